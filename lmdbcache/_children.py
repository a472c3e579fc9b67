"""Worker processes that die with the process that started them, however it dies (issue 38).

torch's DataLoader worker watches its parent by comparing ``os.getppid()`` with the pid it read
when its loop began (every 5 s, while idle). A parent SIGKILLed before that read leaves a worker
that takes init (pid 1), or a subreaper, for its parent: it polls its index queue forever. So
``die_with_parent`` is each worker's first step (its ``worker_init_fn``, which torch runs before
that read): it asks the kernel to SIGKILL the worker when its parent ends (``PR_SET_PDEATHSIG``,
Linux), then checks that its parent is still the process that started it, which closes the window
where the parent died before the request; a worker whose parent is gone exits there. Elsewhere
than on Linux only the check runs, and torch's watch covers the rest (a worker busy in a sample
when its parent dies finishes that sample first). Under ``forkserver`` a worker's parent is the
fork server, a child of the starting process, which outlives it (``_watch`` says why): such a
worker watches the starting process itself, on a thread (elsewhere than on Linux, where there is
no ``/proc`` to tell a fork server from a process that adopted an orphan, only pid 1 is refused).

The kernel sends the signal when the *thread* that forked the worker ends, not its process
(prctl(2)), and a DataLoader forks its workers on the thread that calls ``iter()``. The main
thread lives as long as the process; a thread of the caller's may end while the workers still
serve the process. ``start_workers`` calls ``iter()`` on the main thread directly, and from any
other thread on a thread of its own that lives until the workers are shut down.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["die_with_parent", "start_workers"]

_T = TypeVar("_T")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, worker_id: int = 0) -> None:
    """In a worker started by process ``parent``: be SIGKILLed when the parent ends; exit now if it has ended.

    Shaped as a DataLoader ``worker_init_fn`` once ``parent`` is bound (``functools.partial``, which pickles).
    """
    linux = sys.platform.startswith("linux")
    if linux:
        _request_death_signal()
    ppid = os.getppid()  # read after the request: a parent that ends from here on sends the signal
    if ppid == parent or (not linux and ppid != 1):  # no /proc to tell a fork server from an adopter there
        return
    if ppid <= 1 or _parent_of(ppid) != parent or not _watch(parent):
        os._exit(0)  # the parent is gone: nobody reads this worker's results, and nobody would stop it


def _watch(parent: int) -> bool:
    """Under ``forkserver``: SIGKILL this worker when ``parent``, its grandparent, ends; False if it already has.

    The fork server does not end with ``parent``: every worker holds its "alive" pipe open, so it waits
    for them while they wait for it (a SIGKILLed loader under forkserver left both for good). A daemon
    thread here waits for ``parent`` instead: on a pidfd (Linux 5.3), else polling the fork server's parent.
    """
    try:
        pidfd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd_open, or ``parent`` is gone already
        pidfd = None
    if _parent_of(os.getppid()) != parent:  # checked after the open: the pidfd is ``parent``'s, not a reused pid's
        return False
    threading.Thread(target=_wait_for_end, args=(parent, pidfd), name="lmdbcache-parent-watch", daemon=True).start()
    return True


def _wait_for_end(parent: int, pidfd: int | None) -> None:
    if pidfd is not None:
        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        poll.poll()  # readable once the process has ended
    else:
        while _parent_of(os.getppid()) == parent:  # the fork server is adopted by init when ``parent`` ends
            time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def _request_death_signal() -> None:
    import ctypes  # only in a worker: ``import lmdbcache`` stays light

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl: the check and torch's watch remain
        return
    prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
          ctypes.c_ulong(0))  # fmt: skip


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])  # after "(comm)", which may hold spaces: state, ppid
    except (OSError, ValueError, IndexError):  # no /proc (not Linux), or the process is gone
        return None


def start_workers(start: Callable[[], _T]) -> tuple[_T, Callable[[], None]]:
    """``start()`` (a DataLoader's ``iter()``, which forks its workers) on a thread that outlives the workers, and
    the ``release`` to call once they are shut down.

    On the main thread: here (``release`` does nothing). On any other: on a new thread that waits until
    ``release`` is called or the result is collected, so a worker's death signal follows the workers' own
    lifetime, not the calling thread's. ``start``'s exception is raised here.
    """
    if threading.current_thread() is threading.main_thread():
        return start(), _nothing
    released, ready = threading.Event(), threading.Event()
    box: list[Any] = []

    def parent() -> None:
        try:
            box.append((True, start()))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))
        finally:
            ready.set()
        released.wait()  # the workers forked here die with this thread: it ends after them

    threading.Thread(target=parent, name="lmdbcache-workers-parent", daemon=True).start()
    ready.wait()
    ok, result = box.pop()
    if not ok:
        released.set()
        raise result
    weakref.finalize(result, released.set)  # dropped without a release (its own __del__ shuts the workers)
    return result, released.set


def _nothing() -> None:
    pass
