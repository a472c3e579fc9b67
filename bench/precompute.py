"""Precompute throughput against the bare dataset in a DataLoader with the same workers (issue #3).

    python -m bench.precompute [--n 1500] [--reps 3] [--workers 1 2]

Both run as whole processes, timed from outside (interpreter start to exit), on the same
JPEG folder (already in the page cache: both read the same files), interleaved in every
repetition; each precompute starts from an empty cache. Figures are medians with spread.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .core import _fmt

ROOT = Path(__file__).resolve().parent.parent

BARE = """
import sys
from torch.utils.data import DataLoader
sys.path.insert(0, {root!r})
from scripts.example_data import jpeg_dataset
ds = jpeg_dataset(sys.argv[1], int(sys.argv[2]))
loader = DataLoader(ds, batch_size=16, num_workers=int(sys.argv[3]), prefetch_factor=4 if int(sys.argv[3]) else None)
print(sum(len(labels) for _, labels in loader))
"""


def _run(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="lmdbcache-bench-"))
    jpeg = work / "jpeg"
    sys.path.insert(0, str(ROOT))
    from scripts.example_data import make_jpeg_folder

    make_jpeg_folder(jpeg, args.n)
    bare_cmd = [sys.executable, "-c", BARE.format(root=str(ROOT)), str(jpeg), str(args.n)]
    try:
        for workers in args.workers:
            bare, pre = [], []
            precompute = [sys.executable, "-m", "lmdbcache", "precompute", "scripts/example_data.py:jpeg_dataset"]
            for _ in range(args.reps):
                bare.append(args.n / _run([*bare_cmd, str(workers)]))
                cache = work / "cache"
                shutil.rmtree(cache, ignore_errors=True)
                options = ["--arg", f"root={jpeg}", "--arg", f"n={args.n}", "--workers", str(workers), "--quiet"]
                pre.append(args.n / _run([*precompute, str(cache), *options]))
            ratios = [p / b for p, b in zip(pre, bare)]
            print(
                f"workers={workers}: bare DataLoader {_fmt(bare)}, precompute {_fmt(pre)}"
                f" -> {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}; target >= 0.90)"
            )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {os.cpu_count()} CPUs; n={args.n} JPEGs of ~500x375 -> 3x224x224 uint8")


if __name__ == "__main__":
    main()
