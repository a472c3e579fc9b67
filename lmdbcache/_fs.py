"""Where a cache lives: the filesystem type (LMDB is unsafe on network filesystems) and write access."""

from __future__ import annotations

import os
import warnings

from .errors import LmdbCacheWarning

__all__ = ["filesystem_type", "warn_if_network_fs", "writable"]

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
