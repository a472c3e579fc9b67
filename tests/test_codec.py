"""The value format: exact round-trips, one owned copy, clear errors, detected damage."""

from __future__ import annotations

import collections
import datetime
import pickle
import struct

import numpy as np
import pytest
import torch
from helpers import assert_same, tensor_bytes
from hypothesis import given, settings
from strategies import numpy_arrays, samples, tensors

from lmdbcache import CorruptSampleError, UnsupportedSampleError
from lmdbcache.codec import TORCH_DTYPES, decode, encode

ALL_TORCH_DTYPES = [
    getattr(torch, name) for name in TORCH_DTYPES if isinstance(getattr(torch, name, None), torch.dtype)
]


def roundtrip(sample):
    return decode(encode(sample))


@settings(max_examples=300, deadline=None)
@given(samples)
def test_roundtrip_property(sample):
    """Any supported sample, nested to any depth, comes back equal and of the same types."""
    assert_same(sample, roundtrip(sample))


@settings(max_examples=100, deadline=None)
@given(tensors())
def test_tensor_property(t):
    """Tensors come back contiguous, same dtype, shape and bits, whatever the input strides."""
    out = roundtrip(t)
    assert out.is_contiguous() and out.dtype == t.dtype and out.shape == t.shape
    assert tensor_bytes(out) == tensor_bytes(t)


@settings(max_examples=100, deadline=None)
@given(numpy_arrays())
def test_numpy_property(a):
    """Arrays of every dtype and byte order come back equal, C-contiguous, writable."""
    out = roundtrip(a)
    assert out.dtype == a.dtype and out.shape == a.shape and out.tobytes() == a.tobytes()
    assert out.flags.c_contiguous and out.flags.writeable


@pytest.mark.parametrize("dtype", ALL_TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 3), (4, 0, 2)], ids=str)
def test_every_torch_dtype(dtype, shape):
    """Every dtype torch has (bfloat16, float8, bits, int1..uint7, ...) round-trips bit for bit, 0-d and empty too."""
    n = int(np.prod(shape)) if shape else 1
    raw = torch.arange(n * dtype.itemsize, dtype=torch.int64).remainder(251).to(torch.uint8)
    t = (
        raw.view(dtype).reshape(shape)
        if n
        else torch.zeros((*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8).view(dtype)
    )
    out = roundtrip((t, {"t": t}))
    for got in (out[0], out[1]["t"]):
        assert got.dtype == dtype and got.shape == t.shape
        assert tensor_bytes(got) == tensor_bytes(t)


def test_noncontiguous_and_views():
    """Transposed, sliced, conjugated and negated-view tensors come back contiguous with equal values."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in (base.t(), base[:, ::2], base[1], torch.complex(base, base).conj(), base.expand(2, 4, 6)):
        out = roundtrip(t)
        assert out.is_contiguous() and torch.equal(out, t.resolve_conj())


def test_decoded_arrays_are_writable_and_own_their_memory():
    """Decoded tensors and arrays are writable, warn about nothing, and writing them changes no stored value."""
    value = encode((torch.ones(3, 4), np.ones((2, 2)), [torch.zeros(5)]))
    first = decode(value)
    first[0].add_(1)
    first[1][...] += 1
    first[2][0].fill_(7)
    torch.from_numpy(first[1])  # would warn (an error here) on a read-only buffer
    second = decode(value)
    assert (
        torch.equal(second[0], torch.ones(3, 4))
        and (second[1] == 1).all()
        and torch.equal(second[2][0], torch.zeros(5))
    )


def test_one_copy_out_of_the_value():
    """A decoded tensor does not share memory with the value it came from."""
    value = bytearray(encode((torch.zeros(1000, dtype=torch.uint8), 1)))
    out = decode(memoryview(bytes(value)))
    out[0][:] = 9
    assert out[0].sum() == 9000
    assert torch.equal(decode(bytes(value))[0], torch.zeros(1000, dtype=torch.uint8))


@pytest.mark.parametrize(
    "sample",
    [
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        2**64,
        -(2**100),
        1.5,
        float("inf"),
        -0.0,
        True,
        False,
        None,
        "",
        "héllo",
        "lone \udc80 surrogate",
        b"",
        b"\x00\xff",
        [],
        (),
        {},
        [1, [2, [3]]],
        (1, (2, (3,))),
        {"a": {"b": [1, (2,)]}},
        {1: "int key", "s": "str key", -5: None},
        ([], ()),
        [(), []],
        {"t": (1, 2.0, True)},
        np.float32(1.5),
        np.int64(-3),
        np.uint8(255),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.str_("ab"),
        np.datetime64("2024-01-02T03:04"),
        np.zeros((3, 0)),
        np.array(5),
        np.array(["a", "bc"]),
        np.zeros(2, dtype=[("x", "<f4"), ("y", "<i8", (2,))]),
        np.zeros(1, dtype=[("x", "<f4")])[0],
    ],
    ids=repr,
)
def test_plain_values(sample):
    """Python and numpy scalars, containers and edge values come back exactly, types included."""
    assert_same(sample, roundtrip(sample))


def test_tuple_and_list_keep_their_types():
    """A tuple stays a tuple and a list stays a list, at every depth and in both structure forms."""
    for sample in [(torch.ones(2), 1), [torch.ones(2), 1], (1, [2, (3, [4])]), ([1], (2,))]:
        assert_same(sample, roundtrip(sample))


def test_flat_form_for_tensor_and_scalars():
    """(tensor, int)-like tuples use the flat structure; anything else uses msgpack; both decode alike."""
    flat = (torch.ones(2, 3), 7, 0.5, True, torch.zeros((), dtype=torch.int16))
    value = encode(flat)
    assert value[24] == 0xC1
    assert_same(flat, decode(value))
    for general in [(1, "x"), (torch.ones(1), 2**63), (torch.ones(1), None), ()]:
        value = encode(general)
        assert value[24] != 0xC1
        assert_same(general, decode(value))
    mixed = (3, torch.ones(1), 2.5, torch.zeros(2))  # scalars before tensors: the general item order
    assert encode(mixed)[24] == 0xC1
    assert_same(mixed, decode(encode(mixed)))


@pytest.mark.parametrize("mode", ["1", "L", "P", "RGB", "RGBA", "I;16", "I", "F", "LA", "CMYK", "YCbCr"])
def test_pil_images(mode):
    """PIL images round-trip as PIL images with mode, size, pixels and palette."""
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (5, 7, 3), dtype=np.uint8)).convert(mode)
    if mode == "P":
        im.putpalette(list(range(256)) * 3)
    out = roundtrip((im, 3))
    assert isinstance(out[0], Image.Image)
    assert_same(im, out[0])


def test_jpeg_file_image_comes_back_as_an_image(tmp_path):
    """A lazily loaded JpegImageFile (torchvision without a transform) is cached as its pixels."""
    Image = pytest.importorskip("PIL.Image")
    Image.new("RGB", (20, 10), (10, 200, 30)).save(tmp_path / "x.jpg")
    with Image.open(tmp_path / "x.jpg") as im:
        out = roundtrip(im)
        assert (out.mode, out.size, out.tobytes()) == (im.mode, im.size, im.tobytes())


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize(
    ("sample", "where", "what"),
    [
        ((1, {"meta": datetime.datetime(2024, 1, 1)}), "sample[1]['meta']", "datetime.datetime"),
        ([object()], "sample[0]", "object"),
        ({"a": [1, {2: {3.5}}]}, "sample['a'][1][2]", "set"),
        (Point(1, 2), "sample", "Point"),
        ((torch.ones(2, requires_grad=True),), "sample[0]", "requires grad"),
        ((torch.ones(2).to_sparse(),), "sample[0]", "sparse"),
        (np.array([object()]), "sample", "Python objects"),
        (collections.OrderedDict(a=1), "sample", "OrderedDict"),
        ({(1, 2): 3, frozenset(): 4}, "sample", "frozenset"),
        (torch.nn.Parameter(torch.ones(1)), "sample", "Parameter"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_unsupported_types_name_where_and_what(sample, where, what):
    """Anything else raises UnsupportedSampleError (a TypeError) naming the location and the type."""
    with pytest.raises(UnsupportedSampleError) as info:
        encode(sample, where="index 17")
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert "index 17" in message and f"at {where}:" in message and what in message


def _flip(value: bytes, offset: int) -> bytes:
    damaged = bytearray(value)
    damaged[offset] ^= 0x40
    return bytes(damaged)


@pytest.mark.parametrize("form", ["flat", "msgpack"])
def test_any_flipped_byte_is_detected(form):
    """A single flipped byte anywhere in a value (header, structure or data) raises CorruptSampleError."""
    sample = (
        (torch.arange(50, dtype=torch.int32), 4)
        if form == "flat"
        else {"x": torch.arange(50, dtype=torch.int32), "y": [1, 2]}
    )
    value = encode(sample)
    for offset in range(len(value)):
        with pytest.raises(CorruptSampleError):
            decode(_flip(value, offset))


def test_truncated_and_extended_values_are_detected():
    """A value cut short or with bytes appended is never returned as a sample."""
    value = encode((torch.ones(10), 1))
    for cut in (0, 5, 23, 24, 30, len(value) - 1):
        with pytest.raises(CorruptSampleError):
            decode(value[:cut])
    with pytest.raises(CorruptSampleError):
        decode(value + b"\x00")
    with pytest.raises(CorruptSampleError, match="magic"):
        decode(b"X" * 40)


def test_value_layout_is_stable():
    """The bytes of a known sample match the documented layout (a change here needs a FORMAT_VERSION bump)."""
    value = encode((torch.tensor([1, 2], dtype=torch.uint8), 5))
    magic, size, _, _ = struct.unpack_from("<4sIQQ", value)
    assert magic == b"LMC\x01"
    structure = value[24 : 24 + size]
    assert structure[0] == 0xC1
    assert value[24 + size :] == b"\x01\x02"
    sig_len = struct.unpack_from("<H", structure, 1)[0]
    assert structure[3 : 3 + sig_len] == b"T" + struct.pack("<BBQq", 1, 1, 2, 2) + b"q"
    assert structure[3 + sig_len :] == struct.pack("<q", 5)


def test_errors_pickle_as_the_dataloader_rebuilds_them():
    """Every library error survives type(exc)(message), which is how worker exceptions reach the main process."""
    import lmdbcache

    for name in lmdbcache.__all__:
        cls = getattr(lmdbcache, name)
        if isinstance(cls, type) and issubclass(cls, lmdbcache.LmdbCacheError):
            exc = cls("what, where and how to fix")
            again = pickle.loads(pickle.dumps(exc))
            assert type(again) is cls and str(again) == str(exc) == str(type(exc)(str(exc)))
            assert isinstance(again, lmdbcache.LmdbCacheError)
