"""The attention combine (``flash_combine``) as a kernel family: variants, prewarm plans, its plan, images.

The pure parts run on an empty tuning table; the build compiles the three
bf16 variants prewarm plans for sm_90 (well under a second each, ``-j 2``),
and a fresh process is served the variant a call selects from that image
without importing triton.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_python

from lazytriton import launch, machine, runtime, tuning
from lazytriton.cache_format.image import Image
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, dispatch, flash_combine
from lazytriton.kernels.flash_combine import binding, checks
from lazytriton.kernels.request import Request
from lazytriton.prewarm.enumeration import Axes, all_kernels, enumerate_variants
from lazytriton.prewarm.limits import refusal
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

SM90, GFX942 = Target.parse("sm_90"), Target.parse("gfx942")
COMBINE = FAMILIES["flash_combine"]
EMPTY = tuning.Table(())
# Head dims a call may have: padded (64), chunked (256, 512), masked in one chunk (40, 96) or in the last (192, 320).
CALL_HEAD_DIMS = (64, 128, 256, 512, 80, 96, 192, 320, 1000)


def test_the_variant_string_is_stable() -> None:
    assert str(flash_combine.variant(SM90, "bf16", 96, True, False)) == (
        "flash_combine:sm_90:bf16:ALIGN16=true,BLOCK_D=128,EVEN_D=false,INDEX64=false:BLOCK_M=2,BLOCK_N=16:"
        "num_stages=1,num_warps=4")
    assert str(flash_combine.variant(GFX942, "fp32", 40, False, True)) == (
        "flash_combine:gfx942:fp32:ALIGN16=false,BLOCK_D=64,EVEN_D=false,INDEX64=true:BLOCK_M=4,BLOCK_N=16:"
        "num_stages=1,num_warps=4,waves_per_eu=2")
    assert [flash_combine.block_d(d) for d in (1, 16, 17, 64, 65, 128, 129, 512)] == [16, 16, 32, 64, 128, 128, 128,
                                                                                      128]


@pytest.mark.parametrize("target", [SM90, GFX942])
def test_the_default_plan_serves_every_call_of_its_grid(target: Target) -> None:
    plan = enumerate_variants(Axes((target,), kernels=COMBINE), EMPTY)
    planned = {p.key for p in plan}
    assert len(plan) == len(planned) == 9 and {p.origin for p in plan} == {"default"}
    assert {p.variant.dtype for p in plan} == {"fp32", "bf16", "fp16"}
    for p in plan:
        assert check_fields(p.variant) is p.variant and refusal(p.variant) is None
    for dtype, head_dim in itertools.product(("fp32", "bf16", "fp16"), CALL_HEAD_DIMS):
        chosen = dispatch.kernel_variant("flash_combine", target, dtype, head_dim, False, True, 1, 1, table=EMPTY)
        assert chosen.key() in planned, chosen
        assert chosen == flash_combine.variant(target, dtype, head_dim, True, False)


def test_axes_narrow_the_plan_and_v_head_dims_are_the_ones_combined() -> None:
    plan = enumerate_variants(Axes((SM90,), kernels=COMBINE, dtypes=("bf16",), head_dims=(192,),
                                   head_dims_v=(128, 40), aligned=(True, False), index64=(False, True)), EMPTY)
    assert {(p.variant.get("BLOCK_D"), p.variant.get("EVEN_D")) for p in plan} == {(128, True), (64, False)}
    assert len(plan) == 2 * 2 * 2
    assert any(p.variant.kernel == "flash_combine" for p in enumerate_variants(
        Axes((SM90,), dtypes=("fp16",), head_dims=(64,)), EMPTY)), "every family is planned by default"
    assert "flash_combine" in all_kernels()


def test_prewarm_lists_the_family(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["prewarm", "--target", "sm_90", "--kernel", "flash_combine", "--dtype", "bf16", "--list"]) == 0
    listed = [line.split() for line in capsys.readouterr().out.splitlines()]
    expected = enumerate_variants(Axes((SM90,), kernels=COMBINE, dtypes=("bf16",)), EMPTY)
    assert [(key, Variant.parse(text)) for key, _, text in listed] == [(p.key, p.variant) for p in expected]


def test_explain_describes_the_combine_at_vs_head_dim(capsys: pytest.CaptureFixture[str]) -> None:
    described = Request("bf16", 192, True, True, 4, 4096, head_dim_v=512)
    variant, config, row = dispatch.choice("flash_combine", SM90, described)
    assert variant == flash_combine.variant(SM90, "bf16", 512, True, False) and row is None
    assert (config.block_m, config.block_n) == (variant.get("BLOCK_M"), variant.get("BLOCK_N"))
    assert cli_main(["cache", "explain", "--kernel", "flash_combine", "--dtype", "fp16", "--head-dim", "192",
                     "--head-dim-v", "96", "--seqlen-q", "1", "--target", "sm_90", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["variant"] == str(flash_combine.variant(SM90, "fp16", 96, True, False))


# --- the plan and the launch's flags ------------------------------------------------------------------------------


class _Runtime:
    """Loads nothing: ``kernel`` returns its variant and counts the loads."""

    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}
        self.loads: list[Variant] = []

    def loaded(self, variant: Variant, device_index: int) -> Any:
        return None

    def kernel(self, variant: Variant, device_index: int) -> Variant:
        self.loads.append(variant)
        return variant


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    rt = _Runtime()
    monkeypatch.setattr(machine, "target_of_device", lambda device: SM90)
    monkeypatch.setattr(launch, "is_capturing", lambda: False)
    monkeypatch.setattr(launch, "current_device", None)
    monkeypatch.setattr(runtime, "get", lambda: rt)
    return rt


def test_the_plan_is_the_kernel_with_its_row_and_column_tiles(sm90: _Runtime, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    device = torch.device("cuda", 0)
    kernel, block_m, cols = binding.plan(device, torch.bfloat16, 256, True, False)
    assert kernel == flash_combine.variant(SM90, "bf16", 256, True, False)
    assert (block_m, cols) == (kernel.get("BLOCK_M"), kernel.get("BLOCK_D")) == (2, 128)
    assert binding.plan(device, torch.bfloat16, 512, True, False)[0] is kernel  # one variant: one memo entry
    assert binding.plan(device, torch.bfloat16, 128, True, False)[0] is kernel and len(sm90.loads) == 1
    monkeypatch.setattr(launch, "is_capturing", lambda: True)
    with pytest.raises(launch.CaptureError, match="run flash_attn_combine once with this head dim"):
        binding.plan(device, torch.bfloat16, 96, True, False)


def test_layout_flags_read_the_outputs_alignment_and_every_tensors_extent() -> None:
    out_partial, lse_partial = torch.empty(3, 2, 5, 4, 64), torch.empty(3, 2, 5, 4)
    call = checks.check(out_partial, lse_partial)
    out, lse = binding.empty_outputs(out_partial, call)
    assert binding.layout_flags(out_partial, lse_partial, out, lse) == (True, False)
    odd = torch.empty(3, 2, 5, 4, 72)[..., :64]  # a head stride of 72: not a multiple of 16
    assert binding.layout_flags(odd, lse_partial, out, lse) == (False, False)
    # lse_partial's strides (FlashAttention-3's: 1 along seqlen) do not count
    assert binding.layout_flags(out_partial, torch.empty(3, 2, 4, 5).transpose(-1, -2), out, lse)[0]
    huge = torch.empty_strided((300, 1, 1, 1, 64), (2**23, 64, 64, 64, 1), device="meta")
    assert binding.layout_flags(huge, lse_partial, out, lse)[1]


def test_the_packed_form_passes_a_batch_stride_of_0() -> None:
    out_partial, lse_partial = torch.empty(3, 10, 4, 64), torch.empty(3, 4, 10).transpose(1, 2)
    call = checks.check(out_partial, lse_partial)
    out, lse = binding.empty_outputs(out_partial, call)
    args = dict(zip(flash_combine.INT_PARAMS, binding.ints(out_partial, lse_partial, out, lse, call), strict=True))
    assert (args["stride_opn"], args["stride_opb"], args["stride_ops"], args["stride_oph"]) == (2560, 0, 256, 64)
    assert (args["stride_lpn"], args["stride_lpb"], args["stride_lps"], args["stride_lph"]) == (40, 0, 1, 10)
    assert (args["stride_ob"], args["stride_os"], args["stride_oh"]) == (0, 256, 64)
    assert (args["stride_lb"], args["stride_ls"], args["stride_lh"]) == (0, 1, 10)
    assert (args["heads"], args["seqlen"], args["head_dim"], args["num_splits"], args["n_rows"]) == (4, 10, 64, 3, 40)


# --- a build, and a fresh process served from the image -----------------------------------------------------------

RESOLVE = """
import json, sys
from lazytriton import runtime
from lazytriton.kernels import flash_combine
from lazytriton.target import Target
variant = flash_combine.variant(Target.parse("sm_90"), "bf16", 256, True, False)
rt = runtime.get()
print(json.dumps({"variant": str(variant), "source": rt.resolve(variant).source, "compiles": rt.compiles,
                  "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))[:3]}))
"""


def test_prewarm_builds_the_family_and_a_call_is_served_from_the_image_without_triton(tmp_path: Path) -> None:
    image = tmp_path / "combine.ltimg"
    args = ["--target", "sm_90", "--kernel", "flash_combine", "--dtype", "bf16"]
    built = subprocess.run([sys.executable, "-m", "lazytriton.cli", "prewarm", *args, "-j", "2", "--out", str(image)],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, SOURCE_DATE_EPOCH="1700000000"), check=False)
    assert built.returncode == 0 and "0 reused, 3 compiled, 0 failed" in built.stdout, built.stdout + built.stderr
    with Image(image) as served:
        keys = sorted(served.keys())
    assert keys == sorted(p.key for p in enumerate_variants(Axes((SM90,), kernels=COMBINE, dtypes=("bf16",)), EMPTY))
    empty = tmp_path / "empty-cache"
    served_run = run_python(RESOLVE, {"LAZYTRITON_CACHE_DIR": str(empty), "LAZYTRITON_IMAGES": str(image),
                                      "LAZYTRITON_JIT": "0"})
    assert served_run.returncode == 0, served_run.stderr
    report = json.loads(served_run.stdout.splitlines()[-1])
    assert report["source"] == "image" and report["compiles"] == 0 and report["triton"] == []
    assert Variant.parse(report["variant"]).key() in keys
