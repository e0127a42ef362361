"""The work directory of a prewarm run: built entries, one file per key, and the failures.

``OUT.ltimg.work/`` sits beside the image being built:

    entries/<key>.entry   one encoded Entry per built variant, written atomically
                          (temp file in the same folder, fsync, rename) by the
                          worker that compiled it, the moment it is done
    failures.jsonl        one JSON object per variant that failed in this run:
                          {"variant", "key", "error"}
    logs/worker-N.log     what worker N's compiler printed for its current variant
    logs/fork-server.log  what the pool's fork server printed (its imports' errors)

A prewarm killed at any instant leaves only whole entry files behind (a stray
``*.tmp`` is ignored and removed on the next run), so running it again builds
only what is missing. An entry file is verified (checksum, key) before it is
reused; a damaged one is removed and rebuilt.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from lazytriton.cache_format import Entry, EntryError
from lazytriton.fsutil import write_atomically
from lazytriton.keys import check_key

log = logging.getLogger("lazytriton.prewarm")

ENTRY_SUFFIX = ".entry"
FAILURES = "failures.jsonl"
WORK_SUFFIX = ".work"


def work_dir_for(out: Path) -> Path:
    """The work directory of the image ``out`` (``OUT.work`` beside it)."""
    return out.with_name(out.name + WORK_SUFFIX)


class WorkDir:
    """Entries built so far and the failures of the current run, in one folder."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.entries = self.path / "entries"
        self.logs = self.path / "logs"
        self.failures = self.path / FAILURES

    def create(self) -> WorkDir:
        """Make the folders, and drop temp files a killed run left behind."""
        self.entries.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        for stray in self.entries.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                stray.unlink()
        return self

    def entry_path(self, key: str) -> Path:
        return self.entries / f"{check_key(key)}{ENTRY_SUFFIX}"

    def write(self, entry: Entry) -> Path:
        """Store a built entry (atomically)."""
        path = self.entry_path(entry.key)
        write_atomically(path, [entry.encode()])
        return path

    def read(self, key: str) -> Entry | None:
        """The verified entry for ``key``, or None; a damaged file is removed (and so rebuilt)."""
        path = self.entry_path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return Entry.decode(data, expected_key=key)
        except EntryError as exc:
            log.warning("work entry %s is damaged (%s); it will be rebuilt", path, exc)
            with contextlib.suppress(OSError):
                path.unlink()
            return None

    def keys(self) -> Iterator[str]:
        """Keys of the entry files present (unverified), in name order."""
        if not self.entries.is_dir():
            return iter(())
        return (p.name[:-len(ENTRY_SUFFIX)] for p in sorted(self.entries.glob(f"*{ENTRY_SUFFIX}"))
                if not p.name.startswith("."))

    def clear_failures(self) -> None:
        """Forget the failures of an earlier run (this run retries them)."""
        with contextlib.suppress(FileNotFoundError):
            self.failures.unlink()

    def record_failure(self, variant: str, key: str, error: str) -> None:
        """Append one failure as a JSON line (one write: a crash never leaves half a line)."""
        line = json.dumps({"variant": variant, "key": key, "error": error}, sort_keys=True) + "\n"
        fd = os.open(self.failures, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def read_failures(self) -> list[dict[str, str]]:
        """The failures recorded in this run so far."""
        if not self.failures.exists():
            return []
        return [json.loads(line) for line in self.failures.read_text().splitlines() if line.strip()]

    def worker_log(self, number: int) -> Path:
        return self.logs / f"worker-{number}.log"

    def fork_server_log(self) -> Path:
        return self.logs / "fork-server.log"
