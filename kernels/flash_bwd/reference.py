"""Plain-PyTorch twin of the flash_bwd kernels: the gradients the tests compare against.

The same formulas the kernels evaluate, written out over whole matrices:
``P = softmax(scale * Q K^T)`` (masked), ``dV = P^T dO``,
``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = scale * dS K``,
``dK = scale * dS^T Q``, with GQA's dK and dV summed over each group of query
heads. The window masks as the forward's reference does; with a softcap,
``S = softcap * tanh(scale * Q K^T / softcap)`` and dS is multiplied by
``1 - tanh^2`` (the cap's derivative). ALiBi and a bias are added to the
scores as the forward's reference adds them (no gradient of their own); with
dropout's keep mask Z, FlashAttention-2's formulas: ``dV = (P Z / (1 - p))^T dO``,
``dP = (dO V^T) Z / (1 - p)``, ``dS = P (dP - rowsum(dO * O))``. Computed in
the inputs' dtype for matrix products (float32 softmax) unless the caller
upcasts, so the tests can measure both a same-precision reference and a
float64 one.
"""

from __future__ import annotations

import math

import torch

from lazytriton.kernels.flash_fwd.reference import capped_scores


def attention_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                                 causal: bool | str = False, sm_scale: float | None = None,
                                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                 alibi_slopes: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                                 dropout_p: float = 0.0, keep: torch.Tensor | None = None,
                                 attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``attention_reference(q, k, v)`` for the output gradient ``do``."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    kx = k.repeat_interleave(group, dim=1) if group > 1 else k
    vx = v.repeat_interleave(group, dim=1) if group > 1 else v
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores, tanh = capped_scores(q, kx, scale, softcap, causal, window_size, alibi_slopes, bias, attention_chunk)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).nan_to_num(0.0)  # rows with no key: 0
    dropped = probs if keep is None else probs * keep / (1.0 - dropout_p)
    out = dropped.to(v.dtype) @ vx  # the forward's output, as attention_reference computes it
    delta = (do.to(work) * out.to(work)).sum(-1, keepdim=True)
    dp = (do @ vx.transpose(-1, -2)).to(work)
    if keep is not None:
        dp = dp * keep / (1.0 - dropout_p)
    ds = probs * (dp - delta)
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    dv = dropped.to(q.dtype).transpose(-1, -2) @ do
    dq = (ds.to(q.dtype) @ kx).to(work) * scale
    dk = (ds.to(q.dtype).transpose(-1, -2) @ q).to(work) * scale
    if group > 1:
        dk = dk.reshape(b, hk, group, sk, d).sum(2)
        dv = dv.reshape(b, hk, group, sk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
