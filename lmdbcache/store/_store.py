"""One process's handle on one cache directory: ``Store``, the only door to LMDB.

A cache directory holds LMDB's ``data.mdb`` and ``lock.mdb`` and our ``lmdbcache.lock``.
The environment has two named databases: ``meta`` (one record, ``b"meta"``: a msgpack
map, see ``Store.initialize``) and ``samples`` (key: the index as 8 bytes big-endian, so
key order is index order; value: one encoded sample, see ``codec``; in a cache created with
``pack=K``, also the packs of complete chunks of small samples under 9-byte keys that sort
among them, see ``_pack``).

The metadata record is described in ``_metadata``; the value format in ``codec``.

Processes. Each process opens its own environment, lazily, and never uses one across
``fork()``; ``_registry`` closes them before every fork and hands out one Store per
directory per process. Pickling a dataset carries its configuration only.

Writes. Misses are queued and committed by a background thread (``_commit``), one
write transaction per batch, under the inter-process file lock ``lmdbcache.lock``. A key
is never written twice (``overwrite=False``).

Durability. By default commits are not fsynced (``sync=False, metasync=False``): a process
killed at any instant leaves every committed transaction intact (LMDB is copy-on-write and
its writes are in the kernel's page cache), and ``close`` syncs the file once. A machine
crash before that may tear the file, so an unsynced commit first leaves a marker with the
boot id, and a cache opened in another boot with the marker present is rebuilt (``_fs``).
``sync=True`` fsyncs every commit instead: a power loss then keeps the database consistent
and may undo the last commit. Queued, uncommitted samples are simply decoded again later.

Map size: see ``_env``. The modules behind ``Store``, and what each may import (one way)::

    store      Store: create, check, rebuild, close, fork     -> _read, _write
    _read      the hit path, checksum policy, scans            -> _handle, codec
    _write     queue, batched commits, map growth, deletes     -> _handle, _commit
    _handle    state, lazy open, adopted build, transactions   -> _env, _metadata, _fs, _guard
    _env       opening and sizing an LMDB environment          -> _fs, _lmdb_errors
    _metadata  the metadata record: parse, validate, new       -> _lmdb_errors
    _fs        the cache directory and its files               -> _options
    _lmdb_errors  the one LMDB error table                     -> errors
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import lmdb

from .._options import MIB, parse_size
from .._version import FORMAT_VERSION
from ..errors import (
    CacheMismatchError,
    CorruptCacheError,
    InvalidOptionError,
    LmdbCacheWarning,
    NotACacheError,
    ReadOnlyCacheError,
)
from ..format import _compress, _pack
from ..format._frames import require
from . import _fs, _metadata
from ._commit import CommitQueue, Policy
from ._env import MAX_MAP
from ._fs import DATA_FILE, LOCK_FILE, WRITE_LOCK
from ._lmdb_errors import REBUILD, translate, write_failure
from ._read import MISSING, ReadPath
from ._scanner import Scanner
from ._signals import interrupts_held
from ._write import WritePath, sync_and_clear

__all__ = ["DATA_FILE", "LOCK_FILE", "MISSING", "WRITE_LOCK", "Store"]


class Store(ReadPath, WritePath):
    """One process's handle on a cache directory (see the module docstring).

    Thread-safe: every use of the environment holds ``self._lock``, which is also what
    lets a map growth and a pre-fork close wait for in-flight reads.
    """

    def __init__(
        self,
        path: str,
        *,
        map_size: int = 64 * MIB,
        max_readers: int = 1024,
        commit_every: int = 4096,
        commit_bytes: int = 8 * MIB,
        commit_interval: float = 1.0,
        checksum: str = "once",
        sync: bool = False,
    ) -> None:
        super().__init__(path, map_size=map_size, max_readers=max_readers, checksum=checksum, sync=sync)
        self._queue = CommitQueue(
            self._lock,
            self._write_batch,
            Policy(commit_every, parse_size(commit_bytes, "commit_bytes"), commit_interval),
            on_idle=self._idle,
        )
        self._close_when_idle = False  # close() was interrupted while a batch was being written
        self._scanner = Scanner(self)  # index-order scans: composed, its state its own

    def reconcile(self, map_size: int, max_readers: int, sync: bool = False) -> None:
        """Another object asks for this open store with its own per-environment options.

        A larger map is honoured (applied before the next commit, or when the environment
        opens), and so is ``sync=True`` (from then on every commit on the path is synced); a
        different reader table cannot be (LMDB fixes it when the first process opens the
        environment), which is a warning.
        """
        self.sync = self.sync or sync
        if max_readers != self.max_readers:
            warnings.warn(
                f"Cache '{self.path}' is already open in this process with max_readers={self.max_readers}; "
                f"max_readers={max_readers} cannot take effect (LMDB sizes the reader table when the first "
                "process opens the cache). Pass the same value to every CachedDataset on this path.",
                LmdbCacheWarning,
                stacklevel=4,
            )
        map_size = min(parse_size(map_size), MAX_MAP)
        if map_size > self.map_size:
            # Applied by the next commit's _reserve, under the write lock: set_mapsize while this
            # process's committer thread has a write transaction open would fail.
            self.map_size = map_size

    def iter_raw(self, start: int = 0, chunk: int = 256) -> Iterator[tuple[int, bytes]]:
        """Yield (index, stored value) in key order, ``chunk`` records per read transaction (``Scanner``)."""
        return self._scanner.iter_raw(start, chunk)

    def iter_keys(self, start: int = 0, chunk: int = 65536) -> Iterator[int]:
        """Yield every cached index in order (keys only: no value is read)."""
        return self._scanner.iter_keys(start, chunk)

    def cached_near(self, starts: Iterable[int]) -> list[int]:
        """For each start, the first cached index at or after it (wrapping around), without duplicates."""
        return self._scanner.cached_near(starts)

    def __repr__(self) -> str:
        state = "open" if self._env is not None else "closed"
        return f"<Store {self.path!r} {state}, {len(self._queue.pending)} queued>"

    # ------------------------------------------------------------------ opening

    def initialize(
        self,
        *,
        length: int | None,
        fingerprint: str | None,
        overwrite: bool = False,
        create: bool = True,
        compress: str | None = None,
        compress_level: int | None = None,
        pack: int = 0,
        need_codec: bool = True,
    ) -> dict[str, Any]:
        """Open the cache, creating it or checking it against the dataset; return its metadata.

        ``length``/``fingerprint`` of None skip that check (a cache opened without its
        source). ``compress`` (checked by ``_compress.check``) is what a new build compresses
        with; an existing build with another setting is refused, and None takes its own.
        With ``overwrite`` an existing cache is emptied (in place, so other processes keep
        valid handles) or, if it is not a readable lmdbcache cache, its LMDB files are replaced.
        Files that are not ours are never touched. On error nothing stays open. ``pack``: the
        chunk size K of packs (``_pack``) in a cache created here (an existing cache keeps its own).
        A ``compress`` whose module is missing is refused before anything is created; a compressed
        build whose module is missing is refused unless not ``need_codec`` (reading metadata only).
        """
        if compress is not None:
            require(compress, asked=f"compress={compress!r}")
        with self._lock:
            if overwrite:
                self._queue.forget()  # samples of the build being replaced
            try:
                self._queue.drain()
            except CacheMismatchError:
                self._queue.forget()  # samples of a build another process replaced
            if overwrite:
                self._queue.forget()  # queued by other threads while the drain waited
            # From here to _adopt the lock is held: no thread can queue a sample in between.
            self._close_env()  # another dataset in this process may have it open: start clean
            previous = self.build
            try:
                meta, raw = self._initialize(length, fingerprint, overwrite, create, (compress, compress_level), pack)
                _metadata.check_compression(meta, self.path, compress, compress_level)
                if need_codec:
                    self._require_codec(meta)
            except BaseException:
                self._close_env()
                raise
            self._adopt(meta, raw)
            if meta["cache_id"] != previous:
                self._queue.forget()
            return meta

    def _initialize(
        self,
        length: int | None,
        fingerprint: str | None,
        overwrite: bool,
        create: bool,
        compress: tuple[str | None, int | None],
        pack: int = 0,
    ) -> tuple[dict[str, Any], bytes]:
        self._make_dir(create)
        _fs.warn_if_network_fs(self.path)
        if not _fs.writable(self.path):
            return self._open_readonly(length, fingerprint, overwrite)
        return self._open_writable(length, fingerprint, overwrite, compress, pack)

    def _make_dir(self, create: bool) -> None:
        """Refuse a file as the path, or a missing cache when not creating one; create the directory."""
        path = self.path
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
        self, length: int | None, fingerprint: str | None, overwrite: bool
    ) -> tuple[dict[str, Any], bytes]:
        """A cache in a directory this process cannot write: open it as it is, or refuse."""
        path = self.path
        if overwrite:
            raise ReadOnlyCacheError(
                f"Cannot rebuild the cache at '{path}' (overwrite=True): the directory is read-only."
            )
        if not os.path.exists(os.path.join(path, DATA_FILE)):
            raise ReadOnlyCacheError(
                f"Cannot create a cache in '{path}': the directory is read-only. Choose a writable location."
            )
        _fs.check_data_file(self.path, overwrite=False)
        boot = _fs.unsynced_in_another_boot(path)
        if boot is not None:
            raise CorruptCacheError(self._torn_message(boot) + " It cannot be rebuilt in a read-only location.")
        env = self._open_env(readonly=True)
        found = self._read_meta(env)
        if found is None:
            raise NotACacheError(
                f"'{path}' holds an LMDB environment that lmdbcache did not create (it has no metadata)."
            )
        return _metadata.check(found[0], self.path, length, fingerprint), found[1]

    def _open_writable(
        self,
        length: int | None,
        fingerprint: str | None,
        overwrite: bool,
        compress: tuple[str | None, int | None],
        pack: int = 0,
    ) -> tuple[dict[str, Any], bytes]:
        """Create, check, upgrade or (``overwrite``) rebuild the cache, under the write lock."""
        path = self.path
        _fs.check_dir(self.path, overwrite)  # before the lock file is created: refuse without touching anything
        _fs.check_lmdb_files(path)
        _fs.check_free_space(self.path, self.max_readers)
        with self._write_lock():
            _fs.check_dir(self.path, overwrite)
            if not _fs.check_data_file(self.path, overwrite):
                _fs.remove_lmdb_files(path)
            boot = _fs.unsynced_in_another_boot(path)
            if boot is not None:
                if length is None:
                    raise CorruptCacheError(self._torn_message(boot) + " Open it with its dataset to rebuild it.")
                warnings.warn(
                    self._torn_message(boot) + " It is being rebuilt: its samples are decoded again.",
                    LmdbCacheWarning,
                    stacklevel=5,
                )
                compress, pack = _kept_settings(path, compress, pack)
                _fs.remove_lmdb_files(path)
            elif _fs.has_unsynced(path):
                # This boot's marker, left by a process that ended before its close (a crash, a kill):
                # what it guards is in the page cache; one sync and it guards nothing.
                with interrupts_held(block=False):
                    sync_and_clear(path)
            try:
                env = self._open_env(readonly=False)
                found = self._read_meta(env)
            except (CorruptCacheError, NotACacheError, CacheMismatchError):
                if not overwrite:
                    raise
                self._close_env()
                _fs.remove_lmdb_files(path)
                env = self._open_env(readonly=False)
                found = None
            if found is None or overwrite:
                if length is None:
                    raise NotACacheError(
                        f"There is no lmdbcache cache at '{path}' to open without a dataset. Build it first "
                        "(`lmdbcache precompute`, or CachedDataset with the source dataset)."
                    )
                return self._write_meta(env, length, fingerprint or "", *_compress.check(*compress), pack)
            meta = _metadata.check(found[0], self.path, length, fingerprint)
            if length is not None and meta["format_version"] < FORMAT_VERSION:
                return self._upgrade_meta(env, meta)  # this process may add values: they are this format's
            return found

    def _torn_message(self, boot: str) -> str:
        return (
            f"Cache '{self.path}' was being filled without a disk sync when the machine went down (boot "
            f"{boot[:36]!r} left its unsynced-commits marker, {_fs.UNSYNCED}), so it may be torn and is not read."
        )

    def _write_meta(
        self, env: lmdb.Environment, length: int, fingerprint: str, codec: str | None, level: int, pack: int = 0
    ) -> tuple[dict[str, Any], bytes]:
        """Start a new build: empty the samples and write new metadata, in one transaction."""
        meta, raw = _metadata.new(length, fingerprint, codec, level, pack)
        try:
            with env.begin(write=True) as txn:
                txn.drop(self._samples, delete=False)
                txn.put(_metadata.KEY, raw, db=self._meta_db)
            env.sync(True)  # rare, and what every later commit builds on: never left to the writeback
        except lmdb.Error as exc:
            raise write_failure(exc, self.path, "the cache was not created or rebuilt") from exc
        return meta, raw

    def _upgrade_meta(self, env: lmdb.Environment, meta: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """Mark an older-format cache as this format before this process adds values to it (``_metadata.upgraded``)."""
        meta, raw = _metadata.upgraded(meta)
        try:
            with env.begin(write=True) as txn:
                txn.put(_metadata.KEY, raw, db=self._meta_db)
            env.sync(True)
        except lmdb.Error as exc:
            raise write_failure(exc, self.path, "the metadata was not updated; nothing was lost") from exc
        return meta, raw

    # ------------------------------------------------------------------ inspecting

    def count(self) -> int:
        """Committed samples, after committing this process's queue."""
        self.flush()
        with self._lock, self._begin_checked(self._env or self._env_or_open()) as txn:
            try:
                # A pack is one record holding many samples: its count comes from its key and the length.
                count = (
                    self._scanner.count_packed(txn)
                    if self._pack
                    else int(txn.stat(self._samples)["entries"]) - self._scanner.count_groups(txn)
                )
            except lmdb.Error as exc:
                raise translate(exc, self.path, "counting the samples of") from exc
        assert self._meta is not None
        if count > self._meta["length"]:
            raise CorruptCacheError(
                f"Cache '{self.path}' is damaged: it counts {count:,} samples in a cache of length "
                f"{self._meta['length']:,}. {REBUILD}"
            )
        return count

    def keys_before_start(self, limit: int = 1000) -> int:
        """How many keys sort before index 0's (at most ``limit``): none in a sound cache; out of a scan's reach."""
        return self._scanner.keys_before_start(limit)

    def meta(self) -> dict[str, Any]:
        """A copy of the metadata record of the build this process adopted."""
        with self._lock:
            self._env or self._env_or_open()
            assert self._meta is not None
            return dict(self._meta)

    def env_info(self) -> dict[str, Any]:
        """LMDB's ``Environment.info()`` (map size, last page, readers) for this cache."""
        with self._lock:
            try:
                return dict((self._env or self._env_or_open()).info())
            except lmdb.Error as exc:
                raise translate(exc, self.path, "inspecting") from exc

    def copy_to(self, path: str) -> None:
        """LMDB's compacting copy of one consistent snapshot into the empty directory ``path``."""
        with self.reading_ahead(), self._lock:
            try:
                (self._env or self._env_or_open()).copy(path, compact=True)
            except lmdb.Error as exc:
                raise write_failure(exc, path, "the copy was abandoned") from exc

    @contextmanager
    def reading_ahead(self) -> Iterator[None]:
        """Kernel readahead on this process's map for a scan in key order (``_guard.MapGuard.sequential``)."""
        with self._lock:
            self._env or self._env_or_open()
            guard = self._guard
        if guard is None:
            yield
            return
        with self._lock:  # its refresh must not race a map growth (stored after the map moved: stale)
            guard.sequential(True)
        try:
            yield
        finally:
            with self._lock:
                guard.sequential(False)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Commit the queue, sync what this process committed, end the committer thread and close the environment.

        The environment reopens on next use.
        """
        try:
            with self._lock:
                self._queue.stop()
            self.sync_file()  # takes the write lock, which comes before self._lock
        finally:
            with self._lock:
                # A second Ctrl-C can end stop() while the thread is still writing: its transaction
                # must not lose its environment under it. The thread closes it when done (_idle).
                if self._queue.busy:
                    self._close_when_idle = True
                else:
                    self._close_env()

    def retire(self) -> None:
        """``close()`` for good (the registry's last reference): from now on it never reopens (``retired``)."""
        with self._lock:
            self.retired = True
        self.close()

    def _idle(self) -> None:
        """Called by the commit thread, with the lock held, after each batch."""
        if self._close_when_idle:
            self._close_when_idle = False
            self._close_env()

    def before_fork(self) -> None:
        """Commit, stop the committer thread and close the environment; the lock stays held across the fork."""
        self._lock.acquire()
        try:
            self._queue.stop()
        except Exception:
            pass  # the samples stay queued in the parent; the error resurfaces on its next commit
        finally:
            if not self._queue.busy:
                self._close_env()

    def after_fork(self, in_child: bool) -> None:
        if in_child:
            self._queue.reset_in_child()  # the parent's samples; its committer thread does not exist here
        self._lock.release()


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
