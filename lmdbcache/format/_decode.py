"""Reading one value back into its sample (see ``codec``): the header, the flat form, msgpack.

torch is imported only once a value holds a tensor record, and Pillow once it holds an image.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import msgpack
import numpy as np
import xxhash

from .._version import FORMAT_VERSION, OLDEST_READABLE_FORMAT
from ..errors import CorruptSampleError, InvalidOptionError
from ._format import (
    BIGINT,
    FLAT,
    FRAMED_MAGIC,
    HEAD,
    HEAD_AND_FIRST,
    HEAD_AND_FLAT,
    HEAD_SIZE,
    LIST,
    MAGIC,
    MAX_FLAT_ITEMS,
    MAX_INDEX,
    MAX_V1_LIST_DEPTH,
    NDARRAY,
    NPSCALAR,
    PIL,
    STRUCTURED,
    TENSOR,
    TENSOR_HEAD,
    U16,
    V1_BIGINT,
    V1_STRUCTURED,
    pillow,
)
from ._frames import take as take_frame
from ._records import (
    ARRAY_SPECS,
    STRUCT_SPECS,
    TENSOR_SPECS,
    Shape,
    TensorSpec,
    array,
    array_spec,
    image_record,
    remember,
    struct_spec,
    tensor_spec,
    v1_bigint,
    v1_structured,
)

if TYPE_CHECKING:
    import torch

_xxh3 = xxhash.xxh3_64_intdigest
_unpackb = msgpack.unpackb
_ndarray = np.ndarray
_head = HEAD_AND_FLAT.unpack_from
# Bound once, like _head: CPython compiles a method call on a name bound by an import as an
# attribute load, which builds a bound method on every call.
_cached_tensor, _cached_array, _cached_struct = TENSOR_SPECS.get, ARRAY_SPECS.get, STRUCT_SPECS.get
_LIST_MARK = msgpack.ExtType(LIST, b"")


def _first_from_numpy(arr: np.ndarray) -> torch.Tensor:
    """torch.from_numpy, bound on first use: only a value holding a tensor needs torch."""
    global _from_numpy
    import torch

    _from_numpy = torch.from_numpy
    return _from_numpy(arr)


_from_numpy: Callable[[np.ndarray], torch.Tensor] = _first_from_numpy
_WRONG_STRUCTURE = "the structure checksum does not match: the value is damaged or was stored under another index"


def decode(value: bytes | memoryview, index: int, *, verify_data: bool = True) -> Any:
    """Rebuild the sample stored under ``index`` from its value (bytes, or a memoryview into the map).

    The structure checksum is verified on every call; the data checksum when ``verify_data`` (pass False only
    for a value this process has verified before). Raises ``CorruptSampleError`` with a short reason for anything
    wrong with the value: a damaged value, or one stored under another index, is never returned as data.
    """
    mv = value if type(value) is memoryview else memoryview(value)
    try:
        magic, size, structure_hash, data_hash, first, sig_size = _head(mv)
    except struct.error:  # a value under 27 bytes: no flat structure is that short
        magic, size, structure_hash, data_hash, first, sig_size = _short_head(mv)
    if not 0 <= index <= MAX_INDEX:
        raise InvalidOptionError(f"Cannot decode index {index!r}: an index is an int from 0 to 2**64 - 1.")
    if magic != MAGIC:
        if magic == FRAMED_MAGIC:  # compressed buffers (see the format): never the flat fast path
            return _decode_framed(mv, index, verify_data)
        seed = _format_1_seed(magic)
    else:
        seed = index
    end = 24 + size  # HEAD_SIZE, spelled out on the hot path
    if _xxh3(structure := mv[24:end], seed) != structure_hash:
        raise CorruptSampleError(_WRONG_STRUCTURE)
    if first != 0xC1:  # else a flat tuple (see the format), decoded inline: this is the per-sample hot path
        return decode_msgpack(mv, structure, end, seed, data_hash, verify_data, magic != MAGIC)
    try:
        signature = mv[25 : 27 + sig_size]  # hashable (a read-only byte view); with its length, so a hit checks that
        plan = _PLANS.get(signature) or _plan(bytes(signature))
        unpack_scalars, scalars_at, struct_size, value_size, tensors, order, single = plan
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
            out, pos, digest = [], end, seed
            for nbytes, dtype, shape, view in tensors:
                stop = pos + nbytes
                buf = bytearray(mv[pos:stop])  # the one copy out of the map
                pos = stop
                if verify_data:
                    digest = _xxh3(buf, digest)
                t = _from_numpy(_ndarray(shape, dtype, buf))
                out.append(t if view is None else t.view(view))
            sample = (*out, *scalars) if order is None else tuple([out[k] if k >= 0 else scalars[~k] for k in order])
    except Exception as exc:
        return _flat_failed(exc, mv, index, verify_data)
    if verify_data and digest != data_hash:
        raise CorruptSampleError("the data checksum does not match")
    return sample


def _short_head(mv: memoryview) -> tuple[bytes, int, int, int, int, int]:
    """The header of a value too short for a flat structure (signature length 0), or CorruptSampleError."""
    try:
        return (*HEAD_AND_FIRST.unpack_from(mv), 0)
    except struct.error:
        raise CorruptSampleError(f"the value is {len(mv)} bytes, shorter than the smallest value (25)") from None


def _format_1_seed(magic: bytes) -> int:
    """The checksum seed of a value whose header is neither ``MAGIC`` nor ``FRAMED_MAGIC``: 0 for format 1."""
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


def _flat_failed(exc: Exception, mv: memoryview, index: int, verify_data: bool) -> Any:
    """Why a flat structure did not decode, as CorruptSampleError; or the sample, from a bytes copy."""
    if isinstance(exc, CorruptSampleError):
        raise exc
    if not _hashable(mv):  # a view of a bytearray cannot key the plan lookup: decode a bytes copy
        return decode(bytes(mv), index, verify_data=verify_data)
    raise CorruptSampleError(f"the flat structure does not parse ({type(exc).__name__}: {exc})") from None


def _hashable(mv: memoryview) -> bool:
    try:
        hash(mv[:0])
    except (TypeError, ValueError):
        return False
    return True


# Compiled flat signatures: the signature's length (u16) and bytes -> (scalar unpacker,
# the scalars' offset in the value, the structure's size, the value's size, tensor specs
# in order, the item order as indices into the tensors (k) or the scalars (~k) or None
# when the tensors all come first, and the (dtype, shape, view) of a sole first tensor).
_Plan: TypeAlias = """tuple[
    Callable[[memoryview, int], tuple[Any, ...]], int, int, int, tuple[TensorSpec, ...], tuple[int, ...] | None,
    tuple[np.dtype, Shape, torch.dtype | None] | None,
]"""
_PLANS: dict[bytes | memoryview, _Plan] = {}  # looked up by memoryview slices, which hash like bytes
# The same plans as the compiled core reads them (``core.Tree.sample``, handed this dict by the store's native
# path): (structure size, value size, scalars' offset, scalar codes as bytes (q, d, ?), tensor specs, the full
# item order, numpy.ndarray, torch.from_numpy or None when it holds no tensor).
NATIVE_PLANS: dict[bytes, tuple[Any, ...]] = {}


def flat_plan(key: bytes) -> _Plan:
    """The checked plan of a flat structure (its signature length and signature): ``_gather`` builds batches on it."""
    return _PLANS.get(key) or _plan(key)


def _plan(key: bytes) -> _Plan:
    """Parse and check a flat structure's signature length and signature, and remember them."""
    if len(key) < 2 or U16.unpack_from(key)[0] != len(key) - 2:
        raise CorruptSampleError("the flat structure's signature runs past the end of the value")
    signature = key[2:]
    codes, i = "<", 0
    tensors: list[TensorSpec] = []
    order: list[int] = []
    while i < len(signature):
        tag = signature[i : i + 1]
        if tag == b"T":
            if i + 3 > len(signature):
                raise CorruptSampleError("the flat structure's signature is cut short")
            size = TENSOR_HEAD.size + 8 * signature[i + 2]
            payload = signature[i + 1 : i + 1 + size]
            order.append(len(tensors))
            tensors.append(_cached_tensor(payload) or tensor_spec(payload))
            i += 1 + size
        elif tag in (b"q", b"d", b"?"):
            order.append(~(len(codes) - 1))
            codes += tag.decode()
            i += 1
        else:
            raise CorruptSampleError(f"unknown item tag {tag!r} in a flat structure")
    if not 0 < len(order) <= MAX_FLAT_ITEMS:
        raise CorruptSampleError(f"a flat structure of {len(order)} items")
    tensors_first = order == list(range(len(tensors))) + [~k for k in range(len(codes) - 1)]
    scalars = struct.Struct(codes)
    struct_size = 1 + len(key) + scalars.size
    value_size = HEAD_SIZE + struct_size + sum(spec[0] for spec in tensors)
    plan: _Plan = (
        scalars.unpack_from,
        HEAD_SIZE + 1 + len(key),
        struct_size,
        value_size,
        tuple(tensors),
        None if tensors_first else tuple(order),
        tensors[0][1:] if tensors_first and len(tensors) == 1 else None,
    )
    from_numpy = _torch_from_numpy() if tensors else None  # a tensor spec has imported torch already
    native = (struct_size, value_size, plan[1], codes[1:].encode(), plan[4], tuple(order), _ndarray, from_numpy)
    remember(NATIVE_PLANS, key, native)  # the compiled core's form of it
    return remember(_PLANS, key, plan)


def _torch_from_numpy() -> Callable[[np.ndarray], torch.Tensor]:
    """torch.from_numpy (a plan holding a tensor has imported torch already), bound for the hot path too."""
    global _from_numpy
    import torch

    _from_numpy = torch.from_numpy
    return _from_numpy


# ----------------------------------------------------------------------------------------
# The msgpack form


def decode_msgpack(
    mv: memoryview,
    structure: memoryview,
    end: int,
    seed: int,
    data_hash: int,
    verify: bool,
    v1: bool,
    decoder: type[Decoder] | None = None,
) -> Any:
    """The sample of a msgpack-form value; ``decoder`` takes its buffers (``_compress`` passes its framed one)."""
    if end > len(mv):
        raise CorruptSampleError(f"the structure runs past the end of the value ({end} > {len(mv)} bytes)")
    dec = (decoder or Decoder)(mv, end, seed, verify, v1)
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


class Decoder:
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
        if code == TENSOR:  # the hot path, kept flat
            spec = _cached_tensor(data) or tensor_spec(data)
            t = _from_numpy(_ndarray(spec[2], spec[1], self.take(spec[0])))
            return t if spec[3] is None else t.view(spec[3])
        if code in (NDARRAY, NPSCALAR):
            nbytes, dtype, shape, _ = _cached_array(data) or array_spec(data)
            arr = array(shape, dtype, self.take(nbytes))
            if code == NDARRAY:
                return arr
            if shape:  # checked here, not in array_spec: both codes share the cache
                raise CorruptSampleError("a numpy scalar record with a shape")
            return arr[()]
        if code == LIST:
            if self.v1:
                return self.v1_list(data)
            if data:
                raise CorruptSampleError("a list marker with a payload")
            self.marks += 1
            return _LIST_MARK
        if code == PIL:
            return self.image(data)
        if code == STRUCTURED and not self.v1:
            nbytes, dtype, shape, scalar = _cached_struct(data) or struct_spec(data)
            arr = array(shape, dtype, self.take(nbytes))
            return arr[()] if scalar else arr
        if code == BIGINT and not self.v1 and data:
            return int.from_bytes(data, "little", signed=True)
        if code == V1_BIGINT and self.v1:
            return v1_bigint(data)
        if code == V1_STRUCTURED and self.v1:
            return v1_structured(data)
        raise CorruptSampleError(f"an unknown ext record (type {code}, {len(data)} bytes)")

    def list_hook(self, items: tuple[Any, ...]) -> Any:
        """Every msgpack array: a tuple, or a list when it starts with the list marker."""
        if items and items[0] is _LIST_MARK:
            self.lists += 1
            return list(items[1:])
        return items

    def v1_list(self, data: bytes) -> list[Any]:
        # Each level is a nested msgpack call with its own ~40 KiB stack: bounded so that a
        # hostile value cannot overflow the C stack.
        self.depth += 1
        if self.depth > MAX_V1_LIST_DEPTH:
            raise CorruptSampleError(f"format-1 lists nested over {MAX_V1_LIST_DEPTH} deep")
        out = list(self.unpack(data))
        self.depth -= 1
        return out

    def image(self, data: bytes) -> Any:
        pil_image = pillow()
        if pil_image is None:  # pragma: no cover
            raise CorruptSampleError("the value holds a PIL image but Pillow is not installed (pip install pillow)")
        mode, width, height, nbytes, pal_mode, pal = image_record(data)
        im = pil_image.frombytes(mode, (width, height), self.view(nbytes))
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


# ----------------------------------------------------------------------------------------
# The framed form (compressed buffers)


def _decode_framed(mv: memoryview, index: int, verify: bool) -> Any:
    """The sample in a framed value (see "Compressed values"); ``decode`` read its header."""
    _, size, structure_hash, data_hash = HEAD.unpack_from(mv)
    end = HEAD_SIZE + size
    if not size or end > len(mv):
        raise CorruptSampleError("the structure runs past the end of the value")
    structure = mv[HEAD_SIZE:end]
    if _xxh3(structure, index) != structure_hash:
        raise CorruptSampleError(_WRONG_STRUCTURE)
    if structure[0] != FLAT:
        return decode_msgpack(mv, structure, end, index, data_hash, verify, False, _Framed)
    try:
        sig = U16.unpack_from(structure, 1)[0]
        unpack_scalars, scalars_at, struct_size, _, tensors, order, _ = flat_plan(bytes(structure[1 : 3 + sig]))
        if size != struct_size:
            raise CorruptSampleError("the flat structure's lengths do not add up to the value's")
        scalars = unpack_scalars(mv, scalars_at)
        out, pos, digest = [], end, index
        for nbytes, dtype, shape, view in tensors:
            buf, pos = take_frame(mv, pos, nbytes)
            if verify:
                digest = _xxh3(buf, digest)
            t = _from_numpy(_ndarray(shape, dtype, buf))
            out.append(t if view is None else t.view(view))
    except CorruptSampleError:
        raise
    except Exception as exc:
        raise CorruptSampleError(f"the flat structure does not parse ({type(exc).__name__}: {exc})") from None
    if pos != len(mv):
        raise CorruptSampleError(f"the value ends at byte {len(mv)}, not where its last frame does ({pos})")
    if verify and digest != data_hash:
        raise CorruptSampleError("the data checksum does not match")
    return (*out, *scalars) if order is None else tuple([out[k] if k >= 0 else scalars[~k] for k in order])


class _Framed(Decoder):
    """The msgpack form's decoder, taking each buffer from its frame."""

    __slots__ = ()

    def take(self, nbytes: int) -> bytearray:
        buf, self.pos = take_frame(self.value, self.pos, nbytes)
        if self.verify:
            self.data_hash = _xxh3(buf, self.data_hash)
        return buf

    def view(self, nbytes: int) -> memoryview:
        return memoryview(self.take(nbytes))
