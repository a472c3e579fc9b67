"""Augmented training (issue 26): random-resized crop 224 + flip fused into the loader vs per-sample torch ops.

    python -m bench.augment [--reps 3] [--n 512]
    python -m bench.augment --kernel DIR [--n 64] [--hwc]   # one fused epoch over the cache in DIR (built if
        absent; --hwc: the images stored HWC), for valgrind --tool=callgrind --toggle-collect=py_augment: the
        kernel's instructions per image (valgrind has no AVX-512: it runs the AVX2 copies)
    python -m bench.augment --kernel DIR --slices [--reps 5]   # the kernel's CPU time alone: one epoch's
        core.augment calls recorded, then run again in this thread (a warm epoch first; thread CPU per image)

One cache of ``n`` uint8 CHW images of mixed sizes (shorter side 256-400, aspect up to 4:3 either way),
batch 64, shuffled, one seed. Rows, interleaved per repetition, medians of ``reps``, warm (one untimed
epoch of each first):

- ``fused 1 thread`` / ``fused 2 threads``: ``Loader(ds, 64, augment=[RandomResizedCrop(224),
  RandomHorizontalFlip()])``, uint8 output; also its CPU time per image (process CPU / images); three
  epochs back to back per repetition (see ``afresh``: the next epoch's first batch is built ahead);
- ``DataLoader 2 workers``: the torchvision-equivalent per-sample transform in torch ops on the uint8
  tensor (get_params on torch's RNG, crop by slicing, ``interpolate`` on uint8 with antialias, flip), as
  torchvision v2 does it, over the same cache (the baseline of the ratios);
- ``Loader + transform``: the same transform as the dataset's per-sample ``transform`` through ``Loader``;
- ``copy bound``: a plain copy of the bytes a batch holds (64 x 3 x 224 x 224), the memory-bandwidth bound;
- ``trainer``: a step of 1 ms pure Python then 4 ms with the GIL released, fed by the fused loader
  (2 threads) vs from a list: the slowdown, per step over at least 128 steps (epochs in a row, as training
  runs them), and over one epoch alone (at 512 images, 8 steps: its boundary weighs as much as its steps).

Reports images/s and GB/s written, and the load (``os.getloadavg``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lmdbcache import CachedDataset, Loader
from lmdbcache.augment import RandomHorizontalFlip, RandomResizedCrop

BATCH, SIZE = 64, 224
OUT_BYTES = 3 * SIZE * SIZE
TRAINER_STEPS = 128  # steps per timing of the trainer row (see main)


class Mixed(Dataset[tuple[torch.Tensor, int]]):
    """uint8 CHW images, shorter side 256-400, aspect 1 to 4:3, landscape or portrait."""

    def __init__(self, n: int, hwc: bool = False) -> None:
        self.n, self.hwc = n, hwc

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        short = int(torch.randint(256, 401, (), generator=g))
        long = int(short * (1 + torch.rand((), generator=g).item() / 3))
        h, w = (short, long) if i % 2 else (long, short)
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
        return (image.permute(1, 2, 0).contiguous() if self.hwc else image), i


def torch_rrc_flip(sample: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """torchvision v2's RandomResizedCrop(224) + RandomHorizontalFlip on a uint8 tensor, in torch ops."""
    image, label = sample
    _, height, width = image.shape
    area, log_ratio = height * width, (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(0.08, 1.0).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio).item())
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            i = int(torch.randint(0, height - h + 1, (1,)).item())
            j = int(torch.randint(0, width - w + 1, (1,)).item())
            break
    else:
        i, j, h, w = 0, 0, height, width
    out = F.interpolate(image[None, :, i : i + h, j : j + w], size=(SIZE, SIZE), mode="bilinear", antialias=True)[0]
    return (out.flip(-1) if torch.rand(1) < 0.5 else out), label


def timed(batches: Any) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, images) of one pass."""
    start, cpu = time.perf_counter(), time.process_time()
    count = 0
    for images, _ in batches:
        count += len(images)
    return time.perf_counter() - start, time.process_time() - cpu, count


def trainer(batches: Any, epochs: int = 1) -> float:
    """Seconds for ``epochs`` epochs of steps in a row: 1 ms of pure Python, then 4 ms with the GIL released (a
    CUDA sync)."""
    start = time.perf_counter()
    for _ in range(epochs):
        for _ in batches:
            end = time.perf_counter() + 0.001
            while time.perf_counter() < end:
                pass
            time.sleep(0.004)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--kernel", metavar="DIR")
    parser.add_argument("--hwc", action="store_true", help="--kernel: the images stored HWC")
    parser.add_argument("--slices", action="store_true", help="--kernel: time core.augment alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = [RandomResizedCrop(SIZE), RandomHorizontalFlip()]
    if args.kernel:
        ds = CachedDataset(Mixed(args.n, args.hwc), os.path.join(args.kernel, "c"))
        if not ds.is_complete:
            for _ in ds:
                pass
            ds.flush()
        layout = "HWC" if args.hwc else "CHW"
        # A sampler of the same order: a shuffled Loader would start the next epoch's pass ahead (Spare), whose
        # batches callgrind would count too, as many as the threads' timing lets it build.
        order = Loader(ds, BATCH, shuffle=True, seed=7).order(0)
        loader = Loader(ds, BATCH, sampler=order, num_threads=1, augment=steps, image_layout=layout)
        if args.slices:
            kernel_time(loader, args.reps)
        else:
            timed(loader)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ds = CachedDataset(Mixed(args.n), os.path.join(tmp, "c"))
        for _ in ds:
            pass
        ds.flush()
        with_transform = CachedDataset.open(os.path.join(tmp, "c"), transform=torch_rrc_flip)
        src, dst = torch.empty(BATCH, OUT_BYTES, dtype=torch.uint8), torch.empty(BATCH, OUT_BYTES, dtype=torch.uint8)
        src.fill_(1)

        def copies() -> Any:
            for _ in range(args.n // BATCH):
                dst.copy_(src)
                yield dst, None

        # One loader per row, iterated once per epoch as training does (the first, untimed epoch warms it): a new
        # Loader per epoch would charge every epoch its ring's first page faults, and a new DataLoader its
        # workers' start, neither of which a training run pays more than once.
        fused1 = Loader(ds, BATCH, shuffle=True, num_threads=1, augment=steps)
        fused2 = Loader(ds, BATCH, shuffle=True, num_threads=2, augment=steps)

        def afresh(loader: Loader) -> Any:
            # An epoch's last batch starts the next epoch's first (the Loader's pass ahead), which would be built
            # while the next row runs: its CPU counted there, its batch here. The row runs three epochs back to
            # back (the first batches of the second and third built ahead inside it), then set_epoch to another
            # epoch stops the pass ahead, inside the row's time.
            for _ in range(3):
                yield from loader
            loader.set_epoch(loader.epoch + 1)

        workers = DataLoader(with_transform, BATCH, shuffle=True, num_workers=2, persistent_workers=True)
        transformed = Loader(with_transform, BATCH, shuffle=True)
        runs = {
            "fused 1 thread": lambda: afresh(fused1),
            "fused 2 threads": lambda: afresh(fused2),
            "DataLoader 2 workers": lambda: workers,
            "Loader + transform": lambda: transformed,
            "copy bound": lambda: copies(),
        }
        figures: dict[str, list[tuple[float, float, int]]] = {name: [] for name in runs}
        for make in runs.values():
            timed(make())  # warm: the cache's pages, the code paths, the rings and the workers
        for _ in range(args.reps):
            for name, make in runs.items():
                figures[name].append(timed(make()))
        one = Loader(ds, BATCH, shuffle=True, augment=steps)
        fused = [b for b in one]
        one.close()  # and its pass ahead
        # The trainer's figure is per step, so each timing runs at least TRAINER_STEPS steps (epochs in a row, as
        # training runs them): one epoch of 512 images is 8 steps, where the epoch's boundary (its first batch,
        # the pass ahead's start at its last) weighs as much as the steps. One epoch alone is reported beside.
        epochs = max(1, -(-TRAINER_STEPS // len(fused)))
        ratios = {}
        for label, count in (("steady", epochs), ("one epoch", 1)):
            listed, slow = [], []
            for _ in range(args.reps):
                listed.append(trainer(fused, count))
                slow.append(trainer(fused2, count))
            ratios[label] = (count, statistics.median(slow) / statistics.median(listed))
        ds.close()  # before the directory goes: the exit's flush would find it gone
        with_transform.close()
        report(figures, ratios, args)


def kernel_time(loader: Loader, reps: int) -> None:
    """Thread CPU per image of core.augment alone, over the calls of one (warm) epoch, median of ``reps``."""
    from lmdbcache import _native

    core = _native.core
    assert core is not None and hasattr(core, "augment"), "the compiled core has no augment"
    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return getattr(core, name)

        def augment(self, *args: Any) -> Any:
            calls.append(args)
            return core.augment(*args)

    timed(loader)  # warm: the first read of each value verifies its data checksum
    _native.core = Recorder()  # type: ignore[assignment]
    try:
        timed(loader)
    finally:
        _native.core = core
    images, runs = sum(args[4] - args[3] for args in calls), []
    for _ in range(reps):
        start = time.thread_time()
        for args in calls:
            core.augment(*args)
        runs.append((time.thread_time() - start) / images * 1e6)
    print(f"core.augment alone: {statistics.median(runs):.1f} us CPU per image (median of {reps}; "
          f"{' '.join(f'{r:.1f}' for r in runs)}), {images} images, 1 thread")  # fmt: skip


def report(figures: dict[str, list[tuple[float, float, int]]], ratios: dict[str, tuple[int, float]], args: Any) -> None:
    load = os.getloadavg()
    print(f"bench.augment: {args.n} images 256-400 short side, batch {BATCH}, RandomResizedCrop({SIZE}) + flip, "
          f"uint8; medians of {args.reps}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    base = statistics.median(n / s for s, _, n in figures["DataLoader 2 workers"])
    print(f"{'row':<24}{'images/s':>10}{'GB/s written':>14}{'x DataLoader':>14}{'CPU us/image':>14}")
    for name, runs in figures.items():
        rate = statistics.median(n / s for s, _, n in runs)
        cpu = statistics.median(c / n * 1e6 for _, c, n in runs)
        print(f"{name:<24}{rate:>10.0f}{rate * OUT_BYTES / 1e9:>14.2f}{rate / base:>14.2f}{cpu:>14.0f}")
    (epochs, steady), (_, one) = ratios["steady"], ratios["one epoch"]
    print(f"trainer step (1 ms Python + 4 ms GIL released) fed by fused 2 threads / from a list: {steady:.3f}x "
          f"({epochs} epochs in a row); {one:.3f}x (one epoch alone)")  # fmt: skip


if __name__ == "__main__":
    main()
