"""Plain-PyTorch twin of ``kv_append``: the new keys and values written into the cache with torch indexing.

The tests compare the kernel (through Triton's interpreter) with this, and
both with ``flash_decode.reference`` (FlashAttention-2's own statement of
where the keys land). It writes in place, as the kernel does.
"""

from __future__ import annotations

import torch


def append_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor | int, cache_batch_idx: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None) -> None:
    """Write k (batch, seqlen_new, heads_k, d) and v (..., dv) into the caches at cache_seqlens, in place."""
    batch, seqlen_new = k.shape[:2]
    if batch == 0 or seqlen_new == 0:
        return
    device = k.device
    steps = torch.arange(seqlen_new, device=device)
    start = cache_seqlens.long()[:, None] if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
    positions = (steps[None, :] + start).expand(batch, -1)  # (batch, seqlen_new)
    rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=device)
    if block_table is not None:  # rows of the block table
        page_size = k_cache.shape[1]
        blocks = block_table.long()[rows].gather(1, positions // page_size)
        index = (blocks, positions % page_size)
    else:
        index = (rows[:, None].expand(-1, seqlen_new), positions)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def lengths_reference(cache_seqlens: torch.Tensor | int, cu_seqlens_k_new: torch.Tensor, batch: int
                      ) -> torch.Tensor:
    """``kv_append_lengths``' twin: int32 (batch,) cache_seqlens[b] + cu_seqlens_k_new[b + 1] - cu_seqlens_k_new[b]."""
    cu = cu_seqlens_k_new.long()
    cached = cache_seqlens.long() if isinstance(cache_seqlens, torch.Tensor) else torch.full(
        (batch,), cache_seqlens, dtype=torch.int64, device=cu.device)
    return (cached + cu[1:] - cu[:-1]).to(torch.int32)
