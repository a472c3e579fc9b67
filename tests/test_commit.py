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


def test_a_delete_racing_commits_never_deadlocks(cache_dir):
    """``delete`` (verify --repair's) while another thread's misses are committed: the committer takes the store's
    lock inside the write lock (its puts), so a delete that held the store's lock while waiting for the write lock
    would hang both. It drains first; every delete finishes and the deleted indices are decoded again."""
    n = 600
    ds = CachedDataset(Synthetic(n), cache_dir, commit_every=3, commit_interval=0.01)
    store = ds._live_store()
    for i in range(20):
        ds[i]
    ds.flush()
    stop = threading.Event()

    def fill() -> None:
        for i in range(20, n):
            if stop.is_set():
                return
            ds[i]

    filler = threading.Thread(target=fill)
    filler.start()
    deleted = 0
    try:
        for k in range(200):
            assert finishes(lambda k=k: store.delete([k % 20]), timeout=20), f"delete {k} hung beside a commit"
            deleted += 1
    finally:
        stop.set()
        filler.join(timeout=60)
    assert deleted == 200 and not filler.is_alive()
    for i in range(0, 20):
        assert_same(ds[i], sample_for(i))  # deleted, decoded again
    ds.close()


def test_a_batch_left_in_flight_without_a_thread_is_still_written(cache_dir):
    """The state a ``stop`` cut short by Ctrl-C leaves (its ``finally`` tells the thread to stop before the thread
    took the batch handed to it): a batch in flight and no committer. Whoever waits for it starts one: the flush
    finishes and every sample is committed (it hung: ``hand_off`` and ``drain`` waited for a thread that was gone)."""
    ds = CachedDataset(Synthetic(50), cache_dir, commit_every=10_000, commit_interval=3600)
    for i in range(20):
        ds[i]
    queue = ds._live_store().writer._queue
    with ds._live_store()._lock:
        committer = queue._committer
        assert committer is not None and len(queue.pending) == 20 and not queue.inflight
        queue.inflight, queue.pending, queue.pending_bytes = queue.pending, {}, 0  # handed off (hand_off)
        committer.stop, queue._committer = True, None  # and the thread told to stop first (stop's finally)
        queue._cond.notify_all()
    committer.thread.join(timeout=10)
    assert not committer.thread.is_alive() and len(queue.inflight) == 20
    assert finishes(ds.flush), "flush() waited for a batch no thread would write"
    assert committed(cache_dir) == 20
    ds.close()
