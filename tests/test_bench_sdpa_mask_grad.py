"""benchmarks/bench_sdpa_mask_grad.py on CPU: its mask forms, its cases, and one smoke run.

The benchmark needs a GPU (torch's mem-efficient backend); ``--cpu-smoke``
runs tiny cases end to end through Triton's interpreter, the mem-efficient
providers reported as failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from benchlib import bench_module, run_bench
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_sdpa_mask_grad.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The benchmark as a module (it imports its neighbour csvlog, as when run as a script)."""
    yield bench_module(monkeypatch, BENCH)


def test_mask_forms_and_arguments(bench: ModuleType) -> None:
    assert [bench.mask_shape(form, 4, 16, 1024) for form in bench.MASKS] == [
        (4, 16, 1024, 1024), (1, 16, 1024, 1024), (4, 1, 1024, 1024), (1024, 1024), (4, 1, 1, 1024)]
    args = bench.parse_args(["--seqlens", "1k,4096", "--masks", "heads,keys"])
    assert args.seqlens == [1024, 4096] and args.masks == ["heads", "keys"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--masks", "diagonal"])


def test_cpu_smoke_runs_end_to_end(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    rows, _ = run_bench(BENCH, tmp_path / "sdpa_mask_grad.csv", "--cpu-smoke", out_dir=out_dir)
    assert {(r["provider"], r["mask"]) for r in rows} == {
        (p, m) for p in ("lazytriton_mask_grad", "lazytriton_detached") for m in ("heads", "keys")}
    assert all(r["check"] == "ok" and float(r["p50_ms"]) > 0 for r in rows)
    log = (out_dir / "bench_sdpa_mask_grad.log").read_text()
    assert "efficient_mask_grad    failed: RuntimeError" in log
