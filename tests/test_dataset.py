"""CachedDataset in one process: the Dataset protocol, misses equal hits, metadata, errors."""

from __future__ import annotations

import copy
import os
import pickle
import random
import time

import lmdb
import numpy as np
import pytest
import torch
from helpers import Failing, Listed, Synthetic, assert_same, key, raw_cache, sample_for, source_reads, stored
from torch.utils.data import DataLoader, Subset

import lmdbcache
from lmdbcache import (
    CachedDataset,
    CacheMismatchError,
    LmdbCacheError,
    NotACacheError,
    SampleNotCachedError,
    UnsupportedSampleError,
)
from lmdbcache.store import _registry


def test_len_and_indexing(cache_dir):
    """len matches the source; Python, numpy and 0-d tensor ints and negative indices work; bad ones raise."""
    ds = CachedDataset(Synthetic(10), cache_dir)
    assert len(ds) == 10
    assert ds[3][1] == 3 and ds[np.int64(4)][1] == 4 and ds[np.uint8(5)][1] == 5 and ds[torch.tensor(6)][1] == 6
    assert ds[-1][1] == 9 and ds[-10][1] == 0
    for bad in (10, -11, 2**40):
        with pytest.raises(IndexError):
            ds[bad]
    with pytest.raises(TypeError, match="integers"):
        ds[1.0]
    assert [s[1] for s in ds] == list(range(10))  # the legacy iteration protocol stops at IndexError


def test_miss_returns_exactly_what_a_hit_returns(cache_dir):
    """The first epoch and the tenth see the same data: same types and values (tuple stays tuple, int stays int)."""
    samples = [
        (torch.arange(6).reshape(2, 3).t(), 1),
        {"x": np.arange(4, dtype=">i4")[::2], "y": [1, (2, 3.5)], "z": None},
        [torch.zeros((), dtype=torch.bfloat16), np.float32(2.5), "text", b"bytes"],
        None,
        7,
    ]
    ds = CachedDataset(Listed(samples), cache_dir)
    misses = [ds[i] for i in range(len(samples))]
    ds.flush()
    reopened = CachedDataset.open(cache_dir)
    for i, sample in enumerate(samples):
        hit = reopened[i]
        assert_same(misses[i], hit)
        assert_same(hit, ds[i])
        if isinstance(sample, tuple):
            assert misses[i][0].is_contiguous() and torch.equal(misses[i][0], sample[0])


def _arrays(sample):
    """Every tensor and numpy array in ``sample``, depth first."""
    if isinstance(sample, (torch.Tensor, np.ndarray)):
        return [sample]
    if isinstance(sample, (tuple, list)):
        return [a for item in sample for a in _arrays(item)]
    if isinstance(sample, dict):
        return [a for item in sample.values() for a in _arrays(item)]
    return []


@pytest.mark.parametrize("method", ["getitem", "getitems"])
def test_a_miss_is_a_hit_and_shares_no_memory_with_the_source(cache_dir, method):
    """A miss (flat or not) returns a hit's types, dtypes, contiguity, writability, and owns its memory."""
    samples = [
        (torch.arange(12, dtype=torch.uint8).reshape(3, 4), 5),
        (torch.arange(6.0).reshape(2, 3).t(), 1.5, True, torch.zeros((), dtype=torch.int16)),
        (np.arange(4, dtype=">i4"), torch.ones(2)),
        {"x": torch.arange(3), "y": [np.float32(2.5), (np.arange(3)[::2], "t")], "z": None},
        [torch.zeros(2, dtype=torch.bfloat16), 7, b"b"],
        3.25,
    ]
    pristine = copy.deepcopy(samples)
    ds = CachedDataset(Listed(samples), cache_dir)
    indices = list(range(len(samples)))
    misses = [ds[i] for i in indices] if method == "getitem" else ds.__getitems__(indices)
    ds.flush()
    hits = CachedDataset.open(cache_dir)
    for i, (miss, source) in enumerate(zip(misses, samples)):
        hit = hits[i]
        assert_same(miss, hit)
        for got, kept, original in zip(_arrays(miss), _arrays(hit), _arrays(source)):
            if isinstance(got, torch.Tensor):
                assert got.is_contiguous() and got.is_contiguous() == kept.is_contiguous()
                assert got.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
                got.reshape(-1).view(torch.uint8).fill_(0xAB)  # writable: a copy of the source's
            else:
                assert got.flags.writeable and got.flags.c_contiguous and got.flags.owndata is kept.flags.owndata
                assert not np.shares_memory(got, original)
                got.view(np.uint8)[...] = 0xAB
        assert_same(hits[i], hit)  # the cache did not change through the miss
    assert_same(samples, pristine)  # nor did the source


def test_each_index_is_decoded_once(cache_dir, counts):
    """After the first read, the source is never called again, in this or a new dataset object."""
    ds = CachedDataset(Synthetic(20, count_dir=counts), cache_dir)
    for _ in range(3):
        for i in range(20):
            ds[i]
    ds.close()
    # spot_check=0: the construction-time spot check's re-decodes are the one documented exception.
    ds = CachedDataset(Synthetic(20, count_dir=counts), cache_dir, spot_check=0)
    for i in range(20):
        assert_same(ds[i], sample_for(i))
    assert sorted(source_reads(counts)) == list(range(20))


def test_transform_runs_on_every_access_and_is_never_cached(cache_dir):
    """transform sees the cached sample on every read; its random output is fresh each time and not stored."""
    gen = torch.Generator().manual_seed(0)

    def augment(sample):
        image, label = sample
        return image.float() + torch.rand(image.shape, generator=gen), label

    ds = CachedDataset(Synthetic(4), cache_dir, transform=augment)
    first, second = ds[2], ds[2]
    assert not torch.equal(first[0], second[0])
    assert torch.equal(first[0].floor(), sample_for(2)[0].float())
    assert_same(CachedDataset.open(cache_dir)[2], sample_for(2))  # the stored sample is untransformed
    batch = ds.__getitems__([0, 1])
    assert batch[0][0].dtype == torch.float32


def test_getitems_reads_a_batch_and_fills_misses(cache_dir, counts):
    """__getitems__ returns what __getitem__ would, fills its misses together, and takes numpy/negative indices."""
    ds = CachedDataset(Synthetic(30, count_dir=counts), cache_dir)
    ds[5]
    batch = ds.__getitems__([5, 1, np.int64(2), -1, 5])
    assert [s[1] for s in batch] == [5, 1, 2, 29, 5]
    for s in batch:
        assert_same(s, sample_for(s[1]))
    assert sorted(set(source_reads(counts))) == [1, 2, 5, 29]
    with pytest.raises(IndexError):
        ds.__getitems__([0, 30])


def test_dataloader_uses_the_cache_even_around_a_subset(cache_dir, counts):
    """A wrapped Subset's __getitems__ is not exposed: the DataLoader reads through the cache, every epoch."""
    inner = Subset(Synthetic(40, count_dir=counts), list(range(0, 40, 2)))
    ds = CachedDataset(inner, cache_dir)
    assert ds.__getitems__.__self__ is ds
    with pytest.raises(AttributeError):
        _ = ds.__getitems_from_source__  # private names never read through
    assert ds.indices == inner.indices  # public attributes do
    for _ in range(2):
        seen = [int(v) for _, y in DataLoader(ds, batch_size=8, shuffle=True) for v in y]
        assert sorted(seen) == list(range(0, 40, 2))
    assert sorted(source_reads(counts)) == list(range(0, 40, 2))  # each source index once, over 2 epochs


def test_construction_and_unpickling_read_nothing(cache_dir, counts):
    """Constructing or unpickling reads no sample, and an unpickled copy holds no open environment."""
    ds = CachedDataset(Synthetic(10, count_dir=counts), cache_dir)
    clone = pickle.loads(pickle.dumps(ds))
    assert source_reads(counts) == []
    assert clone._store is None and clone.path == ds.path and len(clone) == 10
    assert clone[3][1] == 3


def test_cached_count_is_complete_close_and_context_manager(cache_dir):
    """cached_count and is_complete follow the fill (queued misses included); close() commits them."""
    with CachedDataset(Synthetic(5), cache_dir, commit_every=1000) as ds:
        assert ds.cached_count == 0 and not ds.is_complete
        ds[0], ds[1]
        assert ds.cached_count == 2
        for i in range(5):
            ds[i]
        assert ds.is_complete
    assert _registry._stores == {}  # the context manager released the handle
    assert CachedDataset.open(cache_dir).is_complete


def test_commits_are_batched(cache_dir):
    """Misses are committed in batches (one LMDB transaction per commit_every samples), not one per sample."""
    ds = CachedDataset(Synthetic(1000), cache_dir, commit_every=250)
    store = ds._live_store()
    before = store._env.info()["last_txnid"]
    for i in range(1000):
        ds[i]
    ds.flush()
    assert store._env.info()["last_txnid"] - before == 4
    assert ds.cached_count == 1000


def test_open_without_source(cache_dir):
    """CachedDataset.open serves a complete cache alone; a miss raises SampleNotCachedError naming the index."""
    CachedDataset(Synthetic(6), cache_dir).__getitems__(list(range(6)))
    _registry._flush_all_at_exit()
    ds = CachedDataset.open(cache_dir)
    assert len(ds) == 6 and ds.is_complete and ds.fingerprint.endswith("Synthetic:6")
    assert [ds[i][1] for i in range(6)] == list(range(6))
    assert [s[1] for s in DataLoader(ds, batch_size=4, num_workers=0)] != []
    with pytest.raises(AttributeError):
        _ = ds.anything


def test_incomplete_cache_without_source_never_raises_indexerror(cache_dir):
    """A shard opened alone raises a library error on a miss, so `for x in ds` cannot silently stop early."""
    with CachedDataset(Synthetic(8), cache_dir) as ds:
        for i in (0, 1, 2, 4):
            ds[i]
    shard = CachedDataset.open(cache_dir)
    assert shard.cached_count == 4
    with pytest.raises(SampleNotCachedError, match="Index 3") as info:
        list(shard)
    assert not isinstance(info.value, IndexError) and isinstance(info.value, LookupError)
    with pytest.raises(SampleNotCachedError):
        shard.__getitems__([0, 5])


def test_missing_cache_without_source(tmp_path):
    """Opening a path that holds no cache without a source is a clear error and creates nothing."""
    with pytest.raises(NotACacheError, match="no cache"):
        CachedDataset.open(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(dataset=Synthetic(11)), "length 10 but the dataset has length 11"),
        (dict(fingerprint="v2"), "fingerprint 'Synthetic:10' but the dataset has 'v2'"),
    ],
)
def test_mismatch_says_what_and_how_to_fix(cache_dir, change, match):
    """Reopening for another length or fingerprint raises CacheMismatchError with both values and the fix."""
    with CachedDataset(Synthetic(10), cache_dir) as ds:
        ds[0]
    kwargs = {"dataset": Synthetic(10), **change}
    with pytest.raises(CacheMismatchError, match=match) as info:
        CachedDataset(kwargs.pop("dataset"), cache_dir, **kwargs)
    assert "overwrite=True" in str(info.value) and str(cache_dir) in str(info.value)
    assert _registry._stores == {}  # nothing left open


def test_overwrite_after_a_mismatch_works_in_the_same_process(cache_dir):
    """The fix the message suggests, overwrite=True, works right away in the same process (a notebook)."""
    with CachedDataset(Synthetic(10), cache_dir) as ds:
        ds[0], ds[1]
    with pytest.raises(CacheMismatchError):
        CachedDataset(Synthetic(12), cache_dir)
    ds = CachedDataset(Synthetic(12), cache_dir, overwrite=True)
    assert ds.cached_count == 0 and len(ds) == 12
    assert ds[11][1] == 11
    ds.close()
    assert len(CachedDataset.open(cache_dir)) == 12


def test_newer_format_is_refused(cache_dir):
    """A cache written by a newer on-disk format raises CacheMismatchError naming both versions."""
    with CachedDataset(Synthetic(3), cache_dir) as ds:
        ds[0]
    import msgpack

    with lmdb.open(str(cache_dir), max_dbs=2) as env:
        meta_db = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            meta = msgpack.unpackb(txn.get(b"meta", db=meta_db))
            meta["format_version"] = lmdbcache.FORMAT_VERSION + 1
            txn.put(b"meta", msgpack.packb(meta), db=meta_db)
    with pytest.raises(
        CacheMismatchError, match=f"format {lmdbcache.FORMAT_VERSION + 1}.*formats 1 to {lmdbcache.FORMAT_VERSION}: upg"
    ):
        CachedDataset(Synthetic(3), cache_dir)
    with pytest.raises(CacheMismatchError):
        CachedDataset.open(cache_dir)


def test_source_errors_propagate_with_the_index(cache_dir):
    """A source that raises propagates its own exception, noting the index; nothing half-written remains, and the
    samples of the batch the source returned before it raised are kept (each is queued as it is read)."""
    ds = CachedDataset(Failing(16, bad=5), cache_dir)
    for i in range(5):
        ds[i]
    with pytest.raises(ValueError, match="cannot decode file 5") as info:
        ds[5]
    assert any("index 5" in note for note in info.value.__notes__)
    with pytest.raises(ValueError):
        ds.__getitems__([6, 5, 7])
    assert ds.cached_count == 6  # 6 was decoded before 5 raised; 7 was never read
    assert_same(ds[6], sample_for(6))
    ds[7]
    assert ds.cached_count == 7


def test_unencodable_sample_writes_nothing(cache_dir):
    """A sample the codec cannot store raises a TypeError naming index and location, and is not cached."""
    ds = CachedDataset(Listed([(1, 2), (1, {"when": object()})]), cache_dir)
    ds[0]
    with pytest.raises(UnsupportedSampleError, match=r"index 1 at sample\[1\]\['when'\]") as info:
        ds[1]
    assert isinstance(info.value, TypeError)
    assert ds.cached_count == 1


def test_path_that_is_a_file(tmp_path):
    """A cache path that is a regular file is refused with a clear error; the file is untouched."""
    path = tmp_path / "file"
    path.write_text("keep me")
    with pytest.raises(NotACacheError, match="is a file"):
        CachedDataset(Synthetic(3), path)
    assert path.read_text() == "keep me"


def test_map_grows_without_losing_a_batch(cache_dir):
    """From a 1 MiB map, a fill of ~40 MiB grows the map as needed and every queued record lands."""
    samples = [(torch.full((512, 1024), i % 251, dtype=torch.uint8), i) for i in range(80)]  # 512 KiB each
    ds = CachedDataset(Listed(samples), cache_dir, map_size=1 << 20, commit_every=30)
    for i in range(80):
        ds[i]
    ds.flush()
    assert ds._live_store()._env.info()["map_size"] > 40 << 20
    reopened = CachedDataset.open(cache_dir)
    assert reopened.cached_count == 80
    for i in random.Random(0).sample(range(80), 20):
        assert_same(reopened[i], samples[i])


def test_max_readers_is_configurable(cache_dir):
    """max_readers sets the size of LMDB's reader table (well above LMDB's default of 126 by default)."""
    with CachedDataset(Synthetic(3), cache_dir) as ds:
        ds[0]
        assert ds._live_store()._env.max_readers() == 1024
    _registry._stores.clear()
    other = cache_dir.parent / "other"
    with CachedDataset(Synthetic(3), other, max_readers=4000) as ds:
        ds[0]
        assert ds._live_store()._env.max_readers() == 4000


def test_repr_and_errors_subclass_the_base(cache_dir):
    """The repr names the path; every library error subclasses LmdbCacheError."""
    ds = CachedDataset(Synthetic(3), cache_dir)
    assert str(cache_dir) in repr(ds) and "3 samples" in repr(ds)
    for cls in (CacheMismatchError, NotACacheError, SampleNotCachedError, UnsupportedSampleError):
        assert issubclass(cls, LmdbCacheError)


def test_relative_and_pathlib_paths_share_one_handle(tmp_path, monkeypatch):
    """Relative paths and pathlib paths both work and resolve to one handle per directory."""
    monkeypatch.chdir(tmp_path)
    a = CachedDataset(Synthetic(3), "rel.lmdb")
    b = CachedDataset(Synthetic(3), tmp_path / "rel.lmdb")
    a[0]
    assert a._live_store() is b._live_store()
    assert os.path.isdir(tmp_path / "rel.lmdb")


# ---------------------------------------------------------------------- trust: rebuilds, stale sources, options


class Resized(torch.utils.data.Dataset):
    """A source whose preprocessing (the output size) can change while its class and length stay the same."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((3, self.size, self.size), i % 251, dtype=torch.uint8), i


def test_rebuild_in_the_same_process_cuts_off_the_old_dataset(cache_dir):
    """After overwrite=True, an object opened on the previous build neither reads nor writes the new one."""
    old = CachedDataset(Listed([(torch.zeros(2), k) for k in range(10)]), cache_dir, fingerprint="A")
    old[0]
    new = CachedDataset(Listed([(torch.ones(2), k) for k in range(4)]), cache_dir, fingerprint="B", overwrite=True)
    for read in (lambda: old[1], lambda: old[0], lambda: old.__getitems__([2, 3]), lambda: old[7]):
        with pytest.raises(CacheMismatchError, match="rebuilt"):
            read()
    with pytest.raises(CacheMismatchError, match="rebuilt"):
        old.flush()
    assert new.cached_count == 0  # nothing of A's was written into B's cache (v0.1.0 wrote index 7 too)
    assert torch.equal(new[1][0], torch.ones(2))
    old.close()  # closing the stale object is fine
    assert new.cached_count == 1
    with CachedDataset.open(cache_dir) as check:
        assert len(check) == 4 and check.fingerprint == "B"


def test_a_changed_preprocessing_is_caught_by_the_spot_check(cache_dir):
    """The same class and length with a different resize: opening the cache names the index and the field."""
    with CachedDataset(Resized(20, 8), cache_dir) as ds:
        ds.__getitems__(list(range(20)))
    with pytest.raises(
        CacheMismatchError,
        match=r"at index \d+: sample\[0\] has shape \[3, 8, 8\] in the cache but "
        r"\[3, 6, 6\] from the source.*fingerprint=.*overwrite=True",
    ):
        CachedDataset(Resized(20, 6), cache_dir)
    with CachedDataset(Resized(20, 6), cache_dir, spot_check=0) as unchecked:  # the documented way out
        assert unchecked[0][0].shape == (3, 8, 8)
    with CachedDataset(Resized(20, 8), cache_dir, spot_check=5) as same:
        assert same[3][1] == 3


def test_spot_check_reports_values_and_types(cache_dir):
    """Same shape and dtype with other values, or another type, is caught too and says which."""
    with CachedDataset(Listed([(torch.zeros(3), 1)] * 6), cache_dir) as ds:
        ds.__getitems__(list(range(6)))
    with pytest.raises(CacheMismatchError, match=r"sample\[0\] has the same dtype and shape but different values"):
        CachedDataset(Listed([(torch.ones(3), 1)] * 6), cache_dir)
    with pytest.raises(CacheMismatchError, match=r"sample\[1\] is 1 in the cache but 2 from the source"):
        CachedDataset(Listed([(torch.zeros(3), 2)] * 6), cache_dir)


def test_spot_check_runs_once_at_construction_not_in_workers(cache_dir, counts):
    """The re-decodes happen once per process tree, when the dataset is built; workers decode nothing again."""
    with CachedDataset(Synthetic(16), cache_dir) as ds:
        ds.__getitems__(list(range(16)))
    ds = CachedDataset(Synthetic(16, count_dir=counts), cache_dir, spot_check=3)
    assert 1 <= len(source_reads(counts)) <= 3
    before = len(source_reads(counts))
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    assert sum(len(y) for _, y in loader) == 16
    assert len(source_reads(counts)) == before
    ds.close()


def test_default_fingerprint_tells_generic_wrappers_apart(cache_dir):
    """Two Subsets of equal length, ConcatDatasets and TensorDatasets of other parts get different fingerprints."""
    from torch.utils.data import ConcatDataset, TensorDataset

    base = Synthetic(100)
    train, val = Subset(base, list(range(0, 50))), Subset(base, list(range(50, 100)))
    fp = lmdbcache.default_fingerprint
    assert fp(train) != fp(val) and fp(train) == fp(Subset(base, list(range(50))))
    assert fp(ConcatDataset([train, val])) != fp(ConcatDataset([val, train]))
    assert fp(TensorDataset(torch.zeros(4, 3))) != fp(TensorDataset(torch.zeros(4, 5)))
    assert fp(base) == "Synthetic:100"  # plain datasets keep v0.1.0's fingerprint: their caches still open
    with CachedDataset(train, cache_dir) as ds:
        ds[0]
    with pytest.raises(CacheMismatchError, match="fingerprint"):
        CachedDataset(val, cache_dir)


def test_negative_length_dataset_is_refused(cache_dir):
    """A dataset whose __len__ is negative is a clear error, not a raw ValueError from deep inside."""

    class Negative(Synthetic):
        def __len__(self):
            return -3

    with pytest.raises(lmdbcache.InvalidOptionError, match="length -3"):
        CachedDataset(Negative(), cache_dir)


def test_a_second_dataset_on_one_path_keeps_its_own_options(cache_dir):
    """Per-object options hold per object; a larger map is honoured; an unchangeable reader table warns."""
    first = CachedDataset(Synthetic(50), cache_dir, commit_every=10_000, commit_interval=60)
    with pytest.warns(lmdbcache.LmdbCacheWarning, match="max_readers=1024.*max_readers=64 cannot take effect"):
        second = CachedDataset(
            Synthetic(50), cache_dir, checksum="always", commit_every=1, map_size="1GiB", max_readers=64
        )
    second[3]  # commit_every=1: committed at once, whatever the first object asked for
    from test_commit import committed, wait_until

    assert wait_until(lambda: committed(cache_dir) == 1, timeout=5)
    assert second._live_store().env_info()["map_size"] >= 1 << 30  # applied before that commit
    first[4]
    time.sleep(0.3)
    assert committed(cache_dir) == 1  # the first object's own policy: not yet
    first.close()
    second.close()


def test_checksum_always_verifies_every_read_and_once_the_first(cache_dir):
    """checksum='once' verifies an index's data on its first read in a process; 'always' on every read."""
    with CachedDataset(Synthetic(4), cache_dir) as ds:
        ds.__getitems__([0, 1, 2, 3])
    from test_store import damage_data

    once = CachedDataset.open(cache_dir)
    always = CachedDataset.open(cache_dir, checksum="always")
    once[1]
    damage_data(cache_dir, 1)  # one data byte of index 1 flipped in place, under both readers
    time.sleep(0.3)  # past the kept read transaction's age
    assert not torch.equal(once[1][0], sample_for(1)[0])  # 'once': already verified, data not re-hashed
    with pytest.raises(lmdbcache.CorruptSampleError, match="index 1"):
        always[1]


def test_a_rebuild_racing_the_old_objects_misses_keeps_them_out_of_the_new_build(cache_dir):
    """A thread filling misses through the old object while this thread rebuilds: the new build holds none of them."""
    import threading

    n = 3000
    old = CachedDataset(Listed([(torch.ones(512, dtype=torch.uint8), k) for k in range(n)]), cache_dir,
                        fingerprint="fp", commit_every=64, commit_interval=0.001)  # fmt: skip
    stop = threading.Event()

    def fill() -> None:
        for i in range(n):
            if stop.is_set():
                return
            try:
                old[i]
            except CacheMismatchError:
                return

    thread = threading.Thread(target=fill)
    thread.start()
    time.sleep(0.2)
    new = CachedDataset(Listed([(torch.full((512,), 2, dtype=torch.uint8), k) for k in range(n)]), cache_dir,
                        fingerprint="fp", overwrite=True, spot_check=0)  # fmt: skip
    time.sleep(0.1)
    stop.set()
    thread.join(timeout=60)
    new.flush()
    stray = [i for i in new._live_store().iter_keys() if int(new[i][0][0]) != 2]
    assert stray == []
    new.close()
    old.close()


def test_spot_check_sees_a_changed_palette_and_caps_its_count(cache_dir):
    """A PIL palette change is a difference; a huge spot_check on a small cache costs no more than its length."""
    from PIL import Image

    def images(rgb):
        out = []
        for k in range(4):
            im = Image.new("P", (2, 2), k % 2)
            im.putpalette(list(rgb) * 2)
            out.append(im)
        return Listed(out)

    with CachedDataset(images((255, 0, 0)), cache_dir) as ds:
        ds.__getitems__(list(range(4)))
    with pytest.raises(CacheMismatchError, match="palette differs"):
        CachedDataset(images((0, 0, 255)), cache_dir)
    start = time.perf_counter()
    CachedDataset(images((255, 0, 0)), cache_dir, spot_check=10**9).close()
    assert time.perf_counter() - start < 5


def test_a_larger_map_from_a_second_object_never_fails_under_a_live_commit(cache_dir):
    """Objects asking for a larger map while another object's commits run: no error (applied between commits)."""
    import threading

    first = CachedDataset(Synthetic(2000), cache_dir, commit_every=1)
    stop, errors = threading.Event(), []

    def fill() -> None:
        try:
            for i in range(2000):
                if stop.is_set():
                    return
                first[i]
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=fill)
    thread.start()
    for k in range(20):
        CachedDataset(Synthetic(2000), cache_dir, map_size=(80 + k) << 20, spot_check=0).close()
    stop.set()
    thread.join(timeout=60)
    assert errors == []
    first.close()


def test_the_spot_check_leaves_a_damaged_value_to_the_read_that_meets_it(cache_dir):
    """A damaged value is not a stale source: opening with the source works; reading the index names the repair."""
    with CachedDataset(Synthetic(1), cache_dir) as ds:
        ds[0]
    with raw_cache(cache_dir) as (txn, samples, _):
        value = bytearray(stored(txn, samples, 0))
        value[-1] ^= 0xFF  # a data byte: the data checksum fails
        txn.put(key(0), bytes(value), db=samples)
    ds = CachedDataset(Synthetic(1), cache_dir, spot_check=1)  # the one cached index is checked
    with pytest.raises(lmdbcache.CorruptSampleError, match=r"index 0.*verify --repair"):
        ds[0]
    ds.close()


def test_close_from_one_thread_while_others_read_then_reopen_in_the_same_process(cache_dir):
    """close() while other threads read (a user's pool, a loader's copy threads): each read returns its sample or
    raises CacheClosedError, and the same process reopens the path at once (it said "already open" before)."""
    import threading

    from lmdbcache import CacheClosedError

    n = 200
    ds = CachedDataset(Synthetic(n), cache_dir)
    for i in range(n):
        ds[i]
    ds.flush()
    stop, unexpected, closed, good = threading.Event(), [], [0], [0]

    def read(rng: random.Random) -> None:
        while not stop.is_set():
            i = rng.randrange(n)
            try:
                assert_same(ds[i], sample_for(i))
                good[0] += 1
            except CacheClosedError:
                closed[0] += 1
            except Exception as exc:
                unexpected.append(repr(exc))

    threads = [threading.Thread(target=read, args=(random.Random(k),)) for k in range(4)]
    for thread in threads:
        thread.start()
    try:
        for k in range(200):
            ds.close()
            other = CachedDataset.open(cache_dir)
            assert_same(other[k % n], sample_for(k % n))
            other.close()
        loader = ds.loader(8, num_threads=2)
        assert sum(len(labels) for _, labels in loader) == n  # the loader's threads read beside them too
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not unexpected, unexpected[:3]
    assert good[0] > 0
    ds.close()


def test_every_sample_a_read_returned_is_committed_when_close_races_the_misses(cache_dir):
    """Two threads filling misses while another closes the dataset 800 times: every sample a read returned is in
    the cache afterwards (issue 38: 4-11 were lost), and a read that did not return raised CacheClosedError."""
    import threading

    from lmdbcache import CacheClosedError

    n = 1 << 20
    ds = CachedDataset(Synthetic(n), cache_dir)
    stop, returned, unexpected = threading.Event(), [set(), set()], []

    def fill(k: int) -> None:
        for i in range(k, n, 2):
            if stop.is_set():
                return
            try:
                ds[i]
                returned[k].add(i)
            except CacheClosedError:
                pass
            except Exception as exc:
                unexpected.append(repr(exc))

    threads = [threading.Thread(target=fill, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(800):
            ds.close()
            time.sleep(0.002)  # the readers run between the closes (not a threshold: any pace shows a loss)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    ds.flush()
    ds.close()
    assert not unexpected, unexpected[:3]
    done = returned[0] | returned[1]
    assert len(done) > 400
    cached = CachedDataset.open(cache_dir)
    lost = []
    for i in sorted(done):
        try:
            assert_same(cached[i], sample_for(i))
        except lmdbcache.SampleNotCachedError:
            lost.append(i)
    assert not lost, f"{len(lost)} samples a read returned were never committed: {lost[:10]}"
    cached.close()


def test_a_batch_read_right_after_this_processs_fill_finds_every_index(cache_dir):
    """The read transaction kept across a fill's misses is renewed after this process's own commit: the loader's
    first batch after ``ds[i]`` filled the cache and ``flush()`` committed it finds every index (no fallback)."""
    ds = CachedDataset(Synthetic(32), cache_dir)
    for i in range(32):
        ds[i]
    ds.flush()
    assert ds.read_batch(list(range(32)), lambda views, checks: len(views)) == 32
    ds.close()


def test_a_batch_of_samples_this_process_queued_commits_them_and_reads_the_map(cache_dir, read_path):
    """A batch read right after a fill, its last misses still queued (not yet committed, no flush()), commits the
    queue and is copied from the map: not the fallback path for every batch until the commit interval ends."""
    ds = CachedDataset(Synthetic(32), cache_dir, commit_every=10_000, commit_interval=3600)
    for i in range(32):
        ds[i]
    writer = ds._live_store().writer
    assert writer.queued == 32 and writer.holds_any([5])  # nothing committed yet: the reads below must commit
    seen = []
    assert ds.read_batch([3, 31, 0], lambda views, checks: seen.append(len(views)) or len(views)) == 3
    assert seen == [3] and writer.queued == 0 and not writer.holds_any(list(range(32)))
    assert ds.read_batch(list(range(32)), lambda views, checks: len(views)) == 32
    ds.close()
