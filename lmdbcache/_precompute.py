"""Build a whole cache before training: parallel decode, one writer, resumable, shardable.

Sharding is a fixed assignment: index ``i`` belongs to shard ``i % N`` of ``N`` (round
robin, so every shard gets a fair mix of the dataset). Under ``torchrun`` (``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE`` in the environment) the local ranks of a node split the indices
of their shard the same way, and all write the one node-local cache.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset

from . import _registry
from . import store as _store
from ._commit import Policy
from ._options import check_options, parse_size
from ._progress import progress_bar
from .codec import encode
from .dataset import _dataset_length, default_fingerprint
from .errors import InvalidOptionError, LmdbCacheError, NondeterministicDatasetError, SourceItemError

# Commits on time as well as on count, with the dataset's default bound: a SIGKILL loses at
# most about a second of work (plus what the workers had decoded but not handed over).
_COMMIT_INTERVAL = 1.0

__all__ = ["NondeterministicDatasetError", "PrecomputeResult", "SourceItemError", "precompute", "shard_indices"]


@dataclasses.dataclass
class PrecomputeResult:
    """What one precompute run did (also the closing summary line)."""

    path: str
    written: int
    skipped: int
    seconds: float
    cached: int
    length: int
    size_bytes: int
    interrupted: bool = False

    @property
    def rate(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        head = "Interrupted: kept" if self.interrupted else "Wrote"
        tail = " Rerun the same command to resume." if self.interrupted else ""
        return (
            f"{head} {self.written} samples, skipped {self.skipped} already cached, in {self.seconds:.1f} s "
            f"({self.rate:,.0f} samples/s); '{self.path}' now holds {self.cached}/{self.length} samples, "
            f"{self.size_bytes / 2**20:,.1f} MB on disk.{tail}"
        )


def shard_indices(length: int, shard: tuple[int, int] | None = None, local: tuple[int, int] | None = None) -> range:
    """The indices of ``shard`` (I, N), split again for local rank ``local`` (R, W): ``i % N == I``, then 1 in W."""
    index, count = shard or (0, 1)
    if not (count >= 1 and 0 <= index < count):
        raise ValueError(f"shard must be I/N with 0 <= I < N (I counted from 0), not {index}/{count}")
    rank, world = local or (0, 1)
    return range(index + rank * count, length, count * world)


class _Encoded(Dataset):
    """Decodes and encodes in the workers, so the writer only copies bytes into LMDB."""

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> tuple[int, bytes | None, str | None]:
        index = self.indices[k]
        try:
            return index, encode(self.dataset[index], index), None
        except Exception as exc:  # reported by the writer with its index; the run stops cleanly
            return index, None, f"{type(exc).__name__}: {exc}"


def _collate(batch: list) -> list:
    return batch


def torchrun_local() -> tuple[int, int] | None:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) when launched by torchrun with more than one local process."""
    try:
        rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 else None


def precompute(
    dataset: Any,
    path: str | os.PathLike[str],
    *,
    num_workers: int | None = None,
    shard: tuple[int, int] | None = None,
    local: tuple[int, int] | None = None,
    fingerprint: str | None = None,
    overwrite: bool = False,
    check_determinism: int = 3,
    allow_nondeterministic: bool = False,
    batch_size: int = 16,
    commit_every: int = 1024,
    commit_bytes: int = 256 << 20,
    map_size: int = 64 << 20,
    progress: bool | None = None,
) -> PrecomputeResult:
    """Decode every index of ``dataset`` (or of one shard) into the cache at ``path``.

    ``num_workers`` DataLoader workers decode and encode (default: the CPU count, split
    between torchrun's local ranks); this process writes, committing every
    ``commit_every`` samples or ``commit_bytes`` bytes. Already cached indices are
    skipped, so an interrupted run resumes where it stopped. ``local`` is (local rank,
    local world size); by default it comes from torchrun's environment.

    Before writing, ``check_determinism`` indices are decoded twice; if the two samples
    differ (random augmentation inside the dataset would be frozen into the cache) this
    raises ``NondeterministicDatasetError`` unless ``allow_nondeterministic``.

    Raises ``SourceItemError`` naming the index when the dataset raises (what was written
    is kept). Ctrl-C commits what was decoded and returns with ``interrupted=True``.
    """
    start = time.perf_counter()
    _check_precompute_options(num_workers, batch_size, check_determinism)
    check_options(
        map_size=map_size,
        max_readers=1,
        commit_every=commit_every,
        commit_bytes=commit_bytes,
        commit_interval=_COMMIT_INTERVAL,
        checksum="once",
        fingerprint=fingerprint,
    )
    path = os.path.abspath(os.fspath(path))
    local = local if local is not None else torchrun_local()
    if overwrite and local is not None:
        raise LmdbCacheError(
            "overwrite=True with several local ranks would wipe the cache once per rank. Delete the cache "
            "directory before launching, or run the rebuild as a single process."
        )
    length = _dataset_length(dataset)
    todo_range = shard_indices(length, shard, local)
    if num_workers is None:
        num_workers = max(1, (os.cpu_count() or 1) // (local[1] if local else 1))
    store, meta = _registry.open_store(
        path,
        length=length,
        fingerprint=fingerprint if fingerprint is not None else default_fingerprint(dataset),
        overwrite=overwrite,
        map_size=map_size,
        commit_every=commit_every,
        commit_bytes=commit_bytes,
        commit_interval=_COMMIT_INTERVAL,
    )
    try:
        # Queued under this run's own commit policy and build (the store may be shared in-process).
        add = functools.partial(
            store.add, build=meta["cache_id"], policy=Policy(commit_every, parse_size(commit_bytes), _COMMIT_INTERVAL)
        )
        todo = _not_cached(store, todo_range, length)
        skipped = len(todo_range) - len(todo)
        written, interrupted = 0, False
        if todo and check_determinism > 0:
            written += _check_determinism(
                dataset, todo, check_determinism, allow_nondeterministic, store, meta["cache_id"]
            )
            todo = todo[check_determinism:]
        try:
            written += _write_all(dataset, todo, store, add, num_workers, batch_size, progress, written)
        except _Interrupted as stop:
            written += stop.written
            interrupted = True
        cached = store.count()
    finally:
        _registry.release(store)
    size = os.path.getsize(os.path.join(path, _store.DATA_FILE))
    return PrecomputeResult(path, written, skipped, time.perf_counter() - start, cached, length, size, interrupted)


def _check_precompute_options(num_workers: int | None, batch_size: int, check_determinism: int) -> None:
    for name, value, low in (("batch_size", batch_size, 1), ("check_determinism", check_determinism, 0)):
        if type(value) is not int or value < low:
            raise InvalidOptionError(f"{name} must be an integer >= {low}, not {value!r}.")
    if num_workers is not None and (type(num_workers) is not int or num_workers < 0):
        raise InvalidOptionError(
            f"num_workers must be an integer >= 0 (0 decodes in this process), or None for the CPU count, not "
            f"{num_workers!r}."
        )


def _not_cached(store: _store.Store, indices: range, length: int) -> list[int]:
    """The indices of ``indices`` the cache does not hold (a byte per index, or a set for huge datasets)."""
    done: bytearray | set[int] = bytearray(length) if length <= 1 << 28 else set()
    for index in store.iter_keys():
        if index < length:
            if isinstance(done, set):
                done.add(index)
            else:
                done[index] = 1
    return [i for i in indices if not (i in done if isinstance(done, set) else done[i])]


def _check_determinism(dataset: Any, todo: list[int], count: int, allow: bool, store: _store.Store, build: str) -> int:
    """Decode the first ``count`` pending indices twice; queue them (they are decoded already)."""
    checked = todo[:count]
    values = []
    for index in checked:
        first, second = (_encode_source(dataset, index) for _ in range(2))
        if first != second and not allow:
            raise NondeterministicDatasetError(
                f"The dataset returned different samples for index {index} on two calls, so its first decode "
                "would be frozen into the cache. Move random augmentation out of the dataset into "
                "CachedDataset(transform=...), or pass --allow-nondeterministic if the difference is harmless."
            )
        values.append((index, first))
    return store.put_many(values, build)


def _encode_source(dataset: Any, index: int) -> bytes:
    try:
        return encode(dataset[index], index)
    except LmdbCacheError:
        raise
    except Exception as exc:
        raise SourceItemError(f"The dataset raised on index {index}: {type(exc).__name__}: {exc}") from exc


class _Interrupted(Exception):
    def __init__(self, written: int) -> None:
        super().__init__(written)
        self.written = written


def _write_all(
    dataset: Any,
    todo: list[int],
    store: _store.Store,
    add: Callable[[int, bytes], None],
    num_workers: int,
    batch_size: int,
    progress: bool | None,
    done_before: int = 0,
) -> int:
    """Workers decode and encode; this process queues their bytes; the store's thread commits."""
    if not todo:
        return 0
    loader = DataLoader(
        _Encoded(dataset, todo),
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=_collate,
        prefetch_factor=4 if num_workers else None,
    )
    bar = progress_bar(len(todo) + done_before, "sample", progress is False, initial=done_before, smoothing=0.1)
    written_before = store.written
    batches = iter(loader)
    try:
        for batch in batches:
            for index, value, error in batch:
                if value is None:
                    store.flush()
                    raise SourceItemError(
                        f"The dataset raised on index {index}: {error}. The {store.written - written_before} "
                        "samples decoded before it were kept; fix the dataset (or exclude the index) and rerun "
                        "to resume."
                    )
                add(index, value)  # the store's committer thread writes batches in the background
            bar.update(len(batch))
        store.flush()
        return store.written - written_before
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abort the last commit
        try:
            store.flush()
        finally:
            signal.signal(signal.SIGINT, previous)
        raise _Interrupted(store.written - written_before) from None
    finally:
        bar.close()
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
