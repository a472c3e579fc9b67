"""The ``lmdbcache`` command: precompute, info, verify, warm, copy, merge.

``main(argv) -> int`` is the whole command; user errors print one line (no traceback)
and return 1, 130 after Ctrl-C. A malformed command line is one line too, naming
``lmdbcache COMMAND --help``, and exits 2 (argparse's status for usage errors).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import LmdbCacheError
from ._parser import parser

if TYPE_CHECKING:  # imported by the commands that need them (some import torch)
    from ._verify import VerifyResult


def _bar(total: int | None, unit: str, quiet: bool, **kwargs: Any) -> Any:
    from ._progress import progress_bar

    return progress_bar(total, unit, quiet, **kwargs)


@contextlib.contextmanager
def _counted(quiet: bool) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
    """``(started, progress)`` for verify and merge: the bar appears when ``started(total)`` gives its total, so it
    neither shows "0sample" at an unknown rate nor measures its rate (and ETA) from before the work began."""
    bars: list[Any] = []

    def started(total: int) -> None:
        bars.append(_bar(total, "sample", quiet))

    def progress(count: int) -> None:
        if bars:
            bars[-1].update(count)
            if bars[-1].n >= bars[-1].total:
                bars[-1].close()  # at 100%: not left running while the scan's process exits

    try:
        yield started, progress
    finally:
        for bar in bars:
            bar.close()


def _precompute(args: argparse.Namespace) -> int:
    codec = args.compress[0]
    if codec is not None:  # before the SPEC is loaded and anything is created
        from ..format._frames import require

        require(codec, asked=f"`--compress {codec}`")
    with _interrupt_not_lost():
        from ._precompute import precompute
        from ._spec import load_spec, parse_args_kv

        dataset = load_spec(args.spec, parse_args_kv(args.arg))
    result = precompute(
        dataset,
        args.path,
        num_workers=args.workers,
        shard=args.shard,
        fingerprint=args.fingerprint,
        overwrite=args.overwrite,
        check_determinism=args.check_determinism,
        allow_nondeterministic=args.allow_nondeterministic,
        batch_size=args.batch_size,
        commit_every=args.commit_every,
        progress=False if args.quiet else None,
        compress=args.compress[0],
        compress_level=args.compress[1],
        pack=args.pack,
        spot_check=args.spot_check,
    )
    print(result.summary())
    return 130 if result.interrupted else 0


@contextlib.contextmanager
def _interrupt_not_lost() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the block as usual, and again at its end if code inside swallowed it.

    torch's import does, when the signal lands in the numpy import it makes from C (it clears
    the error and goes on): a Ctrl-C in the first second of precompute was lost (issue 13).
    """
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # Ctrl-C ignored (a background job) or handled by the caller: theirs to decide
        return
    seen: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if seen:
        raise KeyboardInterrupt


def _info(args: argparse.Namespace) -> int:
    import dataclasses

    from ._ops import info

    data = info(args.path)
    if args.json:
        print(json.dumps(dataclasses.asdict(data), indent=2))
        return 0
    state = "complete" if data.complete else "incomplete"
    print(f"path         {data.path}")
    print(f"length       {data.length}")
    print(f"cached       {data.cached} ({data.percent:.1f}%, {state})")
    print(f"fingerprint  {data.fingerprint}")
    print(f"format       {data.format_version} (written by lmdbcache {data.library_version})")
    print(f"size         {data.size_bytes / 2**20:,.1f} MB on disk, map {data.map_size / 2**20:,.0f} MB")
    print(f"compress     {data.compress or 'none'}")
    print(f"pack         {data.pack or 'none'}")
    print(f"created      {data.created}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from ._ops import verify

    with _counted(args.quiet) as (started, progress):
        result = verify(args.path, repair=args.repair, progress=progress, started=started)
    text, code = _verify_report(result, args.repair)
    print(text)
    return code


def _verify_report(result: VerifyResult, repair: bool) -> tuple[str, int]:
    """What ``lmdbcache verify`` prints about ``result``, and its exit status."""
    shown = ", ".join(map(str, result.bad[:20])) + (", ..." if len(result.bad) > 20 else "")
    deleted = f"{result.repaired} were deleted before it" if result.repaired else "nothing was deleted"
    rebuild = "copy the cache from a good replica, or rebuild it (`lmdbcache precompute --overwrite`)."
    if result.crashed is not None and not result.file_damaged:
        return (
            f"verify stopped: {result.crashed}; {deleted}. Run it again; if it stops at the same place, the file is "
            f"damaged: {rebuild}"
        ), 1
    broken = result.crashed or result.unreadable
    if broken is not None:
        # The file itself is damaged, not just some values: repair does not write to it.
        before = f" Damaged entries before it: {shown}." if result.bad else ""
        cannot = (
            " --repair cannot fix that (it deletes damaged values; writing to a file this damaged could spread it):"
            f" {deleted}."
            if repair
            else ""
        )
        fix = f"; {rebuild}" if result.crashed else ""  # for unreadable, the reason already says what to do
        return f"damaged: {broken}{fix}{cannot}{before}", 1
    if not result.bad:
        return f"Checked {result.checked} entries: all intact.", 0
    if not repair:
        return (
            f"Checked {result.checked} entries: {len(result.bad)} damaged: {shown}. Run with --repair to delete them.",
            1,
        )
    kept = sorted(result.unrepaired)
    if kept:
        return (
            f"Checked {result.checked} entries: deleted {result.repaired} of {len(result.bad)} damaged ({shown}); "
            f"could not delete {', '.join(map(str, kept[:20]))} ({result.unrepaired[kept[0]]}). {rebuild.capitalize()}"
        ), 1
    return (
        f"Checked {result.checked} entries: deleted {result.repaired} damaged ({shown}). They are decoded again "
        "on their next read, or by `lmdbcache precompute`."
    ), 0


def _warm(args: argparse.Namespace) -> int:
    from ._ops import warm

    size = os.path.getsize(os.path.join(args.path, "data.mdb")) if os.path.isdir(args.path) else None
    available = _mem_available()
    if size and available and size > available:
        print(
            f"lmdbcache warm: warning: the cache ({size / 2**20:,.0f} MB) is larger than the free memory "
            f"({available / 2**20:,.0f} MB): it cannot all stay in the page cache.",
            file=sys.stderr,
        )
    with _bar(size, "B", args.quiet, unit_scale=True, unit_divisor=1024) as bar:
        total, seconds = warm(args.path, progress=bar.update)
    rate = total / seconds / 2**20 if seconds > 0 else float("inf")
    print(f"Read {total / 2**20:,.1f} MB in {seconds:.2f} s ({rate:,.0f} MB/s): '{args.path}' is in the page cache.")
    return 0


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _copy(args: argparse.Namespace) -> int:
    from ._ops import copy_cache

    result = copy_cache(args.src, args.dst, overwrite=args.overwrite)
    if result.action == "unchanged":
        print(f"'{args.dst}' already holds the complete cache ({result.cached}/{result.length}): nothing to do.")
    else:
        print(
            f"{result.action.capitalize()} '{args.dst}' from '{args.src}': {result.cached}/{result.length} samples "
            f"in {result.seconds:.1f} s."
        )
    if result.others_had_it_open:
        print(
            f"lmdbcache copy: note: other processes had the old cache at '{args.dst}' open. They keep reading it, "
            "as it was, until they reopen the cache; samples they add to it meanwhile are not kept.",
            file=sys.stderr,
        )
    return 0


def _merge(args: argparse.Namespace) -> int:
    from ._merge import merge

    with _counted(args.quiet) as (started, progress):
        result = merge(args.out, args.shards, progress=progress, started=started)
    state = "complete" if result.complete else f"incomplete: {result.length - result.cached} indices missing"
    shards = f"{result.shards} shard" + ("" if result.shards == 1 else "s")
    print(
        f"Merged {shards} into '{args.out}': {result.cached}/{result.length} samples ({state}); "
        f"added {result.written}, {result.skipped} were already there."
    )
    return 0


COMMANDS = {
    "precompute": _precompute,
    "info": _info,
    "verify": _verify,
    "warm": _warm,
    "copy": _copy,
    "merge": _merge,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run(args)
    finally:
        if argv is None:  # run as the command: the process exits next
            # Python's last collection at exit walks every object torch made (0.3-0.4 s after a
            # precompute, on top of a Ctrl-C's final commit); the process frees them anyway.
            gc.freeze()


def _run(args: argparse.Namespace) -> int:
    """The command ``args`` asks for; user errors as one line on stderr (exit 1), Ctrl-C as exit 130."""
    try:
        return COMMANDS[args.command](args)
    except (LmdbCacheError, OSError) as exc:
        _error(args.command, _cli_words(args.command, _one_line(exc)))
        return 1
    except KeyboardInterrupt:
        print(f"lmdbcache {args.command}: interrupted.", file=sys.stderr)
        return 130
    except Exception as exc:
        import lmdb

        if not isinstance(exc, lmdb.Error):
            raise
        # The store translates every LMDB error; one that gets here is a bug, but still one line.
        _error(
            args.command,
            f"LMDB error that lmdbcache did not translate: {type(exc).__name__}: {_one_line(exc)}. This is a bug in "
            "lmdbcache; please report it with this line. The cache may be damaged: `lmdbcache verify` tells.",
        )
        return 1


# The library's messages name Python arguments; on the command line they name its flags.
_HAS_OVERWRITE = {"precompute", "copy"}


_FLAGS = (
    ("Leave pack= out", "Leave out --pack"),
    ("without compress=", "without --compress"),
    ("with a fingerprint= that", "with a --fingerprint that"),
    ("(spot_check=0 skips this check.)", "(--spot-check 0 skips this check.)"),
)


def _cli_words(command: str, message: str) -> str:
    """Reword a library message for the command line: ``--overwrite``, ``lmdbcache precompute``."""
    if command == "merge":  # its OUT is made of the shards: neither a source to rebuild it from nor --overwrite
        message = message.replace(", use another path, or pass overwrite=True to rebuild it", " or use another path")
        message = re.sub(r",? or pass overwrite=True to (?:rebuild|replace) it(?: with the new one)?", "", message)
        message = message.replace("pass overwrite=True", "write the merge to a new path")
    flag = "--overwrite" if command in _HAS_OVERWRITE else "`lmdbcache precompute SPEC PATH --overwrite`"
    message = message.replace("(overwrite=True, or `lmdbcache precompute --overwrite`)", f"({flag})")
    message = message.replace("pass overwrite=True", f"pass {flag}").replace("overwrite=True", flag)
    for python, words in _FLAGS:
        message = message.replace(python, words)
    return message.replace("Build it first.", "Build it first with `lmdbcache precompute SPEC PATH`.")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split("\n")).strip() or type(exc).__name__


def _error(command: str, message: str) -> None:
    print(f"lmdbcache {command}: error: {message}", file=sys.stderr)
