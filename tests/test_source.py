"""Loader over torch Subset / ConcatDataset wrappers of caches (lmdbcache/loader/_source.py): indices mapped onto the
caches, batches still copied out of their maps, and what cannot work refused with the fix."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import Synthetic, sample_for
from test_augment import expected, image_for
from test_loader import reference, same, warm
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

import lmdbcache.loader._pass as pass_module
from lmdbcache import CachedDataset, InvalidOptionError, Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop
from lmdbcache.loader import _fused
from lmdbcache.loader import augment as aug
from lmdbcache.loader._source import Mapped, part_seed

pytestmark = pytest.mark.timeout(120)


class Shifted(Dataset):
    """``(uint8 tensor, base + i)``: the sample of index ``base + i`` of ``Synthetic``, as another cache holds it."""

    def __init__(self, n: int, base: int, images: bool = False) -> None:
        self.n, self.base, self.images = n, base, images

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        j = self.base + i
        return (image_for(j), j) if self.images else sample_for(j)


def caches(tmp_path, images: bool = False):
    """Two warm caches: ``a`` holds samples 0..49, ``b`` samples 1000..1029."""
    a = warm(CachedDataset(Shifted(50, 0, images), str(tmp_path / "a")))
    b = warm(CachedDataset(Shifted(30, 1000, images), str(tmp_path / "b")))
    return a, b


WRAPPERS = {
    "Subset": lambda a, b: Subset(a, [5, 3, 49, -1, 0, 7, 8, 9, 10, 11, 12, 40, 41]),
    "Subset of a Subset": lambda a, b: Subset(Subset(a, list(range(10, 50))), [0, 39, 5, 6, 7, 8, 20, 21, 22]),
    "ConcatDataset of two caches": lambda a, b: ConcatDataset([a, b]),
    "Subset of a ConcatDataset of Subsets": lambda a, b: Subset(
        ConcatDataset([Subset(b, [1, 2, 3]), a, Subset(b, range(10, 30))]), list(range(0, 73, 2))
    ),
    "Subset with a tensor of indices": lambda a, b: Subset(a, torch.arange(49, 0, -3)),
    "ConcatDataset beside an empty Subset": lambda a, b: ConcatDataset([Subset(a, []), b, Subset(b, [])]),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("shuffle", [False, True])
def test_wrapped_caches_give_dataloaders_batches_from_their_maps(tmp_path, monkeypatch, read_path, wrapper, shuffle):
    """Loader over a Subset (nested), a ConcatDataset of caches and mixes of both yields DataLoader's batches of the
    wrapper, every batch copied out of the caches' maps (never through __getitems__), on 1 and 2 threads."""
    a, b = caches(tmp_path)
    ds = WRAPPERS[wrapper](a, b)
    want = reference(ds, 8, seed=4, shuffle=shuffle)

    def refuse(ds, indices):
        raise AssertionError("fallback used")

    monkeypatch.setattr(pass_module, "together", refuse)
    monkeypatch.setattr(pass_module, "one_by_one", refuse)
    for threads in (1, 2):
        with Loader(ds, 8, shuffle=shuffle, seed=4, num_threads=threads) as loader:
            same(list(loader), want)


def test_a_wrapped_cache_with_misses_or_a_transform_gives_the_wrappers_samples(tmp_path):
    """Misses under a wrapper are filled into their cache; a cache's per-sample transform runs on its samples: the
    batches are the wrapper's, as DataLoader gives them (the fallback path, through the wrapper itself)."""
    cold = CachedDataset(Synthetic(40), str(tmp_path / "cold"))  # nothing cached yet
    ds = Subset(cold, list(range(39, -1, -2)))
    same(list(Loader(ds, 6)), reference(ds, 6))
    assert cold.cached_count == 20
    flipped = CachedDataset(Synthetic(40), str(tmp_path / "cold"), transform=_flip)
    ds = ConcatDataset([Subset(flipped, [3, 1]), cold])
    same(list(Loader(ds, 7, num_workers=0)), reference(ds, 7))


def _flip(sample):
    image, label = sample
    return image.flip(-1), label


def test_worker_processes_read_a_wrapper_as_the_threads_do(tmp_path):
    """num_workers=2 over a Subset of a cache with a transform gives the thread path's batches (the wrapper is
    what the workers receive: Mapped pickles as it)."""
    warm(CachedDataset(Synthetic(30), str(tmp_path / "a")))
    a = CachedDataset(Synthetic(30), str(tmp_path / "a"), transform=_flip)
    ds = Subset(a, list(range(29, 0, -2)))
    threads = list(Loader(ds, 4, shuffle=True, num_workers=0))
    workers = list(Loader(ds, 4, shuffle=True, num_workers=2, multiprocessing_context="fork"))
    same(workers, threads)
    same(threads, reference(ds, 4, shuffle=True))
    assert type(pickle.loads(pickle.dumps(Mapped(ds)))) is Subset


def test_a_resumed_or_distributed_loader_over_a_wrapper_gives_the_right_batches(tmp_path):
    """state_dict / load_state_dict resume exactly over a ConcatDataset, and two ranks split a Subset as
    DistributedSampler does: every index once."""
    a, b = caches(tmp_path)
    ds = ConcatDataset([Subset(a, range(0, 50, 3)), b])
    loader = Loader(ds, 5, shuffle=True, seed=2)
    loader.set_epoch(1)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    resumed = Loader(ds, 5, shuffle=True, seed=2)
    resumed.load_state_dict(state)
    same(list(resumed), rest)
    same(first + rest, reference(ds, 5, seed=2, epoch=1, shuffle=True))
    sub = Subset(a, list(range(1, 50, 2)))
    labels = [
        label
        for rank in (0, 1)
        for _, labels in Loader(sub, 4, shuffle=True, rank=rank, world_size=2)
        for label in labels.tolist()
    ]
    assert len(labels) == 26 and set(labels) == set(range(1, 50, 2))  # 25 indices, padded to 2 x 13 as it does


# Which of the wrapper's caches (in the order they appear under it) holds the sample labelled ``label``.
LEAF = {
    "Subset": lambda label: 0,
    "ConcatDataset of two caches": lambda label: int(label >= 1000),
    "Subset of a ConcatDataset of Subsets": lambda label: 1 if label < 1000 else 0 if label < 1010 else 2,
}


@pytest.mark.parametrize("wrapper", list(LEAF))
def test_augment_over_a_wrapper_crops_each_image_by_its_index_in_its_cache(tmp_path, monkeypatch, read_path, wrapper):
    """With augment=, each image of a wrapped cache is cropped and flipped as the torch reference does for (seed,
    epoch, its index in its cache), the seed mixed for the wrapper's second cache on (a cache appearing twice
    draws anew); a batch spanning several caches takes the core's path for each (no per-sample torch path)."""
    a, b = caches(tmp_path, images=True)
    ds = WRAPPERS[wrapper](a, b)
    if read_path == "native":
        monkeypatch.setattr(_fused.Fused, "pure", lambda *args: pytest.fail("the native batch fell back"))
    pipeline = [RandomResizedCrop(12), RandomHorizontalFlip()]
    plan = aug.compile_plan(pipeline)
    loader = Loader(ds, 8, shuffle=True, seed=9, augment=pipeline)
    seen = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for images, labels in loader:
            assert images.shape[1:] == (3, 12, 12)
            for row, label in enumerate(labels.tolist()):
                index = label if label < 1000 else label - 1000
                want, box = expected(plan, part_seed(9, LEAF[wrapper](label)), epoch, index, image_for(label))
                tolerance = 1 if read_path == "native" and box[4:6] != box[2:4] else 0
                assert (images[row].int() - want.int()).abs().max().item() <= tolerance, (label, epoch)
                seen.append(label)
    assert sorted(seen) == sorted(2 * [int(s[1]) for s in (ds[i] for i in range(len(ds)))])


def test_what_the_loader_cannot_read_under_a_wrapper_is_refused_with_the_fix(tmp_path):
    """A dataset that is not a cache (alone or under a wrapper) and a Subset index out of range are library errors
    naming where and the way out, when the Loader is created; never a raw AttributeError later."""
    a, _ = caches(tmp_path)
    plain = TensorDataset(torch.zeros(4, 2))
    with pytest.raises(InvalidOptionError, match=r"the dataset\.datasets\[1\] is a TensorDataset.*CachedDataset"):
        Loader(ConcatDataset([a, plain]), 2)
    with pytest.raises(InvalidOptionError, match=r"not a TensorDataset.*Wrap the dataset in CachedDataset"):
        Loader(plain, 2)
    with pytest.raises(InvalidOptionError, match=r"the dataset\.dataset\.indices\[1\] is 50, out of range"):
        Loader(Subset(Subset(a, [0, 50]), [0]), 2)
    with pytest.raises(InvalidOptionError, match=r"indices must be integers"):
        Loader(Subset(a, [0.5]), 2)
