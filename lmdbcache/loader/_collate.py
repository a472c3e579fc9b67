"""``collate``: default_collate for ``DataLoader(CachedDataset)`` that takes batches built in the worker.

    from lmdbcache.loader._collate import collate   # lmdbcache.collate once the package exports it
    DataLoader(ds, 64, num_workers=2, collate_fn=collate)

With ``collate`` as the DataLoader's ``collate_fn``, ``CachedDataset.__getitems__`` (called
by the worker's fetcher just before ``collate_fn``) copies a batch of flat samples straight
from the map into one tensor per field, allocated in shared memory (``_gather``: one copy
per sample, no per-sample tensor), so the worker sends the main process a handle, not
bytes. It returns that batch marked as a ``Collated``; ``collate`` passes it through as
``default_collate``'s output (a list, one tensor per item of the tuple samples). Anything
else (misses, non-flat samples, mixed signatures, a per-sample ``transform``, another
dataset) is a list of samples, handed to ``default_collate``.

Why opt in through the fetcher's ``collate_fn`` rather than always building the batch:
a plain ``DataLoader(ds)`` must get exactly today's samples (independent tensors, its own
collate function, which may not be default_collate), and a batch built for nothing would
cost a copy and a shared-memory segment. ``__getitems__`` therefore builds the batch only
when its caller (torch's ``_MapDatasetFetcher.fetch``) holds a ``collate_fn`` carrying
``lmdbcache_batched = True`` (``collate`` does; a wrapper of it may set it too, and must
then handle a ``Collated``). Should torch's fetcher change shape, the check finds nothing
and every batch takes the default_collate path: slower, never different.
"""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing
from torch.utils.data import default_collate, get_worker_info

from ..dataset import register_batch_hook
from ..store._store import MISSING
from ._gather import Buffers, Layout, layout_of
from ._shm import Segment, on_fork, receive, receive_by_token

if TYPE_CHECKING:
    from ..store._store import Store

__all__ = ["Collated", "collate", "gather_shared", "wants_batch"]


class Collated(list):  # type: ignore[type-arg]
    """A batch already collated by ``CachedDataset.__getitems__``: default_collate's list of field tensors.

    Every field lies in one shared-memory segment (``_shm``). Pickled (a worker sending it to the main
    process), it travels as the segment's token (or, until the main process has it mapped, a
    duplicate of its file descriptor), the batch's use number and each field's dtype, shape, stride
    and byte offset, and is rebuilt as a plain list of tensors on the segment mapped there: at most
    one file descriptor per segment, where torch's pickler sends one per tensor per batch (each a
    connection to the worker's resource sharer). Without a segment, or once a
    ``collate_fn`` wrapping ``collate`` changed the list, it pickles as the plain list it now is.
    """

    __slots__ = ("fields", "originals", "segment", "use")

    def __init__(self, tensors: list[torch.Tensor], segment: Segment | None = None) -> None:
        super().__init__(tensors)
        self.segment, self.originals = segment, tuple(tensors)
        self.use = segment.uses if segment is not None else 0  # the fill of the segment this batch is
        if segment is not None:
            self.fields = [(t.dtype, tuple(t.shape), t.stride(), t.data_ptr() - segment.address) for t in tensors]

    def __reduce__(self) -> Any:
        same = len(self) == len(self.originals) and all(a is b for a, b in zip(self, self.originals))
        if self.segment is None or not same:
            return (list, (list(self),))
        segment = self.segment
        segment.sending(self.use)
        if segment.mapped_by() == os.getppid():  # the DataLoader's process keeps it mapped: no descriptor to fetch
            return (receive_by_token, (segment.token(), segment.size, self.use, self.fields, os.getpid(), segment.fd))
        return (_rebuild, (DupFd(segment.fd), segment.size, self.use, self.fields))


def _rebuild(
    fd: Any, size: int, use: int, fields: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]]
) -> list[Any]:
    """The plain list of field tensors a ``Collated`` stood for, on its segment mapped here."""
    return receive(fd.detach(), size, use, fields)


def collate(batch: Any) -> Any:
    """Drop-in ``collate_fn``: a ``Collated`` batch as it is, anything else through ``default_collate``.

    In a DataLoader worker the ``Collated`` itself is returned (it pickles compactly and
    arrives as a plain list); in the main process (``num_workers=0``) a plain list.
    """
    if type(batch) is Collated:
        return batch if get_worker_info() is not None else list(batch)
    return default_collate(batch)


collate.lmdbcache_batched = True  # type: ignore[attr-defined]  # read by wants_batch


def wants_batch() -> bool:
    """True when the caller of ``__getitems__`` is a DataLoader fetcher whose collate_fn takes a ``Collated``."""
    try:
        fetcher = sys._getframe(2).f_locals.get("self")  # 0: here, 1: __getitems__, 2: the fetcher's fetch
    except (ValueError, AttributeError):  # AttributeError: a Python without sys._getframe (default_collate's path)
        return False
    return bool(getattr(getattr(fetcher, "collate_fn", None), "lmdbcache_batched", False))


# One per process: the batch form of each flat signature met (a worker meets few), and the worker's
# segments, filled again once their last batch is dead everywhere (``_shm``). ``_pool_pid``: a forked
# child starts with none (its parent's segments may be in use by the parent's reader).
_layouts: dict[bytes, Layout] = {}
_pool: list[Buffers] = []
_pool_pid = 0
_pool_lock = threading.Lock()
POOL = 6  # segments kept per process: the DataLoader's prefetch (2 per worker) and the batches being used


def _segment_for(layout: Layout, rows: int) -> Buffers:
    """Buffers in a shared-memory segment for ``rows`` samples of ``layout``: a released one of the pool, or new."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool_pid != os.getpid():
            _pool, _pool_pid = [], os.getpid()
        for buffers in _pool:
            same = buffers.layout is layout and buffers.rows == rows
            if same and buffers.unused() and buffers.segment is not None and buffers.segment.released():
                break
        else:
            # torch's "file_system" strategy is chosen to keep file descriptors few: then torch shares the batch
            strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
            memory = "plain" if strategy == "file_system" else "shared"
            buffers = Buffers(layout, rows, memory)
            # The oldest make room: a segment whose batch the reader keeps (or never got) must not hold a place
            _pool = [b for b in _pool if b.segment is not None and not b.segment.retired and not b.moved][-(POOL - 1) :]
            if buffers.segment is not None:
                _pool.append(buffers)
        if buffers.segment is not None:
            buffers.segment.uses += 1
        buffers.busy = True  # until its batch is built: unused() is then measured against that batch
        return buffers


def _retire_all() -> None:
    """Before a fork: the child shares these segments, so none is filled again (see ``_shm``)."""
    with _pool_lock:
        for buffers in _pool:
            if buffers.segment is not None:
                buffers.segment.retired = True
        _pool.clear()


on_fork(_retire_all)


def _after_fork_in_child() -> None:
    global _pool_lock
    _pool_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def gather_shared(store: Store, indices: list[int], always: bool, build: str | None) -> Collated | None:
    """The batch of ``indices`` copied from the map into shared memory, or None (a miss, or not flat alike)."""
    if not indices:
        return None

    def copy(views: list[Any], checks: list[bool]) -> Any:
        layout = layout_of(views[0], indices[0], _layouts)
        if layout is None:
            return None
        buffers = _segment_for(layout, len(views))
        try:
            if not buffers.fill(views, checks, indices, 0, len(views)):
                return None
            return Collated(buffers.batch(len(views)), buffers.segment)
        finally:
            buffers.busy = False

    batch = store.read_batch(indices, always, build, copy)
    return None if batch is MISSING else batch


register_batch_hook(wants_batch, gather_shared)
