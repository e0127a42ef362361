"""ALiBi, dropout and SDPA's attn_mask, forward and backward (issue 11, part 3).

Numerics follow FlashAttention's rule, as tests/test_window_softcap.py does:
each of out, lse, dq, dk, dv may be at most twice as far from a float64
reference as the same-dtype PyTorch reference is, plus a small floor. ALiBi
follows FlashAttention-2's ``attn_bias_from_alibi_slopes``; dropout is checked
against the reference with the kernels' own keep mask (``dropout_keep``, a
torch re-implementation of curand's Philox stream, checked bit for bit
against the kernels' masks here and against Random123's known answers and
PyTorch's memory-efficient mask in ``test_dropout_stream.py``); the SDPA drop-in's masks against torch's own math
backend in float64. On CPU the kernels run through Triton's interpreter; GPU
tests (marked ``gpu``) repeat the checks at larger shapes and under CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from flash_rule import check_rule
from test_flash_bwd import GRAD_FLOOR, grads_of
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, make_qkv, on_gpu, seed_of, twin_line
from torch.nn.attention import SDPBackend, sdpa_kernel

import lazytriton
from lazytriton.interface import always_through_op
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_bwd.reference import attention_backward_reference
from lazytriton.kernels.flash_fwd import binding, hot, score_mods
from lazytriton.kernels.flash_fwd.reference import alibi_bias, attention_reference, dropout_keep
from lazytriton.sdpa import SDPAError, SDPATypeError
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# FlashAttention-2's test_flash_attn_output seqlen pairs, reduced: unequal, odd, fewer and more keys.
SEQLENS = ((13, 21), (21, 13), (1, 17), (16, 16), (17, 1), (9, 33))
HEADS = ((2, 2), (4, 2), (2, 1))


def _bshd(*t: torch.Tensor) -> list[torch.Tensor]:
    return [x.transpose(1, 2) for x in t]


@dataclass(frozen=True)
class Case:
    """One case of FlashAttention-2's test_flash_attn_output matrix (alibi x causal x dropout x ...), reduced."""

    dtype: torch.dtype
    alibi: str  # "none", "heads" ((heads,) slopes) or "batch" ((batch, heads))
    causal: bool
    dropout_p: float
    seqlens: tuple[int, int]
    heads: tuple[int, int]
    extra: str  # "none", "window" (3, 5) or "softcap" 2.0: ALiBi/dropout meet the earlier features

    def __str__(self) -> str:
        return (f"{binding.DTYPES[self.dtype]}-alibi_{self.alibi}-causal_{self.causal}-p{self.dropout_p}"
                f"-s{self.seqlens[0]}x{self.seqlens[1]}-h{self.heads[0]}x{self.heads[1]}-{self.extra}")


def covering_design() -> list[Case]:
    """12 cases: every (alibi, causal, dropout) triple with alibi on or dropout on, the rest rotated around them."""
    triples = [(a, c, p) for a in ("none", "heads", "batch") for c in (False, True) for p in (0.0, 0.17)
               if a != "none" or p > 0]
    extras = ("none", "window", "softcap")
    return [Case(DTYPES[i % 3], a, c, p, SEQLENS[i % len(SEQLENS)], HEADS[i % len(HEADS)], extras[(i // 2) % 3])
            for i, (a, c, p) in enumerate(triples)]


def test_covering_design_covers_the_triples() -> None:
    cases = covering_design()
    assert {(c.alibi, c.causal, c.dropout_p > 0) for c in cases} == {
        (a, c, p) for a in ("none", "heads", "batch") for c in (False, True) for p in (False, True)
        if a != "none" or p}
    assert {c.dtype for c in cases} == set(DTYPES) and {c.extra for c in cases} == {"none", "window", "softcap"}


def _slopes(case: Case, batch: int) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(seed_of(case, "slopes"))
    hq = case.heads[0]
    if case.alibi == "none":
        return None
    return torch.rand((hq,) if case.alibi == "heads" else (batch, hq), generator=gen) * 0.6


@pytest.mark.parametrize("case", covering_design(), ids=str)
def test_forward_and_backward_follow_flash_attentions_rule(case: Case) -> None:
    batch = 2 if case.alibi == "batch" else 1
    q, k, v = make_qkv(batch, case.heads, case.seqlens, 16, case.dtype, seed=seed_of(case))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed_of(case, "do"))).to(case.dtype)
    slopes = _slopes(case, batch)
    features: dict[str, Any] = {"window_size": (3, 5)} if case.extra == "window" else (
        {"softcap": 2.0} if case.extra == "softcap" else {})
    seed = seed_of(case, "philox")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out, lse, s_dmask = lazytriton.flash_attn_func(*_bshd(*leaves), dropout_p=case.dropout_p, alibi_slopes=slopes,
                                                   causal=case.causal, return_attn_probs=True, **features)
    out = out.transpose(1, 2)
    got = torch.autograd.grad(out, leaves, do)
    assert s_dmask is None
    keep = None
    if case.dropout_p > 0:  # the mask the call drew: the same seed gives the same Philox pair
        torch.manual_seed(seed)
        keep = dropout_keep(score_mods.draw_philox(q.device, 0), (batch, case.heads[0], *case.seqlens), case.dropout_p)
    kwargs: dict[str, Any] = {"causal": "bottom_right" if case.causal else False, "alibi_slopes": slopes,
                              "dropout_p": case.dropout_p, "keep": keep, **features}

    def ref(*t: torch.Tensor) -> torch.Tensor:
        return attention_reference(*t, **kwargs)[0]

    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), **kwargs)
    same_out, same_lse = attention_reference(q, k, v, **kwargs)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in got)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    check_rule("out", out, ref_out, same_out, OUT_FLOOR[case.dtype])
    seen = ~torch.isneginf(ref_lse)
    check_rule("lse", lse[seen], ref_lse[seen], same_lse[seen], LSE_FLOOR)
    exact = grads_of(ref, q.double(), k.double(), v.double(), do.double())
    same = grads_of(ref, q, k, v, do)
    for name, g, e, s in zip(("dq", "dk", "dv"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[case.dtype])


def test_alibi_is_flash_attentions_bias() -> None:
    """FlashAttention-2's attn_bias_from_alibi_slopes: -slope |i + sk - sq - j|; causal, up to a row constant."""
    slopes = torch.tensor([[0.5, 0.25]], dtype=torch.float64)
    bias = alibi_bias(slopes, 3, 5)
    assert bias.shape == (1, 2, 3, 5)
    assert bias[0, 0, 0].tolist() == [-1.0, -0.5, 0.0, -0.5, -1.0]  # query 0 sits at key 2 (bottom-right)
    causal_fa2 = torch.arange(-5 + 1, 1, dtype=torch.float64) * slopes[:, :, None, None]  # FA2's causal form
    visible = torch.ones(3, 5, dtype=torch.bool).tril(2)  # bottom-right causal
    diff = bias - causal_fa2
    spread = diff.masked_fill(~visible, float("-inf")).amax(-1) - diff.masked_fill(~visible, float("inf")).amin(-1)
    assert (spread == 0).all()  # one constant per row over the visible keys: the same softmax


@pytest.mark.parametrize(("alibi", "dropout_p", "causal"), [(True, 0.0, True), (False, 0.3, False),
                                                            (True, 0.2, False)])
def test_backward_reference_twin_is_the_gradient_of_the_forward_reference(alibi: bool, dropout_p: float,
                                                                         causal: bool) -> None:
    q, k, v = make_qkv(2, (4, 2), (9, 13), 8, torch.float64, seed=seed_of(alibi, dropout_p))
    do = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    kwargs: dict[str, Any] = {
        "causal": "bottom_right" if causal else False,
        "alibi_slopes": torch.rand(2, 4, generator=gen, dtype=torch.float64) if alibi else None,
        "bias": torch.randn(2, 1, 9, 13, generator=gen, dtype=torch.float64),
        "dropout_p": dropout_p, "keep": torch.rand(2, 4, 9, 13, generator=gen) >= dropout_p if dropout_p else None}
    auto = grads_of(lambda *t: attention_reference(*t, **kwargs)[0], q, k, v, do)
    twin = attention_backward_reference(q, k, v, do, **kwargs)
    for name, a, t in zip(("dq", "dk", "dv"), auto, twin, strict=True):
        torch.testing.assert_close(t, a, rtol=1e-10, atol=1e-10, msg=name)


def test_gradcheck_float32_with_alibi() -> None:
    q, k, v = make_qkv(1, (2, 1), (5, 7), 16, torch.float32, seed=seed_of("gradcheck-alibi"))
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    slopes = torch.tensor([0.3, 0.9])

    def fn(*t: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(*_bshd(*t), alibi_slopes=slopes, causal=True)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-2, atol=5e-3, rtol=5e-3, fast_mode=True)


# ---------------------------------------------------------------------------
# Dropout: the mask, its statistics, reproducibility


def test_the_kernels_masks_forward_and_backward_are_dropout_keep_bit_for_bit() -> None:
    """Read the kernels' masks off their results: with q = 0 every probability is 1 / seqlen_k, and with v (and dO)
    the identity, out[i, j] = Z_ij / (seqlen_k (1 - p)) and dV[j, i] = Z_ij / (seqlen_k (1 - p)).

    So the forward's mask and the backward's regenerated one are both compared,
    element for element, with ``dropout_keep`` (the torch Philox the other tests use).
    """
    b, h, sq, sk, d, p = 2, 1, 20, 30, 32, 0.3
    q = torch.zeros(b, h, sq, d, requires_grad=True)
    k = torch.randn(b, h, sk, d, generator=torch.Generator().manual_seed(1)).requires_grad_()
    v = torch.eye(sk, d).expand(b, h, sk, d).clone().requires_grad_()
    torch.manual_seed(77)
    out, _ = lazytriton.attn_fwd(q, k, v, dropout_p=p)
    (dv,) = torch.autograd.grad(out, (v,), torch.eye(sq, d).expand(b, h, sq, d))
    torch.manual_seed(77)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (b, h, sq, sk), p)
    assert 0.5 < keep.float().mean() < 0.9
    assert torch.equal(out[..., :sk] * (sk * (1 - p)) > 0.5, keep)
    assert torch.equal(dv[..., :sq].transpose(-1, -2) * (sk * (1 - p)) > 0.5, keep)


def test_dropout_keeps_each_element_with_probability_one_minus_p_and_preserves_the_expected_value() -> None:
    """One call with the same (q, k, v) repeated over a batch of 96: 96 independent masks.

    Deterministic (seeded), so it cannot flake; the bounds are 6 sigma, so a
    wrong rescaling or keep rule fails: the kept fraction's sigma is
    sqrt(p (1 - p) / n) over n = 96 x 8 x 16 elements, and each output
    element's mean over the batch has variance p / (1 - p) x sum_j P_ij^2 v_j^2 / 96.
    """
    p, batch = 0.3, 96
    q1, k1, v1 = make_qkv(1, (1, 1), (8, 16), 16, torch.float32, seed=21)
    q, k, v = (t.expand(batch, -1, -1, -1) for t in (q1, k1, v1))
    torch.manual_seed(1234)
    out, _ = lazytriton.attn_fwd(q, k, v, dropout_p=p)
    torch.manual_seed(1234)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (batch, 1, 8, 16), p)
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) <= 6 * (p * (1 - p) / n) ** 0.5
    ref, _ = attention_reference(q1.double(), k1.double(), v1.double())
    probs = torch.softmax((q1.double() @ k1.double().transpose(-1, -2)) / 4.0, -1)
    var = p / (1 - p) * (probs[..., None] ** 2 * v1.double()[:, :, None] ** 2).sum(-2) / batch
    mean = out.double().mean(0, keepdim=True)
    assert ((mean - ref).abs() <= 6 * var.sqrt() + 1e-5).all()
    exact, _ = attention_reference(q.double(), k.double(), v.double(), dropout_p=p, keep=keep)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=0)


def test_same_seed_same_result_another_seed_another() -> None:
    q, k, v = make_qkv(1, (2, 2), (20, 24), 16, torch.float32, seed=8)
    results = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        results.append(lazytriton.flash_attn_func(*_bshd(q, k, v), dropout_p=0.25))
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])
    torch.manual_seed(7)  # each call draws anew
    first, second = (lazytriton.flash_attn_func(*_bshd(q, k, v), dropout_p=0.25) for _ in range(2))
    assert not torch.equal(first, second)


def test_the_backward_regenerates_the_forwards_mask() -> None:
    """Through the op's autograd: dV is exactly (P Z / (1 - p))^T dO for the forward's Z, whatever else drew since."""
    q, k, v = make_qkv(1, (2, 2), (17, 19), 16, torch.float32, seed=12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(99)
    out, _ = lazytriton.attn_fwd(*leaves, dropout_p=0.4)
    torch.rand(100)  # the generator moves on; the backward must not draw again
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    torch.manual_seed(99)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (1, 2, 17, 19), 0.4)
    exact = attention_backward_reference(q.double(), k.double(), v.double(), do.double(), dropout_p=0.4, keep=keep)
    for name, g, e in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, strict=True):
        torch.testing.assert_close(g.double(), e, atol=2e-5, rtol=0, msg=name)


def test_compile_fullgraph_traces_dropout_alibi_and_masks() -> None:
    """torch.compile(fullgraph=True): the same result as eager for the same seed, and a backward through it."""
    q, k, v = make_qkv(1, (2, 2), (12, 14), 16, torch.float32, seed=13)
    slopes = torch.tensor([0.2, 0.7])
    mask = torch.rand(12, 14, generator=torch.Generator().manual_seed(1)) > 0.2

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = lazytriton.flash_attn_func(*_bshd(a, b, c), dropout_p=0.2, alibi_slopes=slopes).transpose(1, 2)
        return x + lazytriton.scaled_dot_product_attention(a, b, c, attn_mask=mask, dropout_p=0.1)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    got = compiled(*leaves)
    torch.manual_seed(3)
    eager = fn(q, k, v)
    torch.testing.assert_close(got, eager, atol=1e-6, rtol=0)
    grads = torch.autograd.grad(got.sum(), leaves)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


# ---------------------------------------------------------------------------
# The SDPA drop-in's attn_mask, against torch's math backend in float64

MASK_SHAPES = ((9, 13), (1, 13), (2, 1, 9, 13), (3, 9, 13), (2, 3, 9, 13), (2, 1, 1, 13), (3, 1, 1))


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_masks_match_torch(shape: tuple[int, ...], kind: str) -> None:
    q, k, v = make_qkv(2, (3, 3), (9, 13), 16, torch.float32, seed=seed_of(shape, kind))
    gen = torch.Generator().manual_seed(seed_of(shape))
    if kind == "bool":
        mask = torch.rand(shape, generator=gen) > 0.35
    else:
        mask = torch.randn(shape, generator=gen).masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lazytriton.scaled_dot_product_attention(*leaves, attn_mask=mask)
    do = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, leaves, do)
    exact_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        exact = torch.nn.functional.scaled_dot_product_attention(
            *exact_leaves, attn_mask=mask if kind == "bool" else mask.double())
    exact_grads = torch.autograd.grad(exact, exact_leaves, do.double())
    torch.testing.assert_close(out.double(), exact, atol=2e-6, rtol=0)
    for name, g, e in zip(("dq", "dk", "dv"), got, exact_grads, strict=True):
        torch.testing.assert_close(g.double(), e, atol=2e-5, rtol=0, msg=name)


def test_sdpa_rows_with_every_key_masked_give_zero_as_torch_does() -> None:
    q, k, v = make_qkv(1, (2, 2), (6, 20), 16, torch.bfloat16, seed=31)
    mask = torch.ones(6, 20, dtype=torch.bool)
    mask[2] = False
    mask[4, :17] = False  # the only visible keys in the last, ragged key block
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lazytriton.scaled_dot_product_attention(*leaves, attn_mask=mask)
    with sdpa_kernel(SDPBackend.MATH):
        exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert (exact[:, :, 2] == 0).all() and (out[:, :, 2] == 0).all()
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=0)
    dq, _, _ = torch.autograd.grad(out.float().sum(), leaves)
    assert (dq[:, :, 2] == 0).all() and torch.isfinite(dq).all()


def test_sdpa_mask_in_half_precision_and_broadcast_batch_dims() -> None:
    """A float32 mask with fp16 queries (torch allows it) and 3-D/5-D inputs."""
    q, k, v = make_qkv(2, (2, 2), (7, 11), 16, torch.float16, seed=32)
    mask = torch.randn(1, 7, 11)
    out = lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(SDPBackend.MATH):
        exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                 attn_mask=mask.half().double())
    torch.testing.assert_close(out.double(), exact, atol=2e-3, rtol=0)
    q5, k5, v5 = (t.reshape(2, 1, 2, *t.shape[2:]).expand(2, 3, 2, -1, -1) for t in (q, k, v))
    mask5 = torch.rand(3, 1, 7, 11) > 0.3
    out5 = lazytriton.scaled_dot_product_attention(q5, k5, v5, attn_mask=mask5)
    with sdpa_kernel(SDPBackend.MATH):
        exact5 = torch.nn.functional.scaled_dot_product_attention(q5.double(), k5.double(), v5.double(),
                                                                  attn_mask=mask5)
    torch.testing.assert_close(out5.double(), exact5, atol=2e-3, rtol=0)


def test_a_broadcast_mask_is_never_materialised(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    original = binding.forward

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: binding.Call) -> Any:
        seen.append(call.bias)
        return original(q, k, v, call)

    monkeypatch.setattr(binding, "forward", spy)
    q, k, v = make_qkv(2, (3, 3), (9, 13), 16, torch.float32, seed=33)
    lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=torch.rand(1, 13) > 0.5)
    (bias,) = seen
    assert bias.shape == (2, 3, 9, 13) and bias.stride() == (0, 0, 0, 1) and bias.untyped_storage().nbytes() == 13 * 4


def test_sdpa_dropout_statistics_and_reproducibility() -> None:
    q, k, v = make_qkv(1, (2, 2), (10, 12), 16, torch.float32, seed=34)
    torch.manual_seed(5)
    a = lazytriton.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    b = lazytriton.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (1, 2, 10, 12), 0.5)
    exact, _ = attention_reference(q.double(), k.double(), v.double(), dropout_p=0.5, keep=keep)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), exact, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# Bad input: a clear error before anything runs


def _no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: Any) -> None:
        raise AssertionError("a kernel ran for a bad call")

    monkeypatch.setattr(binding, "run_interpreter", no_run)
    monkeypatch.setattr(bwd_binding, "run_interpreter", no_run)


FA_BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"alibi_slopes": torch.ones(2, dtype=torch.float16)}, TypeError, r"alibi_slopes must be float32, got .*float16"),
    ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must have shape \(2,\) or \(1, 2\).*\(3,\)"),
    ({"alibi_slopes": torch.ones(2, 2)}, ValueError, r"alibi_slopes must have shape.*\(2, 2\)"),
    ({"alibi_slopes": torch.ones(2, device="meta")}, ValueError, r"alibi_slopes is on meta but q is on cpu"),
    ({"alibi_slopes": [0.5, 0.5]}, TypeError, r"alibi_slopes must be a torch.Tensor or None, got list"),
    ({"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    ({"dropout_p": -0.1}, ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
    ({"dropout_p": True}, TypeError, r"dropout_p must be a float, got bool"),
    ({"dropout_p": "0.1"}, TypeError, r"dropout_p must be a float, got str"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), FA_BAD, ids=lambda x: repr(x)[:40])
def test_bad_alibi_or_dropout_raises_before_anything_runs(kwargs: dict[str, Any], error: type[Exception], match: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _no_run(monkeypatch)
    q, k, v = make_qkv(1, (2, 2), (5, 6), 16, torch.float16)
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_func(*_bshd(q, k, v), **kwargs)
    if "alibi_slopes" in kwargs or kwargs["dropout_p"] is not True:
        with pytest.raises(error, match=match.replace("q is", "q is")):
            lazytriton.attn_fwd(q, k, v, **kwargs)


SDPA_BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"attn_mask": torch.ones(5, 7, dtype=torch.bool)}, SDPAError, r"attn_mask of shape \(5, 7\) does not broadcast"),
    ({"attn_mask": torch.ones(3, 5, 6)}, SDPAError, r"does not broadcast to .*\(1, 2, 5, 6\)"),
    ({"attn_mask": torch.ones(5, 6, dtype=torch.int32)}, SDPATypeError, r"attn_mask must be boolean, float32 or"),
    ({"attn_mask": torch.ones(5, 6, dtype=torch.float64)}, SDPATypeError, r"got torch.float64"),
    ({"attn_mask": torch.ones(5, 6, dtype=torch.bool), "is_causal": True}, SDPAError, r"is_causal=True"),
    ({"attn_mask": torch.ones(5, 6, device="meta")}, SDPAError, r"attn_mask is on meta but query is on cpu"),
    ({"attn_mask": "mask"}, SDPATypeError, r"attn_mask must be a torch.Tensor or None, got str"),
    ({"dropout_p": 1.5}, SDPAError, r"dropout_p must be in \[0, 1\)"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), SDPA_BAD, ids=lambda x: repr(x)[:40])
def test_bad_mask_or_dropout_in_sdpa_raises_before_anything_runs(kwargs: dict[str, Any], error: type[Exception],
                                                                 match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_run(monkeypatch)
    q, k, v = make_qkv(1, (2, 2), (5, 6), 16, torch.float32)
    with pytest.raises(error, match=match) as info:
        lazytriton.scaled_dot_product_attention(q, k, v, **kwargs)
    assert isinstance(info.value, RuntimeError)  # torch's own class for SDPA misuse, too


def test_the_op_refuses_dropout_without_philox(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton import ops

    _no_run(monkeypatch)
    q, k, v = make_qkv(1, (2, 2), (5, 6), 16, torch.float32)
    with pytest.raises(ValueError, match=r"dropout_p > 0, philox must be an int64 tensor \[seed, offset\]"):
        ops.flash_fwd_op(q, k, v, 0.25, "none", -1, -1, 0.0, None, None, 0.5, None)


# ---------------------------------------------------------------------------
# Variants, memo keys, the op, the warm path, prewarm, cache explain


def test_variants_gain_fields_only_when_on() -> None:
    target = Target.parse("sm_90")
    for kernel in ("flash_fwd", *bwd_dispatch.BWD_KERNELS):
        plain = dispatch.kernel_variant(kernel, target, "bf16", 128, True, True, 4096, 4096)
        assert not any(flag in str(plain) for flag in ("ALIBI", "BIAS", "DROPOUT"))
        for flag in ("alibi", "bias", "dropout"):
            one = dispatch.kernel_variant(kernel, target, "bf16", 128, True, True, 4096, 4096, **{flag: True})
            assert one.get(flag.upper()) is True and one.key() != plain.key()
            assert check_fields(Variant.parse(str(one))) == one  # what the miss log and --from-misses read back
        with pytest.raises(ValueError, match="DROPOUT=1 must be true or false"):
            check_fields(Variant.parse(str(plain).replace("EVEN_D=true", "DROPOUT=1,EVEN_D=true")))
    text = ("flash_fwd:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,INDEX64=false:"
            "BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8")
    assert str(dispatch.kernel_variant("flash_fwd", target, "bf16", 128, False, True, 4096, 4096)) == text


def test_memo_keys_of_earlier_calls_are_unchanged_and_others_differ() -> None:
    shape = binding.Shape(1, 2, 2, 100, 100, 64)
    plain = binding.memo_key(0, torch.float16, shape, True, True, False)
    assert len(plain) == 8 and len(binding.memo_key(0, torch.float16, shape, True, True, False, True, False)) == 10
    keys = {binding.memo_key(0, torch.float16, shape, True, True, False, False, False, (a, b, d))
            for a in (False, True) for b in (False, True) for d in (False, True)}
    assert len(keys) == 8 and plain in keys
    assert bwd_binding.memo_key(0, torch.float16, shape, True, True, False, mods=(True, False, True))[1:] == \
        binding.memo_key(0, torch.float16, shape, True, True, False, mods=(True, False, True))


def test_interpreter_constexprs_carry_the_flags() -> None:
    shape = binding.Shape(1, 1, 1, 8, 8, 16)
    fwd = binding.interpreter_constexprs(shape, False, mods=(True, False, True))
    assert (fwd["ALIBI"], fwd["BIAS"], fwd["DROPOUT"]) == (True, False, True)
    bwd = bwd_binding.interpreter_constexprs(shape, False, mods=(False, True, False))
    assert (bwd["ALIBI"], bwd["BIAS"], bwd["DROPOUT"]) == (False, True, False)


def test_the_warm_path_is_never_offered_alibi_dropout_or_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    offered: list[Any] = []
    monkeypatch.setattr(hot, "forward_bhsd", lambda *args: offered.append(args))
    monkeypatch.setattr(hot, "forward_bshd", lambda *args: offered.append(args))
    q, k, v = make_qkv(1, (2, 2), (6, 6), 16, torch.float32)
    lazytriton.attn_fwd(q, k, v, alibi_slopes=torch.ones(2))
    lazytriton.attn_fwd(q, k, v, dropout_p=0.1)
    lazytriton.flash_attn_func(*_bshd(q, k, v), alibi_slopes=torch.ones(2))
    lazytriton.flash_attn_func(*_bshd(q, k, v), dropout_p=0.1)
    lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    lazytriton.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert offered == []


def test_op_schemas_fakes_and_the_op_path() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lazytriton import ops

    names = ["alibi_slopes", "attn_bias", "dropout_p", "philox", "deterministic"]
    assert [a.name for a in ops.flash_fwd_op._schema.arguments][-7:] == [*names, "sinks", "attention_chunk"]
    assert [a.name for a in ops.flash_bwd_op._schema.arguments][-7:] == [*names, "bias_grad", "attention_chunk"]
    q, k, v = make_qkv(1, (4, 2), (7, 9), 16, torch.float32, seed=2)
    slopes, bias = torch.rand(4), torch.randn(1, 1, 7, 9).expand(1, 4, 7, 9)
    philox = torch.tensor([5, 6])
    args = (0.25, "none", -1, -1, 0.0, slopes, bias, 0.2, philox)
    real = ops.flash_fwd_op(q, k, v, *args)
    real_grads = ops.flash_bwd_op(real[0], q, k, v, real[0], real[1], *args)
    with FakeTensorMode() as mode:
        fq, fk, fv, fs, fb, fp = (mode.from_tensor(t) for t in (q, k, v, slopes, bias, philox))
        fake_args = (0.25, "none", -1, -1, 0.0, fs, fb, 0.2, fp)
        fake = ops.flash_fwd_op(fq, fk, fv, *fake_args)
        fake_grads = ops.flash_bwd_op(fake[0], fq, fk, fv, fake[0], fake[1], *fake_args)
    for r, f in zip((*real, *real_grads), (*fake, *fake_grads), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    keep = dropout_keep(philox, (1, 4, 7, 9), 0.2)
    ref, _ = attention_reference(q, k, v, sm_scale=0.25, alibi_slopes=slopes, bias=bias, dropout_p=0.2, keep=keep)
    torch.testing.assert_close(real[0], ref, atol=1e-5, rtol=0)
    results = []
    for through_op in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(4)
        if through_op:
            with always_through_op():
                out, _ = lazytriton.attn_fwd(*leaves, alibi_slopes=slopes, dropout_p=0.3)
        else:
            out, _ = lazytriton.attn_fwd(*leaves, alibi_slopes=slopes, dropout_p=0.3)
        results.append((out, *torch.autograd.grad(out.sum(), leaves)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_prewarm_axes_and_cache_explain_take_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lazytriton import tuning
    from lazytriton.cli import main as cli_main
    from lazytriton.prewarm.enumeration import Axes, all_kernels, enumerate_variants

    narrow = {"targets": (Target.parse("sm_90"),), "dtypes": ("bf16",), "head_dims": (64,), "causal": (False,),
              "seqlens_q": (4096,),
              "kernels": ("flash_fwd", *bwd_dispatch.BWD_KERNELS)}  # decoding has no varlen, dropout or bias variants
    table = tuning.tables_for(all_kernels())
    def plan(axes: Axes) -> list[Any]:  # the Gluon twins serve plain calls only (tests/test_prewarm.py)
        return [p for p in enumerate_variants(axes, table) if p.origin not in ("gluon table", "fused table")]

    plain = plan(Axes(**narrow))
    every = plan(Axes(**narrow, alibi=(False, True), dropout=(False, True), bias=(False, True)))
    assert len(every) == 8 * len(plain) and {p.key for p in plain} < {p.key for p in every}
    common = ["prewarm", "--kernel", "flash_fwd,flash_bwd", "--target", "sm_90",
              "--dtype", "bf16", "--head-dim", "64", "--causal", "none",
              "--seqlen-q", "4096", "--list"]
    assert cli_main(common) == 0
    listed_plain = [line for line in capsys.readouterr().out.splitlines() if not twin_line(line)]
    for flag, field in (("--alibi", "ALIBI=true"), ("--dropout", "DROPOUT=true"), ("--attn-mask", "BIAS=true")):
        assert cli_main([*common, flag]) == 0
        listed = [line for line in capsys.readouterr().out.splitlines() if not twin_line(line)]
        assert len(listed) == 2 * len(listed_plain) and sum(field in line for line in listed) == len(listed_plain)
    explain = ["cache", "explain", "--json", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "128",
               "--target", "sm_90", "--alibi", "--dropout", "--attn-mask"]
    assert cli_main(explain) == 0
    report = json.loads(capsys.readouterr().out)
    assert "ALIBI=true" in report["variant"] and "BIAS=true" in report["variant"] and "DROPOUT=true" in report[
        "variant"]
    assert report["call"]["alibi"] and report["call"]["bias"] and report["call"]["dropout"]


def test_variants_with_every_flag_compile_for_sm_90() -> None:
    """The forward only, for CI's time (the backward's compile for sm_90 with Triton 3.6 and 3.9 alike, checked by
    hand; the lead's GPU run launches all three)."""
    from test_compile import check_elf

    from lazytriton.compiler import compile_variant
    from lazytriton.kernels import get

    target, kernel = Target.parse("sm_90"), "flash_fwd"
    variant = dispatch.kernel_variant(kernel, target, "bf16", 64, True, True, 128, 128, alibi=True, bias=True,
                                      dropout=True)
    entry = compile_variant(variant)
    check_elf(entry, target)
    spec = get(kernel)
    assert entry.arg_types == tuple(t for t in spec.signature("bf16", False).values() if t != "constexpr")
    assert entry.arg_types[-8:] == ("i32", "i64", "i64", "i64", "i64", "fp32", "fp32", "fp32")


# ---------------------------------------------------------------------------
# GPU (the lead runs these on the H200): larger shapes, CUDA graphs

@on_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_alibi_dropout_follow_flash_attentions_rule(dtype: torch.dtype, causal: bool) -> None:
    batch, heads, seqlens, p = 2, (8, 2), (500, 777), 0.17
    q, k, v = make_qkv(batch, heads, seqlens, 128, dtype, device="cuda", seed=seed_of("gpu", dtype, causal))
    slopes = torch.rand(batch, heads[0], device="cuda")
    do = torch.randn(q.shape, device="cuda", dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    out = lazytriton.flash_attn_func(*_bshd(*leaves), dropout_p=p, alibi_slopes=slopes, causal=causal).transpose(1, 2)
    got = torch.autograd.grad(out, leaves, do)
    torch.manual_seed(11)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (batch, heads[0], *seqlens), p)
    kwargs: dict[str, Any] = {"causal": "bottom_right" if causal else False, "alibi_slopes": slopes,
                              "dropout_p": p, "keep": keep}
    ref_out, _ = attention_reference(q.double(), k.double(), v.double(), **kwargs)
    same_out, _ = attention_reference(q, k, v, **kwargs)
    check_rule("out", out, ref_out, same_out, OUT_FLOOR[dtype])

    def ref(*t: torch.Tensor) -> torch.Tensor:
        return attention_reference(*t, **kwargs)[0]

    exact = grads_of(ref, q.double(), k.double(), v.double(), do.double())
    same = grads_of(ref, q, k, v, do)
    for name, g, e, s in zip(("dq", "dk", "dv"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[dtype])


@on_gpu
def test_gpu_sdpa_masks_match_torch() -> None:
    q, k, v = make_qkv(2, (8, 8), (300, 513), 64, torch.bfloat16, device="cuda", seed=41)
    for mask in (torch.rand(300, 513, device="cuda") > 0.3, torch.randn(2, 1, 300, 513, device="cuda")):
        out = lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with sdpa_kernel(SDPBackend.MATH):
            exact = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), attn_mask=mask if mask.dtype == torch.bool else mask.double())
            same = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask if mask.dtype == torch.bool else mask.bfloat16())
        check_rule("out", out, exact, same, OUT_FLOOR[torch.bfloat16])


@on_gpu
def test_gpu_dropout_under_cuda_graph_capture_replays_with_fresh_masks() -> None:
    q, k, v = make_qkv(2, (4, 4), (256, 256), 64, torch.float16, device="cuda", seed=42)
    lazytriton.preload(q, k)
    lazytriton.attn_fwd(q, k, v, dropout_p=0.2)  # loads the dropout variant before the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            out, _ = lazytriton.attn_fwd(q, k, v, dropout_p=0.2)
    torch.cuda.synchronize()
    graph.replay()
    first = out.clone()
    graph.replay()
    second = out.clone()
    assert not torch.equal(first, second)
    ref, _ = attention_reference(q.double(), k.double(), v.double())
    assert (first.double() - ref).abs().mean() > 1e-3  # dropped: not the plain output
    assert ((first.double() + second.double()) / 2 - ref).abs().mean() < (first.double() - ref).abs().mean()
