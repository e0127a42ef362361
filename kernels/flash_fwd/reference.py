"""Plain-PyTorch twin of the flash_fwd kernel: the reference the tests compare against.

Same layout, same causal conventions, same answer for a query that sees no
key (output 0, logsumexp -inf). The sliding window and the softcap follow
FlashAttention-2's own test reference (``construct_local_mask`` and
``attention_ref`` in its tests/test_flash_attn.py): the window is aligned
bottom-right (top-left only for a top-left causal call), causal sets its
right side to 0, and the cap applies to the scaled scores. Computed in the inputs' dtype unless the
caller upcasts, so the tests can measure both a same-precision reference and
a float64 one.
"""

from __future__ import annotations

import math

import torch


def visible(seqlen_q: int, seqlen_k: int, causal: bool | str = False, window_size: tuple[int, int] = (-1, -1),
            device: torch.device | str | None = None) -> torch.Tensor | None:
    """The (seqlen_q, seqlen_k) mask of keys each query sees, or None when it sees them all.

    FlashAttention-2's rule: query i sees key j when
    ``i + offset - left <= j <= i + offset + right`` (-1: that side unbounded),
    offset = seqlen_k - seqlen_q, or 0 for a top-left causal call; causal is
    the window (left, 0).
    """
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    offset = 0 if causal is True or causal == "top_left" else seqlen_k - seqlen_q
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= cols <= rows + offset + right
    if left >= 0:
        keep &= cols >= rows + offset - left
    return keep


def capped_scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float,
                  causal: bool | str, window_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled, capped and masked scores (float32, float64 for float64 inputs), and tanh of the capped ones."""
    scores = q @ k.transpose(-1, -2)
    scores = (scores if q.dtype == torch.float64 else scores.float()) * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    keep = visible(q.shape[-2], k.shape[-2], causal, window_size, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores, tanh


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | str = False,
                        sm_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                        softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(q k^T * scale) v, with GQA, both causal alignments, windows and softcap."""
    hq, d = q.shape[1], q.shape[3]
    hk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scores = capped_scores(q, k, scale, softcap, causal, window_size)[0]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0, not NaN
    out = (probs.to(v.dtype) @ v).to(q.dtype)
    return out, lse.float()
