"""Cold random reads (issue #14): the cache's pages evicted before every timed pass.

    python -m bench.cold [--reps 3] [--n-big 1500] [--n-small 20000] [--pack K] [--fraction F]

``--pack K`` packs the 3x32x32 cache (filled in order, so every chunk is packed);
``--fraction F`` makes the ``ds[i]`` and ``pread`` passes read F of the indices, so with packs
most packs are read for one value only, as in a cache larger than RAM (the loader rows read all).

Before each cold pass the page cache is emptied of data.mdb (this process's mapping of it
is dropped with madvise DONTNEED, then posix_fadvise DONTNEED on the file: no root needed)
and of the baseline file, which holds the same value bytes at the same sizes back to back.
Each pass reads a random permutation in one process:

- ``lmdbcache-first``: ``ds[i]`` in a freshly opened dataset (the first epoch of a process);
- ``lmdbcache``: then ``ds[i]`` again, every index verified (the epochs after the first);
- ``pread``: ``os.pread`` of each value's bytes at its offset in the plain file (the disk's
  random-read rate at this access size, nothing decoded);
- ``ds.loader``: one shuffled epoch of ``ds.loader(64, num_threads=2)`` (batch tensors filled
  from the map by two copy threads);
- ``DataLoader``: one shuffled epoch of ``DataLoader(ds, 64, num_workers=2,
  collate_fn=lmdbcache.collate)``, the workers forked with the pages already evicted.

The three ``ds[i]``/``pread`` rows read one value at a time; the loader rows have two reads in
flight, so they can pass the one-at-a-time ``pread`` rate.

Device bytes per sample: /proc/self/io ``read_bytes``, against the stored value size. It
counts every thread of this process and, for the DataLoader row, its worker processes: the
kernel adds a child's I/O counts to its parent's when the child is reaped (``wait_task_zombie``;
checked here: a forked child's mmap reads of the whole file appear in the parent's count after
``waitpid``), and DataLoader joins its workers at the end of the epoch, which the pass asserts
(no child left in /proc/self/task/<tid>/children). Adding ``getrusage(RUSAGE_CHILDREN)`` or
the workers' own /proc/<pid>/io on top would count their reads twice.
Warm passes re-read everything right before the timed pass. Medians over repetitions,
systems interleaved in every repetition.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import lmdbcache

from .workloads import ArrayDataset, tensor_data

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_DONTNEED = 4


def read_bytes() -> int:
    """Bytes read from the device by this process's threads and its reaped children."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def children() -> list[str]:
    """Pids of this process's live children (/proc/self/task/<tid>/children)."""
    pids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += f.read().split()
        except FileNotFoundError:  # a thread that ended since the listing (the loader's, DataLoader's)
            continue
    return pids


def unmap_pages(data_file: str) -> None:
    """Drop this process's page-table entries for data.mdb (mapped pages survive fadvise DONTNEED)."""
    real = os.path.realpath(data_file)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.realpath(fields[5].strip()) == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if _libc.madvise(lo, hi - lo, _MADV_DONTNEED) != 0:
                    raise OSError(ctypes.get_errno(), "madvise")


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd) if os.access(path, os.W_OK) else None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(run: Callable[[], None], n: int) -> tuple[float, int]:
    """Samples/s and device bytes of one pass."""
    before = read_bytes()
    start = time.perf_counter()
    run()
    elapsed = time.perf_counter() - start
    return n / elapsed, read_bytes() - before


def workload(
    work: Path, name: str, n: int, shape: tuple[int, ...], reps: int, pack: int = 0, fraction: float = 1.0
) -> dict:
    cache_dir = work / f"{name}-pack{pack}.lmdb"
    source = ArrayDataset(tensor_data(n, shape))
    ds = lmdbcache.CachedDataset(source, cache_dir, map_size=1 << 32, pack=pack)
    for i in range(n):  # in order: with pack=K every chunk of K is packed as it completes
        ds[i]
    # The stored values, written back to back into a plain file (the baseline reads the same sizes).
    ds.flush()  # committed: the scan reads what LMDB holds
    offsets, sizes = [0] * n, [0] * n
    plain = work / f"{name}.plain"
    with open(plain, "wb") as out:
        for index, value in ds._live_store().iter_raw():
            offsets[index], sizes[index] = out.tell(), len(value)
            out.write(value)
    ds.close()
    data_file = str(cache_dir / "data.mdb")
    order = list(range(n))
    part = max(1, round(n * fraction))  # the ds[i] and pread rows read this many random indices a pass

    fd = os.open(plain, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: the disk's rate at this access size

    def read_cached(ds: lmdbcache.CachedDataset) -> Callable[[], None]:
        def run() -> None:
            for i in order[:part]:
                ds[i]

        return run

    def read_plain() -> None:
        pread = os.pread
        for i in order[:part]:
            pread(fd, sizes[i], offsets[i])

    def read_loader(ds: lmdbcache.CachedDataset, rep: int) -> Callable[[], None]:
        def run() -> None:
            loader = ds.loader(64, shuffle=True, seed=rep, num_threads=2)
            count = sum(len(batch[1]) for batch in loader)
            loader.close()
            assert count == n

        return run

    def read_dataloader(ds: lmdbcache.CachedDataset, rep: int) -> Callable[[], None]:
        def run() -> None:
            g = torch.Generator().manual_seed(rep)
            batches = DataLoader(ds, 64, shuffle=True, generator=g, num_workers=2, collate_fn=lmdbcache.collate)
            assert sum(len(batch[1]) for batch in batches) == n
            # The workers' reads count in /proc/self/io once they are reaped (see the docstring).
            assert not children(), "DataLoader workers still alive at the end of the epoch"

        return run

    cold: dict[str, list[tuple[float, int]]] = {
        "lmdbcache-first": [],
        "lmdbcache": [],
        "pread": [],
        "ds.loader": [],
        "DataLoader": [],
    }
    warm: dict[str, list[float]] = {"lmdbcache": [], "pread": []}
    for rep in range(reps):
        random.Random(rep).shuffle(order)
        # One dataset per repetition, closed at its end: datasets on one path in a process share
        # one store (and its verified flags), so a second open one would not read "first" again.
        ds = lmdbcache.CachedDataset.open(cache_dir)
        assert ds.cached_count == n  # opened: the environment and its metadata are read before timing
        unmap_pages(data_file)
        evict(data_file)
        cold["lmdbcache-first"].append(timed(read_cached(ds), part))  # bounds and checksums checked
        if part < n:
            read_cached(ds)()  # these indices verified; the next pass reads them again, cold
        else:
            random.Random(rep + 1000).shuffle(order)
        unmap_pages(data_file)
        evict(data_file)
        cold["lmdbcache"].append(timed(read_cached(ds), part))  # every index verified: the fast path
        evict(str(plain))
        cold["pread"].append(timed(read_plain, part))
        unmap_pages(data_file)
        evict(data_file)
        cold["ds.loader"].append(timed(read_loader(ds, rep), n))
        unmap_pages(data_file)
        evict(data_file)
        cold["DataLoader"].append(timed(read_dataloader(ds, rep), n))
        read_cached(ds)()
        warm["lmdbcache"].append(timed(read_cached(ds), part)[0])
        read_plain()
        warm["pread"].append(timed(read_plain, part)[0])
        ds.close()
    os.close(fd)
    value = statistics.median(sizes)
    out: dict = {"n": n, "pack": pack, "read": part, "value_bytes": value, "cold": {}, "warm": {}}
    base = statistics.median(r for r, _ in cold["pread"])
    for key, runs in cold.items():
        rate = statistics.median(r for r, _ in runs)
        per = statistics.median(b for _, b in runs) / (n if key in ("ds.loader", "DataLoader") else part)
        out["cold"][key] = {
            "rate": rate,
            "spread": (min(r for r, _ in runs), max(r for r, _ in runs)),
            "ratio": rate / base,
            "bytes_per_sample": per,
            "bytes_ratio": per / value,
        }
    wbase = statistics.median(warm["pread"])
    for key, rates in warm.items():
        out["warm"][key] = {"rate": statistics.median(rates), "ratio": statistics.median(rates) / wbase}
    return out


def show(name: str, result: dict) -> None:
    packed = f", pack={result['pack']}" if result["pack"] else ""
    read = f", {result['read']:,} random reads a ds[i]/pread pass" if result["read"] < result["n"] else ""
    print(f"{name}: {result['n']} samples{packed}{read}, stored value {result['value_bytes']:,.0f} bytes")
    for key, r in result["cold"].items():
        lo, hi = r["spread"]
        print(
            f"  cold {key:16s} {r['rate']:9,.0f}/s ({lo:,.0f}-{hi:,.0f})  {r['ratio']:5.2f}x pread  "
            f"{r['bytes_per_sample']:10,.0f} B read/sample ({r['bytes_ratio']:.2f}x value)"
        )
    for key, r in result["warm"].items():
        print(f"  warm {key:16s} {r['rate']:9,.0f}/s  {r['ratio']:5.2f}x pread")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n-big", type=int, default=1500)
    parser.add_argument("--n-small", type=int, default=20000)
    parser.add_argument("--dir", default=None, help="where the caches go (default: a temporary directory)")
    parser.add_argument("--pack", type=int, default=0, help="pack the 3x32x32 cache by this many samples (0: off)")
    parser.add_argument(
        "--fraction",
        type=float,
        default=1.0,
        help="the ds[i]/pread passes read this fraction of the indices (below 1: each pack mostly read once, as in "
        "a cache larger than RAM)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        if args.n_big:
            show("3x224x224", workload(work, "big", args.n_big, (3, 224, 224), args.reps))
        if args.n_small:
            show("3x32x32", workload(work, "small", args.n_small, (3, 32, 32), args.reps, args.pack, args.fraction))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
