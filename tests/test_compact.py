"""Groups (format 4, ``format/_group``): a commit's small values in one record, a pointer per index; real LMDB,
real processes, real SIGKILL."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct

import pytest
import torch
from helpers import Synthetic, assert_same, key, raw_cache, sample_for
from test_cli import cli
from test_processes import FILL_SCRIPT, check_cache, run_script, wait_for_count

from lmdbcache import FORMAT_VERSION, CachedDataset, CorruptSampleError
from lmdbcache.format.codec import encode
from lmdbcache.store import _registry

# Every entry of a cache, read straight from LMDB in another process (py-lmdb refuses a second environment on a
# file this process has open): {index: pointer (group, offset, length)}, the indices stored alone, {group: size}.
LAYOUT = """
    import json, struct, sys, lmdb
    pointers, singles, groups = {}, [], {}
    with lmdb.open(sys.argv[1], max_dbs=2, readonly=True, lock=False) as env, env.begin() as txn:
        for k, v in txn.cursor(db=env.open_db(b"samples", txn=txn, create=False)):
            if len(k) == 8 and len(v) == 20 and v[:4] == b"LMGP":
                pointers[int.from_bytes(k, "big")] = struct.unpack_from("<QII", v, 4)
            elif len(k) == 8:
                singles.append(int.from_bytes(k, "big"))
            else:
                assert len(k) == 10 and k[:2] == b"\\xffG", k
                groups[int.from_bytes(k[2:], "big")] = len(v)
    print(json.dumps([pointers, singles, groups]))
"""


def layout(path) -> tuple[dict[int, tuple[int, int, int]], list[int], dict[int, int]]:
    pointers, singles, groups = json.loads(run_script(LAYOUT, str(path)).stdout)
    return {int(i): tuple(p) for i, p in pointers.items()}, singles, {int(g): s for g, s in groups.items()}


def assert_nothing_orphaned(path) -> dict[int, tuple[int, int, int]]:
    """Every group is exactly the values its pointers point to (8-byte aligned, no gap, no overlap): no byte of a
    group is stored that no index points to, and no pointer leaves its group. Returns the pointers."""
    pointers, singles, groups = layout(path)
    assert not set(pointers) & set(singles)
    spans: dict[int, list[tuple[int, int]]] = {g: [] for g in groups}
    for index, (group, offset, length) in pointers.items():
        assert group in spans, f"index {index} points to group {group}, which is missing"
        spans[group].append((offset, length))
    for group, found in spans.items():
        found.sort()
        at = 0
        for offset, length in found:
            assert offset == at, f"group {group}: bytes {at} to {offset} are orphaned (or overlap)"
            at = offset + length + (-length % 8)
        assert at == groups[group], f"group {group} holds {groups[group]} bytes, its pointers cover {at}"
    return pointers


def test_a_shuffled_lazy_fill_groups_small_values_and_stays_compact(cache_dir):
    """The default path, filled in shuffled order: small values in groups, large ones alone, the file near the
    payload (3 KiB samples: <= 1.1x the tensors' bytes), every sample read back exactly."""
    n = 3000
    ds = CachedDataset(_Sized(n), cache_dir)
    order = list(range(n))
    random.Random(0).shuffle(order)
    for i in order:
        assert_same(ds[i], _Sized.sample(i))
    ds.close()
    payload = sum(_Sized.sample(i)[0].numel() for i in range(n))
    disk = sum(os.path.getsize(cache_dir / name) for name in os.listdir(cache_dir))
    assert disk <= 1.1 * payload, disk / payload
    pointers = assert_nothing_orphaned(cache_dir)
    _, singles, _ = layout(cache_dir)
    assert sorted(singles) == [i for i in range(n) if i % 100 == 7]  # the 20 KiB ones stay alone
    assert len(pointers) == n - len(singles)
    reader = CachedDataset.open(cache_dir)
    assert reader.cached_count == n and reader._live_store().meta()["format_version"] == FORMAT_VERSION == 4
    for i in order[:500]:
        assert_same(reader[i], _Sized.sample(i))
    assert all(assert_same(s, _Sized.sample(i)) is None for i, s in zip(order[:64], reader.__getitems__(order[:64])))
    reader.close()


class _Sized(torch.utils.data.Dataset):
    """3 KiB samples, and every hundredth (index % 100 == 7) a 20 KiB one: too large to group."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @staticmethod
    def sample(i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        shape = (20, 32, 32) if i % 100 == 7 else (3, 32, 32)
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g), i

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.sample(i)


def test_a_lone_small_value_is_stored_alone(cache_dir):
    """A commit of one small value writes it as a single record (a group of one saves nothing)."""
    ds = CachedDataset(Synthetic(8), cache_dir, commit_every=1)
    for i in range(3):
        ds[i]
    ds.close()
    pointers, singles, groups = layout(cache_dir)
    assert (pointers, singles, groups) == ({}, [0, 1, 2], {})


def test_a_commit_meeting_stored_indices_groups_only_the_new_ones(cache_dir):
    """A commit whose batch holds indices already stored (by another process, say) keeps the stored values and groups
    only the new ones: the hopeful single putmulti of the pointers is undone and the batch written again."""
    src = Synthetic(40)
    ds = CachedDataset(src, cache_dir)
    store = ds._live_store()
    assert store.put_many([(i, encode(src[i], i)) for i in range(10)], ds._build) == 10
    assert store.put_many([(i, encode(src[i], i)) for i in range(5, 20)], ds._build) == 10
    ds.close()
    pointers = assert_nothing_orphaned(cache_dir)
    assert sorted(pointers) == list(range(20))
    assert {pointers[i][0] for i in range(10)} == {0} and {pointers[i][0] for i in range(10, 20)} == {1}
    check = CachedDataset.open(cache_dir)
    for i in range(20):
        assert_same(check[i], sample_for(i))
    check.close()


def test_an_index_given_twice_in_one_write_keeps_its_first_value(cache_dir):
    """``put_many`` (precompute's and merge's write) given an index twice writes it once, with its first value, as
    the queue keeps a miss's first value: both in one group made every retry meet it again, and the write failed
    saying the map could not grow (found by an attack)."""
    src = Synthetic(40)
    ds = CachedDataset(src, cache_dir)
    store = ds._live_store()
    other = encode(src[9], 8)  # index 8's key, another sample's data: what a second value would be
    batch = [(i, encode(src[i], i)) for i in range(8)] + [(8, encode(src[8], 8)), (8, other), (3, other)]
    assert store.put_many(batch, ds._build) == 9
    ds.close()
    assert sorted(assert_nothing_orphaned(cache_dir)) == list(range(9))
    with CachedDataset.open(cache_dir) as check:
        for i in range(9):
            assert_same(check[i], sample_for(i))


def test_three_processes_filling_at_once_keep_the_first_writer(cache_dir):
    """Three processes fill one cache in different orders: each index stored once, no group byte orphaned by a
    value another process had committed first, every sample right; verify finds nothing."""
    n = 600
    CachedDataset(Synthetic(n), cache_dir).close()
    procs = [
        run_script(FILL_SCRIPT, str(cache_dir), str(n), str(seed), "0.0003", "16", wait=False) for seed in (1, 2, 3)
    ]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    pointers = assert_nothing_orphaned(cache_dir)
    _, singles, _ = layout(cache_dir)  # a commit that met one small value stores it alone: timing decides
    assert sorted([*pointers, *singles]) == list(range(n))
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    check_cache(cache_dir, n)


def test_a_sigkilled_writer_loses_no_committed_sample_and_orphans_nothing(cache_dir):
    """A writer SIGKILLed mid-fill (commits of 10): every committed index reads back, every group is whole and
    fully pointed to; a refill completes the cache."""
    n = 600
    with run_script(FILL_SCRIPT, str(cache_dir), str(n), "3", "0.001", "10", wait=False) as proc:
        wait_for_count(cache_dir, 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    pointers = assert_nothing_orphaned(cache_dir)
    assert 60 <= len(pointers) < n
    assert "all intact" in cli("verify", str(cache_dir), "--quiet").stdout
    ds = CachedDataset(Synthetic(n), cache_dir)
    assert ds.cached_count == len(pointers)
    for i in pointers:
        assert_same(ds[i], sample_for(i))
    for i in range(n):
        assert_same(ds[i], sample_for(i))
    ds.close()
    assert sorted(assert_nothing_orphaned(cache_dir)) == list(range(n))


def _set_pointer(path, index: int, edit) -> None:
    with raw_cache(path) as (txn, samples, _):
        value = bytearray(txn.get(key(index), db=samples))
        assert value[:4] == b"LMGP"
        edit(value, txn, samples)
        txn.put(key(index), bytes(value), db=samples)


def _point_to(other: int):
    def edit(value, txn, samples):
        value[4:] = bytes(txn.get(key(other), db=samples))[4:]

    return edit


def _truncate_group(value, txn, samples):
    group = struct.unpack_from("<Q", value, 4)[0]
    whole = bytes(txn.get(b"\xffG" + group.to_bytes(8, "big"), db=samples))
    offset = struct.unpack_from("<I", value, 12)[0]
    txn.put(b"\xffG" + group.to_bytes(8, "big"), whole[: offset + 8], db=samples)


HOSTILE = {
    "past its group": (lambda v, t, s: struct.pack_into("<I", v, 12, 1 << 30), "points to bytes 1073741824"),
    "unaligned": (lambda v, t, s: struct.pack_into("<I", v, 12, 3), "points to bytes 3 to"),
    "empty": (lambda v, t, s: struct.pack_into("<I", v, 16, 0), "points to bytes"),
    "missing group": (lambda v, t, s: struct.pack_into("<Q", v, 4, 99), "its group 99 is missing"),
    "another index": (_point_to(4), "index"),
    "truncated group": (_truncate_group, "points to bytes"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_pointer_that_lies_is_the_indexs_corrupt_sample_error(cache_dir, name):
    """A pointer out of its group, unaligned, empty, to a missing or truncated group, or to another index's value:
    CorruptSampleError naming the index on every read path (get, batches, the loader), never a crash or a wrong
    sample; verify names it and --repair drops the pointer, after which the sample is decoded again."""
    edit, words = HOSTILE[name]
    ds = CachedDataset(Synthetic(16), cache_dir)
    ds.__getitems__(list(range(16)))
    ds.close()
    _registry._stores.clear()
    _set_pointer(cache_dir, 9, edit)
    reader = CachedDataset.open(cache_dir)
    with pytest.raises(CorruptSampleError, match=f"index 9.*{words}"):
        reader[9]
    with pytest.raises(CorruptSampleError, match="index 9"):
        reader.__getitems__([8, 9])
    with pytest.raises(CorruptSampleError, match="index 9"):
        list(reader.loader(batch_size=4))
    if name != "truncated group":  # the truncated group held index 9's neighbours too
        assert_same(reader[3], sample_for(3))
    reader.close()
    _registry._stores.clear()
    result = cli("verify", str(cache_dir), "--quiet", check=1)
    assert " 9" in result.stdout.split("damaged:")[1] and "all intact" not in result.stdout
    cli("verify", str(cache_dir), "--repair", "--quiet")
    _registry._stores.clear()
    ds = CachedDataset(Synthetic(16), cache_dir)
    for i in range(16):
        assert_same(ds[i], sample_for(i))
    ds.close()


def test_a_golden_v4_cache_is_grouped(tmp_path):
    """tests/data/golden-v4 holds its samples in one group, a pointer per index (the layout it guards)."""
    copy = tmp_path / "golden"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "golden-v4"), copy)
    pointers, singles, groups = layout(copy)
    assert sorted(pointers) == list(range(7)) and singles == [] and list(groups) == [0]


def test_bench_compact_runs_at_tiny_sizes(capsys):
    """bench/compact.py runs end to end (one library, 3 KiB samples): a shuffled lazy fill, by one process and by
    2 DataLoader workers, stays under 1.2x the payload, and so does a reader's PSS."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        import compact
    finally:
        sys.path.pop(0)
    found = compact.main(["--reps", "1", "--n", "300", "--sizes", "3KiB"])["3KiB"]["lib"]
    assert found["disk"] < 1.2 and found["disk_workers"] < 1.2 and found["pss"] < 1.2, found
    assert "| 3KiB | lib |" in capsys.readouterr().out
