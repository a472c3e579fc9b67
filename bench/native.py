"""The loader's batch path both ways in one run: the compiled core against the pure-Python path (issue #24).

    python -m bench.native [--reps 5] [--n-small 20000] [--n-big 1000] [--threads 2]

One process, warm page cache, batch 64, shuffled. Each workload's cache is filled once; then
per repetition one epoch on each path, interleaved (the switch is ``lmdbcache._native.core``,
set to None for the Python path, as ``LMDBCACHE_PURE_PYTHON=1`` does at import). Medians in
samples/s, min-max beside, the ratio native / Python taken per repetition.

    python -m bench.native --callgrind-child {native,python} N EPOCHS

is what ``bench/callgrind_native.sh`` runs under valgrind (instructions per sample).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset

from lmdbcache import CachedDataset, _native


class Images(Dataset):
    """``(uint8 tensor 3xSxS, label)``, generated per index (only read once: to fill the cache)."""

    def __init__(self, n: int, side: int) -> None:
        self.n, self.side = n, side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, self.side, self.side), dtype=torch.uint8, generator=g), i % 1000


def filled(root: str, n: int, side: int) -> CachedDataset:
    ds = CachedDataset(Images(n, side), os.path.join(root, f"c{side}.lmdb"), map_size=1 << 30)
    for lo in range(0, n, 1000):
        ds.__getitems__(list(range(lo, min(lo + 1000, n))))
    ds.flush()
    return ds


def epoch(ds: CachedDataset, threads: int, seed: int) -> float:
    """Samples/s of one shuffled epoch of ``ds.loader(64)`` (the consumer drops each batch)."""
    start = time.perf_counter()
    count = 0
    with ds.loader(64, shuffle=True, seed=seed, num_threads=threads) as loader:
        for batch in loader:
            count += len(batch[1])
    return count / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> None:
    core = _native.core
    if core is None:
        sys.exit("the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1): nothing to compare")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for side, n in ((32, args.n_small), (224, args.n_big)):
            ds = filled(root, n, side)
            for path in (core, None):  # warm the page cache and both paths' caches
                _native.core = path
                epoch(ds, args.threads, 0)
            rates: dict[str, list[float]] = {"native": [], "python": []}
            for rep in range(args.reps):
                for name, path in (("native", core), ("python", None)):
                    _native.core = path
                    rates[name].append(epoch(ds, args.threads, rep + 1))
            _native.core = core
            ratios = [a / b for a, b in zip(rates["native"], rates["python"])]
            for name, values in rates.items():
                median = statistics.median(values)
                print(
                    f"3x{side}x{side} n={n} threads={args.threads} {name:6}: median {median:>10,.0f} samples/s "
                    f"(min {min(values):,.0f}, max {max(values):,.0f})"
                )
            print(f"3x{side}x{side} native / python: median {statistics.median(ratios):.2f}x (per repetition {ratios})")
            ds.close()


def callgrind_child(path: str, n: int, epochs: int) -> None:
    """Fill (or reuse) a 3x32x32 cache of ``n`` samples in $TMPDIR, then read ``epochs`` epochs on ``path``."""
    root = os.path.join(tempfile.gettempdir(), "lmdbcache-bench-native")
    os.makedirs(root, exist_ok=True)
    ds = filled(root, n, 32)
    if path == "python":
        _native.core = None
    for k in range(epochs):
        epoch(ds, 1, k)
    ds.close()


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--callgrind-child"]:
        callgrind_child(argv[1], int(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n-small", type=int, default=20000)
    parser.add_argument("--n-big", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the caches are made (default: the temp dir)")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
