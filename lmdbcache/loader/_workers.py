"""A ``Loader`` pass on worker processes (``num_workers``): for per-sample transforms that hold the GIL.

The thread path runs a per-sample transform on the copy threads, one at a time while the
global generators are seeded (``_pass._seeded``), so a Python or PIL augmentation gets no
parallelism there. Here each batch is built in one of ``num_workers`` processes of a
``DataLoader`` instead: the order is the loader's own (its batches are the
DataLoader's ``batch_sampler``), each index is seeded from (seed, epoch, index) exactly as on
the threads, so both paths give equal batches, and the worker collates the batch straight
into shared memory (``default_collate``; without a transform, ``lmdbcache.collate``'s one-copy
path). The workers live for one pass, as DataLoader's (not persistent) do: however the pass
ends, no process or thread stays behind, and none outlives the loader's process however it
ends, a SIGKILL while they start included (``_children``). Starting them costs a fork per
worker per epoch (with ``spawn``, an interpreter and the imports).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset, default_collate

from .._children import die_with_parent, start_workers
from ..errors import InvalidOptionError, add_note
from ._collate import collate
from ._pass import PassSpec, ended, one_by_one, stray

if TYPE_CHECKING:
    from ..dataset import CachedDataset
    from ._source import Mapped

__all__ = ["WorkerPass"]


class _Seeded(Dataset[Any]):
    """In a worker: the samples of a batch of (seed, epoch, index) items, each transform seeded as on the threads."""

    def __init__(self, ds: CachedDataset | Mapped, seeded: bool) -> None:
        self.ds, self.seeded = ds, seeded

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, item: tuple[int, int, int]) -> Any:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int, int]]) -> list[Any]:
        seed, epoch, _ = items[0]
        return one_by_one(self.ds, [index for _, _, index in items], (seed, epoch) if self.seeded else None)


class WorkerPass:
    """One pass on its own worker processes, with ``_pass.Pass``'s interface: ``get()`` a (batch, slots) or an
    exception, ``stop()`` ends the workers (whatever ended the pass: its end, break, an error, ``close()``)."""

    def __init__(self, spec: PassSpec, epoch: int, batches: Sequence[list[int]], start: int) -> None:
        ds, count = spec.dataset, spec.worker_processes
        self.spec, self.epoch, self.next = spec, epoch, start
        self.replaced = False  # set by the Loader when a newer pass of it starts (see ``_pass.ended``)
        transformed = ds.transform is not None
        items: list[list[Any]] = list(batches[start:])
        if transformed:
            items = [[(spec.seed, epoch, i) for i in batch] for batch in items]
        dataloader: DataLoader[Any] = DataLoader(
            _Seeded(ds, spec.seed_transforms) if transformed else ds,
            batch_sampler=items,
            num_workers=count,
            collate_fn=default_collate if transformed else collate,
            pin_memory=spec.pin_memory,
            prefetch_factor=max(2, -(-spec.prefetch // count)),
            multiprocessing_context=spec.multiprocessing_context,
            worker_init_fn=functools.partial(die_with_parent, os.getpid()),  # issue 38: no worker outlives us
        )
        self.release: Callable[[], None] | None = None
        try:
            with warnings.catch_warnings():  # torch's own hint names neither lmdbcache nor num_workers=0
                warnings.filterwarnings("ignore", "Got pickle error when attempting to start a worker")
                self.iterator: Iterator[Any] | None
                self.iterator, self.release = start_workers(functools.partial(iter, dataloader))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            if "pickle" not in str(exc).lower():
                raise
            method = (dataloader.multiprocessing_context or multiprocessing).get_start_method()
            raise InvalidOptionError(
                f"lmdbcache.Loader cannot send the dataset to worker processes started with {method!r}: {exc}. "
                f"Its transform ({ds.transform!r}) must be picklable there: define it at module level (not a "
                "lambda or a local function), or pass num_workers=0 to run it on the loader's threads."
            ) from exc

    def get(self) -> Any:
        k, self.next = self.next, self.next + 1
        iterator = self.iterator
        if iterator is None:
            return ended(self.replaced)
        try:
            batch = next(iterator)
        except StopIteration as exc:
            if exc.args:  # a worker's StopIteration, re-raised by the DataLoader as type(exc)(its traceback)
                return stray(exc, f"the dataset in a worker process loading batch {k} of epoch {self.epoch}")
            return RuntimeError("lmdbcache.Loader: the workers ended the pass early")
        except BaseException as exc:  # re-raised in the consumer, as on the threads
            if self.iterator is None:  # close() from another thread shut the workers down under next()
                return ended(self.replaced)
            add_note(exc, f"lmdbcache.Loader: raised loading batch {k} of epoch {self.epoch} (on a worker process)")
            return exc
        transform = self.spec.batch_transform
        if transform is not None:
            try:
                batch = transform(batch)
            except StopIteration as exc:
                return stray(exc, f"batch_transform on batch {k} of epoch {self.epoch}")
            except BaseException as exc:
                add_note(exc, f"lmdbcache.Loader: raised by batch_transform on batch {k} of epoch {self.epoch}")
                return exc
        return batch, []

    def stop(self) -> None:
        iterator, self.iterator = self.iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)  # the DataLoader's own clean shutdown
        if shutdown is not None:
            shutdown()
        release, self.release = self.release, None
        if release is not None:
            release()  # the thread that forked the workers may end (``_children.start_workers``)
