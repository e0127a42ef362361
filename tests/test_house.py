"""The house rules of ``docs/architecture.md`` that a machine can check.

- No module of the ``lazytriton`` package is over 500 lines.
- The core (everything in ``lazytriton/`` but the public functions with their ops, the integrations and the
  command-line tools) knows no kernel family: no import of a family's modules, and no family or kernel name in
  its code (docstrings and comments may name one as an example). It reaches the families through the registry.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest
from conftest import REPO

from lazytriton.kernels import FAMILIES

PACKAGE = REPO / "lazytriton"
MAX_LINES = 500
# The layer that exposes each family's calls (public functions, their torch ops and autograd), and the tools
# with one part per family: these name the families they serve.
API_LAYER = {"interface.py", "preloading.py", "sdpa.py", "kvcache.py", "kvcache_op.py", "kvcache_varlen.py",
             "combine.py", "combine_op.py", "kvcache_slots.py", "kvcache_slots_op.py", "ops.py", "ops_varlen.py",
             "eager.py", "flash.py", "forward_routes.py", "fp8_calls.py", "fp8_op.py", "mla_calls.py",
             "mla_op.py", "value_split.py", "flash_attn_3_ops.py"}
NOT_CORE_FOLDERS = {"cli", "integrations"}
NAMES = tuple(sorted({*FAMILIES, *(kernel for kernels in FAMILIES.values() for kernel in kernels)}, key=len,
                     reverse=True))


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _core() -> list[Path]:
    return [p for p in _modules() if p.relative_to(PACKAGE).parts[0] not in NOT_CORE_FOLDERS
            and not (p.parent == PACKAGE and p.name in API_LAYER)]


def _docstrings(tree: ast.AST) -> set[int]:
    """The first lines of the module's, classes' and functions' docstrings."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.add(first.lineno)
    return lines


def family_names_in_code(source: str) -> list[str]:
    """``line: token`` for each name or string in the code (not comments, not docstrings) naming a family."""
    docstrings = _docstrings(ast.parse(source))
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.NAME, tokenize.STRING) or (token.type == tokenize.STRING
                                                                 and token.start[0] in docstrings):
            continue
        if any(name in token.string for name in NAMES):
            found.append(f"{token.start[0]}: {token.string[:80]}")
    return found


def test_the_rule_sees_a_family_named_in_code_and_not_in_prose() -> None:
    assert family_names_in_code('"""Serves flash_fwd."""\n# flash_bwd too\nx = 1\n') == []
    assert family_names_in_code('from lazytriton.kernels.flash_fwd import binding\n')
    assert family_names_in_code('kernel = "flash_decode_split"\n')
    assert family_names_in_code('def f():\n    """kv_append."""\n    return kv_append_rows\n') == [
        "3: kv_append_rows"]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_500_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines: split it by what its parts do"


@pytest.mark.parametrize("path", _core(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_core_names_no_kernel_family(path: Path) -> None:
    found = family_names_in_code(path.read_text())
    assert not found, (f"{path.relative_to(REPO)} names a kernel family in its code (the core reaches families "
                       f"through the registry, kernels.FAMILIES): {found}")


# ``from lazytriton.x import a, b`` / ``import lazytriton.x`` / ``python3 -m lazytriton.x``, also inside the code
# strings that benchmarks and probes hand to child processes.
_NAMED = re.compile(r"(?:\bfrom\s+(lazytriton(?:\.\w+)*)\s+import\s+\(?([\w ,]+)|\bimport\s+(lazytriton(?:\.\w+)+)"
                    r"|-m\s+(lazytriton(?:\.\w+)+))")


def _named_modules(text: str) -> list[tuple[str, tuple[str, ...]]]:
    found = []
    for from_module, names, imported, run in _NAMED.findall(text):
        if from_module:
            found.append((from_module, tuple(n.split(" as ")[0].strip() for n in names.split(",") if n.strip())))
        else:
            found.append((imported or run, ()))
    return found


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent missing, or not a package
        return False


def _missing(module: str, names: tuple[str, ...]) -> list[str]:
    if not _exists(module):
        return [module]
    loaded = importlib.import_module(module) if names else None
    return [f"{module}.{name}" for name in names if not hasattr(loaded, name) and not _exists(f"{module}.{name}")]


def test_the_name_check_sees_a_moved_name() -> None:
    text = 'code = "from lazytriton.dispatch import target_of_device"\nfrom lazytriton.machine import nothing_here\n'
    assert [m for module, names in _named_modules(text) for m in _missing(module, names)] == [
        "lazytriton.dispatch", "lazytriton.machine.nothing_here"]


# Tests whose texts name made-up modules on purpose.
_MADE_UP = {"tests/test_house.py", "tests/test_import_cycles.py", "tests/test_codepack.py"}  # the last: a fake install
_TOOLS = sorted(p for folder in ("benchmarks", "experiments", "examples", "tests", "docs")
                for p in (REPO / folder).rglob("*")
                if p.suffix in {".py", ".sh", ".md"} and "__pycache__" not in p.parts
                and str(p.relative_to(REPO)) not in _MADE_UP)


@pytest.mark.parametrize("path", _TOOLS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_lazytriton_name_a_tool_or_doc_imports_exists(path: Path) -> None:
    """Benchmarks, probes, tests and docs name lazytriton's modules, often in strings run by a child process,
    which no import check of this suite reaches: each named module and name exists."""
    missing = [m for module, names in _named_modules(path.read_text()) for m in _missing(module, names)]
    assert not missing, missing
