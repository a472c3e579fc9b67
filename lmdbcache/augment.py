"""``lmdbcache.augment``: the transforms the loader fuses into its batch copy (``lmdbcache.loader.augment``)."""

from __future__ import annotations

from .loader.augment import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize

__all__ = ["CenterCrop", "Normalize", "RandomHorizontalFlip", "RandomResizedCrop", "Resize"]
