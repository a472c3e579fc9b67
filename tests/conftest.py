from __future__ import annotations

import gc
import getpass
import os
import signal
import subprocess
import tempfile

import pytest

from lmdbcache.store import _registry

# This file imports no torch, nor helpers (which does): `make native-pythons` runs tests/test_native_core.py without it.

# The Ctrl-C tests need Python's own SIGINT handler, here and in the processes they start: a run started in the
# background by a non-interactive shell (`make test &`) inherits SIGINT ignored, and Python keeps it ignored.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def cache_dir(tmp_path):
    """A path for a new cache (not yet created)."""
    return tmp_path / "cache.lmdb"


@pytest.fixture(autouse=True)
def _no_leaked_handles():
    """Every test ends with no open cache handle in this process (datasets it dropped are collected)."""
    yield
    gc.collect()
    for store in list(_registry._stores.values()):
        store.close()
    _registry._stores.clear()


@pytest.fixture
def counts(tmp_path):
    """A directory where Synthetic datasets log every source read, across processes."""
    path = tmp_path / "reads"
    path.mkdir()
    return str(path)


def unmount_leftovers(root: str) -> None:
    """Detach read-only bind mounts that an interrupted test run left under ``root`` (pytest's temp root).

    pytest deletes old temporary directories at the end of a session, and a mount left in one
    (a run killed mid-test) would fail that with EBUSY and turn a passing session into an error.
    """
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            points = [line.split()[1].replace("\\040", " ") for line in f]
    except OSError:
        return
    for point in points:
        if point.startswith(root.rstrip("/") + "/") and point.endswith("-ro") and not _owner_alive(point):
            subprocess.run(["umount", "-l", point], capture_output=True)


def _owner_alive(point: str) -> bool:
    """Whether the test run that made the mount ``point`` still runs (another session's live mount is left alone)."""
    try:
        with open(point + ".pid", encoding="utf-8") as f:
            os.kill(int(f.read()), 0)
    except PermissionError:
        return True  # alive, another user's
    except (OSError, ValueError):
        return False
    return True


def pytest_sessionstart(session):
    """Mounts left by an interrupted run must not break this session's clean-up of old temp dirs."""
    if os.geteuid() == 0:
        unmount_leftovers(os.path.join(tempfile.gettempdir(), f"pytest-of-{getpass.getuser()}"))


@pytest.fixture(params=["native", "python"])
def read_path(request, monkeypatch):
    """The loader's batch path: the compiled core (skipped when it is not built) or the pure-Python reference."""
    from lmdbcache import _native

    if request.param == "native" and _native.core is None:
        pytest.skip("the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")
    if request.param == "python":
        monkeypatch.setattr(_native, "core", None)
    return request.param
