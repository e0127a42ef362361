"""flash_fwd's C++ warm-path tail (``_hotpath.cpp``), when it is built for exactly the running torch.

``python -m lazytriton.kernels.flash_fwd.hotpath_build`` compiles it into
this folder; without that build, the runtime builds it into the cache dir in
the background on first GPU use and loads it from there in later processes
(``lazytriton.driver.helpers``: trusted files only; ``HELPER`` describes it
there, registered in ``kernels.COMPILED_HELPERS``). ``EXTENSION``
(``lazytriton.driver.torch_extension``) finds, checks and loads it as every
family's C++ warm path: only the file named for the running torch's version,
whose module says that version again (``TORCH_VERSION``) and the launch
plan's layout (``PLAN_VERSION``). Its template and calling convention are
hot.py's to check (``hot.usable``). Anything else (not built, another torch,
another plan layout) logs once and the warm path stays in Python (hot.py);
``hot.regenerate()`` makes the warm paths again after ``enable`` or a build.
"""

from __future__ import annotations

from pathlib import Path

from lazytriton.driver import torch_extension
from lazytriton.kernels.flash_fwd import hotpath_record

NAME = hotpath_record.NAME
MODULE = "lazytriton.kernels.flash_fwd._hotpath"
SOURCE = Path(__file__).with_name("_hotpath.cpp")

EXTENSION = torch_extension.TorchExtension(NAME, MODULE, Path(__file__).resolve().parent, SOURCE,
                                           hotpath_record.header, "the C++ warm path",
                                           "lazytriton.kernels.flash_fwd.hotpath_build")
BUILD = EXTENSION.build_command  # python -m lazytriton.kernels.flash_fwd.hotpath_build
# The module's own names for what the extension does (hot.py, helpers, the tests and benchmarks call these).
HELPER, file_name, source = EXTENSION.helper, EXTENSION.file_name, EXTENSION.source
compile_into, load, load_file = EXTENSION.compile_into, EXTENSION.load, EXTENSION.load_file
module, origin, enable, refresh = EXTENSION.module, EXTENSION.origin, EXTENSION.enable, EXTENSION.refresh
