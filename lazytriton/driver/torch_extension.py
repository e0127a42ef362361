"""A family's C++ warm path as a compiled helper: a CPython extension bound to the torch it was built against.

A family with a C++ tail (``kernels.COMPILED_HELPERS``) describes it in its ``hotpath.py`` with one
``TorchExtension``: the helper's name, the module's import name, its package folder and source, the header of the
record it reads, the words its log lines name it by, its build command's module and what else the module must say
of itself. From that this class finds, checks and loads it, and describes it to ``helpers`` (``helper``). A C++
extension is bound to the torch it was compiled against (its ABI, its symbols), so its file name carries that
torch's version and only the file named for the running version is ever loaded; the module says the version again
(``TORCH_VERSION``), the launch plan's layout it reads (``PLAN_VERSION``) and the family's own constants
(``constants``), and a mismatch is refused, with one log line naming the build command. The package folder's build
is tried first, then the cache dir's (``helpers.load_cached``: trusted files only); anything else (not built,
another torch) logs once and the family's warm path stays in Python.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lazytriton.driver import helpers, trusted

log = logging.getLogger("lazytriton.driver")

# A constant the module must hold beside TORCH_VERSION and PLAN_VERSION: (its name, the words a log line says it in,
# the value this lazytriton expects).
Constant = tuple[str, str, object]
_UNREAD = object()  # ``_found``'s value until the module is looked for


class TorchExtension:
    """One family's C++ warm path: where its module is, what it is built from, and its checked load.

    ``name``: the compiled helper's name (its key and cache-dir folder); ``module``: the extension's import name
    (``lazytriton.kernels.<family>._hotpath``); ``folder``: the package folder it is built into and looked for in
    first; ``source_file``: its ``_hotpath.cpp``; ``record_header``: the text of the ``lt_record.h`` written beside
    it; ``what``: how log lines and errors name it; ``build_module``: the module whose ``build(directory, mode=)``
    compiles it (``python -m`` that module builds it into ``folder``); ``constants``: what else the module must say
    of itself, read when it is loaded (the family's record layout, its functions' calling convention).
    """

    def __init__(self, name: str, module: str, folder: Path, source_file: Path, record_header: Callable[[], str],
                 what: str, build_module: str, constants: Callable[[], Sequence[Constant]] = tuple) -> None:
        self.name, self.module_name, self.folder, self.source_file = name, module, folder, source_file
        self.record_header, self.what, self.build_module, self.constants = record_header, what, build_module, constants
        self.build_command = f"python -m {build_module}"
        self.stem = module.rpartition(".")[2]  # the file's name before ``.torch-<version>``
        self.enabled = True
        self._found: Any = _UNREAD
        self.helper = helpers.Helper(name, True, folder, self.file_name, self.source, self.compile_into)

    def file_name(self, torch_version: str | None) -> str:
        """The built module's file name for one torch version (the version's odd characters as ``_``)."""
        if not torch_version:
            raise ValueError(f"{self.what}'s file name needs a torch version")
        return helpers.extension_file(self.stem, torch_version)

    def source(self) -> bytes:
        """What the helper is compiled from: the launch plan's header, ``lt_tail.h``, the record's, the source."""
        from lazytriton.driver import fastlaunch_build, torch_build

        return (fastlaunch_build.PLAN_SOURCE.encode() + torch_build.TAIL_HEADER.read_bytes()
                + self.record_header().encode() + self.source_file.read_bytes())

    def build(self, directory: Path | None = None, verbose: bool = False, mode: int = 0o777) -> Path:
        """Compile the module for the running torch and install it into ``directory`` (default: ``folder``)."""
        import torch

        from lazytriton.driver import torch_build

        target = Path(directory if directory is not None else self.folder) / self.file_name(torch.__version__)
        return torch_build.build(self.source_file, {"lt_record.h": self.record_header()}, target, verbose, mode)

    def compile_into(self, where: Path, torch_version: str | None) -> Path:
        """Build the module into ``where`` (``build_module``'s ``build``), checked to load as the runtime loads it."""
        from lazytriton.driver import fastlaunch, helpers_build, torch_build

        if torch_version is None:
            raise torch_build.BuildError(f"{self.what} needs torch")
        path = importlib.import_module(self.build_module).build(where, mode=helpers.DIR_MODE)
        loads = self.load_file(str(path), path, torch_version, fastlaunch.PLAN_VERSION) is not None
        return helpers_build.loaded_or_removed(path, loads)

    def load(self, directory: Path, torch_version: str, plan_version: int) -> Any:
        """The module built for ``torch_version`` in ``directory``, or None (and one log line saying why).

        Imports only the file named for that version, then checks what it says it was built against.
        """
        path = Path(directory) / self.file_name(torch_version)
        if not path.is_file():
            others = sorted(p.name for p in Path(directory).glob(f"{self.stem}.torch-*") if p.suffix == ".so")
            if others:
                log.warning("%s is built for another torch (%s), not torch %s: the Python warm path until it is "
                            "rebuilt (%s)", self.what, ", ".join(others), torch_version, self.build_command)
            else:
                log.debug("%s is not built (%s)", self.what, self.build_command)
            return None
        return self.load_file(str(path), path, torch_version, plan_version)

    def load_file(self, where: str, path: Path, torch_version: str, plan_version: int) -> Any:
        """The module in ``where`` (a path the loader opens; ``path`` names it in messages), checked; or None."""
        try:
            module = trusted.load_extension(self.module_name, where, path)
        except Exception as exc:  # built for another Python, a broken file
            log.warning("%s %s does not load (%s): the Python warm path", self.what, path, exc)
            return None
        built_for = getattr(module, "TORCH_VERSION", None)
        if built_for != torch_version:
            log.warning("%s %s was built against torch %s, this is torch %s: not used", self.what, path, built_for,
                        torch_version)
            return None
        wanted = [("PLAN_VERSION", "launch plan version", plan_version), *self.constants()]
        found = [getattr(module, name, None) for name, _, _ in wanted]
        if found != [value for _, _, value in wanted]:
            log.warning("%s %s reads %s; this lazytriton packs %s: not used until it is rebuilt (%s)", self.what, path,
                        _listed((words, value) for (_, words, _), value in zip(wanted, found, strict=True)),
                        _listed((words, value) for _, words, value in wanted), self.build_command)
            return None
        return module

    def find(self) -> Any:
        """The package's build for the running torch, else the cache dir's, else None; looked for once."""
        if self._found is _UNREAD:
            self._found = self._look()
        return self._found

    def _look(self) -> Any:
        import torch

        from lazytriton.driver import fastlaunch

        version, plan = torch.__version__, fastlaunch.PLAN_VERSION
        packaged = helpers.in_package(self.name, version) is not None
        if packaged:
            module = self.load(self.folder, version, plan)
            if module is not None:
                return module
        module = helpers.load_cached(self.name, version, lambda where, path: self.load_file(where, path, version, plan))
        if module is None and not packaged:
            self.load(self.folder, version, plan)  # says why there is none (another torch's build there, or none)
        return module

    def module(self) -> Any:
        """The loaded module for the running torch, or None (not built, another torch, or ``enable(False)``)."""
        return self.find() if self.enabled else None

    def origin(self) -> str | None:
        """The file the module in use was loaded from (package or cache dir), or None."""
        found = self.module()
        return None if found is None else str(getattr(found, "__file__", self.module_name))

    def enable(self, on: bool) -> bool:
        """Use the module in warm paths made from now on (when built); the previous setting (tests, benchmarks)."""
        previous, self.enabled = self.enabled, on
        return previous

    def refresh(self) -> bool:
        """Look for the module again (after a build in this process); whether it loads now.

        Only a first build takes effect in this process: CPython keeps an extension module it has loaded by its file's
        path, so a module rebuilt over one already loaded is the new one only in a new process.
        """
        self._found = _UNREAD
        return self.find() is not None


def _listed(pairs: Any) -> str:
    """``launch plan version 3, record '...' and calling convention 2``: each pair's words and value."""
    parts = [f"{words} {value!r}" if isinstance(value, str) else f"{words} {value}" for words, value in pairs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
