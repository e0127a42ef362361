"""No import cycles in the package: every module of lazytriton, counting imports inside functions.

The checkout's folders map to the package as pyproject's ``package-dir`` says (``kernels/`` is
``lazytriton.kernels``, and so on). An import under ``if TYPE_CHECKING:`` never runs and is not counted;
an import of a module's own ancestor package is not counted either (a submodule always runs its parents
first). Each cycle is a strongly connected component of more than one module, named in the failure.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# Top-level folders of the checkout and the package each one is (pyproject's package-dir).
FOLDERS = {"lazytriton": "lazytriton", "kernels": "lazytriton.kernels", "prewarm": "lazytriton.prewarm",
           "capi": "lazytriton.capi", "cache_format": "lazytriton.cache_format"}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
        parent = parents.get(parent)
    return False


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its file, its ancestors excepted."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _absolute(name, is_package, node.level, node.module)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for imported in names:
            while imported and imported not in known:  # an attribute of a module: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_walk_finds_every_folder_and_inner_imports() -> None:
    graph = import_graph(REPO)
    assert {"lazytriton", "lazytriton.kernels", "lazytriton.prewarm", "lazytriton.capi",
            "lazytriton.cache_format", "lazytriton.kernels.flash_fwd.binding", "lazytriton.cli.cache"} <= set(graph)
    # An import inside a function counts: cli.cache registers explain's command from inside add_parser.
    assert "lazytriton.cli.explain" in graph["lazytriton.cli.cache"]


def test_the_cycle_finder_names_a_cycle_through_an_inner_import(tmp_path: Path) -> None:
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "lazytriton" / "a.py").write_text("from lazytriton import b\n")
    (tmp_path / "lazytriton" / "b.py").write_text("def f():\n    from lazytriton.kernels import c\n")
    (tmp_path / "kernels" / "c.py").write_text("from typing import TYPE_CHECKING\nimport lazytriton.a\n")
    (tmp_path / "kernels" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from lazytriton import a\n")
    (tmp_path / "lazytriton" / "e.py").write_text("from lazytriton.kernels import d\n")
    assert cycles(import_graph(tmp_path)) == [["lazytriton.a", "lazytriton.b", "lazytriton.kernels.c"]]


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(import_graph(REPO))
    assert not found, "import cycles (each a set of modules that import one another, inner imports counted):\n" + \
        "\n".join(" <-> ".join(cycle) for cycle in found)
