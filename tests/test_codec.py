"""The value format: exact round-trips, one owned copy, clear errors, detected damage, a hardened reader."""

from __future__ import annotations

import collections
import datetime
import os
import pathlib
import pickle
import random
import shutil
import struct
import threading
from typing import Any

import lmdb
import msgpack
import numpy as np
import pytest
import torch
import xxhash
from helpers import assert_same, golden_samples, tensor_bytes
from hypothesis import given, settings
from strategies import numpy_arrays, samples, structured_arrays, tensors
from test_processes import run_script

import lmdbcache
from lmdbcache import CorruptSampleError, InvalidOptionError, UnsupportedSampleError
from lmdbcache._version import FORMAT_VERSION
from lmdbcache.codec import TORCH_DTYPES, decode, encode
from lmdbcache.format._format import PIL_BITS

ALL_TORCH_DTYPES = [
    getattr(torch, name) for name in TORCH_DTYPES if isinstance(getattr(torch, name, None), torch.dtype)
]
INDEX = 7
GOLDEN = pathlib.Path(__file__).parent / "data" / "golden-v1"
STRESS = os.environ.get("LMDBCACHE_STRESS") == "1"


def roundtrip(sample, index=INDEX):
    return decode(encode(sample, index), index)


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def make_value(structure: bytes, buffers=(), index: int = INDEX, version: int = 2) -> bytes:
    """A value with valid checksums around any structure: crafted records reach the parser itself."""
    seed = index if version >= 2 else 0
    data_hash = seed
    for buf in buffers:
        data_hash = xxhash.xxh3_64_intdigest(buf, seed=data_hash)
    head = struct.pack(
        "<3sBIQQ", b"LMC", version, len(structure), xxhash.xxh3_64_intdigest(structure, seed=seed), data_hash
    )
    return head + structure + b"".join(buffers)


def ext(code: int, payload: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, payload)


def array_payload(shape, nbytes: int, dtype: str) -> bytes:
    """The payload of a numpy array record (codes 3 and 4)."""
    return struct.pack(f"<BQ{len(shape)}q", len(shape), nbytes, *shape) + dtype.encode()


def raw_bytes(a: np.ndarray) -> bytes:
    """Every byte of every element of ``a`` in C order, padding included (a strided array's tobytes() skips it)."""
    if not a.dtype.itemsize:
        return b""
    return np.ascontiguousarray(a[..., None].view(np.uint8)).tobytes()


def assert_same_dtype(a: np.dtype, b: np.dtype) -> None:
    """Equal dtypes in everything numpy's == ignores too: offsets, itemsize, titles, alignment, scalar type."""
    assert a == b and repr(a) == repr(b), (a, b)
    assert (a.itemsize, a.isalignedstruct, a.type, a.names) == (b.itemsize, b.isalignedstruct, b.type, b.names)
    if a.subdtype is not None:
        assert a.subdtype[1] == b.subdtype[1]
        assert_same_dtype(a.subdtype[0], b.subdtype[0])
    for name in a.names or ():
        assert a.fields[name][1:] == b.fields[name][1:], name
        assert_same_dtype(a.fields[name][0], b.fields[name][0])


def nested(wrap, depth: int, leaf: Any = 0) -> Any:
    for _ in range(depth):
        leaf = wrap(leaf)
    return leaf


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


@settings(max_examples=200, deadline=None)
@given(structured_arrays())
def test_structured_property(a):
    """Structured arrays (padding, offsets, align, titles, nested, subarrays) and their np.void come back exactly."""
    out = roundtrip(a)
    assert type(out) is np.ndarray and out.shape == a.shape and out.flags.c_contiguous and out.flags.writeable
    assert_same_dtype(out.dtype, a.dtype)
    assert raw_bytes(out) == raw_bytes(a)
    if a.size:
        item = a.reshape(-1)[-1]
        back = roundtrip(item)
        assert type(back) is np.void
        assert_same_dtype(back.dtype, item.dtype)
        assert raw_bytes(np.asarray(back)) == raw_bytes(np.asarray(item))


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
    value = encode((torch.ones(3, 4), np.ones((2, 2)), [torch.zeros(5)]), 0)
    first = decode(value, 0)
    first[0].add_(1)
    first[1][...] += 1
    first[2][0].fill_(7)
    torch.from_numpy(first[1])  # would warn (an error here) on a read-only buffer
    second = decode(value, 0)
    assert (
        torch.equal(second[0], torch.ones(3, 4))
        and (second[1] == 1).all()
        and torch.equal(second[2][0], torch.zeros(5))
    )


def test_one_copy_out_of_the_value():
    """A decoded tensor does not share memory with the value it came from."""
    value = bytearray(encode((torch.zeros(1000, dtype=torch.uint8), 1), 3))
    out = decode(memoryview(bytes(value)), 3)
    out[0][:] = 9
    assert out[0].sum() == 9000
    assert torch.equal(decode(bytes(value), 3)[0], torch.zeros(1000, dtype=torch.uint8))


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
    value = encode(flat, INDEX)
    assert value[24] == 0xC1
    assert_same(flat, decode(value, INDEX))
    for general in [(1, "x"), (torch.ones(1), 2**63), (torch.ones(1), None), ()]:
        value = encode(general, INDEX)
        assert value[24] != 0xC1
        assert_same(general, decode(value, INDEX))
    mixed = (3, torch.ones(1), 2.5, torch.zeros(2))  # scalars before tensors: the general item order
    assert encode(mixed, INDEX)[24] == 0xC1
    assert_same(mixed, roundtrip(mixed))
    for single in [(torch.ones(3, dtype=torch.bfloat16), 1), (torch.zeros(0, 2), 2.5, False), (torch.tensor(4),)]:
        assert encode(single, INDEX)[24] == 0xC1  # one tensor first: the shortest path
        assert_same(single, roundtrip(single))


def test_a_planned_flat_sample_is_written_as_the_general_path_writes_it():
    """The flat plan cache writes the same bytes as the first, checked write; what it cannot take falls back."""
    from lmdbcache.format import _encode

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    kinds = [
        (base, 7, 0.5, True),
        (torch.arange(6, dtype=torch.bfloat16), -3),
        (torch.tensor(2.5, dtype=torch.float64), torch.ones(2, 2, dtype=torch.complex64)),
        (5, torch.zeros(3, dtype=torch.uint8), 2.0),
        (torch.zeros(0, 2), 1),  # no plan for an empty tensor: always the checked path
    ]
    for sample in kinds:
        _encode._FLAT_PLANS.clear()
        first = encode(sample, INDEX)
        assert encode(sample, INDEX) == first  # the second write goes through the plan
        assert_same(decode(first, INDEX), sample)
    # Same dtype and shape as a planned kind, but no plain view of its bytes (strided, conj or neg bit):
    # written exactly as its contiguous, resolved copy is.
    z = torch.arange(4, dtype=torch.float32).reshape(2, 2) * (1 + 2j)
    for variant in [torch.arange(12, dtype=torch.float32).reshape(4, 3).t(), z.conj(), z._neg_view(), z.t()]:
        plain = variant.resolve_conj().resolve_neg().contiguous().clone()
        _encode._FLAT_PLANS.clear()
        expected = encode((plain, 7), INDEX)
        encode((plain, 7), INDEX)  # the kind now has a plan
        assert encode((variant, 7), INDEX) == expected
    assert encode((base, 2**63, 0.5, True), INDEX)[24] != 0xC1  # an int beyond int64: the msgpack form
    for refused, what in [
        (base.clone().requires_grad_(), "requires grad"),
        (base.to_sparse(), "layout"),
        (torch.empty(3, 4, device="meta"), "device"),
    ]:
        with pytest.raises(UnsupportedSampleError, match=r"sample\[0\]") as info:
            encode((refused, 7, 0.5, True), INDEX)
        assert what in str(info.value)


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


def test_pil_mode_table_matches_pillow():
    """Every mode Pillow has is stored, and the byte count the reader demands is what tobytes() gives."""
    Image = pytest.importorskip("PIL.Image")
    assert set(getattr(Image, "MODES", PIL_BITS)) <= set(PIL_BITS)
    rng = np.random.default_rng(1)
    for mode, bits in PIL_BITS.items():
        for width, height in [(13, 5), (1, 1), (0, 4), (9, 0)]:
            im = Image.new(mode, (width, height))
            assert len(im.tobytes()) == (width * bits + 7) // 8 * height, (mode, width, height)
        raw = rng.integers(0, 256, len(Image.new(mode, (13, 5)).tobytes()), dtype=np.uint8).tobytes()
        im = Image.frombytes(mode, (13, 5), raw)
        assert_same(im, roundtrip(im))


def test_jpeg_file_image_comes_back_as_an_image(tmp_path):
    """A lazily loaded JpegImageFile (torchvision without a transform) is cached as its pixels, a plain Image."""
    Image = pytest.importorskip("PIL.Image")
    Image.new("RGB", (20, 10), (10, 200, 30)).save(tmp_path / "x.jpg")
    with Image.open(tmp_path / "x.jpg") as im:
        out = roundtrip(im)
        assert (out.mode, out.size, out.tobytes()) == (im.mode, im.size, im.tobytes())
        assert type(out) is Image.Image


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
        encode(sample, 17)
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
    value = encode(sample, INDEX)
    for offset in range(len(value)):
        with pytest.raises(CorruptSampleError):
            decode(_flip(value, offset), INDEX)


def test_truncated_and_extended_values_are_detected():
    """A value cut short or with bytes appended is never returned as a sample."""
    value = encode((torch.ones(10), 1), INDEX)
    for cut in (0, 5, 23, 24, 30, len(value) - 1):
        with pytest.raises(CorruptSampleError):
            decode(value[:cut], INDEX)
    with pytest.raises(CorruptSampleError):
        decode(value + b"\x00", INDEX)
    with pytest.raises(CorruptSampleError, match="magic"):
        decode(b"X" * 40, INDEX)


def test_value_layout_is_stable():
    """The bytes of known samples match the documented layout (a change here needs a FORMAT_VERSION bump)."""
    value = encode((torch.tensor([1, 2], dtype=torch.uint8), 5), 9)
    magic, size, structure_hash, data_hash = struct.unpack_from("<4sIQQ", value)
    assert magic == b"LMC\x02" and FORMAT_VERSION == 4  # formats 3 and 4 write uncompressed values as format 2 did
    structure = value[24 : 24 + size]
    assert structure_hash == xxhash.xxh3_64_intdigest(structure, seed=9)
    assert data_hash == xxhash.xxh3_64_intdigest(b"\x01\x02", seed=9)
    assert structure[0] == 0xC1
    assert value[24 + size :] == b"\x01\x02"
    sig_len = struct.unpack_from("<H", structure, 1)[0]
    assert structure[3 : 3 + sig_len] == b"T" + struct.pack("<BBQq", 1, 1, 2, 2) + b"q"
    assert structure[3 + sig_len :] == struct.pack("<q", 5)
    # The msgpack form: a list is an array headed by the empty ext 1; a big int is ext 9, two's complement.
    value = encode([1, -(2**70)], 9)
    structure = packb([ext(1, b""), 1, ext(9, (-(2**70)).to_bytes(9, "little", signed=True))])
    assert (
        value
        == struct.pack("<4sIQQ", b"LMC\x02", len(structure), xxhash.xxh3_64_intdigest(structure, seed=9), 9) + structure
    )


def test_value_is_bound_to_its_index():
    """A value decodes only under the index it was written for: under any other its structure checksum fails."""
    for sample in [(torch.arange(6), 1), {"a": [np.arange(3)]}, None, [2**80]]:
        value = encode(sample, 5)
        assert_same(sample, decode(value, 5))
        for other in (6, 4, 0, 5 ^ (1 << 40), 2**64 - 1):
            for verify_data in (True, False):
                with pytest.raises(CorruptSampleError, match="structure checksum"):
                    decode(value, other, verify_data=verify_data)


def test_index_out_of_range_is_refused():
    """Indices are 0 <= index < 2**64 (the checksum seed); any other raises InvalidOptionError, not a corrupt value."""
    value = encode(1, 2**64 - 1)
    assert decode(value, 2**64 - 1) == 1
    for bad in (-1, 2**64, 2**64 + 2**64 - 1):
        with pytest.raises(InvalidOptionError):
            encode(1, bad)
        with pytest.raises(InvalidOptionError):
            decode(value, bad)
    with pytest.raises(InvalidOptionError):
        encode(1, 1.0)


def test_format_1_values_decode_under_any_index(tmp_path):
    """Values written by 0.1.0 (format 1, checksums seeded 0, tests/data/golden-v1) decode under any index."""
    shutil.copy(GOLDEN / "data.mdb", tmp_path / "data.mdb")
    with lmdb.open(str(tmp_path), readonly=True, lock=False, max_dbs=2) as env:
        db = env.open_db(b"samples", create=False)
        with env.begin(db=db) as txn:
            values = [(struct.unpack(">Q", key)[0], bytes(value)) for key, value in txn.cursor()]
    expected = golden_samples(1)
    assert [index for index, _ in values] == list(range(len(expected)))
    for index, value in values:
        assert value[:4] == b"LMC\x01"
        for under in (index, index + 1, 0, 2**64 - 1):
            for verify_data in (True, False):
                assert_same(expected[index], decode(value, under, verify_data=verify_data))
                assert_same(expected[index], decode(memoryview(value), under, verify_data=verify_data))


def test_newer_format_asks_for_an_upgrade():
    """A value from a newer format says which, and to upgrade; it is not called a bad magic."""
    value = bytearray(encode((torch.ones(2), 1), INDEX))
    value[3] = FORMAT_VERSION + 1
    with pytest.raises(CorruptSampleError) as info:
        decode(bytes(value), INDEX)
    message = str(info.value)
    assert message == (
        f"written by lmdbcache format {FORMAT_VERSION + 1}; this lmdbcache reads formats 1 to {FORMAT_VERSION}: "
        "upgrade lmdbcache"
    )
    value[3] = 0
    with pytest.raises(CorruptSampleError, match="format version 0"):
        decode(bytes(value), INDEX)


class _TouchOnUnpickle:
    """Unpickling this creates a marker file: what a hostile cache file could make a reader do."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def _v1_structured_value(record: dict, scalar: bool = False) -> bytes:
    """A format-1 value holding one code-7 record, as 0.1.0 wrote it around msgpack-numpy's map."""
    return make_value(packb(ext(7, packb([scalar, packb(record)]))), version=1)


def test_format_1_structured_record_is_never_unpickled(tmp_path, monkeypatch):
    """A code-7 record carrying a pickle raises CorruptSampleError; pickle and msgpack-numpy are never called."""
    import msgpack_numpy

    marker = tmp_path / "unpickled"
    payload = pickle.dumps(np.array([_TouchOnUnpickle(marker)], dtype=object))
    calls: list[str] = []

    def spy(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    for module, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (msgpack_numpy, "decode")]:
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    hostile = [
        {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1], b"data": payload},
        {b"nd": True, b"type": [["a", "|O"]], b"kind": b"V", b"shape": [1], b"data": b"\x00" * 8},
        {b"nd": True, b"type": [["a", [["b", "O"]]]], b"kind": b"V", b"shape": [1], b"data": b"\x00" * 8},
        {b"nd": True, b"type": "|O", b"kind": b"", b"shape": [1], b"data": b"\x00" * 8},
        {b"nd": False, b"type": "|O", b"data": payload},
    ]
    for record in hostile:
        for scalar in (False, True):
            with pytest.raises(CorruptSampleError):
                decode(_v1_structured_value(record, scalar), INDEX)
    assert calls == [] and not marker.exists()


FORMAT_1_DTYPES = {
    "fields": [("x", "<f4"), ("y", "<i8", (2,))],
    "nested": [("a", "u1"), ("n", [("p", ">i2"), ("q", "S3")]), ("c", "<c8", (2, 1))],  # no datetimes: 0.1.0 could not
    "padded": np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8], "itemsize": 24}),
}


@pytest.mark.parametrize("dtype", list(FORMAT_1_DTYPES.values()), ids=list(FORMAT_1_DTYPES))
@pytest.mark.parametrize("scalar", [False, True], ids=["array", "scalar"])
def test_format_1_structured_records_decode_as_0_1_0_did(dtype, scalar):
    """A format-1 structured array decodes, without msgpack-numpy, to what 0.1.0 returned."""
    import msgpack_numpy

    dtype = np.dtype(dtype)
    arr = (
        np.ndarray((), dtype, bytearray(range(dtype.itemsize)))
        if scalar
        else np.ndarray((3,), dtype, bytearray(i % 251 for i in range(3 * dtype.itemsize)))
    )
    record = msgpack_numpy.encode(arr)
    expected = msgpack_numpy.decode(msgpack.unpackb(packb(record))).copy()  # 0.1.0's reader, on trusted bytes
    out = decode(_v1_structured_value(record, scalar), 123)
    expected = expected[()] if scalar else expected
    assert type(out) is type(expected)
    assert_same_dtype(out.dtype, expected.dtype)
    assert np.asarray(out).tobytes() == np.asarray(expected).tobytes()


def test_format_1_records_are_bounded():
    """Format-1 big ints read at most 4300 plain digits, and format-1 lists at most 32 deep (no C stack overflow)."""
    for digits, expected in [(b"1" * 4300, int("1" * 4300)), (b"-" + b"9" * 4300, -int("9" * 4300))]:
        assert decode(make_value(packb(ext(5, digits)), version=1), 0) == expected
    for digits in [b"1" * 4301, b"12_3", b" 12", "１２".encode(), b"", b"-", b"0x1f"]:
        with pytest.raises(CorruptSampleError):
            decode(make_value(packb(ext(5, digits)), version=1), 0)

    def v1_lists(depth: int) -> bytes:
        item: Any = 0
        for _ in range(depth):
            item = ext(1, packb([item]))  # 0.1.0's list: the items packed inside the record
        return packb(item)

    assert decode(make_value(v1_lists(32), version=1), 0) == nested(lambda x: [x], 32)
    with pytest.raises(CorruptSampleError, match="32 deep"):
        decode(make_value(v1_lists(33), version=1), 0)
    with pytest.raises(CorruptSampleError):
        decode(make_value(v1_lists(5000), version=1), 0)


BAD_DTYPE_STRINGS = [
    "|O", "O", "O8", "i4,O", "T", "StringDType()", "<i3", "|V", "S", "U", "float64", "<M8[xs]", "<i4\x00",
    "[('a', 'O')]", "(2,)i4", "<f4 ", "<S999999999999",
]  # fmt: skip


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", BAD_DTYPE_STRINGS)
def test_dtype_strings_are_checked_before_use(dtype, version):
    """An array record naming anything but a plain fixed-size dtype ('|O', 'i4,O', 'T', ...) is CorruptSampleError."""
    for code, shape in [(3, (2,)), (4, ())]:
        structure = packb(ext(code, array_payload(shape, 16 if shape else 8, dtype)))
        value = make_value(structure, [b"\x01" * (16 if shape else 8)], version=version)
        with pytest.raises(CorruptSampleError):
            decode(value, INDEX)


@pytest.mark.parametrize(
    ("sample", "what"),
    [
        ({"s": np.array(["a", "bc"], dtype=np.dtypes.StringDType())}, "StringDType"),
        ({"s": np.zeros(2, dtype="i4,O")}, "Python objects"),
        ({"s": np.zeros(2, dtype=[("a", [("b", "O")])])}, "field ['a']['b']"),
        ({"s": np.zeros(1, dtype="i4,O")[0]}, "Python objects"),
        ({"s": np.zeros(2, dtype=np.dtype("i4", metadata={"unit": "m"}))}, "metadata"),
        ({"s": np.zeros(2, dtype=np.dtype({"names": ["a"], "formats": ["i4"], "titles": [1]}))}, "title"),
        ({"s": np.rec.array([(1, 2.0)], dtype=[("x", "i4"), ("y", "f8")]).view(np.ndarray)}, "np.record"),
        ({"s": np.rec.array([(1, 2.0)], dtype=[("x", "i4"), ("y", "f8")])[0]}, "np.record"),
    ],
    ids=[
        "StringDType",
        "object field",
        "nested object field",
        "object np.void",
        "metadata",
        "int title",
        "record",
        "record scalar",
    ],
)
def test_unreadable_dtypes_are_refused_at_write(sample, what):
    """Dtypes a reader could not rebuild safely and exactly raise UnsupportedSampleError naming where: never written."""
    with pytest.raises(UnsupportedSampleError) as info:
        encode(sample, 17)
    message = str(info.value)
    assert "index 17 at sample['s']:" in message and what in message


STRUCTURED_DTYPES = {
    "padding": np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8], "itemsize": 24}),
    "aligned": np.dtype([("a", "u1"), ("b", "<f8"), ("c", "<i2")], align=True),
    "titles": np.dtype({"names": ["a", "b"], "formats": ["<i4", "u1"], "titles": ["Alpha", None]}),
    "nested": np.dtype([("p", np.dtype([("x", "<f4"), ("y", "u1")], align=True)), ("q", ">i8")]),
    "subarrays": np.dtype([("v", "<f4", (2, 3)), ("s", [("k", "u1"), ("m", "S2")], (2,))]),
    "offsets out of order": np.dtype({"names": ["late", "early"], "formats": ["<i4", "<i2"], "offsets": [8, 0]}),
    "overlapping": np.dtype({"names": ["a", "b"], "formats": ["<i4", "<i2"], "offsets": [0, 0]}),
    "zero-size field": np.dtype([("a", "U0"), ("b", "<i4")]),
    "no fields": np.dtype([]),
    "everything": np.dtype(
        {
            "names": ["h", "n", "v"],
            "formats": ["<f2", np.dtype([("d", "<M8[s]"), ("b", "?")], align=True), ("<c8", (2,))],
            "offsets": [2, 8, 32],
            "titles": [None, "Nested", "V"],
            "itemsize": 56,
        },
        align=True,
    ),
}


@pytest.mark.parametrize("dtype", list(STRUCTURED_DTYPES.values()), ids=list(STRUCTURED_DTYPES))
@pytest.mark.parametrize("layout", ["contiguous", "strided", "0-d", "np.void", "in a tuple"])
def test_structured_arrays_round_trip_exactly(dtype, layout):
    """Structured arrays and np.void come back with the same dtype (offsets, itemsize, titles, alignment) and bytes."""
    raw = bytearray(random.Random(0).randbytes(6 * dtype.itemsize))
    base = np.ndarray((6,), dtype, raw) if dtype.itemsize else np.empty((6,), dtype)
    sample = {
        "contiguous": base,
        "strided": base[::2],
        "0-d": base[3, ...],
        "np.void": base[4],
        "in a tuple": (base, 1),
    }[layout]
    expected = sample[0] if layout == "in a tuple" else sample
    out = roundtrip(sample)
    out = out[0] if layout == "in a tuple" else out
    assert type(out) is type(expected) and np.shape(out) == np.shape(expected)
    assert_same_dtype(out.dtype, dtype)
    assert raw_bytes(np.asarray(out)) == raw_bytes(np.asarray(expected))
    if layout == "strided" and dtype.itemsize:  # the padding of every other element, byte for byte
        assert raw_bytes(out) == b"".join(raw[i * dtype.itemsize : (i + 1) * dtype.itemsize] for i in (0, 2, 4))


@pytest.mark.parametrize(
    ("sample", "where", "limit"),
    [
        ((torch.zeros([1] * 65), 1), "sample[0]", "64"),
        ({"deep": torch.zeros([1] * 65)}, "sample['deep']", "64"),
        (nested(lambda x: (x,), 600), "sample[0][0][0][0][0][0]...", "200"),
        (nested(lambda x: [x], 600), "sample[0][0][0][0][0][0]...", "200"),
        (nested(lambda x: {"k": x}, 600), "sample['k']['k']['k']['k']['k']['k']...", "200"),
        ({nested(lambda x: (x,), 600): 1}, "sample", "200"),
        ((torch.empty(2**62, 0, 4, dtype=torch.uint8), 1), "sample[0]", "2**63"),
        (np.empty((2**21,), "V0"), "sample", str(2**20)),
    ],
    ids=[
        "65-d tensor",
        "65-d tensor in a dict",
        "tuples 600 deep",
        "lists 600 deep",
        "dicts 600 deep",
        "key 600 deep",
        "empty tensor beyond numpy",
        "2**21 zero-byte items",
    ],
)
def test_encoding_limits_raise_unsupported_sample_error(sample, where, limit):
    """A sample beyond a limit of the format raises UnsupportedSampleError naming where and the limit, nothing else."""
    with pytest.raises(UnsupportedSampleError) as info:
        encode(sample, 17)
    message = str(info.value)
    assert f"index 17 at {where}" in message and limit in message


@pytest.mark.parametrize(
    "sample",
    [
        tuple(torch.full([1] * 64, k) for k in range(130)),
        (torch.zeros([1] * 64), 10**5000, -(10**5000) - 1),
        10**5000,
        nested(lambda x: (x,), 200),
        nested(lambda x: [x], 200),
        nested(lambda x: {"k": x}, 199),
        {nested(lambda x: (x,), 199): 1},
        (torch.empty(2**61, 0, 2, dtype=torch.uint8), 1),
        np.empty((2**20,), "V0"),
    ],
    ids=[
        "130 64-d tensors",
        "flat-looking with big ints",
        "10**5000",
        "tuples 200 deep",
        "lists 200 deep",
        "dicts 199 deep",
        "key 199 deep",
        "huge empty tensor",
        "2**20 zero-byte items",
    ],
)
def test_samples_at_the_limits_round_trip(sample):
    """Samples at the limits (64-d, 130 tensors past the flat form's u16, huge ints, 200 deep) round-trip exactly."""
    value = encode(sample, INDEX)
    assert_same(sample, decode(value, INDEX))
    if type(sample) is tuple and len(sample) == 130:
        assert value[24] != 0xC1  # the signature would pass 65535 bytes: the general form instead


def test_deep_lists_decode_in_a_small_thread_stack():
    """Decoding a list nested at the 200 limit does not recurse: it works in a thread with a 512 KiB stack."""
    sample = nested(lambda x: [x], 200)
    value = encode(sample, INDEX)
    result: list[Any] = []
    previous = threading.stack_size(512 * 1024)
    try:
        thread = threading.Thread(target=lambda: result.append(decode(value, INDEX)))
        thread.start()
        thread.join()
    finally:
        threading.stack_size(previous)
    assert result == [sample]


def _pil_record(mode: Any, width: Any, height: Any, nbytes: Any, pal_mode: Any = None, pal: Any = None) -> Any:
    return ext(6, packb([mode, width, height, nbytes, pal_mode, pal]))


def _tensor_payload(dtype_code: int, shape, nbytes: int) -> bytes:
    return struct.pack(f"<BBQ{len(shape)}q", dtype_code, len(shape), nbytes, *shape)


HOSTILE = {
    "tensor nbytes past the value": (packb(ext(2, _tensor_payload(1, (2**40,), 2**40))), [b"\x00" * 16], (1, 2)),
    "tensor shape x itemsize != nbytes": (packb(ext(2, _tensor_payload(1, (2**62, 4), 16))), [b"\x00" * 16], (1, 2)),
    "negative dim": (packb(ext(2, _tensor_payload(1, (-2, -8), 16))), [b"\x00" * 16], (1, 2)),
    "66-d tensor": (packb(ext(2, _tensor_payload(1, (1,) * 66, 1))), [b"\x00"], (1, 2)),
    "array shape x itemsize != nbytes": (packb(ext(3, array_payload((2**30,), 8, "<f8"))), [b"\x00" * 8], (1, 2)),
    "V0 x 2**40": (packb(ext(3, array_payload((2**40,), 0, "|V0"))), [], (1, 2)),
    "S0 x 2**40": (packb(ext(3, array_payload((2**40,), 0, "|S0"))), [], (1, 2)),
    "U0 x 2**40 scalar": (packb(ext(4, array_payload((2**40,), 0, "<U0"))), [], (1, 2)),
    "empty dims beyond numpy": (packb(ext(3, array_payload((0, 2**62, 2**62), 0, "<f8"))), [], (1, 2)),
    "PIL 2**20 x 2**20": (packb(_pil_record("RGB", 2**20, 2**20, 3)), [b"\x00" * 3], (1, 2)),
    "PIL 0 x 2**31-1": (packb(_pil_record("L", 0, 2**31 - 1, 0)), [], (1, 2)),
    "PIL negative size": (packb(_pil_record("L", -4, -4, 16)), [b"\x00" * 16], (1, 2)),
    "PIL mode": (packb(_pil_record("BGR;15", 2, 2, 8)), [b"\x00" * 8], (1, 2)),
    "PIL mode type": (packb(_pil_record(["L"], 2, 2, 4)), [b"\x00" * 4], (1, 2)),
    "PIL palette": (packb(_pil_record("P", 2, 2, 4, "RGB", b"\x00" * 5000)), [b"\x00" * 4], (1, 2)),
    "PIL palette mode": (packb(_pil_record("P", 2, 2, 4, "CMYK;I", b"\x00" * 12)), [b"\x00" * 4], (1, 2)),
    "structured V0 x 2**40": (packb(ext(8, packb([[2**40], 0, "|V0", False]))), [], (2,)),
    "structured huge subarray": (
        packb(
            ext(
                8,
                packb(
                    [
                        [1],
                        8,
                        {
                            "names": ["a"],
                            "formats": [{"base": "<f8", "shape": [2**40, 2**40]}],
                            "offsets": [0],
                            "titles": None,
                            "itemsize": 8,
                            "aligned": False,
                        },
                        False,
                    ]
                ),
            )
        ),
        [b"\x00" * 8],
        (2,),
    ),
    "format-1 structured 2**40 x itemsize 0": (
        packb(
            ext(
                7,
                packb(
                    [
                        False,
                        packb({b"nd": True, b"type": [["a", "|V0"]], b"kind": b"V", b"shape": [2**40], b"data": b""}),
                    ]
                ),
            )
        ),
        [],
        (1,),
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_sizes_are_refused_before_allocating(name, monkeypatch):
    """Sizes, shapes and modes read from a value are checked before anything is sized from them."""
    Image = pytest.importorskip("PIL.Image")
    structure, buffers, versions = HOSTILE[name]
    allocations: list[Any] = []
    real_empty, real_new, real_frombytes = np.empty, Image.new, Image.frombytes

    def empty(shape, *args, **kwargs):
        allocations.append(("np.empty", shape))
        return real_empty(shape, *args, **kwargs)

    def new(mode, size, *args, **kwargs):
        allocations.append(("Image.new", size))
        return real_new(mode, size, *args, **kwargs)

    def frombytes(mode, size, *args, **kwargs):
        allocations.append(("Image.frombytes", size))
        return real_frombytes(mode, size, *args, **kwargs)

    monkeypatch.setattr(np, "empty", empty)
    monkeypatch.setattr(Image, "new", new)
    monkeypatch.setattr(Image, "frombytes", frombytes)
    for version in versions:
        with pytest.raises(CorruptSampleError):
            decode(make_value(structure, buffers, version=version), INDEX)
    assert allocations == []


BOTH, V2 = (1, 2), (2,)
CRAFTED = {  # name: (structure, buffers, the format versions whose vocabulary it uses)
    "list marker not first": (packb([1, ext(1, b"")]), [], V2),
    "list marker alone": (packb(ext(1, b"")), [], V2),
    "list marker in a map": (packb({"a": ext(1, b"")}), [], V2),
    "list marker with a payload": (packb([ext(1, b"\x90")]), [], V2),
    "empty big int": (packb(ext(9, b"")), [], V2),
    "format-1 big int in format 2": (packb(ext(5, b"123")), [], V2),
    "format-1 structured in format 2": (packb(ext(7, packb([False, packb({})]))), [], V2),
    "unknown ext": (packb(ext(42, b"")), [], BOTH),
    "numpy scalar with a shape": (packb(ext(4, array_payload((2,), 2, "|u1"))), [b"\x00\x00"], BOTH),
    "structured: scalar with a shape": (packb(ext(8, packb([[2], 2, "|u1", True]))), [b"\x00\x00"], V2),
    "structured: unknown dtype keys": (packb(ext(8, packb([[1], 1, {"names": ["a"], "evil": 1}, False]))), [], V2),
    "structured: fields past itemsize": (
        packb(
            ext(
                8,
                packb(
                    [
                        [1],
                        1,
                        {
                            "names": ["a"],
                            "formats": ["<f8"],
                            "offsets": [0],
                            "titles": None,
                            "itemsize": 1,
                            "aligned": False,
                        },
                        False,
                    ]
                ),
            )
        ),
        [b"\x00"],
        V2,
    ),
    "structured: ext inside the dtype": (packb(ext(8, packb([[1], 1, ext(3, b""), False]))), [b"\x00"], V2),
    "structured: dtype nested 1000 deep": (
        packb(ext(8, packb([[1], 1, nested(lambda d: {"base": d, "shape": [1]}, 1000, "|u1"), False]))),
        [b"\x00"],
        V2,
    ),
    "format-1 structured: descr with a title": (
        packb(
            ext(
                7,
                packb(
                    [
                        False,
                        packb(
                            {
                                b"nd": True,
                                b"type": [[["T", "a"], "|u1"]],
                                b"kind": b"V",
                                b"shape": [1],
                                b"data": b"\x00",
                            }
                        ),
                    ]
                ),
            )
        ),
        [],
        (1,),
    ),
    "format-1 structured: data longer than the shape": (
        packb(
            ext(
                7,
                packb(
                    [
                        False,
                        packb(
                            {b"nd": True, b"type": [["a", "|u1"]], b"kind": b"V", b"shape": [1], b"data": b"\x00" * 5}
                        ),
                    ]
                ),
            )
        ),
        [],
        (1,),
    ),
    "flat: no items": (b"\xc1\x00\x00", [], BOTH),
    "flat: unknown tag": (b"\xc1\x01\x00Z", [], BOTH),
    "flat: 300 items": (b"\xc1" + struct.pack("<H", 300) + b"q" * 300 + struct.pack("<300q", *range(300)), [], BOTH),
    "flat: signature length past the structure": (b"\xc1\xff\x00q" + struct.pack("<q", 1), [], BOTH),
    "flat: tensor cut short": (b"\xc1\x03\x00T\x01\x02", [], BOTH),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_records_are_corrupt(name):
    """Records no writer produces, even with valid checksums, raise CorruptSampleError and nothing else."""
    structure, buffers, versions = CRAFTED[name]
    for version in versions:
        with pytest.raises(CorruptSampleError):
            decode(make_value(structure, buffers, version=version), INDEX)


def test_format_2_records_are_corrupt_in_format_1():
    """Codes 8 and 9 and the list marker are format 2's: inside a format-1 value they are corrupt."""
    for structure in [packb(ext(9, b"\x01" * 9)), packb(ext(8, packb([[], 1, "|u1", False]))), packb([ext(1, b"")])]:
        buffers = [b"\x00"] if b"|u1" in structure else []
        with pytest.raises(CorruptSampleError):
            decode(make_value(structure, buffers, version=1), INDEX)


def test_numpy_scalar_record_with_a_shape_is_corrupt_even_after_a_cache_hit():
    """The parsed-record cache is shared by arrays and scalars; a scalar record with a shape is still refused."""
    payload = array_payload((2,), 2, "|u1")
    assert decode(make_value(packb(ext(3, payload)), [b"\x01\x02"]), INDEX).tolist() == [1, 2]  # now cached
    with pytest.raises(CorruptSampleError, match="scalar"):
        decode(make_value(packb(ext(4, payload)), [b"\x01\x02"]), INDEX)


def test_writable_buffers_decode():
    """A value in a bytearray or a writable memoryview decodes like bytes (the plan cache needs a hashable key)."""
    for sample in [(torch.arange(4), 2), {"a": [torch.arange(3)]}]:
        value = encode(sample, INDEX)
        for form in (bytearray(value), memoryview(bytearray(value))):
            assert_same(sample, decode(form, INDEX))


# Run in a fresh interpreter: samples without a tensor, then a value holding one (argv[1], index argv[3]).
_TORCH_ONLY_FOR_TENSORS = """
import numpy as np
from lmdbcache.codec import decode, encode

samples = [
    (1, 2.5, True),  # the flat form, without a tensor
    {"a": [np.arange(6).reshape(2, 3), "x", None], 1: np.float32(1.5)},
    [10**30, b"raw", np.zeros(2, dtype=[("x", "<f4"), ("y", "<i8", (2,))])],
]
for index, sample in enumerate(samples):
    back = decode(encode(sample, index), index)
    assert repr(back) == repr(sample), (back, sample)
imported = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "PIL"})
assert not imported, imported
t = decode(bytes.fromhex(sys.argv[1]), int(sys.argv[3]))[0]
assert "torch" in sys.modules and type(t).__module__ == "torch" and t.tolist() == [0, 1, 2]
"""
# The codec's own modules, loaded under a stand-in for the package's __init__ (argv[2] is the package directory).
_CODEC_MODULES_ALONE = """
import sys, types
package = types.ModuleType("lmdbcache")
package.__path__ = [sys.argv[2]]
sys.modules["lmdbcache"] = package
"""


@pytest.mark.parametrize(
    "load",
    [
        pytest.param("import sys\nimport lmdbcache.codec\n", id="import lmdbcache.codec"),
        pytest.param(_CODEC_MODULES_ALONE, id="codec modules alone"),
    ],
)
def test_codec_imports_torch_only_for_a_tensor(load):
    """Samples without tensors encode and decode without importing torch or Pillow; a tensor record imports torch."""
    value = encode((torch.arange(3), 1), INDEX)
    run_script(load + _TORCH_ONLY_FOR_TENSORS, value.hex(), lmdbcache.__path__[0], str(INDEX))


# ----------------------------------------------------------------------------------------
# Fuzzing the reader: valid values, mutated, with and without the structure checksum
# recomputed (so that the parser itself, not only the checksum, meets the damage).

_DANGEROUS_STRINGS = ["|O", "T", "|V0", "|S0", "<U0", "i4,O", "BGR;15", "P", "RGB", "names", "base", ""]
_DANGEROUS_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**40, 2**63 - 1, -(2**63), 2**64 - 1, 65]


def _fuzz_values() -> list[tuple[bytes, int]]:
    import msgpack_numpy

    Image = pytest.importorskip("PIL.Image")
    image = Image.frombytes("P", (5, 3), bytes(range(15)))
    image.putpalette(list(range(48)))
    aligned = STRUCTURED_DTYPES["everything"]
    structured = np.ndarray((3,), aligned, bytearray(random.Random(1).randbytes(3 * aligned.itemsize)))
    samples = [
        (torch.arange(24, dtype=torch.int16).reshape(2, 3, 4), 7, 0.5, True, torch.ones(2, dtype=torch.bfloat16)),
        (torch.arange(48, dtype=torch.uint8).reshape(3, 4, 4), 9),
        {"a": [1, (2.5, "x", b"y")], "t": [torch.ones(3)], "n": np.arange(6).reshape(2, 3), "s": np.float32(1)},
        (structured, structured[1], np.datetime64("2024-01-02")),
        (image, Image.new("RGB", (2, 2)), 3),
        [10**40, -(2**100), {(1, 2): 2**64 - 1}],
    ]
    values = [(encode(sample, INDEX), 2) for sample in samples]
    record = packb([True, packb(msgpack_numpy.encode(np.zeros((), FORMAT_1_DTYPES["nested"])))])
    values.append((make_value(packb([ext(7, record), ext(1, packb([ext(5, b"1" * 30), 2]))]), version=1), 1))
    return values


def _mutate_leaves(obj: Any, rng: random.Random) -> Any:
    """One msgpack object with a random leaf replaced by a dangerous int or string."""
    if isinstance(obj, (list, tuple)) and obj:
        k = rng.randrange(len(obj))
        return [*obj[:k], _mutate_leaves(obj[k], rng), *obj[k + 1 :]]
    if isinstance(obj, dict) and obj:
        key = rng.choice(list(obj))
        return {**obj, key: _mutate_leaves(obj[key], rng)}
    if isinstance(obj, msgpack.ExtType):
        return msgpack.ExtType(obj.code, _mutate_bytes(obj.data, rng, structured=True))
    return rng.choice(_DANGEROUS_INTS + _DANGEROUS_STRINGS + [None, True, [], {}, b"\x00" * 9])


def _mutate_bytes(data: bytes, rng: random.Random, structured: bool = False) -> bytes:
    """``data`` with one random mutation; a msgpack payload sometimes has a leaf replaced instead."""
    if structured and data and rng.random() < 0.5:
        try:
            inner = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
        except Exception:
            inner = None
        if inner is not None:
            return packb(_mutate_leaves(inner, rng))
    out = bytearray(data)
    op = rng.randrange(5)
    if op == 0 and out:  # flip bits
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif op == 1 and out:  # zero a range
        start = rng.randrange(len(out))
        out[start : start + rng.randint(1, 16)] = bytes(min(16, len(out) - start))
    elif op == 2:  # truncate
        del out[rng.randint(0, len(out)) :]
    elif op == 3:  # splice random bytes over a range
        start = rng.randint(0, len(out))
        out[start : start + rng.randint(0, 8)] = rng.randbytes(rng.randint(0, 12))
    else:  # set a random 2, 4 or 8-byte field to an extreme
        width = rng.choice([2, 4, 8])
        if len(out) >= width:
            start = rng.randrange(len(out) - width + 1)
            out[start : start + width] = rng.choice([b"\xff", b"\x7f", b"\x80", b"\x00"]) * width
    return bytes(out)


def _mutate(value: bytes, version: int, rng: random.Random) -> bytes:
    if rng.random() < 0.3:  # anywhere, checksums left as they are
        return _mutate_bytes(value, rng)
    size = struct.unpack_from("<I", value, 4)[0]
    structure, buffers = value[24 : 24 + size], value[24 + size :]
    if rng.random() < 0.2:
        buffers = _mutate_bytes(buffers, rng)
    else:
        structure = _mutate_bytes(structure, rng, structured=structure[:1] != b"\xc1")
    return make_value(structure, [buffers] if buffers else [], version=version)  # both checksums recomputed


def test_decode_raises_only_corrupt_sample_error():
    """Fuzz: mutated values (checksums kept or recomputed) decode to something or raise CorruptSampleError."""
    values = _fuzz_values()
    for value, _ in values:
        decode(value, INDEX)  # each seed decodes before it is damaged
    rng = random.Random(20240601)
    rounds = 500_000 if STRESS else 50_000
    outcomes = collections.Counter()
    for n in range(rounds):
        value, version = values[n % len(values)]
        damaged = _mutate(value, version, rng)
        try:
            decode(damaged, INDEX, verify_data=rng.random() < 0.5)
            outcomes["decoded"] += 1
        except CorruptSampleError:
            outcomes["corrupt"] += 1
        except Exception as exc:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"round {n}: {type(exc).__name__}: {exc} for value {damaged!r}")
    assert outcomes["corrupt"] > rounds // 2 and outcomes["decoded"] > 0, outcomes
