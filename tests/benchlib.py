"""Helpers for the benchmarks' tests: a benchmark imported as a module, or run as a script with its CSV read back."""

from __future__ import annotations

import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest


def bench_module(monkeypatch: pytest.MonkeyPatch, script: Path) -> ModuleType:
    """``script`` as a module (it imports its neighbours, such as csvlog, as when run as a script)."""
    monkeypatch.syspath_prepend(str(script.parent))
    return importlib.import_module(script.stem)


def run_bench(script: Path, out_csv: Path, *args: str, out_dir: Path | None = None, cwd: Path | None = None,
              timeout: float = 600) -> tuple[list[dict[str, str]], str]:
    """``script`` run with ``args`` and ``--csv out_csv`` (``OUT=out_dir`` where given): its CSV rows and stdout.

    The script must exit 0; ``timeout`` is for a hang (a CPU run of a benchmark takes minutes on a loaded machine).
    """
    env = {**os.environ, **({"OUT": str(out_dir)} if out_dir is not None else {})}
    proc = subprocess.run([sys.executable, str(script), *args, "--csv", str(out_csv)], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with out_csv.open() as f:
        return list(csv.DictReader(f)), proc.stdout
