"""What a saved ``Loader`` state means, and whether it means the same samples in this loader.

``Loader.load_state_dict`` hands these functions the state and plain facts about itself (its settings,
dataset length, batches per epoch), never the Loader. A state names its position (seed, epoch, batches
received, samples in them) and what decides which samples those batches held (sampler kind, batch_size,
shuffle, drop_last, rank, world_size, dataset_length); a state saved under other settings, or whose
position lies past the end of its epoch here, is refused with the field, both values and the two ways out
(create the loader as it was, or start the next epoch afresh). A field an earlier lmdbcache did not save is
taken as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InvalidOptionError

__all__ = ["check_settings", "position_in"]

SETTINGS = ("seed", "sampler", "shuffle", "drop_last", "rank", "world_size")  # each must be equal, as saved


def check_settings(state: dict[str, Any], mine: dict[str, Any], length: int, epoch: int, delivered: int) -> None:
    """Raise if ``state`` was saved with ``SETTINGS`` other than ``mine`` or for a dataset of another length."""
    where, fresh = f"batch {delivered} of epoch {epoch}", f"set_epoch({epoch + 1})"
    for field in SETTINGS:
        if field in state and state[field] != mine[field]:
            raise InvalidOptionError(
                f"This Loader state was saved with {field}={state[field]!r}, but this loader has "
                f"{field}={mine[field]!r}: its position ({where}) would be other samples here (some skipped, "
                f"some repeated). Create the loader with {field}={state[field]!r} to resume, or call "
                f"{fresh} instead of load_state_dict to start the next epoch afresh."
            )
    saved = state.get("dataset_length", length)
    if saved != length:
        raise InvalidOptionError(
            f"This Loader state was saved for a dataset of {saved!r} samples, but this loader's dataset has "
            f"{length}: its position ({where}) would be other samples here (some skipped, some repeated). Resume "
            f"on the dataset the state was saved with, or call {fresh} instead of load_state_dict to start the "
            "next epoch afresh."
        )


def position_in(
    state: dict[str, Any],
    epoch: int,
    delivered: int,
    batch_size: int | None,
    batches: int,
    total: Callable[[], int | None],
) -> tuple[int, int]:
    """(batches, samples) received of ``state``'s position in a loader of ``batch_size`` (None: a batch_sampler's)
    with ``batches`` per epoch and ``total()`` samples in ``epoch`` (None: a batch_sampler's); a position past
    the epoch's end, or that is not a whole number of this loader's batches, is refused."""
    where, fresh = f"batch {delivered} of epoch {epoch}", f"set_epoch({epoch + 1})"
    samples = state.get("samples")
    size = state.get("batch_size", batch_size)
    if samples is None:
        samples = delivered * size if type(size) is int else 0  # a state from before samples were counted
    if type(samples) is not int or samples < 0:
        raise InvalidOptionError(f"A Loader state's samples is an int >= 0, not {state!r}.")
    if size != batch_size:
        n = total()
        if type(size) is not int or batch_size is None or n is None or (samples % batch_size and samples < n):
            raise InvalidOptionError(
                f"This Loader state was saved with batch_size={size!r} after {samples} samples of epoch "
                f"{epoch} ({where}), which is not a whole number of batches of this loader's "
                f"batch_size={batch_size}. Create the loader with batch_size={size!r} to resume, or call "
                f"{fresh} instead of load_state_dict to start the next epoch afresh."
            )
        if samples > n:
            raise _past_the_end(f"{where}, after {samples} samples", f"{n} samples", fresh)
        delivered = -(-samples // batch_size)  # samples received, counted in this loader's batches
    if delivered > batches:
        raise _past_the_end(where, f"{batches} batches", fresh)
    return delivered, samples


def _past_the_end(where: str, epoch_holds: str, fresh: str) -> InvalidOptionError:
    return InvalidOptionError(
        f"This Loader state is at {where}, past the end of the epoch here: an epoch of this loader has "
        f"{epoch_holds}. It was saved by a loader of other settings or data: resume with those, or call {fresh} "
        "instead of load_state_dict to start the next epoch afresh."
    )
