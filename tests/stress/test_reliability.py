"""The cache never serves a wrong sample and never loses a committed one: concurrency, SIGKILL,
map growth, a full disk, flipped bytes, foreign files and odd samples. Iteration counts scale
with LMDBCACHE_STRESS (see conftest.py); each test prints what it ran."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid

import lmdb
import msgpack
import pytest
import torch
from conftest import scaled
from helpers import (
    TAG,
    Big,
    Huge,
    Listed,
    Synthetic,
    assert_none_outlive,
    assert_same,
    sample_for,
    small_disk,
    total_written,
)
from test_cli import _flip_in_file, cli
from test_processes import check_cache, run_script, wait_for_count

import lmdbcache
from lmdbcache import CachedDataset, CacheFullError, CacheMismatchError, CorruptSampleError, SampleNotCachedError
from lmdbcache.store import _handle, _registry

WORKER = """
import functools, json, random, sys
from torch.utils.data import DataLoader
from helpers import Synthetic, assert_same, report_written, report_written_init, sample_for
from lmdbcache import CachedDataset
path, n, seed, mode, rounds, counts = sys.argv[1:7]
n, seed, rounds = int(n), int(seed), int(rounds)
report_written(path, counts)
ds = CachedDataset(Synthetic(n, delay=0.0005), path, commit_every=8, commit_interval=0.05)
rng = random.Random(seed)
reads = 0
if mode == "script":
    for _ in range(rounds):
        if rng.random() < 0.1:
            batch = rng.sample(range(n), 16)
            for i, sample in zip(batch, ds.__getitems__(batch)):
                assert_same(sample, sample_for(i))
            reads += 16
        else:
            i = rng.randrange(n)
            assert_same(ds[i], sample_for(i))
            reads += 1
else:
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context=mode,
                        worker_init_fn=functools.partial(report_written_init, path, counts))
    for _ in range(rounds):
        for images, labels in loader:
            for image, label in zip(images, labels):
                assert_same((image, int(label)), sample_for(int(label)))
                reads += 1
print(json.dumps({"reads": reads}))
"""


def test_six_processes_fill_and_read_at_random(cache_dir, tmp_path):
    """3 scripts reading at random plus a DataLoader with 2 workers (6 processes) share one new cache:
    every read equals its source, and every index ends cached exactly once (commits total N writes)."""
    n = scaled(600, 4000)
    rounds = scaled(400, 5000)
    counts = tmp_path / "written"
    counts.mkdir()
    for iteration in range(scaled(1, 4)):
        path = cache_dir.parent / f"cache-{iteration}"
        procs = [
            run_script(WORKER, str(path), str(n), str(seed), "script", str(rounds), str(counts), wait=False)
            for seed in range(3)
        ]
        procs.append(
            run_script(
                WORKER,
                str(path),
                str(n),
                "9",
                "fork" if iteration % 2 == 0 else "spawn",
                str(scaled(1, 2)),
                str(counts),
                wait=False,
            )
        )
        outputs = []  # every process ends (and its pipes close) before any is judged
        for proc in procs:
            with proc:
                outputs.append((*proc.communicate(timeout=600), proc.returncode))
        for _, err, code in outputs:
            assert code == 0, err
        reads = sum(json.loads(out.strip().splitlines()[-1])["reads"] for out, _, _ in outputs)
        ds = CachedDataset.open(path)
        keys = list(ds._live_store().iter_keys())
        written = total_written(counts)
        print(
            f"iteration {iteration}: 6 processes, {reads} reads checked, {written} keys written, {len(keys)}/{n} cached"
        )
        # The DataLoader read every index; every process's commits count only the keys they added, so the
        # total equals the number of keys exactly when no key was ever written twice.
        assert keys == list(range(n)) and written == n
        for k in keys:
            assert_same(ds[k], sample_for(k))
        ds.close()
        for name in os.listdir(counts):
            os.remove(counts / name)


FILLER = """
import random, sys
from helpers import Synthetic
from lmdbcache import CachedDataset
path, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ds = CachedDataset(Synthetic(n, delay=0.001), path, commit_every=7, commit_interval=0.05)
order = list(range(n))
random.Random(seed).shuffle(order)
for i in order:
    ds[i]
"""


def _dead_readers(ds) -> list[str]:
    """Rows of the cache's LMDB reader table that belong to processes no longer alive."""
    store = ds._live_store()
    store.count()  # opens the environment in this process if needed
    dead = []
    for row in store._env.readers().splitlines()[1:]:
        pid = int(row.split()[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(row)
    return dead


def test_writers_sigkilled_at_random_moments(cache_dir):
    """Fillers and precomputes SIGKILLed at random moments: after each kill the cache opens, every committed
    sample equals its source, no reader slot of a dead process is left, no process of the killed one outlives
    it (precompute's workers, issue 38), and the rest refills."""
    n = scaled(2000, 30000)
    rng = random.Random(0)
    kills = scaled(4, 30)
    counts = []
    for k in range(kills):
        tag = {TAG: uuid.uuid4().hex}
        if k % 2 == 0:
            proc = run_script(FILLER, str(cache_dir), str(n), str(k), wait=False, env=tag)
        else:
            proc = cli(
                "precompute", "helpers:Synthetic", str(cache_dir), "--arg", f"n={n}", "--arg", "delay=0.001",
                "--workers", "2", "--commit-every", "20", "--quiet", wait=False, env=tag,
            )  # fmt: skip
        with proc:
            if k:
                wait_for_count(cache_dir, counts[-1] + 1, timeout=120)  # it is writing
            time.sleep(rng.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        assert_none_outlive(tag[TAG])
        ds = CachedDataset(Synthetic(n), cache_dir)  # opening reclaims dead readers
        assert _dead_readers(ds) == []
        store = ds._live_store()
        committed = list(store.iter_keys())
        for index in committed:
            assert_same(store.get(index), sample_for(index))
        counts.append(len(committed))
        ds.close()
        _registry._stores.clear()
        if len(committed) == n:
            break
    print(f"{len(counts)} SIGKILLs, committed after each: {counts}")
    assert counts == sorted(counts)
    cli("precompute", "helpers:Synthetic", str(cache_dir), "--arg", f"n={n}", "--quiet")
    check_cache(cache_dir, n)


READER = """
import sys, time
from lmdbcache import CachedDataset, SampleNotCachedError
path, n, stop_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import os
ds = CachedDataset.open(path)
hits = rounds = 0
while not os.path.exists(stop_file) or rounds < 2:
    for i in range(n):
        try:
            image, label = ds[i]
        except SampleNotCachedError:
            continue
        assert label == i and int(image[0]) == i % 251 and int(image[-1]) == i % 251, (i, label)
        hits += 1
    rounds += 1
print(hits, rounds)
"""

GROWER = """
import sys
from helpers import Huge
from lmdbcache import CachedDataset
path, n = sys.argv[1], int(sys.argv[2])
ds = CachedDataset(Huge(n, 1 << 20), path, fingerprint="grow", map_size=1 << 20, commit_every=3)
for i in range(n):
    ds[i]
ds.close()
"""


def test_map_grows_from_1_mib_while_others_read(cache_dir):
    """A writer grows a 1 MiB map to hundreds of MiB while two processes read (and check) every index."""
    n = scaled(160, 1000)  # 1 MiB samples
    CachedDataset(Huge(n, 1 << 20), cache_dir, fingerprint="grow", map_size=1 << 20).close()
    _registry._stores.clear()
    stop = cache_dir.parent / "stop"
    readers = [run_script(READER, str(cache_dir), str(n), str(stop), wait=False) for _ in range(2)]
    run_script(GROWER, str(cache_dir), str(n))
    stop.touch()
    hits = []
    for proc in readers:
        with proc:
            out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        hits.append(out.split())
    ds = CachedDataset.open(cache_dir)
    assert ds.cached_count == n
    size = ds._live_store().env_info()["map_size"]
    assert size >= n << 20
    ds.close()
    print(f"map grew from 1 MiB to {size >> 20} MiB for {n} MiB of samples; readers (hits, rounds): {hits}")


FORK_READER = """
import os, sys, traceback
import torch
from lmdbcache import CachedDataset, SampleNotCachedError
torch.set_num_threads(1)  # forked children: no OpenMP pool to inherit
path, n, stop_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ds = CachedDataset.open(path)
forks = 0
while not os.path.exists(stop_file) or forks < 2:
    pid = os.fork()
    if pid == 0:  # a lazy reopen after the fork, raced by the grower
        try:
            for i in range(0, n, 7):
                try:
                    image, label = ds[i]
                except SampleNotCachedError:
                    continue
                assert label == i and int(image[0]) == i % 251, (i, label)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0, "a forked reader failed (its traceback is above)"
    forks += 1
print(forks)
"""


def test_forked_children_reopen_while_another_process_grows_the_map(cache_dir):
    """Forked children reopen the cache (lazily) again and again while a writer grows it from 1 MiB: none fails."""
    n = scaled(160, 1000)  # 1 MiB samples
    CachedDataset(Huge(n, 1 << 20), cache_dir, fingerprint="grow", map_size=1 << 20).close()
    _registry._stores.clear()
    stop = cache_dir.parent / "stop"
    readers = [run_script(FORK_READER, str(cache_dir), str(n), str(stop), wait=False) for _ in range(2)]
    run_script(GROWER, str(cache_dir), str(n))
    stop.touch()
    forks = []
    for proc in readers:
        with proc:
            out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        forks.append(int(out))
    print(f"forked reopens during the growth: {forks}")


def test_disk_full_during_a_lazy_fill(tmp_path):
    """Filling on a disk that fills up raises CacheFullError naming the path and the free space; what was
    committed before stays readable and equal to its source, and nothing partial is ever served."""
    with small_disk(tmp_path, "20m") as mount:
        path = mount / "cache"
        ds = CachedDataset(Big(64), path, commit_every=2)
        with pytest.raises(CacheFullError) as info:
            for i in range(64):
                ds[i]
            ds.flush()
        message = str(info.value)
        assert str(mount) in message and "bytes free" in message and isinstance(info.value, OSError)
        ds.close()
        _registry._stores.clear()
        reopened = CachedDataset.open(path)
        committed = list(reopened._live_store().iter_keys())
        assert 0 < len(committed) < 64
        for index in committed:
            assert torch.equal(reopened[index][0], Big(64)[index][0])
        missing = next(i for i in range(64) if i not in committed)
        with pytest.raises(SampleNotCachedError):
            reopened[missing]
        reopened.close()
        print(f"disk full after {len(committed)} committed samples: {message[:120]}...")


def _flip_byte_of_sample(path, index: int) -> None:
    _flip_in_file(path / "data.mdb", bytes(sample_for(index)[0].flatten().tolist()))


def test_flipped_byte_is_detected_on_read_in_every_process(cache_dir):
    """A flipped byte in a stored value raises CorruptSampleError naming the index, in a fresh process and
    through a DataLoader worker, with or without a source; it is never returned as data."""
    check = """
        import sys
        from helpers import Synthetic
        from lmdbcache import CachedDataset, CorruptSampleError
        for ds in (CachedDataset.open(sys.argv[1]), CachedDataset(Synthetic(20), sys.argv[1])):
            for i in range(20):
                try:
                    ds[i]
                except CorruptSampleError as exc:
                    assert i == 13 and "index 13" in str(exc), (i, exc)
                else:
                    assert i != 13
        print("ok")
    """
    with CachedDataset(Synthetic(20), cache_dir) as ds:
        ds.__getitems__(list(range(20)))
    _registry._stores.clear()
    _flip_byte_of_sample(cache_dir, 13)
    assert run_script(check, str(cache_dir)).stdout.strip() == "ok"
    from torch.utils.data import DataLoader

    loader = DataLoader(CachedDataset.open(cache_dir), batch_size=4, num_workers=1, multiprocessing_context="fork")
    batches = iter(loader)
    try:
        with pytest.raises(CorruptSampleError, match="index 13"):
            for _ in batches:
                pass
    finally:
        batches._shutdown_workers()


def test_random_bit_flips_anywhere_in_a_value(cache_dir, tmp_path):
    """A bit flipped at a random offset of a random stored value (header, structure or data) is caught on
    the first read of that index, and every other index still reads correctly."""
    n = 40
    with CachedDataset(Synthetic(n), cache_dir) as ds:
        ds.__getitems__(list(range(n)))
        ds.flush()
        raw = dict(ds._live_store().iter_raw())
    _registry._stores.clear()
    original = (cache_dir / "data.mdb").read_bytes()
    rng = random.Random(1)
    trials = scaled(6, 60)
    for trial in range(trials):
        index = rng.randrange(n)
        value = raw[index]
        offset, bit = rng.randrange(len(value)), 1 << rng.randrange(8)
        data = bytearray(original)
        at = data.find(value)
        while at >= 0:  # every copy: LMDB may keep a stale one in a free page
            data[at + offset] ^= bit
            at = data.find(value, at + 1)
        copy = tmp_path / f"trial-{trial}"
        copy.mkdir()
        (copy / "data.mdb").write_bytes(bytes(data))
        ds = CachedDataset.open(copy)
        for i in range(n):
            if i == index:
                with pytest.raises(CorruptSampleError, match=f"index {index} "):
                    ds[i]
            else:
                assert_same(ds[i], sample_for(i))
        ds.close()
        _registry._stores.clear()
    print(f"{trials} random bit flips (offset 0..{len(value) - 1} of a value), each caught on read")


@pytest.mark.parametrize("version", [0, lmdbcache.FORMAT_VERSION + 1])
def test_older_and_newer_formats_are_refused(cache_dir, version):
    """A cache whose metadata says another on-disk format raises CacheMismatchError, and is left as it is."""
    with CachedDataset(Synthetic(3), cache_dir) as ds:
        ds[0]
    _registry._stores.clear()
    with lmdb.open(str(cache_dir), max_dbs=2) as env:
        meta_db = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            meta = msgpack.unpackb(txn.get(b"meta", db=meta_db))
            meta["format_version"] = version
            txn.put(b"meta", msgpack.packb(meta), db=meta_db)
    before = (cache_dir / "data.mdb").read_bytes()
    with pytest.raises(CacheMismatchError, match=f"format {version}"):
        CachedDataset(Synthetic(3), cache_dir)
    assert (cache_dir / "data.mdb").read_bytes() == before


def test_odd_samples(cache_dir):
    """Samples that change type between indices, None, zero-length tensors and a 200 MB tensor round-trip."""
    big = torch.arange(200 * 2**20 // 4, dtype=torch.int32)
    samples = [
        None, 7, (torch.zeros(0), torch.zeros(0, 3, dtype=torch.int64)), {"a": torch.empty(5, 0)}, "text",
        [None, (None,)], big,
    ]  # fmt: skip
    ds = CachedDataset(Listed(samples), cache_dir, commit_every=2)
    for i, sample in enumerate(samples):
        assert_same(ds[i], sample)
    ds.close()
    _registry._stores.clear()
    again = CachedDataset.open(cache_dir)
    for i, sample in enumerate(samples):
        assert_same(again[i], sample)
    again.close()


def test_indices_beyond_2_to_the_32(cache_dir):
    """A dataset longer than 2**32: indices past 2**32 are cached, found again, and iterate in order."""
    ds = CachedDataset(Huge(2**33), cache_dir)
    picks = [0, 2**32 - 1, 2**32, 2**32 + 5, 2**33 - 1]
    for i in picks:
        assert_same(ds[i], Huge(2**33)[i])
    assert_same(ds[-1], Huge(2**33)[2**33 - 1])
    ds.close()
    _registry._stores.clear()
    again = CachedDataset.open(cache_dir)
    assert len(again) == 2**33 and again.cached_count == len(picks)
    assert list(again._live_store().iter_keys()) == picks
    for i in picks:
        assert_same(again[i], Huge(2**33)[i])
    with pytest.raises(SampleNotCachedError):
        again[2**32 + 1]
    again.close()


def test_stale_readers_are_cleared_when_the_table_is_full(cache_dir, monkeypatch):
    """Reader slots of SIGKILLed processes do not lock new processes out while another process uses the cache:
    live processes clear dead slots as they go, and a process that finds the table full waits for that."""
    monkeypatch.setattr(_handle, "_READER_CHECK_INTERVAL", 0.0)
    hold = """
        import sys, time, lmdb
        env = lmdb.open(sys.argv[1], max_dbs=2)
        txn = env.begin()
        print("holding", flush=True)
        time.sleep(120)
    """
    CachedDataset(Synthetic(5), cache_dir, max_readers=4).close()
    _registry._stores.clear()
    live = CachedDataset(Synthetic(5), cache_dir, max_readers=4)  # keeps the lock file in use
    live[0]
    for round_ in range(scaled(2, 10)):
        pids = []
        for _ in range(3):
            with run_script(hold, str(cache_dir), wait=False) as proc:
                line = proc.stdout.readline().strip()
                assert line == "holding", (round_, live._live_store()._env.readers(), proc.stderr.read())
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                pids.append(proc.pid)
        # A new process opens and reads despite a table full of dead slots (the live one clears them)...
        opener = run_script(
            """
            import sys
            from helpers import Synthetic, assert_same, sample_for
            from lmdbcache import CachedDataset
            assert_same(CachedDataset(Synthetic(5), sys.argv[1], max_readers=4)[1], sample_for(1))
            """,
            str(cache_dir),
            wait=False,
        )
        with opener:
            deadline = time.monotonic() + 60
            while opener.poll() is None and time.monotonic() < deadline:
                live._live_store()._drop_reader()
                assert_same(live[round_ % 5], sample_for(round_ % 5))  # renews its read txn: clears dead slots
                time.sleep(0.1)
            _, err = opener.communicate(timeout=60)
            assert opener.returncode == 0, err
        assert _dead_readers(live) == []
    live.close()
