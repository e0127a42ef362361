"""Build flash_decode's C++ warm-path tail: ``python -m lazytriton.kernels.flash_decode.hotpath_build``.

It compiles ``_hotpath.cpp`` with the recipe every C++ tail shares (``lazytriton.driver.torch_build``: the system
C++ compiler against the running torch's headers and libraries, ``lt_plan.h`` and this family's ``lt_record.h``
beside the source) and installs it into this package's folder under a name carrying that torch's version
(``hotpath.file_name``): another torch never loads it. Without this step the runtime makes the same build into
the cache dir in the background on first GPU use (helpers.py); the package's build takes precedence.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lazytriton.driver import torch_build
from lazytriton.kernels.flash_decode import hotpath


def build(directory: Path | None = None, verbose: bool = False, mode: int = 0o777) -> Path:
    """Compile and install the module into ``directory`` (default: this package's folder); its path."""
    return hotpath.EXTENSION.build(directory, verbose, mode)


if __name__ == "__main__":
    sys.exit(torch_build.main(build, sys.argv[1:]))
