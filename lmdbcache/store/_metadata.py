"""The metadata record: one msgpack map under the key ``b"meta"`` of the ``meta`` database.

Fields: ``format_version`` (int, checked first: see ``_version``), ``length``,
``fingerprint``, ``library_version``, ``created`` (ISO 8601, UTC), ``cache_id`` (a random hex
string, new at every build or rebuild: processes check it before they commit, so a process
still filling a rebuilt cache cannot write old samples into it) and ``builder`` (who built
it, for messages). A cache upgraded in place from an older format also has
``upgraded_from``. Format 3 adds ``compress`` (``"lz4"`` or ``"zstd"``; absent or nil: values
are stored as encoded) and ``compress_level`` (int): what every writer of the build compresses
with (``_compress``); and ``pack`` (int, 0 to ``_pack.MAX_PACK``): the chunk size K of packed
records (see ``_pack``); 0 or absent: no packs. A cache file is untrusted input: every field is
validated before use.

Pure functions of bytes and dicts; the store does the reading and writing.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from typing import Any

import msgpack

from .._version import FORMAT_VERSION, OLDEST_READABLE_FORMAT, __version__
from ..errors import CacheMismatchError, CorruptCacheError, NotACacheError
from ..format._compress import CODECS, LEVELS
from ..format._pack import MAX_PACK
from ._lmdb_errors import REBUILD

__all__ = [
    "KEY", "check", "check_compression", "compression", "new", "parse", "rebuilt_message", "upgraded", "validate",
]  # fmt: skip

KEY = b"meta"
# The fields every record has, and their types (``format_version`` is checked first, apart).
_FIELDS: dict[str, type] = {
    "length": int,
    "fingerprint": str,
    "cache_id": str,
    "created": str,
    "library_version": str,
}


def parse(raw: bytes, path: str) -> dict[str, Any]:
    """The validated metadata in ``raw``, a record read from the cache at ``path``."""
    try:
        meta = msgpack.unpackb(raw, strict_map_key=False)
    except Exception as exc:
        raise CorruptCacheError(
            f"Cache '{path}' has unreadable metadata ({type(exc).__name__}: {exc}). {REBUILD}"
        ) from None
    return validate(meta, path)


def validate(meta: Any, path: str) -> dict[str, Any]:
    """Check the metadata record's fields before anything uses them (a cache file is untrusted input)."""
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise NotACacheError(f"'{path}' holds an LMDB environment whose metadata is not lmdbcache's.")
    stored = meta["format_version"]
    fix = f"Delete '{path}', use another path, or pass overwrite=True to rebuild it."
    if type(stored) is not int:
        raise CorruptCacheError(
            f"Cache '{path}' has damaged metadata: field 'format_version' is {stored!r}, not an integer. {REBUILD}"
        )
    if stored < OLDEST_READABLE_FORMAT:
        raise CacheMismatchError(
            f"Cache '{path}' was written in format {stored}, older than this lmdbcache {__version__} reads "
            f"(formats {OLDEST_READABLE_FORMAT} to {FORMAT_VERSION}). {fix}"
        )
    if stored > FORMAT_VERSION:
        raise CacheMismatchError(
            f"Cache '{path}' was written by lmdbcache format {stored} (lmdbcache "
            f"{meta.get('library_version')}); this is lmdbcache {__version__}, which reads formats "
            f"{OLDEST_READABLE_FORMAT} to {FORMAT_VERSION}: upgrade lmdbcache, or {fix[0].lower()}{fix[1:]}"
        )
    for field, kind in _FIELDS.items():
        if field not in meta:
            raise CorruptCacheError(f"Cache '{path}' has damaged metadata: field '{field}' is missing. {REBUILD}")
        value = meta[field]
        if (
            type(value) is not kind
            or (type(value) is int and not 0 <= value < 2**63)
            or (field == "cache_id" and not value)
        ):
            expected = (
                "an integer from 0 to 2**63 - 1"
                if kind is int
                else "a non-empty string"
                if field == "cache_id"
                else "a string"
            )
            raise CorruptCacheError(
                f"Cache '{path}' has damaged metadata: field '{field}' is {value!r:.80}, expected {expected}. {REBUILD}"
            )
    codec, level = meta.get("compress"), meta.get("compress_level", 0)
    known = type(codec) is str and codec in CODECS
    if codec is not None and not (known and type(level) is int and LEVELS[codec][0] <= level <= LEVELS[codec][1]):
        raise CorruptCacheError(
            f"Cache '{path}' has damaged metadata: fields 'compress', 'compress_level' are {codec!r:.40}, "
            f"{level!r:.40}, expected 'lz4' or 'zstd' and a level. {REBUILD}"
        )
    pack = meta.get("pack", 0)
    if type(pack) is not int or not 0 <= pack <= MAX_PACK:
        raise CorruptCacheError(
            f"Cache '{path}' has damaged metadata: field 'pack' is {pack!r:.80}, expected an integer from 0 to "
            f"{MAX_PACK}. {REBUILD}"
        )
    return meta


def settings(meta: dict[str, Any]) -> dict[str, Any]:
    """The build's creation settings, as a rebuild should keep them (see ``_fs.mark_unsynced``)."""
    codec, level = compression(meta)
    return {"compress": codec, "compress_level": level, "pack": meta.get("pack", 0)}


def compression(meta: dict[str, Any]) -> tuple[str | None, int]:
    """The (codec, level) the build's values are compressed with; (None, 0) for none."""
    codec = meta.get("compress")
    return (codec, meta.get("compress_level", 0)) if codec is not None else (None, 0)


def check_compression(meta: dict[str, Any], path: str, codec: str | None, level: int | None) -> None:
    """Refuse to open a build with a compression setting other than the one asked for (None: any)."""
    if codec is None:
        return
    found, found_level = compression(meta)
    if found != codec or (level is not None and found_level != level):
        has = "no compression" if found is None else f"compress={found!r}, compress_level={found_level}"
        asked = f"compress={codec!r}" + ("" if level is None else f", compress_level={level}")
        raise CacheMismatchError(
            f"Cache '{path}' was built with {has}, not {asked}. Open it without compress= to use its setting, or "
            "pass overwrite=True to rebuild it with the new one."
        )


def check(meta: dict[str, Any], path: str, length: int | None, fingerprint: str | None) -> dict[str, Any]:
    """``meta`` if it is the cache of a dataset of ``length`` and ``fingerprint`` (None: not checked)."""
    fix = f"Delete '{path}', use another path, or pass overwrite=True to rebuild it."
    if length is not None and meta["length"] != length:
        raise CacheMismatchError(
            f"Cache '{path}' was built for a dataset of length {meta['length']} but the dataset has length "
            f"{length}. {fix}"
        )
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise CacheMismatchError(
            f"Cache '{path}' was built for fingerprint '{meta['fingerprint']}' but the dataset has "
            f"'{fingerprint}'. {fix}"
        )
    return meta


def new(
    length: int, fingerprint: str, codec: str | None = None, level: int = 0, pack: int = 0
) -> tuple[dict[str, Any], bytes]:
    """The record of a new build (a new ``cache_id``), compressed with ``codec`` at ``level``, packed by
    chunks of ``pack`` (0: no packs), and its bytes."""
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "length": int(length),
        "fingerprint": fingerprint,
        "library_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cache_id": uuid.uuid4().hex,
        "builder": f"pid {os.getpid()} on {socket.gethostname()}",
    }
    if codec is not None:
        meta["compress"], meta["compress_level"] = codec, level
    if pack:
        meta["pack"] = int(pack)
    return meta, msgpack.packb(meta)


def upgraded(meta: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """An older format's record marked as this format (before this process adds values), and its bytes.

    Values of older formats stay readable (the codec reads each by its own version byte);
    the build id is kept, so processes reading it are not told it was rebuilt.
    """
    meta = {k: v for k, v in meta.items() if k != "codec"}
    meta["upgraded_from"], meta["format_version"] = meta["format_version"], FORMAT_VERSION
    return meta, msgpack.packb(meta)


def rebuilt_message(path: str, meta: dict[str, Any] | None) -> str:
    """Why a process may no longer use the build it adopted: the cache at ``path`` now holds ``meta``."""
    if meta is None:
        now = "it no longer holds valid metadata"
    else:
        builder = meta.get("builder")
        now = (
            f"it now holds a new build for fingerprint '{meta['fingerprint']}' (length {meta['length']}), "
            f"created {meta['created']}" + (f" by {builder}" if isinstance(builder, str) else "")
        )
    return (
        f"Cache '{path}' was rebuilt (overwrite=True) after this process opened it: {now}. Samples of the "
        "build this dataset was opened on are gone; nothing is read from or written to the new build through "
        "it. Create the dataset again to use the new build."
    )
