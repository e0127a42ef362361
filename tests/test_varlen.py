"""flash_attn_varlen_func (kernels/flash_fwd/varlen.py): FlashAttention-2's varlen matrices, reduced, on CPU.

Numerics follow FlashAttention's rule, as tests/test_flash_fwd.py and
tests/test_flash_bwd.py state it: out, lse, dq, dk and dv against a float64
reference computed sequence by sequence (``attention_reference`` with causal
aligned bottom-right, windows and softcap), each error at most twice the
same-dtype reference's plus the dtype's floor. The cases cover FlashAttention-2's
``test_flash_attn_varlen_output`` and varlen backward axes in a covering
design: random lengths including 0 and 1, odd and unequal query/key lengths,
causal or not, GQA 1/2/MQA, windows, softcap, fp16/bf16/fp32, head dims 32, 64,
128 and 40. Small shapes: each case runs the three kernels through Triton's
interpreter in about a second.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pytest
import torch
from conftest import recording_backend
from flash_rule import check_rule, references, seed_of
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, on_gpu
from varlen_cases import assert_refused, cu, packed_reference

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_fwd import FLASH_FWD, varlen
from lazytriton.kernels.flash_fwd import binding as fwd_binding
from lazytriton.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


class Case(NamedTuple):
    dtype: torch.dtype
    head_dim: int
    heads: tuple[int, int]
    causal: bool
    window: tuple[int, int]
    softcap: float
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{dtype}-d{self.head_dim}-h{self.heads[0]}x{self.heads[1]}-{'causal' if self.causal else 'full'}"
                f"-w{self.window[0]}_{self.window[1]}-cap{self.softcap}-q{'_'.join(map(str, self.lengths_q))}"
                f"-k{'_'.join(map(str, self.lengths_k))}")


F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
NO_WINDOW = (-1, -1)
# Lengths: empty sequences on either side, single tokens, odd lengths, more
# queries than keys (rows that see no key under causal) and more keys than
# queries, and lengths past the interpreter's tiles (32 query rows, 16 keys).
CASES = [
    Case(F16, 32, (4, 4), False, NO_WINDOW, 0.0, (5, 0, 17, 1, 33), (7, 3, 17, 0, 20)),
    Case(BF16, 64, (4, 2), True, NO_WINDOW, 0.0, (1, 40, 9), (1, 13, 30)),
    Case(F32, 128, (2, 1), True, NO_WINDOW, 0.0, (16, 3, 0), (9, 35, 2)),
    Case(F16, 40, (2, 1), False, NO_WINDOW, 0.0, (11, 23), (23, 11)),
    Case(F32, 32, (4, 2), False, (3, 2), 0.0, (19, 0, 6), (25, 4, 6)),
    Case(BF16, 32, (2, 2), True, (5, -1), 0.0, (34, 2), (17, 9)),
    Case(F16, 64, (4, 1), False, (-1, 4), 2.0, (8, 21), (30, 5)),
    Case(F32, 40, (2, 2), False, NO_WINDOW, 1.5, (13, 1, 0, 7), (13, 0, 5, 19)),
    Case(BF16, 128, (2, 1), True, (0, 0), 3.0, (9, 18), (12, 18)),
    Case(F16, 32, (2, 1), True, (7, 3), 0.5, (0, 0, 26), (0, 4, 31)),
]


def make_inputs(case: Case, device: str = "cpu") -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(seed_of(tuple(case)))
    (hq, hk), d = case.heads, case.head_dim
    tq, tk = sum(case.lengths_q), sum(case.lengths_k)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(case.dtype)

    return {"q": randn(tq, hq, d), "k": randn(tk, hk, d), "v": randn(tk, hk, d), "do": randn(tq, hq, d),
            "cu_seqlens_q": cu(case.lengths_q).to(device), "cu_seqlens_k": cu(case.lengths_k).to(device),
            "max_seqlen_q": max(max(case.lengths_q), 1), "max_seqlen_k": max(max(case.lengths_k), 1)}


def reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) sequence by sequence with the dense reference, packed as the varlen call packs them."""
    return packed_reference(q, k, v, case.lengths_q, case.lengths_k, causal=case.causal, window=case.window,
                            softcap=case.softcap)


def lt_call(case: Case, inputs: dict[str, Any], q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _ = lazytriton.flash_attn_varlen_func(
        q, k, v, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], inputs["max_seqlen_q"], inputs["max_seqlen_k"],
        causal=case.causal, window_size=case.window, softcap=case.softcap, return_attn_probs=True)
    return out, lse


@pytest.mark.parametrize("case", CASES, ids=str)
def test_output_lse_and_gradients_follow_flashattentions_rule(case: Case) -> None:
    inputs = make_inputs(case)
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lt_call(case, inputs, *leaves)
    grads = torch.autograd.grad(out, leaves, do)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32

    exact, same = references(lambda *t: reference(case, *t), (q, k, v), do)

    no_key = torch.isneginf(exact.lse)
    assert torch.equal(torch.isneginf(lse), no_key), "lse is -inf exactly where a row sees no key"
    assert (out.transpose(0, 1)[no_key] == 0).all() and (grads[0].transpose(0, 1)[no_key] == 0).all()
    check_rule("out", out, exact.out, same.out, OUT_FLOOR[case.dtype])
    check_rule("lse", lse[~no_key], exact.lse[~no_key], same.lse[~no_key], LSE_FLOOR)
    for name, g, x, s in zip(("dq", "dk", "dv"), grads, exact.grads, same.grads, strict=True):
        assert g.shape == x.shape and g.dtype == case.dtype, name
        check_rule(name, g, x, s, GRAD_FLOOR[case.dtype])


@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=str)
def test_each_sequence_equals_the_dense_kernel_on_it(case: Case) -> None:
    """The varlen kernels on a packed batch give, bit for bit, the dense kernels' answer on each sequence."""
    inputs = make_inputs(case)
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lt_call(case, inputs, *leaves)
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    cq, ck = cu(case.lengths_q).tolist(), cu(case.lengths_k).tolist()
    for i, (lq, lk) in enumerate(zip(case.lengths_q, case.lengths_k, strict=True)):
        if lq == 0 or lk == 0:
            continue
        part = [t[a:a + n].clone().requires_grad_() for t, a, n in ((q, cq[i], lq), (k, ck[i], lk), (v, ck[i], lk))]
        dense_out, dense_lse = lazytriton.attn_fwd(*(t.transpose(0, 1)[None] for t in part),
                                                   causal="bottom_right" if case.causal else False,
                                                   window_size=case.window, softcap=case.softcap)
        dense_grads = torch.autograd.grad(dense_out, part, do[cq[i]:cq[i] + lq].transpose(0, 1)[None])
        assert torch.equal(out[cq[i]:cq[i] + lq], dense_out[0].transpose(0, 1))
        assert torch.equal(lse[:, cq[i]:cq[i] + lq], dense_lse[0])
        for got, want in zip((dq[cq[i]:cq[i] + lq], dk[ck[i]:ck[i] + lk], dv[ck[i]:ck[i] + lk]), dense_grads,
                             strict=True):
            assert torch.equal(got, want)


def test_torch_compile_traces_forward_and_backward_in_one_graph() -> None:
    torch._dynamo.reset()
    case = Case(F32, 16, (4, 2), True, NO_WINDOW, 0.0, (6, 0, 11), (9, 2, 11))
    inputs = make_inputs(case)
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    graphs: list[str] = []
    backend = recording_backend(graphs)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = lazytriton.flash_attn_varlen_func(q * 2, k, v, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
                                                inputs["max_seqlen_q"], inputs["max_seqlen_k"], causal=True)
        return out * 3  # type: ignore[no-any-return]

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(compiled(*leaves), leaves, do)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(fn(*eager), eager, do)
    assert len(graphs) == 2, "one forward graph and one backward graph"
    assert "lazytriton.flash_varlen_fwd" in graphs[0] and "lazytriton.flash_varlen_bwd" in graphs[1]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_fakes_give_the_real_shapes_dtypes_and_strides() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lazytriton.ops_varlen import flash_varlen_bwd_op, flash_varlen_fwd_op

    case = Case(F16, 32, (4, 2), False, NO_WINDOW, 0.0, (3, 5), (4, 6))
    inputs = make_inputs(case)
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], 5, 6, 0.25, False)
    real = flash_varlen_fwd_op(*args)
    real_grads = flash_varlen_bwd_op(inputs["do"], *args[:3], *real, *args[3:])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = flash_varlen_fwd_op(*fake_args)
        fake_grads = flash_varlen_bwd_op(mode.from_tensor(inputs["do"]), *fake_args[:3], *fake, *fake_args[3:])
    for r, f in zip((*real, *real_grads), (*fake, *fake_grads), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


# ---------------------------------------------------------------------------
# Bad input: refused before anything runs, each argument named


def _good() -> dict[str, Any]:
    case = Case(F16, 32, (4, 2), False, NO_WINDOW, 0.0, (3, 0, 5), (4, 6, 0))
    inputs = make_inputs(case)
    inputs.pop("do")
    return inputs


BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long(), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    ("cu_seqlens_k", lambda a: [0, 4, 10, 10], TypeError, "cu_seqlens_k must be a torch.Tensor"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][None], ValueError, "cu_seqlens_q must be 1-D"),
    ("cu_seqlens_k", lambda a: torch.zeros(8, dtype=torch.int32)[::2], ValueError,  # a view's values, copied
     r"cu_seqlens_k\[-1\] must be the total number of tokens \(10\), got 0"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].to("meta"), ValueError, "cu_seqlens_q is on meta"),
    ("cu_seqlens_k", lambda a: a["cu_seqlens_k"][:3], ValueError, "both have batch \\+ 1 entries, got 4 and 3"),
    ("cu_seqlens_q", lambda a: torch.tensor([1, 3, 3, 8], dtype=torch.int32), ValueError,
     r"cu_seqlens_q\[0\] must be 0"),
    ("cu_seqlens_k", lambda a: torch.tensor([0, 6, 4, 10], dtype=torch.int32), ValueError,
     "cu_seqlens_k must be nondecreasing"),
    ("cu_seqlens_q", lambda a: torch.tensor([0, 3, 3, 7], dtype=torch.int32), ValueError,
     r"cu_seqlens_q\[-1\] must be the total number of tokens \(8\)"),
    ("max_seqlen_q", lambda a: 4, ValueError, r"max_seqlen_q \(4\) must be at least the longest sequence"),
    ("max_seqlen_k", lambda a: 0, ValueError, r"max_seqlen_k \(0\) must be at least the longest sequence"),
    ("max_seqlen_k", lambda a: -1, ValueError, "max_seqlen_k must be in 0.."),
    ("max_seqlen_q", lambda a: 5.0, TypeError, "max_seqlen_q must be an int"),
    ("max_seqlen_k", lambda a: True, TypeError, "max_seqlen_k must be an int"),
    ("q", lambda a: a["q"][None], ValueError, "q must have 3 dims"),
    ("v", lambda a: a["v"].tolist(), TypeError, "v must be a torch.Tensor"),
    ("k", lambda a: a["k"][:, :1].expand(-1, 3, -1), ValueError, r"same shape \(total_k, heads_k, head_dim\)"),
    ("v", lambda a: a["v"].float(), TypeError, "v has dtype torch.float32"),
    ("q", lambda a: a["q"].int(), TypeError, "q must be float16, bfloat16 or float32"),
]
BAD_OPTIONS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"causal": "bottom_right"}, TypeError, "causal must be a bool"),
    ({"window_size": (-2, 0)}, ValueError, "window_size sizes must be -1"),
    ({"window_size": 3}, TypeError, "window_size must be a pair"),
    ({"softcap": -1.0}, ValueError, "softcap must be a finite float >= 0"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite"),
    ({"dropout_p": 1.5}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"dropout_p": -0.1}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"dropout_p": "0.1"}, TypeError, "dropout_p must be a float"),
    ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, TypeError, "alibi_slopes must be float32"),
    ({"alibi_slopes": torch.ones(2, 4)}, ValueError, r"alibi_slopes must have shape \(4,\) or \(3, 4\)"),
    ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must have shape \(4,\) or \(3, 4\)"),
    ({"alibi_slopes": [1.0] * 4}, TypeError, "alibi_slopes must be a torch.Tensor or None"),
    ({"alibi_slopes": torch.ones(4, device="meta")}, ValueError, "alibi_slopes is on meta"),
    ({"deterministic": 1}, TypeError, "deterministic must be a bool"),
    ({"return_attn_probs": None}, TypeError, "return_attn_probs must be a bool"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_are_refused_before_anything_runs(no_launch: None, name: str, change: Any,
                                                        error: type[Exception], match: str) -> None:
    assert_refused(_good(), name, change, error, match)


def test_heads_and_head_dims_that_do_not_fit_are_refused(no_launch: None) -> None:
    args = _good()
    args["k"], args["v"] = (args[n][:, :1].expand(-1, 3, -1) for n in ("k", "v"))
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k/v heads \(3\)"):
        lazytriton.flash_attn_varlen_func(**args)
    args = _good()
    args["k"], args["v"] = (args[n][..., :16] for n in ("k", "v"))
    with pytest.raises(ValueError, match="k has head dim 16 but q has head dim 32"):
        lazytriton.flash_attn_varlen_func(**args)


@pytest.mark.parametrize(("options", "error", "match"), BAD_OPTIONS, ids=[str(i) for i in range(len(BAD_OPTIONS))])
def test_bad_options_are_refused_before_anything_runs(no_launch: None, options: dict[str, Any],
                                                      error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_varlen_func(**_good(), **options)


def test_the_ops_check_the_values_too(no_launch: None) -> None:
    from lazytriton.ops_varlen import flash_varlen_fwd_op

    a = _good()
    with pytest.raises(ValueError, match="must be nondecreasing"):
        flash_varlen_fwd_op(a["q"], a["k"], a["v"], torch.tensor([0, 5, 3, 8], dtype=torch.int32),
                            a["cu_seqlens_k"], 5, 6, 0.5, False)


def test_values_are_not_read_while_tracing_and_only_shapes_are_checked() -> None:
    a = _good()
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)
    meta = bad.to("meta")
    assert not varlen.reading_values_is_safe(meta, meta)
    assert varlen.reading_values_is_safe(a["cu_seqlens_q"], a["cu_seqlens_k"])
    # values=False (what a capture or a trace gets): the shapes pass, the values are the caller's
    call = varlen.check(a["q"], a["k"], a["v"], bad, a["cu_seqlens_k"], 5, 6, values=False)
    assert (call.batch, call.max_seqlen_q, call.max_seqlen_k) == (3, 5, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        varlen.check(a["q"], a["k"], a["v"], bad[None], a["cu_seqlens_k"], 5, 6, values=False)


def test_empty_batches_and_tokens() -> None:
    q = torch.randn(0, 2, 16)
    none = torch.zeros(1, dtype=torch.int32)
    out, lse, _ = lazytriton.flash_attn_varlen_func(q, q, q, none, none, 1, 1, return_attn_probs=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    k = torch.randn(0, 2, 16)
    q = torch.randn(3, 2, 16, requires_grad=True)
    cq, ck = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    out, lse, _ = lazytriton.flash_attn_varlen_func(q, k, k, cq, ck, 3, 1, return_attn_probs=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (dq == 0).all()


def test_a_max_seqlen_of_0_means_every_sequence_is_empty() -> None:
    """FlashAttention allows max_seqlen 0: no query (nothing to compute), or no key (every query gets 0, lse -inf)."""
    q = torch.randn(0, 2, 16)
    empty = torch.zeros(3, dtype=torch.int32)  # two sequences, both empty
    out, lse, _ = lazytriton.flash_attn_varlen_func(q, q, q, empty, empty, 0, 0, return_attn_probs=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    q = torch.randn(5, 4, 16, requires_grad=True)
    k = torch.randn(0, 2, 16, requires_grad=True)
    v = torch.randn(0, 2, 8, requires_grad=True)
    cq = torch.tensor([0, 2, 5], dtype=torch.int32)
    for causal in (False, True):
        out, lse, _ = lazytriton.flash_attn_varlen_func(q, k, v, cq, empty, 3, 0, causal=causal,
                                                        return_attn_probs=True)
        assert out.shape == (5, 4, 8) and (out == 0).all() and torch.isneginf(lse).all()
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape
    with pytest.raises(ValueError, match=r"max_seqlen_q \(0\) must be at least the longest sequence"):
        lazytriton.flash_attn_varlen_func(q, k, v, cq, empty, 0, 0)


# ---------------------------------------------------------------------------
# Packing, variants, memo keys


def test_pack_covers_every_new_parameter() -> None:
    a = _good()
    call = varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6, causal=True)
    out, lse = varlen.empty_outputs(a["q"])
    cq, ck = a["cu_seqlens_q"], a["cu_seqlens_k"]
    views = [varlen.kernel_view(t) for t in (a["q"], a["k"], a["v"], out)]
    ints, _, index64 = fwd_binding.pack(*views, lse.unsqueeze(0), call.call, cq.data_ptr(), ck.data_ptr())
    named = dict(zip(fwd_binding.INT_PARAMS, ints, strict=True))
    assert (named["Cu_seqlens_q"], named["Cu_seqlens_k"]) == (cq.data_ptr(), ck.data_ptr())
    # the packed rows: the sequence stride is the token stride, lse is (heads_q, total_q)
    assert named["stride_qs"] == a["q"].stride(0) and named["stride_qh"] == a["q"].stride(1)
    assert named["stride_lh"] == 8 and named["seqlen_q"] == 8 and named["seqlen_k"] == 10 and not index64
    dense = fwd_binding.pack(*views, lse.unsqueeze(0), call.call)[0]
    assert dict(zip(fwd_binding.INT_PARAMS, dense, strict=True))["Cu_seqlens_q"] == 0
    grads = bwd_binding.empty_grads(a["q"], a["k"], a["v"])
    bviews = (*views[:3], views[3], views[3], lse.unsqueeze(0), lse.unsqueeze(0), *map(varlen.kernel_view, grads))
    dq_ints, dkdv_ints, *_ = bwd_binding.pack(*bviews, call.call, cq.data_ptr(), ck.data_ptr())
    for spec, values in ((FLASH_BWD_DQ, dq_ints), (FLASH_BWD_DKDV, dkdv_ints)):
        named = dict(zip(bwd_binding.DQ_INT_PARAMS if spec is FLASH_BWD_DQ else bwd_binding.DKDV_INT_PARAMS, values,
                         strict=True))
        assert (named["Cu_seqlens_q"], named["Cu_seqlens_k"]) == (cq.data_ptr(), ck.data_ptr())
    for spec in (FLASH_FWD, FLASH_BWD_DQ, FLASH_BWD_DKDV):
        names = [name for name, _ in spec.params]
        own = names.index("Alibi") - 2  # the kernel's own pointers, then the cu_seqlens, then the score mods'
        assert all(kind.startswith("*") for _, kind in spec.params[:own]) and not names[own - 1].startswith("Cu")
        assert names[own:own + 2] == ["Cu_seqlens_q", "Cu_seqlens_k"]
        assert "VARLEN" in spec.constexprs


def test_variants_say_varlen_only_when_set_and_dense_strings_are_unchanged() -> None:
    target = Target.parse("sm_90")
    dense = dispatch.kernel_variant("flash_fwd", target, "bf16", 128, True, True, 4096, 4096)
    packed = dispatch.kernel_variant("flash_fwd", target, "bf16", 128, True, True, 4096, 4096, varlen=True)
    assert "VARLEN" not in str(dense) and "VARLEN=true" in str(packed)
    assert str(packed).replace(",VARLEN=true", "") == str(dense) and dense.key() != packed.key()
    a = _good()
    call = varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6)
    chosen = varlen.variants(varlen.BACKWARD, target, torch.float16, call, True, False)
    assert all(v.get("VARLEN") is True for v in chosen)
    # dispatch sees the max_seqlen buckets: the tiles are those of a dense call of that shape
    by_max = dispatch.kernel_variant("flash_bwd_dq", target, "fp16", 32, False, True, 5, 6, varlen=True)
    assert chosen[0] == by_max


def test_memo_keys_are_marked_and_never_a_dense_calls() -> None:
    a = _good()
    call = varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6)
    key = varlen.memo_key(0, torch.float16, call, True, False)
    assert key[0] == "varlen" and key[1:] == fwd_binding.memo_key(0, torch.float16, call.kernel_shape, False, True,
                                                                  False)
    assert varlen.bwd_memo_key(0, torch.float16, call, True, False)[:2] == ("varlen", "flash_bwd")


def test_flash_attn_varlen_func_is_exported_lazily() -> None:
    import subprocess
    import sys

    code = ("import sys, lazytriton; assert 'torch' not in sys.modules; f = lazytriton.flash_attn_varlen_func; "
            "assert 'triton' not in sys.modules; print(f.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "flash_attn_varlen_func", done.stderr


# ---------------------------------------------------------------------------
# On the GPU (the lead runs these on the H200)


@on_gpu
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize(("causal", "window", "softcap"), [(False, NO_WINDOW, 0.0), (True, NO_WINDOW, 0.0),
                                                           (True, (256, 0), 0.0), (False, NO_WINDOW, 30.0)])
def test_gpu_mixed_lengths(dtype: torch.dtype, head_dim: int, causal: bool, window: tuple[int, int],
                           softcap: float) -> None:
    gen = torch.Generator().manual_seed(seed_of(dtype, head_dim, causal, window, softcap))
    lengths_q = tuple(int(n) for n in torch.randint(0, 1500, (7,), generator=gen)) + (1, 0, 2048)
    lengths_k = tuple(max(0, n + int(d)) for n, d in zip(lengths_q, torch.randint(-64, 200, (10,), generator=gen),
                                                          strict=True))
    case = Case(dtype, head_dim, (16, 4), causal, window, softcap, lengths_q, lengths_k)
    inputs = make_inputs(case, "cuda")
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lt_call(case, inputs, *leaves)
    grads = torch.autograd.grad(out, leaves, do)
    cq, ck = cu(lengths_q).tolist(), cu(lengths_k).tolist()
    for i in (0, 8, 9):  # a few sequences against the float64 reference (all of it: ~1 GiB of scores)
        one = Case(dtype, head_dim, (16, 4), causal, window, softcap, (lengths_q[i],), (lengths_k[i],))
        parts = [t[a:b] for t, (a, b) in ((q, cq[i:i + 2]), (k, ck[i:i + 2]), (v, ck[i:i + 2]))]
        exact, same = references(lambda *t, one=one: reference(one, *t), parts, do[cq[i]:cq[i + 1]])
        check_rule("out", out[cq[i]:cq[i + 1]], exact.out, same.out, OUT_FLOOR[dtype])
        got = (grads[0][cq[i]:cq[i + 1]], grads[1][ck[i]:ck[i + 1]], grads[2][ck[i]:ck[i + 1]])
        for name, g, x, s in zip(("dq", "dk", "dv"), got, exact.grads, same.grads, strict=True):
            check_rule(name, g, x, s, GRAD_FLOOR[dtype])
    assert math.isfinite(float(lse[~torch.isneginf(lse)].sum()))


def test_trusted_indices_skip_the_cu_seqlens_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside trusted_indices() (this thread only) a varlen call does not read cu_seqlens to the host."""
    import threading

    from lazytriton.kernels.flash_fwd import varlen as varlen_binding

    reads: list[int] = []
    real = varlen_binding.check_values
    monkeypatch.setattr(varlen_binding, "check_values", lambda *a: reads.append(1) or real(*a))
    q = torch.randn(5, 2, 16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    lazytriton.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3)
    assert len(reads) == 1
    with lazytriton.trusted_indices():
        lazytriton.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3)
        assert len(reads) == 1
        other = threading.Thread(target=lambda: lazytriton.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3))
        other.start()
        other.join()
        assert len(reads) == 2, "another thread's call is not covered by this thread's trust"
    bad = torch.tensor([0, 4, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        lazytriton.flash_attn_varlen_func(q, q, q, bad, bad, 3, 3)
