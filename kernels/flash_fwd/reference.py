"""Plain-PyTorch twin of the flash_fwd kernel: the reference the tests compare against.

Same layout, same causal conventions, same answer for a query that sees no
key (output 0, logsumexp -inf). Computed in the inputs' dtype unless the
caller upcasts, so the tests can measure both a same-precision reference and
a float64 one.
"""

from __future__ import annotations

import math

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | str = False,
                        sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(q k^T * scale) v, with GQA and both causal alignments."""
    _, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scores = q @ k.transpose(-1, -2)
    scores = (scores if q.dtype == torch.float64 else scores.float()) * scale
    if causal:
        offset = sk - sq if causal == "bottom_right" else 0
        rows = torch.arange(sq, device=q.device)[:, None]
        cols = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + offset, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0, not NaN
    out = (probs.to(v.dtype) @ v).to(q.dtype)
    return out, lse.float()
