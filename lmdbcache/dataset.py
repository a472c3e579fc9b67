"""``CachedDataset``: a map-style dataset whose samples come from a shared LMDB cache."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset

from . import _registry
from .codec import decode, encode
from .errors import SampleNotCachedError
from .store import MISSING, Store

__all__ = ["CachedDataset", "default_fingerprint"]


def default_fingerprint(dataset: Any) -> str:
    """``Class:length`` of the wrapped dataset. Pass ``fingerprint=`` for anything stronger.

    The module is left out on purpose: the same class imported as ``scripts.data`` by a
    training script and as ``data`` by ``lmdbcache precompute scripts/data.py:make`` must
    open the same cache.
    """
    return f"{type(dataset).__qualname__}:{len(dataset)}"


class CachedDataset(Dataset):
    """Wrap a map-style dataset so each sample is decoded once, ever, and then shared.

    The first read of index ``i`` calls ``dataset[i]``, stores the sample in the LMDB
    cache at ``path`` and returns it; every later read, from this or any other process
    (DataLoader workers, other training runs, later runs), comes out of LMDB's memory map.
    A miss returns exactly what later hits return.

    Args:
        dataset: the map-style dataset to cache, or None to serve an existing cache alone
            (see ``CachedDataset.open``).
        path: the cache directory (created if missing).
        transform: called on every sample after it is read, never cached: random
            augmentation goes here and is fresh every epoch.
        fingerprint: a string identifying the dataset's content; reopening the cache with
            a different one raises ``CacheMismatchError``. Default: class name and length.
        map_size: initial LMDB map size in bytes; it grows automatically.
        max_readers: LMDB reader slots (concurrent read transactions across processes).
            Fixed by the first process to open the cache.
        overwrite: empty the cache (or replace damaged LMDB files) and rebuild it. Happens
            once, here, never again in DataLoader workers.
        commit_every, commit_bytes, commit_interval: commit queued misses after this many
            samples, bytes or seconds (also on ``flush()``, ``close()`` and at exit).
        checksum: ``"once"`` (default) verifies each value's data checksum the first time
            this process reads it and skips the hash on later reads of that index;
            ``"always"`` verifies every read (about 10% slower on image-sized samples).
            A damaged value raises ``CorruptSampleError`` and is never returned.
    """

    def __init__(
        self,
        dataset: Any,
        path: str | os.PathLike[str],
        *,
        transform: Callable[[Any], Any] | None = None,
        fingerprint: str | None = None,
        map_size: int = 64 << 20,
        max_readers: int = 1024,
        overwrite: bool = False,
        commit_every: int = 256,
        commit_bytes: int = 64 << 20,
        commit_interval: float = 1.0,
        checksum: str = "once",
    ) -> None:
        self.dataset = dataset
        self.path = os.path.abspath(os.fspath(path))
        self.transform = transform
        self._options = dict(
            map_size=map_size,
            max_readers=max_readers,
            commit_every=commit_every,
            commit_bytes=commit_bytes,
            commit_interval=commit_interval,
            checksum=checksum,
        )
        length = None if dataset is None else len(dataset)
        if dataset is not None and fingerprint is None:
            fingerprint = default_fingerprint(dataset)
        store = _registry.acquire(self.path, **self._options)
        try:
            meta = store.initialize(
                length=length, fingerprint=fingerprint, overwrite=overwrite, create=dataset is not None
            )
        except BaseException:
            _registry.release(store)
            raise
        self._store: Store | None = store
        self._length: int = meta["length"]
        self.fingerprint: str = meta["fingerprint"]
        self._cache_id: str = meta["cache_id"]

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, transform: Callable[[Any], Any] | None = None, **options: Any
    ) -> CachedDataset:
        """Serve an existing cache without its source dataset (e.g. on a machine without the raw files).

        A miss (an index the cache does not hold) raises ``SampleNotCachedError``.
        """
        return cls(None, path, transform=transform, **options)

    # ------------------------------------------------------------------ the Dataset protocol

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        if not (type(index) is int and 0 <= index < self._length):
            index = self._index(index)
        store = self._store
        if store is None or store.pid != _registry._pid:
            store = self._attach()
        sample = store.get(index)
        if sample is MISSING:
            sample = self._fill([index], store)[0]
        transform = self.transform
        return sample if transform is None else transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch in one read transaction, misses filled together (the DataLoader calls this)."""
        n = self._length
        indices = [i if type(i) is int and 0 <= i < n else self._index(i) for i in indices]
        store = self._live_store()  # once per batch: __getitem__ inlines this check, per sample
        samples = store.get_many(indices)
        misses = [k for k, sample in enumerate(samples) if sample is MISSING]
        if misses:
            filled = self._fill([indices[k] for k in misses], store)
            for k, sample in zip(misses, filled):
                samples[k] = sample
        transform = self.transform
        return samples if transform is None else [transform(sample) for sample in samples]

    def _index(self, index: Any) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"CachedDataset indices must be integers, not {type(index).__name__}") from None
        n = self._length
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for a dataset of length {n}")
        return i

    def _attach(self) -> Store:
        """This process's store: first use after unpickling (spawn), after a fork, or after close()."""
        store = _registry.acquire(self.path, **self._options)
        if store._cache_id is None:
            store._cache_id = self._cache_id  # so opening checks the cache is still the one we validated
        self._store = store
        return store

    def _fill(self, indices: list[int], store: Store) -> list[Any]:
        """Decode misses from the source (no lock held), queue them, return them as a hit would."""
        source = self.dataset
        if source is None:
            raise SampleNotCachedError(
                f"Index {indices[0]} is not in cache '{self.path}' and there is no source dataset to decode it from. "
                "Build the cache completely first (`lmdbcache precompute`), or pass the source dataset."
            )
        getitems = getattr(source, "__getitems__", None)
        if getitems is not None and len(indices) > 1:
            try:
                raws = list(getitems(indices))
            except Exception as exc:
                _note(exc, f"lmdbcache: raised by the source dataset's __getitems__ for indices {indices}")
                raise
        else:
            raws = []
            for i in indices:
                try:
                    raws.append(source[i])
                except Exception as exc:
                    _note(exc, f"lmdbcache: raised by the source dataset reading index {i} (cache '{self.path}')")
                    raise
        out = []
        for i, raw in zip(indices, raws):
            value = encode(raw, where=f"index {i}")
            store.add(i, value)
            # Decoded from the bytes just stored: exactly what a later hit returns (same types,
            # contiguous, writable). No checksum: these bytes never left this process.
            out.append(decode(value, False))
        return out

    # ------------------------------------------------------------------ the cache

    @property
    def cached_count(self) -> int:
        """Samples committed to the cache (this process's queue is committed first)."""
        return self._live_store().count()

    @property
    def is_complete(self) -> bool:
        """True when every index is cached: the source dataset is no longer needed."""
        return self.cached_count == self._length

    def flush(self) -> int:
        """Commit this process's queued misses now; return how many there were."""
        return self._live_store().flush()

    def close(self) -> None:
        """Commit queued misses and release this process's handle (it reopens if used again)."""
        store, self._store = self._store, None
        if store is not None and store.pid == _registry._pid:
            _registry.release(store)

    def __enter__(self) -> CachedDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _live_store(self) -> Store:
        store = self._store
        if store is None or store.pid != _registry._pid:
            store = self._attach()
        return store

    # ------------------------------------------------------------------ pickling and attributes

    def __getstate__(self) -> dict[str, Any]:
        store = self._store
        if store is not None and store.pid == _registry._pid:
            store.flush()  # pickled for spawn workers: let them see what this process decoded
        state = self.__dict__.copy()
        state["_store"] = None  # configuration only: each process opens its own environment
        return state

    def __getattr__(self, name: str) -> Any:
        # Public attributes of the wrapped dataset (e.g. ``classes``) read through. Private and
        # dunder names never do: a forwarded ``__getitems__`` would let the DataLoader bypass
        # the cache.
        if name.startswith("_"):
            raise AttributeError(name)
        source = self.__dict__.get("dataset")
        if source is None:
            raise AttributeError(f"'CachedDataset' object has no attribute '{name}'")
        return getattr(source, name)

    def __repr__(self) -> str:
        source = "no source" if self.dataset is None else type(self.dataset).__name__
        return f"CachedDataset('{self.path}', {self._length} samples, {source})"


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(text)
