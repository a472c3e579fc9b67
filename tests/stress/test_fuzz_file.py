"""A damaged data.mdb never crashes the reader and never yields wrong data: a fuzz of cache files.

One small cache (small ``(tensor, int)`` tuples, 40-56 KB tensors stored on LMDB overflow pages,
dict samples) is built once. Each seed copies its data.mdb and damages the copy one way: 1-8
flipped bits, a zeroed or random range (1..4096 bytes, or one whole page), a truncation (page
aligned or not), or a page spliced over another. Offsets are aimed a third of the time anywhere,
a third in LMDB's own pages (meta, branch, leaf) and a third in the bytes LMDB trusts without
checking them (page headers, node pointers, node headers, keys, page numbers, database records).
A forked child per seed (so a signal is charged to its seed) opens the copy with
``CachedDataset.open``, reads every index one by one and as one batch, ``len()``,
``cached_count`` and ``tools.info``. Each result is one of:

    ok        every read returned data equal to the original
    library   an ``LmdbCacheError`` was raised (the cache is refused, or the index is)
    wrong     data not equal to the original was returned silently (a sample, the length, a count)
    raw       an exception that is not an ``LmdbCacheError`` escaped (lmdb.Error, KeyError, ...)
    signal    the child died from a signal (SIGSEGV, SIGBUS, SIGABRT)
    hang      the child did not finish within CHILD_TIMEOUT seconds

Only ``ok`` and ``library`` are acceptable. On failure the test prints a table of reproducers.
Reproduce seeds with ``LMDBCACHE_FUZZ_SEEDS=12,40-45 pytest tests/stress/test_fuzz_file.py -s``
(the page layout, hence what a seed hits, changes when the value format does). The damaged
copies of the first failing seeds are kept (their path is printed), with ``faulthandler.txt``
holding the Python stack of a child that died from a signal. Damage that random offsets rarely
hit (a key turned into another index, a value pointing at another sample's pages, a length past
the end of the file, an entry count) has its own deterministic tests at the end.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import json
import os
import random
import shutil
import signal
import struct
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import STRESS, scaled
from helpers import Listed, assert_same, sample_for
from torch.utils.data._utils.collate import default_collate

import lmdbcache
from lmdbcache import CachedDataset, LmdbCacheError, tools
from lmdbcache.store import _registry

N = 40
FINGERPRINT = "fuzz"
PAGE = 4096
CHILD_TIMEOUT = 20.0  # seconds; a child still running then counts as a hang
JOBS = min(2, os.cpu_count() or 1)  # children at once (the machine is shared)
BUDGET = 1500.0 if STRESS else 240.0  # seconds; stop launching seeds then (below pytest's timeout)
KEEP = 100  # damaged copies of failing seeds kept for inspection
ACCEPTABLE = ("ok", "library")
# A child's outcome is the worst of its reads (worst last); silent wrong data outranks a raw exception.
ORDER = ("ok", "library", "raw", "wrong", "signal", "hang")


# ---------------------------------------------------------------------- the cache


def fuzz_samples() -> list[Any]:
    """40 deterministic samples: mostly small ``(uint8 tensor, int)``, 40-56 KB float tensors, dicts, a list."""
    out: list[Any] = []
    for i in range(N):
        g = torch.Generator().manual_seed(1000 + i)
        if i % 10 == 3:  # 20-60 KB: LMDB overflow pages. Three of one size, as images usually are: a value
            n = 14000 if i == 33 else 10000  # that points at another's pages must still never pass for it
            out.append((torch.randn(n, generator=g), i))
        elif i % 10 == 7:  # the msgpack path of the codec
            out.append({"x": torch.randint(0, 9, (4, 5), generator=g), "name": f"s{i}", "ids": [i, i + 1]})
        elif i == N - 1:
            out.append([None, "last", torch.arange(6, dtype=torch.int16)])
        else:
            out.append(sample_for(i))
    return out


def build_cache(path: Path, samples: list[Any]) -> bytes:
    """Build the cache in 4 commits of 10 (so the file holds free pages and an older meta page); return data.mdb."""
    ds = CachedDataset(Listed(samples), path, fingerprint=FINGERPRINT, commit_every=1 << 20, commit_interval=3600)
    for start in range(0, N, 10):  # explicit commits: the same page layout on every run
        ds.__getitems__(list(range(start, start + 10)))
        ds.flush()
    ds.close()
    _registry._stores.clear()
    return (path / "data.mdb").read_bytes()


@dataclasses.dataclass
class Node:
    offset: int  # in the file
    page: int
    flags: int  # F_BIGDATA 0x01: the value is on overflow pages, the node holds their page number
    key: bytes
    size: int  # leaf: the value's length; branch: the child page number
    head: int  # bytes of the node LMDB trusts: the 8-byte header, the key and a page number or MDB_db record


@dataclasses.dataclass
class Layout:
    """Where LMDB keeps what in a data file, from its page headers (lmdb's mdb.c: MDB_page, MDB_node, MDB_meta)."""

    kinds: list[str]  # per page: meta, branch, leaf, overflow-head, overflow
    nodes: list[Node]  # every node of every branch and leaf page, stale copies in free pages included
    hot: list[tuple[int, int]]  # (offset, length): headers, pointers, keys, page numbers; not the values

    @classmethod
    def of(cls, data: bytes) -> Layout:
        pages = len(data) // PAGE
        kinds: list[str] = []
        while len(kinds) < pages:
            base = len(kinds) * PAGE
            flags = struct.unpack_from("<H", data, base + 10)[0]
            if flags & 0x04:  # P_OVERFLOW: a run of pages, only the first has a header
                kinds += ["overflow-head"] + ["overflow"] * (struct.unpack_from("<I", data, base + 12)[0] - 1)
            else:
                kinds.append("meta" if flags & 0x08 else "leaf" if flags & 0x02 else "branch" if flags & 0x01 else "?")
        del kinds[pages:]
        nodes, hot = [], []
        for page, kind in enumerate(kinds):
            base = page * PAGE
            if kind == "meta":
                hot.append((base, 16 + 136))  # page header, MDB_meta
            elif kind == "overflow-head":
                hot.append((base, 16))
            elif kind in ("branch", "leaf"):
                lower = struct.unpack_from("<H", data, base + 12)[0]
                hot.append((base, min(lower, PAGE)))  # page header and node pointers
                for k in range(max(0, lower - 16) // 2):
                    at = base + struct.unpack_from("<H", data, base + 16 + 2 * k)[0]
                    if at + 8 > base + PAGE:
                        continue
                    lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, at)
                    extra = 0 if kind == "branch" else 8 if flags & 0x01 else 48 if flags & 0x02 else 0
                    size = lo | hi << 16 | (flags << 32 if kind == "branch" else 0)
                    nodes.append(Node(at, page, flags, data[at + 8 : at + 8 + ksize], size, 8 + ksize + extra))
                    hot.append((at, 8 + ksize + extra))
        return cls(kinds, nodes, hot)

    def where(self, offset: int) -> str:
        page = offset // PAGE
        return f"page {page} ({self.kinds[page]})" if page < len(self.kinds) else f"page {page}"


# ---------------------------------------------------------------------- damage


@dataclasses.dataclass
class Damage:
    seed: int
    kind: str
    offset: int
    length: int  # bytes (bits for "flip"; the new size for "truncate")
    detail: str = ""


def damage(data: bytes, seed: int, layout: Layout) -> tuple[bytes, Damage]:
    """``data`` damaged in one of five ways chosen by ``seed``, and what was done."""
    rng = random.Random(seed)
    out = bytearray(data)
    size, pages = len(data), len(data) // PAGE
    structural = [p for p, kind in enumerate(layout.kinds) if kind != "overflow"]
    weights = [length for _, length in layout.hot]

    def offset() -> int:
        # A third anywhere, a third in LMDB's own pages, a third in the bytes LMDB trusts without a check
        # (page headers, node pointers, node headers, keys, page numbers): a uniform offset rarely hits those.
        aim = rng.random()
        if aim < 1 / 3:
            return rng.randrange(size)
        if aim < 2 / 3:
            return rng.choice(structural) * PAGE + rng.randrange(PAGE)
        at, length = rng.choices(layout.hot, weights)[0]
        return at + rng.randrange(length)

    kind = rng.choice(["flip", "zero", "random", "truncate", "splice"])
    if kind == "flip":
        flips = [(offset(), rng.randrange(8)) for _ in range(rng.randint(1, 8))]
        for at, bit in flips:
            out[at] ^= 1 << bit
        more = "".join(f" {at}^{1 << bit:#x}" for at, bit in flips)
        return bytes(out), Damage(seed, kind, flips[0][0], len(flips), f"bits at{more}")
    if kind in ("zero", "random"):
        if rng.random() < 0.3:
            at, length = offset() // PAGE * PAGE, PAGE
        else:
            at, length = offset(), rng.randint(1, PAGE)
        length = min(length, size - at)
        out[at : at + length] = bytes(length) if kind == "zero" else rng.randbytes(length)
        return bytes(out), Damage(seed, kind, at, length)
    if kind == "truncate":
        new = rng.randrange(pages) * PAGE if rng.random() < 0.5 else rng.randrange(size)
        return bytes(out[:new]), Damage(seed, kind, new, new, f"{size} -> {new} bytes")
    source, target = rng.randrange(pages), offset() // PAGE
    while source == target:
        source = rng.randrange(pages)
    out[target * PAGE : (target + 1) * PAGE] = data[source * PAGE : (source + 1) * PAGE]
    return bytes(out), Damage(
        seed, kind, target * PAGE, PAGE, f"page {source} ({layout.kinds[source]}) over page {target}"
    )


# ---------------------------------------------------------------------- the child


def read_back(path: Path, samples: list[Any], note: Callable[..., None]) -> None:
    """Open the cache at ``path`` and read everything; ``note(step)`` before each step, ``note(step, outcome, text)``
    for each result that is not ``ok``."""

    def attempt(step: str, call: Callable[[], Any]) -> tuple[bool, Any]:
        note(step)
        try:
            return True, call()
        except LmdbCacheError as exc:
            note(step, "library", f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            place = f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
            note(step, "raw", f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} [at {place}]")
        return False, None

    def check(step: str, got: Any, index: int) -> None:
        if not same(got, samples[index]):
            other = [j for j in range(N) if j != index and same(got, samples[j])]
            shown = f"the sample of index {other[0]}" if other else repr(got)[:120]
            note(step, "wrong", f"returned {shown}")

    opened, ds = attempt("open", lambda: CachedDataset.open(path))
    if opened:
        ok, length = attempt("len()", lambda: len(ds))
        if ok and length != N:
            note("len()", "wrong", f"{length} instead of {N}")
        for i in range(N):
            ok, got = attempt(f"ds[{i}]", functools.partial(ds.__getitem__, i))
            if ok:
                check(f"ds[{i}]", got, i)
        ok, batch = attempt("__getitems__", lambda: ds.__getitems__(list(range(N))))
        if ok:
            for i, got in enumerate(batch):
                check(f"__getitems__[{i}]", got, i)
        # The loader's batch path (the compiled core's, when it is built): one sample a batch, as the samples
        # differ, over the samples default_collate can batch.
        wanted = {i: want for i in range(N) if (want := _collated(samples[i])) is not None}
        ok, batches = attempt("loader", lambda: list(ds.loader(1, sampler=list(wanted))))
        if ok:
            for i, got in zip(wanted, batches):
                if not same(got, wanted[i]):
                    note(f"loader[{i}]", "wrong", f"returned {repr(got)[:120]}")
        ok, count = attempt("cached_count", lambda: ds.cached_count)
        if ok and not (type(count) is int and 0 <= count <= N):
            note("cached_count", "wrong", f"{count!r} for a cache of length {N}")
        attempt("close", ds.close)
    ok, info = attempt("tools.info", lambda: tools.info(path))
    if ok:
        wanted = {"length": N, "fingerprint": FINGERPRINT}
        bad = {key: getattr(info, key, None) for key, want in wanted.items() if getattr(info, key, None) != want}
        cached = getattr(info, "cached", None)
        if not (type(cached) is int and 0 <= cached <= N):
            bad["cached"] = cached
        if bad:
            note("tools.info", "wrong", f"returned {bad}")


def _collated(sample: Any) -> Any:
    """``default_collate([sample])``, or None for a sample it cannot batch (None, bytes)."""
    try:
        return default_collate([sample])
    except TypeError:
        return None


def same(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except Exception:  # AssertionError, or a comparison that a damaged object makes raise
        return False
    return True


def start_child(directory: Path, samples: list[Any], prelude: Callable[[], None] | None = None) -> int:
    """Fork a child that runs ``read_back`` on ``directory``/cache, logging to ``directory``/report.jsonl."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork() of a process with threads
        pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        # Open for the child's whole life: faulthandler writes the stack there if a signal kills it.
        with (
            open(directory / "faulthandler.txt", "w") as crash_log,
            open(directory / "report.jsonl", "w", buffering=1) as log,
        ):
            faulthandler.enable(file=crash_log, all_threads=False)

            def note(step: str, outcome: str | None = None, text: str = "") -> None:
                log.write(json.dumps({"step": step, "outcome": outcome, "text": text[:400]}) + "\n")

            if prelude is not None:
                prelude()
            read_back(directory / "cache", samples, note)
    except BaseException:
        traceback.print_exc()
        code = 70
    finally:
        os._exit(code)


@dataclasses.dataclass
class Result:
    damage: Damage | None
    outcome: str = "ok"
    step: str = ""
    text: str = ""
    directory: Path | None = None


def finish(directory: Path, status: int | None, result: Result) -> Result:
    """Classify a child from its exit status (None: killed after the timeout) and its report."""
    lines = []
    report = directory / "report.jsonl"
    if report.exists():
        lines = [json.loads(line) for line in report.read_text().splitlines() if line.endswith("}")]
    noted = [line for line in lines if line["outcome"]]
    last_step = lines[-1]["step"] if lines else "before open"
    if status is None:
        result.outcome, result.step, result.text = "hang", last_step, f"still running after {CHILD_TIMEOUT:.0f} s"
    elif os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        result.outcome, result.step, result.text = "signal", last_step, f"{name}{died_in(directory)}"
    elif os.WEXITSTATUS(status) != 0:
        result.outcome, result.step = "raw", last_step
        result.text = f"the harness child exited with status {os.WEXITSTATUS(status)} (see captured stderr)"
    elif noted:
        worst = max(noted, key=lambda line: ORDER.index(line["outcome"]))
        result.outcome, result.step, result.text = worst["outcome"], worst["step"], worst["text"]
    result.directory = directory
    return result


def died_in(directory: Path) -> str:
    """`` in file:line func <- ...``: the innermost frames of faulthandler's stack, innermost first."""
    try:
        text = (directory / "faulthandler.txt").read_text()
    except OSError:
        return ""
    frames = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("File "):
            name, _, rest = line[len("File ") :].partition(", line ")
            lineno, _, func = rest.partition(" in ")
            frames.append(f"{os.path.basename(name.strip(chr(34)))}:{lineno} {func}")
    return f" in {' <- '.join(frames[:4])}" if frames else ""


def run_children(jobs: list[tuple[Path, Result]], samples: list[Any], prelude=None, timeout=CHILD_TIMEOUT):
    """Run one child per (directory, result), ``JOBS`` at once; fill in each result. Returns how many ran."""
    running: dict[int, tuple[Path, Result, float]] = {}
    pending = list(jobs)
    deadline = time.monotonic() + BUDGET
    ran = 0
    while pending or running:
        while pending and len(running) < JOBS and time.monotonic() < deadline:
            directory, result = pending.pop(0)
            running[start_child(directory, samples, prelude)] = (directory, result, time.monotonic() + timeout)
            ran += 1
        if time.monotonic() >= deadline:
            pending.clear()
        for pid, (directory, result, expires) in list(running.items()):
            status: int | None
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() > expires:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = None
            elif not done:
                continue
            del running[pid]
            finish(directory, status, result)
        time.sleep(0.001)
    return ran


# ---------------------------------------------------------------------- reporting


def seeds_to_run() -> list[int]:
    """``LMDBCACHE_FUZZ_SEEDS`` (``12,40-45``) if set, else 0..999 (0..9999 under LMDBCACHE_STRESS=1)."""
    spec = os.environ.get("LMDBCACHE_FUZZ_SEEDS", "").strip()
    if not spec:
        return list(range(scaled(1000, 10000)))
    seeds: list[int] = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        seeds += range(int(low), int(high or low) + 1)
    return seeds


def table(results: list[Result], layout: Layout, per_outcome: int = 12) -> str:
    rows = ["seed   damage    offset   length  where                    outcome  step              exception / signal"]
    for outcome in reversed(ORDER):
        if outcome in ACCEPTABLE:
            continue
        chosen = [r for r in results if r.outcome == outcome]
        for r in chosen[:per_outcome]:
            d = r.damage
            assert d is not None
            rows.append(
                f"{d.seed:<6} {d.kind:<9} {d.offset:<8} {d.length:<7} {layout.where(d.offset):<24} {r.outcome:<8} "
                f"{r.step:<17} {r.text}" + (f"  [{d.detail}]" if d.detail else "")
            )
        if len(chosen) > per_outcome:
            rows.append(f"       ... and {len(chosen) - per_outcome} more {outcome}")
    return "\n".join(rows)


def groups(results: list[Result]) -> str:
    """One line per distinct failure (outcome, exception type or signal, and where), with how many seeds hit it."""
    seen: dict[str, list[int]] = {}
    for r in results:
        what = r.text.split(":")[0] if r.outcome in ("raw", "library") else r.text
        place = r.text[r.text.rfind(" [at ") :] if " [at " in r.text else ""
        step = r.step.split("[")[0]
        seen.setdefault(f"{r.outcome:<7} {step:<13} {what}{place}", []).append(r.damage.seed if r.damage else -1)
    lines = sorted(seen.items(), key=lambda item: -len(item[1]))
    return "\n".join(f"{len(s):>5} x {key}  (seeds {', '.join(map(str, s[:5]))})" for key, s in lines)


def counts(results: list[Result]) -> dict[str, int]:
    return {outcome: sum(r.outcome == outcome for r in results) for outcome in ORDER}


# ---------------------------------------------------------------------- the tests


def table_first() -> None:
    """In a fuzz child: the core's first lookup in a snapshot builds its location table (no-op without the core)."""
    if lmdbcache._native.core is not None:
        lmdbcache._native.core.set_table_threshold(0, 1 << 63)


class Pristine(tuple):
    """(samples, data.mdb bytes) of the undamaged cache; a short repr for pytest's failure reports."""

    def __repr__(self) -> str:
        return f"<{len(self[0])} samples, data.mdb of {len(self[1])} bytes>"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    samples = fuzz_samples()
    return Pristine((samples, build_cache(tmp_path_factory.mktemp("fuzz-pristine") / "cache", samples)))


def make_jobs(root: Path, data: bytes, seeds: list[int], layout: Layout) -> list[tuple[Path, Result]]:
    jobs = []
    for seed in seeds:
        damaged, what = damage(data, seed, layout)
        directory = root / f"seed-{seed}"
        (directory / "cache").mkdir(parents=True)
        (directory / "cache" / "data.mdb").write_bytes(damaged)
        jobs.append((directory, Result(what)))
    return jobs


def test_damaged_data_file_never_crashes_or_returns_wrong_data(pristine, tmp_path):
    """Over >= 1000 randomly damaged copies of data.mdb, every read either returns the original data or raises an
    LmdbCacheError: never wrong data, another exception, a signal or a hang."""
    samples, data = pristine
    layout = Layout.of(data)
    seeds = seeds_to_run()
    started = time.monotonic()
    results: list[Result] = []
    kept = 0
    for chunk in range(0, len(seeds), 200):  # damaged copies on disk: a few MB at a time
        jobs = make_jobs(tmp_path, data, seeds[chunk : chunk + 200], layout)
        # Every other chunk reads through the core's location table, built at the first lookup (its walk over
        # every page of the damaged tree), the others through the per-index lookup
        ran = run_children(jobs, samples, table_first if chunk // 200 % 2 else None)
        for directory, result in jobs[:ran]:
            results.append(result)
            if result.outcome in ACCEPTABLE or kept >= KEEP:
                shutil.rmtree(directory)
            else:
                kept += 1
        if ran < len(jobs):
            break
    seconds = time.monotonic() - started
    by_kind = {
        kind: sum(r.outcome in ACCEPTABLE for r in results if r.damage and r.damage.kind == kind)
        for kind in ("flip", "zero", "random", "truncate", "splice")
    }
    summary = (
        f"{len(results)} damaged files in {seconds:.1f} s ({len(data)} bytes, {len(layout.kinds)} pages; "
        f"lmdbcache {lmdbcache.__version__}): {counts(results)}; acceptable per damage kind: {by_kind}"
    )
    print(summary)
    bad = [r for r in results if r.outcome not in ACCEPTABLE]
    if bad or len(results) < len(seeds):
        pytest.fail(
            f"{summary}\nran {len(results)} of {len(seeds)} seeds; damaged copies of the first {KEEP} failing seeds "
            f"kept under {tmp_path}\n{groups(bad)}\n{table(results, layout)}",
            pytrace=False,
        )
    if len(results) >= 1000:  # the fuzz reached the library's error paths, not just pages nobody reads
        assert counts(results)["library"] > len(results) // 20, summary


def _break_tools_info() -> None:
    """In this child, make ``tools.info`` raise a KeyError: a raw exception, not an LmdbCacheError."""

    def info(path: Any) -> dict[str, Any]:
        raise KeyError("length")

    tools.info = info


def test_fuzz_harness_tells_each_outcome_apart(pristine, tmp_path):
    """The harness classifies an undamaged copy as ok, a changed sample as wrong, a truncated file as a library
    error, and a child killed by SIGSEGV or stuck past its timeout as signal and hang."""
    samples, data = pristine
    cases: dict[str, tuple[bytes, list[Any], Callable[[], None] | None]] = {
        "ok": (data, samples, None),
        "wrong": (data, [samples[0], sample_for(99), *samples[2:]], None),
        "library": (data[: 3 * PAGE], samples, None),
        "raw": (data, samples, _break_tools_info),
        "signal": (data, samples, lambda: os.kill(os.getpid(), signal.SIGSEGV)),
        "hang": (data, samples, lambda: time.sleep(60)),
    }
    for want, (content, expected, prelude) in cases.items():
        directory = tmp_path / want
        (directory / "cache").mkdir(parents=True)
        (directory / "cache" / "data.mdb").write_bytes(content)
        result = Result(Damage(0, want, 0, 0))
        run_children([(directory, result)], expected, prelude=prelude, timeout=3.0)
        assert result.outcome == want, (want, result)
    faulthandler_text = (tmp_path / "signal" / "faulthandler.txt").read_text()
    assert "Segmentation fault" in faulthandler_text


def run_one(root: Path, name: str, content: bytes, samples: list[Any]) -> Result:
    """Read back one damaged data.mdb ``content`` in a child, as the fuzz does."""
    directory = root / name
    (directory / "cache").mkdir(parents=True)
    (directory / "cache" / "data.mdb").write_bytes(content)
    result = Result(Damage(0, name, 0, 0))
    run_children([(directory, result)], samples)
    return result


def _retarget_index_3_to_13(data: bytes, nodes: list[Node]) -> bytes:
    """Index 3's overflow page number becomes index 13's: a value of the same length with valid checksums."""
    out = bytearray(data)
    three = [node for node in nodes if node.key == struct.pack(">Q", 3)]
    thirteen = next(node for node in nodes if node.key == struct.pack(">Q", 13))
    assert three and all(node.flags & 0x01 and node.size == thirteen.size for node in three)
    for node in three:  # every copy, stale ones in free pages too
        at = node.offset + 8 + 8  # node header, key, then the overflow page number
        out[at : at + 8] = data[thirteen.offset + 16 : thirteen.offset + 24]
    return bytes(out)


def _stretch_index_3(data: bytes, nodes: list[Node]) -> bytes:
    """Index 3's value length grows by 2 MiB (a bit of mn_hi): the value now runs past the end of the file."""
    out = bytearray(data)
    for node in nodes:
        if node.key == struct.pack(">Q", 3):
            out[node.offset + 2] ^= 0x20
    return bytes(out)


def _inflate_entry_count(data: bytes, nodes: list[Node]) -> bytes:
    """The samples database's entry count (MDB_db.md_entries in the main database) grows by 2**40."""
    out = bytearray(data)
    for node in nodes:
        if node.key == b"samples" and node.flags & 0x02:
            out[node.offset + 8 + len(node.key) + 32 + 5] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize(
    "surgery",
    [_retarget_index_3_to_13, _stretch_index_3, _inflate_entry_count],
    ids=["another-samples-pages", "length-past-the-file", "entry-count"],
)
def test_a_damaged_record_is_an_error_never_a_crash_or_other_data(pristine, tmp_path, surgery):
    """Precise damage to one LMDB record that random damage rarely hits (another sample's pages, a length beyond
    the file, an entry count): an LmdbCacheError, never another sample, a wrong count or a SIGBUS."""
    samples, data = pristine
    result = run_one(tmp_path, surgery.__name__, surgery(data, Layout.of(data).nodes), samples)
    assert result.outcome in ACCEPTABLE, f"{result.outcome} at {result.step}: {result.text}"


def test_a_key_changed_into_another_index_is_never_served_as_it(pristine, tmp_path):
    """A bit flipped in a stored key turns index a into index b (both cached): reading b returns b's sample or
    raises an LmdbCacheError, never a's sample; for every such pair of the cache."""
    samples, data = pristine
    nodes = [node for node in Layout.of(data).nodes if len(node.key) == 8]
    results = []
    for a in range(N):
        for bit in range(6):
            b = a ^ (1 << bit)
            if b >= N:
                continue
            damaged = bytearray(data)
            for node in nodes:
                if node.key == struct.pack(">Q", a):  # every copy, stale ones in free pages too
                    damaged[node.offset + 8 + 7] ^= 1 << bit
            results.append((a, b, run_one(tmp_path, f"key-{a}-{b}", bytes(damaged), samples)))
    bad = [(a, b, r.outcome, r.step, r.text[:80]) for a, b, r in results if r.outcome not in ACCEPTABLE]
    assert not bad, f"{len(bad)} of {len(results)} key changes a -> b: {bad[:8]}"
