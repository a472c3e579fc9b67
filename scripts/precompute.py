"""A runnable wrapper of ``lmdbcache precompute``: ``python scripts/precompute.py SPEC PATH [options]``."""

from __future__ import annotations

import sys

from lmdbcache.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["precompute", *sys.argv[1:]]))
