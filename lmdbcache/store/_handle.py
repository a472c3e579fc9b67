"""The state a Store keeps for one cache directory in one process, and the questions it answers.

``Handle`` holds the environment this process opened (lazily, on first use: a DataLoader
worker or a forked child opens its own), the build (``cache_id``) it adopted and checked,
and the read transactions every read and write path begins from, each checked against
that build. The reader (``_read.Reader``) and the writer (``_write.Writer``) each hold it as a
member; ``_store.Store`` makes all three and adds creating, rebuilding and closing. The handle
never reaches into either: what they must hear of it (a kept transaction to end, a build
adopted, a rebuild seen) it tells them through the three callables ``Store`` wires (``listen``).

Thread-safe by convention: every method here runs with ``self._lock`` held by its caller.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import lmdb
import msgpack

from .._options import MIB, parse_size
from ..errors import CacheClosedError, CacheMismatchError, NotACacheError
from ..format import _compress
from ..format._frames import require
from . import _fs, _metadata
from ._engine import layout_of
from ._env import MAX_MAP, RESIZE_RETRIES, open_databases, open_env, reserved_size
from ._fs import DATA_FILE
from ._guard import MapGuard
from ._lmdb_errors import readers_full, translate

__all__ = ["Handle"]

# Every live process clears dead processes' reader slots this often (when it renews a read
# transaction or commits), so a process that cannot even open the cache because the table
# is full of them gets in on one of its retries.
_READER_CHECK_INTERVAL = 5.0


class Handle:
    """One process's environment for a cache directory and the build it adopted (see the module docstring)."""

    def __init__(self, path: str, *, map_size: int = 64 * MIB, max_readers: int = 1024) -> None:
        self.path = path
        self.map_size = min(parse_size(map_size), MAX_MAP)
        self.max_readers = int(max_readers)
        self.readonly = False
        # Released for good (its last reference closed it): a thread still inside a read on it must
        # not reopen its environment beside the one a new Store for the same path opens (issue #22).
        self.retired = False
        self._lock = threading.Lock()
        self.commits = 0  # write transactions committed through this handle: a kept read snapshot older is renewed
        self._env: lmdb.Environment | None = None
        self._samples: Any = None
        self._meta_db: Any = None
        # The build id (``cache_id``) this process adopted and checked; a rebuild gives the cache a
        # new one. Reads and writes verify it. A plain attribute: datasets compare it per sample.
        self.build: str | None = None
        self._meta: dict[str, Any] | None = None
        self._meta_raw: bytes = b""  # the metadata record as adopted: a rebuild changes it
        # Why this process may no longer use the build it adopted (set when a rebuild is seen).
        self._stale: str | None = None
        # (environment, txnid) of the last snapshot whose build was checked: a miss begins a transaction each.
        self._build_seen: tuple[lmdb.Environment, int] | None = None
        self._locked = True  # False on a read-only mount opened without LMDB's lock table
        self._last_reader_check = 0.0
        self._guard: MapGuard | None = None
        # The samples database's key in the main database, as the environment's engine stores it (the compiled
        # core looks it up itself): b"samples", or with a NUL under LMDB 1.0 (_engine)
        self.samples_key = b"samples"
        self._compressor: _compress.Compressor | None = None  # the adopted build's, if it compresses
        # The adopted build's chunk size K for packs (_pack; 0: none) and its dataset length.
        self._pack = 0
        self._length = 0
        # What the handle tells the reader and the writer composed over it (``listen``; none until then).
        self._drop_kept: Callable[[], None] = _nothing
        self._adopted: Callable[[bool], None] = _nothing_changed
        self._rebuilt: Callable[[], None] = _nothing

    def listen(
        self, *, drop_kept: Callable[[], None], adopted: Callable[[bool], None], rebuilt: Callable[[], None]
    ) -> None:
        """Wired once by ``Store``: the handle's three events, each told to the one part it concerns.

        ``drop_kept()``: the reader's kept read transaction must end (another is begun: one reader slot
        per process; the map changes size; the environment closes). ``adopted(changed)``: a build was
        adopted (``changed``: another build than before), the reader resets what it knew of the last one.
        ``rebuilt()``: another process rebuilt the cache, the writer drops what it queued for the old build.
        """
        self._drop_kept, self._adopted, self._rebuilt = drop_kept, adopted, rebuilt

    def _open_env(self, *, readonly: bool) -> lmdb.Environment:
        """Open this process's environment and the two databases. Caller holds self._lock."""
        path = self.path
        _fs.check_lmdb_files(path)  # a linked lock.mdb would be rewritten through the link, read-only too
        env, self._locked = open_env(path, map_size=self.map_size, max_readers=self.max_readers, readonly=readonly)
        try:
            layout = layout_of(env)  # the engine that opened this file: its format, not the module's default
            self._samples, self._meta_db = open_databases(env, path, readonly, layout.db_key)
            if not readonly:
                env.reader_check()  # reclaim the reader slots of processes that died
                self._last_reader_check = time.monotonic()
                # LMDB opens a file larger than map_size with a map exactly its size: no room for
                # even the free-list pages of a rebuild or a metadata update. Make some first.
                self._reserve(env, 4 * MIB)
            guard = MapGuard(os.path.join(path, DATA_FILE), env.stat()["psize"], layout.header)
            # The environment last, inside the try: a Ctrl-C between these left a new environment beside the last
            # one's guard, whose map was gone, and the core read through it (a segfault, found by an attack forking
            # beside reads); one after it unpublishes it below before it is closed.
            self.readonly, self._guard, self.samples_key = readonly, guard, layout.db_key(b"samples")
            self._env = env
        except lmdb.Error as exc:
            env.close()
            raise translate(exc, path, "opening") from exc
        except BaseException:
            if self._env is env:
                self._env = None
            env.close()
            raise
        return env

    def _env_or_open(self) -> lmdb.Environment:
        """The environment, opened on first use in this process (a worker, or after a fork)."""
        env = self._env
        if env is not None:
            return env
        if self._stale is not None:
            raise CacheMismatchError(self._stale)
        if self.retired:
            raise CacheClosedError(
                f"Cache '{self.path}' was closed by another thread while this read or write was running; "
                "nothing was lost. Use the dataset again: it reopens the cache."
            )
        readonly = not _fs.writable(self.path)
        if not readonly:
            _fs.check_data_file(self.path, overwrite=False)
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
                raise CacheMismatchError(_metadata.rebuilt_message(self.path, meta))
            self._require_codec(meta)
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

    def _require_codec(self, meta: dict[str, Any]) -> None:
        """Refuse a compressed build when its codec's extra is missing (MissingExtraError), before adopting it."""
        codec = _metadata.compression(meta)[0]
        if codec is not None:
            require(codec, self.path)

    @property
    def compressor(self) -> _compress.Compressor | None:
        """What the adopted build compresses values with (picklable: precompute hands it to its workers)."""
        return self._compressor

    def compress(self, value: bytes) -> bytes:
        """The form the adopted build stores an encoded value in (its buffers compressed if the build is)."""
        compressor = self._compressor
        return value if compressor is None else compressor(value)

    def _adopt(self, meta: dict[str, Any], raw: bytes) -> None:
        codec, level = _metadata.compression(meta)
        compressor = self._compressor
        if codec is None:
            self._compressor = None
        elif compressor is None or (compressor.codec, compressor.level) != (codec, level):
            self._compressor = _compress.Compressor(codec, level)
        changed = meta["cache_id"] != self.build
        if changed:  # else keep the same object: datasets compare by identity
            self.build = meta["cache_id"]
        self._meta, self._meta_raw, self._stale = meta, raw, None
        self._build_seen = None
        self._pack, self._length = meta.get("pack", 0), meta["length"]
        self._adopted(changed)  # the reader's flags and native tree were the last build's

    def _same_build(self, txn: lmdb.Transaction) -> tuple[bool, dict[str, Any] | None, Any]:
        """Does ``txn`` still hold the build this process adopted? (same, the metadata if it was parsed, its bytes).

        One small get and a byte compare; the record is parsed only when its bytes changed
        (a rebuild, or an older format's metadata upgraded in place with the same build id).
        """
        raw = txn.get(_metadata.KEY, db=self._meta_db)
        if raw is None:
            return False, None, None
        if raw == self._meta_raw:
            return True, None, raw
        try:
            meta = _metadata.validate(msgpack.unpackb(raw), self.path)
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
        self._stale = _metadata.rebuilt_message(self.path, meta)
        self._rebuilt()  # the writer's queued samples of the old build must not reach the new one
        raise CacheMismatchError(self._stale)

    def mismatch(self, build: str) -> CacheMismatchError:
        """The error for a dataset opened on ``build`` when this store now holds another build."""
        meta = self._meta
        return CacheMismatchError(
            self._stale
            if self._stale is not None
            else _metadata.rebuilt_message(self.path, meta).replace(
                "after this process opened it", "in this process since this dataset opened it"
            )
        )

    def _read_meta(self, env: lmdb.Environment) -> tuple[dict[str, Any], bytes] | None:
        """The validated metadata record and its bytes, or None for an empty environment."""
        with self._begin(env) as txn:
            try:
                raw = txn.get(_metadata.KEY, db=self._meta_db)
                if raw is None:
                    if txn.stat(self._samples)["entries"]:
                        raise NotACacheError(
                            f"Cache '{self.path}' has samples but no metadata; it was not written by lmdbcache."
                        )
                    return None
                raw = bytes(raw)
            except lmdb.Error as exc:
                raise translate(exc, self.path, "reading the metadata of") from exc
        return _metadata.parse(raw, self.path), raw

    def _begin(self, env: lmdb.Environment, write: bool = False, db: Any = None) -> lmdb.Transaction:
        if not write:
            # One reader slot per process: the kept transaction and this one would take two
            # (the aborted one stays in py-lmdb's spare-transaction cache with its slot).
            self._drop_reader()
        for attempt in range(RESIZE_RETRIES + 1):
            try:
                return env.begin(db=db, write=write, buffers=True)
            except lmdb.MapResizedError as exc:
                if attempt == RESIZE_RETRIES:
                    raise translate(exc, self.path, f"reading (the map grew {attempt + 1} times in a row)") from exc
                self._set_mapsize(env, 0)  # another process grew the map: adopt its size, and again if it grows on
            except lmdb.ReadersFullError:
                if attempt < RESIZE_RETRIES and env.reader_check():
                    continue
                raise readers_full(self.path) from None
            except lmdb.Error as exc:
                raise translate(exc, self.path, "reading") from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _begin_checked(self, env: lmdb.Environment, db: Any = None) -> lmdb.Transaction:
        """A read transaction on the build this process adopted (else CacheMismatchError)."""
        if self._stale is not None:
            raise CacheMismatchError(self._stale)
        txn = self._begin(env, db=db)
        if self._build_seen is not None and self._build_seen[0] is env and self._build_seen[1] == txn.id():
            return txn  # the snapshot checked last time (no commit since: the same metadata record)
        try:
            self._check_build(txn)
            self._build_seen = (env, txn.id())
        except lmdb.Error as exc:
            txn.abort()
            raise translate(exc, self.path, "reading") from exc
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
                raise translate(exc, self.path, "clearing stale readers of") from exc

    def _drop_reader(self) -> None:
        """End the reader's kept read transaction, if any (``listen``)."""
        self._drop_kept()

    def _close_env(self) -> None:
        self._drop_reader()
        env, self._env = self._env, None
        if env is not None:
            env.close()

    def _reserve(self, env: lmdb.Environment, need: int) -> None:
        """Make room for a commit of ``need`` bytes (and apply a larger ``map_size`` asked for by ``reconcile``)."""
        size = reserved_size(env, need, self.map_size)
        if size is not None:
            self._set_mapsize(env, size)

    def _set_mapsize(self, env: lmdb.Environment, size: int) -> None:
        """Every change of this process's map size goes through here (0: adopt another process's size)."""
        self._drop_reader()  # set_mapsize invalidates every transaction of this process
        try:
            env.set_mapsize(size)
        finally:
            if self._guard is not None:
                self._guard.refresh()  # the map may have moved: the guard's view of it must follow (see _guard)


def _nothing() -> None:
    pass


def _nothing_changed(changed: bool) -> None:
    pass
