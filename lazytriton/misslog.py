"""Reading the miss log (``misses.jsonl``): bounded, line by line, from a regular file only.

The runtime appends one JSON line per JIT compile (about 300 bytes);
``prewarm --from-misses`` and ``cache stats`` read it. It may come from
another machine or have been replaced by someone else, so a reader:

- opens it without blocking (``O_NONBLOCK``) and reads it only when the open
  descriptor is a regular file: a FIFO, a directory or a device is
  ``NotRegularFile``, never a hang;
- reads at most ``MISS_LOG_MAX_BYTES`` (64 MiB, some 200,000 misses) and says
  so when it stops there (``truncated``);
- holds at most one line of ``MISS_LOG_MAX_LINE_BYTES`` (64 KiB) at a time: a
  longer line is skipped and reported with its number, as is a line that is
  not UTF-8.

Memory stays within a line plus one read chunk, whatever the file's size.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from lazytriton.fsutil import describe_mode
from lazytriton.record import NamedTuple

MISS_LOG_MAX_BYTES = 64 << 20
MISS_LOG_MAX_LINE_BYTES = 64 << 10
_CHUNK = 1 << 20


class NotRegularFile(OSError):
    """The miss log's path names a FIFO, a directory, a device or a socket: it is not read."""


class Line(NamedTuple):
    """One line of a miss log: its number (from 1), its text, or None and why (``problem``)."""

    number: int
    text: str | None
    problem: str = ""


class MissLog:
    """The lines of one miss log, read within the bounds above; ``truncated`` once the byte bound stopped it.

    ``follow_symlinks=False`` refuses a link at the last component (ELOOP),
    as the runtime's writer does for the cache dir's own miss log.
    """

    def __init__(self, path: str | os.PathLike[str], follow_symlinks: bool = True,
                 max_bytes: int = MISS_LOG_MAX_BYTES, max_line_bytes: int = MISS_LOG_MAX_LINE_BYTES) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_line_bytes = max_line_bytes
        self.truncated = False
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        if not follow_symlinks:
            flags |= getattr(os, "O_NOFOLLOW", 0)
        self._fd = os.open(self.path, flags)
        mode = os.fstat(self._fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(self._fd)
            raise NotRegularFile(errno.EINVAL, f"{describe_mode(mode)}, not a regular file", str(self.path))

    def __iter__(self) -> Iterator[Line]:
        number, pending, too_long, left = 0, bytearray(), False, self.max_bytes
        while left > 0:
            chunk = os.read(self._fd, min(_CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                number += 1
                too_long = too_long or len(pending) + end - start > self.max_line_bytes
                yield self._line(number, b"" if too_long else bytes(pending + chunk[start:end]), too_long)
                pending.clear()
                too_long, start = False, end + 1
            if not too_long:
                pending += chunk[start:]
                if len(pending) > self.max_line_bytes:
                    too_long = True
                    pending.clear()
        else:
            self.truncated = bool(os.read(self._fd, 1))
        if too_long or (pending and not self.truncated):  # a line cut by the byte bound is not read
            yield self._line(number + 1, bytes(pending), too_long)

    def _line(self, number: int, data: bytes, too_long: bool) -> Line:
        if too_long:
            return Line(number, None, f"longer than {self.max_line_bytes} bytes (a logged miss is a few hundred)")
        try:
            return Line(number, data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return Line(number, None, f"not UTF-8 (byte 0x{data[exc.start]:02x} at column {exc.start + 1})")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> MissLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def truncation_note(self) -> str:
        """What a reader says when the byte bound stopped it."""
        return (f"{self.path}: read the first {self.max_bytes >> 20} MiB only (the bound on a miss log); "
                "the rest is not read")


def summarize(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The miss log's non-blank lines (``cache stats``), read within the bounds, never through a link.

    ``complete`` is False when the byte bound stopped the count; ``problem``
    says why the log was not read (a FIFO or a directory at its name, ...).
    """
    report: dict[str, Any] = {"where": str(path), "lines": 0, "complete": True, "problem": None}
    try:
        with MissLog(path, follow_symlinks=False) as log:
            report["lines"] = sum(1 for line in log if line.text is not None and line.text.strip())
            report["complete"] = not log.truncated
    except FileNotFoundError:
        pass
    except OSError as exc:
        report["problem"] = f"{exc.strerror}; not read"
    return report
