"""The commit queue and its thread: time bounds for the whole life of a process, races with forks and Ctrl-C."""

from __future__ import annotations

import _thread
import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import Synthetic, assert_same, sample_for

from lmdbcache import CachedDataset


def committed(path) -> int:
    """Samples committed, as another process sees them (py-lmdb opens an environment once per process): every
    key but the groups' (format 4: a grouped value is counted by its index's pointer)."""
    code = (
        "import lmdb, sys; env = lmdb.open(sys.argv[1], max_dbs=2, readonly=True, lock=False); "
        "db = env.open_db(b'samples', create=False); "
        "print(sum(1 for k in env.begin().cursor(db=db).iternext(values=False) if k[:2] != b'\\xffG'))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def finishes(call, timeout: float = 30) -> bool:
    """Run ``call`` on a daemon thread; True if it returned within ``timeout`` (a hang fails the test, not the run)."""
    done = threading.Event()
    threading.Thread(target=lambda: (call(), done.set()), daemon=True).start()
    return done.wait(timeout)


def slow_commits(ds: CachedDataset, seconds: float) -> None:
    """Make every commit of ``ds``'s store take ``seconds`` longer, so a test can interrupt one mid-write."""
    queue = ds._live_store().writer._queue
    real_write = queue._write

    def slow_write(batch):
        time.sleep(seconds)
        return real_write(batch)

    queue._write = slow_write


def test_commit_interval_holds_for_the_whole_life_of_the_process(cache_dir):
    """Every queued miss is committed within commit_interval of being queued, not only after the first commit."""
    ds = CachedDataset(Synthetic(40), cache_dir, commit_every=10_000, commit_interval=0.3)
    for round_ in range(4):  # v0.1.0 committed the first round only
        for i in range(round_ * 10, round_ * 10 + 10):
            ds[i]
        queued = time.monotonic()
        assert wait_until(lambda n=round_ * 10 + 10: committed(cache_dir) == n, timeout=5.0), (
            round_,
            committed(cache_dir),
        )
        assert time.monotonic() - queued < 3.0
        time.sleep(0.5)  # the thread goes idle between rounds, as a persistent worker between epochs
    ds.close()


def test_a_fork_racing_misses_leaves_a_live_committer(cache_dir):
    """Threads filling misses while the main thread forks in a loop: every sample is committed, nothing hangs."""
    n, forks = 400, 25
    ds = CachedDataset(Synthetic(n), cache_dir, commit_every=7, commit_interval=0.05)
    errors: list[BaseException] = []

    def fill(start: int) -> None:
        try:
            for i in range(start, n, 4):
                ds[i]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fill, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.005)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert not errors, errors
    assert finishes(lambda: ds.flush()), "flush() hung: no live committer thread"
    assert committed(cache_dir) == n
    ds.close()
    check = CachedDataset.open(cache_dir)
    for i in range(0, n, 37):
        assert_same(check[i], sample_for(i))


def test_close_racing_misses_leaves_a_live_committer(cache_dir):
    """close() from one thread while others fill misses: later flushes and closes finish, nothing is lost."""
    n = 300
    ds = CachedDataset(Synthetic(n), cache_dir, commit_every=5, commit_interval=0.05)
    stop = threading.Event()

    def fill(start: int) -> None:
        i = start
        while not stop.is_set() and i < n:
            ds[i]
            i += 3

    threads = [threading.Thread(target=fill, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for _ in range(20):
        ds._live_store().close()  # what a fork or the exit hook does to the shared store
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert finishes(lambda: ds.close()), "close() hung"
    seen = committed(cache_dir)
    with CachedDataset(Synthetic(n), cache_dir) as again:
        again.__getitems__(list(range(n)))
    assert committed(cache_dir) == n and seen <= n


def test_ctrl_c_during_a_drain_leaves_the_queue_usable(cache_dir):
    """KeyboardInterrupt while flush() waits for a commit: the commit still lands and later flushes work."""
    ds = CachedDataset(Synthetic(200), cache_dir, commit_every=10_000, commit_interval=60)
    slow_commits(ds, 0.5)
    ds.__getitems__(list(range(100)))
    threading.Timer(0.1, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        ds.flush()
    ds.__getitems__(list(range(100, 200)))
    assert finishes(lambda: ds.flush()), "flush() hung after a Ctrl-C"
    assert committed(cache_dir) == 200
    ds.close()


def test_a_huge_commit_interval_never_kills_the_committer(cache_dir):
    """commit_interval beyond threading's longest wait (1e10 s) still lets flush() commit."""
    ds = CachedDataset(Synthetic(4), cache_dir, commit_interval=1e10)
    ds[0]
    time.sleep(0.3)  # the thread reaches its timed wait
    assert finishes(lambda: ds.flush()), "flush() hung: the committer thread died"
    assert ds.cached_count == 1
    ds.close()


def test_ctrl_c_twice_during_close_leaves_the_cache_usable(cache_dir):
    """Two KeyboardInterrupts during close() while a batch is written: the environment closes after the write."""
    ds = CachedDataset(Synthetic(100), cache_dir, commit_every=10_000, commit_interval=60)
    slow_commits(ds, 1.0)
    ds.__getitems__(list(range(100)))
    threading.Timer(0.2, _thread.interrupt_main).start()
    threading.Timer(0.4, _thread.interrupt_main).start()
    with contextlib.suppress(KeyboardInterrupt):
        try:
            ds.close()
        except KeyboardInterrupt:
            time.sleep(0.5)  # the second one may land here
            raise
    time.sleep(1.5)  # the write ends; the thread closes the environment
    with CachedDataset.open(cache_dir) as again:
        assert again.cached_count == 100
        assert_same(again[5], sample_for(5))


def test_a_batch_due_by_count_is_written_on_the_callers_thread(cache_dir):
    """A miss that fills the queue to commit_every writes the batch itself, before it returns (no thread hand-over,
    whose GIL ping-pong cost more than the writes); a batch due by time is still the committer thread's, and so
    is every batch of sync=True (its fsync overlaps the decodes there)."""
    ds = CachedDataset(Synthetic(20), cache_dir, commit_every=4, commit_interval=0.2)
    queue = ds._live_store().writer._queue
    real_write, writers = queue._write, []
    queue._write = lambda batch: (writers.append((threading.current_thread(), len(batch))), real_write(batch))[1]
    for i in range(4):
        ds[i]
    assert writers == [(threading.current_thread(), 4)]
    assert committed(cache_dir) == 4
    synced = CachedDataset(Synthetic(20), cache_dir, commit_every=4, commit_interval=0.2, sync=True)
    for i in range(4, 8):
        synced[i]
    assert wait_until(lambda: committed(cache_dir) == 8)
    assert writers[1][0] is not threading.current_thread() and writers[1][1] == 4
    synced.close()
    writers.clear()
    big = CachedDataset(_Big(4), cache_dir / "big", commit_every=2, commit_interval=3600)
    big_queue = big._live_store().writer._queue
    big_write = big_queue._write
    big_queue._write = lambda batch: (writers.append((threading.current_thread(), len(batch))), big_write(batch))[1]
    big[0], big[1]
    big.flush()
    assert writers[0][0] is not threading.current_thread() and writers[0][1] == 2  # 128 KiB values: the thread's
    big.close()
    writers.clear()
    ds[10]
    assert wait_until(lambda: committed(cache_dir) == 9)
    assert writers[0][0] is not threading.current_thread() and writers[0][1] == 1
    ds.close()


class _Big(torch.utils.data.Dataset):
    """Samples of 128 KiB: over INLINE_MEAN."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((128, 1024), i, dtype=torch.uint8), i


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_a_callers_commit_loses_nothing(cache_dir, interrupt):
    """Ctrl-C, or a worker's SIGTERM (SystemExit), landing in a commit written on the caller's thread: the batch is
    queued again and committed by the next flush, every sample right."""
    ds = CachedDataset(Synthetic(8), cache_dir, commit_every=4, commit_interval=3600)
    queue = ds._live_store().writer._queue
    real_write, calls = queue._write, []

    def write_once_interrupted(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise interrupt()
        return real_write(batch)

    queue._write = write_once_interrupted
    for i in range(3):
        ds[i]
    with pytest.raises(interrupt):
        ds[3]
    assert finishes(lambda: ds.flush()), "flush() hung after the interrupt"
    assert committed(cache_dir) == 4
    ds.close()
    check = CachedDataset.open(cache_dir)
    for i in range(4):
        assert_same(check[i], sample_for(i))
    check.close()
