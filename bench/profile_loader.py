"""Where ``ds.loader`` (2 threads) spends an epoch of 3x224x224 against the 2-thread memcpy row (issue 16).

    python -m bench.profile_loader [--reps 5] [--n 2000] [--cprofile]

Builds the bench.loader workload (2,000 random 3x224x224 uint8 samples, a .npy and a warm
cache), times ``ds.loader(64, num_threads=2)``, the 2-thread memcpy row and raw py-lmdb
(2 threads) interleaved, then runs instrumented epochs: the lmdbcache functions on the
planner's path are wrapped (in this process only, the package is not changed) to add up the
wall time of each part per batch:

- lookup: ``Reader.read_batch`` outside its ``copy`` callback (lock, read transaction,
  one ``txn.get`` per index, the verified flags);
- ring: ``Ring.acquire`` (the slot checks: use counts, refcounts, data pointers);
- copy: the planner's wait for the copy threads (``Buffers.fill`` on both), and, summed over
  the threads, the time inside ``_memmove`` and inside ``xxh3`` (structure and data checksums);
- batch: ``Buffers.batch`` (the views handed out);
- handoff: the planner's ``put`` into the queue and the consumer's wait in ``get``.

The instrumentation's own cost (a Python wrapper per call) is in the figures: the
instrumented epoch rate is printed beside the plain one. ``--cprofile`` also prints the top of
a cProfile of the planner thread for one epoch.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch

from lmdbcache import CachedDataset
from lmdbcache.loader import _gather, _pass
from lmdbcache.store import _read

from .loader import BATCH, Rows, cache_loader, memcpy, raw_lmdb, read_through, time_epoch, write_raw_lmdb

TIMES: dict[str, float] = defaultdict(float)
LOCK = threading.Lock()


def add(part: str, seconds: float) -> None:
    with LOCK:
        TIMES[part] += seconds


def timed_fn(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(part, time.perf_counter() - start)

    return wrapper


def instrument() -> Callable[[], None]:
    """Wrap the parts; returns the function that unwraps them."""
    saved = [
        (_read.Reader, "read_batch", _read.Reader.read_batch),
        (_pass.Ring, "acquire", _pass.Ring.acquire),
        (_gather.Buffers, "fill", _gather.Buffers.fill),
        (_gather.Buffers, "batch", _gather.Buffers.batch),
        (_gather, "_memmove", _gather._memmove),
        (_gather, "_xxh3", _gather._xxh3),
        (_pass.Pass, "_put", _pass.Pass._put),
        (_pass.Pass, "get", _pass.Pass.get),
        (_pass, "wait", _pass.wait),
    ]
    read_batch = _read.Reader.read_batch

    def read_batch_timed(self: Any, indices: list[int], always: bool, build: Any, copy: Any) -> Any:
        inside = [0.0]

        def copy_timed(views: list[Any], checks: list[bool]) -> Any:
            start = time.perf_counter()
            try:
                return copy(views, checks)
            finally:
                inside[0] += time.perf_counter() - start

        start = time.perf_counter()
        try:
            return read_batch(self, indices, always, build, copy_timed)
        finally:
            add("lookup (read_batch minus copy)", time.perf_counter() - start - inside[0])
            add("planner: copy callback total", inside[0])

    _read.Reader.read_batch = read_batch_timed  # type: ignore[method-assign]
    _pass.Ring.acquire = timed_fn("ring acquire", _pass.Ring.acquire)  # type: ignore[method-assign]
    _gather.Buffers.fill = timed_fn("threads: fill (sum over threads)", _gather.Buffers.fill)  # type: ignore[method-assign]
    _gather.Buffers.batch = timed_fn("batch views", _gather.Buffers.batch)  # type: ignore[method-assign]
    _gather._memmove = timed_fn("threads: memmove (sum)", _gather._memmove)
    _gather._xxh3 = timed_fn("threads: xxh3 checksums (sum)", _gather._xxh3)
    _pass.Pass._put = timed_fn("planner: queue put (waits while the queue is full)", _pass.Pass._put)  # type: ignore[method-assign]
    _pass.Pass.get = timed_fn("consumer: queue get (waits for a batch)", _pass.Pass.get)  # type: ignore[method-assign]
    _pass.wait = timed_fn("planner: wait for the copy threads", _pass.wait)

    def undo() -> None:
        for owner, name, fn in saved:
            setattr(owner, name, fn)

    return undo


def planner_profile(ds: CachedDataset, cache: Path) -> str:
    """cProfile of the planner thread over one epoch."""
    profile = cProfile.Profile()
    plan = _pass.Pass._plan

    def plan_profiled(self: Any) -> None:
        profile.enable()
        try:
            plan(self)
        finally:
            profile.disable()

    _pass.Pass._plan = plan_profiled  # type: ignore[method-assign]
    try:
        read_through(cache)
        loader = ds.loader(BATCH, shuffle=True, num_threads=2)
        for _ in loader:
            pass
        loader.close()
    finally:
        _pass.Pass._plan = plan  # type: ignore[method-assign]
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, shape = args.n, (3, 224, 224)
    with tempfile.TemporaryDirectory(prefix="lmdbcache-profile-loader-") as tmp:
        root = Path(tmp)
        npy = root / "rows.npy"
        out = np.lib.format.open_memmap(npy, mode="w+", dtype=np.uint8, shape=(n, *shape))
        out[:] = np.random.default_rng(0).integers(0, 256, size=(n, *shape), dtype=np.uint8)
        out.flush()
        del out
        cache, raw = root / "c.lmdb", root / "raw.lmdb"
        ds = CachedDataset(Rows(str(npy)), cache, map_size=1 << 30)
        for k in range(0, n, 512):
            ds.__getitems__(list(range(k, min(n, k + 512))))
        ds.flush()
        write_raw_lmdb(str(npy), raw)
        env = lmdb.open(str(raw), readonly=True, lock=False)
        systems: list[tuple[str, Callable[[int], Iterator[torch.Tensor]], list[Path]]] = [
            ("ds.loader, 2 threads", cache_loader(ds, 2), [cache]),
            ("memcpy, 2 threads", memcpy(str(npy), 2), [npy]),
            ("raw py-lmdb, 2 threads", raw_lmdb(env, n, shape, 2), [raw]),
        ]
        for _, run, files in systems:
            time_epoch(run, n, 0, files)
        rates: list[list[float]] = [[] for _ in systems]
        for epoch in range(1, args.reps + 1):
            for k, (_, run, files) in enumerate(systems):
                rates[k].append(time_epoch(run, n, epoch, files))
        batches = -(-n // BATCH)
        print(f"3x224x224, {n} samples, batch {BATCH}, median of {args.reps} epochs:")
        for (label, _, _), r in zip(systems, rates):
            med = statistics.median(r)
            print(f"  {label:24s} {med:9,.0f}/s  {BATCH / med * 1e6:7.0f} us/batch")
        undo = instrument()
        instrumented = []
        try:
            for epoch in range(args.reps):
                TIMES.clear()
                instrumented.append((time_epoch(systems[0][1], n, 100 + epoch, [cache]), dict(TIMES)))
        finally:
            undo()
        rate, parts = sorted(instrumented, key=lambda x: x[0])[len(instrumented) // 2]
        print(f"instrumented ds.loader epoch (the median one): {rate:,.0f}/s, {BATCH / rate * 1e6:.0f} us/batch")
        for part, seconds in sorted(parts.items()):
            print(f"  {part:55s} {seconds / batches * 1e6:8.1f} us/batch")
        if args.cprofile:
            print(planner_profile(ds, cache))
        ds.close()
        env.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
