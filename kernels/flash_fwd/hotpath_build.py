"""Build flash_fwd's C++ warm-path tail: ``python -m lazytriton.kernels.flash_fwd.hotpath_build``.

It compiles ``_hotpath.cpp`` (a CPython extension using ATen, ``METH_FASTCALL``
functions) with the recipe every C++ tail shares (``lazytriton.driver.torch_build``:
the system C++ compiler against the running torch's headers and libraries)
and installs it into this package's folder under a name carrying that torch's
version (``hotpath.file_name``): another torch never loads it. Without this
step the runtime makes the same build into the cache dir in the background on
first GPU use (helpers.py); the package's build takes precedence. What it
saves: the warm call's allocations and pointer reads from Python (~1.5 µs per
torch call on the H200 host, benchmarks/NOTES.md).

The launch from the plan is ``fastlaunch_build.PLAN_SOURCE``, written beside
the source as ``lt_plan.h``: both helpers compile the same text.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lazytriton.driver import torch_build
from lazytriton.driver.torch_build import BuildError, command, toolchain
from lazytriton.kernels.flash_fwd import hotpath

SOURCE = hotpath.SOURCE

__all__ = ["SOURCE", "BuildError", "build", "command", "toolchain"]


def build(directory: Path | None = None, verbose: bool = False, mode: int = 0o777) -> Path:
    """Compile and install the module into ``directory`` (default: this package's folder); its path."""
    return hotpath.EXTENSION.build(directory, verbose, mode)


if __name__ == "__main__":
    sys.exit(torch_build.main(build, sys.argv[1:]))
