"""The augmented batch path (``Loader(..., augment=[...])``): the image field cropped, resized, flipped and
normalized on its way from the map into the batch tensor.

With the compiled core, ``Fused.native`` hands each slice of a batch to ``core.augment`` (one C
call per slice, the GIL released, ``lmdbcache/_native/_augment.c``): every value is checked as
``core.fill`` checks it, its image's stored shape is read from its own signature (images of any
size go into one batch), and its other fields are copied as ``fill`` copies them. The batch
tensors come from the loader's ring, one layout per pattern (the first value's signature with the
image's size left out). A value in another form (not flat, another structure, another channel
count) and the pure-Python path take ``Fused.pure``: ``__getitems__`` (misses filled), then
``augment.apply`` per sample with torch ops, then ``default_collate``.
"""

from __future__ import annotations

import copy
import itertools
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import default_collate

from .. import _native
from .._native.batch import FILL_REASONS, Spans
from ..errors import CorruptSampleError, InvalidOptionError, add_note
from . import augment as aug
from ._gather import Buffers, Layout, layout_of

if TYPE_CHECKING:
    from ..dataset import CachedDataset

__all__ = ["Fused"]

_UINT8 = 1  # the uint8 code in the format's dtype table (format/_format.py, TORCH_DTYPES)
_REASONS = {**FILL_REASONS, 6: "its image's stored shape does not match its byte count"}


def _corrupt(index: int, reason: str) -> CorruptSampleError:
    exc = CorruptSampleError(reason)
    exc.index = index  # type: ignore[attr-defined]  # read by ReadPath.read_batch
    return exc


def _item_offsets(key: bytes) -> list[int]:
    """The offset in ``key`` (signature length + signature) of each item's tag, in sample order."""
    offsets, i = [], 2
    while i < len(key):
        offsets.append(i)
        i += 1 + (2 + 8 + 8 * key[i + 2] if key[i : i + 1] == b"T" else 0)
    return offsets


class _Shape:
    """The batch form of one pattern: the output layout (for the ring) and what ``core.augment`` checks."""

    def __init__(self, layout: Layout, item: int, field: int, plan: aug.Plan) -> None:
        key = layout.key
        at = _item_offsets(key)[item]
        _, nbytes, _, shape, _ = layout.tensors[field]
        hwc = aug.is_hwc(shape, plan.layout)
        channels = shape[2] if hwc else shape[0]
        oh, ow = plan.size
        out = copy.copy(layout)
        carrier = np.dtype(np.uint8) if plan.lut is None else np.dtype(str(plan.lut.dtype).replace("torch.", ""))
        out_shape = (oh, ow, channels) if plan.channels_last else (channels, oh, ow)
        out.tensors = list(layout.tensors)
        out.tensors[field] = (0, channels * oh * ow * carrier.itemsize, carrier, out_shape, None)
        out.sample_bytes = sum(spec[1] for spec in out.tensors) + layout.scalar_size
        self.out, self.item, self.channels, self.at = out, item, channels, at
        if plan.lut is not None and plan.lut.shape[0] != channels:
            raise InvalidOptionError(f"Normalize: {plan.lut.shape[0]} means for images of {channels} channels.")
        pattern = bytearray(key)
        pattern[at + 3 : at + 35] = bytes(32)  # the image's byte count and dims: each value's own
        self.pattern = bytes(pattern)
        self.shape = (key, at, field, channels, int(hwc), int(plan.layout is None), layout.struct_size,
                      layout.value_size, nbytes, layout.scalars_at, layout.scalar_size)  # fmt: skip
        self.fields = tuple((pos, n) for pos, n, _, _, _ in layout.tensors)


class Fused:
    """One Loader's augmented batches: its plan, and the batch forms met so far."""

    def __init__(self, plan: aug.Plan) -> None:
        self.plan = plan
        self.shapes: dict[bytes, _Shape] = {}  # by pattern: the ring keeps its slots across image sizes
        self.layouts: dict[bytes, Layout] = {}  # the first value's layout, per signature
        p = plan
        kind = 0 if p.lut is None else 1 if p.lut.dtype == torch.float32 else 2
        lut = b"" if p.lut is None else p.lut.contiguous().view(torch.uint8).numpy().tobytes()
        self.params = (p.mode, p.size[0], p.size[1], p.scale[0], p.scale[1], p.log_ratio[0], p.log_ratio[1],
                       p.ratio[0], p.ratio[1], p.resize, p.resize_hw[0], p.resize_hw[1], p.rrc_at, p.flip_p,
                       p.flip_at, kind, lut, int(p.channels_last))  # fmt: skip

    def batch(self, ds: CachedDataset, ring: Any, pool: ThreadPoolExecutor, threads: int, seeds: tuple[int, int],
              indices: list[int]) -> tuple[Any, list[Buffers]]:  # fmt: skip
        """The augmented batch of ``indices`` and the ring slots it lies in."""
        indices = ds.checked_indices(indices)
        if getattr(_native.core, "augment", None) is not None:
            taken: list[Buffers] = []
            try:
                batch = ds.read_batch(indices, lambda views, checks: self.native(ring, pool, threads, seeds,
                                                                                 indices, views, taken))  # fmt: skip
            finally:
                for buffers in taken:
                    buffers.busy = False
            if type(batch) is list:
                return batch, taken
        return self.pure(ds, pool, threads, seeds, indices), []

    def _shape(self, view: Any, index: int) -> _Shape | None:
        # A value of a pattern met before (only its image's size new) takes its _Shape straight away: no Layout
        # for its signature (a decode plan, ~0.1 ms of the planner's GIL per batch). core.augment checks every
        # value, the first too, against the pattern and its own structure checksum.
        sig = bytes(view[25 : 27 + int.from_bytes(view[25:27], "little")])
        for known in self.shapes.values():
            at, pattern = known.at, known.pattern
            if len(sig) == len(pattern) and sig[: at + 3] == pattern[: at + 3] and sig[at + 35 :] == pattern[at + 35 :]:
                return known
        layout = layout_of(view, index, self.layouts)
        if layout is None:
            return None
        field = self.plan.field
        if field is None:
            field = next((k for k, (_, _, c, s, v) in enumerate(layout.tensors)
                          if len(s) == 3 and c == np.uint8 and v is None), None)  # fmt: skip
            item = layout.order.index(field) if field is not None else -1
        else:
            item = field if type(field) is int and 0 <= field < len(layout.order) else -1
            field = layout.order[item] if item >= 0 else None
        if field is None or field < 0 or item < 0:
            return None
        _, _, carrier, shape, view_dtype = layout.tensors[field]
        if len(shape) != 3 or carrier != np.uint8 or view_dtype is not None or 0 in shape:
            return None
        key = bytearray(layout.key)
        at = _item_offsets(layout.key)[item]
        key[at + 3 : at + 35] = bytes(32)
        found = self.shapes.get(bytes(key))
        if found is None:
            found = _Shape(layout, item, field, self.plan)
            if len(self.shapes) >= 16:
                self.shapes.clear()
            self.shapes[found.pattern] = found
        return found

    def native(self, ring: Any, pool: ThreadPoolExecutor, threads: int, seeds: tuple[int, int],
               indices: list[int], views: Any, taken: list[Buffers]) -> Any:  # fmt: skip
        """``read_batch``'s copy on the core: the batch, or None (the pure path then reads it)."""
        if type(views) is not Spans or not views:
            return None
        shape = self._shape(views[0], indices[0])
        if shape is None:
            return None
        n = len(views)
        buffers = ring.acquire(shape.out, n)  # a copy of the Layout with the image's output form
        taken.append(buffers)
        core = _native.core
        assert core is not None
        params = (*seeds, *self.params)

        def run(lo: int, hi: int) -> tuple[int, int]:
            status, row = core.augment(views.base, views.length, views.blob, lo, hi, shape.shape, shape.fields,
                                       buffers.flat, buffers.scalar_view, params)  # fmt: skip
            return status, row

        # The first slice runs on this thread, the others on the pool: one hand-off fewer per batch (none with
        # one thread), and this thread works instead of waiting. The pool's slices end before anything returns
        # or raises: they write into the ring slots that the caller releases.
        parts = min(threads, n)
        slices = list(itertools.pairwise([n * p // parts for p in range(parts + 1)]))
        futures: list[Future[tuple[int, int]]] = [pool.submit(run, lo, hi) for lo, hi in slices[1:]]
        try:
            first = run(*slices[0])
        finally:
            wait(futures)
        for status, row in [first, *(f.result() for f in futures)]:
            if status == 1:
                return None
            if status > 1:
                raise _corrupt(indices[row], _REASONS.get(status, f"augment status {status}"))
        out = buffers.batch(n)
        if self.plan.channels_last:
            out[shape.item] = out[shape.item].permute(0, 3, 1, 2)
        return out

    def pure(self, ds: CachedDataset, pool: ThreadPoolExecutor, threads: int, seeds: tuple[int, int],
             indices: list[int]) -> Any:  # fmt: skip
        """``__getitems__`` on the pool, each image through ``augment.apply``, then ``default_collate``."""
        parts = min(threads, len(indices))
        bounds = [len(indices) * p // parts for p in range(parts + 1)]
        futures = [pool.submit(self.samples, ds, seeds, indices[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        samples: list[Any] = []
        for f in futures:
            part, where = f.result()
            samples += part
        return self.collated(samples, where)

    def collated(self, samples: list[Any], where: Any) -> Any:
        """``default_collate`` of augmented ``samples`` (``where``: the image field), channels-last if asked."""
        batch = default_collate(samples)
        if self.plan.channels_last:
            if where is None:
                batch = batch.contiguous(memory_format=torch.channels_last)
            else:
                batch[where] = batch[where].contiguous(memory_format=torch.channels_last)
        return batch

    def _where(self, sample: Any) -> Any:
        """The key or position of the image field in ``sample`` (None: the sample is the image)."""
        field = self.plan.field
        if isinstance(sample, torch.Tensor):
            return None
        items = sample.items() if isinstance(sample, dict) else enumerate(sample)
        if field is not None:
            return field
        for k, value in items:
            if isinstance(value, torch.Tensor) and value.dim() == 3 and value.dtype == torch.uint8:
                return k
        raise InvalidOptionError(
            "augment: no 3-D uint8 tensor in the sample to augment; name the image field with augment_field=."
        )

    def samples(self, ds: CachedDataset, seeds: tuple[int, int], indices: list[int]) -> tuple[list[Any], Any]:
        """The samples of ``indices``, each image through ``augment.apply``; and where the image field is."""
        samples = ds.__getitems__(indices)
        out: list[Any] = []
        where = None
        for index, sample in zip(indices, samples):
            try:
                where = self._where(sample)
                if where is None:
                    out.append(aug.apply(self.plan, sample, seeds[0], seeds[1], index))
                    continue
                image = aug.apply(self.plan, sample[where], seeds[0], seeds[1], index)
                if isinstance(sample, dict):
                    out.append({**sample, where: image})
                else:
                    items = list(sample)
                    items[where] = image
                    out.append(type(sample)(*items) if hasattr(sample, "_fields") else type(sample)(items))
            except Exception as exc:
                add_note(exc, f"lmdbcache.Loader: raised augmenting index {index}")
                raise
        return out, where


def check(transform: Any, num_workers: int | None) -> None:
    """Refuse what the fused path cannot do (for a dataset with this per-sample ``transform``), with the fix."""
    if transform is not None:
        raise InvalidOptionError(
            "augment= runs on the stored samples, but this dataset has a per-sample transform. Drop the transform "
            "and pass its steps in augment= (the fused ones), or keep the transform and drop augment=."
        )
    if num_workers:
        raise InvalidOptionError("augment= runs on the loader's threads: leave num_workers at None or 0.")
