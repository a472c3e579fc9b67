"""``make bench``: lmdbcache against the alternatives users would pick, side by side, one run.

    python -m bench.run [--tiny] [--reps 3] [--jpeg 1000] [--small 20000] [--dict 200]
                        [--png 20000] [--miss 20000] [--systems ...] [--workloads ...] [--out bench/results]

For each workload (see bench/workloads.py) and system (bench/systems.py) it measures:
first-epoch samples/s (the fill, or the conversion); warm samples/s in one process (random
order, a warm-up pass right before each timed pass, systems interleaved in every
repetition); warm samples/s through a DataLoader (batch 64, 2 persistent workers); the
summed PSS of the main process and its workers after that; and, for systems that persist,
a fresh Python process reusing what was built (time to the first sample, then one pass).
Ratios are against memmap and bare from the same run; figures are medians of --reps
repetitions with their spread. Writes latest.md, latest.json and latest.png.

First epochs (``first_epochs``): the fill through an empty CachedDataset against the bare
source, interleaved, --reps times each, in index order and shuffled, on the CIFAR-like
``png`` workload and on ``jpeg`` and ``dict``; and the cost of one miss above a trivial
source (an in-memory uint8 array of 1, 3 and 6 KiB per sample, with an int label).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .systems import NOTES, SYSTEMS
from .workloads import Workload

ROOT = Path(__file__).resolve().parent.parent
TARGETS_NOTE = "lmdbcache targets (issue #4)"
MEMORY_NOTE = " ".join(
    [
        "- **PSS total / over bare**: summed PSS (proportional set size, /proc/PID/smaps_rollup) of the main",
        "process and all its children after the timed DataLoader epochs, minus the same sum for `bare` (three",
        "Python and torch runtimes). Pages shared by several processes count once in the sum, so one shared copy",
        "of the data shows as 1× payload, a copy per worker as 2×. PSS sees only memory mapped into a process:",
        "diskcache reads its files with read(), so its copy in the page cache does not show here; samples over",
        "~2 KB take whole 4 KiB LMDB pages, so lmdbcache's 3 KiB `small` samples cost 4 KiB each (1.3×); and",
        "freed decode buffers that a worker's allocator keeps count too.",
    ]
)


def machine() -> dict:
    import lmdb
    import numpy

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = {"python": platform.python_version(), "torch": torch.__version__, "lmdb": lmdb.__version__}
    versions["numpy"] = numpy.__version__
    import lmdbcache

    versions["lmdbcache"] = lmdbcache.__version__
    for name in ("datasets", "diskcache", "kappadata"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": mem,
        "platform": platform.platform(),
        "versions": versions,
    }


def _rate(ds, order) -> float:
    start = time.perf_counter()
    for i in order:
        ds[i]
    return len(order) / (time.perf_counter() - start)


def _forked(mode: str, system: str, workload: Workload, root: Path, reps: int, conn) -> None:
    from . import child

    try:
        result = child.loader(system, workload, root, reps) if mode == "loader" else child.fresh(system, workload, root)
        conn.send(json.dumps(result))
    finally:
        conn.close()


def _child(mode: str, system: str, workload: Workload, root: Path, reps: int, fork: bool = False) -> dict:
    """One system in its own process: a fresh interpreter, or (``--tiny``) a fork, which saves the imports."""
    if fork:
        import multiprocessing

        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_forked, args=(mode, system, workload, root, reps, send))
        process.start()
        send.close()
        try:
            return json.loads(receive.recv())
        except EOFError:
            raise RuntimeError(f"bench child {mode} {system} {workload.name} died (exit {process.exitcode})") from None
        finally:
            process.join()
            receive.close()
    argv = [sys.executable, "-m", "bench.child", mode, system, workload.name, str(workload.n), str(workload.data)]
    result = subprocess.run([*argv, str(root), str(reps)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"bench.child {mode} {system} {workload.name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run_workload(workload: Workload, systems: list, work: Path, reps: int, log, fork: bool = False) -> dict:
    source = workload.source()
    payload = workload.payload_bytes(source)
    out: dict = {"n": workload.n, "payload_bytes": payload, "systems": {}}
    built = {}
    for system in systems:
        root = work / "runs" / workload.name / system.name
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        start = time.perf_counter()
        built[system.name] = system.fill(workload, source, root)
        rate = workload.n / (time.perf_counter() - start)
        out["systems"][system.name] = {"first_epoch": rate}
        log(f"  {workload.name:5s} {system.name:17s} first epoch {rate:>10,.0f}/s")
    warm: dict[str, list[float]] = {name: [] for name in built}
    order = list(range(workload.n))
    for rep in range(reps):
        random.Random(rep).shuffle(order)
        for name, ds in built.items():
            _rate(ds, order)  # brings this system's pages back right before it is timed
            warm[name].append(_rate(ds, order))
    for name, rates in warm.items():
        out["systems"][name]["warm_1proc"] = _stats(rates)
        log(f"  {workload.name:5s} {name:17s} warm, one process {statistics.median(rates):>10,.0f}/s")
    for system in systems:
        system.close(built.pop(system.name))
    for system in systems:
        root = work / "runs" / workload.name / system.name
        result = _child("loader", system.name, workload, root, reps, fork)
        entry = out["systems"][system.name]
        entry["warm_loader"] = _stats(result["rates"])
        entry["pss_bytes"] = result["pss"]
        entry["pss_by_process"] = result["pss_by_process"]
        log(
            f"  {workload.name:5s} {system.name:17s} DataLoader {entry['warm_loader']['median']:>10,.0f}/s, "
            f"PSS {result['pss'] / 2**20:,.0f} MiB"
        )
        if system.persistent:
            fresh = [_child("fresh", system.name, workload, root, 1, fork) for _ in range(reps)]
            entry["fresh_first_sample_s"] = _stats([f["first_sample_s"] for f in fresh])
            entry["fresh_rate"] = _stats([f["rate"] for f in fresh])
            log(f"  {workload.name:5s} {system.name:17s} fresh process {entry['fresh_rate']['median']:>10,.0f}/s")
    bare_pss = out["systems"].get("bare", {}).get("pss_bytes")
    for entry in out["systems"].values():
        if bare_pss is not None:
            entry["pss_over_bare_bytes"] = entry["pss_bytes"] - bare_pss
            entry["pss_over_bare_x_payload"] = (entry["pss_bytes"] - bare_pss) / payload
    return out


# First-epoch targets: the fill / bare ratio for a workload (issue #11), and microseconds per miss.
FIRST_EPOCH_TARGETS = {"png": 0.9, "jpeg": 0.95, "dict": 0.9}
MISS_TARGET_US = 15.0
MISS_SIZES = {"1 KiB": (1, 32, 32), "3 KiB": (3, 32, 32), "6 KiB": (6, 32, 32)}


def _fill_rate(source, order: list[int], path: Path) -> float:
    """One first epoch through an empty cache: every index once, then the last commit (flush), timed."""
    import lmdbcache

    ds = lmdbcache.CachedDataset(source, path, spot_check=0)
    start = time.perf_counter()
    for i in order:
        ds[i]
    ds.flush()
    rate = len(order) / (time.perf_counter() - start)
    ds.close()
    shutil.rmtree(path)
    return rate


def first_epochs(work: Path, sizes: dict[str, int], reps: int, log) -> dict:
    """Fill vs bare (in order and shuffled), and per-miss overhead on a trivial source; interleaved, medians."""
    from .workloads import ArrayDataset, tensor_data

    out: dict = {"workloads": {}, "miss_us": {}}
    scratch = work / "runs" / "first-epoch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for name in ("png", "jpeg", "dict"):
        workload = Workload(name, sizes[name], work / "data")
        source = workload.source()
        entry = out["workloads"][name] = {"n": workload.n}
        for shuffled in (False, True):
            order = list(range(workload.n))
            bare, fill = [], []
            for rep in range(reps):
                if shuffled:
                    random.Random(rep).shuffle(order)
                bare.append(_rate(source, order))
                fill.append(_fill_rate(source, order, scratch / "cache.lmdb"))
            key = "shuffled" if shuffled else "in_order"
            ratios = [f / b for f, b in zip(fill, bare)]
            entry[key] = {"bare": _stats(bare), "fill": _stats(fill), "ratio": statistics.median(ratios)}
            log(
                f"  first epoch {name:5s} {key:9s} bare {statistics.median(bare):>9,.0f}/s  "
                f"lmdbcache {statistics.median(fill):>9,.0f}/s  ({entry[key]['ratio']:.2f}x)"
            )
    n = sizes["miss"]
    for label, shape in MISS_SIZES.items():
        source = ArrayDataset(tensor_data(n, shape))
        order = list(range(n))
        bare, fill = [], []
        for _ in range(reps):
            bare.append(_rate(source, order))
            fill.append(_fill_rate(source, order, scratch / "cache.lmdb"))
        over = [1e6 / f - 1e6 / b for f, b in zip(fill, bare)]
        out["miss_us"][label] = {
            "bare_us": statistics.median(1e6 / b for b in bare),
            "fill_us": statistics.median(1e6 / f for f in fill),
            "over_us": _stats(over),
        }
        log(
            f"  per miss {label}: bare {out['miss_us'][label]['bare_us']:.1f} us, through the cache "
            f"{out['miss_us'][label]['fill_us']:.1f} us: {statistics.median(over):.1f} us above the source"
        )
    shutil.rmtree(scratch, ignore_errors=True)
    return out


def _ratio(results: dict, workload: str, system: str, metric: str, base: str) -> float | None:
    systems = results["workloads"].get(workload, {}).get("systems", {})
    a, b = systems.get(system, {}).get(metric), systems.get(base, {}).get(metric)
    if a is None or b is None:
        return None
    return a["median"] / b["median"]


def targets(results: dict) -> list[tuple[str, bool | None, str]]:
    """(target, met or None when not measurable in this run, measured figure)."""
    out = []

    def add(text: str, value: float | None, ok: bool | None, shown: str) -> None:
        out.append((text, None if value is None else ok, shown if value is not None else "not measured in this run"))

    r = _ratio(results, "jpeg", "lmdbcache", "warm_1proc", "memmap")
    add("jpeg warm, one process >= 0.9x memmap", r, r is not None and r >= 0.9, f"{r:.2f}x" if r else "")
    r = _ratio(results, "jpeg", "lmdbcache", "warm_1proc", "bare")
    add("jpeg warm, one process >= 30x bare", r, r is not None and r >= 30, f"{r:.0f}x" if r else "")
    r = _ratio(results, "small", "lmdbcache", "warm_1proc", "memmap")
    add("small warm, one process >= 0.7x memmap", r, r is not None and r >= 0.7, f"{r:.2f}x" if r else "")
    for name, w in results["workloads"].items():
        entry = w["systems"].get("lmdbcache", {})
        x = entry.get("pss_over_bare_x_payload")
        add(
            f"{name}: memory with 2 workers, PSS over bare <= 1.1x payload",
            x,
            x is not None and x <= 1.1,
            f"{x:.2f}x ({entry.get('pss_over_bare_bytes', 0) / 2**20:,.0f} MiB over bare for "
            f"{w['payload_bytes'] / 2**20:,.0f} MiB payload)"
            if x is not None
            else "",
        )
        for metric, label in (("warm_1proc", "one process"), ("warm_loader", "DataLoader")):
            mine = entry.get(metric)
            peers = {
                p: w["systems"][p][metric]["median"]
                for p in ("diskcache", "hf-datasets", "kappadata")
                if p in w["systems"]
            }
            if mine is None or not peers:
                continue
            best = max(peers, key=lambda p: peers[p])
            ratio = mine["median"] / peers[best]
            add(
                f"{name}: warm {label} ahead of diskcache, HF datasets, kappadata",
                ratio,
                ratio > 1,
                f"{ratio:.1f}x the best peer ({best})",
            )
        r = _ratio(results, name, "lmdbcache", "fresh_rate", "memmap")
        if r is not None:
            add(f"{name}: fresh-process reuse >= 0.9x memmap's", r, r >= 0.9, f"{r:.2f}x")
    first = results.get("first_epochs", {})
    for name, target in FIRST_EPOCH_TARGETS.items():
        entry = first.get("workloads", {}).get(name)
        if entry is None:
            continue
        for key, label in (("in_order", "in order"), ("shuffled", "shuffled")):
            r = entry[key]["ratio"]
            add(f"{name}: first epoch (fill), {label}, >= {target}x bare", r, r >= target, f"{r:.2f}x")
    for label, entry in first.get("miss_us", {}).items():
        us = entry["over_us"]["median"]
        add(f"per-miss overhead, {label} samples, <= {MISS_TARGET_US:.0f} us", us, us <= MISS_TARGET_US, f"{us:.1f} us")
    return out


def _fmt_rate(entry: dict | None) -> str:
    if entry is None:
        return "—"
    return f"{entry['median']:,.0f} ({entry['min']:,.0f}–{entry['max']:,.0f})"


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# lmdbcache benchmark",
        "",
        f"{results['date']} · {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM · "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        "",
        f"Rerun: `{results['command']}` (took {results['seconds'] / 60:.1f} min). Samples/s are medians of "
        f"{results['reps']} repetitions (min–max in parentheses); ratios compare medians from this same run.",
        "",
    ]
    for name, w in results["workloads"].items():
        lines += [
            f"## {name}: {w['n']} samples, {w['payload_bytes'] / 2**20:,.1f} MiB decoded",
            "",
            "| system | first epoch /s | warm, 1 process /s | × memmap | × bare | warm, DataLoader 2 workers /s | "
            "PSS total / over bare (× payload) | fresh process: first sample | fresh process /s (× memmap) |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for system, e in w["systems"].items():
            vs_mm = _ratio(results, name, system, "warm_1proc", "memmap")
            vs_bare = _ratio(results, name, system, "warm_1proc", "bare")
            fresh_mm = _ratio(results, name, system, "fresh_rate", "memmap")
            over = e.get("pss_over_bare_bytes")
            memory = (
                "—"
                if over is None
                else f"{e['pss_bytes'] / 2**20:,.0f} / {over / 2**20:,.0f} MiB ({e['pss_over_bare_x_payload']:.2f}×)"
            )
            first = e.get("fresh_first_sample_s")
            first_text = "— (nothing persists)" if first is None else f"{first['median'] * 1000:,.0f} ms"
            lines.append(
                f"| {system} | {e['first_epoch']:,.0f} | {_fmt_rate(e.get('warm_1proc'))} | "
                f"{'—' if vs_mm is None else f'{vs_mm:.2f}'} | {'—' if vs_bare is None else f'{vs_bare:,.1f}'} | "
                f"{_fmt_rate(e.get('warm_loader'))} | {memory} | "
                f"{first_text} | "
                f"{_fmt_rate(e.get('fresh_rate'))}{'' if fresh_mm is None else f' ({fresh_mm:.2f}×)'} |"
            )
        lines.append("")
    first = results.get("first_epochs")
    if first:
        lines += [
            "## First epochs: filling an empty cache vs the bare source",
            "",
            "| workload | order | bare /s | lmdbcache fill /s (last commit included) | × bare |",
            "|---|---|--:|--:|--:|",
        ]
        for name, entry in first["workloads"].items():
            for key in ("in_order", "shuffled"):
                e = entry[key]
                lines.append(
                    f"| {name} ({entry['n']}) | {key.replace('_', ' ')} | {_fmt_rate(e['bare'])} | "
                    f"{_fmt_rate(e['fill'])} | {e['ratio']:.2f} |"
                )
        lines += ["", "| trivial source, per sample | bare µs | through the cache µs | µs per miss above the source |"]
        lines += ["|---|--:|--:|--:|"]
        for label, e in first["miss_us"].items():
            over = e["over_us"]
            lines.append(
                f"| {label} uint8 + int label | {e['bare_us']:.1f} | {e['fill_us']:.1f} | "
                f"{over['median']:.1f} ({over['min']:.1f}–{over['max']:.1f}) |"
            )
        lines.append("")
    lines += [f"## {TARGETS_NOTE}", ""]
    for text, ok, shown in targets(results):
        mark = "—" if ok is None else ("met" if ok else "**NOT MET**")
        lines.append(f"- {mark}: {text}: {shown}")
    if results["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {name}: {why}" for name, why in results["skipped"].items()]
    lines += ["", "## How to read this", ""]
    lines += [f"- **{name}**: {note}." for name, note in NOTES.items()]
    lines += [
        MEMORY_NOTE,
        "- **first epoch** is the fill through an empty cache (lazy caches) or the conversion (memmap, HF datasets), "
        "one process, random order; for bare it is just decoding.",
        "- **fresh process** opens what an earlier process built: time from opening to the first sample, then one "
        "pass in random order with the page cache warm but the process cold.",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    systems = [s.name for s in SYSTEMS if any(s.name in w["systems"] for w in results["workloads"].values())]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.2))
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
        rates = [
            results["workloads"][w]["systems"].get(system, {}).get("warm_1proc", {}).get("median", 0) for w in workloads
        ]
        memory = [
            max(results["workloads"][w]["systems"].get(system, {}).get("pss_over_bare_bytes", 0), 0) / 2**20
            for w in workloads
        ]
        axes[0].bar(xs, rates, width, label=system)
        axes[1].bar(xs, memory, width, label=system)
    for i, w in enumerate(workloads):
        payload = results["workloads"][w]["payload_bytes"] / 2**20
        axes[1].hlines(payload, i - 0.45, i + 0.45, colors="black", linestyles="dashed", linewidth=1)
    axes[0].set_yscale("log")
    axes[0].set_title("warm samples/s, one process, random order (log scale)")
    axes[1].set_title("memory over bare with 2 DataLoader workers, MiB (dashed: payload)")
    for ax in axes:
        ax.set_xticks(range(len(workloads)), workloads)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_yscale("symlog", linthresh=10)
    axes[0].legend(fontsize=8, ncol=2)
    m = results["machine"]
    fig.suptitle(f"lmdbcache benchmark · {m['cpu']}, {m['cores']} cores · {results['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="seconds-long run at tiny sizes (the test uses it)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--jpeg", type=int, default=None)
    parser.add_argument("--small", type=int, default=None)
    parser.add_argument("--dict", type=int, default=None)
    parser.add_argument("--png", type=int, default=None, help="samples of the first-epoch png workload")
    parser.add_argument("--miss", type=int, default=None, help="samples per per-miss overhead measurement")
    parser.add_argument("--no-first-epochs", action="store_true", help="skip the first-epoch section")
    parser.add_argument("--workloads", nargs="+", default=["jpeg", "small", "dict"])
    parser.add_argument("--systems", nargs="+", default=[s.name for s in SYSTEMS])
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "work")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    sizes = (
        {"jpeg": 24, "small": 256, "dict": 6, "png": 64, "miss": 256}
        if args.tiny
        else {"jpeg": 1000, "small": 20000, "dict": 200, "png": 20000, "miss": 20000}
    )
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    reps = args.reps or (1 if args.tiny else 3)
    torch.set_num_threads(1)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    start = time.perf_counter()
    skipped: dict[str, str] = {}
    systems = []
    for system in SYSTEMS:
        if system.name not in args.systems:
            continue
        why = system.unavailable()
        if why:
            skipped[system.name] = why
        else:
            systems.append(system)
    results: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "make bench"
        if argv is None and not args.tiny
        else "python -m bench.run " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "reps": reps,
        "skipped": skipped,
        "workloads": {},
    }
    for name in args.workloads:
        workload = Workload(name, sizes[name], args.work / "data")
        applicable = [s for s in systems if s.applies(workload)]
        log(f"{name}: {workload.n} samples, systems: {', '.join(s.name for s in applicable)}")
        results["workloads"][name] = run_workload(workload, applicable, args.work, reps, log, fork=args.tiny)
    if not args.no_first_epochs:
        log("first epochs: fill vs bare, and per-miss overhead")
        results["first_epochs"] = first_epochs(args.work, sizes, reps, log)
    results["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2))
    (args.out / "latest.md").write_text(markdown(results))
    plot(results, args.out / "latest.png")
    shutil.rmtree(args.work / "runs", ignore_errors=True)
    log(f"wrote {args.out / 'latest.md'}, latest.json, latest.png in {results['seconds'] / 60:.1f} min")
    return results


if __name__ == "__main__":
    main()
