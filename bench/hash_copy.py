"""A first read's copy and data checksum, in one process, paired per round (issue #24, the fresh-process pass).

    python -m bench.hash_copy [--reps 15] [--n 2000] [--side 224] [--root DIR] [--so NAME=PATH ...]

Each sample of a ``.npy`` map (3 x side x side uint8, ``--n`` of them, read through once so the page cache
holds them and this process maps every page) is copied into a reused buffer by:

- ``copy only``: the copy a memmap read does (``memcpy``), the baseline;
- ``copy, then xxh3_64``: the copy, then the checksum of the copy (the core before ``xxh3_64_copy``);
- ``xxh3_64_copy``: both in one pass over the bytes (the core's first read now);

and, with ``--so NAME=PATH``, ``xxh3_64_copy`` of other builds of the core (for example one compiled with
another ``COPY_AHEAD``; a build without it: its copy, then its ``xxh3_64``), loaded beside this one.
Set ``LMDBCACHE_HASH_SIMD=sse2`` to time the SSE2 loops.
Each round times every variant over all samples, in turn; medians of the rounds in microseconds per sample,
and the median of the per-round ratios to ``copy only`` (below 1.0: faster than the plain copy).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lmdbcache import _native


def _load(name: str, path: str) -> Any:
    """Another build of the core, imported under its own name beside ``lmdbcache._native._core``."""
    spec = importlib.util.spec_from_file_location(f"{name}._core", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _samples(root: str, side: int, n: int) -> list[memoryview]:
    from bench.single import _npy

    os.makedirs(root, exist_ok=True)
    mm = np.load(_npy(root, side, n), mmap_mode="r")
    flat, size = memoryview(mm.reshape(-1)), 3 * side * side
    return [flat[i * size : (i + 1) * size] for i in range(n)]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hash_copy", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--side", type=int, default=224)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "lmdbcache-bench-single"))
    p.add_argument("--so", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--shuffled", action="store_true", help="read the samples in a random order (seeded)")
    args = p.parse_args(argv)
    core = _native.core
    if core is None:
        raise SystemExit("the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")
    samples = _samples(args.root, args.side, args.n)
    dest = bytearray(len(samples[0]))

    def copy_only(i: int) -> None:
        dest[:] = samples[i]

    def copy_then_hash(i: int) -> None:
        dest[:] = samples[i]
        core.xxh3_64(dest, i)

    variants: dict[str, Callable[[int], Any]] = {
        "copy only": copy_only,
        "copy, then xxh3_64": copy_then_hash,
        "xxh3_64_copy": lambda i: core.xxh3_64_copy(dest, samples[i], i),
    }
    for spec in args.so:
        name, path = spec.split("=", 1)
        other = _load(name, path)
        if hasattr(other, "xxh3_64_copy"):
            variants[f"xxh3_64_copy of {name}"] = lambda i, other=other: other.xxh3_64_copy(dest, samples[i], i)
        else:  # a build before xxh3_64_copy: its copy, then its hash
            variants[f"copy, then xxh3_64 of {name}"] = lambda i, other=other: (copy_only(i), other.xxh3_64(dest, i))[1]
    for i in range(0, len(samples), 97):  # every variant gives the one-shot digest
        want = core.xxh3_64(samples[i], i)
        assert all(fn(i) in (None, want) for fn in variants.values()), i
    for i in range(len(samples)):  # every page mapped in before the clock
        copy_only(i)
    print(
        f"load average {os.getloadavg()}, hash loops: {core.HASH_SIMD}, prefetched {core.COPY_AHEAD} bytes ahead",
        flush=True,
    )
    order = list(range(len(samples)))
    if args.shuffled:
        random.Random(0).shuffle(order)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            for i in order:
                fn(i)
            times[name].append((time.perf_counter() - start) / len(samples) * 1e6)
    base = times["copy only"]
    for name, got in times.items():
        ratio = statistics.median([t / b for t, b in zip(got, base)])
        print(f"{name:<28} {statistics.median(got):7.2f} us ({min(got):.2f}-{max(got):.2f})   / copy only {ratio:.3f}")
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
