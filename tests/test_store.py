"""The cache directory: read-only use, damaged and foreign files, and the golden format-1 cache."""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import msgpack
import pytest
import torch
from helpers import (
    Listed,
    Synthetic,
    assert_same,
    drop_cached_pages,
    golden_samples,
    key,
    raw_cache,
    sample_for,
    source_reads,
    stored,
    unmount,
)
from test_processes import run_script

import lmdbcache
from lmdbcache import (
    CachedDataset,
    CacheMismatchError,
    CorruptCacheError,
    CorruptSampleError,
    LmdbCacheWarning,
    NotACacheError,
    ReadOnlyCacheError,
)
from lmdbcache.store import _fs, _pages, _registry

GOLDEN = Path(__file__).parent / "data" / "golden-v1"


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
    owner = path.parent / (path.name + "-ro.pid")  # whose mount: conftest's clean-up leaves a live run's alone
    owner.write_text(str(os.getpid()))
    try:
        subprocess.run(["mount", "--bind", str(path), str(mount)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make a read-only location here (bind mount failed: {exc})")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True, capture_output=True)
        yield mount
    finally:
        _registry._flush_all_at_exit()  # a handle left open would keep the mount busy
        unmount(mount)
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


def _fill_until_the_last_page_is(cache_dir, free: bool) -> CachedDataset:
    """A real lazy fill of Synthetic(400), a flush every 3 samples, stopped at the first commit after which the file's
    last page is (``free``) on no tree or (not ``free``) in use: judged on a copy cut one page short."""
    ds = CachedDataset(Synthetic(400), cache_dir)
    data = cache_dir / "data.mdb"
    for i in range(400):
        ds[i]
        if i % 3 == 2:
            ds.flush()
            copy = cache_dir.parent / "short.mdb"
            shutil.copyfile(data, copy)
            os.truncate(copy, data.stat().st_size - 4096)
            if (_pages.reachable_past(str(copy), 4096) == -1) == free:
                return ds
    raise AssertionError("no commit of the fill left its last page as asked")


def _short_file_whole(cache_dir) -> None:
    ds = _fill_until_the_last_page_is(cache_dir, free=True)
    filled = ds.cached_count
    ds.close()
    _registry._stores.clear()
    data = cache_dir / "data.mdb"
    os.truncate(data, data.stat().st_size - 4096)  # the state issue 38 met: one unwritten free page at the end
    with lmdb.open(str(cache_dir), readonly=True, lock=False) as env:
        assert data.stat().st_size < (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    cached = CachedDataset.open(cache_dir)
    assert len(cached) == 400 and cached.cached_count == filled
    for i in range(filled):
        assert_same(cached[i], sample_for(i))
    cached.close()
    ds = CachedDataset(Synthetic(400), cache_dir)  # opened with its source: the rest fills in
    for i in range(400):
        assert_same(ds[i], sample_for(i))
    ds.close()
    _registry._stores.clear()
    again = CachedDataset.open(cache_dir)
    assert again.cached_count == 400
    assert_same(again[399], sample_for(399))
    again.close()


def _short_file_cut(cache_dir) -> None:
    ds = _fill_until_the_last_page_is(cache_dir, free=False)
    ds.close()
    _registry._stores.clear()
    data = cache_dir / "data.mdb"
    os.truncate(data, data.stat().st_size - 4096)
    size = data.stat().st_size
    with pytest.raises(CorruptCacheError, match=r"pages need \d+ \(page \d+ is in use\) \(truncated by a copy"):
        CachedDataset.open(cache_dir)
    with pytest.raises(CorruptCacheError, match="truncated"):
        CachedDataset(Synthetic(400), cache_dir)
    assert data.stat().st_size == size


def _in_engine(engine: str, scenario: str, cache_dir) -> None:
    """Run ``scenario`` (a function of this module) over ``cache_dir`` here (LMDB 0.9) or in a child whose py-lmdb
    writes new caches with LMDB 1.0 (``LMDB_DEFAULT_LIB_VERSION=1``, read at import)."""
    if engine == "0.9":
        globals()[scenario](cache_dir)
        return
    try:
        if tuple(lmdb.version(lib_version=1))[:1] != (1,):
            raise TypeError
    except (TypeError, lmdb.Error):
        pytest.skip(f"py-lmdb {lmdb.__version__} has no LMDB 1.0 engine")
    code = (
        "import sys, pathlib, lmdb, test_store\n"
        f"test_store.{scenario}(pathlib.Path(sys.argv[1]))\n"
        "with lmdb.open(sys.argv[1], readonly=True, lock=False) as env:\n"
        "    assert env.lib_version()[:2] == (1, 0), env.lib_version()\n"
    )
    run_script(code, str(cache_dir), env={"LMDB_DEFAULT_LIB_VERSION": "1"})


@pytest.mark.parametrize("engine", ["0.9", "1.0"])
def test_a_file_short_only_by_free_pages_opens_and_reads_whole(cache_dir, engine):
    """A data.mdb shorter than LMDB's last page number only by pages on no tree (LMDB can commit a page it never
    writes; issue 38) opens, reads every sample back, takes more writes and opens again, on both paths and both
    of py-lmdb 3's engines."""
    _in_engine(engine, "_short_file_whole", cache_dir)


@pytest.mark.parametrize("engine", ["0.9", "1.0"])
def test_a_file_cut_through_a_page_in_use_is_refused_as_truncated(cache_dir, engine):
    """A data.mdb cut one page short where that page is on a tree is still refused with the truncation error,
    naming the page, and nothing is written."""
    _in_engine(engine, "_short_file_cut", cache_dir)


def test_a_last_page_number_far_past_the_end_is_refused_as_truncated(cache_dir):
    """A meta page whose last page number lies far past the end of a whole file (hostile, or a flipped bit) is
    refused as truncated, as before issue 38's change: the missing pages are on no free list, so a commit would
    write past them (a sparse data.mdb of a terabyte, found by the attack on the change)."""
    _cache_with(cache_dir, 50)
    data = cache_dir / "data.mdb"
    raw = bytearray(data.read_bytes())
    for meta in (0, 4096):  # both meta pages: mm_last_pg at byte 136 of LMDB 0.9's meta page
        last = struct.unpack_from("<Q", raw, meta + 136)[0]
        struct.pack_into("<Q", raw, meta + 136, last + 1_000_000)
    data.write_bytes(bytes(raw))
    size = data.stat().st_size
    with pytest.raises(CorruptCacheError, match="truncated by a copy"):
        CachedDataset(Synthetic(50), cache_dir)
    assert data.stat().st_size == size


def test_foreign_lmdb_environment_is_refused(cache_dir):
    """An LMDB environment written by something else is not mistaken for a cache."""
    with lmdb.open(str(cache_dir)) as env, env.begin(write=True) as txn:
        txn.put(b"someone", b"else")
    with pytest.raises(NotACacheError, match="did not create"):
        CachedDataset(Synthetic(3), cache_dir)
    ds = CachedDataset(Synthetic(3), cache_dir, overwrite=True)
    assert_same(ds[1], sample_for(1))
    ds.close()


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_golden_caches_still_read(tmp_path, version):
    """The tiny caches written by formats 1 to 4 (tests/data/golden-v*; v3 packed, v4 grouped) decode to exactly
    their samples."""
    copy = tmp_path / "golden"
    copy.mkdir()
    shutil.copy(GOLDEN.parent / f"golden-v{version}" / "data.mdb", copy / "data.mdb")
    ds = CachedDataset.open(copy)
    meta = ds._live_store().meta()
    assert meta["format_version"] == version and meta["fingerprint"] == "golden"
    assert version < lmdbcache.FORMAT_VERSION or version == lmdbcache.FORMAT_VERSION == 4, (
        "a new format must keep reading golden-v1 to v4; add a golden directory beside them"
    )
    expected = golden_samples(version)
    assert len(ds) == len(expected) and ds.is_complete
    for i, sample in enumerate(expected):
        assert_same(ds[i], sample)


# ---------------------------------------------------------------------- trust: hostile files and metadata


def data_offset(path, index: int) -> int:
    """Where index's tensor bytes (``sample_for(index)``, unique per index) lie in data.mdb."""
    data = (Path(path) / "data.mdb").read_bytes()
    needle = sample_for(index)[0].numpy().tobytes()
    offset = data.find(needle)
    assert offset >= 0 and data.find(needle, offset + 1) < 0
    return offset


def damage_data(path, index: int) -> None:
    """Flip the last data byte of index's value in place (what a bad disk or a stray write does)."""
    offset = data_offset(path, index) + len(sample_for(index)[0].numpy().tobytes()) - 1
    with open(Path(path) / "data.mdb", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def test_a_value_under_the_wrong_key_is_damage(cache_dir):
    """One flipped bit in a key must not serve another index's sample: reads and verify call it damage."""
    _cache_with(cache_dir, 10)
    with raw_cache(cache_dir) as (txn, samples, _):
        value = bytes(stored(txn, samples, 3))
        txn.delete(key(5), db=samples)
        txn.put(key(5), value, db=samples)  # what index 3's key with one bit flipped (3 -> 7, ...) amounts to
    ds = CachedDataset.open(cache_dir)
    assert_same(ds[3], sample_for(3))
    with pytest.raises(CorruptSampleError, match="index 5"):
        ds[5]
    with pytest.raises(CorruptSampleError, match="index 5"):
        ds.__getitems__([4, 5])
    from lmdbcache import tools

    assert tools.verify(cache_dir).bad == [5]


def test_damaged_structure_is_caught_on_every_read_even_after_the_first(cache_dir):
    """With checksum='once', a value damaged after its first read never comes back with another shape or dtype."""
    _cache_with(cache_dir, 6)
    ds = CachedDataset.open(cache_dir)
    assert_same(ds[2], sample_for(2))  # verified once
    start = data_offset(cache_dir, 2)
    with open(cache_dir / "data.mdb", "r+b") as f:  # a dimension in the flat signature, just before the data: 8 -> 9
        f.seek(start - 64)
        head = f.read(64)
        dim = head.rfind((8).to_bytes(8, "little"))
        assert dim > 0
        f.seek(start - 64 + dim)
        f.write((9).to_bytes(8, "little"))
    time.sleep(0.3)  # past the kept read transaction's age
    with pytest.raises(CorruptSampleError, match="index 2"):
        ds[2]


def _set_meta(path, change) -> None:
    with raw_cache(path) as (txn, _, meta_db):
        meta = msgpack.unpackb(txn.get(b"meta", db=meta_db))
        meta = change(meta)
        txn.put(b"meta", msgpack.packb(meta), db=meta_db)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda m: {k: v for k, v in m.items() if k != "cache_id"}, CorruptCacheError, "field 'cache_id' is missing"),
        (lambda m: {**m, "length": -1}, CorruptCacheError, "field 'length' is -1, expected an integer from 0"),
        (lambda m: {**m, "length": "4"}, CorruptCacheError, "field 'length' is '4'"),
        (lambda m: {**m, "length": 2**64 - 1}, CorruptCacheError, "field 'length' is 18446744073709551615"),
        (lambda m: {k: v for k, v in m.items() if k != "fingerprint"}, CorruptCacheError, "'fingerprint' is missing"),
        (lambda m: {**m, "cache_id": ""}, CorruptCacheError, "field 'cache_id' is ''"),
        (lambda m: {**m, "format_version": "2"}, CorruptCacheError, "'format_version' is '2', not an integer"),
        (lambda m: [1, 2], NotACacheError, "metadata is not lmdbcache's"),
        (lambda m: {**m, "format_version": 99}, CacheMismatchError, "format 99.*upgrade lmdbcache"),
    ],
    ids=[
        "no-cache_id",
        "length--1",
        "length-str",
        "length-huge",
        "no-fingerprint",
        "empty-id",
        "format-str",
        "not-a-map",
        "newer",
    ],
)
def test_hostile_metadata_is_a_clear_error(cache_dir, change, error, match):
    """Hand-edited or hostile metadata is refused naming the field, with and without the source; nothing is lost."""
    _cache_with(cache_dir, 5)
    _set_meta(cache_dir, change)
    size = (cache_dir / "data.mdb").stat().st_size
    for open_it in (lambda: CachedDataset(Synthetic(5), cache_dir), lambda: CachedDataset.open(cache_dir)):
        with pytest.raises(error, match=match):
            open_it()
    assert (cache_dir / "data.mdb").stat().st_size == size


def test_unreadable_metadata_is_a_clear_error(cache_dir):
    """Metadata bytes that are not msgpack are CorruptCacheError, not a raw msgpack exception."""
    _cache_with(cache_dir, 3)
    with raw_cache(cache_dir) as (txn, _, meta_db):
        txn.put(b"meta", b"\xc1\xc1garbage", db=meta_db)
    with pytest.raises(CorruptCacheError, match="unreadable metadata"):
        CachedDataset.open(cache_dir)


def test_format_1_cache_is_filled_in_the_current_format_and_still_reads(tmp_path):
    """Opening a format-1 cache with its source marks it format 4 (same build); old and new values both read."""
    copy = tmp_path / "golden"
    copy.mkdir()
    shutil.copy(GOLDEN / "data.mdb", copy / "data.mdb")
    reader = CachedDataset.open(copy)
    expected = golden_samples()
    assert_same(reader[0], expected[0])
    extra = Listed([*expected, (torch.ones(2), 5)])
    with pytest.raises(CacheMismatchError, match="length"):
        CachedDataset(extra, copy, fingerprint="golden")
    source = Listed(expected)
    ds = CachedDataset(source, copy, fingerprint="golden")
    meta = ds._live_store().meta()
    assert meta["format_version"] == lmdbcache.FORMAT_VERSION == 4 and meta["upgraded_from"] == 1
    assert "compress" not in meta  # an upgraded cache stores values as they are encoded
    time.sleep(0.3)
    for i, sample in enumerate(expected):
        assert_same(reader[i], sample)  # the reader was not told the cache was rebuilt: it was not
    ds.close()
    reader.close()


def test_an_lmdb_error_while_reading_becomes_a_library_error(cache_dir):
    """A page number past the end of the file (a damaged branch page) is CorruptCacheError naming the path."""
    _cache_with(cache_dir, 300)
    data = bytearray((cache_dir / "data.mdb").read_bytes())
    # Find the samples database's root page through LMDB and point its first child far past the end.
    with raw_cache(cache_dir, write=False) as (txn, samples, _):
        depth = txn.stat(samples)["depth"]
    assert depth >= 2
    psize = 4096
    for pgno in range(2, len(data) // psize):
        page = data[pgno * psize : (pgno + 1) * psize]
        flags = int.from_bytes(page[10:12], "little")
        if flags & 0x01:  # P_BRANCH
            lower = int.from_bytes(page[12:14], "little")
            ptr = int.from_bytes(page[16:18], "little")  # first node
            data[pgno * psize + ptr : pgno * psize + ptr + 6] = (10**6).to_bytes(6, "little")
            del lower
            break
    else:
        pytest.fail("no branch page found")
    (cache_dir / "data.mdb").write_bytes(bytes(data))
    ds = CachedDataset.open(cache_dir)
    with pytest.raises((CorruptCacheError, CorruptSampleError)) as info:
        for i in range(300):
            ds[i]
    assert str(cache_dir) in str(info.value)


def test_a_cache_grown_past_its_map_size_can_be_rebuilt_and_upgraded(cache_dir):
    """LMDB maps a file larger than map_size at exactly its size; a rebuild or metadata update still has room."""
    big = Listed([(torch.full((1 << 18,), k, dtype=torch.uint8), k) for k in range(12)])  # 3 MiB in a 1 MiB map
    with CachedDataset(big, cache_dir, map_size=1 << 20) as ds:
        ds.__getitems__(list(range(12)))
    _registry._stores.clear()
    _set_meta(cache_dir, lambda m: {**m, "format_version": 1})  # as v0.1.0 wrote it: opening upgrades it in place
    with CachedDataset(big, cache_dir, map_size=1 << 20) as ds:
        assert ds._live_store().meta()["format_version"] == lmdbcache.FORMAT_VERSION
    _registry._stores.clear()
    with CachedDataset(big, cache_dir, map_size=1 << 20, overwrite=True) as ds:
        assert ds.cached_count == 0
        assert ds[3][1] == 3


def test_creating_a_cache_on_a_full_disk_is_a_clear_error(tmp_path):
    """A full disk at creation is CacheFullError, before LMDB maps a lock file it cannot back (SIGBUS)."""
    from helpers import small_disk

    with small_disk(tmp_path, "4m") as mount:
        filler = mount / "filler"
        with open(filler, "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        code = (
            "import sys; from helpers import Synthetic; from lmdbcache import CachedDataset, CacheFullError\n"
            "try:\n    CachedDataset(Synthetic(3), sys.argv[1])\nexcept CacheFullError as exc:\n    print('full', exc)"
        )
        out = run_script(code, str(mount / "c"))  # a child: a SIGBUS would kill it, not the test run
        assert out.stdout.startswith("full") and "is full" in out.stdout
        filler.unlink()


def test_a_cache_in_a_temporary_directory_ends_its_script_without_a_warning(tmp_path):
    """A script that fills a cache in a TemporaryDirectory, flushes and lets the directory go ends silently under
    -W error: the exit hook's sync found no file, but nothing decoded was lost (issue 38 warned of a loss)."""
    code = (
        "import tempfile; from helpers import Synthetic; from lmdbcache import CachedDataset\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    ds = CachedDataset(Synthetic(50), d + '/c')\n"
        "    for i in range(50):\n        ds[i]\n"
        "    ds.flush()\n"
        "print('done')\n"
    )
    out = run_script("import warnings; warnings.simplefilter('error')\n" + code)
    assert out.stdout == "done\n" and out.stderr == ""


def test_a_daemon_thread_filling_at_exit_loses_nothing_it_returned(tmp_path):
    """A daemon thread filling misses while the script ends: every sample a read returned is in the cache, and a
    read after the exit's flush raises CacheClosedError instead of queueing where nothing commits (the attack on
    issue 38 found 1-10 returned samples lost, silently)."""
    log = tmp_path / "returned"
    code = (
        "import os, sys, threading, time\n"
        "from helpers import Synthetic\n"
        "from lmdbcache import CachedDataset\n"
        "ds = CachedDataset(Synthetic(100000, delay=0.0005), sys.argv[1])\n"
        "log = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
        "def fill():\n"
        "    for i in range(100000):\n"
        "        ds[i]\n"
        "        os.write(log, b'%d\\n' % i)\n"
        "threading.Thread(target=fill, daemon=True).start()\n"
        "time.sleep(0.5)\n"
    )
    for _ in range(3):
        out = run_script(code, str(tmp_path / "c"), str(log))
        assert "Traceback" not in out.stderr or "CacheClosedError: Cache" in out.stderr, out.stderr[-2000:]
    returned = sorted({int(x) for x in log.read_text().split()})
    assert returned
    cached = CachedDataset.open(tmp_path / "c")
    for i in returned:
        assert_same(cached[i], sample_for(i))
    cached.close()


def test_samples_lost_at_exit_are_counted_in_the_warning(tmp_path):
    """Misses still queued at exit whose commit fails (a full disk) are named in one warning: how many, which
    cache, and why; nothing else is said."""
    from helpers import small_disk

    with small_disk(tmp_path, "2m") as mount:
        code = (
            "import sys, torch; from torch.utils.data import Dataset; from lmdbcache import CachedDataset\n"
            "class Big(Dataset):\n"
            "    def __len__(self): return 40\n"
            "    def __getitem__(self, i): return (torch.full((100_000,), i, dtype=torch.uint8),)\n"
            "ds = CachedDataset(Big(), sys.argv[1], commit_every=1000, commit_bytes=1 << 30, commit_interval=3600)\n"
            "for i in range(40):\n    ds[i]\n"
        )
        out = run_script(code, str(mount / "c"))
        lines = [line for line in out.stderr.splitlines() if "LmdbCacheWarning" in line]
        assert len(lines) == 1, out.stderr
        assert f"40 samples decoded by this process were not committed to cache '{mount / 'c'}' at exit" in lines[0]


# ---------------------------------------------------------------------- cold reads: large values announced first


def big_sample(i: int) -> tuple[torch.Tensor, int]:
    """A sample whose stored value (~27 KiB) is over _guard.PREFETCH_MIN, unique per index."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (3, 96, 96), dtype=torch.uint8, generator=g), i


@pytest.fixture
def advice(monkeypatch):
    """Every read counted as cold (so the prefetch path always runs); the madvise calls it makes, recorded.

    On the Python path: the compiled core announces values itself (mincore, then madvise, in C; its
    cold and warm reads are tested in tests/test_native.py).
    """
    from lmdbcache import _native
    from lmdbcache.store import _guard, _read

    monkeypatch.setattr(_native, "core", None)

    calls: list[tuple[int, int, int]] = []
    real = _guard._madvise

    def recording(address, length, advice):
        calls.append((address, length, advice))
        return real(address, length, advice) if real is not None else 0

    monkeypatch.setattr(_read, "_COLD", -1.0)
    monkeypatch.setattr(_guard, "_madvise", recording)
    return calls


def evict(cache_dir) -> None:
    """Drop data.mdb from the page cache, this process's mapped pages included (so the next reads are cold)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    real = os.path.realpath(cache_dir / "data.mdb")
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.realpath(fields[5].strip()) == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                assert libc.madvise(lo, hi - lo, 4) == 0  # MADV_DONTNEED: drop the page-table entries
    fd = os.open(real, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _big_cache(cache_dir, n: int = 24) -> None:
    ds = CachedDataset(Listed([big_sample(i) for i in range(n)]), cache_dir)
    for i in range(n):
        ds[i]
    ds.close()


_COLD_CHILD = """
import os, random, resource, sys
from lmdbcache import CachedDataset

def read_bytes():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))

ds = CachedDataset.open(sys.argv[1])
order = random.Random(int(sys.argv[2])).sample(range(len(ds)), len(ds))
before, io = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, read_bytes()
for i in order:
    image, label = ds[i]
    assert label == i
print(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before, read_bytes() - io)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="counts major page faults and /proc/self/io: Linux")
@pytest.mark.parametrize("pure", [False, True], ids=["core", "pure-python"])
def test_cold_large_values_are_read_in_one_request_not_a_fault_per_page(cache_dir, pure):
    """Large values read from the disk are announced before they are copied, on both paths: a fresh process
    reading 60 evicted 27 KiB values in random order takes under 2 major page faults a value, not the 7 a value
    of unannounced 4 KiB faults (issue 39: the core asked about a page it had touched, 37 faults a 150 KB value).
    Counted, not timed; the disk reads are checked to have happened (else the eviction did not take here)."""
    if not pure and lmdbcache._native.core is None:
        pytest.skip("the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")
    n = 60
    _big_cache(cache_dir, n)
    drop_cached_pages(cache_dir / "data.mdb")
    out = _run_cold(cache_dir, pure)
    faults, read = (int(x) for x in out.split())
    value = big_sample(0)[0].numel()
    assert read >= n * value * 0.9, f"only {read} bytes came from the disk: the eviction did not take"
    assert faults < 2 * n, f"{faults} major page faults for {n} cold values of {value} bytes"


def _run_cold(cache_dir, pure: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LMDBCACHE_PURE_PYTHON"}
    if pure:
        env["LMDBCACHE_PURE_PYTHON"] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root
    result = subprocess.run(
        [sys.executable, "-c", _COLD_CHILD, str(cache_dir), "7"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="the prefetch needs /proc/self/maps")
def test_prefetched_reads_return_the_same_samples_cold_and_warm(cache_dir, advice):
    """Large values announced to the kernel before they are read come back as stored: first reads, cold, warm."""
    n = 24
    _big_cache(cache_dir, n)
    ds = CachedDataset.open(cache_dir)
    evict(cache_dir)
    order = [(7 * i) % n for i in range(n)]
    for i in order:  # first reads in this process (bounds checked, then announced)
        assert_same(ds[i], big_sample(i))
    first = len(advice)  # all but the first two reads: two reads in a row seen cold turn the advice on
    assert first == n - 2 and all(a == 3 and length >= 3 * 96 * 96 for _, length, a in advice)
    for _ in range(2):  # verified reads, cold after eviction, then warm
        evict(cache_dir)
        for i in order:
            assert_same(ds[i], big_sample(i))
        for sample, i in zip(ds.__getitems__(order[:5]), order[:5]):
            assert_same(sample, big_sample(i))
    assert len(advice) >= first + 2 * n
    ds.close()


def test_a_damaged_overflow_page_number_is_refused_before_it_is_announced(cache_dir, advice):
    """A record pointing past the end of data.mdb is refused before any advice or read touches its span."""
    _big_cache(cache_dir, 8)
    data = bytearray((cache_dir / "data.mdb").read_bytes())
    target, size = key(5), len(data)
    at = data.find(target)
    while at >= 0:  # the leaf node of index 5: flags F_BIGDATA, an 8-byte key, then the overflow page number
        if int.from_bytes(data[at - 4 : at - 2], "little") == 1 and int.from_bytes(data[at - 2 : at], "little") == 8:
            break
        at = data.find(target, at + 1)
    assert at > 0
    data[at + 8 : at + 16] = (size // 4096 + 10).to_bytes(8, "little")
    (cache_dir / "data.mdb").write_bytes(bytes(data))
    ds = CachedDataset.open(cache_dir)
    assert_same(ds[4], big_sample(4))
    before = len(advice)
    with pytest.raises(CorruptCacheError, match="index 5"):
        ds[5]
    assert len(advice) == before
    ds.close()


def test_the_prefetch_is_a_no_op_without_proc_self_maps_or_madvise(cache_dir, advice, monkeypatch):
    """Where /proc/self/maps (or libc's madvise) is missing, large values read as before and nothing is advised."""
    from lmdbcache.store import _guard

    _big_cache(cache_dir, 6)
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_guard, "open", no_proc, raising=False)
    ds = CachedDataset.open(cache_dir)
    for _ in range(2):
        for i in range(6):
            assert_same(ds[i], big_sample(i))
    assert advice == []
    ds.close()
    monkeypatch.undo()
    monkeypatch.setattr(_guard, "_madvise", None)
    ds = CachedDataset.open(cache_dir)
    for _ in range(2):
        for i in range(6):
            assert_same(ds[i], big_sample(i))
    ds.close()


def _map_flags(cache_dir) -> set[str]:
    """The VmFlags of this process's first mapping of data.mdb, where the file's pages are (rr: random-read
    advice, sr: sequential)."""
    real, inside = os.path.realpath(cache_dir / "data.mdb"), False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) == 6 and os.path.realpath(fields[5].strip()) == real
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    return set()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mapping's advice from smaps")
def test_scans_read_ahead_and_restore_random_advice(cache_dir):
    """reading_ahead (verify, merge, copy) turns the map's readahead on for the scan and back off after it;
    the scan reads what random reads read."""
    _big_cache(cache_dir, 8)
    with _registry.opened(str(cache_dir)) as store:
        store.meta()  # opens the environment (it maps data.mdb)
        assert "rr" in _map_flags(cache_dir)  # LMDB's readahead=False
        with store.reading_ahead():
            flags = _map_flags(cache_dir)
            assert "sr" in flags and "rr" not in flags
            scanned = dict(store.iter_raw())
        assert "rr" in _map_flags(cache_dir) and "sr" not in _map_flags(cache_dir)
        assert sorted(scanned) == list(range(8))
        assert all(scanned[i] == store.raw(i) for i in range(8))


FOREIGN_BOOT = "00000000-0000-4000-8000-000000000000\n"


def test_unsynced_commits_leave_a_boot_marker_until_close_and_sync_true_leaves_none(cache_dir, counts):
    """An unsynced commit first leaves this boot's id in a marker; close syncs and removes it; sync=True needs none."""
    marker = cache_dir / _fs.UNSYNCED
    ds = CachedDataset(Synthetic(10, count_dir=counts), cache_dir)
    ds[0]
    assert not marker.exists()  # nothing committed yet
    ds.flush()
    assert marker.read_text().split("\n")[0] == _fs.boot_id()  # then the build's settings, as JSON
    ds.close()
    assert not marker.exists()
    durable = CachedDataset(Synthetic(10, count_dir=counts), cache_dir, sync=True)
    durable[1]
    durable.flush()
    assert not marker.exists()
    durable.close()
    assert CachedDataset.open(cache_dir).cached_count == 2


def test_a_marker_left_by_another_boot_rebuilds_the_cache(cache_dir, counts):
    """Unsynced commits of a boot that ended (a crash?) may be torn: the cache is rebuilt with a warning, never read."""
    ds = CachedDataset(Synthetic(10, count_dir=counts), cache_dir)
    for i in range(10):
        ds[i]
    ds.close()
    (cache_dir / _fs.UNSYNCED).write_text(FOREIGN_BOOT)  # as a process of the earlier boot left it
    with pytest.raises(CorruptCacheError, match=r"without a disk sync when the machine went down.*with its dataset"):
        CachedDataset.open(cache_dir)
    with pytest.raises(CorruptCacheError, match="read-only location"), read_only(cache_dir) as ro:
        CachedDataset.open(ro)
    with pytest.warns(LmdbCacheWarning, match=r"00000000-0000-4000-8000-000000000000.*being rebuilt"):
        rebuilt = CachedDataset(Synthetic(10, count_dir=counts), cache_dir)
    assert rebuilt.cached_count == 0 and not (cache_dir / _fs.UNSYNCED).exists()
    assert_same(rebuilt[3], sample_for(3))
    assert sorted(source_reads(counts)) == sorted([*range(10), 3])  # decoded again, from the source
    rebuilt.close()
    (cache_dir / _fs.UNSYNCED).write_text("garbage \xff" * 50)  # hostile content: another boot's too
    with pytest.warns(LmdbCacheWarning, match="being rebuilt"):
        CachedDataset(Synthetic(10, count_dir=counts), cache_dir).close()


def test_the_guard_keeps_checking_while_it_looks_for_the_map_again(cache_dir, monkeypatch):
    """refresh() (run by every scan's readahead) never leaves the guard without a map address while it re-reads
    /proc/self/maps: another thread's check meanwhile would have let a damaged record through (a SIGBUS, found by
    the attack: a reader thread beside copy_cache)."""
    from lmdbcache.store import _guard

    _big_cache(cache_dir, 4)
    seen = []
    with _registry.opened(str(cache_dir)) as store:
        store.meta()
        guard = store._guard
        assert guard is not None and guard.start

        def spying_open(path, *args, **kwargs):
            seen.append(guard.start)  # what a concurrent check would use at this moment
            return open(path, *args, **kwargs)

        monkeypatch.setattr(_guard, "open", spying_open, raising=False)
        with store.reading_ahead():
            pass
    assert seen and all(seen)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_marker_that_is_not_a_file_is_a_clear_error_and_nothing_is_deleted(cache_dir, kind):
    """The marker path is untrusted: a directory, FIFO or link there is refused by name before anything is read
    or deleted (found by the attack: a directory was an IsADirectoryError after data.mdb was deleted; a FIFO hung
    the open)."""
    ds = CachedDataset(Synthetic(6), cache_dir)
    ds.__getitems__(list(range(6)))
    ds.close()
    marker = cache_dir / _fs.UNSYNCED
    {"directory": marker.mkdir, "fifo": lambda: os.mkfifo(marker), "symlink": lambda: marker.symlink_to("/etc")}[kind]()
    for attempt in (lambda: CachedDataset(Synthetic(6), cache_dir), lambda: CachedDataset.open(cache_dir)):
        with pytest.raises(CorruptCacheError, match=r"lmdbcache.unsynced.*nothing was read or deleted"):
            attempt()
    assert (cache_dir / "data.mdb").exists()
    marker.rmdir() if kind == "directory" else marker.unlink()
    reopened = CachedDataset.open(cache_dir)
    assert reopened.cached_count == 6
    reopened.close()


def test_a_rebuild_after_a_crash_keeps_the_caches_compression_and_packs(cache_dir):
    """The marker carries the build's creation settings, so the rebuild of a torn compressed, packed cache opened
    the usual way (no compress=, no pack=) is compressed and packed alike, without reading the torn file (found by
    the attack)."""
    pytest.importorskip("zstandard")
    ds = CachedDataset(Listed([(torch.zeros(8000) + i, i) for i in range(6)]), cache_dir, compress="zstd", pack=4)
    ds.__getitems__(list(range(6)))
    ds.flush()
    written = (cache_dir / _fs.UNSYNCED).read_text()  # as the crash left it: this process never closed
    ds.close()
    (cache_dir / _fs.UNSYNCED).write_text(FOREIGN_BOOT + written.split("\n", 1)[1])
    with pytest.warns(LmdbCacheWarning, match="being rebuilt"):
        rebuilt = CachedDataset(Listed([(torch.zeros(8000) + i, i) for i in range(6)]), cache_dir)
    kept = rebuilt._store.meta()
    assert (kept["compress"], kept["pack"], rebuilt.cached_count) == ("zstd", 4, 0)
    assert_same(rebuilt[2], (torch.zeros(8000) + 2, 2))
    rebuilt.close()
    (cache_dir / _fs.UNSYNCED).write_text(FOREIGN_BOOT + '{"compress": "rar", "compress_level": [1]}\n')  # damaged
    with pytest.warns(LmdbCacheWarning, match="being rebuilt"):
        CachedDataset(Listed([(torch.zeros(8000) + i, i) for i in range(6)]), cache_dir).close()


def test_buffer_addresses_are_right_in_every_thread(cache_dir):
    """_address.address (the guard's and the gather's) gives numpy's address for map views, bytes and slices, with
    four threads asking at once (each has its own Py_buffer)."""
    import threading

    import numpy as np

    from lmdbcache.store._address import _numpy_address, address

    _big_cache(cache_dir, 4)
    failures = []
    with _registry.opened(str(cache_dir)) as store:
        store.meta()
        txn = store.reader._reader()
        views = [txn.get(key(i)) for i in range(4)] + [memoryview(b"x" * 100)[7:], bytearray(b"abc")]
        expected = [int(np.frombuffer(view, np.uint8).ctypes.data) for view in views]

        def ask() -> None:
            for _ in range(2000):
                failures.extend(k for k, view in enumerate(views) if address(view) != expected[k])

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert address(views[0]) == _numpy_address(views[0])
        store._drop_reader()
    assert failures == []
    assert isinstance(address(b""), int)
    with pytest.raises(TypeError):
        address(5)


def test_a_guard_that_cannot_look_again_refuses_reads_until_it_can(cache_dir, monkeypatch):
    """A refresh that cannot read /proc/self/maps (out of file descriptors) once the guard is on never turns the
    check off (a hostile record read unchecked kills the process, found by the attack): reads fail, saying why,
    and work again once it can look."""
    from lmdbcache.store import _guard

    _big_cache(cache_dir, 4)
    ds = CachedDataset.open(cache_dir)
    assert_same(ds[0], big_sample(0))
    guard = ds._live_store()._guard
    assert guard is not None and guard.start

    def no_files(path, *args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_guard, "open", no_files, raising=False)
    guard.refresh()
    assert guard.start
    time.sleep(0.3)  # a new read transaction: the compiled core keeps the map it found for the life of one
    with pytest.raises(CorruptCacheError, match=r"could not be checked.*Too many open files"):
        ds[1]
    monkeypatch.undo()
    for i in range(4):
        assert_same(ds[i], big_sample(i))
    ds.close()


GUARD_VERSION_SCRIPT = """
import sys
import warnings

built_with = tuple(int(part) for part in sys.argv[2].split("."))

from helpers import Synthetic, assert_same, sample_for
from lmdbcache import CachedDataset
from lmdbcache.store import _engine

_engine.engine_version = lambda env: built_with  # as py-lmdb reports an environment's engine of that LMDB

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):  # two opens, one warning
        ds = CachedDataset(Synthetic(8), sys.argv[1])
        assert_same(ds[3], sample_for(3))
        on = ds._store._guard.start != 0
        ds.close()
print(int(on), sum("bounds check" in str(w.message) and w.category.__name__ == "LmdbCacheWarning" for w in caught))
"""


@pytest.mark.parametrize(
    ("built_with", "guarded"), [("0.9.36", True), ("0.9.0", True), ("0.10.0", False), ("0.8.9", False)]
)
def test_the_guard_is_off_with_one_warning_under_an_lmdb_it_does_not_know(cache_dir, built_with, guarded):
    """The record guard parses LMDB 0.9's and 1.0's layouts (tests/test_engines.py: 1.0's): under another LMDB
    version it stays off, warned once."""
    on, warnings_seen = map(int, run_script(GUARD_VERSION_SCRIPT, str(cache_dir), built_with).stdout.split())
    assert (on, warnings_seen) == ((1, 0) if guarded else (0, 1))


def test_an_open_raced_by_map_growth_inside_py_lmdbs_open_is_retried(cache_dir, monkeypatch):
    """MDB_MAP_RESIZED from the transaction py-lmdb begins inside lmdb.open (twice in a row) is a retried open."""
    with CachedDataset(Synthetic(8), cache_dir) as ds:
        ds[5]
    real_open, raised = lmdb.open, []

    def resized_twice(*args, **kwargs):
        if len(raised) < 2:
            raised.append(1)
            raise lmdb.MapResizedError(
                "mdb_txn_begin: MDB_MAP_RESIZED: Database contents grew beyond environment mapsize"
            )
        return real_open(*args, **kwargs)

    monkeypatch.setattr(lmdb, "open", resized_twice)
    with CachedDataset.open(cache_dir) as ds:
        assert_same(ds[5], sample_for(5))
    assert len(raised) == 2


def test_the_reader_and_the_writer_own_their_state_and_share_only_what_they_are_handed(cache_dir):
    """A Store is a Reader and a Writer over one Handle, each with its own state: the reader holds no queue and
    finds a queued, uncommitted sample only through the function the writer handed it (``Writer.lookup``), and a
    commit by the writer is seen by the reader's next snapshot."""
    from lmdbcache.store._commit import CommitQueue
    from lmdbcache.store._handle import Handle
    from lmdbcache.store._read import MISSING
    from lmdbcache.store._write import Writer

    ds = CachedDataset(Synthetic(8), cache_dir, commit_every=1000, commit_interval=3600)
    store = ds._live_store()
    reader, writer = store.reader, store.writer
    assert reader._h is writer._h is store.handle and not isinstance(reader, Handle) and not isinstance(writer, Handle)
    held = [type(value) for value in vars(reader).values()]
    assert CommitQueue not in held and Writer not in held and not hasattr(reader, "_queue")
    assert "_rtxn" not in vars(writer) and "_verified" not in vars(writer)

    assert_same(ds[3], sample_for(3))  # a miss: decoded, queued, not committed
    assert writer.lookup(3) is not None  # queued in the writer
    asked = []
    handed = reader._in_queue
    assert handed == writer.lookup  # the one function Store handed it

    def recording(index):
        asked.append(index)
        return handed(index)

    reader._in_queue = recording
    assert_same(store.get(3), sample_for(3))  # found in the queue, through the handed function
    assert asked == [3]
    reader._in_queue = lambda index: None  # the queue still holds it, but the reader has no other way to it
    assert writer.lookup(3) is not None and store.get(3) is MISSING

    txn = reader._reader()  # a snapshot taken before the commit
    assert store.flush() == 1  # the writer commits
    assert writer.lookup(3) is None and txn.get(key(3)) is None  # the old snapshot does not show it
    assert_same(store.get(3), sample_for(3))  # the reader's next snapshot does (its queue function says nothing)
    assert reader._rtxn is not txn
    reader._in_queue = handed
    ds.close()


def test_a_refresh_never_stores_an_older_file_size(tmp_path):
    """Two threads refreshing the guard at once: the one that looked at the file first never stores its older
    size last. The first refresh is held between its look at the file and its store while the file grows; the
    second, started then, ends after it, and the guard holds the grown size (without the guard's own lock: the
    first's; a reader then finding a page past it would call a sound cache damaged)."""
    import threading

    from lmdbcache.store import _guard

    env = lmdb.open(str(tmp_path / "env"), map_size=1 << 26)
    try:
        data = str(tmp_path / "env" / "data.mdb")
        with env.begin(write=True) as txn:
            txn.put(b"a", b"x" * 10_000)
        guard = _guard.MapGuard(data, env.stat()["psize"], 16)  # LMDB 0.9's page header
        held, go = threading.Event(), threading.Event()
        older = threading.Thread(target=guard.refresh)

        def slow_open(*args, **kwargs):  # the older refresh stops after its stat, before it stores anything
            if threading.current_thread() is older:
                held.set()
                go.wait(10)
            return open(*args, **kwargs)

        _guard.open = slow_open  # the module's own name: found before the builtin
        try:
            older.start()
            assert held.wait(10)
            with env.begin(write=True) as txn:  # the file grows while that refresh is held
                txn.put(b"b", b"y" * 100_000)
            grown = os.stat(data).st_size
            newer = threading.Thread(target=guard.refresh)
            newer.start()
            newer.join(0.5)  # before the fix it ended here, storing the grown size first
            go.set()
            older.join(10)
            newer.join(10)
        finally:
            del _guard.open
        assert guard.mapping()[1] == grown > 0
    finally:
        env.close()


def test_a_fill_reads_proc_maps_only_when_the_map_moves(tmp_path, monkeypatch):
    """Every commit of a lazy fill grows data.mdb, and the next read finds pages past the size the guard knew:
    the guard takes the file's size again with a stat (``refresh(grown=True)``), not by reading /proc/self/maps
    (0.9 ms in a process that imported torch, once per commit: 0.4 us a 3 KiB miss). The full look stays for
    a moved map (a growth of the map: ``_set_mapsize``) and for a file replaced at the path (another inode)."""
    from lmdbcache.store import _guard

    looks = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        if file == "/proc/self/maps":
            looks.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(_guard, "open", counting_open, raising=False)
    path = str(tmp_path / "cache")
    n = 600
    ds = CachedDataset(Synthetic(n), path, commit_every=20, map_size=256 << 20)
    ds[0]
    store = ds._live_store()
    opened, commits = len(looks), store.handle.commits
    sizes = set()
    for i in range(n):
        assert_same(ds[i], sample_for(i))
        sizes.add(os.path.getsize(os.path.join(path, "data.mdb")))
    ds.flush()
    for i in range(n):
        assert_same(ds[i], sample_for(i))
    assert store.handle.commits - commits >= 20 and len(sizes) >= 5  # the file grew again and again
    assert len(looks) == opened, f"{len(looks) - opened} full looks over {store.handle.commits - commits} commits"

    guard = store.handle._guard
    data = os.path.join(path, "data.mdb")
    other = str(tmp_path / "other.mdb")
    shutil.copyfile(data, other)
    before = len(looks)
    guard.refresh(grown=True)  # the same file: a stat
    assert len(looks) == before and guard.start
    os.replace(other, data)  # another inode at the path: the map no longer shows the file there
    guard.refresh(grown=True)
    assert len(looks) == before + 1  # looked in full


def test_a_data_file_replaced_under_a_process_stays_checked(tmp_path):
    """`lmdbcache copy` into a live cache swaps another data.mdb in at the path; a process that had the cache open
    keeps reading and writing the file it mapped, unlinked now. Its guard keeps checking records against that
    mapping, the size taken through LMDB's open descriptor of it; before, the full look found no map of the path's
    new file and turned the check off (start 0: reads unchecked, found by the attack on the stat refresh)."""
    from lmdbcache.store import _guard

    path = str(tmp_path / "cache")
    n = 300
    ds = CachedDataset(Synthetic(n), path, commit_every=20, map_size=64 << 20)
    for i in range(100):
        ds[i]
    ds.flush()
    guard = ds._live_store().handle._guard
    assert guard is not None and guard.start
    start, before = guard.start, guard.mapping()[1]
    data = os.path.join(path, "data.mdb")
    other = str(tmp_path / "other.mdb")
    shutil.copyfile(data, other)
    os.replace(other, data)  # as _ops._swap does
    for i in range(100, n):  # committed into the file this process opened: it grows
        assert_same(ds[i], sample_for(i))
    ds.flush()
    guard.refresh()  # a full look
    assert guard.start == start and guard.unreadable == ""
    assert guard.mapping()[1] > before  # its own file's size, not the path's
    assert guard.problem(memoryview(b"12345678")) is not None  # a key outside the map: still refused
    for i in range(n):
        assert_same(ds[i], sample_for(i))
    new = os.stat(data)
    assert _guard._size_of_open(new.st_dev, new.st_ino) is None  # the path's new file: not open here


def test_a_guard_keeps_its_own_file_when_another_caches_file_takes_its_path(tmp_path):
    """In one process, another open cache's data.mdb renamed onto this cache's path: the path's new file is mapped
    here too (by the other cache), and a guard that looked for the path's file adopted that mapping and called its
    own sound records damaged (270 false errors a run, found by the attack). It follows the file it found first."""
    n = 300
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    ds1 = CachedDataset(Synthetic(n), first, commit_every=20, map_size=64 << 20)
    ds2 = CachedDataset(Listed([torch.full((700,), i % 251, dtype=torch.uint8) for i in range(50)]), second)
    for i in range(100):
        ds1[i]
    for i in range(50):
        ds2[i]
    ds1.flush()
    ds2.flush()
    guard = ds1._live_store().handle._guard
    start = guard.start
    # The second cache's very file, renamed: /proc/self/maps then shows its mapping under this cache's path
    os.replace(os.path.join(second, "data.mdb"), os.path.join(first, "data.mdb"))
    for i in range(100, n):  # commits grow ds1's own (unlinked) file: its guard looks again
        assert_same(ds1[i], sample_for(i))
    ds1.flush()
    guard.refresh()
    assert guard.start == start and guard.unreadable == ""
    for i in range(n):
        assert_same(ds1[i], sample_for(i))
    os.link(os.path.join(first, "data.mdb"), os.path.join(second, "data.mdb"))  # its path back, for its close
