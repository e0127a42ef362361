"""flash_decode's C++ warm path (``_hotpath.cpp``: the entry lookup and the tail), when built for the running torch.

``python -m lazytriton.kernels.flash_decode.hotpath_build`` compiles it into this folder; without that build, the
runtime builds it into the cache dir in the background on first GPU use and loads it from there in later processes
(``lazytriton.driver.helpers``: trusted files only; ``HELPER`` describes it there, registered in
``kernels.COMPILED_HELPERS``). A C++ extension is bound to the torch it was compiled against, so its file name
carries that torch's version and only the file named for the running version is ever loaded; the module says the
version again (``TORCH_VERSION``), the launch plan's layout (``PLAN_VERSION``), its record's (``LAYOUT``) and its
functions' calling convention (``INTERFACE``), and a mismatch is refused (a package folder's stale build: the cache
dir's is tried next). Anything else (not built, another torch) logs once and the warm path stays in Python (hot.py).
"""

from __future__ import annotations

import functools
import importlib.machinery
import logging
from pathlib import Path
from typing import Any

from lazytriton.driver import helpers, trusted
from lazytriton.kernels.flash_decode import hotpath_record

log = logging.getLogger("lazytriton.driver")

NAME = hotpath_record.NAME
MODULE = "lazytriton.kernels.flash_decode._hotpath"
SOURCE = Path(__file__).with_name("_hotpath.cpp")
BUILD = "python -m lazytriton.kernels.flash_decode.hotpath_build"
_enabled = [True]


def file_name(torch_version: str | None) -> str:
    """The built module's file name for one torch version (the version's odd characters as ``_``)."""
    if not torch_version:
        raise ValueError("the decoding call's C++ warm path's file name needs a torch version")
    return f"_hotpath.torch-{helpers.torch_tag(torch_version)}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def source() -> bytes:
    """What the helper is compiled from: the launch plan's header, the record's header and ``_hotpath.cpp``."""
    from lazytriton.driver import fastlaunch_build

    return fastlaunch_build.PLAN_SOURCE.encode() + hotpath_record.header().encode() + SOURCE.read_bytes()


def compile_into(where: Path, torch_version: str | None) -> Path:
    """Build the C++ tail into ``where`` and check that it loads as the runtime loads it; its path."""
    from lazytriton.driver import fastlaunch, helpers_build, torch_build
    from lazytriton.kernels.flash_decode import hotpath_build

    if torch_version is None:
        raise torch_build.BuildError("the C++ warm path needs torch")
    path = hotpath_build.build(where, mode=helpers.DIR_MODE)
    loads = load_file(str(path), path, torch_version, fastlaunch.PLAN_VERSION) is not None
    return helpers_build.loaded_or_removed(path, loads)


HELPER = helpers.Helper(NAME, True, Path(__file__).resolve().parent, file_name, source, compile_into)


def load(directory: Path, torch_version: str, plan_version: int) -> Any:
    """The module built for ``torch_version`` in ``directory``, or None (and one log line saying why)."""
    path = Path(directory) / file_name(torch_version)
    if not path.is_file():
        others = sorted(p.name for p in Path(directory).glob("_hotpath.torch-*") if p.suffix == ".so")
        if others:
            log.warning("the decoding call's C++ warm path is built for another torch (%s), not torch %s: the "
                        "Python warm path until it is rebuilt (%s)", ", ".join(others), torch_version, BUILD)
        else:
            log.debug("the decoding call's C++ warm path is not built (%s)", BUILD)
        return None
    return load_file(str(path), path, torch_version, plan_version)


def load_file(where: str, path: Path, torch_version: str, plan_version: int) -> Any:
    """The module in ``where`` (a path the loader opens; ``path`` names it in messages), checked; or None."""
    try:
        module = trusted.load_extension(MODULE, where, path)
    except Exception as exc:  # built for another Python, a broken file
        log.warning("the decoding call's C++ warm path %s does not load (%s): the Python warm path", path, exc)
        return None
    built_for = getattr(module, "TORCH_VERSION", None)
    if built_for != torch_version:
        log.warning("the decoding call's C++ warm path %s was built against torch %s, this is torch %s: not used",
                    path, built_for, torch_version)
        return None
    found = (getattr(module, "PLAN_VERSION", None), getattr(module, "LAYOUT", None), getattr(module, "INTERFACE", None))
    if found != (plan_version, hotpath_record.LAYOUT, hotpath_record.INTERFACE):
        log.warning("the decoding call's C++ warm path %s reads launch plan version %s and record %r with calling "
                    "convention %s, this lazytriton packs %s and %r and calls %s: not used until it is rebuilt (%s)",
                    path, *found, plan_version, hotpath_record.LAYOUT, hotpath_record.INTERFACE, BUILD)
        return None
    return module


@functools.cache
def _module() -> Any:
    """The package's build for the running torch, else the cache dir's, else None."""
    import torch

    from lazytriton.driver import fastlaunch

    here = Path(__file__).resolve().parent
    version, plan = torch.__version__, fastlaunch.PLAN_VERSION
    packaged = helpers.in_package(NAME, version) is not None
    if packaged:
        module = load(here, version, plan)
        if module is not None:
            return module
    module = helpers.load_cached(NAME, version, lambda where, path: load_file(where, path, version, plan))
    if module is None and not packaged:
        load(here, version, plan)  # says why there is none (another torch's build in the package, or none)
    return module


def module() -> Any:
    """The loaded module for the running torch, or None (not built, another torch, or ``enable(False)``)."""
    return _module() if _enabled[0] else None


def enable(on: bool) -> bool:
    """Use the C++ tail in warm paths made from now on (when built); the previous setting (tests, benchmarks)."""
    previous = _enabled[0]
    _enabled[0] = on
    return previous


def refresh() -> bool:
    """Look for the module again (after ``hotpath_build.build()`` in this process); whether it loads now."""
    _module.cache_clear()
    return _module() is not None
