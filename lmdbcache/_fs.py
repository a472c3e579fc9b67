"""The cache directory and its files: what may be in it, whether they are whole, where it lives.

A cache directory holds LMDB's ``data.mdb`` and ``lock.mdb`` and our ``lmdbcache.lock``.
These checks run before LMDB touches a file, so a directory of someone else's files, a
truncated data file or a full disk is refused with a clear error instead of being
overwritten or crashing the process (SIGBUS). Also: the filesystem type (LMDB is unsafe on
network filesystems) and write access.
"""

from __future__ import annotations

import os
import shutil
import warnings

from ._options import MIB
from .errors import CacheFullError, CorruptCacheError, LmdbCacheWarning, NotACacheError

__all__ = [
    "DATA_FILE",
    "LOCK_FILE",
    "WRITE_LOCK",
    "check_data_file",
    "check_dir",
    "check_free_space",
    "check_size",
    "filesystem_type",
    "remove_lmdb_files",
    "warn_if_network_fs",
    "writable",
]

DATA_FILE, LOCK_FILE, WRITE_LOCK = "data.mdb", "lock.mdb", "lmdbcache.lock"
_OUR_FILES = {DATA_FILE, LOCK_FILE, WRITE_LOCK, "data.mdb-lock"}
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
        warnings.warn(
            f"Cache '{path}' is on a network filesystem ({fstype}). LMDB's locking is not safe there: use it from "
            "one machine only, or better, build or copy the cache to a local disk (`lmdbcache copy`).",
            LmdbCacheWarning,
            stacklevel=4,
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


def check_size(path: str, needed: int) -> None:
    """A data.mdb shorter than its last page (``needed`` bytes) would SIGBUS on read: refuse it up front."""
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    if size < needed:
        raise CorruptCacheError(
            f"Cache '{path}' is damaged: {DATA_FILE} is {size} bytes but its pages need {needed} "
            "(truncated by a copy or a full disk?). Delete the directory, or pass overwrite=True to rebuild it."
        )


def remove_lmdb_files(path: str) -> None:
    """Delete LMDB's two files (never anything else in the directory)."""
    for name in (DATA_FILE, LOCK_FILE):
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass
