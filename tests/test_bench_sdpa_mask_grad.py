"""benchmarks/bench_sdpa_mask_grad.py on CPU: its mask forms, its cases, and one smoke run.

The benchmark needs a GPU (torch's mem-efficient backend); ``--cpu-smoke``
runs tiny cases end to end through Triton's interpreter, the mem-efficient
providers reported as failed.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_sdpa_mask_grad.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The benchmark as a module (it imports its neighbour csvlog, as when run as a script)."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCH.parent))
    yield importlib.import_module("bench_sdpa_mask_grad")


def test_mask_forms_and_arguments(bench: ModuleType) -> None:
    assert [bench.mask_shape(form, 4, 16, 1024) for form in bench.MASKS] == [
        (4, 16, 1024, 1024), (1, 16, 1024, 1024), (4, 1, 1024, 1024), (1024, 1024), (4, 1, 1, 1024)]
    args = bench.parse_args(["--seqlens", "1k,4096", "--masks", "heads,keys"])
    assert args.seqlens == [1024, 4096] and args.masks == ["heads", "keys"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--masks", "diagonal"])


def test_cpu_smoke_runs_end_to_end(tmp_path: Path) -> None:
    out_csv, out_dir = tmp_path / "sdpa_mask_grad.csv", tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCH), "--cpu-smoke", "--csv", str(out_csv)],
                          env={**os.environ, "OUT": str(out_dir)}, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader(out_csv.open()))
    assert {(r["provider"], r["mask"]) for r in rows} == {
        (p, m) for p in ("lazytriton_mask_grad", "lazytriton_detached") for m in ("heads", "keys")}
    assert all(r["check"] == "ok" and float(r["p50_ms"]) > 0 for r in rows)
    log = (out_dir / "bench_sdpa_mask_grad.log").read_text()
    assert "efficient_mask_grad    failed: RuntimeError" in log
