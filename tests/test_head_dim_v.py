"""A value head dim different from the query/key head dim on every entry point.

DeepSeek's MLA attends with q and k of head dim 192 and v of 128; FlashAttention-3
and torch's SDPA take such calls. The kernels read v (and write out, read dout,
write dv) with their own tile (``BLOCK_DV``/``EVEN_DV``, written into a variant
only where they differ from q's and k's) and their own runtime ``head_dim_v``.
Numerics follow FlashAttention's rule against a float64 reference, as
tests/test_flash_fwd.py, tests/test_flash_bwd.py and tests/test_varlen.py do, on
CPU through Triton's interpreter.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, NamedTuple

import pytest
import torch
from flash_rule import check_rule, seed_of
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR

import lazytriton
from lazytriton import geometry
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_fwd import binding as fwd_binding
from lazytriton.kernels.flash_fwd.reference import attention_reference
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields, kernel_constexprs

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
SM90 = Target.parse("sm_90")


class Case(NamedTuple):
    dtype: torch.dtype
    dims: tuple[int, int]  # (q/k head dim, v head dim)
    heads: tuple[int, int]
    seqlens: tuple[int, int]
    causal: bool | str

    def __str__(self) -> str:
        return (f"{str(self.dtype)[6:]}-d{self.dims[0]}-dv{self.dims[1]}-h{self.heads[0]}x{self.heads[1]}"
                f"-s{self.seqlens[0]}x{self.seqlens[1]}-{self.causal}")


# The pairs of the brief, each with another causal mode, GQA/MQA and odd seqlens; the dtypes rotate.
CASES = [
    Case(F16, (192, 128), (4, 2), (33, 47), False),
    Case(BF16, (192, 128), (2, 2), (40, 25), "bottom_right"),
    Case(F16, (128, 64), (4, 1), (17, 29), True),
    Case(F32, (64, 128), (2, 1), (31, 31), False),
    Case(F16, (96, 64), (3, 3), (20, 45), "bottom_right"),
    Case(F16, (40, 72), (4, 2), (37, 19), True),
    Case(BF16, (72, 40), (2, 1), (9, 33), False),
]


def make(case: Case, layout: str = "bhsd") -> tuple[torch.Tensor, ...]:
    """q, k, v and a random dout, (batch 2, heads, seqlen, head dim) or FlashAttention's (batch, seqlen, heads, ...)."""
    gen = torch.Generator().manual_seed(seed_of(str(case), layout))
    (hq, hk), (sq, sk), (d, dv) = case.heads, case.seqlens, case.dims

    def randn(*shape: int) -> torch.Tensor:
        t = torch.randn(shape, generator=gen).to(case.dtype)
        return t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bshd" else t

    return randn(2, hq, sq, d), randn(2, hk, sk, d), randn(2, hk, sk, dv), randn(2, hq, sq, dv)


def check_against_reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor | None, grads: tuple[torch.Tensor, ...]) -> None:
    """out (v's head dim), lse and (dq, dk, dv) under FlashAttention's rule, in the (B, H, S, D) layout."""
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == q.dtype

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        o, s = attention_reference(*leaves, causal=case.causal)
        return o, s, torch.autograd.grad(o, leaves, do.to(inputs[0].dtype))

    exact_out, exact_lse, exact_grads = run(q.double(), k.double(), v.double())
    same_out, same_lse, same_grads = run(q, k, v)
    check_rule("out", out, exact_out, same_out, OUT_FLOOR[case.dtype])
    if lse is not None:
        seen = ~torch.isneginf(exact_lse)
        assert torch.equal(torch.isneginf(lse), ~seen), "lse is -inf exactly where a row sees no key"
        check_rule("lse", lse[seen], exact_lse[seen], same_lse[seen], LSE_FLOOR)
    for name, g, x, s, t in zip(("dq", "dk", "dv"), grads, exact_grads, same_grads, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        check_rule(name, g, x, s, GRAD_FLOOR[case.dtype])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attn_fwd_forward_and_backward_follow_flashattentions_rule(case: Case) -> None:
    q, k, v, do = make(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lazytriton.attn_fwd(*leaves, causal=case.causal)
    grads = torch.autograd.grad(out, leaves, do)
    check_against_reference(case, q, k, v, do, out, lse, grads)


@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=str)
def test_flash_attn_func_takes_a_differing_value_head_dim(case: Case) -> None:
    case = case._replace(causal="bottom_right" if case.causal else False)
    q, k, v, do = make(case, "bshd")
    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]  # (batch, seqlen, heads, dim)
    out, lse, _ = lazytriton.flash_attn_func(*leaves, causal=bool(case.causal), return_attn_probs=True)
    assert out.shape == (2, case.seqlens[0], case.heads[0], case.dims[1])
    grads = torch.autograd.grad(out, leaves, do.transpose(1, 2))
    check_against_reference(case, q, k, v, do, out.transpose(1, 2), lse, tuple(g.transpose(1, 2) for g in grads))


@pytest.mark.parametrize("case", [CASES[0]._replace(causal=True), CASES[3]], ids=str)
def test_sdpa_drop_in_takes_a_differing_value_head_dim_as_torch_does(case: Case) -> None:
    q, k, v, do = make(case)
    gqa = case.heads[0] != case.heads[1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lazytriton.scaled_dot_product_attention(*leaves, is_causal=bool(case.causal), enable_gqa=gqa)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=bool(case.causal), enable_gqa=gqa)
    assert out.shape == want.shape
    grads = torch.autograd.grad(out, leaves, do)
    check_against_reference(case, q, k, v, do, out, None, grads)


def _cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("dims, causal", [((192, 128), True), ((40, 72), False)], ids=str)
def test_varlen_forward_and_backward_equal_the_dense_reference_per_sequence(dims: tuple[int, int],
                                                                            causal: bool) -> None:
    lengths_q, lengths_k = (5, 0, 17, 1), (9, 4, 11, 0)
    gen = torch.Generator().manual_seed(seed_of(dims, causal))
    (d, dv), (hq, hk), dtype = dims, (4, 2), F16
    q = torch.randn(sum(lengths_q), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(lengths_k), hk, d, generator=gen).to(dtype)
    v = torch.randn(sum(lengths_k), hk, dv, generator=gen).to(dtype)
    do = torch.randn(sum(lengths_q), hq, dv, generator=gen).to(dtype)
    cq, ck = _cu(lengths_q), _cu(lengths_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = lazytriton.flash_attn_varlen_func(*leaves, cq, ck, 17, 11, causal=causal, return_attn_probs=True)
    assert out.shape == (sum(lengths_q), hq, dv) and lse.shape == (hq, sum(lengths_q))
    grads = torch.autograd.grad(out, leaves, do)

    def reference(*inputs: torch.Tensor) -> torch.Tensor:
        outs = []
        for i in range(len(lengths_q)):
            a, b, c, e = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
            qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t, (lo, hi) in
                          zip(inputs, ((a, b), (c, e), (c, e)), strict=True))
            outs.append(attention_reference(qs, ks, vs, causal="bottom_right" if causal else False)[0][0]
                        .transpose(0, 1))
        return torch.cat(outs)

    for precision in (torch.float64, dtype):
        ref_leaves = [t.to(precision).requires_grad_() for t in (q, k, v)]
        ref_out = reference(*ref_leaves)
        ref_grads = torch.autograd.grad(ref_out, ref_leaves, do.to(precision))
        if precision == torch.float64:
            exact_out, exact_grads = ref_out.detach(), ref_grads
        else:
            same_out, same_grads = ref_out.detach(), ref_grads
    check_rule("out", out, exact_out, same_out, OUT_FLOOR[dtype])
    for name, g, x, s in zip(("dq", "dk", "dv"), grads, exact_grads, same_grads, strict=True):
        check_rule(name, g, x, s, GRAD_FLOOR[dtype])


def test_the_fakes_give_the_real_shapes_dtypes_and_strides() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lazytriton.ops import flash_bwd_op, flash_fwd_op
    from lazytriton.ops_varlen import flash_varlen_bwd_op, flash_varlen_fwd_op

    q, k, v, do = make(CASES[5])
    real = flash_fwd_op(q, k, v, 0.2, "none")
    real_grads = flash_bwd_op(do, q, k, v, *real, 0.2, "none")[:3]  # dq, dk, dv (no bias gradient)
    tq, tk = q[0].transpose(0, 1), k[0].transpose(0, 1)
    tv, tdo = v[0].transpose(0, 1).contiguous(), do[0].transpose(0, 1).contiguous()
    cq, ck = _cu((30, 7)), _cu((10, 9))
    varlen_args = (tq.contiguous(), tk.contiguous(), tv, cq, ck, 30, 10, 0.2, False)
    real_varlen = flash_varlen_fwd_op(*varlen_args)
    real_varlen_grads = flash_varlen_bwd_op(tdo, *varlen_args[:3], *real_varlen, *varlen_args[3:])
    assert real[0].shape == (2, 4, 37, 72) and real_varlen[0].shape == (37, 4, 72)
    assert [g.shape[-1] for g in (*real_grads, *real_varlen_grads)] == [40, 40, 72] * 2
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def fake(t: Any) -> Any:
            return mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

        f_q, f_k, f_v, f_do = (fake(t) for t in (q, k, v, do))
        fakes = flash_fwd_op(f_q, f_k, f_v, 0.2, "none")
        fake_grads = flash_bwd_op(f_do, f_q, f_k, f_v, *fakes, 0.2, "none")[:3]
        f_args = tuple(fake(a) for a in varlen_args)
        fake_varlen = flash_varlen_fwd_op(*f_args)
        fake_varlen_grads = flash_varlen_bwd_op(fake(tdo), *f_args[:3], *fake_varlen, *f_args[3:])
    for r, f in zip((*real, *real_grads, *real_varlen, *real_varlen_grads),
                    (*fakes, *fake_grads, *fake_varlen, *fake_varlen_grads), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_out_keeps_qs_stride_order_with_vs_head_dim() -> None:
    q = torch.empty(2, 5, 3, 40).transpose(1, 2)  # FlashAttention's layout seen as SDPA's
    out = fwd_binding.empty_like_head_dim(q, 72)
    assert out.shape == (2, 3, 5, 72) and out.transpose(1, 2).is_contiguous()
    assert fwd_binding.empty_like_head_dim(q, 40).stride() == torch.empty_like(q).stride()


# ---------------------------------------------------------------------------
# Bad input: refused before anything runs, naming the argument


def _t(*shape: int, dtype: torch.dtype = F16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("make_args, match", [
    (lambda: (_t(1, 2, 3, 16), _t(1, 2, 4, 16), _t(1, 2, 5, 32)), "same shape but for the head dim"),
    (lambda: (_t(1, 2, 3, 16), _t(1, 2, 4, 16), _t(1, 1, 4, 32)), "same shape but for the head dim"),
    (lambda: (_t(1, 2, 3, 16), _t(1, 2, 4, 16), _t(1, 2, 4, 300)), r"v's head dim \(v.shape\[-1\]\) must be in"),
    (lambda: (_t(1, 2, 3, 16), _t(1, 2, 4, 16), _t(1, 2, 4, 0)), r"v's head dim \(v.shape\[-1\]\) must be in"),
    (lambda: (_t(1, 2, 3, 16), _t(1, 2, 4, 24), _t(1, 2, 4, 32)), "k has head dim 24 but q has head dim 16"),
])
def test_bad_value_shapes_are_refused(no_launch: None, make_args: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lazytriton.attn_fwd(*make_args())


def test_a_gradient_of_qs_head_dim_is_refused_when_v_has_another(no_launch: None) -> None:
    from lazytriton.ops import flash_bwd_op

    q, k, v = _t(1, 2, 3, 16), _t(1, 2, 4, 16), _t(1, 2, 4, 32)
    out, lse = _t(1, 2, 3, 32), torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match=r"do must have the output's shape \(1, 2, 3, 32\), got \(1, 2, 3, 16\)"):
        flash_bwd_op(_t(1, 2, 3, 16), q, k, v, out, lse, 0.25, "none")
    with pytest.raises(ValueError, match=r"out must have the output's shape \(1, 2, 3, 32\)"):
        flash_bwd_op(_t(1, 2, 3, 32), q, k, v, _t(1, 2, 3, 16), lse, 0.25, "none")


def test_varlen_refuses_values_of_another_length(no_launch: None) -> None:
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        lazytriton.flash_attn_varlen_func(_t(3, 2, 16), _t(3, 2, 16), _t(4, 2, 32), cu, cu, 3, 3)


def test_the_kv_cache_call_takes_a_differing_value_head_dim(no_launch: None) -> None:
    # flash_attn_with_kvcache takes head_dim_v too (tests/test_kvcache_head_dim_v.py has its numerics).
    with pytest.raises(ValueError, match=r"v must have shape \(1, 1, 2, 32\)"):
        lazytriton.flash_attn_with_kvcache(_t(1, 1, 2, 16), _t(1, 8, 2, 16), _t(1, 8, 2, 32), k=_t(1, 1, 2, 16),
                                           v=_t(1, 1, 2, 16), cache_seqlens=1)
    split = dispatch.kernel_variant("flash_decode_split", SM90, "fp16", 16, False, True, 1, 8, head_dim_v=32)
    assert (split.get("BLOCK_D"), split.get("BLOCK_DV")) == (16, 32)


# ---------------------------------------------------------------------------
# Variants, keys and dispatch


def test_equal_dims_keep_their_variant_strings_and_differing_ones_say_so() -> None:
    plain = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, False, True, 4096, 4096)
    same = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, False, True, 4096, 4096, head_dim_v=128)
    assert "BLOCK_DV" not in str(plain) and str(same) == str(plain)
    mla = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 192, False, True, 4096, 4096, head_dim_v=128)
    assert "BLOCK_D=256" in str(mla) and "BLOCK_DV=128" in str(mla) and "EVEN_D=false" in str(mla)
    assert "EVEN_DV=true" in str(mla) and Variant.parse(str(mla)) == mla and mla.key() != plain.key()
    # 72 and 80 share a tile and evenness: one binary, the runtime head_dim_v tells them apart.
    assert "BLOCK_DV" not in str(dispatch.kernel_variant("flash_fwd", SM90, "fp16", 72, False, True, 64, 64,
                                                         head_dim_v=80))
    for kernel in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"):
        variant = check_fields(dispatch.kernel_variant(kernel, SM90, "fp16", 64, True, True, 512, 512,
                                                       head_dim_v=128))
        assert kernel_constexprs(variant, ("BLOCK_D", "BLOCK_DV", "EVEN_DV"))["BLOCK_DV"] == 128
    assert kernel_constexprs(plain, ("BLOCK_DV", "EVEN_DV")) == {"BLOCK_DV": 128, "EVEN_DV": True}
    check_fields(plain)  # BLOCK_DV/EVEN_DV absent: BLOCK_D's and EVEN_D's


def test_tiles_are_those_of_the_larger_head_dim() -> None:
    for kernel in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"):
        for d, dv in ((64, 256), (256, 64)):
            got = dispatch.kernel_variant(kernel, SM90, "fp16", d, False, True, 4096, 4096, head_dim_v=dv)
            want = dispatch.kernel_variant(kernel, SM90, "fp16", 256, False, True, 4096, 4096)
            assert got.tuned == want.tuned and got.options == want.options, kernel


def test_memo_keys_and_bindings_variants_carry_the_value_head_dim() -> None:
    shape = fwd_binding.Shape(1, 2, 2, 64, 64, 192)
    plain = fwd_binding.memo_key(0, F16, shape, False, True, False)
    mla = fwd_binding.memo_key(0, F16, shape, False, True, False, head_dim_v=128)
    assert plain != mla and plain == fwd_binding.memo_key(0, F16, shape, False, True, False, False, False)
    assert bwd_binding.memo_key(0, F16, shape, False, True, False, head_dim_v=128, seq16=False)[1:] == mla
    assert bwd_binding.memo_key(0, F16, shape, False, True, False, head_dim_v=128)[1:] == (*mla, "SEQ16")
    assert fwd_binding.variant(SM90, F16, shape, False, True, False, head_dim_v=128).get("BLOCK_DV") == 128
    assert all(v.get("BLOCK_DV") == 128 for v in bwd_binding.variants(SM90, F16, shape, False, True, False,
                                                                      head_dim_v=128))


def test_pack_passes_vs_head_dim_and_the_index64_rule_counts_it() -> None:
    q, k, v, _ = make(CASES[5])
    call = fwd_binding.check(q, k, v)
    assert call.head_dim_v == 72 and call.dv == 72 and fwd_binding.check(q, k, k).head_dim_v == 0
    out, lse = fwd_binding.empty_outputs(q, call.shape, call.head_dim_v)
    ints, _, index64 = fwd_binding.pack(q, k, v, out, lse, call)
    names = fwd_binding.INT_PARAMS
    assert ints[names.index("head_dim")] == 40 and ints[names.index("head_dim_v")] == 72 and not index64
    assert "c->dv" in fwd_binding.c_initializer()


# ---------------------------------------------------------------------------
# Prewarm, cache explain


def test_prewarm_axis_head_dim_v(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton import tuning
    from lazytriton.cli import main as cli_main
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    kernels = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv", "flash_decode_split")
    axes = Axes(targets=(SM90,), kernels=kernels, dtypes=("bf16",), head_dims=(192,), head_dims_v=(128, 192),
                causal=(False,), seqlens_q=(4096,), seqlens_k=(4096,))
    planned = [str(p.variant) for p in enumerate_variants(axes, tuning.tables_for(kernels))]
    with_dv = [v for v in planned if "BLOCK_DV=128" in v]
    # the backward's two alignment forms each (SEQ16 or not: odd lengths are planned too)
    # flash_attn_with_kvcache takes head_dim_v too: the decoding split kernel and kv_append (paged or not).
    assert sorted(v.split(":")[0] for v in with_dv) == sorted(["flash_bwd_dkdv"] * 2 + ["flash_bwd_dq"] * 2
                                                              + ["flash_fwd"] + ["flash_decode_split"] * 2
                                                              + ["kv_append"] * 2)
    decode = [v for v in planned if v.startswith("flash_decode_split")]
    assert len(decode) == 4 and sum("BLOCK_DV" in v for v in decode) == 2  # each pair, paged or not
    common = ["prewarm", "--kernel", "flash_fwd,flash_bwd", "--target", "sm_90", "--dtype", "bf16", "--head-dim",
              "192", "--causal", "none", "--seqlen-q", "4096", "--list"]
    assert cli_main(common) == 0
    plain = capsys.readouterr().out.splitlines()
    assert cli_main([*common, "--head-dim-v", "128"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 5 and all("BLOCK_DV=128" in line for line in listed)  # fwd, 2 x (dq, dkdv)
    # Without a head_dim_v the Hopper kernels that stand in for them are planned too (they take no head_dim_v):
    # flash_fwd_gluon (192 = 128 + 64) and the fused backward's pair (in 256's tile).
    assert len(plain) == 8 and sorted(line.split()[2].split(":")[0] for line in plain if line.split()[1] in (
        "gluon", "fused")) == ["flash_bwd_fused_gluon", "flash_bwd_prep", "flash_fwd_gluon"]
    assert not any("BLOCK_DV" in line for line in plain)
    with pytest.raises(SystemExit):
        cli_main([*common, "--head-dim-v", "600"])
    # v's head dims over 256: the forward and backward plan v's two pieces (256 + 256: lazytriton.value_split)
    assert cli_main([*common, "--head-dim-v", "512"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert len(wide) == 5 and all("BLOCK_DV=256" in line for line in wide)
    explain = ["cache", "explain", "--json", "--kernel", "flash_bwd", "--dtype", "bf16", "--head-dim", "192",
               "--head-dim-v", "128", "--seqlen-q", "4096", "--target", "sm_90"]
    capsys.readouterr()
    assert cli_main(explain) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["call"]["head_dim_v"] == 128
    assert [k["kernel"] for k in report["kernels"]] == ["flash_bwd_dq", "flash_bwd_dkdv"]
    assert all("BLOCK_DV=128" in k["variant"] for k in report["kernels"])
    assert cli_main([*explain[:4], "flash_decode", *explain[5:]]) == 0  # flash_attn_with_kvcache takes it too
    decode = json.loads(capsys.readouterr().out)["kernels"]
    assert "BLOCK_DV=128" in decode[0]["variant"] and "BLOCK_D=128," in decode[1]["variant"]  # combine: v's


@pytest.mark.parametrize("kernel, dims, tma", [("flash_fwd", (192, 128), None), ("flash_fwd", (128, 64), True),
                                               ("flash_bwd_dq", (192, 128), None),
                                               ("flash_bwd_dkdv", (40, 72), None)], ids=str)
def test_variants_with_a_value_head_dim_compile_for_sm_90(kernel: str, dims: tuple[int, int], tma: Any) -> None:
    pytest.importorskip("triton")
    from lazytriton.compiler import compile_variant

    variant = dispatch.kernel_variant(kernel, SM90, "bf16", dims[0], True, True, 4096, 4096, tma=tma,
                                      head_dim_v=dims[1])
    assert variant.get("BLOCK_DV") == geometry.padded_head_dim(dims[1]) and (tma is None or variant.get("TMA"))
    entry = compile_variant(variant)
    assert entry.kind == "cubin" and entry.binary
