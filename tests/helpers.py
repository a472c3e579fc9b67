"""Datasets and checks shared by the tests. Importable by spawn workers (tests/ is on sys.path)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def sample_for(i: int) -> tuple[torch.Tensor, int]:
    """The deterministic sample of index ``i``: every process can check any read by value."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g), i


class Synthetic(Dataset):
    """``(uint8 tensor, index)`` samples; optionally slow, and counts its reads in a directory."""

    def __init__(self, n: int = 64, delay: float = 0.0, count_dir: str | None = None) -> None:
        self.n, self.delay, self.count_dir = n, delay, count_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.delay:
            time.sleep(self.delay)
        if self.count_dir is not None:
            rank = os.environ.get("LOCAL_RANK")  # torchrun's: whose reads these are (workers inherit it)
            name = f"{os.getpid()}.reads" if rank is None else f"rank{rank}.{os.getpid()}.reads"
            with open(os.path.join(self.count_dir, name), "a") as f:
                f.write(f"{i}\n")
        return sample_for(i)


def compressible_for(i: int) -> tuple[torch.Tensor, int]:
    """A deterministic sample whose 8 KiB of pixels compress well (ramps, as in a smooth image), and its index."""
    ramp = (torch.arange(3 * 32 * 96, dtype=torch.int64) // 24 + i) % 256
    return ramp.to(torch.uint8).reshape(3, 32, 96), i


class Compressible(Dataset):
    """``compressible_for(i)`` samples: every value of a compressed cache holds a compressed buffer."""

    def __init__(self, n: int = 64, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.delay:
            time.sleep(self.delay)
        return compressible_for(i)


def source_reads(count_dir: str) -> list[int]:
    """Every index the source was asked for, across all processes."""
    out: list[int] = []
    for name in os.listdir(count_dir):
        if name.endswith(".reads"):
            with open(os.path.join(count_dir, name)) as f:
                out += [int(line) for line in f]
    return out


def reads_by_rank(count_dir: str) -> dict[int, list[int]]:
    """The indices each torchrun local rank (its own process and its workers) asked the source for."""
    out: dict[int, list[int]] = {}
    for name in os.listdir(count_dir):
        if name.startswith("rank") and name.endswith(".reads"):
            with open(os.path.join(count_dir, name)) as f:
                out.setdefault(int(name[4:].split(".")[0]), []).extend(int(line) for line in f)
    return out


TAG = "LMDBCACHE_TEST_TAG"  # in the environment of a run whose processes must all end (``assert_none_outlive``)


def tagged_processes(tag: str) -> dict[int, str]:
    """Live processes (zombies count as ended) whose environment holds ``TAG=tag``: pid -> command line.

    Children inherit the environment, forked or spawned, and keep it when an orphan is adopted
    by init, so this finds every process of a run wherever it now hangs in the process tree.
    """
    needle, found = f"{TAG}={tag}".encode(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if state not in (b"Z", b"X"):
            found[int(name)] = command
    return found


def assert_none_outlive(tag: str, timeout: float = 90) -> None:
    """No process of the run tagged ``tag`` is alive, at the latest ``timeout`` s from now (a generous deadline
    for a loaded machine: it returns as soon as none is left)."""
    deadline = time.monotonic() + timeout
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # the test fails, and leaves nothing behind
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of a killed run still alive after {timeout:.0f} s: {left}"


def hold_child(hold_dir: str) -> None:
    """In a new child process: note its pid in ``hold_dir``, then wait until ``hold_dir/go`` exists (a worker held
    before its first step, so that its parent can be killed there)."""
    with open(os.path.join(hold_dir, f"{os.getpid()}.held"), "w"):
        pass
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(hold_dir, "go")) and time.monotonic() < deadline:
        time.sleep(0.01)


def held_children(hold_dir: str) -> list[int]:
    """The pids ``hold_child`` noted in ``hold_dir``."""
    return [int(name.split(".")[0]) for name in os.listdir(hold_dir) if name.endswith(".held")]


class HeldAtFork(Synthetic):
    """``Synthetic`` whose process holds each child it forks (its DataLoader workers) in ``hold_child``."""

    def __init__(self, n: int = 64, hold_dir: str = "", delay: float = 0.0) -> None:
        super().__init__(n, delay)
        os.register_at_fork(after_in_child=functools.partial(hold_child, hold_dir))


class Failing(Dataset):
    """Raises on one index, like a corrupt file in a real dataset."""

    def __init__(self, n: int = 16, bad: int = 5) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise ValueError(f"cannot decode file {i}")
        return sample_for(i)


class Listed(Dataset):
    """Serves a fixed list of samples."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor of any dtype (bitwise: NaN == NaN, -0.0 != 0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: Any, b: Any, where: str = "sample") -> None:
    """Deep equality that also demands identical types, dtypes and shapes."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert tensor_bytes(a) == tensor_bytes(b), f"{where}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{k}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    elif type(a).__name__ == "Image" or hasattr(a, "getpixel"):
        assert (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes()), where
        assert a.getpalette() == b.getpalette(), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class Noisy(Dataset):
    """Random augmentation inside the dataset: what the determinism guard must catch."""

    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.rand(4), i


class Big(Dataset):
    """Incompressible ~1 MiB samples, to fill a small disk."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g), i


TESTS_CONSTANT = 3


def not_a_dataset() -> int:
    """A SPEC callable that returns something that is not a dataset."""
    return 42


class Huge(Dataset):
    """Virtual datasets: any length (beyond 2**32), samples made from the index, optionally large."""

    def __init__(self, n: int = 2**33, nbytes: int = 16) -> None:
        self.n, self.nbytes = n, nbytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.full((self.nbytes,), i % 251, dtype=torch.uint8), i


def report_written(path: str, directory: str) -> None:
    """At this process's exit, record how many samples its commits wrote to ``path`` (a DataLoader worker_init_fn)."""
    import multiprocessing.util

    from lmdbcache.store import _registry

    def write() -> None:
        store = _registry._stores.get(os.path.realpath(path))
        if store is not None:
            with open(os.path.join(directory, f"{os.getpid()}.written"), "w") as f:
                f.write(str(store.written))

    # Priority 0 runs after lmdbcache's own exit commit (priority 100).
    multiprocessing.util.Finalize(None, write, exitpriority=0)


def report_written_init(path: str, directory: str, worker_id: int) -> None:
    """``worker_init_fn=functools.partial(report_written_init, path, directory)``."""
    report_written(path, directory)


def total_written(directory: str) -> int:
    total = 0
    for name in os.listdir(directory):
        if name.endswith(".written"):
            with open(os.path.join(directory, name)) as f:
                total += int(f.read())
    return total


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted under ``tmp_path`` (the test is skipped where mounting is not allowed)."""
    import pytest

    from lmdbcache.store import _registry

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        _registry._flush_all_at_exit()  # a handle left open would keep the mount busy
        _registry._stores.clear()
        subprocess.run(["umount", str(mount)], check=True)


@contextlib.contextmanager
def raw_cache(path: Any, write: bool = True) -> Iterator[tuple[Any, Any, Any]]:
    """The cache's LMDB environment opened directly (no lmdbcache): (txn, samples db, meta db), committed on exit."""
    import lmdb

    env = lmdb.open(str(path), max_dbs=2, subdir=True)
    try:
        samples, meta = env.open_db(b"samples"), env.open_db(b"meta")
        with env.begin(write=write) as txn:
            yield txn, samples, meta
    finally:
        env.close()


def key(index: int) -> bytes:
    """The LMDB key of an index (8 bytes, big-endian)."""
    return index.to_bytes(8, "big")


def golden_samples(version: int | str = 1) -> list[Any]:
    """What tests/data/golden-v<version> holds, from the script that wrote it (tests/data/make_golden.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_golden", Path(__file__).parent / "data" / "make_golden.py")
    assert spec is not None and spec.loader is not None
    make_golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_golden)
    return make_golden.golden_samples(version)  # type: ignore[no-any-return]


def unmount(mount: Any) -> None:
    """Undo a bind mount a test made; detach it lazily if a process still holds it, so none is left behind."""
    if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mount)], check=True, capture_output=True)


class FreezeCount(Dataset):
    """Two items, each ``ds[i]`` then a full collection: what ``gc.get_freeze_count()`` is in the worker reading it."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        self.ds[i]
        gc.collect()  # a full collection, as a worker's allocations set off
        return gc.get_freeze_count()


def stored(txn: Any, samples: Any, index: int) -> bytes:
    """The stored value of ``index`` in a raw transaction: its record, or (format 4) the value its pointer points
    to in its group. Editing it and putting it back under ``key(index)`` stores it alone, in place of the pointer."""
    value = bytes(txn.get(key(index), db=samples))
    if len(value) == 20 and value[:4] == b"LMGP":
        group, offset, length = struct.unpack_from("<QII", value, 4)
        whole = bytes(txn.get(b"\xffG" + group.to_bytes(8, "big"), db=samples))
        return whole[offset : offset + length]
    return value


def drop_cached_pages(data_file: Any) -> None:
    """Write ``data_file`` back and drop it from the page cache (fsync, then posix_fadvise DONTNEED): its next
    reads come from the disk, in a process that has not mapped it."""
    fd = os.open(data_file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
