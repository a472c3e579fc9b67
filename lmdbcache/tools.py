"""Look after existing caches: info, verify, warm, copy and merge (the Python side of the CLI)."""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from . import _registry, codec
from . import store as _store
from .errors import (
    CacheMismatchError,
    CorruptCacheError,
    CorruptSampleError,
    LmdbCacheError,
    LmdbCacheWarning,
    NotACacheError,
)

__all__ = ["CopyResult", "MergeResult", "VerifyResult", "copy", "info", "merge", "verify", "warm"]

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
        "library_version": meta.get("library_version"),
        "created": meta.get("created"),
        "size_bytes": os.path.getsize(data),
        "map_size": env_info["map_size"],
    }


# ---------------------------------------------------------------------- verify


@dataclasses.dataclass
class VerifyResult:
    """What ``verify`` found. ``bad`` entries can be deleted (``repair``); ``crashed`` and
    ``unreadable`` mean the file itself is damaged, which deleting entries cannot fix."""

    checked: int  # entries read and decoded
    bad: list[int]  # damaged entries, in index order
    repaired: int = 0  # of those, how many ``repair`` deleted
    # The file crashed the reader (a signal): where and with what, e.g. "the LMDB file crashed
    # the reader at index 7 (after 7 good entries) with SIGBUS". The scan stopped there.
    crashed: str | None = None
    # The scan met damage it cannot read past (a key that is not an index, a broken B-tree page).
    unreadable: str | None = None
    unrepaired: dict[int, str] = dataclasses.field(default_factory=dict)  # bad entries repair could not delete
    signal: str | None = None  # the signal that ended the reader ("SIGBUS"), with ``crashed``

    @property
    def intact(self) -> bool:
        return not self.bad and self.crashed is None and self.unreadable is None

    @property
    def file_damaged(self) -> bool:
        """The file itself is damaged, beyond what deleting values can fix: it crashed the
        reader (SIGSEGV, SIGBUS, ...), or holds damage the scan cannot read past. A reader
        killed from outside (SIGKILL: out of memory?) sets ``crashed`` but not this."""
        return self.unreadable is not None or self.signal in _FAULTS


# Signals the file's damage itself can cause (bad page numbers and lengths); others came from outside.
_FAULTS = {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"}
_CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from lmdbcache._scan import main; sys.exit(main(sys.argv[2:]))"


def verify(
    path: str | os.PathLike[str],
    *,
    repair: bool = False,
    progress: Progress = None,
    started: Callable[[int], Any] | None = None,
) -> VerifyResult:
    """Decode every stored value and check its checksums (bound to its index); with ``repair``, delete the bad ones.

    Deleted entries are decoded again from the source on their next read (or by the next
    ``precompute``). Entries whose index is outside the dataset count as bad. ``started``
    is called once with the number of entries to check, ``progress(1)`` once per entry.

    The scan runs in a child process (``_scan``): a damaged file can crash LMDB's reader
    with SIGSEGV or SIGBUS, which no exception can catch. Such a crash comes back as
    ``crashed`` (the index it was reading and the signal), damage the scan cannot read
    past as ``unreadable``; in both cases nothing is deleted, whatever ``repair`` says.
    This process never opens the file. Errors (no cache at ``path``, a read-only
    directory with ``repair``) are raised here as the child met them.
    """
    path = os.path.abspath(os.fspath(path))
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as stderr:
        try:
            argv = [sys.executable, "-c", _CHILD, package_parent, path, str(write_fd)]
            child = subprocess.Popen(
                [*argv, *(["--repair"] if repair else [])],
                pass_fds=(write_fd,),
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        state = _ScanState()
        try:
            with os.fdopen(read_fd, "rb") as pipe:
                for line in pipe:
                    state.read(line, progress, started)
            code = child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
        if state.error is not None:
            raise state.error
        if state.done is not None:
            return state.result()
        if code < 0:
            return state.result(crash=-code)
        if code == 130:
            raise KeyboardInterrupt  # the child got the terminal's Ctrl-C first
        stderr.seek(0)
        lines = stderr.read().decode(errors="replace").strip().splitlines() or [f"exit status {code}"]
        raise LmdbCacheError(
            f"verify's reader of '{path}' failed ({lines[-1]}). This is a bug in lmdbcache; please report it."
        )


class _ScanState:
    """The parent's view of the child's report (see ``_scan`` for the messages)."""

    def __init__(self) -> None:
        self.reading: tuple[str, Any] = ("opening", None)  # what the child was doing last
        self.started = 0  # values the child began to read
        self.bad: dict[int, str] = {}
        self.unreadable: str | None = None
        self.unrepaired: dict[int, str] = {}
        self.deleted = 0
        self.error: BaseException | None = None
        self.done: tuple[int, int] | None = None

    def read(self, line: bytes, progress: Progress, started: Callable[[int], Any] | None) -> None:
        tag, _, text = line.decode().rstrip("\n").partition(" ")
        if tag == "r":
            self.reading = ("value", int(text))
            self.started += 1
            if progress is not None:
                progress(1)
        elif tag == "k":
            self.reading = ("keys", int(text))
        elif tag == "b":
            index, why = json.loads(text)
            self.bad[index] = why
        elif tag == "s":
            self.reading = ("keys", -1)
            total = int(text.split()[1])
            if started is not None and total >= 0:
                started(total)
        elif tag == "u":
            after, why = json.loads(text)
            good = self.started - len(self.bad)
            if after is None:
                self.unreadable = f"after {good} good entries, {why}"
            else:
                where = "the start" if after < 0 else f"index {after}"
                self.unreadable = f"the scan cannot read past {where} (after {good} good entries): {why}"
        elif tag == "d":
            self.reading = ("delete", json.loads(text))
        elif tag == "x":
            self.deleted += int(text)
        elif tag == "f":
            index, why = json.loads(text)
            self.unrepaired[index] = why
        elif tag == "w":
            category, message = json.loads(text)
            warnings.warn(message, LmdbCacheWarning if category == "LmdbCacheWarning" else UserWarning, stacklevel=3)
        elif tag == "e":
            name, message = json.loads(text)
            self.error = _error_class(name)(message)
        elif tag == "z":
            checked, deleted = map(int, text.split())
            self.done = (checked, deleted)

    def result(self, crash: int | None = None) -> VerifyResult:
        bad = sorted(self.bad)
        if crash is None:
            checked, deleted = self.done or (self.started, 0)
            return VerifyResult(checked, bad, deleted, None, self.unreadable, self.unrepaired)
        name = signal.Signals(crash).name if crash in signal.Signals._value2member_map_ else f"signal {crash}"
        what, where = self.reading
        checked = self.started - (what == "value")
        good = checked - len(bad)
        if what == "value":
            place = f"at index {where} (after {good} good entries)"
        elif what == "keys":
            entry = "the first entry" if where < 0 else f"the entry after index {where}"
            place = f"at {entry} (after {good} good entries)"
        elif what == "delete":
            place = f"while deleting the damaged entries {', '.join(map(str, where[:10]))}"
        else:
            place = "while opening the cache"
        if name in _FAULTS:
            crashed = f"the LMDB file crashed the reader {place} with {name}"
        else:
            crashed = f"the reader was killed {place} by {name} (out of memory? a damaged length can ask for gigabytes)"
        return VerifyResult(checked, bad, self.deleted, crashed, self.unreadable, self.unrepaired, name)


def _error_class(name: str) -> type[BaseException]:
    """The class of an error the child met, by name: one of ours or a builtin OSError."""
    from . import errors

    found = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, (LmdbCacheError, OSError)):
        return found
    return LmdbCacheError


# ---------------------------------------------------------------------- warm


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


# ---------------------------------------------------------------------- copy


@dataclasses.dataclass
class CopyResult:
    action: str  # "copied", "replaced" or "unchanged"
    cached: int
    length: int
    seconds: float
    # Other processes had the replaced cache open: they go on reading the old file until they
    # reopen the cache, and what they add to it is lost (see ``copy``).
    others_had_it_open: bool = False


# The files a cache directory may hold that are the cache's own (LMDB's and our write lock);
# ``copy`` touches nothing else but its own temporary directory.
_CACHE_FILES = {_store.DATA_FILE, _store.LOCK_FILE, _store.WRITE_LOCK, "data.mdb-lock"}
_COPY_PREFIX = ".lmdbcache-copy-"
_SWAP_LOCK_TIMEOUT = 60.0
# What _destination returns for a cache it cannot read (damaged, or replaced with overwrite).
_UNREADABLE: dict[str, Any] = {"complete": False}


def copy(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False) -> CopyResult:
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
    source = _open(src)
    try:
        meta = source.meta()
        dst_path = os.path.abspath(os.fspath(dst))
        if os.path.realpath(dst_path) == os.path.realpath(source.path):
            raise LmdbCacheError(f"Cannot copy '{source.path}' onto itself.")
        existing = _destination(dst_path, meta, overwrite)
        seen = _identity(os.path.join(dst_path, _store.DATA_FILE))
        if existing is not None and existing["complete"] and _same_dataset(existing, meta):
            return CopyResult("unchanged", existing["cached"], meta["length"], time.perf_counter() - start)
        created = not os.path.isdir(dst_path)
        os.makedirs(dst_path, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=_COPY_PREFIX, dir=dst_path)  # same filesystem as dst: the rename is atomic
        try:
            source.copy_to(tmp)
            others = _swap(dst_path, tmp, seen)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # created by this call
            if created:
                try:
                    os.rmdir(dst_path)  # created by this call too; only if nothing else appeared in it
                except OSError:
                    pass
            raise
        os.rmdir(tmp)  # empty now
    finally:
        _registry.release(source)
    copied = info(dst_path)
    action = "copied" if existing is None else "replaced"
    return CopyResult(action, copied["cached"], copied["length"], time.perf_counter() - start, others)


def _same_dataset(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool((a["fingerprint"], a["length"]) == (b["fingerprint"], b["length"]))


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _destination(path: str, meta: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """``info`` of the cache at copy's destination, ``_UNREADABLE``, or None if there is none.

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
        return None
    names = os.listdir(path)
    if _store.DATA_FILE not in names:
        others = sorted(n for n in names if n not in _CACHE_FILES and not n.startswith(_COPY_PREFIX))
        if others and not overwrite:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise NotACacheError(
                f"'{path}' is not empty and holds no lmdbcache cache (it has {shown}). Choose an empty or new "
                "directory, or pass --overwrite to put the cache beside those files (they are left alone)."
            )
        return None
    try:
        existing = info(path)
    except CorruptCacheError:
        return _UNREADABLE  # unreadable: replacing it loses nothing
    except (NotACacheError, CacheMismatchError):
        if not overwrite:
            raise  # an LMDB file that is not a cache, or a cache in another format: says "overwrite"
        return _UNREADABLE
    if not _same_dataset(existing, meta) and not overwrite:
        raise CacheMismatchError(
            f"'{path}' holds a cache of another dataset (fingerprint '{existing['fingerprint']}', length "
            f"{existing['length']}; the source has '{meta['fingerprint']}', {meta['length']}). Choose another "
            "destination, or pass --overwrite to replace it."
        )
    return existing


def _swap(path: str, tmp: str, seen: tuple[int, int] | None) -> bool:
    """Rename ``tmp``'s data.mdb over ``path``'s and drop the old lock.mdb; True if others had it open."""
    import filelock

    data, lock_file = os.path.join(path, _store.DATA_FILE), os.path.join(path, _store.LOCK_FILE)
    try:
        with filelock.FileLock(os.path.join(path, _store.WRITE_LOCK)).acquire(timeout=_SWAP_LOCK_TIMEOUT):
            if _identity(data) != seen:
                raise LmdbCacheError(
                    f"'{path}' changed while the copy was made (another copy, or a build, wrote its {_store.DATA_FILE})"
                    "; nothing was replaced. Run the copy again."
                )
            others = _open_elsewhere(lock_file)
            # data.mdb first: the old lock file must never describe the new data file to a
            # process that opens it, and it goes right after (processes that opened the
            # cache keep both old files, unlinked).
            os.replace(os.path.join(tmp, _store.DATA_FILE), data)
            try:
                os.remove(lock_file)
            except FileNotFoundError:
                pass
    except filelock.Timeout:
        raise LmdbCacheError(
            f"Cannot replace the cache at '{path}': a process kept its write lock ({_store.WRITE_LOCK}) for "
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
) -> MergeResult:
    """Merge shard caches of one dataset into ``out`` (created if missing).

    Every shard must have the same fingerprint and length as the others (and as ``out`` if
    it exists); a shard listed twice, or ``out`` listed as a shard, is refused. Every value
    is verified (checksums bound to its index; nothing in it is executed) and copied byte
    for byte; indices already in ``out`` are skipped.
    """
    start = time.perf_counter()
    shard_paths = [os.path.abspath(os.fspath(s)) for s in shards]
    out_path = os.path.abspath(os.fspath(out))
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
        seen[real] = path
    metas = []
    for path in shard_paths:
        store = _open(path)
        try:
            metas.append((path, store.meta()))
        finally:
            _registry.release(store)
    first_path, first = metas[0]
    for path, meta in metas[1:]:
        if not _same_dataset(meta, first):
            raise CacheMismatchError(
                f"Shard '{path}' belongs to another dataset (fingerprint '{meta['fingerprint']}', length "
                f"{meta['length']}) than '{first_path}' ('{first['fingerprint']}', {first['length']}). "
                "Merge only shards built from one dataset."
            )
    length = first["length"]
    written = skipped = 0
    target = _registry.acquire(out_path, map_size=max(64 << 20, _total_size(shard_paths)))
    try:
        build = target.initialize(length=length, fingerprint=first["fingerprint"])["cache_id"]
        for path in shard_paths:
            source = _open(path)
            try:
                pending: list[tuple[int, bytes]] = []
                for index, value in source.iter_raw(chunk=batch):
                    _check_shard_value(path, index, value, length)
                    pending.append((index, value))
                    if len(pending) >= batch:
                        added = target.put_many(pending, build)
                        written, skipped = written + added, skipped + len(pending) - added
                        pending = []
                    if progress is not None:
                        progress(1)
                added = target.put_many(pending, build)
                written, skipped = written + added, skipped + len(pending) - added
            finally:
                _registry.release(source)
        cached = target.count()
    finally:
        _registry.release(target)
    return MergeResult(out_path, len(shard_paths), written, skipped, cached, length, time.perf_counter() - start)


def _check_shard_value(path: str, index: int, value: bytes, length: int) -> None:
    if index >= length:
        why = f"the index is outside the dataset (length {length})"
    else:
        try:
            codec.decode(value, index)
            return
        except CorruptSampleError as exc:
            why = str(exc)
        except Exception as exc:  # the codec must not raise anything else on damaged bytes; refuse anyway
            why = f"{type(exc).__name__}: {exc}"
    raise CorruptSampleError(
        f"Shard '{path}': index {index} is damaged ({why}). Run `lmdbcache verify --repair {path}` and rebuild the "
        "missing entries, then merge again (indices already merged are skipped)."
    )


def _total_size(paths: list[str]) -> int:
    return sum(os.path.getsize(os.path.join(p, _store.DATA_FILE)) for p in paths)
