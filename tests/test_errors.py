"""errors.py: every library error pickles and rebuilds from one string, as the DataLoader re-raises it."""

from __future__ import annotations

import pickle

import lmdbcache


def test_errors_pickle_as_the_dataloader_rebuilds_them():
    """Every library error survives type(exc)(message), which is how worker exceptions reach the main process."""
    for name in lmdbcache.__all__:
        cls = getattr(lmdbcache, name)
        if isinstance(cls, type) and issubclass(cls, lmdbcache.LmdbCacheError):
            exc = cls("what, where and how to fix")
            again = pickle.loads(pickle.dumps(exc))
            assert type(again) is cls and str(again) == str(exc) == str(type(exc)(str(exc)))
            assert isinstance(again, lmdbcache.LmdbCacheError)
