"""Many processes on one cache: DataLoader workers (fork, spawn, forkserver), separate scripts, SIGKILL."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lmdb
import pytest
import torch
from helpers import Listed, Synthetic, assert_same, sample_for, source_reads
from torch.utils.data import DataLoader

from lmdbcache import (
    CachedDataset,
    CacheMismatchError,
    InvalidOptionError,
    LmdbCacheWarning,
    ReadersFullError,
    SampleNotCachedError,
)
from lmdbcache import store as _store
from lmdbcache.store import _env, _fs, _registry

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def run_script(
    code: str, *args: str, wait: bool = True, env: dict | None = None, **kwargs
) -> subprocess.Popen | subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the package and tests/helpers importable (``env``: added)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), **(env or {})}
    argv = [sys.executable, "-c", textwrap.dedent(code), *args]
    if not wait:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, **kwargs)
    assert result.returncode == 0, result.stderr
    return result


def check_cache(path, n: int) -> None:
    """Every index is cached exactly once and equals its source sample."""
    ds = CachedDataset.open(path)
    assert ds.cached_count == n
    for i in range(n):
        assert_same(ds[i], sample_for(i))
    ds.close()


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_workers_fill_one_cache(cache_dir, counts, context, persistent):
    """Two workers fill the cache concurrently; each index is decoded once; epoch 2 reads only the cache."""
    n = 96
    ds = CachedDataset(Synthetic(n, count_dir=counts), cache_dir)
    ds[0]  # the main process holds the cache open when the workers start
    loader = DataLoader(
        ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=context, persistent_workers=persistent
    )
    for _epoch in range(2):
        time.sleep(2.5 if persistent else 0)  # idle persistent workers commit within commit_interval (1 s)
        labels = []
        for images, batch_labels in loader:
            for image, label in zip(images, batch_labels):
                assert torch.equal(image, sample_for(int(label))[0])
                labels.append(int(label))
        assert sorted(labels) == list(range(n))
    del loader  # workers exit, committing what they queued
    assert sorted(source_reads(counts)) == list(range(n))
    assert ds.cached_count == n
    ds.close()
    check_cache(cache_dir, n)


def test_main_process_keeps_working_across_worker_forks(cache_dir):
    """The main process reads before, between and after forking workers (its handle is closed and reopened)."""
    ds = CachedDataset(Synthetic(40), cache_dir)
    for epoch in range(3):
        assert_same(ds[epoch], sample_for(epoch))
        assert (
            sum(len(y) for _, y in DataLoader(ds, batch_size=10, num_workers=2, multiprocessing_context="fork")) == 40
        )
    assert ds.is_complete


FILL_SCRIPT = """
    import random, sys
    from helpers import Synthetic, sample_for, assert_same
    from lmdbcache import CachedDataset
    path, n, seed, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    ds = CachedDataset(Synthetic(n, delay=delay), path, commit_every=int(sys.argv[5]) if len(sys.argv) > 5 else 256)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    for i in order:
        assert_same(ds[i], sample_for(i))
    print("done", flush=True)
"""


def test_two_scripts_fill_one_cache_at_once(cache_dir):
    """Two independent processes fill the same new cache at the same time: no error, every index once and right."""
    n = 400
    with run_script(FILL_SCRIPT, str(cache_dir), str(n), "1", "0.001", "16", wait=False) as a:
        with run_script(FILL_SCRIPT, str(cache_dir), str(n), "2", "0.001", "16", wait=False) as b:
            for p in (a, b):
                _, err = p.communicate(timeout=120)
                assert p.returncode == 0, err
    check_cache(cache_dir, n)
    with lmdb.open(str(cache_dir), max_dbs=2, readonly=True, lock=False) as env, env.begin() as txn:
        assert committed(txn, env.open_db(b"samples", txn=txn, create=False)) == n


def test_reader_runs_while_another_process_fills(cache_dir):
    """A process reading (and filling) at random while another one fills sees only correct samples."""
    n = 300
    CachedDataset(Synthetic(n), cache_dir).close()
    ds = CachedDataset(Synthetic(n), cache_dir)
    reads = 0
    with run_script(FILL_SCRIPT, str(cache_dir), str(n), "7", "0.002", "8", wait=False) as writer:
        deadline = time.monotonic() + 60
        while writer.poll() is None and time.monotonic() < deadline:
            i = reads * 37 % n
            assert_same(ds[i], sample_for(i))
            reads += 1
        _, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
    assert reads > 0
    ds.close()
    check_cache(cache_dir, n)


def test_sigkilled_writer_then_clean_reopen(cache_dir):
    """A writer SIGKILLed mid-fill (unsynced commits) leaves every committed sample intact; a reopen refills the rest.

    Its unsynced-commits marker stays, with this boot's id: the same boot opens the cache as it is (a warning
    would fail the test), and the last close syncs the file and removes the marker.
    """
    n = 2000
    with run_script(FILL_SCRIPT, str(cache_dir), str(n), "3", "0.001", "10", wait=False) as proc:
        wait_for_count(cache_dir, 100)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    marker = cache_dir / _fs.UNSYNCED
    assert marker.read_text().split("\n")[0] == _fs.boot_id()
    ds = CachedDataset(Synthetic(n), cache_dir)
    committed = ds.cached_count
    assert 100 <= committed < n
    reader = CachedDataset.open(cache_dir)
    good = [i for i in range(n) if _cached(reader, i)]
    assert len(good) == committed
    for i in good:
        assert_same(reader[i], sample_for(i))
    for i in range(n):
        assert_same(ds[i], sample_for(i))
    ds.close()
    reader.close()
    assert not marker.exists()
    check_cache(cache_dir, n)


def committed(txn, samples) -> int:
    """Samples stored: one per single record or pointer, a pack's count per pack (its header: magic, then the
    count)."""
    total = 0
    for k, v in txn.cursor(db=samples):
        if k[:2] == b"\xffG":
            break  # groups (format 4) sort last: their values are counted by their indices' pointers
        total += 1 if len(k) == 8 else struct.unpack_from("<I", v, 4)[0]
    return total


def wait_for_count(path, count: int, timeout: float = 60) -> None:
    """Poll (read-only) until at least ``count`` samples are committed at ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with lmdb.open(str(path), max_dbs=2, readonly=True) as env, env.begin() as txn:
                if committed(txn, env.open_db(b"samples", txn=txn, create=False)) >= count:
                    return
        except lmdb.Error:
            pass  # not created yet
        time.sleep(0.02)
    raise AssertionError(f"{path} never reached {count} samples")


def _cached(ds, i) -> bool:
    try:
        ds[i]
    except SampleNotCachedError:
        return False
    return True


def test_queued_samples_are_committed_at_interpreter_exit(cache_dir):
    """A script that never calls close() still commits its queued misses when it exits normally."""
    run_script(FILL_SCRIPT, str(cache_dir), "50", "0", "0", "100000")
    check_cache(cache_dir, 50)


def test_overwrite_wipes_once_not_in_each_worker(cache_dir, counts):
    """overwrite=True empties the cache in the constructing process only; spawn workers never wipe again."""
    with CachedDataset(Synthetic(20), cache_dir) as old:
        old.__getitems__(list(range(20)))
    ds = CachedDataset(Synthetic(20, count_dir=counts), cache_dir, overwrite=True)
    assert ds.cached_count == 0
    ds[0]
    ds.flush()
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="spawn")
    assert sum(len(y) for _, y in loader) == 20
    del loader
    assert ds.cached_count == 20
    assert sorted(source_reads(counts)) == list(range(20))  # index 0 was not wiped and decoded again


def test_worker_errors_reach_the_main_process_with_their_type(tmp_path):
    """A library error in a worker is re-raised in the main process as the same class, message intact."""
    shard = tmp_path / "shard"
    with CachedDataset(Synthetic(10), shard) as ds:
        ds[0]
    loader = DataLoader(CachedDataset.open(shard), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    batches = iter(loader)
    try:
        with pytest.raises(SampleNotCachedError, match="Index 1 is not in cache"):
            next(batches)
    finally:
        batches._shutdown_workers()


HOLD_READER = """
    import sys, time, lmdb
    env = lmdb.open(sys.argv[1], max_dbs=2, max_readers=int(sys.argv[2]))
    txn = env.begin()
    print("holding", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def test_dead_readers_are_reclaimed_on_open(cache_dir):
    """Reader slots left by SIGKILLed processes are reclaimed when the cache is opened."""
    CachedDataset(Synthetic(5), cache_dir).close()
    _registry._stores.clear()
    pids = []
    for _ in range(3):
        with run_script(HOLD_READER, str(cache_dir), "1024", "60", wait=False) as p:
            assert p.stdout.readline().strip() == "holding"
            p.send_signal(signal.SIGKILL)
            p.wait()
            pids.append(p.pid)
    ds = CachedDataset(Synthetic(5), cache_dir)
    ds[0]
    readers = ds._live_store()._env.readers()
    assert not any(str(pid) in readers for pid in pids)
    ds.close()


def test_exhausted_reader_table_is_a_clear_error(cache_dir, monkeypatch):
    """When live processes hold every reader slot, opening raises ReadersFullError saying how to fix it."""
    monkeypatch.setattr(_env, "_OPEN_RETRIES", 2)  # it waits ~6 s for dead slots to be cleared otherwise
    CachedDataset(Synthetic(5), cache_dir, max_readers=2).close()
    _registry._stores.clear()
    with run_script(HOLD_READER, str(cache_dir), "2", "60", wait=False) as a:
        with run_script(HOLD_READER, str(cache_dir), "2", "60", wait=False) as b:
            try:
                for p in (a, b):
                    assert p.stdout.readline().strip() == "holding"
                with pytest.raises(ReadersFullError, match="max_readers"):
                    CachedDataset(Synthetic(5), cache_dir, max_readers=2)
            finally:
                for p in (a, b):
                    p.kill()


GROW_SCRIPT = """
    import sys, torch
    from helpers import Listed
    from lmdbcache import CachedDataset
    samples = [(torch.full((1024, 1024), i, dtype=torch.uint8), i) for i in range(60)]
    ds = CachedDataset(Listed(samples), sys.argv[1], fingerprint="grow", map_size=1 << 20, commit_every=4)
    for i in range(60):
        ds[i]
    ds.close()
"""


def test_readers_keep_working_through_another_process_growing_the_map(cache_dir):
    """A reader opened on a 1 MiB map keeps reading while another process grows it to ~60 MiB (MapResizedError)."""
    from helpers import Listed

    ds = CachedDataset(Listed([(torch.zeros(1), 0)] * 60), cache_dir, fingerprint="grow", map_size=1 << 20)
    seen = set()
    with run_script(GROW_SCRIPT, str(cache_dir), wait=False) as writer:
        while writer.poll() is None:
            for i in range(60):
                try:
                    sample = ds._live_store().get(i)
                except Exception as exc:
                    writer.kill()
                    raise AssertionError(f"read failed during growth: {exc!r}") from exc
                if sample is not _store.MISSING:
                    assert sample[1] == i and int(sample[0][0, 0]) == i
                    seen.add(i)
        _, err = writer.communicate()
        assert writer.returncode == 0, err
    assert ds.cached_count == 60
    assert ds._live_store()._env.info()["map_size"] >= 60 << 20
    assert len(seen) > 0


RESIZED_AT_OPEN_SCRIPT = """
    import os, sys, traceback
    import lmdb, torch
    from helpers import Huge
    from lmdbcache import CachedDataset

    torch.set_num_threads(1)  # a large torch.full in a forked child would wait for the parent's OpenMP threads
    path, n, size = sys.argv[1], 256, 512 << 10
    ds = CachedDataset(Huge(n, size), path, map_size=1 << 20)
    ds[0]
    ds.flush()
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()

    writer = os.fork()
    if writer == 0:  # grows the map past what a reader has just mapped, then answers with the indices cached
        os.close(requests_w)
        w = CachedDataset(Huge(n, size), path, map_size=1 << 20, spot_check=0)
        cached = 1
        with os.fdopen(requests_r) as requests:
            for line in requests:
                mapped = int(line)
                while os.path.getsize(os.path.join(path, "data.mdb")) <= mapped + (1 << 20):
                    w[cached]
                    w.flush()
                    cached += 1
                os.write(answers_w, f"{cached}\\n".encode())
        w.close()
        os._exit(0)

    def reader():  # a forked child's lazy reopen, raced by the writer between LMDB's open and first transaction
        real_open, answers = lmdb.open, os.fdopen(answers_r)
        cached = []

        def open_then_grow(*args, **kwargs):
            env = real_open(*args, **kwargs)
            if not cached:
                os.write(requests_w, f"{env.info()['map_size']}\\n".encode())
                cached.append(int(answers.readline()))
            return env

        lmdb.open = open_then_grow
        for i in (0, 1):
            sample = ds[i]  # the first read opens the cache
        for i in range(cached[0]):
            tensor, index = ds[i]
            assert index == i and tensor.shape == (size,) and int(tensor[0]) == int(tensor[-1]) == i % 251, i

    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            try:
                reader()
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0, "a reader failed (its traceback is above)"
    os.close(requests_w)
    assert os.waitpid(writer, 0)[1] == 0
    print(ds.cached_count)
"""


def test_a_reopen_after_fork_adopts_a_map_grown_by_another_process_meanwhile(cache_dir):
    """A forked child's lazy reopen raced by another process growing the map (MDB_MAP_RESIZED) adopts it and reads."""
    cached = int(run_script(RESIZED_AT_OPEN_SCRIPT, str(cache_dir)).stdout)
    assert cached >= 4  # each reader had the writer grow the file past its map


REBUILD_SCRIPT = """
    import sys, torch
    from helpers import Listed
    from lmdbcache import CachedDataset
    with CachedDataset(Listed([(torch.ones(3), 100 + k) for k in range(8)]), sys.argv[1], fingerprint="dataset-B",
                       overwrite=True) as ds:
        ds.__getitems__(list(range(8)))
"""


def test_a_rebuild_by_another_process_is_noticed_on_the_next_read_transaction(cache_dir):
    """A running process never serves another build's samples as its own: it raises CacheMismatchError."""
    from helpers import Listed

    ds = CachedDataset(Listed([(torch.zeros(3), k) for k in range(8)]), cache_dir, fingerprint="dataset-A")
    ds.__getitems__(list(range(4)))
    ds.flush()
    assert ds[1][1] == 1
    run_script(REBUILD_SCRIPT, str(cache_dir))
    time.sleep(0.3)  # past the kept read transaction's age: the next read opens a new one
    with pytest.raises(CacheMismatchError, match=r"rebuilt.*dataset-B.*by pid"):
        ds[1]
    for read in (lambda: ds[6], lambda: ds.__getitems__([0, 7]), lambda: ds.cached_count):
        with pytest.raises(CacheMismatchError, match="rebuilt"):
            read()
    ds.close()
    with CachedDataset.open(cache_dir) as check:  # B's build is intact: A wrote nothing into it
        assert check.fingerprint == "dataset-B" and [check[k][1] for k in range(8)] == list(range(100, 108))
    with CachedDataset(Listed([(torch.ones(3), 100 + k) for k in range(8)]), cache_dir, fingerprint="dataset-B") as b:
        assert b[2][1] == 102  # a new dataset object in the same process adopts the new build


def test_a_new_object_opens_the_new_build_though_an_old_one_had_misses_queued(cache_dir):
    """After another process rebuilt the cache, constructing the dataset again works; the old queue is dropped."""
    old = CachedDataset(Synthetic(10), cache_dir, commit_interval=60)
    old[0]  # queued, not committed
    run_script(
        "import sys; from helpers import Synthetic; from lmdbcache import CachedDataset\n"
        "CachedDataset(Synthetic(10), sys.argv[1], overwrite=True).close()",
        str(cache_dir),
    )
    new = CachedDataset(Synthetic(10), cache_dir)
    assert_same(new[1], sample_for(1))
    assert new.cached_count == 1  # index 0 of the old build was not written into the new one
    with pytest.raises(CacheMismatchError):
        old[2]
    new.close()
    old.close()


def test_an_old_object_never_reads_the_build_a_new_object_adopted(cache_dir):
    """Another process rebuilt with other data; a new object here adopts it; the old object raises, never serves it."""
    import threading

    from helpers import Listed

    n = 200
    old = CachedDataset(Listed([(torch.ones(4), k) for k in range(n)]), cache_dir, fingerprint="fp")
    old.__getitems__(list(range(n)))
    old.flush()
    run_script(
        "import sys, torch; from helpers import Listed; from lmdbcache import CachedDataset\n"
        f"ds = CachedDataset(Listed([(torch.full((4,), 2.0), k) for k in range({n})]), sys.argv[1], fingerprint='fp',"
        " overwrite=True)\n"
        f"ds.__getitems__(list(range({n}))); ds.close()",
        str(cache_dir),
    )
    served_new: list[int] = []
    stop = threading.Event()

    def read_old() -> None:
        while not stop.is_set():
            for i in range(n):
                try:
                    if float(old[i][0][0]) != 1.0:
                        served_new.append(i)
                except CacheMismatchError:
                    pass

    thread = threading.Thread(target=read_old)
    thread.start()
    for _ in range(5):
        new = CachedDataset(Listed([(torch.full((4,), 2.0), k) for k in range(n)]), cache_dir, fingerprint="fp")
        new[0]
        time.sleep(0.05)
    stop.set()
    thread.join(timeout=60)
    assert served_new == []
    old.close()


FREEZE_SCRIPT = """
    import gc, os, sys
    START = gc.get_freeze_count()  # Python 3.12 starts with some objects frozen (375 in 3.12.1), 3.11 with none
    import torch
    from torch.utils.data import DataLoader
    from helpers import FreezeCount, Synthetic
    from lmdbcache import CachedDataset

    def frozen_in_plain_child():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            ds[1]
            gc.collect()
            os.write(write, str(gc.get_freeze_count()).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        return int(os.read(read, 64))

    ds = CachedDataset(Synthetic(8), sys.argv[1])
    ds[3]
    loader = DataLoader(FreezeCount(ds), batch_size=None, num_workers=1, multiprocessing_context="fork")
    workers = [int(count) for count in loader]
    print(min(workers) - START, frozen_in_plain_child() - START, gc.get_freeze_count() - START)
"""


def test_a_dataloader_worker_forked_with_caches_open_freezes_what_it_inherits(cache_dir):
    """A DataLoader worker forked while a cache is open moves the objects it inherits into the collector's
    permanent generation, so its collections never copy the parent's pages (issue #11's extra memory); another
    forked child, and the parent, keep collecting everything."""
    worker, plain, parent = map(int, run_script(FREEZE_SCRIPT, str(cache_dir)).stdout.split())
    assert worker > 1000  # every object of the parent: modules, torch, the dataset
    assert plain == 0
    assert parent == 0


QUICK_START_SCRIPT = """
import sys
from torch.utils.data import DataLoader
from helpers import Synthetic
from lmdbcache import CachedDataset

path, n, context, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cached = CachedDataset(Synthetic(n, delay=0.002), path, fingerprint="quick-start")
if how == "ds.loader":
    loader = cached.loader(16, shuffle=True, seed=0, num_workers=2, multiprocessing_context=context)
else:
    loader = DataLoader(cached, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context=context,
                        persistent_workers=how == "persistent")
for epoch in range(2):
    for images, labels in loader:
        if how == "break" and epoch == 1:
            break
# the script just ends: no close(), no del, the loader and its workers still alive
"""


@pytest.mark.parametrize(
    ("context", "how"),
    [
        ("fork", "persistent"),
        ("spawn", "persistent"),
        ("forkserver", "persistent"),
        ("fork", "break"),
        ("spawn", "ds.loader"),
    ],
)
def test_the_quick_start_recipe_loses_nothing_when_the_script_just_ends(cache_dir, context, how):
    """Everything DataLoader workers decoded is committed and synced when a script ends with its loader alive."""
    n = 300
    run_script(QUICK_START_SCRIPT, str(cache_dir), str(n), context, how)
    assert not (cache_dir / _fs.UNSYNCED).exists()  # every process that committed synced on its way out
    check_cache(cache_dir, n)


def _another_boot(tmp_path, monkeypatch) -> None:
    """From here on this process sees another boot id: a simulated reboot."""
    boot = tmp_path / "boot_id"
    boot.write_text("11111111-2222-4333-8444-555555555555\n")
    monkeypatch.setattr(_fs, "BOOT_ID_FILE", str(boot))


def test_a_killed_workers_marker_is_cleared_by_the_next_sync_and_survives_a_reboot(cache_dir, tmp_path, monkeypatch):
    """A marker left by a process killed in this boot goes at the next writable open; a reboot then reads it all."""
    n = 2000
    with run_script(FILL_SCRIPT, str(cache_dir), str(n), "3", "0.001", "10", wait=False) as proc:
        wait_for_count(cache_dir, 100)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    marker = cache_dir / _fs.UNSYNCED
    assert marker.exists()
    reader = CachedDataset.open(cache_dir)  # a writable open of this boot: one sync, and the marker is gone
    assert not marker.exists()
    committed = reader.cached_count
    reader.close()
    _another_boot(tmp_path, monkeypatch)
    after = CachedDataset.open(cache_dir)
    assert after.cached_count == committed >= 100
    after.close()


PRECOMPUTE_INTERRUPT_SCRIPT = """
import os, signal, sys
from helpers import Synthetic
from lmdbcache.store import _fs
from lmdbcache.tools.cli import main

real_sync = _fs.sync_data_file

def interrupted_sync(path):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the final sync runs
    real_sync(path)

_fs.sync_data_file = interrupted_sync
sys.exit(main(["precompute", "helpers:Synthetic", sys.argv[1], "--arg", "n=200", "--workers", "0"]))
"""


def test_ctrl_c_during_precomputes_final_sync_finishes_it_and_prints_the_summary(cache_dir, tmp_path, monkeypatch):
    """Ctrl-C during the last sync waits for it and the marker's removal, then reports; a reboot reads every sample."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    argv = [sys.executable, "-c", textwrap.dedent(PRECOMPUTE_INTERRUPT_SCRIPT), str(cache_dir)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert "Interrupted: kept" in result.stdout + result.stderr, result.stderr
    assert not (cache_dir / _fs.UNSYNCED).exists()
    _another_boot(tmp_path, monkeypatch)
    check_cache(cache_dir, 200)


@pytest.mark.parametrize(
    "command",
    [
        ["verify"],
        ["precompute", "helpers:Synthetic", "--arg", "n=64", "--workers", "0"],  # nothing left to write
        ["info"],
    ],
)
def test_a_marker_of_this_boot_goes_with_verify_a_no_op_precompute_or_info(cache_dir, tmp_path, monkeypatch, command):
    """A marker that a killed process of this boot left is cleared (after a sync) by the CLI's next writable open;
    after a simulated reboot the cache opens and reads every sample."""
    ds = CachedDataset(Synthetic(64), cache_dir)
    for i in range(64):
        ds[i]
    ds.close()
    marker = cache_dir / _fs.UNSYNCED
    marker.write_text(f"{_fs.boot_id()}\n{{}}\n")  # as a process killed after a commit leaves it
    path = str(cache_dir)
    argv = [command[0], *([command[1], path, *command[2:]] if command[0] == "precompute" else [path])]
    run_script("import sys; from lmdbcache.tools.cli import main; sys.exit(main(sys.argv[1:]))", *argv)
    assert not marker.exists()
    _another_boot(tmp_path, monkeypatch)
    check_cache(cache_dir, 64)


FREEZE_OPTION_SCRIPT = """
import gc, sys
START = gc.get_freeze_count()  # Python 3.12 starts with some objects frozen, 3.11 with none
from torch.utils.data import DataLoader
from helpers import FreezeCount, Synthetic
from lmdbcache import CachedDataset

option = {"None": None, "True": True, "False": False}[sys.argv[2]]
ds = CachedDataset(Synthetic(8), sys.argv[1], freeze_worker_gc=option)
ds[3]
if sys.argv[3] == "closed":
    ds.close()  # no cache open at the fork: freezing would not pay
loader = DataLoader(FreezeCount(ds), batch_size=None, num_workers=1, multiprocessing_context="fork")
print(min(int(count) for count in loader) - START, gc.get_freeze_count() - START)
"""


@pytest.mark.parametrize(
    ("option", "at_fork", "frozen"),
    [("None", "open", True), ("None", "closed", False), ("False", "open", False), ("True", "closed", True)],
)
def test_freeze_worker_gc_freezes_workers_only_where_asked(cache_dir, option, at_fork, frozen):
    """freeze_worker_gc: None freezes a DataLoader worker only if forked with a cache open; True always; False never."""
    worker, parent = map(int, run_script(FREEZE_OPTION_SCRIPT, str(cache_dir), option, at_fork).stdout.split())
    assert (worker > 1000) is frozen
    assert parent == 0


def test_freeze_worker_gc_must_be_none_or_a_bool(cache_dir):
    """freeze_worker_gc=1 or "yes" is an InvalidOptionError naming the values it takes."""
    for bad in (1, "yes"):
        with pytest.raises(InvalidOptionError, match="freeze_worker_gc must be None"):
            CachedDataset(Synthetic(8), cache_dir, freeze_worker_gc=bad)


MID_BATCH_EXIT_SCRIPT = """
import os, sys, time, torch
from torch.utils.data import DataLoader, Dataset
from lmdbcache import CachedDataset

class Slow(Dataset):
    def __init__(self, log):
        self.log = log
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.2)  # an expensive decode
        with open(self.log, "a") as f:
            f.write(f"{i}\\n")
        return torch.full((3, 5), i, dtype=torch.uint8), i

if __name__ == "__main__":
    ds = CachedDataset(Slow(sys.argv[2]), sys.argv[1])
    loader = DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True, multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    time.sleep(0.7)  # the workers are a few samples into their next batch when the script ends
"""


def test_a_worker_ended_mid_batch_keeps_every_sample_it_decoded(cache_dir, tmp_path):
    """SIGTERM at the script's end lands inside the source's __getitem__: the batch's samples read before it are
    committed anyway (each is queued as soon as it is read; the attack found up to batch_size - 1 lost per worker)."""
    log = tmp_path / "decoded.log"
    run_script(MID_BATCH_EXIT_SCRIPT, str(cache_dir), str(log))
    decoded = {int(line) for line in log.read_text().split()}
    ds = CachedDataset.open(cache_dir)
    assert len(decoded) > 16 and ds.cached_count == len(decoded)
    for i in decoded:
        assert int(ds[i][1]) == i
    ds.close()


OTHER_FILLS_SCRIPT = """
import sys
import torch
from helpers import Listed
from lmdbcache import CachedDataset
source = Listed([(torch.full((4,), 100 + i), i) for i in range(10)])
ds = CachedDataset(source, sys.argv[1], fingerprint="t", spot_check=0)
for i in (3, 4):
    ds[i]
ds.flush()
"""


def test_a_miss_after_another_processs_commit_finds_its_value(cache_dir, monkeypatch):
    """The read transaction kept across a fill's misses (its snapshot the newest) is not trusted once another
    process (or this one's queue) has committed since: a later read finds those values, the source untouched."""
    import lmdbcache.store._read as read_module

    monkeypatch.setattr(read_module, "_READER_MAX_AGE", 600.0)  # the kept transaction outlives the other's commit
    called = []

    class Counting(Listed):
        def __getitem__(self, i):
            called.append(i)
            return super().__getitem__(i)

    ds = CachedDataset(Counting([(torch.full((4,), i), i) for i in range(10)]), cache_dir, fingerprint="t")
    assert torch.equal(ds[0][0], torch.full((4,), 0)) and torch.equal(ds[1][0], torch.full((4,), 1))  # misses
    ds.flush()  # this process's own commit: the kept snapshot is no longer the newest
    assert torch.equal(ds[2][0], torch.full((4,), 2))  # a miss in a new snapshot
    run_script(OTHER_FILLS_SCRIPT, str(cache_dir))  # commits 3 and 4 with other values, after our snapshot
    assert torch.equal(ds[3][0], torch.full((4,), 103)) and torch.equal(ds[4][0], torch.full((4,), 104))
    assert called == [0, 1, 2]
    assert torch.equal(ds[0][0], torch.full((4,), 0)) and called == [0, 1, 2]
    ds.close()


def test_the_reboot_warning_points_at_the_users_line(cache_dir, tmp_path, monkeypatch):
    """The warning that an unsynced cache of another boot is being rebuilt names the caller's file and line (the
    CachedDataset(...) call), not a line inside lmdbcache."""
    ds = CachedDataset(Synthetic(8), cache_dir)
    ds[0]
    ds.close()
    (cache_dir / _fs.UNSYNCED).write_text(f"{_fs.boot_id()}\n{{}}\n")  # a process of this boot died unsynced
    _another_boot(tmp_path, monkeypatch)
    with pytest.warns(LmdbCacheWarning, match="being rebuilt") as caught:
        line = sys._getframe().f_lineno + 1
        CachedDataset(Synthetic(8), cache_dir).close()
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


EXIT_FAILS_SCRIPT = """
import sys, torch, warnings
from torch.utils.data import Dataset
from lmdbcache import CachedDataset

class Big(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return (torch.full((100_000,), i, dtype=torch.uint8),)

warnings.simplefilter(sys.argv[2])
ds = CachedDataset(Big(), sys.argv[1] + "/c", commit_every=1000, commit_bytes=1 << 30, commit_interval=3600)
for i in range(40):
    ds[i]  # queued, never flushed: the exit's commit fails on the full disk
"""


@pytest.mark.parametrize("action", ["default", "error"])
def test_the_exit_flush_runs_once_per_process(tmp_path, action):
    """The exit hook runs once in a main process (atexit and multiprocessing's exit hook both call it): a commit
    that fails at exit (a full disk) warns once, and under -W error gives one traceback, not two."""
    from helpers import small_disk

    with small_disk(tmp_path, "2m") as mount:
        result = run_script(EXIT_FAILS_SCRIPT, str(mount), action)
    assert result.stderr.count("samples decoded by this process were not committed") == 1, result.stderr
