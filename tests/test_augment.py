"""lmdbcache.augment: torchvision's transforms fused into the loader, reproducible per (seed, epoch, index)."""

from __future__ import annotations

import math
import struct
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lmdbcache import CachedDataset, CorruptSampleError, InvalidOptionError, Loader, _native
from lmdbcache.augment import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize
from lmdbcache.loader import _fused
from lmdbcache.loader import augment as aug

pytestmark = pytest.mark.timeout(120)


def image_for(i: int, hwc: bool = False) -> torch.Tensor:
    """Sample i's image: a size of its own (odd, tiny, wide and tall ones among them), CHW or HWC."""
    g = torch.Generator().manual_seed(i)
    sizes = [(1, 1), (2, 3), (7, 5), (33, 47), (40, 9), (9, 64), (24, 24), (61, 37)]
    h, w = sizes[i % len(sizes)]
    image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
    return image.permute(1, 2, 0).contiguous() if hwc else image


class Images(Dataset):
    """``(image, index)`` samples of mixed sizes, stored CHW or HWC."""

    def __init__(self, n: int = 48, hwc: bool = False) -> None:
        self.n, self.hwc = n, hwc

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return image_for(i, self.hwc), i


def cached(path, **kw) -> CachedDataset:
    ds = CachedDataset(Images(**kw), str(path))
    for _ in ds:  # every sample stored
        pass
    ds.flush()  # and committed: the batch path reads the file
    return ds


def reference(image: torch.Tensor, box: tuple[int, ...], flip: bool, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's steps with torch ops: crop by slicing, interpolate on uint8 (antialiased), window, flip."""
    top, left, h, w, rh, rw, oy, ox = box
    x = image[:, top : top + h, left : left + w]
    if (rh, rw) == (1, 1) and (h, w) != (1, 1):  # torch's uint8 kernel asserts on a 1x1 output: in float, rounded
        x = F.interpolate(x[None].float(), size=(1, 1), mode="bilinear", antialias=True, align_corners=False)[0]
        x = x.round().to(torch.uint8)
    elif (rh, rw) != (h, w):
        x = F.interpolate(x[None], size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)[0]
    padded = torch.zeros((x.shape[0], rh + 2 * size[0], rw + 2 * size[1]), dtype=torch.uint8)
    padded[:, size[0] : size[0] + rh, size[1] : size[1] + rw] = x
    x = padded[:, size[0] + oy : size[0] + oy + size[0], size[1] + ox : size[1] + ox + size[1]]
    return x.flip(-1) if flip else x


def expected(plan, seed, epoch, index, image):
    _, h, w = image.shape
    box = aug.box_of(plan, h, w, aug.stream(seed, epoch, index, plan.rrc_at))
    flip = aug.flips(plan, aug.stream(seed, epoch, index, plan.flip_at))
    return reference(image, box, flip, plan.size), box


def get_params_reference(height: int, width: int, scale, ratio, g: torch.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, written from its published source, on torch's RNG."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=g).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=g)).item()
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            i = int(torch.randint(0, height - h + 1, size=(1,), generator=g).item())
            j = int(torch.randint(0, width - w + 1, size=(1,), generator=g).item())
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


@pytest.mark.parametrize("shape", [(300, 400)])
def test_crop_box_distribution_matches_torchvision(shape):
    """Over 100k draws, crop scale and log aspect ratio match torchvision's get_params (KS test, alpha 0.001)."""
    n, (height, width) = 100_000, shape
    plan = aug.compile_plan([RandomResizedCrop(224)])
    ours = np.array([aug.box_of(plan, height, width, aug.stream(1, 0, i, 0))[:4] for i in range(n)], dtype=np.float64)
    g = torch.Generator().manual_seed(0)
    theirs = np.array(
        [get_params_reference(height, width, (0.08, 1.0), (3 / 4, 4 / 3), g) for _ in range(n)], dtype=np.float64
    )
    critical = 1.949 * math.sqrt(2 / n)
    for name, f in (
        ("scale", lambda b: b[:, 2] * b[:, 3] / (height * width)),
        ("log-ratio", lambda b: np.log(b[:, 3] / b[:, 2])),
    ):
        d = ks_statistic(f(ours), f(theirs))
        assert d < critical, f"{name}: KS statistic {d:.4f} >= {critical:.4f}"
    for k in (0, 1):  # the box's position: uniform over the places it fits, as torch.randint draws it
        d = ks_statistic(
            ours[:, k] / (np.array([height, width])[k] - ours[:, 2 + k] + 1),
            theirs[:, k] / (np.array([height, width])[k] - theirs[:, 2 + k] + 1),
        )
        assert d < critical


def test_draws_are_a_pure_function_of_seed_epoch_index():
    """The same (seed, epoch, index) gives the same draws; another seed, epoch or index others."""
    key = aug.stream(5, 2, 17, 0)
    assert [aug.uniform(key, k) for k in range(4)] == [aug.uniform(aug.stream(5, 2, 17, 0), k) for k in range(4)]
    others = {
        aug.uniform(aug.stream(*args), 0)
        for args in [(5, 2, 17, 0), (6, 2, 17, 0), (5, 3, 17, 0), (5, 2, 18, 0), (5, 2, 17, 1)]
    }
    assert len(others) == 5
    draws = np.array([aug.uniform(aug.stream(0, 0, i, 0), 0) for i in range(20000)])
    assert draws.min() >= 0.0 and draws.max() < 1.0 and abs(draws.mean() - 0.5) < 0.01


PIPELINES = {
    "rrc-flip": [RandomResizedCrop(16), RandomHorizontalFlip()],
    "rrc-wide": [RandomResizedCrop((12, 20), scale=(0.5, 1.0)), RandomHorizontalFlip(p=1.0)],
    "center": [CenterCrop(20)],
    "resize-center": [Resize(18), CenterCrop(16), RandomHorizontalFlip()],
    "resize-hw": [Resize((30, 10)), CenterCrop((24, 12))],
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("hwc", [False, True], ids=["chw", "hwc"])
def test_batches_match_the_torch_reference(tmp_path, read_path, monkeypatch, name, hwc):
    """Each image equals crop + interpolate + window + flip in torch (within 1 on the core, exact for flips and
    crops without resize), from images of mixed sizes (1x1 to 61x37) into one fixed-size batch; labels pass."""
    ds = cached(tmp_path / "c", hwc=hwc)
    if read_path == "native":  # every batch through core.augment, none through the torch path
        monkeypatch.setattr(_fused.Fused, "pure", lambda *a: pytest.fail("the native batch fell back"))
    loader = Loader(ds, 8, shuffle=True, seed=7, augment=PIPELINES[name], image_layout="HWC" if hwc else None)
    assert_matches_the_reference(loader, aug.compile_plan(PIPELINES[name]), read_path, epochs=2)


def assert_matches_the_reference(loader, plan, read_path, epochs):
    """Every image of ``epochs`` epochs of ``loader`` (seed 7) equals ``reference`` (within 1 where the core
    resized it)."""
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, *plan.size)
            for row, index in enumerate(labels.tolist()):
                want, box = expected(plan, 7, epoch, index, image_for(index))
                assert box[2] >= 1 and box[3] >= 1, f"index {index}: an empty box {box}"
                got = images[row]
                resized = box[4:6] != box[2:4]
                tolerance = 1 if (read_path == "native" and resized) or (resized and box[4:6] == (1, 1)) else 0
                diff = (got.int() - want.int()).abs().max().item()
                assert diff <= tolerance, f"index {index} epoch {epoch} box {box}: off by {diff}"


BAD_OPTIONS = {  # issue 38: each was accepted, then failed later with a raw error (or a 27 GB allocation)
    "resize-past-the-cap": (lambda: Resize(70000), r"Resize: size must be an int in 1\.\.65536"),
    "resize-2**63": (lambda: Resize(2**63), r"Resize: size .* not 9223372036854775808"),
    "resize-hw-zero": (lambda: Resize((8, 0)), r"Resize: size .* pair \(h, w\)"),
    "resize-antialias": (lambda: Resize(8, antialias=False), r"Resize: only antialias=True .* per-sample"),
    "center-float": (lambda: CenterCrop(8.0), r"CenterCrop: size must be an int"),
    "rrc-size-bool": (lambda: RandomResizedCrop(True), r"RandomResizedCrop: size must be an int"),
    "rrc-tiny-ratio": (lambda: RandomResizedCrop(4, ratio=(1e-300, 1e-300)), r"ratio must be .* \[1e-12, 1e12\]"),
    "rrc-infinite-scale": (lambda: RandomResizedCrop(4, scale=(0.5, math.inf)), r"scale must be .* finite"),
    "rrc-nan-scale": (lambda: RandomResizedCrop(4, scale=(math.nan, 1.0)), r"scale must be"),
    "rrc-decreasing-scale": (lambda: RandomResizedCrop(4, scale=(1.0, 0.5)), r"scale must be an increasing pair"),
    "rrc-zero-ratio": (lambda: RandomResizedCrop(4, ratio=(0, 1)), r"ratio must be"),
    "rrc-one-number": (lambda: RandomResizedCrop(4, scale=0.5), r"scale must be .* pair"),
    "rrc-antialias": (lambda: RandomResizedCrop(4, antialias=False), r"RandomResizedCrop: only antialias=True"),
    "flip-nan": (lambda: RandomHorizontalFlip(math.nan), r"p must be a number in \[0, 1\]"),
    "flip-over-one": (lambda: RandomHorizontalFlip(1.5), r"p must be a number in \[0, 1\]"),
    "normalize-infinite": (lambda: Normalize([math.inf], [1.0]), r"finite numbers"),
    "normalize-zero-std": (lambda: Normalize([0.5], [0.0]), r"std without zeros"),
    "normalize-lengths": (lambda: Normalize([0.5, 0.5], [1.0]), r"of one length"),
    "normalize-dtype": (lambda: Normalize([0.5], [1.0], torch.int32), r"dtype must be torch.float32"),
}


@pytest.mark.parametrize("name", sorted(BAD_OPTIONS))
def test_a_bad_option_is_refused_when_the_transform_is_made(read_path, name):
    """Out-of-range, non-finite, empty-box and unfused options raise InvalidOptionError naming the option and its
    bounds when the transform is constructed, on either path (nothing reaches the kernel or torch)."""
    make, words = BAD_OPTIONS[name]
    with pytest.raises(InvalidOptionError, match=words):
        make()


EXTREME = {  # options at their bounds: each runs on both paths, equal to the torch reference
    "rrc-widest-ranges": [RandomResizedCrop(5, scale=(1e-12, 1e12), ratio=(1e-12, 1e12)), RandomHorizontalFlip(1.0)],
    "rrc-thinnest-box": [RandomResizedCrop(4, scale=(1e-12, 1e-12), ratio=(1e-12, 1e-12))],  # a 1-pixel column
    "rrc-flattest-box": [RandomResizedCrop((3, 2), scale=(1e-12, 1e-12), ratio=(1e12, 1e12))],  # a 1-pixel row
    "rrc-wide-on-tiny": [RandomResizedCrop((2, 7), ratio=(3.0, 4.0)), RandomHorizontalFlip(0.0)],
    "resize-to-the-cap": [Resize((65536, 2)), CenterCrop((3, 2))],
    "rrc-widest-output": [RandomResizedCrop((1, 65536))],
    "rrc-one-pixel": [RandomResizedCrop(1)],  # torch's uint8 kernel asserts on a 1x1 output (the pure path's)
    "resize-to-one-pixel": [Resize((1, 1)), CenterCrop(1)],
}


@pytest.mark.parametrize("name", sorted(EXTREME))
def test_extreme_but_valid_options_match_the_torch_reference(tmp_path, read_path, monkeypatch, name):
    """Scale and ratio at 1e-12 and 1e12, a 65536-pixel side, a central fallback box that torchvision would
    make 0 pixels wide (here at least 1): every image equals the torch reference, on the core without fallback."""
    ds = cached(tmp_path / "c", n=16)
    if read_path == "native":
        monkeypatch.setattr(_fused.Fused, "pure", lambda *a: pytest.fail("the native batch fell back"))
    loader = Loader(ds, 8, shuffle=True, seed=7, augment=EXTREME[name])
    assert_matches_the_reference(loader, aug.compile_plan(EXTREME[name]), read_path, epochs=1)
    loader.close()


@pytest.mark.parametrize(("at", "value"), [(3, math.inf), (4, math.nan), (7, 0.0), (8, -math.inf), (13, 2.0)])
def test_the_kernel_refuses_a_plan_with_non_finite_or_out_of_range_numbers(tmp_path, at, value):
    """core.augment checks a plan's doubles itself (scale, ratio, log-ratio, flip probability), whatever calls it:
    a ValueError, no integer made from an infinity."""
    if getattr(_native.core, "augment", None) is None:
        pytest.skip("the compiled core is not built (or LMDBCACHE_PURE_PYTHON=1)")
    loader = Loader(cached(tmp_path / "c", n=8), 4, augment=[RandomResizedCrop(4), RandomHorizontalFlip()])
    params = list(loader._fused.params)  # (mode, oh, ow, scale0, scale1, log_ratio0, log_ratio1, ratio0, ...)
    params[at] = value
    loader._fused.params = tuple(params)
    with pytest.raises(ValueError, match="augment: the plan's scale, ratio or flip probability"):
        next(iter(loader))
    loader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_normalize_and_channels_last(tmp_path, read_path, dtype):
    """Normalize gives (x/255 - mean)/std in its dtype; channels_last=True the same values in NHWC memory."""
    ds = cached(tmp_path / "c")
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    steps = [RandomResizedCrop(16), RandomHorizontalFlip()]
    plain = next(iter(Loader(ds, 16, seed=3, augment=steps)))
    norm = next(iter(Loader(ds, 16, seed=3, augment=[*steps, Normalize(mean, std, dtype)])))
    last = next(iter(Loader(ds, 16, seed=3, augment=[*steps, Normalize(mean, std, dtype)], channels_last=True)))
    want = ((plain[0].float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]).to(dtype)
    assert norm[0].dtype == dtype and torch.equal(norm[0], want)
    assert last[0].is_contiguous(memory_format=torch.channels_last) and torch.equal(last[0], norm[0])
    assert torch.equal(norm[1], plain[1])


def test_chw_and_hwc_storage_give_the_same_batches(tmp_path, read_path):
    """An image stored HWC is augmented as the same image stored CHW."""
    steps = [RandomResizedCrop(16), RandomHorizontalFlip()]
    a = list(Loader(cached(tmp_path / "a"), 8, seed=1, augment=steps))
    b = list(Loader(cached(tmp_path / "b", hwc=True), 8, seed=1, augment=steps, image_layout="HWC"))
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def batches(loader, limit=None):
    out = []
    for k, batch in enumerate(loader):
        out.append([t.clone() for t in batch])
        if limit is not None and k + 1 == limit:
            break
    return out


def test_threads_and_resume_give_identical_batches(tmp_path, read_path):
    """1 or 3 threads, and a resume from state_dict() after k batches, give bit-identical batches."""
    ds = cached(tmp_path / "c")
    steps = [RandomResizedCrop(16), RandomHorizontalFlip(), Normalize([0.5] * 3, [0.25] * 3)]
    one = Loader(ds, 6, shuffle=True, seed=11, num_threads=1, augment=steps)
    three = Loader(ds, 6, shuffle=True, seed=11, num_threads=3, augment=steps)
    for epoch in range(2):
        one.set_epoch(epoch)
        three.set_epoch(epoch)
        full, other = batches(one), batches(three)
        assert all(torch.equal(x, y) for a, b in zip(full, other) for x, y in zip(a, b))
    stopped = Loader(ds, 6, shuffle=True, seed=11, augment=steps)
    stopped.set_epoch(1)
    head = batches(stopped, 3)
    resumed = Loader(ds, 6, shuffle=True, seed=11, augment=steps)
    resumed.load_state_dict(stopped.state_dict())
    rest = batches(resumed)
    assert len(head) + len(rest) == len(full)
    assert all(torch.equal(x, y) for a, b in zip(head + rest, full) for x, y in zip(a, b))


def test_the_next_epoch_is_built_while_the_last_batch_is_held(tmp_path, read_path):
    """Handing out an epoch's last batch starts the next epoch's pass (its first batch ready when iter() asks):
    its batches are a fresh loader's for that epoch; set_epoch to another epoch stops it; close() joins it."""
    ds = cached(tmp_path / "c", n=24)
    steps = [RandomResizedCrop(16), RandomHorizontalFlip()]

    def fresh(epoch):
        other = Loader(ds, 8, shuffle=True, seed=3, augment=steps)
        other.set_epoch(epoch)
        out = batches(other)
        other.close()
        return out

    def same(got, want):
        return len(got) == len(want) and all(torch.equal(x, y) for a, b in zip(got, want) for x, y in zip(a, b))

    before = set(threading.enumerate())
    loader = Loader(ds, 8, shuffle=True, seed=3, augment=steps)
    assert same(batches(loader), fresh(0))
    assert any(t.name == "lmdbcache-planner" for t in set(threading.enumerate()) - before)  # epoch 1's pass
    assert same(batches(loader), fresh(1))
    loader.set_epoch(5)  # not the epoch started ahead (2): that pass stops (its threads joined), 5 is built afresh
    assert not set(threading.enumerate()) - before
    assert same(batches(loader), fresh(5))
    loader.close()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before


def test_the_pass_ahead_builds_one_batch_until_it_is_taken(tmp_path, monkeypatch):
    """The pass started ahead builds the next epoch's first batch only (one core.augment call on one thread),
    however long the consumer takes to come back; iterating it builds the rest."""
    if _native.core is None:
        pytest.skip("counts the compiled core's calls (the pure path's pass ahead: the test above)")
    ds = cached(tmp_path / "c", n=24)
    core, calls = _native.core, []

    class Counting:
        def __getattr__(self, name):
            return getattr(core, name)

        def augment(self, *args):
            calls.append(args[3:5])
            return core.augment(*args)

    monkeypatch.setattr(_native, "core", Counting())
    loader = Loader(ds, 8, shuffle=True, seed=3, num_threads=1, augment=[RandomResizedCrop(16)])
    assert len(batches(loader)) == 3
    time.sleep(0.5)
    assert len(calls) == 4  # the epoch's 3 batches, then the next epoch's first
    assert len(batches(loader)) == 3
    time.sleep(0.5)
    assert len(calls) == 7  # epoch 1's other 2, then epoch 2's first
    loader.close()


def test_epochs_draw_new_boxes(tmp_path):
    """Another epoch gives other crops of the same samples."""
    ds = cached(tmp_path / "c", n=16)
    loader = Loader(ds, 16, augment=[RandomResizedCrop(16)])
    first, second = batches(loader), batches(loader)
    assert not torch.equal(first[0][0], second[0][0])


def test_bad_pipelines_are_refused_with_the_fix(tmp_path):
    """Unfused transforms, a wrong order, no fixed output size and a per-sample transform are refused (bad options
    of one transform: test_a_bad_option_is_refused_when_the_transform_is_made)."""
    ds = cached(tmp_path / "c", n=8)
    for steps, words in [
        ([RandomHorizontalFlip(), RandomResizedCrop(8)], "geometric transforms first"),
        ([Resize(8)], "one output size"),
        ([lambda x: x], "per-sample transform"),
    ]:
        with pytest.raises(InvalidOptionError, match=words):
            Loader(ds, 4, augment=steps)
    ds.transform = lambda s: s
    with pytest.raises(InvalidOptionError, match="per-sample transform"):
        Loader(ds, 4, augment=[CenterCrop(8)])


def _lie(path, index: int, nbytes: int | None = None, dims: tuple[int, int, int] | None = None) -> None:
    """Rewrite the stored image shape of ``index`` as a buggy or hostile writer would, checksums made to match."""
    import xxhash
    from helpers import key, raw_cache, stored

    with raw_cache(path) as (txn, samples, _):
        value = bytearray(stored(txn, samples, index))
        assert value[27:30] == b"T\x01\x03", "the image is the first item of the flat signature"
        if nbytes is not None:
            value[30:38] = struct.pack("<Q", nbytes & (2**64 - 1))
        if dims is not None:
            value[38:62] = struct.pack("<3Q", *(d & (2**64 - 1) for d in dims))
        size = struct.unpack_from("<I", value, 4)[0]
        value[8:16] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(value[24 : 24 + size]), index))
        txn.put(key(index), bytes(value), db=samples)


@pytest.mark.parametrize(
    "lie",
    [
        {"dims": (3, 0, 47)},
        {"dims": (3, 1 << 40, 47)},
        {"dims": (3, -1, 47)},
        {"dims": (3, 34, 47)},
        {"dims": (3, 1 << 31, 1 << 31)},
        {"nbytes": 3 * 34 * 47, "dims": (3, 34, 47)},
        {"nbytes": 0, "dims": (3, 0, 0)},
        {"nbytes": 1 << 62, "dims": (1 << 20, 1 << 21, 1 << 21)},
    ],
    ids=["zero", "huge", "negative", "off-by-a-row", "overflowing", "longer-than-value", "empty", "absurd"],
)
def test_hostile_stored_shapes_get_a_corrupt_sample_error(tmp_path, read_path, lie):
    """A stored image whose shape lies (zero, huge, negative, not its byte count) is refused with an error naming
    its index, on the core and on the torch path, and the process survives; the batch before it was read."""
    ds = cached(tmp_path / "c", n=8)
    ds.close()
    _lie(tmp_path / "c", 3, **lie)  # index 3: a 33x47 image
    ds = CachedDataset.open(str(tmp_path / "c"))
    loader = Loader(ds, 2, augment=[RandomResizedCrop(16), RandomHorizontalFlip()])
    got = []
    with pytest.raises(CorruptSampleError) as info:
        for batch in loader:
            got.append(batch)
    assert "index 3 is damaged" in str(info.value)
    assert len(got) == 1 and got[0][1].tolist() == [0, 1]


class Large(Dataset):
    """Images of 40 to 300 pixels a side, CHW or HWC: whole 16-row strips and 16-column blocks in the kernel."""

    def __init__(self, hwc: bool) -> None:
        self.hwc = hwc

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(100 + i)
        h, w = [(300, 41), (40, 300), (257, 263), (123, 77), (64, 64), (199, 151), (31, 290), (96, 160)][i]
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
        return (image.permute(1, 2, 0).contiguous() if self.hwc else image), i


@pytest.mark.parametrize("hwc", [False, True], ids=["chw", "hwc"])
def test_large_images_match_the_torch_reference(tmp_path, read_path, hwc):
    """Downscaling and upscaling from images up to 300 pixels a side: within 1 of torch's interpolate."""
    ds = CachedDataset(Large(hwc), str(tmp_path / "c"))
    for _ in ds:
        pass
    ds.flush()
    for steps in ([RandomResizedCrop(64), RandomHorizontalFlip()], [Resize(72), CenterCrop(64)]):
        plan = aug.compile_plan(steps)
        for images, labels in Loader(ds, 4, seed=2, augment=steps, image_layout="HWC" if hwc else "CHW"):
            for row, index in enumerate(labels.tolist()):
                image = Large(False)[index][0]
                want, box = expected(plan, 2, 0, index, image)
                assert (images[row].int() - want.int()).abs().max().item() <= 1, f"index {index} box {box}"


class Ragged(Dataset):
    """Widths and heights that are not multiples of the kernel's vector widths (16, 32 lanes), down to 1 pixel."""

    SIZES = ((257, 301), (301, 257), (3, 3), (1, 50), (50, 1), (1, 1), (47, 257), (17, 33), (31, 15), (2, 301))

    def __init__(self, hwc: bool) -> None:
        self.hwc = hwc

    def __len__(self) -> int:
        return len(self.SIZES)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = torch.Generator().manual_seed(200 + i)
        image = torch.randint(0, 256, (3, *self.SIZES[i]), dtype=torch.uint8, generator=g)
        return (image.permute(1, 2, 0).contiguous() if self.hwc else image), i


@pytest.mark.parametrize("hwc", [False, True], ids=["chw", "hwc"])
def test_ragged_sizes_match_the_torch_reference(tmp_path, read_path, monkeypatch, hwc):
    """Row and column tails of every length (the vector code's overlapped last blocks, the byte-by-byte strips
    under 32 rows), outputs 1 to 100 wide: within 1 of torch's interpolate, exact without a resize."""
    if read_path == "native":  # every batch through core.augment
        monkeypatch.setattr(_fused.Fused, "pure", lambda *a: pytest.fail("the native batch fell back"))
    ds = CachedDataset(Ragged(hwc), str(tmp_path / "c"))
    for _ in ds:
        pass
    ds.flush()
    pipelines = (
        [RandomResizedCrop((37, 45)), RandomHorizontalFlip()],
        [RandomResizedCrop((100, 17), scale=(0.5, 1.0))],
        [Resize(50), CenterCrop((47, 33)), RandomHorizontalFlip(p=1.0)],
        [Resize((33, 1)), CenterCrop((33, 1))],
        [CenterCrop((19, 300))],
    )
    for steps in pipelines:
        plan = aug.compile_plan(steps)
        for images, labels in Loader(ds, 5, seed=4, augment=steps, image_layout="HWC" if hwc else "CHW"):
            for row, index in enumerate(labels.tolist()):
                want, box = expected(plan, 4, 0, index, Ragged(False)[index][0])
                tolerance = 1 if read_path == "native" and box[4:6] != box[2:4] else 0
                diff = (images[row].int() - want.int()).abs().max().item()
                assert diff <= tolerance, f"{steps} index {index} box {box}: off by {diff}"


@pytest.mark.parametrize("hwc", [False, True], ids=["chw", "hwc"])
def test_flipped_batches_are_exact_mirrors(tmp_path, read_path, hwc):
    """A flip (done by the horizontal taps on the core) gives the unflipped image's columns reversed, bit for
    bit, for whole-width windows (RandomResizedCrop) and narrower ones (Resize + CenterCrop), large and ragged."""
    for name, data in (("large", Large(hwc)), ("ragged", Ragged(hwc))):
        ds = CachedDataset(data, str(tmp_path / name))
        for _ in ds:
            pass
        ds.flush()
        for first in (RandomResizedCrop((37, 45)), RandomResizedCrop(64, scale=(0.02, 1.0)), Resize(50)):
            window = [CenterCrop((41, 33))] if isinstance(first, Resize) else []
            batches = [
                list(Loader(ds, 4, seed=3, augment=[first, *window, RandomHorizontalFlip(p=p)], image_layout=layout))
                for p in (0.0, 1.0)
                for layout in ["HWC" if hwc else "CHW"]
            ]
            for (plain, labels), (flipped, again) in zip(*batches):
                assert torch.equal(labels, again)
                assert torch.equal(flipped, plain.flip(-1)), f"{name} {first}"
        ds.close()


def test_new_image_sizes_take_the_known_pattern(tmp_path, monkeypatch):
    """A batch whose first image has a size not met before takes the pattern's batch form (no Layout, no decode
    plan built on the planner's thread per batch): one lookup in all, and the batches still match torch."""
    ds = CachedDataset(Large(False), str(tmp_path / "c"))
    for _ in ds:
        pass
    ds.flush()
    calls = []
    real = _fused.layout_of
    monkeypatch.setattr(_fused, "layout_of", lambda *a: calls.append(a[1]) or real(*a))
    steps = [RandomResizedCrop(32), RandomHorizontalFlip()]
    plan = aug.compile_plan(steps)
    loader = Loader(ds, 2, shuffle=True, seed=5, num_threads=2, augment=steps)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for images, labels in loader:
            for row, index in enumerate(labels.tolist()):
                want, box = expected(plan, 5, epoch, index, Large(False)[index][0])
                assert (images[row].int() - want.int()).abs().max().item() <= 1, f"index {index} box {box}"
    if _native.core is not None and getattr(_native.core, "augment", None) is not None:
        assert len(calls) == 1
