"""The ``lmdbcache`` command: precompute, info, verify, warm, copy, merge.

``main(argv) -> int`` is the whole command; user errors print one line (no traceback)
and return 1 (2 for bad arguments, 130 after Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ._version import __version__
from .errors import LmdbCacheError, SpecError

EXAMPLES = {
    "precompute": """examples:
  lmdbcache precompute mypkg.data:make_train_set /fast/train.lmdb --arg root=/data/train --arg size=256
  lmdbcache precompute scripts/example_data.py:jpeg_dataset demo_data/cache.lmdb --workers 2
  lmdbcache precompute mypkg.data:make_train_set /fast/shard-0.lmdb --shard 0/3     # then 1/3, 2/3, merge
  sbatch --array=0-7 ... lmdbcache precompute SPEC /fast/shard-$SLURM_ARRAY_TASK_ID.lmdb \\
      --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT
  torchrun --nproc-per-node 4 -m lmdbcache precompute SPEC /local/train.lmdb  # local ranks split the work

SPEC is package.module:callable or path/to/file.py:callable; the callable returns the
dataset, called with the --arg values (parsed as JSON where they parse, else strings).
Already cached indices are skipped: rerun the same command to resume after Ctrl-C or a crash.
Index i belongs to shard i %% N.""",
    "info": """examples:
  lmdbcache info /fast/train.lmdb
  lmdbcache info /fast/train.lmdb --json | jq .cached""",
    "verify": """examples:
  lmdbcache verify /fast/train.lmdb            # exit 1 and list the damaged indices if any
  lmdbcache verify /fast/train.lmdb --repair   # delete them: they are decoded again on next read""",
    "warm": """examples:
  lmdbcache warm /fast/train.lmdb && python train.py   # first epoch after a reboot at page-cache speed""",
    "copy": """examples:
  lmdbcache copy /shared/train.lmdb /local-ssd/train.lmdb   # on each node, before training

Safe while the source is read or written (LMDB's own compacting copy of one snapshot).
Does nothing if the destination already holds the complete cache; replaces an incomplete one.""",
    "merge": """examples:
  lmdbcache merge /fast/train.lmdb /fast/shard-0.lmdb /fast/shard-1.lmdb /fast/shard-2.lmdb
  lmdbcache merge /fast/train.lmdb /fast/shard-*.lmdb""",
}


def load_spec(spec: str, kwargs: dict[str, Any]) -> Any:
    """Import ``module:callable`` or ``file.py:callable`` and call it with ``kwargs``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise SpecError(f"SPEC '{spec}' must be package.module:callable or path/to/file.py:callable.")
    try:
        if target.endswith(".py") or os.sep in target:
            path = os.path.abspath(target)
            if not os.path.isfile(path):
                raise SpecError(f"SPEC file '{target}' does not exist.")
            # Importable by its stem from its directory, so spawn workers can unpickle what it defines.
            sys.path.insert(0, os.path.dirname(path))
            module_name = os.path.splitext(os.path.basename(path))[0]
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"Cannot import '{target}' from SPEC '{spec}': {type(exc).__name__}: {exc}") from exc
    factory: Any = module
    for part in name.split("."):
        if not hasattr(factory, part):
            raise SpecError(f"'{target}' has no attribute '{name}' (SPEC '{spec}').")
        factory = getattr(factory, part)
    if not callable(factory):
        raise SpecError(f"'{spec}' is a {type(factory).__name__}, not a callable that returns a dataset.")
    try:
        dataset = factory(**kwargs)
    except Exception as exc:
        raise SpecError(f"Calling '{spec}' with {kwargs} failed: {type(exc).__name__}: {exc}") from exc
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise SpecError(
            f"'{spec}' returned a {type(dataset).__name__}, not a map-style dataset (__len__ and __getitem__)."
        )
    return dataset


def _parse_args_kv(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--arg '{item}' must look like key=value.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _parse_shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    try:
        shard = (int(index), int(count))
    except ValueError:
        shard = (-1, 0)
    if not sep or not (shard[1] >= 1 and 0 <= shard[0] < shard[1]):
        raise argparse.ArgumentTypeError(f"'{text}' is not I/N with 0 <= I < N (I counts from 0: 0/3, 1/3, 2/3)")
    return shard


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmdbcache", description="Build and look after lmdbcache caches.")
    parser.add_argument("--version", action="version", version=f"lmdbcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = command("precompute", "Decode a whole dataset (or one shard) into a cache, in parallel; resumable.")
    p.add_argument("spec", metavar="SPEC", help="package.module:callable or path/to/file.py:callable")
    p.add_argument("path", metavar="PATH", help="the cache directory")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for SPEC")
    p.add_argument("--workers", type=int, default=None, help="decoding processes (default: the CPU count)")
    p.add_argument(
        "--shard", type=_parse_shard, default=None, metavar="I/N", help="only the indices i with i %% N == I"
    )
    p.add_argument("--fingerprint", default=None, help="the dataset's fingerprint (default: class name and length)")
    p.add_argument("--overwrite", action="store_true", help="empty an existing cache and rebuild it")
    p.add_argument("--check-determinism", type=int, default=3, metavar="K", help="decode K indices twice (default 3)")
    p.add_argument("--allow-nondeterministic", action="store_true", help="cache a dataset whose samples vary anyway")
    p.add_argument("--batch-size", type=int, default=16, help="samples per worker task (default 16)")
    p.add_argument("--commit-every", type=int, default=1024, help="samples per commit (default 1024)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = command("info", "Show a cache's length, fill, fingerprint, format and size.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="one JSON object, for machines")

    p = command("verify", "Decode every stored value and check its checksums; exit 1 if any is damaged.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--repair", action="store_true", help="delete damaged entries so they are decoded again")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = command("warm", "Read a cache once so it is in the page cache before training.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = command("copy", "Copy a cache (compacted, consistent) to another place, e.g. a node's local disk.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--overwrite", action="store_true", help="replace a cache of another dataset at DST")

    p = command("merge", "Merge shard caches of one dataset into one cache.")
    p.add_argument("out", metavar="OUT")
    p.add_argument("shards", metavar="SHARD", nargs="+")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _bar(total: int | None, unit: str, quiet: bool, **kwargs: Any) -> Any:
    from tqdm import tqdm

    tqdm.monitor_interval = 0
    return tqdm(total=total, unit=unit, disable=True if quiet else None, dynamic_ncols=True, **kwargs)


def _precompute(args: argparse.Namespace) -> int:
    from .precompute import precompute

    dataset = load_spec(args.spec, _parse_args_kv(args.arg))
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
    )
    print(result.summary())
    return 130 if result.interrupted else 0


def _info(args: argparse.Namespace) -> int:
    from .tools import info

    data = info(args.path)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    state = "complete" if data["complete"] else "incomplete"
    print(f"path         {data['path']}")
    print(f"length       {data['length']}")
    print(f"cached       {data['cached']} ({data['percent']:.1f}%, {state})")
    print(f"fingerprint  {data['fingerprint']}")
    print(
        f"format       {data['format_version']} (codec {data['codec']}, written by lmdbcache {data['library_version']})"
    )
    print(f"size         {data['size_bytes'] / 2**20:,.1f} MB on disk, map {data['map_size'] / 2**20:,.0f} MB")
    print(f"created      {data['created']}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .tools import info, verify

    with _bar(info(args.path)["cached"], "sample", args.quiet) as bar:
        result = verify(args.path, repair=args.repair, progress=bar.update)
    if not result.bad:
        print(f"Checked {result.checked} entries: all intact.")
        return 0
    shown = ", ".join(map(str, result.bad[:20])) + (", ..." if len(result.bad) > 20 else "")
    if args.repair:
        print(
            f"Checked {result.checked} entries: deleted {result.repaired} damaged ({shown}). They are decoded again "
            "on their next read, or by `lmdbcache precompute`."
        )
        return 0
    print(f"Checked {result.checked} entries: {len(result.bad)} damaged: {shown}. Run with --repair to delete them.")
    return 1


def _warm(args: argparse.Namespace) -> int:
    from .tools import warm

    size = os.path.getsize(os.path.join(args.path, "data.mdb")) if os.path.isdir(args.path) else None
    available = _mem_available()
    if size and available and size > available:
        print(
            f"warning: the cache ({size / 2**20:,.0f} MB) is larger than the free memory ({available / 2**20:,.0f} MB)."
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
    from .tools import copy

    result = copy(args.src, args.dst, overwrite=args.overwrite)
    if result.action == "unchanged":
        print(f"'{args.dst}' already holds the complete cache ({result.cached}/{result.length}): nothing to do.")
    else:
        print(
            f"{result.action.capitalize()} '{args.dst}' from '{args.src}': {result.cached}/{result.length} samples "
            f"in {result.seconds:.1f} s."
        )
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .tools import merge

    with _bar(None, "sample", args.quiet) as bar:
        data = merge(args.out, args.shards, progress=bar.update)
    state = "complete" if data["complete"] else f"incomplete: {data['length'] - data['cached']} indices missing"
    print(f"Merged {len(args.shards)} shards into '{args.out}': {data['cached']}/{data['length']} samples ({state}).")
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
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except LmdbCacheError as exc:
        print(f"lmdbcache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"lmdbcache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lmdbcache {args.command}: interrupted.", file=sys.stderr)
        return 130
