"""Groups: the small values of one commit stored as one record, each index pointing into it (issue #25, format 4).

Why. LMDB keeps a value in its leaf page only up to about half a page (~2 KiB with 4 KiB pages),
and pages filled in random key order stay about 2/3 full; a larger value takes whole overflow
pages (3 KiB -> 4 KiB, 6 KiB -> 8 KiB). A cache filled lazily in shuffled order, the default way,
so stored 1.35x to 2-3x its payload (packs, ``_pack``, only help an in-order fill). In format 4
the values a commit writes that are smaller than ``SMALL`` are concatenated, in the order the
commit holds them, into one group record; each index keeps a small pointer under its own key.
The group takes contiguous overflow pages (under one page lost per group of up to ``MAX_GROUP`` bytes), and only the
pointers (20 bytes each) sit in half-full leaf pages, whatever the order of the fill.

Keys. A group's key is ``b"\\xffG"`` and its id as 8 bytes big-endian (10 bytes): it sorts after
every index key (an index is below 2**63, so its key's first byte is below 0x80) and every pack
key, so a scan in index order meets the groups only after the last index and stops there. Group
ids increase by one per group (the writer takes the last key's id plus one, under the write lock).

Pointer, the value under an index's key, all integers little-endian (20 bytes)::

    offset  size  field
    0       4     magic b"LMGP" (a stored value starts with b"LMC")
    4       8     the group's id (u64)
    12      4     the value's offset in the group (u32)
    16      4     the value's length (u32)

Group: the values, each exactly as a single record stores it (``codec``), each starting at an
8-byte aligned offset, zero padding between them; no header. A group is written with its
pointers in one write transaction (both or neither survive a crash). A group and its pointers
are untrusted input: a reader checks the pointer's span against the group record (``span``)
before slicing, and the value's own checksums, bound to its index, catch a pointer to another
index's value. Deleting an index (``verify --repair``) deletes its pointer; its bytes in the
group stay until the cache is rewritten (``lmdbcache merge`` into a new cache).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = [
    "MAGIC", "MAX_GROUP", "POINTER_SIZE", "PREFIX", "SMALL",
    "build", "id_of", "index_key", "key", "plan", "pointer", "span", "unpack_index",
]  # fmt: skip

MAGIC = b"LMGP"
# Bytes: a value this large or larger is stored alone, as before (its overflow pages waste under 4 KiB,
# under 25%, and most often far less); equal to _pack.SMALL and _guard.PREFETCH_MIN, so a grouped
# value is always read by the small-value path.
SMALL = 16384
# Bytes per group record: a larger commit writes several. Under glibc's mmap threshold, so neither the join nor
# LMDB's copy of a record touches fresh pages (8 MiB groups: a 3 KiB miss's write cost 10.0 us, 256 KiB: 5.8 us);
# a group loses under one 4 KiB page, under 1.6% of it. Readers take any size (offsets stay far below 4 GiB).
MAX_GROUP = 256 << 10
PREFIX = b"\xffG"
_KEY = struct.Struct(">2sQ")
_INDEX = struct.Struct(">Q")
# An index's own key: the index as 8 bytes big-endian, so keys sort in index order (one definition for all).
index_key = _INDEX.pack
unpack_index = _INDEX.unpack  # (index,) of an index key
_POINTER = struct.Struct("<4sQII")
POINTER_SIZE = _POINTER.size  # 20
KEY_SIZE = _KEY.size  # 10
pointer_of = _POINTER.unpack_from
_PADS = [bytes(k) for k in range(8)]


def key(group: int) -> bytes:
    """The key of group ``group``."""
    return _KEY.pack(PREFIX, group)


def id_of(raw_key: bytes | memoryview) -> int | None:
    """The id of a group's key, or None if ``raw_key`` is not a group key."""
    if len(raw_key) != KEY_SIZE or bytes(raw_key[:2]) != PREFIX:
        return None
    return int(_KEY.unpack(bytes(raw_key))[1])


def pointer(group: int, offset: int, length: int) -> bytes:
    """The pointer to ``length`` bytes at ``offset`` of group ``group``."""
    return _POINTER.pack(MAGIC, group, offset, length)


def is_pointer(raw: bytes | memoryview) -> bool:
    """Whether the stored value ``raw`` is a pointer into a group (else: a value stored alone)."""
    return len(raw) == POINTER_SIZE and raw[:4] == MAGIC


def target(raw: bytes | memoryview) -> tuple[int, int, int]:
    """(group id, offset, length) of the pointer ``raw`` (``is_pointer``)."""
    _, group, offset, length = pointer_of(raw)
    return group, offset, length


def span(size: int, offset: int, length: int) -> str | None:
    """Why a pointer to ``length`` bytes at ``offset`` does not lie in a group of ``size`` bytes, or None."""
    if offset % 8 or offset + length > size or not length:
        return f"it points to bytes {offset} to {offset + length} of a {size}-byte group"
    return None


def build(values: Sequence[bytes | memoryview]) -> tuple[bytes, list[tuple[int, int]]]:
    """The group of ``values`` and each value's (offset, length) in it."""
    parts, spans, at = [], [], 0
    for value in values:
        size = len(value)
        spans.append((at, size))
        parts.append(value)
        if pad := -size % 8:
            parts.append(_PADS[pad])
        at += size + pad
    return b"".join(parts), spans  # one copy of each value (a growing bytearray copied each many times)


Pairs = list[tuple[bytes, bytes]]


def plan(
    batch: list[tuple[int, bytes]], small: int, first: int, limit: int
) -> tuple[Pairs, list[tuple[bytes, bytes, Pairs]]]:
    """The records a commit writes for ``batch`` ((index, value) pairs): ``(singles, groups)``.

    ``singles``: the (key, value) pairs stored alone, in the batch's order: values of ``small`` bytes or more,
    and a lone small value (a group of one saves nothing). ``groups``: (group key, record, [(key, pointer), ...])
    from group id ``first`` on, the small values in the batch's order, a group closed before a value would take
    it past ``limit`` bytes (each value counted with 8 more). The reference of ``core.group_batch``, which
    the writer calls instead when the core is built (no Python step per record on the committer thread).
    """
    smalls = [(i, v) for i, v in batch if len(v) < small]
    lone = len(smalls) < 2
    singles = [(index_key(i), v) for i, v in batch if lone or len(v) >= small]
    groups, group, at = [], first, 0
    while not lone and at < len(smalls):
        end, size = at, 0
        while end < len(smalls) and (end == at or size + len(smalls[end][1]) + 8 <= limit):
            size += len(smalls[end][1]) + 8
            end += 1
        record, spans = build([v for _, v in smalls[at:end]])
        pointers = [(index_key(i), pointer(group, o, n)) for (i, _), (o, n) in zip(smalls[at:end], spans)]
        groups.append((key(group), record, pointers))
        group, at = group + 1, end
    return singles, groups
