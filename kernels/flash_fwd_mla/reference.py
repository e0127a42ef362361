"""Plain-PyTorch twin of the MLA forward (``triton_kernel.py``): the reference the tests compare against.

FlashAttention-3's ``attention_ref`` (hopper/test_util.py) with ``qv``: scores q . k + qv . v, which is
flash_fwd's reference on q and qv joined against k and v joined (one product over both), with v's own head
dim for the values. Default scale 1/sqrt(head_dim + head_dim_v) with qv, 1/sqrt(head_dim) without.
``attention_chunk``: FlashAttention-3's chunked local attention, flash_fwd's reference's (``visible``).
Computed in the inputs' dtype unless the caller upcasts (float64 for the exact reference).
"""

from __future__ import annotations

import math

import torch

from lazytriton.kernels.flash_fwd.reference import attention_reference


def mla_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None = None, *,
                  causal: bool | str = False, sm_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in the (batch, heads, seqlen, head dim) layout: q, k (.., d), v, qv (.., dv)."""
    d, dv = q.shape[-1], v.shape[-1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d + (dv if qv is not None else 0))
    if qv is not None:
        q, k = torch.cat((q, qv), dim=-1), torch.cat((k, v), dim=-1)
    return attention_reference(q, k, v, causal=causal, sm_scale=scale, window_size=window_size, softcap=softcap,
                               attention_chunk=attention_chunk)
