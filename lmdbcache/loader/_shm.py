"""Shared-memory segments for the batches a DataLoader worker sends whole (``lmdbcache.collate``).

A segment is one memfd mapped in the worker: a 64-byte header, then the batch's fields. The worker
sends it as a duplicate of its file descriptor (``multiprocessing.reduction.DupFd``, as torch's own
file-descriptor sharing does); the receiver maps it and builds the batch's tensors on that mapping.

Why reuse, and how it stays safe. A fresh segment per batch costs a page fault, a page allocation
and zeroing per 4 KiB page in the worker (a 3x224x224 batch of 64 is 2,352 pages: several
milliseconds, more than the copy itself), as torch's fresh shared memory per batch does. So a
worker keeps its segments and fills one again, but only when nothing can still read its last batch:

- in the worker, no tensor or array of it is alive (``Buffers.unused``: reference counts);
- in the receiver, the batch it rebuilt is dead. The header holds ``sent``, the use number the
  worker wrote when it pickled the batch, ``released``, the use number the receiver writes when
  the last of its batch is freed, and ``retired``. "The last" is counted by a ``_Lease``: every field
  tensor the receiver hands out and every array under a field's storage (``torch.from_numpy``) is
  a holder, finalized by ``weakref.finalize``; a numpy array taken with ``.numpy()`` holds its
  tensor, so it keeps the segment even after ``share_memory_()`` moved the tensor's storage away.
  The worker reuses a segment only when ``released == sent`` and it is not retired.

Retired for good: a segment whose batch was pickled twice (two readers could not both be counted
by one ``released``), and every segment with a live batch in a process that forks (the child's copy
of the mapping is the same shared memory, and the child's holders are not counted: ``_at_fork``).
A batch never unpickled (a DataLoader shut down with batches in flight) keeps its segment out of
use; the pool then allocates fresh ones, as without reuse.

Each field has its own storage (as ``default_collate``'s do): pickling or ``torch.save`` of one field
carries that field, and the header is in none of them.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["HEADER", "Segment", "in_segment", "on_fork", "receive"]

HEADER = 64  # bytes before the first field: sent, released, retired (u64 each), then padding to keep fields aligned
_COUNTS = struct.Struct("<QQQ")


class Segment:
    """One shared-memory segment (a memfd) mapped here.

    The file descriptor stays open while this object lives, so a batch on it can be sent again; the
    mapping lives while any array, tensor or view of it does, here or in the process that mapped the
    descriptor it got.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.uses = 0  # the number of the batch being filled or last filled (the header's ``sent`` once sent)
        self.retired = False  # sent twice, or this process forked: never filled again
        self.fd = -1
        fd = os.memfd_create("lmdbcache-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
            self.address = np.frombuffer(self.map, np.uint8, 1).__array_interface__["data"][0]
        except BaseException:
            os.close(fd)  # once: __del__ of this half-built object must not close the number again
            raise
        self.fd = fd

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)

    def released(self) -> bool:
        """True when the reader of its last sent batch (if any) has dropped every tensor of it."""
        sent, released, retired = _COUNTS.unpack_from(self.map, 0)
        return not self.retired and not retired and sent == released

    def sending(self, use: int) -> None:
        """Batch ``use`` is being pickled: from now on the segment waits for its reader's release."""
        sent, _, _ = _COUNTS.unpack_from(self.map, 0)
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


class _Lease:
    """A received segment while anything of its batch is alive in this process (see the module docstring)."""

    def __init__(self, segment: mmap.mmap, use: int) -> None:
        self.segment, self.use, self.pid, self.holders = segment, use, os.getpid(), 0
        self.lock = threading.Lock()  # finalizers run on whichever thread drops the last reference

    def hold(self, holder: Any) -> None:
        with self.lock:
            self.holders += 1
        weakref.finalize(holder, self._drop)

    def _drop(self) -> None:
        with self.lock:
            self.holders -= 1
            last = self.holders == 0
        if last and os.getpid() == self.pid:  # a forked child's copy dying is not the reader's release
            struct.pack_into("<Q", self.segment, 8, self.use)

    def retire(self) -> None:
        struct.pack_into("<Q", self.segment, 16, 1)


_leases: weakref.WeakSet[_Lease] = weakref.WeakSet()


def _at_fork() -> None:
    """Before this process forks: no segment with a batch alive here is filled again (the child shares it)."""
    for lease in list(_leases):
        if lease.holders:
            lease.retire()
    for hook in _fork_hooks:
        hook()


_fork_hooks: list[Any] = []


def on_fork(hook: Any) -> None:
    """Call ``hook()`` before this process forks (the sender's pool retires its segments: ``_collate``)."""
    _fork_hooks.append(hook)


os.register_at_fork(before=_at_fork)


def receive(
    fd: int, size: int, use: int, fields: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]
) -> list[torch.Tensor]:
    """The field tensors of a sent batch, each on its own storage in the segment mapped here (``fd`` is closed).

    ``fields``: (torch dtype, shape, stride, byte offset in the segment) per field.
    """
    try:
        segment = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    lease, out = _Lease(segment, use), []
    for dtype, shape, stride, at in fields:
        extent = 0 if 0 in shape else (sum((n - 1) * k for n, k in zip(shape, stride)) + 1) * dtype.itemsize
        if not HEADER <= at <= size - extent:
            raise ValueError(f"a batch field of {extent} bytes at {at} lies outside its {size}-byte segment")
        raw = np.frombuffer(segment, np.uint8, extent, at)
        field = torch.empty(0, dtype=dtype).set_(torch.from_numpy(raw).untyped_storage(), 0, shape, stride)
        lease.hold(raw)
        lease.hold(field)
        out.append(field)
    _leases.add(lease)
    return out
