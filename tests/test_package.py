"""The package's face: `import lmdbcache` shows its public names only; its version has a CHANGELOG section."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lmdbcache

ROOT = Path(__file__).parent.parent


def test_dir_shows_only_the_public_names():
    """dir(lmdbcache) is __all__ (no Any, TYPE_CHECKING, annotations, importlib, submodules), each name reachable."""
    assert dir(lmdbcache) == sorted(lmdbcache.__all__)
    for name in lmdbcache.__all__:
        assert getattr(lmdbcache, name) is not None
    code = "import lmdbcache; print(' '.join(dir(lmdbcache)))"  # a fresh interpreter: nothing imported by tests
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           cwd=ROOT, check=True).stdout.split()  # fmt: skip
    assert fresh == sorted(lmdbcache.__all__)


def test_the_version_has_a_changelog_section():
    """lmdbcache.__version__ (what `info` says wrote a cache) has its own section in CHANGELOG.md."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(lmdbcache.__version__)}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M)
    assert lmdbcache.__version__ != "0.1.0"  # format 3 is not what 0.1.0 wrote
