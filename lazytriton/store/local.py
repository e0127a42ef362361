"""The local tier: a persistent, writable cache on this machine's disk.

All of its file I/O goes through one ``diskcache.Cache`` (SQLite index plus
one file per entry, written before its index row, in a transaction), so a
process killed at any instant leaves it valid. Values are the encoded entry
bytes, verified on every read. Counters (compiles, hits, corrupt entries)
live in the same store under ``counter:`` keys, which entry listings skip.
Every key is a str, so diskcache never pickles one.

Size is bounded, least recently used entries first: diskcache keeps each
entry's access time (its ``least-recently-used`` policy), and ``cull`` evicts
by it. diskcache's own culling is off (``cull_limit=0``) because it would
evict the counters too; ``put`` culls when the store outgrows its bound.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lazytriton.cache_format import Entry, EntryError
from lazytriton.config import DEFAULT_CACHE_MAX_BYTES
from lazytriton.store import TierStats
from lazytriton.variant import check_key

log = logging.getLogger("lazytriton.store.local")

# diskcache keeps values above this many bytes in files of their own; entries
# (cubins of 20-300 KiB) always are, small counters stay in SQLite.
_FILE_THRESHOLD = 4096
_COUNTER = "counter:"


class LocalTier:
    """Entries in ``directory`` on local disk, through diskcache."""

    writable = True

    def __init__(self, directory: str | os.PathLike[str], name: str = "local",
                 size_limit: int = DEFAULT_CACHE_MAX_BYTES) -> None:
        self.name = name
        self.directory = Path(directory)
        self._cache: Any = None  # a diskcache.Cache, opened on first use
        self._size_limit = size_limit
        self._warned: set[str] = set()

    def _store(self) -> Any:
        if self._cache is None:
            try:
                import diskcache  # imported on first use: a process served from images never pays for it

                self._cache = diskcache.Cache(
                    str(self.directory), size_limit=self._size_limit, cull_limit=0,
                    eviction_policy="least-recently-used", disk_min_file_size=_FILE_THRESHOLD,
                    timeout=10,
                )
            except Exception as exc:  # unwritable dir, corrupt SQLite file, ...
                self.warn_once("open", f"local cache {self.directory} unusable ({exc}); running from memory only")
                return None
        return self._cache

    @property
    def size_limit(self) -> int:
        """The bound, in bytes, that ``put`` keeps the store within (``cull`` evicts down to it)."""
        return self._size_limit

    @property
    def usable(self) -> bool:
        """False when the directory cannot be opened (the tier then holds nothing; it warned once)."""
        return self._store() is not None

    def warn_once(self, what: str, message: str) -> None:
        """Log ``message`` the first time ``what`` fails.

        ``write`` covers entries, counters and the runtime's miss log: a full
        disk fails them all and says so once.
        """
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def get(self, key: str) -> Entry | None:
        """The verified entry for ``key``; a corrupt one is dropped, logged and counted."""
        check_key(key)
        store = self._store()
        if store is None:
            return None
        try:
            data = store.get(key, default=None, read=False)
        except Exception as exc:
            self.warn_once("read", f"local cache read failed ({exc}); treated as a miss")
            return None
        if data is None:
            return None
        try:
            return Entry.decode(data, expected_key=key)
        except EntryError as exc:
            log.warning("dropping corrupt entry %s from %s: %s", key, self.directory, exc)
            self.count("corrupt")
            try:
                store.delete(key)
            except Exception:
                pass
            return None

    def put(self, key: str, entry: Entry) -> bool:
        """Store ``entry``; on a full disk or read-only dir, log once and return False."""
        check_key(key)
        store = self._store()
        if store is None:
            return False
        try:
            stored = bool(store.set(key, entry.encode(), read=False))
            if store.volume() > self._size_limit:
                self.cull()
            return stored
        except Exception as exc:
            self.warn_once("write", f"local cache {self.directory}: write failed ({exc}); "
                                    "new entries stay in memory only")
            return False

    def peek(self, key: str) -> bytes | None:
        """The stored bytes for ``key``, unverified, with no side effect (no drop, count or access time)."""
        import sqlite3  # only here: the runtime's import path never needs it

        store = self._store()
        if store is None:
            return None
        try:
            row = store._sql("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1",
                             (check_key(key),)).fetchone()
            return None if row is None else bytes(store._disk.fetch(*row, read=False))
        except (OSError, sqlite3.Error):
            return None

    def cull(self, max_bytes: int | None = None) -> tuple[int, int]:
        """Evict least recently used entries (never counters) until the store is within ``max_bytes``.

        ``max_bytes`` defaults to the tier's size limit; the bound covers the
        SQLite index too. Returns (entries removed, their bytes).
        """
        bound = self._size_limit if max_bytes is None else max_bytes
        if bound < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        store = self._store()
        if store is None:
            return 0, 0
        removed = freed = 0
        rows = store._sql("SELECT key, size FROM Cache WHERE raw = 1 AND key NOT LIKE ? ORDER BY access_time",
                          (_COUNTER + "%",)).fetchall()
        for key, size in rows:
            if store.volume() <= bound:
                break
            if store.delete(key):
                removed, freed = removed + 1, freed + size
        return removed, freed

    def delete(self, key: str) -> bool:
        """Remove one entry; True if it was there."""
        store = self._store()
        return bool(store is not None and store.delete(check_key(key)))

    def keys(self) -> Iterator[str]:
        """Keys of the entries held (counters excluded)."""
        store = self._store()
        if store is None:
            return iter(())
        return (key for key in store.iterkeys() if isinstance(key, str) and not key.startswith(_COUNTER))

    def stats(self) -> TierStats:
        """Entry count and bytes of the tier's directory."""
        store = self._store()
        if store is None:
            return TierStats(self.name, 0, 0)
        return TierStats(self.name, sum(1 for _ in self.keys()), int(store.volume()))

    def entry_path(self, key: str) -> Path | None:
        """The file that holds the entry's bytes (tests corrupt it on purpose)."""
        store = self._store()
        if store is None:
            return None
        row = store._sql("SELECT filename FROM Cache WHERE key = ? AND raw = 1", (check_key(key),)).fetchone()
        return self.directory / row[0] if row and row[0] else None

    def count(self, counter: str, amount: int = 1) -> None:
        """Add to a persistent counter; counting never fails a call."""
        store = self._store()
        if store is None:
            return
        try:
            store.incr(_COUNTER + counter, amount, default=0)
        except Exception as exc:
            self.warn_once("write", f"local cache {self.directory}: write failed ({exc}); "
                                    "new entries stay in memory only")

    def counters(self) -> dict[str, int]:
        """All persistent counters by name."""
        store = self._store()
        if store is None:
            return {}
        out = {}
        for key in store.iterkeys():
            if isinstance(key, str) and key.startswith(_COUNTER):
                out[key[len(_COUNTER):]] = int(store.get(key, default=0))
        return out

    def close(self) -> None:
        """Close the SQLite connection (reopened on next use)."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None
