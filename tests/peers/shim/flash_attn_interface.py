"""FlashAttention-3's ``flash_attn_interface`` module (hopper/) over lazytriton's public functions.

Each function takes FlashAttention-3's parameters, in its order and with its defaults
(``peer_signatures.FA3``), and calls the lazytriton function of the same name: FlashAttention-3's
``page_table`` is lazytriton's ``block_table``, and ``return_attn_probs`` returns ``(out, softmax_lse)`` as
FlashAttention-3 does. An argument lazytriton lacks raises ``peer_shim_common.MissingFeature``; the scheduling
hints are checked and not used (``peer_shim_common``), and ``flash_attn_with_kvcache``'s ``rotary_seqlens`` is
dropped without rotary tables (FlashAttention-3 reads it only with them; lazytriton refuses it alone). Every
other argument reaches lazytriton as the peer gave it, so lazytriton's own checks judge it. Importing it
registers FlashAttention-3's torch ops (``lazytriton.flash_attn_3_ops``), as FlashAttention-3's module does.
"""

from __future__ import annotations

from typing import Any

import torch
from peer_shim_common import MissingFeature, check_hints, refuse

import lazytriton
from lazytriton import flash_attn_3_ops

# FlashAttention-3's module loads its compiled ops (torch.ops.flash_attn_3.*) on import: these are lazytriton's.
flash_attn_3_ops.register()

__all__ = ["MissingFeature", "flash_attn_combine", "flash_attn_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "get_scheduler_metadata"]


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    causal: bool = False, qv: torch.Tensor | None = None, q_descale: torch.Tensor | None = None,
                    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                    window_size: Any = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                    num_splits: int = 1, pack_gqa: bool | None = None, deterministic: bool = False,
                    sm_margin: int = 0, return_attn_probs: bool = False) -> Any:
    """FlashAttention-3's ``flash_attn_func``: ``lazytriton.flash_attn_func``."""
    check_hints(num_splits, pack_gqa, sm_margin)
    res = lazytriton.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap, deterministic=deterministic,
                                     return_attn_probs=return_attn_probs, attention_chunk=attention_chunk,
                                     q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qv=qv)
    return tuple(res[:2]) if return_attn_probs else res


def flash_attn_qkvpacked_func(qkv: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                              q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                              v_descale: torch.Tensor | None = None, window_size: Any = (-1, -1),
                              attention_chunk: int = 0, softcap: float = 0.0, deterministic: bool = False,
                              num_heads_q: int | None = None, sm_margin: int = 0,
                              return_attn_probs: bool = False) -> Any:
    """FlashAttention-3's packed form: qkv (batch, seqlen, 3, heads, d), or (batch, seqlen, heads_q + 2 heads_k, d)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv of 5 dims must be (batch, seqlen, 3, heads, d), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(2)
    elif qkv.dim() == 4:
        if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int):
            raise TypeError("num_heads_q must be an int for qkv of 4 dims (batch, seqlen, heads_q + 2 heads_k, d)")
        heads_k = (qkv.shape[2] - num_heads_q) // 2
        if num_heads_q <= 0 or heads_k <= 0 or num_heads_q + 2 * heads_k != qkv.shape[2]:
            raise ValueError(f"num_heads_q={num_heads_q} does not split qkv's {qkv.shape[2]} heads into q, k, v")
        q, k, v = qkv.split([num_heads_q, heads_k, heads_k], dim=2)
    else:
        raise ValueError(f"qkv must have 4 or 5 dims, got shape {tuple(qkv.shape)}")
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                           attention_chunk=attention_chunk, softcap=softcap, deterministic=deterministic,
                           sm_margin=sm_margin, return_attn_probs=return_attn_probs)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = False, qv: torch.Tensor | None = None,
                           q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                           v_descale: torch.Tensor | None = None, window_size: Any = (-1, -1),
                           attention_chunk: int = 0, softcap: float = 0.0, num_splits: int = 1,
                           pack_gqa: bool | None = None, deterministic: bool = False, sm_margin: int = 0,
                           return_attn_probs: bool = False) -> Any:
    """FlashAttention-3's ``flash_attn_varlen_func``: ``lazytriton.flash_attn_varlen_func`` (num_splits passed on)."""
    check_hints(num_splits, pack_gqa, sm_margin)
    res = lazytriton.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs,
        seqused_q=seqused_q, seqused_k=seqused_k, num_splits=num_splits, attention_chunk=attention_chunk,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qv=qv)
    return tuple(res[:2]) if return_attn_probs else res


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-3's ``flash_attn_combine``: ``lazytriton.flash_attn_combine``."""
    return lazytriton.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=out_dtype)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            qv: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                            rotary_sin: torch.Tensor | None = None, cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                            page_table: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                            cu_seqlens_k_new: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                            rotary_seqlens: torch.Tensor | None = None, q_descale: torch.Tensor | None = None,
                            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                            attention_chunk: int = 0, softcap: float = 0.0, rotary_interleaved: bool = True,
                            scheduler_metadata: torch.Tensor | None = None, num_splits: int = 0,
                            pack_gqa: bool | None = None, sm_margin: int = 0,
                            return_softmax_lse: bool = False) -> Any:
    """FlashAttention-3's ``flash_attn_with_kvcache``: lazytriton's, page_table as its block_table."""
    refuse("flash_attn_with_kvcache", q_descale=q_descale)
    check_hints(0, pack_gqa, sm_margin)
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be None or a torch.Tensor, got {type(scheduler_metadata).__name__}")
    if rotary_cos is None:  # FlashAttention-3 reads rotary_seqlens only with rotary tables; lazytriton refuses it
        rotary_seqlens = None
    return lazytriton.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        block_table=page_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        num_splits=num_splits, return_softmax_lse=return_softmax_lse, cache_leftpad=cache_leftpad,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        rotary_seqlens=rotary_seqlens, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
        attention_chunk=attention_chunk, k_descale=k_descale, v_descale=v_descale, qv=qv,
        cu_seqlens_k_new=cu_seqlens_k_new)


def get_scheduler_metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_q: int,
                           num_heads_kv: int, headdim: int, cache_seqlens: torch.Tensor,
                           qkv_dtype: torch.dtype = torch.bfloat16, headdim_v: int | None = None,
                           cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k_new: torch.Tensor | None = None,
                           cache_leftpad: torch.Tensor | None = None, page_size: int | None = None,
                           max_seqlen_k_new: int = 0, causal: bool = False, window_size: Any = (-1, -1),
                           attention_chunk: int = 0, has_softcap: bool = False, num_splits: int = 0,
                           pack_gqa: bool | None = None, sm_margin: int = 0) -> torch.Tensor:
    """FlashAttention-3's precomputed schedule: lazytriton has none (its plan is memoised per shape class).

    Checks the sizes and returns an empty int32 tensor on cache_seqlens' device, which
    ``flash_attn_with_kvcache`` accepts as ``scheduler_metadata`` and does not read.
    """
    sizes = {"batch_size": batch_size, "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k,
             "num_heads_q": num_heads_q, "num_heads_kv": num_heads_kv, "headdim": headdim,
             "max_seqlen_k_new": max_seqlen_k_new}
    if headdim_v is not None:
        sizes["headdim_v"] = headdim_v
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor, got {type(cache_seqlens).__name__}")
    if not isinstance(qkv_dtype, torch.dtype):
        raise TypeError(f"qkv_dtype must be a torch.dtype, got {type(qkv_dtype).__name__}")
    check_hints(num_splits, pack_gqa, sm_margin)
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)
