"""Whether every page a read or a write can reach lies inside data.mdb: the open's check of a short file.

LMDB records its last page number in the meta page, and a file shorter than that page is usually
truncated (a copy cut short, a full disk): a read of a page past the end kills the process with
SIGBUS. But a healthy file can be shorter too: LMDB can allocate a page in a write transaction,
free it in the same transaction (a page merged away, overflow pages of a value replaced) and
commit it to the free list without ever writing it (issue 38: a lazily filled packed cache one
page short, every sample intact). Such a page is never read: nothing points at it.

So a short file is judged by what points at the missing pages: ``reachable_past`` walks, from
the current meta page, the free database and the main database with every named database in it,
reading every page of each tree with ``os.pread`` (never the map: a page past the end reads short
instead of faulting) and judging it by its own flags, as LMDB does: each branch's children, and
each leaf's overflow spans (LMDB checks only an overflow value's first page number, against its
last page, before reading it). Pages within the last page number are what LMDB itself bounds, so
the file holds everything any read or write can reach exactly when no tree points past its end.
The walk reads the tree pages (not the values): for a million samples of 150 KB, about 35 MB.
Layouts: LMDB 0.9's and 1.0's (``_engine``), told apart by the meta page; any other is not
judged here (None: the caller keeps refusing a short file).
"""

from __future__ import annotations

import os
import struct

__all__ = ["reachable_past"]

_MAGIC = 0xBEEFC0DE
# LMDB's two page layouts (store/_engine.py), told apart by the meta page itself: header bytes -> data format
_FORMATS = {16: 1, 24: 3}
_P_BRANCH, _P_LEAF, _P_META, _P_LEAF2 = 0x01, 0x02, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_FLAGS_LOWER = struct.Struct("<HH")  # a page header's last 6 bytes but 2: flags, lower (then upper)
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
_NO_ROOT = 2**64 - 1


class _Short(Exception):
    """A page, or a page's content, lies past the end of the file."""

    def __init__(self, pgno: int) -> None:
        super().__init__(pgno)
        self.pgno = pgno


def reachable_past(path: str, psize: int) -> int | None:
    """The first page number past the end of ``path`` (data.mdb) that the current snapshot points at, or -1 if
    none does (the file is short only by pages on no tree: it is whole); None if the file's layout is not one
    this walk knows (not judged)."""
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        walk = _Walk(fd, psize, size // psize)
        meta = walk.meta()
        if meta is None:
            return None
        free, main, last = meta
        try:
            walk.tree(free, free=True)
            walk.tree(main)
        except _Short as exc:
            return exc.pgno
        except (ValueError, struct.error, OSError):
            return None  # a page that does not parse: not judged here (the reads say what is wrong)
        # Every missing page must be a free one: LMDB allocates past its last page only after the free list, so a
        # last page number far past the end (a hostile one) would otherwise have the next commits write there.
        missing = range(walk.npages, last + 1)
        if len(missing) > len(walk.free) or not walk.free.issuperset(missing):
            return None
        return -1


class _Walk:
    """LMDB 0.9's layout (a 16-byte page header) or 1.0's (24 bytes, node offsets counted from the header's end,
    a leaf's data after its key padded to an even length), as the C core's ``map_pages`` reads them."""

    def __init__(self, fd: int, psize: int, npages: int) -> None:
        self.fd, self.psize, self.npages = fd, psize, npages
        self.seen: set[int] = set()
        self.free: set[int] = set()  # the free list's page numbers (the free database's values)
        self.header = self.base = self.even = 0

    def page(self, pgno: int) -> bytes:
        if pgno >= self.npages:
            raise _Short(pgno)
        if pgno in self.seen:  # no page of a sound file is on two trees, nor twice on one
            raise ValueError(f"page {pgno} is reached twice")
        self.seen.add(pgno)
        data = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(data) < self.psize:
            raise _Short(pgno)
        return data

    def meta(self) -> tuple[bytes, bytes, int] | None:
        """(free, main) MDB_db records and the last page number of the meta page with the higher transaction id;
        sets the layout."""
        best: tuple[int, bytes, bytes, int] | None = None
        for pgno in (0, 1):
            try:
                page = os.pread(self.fd, 256, pgno * self.psize)
            except OSError:
                return None
            if len(page) < 256:
                return None
            found = [h for h, version in _FORMATS.items() if struct.unpack_from("<II", page, h) == (_MAGIC, version)]
            if len(found) != 1 or (self.header and found[0] != self.header):
                return None
            h = self.header = found[0]
            if not _FLAGS_LOWER.unpack_from(page, h - 6)[0] & _P_META:
                return None
            last, txnid = struct.unpack_from("<QQ", page, h + 120)
            if best is None or txnid > best[0]:
                best = (txnid, page[h + 24 : h + 72], page[h + 72 : h + 120], last)
        self.base, self.even = (self.header, 1) if self.header == 24 else (0, 0)
        return None if best is None else best[1:]

    def tree(self, record: bytes, free: bool = False) -> None:
        """Every page of the tree of the MDB_db ``record``, each read and judged by its own flags (as LMDB judges
        it, not by the record's depth), and every tree a leaf names (a named database, a key's sorted duplicates);
        ``free``: the free database, whose values (page lists) are collected into ``self.free``."""
        root = _DB.unpack(record)[-1]
        stack = [] if root == _NO_ROOT else [root]
        while stack:
            page = self.page(stack.pop())
            flags, lower = _FLAGS_LOWER.unpack_from(page, self.header - 6)
            if flags & _P_BRANCH:
                for at in self._nodes(page, lower):
                    lo, hi, fl, _ = _NODE.unpack_from(page, at)
                    stack.append(lo | hi << 16 | fl << 32)
            elif flags & _P_LEAF and not flags & _P_LEAF2:
                for at in self._nodes(page, lower):
                    self._leaf_node(page, at, free)

    def _nodes(self, page: bytes, lower: int) -> list[int]:
        count = max(0, min(lower + self.base, len(page)) - self.header) // 2
        return [at + self.base for at in struct.unpack_from(f"<{count}H", page, self.header)]

    def _leaf_node(self, page: bytes, at: int, free: bool) -> None:
        lo, hi, flags, ksize = _NODE.unpack_from(page, at)
        data, size = at + 8 + (ksize + 1 & ~1 if self.even else ksize), lo | hi << 16
        if flags & _F_SUBDATA:
            self.tree(page[data : data + _DB.size])
        elif flags & _F_BIGDATA:  # LMDB checks the first page's number only: the span must lie in the file
            first = struct.unpack_from("<Q", page, data)[0]
            pages = -(-(self.header + size) // self.psize)
            if first + pages > self.npages:
                raise _Short(max(first, self.npages))
            if free:
                self._free_list(os.pread(self.fd, size, first * self.psize + self.header))
        elif free:
            self._free_list(page[data : data + size])

    def _free_list(self, ids: bytes) -> None:
        """A free database value: an IDL, its length then that many page numbers (u64 each)."""
        count = struct.unpack_from("<Q", ids)[0]
        if count > len(ids) // 8 - 1:
            raise ValueError("a free list longer than its value")
        self.free.update(struct.unpack_from(f"<{count}Q", ids, 8))
