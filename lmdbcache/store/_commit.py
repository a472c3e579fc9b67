"""The queue of samples a process has decoded but not yet committed, and its committer thread.

Misses are queued (``add``) and handed to a committer thread in batches: when the queue
holds ``commit_every`` samples or ``commit_bytes`` bytes, or ``commit_interval`` seconds
after the oldest queued sample (the thread's timed wait: an idle persistent worker commits
too). Several datasets may share one queue (one store per directory per process); each
``add`` carries its dataset's policy and the queue commits as soon as the strictest policy
among the queued samples asks for it, so every object's own bound holds.

The thread writes the batch in one transaction, so the fdatasync of a commit overlaps the
caller's decoding instead of stalling it. One batch is in flight at a time; a second waits
(back-pressure: a disk slower than the decoders bounds memory).

Queued and in-flight samples stay readable (``lookup``) until they are committed. The
queue shares its store's lock (a ``threading.Condition`` on it), so every state change
happens under the one lock that readers, the pre-fork close and map growth also take.
An error in the thread (a full disk) is raised to the next caller of ``add`` or ``drain``.

Lifecycle. Each thread has its own stop flag, so a thread started while ``stop`` waits
for the previous one (the lock is released during the join) is never mistaken for the
stopped one; ``stop`` loops until no thread runs and nothing is queued. A fork child
starts with an empty queue and no thread (``reset_in_child``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from ._signals import interrupts_held

Batch = list[tuple[int, bytes]]
_POLL = 0.05  # seconds between a waiting main thread's looks for a Ctrl-C it noted


class Policy(NamedTuple):
    """When to commit: after this many samples, bytes, or seconds since the oldest queued one."""

    every: int
    bytes: int
    interval: float


class _Committer:
    __slots__ = ("stop", "thread")

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.stop = False


class CommitQueue:
    def __init__(
        self,
        lock: threading.Lock,
        write: Callable[[Batch], int],
        policy: Policy,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self._cond = threading.Condition(lock)
        self._on_idle = on_idle  # called by the thread, with the lock held, after each batch
        self._write = write  # called on the thread, without the lock: it takes what it needs
        self.policy = policy  # the default for add() calls that bring none
        self.pending: dict[int, bytes] = {}
        self.pending_bytes = 0
        self.inflight: dict[int, bytes] = {}
        self.written = 0  # samples this queue's commits actually wrote (existing keys are skipped)
        self.dropped = 0  # samples of batches whose commit failed: decoded, never committed
        # The strictest policy among the queued samples, and when the oldest must be committed.
        self._every = self._bytes = 0
        self._deadline = 0.0
        self._strictest: Policy | None = None  # the policy last merged into the thresholds
        self._error: BaseException | None = None
        self._committer: _Committer | None = None
        self._busy = False  # a thread is writing the in-flight batch

    # All methods below are called with the lock held.

    def add(self, index: int, value: bytes, policy: Policy | None = None) -> None:
        if self._error is not None:
            self.raise_error()
        if index in self.pending or index in self.inflight:
            return
        policy = policy or self.policy
        wake = False
        if not self.pending:
            self._every, self._bytes, self._strictest = policy.every, policy.bytes, policy
            self._deadline, wake = time.monotonic() + policy.interval, True
        elif policy is not self._strictest:  # another object's policy joins the queued batch
            self._strictest = policy
            self._every = min(self._every, policy.every)
            self._bytes = min(self._bytes, policy.bytes)
            deadline = time.monotonic() + policy.interval
            if deadline < self._deadline:
                self._deadline, wake = deadline, True
        self.pending[index] = value
        self.pending_bytes += len(value)
        if len(self.pending) >= self._every or self.pending_bytes >= self._bytes:
            self.hand_off()
        elif wake:
            # Only when the deadline moved earlier (the first queued sample, or a stricter policy):
            # waking the thread on every miss would cost a thread switch per sample.
            self._ensure_thread()
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """A batch is being written right now (by the thread, or by a caller's put_many)."""
        return self._busy

    def unwritten_bytes(self) -> int:
        """Bytes queued or in flight: what a drain still has to write."""
        return self.pending_bytes + sum(len(value) for value in self.inflight.values())

    def lookup(self, index: int) -> bytes | None:
        value = self.pending.get(index)
        return self.inflight.get(index) if value is None else value

    def hand_off(self) -> None:
        """Give the queued samples to the thread (waiting for the batch before them)."""
        self._wait_for_inflight()
        self.raise_error()
        if self.pending:
            self.inflight, self.pending, self.pending_bytes = self.pending, {}, 0
            self._ensure_thread()
            self._cond.notify_all()

    def drain(self) -> int:
        """Commit everything queued now and wait for it; return how many samples that was."""
        count = len(self.pending)
        self.hand_off()
        self._wait_for_inflight()
        self.raise_error()
        return count

    def _wait_for_inflight(self) -> None:
        """Wait until no batch is in flight, with a thread alive to write it: a ``stop`` cut short by Ctrl-C ends
        the thread with its batch unwritten (``_run`` checks its stop flag first), and this wait then started none
        (every later miss hung).

        A Ctrl-C never leaves the lock released: threading's ``Condition.wait`` runs Python code between its
        release and its ``try`` (and before its reacquire), and one raised there unwound with the lock released,
        so the caller's ``with`` released it again, under another thread's hold (a fork hook's "release unlocked
        lock", then a hang). In the main thread the wait notes a Ctrl-C instead and looks every ``_POLL`` seconds,
        and the Ctrl-C is raised once the lock is held again."""
        if not self.inflight:
            return
        poll = _POLL if threading.current_thread() is threading.main_thread() else None  # (handlers run there)
        with interrupts_held(block=False) as held:
            while self.inflight and not held:
                if not self._busy:
                    self._ensure_thread()
                self._cond.wait(poll)

    def begin_direct(self, batch: Batch) -> None:
        """Mark ``batch`` as being written by the caller's thread (a close or a fork waits for it)."""
        self.drain()
        self.inflight = dict(batch)
        self._busy = True  # the committer thread must not write it too

    def end_direct(self) -> None:
        self.inflight = {}
        self._busy = False
        self._cond.notify_all()

    def stop(self) -> None:
        """Drain and end the thread; on return no thread runs and nothing is queued or in flight.

        The lock is released while joining, so other threads may queue more meanwhile:
        loop until a pass finds nothing to do. Errors of a commit are raised, after the
        thread is told to stop.
        """
        while True:
            try:
                self.drain()
            finally:
                committer, self._committer = self._committer, None
                if committer is not None:
                    committer.stop = True
                    self._cond.notify_all()
                    with interrupts_held(block=False):  # never left released by a Ctrl-C (see _wait_for_inflight)
                        self._cond.release()
                        try:
                            committer.thread.join()
                        finally:
                            self._cond.acquire()
            if committer is None and not self.pending and not self.inflight:
                return

    def forget(self) -> None:
        """Drop every queued sample (the cache they belonged to was rebuilt)."""
        self.pending, self.pending_bytes = {}, 0

    def reset_in_child(self) -> None:
        """In a fork child: the parent's samples and thread do not exist here."""
        self.pending, self.pending_bytes, self.inflight = {}, 0, {}
        self._committer = None
        self._error = None
        self._busy = False

    def raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _ensure_thread(self) -> None:
        if self._committer is None:
            thread = threading.Thread(name="lmdbcache-commit", daemon=True)
            committer = self._committer = _Committer(thread)
            thread.run = lambda: self._run(committer)  # type: ignore[method-assign]
            thread.start()

    def _run(self, me: _Committer) -> None:
        cond = self._cond
        while True:
            with cond:
                while True:
                    if me.stop:
                        return
                    if self._busy:  # a stopped thread is still writing: never take its batch
                        cond.wait()
                        continue
                    if self.inflight:
                        break
                    timeout = None
                    if self.pending:
                        timeout = self._deadline - time.monotonic()
                        if timeout <= 0:
                            self.inflight, self.pending, self.pending_bytes = self.pending, {}, 0
                            break
                    # Bounded: threading refuses waits beyond TIMEOUT_MAX (a huge commit_interval).
                    cond.wait(None if timeout is None else min(timeout, 3600.0))
                self._busy = True
                inflight = self.inflight  # key order: appends to the B-tree (ints sort faster than pairs)
                batch = [(index, inflight[index]) for index in sorted(inflight)]
            error = None
            try:
                written = self._write(batch)
            except BaseException as exc:  # handed to the next caller, on its own thread
                error, written = exc, 0
            with cond:
                self.inflight = {}
                self._busy = False
                self.written += written
                if error is not None:
                    self._error = error
                    self.dropped += len(batch)
                if self._on_idle is not None:
                    self._on_idle()
                cond.notify_all()
