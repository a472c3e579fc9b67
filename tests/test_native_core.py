"""The compiled core's byte-level pieces against their Python references, with no torch: XXH3-64 against the
xxhash package, the LMDB snapshot reader (``open_tree``, ``locate``, ``locate_batch``) against py-lmdb.

Apart from tests/test_native.py (the switch, the loader's batch path, ``fill``), so that ``make native-pythons`` can
run them on every CPython the package declares, in a venv without torch.
"""

from __future__ import annotations

import ctypes
import os
import random
import struct
import subprocess
import sys
from typing import Any

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

import lmdbcache
from lmdbcache import _native
from lmdbcache.store._engine import layout_of
from lmdbcache.store._guard import MapGuard

# Where the lmdbcache under test was imported from (the checkout, or a venv's site-packages): a child imports the same.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(lmdbcache.__file__)))
core = _native.core
needs_core = pytest.mark.skipif(core is None, reason="the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")


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


# Lengths around XXH3's edges: the long form from 241 bytes, stripes of 64, blocks of 1024 (16 stripes).
_EDGE_LENGTHS = st.one_of(
    st.integers(0, 4096),
    st.builds(
        lambda blocks, off: max(0, blocks * 1024 + off),
        st.integers(0, 160),
        st.sampled_from([-65, -64, -63, -1, 0, 1, 2, 63, 64, 65, 500, 960, 961]),
    ),
)


@needs_core
@given(n=_EDGE_LENGTHS, seed=st.one_of(st.just(0), st.integers(0, 2**64 - 1)), fill=st.integers(0, 2**32))
@settings(max_examples=300, deadline=None)
def test_xxh3_copy_hypothesis(n: int, seed: int, fill: int) -> None:
    """xxh3_64_copy (the first read's copy and checksum in one pass) copies exactly the source, touches nothing
    around the destination, and returns xxh3_64 of it: lengths ending mid-stripe, mid-block, on block edges."""
    data = random.Random(fill).randbytes(n)
    buf = bytearray(b"\xa5" * (n + 128))
    digest = core.xxh3_64_copy(memoryview(buf)[64 : 64 + n], data, seed)
    assert digest == core.xxh3_64(data, seed) == xxh3_64_intdigest(data, seed), (n, seed)
    assert buf[64 : 64 + n] == data
    assert buf[:64] == buf[64 + n :] == b"\xa5" * 64


@needs_core
def test_xxh3_copy_arguments() -> None:
    """xxh3_64_copy refuses a read-only, shorter, longer or overlapping destination before copying anything."""
    data = bytes(range(256)) * 4
    with pytest.raises(BufferError):
        core.xxh3_64_copy(bytes(len(data)), data)
    for size in (len(data) - 1, len(data) + 1):
        dest = bytearray(size)
        with pytest.raises(ValueError, match="length"):
            core.xxh3_64_copy(dest, data)
        assert dest == bytearray(size)
    shared = bytearray(data) + bytearray(512)
    with pytest.raises(ValueError, match="overlap"):
        core.xxh3_64_copy(memoryview(shared)[512:], memoryview(shared)[: len(data)])
    with pytest.raises(TypeError):
        core.xxh3_64_copy(bytearray(1))
    assert core.xxh3_64_copy(bytearray(0), b"") == xxh3_64_intdigest(b"")
    assert core.xxh3_64_copy(bytearray(len(data)), data, -1) == xxh3_64_intdigest(data, 2**64 - 1)


# ----------------------------------------------------------------------------------------
# The snapshot reader (open_tree, locate) against py-lmdb on real environments, written by each LMDB engine

_KEY = struct.Struct(">Q").pack


def _has_lmdb_1_0() -> bool:
    """py-lmdb 3.0 on bundles LMDB 1.0 beside 0.9 (``lib_version=1``); earlier releases have one engine."""
    try:
        return tuple(lmdb.version(lib_version=1))[:1] == (1,)  # type: ignore[call-overload,unused-ignore]
    except TypeError:
        return False


@pytest.fixture(
    params=[
        0,
        pytest.param(1, marks=pytest.mark.skipif(not _has_lmdb_1_0(), reason="this py-lmdb has no LMDB 1.0 engine")),
    ],
    ids=["lmdb-0.9", "lmdb-1.0"],
)
def engine(request: Any) -> int:
    """The LMDB line that writes the environment: 0.9 (data format 1) or 1.0 (format 3: its own page layout)."""
    return int(request.param)


def open_env(path: str, engine: int, **options: Any) -> lmdb.Environment:
    """A new environment written by ``engine`` (py-lmdb before 3.0 has only 0.9: no ``lib_version``)."""
    return lmdb.open(path, **options, **({"lib_version": engine} if engine else {}))


def _mapping(env: lmdb.Environment, path: str) -> tuple[int, int, int]:
    """(base, length, page header size) of ``env``'s data.mdb as the store's guard finds it."""
    header = layout_of(env).header
    base, length, _ = MapGuard(os.path.join(path, "data.mdb"), env.stat()["psize"], header).mapping()
    return base, length, header


def _value_for(i: int, rng: random.Random) -> bytes:
    """Mostly inline values of a few to 2000 bytes; one in 16 on overflow pages (up to 40 KB)."""
    size = rng.randrange(20_000, 40_000) if i % 16 == 0 else rng.randrange(0, 2000)
    return rng.randbytes(size)


def _located(env: lmdb.Environment, path: str, name: bytes = b"samples") -> dict[bytes, bytes | None]:
    """Every key of ``name`` as the native reader finds it in a fresh read transaction, checked as it goes."""
    base, length, header = _mapping(env, path)
    assert base and length
    psize = env.stat()["psize"]
    db = env.open_db(name)
    out: dict[bytes, bytes | None] = {}
    with env.begin(buffers=True) as txn:
        code, root, depth = core.open_tree(base, length, psize, header, txn.id(), layout_of(env).db_key(name))
        assert code == 0, _native.reason(code)
        assert depth == txn.stat(db)["depth"]
        for key, value in txn.cursor(db=db):
            code, offset, size = core.locate(base, length, psize, header, root, depth, bytes(key))
            assert code == 0, (bytes(key), _native.reason(code))
            assert offset + size <= length
            got = ctypes.string_at(base + offset, size)
            assert got == bytes(value)
            out[bytes(key)] = got
        for missing in (_KEY(10**9), b"\xff" * 9, _KEY(3) + b"P"):
            if txn.get(missing, db=db) is None:
                assert core.locate(base, length, psize, header, root, depth, missing)[0] == _native.NOTFOUND
        assert core.locate(base, length, psize, header, root, depth, b"")[0] == _native.NOTFOUND
    return out


@pytest.fixture
def env_path(tmp_path: Any) -> str:
    return str(tmp_path / "env")


@needs_core
def test_locate_equals_lmdb_many_keys(env_path: str, engine: int) -> None:
    """Every key (odd lengths too) of a three-level tree of inline and overflow values is found with py-lmdb's bytes."""
    rng = random.Random(5)
    env = open_env(env_path, engine, max_dbs=4, map_size=1 << 28, readahead=False)
    try:
        db = env.open_db(b"samples")
        env.open_db(b"meta")
        with env.begin(write=True) as txn:
            for i in rng.sample(range(200_000), 40_000):
                # A pack's key is 9 bytes: LMDB 1.0 pads an odd key before its data (1 in 8 here)
                key = _KEY(i) + b"P" if i % 8 == 1 else _KEY(i)
                txn.put(key, _value_for(i, rng) if i % 3 else b"x" * (i % 40), db=db)
        with env.begin() as txn:
            assert txn.stat(db)["depth"] >= 3
        found = _located(env, env_path)
        assert len(found) == 40_000 and sum(len(k) == 9 for k in found) > 1000
    finally:
        env.close()


@needs_core
def test_locate_after_deletes_and_growth(env_path: str, engine: int) -> None:
    """After deletes, several commits and map growth (the map moves) every key is still found with py-lmdb's bytes."""
    rng = random.Random(6)
    env = open_env(env_path, engine, max_dbs=4, map_size=1 << 20, readahead=False)
    try:
        db = env.open_db(b"samples")
        for round_ in range(6):
            while True:
                try:
                    with env.begin(write=True) as txn:
                        for i in range(round_ * 3000, (round_ + 1) * 3000):
                            txn.put(_KEY(i), _value_for(i, rng), db=db)
                        for i in rng.sample(range((round_ + 1) * 3000), 500):
                            txn.delete(_KEY(i), db=db)
                    break
                except lmdb.MapFullError:
                    env.set_mapsize(env.info()["map_size"] * 2)
            with env.begin(buffers=True) as txn:
                expected = {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
            assert _located(env, env_path) == expected
        assert env.info()["map_size"] > 1 << 20
    finally:
        env.close()


@needs_core
def test_open_tree_needs_the_snapshots_meta(env_path: str, engine: int) -> None:
    """A transaction whose meta page was reused (two commits since) gets RETRY; an unknown database NOTFOUND; the other
    engine's layout finds no sound meta page (never a misread tree); a layout nobody named is refused."""
    env = open_env(env_path, engine, max_dbs=4, map_size=1 << 22)
    try:
        db = env.open_db(b"samples")
        layout = layout_of(env)
        header, name, other = layout.header, layout.db_key(b"samples"), 40 - layout.header  # 16 <-> 24
        guard = MapGuard(os.path.join(env_path, "data.mdb"), 4096, header)
        with env.begin(buffers=True) as old:
            for i in range(2):
                with env.begin(write=True) as txn:
                    txn.put(_KEY(i), b"v", db=db)
            guard.refresh()  # the file grew: pages past the old length are not read
            base, length, _ = guard.mapping()
            assert core.open_tree(base, length, 4096, header, old.id(), name)[0] == _native.RETRY
        with env.begin(buffers=True) as txn:
            assert core.open_tree(base, length, 4096, header, txn.id(), name)[0] == 0
            assert core.open_tree(base, length, 4096, header, txn.id(), b"nothere")[0] == _native.NOTFOUND
            code = core.open_tree(base, length, 4096, other, txn.id(), name)[0]
            assert _native.reason(code) == "no sound meta page holds its snapshot"
            assert core.newest_txnid(base, length, 4096, header) == txn.id()
            with pytest.raises(ValueError):
                core.open_tree(0, length, 4096, header, txn.id(), name)
            with pytest.raises(ValueError):
                core.open_tree(base, length, 1000, header, txn.id(), name)
            for wrong in (0, 8, 20, 32):
                with pytest.raises(ValueError, match="page header"):
                    core.open_tree(base, length, 4096, wrong, txn.id(), name)
    finally:
        env.close()


_DAMAGE_CHILD = r"""
import ctypes, os, random, shutil, struct, sys
import lmdb
from lmdbcache import _native
from lmdbcache.store._engine import layout_of
from lmdbcache.store._guard import MapGuard
core = _native.core
src, work, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data = open(os.path.join(src, "data.mdb"), "rb").read()
keys = [struct.pack(">Q", i) + b"P" * (i % 5 == 1) for i in range(3000)]
seen = {}
for seed in range(first, first + count):
    rng = random.Random(seed)
    bad = bytearray(data)
    for _ in range(rng.choice((1, 4, 32))):
        at = rng.randrange(2 * 4096, len(bad))  # meta pages intact: py-lmdb opens the copy
        if rng.random() < 0.5:
            bad[at] ^= 1 << rng.randrange(8)
        else:
            bad[at : at + 2] = rng.randbytes(2)
    os.makedirs(work, exist_ok=True)
    open(os.path.join(work, "data.mdb"), "wb").write(bad)
    print(seed, flush=True)
    env = lmdb.open(work, max_dbs=4, readonly=True, lock=False)  # the engine of the file's format
    layout = layout_of(env)
    base, length, _ = MapGuard(os.path.join(work, "data.mdb"), 4096, layout.header).mapping()
    with env.begin(buffers=True) as txn:
        code, root, depth = core.open_tree(base, length, 4096, layout.header, txn.id(), layout.db_key(b"samples"))
        seen[code] = seen.get(code, 0) + 1
        if code == 0:
            for key in keys:
                code, offset, size = core.locate(base, length, 4096, layout.header, root, depth, key)
                seen[code] = seen.get(code, 0) + 1
                if code == 0:
                    assert offset + size <= length
                    ctypes.string_at(base + offset, size)  # touch every byte: inside the file
    env.close()
    shutil.rmtree(work)
print("codes", sorted(seen.items()))
"""


@needs_core
def test_damaged_files_never_crash_the_reader(env_path: str, tmp_path: Any, engine: int) -> None:
    """Random damage to tree pages gives error codes or in-file spans, never a crash (a child process per run)."""
    rng = random.Random(7)
    env = open_env(env_path, engine, max_dbs=4, map_size=1 << 26)
    db = env.open_db(b"samples")
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(_KEY(i) + b"P" * (i % 5 == 1), _value_for(i, rng), db=db)  # odd keys too: 1.0 pads them
    env.close()
    out = subprocess.run(
        [sys.executable, "-c", _DAMAGE_CHILD, env_path, str(tmp_path / "bad"), "0", "150"],
        env={**os.environ, "PYTHONPATH": PACKAGE_ROOT},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, f"died after seed {out.stdout.split()[-1:]}: {out.stderr[-2000:]}"
    codes = dict(eval(out.stdout.splitlines()[-1][len("codes ") :]))
    assert codes.get(0) and any(code >= 16 for code in codes), codes


@needs_core
def test_locate_batch_equals_locate_cold_and_warm(env_path: str, engine: int) -> None:
    """locate_batch finds what locate finds, with the cold-value advice on (file pages dropped first) and off."""
    rng = random.Random(9)
    env = open_env(env_path, engine, max_dbs=4, map_size=1 << 26, readahead=False)
    try:
        db = env.open_db(b"samples")
        with env.begin(write=True) as txn:
            for i in range(600):
                txn.put(_KEY(i), _value_for(i, rng), db=db)
        base, length, h = _mapping(env, env_path)
        indices = rng.sample(range(600), 600)
        with env.begin(buffers=True) as txn:
            code, root, depth = core.open_tree(base, length, 4096, h, txn.id(), layout_of(env).db_key(b"samples"))
            assert code == 0
            want = [core.locate(base, length, 4096, h, root, depth, _KEY(i))[1:] for i in indices]
            fd = os.open(os.path.join(env_path, "data.mdb"), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the advice is given
            finally:
                os.close(fd)
            for advise in (16384, 0):
                code, k, blob = core.locate_batch(
                    base, length, 4096, h, root, depth, indices, 0, 600, None, False, advise
                )
                assert code == 0
                got = [struct.unpack_from("<QQQB", blob, 32 * j) for j in range(len(indices))]
                assert [(o, s) for o, s, _, _ in got] == want
                assert [i for _, _, i, _ in got] == indices and all(check for *_, check in got)
                assert all(ctypes.string_at(base + o, s) == bytes(txn.get(_KEY(i), db=db)) for o, s, i, _ in got)
            code, k, _ = core.locate_batch(base, length, 4096, h, root, depth, [5, 10**6], 0, 600, None, False)
            assert (code, k) == (_native.NOTFOUND, 1)
    finally:
        env.close()


@needs_core
def test_xxh3_sse2_and_avx2_agree_with_xxhash() -> None:
    """Both long-hash loops (AVX2 when the CPU has it, SSE2 forced by LMDBCACHE_HASH_SIMD=sse2) equal xxhash's."""
    code = (
        "import os, random, lmdbcache._native as n, xxhash\n"
        "r = random.Random(3)\n"
        "for size in [241, 256, 1023, 1024, 1025, 4096, 65536 + 7, 150528, 1 << 20]:\n"
        "    data, seed = r.randbytes(size), r.getrandbits(64)\n"
        "    assert n.core.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), size\n"
        "    assert n.core.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), size\n"
        "print(n.core.HASH_SIMD)\n"
    )
    seen = []
    for cap in ("sse2", ""):
        env = {**os.environ, "LMDBCACHE_HASH_SIMD": cap}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip())
    assert seen[0] == "sse2 or scalar" and seen[1] in ("avx2", "sse2 or scalar")


_COPY_CHILD = """
import random, lmdbcache._native as n, xxhash
r = random.Random(5)
sizes = list(range(200, 2200)) + [k * 1024 + d for k in range(2, 150, 7) for d in (-65, -64, -1, 0, 1, 63, 64, 65)]
for size in sizes + [150528, 1 << 20]:
    data, seed = r.randbytes(size), r.choice([0, r.getrandbits(64)])
    buf = bytearray(size + 128)
    got = n.core.xxh3_64_copy(memoryview(buf)[64 : 64 + size], data, seed)
    assert got == xxhash.xxh3_64_intdigest(data, seed), (size, seed)
    assert buf[64 : 64 + size] == data and not any(buf[:64]) and not any(buf[64 + size :]), size
print(n.core.HASH_SIMD)
"""


@needs_core
def test_xxh3_copy_sse2_and_avx2_agree_with_xxhash() -> None:
    """The one-pass copy and checksum equals xxhash's on both long loops (AVX2 when the CPU has it, SSE2 forced)."""
    seen = []
    for cap in ("sse2", ""):
        env = {**os.environ, "LMDBCACHE_HASH_SIMD": cap}
        done = subprocess.run([sys.executable, "-c", _COPY_CHILD], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip())
    assert seen[0] == "sse2 or scalar" and seen[1] in ("avx2", "sse2 or scalar")


@needs_core
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**64 - 1), st.binary(max_size=40)), max_size=12),
    st.sampled_from([0, 1, 8, 24, 64, 1 << 18]),
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 9, 48, 100, 1 << 18]),
)
def test_group_batch_equals_plan(batch: list[tuple[int, bytes]], small: int, first: int, limit: int) -> None:
    """``core.group_batch`` lays out a commit's records byte for byte as ``_group.plan`` does (singles, groups)."""
    from lmdbcache.format import _group

    assert core is not None
    if first + len(batch) >= 2**64:
        first = 2**64 - 1 - len(batch)  # group ids are u64
    assert core.group_batch(batch, small, first, limit) == _group.plan(batch, small, first, limit)


@needs_core
def test_group_batch_copies_a_batch_another_thread_changes_meanwhile() -> None:
    """The values are copied into the records with the GIL released: a list whose items another thread replaces
    meanwhile (the old values freed) gives the records of the list as it was at the call, never a mix or freed
    bytes (the sanitizer run reads them too)."""
    import threading

    from lmdbcache.format import _group

    assert core is not None
    rng = random.Random(5)
    versions = [[(i, rng.randbytes(rng.randrange(1, 9000))) for i in rng.sample(range(10**6), 700)] for _ in range(2)]
    versions.append(versions[0][:3])
    expected = [_group.plan(v, 16384, 7, 1 << 18) for v in versions]
    batch = list(versions[0])
    stop = threading.Event()

    def churn() -> None:  # each assignment is one step under the GIL; the values it drops are freed
        k = 0
        while not stop.is_set():
            batch[:] = [(i, bytes(bytearray(v))) for i, v in versions[k % 3]]
            k += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(300):
            assert core.group_batch(batch, 16384, 7, 1 << 18) in expected
    finally:
        stop.set()
        thread.join()


@needs_core
def test_group_batch_leaves_odd_items_to_python() -> None:
    """Anything but (int, bytes) pairs with an index that fits 8 bytes comes back None: Python writes or refuses it."""
    assert core is not None
    odd: list[Any] = [[(1, bytearray(3)), (2, b"x")], [(-1, b"x"), (2, b"y")], [(2**64, b"x")]]
    odd += [[(1, b"x", 0)], [[1, b"x"]]]
    for batch in odd:
        assert core.group_batch(batch, 100, 0, 1000) is None
    assert core.group_batch([], 100, 0, 1000) == ([], [])
    with pytest.raises(TypeError):
        core.group_batch((1, b"x"), 100, 0, 1000)
