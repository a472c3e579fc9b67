"""Look after existing caches: info, warm and copy (the Python side of the CLI; merge is ``_merge``).

Each function opens caches through ``_registry`` (this process's one store per directory)
and returns a dataclass, except ``warm``: (bytes read, seconds). ``verify`` lives in
``_verify`` (it scans in a child process, ``_scan``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any

from ..errors import CacheMismatchError, CorruptCacheError, LmdbCacheError, NotACacheError
from ..store import _fs, _metadata, _registry
from ..store._store import DATA_FILE, LOCK_FILE, WRITE_LOCK, Store
from ._verify import Progress, VerifyResult, verify

__all__ = [
    "CacheInfo",
    "CopyResult",
    "VerifyResult",
    "copy_cache",
    "info",
    "verify",
    "warm",
]


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """What ``info`` found (and ``lmdbcache info`` prints): metadata, counts and sizes of a cache."""

    path: str
    length: int
    cached: int
    percent: float
    complete: bool
    fingerprint: str
    format_version: int
    library_version: str | None
    created: str | None
    size_bytes: int
    map_size: int
    compress: str | None = None  # "zstd:3", "lz4:0" or None: what the build compresses buffers with
    pack: int = 0  # K: complete chunks of K small samples are stored as one record (0: one record per sample)

    # Deprecated: ``info`` returned a dict before it returned this, and ``info(path)["cached"]``
    # (or ``.get``) keeps working for code written then. Use the attributes.
    def __getitem__(self, name: str) -> Any:
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in self.__dataclass_fields__ else default


def info(path: str | os.PathLike[str]) -> CacheInfo:
    """What ``lmdbcache info`` prints: metadata, counts and sizes of the cache at ``path``."""
    with _registry.opened(os.fspath(path), need_codec=False) as store:  # metadata only: any codec, installed or not
        meta = store.meta()
        cached = store.count()
        env_info = store.env_info()
    length = meta["length"]
    return CacheInfo(
        path=store.path,
        length=length,
        cached=cached,
        percent=100.0 * cached / length if length else 100.0,
        complete=cached == length,
        fingerprint=meta["fingerprint"],
        format_version=meta["format_version"],
        library_version=meta.get("library_version"),
        created=meta.get("created"),
        size_bytes=os.path.getsize(os.path.join(store.path, DATA_FILE)),
        map_size=env_info["map_size"],
        compress=_compression_label(meta),
        pack=int(meta.get("pack", 0)),
    )


def _compression_label(meta: dict[str, Any]) -> str | None:
    codec, level = _metadata.compression(meta)
    return None if codec is None else f"{codec}:{level}"


# ---------------------------------------------------------------------- warm


def warm(path: str | os.PathLike[str], *, chunk: int = 8 << 20, progress: Progress = None) -> tuple[int, float]:
    """Read the cache's data file once, sequentially, so its pages sit in the page cache.

    Sequential reads of the whole file fill the page cache at the disk's full speed, where
    the first random-access epoch after a reboot would fault the pages in one at a time.
    Returns (bytes read, seconds).
    """
    with _registry.opened(os.fspath(path)) as store:  # checks it is a cache
        data = os.path.join(store.path, DATA_FILE)
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


# ---------------------------------------------------------------------- copy


@dataclasses.dataclass
class CopyResult:
    action: str  # "copied", "replaced" or "unchanged"
    cached: int
    length: int
    seconds: float
    # Other processes had the replaced cache open: they go on reading the old file until they
    # reopen the cache, and what they add to it is lost (see ``copy_cache``).
    others_had_it_open: bool = False


# The files a cache directory may hold that are the cache's own (LMDB's and our write lock);
# ``copy_cache`` touches nothing else but its own temporary directory.
_CACHE_FILES = {DATA_FILE, LOCK_FILE, WRITE_LOCK, "data.mdb-lock"}
_COPY_PREFIX = ".lmdbcache-copy-"
_SWAP_LOCK_TIMEOUT = 60.0


def copy_cache(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False) -> CopyResult:
    """A consistent, compacted copy of ``src`` at ``dst`` (LMDB's own copy), safe while ``src`` is in use.

    ``dst`` is a directory, created if missing; a file there (or a link to one) is refused.
    If it already holds a complete cache of the same dataset, nothing is done; an incomplete
    or damaged one is replaced. A cache of another dataset (or format), an LMDB file that is
    not a cache, or other files with no cache are only replaced, or joined, with ``overwrite``.

    Only the cache's own files change: the copy is written into a temporary directory
    inside ``dst``, then, under the cache's write lock (``lmdbcache.lock``, which every
    writer takes to commit), its ``data.mdb`` is renamed over ``dst/data.mdb`` and the old
    ``lock.mdb`` removed. Every other file in ``dst`` stays, and ``dst`` is never seen half
    written. Nothing is moved aside or deleted as a whole directory.

    A process that has the old cache open keeps its old ``data.mdb`` and ``lock.mdb`` (the
    files are unlinked, not overwritten): it goes on reading the old cache, consistent but
    no longer at ``dst``, until it reopens the cache, and samples it adds meanwhile are lost
    with the old file. A process that opens the cache after the swap (a new DataLoader
    worker, say) gets the new file with a fresh lock file, never the new bytes under the old
    lock file, and a ``CacheMismatchError`` if the copy is another build. The one gap is an
    open that does not take the write lock (a worker's lazy open) in the instant between
    the rename and the removal of the lock file. ``CopyResult.others_had_it_open`` says
    whether any process had the old cache open.
    """
    start = time.perf_counter()
    with _registry.opened(os.fspath(src)) as source:
        meta = source.meta()
        dst_path = os.path.abspath(os.fspath(dst))
        if os.path.realpath(dst_path) == os.path.realpath(source.path):
            raise LmdbCacheError(f"Cannot copy '{source.path}' onto itself.")
        shared = _shared(dst_path, source.path)
        if shared is not None:
            raise LmdbCacheError(
                f"Cannot copy '{source.path}' to '{dst_path}': {shared}, so the copy would replace the source itself. "
                f"Either {_unshare_fix(dst_path, shared)} and copy again, or choose another destination."
            )
        there, existing = _destination(dst_path, meta, overwrite)
        if existing is not None and existing.complete and _same_dataset(existing, meta):
            return CopyResult("unchanged", existing.cached, meta["length"], time.perf_counter() - start)
        others = _copy_into(source, dst_path)
    copied = info(dst_path)
    action = "replaced" if there else "copied"
    return CopyResult(action, copied.cached, copied.length, time.perf_counter() - start, others)


# Deprecated name of ``copy_cache`` (it shadowed the standard library's ``copy``); kept so code
# written against lmdbcache 0.1 keeps working. Not in ``__all__``.
copy = copy_cache


def _shared(path: str, other: str) -> str | None:
    """How the caches at ``path`` and ``other`` are one on disk (by device and inode), or None.

    ``realpath`` sees symbolic links only: a hard link of data.mdb, or a directory bind-mounted
    twice, is the same file under two names, which LMDB (py-lmdb: "already open in this
    process") and a copy or merge must not take for two caches.
    """
    here, there = _identity(path), _identity(other)
    if here is not None and here == there:
        return f"'{path}' and '{other}' are the same directory (device {here[0]}, inode {here[1]}: a bind mount?)"
    here, there = _identity(os.path.join(path, DATA_FILE)), _identity(os.path.join(other, DATA_FILE))
    if here is not None and here == there:
        return (
            f"'{os.path.join(path, DATA_FILE)}' is the same file as '{os.path.join(other, DATA_FILE)}' (a hard link: "
            f"device {here[0]}, inode {here[1]})"
        )
    return None


def _unshare_fix(path: str, shared: str) -> str:
    if "hard link" in shared:
        return f"remove '{os.path.join(path, DATA_FILE)}' (the other name keeps the data)"
    return f"use the directory's one path instead of '{path}'"


def _same_dataset(found: CacheInfo, meta: dict[str, Any]) -> bool:
    return (found.fingerprint, found.length) == (meta["fingerprint"], meta["length"])


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: a file where a cache directory would be
        return None
    return st.st_dev, st.st_ino


def _destination(path: str, meta: dict[str, Any], overwrite: bool) -> tuple[bool, CacheInfo | None]:
    """Is there a cache at copy's destination, and its ``info`` (None if there is none or it cannot be read)?

    Raises for what copy must not replace (a file, other files, another dataset without ``overwrite``).
    """
    if os.path.islink(path) and not os.path.exists(path):
        raise NotACacheError(
            f"'{path}' is a broken symbolic link. copy writes a cache directory there: remove the link, or choose "
            "another destination."
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotACacheError(
            f"'{path}' is a file, not a directory. copy writes a cache directory (data.mdb and lock.mdb inside) "
            "and never replaces a file: choose another destination."
        )
    if not os.path.isdir(path):
        return False, None
    _fs.check_lmdb_files(path)  # a linked file there is not a damaged cache to replace: refuse it
    names = os.listdir(path)
    if DATA_FILE not in names:
        others = sorted(n for n in names if n not in _CACHE_FILES and not n.startswith(_COPY_PREFIX))
        if others and not overwrite:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise NotACacheError(
                f"'{path}' is not empty and holds no lmdbcache cache (it has {shown}). Choose an empty or new "
                "directory, or pass --overwrite to put the cache beside those files (they are left alone)."
            )
        return False, None
    try:
        existing = info(path)
    except CorruptCacheError:
        return True, None  # unreadable: replacing it loses nothing
    except (NotACacheError, CacheMismatchError):
        if not overwrite:
            raise  # an LMDB file that is not a cache, or a cache in another format: says "overwrite"
        return True, None
    if not _same_dataset(existing, meta) and not overwrite:
        raise CacheMismatchError(
            f"'{path}' holds a cache of another dataset (fingerprint '{existing.fingerprint}', length "
            f"{existing.length}; the source has '{meta['fingerprint']}', {meta['length']}). Choose another "
            "destination, or pass --overwrite to replace it."
        )
    return True, existing


def _copy_into(source: Store, path: str) -> bool:
    """Copy ``source`` into a temporary directory inside ``path``, then swap it in; True if others had it open."""
    seen = _identity(os.path.join(path, DATA_FILE))
    created = not os.path.isdir(path)
    os.makedirs(path, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=_COPY_PREFIX, dir=path)  # same filesystem as path: the rename is atomic
    try:
        source.copy_to(tmp)
        _fs.sync_data_file(tmp)  # the copy is whole on the disk before it replaces anything
        others = _swap(path, tmp, seen)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # created by this call
        if created:
            try:
                os.rmdir(path)  # created by this call too; only if nothing else appeared in it
            except OSError:
                pass
        raise
    os.rmdir(tmp)  # empty now
    return others


def _swap(path: str, tmp: str, seen: tuple[int, int] | None) -> bool:
    """Rename ``tmp``'s data.mdb over ``path``'s and drop the old lock.mdb; True if others had it open."""
    import filelock

    data, lock_file = os.path.join(path, DATA_FILE), os.path.join(path, LOCK_FILE)
    try:
        with filelock.FileLock(os.path.join(path, WRITE_LOCK)).acquire(timeout=_SWAP_LOCK_TIMEOUT):
            if _identity(data) != seen:
                raise LmdbCacheError(
                    f"'{path}' changed while the copy was made (another copy, or a build, wrote its {DATA_FILE})"
                    "; nothing was replaced. Run the copy again."
                )
            others = _open_elsewhere(lock_file)
            # data.mdb first: the old lock file must never describe the new data file to a
            # process that opens it, and it goes right after (processes that opened the
            # cache keep both old files, unlinked).
            os.replace(os.path.join(tmp, DATA_FILE), data)
            try:
                os.remove(lock_file)
            except FileNotFoundError:
                pass
            # An unsynced-commits marker described the old file; the new one was synced above.
            _fs.clear_unsynced(path)
    except filelock.Timeout:
        raise LmdbCacheError(
            f"Cannot replace the cache at '{path}': a process kept its write lock ({WRITE_LOCK}) for "
            f"{_SWAP_LOCK_TIMEOUT:.0f} s. Nothing was replaced; try again when it has finished writing."
        ) from None
    return others


def _open_elsewhere(lock_file: str) -> bool:
    """Does another process have the LMDB environment open?

    Every process that has it open holds a shared fcntl lock on the first byte of lock.mdb
    (LMDB's ``mdb_env_share_locks``), so an exclusive one cannot be taken. Closing our
    descriptor drops every fcntl lock this process holds on the file, including those of an
    environment it has open itself; that only matters to a process replacing a cache it is
    reading, which loses the file anyway.
    """
    import fcntl

    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
