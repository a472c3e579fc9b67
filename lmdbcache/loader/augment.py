"""Augmentations the loader fuses into its batch copy: ``Loader(ds, batch_size, augment=[...])``.

Five transforms with torchvision's names, meanings and defaults: ``RandomResizedCrop``,
``RandomHorizontalFlip``, ``CenterCrop``, ``Resize`` (the shorter side, or (h, w)) and
``Normalize`` (on the uint8 image scaled to [0, 1], as ``ToDtype(float, scale=True)`` then
``Normalize`` compute it; ``dtype`` float32 or float16). They apply to the image field of
each sample (a 3-D uint8 tensor, CHW or HWC as stored); the output is one batch tensor of
shape (B, C, H, W), uint8 unless ``Normalize`` is given. With the compiled core the whole
pipeline runs in C inside the batch copy (``lmdbcache/_native/_augment.c``, the GIL released);
without it (``LMDBCACHE_PURE_PYTHON=1``) ``apply`` runs the same steps with torch ops.

Random parameters. The draws of sample ``index`` in ``epoch`` are a pure function of
(seed, epoch, index, transform position, draw number): ``uniform`` hashes them with the
splitmix64 finalizer into a 53-bit double (the C kernel computes the same numbers), so a batch
depends on neither the threads nor a resume. ``RandomResizedCrop`` draws its box as
torchvision's ``get_params`` does: up to 10 tries of (scale, log-ratio), then the central
fallback (at least one pixel wide and tall, where torchvision's can be empty); draws 2t and 2t+1
are try t's, draws 20 and 21 the box's top and left.

Options are checked when a transform is made, with ``InvalidOptionError``: sizes in 1..65536
(``MAX_SIDE``, the kernel's), ``scale`` and ``ratio`` increasing pairs of finite numbers in
[1e-12, 1e12], ``p`` in [0, 1], ``Normalize``'s numbers finite, ``antialias`` True (the one
kind fused). Every option made so runs on both paths.

Order: the geometric transforms first (``RandomResizedCrop``, or ``Resize`` and/or
``CenterCrop``), then ``RandomHorizontalFlip``, then ``Normalize``; the output size must be
fixed (a ``RandomResizedCrop`` or a ``CenterCrop``). Any other transform still works as the
dataset's per-sample ``transform``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidOptionError

__all__ = [
    "MAX_SIDE",
    "CenterCrop",
    "Normalize",
    "Plan",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "box_of",
    "compile_plan",
    "is_hwc",
    "uniform",
]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """splitmix64's finalizer (a bijection of 64-bit words)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream(seed: int, epoch: int, index: int, position: int) -> int:
    """The key of one transform's draws for one sample (``_augment.c``'s ``aug_stream``)."""
    key = _mix((seed + _GOLDEN) & _M64)
    for word in (epoch, index, position):
        key = _mix((key ^ (word & _M64)) + _GOLDEN & _M64)
    return key


def uniform(key: int, k: int) -> float:
    """Draw ``k`` of the stream ``key``: a double in [0, 1) with 53 random bits."""
    return (_mix((key + (k + 1) * _GOLDEN) & _M64) >> 11) * 2.0**-53


MAX_SIDE = 1 << 16  # the largest output or resized side (_augment.c's AUG_MAX_SIDE)
RANGE = (1e-12, 1e12)  # scale and ratio bounds: wider than any image's aspect; the box math stays finite


def _pair(size: Any, name: str) -> tuple[int, int]:
    pair = (size, size) if type(size) is int else size
    if not (isinstance(pair, Sequence) and len(pair) == 2 and all(type(s) is int and 0 < s <= MAX_SIDE for s in pair)):
        raise InvalidOptionError(
            f"{name}: size must be an int in 1..{MAX_SIDE} or a pair (h, w) of them, not {size!r} (the fused "
            f"kernel's largest side is {MAX_SIDE})."
        )
    return int(pair[0]), int(pair[1])


def _size(size: Any, name: str) -> int | tuple[int, int]:
    """``size`` checked (``_pair``) and frozen: an int stays an int, a sequence becomes a tuple."""
    pair = _pair(size, name)
    return pair[0] if type(size) is int else pair


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def _range(pair: Any, name: str, default: str) -> tuple[float, float]:
    """A (lo, hi) pair of finite numbers with RANGE[0] <= lo <= hi <= RANGE[1], as floats."""
    if not (isinstance(pair, Sequence) and len(pair) == 2 and all(_real(v) for v in pair)):
        ok = False
    else:
        ok = RANGE[0] <= float(pair[0]) <= float(pair[1]) <= RANGE[1]
    if not ok:
        raise InvalidOptionError(
            f"RandomResizedCrop: {name} must be an increasing pair (lo, hi) of finite numbers in [1e-12, 1e12], "
            f"not {pair!r} (torchvision's default: {name}={default})."
        )
    return float(pair[0]), float(pair[1])


def _antialias(antialias: Any, name: str) -> None:
    if antialias is not True:
        raise InvalidOptionError(
            f"{name}: only antialias=True is fused (the kernel computes torch's antialiased bilinear), not "
            f"antialias={antialias!r}. Leave it at its default, or pass torchvision's {name}(antialias=False) as the "
            "dataset's per-sample transform= instead."
        )


@dataclasses.dataclass(frozen=True)
class RandomResizedCrop:
    """A random crop (area ``scale`` of the image, aspect ratio ``ratio`` drawn log-uniformly) resized to ``size``.

    Checked here (``InvalidOptionError``): ``size`` an int in 1..65536 or (h, w) of them, ``scale`` and ``ratio``
    increasing pairs of finite numbers in [1e-12, 1e12], ``antialias`` True."""

    size: Any
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    antialias: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size(self.size, "RandomResizedCrop"))
        object.__setattr__(self, "scale", _range(self.scale, "scale", "(0.08, 1.0)"))
        object.__setattr__(self, "ratio", _range(self.ratio, "ratio", "(3 / 4, 4 / 3)"))
        _antialias(self.antialias, "RandomResizedCrop")


@dataclasses.dataclass(frozen=True)
class RandomHorizontalFlip:
    """Mirror left-right with probability ``p`` (a number in [0, 1])."""

    p: float = 0.5

    def __post_init__(self) -> None:
        if not (_real(self.p) and 0.0 <= float(self.p) <= 1.0):
            raise InvalidOptionError(f"RandomHorizontalFlip: p must be a number in [0, 1], not {self.p!r}.")
        object.__setattr__(self, "p", float(self.p))


@dataclasses.dataclass(frozen=True)
class CenterCrop:
    """The central ``size`` crop (zero-padded where the image is smaller, as torchvision pads)."""

    size: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size(self.size, "CenterCrop"))


@dataclasses.dataclass(frozen=True)
class Resize:
    """Resize so the shorter side is ``size`` (an int), or to (h, w); antialiased bilinear. Sides up to 65536."""

    size: Any
    antialias: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size(self.size, "Resize"))
        _antialias(self.antialias, "Resize")


@dataclasses.dataclass(frozen=True)
class Normalize:
    """``(x / 255 - mean) / std`` per channel, as ``dtype`` (float32 or float16); finite numbers, std without 0."""

    mean: Sequence[float]
    std: Sequence[float]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.float16):
            raise InvalidOptionError(f"Normalize: dtype must be torch.float32 or torch.float16, not {self.dtype!r}.")
        mean, std = self.mean, self.std
        numbers_ok = all(isinstance(v, Sequence) and all(_real(x) for x in v) for v in (mean, std))
        if not (numbers_ok and len(mean) == len(std) > 0 and all(float(x) != 0 for x in std)):
            raise InvalidOptionError(
                "Normalize: mean and std must be sequences of one length (one number per channel) of finite "
                f"numbers, std without zeros; got mean={mean!r}, std={std!r}."
            )
        object.__setattr__(self, "mean", tuple(float(x) for x in mean))
        object.__setattr__(self, "std", tuple(float(x) for x in std))


@dataclasses.dataclass
class Plan:
    """A checked pipeline, as the kernel and ``apply`` take it.

    ``mode``: 0 a random-resized crop, 1 resize (``resize``: 0 none, else the shorter side;
    ``resize_hw`` a fixed size) then a central window of ``size``. ``rrc_at``/``flip_at``: the
    transform positions that key their draws. ``lut``: per channel, 256 output values (None: uint8).
    """

    size: tuple[int, int]
    mode: int
    scale: tuple[float, float] = (0.08, 1.0)
    log_ratio: tuple[float, float] = (0.0, 0.0)
    ratio: tuple[float, float] = (1.0, 1.0)
    resize: int = 0
    resize_hw: tuple[int, int] = (0, 0)
    rrc_at: int = 0
    flip_p: float = 0.0
    flip_at: int = 0
    lut: torch.Tensor | None = None
    channels_last: bool = False
    field: Any = None
    layout: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.lut is None else self.lut.dtype


def _lut(norm: Normalize) -> torch.Tensor:
    mean = torch.tensor(norm.mean, dtype=torch.float32)  # checked by Normalize
    std = torch.tensor(norm.std, dtype=torch.float32)
    values = torch.arange(256, dtype=torch.float32) / 255
    return ((values[None, :] - mean[:, None]) / std[:, None]).to(norm.dtype).contiguous()


def compile_plan(
    transforms: Sequence[Any], field: Any = None, channels_last: bool = False, layout: str | None = None
) -> Plan:
    """Check ``transforms`` (see the module docstring for the order) and turn them into a ``Plan``."""
    if layout not in (None, "CHW", "HWC"):
        raise InvalidOptionError(f"image_layout must be None (found per image), 'CHW' or 'HWC', not {layout!r}.")
    items = list(transforms)
    rank = {RandomResizedCrop: 0, Resize: 0, CenterCrop: 0, RandomHorizontalFlip: 1, Normalize: 2}
    bad = next((t for t in items if type(t) not in rank), None)
    if bad is not None:
        raise InvalidOptionError(
            f"augment: {bad!r} is not one of the fused transforms (RandomResizedCrop, RandomHorizontalFlip, "
            "CenterCrop, Resize, Normalize from lmdbcache.augment). Pass any other transform as the dataset's "
            "per-sample transform= instead."
        )
    kinds = [rank[type(t)] for t in items]
    if kinds != sorted(kinds) or sum(k == 1 for k in kinds) > 1 or sum(k == 2 for k in kinds) > 1:
        raise InvalidOptionError(
            "augment: put the geometric transforms first, then at most one RandomHorizontalFlip, then at most "
            f"one Normalize; got {[type(t).__name__ for t in items]}."
        )
    geometry = [(k, t) for k, t in enumerate(items) if kinds[k] == 0]
    plan = _geometry(geometry)
    for k, t in enumerate(items):
        if type(t) is RandomHorizontalFlip:
            plan.flip_p, plan.flip_at = t.p, k
        elif type(t) is Normalize:
            plan.lut = _lut(t)
    plan.channels_last, plan.field, plan.layout = bool(channels_last), field, layout
    return plan


def _geometry(geometry: list[tuple[int, Any]]) -> Plan:
    names = [type(t).__name__ for _, t in geometry]
    if names == ["RandomResizedCrop"]:
        k, t = geometry[0]  # its options were checked when it was made (RandomResizedCrop.__post_init__)
        (r0, r1), size = t.ratio, _pair(t.size, "RandomResizedCrop")
        return Plan(size, 0, t.scale, (math.log(r0), math.log(r1)), t.ratio, rrc_at=k)
    if names in (["CenterCrop"], ["Resize", "CenterCrop"]):
        size = _pair(geometry[-1][1].size, "CenterCrop")
        plan = Plan(size, 1)
        if len(geometry) == 2:
            resize = geometry[0][1]
            if type(resize.size) is int:
                plan.resize = resize.size
            else:
                plan.resize_hw = _pair(resize.size, "Resize")
        return plan
    raise InvalidOptionError(
        "augment: a batch needs one output size: use one RandomResizedCrop, or CenterCrop (after an optional "
        f"Resize); got {names or 'no geometric transform'}."
    )


def _round(x: float) -> int:
    return round(x)  # half to even, as torchvision's int(round(...)) and C's rint


def box_of(plan: Plan, height: int, width: int, key: int) -> tuple[int, ...]:
    """(top, left, h, w, rh, rw, oy, ox): the source box, its resized size, the output window's offset in it."""
    oh, ow = plan.size
    if plan.mode == 0:
        area = float(height * width)
        for t in range(10):
            target = area * (plan.scale[0] + (plan.scale[1] - plan.scale[0]) * uniform(key, 2 * t))
            lr0, lr1 = plan.log_ratio
            aspect = math.exp(lr0 + (lr1 - lr0) * uniform(key, 2 * t + 1))
            w = _round(math.sqrt(target * aspect))
            h = _round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(uniform(key, 20) * (height - h + 1))
                left = int(uniform(key, 21) * (width - w + 1))
                return top, left, h, w, oh, ow, 0, 0
        in_ratio = width / height  # the central fallback; at least one pixel (torchvision's can be 0 wide)
        if in_ratio < plan.ratio[0]:
            w, h = width, max(1, _round(width / plan.ratio[0]))
        elif in_ratio > plan.ratio[1]:
            h, w = height, max(1, _round(height * plan.ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w, oh, ow, 0, 0
    rh, rw = height, width
    if plan.resize:
        short, long = sorted((height, width))
        new_long = int(plan.resize * long / short)
        rh, rw = (plan.resize, new_long) if height <= width else (new_long, plan.resize)
    elif plan.resize_hw != (0, 0):
        rh, rw = plan.resize_hw
    oy = -((oh - rh) // 2) if oh > rh else _round((rh - oh) / 2.0)
    ox = -((ow - rw) // 2) if ow > rw else _round((rw - ow) / 2.0)
    return 0, 0, height, width, rh, rw, oy, ox


def flips(plan: Plan, key: int) -> bool:
    return plan.flip_p > 0 and uniform(key, 0) < plan.flip_p


def is_hwc(shape: Sequence[int], layout: str | None) -> bool:
    """``layout`` if given; else HWC when the last dimension looks like channels (<= 4) and the first does not."""
    return layout == "HWC" if layout is not None else shape[2] <= 4 < shape[0]


def apply(plan: Plan, image: torch.Tensor, seed: int, epoch: int, index: int) -> torch.Tensor:
    """The augmented image of sample ``index`` in ``epoch``, with torch ops (the pure path and the reference)."""
    if image.dim() != 3 or image.dtype != torch.uint8:
        raise InvalidOptionError(
            f"augment: the image field must be a 3-D uint8 tensor, not {image.dtype} {tuple(image.shape)}."
        )
    chw = image.permute(2, 0, 1) if is_hwc(image.shape, plan.layout) else image
    _, height, width = chw.shape
    if height == 0 or width == 0:
        raise InvalidOptionError(f"augment: sample {index} holds an empty image of shape {tuple(image.shape)}.")
    box = box_of(plan, height, width, stream(seed, epoch, index, plan.rrc_at))
    flip = flips(plan, stream(seed, epoch, index, plan.flip_at))
    return render(plan, chw, box, flip)


def _resize(x: torch.Tensor, rh: int, rw: int) -> torch.Tensor:
    return F.interpolate(x[None].contiguous(), size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)[0]


def render(plan: Plan, chw: torch.Tensor, box: tuple[int, ...], flip: bool) -> torch.Tensor:
    """Crop ``box``, resize, take the window (zeros outside), flip, normalize: one CHW image (or HWC storage)."""
    top, left, h, w, rh, rw, oy, ox = box
    x = chw[:, top : top + h, left : left + w]
    if (rh, rw) == (1, 1) and (h, w) != (1, 1) and h != 1:  # torch 2.13's uint8 kernel asserts on a 1x1 output:
        x = _resize(x, 1, w)  # one axis at a time, as its separable passes would (the compiled core's result)
    if (rh, rw) != tuple(x.shape[1:]):
        x = _resize(x, rh, rw)
    oh, ow = plan.size
    if (oy, ox, rh, rw) != (0, 0, oh, ow):
        out = torch.zeros((x.shape[0], oh, ow), dtype=torch.uint8)
        y0, y1, x0, x1 = max(oy, 0), min(oy + oh, rh), max(ox, 0), min(ox + ow, rw)
        if y0 < y1 and x0 < x1:
            out[:, y0 - oy : y1 - oy, x0 - ox : x1 - ox] = x[:, y0:y1, x0:x1]
        x = out
    if flip:
        x = x.flip(-1)
    if plan.lut is not None:
        if plan.lut.shape[0] != x.shape[0]:
            raise InvalidOptionError(f"Normalize: {plan.lut.shape[0]} means for an image of {x.shape[0]} channels.")
        x = plan.lut[torch.arange(x.shape[0])[:, None, None], x.long()]
    if plan.channels_last:
        return x.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    return x.contiguous()
