"""The loader at scale: ``ds.loader`` over a cache of 1M samples against a memmap (issue #24).

    python -m bench.scale [--n 1000000] [--reps 3] [--root DIR]

One process, warm page cache (the files dropped from it and read back once, so all three are as a read
from disk leaves them, then each read through right before each timed epoch). Caches of
``--n`` samples of 3x32x32 uint8, unpacked and packed by 64 (precompute's default), are built once
by ``bench.single``'s builder and kept in ``--root`` (shared with ``python -m bench.single --root``).
Rows, per repetition, interleaved, in samples/s of the second shuffled epoch (the first, untimed,
is the process's first reads of every index):

- ``ds.loader``, batch 64, 2 threads, on the unpacked and on the packed cache;
- the bound: ``np.take`` of shuffled batches of 64 from the memmap into a reused buffer, 1 thread.

Medians of ``--reps``, min-max beside; the ratio is loader / bound, taken per repetition.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.single import build, reread_files, warm_files
from lmdbcache import CachedDataset

BATCH = 64


def batches(n: int, epoch: int) -> list[np.ndarray]:
    """The shuffled batches of ``epoch`` (the same for every row of that epoch)."""
    perm = np.random.default_rng(epoch).permutation(n)
    return [perm[lo : lo + BATCH] for lo in range(0, n, BATCH)]


def loader_epoch(cache: str) -> Callable[[int, list[np.ndarray]], int]:
    ds = CachedDataset.open(cache)
    loader = ds.loader(BATCH, shuffle=True, num_threads=2)
    loader.set_epoch(0)
    for _ in loader:  # the untimed first epoch: this process's first reads
        pass

    def run(epoch: int, _order: list[np.ndarray]) -> int:
        loader.set_epoch(epoch)
        count = 0
        for images, _labels in loader:
            count += len(images)
        return count

    return run


def memcpy_epoch(npy: str) -> Callable[[int, list[np.ndarray]], int]:
    mm = np.load(npy, mmap_mode="r")
    buf = np.empty((BATCH, *mm.shape[1:]), mm.dtype)

    def run(_epoch: int, order: list[np.ndarray]) -> int:
        count = 0
        for indices in order:
            np.take(mm, indices, axis=0, out=buf[: len(indices)])
            torch.from_numpy(buf[: len(indices)])
            count += len(indices)
        return count

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "lmdbcache-bench-single"))
    args = p.parse_args(argv)
    os.makedirs(args.root, exist_ok=True)
    torch.set_num_threads(1)
    unpacked, npy = build(args.root, "r32", args.n)
    packed, _ = build(args.root, "r32p64", args.n)
    # All three as read from disk (see bench.single.reread_files), before any is mapped: a page mapped by a
    # process is not dropped, so a loader's first epoch before this would keep its cache's pages as built.
    reread_files(unpacked, packed, npy)
    rows = {
        "ds.loader, 2 threads, unpacked": (loader_epoch(unpacked), unpacked),
        "ds.loader, 2 threads, packed by 64": (loader_epoch(packed), packed),
        "np.take from the memmap into a reused buffer, 1 thread": (memcpy_epoch(npy), npy),
    }
    rates: dict[str, list[float]] = {label: [] for label in rows}
    for epoch in range(1, args.reps + 1):
        order = batches(args.n, epoch)
        for label, (run, path) in rows.items():
            warm_files(path)
            start = time.perf_counter()
            count = run(epoch, order)
            rates[label].append(count / (time.perf_counter() - start))
            assert count == args.n, (label, count)
        print(f"  repetition {epoch}: " + ", ".join(f"{r[-1]:,.0f}" for r in rates.values()), flush=True)
    bound = rates["np.take from the memmap into a reused buffer, 1 thread"]
    load = os.getloadavg()
    print(f"\n{args.n:,} samples of 3x32x32 uint8, batch {BATCH}, second shuffled epoch on, warm; load {load}")
    print("| path | samples/s, median (min-max) | vs the bound |")
    print("|---|---|---|")
    for label, r in rates.items():
        ratio = statistics.median(a / b for a, b in zip(r, bound))
        print(f"| {label} | {statistics.median(r):,.0f} ({min(r):,.0f}-{max(r):,.0f}) | {ratio:.2f}x |")
    print("mapped in 2 MiB pages (FilePmdMapped / Rss, /proc/self/smaps): " + huge_mapped(unpacked, packed, npy))
    return 0


def huge_mapped(*paths: str) -> str:
    """How much of each file's mapping in this process the kernel maps with 2 MiB entries (fewer TLB misses)."""
    names = {os.path.join(p, "data.mdb") if os.path.isdir(p) else p: os.path.basename(p) for p in paths}
    found: dict[str, list[int]] = {}
    try:
        with open("/proc/self/smaps") as f:
            current = None
            for line in f:
                field = line.split()
                if len(field) >= 6 and "-" in field[0]:
                    current = names.get(field[-1])
                elif current is not None and field[0] in ("Rss:", "FilePmdMapped:"):
                    found.setdefault(current, [0, 0])[field[0] == "Rss:"] += int(field[1])
    except OSError:
        return "not known (no /proc/self/smaps)"
    return ", ".join(f"{name} {pmd >> 10} / {rss >> 10} MiB" for name, (pmd, rss) in found.items())


if __name__ == "__main__":
    raise SystemExit(main())
