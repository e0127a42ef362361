"""The torch op of ``flash_attn_with_kvcache``: ``lazytriton::flash_kvcache``, with its fake twin.

``lazytriton::flash_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
cache_seqlens_int, cache_batch_idx, block_table, softmax_scale, causal,
window_left, window_right, softcap, alibi_slopes, num_splits,
cache_leftpad=None, rotary_cos=None, rotary_sin=None,
rotary_interleaved=True, rotary_seqlens=None, sinks=None, cu_seqlens_q=None,
max_seqlen_q=-1, attention_chunk=0, k_descale=None, v_descale=None, qv=None, cu_seqlens_k_new=None,
key_mask=None) -> (out, lse)``
takes FlashAttention's
layout and arguments
(``cache_seqlens`` as a tensor, or else ``cache_seqlens_int``: an int >= 0, -1
for None, the whole cache; ``max_seqlen_q`` -1 for None). It
writes k and v into k_cache and v_cache in place, so both caches are declared
mutated (``Tensor(a!)``): ``torch.compile`` functionalises the write and keeps
it ordered before the attention. A call without k and v goes to
``lazytriton::flash_kvcache_read`` (same arguments, nothing mutated), so a
compiled graph never copies a cache it only reads. Forward only. The fake
gives the exact shapes, dtypes and strides of the real outputs (both allocate
through ``binding.empty_outputs``). The ops' calls keep nothing on the device
(the fused combine's counters are each call's own: ``flash_decode/counters.py``
says why).

Registered on first use by ``lazytriton.kvcache`` (an eager call with nothing
tracing goes to the binding directly and never registers it).
"""

from __future__ import annotations

import torch

from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_decode import binding, checks

_SCHEMA = ("(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
           "int cache_seqlens_int, Tensor? cache_batch_idx, Tensor? block_table, float softmax_scale, bool causal, "
           "int window_left, int window_right, float softcap, Tensor? alibi_slopes, int num_splits, "
           "Tensor? cache_leftpad=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
           "bool rotary_interleaved=True, Tensor? rotary_seqlens=None, Tensor? sinks=None, "
           "Tensor? cu_seqlens_q=None, int max_seqlen_q=-1, int attention_chunk=0, Tensor? k_descale=None, "
           "Tensor? v_descale=None, Tensor? qv=None, Tensor? cu_seqlens_k_new=None, Tensor? key_mask=None) "
           "-> (Tensor, Tensor)")


def inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
           v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int,
           cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
           alibi_slopes: torch.Tensor | None, cache_leftpad: torch.Tensor | None = None,
           rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
           rotary_seqlens: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
           cu_seqlens_q: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
           v_descale: torch.Tensor | None = None, qv: torch.Tensor | None = None,
           cu_seqlens_k_new: torch.Tensor | None = None, key_mask: torch.Tensor | None = None) -> checks.Inputs:
    """The binding's ``Inputs`` from the op's arguments, the index tensors plain and contiguous.

    The kernels read the index tensors through their pointers: a strided
    view (``x[::2]``) is copied and a subclass read as the tensor it holds
    (``arguments.index_tensor``) before the checks, so the values checked are
    the values read.
    """
    lens: torch.Tensor | int | None = index_tensor(cache_seqlens)
    if lens is None and cache_seqlens_int >= 0:
        lens = cache_seqlens_int
    return checks.Inputs(q, k_cache, v_cache, k, v, lens, index_tensor(cache_batch_idx),  # type: ignore[arg-type]
                         index_tensor(block_table), index_tensor(alibi_slopes), index_tensor(cache_leftpad),
                         index_tensor(rotary_cos), index_tensor(rotary_sin), index_tensor(rotary_seqlens),
                         index_tensor(sinks), index_tensor(cu_seqlens_q), index_tensor(k_descale),
                         index_tensor(v_descale), qv, index_tensor(cu_seqlens_k_new), index_tensor(key_mask))


@torch.library.custom_op("lazytriton::flash_kvcache", mutates_args=("k_cache", "v_cache"), schema=_SCHEMA)
def flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int,
                  cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None, softmax_scale: float,
                  causal: bool, window_left: int, window_right: int, softcap: float,
                  alibi_slopes: torch.Tensor | None, num_splits: int,
                  cache_leftpad: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                  rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
                  rotary_seqlens: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                  cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int = -1,
                  attention_chunk: int = 0, k_descale: torch.Tensor | None = None,
                  v_descale: torch.Tensor | None = None,
                  qv: torch.Tensor | None = None,
                  cu_seqlens_k_new: torch.Tensor | None = None,
                  key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k/v to the cache, then attend: ``(out, lse)`` (checked again: the op can be called directly)."""
    t = inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table,
               alibi_slopes, cache_leftpad, rotary_cos, rotary_sin, rotary_seqlens, sinks, cu_seqlens_q,
               k_descale, v_descale, qv, cu_seqlens_k_new, key_mask)
    return _run(t, softmax_scale, causal, window_left, window_right, softcap, num_splits, rotary_interleaved,
                max_seqlen_q, attention_chunk)


def _run(t: checks.Inputs, softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
         num_splits: int, rotary_interleaved: bool, max_seqlen_q: int = -1,
         attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    call = checks.check(t, softmax_scale, causal, (window_left, window_right), softcap, num_splits,
                        rotary_interleaved, None if max_seqlen_q < 0 else max_seqlen_q, attention_chunk)
    # The op is what compiled graphs run, and cudagraph trees warm them up and record them with their allocations
    # in the graph's pool: the fused combine's counters are the call's own, never a buffer kept past it.
    return binding.forward(t, call, own_counters=True)


@flash_kvcache.register_fake
def _flash_kvcache_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                        v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int,
                        cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                        alibi_slopes: torch.Tensor | None, num_splits: int,
                        cache_leftpad: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                        rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
                        rotary_seqlens: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                        cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int = -1,
                        attention_chunk: int = 0, k_descale: torch.Tensor | None = None,
                        v_descale: torch.Tensor | None = None,
                        qv: torch.Tensor | None = None,
                        cu_seqlens_k_new: torch.Tensor | None = None,
                        key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty((*q.shape[:-1], v_cache.shape[-1]), dtype=q.dtype, device=q.device)  # v's head dim
    if cu_seqlens_q is not None:  # packed queries: lse (heads, total_q)
        return out, torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    return out, lse


_READ_SCHEMA = _SCHEMA.replace("Tensor(a!) k_cache, Tensor(b!) v_cache", "Tensor k_cache, Tensor v_cache")


@torch.library.custom_op("lazytriton::flash_kvcache_read", mutates_args=(), schema=_READ_SCHEMA)
def flash_kvcache_read(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                       v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int,
                       cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None, softmax_scale: float,
                       causal: bool, window_left: int, window_right: int, softcap: float,
                       alibi_slopes: torch.Tensor | None, num_splits: int,
                       cache_leftpad: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                       rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
                       rotary_seqlens: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                       cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int = -1,
                       attention_chunk: int = 0, k_descale: torch.Tensor | None = None,
                       v_descale: torch.Tensor | None = None,
                       qv: torch.Tensor | None = None,
                       cu_seqlens_k_new: torch.Tensor | None = None,
                       key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same call without new keys: nothing is written, so nothing is declared mutated.

    A compiled graph then needs no functional copy of the caches (declared
    mutable arguments are cloned by functionalisation when a backend cannot
    write in place, and a KV cache can be gigabytes).
    """
    if k is not None or v is not None or cu_seqlens_k_new is not None:
        raise ValueError("lazytriton::flash_kvcache_read takes no k/v; lazytriton::flash_kvcache appends them")
    t = inputs(q, k_cache, v_cache, None, None, cache_seqlens, cache_seqlens_int, cache_batch_idx, block_table,
               alibi_slopes, cache_leftpad, rotary_cos, rotary_sin, rotary_seqlens, sinks, cu_seqlens_q,
               k_descale, v_descale, qv, None, key_mask)
    return _run(t, softmax_scale, causal, window_left, window_right, softcap, num_splits, rotary_interleaved,
                max_seqlen_q, attention_chunk)


flash_kvcache_read.register_fake(_flash_kvcache_fake)

# The overloads themselves: calling them skips CustomOpDef's Python wrapper.
flash_kvcache_op = torch.ops.lazytriton.flash_kvcache.default
flash_kvcache_read_op = torch.ops.lazytriton.flash_kvcache_read.default
