"""Fault-injection and stress tests: short under `make test`, long under `make stress`."""

from __future__ import annotations

import os

import pytest

STRESS = os.environ.get("LMDBCACHE_STRESS") == "1"


def scaled(short: int, long: int) -> int:
    """``long`` under `make stress` (LMDBCACHE_STRESS=1), else ``short``."""
    return long if STRESS else short


def pytest_collection_modifyitems(items):
    for item in items:
        if "stress" in str(item.fspath):
            item.add_marker(pytest.mark.timeout(1800 if STRESS else 300))
