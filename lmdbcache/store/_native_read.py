"""The read paths on the compiled core (``lmdbcache._native``): single reads located in one call each, a batch
located in one call and copied in one per slice.

``Reader.get`` and ``get_many`` read each value in one call (``core.Tree.sample``) in the samples tree
of the kept read transaction, found once per transaction (``native_tree``: ``open_tree`` on its meta page,
kept as ``_tree`` until the transaction ends). A flat value whose signature the decoder planned before
(``_decode.NATIVE_PLANS``) comes back decoded: header, structure checksum and lengths checked, the data
checksum on a first read (or every read: ``always``), the tensors copied out of the map into new
buffers, the index marked verified. Anything else (another form, a first sight of a signature, any
check that fails) comes back as the value's view, handed to ``decode`` as the Python path hands its
views: so the two paths raise the same errors, worded by the same code.

``Reader.read_batch`` asks here first when the core is built: ``native_spans`` locates every
value of the batch in the read transaction's snapshot (the core walks LMDB's pages itself, every
page and span checked against the mapped file), and ``copy_native`` hands the spans to the
loader's copy, marking what it verified. None from ``native_spans`` means the Python path reads
the batch as before (no map address known here, or the snapshot kept moving). ``native_fill`` is
the loader's shortcut for a batch of a flat layout it met before: located, checked, copied into its
buffers and marked verified in one call (``core.Tree.gather``); anything short of every row copied
is left to ``read_batch``, which reads the batch again and says what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import lmdb

from .. import _native
from .._native.batch import Spans
from ..errors import CorruptCacheError, CorruptSampleError, LmdbCacheError
from ..format import _encode, _pack
from ..format._decode import NATIVE_PLANS
from ..format._decode import decode as _decode
from ..format._group import index_key
from ._groups import deref
from ._guard import PREFETCH_MIN
from ._handle import Handle
from ._lmdb_errors import REBUILD

__all__ = ["MISSING", "copy_native", "decode_new", "native_fill", "native_lookup", "native_spans", "native_tree"]

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
if _native.core is not None:
    _native.core.set_plans(NATIVE_PLANS)  # the flat plans Tree.sample decodes with (the decoder fills them)
    _encode.use_native(_native.core.encode_flat, getattr(_native.core, "encode_sample", None))  # a miss: one call
_decode_flat = _native.core.decode_flat if _native.core is not None else None


def decode_new(value: bytes, index: int) -> Any:
    """The sample of ``value``, just encoded for ``index`` by this process (a miss): no data checksum.

    A flat value is decoded by the core (``core.decode_flat``) when its signature is planned, else by ``decode``.
    """
    if _decode_flat is not None and (sample := _decode_flat(value, index, False)) is not None:
        return sample
    return _decode(value, index, verify_data=False)


class Hits(Protocol):
    """What these paths ask of the reader (``_read.Reader``), handed in as ``r``: no import back up."""

    _h: Handle
    _verified: bytearray | None
    _tree: tuple[Any, ...] | None
    _last_tree: tuple[tuple[Any, ...], tuple[Any, ...]] | None

    def _drop_reader(self) -> None: ...

    def _reader(self) -> lmdb.Transaction: ...

    def _corrupt(self, index: int, exc: CorruptSampleError) -> CorruptSampleError: ...


def native_spans(r: Hits, txn: lmdb.Transaction, indices: list[int], always: bool) -> Any:
    """The batch's values located by the core (``Spans``), ``MISSING`` if one is absent, or None: no map
    address is known here (not Linux, or the guard could not find the map), so the Python path reads it.

    Located in the read transaction's tree (``native_tree``: found once per snapshot), whose location table
    answers once enough indices were looked up in it. A lookup that fails is tried again after the guard takes
    the file's size again (a commit may have grown the file since), then after it finds the map again
    (``_refound``); a third failure is damage, worded as the guard words it.
    """
    tree = native_tree(r, txn)
    for attempt in range(3):
        if tree[1] is None:
            return None  # the Python path reads in this transaction (no map address, no samples database)
        core_tree = tree[7].__self__  # the core.Tree whose bound ``sample`` native_tree keeps
        code, k, blob = core_tree.locate_batch(indices, r._verified, always)
        if code == _native.OK:
            return Spans(tree[2], tree[3], tree[1], blob)
        if code == _native.NOTFOUND:
            return MISSING  # the caller reads the batch again through get_many, which looks again
        if attempt < 2:
            tree = _refound(r, tree, grown=attempt == 0)
    raise _damage(r, code, indices[k], tree)


def native_fill(
    r: Hits, txn: lmdb.Transaction, indices: list[int], always: bool, plan: Any, dests: list[Any], scalars: Any
) -> bool:
    """True when the core located, checked and copied every value of ``indices`` into ``dests`` and ``scalars``
    (``Buffers.fill``'s, for the layout of ``plan``), marking those it verified; False: nothing is known, and
    ``read_batch`` reads the batch (a miss, another form, damage, or no map address here)."""
    tree = native_tree(r, txn)
    if tree[1] is None:
        return False
    code, status, _ = tree[7].__self__.gather(indices, r._verified, always, plan, dests, scalars, PREFETCH_MIN)
    return bool(code == _native.OK and status == 0)


def native_tree(r: Hits, txn: lmdb.Transaction) -> tuple[Any, ...]:
    """The samples tree of the read transaction ``txn`` as the core reads it, found once per transaction.

    ``(txn, view, base, length, psize, root, depth, value, header)``, kept as ``r._tree`` until the transaction ends
    (``_drop_reader`` forgets it); ``txn`` in it is a new transaction when the snapshot's meta page was
    reused before the core could read it (the caller then reads in that one: a fresh snapshot). ``view``
    None: the Python path reads in this transaction (no map address known here, no samples database in
    the snapshot, or its meta page kept being reused). ``value(index, always, verified)`` (``core.Tree.sample``)
    is a single read: the decoded sample (a tuple: a flat value whose plan is known, its checks passed and
    its index marked verified), else a view of the value in the map for ``decode``, None if it is not
    stored, or an error code. A broken main database is looked at again after the guard takes the file's size
    again (a commit grew it: ``refresh(grown=True)``), then after it finds the map again, per snapshot (one
    begun after a RETRY is newer than that size), then raised as damage, worded as the guard's.

    A new transaction on the snapshot of the last tree found (the same txnid, map view, packing and
    length: no commit since, as between the misses of a fill, where every miss begins a transaction)
    reuses that tree: the snapshot's pages are held by the new reader as they were by the old one.
    """
    tree = r._tree
    if tree is not None and tree[0] is txn:
        return tree
    core, guard = _native.core, r._h._guard
    assert core is not None
    looks = 0  # how many times the guard looked again for this snapshot
    for _ in range(8):
        base, length, view = guard.mapping() if guard is not None else (0, 0, None)
        if not base or guard is None:
            break
        # The map's view by identity (a new one whenever the guard finds the map again; == would compare bytes)
        snapshot = (txn.id(), id(view), r._h._pack, r._h._length)
        last = r._last_tree
        if last is not None and last[0] == snapshot and last[1][0] is view:  # no commit since (as in a fill)
            r._tree = tree = (txn, *last[1])
            return tree
        psize, header = guard.page_size, guard.header  # the file's layout, as its engine reads it (_engine)
        code, root, depth = core.open_tree(base, length, psize, header, snapshot[0], r._h.samples_key)
        if code == _native.OK:
            value = core.Tree(base, length, psize, header, root, depth, r._h._pack, r._h._length, PREFETCH_MIN).sample
            r._tree = tree = (txn, view, base, length, psize, root, depth, value, header)
            r._last_tree = (snapshot, tree[1:])
            return tree
        if code == _native.RETRY:  # a newer snapshot: its pages may lie past the file's size as last found
            r._drop_reader()
            txn, looks = r._reader(), 0
            continue
        if code == _native.NOTFOUND:
            break  # no samples database in this snapshot: the Python path says what that means
        if looks == 2:
            raise _damage(r, code, None)
        looks += 1
        guard.refresh(grown=looks == 1)  # the file grown (a commit: a stat), then the map looked for in full
    r._tree = tree = (txn, None, 0, 0, 0, 0, 0, None, 0)
    return tree


def native_lookup(r: Hits, tree: tuple[Any, ...], index: int, code: int = -1) -> Any:
    """The stored value of ``index`` in ``tree`` (``native_tree``, its view set): a view into the map, or None.

    ``code``: the outcome of a lookup the caller already made (``get`` makes its own); -1: look it up.
    A lookup that fails is tried again after the guard takes the file's size again (a commit may have grown the
    file since), then after it finds the map again; a third failure is damage, worded as the guard's.
    """
    core = _native.core
    assert core is not None
    _, view, base, length, psize, root, depth, _, header = tree
    pack, n = r._h._pack, r._h._length
    for attempt in range(3):
        if code < 0 or attempt:
            code, at, size = core.locate_index(base, length, psize, header, root, depth, index, pack, n, PREFETCH_MIN)
            if code == _native.OK:
                return view[at : at + size]
        if code == _native.NOTFOUND:
            return None
        if attempt < 2:
            _, view, base, length, *_ = tree = _refound(r, tree, grown=attempt == 0)
    raise _damage(r, code, index, r._tree)


def _refound(r: Hits, tree: tuple[Any, ...], grown: bool = False) -> tuple[Any, ...]:
    """``tree`` over the map as the guard finds it again (another process may have grown the file), kept as
    ``r._tree``; ``tree`` itself if the guard finds no map. ``grown``: the guard takes only the file's size
    again (``MapGuard.refresh``)."""
    core, guard = _native.core, r._h._guard
    assert core is not None
    if guard is None:
        return tree
    guard.refresh(grown)
    base, length, view = guard.mapping()
    if not base:
        return tree
    txn, _, _, _, psize, root, depth, _, header = tree
    value = core.Tree(base, length, psize, header, root, depth, r._h._pack, r._h._length, PREFETCH_MIN).sample
    r._tree = fresh = (txn, view, base, length, psize, root, depth, value, header)
    return fresh


def _pack_problem(r: Hits, tree: tuple[Any, ...], index: int) -> str | None:
    """Why the pack holding ``index`` does not hold its value, worded as the Python path's ``_pack.span``."""
    core = _native.core
    assert core is not None
    _, view, base, length, psize, root, depth, _, header = tree
    first = index - index % r._h._pack
    n = min(r._h._pack, r._h._length - first)
    if index - first >= n:
        return f"index {index} is past the dataset's end"
    code, at, size = core.locate(base, length, psize, header, root, depth, _pack.key(first, _pack.TAG))
    found = _pack.span(view[at : at + size], index - first, n) if code == _native.OK else None
    return found if isinstance(found, str) else None


def _damage(r: Hits, code: int, index: int | None, tree: tuple[Any, ...] | None = None) -> LmdbCacheError:
    """The error for a failed native lookup (``index`` None: the samples database's), worded as the guard's; a
    pointer into a group that lies is the index's ``CorruptSampleError``, worded as the Python path's."""
    if code == _native.GROUP and index is not None:
        return _group_error(r, index, tree)
    why = (r._h._guard.unreadable if r._h._guard is not None else "") or _native.reason(code)
    if index is None:
        return CorruptCacheError(
            f"Cache '{r._h.path}' is damaged: the samples database cannot be read ({why}). {REBUILD}"
        )
    if code == _native.PACK:
        first = index - index % r._h._pack
        last = min(first + r._h._pack, r._h._length) - 1
        if tree is not None:
            why = _pack_problem(r, tree, index) or why
        return CorruptCacheError(
            f"Cache '{r._h.path}' is damaged: the pack holding index {index} (indices {first} to {last}) is "
            f"broken ({why}); it was not read. Run `lmdbcache verify --repair {r._h.path}` "
            "to drop it (its samples are decoded again from the source on their next read)."
        )
    return CorruptCacheError(
        f"Cache '{r._h.path}' is damaged: the record of index {index} is broken ({why}); it was not read. {REBUILD}"
    )


def _group_error(r: Hits, index: int, tree: tuple[Any, ...] | None) -> LmdbCacheError:
    """The Python path's error for the pointer of ``index`` that the core found lying (``_groups.deref``)."""
    h = r._h
    generic = CorruptSampleError(
        f"Cache '{h.path}': the stored entry of index {index} points into a group, but "
        f"{_native.reason(_native.GROUP)}; it was not read. Run `lmdbcache verify --repair {h.path}` to drop "
        "damaged entries (they are decoded again from the source on the next read)."
    )
    txn = tree[0] if tree is not None else None
    try:
        if txn is not None:
            deref(h, txn, txn.get(index_key(index), db=h._samples), index, None)
    except CorruptSampleError as exc:
        return exc
    except lmdb.Error:
        pass
    return generic


def copied(r: Hits, copy: Callable[[Any, Any], Any], views: Any, checks: Any) -> Any:
    """``copy(views, checks)``; a ``CorruptSampleError`` carrying an ``index`` is worded as ``get`` words it."""
    try:
        return copy(views, checks)
    except CorruptSampleError as exc:
        where = getattr(exc, "index", None)
        if where is None:
            raise
        raise r._corrupt(where, exc) from None


def copy_native(r: Hits, spans: Spans, copy: Callable[[Any, Any], Any], verified: bytearray | None) -> Any:
    """``read_batch``'s copy over located values; indices whose data checksum passed are marked verified."""
    result = copied(r, copy, spans, spans.checks())
    if verified is not None and result is not None:
        _native.core.mark_verified(verified, spans.blob, PREFETCH_MIN)  # type: ignore[union-attr]
    return result
