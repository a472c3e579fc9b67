"""The ``lmdbcache`` command line's parser: commands, options, examples and one-line usage errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._version import __version__
from ..errors import LmdbCacheError

# Printed as written (RawDescriptionHelpFormatter does not %-format an epilog): a plain "%",
# where help= strings need "%%".
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
Index i belongs to shard i % N.""",
    "info": """examples:
  lmdbcache info /fast/train.lmdb
  lmdbcache info /fast/train.lmdb --json | jq .cached""",
    "verify": """examples:
  lmdbcache verify /fast/train.lmdb            # exit 1 and list the damaged indices if any
  lmdbcache verify /fast/train.lmdb --repair   # delete them: they are decoded again on next read

The scan runs in a child process: a damaged file that crashes LMDB's reader (SIGSEGV, SIGBUS)
is reported as damage (exit 1) with the index it was reading. --repair deletes damaged values
only; a file that crashes the reader must be copied from a good replica or rebuilt.""",
    "warm": """examples:
  lmdbcache warm /fast/train.lmdb && python train.py   # first epoch after a reboot at page-cache speed""",
    "copy": """examples:
  lmdbcache copy /shared/train.lmdb /local-ssd/train.lmdb   # on each node, before training

Safe while the source is read or written (LMDB's own compacting copy of one snapshot).
Does nothing if the destination already holds the complete cache; replaces an incomplete one.
Only the cache's own files in DST change (data.mdb, lock.mdb): other files there are left alone,
and a file as DST is refused. Processes that have the old cache open keep reading it until they
reopen it; what they add to it meanwhile is lost.""",
    "merge": """examples:
  lmdbcache merge /fast/train.lmdb /fast/shard-0.lmdb /fast/shard-1.lmdb /fast/shard-2.lmdb
  lmdbcache merge /fast/train.lmdb /fast/shard-*.lmdb""",
}


def _parse_shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    try:
        shard = (int(index), int(count))
    except ValueError:
        shard = (-1, 0)
    if not sep or not (shard[1] >= 1 and 0 <= shard[0] < shard[1]):
        raise argparse.ArgumentTypeError(f"'{text}' is not I/N with 0 <= I < N (I counts from 0: 0/3, 1/3, 2/3)")
    return shard


def _parse_compress(text: str) -> tuple[str, int | None]:
    """``--compress``: ``lz4`` or ``zstd``, with an optional ``:LEVEL``."""
    from ..format._compress import check

    codec, sep, digits = text.partition(":")
    try:
        level = int(digits) if sep else None
        check(codec, level)
    except (ValueError, LmdbCacheError) as exc:
        raise argparse.ArgumentTypeError(f"'{text}' is not lz4 or zstd with an optional :LEVEL ({exc})") from None
    return codec, level


def _int_at_least(minimum: int, note: str = "") -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else a one-line error naming the valid range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}{note}, not '{text}'")
        return value

    return parse


def _fingerprint(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must not be empty: omit --fingerprint for the default (class name and length), or give a name that "
            "changes when the decoded content would"
        )
    return text


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line: what is wrong, and where the help is."""

    commands: dict[str, argparse.ArgumentParser]  # the top parser's subcommands, by name

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, but an argument no subcommand takes is that subcommand's error (its --help is named)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            getattr(self, "commands", {}).get(parsed.command, self).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def parser() -> argparse.ArgumentParser:
    """The whole command line: one subparser per command, each with its examples."""
    parser = _Parser(prog="lmdbcache", description="Build and look after lmdbcache caches.")
    parser.add_argument("--version", action="version", version=f"lmdbcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    parser.commands = {}

    def command(name: str, help: str, *paths: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for metavar in paths:
            p.add_argument(metavar.lower(), metavar=metavar)
        parser.commands[name] = p
        return p

    precompute = command("precompute", "Decode a whole dataset (or one shard) into a cache, in parallel; resumable.")
    _precompute_arguments(precompute)
    info = command("info", "Show a cache's length, fill, fingerprint, format and size.", "PATH")
    info.add_argument("--json", action="store_true", help="one JSON object, for machines")
    verify = command("verify", "Decode every stored value and check its checksums; exit 1 if any is damaged.", "PATH")
    verify.add_argument("--repair", action="store_true", help="delete damaged entries so they are decoded again")
    warm = command("warm", "Read a cache once so it is in the page cache before training.", "PATH")
    copy = command(
        "copy", "Copy a cache (compacted, consistent) to another place, e.g. a node's local disk.", "SRC", "DST"
    )
    copy.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a cache of another dataset (or format) at DST, or put the cache beside other files there",
    )
    merge = command("merge", "Merge shard caches of one dataset into one cache.", "OUT")
    merge.add_argument("shards", metavar="SHARD", nargs="+")
    for p in (precompute, verify, warm, merge):
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _precompute_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="package.module:callable or path/to/file.py:callable")
    p.add_argument("path", metavar="PATH", help="the cache directory")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for SPEC")
    p.add_argument(
        "--workers",
        type=_int_at_least(0, " (0 decodes in this process)"),
        default=None,
        metavar="N",
        help="decoding processes (default: the CPU count); 0 decodes in this process",
    )
    p.add_argument(
        "--shard", type=_parse_shard, default=None, metavar="I/N", help="only the indices i with i %% N == I"
    )
    p.add_argument(
        "--fingerprint",
        type=_fingerprint,
        default=None,
        help="the dataset's fingerprint (default: class name and length)",
    )
    p.add_argument("--overwrite", action="store_true", help="empty an existing cache and rebuild it")
    p.add_argument(
        "--spot-check",
        type=_int_at_least(0, " (0 skips the check)"),
        default=2,
        metavar="K",
        help="decode K cached indices of an existing cache again and refuse it if they differ (default 2; 0 skips)",
    )
    p.add_argument(
        "--check-determinism",
        type=_int_at_least(0, " (0 skips the check)"),
        default=3,
        metavar="K",
        help="decode K indices twice (default 3; 0 skips the check)",
    )
    p.add_argument("--allow-nondeterministic", action="store_true", help="cache a dataset whose samples vary anyway")
    _storage_arguments(p)


def _storage_arguments(p: argparse.ArgumentParser) -> None:
    """precompute's options on how the cache is written: compression, batches, commits, packs."""
    p.add_argument(
        "--compress",
        type=_parse_compress,
        default=(None, None),
        metavar="CODEC[:LEVEL]",
        help="compress a new cache's buffers: lz4 or zstd, e.g. zstd:3 (needs pip install 'lmdbcache[zstd]')",
    )
    p.add_argument(
        "--batch-size", type=_int_at_least(1), default=16, metavar="N", help="samples per worker task (default 16)"
    )
    p.add_argument(
        "--commit-every",
        type=_int_at_least(1),
        default=1024,
        metavar="N",
        help="samples per commit (default 1024); a commit also happens every second: a kill loses about 1 s of work",
    )
    p.add_argument(
        "--pack",
        type=_int_at_least(0, " (0: one record per sample)"),
        default=None,
        metavar="K",
        help="store each K consecutive samples under 16 KiB as one record in a new cache (default 64; 0: one "
        "record per sample; see docs/usage.md, Packs); an existing cache keeps its own, another K is refused",
    )
