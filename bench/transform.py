"""Per-sample transforms on ``ds.loader``: the copy threads (``num_workers=0``) vs 2 worker processes.

    python -m bench.transform [--reps 3]

One run, warm cache, batch 64, shuffled. Two transforms: ``python`` holds the GIL for about
0.5 ms per sample (a pure-Python loop, as PIL-heavy or Python augmentation does) and ``flip``
is a cheap tensor op that releases the GIL. Each is timed on the threads and on 2 worker
processes, interleaved per repetition; figures are medians (samples/s), with the ratio
processes / threads. This is what ``Loader``'s default (``num_workers=None``: processes when
there is a transform) rests on.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import Dataset

from lmdbcache import CachedDataset


class Images(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 255, self.shape, dtype=torch.uint8, generator=g), i


def python(sample: Any) -> Any:
    """About 0.5 ms of pure Python, holding the GIL."""
    x = 0
    for k in range(15000):
        x += k
    return sample[0], sample[1] + (x & 1)


def flip(sample: Any) -> Any:
    image, label = sample
    return (image.flip(-1) if torch.rand(()) < 0.5 else image), label


def epoch(ds: CachedDataset, workers: int) -> float:
    with ds.loader(64, shuffle=True, num_workers=workers) as loader:
        start = time.perf_counter()
        count = sum(len(labels) for _, labels in loader)
        return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    for n, shape in ((2000, (3, 64, 64)), (1000, (3, 224, 224))):
        with tempfile.TemporaryDirectory() as root:
            CachedDataset(Images(n, shape), f"{root}/c").__getitems__(list(range(n)))
            for name, transform in (("python 0.5 ms", python), ("flip", flip)):
                ds = CachedDataset.open(f"{root}/c", transform=transform)
                runs: dict[int, list[float]] = {0: [], 2: []}
                for workers in runs:
                    epoch(ds, workers)  # untimed: warms the pages and the code
                for _ in range(args.reps):
                    for workers, rates in runs.items():
                        rates.append(epoch(ds, workers))
                ds.close()
                threads, processes = statistics.median(runs[0]), statistics.median(runs[2])
                print(
                    f"{name:>14} {'x'.join(map(str, shape)):>9}: threads {threads:8,.0f}/s, 2 processes "
                    f"{processes:8,.0f}/s, processes/threads {processes / threads:.2f}x"
                )


if __name__ == "__main__":
    main()
