"""What gets shipped: the sdist carries the compiled core's C source (and no build output), and a wheel built from
that sdist is a platform wheel holding the compiled module. Offline (no build isolation, no dependencies fetched);
the checkout is not written to. `make native-pythons` builds the core on every declared CPython."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _run(*args: str, cwd: Path) -> None:
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist of this checkout (its egg-info written under a temporary directory, not into the checkout)."""
    out = tmp_path_factory.mktemp("sdist")
    _run("setup.py", "-q", "egg_info", "--egg-base", str(out), "sdist", "--dist-dir", str(out), cwd=ROOT)
    (archive,) = out.glob("lmdbcache-*.tar.gz")
    return archive


def test_sdist_holds_the_c_source_and_no_build_output(sdist: Path) -> None:
    """The sdist has _core.c, setup.py and pyproject.toml (what builds the core), and no compiled file."""
    with tarfile.open(sdist) as tar:
        names = [name.split("/", 1)[1] for name in tar.getnames() if "/" in name]
    assert {"lmdbcache/_native/_core.c", "lmdbcache/_native/_augment.c", "setup.py", "pyproject.toml"} <= set(names)
    assert "lmdbcache/_native/__init__.py" in names
    assert not [name for name in names if name.endswith((".so", ".pyd", ".o", ".dll", ".dylib"))]


def test_a_wheel_built_from_the_sdist_is_a_platform_wheel(sdist: Path, tmp_path: Path) -> None:
    """pip wheel on the unpacked sdist compiles the core: the wheel is tagged for this CPython and platform."""
    if importlib.util.find_spec("wheel") is None and importlib.util.find_spec("setuptools.command.bdist_wheel") is None:
        pytest.skip("this setuptools has no bdist_wheel (setuptools < 70.1 without the wheel package)")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.10.12+, 3.11.4+: without it 3.12+ warns (an error here)
            tar.extractall(tmp_path / "src", filter="data")
        else:
            tar.extractall(tmp_path / "src")
    (src,) = (tmp_path / "src").iterdir()
    _run("-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-q", "-w", str(tmp_path), str(src),
         cwd=tmp_path)  # fmt: skip
    (built,) = tmp_path.glob("lmdbcache-*.whl")
    _, _, python, abi, platform = built.stem.split("-")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert (python, abi) == (tag, tag)
    assert platform == sysconfig.get_platform().replace("-", "_").replace(".", "_") != "any"
    with zipfile.ZipFile(built) as whl:
        names = whl.namelist()
        wheel_meta = whl.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: false" in wheel_meta
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert f"lmdbcache/_native/_core{suffix}" in names
