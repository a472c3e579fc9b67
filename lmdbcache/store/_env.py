"""Opening and sizing one LMDB environment: the options we open it with, and map growth.

Map size. The map starts at ``map_size`` and doubles (at least) whenever a commit would
not fit; the store grows it by aborting the transaction, growing, and re-putting every
queued record. A process that finds the map grown by another (``MapResizedError``) adopts
the new size and tries again, on every path that begins a transaction, opening included: a
process (re)opening the cache reads the map size when it opens the file and begins its first
transaction a moment later, and another process may grow the map in between.

Open with ``readahead=False``: samples are read in random order, and readahead would only
evict useful pages.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import lmdb

from .._options import MIB
from ..errors import CorruptCacheError, NotACacheError
from ._engine import unreadable_engine
from ._fs import DATA_FILE, check_size
from ._lmdb_errors import readers_full, translate

__all__ = ["MAX_MAP", "RESIZE_RETRIES", "grown_size", "open_databases", "open_env", "reserved_size"]

MAX_MAP = 1 << 46  # 64 TiB: beyond what a 47-bit user address space can map
_OPEN_RETRIES = 30  # x 0.2 s
# Growths one open or begin rides out in a row (each at least doubles the map: more means a
# writer growing it without end, which the error then names).
RESIZE_RETRIES = 8
_NOT_OURS = "Use another path, or pass overwrite=True to replace it."


def open_env(path: str, *, map_size: int, max_readers: int, readonly: bool) -> tuple[lmdb.Environment, bool]:
    """Open the environment at ``path``; return it and whether it uses LMDB's lock table.

    A reader table full of dead processes' slots is retried for a few seconds (a live
    process clears them); a read-only mount where ``lock.mdb`` cannot be written is opened
    without the lock table (no writer can exist there).
    """
    options: dict[str, Any] = dict(
        map_size=map_size,
        max_dbs=2,
        max_readers=max_readers,
        readahead=False,  # random access: readahead only evicts useful pages
        metasync=False,
        sync=False,  # commits are synced as the store decides (see _fs: the unsynced marker)
        max_spare_txns=1,
        subdir=True,
        create=not readonly,
    )
    full = resized = 0
    try:
        while True:
            try:
                return lmdb.open(path, readonly=readonly, **options), True
            except lmdb.ReadersFullError:
                # py-lmdb opens with a read transaction, so a table full of dead processes'
                # slots keeps us out until a live process clears them (Store._maybe_reader_check).
                full += 1
                if full > _OPEN_RETRIES:
                    raise
                time.sleep(0.2)
            except lmdb.MapResizedError:
                # py-lmdb begins a read transaction inside open: another process grew the map
                # since LMDB read its size. A new open reads the new size.
                resized += 1
                if resized > RESIZE_RETRIES:
                    raise
            except lmdb.Error as exc:
                if not readonly or ("ermission" not in str(exc) and "Read-only" not in str(exc)):
                    raise
                # A read-only mount where lock.mdb cannot be opened for writing: no writer can
                # exist there, so running without LMDB's lock table is safe.
                return lmdb.open(path, readonly=True, lock=False, **options), False
    except (lmdb.InvalidError, lmdb.VersionMismatchError) as exc:
        if (other := unreadable_engine(os.path.join(path, DATA_FILE), path)) is not None:
            raise other from exc  # a sound file of the other LMDB line: not "damaged", and never "delete it"
        if isinstance(exc, lmdb.VersionMismatchError):
            raise translate(exc, path, "opening") from exc
        raise CorruptCacheError(
            f"'{path}/{DATA_FILE}' is not an LMDB file ({exc}). Delete the directory, or pass overwrite=True "
            "to replace it."
        ) from exc
    except lmdb.ReadersFullError:
        raise readers_full(path) from None
    except lmdb.Error as exc:
        raise translate(exc, path, "opening") from exc


def open_databases(
    env: lmdb.Environment, path: str, readonly: bool, db_key: Callable[[bytes], bytes]
) -> tuple[Any, Any]:
    """The ``samples`` and ``meta`` databases of ``env``, after checking the file is whole and ours.

    ``db_key``: the main database's key of a named database in the file's format (``_engine.Layout.db_key``:
    LMDB 1.0 stores the name with a NUL). Raises ``lmdb.Error`` for the caller to translate (it closes ``env`` first).
    """
    # Before any page beyond the meta pages is touched: a truncated file would SIGBUS.
    psize = env.stat()["psize"]
    check_size(path, (env.info()["last_pgno"] + 1) * psize, psize)
    for resized in range(RESIZE_RETRIES + 1):
        try:
            with env.begin() as txn:
                names = {bytes(key) for key in txn.cursor().iternext(values=False)}
            break
        except lmdb.MapResizedError:
            # Another process grew the map since this one opened the file: adopt its size (0).
            if resized == RESIZE_RETRIES:
                raise
            env.set_mapsize(0)
    foreign = sorted(names - {db_key(b"meta"), db_key(b"samples")})
    if foreign:
        raise NotACacheError(
            f"'{path}' holds an LMDB environment that lmdbcache did not create (its keys include "
            f"{foreign[:3]}). {_NOT_OURS}"
        )
    try:
        return _open_db(env, b"samples", readonly), _open_db(env, b"meta", readonly)
    except (lmdb.NotFoundError, lmdb.IncompatibleError) as exc:
        raise NotACacheError(
            f"'{path}' holds an LMDB environment that lmdbcache did not create ({exc}). {_NOT_OURS}"
        ) from exc


def _open_db(env: lmdb.Environment, name: bytes, readonly: bool) -> Any:
    """``env.open_db``, which begins a transaction of its own: the map may have grown meanwhile too."""
    for resized in range(RESIZE_RETRIES + 1):
        try:
            return env.open_db(name, create=not readonly)
        except lmdb.MapResizedError:
            if resized == RESIZE_RETRIES:
                raise
            env.set_mapsize(0)
    raise AssertionError("unreachable: the last attempt returns or raises")


def reserved_size(env: lmdb.Environment, need: int, map_size: int) -> int | None:
    """The map size to set before a commit of ``need`` bytes (None: the map is large enough).

    Grows the map before a commit that would not fit, so it rarely has to be retried, and
    applies a larger ``map_size`` another object asked for.
    """
    info = env.info()
    used = (info["last_pgno"] + 1) * env.stat()["psize"]
    if used + 2 * need + MIB > info["map_size"]:
        return grown_size(env, need)
    if info["map_size"] < map_size:
        return map_size
    return None


def grown_size(env: lmdb.Environment, need: int) -> int:
    """The next map size: at least double, with room for ``need`` bytes twice over, in whole MiB (whole pages)."""
    info = env.info()
    used = (info["last_pgno"] + 1) * env.stat()["psize"]
    size = max(2 * info["map_size"], used + 2 * need + 16 * MIB)
    return -(-size // MIB) * MIB
