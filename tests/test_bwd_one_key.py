"""A backward whose rows see at most one key gives dq, dk (and a bias' gradient) of exactly zero.

A softmax over one key is 1 whatever its score, so dS = P * (dP - delta) is
zero in exact arithmetic, with a cap, ALiBi, a bias or dropout as well; the
kernels' dP and delta are sums taken in different orders, so without
``flash_bwd.binding.one_key_rows`` their rounding (~1e-7 of dP) would be left
in dq and dk, where FlashAttention-3's tests (seqlen_k = 1) allow no error at
all. dv is P^T dO as usual, checked here against float64. Sinks join every
softmax (P < 1), so there the gradients stay as computed, and follow the
float64 reference. CPU through Triton's interpreter, tiny shapes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from flash_rule import check_rule
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import make_qkv, seed_of

import lazytriton
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_fwd.reference import attention_reference

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"softcap": 5.0}, id="softcap"),
    pytest.param({"alibi": True}, id="alibi"),
    pytest.param({"window_size": (2, 0)}, id="window"),
    pytest.param({"dropout_p": 0.25}, id="dropout"),
]


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _dense(case: dict[str, Any], dtype: torch.dtype, seqlen_q: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(q, k, v, do) in (b, h, s, d) and lazytriton's (dq, dk, dv) through flash_attn_func."""
    q, k, v = make_qkv(2, (4, 2), (seqlen_q, 1), 32, dtype, seed=seed_of(case, dtype, seqlen_q))
    do = torch.randn(q.shape, dtype=dtype, generator=torch.Generator().manual_seed(7))
    kwargs = {key: value for key, value in case.items() if key != "alibi"}
    if case.get("alibi"):
        kwargs["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    leaves = _leaves(*map(_bshd, (q, k, v)))
    out = lazytriton.flash_attn_func(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, _bshd(do))
    return (q, k, v, do), tuple(map(_bshd, grads))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_one_key_gives_exactly_zero_dq_and_dk(case: dict[str, Any], dtype: torch.dtype) -> None:
    (q, k, v, do), (dq, dk, dv) = _dense(case, dtype, seqlen_q=5)
    assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0
    if case.get("dropout_p"):
        return  # dv follows the call's own keep mask; tests/test_alibi_dropout_mask.py checks it
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64) if case.get("alibi") else None

    def ref(*t: torch.Tensor) -> torch.Tensor:
        return attention_reference(*t, causal="bottom_right" if case.get("causal") else False,
                                   window_size=case.get("window_size", (-1, -1)), softcap=case.get("softcap", 0.0),
                                   alibi_slopes=slopes)[0]

    exact = torch.autograd.grad(ref(*(leaves := _leaves(q.double(), k.double(), v.double()))), leaves, do.double())
    same = torch.autograd.grad(ref(*(leaves := _leaves(q, k, v))), leaves, do)
    assert torch.count_nonzero(exact[0]) == 0 and torch.count_nonzero(exact[1]) == 0  # the identity itself
    check_rule("dv", dv, exact[2], same[2], GRAD_FLOOR[dtype])


def test_varlen_with_at_most_one_key_a_sequence_gives_exactly_zero_dq_and_dk() -> None:
    lens_q, lens_k = [3, 1, 4], [1, 0, 1]
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lens_q), 4, 32, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 32, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    leaves = _leaves(q, k, v)
    out = lazytriton.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=gen, dtype=out.dtype))
    assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0
    assert torch.count_nonzero(dv) > 0


def test_a_bias_over_one_key_gets_an_exactly_zero_gradient() -> None:
    q, k, v = make_qkv(1, (2, 2), (3, 1), 16, torch.float32, seed=5)
    bias = torch.randn(1, 2, 3, 1, generator=torch.Generator().manual_seed(6)).requires_grad_()
    leaves = _leaves(q, k, v)
    out = lazytriton.scaled_dot_product_attention(*leaves, attn_mask=bias)
    grads = torch.autograd.grad(out, (*leaves, bias), torch.randn(out.shape))
    assert all(torch.count_nonzero(g) == 0 for g in (grads[0], grads[1], grads[3]))


def test_sinks_keep_their_gradients() -> None:
    """P < 1 with a sink: dq and dk are not zero and follow the float64 reference."""
    dtype = torch.float32
    q, k, v = make_qkv(1, (2, 2), (4, 1), 16, dtype, seed=9)
    sinks = torch.tensor([0.3, -0.7])
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(10))
    leaves = _leaves(*map(_bshd, (q, k, v)))
    out = lazytriton.flash_attn_func(*leaves, sinks=sinks)
    dq, dk, _ = (_bshd(g) for g in torch.autograd.grad(out, leaves, _bshd(do)))
    exact_leaves = _leaves(q.double(), k.double(), v.double())
    exact = torch.autograd.grad(attention_reference(*exact_leaves, sinks=sinks.double())[0], exact_leaves,
                                do.double())
    assert torch.count_nonzero(dq) > 0 and torch.count_nonzero(dk) > 0
    torch.testing.assert_close(dq.double(), exact[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk.double(), exact[1], rtol=1e-4, atol=1e-5)


def test_the_rule_touches_only_calls_of_one_key_without_sinks() -> None:
    """``one_key_rows`` zeroes dq, dk and dbias for max_seqlen_k 1 alone, and never with sinks."""
    from lazytriton.kernels.flash_fwd.binding import Call, Shape

    def grads() -> bwd_binding.Grads:
        return bwd_binding.Grads(torch.ones(2), torch.ones(2), torch.ones(2))

    call = Call(Shape(1, 1, 1, 3, 1, 16), "none", 0, 1 / math.sqrt(16))
    dbias = torch.ones(3)
    zeroed = bwd_binding.one_key_rows(grads(), call, 1, dbias)
    assert zeroed.dq.sum() == 0 and zeroed.dk.sum() == 0 and zeroed.dv.sum() == 2 and dbias.sum() == 0
    for other, keys in ((call, 2), (call, 0), (call._replace(sinks=torch.zeros(1)), 1)):
        kept = bwd_binding.one_key_rows(grads(), other, keys)
        assert kept.dq.sum() == 2 and kept.dk.sum() == 2
