"""``flash_attn_varlen_func`` over a paged KV cache: vLLM's calling convention, served by the decoding kernels.

vLLM (v1) runs a batch of prefills and decodes as one call:
``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=..., max_seqlen_q=..., seqused_k=...,
max_seqlen_k=..., causal=True, block_table=..., cu_seqlens_k=None, ...)``. The queries are packed by
cu_seqlens_q, the keys read from the paged caches through the block table, each sequence's key count from
seqused_k. That is ``flash_attn_with_kvcache`` with ``cu_seqlens_q`` (the decoding family's packed-query path,
VARLEN_Q=true) and seqused_k as its cache_seqlens, which this module calls after checking the arguments only
this form has. Forward only, as in FlashAttention-3 (no backward through a paged cache). FlashAttention-3's qv
(DeepSeek's MLA) is taken here as ``flash_attn_with_kvcache`` takes it.

``lazytriton.interface.flash_attn_varlen_func`` routes a call with a block_table here; its docstring and this
function's say what each argument means.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import kvcache
from lazytriton.kernels.arguments import check_bool, check_dropout, shown
from lazytriton.kernels.flash_decode import checks
from lazytriton.kernels.flash_fwd import fp8
from lazytriton.kernels.flash_fwd import sinks as attention_sinks


def _requires_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def check_out(out: Any, q: Any, v: Any) -> None:
    """Refuse an ``out`` (vLLM's) that is not q's (total_q, heads, v's head dim), dtype and device.

    For float8_e4m3fn queries the dtype is the FP8 forward's output's, bfloat16 (FlashAttention-3 takes no other).
    """
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)):
        return  # the checks that follow name q or v
    want = (*q.shape[:-1], v.shape[-1])
    if tuple(out.shape) != want:
        raise ValueError(f"out must have shape {want} (q's, with v's head dim), got {tuple(out.shape)}")
    if fp8.is_fp8(q):
        if out.dtype != fp8.OUT_DTYPE or out.device != q.device:
            raise TypeError(f"out must be {fp8.OUT_DTYPE} on {q.device} (the FP8 forward's output, as "
                            f"FlashAttention-3's), got {out.dtype} on {out.device}")
    elif out.dtype != q.dtype or out.device != q.device:
        raise TypeError(f"out must be {q.dtype} on {q.device} (q's), got {out.dtype} on {out.device}")


def check_splits_and_out(num_splits: Any, out: Any, q: Any, v: Any) -> None:
    """The checks of num_splits and out, which a call without a block table takes too (FlashAttention-3's)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= checks.MAX_SPLITS:
        raise ValueError(f"num_splits must be in 0..{checks.MAX_SPLITS}, got {num_splits}")
    check_out(out, q, v)


def paged_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                 block_table: torch.Tensor | None, *, dropout_p: float = 0.0, softmax_scale: float | None = None,
                 causal: bool = False,
                 window_size: tuple[int, int] = checks.NO_WINDOW, softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                 return_attn_probs: bool = False, seqused_q: torch.Tensor | None = None,
                 seqused_k: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 s_aux: torch.Tensor | None = None, num_splits: int = 0,
                 out: torch.Tensor | None = None, attention_chunk: int = 0, q_descale: torch.Tensor | None = None,
                 k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                 qv: torch.Tensor | None = None) -> Any:
    """``flash_attn_varlen_func`` with a block table (or qv): q packed, k and v the paged caches (forward only).

    Args (those the paged form reads differently; the rest are ``flash_attn_with_kvcache``'s):
        q: (total_q, heads, head_dim), packed by cu_seqlens_q.
        k, v: the paged caches, (num_blocks, page_size, heads_k, head_dim) and v's head dim.
        cu_seqlens_q: int32 (batch + 1,): sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1.
        cu_seqlens_k: must be None (FlashAttention-3 and vLLM refuse both): seqused_k gives the key counts.
        max_seqlen_q: an int >= the longest sequence's query count (it sizes the grid).
        max_seqlen_k: an int >= 0 (the longest key count; the kernels take the lengths from seqused_k).
        block_table: int32 (batch, max_blocks_per_seq): each sequence's pages, in order.
        seqused_k: int32 (batch,), required: sequence b sees its first seqused_k[b] keys, its queries aligned
            bottom-right against them when causal.
        seqused_q: not taken with a block table (every query of cu_seqlens_q's spans is used).
        dropout_p: must be 0 (the decoding kernels have no dropout).
        num_splits: 0 lets the heuristic cut each sequence's keys; n >= 1 forces n (at most 256).
        out: optional (total_q, heads, head_dim_v) in q's dtype and device, sharing no memory with q, k or v:
            the kernels write the output there through its strides (vLLM's out=; a copy into it when its last dim
            is not contiguous) and it is returned.
        k_descale, v_descale: with float8 caches (torch.float8_e4m3fn or float8_e5m2; q float16 or bfloat16), as
            vLLM calls FlashAttention-3 on an fp8 KV cache: ``flash_attn_with_kvcache``'s (per tensor, per key/value
            head or per (batch, heads_k); the caches hold x / descale).
        q_descale: refused: the decoding kernels read float16 or bfloat16 queries, never float8 ones, so there is
            no q to descale (pass q unquantised with the float8 caches).
        qv: optional (total_q, heads, head_dim_v), FlashAttention-3's (DeepSeek's MLA): ``flash_attn_with_kvcache``'s
            qv, packed as q (scores (q . k + qv . v) x softmax_scale, default 1/sqrt(head_dim + head_dim_v)).

    Returns ``out``, or ``(out, softmax_lse (heads, total_q), None)`` with return_attn_probs.
    Every argument is checked before anything runs; a call that wants gradients (q, k, v or sinks requiring
    grad, grad mode on) is refused: there is no backward through a paged cache.
    """
    form = "block_table"  # what brought the call here, for the errors
    if cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_k must be None with block_table (FlashAttention-3 refuses both): the keys are "
                         "read from the paged cache and seqused_k gives each sequence's key count")
    if seqused_k is None:
        raise ValueError("block_table needs seqused_k: each sequence's key count in the paged cache")
    if seqused_q is not None:
        raise ValueError(f"seqused_q is not taken with {form}: every query of cu_seqlens_q's spans is used")
    if check_dropout("dropout_p", dropout_p) > 0.0:
        raise ValueError(f"dropout_p must be 0 with {form} (the decoding kernels read keys forward only, without "
                         f"dropout), got {dropout_p!r}")
    check_bool("deterministic", deterministic)
    check_bool("return_attn_probs", return_attn_probs)
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise TypeError(f"max_seqlen_k must be an int >= 0, got {shown(max_seqlen_k)}")
    if torch.is_grad_enabled() and any(_requires_grad(t) for t in (q, k, v, sinks, s_aux, qv)):
        raise ValueError(f"flash_attn_varlen_func with {form} is forward only (as FlashAttention-3): no "
                         "gradient flows through the decoding kernels; call it under torch.no_grad() or on tensors "
                         "that do not require grad")
    if q_descale is not None:
        raise ValueError(f"q_descale is not taken with {form}: the paged form reads float16 or bfloat16 queries "
                         "(the decoding kernels take no float8 q); pass q unquantised, with k_descale/v_descale for "
                         "float8 caches")
    if not isinstance(seqused_k, torch.Tensor):  # the kvcache form would take an int: this one does not
        raise TypeError(f"seqused_k must be an int32 tensor of shape (batch,), got {type(seqused_k).__name__}")
    t = kvcache.inputs(q, k, v, None, None, seqused_k, None, block_table, alibi_slopes, None, None, None, None,
                       attention_sinks.given(sinks, s_aux), cu_seqlens_q, k_descale, v_descale)._replace(qv=qv)
    options = kvcache.Options(softmax_scale, causal, window_size, softcap, num_splits, True, max_seqlen_q,
                              attention_chunk)
    res, lse = kvcache.serve(t, options, out, checks.PAGED_VARLEN)
    return (res, lse, None) if return_attn_probs else res

