"""Plain-PyTorch twin of ``flash_combine``: the split outputs merged by their logsumexp, in float64.

FlashAttention-3's own statement of the combine (``attention_combine_ref`` of
its tests), with one difference that the kernel shares: a split whose lse is
-inf contributes nothing, whatever its output holds (FlashAttention-3's
multiplies it by 0, so a NaN or inf there would spread). The tests compare
the kernel (through Triton's interpreter) with this.
"""

from __future__ import annotations

import torch


def combine_reference(out_partial: torch.Tensor, lse_partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64 from out_partial (splits, ..., head_dim) and lse_partial (splits, ...).

    ``...`` is (batch, seqlen, heads) or (total_q, heads); every split -inf
    gives out 0 and lse -inf.
    """
    lse_parts = lse_partial.double()
    lse = torch.logsumexp(lse_parts, dim=0)  # -inf where every split is -inf
    seen = lse_parts > float("-inf")
    weight = torch.where(seen, torch.exp(lse_parts - torch.where(seen, lse, 0.0)), 0.0)
    parts = torch.where(seen.unsqueeze(-1), out_partial.double(), 0.0)
    return (weight.unsqueeze(-1) * parts).sum(0), lse
