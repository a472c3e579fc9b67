"""The benchmark's workloads, generated on the spot from fixed seeds (nothing is downloaded).

- ``jpeg``: JPEG files (~500x375, quality 90) decoded with Pillow, resized to 256 on the short
  side, center-cropped to 224: ``(uint8 tensor 3x224x224, int label)``. The ImageNet-like case.
- ``small``: ``(uint8 tensor 3x32x32, int label)`` from an in-memory array, as torchvision's
  CIFAR datasets hold it. Per-sample overhead dominates.
- ``dict``: ``{"features": float32 tensor 1x80x3000, "tokens": [int64 tensors of varied
  length], "text": str}``, generated per index: a generic nested sample.
- ``png`` (first epochs only): 32x32 RGB PNG files decoded with Pillow: ``(uint8 tensor
  3x32x32, int label)``. The CIFAR-like case of a real but cheap decode (a synthetic 3 us
  source makes any cache look slow).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

# The JPEG workload is the demo's (the bundled example).
from scripts.example_data import JpegFolder, make_jpeg_folder

__all__ = [
    "ArrayDataset",
    "DictDataset",
    "JpegFolder",
    "MemmapDataset",
    "PngFolder",
    "Workload",
    "make_jpeg_folder",
    "make_png_folder",
    "tensor_data",
    "write_npy",
]


class ArrayDataset(Dataset):
    """Samples ``(uint8 tensor, int label)`` copied from one in-memory array."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.data[i].copy()), int(i % 1000)


def tensor_data(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


class DictDataset(Dataset):
    """Nested samples generated from the index (the "decode" is the generation)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        lengths = torch.randint(5, 60, (int(torch.randint(1, 5, (), generator=g)),), generator=g).tolist()
        return {
            "features": torch.randn((1, 80, 3000), generator=g),
            "tokens": [torch.randint(0, 50_000, (k,), generator=g) for k in lengths],
            "text": f"utterance {i}: " + "x" * int(lengths[0]),
        }


def make_png_folder(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` 32x32 RGB PNG files (smooth blobs plus noise, ~2-3 KB each, like CIFAR's); reused if present."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    marker = root / f".complete-{n}-{seed}"
    if marker.exists():
        return root
    rng = np.random.default_rng(seed)
    for i in range(n):
        coarse = rng.integers(0, 256, size=(8, 8, 3)).astype(np.float32)
        img = np.kron(coarse, np.ones((4, 4, 1))) + rng.normal(0, 10, size=(32, 32, 3))
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / f"{i:06d}.png")
    marker.touch()
    return root


class PngFolder(Dataset):
    """CIFAR-like decode: Pillow opens a 32x32 PNG; CHW uint8 tensor + label."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.files = sorted(Path(root).glob("*.png"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.files[i]) as im:
            arr = np.asarray(im.convert("RGB"))
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), i % 10


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


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named workload of ``n`` samples whose generated inputs live under ``data``."""

    name: str
    n: int
    data: Path

    @property
    def fixed_shape(self) -> bool:
        return self.name in ("jpeg", "small")

    def source(self) -> Dataset:
        if self.name == "jpeg":
            return JpegFolder(make_jpeg_folder(self.data / f"jpeg-{self.n}", self.n))
        if self.name == "small":
            return ArrayDataset(tensor_data(self.n, (3, 32, 32)))
        if self.name == "dict":
            return DictDataset(self.n)
        if self.name == "png":
            return PngFolder(make_png_folder(self.data / f"png-{self.n}", self.n))
        raise ValueError(f"unknown workload {self.name!r}")

    def payload_bytes(self, source: Dataset) -> int:
        """Bytes of decoded data (tensors, token ids and text) in the whole dataset."""
        if self.name == "jpeg":
            return self.n * 3 * 224 * 224
        if self.name == "small":
            return self.n * 3 * 32 * 32
        total = 0
        for i in range(self.n):
            s = source[i]
            total += s["features"].nbytes + sum(t.nbytes for t in s["tokens"]) + len(s["text"].encode())
        return total
