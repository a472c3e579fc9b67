"""One process's handle on one cache directory: the only module that talks to LMDB.

A cache directory holds LMDB's ``data.mdb`` and ``lock.mdb`` and our ``lmdbcache.lock``.
The environment has two named databases: ``meta`` (one record, ``b"meta"``: a msgpack
map, see ``Store.initialize``) and ``samples`` (key: the index as 8 bytes big-endian, so
key order is index order; value: one encoded sample, see ``codec``).

The metadata record: ``format_version`` (int), ``length``, ``fingerprint``, ``codec``,
``library_version``, ``created`` (ISO 8601, UTC) and ``cache_id`` (a random hex string,
new at every build or rebuild: processes check it before they commit, so a process still
filling a rebuilt cache cannot write old samples into it).

Processes. Each process opens its own environment, lazily, and never uses one across
``fork()``; ``_registry`` closes them before every fork and hands out one Store per
directory per process. Pickling a dataset carries its configuration only.

Writes. Misses are queued and committed by a background thread (``_commit``), one
write transaction per batch, under the inter-process file lock ``lmdbcache.lock``. A key
is never written twice (``overwrite=False``).

Durability. ``sync=True, metasync=False``: every commit fdatasyncs the data pages and
leaves the meta page to the next commit or the OS. A process killed at any instant
leaves every committed transaction intact (LMDB is copy-on-write); a power loss keeps
the database consistent but may undo the last commit. Queued, uncommitted samples are
simply decoded again later.

Map size. The map starts at ``map_size`` and doubles (at least) whenever a commit would
not fit, by aborting the transaction, growing, and re-putting every queued record.
A process that finds the map grown by another (``MapResizedError``) adopts the new size.
"""

from __future__ import annotations

import datetime
import os
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import filelock
import lmdb
import msgpack

from . import _fs, codec
from ._commit import CommitQueue
from ._version import FORMAT_VERSION, OLDEST_READABLE_FORMAT, __version__
from .errors import (
    CacheFullError,
    CacheMismatchError,
    CorruptCacheError,
    CorruptSampleError,
    LmdbCacheError,
    NotACacheError,
    ReadersFullError,
    ReadOnlyCacheError,
)

__all__ = ["DATA_FILE", "MISSING", "Store"]

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()

DATA_FILE, LOCK_FILE, WRITE_LOCK = "data.mdb", "lock.mdb", "lmdbcache.lock"
_OUR_FILES = {DATA_FILE, LOCK_FILE, WRITE_LOCK, "data.mdb-lock"}
_META_KEY = b"meta"
_KEY = struct.Struct(">Q").pack
_decode = codec.decode
_monotonic = time.monotonic
_UNKEY = struct.Struct(">Q").unpack
_MIN_DATA_FILE = 2 * 4096  # LMDB writes two meta pages before anything else
_MIB = 1 << 20
_READER_MAX_AGE = 0.25  # seconds a kept read transaction may pin its snapshot
# Every live process clears dead processes' reader slots this often (when it renews a read
# transaction or commits), so a process that cannot even open the cache because the table
# is full of them gets in on one of its retries.
_READER_CHECK_INTERVAL = 5.0
_OPEN_RETRIES = 30  # x 0.2 s
# Per-index "verified" flags cost a byte per index; beyond this length every read is verified.
_VERIFIED_MAX = 1 << 24


class Store:
    """One process's handle on a cache directory (see the module docstring).

    Thread-safe: every use of the environment holds ``self._lock``, which is also what
    lets a map growth and a pre-fork close wait for in-flight reads.
    """

    def __init__(
        self,
        path: str,
        *,
        map_size: int = 64 * _MIB,
        max_readers: int = 1024,
        commit_every: int = 256,
        commit_bytes: int = 64 * _MIB,
        commit_interval: float = 1.0,
        checksum: str = "once",
    ) -> None:
        self.path = path
        self.checksum = checksum
        self.map_size = int(map_size)
        self.max_readers = int(max_readers)
        self.pid = 0  # the process this store belongs to (set by _registry.acquire)
        self.readonly = False
        self.refs = 0
        self._lock = threading.Lock()
        self._env: lmdb.Environment | None = None
        self._samples: Any = None
        self._meta_db: Any = None
        self._file_lock: filelock.BaseFileLock | None = None
        self._cache_id: str | None = None  # the build this process checked; writes verify it
        self._queue = CommitQueue(
            self._lock,
            self._write_batch,
            commit_every=commit_every,
            commit_bytes=commit_bytes,
            commit_interval=commit_interval,
        )
        self._meta: dict[str, Any] | None = None
        # A read transaction kept open between hits (see _reader) and when it goes stale.
        self._rtxn: lmdb.Transaction | None = None
        self._rtxn_expires = 0.0
        # Byte i set: this process has verified index i's checksums (checksum="once"). A byte
        # rather than a bit per index: N bytes per process is small, and the test is cheaper.
        self._verified: bytearray | None = None
        self._locked = True  # False on a read-only mount opened without LMDB's lock table
        self._last_reader_check = 0.0

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
    ) -> dict[str, Any]:
        """Open the cache, creating it or checking it against the dataset; return its metadata.

        ``length``/``fingerprint`` of None skip that check (a cache opened without its
        source). With ``overwrite`` an existing cache is emptied (in place, so other
        processes keep valid handles) or, if it is not a readable lmdbcache cache, its
        LMDB files are replaced. Files that are not ours are never touched. On error
        nothing stays open.
        """
        with self._lock:
            if overwrite:
                self._queue.forget()  # samples of the build being replaced
            self._queue.drain()
            self._close_env()  # another dataset in this process may have it open: start clean
            try:
                meta = self._initialize(length, fingerprint, overwrite, create)
            except BaseException:
                self._close_env()
                raise
            self._adopt(meta)
            return meta

    def _initialize(self, length: int | None, fingerprint: str | None, overwrite: bool, create: bool) -> dict:
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
        _fs.warn_if_network_fs(path)
        if not _fs.writable(path):
            if overwrite:
                raise ReadOnlyCacheError(
                    f"Cannot rebuild the cache at '{path}' (overwrite=True): the directory is read-only."
                )
            if not os.path.exists(os.path.join(path, DATA_FILE)):
                raise ReadOnlyCacheError(
                    f"Cannot create a cache in '{path}': the directory is read-only. Choose a writable location."
                )
            self._check_data_file(overwrite=False)
            env = self._open_env(readonly=True)
            meta = self._read_meta(env)
            if meta is None:
                raise NotACacheError(
                    f"'{path}' holds an LMDB environment that lmdbcache did not create (it has no metadata)."
                )
            return self._check_meta(meta, length, fingerprint)

        self._check_dir(overwrite)  # before the lock file is created: refuse without touching anything
        with self._write_lock():
            self._check_dir(overwrite)
            if not self._check_data_file(overwrite):
                _remove_lmdb_files(path)
            try:
                env = self._open_env(readonly=False)
                meta = self._read_meta(env)
            except (CorruptCacheError, NotACacheError):
                if not overwrite:
                    raise
                self._close_env()
                _remove_lmdb_files(path)
                env = self._open_env(readonly=False)
                meta = None
            if meta is None or overwrite:
                if length is None:
                    raise NotACacheError(f"There is no lmdbcache cache at '{path}' to open without a dataset.")
                return self._write_meta(env, length, fingerprint or "")
            return self._check_meta(meta, length, fingerprint)

    def _check_dir(self, overwrite: bool) -> None:
        """Refuse a directory holding other files and no cache, unless asked to create one beside them."""
        names = set(os.listdir(self.path))
        foreign = sorted(names - _OUR_FILES)
        if foreign and DATA_FILE not in names and not overwrite:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise NotACacheError(
                f"'{self.path}' is not empty and holds no lmdbcache cache (it has {shown}). Use an empty or new "
                "directory, or pass overwrite=True to create the cache beside those files (they are left alone)."
            )

    def _check_data_file(self, overwrite: bool) -> bool:
        """Return False if data.mdb exists but is too short to be LMDB (and overwrite allows replacing it)."""
        data = os.path.join(self.path, DATA_FILE)
        try:
            size = os.path.getsize(data)
        except FileNotFoundError:
            return True
        if size >= _MIN_DATA_FILE:
            return True
        if overwrite:
            return False
        raise CorruptCacheError(
            f"Cache '{self.path}' is damaged: {DATA_FILE} is {size} bytes, too short for an LMDB environment "
            "(a crash while creating it?). Delete the directory, or pass overwrite=True to rebuild it."
        )

    def _check_truncation(self, env: lmdb.Environment) -> None:
        """A data.mdb shorter than its last page would SIGBUS on read: refuse it up front."""
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        size = os.path.getsize(os.path.join(self.path, DATA_FILE))
        if size < needed:
            raise CorruptCacheError(
                f"Cache '{self.path}' is damaged: {DATA_FILE} is {size} bytes but its pages need {needed} "
                "(truncated by a copy or a full disk?). Delete the directory, or pass overwrite=True to rebuild it."
            )

    def _open_env(self, *, readonly: bool) -> lmdb.Environment:
        """Open this process's environment and the two databases. Caller holds self._lock."""
        path = self.path
        options: dict[str, Any] = dict(
            map_size=self.map_size,
            max_dbs=2,
            max_readers=self.max_readers,
            readahead=False,  # random access: readahead only evicts useful pages
            metasync=False,
            sync=True,
            max_spare_txns=1,
            subdir=True,
            create=not readonly,
        )
        try:
            for attempt in range(_OPEN_RETRIES + 1):
                try:
                    env = lmdb.open(path, readonly=readonly, **options)
                    self._locked = True
                    break
                except lmdb.ReadersFullError:
                    # py-lmdb opens with a read transaction, so a table full of dead processes'
                    # slots keeps us out until a live process clears them (_maybe_reader_check).
                    if attempt == _OPEN_RETRIES:
                        raise
                    time.sleep(0.2)
                except lmdb.Error as exc:
                    if not readonly or ("ermission" not in str(exc) and "Read-only" not in str(exc)):
                        raise
                    # A read-only mount where lock.mdb cannot be opened for writing: no writer can
                    # exist there, so running without LMDB's lock table is safe.
                    env = lmdb.open(path, readonly=True, lock=False, **options)
                    self._locked = False
                    break
        except lmdb.InvalidError as exc:
            raise CorruptCacheError(
                f"'{path}/{DATA_FILE}' is not an LMDB file ({exc}). Delete the directory, or pass overwrite=True "
                "to replace it."
            ) from exc
        except (lmdb.VersionMismatchError, lmdb.CorruptedError, lmdb.PanicError) as exc:
            raise CorruptCacheError(f"Cannot open cache '{path}': {exc}. Delete it, or pass overwrite=True.") from exc
        except lmdb.ReadersFullError:
            raise self._readers_full() from None
        except lmdb.Error as exc:
            raise _translate(exc, path, "opening") from exc
        try:
            self._check_truncation(env)  # before any page beyond the meta pages is touched
            with env.begin() as txn:
                names = {bytes(key) for key in txn.cursor().iternext(values=False)}
            foreign = sorted(names - {b"meta", b"samples"})
            if foreign:
                raise NotACacheError(
                    f"'{path}' holds an LMDB environment that lmdbcache did not create (its keys include "
                    f"{foreign[:3]}). Use another path, or pass overwrite=True to replace it."
                )
            try:
                self._samples = env.open_db(b"samples", create=not readonly)
                self._meta_db = env.open_db(b"meta", create=not readonly)
            except (lmdb.NotFoundError, lmdb.IncompatibleError) as exc:
                raise NotACacheError(
                    f"'{path}' holds an LMDB environment that lmdbcache did not create ({exc}). Use another path, "
                    "or pass overwrite=True to replace it."
                ) from exc
            if not readonly:
                env.reader_check()  # reclaim the reader slots of processes that died
                self._last_reader_check = time.monotonic()
        except BaseException:
            env.close()
            raise
        self._env = env
        self.readonly = readonly
        return env

    def _env_or_open(self) -> lmdb.Environment:
        """The environment, opened on first use in this process (a worker, or after a fork)."""
        env = self._env
        if env is not None:
            return env
        readonly = not _fs.writable(self.path)
        if not readonly:
            self._check_data_file(overwrite=False)
        env = self._open_env(readonly=readonly)
        meta = self._read_meta(env)
        if meta is None or (self._cache_id is not None and meta.get("cache_id") != self._cache_id):
            self._close_env()
            raise CacheMismatchError(
                f"Cache '{self.path}' was rebuilt or replaced by another process since this dataset was created. "
                "Create the dataset again."
            )
        self._adopt(meta)
        return env

    def _adopt(self, meta: dict[str, Any]) -> None:
        self._meta, self._cache_id = meta, meta["cache_id"]
        length = meta["length"]
        verified = self._verified
        if self.checksum == "once" and length <= _VERIFIED_MAX and (verified is None or len(verified) < length):
            self._verified = bytearray(length)

    def _read_meta(self, env: lmdb.Environment) -> dict[str, Any] | None:
        with self._begin(env) as txn:
            raw = txn.get(_META_KEY, db=self._meta_db)
            if raw is None:
                if txn.stat(self._samples)["entries"]:
                    raise NotACacheError(
                        f"Cache '{self.path}' has samples but no metadata; it was not written by lmdbcache."
                    )
                return None
            try:
                meta = msgpack.unpackb(raw)
            except Exception as exc:
                raise CorruptCacheError(f"Cache '{self.path}' has unreadable metadata ({exc}).") from exc
        if not isinstance(meta, dict) or "format_version" not in meta:
            raise NotACacheError(f"'{self.path}' holds an LMDB environment whose metadata is not lmdbcache's.")
        return meta

    def _write_meta(self, env: lmdb.Environment, length: int, fingerprint: str) -> dict[str, Any]:
        meta = {
            "format_version": FORMAT_VERSION,
            "length": int(length),
            "fingerprint": fingerprint,
            "codec": codec.CODEC,
            "library_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cache_id": uuid.uuid4().hex,
        }
        with env.begin(write=True) as txn:
            txn.drop(self._samples, delete=False)
            txn.put(_META_KEY, msgpack.packb(meta), db=self._meta_db)
        return meta

    def _check_meta(self, meta: dict[str, Any], length: int | None, fingerprint: str | None) -> dict[str, Any]:
        fix = f"Delete '{self.path}', use another path, or pass overwrite=True to rebuild it."
        stored = meta.get("format_version")
        if isinstance(stored, int) and stored < OLDEST_READABLE_FORMAT:
            raise CacheMismatchError(
                f"Cache '{self.path}' was written in format {stored}, older than this lmdbcache {__version__} reads "
                f"(formats {OLDEST_READABLE_FORMAT} to {FORMAT_VERSION}). {fix}"
            )
        if not isinstance(stored, int) or stored > FORMAT_VERSION:
            raise CacheMismatchError(
                f"Cache '{self.path}' was written in format {stored} by lmdbcache {meta.get('library_version')}; "
                f"this lmdbcache {__version__} reads formats up to {FORMAT_VERSION}. Upgrade lmdbcache, or "
                f"{fix[0].lower()}{fix[1:]}"
            )
        if length is not None and meta["length"] != length:
            raise CacheMismatchError(
                f"Cache '{self.path}' was built for a dataset of length {meta['length']} but the dataset has length "
                f"{length}. {fix}"
            )
        if fingerprint is not None and meta["fingerprint"] != fingerprint:
            raise CacheMismatchError(
                f"Cache '{self.path}' was built for fingerprint '{meta['fingerprint']}' but the dataset has "
                f"'{fingerprint}'. {fix}"
            )
        return meta

    # ------------------------------------------------------------------ reading

    def _begin(self, env: lmdb.Environment, write: bool = False, db: Any = None) -> lmdb.Transaction:
        if not write:
            # One reader slot per process: the kept transaction and this one would take two
            # (the aborted one stays in py-lmdb's spare-transaction cache with its slot).
            self._drop_reader()
        try:
            return env.begin(db=db, write=write, buffers=True)
        except lmdb.MapResizedError:
            self._drop_reader()  # set_mapsize invalidates every transaction of this process
            env.set_mapsize(0)  # another process grew the map: adopt its size
            return env.begin(db=db, write=write, buffers=True)
        except lmdb.ReadersFullError:
            if env.reader_check():
                return env.begin(db=db, write=write, buffers=True)
            raise self._readers_full() from None
        except lmdb.Error as exc:
            raise _translate(exc, self.path, "reading") from exc

    def _reader(self) -> lmdb.Transaction:
        """A read transaction for a hit: the one kept from the last hit if it is fresh.

        Reusing it saves a begin/abort per sample. It is dropped on any miss (its snapshot
        may predate another process's commit, and while filling it would only pin pages
        that writers want to reuse) and renewed after _READER_MAX_AGE seconds.
        """
        txn = self._rtxn
        if txn is not None:
            if time.monotonic() < self._rtxn_expires:
                return txn
            self._drop_reader()
        env = self._env or self._env_or_open()
        self._maybe_reader_check(env)
        txn = self._begin(env, db=self._samples)
        self._rtxn, self._rtxn_expires = txn, time.monotonic() + _READER_MAX_AGE
        return txn

    def _maybe_reader_check(self, env: lmdb.Environment) -> None:
        """Clear dead processes' reader slots, at most every _READER_CHECK_INTERVAL seconds."""
        now = time.monotonic()
        if self._locked and now - self._last_reader_check >= _READER_CHECK_INTERVAL:
            self._last_reader_check = now
            env.reader_check()

    def _drop_reader(self) -> None:
        txn, self._rtxn = self._rtxn, None
        if txn is not None:
            txn.abort()

    def _readers_full(self) -> ReadersFullError:
        return ReadersFullError(
            f"Cache '{self.path}': all LMDB reader slots are taken (each process using the cache holds one; "
            "slots left by dead processes are cleared within seconds by any process still using it). Close some "
            "processes, or once none uses the cache, open it with a larger max_readers (the first process to "
            "open a cache sizes its reader table)."
        )

    def get(self, index: int) -> Any:
        """The decoded sample at ``index``, or ``MISSING``. The hot path: kept flat."""
        lock = self._lock
        lock.acquire()  # not `with`: half the cost, and this runs once per sample
        try:
            txn = self._rtxn
            if txn is None or _monotonic() >= self._rtxn_expires:
                txn = self._reader()
            raw = txn.get(_KEY(index))
            if raw is None:
                return self._get_fresh([index])[0]
            verified = self._verified
            if verified is not None and index < len(verified) and verified[index]:
                try:
                    return _decode(raw, False)
                except CorruptSampleError as exc:
                    raise self._corrupt(index, exc) from None
            return self._decode(raw, index)
        finally:
            lock.release()

    def get_many(self, indices: list[int]) -> list[Any]:
        """Decode a batch in one read transaction; misses come back as ``MISSING``."""
        with self._lock:
            get, decode = self._reader().get, self._decode
            out = []
            for index in indices:
                raw = get(_KEY(index))
                out.append(MISSING if raw is None else decode(raw, index))
            misses = [k for k, sample in enumerate(out) if sample is MISSING]
            if misses:
                for k, sample in zip(misses, self._get_fresh([indices[k] for k in misses])):
                    out[k] = sample
        return out

    def _get_fresh(self, indices: list[int]) -> list[Any]:
        """Look misses up again in a new snapshot, then in this process's queue. Holds self._lock."""
        self._drop_reader()
        out = []
        with self._begin(self._env or self._env_or_open()) as txn:
            for index in indices:
                raw = txn.get(_KEY(index), db=self._samples)
                if raw is None:
                    raw = self._queue.lookup(index)
                out.append(MISSING if raw is None else self._decode(raw, index))
        return out

    def _decode(self, raw: Any, index: int) -> Any:
        verified = self._verified
        try:
            if verified is None or index >= len(verified):
                return codec.decode(raw)
            if verified[index]:
                return codec.decode(raw, False)
            sample = codec.decode(raw)
            verified[index] = 1
            return sample
        except CorruptSampleError as exc:
            raise self._corrupt(index, exc) from None

    def _corrupt(self, index: int, exc: CorruptSampleError) -> CorruptSampleError:
        return CorruptSampleError(
            f"Cache '{self.path}': the stored value of index {index} is damaged ({exc}); it was not returned. "
            f"Run `lmdbcache verify --repair {self.path}` to drop damaged entries (they are decoded again "
            "from the source on the next read)."
        )

    def env_info(self) -> dict[str, Any]:
        """LMDB's ``Environment.info()`` (map size, last page, readers) for this cache."""
        with self._lock:
            return dict((self._env or self._env_or_open()).info())

    def copy_to(self, path: str) -> None:
        """LMDB's compacting copy of one consistent snapshot into the empty directory ``path``."""
        with self._lock:
            try:
                (self._env or self._env_or_open()).copy(path, compact=True)
            except lmdb.Error as exc:
                raise _write_failure(exc, path, "the copy was abandoned") from exc

    def count(self) -> int:
        """Committed samples, after committing this process's queue."""
        self.flush()
        with self._lock, self._begin(self._env or self._env_or_open()) as txn:
            return txn.stat(self._samples)["entries"]

    def meta(self) -> dict[str, Any]:
        with self._lock:
            self._env or self._env_or_open()
            assert self._meta is not None
            return dict(self._meta)

    def iter_raw(self, start: int = 0, chunk: int = 256) -> Iterator[tuple[int, bytes]]:
        """Yield (index, stored value) in key order, ``chunk`` records per read transaction."""
        return self._scan(start, chunk, values=True)

    def iter_keys(self, start: int = 0, chunk: int = 65536) -> Iterator[int]:
        """Yield every cached index in order (keys only: no value is read)."""
        return (index for index, _ in self._scan(start, chunk, values=False))

    def _scan(self, start: int, chunk: int, values: bool) -> Iterator[tuple[int, Any]]:
        # Short read transactions: a long scan never pins a snapshot that writers must move past.
        key = _KEY(start)
        while True:
            batch: list[tuple[int, Any]] = []
            with self._lock, self._begin(self._env or self._env_or_open()) as txn:
                cursor = txn.cursor(db=self._samples)
                if cursor.set_range(key):
                    records = cursor.iternext() if values else ((k, None) for k in cursor.iternext(values=False))
                    for k, v in records:
                        if len(k) != 8:
                            raise CorruptCacheError(f"Cache '{self.path}' holds a key of {len(k)} bytes: {bytes(k)!r}")
                        batch.append((_UNKEY(k)[0], None if v is None else bytes(v)))
                        if len(batch) == chunk:
                            break
            yield from batch
            if len(batch) < chunk:
                return
            key = _KEY(batch[-1][0] + 1)

    # ------------------------------------------------------------------ writing

    def add(self, index: int, value: bytes) -> None:
        """Queue one encoded sample; the committer thread writes it (see ``_commit``)."""
        with self._lock:
            if self.readonly or (self._env is None and not _fs.writable(self.path)):
                raise ReadOnlyCacheError(
                    f"Cache '{self.path}' is read-only (read-only directory or mount) and index {index} is not "
                    "cached. Open the cache without a dataset, or copy it to a writable location to fill it."
                )
            self._queue.add(index, value)

    def flush(self) -> int:
        """Commit this process's queued samples and wait for them; return how many were queued."""
        with self._lock:
            return self._queue.drain()

    @property
    def written(self) -> int:
        """Samples this process's commits have written (indices already present are not counted)."""
        return self._queue.written

    def put_many(self, items: Iterable[tuple[int, bytes]]) -> int:
        """Write (index, value) pairs now, in one transaction, skipping indices already present.

        Returns the number of records actually written.
        """
        batch = sorted(items)
        with self._lock:
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
        items = [(_KEY(i), v) for i, v in batch]
        need = sum(len(k) + len(v) for k, v in items)
        with self._write_lock():
            with self._lock:
                env = self._env or self._env_or_open()
                self._maybe_reader_check(env)
                self._reserve(env, need)
            for _ in range(64):
                try:
                    written = 0
                    with env.begin(write=True) as txn:
                        self._check_cache_id(txn)
                        put, db = txn.put, self._samples
                        for key, value in items:
                            written += put(key, value, db=db, overwrite=False)
                    return written
                except lmdb.MapFullError:
                    with self._lock:
                        self._grow(env, need)
                except lmdb.MapResizedError:
                    with self._lock:
                        self._drop_reader()
                        env.set_mapsize(0)
                except lmdb.Error as exc:
                    raise _write_failure(
                        exc,
                        self.path,
                        f"{len(items)} samples were not cached (they are decoded again on the next read; "
                        "everything committed before is intact)",
                    ) from exc
        raise LmdbCacheError(f"Cache '{self.path}': could not make room for {need} bytes after 64 map growths.")

    def _check_cache_id(self, txn: lmdb.Transaction) -> None:
        raw = txn.get(_META_KEY, db=self._meta_db)
        stored = msgpack.unpackb(raw).get("cache_id") if raw is not None else None
        if stored != self._cache_id:
            raise CacheMismatchError(
                f"Cache '{self.path}' was rebuilt by another process (overwrite=True) while this one was filling "
                "it; its queued samples were dropped. Create the dataset again."
            )

    def _reserve(self, env: lmdb.Environment, need: int) -> None:
        """Grow the map before a commit that would not fit, so it rarely has to be retried."""
        info = env.info()
        used = (info["last_pgno"] + 1) * env.stat()["psize"]
        if used + 2 * need + _MIB > info["map_size"]:
            self._grow(env, need)

    def _grow(self, env: lmdb.Environment, need: int) -> None:
        self._drop_reader()  # set_mapsize invalidates every transaction of this process
        info = env.info()
        used = (info["last_pgno"] + 1) * env.stat()["psize"]
        size = max(2 * info["map_size"], used + 2 * need + 16 * _MIB)
        env.set_mapsize(-(-size // _MIB) * _MIB)  # a whole number of MiB, hence of pages

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Commit the queue, end the committer thread and close the environment (it reopens on next use)."""
        with self._lock:
            try:
                self._queue.stop()
            finally:
                self._close_env()

    def before_fork(self) -> None:
        """Commit, stop the committer thread and close the environment; the lock stays held across the fork."""
        self._lock.acquire()
        try:
            self._queue.stop()
        except Exception:
            pass  # the samples stay queued in the parent; the error resurfaces on its next commit
        self._close_env()

    def after_fork(self, in_child: bool) -> None:
        if in_child:
            self._queue.forget()  # the parent's samples; its committer thread does not exist here
        self._lock.release()

    def _close_env(self) -> None:
        self._drop_reader()
        env, self._env = self._env, None
        if env is not None:
            env.close()

    def _write_lock(self) -> filelock.BaseFileLock:
        if self._file_lock is None:
            self._file_lock = filelock.FileLock(os.path.join(self.path, WRITE_LOCK))
        return self._file_lock

    def delete(self, keys: Iterable[int]) -> int:
        """Delete the given indices (used by ``verify --repair``); returns how many existed."""
        with self._lock:
            env = self._env or self._env_or_open()
            with self._write_lock(), env.begin(write=True) as txn:
                return sum(txn.delete(_KEY(k), db=self._samples) for k in keys)


# ---------------------------------------------------------------------- helpers


def _remove_lmdb_files(path: str) -> None:
    for name in (DATA_FILE, LOCK_FILE):
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass


def _write_failure(exc: lmdb.Error, path: str, lost: str) -> LmdbCacheError:
    """The error for a failed write to ``path``; ``lost`` says what did not get written."""
    if isinstance(exc, lmdb.ReadonlyError):
        return ReadOnlyCacheError(f"Cache '{path}' is read-only: {lost}.")
    free = shutil.disk_usage(path).free
    # LMDB reports a short write on a full disk as EIO, so judge by the free space.
    if free < 64 * _MIB or "space" in str(exc):
        return CacheFullError(
            f"The disk holding '{path}' is full ({free:,} bytes free): {lost}. Free some space or move the "
            f"cache. (LMDB said: {exc})"
        )
    return _translate(exc, path, "writing")


def _translate(exc: lmdb.Error, path: str, action: str) -> LmdbCacheError:
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError)):
        return CorruptCacheError(
            f"Cache '{path}' is damaged ({exc}) while {action}. Delete it, or pass overwrite=True."
        )
    if isinstance(exc, lmdb.ReadonlyError):
        return ReadOnlyCacheError(f"Cache '{path}' is read-only ({exc}) while {action}.")
    return LmdbCacheError(f"LMDB error while {action} cache '{path}': {exc}")
