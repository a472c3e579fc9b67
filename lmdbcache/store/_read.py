"""The read path: hits out of LMDB's memory map, checked as the store's checksum policy says.

A hit is the hot path (``get``): one lock, a read transaction kept between hits (renewed every ``_READER_MAX_AGE``
seconds and on any miss, so it never pins old pages for long), a cursor lookup, and ``codec.decode`` with its one
copy out of the map. The value's structure and its binding to the index are checked on every read; its record's
bounds (``_guard``) and its data checksum the first time this process reads the index (``checksum="once"``, one flag
byte per index), or the data checksum on every read (``"always"``). While reads are seen to be cold (two in a row
took over ``_COLD`` seconds), a large value (``_guard.PREFETCH_MIN`` bytes or more; flag byte 2 once verified) is
looked up with a cursor and announced to the kernel before it is touched, so it is read in one I/O rather than a
page fault per 4 KiB (issue #14). Warm, the advice would cost a 147 KiB read half its speed (a syscall walking 37
cached pages), so after ``_COLD_RUN`` fast reads it stops again. With the compiled core (``lmdbcache._native``;
``_native_read``), a hit is read in one C call instead (``core.Tree.sample`` in the samples tree the core found once
per kept transaction, packs included, every page and span checked against the map on every read): a flat value comes
back decoded and checked as above, any other a view for ``decode``; everything else above (flags, checksums, misses,
errors) is the same. A miss is looked up again in a fresh snapshot (unless its own is the newest) and in this
process's commit queue before it is reported ``MISSING``.

Packs (``_pack``): with packing on, a small value is looked up in its chunk's pack first, then
as a single record; its span is checked against the pack's header (and the record's bounds
before that, on the first read of the index) and the value is a slice of the pack, decoded as
a single record is. Scans merge packs and singles in index order, and report an index stored
in both (a hostile file).

Groups (``_group``, format 4): a pointer is followed into its group (``_groups.deref``: the group's
record bounds-checked, the span checked against it, the kept transaction's groups remembered); the
value is a slice of the group, decoded as a single record is; a pointer that lies is a ``CorruptSampleError``.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import lmdb

from .. import _native
from ..errors import CorruptCacheError, CorruptSampleError, LmdbCacheError
from ..format import _group, _pack, codec
from ..format._group import index_key
from ._groups import deref as _deref
from ._guard import PREFETCH_MIN
from ._handle import Handle
from ._lmdb_errors import REBUILD, translate
from ._native_read import MISSING, copied, copy_native, native_fill, native_lookup, native_spans, native_tree

__all__ = ["MISSING", "Reader"]


_PKEY = _pack.key
_TAG = _pack.TAG
_span = _pack.span
_pair = struct.Struct("<II").unpack_from
_POINTER_SIZE = _group.POINTER_SIZE
_PACKS_KEPT = 1 << 16  # packs remembered per read transaction (a view each)
assert _pack.SMALL == PREFETCH_MIN  # a packed value is small: read by the small-value path, never _large
_decode = codec.decode
_monotonic = time.monotonic
_READER_MAX_AGE = 0.25  # seconds a kept read transaction may pin its snapshot
_clock = time.perf_counter
_COLD = 50e-6  # seconds: a large value read slower than this came from the disk (warm: a few us)
_COLD_RUN = 64  # large reads prefetched after a cold one, each cold read starting the count again
# Per-index "verified" flags cost a byte per index; beyond this length every read is verified.
_VERIFIED_MAX = 1 << 24


def _mark(size: int) -> int:
    """The flag byte of a verified index: 2 for a value worth announcing before it is read, else 1."""
    return 2 if size >= PREFETCH_MIN else 1


class Reader:
    """Reading samples (see the module docstring): its own state, over the handle ``handle`` it holds.

    ``in_queue(index)``: the encoded value of ``index`` if this process has queued it and not yet
    committed it, else None (the writer's ``lookup``, handed in by ``Store``): all a miss may ask of
    the write path. Every public method takes the handle's lock.
    """

    def __init__(self, handle: Handle, in_queue: Callable[[int], bytes | None]) -> None:
        self._h = handle
        self._lock = handle._lock  # the handle's, never replaced: one attribute load less per hit
        self._in_queue = in_queue
        # A read transaction kept open between reads (see _reader), when it goes stale, the handle's commits then.
        self._rtxn: lmdb.Transaction | None = None
        self._rtxn_expires, self._rtxn_commits = 0.0, 0
        # Packs and groups (views) looked up in that transaction, by first index / id; forgotten with it.
        self._packs: dict[int, Any] = {}  # _pack_of
        self._groups: dict[int, Any] = {}  # _groups.group_view
        # Its samples tree as the compiled core reads it (_native_read.native_tree), found once per transaction.
        self._tree: tuple[Any, ...] | None = None
        # ((txnid, map view id, pack, length), the rest of that tree): reused by a later transaction on its snapshot.
        self._last_tree: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None
        # Byte i set: this process has verified index i's data checksum (checksum="once"). A byte
        # rather than a bit per index: N bytes per process is small, and the test is cheaper.
        self._verified: bytearray | None = None
        self._cold_left = 0  # large reads still to prefetch (reads were seen cold); 0: plain reads, timed
        self._slow = 0  # large reads in a row slower than _COLD

    def adopted(self, changed: bool) -> None:
        """The handle adopted a build (``changed``: another than before): the flags and the tree were the last one's."""
        self._tree = None  # the core's tree reads with the build's packing and length
        if changed:
            self._verified = None  # flags of another build's values
        length, verified = self._h._length, self._verified
        if length <= _VERIFIED_MAX and (verified is None or len(verified) < length):
            self._verified = bytearray(length)

    def _drop_reader(self) -> None:
        """End the kept read transaction; what was found in it (pack views, the core's tree) goes with it."""
        self._packs.clear()  # views into the transaction's snapshot: never used past it
        self._groups.clear()
        self._tree = None
        txn, self._rtxn = self._rtxn, None
        if txn is not None:
            txn.abort()

    def get(self, index: int, always: bool = False, build: str | None = None) -> Any:
        """The decoded sample at ``index`` of the build ``build``, or ``MISSING``. The hot path: kept flat.

        The value's structure (and its binding to ``index``) is checked on every read; its
        record's bounds (``_guard``) the first time this process reads the index; its data
        checksum then too, or on every read if ``always``. The build is checked under the lock, so a rebuild
        by another object in this process can never slip between a caller's check and the read.
        """
        with self._lock:  # not acquire() then try: a Ctrl-C between the two would leave the lock held for good
            if build is not self._h.build and build is not None and build != self._h.build:
                raise self._h.mismatch(build)
            txn = self._rtxn
            fresh = False  # whether this call began the snapshot (then a miss needs no second look)
            if txn is None or _monotonic() >= self._rtxn_expires:
                txn, fresh = self._reader(), True
            verified = self._verified
            if _native.core is not None:  # the compiled core: one call locates the value (_native_read)
                if (tree := self._tree) is None or tree[0] is not txn:
                    tree = native_tree(self, txn)
                    fresh = fresh or tree[0] is not txn  # a new snapshot: a miss in it needs no second look
                if (value := tree[7]) is not None:
                    if type(raw := value(index, always, verified)) is tuple:
                        return raw  # decoded and checked in the core (_native_read)
                    if type(raw) is not memoryview:
                        raw = None if raw is None else native_lookup(self, tree, index, raw)
                    if raw is None:  # kept across misses while no commit came after it (_queued)
                        if fresh or _native.core.newest_txnid(tree[2], tree[3], tree[4], tree[8]) == tree[0].id():
                            return self._queued(index, always, keep=True)
                        return self._get_fresh([index], always)[0]
                    return self._decode(raw, index, always)  # not flat (the core decoded those): checks, mark
                txn = self._reader()  # the kept one: native_tree may have begun another
            if verified is not None and index < len(verified) and (mark := verified[index]):
                try:
                    if mark != 1:
                        raw = self._large(txn, index)
                    elif not (pack := self._h._pack):
                        raw = txn.get(index_key(index))
                    elif (whole := self._pack_of(txn, first := index - index % pack, index)) is None:
                        raw = txn.get(index_key(index))  # this index's chunk is not packed
                    elif len(whole) >= 8 + 8 * pack:  # its span, checked here before: decode catches a changed one
                        at, end = _pair(whole, 8 + 8 * (index - first))
                        raw = whole[at:end] if 8 < at < end else self._slice(whole, index, first)
                    else:  # the dataset's last chunk (fewer values), or a broken pack
                        raw = self._slice(whole, index, first)
                    if raw is not None and len(raw) == _POINTER_SIZE:  # maybe a pointer into a group (format 4)
                        raw = _deref(self._h, txn, raw, index, self._groups)
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
                return self._queued(index, always) if fresh else self._get_fresh([index], always)[0]
            return self._decode(raw, index, always)

    def _reader(self) -> lmdb.Transaction:
        """A read transaction: the one kept from the last read (a begin/abort saved per sample) if it is fresh.

        Renewed after _READER_MAX_AGE seconds, after a commit of this process, and after a miss in an older
        snapshot. Each new one first checks the cache was not rebuilt since this process adopted it.
        """
        txn = self._rtxn
        if txn is not None:
            if time.monotonic() < self._rtxn_expires and self._rtxn_commits == self._h.commits:
                return txn
            self._drop_reader()
        env = self._h._env or self._h._env_or_open()
        self._h._maybe_reader_check(env)
        self._rtxn_commits = self._h.commits  # read first: a commit landing during the begin renews it next time
        txn = self._h._begin_checked(env, db=self._h._samples)
        self._rtxn, self._rtxn_expires = txn, time.monotonic() + _READER_MAX_AGE
        return txn

    def _fetch(self, txn: lmdb.Transaction, index: int) -> Any:
        """The stored value of ``index`` (a view into the map) or None, its record bounds-checked first.

        With packs, the chunk's pack is looked up first (a complete chunk is packed), then the single record.
        """
        raw = self._packed(txn, index)
        if raw is not None:
            return raw
        raw = self._record(txn, index_key(index), index)
        try:
            return _deref(self._h, txn, raw, index, self._groups if txn is self._rtxn else None)
        except lmdb.Error as exc:
            raise self._read_failure(exc, index) from exc

    def _packed(self, txn: lmdb.Transaction, index: int) -> Any:
        """The value of ``index`` sliced out of its chunk's pack (span checked), or None: packs off, chunk unpacked."""
        pack = self._h._pack
        if not pack:
            return None
        first = index - index % pack
        whole = self._pack_of(txn, first, index)
        return None if whole is None else self._slice(whole, index, first)

    def _slice(self, whole: Any, index: int, first: int) -> Any:
        """The value of ``index`` in the pack ``whole`` of the chunk starting at ``first``, its span checked."""
        n = min(self._h._pack, self._h._length - first)
        found = _span(whole, index - first, n) if index - first < n else f"index {index} is past the dataset's end"
        if type(found) is str:
            path = self._h.path
            raise CorruptCacheError(
                f"Cache '{path}' is damaged: the pack holding index {index} (indices {first} to {first + n - 1}) "
                f"is broken ({found}); it was not read. Run `lmdbcache verify --repair {path}` to drop it "
                "(its samples are decoded again from the source on their next read)."
            )
        return whole[found[0] : found[1]]

    def _small(self, txn: lmdb.Transaction, index: int) -> Any:
        """A verified small value: from its chunk's pack if there is one, else its single record."""
        raw = self._packed(txn, index)
        return raw if raw is not None else txn.get(index_key(index))

    def _pack_of(self, txn: lmdb.Transaction, first: int, index: int) -> Any:
        """The pack of the chunk starting at ``first`` in ``txn``, or None; ``index`` (in it) names it in errors.

        The pack is a view of the mapped file that touches none of its pages (``MapGuard.value``,
        its record bounds-checked on the way): a read then touches the header's page and its own
        value's, where py-lmdb's get touches every page of the record, one page fault after another:
        48 synchronous reads for one cold 3 KiB value in a pack of 64. The pack is announced to the
        kernel instead (``madvise(WILLNEED)``: one read for all of it when it is cold, a syscall over
        cached pages when warm), so a cold pass over a cache reads each pack once, in one I/O, and
        its other values are then warm. Packs looked up in the kept read transaction are
        remembered until it ends (``_drop_reader`` forgets them): a fresh process's first pass
        checks each pack once, not once per index, and a warm read skips the lookup.
        """
        kept = txn is self._rtxn
        if kept and (whole := self._packs.get(first)) is not None:
            return whole
        guard = self._h._guard
        try:
            if guard is None or not guard.start:
                whole = txn.get(_PKEY(first, _TAG), db=self._h._samples)  # no map to check against (not Linux)
            else:
                cursor = txn.cursor(db=self._h._samples)
                if not cursor.set_key(_PKEY(first, _TAG)):
                    return None
                whole = guard.value(cursor.key(), advise=True)
                if isinstance(whole, str):
                    raise CorruptCacheError(
                        f"Cache '{self._h.path}' is damaged: the record of the pack holding index {index} is broken "
                        f"({whole}); it was not read. {REBUILD}"
                    )
        except lmdb.Error as exc:
            raise self._read_failure(exc, index) from exc
        if whole is not None and kept and len(self._packs) < _PACKS_KEPT:
            self._packs[first] = whole
        return whole

    def _record(self, txn: lmdb.Transaction, key: bytes, index: int) -> Any:
        """The record under ``key`` (a view into the map) or None, bounds-checked first; ``index`` names it."""
        try:
            guard = self._h._guard
            if guard is None or not guard.start:
                return txn.get(key, db=self._h._samples)
            cursor = txn.cursor(db=self._h._samples)
            if not cursor.set_key(key):
                return None
            start = _clock()
            problem = guard.problem(cursor.key(), prefetch=self._cold_left > 0)
            if problem is not None:
                raise CorruptCacheError(
                    f"Cache '{self._h.path}' is damaged: the record of index {index} is broken ({problem}); it was not "
                    f"read. {REBUILD}"
                )
            raw = cursor.value()
            if len(raw) >= PREFETCH_MIN:
                self._saw(_clock() - start)
            return raw
        except lmdb.Error as exc:
            raise self._read_failure(exc, index) from exc

    def _large(self, txn: lmdb.Transaction, index: int) -> Any:
        """A verified large value: announced to the kernel first while reads are cold; lmdb.Error propagates."""
        start = _clock()
        guard = self._h._guard
        if self._cold_left <= 0 or guard is None or not guard.start:
            raw = txn.get(index_key(index))
        else:
            cursor = txn.cursor()
            if not cursor.set_key(index_key(index)):
                return None
            guard.prefetch(cursor.key())
            raw = cursor.value()
        self._saw(_clock() - start)
        return raw

    def _saw(self, elapsed: float) -> None:
        """Count a large read that took ``elapsed`` seconds toward the cold/warm decision.

        Two slow reads in a row turn the advice on: one alone is as often a wait for the GIL
        (py-lmdb touches the value's pages with the GIL released, then takes it back) as a
        read from the disk; on warm data under the loader's copy threads single slow reads
        turned it on 380-900 times an epoch (bench/profile_loader.py).
        """
        if elapsed > _COLD:
            self._slow += 1
            if self._slow >= 2:
                self._cold_left = _COLD_RUN
        else:
            self._slow = 0
            if self._cold_left > 0:
                self._cold_left -= 1

    def get_many(self, indices: list[int], always: bool = False, build: str | None = None) -> list[Any]:
        """Decode a batch of the build ``build`` in one read transaction; misses come back as ``MISSING``."""
        with self._lock:
            if build is not None and build != self._h.build:
                raise self._h.mismatch(build)
            kept = self._rtxn
            txn = self._reader()
            fresh = txn is not kept  # begun here: a miss in it needs no second look
            tree = native_tree(self, txn) if _native.core is not None else None
            if tree is not None:
                fresh, txn = fresh or tree[0] is not txn, tree[0]
                tree = None if tree[1] is None else tree  # None: the Python path reads in this transaction
            value, decode, verified = self._value, self._decode, self._verified
            out = []
            for index in indices:
                if tree is not None:
                    if type(raw := tree[7](index, always, verified)) is tuple:
                        out.append(raw)  # decoded and checked in the core (_native_read)
                        continue
                    if type(raw) is not memoryview and raw is not None:
                        raw = native_lookup(self, tree, index, raw)
                        tree = self._tree or tree  # a failed lookup may have found the map again
                else:
                    raw = value(txn, index, 0 if verified is None or index >= len(verified) else verified[index])
                out.append(MISSING if raw is None else decode(raw, index, always))
            misses = [k for k, sample in enumerate(out) if sample is MISSING]
            if misses:
                missed = [indices[k] for k in misses]
                found = [self._queued(i, always) for i in missed] if fresh else self._get_fresh(missed, always)
                for k, sample in zip(misses, found):
                    out[k] = sample
        return out

    def fill_batch(
        self, indices: list[int], always: bool, build: str | None, plan: Any, dests: list[Any], scalars: Any
    ) -> bool:
        """``native_fill`` under the lock and one read transaction (False: take ``read_batch``)."""
        with self._lock:
            if build is not None and build != self._h.build:
                raise self._h.mismatch(build)
            return _native.core is not None and native_fill(self, self._reader(), indices, always, plan, dests, scalars)

    def read_batch(
        self, indices: list[int], always: bool, build: str | None, copy: Callable[[list[Any], list[bool]], Any]
    ) -> Any:
        """``copy(views, check_data)`` run under the lock and one read transaction; ``MISSING`` if any index is.

        The loader's gather (``_gather``): ``views`` are the stored values (views into the map,
        valid only during the call; each record bounds-checked first as in ``get``), and
        ``check_data[k]`` says whether the data checksum of ``views[k]`` must be verified now
        (``always``, or the first read of the index in this process). When ``copy`` returns
        anything but None (None: it did not use the values), those indices are marked
        verified. ``copy`` may hand the views to other threads but must wait for them: the
        lock keeps the map from moving (growth) under them. A ``CorruptSampleError``
        carrying an ``index`` attribute is raised as ``get`` raises it.
        """
        with self._lock:
            if build is not None and build != self._h.build:
                raise self._h.mismatch(build)
            txn = self._reader()
            verified = self._verified
            if _native.core is not None:
                spans = native_spans(self, txn, indices, always)
                if spans is not None:
                    return MISSING if spans is MISSING else copy_native(self, spans, copy, verified)
                txn = self._reader()  # the core may have renewed the transaction (a reused meta page) before giving up
            value = self._value
            views: list[Any] = []
            checks: list[bool] = []
            sizes: list[int] = []
            for index in indices:
                known = 0 if verified is None or index >= len(verified) else verified[index]
                raw = value(txn, index, known)
                if raw is None:
                    return MISSING  # the caller reads the batch again through get_many, which looks again
                views.append(raw)
                checks.append(always or not known)
                sizes.append(len(raw))
            result = copied(self, copy, views, checks)
            if verified is not None and result is not None:
                for index, checked, size in zip(indices, checks, sizes):
                    if checked and index < len(verified):
                        verified[index] = _mark(size)  # bounds and data checksum passed in this process
            return result

    def _value(self, txn: lmdb.Transaction, index: int, verified_before: int) -> Any:
        """The stored value of ``index`` or None: a plain get if this process verified it before, else ``_fetch``.

        ``verified_before`` is the index's flag byte (0: not yet; 2: a large value, prefetched).
        """
        if not verified_before:
            return self._fetch(txn, index)
        try:
            raw = self._small(txn, index) if verified_before == 1 else self._large(txn, index)
            return _deref(self._h, txn, raw, index, self._groups if txn is self._rtxn else None)
        except lmdb.Error as exc:
            raise self._read_failure(exc, index) from exc

    def _queued(self, index: int, always: bool, keep: bool = False) -> Any:
        """A miss in the newest snapshot (begun under this hold of the lock, or dated by ``core.newest_txnid``):
        only this process's queue can hold it (a batch leaves the queue only once committed, under this lock).
        ``keep`` (the core's path) keeps the transaction for a fill's next miss: no begin, tree and abort each.
        """
        if not keep:
            self._drop_reader()
        raw = self._in_queue(index)
        return MISSING if raw is None else self._decode(raw, index, always)

    def _get_fresh(self, indices: list[int], always: bool) -> list[Any]:
        """Look misses up again in a new snapshot, then in this process's queue. Holds self._lock."""
        self._drop_reader()
        out = []
        with self._h._begin_checked(self._h._env or self._h._env_or_open()) as txn:
            for index in indices:
                raw = self._fetch(txn, index)
                if raw is None:
                    raw = self._in_queue(index)
                out.append(MISSING if raw is None else self._decode(raw, index, always))
        return out

    def raw(self, index: int) -> bytes | None:
        """The stored value of ``index`` as bytes (committed or queued here), or None."""
        with self._lock:
            self._drop_reader()
            with self._h._begin_checked(self._h._env or self._h._env_or_open(), db=self._h._samples) as txn:
                raw = self._fetch(txn, index)
                if raw is None:
                    return self._in_queue(index)
                return bytes(raw)

    def _decode(self, raw: Any, index: int, always: bool = False) -> Any:
        verified = self._verified
        try:
            if verified is None or index >= len(verified):
                return _decode(raw, index)
            if verified[index]:
                return _decode(raw, index, verify_data=always)
            sample = _decode(raw, index)
            verified[index] = _mark(len(raw))  # its record's bounds and data checksums passed in this process
            return sample
        except CorruptSampleError as exc:
            raise self._corrupt(index, exc) from None

    def _corrupt(self, index: int, exc: CorruptSampleError) -> CorruptSampleError:
        return CorruptSampleError(
            f"Cache '{self._h.path}': the stored value of index {index} is damaged ({exc}); it was not returned. "
            f"Run `lmdbcache verify --repair {self._h.path}` to drop damaged entries (they are decoded again "
            "from the source on the next read)."
        )

    def _read_failure(self, exc: lmdb.Error, index: int) -> LmdbCacheError:
        self._drop_reader()  # a transaction that failed is not reused
        return translate(exc, self._h.path, f"reading index {index} of")
