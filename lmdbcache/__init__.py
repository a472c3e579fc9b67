"""lmdbcache: decode each sample once, share it from LMDB's memory map with every process.

``CachedDataset``, ``default_fingerprint``, ``Loader``, ``collate``, ``precompute`` and
``PrecomputeResult`` are imported on first use (PEP 562): they need torch, which takes seconds
to import, and the CLI's commands on an existing cache (``lmdbcache info``, ``--version``) do not.
"""

# No ``from __future__ import annotations`` and no module-level imports but the public names:
# each would be an attribute of the package (``lmdbcache.annotations``, ``lmdbcache.Any``).
import typing as _typing

from ._version import FORMAT_VERSION, __version__
from .errors import (
    CacheClosedError,
    CacheFullError,
    CacheMismatchError,
    CorruptCacheError,
    CorruptSampleError,
    InvalidOptionError,
    LmdbCacheError,
    LmdbCacheWarning,
    MissingExtraError,
    NondeterministicDatasetError,
    NotACacheError,
    ReadersFullError,
    ReadOnlyCacheError,
    SampleNotCachedError,
    SourceItemError,
    SpecError,
    StrayStopIterationError,
    UnsupportedSampleError,
)

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports them
    from .dataset import CachedDataset, default_fingerprint
    from .loader import Loader, collate
    from .tools import PrecomputeResult, precompute

__all__ = [
    "FORMAT_VERSION",
    "CacheClosedError",
    "CacheFullError",
    "CacheMismatchError",
    "CachedDataset",
    "CorruptCacheError",
    "CorruptSampleError",
    "InvalidOptionError",
    "LmdbCacheError",
    "LmdbCacheWarning",
    "Loader",
    "MissingExtraError",
    "NondeterministicDatasetError",
    "NotACacheError",
    "PrecomputeResult",
    "ReadOnlyCacheError",
    "ReadersFullError",
    "SampleNotCachedError",
    "SourceItemError",
    "SpecError",
    "StrayStopIterationError",
    "UnsupportedSampleError",
    "__version__",
    "collate",
    "default_fingerprint",
    "precompute",
]

# The names imported on first use, and the module of each.
_LAZY = {
    "CachedDataset": ".dataset",
    "Loader": ".loader",
    "PrecomputeResult": ".tools",
    "collate": ".loader",
    "default_fingerprint": ".dataset",
    "precompute": ".tools",
}


if not _typing.TYPE_CHECKING:  # hidden from type checkers, which would otherwise accept any name as Any

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups find it without coming here
        return value


def __dir__() -> list[str]:
    """The public names only (``__all__``): not the submodules, nor what this file imports to work."""
    return sorted(__all__)
