"""Ctrl-C around work that must not be cut in half: held until the block ends, ignored during it, or kept out
of the standard library's lock wrappers.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, so an
interrupt that lands between an fsync and the removal of the unsynced marker would leave the
marker for good (issue #22), and one inside precompute's last commit would lose the batch.
Signal handlers run in the main thread only, so in other threads these blocks change nothing.

The standard library's Python-level lock wrappers have the same hole: ``Condition.__enter__`` is
``return self._lock.__enter__()``, so an interrupt raised in that frame after the acquire leaves the lock
held for good (a multiprocessing ``Lock``'s ``__enter__`` too, a ``Queue``'s put and get between their
acquire and their ``try``, and the ``with`` statement's own first instruction once ``__enter__`` has
returned). A DataLoader's index queue is one: precompute interrupted there hung in the DataLoader's own
shutdown, which puts into that queue (``interrupts_outside_locks``). The library's own locks are taken by
``with`` on C-level locks, which has no such hole (``acquire()`` then ``try`` had one: tests/test_interrupts.py).
"""

from __future__ import annotations

import _signal
import _thread
import contextlib
import dis
import multiprocessing.queues
import multiprocessing.synchronize
import queue
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = [
    "give_back_sigint",
    "hold_sigint",
    "interrupts_held",
    "interrupts_ignored",
    "interrupts_outside_locks",
    "redeliver_dropped_interrupts",
]

# The functions (file, name) in which a KeyboardInterrupt can leave a lock held (see the module docstring).
_LOCK_WRAPPERS = {
    *((threading.__file__, name) for name in ("__enter__", "__exit__", "_release_save", "_acquire_restore")),
    *((multiprocessing.synchronize.__file__, name) for name in ("__enter__", "__exit__")),
    *((multiprocessing.queues.__file__, name) for name in ("put", "get")),
}
_WITH_OPS = {dis.opmap[name] for name in ("BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH") if name in dis.opmap}
_RETRY = 0.002  # seconds before an interrupt that landed in a lock wrapper is delivered again


@contextlib.contextmanager
def interrupts_held(block: bool = True, reraise: bool = True) -> Iterator[list[int]]:
    """Hold Ctrl-C until the block has run, then raise it (the list it yields says whether one came).

    ``reraise=False`` only notes it: the caller reports the interruption itself. With ``block``
    the signal is also blocked in the mask, which processes started inside the block inherit
    (through fork and exec): a worker cannot be interrupted before it sets its own handler.
    """
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield held  # Python runs signal handlers in the main thread only (and one set from C could not be put back)
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


def hold_sigint() -> tuple[object, list[int]] | None:
    """Note a Ctrl-C instead of raising it, until ``give_back_sigint``: for the fork hooks, which hold the stores'
    locks from one hook to the next and whose exceptions Python prints and drops. None (nothing to hold) in another
    thread than the main one (handlers run there), and when the handler in force is not a Python callable: under
    ``SIG_IGN`` or ``SIG_DFL`` a Ctrl-C raises nothing (it is ignored, or ends the process, as without the
    library), and one set from C could not be put back."""
    if threading.current_thread() is not threading.main_thread() or not callable(signal.getsignal(signal.SIGINT)):
        return None
    held: list[int] = []
    return signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)), held


def give_back_sigint(state: tuple[object, list[int]] | None, deliver: bool) -> None:
    """Put back the handler ``hold_sigint`` replaced. With ``deliver``, a Ctrl-C that came meanwhile is sent again
    ``_RETRY`` seconds later from a thread of its own: raised here it would be a fork hook's exception, printed and
    dropped; a moment later the caller's own code takes it."""
    if state is None:
        return
    previous, held = state
    # First: CPython runs a signal still pending through the handler in force before it changes one, so a Ctrl-C
    # that came in the fork's last instants is noted now, not lost after the test below (precompute lost one so).
    # The C function, not signal.py's wrapper: a Ctrl-C after it is raised where it lands (in the few instructions
    # left of a hook it is dropped, as Python drops any fork hook's exception).
    _signal.signal(signal.SIGINT, previous)
    if held and deliver:
        _thread.start_new_thread(_deliver_later, (threading.main_thread().ident,))


def _deliver_later(main: int | None) -> None:
    time.sleep(_RETRY)
    if main is not None:
        signal.pthread_kill(main, signal.SIGINT)


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


@contextlib.contextmanager
def interrupts_outside_locks() -> Iterator[None]:
    """Ctrl-C raised as usual during the block, except inside a lock wrapper of the standard library or on a
    ``with`` statement's first instruction (see the module docstring), where it is delivered again ``_RETRY``
    seconds later, and again until it lands elsewhere: no interrupt leaves a lock held. One still pending when
    the block ends is raised there.

    The handler asks a helper thread for the later delivery through a C-level ``SimpleQueue``: its ``put`` runs
    no bytecode, so no second interrupt can be taken inside the handler and raised out of the wrapper (starting a
    timer thread there did run some, and lost or leaked about one round in ten under load)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs signal handlers in the main thread only
        return
    requests: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: deliver one again; False: stop

    def deliver() -> None:
        while requests.get():
            time.sleep(_RETRY)
            _thread.interrupt_main()

    def handler(signum: int, frame: FrameType | None) -> None:
        if frame is not None and _in_lock_wrapper(frame):
            requests.put(True)  # a moment later, the wrapper's frame has returned
            return
        if callable(previous):
            previous(signum, frame)  # Python's default raises KeyboardInterrupt
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    helper = threading.Thread(target=deliver, name="lmdbcache-interrupts", daemon=True)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        helper.start()  # inside: a Ctrl-C during its start still ends it (the False below is queued first)
        yield
    finally:
        try:
            requests.put(False)
            if helper.is_alive():
                helper.join()  # a delivery still asked for reaches this handler first, and is raised here
        finally:
            signal.signal(signal.SIGINT, previous)


def _in_lock_wrapper(frame: FrameType) -> bool:
    """The frame runs a lock wrapper (``_LOCK_WRAPPERS``), or stands on a ``with`` statement whose ``__enter__``
    (a wrapper's) has returned: an exception there is outside the block that would release the lock."""
    code = frame.f_code
    if (code.co_filename, code.co_name) in _LOCK_WRAPPERS:
        return True
    at = frame.f_lasti
    return 0 <= at < len(code.co_code) and code.co_code[at] in _WITH_OPS


def redeliver_dropped_interrupts() -> None:
    """From now on, a Ctrl-C that Python drops is delivered again (idempotent; the loader calls it as it iterates).

    A ``KeyboardInterrupt`` raised inside a weakref callback or a finalizer (Python runs them wherever an object
    dies: ``threading``'s ``WeakSet`` of threads when a finished thread object is freed, say) is printed as
    "Exception ignored in ..." and lost, so a user's one Ctrl-C did not stop ``for batch in loader`` (issue 38:
    1 of 150 in the test's tight loop after the loader's own callbacks were gone). ``sys.unraisablehook`` is
    wrapped: such an interrupt is sent again to the main thread ``_RETRY`` seconds later, where the caller's own code
    takes it; anything else goes to the previous hook, as before.
    """
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "redelivers", False):
        return  # installed (and not replaced since: pytest, say, puts its own back after each test)

    def hook(unraisable: object) -> None:
        exc_type = getattr(unraisable, "exc_type", None)
        main = threading.current_thread() is threading.main_thread()
        if main and exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # A moment later, from a thread of its own (as give_back_sigint): raised here, in the hook, it would be
            # dropped again.
            _thread.start_new_thread(_deliver_later, (threading.main_thread().ident,))
            return
        previous(unraisable)  # type: ignore[arg-type]

    hook.redelivers = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
