"""Caches written by either LMDB engine py-lmdb bundles: LMDB 0.9's format and LMDB 1.0's, on both read paths.

py-lmdb 3.0 writes a new environment with LMDB 0.9 unless ``LMDB_DEFAULT_LIB_VERSION=1`` (read when py-lmdb is
imported) asks for 1.0, and opens an existing one with the engine of its format. The two formats lay pages out
differently (lmdbcache/store/_engine.py). So a cache is filled in a child process started with that variable set
one way, then read there and in this process, whose default engine may be the other: every read takes the layout
from the environment that opened the file. ``make lmdb-versions`` runs this file on the oldest and the newest
py-lmdb the package admits, and with ``LMDB_DEFAULT_LIB_VERSION=1``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from helpers import assert_same, golden_samples

import lmdbcache
from lmdbcache import CachedDataset, MissingExtraError, _native, tools

TESTS = Path(__file__).resolve().parent
PACKAGE_ROOT = str(Path(lmdbcache.__file__).resolve().parent.parent)
GOLDEN_1_0 = TESTS / "data" / "golden-v4-lmdb-1.0"
N = 48
# Batches of one shape each (a batch stacks its samples): the small samples, then the large ones
BATCHES = [[i for i in range(N) if i % 5][k : k + 8] for k in range(0, N, 8)] + [list(range(0, N, 5))]
BATCHES = [b for b in BATCHES if b]


def has_lmdb_1_0() -> bool:
    """py-lmdb 3.0 on bundles LMDB 1.0 beside 0.9 (``lib_version=1``); earlier releases have one engine."""
    try:
        return tuple(lmdb.version(lib_version=1))[:1] == (1,)  # type: ignore[call-overload,unused-ignore]
    except TypeError:
        return False


needs_1_0 = pytest.mark.skipif(not has_lmdb_1_0(), reason=f"py-lmdb {lmdb.__version__} has no LMDB 1.0 engine")
ENGINES = [pytest.param("0", id="lmdb-0.9"), pytest.param("1", id="lmdb-1.0", marks=needs_1_0)]


def mixed_for(i: int) -> Any:
    """Index ``i``'s sample: small tensors (inline values, packed with pack=4: 9-byte pack keys, which LMDB 1.0 pads
    before their data), every fifth a 24 KB tensor on overflow pages."""
    g = torch.Generator().manual_seed(i)
    if i % 5 == 0:
        return torch.randint(0, 256, (6000,), dtype=torch.int32, generator=g), i
    return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g), i


class Mixed(torch.utils.data.Dataset):
    """``mixed_for(i)`` for ``n`` indices (importable by the child: tests/ is on its path)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return mixed_for(i)


def data_format(path: str | Path) -> int:
    """The LMDB data format of ``path``'s data.mdb, from its first meta page: 1 (LMDB 0.9) or 3 (1.0)."""
    head = (Path(path) / "data.mdb").read_bytes()[:32]
    for at in (16, 24):  # the meta page's magic after a 16-byte (0.9) or 24-byte (1.0) page header
        magic, version = struct.unpack_from("<II", head, at)
        if magic == 0xBEEFC0DE:
            return version
    raise AssertionError(f"no LMDB meta page in {path}")


_CHILD = r"""
import json, sys
from lmdbcache import CachedDataset, _native, tools
from test_engines import BATCHES, Mixed, mixed_for
from helpers import assert_same
path, pack = sys.argv[1], int(sys.argv[2])
# A small map: it grows several times during the fill (set_mapsize with the named databases open)
with CachedDataset(Mixed(), path, pack=pack, map_size=1 << 20) as ds:
    for i in range(len(ds)):
        ds[i]
with CachedDataset(Mixed(), path, pack=pack) as ds:  # its own next open: the bug of issue 38 refused it here
    assert ds.is_complete
    for i in range(len(ds)):
        assert_same(ds[i], mixed_for(i), f"sample {i}")
    native = _native.core is not None and ds._live_store().reader._tree[7] is not None
    batches = [labels.tolist() for _, labels in ds.loader(batch_sampler=BATCHES)]
    assert batches == BATCHES, batches
info, result = tools.info(path), tools.verify(path)
print(json.dumps({"native": native, "cached": info.cached, "checked": result.checked, "bad": result.bad}))
"""


def fill_in_child(path: Path, engine: str, pack: int, pure: bool = False) -> dict[str, Any]:
    """Fill, reopen, read, batch, ``info`` and ``verify`` the cache at ``path`` in a child whose new environments
    are written by LMDB ``engine`` ("0": 0.9, "1": 1.0); what it saw."""
    env = {**os.environ, "LMDB_DEFAULT_LIB_VERSION": engine, "PYTHONPATH": os.pathsep.join([str(TESTS), PACKAGE_ROOT])}
    if pure:  # else the child takes this process's path (make test-pure runs this file with the core off)
        env["LMDBCACHE_PURE_PYTHON"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(pack)], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.splitlines()[-1]))


@pytest.fixture(scope="module", params=ENGINES)
def filled(request: Any, tmp_path_factory: Any) -> tuple[str, Path]:
    """(engine, cache) once per engine for the module: filled by a child on the compiled core (when built)."""
    path = tmp_path_factory.mktemp("engines") / f"cache-{request.param}"
    seen = fill_in_child(path, request.param, 4)
    assert data_format(path) == (3 if request.param == "1" else 1)
    assert seen == {"native": _native.core is not None, "cached": N, "checked": N, "bad": []}
    return request.param, path


@pytest.mark.parametrize("pure", [False, True], ids=["core", "pure"])
def test_a_cache_of_either_engine_fills_reopens_reads_and_verifies_in_its_process(
    filled: tuple[str, Path], tmp_path: Any, pure: bool
) -> None:
    """A process whose new caches LMDB 0.9 or 1.0 writes fills one (packs and single values, growing its map),
    reopens it, reads every sample and batch on the compiled core or the pure-Python path, and info and verify read
    it whole."""
    engine, path = filled
    if pure:  # the compiled core's fill is the fixture's
        path = tmp_path / "cache"
        seen = fill_in_child(path, engine, 4, pure=True)
        assert data_format(path) == (3 if engine == "1" else 1)
        assert seen == {"native": False, "cached": N, "checked": N, "bad": []}
    assert tools.info(path).cached == N


def test_a_cache_of_either_engine_reads_in_a_process_whose_default_may_be_the_other(
    filled: tuple[str, Path], tmp_path: Any, read_path: str
) -> None:
    """A cache written by one engine reads here (the file's format picks the engine, whatever this process's default)
    on both paths, with no source, its records bounds-checked: every sample, every batch, info and verify."""
    path = tmp_path / "cache"
    path.mkdir()
    (path / "data.mdb").write_bytes((filled[1] / "data.mdb").read_bytes())
    with CachedDataset.open(path) as ds:
        assert ds._live_store()._guard.start != 0  # type: ignore[attr-defined]  # the guard knows the layout
        for i in range(N):
            assert_same(ds[i], mixed_for(i), f"sample {i}")
        if read_path == "native":
            tree = ds._live_store().reader._tree  # type: ignore[attr-defined]
            assert tree is not None and tree[7] is not None  # the core read them
            assert tree[7].__self__.index(True) == 1  # the location table: one walk over every leaf page
            for i in range(N):  # now answered by the table (packs: their slots entered at the first read)
                assert_same(ds[i], mixed_for(i), f"sample {i} through the table")
        for batch, (values, labels) in zip(BATCHES, ds.loader(batch_sampler=BATCHES), strict=True):
            assert labels.tolist() == batch
            for row, i in enumerate(batch):
                assert_same(values[row], mixed_for(i)[0], f"sample {i} in its batch")
    assert tools.info(path).cached == N
    assert tools.verify(path).bad == []


@needs_1_0
def test_golden_cache_written_by_lmdb_1_0_still_reads(tmp_path: Any, read_path: str) -> None:
    """The tiny cache LMDB 1.0 wrote (tests/data/golden-v4-lmdb-1.0: packs of 2, an overflow value) decodes to exactly
    its samples; a change that misreads 1.0's page layout fails here."""

    copy = tmp_path / "golden"
    copy.mkdir()
    (copy / "data.mdb").write_bytes((GOLDEN_1_0 / "data.mdb").read_bytes())
    assert data_format(copy) == 3
    expected = golden_samples("4-lmdb-1.0")
    with CachedDataset.open(copy) as ds:
        assert len(ds) == len(expected) and ds.is_complete
        for i, sample in enumerate(expected):
            assert_same(ds[i], sample, f"sample {i}")
    assert tools.verify(copy).bad == []


@pytest.mark.skipif(has_lmdb_1_0(), reason=f"py-lmdb {lmdb.__version__} reads LMDB 1.0's format")
def test_a_cache_lmdb_1_0_wrote_is_a_clear_error_without_a_1_0_engine(tmp_path: Any) -> None:
    """Under a py-lmdb with no 1.0 engine (before 3.0) a cache LMDB 1.0 wrote is MissingExtraError naming the fix, not
    "damaged, delete it"; nothing is changed, and overwrite=True rebuilds it with this engine."""
    copy = tmp_path / "golden"
    copy.mkdir()
    (copy / "data.mdb").write_bytes((GOLDEN_1_0 / "data.mdb").read_bytes())
    before = (copy / "data.mdb").read_bytes()
    for open_it in (lambda: CachedDataset.open(copy), lambda: tools.info(copy), lambda: CachedDataset(Mixed(), copy)):
        with pytest.raises(MissingExtraError, match=r"written by LMDB 1\.0 .*Install py-lmdb 3\.0 or later"):
            open_it()
    assert (copy / "data.mdb").read_bytes() == before
    with CachedDataset(Mixed(4), copy, overwrite=True) as ds:
        assert_same(ds[3], mixed_for(3))
    assert data_format(copy) == 1
