"""``make demo``: cache a folder of JPEG photos and watch every later epoch, and process, skip the decode.

Generates 400 synthetic JPEGs (about 500x375, quality 90) under demo_data/, then times:
the bare dataset, the first epoch through CachedDataset (decoding and filling the cache),
a warm epoch, a DataLoader epoch with 2 workers, and a separate Python process that opens
the cache without the JPEG files.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lmdbcache  # noqa: E402
from scripts.example_data import jpeg_dataset  # noqa: E402

N = int(os.environ.get("DEMO_N", 400))
DATA = ROOT / "demo_data"
CACHE = DATA / "cache.lmdb"

READER = """
import sys, time, random
from lmdbcache import CachedDataset
ds = CachedDataset.open(sys.argv[1])        # no JPEG files, no source dataset
order = list(range(len(ds))); random.shuffle(order)
start = time.perf_counter()
for i in order:
    image, label = ds[i]
print(f"{len(ds) / (time.perf_counter() - start):,.0f}")
"""


def timed(label: str, run) -> float:
    start = time.perf_counter()
    count = run()
    rate = count / (time.perf_counter() - start)
    print(f"  {label:<52} {rate:>9,.0f} samples/s")
    return rate


def main() -> None:
    print(f"lmdbcache {lmdbcache.__version__} demo: {N} JPEG photos, decoded to 3x224x224 uint8 tensors\n")
    start = time.perf_counter()
    source = jpeg_dataset(str(DATA / "jpeg"), N)
    print(f"  example data in {DATA / 'jpeg'} ({time.perf_counter() - start:.1f} s)\n")
    shutil.rmtree(CACHE, ignore_errors=True)
    order = list(range(N))
    random.Random(0).shuffle(order)

    def epoch(ds):
        return lambda: sum(1 for i in order if ds[i] is not None)

    bare = timed("bare dataset (decode every time)", epoch(source))
    ds = lmdbcache.CachedDataset(source, CACHE)
    timed("CachedDataset, epoch 1 (decode + fill the cache)", epoch(ds))
    start = time.perf_counter()
    ds.flush()  # the background thread commits the last batch while training would go on
    print(f"  {'  (then the last commit, waited for here)':<52} {time.perf_counter() - start:>9.2f} s")
    warm = timed("CachedDataset, epoch 2 (from the cache)", epoch(ds))
    loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2, persistent_workers=True)
    timed("DataLoader, 2 workers, batch 32, first pass", lambda: sum(len(y) for _, y in loader))
    timed("DataLoader, 2 workers, batch 32, second pass", lambda: sum(len(y) for _, y in loader))
    loader = None  # the persistent workers exit and commit
    fast = ds.loader(32, shuffle=True, seed=0, num_threads=2)  # threads copy batches straight from the map
    timed("ds.loader, 2 threads, batch 32, first pass", lambda: sum(len(y) for _, y in fast))
    timed("ds.loader, 2 threads, batch 32, second pass", lambda: sum(len(y) for _, y in fast))
    fast.close()
    ds.close()

    result = subprocess.run(
        [sys.executable, "-c", READER, str(CACHE)], capture_output=True, text=True, check=True, env={**os.environ}
    )
    other = float(result.stdout.strip().replace(",", ""))
    print(f"  {'another Python process, CachedDataset.open (no source)':<52} {other:>9,.0f} samples/s")

    size = sum(f.stat().st_size for f in CACHE.iterdir())
    print(
        f"\n  warm reads are {warm / bare:.0f}x the bare dataset; the cache holds {N} decoded samples in "
        f"{size / 2**20:.0f} MiB,\n  one copy in the page cache shared by every process and run. "
        f"Inspect it: lmdbcache info {CACHE.relative_to(ROOT)}"
    )


if __name__ == "__main__":
    main()
