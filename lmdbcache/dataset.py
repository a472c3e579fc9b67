"""``CachedDataset``: a map-style dataset whose samples come from a shared LMDB cache."""

from __future__ import annotations

import operator
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from ._options import check_options, parse_size
from .errors import CacheMismatchError, CorruptSampleError, InvalidOptionError, SampleNotCachedError, add_note
from .format._compress import check as check_compression
from .format._diff import first_difference
from .format._encode import encode_miss
from .format.codec import decode, encode
from .store import _registry
from .store._commit import Policy
from .store._native_read import decode_new
from .store._store import MISSING, Store

__all__ = ["CachedDataset", "dataset_length", "default_fingerprint", "register_batch_hook"]

# Set by lmdbcache.loader when it is imported (``lmdbcache.collate`` lives there), so that the
# dataset never imports the loader: (does the DataLoader calling ``__getitems__`` collate with
# ``lmdbcache.collate``?, the batch of indices copied from the map into shared memory or None).
_batch_hooks: list[tuple[Callable[[], bool], Callable[[Store, list[int], bool, str | None], Any]]] = []


def register_batch_hook(
    wants_batch: Callable[[], bool], gather_shared: Callable[[Store, list[int], bool, str | None], Any]
) -> None:
    """Called once by ``lmdbcache.loader``: how ``__getitems__`` hands a whole batch to ``lmdbcache.collate``."""
    _batch_hooks[:] = [(wants_batch, gather_shared)]


def default_fingerprint(dataset: Any) -> str:
    """``Class:length`` of the wrapped dataset, spelled out for PyTorch's generic wrappers.

    ``Subset`` adds a hash of its indices (a train and a val subset of equal length differ),
    ``ConcatDataset`` and ``TensorDataset`` list their parts (tensors by dtype and shape);
    no sample is read. The module is left out on purpose: the same class imported as
    ``scripts.data`` by a training script and as ``data`` by ``lmdbcache precompute
    scripts/data.py:make`` must open the same cache. Pass ``fingerprint=`` for anything
    stronger: the default cannot see a change of preprocessing (the spot check can).
    """
    name = type(dataset).__qualname__
    if isinstance(dataset, Subset):
        indices = np.asarray(dataset.indices, dtype=np.int64)
        digest = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(indices).tobytes())
        return f"{name}({default_fingerprint(dataset.dataset)})[{digest}]:{len(dataset)}"
    if isinstance(dataset, ConcatDataset):
        return f"{name}({', '.join(default_fingerprint(d) for d in dataset.datasets)}):{len(dataset)}"
    if isinstance(dataset, TensorDataset):
        parts = ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in dataset.tensors)
        return f"{name}({parts}):{len(dataset)}"
    return f"{name}:{len(dataset)}"


def dataset_length(dataset: Any) -> int:
    try:
        length = operator.index(type(dataset).__len__(dataset))  # not len(): it hides a negative length
    except (TypeError, AttributeError) as exc:
        raise InvalidOptionError(
            f"The dataset ({type(dataset).__name__}) has no usable length ({exc}); CachedDataset wraps map-style "
            "datasets with __len__ and __getitem__."
        ) from None
    if length < 0:
        raise InvalidOptionError(
            f"The dataset ({type(dataset).__name__}) reports length {length}; a length must be >= 0. Fix its __len__."
        )
    return length


class CachedDataset(Dataset[Any]):
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
        checksum: what is verified on each read. Every read checks the value's structure
            (types, dtypes, shapes, lengths) and that it belongs to the index asked for.
            ``"once"`` (default) also verifies the data checksum the first time this process
            reads an index; ``"always"`` on every read (see the README for what it costs).
            A value failing a check raises ``CorruptSampleError`` and is never returned.
        spot_check: when an existing cache is opened with its source, re-decode this many
            random cached indices and compare them with the cache; a difference (changed
            preprocessing, another subset) raises ``CacheMismatchError``. 0 turns it off.
            Done once, here, never in DataLoader workers.
        compress: ``"lz4"`` or ``"zstd"`` compresses the tensor, array and image buffers of a
            new cache (each of at least 4 KiB, kept compressed only when that saves 5%); the
            setting is stored in the cache, so None (default) opens an existing cache with
            its own and creates an uncompressed one. Needs ``pip install 'lmdbcache[zstd]'``
            (or ``[lz4]``); see the README for what it costs.
        compress_level: the codec's level (lz4: 0, fast, to 12; zstd: -7 to 22, default 3).
        sync: fsync every commit. Default False: commits reach the disk when the kernel
            writes them back and at ``close()``; a killed process loses nothing committed,
            and a cache left unsynced by a machine crash is rebuilt when next opened (see
            the README's Durability).
        pack: store the values of each run of ``pack`` consecutive small samples (under 16 KiB
            each) as one LMDB record once all of them are cached, so samples of a few KiB do
            not each take whole 4 KiB pages (see the README's "Packs"). Fixed by the process
            that creates the cache; 0 (default) stores every sample as its own record.
        freeze_worker_gc: ``gc.freeze()`` in DataLoader workers at their first use of the
            cache, so their collections never copy the parent's pages (see the README's
            memory notes). None (default): only in workers forked while a cache was open,
            where it pays; True: in every DataLoader worker; False: never (the worker's
            heap, the user's objects included, then stays collectable).
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
        commit_every: int = 4096,
        commit_bytes: int = 8 << 20,
        commit_interval: float = 1.0,
        checksum: str = "once",
        spot_check: int = 2,
        compress: str | None = None,
        compress_level: int | None = None,
        sync: bool = False,
        pack: int = 0,
        freeze_worker_gc: bool | None = None,
    ) -> None:
        check_options(
            map_size=map_size,
            max_readers=max_readers,
            commit_every=commit_every,
            commit_bytes=commit_bytes,
            commit_interval=commit_interval,
            checksum=checksum,
            fingerprint=fingerprint,
            pack=pack,
        )
        check_compression(compress, compress_level)
        if type(sync) is not bool:
            raise InvalidOptionError(f"sync must be True or False, not {sync!r}.")
        if freeze_worker_gc is not None and type(freeze_worker_gc) is not bool:
            raise InvalidOptionError(
                f"freeze_worker_gc must be None (freeze only in forked workers), True or False, "
                f"not {freeze_worker_gc!r}."
            )
        if type(spot_check) is not int or spot_check < 0:
            raise InvalidOptionError(f"spot_check must be an integer >= 0 (0 turns it off), not {spot_check!r}.")
        self.dataset = dataset
        self.path = os.path.abspath(os.fspath(path))
        self.transform = transform
        self._options: dict[str, Any] = dict(map_size=map_size, max_readers=max_readers, sync=sync)
        self._compression = (compress, compress_level)
        self._policy = Policy(commit_every, parse_size(commit_bytes, "commit_bytes"), commit_interval)
        self._always = checksum == "always"
        self._freeze_gc = freeze_worker_gc
        self._open(fingerprint, overwrite, spot_check, pack)

    def _open(self, fingerprint: str | None, overwrite: bool, spot_check: int, pack: int = 0) -> None:
        """Open (create, check or rebuild) the cache for this dataset; on error nothing stays open."""
        dataset = self.dataset
        length = None if dataset is None else dataset_length(dataset)
        if dataset is not None and fingerprint is None:
            fingerprint = default_fingerprint(dataset)
        store, meta = _registry.open_store(
            self.path, length=length, fingerprint=fingerprint, overwrite=overwrite, create=dataset is not None,
            compress=self._compression[0], compress_level=self._compression[1], pack=pack, **self._options,
        )  # fmt: skip
        try:
            self._store: Store | None = store
            self._length: int = meta["length"]
            self.fingerprint: str = meta["fingerprint"]
            self._build: str = meta["cache_id"]
            if dataset is not None and spot_check and not overwrite:
                self._spot_check(store, spot_check)
        except BaseException:
            self._store = None
            _registry.release(store)
            raise

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
        if store is None or not store.owned:
            store = self._live_store()
        sample = store.get(index, self._always, self._build)  # the store checks the build, under its lock
        if sample is MISSING:
            sample = self._fill_one(index, store)
        transform = self.transform
        return sample if transform is None else transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch in one read transaction, misses filled together (the DataLoader calls this).

        Called by a DataLoader whose ``collate_fn`` is ``lmdbcache.collate``, a batch of flat
        samples comes back already collated into shared memory (``lmdbcache.loader._collate``).
        """
        indices = self.checked_indices(indices)
        store = self._live_store()
        if self.transform is None and _batch_hooks:
            wants_batch, gather_shared = _batch_hooks[0]
            if wants_batch():
                batch = gather_shared(store, indices, self._always, self._build)
                if batch is not None:
                    return batch  # type: ignore[no-any-return]  # a Collated (a list subclass)
        samples = store.get_many(indices, self._always, self._build)
        misses = [k for k, sample in enumerate(samples) if sample is MISSING]
        if misses:
            filled = self._fill([indices[k] for k in misses], store)
            for k, sample in zip(misses, filled):
                samples[k] = sample
        transform = self.transform
        return samples if transform is None else [transform(sample) for sample in samples]

    def read_batch(self, indices: list[int], copy: Callable[[list[Any], list[bool]], Any]) -> Any:
        """Low level, for the loader: ``copy(views, check_data)`` over the stored values of ``indices``.

        Runs under the store's lock and one read transaction, with this dataset's checksum
        policy and build (``Reader.read_batch`` says what ``copy`` may do); returns what
        ``copy`` returns, or ``MISSING`` when an index is not cached.
        """
        return self._live_store().read_batch(indices, self._always, self._build, copy)

    def fill_batch(self, indices: list[int], plan: Any, dests: list[Any], scalars: Any) -> bool:
        """Low level, for the loader: the stored values of ``indices`` copied into ``dests`` and ``scalars`` by
        the compiled core in one call (``Reader.fill_batch``) when they are all of the flat layout ``plan``;
        False when not done (``read_batch`` then reads the batch and says what, if anything, is wrong)."""
        return self._live_store().reader.fill_batch(indices, self._always, self._build, plan, dests, scalars)

    def checked_indices(self, indices: Iterable[Any]) -> list[int]:
        """``indices`` as ints in range, numpy and negative ones resolved as ``ds[i]`` does; IndexError if out."""
        n = self._length
        return [i if type(i) is int and 0 <= i < n else self._index(i) for i in indices]

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

    def _live_store(self) -> Store:
        """This process's store, holding the build this dataset was opened on (else CacheMismatchError).

        A new store is acquired on first use after unpickling (spawn), after a fork, or after
        close(). The build ids are made the same object, so the store's per-sample check is
        an identity test.
        """
        store = self._store
        if store is None or not store.owned or store.retired:
            _registry.freeze_inherited(self._freeze_gc)  # in a DataLoader worker (see there)
            store = _registry.acquire(self.path, **self._options)
            store.expect_build(self._build)  # opening checks the cache is still the build we validated
            self._store = store
        build = store.build
        if build is not self._build:
            if build is not None and build != self._build:
                raise store.mismatch(self._build)
            if build is not None:
                self._build = build
        return store

    def _fill(self, indices: list[int], store: Store) -> list[Any]:
        """Decode misses from the source (no lock held), queue them, return them as a hit would."""
        source = self.dataset
        if source is None:
            raise SampleNotCachedError(
                f"Index {indices[0]} is not in cache '{self.path}' and there is no source dataset to decode it from. "
                "Build the cache completely first (`lmdbcache precompute`), or pass the source dataset."
            )
        out = []
        # Each sample is queued as soon as the source returns it: a worker told to end (SIGTERM at the
        # script's exit, see store/_registry.py) mid-batch keeps what it already decoded.
        for i, raw in self._source_samples(indices):
            value = encode_miss(raw, i)
            store = store.queue(i, value, self._build, self._policy, self._live_store)  # (another if closed)
            # Decoded from the bytes just stored: exactly what a later hit returns (same types,
            # contiguous, writable). No data checksum: these bytes never left this process.
            out.append(decode_new(value, i))
        return out

    def _fill_one(self, index: int, store: Store) -> Any:
        """``_fill([index], store)[0]``, without the batch's lists and generator (a single miss)."""
        source = self.dataset
        if source is None:
            return self._fill([index], store)[0]  # raises, saying why
        try:
            raw = source[index]
        except Exception as exc:
            add_note(exc, f"lmdbcache: raised by the source dataset reading index {index} (cache '{self.path}')")
            raise
        value = encode_miss(raw, index)
        store.queue(index, value, self._build, self._policy, self._live_store)  # or a reopened one
        return decode_new(value, index)  # as _fill: exactly what a later hit returns

    def _read_source(self, indices: list[int]) -> list[Any]:
        return [raw for _, raw in self._source_samples(indices)]

    def _source_samples(self, indices: list[int]) -> Iterator[tuple[int, Any]]:
        """(index, sample) from the source, each as soon as it is read (the source's ``__getitems__``: all at once)."""
        source = self.dataset
        getitems = getattr(source, "__getitems__", None)
        if getitems is not None and len(indices) > 1:
            try:
                raws = list(getitems(indices))
            except Exception as exc:
                add_note(exc, f"lmdbcache: raised by the source dataset's __getitems__ for indices {indices}")
                raise
            yield from zip(indices, raws)
            return
        for i in indices:
            try:
                raw = source[i]
            except Exception as exc:
                add_note(exc, f"lmdbcache: raised by the source dataset reading index {i} (cache '{self.path}')")
                raise
            yield i, raw

    def _spot_check(self, store: Store, count: int) -> None:
        """Re-decode ``count`` random cached indices and compare them with the cache (see ``spot_check``)."""
        spot_check(
            store,
            count,
            lambda index: encode(self._read_source([index])[0], index),
            (
                "Pass a fingerprint= that names what changed, or overwrite=True to rebuild; if the dataset applies "
                "random augmentation, move it to transform=. (spot_check=0 turns this check off.)"
            ),
        )

    def loader(self, batch_size: int | None = 1, **kwargs: Any) -> Any:
        """``lmdbcache.Loader(self, batch_size, **kwargs)``: batches equal to ``DataLoader(self, batch_size,
        collate_fn=default_collate)``'s, copied from the map.

        See ``lmdbcache.Loader`` for the options (shuffle, seed, drop_last, sampler,
        batch_sampler, num_threads, prefetch, rank, world_size, batch_transform, pin_memory,
        record_event, seed_transforms, num_workers, multiprocessing_context), the order, and
        resuming with ``state_dict``.
        """
        from .loader import Loader  # the one edge from the dataset up to the loader: lazy, at call time

        return Loader(self, batch_size, **kwargs)

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
        if store is not None and store.owned:
            _registry.release(store)

    def __enter__(self) -> CachedDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ pickling and attributes

    def __getstate__(self) -> dict[str, Any]:
        store = self._store
        if store is not None and store.owned and store.build == self._build:
            store.flush()  # pickled for spawn workers: let them see what this process decoded
        state = self.__dict__.copy()
        state["_store"] = None  # configuration only: each process opens its own environment
        state["_policy"] = tuple(self._policy)  # a plain tuple: the pickle names no private class
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A dataset pickled by an older lmdbcache lacks the attributes added since: each gets the
        # value that version meant (tests/test_layout.py unpickles one pickled by 0.3).
        self.__dict__.update({"_freeze_gc": None, **state, "_policy": Policy(*state["_policy"])})

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


def spot_check(
    store: Store, count: int, encoded: Callable[[int], bytes], fix: str, among: Sequence[int] | None = None
) -> None:
    """Re-decode ``count`` random cached indices and compare them with the cache; CacheMismatchError on a difference.

    ``encoded(index)`` is the source's sample at ``index``, encoded; ``fix`` ends the message (what the caller
    can do). ``among``: the cached indices to choose from (precompute's own share: another rank's are that
    rank's to decode), by default the first cached at or after random starts. Shared by ``CachedDataset``
    and ``precompute``."""
    meta = store.meta()
    length, fingerprint, rng = meta["length"], meta["fingerprint"], random.Random()
    starts = [rng.randrange(length) for _ in range(min(count, length))]
    for index in rng.sample(among, min(count, len(among))) if among is not None else store.cached_near(starts):
        stored = store.raw(index)
        if stored is None:
            continue
        fresh = encoded(index)
        if store.compress(fresh) == stored:
            continue
        # Bytes can differ while samples are equal (a value written by an older format).
        try:
            cached = store.get(index, True)
        except CorruptSampleError:
            continue  # damage, not a stale source: reading the index says so, with the repair to run
        difference = first_difference(cached, decode(fresh, index, verify_data=False))
        if difference is not None:
            raise CacheMismatchError(
                f"Cache '{store.path}' does not match its source dataset at index {index}: {difference}. The cache was "
                f"built from other data under the same fingerprint '{fingerprint}' (changed preprocessing, another "
                f"subset or file list) or the dataset is not deterministic. {fix}"
            )
