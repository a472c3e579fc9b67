"""Scans of one cache in index order: every key, or every value, merging packs and single records.

``Scanner`` is composed into ``Store`` (``store.iter_raw``, ``iter_keys``, ``cached_near``) and
holds only its own state (the last pack it found sound); everything else it asks of the
store's handle: the lock, checked read transactions, the adopted build's packing and length,
the guard. Used by verify, merge, copy and precompute's resume. Short read transactions: a
long scan never pins a snapshot that writers must move past. An index stored both alone and
in a pack, a key that is neither, or a broken pack is a ``CorruptCacheError`` naming it. A value that is a
pointer into a group (format 4, ``_group``) is followed into it; the groups' keys sort after every index,
so a scan ends where they begin, and a pointer that lies is a ``CorruptCacheError`` naming its index.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import lmdb

from ..errors import CorruptCacheError, CorruptSampleError
from ..format import _group, _pack
from ..format._group import index_key, unpack_index
from ._groups import deref
from ._handle import Handle
from ._lmdb_errors import REBUILD, translate

__all__ = ["Scanner"]

_FIRST_KEY = bytes(8)  # index 0's key: every key of a sound cache sorts at or after it


class Scanner:
    """Index-order scans over ``handle`` (see the module docstring)."""

    def __init__(self, handle: Handle) -> None:
        self._h = handle
        self._sound_pack: tuple[int, int, bytes] | None = None  # the last pack found sound: (first, size, header)

    def cached_near(self, starts: Iterable[int]) -> list[int]:
        """For each start, the first cached index at or after it (wrapping around), without duplicates."""
        found: list[int] = []
        with self._h._lock:
            self._h._env or self._h._env_or_open()  # the build, and so its packing, is known once open
        if self._h._pack:  # a pack's key is not its indices' keys: let the scan merge them
            for start in starts:
                index = next(self._scan(start, 1, values=False), None) or next(self._scan(0, 1, values=False), None)
                if index is not None and index[0] not in found:
                    found.append(index[0])
            return found
        with self._h._lock:
            self._h._drop_reader()
            with self._h._begin_checked(self._h._env or self._h._env_or_open(), db=self._h._samples) as txn:
                try:
                    cursor = txn.cursor()
                    for start in starts:
                        if cursor.set_range(index_key(start)) or cursor.first():
                            key = cursor.key()
                            if len(key) != 8 and cursor.first():  # past the last index: the groups' keys
                                key = cursor.key()
                            if len(key) == 8 and unpack_index(key)[0] not in found:
                                found.append(unpack_index(key)[0])
                except lmdb.Error as exc:
                    raise translate(exc, self._h.path, "reading") from exc
        return found

    def iter_raw(self, start: int = 0, chunk: int = 256) -> Iterator[tuple[int, bytes]]:
        """Yield (index, stored value) in key order, ``chunk`` records per read transaction."""
        return self._scan(start, chunk, values=True)

    def iter_keys(self, start: int = 0, chunk: int = 65536) -> Iterator[int]:
        """Yield every cached index in order (keys only: no value is read)."""
        return (index for index, _ in self._scan(start, chunk, values=False))

    def _scan(self, start: int, chunk: int, values: bool) -> Iterator[tuple[int, Any]]:
        # Short read transactions: a long scan never pins a snapshot that writers must move past.
        # With packs, each batch starts at the chunk holding ``start``: its pack key sorts after the
        # key of the chunk's first index, before ``start``'s own.
        path = self._h.path
        while True:
            batch: list[tuple[int, Any]] = []
            end = False
            with self._h._lock, self._h._begin_checked(self._h._env or self._h._env_or_open()) as txn:
                pack = self._h._pack  # the adopted build's (known once the environment is open)
                key = index_key(start - start % pack if pack else start)
                groups: dict[int, Any] = {}  # the groups seen in this transaction (views), by id
                try:
                    cursor = txn.cursor(db=self._h._samples)
                    covered, single = -1, -1  # the end of the last pack seen, the last single index seen
                    for k in cursor.iternext(values=False) if cursor.set_range(key) else ():
                        if len(k) == 8:
                            index = single = unpack_index(k)[0]
                            if index < covered:
                                raise CorruptCacheError(self._twice(index, covered))
                            if index >= start:
                                batch.append((index, self._value(txn, cursor, k, index, groups) if values else None))
                        elif _group.id_of(k) is not None:
                            end = True  # the groups sort after every index: the scan is over
                            break
                        else:
                            first, n = self.pack_key(k)
                            if single >= first:
                                raise CorruptCacheError(self._twice(single, first + n))
                            covered = first + n
                            if covered > start:
                                whole = self._view(cursor, k, first) if values else b""
                                problem = self._pack_problem(whole, first, n) if values else None
                                if problem is not None:
                                    raise CorruptCacheError(
                                        f"Cache '{path}' is damaged: the pack of indices {first} to {covered - 1} is "
                                        f"broken ({problem}). Run `lmdbcache verify --repair {path}` to drop it (its "
                                        "samples are decoded again on their next read)."
                                    )
                                for index in range(max(first, start), covered):
                                    if len(batch) == chunk:
                                        break
                                    if values:
                                        batch.append((index, bytes(_pack.value(whole, index - first, n))))
                                    else:
                                        batch.append((index, None))
                        if len(batch) == chunk:
                            break
                except lmdb.Error as exc:
                    raise translate(exc, self._h.path, f"scanning (near index {start})") from exc
            yield from batch
            if end or len(batch) < chunk or batch[-1][0] == 2**64 - 1:
                return
            start = batch[-1][0] + 1

    def _pack_problem(self, whole: Any, first: int, n: int) -> str | None:
        """``_pack.problem`` of a pack, remembered for the last sound one: verify reads a chunk index by index, and
        checking all K spans for each of its K indices made verify cost N x K (found by the attack)."""
        seen = (first, len(whole), bytes(whole[: _pack.header_size(n)]))  # all that problem() looks at
        if seen == self._sound_pack:
            return None
        problem = _pack.problem(whole, n)
        if problem is None:
            self._sound_pack = seen
        return problem

    def _value(self, txn: lmdb.Transaction, cursor: lmdb.Cursor, key: Any, index: int, groups: dict[int, Any]) -> bytes:
        """The stored value of ``index`` at ``cursor`` as bytes, followed into its group if it is a pointer."""
        try:
            return bytes(deref(self._h, txn, self._view(cursor, key, index), index, groups))
        except CorruptSampleError as exc:  # a pointer that lies: this index's damage (verify reports it)
            raise CorruptCacheError(str(exc)) from None

    def _view(self, cursor: lmdb.Cursor, key: Any, index: int) -> Any:
        """The value at ``cursor`` (whose key is ``key``), its record checked before it is touched (see _guard)."""
        problem = self._h._guard.problem(key) if self._h._guard is not None else None
        if problem is not None:
            raise CorruptCacheError(
                f"Cache '{self._h.path}' is damaged: the record of index {index} is broken ({problem}). {REBUILD}"
            )
        return cursor.value()

    def pack_key(self, k: Any) -> tuple[int, int]:
        """(first index, count) of the pack whose key is ``k``; CorruptCacheError for a key that is not ours."""
        first = _pack.first_of(k)
        pack = self._h._pack
        if first is None or not pack or first % pack or first >= self._h._length:
            raise CorruptCacheError(
                f"Cache '{self._h.path}' is damaged: it holds a key of {len(k)} bytes ({bytes(k)[:16]!r}), not an "
                f"8-byte index{' or the key of a pack' if pack else ''}. {REBUILD}"
            )
        return first, min(pack, self._h._length - first)

    def _twice(self, index: int, end: int) -> str:
        return (
            f"Cache '{self._h.path}' is damaged: index {index} is stored both alone and in the pack of indices up to "
            f"{end - 1}. {REBUILD}"
        )

    def count_groups(self, txn: lmdb.Transaction) -> int:
        """How many group records ``txn`` holds (their keys sort last, after every index)."""
        cursor, total = txn.cursor(db=self._h._samples), 0
        if cursor.set_range(_group.PREFIX):
            for key in cursor.iternext(values=False):
                total += _group.id_of(key) is not None
        return total

    def count_packed(self, txn: lmdb.Transaction) -> int:
        """A walk over the keys only. Keys that sort before index 0 are left to ``keys_before_start`` (verify
        reports them); any other key that is neither an index nor a pack's is ``CorruptCacheError``."""
        cursor, total = txn.cursor(db=self._h._samples), 0
        if cursor.set_range(_FIRST_KEY):
            for key in cursor.iternext(values=False):
                if len(key) != 8 and _group.id_of(key) is not None:
                    break  # the groups sort after every index
                total += 1 if len(key) == 8 else self.pack_key(key)[1]
        return total

    def keys_before_start(self, limit: int = 1000) -> int:
        """How many keys sort before index 0's (at most ``limit``): none in a sound cache; out of a scan's reach."""
        with self._h._lock, self._h._begin_checked(self._h._env or self._h._env_or_open()) as txn:
            try:
                cursor, found = txn.cursor(db=self._h._samples), 0
                if cursor.first():
                    for key in cursor.iternext(values=False):
                        if bytes(key) >= _FIRST_KEY or found >= limit:
                            break
                        found += 1
            except lmdb.Error as exc:
                raise translate(exc, self._h.path, "scanning the keys of") from exc
        return found
