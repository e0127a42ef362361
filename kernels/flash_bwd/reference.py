"""Plain-PyTorch twin of the flash_bwd kernels: the gradients the tests compare against.

The same formulas the kernels evaluate, written out over whole matrices:
``P = softmax(scale * Q K^T)`` (masked), ``dV = P^T dO``,
``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = scale * dS K``,
``dK = scale * dS^T Q``, with GQA's dK and dV summed over each group of query
heads. Computed in the inputs' dtype for matrix products (float32 softmax)
unless the caller upcasts, so the tests can measure both a same-precision
reference and a float64 one.
"""

from __future__ import annotations

import math

import torch


def attention_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                                 causal: bool | str = False, sm_scale: float | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``attention_reference(q, k, v)`` for the output gradient ``do``."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    kx = k.repeat_interleave(group, dim=1) if group > 1 else k
    vx = v.repeat_interleave(group, dim=1) if group > 1 else v
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q @ kx.transpose(-1, -2)).to(work) * scale
    if causal:
        offset = sk - sq if causal == "bottom_right" else 0
        rows = torch.arange(sq, device=q.device)[:, None]
        cols = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + offset, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).nan_to_num(0.0)  # rows with no key: 0
    out = probs.to(v.dtype) @ vx  # the forward's output, as attention_reference computes it
    delta = (do.to(work) * out.to(work)).sum(-1, keepdim=True)
    dp = (do @ vx.transpose(-1, -2)).to(work)
    ds = probs * (dp - delta)
    dv = probs.to(q.dtype).transpose(-1, -2) @ do
    dq = (ds.to(q.dtype) @ kx).to(work) * scale
    dk = (ds.to(q.dtype).transpose(-1, -2) @ q).to(work) * scale
    if group > 1:
        dk = dk.reshape(b, hk, group, sk, d).sum(2)
        dv = dv.reshape(b, hk, group, sk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
