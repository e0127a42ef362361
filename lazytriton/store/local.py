"""The local tier: a persistent, writable cache on this machine's disk.

Entries go through one ``diskcache.Cache`` (SQLite index plus one file per
entry, written before its index row, in a transaction), so a process killed at
any instant leaves it valid. Its ``Disk`` is ``RawDisk`` (``local_disk``):
str keys and raw bytes in, raw bytes out; a row stored any other way (pickle,
text, an int) is damage, never decoded: a lookup drops it, counts it
(``corrupt``) and the entry is rebuilt; listings skip it; ``cache verify``
reports it; ``cache gc`` drops it. Values are the encoded entry bytes,
verified on every read.

Counters (compiles, hits, corrupt, ...) live apart, in ``counters.db`` beside
the index (one small SQLite table, each increment one transaction), so the
entries table holds entries only and diskcache's own eviction bounds it:
least recently used first, ``CULL_LIMIT`` rows per write at most.

A file no row references (a writer killed between its value file and its
index row) is an orphan: diskcache never counts or removes it; ``sweep_orphans``
does, once it is older than ``ORPHAN_GRACE_S``, and only files named as
diskcache names them, never through a link (``local_disk.sweep_value_files``).

Before SQLite opens anything, every file at a database's name (``cache.db``,
``counters.db`` and their journals) must be a regular file or absent: SQLite
would block for good opening a FIFO planted at ``cache.db-journal``. Anything
else makes the tier unusable (memory only, one warning); ``clear`` removes it,
except a directory, which lazytriton never deletes and names instead.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lazytriton.cache_format import Entry, EntryError
from lazytriton.config import DEFAULT_CACHE_MAX_BYTES
from lazytriton.fsutil import describe_mode
from lazytriton.keys import check_key
from lazytriton.record import record
from lazytriton.store import TierStats

log = logging.getLogger("lazytriton.store.local")

# diskcache keeps values above this many bytes in files of their own; entries
# (cubins of 20-300 KiB) always are.
_FILE_THRESHOLD = 4096
# Rows diskcache evicts (least recently used first) per write that finds the
# store at or over its bound. Measured with benchmarks/bench_local_eviction.py
# (2-core CPU machine; a seeded stream of 20-300 KiB entries, one random read
# between writes):
#   limit  writes over the bound, max excess  entries left  own entry evicted
#   8 MiB bound, 400 writes:
#     1    297, 1272 KiB (it drifts: one out per one in)     58   0
#     2      6,   80 KiB                                     58   0
#     3      1,   32 KiB (SQLite page growth)                58   0
#     4      0                                               56   0
#     10     0 (diskcache's default)                         50   0
#   1 MiB bound (the smallest allowed), 300 writes:
#     2      8,  135 KiB                                      8   0
#     3      0                                                9   0
#     10     0                                                7  42 (it evicts the entry just written)
# 3 keeps the bound and the most entries; and since three 300 KiB entries fit
# in 1 MiB, a write never evicts its own entry at any allowed bound.
CULL_LIMIT = 3
# A value file with no index row is swept only when older than this: a writer
# writes its file, then waits (up to its 10 s SQLite timeout) for the row.
ORPHAN_GRACE_S = 3600.0
COUNTERS_DB = "counters.db"
# Files of the tier's directory that are not value files (SQLite and its journals).
_DATABASE_FILES = ("cache.db", "cache.db-wal", "cache.db-shm", "cache.db-journal",
                   COUNTERS_DB, COUNTERS_DB + "-journal", COUNTERS_DB + "-wal", COUNTERS_DB + "-shm")


@record
class StoredRow:
    """One row of the entries table as stored (``data`` None: damaged, ``problem`` says why)."""

    key: str
    data: bytes | None
    problem: str = ""


class LocalTier:
    """Entries in ``directory`` on local disk, through diskcache."""

    writable = True

    def __init__(self, directory: str | os.PathLike[str], name: str = "local",
                 size_limit: int = DEFAULT_CACHE_MAX_BYTES, cull_limit: int = CULL_LIMIT) -> None:
        self.name = name
        self.directory = Path(directory)
        self._cache: Any = None  # a diskcache.Cache, opened on first use
        self._size_limit = size_limit
        self._cull_limit = cull_limit
        self._warned: set[str] = set()
        self._problem: str | None = None

    def _store(self) -> Any:
        if self._cache is None and self._problem is None:
            obstacle = self._database_obstacle()
            if obstacle is not None:
                self._problem = obstacle
                self.warn_once("open", f"local cache {self.directory} unusable ({obstacle}); running from memory "
                                       "only (`lazytriton cache clear` resets it)")
                return None
            try:
                import diskcache  # imported on first use: a process served from images never pays for it

                from lazytriton.store.local_disk import RawDisk

                self._cache = diskcache.Cache(
                    str(self.directory), disk=RawDisk, size_limit=self._size_limit, cull_limit=self._cull_limit,
                    eviction_policy="least-recently-used", disk_min_file_size=_FILE_THRESHOLD, timeout=10,
                    # Pinned: these settings are otherwise read from the (untrusted) Settings table.
                    statistics=0, tag_index=0, sqlite_auto_vacuum=1, sqlite_cache_size=2**13,
                    sqlite_journal_mode="wal", sqlite_mmap_size=2**26, sqlite_synchronous=1,
                )
            except Exception as exc:  # unwritable dir, a damaged SQLite file, ...
                self._problem = f"{type(exc).__name__}: {exc}"
                self.warn_once("open", f"local cache {self.directory} unusable ({exc}); running from memory only "
                                       "(`lazytriton cache verify` checks it, `lazytriton cache clear` resets it)")
        return self._cache

    def _database_obstacle(self) -> str | None:
        """Why a file at one of the databases' names is not one SQLite may open, or None.

        Checked with ``lstat`` before any connection: a FIFO would block the
        open for good, a link would put the database elsewhere.
        """
        for name in _DATABASE_FILES:
            try:
                mode = os.lstat(self.directory / name).st_mode
            except FileNotFoundError:
                continue
            except OSError as exc:
                return f"{self.directory / name}: {exc.strerror}"
            if not stat.S_ISREG(mode):
                return f"{self.directory / name} is {describe_mode(mode)}, not a regular file"
        return None

    def obstacles(self) -> list[Path]:
        """Directories at the databases' names: ``clear`` leaves them (lazytriton never made them), so they block."""
        found = []
        for name in _DATABASE_FILES:
            try:
                if stat.S_ISDIR(os.lstat(self.directory / name).st_mode):
                    found.append(self.directory / name)
            except OSError:
                continue
        return found

    @property
    def size_limit(self) -> int:
        """The bound, in bytes, that diskcache's eviction keeps the store within."""
        return self._size_limit

    @property
    def usable(self) -> bool:
        """False when the directory cannot be opened (the tier then holds nothing; it warned once)."""
        return self._store() is not None

    @property
    def problem(self) -> str | None:
        """Why the tier's database cannot be opened (None: it can); ``info`` and ``cache verify`` show it."""
        self._store()
        return self._problem

    def warn_once(self, what: str, message: str) -> None:
        """Log ``message`` the first time ``what`` fails.

        ``write`` covers entries, counters and the runtime's miss log: a full
        disk fails them all and says so once.
        """
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def get(self, key: str) -> Entry | None:
        """The verified entry for ``key``; a corrupt or damaged one is dropped, logged and counted."""
        from lazytriton.store.local_disk import DamagedRow

        check_key(key)
        store = self._store()
        if store is None:
            return None
        try:
            data = store.get(key, default=None, read=False)
            if data is None:
                return None
            return Entry.decode(data, expected_key=key)
        except (EntryError, DamagedRow) as exc:
            log.warning("dropping corrupt entry %s from %s: %s", key, self.directory, exc)
            self.count("corrupt")
            try:
                store.delete(key)
            except Exception:
                pass
            return None
        except Exception as exc:
            self.warn_once("read", f"local cache read failed ({exc}); treated as a miss")
            return None

    def put(self, key: str, entry: Entry) -> bool:
        """Store ``entry`` (diskcache evicts to the bound); on a full disk or read-only dir, log once, False."""
        check_key(key)
        store = self._store()
        if store is None:
            return False
        try:
            return bool(store.set(key, entry.encode(), read=False))
        except Exception as exc:
            self.warn_once("write", f"local cache {self.directory}: write failed ({exc}); "
                                    "new entries stay in memory only")
            return False

    def peek(self, key: str) -> bytes | None:
        """The stored bytes for ``key``, unverified, with no side effect (no drop, count or access time).

        None when nothing is stored, or when the row holds anything but raw bytes.
        """
        import sqlite3

        from lazytriton.store import local_disk

        check_key(key)
        if self._store() is None:
            return None
        try:
            rows = local_disk.index_rows(str(self.directory), "WHERE key = ? AND raw = 1", (key,))
            return local_disk.row_bytes(str(self.directory), *rows[0][3:]) if rows else None
        except (OSError, sqlite3.Error, local_disk.DamagedRow):
            return None

    def scan(self) -> Iterator[StoredRow]:
        """Every row of the entries table, in key order, read without side effects and never decoded.

        A row that is not a valid key holding raw bytes comes with ``data``
        None and its ``problem``; ``cache ls`` and ``cache verify`` show it.
        """
        import sqlite3

        from lazytriton.store import local_disk

        if self._store() is None:
            return
        root = str(self.directory)
        try:
            rows = local_disk.index_rows(root, "ORDER BY raw DESC, key")
        except sqlite3.Error as exc:
            yield StoredRow("-", None, f"the entries index cannot be read: {exc}")
            return
        for rowid, key, raw, mode, filename, value in rows:
            if local_disk.legacy_counter(key, raw, mode, value) is not None:
                continue  # an older lazytriton's counter: ``drop_damaged`` moves it to counters.db
            if not local_disk.is_str_key(key, raw):
                yield StoredRow(f"row {rowid}", None, f"{local_disk.describe_key(key, raw)}, not an entry key")
                continue
            try:
                check_key(key)
                yield StoredRow(key, local_disk.row_bytes(root, mode, filename, value))
            except (ValueError, local_disk.DamagedRow, OSError) as exc:
                yield StoredRow(key if len(key) <= 64 else key[:61] + "...", None, str(exc))

    def cull(self, max_bytes: int | None = None) -> tuple[int, int]:
        """Evict least recently used entries until the store is within ``max_bytes``; (removed, bytes freed).

        ``max_bytes`` defaults to the tier's size limit; the bound covers the
        SQLite index too. Writes never need this (diskcache's eviction bounds
        them); ``cache gc`` does, to a bound of its own. diskcache's ``cull``
        evicts ten rows per step: at the smallest bound (1M) with three 400 KB
        entries it removed all three where one was enough (tests/test_cache_cli.py::
        test_the_local_bound_is_a_setting), so this removes one row at a time,
        in diskcache's own least-recently-used order, through ``Cache.delete``.
        """
        from lazytriton.store import local_disk

        bound = self._size_limit if max_bytes is None else max_bytes
        if bound < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        store = self._store()
        if store is None:
            return 0, 0
        before, removed = self.volume(), 0
        if before > bound:
            for key, raw in local_disk.index_rows(str(self.directory), "ORDER BY access_time", columns="key, raw"):
                if self.volume() <= bound:
                    break
                removed += bool(store.delete(local_disk.DamagedKey(key, raw)))
        return removed, max(before - self.volume(), 0)

    def drop_damaged(self) -> int:
        """Remove every row that is not a valid key holding raw bytes, counted ``corrupt``; how many.

        An older lazytriton's counter (``counter:<name>`` holding an int) is
        not damage: it is added to ``counters.db`` and removed.

        Judged from the index (key type, value mode, file name) and whether its
        value file is there, nothing decoded; a value file's content is checked
        when the entry is read.
        """
        from lazytriton.store import local_disk

        store = self._store()
        if store is None:
            return 0
        damaged, legacy = [], []
        for rowid, key, raw, mode, filename, value in local_disk.index_rows(str(self.directory)):
            name = local_disk.legacy_counter(key, raw, mode, value)
            if name is not None:  # counters lived among the entries before lazytriton 0.1's counters.db
                self.count(name, value)
                legacy.append(rowid)
                continue
            if local_disk.is_str_key(key, raw) and _is_key(key) and local_disk.value_shape_ok(mode, filename, value) \
                    and (filename is None or _regular_file(self.directory / filename)):
                continue
            log.warning("dropping a damaged row from %s: %s", self.directory,
                        repr(key[:64]) if local_disk.is_str_key(key, raw) else local_disk.describe_key(key, raw))
            damaged.append(rowid)
        local_disk.delete_rows(str(self.directory), legacy)
        dropped = local_disk.delete_rows(str(self.directory), damaged)
        if dropped:
            self.count("corrupt", dropped)
        return dropped

    def sweep_orphans(self, grace_s: float = ORPHAN_GRACE_S) -> tuple[int, int]:
        """Remove value files no row references, older than ``grace_s``; (files removed, their bytes).

        Only files named as diskcache names value files, in its two levels of
        two-hex-digit folders, never through a link (``sweep_value_files``);
        any other file in the directory, the databases included, is left alone.
        """
        from lazytriton.store import local_disk

        if self._store() is None:
            return 0, 0
        root = str(self.directory)
        referenced = {row[4] for row in local_disk.index_rows(root, "WHERE filename IS NOT NULL")}
        return local_disk.sweep_value_files(root, referenced, grace_s, time.time())

    def clear(self) -> int:
        """Remove every entry, damaged rows and orphaned files included, and the counters; entries removed.

        A database that cannot be opened is removed with its files (any
        non-directory at the databases' names, a FIFO included), so the next
        use starts afresh; a directory there is left (``obstacles`` names it).
        """
        store = self._store()
        removed = 0
        if store is not None:
            removed = int(store.clear())
            self.sweep_orphans(grace_s=0)
        else:
            from lazytriton.store import local_disk

            self.close()
            for name in _DATABASE_FILES:
                path = self.directory / name
                try:
                    if not stat.S_ISDIR(os.lstat(path).st_mode):
                        path.unlink()
                except OSError:
                    continue
            local_disk.sweep_value_files(str(self.directory), set(), 0.0, time.time())
            self._problem = None
        self._clear_counters()
        return removed

    def delete(self, key: str) -> bool:
        """Remove one entry; True if it was there."""
        store = self._store()
        return bool(store is not None and store.delete(check_key(key)))

    def keys(self) -> Iterator[str]:
        """Keys of the entries held (rows that are not entry keys are skipped, never decoded)."""
        store = self._store()
        if store is None:
            return
        try:
            for key in store.iterkeys():
                if type(key) is str and _is_key(key):
                    yield key
        except Exception as exc:  # a damaged index: ``cache verify`` says so
            self.warn_once("read", f"local cache read failed ({exc}); treated as a miss")

    def volume(self) -> int:
        """Bytes on disk by diskcache's count (index plus value files); 0 when its count is unreadable."""
        store = self._store()
        try:
            return 0 if store is None else int(store.volume())
        except Exception as exc:  # a damaged Settings table
            self.warn_once("read", f"local cache read failed ({exc}); treated as a miss")
            return 0

    def stats(self) -> TierStats:
        """Entry count and bytes of the tier's directory (orphaned files are not counted: ``gc`` sweeps them)."""
        return TierStats(self.name, sum(1 for _ in self.keys()), self.volume())

    def entry_path(self, key: str) -> Path | None:
        """The file that holds the entry's bytes (tests corrupt it on purpose)."""
        from lazytriton.store.local_disk import index_rows

        if self._store() is None:
            return None
        rows = index_rows(str(self.directory), "WHERE key = ? AND raw = 1", (check_key(key),))
        return self.directory / rows[0][4] if rows and rows[0][4] else None

    # --- counters ----------------------------------------------------------------------------------------------

    def _counters_db(self, create: bool) -> Any:
        import sqlite3

        path = self.directory / COUNTERS_DB
        if not create and not path.exists():
            return None
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(str(path), timeout=10, isolation_level=None)
        if create:
            con.execute("CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        return con

    def count(self, counter: str, amount: int = 1) -> None:
        """Add to a persistent counter (one transaction in ``counters.db``); counting never fails a call."""
        if self._store() is None:
            return
        try:
            con = self._counters_db(create=True)
            try:
                con.execute("INSERT INTO counters (name, value) VALUES (?, ?) "
                            "ON CONFLICT (name) DO UPDATE SET value = value + excluded.value", (counter, amount))
            finally:
                con.close()
        except Exception as exc:
            self.warn_once("write", f"local cache {self.directory}: write failed ({exc}); "
                                    "new entries stay in memory only")

    def counters(self) -> dict[str, int]:
        """All persistent counters by name (a row that is not a name and an integer is ignored)."""
        if self._store() is None:
            return {}
        try:
            con = self._counters_db(create=False)
            if con is None:
                return {}
            try:
                rows = con.execute("SELECT name, value FROM counters "
                                   "WHERE typeof(name) = 'text' AND typeof(value) = 'integer'").fetchall()
            finally:
                con.close()
        except Exception as exc:
            self.warn_once("counters", f"local cache {self.directory}: counters unreadable ({exc})")
            return {}
        return dict(rows)

    def _clear_counters(self) -> None:
        try:
            con = self._counters_db(create=False)
            if con is not None:
                try:
                    con.execute("DELETE FROM counters")
                finally:
                    con.close()
        except Exception:  # unreadable: remove it, the next count starts a new one
            _unlink(self.directory / COUNTERS_DB)

    def close(self) -> None:
        """Close the SQLite connection (reopened on next use)."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None


def _is_key(key: str) -> bool:
    try:
        check_key(key)
        return True
    except ValueError:
        return False


def _regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
