"""Turn one sample into bytes and back, exactly, with one copy out of the memory map.

The value format (``CODEC``, value version 1)
=============================================

One LMDB value holds one sample. All integers are little-endian::

    offset  size  field
    0       3     magic b"LMC"
    3       1     value version, 1
    4       4     S, the length of the structure (u32)
    8       8     xxh3_64 of the structure, seed 0
    16      8     data checksum: xxh3_64 chained over the buffers in order, each hashed with
                  the previous hash as its seed (first seed 0); 0 when there are no buffers
    24      S     structure: one msgpack object (below)
    24+S    ...   buffers: the raw bytes of every array in the sample, concatenated in the order
                  their records appear in the structure (depth first, left to right), unpadded.
                  The value ends exactly where the last buffer ends.

The structure uses msgpack's own nil, bool, int (-2**63 .. 2**64-1), float (always
double), str (UTF-8, lone surrogates passed through), bin (bytes), array (decoded as
``tuple``: samples are usually tuples, so the common case needs no ext record) and map
(decoded as ``dict``; keys str, int, or any other scalar above). Everything else is an
ext record:

    code  type               ext payload
    1     list               a msgpack array of the items, encoded by these same rules
    2     torch.Tensor       <B dtype code><B ndim><Q nbytes> then ndim x <q dim>
    3     numpy.ndarray      <B ndim><Q nbytes> then ndim x <q dim>, then dtype.str in ASCII
    4     numpy scalar       as 3 with ndim 0; decoded as ``array[()]``
    5     int beyond 64 bit  its decimal digits in ASCII
    6     PIL.Image.Image    msgpack [mode, width, height, nbytes, palette mode or nil,
                                      palette bytes or nil]; pixels (``Image.tobytes()``) in a buffer
    7     structured ndarray msgpack-numpy's encoding of the array (field names and all), inline

Flat tuples. A sample that is a tuple of 1 to 255 items, each a tensor, an int that fits
in int64, a float or a bool (``(image, label)``, ``(features, target, weight)``), has a
structure in a second, flat form, told apart by its first byte 0xC1 (a byte msgpack
never uses)::

    0xC1, <H signature length L>, signature (L bytes), scalars

    signature: per item, b"T" + the tensor's ext payload (as code 2), or a struct code
               b"q" (int64), b"d" (float64), b"?" (bool)
    scalars:   the scalar items, packed as struct "<" + their codes, in order

Decoding it costs one cached lookup of the signature and one struct unpack, with no
msgpack call or ext hook: for small samples that is most of the per-sample overhead.

Tensor dtype codes are the positions in ``TORCH_DTYPES`` below (append-only). Arrays
are stored C-contiguous: a non-contiguous tensor or array comes back contiguous with the
same shape and values; 0-d and empty arrays are ordinary cases (ndim 0, nbytes 0).
A ``numpy.memmap`` comes back as a plain ``numpy.ndarray``; every other type comes back
as exactly the type that went in.

Decoding verifies the structure checksum before parsing it and the data checksum over
the copies it made, so a damaged value raises ``CorruptSampleError`` and is never
returned. Decoded tensors and arrays are writable and own their memory: each buffer is
copied once out of the value (``bytearray``) and nothing else is copied.

Why not msgpack-numpy's own array encoding: it stores array bytes inside msgpack ``bin``
objects, which unpack into immutable ``bytes`` (one copy) that must be copied again to
be writable; that costs about a third of the throughput on image-sized samples. It is
still used for structured dtypes (code 7), which are rare and which it handles well.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from .errors import CorruptSampleError, UnsupportedSampleError

__all__ = ["CODEC", "TORCH_DTYPES", "decode", "encode"]

CODEC = "lmdbcache-msgpack/1"

_MAGIC = b"LMC\x01"
_HEAD = struct.Struct("<4sIQQ")
_HEAD_SIZE = _HEAD.size  # 24
_MAX_VALUE = 0xFFFFFFFF  # LMDB's largest value (MAXDATASIZE)

_LIST, _TENSOR, _NDARRAY, _NPSCALAR, _BIGINT, _PIL, _STRUCTURED = 1, 2, 3, 4, 5, 6, 7

_TENSOR_HEAD = struct.Struct("<BBQ")
_U16 = struct.Struct("<H")
_ARRAY_HEAD = struct.Struct("<BQ")
_DIMS = [struct.Struct("<" + "q" * n) for n in range(65)]

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

_Packer = msgpack.Packer
_packb = _Packer(use_bin_type=True, unicode_errors="surrogatepass", autoreset=True).pack


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


class _Encoder:
    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []

    def prepare(self, obj: Any) -> Any:
        """Return ``obj`` as msgpack-native values and ext records, collecting buffers."""
        cls = type(obj)
        if cls is str or cls is float or cls is bool or cls is bytes or obj is None:
            return obj
        if cls is int:
            if -(2**63) <= obj < 2**64:
                return obj
            return msgpack.ExtType(_BIGINT, str(obj).encode("ascii"))
        if cls is tuple:
            return [self.child(item, i) for i, item in enumerate(obj)]
        if cls is list:
            return msgpack.ExtType(_LIST, _packb([self.child(item, i) for i, item in enumerate(obj)]))
        if cls is dict:
            return {self.key(key): self.child(value, key) for key, value in obj.items()}
        if cls is torch.Tensor:
            return self.tensor(obj)
        if isinstance(obj, np.ndarray) and (cls is np.ndarray or cls is np.memmap):
            return self.array(obj, _NDARRAY)
        if isinstance(obj, np.generic):
            return self.array(np.asarray(obj), _NPSCALAR)
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

    def key(self, key: Any) -> Any:
        """A dict key: a scalar, or a tuple of them (msgpack arrays decode as tuples: hashable)."""
        cls = type(key)
        if cls is tuple:
            return tuple(self.key(k) for k in key)
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
        code, carrier = entry
        t = t.resolve_conj().resolve_neg().contiguous()
        flat = t.reshape(-1)
        arr = (flat if carrier is None else flat.view(carrier)).numpy()
        buf = arr.data.cast("B")
        self.buffers.append(buf)
        ndim = t.dim()
        return msgpack.ExtType(_TENSOR, _TENSOR_HEAD.pack(code, ndim, buf.nbytes) + _DIMS[ndim].pack(*t.shape))

    def flat(self, sample: tuple) -> bytes | None:
        """The flat structure of ``sample`` (see the format), or None if it does not qualify."""
        if not 0 < len(sample) < 256:
            return None
        signature: list[Any] = []
        codes: list[str] = []
        scalars: list[Any] = []
        for item in sample:
            cls = type(item)
            if cls is torch.Tensor:
                if (
                    item.dtype not in _TORCH_TO_CODE
                    or item.layout is not torch.strided
                    or item.device.type != "cpu"
                    or item.requires_grad
                ):
                    return None  # the general form reports the problem with its location
                signature.append(None)  # filled in below, once nothing can disqualify the sample
            elif (cls is int and -(2**63) <= item < 2**63) or cls is float or cls is bool:
                code = "q" if cls is int else "d" if cls is float else "?"
                signature.append(code.encode())
                codes.append(code)
                scalars.append(item)
            else:
                return None
        for k, item in enumerate(sample):
            if signature[k] is None:
                signature[k] = b"T" + self.tensor(item).data
        sig = b"".join(signature)
        return b"\xc1" + _U16.pack(len(sig)) + sig + struct.pack("<" + "".join(codes), *scalars)

    def array(self, a: np.ndarray, kind: int) -> msgpack.ExtType:
        dtype = a.dtype
        if dtype.hasobject:
            raise _Unsupported(f"numpy array of dtype {dtype} (Python objects); convert it to a numeric dtype")
        if dtype.names is not None:
            import msgpack_numpy

            packed = _packb(msgpack_numpy.encode(a.copy(order="C").view(np.ndarray)))
            return msgpack.ExtType(_STRUCTURED, _packb([kind == _NPSCALAR, packed]))
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # not ascontiguousarray: it turns 0-d into 1-d
        buf = a.view(np.ndarray).reshape(-1).view(np.uint8).data
        self.buffers.append(buf)
        ndim = a.ndim
        head = _ARRAY_HEAD.pack(ndim, buf.nbytes) + _DIMS[ndim].pack(*a.shape)
        return msgpack.ExtType(kind, head + dtype.str.encode("ascii"))

    def image(self, im: Any) -> msgpack.ExtType:
        data = memoryview(im.tobytes())
        self.buffers.append(data)
        palette = im.palette
        pal_mode, pal = (
            (palette.mode, bytes(palette.tobytes())) if palette is not None and im.mode in ("P", "PA") else (None, None)
        )
        return msgpack.ExtType(_PIL, _packb([im.mode, im.size[0], im.size[1], data.nbytes, pal_mode, pal]))


def encode(sample: Any, *, where: str = "the sample") -> bytes:
    """Serialize ``sample`` to one value (format above).

    ``where`` names the sample in error messages, e.g. ``"index 17"``. Raises
    ``UnsupportedSampleError`` naming the location (``sample[1]['meta']``) and type of
    the first value that cannot be stored; nothing is produced in that case.
    """
    enc = _Encoder()
    try:
        structure = (type(sample) is tuple and enc.flat(sample)) or _packb(enc.prepare(sample))
    except _Unsupported as exc:
        location = "sample" + "".join(reversed(exc.path))
        raise UnsupportedSampleError(f"Cannot encode {where} at {location}: {exc.reason}.") from None
    except UnicodeEncodeError as exc:  # pragma: no cover - surrogatepass accepts every str
        raise UnsupportedSampleError(f"Cannot encode {where}: {exc}.") from None
    data_hash = 0
    for buf in enc.buffers:
        data_hash = xxhash.xxh3_64_intdigest(buf, seed=data_hash)
    head = _HEAD.pack(_MAGIC, len(structure), xxhash.xxh3_64_intdigest(structure), data_hash)
    value = b"".join([head, structure, *enc.buffers])
    if len(value) > _MAX_VALUE:
        raise UnsupportedSampleError(
            f"Cannot encode {where}: it is {len(value)} bytes once encoded, over LMDB's limit of "
            f"{_MAX_VALUE} bytes per value. Split it across several indices."
        )
    return value


# Parsed ext payloads of tensors and arrays, keyed by the payload bytes. A dataset's
# samples nearly always share a handful of shapes, so decoding a tensor usually costs one
# dict lookup instead of two struct parses and a dtype lookup. Cleared when it grows large.
_Spec = tuple  # (nbytes, numpy carrier dtype, shape, torch dtype to view as, or None)
_TENSOR_SPECS: dict[bytes, _Spec] = {}
_ARRAY_SPECS: dict[bytes, _Spec] = {}
_SPECS_MAX = 4096


def _spec(code: int, data: bytes) -> _Spec:
    """Parse a tensor or array payload (see the format above) and remember it."""
    if code == _TENSOR:
        cache = _TENSOR_SPECS
        dtype_code, ndim, nbytes = _TENSOR_HEAD.unpack_from(data)
        shape = _DIMS[ndim].unpack_from(data, _TENSOR_HEAD.size)
        entry = _TORCH_FROM_CODE.get(dtype_code)
        if entry is None:
            name = TORCH_DTYPES[dtype_code] if dtype_code < len(TORCH_DTYPES) else f"code {dtype_code}"
            raise CorruptSampleError(f"tensor dtype {name} is not available in torch {torch.__version__}")
        _, carrier, view = entry
    else:
        cache = _ARRAY_SPECS
        ndim, nbytes = _ARRAY_HEAD.unpack_from(data)
        shape = _DIMS[ndim].unpack_from(data, _ARRAY_HEAD.size)
        carrier, view = np.dtype(data[_ARRAY_HEAD.size + 8 * ndim :].decode("ascii")), None
    if len(cache) >= _SPECS_MAX:
        cache.clear()
    spec = cache[data] = (nbytes, carrier, shape, view)
    return spec


class _Decoder:
    """Decodes one value; its ``hook`` is msgpack's ext_hook and walks the buffers in order.

    With ``verify`` false the data checksum is not computed (the caller has verified
    this value before); every length is still checked.
    """

    __slots__ = ("data_hash", "pos", "value", "verify")

    def __init__(self, value: memoryview, pos: int, verify: bool) -> None:
        self.value = value
        self.pos = pos
        self.data_hash = 0
        self.verify = verify

    def take(self, nbytes: int) -> bytearray:
        """Copy the next buffer out of the value (the one copy) and hash the copy."""
        pos = self.pos
        buf = bytearray(self.value[pos : pos + nbytes])
        if len(buf) != nbytes:
            raise CorruptSampleError("a buffer runs past the end of the value")
        self.pos = pos + nbytes
        if self.verify:
            self.data_hash = _xxh3(buf, self.data_hash)
        return buf

    def hook(self, code: int, data: bytes) -> Any:
        if code == _TENSOR:  # the hot path, kept flat
            spec = _TENSOR_SPECS.get(data) or _spec(code, data)
            buf = self.take(spec[0])
            t = _from_numpy(_ndarray(spec[2], spec[1], buf))
            return t if spec[3] is None else t.view(spec[3])
        if code in (_NDARRAY, _NPSCALAR):
            nbytes, dtype, shape, _ = _ARRAY_SPECS.get(data) or _spec(code, data)
            buf = self.take(nbytes)
            # A zero-width dtype such as "<U0" cannot sit on a buffer; such an array holds no bytes.
            arr = _ndarray(shape, dtype, buf) if dtype.itemsize else np.empty(shape, dtype)
            return arr if code == _NDARRAY else arr[()]
        if code == _LIST:
            return list(self.unpack(data))
        if code == _BIGINT:
            return int(data.decode("ascii"))
        if code == _PIL:
            return self.image(data)
        if code == _STRUCTURED:
            import msgpack_numpy

            scalar, packed = msgpack.unpackb(data)
            arr = msgpack_numpy.decode(msgpack.unpackb(packed)).copy()
            return arr[()] if scalar else arr
        raise CorruptSampleError(f"unknown ext record type {code}")

    def image(self, data: bytes) -> Any:
        if _PILImage is None:  # pragma: no cover
            raise CorruptSampleError("the value holds a PIL image but Pillow is not installed (pip install pillow)")
        mode, width, height, nbytes, pal_mode, pal = msgpack.unpackb(data)
        pos = self.pos
        pixels = self.value[pos : pos + nbytes]
        if len(pixels) != nbytes:
            raise CorruptSampleError("a buffer runs past the end of the value")
        self.pos = pos + nbytes
        if self.verify:
            self.data_hash = _xxh3(pixels, self.data_hash)
        im = _PILImage.frombytes(mode, (width, height), pixels)
        if pal is not None:
            im.putpalette(pal, pal_mode)
        return im

    def unpack(self, data: Any) -> Any:
        return _unpackb(
            data, use_list=False, raw=False, strict_map_key=False, ext_hook=self.hook, unicode_errors="surrogatepass"
        )


_xxh3 = xxhash.xxh3_64_intdigest
_unpackb = msgpack.unpackb
_from_numpy = torch.from_numpy


def decode(value: Any, verify: bool = True) -> Any:
    """Rebuild the sample from one value (bytes, or a memoryview into the map).

    Raises ``CorruptSampleError`` if a checksum or length does not match; a damaged
    value is never returned as data. ``verify=False`` skips both checksums (lengths are
    still checked), for a value this process has verified before.
    """
    mv = value if type(value) is memoryview else memoryview(value)
    try:
        magic, size, structure_hash, data_hash = _head(mv)
    except struct.error:
        raise CorruptSampleError(f"the value is {len(mv)} bytes, shorter than its {_HEAD_SIZE}-byte header") from None
    end = _HEAD_SIZE + size
    structure = mv[_HEAD_SIZE:end]
    if magic != _MAGIC:
        raise CorruptSampleError(f"bad magic {bytes(magic)!r} (expected {_MAGIC!r}): not an lmdbcache value")
    if verify and (end > len(mv) or _xxh3(structure) != structure_hash):
        raise CorruptSampleError("the structure checksum does not match")
    if not (structure and structure[0] == 0xC1):
        return _decode_msgpack(mv, structure, end, data_hash, verify)
    # A flat tuple (see the format), inline: this is the per-sample hot path.
    try:
        size = _u16(structure, 1)[0]
        signature = structure[3 : 3 + size]  # hashable: a read-only byte view
        unpack_scalars, scalars_size, tensors, order = _PLANS.get(signature) or _plan(bytes(signature))
        if verify and 3 + size + scalars_size != end - _HEAD_SIZE:
            raise CorruptSampleError("the flat structure has the wrong length")
        scalars = unpack_scalars(structure, 3 + size)
        out = []
        pos, digest = end, 0
        for nbytes, dtype, shape, view in tensors:
            stop = pos + nbytes
            buf = bytearray(mv[pos:stop])  # the one copy out of the map
            pos = stop
            if verify:
                digest = _xxh3(buf, digest)
            t = _from_numpy(_ndarray(shape, dtype, buf))
            out.append(t if view is None else t.view(view))
    except (struct.error, TypeError, ValueError, IndexError) as exc:
        raise CorruptSampleError(f"the flat structure does not parse: {exc}") from None
    if pos != len(mv):
        raise CorruptSampleError(f"the value ends at byte {len(mv)}, not where its last buffer does ({pos})")
    if verify and digest != data_hash:
        raise CorruptSampleError("the data checksum does not match")
    if order is None:  # tensors first, then scalars: (image, label) and the like
        return (*out, *scalars)
    return tuple([out[k] if k >= 0 else scalars[~k] for k in order])


def _decode_msgpack(mv: memoryview, structure: memoryview, end: int, data_hash: int, verify: bool) -> Any:
    dec = _Decoder(mv, end, verify)
    try:
        sample = dec.unpack(structure)
    except CorruptSampleError:
        raise
    except Exception as exc:  # checksummed, yet unparseable: written by a buggy or foreign writer
        raise CorruptSampleError(f"the structure does not parse: {exc}") from None
    if dec.pos != len(mv):
        raise CorruptSampleError(f"the value ends at byte {len(mv)}, not where its last buffer does ({dec.pos})")
    if verify and dec.data_hash != data_hash:
        raise CorruptSampleError("the data checksum does not match")
    return sample


_u16 = _U16.unpack_from
_ndarray = np.ndarray
_head = _HEAD.unpack_from

# Compiled flat signatures: signature bytes -> (scalar unpacker, scalars size, tensor
# specs in order, and the item order as indices into the tensors (k) or the scalars (~k),
# or None when the tensors all come first).
_PLANS: dict[Any, tuple] = {}  # looked up by memoryview slices, which hash like bytes


def _plan(signature: bytes) -> tuple:
    codes, i = "<", 0
    tensors: list[_Spec] = []
    order: list[int] = []
    try:
        while i < len(signature):
            tag = signature[i : i + 1]
            if tag == b"T":
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
    except (IndexError, struct.error) as exc:
        raise CorruptSampleError(f"the flat structure's signature is malformed ({exc})") from None
    tensors_first = order == list(range(len(tensors))) + [~k for k in range(len(codes) - 1)]
    if len(_PLANS) >= _SPECS_MAX:
        _PLANS.clear()
    scalars = struct.Struct(codes)
    plan = (scalars.unpack_from, scalars.size, tuple(tensors), None if tensors_first else tuple(order))
    _PLANS[signature] = plan
    return plan
