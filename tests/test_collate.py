"""lmdbcache collate: DataLoader batches built in the worker's shared memory equal default_collate's."""

from __future__ import annotations

import pytest
import torch
from helpers import Listed, Synthetic
from test_loader import KINDS, flat_mixed, same, warm
from torch.utils.data import DataLoader, default_collate

import lmdbcache.loader._collate as collate_module
from lmdbcache import CachedDataset
from lmdbcache.loader._collate import Collated, collate

pytestmark = pytest.mark.timeout(120)

FLAT = ["flat image+label", "flat floats, bools, int16", "scalars first", "bfloat16"]


def batches(ds, collate_fn, workers=2, context="fork", shuffle=True, seed=0, **kwargs):
    g = torch.Generator().manual_seed(seed)
    extra = {"multiprocessing_context": context} if workers else {}
    return list(
        DataLoader(ds, 16, shuffle=shuffle, generator=g, num_workers=workers, collate_fn=collate_fn, **kwargs, **extra)
    )


def count_built(monkeypatch):
    """Count the batches __getitems__ builds itself (in this process: num_workers=0)."""
    built = []
    gather = collate_module.gather_shared

    def counting(*args):
        batch = gather(*args)
        built.append(batch is not None)
        return batch

    import lmdbcache.dataset as dataset_module

    monkeypatch.setattr(dataset_module, "_batch_hooks", [(collate_module.wants_batch, counting)])
    return built


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_batches_equal_default_collate(cache_dir, kind, context):
    """DataLoader(2 workers, collate_fn=collate) yields default_collate's batches (flat, non-flat, partial last)."""
    ds = warm(CachedDataset(KINDS[kind](), cache_dir))
    got = batches(ds, collate, context=context)
    want = batches(ds, default_collate, workers=0)
    assert len(got) == 4 and len(got[-1][0] if isinstance(got[-1], list) else got[-1]["x"]) == 2
    same(got, want)


@pytest.mark.parametrize("kind", list(KINDS))
def test_flat_batches_are_built_by_getitems_in_shared_memory(cache_dir, kind, monkeypatch):
    """Flat samples come from __getitems__ already collated, in shared memory; others go through default_collate."""
    ds = warm(CachedDataset(KINDS[kind](), cache_dir))
    built = count_built(monkeypatch)
    got = batches(ds, collate, workers=0, drop_last=True)
    same(got, batches(ds, default_collate, workers=0, drop_last=True))
    assert all(built) == (kind in FLAT) and len(built) == 3
    if kind in FLAT:
        assert all(in_memfd_segment(t) for t in got[0])


def in_memfd_segment(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes lie in a shared mapping of one of lmdbcache's memfd segments (/proc/self/maps)."""
    start, end = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= start and end <= hi:
                return parts[1][3] == "s" and len(parts) > 5 and "memfd:lmdbcache-batch" in parts[5]
    return False


def test_plain_dataloader_is_unchanged(cache_dir, monkeypatch):
    """Without collate, __getitems__ returns the samples as before (never a prebuilt batch), for any collate_fn."""
    ds = warm(CachedDataset(Synthetic(40), cache_dir))
    built = count_built(monkeypatch)
    seen = []

    def mine(samples):
        seen.append(samples)
        return default_collate(samples)

    got = batches(ds, mine, workers=0)
    same(got, batches(ds, None, workers=0))
    assert not built
    assert all(type(s) is list and type(s[0]) is tuple and isinstance(s[0][0], torch.Tensor) for s in seen)
    assert not any(s[0][0].is_shared() for s in seen)
    assert type(ds.__getitems__([1, 2])) is list


def test_misses_filled_through_it_equal_later_hits(cache_dir):
    """A cold cache read through DataLoader+collate is filled; its batches equal those read back warm."""
    ds = CachedDataset(Listed([flat_mixed(i) for i in range(40)]), cache_dir)
    cold = batches(ds, collate, workers=2)
    assert ds.is_complete
    ds.close()
    warm_ds = CachedDataset.open(cache_dir)
    hot = batches(warm_ds, collate, workers=2)
    same(cold, hot)
    same(hot, batches(warm_ds, default_collate, workers=0))


def test_a_per_sample_transform_takes_the_default_path(cache_dir):
    """With a transform, batches are collated from transformed samples, as default_collate would."""
    warm(CachedDataset(Synthetic(20), cache_dir)).close()
    ds = CachedDataset.open(cache_dir, transform=lambda s: (s[0].float() / 2, s[1] + 1))
    same(batches(ds, collate, workers=0), batches(ds, default_collate, workers=0))


def test_collated_is_default_collate_output():
    """collate passes a Collated through as a plain list and hands anything else to default_collate."""
    fields = [torch.zeros(2, 3), torch.tensor([1, 2])]
    out = collate(Collated(fields))
    assert type(out) is list and out[0] is fields[0]
    same(collate([(torch.ones(2), 1), (torch.ones(2), 2)]), default_collate([(torch.ones(2), 1), (torch.ones(2), 2)]))


def test_workers_build_the_batches(cache_dir, tmp_path, monkeypatch):
    """In forked DataLoader workers, every batch of flat samples is built by __getitems__ (logged by the workers)."""
    import os

    import lmdbcache.dataset as dataset_module

    ds = warm(CachedDataset(Synthetic(40), cache_dir))
    log = tmp_path / "built"
    gather = collate_module.gather_shared

    def logging(*args):
        batch = gather(*args)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {batch is not None}\n")
        return batch

    monkeypatch.setattr(dataset_module, "_batch_hooks", [(collate_module.wants_batch, logging)])
    same(batches(ds, collate, workers=2, context="fork"), batches(ds, default_collate, workers=0))
    lines = log.read_text().split("\n")[:-1]
    assert len(lines) == 3 and all(line.endswith("True") for line in lines)
    assert str(os.getpid()) not in {line.split()[0] for line in lines}


def test_a_collated_batch_pickles_as_one_segment(cache_dir, monkeypatch):
    """A Collated batch travels as one shared segment (one handle) and arrives as a plain list of equal views."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  # registers torch's reductions

    ds = warm(CachedDataset(KINDS["flat floats, bools, int16"](), cache_dir))
    monkeypatch.setattr(collate_module, "get_worker_info", lambda: object())  # as in a worker
    built = []

    def keep(batch):
        built.append(collate(batch))
        return batch

    keep.lmdbcache_batched = True
    for _ in DataLoader(ds, 16, collate_fn=keep):
        pass
    assert all(type(b) is Collated and b.segment is not None for b in built)
    sent = ForkingPickler.dumps(built[-1])
    assert bytes(sent).count(b"DupFd") == 1
    got = pickle.loads(sent)
    assert type(got) is list and len({t.untyped_storage().data_ptr() for t in got}) == len(got)  # one storage each
    starts = sorted(t.untyped_storage().data_ptr() for t in got)
    assert starts[-1] - starts[0] < 4096 and all(in_memfd_segment(t) for t in got)  # all in one mapped segment
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in got)  # no header, no neighbour
    same(got, list(built[-1]))


NO_PRIVATE_TORCH_SCRIPT = """
import sys

import torch

del torch._C._storage_Use_Count  # private functions lmdbcache used to call: it must need none of them
for cls in torch.UntypedStorage.__mro__:
    if "_new_shared" in vars(cls):
        delattr(cls, "_new_shared")
from torch.utils.data import DataLoader, default_collate

import lmdbcache.loader._gather as gather
from helpers import Synthetic
from lmdbcache import CachedDataset
from lmdbcache.loader._collate import collate
from test_loader import same

allocated = []
init = gather.Buffers.__init__
gather.Buffers.__init__ = lambda self, *a, **k: allocated.append(1) or init(self, *a, **k)
ds = CachedDataset(Synthetic(40), sys.argv[1])
want = [default_collate([ds[i] for i in range(k, min(k + 8, 40))]) for k in range(0, 40, 8)]
same(list(DataLoader(ds, 8, num_workers=2, multiprocessing_context="fork", collate_fn=collate)), want)
kept = [list(ds.loader(8, num_threads=2)) for epoch in range(3)]  # batches kept: a reused slot would change them
for epoch in kept:
    same(epoch, want)
del kept
allocated.clear()
loader = ds.loader(8, num_threads=2)
for epoch in range(6):
    for batch in loader:  # dropped as the loop goes on: slots are reused
        same(batch, want[batch[1][0] // 8])
print("ok", len(allocated))
"""


def test_collate_and_loader_need_no_private_torch_function(cache_dir):
    """With torch._C._storage_Use_Count and _new_shared deleted, batches are right and the loader still reuses slots."""
    from test_processes import run_script

    out = run_script(NO_PRIVATE_TORCH_SCRIPT, str(cache_dir)).stdout.split()
    assert out[0] == "ok" and int(out[1]) <= 5  # the ring's prefetch + 3 slots (prefetch 2), not one per batch (30)


def test_pin_batch_pins_every_tensor_and_keeps_the_structure(monkeypatch):
    """The loader's public pin_memory path pins each tensor of a fallback batch and keeps lists, tuples and dicts."""
    import collections

    from lmdbcache.loader._pass import pin_batch

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self.clone())
    Pair = collections.namedtuple("Pair", "a b")
    batch = [torch.ones(2), {"x": torch.zeros(1), "name": ["a", "b"]}, Pair(torch.ones(1), 3), (torch.ones(3),)]
    got = pin_batch(batch)
    assert len(pinned) == 4
    assert type(got) is list and type(got[1]) is dict and type(got[2]) is Pair and type(got[3]) is tuple
    assert got[1]["name"] == ["a", "b"] and got[2].b == 3
    same(got, batch)


def test_without_sys_getframe_every_batch_takes_default_collates_path(monkeypatch):
    """A Python without sys._getframe: wants_batch says no (default_collate's path) instead of raising."""
    import sys

    monkeypatch.delattr(sys, "_getframe")
    assert collate_module.wants_batch() is False


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_fill_their_segments_again_and_a_kept_batch_never_changes(cache_dir, context, monkeypatch):
    """Persistent workers reuse a few segments (released by this process) while kept batches stay as they were."""

    ds = warm(CachedDataset(Synthetic(256), cache_dir))
    want = [default_collate([ds[i] for i in range(k, k + 8)]) for k in range(0, 256, 8)]
    from lmdbcache.loader import _shm

    segments = set()
    fields = _shm._fields

    def counting(segment, *args):  # here, in the main process: each batch's segment, by its token
        segments.add(bytes(segment[_shm._TOKEN : _shm._TOKEN + 8]))
        return fields(segment, *args)

    monkeypatch.setattr(_shm, "_fields", counting)
    loader = DataLoader(ds, 8, num_workers=2, collate_fn=collate, persistent_workers=True,
                        multiprocessing_context=context)  # fmt: skip
    kept = list(loader)
    kept_segments = len(segments)
    for _ in range(3):
        for k, batch in enumerate(loader):  # each batch dropped before the next: its segment is released
            same(batch, want[k])
    for k, batch in enumerate(kept):  # the first epoch's batches, kept all along: no reuse overwrote them
        same(batch, want[k])
    assert kept_segments == 32  # every kept batch holds its own segment
    assert len(segments) <= kept_segments + 2 * (collate_module.POOL + 2)  # 96 more batches, a few segments


def test_a_batch_sent_twice_retires_its_segment(cache_dir, monkeypatch):
    """A Collated pickled twice (two readers) never has its segment filled again; once-sent ones are reused."""
    import gc
    import pickle
    from multiprocessing.reduction import ForkingPickler

    ds = warm(CachedDataset(Synthetic(40), cache_dir))
    monkeypatch.setattr(collate_module, "get_worker_info", lambda: object())  # as in a worker
    built = []

    def keep(batch):
        built.append(batch)
        return batch

    keep.lmdbcache_batched = True
    for _ in DataLoader(ds, 8, collate_fn=keep):
        break
    twice = built.pop()
    first, second = pickle.loads(ForkingPickler.dumps(twice)), pickle.loads(ForkingPickler.dumps(twice))
    segment = twice.segment
    del twice, first, second, _
    gc.collect()
    assert segment.retired and not segment.released()
    used = []
    for _ in DataLoader(ds, 8, collate_fn=keep):
        batch = built.pop()
        assert batch.segment is not None and batch.segment is not segment
        used.append(batch.segment)
        pickle.loads(ForkingPickler.dumps(batch))  # sent once and dropped: its segment is filled again
        del batch
    assert len(used) == 5 and len({id(s) for s in used}) <= 2


def test_a_forked_childs_copy_of_a_batch_does_not_release_it():
    """A fork retires the segments of live batches; a forked child dropping its copy releases nothing."""
    import gc
    import os
    import struct

    from lmdbcache.loader._shm import HEADER, Segment, receive

    segment = Segment(HEADER + 4096)
    segment.sending(1)
    batch = receive(os.dup(segment.fd), segment.size, 1, [(torch.uint8, (8, 2), (2, 1), HEADER)])
    pid = os.fork()
    if pid == 0:
        del batch
        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    # not released by the child, and retired by the fork: the child's copy is the same memory
    assert struct.unpack_from("<QQQ", segment.map, 0) == (1, 0, 1) and not segment.released()
    del batch
    gc.collect()
    assert struct.unpack_from("<QQQ", segment.map, 0) == (1, 1, 1) and not segment.released()


FORK_KEEPS_SCRIPT = """
import os, sys
import torch
from torch.utils.data import DataLoader, default_collate
from helpers import Synthetic
from lmdbcache import CachedDataset, collate

if __name__ == "__main__":
    ds = CachedDataset(Synthetic(64), sys.argv[1])
    ds.__getitems__(list(range(64)))
    ds.flush()
    workers = int(sys.argv[2])
    extra = {"multiprocessing_context": "spawn"} if workers else {}
    batches = iter(DataLoader(ds, 8, num_workers=workers, collate_fn=collate, **extra))
    batch = next(batches)
    want = default_collate([ds[i] for i in range(8)])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child keeps its copy of the batch while the parent goes on
        os.close(w)
        os.read(r, 1)
        os._exit(0 if all(torch.equal(a, b) for a, b in zip(batch, want)) else 1)
    os.close(r)
    del batch
    for other in batches:  # the worker (or this process) fills segments again
        pass
    os.write(w, b"x")
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_a_forked_child_keeps_never_changes(cache_dir, workers):
    """A fork shares the segments of the batches alive at that moment: none of them is filled again."""
    from test_processes import run_script

    assert run_script(FORK_KEEPS_SCRIPT, str(cache_dir), str(workers)).stdout.split() == ["0"]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_numpy_array_of_a_batch_moved_to_shared_memory_never_changes(cache_dir, workers):
    """``.numpy()`` then ``share_memory_()`` (as a Queue does): the array still points at the batch's old memory,
    which is therefore never filled again (ds.loader's slot, or a worker's segment, kept by the tensor)."""
    ds = warm(CachedDataset(Synthetic(64), cache_dir))
    want = default_collate([ds[i] for i in range(8)])
    if workers:
        batches = iter(DataLoader(ds, 8, num_workers=1, collate_fn=collate, multiprocessing_context="fork"))
    else:
        batches = iter(ds.loader(8, num_threads=1))
    batch = next(batches)
    images = batch[0].numpy()
    for t in batch:
        t.share_memory_()
    for _ in batches:
        pass
    for _ in ds.loader(8, num_threads=1):
        pass
    assert (images == want[0].numpy()).all() and all(torch.equal(a, b) for a, b in zip(batch, want))


def test_a_wrapper_that_changes_the_batch_is_sent_as_changed(cache_dir):
    """A collate_fn wrapping collate (lmdbcache_batched) that replaces or adds fields: the worker sends its list."""
    ds = warm(CachedDataset(Synthetic(16), cache_dir))

    def mine(batch):
        out = collate(batch)
        out[0] = out[0].float() / 255
        out.append(torch.ones(len(out[1])))
        return out

    mine.lmdbcache_batched = True
    for workers in (0, 1):
        got = next(iter(DataLoader(ds, 4, num_workers=workers, collate_fn=mine)))
        assert len(got) == 3 and got[0].dtype == torch.float32 and torch.equal(got[2], torch.ones(4)), workers


def test_the_file_system_sharing_strategy_is_honoured(cache_dir):
    """With torch's file_system strategy (chosen to keep descriptors few) a kept batch holds no descriptor."""
    import os

    import torch.multiprocessing as mp

    ds = warm(CachedDataset(Synthetic(64), cache_dir))
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        opened = len(os.listdir("/proc/self/fd"))
        kept = list(DataLoader(ds, 2, num_workers=1, collate_fn=collate, multiprocessing_context="fork"))
        assert len(os.listdir("/proc/self/fd")) - opened < 5 and len(kept) == 32
        same(kept, list(DataLoader(ds, 2, collate_fn=default_collate)))
    finally:
        mp.set_sharing_strategy(before)


def test_a_segment_that_cannot_be_mapped_closes_its_descriptor_once(monkeypatch):
    """A failed mmap closes the new memfd once: no later close of a number another file has taken since."""
    import gc
    import os
    import types

    from lmdbcache.loader import _shm

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(_shm, "mmap", types.SimpleNamespace(mmap=refuse))
    with pytest.raises(OSError):
        _shm.Segment(_shm.HEADER + 4096)
    with open(os.devnull) as victim:  # takes the number the memfd had
        gc.collect()  # the half-built Segment's __del__ runs here at the latest
        os.fstat(victim.fileno())
