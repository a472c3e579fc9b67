"""The next epoch's pass built ahead (``loader/_spare.Spare``): taken only when it fits, never a leaked thread.

Each test guards one of the five bugs an attack found in its first version (issue 26).
"""

from __future__ import annotations

import gc
import multiprocessing
import sys
import threading
import time

import pytest
import torch
from test_augment import batches, cached

from lmdbcache import InvalidOptionError, Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop
from lmdbcache.loader import _pass

pytestmark = pytest.mark.timeout(120)
STEPS = [RandomResizedCrop(16), RandomHorizontalFlip()]


def ours() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("lmdbcache-planner", "lmdbcache-copy"))}


def settled(before: set[threading.Thread], seconds: float = 5.0) -> set[threading.Thread]:
    """The loader threads alive now that were not before, after up to ``seconds`` for them to end."""
    deadline = time.monotonic() + seconds
    while ours() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return ours() - before


def fresh(ds, epoch: int, **kw) -> list:
    other = Loader(ds, 8, augment=STEPS, **{"shuffle": True, "seed": 3, **kw})
    other.set_epoch(epoch)
    out = batches(other)
    other.close()
    return out


def same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(torch.equal(x, y) for a, b in zip(got, want) for x, y in zip(a, b))


def test_a_pass_ahead_of_another_seed_is_not_taken(tmp_path, read_path):
    """After the loader's seed changes (shuffle=False: the same batches of indices), the next epoch's batches are
    the new seed's: the pass built ahead with the old seed is not taken (load_state_dict refuses another seed)."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=False, seed=3, augment=STEPS)
    assert same(batches(loader), fresh(ds, 0, shuffle=False))
    state = loader.state_dict()
    assert state["epoch"] == 1 and loader._spare.run is not None  # epoch 1's pass, seed 3, built ahead
    with pytest.raises(InvalidOptionError, match="saved with seed=4, but this loader has seed=3"):
        loader.load_state_dict({**state, "seed": 4})
    loader.seed = 4
    want = fresh(ds, 1, shuffle=False, seed=4)
    assert not same(want, fresh(ds, 1, shuffle=False))  # the seeds' crops differ: the test can tell them apart
    assert same(batches(loader), want)
    loader.close()


@pytest.mark.parametrize("where", ["mid-epoch", "the next epoch's start"])
def test_load_state_dict_stops_a_pass_ahead_it_makes_useless(tmp_path, read_path, where):
    """load_state_dict to another position stops the pass ahead at once (its threads do not linger until
    the next iter or close()); a state at the next epoch's start with the same seed keeps it, and it is taken."""
    ds = cached(tmp_path / "c", n=24)
    before = ours()
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    assert len(batches(loader)) == 3
    state = loader.state_dict()
    assert state["epoch"] == 1 and loader._spare.run is not None
    change = {"mid-epoch": {"batches": 1}, "the next epoch's start": {}}[where]
    loader.load_state_dict({**state, **change})
    if where == "the next epoch's start":
        ahead, taken = loader._spare.run, []
        assert ahead is not None
        take = loader._spare.take
        loader._spare.take = lambda *args: taken.append(take(*args)) or taken[-1]  # type: ignore[method-assign]
        got = batches(loader)
        assert taken == [ahead] and loader._pass is None and same(got, fresh(ds, 1))
    else:
        assert loader._spare.run is None and not settled(before)
        want = fresh(ds, 1)[change["batches"] :]
        assert same(batches(loader), want)
    loader.close()
    assert not settled(before)


@pytest.mark.parametrize("when", ["before", "during"])
def test_close_from_another_thread_racing_the_last_batch_leaves_no_thread(tmp_path, read_path, monkeypatch, when):
    """close() from another thread between the last batch's arrival and the start of the pass ahead, or while
    that pass is being started: no pass ahead is kept after it, no thread is left."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    real, begin = loader._batches, _pass.Pass._begin

    def close_now() -> None:
        closer = threading.Thread(target=loader.close)
        closer.start()
        closer.join()

    def racing(epoch: int) -> tuple:
        if when == "before" and sys._getframe(1).f_code.co_name == "_run":  # the pass ahead's order
            close_now()
        return real(epoch)

    def racing_begin(self) -> None:
        begin(self)
        if when == "during" and not self.go.is_set():  # the pass ahead's threads run, Spare.start not done
            close_now()

    before = ours()
    loader._batches = racing  # type: ignore[method-assign]
    monkeypatch.setattr(_pass.Pass, "_begin", racing_begin)
    assert len(batches(loader)) == 3
    assert not settled(before)
    assert loader._spare.run is None


def test_two_threads_iterating_one_loader_leave_one_pass_ahead(tmp_path, read_path, monkeypatch):
    """Two threads reaching an epoch's last batch of one Loader at once start one pass ahead each: the one
    replaced is stopped, and close() leaves no thread."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    real, meet = loader._batches, threading.Barrier(2, timeout=30)
    begin = _pass.Pass._begin

    def slow_begin(self) -> None:
        if not self.go.is_set():  # a pass ahead: both threads are inside Spare.start together
            time.sleep(0.2)
        begin(self)

    monkeypatch.setattr(_pass.Pass, "_begin", slow_begin)
    errors: list[BaseException] = []

    def second() -> None:
        try:
            assert len(batches(loader)) == 3  # epoch 1, through the same loader
        except BaseException as exc:
            errors.append(exc)

    helper = threading.Thread(target=second)

    def meeting(epoch: int) -> tuple:
        if sys._getframe(1).f_code.co_name == "_run":  # each thread, about to start its pass ahead
            if not helper.is_alive() and epoch == 1:
                helper.start()
            meet.wait()
        return real(epoch)

    before = ours()
    loader._batches = meeting  # type: ignore[method-assign]
    assert len(batches(loader)) == 3
    helper.join(60)
    assert not errors
    assert sum(t.name == "lmdbcache-planner" for t in settled(before, 1.0)) == 1  # one pass ahead, not two
    loader.close()
    assert not settled(before)


def _child(loader: Loader, want: list, out: multiprocessing.Queue) -> None:
    out.put(same(batches(loader), want))


def test_a_forked_child_drops_the_inherited_pass_ahead(tmp_path, read_path):
    """A child forked while the next epoch's pass runs ahead builds that epoch afresh (the parent's threads do
    not exist there) and gets its batches; the parent still takes its own pass ahead."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    want = fresh(ds, 1)
    assert len(batches(loader)) == 3
    time.sleep(0.2)  # the pass ahead has built epoch 1's first batch
    inherited = loader._spare.run
    assert inherited is not None
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_child, args=(loader, want, out))
    child.start()
    try:
        assert out.get(timeout=60) is True
    finally:
        child.join(60)
    assert child.exitcode == 0
    assert loader._spare.run is inherited  # the parent's pass ahead was not touched by the child
    assert same(batches(loader), want)
    loader.close()


@pytest.mark.parametrize("how", ["break", "exception", "collected"])
def test_a_break_an_exception_or_collection_at_the_last_batch_stops_the_pass_ahead(tmp_path, read_path, how):
    """The pass ahead starts with an epoch's last batch but lives on only if the epoch ends normally: a break,
    an exception at the last batch, or the iterator's collection stop it and join its threads."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    before = ours()
    if how == "collected":
        it = iter(loader)
        for _ in range(3):
            next(it)
        assert any(t.name == "lmdbcache-planner" for t in ours() - before)  # started with the last batch
        del it
    else:
        with pytest.raises(ValueError) if how == "exception" else _nothing():
            for k, _batch in enumerate(loader):
                if k == 2 and how == "break":
                    break
                if k == 2:
                    raise ValueError("at the last batch")
    assert not settled(before)
    assert loader._spare.run is None
    batches(loader)  # a complete epoch then leaves one, which close() stops
    assert settled(before, 0.0)
    loader.close()
    assert not settled(before)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_the_loaders_collection_in_its_pass_aheads_own_thread_stops_it(tmp_path, read_path, monkeypatch):
    """A Loader in a reference cycle collected by a garbage collection that runs on its pass ahead's own planner
    thread (any allocation can start one, in any thread) stops that pass without joining the thread it runs on:
    no error, no thread left."""
    ds = cached(tmp_path / "c", n=24)
    calls, dropped, raised = [0], threading.Event(), []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: raised.append(info.exc_value))

    def collect_on_the_spares_batch(batch):
        calls[0] += 1
        if calls[0] == 4:  # the 4th batch built: epoch 1's first, on the pass ahead's planner thread
            assert dropped.wait(30)
            gc.collect()
        return batch

    before = ours()
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS, batch_transform=collect_on_the_spares_batch)
    loader.cycle = loader  # type: ignore[attr-defined]  # only the cyclic collector frees it
    assert len(batches(loader)) == 3
    del loader
    dropped.set()
    assert not settled(before)
    assert calls[0] == 4 and not raised


def test_iter_takes_the_pass_aheads_batches_instead_of_building_the_order_again(tmp_path, read_path):
    """The next iter reuses the list of batches the pass ahead was made of (an ImageNet order takes about 0.15 s
    to build and 0.05 s to compare): the order is built once per epoch, and the batches are still that epoch's."""
    ds = cached(tmp_path / "c", n=24)
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=STEPS)
    assert len(batches(loader)) == 3
    real, calls = loader._sequence, []

    def counted(epoch: int) -> list[list[int]]:
        calls.append(epoch)
        return real(epoch)

    loader._sequence = counted  # type: ignore[method-assign]
    assert same(batches(loader), fresh(ds, 1))
    assert calls == [2]  # epoch 2's, for its pass ahead; epoch 1's came with its pass ahead
    loader.set_epoch(1)  # stops epoch 2's pass ahead: epoch 1 is built afresh, its order too
    assert same(batches(loader), fresh(ds, 1))
    assert calls == [2, 1, 2]
    loader.close()
