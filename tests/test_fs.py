"""The cache directory and its files: filesystem type, the network-filesystem warning."""

from __future__ import annotations

import pytest
from helpers import Synthetic

import lmdbcache
from lmdbcache import CachedDataset
from lmdbcache.store import _fs


def test_network_filesystem_warns_once(cache_dir, monkeypatch):
    """A cache directory on NFS (or another network filesystem) warns once that LMDB's locking is unsafe there."""
    monkeypatch.setattr(_fs, "filesystem_type", lambda path: "nfs4")
    with pytest.warns(lmdbcache.LmdbCacheWarning, match="network filesystem"):
        CachedDataset(Synthetic(3), cache_dir).close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CachedDataset(Synthetic(3), cache_dir).close()


def test_filesystem_type_from_mountinfo():
    """The filesystem type comes from the longest mount point containing the path."""
    mountinfo = (
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        "40 22 0:50 / /mnt/data rw - nfs4 server:/export rw\n"
        "41 40 0:51 / /mnt/data/local\\040dir rw - tmpfs tmpfs rw\n"
    )
    assert _fs.filesystem_type("/home/x", mountinfo) == "ext4"
    assert _fs.filesystem_type("/mnt/data/cache", mountinfo) == "nfs4"
    assert _fs.filesystem_type("/mnt/database", mountinfo) == "ext4"
    assert _fs.filesystem_type("/mnt/data/local dir/c", mountinfo) == "tmpfs"
