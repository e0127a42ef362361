"""What the tests of the families' C++ warm paths share (test_hotpath_cpp.py, test_decode_hotpath_cpp.py).

``tail_fixtures`` makes a test module's ``built``, ``cpp`` and ``helper`` fixtures for one family's C++ tail (its
``hotpath`` module, a ``lazytriton.driver.torch_extension.TorchExtension``); the rest reads the fake libcuda's
launches, stands in for the runtime and the background build, and checks what every such module's load refuses.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from lazytriton.driver import fastlaunch, fastlaunch_build, helpers, trusted
from lazytriton.kernels import get


def arg_types(kernel: str) -> tuple[str, ...]:
    """The kernel's launch parameters' types (bf16), constexprs left out."""
    return tuple(t for t in get(kernel).signature("bf16").values() if t != "constexpr")


def param_sizes(types: Sequence[str]) -> list[int]:
    """Each parameter's size as the fake libcuda records it, then the 2 hidden scratch pointers'."""
    return [4 if t in ("i32", "fp32") else 8 for t in types] + [8, 8]


def decoded(params: Sequence[bytes], types: Sequence[str]) -> tuple[list[int], list[float]]:
    """(ints, floats) of a recorded launch's parameters, decoded by their types."""
    ints: list[int] = []
    floats: list[float] = []
    for kind, raw in zip(types, params, strict=False):
        if kind == "fp32":
            floats.append(struct.unpack("<f", raw)[0])
        else:
            ints.append(struct.unpack("<i" if kind == "i32" else "<q", raw)[0])
    return ints, floats


class Runtime:
    """The runtime as the warm paths read it: its memoised plans."""

    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}


def tail_fixtures(hotpath: ModuleType, hotpath_build: ModuleType, folder: str) -> tuple[Any, Any, Any]:
    """A test module's fixtures for one family's C++ tail: ``built``, ``cpp`` and ``helper``.

    built: the extension, built once per session into a temporary folder named ``folder`` (a test using it fails,
    with the build's own message, when it cannot be built here); cpp: that build, loaded as the runtime loads it;
    helper: the compiled launch helper (its plans are what the C++ tail launches from), installed or built here.
    """

    @pytest.fixture(scope="session", name="built")
    def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
        try:
            return Path(hotpath_build.build(tmp_path_factory.mktemp(folder)))
        except Exception as exc:  # torch_build.BuildError: says what is missing
            pytest.fail(f"{hotpath.EXTENSION.what} must build here: {exc}")

    @pytest.fixture(scope="session", name="cpp")
    def cpp(built: Path) -> Any:
        module = hotpath.load(built.parent, torch.__version__, fastlaunch.PLAN_VERSION)
        assert module is not None, f"{built} was built for this torch and must load"
        return module

    @pytest.fixture(scope="module", name="helper")
    def helper(tmp_path_factory: pytest.TempPathFactory) -> Any:
        if fastlaunch.available():
            return importlib.import_module(fastlaunch.MODULE)
        path = fastlaunch_build.build(tmp_path_factory.mktemp("fastlaunch"))
        return trusted.load_extension(fastlaunch.MODULE, str(path), path)

    return built, cpp, helper


def never_loads_another_torchs_build(hotpath: ModuleType, built: Path, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """A build named for another torch is not loaded, nor one whose module says another torch or plan layout."""
    other = tmp_path / hotpath.file_name("2.11.0")
    shutil.copyfile(built, other)  # what a build by torch 2.11 left behind
    with caplog.at_level(logging.WARNING, logger="lazytriton.driver"):
        assert hotpath.load(tmp_path, torch.__version__, fastlaunch.PLAN_VERSION) is None
    assert "built for another torch" in caplog.text and torch.__version__ in caplog.text
    assert hotpath.BUILD in caplog.text, "the line says how to rebuild it"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lazytriton.driver"):  # the file's name lies: the module says
        assert hotpath.load(tmp_path, "2.11.0", fastlaunch.PLAN_VERSION) is None
    assert f"built against torch {torch.__version__}, this is torch 2.11.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lazytriton.driver"):  # another plan layout
        assert hotpath.load(built.parent, torch.__version__, fastlaunch.PLAN_VERSION + 1) is None
    assert f"launch plan version {fastlaunch.PLAN_VERSION}" in caplog.text and "not used" in caplog.text


def build_by_copying(hotpath: ModuleType, built: Path) -> Callable[..., Path]:
    """A stand-in for the family's ``hotpath_build.build``: the session's build copied, not a minute more of it."""

    def build(directory: Path, verbose: bool = False, mode: int = 0o777) -> Path:
        target = Path(directory) / hotpath.file_name(torch.__version__)
        shutil.copyfile(built, target)
        target.chmod(mode & 0o755)
        return target

    return build


@contextlib.contextmanager
def builder_lock(hotpath: ModuleType, cache_dir: Path, version: str) -> Iterator[tuple[Path, int]]:
    """(the helper's key folder in ``cache_dir``, made; its build lock, held), as ``helpers._start`` hands them to
    the background builder (``helpers_build.child``); the lock released after."""
    where = helpers.folder(cache_dir, hotpath.NAME, version)
    assert helpers.make_folder(cache_dir, hotpath.NAME, version) is None
    lock = helpers.take_lock(where, blocking=False)
    assert lock is not None
    try:
        yield where, lock
    finally:
        os.close(lock)
