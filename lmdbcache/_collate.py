"""``collate``: default_collate for ``DataLoader(CachedDataset)`` that takes batches built in the worker.

    from lmdbcache._collate import collate   # lmdbcache.collate once the package exports it
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

import sys
from typing import TYPE_CHECKING, Any

from torch.utils.data._utils.collate import default_collate

from ._gather import Buffers, Layout, layout_of
from .store import MISSING

if TYPE_CHECKING:
    from .store import Store

__all__ = ["Collated", "collate", "gather_shared", "wants_batch"]


class Collated(list):  # type: ignore[type-arg]
    """A batch already collated by ``CachedDataset.__getitems__``: default_collate's list of field tensors."""

    __slots__ = ()

    def __reduce__(self) -> Any:  # pickled as the plain list it stands for
        return (list, (list(self),))


def collate(batch: Any) -> Any:
    """Drop-in ``collate_fn``: a ``Collated`` batch as it is, anything else through ``default_collate``."""
    if type(batch) is Collated:
        return list(batch)
    return default_collate(batch)  # type: ignore[no-untyped-call]


collate.lmdbcache_batched = True  # type: ignore[attr-defined]  # read by wants_batch


def wants_batch() -> bool:
    """True when the caller of ``__getitems__`` is a DataLoader fetcher whose collate_fn takes a ``Collated``."""
    try:
        fetcher = sys._getframe(2).f_locals.get("self")  # 0: here, 1: __getitems__, 2: the fetcher's fetch
    except ValueError:
        return False
    return bool(getattr(getattr(fetcher, "collate_fn", None), "lmdbcache_batched", False))


# One per process: the batch form of each flat signature met (a worker meets few).
_layouts: dict[bytes, Layout] = {}


def gather_shared(store: Store, indices: list[int], always: bool, build: str | None) -> Collated | None:
    """The batch of ``indices`` copied from the map into shared memory, or None (a miss, or not flat alike)."""
    if not indices:
        return None

    def copy(views: list[Any], checks: list[bool]) -> Any:
        layout = layout_of(views[0], indices[0], _layouts)
        if layout is None:
            return None
        buffers = Buffers(layout, len(views), "shared")
        if not buffers.fill(views, checks, indices, 0, len(views)):
            return None
        return buffers.batch(len(views))

    batch = store.read_batch(indices, always, build, copy)
    return None if batch is MISSING or batch is None else Collated(batch)
