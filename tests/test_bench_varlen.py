"""benchmarks/bench_varlen.py on CPU: its batch, its FLOP count, its padding, its check, and one smoke run.

The benchmark itself needs the H200; these keep it importable and runnable
(``--cpu-smoke`` runs a tiny batch end to end through Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from benchlib import bench_module, run_bench
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_varlen.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    yield bench_module(monkeypatch, BENCH)


def test_the_batch_is_fixed_and_flops_count_real_tokens(bench: ModuleType) -> None:
    lengths = bench.lengths_of(16)
    assert lengths == bench.lengths_of(16) and len(lengths) == 16 and all(128 <= n <= 4096 for n in lengths)
    case_list = bench.cases([64, 128], [False, True], lengths)
    assert [(c.head_dim, c.causal, c.heads) for c in case_list] == [(64, False, 32), (64, True, 32), (128, False, 16),
                                                                    (128, True, 16)]
    full = case_list[2]
    assert full.fwd_flops == 4 * 16 * 128 * sum(n * n for n in lengths) == 2 * case_list[3].fwd_flops


def test_padding_round_trips_and_the_check_flags_a_wrong_answer(bench: ModuleType) -> None:
    case = bench.Case(16, True, (3, 7, 1), 2)
    b = bench.make_batch(case, torch.device("cpu"), seed=1)
    padded = bench.pad(b, b.q)
    assert padded.shape == (3, 2, 7, 16) and (padded[0, :, 3:] == 0).all()
    assert torch.equal(bench.unpad(b, padded), b.q)
    assert b.key_mask[:, 0, 0].tolist() == [[True] * 3 + [False] * 4, [True] * 7, [True] + [False] * 6]
    ref = bench.reference(b, case, backward=False)
    exact = bench.FACTORIES["lt_varlen"](b, case, False)()
    ok, err, note = bench.check(exact, ref)
    assert ok and note == ""
    wrong = exact[0].clone()
    wrong[b.cu[1]:b.cu[2], 0] *= 1.5  # the longest sequence, head 0
    ok, _, note = bench.check((wrong,), ref)
    assert not ok and "out of sequence 1" in note


def test_cpu_smoke_runs_end_to_end(tmp_path: Path) -> None:
    """A tiny batch on CPU: every provider checked and timed, or reported failed or unchecked; rows written."""
    rows, stdout = run_bench(BENCH, tmp_path / "varlen.csv", "--cpu-smoke", "--causal", "full")
    checks = {(r["provider"], r["mode"]): r["check"] for r in rows}
    for mode in ("fwd", "fwd+bwd"):
        assert checks[("lt_varlen", mode)] == checks[("lt_varlen_api", mode)] == "ok"
        assert checks[("lt_dense", mode)] == checks[("sdpa_flash", mode)] == "unchecked"  # no key mask: by design
        assert checks[("sdpa_cudnn", mode)] == "failed"  # no cuDNN on the CPU
    assert all(r["kernel"] == "flash_varlen" and r["tokens"] == "31" and r["max_seqlen"] == "17" for r in rows)
    assert all(float(r["p50_ms"]) > 0 for r in rows if r["check"] != "failed")
    lines = stdout.splitlines()
    assert sum(line.startswith("TFLOP/s on real tokens") for line in lines) == 2
    assert any("sdpa_cudnn fwd failed" in line for line in lines)
