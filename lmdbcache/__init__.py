"""lmdbcache: decode each sample once, share it from LMDB's memory map with every process."""

from __future__ import annotations

from ._version import FORMAT_VERSION, __version__
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

__all__ = [
    "FORMAT_VERSION",
    "CacheFullError",
    "CacheMismatchError",
    "CorruptCacheError",
    "CorruptSampleError",
    "LmdbCacheError",
    "NotACacheError",
    "ReadOnlyCacheError",
    "ReadersFullError",
    "SampleNotCachedError",
    "UnsupportedSampleError",
    "__version__",
]
