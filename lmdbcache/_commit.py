"""The queue of samples a process has decoded but not yet committed, and its committer thread.

Misses are queued (``add``) and handed to a committer thread in batches: when the queue
holds ``commit_every`` samples or ``commit_bytes`` bytes, or ``commit_interval`` seconds
after its first sample (the thread's timed wait: an idle persistent worker commits too).
The thread writes the batch in one transaction, so the fdatasync of a commit overlaps
the caller's decoding instead of stalling it. One batch is in flight at a time; a
second waits (back-pressure: a disk slower than the decoders bounds memory).

Queued and in-flight samples stay readable (``lookup``) until they are committed. The
queue shares its store's lock (a ``threading.Condition`` on it), so every state change
happens under the one lock that readers, the pre-fork close and map growth also take.
An error in the thread (a full disk) is raised to the next caller of ``add`` or ``drain``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Batch = list[tuple[int, bytes]]


class CommitQueue:
    def __init__(
        self,
        lock: threading.Lock,
        write: Callable[[Batch], int],
        *,
        commit_every: int,
        commit_bytes: int,
        commit_interval: float,
    ) -> None:
        self._cond = threading.Condition(lock)
        self._write = write  # called on the thread, without the lock: it takes what it needs
        self.commit_every = max(1, int(commit_every))
        self.commit_bytes = int(commit_bytes)
        self.commit_interval = float(commit_interval)
        self.pending: dict[int, bytes] = {}
        self.pending_bytes = 0
        self.pending_since = 0.0
        self.inflight: dict[int, bytes] = {}
        self.written = 0  # samples this queue's commits actually wrote (existing keys are skipped)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # All methods below are called with the lock held.

    def add(self, index: int, value: bytes) -> None:
        self.raise_error()
        if index in self.pending or index in self.inflight:
            return
        if not self.pending:
            self.pending_since = time.monotonic()
        self.pending[index] = value
        self.pending_bytes += len(value)
        if len(self.pending) >= self.commit_every or self.pending_bytes >= self.commit_bytes:
            self.hand_off()
        elif self._thread is None:
            self._start()  # its timed wait commits this sample commit_interval from now

    def lookup(self, index: int) -> bytes | None:
        value = self.pending.get(index)
        return self.inflight.get(index) if value is None else value

    def hand_off(self) -> None:
        """Give the queued samples to the thread (waiting for the batch before them)."""
        while self.inflight:
            self._cond.wait()
        self.raise_error()
        if self.pending:
            self.inflight, self.pending, self.pending_bytes = self.pending, {}, 0
            if self._thread is None:
                self._start()
            self._cond.notify_all()

    def drain(self) -> int:
        """Commit everything queued now and wait for it; return how many samples that was."""
        count = len(self.pending)
        self.hand_off()
        while self.inflight:
            self._cond.wait()
        self.raise_error()
        return count

    def begin_direct(self, batch: Batch) -> None:
        """Mark ``batch`` as being written by the caller's thread (a close or a fork waits for it)."""
        self.drain()
        self.inflight = dict(batch)

    def end_direct(self) -> None:
        self.inflight = {}
        self._cond.notify_all()

    def stop(self) -> None:
        """Drain, then end the thread (a later ``add`` starts a new one)."""
        try:
            self.drain()
        finally:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._stopping = True
                self._cond.notify_all()
                self._cond.release()
                try:
                    thread.join()
                finally:
                    self._cond.acquire()
                    self._stopping = False

    def forget(self) -> None:
        """Drop every uncommitted sample (the cache they belonged to was rebuilt)."""
        self.pending, self.pending_bytes = {}, 0

    def raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmdbcache-commit", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self.inflight:
                    if self._stopping:
                        return
                    timeout = None
                    if self.pending:
                        timeout = self.pending_since + self.commit_interval - time.monotonic()
                        if timeout <= 0:
                            self.inflight, self.pending, self.pending_bytes = self.pending, {}, 0
                            break
                    cond.wait(timeout)
                batch = sorted(self.inflight.items())  # key order: appends to the B-tree
            error = None
            try:
                written = self._write(batch)
            except BaseException as exc:  # handed to the next caller, on its own thread
                error, written = exc, 0
            with cond:
                self.inflight = {}
                self.written += written
                if error is not None:
                    self._error = error
                cond.notify_all()
