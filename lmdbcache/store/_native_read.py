"""The batch path on the compiled core (``lmdbcache._native``): one call locates a batch, one per slice copies it.

``ReadPath.read_batch`` asks here first when the core is built: ``native_spans`` locates every
value of the batch in the read transaction's snapshot (the core walks LMDB's pages itself, every
page and span checked against the mapped file), and ``copy_native`` hands the spans to the
loader's copy, marking what it verified. None from ``native_spans`` means the Python path reads
the batch as before (no map address known here, or the snapshot kept moving).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import lmdb

from .. import _native
from .._native.batch import Spans
from ..errors import CorruptCacheError, CorruptSampleError
from ._guard import PREFETCH_MIN, MapGuard
from ._lmdb_errors import REBUILD

__all__ = ["MISSING", "copy_native", "native_spans"]

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()


class Reader(Protocol):
    """What this path asks of the read path (``_read.ReadPath``), handed in as ``h``: no import back up."""

    path: str
    _guard: MapGuard | None
    _pack: int
    _length: int
    _verified: bytearray | None

    def _drop_reader(self) -> None: ...

    def _reader(self) -> lmdb.Transaction: ...

    def _corrupt(self, index: int, exc: CorruptSampleError) -> CorruptSampleError: ...


def native_spans(h: Reader, txn: lmdb.Transaction, indices: list[int], always: bool) -> Any:
    """The batch's values located by the core (``Spans``), ``MISSING`` if one is absent, or None: no map
    address is known here (not Linux, or the guard could not find the map), so the Python path reads it.

    A snapshot whose meta page was reused meanwhile is read again in a new transaction; a lookup that
    fails is tried once more after the guard looks for the map and the file's size again (another process
    may have grown the file since); a second failure is damage, worded as the guard words it.
    """
    core, guard = _native.core, h._guard
    assert core is not None
    if guard is None:
        return None
    refreshed = False
    for _ in range(8):
        base, length, view = guard.mapping()
        if not base:
            return None
        psize = guard.page_size
        code, root, depth = core.open_tree(base, length, psize, txn.id(), b"samples")
        if code == _native.RETRY:
            h._drop_reader()
            txn = h._reader()
            continue
        k = -1
        if code == _native.OK:
            code, k, blob = core.locate_batch(
                base,
                length,
                psize,
                root,
                depth,
                indices,
                h._pack,
                h._length,
                h._verified,
                always,
                PREFETCH_MIN,
            )
            if code == _native.OK:
                return Spans(base, length, view, blob)
            if code == _native.NOTFOUND:
                return MISSING  # the caller reads the batch again through get_many, which looks again
        elif code == _native.NOTFOUND:
            return None  # no samples database in this snapshot: the Python path says what that means
        if not refreshed:
            refreshed = True
            guard.refresh()
            continue
        raise _damage(h, code, indices[k] if k >= 0 else None)
    return None  # the meta page kept being reused under us: the Python path reads this batch


def _damage(h: Reader, code: int, index: int | None) -> CorruptCacheError:
    if index is None:
        return CorruptCacheError(
            f"Cache '{h.path}' is damaged: the samples database cannot be read ({_native.reason(code)}). {REBUILD}"
        )
    if code == _native.PACK:
        first = index - index % h._pack
        last = min(first + h._pack, h._length) - 1
        return CorruptCacheError(
            f"Cache '{h.path}' is damaged: the pack holding index {index} (indices {first} to {last}) is "
            f"broken ({_native.reason(code)}); it was not read. Run `lmdbcache verify --repair {h.path}` "
            "to drop it (its samples are decoded again from the source on their next read)."
        )
    return CorruptCacheError(
        f"Cache '{h.path}' is damaged: the record of index {index} is broken ({_native.reason(code)}); it "
        f"was not read. {REBUILD}"
    )


def copy_native(h: Reader, spans: Spans, copy: Callable[[Any, Any], Any], verified: bytearray | None) -> Any:
    """``read_batch``'s copy over located values; indices whose data checksum passed are marked verified."""
    try:
        result = copy(spans, spans.checks())
    except CorruptSampleError as exc:
        where = getattr(exc, "index", None)
        if where is None:
            raise
        raise h._corrupt(where, exc) from None
    if verified is not None and result is not None:
        _native.core.mark_verified(verified, spans.blob, PREFETCH_MIN)  # type: ignore[union-attr]
    return result
