"""Look after existing caches: info, verify, warm, copy and merge (the Python side of the CLI)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import _registry, codec
from . import store as _store
from .errors import CacheMismatchError, CorruptCacheError, CorruptSampleError, LmdbCacheError, NotACacheError

__all__ = ["CopyResult", "VerifyResult", "copy", "info", "merge", "verify", "warm"]

Progress = Callable[[int], Any] | None


def _open(path: str | os.PathLike[str]) -> _store.Store:
    """This process's store for an existing cache (never creates one)."""
    store = _registry.acquire(os.fspath(path))
    try:
        store.initialize(length=None, fingerprint=None, create=False)
    except BaseException:
        _registry.release(store)
        raise
    return store


def info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``lmdbcache info`` prints: metadata, counts and sizes of the cache at ``path``."""
    store = _open(path)
    try:
        meta = store.meta()
        cached = store.count()
        env_info = store.env_info()
    finally:
        _registry.release(store)
    data = os.path.join(store.path, _store.DATA_FILE)
    return {
        "path": store.path,
        "length": meta["length"],
        "cached": cached,
        "percent": 100.0 * cached / meta["length"] if meta["length"] else 100.0,
        "complete": cached == meta["length"],
        "fingerprint": meta["fingerprint"],
        "format_version": meta["format_version"],
        "codec": meta["codec"],
        "library_version": meta["library_version"],
        "created": meta["created"],
        "size_bytes": os.path.getsize(data),
        "map_size": env_info["map_size"],
    }


@dataclasses.dataclass
class VerifyResult:
    checked: int
    bad: list[int]
    repaired: int = 0


def verify(path: str | os.PathLike[str], *, repair: bool = False, progress: Progress = None) -> VerifyResult:
    """Decode every stored value and check its checksums; with ``repair``, delete the bad ones.

    Deleted entries are decoded again from the source on their next read (or by the
    next ``precompute``). Entries whose index is outside the dataset count as bad.
    """
    store = _open(path)
    try:
        length = store.meta()["length"]
        bad, checked = [], 0
        for index, value in store.iter_raw():
            checked += 1
            if index >= length:
                bad.append(index)
            else:
                try:
                    codec.decode(value)
                except CorruptSampleError:
                    bad.append(index)
            if progress is not None:
                progress(1)
        repaired = store.delete(bad) if repair and bad else 0
    finally:
        _registry.release(store)
    return VerifyResult(checked, bad, repaired)


def warm(path: str | os.PathLike[str], *, chunk: int = 8 << 20, progress: Progress = None) -> tuple[int, float]:
    """Read the cache's data file once, sequentially, so its pages sit in the page cache.

    Sequential reads of the whole file fill the page cache at the disk's full speed, where
    the first random-access epoch after a reboot would fault the pages in one at a time.
    Returns (bytes read, seconds).
    """
    store = _open(path)  # checks it is a cache
    _registry.release(store)
    data = os.path.join(store.path, _store.DATA_FILE)
    start, total = time.perf_counter(), 0
    buf = bytearray(chunk)
    with open(data, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            total += n
            if progress is not None:
                progress(n)
    return total, time.perf_counter() - start


@dataclasses.dataclass
class CopyResult:
    action: str  # "copied", "replaced" or "unchanged"
    cached: int
    length: int
    seconds: float


def copy(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False) -> CopyResult:
    """A consistent, compacted copy of ``src`` at ``dst`` (LMDB's own copy), safe while ``src`` is in use.

    If ``dst`` already holds a complete cache of the same dataset, nothing is done; if it
    holds an incomplete one, it is replaced. A cache of another dataset at ``dst`` is only
    replaced with ``overwrite``. The copy is written beside ``dst`` and renamed into place,
    so ``dst`` is never seen half-written.
    """
    start = time.perf_counter()
    source = _open(src)
    try:
        meta = source.meta()
        dst_path = os.path.abspath(os.fspath(dst))
        if os.path.realpath(dst_path) == os.path.realpath(source.path):
            raise LmdbCacheError(f"Cannot copy '{source.path}' onto itself.")
        existing = _existing(dst_path)
        if existing is not None:
            same = (existing["fingerprint"], existing["length"]) == (meta["fingerprint"], meta["length"])
            if not same and not overwrite:
                raise CacheMismatchError(
                    f"'{dst_path}' holds a cache of another dataset (fingerprint '{existing['fingerprint']}', length "
                    f"{existing['length']}; the source has '{meta['fingerprint']}', {meta['length']}). Choose another "
                    "destination, or pass --overwrite to replace it."
                )
            if same and existing["complete"]:
                return CopyResult("unchanged", existing["cached"], meta["length"], time.perf_counter() - start)
        parent = os.path.dirname(dst_path)
        os.makedirs(parent, exist_ok=True)
        tmp = f"{dst_path}.copy-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        try:
            source.copy_to(tmp)
            if os.path.exists(dst_path):
                old = f"{dst_path}.old-{os.getpid()}"
                os.rename(dst_path, old)
                os.rename(tmp, dst_path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, dst_path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        _registry.release(source)
    copied = info(dst_path)
    action = "copied" if existing is None else "replaced"
    return CopyResult(action, copied["cached"], copied["length"], time.perf_counter() - start)


def _existing(path: str) -> dict[str, Any] | None:
    """``info`` of the cache at ``path``, or None if there is none; damaged caches count as none."""
    if not os.path.exists(os.path.join(path, _store.DATA_FILE)):
        if os.path.isdir(path) and os.listdir(path):
            raise NotACacheError(f"'{path}' exists and is not a cache; refusing to replace it.")
        return None
    try:
        return info(path)
    except CorruptCacheError:
        return None  # damaged: as good as incomplete


def merge(
    out: str | os.PathLike[str],
    shards: Iterable[str | os.PathLike[str]],
    *,
    progress: Progress = None,
    batch: int = 1024,
) -> dict[str, Any]:
    """Merge shard caches of one dataset into ``out`` (created if missing); returns ``info(out)``.

    Every shard must have the same fingerprint, length and format as the others (and as
    ``out`` if it exists). Values are verified and copied byte for byte; indices already
    in ``out`` are skipped.
    """
    shard_paths = [os.fspath(s) for s in shards]
    if not shard_paths:
        raise LmdbCacheError("merge needs at least one shard.")
    metas = []
    for path in shard_paths:
        store = _open(path)
        metas.append((path, store.meta()))
        _registry.release(store)
    first_path, first = metas[0]
    for path, meta in metas[1:]:
        if (meta["fingerprint"], meta["length"]) != (first["fingerprint"], first["length"]):
            raise CacheMismatchError(
                f"Shard '{path}' belongs to another dataset (fingerprint '{meta['fingerprint']}', length "
                f"{meta['length']}) than '{first_path}' ('{first['fingerprint']}', {first['length']}). "
                "Merge only shards built from one dataset."
            )
    target = _registry.acquire(os.fspath(out), map_size=max(64 << 20, _total_size(shard_paths)))
    try:
        target.initialize(length=first["length"], fingerprint=first["fingerprint"])
        for path in shard_paths:
            source = _open(path)
            try:
                pending: list[tuple[int, bytes]] = []
                for index, value in source.iter_raw(chunk=batch):
                    try:
                        codec.decode(value)
                    except CorruptSampleError as exc:
                        raise CorruptSampleError(
                            f"Shard '{path}': index {index} is damaged ({exc}). Run `lmdbcache verify --repair {path}` "
                            "and rebuild the missing entries, then merge again."
                        ) from None
                    pending.append((index, value))
                    if len(pending) >= batch:
                        target.put_many(pending)
                        pending = []
                    if progress is not None:
                        progress(1)
                target.put_many(pending)
            finally:
                _registry.release(source)
    finally:
        _registry.release(target)
    return info(out)


def _total_size(paths: list[str]) -> int:
    return sum(os.path.getsize(os.path.join(p, _store.DATA_FILE)) for p in paths)
