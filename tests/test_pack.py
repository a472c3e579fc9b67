"""Packs (``_pack``): small samples of a chunk stored as one record, on real LMDB and real processes."""

from __future__ import annotations

import json
import os
import random
import signal
import struct

import pytest
import torch
from helpers import Listed, Synthetic, assert_same, key, raw_cache, sample_for
from test_cli import SPEC, _flip_in_file, cli
from test_processes import FILL_SCRIPT, check_cache, run_script, wait_for_count

from lmdbcache import CachedDataset, CorruptCacheError, InvalidOptionError, precompute, tools
from lmdbcache.store import _registry

PACK_FILL = FILL_SCRIPT.replace("path, commit_every=", "path, pack=8, commit_every=")


LAYOUT = """
    import json, sys, lmdb
    singles, packs = [], []
    with lmdb.open(sys.argv[1], max_dbs=2, readonly=True) as env, env.begin() as txn:
        for k in txn.cursor(db=env.open_db(b"samples", txn=txn, create=False)).iternext(values=False):
            if len(k) == 8:
                singles.append(int.from_bytes(k, "big"))
            else:
                assert len(k) == 9 and k[8:] == b"P", k
                packs.append(int.from_bytes(k[:8], "big"))
    print(json.dumps([singles, packs]))
"""


def layout(path) -> tuple[list[int], list[int]]:
    """(indices stored as single records, first indices of packs), read straight from LMDB in another process
    (py-lmdb refuses a second environment on a file this process has open)."""
    singles, packs = json.loads(run_script(LAYOUT, str(path)).stdout)
    return singles, packs


def fill(path, n: int, order, pack: int = 8, **options) -> None:
    ds = CachedDataset(Synthetic(n), path, pack=pack, **options)
    for i in order:
        assert_same(ds[i], sample_for(i))
    ds.close()


def test_packed_and_single_caches_hold_the_same_bytes(tmp_path):
    """A shuffled fill with pack=8 stores every value byte for byte as pack=0 does, all in packs (last one short)."""
    n = 100
    order = list(range(n))
    random.Random(3).shuffle(order)
    fill(tmp_path / "packed", n, order, commit_every=16)
    fill(tmp_path / "single", n, order, pack=0, commit_every=16)
    assert layout(tmp_path / "packed") == ([], list(range(0, n, 8)))
    assert layout(tmp_path / "single") == (list(range(n)), [])
    with _registry.opened(str(tmp_path / "packed")) as packed, _registry.opened(str(tmp_path / "single")) as single:
        assert list(packed.iter_raw(chunk=7)) == list(single.iter_raw())
        assert [packed.raw(i) for i in range(n)] == [single.raw(i) for i in range(n)]
        assert packed.count() == n and list(packed.iter_keys(start=13)) == list(range(13, n))
        assert packed.cached_near([13, 99]) == [13, 99]
    reader = CachedDataset.open(tmp_path / "packed")
    for i in order:
        assert_same(reader[i], sample_for(i))
    assert all(isinstance(s, tuple) for s in reader.__getitems__(order[:20]))
    reader.close()
    check_cache(tmp_path / "packed", n)


def test_a_chunk_is_packed_by_the_commit_that_completes_it(cache_dir):
    """Singles until the chunk's last index commits, then one pack; a reader that verified the singles reads on."""
    ds = CachedDataset(Synthetic(20), cache_dir, pack=8)
    reader = CachedDataset.open(cache_dir)
    for i in range(7):
        ds[i]
    ds.flush()
    assert layout(cache_dir) == (list(range(7)), [])
    for i in range(7):
        assert_same(reader[i], sample_for(i))  # verified as singles in this process
    ds[7]
    ds.flush()
    assert layout(cache_dir) == ([], [0])
    reader._live_store()._drop_reader()  # as after _READER_MAX_AGE: a new snapshot
    for i in range(8):
        assert_same(reader[i], sample_for(i))
    assert reader.cached_count == 8
    ds.close()
    reader.close()


def test_precompute_writes_packs(cache_dir):
    """precompute with pack=16 writes every chunk as a pack (none left as singles), resumes and verifies clean."""
    result = precompute(Synthetic(70), cache_dir, num_workers=0, progress=False, pack=16, check_determinism=0)
    assert result.cached == 70 and layout(cache_dir) == ([], [0, 16, 32, 48, 64])
    again = precompute(Synthetic(70), cache_dir, num_workers=0, progress=False, check_determinism=0)
    assert again.written == 0 and again.skipped == 70
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    check_cache(cache_dir, 70)


def test_sigkilled_packing_writer_leaves_singles_or_packs(cache_dir):
    """A packing writer SIGKILLed mid-fill leaves each committed index once (single or packed); a refill completes."""
    n = 600
    with run_script(PACK_FILL, str(cache_dir), str(n), "3", "0.001", "10", wait=False) as proc:
        wait_for_count(cache_dir, 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    singles, packs = layout(cache_dir)
    packed = {i for first in packs for i in range(first, first + 8)}
    assert not packed & set(singles) and len(singles) + len(packed) < n
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    ds = CachedDataset(Synthetic(n), cache_dir)
    assert ds.cached_count == len(singles) + len(packed)
    for i in range(n):
        assert_same(ds[i], sample_for(i))
    ds.close()
    assert layout(cache_dir) == ([], list(range(0, n, 8)))
    check_cache(cache_dir, n)


def test_two_processes_fill_one_packed_cache(cache_dir):
    """Two processes filling one packed cache in different orders: every index once, all packed, verify clean."""
    n = 400
    CachedDataset(Synthetic(n), cache_dir, pack=8).close()
    with run_script(PACK_FILL, str(cache_dir), str(n), "1", "0.0005", "16", wait=False) as a:
        with run_script(PACK_FILL, str(cache_dir), str(n), "2", "0.0005", "16", wait=False) as b:
            for proc in (a, b):
                _, err = proc.communicate(timeout=120)
                assert proc.returncode == 0, err
    assert layout(cache_dir) == ([], list(range(0, n, 8)))
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    check_cache(cache_dir, n)


def test_repair_of_a_damaged_packed_value_unpacks_the_rest_of_its_chunk(cache_dir):
    """precompute --pack 8, a flipped packed byte: verify names it; --repair unpacks its 7 neighbours; refill packs."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=40", "--pack", "8", "--workers", "0", "--quiet")
    _flip_in_file(cache_dir / "data.mdb", bytes(sample_for(17)[0].flatten().tolist()))
    assert "1 damaged: 17." in cli("verify", str(cache_dir), "--quiet", check=1).stdout
    reader = CachedDataset.open(cache_dir)
    with pytest.raises(Exception, match="index 17 is damaged"):
        reader[17]
    reader.close()
    _registry._stores.clear()
    assert "deleted 1 damaged (17)" in cli("verify", str(cache_dir), "--repair", "--quiet").stdout
    assert layout(cache_dir) == ([16, 18, 19, 20, 21, 22, 23], [0, 8, 24, 32])
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    ds = CachedDataset(Synthetic(40), cache_dir, spot_check=0)
    assert ds.cached_count == 39
    assert_same(ds[17], sample_for(17))
    ds.close()
    assert layout(cache_dir) == ([], [0, 8, 16, 24, 32])
    check_cache(cache_dir, 40)


def _edit_pack(path, first: int, edit) -> None:
    with raw_cache(path) as (txn, samples, _):
        pack_key = key(first) + b"P"
        value = bytearray(txn.get(pack_key, db=samples))
        edit(value)
        txn.put(pack_key, bytes(value), db=samples)


def _pair(j: int, start: int, end: int):
    return lambda v: struct.pack_into("<II", v, 8 + 8 * j, start, end)


@pytest.mark.parametrize(
    "edit, read, scan",
    [
        (_pair(3, 8, 1 << 30), "value 3 of the pack spans bytes 8 to 1073741824", "spans bytes 8"),
        (lambda v: struct.pack_into("<I", v, 4, 7), "holds 7 values, not 8", "holds 7 values, not 8"),
        (lambda v: v.__setitem__(slice(0, 4), b"XXXX"), "bad pack magic", "bad pack magic"),
        (lambda v: v.__delitem__(slice(40, None)), "shorter than its header", "shorter than its header"),
    ],
)
def test_hostile_pack_headers_give_clear_errors(cache_dir, edit, read, scan):
    """A pack header with a span out of range, a wrong count, a bad magic or cut short: CorruptCacheError, the index."""
    precompute(Synthetic(16), cache_dir, num_workers=0, progress=False, pack=8, check_determinism=0)
    _edit_pack(cache_dir, 8, edit)
    ds = CachedDataset.open(cache_dir)
    with pytest.raises(CorruptCacheError, match=f"pack holding index 11 \\(indices 8 to 15\\) is broken \\(.*{read}"):
        ds[11]
    assert_same(ds[3], sample_for(3))
    ds.close()
    result = cli("verify", str(cache_dir), "--quiet", check=1)
    assert "8 damaged: 8, 9, 10" in result.stdout
    assert "all intact" not in result.stdout
    with _registry.opened(str(cache_dir)) as store, pytest.raises(CorruptCacheError, match=scan):
        list(store.iter_raw(8))
    cli("verify", str(cache_dir), "--repair", "--quiet")
    assert layout(cache_dir) == ([], [0])
    check_cache(cache_dir, 8)  # 8 of 16: the dropped pack is decoded again on the next read


def test_overlapping_pack_spans_are_found_by_verify(cache_dir):
    """Two packed values made to overlap (each span in range): a read fails its checksum, verify names the overlap."""
    precompute(Synthetic(8), cache_dir, num_workers=0, progress=False, pack=8, check_determinism=0)
    with raw_cache(cache_dir, write=False) as (txn, samples, _):
        start = struct.unpack_from("<I", txn.get(key(0) + b"P", db=samples), 8 + 8 * 2)[0]
    _edit_pack(cache_dir, 0, _pair(3, start, start + 100))
    ds = CachedDataset.open(cache_dir)
    with pytest.raises(Exception, match="index 3 is damaged"):
        ds[3]
    ds.close()
    assert "8 damaged: 0, 1, 2, 3, 4, 5, 6, 7." in cli("verify", str(cache_dir), "--quiet", check=1).stdout
    with _registry.opened(str(cache_dir)) as store, pytest.raises(CorruptCacheError, match="overlaps the value before"):
        list(store.iter_raw())


def test_a_single_record_inside_a_packed_range_is_reported(cache_dir):
    """An index stored both alone and in a pack (a hostile file): the scan and verify say so."""
    precompute(Synthetic(16), cache_dir, num_workers=0, progress=False, pack=8, check_determinism=0)
    with raw_cache(cache_dir) as (txn, samples, _):
        from lmdbcache import codec

        txn.put(key(10), codec.encode(sample_for(10), 10), db=samples)
    with _registry.opened(str(cache_dir)) as store, pytest.raises(CorruptCacheError, match="index 10 is stored both"):
        list(store.iter_keys())
    assert "index 10 is stored both alone and in the pack" in cli("verify", str(cache_dir), check=1).stdout


def test_merge_and_copy_keep_packs(tmp_path):
    """Two packed shards merge into a packed cache; a copy of it is packed too, and both read back exactly."""
    for rank in (0, 1):
        precompute(
            Synthetic(50), tmp_path / f"s{rank}", shard=(rank, 2), num_workers=0, progress=False, pack=8,
            check_determinism=0,
        )  # fmt: skip
    merged = tools.merge(tmp_path / "out", [tmp_path / "s0", tmp_path / "s1"])
    assert merged.complete and layout(tmp_path / "out") == ([], list(range(0, 50, 8)))
    tools.copy_cache(tmp_path / "out", tmp_path / "copy")
    assert layout(tmp_path / "copy") == ([], list(range(0, 50, 8)))
    assert (tools.info(tmp_path / "copy").cached, tools.info(tmp_path / "copy").pack) == (50, 8)
    assert "pack         8" in cli("info", str(tmp_path / "copy")).stdout
    check_cache(tmp_path / "out", 50)
    check_cache(tmp_path / "copy", 50)


def test_pack_is_fixed_when_the_cache_is_created(cache_dir):
    """pack is validated; a cache keeps the pack it was created with (0 here) whatever a later opener asks."""
    with pytest.raises(InvalidOptionError, match="pack must be an integer from 0"):
        CachedDataset(Synthetic(8), cache_dir, pack=-1)
    fill(cache_dir, 8, range(8), pack=0)
    fill(cache_dir, 8, range(8), pack=4)
    assert layout(cache_dir) == (list(range(8)), [])


def test_bench_pack_runs_at_tiny_sizes_and_packs_shrink_3_kib_samples(tmp_path, capsys):
    """python -m bench.pack runs end to end; packed 3 KiB samples take less disk than singles after an in-order fill."""
    from bench import pack as bench_pack

    found = bench_pack.main(["--reps", "1", "--n", "300", "--n-jpeg", "8", "--pack", "16", "--sizes", "3KiB", "jpeg"])
    assert found["3KiB"]["16"]["in-order"] < 1.15 < found["3KiB"]["0"]["in-order"]
    assert "| 3KiB | warm on/off |" in capsys.readouterr().out


def test_the_loader_reads_packed_batches_like_single_ones(tmp_path):
    """The loader's batches (gathered straight from the map) are equal on a packed and an unpacked cache."""
    order = list(range(50))
    fill(tmp_path / "packed", 50, order, pack=8)
    fill(tmp_path / "single", 50, order, pack=0)
    packed, single = CachedDataset.open(tmp_path / "packed"), CachedDataset.open(tmp_path / "single")
    for a, b in zip(packed.loader(7, shuffle=True, seed=1), single.loader(7, shuffle=True, seed=1), strict=True):
        assert_same(a, b)
    packed.close()
    single.close()


@pytest.mark.parametrize("pack", ["8", -1, 4097])
def test_hostile_pack_metadata_is_a_clear_error(cache_dir, pack):
    """A metadata field 'pack' that is not an integer from 0 to 4096 is CorruptCacheError naming the field."""
    import msgpack

    fill(cache_dir, 8, range(8))
    with raw_cache(cache_dir) as (txn, _, meta_db):
        txn.put(b"meta", msgpack.packb({**msgpack.unpackb(txn.get(b"meta", db=meta_db)), "pack": pack}), db=meta_db)
    with pytest.raises(CorruptCacheError, match="field 'pack' is"):
        CachedDataset.open(cache_dir)


def test_a_pack_key_in_a_cache_without_packs_is_damage(cache_dir):
    """A 9-byte pack key in a cache created without packs: the scan and verify call it damage, reads skip it."""
    fill(cache_dir, 16, range(16), pack=0)
    with raw_cache(cache_dir) as (txn, samples, _):
        txn.put(key(8) + b"P", b"LMPK" + bytes(12), db=samples)
    with _registry.opened(str(cache_dir)) as store, pytest.raises(CorruptCacheError, match="key of 9 bytes"):
        list(store.iter_keys())
    ds = CachedDataset.open(cache_dir)
    assert_same(ds[8], sample_for(8))
    ds.close()


def test_packs_hold_compressed_values(cache_dir):
    """pack and compress together: the packed values are the framed ones, and read back exactly."""
    pytest.importorskip("zstandard")
    samples = [(torch.zeros(4096, dtype=torch.uint8) + i, i) for i in range(20)]  # compressible, 4 KiB buffers
    with CachedDataset(Listed(samples), cache_dir, pack=8, compress="zstd") as ds:
        ds.__getitems__(list(range(20)))
    assert layout(cache_dir) == ([], [0, 8, 16])
    reader = CachedDataset.open(cache_dir)
    assert reader._live_store().raw(9)[:4] == b"LMC\x03"  # framed: compressed
    for i in range(20):
        assert_same(reader[i], samples[i])
    reader.close()


def test_repair_grows_the_map_to_unpack_chunks_of_a_compacted_copy(tmp_path):
    """A compacted copy's map is about its file's size; repairing a value in each of many packs unpacks their
    chunks into single records, which need more room: the repair grows the map (found by the attack: it failed
    with MDB_MAP_FULL and repaired nothing)."""
    n, k = 64 * 200, 64  # file (~38 MB) + unpacked chunks (~51 MB) > the 64 MiB map a reopen gives
    samples = [
        torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)) for i in range(n)
    ]
    precompute(
        Listed([(s, i) for i, s in enumerate(samples)]), tmp_path / "built", num_workers=0, progress=False, pack=k
    )
    tools.copy_cache(tmp_path / "built", tmp_path / "copy")
    data_file = tmp_path / "copy" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    for first in range(0, n, k):  # one value of every pack
        at = data.find(bytes(samples[first + 5].tolist()))
        assert at > 0
        data[at + 10] ^= 0xFF
    data_file.write_bytes(bytes(data))
    repaired = tools.verify(tmp_path / "copy", repair=True)
    assert len(repaired.bad) == n // k and repaired.repaired == n // k
    after = tools.verify(tmp_path / "copy")
    assert after.intact and after.checked == n - n // k


def test_a_fresh_pass_checks_each_packs_record_once_and_every_span(cache_dir, monkeypatch):
    """A fresh process's first pass over a packed chunk bounds-checks the pack's record once per read transaction
    (not once per index), and still checks each index's span: a broken span is found on that index's first read.
    The Python path's guard (the compiled core checks every record and span on every read, in C)."""
    from lmdbcache import _native
    from lmdbcache.store import _guard

    monkeypatch.setattr(_native, "core", None)

    precompute(Synthetic(16), cache_dir, num_workers=0, progress=False, pack=8, check_determinism=0)
    _edit_pack(cache_dir, 8, _pair(5, 8, 1 << 30))  # index 13's span runs off the pack
    checks = []
    real = _guard.MapGuard._locate
    monkeypatch.setattr(_guard.MapGuard, "_locate", lambda self, *a, **k: checks.append(1) or real(self, *a, **k))
    ds = CachedDataset.open(cache_dir)
    ds[0]  # the kept read transaction begins
    checks.clear()
    for i in range(1, 8):
        assert_same(ds[i], sample_for(i))
    assert len(checks) == 0  # the pack of 0..7 was checked by ds[0], in this transaction
    for i in (8, 9, 10, 11, 12):
        assert_same(ds[i], sample_for(i))
    assert len(checks) == 1
    with pytest.raises(CorruptCacheError, match=r"pack holding index 13 .* spans bytes 8 to 1073741824"):
        ds[13]
    ds.close()


ONE_PACKED_READ = """
    import os, sys, torch
    from helpers import Listed
    from lmdbcache import CachedDataset

    path = sys.argv[1]
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold, where the filesystem allows it
    os.close(fd)
    ds = CachedDataset(Listed([torch.full((8000,), i, dtype=torch.uint8) for i in range(64)]), path, spot_check=0)
    assert int(ds[50][0]) == 50 and int(ds[51][-1]) == 51
    real = os.path.realpath(os.path.join(path, "data.mdb"))
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) == 6 and os.path.realpath(fields[5]) == real
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1])
    print(rss)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the map's resident pages from smaps")
def test_reading_a_packed_value_leaves_the_rest_of_its_pack_untouched(cache_dir):
    """A read of one packed value touches the pack's header and its own pages, not the whole record: py-lmdb's
    get touches every page of what it returns, one synchronous page fault after another when cold (the pack is
    announced to the kernel instead, which reads it in one I/O and maps nothing)."""
    samples = [torch.full((8000,), i, dtype=torch.uint8) for i in range(64)]
    precompute(Listed(samples), cache_dir, num_workers=0, progress=False, pack=64, check_determinism=0)
    assert layout(cache_dir) == ([], [0])  # one pack of 64 x 8 KiB: 500 KiB
    resident_kib = int(run_script(ONE_PACKED_READ, str(cache_dir)).stdout)
    assert resident_kib < 256  # header, two values and the tree's pages (with the kernel's fault-around)


def test_packed_reads_follow_the_map_when_it_moves(cache_dir):
    """Packed values are views of the guard's map: after this process's map grows (and may move), the guard looks
    again before any read, so reads stay right (a stale view would read unmapped memory)."""
    precompute(Synthetic(32), cache_dir, num_workers=0, progress=False, pack=8, check_determinism=0)
    ds = CachedDataset.open(cache_dir)
    for i in range(32):
        assert_same(ds[i], sample_for(i))
    store = ds._live_store()
    for growth in (4, 64):
        with store._lock:
            env = store._env
            store.handle._set_mapsize(env, env.info()["map_size"] * growth)
            guard = store._guard
            start, size, _ = guard._mapped
            assert (start, size) == (guard.start, guard.file_size) and start
            with open("/proc/self/maps") as f:
                assert f"{start:x}-" in f.read()  # the mapping as it is now
        for i in reversed(range(32)):
            assert_same(ds[i], sample_for(i))
    ds.close()
