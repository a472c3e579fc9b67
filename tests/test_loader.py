"""lmdbcache.Loader: DataLoader's batches and order, resume, buffer reuse, trust checks, clean shutdown."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from helpers import Listed, Synthetic, key, raw_cache, sample_for, stored
from torch.utils.data import DataLoader, DistributedSampler, default_collate

import lmdbcache.loader._pass as pass_module
from lmdbcache import CachedDataset, CorruptSampleError, InvalidOptionError, LmdbCacheWarning

pytestmark = pytest.mark.timeout(60)


def same(a, b, where="batch"):
    """Equal structure, types, dtypes, shapes and values."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def reference(ds, batch_size, seed=0, epoch=0, **kwargs):
    g = torch.Generator().manual_seed(seed + epoch)
    return list(DataLoader(ds, batch_size, generator=g, collate_fn=default_collate, **kwargs))


def warm(ds):
    """Every index decoded into the cache and committed."""
    ds.__getitems__(list(range(len(ds))))
    ds.flush()
    return ds


def flat_mixed(i):
    g = torch.Generator().manual_seed(i)
    return (torch.rand(2, 3, generator=g), i * 3 - 50, i / 7, i % 3 == 0, torch.tensor([i, -i], dtype=torch.int16))


KINDS = {
    "flat image+label": lambda: Synthetic(50),
    "flat floats, bools, int16": lambda: Listed([flat_mixed(i) for i in range(50)]),
    "scalars first": lambda: Listed([(i, torch.full((4,), i, dtype=torch.float64)) for i in range(50)]),
    "dicts": lambda: Listed([{"x": torch.full((3,), i), "y": i, "name": f"s{i}"} for i in range(50)]),
    "nested": lambda: Listed([((torch.tensor([i]), [i, i + 1]), {"w": float(i)}) for i in range(50)]),
    "mixed shapes, strings": lambda: Listed([(torch.zeros(2, 3), torch.ones(5) * i, f"n{i}", b"b") for i in range(50)]),
    "bfloat16": lambda: Listed([(torch.full((2, 2), i, dtype=torch.bfloat16), i) for i in range(50)]),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("shuffle", "drop_last"), [(False, False), (True, False), (True, True)])
def test_batches_equal_dataloader(cache_dir, kind, shuffle, drop_last, copies, read_path):
    """Every batch equals DataLoader+default_collate's with the same generator seed (partial last batch, drop_last)."""
    ds = warm(CachedDataset(KINDS[kind](), cache_dir))
    with ds.loader(16, shuffle=shuffle, drop_last=drop_last, seed=5) as loader:
        got = list(loader)
    want = reference(ds, 16, seed=5, shuffle=shuffle, drop_last=drop_last)
    assert len(got) == len(want) == (3 if drop_last else 4)
    same(got, want)


@pytest.mark.parametrize(("shuffle", "drop_last"), [(False, False), (True, False), (True, True)])
def test_an_epochs_batches_are_dataloaders_index_lists(cache_dir, shuffle, drop_last):
    """``Loader.batches(e)`` holds DataLoader's batches of indices as lists of Python ints; what a pass walks
    (``_sequence``: each batch made when asked for) holds the same, with a list's indexing: negative, slices,
    IndexError past the end, TypeError for a float, equality."""
    ds = CachedDataset(Synthetic(50), cache_dir)
    for epoch in (0, 3):
        g = torch.Generator().manual_seed(5 + epoch)
        want = list(DataLoader(range(50), 16, shuffle=shuffle, drop_last=drop_last, generator=g))
        want = [[int(i) for i in b] for b in want]
        loader = ds.loader(16, shuffle=shuffle, drop_last=drop_last, seed=5)
        assert loader.batches(epoch) == want and type(loader.batches(epoch)) is list  # the public form: lists
        got = loader._sequence(epoch)  # what a pass walks: each batch made when asked for
        assert len(got) == len(want) and list(got) == want and got == want
        assert all(type(i) is int for b in got for i in b)
        assert got[-1] == want[-1] and got[1:] == want[1:] and got[::-2] == want[::-2]
        with pytest.raises(IndexError, match="out of range"):
            got[len(want)]
        with pytest.raises(TypeError):
            got[1.0]
    sampled = ds.loader(16, sampler=[2**70, -1, 3])._sequence(0)  # a sampler's values are kept as given
    assert list(sampled) == [[2**70, -1, 3]]


@pytest.fixture(params=["inline", "pool"])
def copies(request, monkeypatch):
    """Small batches are copied by the planner thread; 'pool' forces them onto the copy threads."""
    if request.param == "pool":
        monkeypatch.setattr(pass_module, "INLINE", 0)
    return request.param


def test_flat_batches_take_the_copy_path(cache_dir, monkeypatch, copies):
    """A warm cache of flat samples is read by copying out of the map, never through __getitems__."""
    ds = warm(CachedDataset(Listed([flat_mixed(i) for i in range(40)]), cache_dir))

    def refuse(ds, indices):
        raise AssertionError("fallback used")

    monkeypatch.setattr(pass_module, "together", refuse)
    monkeypatch.setattr(pass_module, "one_by_one", refuse)
    for threads in (1, 2, 3):
        same(list(ds.loader(8, shuffle=True, num_threads=threads)), reference(ds, 8, shuffle=True))


def test_variable_shapes_fail_as_default_collate_does_and_layouts_may_change(cache_dir):
    """Shapes that differ inside a batch raise default_collate's error; layouts changing between batches are fine."""
    ds = warm(CachedDataset(Listed([(torch.zeros(i // 8 + 1), i) for i in range(32)]), cache_dir))
    same(list(ds.loader(8, prefetch=1)), reference(ds, 8))
    with pytest.raises(RuntimeError) as ours:
        list(ds.loader(8, shuffle=True))
    with pytest.raises(RuntimeError) as theirs:
        reference(ds, 8, shuffle=True)
    assert str(ours.value) == str(theirs.value)


def test_epochs_advance_per_pass_and_set_epoch_sets_it(cache_dir):
    """Pass k without set_epoch is epoch k (seed + k); set_epoch(e) gives epoch e's order."""
    ds = warm(CachedDataset(Synthetic(40), cache_dir))
    loader = ds.loader(8, shuffle=True, seed=11)
    for epoch in range(3):
        same(list(loader), reference(ds, 8, seed=11, epoch=epoch, shuffle=True))
    loader.set_epoch(1)
    same(list(loader), reference(ds, 8, seed=11, epoch=1, shuffle=True))
    loader.close()


@pytest.mark.parametrize("n", [60, 61])
def test_distributed_split_covers_every_index_once(cache_dir, n):
    """Ranks get DistributedSampler's indices; together they cover every index, each once (plus its padding)."""
    ds = warm(CachedDataset(Synthetic(n), cache_dir))
    seen = []
    for rank in range(3):
        loader = ds.loader(7, shuffle=True, seed=2, rank=rank, world_size=3)
        loader.set_epoch(4)
        labels = torch.cat([batch[1] for batch in loader]).tolist()
        sampler = DistributedSampler(range(n), num_replicas=3, rank=rank, shuffle=True, seed=2)  # type: ignore[arg-type]
        sampler.set_epoch(4)
        assert labels == list(sampler)
        seen += labels
    pad = -n % 3
    assert sorted(set(seen)) == list(range(n)) and len(seen) == n + pad


def test_distributed_from_torchrun_env(cache_dir, monkeypatch):
    """Without rank/world_size, RANK and WORLD_SIZE from torchrun select this rank's share."""
    ds = warm(CachedDataset(Synthetic(20), cache_dir))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    labels = torch.cat([b[1] for b in ds.loader(4)]).tolist()
    assert labels == list(range(1, 20, 2))


def read_indices(monkeypatch):
    """Record the index lists the loader reads."""
    reads = []
    gather = pass_module.Pass._gather

    def recording(self, indices):
        reads.append(list(indices))
        return gather(self, indices)

    monkeypatch.setattr(pass_module.Pass, "_gather", recording)
    return reads


def position(state):
    """(seed, epoch, batches, samples) of a Loader state."""
    return state["seed"], state["epoch"], state["batches"], state["samples"]


def test_resume_mid_epoch_gives_exactly_the_remaining_batches(cache_dir, monkeypatch):
    """A loader restored from state_dict yields the remaining batches, without reading the skipped ones."""
    ds = warm(CachedDataset(Synthetic(50), cache_dir))
    want = reference(ds, 8, seed=1, shuffle=True)
    first = ds.loader(8, shuffle=True, seed=1, prefetch=3)
    for k, _ in enumerate(first):
        if k == 2:
            break
    state = first.state_dict()
    first.close()
    assert state == {  # received, not prefetched; and what the position means
        "seed": 1,
        "epoch": 0,
        "batches": 3,
        "samples": 24,
        "sampler": "default",
        "batch_size": 8,
        "shuffle": True,
        "drop_last": False,
        "rank": None,
        "world_size": None,
        "dataset_length": 50,
    }
    reads = read_indices(monkeypatch)
    second = ds.loader(8, shuffle=True, seed=1)
    second.load_state_dict(state)
    same(list(second), want[3:])
    assert reads == [b[1].tolist() for b in want[3:]]
    assert position(second.state_dict()) == (1, 1, 0, 0)


def test_two_resumes_in_a_row_and_at_the_end_of_an_epoch(cache_dir):
    """Resumed twice, then from the last batch of an epoch: the batches seen are exactly one run's."""
    ds = warm(CachedDataset(Synthetic(50), cache_dir))
    want = reference(ds, 8, seed=3, shuffle=True) + reference(ds, 8, seed=3, epoch=1, shuffle=True)
    got, state = [], None
    for stop in (2, 4, 7, 9):  # 7 batches per epoch: the third stop is the very end of epoch 0
        loader = ds.loader(8, shuffle=True, seed=3)
        if state is not None:
            loader.load_state_dict(state)
        for batch in loader:
            got.append(batch)
            if len(got) == stop:
                break
        state = loader.state_dict()
        loader.close()
    same(got, want[:9])
    assert position(state) == (3, 1, 2, 16)


def labels_after(loader, state):
    """The labels of every batch a loader gives after load_state_dict(state), flattened."""
    loader.load_state_dict(state)
    got = torch.cat([b[1] for b in loader]).tolist()
    loader.close()
    return got


def stopped_after(loader, batches):
    """The loader's state after the consumer received ``batches`` batches."""
    for k, _ in enumerate(loader, 1):
        if k == batches:
            break
    state = loader.state_dict()
    loader.close()
    return state


def test_a_state_resumes_at_the_same_sample_with_another_batch_size(cache_dir):
    """A state saved with batch size 16 resumes at the same sample with 32 (and 8): no sample skipped or repeated;
    a position that is not a whole number of the new batches is refused, naming both sizes."""
    ds = warm(CachedDataset(Synthetic(100), cache_dir))
    order = torch.cat([b[1] for b in reference(ds, 16, seed=2, shuffle=True)]).tolist()
    state = stopped_after(ds.loader(16, shuffle=True, seed=2), 4)  # 64 samples
    assert labels_after(ds.loader(32, shuffle=True, seed=2), state) == order[64:]
    assert labels_after(ds.loader(8, shuffle=True, seed=2), state) == order[64:]
    odd = stopped_after(ds.loader(16, shuffle=True, seed=2), 3)  # 48 samples: one and a half batches of 32
    with pytest.raises(InvalidOptionError, match=r"batch_size=16 after 48 samples .* batch_size=32"):
        ds.loader(32, shuffle=True, seed=2).load_state_dict(odd)
    end = stopped_after(ds.loader(16, shuffle=True, seed=2), 7)  # the whole epoch: 100 samples, the last 4 alone
    loader = ds.loader(32, shuffle=True, seed=2)
    loader.load_state_dict(end)
    assert position(loader.state_dict()) == (2, 1, 0, 0)
    loader.close()


@pytest.mark.parametrize(
    ("saved", "loaded", "field"),
    [
        ({"seed": 1, "shuffle": True}, {"seed": 2, "shuffle": True}, "seed"),
        ({"shuffle": True}, {"shuffle": False}, "shuffle"),
        ({"drop_last": True}, {}, "drop_last"),
        ({"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 2}, {"rank": 0, "world_size": 4}, "world_size"),
        ({}, {"sampler": list(range(50))}, "sampler"),
        ({"batch_size": None, "batch_sampler": [[k, k + 1] for k in range(0, 50, 2)]}, {}, "sampler"),
    ],
)
def test_a_state_saved_with_other_settings_is_refused(cache_dir, saved, loaded, field):
    """A state whose position means other samples here (seed, shuffle, drop_last, rank, world size, sampler kind)
    is refused with an InvalidOptionError naming the field, both values and the fix; the position is unchanged."""
    ds = warm(CachedDataset(Synthetic(50), cache_dir))
    size = {"batch_size": 5}
    state = stopped_after(ds.loader(**{**size, **saved}), 3)
    loader = ds.loader(**{**size, **loaded})
    with pytest.raises(InvalidOptionError, match=rf"saved with {field}=.*but this loader has {field}=.*set_epoch"):
        loader.load_state_dict(state)
    assert position(loader.state_dict())[1:] == (0, 0, 0)
    loader.close()


def test_a_state_without_the_new_fields_still_loads(cache_dir):
    """A state saved by an earlier lmdbcache ({seed, epoch, batches} only) loads as before and resumes there."""
    ds = warm(CachedDataset(Synthetic(50), cache_dir))
    order = torch.cat([b[1] for b in reference(ds, 8, seed=1, shuffle=True)]).tolist()
    loader = ds.loader(8, shuffle=True, seed=1)
    assert labels_after(loader, {"seed": 1, "epoch": 0, "batches": 3}) == order[24:]


def test_a_kept_batch_is_never_overwritten(cache_dir, copies):
    """Batches (and views of them) kept by the user keep their values; dropped buffers are reused."""
    ds = warm(CachedDataset(Synthetic(64), cache_dir))
    loader = ds.loader(4, shuffle=True, prefetch=1)
    kept, copies = [], []
    for _ in range(3):
        for k, batch in enumerate(loader):
            if k % 5 == 0:
                kept.append(batch[0] if k % 2 else batch[0][1:3])  # a whole batch tensor, or a view of one
                copies.append(kept[-1].clone())
    for a, b in zip(kept, copies):
        assert torch.equal(a, b)
    assert len(loader._ring.buffers) <= 4
    loader.close()


def test_buffers_are_reused_when_batches_are_dropped(cache_dir, monkeypatch):
    """A consumer that keeps nothing costs at most prefetch + 3 batch allocations over several epochs."""
    import lmdbcache.loader._gather as gather

    ds = warm(CachedDataset(Synthetic(64), cache_dir))
    made = []
    allocate = gather.Layout.allocate
    monkeypatch.setattr(gather.Layout, "allocate", lambda self, *a: made.append(a) or allocate(self, *a))
    loader = ds.loader(4, shuffle=True, prefetch=2)
    for _ in range(3):
        for batch in loader:
            batch[0].add_(0)  # used, then dropped when the loop moves on
    loader.close()
    assert 1 <= len(made) <= 5


def test_misses_filled_through_the_loader_equal_later_hits(cache_dir):
    """A cold cache is filled by the loader; its batches equal those read back from the warm cache."""
    ds = CachedDataset(Synthetic(40), cache_dir)
    cold = list(ds.loader(8, shuffle=True))
    ds.flush()
    assert ds.is_complete
    ds.close()
    warm_ds = CachedDataset.open(cache_dir)
    loader = warm_ds.loader(8, shuffle=True)
    loader.set_epoch(0)
    same(cold, list(loader))
    same(cold, reference(warm_ds, 8, shuffle=True))


def damage(path, index, at):
    """Flip the byte ``at`` of index's stored value (negative: from its end)."""
    with raw_cache(path) as (txn, samples, _):
        value = bytearray(stored(txn, samples, index))
        value[at] ^= 0xFF
        txn.put(key(index), bytes(value), db=samples)


def damage_in_place(path, index):
    """Flip the last byte of index's tensor in data.mdb, under the open reader (every copy of it LMDB holds)."""
    needle = sample_for(index)[0].numpy().tobytes()
    with open(path / "data.mdb", "r+b") as f:
        data = f.read()
        at = data.find(needle)
        assert at >= 0
        while at >= 0:
            f.seek(at + len(needle) - 1)
            f.write(bytes([needle[-1] ^ 0xFF]))
            at = data.find(needle, at + 1)


@pytest.mark.parametrize("checksum", ["once", "always"])
@pytest.mark.parametrize(("what", "at"), [("data", -1), ("structure", 30), ("header", 10)])
def test_a_damaged_value_raises_what_the_dataset_raises(cache_dir, checksum, what, at, copies, read_path):
    """A damaged value raises CorruptSampleError with the dataset's message; no batch holding it is yielded."""
    warm(CachedDataset(Synthetic(24), cache_dir)).close()
    damage(cache_dir, 13, at)
    ds = CachedDataset.open(cache_dir, checksum=checksum)
    with pytest.raises(CorruptSampleError) as raised:
        for batch in ds.loader(8):
            assert 13 not in batch[1].tolist()
    with pytest.raises(CorruptSampleError) as direct:
        ds[13]
    assert str(raised.value) == str(direct.value)
    assert "index 13" in str(raised.value)


def test_always_verifies_data_already_read(cache_dir, read_path):
    """checksum='always': a value damaged after the loader read it once is refused on the next read."""
    warm(CachedDataset(Synthetic(16), cache_dir)).close()
    ds = CachedDataset.open(cache_dir, checksum="always")
    same(list(ds.loader(8)), reference(ds, 8))
    damage_in_place(cache_dir, 3)
    time.sleep(0.3)  # past the kept read transaction's age
    with pytest.raises(CorruptSampleError, match="index 3"):
        list(ds.loader(8))


def test_a_value_under_another_key_is_refused(cache_dir, read_path):
    """Index 3's value stored under index 5 is damage, not index 3's sample."""
    warm(CachedDataset(Synthetic(10), cache_dir)).close()
    with raw_cache(cache_dir) as (txn, samples, _):
        txn.put(key(5), bytes(stored(txn, samples, 3)), db=samples)
    ds = CachedDataset.open(cache_dir)
    with pytest.raises(CorruptSampleError, match="index 5"):
        list(ds.loader(4))


def threads_after(action):
    before = set(threading.enumerate())
    action()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return set(threading.enumerate()) - before


def test_break_leaves_no_thread(cache_dir):
    """Leaving a pass early joins its planner and copy threads; close() is idempotent."""
    ds = warm(CachedDataset(Synthetic(64), cache_dir))
    loader = ds.loader(4, prefetch=4)

    def run():
        for _ in loader:
            break

    assert not threads_after(run)
    loader.close()
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_error_reaches_the_consumer_with_its_index(cache_dir, workers):
    """A failing per-sample transform is re-raised in the consumer, naming the index, on the threads and on
    worker processes; no thread stays."""

    def transform(sample):
        if sample[1] == 21:
            raise ValueError("bad augmentation")
        return sample

    warm(CachedDataset(Synthetic(40), cache_dir)).close()
    ds = CachedDataset.open(cache_dir, transform=transform)
    raised = []

    def run():
        with pytest.raises(ValueError, match="bad augmentation") as info:
            list(ds.loader(8, num_workers=workers))
        raised.append(info.value)

    assert not threads_after(run)
    notes = " ".join([str(raised[0]), *getattr(raised[0], "__notes__", [])])  # a worker's note is in its traceback
    assert "index 21" in notes and "batch 2" in notes


def test_batch_transform_runs_on_whole_batches_and_its_errors_stop_cleanly(cache_dir):
    """batch_transform sees each collated batch; its exception reaches the consumer; no thread stays."""
    ds = warm(CachedDataset(Synthetic(24), cache_dir))
    got = list(ds.loader(8, batch_transform=lambda b: (b[0].float() / 255, b[1])))
    assert got[0][0].dtype == torch.float32 and got[2][1].tolist() == list(range(16, 24))

    def fail(batch):
        raise RuntimeError("boom")

    def run():
        with pytest.raises(RuntimeError, match="boom"):
            list(ds.loader(8, batch_transform=fail))

    assert not threads_after(run)


def test_keyboard_interrupt_leaves_no_thread(cache_dir):
    """KeyboardInterrupt in the consumer's loop stops the pass and joins its threads."""
    ds = warm(CachedDataset(Synthetic(64), cache_dir))
    loader = ds.loader(4, prefetch=2)

    def run():
        with pytest.raises(KeyboardInterrupt):
            for k, _ in enumerate(loader):
                if k == 3:
                    raise KeyboardInterrupt

    assert not threads_after(run)
    assert loader.state_dict()["batches"] == 4
    loader.close()


def test_sample_values_come_through_unchanged(cache_dir):
    """Flat-path tensors hold the source's bytes (checked against the deterministic samples)."""
    ds = warm(CachedDataset(Synthetic(12), cache_dir))
    (images, labels), *_ = list(ds.loader(12))
    assert labels.tolist() == list(range(12))
    assert torch.equal(images, torch.stack([sample_for(i)[0] for i in range(12)]))


class FakeEvent:
    """A device event that completes ``delay`` seconds after it is recorded (a host-to-device copy in flight)."""

    def __init__(self, delay: float) -> None:
        self.done = threading.Event()
        self.timer = threading.Timer(delay, self.done.set)
        self.timer.start()

    def query(self) -> bool:
        return self.done.is_set()


def test_a_slot_is_reused_only_after_its_device_event(cache_dir, monkeypatch):
    """With record_event, a slot whose batch the consumer dropped waits for its event; nothing is allocated instead."""
    import lmdbcache.loader._gather as gather

    ds = warm(CachedDataset(Synthetic(64), cache_dir))
    events: list[FakeEvent] = []
    made, waited = [], []
    allocate = gather.Layout.allocate
    monkeypatch.setattr(gather.Layout, "allocate", lambda self, *a: made.append(a) or allocate(self, *a))
    acquire = pass_module.Ring.acquire

    def checked(ring, layout, rows):
        pending = {id(b): b.event for b in ring.buffers if b.event is not None and not b.event.query()}
        buffers = acquire(ring, layout, rows)
        if id(buffers) in pending:
            assert pending[id(buffers)].query(), "a slot was reused before its device copy finished"
            waited.append(buffers)
        return buffers

    monkeypatch.setattr(pass_module.Ring, "acquire", checked)
    loader = ds.loader(4, shuffle=True, prefetch=1, record_event=lambda: events.append(FakeEvent(0.02)) or events[-1])
    for _ in range(2):
        for batch in loader:
            batch[0].add_(0)
    loader.close()
    assert len(events) == 32 and waited and len(made) <= 4
    for event in events:
        event.timer.join()


def test_pin_memory_without_cuda_warns_and_is_ignored(cache_dir):
    """Like DataLoader: pin_memory=True without CUDA warns, and batches are the usual (unpinned) ones."""
    ds = warm(CachedDataset(Synthetic(20), cache_dir))
    assert not torch.cuda.is_available()
    with pytest.warns(LmdbCacheWarning, match="pin_memory"):
        loader = ds.loader(8, pin_memory=True)
    same(list(loader), reference(ds, 8))
    assert loader.record_event is None
    loader.close()


def test_the_pin_memory_warning_points_at_the_users_line(cache_dir):
    """The pin_memory warning names the caller's file, through ds.loader(...) as through Loader(...)."""
    from lmdbcache import Loader

    ds = warm(CachedDataset(Synthetic(4), cache_dir))
    for make in (lambda: ds.loader(2, pin_memory=True), lambda: Loader(ds, 2, pin_memory=True)):
        with pytest.warns(LmdbCacheWarning, match="pin_memory") as caught:
            make().close()
        assert [w.filename for w in caught] == [__file__]


def random_transform(sample):
    """A random augmentation drawing from the three global generators."""
    import random

    import numpy as np

    image, label = sample
    noise = torch.randint(0, 5, image.shape, dtype=torch.uint8)
    return image + noise, label * 1000 + random.randrange(1000), float(np.random.rand())


def test_random_transforms_do_not_depend_on_threads(cache_dir):
    """Random transforms are seeded per (seed, epoch, index): 1 and 3 threads give equal batches; epochs differ."""
    warm(CachedDataset(Synthetic(40), cache_dir)).close()
    ds = CachedDataset.open(cache_dir, transform=random_transform)
    state = torch.get_rng_state()
    runs = []
    for threads in (1, 3, 3):
        loader = ds.loader(8, shuffle=True, seed=4, num_threads=threads, num_workers=0)
        runs.append([list(loader), list(loader)])  # epochs 0 and 1
        loader.close()
    same(runs[0], runs[1])
    same(runs[0], runs[2])
    assert not torch.equal(runs[0][0][0][0], runs[0][1][0][0]) or runs[0][0][0][1].tolist() != runs[0][1][0][1].tolist()
    labels = torch.cat([b[1] for b in runs[0][1]]) // 1000
    assert sorted(labels.tolist()) == list(range(40))
    assert torch.equal(torch.get_rng_state(), state)  # the consumer's generator state is restored


def test_sampler_and_batch_sampler_as_in_dataloader(cache_dir):
    """sampler= and batch_sampler= give DataLoader's batches; set_epoch is called on samplers that have one."""
    from torch.utils.data import BatchSampler

    ds = warm(CachedDataset(Synthetic(30), cache_dir))
    order = [7, 3, 29, 0, 11, 5, 6, 13, 2]
    loader = ds.loader(4, sampler=order)
    same(list(loader), list(DataLoader(ds, 4, sampler=order)))
    assert len(loader) == 3
    groups = [[1, 2, 3], list(range(4, 14)), [20], [0, 29]]
    loader = ds.loader(None, batch_sampler=groups)
    same(list(loader), list(DataLoader(ds, batch_sampler=groups)))
    assert len(loader) == 4
    dist = DistributedSampler(range(30), num_replicas=2, rank=1, shuffle=True, seed=9)  # type: ignore[arg-type]
    loader = ds.loader(None, batch_sampler=BatchSampler(dist, 5, drop_last=False))
    loader.set_epoch(3)
    got = torch.cat([b[1] for b in loader]).tolist()
    dist.set_epoch(3)
    assert got == list(dist)
    with pytest.raises(InvalidOptionError, match="mutually exclusive"):
        ds.loader(4, sampler=order, shuffle=True)
    with pytest.raises(InvalidOptionError, match="mutually exclusive"):
        ds.loader(4, batch_sampler=groups)


def memory_now():
    """(PSS, anonymous PSS) of this process, in bytes."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Pss_Anon"):
                fields[name] = int(rest.split()[0]) * 1024
    return fields["Pss"], fields["Pss_Anon"]


def test_memory_does_not_grow_from_epoch_to_epoch(cache_dir):
    """PSS after epoch 4 is within a generous bound of PSS after epoch 2: batches are reused or freed, not leaked."""
    image = torch.zeros(3, 128, 128, dtype=torch.uint8)
    ds = warm(CachedDataset(Listed([(image + (i % 200), i) for i in range(256)]), cache_dir, map_size=64 << 20))
    batch_bytes = 32 * image.numel()
    loader = ds.loader(32, shuffle=True, prefetch=2)
    seen = {}
    for epoch in range(1, 5):
        for batch in loader:
            batch[0].add_(0)
        seen[epoch] = memory_now()
    loader.close()
    epoch_bytes = 8 * batch_bytes  # a leak of every batch would add this per epoch
    assert seen[4][0] - seen[2][0] < epoch_bytes, seen
    assert seen[4][1] - seen[2][1] < epoch_bytes, seen


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_loader_and_dataloader_workers_fill_one_cache_at_once(cache_dir, context):
    """The loader's threads and two DataLoader workers fill one empty cache at once: both see the source's
    samples, and the cache ends complete with every index equal to its source."""
    from test_processes import check_cache

    n = 96
    ds = CachedDataset(Synthetic(n, delay=0.002), cache_dir)
    workers = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=context)
    seen: list[int] = []

    def other() -> None:
        for _, labels in workers:
            seen.extend(labels.tolist())

    thread = threading.Thread(target=other)
    thread.start()
    with ds.loader(8, shuffle=True, seed=1, num_threads=2) as loader:
        got = [(images, labels) for images, labels in loader]
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert sorted(seen) == list(range(n))
    assert sorted(i for _, labels in got for i in labels.tolist()) == list(range(n))
    for images, labels in got:
        same(images, torch.stack([sample_for(i)[0] for i in labels.tolist()]))
    ds.close()
    check_cache(cache_dir, n)


@pytest.mark.parametrize("keep", ["untyped_storage", "storage", "share_memory_"])
def test_a_batch_kept_by_its_storage_or_moved_to_shared_memory_never_changes(cache_dir, keep):
    """Keeping only a batch's storage, or moving it to shared memory (what a torch.multiprocessing Queue does),
    never lets a later batch overwrite it or be written into freed memory (found by the attack)."""
    ds = warm(CachedDataset(Synthetic(40), cache_dir))
    expected = reference(ds, 4)
    kept, got = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated; users still call storage()
        with ds.loader(4, prefetch=1) as loader:
            for images, labels in loader:
                if keep == "share_memory_":  # then dropped: its slot must not be reused through stale addresses
                    images.share_memory_()
                    labels.share_memory_()
                    got.append([images.clone(), labels.clone()])
                else:
                    kept.append((getattr(images, keep)(), bytes(images.numpy()[:, :1, :1, :1])))
                    got.append([images.clone(), labels.clone()])
    for a, b in zip(got, expected):
        same(a, b)
    for storage, first_bytes in kept:
        assert bytes(torch.tensor([], dtype=torch.uint8).set_(storage.untyped() if keep == "storage" else storage)
                     .numpy()[:: 3 * 8 * 8][:4]) == first_bytes  # fmt: skip


def test_samples_with_an_empty_tensor_batch_as_in_dataloader(cache_dir):
    """A flat sample holding a zero-byte tensor batches like default_collate, cold and warm (found by the attack)."""
    ds = CachedDataset(Listed([(torch.empty(0, 3), i) for i in range(8)]), cache_dir)
    for _ in range(2):  # cold (filled through the loader), then warm
        with ds.loader(4) as loader:
            same(list(loader), reference(ds, 4))
        ds.flush()
    ds.close()


def test_sampler_indices_are_resolved_as_dataloader_does(cache_dir):
    """Negative and tensor indices from a sampler read what DataLoader reads; out-of-range ones raise IndexError."""
    ds = warm(CachedDataset(Synthetic(8), cache_dir))
    for sampler in ([-1, 0, -8], [torch.tensor(3), 1]):
        with ds.loader(2, sampler=sampler) as loader:
            same(list(loader), list(DataLoader(ds, 2, sampler=sampler)))
    for sampler in ([7, 8], [0, 2**64]):
        with ds.loader(2, sampler=sampler) as loader, pytest.raises(IndexError, match="out of range"):
            list(loader)
    ds.close()


def close_mid_pass(loader, at: int = 2) -> None:
    """Iterate ``loader`` and close it from another thread at batch ``at``: the pass ends with 'was closed'."""
    with pytest.raises(RuntimeError, match="was closed while this pass was running"):
        for k, _ in enumerate(loader):
            if k == at:
                closer = threading.Thread(target=loader.close)
                closer.start()
                closer.join()
            time.sleep(0.001)


def test_close_from_another_thread_ends_the_pass_with_a_clear_error(cache_dir):
    """close() from another thread mid-pass ends the consumer's loop with 'was closed', and leaves no thread."""
    ds = warm(CachedDataset(Synthetic(400), cache_dir))
    before = set(threading.enumerate())
    close_mid_pass(ds.loader(2, prefetch=1))
    assert set(threading.enumerate()) <= before
    ds.close()


# ---------------------------------------------------------------- edges: nested passes, StopIteration, empty batches


@pytest.mark.parametrize("workers", [0, 2])
def test_a_nested_loop_over_one_loader_says_a_newer_pass_replaced_it(cache_dir, workers):
    """iter(loader) inside a loop over it: the outer pass ends saying a newer pass replaced it, not 'closed'."""
    ds = warm(CachedDataset(Synthetic(40), cache_dir))
    loader = ds.loader(4, num_workers=workers)
    with pytest.raises(RuntimeError, match="replaced by a newer pass") as info:
        for _ in loader:
            inner = [b[1].tolist() for b in loader]
    assert "closed" not in str(info.value)
    assert inner == [list(range(k, k + 4)) for k in range(4, 40, 4)]  # it continued from the outer position
    loader.close()
    with pytest.raises(RuntimeError, match="was closed"):  # close() keeps its own message
        closed = ds.loader(4, num_workers=workers)
        for _ in closed:
            closed.close()


def stop_at_13(sample):
    """A transform that raises StopIteration at index 13."""
    if int(sample[1]) == 13:
        raise StopIteration("no more crops")
    return sample


def stop_on_batch_2(batch):
    if int(batch[1][0]) == 8:
        raise StopIteration("batch_transform gave up")
    return batch


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_stop_iteration_in_a_transform_is_an_error_naming_its_index(cache_dir, workers, context):
    """A StopIteration from a per-sample transform ends the pass with StrayStopIterationError naming index 13 and
    the original exception, on threads and on worker processes; never a silently short epoch."""
    from lmdbcache import StrayStopIterationError

    warm(CachedDataset(Synthetic(24), cache_dir)).close()
    ds = CachedDataset.open(cache_dir, transform=stop_at_13)
    got = []
    with pytest.raises(StrayStopIterationError) as info:
        for batch in ds.loader(4, num_workers=workers, multiprocessing_context=context):
            got.append(batch)
    assert len(got) == 3
    text = " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "index 13" in text and "no more crops" in text and "batch 3" in text
    if workers == 0:  # across processes the cause travels as text (the worker's traceback, in the message)
        assert isinstance(info.value.__cause__, StopIteration) and str(info.value.__cause__) == "no more crops"


@pytest.mark.parametrize("workers", [0, 2])
def test_stop_iteration_in_a_batch_transform_is_an_error_naming_its_batch(cache_dir, workers):
    """A StopIteration from batch_transform ends the pass with StrayStopIterationError naming the batch, its cause
    the original, with threads or worker processes; no thread stays."""
    from lmdbcache import StrayStopIterationError

    ds = warm(CachedDataset(Synthetic(24), cache_dir))
    raised = []

    def run():
        with pytest.raises(StrayStopIterationError, match="batch_transform on batch 2 of epoch 0") as info:
            list(ds.loader(4, batch_transform=stop_on_batch_2, num_workers=workers))
        raised.append(info.value)

    assert not threads_after(run)
    assert isinstance(raised[0].__cause__, StopIteration) and "gave up" in str(raised[0].__cause__)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_empty_batch_from_a_batch_sampler_is_a_clear_error(cache_dir, workers):
    """An empty list from a batch_sampler is an InvalidOptionError naming the batch and the fix (DataLoader gives
    a bare IndexError), before any batch is read."""
    ds = warm(CachedDataset(Synthetic(10), cache_dir))
    with pytest.raises(IndexError):  # what DataLoader does with it
        list(DataLoader(ds, batch_sampler=[[0, 1], [], [2]]))
    loader = ds.loader(None, batch_sampler=[[0, 1], [], [2]], num_workers=workers)
    with pytest.raises(InvalidOptionError, match="batch 1 of epoch 0 from the batch_sampler is empty"):
        iter(loader)
    loader.close()


def planner_running() -> bool:
    return any(t.name == "lmdbcache-planner" for t in threading.enumerate())


def test_small_batches_are_built_by_the_consumer_after_a_first_pass(cache_dir):
    """After a pass of small copied batches, the next ones run no planner thread (the consumer builds each
    batch): DataLoader's batches still, every epoch, and resumable mid-pass."""
    ds = warm(CachedDataset(Synthetic(50), cache_dir))
    loader = ds.loader(8, shuffle=True, seed=4)
    planners = []
    for epoch in range(3):
        got = []
        for batch in loader:
            if not got:
                planners.append(planner_running())
            got.append(batch)
        same(got, reference(ds, 8, seed=4, epoch=epoch, shuffle=True))
    assert planners == [True, False, False]
    got = []
    for batch in loader:  # epoch 3, on the consumer's thread: stop after two batches, resume in a new loader
        got.append(batch)
        if len(got) == 2:
            break
    resumed = ds.loader(8, shuffle=True, seed=4)
    resumed.load_state_dict(loader.state_dict())
    same(got + list(resumed), reference(ds, 8, seed=4, epoch=3, shuffle=True))


def test_a_damaged_value_in_a_consumer_built_pass_raises_with_its_index(cache_dir):
    """checksum='always', a value damaged after a first pass: the consumer-built pass raises CorruptSampleError
    for it, with the batch noted, and leaves no thread."""
    warm(CachedDataset(Synthetic(16), cache_dir)).close()
    ds = CachedDataset.open(cache_dir, checksum="always")
    loader = ds.loader(8)
    same(list(loader), reference(ds, 8))
    damage_in_place(cache_dir, 3)
    time.sleep(0.3)  # past the kept read transaction's age

    def run():
        with pytest.raises(CorruptSampleError, match="index 3") as raised:
            for _ in loader:
                assert not planner_running()
        assert any("batch 0 of epoch 1" in note for note in raised.value.__notes__)

    assert not threads_after(run)
