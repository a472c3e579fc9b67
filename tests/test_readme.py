"""The recipes in README.md and docs/ run as written.

Every ```python block of README.md runs unmodified, as a script of its own, in a fresh Python
process whose working directory is a temporary folder (PYTHONPATH: the repository), as a user
who pastes it into a file runs it. The README's blocks form one story: a later block reads what
an earlier one left behind (the second quick start block opens the cache the first one filled),
so each block runs after the blocks before it, in the same folder, as its setup.

In docs/, the one ```python block is the torchvision recipe of docs/usage.md. It needs a
torchvision ``ImageFolder`` of photos, which the tests do not have: it runs as written with
``train`` supplied (a synthetic dataset of the same (uint8 image, label) samples). Every other
block in docs/ is ```sh or output, illustrative; ``test_docs_hold_no_other_python_block`` keeps
it so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Synthetic

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
BLOCK_TIMEOUT = 120  # seconds; each block is meant to take a few


def python_blocks(page: Path) -> list[str]:
    """Every ```python block of a Markdown page, in order, as written."""
    return PYTHON_BLOCK.findall(page.read_text())


README_BLOCKS = python_blocks(README)


def run_block(source: str, cwd: Path, name: str) -> subprocess.CompletedProcess[str]:
    """Run one block as a user's script (``python name.py`` in ``cwd``); it must end cleanly and quietly."""
    script = cwd / f"{name}.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, script.name], cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stderr}"
    assert done.stderr == "", f"{name} wrote to stderr (a warning a user would see):\n{done.stderr}"
    return done


def test_the_readme_has_the_quick_start_blocks():
    """The blocks below are found: the DataLoader recipe and the loader, so the test cannot pass on nothing."""
    assert len(README_BLOCKS) >= 2
    assert "DataLoader(" in README_BLOCKS[0] and "CachedDataset(" in README_BLOCKS[0]
    assert any("Loader(" in block or ".loader(" in block for block in README_BLOCKS[1:])


@pytest.mark.parametrize("n", range(len(README_BLOCKS)), ids=[f"block{n + 1}" for n in range(len(README_BLOCKS))])
def test_each_readme_python_block_runs_as_written(n, tmp_path):
    """README block n runs unmodified in a fresh process (after the blocks before it, in the same folder)."""
    for before in range(n):
        run_block(README_BLOCKS[before], tmp_path, f"block{before + 1}")
    run_block(README_BLOCKS[n], tmp_path, f"block{n + 1}")


def test_the_quick_start_leaves_a_complete_cache_and_the_loader_reads_it(tmp_path):
    """The quick start's claims: the script that just ends leaves every sample cached; the loader reads all."""
    run_block(README_BLOCKS[0], tmp_path, "quickstart")
    from lmdbcache import CachedDataset

    with CachedDataset.open(tmp_path / "train.lmdb") as cached:
        assert cached.is_complete and len(cached) == 512
    done = run_block(README_BLOCKS[1], tmp_path, "fast")
    assert "512 samples, complete: True, trained on 1024 from epoch 0" in done.stdout
    state = torch.load(tmp_path / "checkpoint.pt")
    assert state["epoch"] == 1 and state["loader"]["epoch"] == 1 and state["loader"]["batches"] == 8


def test_the_readme_loop_run_again_resumes_after_the_last_batch_it_saved(tmp_path):
    """The README's loader block, rerun as written: from a checkpoint at the end of its last epoch it trains on
    nothing; from one saved 3 batches into epoch 1 (a crashed run's) on exactly the 5 batches after it, then,
    rerun, on the one batch after its own last save (set_epoch keeps the loaded position: issue 38)."""
    run_block(README_BLOCKS[0], tmp_path, "quickstart")
    assert "trained on 1024 from epoch 0" in run_block(README_BLOCKS[1], tmp_path, "fast").stdout
    assert "trained on 0 from epoch 1" in run_block(README_BLOCKS[1], tmp_path, "fast").stdout
    from lmdbcache import CachedDataset, Loader

    with CachedDataset.open(tmp_path / "train.lmdb") as cached:
        crashed = Loader(cached, 64, shuffle=True, seed=0, num_threads=2)
        crashed.set_epoch(1)
        for step, _ in enumerate(crashed):
            if step == 2:
                break
        torch.save({"epoch": 1, "loader": crashed.state_dict()}, tmp_path / "checkpoint.pt")
        crashed.close()
    assert "trained on 320 from epoch 1" in run_block(README_BLOCKS[1], tmp_path, "fast").stdout
    assert torch.load(tmp_path / "checkpoint.pt")["loader"]["batches"] == 7  # its step 3: batch 7 of 8
    assert "trained on 64 from epoch 1" in run_block(README_BLOCKS[1], tmp_path, "fast").stdout


def block_after(page: Path, heading: str) -> str:
    """The first ```python block after the paragraph that starts with ``heading``."""
    text = page.read_text()
    match = PYTHON_BLOCK.search(text, text.index(heading))
    assert match is not None, f"no python block after {heading!r}"
    return match.group(1)


def test_docs_hold_no_other_python_block():
    """docs/ has exactly the python blocks this module runs: a new one must get a test (or be marked ```text)."""
    blocks = {page.name: python_blocks(page) for page in sorted((ROOT / "docs").glob("*.md"))}
    assert {name: len(found) for name, found in blocks.items() if found} == {"usage.md": 1}
    assert blocks["usage.md"][0] == block_after(USAGE, "**torchvision datasets.**")


def test_the_torchvision_recipe_runs_as_written(tmp_path, monkeypatch):
    """The torchvision recipe (docs/usage.md), as written, gives random-flipped batches of the cached samples."""
    monkeypatch.chdir(tmp_path)
    train = Synthetic(64)  # stands for the recipe's ImageFolder: (uint8 image tensor, label)
    names = {"train": train, "__name__": "usage"}
    exec(compile(block_after(USAGE, "**torchvision datasets.**"), str(USAGE), "exec"), names)
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
    """docs/usage.md's claim: a rank started by torch.multiprocessing.spawn starts its children with spawn, on
    Linux too (so a DataLoader's or ds.loader's workers there must pickle the transform)."""
    import torch.multiprocessing as mp

    out = tmp_path / "method"
    mp.spawn(report_start_method, args=(str(out),), nprocs=1)
    assert out.read_text() == "spawn"
