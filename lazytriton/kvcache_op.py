"""The torch op of ``flash_attn_with_kvcache``: ``lazytriton::flash_kvcache``, with its fake twin.

``lazytriton::flash_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
cache_seqlens_int, cache_batch_idx, block_table, softmax_scale, causal,
window_left, window_right, softcap, alibi_slopes, num_splits) -> (out, lse)``
takes FlashAttention-2's layout and arguments (``cache_seqlens`` as a tensor,
or else ``cache_seqlens_int``: an int >= 0, -1 for None, the whole cache). It
writes k and v into k_cache and v_cache in place when they are given, so both
caches are declared mutated (``Tensor(a!)``): ``torch.compile`` functionalises
the write and keeps it ordered before the attention. Forward only. The fake
gives the exact shapes, dtypes and strides of the real outputs (both allocate
through ``binding.empty_outputs``).

Registered on first use by ``lazytriton.kvcache`` (an eager call with nothing
tracing goes to the binding directly and never registers it).
"""

from __future__ import annotations

import torch

from lazytriton.kernels.flash_decode import binding, checks

_SCHEMA = ("(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
           "int cache_seqlens_int, Tensor? cache_batch_idx, Tensor? block_table, float softmax_scale, bool causal, "
           "int window_left, int window_right, float softcap, Tensor? alibi_slopes, int num_splits) "
           "-> (Tensor, Tensor)")


def inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
           v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int,
           cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
           alibi_slopes: torch.Tensor | None) -> checks.Inputs:
    """The binding's ``Inputs`` from the op's arguments."""
    lens: torch.Tensor | int | None = cache_seqlens
    if lens is None and cache_seqlens_int >= 0:
        lens = cache_seqlens_int
    return checks.Inputs(q, k_cache, v_cache, k, v, lens, cache_batch_idx, block_table,  # type: ignore[arg-type]
                         alibi_slopes)


@torch.library.custom_op("lazytriton::flash_kvcache", mutates_args=("k_cache", "v_cache"), schema=_SCHEMA)
def flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int,
                  cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None, softmax_scale: float,
                  causal: bool, window_left: int, window_right: int, softcap: float,
                  alibi_slopes: torch.Tensor | None, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k/v to the cache, then attend: ``(out, lse)`` (checked again: the op can be called directly)."""
    t = inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table,
               alibi_slopes)
    call = checks.check(t, softmax_scale, causal, (window_left, window_right), softcap, num_splits)
    return binding.forward(t, call)


@flash_kvcache.register_fake
def _flash_kvcache_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                        v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int,
                        cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                        alibi_slopes: torch.Tensor | None, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    return out, lse


# The overload itself: calling it skips CustomOpDef's Python wrapper.
flash_kvcache_op = torch.ops.lazytriton.flash_kvcache.default
