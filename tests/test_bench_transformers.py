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


def test_the_prefill_profile_counts_the_attention_kernels_apart() -> None:
    """``--profile-prefill``'s share: lazytriton's, cuDNN's, FlashAttention's and the mem-efficient kernels are
    attention; GEMMs, elementwise and norm kernels are not."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_transformers
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    rows = [("flash_fwd_gluon_kernel", 30.0), ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 20.0),
            ("void pytorch_flash::flash_fwd_kernel<...>", 5.0), ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", 5.0),
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 100.0),
            ("void at::native::elementwise_kernel<128, 4, ...>", 30.0), ("void at::native::rms_norm_kernel", 10.0)]
    total, attention = bench_transformers.attention_share(iter(rows))
    assert (total, attention) == (200.0, 60.0)
    assert bench_transformers.attention_share([]) == (0, 0)
