"""Plain-PyTorch twin of the flash_decode kernels: ``flash_attn_with_kvcache`` as the tests compare against it.

One sequence at a time, written out the way FlashAttention-2's own test
states it (``test_flash_attn_kvcache``): the new keys and values land in the
cache at positions cache_seqlens .. cache_seqlens + seqlen_new - 1 of each
sequence (through its block table when paged); sequence b then has len_b =
cache_seqlens[b] + seqlen_new keys, gathered from its cache row (or its
blocks), and query i sees key j when j < len_b and, causal, j <= i + len_b -
seqlen_q, and, with a window, i + len_b - seqlen_q - left <= j <= i + len_b -
seqlen_q + right, and, with cache_leftpad, j >= cache_leftpad[b]. That last
bound is FlashAttention's ``key_leftpad`` worked out in absolute positions:
its reference shifts the key columns and seqlen_k by the pad (j - pad
against i + (len_b - pad) - seqlen_q), which leaves every other bound and
ALiBi's distance as they are without it. Scores are scaled, capped
(softcap), then ALiBi's -slope * |i + len_b - seqlen_q - j| is added
(FlashAttention-2's order). With rotary_cos and rotary_sin, FlashAttention's rotary embedding
(``flash_attn.layers.rotary.apply_rotary_emb``, written out in ``rotate``)
turns new key j of sequence b, at position base_b + j, before it lands, and
query i at base_b + i when causal or local (a window side in 0..capacity - 1,
FlashAttention-2's rule), else at base_b; base_b = rotary_seqlens[b], else
cache_seqlens[b] (absolute: cache_leftpad does not move it). Products run
in the inputs' dtype (float64 inputs give the float64 reference), the
softmax in float32 or float64; a query that sees no key gets 0 and lse -inf.
A float8 cache (``kv_fp8.py``: it holds x / descale) takes its new keys and
values as ``quantised`` writes them, and is read dequantised: each key of
sequence b and head h times k_descale's (b, h) entry, in q's dtype (exact in
float64). With ``key_mask`` ((batch, capacity) booleans, lazytriton's own:
``key_mask.py``), query i of sequence b also needs key_mask[b, j] to see key
j (SDPA's boolean mask: the score -inf, after the cap and ALiBi).
Nothing passed in is modified: the caches come back updated as copies.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _rows(batch_idx: torch.Tensor | None, b: int) -> int:
    """Sequence b's cache row, or its row of the block table with one."""
    return b if batch_idx is None else int(batch_idx[b])


def _positions(page_size: int, table: torch.Tensor | None, row: int, start: int, count: int
               ) -> tuple[list[int], list[int]]:
    """(cache row, slot) of key positions start .. start + count - 1 of the sequence of cache or table row ``row``."""
    positions = range(start, start + count)
    if table is None:
        return [row] * count, list(positions)
    return [int(table[row, p // page_size]) for p in positions], [p % page_size for p in positions]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """``x`` (n, heads, d) with its first 2 x cos.shape[1] columns rotated at ``positions`` (n,).

    FlashAttention's ``apply_rotary_emb``: pairs (0, 1), (2, 3)... when
    ``interleaved``, else column j with j + rotary_dim / 2; in float64 for
    float64 inputs, else in float32 rounded once to x's dtype (as
    FlashAttention's kernels and its Triton ``apply_rotary`` do).
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    dim = 2 * cos.shape[1]
    c, s = cos[positions].to(work)[:, None, :], sin[positions].to(work)[:, None, :]  # (n, 1, rotary_dim / 2)
    part = x[..., :dim].to(work)
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., :dim // 2], part[..., dim // 2:]
        turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., dim:]), dim=-1)


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def descales_of(descale: torch.Tensor | None, b: int, heads_k: int) -> torch.Tensor:
    """Sequence b's descale of each key/value head, float64 (heads_k,): per tensor, per head or per (batch, head)."""
    if descale is None:
        return torch.ones(heads_k, dtype=torch.float64)
    if descale.dim() == 2:
        return descale[b].double()
    return descale.double().reshape(-1).expand(heads_k) if descale.numel() == 1 else descale.double()


def quantised(x: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (..., heads_k, d) as a float8 cache of ``dtype`` holds it: x / descale (heads_k,), saturated, RTNE.

    In float32, as kv_append computes it; saturated first (torch's float8_e5m2 conversion does not saturate).
    """
    limit = FP8_MAX[dtype]
    return (x.float() / descale.float()[:, None]).clamp(-limit, limit).to(dtype)


def kvcache_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None = None,
                      v: torch.Tensor | None = None, cache_seqlens: torch.Tensor | int | None = None,
                      cache_batch_idx: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                      softmax_scale: float | None = None, causal: bool = False,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                      rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                      rotary_interleaved: bool = True, rotary_seqlens: torch.Tensor | None = None,
                      k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                      qv: torch.Tensor | None = None, key_mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, k_cache after the append, v_cache after it), in q's layout (batch, seqlen_q, heads, head_dim_v).

    v_cache (and v) may have a head dim of their own (head_dim_v); the scale defaults to 1/sqrt(q's head dim).
    A float8 cache is read dequantised (``k_descale``, ``v_descale``: None is 1.0) in q's dtype.
    ``qv`` (FlashAttention-3's, (batch, seqlen_q, heads, head_dim_v)) adds qv . v to the scores, and the scale's
    default is then 1/sqrt(head_dim + head_dim_v) (``hopper/test_util.py``'s ``attention_ref``).
    """
    batch, sq, hq, d = q.shape
    hk, dv = k_cache.shape[2], v_cache.shape[3]
    scale = 1.0 / math.sqrt(d + (0 if qv is None else dv)) if softmax_scale is None else softmax_scale
    page = k_cache.shape[1] if block_table is not None else 0
    capacity = block_table.shape[1] * page if block_table is not None else k_cache.shape[1]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    left, right = window_size
    per_query = causal or 0 <= left < capacity or 0 <= right < capacity
    new = 0 if k is None else k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros((batch, sq, hq, dv))
    lse = torch.full((batch, hq, sq), float("-inf"), dtype=torch.float32)
    for b in range(batch):
        if cache_seqlens is None:
            cached = capacity
        else:
            cached = int(cache_seqlens[b]) if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
        row = _rows(cache_batch_idx, b)
        queries = q[b]
        kd, vd = descales_of(k_descale, b, hk), descales_of(v_descale, b, hk)
        if k is not None and v is not None:
            keys_new = k[b]
            if rotary_cos is not None and rotary_sin is not None:
                base = cached if rotary_seqlens is None else int(rotary_seqlens[b])
                keys_new = rotate(keys_new, rotary_cos, rotary_sin, torch.arange(new) + base, rotary_interleaved)
                steps = torch.arange(sq) if per_query else torch.zeros(sq, dtype=torch.long)
                queries = rotate(queries, rotary_cos, rotary_sin, steps + base, rotary_interleaved)
            values_new = v[b]
            if k_cache.dtype in FP8_MAX:
                keys_new, values_new = quantised(keys_new, kd, k_cache.dtype), quantised(values_new, vd, v_cache.dtype)
            rows, slots = _positions(page, block_table, row, cached, new)
            for n, (r, s) in enumerate(zip(rows, slots, strict=True)):
                k_cache[r, s], v_cache[r, s] = keys_new[n], values_new[n]
        length = cached + new
        rows, slots = _positions(page, block_table, row, 0, length)
        keys = k_cache[rows, slots] if length else k_cache.new_zeros((0, hk, d))  # (length, hk, d)
        values = v_cache[rows, slots] if length else v_cache.new_zeros((0, hk, dv))
        if k_cache.dtype in FP8_MAX:  # dequantised: exact in float64, rounded once to q's dtype otherwise
            keys = (keys.double() * kd[:, None]).to(q.dtype)
            values = (values.double() * vd[:, None]).to(q.dtype)
        keys = keys.repeat_interleave(hq // hk, dim=1).transpose(0, 1)  # (hq, length, d)
        values = values.repeat_interleave(hq // hk, dim=1).transpose(0, 1)
        scores = queries.transpose(0, 1) @ keys.transpose(-1, -2)  # (hq, sq, length)
        if qv is not None:
            scores = scores + qv[b].transpose(0, 1) @ values.transpose(-1, -2)
        scores = scores.to(work) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        diag = torch.arange(sq)[:, None] + length - sq
        cols = torch.arange(length)[None, :]
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
            scores = scores - slopes.to(work)[:, None, None] * (diag - cols).abs().to(work)
        keep = torch.ones(sq, length, dtype=torch.bool)
        if causal or right >= 0:
            keep &= cols <= diag + (0 if causal else right)
        if left >= 0:
            keep &= cols >= diag - left
        if cache_leftpad is not None:
            keep &= cols >= int(cache_leftpad[b])
        if key_mask is not None:
            keep &= key_mask[b, :length].bool()[None, :]
        scores = scores.masked_fill(~keep, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # (hq, sq)
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[b] = (probs.to(values.dtype) @ values).transpose(0, 1).to(q.dtype)
        lse[b] = row_lse.float()
    return out, lse, k_cache, v_cache


def varlen_q_reference(q: torch.Tensor, cu_seqlens_q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                       cache_seqlens: torch.Tensor | int | None = None, cache_batch_idx: torch.Tensor | None = None,
                       block_table: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                       cache_leftpad: torch.Tensor | None = None, rotary_seqlens: torch.Tensor | None = None,
                       k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                       cu_seqlens_k_new: torch.Tensor | None = None, qv: torch.Tensor | None = None,
                       **options: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kvcache_reference`` of queries packed by cu_seqlens_q: (out, lse, k_cache, v_cache after the append).

    out is (total_q, heads, head_dim_v) and lse (heads, total_q).
    FlashAttention-3's varlen q, one sequence at a time: sequence b's queries,
    rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q, are a call of their
    own with that sequence's lengths, rows and slopes (the caches carried from
    one sequence's append to the next). With cu_seqlens_k_new (FlashAttention-3's),
    k and v are packed too: sequence b appends rows cu_seqlens_k_new[b] ..
    cu_seqlens_k_new[b + 1] - 1. ``qv`` (FlashAttention-3's, (total_q, heads,
    head_dim_v)) is packed as q.
    """
    total, hq = q.shape[:2]
    out = q.new_zeros((total, hq, v_cache.shape[3]))
    lse = torch.full((hq, total), float("-inf"), dtype=torch.float32)
    for b in range(cu_seqlens_q.shape[0] - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])

        def one(x: torch.Tensor | None, b: int = b) -> torch.Tensor | None:
            return x[b:b + 1] if x is not None else None

        lens = one(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        kd, vd = (d if d is None or d.dim() < 2 else d[b:b + 1] for d in (k_descale, v_descale))
        rows, table = one(cache_batch_idx), block_table if cache_batch_idx is not None else one(block_table)
        if cache_batch_idx is None and block_table is None:  # this sequence's row of the cache
            rows = torch.tensor([b], dtype=torch.int32)
        new_k, new_v = one(k), one(v)
        if cu_seqlens_k_new is not None and k is not None and v is not None:
            first, end = int(cu_seqlens_k_new[b]), int(cu_seqlens_k_new[b + 1])
            new_k, new_v = k[None, first:end], v[None, first:end]
        seq_out, seq_lse, k_cache, v_cache = kvcache_reference(
            q[None, lo:hi], k_cache, v_cache, new_k, new_v, lens, rows, table, alibi_slopes=slopes,
            cache_leftpad=one(cache_leftpad), rotary_seqlens=one(rotary_seqlens), k_descale=kd, v_descale=vd,
            qv=None if qv is None else qv[None, lo:hi], **options)
        out[lo:hi], lse[:, lo:hi] = seq_out[0], seq_lse[0]
    return out, lse, k_cache, v_cache
