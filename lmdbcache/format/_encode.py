"""Writing a sample as one value (see ``codec``): the flat form, or msgpack with ext records.

torch and Pillow are never imported here: a sample can hold a tensor or an image only if its
caller imported them already, so ``encode`` looks for them in ``sys.modules``.
"""

from __future__ import annotations

import operator
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import msgpack
import numpy as np
import xxhash

from ..errors import CorruptSampleError, InvalidOptionError, UnsupportedSampleError
from ._dtypes import build_dtype, describe_dtype, plain_str, refusal, same_dtype
from ._format import (
    ARRAY_HEAD,
    BIGINT,
    DIMS,
    FLAT,
    HEAD,
    LIST,
    MAGIC,
    MAX_DEPTH,
    MAX_FLAT_ITEMS,
    MAX_INDEX,
    MAX_NDIM,
    MAX_PALETTE,
    MAX_SIGNATURE,
    MAX_VALUE,
    NDARRAY,
    NPSCALAR,
    PALETTE_MODES,
    PIL,
    PIL_BITS,
    STRUCTURED,
    TENSOR,
    TENSOR_HEAD,
    U16,
    TorchToCode,
    Unsupported,
    image_problem,
    shape_problem,
    torch_dtypes,
    typename,
)
from ._records import remember

if TYPE_CHECKING:
    import torch

_xxh3 = xxhash.xxh3_64_intdigest
# Bound once: CPython compiles a method call on a name bound by an import as an attribute
# load, which builds a bound method on every call.
_pack_head, _pack_tensor_head, _pack_array_head, _pack_u16 = HEAD.pack, TENSOR_HEAD.pack, ARRAY_HEAD.pack, U16.pack
_packb = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass", autoreset=True).pack
_LIST_MARK = msgpack.ExtType(LIST, b"")
_KEY_TYPES = (str, int, bytes, float, bool, type(None))
_FLAT_FIRST = bytes([FLAT])


class _NoTensor:
    """Stands in for ``torch.Tensor`` while torch is not imported: nothing is of this type."""


# Bound by _bind_torch() once the caller has imported torch.
_Tensor: type[Any] = _NoTensor
_STRIDED: Any = None  # torch.strided
_TORCH_TO_CODE: TorchToCode = {}


# The compiled core's flat writer (``core.encode_flat``), handed in by the store when the core is
# loaded (``use_native``): this part never imports the core. None: every value is written here.
_encode_flat: Callable[..., bytes | None] | None = None
# And its whole flat path in one call (``core.encode_sample``: the kind, the plan, the views, the value).
_encode_sample: Callable[..., bytes | None] | None = None


def use_native(
    encode_flat: Callable[..., bytes | None] | None, encode_sample: Callable[..., bytes | None] | None = None
) -> None:
    """Write planned flat samples with ``encode_flat`` (``core.encode_flat``), the plan found by ``encode_sample``
    (``core.encode_sample``) if given, or here again (None)."""
    global _encode_flat, _encode_sample
    _encode_flat, _encode_sample = encode_flat, encode_sample if encode_flat is not None else None


def encode_miss(sample: Any, index: int) -> bytes:
    """``encode(sample, index)`` for a dataset's miss, whose index is an int in range: a planned flat sample is
    written by one core call, without encode's checks of the index."""
    if _encode_sample is not None and (value := _encode_sample(sample, index, _FLAT_PLANS, _Tensor)) is not None:
        return value
    return encode(sample, index)


def _bind_torch() -> None:
    """Bind torch's tensor type, strided layout and dtype table, if the caller has imported torch."""
    global _Tensor, _STRIDED, _TORCH_TO_CODE
    torch = sys.modules.get("torch")
    if torch is not None:
        _TORCH_TO_CODE = torch_dtypes()[0]
        _STRIDED = torch.strided
        _Tensor = torch.Tensor


def encode(sample: Any, index: int) -> bytes:
    """Serialize ``sample`` to the value stored under ``index`` (the format: see ``codec``).

    Raises ``UnsupportedSampleError`` naming the index, the location (``sample[1]['meta']``)
    and the type or limit of the first value that cannot be stored; nothing is produced in
    that case.
    """
    try:
        index = operator.index(index)
        valid = 0 <= index <= MAX_INDEX
    except TypeError:
        valid = False
    if not valid:
        raise InvalidOptionError(f"Cannot encode index {index!r}: an index is an int from 0 to 2**64 - 1.")
    if _Tensor is _NoTensor:
        _bind_torch()
    if _encode_flat is not None and type(sample) is tuple and (value := _native_flat(sample, index)) is not None:
        return value
    buffers: list[memoryview] = []
    try:
        structure = (type(sample) is tuple and _flat(sample, buffers)) or _packb(_Encoder(buffers).prepare(sample))
    except Unsupported as exc:
        raise UnsupportedSampleError(f"Cannot encode index {index} at {_location(exc.path)}: {exc.reason}.") from None
    except RecursionError:
        raise UnsupportedSampleError(
            f"Cannot encode index {index}: the sample is nested too deeply for the Python stack "
            f"(at most {MAX_DEPTH} levels are stored)."
        ) from None
    data_hash = index
    for buf in buffers:
        data_hash = _xxh3(buf, data_hash)
    head = _pack_head(MAGIC, len(structure), _xxh3(structure, index), data_hash)
    value = b"".join([head, structure, *buffers])
    if len(value) > MAX_VALUE:
        raise UnsupportedSampleError(
            f"Cannot encode index {index}: it is {len(value)} bytes once encoded, over LMDB's limit of "
            f"{MAX_VALUE} bytes per value. Split it across several indices."
        )
    return value


def _location(path: list[str]) -> str:
    parts = path[::-1]
    if len(parts) > 12:  # a depth error: the first and last steps are enough to find it
        return f"sample{''.join(parts[:6])}...{''.join(parts[-3:])} ({len(parts)} levels down)"
    return "sample" + "".join(parts)


# ----------------------------------------------------------------------------------------
# The msgpack form


class _Encoder:
    """Turns a sample into msgpack-native values and ext records, collecting buffers in order."""

    __slots__ = ("buffers", "depth")

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.depth = 0

    def prepare(self, obj: Any) -> Any:
        """Return ``obj`` as msgpack-native values and ext records, collecting buffers."""
        cls = type(obj)
        if cls is str or cls is float or cls is bool or obj is None:
            if cls is str and len(obj) > MAX_VALUE // 4 and len(obj.encode("utf-8", "surrogatepass")) > MAX_VALUE:
                raise Unsupported(f"str over LMDB's limit of {MAX_VALUE} bytes per value")
            return obj
        if cls is bytes:
            if len(obj) > MAX_VALUE:
                raise Unsupported(f"bytes over LMDB's limit of {MAX_VALUE} bytes per value")
            return obj
        if cls is int:
            if -(2**63) <= obj < 2**64:
                return obj
            return msgpack.ExtType(BIGINT, obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True))
        if cls is tuple:
            return self.items(obj, [])
        if cls is list:
            return self.items(obj, [_LIST_MARK])
        if cls is dict:
            self.enter()
            out = {self.key(key): self.child(value, key) for key, value in obj.items()}
            self.depth -= 1
            return out
        if cls is _Tensor:
            return _tensor(obj, self.buffers)
        if isinstance(obj, np.ndarray) and (cls is np.ndarray or cls is np.memmap):
            return _array(obj.view(np.ndarray), False, self.buffers)
        if isinstance(obj, np.generic):
            arr = np.asarray(obj)
            if arr.dtype.type is not cls:
                raise Unsupported(f"unsupported type {typename(obj)} (a subclass of a numpy scalar type)")
            return _array(arr, True, self.buffers)
        pil_image = sys.modules.get("PIL.Image")  # an image exists only once Pillow is imported
        if pil_image is not None and isinstance(obj, pil_image.Image):
            return _image(obj, self.buffers)
        raise Unsupported(f"unsupported type {typename(obj)}{_hint(obj)}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Unsupported(f"containers nested over {MAX_DEPTH} deep, the limit; flatten the sample")

    def items(self, seq: tuple[Any, ...] | list[Any], out: list[Any]) -> list[Any]:
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
        raise Unsupported(f"dict key {key!r} of type {typename(key)}; keys must be str, int or other scalars")

    def child(self, obj: Any, key: Any) -> Any:
        try:
            return self.prepare(obj)
        except Unsupported as exc:
            exc.path.append(f"[{key!r}]")
            raise


def _hint(obj: object) -> str:
    """How to store an object of an unsupported subclass of a supported type, if it is one."""
    if isinstance(obj, tuple):
        return " (a tuple subclass such as a namedtuple: convert it with tuple(x) or x._asdict())"
    if isinstance(obj, (dict, list)):
        return f" (a subclass of {type(obj).__mro__[1].__name__}: convert it to a plain one)"
    if isinstance(obj, _Tensor):
        return " (a Tensor subclass such as Parameter: store obj.detach() as a plain tensor)"
    return ""


# ----------------------------------------------------------------------------------------
# Records: each appends its bytes to ``buffers`` and returns the ext record that sizes them.


def _tensor(t: torch.Tensor, buffers: list[memoryview]) -> msgpack.ExtType:
    if t.layout is not _STRIDED or t.is_quantized:
        raise Unsupported(f"tensor with layout {t.layout} / dtype {t.dtype}; store t.to_dense() or t.dequantize()")
    if t.device.type != "cpu":
        raise Unsupported(f"tensor on device {t.device}; move it to the CPU with .cpu() before caching")
    if t.requires_grad:
        raise Unsupported("tensor that requires grad; cache t.detach() instead")
    entry = _TORCH_TO_CODE.get(t.dtype)
    if entry is None:
        raise Unsupported(f"tensor of dtype {t.dtype}")
    ndim = t.dim()
    if ndim > MAX_NDIM:
        raise Unsupported(f"tensor with {ndim} dimensions, over the limit of {MAX_NDIM}")
    return _tensor_record(t, entry, ndim, buffers)


def _tensor_record(
    t: torch.Tensor, entry: tuple[int, torch.dtype | None], ndim: int, buffers: list[memoryview]
) -> msgpack.ExtType:
    """The record of a tensor whose type, layout, device, dtype (``entry``) and ``ndim`` were checked."""
    code, carrier = entry
    try:
        if not t.numel():
            problem = shape_problem(tuple(t.shape), t.element_size())
            if problem:
                raise Unsupported(f"tensor with {problem}")
        t = t.resolve_conj().resolve_neg().contiguous()
        flat = t.reshape(-1)
        arr = (flat if carrier is None else flat.view(carrier)).numpy()
    except (RuntimeError, TypeError, ValueError) as exc:
        what = "a nested tensor" if t.is_nested else f"a tensor whose bytes cannot be read ({exc})"
        raise Unsupported(f"{what}; store its parts as plain tensors") from None
    buf = arr.data.cast("B")
    buffers.append(buf)
    return msgpack.ExtType(TENSOR, _pack_tensor_head(code, ndim, buf.nbytes) + DIMS[ndim].pack(*t.shape))


def _array(a: np.ndarray, scalar: bool, buffers: list[memoryview]) -> msgpack.ExtType:
    dtype = a.dtype
    if dtype.names is not None:
        return _structured(a, scalar, buffers)
    s = plain_str(dtype)
    if s is None:
        raise Unsupported(refusal(dtype))
    if not a.size or not dtype.itemsize:
        problem = shape_problem(a.shape, dtype.itemsize)
        if problem:
            raise Unsupported(f"numpy array with {problem}")
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # not ascontiguousarray: it turns 0-d into 1-d
    buf = a.reshape(-1).view(np.uint8).data if a.nbytes else memoryview(b"")
    buffers.append(buf)
    ndim = a.ndim
    head = _pack_array_head(ndim, buf.nbytes) + DIMS[ndim].pack(*a.shape)
    return msgpack.ExtType(NPSCALAR if scalar else NDARRAY, head + s.encode("ascii"))


def _structured(a: np.ndarray, scalar: bool, buffers: list[memoryview]) -> msgpack.ExtType:
    dtype = a.dtype
    desc = describe_dtype(dtype)
    try:
        rebuilt = build_dtype(desc)
    except (CorruptSampleError, ValueError, TypeError) as exc:
        raise Unsupported(f"structured numpy dtype {dtype} that cannot be rebuilt ({exc})") from None
    if not same_dtype(rebuilt, dtype):
        raise Unsupported(
            f"structured numpy dtype {dtype!r} that does not rebuild exactly from its fields (np.record "
            "dtypes, from np.recarray, do not); convert it with a.view(np.dtype((np.void, a.dtype)))"
        )
    problem = shape_problem(a.shape, dtype.itemsize)
    if problem:
        raise Unsupported(f"numpy array with {problem}")
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
    buffers.append(buf)
    return msgpack.ExtType(STRUCTURED, _packb([list(a.shape), nbytes, desc, scalar]))


def _image(im: Any, buffers: list[memoryview]) -> msgpack.ExtType:
    mode = im.mode
    if mode not in PIL_BITS:
        raise Unsupported(f"PIL image of mode {mode!r}; convert it to one of {', '.join(PIL_BITS)}")
    try:
        data = memoryview(im.tobytes())
    except Exception as exc:  # a lazily loaded file that is truncated or damaged
        raise Unsupported(f"PIL image whose pixels cannot be read ({type(exc).__name__}: {exc})") from None
    problem = image_problem(mode, im.size[0], im.size[1], data.nbytes)
    if problem:
        raise Unsupported(f"PIL image with {problem}")
    palette = im.palette
    pal_mode, pal = None, None
    if palette is not None and mode in ("P", "PA"):
        pal_mode, pal = palette.mode, bytes(palette.tobytes())
        if pal_mode not in PALETTE_MODES or len(pal) > MAX_PALETTE or len(pal) % len(pal_mode):
            raise Unsupported(f"PIL palette of mode {pal_mode!r} and {len(pal)} bytes; use an RGB or RGBA palette")
    buffers.append(data)
    return msgpack.ExtType(PIL, _packb([mode, im.size[0], im.size[1], data.nbytes, pal_mode, pal]))


# ----------------------------------------------------------------------------------------
# The flat form


# Compiled flat samples: the item kinds of a sample (a tensor's dtype and shape, a scalar's
# type) -> (everything before the scalars, their packer, the tensors' positions and carrier
# dtypes, the scalars' positions). A sample of a known kind is written without the walk: one
# numpy() view per tensor and one struct pack. Filled by _flat_first, so a sample it could not
# write (a shape over the limits) never gets a plan.
_FlatPlan: TypeAlias = "tuple[bytes, Callable[..., bytes], tuple[tuple[int, Any], ...], tuple[int, ...], bytes]"
_FLAT_PLANS: dict[tuple[Any, ...], _FlatPlan] = {}


def _kind(sample: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key of a sample's flat plan: each tensor's (dtype, shape), each other item's type."""
    return tuple([(item.dtype, item.shape) if type(item) is _Tensor else type(item) for item in sample])


def _flat(sample: tuple[Any, ...], buffers: list[memoryview]) -> bytes | None:
    """The flat structure of ``sample`` (see the format), or None if it does not qualify.

    The per-miss hot path for (image, label) samples: a sample whose kind has a plan is
    written with one ``numpy()`` view per tensor (it raises for every tensor the general
    path refuses or must convert: grad, conj/neg bits, other devices and layouts) and one
    struct pack; anything else, and the first sample of a kind, goes through _flat_first.
    """
    try:
        key = _kind(sample)
    except RuntimeError:  # a nested tensor has no shape: the general form refuses it, with its location
        return None
    plan = _FLAT_PLANS.get(key)
    if plan is None:
        return _flat_first(sample, buffers, key)
    prefix, pack_scalars, tensors, scalars, _ = plan
    start = len(buffers)
    try:
        for k, carrier in tensors:
            arr = (sample[k] if carrier is None else sample[k].view(carrier)).numpy()
            buffers.append(memoryview(arr).cast("B"))  # TypeError unless C-contiguous
        return prefix + pack_scalars(*[sample[k] for k in scalars])
    except (RuntimeError, TypeError, ValueError, struct.error):
        del buffers[start:]  # the general path writes (or refuses) this one
        return _flat_first(sample, buffers, None)


def _native_flat(sample: tuple[Any, ...], index: int) -> bytes | None:
    """The whole value of a planned flat sample, written by the core (``use_native``); None: not planned, or
    anything the core does not take as planned (it checks the buffers against the signature). Encoded here then.
    """
    if _encode_sample is not None:  # the same steps in one call
        return _encode_sample(sample, index, _FLAT_PLANS, _Tensor)
    try:
        plan = _FLAT_PLANS.get(_kind(sample))
        if plan is None:
            return None
        prefix, _, tensors, scalars, codes = plan
        arrays = tuple([(sample[k] if carrier is None else sample[k].view(carrier)).numpy() for k, carrier in tensors])
    except (RuntimeError, TypeError, ValueError):  # what _flat's own views would raise: its path decides
        return None
    return _encode_flat(prefix, codes, arrays, tuple([sample[k] for k in scalars]), index)  # type: ignore[misc]


def _flat_first(sample: tuple[Any, ...], buffers: list[memoryview], key: tuple[Any, ...] | None) -> bytes | None:
    """``_flat``'s general path: check every item, write the sample, and remember its plan under ``key``."""
    if not 0 < len(sample) <= MAX_FLAT_ITEMS:
        return None
    codes: list[Any] = []  # per item: its struct code, or (tensor dtype entry, ndim)
    size = 0
    for item in sample:  # qualify first: nothing is collected for a sample that falls back
        cls = type(item)
        if cls is _Tensor:
            entry = _TORCH_TO_CODE.get(item.dtype)
            ndim = item.dim()
            if (
                entry is None
                or item.layout is not _STRIDED
                or item.device.type != "cpu"
                or item.requires_grad
                or ndim > MAX_NDIM
            ):
                return None  # the general form reports the problem with its location
            codes.append((entry, ndim))
            size += 1 + TENSOR_HEAD.size + 8 * ndim
        elif (cls is int and -(2**63) <= item < 2**63) or cls is float or cls is bool:
            codes.append("q" if cls is int else "d" if cls is float else "?")
            size += 1
        else:
            return None
    if size > MAX_SIGNATURE:
        return None
    signature: list[bytes] = []
    scalar_codes, scalars = "<", []
    tensor_at: list[tuple[int, Any]] = []
    scalar_at: list[int] = []
    for k, (item, code) in enumerate(zip(sample, codes)):
        if type(code) is tuple:
            entry, ndim = code
            try:
                signature.append(b"T" + _tensor_record(item, entry, ndim, buffers).data)
            except Unsupported as exc:
                exc.path.append(f"[{k}]")
                raise
            tensor_at.append((k, entry[1]))
        else:
            signature.append(code.encode())
            scalar_codes += code
            scalars.append(item)
            scalar_at.append(k)
    prefix = _FLAT_FIRST + _pack_u16(size) + b"".join(signature)
    pack = struct.Struct(scalar_codes).pack
    if key is not None and all(item.numel() for item in sample if type(item) is _Tensor):
        plan = (prefix, pack, tuple(tensor_at), tuple(scalar_at), scalar_codes[1:].encode())
        remember(_FLAT_PLANS, key, plan)
    return prefix + pack(*scalars)
