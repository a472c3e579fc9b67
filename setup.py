"""Build the optional compiled core ``lmdbcache._native._core`` (everything else is in pyproject.toml).

``optional=True``: a machine without a C compiler (or Python headers) still installs the
package; ``lmdbcache._native`` then warns once and the pure-Python path is used.
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing"]
# `make native-asan` builds the same module with the sanitizers (see the Makefile).
_FLAGS += os.environ.get("LMDBCACHE_CFLAGS", "").split()

setup(
    ext_modules=[
        Extension(
            "lmdbcache._native._core",
            ["lmdbcache/_native/_core.c"],
            depends=["lmdbcache/_native/_augment.c"],  # included by _core.c
            optional=True,
            extra_compile_args=_FLAGS,
            extra_link_args=os.environ.get("LMDBCACHE_LDFLAGS", "").split(),
        )
    ]
)
