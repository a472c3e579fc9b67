"""Parsing the ext records of a value (see ``codec``), each checked before it sizes anything.

A dataset's samples nearly always share a handful of shapes, so the parsed payloads of tensor,
array and structured records are cached by their bytes: decoding one usually costs one dict
lookup instead of two struct parses and a dtype lookup. An entry is made only after every
check that depends on the payload alone passed, so a hit skips no check. A cache is cleared
when it grows large.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import msgpack
import numpy as np

from ..errors import CorruptSampleError
from ._dtypes import build_dtype, int_tuple, plain_dtype, v1_dtype
from ._format import (
    ARRAY_HEAD,
    DIMS,
    MAX_NDIM,
    MAX_PALETTE,
    MAX_V1_DIGITS,
    PALETTE_MODES,
    SPECS_MAX,
    TENSOR_HEAD,
    TORCH_DTYPES,
    image_problem,
    shape_problem,
    torch_dtypes,
)

if TYPE_CHECKING:
    import torch

Shape: TypeAlias = tuple[int, ...]
# (nbytes, the numpy dtype its bytes are read as, shape, the torch dtype to view them as or None)
TensorSpec: TypeAlias = "tuple[int, np.dtype, Shape, torch.dtype | None]"
ArraySpec: TypeAlias = tuple[int, np.dtype, Shape, None]
StructSpec: TypeAlias = tuple[int, np.dtype, Shape, bool]  # ..., is a scalar (np.void)

TENSOR_SPECS: dict[bytes, TensorSpec] = {}
ARRAY_SPECS: dict[bytes, ArraySpec] = {}  # numpy arrays and scalars (codes 3 and 4) alike
STRUCT_SPECS: dict[bytes, StructSpec] = {}

_ndarray = np.ndarray  # bound once: array() runs for every numpy array decoded
_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def remember(cache: dict[_Key, _Value], key: _Key, value: _Value) -> _Value:
    """Cache ``value`` under ``key``, first clearing a full cache; return ``value``."""
    if len(cache) >= SPECS_MAX:
        cache.clear()
    cache[key] = value
    return value


def _check_nbytes(shape: Shape, dtype: np.dtype, nbytes: Any) -> None:
    problem = shape_problem(shape, dtype.itemsize)
    if problem:
        raise CorruptSampleError(f"an array record with {problem}")
    count = 1
    for dim in shape:
        count *= dim
    if nbytes != count * dtype.itemsize:
        raise CorruptSampleError(f"an array record of shape {shape} and dtype {dtype} claims {nbytes} bytes")


def tensor_spec(data: bytes) -> TensorSpec:
    """Parse and check a tensor payload (code 2) and remember it; imports torch on first use."""
    dtype_code, ndim, nbytes = TENSOR_HEAD.unpack_from(data)
    if ndim > MAX_NDIM or len(data) != TENSOR_HEAD.size + 8 * ndim:
        raise CorruptSampleError("a tensor record of the wrong length")
    shape = DIMS[ndim].unpack_from(data, TENSOR_HEAD.size)
    entry = torch_dtypes()[1].get(dtype_code)
    if entry is None:
        import torch

        name = TORCH_DTYPES[dtype_code] if dtype_code < len(TORCH_DTYPES) else f"code {dtype_code}"
        raise CorruptSampleError(f"tensor dtype {name} is not available in torch {torch.__version__}")
    _, carrier, view = entry
    _check_nbytes(shape, carrier, nbytes)
    return remember(TENSOR_SPECS, data, (nbytes, carrier, shape, view))


def array_spec(data: bytes) -> ArraySpec:
    """Parse and check a numpy array or scalar payload (codes 3 and 4) and remember it."""
    ndim, nbytes = ARRAY_HEAD.unpack_from(data)
    if ndim > MAX_NDIM:
        raise CorruptSampleError(f"an array record of {ndim} dimensions")
    start = ARRAY_HEAD.size + 8 * ndim
    shape = DIMS[ndim].unpack_from(data, ARRAY_HEAD.size)
    dtype = plain_dtype(bytes(data[start:]).decode("ascii"))
    _check_nbytes(shape, dtype, nbytes)
    return remember(ARRAY_SPECS, data, (nbytes, dtype, shape, None))


def struct_spec(data: bytes) -> StructSpec:
    """Parse and check a structured array payload (code 8) and remember it."""
    items = unpack_plain(data)
    if type(items) is not list or len(items) != 4:
        raise CorruptSampleError("a malformed structured array record")
    shape = int_tuple(items[0], "shape")
    nbytes, dtype, scalar = items[1], build_dtype(items[2]), items[3]
    if type(nbytes) is not int or type(scalar) is not bool or (scalar and shape):
        raise CorruptSampleError("a malformed structured array record")
    _check_nbytes(shape, dtype, nbytes)
    return remember(STRUCT_SPECS, data, (nbytes, dtype, shape, scalar))


def unpack_plain(data: Any) -> Any:
    """msgpack data inside a record: no ext hook (an ext comes back as an ExtType and is refused)."""
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)


def array(shape: Shape, dtype: np.dtype, buf: bytearray) -> np.ndarray:
    """The array of ``shape`` and ``dtype`` on ``buf``, which was checked to be its size."""
    # A zero-byte dtype cannot sit on a buffer; such an array holds no bytes. Its element
    # count was checked, which keeps np.empty small even where it widens "<U0" to "<U1".
    return _ndarray(shape, dtype, buf) if dtype.itemsize else np.empty(shape, dtype)


def image_record(data: bytes) -> tuple[str, int, int, int, str | None, bytes | None]:
    """A PIL image record's mode, width, height, pixel byte count, palette mode and palette, checked."""
    items = unpack_plain(data)
    if type(items) is not list or len(items) != 6:
        raise CorruptSampleError("a malformed PIL image record")
    mode, width, height, nbytes, pal_mode, pal = items
    problem = image_problem(mode, width, height, nbytes)
    if problem:
        raise CorruptSampleError(f"a PIL image record with {problem}")
    if not (pal_mode is None and pal is None) and not (
        mode in ("P", "PA")
        and pal_mode in PALETTE_MODES
        and type(pal) is bytes
        and len(pal) <= MAX_PALETTE
        and len(pal) % len(pal_mode) == 0
    ):
        raise CorruptSampleError("a malformed PIL palette")
    return mode, width, height, nbytes, pal_mode, pal


# ----------------------------------------------------------------------------------------
# Format 1's own records (see "Format 1")

_V1_DIGITS = re.compile(rb"-?[0-9]{1,%d}" % MAX_V1_DIGITS)


def v1_bigint(data: bytes) -> int:
    """A format-1 code-5 record: at most 4300 decimal digits."""
    if not _V1_DIGITS.fullmatch(data):
        raise CorruptSampleError(f"a format-1 big int record of {len(data)} bytes that are not at most 4300 digits")
    return int(data)


def v1_structured(data: bytes) -> Any:
    """A format-1 code-7 record, parsed by hand: msgpack-numpy's reader would unpickle kind b"O"."""
    outer = unpack_plain(data)
    if type(outer) is not list or len(outer) != 2 or type(outer[0]) is not bool or type(outer[1]) is not bytes:
        raise CorruptSampleError("a malformed format-1 structured array record")
    record = unpack_plain(outer[1])
    if type(record) is not dict or record.keys() != {b"nd", b"type", b"kind", b"shape", b"data"}:
        raise CorruptSampleError("a malformed format-1 structured array record")
    if record[b"nd"] is not True or record[b"kind"] != b"V":
        raise CorruptSampleError(
            f"a format-1 numpy record of kind {record[b'kind']!r}: only structured arrays are read "
            "(object arrays are never unpickled)"
        )
    dtype = v1_dtype(record[b"type"])
    shape = int_tuple(record[b"shape"], "shape")
    raw = record[b"data"]
    if type(raw) is not bytes:
        raise CorruptSampleError("a malformed format-1 structured array record")
    _check_nbytes(shape, dtype, len(raw))
    arr = array(shape, dtype, bytearray(raw))
    return arr[()] if outer[0] else arr
