"""verify's side of the scan: start ``_scan`` in a child process, read its report, say what it found.

A damaged file can crash LMDB's reader with SIGSEGV or SIGBUS, which no exception can catch,
so the scan (and ``repair``'s deletions) run in a child; this process never opens the file.
The child reports one line per step on a pipe (the messages are listed in ``_scan``), so when
it dies this side knows what it was reading and says where.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import IO, Any

from ..errors import LmdbCacheError, LmdbCacheWarning
from . import _scan

__all__ = ["Progress", "VerifyResult", "verify"]

Progress = Callable[[int], Any] | None


@dataclasses.dataclass
class VerifyResult:
    """What ``verify`` found. ``bad`` entries can be deleted (``repair``); ``crashed`` and
    ``unreadable`` mean the file itself is damaged, which deleting entries cannot fix."""

    checked: int  # entries read and decoded
    bad: list[int]  # damaged entries, in index order
    repaired: int = 0  # of those, how many ``repair`` deleted
    # The file crashed the reader (a signal): where and with what, e.g. "the LMDB file crashed
    # the reader at index 7 (after 7 good entries) with SIGBUS". The scan stopped there.
    crashed: str | None = None
    # The scan met damage it cannot read past (a key that is not an index, a broken B-tree page).
    unreadable: str | None = None
    unrepaired: dict[int, str] = dataclasses.field(default_factory=dict)  # bad entries repair could not delete
    signal: str | None = None  # the signal that ended the reader ("SIGBUS"), with ``crashed``

    @property
    def intact(self) -> bool:
        return not self.bad and self.crashed is None and self.unreadable is None

    @property
    def file_damaged(self) -> bool:
        """The file itself is damaged, beyond what deleting values can fix: it crashed the
        reader (SIGSEGV, SIGBUS, ...), or holds damage the scan cannot read past. A reader
        killed from outside (SIGKILL: out of memory?) sets ``crashed`` but not this."""
        return self.unreadable is not None or self.signal in _FAULTS


# Signals the file's damage itself can cause (bad page numbers and lengths); others came from outside.
_FAULTS = {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"}
# The child imports the scanner by the name of the module imported here: an import check sees the edge.
_CHILD = f"import sys; sys.path.insert(0, sys.argv[1]); from {_scan.__name__} import main; sys.exit(main(sys.argv[2:]))"


def verify(
    path: str | os.PathLike[str],
    *,
    repair: bool = False,
    progress: Progress = None,
    started: Callable[[int], Any] | None = None,
) -> VerifyResult:
    """Decode every stored value and check its checksums (bound to its index); with ``repair``, delete the bad ones.

    Deleted entries are decoded again from the source on their next read (or by the next
    ``precompute``). Entries whose index is outside the dataset count as bad. ``started``
    is called once with the number of entries to check, ``progress(1)`` once per entry.

    The scan runs in a child process (``_scan``): a damaged file can crash LMDB's reader
    with SIGSEGV or SIGBUS, which no exception can catch. Such a crash comes back as
    ``crashed`` (the index it was reading and the signal), damage the scan cannot read
    past as ``unreadable``; in both cases nothing is deleted, whatever ``repair`` says.
    This process never opens the file. Errors (no cache at ``path``, a read-only
    directory with ``repair``) are raised here as the child met them.
    """
    path = os.path.abspath(os.fspath(path))
    with tempfile.TemporaryFile() as output:
        read_fd, child = _start_scan(path, repair, output)
        state = _ScanState()
        try:
            with os.fdopen(read_fd, "rb") as pipe:
                for line in pipe:
                    state.read(line, progress, started)
            code = child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
        return _outcome(path, state, code, output)


def _start_scan(path: str, repair: bool, output: IO[bytes]) -> tuple[int, subprocess.Popen[bytes]]:
    """Start the scan of ``path`` in a child; return the pipe it reports on and the child."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    read_fd, write_fd = os.pipe()
    try:
        argv = [sys.executable, "-c", _CHILD, package_parent, path, str(write_fd)]
        child = subprocess.Popen(
            [*argv, *(["--repair"] if repair else [])],
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return read_fd, child


def _outcome(path: str, state: _ScanState, code: int, output: IO[bytes]) -> VerifyResult:
    """The result of a scan that has ended with exit status ``code`` (or the error it met)."""
    if state.error is not None:
        raise state.error
    if state.done is not None:
        return state.result()
    if code < 0:
        return state.result(crash=-code)
    if code == 130:
        raise KeyboardInterrupt  # the child got the terminal's Ctrl-C first
    output.seek(0)
    lines = output.read().decode(errors="replace").strip().splitlines() or [f"exit status {code}"]
    raise LmdbCacheError(
        f"verify's reader of '{path}' failed ({lines[-1]}). This is a bug in lmdbcache; please report it."
    )


class _ScanState:
    """The parent's view of the child's report (see ``_scan`` for the messages)."""

    def __init__(self) -> None:
        self.reading: tuple[str, Any] = ("opening", None)  # what the child was doing last
        self.started = 0  # values the child began to read
        self.bad: dict[int, str] = {}
        self.unreadable: str | None = None
        self.unrepaired: dict[int, str] = {}
        self.deleted = 0
        self.error: BaseException | None = None
        self.done: tuple[int, int] | None = None

    def read(self, line: bytes, progress: Progress, started: Callable[[int], Any] | None) -> None:
        tag, _, text = line.decode().rstrip("\n").partition(" ")
        if tag == "r":
            self.reading = ("value", int(text))
            self.started += 1
            if progress is not None:
                progress(1)
        elif tag == "k":
            self.reading = ("keys", int(text))
        elif tag == "b":
            index, why = json.loads(text)
            self.bad[index] = why
        elif tag == "s":
            self.reading = ("keys", -1)
            total = int(text.split()[1])
            if started is not None and total >= 0:
                started(total)
        elif tag == "u":
            after, why = json.loads(text)
            good = self.started - len(self.bad)
            if after is None:
                self.unreadable = f"after {good} good entries, {why}"
            else:
                where = "the start" if after < 0 else f"index {after}"
                self.unreadable = f"the scan cannot read past {where} (after {good} good entries): {why}"
        elif tag == "d":
            self.reading = ("delete", json.loads(text))
        elif tag == "x":
            self.deleted += int(text)
        elif tag == "f":
            index, why = json.loads(text)
            self.unrepaired[index] = why
        elif tag == "w":
            category, message = json.loads(text)
            warnings.warn(message, LmdbCacheWarning if category == "LmdbCacheWarning" else UserWarning, stacklevel=3)
        elif tag == "e":
            name, message = json.loads(text)
            self.error = _error_class(name)(message)
        elif tag == "z":
            checked, deleted = map(int, text.split())
            self.done = (checked, deleted)

    def result(self, crash: int | None = None) -> VerifyResult:
        bad = sorted(self.bad)
        if crash is None:
            checked, deleted = self.done or (self.started, 0)
            return VerifyResult(checked, bad, deleted, None, self.unreadable, self.unrepaired)
        name = signal.Signals(crash).name if crash in signal.Signals._value2member_map_ else f"signal {crash}"
        what, where = self.reading
        checked = self.started - (what == "value")
        good = checked - len(bad)
        if what == "value":
            place = f"at index {where} (after {good} good entries)"
        elif what == "keys":
            entry = "the first entry" if where < 0 else f"the entry after index {where}"
            place = f"at {entry} (after {good} good entries)"
        elif what == "delete":
            place = f"while deleting the damaged entries {', '.join(map(str, where[:10]))}"
        else:
            place = "while opening the cache"
        if name in _FAULTS:
            crashed = f"the LMDB file crashed the reader {place} with {name}"
        else:
            crashed = f"the reader was killed {place} by {name} (out of memory? a damaged length can ask for gigabytes)"
        return VerifyResult(checked, bad, self.deleted, crashed, self.unreadable, self.unrepaired, name)


def _error_class(name: str) -> type[BaseException]:
    """The class of an error the child met, by name: one of ours or a builtin OSError."""
    from .. import errors

    found = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, (LmdbCacheError, OSError)):
        return found
    return LmdbCacheError
