"""``python -m lmdbcache`` (and ``torchrun -m lmdbcache precompute ...``)."""

from __future__ import annotations

import sys

from .tools.cli import main

sys.exit(main())
