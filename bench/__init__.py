"""Benchmarks for lmdbcache: ``python -m bench.core`` (read path and fill) and ``make bench``."""
