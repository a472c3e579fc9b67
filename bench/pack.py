"""Packs (issue #11): disk size and memory over payload, and warm random reads, pack on vs off in one run.

    python -m bench.pack [--reps 3] [--n 20000] [--n-jpeg 1000] [--pack 64]

For samples of (uint8 tensor, int) of 1 KiB, 3 KiB (3x32x32), 6 KiB and jpeg-sized (3x224x224,
147 KiB): the cache's data.mdb after an in-order lazy fill, a shuffled lazy fill and a
precompute, over the payload (the tensors' bytes), with ``pack=0`` and ``pack=K``; the
shuffled fill also after ``lmdbcache copy`` (compacting: LMDB never shrinks its file, and a
shuffled fill packs most chunks near its end, while the singles they replace still hold
their pages). Then warm random reads (one process, every index read once before timing,
one shuffled pass timed; median of ``--reps``, on and off interleaved) and the PSS a fresh
reader process adds over its start while reading every index (mapped pages it touched,
counted by /proc/self/smaps_rollup), over the payload, for the in-order and the shuffled cache.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"1KiB": (1024,), "3KiB": (3, 32, 32), "6KiB": (2, 3, 32, 32), "jpeg": (3, 224, 224)}


class Tensors(Dataset[Any]):
    """(uint8 tensor of ``shape``, index): a cheap deterministic source."""

    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.n, self.shape = n, shape
        self.base = torch.randint(0, 256, (int(torch.tensor(shape).prod()) + 4096,), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = (i * 7919) % 4096
        return self.base[start : start + self.base.numel() - 4096].reshape(self.shape).clone(), i


PSS = """
import random, sys
sys.path.insert(0, {root!r})
from lmdbcache import CachedDataset

def pss():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024

ds = CachedDataset.open(sys.argv[1])
ds[0]
before = pss()
order = list(range(len(ds)))
random.Random(0).shuffle(order)
for i in order:
    ds[i]
print(pss() - before)
"""


def _fill(path: Path, ds: Tensors, mode: str, pack: int) -> None:
    from lmdbcache import CachedDataset, precompute

    if mode == "precompute":
        precompute(ds, path, num_workers=0, progress=False, pack=pack, check_determinism=0)
        return
    order = list(range(len(ds)))
    if mode == "shuffled":
        random.Random(1).shuffle(order)
    cached = CachedDataset(ds, path, pack=pack, spot_check=0)
    for i in order:
        cached[i]
    cached.close()


def _warm(path: Path, n: int) -> float:
    """Samples/s of one shuffled pass over a cache every index of which this process has read once."""
    from lmdbcache import CachedDataset

    ds = CachedDataset.open(path)
    order = list(range(n))
    random.Random(2).shuffle(order)
    for i in order:
        ds[i]
    random.Random(3).shuffle(order)
    start = time.perf_counter()
    for i in order:
        ds[i]
    rate = n / (time.perf_counter() - start)
    ds.close()
    return rate


def _pss(path: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PSS.format(root=str(ROOT)), str(path)], check=True, capture_output=True, text=True
    )
    return int(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=20000, help="samples of each small size")
    parser.add_argument("--n-jpeg", type=int, default=1000)
    parser.add_argument("--pack", type=int, default=64)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from lmdbcache import tools

    work = args.work or Path(tempfile.mkdtemp(prefix="lmdbcache-pack-"))
    results: dict[str, Any] = {}
    print(
        f"pack={args.pack}; disk and PSS over payload (tensor bytes); warm: samples/s, median (min-max) of {args.reps}"
    )
    print("| size | pack | in-order | shuffled | shuffled, copied | precompute | PSS | PSS, shuffled | warm random |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    try:
        for name in args.sizes:
            shape = SIZES[name]
            n = args.n_jpeg if name == "jpeg" else args.n
            ds = Tensors(n, shape)
            payload = n * ds[0][0].numel()
            row: dict[str, Any] = {}
            for pack in (0, args.pack):
                figures: dict[str, float] = {}
                for mode in ("in-order", "shuffled", "precompute"):
                    path = work / f"{name}-{pack}-{mode}"
                    _fill(path, ds, mode, pack)
                    figures[mode] = os.path.getsize(path / "data.mdb") / payload
                    if mode == "shuffled":
                        figures["pss_shuffled"] = _pss(path) / payload
                        tools.copy_cache(path, work / f"{name}-{pack}-copy")
                        figures["copied"] = os.path.getsize(work / f"{name}-{pack}-copy" / "data.mdb") / payload
                        shutil.rmtree(work / f"{name}-{pack}-copy")
                    if mode != "in-order":
                        shutil.rmtree(path)
                figures["pss"] = _pss(work / f"{name}-{pack}-in-order") / payload
                row[str(pack)] = figures
            rates: dict[str, list[float]] = {"0": [], str(args.pack): []}
            for _ in range(args.reps):
                for pack in (0, args.pack):
                    rates[str(pack)].append(_warm(work / f"{name}-{pack}-in-order", n))
            for pack in (0, args.pack):
                figures, r = row[str(pack)], rates[str(pack)]
                figures["warm"] = statistics.median(r)
                print(
                    f"| {name} | {pack} | {figures['in-order']:.2f}x | {figures['shuffled']:.2f}x | "
                    f"{figures['copied']:.2f}x | {figures['precompute']:.2f}x | {figures['pss']:.2f}x | "
                    f"{figures['pss_shuffled']:.2f}x | "
                    f"{statistics.median(r):,.0f}/s ({min(r):,.0f}-{max(r):,.0f}) |",
                    flush=True,
                )
            off, on = statistics.median(rates["0"]), statistics.median(rates[str(args.pack)])
            print(f"| {name} | warm on/off | | | | | | | {on / off:.2f}x |", flush=True)
            results[name] = row
            for pack in (0, args.pack):
                shutil.rmtree(work / f"{name}-{pack}-in-order")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
