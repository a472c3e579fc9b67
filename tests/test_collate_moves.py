"""Batches moved under their views, and descriptors over many epochs: found by attacking collate's segments."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from helpers import Synthetic
from test_loader import warm
from torch.utils.data import DataLoader

from lmdbcache import CachedDataset
from lmdbcache.loader import _shm
from lmdbcache.loader._collate import collate

pytestmark = pytest.mark.timeout(180)


def memfd_descriptors() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:lmdbcache" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


@pytest.mark.parametrize("workers", [1, 0])
@pytest.mark.parametrize("move", ["share_memory_", "queue"])
@pytest.mark.parametrize("part", ["field", "view"])
def test_a_numpy_array_taken_before_share_memory_never_changes_once_its_batch_is_gone(cache_dir, workers, move, part):
    """share_memory_() (a torch Queue calls it) moves the field's storage away; a numpy array taken before still
    points into the segment or slot, and its .base is a new alias tensor (torch 2.13: ``t.numpy().base is not
    t``), held by nothing the lease or ``_hold`` counts. The move is seen when the storage lets go of its array
    while the field lives, and that memory is never filled again (nor freed)."""
    ds = warm(CachedDataset(Synthetic(128), cache_dir))
    loader = DataLoader(ds, 8, num_workers=workers, collate_fn=collate, persistent_workers=workers > 0)
    kept = []
    for batch in loader:
        array = batch[0].numpy() if part == "field" else batch[0][1:].numpy()
        if move == "share_memory_":
            batch[0].share_memory_()
        else:
            queue = torch.multiprocessing.get_context("fork").SimpleQueue()
            queue.put(batch[0])
            queue.get()
        kept.append((array.copy(), array))
        del batch
        gc.collect()
    changed = [k for k, (snapshot, array) in enumerate(kept) if not np.array_equal(snapshot, array)]
    assert changed == []


def test_the_main_process_adopting_a_kept_segment_leaks_no_descriptor(cache_dir):
    """A num_workers=0 loader after one with workers: the main process adopts kept segments (_adopt) and closes
    the kept descriptor of each (a leaked one would keep its segment's memory too)."""
    ds = warm(CachedDataset(Synthetic(100), cache_dir))
    train = DataLoader(ds, 8, num_workers=2, collate_fn=collate)
    val = DataLoader(ds, 8, num_workers=0, collate_fn=collate)
    counts = []
    for _ in range(12):
        for _batch in train:
            pass
        for _batch in val:
            pass
        gc.collect()
        counts.append(memfd_descriptors())
    assert len(_shm._kept) <= 16
    assert counts[-1] <= counts[3] + 2, counts  # was 2 more every epoch
