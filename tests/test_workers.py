"""lmdbcache.Loader on worker processes (``num_workers``): the thread path's batches, resume, errors, shutdown."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
from helpers import TAG, Synthetic, assert_none_outlive, held_children
from test_cli import ROOT, TESTS
from test_commit import wait_until
from test_loader import close_mid_pass, random_transform, reference, same, warm

from lmdbcache import CachedDataset, InvalidOptionError

pytestmark = pytest.mark.timeout(120)


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def assert_no_children_after(before: set[int]) -> None:
    """Every child process started since ``before`` ends within 10 s."""
    deadline = time.monotonic() + 10
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not children() - before


def transformed(cache_dir, n=40, transform=random_transform):
    warm(CachedDataset(Synthetic(n), cache_dir)).close()
    return CachedDataset.open(cache_dir, transform=transform)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_processes_give_the_thread_paths_batches(cache_dir, context):
    """A random per-sample transform gives equal batches on 2 worker processes and on the threads, epoch by
    epoch (each index is seeded from (seed, epoch, index) on both), and close() ends the workers."""
    ds = transformed(cache_dir)
    before = children()
    runs = []
    for workers in (0, 2):
        loader = ds.loader(8, shuffle=True, seed=3, num_workers=workers, multiprocessing_context=context)
        runs.append([list(loader), list(loader)])
        if workers:
            assert not children() - before  # the workers of a pass end with it
        loader.close()
    same(runs[0], runs[1])
    labels = torch.cat([b[1] for b in runs[1][0]]) // 1000
    assert sorted(labels.tolist()) == list(range(40))
    assert_no_children_after(before)


def test_without_a_transform_workers_give_dataloaders_batches(cache_dir):
    """num_workers without a transform: DataLoader's batches (built with lmdbcache.collate in the workers)."""
    ds = warm(CachedDataset(Synthetic(30), cache_dir))
    with ds.loader(8, shuffle=True, seed=2, num_workers=2) as loader:
        same(list(loader), reference(ds, 8, seed=2, shuffle=True))


def test_workers_resume_mid_epoch_and_count_delivered_batches(cache_dir):
    """state_dict counts batches the consumer received; a new loader resumes at the next one, on workers too."""
    ds = transformed(cache_dir)
    with ds.loader(4, shuffle=True, seed=5, num_workers=2) as loader:
        full = list(loader)
    with ds.loader(4, shuffle=True, seed=5, num_workers=2) as loader:
        for k, _ in enumerate(loader):
            if k == 2:
                break
        state = loader.state_dict()
    assert (state["seed"], state["epoch"], state["batches"], state["samples"]) == (5, 0, 3, 12)
    with ds.loader(4, shuffle=True, seed=5, num_workers=2) as loader:
        loader.load_state_dict(state)
        same(list(loader), full[3:])


def failing(sample):
    if sample[1] == 13:
        raise ValueError("bad augmentation")
    return sample


def test_a_transform_error_in_a_worker_reaches_the_consumer_with_its_index(cache_dir):
    """A transform failing in a worker is re-raised in the consumer, naming the index and the batch."""
    ds = transformed(cache_dir, 24, failing)
    before = children()
    loader = ds.loader(4, num_workers=2)
    with pytest.raises(ValueError, match="bad augmentation") as info:
        list(loader)
    assert "index 13" in str(info.value)
    assert "batch 3" in " ".join(getattr(info.value, "__notes__", []))
    loader.close()
    loader.close()
    assert_no_children_after(before)


def test_close_from_another_thread_ends_a_worker_pass_clearly(cache_dir):
    """close() from another thread while the consumer reads from the workers: 'was closed', no worker left."""
    ds = transformed(cache_dir, 200)
    before = children()
    close_mid_pass(ds.loader(2, num_workers=2))
    assert_no_children_after(before)


def test_worker_count_is_automatic_or_checked(cache_dir):
    """None: worker processes (num_threads of them) when the dataset has a per-sample transform, else threads."""
    ds = warm(CachedDataset(Synthetic(8), cache_dir))
    assert ds.loader(4).worker_processes == 0
    assert ds.loader(4, num_workers=3).worker_processes == 3
    ds.close()
    with_transform = CachedDataset.open(cache_dir, transform=lambda s: s)
    assert with_transform.loader(4, num_threads=3).worker_processes == 3
    assert with_transform.loader(4, num_workers=0).worker_processes == 0
    for bad in (-1, 1.5, "2"):
        with pytest.raises(InvalidOptionError, match="num_workers"):
            ds.loader(4, num_workers=bad)


def test_a_transform_spawn_cannot_send_is_a_clear_error(cache_dir):
    """A lambda transform with spawned workers: InvalidOptionError naming the transform, module level and
    num_workers=0 (torch alone says only that a pickle failed), no process left, and num_workers=0 then works."""
    ds = transformed(cache_dir, 12, transform=lambda sample: sample)
    before = children()
    with ds.loader(4, num_workers=2, multiprocessing_context="spawn") as loader:
        with pytest.raises(InvalidOptionError, match=r"'spawn'.*lambda.*module level.*num_workers=0"):
            next(iter(loader))
    assert_no_children_after(before)
    with ds.loader(4, num_workers=0) as loader:
        assert sum(len(batch[1]) for batch in loader) == 12


_held = threading.Event()
_release = threading.Event()


def _blocking_transform(sample):
    """On loader A's thread: holds the seeded-generator lock until the test lets go."""
    _held.set()
    _release.wait(60)
    return sample


def test_a_loader_forking_workers_beside_a_thread_pass_that_holds_the_generator_lock_does_not_hang(cache_dir):
    """Loader B forks its workers while loader A's per-sample transform holds the seeded-generator lock on a
    thread: the workers start with the lock free (reset at fork) and B's pass completes."""
    warm(CachedDataset(Synthetic(32), cache_dir)).close()
    a = CachedDataset.open(cache_dir, transform=_blocking_transform)
    b = CachedDataset.open(cache_dir, transform=random_transform)
    loader_a = a.loader(8, num_workers=0, num_threads=1)
    loader_b = b.loader(8, num_workers=2, multiprocessing_context="fork")
    results: list = []
    thread = threading.Thread(target=lambda: results.extend(loader_a), daemon=True)
    thread.start()
    try:
        assert _held.wait(30)
        assert sum(len(batch[1]) for batch in loader_b) == 32  # hung forever before the reset
    finally:
        _release.set()
        thread.join(60)
    assert sum(len(labels) for _, labels in results) == 32
    a.close()
    b.close()


KILLED_LOADER = """
import functools, os, sys, time
from helpers import hold_child
from lmdbcache import CachedDataset

HOLD = os.environ.get("HOLD_DIR")


def slow(sample):
    time.sleep(0.002)
    return sample


if __name__ == "__mp_main__" and HOLD:  # a spawn worker importing this script: held before its first step
    hold_child(HOLD)
if __name__ == "__main__":
    path, context = sys.argv[1:3]
    if HOLD and context == "fork":
        os.register_at_fork(after_in_child=functools.partial(hold_child, HOLD))
    ds = CachedDataset.open(path, transform=slow)
    with ds.loader(4, num_workers=2, multiprocessing_context=context) as loader:
        while True:
            for _ in loader:
                print("batch", flush=True)
"""


@pytest.mark.parametrize(
    ("context", "moment"), [("fork", "held"), ("spawn", "held"), ("fork", "running"), ("forkserver", "running")]
)
def test_no_worker_outlives_a_sigkilled_loader(cache_dir, tmp_path, context, moment):
    """A Loader's process SIGKILLed with its workers started but not yet at their first step, or while they build
    batches: every process of it ends (issue 38), under fork, spawn and forkserver."""
    warm(CachedDataset(Synthetic(40), cache_dir)).close()
    script, hold, tag = tmp_path / "killed_loader.py", tmp_path / "hold", uuid.uuid4().hex
    script.write_text(KILLED_LOADER)
    hold.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), TAG: tag}
    if moment == "held":
        env["HOLD_DIR"] = str(hold)
    argv = [sys.executable, str(script), str(cache_dir), context]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        if moment == "held":
            assert wait_until(lambda: len(held_children(str(hold))) == 2, 120)
        else:
            for _ in range(3):
                assert proc.stdout is not None and proc.stdout.readline() == "batch\n"
        proc.kill()
        proc.wait(timeout=60)
    (hold / "go").touch()
    assert_none_outlive(tag)


def test_workers_started_from_a_thread_that_ends_serve_the_pass_on(cache_dir):
    """A worker pass started on a thread that then ends goes on in another thread: its workers die with the
    process, not with the thread that started them (PR_SET_PDEATHSIG follows the forking thread), and once the
    pass ends no thread of it is left."""
    ds = transformed(cache_dir)
    with ds.loader(4, shuffle=True, seed=3, num_workers=2) as loader:
        full = list(loader)
    with ds.loader(4, shuffle=True, seed=3, num_workers=2) as loader:
        box = []
        thread = threading.Thread(target=lambda: box.append((it := iter(loader), next(it))))
        thread.start()
        thread.join()
        it, first = box.pop()
        (parent,) = [t for t in threading.enumerate() if t.name == "lmdbcache-workers-parent"]  # forked them
        same([first, *it], full)
    parent.join(timeout=30)  # released at the pass's end, it ends on its own
    assert not parent.is_alive()
