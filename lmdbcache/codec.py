"""``lmdbcache.codec``, as lmdbcache 0.1-0.3 spelled it: the value codec now lives in ``lmdbcache.format.codec``."""

from __future__ import annotations

from .format.codec import *  # noqa: F403
from .format.codec import __all__ as __all__
