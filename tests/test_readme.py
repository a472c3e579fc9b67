"""README.md: its recipes run as written (each test names the block it runs and supplies only its inputs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import Synthetic

pytestmark = pytest.mark.timeout(120)

README = Path(__file__).resolve().parent.parent / "README.md"


def block_after(heading: str) -> str:
    """The first ```python block after the paragraph that starts with ``heading``."""
    text = README.read_text()
    start = text.index(heading)
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no python block after {heading!r}"
    return match.group(1)


def test_the_torchvision_recipe_runs_as_written(tmp_path, monkeypatch):
    """The torchvision recipe, as written, gives random-flipped batches of the cached (image, label) samples."""
    monkeypatch.chdir(tmp_path)
    train = Synthetic(64)  # stands for the recipe's ImageFolder: (uint8 image tensor, label)
    names = {"train": train, "__name__": "readme"}
    exec(compile(block_after("**torchvision datasets.**"), str(README), "exec"), names)
    images, labels = names["images"], names["labels"]
    assert images.shape == (32, *train[0][0].shape) and images.dtype == torch.uint8 and labels.shape == (32,)
    flipped = 0
    for image, label in zip(images, labels):
        stored = train[int(label)][0]
        assert not torch.equal(stored, stored.flip(-1))
        flipped += torch.equal(image, stored.flip(-1))
        assert torch.equal(image, stored) or torch.equal(image, stored.flip(-1))
    assert 0 < flipped < 32  # the transform ran on the image, after the cache (odds of failing: 2**-31)
    assert (tmp_path / "train.lmdb").is_dir()
    names["cached"].close()


def report_start_method(rank: int, path: str) -> None:
    """In a rank started by mp.spawn: the start method its own children (DataLoader workers) would use."""
    import multiprocessing

    Path(path).write_text(multiprocessing.get_start_method())


def test_ranks_started_by_mp_spawn_start_their_workers_with_spawn(tmp_path):
    """The README's claim: a rank started by torch.multiprocessing.spawn starts its children with spawn, on Linux
    too (so a DataLoader's or ds.loader's workers there must pickle the transform)."""
    import torch.multiprocessing as mp

    out = tmp_path / "method"
    mp.spawn(report_start_method, args=(str(out),), nprocs=1)
    assert out.read_text() == "spawn"
