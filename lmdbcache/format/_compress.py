"""Optional per-buffer compression, the writing side: the framed value form (see ``codec``, "Compressed values").

A cache built with ``compress="lz4"`` or ``"zstd"`` passes every encoded value through
``Compressor``: each buffer of at least ``THRESHOLD`` bytes is compressed, and kept compressed
only when that pays (under ``PAYS`` of its size). A value none of whose buffers pays is stored
as it was encoded, so it keeps the flat fast path. The writer works on the encoded value (its
structure says where each buffer starts), so the encoder itself knows nothing of compression.

The frames' layout, their bounds and reading one live in ``_frames``; ``_decode`` reads the
framed form.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import InvalidOptionError
from ._decode import flat_plan
from ._format import FLAT, FRAMED_MAGIC, HEAD, HEAD_SIZE, NDARRAY, NPSCALAR, PIL, STRUCTURED, TENSOR, U16
from ._frames import CODECS, FRAME, MAX_RATIO, require
from ._records import array_spec, image_record, struct_spec, tensor_spec

__all__ = ["CODECS", "LEVELS", "Compressor", "check"]

LEVELS = {"lz4": (0, 12, 0), "zstd": (-7, 22, 3)}  # lowest, highest, default
THRESHOLD = 4096  # smaller buffers are stored raw: a frame's overhead and a call cost more than they save
PAYS = 0.95  # a buffer stays compressed only under this fraction of its size


def check(compress: Any, level: Any) -> tuple[str | None, int]:
    """The (codec, level) of the options ``compress`` and ``compress_level``; InvalidOptionError if out of range."""
    if compress is None:
        if level is not None:
            raise InvalidOptionError(f"compress_level={level!r} needs compress='lz4' or 'zstd'.")
        return None, 0
    if compress not in CODECS:
        raise InvalidOptionError(f"compress must be None, 'lz4' or 'zstd', not {compress!r}.")
    low, high, default = LEVELS[compress]
    if level is None:
        return compress, default
    if type(level) is not int or not low <= level <= high:
        raise InvalidOptionError(
            f"compress_level for {compress} must be an integer from {low} to {high}, not {level!r}."
        )
    return compress, level


# ----------------------------------------------------------------------------------------
# Writing


class Compressor:
    """``compressor(value)``: the framed form of an encoded value, or the value itself when nothing pays.

    Picklable as its settings; compression contexts are made per thread (zstandard's are not thread-safe).
    """

    def __init__(self, codec: str, level: int) -> None:
        # The codec's module is imported on first use: a store that only reads metadata (``lmdbcache info``)
        # adopts a compressed build without it; ``Store`` refuses to write or read one without it.
        self.codec, self.level, self.kind = codec, level, CODECS[codec]
        self._local = threading.local()

    def __getstate__(self) -> tuple[str, int]:
        return self.codec, self.level

    def __setstate__(self, state: tuple[str, int]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def _compress(self) -> Callable[[memoryview], bytes]:
        fn: Callable[[memoryview], bytes] | None = getattr(self._local, "fn", None)
        if fn is None:
            module = require(self.codec)
            if self.codec == "zstd":
                fn = module.ZstdCompressor(level=self.level, write_content_size=True).compress
            elif self.level:
                level = self.level
                fn = functools.partial(module.compress, mode="high_compression", compression=level, store_size=False)
            else:
                fn = functools.partial(module.compress, store_size=False)
            self._local.fn = fn
        return fn

    def __call__(self, value: bytes) -> bytes:
        if len(value) < HEAD_SIZE + THRESHOLD:
            return value
        size = HEAD.unpack_from(value)[1]
        end = HEAD_SIZE + size
        if len(value) - end < THRESHOLD:
            return value
        mv = memoryview(value)
        compress, kind, ratio = self._compress(), self.kind, MAX_RATIO[self.kind]
        frames: list[bytes | memoryview] = [FRAMED_MAGIC, mv[4:end]]
        pos, paid = end, False
        for nbytes in buffer_sizes(mv[HEAD_SIZE:end]):
            raw = mv[pos : pos + nbytes]
            pos += nbytes
            if THRESHOLD <= nbytes <= _MAX_INPUT:
                try:
                    packed: bytes | None = compress(raw)
                except Exception:  # the codec refuses this buffer: it is stored as it is
                    packed = None
                if packed is not None and len(packed) < PAYS * nbytes and nbytes <= len(packed) * ratio:
                    frames += (FRAME.pack(kind, len(packed)), packed)
                    paid = True
                    continue
            frames += (FRAME.pack(0, nbytes), raw)
        if not paid or pos != len(value):
            return value
        return b"".join(frames)


# The largest buffer compressed: lz4's block API refuses inputs over LZ4_MAX_INPUT_SIZE
# (0x7E000000, ~2.1 GB) with OverflowError; a larger buffer is stored raw, with either codec.
_MAX_INPUT = 0x7E000000


def buffer_sizes(structure: memoryview) -> list[int]:
    """The size of each buffer a (trusted, just encoded) structure owns, in order."""
    if structure[0] == FLAT:
        sig = U16.unpack_from(structure, 1)[0]
        return [spec[0] for spec in flat_plan(bytes(structure[1 : 3 + sig]))[4]]
    sizes: list[int] = []

    def hook(code: int, data: bytes) -> None:
        if code == TENSOR:
            sizes.append(tensor_spec(data)[0])
        elif code in (NDARRAY, NPSCALAR):
            sizes.append(array_spec(data)[0])
        elif code == STRUCTURED:
            sizes.append(struct_spec(data)[0])
        elif code == PIL:
            sizes.append(image_record(data)[3])

    msgpack.unpackb(structure, use_list=False, raw=False, strict_map_key=False, ext_hook=hook,
                    unicode_errors="surrogatepass")  # fmt: skip
    return sizes
