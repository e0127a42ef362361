"""FlashAttention-2's ``flash_attn.flash_attn_interface`` over lazytriton's public functions.

lazytriton's ``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` take
FlashAttention-2's parameters already; these wrappers fix FlashAttention-2's order and defaults
(``peer_signatures.FA2``) and add its packed forms, which split the packed tensor into views (gradients flow
back into it). ``return_attn_probs`` returns ``(out, softmax_lse, S_dmask)``: S_dmask is None without dropout, and
with dropout ``peer_s_dmask``'s (lazytriton's keep mask, replayed from the call's Philox pair, over probabilities
recomputed in float32), read by the peer's tests in one block of keys a row (``_get_block_size_n``). With
``block_table``, FlashAttention-2's ``cu_seqlens_k`` gives each sequence's key count: lazytriton's paged form takes
it as ``seqused_k`` (forward only: q, k and v go in detached).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import peer_s_dmask
import torch
from peer_shim_common import refuse

import lazytriton
from lazytriton.window import window_pair

USE_TRITON_ROCM = False


def _get_block_size_n(device: Any, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The keys of a block of S_dmask's running maximum: the whole row (``peer_s_dmask``)."""
    return peer_s_dmask.WHOLE_ROW


def _with_s_dmask(q: torch.Tensor, dropout_p: Any, return_attn_probs: Any, call: Any, s_dmask: Any) -> Any:
    """``call()``, with S_dmask (``s_dmask(philox)``) in place of lazytriton's None where the peer reads one."""
    if not (return_attn_probs is True and isinstance(dropout_p, float) and dropout_p > 0
            and isinstance(q, torch.Tensor)):
        return call()
    (out, lse, _), philox = peer_s_dmask.replayed(q.device, call)
    return out, lse, s_dmask(philox)


def _unbind(packed: torch.Tensor, name: str, dim: int, count: int) -> tuple[torch.Tensor, ...]:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() <= dim or packed.shape[dim] != count:
        raise ValueError(f"{name} must have {count} at dim {dim}, got shape {tuple(packed.shape)}")
    return packed.unbind(dim)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Any:
    """FlashAttention-2's ``flash_attn_func``: ``lazytriton.flash_attn_func``."""
    return _with_s_dmask(q, dropout_p, return_attn_probs, lambda: lazytriton.flash_attn_func(
        q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
        return_attn_probs=return_attn_probs), lambda philox: peer_s_dmask.dense(
        q, k, philox, dropout_p, softmax_scale, causal, window_pair(window_size), alibi_slopes))


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Any:
    """qkv (batch, seqlen, 3, heads, d)."""
    q, k, v = _unbind(qkv, "qkv", 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                             deterministic: bool = False, return_attn_probs: bool = False) -> Any:
    """kv (batch, seqlen_k, 2, heads_k, d)."""
    k, v = _unbind(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: torch.Tensor | None = None) -> Any:
    """FlashAttention-2's ``flash_attn_varlen_func``: ``lazytriton.flash_attn_varlen_func``."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, None)


def _varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
            dropout_p: Any, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any, alibi_slopes: Any,
            deterministic: Any, return_attn_probs: Any, block_table: Any, seqused_k: Any) -> Any:
    """The packed call, with S_dmask where the peer reads one (``_varlen_parts``)."""
    q, run, s_dmask = _varlen_parts(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                    return_attn_probs, block_table, seqused_k)
    return _with_s_dmask(q, dropout_p, return_attn_probs, run, s_dmask)


def _varlen_parts(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                  max_seqlen_k: Any, dropout_p: Any, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any,
                  alibi_slopes: Any, deterministic: Any, return_attn_probs: Any, block_table: Any,
                  seqused_k: Any) -> tuple[Any, Callable[[], Any], Callable[[torch.Tensor], torch.Tensor]]:
    """(q as called, the lazytriton call, S_dmask of its Philox pair).

    Paged (``block_table``), each sequence's key count is ``seqused_k``, else cu_seqlens_k's.
    """
    if block_table is not None and isinstance(cu_seqlens_k, torch.Tensor):  # the paged form's key counts
        if seqused_k is None:
            seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        cu_seqlens_k = None
        q, k, v = (t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    return q, lambda: lazytriton.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs,
        block_table=block_table, seqused_k=seqused_k), lambda philox: peer_s_dmask.packed(
        q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, philox, dropout_p, softmax_scale, causal,
        window_pair(window_size), alibi_slopes)


def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
                               block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
                               seqused_k: torch.Tensor | None = None, zero_tensors: bool = False,
                               num_splits: int = 0) -> tuple[Any, Any, Any, Any]:
    """FlashAttention-2's forward op: (out, softmax_lse, S_dmask, rng_state), its rule on ``num_splits``.

    FlashAttention-2 splits a paged call's keys only where it swaps one query's head groups into rows (one query,
    GQA, no window, no dropout, no ALiBi); elsewhere a paged call with ``num_splits`` > 1 is its error. lazytriton
    chooses its own splits, so num_splits changes nothing else. ``zero_tensors`` (zeroing the outputs first) changes
    no result. rng_state is dropout's [seed, offset] pair (zeros without dropout).
    """
    refuse("flash_attn_varlen_func", leftpad_k=leftpad_k)
    swapped = (max_seqlen_q == 1 and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
               and q.shape[-2] > k.shape[-2] and window_size_left < 0 and window_size_right < 0 and dropout_p == 0
               and alibi_slopes is None)
    if block_table is not None and not swapped and num_splits > 1:
        raise RuntimeError("num_splits > 1 is not supported for varlen paged KV")
    device = q.device if isinstance(q, torch.Tensor) else None
    q, run, s_dmask = _varlen_parts(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, (window_size_left, window_size_right), softcap,
                                    alibi_slopes, False, True, block_table, seqused_k)
    if isinstance(dropout_p, float) and dropout_p > 0 and device is not None:
        (out, lse, _), rng_state = peer_s_dmask.replayed(device, run)
        return out, lse, s_dmask(rng_state) if return_softmax else None, rng_state
    out, lse, _ = run()
    return out, lse, None, torch.zeros(2, dtype=torch.int64, device=device)


def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     dropout_p: float = 0.0, softmax_scale: float | None = None,
                                     causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Any:
    """qkv (total, 3, heads, d), one cu_seqlens for queries and keys."""
    q, k, v = _unbind(qkv, "qkv", 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: float | None = None,
                                    causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Any:
    """kv (total_k, 2, heads_k, d)."""
    k, v = _unbind(kv, "kv", 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False) -> Any:
    """FlashAttention-2's ``flash_attn_with_kvcache``: ``lazytriton.flash_attn_with_kvcache``."""
    return lazytriton.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits, return_softmax_lse=return_softmax_lse,
        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved)
