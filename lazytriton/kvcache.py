"""``flash_attn_with_kvcache``: FlashAttention-2's decoding entry point, served from lazytriton's kernel cache.

Layering is the other entry points': this thin function checks its
arguments (a ``TypeError``/``ValueError`` naming the argument before
anything is written or launched), then calls the torch op
``lazytriton::flash_kvcache`` (``lazytriton.kvcache_op``), or, when nothing
is tracing, the binding (``kernels/flash_decode/binding.py``) directly.

``import lazytriton`` does not import this module (it imports torch): the
name is re-exported lazily by ``lazytriton/__init__.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.flash_decode import hot as decode_hot
from lazytriton.kernels.flash_fwd import sinks as attention_sinks
from lazytriton.kernels.trust import trusted_indices
from lazytriton.kvcache_fp8 import is_fp8, widened
from lazytriton.window import window_pair

_is_compiling = torch.compiler.is_compiling
_dispatch_mode = getattr(torch.utils._python_dispatch, "_get_current_dispatch_mode", lambda: None)
# How many dispatch modes are active (C, ~30 ns), as interface.py counts them for its warm path.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None) or (lambda: int(_dispatch_mode() is not None))
_Tensor = torch.Tensor
_NO_WINDOW = checks.NO_WINDOW


def _direct(*tensors: Any) -> bool:
    """True when the op's dispatch adds nothing: plain tensors, nothing tracing, no dispatch mode."""
    return (all(t is None or type(t) is _Tensor for t in tensors) and not _is_compiling()
            and _dispatch_mode() is None)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = checks.NO_WINDOW, softcap: float = 0.0,
                            alibi_slopes: torch.Tensor | None = None, num_splits: int = 0,
                            return_softmax_lse: bool = False, cache_leftpad: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                            rotary_interleaved: bool = True, rotary_seqlens: torch.Tensor | None = None,
                            sinks: torch.Tensor | None = None, s_aux: torch.Tensor | None = None,
                            cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                            attention_chunk: int = 0, k_descale: torch.Tensor | None = None,
                            v_descale: torch.Tensor | None = None, qv: torch.Tensor | None = None,
                            cu_seqlens_k_new: torch.Tensor | None = None, out: torch.Tensor | None = None) -> Any:
    """FlashAttention-2's ``flash_attn_with_kvcache`` (forward only), served from lazytriton's kernel cache.

    If k and v are given, they are first written into k_cache and v_cache *in
    place*, at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1
    of each sequence b (through its block table when paged); attention then
    runs over the cache's first cache_seqlens[b] + seqlen_new keys (from
    cache_leftpad[b] on, with cache_leftpad). The cache must be large enough
    to hold the new keys (pre-allocate it at the maximum length and track
    lengths with cache_seqlens).

    With rotary_cos and rotary_sin (FlashAttention's rotary embedding, inside
    the kernels), new key j of sequence b is rotated at position
    cache_seqlens[b] + j on its way into the cache, and q as the attention
    loads it: query i at cache_seqlens[b] + i when causal or local (a window
    side bounded within the cache), else every query at cache_seqlens[b].
    rotary_seqlens (FlashAttention-3's) replaces cache_seqlens as that base.
    Positions are absolute: cache_leftpad does not shift them.

    Args:
        q: (batch, seqlen_q, heads, head_dim), float16, bfloat16 or float32,
            any strides with a contiguous last dim. Or FlashAttention-3's
            FP8 call: q, the caches and k, v in one float8 dtype; q, qv, k, v
            and the rotary tables are then widened to bfloat16 (exactly) and
            out is bfloat16 (``lazytriton.kvcache_fp8``).
        k_cache: (batch_cache, seqlen_cache, heads_k, head_dim) without a
            block table, or (num_blocks, page_size, heads_k, head_dim) with
            one (a paged cache; page_size >= 1: pages of a multiple of 64
            keys read a key tile a page, any other size, such as 1 or 16
            keys a page, each key's page). heads must be a multiple of heads_k
            (GQA; heads_k = 1 is MQA). q's dtype and device.
        v_cache: like k_cache, but its head dim (head_dim_v, up to 512) may
            differ from q's and k's (DeepSeek's MLA: 192 and 128, or 64 and
            512 with qv); out then has v's. It may be a view of k_cache's
            first columns, v_cache = k_cache[..., :head_dim_v] (FlashMLA's
            and vLLM's latent cache: k_cache (num_blocks, page_size, 1, 576),
            v its first 512 columns, q (..., 576) = [q_nope | q_pe]; head_dim
            up to 768 in this form): read without a copy, each key's bytes
            once; the default scale is then 1/sqrt(head_dim). New keys into
            such a cache are one latent row: v must be k[..., :head_dim_v],
            and each column is written once; caches that share memory in any
            other way take no new keys (ValueError). This form takes no
            rotary embedding (FlashAttention's rotates q's and k's first
            columns, v's here) and no float8 cache.
        k: optional (batch, seqlen_new, heads_k, head_dim): new keys, written
            into k_cache at cache_seqlens (needs cache_seqlens).
        v: optional (batch, seqlen_new, heads_k, head_dim_v): new values,
            written into v_cache. On a GPU one kernel (kv_append) writes both,
            on the current stream, before the attention.
        cache_seqlens: an int, an int32 tensor (batch,), or None: each
            sequence's length in the cache before the new keys (None: the
            whole cache). cache_seqlens + seqlen_new must not pass the cache's
            end (seqlen_cache, or max_blocks_per_seq x page_size).
        cache_batch_idx: optional int32 (batch,): the row of a contiguous
            cache each sequence uses (default 0..batch-1; then batch_cache must
            equal batch), or with a block table the row of the table holding
            its blocks (FlashAttention-3's; the table may then have any
            number of rows). If rows repeat and k/v are given, which
            sequence's new keys a shared row keeps is undefined (as in
            FlashAttention).
        block_table: optional int32 (batch, max_blocks_per_seq), or
            (table_rows, max_blocks_per_seq) with cache_batch_idx: the cache
            blocks of each sequence, in order (a paged cache). Entries past
            a sequence's last key (and, with cache_leftpad, wholly before its
            first) are never read: they may hold anything, -1 included.
        softmax_scale: default 1/sqrt(head_dim).
        causal: aligned bottom-right: query i sees key j when j <= i +
            cache_seqlens + seqlen_new - seqlen_q. A query that sees no key
            outputs 0 (and lse -inf).
        window_size: (left, right), FlashAttention-2's sliding window: query i
            sees keys i + offset - left .. i + offset + right, offset =
            cache_seqlens + seqlen_new - seqlen_q; -1 leaves a side unbounded;
            causal sets right to 0. A list, or an integer tensor of two
            (FlashAttention-3's tests pass one), reads as the pair.
        softcap: if > 0, scores s (already scaled) become softcap * tanh(s /
            softcap) before the softmax.
        alibi_slopes: optional float32 (heads,) or (batch, heads): the bias
            -slope * |i + offset - j| is added to the (capped) score of query
            i and key j. This is FlashAttention-2's documented rule; out
            matches FlashAttention-2's with or without causal, and lse is that
            of the scores with this bias.
        num_splits: 0 lets a heuristic pick how many pieces each sequence's
            keys are cut into (FlashAttention-2's: enough programs to fill
            the GPU); n >= 1 forces n (1: no split; at most 256).
        return_softmax_lse: also return the float32 logsumexp of the scaled
            scores, (batch, heads, seqlen_q).
        cache_leftpad: optional int32 (batch,), FlashAttention's: the index
            where each sequence's cache starts (a left-padded batch). Sequence
            b's keys are then cache positions cache_leftpad[b] ..
            cache_seqlens[b] + seqlen_new - 1; new keys are still written at
            cache_seqlens[b], and positions stay absolute, so the causal
            mask, the window and ALiBi's distances are those of the call
            without it (keys before cache_leftpad[b] are simply not seen,
            nor read: the pad may hold anything). 0 <= cache_leftpad[b] <=
            cache_seqlens[b] (the whole cache's length without
            cache_seqlens); equal, a sequence sees its new keys only, none
            without them (out 0, lse -inf). With a block table, the pages
            wholly before cache_leftpad[b] are never read.
        rotary_cos: optional (seqlen_ro, rotary_dim / 2), q's dtype and
            device: the cosines of each position's angles. The first
            rotary_dim columns of q and of the new keys are rotated, the rest
            kept; rotary_dim may be any even width up to head_dim
            (FlashAttention asks for a multiple of 16). Needs k and v (as in
            FlashAttention) and rotary_sin; seqlen_ro must cover every
            position rotated (ValueError otherwise). Rotated in float32,
            rounded once to q's dtype, as FlashAttention's kernels do.
        rotary_sin: optional, rotary_cos's shape, dtype and device: the sines.
        rotary_interleaved: True (the default): pairs of columns (0, 1), (2,
            3), ...; False: column j with j + rotary_dim / 2 (GPT-NeoX's
            halves). Only read with rotary_cos.
        rotary_seqlens: optional int32 (batch,), FlashAttention-3's: each
            sequence's first rotary position, in place of cache_seqlens (the
            keys still land at cache_seqlens). Only with rotary_cos.
        sinks: optional float32 (heads,): attention sinks (gpt-oss's), one
            logit a query head, compared with the scaled (capped) scores: it
            joins every row's softmax denominator and lse once (with several
            splits, in their merge) and adds no value; a query that sees no
            key outputs 0 with lse the sink.
        s_aux: ``sinks``' other name (vLLM's FlashAttention-3 fork); pass one.
        cu_seqlens_q: optional int32 (batch + 1,), FlashAttention-3's: q is
            then (total_q, heads, head_dim), the queries of every sequence
            one after another (a serving engine's mixed batch of prefills and
            decodes in one call): sequence b's are rows cu_seqlens_q[b] ..
            cu_seqlens_q[b + 1] - 1, their own count seqlen_q_b aligning the
            causal mask, the window, ALiBi and rotary bottom-right (offset =
            cache_seqlens[b] + seqlen_new - seqlen_q_b); an empty sequence is
            allowed. cu_seqlens_q[0] must be 0, the entries nondecreasing and
            the last total_q. k and v (new keys) keep their (batch,
            seqlen_new, ...) form.
        max_seqlen_q: with cu_seqlens_q (needed then), an int >= the longest
            sequence's query count: it sizes the grid and picks the tiles.
        attention_chunk: FlashAttention-3's chunked local attention (Llama
            4's): if > 0, query i sees key j only when j // attention_chunk
            == (i + offset) // attention_chunk, on top of causal and the
            window; with cache_leftpad the chunks count from the sequence's
            first key (j - pad and i + offset - pad in place of j and i +
            offset, FlashAttention-3's rule). Key blocks outside every
            query's chunk are never read. Default 0 (off).
        k_descale: optional float32, FlashAttention-3's, with a float8
            k_cache (torch.float8_e4m3fn or torch.float8_e5m2, then v_cache
            too; q, k and v float16 or bfloat16): shape () or (1,) (per
            tensor), (heads_k,) (per key/value head) or (batch, heads_k) (per
            sequence b of q, whatever its cache row). The cache holds each key
            divided by its descale: the kernels read k_cache x k_descale
            (dequantised in registers, so decoding reads half the bytes of a
            16-bit cache), and new keys k are written as k / k_descale,
            computed in float32, saturated to the format's largest finite
            value (448 for e4m3, 57344 for e5m2) and rounded to nearest, ties
            to even (after the rotary embedding, with one). None: 1.0.
            Refused with a cache of q's dtype.
        v_descale: the same for v_cache and the new values v.
        qv: optional (batch, seqlen_q, heads, head_dim_v) ((total_q, heads,
            head_dim_v) with cu_seqlens_q), q's dtype and device,
            FlashAttention-3's (DeepSeek's MLA with the absorbed
            projections): the scores become (q . k + qv . v) x softmax_scale,
            whose default is then 1/sqrt(head_dim + head_dim_v). The kernel
            reads each V tile once for both products; q and qv are joined
            into one tensor first (a copy of the queries). Not with a float8
            cache, nor with v_cache = k_cache[..., :head_dim_v] (that form's q
            carries its qv).
        cu_seqlens_k_new: optional int32 (batch + 1,), FlashAttention-3's: k
            and v are then (total_new, heads_k, head_dim) and (total_new,
            heads_k, head_dim_v), the new keys of every sequence one after
            another: sequence b's are rows cu_seqlens_k_new[b] ..
            cu_seqlens_k_new[b + 1] - 1, n_b of them (0 allowed), written at
            cache_seqlens[b] .. cache_seqlens[b] + n_b - 1, and the attention
            covers cache_seqlens[b] + n_b keys (the offset of causal, the
            window, ALiBi and rotary uses that length). cu_seqlens_k_new[0]
            must be 0, the entries nondecreasing and the last total_new.
        out: optional, vLLM's: a tensor of out's shape, q's dtype and device,
            sharing no memory with q, k, v or the caches: the kernels write the
            output there through its strides (a copy into it when its last dim
            is not contiguous) and it is returned.

    Returns:
        out (batch, seqlen_q, heads, head_dim_v) in q's dtype, or (out,
        softmax_lse) with return_softmax_lse. With cu_seqlens_q, out is
        (total_q, heads, head_dim_v) and softmax_lse (heads, total_q)
        (FlashAttention-3's varlen layout).

    The index tensors (cache_seqlens, cache_batch_idx, block_table,
    alibi_slopes, cache_leftpad, rotary_seqlens) and the rotary tables are
    read as plain contiguous tensors: a strided view is copied first, a
    subclass read as the tensor it holds, so the values checked are the values
    the kernels read. Their values are checked too (a length past the cache's
    end, a block past the cache, a row past the cache, a left pad past the
    cached length, a rotary position past seqlen_ro raise ValueError, and
    nothing is written; so do cu_seqlens_q's against q and max_seqlen_q): on a GPU that costs
    one host synchronisation per call, skipped while a CUDA graph is being
    captured and inside ``lazytriton.kvcache.trusted_indices()``. CUDA/ROCm
    tensors run cached kernels (compiled on first use if no tier holds them);
    CPU tensors run the same kernels through Triton's interpreter (for
    checking results); torch.compile(fullgraph=True) traces the call through
    the op ``torch.ops.lazytriton.flash_kvcache``. Not differentiable.

    """
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
    # The warm path before the float8 test: it declines a float8 q at its key, before anything that could raise (no
    # entry is made for one; the widened call reads a float8 cache, the general path's), so its errors stay widened's.
    if (cache_batch_idx is None and alibi_slopes is None and cache_leftpad is None and rotary_cos is None
            and rotary_sin is None and rotary_seqlens is None and sinks is None and s_aux is None
            and cu_seqlens_q is None and max_seqlen_q is None and k_descale is None and v_descale is None
            and qv is None and cu_seqlens_k_new is None and type(softcap) is float and softcap == 0.0
            and type(attention_chunk) is int and attention_chunk == 0 and (window_size is _NO_WINDOW or (
                type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
                and type(window_size[1]) is int and window_size == _NO_WINDOW))
            and not _is_compiling() and not _dispatch_modes()):
        warm = decode_hot.serve(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                                num_splits, rotary_interleaved, return_softmax_lse, out)  # the common call, warm
        if warm is not None:
            return warm
    if is_fp8(q):  # FlashAttention-3's FP8 call: q, qv, the new keys and the rotary tables widened to bfloat16
        q, qv, k, v, rotary_cos, rotary_sin = widened(q, k_cache, qv=qv, k=k, v=v, rotary_cos=rotary_cos,
                                                      rotary_sin=rotary_sin)
    window_size = window_size if window_size is checks.NO_WINDOW else window_pair(window_size)
    t = inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes, cache_leftpad,
               rotary_cos, rotary_sin, rotary_seqlens, attention_sinks.given(sinks, s_aux), cu_seqlens_q, k_descale,
               v_descale, None, cu_seqlens_k_new)._replace(qv=qv)  # qv as given: a data tensor, checked as such
    res, lse = serve(t, Options(softmax_scale, causal, window_size, softcap, num_splits, rotary_interleaved,
                                max_seqlen_q, attention_chunk), out)
    return (res, lse) if return_softmax_lse else res


def with_key_mask(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_mask: torch.Tensor,
                  k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                  cache_seqlens: torch.Tensor | int | None = None, block_table: torch.Tensor | None = None,
                  softmax_scale: float | None = None, causal: bool = False, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None, num_splits: int = 0,
                  return_softmax_lse: bool = False) -> Any:
    """``flash_attn_with_kvcache`` under a per-(batch, key) boolean mask: lazytriton's own, not FlashAttention's.

    ``key_mask``: (batch, capacity) torch.bool or torch.uint8 on q's device, any strides, True (nonzero) where
    sequence b sees key position j: SDPA's boolean mask (``kernels/flash_decode/key_mask.py``: a masked key's
    score is -inf after the cap; a sequence whose keys are all masked gets out 0). The other arguments are
    ``flash_attn_with_kvcache``'s. Nothing is read back to the host for the mask (its values need no check).
    Under ``torch.compile``, a tensor subclass or a dispatch mode the call goes through the torch op
    (``lazytriton::flash_kvcache``/``flash_kvcache_read``, ``key_mask`` argument), as
    ``flash_attn_with_kvcache`` does. Eager calls without softcap or sinks are served by the warm path
    (``kernels/flash_decode/hot.py``) once their shape is planned.
    """
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
    if sinks is None and type(softcap) is float and softcap == 0.0 and not _is_compiling() and not _dispatch_modes():
        warm = decode_hot.serve(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                                num_splits, True, return_softmax_lse, None, key_mask)
        if warm is not None:
            return warm
    t = inputs(q, k_cache, v_cache, k, v, cache_seqlens, None, block_table, None, None, None, None, None,
               sinks)._replace(key_mask=key_mask)
    res, lse = serve(t, Options(softmax_scale, causal, checks.NO_WINDOW, softcap, num_splits))
    return (res, lse) if return_softmax_lse else res


class Options(NamedTuple):
    """The call's options, in ``checks.check``'s order (the caller's values, unchecked)."""

    softmax_scale: Any = None
    causal: Any = False
    window_size: Any = checks.NO_WINDOW
    softcap: Any = 0.0
    num_splits: Any = 0
    rotary_interleaved: Any = True
    max_seqlen_q: Any = None
    attention_chunk: Any = 0


def inputs(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, cache_seqlens: Any = None,
           *index: Any) -> checks.Inputs:
    """``checks.Inputs`` of the call, in its order, the index tensors plain and contiguous (``index_tensor``).

    The kernels read them through their pointers: a strided view is copied, a subclass read as the tensor it
    holds, before the checks, so the values checked are the values read.
    """
    return checks.Inputs(q, k_cache, v_cache, k, v, index_tensor(cache_seqlens), *map(index_tensor, index))


def serve(t: checks.Inputs, options: Options, out: torch.Tensor | None = None,
          names: checks.Names = checks.KVCACHE) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call: checked (errors naming the arguments by ``names``), then the binding or the op."""
    call = checks.check(t, *options, names=names)
    checks.check_out(out, t, call, names)
    lens = t.cache_seqlens
    index_tensors = (lens if isinstance(lens, torch.Tensor) else None, t.cache_batch_idx, t.block_table,
                     t.alibi_slopes, t.cache_leftpad, t.sinks)
    rotary = (t.rotary_cos, t.rotary_sin, t.rotary_seqlens)
    descales = (t.k_descale, t.v_descale)
    if _direct(t.q, t.k_cache, t.v_cache, t.k, t.v, *index_tensors, *rotary, t.cu_seqlens_q, *descales, t.qv,
               t.cu_seqlens_k_new, t.key_mask, out):
        return binding.forward(t, call, out, names)
    from lazytriton.kvcache_op import flash_kvcache_op, flash_kvcache_read_op

    op = flash_kvcache_read_op if t.k is None else flash_kvcache_op  # a read declares no mutation
    window, fp8 = options.window_size, call.kv_fp8 != "none"
    lens_int = -1 if lens is None or isinstance(lens, torch.Tensor) else int(lens)
    res, lse = op(t.q, t.k_cache, t.v_cache, t.k, t.v, index_tensors[0], lens_int, t.cache_batch_idx, t.block_table,
                  call.scale, options.causal, window[0], window[1], float(options.softcap), t.alibi_slopes,
                  options.num_splits, t.cache_leftpad, *rotary[:2], options.rotary_interleaved, rotary[2], t.sinks,
                  *((t.cu_seqlens_q, call.seqlen_q if call.varlen_q else -1)
                    if call.varlen_q or call.chunked or fp8 else ()),
                  *((call.attention_chunk,) if call.chunked or fp8 else ()), *(descales if fp8 else ()),
                  **({"qv": t.qv} if t.qv is not None else {}),
                  **({"cu_seqlens_k_new": t.cu_seqlens_k_new} if call.varlen_new else {}),
                  **({"key_mask": t.key_mask} if t.key_mask is not None else {}))
    return (res, lse) if out is None else (out.copy_(res), lse)  # the op returns new tensors: one copy


__all__ = ["Options", "flash_attn_with_kvcache", "inputs", "serve", "trusted_indices", "with_key_mask"]
