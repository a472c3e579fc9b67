"""Per-record compression (issue #14): stored size, warm and cold random reads for none, lz4 and zstd.

    python -m bench.compress [--reps 3] [--n 1000] [--codecs none,lz4,zstd]

Two workloads of 3x224x224 uint8 images, decoded once into memory and then cached once per
codec (the same samples in every cache):

- ``jpeg``: the JPEG workload (``bench.workloads``: photo-like gradients with sensor-like
  noise, decoded, resized and cropped as for ImageNet);
- ``smooth``: gradients with little noise and a few flat regions (renders, scans,
  upsampled images): what zstd compresses somewhat;
- ``masks``: piecewise-constant label maps (segmentation masks, as 3x224x224 uint8): what
  every codec compresses well.

For each cache: its size on disk (data.mdb) and the mean stored value; warm random reads
(``ds[i]`` over a random permutation, every page already in memory, every index verified
before: the epochs after the first); cold random reads (the same, with data.mdb evicted from
the page cache first, as ``bench.cold`` does) and the device bytes they read per sample.
Codecs are interleaved in every repetition; medians of the repetitions; ratios against
``none`` of the same run. ``--codecs none`` runs on a lmdbcache without ``compress=``
(an A/B of uncompressed reads against another checkout).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import lmdbcache

from .cold import evict, read_bytes, unmap_pages
from .workloads import ArrayDataset, JpegFolder, make_jpeg_folder


def jpeg_images(work: Path, n: int) -> np.ndarray:
    source = JpegFolder(make_jpeg_folder(work / "jpeg", n))
    return np.stack([source[i][0].numpy() for i in range(n)])


def smooth_images(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:224, 0:224].astype(np.float32)
    out = np.empty((n, 3, 224, 224), np.uint8)
    for i in range(n):
        for c in range(3):
            ramp = xx * rng.uniform(0.1, 0.8) + yy * rng.uniform(0.1, 0.8) + rng.uniform(0, 255)
            ramp[: rng.integers(20, 120), : rng.integers(20, 120)] = rng.uniform(0, 255)  # a flat region
            out[i, c] = np.clip(ramp % 256 + rng.normal(0, 2, ramp.shape), 0, 255).astype(np.uint8)
    return out


def mask_images(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((n, 3, 224, 224), np.uint8)
    for i in range(n):
        for _ in range(8):  # a few rectangles of classes 1..20 on a background of 0
            y, x = rng.integers(0, 200, 2)
            h, w = rng.integers(10, 120, 2)
            out[i, :, y : y + h, x : x + w] = rng.integers(1, 21)
    return out


def build(work: Path, name: str, codec: str, data: np.ndarray) -> Path:
    path = work / f"{name}-{codec}.lmdb"
    options = {} if codec == "none" else {"compress": codec}
    ds = lmdbcache.CachedDataset(ArrayDataset(data), path, map_size=1 << 32, **options)
    for i in range(len(data)):
        ds[i]
    ds.close()
    return path


def stored_bytes(path: Path) -> float:
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=2)
    with env.begin(db=env.open_db(b"samples", create=False)) as txn:
        sizes = [len(v) for _, v in txn.cursor()]
    env.close()
    return statistics.mean(sizes)


def workload(work: Path, name: str, data: np.ndarray, codecs: list[str], reps: int) -> dict:
    n = len(data)
    paths = {codec: build(work, name, codec, data) for codec in codecs}
    order = list(range(n))
    warm: dict[str, list[float]] = {c: [] for c in codecs}
    cold: dict[str, list[tuple[float, int]]] = {c: [] for c in codecs}
    for rep in range(reps):
        for codec in codecs:
            ds = lmdbcache.CachedDataset.open(paths[codec])
            for i in range(n):  # every index verified once, every page in memory
                ds[i]
            random.Random(rep).shuffle(order)
            start = time.perf_counter()
            for i in order:
                ds[i]
            warm[codec].append(n / (time.perf_counter() - start))
            data_file = str(paths[codec] / "data.mdb")
            unmap_pages(data_file)
            evict(data_file)
            random.Random(rep + 1000).shuffle(order)
            before, start = read_bytes(), time.perf_counter()
            for i in order:
                ds[i]
            cold[codec].append((n / (time.perf_counter() - start), read_bytes() - before))
            ds.close()
    out: dict = {"n": n, "codecs": {}}
    for codec in codecs:
        out["codecs"][codec] = {
            "file_bytes": os.path.getsize(paths[codec] / "data.mdb"),
            "value_bytes": stored_bytes(paths[codec]),
            "warm": statistics.median(warm[codec]),
            "warm_spread": (min(warm[codec]), max(warm[codec])),
            "cold": statistics.median(r for r, _ in cold[codec]),
            "cold_spread": (min(r for r, _ in cold[codec]), max(r for r, _ in cold[codec])),
            "device_bytes": statistics.median(b for _, b in cold[codec]) / n,
        }
    return out


def show(name: str, result: dict) -> None:
    rows = result["codecs"]
    base = rows.get("none")
    print(f"{name}: {result['n']} samples of 3x224x224 uint8 (150,528 bytes raw)")
    print("  codec  value bytes  data.mdb MB  warm/s (min-max)          cold/s (min-max)        device B/sample")
    for codec, r in rows.items():
        rel = (
            f"  [{r['value_bytes'] / base['value_bytes']:.2f}x size, {r['warm'] / base['warm']:.2f}x warm, "
            f"{r['cold'] / base['cold']:.2f}x cold]"
            if base
            else ""
        )
        print(
            f"  {codec:5s}  {r['value_bytes']:11,.0f}  {r['file_bytes'] / 2**20:11,.1f}  "
            f"{r['warm']:7,.0f} ({r['warm_spread'][0]:,.0f}-{r['warm_spread'][1]:,.0f})  "
            f"{r['cold']:7,.0f} ({r['cold_spread'][0]:,.0f}-{r['cold_spread'][1]:,.0f})  "
            f"{r['device_bytes']:12,.0f}{rel}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--codecs", default="none,lz4,zstd")
    parser.add_argument("--workloads", default="jpeg,smooth,masks")
    parser.add_argument("--dir", default=None, help="where the caches go (default: a temporary directory)")
    args = parser.parse_args(argv)
    codecs = args.codecs.split(",")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        for name in args.workloads.split(","):
            images = {"jpeg": lambda: jpeg_images(work, args.n), "smooth": lambda: smooth_images(args.n),
                      "masks": lambda: mask_images(args.n)}  # fmt: skip
            data = images[name]()
            show(name, workload(work, name, data, codecs, args.reps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
