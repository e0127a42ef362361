"""FlashAttention-2's ``S_dmask`` (``return_attn_probs=True`` with dropout) for a lazytriton call, for its tests.

FlashAttention-2's tests read two things from S_dmask: the dropout mask (its sign: a dropped element is negative)
and the unnormalised probabilities ``exp(s - m)`` (its magnitude, m the running row maximum over blocks of
``_get_block_size_n`` keys, which their ``normalize_flash_attn_S`` undoes). Here:

- the mask is lazytriton's own: the call's Philox [seed, offset] pair is drawn from torch's generator on q's
  device, so ``replayed`` saves the generator's state, runs the call, and draws the same pair again from the saved
  state; each element's keep bit then follows the kernels' rule, ``philox_uniform(seed, offset + index) >
  dropout_p`` with the index of element (b, h, i, j) dense, (h, packed row, packed key) packed (``dropout_keep``
  of ``lazytriton.kernels.flash_fwd.reference``, which lazytriton's tests hold bit for bit to the kernels'; its
  ``philox_uniform`` computed here on q's device);
- the magnitude is recomputed here in float32 from q and k (lazytriton's kernels do not write probabilities out),
  over one block the width of the row (the shim's ``_get_block_size_n`` says so), so ``m`` is the row maximum.

So a test's output and gradient checks, which use the mask in their reference, check lazytriton's dropout; its
check of the probabilities checks this recomputation, not the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lazytriton.kernels.flash_fwd.reference import capped_scores, philox_uniform
from lazytriton.kernels.flash_fwd.score_mods import draw_philox

WHOLE_ROW = 2**31 - 1  # the block width normalize_flash_attn_S splits keys by: one block


def replayed(device: torch.device, call: Callable[[], Any]) -> tuple[Any, torch.Tensor]:
    """``call()``'s result and the Philox pair it drew on ``device`` (its first draw from torch's generator)."""
    get, put = ((torch.get_rng_state, torch.set_rng_state) if device.type == "cpu" else
                (lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device)))
    before = get()
    result = call()
    after = get()
    put(before)
    philox = draw_philox(device, 0)  # the pair only: the state is put back next
    put(after)
    return result, philox


def _kept(philox: torch.Tensor, index: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The keep bits of the elements at ``index`` (int64, on the device the bits are wanted on)."""
    seed, offset = (int(x) for x in philox.cpu())
    return philox_uniform(seed % 2**64, index + offset) > torch.tensor(dropout_p, dtype=torch.float32,
                                                                       device=index.device)


def _encoded(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(scores - row max), negated where dropped (FlashAttention-2's encoding); 0 where masked."""
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    unnorm = torch.exp(scores - top)
    return torch.where(keep, unnorm, -unnorm)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None, causal: bool, window: tuple[int, int],
            alibi: torch.Tensor | None) -> torch.Tensor:
    """Float32 scores (batch, heads_q, seqlen_q, seqlen_k) of (batch, seqlen, heads, d) q and k, masked to -inf."""
    qf, kf = (t.detach().float().transpose(1, 2) for t in (q, k))
    kf = kf.repeat_interleave(qf.shape[1] // kf.shape[1], dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    slopes = None if alibi is None else alibi.float()
    return capped_scores(qf, kf, scale, 0.0, "bottom_right" if causal else False, window, slopes)[0]


def dense(q: torch.Tensor, k: torch.Tensor, philox: torch.Tensor, dropout_p: float, scale: float | None,
          causal: bool, window: tuple[int, int], alibi: torch.Tensor | None) -> torch.Tensor:
    """S_dmask of ``flash_attn_func``'s call: (batch, heads_q, seqlen_q, seqlen_k), float32."""
    b, sq, h, _ = q.shape
    index = torch.arange(b * h * sq * k.shape[1], dtype=torch.int64, device=q.device).view(b, h, sq, k.shape[1])
    keep = _kept(philox, index, dropout_p)
    return _encoded(_scores(q, k, scale, causal, window, alibi), keep)


def packed(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
           max_seqlen_q: int, max_seqlen_k: int, philox: torch.Tensor, dropout_p: float, scale: float | None,
           causal: bool, window: tuple[int, int], alibi: torch.Tensor | None) -> torch.Tensor:
    """S_dmask of ``flash_attn_varlen_func``'s call: (batch, heads_q, max_seqlen_q, max_seqlen_k), float32,
    sequence b's block at [b, :, :len_q, :len_k] (the rest 0)."""
    total_q, heads = q.shape[:2]
    total_k = k.shape[0]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    s_dmask = torch.zeros(len(cq) - 1, heads, max_seqlen_q, max_seqlen_k, dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0 or lk == 0:
            continue
        slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)[None]
        scores = _scores(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], scale, causal, window, slopes)[0]
        rows = torch.arange(cq[b], cq[b + 1], dtype=torch.int64, device=q.device)[None, :, None]
        cols = torch.arange(ck[b], ck[b + 1], dtype=torch.int64, device=q.device)[None, None, :]
        heads_index = torch.arange(heads, dtype=torch.int64, device=q.device)[:, None, None]
        s_dmask[b, :, :lq, :lk] = _encoded(scores, _kept(philox, (heads_index * total_q + rows) * total_k + cols,
                                                         dropout_p))
    return s_dmask
