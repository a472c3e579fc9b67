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

import struct
import sys
import threading
import weakref
from typing import Any

import numpy as np
import torch
import xxhash

from .._native.batch import FILL_REASONS, Spans
from ..errors import CorruptSampleError
from ..format._decode import flat_plan
from ..format._format import HEAD_AND_FLAT, MAGIC
from ._shm import Segment, in_segment

__all__ = ["Buffers", "Layout", "layout_of"]

_xxh3 = xxhash.xxh3_64_intdigest
_BIG = 64 << 10  # bytes from which a copy goes through numpy (it releases the GIL; below, a memoryview is cheaper)
_from = np.frombuffer
_FLAT = 0xC1
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


def _array(shape: tuple[int, ...], dtype: np.dtype[Any], memory: str) -> np.ndarray:
    """An uninitialized array in ``memory``: "plain", or "pinned" (torch's page-locked host memory)."""
    if memory == "plain":
        return np.empty(shape, dtype)
    torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
    # The array holds the pinned tensor (its .base): the memory lives while the slot or a batch of it does.
    return torch.empty(shape, dtype=torch_dtype, pin_memory=True).numpy()


# The storage of each handed-out batch tensor, weakly, with the slot it lies in (``_hold``): kept until the storage
# dies, so that a slot moved away from (``Buffers.moved``) is not freed under a numpy array that points into it.
_lent: list[tuple[weakref.ref[Any], Buffers]] = []
_lent_lock = threading.Lock()
_prune_at = [256]  # prune _lent when it reaches this length (twice what is still alive after a prune)


def _hold(tensor: torch.Tensor, buffers: Buffers, k: int) -> None:
    """Lend array ``k`` of ``buffers`` to ``tensor``: the slot is filled again (or freed) only once its storage dies.

    The storage holds the array (``torch.from_numpy``), and torch keeps one Python object per storage for as
    long as the storage lives (PyObject preservation, torch >= 2.0: its weak reference dies with the storage,
    not with a wrapper; without it the reference counts alone decide, as before). ``share_memory_()`` (as a
    Queue does) moves the storage's data away and lets go of the array, while a numpy array taken before with
    ``.numpy()`` (its ``.base`` an alias tensor of the same storage) or from a view still points into the old
    memory: the slot stays lent until that storage dies too. A weak reference without a callback: a callback is
    Python code run wherever the tensor dies, the training loop's thread included, and a Ctrl-C landing on its
    first instruction is printed and lost (tests/test_interrupts.py).
    """
    ref = weakref.ref(tensor.untyped_storage())
    buffers.lent[k] = ref
    with _lent_lock:
        _lent.append((ref, buffers))
        if len(_lent) >= _prune_at[0]:
            _lent[:] = [(r, b) for r, b in _lent if r() is not None]
            _prune_at[0] = max(256, 2 * len(_lent))


class Buffers:
    """One ring slot: an array per tensor field, one per scalar field, and a staging array for the scalars.

    ``memory`` is where the batch lives: "plain", "shared" (one shared-memory segment, see ``_shm``)
    or "pinned" (see ``_array``).

    Reuse. The slot owns numpy arrays, never a tensor: every batch hands out tensors made by
    ``torch.from_numpy`` on them, and each such tensor's storage holds a reference to its array (or to
    a slice of it, whose ``.base`` is the array) until the last tensor, view, numpy array or storage
    object of it dies. So the arrays' reference counts are back at their values at allocation exactly
    when nothing handed out from the slot is alive: public behaviour of ``torch.from_numpy`` and
    CPython, no private torch function. A batch moved to other memory (``share_memory_()``, as a
    torch.multiprocessing Queue does) has its storage let go of the array while a numpy array taken from it
    before the move may still point into it: the slot also waits for each handed-out storage to die (``_hold``).
    """

    def __init__(self, layout: Layout, rows: int, memory: str = "plain") -> None:
        self.layout, self.rows = layout, rows
        specs = [((rows, *shape), carrier) for _, _, carrier, shape, _ in layout.tensors]
        specs += [((rows,), _COLUMN_DTYPES[code]) for _, code in layout.scalars]
        self.segment: Segment | None = None
        if memory == "shared":  # one segment per slot: a DataLoader worker sends one handle per batch (_collate)
            self.segment, arrays = in_segment(specs)
        else:
            arrays = [_array(shape, dtype, memory) for shape, dtype in specs]
        self.arrays, self.column_arrays = arrays[: len(layout.tensors)], arrays[len(layout.tensors) :]
        self.flat = [memoryview(a).cast("B") for a in self.arrays]  # type: ignore[arg-type]
        self.bytes = [np.frombuffer(f, np.uint8) for f in self.flat]  # the same memory, for numpy's copies
        self.scalars = np.zeros((rows, layout.scalar_size), np.uint8)
        # No scalar field (a 1-tuple of a tensor): numpy's (rows, 0) array cannot be cast to bytes; nothing is copied
        self.scalar_view = memoryview(self.scalars).cast("B") if layout.scalar_size else memoryview(bytearray())  # type: ignore[arg-type]
        self.busy = False
        self.lent: list[weakref.ref[Any] | None] = [None] * len(arrays)  # each array's last batch storage (_hold)
        self.event: Any = None  # set by the loader: the slot is reused only once event.query() is True
        del arrays  # a local reference counted into the base would make a handed-out batch look unused
        self._base = self._counts()

    def _counts(self) -> list[int]:
        """Each array's reference count, taken the same way every time (no zip or enumerate in between:
        its reused result tuple would hold one more reference)."""
        arrays, counts = self.arrays + self.column_arrays, []
        for k in range(len(arrays)):
            counts.append(sys.getrefcount(arrays[k]))
        return counts

    def unused(self) -> bool:
        """True when no tensor, view, numpy array or storage handed out from this slot is alive anywhere."""
        return not self.busy and self._counts() == self._base and not any(r is not None and r() for r in self.lent)

    @property
    def moved(self) -> bool:
        """A storage handed out from this slot lives but no longer holds its array (``share_memory_()`` moved it):
        the slot waits for it to die (``_hold``)."""
        counts = self._counts()
        return any(r is not None and r() is not None and counts[k] <= self._base[k] for k, r in enumerate(self.lent))

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
        fields = list(zip(layout.tensors, self.flat, self.bytes))
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
            for (pos, nbytes, _, _, _), flat, out in fields:
                row = j * nbytes
                if nbytes >= _BIG:
                    out[row : row + nbytes] = _from(mv, np.uint8, nbytes, pos)  # within mv: len(mv) == value_size
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

        Every field is a new tensor on this slot's arrays (alive, it keeps the slot from reuse: see
        the class docstring); the scalar columns are converted from the staging rows into theirs here.
        """
        layout = self.layout
        tensors = []
        for a, (_, _, _, _, view) in zip(self.arrays, layout.tensors):
            part = torch.from_numpy(a if rows == self.rows else a[:rows])
            tensors.append(part.view(view) if view is not None else part)
        scalars = []
        for (offset, code), array in zip(layout.scalars, self.column_arrays):
            column = np.ndarray((rows,), _SCALAR_DTYPES[code], self.scalars, offset, (layout.scalar_size,))
            if code == "?":
                np.not_equal(column, 0, out=array[:rows])
            else:
                array[:rows] = column
            scalars.append(torch.from_numpy(array if rows == self.rows else array[:rows]))
        handed = tensors + scalars
        for k in range(len(handed)):
            _hold(handed[k], self, k)
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
