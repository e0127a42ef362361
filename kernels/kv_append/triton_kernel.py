"""The KV-cache append in Triton: ``kv_append_kernel`` writes new keys and values into a cache.

This file, with its helper ``kernels/rotary.py``, is the kernel's source
fingerprint. It imports triton: only ``lazytriton.compiler`` may import it.

One program per BLOCK_M rows of one sequence's (new key, key/value head)
pairs, row r = n * heads_k + h (new key n, head h: k's own order, so a
contiguous k is read in one sweep) x batch. Key n of sequence b lands at
position p = start_b + n, start_b = ``Seqlens[b]`` (``seqlen_const`` without
a Seqlens tensor): row r = ``BatchIdx[b]`` (or b) and slot p of a contiguous
cache, or block ``BlockTable[r, p // page_size]`` and slot ``p % page_size``
of a paged one (``PAGED``: r picks the sequence's row of the block table).
k's head dim is BLOCK_D wide (EVEN_D: no column mask), v's BLOCK_DV
(EVEN_DV). Nothing is read back: a plain copy, but for
``ROTARY``: key n is rotated on its way in (``rotary.rotate``, its first
``rotary_dim`` columns, ``ROTARY_INTERLEAVED`` pairs or halves) at position
base + n, base = ``RotarySeqlens[b]`` with ``use_rotary_seqlens``, else
start_b (FlashAttention's: the position the key is written at).

``KV_FP8`` (``e4m3`` or ``e5m2``; ``none``: a cache of k's dtype) writes a
float8 cache (KCache and VCache point at float8 bytes, typed as k's dtype
in the description): each key and value is divided by its sequence's and
head's descale (``KDescale``/``VDescale`` at batch x ``stride_kdb`` + head x
``stride_kdh``; 1.0 without ``use_k_descale``/``use_v_descale``) in float32,
correctly rounded, saturated to the format's finite range (NaN stays NaN),
and rounded to nearest, ties to even (``_quantise``); rotary keys are
rotated first, so the cache holds the rotated key / k_descale.

``VARLEN`` takes new keys packed by cu_seqlens_k_new (FlashAttention-3's):
k and v (total_new, heads_k, ...) with batch stride 0, the grid's batch 1,
and row r's sequence b the last one whose ``CuSeqlensKNew[b]`` <= its packed
key r // heads_k (``_sequence_of``: a binary search over the ``num_seqs``
starts); key n = r // heads_k - CuSeqlensKNew[b] of sequence b then lands as
above. An empty sequence is never found (its start is the next one's).

A position outside ``[0, capacity)``, a block outside ``[0, cache_rows)``
(num_blocks) or a cache row outside ``[0, cache_rows)`` (batch_cache) is not
written: index values nobody checked (the C API's device memory, a CUDA
graph's replays, ``trusted_indices``) cannot make the kernel write outside
the caches. Checked calls never have such values.

``PDL`` (a capability flag: the compile target sets it, ``spec.PDL_FROM``)
releases the kernel launched after it as soon as every program runs
(``gdc_launch_dependents``): the call's split kernel, where it is kv_append's
programmatic dependent (a rotary call's, or every call's with flash_decode's
``DEPENDENT_SPLIT``), then launches and starts while the cache is written (a
rotary one rotates its query meanwhile). A kernel launched plainly after it is
unaffected.
"""

import triton
import triton.language as tl

from lazytriton.kernels.rotary import rotate


@triton.jit
def _quantise(x, Descale, offsets, given, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    """X / descale in float32 (correctly rounded), saturated to +-FP8_MAX (NaN kept), rounded to ``dtype`` (RTNE).

    ``offsets``: each row's descale (read where ``given``, else 1.0).
    """
    # Float32 already on a GPU (the description's type); the interpreter types an absent descale's stand-in by k's.
    descale = tl.load(Descale + offsets, mask=(offsets * 0 + given) != 0, other=1.0).to(tl.float32)
    y = tl.math.div_rn(x.to(tl.float32), descale[:, None])
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    return y.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _sequence_of(Starts, key, num_seqs):
    """Each packed key's sequence: the last b in 0..num_seqs - 1 with Starts[b] <= key (Starts[0] is 0)."""
    seq = key * 0
    width = num_seqs
    while width > 1:
        half = width // 2
        take = tl.load(Starts + seq + half) <= key
        seq = tl.where(take, seq + half, seq)
        width -= half
    return seq


@triton.jit
def kv_append_kernel(
    K, V, KCache, VCache, Seqlens, BatchIdx, BlockTable, RotaryCos, RotarySin, RotarySeqlens, KDescale, VDescale,
    CuSeqlensKNew,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_tb, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    heads_k, seqlen_new, head_dim, head_dim_v, seqlen_const, use_seqlens, use_batch_idx, page_size, capacity,
    cache_rows, rotary_dim, seqlen_ro, use_rotary_seqlens, use_k_descale, use_v_descale, num_seqs,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr, PAGED: tl.constexpr = False, ROTARY: tl.constexpr = False,
    ROTARY_INTERLEAVED: tl.constexpr = False, KV_FP8: tl.constexpr = "none", VARLEN: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    if PDL:  # the split kernel may launch now: it waits for this grid's memory before it reads a key
        tl.extra.cuda.gdc_launch_dependents()
    if KV_FP8 == "e4m3":  # the description types the caches as k's dtype: the bytes are float8
        KCache = KCache.to(tl.pointer_type(tl.float8e4nv))
        VCache = VCache.to(tl.pointer_type(tl.float8e4nv))
    elif KV_FP8 == "e5m2":
        KCache = KCache.to(tl.pointer_type(tl.float8e5))
        VCache = VCache.to(tl.pointer_type(tl.float8e5))
    FP8_MAX: tl.constexpr = 448.0 if KV_FP8 == "e4m3" else 57344.0
    batch = tl.program_id(1)
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < seqlen_new * heads_k
    step = offs_r // heads_k
    head = offs_r % heads_k
    key = step  # the row of k and v (packed: of every sequence's new keys)
    if VARLEN:  # each row's sequence, a vector: the grid's batch is 1
        batch = _sequence_of(CuSeqlensKNew, key, num_seqs)
        step = key - tl.load(CuSeqlensKNew + batch)
    if use_seqlens != 0:
        start = tl.load(Seqlens + batch)
    else:
        start = batch * 0 + seqlen_const
    pos = start + step
    row_ok = row_ok & (pos >= 0) & (pos < capacity)
    if PAGED:
        table_row = batch
        if use_batch_idx != 0:
            table_row = tl.load(BatchIdx + batch)
        block = tl.load(BlockTable + table_row * stride_tb + pos // page_size, mask=row_ok, other=0)
        row_ok = row_ok & (block >= 0) & (block < cache_rows)
        slot = pos % page_size
        kc_rows = block * stride_kcb + slot * stride_kcs + head * stride_kch
        vc_rows = block * stride_vcb + slot * stride_vcs + head * stride_vch
    else:
        cache_row = batch
        if use_batch_idx != 0:
            cache_row = tl.load(BatchIdx + batch)
        row_of = tl.zeros([BLOCK_M], dtype=tl.int32) + cache_row  # a vector: the interpreter masks with no scalar
        row_ok = row_ok & (row_of >= 0) & (row_of < cache_rows)
        kc_rows = cache_row * stride_kcb + pos * stride_kcs + head * stride_kch
        vc_rows = cache_row * stride_vcb + pos * stride_vcs + head * stride_vch

    offs_d = tl.arange(0, BLOCK_D)
    k_rows = batch * stride_kb + key * stride_ks + head * stride_kh
    if EVEN_D:
        k_mask = row_ok[:, None]
    else:
        k_mask = row_ok[:, None] & (offs_d < head_dim)[None, :]
    k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=k_mask)
    if ROTARY:
        if use_rotary_seqlens != 0:
            start = tl.load(RotarySeqlens + batch)
        k = rotate(k, K + k_rows, row_ok, start + step, offs_d, RotaryCos, RotarySin, rotary_dim, seqlen_ro,
                   ROTARY_INTERLEAVED)
    if KV_FP8 != "none":
        k = _quantise(k, KDescale, batch * stride_kdb + head * stride_kdh, use_k_descale, FP8_MAX,
                      KCache.dtype.element_ty)
    tl.store(KCache + kc_rows[:, None] + offs_d[None, :], k, mask=k_mask)

    offs_dv = tl.arange(0, BLOCK_DV)
    v_rows = batch * stride_vb + key * stride_vs + head * stride_vh
    if EVEN_DV:
        v_mask = row_ok[:, None]
    else:
        v_mask = row_ok[:, None] & (offs_dv < head_dim_v)[None, :]
    v = tl.load(V + v_rows[:, None] + offs_dv[None, :], mask=v_mask)
    if KV_FP8 != "none":
        v = _quantise(v, VDescale, batch * stride_vdb + head * stride_vdh, use_v_descale, FP8_MAX,
                      VCache.dtype.element_ty)
    tl.store(VCache + vc_rows[:, None] + offs_dv[None, :], v, mask=v_mask)
