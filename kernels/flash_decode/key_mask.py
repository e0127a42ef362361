"""A decoding call's key mask: lazytriton's own per-(batch, key) boolean mask on the split kernel (``KEY_MASK``).

Not a FlashAttention argument. It is what a transformers decoding step hands
its attention: SDPA's boolean (batch, 1, 1, kv_len) mask, one query a
sequence, True where the query attends (``lazytriton.integrations.transformers``
passes its (batch, kv_len) view, ``kvcache.with_key_mask``). A left-padded
batch, holes, a static cache's empty slots: whatever the mask says, read by
the kernel per key tile, so nothing is read back to the host (the pads need
not be turned into ``cache_leftpad``).

The mask is ``key_mask``: (batch, capacity) with capacity the cache's keys
per sequence (seqlen_cache, or max_blocks x page_size with a block table),
torch.bool or torch.uint8 (0: masked, anything else: seen), on q's device,
any strides (a view of the 4-D mask serves as it is). Row b is sequence b of
q (whatever its cache row), column j key position j of that sequence. Its
values are never read on the host: every byte is a valid mask.

Semantics: SDPA's boolean mask. A masked key's score is -inf before the
row's max, after the softcap and ALiBi (the order of transformers' eager
attention: the cap, then the mask), on top of every other bound of the call
(its length, cache_leftpad, causal, the window, the chunk), the same for
every query and head of the sequence. A row whose keys are all masked gets
out 0 and lse -inf (lse the sink with sinks), which is what PyTorch's SDPA
gives a fully masked row (its math backend's ``_safe_softmax`` since torch
2.5: 0, not NaN; lazytriton's forward kernel under the same mask as a bias
gives 0 too). A masked key's K and V are still read: a NaN in a masked
value reaches the output, as it does in SDPA.

Served eagerly on plain tensors (``kvcache.with_key_mask``: the warm path
``hot.py`` and the binding); the torch op does not take it, nor does the C
API (its struct has no field for it, and its launches pass a null mask).
"""

from __future__ import annotations

import torch

DTYPES = (torch.bool, torch.uint8)


def check(mask: object, q: torch.Tensor, batch: int, capacity: int, cache: str = "k_cache") -> None:
    """Refuse a key mask that is not a (batch, capacity) bool or uint8 tensor on q's device (names key_mask)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype not in DTYPES:
        raise TypeError(f"key_mask must be torch.bool or torch.uint8 (0: masked), got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"key_mask is on {mask.device} but q is on {q.device}; they must be on one device")
    if tuple(mask.shape) != (batch, capacity):
        raise ValueError(f"key_mask must have shape ({batch}, {capacity}) (q's batch, and every key position of "
                         f"the cache: {cache}'s capacity per sequence), got {tuple(mask.shape)}")


def kernel_view(mask: torch.Tensor) -> torch.Tensor:
    """The mask as the kernel reads it: its bytes as uint8 (a view: bool and uint8 have one byte an element)."""
    return mask if mask.dtype == torch.uint8 else mask.view(torch.uint8)


def strides(mask: torch.Tensor | None) -> tuple[int, int]:
    """(stride_mb, stride_mn): the mask's (batch, key) strides in bytes, 0 without one."""
    if mask is None:
        return 0, 0
    return mask.stride(0), mask.stride(1)
