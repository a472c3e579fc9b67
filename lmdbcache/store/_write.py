"""The write path: misses queued and committed in batches, map growth, direct writes and deletes.

Misses are queued and committed by a background thread (``_commit``), one write
transaction per batch, under the inter-process file lock ``lmdbcache.lock``. A key is never
written twice (``overwrite=False``): when two processes decode one index, the first commit
wins. Every write transaction first checks the cache still holds the build this process
adopted, so samples of a replaced build never reach a new one. A commit that does not fit
grows the map and re-puts every record of the batch, never just the last one. Commits are
not fsynced unless the store's ``sync`` asks (``_fs`` says why and what keeps that safe);
``sync_file`` syncs them all at once.

Packs (``_pack``). In a cache created with ``pack=K``, the commit that completes a chunk (every
index of it committed or in the batch, each value small) writes the chunk's pack and deletes
its single records in the same transaction: a process killed at any instant leaves either
the singles or the pack, and a reader's older snapshot still sees the singles. A chunk
written whole by one batch (``precompute``) goes straight into its pack.

Groups (``_group``, format 4). In a cache without packs, a commit's small values (under
``_group.SMALL``) whose indices are not stored yet go into one group record, in the batch's order,
and each index gets a pointer into it, in the same transaction: a SIGKILL leaves both or neither,
and an index another process stored first adds no byte to the group (the first commit wins).
``delete`` deletes a pointer only; its bytes stay in the group until the cache is rewritten.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import filelock
import lmdb

from .. import _native
from ..errors import CacheClosedError, CacheMismatchError, CorruptCacheError, LmdbCacheError, ReadOnlyCacheError
from ..format import _group, _pack
from ..format._group import index_key
from . import _fs, _metadata
from ._commit import CommitQueue, Policy
from ._env import grown_size
from ._fs import WRITE_LOCK
from ._handle import Handle
from ._lmdb_errors import REBUILD, write_failure
from ._signals import interrupts_held

__all__ = ["Writer", "sync_and_clear"]

_PKEY = _pack.key
_TAG = _pack.TAG
_group_batch = _native.core.group_batch if _native.core is not None else None  # _group.plan in one call


class _Present(Exception):
    """Raised inside a write transaction to abort it: a hopeful ``_put_grouped`` met an index already present."""


class Writer:
    """Queueing, committing and deleting samples (see the module docstring): its own state, over ``handle``.

    It owns the commit queue and its committer thread, the inter-process file lock, the ``sync``
    setting and the unsynced marker this process left. Every public method takes the handle's lock.
    """

    def __init__(self, handle: Handle, policy: Policy, sync: bool = False) -> None:
        self._h = handle
        self._lock = handle._lock
        self.sync = sync  # fsync every commit (else once, at close; see _fs on the unsynced marker)
        self._unsynced = False  # this process committed without a sync since the last one
        self._file_lock: filelock.BaseFileLock | None = None
        self._close_when_idle = False  # close() was interrupted while a batch was being written
        self._queue = CommitQueue(handle._lock, self._write_batch, policy, on_idle=self._idle)
        # lookup(index): the encoded value of ``index`` if it is queued or in flight here (not yet committed), else
        # None. What the reader may ask of the write path (``Store`` hands it this); the lock is held. The queue's
        # own method (one frame less on every miss: the queue object lives as long as the writer).
        self.lookup: Callable[[int], bytes | None] = self._queue.lookup

    @property
    def queued(self) -> int:
        """Samples queued and not yet handed to the committer."""
        return len(self._queue.pending)

    def holds_any(self, indices: list[int]) -> bool:
        """Whether this process has queued (or is committing) any of ``indices``: decoded, not yet in the map."""
        with self._lock:
            lookup = self._queue.lookup
            return any(lookup(index) is not None for index in indices)

    def file_lock(self) -> filelock.BaseFileLock:
        """The inter-process write lock (``lmdbcache.lock``): every commit, and a create or rebuild, holds it."""
        if self._file_lock is None:
            _fs.check_lmdb_files(self._h.path)  # filelock would follow a linked lmdbcache.lock
            self._file_lock = filelock.FileLock(os.path.join(self._h.path, WRITE_LOCK))
        return self._file_lock

    # The lifecycle Store drives (the lock held by the caller): rebuilds, close, fork.

    def drain(self) -> int:
        """Commit the queue now and wait for it; how many samples were queued."""
        return self._queue.drain()

    def forget(self) -> None:
        """Drop every queued sample: the build they belong to is being replaced, or was."""
        self._queue.forget()

    def stop(self) -> None:
        """Commit the queue and end the committer thread (``CommitQueue.stop``)."""
        self._queue.stop()

    @property
    def busy(self) -> bool:
        """A batch is being written right now (by the committer, or by a caller's ``put_many``)."""
        return self._queue.busy

    def close_later(self) -> bool:
        """If a batch is being written now, have the committer close the environment when done (``_idle``): True."""
        if self._queue.busy:
            self._close_when_idle = True
        return self._queue.busy

    def reset_in_child(self) -> None:
        """In a fork child: the parent's queued samples and committer thread do not exist here."""
        self._queue.reset_in_child()

    def _idle(self) -> None:
        """Called by the commit thread, with the lock held, after each batch."""
        if self._close_when_idle:
            self._close_when_idle = False
            self._h._close_env()

    def add(self, index: int, value: bytes, build: str | None = None, policy: Policy | None = None) -> None:
        """Queue one encoded sample for the build ``build``; the committer thread writes it (see ``_commit``).

        ``build`` (the dataset's build id) guards against a rebuild in between: a sample of a
        build this store no longer holds is refused, never written into the new one.
        """
        h = self._h
        with self._lock:  # not acquire() then try: a Ctrl-C between the two would leave the lock held for good
            if h.retired:  # closed for good by another thread: a sample queued here would never be committed
                raise CacheClosedError(
                    f"Cache '{h.path}' was closed by another thread before index {index} could be queued; "
                    "nothing was lost. Use the dataset again: it reopens the cache."
                )
            if build is not h.build and build is not None and build != h.build:
                raise h.mismatch(build)
            if h._stale is not None:
                raise CacheMismatchError(h._stale)
            if h.readonly or (h._env is None and not _fs.writable(h.path)):
                raise ReadOnlyCacheError(
                    f"Cache '{h.path}' is read-only (read-only directory or mount) and index {index} is not "
                    "cached. Open the cache without a dataset, or copy it to a writable location to fill it."
                )
            self._queue.add(index, value, policy)

    @property
    def dropped(self) -> int:
        """Samples whose commit failed since this writer began: decoded, never committed."""
        return self._queue.dropped

    def uncommitted(self) -> int:
        """``dropped`` and the samples still queued or in flight."""
        return self.dropped + len(self._queue.pending) + len(self._queue.inflight)

    def flush(self) -> int:
        """Commit this process's queued samples and wait for them; return how many were queued."""
        with self._lock:
            return self._queue.drain()

    @property
    def unwritten_bytes(self) -> int:
        """Bytes of samples queued or being written and not yet committed: what a flush still has to write."""
        with self._lock:
            return self._queue.unwritten_bytes()

    @property
    def written(self) -> int:
        """Samples this process's commits have written (indices already present are not counted)."""
        return self._queue.written

    def put_many(self, items: Iterable[tuple[int, bytes]], build: str | None = None) -> int:
        """Write (index, value) pairs of the build ``build`` now, in one transaction, skipping indices present.

        Returns the number of records actually written. A rebuild waits for the write (the
        batch is in flight), so the build checked here is the one written into. An index given twice
        keeps its first value, as the queue does (a group holding both ran out of retries, saying the
        map could not grow).
        """
        first: dict[int, bytes] = {}
        for index, value in items:
            first.setdefault(index, value)
        batch = sorted(first.items())
        with self._lock:
            if build is not None and build != self._h.build:
                raise self._h.mismatch(build)
            self._queue.begin_direct(batch)
        try:
            return self._write_batch(batch)
        finally:
            with self._lock:
                self._queue.end_direct()

    def _write_batch(self, batch: list[tuple[int, bytes]]) -> int:
        """One write transaction for ``batch``; called without the lock (it takes it to grow the map).

        Grows the map as needed; every record is re-put after a growth, never just the
        last one.
        """
        if not batch:
            return 0
        need = sum([len(v) for _, v in batch]) + 8 * len(batch)
        with self.file_lock():
            with self._lock:
                env = self._h._env or self._h._env_or_open()
                self._h._maybe_reader_check(env)
                self._h._reserve(env, need)
            # The marker goes down (fsynced) before any byte of an unsynced commit: see _fs.
            durable = self.sync or not _fs.mark_unsynced(self._h.path, self._settings())
            hopeful = True  # every small index taken for absent (_put_grouped), until one is not
            for _ in range(64):
                try:
                    written = 0
                    with env.begin(write=True) as txn:
                        self._check_cache_id(txn)
                        if self._h._pack:
                            written = self._put_packed(txn, batch)
                        elif (written := self._put_grouped(txn, batch, hopeful)) < 0:
                            raise _Present
                    self._h.commits += 1  # this process's readers renew a snapshot kept from before (_read)
                    if durable:
                        env.sync(True)
                    else:
                        self._unsynced = True
                    return written
                except _Present:  # the transaction is aborted: write the batch again, looking each index up
                    hopeful = False
                except lmdb.MapFullError:
                    with self._lock:
                        self._h._set_mapsize(env, grown_size(env, need))
                except lmdb.MapResizedError:
                    with self._lock:
                        self._h._set_mapsize(env, 0)
                except lmdb.Error as exc:
                    raise write_failure(
                        exc,
                        self._h.path,
                        f"{len(batch)} samples were not cached (they are decoded again on the next read; "
                        "everything committed before is intact)",
                    ) from exc
        raise LmdbCacheError(f"Cache '{self._h.path}': could not make room for {need} bytes after 64 map growths.")

    def _delete_in(self, env: lmdb.Environment, wanted: set[int]) -> int:
        """One transaction of ``delete``: the indices of ``wanted`` gone, their chunks unpacked; how many existed."""
        with env.begin(write=True) as txn:
            self._check_cache_id(txn)
            db, pack, deleted = self._h._samples, self._h._pack, 0
            for k in sorted(wanted):
                if txn.delete(index_key(k), db=db):
                    deleted += 1
                elif pack and (whole := txn.get(_PKEY(first := k - k % pack, _TAG), db=db)) is not None:
                    n = min(pack, self._h._length - first)
                    whole = bytes(whole)
                    broken = _pack.problem(whole, n) is not None
                    txn.delete(_PKEY(first, _TAG), db=db)
                    for index in range(first, first + n):
                        if index in wanted or broken:
                            deleted += index in wanted
                            continue
                        txn.put(index_key(index), _pack.value(whole, index - first, n), db=db)
        self._h.commits += 1
        return deleted

    def _put_grouped(self, txn: lmdb.Transaction, batch: list[tuple[int, bytes]], hopeful: bool = True) -> int:
        """Write ``batch`` into ``txn``: its small values absent so far as groups and pointers, the rest alone.

        An index already present is skipped (the first commit wins) before its value joins a group, so a
        group holds no byte that nothing points to. A lone small value is stored alone: a group of one
        saves nothing. Returns how many indices were new, or -1: ``hopeful`` took every small index for
        absent and one was not (the caller aborts ``txn`` and writes the batch again, not hopeful).

        Hopeful, the usual case (one process filling), costs one ``putmulti`` of the pointers instead
        of a ``get`` and a ``put`` per index: py-lmdb releases the GIL around each of them. The records
        are laid out by the core in one call (``core.group_batch``), else by ``_group.plan``: the same bytes.

        The groups and pointers are put holding the store's lock. py-lmdb releases the GIL around every
        record it writes and takes it back after: with the filling thread running Python beside, each of
        those is a hand-over of the GIL between two cores (futex wakes and waits were 18% of a lazy fill's
        CPU samples, perf). Holding the lock, the filling thread waits once, at its next read, and the puts
        take an uncontended GIL: a 3 KiB miss 9.9 -> 6.9 us above the source (issue 24). Values stored alone
        (16 KiB and up) are put without it: their copies overlap the filling thread (a 0.9 MB sample's first
        epoch lost a third of its speed under the lock). The lock comes after the write lock, as in
        ``_reserve``: no holder of the store's lock waits for the write lock (``delete`` drains first).
        """
        db, small_size = self._h._samples, _group.SMALL
        cursor = txn.cursor(db=db)
        if not hopeful:
            get = txn.get
            batch = [(i, v) for i, v in batch if len(v) >= small_size or get(index_key(i), db=db) is None]
        first = self._next_group(txn)
        planned = _group_batch(batch, small_size, first, _group.MAX_GROUP) if _group_batch is not None else None
        singles, groups = planned or _group.plan(batch, small_size, first, _group.MAX_GROUP)
        written = cursor.putmulti(singles, overwrite=False)[1] if singles else 0
        with self._lock:  # the puts below take the GIL back once a record: see the note above
            for group_key, record, pointers in groups:
                if not txn.put(group_key, record, db=db, overwrite=False):
                    raise CorruptCacheError(
                        f"Cache '{self._h.path}' is damaged: a key sorts after its groups'. {REBUILD}"
                    )
                if cursor.putmulti(pointers, overwrite=False)[1] != len(pointers):
                    return -1  # an index was present (another process stored it): its value must not join a group
                written += len(pointers)
        return written

    def _next_group(self, txn: lmdb.Transaction) -> int:
        """The id of the next group: one past the last group's (group keys sort last), or 0."""
        cursor = txn.cursor(db=self._h._samples)
        last = _group.id_of(cursor.key()) if cursor.last() else None
        return 0 if last is None else last + 1

    def _settings(self) -> dict[str, Any]:
        """The build's creation settings, for the unsynced-commits marker."""
        return _metadata.settings(self._h._meta) if self._h._meta is not None else {}

    def _put_packed(self, txn: lmdb.Transaction, batch: list[tuple[int, bytes]]) -> int:
        """Write ``batch`` (sorted) into ``txn``, packing every chunk it completes; return how many indices were new.

        Per chunk touched: nothing if it is packed already (its indices are all present: the first
        commit wins); else its pack if every index is now present and small, its singles deleted;
        else the batch's values as singles. The chunk's other indices are looked up one by one,
        stopping at the first absent one, so an incomplete chunk costs little.
        """
        pack, length, db = self._h._pack, self._h._length, self._h._samples
        get, put, delete = txn.get, txn.put, txn.delete
        written, at = 0, 0
        while at < len(batch):
            first = batch[at][0] - batch[at][0] % pack
            end = min(first + pack, length)
            group: dict[int, bytes] = {}
            while at < len(batch) and batch[at][0] < first + pack:
                group.setdefault(*batch[at])
                at += 1
            if get(_PKEY(first, _TAG), db=db) is not None:
                continue
            present: dict[int, bytes] = {}
            complete = first < end and all(len(v) < _pack.SMALL for v in group.values())
            for index in range(first, end) if complete else ():
                old = get(index_key(index), db=db)
                if old is not None:
                    present[index] = bytes(old)  # copied: a write in this transaction may move it
                elif index not in group:
                    complete = False
                    break
            if complete and all(len(v) < _pack.SMALL for v in present.values()):
                values = [present[i] if i in present else group[i] for i in range(first, end)]
                put(_PKEY(first, _TAG), _pack.build(values), db=db)
                for index in present:
                    delete(index_key(index), db=db)
                written += sum(1 for i in group if i not in present and i < end)
                for index, value in group.items():  # past the dataset's end: no chunk holds them
                    if index >= end:
                        written += put(index_key(index), value, db=db, overwrite=False)
            else:
                for index, value in group.items():
                    written += put(index_key(index), value, db=db, overwrite=False)
        return written

    def sync_file(self) -> None:
        """fsync everything committed so far (by any process) and clear the unsynced marker (at close).

        An fsync of data.mdb itself, not of the environment: it may be closed (before a fork)
        and every commit's pages are in the file's page cache whoever wrote them. So it also
        clears a marker another process left (one killed before its close, say): after this
        sync nothing it guarded is unsynced, and a process that commits again writes it again
        (``_fs.mark_unsynced``, under the same write lock). Called without the lock (it takes
        the write lock, which comes first). Ctrl-C waits for the sync and the marker's removal.
        """
        if not self._unsynced and (self._h.readonly or self._h.build is None or not _fs.has_unsynced(self._h.path)):
            return  # (a store that adopted no build may have refused another boot's marker: never clear that)
        with self.file_lock(), interrupts_held(block=False):
            sync_and_clear(self._h.path)
        self._unsynced = False

    def _check_cache_id(self, txn: lmdb.Transaction) -> None:
        """Inside a write transaction: refuse to write into a build this process did not adopt."""
        if not self._h._same_build(txn)[0]:
            raise CacheMismatchError(
                f"Cache '{self._h.path}' was rebuilt by another process (overwrite=True) while this one was filling "
                "it; its queued samples were dropped. Create the dataset again."
            )

    def delete(self, keys: Iterable[int]) -> int:
        """Delete the given indices (used by ``verify --repair``); returns how many existed. Synced: it is rare.

        An index held in a pack unpacks the rest of its chunk into single records, in the same
        transaction; a pack whose header is broken is dropped whole (``verify`` reports all its indices).
        """
        wanted = set(keys)
        with self._lock:
            # The committer takes this lock inside the write lock (_put_grouped): with a batch in flight, waiting
            # for the write lock here would wait for a thread that waits for us.
            self._queue.drain()
            env = self._h._env or self._h._env_or_open()
            try:
                with self.file_lock():
                    for _ in range(64):
                        try:
                            deleted = self._delete_in(env, wanted)
                        except lmdb.MapFullError:  # unpacking a chunk: its values take single pages again
                            self._h._set_mapsize(env, grown_size(env, 16 * _pack.SMALL * max(self._h._pack, 1)))
                            continue
                        except lmdb.MapResizedError:  # another process grew the map
                            self._h._set_mapsize(env, 0)
                            continue
                        env.sync(True)
                        return deleted
                    raise LmdbCacheError(f"Cache '{self._h.path}': no room to unpack after 64 map growths.")
            except lmdb.Error as exc:
                raise write_failure(exc, self._h.path, "nothing was deleted") from exc


def sync_and_clear(path: str) -> None:
    """fsync data.mdb, then remove the unsynced marker; under the write lock."""
    try:
        _fs.sync_data_file(path)
    except OSError as exc:
        raise LmdbCacheError(
            f"Cache '{path}': syncing its last commits to disk failed ({exc.strerror}). They are "
            "readable; a crash of the machine before the kernel writes them would make the next run rebuild."
        ) from exc
    if _fs.unsynced_in_another_boot(path) is None:  # another boot's marker is the next open's to judge
        _fs.clear_unsynced(path)
