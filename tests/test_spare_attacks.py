"""Attacks on the next epoch's pass built ahead (``loader/_spare.Spare``, issue 26): each test compares a Loader
that had a pass ahead with one that had none (a fresh Loader at the same seed and epoch), or checks what it leaves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_augment import Images, batches, cached
from test_spare import STEPS, fresh, ours, same, settled

from lmdbcache import CachedDataset, Loader
from lmdbcache.errors import CacheMismatchError

pytestmark = pytest.mark.timeout(170)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_cache_rebuilt_between_epochs_is_noticed_at_the_next_epochs_first_batch(tmp_path, read_path):
    """A cache rebuilt after an epoch ends: the next epoch's first batch raises CacheMismatchError, as a Loader
    without a pass ahead does, instead of one batch of the old build read ahead before the rebuild."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    assert len(batches(loader)) == 3
    time.sleep(0.3)  # the pass ahead has built epoch 1's first batch from the build adopted
    CachedDataset(Images(n=24), str(tmp_path / "c"), fingerprint="other", overwrite=True).close()
    control = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    control.set_epoch(1)
    with pytest.raises(CacheMismatchError, match="rebuilt"):
        next(iter(control))  # without a pass ahead: the first read after the rebuild
    control.close()
    got = []
    with pytest.raises(CacheMismatchError, match="rebuilt"):
        for batch in loader:
            got.append(batch)
    assert got == []  # the pass ahead served a batch of the replaced build first
    loader.close()


def test_the_next_epoch_after_set_epoch_state_dict_or_option_changes_is_a_fresh_loaders(tmp_path, read_path):
    """Between epochs: set_epoch to the same epoch, a state_dict round trip, drop_last or batch_size changed on
    the loader: the next epoch's batches are those of a Loader that never ran ahead."""
    ds = cached(tmp_path / "c", n=28)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    batches(loader)
    loader.set_epoch(1)
    assert same(batches(loader), fresh(ds, 1))
    loader.load_state_dict(loader.state_dict())
    assert same(batches(loader), fresh(ds, 2))
    loader.drop_last = True
    assert same(batches(loader), fresh(ds, 3, drop_last=True))
    loader.batch_size = 4
    assert same(batches(loader), _fresh4(ds, 4))
    loader.close()


def _fresh4(ds, epoch):
    other = Loader(ds, 4, augment=STEPS, shuffle=True, seed=3, drop_last=True)
    other.set_epoch(epoch)
    out = batches(other)
    other.close()
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ddp_split_gets_its_ranks_next_epoch(tmp_path, read_path, rank):
    """A rank's epochs after the first are that rank's, as without a pass ahead."""
    ds = cached(tmp_path / "c", n=30)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS, rank=rank, world_size=2)
    for epoch in range(3):
        assert same(batches(loader), fresh(ds, epoch, rank=rank, world_size=2))
    loader.close()


def test_kept_batches_never_change_while_the_pass_ahead_fills_the_ring(tmp_path, read_path):
    """Every batch of an epoch kept (not cloned) is unchanged after the pass ahead built the next epoch's first
    batch and the next epochs ran."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS, prefetch=1)
    kept = list(loader)
    copies = [[t.clone() for t in b] for b in kept]
    time.sleep(0.2)
    for _ in range(2):
        for batch in loader:
            del batch
    assert same([list(b) for b in kept], copies)
    loader.close()


def test_no_thread_or_descriptor_is_left_after_epochs_and_close(tmp_path, read_path):
    """Ten epochs leave one pass ahead at most (its planner and copy threads), close() none, and no descriptor."""
    ds = cached(tmp_path / "c", n=24)
    before = ours()
    fds = len(os.listdir("/proc/self/fd"))
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS, num_threads=2)
    for _ in range(10):
        batches(loader)
    alive = settled(before, 1.0)
    assert sum(t.name.startswith("lmdbcache-planner") for t in alive) <= 1
    assert len(alive) <= 3
    loader.close()
    assert settled(before) == set()
    assert len(os.listdir("/proc/self/fd")) <= fds


SCRIPT = """
import sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from test_augment import cached
from lmdbcache import Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop
ds = cached({path!r}, n=40)
loader = Loader(ds, 8, shuffle=True, seed=3, augment=[RandomResizedCrop(16), RandomHorizontalFlip()])
for epoch in range({epochs}):
    for batch in loader:
        pass
"""


def _env(read_path: str) -> dict[str, str]:
    """The child's environment: this worktree's code, on the path ``read_path`` names."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("LMDBCACHE_PURE_PYTHON", None)
    return {**env, "LMDBCACHE_PURE_PYTHON": "1"} if read_path == "python" else env


def _script(tmp_path, name: str, epochs: int) -> list[str]:
    code = SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), path=str(tmp_path / name), epochs=epochs)
    return [sys.executable, "-X", "faulthandler", "-c", code]


def test_a_script_that_just_ends_with_a_pass_ahead_exits_cleanly(tmp_path, read_path):
    """A script that iterates 1 to 3 epochs and ends, a pass ahead running: rc 0, nothing on stderr, no hang
    (6 runs; 30 under `make stress`)."""
    env = _env(read_path)
    for run in range(30 if os.environ.get("LMDBCACHE_STRESS") == "1" else 6):
        proc = subprocess.run(
            _script(tmp_path, f"c{run % 3}", 1 + run % 3), env=env, capture_output=True, text=True, timeout=60
        )
        assert (proc.returncode, proc.stderr) == (0, ""), f"run {run}"


SIGINT_SCRIPT = """
import os, signal, sys, threading, time
sys.path[:0] = [{root!r}, {tests!r}]
from test_augment import cached
from lmdbcache import Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop
ds = cached({path!r}, n=40)
loader = Loader(ds, 8, shuffle=True, seed=3, augment=[RandomResizedCrop(16), RandomHorizontalFlip()])
def ours():
    return [t.name for t in threading.enumerate() if t.name.startswith(("lmdbcache-planner", "lmdbcache-copy"))]
try:
    for k, batch in enumerate(loader):
        if k == len(loader) - 1:
            time.sleep(0.2)  # the pass ahead builds
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
except KeyboardInterrupt:
    pass
deadline = time.monotonic() + 5
while ours() and time.monotonic() < deadline:
    time.sleep(0.01)
print(ours())
print(loader._spare.run is None)
"""


def test_ctrl_c_at_the_last_batch_stops_the_pass_ahead(tmp_path, read_path):
    """A real SIGINT while the consumer holds an epoch's last batch: KeyboardInterrupt, no thread left."""
    code = SIGINT_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), path=str(tmp_path / "c"))
    env = _env(read_path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "[]\nTrue\n", "")


def _error_of(loader) -> tuple[str, str, list[str]]:
    with pytest.raises(Exception) as info:  # whatever it is, both loaders must raise the same
        for _ in loader:
            pass
    return type(info.value).__name__, str(info.value), list(getattr(info.value, "__notes__", []))


def test_a_damaged_sample_in_the_next_epochs_first_batch_raises_as_without_a_pass_ahead(tmp_path, read_path):
    """A damaged value first met by the pass ahead (rank 0 of 2: not in its epoch 0): the next epoch raises the
    error a Loader without a pass ahead raises there, at its first batch, every time it is iterated."""
    from test_loader import damage

    kw = {"shuffle": True, "seed": 3, "augment": STEPS, "rank": 0, "world_size": 2}
    ds = cached(tmp_path / "c", n=24)
    probe = Loader(ds, 8, **kw)
    seen = {i for b in probe.batches(0) for i in b}
    k = next(i for i in probe.batches(1)[0] if i not in seen)
    probe.close()
    ds.close()
    damage(tmp_path / "c", k, 10)
    ds = CachedDataset.open(str(tmp_path / "c"))
    loader = Loader(ds, 8, **kw)
    assert len(batches(loader)) == 2
    time.sleep(0.2)  # the pass ahead met the damaged value
    control = Loader(ds, 8, **kw)
    control.set_epoch(1)
    want = _error_of(control)
    assert want[0] == "CorruptSampleError", want
    assert _error_of(loader) == want
    assert _error_of(loader) == _error_of(control)  # the next try raises it again, like the control's
    loader.close()
    control.close()


def test_ctrl_c_while_the_pass_ahead_is_being_started_leaves_no_thread(tmp_path, read_path, monkeypatch):
    """A real SIGINT landing between the pass ahead's creation and its registration (Spare.start, at the
    epoch's last batch): KeyboardInterrupt, and no planner or copy thread left behind, not even after close()."""
    from lmdbcache.loader import _spare

    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    before = ours()
    created: list = []
    swap = _spare.Spare._swap

    def interrupted(self, run, *args, **kw):
        if run is not None and not created:  # Spare.start: the pass ahead exists, its threads run
            created.append(run)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here, in the consumer's thread
        return swap(self, run, *args, **kw)

    monkeypatch.setattr(_spare.Spare, "_swap", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
        assert created
        loader.close()
        assert settled(before) == set()  # on spare: the pass ahead's planner (held for ever) and copy threads
    finally:
        for run in created:
            run.stop()
        loader.close()


def test_ctrl_c_right_after_the_pass_ahead_started_stops_it(tmp_path, read_path, monkeypatch):
    """A real SIGINT landing just after Spare.start returned (before _run holds the pass it started): the
    KeyboardInterrupt at the last batch still stops the pass ahead, as a break or an exception there does."""
    from lmdbcache.loader import _spare

    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    before = ours()
    start = _spare.Spare.start

    def interrupted(self, *args, **kw):
        run = start(self, *args, **kw)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises KeyboardInterrupt here, in the consumer's thread
        return run

    monkeypatch.setattr(_spare.Spare, "start", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
        assert settled(before) == set()  # on spare: the pass ahead lives on until close()
        assert loader._spare.run is None
    finally:
        loader.close()
