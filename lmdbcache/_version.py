from __future__ import annotations

__version__ = "0.4.0"

# The on-disk format this library writes and the newest it reads. Bump it only when the
# stored bytes change (record layout, keys, metadata), and keep tests/data/golden-v*
# readable. Format 3: the metadata may carry ``compress`` (and ``pack``), and values may be
# framed with compressed buffers; format-2 values are format-3 values unchanged. Format 4: the
# small values of a commit may be stored together in a group record, each index's entry a pointer
# into it (``format/_group``); values themselves are format 3's unchanged.
FORMAT_VERSION = 4
# The oldest format this library still reads (tests/data/golden-v* back to this one).
OLDEST_READABLE_FORMAT = 1
