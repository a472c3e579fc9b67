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
    LmdbCacheWarning,
    NotACacheError,
    ReadersFullError,
    ReadOnlyCacheError,
    SampleNotCachedError,
    UnsupportedSampleError,
)
from .precompute import NondeterministicDatasetError, PrecomputeResult, SourceItemError, precompute

__all__ = [
    "FORMAT_VERSION",
    "CacheFullError",
    "CacheMismatchError",
    "CachedDataset",
    "CorruptCacheError",
    "CorruptSampleError",
    "LmdbCacheError",
    "LmdbCacheWarning",
    "NondeterministicDatasetError",
    "NotACacheError",
    "PrecomputeResult",
    "ReadOnlyCacheError",
    "ReadersFullError",
    "SampleNotCachedError",
    "SourceItemError",
    "UnsupportedSampleError",
    "__version__",
    "default_fingerprint",
    "precompute",
]
