"""``tools``: verify, copy and merge on real caches, mostly through the command that people run them with."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import time
from pathlib import Path

import lmdb
import pytest
from helpers import Synthetic, assert_same, key, sample_for
from test_cli import SPEC, _flip_in_file, cli, one_line_error
from test_processes import check_cache, wait_for_count

from lmdbcache import CachedDataset, CorruptCacheError, LmdbCacheError, SampleNotCachedError, precompute, tools
from lmdbcache.store import _registry
from lmdbcache.tools._scan import TEST_SIGNAL


def test_info_is_a_frozen_dataclass_and_the_old_spellings_still_work(cache_dir):
    """info returns a frozen CacheInfo; info(path)["cached"] and tools.copy (lmdbcache 0.1) keep working."""
    precompute(Synthetic(10), cache_dir, num_workers=0, progress=False)
    found = tools.info(cache_dir)
    assert (found.length, found.cached, found.complete, found.fingerprint) == (10, 10, True, "Synthetic:10")
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.cached = 0
    assert found["cached"] == 10 and found.get("percent") == 100.0 and found.get("nothing") is None
    with pytest.raises(KeyError):
        found["nothing"]
    assert tools.copy is tools.copy_cache and "copy" not in tools.__all__


# ---------------------------------------------------------------------- verify


def damage_entries(path: Path, edit) -> None:
    """Open the cache's LMDB environment directly and let ``edit(txn)`` change the samples database."""
    with lmdb.open(str(path), max_dbs=2) as env:
        db = env.open_db(b"samples")
        with env.begin(write=True, db=db) as txn:
            edit(txn)


def crashing_cache(path: Path, after: int = 6) -> None:
    """A cache whose leaf page points the node after index ``after`` 64 KiB on, past the end of data.mdb.

    LMDB trusts the node offsets in a page: reading that key runs off the end of the file (SIGBUS).
    """
    ds = CachedDataset(Synthetic(20), path, commit_every=1)  # one leaf node each, the value in it (no groups)
    for i in range(20):
        ds[i]
    ds.close()
    data = bytearray((path / "data.mdb").read_bytes())
    node = b"\x00\x00\x08\x00" + struct.pack(">Q", after + 1)  # a leaf node's flags (0), key size (8), key
    at, patched = data.find(node), 0
    while at >= 0:
        page = at // 4096 * 4096
        lower = struct.unpack_from("<H", data, page + 12)[0]  # the page header's end of the offsets table
        offsets = [page + 16 + 2 * i for i in range((lower - 16) // 2)]
        for where in offsets:
            if struct.unpack_from("<H", data, where)[0] == at - 4 - page:
                assert page + 0xFFF8 > len(data)
                struct.pack_into("<H", data, where, 0xFFF8)
                patched += 1
        at = data.find(node, at + 1)
    assert patched
    (path / "data.mdb").write_bytes(bytes(data))


def test_verify_finds_a_corrupted_value_and_repair_refills(cache_dir):
    """A byte flipped inside one stored value: verify exits 1 naming its index; --repair deletes it; it refills."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=50", "--quiet")
    marker = bytes(sample_for(17)[0].flatten().tolist())  # the raw pixels of index 17, unique in the file
    _flip_in_file(cache_dir / "data.mdb", marker)
    result = cli("verify", str(cache_dir), "--quiet", check=1)
    assert "1 damaged: 17." in result.stdout
    ds = CachedDataset(Synthetic(50), cache_dir, spot_check=0)  # a spot check could land on 17 (1 run in 25)
    with pytest.raises(Exception, match="index 17 is damaged"):
        ds[17]
    ds.close()
    _registry._stores.clear()
    assert "deleted 1 damaged (17)" in cli("verify", str(cache_dir), "--repair", "--quiet").stdout
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=50", "--quiet")
    check_cache(cache_dir, 50)


def test_verify_survives_a_file_that_crashes_the_reader(cache_dir):
    """A data.mdb that makes LMDB's C code fault: verify exits 1 saying where and how; --repair changes nothing."""
    crashing_cache(cache_dir)
    before = (cache_dir / "data.mdb").read_bytes()
    result = cli("verify", str(cache_dir), check=1)
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stdout.strip()
    assert re.fullmatch(
        r"damaged: the LMDB file crashed the reader at the entry after index 6 \(after 7 good entries\) with "
        r"SIG(BUS|SEGV); copy the cache from a good replica, or rebuild it \(`lmdbcache precompute --overwrite`\)\.",
        line,
    ), line
    result = cli("verify", str(cache_dir), "--repair", "--quiet", check=1)
    assert "crashed the reader at the entry after index 6" in result.stdout
    assert "nothing was deleted" in result.stdout
    assert (cache_dir / "data.mdb").read_bytes() == before


def test_verify_reports_where_a_killed_reader_died(cache_dir, monkeypatch):
    """A reader killed by a signal (sent by a test hook) is reported with the index, the good entries and the signal."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet")
    result = cli("verify", str(cache_dir), "--quiet", check=1, env={TEST_SIGNAL: "SIGSEGV@5"})
    assert result.stdout.startswith(
        "damaged: the LMDB file crashed the reader at index 5 (after 5 good entries) with SIGSEGV; copy"
    )
    assert "Traceback" not in result.stderr
    monkeypatch.setenv(TEST_SIGNAL, "SIGKILL@3")
    found = tools.verify(cache_dir, repair=True)
    assert (found.checked, found.bad, found.repaired) == (3, [], 0) and not found.intact
    assert found.crashed is not None and "at index 3 (after 3 good entries) by SIGKILL" in found.crashed
    monkeypatch.delenv(TEST_SIGNAL)
    assert tools.verify(cache_dir).intact


def test_verify_binds_each_value_to_its_index(cache_dir):
    """A sound value stored under another index, or an index outside the dataset, is damage; --repair deletes it."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet", "--pack", "0")  # single records, damaged below
    damage_entries(cache_dir, lambda txn: (txn.put(key(4), txn.get(key(3))), txn.put(key(25), txn.get(key(5)))))
    assert "2 damaged: 4, 25." in cli("verify", str(cache_dir), "--quiet", check=1).stdout
    assert "deleted 2 damaged (4, 25)" in cli("verify", str(cache_dir), "--repair", "--quiet").stdout
    assert "Checked 19 entries: all intact" in cli("verify", str(cache_dir), "--quiet").stdout


def test_verify_stops_at_a_key_that_is_not_an_index(cache_dir):
    """A key that is not 8 bytes is damage verify reports (with what came before), not an error; nothing is deleted."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=20", "--quiet", "--pack", "0")  # single records, damaged below
    between = key(9) + b"!"  # sorts between the keys of indices 9 and 10: a scan must not step over it
    damage_entries(cache_dir, lambda txn: (txn.put(key(4), txn.get(key(3))), txn.put(between, b"hostile")))
    result = cli("verify", str(cache_dir), "--repair", "--quiet", check=1)
    assert "Traceback" not in result.stderr and not result.stderr.strip()
    out = result.stdout.strip()
    assert out.startswith("damaged: the scan cannot read past index 9 (after 9 good entries):"), out
    assert "key of 9 bytes" in out and "nothing was deleted" in out and out.endswith("before it: 4.")
    first = cache_dir.parent / "first"  # a key that sorts before index 0, out of reach of a scan by index
    cli("precompute", SPEC, str(first), "--arg", "n=20", "--shard", "0/2", "--quiet", "--pack", "0")
    damage_entries(first, lambda txn: txn.put(b"\x00", b"hostile"))
    out = cli("verify", str(first), "--quiet", check=1).stdout
    assert out.startswith("damaged: after 10 good entries, it held 11 entries when the scan began but only 10"), out
    packed = cache_dir.parent / "packed"  # packed (precompute's default): the count is of indices, not of keys
    cli("precompute", SPEC, str(packed), "--arg", "n=20", "--quiet")
    damage_entries(packed, lambda txn: txn.put(b"\x00", b"hostile"))
    out = cli("verify", str(packed), "--quiet", check=1).stdout
    assert "it holds 1 keys that sort before index 0" in out, out


# ---------------------------------------------------------------------- copy touches only the cache's files


def partial_cache(path: Path, n: int, filled: int, *, beside: bool = False) -> None:
    """A cache of Synthetic(n) holding ``filled`` indices; ``beside``: created among other files (README recipe)."""
    ds = CachedDataset(Synthetic(n), path, overwrite=beside)
    for i in range(filled):
        ds[i]
    ds.close()


def test_copy_during_a_concurrent_fill(tmp_path):
    """Copies taken while another process fills the source are consistent caches; a later copy completes it."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    n = 1200
    with cli(
        "precompute", SPEC, str(src), "--arg", f"n={n}", "--arg", "delay=0.002", "--workers", "1",
        "--commit-every", "40", "--quiet", wait=False,
    ) as filler:  # fmt: skip
        wait_for_count(src, 80)
        counts = []
        while filler.poll() is None and len(counts) < 4:
            result = cli("copy", str(src), str(dst))
            assert "Traceback" not in result.stderr
            assert "all intact" in cli("verify", str(dst), "--quiet").stdout
            counts.append(json.loads(cli("info", str(dst), "--json").stdout)["cached"])
            time.sleep(0.2)
        _, err = filler.communicate(timeout=120)
        assert filler.returncode == 0, err
    assert counts and counts == sorted(counts) and counts[0] < n
    assert "Replaced" in cli("copy", str(src), str(dst)).stdout or counts[-1] == n
    assert "nothing to do" in cli("copy", str(src), str(dst)).stdout
    check_cache(dst, n)
    other = tmp_path / "other"
    cli("precompute", SPEC, str(other), "--arg", "n=10", "--quiet")
    assert "another dataset" in one_line_error(cli("copy", str(other), str(dst), check=1))
    cli("copy", str(other), str(dst), "--overwrite")
    check_cache(dst, 10)


def test_copy_leaves_every_other_file_in_the_destination(tmp_path):
    """copy replaces only the cache's own files in DST: other files and folders survive, nothing is moved aside."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cli("precompute", SPEC, str(src), "--arg", "n=30", "--quiet")
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    (dst / "runs").mkdir()
    (dst / "runs" / "log").write_text("and me")
    partial_cache(dst, 30, 5, beside=True)
    assert "Replaced" in cli("copy", str(src), str(dst)).stdout
    check_cache(dst, 30)
    assert (dst / "notes.txt").read_text() == "keep me" and (dst / "runs" / "log").read_text() == "and me"
    assert sorted(os.listdir(dst)) == ["data.mdb", "lmdbcache.lock", "lock.mdb", "notes.txt", "runs"]
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]  # no dst.old-PID, no dst.copy-PID
    other = tmp_path / "other"
    cli("precompute", SPEC, str(other), "--arg", "n=10", "--quiet")
    cli("copy", str(other), str(dst), "--overwrite")
    check_cache(dst, 10)
    assert (dst / "notes.txt").read_text() == "keep me" and (dst / "runs" / "log").read_text() == "and me"
    plain = tmp_path / "plain"  # other files and no cache: only with --overwrite, beside them
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    assert "holds no lmdbcache cache" in one_line_error(cli("copy", str(src), str(plain), check=1))
    assert os.listdir(plain) == ["notes.txt"]
    cli("copy", str(src), str(plain), "--overwrite")
    check_cache(plain, 30)
    assert (plain / "notes.txt").read_text() == "mine"


def test_copy_refuses_a_file_or_a_link_to_one_as_destination(tmp_path):
    """A regular file (or a symlink to one) as DST is refused in one line and left exactly as it was."""
    src = tmp_path / "src"
    cli("precompute", SPEC, str(src), "--arg", "n=10", "--quiet")
    target = tmp_path / "results.csv"
    target.write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(target)
    for dst in (target, link):
        assert "is a file, not a directory" in one_line_error(cli("copy", str(src), str(dst), check=1))
    assert target.read_text() == "precious" and os.readlink(link) == str(target)
    assert sorted(os.listdir(tmp_path)) == ["link", "results.csv", "src"]


def test_copy_over_a_cache_in_use_keeps_its_readers_on_the_old_file(tmp_path):
    """A process reading DST when copy replaces it keeps reading the old file (never the new bytes); copy says so."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cli("precompute", SPEC, str(src), "--arg", "n=30", "--quiet")
    partial_cache(dst, 30, 10)
    reader = CachedDataset.open(dst)
    assert_same(reader[3], sample_for(3))
    result = cli("copy", str(src), str(dst))
    assert "Replaced" in result.stdout and "other processes had the old cache" in result.stderr
    for i in range(10):
        assert_same(reader[i], sample_for(i))
    with pytest.raises(SampleNotCachedError):
        reader[20]  # cached only in the new file
    reader.close()
    _registry._stores.clear()
    check_cache(dst, 30)


# ---------------------------------------------------------------------- merge


def test_merge_reports_its_total_before_it_starts(tmp_path):
    """merge calls started(total) once, before any progress, with the number of values progress then counts."""
    shards = [tmp_path / "a", tmp_path / "b"]
    for i, shard in enumerate(shards):
        precompute(Synthetic(30), shard, num_workers=0, progress=False, shard=(i, 2))
    events: list = []
    result = tools.merge(
        tmp_path / "out", shards, progress=events.append, started=lambda n: events.append(("total", n))
    )
    assert events[0] == ("total", 30) and sum(events[1:]) == 30 and result.written == 30


def test_merge_refuses_shards_of_different_datasets(tmp_path):
    """Shards with different fingerprints or lengths are refused, and nothing is merged."""
    a, b = tmp_path / "a", tmp_path / "b"
    cli("precompute", SPEC, str(a), "--arg", "n=30", "--shard", "0/2", "--quiet")
    cli("precompute", SPEC, str(b), "--arg", "n=31", "--shard", "1/2", "--quiet")
    line = one_line_error(cli("merge", str(tmp_path / "out"), str(a), str(b), check=1))
    assert "another dataset" in line and "Synthetic:31" in line
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_shard_twice_or_the_output_as_a_shard(tmp_path):
    """The same shard listed twice (by any path) or OUT among the shards is refused in one line, writing nothing."""
    a, b = tmp_path / "a", tmp_path / "b"
    cli("precompute", SPEC, str(a), "--arg", "n=30", "--shard", "0/2", "--quiet")
    cli("precompute", SPEC, str(b), "--arg", "n=30", "--shard", "1/2", "--quiet")
    (tmp_path / "alias").symlink_to(a)
    out = tmp_path / "out"
    assert "listed twice" in one_line_error(cli("merge", str(out), str(a), str(b), str(a), check=1))
    line = one_line_error(cli("merge", str(out), str(a), str(tmp_path / "alias"), check=1))
    assert "listed twice" in line and f"the same as '{a}'" in line
    assert not out.exists()
    before = (a / "data.mdb").read_bytes()
    assert "merged cache itself" in one_line_error(cli("merge", str(a), str(a), str(b), check=1))
    assert (a / "data.mdb").read_bytes() == before


def test_merge_verifies_each_value_against_its_index(tmp_path):
    """A shard value stored under another index stops merge with one line naming the shard and the index."""
    a = tmp_path / "a"
    cli("precompute", SPEC, str(a), "--arg", "n=30", "--quiet", "--pack", "0")  # single records, damaged below
    damage_entries(a, lambda txn: txn.put(key(6), txn.get(key(2))))
    line = one_line_error(cli("merge", str(tmp_path / "out"), str(a), "--quiet", check=1))
    assert f"Shard '{a}': index 6 is damaged" in line and "verify --repair" in line


def test_copy_is_synced_and_drops_the_old_files_unsynced_marker(tmp_path):
    """A copy replaces a cache whose unsynced-commits marker came from another boot: the copy was synced before
    the swap, so the marker (which described the old file) goes with it, and the copy opens without a rebuild."""
    from lmdbcache.store import _fs

    src, dst = tmp_path / "src", tmp_path / "dst"
    ds = CachedDataset(Synthetic(12), src)
    ds.__getitems__(list(range(12)))
    ds.close()
    old = CachedDataset(Synthetic(12), dst)
    old[0]
    old.close()
    (dst / _fs.UNSYNCED).write_text("00000000-0000-4000-8000-000000000000\n")  # a boot that crashed
    assert tools.copy_cache(src, dst, overwrite=True).action == "replaced"
    assert not (dst / _fs.UNSYNCED).exists()
    copied = CachedDataset.open(dst)
    assert copied.cached_count == 12
    assert_same(copied[5], sample_for(5))
    copied.close()


# ---------------------------------------------------------------------- files that are not ours


def link_to_user_file(cache_dir: Path, name: str, tmp_path: Path) -> tuple[Path, bytes]:
    """Replace the cache's ``name`` by a symbolic link to a user file outside it; return the file and its bytes."""
    user = tmp_path / f"notes-{name}.txt"
    content = b"my own file, not the cache's\n" * 10
    user.write_bytes(content)
    (cache_dir / name).unlink(missing_ok=True)
    (cache_dir / name).symlink_to(user)
    return user, content


def test_a_linked_lock_file_is_refused_and_the_file_it_points_to_is_untouched(cache_dir, tmp_path):
    """info, verify, copy and CachedDataset.open refuse a cache whose lock.mdb links to a user file, naming it."""
    precompute(Synthetic(10), cache_dir, num_workers=0, progress=False)
    user, content = link_to_user_file(cache_dir, "lock.mdb", tmp_path)
    for args in (["info", str(cache_dir)], ["verify", str(cache_dir)], ["copy", str(cache_dir), str(tmp_path / "c")]):
        line = one_line_error(cli(*args, check=None))
        assert "lock.mdb" in line and "symbolic link" in line and "Remove" in line, line
    with pytest.raises(CorruptCacheError, match=r"holds 'lock\.mdb' as a symbolic link to"):
        CachedDataset.open(cache_dir)
    with pytest.raises(CorruptCacheError, match=r"lock\.mdb"):
        CachedDataset(Synthetic(10), cache_dir)
    good = tmp_path / "good"
    precompute(Synthetic(10), good, num_workers=0, progress=False)
    with pytest.raises(CorruptCacheError, match=r"lock\.mdb"):
        tools.copy_cache(good, cache_dir)  # the destination's link is not a damaged cache to replace
    assert user.read_bytes() == content
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name", ["lmdbcache.lock", "data.mdb"])
def test_a_linked_write_lock_or_data_file_is_refused(cache_dir, tmp_path, name):
    """A symbolic link as lmdbcache.lock or data.mdb is a CorruptCacheError naming it, before anything opens it."""
    precompute(Synthetic(10), cache_dir, num_workers=0, progress=False)
    user, content = link_to_user_file(cache_dir, name, tmp_path)
    for open_it in (lambda: CachedDataset(Synthetic(10), cache_dir), lambda: CachedDataset.open(cache_dir)):
        with pytest.raises(CorruptCacheError, match=f"holds '{re.escape(name)}' as a symbolic link"):
            open_it()
    assert user.read_bytes() == content


def test_a_lock_file_that_is_a_fifo_is_refused(cache_dir):
    """A lock.mdb that is a FIFO (not a regular file) is refused before LMDB opens it (which would block)."""
    precompute(Synthetic(10), cache_dir, num_workers=0, progress=False)
    (cache_dir / "lock.mdb").unlink()
    os.mkfifo(cache_dir / "lock.mdb")
    with pytest.raises(CorruptCacheError, match=r"holds 'lock\.mdb' as a FIFO"):
        tools.info(cache_dir)


def test_copy_or_merge_onto_a_hard_link_of_the_source_says_so(cache_dir, tmp_path):
    """A destination or shard whose data.mdb is a hard link of another's is refused naming the link and the fix."""
    precompute(Synthetic(10), cache_dir, num_workers=0, progress=False)
    before = (cache_dir / "data.mdb").read_bytes()
    linked = tmp_path / "linked"
    linked.mkdir()
    os.link(cache_dir / "data.mdb", linked / "data.mdb")
    with pytest.raises(LmdbCacheError, match=r"same file as .*\(a hard link: device \d+, inode \d+\).*Either remove"):
        tools.copy_cache(cache_dir, linked)
    with pytest.raises(LmdbCacheError, match=r"is the merged cache .* under another name: .*a hard link"):
        tools.merge(linked, [cache_dir])
    with pytest.raises(LmdbCacheError, match=r"is shard .* under another name: .*a hard link.*List each shard once"):
        tools.merge(tmp_path / "merged", [cache_dir, linked])
    line = one_line_error(cli("copy", str(cache_dir), str(linked), check=None))
    assert "hard link" in line and "Either remove" in line, line
    assert (cache_dir / "data.mdb").read_bytes() == before
    assert not (tmp_path / "merged").exists()
    check_cache(cache_dir, 10)


# ---------------------------------------------------------------------- grouped caches (format 4)


def _grouped(path, n: int, seed: int, indices=None) -> None:
    """A cache at ``path`` filled lazily in shuffled order by commits of 16 (many groups, format 4)."""
    import random

    order = list(range(n)) if indices is None else list(indices)
    random.Random(seed).shuffle(order)
    ds = CachedDataset(Synthetic(n), path, commit_every=16)
    for i in order:
        assert_same(ds[i], sample_for(i))
    ds.close()


def test_merge_of_grouped_shards_is_grouped_whole_and_verified(tmp_path):
    """Two shards filled lazily in shuffled order (groups, pointers) merge into one grouped cache: every index
    once and right, nothing orphaned, verify clean."""
    from test_compact import assert_nothing_orphaned

    n = 200
    _grouped(tmp_path / "a", n, 1, range(0, n, 2))
    _grouped(tmp_path / "b", n, 2, range(1, n, 2))
    tools.merge(tmp_path / "out", [tmp_path / "a", tmp_path / "b"])
    _registry._stores.clear()
    assert sorted(assert_nothing_orphaned(tmp_path / "out")) == list(range(n))
    assert "all intact" in cli("verify", str(tmp_path / "out"), "--quiet").stdout
    check_cache(tmp_path / "out", n)


def test_copy_of_a_grouped_cache_reads_the_same(tmp_path):
    """lmdbcache copy of a grouped cache: the same pointers and groups, every sample right, verify clean."""
    from test_compact import assert_nothing_orphaned, layout

    n = 150
    _grouped(tmp_path / "src", n, 3)
    tools.copy_cache(tmp_path / "src", tmp_path / "dst")
    _registry._stores.clear()
    assert layout(tmp_path / "dst") == layout(tmp_path / "src")
    assert sorted(assert_nothing_orphaned(tmp_path / "dst")) == list(range(n))
    assert "all intact" in cli("verify", str(tmp_path / "dst"), "--quiet").stdout
    check_cache(tmp_path / "dst", n)


def test_repair_of_a_damaged_grouped_value_drops_its_pointer_only(tmp_path):
    """A flipped byte of a value inside a group: verify names that index alone; --repair deletes its pointer (the
    group and its other indices stay), and the sample is decoded again on its next read."""
    from test_compact import layout

    n, path = 64, tmp_path / "c"
    _grouped(path, n, 4)
    before, _, groups = layout(path)
    _flip_in_file(path / "data.mdb", bytes(sample_for(17)[0].flatten().tolist()))
    assert "1 damaged: 17." in cli("verify", str(path), "--quiet", check=1).stdout
    assert "deleted 1 damaged (17)" in cli("verify", str(path), "--repair", "--quiet").stdout
    after, singles, groups_after = layout(path)
    assert after == {i: p for i, p in before.items() if i != 17} and singles == [] and groups_after == groups
    assert "all intact" in cli("verify", str(path), "--quiet").stdout
    ds = CachedDataset(Synthetic(n), path, spot_check=0)
    assert ds.cached_count == n - 1
    assert_same(ds[17], sample_for(17))
    ds.close()
    check_cache(path, n)
