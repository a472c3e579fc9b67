"""One Store per cache directory per process, and what keeps processes apart.

``open_store``/``release`` hand out this process's Store for a directory, initialized (datasets,
precompute and the tools share it: one LMDB environment per file per process, as LMDB
requires); ``Store.owned`` says whether the caller's process may use a store it holds.

Fork. Before every ``fork()`` each store commits its queue, stops its committer thread and
closes its environment, holding its lock across the fork so no thread reopens it; the child
starts with an empty registry (the parent's stores stay reachable from datasets, which see
the pid change and acquire their own). LMDB forbids using an environment across fork, and
py-lmdb 3 refuses to open one in a child whose parent holds it open.

Exit. Queued samples are committed at interpreter exit (atexit) and, in multiprocessing
children such as DataLoader workers, by multiprocessing's exit finalizers (workers end with
``os._exit``, which skips atexit). A script that ends with a DataLoader still alive (persistent
workers, or a loop left with ``break``) does not stop its workers: multiprocessing's own exit
hook sends each daemonic child SIGTERM and waits for it, and torch's worker handler for SIGTERM
calls ``_exit`` at once, which threw away every sample the worker had queued (issue #22). So a
multiprocessing child that opens a cache handles SIGTERM itself: the handler raises
``SystemExit`` in the main thread, which unwinds whatever it was doing (releasing the locks it
held), and the process then ends through multiprocessing's finalizers, which commit and sync the
queue, and then ``_exit`` at once as torch's handler would (the remaining finalizers could wait
forever on a result queue the parent no longer reads). The parent is waiting for it in ``join``;
the exit code is 0, as torch's handler gives, and a watchdog ends the process after 60 s if the
code it interrupted swallowed the ``SystemExit``. A handler the user installed from Python is
left alone.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import CacheClosedError, LmdbCacheWarning
from ._signals import give_back_sigint, hold_sigint
from ._store import Store

__all__ = ["acquire", "freeze_inherited", "open_store", "opened", "release"]

_pid = os.getpid()
_stores: dict[str, Store] = {}
_inherited = False  # this process was forked while caches were open (see freeze_inherited)
_frozen = False  # freeze_inherited froze this process's heap (once is enough)
_registry_lock = threading.Lock()
_exit_flush_pid = 0


def acquire(path: str, **options: Any) -> Store:
    """This process's Store for ``path`` (one per directory per process), with one more reference.

    Later callers share the first caller's store. Per-object options (checksum, commit
    policy) travel with each call instead; of the per-environment ones a larger
    ``map_size`` is honoured and a different ``max_readers`` is a warning (``Store.reconcile``).
    """
    if _flushed_pid == os.getpid():  # a thread still reading after the exit's flush: nothing would commit its misses
        raise CacheClosedError(
            f"Cache '{path}' was committed and closed at interpreter exit; a thread still reading it (a daemon "
            "thread) cannot reopen it. End such threads before the script ends, or join them."
        )
    key = os.path.realpath(path)
    with _registry_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = Store(os.path.abspath(path), **options)
            store.claim()
            _register_exit_flush()
            created = True
        else:
            created = False
        store.hold()
    if not created:
        try:
            store.reconcile(
                options.get("map_size", store.map_size),
                options.get("max_readers", store.max_readers),
                options.get("sync", False),
            )
        except BaseException:
            release(store)
            raise
    return store


def open_store(
    path: str,
    *,
    length: int | None = None,
    fingerprint: str | None = None,
    overwrite: bool = False,
    create: bool = True,
    compress: str | None = None,
    compress_level: int | None = None,
    pack: int = 0,
    need_codec: bool = True,
    **options: Any,
) -> tuple[Store, dict[str, Any]]:
    """This process's Store for ``path``, initialized (``Store.initialize``), and the cache's metadata.

    The caller owns one reference and gives it back with ``release``; if initializing
    raises, the reference is released here and nothing stays open.
    """
    store = acquire(path, **options)
    try:
        meta = store.initialize(
            length=length,
            fingerprint=fingerprint,
            overwrite=overwrite,
            create=create,
            compress=compress,
            compress_level=compress_level,
            pack=pack,
            need_codec=need_codec,
        )
    except BaseException:
        release(store)
        raise
    return store, meta


@contextmanager
def opened(path: str, **options: Any) -> Iterator[Store]:
    """``open_store`` an existing cache (never creating one) for the length of a ``with`` block."""
    store, _ = open_store(path, create=False, **options)
    try:
        yield store
    finally:
        release(store)


def release(store: Store) -> None:
    """Drop one reference; the last one commits and closes the environment."""
    with _registry_lock:
        if not store.owned:
            return  # inherited across fork: the parent owns it
        if store.let_go() > 0:
            return
        for key, value in list(_stores.items()):
            if value is store:
                del _stores[key]
        # Closed inside the registry lock: a new Store for the same path (a reopen from another
        # thread) waits until this environment is closed, as LMDB's one-per-process rule needs.
        store.retire()


# What the running fork's _before_fork took, so the after hooks release that and nothing else.
_forking_stores: list[Store] = []
_forking_registry = False
_forking_sigint: tuple[object, list[int]] | None = None  # _signals.hold_sigint's


def _before_fork() -> None:
    # Commit and close every environment so the child inherits none (see module docstring).
    # The locks stay held across the fork so no thread reopens one in between. A Ctrl-C during the hooks waits
    # for their end: one raised in a hook is dropped by Python, and it left the locks half taken and the after
    # hooks releasing locks other threads held (a reader then ran on an environment being closed and the process
    # crashed, or a committer stopped with its batch unwritten and every later miss hung).
    global _forking_registry, _forking_sigint
    _forking_sigint = hold_sigint()
    _registry_lock.acquire()
    _forking_registry = True
    for store in _stores.values():
        store.before_fork()
        _forking_stores.append(store)


def _after_fork_parent() -> None:
    global _forking_registry, _forking_sigint
    for store in _forking_stores:
        store.after_fork(in_child=False)
    _forking_stores.clear()
    if _forking_registry:
        _forking_registry = False
        _registry_lock.release()
    sigint, _forking_sigint = _forking_sigint, None
    give_back_sigint(sigint, deliver=True)  # the parent's Ctrl-C, raised in its own code a moment later


def _after_fork_child() -> None:
    global _pid, _inherited, _forking_registry, _forking_sigint
    _pid = os.getpid()
    # The child opens its own stores. The parent's objects stay reachable from datasets,
    # which see the pid change and re-acquire; unlock them so nothing can hang on them.
    _inherited = bool(_stores)  # see freeze_inherited
    for store in _stores.values():
        store.disown()
        store.after_fork(in_child=True)  # (whoever held its lock: no thread of the child does)
    _stores.clear()
    _forking_stores.clear()
    _forking_registry = False
    if _registry_lock.locked():
        _registry_lock.release()
    sigint, _forking_sigint = _forking_sigint, None
    give_back_sigint(sigint, deliver=False)  # a Ctrl-C from before this process existed is its parent's


def freeze_inherited(option: bool | None = None) -> None:
    """``gc.freeze()`` once in a DataLoader worker, as ``CachedDataset(freeze_worker_gc=option)`` asks.

    ``None`` (the default): only in a worker forked while caches were open, where it pays.
    ``True``: in any DataLoader worker (spawn and forkserver too). ``False``: never.

    Every object inherited from the parent goes into the collector's permanent generation,
    untouched. A full collection in the worker would otherwise write to each one's header and
    so copy every page of the parent's objects into the worker: 35 MiB per worker in make
    bench's small workload, set off by a few hundred kept pack views (issue #11; Python's gc
    docs advise freezing for fork without exec). The cost: every object alive then, the
    user's too, is never collected in that worker, an inherited cycle included; a worker
    (it lives for an epoch or a run, its objects mostly its parent's) rarely notices, and
    ``False`` opts out. Only in a DataLoader worker: another long-lived forked child might.
    Called by ``CachedDataset`` when it acquires its store.
    """
    global _inherited, _frozen
    if option is False or _frozen or (option is None and not _inherited):
        return
    from torch.utils.data import get_worker_info  # torch is loaded: a dataset asks

    if get_worker_info() is not None:
        _inherited, _frozen = False, True
        gc.freeze()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)


_flushed_pid = 0  # the process whose exit hook ran (_at_exit)


def _at_exit() -> None:
    """The exit hook: ``_flush_all_at_exit`` once per process. In a main process both atexit and multiprocessing's
    own exit hook (which runs the ``Finalize`` below) call it, and a close failing at exit warned twice (two
    tracebacks under ``-W error``, after pytest's summary)."""
    global _flushed_pid
    if _flushed_pid != os.getpid():
        _flushed_pid = os.getpid()
        _flush_all_at_exit()


def _flush_all_at_exit() -> None:
    for store in list(_stores.values()):
        if store.owned:
            dropped = store.writer.dropped
            try:
                # At exit for good (``_at_exit``): a daemon thread's later miss raises CacheClosedError instead of
                # reopening the store into a queue nothing would commit (samples it returned were lost, silently).
                if _flushed_pid == os.getpid():
                    store.retire()
                else:
                    store.close()
            except Exception as exc:
                # Only a loss is worth a word: a sync that failed after every commit (the cache directory deleted
                # already, say: a TemporaryDirectory) lost nothing, and a later crash is what the marker is for.
                lost = store.writer.uncommitted() - dropped
                if lost > 0:
                    warnings.warn(
                        f"lmdbcache: {lost} samples decoded by this process were not committed to cache "
                        f"'{store.path}' at exit (they are decoded again when next read): {exc}",
                        LmdbCacheWarning,
                        stacklevel=1,
                    )
    if _terminating:
        # Ended by SIGTERM: the queue is committed and synced; now end as torch's handler would have
        # (``_exit``), before the other finalizers: joining a result queue's feeder thread whose pipe the
        # parent no longer reads would wait forever, and the parent waits for this process.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _register_exit_flush() -> None:
    """Commit queued samples at exit: atexit in a main process, multiprocessing finalizers in workers."""
    global _exit_flush_pid
    if _exit_flush_pid == _pid:
        return
    _exit_flush_pid = _pid
    atexit.register(_at_exit)
    import multiprocessing
    import multiprocessing.util

    # Process._bootstrap runs these (not atexit) before a worker's os._exit().
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)
    if multiprocessing.parent_process() is not None:
        _commit_on_sigterm()


_terminating = False  # SIGTERM arrived: the exit flush ends the process (_flush_all_at_exit)
_SIGTERM_GRACE = 60.0  # seconds a SIGTERMed child has to commit before it ends regardless


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    global _terminating
    if _terminating:
        return  # a second SIGTERM: the first one's exit is under way
    _terminating = True
    # Whatever the code running now does with the SystemExit (a bare ``except BaseException`` in a
    # dataset could swallow it), the process ends: the parent is waiting for it in ``join``.
    threading.Thread(target=_exit_after, args=(_SIGTERM_GRACE,), name="lmdbcache-sigterm", daemon=True).start()
    raise SystemExit(0)  # Process._bootstrap runs the finalizers (our flush first), then exits


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(0)


def _commit_on_sigterm() -> None:
    """In a multiprocessing child: SIGTERM ends the process through its finalizers, which commit the queue."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set a handler; the finalizers still run at a normal end
    try:
        current = signal.getsignal(signal.SIGTERM)
    except (AttributeError, ValueError):
        return
    # SIG_DFL, or None: a handler set outside Python (torch's worker handler, which calls _exit).
    if current in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
