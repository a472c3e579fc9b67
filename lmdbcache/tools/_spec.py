"""precompute's SPEC: import ``package.module:callable`` or ``path/to/file.py:callable`` and call it."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import SpecError

__all__ = ["load_spec", "parse_args_kv"]


def load_spec(spec: str, kwargs: dict[str, Any]) -> Any:
    """Import ``module:callable`` or ``file.py:callable`` and call it with ``kwargs``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise SpecError(f"SPEC '{spec}' must be package.module:callable or path/to/file.py:callable.")
    try:
        if target.endswith(".py") or os.sep in target:
            path = os.path.abspath(target)
            if not os.path.isfile(path):
                raise SpecError(f"SPEC file '{target}' does not exist.")
            # Importable by its stem from its directory, so spawn workers can unpickle what it defines.
            sys.path.insert(0, os.path.dirname(path))
            module_name = os.path.splitext(os.path.basename(path))[0]
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"Cannot import '{target}' from SPEC '{spec}': {type(exc).__name__}: {exc}") from exc
    factory: Any = module
    for part in name.split("."):
        if not hasattr(factory, part):
            raise SpecError(f"'{target}' has no attribute '{name}' (SPEC '{spec}').")
        factory = getattr(factory, part)
    if not callable(factory):
        raise SpecError(f"'{spec}' is a {type(factory).__name__}, not a callable that returns a dataset.")
    try:
        dataset = factory(**kwargs)
    except Exception as exc:
        raise SpecError(f"Calling '{spec}' with {kwargs} failed: {type(exc).__name__}: {exc}") from exc
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise SpecError(
            f"'{spec}' returned a {type(dataset).__name__}, not a map-style dataset (__len__ and __getitem__)."
        )
    return dataset


def parse_args_kv(items: Sequence[str]) -> dict[str, Any]:
    """``--arg`` values: ``key=value`` pairs, each value parsed as JSON where it parses, else a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--arg '{item}' must look like key=value.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
