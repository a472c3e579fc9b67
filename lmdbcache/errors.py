"""The exceptions lmdbcache raises.

Every error is built from one message string and pickles as ``type(exc)(message)``,
which is how the DataLoader re-raises an exception from a worker in the main process.
Each one also subclasses the builtin a caller would already catch::

    LmdbCacheError(Exception)
    ├── CacheMismatchError(ValueError)          stored length, fingerprint, format or build differ,
    │                                           a source that no longer matches, a rebuilt cache
    ├── NotACacheError(ValueError)              the path holds something that is not an lmdbcache cache
    ├── CorruptCacheError(OSError)              data.mdb or its metadata is truncated, damaged or unreadable
    ├── CorruptSampleError(ValueError)          a stored value fails its checksum or does not parse
    ├── SampleNotCachedError(LookupError)       a miss with no source dataset to fill it
    ├── UnsupportedSampleError(TypeError)       a sample (or part of one) the codec cannot store
    ├── ReadOnlyCacheError(PermissionError)     a write to a cache opened read-only
    ├── CacheFullError(OSError)                 the disk (not the map: that grows) is full
    ├── ReadersFullError(RuntimeError)          LMDB's reader table is exhausted
    ├── CacheClosedError(RuntimeError)          a read or write that ran while another thread closed the cache
    ├── InvalidOptionError(ValueError)          an argument or option out of its valid range
    ├── SpecError(ValueError)                   a precompute SPEC that does not give a dataset
    ├── NondeterministicDatasetError(ValueError) the source returned two different samples for one index
    ├── SourceItemError(RuntimeError)           the source raised while precompute read an index
    ├── StrayStopIterationError(RuntimeError)   a dataset or transform raised StopIteration inside a Loader pass
    └── MissingExtraError(ImportError)          a compressed cache, and the extra that reads it is not installed;
                                                a cache LMDB 1.0 wrote, and py-lmdb has no 1.0 engine (< 3.0)

``LmdbCacheWarning(UserWarning)`` is for situations that work but deserve attention
(a cache on a network filesystem, an option that cannot be honoured).

``SampleNotCachedError`` is a ``LookupError`` but deliberately not an ``IndexError``:
``for x in ds`` stops at the first ``IndexError``, so a miss must never look like one.
"""

from __future__ import annotations

__all__ = [
    "CacheClosedError",
    "CacheFullError",
    "CacheMismatchError",
    "CorruptCacheError",
    "CorruptSampleError",
    "InvalidOptionError",
    "LmdbCacheError",
    "LmdbCacheWarning",
    "MissingExtraError",
    "NondeterministicDatasetError",
    "NotACacheError",
    "ReadOnlyCacheError",
    "ReadersFullError",
    "SampleNotCachedError",
    "SourceItemError",
    "SpecError",
    "StrayStopIterationError",
    "UnsupportedSampleError",
]


class LmdbCacheError(Exception):
    """Base class of every error lmdbcache raises itself."""


class CacheMismatchError(LmdbCacheError, ValueError):
    """The cache was built for another dataset (length, fingerprint, content) or format, or rebuilt since."""


class NotACacheError(LmdbCacheError, ValueError):
    """The path is a file, or a directory or LMDB environment that lmdbcache did not create."""


class CorruptCacheError(LmdbCacheError, OSError):
    """The LMDB files or the metadata record are damaged: empty, truncated, or not readable."""


class CorruptSampleError(LmdbCacheError, ValueError):
    """A stored value does not match its checksum or is malformed; it is never returned."""


class SampleNotCachedError(LmdbCacheError, LookupError):
    """An index is not cached and there is no source dataset to decode it from."""


class UnsupportedSampleError(LmdbCacheError, TypeError):
    """A sample holds a value of a type the codec cannot round-trip exactly."""


class ReadOnlyCacheError(LmdbCacheError, PermissionError):
    """A write was needed but the cache can only be read (read-only directory or mount)."""


class CacheFullError(LmdbCacheError, OSError):
    """The filesystem holding the cache is out of space."""


class ReadersFullError(LmdbCacheError, RuntimeError):
    """LMDB's table of concurrent readers is full, even after clearing dead processes."""


class CacheClosedError(LmdbCacheError, RuntimeError):
    """A read or write that was running while another thread closed the cache (``close()``); use it again."""


class InvalidOptionError(LmdbCacheError, ValueError):
    """An argument or option is outside its valid range (a negative size, an unknown mode)."""


class SpecError(LmdbCacheError, ValueError):
    """A precompute SPEC that does not import, is not callable, or does not return a dataset."""


class NondeterministicDatasetError(LmdbCacheError, ValueError):
    """The wrapped dataset returned different samples for the same index on two calls."""


class SourceItemError(LmdbCacheError, RuntimeError):
    """The wrapped dataset raised while precompute was reading one index (what was written is kept)."""


class StrayStopIterationError(LmdbCacheError, RuntimeError):
    """A dataset, ``transform`` or ``batch_transform`` raised ``StopIteration`` while a ``Loader`` built a batch.

    Left as it is, it would end the consumer's ``for`` loop early or become Python's bare
    "generator raised StopIteration"; this error names the index or batch instead, and the
    original is its ``__cause__``.
    """


class MissingExtraError(LmdbCacheError, ImportError):
    """A cache needs a module that is missing: its codec's (``pip install 'lmdbcache[zstd]'``), or a py-lmdb that
    bundles LMDB 1.0 (3.0 or later) for a cache LMDB 1.0 wrote."""


class LmdbCacheWarning(UserWarning):
    """A situation that works but that the user should know about (e.g. a network filesystem)."""


def add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` where Python has it (3.11+): where an error came from, for the traceback."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)


def warn(message: str, category: type[Warning] = LmdbCacheWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside lmdbcache: the user's line.

    The same warning is reached through calls of different depths (``Loader(...)`` or ``ds.loader(...)``; a
    ``CachedDataset`` created by the user or by ``precompute``); a fixed stacklevel named ``dataset.py:189`` for
    the reboot warning. Python 3.12's ``skip_file_prefixes`` does this.
    """
    import inspect  # only when warning: not at import time
    import os
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = inspect.currentframe(), 1  # level 1: this function, which calls warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
