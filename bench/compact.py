"""Compact by default (issue #25): the default lazy path's disk and memory over payload, two libraries in one run.

    python bench/compact.py --baseline /work/main [--lib .] [--reps 3] [--n 20000] [--n-jpeg 1000]

For samples of (uint8 tensor, int) of 1 KiB, 3 KiB, 6 KiB and jpeg-sized (147 KiB), each library
(``--baseline``: a checkout of today's main, ``--lib``: the one under test, each run in child processes
with its own ``PYTHONPATH``, measurements interleaved) is timed and measured on:

- disk: the bytes of the cache directory over the payload (the tensors' bytes) after a shuffled lazy
  fill through ``ds[i]`` by one process, then close (``CachedDataset(src, path)``, no options);
- disk, 2 workers: the same filled by a shuffled epoch of a ``DataLoader`` with 2 workers;
- PSS: the proportional set size of the cache file's mapping (``data.mdb`` in ``/proc/<pid>/smaps``),
  summed over a reader's main process and its 2 DataLoader workers after a shuffled epoch over the
  whole cache, over the payload (the page cache a reader holds for its data);
- fill: samples/s of the first (filling) epoch of the one-process fill, over wall time and over the
  process's CPU time (``fill_cpu``: every thread, the committer's included; steadier on a loaded machine);
- warm reads: samples/s of a shuffled pass of ``ds[i]`` over a cache this process has read whole
  just before (``warm_cpu``: over CPU time); loader: samples/s of a shuffled warm epoch of
  ``ds.loader(batch_size=256)``.

Each figure is the median of ``--reps`` (each rep a new fill in a new directory); the ratios of
``--lib`` over ``--baseline`` are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = {"1KiB": (1024,), "3KiB": (3, 32, 32), "6KiB": (2, 3, 32, 32), "jpeg": (3, 224, 224)}


def _source(n: int, shape: tuple[int, ...]) -> Any:
    import torch
    from torch.utils.data import Dataset

    class Tensors(Dataset[Any]):
        """(uint8 tensor of ``shape``, index): a cheap deterministic source."""

        def __init__(self) -> None:
            self.base = torch.randint(0, 256, (int(torch.tensor(shape).prod()) + 4096,), dtype=torch.uint8)

        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> Any:
            if not 0 <= i < n:
                raise IndexError(i)
            start = (i * 7919) % 4096
            return self.base[start : start + self.base.numel() - 4096].reshape(shape).clone(), i

    return Tensors()


def _disk(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def _mapped_pss(pid: int) -> int:
    """The PSS (bytes) of ``pid``'s mappings of a ``data.mdb``."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = line.rstrip().endswith("data.mdb")
            elif inside and line.startswith("Pss:"):
                total += int(head[1]) * 1024
    return total


def child_fill(path: str, n: int, size: str, workers: int) -> dict[str, float]:
    """A shuffled lazy fill of a new cache at ``path``: ds[i] in this process, or a DataLoader epoch."""
    import torch

    from lmdbcache import CachedDataset

    ds = CachedDataset(_source(n, SIZES[size]), path)
    start, cpu = time.perf_counter(), _cpu()
    if workers:
        loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=workers)
        for _ in loader:
            pass
    else:
        order = list(range(n))
        random.Random(1).shuffle(order)
        for i in order:
            ds[i]
    ds.close()
    elapsed, cpu = time.perf_counter() - start, _cpu() - cpu
    return {"fill": n / elapsed, "fill_cpu": n / cpu, "disk": _disk(path)}


def _cpu() -> float:
    """CPU seconds of this process so far, every thread (the committer's included): steadier than wall time on a
    loaded machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_read(path: str, n: int) -> dict[str, float]:
    """Warm ds[i] reads and a warm loader epoch over the cache at ``path``."""
    from lmdbcache import CachedDataset

    ds = CachedDataset.open(path)
    order = list(range(n))
    random.Random(2).shuffle(order)
    for i in order:
        ds[i]
    random.Random(3).shuffle(order)
    start, cpu = time.perf_counter(), _cpu()
    for i in order:
        ds[i]
    warm, warm_cpu = n / (time.perf_counter() - start), n / (_cpu() - cpu)
    loader = ds.loader(batch_size=256, shuffle=True)
    for _ in loader:
        pass
    start = time.perf_counter()
    for _ in loader:
        pass
    batches = n / (time.perf_counter() - start)
    ds.close()
    return {"warm": warm, "warm_cpu": warm_cpu, "loader": batches}


def child_pss(path: str) -> dict[str, float]:
    """The data.mdb PSS of this process and its 2 DataLoader workers after a shuffled epoch over the cache."""
    import torch

    from lmdbcache import CachedDataset

    ds = CachedDataset.open(path)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True)
    it = iter(loader)
    for _ in it:
        pass
    pids = [os.getpid()] + [w.pid for w in it._workers]  # type: ignore[attr-defined]
    pss = sum(_mapped_pss(pid) for pid in pids)
    del it, loader
    return {"pss": pss}


def _run(lib: str, *args: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=lib)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _measure(lib: str, work: Path, size: str, n: int, rep: int) -> dict[str, float]:
    payload = n * math.prod(SIZES[size])
    path = str(work / f"{size}-{rep}-1")
    one = _run(lib, "fill", path, str(n), size, "0")
    figures = {"disk": one["disk"] / payload, "fill": one["fill"], "fill_cpu": one["fill_cpu"]}
    figures.update(_run(lib, "read", path, str(n)))
    figures["pss"] = _run(lib, "pss", path)["pss"] / payload
    shutil.rmtree(path)
    path = str(work / f"{size}-{rep}-2")
    figures["disk_workers"] = _run(lib, "fill", path, str(n), size, "2")["disk"] / payload
    shutil.rmtree(path)
    return figures


FIELDS = ("disk", "disk_workers", "pss", "fill", "fill_cpu", "warm", "warm_cpu", "loader")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="a checkout of the library to compare against")
    parser.add_argument("--lib", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--n-jpeg", type=int, default=1000)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    args = parser.parse_args(argv)
    libs = {"lib": args.lib} | ({"baseline": args.baseline} if args.baseline else {})
    work = Path(tempfile.mkdtemp(prefix="lmdbcache-compact-"))
    results: dict[str, Any] = {}
    print(
        f"load {os.getloadavg()[0]:.2f}; disk and PSS over payload; fill, warm, loader: samples/s; "
        f"median of {args.reps}"
    )
    print("| size | library | " + " | ".join(FIELDS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in FIELDS) + " |")
    try:
        for size in args.sizes:
            n = args.n_jpeg if size == "jpeg" else args.n
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in libs}
            for rep in range(args.reps):
                for name, lib in libs.items():  # interleaved: both see the same machine
                    runs[name].append(_measure(lib, work, size, n, rep))
            row = {name: {f: statistics.median(r[f] for r in runs[name]) for f in FIELDS} for name in libs}
            for name in libs:
                cells = [f"{row[name][f]:.3f}x" if f in FIELDS[:3] else f"{row[name][f]:,.0f}" for f in FIELDS]
                print(f"| {size} | {name} | " + " | ".join(cells) + " |", flush=True)
            if "baseline" in row:
                ratios = [row["lib"][f] / row["baseline"][f] for f in FIELDS]
                print(f"| {size} | lib / baseline | " + " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)
            results[size] = row
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    sys.path.pop(0)  # bench/ itself: its modules must not shadow any (a child imports lmdbcache from PYTHONPATH)
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "fill":
            result = child_fill(rest[0], int(rest[1]), rest[2], int(rest[3]))
        elif kind == "read":
            result = child_read(rest[0], int(rest[1]))
        else:
            result = child_pss(rest[0])
        print(json.dumps(result))
    else:
        main()
