"""The next epoch's pass, built ahead while the consumer holds an epoch's last batch (``augment=`` loaders).

``Loader._run`` starts it at the last batch (``start``, owned by the pass that hands that batch out),
``iter`` takes it when it fits (``take``), and a break, an exception, ``set_epoch`` to another epoch,
``close()`` or the Loader's collection stop it (docs/guarantees.md says when it lives).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from ._pass import Pass, PassSpec
from ._source import Mapped

__all__ = ["Spare"]


class Spare:
    """The next epoch's pass, started while the consumer holds the last batch of an epoch (``augment=`` loaders).

    Without it an epoch's first batch is built only when ``iter`` asks for it, and a trainer waits that
    long at every epoch start (an augmented batch of 64 takes milliseconds). The batches of epoch e + 1
    are a pure function of the loader's own order, so its pass can start early: it builds the first batch
    only (work done outside the epoch, and lost if no pass follows, stays one batch) until ``take`` hands it
    to a pass asking for exactly what it builds: an equal ``PassSpec`` (seed, dataset, augmentation, threads,
    everything a batch depends on), the same epoch and batches, from the first batch. Otherwise it is stopped.
    One spare at a time, under a lock: a newer one stops the older, none starts after ``stop(close=True)``
    (a ``close()`` racing the last batch from another thread). A forked child drops the spare it inherited
    without stopping it: its threads live in the parent only (issue 26: the five bugs of its first version).
    """

    def __init__(self) -> None:
        self.closed = False
        self._owner()

    def _owner(self) -> None:
        # A fresh lock in each process: a child forked while another thread held it would wait forever.
        self.pid, self.lock = os.getpid(), threading.Lock()
        self.run: Pass | None = None

    def _swap(self, run: Pass | None, owner: Any = None, close: bool = False) -> Pass | None:
        """Put ``run`` in place of the spare (only if the spare was started by ``owner``, when given); the one
        it replaced."""
        if self.pid != os.getpid():
            self._owner()  # the parent's pass: its threads do not exist here
        with self.lock:
            self.closed = self.closed or close
            if owner is not None and (self.run is None or self.run.owner is not owner):
                return None
            if run is not None and self.closed:
                return run  # closed meanwhile: the caller stops the new pass, none is kept
            old, self.run = self.run, run
        return old

    def start(self, owner: Any, spec: PassSpec, epoch: int, batches: Sequence[list[int]], key: tuple[Any, ...]) -> None:
        """Start epoch ``epoch``'s pass (held after its first batch) for ``owner`` (``stop(owner=)``), unless
        closed. ``key``: what the Loader made ``batches`` of (its epoch, seed, order options), for ``batches``.
        Kept before its threads start: a KeyboardInterrupt anywhere here leaves it where close() finds it."""
        if self.closed:
            return
        run = Pass(spec, epoch, batches, 0, held=True)
        run.key, run.owner = key, owner
        old = self._swap(run)
        if old is not None:
            old.stop()  # the older spare, or ``run`` itself when closed meanwhile
        if old is not run:
            try:
                run._begin()
            except RuntimeError:  # no thread can start (the interpreter's shutdown): the next epoch starts its own
                self.stop(owner=owner)

    def take(self, spec: PassSpec, epoch: int, batches: Sequence[list[int]], start: int) -> Pass | None:
        """The spare if it builds exactly these batches (it runs on at once), else None (it is stopped)."""
        run = self._swap(None)
        if run is None:
            return None
        if run.spec == spec and run.epoch == epoch and (run.batches is batches or run.batches == batches) and not start:
            try:  # the cache rebuilt (or closed) since its first batch was read?
                for cache in spec.dataset.leaves if isinstance(spec.dataset, Mapped) else [spec.dataset]:
                    cache.read_batch([], _no_copy)  # one lock and read transaction: the build is checked
            except Exception:  # whatever it is, the fresh pass below raises it at its batch 0
                pass
            else:
                run.go.set()
                return run
        run.stop()
        return None

    def batches(self, key: tuple[Any, ...]) -> Sequence[list[int]] | None:
        """The spare's batches if the Loader made them of ``key``: ``iter`` need not build them again."""
        run = self.run
        return run.batches if run is not None and run.key == key and self.pid == os.getpid() else None

    def keep(self, epoch: int) -> None:
        """Stop the spare now unless it is of ``epoch`` (the Loader's ``set_epoch``)."""
        run = self.run
        if run is not None and run.epoch != epoch:
            self.stop(owner=run.owner)

    def stop(self, owner: Any = None, close: bool = False) -> None:
        """Stop the spare (only if ``owner`` started it, when given); with ``close`` start none again."""
        run = self._swap(None, owner, close)
        if run is not None:
            run.stop()


def _no_copy(views: list[Any], checks: list[bool]) -> None:
    return None
