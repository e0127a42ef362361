"""The attention sinks' gradient kernel (``flash_bwd_dsinks``): numerics, determinism, variants, prewarm, explain, C.

On the CPU through Triton's interpreter against the float64 reference
(``reference.dsinks``, the torch formula of ``flash_fwd.sinks.grad``):
dense and packed layouts, used lengths (rows past them never read), rows
with no key and no sink (NaN gaps add 0); the same bits on every run. The
family's variant, prewarm plan and ``cache explain`` answer; the C API's
launcher passes the binding's arguments (``c_initializer`` against
lt_bwd.c's text) and the native core computes the same variant and key. On
the GPU, at real sizes: the kernel against the float64 formula, bitwise
reproducible, and a backward with sinks whose d(sinks) is the Python path's.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, gpu
from nativelib import SANITIZER_ENV, build_driver

from lazytriton import tuning
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, dispatch, flash_bwd_dsinks
from lazytriton.kernels.flash_bwd_dsinks import binding, reference
from lazytriton.kernels.request import Request
from lazytriton.prewarm.enumeration import Axes, enumerate_variants
from lazytriton.prewarm.limits import refusal
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

SM90 = Target.parse("sm_90")
EMPTY = tuning.Table(())


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), (got, want)


def test_dense_rows_against_the_float64_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    for batch, heads, seqlen in ((1, 1, 1), (2, 4, 13), (3, 2, 9)):
        sinks = torch.randn(heads, generator=gen)
        lse = torch.randn(batch, heads, seqlen, generator=gen) + 1.5
        delta = torch.randn(batch, heads, seqlen, generator=gen)
        _close(binding.dsinks(sinks, lse, delta), reference.dsinks(sinks, lse, delta))


def test_packed_rows_and_used_lengths() -> None:
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)  # lengths 3, 0, 17, 1
    used = torch.tensor([2, 0, 11, 1], dtype=torch.int32)
    sinks = torch.randn(4, generator=gen)
    lse, delta = torch.randn(4, 21, generator=gen), torch.randn(4, 21, generator=gen)
    _close(binding.dsinks(sinks, lse, delta, cu), reference.dsinks(sinks, lse, delta, cu))
    poisoned = delta.clone()
    keep = torch.zeros(21, dtype=torch.bool)
    for start, n in ((0, 2), (3, 11), (20, 1)):
        keep[start:start + n] = True
    poisoned[:, ~keep] = float("nan")  # rows past seqused_q are never written by the backward: never read here
    got = binding.dsinks(sinks, lse, poisoned, cu, used)
    _close(got, reference.dsinks(sinks, lse, delta, cu, used))


def test_rows_without_key_or_sink_add_nothing_and_the_bits_repeat() -> None:
    gen = torch.Generator().manual_seed(3)
    sinks = torch.tensor([float("-inf"), 0.5, -1.0])
    lse, delta = torch.randn(2, 3, 40, generator=gen), torch.randn(2, 3, 40, generator=gen)
    lse[:, 0, :7] = float("-inf")  # no key and no sink: the gap is NaN
    got = binding.dsinks(sinks, lse, delta)
    assert torch.isfinite(got).all() and got[0] == 0
    _close(got, reference.dsinks(sinks, lse, delta))
    assert torch.equal(got, binding.dsinks(sinks, lse, delta))


def test_the_variant_string_is_stable_and_prewarm_plans_the_family() -> None:
    assert str(flash_bwd_dsinks.variant(SM90, True, True, False)) == (
        "flash_bwd_dsinks:sm_90:fp32:INDEX64=false,SEQUSED_Q=true,VARLEN=true:BLOCK_M=256:num_stages=1,num_warps=4")
    with pytest.raises(ValueError, match="seqused_q needs packed sequences"):
        flash_bwd_dsinks.variant(SM90, False, True, False)
    plan = enumerate_variants(Axes((SM90,), kernels=FAMILIES["flash_bwd_dsinks"], index64=(False, True)), EMPTY)
    assert len(plan) == 6 and all(check_fields(p.variant) is p.variant and refusal(p.variant) is None for p in plan)
    planned = {p.key for p in plan}
    for varlen, used, wide in ((False, False, False), (True, False, True), (True, True, False)):
        chosen = dispatch.kernel_variant("flash_bwd_dsinks", SM90, "bf16", 128, True, True, 4096, 4096, varlen=varlen,
                                         seqused_q=used, index64=wide)
        assert chosen == flash_bwd_dsinks.variant(SM90, varlen, used, wide) and chosen.key() in planned


def test_explain_answers_for_the_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    variant, config, row = dispatch.choice("flash_bwd_dsinks", SM90, Request("bf16", 128, True, True, 64, 64,
                                                                             varlen=True))
    assert variant == flash_bwd_dsinks.variant(SM90, True, False, False) and row is None
    assert config.block_m == flash_bwd_dsinks.BLOCK_M
    assert cli_main(["cache", "explain", "--kernel", "flash_bwd_dsinks", "--dtype", "bf16", "--head-dim", "64",
                     "--seqlen-q", "128", "--target", "sm_90", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["variant"] == str(flash_bwd_dsinks.variant(SM90, False, False, False))


def test_the_c_launcher_passes_the_bindings_arguments() -> None:
    source = (REPO / "capi" / "lt_bwd.c").read_text()
    found = re.search(r"int64_t ints\[LT__BWD_DSINKS_PARAMS \+ LT__MAX_HIDDEN\] = \{(.*?)\};", source, re.S)
    assert found is not None
    c_items = [" ".join(item.split()) for item in re.split(r",\s*(?![^()]*\))", found[1].strip())]
    expected = [" ".join(item.split()) for item in binding.c_initializer().split(", ")]
    assert c_items == expected
    count = re.search(r"#define LT__BWD_DSINKS_PARAMS (\d+)", source)
    assert count is not None and int(count[1]) == len(flash_bwd_dsinks.INT_PARAMS)


def test_the_native_core_chooses_the_same_variant_and_key(tmp_path: Path) -> None:
    program, _ = build_driver(tmp_path, "native_dsinks")  # tests/capi/native_dsinks.c
    calls = [(cap, varlen, used, wide) for cap in (80, 90, 100) for varlen in (0, 1) for used in (0, 1)
             for wide in (0, 1)]
    done = subprocess.run([str(program)], input="".join(" ".join(map(str, c)) + "\n" for c in calls),
                          capture_output=True, text=True, timeout=300, env=SANITIZER_ENV | {"PATH": "/usr/bin:/bin"},
                          check=True)
    for call, answer in zip(calls, done.stdout.splitlines(), strict=True):
        cap, varlen, used, wide = call
        if used and not varlen:
            assert answer.startswith("error "), (call, answer)
            continue
        want = flash_bwd_dsinks.variant(Target("cuda", str(cap), 32), bool(varlen), bool(used), bool(wide))
        assert answer == f"ok {want} {want.key()}", call
        assert Variant.parse(answer.split()[1]) == want


@gpu
@pytest.mark.gpu
def test_the_kernel_on_the_gpu_is_the_formula_and_repeats_its_bits() -> None:
    from lazytriton.kernels.flash_fwd import sinks as fwd_sinks

    gen = torch.Generator(device="cuda").manual_seed(4)
    for batch, heads, seqlen in ((8, 64, 4096), (1, 8, 100_000), (2, 1, 1)):
        sinks = torch.randn(heads, device="cuda", generator=gen)
        lse = torch.randn(batch, heads, seqlen, device="cuda", generator=gen) + 3
        delta = torch.randn(batch, heads, seqlen, device="cuda", generator=gen)
        got = binding.dsinks(sinks, lse, delta)
        want = reference.dsinks(sinks.cpu(), lse.cpu(), delta.cpu())
        same_precision = fwd_sinks.grad(sinks, lse, delta, 1).double().cpu()
        assert (got.double().cpu() - want).abs().max() <= 2 * (same_precision - want).abs().max() + 1e-4
        assert torch.equal(got, binding.dsinks(sinks, lse, delta))
    cu = torch.tensor([0, 1000, 1000, 70_000], dtype=torch.int32, device="cuda")
    used = torch.tensor([999, 0, 50_000], dtype=torch.int32, device="cuda")
    sinks = torch.randn(16, device="cuda", generator=gen)
    lse, delta = (torch.randn(16, 70_000, device="cuda", generator=gen) for _ in range(2))
    got = binding.dsinks(sinks, lse, delta, cu, used)
    want = reference.dsinks(sinks.cpu(), lse.cpu(), delta.cpu(), cu.cpu(), used.cpu())
    assert (got.double().cpu() - want).abs().max() <= 1e-3 * want.abs().max()
