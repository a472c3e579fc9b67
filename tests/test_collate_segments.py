"""lmdbcache collate's segments across processes: one mapping per segment in the reader, adopted by later workers."""

from __future__ import annotations

import gc
import os
import socket
import struct
from multiprocessing.reduction import recvfds, sendfds

import pytest
import torch
from helpers import Synthetic
from test_loader import same, warm
from torch.utils.data import DataLoader, default_collate

import lmdbcache.loader._collate as collate_module
from lmdbcache import CachedDataset
from lmdbcache.loader import _shm
from lmdbcache.loader._collate import collate

pytestmark = pytest.mark.timeout(180)

FIELD = [(torch.uint8, (8, 2), (2, 1), _shm.HEADER)]
SIZE = _shm.HEADER + 4096


def counting_segments(monkeypatch, maps=None):
    """The token of the segment of every batch this process receives (and in ``maps``, the mapping's id)."""
    tokens = []
    fields = _shm._fields

    def counting(segment, *args):
        tokens.append(bytes(segment[_shm._TOKEN : _shm._TOKEN + 8]))
        if maps is not None:
            maps.add(id(segment))
        return fields(segment, *args)

    monkeypatch.setattr(_shm, "_fields", counting)
    return tokens


def test_workers_of_later_epochs_adopt_the_segments_of_earlier_ones(cache_dir, monkeypatch):
    """Without persistent workers, each epoch's new workers fill the segments the last epoch's workers left."""
    ds = warm(CachedDataset(Synthetic(256), cache_dir))
    want = [default_collate([ds[i] for i in range(k, k + 8)]) for k in range(0, 256, 8)]
    inodes = counting_segments(monkeypatch)
    per_epoch = []
    for _ in range(4):
        for k, batch in enumerate(DataLoader(ds, 8, num_workers=2, collate_fn=collate)):
            same(batch, want[k])
        per_epoch.append(set(inodes))
        inodes.clear()
    first, later = per_epoch[0], set().union(*per_epoch[1:])
    assert len(later - first) <= 4  # three new generations of workers: almost every segment is an adopted one
    assert len(first & later) >= len(first) - 2


def test_an_adopted_segment_never_overwrites_a_kept_batch(cache_dir):
    """Batches kept from earlier epochs (never released) are never adopted: they stay as they were."""
    ds = warm(CachedDataset(Synthetic(128), cache_dir))
    want = [default_collate([ds[i] for i in range(k, k + 8)]) for k in range(0, 128, 8)]
    kept = list(DataLoader(ds, 8, num_workers=2, collate_fn=collate))
    half = [batch for k, batch in enumerate(DataLoader(ds, 8, num_workers=2, collate_fn=collate)) if k % 2]
    for _ in range(2):
        for k, batch in enumerate(DataLoader(ds, 8, num_workers=2, collate_fn=collate)):
            same(batch, want[k])
    same(kept, want)
    same(half, want[1::2])


def test_the_reader_maps_each_segment_once(cache_dir, monkeypatch):
    """Every later batch in a segment is built on the mapping made for its first one; no descriptor piles up."""
    ds = warm(CachedDataset(Synthetic(256), cache_dir))
    maps = set()
    inodes = counting_segments(monkeypatch, maps)
    sent = []
    reduce = collate_module.Collated.__reduce__

    def sending(self):  # in the workers: how each batch travels
        out = reduce(self)
        os.write(w, b"t" if out[0] is _shm.receive_by_token else b"d")
        return out

    r, w = os.pipe()
    monkeypatch.setattr(collate_module.Collated, "__reduce__", sending)
    loader = DataLoader(ds, 8, num_workers=2, collate_fn=collate, persistent_workers=True)
    opened = len(os.listdir("/proc/self/fd"))
    for _ in range(4):
        for _batch in loader:
            pass
    assert len(inodes) == 128 and len(set(inodes)) <= 2 * (collate_module.POOL + 2)
    assert len(maps) == len(set(inodes))  # one mapping per segment, not per batch
    assert len(os.listdir("/proc/self/fd")) - opened <= len(set(inodes)) + 2  # one kept descriptor per segment
    while len(sent) < 128:
        sent += os.read(r, 128).decode()
    os.close(r)
    os.close(w)
    # a descriptor travels at most with the first batch in each segment (none if adopted): the rest go by token
    assert sent.count("d") <= len(set(inodes)) and sent.count("t") >= 128 - len(set(inodes))


def _owner(sock: socket.socket) -> None:
    """A forked worker: sends a new segment's descriptor (batch 1 of it), waits for a byte, exits."""
    segment = _shm.Segment(SIZE)
    segment.map[_shm.HEADER : _shm.HEADER + 16] = bytes(range(16))
    segment.sending(1)
    sendfds(sock, [segment.fd])
    sock.recv(1)
    os._exit(0)


def _adopters(n: int, size: int) -> list[int]:
    """Fork ``n`` would-be workers that each try to adopt a kept segment and hold what they got until all have
    tried; how many adopted one (1) or not (0), sorted."""
    go_r, go_w = os.pipe()
    said_r, said_w = os.pipe()
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            adopted = _shm._adopt(size)
            os.write(said_w, b"1" if adopted is not None else b"0")
            os.read(go_r, 1)  # the segment (and its lock) held until the parent has heard from everyone
            os._exit(0)
        pids.append(pid)
    said = sorted(int(os.read(said_r, 1)) for _ in range(n))
    os.write(go_w, b"x" * n)
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    for fd in (go_r, go_w, said_r, said_w):
        os.close(fd)
    return said


def _received() -> tuple[list[torch.Tensor], bytes, int, socket.socket]:
    """A batch received here from a forked owner that waits for a byte before exiting, its token, pid and socket."""
    parent, child = socket.socketpair()
    owner = os.fork()
    if owner == 0:
        parent.close()
        _owner(child)
    child.close()
    (fd,) = recvfds(parent, 1)
    token = os.pread(fd, 8, _shm._TOKEN)
    batch = _shm.receive(fd, SIZE, 1, FIELD)
    assert bytes(batch[0].flatten().numpy()) == bytes(range(16))
    return batch, token, owner, parent


def _end(owner: int, sock: socket.socket) -> None:
    sock.send(b"x")
    assert os.waitstatus_to_exitcode(os.waitpid(owner, 0)[1]) == 0
    sock.close()


def test_a_segment_is_adopted_only_once_its_owner_exits_and_by_one_process():
    """While its owner lives nobody adopts its segment; then exactly one of several siblings, of that size only."""
    batch, token, owner, sock = _received()
    try:
        del batch
        gc.collect()
        assert struct.unpack_from("<QQQ", _shm._kept[token].map, 0) == (1, 1, 0)  # released, not retired
        assert _adopters(1, SIZE) == [0]  # its owner lives
        _end(owner, sock)
        assert _adopters(3, SIZE) == [0, 0, 1]  # siblings at once: exactly one
        assert _adopters(1, SIZE + 64) == [0]  # another size is never taken
        assert _adopters(1, SIZE) == [1]  # each adopter exited: free again
    finally:
        _shm._kept.pop(token).forget()


def test_a_segment_whose_batch_the_reader_holds_is_never_adopted():
    """A batch alive here when workers fork retires its segment: no worker ever fills it, even after release."""
    batch, token, owner, sock = _received()
    try:
        _end(owner, sock)
        assert _adopters(2, SIZE) == [0, 0]  # the batch lives: retired by the fork
        del batch
        gc.collect()
        assert struct.unpack_from("<QQQ", _shm._kept[token].map, 0) == (1, 1, 1)
        assert _adopters(1, SIZE) == [0]
    finally:
        _shm._kept.pop(token).forget()


def test_a_batch_sent_by_token_to_a_process_that_never_mapped_it_is_opened_from_its_sender_or_refused():
    """A token-only batch unpickled elsewhere opens the sender's descriptor, checked to be that segment."""
    segment = _shm.Segment(SIZE)
    segment.map[_shm.HEADER : _shm.HEADER + 16] = bytes(range(16))
    segment.sending(1)
    token = segment.token()
    try:
        batch = _shm.receive_by_token(token, SIZE, 1, FIELD, os.getpid(), segment.fd)
        assert bytes(batch[0].flatten().numpy()) == bytes(range(16))
        with pytest.raises(RuntimeError, match="is gone"):  # the number now names another file
            _shm.receive_by_token(b"\0" * 8, SIZE, 2, FIELD, os.getpid(), segment.fd)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        with pytest.raises(RuntimeError, match="never mapped, and it cannot be opened"):
            _shm.receive_by_token(os.urandom(8), SIZE, 1, FIELD, pid, segment.fd)
    finally:
        kept = _shm._kept.pop(token, None)
        if kept is not None:
            kept.forget()
