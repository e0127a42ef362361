"""Build flash_fwd's C++ warm-path tail: ``python -m lazytriton.kernels.flash_fwd.hotpath_build``.

It compiles ``_hotpath.cpp`` (a CPython extension using ATen, one
``METH_FASTCALL`` function) with the system C++ compiler against the running
torch's headers and libraries, and installs it into this package's folder
under a name carrying that torch's version (``hotpath.file_name``): another
torch never loads it. Without this step the runtime makes the same build
into the cache dir in the background on first GPU use (helpers.py); the
package's build takes precedence. What it saves: the
warm call's allocations and pointer reads from Python (~1.5 µs per torch
call on the H200 host, benchmarks/NOTES.md). No ninja, no setuptools: one
compiler command. When something is missing (a C++ compiler, Python's or
torch's headers, torch's libraries) the build says exactly what and where
it looked.

The launch from the plan is ``fastlaunch_build.PLAN_SOURCE``, written beside
the source as ``lt_plan.h``: both helpers compile the same text.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from lazytriton.driver import fastlaunch, fastlaunch_build, helpers
from lazytriton.kernels.flash_fwd import hotpath_record

SOURCE = Path(__file__).with_name("_hotpath.cpp")
LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")
HEADER = "torch/csrc/autograd/python_variable.h"  # the torch header the source needs first


class BuildError(RuntimeError):
    """What the build lacks, said plainly (no compiler, no headers, no libraries)."""


def find_compiler() -> str | None:
    """``$CXX``, else ``c++`` or ``g++`` or ``clang++`` on the PATH; None when there is none."""
    wanted = os.environ.get("CXX")
    if wanted:
        return shutil.which(wanted.split()[0]) and wanted
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    return None


def toolchain() -> tuple[str, list[str], list[str]]:
    """(compiler, include folders, library folders); BuildError listing everything missing."""
    import torch
    from torch.utils import cpp_extension

    missing = []
    compiler = find_compiler()
    if compiler is None:
        missing.append("a C++ compiler: none of $CXX, c++, g++, clang++ on the PATH (e.g. apt-get install g++)")
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        missing.append(f"Python's headers: no Python.h in {python_include} (e.g. apt-get install python3-dev)")
    includes = [str(p) for p in cpp_extension.include_paths()]
    if not any((Path(p) / HEADER).is_file() for p in includes):
        missing.append(f"torch {torch.__version__}'s C++ headers: no {HEADER} under {', '.join(includes)}")
    libraries = [str(p) for p in cpp_extension.library_paths()]
    for name in LIBRARIES:
        if not any((Path(p) / f"lib{name}.so").is_file() for p in libraries):
            missing.append(f"torch's library lib{name}.so: not in {', '.join(libraries)}")
    if missing:
        raise BuildError("cannot build the C++ warm path; missing:\n  " + "\n  ".join(missing))
    return str(compiler), [python_include, *includes], libraries


def command(compiler: str, source: Path, output: Path, includes: list[str], libraries: list[str],
            torch_version: str, cxx11_abi: bool, plan_version: int) -> list[str]:
    """The one compiler command: -O2, C++17, torch's ABI flag, linked against torch's libraries."""
    if not re.fullmatch(r"[A-Za-z0-9.+_-]+", torch_version):
        raise BuildError(f"torch version {torch_version!r}: expected letters, digits and .+_- only")
    return [*compiler.split(), "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}", f'-DLT_TORCH_VERSION="{torch_version}"',
            f"-DLT_PLAN_VERSION={plan_version}", *(f"-I{p}" for p in [str(source.parent), *includes]),
            str(source), "-o", str(output), *(f"-L{p}" for p in libraries),
            *(f"-Wl,-rpath,{p}" for p in libraries), *(f"-l{name}" for name in LIBRARIES), "-ldl"]


def build(directory: Path | None = None, verbose: bool = False, mode: int = 0o777) -> Path:
    """Compile and install the module into ``directory`` (default: this package's folder); its path.

    Written beside its final name and renamed, with ``mode`` less the umask: a running process keeps the module it
    loaded.
    """
    import torch

    compiler, includes, libraries = toolchain()
    target_dir = Path(directory) if directory is not None else Path(__file__).resolve().parent
    target = target_dir / helpers.module_file(hotpath_record.NAME, torch.__version__)
    with tempfile.TemporaryDirectory(prefix="lazytriton-hotpath-") as tmp:
        source = Path(tmp) / SOURCE.name
        shutil.copyfile(SOURCE, source)
        (Path(tmp) / "lt_plan.h").write_text(fastlaunch_build.PLAN_SOURCE)
        (Path(tmp) / "lt_record.h").write_text(hotpath_record.header())
        built = Path(tmp) / target.name
        argv = command(compiler, source, built, includes, libraries, torch.__version__,
                       bool(torch._C._GLIBCXX_USE_CXX11_ABI), fastlaunch.PLAN_VERSION)
        try:
            fastlaunch_build.compile_and_install(argv, built, target, mode, verbose)
        except fastlaunch_build.BuildError as exc:
            raise BuildError(str(exc)) from None
    return target


def main() -> int:
    try:
        print(build(verbose="-v" in sys.argv[1:]))
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
