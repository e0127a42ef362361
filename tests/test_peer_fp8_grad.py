"""The FP8 forward takes float8 q, k, v that require grad, as FlashAttention-3's does; only a backward raises.

FlashAttention-3's own tests (hopper/test_flash_attn.py's output tests) make their float8 inputs with
``requires_grad_()`` and skip the backward for float8: the forward must run, give what the same call without
gradients gives, and a backward must fail naming the FP8 forward (``lazytriton.fp8_op.NO_BACKWARD``). CPU tests run
the kernel through Triton's interpreter, checked by FlashAttention-3's rule against float64 (``test_fp8_fwd``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import gpu
from test_fp8_fwd import E4M3, assert_fa3_rule, fp8_inputs, per_head, reference

import lazytriton

NO_BACKWARD = "the FP8 forward .* has no backward"


def _grad(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _check_no_backward(out: torch.Tensor) -> None:
    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(NotImplementedError, match=NO_BACKWARD):
        out.float().sum().backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
def test_flash_attn_func_with_inputs_that_require_grad(device: str) -> None:
    torch.manual_seed(11)
    q, k, v = (t.transpose(1, 2).to(device) for t in fp8_inputs(2, 40, 72, 4, 2, 64))  # (B, S, H, D)
    scales = tuple(s.to(device) for s in per_head(2, 2))
    kw = dict(causal=True, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    want = lazytriton.flash_attn_func(q, k, v, **kw)
    out = lazytriton.flash_attn_func(*_grad(q, k, v), **kw)
    assert torch.equal(out.detach(), want)
    qt, kt, vt = (t.transpose(1, 2).cpu() for t in (q, k, v))
    sc = tuple(s.cpu() for s in scales)
    exact = reference(qt, kt, vt, sc, "bottom_right").transpose(1, 2)
    assert_fa3_rule(out.detach().cpu(), exact, reference(qt, kt, vt, sc, "bottom_right",
                                                         same_precision=True).transpose(1, 2))
    _check_no_backward(out)
    with torch.no_grad():  # no graph wanted: the plain path, no grad_fn
        assert lazytriton.flash_attn_func(*_grad(q, k, v), **kw).grad_fn is None


def test_attn_fwd_with_one_input_that_requires_grad() -> None:
    torch.manual_seed(12)
    q, k, v = fp8_inputs(1, 33, 50, 2, 1, 64)
    want, want_lse = lazytriton.attn_fwd(q, k, v, window_size=(8, 4), softcap=2.0)
    out, lse = lazytriton.attn_fwd(q, k, v.clone().requires_grad_(), window_size=(8, 4), softcap=2.0)
    assert torch.equal(out.detach(), want) and torch.equal(lse.detach(), want_lse)
    _check_no_backward(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
def test_flash_attn_varlen_func_with_inputs_that_require_grad(device: str) -> None:
    torch.manual_seed(13)
    lens_q, lens_k, hq, hk, d = [20, 1, 37], [45, 9, 30], 4, 2, 64
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), hq, d, device=device).to(E4M3)
    k, v = (torch.randn(sum(lens_k), hk, d, device=device).to(E4M3) for _ in range(2))
    scales = tuple(s.to(device) for s in per_head(3, hk))
    kw = dict(causal=True, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    want = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 45, **kw)
    out = lazytriton.flash_attn_varlen_func(*_grad(q, k, v), cu_q, cu_k, 37, 45, **kw)
    assert torch.equal(out.detach(), want)
    for i in range(3):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qi, ki, vi = (t[sl].transpose(0, 1)[None].cpu() for t, sl in ((q, rows), (k, keys), (v, keys)))
        si = tuple(s[i:i + 1].cpu() for s in scales)
        exact = reference(qi, ki, vi, si, "bottom_right")[0].transpose(0, 1)
        same = reference(qi, ki, vi, si, "bottom_right", same_precision=True)[0].transpose(0, 1)
        assert_fa3_rule(out[rows].detach().cpu(), exact, same)
    _check_no_backward(out)


def test_a_descale_that_requires_grad_is_still_refused() -> None:
    q, k, v = fp8_inputs(1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="q_descale requires grad"):
        lazytriton.attn_fwd(q, k, v, q_descale=torch.ones(1, 2).requires_grad_())
