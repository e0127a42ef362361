"""kv_append's packed new keys (cu_seqlens_k_new, VARLEN=true) in prewarm and ``cache explain``.

Prewarm's packed-sequences axis (``--varlen``) plans kv_append's VARLEN variants beside the plain ones, and only
when asked; ``cache explain --kernel kv_append --varlen`` describes the call and names cu_seqlens_k_new, and
refuses ``--varlen`` for the decoding kernels (packed queries are ``--varlen-q``). The planned variant is the one
a call with cu_seqlens_k_new runs (``kv_append.binding``'s plan), so a prewarmed image serves it.
"""

from __future__ import annotations

import pytest

from lazytriton import tuning
from lazytriton.cli import main as cli_main
from lazytriton.kernels import kv_append
from lazytriton.kernels.flash_decode import checks
from lazytriton.prewarm.enumeration import Axes, enumerate_variants
from lazytriton.target import Target

SM90 = Target.parse("sm_90")
KERNELS = ("flash_decode_split", "flash_decode_combine", "kv_append")


def planned(**axes: object) -> list[str]:
    chosen = Axes(targets=(SM90,), kernels=KERNELS, dtypes=("bf16",), head_dims=(128,), seqlens_q=(16,),
                  seqlens_k=(4096,), paged=(True,), **axes)  # type: ignore[arg-type]
    return [str(p.variant) for p in enumerate_variants(chosen, tuning.tables_for(KERNELS))]


def test_prewarm_plans_the_varlen_append_only_when_asked() -> None:
    plain, packed = planned(), planned(varlen=(False, True))
    appends = [v for v in packed if v.startswith("kv_append:")]
    assert not any("VARLEN" in v for v in plain)
    assert len(appends) == 2 and sum("VARLEN=true" in v for v in appends) == 1
    assert [v for v in packed if not v.startswith("kv_append")] == [v for v in plain if not v.startswith("kv_append")]
    assert not any("VARLEN=true" in v for v in packed if v.startswith("flash_decode")), "the decoding kernels' own"


def test_the_planned_variant_is_the_one_a_packed_call_runs() -> None:
    call = checks.Call(2, 8, 2, 1, 128, 3, 4096, 16, 64, -1, False, 0.1, varlen_new=True)
    ran = kv_append.variant(SM90, "bf16", call.head_dim, call.head_dim_v, call.paged, True, False,
                            kv_fp8=call.kv_fp8, varlen=call.varlen_new)
    assert str(ran) in planned(varlen=(True,))


def test_prewarm_cli_lists_the_varlen_append(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["prewarm", "--kernel", "flash_decode", "--target", "sm_90", "--dtype", "bf16", "--head-dim",
                     "128", "--seqlen-q", "16", "--seqlen-k", "4096", "--varlen", "--list"]) == 0
    listed = capsys.readouterr().out
    assert any(" kv_append:" in line and "VARLEN=true" in line for line in listed.splitlines()), listed


def test_explain_names_cu_seqlens_k_new(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["cache", "explain", "--kernel", "kv_append", "--dtype", "bf16", "--head-dim", "128",
                     "--seqlen-q", "1", "--seqlen-k", "4096", "--varlen", "--target", "sm_90"]) == 0
    text = capsys.readouterr().out
    assert "VARLEN=true" in text and "cu_seqlens_k_new" in text
    assert cli_main(["cache", "explain", "--kernel", "kv_append", "--dtype", "bf16", "--head-dim", "128",
                     "--seqlen-q", "1", "--seqlen-k", "4096", "--target", "sm_90"]) == 0
    assert "VARLEN" not in capsys.readouterr().out
    assert cli_main(["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128",
                     "--seqlen-q", "1", "--varlen", "--target", "sm_90"]) != 0
    assert "packed queries are --varlen-q" in capsys.readouterr().err


def test_explain_json_carries_the_varlen_append(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli_main(["cache", "explain", "--kernel", "kv_append", "--dtype", "fp16", "--head-dim", "64",
                     "--head-dim-v", "512", "--seqlen-q", "1", "--seqlen-k", "256", "--varlen", "--page-size", "64",
                     "--target", "sm_90", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # the family: kv_append, then kv_append_lengths
    found = {kernel["kernel"]: kernel["variant"] for kernel in report["kernels"]}
    assert report["call"]["varlen"] and "VARLEN=true" in found["kv_append"] and "BLOCK_DV=512" in found["kv_append"]
    assert found["kv_append_lengths"].startswith("kv_append_lengths:sm_90:fp32:")
