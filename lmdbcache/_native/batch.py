"""The loader's batch path on the compiled core: a batch's located values (``Spans``) and their copy.

``Reader.read_batch`` locates every index of a batch in one call (``core.locate_batch``, the
GIL released) and hands ``copy`` a ``Spans`` in place of its list of views: a sequence whose
items are the same views into the map (made only when asked for: ``layout_of`` looks at the
first, a fallback at any), and which ``Buffers.fill`` copies in one call per slice
(``core.fill``, the GIL released). Only used when ``lmdbcache._native.core`` is present.

May import: ``lmdbcache._native`` and ``lmdbcache.errors``.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterator, Sequence
from typing import Any

from . import core

__all__ = ["FILL_REASONS", "Checks", "Indexed", "Spans"]

_SPAN = struct.Struct("<QQQB7x")  # offset, size, index, check (lmdbcache/_native/_core.c, SPAN)

# Why core.fill refused a row, by its status (1, "another form", is not an error: the batch takes its other path).
FILL_REASONS = {
    2: "the structure checksum does not match: the value is damaged or was stored under another index",
    3: "the flat structure's lengths do not add up to the value's",
    4: "the data checksum does not match",
    5: "its span lies outside the mapped file",
}


class Indexed(Sequence[Any]):
    """A sequence whose items are made when asked for (``_record``): indexed as a list is (negative indices,
    slices as lists, IndexError past the end, TypeError for anything but an int), in one place."""

    __slots__ = ()

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        k = operator.index(k)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"index {k} out of range")
        return self._record(k)

    def _record(self, k: int) -> Any:
        raise NotImplementedError


class _Records(Indexed):
    """A sequence over the 32-byte span records of ``blob``."""

    __slots__ = ()
    blob: bytearray

    def __len__(self) -> int:
        return len(self.blob) // _SPAN.size


class Checks(_Records):
    """The check flags of a ``Spans`` blob as a sequence of bools (only a fallback reads them one by one)."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytearray) -> None:
        self.blob = blob

    def _record(self, k: int) -> bool:
        return bool(self.blob[k * _SPAN.size + 24])


class Spans(_Records):
    """A batch's values located in the map: ``blob`` from ``core.locate_batch``, and the map they lie in.

    Valid only while the read transaction and the store's lock that located them are held (as views are).
    """

    __slots__ = ("base", "blob", "length", "view")

    def __init__(self, base: int, length: int, view: memoryview, blob: bytearray) -> None:
        self.base, self.length, self.view, self.blob = base, length, view, blob

    def _record(self, k: int) -> Any:
        offset, size, _, _ = _SPAN.unpack_from(self.blob, k * _SPAN.size)
        return self.view[offset : offset + size]

    def __iter__(self) -> Iterator[Any]:
        return (self[k] for k in range(len(self)))

    def checks(self) -> Checks:
        """Per value: whether its data checksum is verified now (``read_batch``'s ``check_data``), read when asked."""
        return Checks(self.blob)

    def fill(self, plan: tuple[Any, ...], dests: list[Any], scalars: Any, lo: int, hi: int) -> tuple[int, int]:
        """``core.fill`` of rows ``lo:hi``: (status, row); see FILL_REASONS."""
        assert core is not None
        status, row = core.fill(self.base, self.length, self.blob, lo, hi, plan, dests, scalars)
        return status, row
