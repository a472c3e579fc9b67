"""Packs: the values of one chunk of consecutive small samples stored as one LMDB record (issue #11).

Why. LMDB keeps a value in its leaf page only up to about half a page (~2 KiB with 4 KiB
pages); anything larger takes whole overflow pages of its own, so a 3 KiB sample costs 4 KiB
plus its leaf node (1.36x on disk, and as much in the page cache). A cache created with
``pack=K`` (the metadata's ``pack`` field; 0 or absent: off) stores the values of every
complete chunk ``[c*K, (c+1)*K)`` (the last chunk: up to the dataset's length) as one record,
once every value of the chunk is committed and each is smaller than ``SMALL``; large values
gain nothing (their overflow waste is under 4 KiB) and stay single records.

Key. The chunk's first index as 8 bytes big-endian followed by ``b"P"`` (9 bytes), in the
``samples`` database beside the single records: LMDB sorts it right after the key of that
index and before the next one, so a key scan is still in index order, and a reader of an
older format never meets a database it does not know (it refuses format 3 on its metadata).

Value, all integers little-endian::

    offset  size  field
    0       4     magic b"LMPK"
    4       4     n, the number of values (u32): K, or fewer for the dataset's last chunk
    8       8n    n pairs (u32 start, u32 end): value j (index first + j) is bytes [start, end)
    ...           each value exactly as a single record stores it (``codec``), starting at an
                  8-byte aligned offset, in index order, zero padding between them

A pack is untrusted input like any record: a reader checks n against the chunk and the
value's span against the header and the record before slicing (``span``); ``problem``
checks the whole header (``verify``). The values' own checksums, bound to their indices,
catch anything else.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .._options import MAX_PACK  # the largest K a cache may ask for (K x SMALL stays far below 4 GiB)

__all__ = ["MAGIC", "MAX_PACK", "SMALL", "build", "first_of", "header_size", "key", "problem", "span", "value"]

MAGIC = b"LMPK"
# Bytes: a value this large or larger is never packed (see the module docstring). Equal to
# _guard.PREFETCH_MIN (checked in _read), so a packed value is always read by the small-value path.
SMALL = 16384
_HEAD = struct.Struct("<4sI")
_PAIR = struct.Struct("<II")
_KEY = struct.Struct(">Qc")
_unpack_head = _HEAD.unpack_from
_unpack_pair = _PAIR.unpack_from
key = _KEY.pack  # key(first, b"P")
KEY_SIZE = _KEY.size  # 9
TAG = b"P"


def first_of(raw_key: bytes | memoryview) -> int | None:
    """The first index of a pack's key, or None if ``raw_key`` is not a pack key."""
    if len(raw_key) != KEY_SIZE or bytes(raw_key[8:]) != TAG:
        return None
    return int(_KEY.unpack(bytes(raw_key))[0])


def build(values: Sequence[bytes | memoryview]) -> bytes:
    """The pack of ``values`` (the values of consecutive indices, in order)."""
    n = len(values)
    offset = -(-(_HEAD.size + _PAIR.size * n) // 8) * 8
    head = bytearray(_HEAD.pack(MAGIC, n))
    body = bytearray(offset - _HEAD.size - _PAIR.size * n)
    for value in values:
        head += _PAIR.pack(offset, offset + len(value))
        body += value
        pad = -len(value) % 8
        body += bytes(pad)
        offset += len(value) + pad
    return bytes(head + body)


def span(raw: bytes | memoryview, j: int, n: int) -> tuple[int, int] | str:
    """Where value ``j`` lies in the pack ``raw`` of a chunk of ``n`` indices, or why the header is broken."""
    size = len(raw)
    if size < _HEAD.size + _PAIR.size * n:
        return f"the {size}-byte pack is shorter than its header for {n} values"
    magic, count = _unpack_head(raw)
    if count != n or magic != MAGIC:
        return f"bad pack magic {bytes(magic)!r}" if magic != MAGIC else f"the pack holds {count} values, not {n}"
    start, end = _unpack_pair(raw, 8 + 8 * j)
    if not _HEAD.size + _PAIR.size * n <= start <= end <= size:
        return f"value {j} of the pack spans bytes {start} to {end} of {size} (outside its values)"
    return start, end


def value(raw: bytes | memoryview, j: int, n: int) -> bytes | memoryview:
    """Value ``j`` of a pack whose header ``problem`` found sound (ValueError if it is not)."""
    found = span(raw, j, n)
    if isinstance(found, str):
        raise ValueError(found)
    return raw[found[0] : found[1]]


def header_size(n: int) -> int:
    """The bytes of a pack's header for ``n`` values: magic, count, then a (start, end) pair per value."""
    return _HEAD.size + _PAIR.size * n


def problem(raw: bytes | memoryview, n: int) -> str | None:
    """Why the header of the pack ``raw`` of a chunk of ``n`` indices is broken (spans out of order, overlapping,
    out of range, a wrong count), or None."""
    previous = 0
    for j in range(n):
        found = span(raw, j, n)
        if isinstance(found, str):
            return found
        if found[0] < previous:
            return f"value {j} of the pack overlaps the value before it (bytes {found[0]} < {previous})"
        previous = found[1]
    return None
