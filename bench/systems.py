"""The systems compared, each wrapping the same source dataset of a workload.

A system knows how to ``fill`` itself from the source (its first epoch: a lazy cache reads
every index once, a converter builds its files) and, if it persists, how to ``open`` what it
built in a fresh process. ``NOTES`` says, for the table, what a reader could misread.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

import lmdbcache

from .workloads import MemmapDataset, Workload, write_npy

NOTES = {
    "bare": "no cache: every read decodes",
    "lmdbcache": "copies each sample out of the shared map (writable tensors the reader owns)",
    "dict-per-process": "returns the stored object itself: no copy, so one-process reads can beat the memmap "
    "floor, but an in-place edit of a sample (`x += 1`) silently corrupts the cache, and every worker holds "
    "its own copy of every sample",
    "memmap": "one .npy converted up front; a copy per read (the physical floor); fixed shapes only",
    "diskcache": "pickled samples in SQLite plus files; a copy per read",
    "hf-datasets": 'Arrow files memory-mapped, `with_format("torch")`; converts integer arrays to int64 '
    "(a uint8 image comes back 8x larger)",
    "kappadata": "SharedDictDataset: a multiprocessing Manager dict; each read is a round trip to the manager "
    "process, tensors come back as views into shared memory (edits write through to the cache). Run with torch's "
    "`file_system` sharing strategy: with the default it dies near `ulimit -n` cached samples (one open "
    "descriptor per tensor)",
}


def _touch_all(ds: Dataset, n: int, seed: int = 0) -> None:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    for i in order:
        ds[i]


class System:
    name = ""
    persistent = True
    fixed_shape_only = False

    def unavailable(self) -> str | None:
        """Why this system cannot run here, or None."""
        return None

    def applies(self, workload: Workload) -> bool:
        return workload.fixed_shape or not self.fixed_shape_only

    def fill(self, workload: Workload, source: Dataset, root: Path) -> Dataset:
        """Build from the source (timed as the first epoch) and return the dataset to read."""
        ds = self.open(workload, source, root)
        _touch_all(ds, workload.n)
        return ds

    def open(self, workload: Workload, source: Dataset, root: Path) -> Dataset:
        """The dataset as a process other than the builder opens it (or builds it, if not persistent)."""
        raise NotImplementedError

    def close(self, ds: Dataset) -> None:
        """Commit and release what ``fill``/``open`` returned."""


class Bare(System):
    name = "bare"
    persistent = False

    def fill(self, workload, source, root):
        _touch_all(source, workload.n)
        return source

    def open(self, workload, source, root):
        return source


class Lmdb(System):
    name = "lmdbcache"

    def fill(self, workload, source, root):
        ds = self.open(workload, source, root)
        _touch_all(ds, workload.n)
        ds.flush()
        return ds

    def open(self, workload, source, root):
        return lmdbcache.CachedDataset(source, root / "cache.lmdb")

    def close(self, ds):
        ds.close()


class DictCache(Dataset):
    """What users write by hand: a dict in the process, filled on first read."""

    def __init__(self, source: Dataset) -> None:
        self.source = source
        self.cache: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        sample = self.cache.get(i)
        if sample is None:
            sample = self.cache[i] = self.source[i]
        return sample


class DictPerProcess(System):
    name = "dict-per-process"
    persistent = False

    def open(self, workload, source, root):
        return DictCache(source)

    def close(self, ds):
        ds.cache.clear()


class Memmap(System):
    name = "memmap"
    fixed_shape_only = True

    def fill(self, workload, source, root):
        root.mkdir(parents=True, exist_ok=True)
        write_npy(source, root / "data.npy")
        return self.open(workload, source, root)

    def open(self, workload, source, root):
        return MemmapDataset(root / "data.npy")


class DiskcacheDataset(Dataset):
    def __init__(self, source: Dataset, directory: Path) -> None:
        import diskcache

        self.source = source
        self.cache = diskcache.Cache(str(directory), size_limit=2**40, eviction_policy="none")

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        sample = self.cache.get(i)
        if sample is None:
            sample = self.source[i]
            self.cache.set(i, sample)
        return sample


class Diskcache(System):
    name = "diskcache"

    def unavailable(self):
        try:
            import diskcache  # noqa: F401
        except ImportError:
            return "not installed (pip install diskcache)"
        return None

    def open(self, workload, source, root):
        return DiskcacheDataset(source, root / "diskcache")

    def close(self, ds):
        ds.cache.close()


class HFRows(Dataset):
    """An HF ``datasets`` table read as this workload's samples (tuples for fixed-shape workloads)."""

    def __init__(self, table: Any, as_tuple: bool) -> None:
        self.table, self.as_tuple = table, as_tuple

    def __len__(self) -> int:
        return len(self.table)

    def _row(self, row: dict) -> Any:
        return (row["image"], row["label"]) if self.as_tuple else row

    def __getitem__(self, i: int) -> Any:
        return self._row(self.table[i])

    def __getitems__(self, indices: list[int]) -> list:
        # HF's own batched read (the DataLoader calls this), kept so HF is not slowed by the wrapper.
        return [self._row(row) for row in self.table.__getitems__(indices)]


class HFDatasets(System):
    name = "hf-datasets"

    def unavailable(self):
        try:
            import datasets  # noqa: F401
        except ImportError:
            return "not installed (pip install datasets)"
        return None

    def _features(self, workload: Workload) -> Any:
        import datasets

        if workload.fixed_shape:
            shape = (3, 224, 224) if workload.name == "jpeg" else (3, 32, 32)
            return datasets.Features(
                {"image": datasets.Array3D(shape=shape, dtype="uint8"), "label": datasets.Value("int64")}
            )
        return datasets.Features(
            {
                "features": datasets.Array3D(shape=(1, 80, 3000), dtype="float32"),
                "tokens": datasets.Sequence(datasets.Sequence(datasets.Value("int64"))),
                "text": datasets.Value("string"),
            }
        )

    def fill(self, workload, source, root):
        import datasets

        datasets.disable_progress_bars()

        def rows():
            for i in range(workload.n):
                sample = source[i]
                if workload.fixed_shape:
                    yield {"image": sample[0].numpy(), "label": sample[1]}
                else:
                    yield {
                        "features": sample["features"].numpy(),
                        "tokens": [t.tolist() for t in sample["tokens"]],
                        "text": sample["text"],
                    }

        table = datasets.Dataset.from_generator(
            rows, features=self._features(workload), cache_dir=str(root / "hf-cache")
        )
        table.save_to_disk(str(root / "hf"))
        shutil.rmtree(root / "hf-cache", ignore_errors=True)
        return self.open(workload, source, root)

    def open(self, workload, source, root):
        import datasets

        datasets.disable_progress_bars()
        return HFRows(datasets.load_from_disk(str(root / "hf")).with_format("torch"), workload.fixed_shape)


def _load_shared_dict_dataset() -> Any:
    """kappadata's SharedDictDataset without importing kappadata's __init__ (which needs torchvision)."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("kappadata")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("kappadata is not installed (pip install --no-deps kappadata)")
    caching = Path(next(iter(spec.submodule_search_locations))) / "caching"
    package = "lmdbcache_bench_kappadata_caching"
    if package not in sys.modules:
        pkg_spec = importlib.util.spec_from_file_location(
            package, caching / "__init__.py", submodule_search_locations=[str(caching)]
        )
        assert pkg_spec is not None and pkg_spec.loader is not None
        module = importlib.util.module_from_spec(pkg_spec)
        sys.modules[package] = module
        pkg_spec.loader.exec_module(module)
    return sys.modules[package].SharedDictDataset


class Kappadata(System):
    name = "kappadata"
    persistent = False

    def unavailable(self):
        try:
            _load_shared_dict_dataset()
        except Exception as exc:
            return f"cannot import kappadata.caching ({exc})"
        return None

    def open(self, workload, source, root):
        torch.multiprocessing.set_sharing_strategy("file_system")
        return _load_shared_dict_dataset()(source)

    def close(self, ds):
        ds.dispose()


SYSTEMS: list[System] = [Bare(), Lmdb(), DictPerProcess(), Memmap(), Diskcache(), HFDatasets(), Kappadata()]
BY_NAME = {s.name: s for s in SYSTEMS}
