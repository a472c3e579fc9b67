"""The value format: bytes <-> samples.

``codec`` encodes a sample into one value and decodes it back (the format is written down
in docs/format.md); ``_encode``/``_decode`` do the work over the vocabulary of ``_format``
(header, record codes, limits), ``_dtypes`` and ``_records``; ``_frames`` and ``_compress``
compress a value's buffers; ``_pack`` lays many small values out in one record; ``_diff``
names the first difference between two samples.

May import: the standard library, numpy, msgpack and xxhash (torch and Pillow only once a
sample holds them), and lmdbcache's base modules (``errors``, ``_version``, ``_options``).
Never ``store``, ``dataset``, ``loader`` or ``tools``: this part knows nothing of LMDB.
"""

from __future__ import annotations

from . import codec
from .codec import decode, encode

__all__ = ["codec", "decode", "encode"]
