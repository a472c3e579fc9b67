"""Opening a cache directory for a build: create it, check it against the dataset, upgrade or rebuild it.

``open_build`` is ``Store.initialize``'s work on the handle (``_handle.Handle``), under its lock: the
directory made or refused, a read-only location opened as it is, a writable one under the
inter-process write lock (the writer's, handed in as ``file_lock``) checked, created, upgraded to
this format or rebuilt (``overwrite``; a cache torn by a machine crash, seen by its unsynced marker,
with the settings the marker kept). Files that are not ours are never touched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import filelock
import lmdb

from .._version import FORMAT_VERSION
from ..errors import (
    CacheMismatchError,
    CorruptCacheError,
    InvalidOptionError,
    MissingExtraError,
    NotACacheError,
    ReadOnlyCacheError,
    warn,
)
from ..format import _compress, _pack
from . import _fs, _metadata
from ._fs import DATA_FILE
from ._handle import Handle
from ._lmdb_errors import write_failure
from ._signals import interrupts_held
from ._write import sync_and_clear

__all__ = ["open_build"]


def open_build(
    h: Handle,
    file_lock: Callable[[], filelock.BaseFileLock],
    length: int | None,
    fingerprint: str | None,
    overwrite: bool,
    create: bool,
    compress: tuple[str | None, int | None],
    pack: int = 0,
) -> tuple[dict[str, Any], bytes]:
    """The build ``h`` opens (its metadata and the record's bytes), the cache made, checked or rebuilt for it.

    Arguments as ``Store.initialize``'s (``compress``: the codec and level asked for); the caller holds
    the handle's lock and adopts the result. On error the caller closes the environment.
    """
    _make_dir(h.path, create)
    _fs.warn_if_network_fs(h.path)
    if not _fs.writable(h.path):
        return _open_readonly(h, length, fingerprint, overwrite)
    return _open_writable(h, file_lock, length, fingerprint, overwrite, compress, pack)


def _make_dir(path: str, create: bool) -> None:
    """Refuse a file as the path, or a missing cache when not creating one; create the directory."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotACacheError(
            f"Cache path '{path}' is a file, not a directory. Pass the path of a directory "
            "(lmdbcache creates it and keeps data.mdb and lock.mdb inside)."
        )
    if not create and not os.path.exists(os.path.join(path, DATA_FILE)):
        raise NotACacheError(f"There is no cache at '{path}' (no {DATA_FILE} there). Build it first.")
    if not os.path.isdir(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise ReadOnlyCacheError(
                f"Cannot create the cache directory '{path}': {exc.strerror}. Choose a writable location."
            ) from exc


def _open_readonly(
    h: Handle, length: int | None, fingerprint: str | None, overwrite: bool
) -> tuple[dict[str, Any], bytes]:
    """A cache in a directory this process cannot write: open it as it is, or refuse."""
    path = h.path
    if overwrite:
        raise ReadOnlyCacheError(f"Cannot rebuild the cache at '{path}' (overwrite=True): the directory is read-only.")
    if not os.path.exists(os.path.join(path, DATA_FILE)):
        raise ReadOnlyCacheError(
            f"Cannot create a cache in '{path}': the directory is read-only. Choose a writable location."
        )
    _fs.check_data_file(h.path, overwrite=False)
    boot = _fs.unsynced_in_another_boot(path)
    if boot is not None:
        raise CorruptCacheError(_torn_message(path, boot) + " It cannot be rebuilt in a read-only location.")
    env = h._open_env(readonly=True)
    found = h._read_meta(env)
    if found is None:
        raise NotACacheError(f"'{path}' holds an LMDB environment that lmdbcache did not create (it has no metadata).")
    return _metadata.check(found[0], h.path, length, fingerprint), found[1]


def _open_writable(
    h: Handle,
    file_lock: Callable[[], filelock.BaseFileLock],
    length: int | None,
    fingerprint: str | None,
    overwrite: bool,
    compress: tuple[str | None, int | None],
    pack: int = 0,
) -> tuple[dict[str, Any], bytes]:
    """Create, check, upgrade or (``overwrite``) rebuild the cache, under the write lock."""
    path = h.path
    _fs.check_dir(h.path, overwrite)  # before the lock file is created: refuse without touching anything
    _fs.check_lmdb_files(path)
    _fs.check_free_space(h.path, h.max_readers)
    with file_lock():
        _fs.check_dir(h.path, overwrite)
        if not _fs.check_data_file(h.path, overwrite):
            _fs.remove_lmdb_files(path)
        boot = _fs.unsynced_in_another_boot(path)
        if boot is not None:
            if length is None:
                raise CorruptCacheError(_torn_message(path, boot) + " Open it with its dataset to rebuild it.")
            warn(_torn_message(path, boot) + " It is being rebuilt: its samples are decoded again.")
            compress, pack = _kept_settings(path, compress, pack)
            _fs.remove_lmdb_files(path)
        elif _fs.has_unsynced(path):
            # This boot's marker, left by a process that ended before its close (a crash, a kill):
            # what it guards is in the page cache; one sync and it guards nothing.
            with interrupts_held(block=False):
                sync_and_clear(path)
        try:
            env = h._open_env(readonly=False)
            found = h._read_meta(env)
        except (CorruptCacheError, NotACacheError, CacheMismatchError, MissingExtraError):
            # MissingExtraError: a cache this py-lmdb cannot read (LMDB 1.0's, _engine) or a codec not installed
            if not overwrite:
                raise
            h._close_env()
            _fs.remove_lmdb_files(path)
            env = h._open_env(readonly=False)
            found = None
        if found is None or overwrite:
            if length is None:
                raise NotACacheError(
                    f"There is no lmdbcache cache at '{path}' to open without a dataset. Build it first "
                    "(`lmdbcache precompute`, or CachedDataset with the source dataset)."
                )
            return _write_meta(h, env, length, fingerprint or "", *_compress.check(*compress), pack)
        meta = _metadata.check(found[0], h.path, length, fingerprint)
        if length is not None and meta["format_version"] < FORMAT_VERSION:
            return _upgrade_meta(h, env, meta)  # this process may add values: they are this format's
        return found


def _torn_message(path: str, boot: str) -> str:
    return (
        f"Cache '{path}' was being filled without a disk sync when the machine went down (boot "
        f"{boot[:36]!r} left its unsynced-commits marker, {_fs.UNSYNCED}), so it may be torn and is not read."
    )


def _write_meta(
    h: Handle, env: lmdb.Environment, length: int, fingerprint: str, codec: str | None, level: int, pack: int = 0
) -> tuple[dict[str, Any], bytes]:
    """Start a new build: empty the samples and write new metadata, in one transaction."""
    meta, raw = _metadata.new(length, fingerprint, codec, level, pack)
    try:
        with env.begin(write=True) as txn:
            txn.drop(h._samples, delete=False)
            txn.put(_metadata.KEY, raw, db=h._meta_db)
        env.sync(True)  # rare, and what every later commit builds on: never left to the writeback
    except lmdb.Error as exc:
        raise write_failure(exc, h.path, "the cache was not created or rebuilt") from exc
    return meta, raw


def _upgrade_meta(h: Handle, env: lmdb.Environment, meta: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """Mark an older-format cache as this format before this process adds values to it (``_metadata.upgraded``)."""
    meta, raw = _metadata.upgraded(meta)
    try:
        with env.begin(write=True) as txn:
            txn.put(_metadata.KEY, raw, db=h._meta_db)
        env.sync(True)
    except lmdb.Error as exc:
        raise write_failure(exc, h.path, "the metadata was not updated; nothing was lost") from exc
    return meta, raw


def _kept_settings(
    path: str, compress: tuple[str | None, int | None], pack: int
) -> tuple[tuple[str | None, int | None], int]:
    """The compression and packing a rebuild after a crash uses: those asked for, else the old build's (from its
    marker, ``_fs.marker_settings``: untrusted, each value checked, a bad one ignored)."""
    kept = _fs.marker_settings(path)
    if compress[0] is None and kept.get("compress") is not None:
        try:
            compress = _compress.check(kept["compress"], kept.get("compress_level"))
        except InvalidOptionError:
            pass  # a damaged marker: what the caller asked for
    found = kept.get("pack")
    if not pack and type(found) is int and 0 <= found <= _pack.MAX_PACK:
        pack = found
    return compress, pack
