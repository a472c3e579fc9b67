"""Write tests/data/golden-v<FORMAT_VERSION>: a tiny cache that later versions must keep reading.

Run only when the format changes (and then add a new golden directory; never rewrite an old one):
    python tests/data/make_golden.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

from helpers import Listed  # noqa: E402
from test_store import golden_samples  # noqa: E402

import lmdbcache  # noqa: E402

out = HERE / f"golden-v{lmdbcache.FORMAT_VERSION}"
if out.exists():
    sys.exit(f"{out} exists: golden caches are never rewritten")
samples = golden_samples(lmdbcache.FORMAT_VERSION)
with lmdbcache.CachedDataset(Listed(samples), out, fingerprint="golden", map_size=1 << 20) as ds:
    ds.__getitems__(list(range(len(ds))))
for name in ("lock.mdb", "lmdbcache.lock"):
    (out / name).unlink(missing_ok=True)
shutil.copy(out / "data.mdb", out / "data.mdb.tmp")
(out / "data.mdb.tmp").replace(out / "data.mdb")
print(f"wrote {out}")
