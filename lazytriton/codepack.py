"""The package's modules from one file: a code pack that a fresh process imports from without searching.

A process served from an image imports ~50 of lazytriton's modules before
its first result. Python's path finder spends ~60-80 µs on each beyond
unmarshalling and running it (its pure-Python search, stat calls, the .pyc
opened, read and checked): ~3.5 ms of a ~17 ms cold start. The code pack
holds every module of an installed lazytriton compiled, in one file beside
the package's own bytecode (``lazytriton/__pycache__/lazytriton.<cache
tag>.ltpack``). ``import lazytriton`` puts a finder first on ``sys.meta_path``
that serves the package's modules from it: one ``stat`` of the module's
source and one ``pread``.

What it takes from the pack, and when. The pack records, for each module,
its source's size and modification time (Python's rule for a .pyc); a module
whose source no longer matches is imported as Python would, from its file,
and so is every module when the pack is missing, was built by another
Python (magic number, optimisation level) or for another folder (the code's
file names are the sources' paths), or fails a check of its header, index or
the module's own checksum. The pack is never required: ``LAZYTRITON_CODEPACK=0``
turns it off (read here, at import).

Trust. The pack is the package's own bytecode, in the package's
``__pycache__``: as trusted as the package's files and .pyc files, which
Python runs from the same folder. It is written only by
``codepack_build.build``, to a temporary file renamed into place (a killed
build leaves the old pack or none), never read from the cache dir or a
shared tier.

Who builds it (``codepack_build``). ``lazytriton prewarm --helpers`` (a
deployment image's build, in the foreground), and the first GPU use of a
process (``on_first_use``, beside the compiled helpers), in a detached
background process, where the package's ``__pycache__`` is writable and
Python writes bytecode (``sys.dont_write_bytecode`` unset). Only a regular
install has a pack: a checkout or an editable install maps folders from
elsewhere into the package, and imports as Python does.

File layout: ``HEADER`` (little-endian: magic, format, Python's magic number,
optimisation level, the package folder's length, the index's length and
xxh3-64), the package folder (UTF-8), the index (``marshal``: a dict of module
name to (source path relative to the folder, "/"-separated; is a package;
source mtime in ns; source size; the code's offset, length and xxh3-64)), then
each module's code (``marshal``). This module reads it; ``codepack_build``
writes it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import marshal
import os
import struct
import sys
from collections.abc import Sequence
from types import CodeType, ModuleType
from typing import Any

PACKAGE = "lazytriton"
MAGIC = b"LTPK"
FORMAT = 2
VARIABLE = "LAZYTRITON_CODEPACK"
HEADER = struct.Struct("<4sI4sBIIQ")  # magic, format, python magic, optimize, folder bytes, index bytes, index sum
MAX_FOLDER = 1 << 12
MAX_INDEX = 1 << 22
MAX_CODE = 1 << 26  # one module's code: 64 MiB (lazytriton's largest is ~70 KB)
FAILED_SUFFIX = ".failed"
# The folders pyproject maps into the package (at the top of a checkout, inside a regular install).
MAPPED_FOLDERS = ("kernels", "cache_format", "prewarm", "capi")
# The background build's program (``-c``: the working directory, the package's parent, first on sys.path).
BUILDER = "import sys; from lazytriton import codepack_build; sys.exit(codepack_build.main(sys.argv[1:]))"


def checksum(data: bytes) -> int:
    """The pack's checksum of its index and of each module's code: xxh3-64 (~15x zlib's CRC-32 on this code)."""
    import xxhash  # here, not at the top: an install without a pack never needs it to import

    return int(xxhash.xxh3_64_intdigest(data))


class PackError(ValueError):
    """A code pack that cannot be used: its bytes fail a check of the layout above."""


def pack_path(package_dir: str) -> str:
    """Where the pack of the package in ``package_dir`` is: its ``__pycache__`` (Python's prefix if one is set)."""
    cached = importlib.util.cache_from_source(os.path.join(package_dir, "__init__.py"))
    return os.path.join(os.path.dirname(cached), f"{PACKAGE}.{sys.implementation.cache_tag}.ltpack")


def package_dir() -> str:
    """The folder of the lazytriton this interpreter imports."""
    return os.path.dirname(os.path.abspath(sys.modules[PACKAGE].__file__ or ""))


def disabled() -> bool:
    return os.environ.get(VARIABLE, "1").strip().lower() in ("0", "false", "no", "off")


def regular_install(folder: str, mapped: Sequence[str] = MAPPED_FOLDERS) -> bool:
    """Whether every mapped folder (``kernels``, ...) sits inside the package folder, as a regular install has it."""
    return all(os.path.isfile(os.path.join(folder, name, "__init__.py")) for name in mapped)


def decode(header: bytes, rest: bytes) -> tuple[str, dict[Any, Any]]:
    """The package folder and the index from a pack's first bytes; PackError for anything else.

    ``header`` is ``HEADER.size`` bytes, ``rest`` at least the folder and the index after it. The index's entries
    are not checked here (``PackFinder.entry`` checks one when asked). Nothing here runs code: the index holds only
    strings, ints and bools.
    """
    if len(header) != HEADER.size:
        raise PackError("short header")
    magic, version, python_magic, optimize, folder_bytes, index_bytes, index_sum = HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT:
        raise PackError("not a code pack of this format")
    if python_magic != importlib.util.MAGIC_NUMBER or optimize != sys.flags.optimize:
        raise PackError("built by another Python or optimisation level")
    if folder_bytes > MAX_FOLDER or index_bytes > MAX_INDEX or len(rest) < folder_bytes + index_bytes:
        raise PackError("folder or index out of bounds")
    index = rest[folder_bytes:folder_bytes + index_bytes]
    if checksum(index) != index_sum:
        raise PackError("index checksum mismatch")
    try:
        folder = rest[:folder_bytes].decode()
        entries = marshal.loads(index)
    except (UnicodeDecodeError, EOFError, ValueError, TypeError, MemoryError) as exc:  # MemoryError: a crafted
        raise PackError(f"unreadable folder or index: {exc!r}") from exc  # length, past a memory limit
    if type(entries) is not dict:
        raise PackError("index is not a table")
    return folder, entries


def _checked(entry: object) -> tuple[str, bool, int, int, int, int, int] | None:
    """An index entry of the layout's shape (a bad number then fails the lookup's stat, read or checks), else None."""
    if type(entry) is not tuple or len(entry) != 7:
        return None
    path = entry[0]
    if type(path) is not str or not path.endswith(".py") or path.startswith("/") or "/../" in f"/{path}":
        return None
    return entry  # type: ignore[return-value]


class PackFinder:
    """Finds the package's modules in its code pack (first on ``sys.meta_path``) and loads them from it."""

    def __init__(self, root: str, fd: int, entries: dict[Any, Any]) -> None:
        self.root = root
        self.fd = fd
        self.entries = entries
        self.prefix = PACKAGE + "."
        plain = sys.pycache_prefix is None and not sys.flags.optimize and sys.implementation.cache_tag
        self.pyc_tag = f".{sys.implementation.cache_tag}.pyc" if plain else None
        self.served = 0
        self.stale: set[str] = set()  # modules whose source no longer matches the pack

    def entry(self, fullname: str) -> tuple[str, bool, int, int, int, int, int] | None:
        if not fullname.startswith(self.prefix):
            return None
        return _checked(self.entries.get(fullname))

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        entry = self.entry(fullname)
        if entry is None:
            return None
        relative, is_package, mtime_ns, size, offset, length, code_sum = entry
        source = os.path.join(self.root, *relative.split("/"))
        try:
            st = os.stat(source)
            if st.st_mtime_ns != mtime_ns or st.st_size != size:
                self.stale.add(fullname)
                return None
            if not 0 <= length <= MAX_CODE:
                return None
            data = os.pread(self.fd, length, offset)
        except (OSError, OverflowError, TypeError, ValueError):
            return None
        if len(data) != length or checksum(data) != code_sum:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=source, loader_state=data,  # type: ignore[arg-type]
                                              is_package=bool(is_package))
        spec.has_location = True
        if self.pyc_tag is not None:  # Python's name for the module's .pyc (``__cached__``), without its search
            head, tail = os.path.split(source)
            spec.cached = os.path.join(head, "__pycache__", tail[:-3] + self.pyc_tag)
        if is_package:
            spec.submodule_search_locations = [os.path.dirname(source)]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        assert spec is not None
        code = None
        if isinstance(spec.loader_state, bytes):
            try:
                code = marshal.loads(spec.loader_state)
            except (EOFError, ValueError, TypeError):
                code = None
            spec.loader_state = None  # the bytes are not kept once run
        if isinstance(code, CodeType):
            self.served += 1
        else:
            code = self.get_code(module.__name__)
        exec(code, module.__dict__)  # noqa: S102 - the package's own bytecode, as Python runs a .pyc

    # What inspect, linecache and pdb ask a loader.
    def get_filename(self, fullname: str) -> str:
        entry = self.entry(fullname)
        if entry is None:
            raise ImportError(f"{fullname} is not in the code pack", name=fullname)
        return os.path.join(self.root, *entry[0].split("/"))

    def get_source(self, fullname: str) -> str:
        with open(self.get_filename(fullname), "rb") as f:
            return importlib.util.decode_source(f.read())

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        with open(path, "rb") as f:
            return compile(f.read(), path, "exec", dont_inherit=True)

    def is_package(self, fullname: str) -> bool:
        entry = self.entry(fullname)
        return entry is not None and bool(entry[1])


def install(folder: str) -> PackFinder | None:
    """Put the pack's finder first on ``sys.meta_path`` where the install in ``folder`` has a usable pack.

    The finder, or None. Costs one ``open`` and two ``pread`` of the header
    and index (~10 KB). Any problem leaves the import system as it was.
    """
    if disabled() or not regular_install(folder):
        return None
    try:
        fd = os.open(pack_path(folder), os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        header = os.pread(fd, HEADER.size, 0)
        sizes = HEADER.unpack(header)[4:6] if len(header) == HEADER.size else (0, 0)
        root, entries = decode(header, os.pread(fd, min(sum(sizes), MAX_FOLDER + MAX_INDEX), HEADER.size))
        if root != folder:
            raise PackError("built for another folder")
    except (OSError, PackError):
        os.close(fd)
        return None
    finder = PackFinder(folder, fd, entries)
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]
    return finder


def finder() -> PackFinder | None:
    """The pack finder ``import lazytriton`` installed in this process, or None."""
    return next((f for f in sys.meta_path if isinstance(f, PackFinder)), None)


_first_use_done: list[bool] = []


def python_executable() -> str | None:
    """The interpreter to run a background build with (this one's).

    None where this process is not a plain Python (an embedding program's ``sys.executable``).
    """
    executable = sys.executable
    name = os.path.basename(executable or "")
    if name.startswith("python") and all(c.isdigit() or c == "." for c in name[6:]) and os.access(executable, os.X_OK):
        return executable
    return None


def wanted(folder: str) -> bool:
    """Whether the install in ``folder`` should get a (new) pack: none in use, or one with stale modules.

    A few ``stat`` calls; false where the pack is off, Python writes no
    bytecode, the install is not a regular one, a background build failed
    (its marker beside the pack) or the ``__pycache__`` is not writable.
    """
    if disabled() or sys.dont_write_bytecode or not regular_install(folder):
        return False
    found = finder()
    if found is not None and found.root == folder and not found.stale:
        return False
    target = pack_path(folder)
    if os.path.lexists(target + FAILED_SUFFIX):
        return False
    cache = os.path.dirname(target)
    return os.access(cache if os.path.isdir(cache) else folder, os.W_OK)


def interpreter_flags() -> list[str]:
    """The flags of this interpreter that name its pack (``pack_path``, ``HEADER``'s optimisation level)."""
    flags = ["-" + "O" * sys.flags.optimize] if sys.flags.optimize else []
    return flags + (["-X", f"pycache_prefix={sys.pycache_prefix}"] if sys.pycache_prefix else [])


def on_first_use() -> bool:
    """Once a process (its first GPU use): start the pack's build in a detached process where ``wanted``.

    The build runs ``codepack_build.main(["--background", folder])`` in a new
    interpreter started in the package's parent folder (so that it builds
    this install, not a checkout in the working directory); no call waits for
    it, the next process imports from the pack.
    """
    if _first_use_done:
        return False
    _first_use_done.append(True)
    here = package_dir()
    executable = python_executable() if wanted(here) else None
    if executable is None:
        return False
    import subprocess
    import threading

    argv = [executable, *interpreter_flags(), "-c", BUILDER, "--background", here]
    env = dict(os.environ, **{VARIABLE: "0"})  # the builder imports the sources, never an old pack

    def run() -> None:
        try:
            subprocess.Popen(argv, cwd=os.path.dirname(here), stdin=subprocess.DEVNULL,  # noqa: S603
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env=env).wait()
        except OSError:
            pass  # the pack is optional: the next process tries again

    threading.Thread(target=run, name="lazytriton-codepack-build", daemon=True).start()
    return True
