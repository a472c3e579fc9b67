"""The one table that turns LMDB's errors into the library's (``translate``), and the fix for damage.

Every module that calls LMDB raises ``translate(exc, path, action)`` or ``write_failure``
``from`` the LMDB error, so a caller only ever catches ``LmdbCacheError`` and its subclasses.
"""

from __future__ import annotations

import shutil

import lmdb

from .._options import MIB
from ..errors import CacheFullError, CorruptCacheError, LmdbCacheError, ReadersFullError, ReadOnlyCacheError

__all__ = ["REBUILD", "readers_full", "translate", "write_failure"]

REBUILD = (
    "Rebuild it (overwrite=True, or `lmdbcache precompute --overwrite`), or copy it from a good replica "
    "(`lmdbcache copy`)."
)

# The one table that turns LMDB's errors into the library's: (LMDB classes, our class, what it means).
# Errors that only a damaged file produces (a page number past the end, a B-tree deeper than
# LMDB's cursor stack, a transaction LMDB gave up on after such an error) all mean "damaged".
LMDB_ERRORS: list[tuple[tuple[type[lmdb.Error], ...], type[LmdbCacheError], str]] = [
    (
        (
            lmdb.CorruptedError,
            lmdb.PageNotFoundError,
            lmdb.PanicError,
            lmdb.InvalidError,
            lmdb.BadTxnError,
            lmdb.CursorFullError,
            lmdb.BadRslotError,
            lmdb.BadValsizeError,
            lmdb.PageFullError,
            lmdb.IncompatibleError,
            lmdb.VersionMismatchError,
        ),
        CorruptCacheError,
        "is damaged",
    ),
    ((lmdb.ReadonlyError,), ReadOnlyCacheError, "is read-only"),
    ((lmdb.ReadersFullError,), ReadersFullError, "has no free reader slot"),
    ((lmdb.DiskError,), CorruptCacheError, "met a disk I/O error"),
]


def translate(exc: lmdb.Error, path: str, action: str) -> LmdbCacheError:
    """The library error for an LMDB error met while ``action`` (e.g. "reading index 7 of") the cache."""
    for classes, ours, meaning in LMDB_ERRORS:
        if isinstance(exc, classes):
            fix = f" {REBUILD}" if ours is CorruptCacheError else ""
            return ours(f"Cache '{path}' {meaning}: LMDB said '{exc}' while {action} it.{fix}")
    return LmdbCacheError(f"Cache '{path}': LMDB error while {action} it: {exc}")


def write_failure(exc: lmdb.Error, path: str, lost: str) -> LmdbCacheError:
    """The error for a failed write to ``path``; ``lost`` says what did not get written."""
    if isinstance(exc, lmdb.ReadonlyError):
        return ReadOnlyCacheError(f"Cache '{path}' is read-only: {lost}.")
    free = shutil.disk_usage(path).free
    # LMDB reports a short write on a full disk as EIO, so judge by the free space.
    if free < 64 * MIB or "space" in str(exc):
        return CacheFullError(
            f"The disk holding '{path}' is full ({free:,} bytes free): {lost}. Free some space or move the "
            f"cache. (LMDB said: {exc})"
        )
    return translate(exc, path, "writing")


def readers_full(path: str) -> ReadersFullError:
    return ReadersFullError(
        f"Cache '{path}': all LMDB reader slots are taken (each process using the cache holds one; "
        "slots left by dead processes are cleared within seconds by any process still using it). Close some "
        "processes, or once none uses the cache, open it with a larger max_readers (the first process to "
        "open a cache sizes its reader table)."
    )
