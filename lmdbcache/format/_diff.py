"""Where two decoded samples first differ: the message of a spot check that failed."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["first_difference"]


def first_difference(cached: Any, fresh: Any, where: str = "sample") -> str | None:
    """Describe the first place (depth first) where ``cached`` and ``fresh`` differ, or None if equal.

    Tensors and arrays are compared by type, dtype, shape, then bytes (so NaNs compare equal
    to themselves and -0.0 differs from 0.0: the cache stores bits, not numbers).
    """
    if type(cached) is not type(fresh):
        return f"{where} is a {type(cached).__name__} in the cache but a {type(fresh).__name__} from the source"
    if isinstance(cached, torch.Tensor):
        return _arrays(where, cached.dtype, fresh.dtype, tuple(cached.shape), tuple(fresh.shape), cached, fresh)
    if isinstance(cached, np.ndarray):
        return _arrays(where, cached.dtype, fresh.dtype, cached.shape, fresh.shape, cached, fresh)
    if isinstance(cached, (tuple, list)):
        if len(cached) != len(fresh):
            return f"{where} has {len(cached)} items in the cache but {len(fresh)} from the source"
        for k, (a, b) in enumerate(zip(cached, fresh)):
            found = first_difference(a, b, f"{where}[{k}]")
            if found:
                return found
        return None
    if isinstance(cached, dict):
        if list(cached) != list(fresh):
            return f"{where} has keys {list(cached)[:8]} in the cache but {list(fresh)[:8]} from the source"
        for key in cached:
            found = first_difference(cached[key], fresh[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(cached, np.generic):
        cached, fresh = np.asarray(cached), np.asarray(fresh)
        return _arrays(where, cached.dtype, fresh.dtype, (), (), cached, fresh)
    if hasattr(cached, "tobytes") and hasattr(cached, "mode"):  # a PIL image
        if (cached.mode, cached.size) != (fresh.mode, fresh.size):
            return f"{where} is a {cached.mode} image of {cached.size} in the cache but {fresh.mode} {fresh.size} now"
        if cached.getpalette() != fresh.getpalette():
            return f"{where}: the image's palette differs"
        return None if cached.tobytes() == fresh.tobytes() else f"{where}: the image's pixel values differ"
    if cached != cached and fresh != fresh:  # NaN
        return None
    return None if cached == fresh else f"{where} is {cached!r:.60} in the cache but {fresh!r:.60} from the source"


def _arrays(
    where: str, dtype_a: Any, dtype_b: Any, shape_a: tuple[int, ...], shape_b: tuple[int, ...], a: Any, b: Any
) -> str | None:
    if dtype_a != dtype_b:
        return f"{where} has dtype {dtype_a} in the cache but {dtype_b} from the source"
    if shape_a != shape_b:
        return f"{where} has shape {list(shape_a)} in the cache but {list(shape_b)} from the source"
    if _bytes(a) != _bytes(b):
        return f"{where} has the same dtype and shape but different values"
    return None


def _bytes(x: Any) -> bytes:
    if isinstance(x, torch.Tensor):
        x = x.contiguous().reshape(-1)
        return x.view(torch.uint8).numpy().tobytes() if x.dtype.itemsize and x.numel() else b""
    return np.ascontiguousarray(x).tobytes()
