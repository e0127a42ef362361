"""The gradient of SDPA's float attn_mask: flash_bwd_dq's BIAS_GRAD, summed over the mask's broadcast dims.

CPU tests run the kernels through Triton's interpreter at small shapes and
compare with torch's math backend in float64 (the mask's gradient is dS =
P (dP - rowsum(dO * O)), summed over every dim the mask broadcasts along, in
the mask's dtype); half-precision calls follow FlashAttention's rule against
the same math in their own dtype. GPU tests (``-m gpu``) compare with torch's
mem-efficient backend, the one that computes this gradient, at real sizes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from flash_rule import check_rule
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import make_qkv, on_gpu, seed_of
from torch.nn.attention import SDPBackend, sdpa_kernel

import lazytriton
from lazytriton import sdpa
from lazytriton.interface import always_through_op
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_fwd import binding, score_mods
from lazytriton.kernels.flash_fwd.reference import dropout_keep
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

# Every broadcast form of a mask over (batch 2, heads 4, 19 queries, 21 keys): both seqlens over the
# interpreter's 16-row tiles, so a ragged tile of each axis is written too.
B, H, SQ, SK, D = 2, 4, 19, 21, 16
MASK_SHAPES = ((SQ, SK), (1, SK), (SQ, 1), (H, SQ, SK), (1, H, SQ, SK), (B, 1, SQ, SK), (B, H, SQ, SK),
               (B, 1, 1, SK), (H, 1, 1), (1, 1))


def _torchs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, do: torch.Tensor,
            backend: SDPBackend = SDPBackend.MATH, **kwargs: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(out, (dq, dk, dv, dmask)) of torch's SDPA on one backend, in the inputs' dtypes."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mask)]
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], **kwargs)
    return out, torch.autograd.grad(out, leaves, do)


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, do: torch.Tensor,
           **kwargs: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(out, (dq, dk, dv, dmask)) of torch's math SDPA in float64."""
    return _torchs(*(t.double() for t in (q, k, v, mask, do)), **kwargs)


def _ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, do: torch.Tensor,
          qkv_grad: bool = True, **kwargs: Any) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """(out, (dq, dk, dv, dmask)) of lazytriton's SDPA; dq, dk, dv None unless ``qkv_grad``."""
    leaves = [t.detach().clone().requires_grad_(qkv_grad) for t in (q, k, v)]
    m = mask.detach().clone().requires_grad_()
    out = lazytriton.scaled_dot_product_attention(*leaves, attn_mask=m, **kwargs)
    wanted = [*leaves, m] if qkv_grad else [m]
    grads = torch.autograd.grad(out, wanted, do)
    return out, tuple(grads) if qkv_grad else (None, None, None, grads[0])


def _mask(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0,
          neg_inf: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.randn(shape, generator=gen).to(dtype)
    return mask.masked_fill(torch.rand(shape, generator=gen) < neg_inf, float("-inf")) if neg_inf else mask


# ---------------------------------------------------------------------------
# float32 against float64, every broadcast form


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_every_broadcast_form_gets_torchs_gradient(shape: tuple[int, ...]) -> None:
    q, k, v = make_qkv(B, (H, H), (SQ, SK), D, torch.float32, seed=seed_of(shape))
    mask = _mask(shape, seed=seed_of("mask", shape), neg_inf=0.15)
    do = torch.randn(B, H, SQ, D, generator=torch.Generator().manual_seed(3))
    out, got = _ours(q, k, v, mask, do)
    exact_out, exact = _exact(q, k, v, mask, do)
    torch.testing.assert_close(out.double(), exact_out, atol=2e-6, rtol=0)
    assert got[3].shape == mask.shape and got[3].dtype == mask.dtype
    for name, g, e in zip(("dq", "dk", "dv", "dmask"), got, exact, strict=True):
        torch.testing.assert_close(g.double(), e, atol=2e-5, rtol=0, msg=name)


def test_gqa_scale_and_five_dim_batch() -> None:
    """enable_gqa (4 query heads over 2), a scale of its own, and batch dims (3, 2) the mask broadcasts over one of."""
    q = torch.randn(3, 2, 4, 17, D, generator=torch.Generator().manual_seed(1))
    k, v = (torch.randn(3, 2, 2, 18, D, generator=torch.Generator().manual_seed(s)) for s in (2, 3))
    mask = _mask((2, 1, 17, 18), seed=4, neg_inf=0.1)
    do = torch.randn(3, 2, 4, 17, D, generator=torch.Generator().manual_seed(5))
    kwargs = {"enable_gqa": True, "scale": 0.3}
    out, got = _ours(q, k, v, mask, do, **kwargs)
    exact_out, exact = _exact(q, k, v, mask, do, **kwargs)
    torch.testing.assert_close(out.double(), exact_out, atol=2e-6, rtol=0)
    for name, g, e in zip(("dq", "dk", "dv", "dmask"), got, exact, strict=True):
        torch.testing.assert_close(g.double(), e, atol=2e-5, rtol=0, msg=name)


def test_mask_gradient_alone_when_query_key_and_value_need_none() -> None:
    q, k, v = make_qkv(B, (H, 2), (SQ, SK), D, torch.float32, seed=6)
    mask = _mask((1, H, SQ, SK), seed=7)
    do = torch.randn(B, H, SQ, D, generator=torch.Generator().manual_seed(8))
    out, got = _ours(q, k, v, mask, do, qkv_grad=False, enable_gqa=True)
    _, exact = _exact(q, k, v, mask, do, enable_gqa=True)
    assert got[:3] == (None, None, None) and out.requires_grad
    torch.testing.assert_close(got[3].double(), exact[3], atol=2e-5, rtol=0)


def test_rows_with_every_key_masked_get_zero_gradient_as_torch_gives() -> None:
    """-inf entries and whole -inf rows: torch's math backend gives output 0 and mask gradient 0 there; so do we."""
    q, k, v = make_qkv(1, (2, 2), (SQ, SK), D, torch.float32, seed=9)
    mask = _mask((SQ, SK), seed=10, neg_inf=0.3)
    mask[4] = float("-inf")
    mask[17, :18] = float("-inf")  # the only visible keys in the last, ragged key tile
    do = torch.randn(1, 2, SQ, D, generator=torch.Generator().manual_seed(11))
    out, got = _ours(q, k, v, mask, do)
    exact_out, exact = _exact(q, k, v, mask, do)
    assert (exact_out[:, :, 4] == 0).all() and (out[:, :, 4] == 0).all()
    assert (exact[3][4] == 0).all() and (got[3][4] == 0).all()
    assert (got[3][mask == float("-inf")] == 0).all() and torch.isfinite(got[3]).all()
    torch.testing.assert_close(got[3].double(), exact[3], atol=2e-5, rtol=0)


# ---------------------------------------------------------------------------
# Half precision: FlashAttention's rule, a mask of q's dtype and a float32 one


@pytest.mark.parametrize(("dtype", "mask_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                   (torch.float16, torch.float16)], ids=str)
def test_half_precision_follows_flash_attentions_rule(dtype: torch.dtype, mask_dtype: torch.dtype) -> None:
    q, k, v = make_qkv(B, (H, 2), (SQ, SK), D, dtype, seed=seed_of(dtype, mask_dtype))
    mask = _mask((1, H, SQ, SK), mask_dtype, seed=12, neg_inf=0.1)
    do = torch.randn(B, H, SQ, D, generator=torch.Generator().manual_seed(13)).to(dtype)
    out, got = _ours(q, k, v, mask, do, enable_gqa=True)
    _, exact = _exact(q, k, v, mask, do, enable_gqa=True)
    _, same = _torchs(q, k, v, mask, do, enable_gqa=True)
    assert got[3].dtype == mask_dtype and got[3].shape == mask.shape
    for name, g, e, s in zip(("dq", "dk", "dv", "dmask"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[dtype], 3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# torch's own rule for this gradient (test_transformers.py's mem-efficient mask test), on all-positive inputs


def _torchs_tolerance(exact: torch.Tensor, same: torch.Tensor, fudge: float) -> tuple[float, float]:
    """test_transformers.py's ``get_tolerances``: fudge x (the same-precision math's largest error, its rtol)."""
    floor_atol, floor_rtol = {torch.bfloat16: (1e-3, 1.6e-2), torch.float16: (1e-3, 1e-3)}[same.dtype]
    deviation = exact - same.to(exact.dtype)
    relative = torch.nan_to_num(torch.abs(deviation / exact), nan=floor_rtol)
    rtol = fudge * max(relative.max().item(), floor_rtol)
    return fudge * max(deviation.abs().max().item(), floor_atol), rtol if rtol <= 1e30 else floor_rtol


@pytest.mark.parametrize(("batch", "seqlen_q", "seqlen_k"), [(8, 64, 4), (1, 64, 4), (8, 8, 4)], ids=str)
def test_positive_inputs_keep_dq_within_torchs_mem_efficient_rule(batch: int, seqlen_q: int, seqlen_k: int) -> None:
    """torch.rand q, k, v, mask and dO (all positive, bf16, head dim 64): dQ within torch's tolerance.

    With nothing negative, delta = rowsum(dO * out) is large and sums with no
    cancellation, so a bias in out's weights (probabilities summed unrounded,
    multiplied with v rounded) moves every dS of a row alike and dQ with it:
    a forward that sums the unrounded ones puts dQ at 1.3-1.7x torch's
    tolerance in these cases.
    """
    gen = torch.Generator().manual_seed(batch * 10007 + seqlen_q * 101 + seqlen_k)
    q, k, v = (torch.rand(batch, 4, n, 64, generator=gen).to(torch.bfloat16) for n in (seqlen_q, seqlen_k, seqlen_k))
    mask = torch.rand(seqlen_q, seqlen_k, generator=gen).to(torch.bfloat16)
    do = torch.rand(batch, 4, seqlen_q, 64, generator=gen).to(torch.bfloat16)
    _, got = _ours(q, k, v, mask, do)
    _, exact = _torchs(*(t.float() for t in (q, k, v, mask, do)))
    _, same = _torchs(q, k, v, mask, do)
    for name, i, fudge in (("dq", 0, 2.0), ("dk", 1, 12.0), ("dv", 2, 1.0)):  # torch's fudge factors
        atol, rtol = _torchs_tolerance(exact[i], same[i], fudge)
        torch.testing.assert_close(got[i], exact[i].to(torch.bfloat16), atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------
# Dropout, a softcap, the op, torch.compile


def test_dropout_gradient_is_torchs_dropped_and_rescaled_form() -> None:
    """dS = P (dP Z / (1 - p) - rowsum(dO O)): the mask's gradient through the kernels' own dropout mask Z."""
    q, k, v = make_qkv(1, (2, 2), (SQ, SK), D, torch.float32, seed=14)
    mask = _mask((2, SQ, SK), seed=15)
    do = torch.randn(1, 2, SQ, D, generator=torch.Generator().manual_seed(16))
    p = 0.3
    torch.manual_seed(17)
    _, got = _ours(q, k, v, mask, do, dropout_p=p)
    torch.manual_seed(17)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (1, 2, SQ, SK), p)
    leaves = [t.double().requires_grad_() for t in (q, k, v, mask)]
    probs = torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(D) + leaves[3], dim=-1)
    out = (probs * keep / (1 - p)) @ leaves[2]
    exact = torch.autograd.grad(out, leaves, do.double())
    for name, g, e in zip(("dq", "dk", "dv", "dmask"), got, exact, strict=True):
        torch.testing.assert_close(g.double(), e, atol=2e-5, rtol=0, msg=name)


def test_a_softcapped_call_gets_the_gradient_of_the_bias_added_after_the_cap() -> None:
    """``sdpa.masked`` with a softcap (Gemma 2's order): the mask's gradient is dS before the cap's factor."""
    q, k, v = make_qkv(1, (2, 2), (SQ, SK), D, torch.float32, seed=18)
    mask = _mask((SQ, SK), seed=19).requires_grad_()
    do = torch.randn(1, 2, SQ, D, generator=torch.Generator().manual_seed(20))
    out = sdpa.masked(q, k, v, mask, 0.0, False, None, False, softcap=2.0)
    got = torch.autograd.grad(out, mask, do)[0]
    qd, kd, vd, md = (t.detach().double() for t in (q, k, v, mask))
    md.requires_grad_()
    scores = 2.0 * torch.tanh(qd @ kd.transpose(-1, -2) / math.sqrt(D) / 2.0) + md
    exact = torch.autograd.grad(torch.softmax(scores, -1) @ vd, md, do.double())[0]
    torch.testing.assert_close(got.double(), exact, atol=2e-5, rtol=0)


def test_through_the_op_and_under_compile_fullgraph() -> None:
    """The op's autograd (always_through_op) and torch.compile(fullgraph=True) of a module with a mask parameter."""
    q, k, v = make_qkv(B, (H, 2), (SQ, SK), D, torch.float32, seed=21)
    do = torch.randn(B, H, SQ, D, generator=torch.Generator().manual_seed(22))

    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(_mask((H, SQ, SK), seed=23))

        def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return lazytriton.scaled_dot_product_attention(a, b, c, attn_mask=self.bias, enable_gqa=True)

    module = Biased()
    _, exact = _exact(q, k, v, module.bias, do, enable_gqa=True)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for run in (lambda *t: compiled(*t), lambda *t: _through_op(module, *t)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        module.zero_grad()
        run(*leaves).backward(do)
        assert module.bias.grad is not None
        for name, g, e in zip(("dq", "dk", "dv", "dmask"), (*(t.grad for t in leaves), module.bias.grad), exact,
                              strict=True):
            torch.testing.assert_close(g.double(), e, atol=2e-5, rtol=0, msg=name)  # type: ignore[union-attr]


def _through_op(module: torch.nn.Module, *t: torch.Tensor) -> torch.Tensor:
    with always_through_op():
        return module(*t)  # type: ignore[no-any-return]


def test_the_ops_fake_gives_the_real_bias_gradients_layout() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lazytriton import ops

    q, k, v = make_qkv(1, (4, 2), (7, 9), 16, torch.float32, seed=24)
    bias = torch.randn(1, 1, 7, 9).expand(1, 4, 7, 9)
    args = (0.25, "none", -1, -1, 0.0, None, bias, 0.0, None, False, True)
    out, lse = ops.flash_fwd_op(q, k, v, *args[:9])
    real = ops.flash_bwd_op(out, q, k, v, out, lse, *args)
    with FakeTensorMode() as mode:
        fq, fk, fv, fb = (mode.from_tensor(t) for t in (q, k, v, bias))
        fo, flse = ops.flash_fwd_op(fq, fk, fv, *args[:6], fb, *args[7:9])
        fake = ops.flash_bwd_op(fo, fq, fk, fv, fo, flse, *args[:6], fb, *args[7:])
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    assert real[3].shape == (1, 4, 7, 9) and real[3].stride() == (4 * 7 * 16, 7 * 16, 16, 1)
    no_grad = ops.flash_bwd_op(out, q, k, v, out, lse, *args[:-1])
    assert no_grad[3].numel() == 0


# ---------------------------------------------------------------------------
# Variants, the binding's checks, prewarm, cache explain


def test_variant_strings_without_bias_grad_are_unchanged() -> None:
    target = Target.parse("sm_90")
    for kernel in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"):
        for bias in (False, True):
            plain = str(dispatch.kernel_variant(kernel, target, "bf16", 128, False, True, 1024, 1024, bias=bias))
            assert "BIAS_GRAD" not in plain
    with_grad = str(dispatch.kernel_variant("flash_bwd_dq", target, "bf16", 128, False, True, 1024, 1024, bias=True,
                                            bias_grad=True))
    without = str(dispatch.kernel_variant("flash_bwd_dq", target, "bf16", 128, False, True, 1024, 1024, bias=True))
    assert with_grad == without.replace("BIAS=true,", "BIAS=true,BIAS_GRAD=true,")
    for kernel in ("flash_fwd", "flash_bwd_dkdv"):  # the other kernels of the call keep the bias call's variant
        assert dispatch.kernel_variant(kernel, target, "bf16", 128, False, True, 1024, 1024, bias=True,
                                       bias_grad=True) == dispatch.kernel_variant(kernel, target, "bf16", 128, False,
                                                                                  True, 1024, 1024, bias=True)
    assert check_fields(Variant.parse(with_grad)) == Variant.parse(with_grad)


@pytest.mark.parametrize("variant", [
    "flash_bwd_dkdv:sm_90:bf16:ALIGN16=true,BIAS=true,BIAS_GRAD=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
    "INDEX64=false:BLOCK_M=32,BLOCK_N=64:num_stages=3,num_warps=4",
    "flash_bwd_dq:sm_90:bf16:ALIGN16=true,BIAS_GRAD=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
    "INDEX64=false:BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8",
    "flash_bwd_dq:sm_90:bf16:ALIGN16=true,BIAS=true,BIAS_GRAD=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
    "INDEX64=false,VARLEN=true:BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8",
], ids=["dkdv", "no-bias", "varlen"])
def test_a_bias_grad_variant_the_kernels_cannot_run_is_refused(variant: str) -> None:
    with pytest.raises(ValueError, match="BIAS_GRAD=true"):
        check_fields(Variant.parse(variant))


def test_bias_grad_needs_a_dense_call_with_a_bias() -> None:
    target = Target.parse("sm_90")
    for kwargs in ({"bias": False}, {"bias": True, "varlen": True}):
        with pytest.raises(ValueError, match="bias_grad=True"):
            dispatch.kernel_variant("flash_bwd_dq", target, "bf16", 64, False, True, 64, 64, bias_grad=True,
                                    **kwargs)


def test_the_memo_key_tells_a_bias_gradient_apart() -> None:
    shape = binding.Shape(1, 2, 2, 64, 64, 64)
    args = (0, torch.bfloat16, shape, False, True, False, False, False, (False, True, False))
    assert bwd_binding.memo_key(*args, bias_grad=True) == (*bwd_binding.memo_key(*args), "BIAS_GRAD")


def test_the_binding_refuses_a_bias_gradient_it_cannot_write() -> None:
    q, k, v = make_qkv(1, (2, 2), (5, 6), 16, torch.float32)
    plain = binding.check(q, k, v, False)
    out, lse = binding.forward(q, k, v, plain)
    with pytest.raises(ValueError, match="dbias .* was given for a call without a bias"):
        bwd_binding.backward(q, k, v, out, lse, out, plain, dbias=torch.zeros(1, 2, 5, 6))
    call = score_mods.with_mods(plain, q, None, torch.zeros(1, 2, 5, 6), 0.0)
    for bad in (torch.zeros(1, 2, 5, 7), torch.zeros(1, 2, 5, 6, dtype=torch.float16), torch.zeros(1, 2, 5, 6),
                "dbias"):
        with pytest.raises(ValueError, match=r"dbias must be a torch.float32 tensor of shape \(1, 2, 5, 6\)"):
            bwd_binding.backward(q, k, v, out, lse, out, call, dbias=bad)  # type: ignore[arg-type]
    good = bwd_binding.empty_bias_grad(q, call)
    assert good.shape == (1, 2, 5, 6) and good.stride() == (160, 80, 16, 1)
    bwd_binding.backward(q, k, v, out, lse, out, call, dbias=good)


def test_bad_bias_grad_requests_are_refused_before_anything_runs() -> None:
    from lazytriton import ops

    q, k, v = make_qkv(1, (2, 2), (5, 6), 16, torch.float32)
    out, lse = ops.flash_fwd_op(q, k, v, 0.25, "none")
    with pytest.raises(ValueError, match="bias_grad=True needs attn_bias"):
        ops.flash_bwd_op(out, q, k, v, out, lse, 0.25, "none", bias_grad=True)
    with pytest.raises(ValueError, match="bias_grad=True describes the backward"):
        lazytriton.preload((1, 2, 64, 64), (1, 2, 64, 64), device="meta", attn_mask=True, bias_grad=True)
    with pytest.raises(TypeError, match="bias_grad must be a bool"):
        lazytriton.preload((1, 2, 64, 64), (1, 2, 64, 64), device="meta", bias_grad=1)  # type: ignore[arg-type]


def test_prewarm_plans_bias_grad_beside_each_bias_variant_only() -> None:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants, variants_from_misses

    kernels = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")
    axes = {"targets": (Target.parse("sm_90"),), "kernels": kernels, "dtypes": ("bf16",), "head_dims": (64,),
            "bias": (False, True), "varlen": (False, True)}
    without = {str(p.variant) for p in enumerate_variants(Axes(**axes), tuning.tables_for(kernels))}
    planned = {str(p.variant) for p in enumerate_variants(Axes(**axes, bias_grad=(False, True)),
                                                          tuning.tables_for(kernels))}
    added = planned - without
    assert without <= planned and added
    assert all(v.startswith("flash_bwd_dq:") and "BIAS=true,BIAS_GRAD=true" in v and "VARLEN" not in v
               for v in added)
    assert {v.replace("BIAS_GRAD=true,", "") for v in added} <= without
    one = sorted(added)[0]  # a miss log's line names it: prewarm --from-misses plans it again
    again, problems = variants_from_misses([json.dumps({"variant": one})])
    assert [str(p.variant) for p in again] == [one] and not problems


def test_the_prewarm_cli_and_cache_explain_take_bias_grad(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main

    assert main(["prewarm", "--target", "sm_90", "--kernel", "flash_bwd_dq", "--dtype", "bf16", "--head-dim", "64",
                 "--causal", "none", "--seqlen-q", "1024", "--attn-mask", "--bias-grad", "--list"]) == 0
    printed = capsys.readouterr().out
    assert "BIAS=true,BIAS_GRAD=true" in printed
    assert main(["cache", "explain", "--kernel", "flash_bwd", "--dtype", "bf16", "--head-dim", "64",
                 "--seqlen-q", "1024", "--target", "sm_90", "--attn-mask", "--bias-grad"]) == 0
    printed = capsys.readouterr().out
    assert "bias gradient: flash_bwd_dq writes dS" in printed and "never the fused or Gluon" in printed
    assert "flash_bwd_dq:sm_90:bf16:ALIGN16=true,BIAS=true,BIAS_GRAD=true" in printed
    assert "flash_bwd_dkdv:sm_90:bf16:ALIGN16=true,BIAS=true,BLOCK_D" in printed
    assert main(["cache", "explain", "--kernel", "flash_bwd", "--dtype", "bf16", "--head-dim", "64",
                 "--seqlen-q", "1024", "--target", "sm_90", "--bias-grad"]) != 0
    assert "--bias-grad is the gradient of an attn_mask: it needs --attn-mask" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# GPU (the lead runs these on the H200): real sizes, against torch's mem-efficient backend


GPU_MASKS = ((1, 8, 1024, 1024), (2, 1, 1024, 1024), (1024, 1024), (2, 8, 1024, 1024), (2, 1, 1, 1024))


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_MASKS, ids=str)
def test_gpu_mask_gradient_against_the_mem_efficient_backend(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Each gradient within 3x the mem-efficient backend's own error against float64 (+ the dtype's floor)."""
    q, k, v = make_qkv(2, (8, 8), (1024, 1024), 128, dtype, device="cuda", seed=seed_of("gpu", dtype, shape))
    mask = torch.randn(shape, device="cuda", dtype=dtype)
    do = torch.randn(q.shape, device="cuda", dtype=dtype)
    _, got = _ours(q, k, v, mask, do)
    _, peer = _torchs(q, k, v, mask, do, SDPBackend.EFFICIENT_ATTENTION)
    _, exact = _exact(q, k, v, mask, do)
    for name, g, e, s in zip(("dq", "dk", "dv", "dmask"), got, exact, peer, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[dtype], 3)  # type: ignore[arg-type]


@on_gpu
def test_gpu_ragged_gqa_and_float32_mask() -> None:
    """Odd seqlens (no SEQ16), GQA and a float32 mask with bf16 inputs, against torch's math in bf16."""
    q, k, v = make_qkv(2, (8, 2), (500, 777), 64, torch.bfloat16, device="cuda", seed=31)
    mask = torch.randn(8, 500, 777, device="cuda")
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    _, got = _ours(q, k, v, mask, do, enable_gqa=True)
    _, same = _torchs(q, k, v, mask, do, enable_gqa=True)
    _, exact = _exact(q, k, v, mask, do, enable_gqa=True)
    assert got[3].dtype == torch.float32
    for name, g, e, s in zip(("dq", "dk", "dv", "dmask"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[torch.bfloat16], 3)  # type: ignore[arg-type]


@on_gpu
def test_gpu_mask_gradient_is_bitwise_reproducible_and_compiles() -> None:
    """No atomics: two backward runs agree bit for bit; torch.compile (inductor) gives the eager gradient."""
    q, k, v = make_qkv(2, (8, 8), (2048, 2048), 128, torch.bfloat16, device="cuda", seed=32)
    mask = torch.randn(1, 8, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    first, second = _ours(q, k, v, mask, do)[1], _ours(q, k, v, mask, do)[1]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)  # type: ignore[arg-type]

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return lazytriton.scaled_dot_product_attention(a, b, c, attn_mask=m)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    compiled = torch.compile(fn, fullgraph=True)(*leaves)
    got = torch.autograd.grad(compiled, leaves, do)
    for name, g, e in zip(("dq", "dk", "dv", "dmask"), got, first, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=0, msg=name)
