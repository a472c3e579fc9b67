"""The compiled core and the one place that picks it or the pure-Python path (issue #24).

``core`` is the extension module ``lmdbcache._native._core`` (plain C against the CPython
API and the buffer protocol, built by ``setup.py`` on ``pip install``), or None; ``NATIVE``
says which. Everything else asks here and never imports ``_core`` itself, so the pure-Python
path (the reference: every native result is tested against it) is one switch away:

- ``LMDBCACHE_PURE_PYTHON=1`` in the environment forces it (read once, at first import);
- a module that cannot be imported (no compiler at install time, a build for another
  Python) gives one ``LmdbCacheWarning`` naming the rebuild command, then the same path.

The core reads LMDB's file itself (``open_tree``, ``locate``): the snapshot of a py-lmdb read
transaction is found from the meta page whose txnid is the transaction's (``txn.id()``), then its
tree is walked with every page, node, key and value checked against the mapped length (from
``MapGuard.mapping``: the address comes from /proc/self/maps when the map moves, never per read;
py-lmdb's ``env.info()["map_addr"]`` is 0 unless the map is fixed), in the page layout of the engine
py-lmdb opened the file with (LMDB 0.9's or 1.0's: ``store/_engine.py`` asks the environment;
``open_tree`` checks the meta page's magic and version agree). What breaks it: another LMDB data
format (the core is then off, as ``_engine`` warns), a big-endian machine (the Python side keeps the
native path off there, as the guard does). One window it cannot see: a writer two commits on
rewrites the meta page in place, and a copy of the root made while those 48 bytes are half written,
with the txnid not yet changed, would read a newer snapshot; its pages are all still held by this
reader (LMDB frees only pages no reader can see), so every read stays inside sound pages, and every
value read is still checked against its index's checksums. It needs two commits within the life of a
kept read transaction (at most ``_read._READER_MAX_AGE``) and the copy to fall inside the second
one's write of the meta page.

May import: ``lmdbcache.errors`` only.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import ModuleType

from ..errors import LmdbCacheWarning

__all__ = ["NATIVE", "core"]


def _load() -> ModuleType | None:
    if os.environ.get("LMDBCACHE_PURE_PYTHON", "") not in ("", "0"):
        return None
    if sys.byteorder != "little" or sys.maxsize <= 2**32:
        return None  # the core reads LMDB's pages as a little-endian 64-bit build writes them
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


# Why a native lookup failed, by its code (lmdbcache/_native/_core.c, LK_*): worded as the guard words a broken
# record (``_guard``), to follow "the record of index N is broken (...)".
REASONS: dict[int, str] = {
    16: "no sound meta page holds its snapshot",
    17: "a page number on its path lies past the end of the data file",
    18: "a page header on its path does not hold together",
    19: "a node offset on its path lies outside its page",
    20: "a key on its path runs past its page",
    21: "its value runs past its page, or is not a plain value",
    22: "its overflow pages would run past the end of the data file",
    23: "the tree above it is deeper than its database says, or malformed",
    24: "the samples database's own record is broken",
    25: "its pack's header does not hold its value",
    26: "it points into a group that is missing or does not hold its span",
}
OK, NOTFOUND, RETRY, PACK, GROUP = 0, 1, 2, 25, 26


def reason(code: int) -> str:
    """The words for a native lookup's error ``code``."""
    return REASONS.get(code, f"native lookup error {code}")
