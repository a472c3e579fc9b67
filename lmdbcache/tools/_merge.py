"""``merge``: shards written by separate precompute runs (``--shard i/n``) into one cache.

Each shard must hold the same dataset (length and fingerprint) and format; every value is
checked before it is written (``_scan.decode_problem``), and an index held by two shards keeps
the first. Opened through ``_registry`` like every tool; hard links and bind mounts between the
shards and the output are refused by ``_ops._shared``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CacheMismatchError, CorruptSampleError, LmdbCacheError
from ..store import _metadata, _registry
from ..store._store import DATA_FILE, Store
from ._ops import _compression_label, _shared, _unshare_fix
from ._scan import decode_problem
from ._verify import Progress

__all__ = ["MergeResult", "merge"]


# ---------------------------------------------------------------------- merge


@dataclasses.dataclass
class MergeResult:
    path: str
    shards: int
    written: int  # entries added to the merged cache
    skipped: int  # entries it already held
    cached: int
    length: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.cached == self.length


def merge(
    out: str | os.PathLike[str],
    shards: Iterable[str | os.PathLike[str]],
    *,
    progress: Progress = None,
    batch: int = 1024,
    started: Callable[[int], Any] | None = None,
) -> MergeResult:
    """Merge shard caches of one dataset into ``out`` (created if missing).

    Every shard must have the same fingerprint, length and compression setting as the others
    (and as ``out`` if it exists; a new ``out`` takes the shards' setting); a shard listed
    twice, or ``out`` listed as a shard, is refused. Every value
    is verified (checksums bound to its index; nothing in it is executed) and copied byte
    for byte; indices already in ``out`` are skipped. ``started(total)`` is called once the
    shards are checked, with the number of values ``progress`` will count.
    """
    start = time.perf_counter()
    out_path = os.path.abspath(os.fspath(out))
    shard_paths = _distinct_shards(out_path, [os.path.abspath(os.fspath(s)) for s in shards])
    first, total = _common_dataset(shard_paths)
    if started is not None:
        started(total)
    length, written, skipped = first["length"], 0, 0
    codec, level = _metadata.compression(first)
    target, meta = _registry.open_store(
        out_path,
        length=length,
        fingerprint=first["fingerprint"],
        map_size=max(64 << 20, _total_size(shard_paths)),
        compress=codec,
        compress_level=level if codec else None,
        pack=first.get("pack", 0),  # a new merged cache packs as its first shard does
    )
    if codec is None and _metadata.compression(meta)[0] is not None:
        _registry.release(target)
        raise CacheMismatchError(
            f"Cache '{out_path}' is compressed ({_compression_label(meta)}) and the shards are not; merge them into "
            "a cache with their setting (another path, or rebuild it)."
        )
    try:
        for path in shard_paths:
            added, present = _merge_shard(path, target, meta["cache_id"], length, batch, progress)
            written, skipped = written + added, skipped + present
        cached = target.count()
    finally:
        _registry.release(target)
    return MergeResult(out_path, len(shard_paths), written, skipped, cached, length, time.perf_counter() - start)


def _distinct_shards(out_path: str, shard_paths: list[str]) -> list[str]:
    """``shard_paths``, refused if empty, if one is listed twice (by any path) or if one is ``out_path``."""
    if not shard_paths:
        raise LmdbCacheError("merge needs at least one shard.")
    seen: dict[str, str] = {}
    for path in shard_paths:
        real = os.path.realpath(path)
        if real == os.path.realpath(out_path):
            raise LmdbCacheError(
                f"'{path}' is the merged cache itself ('{out_path}'); list only the shards, and write the merge to "
                "another path."
            )
        if real in seen:
            same = f"'{path}'" if seen[real] == path else f"'{path}' (the same as '{seen[real]}')"
            raise LmdbCacheError(f"Shard {same} is listed twice; list each shard once.")
        shared = _shared(path, out_path)
        if shared is not None:
            raise LmdbCacheError(
                f"Shard '{path}' is the merged cache '{out_path}' under another name: {shared}, so the merge would "
                f"read and write one cache. Write the merge to a new path, or {_unshare_fix(out_path, shared)}."
            )
        for earlier in seen.values():
            shared = _shared(path, earlier)
            if shared is not None:
                raise LmdbCacheError(
                    f"Shard '{path}' is shard '{earlier}' under another name: {shared}. List each shard once."
                )
        seen[real] = path
    return shard_paths


def _common_dataset(shard_paths: list[str]) -> tuple[dict[str, Any], int]:
    """The metadata of the first shard, once every shard is known to hold the same dataset, and their values' count."""
    metas, total = [], 0
    for path in shard_paths:
        with _registry.opened(path) as store:
            metas.append((path, store.meta()))
            total += store.count()
    first_path, first = metas[0]
    for path, meta in metas[1:]:
        if (meta["fingerprint"], meta["length"]) != (first["fingerprint"], first["length"]):
            raise CacheMismatchError(
                f"Shard '{path}' belongs to another dataset (fingerprint '{meta['fingerprint']}', length "
                f"{meta['length']}) than '{first_path}' ('{first['fingerprint']}', {first['length']}). "
                "Merge only shards built from one dataset."
            )
        if _metadata.compression(meta) != _metadata.compression(first):
            raise CacheMismatchError(
                f"Shard '{path}' is compressed with {_compression_label(meta) or 'nothing'} and '{first_path}' with "
                f"{_compression_label(first) or 'nothing'}. Merge only shards built with one compress= setting "
                "(rebuild one of them with the other's)."
            )
    return first, total


def _merge_shard(path: str, target: Store, build: str, length: int, batch: int, progress: Progress) -> tuple[int, int]:
    """Copy every value of the shard at ``path`` into ``target``, ``batch`` at a time; (written, already there)."""
    written = skipped = 0
    with _registry.opened(path) as source, source.reading_ahead():
        values = source.iter_raw(chunk=batch)
        while pending := list(itertools.islice(values, batch)):
            for index, value in pending:
                _check_shard_value(path, index, value, length)
                if progress is not None:
                    progress(1)
            added = target.put_many(pending, build)
            written, skipped = written + added, skipped + len(pending) - added
    return written, skipped


def _check_shard_value(path: str, index: int, value: bytes, length: int) -> None:
    why = f"the index is outside the dataset (length {length})" if index >= length else decode_problem(value, index)
    if why is not None:
        raise CorruptSampleError(
            f"Shard '{path}': index {index} is damaged ({why}). Run `lmdbcache verify --repair {path}` and rebuild "
            "the missing entries, then merge again (indices already merged are skipped)."
        )


def _total_size(paths: list[str]) -> int:
    return sum(os.path.getsize(os.path.join(p, DATA_FILE)) for p in paths)
