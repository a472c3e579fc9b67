"""Kept for pickles only: a ``CachedDataset`` pickled by lmdbcache 0.3 or earlier names ``lmdbcache._commit.Policy``.

The commit queue lives in ``lmdbcache.store._commit``; a dataset pickled now carries its policy
as a plain tuple (``CachedDataset.__getstate__``), so nothing new depends on this name.
"""

from __future__ import annotations

from .store._commit import Policy

__all__ = ["Policy"]
