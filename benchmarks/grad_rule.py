"""FlashAttention's rule for attention gradients, for the benchmarks' check before they time a backward.

A provider's dq, dk and dv pass when each one's largest error against a
float64 reference is at most twice the largest error of the same math done in
the inputs' dtype (plain PyTorch, autograd), plus the dtype's rounding at 0.3
(FlashAttention 3's floor). Only batch 0, heads ``[0, REF_HEADS)`` are
compared: float64 scores of 16k x 16k are 2 GiB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

REF_HEADS = 1


def math_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
               dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of plain attention computed in ``dtype`` (causal: top-left, as SDPA's is_causal)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return torch.autograd.grad(out, (q, k, v), do.to(dtype))


class Reference(NamedTuple):
    """Float64 gradients of the reference slice, and the error of the same-dtype math against them."""

    exact: tuple[torch.Tensor, ...]
    base_err: tuple[float, ...]
    atol: tuple[float, ...]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool) -> Reference:
    qs, ks, vs, dos = (t[:1, :REF_HEADS] for t in (q, k, v, do))
    exact = math_grads(qs, ks, vs, dos, causal, torch.float64)
    low = math_grads(qs, ks, vs, dos, causal, q.dtype)
    base = tuple(float((lo.double() - ex).abs().max()) for lo, ex in zip(low, exact, strict=True))
    rounded = [ex.to(q.dtype) for ex in exact]
    atol = tuple(2 * float((r + 0.3 - 0.3 - r).abs().max()) for r in rounded)  # FlashAttention 3's floor
    return Reference(exact, base, atol)


def check_grads(grads: Sequence[torch.Tensor], ref: Reference) -> tuple[bool, float, str]:
    """(passes FlashAttention's rule, worst relative error, what failed) for one provider's (dq, dk, dv)."""
    ok, worst, notes = True, 0.0, []
    for name, g, exact, base, atol in zip(("dq", "dk", "dv"), grads, ref.exact, ref.base_err, ref.atol,
                                          strict=True):
        part = g[:1, :REF_HEADS].double()
        err = float((part - exact).abs().max())
        worst = max(worst, float((part - exact).norm() / exact.norm().clamp_min(1e-30)))
        if not err <= 2 * base + atol:  # also refuses NaN
            ok = False
            notes.append(f"{name} max error {err:.2e} > 2 x {base:.2e} + {atol:.1e}")
    return ok, worst, "; ".join(notes)
