"""The cache directory: read-only use, damaged and foreign files, and the golden format-1 cache."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from helpers import Synthetic, assert_same, sample_for
from test_processes import run_script

import lmdbcache
from lmdbcache import (
    CachedDataset,
    CorruptCacheError,
    NotACacheError,
    ReadOnlyCacheError,
    _registry,
)

GOLDEN = Path(__file__).parent / "data" / "golden-v1"


def golden_samples():
    """The samples stored in tests/data/golden-v1 (see tests/data/make_golden.py)."""
    return [
        (torch.arange(12, dtype=torch.uint8).reshape(3, 2, 2), 7),
        {
            "x": np.arange(6, dtype="<f4").reshape(2, 3),
            "tokens": [torch.tensor([1, 2, 3]), torch.tensor([4])],
            "id": "a",
        },
        [None, True, 2**70, -1.5, b"raw", ("t", 1)],
        (np.float32(0.5), torch.tensor(3.0, dtype=torch.bfloat16)),
    ]


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` as a read-only location: a read-only bind mount as root, else chmod."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.iterdir()]}
        for p in modes:
            p.chmod(0o555 if p.is_dir() else 0o444)
        try:
            yield path
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    mount = path.parent / (path.name + "-ro")
    mount.mkdir()
    try:
        subprocess.run(["mount", "--bind", str(path), str(mount)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make a read-only location here (bind mount failed: {exc})")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True, capture_output=True)
        yield mount
    finally:
        _registry._flush_all_at_exit()  # a handle left open would keep the mount busy
        subprocess.run(["umount", str(mount)], check=True, capture_output=True)
        mount.rmdir()


def test_complete_cache_reads_from_a_read_only_location(cache_dir):
    """A complete cache on a read-only mount reads fine, from this and other processes, without a source."""
    with CachedDataset(Synthetic(20), cache_dir) as ds:
        ds.__getitems__(list(range(20)))
    with read_only(cache_dir) as ro:
        assert not os.access(ro, os.W_OK)
        ds = CachedDataset(Synthetic(20), ro)
        for i in range(20):
            assert_same(ds[i], sample_for(i))
        alone = CachedDataset.open(ro)
        assert alone.is_complete
        alone.close()
        script = """
            import sys
            from helpers import sample_for, assert_same
            from lmdbcache import CachedDataset
            ds = CachedDataset.open(sys.argv[1])
            for i in range(20):
                assert_same(ds[i], sample_for(i))
        """
        for _ in range(2):
            run_script(script, str(ro))
        ds.close()


def test_writing_to_a_read_only_cache_is_a_clear_error(cache_dir):
    """A miss in a read-only cache with a source raises ReadOnlyCacheError; rebuilding or creating there too."""
    with CachedDataset(Synthetic(20), cache_dir) as ds:
        ds[0]
    with read_only(cache_dir) as ro:
        ds = CachedDataset(Synthetic(20), ro)
        assert_same(ds[0], sample_for(0))
        with pytest.raises(ReadOnlyCacheError, match="read-only") as info:
            ds[1]
        assert isinstance(info.value, PermissionError) and "index 1" in str(info.value)
        with pytest.raises(ReadOnlyCacheError):
            CachedDataset(Synthetic(20), ro, overwrite=True)
        ds.close()
    empty = cache_dir.parent / "empty"
    empty.mkdir()
    with read_only(empty) as ro, pytest.raises(ReadOnlyCacheError, match="Choose a writable location"):
        CachedDataset(Synthetic(3), Path(ro) / "new")


def test_directory_with_other_files_is_refused(tmp_path):
    """A non-empty directory holding no cache is refused; overwrite=True creates the cache beside the files."""
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(b"jpeg")
    with pytest.raises(NotACacheError, match=r"a\.jpg") as info:
        CachedDataset(Synthetic(3), folder)
    assert "overwrite=True" in str(info.value)
    assert sorted(os.listdir(folder)) == ["a.jpg"]
    ds = CachedDataset(Synthetic(3), folder, overwrite=True)
    ds[0]
    ds.close()
    assert (folder / "a.jpg").read_bytes() == b"jpeg"


def _cache_with(cache_dir, n=10):
    with CachedDataset(Synthetic(n), cache_dir) as ds:
        ds.__getitems__(list(range(n)))
    _registry._stores.clear()


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: p.write_bytes(b""), "0 bytes, too short"),
        (lambda p: p.write_bytes(os.urandom(1 << 16)), "not an LMDB file"),
        (lambda p: os.truncate(p, p.stat().st_size // 2), "truncated"),
    ],
    ids=["empty", "garbage", "truncated"],
)
def test_damaged_data_file_gives_its_own_error(cache_dir, damage, match):
    """An empty, garbage or truncated data.mdb raises CorruptCacheError (never a crash); overwrite=True rebuilds."""
    _cache_with(cache_dir, 200)
    damage(cache_dir / "data.mdb")
    size = (cache_dir / "data.mdb").stat().st_size
    with pytest.raises(CorruptCacheError, match=match):
        CachedDataset(Synthetic(200), cache_dir)
    with pytest.raises(CorruptCacheError):
        CachedDataset.open(cache_dir)
    assert (cache_dir / "data.mdb").stat().st_size == size  # nothing was overwritten without being asked
    ds = CachedDataset(Synthetic(200), cache_dir, overwrite=True)
    assert ds.cached_count == 0
    assert_same(ds[3], sample_for(3))
    ds.close()


def test_foreign_lmdb_environment_is_refused(cache_dir):
    """An LMDB environment written by something else is not mistaken for a cache."""
    with lmdb.open(str(cache_dir)) as env, env.begin(write=True) as txn:
        txn.put(b"someone", b"else")
    with pytest.raises(NotACacheError, match="did not create"):
        CachedDataset(Synthetic(3), cache_dir)
    ds = CachedDataset(Synthetic(3), cache_dir, overwrite=True)
    assert_same(ds[1], sample_for(1))
    ds.close()


def test_golden_format_1_cache_still_reads(tmp_path):
    """The tiny cache written by format 1 (tests/data/golden-v1) decodes to exactly its samples."""
    copy = tmp_path / "golden"
    copy.mkdir()
    shutil.copy(GOLDEN / "data.mdb", copy / "data.mdb")
    ds = CachedDataset.open(copy)
    meta = ds._live_store().meta()
    assert meta["format_version"] == 1 and meta["codec"] == "lmdbcache-msgpack/1" and meta["fingerprint"] == "golden"
    assert lmdbcache.FORMAT_VERSION == 1, "a new format must keep reading golden-v1; add a golden-v2 beside it"
    expected = golden_samples()
    assert len(ds) == len(expected) and ds.is_complete
    for i, sample in enumerate(expected):
        assert_same(ds[i], sample)
