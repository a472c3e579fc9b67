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

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
keys = st.one_of(st.text(max_size=8), st.integers(min_value=-(2**40), max_value=2**40))
leaves = st.one_of(scalars, tensors(), numpy_arrays(), numpy_scalars)
samples = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)
