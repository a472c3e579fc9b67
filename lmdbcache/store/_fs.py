"""The cache directory and its files: what may be in it, whether they are whole, where it lives.

A cache directory holds LMDB's ``data.mdb`` and ``lock.mdb`` and our ``lmdbcache.lock``.
These checks run before LMDB touches a file, so a directory of someone else's files, a
truncated data file or a full disk is refused with a clear error instead of being
overwritten or crashing the process (SIGBUS). Also: the filesystem type (LMDB is unsafe on
network filesystems) and write access; and the unsynced-commits marker (below).

The marker. Commits are not fsynced (a cache can be rebuilt; a sync per commit bounds a fill
at the disk's flush rate), which a killed process survives (its writes are in the kernel's
page cache) but a kernel crash or power loss may not: LMDB's pages could reach the disk in
any order. So before the first unsynced commit, ``lmdbcache.unsynced`` is written (and
fsynced) holding this boot's id (``/proc/sys/kernel/random/boot_id``); a sync of the whole
file removes it. A cache opened in another boot with the marker present may be torn and is
rebuilt. Without a boot id (not Linux) every commit is synced instead.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from typing import Any

from .._options import MIB
from ..errors import CacheFullError, CorruptCacheError, NotACacheError, warn
from ._pages import reachable_past

__all__ = [
    "DATA_FILE",
    "LOCK_FILE",
    "WRITE_LOCK",
    "check_data_file",
    "check_dir",
    "check_free_space",
    "check_lmdb_files",
    "check_size",
    "clear_unsynced",
    "filesystem_type",
    "has_unsynced",
    "mark_unsynced",
    "marker_settings",
    "remove_lmdb_files",
    "sync_data_file",
    "unsynced_in_another_boot",
    "warn_if_network_fs",
    "writable",
]

DATA_FILE, LOCK_FILE, WRITE_LOCK = "data.mdb", "lock.mdb", "lmdbcache.lock"
UNSYNCED = "lmdbcache.unsynced"
_UNSYNCED_TMP = UNSYNCED + ".tmp"
_OUR_FILES = {DATA_FILE, LOCK_FILE, WRITE_LOCK, "data.mdb-lock", UNSYNCED, _UNSYNCED_TMP}
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
_MIN_DATA_FILE = 2 * 4096  # LMDB writes two meta pages before anything else

# Filesystems where LMDB's locking (fcntl locks + a shared-memory lock file) is unsafe.
NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "gpfs",
    "beegfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs", "fuse.glusterfs",
}  # fmt: skip


def writable(path: str) -> bool:
    """Can this process create files in ``path``? False on read-only mounts even for root."""
    return os.access(path, os.W_OK)


def filesystem_type(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem holding ``path`` (from /proc/self/mountinfo), or None if unknown."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    real = os.path.realpath(path)
    best, best_type = "", None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, right.split()[0]
    return best_type


_warned_paths: set[str] = set()


def warn_if_network_fs(path: str) -> None:
    fstype = filesystem_type(path)
    if fstype in NETWORK_FS and path not in _warned_paths:
        _warned_paths.add(path)
        warn(
            f"Cache '{path}' is on a network filesystem ({fstype}). LMDB's locking is not safe there: use it from "
            "one machine only, or better, build or copy the cache to a local disk (`lmdbcache copy`)."
        )


def check_free_space(path: str, max_readers: int) -> None:
    """Refuse to create LMDB's files on a full disk: LMDB writes lock.mdb through a memory map,
    and a page the filesystem cannot back kills the process with SIGBUS instead of an error."""
    if os.path.exists(os.path.join(path, LOCK_FILE)):
        return
    need = MIB + 64 * max_readers + 8192
    free = shutil.disk_usage(path).free
    if free < need:
        raise CacheFullError(
            f"The disk holding '{path}' is full ({free:,} bytes free; creating a cache needs at least "
            f"{need:,}). Free some space or choose another location."
        )


def check_dir(path: str, overwrite: bool) -> None:
    """Refuse a directory holding other files and no cache, unless asked to create one beside them."""
    names = set(os.listdir(path))
    foreign = sorted(names - _OUR_FILES)
    if foreign and DATA_FILE not in names and not overwrite:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise NotACacheError(
            f"'{path}' is not empty and holds no lmdbcache cache (it has {shown}). Use an empty or new "
            "directory, or pass overwrite=True to create the cache beside those files (they are left alone)."
        )


def check_lmdb_files(path: str) -> None:
    """Refuse a ``data.mdb``, ``lock.mdb`` or ``lmdbcache.lock`` that is not a regular file, before anything opens it.

    LMDB and filelock follow a symbolic link and write through it: LMDB rewrites a linked
    ``lock.mdb`` as its 65,664-byte lock table even for a read-only open, so a link there would
    overwrite a file outside the cache. No lmdbcache cache holds a link or a special file there.
    (A link swapped in between this check and LMDB's open is not caught: LMDB has no O_NOFOLLOW.)
    """
    for name in (DATA_FILE, LOCK_FILE, WRITE_LOCK):
        file = os.path.join(path, name)
        try:
            mode = os.lstat(file).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISREG(mode):
            continue
        what = _kind(mode)
        if stat.S_ISLNK(mode):
            what += f" to '{os.readlink(file)}'"
        if name == DATA_FILE:
            fix = (
                "Put the data file itself there (replace the link by the file it points to), or open the directory "
                "that holds it."
            )
        else:
            fix = f"Remove '{file}' (it holds no data: it is made again on the next open) and open the cache again."
        raise CorruptCacheError(
            f"Cache '{path}' holds '{name}' as {what}, where lmdbcache and LMDB keep a plain file; it was not opened, "
            f"so nothing it points to was written. {fix}"
        )


def check_data_file(path: str, overwrite: bool) -> bool:
    """Return False if data.mdb exists but is too short to be LMDB (and overwrite allows replacing it)."""
    data = os.path.join(path, DATA_FILE)
    try:
        size = os.path.getsize(data)
    except FileNotFoundError:
        return True
    if size >= _MIN_DATA_FILE:
        return True
    if overwrite:
        return False
    raise CorruptCacheError(
        f"Cache '{path}' is damaged: {DATA_FILE} is {size} bytes, too short for an LMDB environment "
        "(a crash while creating it?). Delete the directory, or pass overwrite=True to rebuild it."
    )


def check_size(path: str, needed: int, psize: int) -> None:
    """A data.mdb shorter than its last page (``needed`` bytes) would SIGBUS on a read of a page past its end: refuse
    it up front, unless no tree points past the end (LMDB can commit pages it never wrote: ``_pages``)."""
    data = os.path.join(path, DATA_FILE)
    size = os.path.getsize(data)
    if size >= needed:
        return
    past = reachable_past(data, psize)
    if past == -1:
        return  # only free pages are missing: every read and write stays inside the file
    where = f" (page {past} is in use)" if past is not None else ""
    raise CorruptCacheError(
        f"Cache '{path}' is damaged: {DATA_FILE} is {size} bytes but its pages need {needed}{where} "
        "(truncated by a copy or a full disk?). Delete the directory, or pass overwrite=True to rebuild it."
    )


def remove_lmdb_files(path: str) -> None:
    """Delete LMDB's two files and the marker that describes them (never anything else in the directory).

    A marker that is not a file (not ours) is refused first, before anything is deleted.
    """
    _check_marker(path)
    for name in (DATA_FILE, LOCK_FILE, UNSYNCED):
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass


def _check_marker(path: str) -> None:
    """Refuse a marker path that is not a regular file (a directory, FIFO, link: nothing lmdbcache makes)."""
    marker = os.path.join(path, UNSYNCED)
    try:
        mode = os.lstat(marker).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise CorruptCacheError(
            f"Cache '{path}' holds '{UNSYNCED}', which lmdbcache writes as a plain file, as something else "
            f"({_kind(mode)}); nothing was read or deleted. Remove '{marker}' and open the cache again (or "
            "pass overwrite=True to rebuild it)."
        )


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return "not a regular file"


def boot_id() -> str | None:
    """This boot's id (Linux), or None where there is none: then every commit is synced."""
    try:
        with open(BOOT_ID_FILE, "rb") as f:
            boot = f.read(64).strip().decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return boot or None


def mark_unsynced(path: str, settings: dict[str, Any] | None = None) -> bool:
    """Before an unsynced commit, under the write lock: make sure the marker holds this boot's id.

    Returns False when the commit must be synced instead (no boot id, or the marker cannot
    be written). A marker already there was written in this boot: a foreign one is dealt
    with when the cache is opened, before any commit. ``settings`` (the build's creation
    settings, e.g. its compression) go on the marker's second line, as JSON: a cache rebuilt
    after a crash keeps them without reading its possibly torn file (``marker_settings``).
    """
    marker = os.path.join(path, UNSYNCED)
    if os.path.exists(marker):
        return True
    boot = boot_id()
    if boot is None:
        return False
    tmp = os.path.join(path, _UNSYNCED_TMP)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, boot.encode("ascii") + b"\n" + json.dumps(settings or {}).encode("ascii") + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, marker)
        _fsync_dir(path)
    except OSError:
        return False
    return True


def has_unsynced(path: str) -> bool:
    """The marker is there (anything at its path: a non-file is refused when the cache is opened)."""
    return os.path.lexists(os.path.join(path, UNSYNCED))


def clear_unsynced(path: str) -> None:
    """After a sync of the whole data file, under the write lock: nothing unsynced is left.

    A marker path that cannot be removed (someone made it a directory) is left for the next
    open to refuse with a clear error.
    """
    try:
        os.remove(os.path.join(path, UNSYNCED))
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        pass


def unsynced_in_another_boot(path: str) -> str | None:
    """The boot id in the marker when it is not this boot's (commits of a boot that may have crashed), else None.

    The marker is untrusted input: anything but a regular file is refused (``_check_marker``),
    it is opened without following links or blocking, at most 64 bytes are read, and anything
    that is not this boot's id counts as another boot's.
    """
    _check_marker(path)
    try:
        fd = os.open(os.path.join(path, UNSYNCED), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped in after the check
            _check_marker(path)
            return "not a regular file"
        found = os.read(fd, 64).split(b"\n", 1)[0].strip().decode("ascii", "replace")
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    finally:
        os.close(fd)
    return None if found == boot_id() else found or "empty"


def marker_settings(path: str) -> dict[str, Any]:
    """The settings ``mark_unsynced`` wrote on the marker's second line; {} if none can be read.

    Untrusted (call after ``unsynced_in_another_boot`` accepted the path): at most 1 KiB
    read; the caller validates every value before use.
    """
    try:
        fd = os.open(os.path.join(path, UNSYNCED), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return {}
    try:
        lines = os.read(fd, 1024).split(b"\n")
        found = json.loads(lines[1]) if len(lines) > 2 else {}
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return found if isinstance(found, dict) else {}


def sync_data_file(path: str) -> None:
    """fsync data.mdb: every commit of every process is in its page cache, and goes down with it."""
    fd = os.open(os.path.join(path, DATA_FILE), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
