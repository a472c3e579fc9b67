"""Where a ``Loader``'s order comes from besides its seed (the DDP split, a user sampler's epoch), and its batches."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .._native.batch import Indexed
from ..errors import InvalidOptionError

__all__ = ["Batches", "epoch_of", "rows", "world_of"]


def world_of(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """(rank, world size) from the arguments, torch.distributed or the torchrun env; None when not distributed."""
    if (rank is None) != (world_size is None):
        raise InvalidOptionError("Pass both rank and world_size, or neither (they are then found automatically).")
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:
            return None
    if not (type(world_size) is int and world_size >= 1 and type(rank) is int and 0 <= rank < world_size):
        raise InvalidOptionError(f"rank must be in [0, world_size) and world_size >= 1, not {rank!r}, {world_size!r}.")
    return rank, world_size


def epoch_of(sampler: Iterable[Any], epoch: int) -> Iterable[Any]:
    """``sampler`` set to ``epoch`` (its ``set_epoch``, or its inner sampler's for a BatchSampler), to iterate."""
    set_epoch = getattr(sampler, "set_epoch", None) or getattr(getattr(sampler, "sampler", None), "set_epoch", None)
    if set_epoch is not None:  # a BatchSampler's epoch is its sampler's
        set_epoch(epoch)
    return sampler


class Batches(Indexed):
    """An epoch's batches of ``size`` over ``order`` (an int64 array), each made a list of ints when asked for.

    What ``[order[k : k + size] for k in ...]`` over the order's list was, without building the epoch's
    lists up front: at 1M samples those took 100-150 ms an epoch (10% of the loader's time at its
    speed there), and the first batch of every epoch waited for them.
    """

    __slots__ = ("length", "order", "size")

    def __init__(self, order: np.ndarray, size: int, drop_last: bool) -> None:
        self.order, self.size = order[: len(order) - len(order) % size] if drop_last else order, size
        self.length = -(-len(self.order) // size)

    def __len__(self) -> int:
        return self.length

    def _record(self, k: int) -> list[int]:
        return self.order[k * self.size : (k + 1) * self.size].tolist()  # type: ignore[no-any-return]

    def rows(self, k: int) -> int:
        """``len(self[k])``, without making the list."""
        return min(self.size, len(self.order) - k * self.size)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Batches):
            return self.size == other.size and np.array_equal(self.order, other.order)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # type: ignore[assignment]  # equal by value, as the lists were


def rows(batches: Sequence[list[int]], k: int) -> int:
    """How many indices batch ``k`` of ``batches`` holds."""
    return batches.rows(k) if type(batches) is Batches else len(batches[k])
