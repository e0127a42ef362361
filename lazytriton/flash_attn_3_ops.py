"""FlashAttention-3's torch ops, ``torch.ops.flash_attn_3.*``, served by lazytriton.

Code written against FlashAttention-3's operators rather than its Python
functions (exported models, serving engines that call
``torch.ops.flash_attn_3.fwd`` directly) runs unchanged after ``register()``:
it defines ``flash_attn_3::fwd``, ``bwd``, ``fwd_combine`` and
``get_scheduler_metadata`` with FlashAttention-3's schemas (hopper/
``flash_api.cpp``), each implemented by the lazytriton call that FlashAttention-3's
own Python functions make of them:

- ``fwd``: a dense call (``flash_attn_func``), a packed one (``cu_seqlens_q``
  and ``cu_seqlens_k``: ``flash_attn_varlen_func``, ``page_table`` its
  block table), or a KV-cache call (no ``cu_seqlens_k``, and any of
  ``k_new``, ``page_table``, ``kv_batch_idx``, ``leftpad_k``, ``rotary_cos``
  or ``seqused_k`` with a 4-dimensional cache: ``flash_attn_with_kvcache``,
  ``seqused_k`` its cache_seqlens). Returns ``(out, softmax_lse, out_accum,
  softmax_lse_accum)``; the two accumulators, FlashAttention-3's split
  workspaces, are empty float32 tensors (lazytriton's splits keep theirs).
  Given ``out``, the result is written into it and it is returned.
- ``bwd``: the gradients of a dense or packed call from ``out`` and
  ``softmax_lse``; returns ``(dq, dk, dv, softmax_d, softmax_lse_log2,
  dq_accum, dk_accum, dv_accum)`` with softmax_d the rows' sum of dout x out,
  softmax_lse_log2 the logsumexp in base 2 (both float32, lse's shape), the
  accumulators empty. Given dq, dk or dv, the gradients are written into them.
- ``fwd_combine``: ``flash_attn_combine``.
- ``get_scheduler_metadata``: FlashAttention-3 precomputes its persistent
  scheduler's work split here; lazytriton's kernels need none, so it returns
  an empty int32 tensor, which ``fwd`` accepts as ``scheduler_metadata`` and
  does not read (its sizes are checked: none negative, num_heads a multiple
  of num_heads_k).

``num_splits``, ``pack_gqa`` and ``sm_margin`` are scheduling hints: ``num_splits``
reaches the KV-cache and packed calls, the others are not read. ``bwd``'s
``deterministic`` reaches a dense backward; a packed one is always bitwise
reproducible. An argument lazytriton cannot serve (``q_descale`` on a KV-cache
call, ``seqused_q`` or ``seqused_k`` on a dense call, new keys or rotary on a
packed call) raises ``NotImplementedError`` naming it. Not registered by ``import
lazytriton``: a real FlashAttention-3 install defines the same names, and
``register()`` leaves them to it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

FWD_SCHEMA = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, Tensor? q_v=None, "
    "Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, "
    "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
    "Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, Tensor? rotary_cos=None, "
    "Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, Tensor? k_descale=None, "
    "Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, "
    "int window_size_right=-1, int attention_chunk=0, float softcap=0., bool is_rotary_interleaved=False, "
    "Tensor? scheduler_metadata=None, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) "
    "-> (Tensor(out!), Tensor, Tensor, Tensor)")
BWD_SCHEMA = (
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(dq!)? dq=None, "
    "Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
    "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
    "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
    "float softcap=0., bool deterministic=False, int sm_margin=0) "
    "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)")
COMBINE_SCHEMA = ("fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
                  "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)")
METADATA_SCHEMA = (
    "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads, int num_heads_k, "
    "int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q=None, "
    "Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? leftpad_k=None, "
    "int? page_size=None, int max_seqlen_k_new=0, bool is_causal=False, int window_size_left=-1, "
    "int window_size_right=-1, int attention_chunk=0, bool has_softcap=False, int num_splits=0, "
    "bool? pack_gqa=None, int sm_margin=0) -> Tensor")
NAMESPACE = "flash_attn_3"
_LIBRARY: list[Any] = []  # the Library that defines the ops (kept alive: its ops go with it)


def defined(name: str) -> bool:
    """Whether ``torch.ops.flash_attn_3.<name>`` exists (ours, or a real FlashAttention-3's)."""
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> bool:
    """Define FlashAttention-3's four ops over lazytriton; False (nothing done) where ``fwd`` is already defined."""
    if _LIBRARY or defined("fwd"):
        return False
    lib = torch.library.Library(NAMESPACE, "DEF")
    for schema, name, impl, meta in ((FWD_SCHEMA, "fwd", _fwd, _fwd_meta), (BWD_SCHEMA, "bwd", _bwd, _bwd_meta),
                                     (COMBINE_SCHEMA, "fwd_combine", _combine, _combine_meta),
                                     (METADATA_SCHEMA, "get_scheduler_metadata", _metadata, _metadata)):
        lib.define(schema)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        lib.impl(name, meta, "Meta")
    _LIBRARY.append(lib)
    return True


def _refuse(name: str, value: Any, where: str) -> None:
    if value is not None:
        raise NotImplementedError(f"flash_attn_3::fwd: {name} is not served on {where} by lazytriton")


def _into(given: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, or ``given`` holding it (FlashAttention-3's optional output tensors)."""
    if given is None:
        return result
    if given.shape != result.shape:
        raise ValueError(f"flash_attn_3: an output of shape {tuple(given.shape)} given for {tuple(result.shape)}")
    return given.copy_(result)


def _is_kvcache(k: torch.Tensor, cu_seqlens_k: Any, k_new: Any, page_table: Any, kv_batch_idx: Any,
                leftpad_k: Any, rotary_cos: Any, seqused_k: Any) -> bool:
    """FlashAttention-3's ``flash_attn_with_kvcache`` call (its only user of these arguments without cu_seqlens_k)."""
    return cu_seqlens_k is None and (k_new is not None or kv_batch_idx is not None or leftpad_k is not None
                                     or rotary_cos is not None
                                     or ((page_table is not None or seqused_k is not None) and k.dim() == 4))


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor | None = None,
         v_new: torch.Tensor | None = None, q_v: torch.Tensor | None = None, out: torch.Tensor | None = None,
         cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
         cu_seqlens_k_new: torch.Tensor | None = None, seqused_q: torch.Tensor | None = None,
         seqused_k: torch.Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
         page_table: torch.Tensor | None = None, kv_batch_idx: torch.Tensor | None = None,
         leftpad_k: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
         rotary_sin: torch.Tensor | None = None, seqlens_rotary: torch.Tensor | None = None,
         q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
         v_descale: torch.Tensor | None = None, softmax_scale: float | None = None, is_causal: bool = False,
         window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
         is_rotary_interleaved: bool = False, scheduler_metadata: torch.Tensor | None = None, num_splits: int = 0,
         pack_gqa: bool | None = None, sm_margin: int = 0) -> tuple[torch.Tensor, ...]:
    import lazytriton

    window = (window_size_left, window_size_right)
    if _is_kvcache(k, cu_seqlens_k, k_new, page_table, kv_batch_idx, leftpad_k, rotary_cos, seqused_k):
        _refuse("q_descale", q_descale, "a KV-cache call")
        _refuse("seqused_q", seqused_q, "a KV-cache call")
        result, lse = lazytriton.flash_attn_with_kvcache(
            q, k, v, k_new, v_new, cache_seqlens=seqused_k, cache_batch_idx=kv_batch_idx, block_table=page_table,
            softmax_scale=softmax_scale, causal=is_causal, window_size=window, softcap=softcap,
            num_splits=num_splits, return_softmax_lse=True, cache_leftpad=leftpad_k, rotary_cos=rotary_cos,
            rotary_sin=rotary_sin, rotary_interleaved=is_rotary_interleaved, rotary_seqlens=seqlens_rotary,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, attention_chunk=attention_chunk,
            k_descale=k_descale, v_descale=v_descale, qv=q_v, cu_seqlens_k_new=cu_seqlens_k_new)
    else:
        for name, value in (("k_new", k_new), ("v_new", v_new), ("cu_seqlens_k_new", cu_seqlens_k_new),
                            ("kv_batch_idx", kv_batch_idx), ("leftpad_k", leftpad_k), ("rotary_cos", rotary_cos),
                            ("rotary_sin", rotary_sin), ("seqlens_rotary", seqlens_rotary)):
            _refuse(name, value, "a call without a KV cache")
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
                raise ValueError("flash_attn_3::fwd: packed sequences need cu_seqlens_q, cu_seqlens_k, max_seqlen_q "
                                 "and max_seqlen_k")
            result, lse, _ = lazytriton.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                causal=is_causal, window_size=window, softcap=softcap, return_attn_probs=True, seqused_q=seqused_q,
                seqused_k=seqused_k, block_table=page_table, num_splits=num_splits,
                attention_chunk=attention_chunk, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                qv=q_v)
        else:
            for name, value in (("seqused_q", seqused_q), ("seqused_k", seqused_k), ("page_table", page_table)):
                _refuse(name, value, "a dense call")
            result, lse, _ = lazytriton.flash_attn_func(
                q, k, v, softmax_scale=softmax_scale, causal=is_causal, window_size=window, softcap=softcap,
                return_attn_probs=True, attention_chunk=attention_chunk, q_descale=q_descale, k_descale=k_descale,
                v_descale=v_descale, qv=q_v)
    empty = q.new_empty(0, dtype=torch.float32)
    return _into(out, result), lse, empty, empty.clone()


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    """The output's dtype: q's, bfloat16 for a float8 q (FlashAttention-3's)."""
    return torch.bfloat16 if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else q.dtype


def _fwd_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor | None = None,
              v_new: torch.Tensor | None = None, q_v: torch.Tensor | None = None, out: torch.Tensor | None = None,
              cu_seqlens_q: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """The outputs' shapes: out (q's rows, v's head dim), lse (batch, heads, seqlen_q) or packed (heads, total_q)."""
    result = out if out is not None else q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=_out_dtype(q))
    if q.dim() == 3:  # packed queries
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    empty = q.new_empty(0, dtype=torch.float32)
    return result, lse, empty, empty.clone()


def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         softmax_lse: torch.Tensor, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
         dv: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
         cu_seqlens_k: torch.Tensor | None = None, seqused_q: torch.Tensor | None = None,
         seqused_k: torch.Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
         softmax_scale: float | None = None, is_causal: bool = False, window_size_left: int = -1,
         window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False,
         sm_margin: int = 0) -> tuple[torch.Tensor, ...]:
    from lazytriton import ops, ops_varlen

    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    window = (int(window_size_left), int(window_size_right))
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("flash_attn_3::bwd: packed sequences need cu_seqlens_q, cu_seqlens_k, max_seqlen_q "
                             "and max_seqlen_k")
        grads = ops_varlen.flash_varlen_bwd_op(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k, scale, bool(is_causal), *window,
                                               float(softcap), None, 0.0, None, seqused_q, seqused_k)
        d = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # (heads, total_q), lse's layout
    else:
        for name, value in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if value is not None:
                raise NotImplementedError(f"flash_attn_3::bwd: {name} is not served on a dense call by lazytriton")
        t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
        grads = [g.transpose(1, 2) for g in ops.flash_bwd_op(
            *t, softmax_lse, scale, "bottom_right" if is_causal else "none", *window, float(softcap), None, None,
            0.0, None, bool(deterministic), False, 0)[:3]]
        d = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    empty = q.new_empty(0, dtype=torch.float32)
    return (_into(dq, grads[0]), _into(dk, grads[1]), _into(dv, grads[2]), d.contiguous(),
            softmax_lse * (1.0 / math.log(2.0)), empty, empty.clone(), empty.clone())


def _bwd_meta(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
              dv: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    grads = [given if given is not None else torch.empty_like(t) for given, t in ((dq, q), (dk, k), (dv, v))]
    empty = q.new_empty(0, dtype=torch.float32)
    return (*grads, torch.empty_like(softmax_lse), torch.empty_like(softmax_lse), empty, empty.clone(),
            empty.clone())


def _combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    import lazytriton

    return lazytriton.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=out_dtype)


def _combine_meta(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_combine``'s outputs: out one split's shape, lse a transposed view as it returns it.

    out's dtype is ``out_dtype``, else out's, else float32; lse is lse_partial's shape less the splits.
    """
    dtype = out_dtype or (out.dtype if out is not None else torch.float32)
    result = out if out is not None else out_partial.new_empty(out_partial.shape[1:], dtype=dtype)
    shape = tuple(lse_partial.shape[1:])
    lse = lse_partial.new_empty((*shape[:-2], shape[-1], shape[-2]), dtype=torch.float32).transpose(-1, -2)
    return result, lse


def _metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads: int, num_heads_k: int,
              headdim: int, headdim_v: int, qkv_dtype: torch.dtype, seqused_k: torch.Tensor,
              *args: Any, **kwargs: Any) -> torch.Tensor:
    """An empty int32 tensor on seqused_k's device: lazytriton's kernels schedule themselves."""
    for name, value in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("num_heads", num_heads), ("num_heads_k", num_heads_k), ("headdim", headdim),
                        ("headdim_v", headdim_v)):
        if value < 0:
            raise ValueError(f"flash_attn_3::get_scheduler_metadata: {name} must be >= 0, got {value}")
    if num_heads_k == 0 or num_heads % num_heads_k:
        raise ValueError(f"flash_attn_3::get_scheduler_metadata: num_heads ({num_heads}) must be a multiple of "
                         f"num_heads_k ({num_heads_k})")
    return seqused_k.new_empty(0, dtype=torch.int32)
