"""The LMDB engine behind one environment, and the layout of the files it writes: what the guard and the core parse.

py-lmdb 3.0 bundles two LMDB release lines and binds each environment to one of them when it opens it: an
existing data.mdb to the engine of its own data format, a new one to LMDB 0.9 unless ``lib_version=1`` or
``LMDB_DEFAULT_LIB_VERSION=1`` asks for 1.0. Earlier releases have one engine, the LMDB they were built with. So
the layout is asked of the environment (``Environment.lib_version()``), never of the module (``lmdb.version()``
names only the engine for new environments): one process may have a cache of each kind open.

What differs (each line's mdb.c: ``MDB_page``, ``MDB_meta``, ``mdb_dbi_open``)::

                        LMDB 0.9 (data format 1)            LMDB 1.0 (data format 3)
    page header         16 bytes: u64 pgno; u16 pad;        24 bytes: u64 pgno; u64 txnid (the
                        u16 flags; u16 lower, u16 upper     writer's, unused by a read); then the same 8
    named database      its name                            its name and a NUL (``strlen(name) + 1``)
    (a main-db key)

Everything after a page header moves with it: the meta page's fields (the magic at 16 or 24, the main database's
``MDB_db`` at 88 or 96, the txnid at 144 or 152), a page's node offsets, an overflow value's first byte. The rest
is the same: the node (8 bytes before its key: data size, flags, key size), ``MDB_db`` (48 bytes), the meta page's
fields and their order, the page and node flags, the key order. 1.0's page checksums and encryption stay off
unless the opener asks (``mdb_env_set_checksum``, ``mdb_env_set_encrypt``): py-lmdb never does, and a file that
needs them is refused by py-lmdb before lmdbcache sees it.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import lmdb

from ..errors import LmdbCacheWarning, MissingExtraError

__all__ = ["Layout", "engine_version", "layout_of", "unreadable_engine"]


@dataclass(frozen=True)
class Layout:
    """The engine of one environment and what its files look like."""

    lmdb: tuple[int, ...]  # the engine's LMDB version
    header: int  # bytes of a page header: 16 (0.9), 24 (1.0), 0 when the layout is not known (nothing is parsed)
    name_end: bytes  # what follows a named database's name in its main-database key

    def db_key(self, name: bytes) -> bytes:
        """The main database's key of the named database ``name``."""
        return name + self.name_end


_HEADERS: dict[tuple[int, ...], int] = {(0, 9): 16, (1, 0): 24}


def engine_version(env: lmdb.Environment) -> tuple[int, ...]:
    """The LMDB version of ``env``'s engine: ``Environment.lib_version()`` (py-lmdb 3.0 on), else the build's one."""
    engine = getattr(env, "lib_version", None)
    return tuple(engine() if engine is not None else lmdb.version())


_warned: set[tuple[int, ...]] = set()  # unknown engines already warned about in this process


def layout_of(env: lmdb.Environment) -> Layout:
    """The layout of the files ``env``'s engine reads and writes (see the module docstring).

    An engine whose page layout lmdbcache does not know (another LMDB line, or a py-lmdb built against one
    with ``LMDB_FORCE_SYSTEM=1``) gets header 0: the bounds check and the compiled core's reads stay off for it
    (one ``LmdbCacheWarning`` per engine and process says what that means), and LMDB reads everything.
    """
    version = engine_version(env)
    header = _HEADERS.get(version[:2], 0)
    if not header and version not in _warned:
        _warned.add(version)
        warnings.warn(
            f"lmdbcache: this cache's LMDB engine is {'.'.join(map(str, version))} (py-lmdb {lmdb.__version__}), "
            "and the bounds check that refuses a damaged record before it is read knows only the page layouts of "
            "LMDB 0.9 and 1.0; it is off for this cache, so reading a damaged or hostile data.mdb may crash the "
            "process (SIGBUS or SIGSEGV) instead of raising CorruptSampleError. Install a py-lmdb that bundles "
            "LMDB 0.9 or 1.0 (the PyPI wheels do; a build with LMDB_FORCE_SYSTEM=1 uses the system's LMDB), or "
            "open only caches you trust.",
            LmdbCacheWarning,
            stacklevel=3,
        )
    return Layout(version, header, b"\0" if version[:1] >= (1,) else b"")


_MAGIC = 0xBEEFC0DE


def unreadable_engine(data_file: str, path: str) -> MissingExtraError | None:
    """The error for a data.mdb that LMDB 1.0 wrote when this py-lmdb has no 1.0 engine (it calls the file invalid).

    Asked only after the open failed. The first meta page says which line wrote the file: magic and data format 3
    after a 24-byte page header. Anything else is None: the caller's error stands (a damaged file, say).
    """
    try:
        with open(data_file, "rb") as f:
            head = f.read(32)
    except OSError:
        return None
    if len(head) < 32 or struct.unpack_from("<II", head, 24) != (_MAGIC, 3) or _has_engine(1):
        return None  # not LMDB 1.0's, or this py-lmdb reads it: the file itself is at fault
    return MissingExtraError(
        f"Cache '{path}' was written by LMDB 1.0 (data format 3), and py-lmdb {lmdb.__version__} reads only LMDB "
        f"{'.'.join(map(str, lmdb.version()))}'s format. Install py-lmdb 3.0 or later (`pip install -U lmdb`: it "
        "bundles both LMDB 0.9 and 1.0), or rebuild the cache here (overwrite=True) to write it with this one."
    )


def _has_engine(major: int) -> bool:
    """Does this py-lmdb bundle an LMDB ``major``.x engine (``lmdb.version(lib_version=)``: py-lmdb 3.0 on)?"""
    try:
        # py-lmdb's stubs before 3.0 have no lib_version: the ignore serves mypy under either
        return tuple(lmdb.version(lib_version=major))[:1] == (major,)  # type: ignore[call-overload,unused-ignore]
    except (TypeError, lmdb.Error):
        return tuple(lmdb.version())[:1] == (major,)
