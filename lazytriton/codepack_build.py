"""Writing the code pack (codepack.py): every module of an installed lazytriton compiled into one file.

``lazytriton prewarm --helpers`` builds it in the foreground
(``build_installed``); the first GPU use of a process where it is missing or
stale starts ``main(["--background", folder])`` in a detached interpreter
(``codepack.on_first_use``; one builder at a time, by a lock beside the
pack), which writes a failure marker beside the pack when it cannot build,
so that later processes do not try again until a foreground build succeeds.
``state`` is what ``lazytriton info`` reports.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import sys
from collections.abc import Iterator, Sequence

from lazytriton import codepack


def modules(package: str, folder: str) -> Iterator[tuple[str, str, bool]]:
    """(module name, source path relative to ``folder``, "/"-separated, is a package) of every module under it.

    Folders are walked in name order, each only if it is a package (holds
    ``__init__.py``), as the import system would find them.
    """
    for here, dirs, files in os.walk(folder):
        relative = os.path.relpath(here, folder)
        parts = [] if relative == "." else relative.split(os.sep)
        dirs[:] = sorted(d for d in dirs if d.isidentifier() and os.path.isfile(os.path.join(here, d, "__init__.py")))
        for file in sorted(files):
            stem, ext = os.path.splitext(file)
            if ext != ".py" or not stem.isidentifier():
                continue
            is_package = stem == "__init__"
            name = ".".join([package, *parts] + ([] if is_package else [stem]))
            yield name, "/".join([*parts, file]), is_package


def encode(folder: str, compiled: Sequence[tuple[str, str, bool, int, int, bytes]]) -> bytes:
    """A pack's bytes: ``compiled`` is (name, relative source path, is a package, mtime_ns, size, marshalled code)."""
    folder_bytes = folder.encode()

    def index_of(start: int) -> bytes:
        entries = {}
        offset = start
        for name, path, is_package, mtime_ns, size, code in compiled:
            entries[name] = (path, is_package, mtime_ns, size, offset, len(code), codepack.checksum(code))
            offset += len(code)
        return marshal.dumps(entries)

    start = codepack.HEADER.size + len(folder_bytes)
    index, length = index_of(start), -1
    while len(index) != length:  # the code starts after the index, whose length the offsets' width may change
        length = len(index)
        index = index_of(start + length)
    if len(folder_bytes) > codepack.MAX_FOLDER or len(index) > codepack.MAX_INDEX:
        raise ValueError(f"{len(compiled)} modules in {folder}: more than a code pack's index holds")
    header = codepack.HEADER.pack(codepack.MAGIC, codepack.FORMAT, importlib.util.MAGIC_NUMBER, sys.flags.optimize,
                                  len(folder_bytes), len(index), codepack.checksum(index))
    return b"".join([header, folder_bytes, index, *(code for *_, code in compiled)])


def build(package: str, folder: str, out: str | None = None) -> tuple[str, int]:
    """Compile every module of the package in ``folder`` into its pack, written atomically; (the pack's path, modules).

    A module whose source changes while it is read is left out (Python then
    imports it from its file). Raises OSError where the pack cannot be
    written, SyntaxError where a module does not compile.
    """
    compiled = []
    for name, relative, is_package in modules(package, folder):
        if name == package:
            continue  # imported before the finder exists
        path = os.path.join(folder, *relative.split("/"))
        before = os.stat(path)
        with open(path, "rb") as f:
            source = f.read()
        after = os.stat(path)
        if (before.st_mtime_ns, before.st_size) != (after.st_mtime_ns, after.st_size) or len(source) != after.st_size:
            continue
        code = compile(source, path, "exec", dont_inherit=True)
        compiled.append((name, relative, is_package, after.st_mtime_ns, after.st_size, marshal.dumps(code)))
    data = encode(folder, compiled)
    target = out or codepack.pack_path(folder)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    temporary = f"{target}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    return target, len(compiled)


def build_installed(background: bool = False) -> tuple[bool | None, str]:
    """Build the pack of the lazytriton this interpreter imports; (built, what happened, in words).

    True: written. None: nothing to build (not a regular install, or its folder not writable by this user). False:
    the error; with ``background`` also left in the failure marker, which stops further background builds until a
    foreground one succeeds.
    """
    here = codepack.package_dir()
    if not codepack.regular_install(here):
        return None, f"{here} is not a regular install (a checkout or an editable one): its modules import from files"
    target = codepack.pack_path(here)
    marker = target + codepack.FAILED_SUFFIX
    folder = os.path.dirname(target)
    if not os.access(folder if os.path.isdir(folder) else here, os.W_OK):  # a system install run by a user
        return None, f"{folder} is not writable here: no code pack (the modules import from their files)"
    try:
        path, count = build(codepack.PACKAGE, here)
    except (OSError, SyntaxError, ValueError) as exc:
        if background:
            try:
                with open(marker, "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}\n")
            except OSError:
                pass
        return False, f"cannot build {target}: {exc}"
    try:
        os.unlink(marker)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return False, f"wrote {path}, but cannot remove {marker}: {exc}"
    return True, f"wrote {path}: {count} modules"


def take_lock(target: str) -> int | None:
    """The fd of the builders' lock beside the pack (``<pack>.lock``), held; None when another builder holds it.

    Processes that start on one node at once each start a background build: the first takes the lock and builds,
    the others leave at once. A lock that cannot be made (a read-only folder) is no lock: -1.
    """
    import fcntl

    try:
        fd = os.open(target + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def main(argv: Sequence[str]) -> int:
    """Run a build; its exit status.

    ``[]`` prints what it did; ``["--background", FOLDER]`` (the first GPU use's build) prints nothing, and builds
    only if this interpreter imports the install in FOLDER.
    """
    args = list(argv)
    background = args[:1] == ["--background"]
    if background and args[1:] != [codepack.package_dir()]:
        return 2  # started for another install than the one this interpreter imports
    if background:
        target = codepack.pack_path(codepack.package_dir())
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        except OSError:
            pass  # the build says why
        if take_lock(target) is None:
            return 0  # another process is building it (this one's lock is released when it exits)
    built, message = build_installed(background)
    if not background:
        print(message if built else f"lazytriton codepack: {message}", file=sys.stdout if built else sys.stderr)
    return 0 if built else 1


def state(folder: str) -> tuple[str, str]:
    """(state, detail) of the install's pack, for ``lazytriton info``."""
    target = codepack.pack_path(folder)
    found = codepack.finder()
    if codepack.disabled():
        return "off", f"{codepack.VARIABLE}=0"
    if not codepack.regular_install(folder):
        return "none", "not a regular install: modules are imported from their files"
    if found is not None:
        stale = f", {len(found.stale)} stale (rebuilt on the next GPU use)" if found.stale else ""
        return "in use", f"{target}: {found.served} modules imported from it{stale}"
    if os.path.lexists(target + codepack.FAILED_SUFFIX):
        return "failed", f"{target + codepack.FAILED_SUFFIX} (lazytriton prewarm --helpers tries again)"
    if os.path.exists(target):
        return "unusable", f"{target} (another Python or folder, or damaged: rebuilt on the next GPU use)"
    return "not built", f"{target} (built on the first GPU use, or by lazytriton prewarm --helpers)"
