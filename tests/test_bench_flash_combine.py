"""benchmarks/bench_flash_combine.py on CPU: its grid, and one ``--quick`` run end to end.

The benchmark itself needs the H200; these keep it importable and runnable (``--quick`` runs two tiny cases
through Triton's interpreter, with the same providers, checks and CSV rows as the GPU run).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchlib import run_bench
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_flash_combine.py"


def test_list_prints_the_grid_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--list"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 14 and sum(line.startswith("decode") for line in lines) == 11
    assert any(line.startswith("mla") and "d512" in line for line in lines)


def test_quick_runs_both_providers_and_writes_checked_rows(tmp_path: Path) -> None:
    rows, _ = run_bench(BENCH, tmp_path / "combine.csv", "--quick", out_dir=tmp_path, cwd=tmp_path, timeout=300)
    assert [(r["provider"], r["case"]) for r in rows] == [("lazytriton", "decode"), ("torch", "decode"),
                                                          ("lazytriton", "prefill"), ("torch", "prefill")]
    assert {r["check"] for r in rows} == {"ok"} and {r["kernel"] for r in rows} == {"flash_combine"}
    assert "lazytriton" in (tmp_path / "bench_flash_combine.log").read_text()
