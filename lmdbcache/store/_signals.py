"""Ctrl-C around work that must not be cut in half: held until the block ends, or ignored during it.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, so an
interrupt that lands between an fsync and the removal of the unsynced marker would leave the
marker for good (issue #22), and one inside precompute's last commit would lose the batch.
Signal handlers run in the main thread only, so in other threads these blocks change nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["interrupts_held", "interrupts_ignored"]


@contextlib.contextmanager
def interrupts_held(block: bool = True, reraise: bool = True) -> Iterator[list[int]]:
    """Hold Ctrl-C until the block has run, then raise it (the list it yields says whether one came).

    ``reraise=False`` only notes it: the caller reports the interruption itself. With ``block``
    the signal is also blocked in the mask, which processes started inside the block inherit
    (through fork and exec): a worker cannot be interrupted before it sets its own handler.
    """
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held  # Python runs signal handlers in the main thread only
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if block else None
    try:
        yield held
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)
    if held and reraise:
        signal.raise_signal(signal.SIGINT)  # to the handler in force again: KeyboardInterrupt by default


@contextlib.contextmanager
def interrupts_ignored() -> Iterator[None]:
    """Ignore Ctrl-C during the block (a second Ctrl-C must not abort the commit the first one asked for)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
