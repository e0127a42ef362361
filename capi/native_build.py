"""Build the C API's native core, ``liblazytriton_native.so``: images served with no Python in the process.

``build(directory)`` writes ``directory/lt_tables.h`` (``native_tables.header``: the
choice's tables from the Python descriptions and tuning tables), then compiles
``capi/native/*.c`` with the system C compiler into
``directory/liblazytriton_native.so``, linking libzstd, libdl and
libpthread, never libpython. Beyond the C library's headers it needs only
``zstd.h`` (Debian: ``apt-get install libzstd-dev``): the XXH3 digests of
the checksums and the key are its own (``native/lt_xxh3.c``). Its interface
is ``capi/lazytriton_native.h``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "native"
LIBRARY = "liblazytriton_native.so"
FRONT = HERE / "lt_front.c"  # lazytriton.h's API over the native core (includes lazytriton.c)
FLAGS = ["-std=gnu11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra"]
LIBS = ["-lzstd", "-ldl", "-lpthread", "-lm"]


def compiler() -> str:
    """The C compiler; RuntimeError naming what to install without one."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("building liblazytriton_native.so needs a C compiler (apt-get install gcc)")
    return cc


def write_tables(directory: Path) -> Path:
    """``directory/lt_tables.h``, generated now from the Python descriptions (``native_tables.header``)."""
    from lazytriton.capi import native_tables

    path = directory / "lt_tables.h"
    path.write_text(native_tables.header())
    return path


def build(directory: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """``directory/liblazytriton_native.so``, compiled now; RuntimeError with the compiler's output on failure."""
    directory.mkdir(parents=True, exist_ok=True)
    write_tables(directory)
    library = directory / LIBRARY
    sources = [str(path) for path in sorted(NATIVE.glob("*.c"))] + [str(FRONT)]
    command = [compiler(), *FLAGS, f"-Wl,-soname,{LIBRARY}", *extra_flags, f"-I{NATIVE}", f"-I{HERE}",
               f"-I{directory}", *sources, *LIBS, "-o", str(library)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building {LIBRARY} failed:\n{' '.join(command)}\n{done.stderr}")
    return library
