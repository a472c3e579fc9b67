"""The fused loader's epochs in the process that filled the cache (issue 38, item 6).

    python -m bench.after_fill [--n 512] [--epochs 4] [--flush] [--threads 2]

Fills a new cache through ``CachedDataset`` (epoch 1: every index a miss, as a first training epoch
fills it), then runs ``--epochs`` epochs of ``Loader(ds, 64, shuffle=True, augment=[RandomResizedCrop(224),
RandomHorizontalFlip()])`` in the same process and prints each epoch's CPU time per image (process CPU /
images) and wall time. ``--flush`` calls ``ds.flush()`` between the fill and the loader (the workaround the
client found). A second process opening the finished cache is the reference (``--fresh``): the same epochs
with nothing of the fill's in memory.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset

from lmdbcache import CachedDataset, Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop


class Images(Dataset[tuple[torch.Tensor, int]]):
    """uint8 CHW images of 3x256x320, deterministic per index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, 256, 320), dtype=torch.uint8, generator=g), i % 1000


def epochs(ds: CachedDataset, count: int, threads: int) -> None:
    loader = Loader(ds, 64, shuffle=True, seed=0, num_threads=threads,
                    augment=[RandomResizedCrop(224), RandomHorizontalFlip()])  # fmt: skip
    for epoch in range(count):
        loader.set_epoch(epoch)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu, wall, n = time.process_time(), time.perf_counter(), 0
        for images, _ in loader:
            n += len(images)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(
            f"  epoch {epoch + 2}: {cpu / n * 1e6:6.0f} us CPU per image, {wall:5.2f} s wall, "
            f"{faults / n:5.1f} page faults per image",
            flush=True,
        )
    loader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flush", action="store_true")
    parser.add_argument("--fresh", help=argparse.SUPPRESS)  # the child: open this cache and run the epochs
    args = parser.parse_args()
    if args.fresh:
        print("another process, CachedDataset.open:")
        epochs(CachedDataset.open(args.fresh), args.epochs, args.threads)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.lmdb")
        ds = CachedDataset(Images(args.n), path)
        t = time.perf_counter()
        for i in torch.randperm(args.n).tolist():  # a shuffled first epoch fills it
            ds[i]
        print(f"fill: {args.n} images in {time.perf_counter() - t:.2f} s; flush between: {args.flush}")
        if args.flush:
            ds.flush()
        print("the process that filled it:")
        epochs(ds, args.epochs, args.threads)
        ds.close()
        subprocess.run([sys.executable, "-m", "bench.after_fill", "--fresh", path, "--epochs", str(args.epochs),
                        "--threads", str(args.threads)], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
