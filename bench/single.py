"""Single reads (``ds[i]``) on the compiled core and the pure-Python path, against a numpy memmap (issue #24).

    python -m bench.single [--reps 3] [--root DIR] [--n-small 20000] [--n-big 2000] [--n-random 200000]
                           [--reads 100000] [--only warm,fresh,random] [--callgrind N]

Three figures, each path against ``np.array(mm[i])`` + ``torch.from_numpy`` of the same bytes from a
``.npy`` memmap, on a warm page cache (every file read through once before each group):

- warm: one process opens the cache (``CachedDataset.open``), reads every index once (its first reads:
  bounds and data checksum), then times shuffled passes of ``ds[i]``; the memmap's passes are timed in
  the same process, interleaved, so each repetition's ratio is measured in one run;
- fresh: a new process per repetition and per reader, imports done before the clock, reads every index
  once in shuffled order (a fresh process's first pass: every read is a first read);
- random: a new process per repetition and per reader reads ``--reads`` random indices (with
  replacement) of a cache of ``--n-random`` samples of 3x32x32, unpacked and packed by 64.
  Before the fresh and random rows, the cache and the .npy are dropped from the page cache and read back
  (``reread_files``), so both are laid out in memory as a read from disk leaves them.

"native" is the core, "python" the same code with ``LMDBCACHE_PURE_PYTHON=1``. Medians of the
repetitions, in microseconds per sample, min-max beside; the ratio is memmap time / path time (higher is
better, 1.0: as fast as the memmap), taken per repetition and reported as its median.

``--callgrind N`` instead counts instructions per sample with valgrind's callgrind (the machine is
too noisy to compare small differences by the clock): each reader reads N indices inside one call of
``sum`` (``--toggle-collect=builtin_sum``: only the reads are counted, never imports or setup), warm
(after a first pass) and fresh (the first pass itself), and random over the 200k caches.

Caches and memmaps are kept in ``--root`` (default /tmp/lmdbcache-bench-single) between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {  # name: (side, samples argument, pack)
    "s32": (32, "n_small", 0),
    "b224": (224, "n_big", 0),
    "r32": (32, "n_random", 0),
    "r32p64": (32, "n_random", 64),
}


# ------------------------------------------------------------------ building (once, kept in --root)


class _FromMemmap:
    """The source of a cache: ``(tensor, label)`` read from the memmap it is compared with."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.mm: Any = None

    def __len__(self) -> int:
        return int(np.load(self.path, mmap_mode="r").shape[0])

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.mm is None:
            self.mm = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.array(self.mm[i])), i % 1000


def _npy(root: str, side: int, n: int) -> str:
    path = os.path.join(root, f"img{side}x{n}.npy")
    if not os.path.exists(path):
        mm = np.lib.format.open_memmap(path + ".tmp", mode="w+", dtype=np.uint8, shape=(n, 3, side, side))
        rng = np.random.default_rng(side)
        for lo in range(0, n, 4096):
            hi = min(lo + 4096, n)
            mm[lo:hi] = rng.integers(0, 256, size=(hi - lo, 3, side, side), dtype=np.uint8)
        mm.flush()
        del mm
        os.replace(path + ".tmp", path)
    return path


def build(root: str, name: str, n: int) -> tuple[str, str]:
    """(cache directory, memmap file) of workload ``name`` with ``n`` samples, built if absent."""
    from lmdbcache import CachedDataset

    side, _, pack = WORKLOADS[name]
    npy = _npy(root, side, n)
    cache = os.path.join(root, f"{name}x{n}.lmdb")
    if not os.path.exists(os.path.join(cache, "done")):
        ds = CachedDataset(_FromMemmap(npy), cache, pack=pack, map_size=4 << 30, overwrite=True, fingerprint=name)
        for lo in range(0, n, 2048):
            ds.__getitems__(list(range(lo, min(lo + 2048, n))))
        ds.close()
        open(os.path.join(cache, "done"), "w").close()
    return cache, npy


def warm_files(*paths: str) -> None:
    """Read every file through once so the page cache holds it (the figures are warm ones)."""
    for path in paths:
        files = [os.path.join(path, "data.mdb")] if os.path.isdir(path) else [path]
        for name in files:
            with open(name, "rb") as f:
                while f.read(1 << 24):
                    pass


def reread_files(*paths: str) -> None:
    """Drop the files from the page cache (after a sync) and read them back, so both sides' pages are as a read
    from disk leaves them. A file's page cache keeps the shape its writes gave it: a .npy written in one call
    gets large folios, an LMDB file written a page at a time by its commits gets 4 KiB ones, and a fresh
    process's first touch of the map costs about 1.6x more for the latter (3x224x224: 34.7 against 20.5 us a
    sample, the same cache before and after this): a comparison of layouts, not of readers."""
    for path in paths:
        for name in [os.path.join(path, "data.mdb")] if os.path.isdir(path) else [path]:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    warm_files(*paths)


# ------------------------------------------------------------------ the children (fresh processes)


def _reader(reader: str, cache: str, npy: str) -> Any:
    """A ``read(i)`` of ``reader``: ``ds[i]`` of the cache (opened without its source) or the memmap's."""
    import torch

    if reader == "memmap":
        mm = np.load(npy, mmap_mode="r")
        from_numpy, array = torch.from_numpy, np.array
        return lambda i: (from_numpy(array(mm[i])), i % 1000)
    from lmdbcache import CachedDataset, _native

    assert (_native.core is not None) == (reader == "native"), (reader, _native.core)
    return CachedDataset.open(cache).__getitem__


def child(what: str, reader: str, cache: str, npy: str, n: int, reads: int, seed: int, reps: int) -> None:
    """Run one measurement in this (fresh) process and print its result as JSON."""
    read = _reader(reader, cache, npy)
    rng = random.Random(seed)
    if what == "random":
        order = [rng.randrange(n) for _ in range(reads)]
    else:
        order = list(range(n))
        rng.shuffle(order)
    clock = time.perf_counter
    if what != "warm":  # fresh, random: this process's first reads
        start = clock()
        for i in order:
            read(i)
        print(json.dumps({"us": (clock() - start) / len(order) * 1e6}))
        return
    memmap = _reader("memmap", cache, npy)
    for i in order:  # first reads: verified from now on
        read(i)
        memmap(i)
    times: dict[str, list[float]] = {reader: [], "memmap": []}
    for _ in range(reps):
        for name, fn in ((reader, read), ("memmap", memmap)):
            start = clock()
            for i in order:
                fn(i)
            times[name].append((clock() - start) / len(order) * 1e6)
    print(json.dumps(times))


def callgrind_child(what: str, reader: str, cache: str, npy: str, n: int, seed: int) -> None:
    """``n`` reads inside one ``sum`` (what callgrind counts); warm: after a first pass outside it."""
    read = _reader(reader, cache, npy)
    rng = random.Random(seed)
    order = [rng.randrange(n) for _ in range(n)] if what == "random" else rng.sample(range(n), n)
    if what == "warm":
        for i in order:
            read(i)
    count = sum(1 for _ in map(read, order))
    assert count == n


# ------------------------------------------------------------------ the parent


def _run(args: list[str], pure: bool, prefix: list[str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LMDBCACHE_PURE_PYTHON"}
    env["PYTHONPATH"] = ROOT
    if pure:
        env["LMDBCACHE_PURE_PYTHON"] = "1"
    cmd = [*(prefix or []), sys.executable, "-m", "bench.single", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr[-3000:]}")
    return out.stdout


def _measure(what: str, reader: str, cache: str, npy: str, n: int, reads: int, seed: int, reps: int) -> Any:
    args = ["--child", what, reader, cache, npy, str(n), str(reads), str(seed), str(reps)]
    return json.loads(_run(args, pure=reader == "python").splitlines()[-1])


def _row(label: str, path_us: list[float], memmap_us: list[float]) -> str:
    ratios = [m / p for p, m in zip(path_us, memmap_us)]
    med = statistics.median
    return (
        f"{label:<34} {med(path_us):7.2f} us ({min(path_us):.2f}-{max(path_us):.2f})   memmap {med(memmap_us):6.2f} us"
        f"   ratio {med(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
    )


def run_warm(root: str, args: argparse.Namespace) -> None:
    for name in ("s32", "b224"):
        n = getattr(args, WORKLOADS[name][1])
        cache, npy = build(root, name, n)
        for reader in ("native", "python"):
            warm_files(cache, npy)
            times = _measure("warm", reader, cache, npy, n, 0, 1, args.reps)
            print(_row(f"warm ds[i] {name} n={n} {reader}", times[reader], times["memmap"]), flush=True)


def run_fresh(root: str, what: str, names: tuple[str, ...], args: argparse.Namespace) -> None:
    for name in names:
        n = getattr(args, WORKLOADS[name][1])
        cache, npy = build(root, name, n)
        reread_files(cache, npy)  # both as read from disk (see reread_files)
        got: dict[str, list[float]] = {"memmap": [], "native": [], "python": []}
        for rep in range(args.reps):
            for reader in got:
                warm_files(cache, npy)
                got[reader].append(_measure(what, reader, cache, npy, n, args.reads, rep, 1)["us"])
        for reader in ("native", "python"):
            print(_row(f"{what} {name} n={n} {reader}", got[reader], got["memmap"]), flush=True)


def run_callgrind(root: str, args: argparse.Namespace) -> None:
    n = args.callgrind
    plan = [("warm", "s32"), ("warm", "b224"), ("fresh", "s32"), ("random", "r32"), ("random", "r32p64")]
    with tempfile.TemporaryDirectory() as out:
        for what, name in plan:
            size = getattr(args, WORKLOADS[name][1])
            cache, npy = build(root, name, size)
            warm_files(cache, npy)
            reads = min(n, size) if what != "random" else n
            line = []
            for reader in ("memmap", "native", "python"):
                cg = os.path.join(out, f"cg.{what}.{name}.{reader}")
                prefix = ["valgrind", "--tool=callgrind", "--toggle-collect=builtin_sum", f"--callgrind-out-file={cg}"]
                child_args = ["--callgrind-child", what, reader, cache, npy, str(reads if what != "random" else size)]
                _run([*child_args, str(reads)], pure=reader == "python", prefix=prefix)
                with open(cg) as f:
                    total = next(int(ln.split()[1]) for ln in f if ln.startswith(("summary:", "totals:")))
                line.append(f"{reader} {total / reads:,.0f}")
            print(f"callgrind {what} {name}: instructions per sample: " + ", ".join(line), flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        what, reader, cache, npy, n, reads, seed, reps = argv[1:]
        return child(what, reader, cache, npy, int(n), int(reads), int(seed), int(reps))
    if argv[:1] == ["--callgrind-child"]:
        what, reader, cache, npy, n, reads = argv[1:]
        return callgrind_random(what, reader, cache, npy, int(n), int(reads))
    p = argparse.ArgumentParser(prog="python -m bench.single", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "lmdbcache-bench-single"))
    p.add_argument("--n-small", type=int, default=20000)
    p.add_argument("--n-big", type=int, default=2000)
    p.add_argument("--n-random", type=int, default=200000)
    p.add_argument("--reads", type=int, default=100000)
    p.add_argument("--only", default="warm,fresh,random")
    p.add_argument("--callgrind", type=int, default=0, metavar="N")
    args = p.parse_args(argv)
    os.makedirs(args.root, exist_ok=True)
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    if args.callgrind:
        return run_callgrind(args.root, args)
    only = args.only.split(",")
    if "warm" in only:
        run_warm(args.root, args)
    if "fresh" in only:
        run_fresh(args.root, "fresh", ("s32", "b224"), args)
    if "random" in only:
        run_fresh(args.root, "random", ("r32", "r32p64"), args)
    print(f"load average {os.getloadavg()}", flush=True)


def callgrind_random(what: str, reader: str, cache: str, npy: str, size: int, reads: int) -> None:
    """``callgrind_child`` over a cache of ``size`` samples, ``reads`` reads (random: with replacement)."""
    if what != "random":
        return callgrind_child(what, reader, cache, npy, reads, 1)
    read = _reader(reader, cache, npy)
    rng = random.Random(1)
    order = [rng.randrange(size) for _ in range(reads)]
    count = sum(1 for _ in map(read, order))
    assert count == reads


if __name__ == "__main__":
    main(sys.argv[1:])
