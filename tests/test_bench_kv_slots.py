"""benchmarks/bench_kv_slots.py on CPU: its grid, and one ``--quick`` run end to end.

The benchmark itself needs the H200; these keep it importable and runnable (``--quick`` runs two tiny cases
through Triton's interpreter, with the same providers, checks and CSV rows as the GPU run).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_kv_slots.py"


def test_list_prints_the_grid_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--list"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and [line.split()[1] for line in lines[:4]] == ["t1", "t32", "t256", "t4096"]


def test_quick_runs_every_provider_and_writes_checked_rows(tmp_path: Path) -> None:
    out_csv = tmp_path / "kv_slots.csv"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--csv", str(out_csv)], capture_output=True,
                          text=True, timeout=300, check=False, env=dict(os.environ, OUT=str(tmp_path)), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["provider"], r["case"]) for r in rows] == [(p, c) for c in ("llama3", "pool")
                                                          for p in ("lazytriton", "index_copy", "indexing")]
    assert {r["check"] for r in rows} == {"ok"} and {r["kernel"] for r in rows} == {"kv_slots"}
    assert "lazytriton" in (tmp_path / "bench_kv_slots.log").read_text()
