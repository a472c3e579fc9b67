"""lmdbcache: decode each sample once, share it from LMDB's memory map with every process."""

from __future__ import annotations

from ._version import FORMAT_VERSION, __version__
from .dataset import CachedDataset, default_fingerprint
from .errors import (
    CacheFullError,
    CacheMismatchError,
    CorruptCacheError,
    CorruptSampleError,
    LmdbCacheError,
    NotACacheError,
    ReadersFullError,
    ReadOnlyCacheError,
    SampleNotCachedError,
    UnsupportedSampleError,
)
from .store import LmdbCacheWarning

__all__ = [
    "FORMAT_VERSION",
    "CacheFullError",
    "CacheMismatchError",
    "CachedDataset",
    "CorruptCacheError",
    "CorruptSampleError",
    "LmdbCacheError",
    "LmdbCacheWarning",
    "NotACacheError",
    "ReadOnlyCacheError",
    "ReadersFullError",
    "SampleNotCachedError",
    "UnsupportedSampleError",
    "__version__",
    "default_fingerprint",
]
