"""Crash-safe file writes (the image writer, prewarm's work dir, ``lazytriton tune``) and bounded reads."""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path


@functools.cache
def _umask() -> int:
    """The process's umask, read once (setting it to read it is racy, so only as a fallback)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike[str], parts: Iterable[bytes], mode: int = 0o666) -> None:
    """Write ``parts`` to a temp file beside ``path``, fsync, rename over it, fsync the folder.

    A reader sees the old file or the whole new one, never a part, whatever
    kills the writer; the file gets ``mode`` less the umask (0666 by default:
    mkstemp's 0600 would hide a shipped image from other users; 0777 for the
    compiled helpers' shared objects).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode & ~_umask())
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where the platform allows it
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_fd_bounded(fd: int, limit: int) -> bytes:
    """Read an open file to its end, but at most ``limit + 1`` bytes: one more than allowed shows a file that grew."""
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def describe_mode(mode: int) -> str:
    """What a file that is not a regular one is, in words (``a FIFO``, ``a directory``, ...)."""
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "a regular file" if stat.S_ISREG(mode) else "not a file"
