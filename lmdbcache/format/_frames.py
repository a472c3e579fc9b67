"""The frames of a compressed value (see ``codec``, "Compressed values"): their layout, their bounds, reading one.

Shared by the writer (``_compress``) and the reader (``_decode``). ``lz4`` and ``zstandard``
are optional extras, imported on first use: ``require`` names the extra to install when one
is missing.
"""

from __future__ import annotations

import functools
import importlib
import struct
import threading
from types import ModuleType
from typing import Any

from ..errors import CorruptSampleError, MissingExtraError

__all__ = ["CODECS", "FRAME", "MAX_RATIO", "require", "take"]

CODECS = {"lz4": 1, "zstd": 2}  # the codec's frame kind (0: a buffer stored raw)
_MODULES = {"lz4": "lz4.block", "zstd": "zstandard"}
FRAME = struct.Struct("<BI")  # per buffer: its kind, its stored length
# The most a frame may expand, a bound both sides keep: the writer stores raw what expands
# more, the reader refuses a frame that claims more, so a small hostile frame cannot make it
# allocate gigabytes. LZ4 cannot exceed 255:1; zstd's densest block (RLE) is 4 bytes per 128 KiB.
MAX_RATIO = {1: 255, 2: 1 << 15}


def require(codec: str, path: str | None = None, *, asked: str | None = None) -> ModuleType:
    """The module behind ``codec``, or MissingExtraError naming the extra that installs it.

    ``asked``: the option that asks to compress with ``codec`` (``"compress='zstd'"``), for a
    writer that checks before it creates anything; else the error is about reading ``path``.
    """
    try:
        return _module(codec)
    except ImportError:
        module, extra = _MODULES[codec].split(".")[0], f"pip install 'lmdbcache[{codec}]'"
        if asked is not None:
            raise MissingExtraError(f"{asked} needs the {module} module: {extra}.") from None
        where = f"Cache '{path}' is" if path else "This value is"
        raise MissingExtraError(
            f"{where} compressed with {codec}, but the {module} module is not installed: {extra}."
        ) from None


@functools.cache
def _module(codec: str) -> ModuleType:
    return importlib.import_module(_MODULES[codec])


_local = threading.local()


def _zstd_context(module: ModuleType) -> Any:
    """This thread's zstd decompression context: making one per frame costs ~60 us (a 150 KiB buffer takes ~300)."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = module.ZstdDecompressor()
    return dctx


def take(mv: memoryview, pos: int, nbytes: int) -> tuple[bytearray, int]:
    """The next buffer of a framed value (``nbytes``, as its record says) from the frame at ``pos``, and the next pos.

    The record's size bounds every allocation, and the result's length is checked exactly.
    """
    try:
        kind, stored = FRAME.unpack_from(mv, pos)
    except struct.error:
        raise CorruptSampleError("a frame header runs past the end of the value") from None
    pos += FRAME.size
    if stored > len(mv) - pos:
        raise CorruptSampleError("a frame runs past the end of the value")
    src = mv[pos : pos + stored]
    if kind == 0:
        if stored != nbytes:
            raise CorruptSampleError(f"a raw frame of {stored} bytes for a buffer of {nbytes}")
        return bytearray(src), pos + stored
    ratio = MAX_RATIO.get(kind)
    if ratio is None:
        raise CorruptSampleError(f"a frame of unknown kind {kind}")
    if not 0 < nbytes <= stored * ratio:
        raise CorruptSampleError(f"a frame of {stored} bytes claims a buffer of {nbytes}")
    codec = "lz4" if kind == 1 else "zstd"
    module = require(codec)
    try:
        if kind == 1:
            buf = module.decompress(src, uncompressed_size=nbytes, return_bytearray=True)
        else:
            if module.frame_content_size(src) != nbytes:
                raise CorruptSampleError(f"a zstd frame whose content size is not the buffer's {nbytes} bytes")
            buf = bytearray(nbytes)
            reader = _zstd_context(module).stream_reader(src, read_across_frames=False)
            got = reader.readinto(buf)
            if got != nbytes or reader.read(1):
                raise CorruptSampleError(f"a zstd frame that does not decompress to {nbytes} bytes")
    except CorruptSampleError:
        raise
    except Exception as exc:  # the codec's own error for a damaged stream
        raise CorruptSampleError(f"a {codec} frame does not decompress ({type(exc).__name__}: {exc})") from None
    if len(buf) != nbytes:
        raise CorruptSampleError(f"a {codec} frame decompresses to {len(buf)} bytes, not {nbytes}")
    return buf, pos + stored
