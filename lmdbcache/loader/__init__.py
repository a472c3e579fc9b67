"""Batches: ``Loader`` (``_loader``) and ``collate``, copied from the map into batch tensors.

A pass runs on threads (``_pass``) or on worker processes (``_workers``); both are handed a
small spec of what they need (``_pass.PassSpec``), never the Loader itself. ``_gather`` copies
flat values straight from the map into preallocated batch tensors; ``_collate`` is the
DataLoader-side ``collate_fn`` that receives such batches from ``CachedDataset.__getitems__``, built
in a worker's shared-memory segments (``_shm``: one file descriptor per batch, reused once released).

May import: ``dataset``, ``store``, ``format`` and the base modules. Never ``tools``.
"""

from __future__ import annotations

from ._collate import collate
from ._loader import Loader

__all__ = ["Loader", "collate"]
