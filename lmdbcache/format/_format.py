"""The value format's vocabulary (see ``codec``): header layout, record codes, limits, dtype tables.

Shared by the writer (``_encode``) and the reader (``_decode``), so that whatever one writes the
other reads. Neither torch nor Pillow is imported here: a sample can hold a tensor or an image
only once its caller has imported them, and a value is read with them only when it holds one.
"""

from __future__ import annotations

import functools
import struct
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

# The header's version byte: 2 for a value as format 2 wrote it (formats 3 and 4 write their values
# unchanged), 3 for a value whose buffers are framed and compressed (format 3, ``_compress``; format 4
# writes them unchanged: it changed where values are stored, ``_group``, not their bytes).
# A bump that changes the value layout must teach decode() the old one, as format 1 is taught there.
MAGIC = b"LMC\x02"
FRAMED_MAGIC = b"LMC\x03"
HEAD = struct.Struct("<4sIQQ")
# The header, the structure's first byte and, in a flat structure, its signature length.
HEAD_AND_FLAT = struct.Struct("<4sIQQBH")
HEAD_AND_FIRST = struct.Struct("<4sIQQB")
HEAD_SIZE = HEAD.size  # 24
FLAT = 0xC1  # the first byte of a flat structure: one msgpack never uses

MAX_VALUE = 0xFFFFFFFF  # LMDB's largest value (MAXDATASIZE)
MAX_INDEX = 2**64 - 1  # the checksums' seed is a u64
MAX_DEPTH = 200
MAX_NDIM = 64
MAX_ARRAY_BYTES = 2**63 - 1  # numpy's size * itemsize must fit its npy_intp
MAX_EMPTY_ITEMS = 1 << 20
MAX_DTYPE_DEPTH = 32
MAX_DTYPE_SIZE = 2**31 - 1  # numpy keeps a dtype's itemsize in a C int
MAX_SIGNATURE = 0xFFFF
MAX_FLAT_ITEMS = 255
MAX_PIL_SIDE = 2**31 - 1
MAX_EMPTY_PIL_SIDE = 0xFFFF  # Pillow allocates a row pointer per line even when a line has no pixels
MAX_PALETTE = 1024
MAX_V1_LIST_DEPTH = 32
MAX_V1_DIGITS = 4300  # Python's default int_max_str_digits: 0.1.0 could not write more
SPECS_MAX = 4096  # entries per cache of parsed records (cleared when full)

LIST, TENSOR, NDARRAY, NPSCALAR, PIL, STRUCTURED, BIGINT = 1, 2, 3, 4, 6, 8, 9
V1_BIGINT, V1_STRUCTURED = 5, 7

TENSOR_HEAD = struct.Struct("<BBQ")
U16 = struct.Struct("<H")
ARRAY_HEAD = struct.Struct("<BQ")
DIMS = [struct.Struct("<" + "q" * n) for n in range(MAX_NDIM + 1)]

# Append-only: a dtype's position is its code in stored values.
TORCH_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex32", "complex64", "complex128", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
)  # fmt: skip

# Dtypes numpy has under the same name; the others travel as an unsigned integer of
# the same width and are viewed back as the torch dtype.
_NUMPY_NATIVE = {
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
}  # fmt: skip
_CARRIERS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}

# A torch dtype's code and the torch dtype it is written as (None: itself).
TorchToCode: TypeAlias = "dict[torch.dtype, tuple[int, torch.dtype | None]]"
# A code's torch dtype, the numpy dtype its bytes are read as, and the torch dtype to view them as (None: no view).
TorchFromCode: TypeAlias = "dict[int, tuple[torch.dtype, np.dtype, torch.dtype | None]]"


@functools.cache
def torch_dtypes() -> tuple[TorchToCode, TorchFromCode]:
    """The dtype tables of the torch this process has, imported here on first use."""
    import torch

    to_code: TorchToCode = {}
    from_code: TorchFromCode = {}
    for code, name in enumerate(TORCH_DTYPES):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue
        if name in _NUMPY_NATIVE:
            to_code[dtype] = (code, None)
            from_code[code] = (dtype, np.dtype(name), None)
        else:
            carrier = _CARRIERS[dtype.itemsize]
            to_code[dtype] = (code, getattr(torch, carrier))
            from_code[code] = (dtype, np.dtype(carrier), dtype)
    return to_code, from_code


@functools.cache
def pillow() -> ModuleType | None:
    """``PIL.Image``, imported on first use; None where Pillow is absent (no sample can hold an image then)."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - exercised only where Pillow is absent
        return None
    return Image


# Bits per pixel of every PIL mode stored; a row of Image.tobytes() is padded to a byte.
PIL_BITS = {
    "1": 1, "L": 8, "P": 8, "LA": 16, "La": 16, "PA": 16, "I;16": 16, "I;16L": 16, "I;16B": 16,
    "I;16N": 16, "RGB": 24, "YCbCr": 24, "LAB": 24, "HSV": 24, "I": 32, "F": 32, "RGBA": 32,
    "RGBa": 32, "RGBX": 32, "CMYK": 32,
}  # fmt: skip
PALETTE_MODES = ("RGB", "RGBA")


class Unsupported(Exception):
    """Internal: a value the format cannot hold; carries the path to it up to ``encode``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path: list[str] = []


def typename(obj: object) -> str:
    """The name of ``obj``'s type as a refusal gives it: ``set``, ``datetime.datetime``."""
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# ----------------------------------------------------------------------------------------
# Checks shared by the writer and the reader, so that whatever is written can be read.


def shape_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why an array of this shape and itemsize cannot be stored, or None."""
    if len(shape) > MAX_NDIM:
        return f"{len(shape)} dimensions, over the limit of {MAX_NDIM}"
    size, count = itemsize or 1, 1
    for dim in shape:
        if dim < 0:
            return f"a negative dimension in shape {shape}"
        count *= dim
        if dim:
            size *= dim
            if size > MAX_ARRAY_BYTES:
                return f"shape {shape} spans over 2**63 bytes (numpy's limit)"
    if not itemsize and count > MAX_EMPTY_ITEMS:
        return f"{count} elements of a zero-byte dtype, over the limit of {MAX_EMPTY_ITEMS}"
    return None


def image_problem(mode: Any, width: Any, height: Any, nbytes: Any) -> str | None:
    """Why a PIL image of this mode, size and pixel byte count cannot be stored, or None."""
    bits = PIL_BITS.get(mode) if type(mode) is str else None
    if bits is None:
        return f"mode {mode!r} is not one of {', '.join(PIL_BITS)}"
    if not all(type(n) is int for n in (width, height, nbytes)):
        return "size or length of the wrong type"
    if not (0 <= width <= MAX_PIL_SIDE and 0 <= height <= MAX_PIL_SIDE):
        return f"size {width}x{height} out of range"
    if not (width and height) and max(width, height) > MAX_EMPTY_PIL_SIDE:
        return f"an image without pixels of size {width}x{height} (at most {MAX_EMPTY_PIL_SIDE} per side)"
    if nbytes != (width * bits + 7) // 8 * height:
        return f"{nbytes} pixel bytes for a {width}x{height} image of mode {mode}"
    return None
