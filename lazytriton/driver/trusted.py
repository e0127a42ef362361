"""Files trusted as far as the user's own: opened through a chain of folders without following links.

Loading a compiled helper from the cache dir runs code from disk, so a file
is trusted only when it is a regular file and it and every folder from the
cache dir down to it are owned by the user or by root and writable by nobody
else. ``walk`` opens each step relative to the last (``openat``, links never
followed), so what is checked is what is then loaded (through
``/proc/self/fd``); ``load_extension`` imports a module from such a path.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.machinery
import importlib.util
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_extension(name: str, where: str, path: Path) -> Any:
    """Import the extension module ``name`` from ``where`` (a path the loader opens; ``path`` names it).

    Raises what the import raises (built for another Python, a broken file);
    the module's ``__file__`` is ``path``.
    """
    loader = importlib.machinery.ExtensionFileLoader(name, where)
    spec = importlib.util.spec_from_file_location(name, where, loader=loader)
    if spec is None:
        raise ImportError(f"no module spec for {where}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    module.__file__ = str(path)
    return module


ABSENT = ""  # walk's problem when a part does not exist (nothing to refuse)


def owners() -> tuple[int, ...]:
    """Owners whose files are trusted: the user, and root (who can change any of the user's files anyway)."""
    return (os.geteuid(), 0)


def problem_of(st: os.stat_result, path: str | Path, directory: bool) -> str | None:
    """Why a file or folder is not trusted (pure, from its ``stat``), or None."""
    if directory and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if not directory and not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid not in owners():
        return f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable:
        return f"{path} is writable by {' and '.join(writable)}"
    return None


def walk(cache_dir: Path, parts: Sequence[str], last_is_file: bool) -> tuple[list[int], str | None]:
    """Open the cache dir, then each part below it relative to the last (links never followed); (fds, problem).

    problem: None when every step exists and is trusted, ``ABSENT`` when a
    step does not exist, else why it is refused. The caller closes the fds.
    """
    fds: list[int] = []
    path = os.fspath(cache_dir)
    try:
        fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))  # the user named it: links followed
        problem = problem_of(os.fstat(fds[-1]), path, True)
        for i, name in enumerate(parts):
            if problem is not None:
                return fds, problem
            path = os.path.join(path, name)
            is_file = last_is_file and i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if is_file else os.O_DIRECTORY)
            fds.append(os.open(name, flags, dir_fd=fds[-1]))  # O_NONBLOCK: a FIFO opens at once, then is refused
            problem = problem_of(os.fstat(fds[-1]), path, not is_file)
        return fds, problem
    except FileNotFoundError:
        return fds, ABSENT
    except OSError as exc:  # a link (ELOOP, or ENOTDIR for a link to a folder), a file for a folder, ...
        with contextlib.suppress(OSError):
            if fds and stat.S_ISLNK(os.lstat(os.path.basename(path), dir_fd=fds[-1]).st_mode):
                return fds, f"{path} is a symbolic link"
        if exc.errno == errno.ENOTDIR:
            return fds, f"{path} is not a folder"
        return fds, f"{path} cannot be opened ({exc.strerror})"


def close_all(fds: Sequence[int]) -> None:
    """Close each descriptor, ignoring errors."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
