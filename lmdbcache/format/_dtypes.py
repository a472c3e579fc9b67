"""numpy dtypes in the value format (see ``codec``): dtype strings and descriptions, both ways.

The writer describes a dtype and checks that the description rebuilds it exactly; the reader
rebuilds a dtype only from pieces it checked first, so that nothing read from a value reaches
numpy unchecked.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import CorruptSampleError
from ._format import MAX_DTYPE_DEPTH, MAX_DTYPE_SIZE, MAX_NDIM, SPECS_MAX, Unsupported, shape_problem, typename

# The only dtype strings a value may name (see the format). Everything else, "|O" and
# "T" (StringDType) included, is refused before numpy sees it.
PLAIN_DTYPE = re.compile(
    r"[<>|=]?(?:b1|[iu][1248]|f(?:2|4|8|16)|c(?:8|16|32)|[SUV][0-9]{1,10}"
    r"|[mM]8(?:\[[0-9]{0,10}(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?)"
)

_PLAIN_DTYPES: dict[str, np.dtype] = {}


def plain_dtype(s: Any) -> np.dtype:
    """The numpy dtype a dtype string names, after checking it against ``PLAIN_DTYPE``."""
    dtype = _PLAIN_DTYPES.get(s) if type(s) is str else None
    if dtype is not None:
        return dtype
    if type(s) is not str or not PLAIN_DTYPE.fullmatch(s):
        raise CorruptSampleError(f"dtype {s!r} is not a plain fixed-size numpy dtype")
    dtype = np.dtype(s)
    if dtype.hasobject or dtype.names is not None or dtype.subdtype is not None or dtype.kind not in "biufcSUVmM":
        raise CorruptSampleError(f"dtype {s!r} is not a plain fixed-size numpy dtype")  # pragma: no cover
    if len(_PLAIN_DTYPES) >= SPECS_MAX:
        _PLAIN_DTYPES.clear()
    _PLAIN_DTYPES[s] = dtype
    return dtype


def int_tuple(value: Any, what: str) -> tuple[int, ...]:
    """A shape read from a value: a list of at most ``MAX_NDIM`` ints."""
    if type(value) is not list or len(value) > MAX_NDIM or not all(type(n) is int for n in value):
        raise CorruptSampleError(f"the {what} is not a list of at most {MAX_NDIM} integers")
    return tuple(value)


_STRUCT_KEYS = frozenset(["names", "formats", "offsets", "titles", "itemsize", "aligned"])
_SUBARRAY_KEYS = frozenset(["base", "shape"])


def build_dtype(desc: Any, depth: int = 0) -> np.dtype:
    """The numpy dtype of a dtype description (see the format), built from checked pieces only."""
    if type(desc) is str:
        return plain_dtype(desc)
    if depth >= MAX_DTYPE_DEPTH or type(desc) is not dict:
        raise CorruptSampleError("a malformed or too deeply nested structured dtype")
    keys = desc.keys()
    if keys == _SUBARRAY_KEYS:
        shape = int_tuple(desc["shape"], "subarray shape")
        base = build_dtype(desc["base"], depth + 1)
        if not shape or shape_problem(shape, base.itemsize):
            raise CorruptSampleError(f"a subarray field of shape {shape}")
        return np.dtype((base, shape))
    if keys != _STRUCT_KEYS:
        raise CorruptSampleError("a structured dtype with unexpected keys")
    if not _struct_pieces_ok(desc):
        raise CorruptSampleError("a malformed structured dtype")
    names, offsets, titles, itemsize = desc["names"], desc["offsets"], desc["titles"], desc["itemsize"]
    built = [build_dtype(fmt, depth + 1) for fmt in desc["formats"]]
    if any(off + fmt.itemsize > itemsize for off, fmt in zip(offsets, built)):
        raise CorruptSampleError("a structured dtype whose fields run past its itemsize")
    spec: Any = {"names": names, "formats": built, "offsets": offsets, "itemsize": itemsize}  # numpy's dict form
    if titles is not None:
        spec["titles"] = titles
    dtype: np.dtype = np.dtype(spec, align=desc["aligned"])
    return dtype


def _struct_pieces_ok(desc: dict[str, Any]) -> bool:
    """Whether a structured dtype description's pieces have the types and counts of the format."""
    names, formats, offsets = desc["names"], desc["formats"], desc["offsets"]
    titles, itemsize, aligned = desc["titles"], desc["itemsize"], desc["aligned"]
    n = len(names) if type(names) is list else -1
    return (
        n >= 0
        and all(type(name) is str for name in names)
        and type(formats) is list
        and len(formats) == n
        and type(offsets) is list
        and len(offsets) == n
        and all(type(off) is int and 0 <= off <= MAX_DTYPE_SIZE for off in offsets)
        and (titles is None or (type(titles) is list and len(titles) == n))
        and all(title is None or type(title) is str for title in titles or ())
        and type(itemsize) is int
        and 0 <= itemsize <= MAX_DTYPE_SIZE
        and type(aligned) is bool
    )


def v1_dtype(descr: Any, depth: int = 0) -> np.dtype:
    """The dtype of a format-1 ``dtype.descr`` list, as 0.1.0 built it, from checked pieces."""
    if depth >= MAX_DTYPE_DEPTH or type(descr) is not list:
        raise CorruptSampleError("a malformed format-1 structured dtype")
    fields: list[tuple[Any, ...]] = []
    for entry in descr:
        if type(entry) is not list or not 2 <= len(entry) <= 3 or type(entry[0]) is not str:
            raise CorruptSampleError("a malformed format-1 structured dtype field")
        fmt = entry[1]
        base = plain_dtype(fmt) if type(fmt) is str else v1_dtype(fmt, depth + 1)
        if len(entry) == 2:
            fields.append((entry[0], base))
        else:
            shape = int_tuple(entry[2], "subarray shape")
            if shape_problem(shape, base.itemsize):
                raise CorruptSampleError(f"a format-1 subarray field of shape {shape}")
            fields.append((entry[0], base, shape))
    return np.dtype(fields)


def same_dtype(a: np.dtype, b: np.dtype) -> bool:
    """Whether two dtypes agree on everything the format promises to keep."""
    if (
        a != b
        or type(a) is not type(b)
        or a.type is not b.type
        or a.itemsize != b.itemsize
        or a.isalignedstruct != b.isalignedstruct
        or a.metadata is not None
        or b.metadata is not None
    ):
        return False
    if a.subdtype is not None or b.subdtype is not None:
        return (
            a.subdtype is not None
            and b.subdtype is not None
            and a.subdtype[1] == b.subdtype[1]
            and same_dtype(a.subdtype[0], b.subdtype[0])
        )
    if a.names is None or b.names is None:
        return a.names is None and b.names is None and a.str == b.str
    if a.names != b.names:
        return False
    fields_a: Any = a.fields
    fields_b: Any = b.fields
    for name in a.names:
        fa, fb = fields_a[name], fields_b[name]
        if fa[1:] != fb[1:] or not same_dtype(fa[0], fb[0]):
            return False
    return True


_PLAIN_STRS: dict[tuple[Any, ...], str | None] = {}


def plain_str(dtype: np.dtype) -> str | None:
    """The dtype string of a plain fixed-size dtype, or None if it is not one."""
    if dtype.metadata is not None or dtype.names is not None or dtype.subdtype is not None:
        return None
    key = (dtype, dtype.type, type(dtype))  # equal dtypes may differ in scalar type or class
    if key in _PLAIN_STRS:
        return _PLAIN_STRS[key]
    s: str | None = dtype.str
    try:
        if not same_dtype(plain_dtype(s), dtype):
            s = None
    except CorruptSampleError:
        s = None
    if len(_PLAIN_STRS) >= SPECS_MAX:
        _PLAIN_STRS.clear()
    _PLAIN_STRS[key] = s
    return s


def refusal(dtype: np.dtype, where: str = "") -> str:
    """Why a dtype cannot be written, and what to do instead."""
    what = f"numpy dtype {dtype}" + (f" (field {where})" if where else "")
    if dtype.kind == "T":
        return f"{what} is numpy's variable-length StringDType; convert it with .astype('U')"
    if dtype.hasobject:
        return f"{what} holds Python objects; convert it to a numeric dtype"
    if dtype.metadata is not None:
        return f"{what} carries metadata, which cannot be stored; drop it"
    return f"{what} is not a plain fixed-size numpy dtype"


def describe_dtype(dtype: np.dtype, where: str = "", depth: int = 0) -> Any:
    """The dtype description of the format (code 8); raises ``Unsupported``."""
    if depth >= MAX_DTYPE_DEPTH:
        raise Unsupported(f"a structured dtype nested over {MAX_DTYPE_DEPTH} deep (field {where})")
    if dtype.metadata is not None:
        raise Unsupported(refusal(dtype, where))
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return {"base": describe_dtype(base, where, depth + 1), "shape": list(shape)}
    if dtype.names is None:
        s = plain_str(dtype)
        if s is None:
            raise Unsupported(refusal(dtype, where))
        return s
    formats, offsets, titles = [], [], []
    fields: Any = dtype.fields
    for name in dtype.names:
        fmt, offset, *title = fields[name]  # (dtype, offset) or (dtype, offset, title)
        title = title[0] if title else None
        if title is not None and type(title) is not str:
            raise Unsupported(f"numpy dtype field {where}[{name!r}] has a title of type {typename(title)}, not str")
        formats.append(describe_dtype(fmt, f"{where}[{name!r}]", depth + 1))
        offsets.append(offset)
        titles.append(title)
    return {
        "names": list(dtype.names),
        "formats": formats,
        "offsets": offsets,
        "titles": titles if any(t is not None for t in titles) else None,
        "itemsize": dtype.itemsize,
        "aligned": dtype.isalignedstruct,
    }
