"""Plain-PyTorch twin of ``kv_slots``: keys and values written at their slots with torch indexing.

The tests compare the kernel (through Triton's interpreter) with this, bit
for bit. It writes in place, as the kernel does, and skips the slots the
kernel skips: negative ones and those past the cache. It reads the slots on
the host (a boolean index), which the kernel never does.
"""

from __future__ import annotations

import torch


def write_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Token t of key (num_tokens', heads_k, d) and value (..., dv) into slot slot_mapping[t] of the caches."""
    n = slot_mapping.shape[0]
    num_blocks, block_size = key_cache.shape[:2]
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < num_blocks * block_size)
    slots = slots[keep]
    index = (slots // block_size, slots % block_size)
    key_cache.index_put_(index, key[:n][keep])
    value_cache.index_put_(index, value[:n][keep])


def write_index_copy(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """The same write as ``index_copy_`` over the caches' slots, for caches whose (block, slot) dims flatten.

    Every slot must be in range (index_copy_ skips none); the caches must be
    views whose first two dims merge (``flatten(0, 1)`` a view, not a copy).
    """
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    for cache, new in ((key_cache, key[:n]), (value_cache, value[:n])):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, slots, new)
