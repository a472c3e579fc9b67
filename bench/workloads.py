"""Deterministic benchmark datasets, generated on the spot (nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

# The JPEG workload is the demo's (the bundled example).
from scripts.example_data import JpegFolder, make_jpeg_folder


class ArrayDataset(Dataset):
    """Samples ``(uint8 tensor, int label)`` copied from one in-memory array: the source for tensor workloads."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.data[i].copy()), int(i % 1000)


def tensor_data(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


class MemmapDataset(Dataset):
    """The physical floor: ``np.load(mmap_mode="r")`` of one .npy and a copy per sample, as users write it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.mm = None
        self.n = int(np.load(self.path, mmap_mode="r").shape[0])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.mm is None:
            self.mm = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.array(self.mm[i])), int(i % 1000)

    def __getstate__(self):
        return {**self.__dict__, "mm": None}


def write_npy(dataset: Dataset, path: Path) -> None:
    """Write every sample's tensor into one .npy (fixed-shape workloads only)."""
    first = dataset[0][0].numpy()
    out = np.lib.format.open_memmap(path, mode="w+", dtype=first.dtype, shape=(len(dataset), *first.shape))
    for i in range(len(dataset)):
        out[i] = dataset[i][0].numpy()
    out.flush()
    del out


__all__ = ["ArrayDataset", "JpegFolder", "MemmapDataset", "make_jpeg_folder", "tensor_data", "write_npy"]
