"""flash_decode's C++ warm path (``_hotpath.cpp``: the entry lookup and the tail), when built for the running torch.

``python -m lazytriton.kernels.flash_decode.hotpath_build`` compiles it into this folder; without that build, the
runtime builds it into the cache dir in the background on first GPU use and loads it from there in later processes
(``lazytriton.driver.helpers``: trusted files only; ``HELPER`` describes it there, registered in
``kernels.COMPILED_HELPERS``). ``EXTENSION`` (``lazytriton.driver.torch_extension``) finds, checks and loads it as
every family's C++ warm path: only the file named for the running torch's version, whose module says that version
again (``TORCH_VERSION``), the launch plan's layout (``PLAN_VERSION``), its record's (``LAYOUT``) and its
functions' calling convention (``INTERFACE``); a mismatch is refused (a package folder's stale build: the cache
dir's is tried next). Anything else (not built, another torch) logs once and the warm path stays in Python (hot.py).
"""

from __future__ import annotations

from pathlib import Path

from lazytriton.driver import torch_extension
from lazytriton.kernels.flash_decode import hotpath_record

NAME = hotpath_record.NAME
MODULE = "lazytriton.kernels.flash_decode._hotpath"
SOURCE = Path(__file__).with_name("_hotpath.cpp")


def constants() -> tuple[torch_extension.Constant, ...]:
    """What the module must say of itself beside its torch and plan versions.

    The record's layout and ``run()``'s, ``serve()``'s and ``remember()``'s calling convention, read at each load.
    """
    return ("LAYOUT", "record", hotpath_record.LAYOUT), ("INTERFACE", "calling convention", hotpath_record.INTERFACE)


EXTENSION = torch_extension.TorchExtension(NAME, MODULE, Path(__file__).resolve().parent, SOURCE,
                                           hotpath_record.header, "the decoding call's C++ warm path",
                                           "lazytriton.kernels.flash_decode.hotpath_build", constants)
BUILD = EXTENSION.build_command  # python -m lazytriton.kernels.flash_decode.hotpath_build
# The module's own names for what the extension does (hot.py, helpers, the tests and benchmarks call these).
HELPER, file_name, source = EXTENSION.helper, EXTENSION.file_name, EXTENSION.source
compile_into, load, load_file = EXTENSION.compile_into, EXTENSION.load, EXTENSION.load_file
module, origin, enable, refresh = EXTENSION.module, EXTENSION.origin, EXTENSION.enable, EXTENSION.refresh
