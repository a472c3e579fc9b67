"""Whole caches and the command line: precompute, verify, copy, merge, warm, info.

``_precompute`` builds a cache in parallel; ``_scan`` and ``_verify`` read a whole cache
(in a child process, so a file that crashes LMDB is reported); ``_ops`` holds copy, warm and
info, ``_merge`` merge; ``_spec`` loads a dataset from a ``module:callable`` spec;
``_progress`` the bar; ``cli`` the ``lmdbcache`` command (its parser in ``_parser``).

May import every other part (``loader`` excepted: no tool needs batches), ``dataset``,
``store``, ``format`` and the base modules; nothing imports it but ``lmdbcache/__init__``
(lazily) and ``__main__``. The names below are imported on first use (PEP 562), as the
package's own are: ``lmdbcache --version`` and ``lmdbcache info`` must not import torch.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from ._merge import MergeResult, merge
    from ._ops import CacheInfo, CopyResult, copy_cache, info, warm
    from ._ops import copy as copy  # the deprecated name, not in __all__
    from ._precompute import PrecomputeResult, precompute
    from ._verify import VerifyResult, verify

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

# The names imported on first use, and the module of each (``copy``: the deprecated name of
# ``copy_cache`` from lmdbcache 0.1, importable but not in __all__).
_LAZY = {
    "CacheInfo": "._ops",
    "CopyResult": "._ops",
    "MergeResult": "._merge",
    "PrecomputeResult": "._precompute",
    "VerifyResult": "._verify",
    "copy": "._ops",
    "copy_cache": "._ops",
    "info": "._ops",
    "merge": "._merge",
    "precompute": "._precompute",
    "verify": "._verify",
    "warm": "._ops",
}

if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(__all__)
