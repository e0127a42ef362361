"""The house rules of ``docs/architecture.md`` that a machine can check.

- No module of the ``lazytriton`` package is over 500 lines.
- The core (everything in ``lazytriton/`` but the public functions with their ops, the integrations and the
  command-line tools) knows no kernel family: no import of a family's modules, and no family or kernel name in
  its code (docstrings and comments may name one as an example). It reaches the families through the registry.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest
from conftest import REPO

from lazytriton.kernels import FAMILIES

PACKAGE = REPO / "lazytriton"
MAX_LINES = 500
# The layer that exposes each family's calls (public functions, their torch ops and autograd), and the tools
# with one part per family: these name the families they serve.
API_LAYER = {"interface.py", "sdpa.py", "kvcache.py", "kvcache_op.py", "ops.py", "ops_varlen.py", "eager.py",
             "flash.py"}
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
