"""The compiled core (``lmdbcache._native``): the switch, and each native piece against its Python reference."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from lmdbcache import _native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
core = _native.core
needs_core = pytest.mark.skipif(core is None, reason="the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LMDBCACHE_PURE_PYTHON"}
    environ.update(PYTHONPATH=ROOT, **env)
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_forced_pure_python() -> None:
    """LMDBCACHE_PURE_PYTHON=1 gives no core and no warning."""
    out = _child(
        "import warnings; warnings.simplefilter('error')\n"
        "from lmdbcache import _native; print(_native.NATIVE, _native.core)",
        LMDBCACHE_PURE_PYTHON="1",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "None"]


def test_import_failure_warns_once() -> None:
    """A core that cannot be imported gives exactly one LmdbCacheWarning naming the fallback and the rebuild."""
    out = _child(
        "import sys, warnings\n"
        "sys.modules['lmdbcache._native._core'] = None  # the import now fails as a missing build does\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    from lmdbcache import _native\n"
        "    import lmdbcache._native, lmdbcache\n"
        "print(_native.NATIVE)\n"
        "for w in seen: print(w.category.__name__, '|', w.message)\n"
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False"
    assert len(lines) == 2, lines
    assert lines[1].startswith("LmdbCacheWarning |")
    assert "pure-Python path is used" in lines[1] and "pip install" in lines[1]


@needs_core
def test_core_is_the_built_extension() -> None:
    """The core found is the compiled module inside the package."""
    assert core is not None and _native.NATIVE
    assert core.__name__ == "lmdbcache._native._core"
    assert core.__file__.endswith((".so", ".pyd"))


# ----------------------------------------------------------------------------------------
# XXH3-64 (the codec's checksums) against the xxhash package


@needs_core
def test_xxh3_every_small_length() -> None:
    """xxh3_64 equals xxhash's on random inputs of every length 0..2000 (every length class), seeded and not."""
    rng = random.Random(24)
    for n in range(2001):
        data = rng.randbytes(n)
        for seed in (0, rng.getrandbits(64)):
            assert core.xxh3_64(data, seed) == xxh3_64_intdigest(data, seed), (n, seed)


@needs_core
@pytest.mark.parametrize("n", [1 << 20, (1 << 20) + 7, 3 * 224 * 224 + 1, 1023, 1024, 1025, 4096 + 63])
def test_xxh3_large(n: int) -> None:
    """xxh3_64 equals xxhash's over many blocks and stripes, the GIL released, with random u64 seeds."""
    rng = random.Random(n)
    data = rng.randbytes(n)
    for seed in (0, 1, 2**64 - 1, rng.getrandbits(64)):
        assert core.xxh3_64(data, seed) == xxh3_64_intdigest(data, seed)
    assert core.xxh3_64(bytearray(data)) == core.xxh3_64(memoryview(data)) == xxh3_64_intdigest(data)


@needs_core
@given(data=st.binary(max_size=600), seed=st.integers(min_value=0, max_value=2**64 - 1))
@settings(max_examples=300, deadline=None)
def test_xxh3_hypothesis(data: bytes, seed: int) -> None:
    """xxh3_64 equals xxhash's on arbitrary short inputs and seeds."""
    assert core.xxh3_64(data, seed) == xxh3_64_intdigest(data, seed)


@needs_core
def test_xxh3_arguments() -> None:
    """Seeds wrap modulo 2**64 as xxhash's do; non-buffers and wrong arity raise TypeError."""
    for seed in (-1, 2**64, 2**65 + 3):
        assert core.xxh3_64(b"abc", seed) == xxh3_64_intdigest(b"abc", seed)
    assert core.xxh3_64(np.arange(10, dtype=np.int64)) == xxh3_64_intdigest(np.arange(10, dtype=np.int64).tobytes())
    with pytest.raises(TypeError):
        core.xxh3_64("text")
    with pytest.raises(TypeError):
        core.xxh3_64()
    with pytest.raises(TypeError):
        core.xxh3_64(b"", 0, 1)
