"""The compiled core and the one place that picks it or the pure-Python path (issue #24).

``core`` is the extension module ``lmdbcache._native._core`` (plain C against the CPython
API and the buffer protocol, built by ``setup.py`` on ``pip install``), or None; ``NATIVE``
says which. Everything else asks here and never imports ``_core`` itself, so the pure-Python
path (the reference: every native result is tested against it) is one switch away:

- ``LMDBCACHE_PURE_PYTHON=1`` in the environment forces it (read once, at first import);
- a module that cannot be imported (no compiler at install time, a build for another
  Python) gives one ``LmdbCacheWarning`` naming the rebuild command, then the same path.

May import: ``lmdbcache.errors`` only.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

from ..errors import LmdbCacheWarning

__all__ = ["NATIVE", "core"]


def _load() -> ModuleType | None:
    if os.environ.get("LMDBCACHE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        module = importlib.import_module(__name__ + "._core")
    except ImportError as exc:
        warnings.warn(
            f"lmdbcache's compiled core could not be imported ({exc}); the pure-Python path is used (correct, "
            "slower). Rebuild it with `pip install --force-reinstall --no-deps .` (or `pip install -e .`) from a "
            "checkout, with a C compiler and Python's headers installed; set LMDBCACHE_PURE_PYTHON=1 to silence "
            "this.",
            LmdbCacheWarning,
            stacklevel=2,
        )
        return None
    return module


core: ModuleType | None = _load()
NATIVE: bool = core is not None
