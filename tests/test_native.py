"""The compiled core (``lmdbcache._native``): the switch, and each native piece against its Python reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmdbcache import _native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
core = _native.core
needs_core = pytest.mark.skipif(core is None, reason="the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LMDBCACHE_PURE_PYTHON"}
    environ.update(PYTHONPATH=ROOT, **env)
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_forced_pure_python() -> None:
    """LMDBCACHE_PURE_PYTHON=1 gives no core and no warning."""
    out = _child(
        "import warnings; warnings.simplefilter('error')\n"
        "from lmdbcache import _native; print(_native.NATIVE, _native.core)",
        LMDBCACHE_PURE_PYTHON="1",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "None"]


def test_import_failure_warns_once() -> None:
    """A core that cannot be imported gives exactly one LmdbCacheWarning naming the fallback and the rebuild."""
    out = _child(
        "import sys, warnings\n"
        "sys.modules['lmdbcache._native._core'] = None  # the import now fails as a missing build does\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    from lmdbcache import _native\n"
        "    import lmdbcache._native, lmdbcache\n"
        "print(_native.NATIVE)\n"
        "for w in seen: print(w.category.__name__, '|', w.message)\n"
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False"
    assert len(lines) == 2, lines
    assert lines[1].startswith("LmdbCacheWarning |")
    assert "pure-Python path is used" in lines[1] and "pip install" in lines[1]


@needs_core
def test_core_is_the_built_extension() -> None:
    """The core found is the compiled module inside the package."""
    assert core is not None and _native.NATIVE
    assert core.__name__ == "lmdbcache._native._core"
    assert core.__file__.endswith((".so", ".pyd"))
