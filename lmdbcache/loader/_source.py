"""What a ``Loader`` reads: a ``CachedDataset``, or torch ``Subset`` / ``ConcatDataset`` wrappers of them (nested in
any way), mapped onto the caches underneath so that batches are still copied straight out of their maps.

``source_of`` returns a plain ``CachedDataset`` as it is (nothing changes on its path) and a wrapper as a
``Mapped``: the wrapper's items as a pass asks for them (length, ``transform``, ``__getitems__`` and
``__getitem__`` through the wrapper itself, so the fallback and the per-sample transform give exactly its
samples), plus ``split``: a batch of the wrapper's indices as one ``Part`` per cache it touches, each with the
cache's own indices (the ones its values' checksums are bound to) and the rows of the batch they fill. The
index tables are built once, when the Loader is created (12 bytes per index). A pass copies a part as it
copies a batch of a plain cache (the compiled core, ``augment=``); a batch that spans several caches is put
together from their parts (``merge``: one copy more). Under ``augment=`` the crop and flip of a sample depend
on (seed, epoch, its index in its cache), the seed mixed with the cache's position among the wrapper's caches
from the second on: a Subset of one cache crops each image as a Loader over the cache does, and two caches
concatenated do not crop their i-th images alike.

Anything else under a wrapper (a dataset that is not a ``CachedDataset``, another wrapper class) is refused
when the Loader is created, with the path to it and the way out.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset

from ..dataset import CachedDataset
from ..errors import InvalidOptionError

if TYPE_CHECKING:
    from ._fused import Fused

__all__ = ["Mapped", "Part", "assemble", "merge", "source_of"]

_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


class Part(NamedTuple):
    """The indices of one cache that a batch holds: ``ds[indices[j]]`` is row ``rows[j]`` (None: rows 0..n-1)."""

    ds: CachedDataset
    indices: list[int]
    rows: list[int] | None
    seed: int  # the Loader's seed for this cache (see the module docstring)


def part_seed(seed: int, k: int) -> int:
    """The augmentation seed of the ``k``-th cache under a wrapper: the Loader's own for the first."""
    return seed if k == 0 else (seed + k * _GOLDEN) & _M64


def source_of(dataset: Any) -> CachedDataset | Mapped:
    """``dataset`` itself if it is a ``CachedDataset``; a ``Mapped`` of a Subset / ConcatDataset of them."""
    if isinstance(dataset, CachedDataset):
        return dataset
    if isinstance(dataset, (Subset, ConcatDataset)):
        return Mapped(dataset)
    raise InvalidOptionError(
        f"lmdbcache.Loader reads a CachedDataset, or a torch Subset or ConcatDataset of CachedDatasets (nested in "
        f"any way), not a {type(dataset).__name__}. Wrap the dataset in CachedDataset, or give this one to a torch "
        "DataLoader."
    )


def _tables(dataset: Any, where: str, leaves: list[CachedDataset]) -> tuple[np.ndarray, np.ndarray]:
    """For each index of ``dataset``: which of ``leaves`` (appended here) holds it, and its index there."""
    if isinstance(dataset, CachedDataset):
        leaves.append(dataset)
        n = len(dataset)
        return np.full(n, len(leaves) - 1, np.int32), np.arange(n, dtype=np.int64)
    if isinstance(dataset, Subset):
        leaf, inner = _tables(dataset.dataset, where + ".dataset", leaves)
        try:
            indices = np.asarray(dataset.indices)
            indices = indices if indices.size else indices.astype(np.int64)  # [] is float64 to numpy: empty is fine
            picked = indices.astype(np.int64, casting="same_kind").reshape(-1)
        except (TypeError, ValueError):
            raise InvalidOptionError(f"lmdbcache.Loader: {where}.indices must be integers.") from None
        n = len(inner)
        bad = np.flatnonzero((picked < -n) | (picked >= n))
        if len(bad):
            raise InvalidOptionError(
                f"lmdbcache.Loader: {where}.indices[{bad[0]}] is {picked[bad[0]]}, out of range for its dataset of "
                f"length {n}. Make the Subset's indices lie in [0, {n})."
            )
        picked = np.where(picked < 0, picked + n, picked)  # as Subset's ``dataset[indices[i]]`` reads them
        return leaf[picked], inner[picked]
    if isinstance(dataset, ConcatDataset):
        parts = [_tables(d, f"{where}.datasets[{k}]", leaves) for k, d in enumerate(dataset.datasets)]
        if not parts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    raise InvalidOptionError(
        f"lmdbcache.Loader: {where} is a {type(dataset).__name__}; under a Subset or ConcatDataset the Loader reads "
        "CachedDatasets only (its batches are copied out of their caches). Wrap it in CachedDataset, or give the "
        "whole dataset to a torch DataLoader."
    )


class Mapped(Dataset[Any]):
    """A Subset / ConcatDataset of ``CachedDataset``s as a pass reads it (see the module docstring).

    Pickles as the wrapper itself: a worker process (``num_workers``) needs only its items.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.leaves: list[CachedDataset] = []
        leaf, self.inner = _tables(dataset, "the dataset", self.leaves)
        self.leaf = None if len(self.leaves) == 1 else leaf  # one cache: every index is in it
        if len(self.inner) != len(dataset):
            raise InvalidOptionError(
                f"lmdbcache.Loader: the dataset says it holds {len(dataset)} samples, but its caches hold "
                f"{len(self.inner)} under it."
            )
        transforms = [d.transform for d in self.leaves if d.transform is not None]
        # A cache with a per-sample transform sends every batch through the wrapper's items (the fallback).
        self.transform = transforms[0] if transforms else None

    def __reduce__(self) -> tuple[Any, ...]:
        return _itself, (self.dataset,)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)  # Subset's: its cache's one read transaction
        if getitems is not None:
            return getitems(list(indices))  # type: ignore[no-any-return]
        return [self.dataset[i] for i in indices]

    def checked_indices(self, indices: Sequence[Any]) -> list[int]:
        """``indices`` as ints in range, numpy and negative ones resolved; IndexError naming one out of range."""
        n = len(self.inner)
        out = []
        for i in indices:
            if type(i) is not int or not 0 <= i < n:
                try:
                    j = operator.index(i)
                except TypeError:
                    raise TypeError(f"Dataset indices must be integers, not {type(i).__name__}") from None
                i = j + n if j < 0 else j
                if not 0 <= i < n:
                    raise IndexError(f"index {j} is out of range for a dataset of length {n}")
            out.append(i)
        return out

    def split(self, indices: list[int], seed: int) -> list[Part]:
        """The batch of (checked) ``indices`` as the parts of the caches it touches, in the caches' order."""
        inner = self.inner[indices]
        if self.leaf is None:
            return [Part(self.leaves[0], inner.tolist(), None, seed)]
        leaf = self.leaf[indices]
        first = int(leaf[0])
        if (leaf == first).all():
            return [Part(self.leaves[first], inner.tolist(), None, part_seed(seed, first))]
        parts = []
        for k in np.unique(leaf).tolist():
            rows = np.flatnonzero(leaf == k)
            parts.append(Part(self.leaves[k], inner[rows].tolist(), rows.tolist(), part_seed(seed, k)))
        return parts


def _itself(dataset: Any) -> Any:
    return dataset


def assemble(parts: list[Part], batches: list[Any], n: int, pin: bool, fused: Fused | None, epoch: int) -> Any:
    """The batch of ``n`` rows from its ``parts``' ``batches`` (``merge``); under ``augment=`` (``fused``), when they
    do not merge (samples of another form), the parts' samples augmented on the torch path, then collated."""
    rows = [part.rows or list(range(len(part.indices))) for part in parts]
    merged = merge(batches, rows, n, pin)
    if merged is not None or fused is None:
        return merged
    samples: list[Any] = [None] * n
    for part, where in zip(parts, rows):
        got, field = fused.samples(part.ds, (part.seed, epoch), part.indices)
        for row, sample in zip(where, got):
            samples[row] = sample
    return fused.collated(samples, field)


def merge(batches: list[Any], rows: list[list[int]], n: int, pin: bool = False) -> Any:
    """One batch of ``n`` rows from the parts' ``batches`` (row ``rows[p][j]`` is row ``j`` of ``batches[p]``):
    tensors (channels-last kept) in lists, tuples and dicts, as the parts have them. None when they are not of one
    form (another structure, dtype or shape, or leaves that are not tensors): the caller then builds the batch
    from its samples."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0 or any(
            not isinstance(b, torch.Tensor) or b.dtype != first.dtype or b.shape[1:] != first.shape[1:] for b in batches
        ):
            return None
        shape = tuple(first.shape[1:])
        if first.dim() == 4 and not first.is_contiguous() and first.is_contiguous(memory_format=torch.channels_last):
            c, h, w = shape
            out = torch.empty((n, h, w, c), dtype=first.dtype, pin_memory=pin).permute(0, 3, 1, 2)
        else:
            out = torch.empty((n, *shape), dtype=first.dtype, pin_memory=pin)
        for batch, where in zip(batches, rows):
            lo = where[0]
            if where[-1] - lo == len(where) - 1:  # consecutive rows (a batch across a ConcatDataset's border)
                out[lo : lo + len(where)] = batch
            else:
                out[torch.tensor(where)] = batch
        return out
    if isinstance(first, dict):
        if any(type(b) is not type(first) or b.keys() != first.keys() for b in batches):
            return None
        merged = {key: merge([b[key] for b in batches], rows, n, pin) for key in first}
        return None if any(v is None for v in merged.values()) else merged
    if isinstance(first, (list, tuple)):
        if any(type(b) is not type(first) or len(b) != len(first) for b in batches):
            return None
        items = [merge([b[k] for b in batches], rows, n, pin) for k in range(len(first))]
        if any(item is None for item in items):
            return None
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return None
