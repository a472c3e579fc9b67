"""Write tests/data/golden-v<FORMAT_VERSION>: a tiny cache that later versions must keep reading.

Run only when the format changes (and then add a new golden directory; never rewrite an old one):
    python tests/data/make_golden.py

``golden_samples(version)`` is what each golden cache holds; the tests that read them import it
from here. This script imports the library and nothing from the tests.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).parent


def golden_samples(version: int | str = 1) -> list[Any]:
    """The samples stored in tests/data/golden-v<version> (``"3-zstd"``: the zstd-compressed format-3 cache)."""
    if version == "3-zstd":
        ramp = np.arange(4096, dtype="<u2") // 16
        return [
            *golden_samples(2),
            (torch.arange(8192, dtype=torch.int64) % 7, 1),  # flat, one compressed buffer
            {"mask": ramp.reshape(64, 64), "raw": np.arange(10, dtype="<i8"), "t": [torch.zeros(2048)]},
        ]
    if version == "4-lmdb-1.0":  # written by LMDB 1.0 (its page layout): packs of 2 (odd keys), an overflow value
        return [*golden_samples(2), (torch.arange(3000, dtype=torch.int64) * 7 % 1000, 8)]
    if version in (3, 4):
        # golden-v3 is packed (pack=2), golden-v4 grouped (one commit: one group, a pointer per index):
        # the layout changed, not what a value holds
        return golden_samples(2)
    if isinstance(version, int) and version >= 2:
        padded = np.dtype({"names": ["a", "b"], "formats": ["<u1", "<f8"], "offsets": [0, 8], "itemsize": 24})
        records = np.zeros(2, dtype=padded)  # zeros: the padding bytes are stored too
        records["a"], records["b"] = [1, 3], [2.5, -1.0]
        return [
            *golden_samples(1),
            records,
            {"big": 10**40, "neg": -(2**100), "deep": [[[(1,)]]]},
            (torch.arange(6, dtype=torch.int16).reshape(2, 3).t(), np.float16(1.5), True),
        ]
    return [
        (torch.arange(12, dtype=torch.uint8).reshape(3, 2, 2), 7),
        {
            "x": np.arange(6, dtype="<f4").reshape(2, 3),
            "tokens": [torch.tensor([1, 2, 3]), torch.tensor([4])],
            "id": "a",
        },
        [None, True, 2**70, -1.5, b"raw", ("t", 1)],
        (np.float32(0.5), torch.tensor(3.0, dtype=torch.bfloat16)),
    ]


def write_golden(out: Path, version: int | str, compress: str | None = None) -> None:
    """Fill a new cache at ``out`` with ``golden_samples(version)`` and keep only its data file."""
    import lmdbcache

    samples = golden_samples(version)  # a list is a map-style dataset
    # golden-v3 and the LMDB 1.0 golden: packs of 2 (the last chunk holds one sample)
    pack = {"pack": 2} if version in (3, "4-lmdb-1.0") else {}
    with lmdbcache.CachedDataset(samples, out, fingerprint="golden", map_size=1 << 20, compress=compress, **pack) as ds:
        ds.__getitems__(list(range(len(ds))))
    for name in ("lock.mdb", "lmdbcache.lock"):
        (out / name).unlink(missing_ok=True)
    shutil.copy(out / "data.mdb", out / "data.mdb.tmp")
    (out / "data.mdb.tmp").replace(out / "data.mdb")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))  # this checkout's lmdbcache, installed or not
    from lmdbcache import FORMAT_VERSION

    if sys.argv[1:] == ["lmdb-1.0"]:  # LMDB_DEFAULT_LIB_VERSION=1 python tests/data/make_golden.py lmdb-1.0
        import lmdb

        target = HERE / "golden-v4-lmdb-1.0"
        if lmdb.version()[:2] != (1, 0) or target.exists():
            sys.exit(f"needs py-lmdb 3 with LMDB_DEFAULT_LIB_VERSION=1, and no {target} (never rewritten)")
        write_golden(target, "4-lmdb-1.0")
        sys.exit(f"wrote {target}")

    target = HERE / f"golden-v{FORMAT_VERSION}"
    if target.exists():
        sys.exit(f"{target} exists: golden caches are never rewritten")
    write_golden(target, FORMAT_VERSION)
    print(f"wrote {target}")
    zstd = HERE / f"golden-v{FORMAT_VERSION}-zstd"  # compressed values: format 3's (format 4 wrote none new)
    if FORMAT_VERSION == 3 and not zstd.exists():
        write_golden(zstd, f"{FORMAT_VERSION}-zstd", compress="zstd")
        print(f"wrote {zstd}")
