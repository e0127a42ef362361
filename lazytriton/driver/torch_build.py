"""Build a family's C++ warm-path tail: a CPython extension against the running torch, one compiler command.

The recipe every torch-bound compiled helper shares (flash_fwd's and flash_decode's ``_hotpath.cpp``, each built by
its family's ``hotpath_build``): the system C++ compiler with torch's headers, libraries and C++ ABI flag, the
source copied into a temporary folder beside the headers it includes (the launch plan's ``lt_plan.h``,
``fastlaunch_build.PLAN_SOURCE``; ``lt_tail.h``, what every C++ warm path shares, ``TAIL_HEADER``; and the family's
own), the result installed atomically under its final name.
No ninja, no setuptools. When something is missing (a C++ compiler, Python's or torch's headers, torch's
libraries) the build says exactly what and where it looked.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lazytriton.driver import fastlaunch, fastlaunch_build

LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")
HEADER = "torch/csrc/autograd/python_variable.h"  # the torch header the sources need first
TAIL_HEADER = Path(__file__).with_name("lt_tail.h")  # what every C++ warm path includes, beside lt_plan.h


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


def build(source: Path, headers: Mapping[str, str], target: Path, verbose: bool = False, mode: int = 0o777) -> Path:
    """Compile ``source`` beside ``lt_plan.h``, ``lt_tail.h`` and ``headers`` (name -> text); install it as ``target``.

    Written beside its final name and renamed, with ``mode`` less the umask: a running process keeps the module it
    loaded. Returns ``target``.
    """
    import torch

    compiler, includes, libraries = toolchain()
    with tempfile.TemporaryDirectory(prefix="lazytriton-hotpath-") as tmp:
        copied = Path(tmp) / source.name
        shutil.copyfile(source, copied)
        shared = {"lt_plan.h": fastlaunch_build.PLAN_SOURCE, TAIL_HEADER.name: TAIL_HEADER.read_text()}
        for name, text in {**shared, **headers}.items():
            (Path(tmp) / name).write_text(text)
        built = Path(tmp) / target.name
        argv = command(compiler, copied, built, includes, libraries, torch.__version__,
                       bool(torch._C._GLIBCXX_USE_CXX11_ABI), fastlaunch.PLAN_VERSION)
        try:
            fastlaunch_build.compile_and_install(argv, built, target, mode, verbose)
        except fastlaunch_build.BuildError as exc:
            raise BuildError(str(exc)) from None
    return target


def main(build: Callable[..., Path], argv: Sequence[str]) -> int:
    """A family's build command (``python -m`` its ``hotpath_build``); its exit status.

    ``build(verbose=)``'s path printed, 0; or what the build lacks, 1. ``-v`` prints the compiler's command.
    """
    try:
        print(build(verbose="-v" in argv))
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0
