"""The core's location table (issue 24): one walk over a snapshot's leaf pages, then a lookup per index.

Where it answers, it answers what the walk down the tree (``locate_index``) answers, for values stored alone,
in packs and in groups; a commit by another process gives a new snapshot and so a new table; a value damaged
under a table-located read gives the same error as without it.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import Listed, Synthetic, key, raw_cache, sample_for

from lmdbcache import CachedDataset, CorruptSampleError, LmdbCacheError, _native
from lmdbcache.store._native_read import native_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
core = _native.core
pytestmark = pytest.mark.skipif(core is None, reason="the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")
ALWAYS = (0, 1 << 63)  # set_table_threshold: the first lookup builds the table


@contextlib.contextmanager
def _threshold(minimum: int, every: int) -> Iterator[None]:
    assert core is not None
    saved = core.set_table_threshold(minimum, every)
    try:
        yield
    finally:
        core.set_table_threshold(*saved)


def _tree(ds: CachedDataset) -> Any:
    """The core's tree of ``ds``'s kept read transaction: (its tuple, the Tree object)."""
    r = ds._live_store().reader  # type: ignore[attr-defined]
    tree = native_tree(r, r._reader())
    return tree, tree[7].__self__


def _bytes_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (str(x.dtype), tuple(x.shape), x.contiguous().view(torch.uint8).numpy().tobytes())
    if isinstance(x, (list, tuple)):
        return [_bytes_of(v) for v in x]
    return x


def _fill_cache(path: str, n: int, pack: int, order: list[int], commit_every: int = 1000) -> None:
    ds = CachedDataset(Synthetic(n), path, pack=pack, commit_every=commit_every)
    for lo in range(0, len(order), 7):
        ds.__getitems__(order[lo : lo + 7])
    ds.close()


@pytest.mark.parametrize(("pack", "commit_every"), [(0, 1000), (8, 1000), (0, 5)])
def test_the_table_answers_what_the_walk_answers(tmp_path: Any, pack: int, commit_every: int) -> None:
    """Stored alone, in packs (a short last chunk, a chunk left unpacked) and in groups (commits of 5): every index
    of [0, length) and past it is located by the table as by the walk down the tree."""
    path = str(tmp_path / "c.lmdb")
    n = 203
    order = [i for i in random.Random(3).sample(range(n), n) if i % 31 != 4]  # some never stored
    _fill_cache(path, n, pack, order, commit_every)
    ds = CachedDataset.open(path)
    tree, t = _tree(ds)
    assert t.index(False) == 0  # not built yet: a few reads do not pay for it
    assert t.index(True) == 1
    _, _, base, length, psize, root, depth, _, header = tree
    r = ds._live_store().reader  # type: ignore[attr-defined]
    everything = list(range(n + 20))
    for k in everything + everything:  # twice: a pack's first read enters its values in the table (its slots)
        assert core is not None
        want = core.locate_batch(base, length, psize, header, root, depth, [k], r._h._pack, r._h._length, None, False)
        assert t.locate_batch([k], None, False) == want, k
    ds.close()


def test_a_broken_slot_of_a_pack_read_before_keeps_its_error(tmp_path: Any) -> None:
    """A pack whose slot of index 13 points before its values: the pack's first read (index 8) enters its other
    values in the table, and index 13 raises the pack's error on every read, as without a table."""
    path = str(tmp_path / "c.lmdb")
    n, pack = 45, 8
    _fill_cache(path, n, pack, list(range(n)))
    ds = CachedDataset.open(path)
    at = _pack_record_offset(_tree(ds)[0], ds._live_store().reader, 13)  # type: ignore[attr-defined]
    ds.close()
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.seek(at + 8 + 8 * 5)  # the u32 start of slot 5 (index 13): 0 is inside the pack's header
        f.write(b"\0\0\0\0")
    with _threshold(*ALWAYS):
        ds = CachedDataset.open(path)
        for _ in range(2):
            for i in range(8, 16):
                if i == 13:
                    with pytest.raises(LmdbCacheError, match="pack holding index 13"):
                        ds[i]
                else:
                    assert _bytes_of(ds[i]) == _bytes_of(sample_for(i)), i
        assert _tree(ds)[1].index(False) == 1
        ds.close()


@pytest.mark.parametrize(("pack", "commit_every"), [(0, 1000), (8, 1000), (0, 5)])
def test_reads_through_the_table_equal_the_python_paths(tmp_path: Any, pack: int, commit_every: int) -> None:
    """ds[i], __getitems__ and loader batches with the table built at the first lookup: byte-identical to the
    pure-Python path's."""
    path = str(tmp_path / "c.lmdb")
    n = 150
    _fill_cache(path, n, pack, random.Random(5).sample(range(n), n), commit_every)
    order = random.Random(6).sample(range(n), n)
    got = {}
    for native in (True, False):
        saved = _native.core
        _native.core = saved if native else None  # type: ignore[assignment]
        try:
            with _threshold(*ALWAYS):
                ds = CachedDataset.open(path)
                singles = [_bytes_of(ds[i]) for i in order] + [_bytes_of(ds[i]) for i in order]
                many = [_bytes_of(s) for s in ds.__getitems__(order)]
                with ds.loader(16, shuffle=True, seed=2) as loader:
                    batches = [_bytes_of(b) for b in loader]
                if native:
                    assert _tree(ds)[1].index(False) == 1
                ds.close()
        finally:
            _native.core = saved  # type: ignore[assignment]
        got[native] = (singles, many, batches)
    assert got[True] == got[False]
    assert got[True][0][: len(order)] == [_bytes_of(sample_for(i)) for i in order]


_COMMIT = """
import sys
from helpers import Synthetic
from lmdbcache import CachedDataset
ds = CachedDataset(Synthetic(int(sys.argv[2])), sys.argv[1])
ds.__getitems__([int(i) for i in sys.argv[3].split(",")])
ds.close()
"""


@pytest.mark.parametrize("pack", [0, 8])
def test_a_commit_by_another_process_is_seen_past_the_table(tmp_path: Any, pack: int) -> None:
    """A table built on a snapshot that lacks indices; another process commits them; this process's next reads
    (a new snapshot: a new table) find them, single and batched, as the source has them."""
    path = str(tmp_path / "c.lmdb")
    n, late = 96, [3, 40, 41, 95]
    _fill_cache(path, n, pack, [i for i in range(n) if i not in late])
    with _threshold(*ALWAYS):
        ds = CachedDataset.open(path)  # no source: a miss could not be filled here
        assert _bytes_of(ds[0]) == _bytes_of(sample_for(0))
        t = _tree(ds)[1]
        assert t.index(False) == 1
        code, _, _ = t.locate_batch(late, None, False)
        assert code == _native.NOTFOUND
        env = {k: v for k, v in os.environ.items() if k != "LMDBCACHE_PURE_PYTHON"}
        env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
        done = subprocess.run(
            [sys.executable, "-c", _COMMIT, path, str(n), ",".join(map(str, late))],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        ds._live_store()._drop_reader()  # type: ignore[attr-defined]  # as 0.25 s later: the kept snapshot renewed
        assert [_bytes_of(ds[i]) for i in late] == [_bytes_of(sample_for(i)) for i in late]
        t2 = _tree(ds)[1]
        assert t2 is not t and t2.index(False) == 1
        with ds.loader(8, shuffle=True, seed=1) as loader:
            seen = {int(i) for _, labels in loader for i in labels}
        assert seen == set(range(n))
        ds.close()


def _value_offset(ds: CachedDataset, index: int) -> int:
    """Where the value of ``index`` starts in the map, found by a walk down the tree (not through the table: a
    table entry's first read checks its overflow page number, later reads in the snapshot do not)."""
    assert core is not None
    _, _, base, length, psize, root, depth, _, header = _tree(ds)[0]
    r = ds._live_store().reader  # type: ignore[attr-defined]
    code, _, blob = core.locate_batch(
        base, length, psize, header, root, depth, [index], r._h._pack, r._h._length, None, False
    )
    assert code == 0
    return int.from_bytes(blob[:8], "little")


def _forty(tmp_path: Any, side: int, pack: int) -> tuple[str, Any]:
    """A cache of 40 samples of 3 x side x side (packed by ``pack``) and its source."""
    path = str(tmp_path / "c.lmdb")
    source = Listed([(torch.full((3, side, side), i % 251, dtype=torch.uint8), i) for i in range(40)])
    ds = CachedDataset(source, path, pack=pack)
    ds.__getitems__(list(range(40)))
    ds.close()
    return path, source


def _opened_at_13(path: str) -> tuple[CachedDataset, Any, int]:
    """``path`` opened (checksum "always") after one read, its tree, and where index 13's value starts in the map."""
    ds = CachedDataset.open(path, checksum="always")
    ds[5]
    return ds, _tree(ds)[0], _value_offset(ds, 13)


@pytest.mark.parametrize(
    ("side", "pack", "what"),
    [(80, 0, "data"), (80, 0, "structure"), (80, 0, "page number"), (32, 0, "data"), (32, 8, "data"),
     (32, 8, "structure"), (32, 8, "page number")],
)  # fmt: skip
def test_a_value_damaged_under_the_table_gives_the_clear_error(tmp_path: Any, side: int, pack: int, what: str) -> None:
    """Bytes of a value (alone: 3x80x80; in a group: 3x32x32; in a pack), or the number of the overflow page that
    holds it (its own, or its pack's), changed in the file under a built table, with no commit: ds[i] and the
    loader raise the library's error for that index, never a crash; the bytes put back, it reads again. (The page
    number is checked at the entry's first read in the snapshot: test_a_checked_page_number_is_not_read_again.)"""
    path, source = _forty(tmp_path, side, pack)
    with _threshold(*ALWAYS):
        ds, tree, offset = _opened_at_13(path)
        if what == "page number":
            if pack:
                offset = _pack_record_offset(tree, ds._live_store().reader, 13)  # type: ignore[attr-defined]
            assert offset % tree[4] == tree[8]  # the page's header: 16 bytes in LMDB 0.9, 24 in 1.0
            where = offset - tree[8]
        else:
            where = offset + (30 if what == "structure" else 3000)
        fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR)
        try:
            old = os.pread(fd, 1, where)
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), where)
            with pytest.raises(LmdbCacheError, match="index 13") as raised:
                ds[13]
            if what != "page number":
                assert type(raised.value) is CorruptSampleError
            with pytest.raises(LmdbCacheError, match="13"), ds.loader(8) as loader:
                list(loader)
        finally:
            os.pwrite(fd, old, where)
            os.close(fd)
        assert _bytes_of(ds[13]) == _bytes_of(source[13])
        ds.close()


@pytest.mark.parametrize(("side", "pack"), [(80, 0), (32, 8)])
def test_a_checked_page_number_is_not_read_again(tmp_path: Any, side: int, pack: int) -> None:
    """A table entry's overflow page number (its own, or its pack's) is checked at the entry's first read in the
    snapshot and not at later ones (a second cache miss per value of a shuffled batch): changed after that read,
    with no commit, the value still reads right; the span stays checked against the map on every read, and the
    data checksum as the policy says."""
    path, source = _forty(tmp_path, side, pack)
    with _threshold(*ALWAYS):
        ds, tree, offset = _opened_at_13(path)
        if pack:
            offset = _pack_record_offset(tree, ds._live_store().reader, 13)  # type: ignore[attr-defined]
        assert _bytes_of(ds[13]) == _bytes_of(source[13])  # the entry's first read: checked
        fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR)
        try:
            old = os.pread(fd, 1, offset - 16)
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), offset - 16)
            assert _bytes_of(ds[13]) == _bytes_of(source[13])
            assert _tree(ds)[0] is tree  # the same snapshot, its table
        finally:
            os.pwrite(fd, old, offset - 16)
            os.close(fd)
        ds.close()


def _pack_record_offset(tree: Any, r: Any, index: int) -> int:
    assert core is not None
    _, _, base, length, psize, root, depth, _, header = tree
    first = index - index % r._h._pack
    code, at, _ = core.locate(base, length, psize, header, root, depth, key(first) + b"P")
    assert code == 0
    return int(at)


def test_damage_the_walk_meets_leaves_no_table(tmp_path: Any) -> None:
    """A leaf whose keys are out of order: the walk builds no table (state -1) and the reads walk the tree."""
    path = str(tmp_path / "c.lmdb")
    _fill_cache(path, 64, 0, list(range(64)))
    with raw_cache(path, write=False) as (txn, samples, _):
        assert txn.get(key(10), db=samples) is not None
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        data = bytearray(f.read())
    nodes = [data.find(b"\x08\x00" + key(i)) + 2 for i in (10, 11)]  # key size 8, then the key
    assert all(at > 2 for at in nodes)
    data[nodes[0] + 7], data[nodes[1] + 7] = 11, 10  # two keys swapped in their leaf: out of order
    with open(os.path.join(path, "data.mdb"), "wb") as f:
        f.write(data)
    with _threshold(*ALWAYS):
        ds = CachedDataset.open(path)
        with contextlib.suppress(LmdbCacheError):
            ds[0]
        assert _tree(ds)[1].index(True) == -1
        ds.close()


def test_a_lazy_fills_misses_build_no_table(tmp_path: Any) -> None:
    """A single read counts toward the table only when it finds its value: a lazy fill's reads all miss and
    each commit begins a snapshot, so counting them built a table per commit, a walk of every entry stored so far
    (at 200k samples of 1 KiB, 1.5 us of every miss). Reads that find their values still build it."""
    n = 3000  # the threshold: n // 256 + 256 = 267 lookups
    ds = CachedDataset(Synthetic(n), str(tmp_path / "c.lmdb"), commit_every=1_000_000, commit_interval=3600)
    order = random.Random(0).sample(range(n), n)
    for i in order[:600]:  # misses in one snapshot (no commit: the kept transaction and its tree stay)
        assert _bytes_of(ds[i]) == _bytes_of(sample_for(i))
    assert _tree(ds)[1].index(False) == 0
    ds.flush()
    for i in order[:300]:  # hits in the snapshot after the commit
        assert _bytes_of(ds[i]) == _bytes_of(sample_for(i))
    assert _tree(ds)[1].index(False) == 1
    ds.close()
