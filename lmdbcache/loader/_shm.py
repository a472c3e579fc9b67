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
  a holder, finalized by ``weakref.finalize``. A storage moved away (``share_memory_()``, a torch
  Queue) lets go of its array while its field lives: a numpy array taken before (its ``.base`` is
  an alias tensor, held by nothing counted here) still points into the segment, so that segment is
  retired and never unmapped (``_Lease._drop``). The worker reuses a segment only when
  ``released == sent`` and it is not retired.

Retired for good: a segment whose batch was pickled twice (two readers could not both be counted
by one ``released``), and every segment with a live batch in a process that forks (the child's copy
of the mapping is the same shared memory, and the child's holders are not counted: ``_at_fork``).
A batch never unpickled (a DataLoader shut down with batches in flight) keeps its segment out of
use; the pool then allocates fresh ones, as without reuse.

Each field has its own storage (as ``default_collate``'s do): pickling or ``torch.save`` of one field
carries that field, and the header is in none of them.

Mapped once by the reader. The reader keeps the mapping of every segment it received (``_kept``, by
a random token in the header) and builds each later batch in that segment on it: mapping each batch
anew made the consumer's first touch fault every page in again (6.4 ms per 9.6 MB here, against
1.2 ms to map it once with ``MAP_POPULATE``). It writes its pid into the header (``_READER``), and a
worker whose parent that is sends later batches by token alone: fetching a duplicated descriptor
is a connection to the worker's resource-sharer thread, which waits for the worker's GIL (0.1 to
3 ms a batch on two busy cores). The reader forgets a segment only once no process owns it (below),
so a batch sent by token always finds its mapping; one unpickled elsewhere opens the sender's
descriptor through ``/proc/<pid>/fd`` (checked by size and token) or raises a clear error.

Kept across worker generations. A DataLoader without ``persistent_workers`` forks new workers every
epoch, and a new worker's fresh segments paid their page allocation again (about 9 ms per 9.6 MB
batch here, against 0.7 ms to fill a reused one). So the reader also keeps a descriptor of each
segment (its own open file description, reopened through ``/proc/self/fd``), and a worker forked
from it inherits them and adopts one of the right size instead of allocating. Ownership is an
exclusive ``flock`` on the owner's own open file description, held for the segment's life: a
segment can be adopted only once its owner has exited (the kernel drops the lock with the process),
by one worker (the others' ``LOCK_NB`` fails), and only when released and not retired. The reader
forgets a segment not received in ``KEEP_RECEIVES`` batches once no process owns it (it takes the
lock itself while it clears ``_READER``): a new generation adopts within its first few batches, and
spawned workers never adopt, so unowned segments are not kept long. Each kept segment holds two
descriptors (Python's mmap keeps a duplicate); what is kept after the last DataLoader ends (up to
``KEEP_RECEIVES`` segments, a pool's worth per worker) is freed at exit.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["HEADER", "Segment", "in_segment", "on_fork", "receive", "receive_by_token"]

HEADER = 64  # bytes before the first field: sent, released, retired, token (u64 each), padding to keep fields aligned
_COUNTS = struct.Struct("<QQQ")
_TOKEN = 24  # a random number naming the segment for the reader's ``_kept``, the same in every process
_READER = 32  # the pid of the process that keeps it mapped (``_Kept``): batches to it are sent by token alone


class Segment:
    """One shared-memory segment (a memfd) mapped here.

    The file descriptor stays open while this object lives, so a batch on it can be sent again; the
    mapping lives while any array, tensor or view of it does, here or in the process that mapped the
    descriptor it got.
    """

    def __init__(self, size: int, adopted: int = -1) -> None:
        """A new segment of ``size`` bytes, or (``adopted``) the one behind that locked descriptor (``_adopt``)."""
        self.size = size
        self.uses = 0  # the number of the batch being filled or last filled (the header's ``sent`` once sent)
        self.retired = False  # sent twice, or this process forked: never filled again
        self.fd = -1
        fd = os.memfd_create("lmdbcache-batch", os.MFD_CLOEXEC) if adopted < 0 else adopted
        try:
            if adopted < 0:
                os.ftruncate(fd, size)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # owned while this process holds it
            self.map = mmap.mmap(fd, size, flags=_POPULATE)
            self.address = np.frombuffer(self.map, np.uint8, 1).__array_interface__["data"][0]
        except BaseException:
            os.close(fd)  # once: __del__ of this half-built object must not close the number again
            raise
        self.fd = fd
        if adopted < 0:
            self.map[_TOKEN : _TOKEN + 8] = os.urandom(8)
        else:
            self.uses = _COUNTS.unpack_from(self.map, 0)[0]  # go on from the last use number sent

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)

    def released(self) -> bool:
        """True when the reader of its last sent batch (if any) has dropped every tensor of it."""
        sent, released, retired = _COUNTS.unpack_from(self.map, 0)
        return not self.retired and not retired and sent == released

    def token(self) -> bytes:
        return bytes(self.map[_TOKEN : _TOKEN + 8])

    def mapped_by(self) -> int:
        """The pid of the process that keeps this segment mapped (0: none), so needs no descriptor sent."""
        return int(struct.unpack_from("<Q", self.map, _READER)[0])

    def sending(self, use: int) -> None:
        """Batch ``use`` is being pickled: from now on the segment waits for its reader's release."""
        sent, _, _ = _COUNTS.unpack_from(self.map, 0)
        if sent >= use:  # pickled before: a second reader (see the module docstring)
            self.retired = True
        struct.pack_into("<Q", self.map, 0, use)


def in_segment(specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> tuple[Segment | None, list[np.ndarray]]:
    """Uninitialized arrays of these shapes and dtypes, 64-byte aligned in one shared-memory segment (new or adopted).

    Without ``os.memfd_create`` (not Linux): plain arrays and no segment; torch's pickler then copies
    each field into its own shared memory when a worker sends the batch (one copy more).
    """
    if not hasattr(os, "memfd_create"):
        return None, [np.empty(shape, dtype) for shape, dtype in specs]
    offsets, end = [], HEADER
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-int(np.prod(shape)) * dtype.itemsize // 64) * 64
    segment = _adopt(end) or Segment(end)
    arrays = [np.frombuffer(segment.map, dtype, int(np.prod(shape)), offset).reshape(shape)
              for (shape, dtype), offset in zip(specs, offsets)]  # fmt: skip
    return segment, arrays


class _Lease:
    """A received segment while anything of its batch is alive in this process (see the module docstring)."""

    def __init__(self, segment: mmap.mmap, use: int) -> None:
        self.segment, self.use, self.pid, self.holders = segment, use, os.getpid(), 0
        self.lock = threading.Lock()  # finalizers run on whichever thread drops the last reference

    def hold(self, holder: Any, field: Any = None) -> None:
        """Count ``holder`` until it dies; ``field``: the tensor whose storage holds ``holder`` (an array)."""
        with self.lock:
            self.holders += 1
        weakref.finalize(holder, self._drop, None if field is None else weakref.ref(field))

    def _drop(self, field: Any) -> None:
        if field is not None and field() is not None:
            # The storage let go of its array while the field lives: moved (share_memory_(), a torch
            # Queue) or replaced. A numpy array of a view taken before still points here, and nothing
            # says when it dies: never filled again, never unmapped (a leak, only for batches moved so).
            self.retire()
            _moved.append(self.segment)
        with self.lock:
            self.holders -= 1
            last = self.holders == 0
        if last and os.getpid() == self.pid:  # a forked child's copy dying is not the reader's release
            struct.pack_into("<Q", self.segment, 8, self.use)

    def retire(self) -> None:
        struct.pack_into("<Q", self.segment, 16, 1)


_leases: weakref.WeakSet[_Lease] = weakref.WeakSet()
_moved: list[mmap.mmap] = []  # mappings of batches whose storage moved under a live field (``_Lease._drop``)


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


# The segments this process received, by token (a reader keeps them: see the module docstring)
_kept: dict[bytes, _Kept] = {}
_kept_lock = threading.Lock()
_receipts = 0
KEEP_RECEIVES = 16  # unowned and not received again in this many batches: forgotten (a pool cycles in fewer)
_POPULATE = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # all pages at once: one call, not a fault per page


class _Kept:
    """A received segment: its mapping here, reused by every later batch in it, and a descriptor for adoption."""

    __slots__ = ("fd", "map", "seen", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.size, self.seen = size, 0
        # Mapped through a description of our own: the sender's (dup'd to us) carries its ownership lock,
        # and a mapping holds its description open, so mapping that one would keep the lock after the sender exits.
        try:
            self.fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            self.fd = -1  # no /proc: mapped, but never adopted (later workers allocate their own)
        try:
            self.map = mmap.mmap(fd if self.fd < 0 else self.fd, size, flags=_POPULATE)
        except BaseException:
            self.forget()
            raise
        if self.fd >= 0:  # kept until its owner is gone (``stale``): later batches may come by token alone
            struct.pack_into("<Q", self.map, _READER, os.getpid())

    def stale(self) -> bool:
        """Forgettable: no process owns it (so none sends it); it then stops announcing its mapping here."""
        if self.fd < 0:
            return True  # never announced: every batch in it comes with its descriptor
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while the reset below happens: no adopter
        except OSError:
            return False  # its owner lives and may send it by token at any time
        struct.pack_into("<Q", self.map, _READER, 0)
        return True

    def forget(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the lock ``stale`` took; the mapping lives on while a batch on it does
            self.fd = -1


def _mapping(fd: int, size: int) -> mmap.mmap:
    """The received segment behind ``fd`` mapped here, the mapping of its earlier batches if any (closes ``fd``)."""
    try:
        token = os.pread(fd, 8, _TOKEN)
        with _kept_lock:
            kept = _kept.get(token)
            if kept is None or kept.size != size:
                if kept is not None:
                    kept.forget()
                kept = _kept[token] = _Kept(fd, size)
            return _seen(kept)
    finally:
        os.close(fd)


def _seen(kept: _Kept) -> mmap.mmap:
    """Count a receipt of ``kept`` (under ``_kept_lock``), forgetting the segments long unseen and unowned."""
    global _receipts
    _receipts += 1
    kept.seen = _receipts
    for token, old in list(_kept.items()):
        if old.seen < _receipts - KEEP_RECEIVES and old.stale():
            del _kept[token]
            old.forget()
    return kept.map


def _mapped(token: bytes, size: int, pid: int, fd: int) -> mmap.mmap:
    """The segment a batch sent by token alone lies in: kept here (it announced so), else opened from its sender."""
    with _kept_lock:
        kept = _kept.get(token)
        if kept is not None and kept.size == size:
            return _seen(kept)
    try:  # not this process that announced it (a batch handed on): the sender's descriptor, checked to be that one
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RuntimeError(
            f"lmdbcache.collate: a batch from process {pid} lies in a shared-memory segment this process "
            f"({os.getpid()}) never mapped, and it cannot be opened ({exc}). Unpickle Collated batches only in the "
            "process that runs the DataLoader's workers, or use torch's default collate_fn."
        ) from None
    if os.fstat(own).st_size != size or os.pread(own, 8, _TOKEN) != token:
        os.close(own)
        raise RuntimeError(f"lmdbcache.collate: the shared-memory segment of a batch from process {pid} is gone")
    return _mapping(own, size)


def _adopt(size: int) -> Segment | None:
    """A segment of ``size`` bytes inherited from the reader that forked this process, owned by no live process."""
    with _kept_lock:
        for token, kept in list(_kept.items()):
            if kept.size != size or kept.fd < 0:
                continue
            try:
                fd = os.open(f"/proc/self/fd/{kept.fd}", os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its owner (or a sibling) lives
            except OSError:
                os.close(fd)
                continue
            segment = Segment(size, fd)
            if segment.released():  # its last batch is dead in the reader, and it was never retired
                _kept.pop(token).forget()  # here only: the reader sees it again under the same token
                return segment
            del segment  # closes the descriptor, dropping the lock
    return None


def _after_fork_in_child() -> None:
    global _kept_lock
    _kept_lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(before=_at_fork, after_in_child=_after_fork_in_child)


def receive(
    fd: int, size: int, use: int, fields: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]
) -> list[torch.Tensor]:
    """The field tensors of a sent batch, each on its own storage in the segment mapped here (``fd`` is closed).

    ``fields``: (torch dtype, shape, stride, byte offset in the segment) per field.
    """
    return _fields(_mapping(fd, size), size, use, fields)


def receive_by_token(token: bytes, size: int, use: int, fields: list[Any], pid: int, fd: int) -> list[torch.Tensor]:
    """``receive`` for a batch sent without a descriptor: its segment is kept mapped here (``_READER``)."""
    return _fields(_mapped(token, size, pid, fd), size, use, fields)


def _fields(
    segment: mmap.mmap, size: int, use: int, fields: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]
) -> list[torch.Tensor]:
    lease, out = _Lease(segment, use), []
    for dtype, shape, stride, at in fields:
        extent = 0 if 0 in shape else (sum((n - 1) * k for n, k in zip(shape, stride)) + 1) * dtype.itemsize
        if not HEADER <= at <= size - extent:
            raise ValueError(f"a batch field of {extent} bytes at {at} lies outside its {size}-byte segment")
        raw = np.frombuffer(segment, np.uint8, extent, at)
        field = torch.empty(0, dtype=dtype).set_(torch.from_numpy(raw).untyped_storage(), 0, shape, stride)
        lease.hold(raw, field)
        lease.hold(field)
        out.append(field)
    _leases.add(lease)
    return out
