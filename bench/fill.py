"""Where a first epoch's time goes (issue 24's first-epoch row): one lazy fill per fresh process, by thread.

    python -m bench.fill [--workload dict] [--n 300] [--reps 3] [--shuffled]

Each repetition is a fresh interpreter, as a real first epoch is (glibc's malloc thresholds, the committer
thread and LMDB's environment all new: ``bench.run`` fills several caches in one process, and a later fill
there can run on memory an earlier one left, see docs/benchmarks.md). The child reads the source over the
order once (warm), times it again (the baseline), then fills an empty cache through ``ds[i]`` in the same
order, ``flush`` included. Per sample it reports the wall clock of both and their ratio, and, for the fill,
the CPU and minor page faults of the main thread and of the committer thread (``Writer._write_batch``
wrapped: a private method, so this script follows the store's internals), and the commits. Medians of the
repetitions, min-max beside; ``uptime``'s load is printed first: on a busy machine the CPU and fault
counts hold where the wall clock does not.
"""

from __future__ import annotations

import argparse
import json
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

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {
    "bare_us": "bare source, wall",
    "fill_us": "fill, wall",
    "main_cpu_us": "fill, main thread CPU",
    "committer_cpu_us": "fill, committer CPU",
    "main_faults": "main thread page faults",
    "committer_faults": "committer page faults",
}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def child(workload: str, n: int, shuffled: bool, data: Path) -> dict[str, Any]:
    """One first epoch in this (fresh) process; figures per sample."""
    import torch

    torch.set_num_threads(1)
    import lmdbcache
    from lmdbcache.store import _write

    from .workloads import Workload

    committer = {"cpu": 0.0, "faults": 0, "commits": 0}
    write_batch = _write.Writer._write_batch

    def counted(self: Any, batch: list[tuple[int, bytes]]) -> int:
        cpu, faults = time.thread_time(), _faults()
        try:
            return write_batch(self, batch)
        finally:
            committer["cpu"] += time.thread_time() - cpu
            committer["faults"] += _faults() - faults
            committer["commits"] += 1

    _write.Writer._write_batch = counted  # type: ignore[method-assign]
    source = Workload(workload, n, data).source()
    order = list(range(len(source)))
    if shuffled:
        random.Random(0).shuffle(order)
    for i in order:  # warm: the source's files and code, read right before the baseline is timed
        source[i]
    start = time.perf_counter()
    for i in order:
        source[i]
    bare = time.perf_counter() - start
    path = tempfile.mkdtemp(prefix="bench-fill-")
    try:
        ds = lmdbcache.CachedDataset(source, os.path.join(path, "cache"), spot_check=0)
        cpu, faults, start = time.thread_time(), _faults(), time.perf_counter()
        for i in order:
            ds[i]
        ds.flush()
        fill = time.perf_counter() - start
        cpu, faults = time.thread_time() - cpu, _faults() - faults
        ds.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    k = len(order)
    return {
        "bare_us": bare / k * 1e6,
        "fill_us": fill / k * 1e6,
        "ratio": bare / fill,
        "main_cpu_us": cpu / k * 1e6,
        "committer_cpu_us": committer["cpu"] / k * 1e6,
        "main_faults": faults / k,
        "committer_faults": committer["faults"] / k,
        "commits": committer["commits"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="dict", choices=["dict", "png", "jpeg"])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shuffled", action="store_true")
    parser.add_argument("--data", type=Path, default=ROOT / "bench" / "work" / "data")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.workload, args.n, args.shuffled, args.data)
        print(json.dumps(result))
        return result
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores, {args.workload} n={args.n}", flush=True)
    rows = []
    for _ in range(args.reps):
        argv_child = [sys.executable, "-m", "bench.fill", "--child", "--workload", args.workload, "--n", str(args.n)]
        argv_child += ["--data", str(args.data)] + (["--shuffled"] if args.shuffled else [])
        out = subprocess.run(argv_child, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(f"bench.fill child failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {key: statistics.median(r[key] for r in rows) for key in [*FIELDS, "ratio", "commits"]}
    for key, label in FIELDS.items():
        values = [r[key] for r in rows]
        unit = "" if key.endswith("faults") else " us"
        print(f"  {label:26s} {summary[key]:9.1f}{unit} per sample ({min(values):.1f}-{max(values):.1f})")
    ratios = [r["ratio"] for r in rows]
    print(f"  fill / bare: {summary['ratio']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    return {"rows": rows, "median": summary}


if __name__ == "__main__":
    main()
