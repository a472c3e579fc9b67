"""Refuse an LMDB record whose value would run past the end of data.mdb, before anything touches it.

Why this exists: py-lmdb's ``Transaction.get`` (and ``Cursor.value``) touch one byte per 4 KiB
page of a value as soon as LMDB returns it (``preload()`` in py-lmdb's cpython.c), and LMDB
trusts the value length stored in the record. One damaged length in data.mdb therefore kills
the reading process with SIGBUS (pages past the end of the file) or SIGSEGV (past the map)
before Python sees any byte: the fuzz in tests/stress/test_fuzz_file.py found such files.

So a value this process has not verified yet is looked up with a cursor (``set_key`` does not
touch the value), and its record is checked against the mapped file first. The record is LMDB's
``MDB_node`` (mdb.c), the same in 0.9 and 1.0: 8 bytes right before the key::

    u16 lo, u16 hi      data size = lo | hi << 16 (little-endian machines)
    u16 flags           F_BIGDATA (0x01): the data is on overflow pages
    u16 ksize           key size
    key (ksize bytes), then the data inline, or a u64 overflow page number (F_BIGDATA);
    an overflow page's data starts after its page header.

Two details depend on the engine that wrote the file (``_engine``: the environment says which): the page
header is 16 bytes in LMDB 0.9 and 24 in 1.0, and 1.0 starts the data after the key padded to an even length
(with F_BIGDATA, a 24-byte ``MDB_ovpage`` whose first u64 is the page number).

The mapping's address comes from /proc/self/maps (refreshed when the map moves: a growth or an
adopted resize; never per read, on either path: the compiled core's reads take the address, length
and view ``mapping`` keeps, and only a failed lookup asks for a refresh, which first takes a grown
file's size with a stat: ``refresh(grown=True)``).
Where that is unavailable (not Linux) or the layout is not known (a big-endian machine, or an
engine other than LMDB 0.9 or 1.0: ``_engine.layout_of`` says so once with an ``LmdbCacheWarning``)
the check is skipped, never guessed: reads of a damaged file may then crash.

The same header gives the value's span in the map, so a large value is also announced to the
kernel before it is touched (``madvise(MADV_WILLNEED)`` on that span, which starts its read):
the map is opened with readahead off, and without this a cold 147 KiB value is read as 36
synchronous 4 KiB page faults instead of one I/O (issue #14, ``python -m bench.cold``). The
advice is only a hint: it touches nothing, a failure is ignored, and without libc's madvise
(or /proc/self/maps) there is none. madvise rather than posix_fadvise on a descriptor: no
file stays open past the environment (a read-only mount could not be unmounted).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from typing import Any

from .. import _native

# A buffer's address and the map's view: the compiled core's own (no ctypes), else _address's (ctypes.pythonapi:
# see what breaks it there; imported only then, so the core's path never loads it)
if _native.core is not None:
    _address, _view = _native.core.address, _native.core.view
else:
    from ._address import address as _address
    from ._address import view as _view

__all__ = ["MapGuard"]

_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")
_F_BIGDATA = 0x01
_node = _NODE.unpack_from
_pgno = _PGNO.unpack_from
_EMPTY = memoryview(b"")
_LITTLE = sys.byteorder == "little"
PREFETCH_MIN = 16384  # bytes: a value of a few pages gains little from one I/O over its faults
_MADV_RANDOM, _MADV_SEQUENTIAL, _MADV_WILLNEED = 1, 2, 3  # Linux, the BSDs and macOS alike


def _libc_madvise() -> Any:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise() if sys.platform.startswith("linux") else None


class MapGuard:
    """Bounds checks for records of one data.mdb mapped in this process."""

    def __init__(self, data_file: str, page_size: int, header: int) -> None:
        """``header``: the page header's size in the file's layout (``_engine.Layout.header``: 16 for LMDB 0.9, 24
        for 1.0), or 0 when the layout is not known: the guard then stays off."""
        self.data_file = data_file
        self.page_size = page_size
        self.header = header
        self._odd = 1 if header == 24 else 0  # LMDB 1.0: an odd-length key is padded by a byte before its data
        self._pointer = 24 if header == 24 else 8  # an overflow value's pointer: 1.0's MDB_ovpage, 0.9's page number
        self.start = 0  # the mapping's address, 0 when unknown
        self.file_size = 0
        # (start, file_size, a view of the file's bytes in the map): swapped as one, so a thread checking a
        # record while another refreshes sees one mapping's figures, never a mix
        self._mapped: tuple[int, int, memoryview] = (0, 0, _EMPTY)
        self._unreadable = ""  # why the last refresh failed (every check then fails with it), or ""
        # (start, end, st_dev, st_ino, the device as /proc/self/maps writes it) of the mapped file at the last full look
        self._found_map: tuple[int, int, int, int, str] | None = None
        # One refresh at a time: two threads refreshing at once could store the older file size last, and a
        # reader finding its page past that size again would call a sound cache damaged. Today's callers hold
        # the handle's lock; this keeps the guard right without relying on that (tests/test_store.py:
        # test_a_refresh_never_stores_an_older_file_size)
        self._refreshing = threading.Lock()
        self.refresh()

    def refresh(self, grown: bool = False) -> None:
        """Find the mapping of data.mdb in this process and the file's current size.

        Both are found first and stored together: other threads check records against them
        meanwhile (a moment with ``start`` at 0 would let their unchecked reads through).

        ``grown``: only the file may have changed since the last look (a commit grew it), not the map: the
        file's size is taken again with one ``stat`` (the same file, by device and inode), the mapping as found
        last. Reading /proc/self/maps took 0.9 ms in a process that imported torch, once per commit of a
        lazy fill (0.4 us a 3 KiB miss). The map moves only when this process sets the map size
        (``Handle._set_mapsize``) or reopens the environment (a new guard): both look in full. A caller that
        still finds a record out of bounds after this looks in full before calling the file damaged.
        """
        if not _LITTLE or not self.header:
            return  # records parsed little-endian, in a known layout: elsewhere the check is off, as without /proc
        with self._refreshing:
            if not (grown and self._grew()):
                self._refresh()

    def _grew(self) -> bool:
        """The file's size taken again under the mapping last found; False if that cannot be (look in full)."""
        found = self._found_map
        if found is None or self._unreadable:
            return False
        start, end, dev, ino, _ = found
        try:
            st = os.stat(self.data_file)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) != (dev, ino) or start != self.start:
            return False  # another file at the path (a rebuild): the full look says what is mapped
        size = min(st.st_size, end - start)
        if size != self._mapped[1]:
            self._mapped = (start, size, _view(start, size) if size > 0 else _EMPTY)
            self.file_size = size
        return True

    def _refresh(self) -> None:
        try:
            st = os.stat(self.data_file)
            with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            if self.start:
                self._refuse(f"it could not be checked: {exc}")  # checked before: never unchecked reads
            return  # never checked (no /proc/self/maps: not Linux): the check stays off, as documented
        self._unreadable = ""
        known = self._found_map if self.start else None
        if known is None:  # the first look: the file at the path
            start, end, device = _mapping_of(lines, st.st_ino, real=os.path.realpath(self.data_file))
            size = st.st_size
            ident = (st.st_dev, st.st_ino, device)
        else:
            # The file this guard found first, wherever it is mapped now: the path may hold another one (`lmdbcache
            # copy` into a live cache swaps it in; this process still maps the one it opened, unlinked), which may
            # even be mapped here by another cache. Its size through LMDB's open descriptor of it, then; never
            # turn the check off (a hostile record would crash the process).
            ident = known[2:]
            start, end, _ = _mapping_of(lines, ident[1], device=ident[2])
            opened = st.st_size if (st.st_dev, st.st_ino) == ident[:2] else _size_of_open(*ident[:2])
            if not start or opened is None:
                self._refuse(
                    f"it could not be checked: {self.data_file} was replaced by another file since this process "
                    "opened it, and the file it still maps cannot be found; close the dataset and read again"
                )
                return
            size = opened
        # What may be read through the map: the file's bytes that are mapped (a hostile record can point past
        # either end; another process may have grown the file past this process's map)
        size = min(size, end - start)
        view = _view(start, size) if start and size > 0 else _EMPTY  # read-only; its slices hash (decode needs it)
        self._mapped = (start, size, view)
        self._found_map = (start, end, *ident) if start else None
        if start and start == self.start:
            self.file_size = size
        else:
            self.start, self.file_size = start, size

    def _refuse(self, why: str) -> None:
        """Every check fails, naming ``why``, until a refresh works again (checked before: never unchecked reads)."""
        self._unreadable = why
        self._mapped = (self.start, 0, _EMPTY)

    @property
    def unreadable(self) -> str:
        """Why the last refresh could not look at the map (every check fails with it), or ""."""
        return self._unreadable

    def mapping(self) -> tuple[int, int, memoryview]:
        """(address, readable bytes, a view of them) of the file's mapping as last found (0, 0 and an empty view
        when unknown): the native reader's bounds (``lmdbcache._native``); it refreshes and asks again when a
        lookup fails."""
        return self._mapped

    def problem(self, key: bytes | memoryview, prefetch: bool = True) -> str | None:
        """Why the record whose key (a view into the map) is ``key`` cannot be read safely, or None.

        With ``prefetch``, a sound record's value of ``PREFETCH_MIN`` bytes or more is announced
        to the kernel (see the module docstring) before the caller touches it.
        """
        if not self.start:
            return None
        found = self._found(key, prefetch)
        return found if isinstance(found, str) else None

    def prefetch(self, key: bytes | memoryview) -> None:
        """Announce the value of the record whose key is ``key`` (a record checked before in this process).

        A wrong span is harmless (advice touches nothing), so nothing is refreshed or reported:
        the fast path's cheap half of ``problem``.
        """
        if _madvise is not None and self.start:
            self._locate(key, prefetch=True)

    def sequential(self, on: bool) -> None:
        """Read the map ahead (``MADV_SEQUENTIAL``) while a scan walks it, or back to LMDB's no-readahead advice.

        The environment is opened with ``readahead=False`` (LMDB's ``MADV_RANDOM``: random
        reads of the cache fetch only the pages they touch); a scan in key order walks the
        file mostly front to back, and with readahead each fault brings the next pages too.
        """
        self.refresh()
        if _madvise is not None and self.start and self.file_size:
            _madvise(self.start, self.file_size, _MADV_SEQUENTIAL if on else _MADV_RANDOM)

    def _advise(self, offset: int, size: int) -> None:
        """Ask for bytes [offset, offset + size) of the file, through the map (the page holding offset on)."""
        page = offset - offset % self.page_size
        if _madvise is not None and 0 <= page < self.file_size:
            _madvise(self.start + page, min(size + offset - page, self.file_size - page), _MADV_WILLNEED)

    def value(self, key: bytes | memoryview, advise: bool = False) -> memoryview | str:
        """The value of the record whose key (a view into the map) is ``key``, or why it cannot be read safely.

        The value is a slice of this guard's view of the mapped file: making it touches no page of
        the value (py-lmdb's get touches every one: a pack of 48 pages read cold for one 3 KiB value
        in it). The caller keeps it no longer than its read transaction, and refreshes this guard
        whenever this process's map moves (``Handle._set_mapsize``). With ``advise``, a value of
        more than a page is announced to the kernel (one read for all of it if it is not cached).
        """
        found = self._found(key)
        if isinstance(found, str):
            return found
        at, size, view = found
        if advise and size > self.page_size:
            self._advise(at, size)
        return view[at : at + size]

    def _found(self, key: bytes | memoryview, prefetch: bool = False) -> tuple[int, int, memoryview] | str:
        """``_locate``, looking again if it fails: the file may have grown (``refresh(grown=True)``), or the map
        moved (a full ``refresh``)."""
        found = self._locate(key, prefetch)
        for grown in (True, False):  # the file grown (a stat), then the map looked for in full
            if not isinstance(found, str):
                break
            self.refresh(grown)
            found = self._locate(key, prefetch)
        return found

    def _locate(self, key: bytes | memoryview, prefetch: bool = False) -> tuple[int, int, memoryview] | str:
        """(offset in the file, size, the file's view) of the record's value, or why it cannot be read safely."""
        start, end, view = self._mapped
        offset = _address(key) - start - 8  # the record's node header, in the file
        if not self.page_size <= offset <= end - 8:
            return self._unreadable or f"its key lies outside the data file (offset {offset + 8})"
        lo, hi, flags, ksize = _node(view, offset)
        size = lo | hi << 16
        data = offset + 8 + ksize + (ksize & self._odd)
        if flags & _F_BIGDATA:
            if data + self._pointer > end:
                return "its overflow page number lies past the end of the data file"
            pgno = _pgno(view, data)[0]
            at = pgno * self.page_size + self.header
            if pgno < 2 or at + size > end:
                return f"its {size:,}-byte value on page {pgno} would run past the end of the data file ({end:,} bytes)"
            if prefetch and size >= PREFETCH_MIN:
                self._advise(at, size)
            return at, size, view
        if data + size > end:
            return f"its {size:,}-byte value would run past the end of the data file ({end:,} bytes)"
        return data, size, view


def _mapping_of(lines: list[str], ino: int, real: str = "", device: str = "") -> tuple[int, int, str]:
    """(start, end, device field) of the mapping from offset 0 of the file of inode ``ino`` in /proc/self/maps's
    ``lines``, whose path resolves to ``real`` or (an unlinked file too) whose device field is ``device``, or
    (0, 0, ""). The device as the maps write it, not ``st_dev``: on btrfs or overlayfs the two differ."""
    start = end = 0
    found = ""
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        try:
            low, high = (int(part, 16) for part in fields[0].split("-"))
            inode = int(fields[4])
        except ValueError:
            continue
        if start and low == end and inode == ino:
            end = high  # the mapping goes on (advice on part of it splits it into several lines)
        elif start:
            break
        elif (
            fields[2] == "00000000"
            and inode == ino
            and (fields[3] == device if device else os.path.realpath(fields[5]) == real)
        ):
            start, end, found = low, high, fields[3]
    return start, end, found


def _size_of_open(dev: int, ino: int) -> int | None:
    """The size of a file this process holds open (an unlinked one too), by device and inode, or None."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (dev, ino):
            return st.st_size
    return None
