"""``Loader``: batches of a ``CachedDataset`` copied straight out of the map, on threads, in DataLoader's order.

Threads. One planner thread turns the epoch's order into batches of indices, looks each
batch up in one read transaction under the store's lock (``Reader.read_batch``) and hands
whole slices of the batch to a pool of ``num_threads`` copy threads; each copies its values
straight into the batch tensors (``_gather``: large copies release the GIL). A batch under
1 MiB is copied by the planner itself (``INLINE``: its copies are GIL-bound anyway). Up to
``prefetch`` finished batches wait in a queue. The threads live for one pass: a pass that
ends (exhausted, ``break``, an exception, KeyboardInterrupt, ``close()``) joins them. One
exception: when an ``augment=`` loader (its own order) hands out an epoch's last batch, the next
epoch's pass starts and builds that epoch's first batch (``_spare.Spare``); it lives on only if
the epoch then ends normally, until the next ``iter`` takes it or ``close()``, ``set_epoch`` to
another epoch, ``load_state_dict`` to another position or the Loader's collection stops it
(docs/guarantees.md). When a
pass saw only such small batches copied from the map, the Loader's next pass has no planner:
the consumer's own thread builds each batch when it asks (``_pass.InlinePass``), because
handing a small batch from thread to thread cost about as much as building it.

Buffers. Batch tensors come from a ring of ``prefetch + 3`` slots per sample layout: the
``prefetch`` queued batches, the one being filled, the one the consumer's loop variable
still holds while it asks for the next, and the one being handed over. A slot
is reused only when the reference counts of its arrays are back where they were when it was
allocated: no tensor handed out from it, nor any view, numpy array or storage of one, is
alive (``_gather.Buffers``: each batch tensor is ``torch.from_numpy`` of a slot array). A
batch a user keeps therefore never changes under them (a fresh slot is allocated instead).

Pinned memory (``pin_memory=True``). With CUDA the ring's tensors are allocated pinned, once
per slot, never per batch; the copy threads write straight into them, so there is no pin
thread. A pinned slot is reused only when, besides those counts, an event recorded when
the consumer asked for the next batch has completed: by default an event on the consumer's
current CUDA stream, so a ``non_blocking`` host-to-device copy of the previous batch issued
on that stream has finished reading it (copies on another stream: pass ``record_event``).
When every slot waits only on its event, the planner waits for the oldest one rather than
allocate. Without CUDA, ``pin_memory=True`` warns (as DataLoader does) and is ignored.
Fallback batches (below) are pinned per batch, as DataLoader's pin thread does.

Fallback. A batch with a miss (cache incomplete), a value not in the codec's flat form
(dicts, lists, PIL images, ...) or samples of different signatures (variable shapes) is read
through ``CachedDataset.__getitems__`` on the copy threads and collated with
``default_collate``: the same batch as the DataLoader's, misses filled into the cache. A
dataset with a per-sample ``transform`` always takes this path (the transform runs on the
copy threads, under the GIL unless it releases it); the exception of a failing transform is
re-raised in the consumer with a note naming the index.

Random state of transforms (``seed_transforms=True``, the default). Before the transform of
index ``i`` runs, the global generators of torch (CPU), numpy and ``random`` are seeded from
a hash of (seed, epoch, i), and restored after it: a random augmentation gives the same
result whatever the number of threads or their scheduling. The generators are process-wide,
so the transforms run one at a time under a lock (a transform that releases the GIL no
longer overlaps with another), and a draw the training thread makes from a global generator
while a transform runs sees the transform's state: seed your training code's randomness
through explicit ``torch.Generator`` objects, or pass ``seed_transforms=False`` (transforms
then run concurrently, with whatever state the generators hold). Generators a transform
owns (``torch.Generator``, ``np.random.Generator``) are not touched. Transforms that hold
the GIL for long (PIL, pure Python) get no parallelism on threads.

Worker processes (``num_workers``). So by default (``num_workers=None``) a dataset with a
per-sample ``transform`` is loaded on ``num_threads`` worker processes instead (``_workers``:
a DataLoader per pass over the loader's own batches, each index seeded as on the threads, so
the batches are equal whichever path runs): a 0.5 ms pure-Python transform measured 1.2-1.7x
faster on 2 processes than on the threads, 3x64x64 and 3x224x224 (``bench/transform.py``). A
transform that releases the GIL and costs little next to the batch copy (a tensor flip on
3x224x224) was 0.75-0.9x there: pass ``num_workers=0`` to keep it on the threads. Without a
transform, ``num_workers=None`` means the threads, which read warm data fastest;
``num_workers=N`` forces processes (``lmdbcache.collate``'s one-copy path), e.g. to decode the
misses of a first epoch on N cores. The workers live for one pass (a fork per worker per
epoch; ``multiprocessing_context`` as in DataLoader).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DistributedSampler, Subset

from ..errors import InvalidOptionError, warn
from ..store import redeliver_dropped_interrupts
from ._fused import Fused
from ._fused import check as check_fused
from ._gather import Layout
from ._order import Batches, epoch_of, rows, world_of
from ._pass import InlinePass, Pass, PassSpec, Ring, current_stream_event, stamp
from ._resume import check_settings, position_in
from ._source import source_of
from ._spare import Spare
from ._workers import WorkerPass
from .augment import compile_plan

if TYPE_CHECKING:
    from ..dataset import CachedDataset

__all__ = ["Loader"]


def _check_options(
    batch_size: int | None,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    num_threads: int,
    prefetch: int,
    sampler: Iterable[int] | None,
    batch_sampler: Iterable[list[int]] | None,
) -> int:
    """Refuse what DataLoader refuses, and out-of-range numbers; return the batch size to allocate for."""
    if batch_sampler is not None:
        if batch_size not in (None, 1) or shuffle or sampler is not None or drop_last:
            raise InvalidOptionError(
                "batch_sampler is mutually exclusive with batch_size, shuffle, sampler and drop_last (as in "
                "DataLoader): leave them at their defaults."
            )
        batch_size = 1  # the ring's rows grow to the largest batch
    elif sampler is not None and shuffle:
        raise InvalidOptionError("sampler is mutually exclusive with shuffle (as in DataLoader).")
    if batch_size is None:
        raise InvalidOptionError("batch_size must be an int >= 1 (None only with a batch_sampler).")
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("num_threads", num_threads, 1),
        ("prefetch", prefetch, 1),
    ):
        if type(value) is not int or value < low:
            raise InvalidOptionError(f"{name} must be an int >= {low}, not {value!r}.")
    if type(seed) is not int:
        raise InvalidOptionError(f"seed must be an int, not {seed!r}.")
    return batch_size


class Loader:
    """Batches of ``dataset`` equal to ``DataLoader(dataset, batch_size, shuffle=shuffle, drop_last=drop_last,
    generator=torch.Generator().manual_seed(seed + epoch), collate_fn=default_collate)``.

    In distributed mode (``rank`` and ``world_size`` given, else taken from an initialized
    torch.distributed, else from the torchrun env ``RANK`` / ``WORLD_SIZE``) each rank gets
    the indices of ``DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed)``
    after ``set_epoch(epoch)``. The order is a pure function of (seed, epoch, rank, world size).

    ``sampler`` (an iterable of indices, exclusive with ``shuffle``) or ``batch_sampler`` (an
    iterable of index lists, exclusive with ``batch_size``, ``shuffle``, ``sampler`` and
    ``drop_last``) replace that order as in DataLoader; distributed mode is then the
    sampler's business. Before each pass, the sampler's ``set_epoch(epoch)`` is called if it
    has one (for a ``BatchSampler``, its sampler's); resume assumes it then gives the same
    order for the same epoch.

    Epochs and position. The loader keeps a position (epoch, batches delivered). Each pass
    (``for batch in loader``) continues from it: a complete pass moves to the next epoch, so
    iterating without ``set_epoch`` advances the epoch every pass; a pass ended early
    (``break``) leaves the position after the last batch the consumer received, and the next
    pass continues there. ``set_epoch(e)`` moves to the start of epoch ``e``, except right after
    ``load_state_dict`` of a state of epoch ``e``: it then keeps the loaded position, so the
    usual loop (``for epoch in range(start, n): loader.set_epoch(epoch)``) resumes mid-epoch
    (a state saved after the epoch's last batch makes that epoch's pass empty).
    ``state_dict()`` is that position; ``load_state_dict()`` restores it without reading the
    batches before it. A batch counts as delivered when the consumer receives it, not when it
    is prefetched. One pass runs at a time: ``iter(loader)`` during a pass (a loop over the
    loader inside a loop over it) starts a new pass at the position and ends the old one, whose
    consumer is told so at its next batch (a second Loader serves a nested loop).

    ``dataset``: a ``CachedDataset``, or torch ``Subset`` / ``ConcatDataset`` wrappers of them, mapped onto the
    caches underneath and copied from their maps as a plain cache is (``_source``).

    ``batch_transform`` runs on the planner thread on every whole batch. See the module
    docstring for threads, buffer reuse, pinned memory (``pin_memory``; ``record_event``: a
    callable run in the consumer's thread each time it asks for the next batch, returning an
    event with ``query()``; the previous batch's slot is reused only once it is done) and
    the fallback path (misses, non-flat samples, per-sample ``transform``).

    ``num_workers``: None (default) runs the batches of a dataset with a per-sample
    ``transform`` on ``num_threads`` worker processes and everything else on the threads; 0
    always uses the threads, N >= 1 always N processes (``multiprocessing_context`` as in
    DataLoader). See "Worker processes" in the module docstring for when each is faster.

    ``augment``: a list of ``lmdbcache.augment`` transforms (``RandomResizedCrop``,
    ``RandomHorizontalFlip``, ``CenterCrop``, ``Resize``, ``Normalize``) applied to the image field
    (``augment_field``: its position in the sample, or key of a dict sample; by default the first 3-D
    uint8 tensor, CHW or HWC as stored: ``image_layout`` "CHW" or "HWC", or None to take HWC where the last
    dimension is <= 4 and the first is not) inside the batch copy, on the compiled core in C; the
    parameters of sample i in epoch e depend only on (seed, e, i). The image batch is (B, C, H, W),
    uint8 or Normalize's dtype, in channels-last memory with ``channels_last=True``. See
    ``lmdbcache.augment``.
    """

    def __init__(
        self,
        dataset: CachedDataset | Subset[Any] | ConcatDataset[Any],
        batch_size: int | None = 1,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        num_threads: int = 2,
        prefetch: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        batch_transform: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        record_event: Callable[[], Any] | None = None,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[list[int]] | None = None,
        seed_transforms: bool = True,
        num_workers: int | None = None,
        multiprocessing_context: Any = None,
        augment: Sequence[Any] | None = None,
        augment_field: int | str | None = None,
        channels_last: bool = False,
        image_layout: str | None = None,
    ) -> None:
        batch_size = _check_options(batch_size, shuffle, seed, drop_last, num_threads, prefetch, sampler, batch_sampler)
        if num_workers is not None and (type(num_workers) is not int or num_workers < 0):
            raise InvalidOptionError(f"num_workers must be None (automatic) or an int >= 0, not {num_workers!r}.")
        self.num_workers, self.multiprocessing_context = num_workers, multiprocessing_context
        self._source = source_of(dataset)  # the dataset, or a Subset / ConcatDataset mapped onto its caches
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, bool(shuffle), seed
        self.drop_last, self.num_threads, self.prefetch = bool(drop_last), num_threads, prefetch
        self.batch_transform = batch_transform
        self.sampler, self.batch_sampler, self.seed_transforms = sampler, batch_sampler, bool(seed_transforms)
        custom = sampler is not None or batch_sampler is not None
        self.world = None if custom and rank is None else world_of(rank, world_size)
        if custom and self.world is not None:
            raise InvalidOptionError("With a sampler or batch_sampler, split the data across ranks in the sampler.")
        self.epoch, self.delivered, self.samples = 0, 0, 0  # samples: in the batches delivered this epoch
        self._loaded: tuple[int, int, int] | None = None  # a loaded state's (epoch, batches, samples) until a pass
        self._emptied = False  # set_epoch kept a loaded state's finished epoch: the next pass is empty
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warn("lmdbcache.Loader: pin_memory=True but CUDA is not available; batches are not pinned.")
        if record_event is None and self.pin_memory:
            record_event = current_stream_event
        self.record_event = record_event
        memory = "pinned" if self.pin_memory else "plain"
        self._ring = Ring(prefetch + 3, batch_size, memory)  # see the module docstring
        self._layouts: dict[bytes, Layout] = {}
        self._pass: Pass | WorkerPass | None = None
        self._spare = Spare()  # the next epoch's pass, started early (augment=; see _spare.Spare)
        weakref.finalize(self, self._spare.stop)
        self._small = False  # the last pass saw only batches copied from the map under _pass.INLINE bytes
        self._closed = False
        self._fused = None
        if augment is not None:
            check_fused(self._source.transform, num_workers)
            self._fused = Fused(compile_plan(augment, augment_field, channels_last, image_layout))

    # ------------------------------------------------------------------ order and position

    def order(self, epoch: int) -> list[int]:
        """This rank's indices for ``epoch``, in order."""
        return self._order(epoch).tolist()  # type: ignore[no-any-return]

    def _order(self, epoch: int) -> np.ndarray:
        """``order(epoch)`` as an array (``Batches`` slices it per batch): int64, or Python ints from a sampler."""
        n = len(self.dataset)
        if self.sampler is not None:  # checked per batch (PassSpec.own_order): kept as the sampler gave them
            return np.array([int(i) for i in epoch_of(self.sampler, epoch)], object)
        if self.world is not None:
            rank, world_size = self.world
            sampler: DistributedSampler[int] = DistributedSampler(
                range(n),  # type: ignore[arg-type]  # it needs a length only
                num_replicas=world_size,
                rank=rank,
                shuffle=self.shuffle,
                seed=self.seed,
            )
            sampler.set_epoch(epoch)
            return np.array(list(sampler), np.int64)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        g = torch.Generator().manual_seed(self.seed + epoch)
        torch.empty((), dtype=torch.int64).random_(generator=g)  # the DataLoader iterator's base seed comes first
        return torch.randperm(n, generator=g).numpy()

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of indices for ``epoch``."""
        return list(self._sequence(epoch))

    def _sequence(self, epoch: int) -> Sequence[list[int]]:
        """``batches(epoch)``, each batch made when asked for (``Batches``) unless a batch_sampler gives them."""
        if self.batch_sampler is not None:
            batches = [[int(i) for i in b] for b in epoch_of(self.batch_sampler, epoch)]
            empty = next((k for k, b in enumerate(batches) if not b), None)
            if empty is not None:  # DataLoader fails on it with default_collate's bare IndexError
                raise InvalidOptionError(
                    f"lmdbcache.Loader: batch {empty} of epoch {epoch} from the batch_sampler is empty. A batch "
                    "needs at least one index (DataLoader fails on it too: default_collate cannot collate an empty "
                    "list). Make the batch_sampler leave empty batches out."
                )
            return batches
        return Batches(self._order(epoch), self.batch_size, self.drop_last)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        if self.sampler is not None:
            n = len(self.sampler)  # type: ignore[arg-type]
        else:
            n = len(self._order(0)) if self.world is not None else len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at the first batch of ``epoch`` (at a just-loaded state's position if of ``epoch``)."""
        if type(epoch) is not int or epoch < 0:
            raise InvalidOptionError(f"epoch must be an int >= 0, not {epoch!r}.")
        loaded, self._emptied = self._loaded, False
        if loaded is not None and loaded[0] == epoch:
            self.epoch, self.delivered, self.samples = loaded
            self._emptied = self.delivered >= len(self)  # the state's epoch was over: its pass yields nothing
            self._spare.keep(epoch + 1 if self._emptied else epoch)
            return
        self._loaded = None
        self.epoch, self.delivered, self.samples = epoch, 0, 0
        self._spare.keep(epoch)  # a pass started ahead for another epoch stops now, not at the next iter

    def state_dict(self) -> dict[str, Any]:
        """The position: {seed, epoch, batches} (the batches of ``epoch`` the consumer has received), ``samples``
        in them, and what it means: batch_size, shuffle, drop_last, rank, world_size, sampler, dataset_length."""
        rank, world_size = self.world if self.world is not None else (None, None)
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "batches": self.delivered,
            "samples": self.samples,
            **self._order_kind(),
            "rank": rank,
            "world_size": world_size,
            "dataset_length": len(self.dataset),
        }

    def _order_kind(self) -> dict[str, Any]:
        """What, besides seed and epoch, decides which samples the first k batches of an epoch hold."""
        kind = "batch_sampler" if self.batch_sampler is not None else "sampler" if self.sampler is not None else None
        return {
            "sampler": kind or "default",
            "batch_size": None if kind == "batch_sampler" else self.batch_size,  # the batch_sampler's own
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the batch after ``state``'s (the next epoch's first if it was the last); nothing is read.
        A ``set_epoch`` of the state's epoch before the next pass keeps this position (the resume loop).

        A state saved with another seed, shuffle, drop_last, rank, world_size, kind of sampler or dataset
        length, or at a position past the end of its epoch here, is refused (its batches would be other
        samples here). Another batch_size is converted exactly, by the samples received, when they fill
        whole batches of this one; otherwise it is refused. A state without these fields (from an earlier
        lmdbcache) is taken as it is.
        """
        try:
            seed, epoch, delivered = state["seed"], state["epoch"], state["batches"]
        except (KeyError, TypeError):
            raise InvalidOptionError(f"A Loader state is a dict with seed, epoch and batches, not {state!r}.") from None
        if not all(type(v) is int for v in (seed, epoch, delivered)) or epoch < 0 or delivered < 0:
            raise InvalidOptionError(f"A Loader state holds ints (epoch, batches >= 0), not {state!r}.")
        rank, world_size = self.world if self.world is not None else (None, None)
        mine = {"seed": self.seed, **self._order_kind(), "rank": rank, "world_size": world_size}
        check_settings(state, mine, len(self.dataset), epoch, delivered)
        total = (lambda: None) if self.batch_sampler is not None else (lambda: len(self._order(epoch)))
        delivered, samples = position_in(state, epoch, delivered, mine["batch_size"], len(self), total)
        self.epoch, self.delivered, self.samples = epoch, delivered, samples
        self._loaded, self._emptied = (epoch, delivered, samples), False
        if delivered >= len(self):
            self.epoch, self.delivered, self.samples = epoch + 1, 0, 0
        if self.delivered:  # a pass ahead can never be taken there: stop it now
            self._spare.stop()
        else:
            self._spare.keep(self.epoch)

    # ------------------------------------------------------------------ passes

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise InvalidOptionError("This Loader is closed.")
        redeliver_dropped_interrupts()  # a Ctrl-C landing where an object dies stops the loop too
        if self._pass is not None:  # one pass at a time: a new iter replaces an abandoned (or running) one
            self._pass.replaced = True  # its consumer, if it asks again, is told why (``_pass.ended``)
            self._pass.stop()
        epoch, emptied, self._loaded, self._emptied = self.epoch, self._emptied, None, False
        if emptied:  # set_epoch kept a loaded state at this epoch's end: an empty pass, which completes the epoch
            self.epoch, self.delivered, self.samples = epoch + 1, 0, 0
            return iter(())
        batches = self._batches(epoch)[0]
        if self.delivered >= len(batches) > 0:
            epoch, self.epoch, self.delivered, self.samples = epoch + 1, epoch + 1, 0, 0
            batches = self._batches(epoch)[0]
        return self._run(epoch, batches, self.delivered)

    def _batches(self, epoch: int) -> tuple[Sequence[list[int]], tuple[Any, ...]]:
        """``batches(epoch)`` and what they are made of: the pass ahead's list is reused when it is the same (an
        ImageNet order takes 0.15 s to build and 0.05 s to compare; _spare.Spare)."""
        key = (epoch, self.seed, self.world, len(self.dataset), *self._order_kind().values())
        return self._spare.batches(key) or self._sequence(epoch), key

    @property
    def worker_processes(self) -> int:
        """How many worker processes build the batches (0: the thread path). See ``num_workers``."""
        if self.num_workers is not None:
            return self.num_workers
        return self.num_threads if self._source.transform is not None else 0

    def _spec(self) -> PassSpec:
        """What the next pass needs from this loader (see ``_pass.PassSpec``)."""
        return PassSpec(
            self._source, self.num_threads, self.prefetch, self.pin_memory, self.batch_transform, self.seed,
            self.seed_transforms, self._ring, self._layouts, self.worker_processes, self.multiprocessing_context,
            self._fused, self.sampler is None and self.batch_sampler is None,
        )  # fmt: skip

    def _run(self, epoch: int, batches: Sequence[list[int]], start: int) -> Iterator[Any]:
        kind: type[Pass] | type[WorkerPass] = Pass
        if self.worker_processes:
            kind = WorkerPass
        elif self._small and self._fused is None and self._source.transform is None:
            kind = InlinePass  # the last pass's batches were all small copies: build them here (see InlinePass)
        spare = self._spare.take(self._spec(), epoch, batches, start if kind is Pass else -1)  # if it fits exactly
        run: Pass | WorkerPass = spare or kind(self._spec(), epoch, batches, start)
        ahead = kind is Pass and self._fused is not None and self.sampler is None and self.batch_sampler is None
        self._pass, done = run, False
        record, slots = self.record_event, []
        try:
            for k in range(start, len(batches)):
                item = run.get()
                if isinstance(item, BaseException):
                    raise item
                batch, slots = item
                del item
                self.delivered, self.samples = k + 1, self.samples + rows(batches, k)
                if ahead and k == len(batches) - 1:  # the order of epoch + 1 is the loader's own: start it
                    self._spare.start(run, self._spec(), epoch + 1, *self._batches(epoch + 1))
                yield batch
                # The consumer asks for the next batch: its device copies of this one are queued.
                if record is not None and slots:
                    stamp(slots, record())
                del batch
            self.epoch, self.delivered, self.samples, done = epoch + 1, 0, 0, True
        finally:
            if record is not None and slots and slots[0].event is None:
                stamp(slots, record())  # the last batch (or the one a break left): same rule
            run.stop()
            if ahead and not done:  # a break, an exception or the collection at the last batch
                self._spare.stop(owner=run)
            self._small = isinstance(run, Pass) and run.small and run.built > 0
            if self._pass is run:
                self._pass = None

    def close(self) -> None:
        """Stop the running pass and its threads. Idempotent."""
        self._closed = True
        run, self._pass = self._pass, None
        self._spare.stop(close=True)  # and one a racing last batch starts from now on
        if run is not None:
            run.stop()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Loader({self.dataset!r}, batch_size={self.batch_size}, epoch={self.epoch}, batches={self.delivered})"
