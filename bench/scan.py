"""Cold scans (verify, copy, merge source) with and without readahead: python /tmp/wk/scan.py"""
import os, sys, time, tempfile, statistics, shutil
import torch
from lmdbcache import CachedDataset, tools
from lmdbcache.store import Store
import lmdbcache.store as st

class Imgs(torch.utils.data.Dataset):
    def __len__(s): return 1500
    def __getitem__(s, i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 255, (3, 224, 224), dtype=torch.uint8, generator=g), i

def evict(path):
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    os.fsync(fd) if False else None
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)

root = tempfile.mkdtemp(dir="/work")  # on the real disk
path = root + "/c"
ds = CachedDataset(Imgs(), path); ds.__getitems__(list(range(1500))); ds.close()
os.sync()
real = st.Store.reading_ahead
import contextlib
@contextlib.contextmanager
def none(self): yield
res = {"off": {"verify": [], "copy": []}, "on": {"verify": [], "copy": []}}
for rep in range(3):
    for mode in ("off", "on"):
        st.Store.reading_ahead = none if mode == "off" else real
        evict(path); t = time.perf_counter(); r = tools.verify(path, spot_check=0) if False else tools.verify(path); res[mode]["verify"].append(time.perf_counter() - t)
        evict(path); dst = root + "/copy"; shutil.rmtree(dst, ignore_errors=True)
        t = time.perf_counter(); tools.copy_cache(path, dst); res[mode]["copy"].append(time.perf_counter() - t)
size = os.path.getsize(path + "/data.mdb") / 2**20
for mode in res:
    print(mode, {k: f"{statistics.median(v):.2f}s ({size/statistics.median(v):.0f} MiB/s)" for k, v in res[mode].items()})
shutil.rmtree(root)
