"""The backward as a kernel family like the forward: prewarm plans, limits, miss logs, tuning rows and images.

The pure parts run on made-up tables; the builds compile head dim 16 fp16 backward variants for
sm_90 (a second or two each, ``-j 2``), and a fresh process is served both backward kernels from
the image without importing triton.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from served import jit_prewarm_serve

from lazytriton import geometry, tuning
from lazytriton.cache_format.image import Image
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, dispatch
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm.enumeration import Axes, all_kernels, enumerate_variants, parse_kernels, variants_from_misses
from lazytriton.prewarm.limits import KNOWN_TARGETS, estimate_shared, refusal
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant, check_fields

SM90, SM80, SM86, GFX942 = (Target.parse(t) for t in ("sm_90", "sm_80", "sm_86", "gfx942"))
BWD = FAMILIES["flash_bwd"]
EMPTY = tuning.Table(())
CALL_SEQLENS = (1, 15, 16, 17, 64, 65, 100, 1000, 4096, 100_000)
EPOCH = "1700000000"


def bwd_row(kernel: str, sq: int, sk: int, block_m: int, block_n: int, causal: bool = False) -> tuning.Row:
    return tuning.Row("sm_90", kernel, "bf16", 128, causal, sq, sk, block_m, block_n, 4, 2, 0, 300.0, "NVIDIA H200",
                      "2026-11-30")


# A made-up backward table: the dq kernel tuned at two buckets, dK/dV at one.
TABLE = tuning.Table([bwd_row("flash_bwd_dq", 1024, 1024, 64, 64), bwd_row("flash_bwd_dq", 4096, 4096, 128, 64),
                      bwd_row("flash_bwd_dkdv", 4096, 4096, 64, 128)])


# --- kernels and families ---------------------------------------------------------------------------------------


def test_kernel_flags_take_families_and_kernel_names() -> None:
    assert all_kernels()[:3] == ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")  # then other families' kernels
    assert parse_kernels("flash_bwd") == BWD
    assert parse_kernels("flash_bwd_dkdv, flash_fwd,flash_bwd_dkdv") == ("flash_fwd", "flash_bwd_dkdv")
    assert parse_kernels("flash_fwd,flash_bwd") == all_kernels()[:3]
    for bad in ("flash_bwdx", "", " , "):
        with pytest.raises(ValueError, match="--kernel"):
            parse_kernels(bad)
    with pytest.raises(ValueError, match="kernel must be one of"):
        Axes((SM90,), kernels=("flash_bwd",))  # Axes take kernel names; the CLI expands families


# --- enumeration (pure) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [SM90, SM80, SM86, GFX942])
def test_the_default_grid_covers_every_backward_call_dispatch_can_make(target: Target) -> None:
    # bwd_default_config reads the class of seqlen_q for dq and of seqlen_k for dK/dV: every pair of call
    # seqlens must be served by a planned variant, and nothing is planned that no call selects.
    every = enumerate_variants(Axes((target,), kernels=BWD), EMPTY)
    # flash_bwd_dkdv_gluon twins (sm_90, shapes that fit BWD_GLUON_TABLE): the variant dispatch serves
    twins = [p for p in every if p.variant.kernel == "flash_bwd_dkdv_gluon"]
    assert bool(twins) == (str(target) == "sm_90") and {p.origin for p in twins} <= {"gluon table"}
    for p in twins:
        v = p.variant
        assert v == bwd_dispatch.flash_bwd_dkdv_gluon_default_variant(target, v.dtype, v.get("BLOCK_D"),
                                                                      v.get("CAUSAL"), True, False, 4096, 4096)
    # The fused backward's pairs (sm_90, BWD_FUSED_TABLE): the variants dispatch serves those shapes with
    fused_ = [p for p in every if p.variant.kernel in ("flash_bwd_prep", "flash_bwd_fused_gluon")]
    assert bool(fused_) == (str(target) == "sm_90") and {p.origin for p in fused_} <= {"fused table"}
    for p in fused_:
        v = p.variant
        causal = v.kernel == "flash_bwd_fused_gluon" and bool(v.get("CAUSAL"))
        pair = bwd_dispatch.flash_bwd_fused_default_variants(target, v.dtype, v.get("BLOCK_D"), causal, True, False,
                                                             4096, 4096)
        assert pair is not None and v in pair
    plan = [p for p in every if p.variant.kernel not in ("flash_bwd_dkdv_gluon", "flash_bwd_prep",
                                                          "flash_bwd_fused_gluon")]
    planned = {p.key for p in plan}
    assert len(planned) == len(plan) and {p.variant.kernel for p in plan} == set(BWD)
    assert {p.origin for p in plan} == {"default"}
    selected = set()
    for kernel, dtype, head_dim, causal in itertools.product(BWD, ("fp16", "bf16", "fp32"), geometry.HEAD_DIMS,
                                                             (False, True)):
        for sq, sk in itertools.product(CALL_SEQLENS, CALL_SEQLENS):
            selected.add(dispatch.kernel_variant(kernel, target, dtype, head_dim, causal, True, sq, sk,
                                                 table=EMPTY).key())
    assert selected == planned


def test_the_backward_tables_rows_are_planned_and_every_call_in_their_group_served() -> None:
    plan = enumerate_variants(Axes((SM90,), kernels=BWD, dtypes=("bf16",), head_dims=(128,), causal=(False,)), TABLE)
    from_table = sorted((p.variant.kernel, p.variant.get("BLOCK_M"), p.variant.get("BLOCK_N"),
                         "SEQ16" in dict(p.variant.functional)) for p in plan if p.origin == "table")
    # Each row twice: SEQ16 (seqlens multiples of 16) and ALIGN16 alone (other lengths, packed sequences).
    assert from_table == [(k, m, n, seq16) for k, m, n in (("flash_bwd_dkdv", 64, 128), ("flash_bwd_dq", 64, 64),
                                                           ("flash_bwd_dq", 128, 64)) for seq16 in (False, True)]
    keys = {p.key for p in plan}
    for kernel, sq, sk in itertools.product(BWD, CALL_SEQLENS, CALL_SEQLENS):
        assert dispatch.kernel_variant(kernel, SM90, "bf16", 128, False, True, sq, sk, table=TABLE).key() in keys
    # A forward row does not change the backward's plan, nor a backward row the forward's.
    fwd_only = enumerate_variants(Axes((SM90,), kernels=("flash_fwd",)), TABLE)
    assert fwd_only == enumerate_variants(Axes((SM90,), kernels=("flash_fwd",)), EMPTY)


def test_every_family_is_planned_by_default_in_a_stable_order() -> None:
    planned = enumerate_variants(Axes((GFX942, SM90), dtypes=("fp16",), head_dims=(64,)), EMPTY)
    # flash_fwd_gluon (in no family) is planned right after the flash_fwd variant it stands in for
    twins = [i for i, p in enumerate(planned) if p.variant.kernel == "flash_fwd_gluon"]
    assert twins and all(planned[i - 1].variant.kernel == "flash_fwd" for i in twins)
    # flash_bwd_dkdv_gluon likewise (none at head dim 64: tests/test_gluon_bwd.py checks its place)
    # and the fused backward's two kernels (none at head dim 64 fp16 default seqlens under 2k: test_fused_bwd.py)
    alternatives = ("flash_fwd_gluon", "flash_bwd_dkdv_gluon", "flash_bwd_prep", "flash_bwd_fused_gluon")
    plan = [p for p in planned if p.variant.kernel not in alternatives]
    order = [(p.variant.target, p.variant.kernel) for p in plan]
    assert order == sorted(order, key=lambda tk: (["gfx942", "sm_90"].index(tk[0]), all_kernels().index(tk[1])))
    # flash_fwd_mla (qv, v of 512) is planned only when asked for (--qv, or --head-dim-v over 256)
    # kv_append_lengths likewise, with the packed appends (--varlen)
    assert {k for _, k in order} == set(all_kernels()) - {"flash_fwd_mla", "kv_append_lengths"}
    just_bwd = enumerate_variants(Axes((GFX942, SM90), kernels=BWD, dtypes=("fp16",), head_dims=(64,)), EMPTY)
    assert just_bwd == [p for p in planned if p.variant.kernel in (*BWD, *alternatives[1:])]


# --- limits -------------------------------------------------------------------------------------------------------

# (kernel, target, dtype, head dim, BLOCK_M, BLOCK_N, num_stages, shared bytes Triton 3.9 reported for it),
# from lazytriton.compiler.compile_variant on this machine (2026-11-30); num_warps 4 unless noted in the config.
MEASURED_BWD = [
    ("flash_bwd_dq", "sm_90", "fp16", 128, 128, 32, 3, 114688),
    ("flash_bwd_dkdv", "sm_90", "fp16", 128, 32, 128, 3, 115200),
    ("flash_bwd_dq", "sm_80", "fp16", 128, 128, 32, 3, 98304),
    ("flash_bwd_dkdv", "sm_80", "fp16", 128, 32, 128, 3, 98816),
    ("flash_bwd_dq", "sm_90", "bf16", 256, 64, 32, 1, 98304),
    ("flash_bwd_dkdv", "sm_90", "bf16", 256, 32, 64, 1, 98304),
    ("flash_bwd_dq", "sm_80", "fp32", 256, 32, 16, 1, 98304),
    ("flash_bwd_dkdv", "sm_80", "fp32", 256, 16, 32, 1, 100352),
    ("flash_bwd_dq", "sm_80", "fp32", 128, 64, 32, 1, 98304),
    ("flash_bwd_dq", "sm_90", "fp16", 64, 128, 32, 3, 57344),
    ("flash_bwd_dkdv", "sm_86", "fp16", 128, 32, 64, 2, 53504),
    ("flash_bwd_dq", "sm_80", "fp16", 64, 64, 64, 2, 32768),
    ("flash_bwd_dkdv", "sm_90", "fp32", 64, 64, 32, 1, 57344),
    ("flash_bwd_dkdv", "sm_90", "bf16", 128, 64, 128, 4, 198144),  # 8 warps
    ("flash_bwd_dq", "sm_80", "fp16", 256, 128, 32, 3, 204800),  # over sm_80's 163 KiB: refused, rightly
    ("flash_bwd_dkdv", "gfx942", "fp16", 128, 32, 128, 2, 32768),
    ("flash_bwd_dq", "gfx942", "fp16", 128, 128, 32, 2, 32768),
    ("flash_bwd_dq", "gfx942", "fp32", 256, 32, 16, 1, 32768),
]


def bwd_variant(kernel: str, target: str, dtype: str, head_dim: int, block_m: int, block_n: int,
                stages: int) -> Variant:
    config = Config(block_m, block_n, 4, stages, 2)
    return dispatch.kernel_variant(kernel, Target.parse(target), dtype, head_dim, False, True, 4096, 4096,
                                   config=config)


@pytest.mark.parametrize(("kernel", "target", "dtype", "head_dim", "block_m", "block_n", "stages", "measured"),
                         MEASURED_BWD)
def test_the_backward_estimate_is_a_lower_bound_of_what_triton_allocated(
        kernel: str, target: str, dtype: str, head_dim: int, block_m: int, block_n: int, stages: int,
        measured: int) -> None:
    variant = bwd_variant(kernel, target, dtype, head_dim, block_m, block_n, stages)
    assert measured // 2 <= estimate_shared(variant) <= measured  # never above; not uselessly far below
    fits = measured <= KNOWN_TARGETS[target].shared
    assert (refusal(variant) is None) == fits, "refused exactly the measured variant that cannot load"


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950"])
def test_every_backward_variant_dispatch_selects_is_allowed(target: str) -> None:
    axes = Axes((Target.parse(target),), kernels=BWD, aligned=(True, False), index64=(False, True))
    for planned in enumerate_variants(axes, tuning.tables_for(BWD)):
        assert check_fields(planned.variant) is planned.variant
        assert refusal(planned.variant) is None, planned.variant


def test_oversized_backward_tiles_are_refused_with_a_reason() -> None:
    huge = bwd_variant("flash_bwd_dkdv", "sm_90", "fp32", 256, 64, 1024, 1)
    assert refusal(huge) == "BLOCK_N=1024 is over the cap of 256"
    wide = bwd_variant("flash_bwd_dq", "sm_90", "fp32", 256, 128, 128, 3)
    why = refusal(wide)
    assert why is not None and "needs at least 768 KiB of shared memory" in why and "sm_90 has 227 KiB" in why


# --- miss logs ----------------------------------------------------------------------------------------------------


def small_bwd(kernel: str, causal: bool = False, seqlen: int = 64) -> Variant:
    return dispatch.kernel_variant(kernel, SM90, "fp16", 16, causal, True, seqlen, seqlen)


def test_backward_variants_from_a_miss_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dq, dkdv, fwd = small_bwd("flash_bwd_dq"), small_bwd("flash_bwd_dkdv"), fwd_dispatch.flash_fwd_variant(
        SM90, "fp16", 16, False, True, 64)
    poisoned = str(bwd_variant("flash_bwd_dq", "sm_90", "fp32", 256, 128, 128, 3))
    lines = [json.dumps({"variant": v}) for v in (str(dq), str(fwd), poisoned, str(dkdv),
                                                  str(dq).replace("BLOCK_N=", "BLOCK_X="))]
    plan, problems = variants_from_misses(lines, "m.jsonl")
    assert [p.variant for p in plan] == [dq, fwd, dkdv]
    assert problems[0].startswith("m.jsonl:3: refused") and "shared memory" in problems[0]
    assert problems[1].startswith("m.jsonl:5: bad variant") and "BLOCK_N" in problems[1]

    misses = tmp_path / "misses.jsonl"
    misses.write_text("\n".join(lines) + "\n")
    assert cli_main(["prewarm", "--from-misses", str(misses), "--list"]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[2] for line in out.splitlines()] == [str(dq), str(fwd), str(dkdv)]
    assert "3 variants: flash_bwd_dq 1, flash_fwd 1, flash_bwd_dkdv 1" in err
    assert cli_main(["prewarm", "--from-misses", str(misses), "--kernel", "flash_bwd", "--list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [dq.key(), dkdv.key()]
    assert cli_main(["prewarm", "--from-misses", str(misses), "--kernel", "flash_bwd", "--dtype", "fp16",
                     "--list"]) == 2
    assert "only --target and --kernel filter it" in capsys.readouterr().err


def test_list_names_the_backward_variants(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["prewarm", "--target", "sm_90", "--dtype", "fp16", "--head-dim", "100", "--causal", "bottom_right"]
    assert cli_main([*common, "--kernel", "flash_bwd", "--list"]) == 0
    out, err = capsys.readouterr()
    listed = [line.split() for line in out.splitlines()]
    expected = enumerate_variants(Axes((SM90,), kernels=BWD, dtypes=("fp16",), head_dims=(100,), causal=(True,)),
                                  tuning.tables_for(BWD))
    assert [(k, Variant.parse(v)) for k, _, v in listed] == [(p.key, p.variant) for p in expected]
    assert {v.split(":")[0] for _, _, v in listed} == set(BWD)
    per_kernel = {k: sum(p.variant.kernel == k for p in expected) for k in BWD}
    assert err.strip() == f"{len(expected)} variants: flash_bwd_dq {per_kernel['flash_bwd_dq']}, " \
                          f"flash_bwd_dkdv {per_kernel['flash_bwd_dkdv']}"
    assert cli_main([*common, "--kernel", "flash_bwd_dkdv", "--list"]) == 0
    only = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in only] == [p.key for p in expected if p.variant.kernel == "flash_bwd_dkdv"]
    assert cli_main([*common, "--list"]) == 0  # default: every family
    every = {line.split()[2].split(":")[0] for line in capsys.readouterr().out.splitlines()}
    # planned when asked for: flash_fwd_mla (--qv, --head-dim-v over 256), kv_append_lengths (--varlen)
    assert every == set(all_kernels()) - {"flash_fwd_mla", "kv_append_lengths"}
    with pytest.raises(SystemExit):
        cli_main([*common, "--kernel", "flash_bwd_dv", "--list"])
    assert "neither a kernel family (flash_fwd, flash_bwd" in capsys.readouterr().err


# --- builds and a fresh process served from the image ----------------------------------------------------------

SMALL_BWD = ["--kernel", "flash_bwd", "--dtype", "fp16", "--head-dim", "16", "--causal", "none", "--seqlen-q", "64"]


def prewarm(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "lazytriton.cli", "prewarm", *args], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, SOURCE_DATE_EPOCH=EPOCH), check=False)
    assert result.returncode == 0, result.stderr
    return result


# Resolve the two kernels a backward of (1, 2, 64, 16) fp16 would launch, chosen by the binding itself.
RESOLVE_BACKWARD = """
import json, sys
import torch
from lazytriton import runtime
from lazytriton.kernels.flash_bwd import binding
from lazytriton.target import Target
shape = binding.Shape(1, 2, 2, 64, 64, 16)
variants = binding.variants(Target.parse("sm_90"), torch.float16, shape, False, True, False)
rt = runtime.get()
sources = [rt.resolve(v).source for v in variants]
print(json.dumps({"variants": [str(v) for v in variants], "sources": sources, "compiles": rt.compiles,
                  "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))[:3]}))
"""


def test_a_backward_jit_miss_is_prewarmed_and_then_served_from_an_image_without_triton(
        tmp_path: Path, cache_dir: Path) -> None:
    report = jit_prewarm_serve(RESOLVE_BACKWARD, "flash_bwd", tmp_path, cache_dir)
    assert [v.split(":")[0] for v in report["variants"]] == list(BWD)


def test_prewarm_kernel_flash_bwd_builds_what_a_backward_selects(tmp_path: Path) -> None:
    out = tmp_path / "bwd.ltimg"
    built = prewarm("--target", "sm_90", *SMALL_BWD, "-j", "2", "--out", str(out))
    assert "0 reused, 4 compiled, 0 failed" in built.stdout, built.stdout + built.stderr  # with and without SEQ16
    listed = prewarm("--target", "sm_90", *SMALL_BWD, "--list").stdout.split()
    with Image(out) as image:
        keys = list(image.keys())
        kernels = sorted(image.read(k).variant.split(":")[0] for k in keys)  # type: ignore[union-attr]
    assert sorted(keys) == sorted(listed[0::3]) and kernels == sorted(BWD * 2)
    chosen = [dispatch.kernel_variant(k, SM90, "fp16", 16, False, True, n, n).key() for k in BWD for n in (64, 63)]
    assert sorted(chosen) == sorted(keys)


# --- a miss log is untrusted input: any line gives a planned variant or a reported problem ---------------------

_INTS = st.one_of(st.integers(-3, 300), st.sampled_from([1024, 2**31, 2**63]))


@st.composite
def miss_lines(draw: st.DrawFn) -> str:
    kernel = draw(st.sampled_from([*all_kernels(), "flash_bwd", "nope"]))
    target = draw(st.sampled_from(["sm_90", "sm_80", "sm_86", "gfx942", "sm_12", "gfx9"]))
    dtype = draw(st.sampled_from(["fp16", "bf16", "fp32", "fp8"]))
    flags = ",".join(f"{name}={draw(st.sampled_from(['true', 'false', '1']))}"
                     for name in ("ALIGN16", "CAUSAL", "EVEN_D", "INDEX64"))
    tiles = ",".join(f"{name}={draw(_INTS)}" for name in draw(st.permutations(["BLOCK_M", "BLOCK_N"])))
    options = f"num_stages={draw(_INTS)},num_warps={draw(_INTS)}"
    text = f"{kernel}:{target}:{dtype}:{flags},BLOCK_D={draw(_INTS)}:{tiles}:{options}"
    return json.dumps({"variant": draw(st.one_of(st.just(text), st.text(max_size=80)))})


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(miss_lines(), max_size=4))
def test_any_miss_log_line_is_planned_or_reported(lines: list[str]) -> None:
    plan, problems = variants_from_misses(lines, "m.jsonl")
    assert len(plan) + len(problems) <= len(lines)
    for planned in plan:
        assert check_fields(planned.variant) is planned.variant and refusal(planned.variant) is None
    for problem in problems:
        assert problem.startswith("m.jsonl:")
