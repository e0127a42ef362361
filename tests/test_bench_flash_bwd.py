"""benchmarks/bench_flash_bwd.py on CPU: its case grid, its filters, its gradient check, and one smoke run.

The benchmark itself needs the H200; these keep it importable and runnable
(``--cpu-smoke`` runs one tiny case end to end through Triton's interpreter,
with the same argument path as the GPU run's Triton JIT provider).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from benchlib import bench_module, run_bench
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_flash_bwd.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The benchmark as a module (it imports its neighbour csvlog, as when run as a script)."""
    yield bench_module(monkeypatch, BENCH)


def test_full_grid_is_the_forward_grid(bench: ModuleType) -> None:
    cases = bench.grid_of(bench.parse_args([]))
    assert len(cases) == 36
    assert {(c.dtype, c.head_dim, c.causal, c.seqlen) for c in cases} == {
        (dt, d, causal, s) for dt in ("bf16", "fp16") for d in (64, 128, 256) for causal in (False, True)
        for s in (1024, 4096, 16384)}
    for c in cases:
        assert c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048
    hd128_16k = next(c for c in cases if c.head_dim == 128 and c.seqlen == 16384 and not c.causal)
    assert hd128_16k.fwd_flops == 4 * 1 * 16 * 16384**2 * 128
    causal = hd128_16k._replace(causal=True)
    assert causal.fwd_flops == hd128_16k.fwd_flops / 2


def test_quick_and_filters_select_subsets(bench: ModuleType) -> None:
    quick = bench.grid_of(bench.parse_args(["--quick"]))
    assert len(quick) == 24 and {c.seqlen for c in quick} == {1024, 4096}  # 2 dtypes x 3 head dims x 2 x 2
    args = bench.parse_args(["--dtypes", "fp16", "--head-dims", "128", "--seqlens", "4k,2048", "--causal", "causal"])
    assert [(c.dtype, c.head_dim, c.causal, c.seqlen) for c in bench.grid_of(args)] == [
        ("fp16", 128, True, 4096), ("fp16", 128, True, 2048)]
    only = bench.parse_args(["--providers", "sdpa_cudnn,lazytriton"]).providers
    assert list(bench.providers("bwd", only)) == ["lazytriton", "sdpa_cudnn"]
    assert list(bench.providers("fwd+bwd", only)) == ["lazytriton", "sdpa_cudnn"]


@pytest.mark.parametrize("argv", [["--dtypes", "fp8"], ["--head-dims", "0"], ["--head-dims", "512"],
                                  ["--seqlens", "4q"], ["--seqlens", ""], ["--reps", "0"], ["--causal", "yes"],
                                  ["--providers", "sdpa_math"]])
def test_bad_filters_are_refused(bench: ModuleType, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_check_passes_exact_math_and_flags_a_wrong_gradient(bench: ModuleType) -> None:
    import grad_rule as rule  # beside the benchmark, on the path the fixture set

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 48, 32, dtype=torch.bfloat16) for _ in range(4))
    ref = rule.reference(q, k, v, do, True)
    good = rule.math_grads(q, k, v, do, True, torch.float32)
    ok, err, note = rule.check_grads(good, ref)
    assert ok and err < 1e-5 and note == ""
    wrong = (good[0], good[1] * 1.1, good[2])
    ok, err, note = rule.check_grads(wrong, ref)
    assert not ok and "dk" in note and "dq" not in note and err > 0.05
    not_causal = rule.math_grads(q, k, v, do, False, torch.float32)
    assert not rule.check_grads(not_causal, ref)[0]
    nan = (good[0], good[1], torch.full_like(good[2], float("nan")))
    assert not rule.check_grads(nan, ref)[0]


def test_table_reports_a_failed_provider_and_ratios(bench: ModuleType) -> None:
    case = bench.Case("bf16", 128, False, 4096, 4, 16)
    ms = case.fwd_flops * 2.5 / 1e9 / 300  # 300 TFLOP/s
    results = [bench.Result(case, "lazytriton", "bwd", ms, 1e-3, "ok"),
               bench.Result(case, "triton_jit", "bwd", ms * 2, 1e-3, "wrong", "dq max error"),
               bench.Result(case, "sdpa_flash", "bwd", ms * 1.5, 1e-3, "ok"),
               bench.Result(case, "sdpa_cudnn", "bwd", None, None, "failed", "RuntimeError: no cuDNN")]
    log = bench.Log()
    bench.print_table(results, log)
    row = next(line for line in log.lines if line.startswith("bf16 hd128 full    4k") and "failed" in line)
    assert row.split()[4:] == ["300", "150*", "200", "failed", "-", "1.50", "-"]
    assert any(line.startswith("min") and line.split()[1:] == ["-", "1.50", "-"] for line in log.lines)
    assert "  sdpa_cudnn bwd failed on bf16 hd128 full 4k: RuntimeError: no cuDNN" in log.lines


def test_table_counts_the_rows_under_issue_12s_line(bench: ModuleType) -> None:
    """The count of cases under 0.9x a peer, per peer: 0.8x and 0.89x count, 0.9x and 1.5x do not."""
    results = []
    for seqlen, against_flash, against_cudnn in ((1024, 0.8, 1.5), (4096, 0.89, 0.9), (16384, 1.5, 0.85)):
        case = bench.Case("bf16", 128, False, seqlen, 16384 // seqlen, 16)
        ms = case.fwd_flops * 2.5 / 1e9 / 300
        results += [bench.Result(case, "lazytriton", "bwd", ms, 1e-3, "ok"),
                    bench.Result(case, "sdpa_flash", "bwd", ms * against_flash, 1e-3, "ok"),
                    bench.Result(case, "sdpa_cudnn", "bwd", ms * against_cudnn, 1e-3, "ok")]
    log = bench.Log()
    bench.print_table(results, log)
    under = next(line for line in log.lines if line.startswith("under 0.9"))
    assert under.split()[-3:] == ["0", "2", "1"]  # triton_jit (no rows), sdpa_flash, sdpa_cudnn


def test_cpu_smoke_runs_end_to_end(tmp_path: Path) -> None:
    """One tiny case on CPU: every provider either checked and timed or reported failed; rows and log written."""
    out_dir = tmp_path / "out"
    rows, stdout = run_bench(BENCH, tmp_path / "flash_bwd.csv", "--cpu-smoke", out_dir=out_dir)
    checks = {(r["provider"], r["mode"]): r["check"] for r in rows}
    assert checks == {("lazytriton", "bwd"): "ok", ("triton_jit", "bwd"): "ok", ("sdpa_flash", "bwd"): "ok",
                      ("sdpa_cudnn", "bwd"): "failed", ("lazytriton", "fwd+bwd"): "ok",
                      ("sdpa_flash", "fwd+bwd"): "ok", ("sdpa_cudnn", "fwd+bwd"): "failed"}
    assert all(r["kernel"] == "flash_bwd" and r["seqlen"] == "64" for r in rows)
    assert all(float(r["p50_ms"]) > 0 for r in rows if r["check"] == "ok")
    lines = stdout.splitlines()
    table = [n for n, line in enumerate(lines) if line.startswith("TFLOP/s")]
    assert len(table) == 2
    assert not any(line.startswith("bf16 hd32  causal  64  bwd") for line in lines[table[0]:])  # the table is last
    log = (out_dir / "bench_flash_bwd.log").read_text()
    assert "TFLOP/s (bwd)" in log and "sdpa_cudnn bwd failed on bf16 hd32 causal 64: RuntimeError" in log
