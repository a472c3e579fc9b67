"""verify's scan, run in a child process, because a damaged data.mdb can crash its reader.

LMDB trusts the page numbers and lengths written in its file: a damaged one can send its C code
past the end of the file (SIGBUS) or of the map (SIGSEGV), which kills the process with no Python
exception to catch. So ``tools.verify`` runs ``main`` in a child and reads its report from a pipe;
when the child dies, the parent knows what it was reading and says so.

The report: one line per message, each written with one unbuffered ``os.write`` (atomic on a
pipe), so a crash loses nothing that was sent before it::

    s LENGTH CACHED   the cache opened: the dataset length and the number of stored entries (-1: unknown)
    k AFTER           about to read the next keys after index AFTER (-1: from the start)
    r INDEX           about to read and decode the value of INDEX (so the one before is done)
    b JSON            [index, why]: a damaged entry; the scan goes on
    u JSON            [after, why]: damage the scan cannot read past (not a crash); it stops there
                      (after null: damage found at the end; nothing is deleted either way)
    d JSON            [indices]: about to delete these (repair), in one transaction
    x COUNT           that transaction deleted COUNT entries
    f JSON            [index, why]: that index could not be deleted (repair)
    w JSON            [category, message]: a warning
    e JSON            [error class, message]: the cache could not be opened or read
    z CHECKED DELETED done

Each key, then its value, is read in its own short read transaction (a few microseconds each),
so a crash names the index whose value it was reading, or the last index before the damage.
Keys are read from the last index seen, inclusive, so a key that is not an index cannot hide
between two indices.
Repair (deleting the damaged values) happens here too, and only after a scan that read the whole
file: the parent never opens it, and a file whose structure is damaged is never written to.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ..errors import CorruptCacheError, CorruptSampleError, LmdbCacheError
from ..format import codec
from ..store import _registry
from ..store._store import Store

__all__ = ["TEST_SIGNAL", "decode_problem", "main"]

_LAST_INDEX = 2**64 - 1  # the largest 8-byte key: nothing comes after it
# Tests only: "SIGSEGV@7" makes the child send itself SIGSEGV when it is about to read index 7,
# to prove the parent's handling of a reader that dies (tests/test_tools.py).
TEST_SIGNAL = "LMDBCACHE_TEST_SCAN_SIGNAL"


class _Report:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, tag: str, *fields: Any) -> None:
        text = " ".join(f if isinstance(f, str) else json.dumps(f) for f in fields)
        os.write(self.fd, f"{tag} {text}\n".encode())

    def mark(self, tag: bytes, number: int) -> None:
        """The per-entry messages (k, r): one number, the cheap way."""
        os.write(self.fd, b"%s %d\n" % (tag, number))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmdbcache.tools._scan", description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("fd", type=int, help="the pipe to report on")
    parser.add_argument("--repair", action="store_true")
    args = parser.parse_args(argv)
    report = _Report(args.fd)

    def forward(message: Any, category: type, *_: Any, **__: Any) -> None:
        report.send("w", [category.__name__, str(message)])

    warnings.showwarning = forward
    try:
        checked, deleted = _scan(args.path, args.repair, report)
    except (LmdbCacheError, OSError) as exc:
        report.send("e", [type(exc).__name__, str(exc)])
        return 1
    except KeyboardInterrupt:
        return 130
    report.send("z", str(checked), str(deleted))
    return 0


def _scan(path: str, repair: bool, report: _Report) -> tuple[int, int]:
    """Check every entry of the cache at ``path`` (and delete the damaged ones with ``repair``): (checked, deleted)."""
    with _registry.opened(path) as store, store.reading_ahead():
        length = store.meta()["length"]
        try:
            entries, miscount = store.count(), None
        except CorruptCacheError as exc:  # e.g. more entries than the length: the scan says which
            entries, miscount = -1, str(exc)
        _import_torch()  # before "s": the parent's bar starts counting (its rate, its ETA) from that line
        report.send("s", str(length), str(entries))
        tally = _read_all(store, length, report)
        if tally.stopped:
            return tally.checked, 0  # nothing is written to a file whose structure is damaged
        if miscount is not None and not tally.bad:
            report.send("u", [None, f"the scan found no damaged entry, yet: {miscount}"])
            return tally.checked, 0
        if tally.seen < entries:  # entries are only deleted by repair: some keys were out of the scan's reach
            report.send(
                "u",
                [
                    None,
                    f"it held {entries} entries when the scan began but only {tally.seen} have keys that are "
                    "indices (the others sort before index 0). Copy the cache from a good replica, or rebuild it "
                    "(`lmdbcache precompute --overwrite`).",
                ],
            )
            return tally.checked, 0
        stray = store.keys_before_start()  # a packed cache counts indices, so the check above cannot see them
        if stray:
            report.send(
                "u",
                [
                    None,
                    f"it holds {stray}{'+' if stray >= 1000 else ''} keys that sort before index 0, out of the scan's "
                    "reach. Copy the cache from a good replica, or rebuild it (`lmdbcache precompute --overwrite`).",
                ],
            )
            return tally.checked, 0
        return tally.checked, _delete(store, tally.bad, report) if repair and tally.bad else 0


def _import_torch() -> None:
    """Import torch now, as decoding the first tensor would: seconds on a loaded machine, which the bar counted as
    the first entry's (a rate of a few entries per second and an ETA of minutes at the start)."""
    try:
        import torch  # noqa: F401
    except ImportError:  # samples without tensors decode without it
        pass


@dataclasses.dataclass
class _Tally:
    checked: int = 0  # values read and decoded
    seen: int = 0  # keys that are indices
    bad: list[int] = dataclasses.field(default_factory=list)
    stopped: bool = False  # damage the scan cannot read past stopped it (reported)


def _read_all(store: Store, length: int, report: _Report) -> _Tally:
    """Read every key, then its value, in index order, reporting each step before it is taken."""
    hook = _test_hook()
    tally, after = _Tally(), -1
    while after < _LAST_INDEX:
        report.mark(b"k", after)
        try:
            # One key at a time, so a crash names where it happened; and from ``after`` itself, not
            # after + 1: a key that is not an index can sort between two indices.
            keys = list(itertools.islice(store.iter_keys(max(after, 0), chunk=2), 2))
        except CorruptCacheError as exc:
            report.send("u", [after, str(exc)])
            tally.stopped = True
            return tally
        ahead = [k for k in keys if k != after]
        if not ahead:
            return tally
        index = ahead[0]
        if index < after:
            disorder = (
                f"keys out of order (index {index} after {after}): its B-tree is damaged. Copy the cache "
                "from a good replica, or rebuild it (`lmdbcache precompute --overwrite`)."
            )
            report.send("u", [after, disorder])
            tally.stopped = True
            return tally
        after, tally.seen = index, tally.seen + 1
        report.mark(b"r", index)
        if hook is not None and hook[1] == index:
            os.kill(os.getpid(), hook[0])
        why = _check(store, index, length)
        if why is not _GONE:
            tally.checked += 1
            if why is not None:
                tally.bad.append(index)
                report.send("b", [index, why])
    return tally


_GONE = "deleted since its key was read (by another process): not checked"


def _check(store: Store, index: int, length: int) -> str | None:
    """Why the entry of ``index`` is damaged, None if it decodes (checksums bound to its index), or _GONE."""
    try:
        found = next(iter(store.iter_raw(index, chunk=1)), None)
    except CorruptCacheError as exc:
        return str(exc)
    if found is None or found[0] != index:
        return _GONE
    if index >= length:
        return f"index {index} is outside the dataset (length {length})"
    return decode_problem(found[1], index)


def decode_problem(value: bytes, index: int) -> str | None:
    """Why ``value`` is not a sound value of ``index`` (checksums bound to the index), or None if it decodes."""
    try:
        codec.decode(value, index)
    except CorruptSampleError as exc:
        return str(exc)
    except Exception as exc:  # the codec must not raise anything else on damaged bytes; report it anyway
        return f"{type(exc).__name__}: {exc}"
    return None


def _delete(store: Store, bad: list[int], report: _Report) -> int:
    """Delete the damaged entries: all in one transaction, else one by one (some may not be deletable)."""
    report.send("d", bad)
    try:
        deleted = int(store.delete(bad))
    except CorruptCacheError:
        deleted = 0
    else:
        report.send("x", str(deleted))
        return deleted
    for index in bad:
        report.send("d", [index])
        try:
            count = int(store.delete([index]))
        except CorruptCacheError as exc:
            report.send("f", [index, str(exc)])
            continue
        deleted += count
        report.send("x", str(count))
    return deleted


def _test_hook() -> tuple[int, int] | None:
    spec = os.environ.get(TEST_SIGNAL)
    if not spec:
        return None
    name, _, index = spec.partition("@")
    return int(getattr(signal, name)), int(index)


if __name__ == "__main__":
    sys.exit(main())
