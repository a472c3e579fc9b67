"""One pass of a ``Loader`` over an epoch: the planner thread, the copy pool, the ring of buffers.

The planner thread walks the epoch's batches, reads each through ``Reader.read_batch`` (one
lock and read transaction per batch) and hands slices of it to the copy pool, which copies the
values straight from the map into a ring slot (``_gather``); finished batches wait in a queue
of ``prefetch`` for the consumer. Misses, values that are not flat and datasets with a
per-sample transform take the fallback: ``__getitems__`` and ``default_collate`` on the pool.
See ``loader`` for the rules the ring and the fallback keep.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import random
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash
from torch.utils.data import default_collate

from .._native.batch import Spans
from ..errors import StrayStopIterationError, add_note
from ..store._store import MISSING
from ._gather import Buffers, Layout, layout_of
from ._source import Mapped, assemble

if TYPE_CHECKING:
    from ..dataset import CachedDataset
    from ._fused import Fused

# Held while a transform runs with the global generators seeded: they are process-wide.
_RNG_LOCK = threading.Lock()


def _new_rng_lock() -> None:
    # A child forked while another thread's transform held the lock (a second loader starting fork
    # workers beside a thread pass) would inherit it held by a thread that does not exist there.
    global _RNG_LOCK
    _RNG_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_rng_lock)
_U64 = (1 << 64) - 1

__all__ = [
    "INLINE",
    "Pass",
    "Ring",
    "current_stream_event",
    "ended",
    "one_by_one",
    "stamp",
    "stray",
    "together",
]

# A batch smaller than this is copied by the planner thread itself: its per-sample work holds
# the GIL anyway, and the hand-off to the pool cost more than it saved (3x32x32, batch 64:
# 331k -> 365k samples/s on one thread, 259k -> 415k on two; bench/loader.py).
INLINE = 1 << 20


class Ring:
    """Batch buffers reused only when no handed-out tensor of theirs is alive (see the module docstring)."""

    def __init__(self, slots: int, rows: int, memory: str = "plain") -> None:
        self.slots, self.rows, self.memory = slots, rows, memory
        self.buffers: list[Buffers] = []
        self.lock = threading.Lock()

    def acquire(self, layout: Layout, rows: int) -> Buffers:
        with self.lock:
            kept = [b for b in self.buffers if b.layout is layout and b.rows >= rows and not b.moved]
            if len(kept) != len(self.buffers):
                self.buffers = kept  # another layout or size: the old slots go when their batches do
            buffers = next((b for b in kept if b.free()), None)
            if buffers is None and len(kept) >= self.slots:
                # Slots held only by the device's copies complete soon: wait, do not allocate.
                waiting = next((b for b in kept if b.unused()), None)
                if waiting is not None:
                    _wait(waiting.event)
                    buffers = waiting
            if buffers is None:
                buffers = layout.allocate(max(rows, self.rows), self.memory)
                if len(kept) < self.slots:
                    self.buffers.append(buffers)
            buffers.busy, buffers.event = True, None
            return buffers


def pin_batch(batch: Any) -> Any:
    """``batch`` with every tensor in it copied to pinned memory (``Tensor.pin_memory``), its structure kept.

    What torch's private ``_utils.pin_memory.pin_memory`` does to ``default_collate``'s output
    (tensors in lists, tuples, named tuples and dicts; other leaves as they are), through public calls.
    """
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {key: pin_batch(value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple keeps its type
        return type(batch)(*(pin_batch(item) for item in batch))
    if isinstance(batch, tuple):
        return tuple(pin_batch(item) for item in batch)
    if isinstance(batch, list):
        return [pin_batch(item) for item in batch]
    return batch


def _wait(event: Any) -> None:
    """Block until ``event`` (a CUDA event, or any object with query() and maybe synchronize()) completes."""
    synchronize = getattr(event, "synchronize", None)
    if synchronize is not None:
        synchronize()
    while not event.query():
        threading.Event().wait(0.0005)


class _Finished:
    """A pass's finished batches, at most ``size`` waiting for the consumer: two C-level ``SimpleQueue``s (the
    batches, and a token per free place), so no Python-level lock wrapper runs in the consumer's thread. A Ctrl-C
    inside ``queue.Queue``'s (a ``Condition.__enter__``) left its lock held, and ``stop``'s drain hung on it
    (tests/test_interrupts.py)."""

    def __init__(self, size: int) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(size):
            self.room.put(None)

    def put(self, item: Any, timeout: float) -> bool:
        """Queue ``item`` once a place is free within ``timeout`` seconds (False: none was)."""
        try:
            self.room.get(timeout=timeout)
        except queue.Empty:
            return False
        self.items.put(item)
        return True

    def get(self, timeout: float | None = None) -> Any:
        """The next batch (``queue.Empty`` after ``timeout`` seconds); its place is free again."""
        item = self.items.get(timeout=timeout)
        self.room.put(None)
        return item

    def get_nowait(self) -> Any:
        item = self.items.get_nowait()
        self.room.put(None)
        return item

    def empty(self) -> bool:
        return self.items.empty()


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """What a pass (threads here, or ``_workers.WorkerPass``) needs from its Loader, handed over when it starts.

    The loader owns the ring of batch buffers and the batch form of each signature met; a pass
    only uses them. Never the Loader itself: a pass does not reach into its owner's state.
    """

    dataset: CachedDataset | Mapped
    num_threads: int
    prefetch: int
    pin_memory: bool
    batch_transform: Callable[[Any], Any] | None
    seed: int
    seed_transforms: bool
    ring: Ring
    layouts: dict[bytes, Layout]
    worker_processes: int = 0
    multiprocessing_context: Any = None
    fused: Fused | None = None  # ``augment=``: the image field augmented on its way into the batch
    own_order: bool = False  # the batches are the Loader's own order: ints in range, not checked again per batch


class Pass:
    """One pass: the planner thread, the copy pool and the queue of finished batches."""

    def __init__(
        self, spec: PassSpec, epoch: int, batches: Sequence[list[int]], start: int, held: bool = False
    ) -> None:
        self.spec, self.epoch, self.batches, self.start = spec, epoch, batches, start
        self.ds = spec.dataset
        self.out = _Finished(spec.prefetch)
        self.stopping = threading.Event()
        self.go = threading.Event()  # held (``Spare``): the planner builds the first batch, then waits for it
        if not held:
            self.go.set()
        self.replaced = False  # set by the Loader when a newer pass of it starts (see ``ended``)
        self.key: tuple[Any, ...] = ()  # ``Spare``: what the Loader made ``batches`` of
        self.small, self.built = True, 0  # every batch built so far was copied from the map under INLINE bytes
        self.last: Layout | None = None  # the layout of the last small batch the compiled core located
        self.threads: set[int] = set()  # the pool's threads (see ``stop``)
        self.pool = ThreadPoolExecutor(spec.num_threads, "lmdbcache-copy", _note_thread, (self.threads,))
        self.owner: Any = None  # ``Spare``: the pass that started this one ahead; held: its owner begins it
        if not held:
            self._begin()

    def _begin(self) -> None:
        self.planner = threading.Thread(target=self._plan, name="lmdbcache-planner", daemon=True)
        self.planner.start()

    def get(self) -> Any:
        while True:
            if self.stopping.is_set():  # a batch the planner put while stop() drained is not this pass's to give
                return ended(self.replaced)
            try:
                return self.out.get(timeout=0.1)
            except queue.Empty:
                if not self.planner.is_alive() and self.out.empty():
                    if self.stopping.is_set():  # close(), or a newer pass: this one ends here
                        return ended(self.replaced)
                    return RuntimeError("lmdbcache.Loader: the planner thread ended without a batch")

    def stop(self) -> None:
        self.stopping.set()
        self.go.set()  # a held planner wakes to see it
        # Held and never begun (Spare.start): no thread to join; or on one of its own threads: they end on their
        # own, stopping is set.
        if not hasattr(self, "planner") or self._inside():
            self.pool.shutdown(wait=False, cancel_futures=True)
            return
        while self.planner.is_alive():
            try:
                while True:
                    self.out.get_nowait()  # unblock a planner waiting to put
            except queue.Empty:
                pass
            self.planner.join(0.05)
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _inside(self) -> bool:
        """Called on one of this pass's own threads, which cannot join themselves: the Loader's collection (and
        so ``stop``) can run on any thread, its pass ahead's planner included, when it sits in a reference cycle."""
        me = threading.current_thread()
        return me is getattr(self, "planner", None) or me.ident in self.threads

    def _put(self, item: Any) -> bool:
        while not self.stopping.is_set():
            if self.out.put(item, timeout=0.1):
                return True
        return False

    def _plan(self) -> None:
        for k in range(self.start, len(self.batches)):
            if self.stopping.is_set():
                return
            item = self._build(k)
            if not self._put(item) or isinstance(item, BaseException):
                return
            del item
            while not self.go.wait(0.1):  # a pass started ahead builds one batch until it is taken
                if self.stopping.is_set():
                    return

    def _build(self, k: int) -> Any:
        """Batch ``k`` and its ring slots, or the exception that building it raised (noted with where)."""
        indices = self.batches[k]
        self.built += 1
        try:
            batch, slots = self._gather(indices)
            if batch is None:
                self.small = False
                batch = self._fallback(indices)
                if self.spec.pin_memory:
                    batch = pin_batch(batch)  # per batch: fallback only
            transform = self.spec.batch_transform
            if transform is not None:
                try:
                    batch = transform(batch)
                except StopIteration as exc:
                    raise stray(exc, f"batch_transform on batch {k} of epoch {self.epoch}") from exc
        except BaseException as exc:  # re-raised in the consumer
            add_note(exc, f"lmdbcache.Loader: raised loading batch {k} of epoch {self.epoch} (indices {indices})")
            return exc
        return batch, slots

    def _gather(self, indices: list[int]) -> tuple[Any, list[Buffers]]:
        """The batch copied from the map (None when it must take the fallback path) and its ring slots."""
        ds, spec = self.ds, self.spec
        if not isinstance(ds, Mapped):
            return self._copied(ds, indices, spec.seed, spec.own_order, spec.pin_memory)
        if spec.fused is None and ds.transform is not None:
            return None, []
        parts = ds.split(ds.checked_indices(indices), spec.seed)  # a Subset / ConcatDataset: its caches' indices
        if len(parts) == 1:
            return self._copied(parts[0].ds, parts[0].indices, parts[0].seed, True, spec.pin_memory)
        batches = []
        for part in parts:  # one after the other: each takes the pool's threads, and a ring slot until merged
            batch, _ = self._copied(part.ds, part.indices, part.seed, True, False)
            if batch is None:
                return None, []  # the fallback reads the whole batch through the wrapper
            batches.append(batch)
        return assemble(parts, batches, len(indices), spec.pin_memory, spec.fused, self.epoch), []

    def _copied(
        self, ds: CachedDataset, indices: list[int], seed: int, checked: bool, pin: bool
    ) -> tuple[Any, list[Buffers]]:
        """``_gather`` of the batch ``indices`` of the one cache ``ds`` (``seed``: its augmentation seed)."""
        spec = self.spec
        if spec.fused is not None:
            batch, slots = spec.fused.batch(ds, spec.ring, self.pool, spec.num_threads, (seed, self.epoch), indices)
            return (pin_batch(batch) if pin and not slots else batch), slots  # the torch path's batch
        if ds.transform is not None:
            return None, []
        if not checked:
            indices = ds.checked_indices(indices)  # a sampler may give numpy or negative indices, or bad ones
        last = self.last
        if last is not None and last.sample_bytes * len(indices) < INLINE:  # the compiled core's one call
            buffers = spec.ring.acquire(last, len(indices))
            try:
                if ds.fill_batch(indices, last.native_plan, buffers.flat, buffers.scalar_view):
                    return buffers.batch(len(indices)), [buffers]
                self.last = None  # not all of that layout, or something to say: the path below reads it
            finally:
                buffers.busy = False
        taken: list[Buffers] = []

        def copy(views: Any, checks: Any) -> Any:  # lists, or the core's Spans and Checks
            layout = layout_of(views[0], indices[0], spec.layouts)
            if layout is None:
                return None
            buffers = spec.ring.acquire(layout, len(views))
            taken.append(buffers)
            n, parts = len(views), min(spec.num_threads, len(views))
            if layout.sample_bytes * n < INLINE:
                if not buffers.fill(views, checks, indices, 0, n):
                    return None
                if type(views) is Spans:  # located by the core: the next batch takes its one call (above)
                    self.last = layout
                return buffers.batch(n)
            self.small = False
            bounds = [n * p // parts for p in range(parts + 1)]
            futures: list[Future[bool]] = [
                self.pool.submit(buffers.fill, views, checks, indices, lo, hi) for lo, hi in itertools.pairwise(bounds)
            ]
            wait(futures)  # every copy ends before the lock is released, even when one of them fails
            if not all([f.result() for f in futures]):
                return None
            return buffers.batch(n)

        try:
            batch = ds.read_batch(indices, copy)
        finally:
            for buffers in taken:
                buffers.busy = False  # from now on only the batch's tensors hold it (_gather.Buffers)
        return (None, []) if batch is MISSING or batch is None else (batch, taken)

    def _fallback(self, indices: list[int]) -> Any:
        """Through ``CachedDataset.__getitems__`` (or per index with a transform) on the copy threads."""
        ds, parts = self.ds, min(self.spec.num_threads, len(indices))
        bounds = [len(indices) * p // parts for p in range(parts + 1)]
        if ds.transform is None:
            futures = [self.pool.submit(together, ds, indices[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        else:
            seeds = (self.spec.seed, self.epoch) if self.spec.seed_transforms else None
            futures = [self.pool.submit(one_by_one, ds, indices[lo:hi], seeds) for lo, hi in itertools.pairwise(bounds)]
        samples: list[Any] = []
        for f in futures:
            samples += f.result()
        return default_collate(samples)


class InlinePass(Pass):
    """A pass whose batches the consumer's own thread builds when it asks: no planner, no hand-off.

    For batches copied from the map under ``INLINE`` bytes the planner thread only moved the work: its
    copy holds the GIL anyway, and handing each finished batch to the consumer (a thread wake-up and a
    GIL hand-over) cost about as much as building it (3x32x32, batch 64: 1.14M samples/s through the
    planner, 1.81M built in the consumer; np.take of the same rows 1.64M). The Loader picks this pass
    when the previous pass of the same Loader saw only such batches (``small``); a batch that turns
    out otherwise is still built here, correctly, and the next pass goes back to the planner.
    """

    def _begin(self) -> None:
        self.next = self.start  # no planner: get() builds batch ``next``

    def get(self) -> Any:
        if self.stopping.is_set():
            return ended(self.replaced)
        k, self.next = self.next, self.next + 1
        return self._build(k)

    def stop(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=not self._inside(), cancel_futures=True)


def _note_thread(threads: set[int]) -> None:
    threads.add(threading.get_ident())


def ended(replaced: bool) -> RuntimeError:
    """Why a pass stopped under its consumer: a newer pass of the same Loader replaced it, or close()."""
    if replaced:
        return RuntimeError(
            "lmdbcache.Loader: this pass was replaced by a newer pass of the same Loader: iter(loader) was called "
            "again while it ran (a loop over the loader inside a loop over it, or next(iter(loader))), and a Loader "
            "runs one pass at a time, at its own position. Use a second Loader (the same arguments) for the inner "
            "loop."
        )
    return RuntimeError("lmdbcache.Loader was closed while this pass was running.")


def stray(exc: StopIteration, where: str) -> StrayStopIterationError:
    """A ``StopIteration`` from user code at ``where``, as an error that neither ends the consumer's loop nor
    becomes a bare "generator raised StopIteration" (PEP 479); ``exc`` is its cause."""
    error = StrayStopIterationError(
        f"lmdbcache.Loader: {where} raised StopIteration ({exc!r}). Inside a pass it would end the consumer's "
        "loop early or become 'generator raised StopIteration', so it is raised as this error (the original is "
        "its __cause__). Raise another exception there: StopIteration means 'no more items' to every for loop."
    )
    error.__cause__, error.__suppress_context__ = exc, True
    return error


def current_stream_event() -> Any:
    return torch.cuda.current_stream().record_event()


def stamp(slots: list[Buffers], event: Any) -> None:
    for buffers in slots:
        buffers.event = event


def together(ds: CachedDataset | Mapped, indices: list[int]) -> list[Any]:
    try:
        return ds.__getitems__(indices)
    except StopIteration as exc:  # from the source dataset, filling a miss
        raise stray(exc, f"the dataset reading indices {indices}") from exc


def one_by_one(ds: CachedDataset | Mapped, indices: list[int], seeds: tuple[int, int] | None = None) -> list[Any]:
    out = []
    for index in indices:
        try:
            if seeds is None:
                out.append(ds[index])
            else:
                with _seeded(*seeds, index):
                    out.append(ds[index])
        except StopIteration as exc:
            raise stray(exc, f"the dataset (or its transform) at index {index}") from exc
        except Exception as exc:
            add_note(exc, f"lmdbcache.Loader: raised by the dataset (or its transform) at index {index}")
            raise
    return out


@contextmanager
def _seeded(seed: int, epoch: int, index: int) -> Iterator[None]:
    """The global torch (CPU), numpy and random generators seeded from (seed, epoch, index), restored after."""
    value = xxhash.xxh3_64_intdigest(struct.pack("<QQQ", seed & _U64, epoch & _U64, index & _U64))
    with _RNG_LOCK:
        saved = torch.default_generator.get_state(), np.random.get_state(), random.getstate()
        torch.default_generator.manual_seed(value)
        np.random.seed(value & 0xFFFFFFFF)
        random.seed(value)
        try:
            yield
        finally:
            torch.default_generator.set_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])
