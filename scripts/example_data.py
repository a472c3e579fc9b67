"""The bundled example: a folder of synthetic JPEG photos and an ImageNet-style dataset over it.

Used by ``make demo``, the benchmarks, and as a precompute SPEC:
    lmdbcache precompute scripts/example_data.py:jpeg_dataset --arg root=demo_data/jpeg CACHE
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


def make_jpeg_folder(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` JPEG files (quality 90) of varied sizes around 500x375, as in ImageNet; reused if present."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    marker = root / f".complete-{n}-{seed}"
    if marker.exists():
        return root
    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = int(rng.integers(400, 600)), int(rng.integers(300, 450))
        # Smooth gradients plus noise: compresses like a photo, not like pure noise.
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack(
            [(xx * rng.uniform(0.2, 0.6) + yy * rng.uniform(0.1, 0.4) + rng.uniform(0, 255)) % 256 for _ in range(3)],
            -1,
        )
        img = np.clip(base + rng.normal(0, 12, size=base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(root / f"{i:06d}.jpg", quality=90)
    marker.touch()
    return root


class JpegFolder(Dataset):
    """ImageNet-style decode: Pillow open, resize short side to 256, center crop 224, CHW uint8 tensor + label."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.files = sorted(Path(root).glob("*.jpg"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            scale = 256 / min(w, h)
            im = im.resize((max(256, round(w * scale)), max(256, round(h * scale))), Image.BILINEAR)
            w, h = im.size
            left, top = (w - 224) // 2, (h - 224) // 2
            im = im.crop((left, top, left + 224, top + 224))
            arr = np.asarray(im)
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), i % 1000


def jpeg_dataset(root: str = "demo_data/jpeg", n: int = 400) -> JpegFolder:
    """The example dataset, generating its JPEG files on first use."""
    return JpegFolder(make_jpeg_folder(Path(root), n))
