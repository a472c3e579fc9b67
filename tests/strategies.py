"""Hypothesis strategies for samples the codec must round-trip exactly."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

NUMPY_DTYPES = [
    "bool", "int8", "uint8", "int16", ">i2", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", ">f4", "float64", "complex64", "complex128", "<U3", "|S4", "datetime64[ms]", "timedelta64[s]",
]  # fmt: skip

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]  # fmt: skip

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def numpy_arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    arr = draw(hnp.arrays(dtype, shapes))
    if arr.ndim >= 2 and draw(st.booleans()):
        arr = arr.T  # non-contiguous input
    return arr


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    n = int(np.prod(shape)) if shape else 1
    data = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    t = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
        if n
        else torch.empty(shape, dtype=dtype)
    )
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous input
    return t


numpy_scalars = numpy_arrays().filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0])

STRUCT_LEAF_DTYPES = [
    "|b1", "|i1", "<i2", ">i4", "<u8", "<f2", ">f8", "<c8", "|S3", "<U2", "|V2", "<M8[s]", ">m8[ms]",
]  # fmt: skip


@st.composite
def structured_dtypes(draw, depth=0):
    """Structured dtypes with padding, explicit offsets or align=True, titles, nested structs and subarrays."""
    names = draw(
        st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=0 if depth else 1, max_size=4, unique=True)
    )
    formats = []
    for _ in names:
        kind = draw(st.sampled_from(["leaf", "leaf", "subarray", "nested"] if depth < 2 else ["leaf", "subarray"]))
        if kind == "nested":
            formats.append(draw(structured_dtypes(depth + 1)))
            continue
        leaf = np.dtype(draw(st.sampled_from(STRUCT_LEAF_DTYPES)))
        if kind == "subarray":
            leaf = np.dtype((leaf, tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))))
        formats.append(leaf)
    spec = {"names": names, "formats": formats}
    if draw(st.booleans()):
        spec["titles"] = [f"T{name}" if draw(st.booleans()) else None for name in names]
    if draw(st.booleans()):
        return np.dtype(spec, align=True)  # numpy places the fields and pads the end
    offsets, end = [], 0
    for fmt in formats:  # explicit offsets with padding between fields and after the last
        end += draw(st.integers(0, 3))
        offsets.append(end)
        end += fmt.itemsize
    return np.dtype({**spec, "offsets": offsets, "itemsize": end + draw(st.integers(0, 4))})


@st.composite
def structured_arrays(draw, contiguous=False):
    """C-contiguous (or, unless ``contiguous``, strided) arrays of random bytes, padding bytes included."""
    dtype = draw(structured_dtypes())
    shape = draw(shapes)
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    arr = np.ndarray(shape, dtype, bytearray(raw)) if dtype.itemsize else np.empty(shape, dtype)
    if not contiguous and arr.ndim >= 1 and draw(st.booleans()):
        arr = arr[::-1]  # non-contiguous input: the padding must still come back
    return arr


structured_scalars = structured_arrays(contiguous=True).filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
keys = st.one_of(st.text(max_size=8), st.integers(min_value=-(2**40), max_value=2**40))
leaves = st.one_of(
    scalars, tensors(), numpy_arrays(), numpy_scalars, structured_arrays(contiguous=True), structured_scalars
)
samples = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)
