"""The wait for each epoch's first batch in a trainer loop (issue 26: the next epoch's pass built ahead).

    python -m bench.epoch_start [--n 512] [--epochs 12] [--reps 3]

One cache of ``n`` uint8 CHW images of mixed sizes (``bench.augment``'s), ``Loader(ds, 64, shuffle=True,
num_threads=2, augment=[RandomResizedCrop(224), RandomHorizontalFlip()])``, one warm epoch first, then
``epochs`` epochs back to back of a trainer step (1 ms pure Python, 4 ms with the GIL released, as
``bench.augment``'s trainer row). For each repetition: the median wait for an epoch's first batch (from the
consumer asking for it to having it) and for the other batches, then the medians over ``reps``. Without a
pass ahead the first batch of each epoch is built only when ``iter`` asks: a whole batch's wait; with one
(``loader/_pass.Spare``) it is ready. Also the load (``os.getloadavg``). Run it against another checkout with
``PYTHONPATH`` pointing there to pair two builds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bench.augment import BATCH, SIZE, Mixed
from lmdbcache import CachedDataset, Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop


def step() -> None:
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end:
        pass
    time.sleep(0.004)


def waits(loader: Loader, epochs: int) -> tuple[list[float], list[float]]:
    """Seconds waited for each epoch's first batch, and for every other batch."""
    first, other = [], []
    for _ in range(epochs):
        it = iter(loader)
        k = 0
        while True:
            asked = time.perf_counter()
            batch = next(it, None)
            if batch is None:
                break
            (first if k == 0 else other).append(time.perf_counter() - asked)
            k += 1
            step()
    return first, other


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ds = CachedDataset(Mixed(args.n), os.path.join(tmp, "c"))
        for _ in ds:
            pass
        ds.flush()
        steps = [RandomResizedCrop(SIZE), RandomHorizontalFlip()]
        loader = Loader(ds, BATCH, shuffle=True, num_threads=2, augment=steps)
        waits(loader, 1)  # warm: the cache's pages, the ring
        firsts, others = [], []
        for _ in range(args.reps):
            first, other = waits(loader, args.epochs)
            firsts.append(statistics.median(first))
            others.append(statistics.median(other))
        loader.close()
        ds.close()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"bench.epoch_start: {args.n} images, batch {BATCH}, {args.epochs} epochs x {args.reps}; load {load}")
    print(f"wait for an epoch's first batch, ms: median {1e3 * statistics.median(firsts):.2f} "
          f"(per rep {' / '.join(f'{1e3 * x:.2f}' for x in firsts)})")  # fmt: skip
    print(f"wait for the other batches, ms: median {1e3 * statistics.median(others):.2f} "
          f"(per rep {' / '.join(f'{1e3 * x:.2f}' for x in others)})")  # fmt: skip


if __name__ == "__main__":
    main()
