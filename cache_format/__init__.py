"""Byte formats of lazytriton's caches: bytes <-> Entry. No policy lives here."""

from lazytriton.cache_format.entry import Entry, EntryError, Provenance

__all__ = ["Entry", "EntryError", "Provenance"]
