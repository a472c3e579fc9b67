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
import socket
import struct
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import filelock
import lmdb
import msgpack

from . import _fs, codec
from ._commit import CommitQueue, Policy
from ._guard import MapGuard
from ._options import MIB as _MIB
from ._options import parse_size
from ._version import FORMAT_VERSION, OLDEST_READABLE_FORMAT, __version__
from .errors import (
    CacheFullError,
    CacheMismatchError,
    CorruptCacheError,
    CorruptSampleError,
    LmdbCacheError,
    LmdbCacheWarning,
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
_MAX_MAP = 1 << 46  # 64 TiB: beyond what a 47-bit user address space can map
_READER_MAX_AGE = 0.25  # seconds a kept read transaction may pin its snapshot
# Every live process clears dead processes' reader slots this often (when it renews a read
# transaction or commits), so a process that cannot even open the cache because the table
# is full of them gets in on one of its retries.
_READER_CHECK_INTERVAL = 5.0
_OPEN_RETRIES = 30  # x 0.2 s
# Per-index "verified" flags cost a byte per index; beyond this length every read is verified.
_VERIFIED_MAX = 1 << 24
# The metadata record's fields and their types (``format_version`` is checked first, apart).
_META_FIELDS: dict[str, type] = {
    "length": int,
    "fingerprint": str,
    "cache_id": str,
    "created": str,
    "library_version": str,
}
_REBUILD = (
    "Rebuild it (overwrite=True, or `lmdbcache precompute --overwrite`), or copy it from a good replica "
    "(`lmdbcache copy`)."
)


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
        self.checksum = checksum  # the default for reads that do not say (tools)
        self.map_size = min(parse_size(map_size), _MAX_MAP)
        self.max_readers = int(max_readers)
        # Handed out by _registry in this process and usable here; False in a child forked since
        # (a plain attribute rather than a pid compare: the hit path asks it per sample).
        self.owned = False
        self.readonly = False
        self.refs = 0
        self._lock = threading.Lock()
        self._env: lmdb.Environment | None = None
        self._samples: Any = None
        self._meta_db: Any = None
        self._file_lock: filelock.BaseFileLock | None = None
        # The build id (``cache_id``) this process adopted and checked; a rebuild gives the cache a
        # new one. Reads and writes verify it. A plain attribute: datasets compare it per sample.
        self.build: str | None = None
        self._queue = CommitQueue(
            self._lock,
            self._write_batch,
            Policy(commit_every, parse_size(commit_bytes, "commit_bytes"), commit_interval),
            on_idle=self._idle,
        )
        self._meta: dict[str, Any] | None = None
        self._meta_raw: bytes = b""  # the metadata record as adopted: a rebuild changes it
        # Why this process may no longer use the build it adopted (set when a rebuild is seen).
        self._stale: str | None = None
        # A read transaction kept open between hits (see _reader) and when it goes stale.
        self._rtxn: lmdb.Transaction | None = None
        self._rtxn_expires = 0.0
        # Byte i set: this process has verified index i's data checksum (checksum="once"). A byte
        # rather than a bit per index: N bytes per process is small, and the test is cheaper.
        self._verified: bytearray | None = None
        self._locked = True  # False on a read-only mount opened without LMDB's lock table
        self._last_reader_check = 0.0
        self._guard: MapGuard | None = None
        self._close_when_idle = False  # close() was interrupted while a batch was being written

    def reconcile(self, map_size: int, max_readers: int) -> None:
        """Another object asks for this open store with its own per-environment options.

        A larger map is honoured (applied before the next commit, or when the environment
        opens); a different reader table cannot be (LMDB fixes it when the first process opens
        the environment), which is a warning.
        """
        if max_readers != self.max_readers:
            warnings.warn(
                f"Cache '{self.path}' is already open in this process with max_readers={self.max_readers}; "
                f"max_readers={max_readers} cannot take effect (LMDB sizes the reader table when the first "
                "process opens the cache). Pass the same value to every CachedDataset on this path.",
                LmdbCacheWarning,
                stacklevel=4,
            )
        map_size = min(parse_size(map_size), _MAX_MAP)
        if map_size > self.map_size:
            # Applied by the next commit's _reserve, under the write lock: set_mapsize while this
            # process's committer thread has a write transaction open would fail.
            self.map_size = map_size

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
                meta, raw = self._initialize(length, fingerprint, overwrite, create)
            except BaseException:
                self._close_env()
                raise
            self._adopt(meta, raw)
            if meta["cache_id"] != previous:
                self._queue.forget()
            return meta

    def _initialize(
        self, length: int | None, fingerprint: str | None, overwrite: bool, create: bool
    ) -> tuple[dict[str, Any], bytes]:
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
            found = self._read_meta(env)
            if found is None:
                raise NotACacheError(
                    f"'{path}' holds an LMDB environment that lmdbcache did not create (it has no metadata)."
                )
            return self._check_meta(found[0], length, fingerprint), found[1]

        self._check_dir(overwrite)  # before the lock file is created: refuse without touching anything
        self._check_free_space()
        with self._write_lock():
            self._check_dir(overwrite)
            if not self._check_data_file(overwrite):
                _remove_lmdb_files(path)
            try:
                env = self._open_env(readonly=False)
                found = self._read_meta(env)
            except (CorruptCacheError, NotACacheError, CacheMismatchError):
                if not overwrite:
                    raise
                self._close_env()
                _remove_lmdb_files(path)
                env = self._open_env(readonly=False)
                found = None
            if found is None or overwrite:
                if length is None:
                    raise NotACacheError(
                        f"There is no lmdbcache cache at '{path}' to open without a dataset. Build it first "
                        "(`lmdbcache precompute`, or CachedDataset with the source dataset)."
                    )
                return self._write_meta(env, length, fingerprint or "")
            meta = self._check_meta(found[0], length, fingerprint)
            if length is not None and meta["format_version"] < FORMAT_VERSION:
                return self._upgrade_meta(env, meta)  # this process may add values: they are this format's
            return found

    def _check_free_space(self) -> None:
        """Refuse to create LMDB's files on a full disk: LMDB writes lock.mdb through a memory map,
        and a page the filesystem cannot back kills the process with SIGBUS instead of an error."""
        if os.path.exists(os.path.join(self.path, LOCK_FILE)):
            return
        need = _MIB + 64 * self.max_readers + 8192
        free = shutil.disk_usage(self.path).free
        if free < need:
            raise CacheFullError(
                f"The disk holding '{self.path}' is full ({free:,} bytes free; creating a cache needs at least "
                f"{need:,}). Free some space or choose another location."
            )

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
                # LMDB opens a file larger than map_size with a map exactly its size: no room for
                # even the free-list pages of a rebuild or a metadata update. Make some first.
                self._reserve(env, 4 * _MIB)
        except lmdb.Error as exc:
            env.close()
            raise _translate(exc, path, "opening") from exc
        except BaseException:
            env.close()
            raise
        self._env = env
        self.readonly = readonly
        self._guard = MapGuard(os.path.join(path, DATA_FILE), env.stat()["psize"])
        return env

    def _env_or_open(self) -> lmdb.Environment:
        """The environment, opened on first use in this process (a worker, or after a fork)."""
        env = self._env
        if env is not None:
            return env
        if self._stale is not None:
            raise CacheMismatchError(self._stale)
        readonly = not _fs.writable(self.path)
        if not readonly:
            self._check_data_file(overwrite=False)
        env = self._open_env(readonly=readonly)
        try:
            found = self._read_meta(env)
            if found is None:
                raise CacheMismatchError(
                    f"Cache '{self.path}' was emptied or replaced by another process since this dataset opened it "
                    "(it has no metadata now). Create the dataset again."
                )
            meta, raw = found
            if self.build is not None and meta["cache_id"] != self.build:
                raise CacheMismatchError(self._rebuilt_message(meta))
        except BaseException:
            self._close_env()
            raise
        self._adopt(meta, raw)
        return env

    def expect_build(self, build: str) -> None:
        """Open (lazily) only the build ``build``: a dataset unpickled in a worker checks its cache is the same."""
        with self._lock:
            if self.build is None:
                self.build = build

    def _adopt(self, meta: dict[str, Any], raw: bytes) -> None:
        if meta["cache_id"] != self.build:
            self._verified = None  # flags of another build's values
        if meta["cache_id"] != self.build:  # else keep the same object: datasets compare by identity
            self.build = meta["cache_id"]
        self._meta, self._meta_raw, self._stale = meta, raw, None
        length = meta["length"]
        verified = self._verified
        if length <= _VERIFIED_MAX and (verified is None or len(verified) < length):
            self._verified = bytearray(length)

    def _same_build(self, txn: lmdb.Transaction) -> tuple[bool, dict[str, Any] | None, Any]:
        """Does ``txn`` still hold the build this process adopted? (same, the metadata if it was parsed, its bytes).

        One small get and a byte compare; the record is parsed only when its bytes changed
        (a rebuild, or an older format's metadata upgraded in place with the same build id).
        """
        raw = txn.get(_META_KEY, db=self._meta_db)
        if raw is None:
            return False, None, None
        if raw == self._meta_raw:
            return True, None, raw
        try:
            meta = self._validate_meta(msgpack.unpackb(raw))
        except Exception:  # damaged or hostile metadata: treated as another build
            return False, None, raw
        return meta["cache_id"] == self.build, meta, raw

    def _check_build(self, txn: lmdb.Transaction) -> None:
        """Raise if another process rebuilt the cache since this one adopted its build (once per read transaction)."""
        same, meta, raw = self._same_build(txn)
        if same:
            if meta is not None:
                self._meta, self._meta_raw = meta, bytes(raw)  # metadata upgraded in place
            return
        self._stale = self._rebuilt_message(meta)
        self._queue.forget()  # samples of the old build must not reach the new one
        raise CacheMismatchError(self._stale)

    def _rebuilt_message(self, meta: dict[str, Any] | None) -> str:
        if meta is None:
            now = "it no longer holds valid metadata"
        else:
            builder = meta.get("builder")
            now = (
                f"it now holds a new build for fingerprint '{meta['fingerprint']}' (length {meta['length']}), "
                f"created {meta['created']}" + (f" by {builder}" if isinstance(builder, str) else "")
            )
        return (
            f"Cache '{self.path}' was rebuilt (overwrite=True) after this process opened it: {now}. Samples of the "
            "build this dataset was opened on are gone; nothing is read from or written to the new build through "
            "it. Create the dataset again to use the new build."
        )

    def mismatch(self, build: str) -> CacheMismatchError:
        """The error for a dataset opened on ``build`` when this store now holds another build."""
        meta = self._meta
        return CacheMismatchError(
            self._stale
            if self._stale is not None
            else self._rebuilt_message(meta).replace(
                "after this process opened it", "in this process since this dataset opened it"
            )
        )

    def _read_meta(self, env: lmdb.Environment) -> tuple[dict[str, Any], bytes] | None:
        """The validated metadata record and its bytes, or None for an empty environment."""
        with self._begin(env) as txn:
            try:
                raw = txn.get(_META_KEY, db=self._meta_db)
                if raw is None:
                    if txn.stat(self._samples)["entries"]:
                        raise NotACacheError(
                            f"Cache '{self.path}' has samples but no metadata; it was not written by lmdbcache."
                        )
                    return None
                raw = bytes(raw)
            except lmdb.Error as exc:
                raise _translate(exc, self.path, "reading the metadata of") from exc
        try:
            meta = msgpack.unpackb(raw, strict_map_key=False)
        except Exception as exc:
            raise CorruptCacheError(
                f"Cache '{self.path}' has unreadable metadata ({type(exc).__name__}: {exc}). {_REBUILD}"
            ) from None
        return self._validate_meta(meta), raw

    def _validate_meta(self, meta: Any) -> dict[str, Any]:
        """Check the metadata record's fields before anything uses them (a cache file is untrusted input)."""
        if not isinstance(meta, dict) or "format_version" not in meta:
            raise NotACacheError(f"'{self.path}' holds an LMDB environment whose metadata is not lmdbcache's.")
        stored = meta["format_version"]
        fix = f"Delete '{self.path}', use another path, or pass overwrite=True to rebuild it."
        if type(stored) is not int:
            raise CorruptCacheError(
                f"Cache '{self.path}' has damaged metadata: field 'format_version' is {stored!r}, not an integer. "
                f"{_REBUILD}"
            )
        if stored < OLDEST_READABLE_FORMAT:
            raise CacheMismatchError(
                f"Cache '{self.path}' was written in format {stored}, older than this lmdbcache {__version__} reads "
                f"(formats {OLDEST_READABLE_FORMAT} to {FORMAT_VERSION}). {fix}"
            )
        if stored > FORMAT_VERSION:
            raise CacheMismatchError(
                f"Cache '{self.path}' was written by lmdbcache format {stored} (lmdbcache "
                f"{meta.get('library_version')}); this is lmdbcache {__version__}, which reads formats "
                f"{OLDEST_READABLE_FORMAT} to {FORMAT_VERSION}: upgrade lmdbcache, or {fix[0].lower()}{fix[1:]}"
            )
        for field, kind in _META_FIELDS.items():
            if field not in meta:
                raise CorruptCacheError(
                    f"Cache '{self.path}' has damaged metadata: field '{field}' is missing. {_REBUILD}"
                )
            value = meta[field]
            if (
                type(value) is not kind
                or (type(value) is int and not 0 <= value < 2**63)
                or (field == "cache_id" and not value)
            ):
                expected = (
                    "an integer from 0 to 2**63 - 1"
                    if kind is int
                    else "a non-empty string"
                    if field == "cache_id"
                    else "a string"
                )
                raise CorruptCacheError(
                    f"Cache '{self.path}' has damaged metadata: field '{field}' is {value!r:.80}, expected {expected}. "
                    f"{_REBUILD}"
                )
        return meta

    def _write_meta(self, env: lmdb.Environment, length: int, fingerprint: str) -> tuple[dict[str, Any], bytes]:
        meta = {
            "format_version": FORMAT_VERSION,
            "length": int(length),
            "fingerprint": fingerprint,
            "library_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cache_id": uuid.uuid4().hex,
            "builder": f"pid {os.getpid()} on {socket.gethostname()}",
        }
        raw = msgpack.packb(meta)
        try:
            with env.begin(write=True) as txn:
                txn.drop(self._samples, delete=False)
                txn.put(_META_KEY, raw, db=self._meta_db)
        except lmdb.Error as exc:
            raise _write_failure(exc, self.path, "the cache was not created or rebuilt") from exc
        return meta, raw

    def _upgrade_meta(self, env: lmdb.Environment, meta: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """Mark an older-format cache as this format before this process adds values to it.

        Values of older formats stay readable (the codec reads each by its own version byte);
        the build id is kept, so processes reading it are not told it was rebuilt.
        """
        meta = {k: v for k, v in meta.items() if k != "codec"}
        meta["upgraded_from"], meta["format_version"] = meta["format_version"], FORMAT_VERSION
        raw = msgpack.packb(meta)
        try:
            with env.begin(write=True) as txn:
                txn.put(_META_KEY, raw, db=self._meta_db)
        except lmdb.Error as exc:
            raise _write_failure(exc, self.path, "the metadata was not updated; nothing was lost") from exc
        return meta, raw

    def _check_meta(self, meta: dict[str, Any], length: int | None, fingerprint: str | None) -> dict[str, Any]:
        fix = f"Delete '{self.path}', use another path, or pass overwrite=True to rebuild it."
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
        that writers want to reuse) and renewed after _READER_MAX_AGE seconds. Each new
        transaction first checks the cache was not rebuilt since this process adopted it.
        """
        txn = self._rtxn
        if txn is not None:
            if time.monotonic() < self._rtxn_expires:
                return txn
            self._drop_reader()
        env = self._env or self._env_or_open()
        self._maybe_reader_check(env)
        txn = self._begin_checked(env, db=self._samples)
        self._rtxn, self._rtxn_expires = txn, time.monotonic() + _READER_MAX_AGE
        return txn

    def _begin_checked(self, env: lmdb.Environment, db: Any = None) -> lmdb.Transaction:
        """A read transaction on the build this process adopted (else CacheMismatchError)."""
        if self._stale is not None:
            raise CacheMismatchError(self._stale)
        txn = self._begin(env, db=db)
        try:
            self._check_build(txn)
        except lmdb.Error as exc:
            txn.abort()
            raise _translate(exc, self.path, "reading") from exc
        except BaseException:
            txn.abort()
            raise
        return txn

    def _maybe_reader_check(self, env: lmdb.Environment) -> None:
        """Clear dead processes' reader slots, at most every _READER_CHECK_INTERVAL seconds."""
        now = time.monotonic()
        if self._locked and now - self._last_reader_check >= _READER_CHECK_INTERVAL:
            self._last_reader_check = now
            try:
                env.reader_check()
            except lmdb.Error as exc:
                raise _translate(exc, self.path, "clearing stale readers of") from exc

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

    def get(self, index: int, always: bool = False, build: str | None = None) -> Any:
        """The decoded sample at ``index`` of the build ``build``, or ``MISSING``. The hot path: kept flat.

        The value's structure (and its binding to ``index``) is checked on every read; its
        record's bounds (``_guard``) the first time this process reads the index; its data
        checksum then too, or on every read if ``always``. The build is checked under the lock, so a rebuild
        by another object in this process can never slip between a caller's check and the read.
        """
        lock = self._lock
        lock.acquire()  # not `with`: half the cost, and this runs once per sample
        try:
            if build is not self.build and build is not None and build != self.build:
                raise self.mismatch(build)
            txn = self._rtxn
            if txn is None or _monotonic() >= self._rtxn_expires:
                txn = self._reader()
            verified = self._verified
            if verified is not None and index < len(verified) and verified[index]:
                try:
                    raw = txn.get(_KEY(index))
                except lmdb.Error as exc:
                    raise self._read_failure(exc, index) from exc
                if raw is not None:
                    try:
                        return _decode(raw, index, verify_data=always)
                    except CorruptSampleError as exc:
                        raise self._corrupt(index, exc) from None
            else:
                raw = self._fetch(txn, index)
            if raw is None:
                return self._get_fresh([index], always)[0]
            return self._decode(raw, index, always)
        finally:
            lock.release()

    def _fetch(self, txn: lmdb.Transaction, index: int) -> Any:
        """The stored value of ``index`` (a view into the map) or None, its record bounds-checked first."""
        key = _KEY(index)
        try:
            guard = self._guard
            if guard is None or not guard.start:
                return txn.get(key, db=self._samples)
            cursor = txn.cursor(db=self._samples)
            if not cursor.set_key(key):
                return None
            problem = guard.problem(cursor.key())
            if problem is not None:
                raise CorruptCacheError(
                    f"Cache '{self.path}' is damaged: the record of index {index} is broken ({problem}); it was not "
                    f"read. {_REBUILD}"
                )
            return cursor.value()
        except lmdb.Error as exc:
            raise self._read_failure(exc, index) from exc

    def get_many(self, indices: list[int], always: bool = False, build: str | None = None) -> list[Any]:
        """Decode a batch of the build ``build`` in one read transaction; misses come back as ``MISSING``."""
        with self._lock:
            if build is not None and build != self.build:
                raise self.mismatch(build)
            txn = self._reader()
            get, decode, fetch, verified = txn.get, self._decode, self._fetch, self._verified
            out = []
            for index in indices:
                if verified is not None and index < len(verified) and verified[index]:
                    try:
                        raw = get(_KEY(index))
                    except lmdb.Error as exc:
                        raise self._read_failure(exc, index) from exc
                else:
                    raw = fetch(txn, index)
                out.append(MISSING if raw is None else decode(raw, index, always))
            misses = [k for k, sample in enumerate(out) if sample is MISSING]
            if misses:
                for k, sample in zip(misses, self._get_fresh([indices[k] for k in misses], always)):
                    out[k] = sample
        return out

    def _get_fresh(self, indices: list[int], always: bool) -> list[Any]:
        """Look misses up again in a new snapshot, then in this process's queue. Holds self._lock."""
        self._drop_reader()
        out = []
        with self._begin_checked(self._env or self._env_or_open()) as txn:
            for index in indices:
                raw = self._fetch(txn, index)
                if raw is None:
                    raw = self._queue.lookup(index)
                out.append(MISSING if raw is None else self._decode(raw, index, always))
        return out

    def raw(self, index: int) -> bytes | None:
        """The stored value of ``index`` as bytes (committed or queued here), or None."""
        with self._lock:
            self._drop_reader()
            with self._begin_checked(self._env or self._env_or_open(), db=self._samples) as txn:
                raw = self._fetch(txn, index)
                if raw is None:
                    return self._queue.lookup(index)
                return bytes(raw)

    def cached_near(self, starts: Iterable[int]) -> list[int]:
        """For each start, the first cached index at or after it (wrapping around), without duplicates."""
        found: list[int] = []
        with self._lock:
            self._drop_reader()
            with self._begin_checked(self._env or self._env_or_open(), db=self._samples) as txn:
                try:
                    cursor = txn.cursor()
                    for start in starts:
                        if cursor.set_range(_KEY(start)) or cursor.first():
                            key = cursor.key()
                            if len(key) == 8 and _UNKEY(key)[0] not in found:
                                found.append(_UNKEY(key)[0])
                except lmdb.Error as exc:
                    raise _translate(exc, self.path, "reading") from exc
        return found

    def _decode(self, raw: Any, index: int, always: bool = False) -> Any:
        verified = self._verified
        try:
            if verified is None or index >= len(verified):
                return _decode(raw, index)
            if verified[index]:
                return _decode(raw, index, verify_data=always)
            sample = _decode(raw, index)
            verified[index] = 1  # its record's bounds and data checksums passed in this process
            return sample
        except CorruptSampleError as exc:
            raise self._corrupt(index, exc) from None

    def _corrupt(self, index: int, exc: CorruptSampleError) -> CorruptSampleError:
        return CorruptSampleError(
            f"Cache '{self.path}': the stored value of index {index} is damaged ({exc}); it was not returned. "
            f"Run `lmdbcache verify --repair {self.path}` to drop damaged entries (they are decoded again "
            "from the source on the next read)."
        )

    def _read_failure(self, exc: lmdb.Error, index: int) -> LmdbCacheError:
        self._drop_reader()  # a transaction that failed is not reused
        return _translate(exc, self.path, f"reading index {index} of")

    def env_info(self) -> dict[str, Any]:
        """LMDB's ``Environment.info()`` (map size, last page, readers) for this cache."""
        with self._lock:
            try:
                return dict((self._env or self._env_or_open()).info())
            except lmdb.Error as exc:
                raise _translate(exc, self.path, "inspecting") from exc

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
        with self._lock, self._begin_checked(self._env or self._env_or_open()) as txn:
            try:
                entries = int(txn.stat(self._samples)["entries"])
            except lmdb.Error as exc:
                raise _translate(exc, self.path, "counting the samples of") from exc
        assert self._meta is not None
        if entries > self._meta["length"]:
            raise CorruptCacheError(
                f"Cache '{self.path}' is damaged: LMDB counts {entries:,} samples in a cache of length "
                f"{self._meta['length']:,}. {_REBUILD}"
            )
        return entries

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
            with self._lock, self._begin_checked(self._env or self._env_or_open()) as txn:
                try:
                    cursor = txn.cursor(db=self._samples)
                    for k in cursor.iternext(values=False) if cursor.set_range(key) else ():
                        if len(k) != 8:
                            raise CorruptCacheError(
                                f"Cache '{self.path}' is damaged: it holds a key of {len(k)} bytes "
                                f"({bytes(k)[:16]!r}), not an 8-byte index. {_REBUILD}"
                            )
                        index = _UNKEY(k)[0]
                        value = None
                        if values:
                            # Checked before the value is touched (see _guard), then copied out.
                            problem = self._guard.problem(k) if self._guard is not None else None
                            if problem is not None:
                                raise CorruptCacheError(
                                    f"Cache '{self.path}' is damaged: the record of index {index} is broken "
                                    f"({problem}). {_REBUILD}"
                                )
                            value = bytes(cursor.value())
                        batch.append((index, value))
                        if len(batch) == chunk:
                            break
                except lmdb.Error as exc:
                    raise _translate(exc, self.path, f"scanning (near index {_UNKEY(key)[0]})") from exc
            yield from batch
            if len(batch) < chunk or batch[-1][0] == 2**64 - 1:
                return
            key = _KEY(batch[-1][0] + 1)

    # ------------------------------------------------------------------ writing

    def add(self, index: int, value: bytes, build: str | None = None, policy: Policy | None = None) -> None:
        """Queue one encoded sample for the build ``build``; the committer thread writes it (see ``_commit``).

        ``build`` (the dataset's build id) guards against a rebuild in between: a sample of a
        build this store no longer holds is refused, never written into the new one.
        """
        with self._lock:
            if build is not None and build != self.build:
                raise self.mismatch(build)
            if self._stale is not None:
                raise CacheMismatchError(self._stale)
            if self.readonly or (self._env is None and not _fs.writable(self.path)):
                raise ReadOnlyCacheError(
                    f"Cache '{self.path}' is read-only (read-only directory or mount) and index {index} is not "
                    "cached. Open the cache without a dataset, or copy it to a writable location to fill it."
                )
            self._queue.add(index, value, policy)

    def flush(self) -> int:
        """Commit this process's queued samples and wait for them; return how many were queued."""
        with self._lock:
            return self._queue.drain()

    @property
    def written(self) -> int:
        """Samples this process's commits have written (indices already present are not counted)."""
        return self._queue.written

    def put_many(self, items: Iterable[tuple[int, bytes]], build: str | None = None) -> int:
        """Write (index, value) pairs of the build ``build`` now, in one transaction, skipping indices present.

        Returns the number of records actually written. A rebuild waits for the write (the
        batch is in flight), so the build checked here is the one written into.
        """
        batch = sorted(items)
        with self._lock:
            if build is not None and build != self.build:
                raise self.mismatch(build)
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
        """Inside a write transaction: refuse to write into a build this process did not adopt."""
        if not self._same_build(txn)[0]:
            raise CacheMismatchError(
                f"Cache '{self.path}' was rebuilt by another process (overwrite=True) while this one was filling "
                "it; its queued samples were dropped. Create the dataset again."
            )

    def _reserve(self, env: lmdb.Environment, need: int) -> None:
        """Grow the map before a commit that would not fit, so it rarely has to be retried.

        Also applies a larger ``map_size`` another object asked for (``reconcile``).
        """
        info = env.info()
        used = (info["last_pgno"] + 1) * env.stat()["psize"]
        if used + 2 * need + _MIB > info["map_size"]:
            self._grow(env, need)
        elif info["map_size"] < self.map_size:
            self._drop_reader()
            env.set_mapsize(self.map_size)

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
                # A second Ctrl-C can end stop() while the thread is still writing: its transaction
                # must not lose its environment under it. The thread closes it when done (_idle).
                if self._queue.busy:
                    self._close_when_idle = True
                else:
                    self._close_env()

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
            try:
                with self._write_lock(), env.begin(write=True) as txn:
                    self._check_cache_id(txn)
                    return sum(txn.delete(_KEY(k), db=self._samples) for k in keys)
            except lmdb.Error as exc:
                raise _write_failure(exc, self.path, "nothing was deleted") from exc


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


# The one table that turns LMDB's errors into the library's: (LMDB classes, our class, what it means).
# Errors that only a damaged file produces (a page number past the end, a B-tree deeper than
# LMDB's cursor stack, a transaction LMDB gave up on after such an error) all mean "damaged".
_LMDB_ERRORS: list[tuple[tuple[type[lmdb.Error], ...], type[LmdbCacheError], str]] = [
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


def _translate(exc: lmdb.Error, path: str, action: str) -> LmdbCacheError:
    """The library error for an LMDB error met while ``action`` (e.g. "reading index 7 of") the cache."""
    for classes, ours, meaning in _LMDB_ERRORS:
        if isinstance(exc, classes):
            fix = f" {_REBUILD}" if ours is CorruptCacheError else ""
            return ours(f"Cache '{path}' {meaning}: LMDB said '{exc}' while {action} it.{fix}")
    return LmdbCacheError(f"Cache '{path}': LMDB error while {action} it: {exc}")
