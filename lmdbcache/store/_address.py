"""The address of a buffer's first byte (a view into LMDB's map), cheaply.

The record guard (``_guard``) and the loader's gather (``_gather``) need the address of a
memoryview that py-lmdb returns. ``np.frombuffer(view, np.uint8).ctypes.data`` costs about
1.1 us (it builds an array and a ctypes helper object); asking CPython for the buffer
(``PyObject_GetBuffer``, then ``PyBuffer_Release``) costs about 0.45 us, and on a fresh
process's first pass over 3 KiB samples the guard runs once per sample (issue #11).

The ``Py_buffer`` struct filled by the call is per thread: the loader's copy threads call
this at once, and a struct shared between them could hand one thread another's address.
Elsewhere than CPython (no ``ctypes.pythonapi``) the numpy way is used.

Only the pure-Python path imports this module (issue #24): the record guard's per-read checks
(``_guard.MapGuard.problem``) and the map's view when the compiled core is off (with the core,
``core.address`` and ``core.view`` do both through the buffer protocol in C, and the loader's
Python copy goes through numpy). What breaks it: it calls CPython's C API through
``ctypes.pythonapi`` with a block it sizes itself (``_PY_BUFFER_SIZE``), reading ``Py_buffer.buf``
as the block's first pointer: a CPython whose ``Py_buffer`` grows past 160 bytes or moves ``buf``
(no release so far has), or an interpreter without ``pythonapi`` (PyPy). The probe at import
compares its answers with numpy's and falls back to numpy's way (slower, correct) if they differ;
a ``Py_buffer`` grown past the block would be written out of bounds before the probe can tell.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["address", "view"]


def _numpy_address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


_PY_BUFFER_SIZE = 160  # bytes, room for CPython's Py_buffer (80 on 64-bit builds); ``buf`` is its first field


def _cpython_address() -> Callable[[Any], int] | None:
    try:
        api = ctypes.pythonapi
        get, release = api.PyObject_GetBuffer, api.PyBuffer_Release
    except (AttributeError, OSError):
        return None
    get.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int]
    get.restype = ctypes.c_int
    release.argtypes = [ctypes.c_void_p]
    release.restype = None
    local = threading.local()

    def address(buffer: Any) -> int:
        try:
            at, buf = local.struct
        except AttributeError:
            block = ctypes.create_string_buffer(_PY_BUFFER_SIZE)
            at = ctypes.addressof(block)
            buf = ctypes.c_void_p.from_address(at)
            local.block, local.struct = block, (at, buf)  # the block lives as long as the thread
        get(buffer, at, 0)  # PyBUF_SIMPLE; a failure raises (the call's Python error), nothing to release
        found = buf.value
        release(at)
        return found or 0

    probe = bytearray(b"lmdbcache")
    try:
        if address(probe) != _numpy_address(probe) or address(memoryview(probe)[3:]) != _numpy_address(probe) + 3:
            return None
    except Exception:  # pragma: no cover - an interpreter whose buffer API differs: fall back
        return None
    return address


address: Callable[[Any], int] = _cpython_address() or _numpy_address


def _cpython_view() -> Callable[[int, int], memoryview] | None:
    try:
        from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
    except (AttributeError, OSError):
        return None
    from_memory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
    from_memory.restype = ctypes.py_object
    return lambda at, size: from_memory(at, size, 0x100)  # PyBUF_READ


def _ctypes_view(at: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(at)).cast("B").toreadonly()


_view = _cpython_view()


def view(at: int, size: int) -> memoryview:
    """A read-only view of ``size`` bytes of this process's memory at ``at`` (the caller keeps it valid).

    CPython's own memoryview of raw memory (as py-lmdb's views are): it has no owner object, so
    its slices hash like bytes, which ``decode``'s plan lookup needs (a view of a ctypes array
    is unhashable, and decode would copy each value to bytes first).
    """
    return _view(at, size) if _view is not None else _ctypes_view(at, size)
