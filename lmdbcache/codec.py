"""Turn one sample into bytes and back, exactly, with one copy out of the memory map.

The value format, version 2
===========================

One LMDB value holds one sample and is bound to the index it is stored under. All
integers are little-endian::

    offset  size  field
    0       3     magic b"LMC"
    3       1     format version: 2 (``FORMAT_VERSION``); 1 is still read, see "Format 1"
    4       4     S, the length of the structure (u32, at least 1)
    8       8     structure checksum: xxh3_64 of the structure, seed = the index
    16      8     data checksum: xxh3_64 chained over the buffers in order, each hashed
                  with the previous hash as its seed and the first with seed = the index
                  (so it is the index itself when there are no buffers)
    24      S     structure: a flat structure or one msgpack object (below)
    24+S    ...   buffers: the raw bytes of every tensor, array and image in the sample,
                  concatenated in the order their records appear in the structure (depth
                  first, left to right), unpadded. The value ends exactly where the last
                  buffer ends.

The index (0 <= index < 2**64; any other raises ``InvalidOptionError``) seeds both
checksums, so a value read under any other key fails its structure checksum: a flipped bit
in a key never serves another index's sample.
``decode`` verifies the structure checksum on every call, before parsing anything, and the
data checksum over the copies it makes unless the caller passes ``verify_data=False`` (a
value it has verified before). Every count, length, dtype and mode read from a value is
checked against the value before it sizes an allocation; whatever is wrong raises
``CorruptSampleError``, never another exception and never a damaged sample. Nothing read
from a value is ever unpickled or handed to msgpack-numpy.

The structure
-------------
msgpack's own nil, bool, int (-2**63 .. 2**64-1), float (written as double), str (UTF-8,
lone surrogates passed through), bin (bytes), array (decoded as ``tuple``: samples are
usually tuples, so the common case needs no record) and map (decoded as ``dict``; keys are
str, int, the other scalars here, or tuples of them). Everything else is an ext record::

    code  type                 ext payload
    1     list                 empty: a marker, the first element of a msgpack array whose
                               other elements are the list's items
    2     torch.Tensor         <B dtype code><B ndim><Q nbytes> then ndim x <q dim>
    3     numpy.ndarray        <B ndim><Q nbytes> then ndim x <q dim>, then the dtype string
                               (below) in ASCII
    4     numpy scalar         as 3 with ndim 0; decoded as ``array[()]``
    6     PIL.Image.Image      msgpack [mode, width, height, nbytes, palette mode or nil,
                               palette bytes or nil]; the pixels (``Image.tobytes()``) in a buffer
    8     structured numpy     msgpack [shape, nbytes, dtype description (below), is scalar];
          array or np.void     the array's bytes, padding bytes included, in a buffer
    9     int beyond 64 bits   two's complement, little-endian, in the fewest bytes that hold
                               the number and its sign

A list is a marker rather than (as in format 1) a record holding its packed items, so that
nested lists decode in one msgpack call: format 1 unpacked each level in a call of its own,
~40 KiB of C stack apiece. Codes 5 and 7 belong to format 1 and are corrupt in a format-2
value. A tensor, array or structured record owns the next ``nbytes`` of the buffers, and
``nbytes`` must equal the product of its shape times its itemsize. Tensor dtype codes are
positions in ``TORCH_DTYPES`` (append-only); dtypes numpy lacks (bfloat16, float8, ...)
travel as an unsigned integer of the same width.

A dtype string is the ``dtype.str`` of a plain fixed-size numpy dtype, and only these are
read (``_PLAIN_DTYPE``): an optional byte order ``<``, ``>``, ``|`` or ``=``, then ``b1``,
``i`` or ``u`` with 1, 2, 4 or 8, ``f`` with 2, 4, 8 or 16, ``c`` with 8, 16 or 32, ``S``,
``U`` or ``V`` with a size, or ``M8`` / ``m8`` with an optional ``[<count><unit>]``. Object
arrays, numpy's StringDType, dtypes with metadata and any other dtype are refused when
writing (``UnsupportedSampleError``) and corrupt when reading.

A dtype description (code 8) is a dtype string, a map for a structured dtype::

    {"names": [str], "formats": [description], "offsets": [int], "titles": [str or nil] or nil,
     "itemsize": int, "aligned": bool}

or a map ``{"base": description, "shape": [int]}`` for a subarray field. It is rebuilt
with ``np.dtype({names, formats, offsets, titles, itemsize}, align=aligned)`` from checked
pieces, so offsets, padding, titles, nested structures, subarrays and ``isalignedstruct``
come back as written. A structured dtype that this does not rebuild exactly (a
``np.record`` dtype, for one) is refused when writing.

The flat form. A sample that is a tuple of 1 to 255 items, each a tensor, an int that fits
in int64, a float or a bool (``(image, label)``, ``(features, target, weight)``), has a
structure in a second form, told apart by its first byte 0xC1 (a byte msgpack never
uses)::

    0xC1, <H signature length L>, signature (L bytes), scalars

    signature: per item, b"T" + the tensor's ext payload (as code 2), or a struct code
               b"q" (int64), b"d" (float64), b"?" (bool)
    scalars:   the scalar items, packed as struct "<" + their codes, in order

A tuple whose signature would pass 65535 bytes is written in the msgpack form; a flat
structure with no items, more than 255, or lengths that do not add up to S and to the
value's length is corrupt. Decoding the
flat form costs one cached lookup of the signature and one struct unpack, with no msgpack
call or ext hook: for small samples that is most of the per-sample overhead.

Limits. Writing beyond one raises ``UnsupportedSampleError`` naming where in the sample;
reading a value beyond one raises ``CorruptSampleError``:

- a value is at most 2**32 - 1 bytes (LMDB's largest value);
- containers (tuples, lists, dicts, tuple keys) nest at most 200 deep;
- tensors and arrays have at most 64 dimensions, none negative, and the product of the
  nonzero dimensions times the itemsize (1 if 0) is below 2**63 (numpy's own limit);
- an array of a zero-byte dtype (``V0``, a structured dtype without fields) holds at most
  2**20 elements;
- a structured dtype nests at most 32 deep;
- PIL images have one of the modes in ``_PIL_BITS``, sides below 2**31, a palette of mode
  RGB or RGBA of at most 1024 bytes (kept for modes P and PA only), and an image without
  pixels is at most 65535 on either side.

Arrays are stored C-contiguous: a non-contiguous tensor or array comes back contiguous
with the same shape and values; 0-d and empty arrays are ordinary cases (ndim 0, nbytes
0). A ``numpy.memmap`` comes back as a plain ``numpy.ndarray``; a PIL image of a subclass
(``PngImageFile``, ``JpegImageFile``, ...) comes back as a plain ``PIL.Image.Image`` with
its mode, size, pixels and palette (not its ``info`` or file); every other type comes back
as exactly the type that went in. Decoded tensors and arrays are writable and own their
memory: each buffer is copied once out of the value (``bytearray``) and nothing else is
copied.

Format 1
--------
Written by lmdbcache 0.1.0, and still read: the same header with version byte 1, and both
checksums seeded with 0 instead of the index (such a value is not bound to its key and
decodes under any index). Its records are those of format 2 except::

    code  type                 ext payload
    1     list                 a msgpack array of the items (read at most 32 lists deep:
                               each level costs msgpack ~40 KiB of C stack)
    5     int beyond 64 bits   its decimal digits in ASCII (read up to 4300 digits)
    7     structured ndarray   msgpack [is scalar, bin: msgpack-numpy's map of the array]

A code-7 map is parsed here, never by msgpack-numpy: exactly the keys b"nd" (true),
b"kind" (b"V"), b"type" (the ``dtype.descr`` list: [name, format] or [name, format,
shape], each format a dtype string or a nested list), b"shape" and b"data" (the bytes,
exactly shape x itemsize). It decodes to what 0.1.0 returned: ``np.dtype(descr)``, so
padding comes back as extra fields and titled fields cannot be read. Any other kind (b"O"
carries a pickle) is corrupt. Codes 8 and 9 are corrupt in a format-1 value.

Why not msgpack-numpy's own array encoding: it stores array bytes inside msgpack ``bin``
objects, which unpack into immutable ``bytes`` (one copy) that must be copied again to be
writable; that costs about a third of the throughput on image-sized samples. And its
reader unpickles object arrays, which a cache file must never make us do.
"""

from __future__ import annotations

import operator
import re
import struct
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from ._version import FORMAT_VERSION, OLDEST_READABLE_FORMAT
from .errors import CorruptSampleError, InvalidOptionError, UnsupportedSampleError

__all__ = ["TORCH_DTYPES", "decode", "encode"]

# The header's version byte is FORMAT_VERSION. A bump that changes the value layout must
# teach decode() the old one, as format 1 is taught here.
_MAGIC = b"LMC" + bytes([FORMAT_VERSION])
_HEAD = struct.Struct("<4sIQQ")
# The header, the structure's first byte and, in a flat structure, its signature length.
_HEAD_AND_FLAT = struct.Struct("<4sIQQBH")
_HEAD_AND_FIRST = struct.Struct("<4sIQQB")
_HEAD_SIZE = _HEAD.size  # 24

_MAX_VALUE = 0xFFFFFFFF  # LMDB's largest value (MAXDATASIZE)
_MAX_INDEX = 2**64 - 1  # the checksums' seed is a u64
_MAX_DEPTH = 200
_MAX_NDIM = 64
_MAX_ARRAY_BYTES = 2**63 - 1  # numpy's size * itemsize must fit its npy_intp
_MAX_EMPTY_ITEMS = 1 << 20
_MAX_DTYPE_DEPTH = 32
_MAX_DTYPE_SIZE = 2**31 - 1  # numpy keeps a dtype's itemsize in a C int
_MAX_SIGNATURE = 0xFFFF
_MAX_FLAT_ITEMS = 255
_MAX_PIL_SIDE = 2**31 - 1
_MAX_EMPTY_PIL_SIDE = 0xFFFF  # Pillow allocates a row pointer per line even when a line has no pixels
_MAX_PALETTE = 1024
_MAX_V1_LIST_DEPTH = 32
_MAX_V1_DIGITS = 4300  # Python's default int_max_str_digits: 0.1.0 could not write more
_SPECS_MAX = 4096  # entries per cache of parsed records (cleared when full)

_LIST, _TENSOR, _NDARRAY, _NPSCALAR, _PIL, _STRUCTURED, _BIGINT = 1, 2, 3, 4, 6, 8, 9
_V1_BIGINT, _V1_STRUCTURED = 5, 7

_TENSOR_HEAD = struct.Struct("<BBQ")
_U16 = struct.Struct("<H")
_ARRAY_HEAD = struct.Struct("<BQ")
_DIMS = [struct.Struct("<" + "q" * n) for n in range(_MAX_NDIM + 1)]

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


def _torch_dtype_table() -> tuple[dict[torch.dtype, tuple[int, torch.dtype | None]], dict[int, tuple]]:
    """Map each dtype this torch has to (code, carrier for encoding) and code to (dtype, numpy carrier, view)."""
    to_code: dict[torch.dtype, tuple[int, torch.dtype | None]] = {}
    from_code: dict[int, tuple] = {}
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


_TORCH_TO_CODE, _TORCH_FROM_CODE = _torch_dtype_table()

try:  # Pillow is optional; without it no sample can hold an image anyway.
    from PIL import Image as _PILImage
except ImportError:  # pragma: no cover - exercised only where Pillow is absent
    _PILImage = None  # type: ignore[assignment]

# Bits per pixel of every PIL mode stored; a row of Image.tobytes() is padded to a byte.
_PIL_BITS = {
    "1": 1, "L": 8, "P": 8, "LA": 16, "La": 16, "PA": 16, "I;16": 16, "I;16L": 16, "I;16B": 16,
    "I;16N": 16, "RGB": 24, "YCbCr": 24, "LAB": 24, "HSV": 24, "I": 32, "F": 32, "RGBA": 32,
    "RGBa": 32, "RGBX": 32, "CMYK": 32,
}  # fmt: skip
_PALETTE_MODES = ("RGB", "RGBA")

# The only dtype strings a value may name (see the format). Everything else, "|O" and
# "T" (StringDType) included, is refused before numpy sees it.
_PLAIN_DTYPE = re.compile(
    r"[<>|=]?(?:b1|[iu][1248]|f(?:2|4|8|16)|c(?:8|16|32)|[SUV][0-9]{1,10}"
    r"|[mM]8(?:\[[0-9]{0,10}(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?)"
)
_V1_DIGITS = re.compile(rb"-?[0-9]{1,%d}" % _MAX_V1_DIGITS)

_Packer = msgpack.Packer
_packb = _Packer(use_bin_type=True, unicode_errors="surrogatepass", autoreset=True).pack
_LIST_MARK = msgpack.ExtType(_LIST, b"")

_KEY_TYPES = (str, int, bytes, float, bool, type(None))


class _Unsupported(Exception):
    """Internal: carries the path to the offending value up to ``encode``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path: list[str] = []


def _typename(obj: object) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _location(path: list[str]) -> str:
    parts = path[::-1]
    if len(parts) > 12:  # a depth error: the first and last steps are enough to find it
        return f"sample{''.join(parts[:6])}...{''.join(parts[-3:])} ({len(parts)} levels down)"
    return "sample" + "".join(parts)


# ----------------------------------------------------------------------------------------
# Checks shared by the writer and the reader, so that whatever is written can be read.


def _shape_problem(shape: tuple, itemsize: int) -> str | None:
    """Why an array of this shape and itemsize cannot be stored, or None."""
    if len(shape) > _MAX_NDIM:
        return f"{len(shape)} dimensions, over the limit of {_MAX_NDIM}"
    size, count = itemsize or 1, 1
    for dim in shape:
        if dim < 0:
            return f"a negative dimension in shape {shape}"
        count *= dim
        if dim:
            size *= dim
            if size > _MAX_ARRAY_BYTES:
                return f"shape {shape} spans over 2**63 bytes (numpy's limit)"
    if not itemsize and count > _MAX_EMPTY_ITEMS:
        return f"{count} elements of a zero-byte dtype, over the limit of {_MAX_EMPTY_ITEMS}"
    return None


def _image_problem(mode: Any, width: Any, height: Any, nbytes: Any) -> str | None:
    """Why a PIL image of this mode, size and pixel byte count cannot be stored, or None."""
    bits = _PIL_BITS.get(mode) if type(mode) is str else None
    if bits is None:
        return f"mode {mode!r} is not one of {', '.join(_PIL_BITS)}"
    if not all(type(n) is int for n in (width, height, nbytes)):
        return "size or length of the wrong type"
    if not (0 <= width <= _MAX_PIL_SIDE and 0 <= height <= _MAX_PIL_SIDE):
        return f"size {width}x{height} out of range"
    if not (width and height) and max(width, height) > _MAX_EMPTY_PIL_SIDE:
        return f"an image without pixels of size {width}x{height} (at most {_MAX_EMPTY_PIL_SIDE} per side)"
    if nbytes != (width * bits + 7) // 8 * height:
        return f"{nbytes} pixel bytes for a {width}x{height} image of mode {mode}"
    return None


_PLAIN_DTYPES: dict[str, np.dtype] = {}


def _plain_dtype(s: Any) -> np.dtype:
    """The numpy dtype a dtype string names, after checking it against ``_PLAIN_DTYPE``."""
    dtype = _PLAIN_DTYPES.get(s) if type(s) is str else None
    if dtype is not None:
        return dtype
    if type(s) is not str or not _PLAIN_DTYPE.fullmatch(s):
        raise CorruptSampleError(f"dtype {s!r} is not a plain fixed-size numpy dtype")
    dtype = np.dtype(s)
    if dtype.hasobject or dtype.names is not None or dtype.subdtype is not None or dtype.kind not in "biufcSUVmM":
        raise CorruptSampleError(f"dtype {s!r} is not a plain fixed-size numpy dtype")  # pragma: no cover
    if len(_PLAIN_DTYPES) >= _SPECS_MAX:
        _PLAIN_DTYPES.clear()
    _PLAIN_DTYPES[s] = dtype
    return dtype


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > _MAX_NDIM or not all(type(n) is int for n in value):
        raise CorruptSampleError(f"the {what} is not a list of at most {_MAX_NDIM} integers")
    return tuple(value)


_STRUCT_KEYS = frozenset(["names", "formats", "offsets", "titles", "itemsize", "aligned"])
_SUBARRAY_KEYS = frozenset(["base", "shape"])


def _build_dtype(desc: Any, depth: int = 0) -> np.dtype:
    """The numpy dtype of a dtype description (see the format), built from checked pieces only."""
    if type(desc) is str:
        return _plain_dtype(desc)
    if depth >= _MAX_DTYPE_DEPTH or type(desc) is not dict:
        raise CorruptSampleError("a malformed or too deeply nested structured dtype")
    keys = desc.keys()
    if keys == _SUBARRAY_KEYS:
        shape = _int_tuple(desc["shape"], "subarray shape")
        base = _build_dtype(desc["base"], depth + 1)
        if not shape or _shape_problem(shape, base.itemsize):
            raise CorruptSampleError(f"a subarray field of shape {shape}")
        return np.dtype((base, shape))
    if keys != _STRUCT_KEYS:
        raise CorruptSampleError("a structured dtype with unexpected keys")
    names, formats, offsets = desc["names"], desc["formats"], desc["offsets"]
    titles, itemsize, aligned = desc["titles"], desc["itemsize"], desc["aligned"]
    n = len(names) if type(names) is list else -1
    if not (
        n >= 0
        and all(type(name) is str for name in names)
        and type(formats) is list
        and len(formats) == n
        and type(offsets) is list
        and len(offsets) == n
        and all(type(off) is int and 0 <= off <= _MAX_DTYPE_SIZE for off in offsets)
        and (titles is None or (type(titles) is list and len(titles) == n))
        and all(title is None or type(title) is str for title in titles or ())
        and type(itemsize) is int
        and 0 <= itemsize <= _MAX_DTYPE_SIZE
        and type(aligned) is bool
    ):
        raise CorruptSampleError("a malformed structured dtype")
    built = [_build_dtype(fmt, depth + 1) for fmt in formats]
    if any(off + fmt.itemsize > itemsize for off, fmt in zip(offsets, built)):
        raise CorruptSampleError("a structured dtype whose fields run past its itemsize")
    spec: Any = {"names": names, "formats": built, "offsets": offsets, "itemsize": itemsize}
    if titles is not None:
        spec["titles"] = titles
    return np.dtype(spec, align=aligned)


def _same_dtype(a: np.dtype, b: np.dtype) -> bool:
    """Whether two dtypes agree on everything the format promises to keep."""
    if (
        a != b
        or type(a) is not type(b)
        or a.type is not b.type
        or a.itemsize != b.itemsize
        or a.isalignedstruct != b.isalignedstruct
        or a.metadata is not None
        or b.metadata is not None
    ):
        return False
    if a.subdtype is not None or b.subdtype is not None:
        return (
            a.subdtype is not None
            and b.subdtype is not None
            and a.subdtype[1] == b.subdtype[1]
            and _same_dtype(a.subdtype[0], b.subdtype[0])
        )
    if a.names is None or b.names is None:
        return a.names is None and b.names is None and a.str == b.str
    if a.names != b.names:
        return False
    fields_a: Any = a.fields
    fields_b: Any = b.fields
    for name in a.names:
        fa, fb = fields_a[name], fields_b[name]
        if fa[1:] != fb[1:] or not _same_dtype(fa[0], fb[0]):
            return False
    return True


_PLAIN_STRS: dict[tuple, str | None] = {}


def _plain_str(dtype: np.dtype) -> str | None:
    """The dtype string of a plain fixed-size dtype, or None if it is not one."""
    if dtype.metadata is not None or dtype.names is not None or dtype.subdtype is not None:
        return None
    key = (dtype, dtype.type, type(dtype))  # equal dtypes may differ in scalar type or class
    if key in _PLAIN_STRS:
        return _PLAIN_STRS[key]
    s: str | None = dtype.str
    try:
        if not _same_dtype(_plain_dtype(s), dtype):
            s = None
    except CorruptSampleError:
        s = None
    if len(_PLAIN_STRS) >= _SPECS_MAX:
        _PLAIN_STRS.clear()
    _PLAIN_STRS[key] = s
    return s


def _refusal(dtype: np.dtype, where: str = "") -> str:
    what = f"numpy dtype {dtype}" + (f" (field {where})" if where else "")
    if dtype.kind == "T":
        return f"{what} is numpy's variable-length StringDType; convert it with .astype('U')"
    if dtype.hasobject:
        return f"{what} holds Python objects; convert it to a numeric dtype"
    if dtype.metadata is not None:
        return f"{what} carries metadata, which cannot be stored; drop it"
    return f"{what} is not a plain fixed-size numpy dtype"


def _describe_dtype(dtype: np.dtype, where: str = "", depth: int = 0) -> Any:
    """The dtype description of the format (code 8); raises ``_Unsupported``."""
    if depth >= _MAX_DTYPE_DEPTH:
        raise _Unsupported(f"a structured dtype nested over {_MAX_DTYPE_DEPTH} deep (field {where})")
    if dtype.metadata is not None:
        raise _Unsupported(_refusal(dtype, where))
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return {"base": _describe_dtype(base, where, depth + 1), "shape": list(shape)}
    if dtype.names is None:
        s = _plain_str(dtype)
        if s is None:
            raise _Unsupported(_refusal(dtype, where))
        return s
    formats, offsets, titles = [], [], []
    fields: Any = dtype.fields
    for name in dtype.names:
        fmt, offset, *title = fields[name]  # (dtype, offset) or (dtype, offset, title)
        title = title[0] if title else None
        if title is not None and type(title) is not str:
            raise _Unsupported(f"numpy dtype field {where}[{name!r}] has a title of type {_typename(title)}, not str")
        formats.append(_describe_dtype(fmt, f"{where}[{name!r}]", depth + 1))
        offsets.append(offset)
        titles.append(title)
    return {
        "names": list(dtype.names),
        "formats": formats,
        "offsets": offsets,
        "titles": titles if any(t is not None for t in titles) else None,
        "itemsize": dtype.itemsize,
        "aligned": dtype.isalignedstruct,
    }


# ----------------------------------------------------------------------------------------
# Writing


class _Encoder:
    __slots__ = ("buffers", "depth")

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.depth = 0

    def prepare(self, obj: Any) -> Any:
        """Return ``obj`` as msgpack-native values and ext records, collecting buffers."""
        cls = type(obj)
        if cls is str or cls is float or cls is bool or obj is None:
            if cls is str and len(obj) > _MAX_VALUE // 4 and len(obj.encode("utf-8", "surrogatepass")) > _MAX_VALUE:
                raise _Unsupported(f"str over LMDB's limit of {_MAX_VALUE} bytes per value")
            return obj
        if cls is bytes:
            if len(obj) > _MAX_VALUE:
                raise _Unsupported(f"bytes over LMDB's limit of {_MAX_VALUE} bytes per value")
            return obj
        if cls is int:
            if -(2**63) <= obj < 2**64:
                return obj
            return msgpack.ExtType(_BIGINT, obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True))
        if cls is tuple:
            return self.items(obj, [])
        if cls is list:
            return self.items(obj, [_LIST_MARK])
        if cls is dict:
            self.enter()
            out = {self.key(key): self.child(value, key) for key, value in obj.items()}
            self.depth -= 1
            return out
        if cls is torch.Tensor:
            return self.tensor(obj)
        if isinstance(obj, np.ndarray) and (cls is np.ndarray or cls is np.memmap):
            return self.array(obj.view(np.ndarray), False)
        if isinstance(obj, np.generic):
            arr = np.asarray(obj)
            if arr.dtype.type is not cls:
                raise _Unsupported(f"unsupported type {_typename(obj)} (a subclass of a numpy scalar type)")
            return self.array(arr, True)
        if _PILImage is not None and isinstance(obj, _PILImage.Image):
            return self.image(obj)
        hint = ""
        if isinstance(obj, tuple):
            hint = " (a tuple subclass such as a namedtuple: convert it with tuple(x) or x._asdict())"
        elif isinstance(obj, (dict, list)):
            hint = f" (a subclass of {cls.__mro__[1].__name__}: convert it to a plain one)"
        elif isinstance(obj, torch.Tensor):
            hint = " (a Tensor subclass such as Parameter: store obj.detach() as a plain tensor)"
        raise _Unsupported(f"unsupported type {_typename(obj)}{hint}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Unsupported(f"containers nested over {_MAX_DEPTH} deep, the limit; flatten the sample")

    def items(self, seq: tuple | list, out: list) -> list:
        self.enter()
        for i, item in enumerate(seq):
            out.append(self.child(item, i))
        self.depth -= 1
        return out

    def key(self, key: Any) -> Any:
        """A dict key: a scalar, or a tuple of them (msgpack arrays decode as tuples: hashable)."""
        cls = type(key)
        if cls is tuple:
            self.enter()
            out = tuple(self.key(k) for k in key)
            self.depth -= 1
            return out
        if cls in _KEY_TYPES:
            return self.prepare(key)
        raise _Unsupported(f"dict key {key!r} of type {_typename(key)}; keys must be str, int or other scalars")

    def child(self, obj: Any, key: Any) -> Any:
        try:
            return self.prepare(obj)
        except _Unsupported as exc:
            exc.path.append(f"[{key!r}]")
            raise

    def tensor(self, t: torch.Tensor) -> msgpack.ExtType:
        if t.layout is not torch.strided or t.is_quantized:
            raise _Unsupported(f"tensor with layout {t.layout} / dtype {t.dtype}; store t.to_dense() or t.dequantize()")
        if t.device.type != "cpu":
            raise _Unsupported(f"tensor on device {t.device}; move it to the CPU with .cpu() before caching")
        if t.requires_grad:
            raise _Unsupported("tensor that requires grad; cache t.detach() instead")
        entry = _TORCH_TO_CODE.get(t.dtype)
        if entry is None:
            raise _Unsupported(f"tensor of dtype {t.dtype}")
        ndim = t.dim()
        if ndim > _MAX_NDIM:
            raise _Unsupported(f"tensor with {ndim} dimensions, over the limit of {_MAX_NDIM}")
        return self.tensor_record(t, entry, ndim)

    def tensor_record(self, t: torch.Tensor, entry: tuple[int, torch.dtype | None], ndim: int) -> msgpack.ExtType:
        """The record of a tensor whose type, layout, device, dtype (``entry``) and ``ndim`` were checked."""
        code, carrier = entry
        try:
            if not t.numel():
                problem = _shape_problem(tuple(t.shape), t.element_size())
                if problem:
                    raise _Unsupported(f"tensor with {problem}")
            t = t.resolve_conj().resolve_neg().contiguous()
            flat = t.reshape(-1)
            arr = (flat if carrier is None else flat.view(carrier)).numpy()
        except (RuntimeError, TypeError, ValueError) as exc:
            what = "a nested tensor" if t.is_nested else f"a tensor whose bytes cannot be read ({exc})"
            raise _Unsupported(f"{what}; store its parts as plain tensors") from None
        buf = arr.data.cast("B")
        self.buffers.append(buf)
        return msgpack.ExtType(_TENSOR, _TENSOR_HEAD.pack(code, ndim, buf.nbytes) + _DIMS[ndim].pack(*t.shape))

    def flat(self, sample: tuple) -> bytes | None:
        """The flat structure of ``sample`` (see the format), or None if it does not qualify."""
        if not 0 < len(sample) <= _MAX_FLAT_ITEMS:
            return None
        codes: list[Any] = []  # per item: its struct code, or (tensor dtype entry, ndim)
        size = 0
        for item in sample:  # qualify first: nothing is collected for a sample that falls back
            cls = type(item)
            if cls is torch.Tensor:
                entry = _TORCH_TO_CODE.get(item.dtype)
                ndim = item.dim()
                if (
                    entry is None
                    or item.layout is not torch.strided
                    or item.device.type != "cpu"
                    or item.requires_grad
                    or ndim > _MAX_NDIM
                ):
                    return None  # the general form reports the problem with its location
                codes.append((entry, ndim))
                size += 1 + _TENSOR_HEAD.size + 8 * ndim
            elif (cls is int and -(2**63) <= item < 2**63) or cls is float or cls is bool:
                codes.append("q" if cls is int else "d" if cls is float else "?")
                size += 1
            else:
                return None
        if size > _MAX_SIGNATURE:
            return None
        signature: list[bytes] = []
        scalar_codes, scalars = "<", []
        for k, (item, code) in enumerate(zip(sample, codes)):
            if type(code) is tuple:
                try:
                    signature.append(b"T" + self.tensor_record(item, *code).data)
                except _Unsupported as exc:
                    exc.path.append(f"[{k}]")
                    raise
            else:
                signature.append(code.encode())
                scalar_codes += code
                scalars.append(item)
        return b"\xc1" + _U16.pack(size) + b"".join(signature) + struct.pack(scalar_codes, *scalars)

    def array(self, a: np.ndarray, scalar: bool) -> msgpack.ExtType:
        dtype = a.dtype
        if dtype.names is not None:
            return self.structured(a, scalar)
        s = _plain_str(dtype)
        if s is None:
            raise _Unsupported(_refusal(dtype))
        if not a.size or not dtype.itemsize:
            problem = _shape_problem(a.shape, dtype.itemsize)
            if problem:
                raise _Unsupported(f"numpy array with {problem}")
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # not ascontiguousarray: it turns 0-d into 1-d
        buf = a.reshape(-1).view(np.uint8).data if a.nbytes else memoryview(b"")
        self.buffers.append(buf)
        ndim = a.ndim
        head = _ARRAY_HEAD.pack(ndim, buf.nbytes) + _DIMS[ndim].pack(*a.shape)
        return msgpack.ExtType(_NPSCALAR if scalar else _NDARRAY, head + s.encode("ascii"))

    def structured(self, a: np.ndarray, scalar: bool) -> msgpack.ExtType:
        dtype = a.dtype
        desc = _describe_dtype(dtype)
        try:
            rebuilt = _build_dtype(desc)
        except (CorruptSampleError, ValueError, TypeError) as exc:
            raise _Unsupported(f"structured numpy dtype {dtype} that cannot be rebuilt ({exc})") from None
        if not _same_dtype(rebuilt, dtype):
            raise _Unsupported(
                f"structured numpy dtype {dtype!r} that does not rebuild exactly from its fields (np.record "
                "dtypes, from np.recarray, do not); convert it with a.view(np.dtype((np.void, a.dtype)))"
            )
        problem = _shape_problem(a.shape, dtype.itemsize)
        if problem:
            raise _Unsupported(f"numpy array with {problem}")
        nbytes = a.size * dtype.itemsize
        if nbytes:
            # The raw bytes, padding included: numpy's own copy (and tobytes) skip the padding
            # of a non-contiguous structured array.
            raw = a[..., None].view(np.uint8)
            if not raw.flags.c_contiguous:
                raw = raw.copy()
            buf = raw.reshape(-1).data
        else:
            buf = memoryview(b"")
        self.buffers.append(buf)
        return msgpack.ExtType(_STRUCTURED, _packb([list(a.shape), nbytes, desc, scalar]))

    def image(self, im: Any) -> msgpack.ExtType:
        mode = im.mode
        if mode not in _PIL_BITS:
            raise _Unsupported(f"PIL image of mode {mode!r}; convert it to one of {', '.join(_PIL_BITS)}")
        try:
            data = memoryview(im.tobytes())
        except Exception as exc:  # a lazily loaded file that is truncated or damaged
            raise _Unsupported(f"PIL image whose pixels cannot be read ({type(exc).__name__}: {exc})") from None
        problem = _image_problem(mode, im.size[0], im.size[1], data.nbytes)
        if problem:
            raise _Unsupported(f"PIL image with {problem}")
        palette = im.palette
        pal_mode, pal = None, None
        if palette is not None and mode in ("P", "PA"):
            pal_mode, pal = palette.mode, bytes(palette.tobytes())
            if pal_mode not in _PALETTE_MODES or len(pal) > _MAX_PALETTE or len(pal) % len(pal_mode):
                raise _Unsupported(f"PIL palette of mode {pal_mode!r} and {len(pal)} bytes; use an RGB or RGBA palette")
        self.buffers.append(data)
        return msgpack.ExtType(_PIL, _packb([mode, im.size[0], im.size[1], data.nbytes, pal_mode, pal]))


def encode(sample: Any, index: int) -> bytes:
    """Serialize ``sample`` to the value stored under ``index`` (format above).

    Raises ``UnsupportedSampleError`` naming the index, the location (``sample[1]['meta']``)
    and the type or limit of the first value that cannot be stored; nothing is produced in
    that case.
    """
    try:
        index = operator.index(index)
        valid = 0 <= index <= _MAX_INDEX
    except TypeError:
        valid = False
    if not valid:
        raise InvalidOptionError(f"Cannot encode index {index!r}: an index is an int from 0 to 2**64 - 1.")
    enc = _Encoder()
    try:
        structure = (type(sample) is tuple and enc.flat(sample)) or _packb(enc.prepare(sample))
    except _Unsupported as exc:
        raise UnsupportedSampleError(f"Cannot encode index {index} at {_location(exc.path)}: {exc.reason}.") from None
    except RecursionError:
        raise UnsupportedSampleError(
            f"Cannot encode index {index}: the sample is nested too deeply for the Python stack "
            f"(at most {_MAX_DEPTH} levels are stored)."
        ) from None
    data_hash = index
    for buf in enc.buffers:
        data_hash = _xxh3(buf, data_hash)
    head = _HEAD.pack(_MAGIC, len(structure), _xxh3(structure, index), data_hash)
    value = b"".join([head, structure, *enc.buffers])
    if len(value) > _MAX_VALUE:
        raise UnsupportedSampleError(
            f"Cannot encode index {index}: it is {len(value)} bytes once encoded, over LMDB's limit of "
            f"{_MAX_VALUE} bytes per value. Split it across several indices."
        )
    return value


# ----------------------------------------------------------------------------------------
# Reading

# Parsed ext payloads of tensors and arrays, keyed by the payload bytes. A dataset's
# samples nearly always share a handful of shapes, so decoding a tensor usually costs one
# dict lookup instead of two struct parses and a dtype lookup. An entry is made only after
# every check that depends on the payload alone passed, so a hit skips no check. Cleared
# when it grows large.
_Spec = tuple  # (nbytes, numpy dtype, shape, torch dtype to view as or, for code 8, is scalar)
_TENSOR_SPECS: dict[bytes, _Spec] = {}
_ARRAY_SPECS: dict[bytes, _Spec] = {}
_STRUCT_SPECS: dict[bytes, _Spec] = {}


def _remember(cache: dict, key: bytes, spec: _Spec) -> _Spec:
    if len(cache) >= _SPECS_MAX:
        cache.clear()
    cache[key] = spec
    return spec


def _check_nbytes(shape: tuple, dtype: np.dtype, nbytes: Any) -> None:
    problem = _shape_problem(shape, dtype.itemsize)
    if problem:
        raise CorruptSampleError(f"an array record with {problem}")
    count = 1
    for dim in shape:
        count *= dim
    if nbytes != count * dtype.itemsize:
        raise CorruptSampleError(f"an array record of shape {shape} and dtype {dtype} claims {nbytes} bytes")


def _spec(code: int, data: bytes) -> _Spec:
    """Parse and check a tensor or array payload (see the format) and remember it."""
    if code == _TENSOR:
        dtype_code, ndim, nbytes = _TENSOR_HEAD.unpack_from(data)
        if ndim > _MAX_NDIM or len(data) != _TENSOR_HEAD.size + 8 * ndim:
            raise CorruptSampleError("a tensor record of the wrong length")
        shape = _DIMS[ndim].unpack_from(data, _TENSOR_HEAD.size)
        entry = _TORCH_FROM_CODE.get(dtype_code)
        if entry is None:
            name = TORCH_DTYPES[dtype_code] if dtype_code < len(TORCH_DTYPES) else f"code {dtype_code}"
            raise CorruptSampleError(f"tensor dtype {name} is not available in torch {torch.__version__}")
        _, carrier, view = entry
        _check_nbytes(shape, carrier, nbytes)
        return _remember(_TENSOR_SPECS, data, (nbytes, carrier, shape, view))
    ndim, nbytes = _ARRAY_HEAD.unpack_from(data)
    if ndim > _MAX_NDIM:
        raise CorruptSampleError(f"an array record of {ndim} dimensions")
    start = _ARRAY_HEAD.size + 8 * ndim
    shape = _DIMS[ndim].unpack_from(data, _ARRAY_HEAD.size)
    dtype = _plain_dtype(bytes(data[start:]).decode("ascii"))
    _check_nbytes(shape, dtype, nbytes)
    return _remember(_ARRAY_SPECS, data, (nbytes, dtype, shape, None))


def _unpack_plain(data: Any) -> Any:
    """msgpack data inside a record: no ext hook (an ext comes back as an ExtType and is refused)."""
    return _unpackb(data, raw=False, use_list=True, strict_map_key=True)


def _struct_spec(data: bytes) -> _Spec:
    items = _unpack_plain(data)
    if type(items) is not list or len(items) != 4:
        raise CorruptSampleError("a malformed structured array record")
    shape = _int_tuple(items[0], "shape")
    nbytes, dtype, scalar = items[1], _build_dtype(items[2]), items[3]
    if type(nbytes) is not int or type(scalar) is not bool or (scalar and shape):
        raise CorruptSampleError("a malformed structured array record")
    _check_nbytes(shape, dtype, nbytes)
    return _remember(_STRUCT_SPECS, data, (nbytes, dtype, shape, scalar))


def _array(shape: tuple, dtype: np.dtype, buf: bytearray) -> np.ndarray:
    # A zero-byte dtype cannot sit on a buffer; such an array holds no bytes. Its element
    # count was checked, which keeps np.empty small even where it widens "<U0" to "<U1".
    return _ndarray(shape, dtype, buf) if dtype.itemsize else np.empty(shape, dtype)


def _v1_dtype(descr: Any, depth: int = 0) -> np.dtype:
    """The dtype of a format-1 ``dtype.descr`` list, as 0.1.0 built it, from checked pieces."""
    if depth >= _MAX_DTYPE_DEPTH or type(descr) is not list:
        raise CorruptSampleError("a malformed format-1 structured dtype")
    fields: list[tuple] = []
    for entry in descr:
        if type(entry) is not list or not 2 <= len(entry) <= 3 or type(entry[0]) is not str:
            raise CorruptSampleError("a malformed format-1 structured dtype field")
        fmt = entry[1]
        base = _plain_dtype(fmt) if type(fmt) is str else _v1_dtype(fmt, depth + 1)
        if len(entry) == 2:
            fields.append((entry[0], base))
        else:
            shape = _int_tuple(entry[2], "subarray shape")
            if _shape_problem(shape, base.itemsize):
                raise CorruptSampleError(f"a format-1 subarray field of shape {shape}")
            fields.append((entry[0], base, shape))
    return np.dtype(fields)


def _v1_structured(data: bytes) -> Any:
    """A format-1 code-7 record, parsed by hand: msgpack-numpy's reader would unpickle kind b"O"."""
    outer = _unpack_plain(data)
    if type(outer) is not list or len(outer) != 2 or type(outer[0]) is not bool or type(outer[1]) is not bytes:
        raise CorruptSampleError("a malformed format-1 structured array record")
    record = _unpack_plain(outer[1])
    if type(record) is not dict or record.keys() != {b"nd", b"type", b"kind", b"shape", b"data"}:
        raise CorruptSampleError("a malformed format-1 structured array record")
    if record[b"nd"] is not True or record[b"kind"] != b"V":
        raise CorruptSampleError(
            f"a format-1 numpy record of kind {record[b'kind']!r}: only structured arrays are read "
            "(object arrays are never unpickled)"
        )
    dtype = _v1_dtype(record[b"type"])
    shape = _int_tuple(record[b"shape"], "shape")
    raw = record[b"data"]
    if type(raw) is not bytes:
        raise CorruptSampleError("a malformed format-1 structured array record")
    _check_nbytes(shape, dtype, len(raw))
    arr = _array(shape, dtype, bytearray(raw))
    return arr[()] if outer[0] else arr


def _v1_bigint(data: bytes) -> int:
    if not _V1_DIGITS.fullmatch(data):
        raise CorruptSampleError(f"a format-1 big int record of {len(data)} bytes that are not at most 4300 digits")
    return int(data)


class _Decoder:
    """Decodes one msgpack-form value; ``hook`` is msgpack's ext_hook and walks the buffers in order.

    With ``verify`` false the data checksum is not computed; every length is still checked.
    """

    __slots__ = ("data_hash", "depth", "lists", "marks", "pos", "v1", "value", "verify")

    def __init__(self, value: memoryview, pos: int, seed: int, verify: bool, v1: bool) -> None:
        self.value = value
        self.pos = pos
        self.data_hash = seed
        self.verify = verify
        self.v1 = v1
        self.depth = self.marks = self.lists = 0

    def view(self, nbytes: int) -> memoryview:
        """The next buffer, as a view into the value, hashed."""
        pos = self.pos
        if nbytes > len(self.value) - pos:
            raise CorruptSampleError("a buffer runs past the end of the value")
        self.pos = pos + nbytes
        buf = self.value[pos : pos + nbytes]
        if self.verify:
            self.data_hash = _xxh3(buf, self.data_hash)
        return buf

    def take(self, nbytes: int) -> bytearray:
        """Copy the next buffer out of the value (the one copy) and hash the copy."""
        pos = self.pos
        if nbytes > len(self.value) - pos:
            raise CorruptSampleError("a buffer runs past the end of the value")
        self.pos = pos + nbytes
        buf = bytearray(self.value[pos : pos + nbytes])
        if self.verify:
            self.data_hash = _xxh3(buf, self.data_hash)
        return buf

    def hook(self, code: int, data: bytes) -> Any:
        if code == _TENSOR:  # the hot path, kept flat
            spec = _TENSOR_SPECS.get(data) or _spec(code, data)
            t = _from_numpy(_ndarray(spec[2], spec[1], self.take(spec[0])))
            return t if spec[3] is None else t.view(spec[3])
        if code in (_NDARRAY, _NPSCALAR):
            nbytes, dtype, shape, _ = _ARRAY_SPECS.get(data) or _spec(code, data)
            arr = _array(shape, dtype, self.take(nbytes))
            if code == _NDARRAY:
                return arr
            if shape:  # checked here, not in _spec: both codes share the cache
                raise CorruptSampleError("a numpy scalar record with a shape")
            return arr[()]
        if code == _LIST:
            if self.v1:
                return self.v1_list(data)
            if data:
                raise CorruptSampleError("a list marker with a payload")
            self.marks += 1
            return _LIST_MARK
        if code == _PIL:
            return self.image(data)
        if code == _STRUCTURED and not self.v1:
            nbytes, dtype, shape, scalar = _STRUCT_SPECS.get(data) or _struct_spec(data)
            arr = _array(shape, dtype, self.take(nbytes))
            return arr[()] if scalar else arr
        if code == _BIGINT and not self.v1 and data:
            return int.from_bytes(data, "little", signed=True)
        if code == _V1_BIGINT and self.v1:
            return _v1_bigint(data)
        if code == _V1_STRUCTURED and self.v1:
            return _v1_structured(data)
        raise CorruptSampleError(f"an unknown ext record (type {code}, {len(data)} bytes)")

    def list_hook(self, items: tuple) -> Any:
        """Every msgpack array: a tuple, or a list when it starts with the list marker."""
        if items and items[0] is _LIST_MARK:
            self.lists += 1
            return list(items[1:])
        return items

    def v1_list(self, data: bytes) -> list:
        # Each level is a nested msgpack call with its own ~40 KiB stack: bounded so that a
        # hostile value cannot overflow the C stack.
        self.depth += 1
        if self.depth > _MAX_V1_LIST_DEPTH:
            raise CorruptSampleError(f"format-1 lists nested over {_MAX_V1_LIST_DEPTH} deep")
        out = list(self.unpack(data))
        self.depth -= 1
        return out

    def image(self, data: bytes) -> Any:
        if _PILImage is None:  # pragma: no cover
            raise CorruptSampleError("the value holds a PIL image but Pillow is not installed (pip install pillow)")
        items = _unpack_plain(data)
        if type(items) is not list or len(items) != 6:
            raise CorruptSampleError("a malformed PIL image record")
        mode, width, height, nbytes, pal_mode, pal = items
        problem = _image_problem(mode, width, height, nbytes)
        if problem:
            raise CorruptSampleError(f"a PIL image record with {problem}")
        if not (pal_mode is None and pal is None) and not (
            mode in ("P", "PA")
            and pal_mode in _PALETTE_MODES
            and type(pal) is bytes
            and len(pal) <= _MAX_PALETTE
            and len(pal) % len(pal_mode) == 0
        ):
            raise CorruptSampleError("a malformed PIL palette")
        im = _PILImage.frombytes(mode, (width, height), self.view(nbytes))
        if pal is not None:
            im.putpalette(pal, pal_mode)
        return im

    def unpack(self, data: Any) -> Any:
        return _unpackb(
            data,
            use_list=False,
            raw=False,
            strict_map_key=False,
            ext_hook=self.hook,
            list_hook=None if self.v1 else self.list_hook,
            unicode_errors="surrogatepass",
        )


_xxh3 = xxhash.xxh3_64_intdigest
_unpackb = msgpack.unpackb
_from_numpy = torch.from_numpy
_ndarray = np.ndarray
_head = _HEAD_AND_FLAT.unpack_from


def decode(value: bytes | memoryview, index: int, *, verify_data: bool = True) -> Any:
    """Rebuild the sample stored under ``index`` from its value (bytes, or a memoryview into the map).

    The structure checksum is verified on every call; the data checksum when
    ``verify_data`` (pass False only for a value this process has verified before).
    Raises ``CorruptSampleError`` with a short reason for anything wrong with the value:
    a damaged value, or one stored under another index, is never returned as data.
    """
    mv = value if type(value) is memoryview else memoryview(value)
    try:
        magic, size, structure_hash, data_hash, first, sig_size = _head(mv)
    except struct.error:  # a value under 27 bytes: no flat structure is that short
        magic, size, structure_hash, data_hash, first = _short_head(mv)
        sig_size = 0
    if not 0 <= index <= _MAX_INDEX:
        raise InvalidOptionError(f"Cannot decode index {index!r}: an index is an int from 0 to 2**64 - 1.")
    seed = index if magic == _MAGIC else _format_1_seed(magic)
    end = 24 + size  # _HEAD_SIZE, spelled out on the hot path
    structure = mv[24:end]
    if _xxh3(structure, seed) != structure_hash:
        raise CorruptSampleError(
            "the structure checksum does not match: the value is damaged or was stored under another index"
        )
    if first != 0xC1:
        return _decode_msgpack(mv, structure, end, seed, data_hash, verify_data, magic != _MAGIC)
    # A flat tuple (see the format), inline: this is the per-sample hot path.
    try:
        # The key holds the signature's length too, so a hit means the length is right.
        signature = mv[25 : 27 + sig_size]  # hashable: a read-only byte view
        unpack_scalars, scalars_at, struct_size, value_size, tensors, order, single = _PLANS.get(signature) or _plan(
            bytes(signature)
        )
        if size != struct_size or len(mv) != value_size:
            raise CorruptSampleError("the flat structure's lengths do not add up to the value's")
        scalars = unpack_scalars(mv, scalars_at)
        if single is not None:  # one tensor, then scalars: (image, label) and the like
            dtype, shape, view = single
            buf = bytearray(mv[end:])  # the one copy out of the map; the lengths were checked above
            digest = _xxh3(buf, seed) if verify_data else data_hash
            t = _from_numpy(_ndarray(shape, dtype, buf))
            sample = (t if view is None else t.view(view), *scalars)
        else:
            out = []
            pos, digest = end, seed
            for nbytes, dtype, shape, view in tensors:
                stop = pos + nbytes
                buf = bytearray(mv[pos:stop])  # the one copy out of the map
                pos = stop
                if verify_data:
                    digest = _xxh3(buf, digest)
                t = _from_numpy(_ndarray(shape, dtype, buf))
                out.append(t if view is None else t.view(view))
            sample = (*out, *scalars) if order is None else tuple([out[k] if k >= 0 else scalars[~k] for k in order])
    except CorruptSampleError:
        raise
    except Exception as exc:
        if not _hashable(mv):  # a view of a bytearray cannot key the plan lookup: decode a bytes copy
            return decode(bytes(mv), index, verify_data=verify_data)
        raise CorruptSampleError(f"the flat structure does not parse ({type(exc).__name__}: {exc})") from None
    if verify_data and digest != data_hash:
        raise CorruptSampleError("the data checksum does not match")
    return sample


def _hashable(mv: memoryview) -> bool:
    try:
        hash(mv[:0])
    except (TypeError, ValueError):
        return False
    return True


def _short_head(mv: memoryview) -> tuple:
    try:
        return _HEAD_AND_FIRST.unpack_from(mv)
    except struct.error:
        raise CorruptSampleError(f"the value is {len(mv)} bytes, shorter than the smallest value (25)") from None


def _format_1_seed(magic: bytes) -> int:
    """The checksum seed of a value whose version byte is not FORMAT_VERSION: 0 for format 1."""
    if magic[:3] != b"LMC":
        raise CorruptSampleError(f"bad magic {bytes(magic[:3])!r} (expected b'LMC'): not an lmdbcache value")
    version = magic[3]
    if version > FORMAT_VERSION:
        raise CorruptSampleError(
            f"written by lmdbcache format {version}; this lmdbcache reads formats "
            f"{OLDEST_READABLE_FORMAT} to {FORMAT_VERSION}: upgrade lmdbcache"
        )
    if version != 1 or version < OLDEST_READABLE_FORMAT:
        raise CorruptSampleError(
            f"format version {version} is not one lmdbcache wrote or reads "
            f"({OLDEST_READABLE_FORMAT} to {FORMAT_VERSION})"
        )
    return 0


def _decode_msgpack(
    mv: memoryview, structure: memoryview, end: int, seed: int, data_hash: int, verify: bool, v1: bool
) -> Any:
    if end > len(mv):
        raise CorruptSampleError(f"the structure runs past the end of the value ({end} > {len(mv)} bytes)")
    dec = _Decoder(mv, end, seed, verify, v1)
    try:
        sample = dec.unpack(structure)
    except CorruptSampleError:
        raise
    except Exception as exc:  # checksummed, yet unparseable: written by a buggy or foreign writer
        raise CorruptSampleError(f"the structure does not parse ({type(exc).__name__}: {exc})") from None
    if dec.marks != dec.lists:
        raise CorruptSampleError("a list marker outside the head of an array")
    if dec.pos != len(mv):
        raise CorruptSampleError(f"the value ends at byte {len(mv)}, not where its last buffer does ({dec.pos})")
    if verify and dec.data_hash != data_hash:
        raise CorruptSampleError("the data checksum does not match")
    return sample


# Compiled flat signatures: the signature's length (u16) and bytes -> (scalar unpacker,
# the scalars' offset in the value, the structure's size, the value's size, tensor specs
# in order, the item order as indices into the tensors (k) or the scalars (~k) or None
# when the tensors all come first, and the (dtype, shape, view) of a sole first tensor).
_PLANS: dict[Any, tuple] = {}  # looked up by memoryview slices, which hash like bytes


def _plan(key: bytes) -> tuple:
    """Parse and check a flat structure's signature length and signature, and remember them."""
    if len(key) < 2 or _U16.unpack_from(key)[0] != len(key) - 2:
        raise CorruptSampleError("the flat structure's signature runs past the end of the value")
    signature = key[2:]
    codes, i = "<", 0
    tensors: list[_Spec] = []
    order: list[int] = []
    while i < len(signature):
        tag = signature[i : i + 1]
        if tag == b"T":
            if i + 3 > len(signature):
                raise CorruptSampleError("the flat structure's signature is cut short")
            size = _TENSOR_HEAD.size + 8 * signature[i + 2]
            payload = signature[i + 1 : i + 1 + size]
            order.append(len(tensors))
            tensors.append(_TENSOR_SPECS.get(payload) or _spec(_TENSOR, payload))
            i += 1 + size
        elif tag in (b"q", b"d", b"?"):
            order.append(~(len(codes) - 1))
            codes += tag.decode()
            i += 1
        else:
            raise CorruptSampleError(f"unknown item tag {tag!r} in a flat structure")
    if not 0 < len(order) <= _MAX_FLAT_ITEMS:
        raise CorruptSampleError(f"a flat structure of {len(order)} items")
    tensors_first = order == list(range(len(tensors))) + [~k for k in range(len(codes) - 1)]
    scalars = struct.Struct(codes)
    struct_size = 1 + len(key) + scalars.size
    value_size = _HEAD_SIZE + struct_size + sum(spec[0] for spec in tensors)
    plan = (
        scalars.unpack_from,
        _HEAD_SIZE + 1 + len(key),
        struct_size,
        value_size,
        tuple(tensors),
        None if tensors_first else tuple(order),
        tensors[0][1:] if tensors_first and len(tensors) == 1 else None,
    )
    return _remember(_PLANS, key, plan)
