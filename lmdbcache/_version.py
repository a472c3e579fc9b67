from __future__ import annotations

__version__ = "0.4.0"

# The on-disk format this library writes and the newest it reads. Bump it only when the
# stored bytes change (record layout, keys, metadata), and keep tests/data/golden-v*
# readable. Format 3: the metadata may carry ``compress`` (and ``pack``), and values may be
# framed with compressed buffers; format-2 values are format-3 values unchanged.
FORMAT_VERSION = 3
# The oldest format this library still reads (tests/data/golden-v* back to this one).
OLDEST_READABLE_FORMAT = 1
