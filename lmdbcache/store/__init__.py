"""One cache directory in one process: ``Store``, the only door to LMDB.

``_store`` (Store: initialize, close, fork) composes a ``Reader`` (``_read``, with ``_native_read``
on the compiled core) and a ``Writer`` (``_write``, with its commit queue ``_commit``), each over
the one per-process ``Handle`` (``_handle``) it holds, and a ``Scanner`` (``_scanner``); ``_open``
creates, checks and rebuilds a directory; ``_env`` opens and sizes the LMDB environment (``_engine``: its
engine's page layout, LMDB 0.9's or 1.0's), ``_metadata`` is the metadata record, ``_fs`` the directory and its
files (and the unsynced marker; ``_pages``: a short file judged by what points past its end), ``_guard``
the bounds check of a record against the mapped file (``_address``: a buffer's address),
``_lmdb_errors`` the one translation of LMDB's errors, ``_registry`` one Store per
directory per process (forks, exit), ``_signals`` Ctrl-C around work that must not be cut.

May import: ``format`` and the base modules (``errors``, ``_version``, ``_options``).
Never ``dataset``, ``loader`` or ``tools``.
"""

from __future__ import annotations

from ._signals import redeliver_dropped_interrupts
from ._store import DATA_FILE, LOCK_FILE, MISSING, WRITE_LOCK, Store

__all__ = ["DATA_FILE", "LOCK_FILE", "MISSING", "WRITE_LOCK", "Store", "redeliver_dropped_interrupts"]
