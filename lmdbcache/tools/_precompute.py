"""Build a whole cache before training: parallel decode, one writer, resumable, shardable.

Sharding is a fixed assignment: index ``i`` belongs to shard ``i % N`` of ``N`` (round
robin, so every shard gets a fair mix of the dataset). Under ``torchrun`` (``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE`` in the environment) the local ranks of a node split the indices
of their shard the same way, and all write the one node-local cache.

Ctrl-C. The main process decides when to stop: it commits what it has queued (a second
Ctrl-C cannot abort that commit), then stops the workers, which ignore SIGINT (a terminal
sends it to them too). A worker interrupted by it on its own used to leave a full result
pipe behind and the DataLoader waited 5 s per worker before killing it (issue 13). Workers
also skip the rest of their batch once the run has stopped, so they leave at once.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset

from .._children import die_with_parent, start_workers
from .._options import check_options, parse_size
from ..dataset import dataset_length, default_fingerprint, spot_check
from ..errors import (
    CacheMismatchError,
    InvalidOptionError,
    LmdbCacheError,
    NondeterministicDatasetError,
    SourceItemError,
)
from ..format._compress import Compressor
from ..format._compress import check as check_compression
from ..format.codec import encode
from ..store import _registry
from ..store._commit import Policy
from ..store._signals import interrupts_held, interrupts_ignored, interrupts_outside_locks
from ..store._store import DATA_FILE, Store
from ._progress import note, progress_bar

# Commits on time as well as on count, with the dataset's default bound: a SIGKILL loses at
# most about a second of work (plus what the workers had decoded but not handed over).
_COMMIT_INTERVAL = 1.0
_DEFAULT_PACK = 64  # pack=None: a new cache packs chunks of this many small samples
# Ctrl-C with this much decoded and not yet committed says that it is writing it (two commits' worth, 256 MB
# each by default, take seconds on a slow disk, and the Ctrl-C would otherwise seem to go unheard).
_SAY_WRITING = 32 << 20

__all__ = ["NondeterministicDatasetError", "PrecomputeResult", "SourceItemError", "precompute", "shard_indices"]


# What a worker sends for one index: (index, encoded sample, None) or (index, None, why it failed).
_Item = tuple[int, bytes | None, str | None]
_Batch = list[_Item]


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
    compress: str | None = None,
    compress_level: int | None = None,
    pack: int | None = None,
    spot_check: int = 2,
) -> PrecomputeResult:
    """Decode every index of ``dataset`` (or of one shard) into the cache at ``path``.

    ``num_workers`` DataLoader workers decode and encode (default: the CPU count, split
    between torchrun's local ranks); this process writes, committing every
    ``commit_every`` samples or ``commit_bytes`` bytes. Already cached indices are
    skipped, so an interrupted run resumes where it stopped. ``local`` is (local rank,
    local world size); by default it comes from torchrun's environment.

    Before writing, ``check_determinism`` indices are decoded twice; if the two samples
    differ (random augmentation inside the dataset would be frozen into the cache) this
    raises ``NondeterministicDatasetError`` unless ``allow_nondeterministic``. ``pack``: as
    ``CachedDataset``'s, for a cache created here, but 64 by default (None): precompute writes
    whole chunks in index order, the case packs are made for (small samples take 1.02-1.13x
    their bytes on disk instead of 1.34-2x; samples of 16 KiB or more are never packed). Pass 0
    for one record per sample. An existing cache keeps its own; another explicit ``pack`` raises
    ``CacheMismatchError``, as another ``compress`` does.

    An existing cache is spot-checked first, as ``CachedDataset(dataset, path)`` does:
    ``spot_check`` random cached indices of this run's share are decoded again, and a difference
    (changed preprocessing under the same class and length) raises ``CacheMismatchError``; 0
    skips it. No index of another shard or local rank is decoded here, checks included.

    Raises ``SourceItemError`` naming the index when the dataset raises (what was written
    is kept). Ctrl-C commits what was decoded, stops the workers and returns with
    ``interrupted=True``; ``seconds`` (and the rate) cover the work, not the shutdown.

    ``compress`` and ``compress_level`` are ``CachedDataset``'s: a new cache is compressed so, an
    existing one keeps its own setting (another one raises ``CacheMismatchError``). The workers compress.
    """
    start = time.perf_counter()
    _check_arguments(
        num_workers, batch_size, check_determinism, map_size, commit_every, commit_bytes, fingerprint,
        _DEFAULT_PACK if pack is None else pack,
    )  # fmt: skip
    if type(spot_check) is not int or spot_check < 0:
        raise InvalidOptionError(f"spot_check must be an integer >= 0 (0 turns it off), not {spot_check!r}.")
    check_compression(compress, compress_level)
    path = os.path.abspath(os.fspath(path))
    local, workers = _local_ranks(local, overwrite, num_workers)
    length = dataset_length(dataset)
    indices = shard_indices(length, shard, local)
    halted = False
    run = _Run.open(
        path, dataset, length, fingerprint, overwrite, map_size, commit_every, commit_bytes, compress, compress_level,
        _DEFAULT_PACK if pack is None else pack,
    )  # fmt: skip
    try:
        todo, held = _split_cached(run.store, indices, length)
        if not overwrite:
            _check_existing(run, dataset, pack, spot_check, held)
        halted = _fill(run, dataset, todo, workers, batch_size, progress, check_determinism, allow_nondeterministic)
        cached = run.store.count()
        if run.written:
            note("Syncing to disk...", progress is False)  # the bar sits at 100% meanwhile: say why
    finally:
        # The last release syncs the file and removes the unsynced marker: a Ctrl-C meanwhile (the bar
        # sits at 100% during the sync) waits for both, then the run reports as interrupted.
        with interrupts_held(block=False, reraise=False) as held:
            _registry.release(run.store)
        halted = halted or bool(held)
    seconds = (run.stopped or time.perf_counter()) - start
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    return PrecomputeResult(path, run.written, len(indices) - len(todo), seconds, cached, length, size, halted)


def _check_existing(run: _Run, dataset: Any, pack: int | None, count: int, cached: list[int]) -> None:
    """Refuse an existing cache packed otherwise than ``pack`` asks, or whose samples differ from ``dataset``'s.

    The spot check decodes only ``cached`` indices of this run's own share: under torchrun, another rank's
    indices (cached by it a moment ago, or in an earlier run) are that rank's to decode and check (issue 38).
    """
    found = run.store.meta().get("pack", 0)
    if pack is not None and found != pack:
        has = f"pack={found}" if found else "no packs (pack=0)"
        raise CacheMismatchError(
            f"Cache '{run.store.path}' was built with {has}, not pack={pack}. Leave pack= out to use its setting, "
            "or pass overwrite=True to rebuild it with the new one."
        )
    if count:
        spot_check(
            run.store,
            count,
            functools.partial(_encode_source, dataset),
            "Pass overwrite=True to rebuild it, or build into another path (with a fingerprint= that names what "
            "changed). (spot_check=0 skips this check.)",
            among=cached,
        )


def _check_arguments(
    num_workers: int | None,
    batch_size: int,
    check_determinism: int,
    map_size: int,
    commit_every: int,
    commit_bytes: int,
    fingerprint: str | None,
    pack: int = 0,
) -> None:
    for name, value, low in (("batch_size", batch_size, 1), ("check_determinism", check_determinism, 0)):
        if type(value) is not int or value < low:
            raise InvalidOptionError(f"{name} must be an integer >= {low}, not {value!r}.")
    if num_workers is not None and (type(num_workers) is not int or num_workers < 0):
        raise InvalidOptionError(
            f"num_workers must be an integer >= 0 (0 decodes in this process), or None for the CPU count, not "
            f"{num_workers!r}."
        )
    check_options(
        map_size=map_size,
        max_readers=1,
        commit_every=commit_every,
        commit_bytes=commit_bytes,
        commit_interval=_COMMIT_INTERVAL,
        checksum="once",
        fingerprint=fingerprint,
        pack=pack,
    )


def _local_ranks(
    local: tuple[int, int] | None, overwrite: bool, num_workers: int | None
) -> tuple[tuple[int, int] | None, int]:
    """(``local`` or torchrun's (local rank, local world size), ``num_workers`` or this rank's share of the CPUs).

    ``overwrite`` with several local ranks is refused: each rank would wipe the cache.
    """
    local = local if local is not None else torchrun_local()
    if overwrite and local is not None:
        raise LmdbCacheError(
            "overwrite=True with several local ranks would wipe the cache once per rank. Delete the cache "
            "directory before launching, or run the rebuild as a single process."
        )
    workers = num_workers if num_workers is not None else max(1, (os.cpu_count() or 1) // (local[1] if local else 1))
    return local, workers


@dataclasses.dataclass
class _Run:
    """One precompute on its store: what it has written, and when its work stopped."""

    store: Store
    build: str  # the build this run writes into (the store may be shared in-process)
    policy: Policy  # this run's own commit policy
    base: int  # the store's count of written samples when the run began
    checked: int = 0  # samples written by the determinism check
    stopped: float | None = None  # perf_counter() after the last commit, before the workers are stopped

    @classmethod
    def open(
        cls,
        path: str,
        dataset: Any,
        length: int,
        fingerprint: str | None,
        overwrite: bool,
        map_size: int,
        every: int,
        size: int,
        compress: str | None = None,
        compress_level: int | None = None,
        pack: int = 0,
    ) -> _Run:
        """This process's store for ``path``, opened for ``dataset`` (created, or checked against it)."""
        store, meta = _registry.open_store(
            path,
            length=length,
            fingerprint=fingerprint if fingerprint is not None else default_fingerprint(dataset),
            overwrite=overwrite,
            map_size=map_size,
            commit_every=every,
            commit_bytes=size,
            commit_interval=_COMMIT_INTERVAL,
            compress=compress,
            compress_level=compress_level,
            pack=pack,
        )
        policy = Policy(every, parse_size(size), _COMMIT_INTERVAL)
        return cls(store, meta["cache_id"], policy, store.written)

    @property
    def written(self) -> int:
        return self.checked + self.store.written - self.base

    def commit(self) -> None:
        """Commit every queued sample and wait for it; the work stops here."""
        self.store.flush()
        self.stopped = time.perf_counter()

    def final_commit(self, quiet: bool) -> None:
        """``commit`` after Ctrl-C: a second Ctrl-C must not abort it."""
        if self.stopped is None:
            with interrupts_ignored():
                unwritten = self.store.writer.unwritten_bytes
                if unwritten >= _SAY_WRITING:
                    note(f"Interrupted: writing the {unwritten / 2**20:,.0f} MB decoded so far before stopping "
                         "(a second Ctrl-C does not stop this)...", quiet)  # fmt: skip
                self.commit()


def _split_cached(store: Store, indices: range, length: int) -> tuple[list[int], list[int]]:
    """The indices of ``indices`` the cache does not hold, and those it holds (a byte per index, or a set for huge
    datasets, marks what it holds)."""
    done: bytearray | set[int] = bytearray(length) if length <= 1 << 28 else set()
    for index in store.iter_keys():
        if index < length:
            if isinstance(done, set):
                done.add(index)
            else:
                done[index] = 1
    held = [i for i in indices if (i in done if isinstance(done, set) else done[i])]
    return [i for i in indices if not (i in done if isinstance(done, set) else done[i])], held


def _fill(
    run: _Run,
    dataset: Any,
    todo: list[int],
    workers: int,
    batch_size: int,
    progress: bool | None,
    check: int,
    allow_nondeterministic: bool,
) -> bool:
    """Decode and write ``todo``: the determinism check, then the workers. True if Ctrl-C stopped it."""
    try:
        if todo and check > 0:
            run.checked = _check_determinism(dataset, todo[:check], allow_nondeterministic, run.store, run.build)
            todo = todo[check:]
        _write_all(run, dataset, todo, workers, batch_size, progress)
    except KeyboardInterrupt:
        run.final_commit(progress is False)
        return True
    return False


def _check_determinism(dataset: Any, checked: list[int], allow: bool, store: Store, build: str) -> int:
    """Decode ``checked`` twice each; write them (they are decoded already) and return how many were new."""
    values = []
    for index in checked:
        first, second = (_encode_source(dataset, index) for _ in range(2))
        if first != second and not allow:
            raise NondeterministicDatasetError(
                f"The dataset returned different samples for index {index} on two calls, so its first decode "
                "would be frozen into the cache. Move random augmentation out of the dataset into "
                "CachedDataset(transform=...), or pass --allow-nondeterministic if the difference is harmless."
            )
        values.append((index, store.compress(first)))
    return store.put_many(values, build)


def _encode_source(dataset: Any, index: int) -> bytes:
    try:
        return encode(dataset[index], index)
    except LmdbCacheError:
        raise
    except Exception as exc:
        raise SourceItemError(f"The dataset raised on index {index}: {type(exc).__name__}: {exc}") from exc


def _write_all(run: _Run, dataset: Any, todo: list[int], workers: int, batch_size: int, progress: bool | None) -> None:
    """Workers decode and encode; this process queues their bytes; the store's thread commits."""
    if not todo:
        return
    stop = multiprocessing.Event() if workers else None
    loader = DataLoader(
        _Encoded(dataset, todo, stop, run.store.compressor),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_collate,
        prefetch_factor=4 if workers else None,
        worker_init_fn=functools.partial(_worker_start, os.getpid()) if workers else None,
    )
    bar = progress_bar(len(todo) + run.written, "sample", progress is False, initial=run.written, smoothing=0.1)
    batches: Iterator[_Batch] | None = None
    release = None
    try:
        with interrupts_held():  # an interrupted start would leave workers that nothing shuts down
            started, release = start_workers(functools.partial(iter, loader))  # a thread that outlives them
            batches = started
        with interrupts_outside_locks():  # one inside the index queue's put would hang its shutdown below
            _queue_all(run, started, bar)
    except KeyboardInterrupt:
        run.final_commit(progress is False)  # before the workers go: what they handed over is kept
        raise
    finally:
        bar.close()
        if stop is not None:
            stop.set()  # workers skip the rest of their batch
        shutdown = getattr(batches, "_shutdown_workers", None)  # the DataLoader's own clean shutdown
        if shutdown is not None:
            shutdown()
        if release is not None:
            release()


def _queue_all(run: _Run, batches: Iterable[_Batch], bar: Any) -> None:
    """Queue every encoded sample the workers send; the last commit ends the work."""
    add = functools.partial(run.store.add, build=run.build, policy=run.policy)
    for batch in batches:
        for index, value, error in batch:
            if value is None:
                run.store.flush()
                raise SourceItemError(
                    f"The dataset raised on index {index}: {error}. The {run.store.written - run.base} samples "
                    "decoded before it were kept; fix the dataset (or exclude the index) and rerun to resume."
                )
            add(index, value)  # the store's committer thread writes batches in the background
        bar.update(len(batch))
    run.commit()


class _Encoded(Dataset[_Item]):
    """Decodes and encodes in the workers, so the writer only copies bytes into LMDB."""

    def __init__(
        self,
        dataset: Any,
        indices: Sequence[int],
        stop: multiprocessing.synchronize.Event | None = None,
        compressor: Compressor | None = None,
    ) -> None:
        self.dataset, self.indices, self.stop, self.compressor = dataset, indices, stop, compressor

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> _Item:
        index = self.indices[k]
        if self.stop is not None and self.stop.is_set():
            return index, None, "skipped: the run has stopped"  # never read: the main process has left
        try:
            value = encode(self.dataset[index], index)
            return index, value if self.compressor is None else self.compressor(value), None
        except Exception as exc:  # reported by the writer with its index; the run stops cleanly
            return index, None, f"{type(exc).__name__}: {exc}"


def _collate(batch: _Batch) -> _Batch:
    return batch


# ---------------------------------------------------------------------- Ctrl-C


def _worker_start(parent: int, worker_id: int) -> None:
    """A worker's first steps: die with ``parent`` however it ends (``_children``, issue 38), and ignore SIGINT
    (see the module docstring), which ``interrupts_held`` blocked."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
