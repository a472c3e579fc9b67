"""Where a ``Loader``'s order comes from besides its seed: the DDP split (rank, world size), a user sampler's epoch."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import InvalidOptionError

__all__ = ["epoch_of", "world_of"]


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
