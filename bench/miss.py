"""The cost of one miss above a trivial source (issue #24, step 3): a lazy fill through ``ds[i]``.

    python -m bench.miss [--n 20000] [--reps 3] [--sizes 1,3,6] [--profile KIB]

For each sample size (1 / 3 / 6 KiB of uint8, with an int label: ``bench.workloads.ArrayDataset``), one
process times, interleaved per repetition: the bare source over a shuffled order (``src[i]`` for every
index), then a first epoch through an empty cache in the same order (``ds[i]`` for every index, then
``flush``: every miss encoded, queued and committed). The figure is the wall clock per sample of the
fill minus the bare source's (medians of the repetitions, min-max beside); make bench's per-miss
harness (``bench.run``) takes the same figure in index order. ``--profile KIB`` instead prints a
cProfile of one fill of that size, by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any


def _bare(source: Any, order: list[int]) -> float:
    gc.collect()  # not the one-off full collection of torch's import objects inside the timed loop
    start = time.perf_counter()
    for i in order:
        source[i]
    return (time.perf_counter() - start) / len(order) * 1e6


def _fill(source: Any, order: list[int], path: str) -> float:
    import lmdbcache

    ds = lmdbcache.CachedDataset(source, path, spot_check=0)
    gc.collect()
    start = time.perf_counter()
    for i in order:
        ds[i]
    ds.flush()
    us = (time.perf_counter() - start) / len(order) * 1e6
    ds.close()
    shutil.rmtree(path)
    return us


def _dirty_mib() -> str:
    """The machine's dirty page cache (/proc/meminfo), which the commits' writes depend on: with 1.3 GB of it
    left by other runs, a commit's page-cache copy ran 5-7x slower here (and the 6 KiB row with it)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("Dirty:"))
        return str(kib // 1024)
    except (OSError, StopIteration, ValueError):
        return "?"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.miss", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sizes", default="1,3,6", help="KiB per sample, comma-separated")
    p.add_argument("--profile", type=int, default=0, metavar="KIB")
    args = p.parse_args(argv)
    from lmdbcache import _native

    from .workloads import ArrayDataset, tensor_data

    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} cores, core {'on' if _native.NATIVE else 'off'}, "
        f"dirty page cache {_dirty_mib()} MiB"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cache.lmdb")
        if args.profile:
            source = ArrayDataset(tensor_data(args.n, (args.profile, 32, 32)))
            order = random.Random(0).sample(range(args.n), args.n)
            prof = cProfile.Profile()
            prof.runcall(_fill, source, order, path)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        for kib in (int(k) for k in args.sizes.split(",")):
            source = ArrayDataset(tensor_data(args.n, (kib, 32, 32)))
            bare, fill = [], []
            for rep in range(args.reps):
                order = random.Random(rep).sample(range(args.n), args.n)
                bare.append(_bare(source, order))
                fill.append(_fill(source, order, path))
            over = [f - b for f, b in zip(fill, bare)]
            ratio = statistics.median(b / f for f, b in zip(fill, bare))
            print(
                f"per miss {kib} KiB shuffled: bare {statistics.median(bare):.1f} us, through the cache "
                f"{statistics.median(fill):.1f} us: {statistics.median(over):.1f} us above the source "
                f"({min(over):.1f}-{max(over):.1f}); fill/bare {ratio:.2f}x; dirty page cache {_dirty_mib()} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
