"""benchmarks/bench_transformers.py on CPU: a tiny float32 Llama through the interpreter, end to end.

The benchmark's real run needs the H200; this keeps its code path (logits
rule, greedy comparison, throughput rows) runnable and checked in CI.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytest.importorskip("transformers")
pytest.importorskip("triton")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cpu_smoke_writes_every_row_and_passes_its_checks(tmp_path: Path, cache: str) -> None:
    """With a static cache, generate traces each decoding step whole (fullgraph) through the integration."""
    out = tmp_path / "transformers.csv"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_transformers.py"), "--cpu-smoke",
                             "--cache", cache, "--csv", str(out)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.open()))
    metrics = {(r["impl"], r["metric"]) for r in rows}
    assert {(impl, m) for impl in ("sdpa", "lazytriton")
            for m in ("logits_max_err_vs_fp32", "prefill_ms", "gen_tokens_per_s")} <= metrics
    tokens = next(r for r in rows if r["metric"] == "greedy_tokens_equal_of_compared")
    equal, compared = map(int, tokens["value"].split("/"))
    assert compared == 3 * 4 and equal == compared  # float32: the same greedy tokens everywhere
    assert all(r["check"] in ("ok", "") for r in rows)
    assert "tokens/s lazytriton/sdpa" in result.stdout
    assert all(f"{cache} cache" in r["config"] for r in rows)
