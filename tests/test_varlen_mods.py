"""ALiBi and dropout with packed sequences (``flash_attn_varlen_func``), forward and backward.

Numerics follow FlashAttention's rule against a float64 reference computed
sequence by sequence (``tests/test_varlen.py``'s), with FlashAttention-2's
per-sequence ALiBi (bottom-right within each sequence) and, for dropout, the
kernels' keep mask: ``dropout_keep`` (the torch Philox copy) over the packed
(1, heads_q, total_q, total_k) scores, of which each sequence owns the block
of its own rows and keys, so no two elements of the batch share a mask bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from flash_rule import check_rule, references, seed_of
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR
from varlen_cases import cu, packed_reference

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd import score_mods, varlen
from lazytriton.kernels.flash_fwd.reference import dropout_keep
from lazytriton.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Case(NamedTuple):
    dtype: torch.dtype
    heads: tuple[int, int]
    causal: bool
    alibi: str  # none, heads, batch
    dropout_p: float
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]

    def __str__(self) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')}-h{self.heads[0]}x{self.heads[1]}-"
                f"{'causal' if self.causal else 'full'}-alibi_{self.alibi}-p{self.dropout_p}-"
                f"q{'_'.join(map(str, self.lengths_q))}-k{'_'.join(map(str, self.lengths_k))}")


CASES = [
    Case(F32, (2, 1), True, "batch", 0.0, (5, 0, 19), (9, 4, 17)),
    Case(F16, (2, 2), False, "heads", 0.25, (7, 18, 1), (13, 6, 20)),
    Case(BF16, (4, 2), True, "batch", 0.4, (17, 3), (9, 21)),
    Case(F32, (2, 2), False, "none", 0.3, (0, 11, 6), (5, 0, 14)),
]
HEAD_DIM = 16


def _inputs(case: Case) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed_of(str(case)))
    (hq, hk), tq, tk = case.heads, sum(case.lengths_q), sum(case.lengths_k)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    batch = len(case.lengths_q)
    slopes = None if case.alibi == "none" else torch.rand((hq,) if case.alibi == "heads" else (batch, hq),
                                                          generator=gen) * 0.7
    return {"q": randn(tq, hq, HEAD_DIM), "k": randn(tk, hk, HEAD_DIM), "v": randn(tk, hk, HEAD_DIM),
            "do": randn(tq, hq, HEAD_DIM), "slopes": slopes}


def _reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor | None,
               keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) sequence by sequence; sequence i's keep mask is its block of the packed one."""
    return packed_reference(q, k, v, case.lengths_q, case.lengths_k, causal=case.causal, slopes=slopes, keep=keep,
                            dropout_p=case.dropout_p)


def _call(case: Case, a: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    out, lse, _ = lazytriton.flash_attn_varlen_func(
        q, k, v, cu(case.lengths_q), cu(case.lengths_k), max(max(case.lengths_q), 1), max(max(case.lengths_k), 1),
        dropout_p=case.dropout_p, causal=case.causal, alibi_slopes=a["slopes"], return_attn_probs=True)
    return out, lse


def _packed_keep(case: Case, seed: int) -> torch.Tensor | None:
    if case.dropout_p == 0:
        return None
    torch.manual_seed(seed)  # the pair the call drew
    return dropout_keep(score_mods.draw_philox(torch.device("cpu"), 0),
                        (1, case.heads[0], sum(case.lengths_q), sum(case.lengths_k)), case.dropout_p)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_alibi_and_dropout_follow_flash_attentions_rule(case: Case) -> None:
    a = _inputs(case)
    q, k, v, do = (a[n] for n in ("q", "k", "v", "do"))
    seed = seed_of(str(case), "philox")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _call(case, a, *leaves, seed)
    grads = torch.autograd.grad(out, leaves, do)
    keep = _packed_keep(case, seed)

    exact, same = references(lambda *t: _reference(case, *t, a["slopes"], keep), (q, k, v), do)

    seen = ~torch.isneginf(exact.lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    check_rule("out", out, exact.out, same.out, OUT_FLOOR[case.dtype])
    check_rule("lse", lse[seen], exact.lse[seen], same.lse[seen], LSE_FLOOR)
    for name, g, x, s in zip(("dq", "dk", "dv"), grads, exact.grads, same.grads, strict=True):
        check_rule(name, g, x, s, GRAD_FLOOR[case.dtype])


def test_the_packed_mask_forward_and_backward_is_dropout_keep_bit_for_bit() -> None:
    """q = 0 makes every probability 1 / len_k; v and dO the identity per sequence read Z off out and dV.

    So both the forward's mask and the backward's regenerated one are compared
    with the packed ``dropout_keep``: each sequence gets its own block of it.
    """
    lq, lk, h, d, p = (5, 12, 0, 9), (7, 3, 4, 12), 2, 16, 0.3
    cq, ck = cu(lq), cu(lk)
    q = torch.zeros(sum(lq), h, d, requires_grad=True)
    k = torch.randn(sum(lk), h, d, generator=torch.Generator().manual_seed(3)).requires_grad_()
    v = torch.cat([torch.eye(n, d) for n in lk])[:, None].expand(-1, h, -1).clone().requires_grad_()
    do = torch.cat([torch.eye(n, d) for n in lq])[:, None].expand(-1, h, -1)
    torch.manual_seed(91)
    out = lazytriton.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), dropout_p=p)
    (dv,) = torch.autograd.grad(out, (v,), do)
    torch.manual_seed(91)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (1, h, sum(lq), sum(lk)), p)[0]
    a, b = cq.tolist(), ck.tolist()
    checked = 0
    for i, (nq, nk) in enumerate(zip(lq, lk, strict=True)):
        if nq == 0 or nk == 0:
            continue
        block = keep[:, a[i]:a[i] + nq, b[i]:b[i] + nk]
        fwd_mask = out[a[i]:a[i] + nq, :, :nk].transpose(0, 1) * (nk * (1 - p)) > 0.5
        bwd_mask = dv[b[i]:b[i] + nk, :, :nq].permute(1, 2, 0) * (nk * (1 - p)) > 0.5
        assert torch.equal(fwd_mask, block), f"sequence {i}: the forward's mask"
        assert torch.equal(bwd_mask, block), f"sequence {i}: the backward's mask"
        checked += block.numel()
    assert checked > 100 and 0.5 < keep.float().mean() < 0.9


def test_same_seed_same_result_another_seed_another() -> None:
    case = CASES[1]
    a = _inputs(case)
    first, _ = _call(case, a, a["q"], a["k"], a["v"], 5)
    again, _ = _call(case, a, a["q"], a["k"], a["v"], 5)
    other, _ = _call(case, a, a["q"], a["k"], a["v"], 6)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_variants_memo_keys_and_op_schema_carry_the_mods() -> None:
    q = torch.zeros(10, 2, 16, dtype=torch.float16)
    cuq = torch.tensor([0, 4, 10], dtype=torch.int32)
    plain = varlen.check(q, q, q, cuq, cuq, 6, 6)
    modded = varlen.check(q, q, q, cuq, cuq, 6, 6, alibi=torch.ones(2, 2), dropout_p=0.2,
                          philox=torch.tensor([1, 2]))
    assert modded.call.shape == plain.call.shape and modded.call.mods == (True, False, True)
    sm90 = Target.parse("sm_90")
    for v in varlen.variants((*varlen.FORWARD, *varlen.BACKWARD), sm90, torch.float16, modded, True, False):
        assert (v.get("ALIBI"), v.get("DROPOUT"), v.get("VARLEN")) == (True, True, True)
    assert "ALIBI" not in str(varlen.variants(varlen.FORWARD, sm90, torch.float16, plain, True, False)[0])
    assert varlen.memo_key(0, torch.float16, plain, True, False) != varlen.memo_key(0, torch.float16, modded, True,
                                                                                    False)
    assert varlen.bwd_memo_key(0, torch.float16, plain, True, False) != varlen.bwd_memo_key(
        0, torch.float16, modded, True, False)
    want = dispatch.kernel_variant("flash_bwd_dq", sm90, "fp16", 16, False, True, 6, 6, alibi=True, dropout=True,
                                   varlen=True)
    assert varlen.variants(varlen.BACKWARD, sm90, torch.float16, modded, True, False)[0] == want
    from lazytriton.ops_varlen import flash_varlen_fwd_op

    names = [arg.name for arg in flash_varlen_fwd_op._schema.arguments][-7:]
    assert names == ["alibi_slopes", "dropout_p", "philox", "seqused_q", "seqused_k", "sinks", "attention_chunk"]


def test_dropout_without_philox_is_refused_by_the_op(no_launch: None) -> None:
    from lazytriton.ops_varlen import flash_varlen_fwd_op

    q = torch.zeros(10, 2, 16)
    cuq = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dropout_p > 0, philox must be an int64 tensor \[seed, offset\]"):
        flash_varlen_fwd_op(q, q, q, cuq, cuq, 6, 6, 0.25, False, -1, -1, 0.0, None, 0.5, None)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\) or \(2, 2\)"):
        flash_varlen_fwd_op(q, q, q, cuq, cuq, 6, 6, 0.25, False, -1, -1, 0.0, torch.ones(3, 2), 0.0, None)


def test_compile_fullgraph_traces_varlen_dropout_and_alibi() -> None:
    """torch.compile(fullgraph=True) through the op: eager's result for the same seed, and a backward through it."""
    case = CASES[2]
    a = _inputs(case)
    cq, ck = cu(case.lengths_q), cu(case.lengths_k)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_varlen_func(q, k, v, cq, ck, max(case.lengths_q), max(case.lengths_k),
                                                 dropout_p=0.3, alibi_slopes=a["slopes"], causal=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [a[n].float().clone().requires_grad_() for n in ("q", "k", "v")]
    torch.manual_seed(4)
    got = compiled(*leaves)
    torch.manual_seed(4)
    eager = fn(*(t.detach() for t in leaves))
    torch.testing.assert_close(got, eager, atol=1e-6, rtol=0)
    grads = torch.autograd.grad(got.sum(), leaves)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
