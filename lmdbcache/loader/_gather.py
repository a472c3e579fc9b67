"""Copy flat values (the codec's flat form) straight from the map into preallocated batch tensors.

One copy per sample and field, no per-sample tensor: each value's bytes go from its view
into the map (``Reader.read_batch``) into row ``j`` of the batch tensor of each field,
and its scalars into one staging row that becomes one int64 / float64 / bool tensor per
field, as ``default_collate`` builds them. The codec's trust rules hold here as in
``codec.decode``: a value's structure checksum (seed = the index) is verified before any
of its bytes are used, its lengths are checked against its signature's plan, and its data
checksum is verified over the copy when the store asks for it; whatever fails raises
``CorruptSampleError`` carrying the index, which the store words as ``get`` does. A value
in another form (msgpack, format 1, another signature) makes the batch fall back to
``CachedDataset.__getitems__``: it is never parsed here.

The codec pieces used here (and only here): ``_format.MAGIC`` and the header layout, and
``_decode.flat_plan`` (the same checked plan ``decode`` uses).
"""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any

import numpy as np
import torch
import xxhash

from .._native.batch import FILL_REASONS, Spans
from ..errors import CorruptSampleError
from ..format._decode import flat_plan
from ..format._format import HEAD_AND_FLAT, MAGIC
from ..store._address import address as _address

__all__ = ["Buffers", "Layout", "layout_of"]

_xxh3 = xxhash.xxh3_64_intdigest
_memmove = ctypes.memmove  # a ctypes call releases the GIL: large copies run in parallel
_BIG = 64 << 10  # bytes from which a copy goes through memmove (below, a memoryview copy is cheaper)
_FLAT = 0xC1
# How many tensors and views share a storage: a private torch function (the one exception to the
# STYLE's rule, because nothing public counts views). A torch without it must not break
# `import lmdbcache`: then no slot is ever judged unused, and every batch gets new buffers
# (correct, only without the reuse). tests/test_collate.py removes it to check that path.
_use_count: Any = getattr(torch._C, "_storage_Use_Count", None)
_SCALAR_DTYPES: dict[str, np.dtype[Any]] = {"q": np.dtype("<i8"), "d": np.dtype("<f8"), "?": np.dtype("u1")}
_COLUMN_DTYPES: dict[str, np.dtype[Any]] = {"q": np.dtype("=i8"), "d": np.dtype("=f8"), "?": np.dtype("bool")}


_head = HEAD_AND_FLAT.unpack_from


def _corrupt(index: int, reason: str) -> CorruptSampleError:
    exc = CorruptSampleError(reason)
    exc.index = index  # type: ignore[attr-defined]  # read by Reader.read_batch
    return exc


class Layout:
    """The batch form of one flat signature: where each field lies in a value, and its batch dtype and shape."""

    def __init__(self, key: bytes) -> None:
        unpack, self.scalars_at, self.struct_size, self.value_size, tensors, order, _ = flat_plan(key)
        self.key = key
        codes = unpack.__self__.format[1:]  # type: ignore[attr-defined]  # a bound Struct.unpack_from: "<" + codes
        self.scalar_size = struct.calcsize("<" + codes)
        pos = 24 + self.struct_size
        self.tensors: list[tuple[int, int, np.dtype, tuple[int, ...], torch.dtype | None]] = []
        for nbytes, carrier, shape, view in tensors:
            self.tensors.append((pos, nbytes, carrier, shape, view))
            pos += nbytes
        if pos != self.value_size:  # fill() copies [pos, pos + nbytes) of a value of value_size bytes by address
            raise CorruptSampleError(f"the flat plan's fields end at byte {pos}, not at the value's {self.value_size}")
        offsets, at = [], 0
        for code in codes:
            offsets.append((at, code))
            at += struct.calcsize("<" + code)
        self.scalars = offsets
        self.sample_bytes = sum(spec[1] for spec in self.tensors) + self.scalar_size
        # A tensor field of zero bytes has no memory to copy into (numpy refuses a byte view of
        # it): such batches take default_collate's path.
        self.has_empty = any(spec[1] == 0 for spec in self.tensors)
        if order is None:
            order = tuple(range(len(tensors))) + tuple(~k for k in range(len(codes)))
        self.order: tuple[int, ...] = tuple(order)
        # What lmdbcache._native's fill needs of this layout (see core.fill)
        self.native_plan = (key, self.struct_size, self.value_size, self.scalars_at, self.scalar_size,
                            tuple((pos, nbytes) for pos, nbytes, _, _, _ in self.tensors))  # fmt: skip

    def allocate(self, rows: int, memory: str = "plain") -> Buffers:
        return Buffers(self, rows, memory)


def _shared_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of uninitialized shared memory: torch's private ``_new_shared`` (allocated there
    at once), else the public ``share_memory_()`` (allocated privately, then moved: one copy more)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is not None:
        return new_shared(nbytes)  # type: ignore[no-any-return]
    return torch.UntypedStorage(nbytes).share_memory_()  # type: ignore[no-untyped-call,no-any-return]


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any], memory: str) -> torch.Tensor:
    """An uninitialized tensor in ``memory``: "plain", "shared" (a shared-memory segment) or "pinned"."""
    if memory == "plain":
        return torch.from_numpy(np.empty(shape, dtype))
    torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
    if memory == "pinned":
        return torch.empty(shape, dtype=torch_dtype, pin_memory=True)
    # Allocated shared from the start (share_memory_() would copy a private buffer into a new segment):
    # a DataLoader worker then pickles a handle to it, not its bytes.
    storage = _shared_storage(int(np.prod(shape)) * dtype.itemsize)
    out: torch.Tensor = torch.empty(0, dtype=torch_dtype).set_(storage, 0, shape)  # type: ignore[call-overload]
    return out


def _one_segment(specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> list[torch.Tensor]:
    """Uninitialized tensors of these shapes and dtypes, laid out 64-byte aligned in one shared-memory segment."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-int(np.prod(shape)) * dtype.itemsize // 64) * 64
    storage = _shared_storage(end)
    out = []
    for (shape, dtype), offset in zip(specs, offsets):
        torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        out.append(torch.empty(0, dtype=torch_dtype).set_(storage, offset // dtype.itemsize, shape))  # type: ignore[call-overload]
    return out


class Buffers:
    """One ring slot: a batch tensor per tensor field, one per scalar field, and a staging array for the scalars.

    ``memory`` is where the batch tensors live: "plain", "shared" or "pinned" (see ``_empty``).
    """

    def __init__(self, layout: Layout, rows: int, memory: str = "plain") -> None:
        self.layout, self.rows = layout, rows
        specs = [((rows, *shape), carrier) for _, _, carrier, shape, _ in layout.tensors]
        specs += [((rows,), _COLUMN_DTYPES[code]) for _, code in layout.scalars]
        # "shared": one segment per batch, so a DataLoader worker sends one handle for it (lmdbcache.loader._collate).
        shared = memory == "shared"
        fields = _one_segment(specs) if shared else [_empty(shape, dtype, memory) for shape, dtype in specs]
        self.tensors, self.columns = fields[: len(layout.tensors)], fields[len(layout.tensors) :]
        self.flat = [memoryview(t.numpy()).cast("B") for t in self.tensors]  # type: ignore[arg-type]
        self.addresses = [t.data_ptr() for t in self.tensors]
        self.scalars = np.zeros((rows, layout.scalar_size), np.uint8)
        # No scalar field (a 1-tuple of a tensor): numpy's (rows, 0) array cannot be cast to bytes; nothing is copied
        self.scalar_view = memoryview(self.scalars).cast("B") if layout.scalar_size else memoryview(bytearray())  # type: ignore[arg-type]
        # The scalar columns' batch tensors live in the slot too: no tensor is allocated per batch.
        self.column_arrays = [c.numpy() for c in self.columns]
        self.busy = False
        self.event: Any = None  # set by the loader: the slot is reused only once event.query() is True
        # What "no longer referenced" is measured against. Three counts, because each misses a
        # way of keeping a batch: the storage's use count sees tensors and views (and numpy
        # arrays of them); the Python storage object's refcount sees `batch.untyped_storage()`
        # and `batch.storage()` kept alone (torch hands out one cached object per storage);
        # the data pointer sees `share_memory_()` (a torch.multiprocessing Queue does it),
        # which moves the storage and frees the memory our copy addresses point into.
        self._storages = [t.untyped_storage() for t in self.tensors + self.columns]
        self._pointers = [storage.data_ptr() for storage in self._storages]
        self._base = self._counts()

    def _counts(self) -> list[tuple[int, int]] | None:
        """Each storage's (use count, refcount), taken the same way every time (a zip or enumerate
        in between would hold one more reference in its reused result tuple); None without the use count."""
        if _use_count is None:
            return None
        storages, counts = self._storages, []
        for k in range(len(storages)):
            counts.append((int(_use_count(storages[k]._cdata)), sys.getrefcount(storages[k])))
        return counts

    def moved(self) -> bool:
        """True when a batch of this slot was moved to other memory (``share_memory_``): never reuse it."""
        return any(st.data_ptr() != ptr for st, ptr in zip(self._storages, self._pointers))

    def unused(self) -> bool:
        """True when no tensor, view or storage handed out from this slot is alive anywhere, and it did not move.

        Always False without torch's use count (see ``_use_count``): a slot is then never reused.
        """
        return not self.busy and self._base is not None and self._counts() == self._base and not self.moved()

    def free(self) -> bool:
        """Unused, and the consumer's device copies of its last batch (``event``) are done."""
        return self.unused() and (self.event is None or bool(self.event.query()))

    def fill(self, views: Any, checks: Any, indices: list[int], lo: int, hi: int) -> bool:
        """Copy values ``lo:hi`` into rows ``lo:hi``; False if one is not in this layout (nothing is wrong yet)."""
        if type(views) is Spans:  # located by the compiled core: one call copies the slice, the GIL released
            status, row = views.fill(self.layout.native_plan, self.flat, self.scalar_view, lo, hi)
            if status > 1:
                raise _corrupt(indices[row], FILL_REASONS[status])
            return status == 0
        layout = self.layout
        key, klen, value_size, struct_size = layout.key, len(layout.key), layout.value_size, layout.struct_size
        at, ssize = layout.scalars_at, layout.scalar_size
        fields = list(zip(layout.tensors, self.flat, self.addresses))
        scalar_view = self.scalar_view
        for j in range(lo, hi):
            mv, index = views[j], indices[j]
            try:
                magic, size, structure_hash, data_hash, first, sig = _head(mv)
            except struct.error:
                return False
            if magic != MAGIC or first != _FLAT or sig + 2 != klen or mv[25 : 25 + klen] != key:
                return False
            end = 24 + size
            if _xxh3(mv[24:end], index) != structure_hash:
                raise _corrupt(
                    index,
                    "the structure checksum does not match: the value is damaged or was stored under another index",
                )
            if size != struct_size or len(mv) != value_size:
                raise _corrupt(index, "the flat structure's lengths do not add up to the value's")
            check, digest = checks[j], index
            for (pos, nbytes, _, _, _), flat, address in fields:
                row = j * nbytes
                if nbytes >= _BIG:
                    _memmove(address + row, _address(mv) + pos, nbytes)  # within mv: len(mv) == value_size above
                else:
                    flat[row : row + nbytes] = mv[pos : pos + nbytes]
                if check:
                    digest = _xxh3(flat[row : row + nbytes], digest)
            if check and digest != data_hash:
                raise _corrupt(index, "the data checksum does not match")
            if ssize:
                scalar_view[j * ssize : (j + 1) * ssize] = mv[at : at + ssize]
        return True

    def batch(self, rows: int) -> list[torch.Tensor]:
        """The batch as ``default_collate`` returns a tuple sample: a list, one tensor per item in order.

        Every field is a new view of this slot's tensors (each alive view counts against
        ``free``); the scalar columns are converted from the staging rows into theirs here.
        """
        layout = self.layout
        tensors = []
        for t, (_, _, _, _, view) in zip(self.tensors, layout.tensors):
            part = t if rows == self.rows else t[:rows]
            tensors.append(part.view(view) if view is not None else part.view(part.shape))
        scalars = []
        for (offset, code), out, array in zip(layout.scalars, self.columns, self.column_arrays):
            column = np.ndarray((rows,), _SCALAR_DTYPES[code], self.scalars, offset, (layout.scalar_size,))
            if code == "?":
                np.not_equal(column, 0, out=array[:rows])
            else:
                array[:rows] = column
            scalars.append(out[:rows])  # a new view: the slot's own tensor object would not count as handed out
        return [tensors[k] if k >= 0 else scalars[~k] for k in layout.order]


def layout_of(mv: Any, index: int, layouts: dict[bytes, Layout]) -> Layout | None:
    """The layout of the flat value ``mv`` (its structure verified first), or None if it is not flat."""
    try:
        magic, size, structure_hash, _, first, sig = _head(mv)
    except struct.error:
        return None
    if magic != MAGIC or first != _FLAT:
        return None
    key = bytes(mv[25 : 27 + sig])
    layout = layouts.get(key)
    if layout is not None:
        return None if layout.has_empty else layout
    if _xxh3(mv[24 : 24 + size], index) != structure_hash:
        raise _corrupt(
            index, "the structure checksum does not match: the value is damaged or was stored under another index"
        )
    try:
        layout = Layout(key)
    except CorruptSampleError as exc:
        raise _corrupt(index, str(exc)) from None
    if len(layouts) >= 64:
        layouts.clear()
    layouts[key] = layout
    return None if layout.has_empty else layout
