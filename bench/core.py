"""The core read-path and fill figures (issue #2), as ratios against baselines timed in the same run.

    python -m bench.core [--reps 7] [--n-big 2000] [--n-small 20000] [--n-jpeg 400]

Warm reads: one process, random order, each system re-read once right before it is
timed (the machine reclaims idle page cache), systems interleaved in every repetition;
figures are medians over repetitions with the min-max spread.
Fill: one pass in index order over a JPEG folder, bare dataset vs CachedDataset filling
an empty cache (commit included: the cache is closed inside the timed region).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lmdbcache

from .workloads import ArrayDataset, JpegFolder, MemmapDataset, make_jpeg_folder, tensor_data, write_npy


def _rate(ds, order) -> float:
    start = time.perf_counter()
    for i in order:
        ds[i]
    return len(order) / (time.perf_counter() - start)


def warm_reads(work: Path, name: str, n: int, shape: tuple[int, ...], reps: int, checksum: str) -> dict:
    source = ArrayDataset(tensor_data(n, shape))
    write_npy(source, work / f"{name}.npy")
    cache = lmdbcache.CachedDataset(source, work / f"{name}.lmdb", map_size=1 << 30, checksum=checksum)
    for i in range(n):
        cache[i]
    cache.flush()
    # The same cache read with the other checksum mode, timed in the same run (what "always" costs).
    other = "always" if checksum == "once" else "once"
    second = lmdbcache.CachedDataset.open(work / f"{name}.lmdb", checksum=other)
    systems = {"memmap": MemmapDataset(work / f"{name}.npy"), "lmdbcache": cache, f"lmdbcache-{other}": second}
    order = list(range(n))
    rates: dict[str, list[float]] = {k: [] for k in systems}
    for rep in range(reps):
        random.Random(rep).shuffle(order)
        for key, ds in systems.items():
            _rate(ds, order)  # warm: bring the pages back right before timing
            rates[key].append(_rate(ds, order))
    ratios = [a / b for a, b in zip(rates["lmdbcache"], rates["memmap"])]
    modes = [a / b for a, b in zip(rates[f"lmdbcache-{other}"], rates["lmdbcache"])]
    cache.close()
    second.close()
    return {
        "rates": rates,
        "ratio": statistics.median(ratios),
        "ratio_spread": (min(ratios), max(ratios)),
        "other": other,
        "other_ratio": statistics.median(modes),
    }


def fill(work: Path, n: int, reps: int) -> dict:
    """First epoch through an empty cache vs the bare dataset, interleaved.

    The epoch is timed as training sees it: the loop over every index. Its last batch is
    committed by the background thread while the next epoch starts; that final wait
    (``close``) is timed apart and reported, not hidden.
    """
    folder = make_jpeg_folder(work / "jpeg", n)
    source = JpegFolder(folder)
    order = list(range(n))
    bare, filling, closing = [], [], []
    for rep in range(reps):
        bare.append(_rate(source, order))
        path = work / f"fill-{rep}.lmdb"
        cache = lmdbcache.CachedDataset(source, path, map_size=1 << 30)
        filling.append(_rate(cache, order))
        start = time.perf_counter()
        cache.close()
        closing.append(time.perf_counter() - start)
        shutil.rmtree(path)
    ratios = [f / b for f, b in zip(filling, bare)]
    return {
        "bare": bare,
        "fill": filling,
        "close_s": statistics.median(closing),
        "ratio": statistics.median(ratios),
        "ratio_spread": (min(ratios), max(ratios)),
    }


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f}/s ({min(values):,.0f}-{max(values):,.0f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--n-big", type=int, default=2000)
    parser.add_argument("--n-small", type=int, default=20000)
    parser.add_argument("--n-jpeg", type=int, default=1000)
    parser.add_argument("--checksum", default="once", choices=["once", "always"])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="lmdbcache-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name, n, shape, target in (
            ("3x224x224", args.n_big, (3, 224, 224), 0.9),
            ("3x32x32", args.n_small, (3, 32, 32), 0.7),
        ):
            if not n:
                continue
            r = warm_reads(work, name, n, shape, args.reps, args.checksum)
            lo, hi = r["ratio_spread"]
            rates = r["rates"]
            print(
                f"warm {name:10s} n={n:6d}: memmap {_fmt(rates['memmap'])}, lmdbcache {_fmt(rates['lmdbcache'])}"
                f" -> {r['ratio']:.2f}x memmap ({lo:.2f}-{hi:.2f}; target >= {target});"
                f" checksum={r['other']} {_fmt(rates['lmdbcache-' + r['other']])} = {r['other_ratio']:.2f}x"
                f" checksum={args.checksum}"
            )
        if args.n_jpeg:
            r = fill(work, args.n_jpeg, args.reps)
            lo, hi = r["ratio_spread"]
            print(
                f"fill jpeg n={args.n_jpeg}: bare {_fmt(r['bare'])}, first epoch {_fmt(r['fill'])}"
                f" -> {r['ratio']:.2f}x bare ({lo:.2f}-{hi:.2f}; target >= 0.90);"
                f" final commit at close {r['close_s']:.2f} s"
            )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
