"""Cold scans with and without readahead: ``tools.verify`` and ``tools.copy_cache`` (issue 14).

    python -m bench.scan [--reps 3] [--dir DIR]

Builds one cache of 1,500 3x224x224 uint8 samples and one of 40,000 3x32x32 under ``--dir``
(default: a temporary directory beside this checkout, so on the same disk as a real cache),
then, per repetition and interleaved, evicts data.mdb from the page cache
(``posix_fadvise(DONTNEED)``) before each timed verify and copy, once with
``Store.reading_ahead`` as shipped (``MADV_SEQUENTIAL`` for the scan) and once with it
replaced by a no-op (LMDB's random-read advice throughout). Prints medians (seconds, MiB/s
of data.mdb).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.transform import Images
from lmdbcache import CachedDataset, tools
from lmdbcache.store import Store


def evict(path: str) -> None:
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def no_readahead(self: Any) -> Iterator[None]:
    yield


def timed(action: Any) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent))
    args = parser.parse_args()
    shipped = Store.reading_ahead
    for n, shape in ((1500, (3, 224, 224)), (40000, (3, 32, 32))):
        root = tempfile.mkdtemp(prefix=".bench-scan-", dir=args.dir)
        try:
            path, copy = f"{root}/cache", f"{root}/copy"
            CachedDataset(Images(n, shape), path).__getitems__(list(range(n)))
            os.sync()
            times: dict[str, dict[str, list[float]]] = {m: {"verify": [], "copy": []} for m in ("random", "readahead")}
            for _ in range(args.reps):
                for mode, runs in times.items():
                    Store.reading_ahead = shipped if mode == "readahead" else no_readahead  # type: ignore[method-assign]
                    evict(path)
                    runs["verify"].append(timed(lambda p=path: tools.verify(p)))
                    evict(path)
                    shutil.rmtree(copy, ignore_errors=True)
                    runs["copy"].append(timed(lambda p=path, c=copy: tools.copy_cache(p, c)))
            Store.reading_ahead = shipped  # type: ignore[method-assign]
            mib = os.path.getsize(f"{path}/data.mdb") / 2**20
            for mode, runs in times.items():
                cells = ", ".join(
                    f"{what} {statistics.median(t):.2f} s ({mib / statistics.median(t):.0f} MiB/s)"
                    for what, t in runs.items()
                )
                print(f"{n} x {'x'.join(map(str, shape))} ({mib:.0f} MiB), {mode:>9}: {cells}")
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
