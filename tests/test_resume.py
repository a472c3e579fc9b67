"""Loader resume (issue 38): the README's loop with a checkpoint keeps the loaded position, in one process and in
two ranks run as torchrun runs them; a state that means other samples here is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import Synthetic
from test_augment import cached as augmented_cache

from lmdbcache import CachedDataset, InvalidOptionError, Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


def warm(path: Path, n: int = 50) -> CachedDataset:
    """A complete cache of ``Synthetic(n)`` (labels are indices)."""
    ds = CachedDataset(Synthetic(n), str(path))
    ds.__getitems__(list(range(n)))
    ds.flush()
    return ds


def labels(loader: Loader, stop: int | None = None) -> list[list[int]]:
    """The indices of each batch of one pass (the first ``stop`` only, then a break)."""
    out = []
    for batch in loader:
        out.append(batch[1].tolist())
        if len(out) == stop:
            break
    return out


def epochs_of(loader: Loader, start: int, end: int) -> list[list[int]]:
    """The README's loop: ``for epoch in range(start, end): loader.set_epoch(epoch)``, every batch's indices."""
    got = []
    for epoch in range(start, end):
        loader.set_epoch(epoch)
        got += labels(loader)
    return got


def make(kind: str, path: Path) -> tuple[CachedDataset, dict]:
    """A dataset and Loader options: the thread path, or an augment= loader (its pass ahead at an epoch's end)."""
    if kind == "augment":
        return augmented_cache(path, n=40), {"augment": [RandomResizedCrop(8), RandomHorizontalFlip()]}
    return warm(path), {}


@pytest.mark.parametrize("kind", ["threads", "augment"])
@pytest.mark.parametrize("where", ["mid-epoch", "end-of-epoch"])
def test_set_epoch_after_load_state_dict_keeps_the_loaded_position(tmp_path, kind, where):
    """The README's resume loop (load_state_dict, then set_epoch(e) for e from the saved epoch) gives exactly the
    batches after the saved one: none repeated, whether the state was mid-epoch or at the epoch's last batch."""
    ds, options = make(kind, tmp_path / "c")
    whole = Loader(ds, 6, shuffle=True, seed=4, **options)
    full, per_epoch = epochs_of(whole, 0, 3), len(whole)
    whole.close()
    stop = 3 if where == "mid-epoch" else per_epoch
    first = Loader(ds, 6, shuffle=True, seed=4, **options)
    head = epochs_of(first, 0, 1)
    first.set_epoch(1)
    head += labels(first, stop)  # the checkpoint inside the loop: {"epoch": 1, "loader": state}
    state = first.state_dict()
    first.close()
    resumed = Loader(ds, 6, shuffle=True, seed=4, **options)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    resumed.set_epoch(1)  # twice before a pass: still the loaded position
    assert resumed.state_dict()["batches"] == stop
    rest = epochs_of(resumed, 1, 3)
    assert len(rest) == 2 * per_epoch - stop and head + rest == full
    resumed.close()


def test_set_epoch_keeps_a_loaded_position_only_until_a_pass_or_another_epoch(tmp_path):
    """set_epoch of the loaded epoch keeps the position only before any pass and any set_epoch to another epoch;
    afterwards it means the epoch's start again."""
    ds = warm(tmp_path / "c")
    loader = Loader(ds, 6, shuffle=True, seed=4)
    loader.set_epoch(2)
    state = {**loader.state_dict(), "batches": 3, "samples": 18}
    loader.load_state_dict(state)
    loader.set_epoch(1)
    loader.set_epoch(2)
    assert loader.state_dict()["batches"] == 0
    loader.load_state_dict(state)
    loader.set_epoch(2)
    assert len(labels(loader, 1)) == 1 and loader.state_dict()["batches"] == 4
    loader.set_epoch(2)
    assert loader.state_dict()["batches"] == 0
    loader.close()


def test_a_state_for_another_dataset_length_or_past_its_epoch_is_refused(tmp_path):
    """A state saved for a dataset of another length, at a batch past the end of its epoch here, or with more
    samples than an epoch holds (another batch size) is an InvalidOptionError naming both and the fix; the
    position is unchanged."""
    big, small = warm(tmp_path / "a", 50), warm(tmp_path / "b", 40)
    saved = Loader(big, 5, shuffle=True, seed=1)
    labels(saved, 3)
    state = saved.state_dict()
    saved.close()
    loader = Loader(small, 5, shuffle=True, seed=1)
    cases = [
        (state, r"saved for a dataset of 50 samples, but this loader's dataset has 40: .*set_epoch\(1\)"),
        ({**state, "dataset_length": 40, "batches": 9}, r"at batch 9 of epoch 0, past the end .* has 8 batches"),
        ({**state, "dataset_length": 40, "batch_size": 10, "batches": 5, "samples": 50}, r"after 50 samples, past "),
    ]
    for bad, words in cases:
        with pytest.raises(InvalidOptionError, match=words):
            loader.load_state_dict(bad)
        assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["batches"] == 0
    loader.load_state_dict({**state, "dataset_length": 40, "batches": 8})  # the end of the epoch: accepted
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batches"] == 0
    loader.close()


RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys

    import torch

    from lmdbcache import CachedDataset, Loader

    path, checkpoint, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cached = CachedDataset.open(path)
    loader = Loader(cached, 4, shuffle=True, seed=5, num_threads=2)  # rank and world size: torchrun's env
    start, seen = 0, []
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        loader.load_state_dict(state["loader"])
        start = state["epoch"]
    for epoch in range(start, 3):
        loader.set_epoch(epoch)
        for images, labels in loader:
            seen.append(labels.tolist())
            torch.save({"epoch": epoch, "loader": loader.state_dict()}, checkpoint)
            if len(seen) == crash_at:  # killed right after the checkpoint
                print(json.dumps(seen), flush=True)
                os._exit(9)
    print(json.dumps(seen), flush=True)
    """
)


def run_ranks(tmp_path: Path, crash_at: int) -> list[list[list[int]]]:
    """Both ranks of a 2-process run of RANK_SCRIPT at once (torchrun's RANK / WORLD_SIZE env): their batches."""
    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        args = [sys.executable, str(script), str(tmp_path / "c"), str(tmp_path / f"checkpoint{rank}.pt"), str(crash_at)]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=100)
        assert proc.returncode == (9 if crash_at else 0), stderr
        assert "Warning" not in stderr, stderr
        out.append(json.loads(stdout))
    return out


@pytest.mark.parametrize("crash_at", [7, 8], ids=["mid-epoch", "end-of-epoch"])
def test_two_ranks_killed_after_a_checkpoint_resume_without_repeating_a_batch(tmp_path, crash_at):
    """Two ranks (torchrun's env) run the README loop with a checkpoint per batch and die after batch 3 (or the
    last, 4) of epoch 1; rerun, each gives exactly its DistributedSampler batches after its checkpoint."""
    warm(tmp_path / "c", 30).close()  # 15 samples a rank: 4 batches of 4 an epoch
    first = run_ranks(tmp_path, crash_at)
    second = run_ranks(tmp_path, 0)
    with CachedDataset.open(tmp_path / "c") as ds:
        for rank in range(2):
            loader = Loader(ds, 4, shuffle=True, seed=5, rank=rank, world_size=2)
            want = [batch for epoch in range(3) for batch in loader.batches(epoch)]
            assert len(first[rank]) == crash_at and first[rank] + second[rank] == want, f"rank {rank}"
