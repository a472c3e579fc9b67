"""Options as users type them: sizes such as ``"64MiB"``, and one clear error per bad option.

Checked before anything is opened, so a bad option never leaves a half-open cache behind.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import InvalidOptionError

__all__ = ["MIB", "check_options", "parse_size"]

MIB = 1 << 20
# The largest pack size K a cache may ask for: K x the largest packed value (16 KiB) stays far
# below LMDB's 4 GiB value limit. format/_pack.py builds on it; the option is checked here.
MAX_PACK = 4096

_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
               "T": 1000**4, "TB": 1000**4, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip


def parse_size(value: Any, name: str = "map_size", minimum: int = 1) -> int:
    """A byte count from an int or a string such as ``"64MiB"``, ``"1GB"``, ``"512 M"``; InvalidOptionError if not."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise InvalidOptionError(
                f"{name}={value!r} is not a size: pass bytes as an int, or a string such as '64MiB', '1GB' or '512M'."
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if type(value) is not int or value <= 0:
        raise InvalidOptionError(
            f"{name} must be a positive number of bytes (or a string such as '1GiB'), not {value!r}."
        )
    if value < minimum:
        raise InvalidOptionError(f"{name} must be at least {minimum:,} bytes, not {value:,}.")
    return value


def check_options(
    *,
    map_size: Any,
    max_readers: Any,
    commit_every: Any,
    commit_bytes: Any,
    commit_interval: Any,
    checksum: Any,
    fingerprint: Any = None,
    pack: Any = 0,
) -> None:
    """Refuse out-of-range options with one clear error each (before anything is opened)."""
    if type(pack) is not int or not 0 <= pack <= MAX_PACK:
        raise InvalidOptionError(
            f"pack must be an integer from 0 (no packs) to {MAX_PACK} (samples per packed record), not {pack!r}."
        )
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
        raise InvalidOptionError(
            f"fingerprint must be a non-empty string (or None for the default), not {fingerprint!r}."
        )
    parse_size(map_size, "map_size", MIB)  # LMDB needs a few pages before the map can grow
    for name, value in (("max_readers", max_readers), ("commit_every", commit_every)):
        if type(value) is not int or value < 1:
            raise InvalidOptionError(f"{name} must be an integer >= 1, not {value!r}.")
    if max_readers > 1 << 20:
        raise InvalidOptionError(f"max_readers must be at most {1 << 20}, not {max_readers}.")
    parse_size(commit_bytes, "commit_bytes")
    if (
        isinstance(commit_interval, bool)
        or not isinstance(commit_interval, (int, float))
        or not (0 < commit_interval < float("inf"))
    ):
        raise InvalidOptionError(f"commit_interval must be a number of seconds > 0, not {commit_interval!r}.")
    if checksum not in ("once", "always"):
        raise InvalidOptionError(f"checksum must be 'once' or 'always', not {checksum!r}.")
