"""``-m gpu`` (how the GPU host runs the GPU tests) selects every test the ``gpu`` skip decorator guards.

A test guarded only by ``conftest.gpu`` (a skipif) carries no ``gpu`` mark of its own; ``conftest``'s collection
hook adds it, before ``-m`` deselects. Checked on a file whose GPU tests have the decorator alone.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def _collected(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *args,
                           "tests/test_fp8_fwd.py"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_minus_m_gpu_selects_the_tests_the_gpu_decorator_guards() -> None:
    source = (REPO / "tests" / "test_fp8_fwd.py").read_text()
    assert "@gpu\n" in source and "pytest.mark.gpu" not in source  # the decorator alone
    selected, rest = _collected("-m", "gpu"), _collected("-m", "not gpu")
    assert selected and rest and not set(selected) & set(rest)
    assert all("gpu" in name for name in selected), selected
