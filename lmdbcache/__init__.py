"""lmdbcache: decode each sample once, share it from LMDB's memory map with every process."""

from __future__ import annotations

from ._precompute import PrecomputeResult, precompute
from ._version import FORMAT_VERSION, __version__
from .dataset import CachedDataset, default_fingerprint
from .errors import (
    CacheFullError,
    CacheMismatchError,
    CorruptCacheError,
    CorruptSampleError,
    InvalidOptionError,
    LmdbCacheError,
    LmdbCacheWarning,
    NondeterministicDatasetError,
    NotACacheError,
    ReadersFullError,
    ReadOnlyCacheError,
    SampleNotCachedError,
    SourceItemError,
    SpecError,
    UnsupportedSampleError,
)

__all__ = [
    "FORMAT_VERSION",
    "CacheFullError",
    "CacheMismatchError",
    "CachedDataset",
    "CorruptCacheError",
    "CorruptSampleError",
    "InvalidOptionError",
    "LmdbCacheError",
    "LmdbCacheWarning",
    "NondeterministicDatasetError",
    "NotACacheError",
    "PrecomputeResult",
    "ReadOnlyCacheError",
    "ReadersFullError",
    "SampleNotCachedError",
    "SourceItemError",
    "SpecError",
    "UnsupportedSampleError",
    "__version__",
    "default_fingerprint",
    "precompute",
]
