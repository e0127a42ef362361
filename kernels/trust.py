"""Whether index tensors built by the caller are trusted: their value checks (a host sync) are skipped.

``flash_attn_with_kvcache`` reads cache_seqlens, block_table and
cache_batch_idx to the host to check them, and ``flash_attn_varlen_func``
reads cu_seqlens_q/cu_seqlens_k; each read is a device-to-host sync, one per
call (per layer, in a model). A caller whose index tensors are right by
construction (a serving loop, the transformers integration, which derives
cu_seqlens from the mask it has already read once per forward) skips them
inside ``trusted_indices()``: a bad value then reads or writes out of bounds
(a device fault), as in FlashAttention-2, instead of raising. The flag is
per thread, so one thread's trust never covers another's calls.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def trusted_indices() -> Iterator[None]:
    """Skip the value checks of the index tensors (KV cache indices, cu_seqlens) in this block, this thread."""
    saved = getattr(_local, "trusted", False)
    _local.trusted = True
    try:
        yield
    finally:
        _local.trusted = saved


def indices_trusted() -> bool:
    """True inside ``trusted_indices()`` on this thread."""
    return getattr(_local, "trusted", False)
