"""Shared-memory segments for the batches a DataLoader worker sends whole (``lmdbcache.collate``).

A segment is one memfd mapped in the worker: a 64-byte header, then the batch's fields. The worker
sends it as a duplicate of its file descriptor (``multiprocessing.reduction.DupFd``, as torch's own
file-descriptor sharing does); the receiver maps it and builds the batch's tensors on that mapping.

Why reuse, and how it stays safe. A fresh segment per batch costs a page fault, a page allocation
and zeroing per 4 KiB page in the worker (a 3x224x224 batch of 64 is 2,352 pages: several
milliseconds, more than the copy itself), as torch's fresh shared memory per batch does. So a
worker keeps its segments and fills one again, but only when nothing can still read its last batch:

- in the worker, no tensor or array of it is alive (``Buffers.unused``: reference counts);
- in the receiver, the batch it rebuilt is dead. The header holds two counters: ``sent``, the use
  number the worker wrote when it pickled the batch, and ``released``, the use number the receiver
  writes into the shared header when the last tensor, view or storage of its batch is freed
  (``weakref.finalize`` on the array every tensor of it holds, through ``torch.from_numpy``). The
  worker reuses a segment only when ``released == sent``.

A batch pickled twice (sent to two readers) retires its segment: two readers could not both be
counted by one ``released``. A batch never unpickled (a DataLoader shut down with batches in flight)
keeps its segment out of use; the pool then allocates fresh ones, as without reuse.
"""

from __future__ import annotations

import mmap
import os
import struct
import weakref
from typing import Any

import numpy as np

__all__ = ["HEADER", "Segment", "in_segment", "receive"]

HEADER = 64  # bytes before the first field: sent (u64), released (u64), then padding to keep fields aligned
_COUNTS = struct.Struct("<QQ")


class Segment:
    """One shared-memory segment (a memfd) mapped here.

    The file descriptor stays open while this object lives, so a batch on it can be sent again; the
    mapping lives while any array, tensor or view of it does, here or in the process that mapped the
    descriptor it got.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.uses = 0  # the number of the batch being filled or last filled (the header's ``sent`` once sent)
        self.retired = False  # sent twice: never filled again
        self.fd = os.memfd_create("lmdbcache-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
            self.address = np.frombuffer(self.map, np.uint8, 1).__array_interface__["data"][0]
        except BaseException:
            os.close(self.fd)
            raise

    def __del__(self) -> None:
        os.close(self.fd)

    def released(self) -> bool:
        """True when the reader of its last sent batch (if any) has dropped every tensor of it."""
        sent, released = _COUNTS.unpack_from(self.map, 0)
        return not self.retired and sent == released

    def sending(self, use: int) -> None:
        """Batch ``use`` is being pickled: from now on the segment waits for its reader's release."""
        sent, _ = _COUNTS.unpack_from(self.map, 0)
        if sent >= use:  # pickled before: a second reader (see the module docstring)
            self.retired = True
        struct.pack_into("<Q", self.map, 0, use)


def in_segment(specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> tuple[Segment | None, list[np.ndarray]]:
    """Uninitialized arrays of these shapes and dtypes, 64-byte aligned in one new shared-memory segment.

    Without ``os.memfd_create`` (not Linux): plain arrays and no segment; torch's pickler then copies
    each field into its own shared memory when a worker sends the batch (one copy more).
    """
    if not hasattr(os, "memfd_create"):
        return None, [np.empty(shape, dtype) for shape, dtype in specs]
    offsets, end = [], HEADER
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-int(np.prod(shape)) * dtype.itemsize // 64) * 64
    segment = Segment(end)
    arrays = [np.frombuffer(segment.map, dtype, int(np.prod(shape)), offset).reshape(shape)
              for (shape, dtype), offset in zip(specs, offsets)]  # fmt: skip
    return segment, arrays


def _release(segment: mmap.mmap, use: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child's copy of the batch dying is not the reader's release
        struct.pack_into("<Q", segment, 8, use)


def receive(fd: int, size: int, use: int) -> np.ndarray:
    """The bytes of a sent segment, mapped here (``fd`` is closed); its header tells the sender when they die."""
    try:
        segment = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    whole = np.frombuffer(segment, np.uint8)
    weakref.finalize(whole, _release, segment, use, os.getpid())
    return whole
