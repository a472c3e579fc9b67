"""Reading through a pointer into a group (``format/_group``): the group found, the span checked, the value sliced.

Shared by the read path (``_read``) and the scans (``_scanner``): ``deref`` turns a stored value
that is a pointer into the view of the value it points to. A group record that runs past the file
is damage to the file (``CorruptCacheError``, as a single record would be); every other failure is a
``CorruptSampleError`` naming the index (a pointer is one index's entry: ``verify --repair``
deletes it and the sample is decoded again), and a pointer to another index's value is caught
later by the value's own checksums, bound to its index.
"""

from __future__ import annotations

from typing import Any

import lmdb

from ..errors import CorruptCacheError, CorruptSampleError
from ..format import _group
from ._lmdb_errors import REBUILD

__all__ = ["deref", "group_view"]

_MAGIC = _group.MAGIC
_pointer_of = _group.pointer_of
_SIZE = _group.POINTER_SIZE
_GROUPS_KEPT = 1 << 16  # groups remembered per kept read transaction (a view each)


def group_view(h: Any, txn: lmdb.Transaction, group: int, kept: dict[int, Any] | None) -> Any:
    """The record of group ``group`` in ``txn`` (a view of the map, bounds-checked by the guard), None if
    absent, or why it cannot be read (a str). ``kept``: views of this transaction, by id, to reuse and fill."""
    if kept is not None and (whole := kept.get(group)) is not None:
        return whole
    guard = h._guard
    if guard is None or not guard.start:
        whole = txn.get(_group.key(group), db=h._samples)  # no map to check against (not Linux)
    else:
        cursor = txn.cursor(db=h._samples)
        if not cursor.set_key(_group.key(group)):
            return None
        whole = guard.value(cursor.key())
        if isinstance(whole, str):
            return whole  # why the guard refuses the group's record
    if whole is not None and kept is not None and len(kept) < _GROUPS_KEPT:
        kept[group] = whole
    return whole


def deref(h: Any, txn: lmdb.Transaction, raw: Any, index: int, kept: dict[int, Any] | None) -> Any:
    """``raw`` itself if it is not a pointer, else the value it points to (a view), checked against its group.

    ``h`` is the store's handle (``path``, ``_guard``, ``_samples``); lmdb.Error propagates.
    """
    if raw is None or len(raw) != _SIZE or raw[:4] != _MAGIC:
        return raw
    _, group, offset, length = _pointer_of(raw)
    if (
        kept is not None
        and (whole := kept.get(group)) is not None
        and not offset % 8
        and 0 < length <= len(whole) - offset
    ):
        return whole[offset : offset + length]  # the warm case: a group this transaction found, a span inside it
    whole = group_view(h, txn, group, kept)
    if isinstance(whole, str):  # the file itself is damaged (as a single record past its end): not one index's
        raise CorruptCacheError(
            f"Cache '{h.path}' is damaged: index {index} points into group {group}, whose record is broken "
            f"({whole}); it was not read. {REBUILD}"
        )
    problem = f"its group {group} is missing" if whole is None else _group.span(len(whole), offset, length)
    if problem is not None:
        raise CorruptSampleError(
            f"Cache '{h.path}': the stored entry of index {index} points into a group, but {problem}; it was not "
            f"read. Run `lmdbcache verify --repair {h.path}` to drop damaged entries (they are decoded again "
            "from the source on the next read)."
        )
    return whole[offset : offset + length]
