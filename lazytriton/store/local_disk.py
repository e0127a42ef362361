"""The local tier's file I/O: diskcache's Disk, narrowed to str keys and raw bytes.

diskcache decodes every row it reads through its ``Disk``: a key stored with
``raw = 0`` and a value stored in its pickle mode are unpickled. A cache dir
written by someone else (copied, or world-writable) could then run code in
any process that lists or reads it. ``RawDisk`` never unpickles anything:

- a key that is not a raw ``str`` comes back as a ``DamagedKey``, which the
  tier skips when listing and which ``Cache.delete`` accepts to drop exactly
  that row (its stored bytes, never decoded);
- a value that is not raw bytes (pickle, text, an int, a float) raises
  ``DamagedRow``, which the tier turns into a dropped, counted, rebuilt entry;
- a value file is read only under the name diskcache itself gives it (two hex
  folders, a hex name), without following a link, only when it is a regular
  file and within the entry size bound; a forged row naming another file makes
  the row damaged, and dropping it removes no file outside the cache;
- the orphan sweep (``sweep_value_files``) removes only regular files named as
  diskcache names value files, in folders named as it names them, each folder
  opened from its parent's descriptor without following a link: a cache dir
  whose ``entries/`` already held other files, or a link in it, loses nothing.

This module imports diskcache, so the tier imports it on first use only.
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import stat
from typing import Any

import diskcache
from diskcache.core import UNKNOWN

from lazytriton.cache_format.entry import MAX_ENTRY_BYTES
from lazytriton.fsutil import read_fd_bounded

# diskcache's value modes (diskcache.core.MODE_*): bytes are stored inline (raw) or in a file (binary).
MODE_RAW, MODE_BINARY = 1, 2
MODE_NAMES = {0: "none", 1: "raw", 2: "binary", 3: "text", 4: "pickle"}

# The names diskcache.Disk.filename gives value files: "ab/cd/<28 hex digits>.val".
VALUE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
_FOLDER = re.compile(r"[0-9a-f]{2}")
_VALUE_NAME = re.compile(r"[0-9a-f]{28}\.val")
_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class DamagedRow(Exception):
    """A row of the entries table that is not a str key holding raw bytes (never decoded)."""


class DamagedKey:
    """A key stored some other way than as a raw str: kept as stored, never decoded."""

    __slots__ = ("db_key", "raw")

    def __init__(self, db_key: Any, raw: Any) -> None:
        self.db_key = db_key
        self.raw = raw

    def __str__(self) -> str:
        return describe_key(self.db_key, self.raw)


def is_str_key(db_key: Any, raw: Any) -> bool:
    """True for a key stored as diskcache stores a str: a text key with ``raw = 1``."""
    return type(db_key) is str and type(raw) is int and raw == 1


def describe_key(db_key: Any, raw: Any) -> str:
    """What a damaged key is, in words (``a pickled key``, ``a bytes key``), without decoding it."""
    if raw == 0:
        return "a pickled key (never unpickled)"
    if type(raw) is not int or raw != 1:
        return f"a key with raw flag {raw!r}"
    return f"a {type(db_key).__name__} key"


def describe_value(mode: Any, value: Any) -> str:
    """Why a stored value is not raw bytes, in words."""
    name = MODE_NAMES.get(mode, repr(mode))
    if mode == MODE_RAW:
        return f"value stored as {type(value).__name__}, not raw bytes"
    return f"value stored in diskcache's {name} mode, not as raw bytes"


def value_file_name_ok(filename: Any) -> bool:
    """True for a name diskcache gives value files, relative to the cache directory."""
    return isinstance(filename, str) and VALUE_FILE.fullmatch(filename) is not None


def read_value_file(directory: str, filename: Any) -> bytes:
    """The bytes of a value file: named as diskcache names them, a regular file, not a link, bounded.

    Raises DamagedRow for anything else; OSError (a file removed meanwhile) is
    left to diskcache, which reads it as a miss.
    """
    if not value_file_name_ok(filename):
        raise DamagedRow(f"value file name {filename!r} is not one diskcache writes")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(directory, filename), flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DamagedRow(f"value file {filename} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DamagedRow(f"value file {filename} is not a regular file")
        if info.st_size > MAX_ENTRY_BYTES:
            raise DamagedRow(f"value file {filename} holds {info.st_size} bytes, over the {MAX_ENTRY_BYTES} bound")
        return read_fd_bounded(fd, info.st_size)  # a file that grew is read one byte past its size, then refused
    finally:
        os.close(fd)


class RawDisk(diskcache.Disk):  # type: ignore[misc]
    """diskcache's Disk for str keys and bytes values only; see the module docstring for why."""

    def __init__(self, directory: str, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self.root = directory

    def put(self, key: Any) -> tuple[Any, bool]:
        if isinstance(key, DamagedKey):  # Cache.delete of a damaged row: match it exactly as stored
            return key.db_key, key.raw
        if type(key) is not str:
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        return key, True

    def get(self, key: Any, raw: Any) -> Any:
        return key if is_str_key(key, raw) else DamagedKey(key, raw)

    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[Any, ...]:
        if read or type(value) is not bytes:
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        return super().store(value, False, key=key)  # type: ignore[no-any-return]

    def fetch(self, mode: Any, filename: Any, value: Any, read: bool) -> bytes:
        if read:
            raise TypeError("the local tier reads values as bytes, never as open files")
        return row_bytes(self.root, mode, filename, value)

    def remove(self, file_path: Any) -> None:
        if value_file_name_ok(file_path):  # a forged row never makes a drop delete a file of its choosing
            super().remove(file_path)


def index_rows(directory: str, where: str = "", params: tuple[Any, ...] = (),
               columns: str = "rowid, key, raw, mode, filename, value") -> list[tuple[Any, ...]]:
    """Rows (by default rowid, key, raw, mode, filename, value) of diskcache's Cache table, read as stored.

    Its own short-lived connection, SELECT only: no access time is touched, no
    lock is held for long, nothing is decoded. The table layout is diskcache's
    on-disk format (stable since diskcache 4).
    """
    con = sqlite3.connect(os.path.join(directory, "cache.db"), timeout=10, isolation_level=None)
    try:
        return con.execute(f"SELECT {columns} FROM Cache {where}", params).fetchall()
    finally:
        con.close()


def delete_rows(directory: str, rowids: list[int]) -> int:
    """Delete rows by rowid in one transaction, then their value files (diskcache's names only); how many.

    For damaged rows, which ``Cache.delete`` cannot always match (a NULL key
    or raw flag); diskcache's triggers keep its count and size right.
    """
    if not rowids:
        return 0
    con = sqlite3.connect(os.path.join(directory, "cache.db"), timeout=10, isolation_level=None)
    try:
        marks = ",".join("?" * len(rowids))
        con.execute("BEGIN IMMEDIATE")
        try:
            names = [name for (name,) in con.execute(f"SELECT filename FROM Cache WHERE rowid IN ({marks})", rowids)]
            deleted = con.execute(f"DELETE FROM Cache WHERE rowid IN ({marks})", rowids).rowcount
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.close()
    for name in names:
        if value_file_name_ok(name):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
    return int(deleted)


def legacy_counter(key: Any, raw: Any, mode: Any, value: Any) -> str | None:
    """The name of a counter an older lazytriton kept among the entries (``counter:<name>``, an int), else None."""
    if is_str_key(key, raw) and key.startswith("counter:") and mode == MODE_RAW and type(value) is int:
        return str(key[len("counter:"):])
    return None


def value_shape_ok(mode: Any, filename: Any, value: Any) -> bool:
    """True when a row stores raw bytes inline or in a value file named as diskcache names them."""
    if mode == MODE_RAW:
        return type(value) is bytes
    return mode == MODE_BINARY and value is None and value_file_name_ok(filename)


def row_bytes(directory: str, mode: Any, filename: Any, value: Any) -> bytes:
    """A row's stored bytes (DamagedRow when it holds anything else); never decodes."""
    if mode == MODE_RAW and type(value) is bytes:
        return value
    if mode == MODE_BINARY and value is None:
        return read_value_file(directory, filename)
    raise DamagedRow(describe_value(mode, value))


def sweep_value_files(directory: str, keep: set[str], grace_s: float, now: float) -> tuple[int, int]:
    """Remove value files whose name is not in ``keep`` and that are ``grace_s`` old; (files removed, their bytes).

    Only what diskcache writes: regular files named ``<28 hex>.val`` in
    folders ``<2 hex>/<2 hex>``; nothing else in ``directory`` is looked at.
    ``directory`` and each folder are opened without following a link (a
    symlinked ``entries/`` or ``entries/ab`` is skipped whole), and files are
    removed relative to their folder's descriptor, so a folder swapped for a
    link meanwhile cannot redirect a removal. Emptied folders are removed.
    """
    try:
        top = os.open(directory, _FOLDER_FLAGS)
    except OSError:  # missing, or a link: nothing is swept through it
        return 0, 0
    removed = freed = 0
    try:
        for first in _folders(top):
            outer = _open_folder(first, top)
            if outer is None:
                continue
            try:
                for second in _folders(outer):
                    inner = _open_folder(second, outer)
                    if inner is None:
                        continue
                    try:
                        for name in _names(inner):
                            if _VALUE_NAME.fullmatch(name) and f"{first}/{second}/{name}" not in keep:
                                size = _unlink_if_old(name, inner, grace_s, now)
                                removed, freed = removed + (size is not None), freed + (size or 0)
                    finally:
                        os.close(inner)
                    _rmdir_if_empty(second, outer)
            finally:
                os.close(outer)
            _rmdir_if_empty(first, top)
    finally:
        os.close(top)
    return removed, freed


def _names(folder: int) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _folders(folder: int) -> list[str]:
    return [name for name in _names(folder) if _FOLDER.fullmatch(name)]


def _open_folder(name: str, parent: int) -> int | None:
    try:
        return os.open(name, _FOLDER_FLAGS, dir_fd=parent)
    except OSError:  # a link (ELOOP), a file (ENOTDIR), gone
        return None


def _unlink_if_old(name: str, folder: int, grace_s: float, now: float) -> int | None:
    """Unlink a regular file at least ``grace_s`` old; its size, or None when it stays."""
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < grace_s:
            return None
        os.unlink(name, dir_fd=folder)
    except OSError:
        return None
    return info.st_size


def _rmdir_if_empty(name: str, parent: int) -> None:
    try:
        os.rmdir(name, dir_fd=parent)  # only when empty
    except OSError:
        pass
