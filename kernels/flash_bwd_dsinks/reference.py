"""The plain PyTorch twin of ``flash_bwd_dsinks`` (the tests compare the kernel with it).

``dsinks`` over the same layouts the kernel reads: dense lse and delta
(batch, heads, seqlen_q); packed (heads, total_q) with the cumulative lengths
and, where given, each sequence's used rows (the rows past them add nothing).
"""

from __future__ import annotations

import torch


def dsinks(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
           seqused_q: torch.Tensor | None = None) -> torch.Tensor:
    """-sum over every row of head h of exp(sinks[h] - lse) * delta, in float64; a NaN gap (both -inf) adds 0."""
    heads = sinks.numel()
    lse64, delta64, sinks64 = lse.double(), delta.double(), sinks.double()
    if cu_seqlens_q is None:
        gap = sinks64.view(1, heads, 1) - lse64
        share = torch.exp(gap.nan_to_num(nan=float("-inf")))
        return -(share * delta64).sum((0, 2))
    keep = torch.zeros(lse.shape[1], dtype=torch.bool)
    bounds = cu_seqlens_q.tolist()
    for b in range(len(bounds) - 1):
        used = bounds[b + 1] - bounds[b] if seqused_q is None else int(seqused_q[b])
        keep[bounds[b]:bounds[b] + used] = True
    gap = sinks64.view(heads, 1) - lse64[:, keep]
    share = torch.exp(gap.nan_to_num(nan=float("-inf")))
    return -(share * delta64[:, keep]).sum(1)
