"""Whole caches and the command line: precompute, verify, copy, merge, warm, info.

``_precompute`` builds a cache in parallel; ``_scan`` and ``_verify`` read a whole cache
(in a child process, so a file that crashes LMDB is reported); ``_ops`` holds copy, warm and
info, ``_merge`` merge; ``_spec`` loads a dataset from a ``module:callable`` spec; ``_progress`` the
bar; ``cli`` the ``lmdbcache`` command.

May import every other part (``loader`` excepted: no tool needs batches), ``dataset``,
``store``, ``format`` and the base modules; nothing imports it but ``lmdbcache/__init__``
(lazily) and ``__main__``.
"""

from __future__ import annotations

from ._merge import MergeResult, merge
from ._ops import CacheInfo, CopyResult, VerifyResult, copy, copy_cache, info, verify, warm
from ._precompute import PrecomputeResult, precompute

__all__ = [
    "CacheInfo",
    "CopyResult",
    "MergeResult",
    "PrecomputeResult",
    "VerifyResult",
    "copy_cache",
    "info",
    "merge",
    "precompute",
    "verify",
    "warm",
]
# ``copy``: the deprecated name of ``copy_cache`` (lmdbcache 0.1), importable but not in __all__.
_ = copy
