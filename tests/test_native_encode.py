"""The core's flat writer (``core.encode_flat``; ``core.encode_sample``: a miss's value in one call) against the Python
encoder: byte-identical values over random flat samples, and every sample it does not plan for handed back to Python
(None), never written.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import lmdbcache.store._native_read  # noqa: F401  (hands the core's writer to the encoder)
from lmdbcache import _native
from lmdbcache.errors import UnsupportedSampleError
from lmdbcache.format import _encode
from lmdbcache.format.codec import decode, encode

core = _native.core
pytestmark = pytest.mark.skipif(core is None, reason="the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.complex64,
]


def _python(sample: Any, index: int) -> bytes:
    """The value as the pure-Python encoder writes it."""
    saved = _encode._encode_flat, _encode._encode_sample
    _encode.use_native(None)
    try:
        return encode(sample, index)
    finally:
        _encode.use_native(*saved)


def _tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    ndim = rng.choice([0, 1, 1, 2, 3, 4])
    shape = [rng.choice([0, 1, 2, 3, 5, 8]) if rng.random() < 0.1 else rng.randint(1, 6) for _ in range(ndim)]
    t = torch.randn(shape).mul(50) if dtype.is_floating_point or dtype.is_complex else torch.randint(-100, 100, shape)
    t = t.to(dtype)
    kind = rng.random()
    if kind < 0.15 and t.dim() >= 2:
        t = t.transpose(0, 1)  # not contiguous
    elif kind < 0.25 and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]  # contiguous, at a storage offset
    elif kind < 0.3 and t.dim() >= 1:
        t = t[::2]  # strided
    return t


def _scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            rng.randint(-(2**63), 2**63 - 1),
            rng.randint(-5, 5),
            rng.random() * 1e6,
            float("nan"),
            -0.0,
            float("inf"),
            True,
            False,
            2**63,  # beyond int64: the msgpack form
            -(2**63) - 1,
        ]
    )


def _samples(seed: int, count: int) -> Iterator[tuple[Any, ...]]:
    rng = random.Random(seed)
    for _ in range(count):
        items: list[Any] = []
        for _ in range(rng.randint(1, 5)):
            items.append(_tensor(rng, rng.choice(DTYPES)) if rng.random() < 0.6 else _scalar(rng))
        yield tuple(items)


@pytest.mark.parametrize("seed", range(6))
def test_core_and_python_write_the_same_bytes(seed: int) -> None:
    """Random flat samples (every dtype incl. bool, float16, bfloat16; 0-d, empty, non-contiguous, scalars at
    int64's edges and beyond, NaN, -0.0), each written twice so that the second one has a plan: the values are
    byte-identical, and a value the core wrote decodes to the sample."""
    written = 0
    for k, sample in enumerate(_samples(seed, 150)):
        for index in (k, 2**64 - 1 - k):
            expected = _python(sample, index)
            for _ in range(2):
                assert encode(sample, index) == expected
            assert _encode.encode_miss(sample, index) == expected
            value = _encode._native_flat(sample, index)  # core.encode_sample: the kind, plan, views in one call
            if value is not None:
                written += 1
                assert value == expected
                out = decode(value, index)
                for a, b in zip(out, sample):
                    if isinstance(b, torch.Tensor):
                        assert a.dtype == b.dtype and a.shape == b.shape
                        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
                    elif b == b:
                        assert a == b and type(a) is type(b)
    assert written > 100  # the core wrote most of them


def test_a_planned_kind_with_other_items_goes_back_to_python() -> None:
    """A sample of a planned kind whose items the core cannot take is handed back (None) and Python writes it."""
    base = (torch.arange(6, dtype=torch.int16).reshape(2, 3), 7)
    encode(base, 0)  # plans the kind
    assert _encode._native_flat(base, 1) == _python(base, 1)
    odd = [
        (torch.arange(6, dtype=torch.int16).reshape(3, 2).t(), 7),  # not contiguous, same dtype and shape
        (torch.arange(6, dtype=torch.int16).reshape(2, 3).conj(), 7),
        (torch.arange(6, dtype=torch.float32).reshape(2, 3).mul(1j).conj(), 7),  # a kind of its own: complex, conj bit
    ]
    for sample in odd:
        assert encode(sample, 3) == _python(sample, 3)
    big = (base[0], 2**63)  # a kind of its own (int), beyond int64: msgpack form
    assert encode(big, 4) == _python(big, 4)
    grad = (torch.ones(2, 3, dtype=torch.float32, requires_grad=True), 1)
    encode((torch.ones(2, 3), 1), 0)
    with pytest.raises(UnsupportedSampleError):
        encode(grad, 5)


def test_encode_flat_checks_its_arguments() -> None:
    """The core never writes what the signature does not name: wrong lengths, counts, codes or buffers give None."""
    assert core is not None
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    sample = (torch.from_numpy(arr.copy()), 7)
    encode(sample, 0)
    plan = _encode._FLAT_PLANS[((torch.int16, torch.Size([2, 3])), int)]
    prefix, _, _, _, codes = plan
    good = core.encode_flat(prefix, codes, (arr,), (7,), 9)
    assert good == _python(sample, 9)
    bad_calls = [
        (prefix, codes, (arr[:, :2].copy(),), (7,)),  # the buffer's length is not the record's nbytes
        (prefix, codes, (arr.T,), (7,)),  # not C-contiguous
        (prefix, codes, (), (7,)),  # a buffer missing
        (prefix, codes, (arr, arr), (7,)),  # one too many
        (prefix, b"d", (arr,), (7,)),  # a code the signature does not hold
        (prefix, codes, (arr,), (7.0,)),  # a float for an int
        (prefix, codes, (arr,), (True,)),  # a bool for an int
        (prefix, codes, (arr,), (2**63,)),  # beyond int64
        (prefix[:-1], codes, (arr,), (7,)),  # a signature shorter than its length says
        (prefix + b"q", codes, (arr,), (7,)),
        (b"\xc1", codes, (arr,), (7,)),
        (b"", b"", (), ()),
        (prefix, codes, (object(),), (7,)),  # no buffer
    ]
    for args in bad_calls:
        assert core.encode_flat(*args, 9) is None, args
    with pytest.raises(TypeError):
        core.encode_flat(prefix, codes, [arr], (7,), 9)
    with pytest.raises(OverflowError):
        core.encode_flat(prefix, codes, (arr,), (7,), -1)


def test_encode_sample_takes_only_what_its_plan_names() -> None:
    """``core.encode_sample`` finds the plan Python's kind finds and writes the same bytes; a tensor subclass, a
    list, an unplanned kind or a hostile plan (positions out of range, wrong shapes) give None, never a crash."""
    assert core is not None and _encode._encode_sample is not None
    sample = (torch.arange(6, dtype=torch.int16).reshape(2, 3), 7, 0.5)
    encode(sample, 0)
    key = _encode._kind(sample)
    plans = _encode._FLAT_PLANS
    assert core.encode_sample(sample, 9, plans, torch.Tensor) == _python(sample, 9)

    class Sub(torch.Tensor):
        pass

    assert core.encode_sample((sample[0].as_subclass(Sub), 7, 0.5), 9, plans, torch.Tensor) is None
    assert core.encode_sample(list(sample), 9, plans, torch.Tensor) is None
    unplanned = (torch.zeros(3, 11, dtype=torch.int16), 7)
    assert _encode._kind(unplanned) not in plans
    assert core.encode_sample(unplanned, 9, plans, torch.Tensor) is None
    assert core.encode_sample((), 9, plans, torch.Tensor) is None
    prefix, pack, tensors, scalars, codes = plans[key]
    hostile = [
        (prefix, pack, ((5, None),), scalars, codes),  # a tensor position past the sample
        (prefix, pack, ((-1, None),), scalars, codes),
        (prefix, pack, tensors, (1, 9), codes),  # a scalar position past the sample
        (prefix, pack, ((1, None),), scalars, codes),  # an int where a tensor is named: no numpy()
        (prefix, pack, (("0", None),), scalars, codes),
        (prefix, pack, ((0,),), scalars, codes),
        (prefix, pack, tensors, scalars),
        (prefix, pack, [(0, None)], scalars, codes),
        "not a plan",
    ]
    for plan in hostile:
        assert core.encode_sample(sample, 9, {key: plan}, torch.Tensor) is None, plan
    with pytest.raises(TypeError):
        core.encode_sample(sample, 9, None, torch.Tensor)
    with pytest.raises(OverflowError):
        core.encode_sample(sample, -1, plans, torch.Tensor)
