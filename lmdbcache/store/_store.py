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

Map size: see ``_env``.

Composition. A ``Store`` is three objects over one ``Handle`` (``_handle``: the environment, the
adopted build, checked transactions, the lock), each owning its state: a ``Reader`` (``_read``:
the kept read transaction, packs, checksum flags, the core's tree), a ``Writer`` (``_write``:
the commit queue and its thread, the file lock, ``sync``, the unsynced marker) and a ``Scanner``.
The reader asks the writer one thing, handed to it as a function: a queued, uncommitted value
(``Writer.lookup``). The handle tells them what they must hear through ``Handle.listen``. The
modules behind ``Store``, and what each may import (one way)::

    _store     Store: composes; initialize, check, close, fork   -> _open, _read, _write, _scanner
    _open      create, check, upgrade, rebuild a directory       -> _handle, _write (sync_and_clear)
    _read      Reader: the hit path, checksum policy, batches    -> _handle, _native_read, codec
    _native_read  the hit path on the compiled core              -> _handle, _native
    _scanner   Scanner: index-order scans                        -> _handle
    _write     Writer: queue, batched commits, growth, deletes   -> _handle, _commit
    _commit    the queue and its committer thread               -> (nothing of the store)
    _handle    state, lazy open, adopted build, transactions     -> _env, _metadata, _fs, _guard
    _env       opening and sizing an LMDB environment            -> _fs, _lmdb_errors
    _metadata  the metadata record: parse, validate, new         -> _lmdb_errors
    _fs        the cache directory and its files                 -> _options
    _lmdb_errors  the one LMDB error table                       -> errors
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lmdb

from .._options import MIB, parse_size
from ..errors import CacheClosedError, CacheMismatchError, CorruptCacheError, warn
from ..format import _compress
from ..format._frames import require
from . import _metadata
from ._commit import Policy
from ._env import MAX_MAP
from ._fs import DATA_FILE, LOCK_FILE, WRITE_LOCK
from ._guard import MapGuard
from ._handle import Handle
from ._lmdb_errors import REBUILD, translate, write_failure
from ._open import open_build
from ._read import MISSING, Reader
from ._scanner import Scanner
from ._write import Writer

__all__ = ["DATA_FILE", "LOCK_FILE", "MISSING", "WRITE_LOCK", "Store"]


class Store:
    """One process's handle on a cache directory (see the module docstring): a reader and a writer over one handle.

    Thread-safe: every use of the environment holds the handle's lock (``_lock``), which is also
    what lets a map growth and a pre-fork close wait for in-flight reads.
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
        self.path = path
        self.checksum = checksum  # the default for reads that do not say (tools)
        # Handed out by _registry in this process and usable here; False in a child forked since
        # (a plain attribute rather than a pid compare: the hit path asks it per sample).
        self.owned = False
        self.refs = 0
        handle = self.handle = Handle(path, map_size=map_size, max_readers=max_readers)
        policy = Policy(commit_every, parse_size(commit_bytes, "commit_bytes"), commit_interval)
        writer = self.writer = Writer(handle, policy, sync)
        reader = self.reader = Reader(handle, writer.lookup)  # all a miss may ask of the write path
        handle.listen(drop_kept=reader._drop_reader, adopted=reader.adopted, rebuilt=writer.forget)
        self._scanner = Scanner(handle)  # index-order scans: composed, its state its own
        self._lock = handle._lock
        # What a dataset calls per sample, bound here once: the call costs what a method of Store's own
        # would, with no frame in between (get_many and read_batch, once per batch, are methods below).
        self.get = reader.get
        self.add = writer.add
        self.compress = handle.compress
        self.raw = reader.raw
        self.flush = writer.flush
        self.put_many = writer.put_many
        self.delete = writer.delete
        self.sync_file = writer.sync_file
        self.expect_build = handle.expect_build
        self.mismatch = handle.mismatch
        self._drop_reader = handle._drop_reader  # the reader's kept transaction ends (tests: a new snapshot)
        self.iter_raw = self._scanner.iter_raw
        self.iter_keys = self._scanner.iter_keys
        self.cached_near = self._scanner.cached_near
        self.keys_before_start = self._scanner.keys_before_start

    def queue(self, index: int, value: bytes, build: str | None, policy: Policy, reopen: Callable[[], Store]) -> Store:
        """``add(index, compress(value))`` here, or in the store ``reopen()`` returns if another thread's close() closed
        this one for good meanwhile (it committed all queued before): whatever a read returns is committed (issue 38,
        reads racing close() lost samples they had returned). Returns the store that took the sample."""
        store = self
        while True:
            try:
                store.add(index, store.compress(value), build, policy)
                return store
            except CacheClosedError:
                if not store.retired:
                    raise
                store = reopen()

    def get_many(self, indices: list[int], always: bool = False, build: str | None = None) -> list[Any]:
        """``Reader.get_many``: a batch decoded in one read transaction, misses as ``MISSING``."""
        return self.reader.get_many(indices, always, build)

    def read_batch(
        self, indices: list[int], always: bool, build: str | None, copy: Callable[[list[Any], list[bool]], Any]
    ) -> Any:
        """``Reader.read_batch``: ``copy(views, check_data)`` under the lock and one read transaction.

        A batch holding a sample this process decoded but has not committed yet (a miss of the last
        ``commit_interval``) commits the queue and is read again: such a value is not in the map, so every
        batch holding one took the loader's slow path (``__getitems__``, then per-sample torch ops under
        ``augment=``) until the committer's interval ran out: 2-8x the CPU per image in the epochs right
        after a fill (issue 38; ``python -m bench.after_fill``).
        """
        result = self.reader.read_batch(indices, always, build, copy)
        if result is MISSING and self.writer.holds_any(indices):
            self.writer.flush()
            result = self.reader.read_batch(indices, always, build, copy)
        return result

    # The handle's and the writer's state, as callers read it.

    @property
    def build(self) -> str | None:
        """The build id (``cache_id``) this process adopted (``Handle.build``)."""
        return self.handle.build

    @property
    def retired(self) -> bool:
        return self.handle.retired

    @property
    def readonly(self) -> bool:
        return self.handle.readonly

    @property
    def map_size(self) -> int:
        return self.handle.map_size

    @property
    def max_readers(self) -> int:
        return self.handle.max_readers

    @property
    def sync(self) -> bool:
        """Every commit fsynced (``Writer.sync``)."""
        return self.writer.sync

    @property
    def written(self) -> int:
        """Samples this process's commits have written (indices already present are not counted)."""
        return self.writer.written

    @property
    def compressor(self) -> _compress.Compressor | None:
        return self.handle.compressor

    @property
    def _env(self) -> lmdb.Environment | None:
        return self.handle._env

    @property
    def _guard(self) -> MapGuard | None:
        return self.handle._guard

    # The registry's questions and answers (``_registry``): who owns this store, how many hold it.

    def claim(self) -> None:
        """This process's registry hands this store out: usable here."""
        self.owned = True

    def disown(self) -> None:
        """In a child forked since: the parent's store, never used here (datasets acquire their own)."""
        self.owned = False

    def hold(self) -> None:
        """One more holder (a dataset, a tool)."""
        self.refs += 1

    def let_go(self) -> int:
        """One holder fewer; how many are left (at 0 the registry retires the store)."""
        self.refs -= 1
        return self.refs

    def reconcile(self, map_size: int, max_readers: int, sync: bool = False) -> None:
        """Another object asks for this open store with its own per-environment options.

        A larger map is honoured (applied before the next commit, or when the environment
        opens), and so is ``sync=True`` (from then on every commit on the path is synced); a
        different reader table cannot be (LMDB fixes it when the first process opens the
        environment), which is a warning.
        """
        self.writer.sync = self.writer.sync or sync
        if max_readers != self.max_readers:
            warn(
                f"Cache '{self.path}' is already open in this process with max_readers={self.max_readers}; "
                f"max_readers={max_readers} cannot take effect (LMDB sizes the reader table when the first "
                "process opens the cache). Pass the same value to every CachedDataset on this path."
            )
        map_size = min(parse_size(map_size), MAX_MAP)
        if map_size > self.map_size:
            # Applied by the next commit's _reserve, under the write lock: set_mapsize while this
            # process's committer thread has a write transaction open would fail.
            self.handle.map_size = map_size

    def __repr__(self) -> str:
        state = "open" if self._env is not None else "closed"
        return f"<Store {self.path!r} {state}, {self.writer.queued} queued>"

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
        handle, writer = self.handle, self.writer
        with self._lock:
            if overwrite:
                writer.forget()  # samples of the build being replaced
            try:
                writer.drain()
            except CacheMismatchError:
                writer.forget()  # samples of a build another process replaced
            if overwrite:
                writer.forget()  # queued by other threads while the drain waited
            # From here to _adopt the lock is held: no thread can queue a sample in between.
            handle._close_env()  # another dataset in this process may have it open: start clean
            previous = handle.build
            try:
                asked = (compress, compress_level)
                meta, raw = open_build(handle, writer.file_lock, length, fingerprint, overwrite, create, asked, pack)
                _metadata.check_compression(meta, self.path, compress, compress_level)
                if need_codec:
                    handle._require_codec(meta)
            except BaseException:
                handle._close_env()
                raise
            handle._adopt(meta, raw)
            if meta["cache_id"] != previous:
                writer.forget()
            return meta

    # ------------------------------------------------------------------ inspecting

    def count(self) -> int:
        """Committed samples, after committing this process's queue."""
        self.flush()
        h = self.handle
        with self._lock, h._begin_checked(h._env or h._env_or_open()) as txn:
            try:
                # A pack is one record holding many samples: its count comes from its key and the length.
                count = (
                    self._scanner.count_packed(txn)
                    if h._pack
                    else int(txn.stat(h._samples)["entries"]) - self._scanner.count_groups(txn)
                )
            except lmdb.Error as exc:
                raise translate(exc, self.path, "counting the samples of") from exc
        assert h._meta is not None
        if count > h._meta["length"]:
            raise CorruptCacheError(
                f"Cache '{self.path}' is damaged: it counts {count:,} samples in a cache of length "
                f"{h._meta['length']:,}. {REBUILD}"
            )
        return count

    def meta(self) -> dict[str, Any]:
        """A copy of the metadata record of the build this process adopted."""
        h = self.handle
        with self._lock:
            h._env or h._env_or_open()
            assert h._meta is not None
            return dict(h._meta)

    def env_info(self) -> dict[str, Any]:
        """LMDB's ``Environment.info()`` (map size, last page, readers) for this cache."""
        with self._lock:
            try:
                return dict((self.handle._env or self.handle._env_or_open()).info())
            except lmdb.Error as exc:
                raise translate(exc, self.path, "inspecting") from exc

    def copy_to(self, path: str) -> None:
        """LMDB's compacting copy of one consistent snapshot into the empty directory ``path``."""
        with self.reading_ahead(), self._lock:
            try:
                (self.handle._env or self.handle._env_or_open()).copy(path, compact=True)
            except lmdb.Error as exc:
                raise write_failure(exc, path, "the copy was abandoned") from exc

    @contextmanager
    def reading_ahead(self) -> Iterator[None]:
        """Kernel readahead on this process's map for a scan in key order (``_guard.MapGuard.sequential``)."""
        h = self.handle
        with self._lock:
            h._env or h._env_or_open()
            guard = h._guard
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
                self.writer.stop()
            self.writer.sync_file()  # takes the write lock, which comes before the handle's lock
        finally:
            with self._lock:
                # A second Ctrl-C can end stop() while the thread is still writing: its transaction
                # must not lose its environment under it. The thread closes it when done (Writer._idle).
                if not self.writer.close_later():
                    self.handle._close_env()

    def retire(self) -> None:
        """``close()`` for good (the registry's last reference): from now on it never reopens (``retired``)."""
        with self._lock:
            self.handle.retired = True
        self.close()

    def before_fork(self) -> None:
        """Commit, stop the committer thread and close the environment; the lock stays held across the fork."""
        self._lock.acquire()
        try:
            self.writer.stop()
        except Exception:
            pass  # the samples stay queued in the parent; the error resurfaces on its next commit
        finally:
            if not self.writer.busy:
                self.handle._close_env()

    def after_fork(self, in_child: bool) -> None:
        """Release the lock ``before_fork`` took; in a child, whoever held it (no thread of the child does)."""
        if in_child:
            self.writer.reset_in_child()  # the parent's samples; its committer thread does not exist here
            if not self._lock.locked():
                return
        self._lock.release()
