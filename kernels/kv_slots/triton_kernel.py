"""The slot-addressed KV-cache write in Triton: ``kv_slots_kernel`` writes keys and values at their cache slots.

This file is the kernel's source fingerprint. It imports triton: only
``lazytriton.compiler`` may import it.

One program per BLOCK_M rows of (token, key/value head) pairs, row r = t *
heads_k + h (token t, head h: key's own order, so a packed key is read in one
sweep), x chunks of BLOCK_D head-dim columns. Token t lands at slot s =
``slot_mapping[t]`` (``Slots64`` with ``SLOT64``, else ``Slots32``; the other
pointer is never read): row ``s % block_size`` of block ``s // block_size``
of each cache. Keys are head_dim wide, values head_dim_v; a chunk past one's
width writes nothing of it (EVEN_D/EVEN_DV: the width is a multiple of
BLOCK_D, no column mask). Nothing is read back: a plain copy, bit for bit,
but for a float8 cache.

``KV_FP8`` (``e4m3`` or ``e5m2``; ``none``: a cache of key's dtype) writes a
float8 cache (KCache and VCache point at float8 bytes, typed as key's dtype
in the description): each key and value is divided by its tensor's descale
(``KDescale``/``VDescale``, one float32; 1.0 without ``use_k_descale``/
``use_v_descale``) in float32, correctly rounded, saturated to the format's
finite range (NaN stays NaN), and rounded to nearest, ties to even
(``_quantise``; ``flash_decode/kv_fp8.py``'s convention).

A slot outside ``[0, num_slots)`` (num_blocks x block_size) is not written:
negative slots are padding (vLLM's), and a slot past the cache, which nobody
checked (the slots are never read on the host), cannot make the kernel write
outside the caches.
"""

import triton
import triton.language as tl


@triton.jit
def _quantise(x, Descale, rows, given, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    """X / descale in float32 (correctly rounded), saturated to +-FP8_MAX (NaN kept), rounded to ``dtype`` (RTNE).

    ``rows``: the tile's row offsets (every row reads the one descale where ``given``, else takes 1.0).
    """
    # Float32 already on a GPU (the description's type); the interpreter types an absent descale's stand-in by key's.
    descale = tl.load(Descale + rows * 0, mask=(rows * 0 + given) != 0, other=1.0).to(tl.float32)
    y = tl.math.div_rn(x.to(tl.float32), descale[:, None])
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    return y.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def kv_slots_kernel(
    K, V, KCache, VCache, Slots32, Slots64, KDescale, VDescale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    heads_k, n_rows, head_dim, head_dim_v, block_size, num_slots, use_k_descale, use_v_descale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    SLOT64: tl.constexpr, KV_FP8: tl.constexpr = "none",
):
    if KV_FP8 == "e4m3":  # the description types the caches as key's dtype: the bytes are float8
        KCache = KCache.to(tl.pointer_type(tl.float8e4nv))
        VCache = VCache.to(tl.pointer_type(tl.float8e4nv))
    elif KV_FP8 == "e5m2":
        KCache = KCache.to(tl.pointer_type(tl.float8e5))
        VCache = VCache.to(tl.pointer_type(tl.float8e5))
    FP8_MAX: tl.constexpr = 448.0 if KV_FP8 == "e4m3" else 57344.0
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_D
    row_in = offs_r < n_rows
    token = offs_r // heads_k
    head = offs_r % heads_k
    if SLOT64:
        slot = tl.load(Slots64 + token, mask=row_in, other=-1)
    else:
        slot = tl.load(Slots32 + token, mask=row_in, other=-1)
    row_ok = row_in & (slot >= 0) & (slot < num_slots)
    slot = tl.where(row_ok, slot, 0)  # offsets in the slots' width, or the strides' where wider
    block = slot // block_size
    in_block = slot % block_size
    offs_d = col0 + tl.arange(0, BLOCK_D)

    if col0 < head_dim:
        if EVEN_D:
            k_mask = row_ok[:, None]
        else:
            k_mask = row_ok[:, None] & (offs_d < head_dim)[None, :]
        k_rows = token * stride_kt + head * stride_kh
        kc_rows = block * stride_kcb + in_block * stride_kcs + head * stride_kch
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=k_mask)
        if KV_FP8 != "none":
            k = _quantise(k, KDescale, offs_r, use_k_descale, FP8_MAX, KCache.dtype.element_ty)
        tl.store(KCache + kc_rows[:, None] + offs_d[None, :], k, mask=k_mask)

    if col0 < head_dim_v:
        if EVEN_DV:
            v_mask = row_ok[:, None]
        else:
            v_mask = row_ok[:, None] & (offs_d < head_dim_v)[None, :]
        v_rows = token * stride_vt + head * stride_vh
        vc_rows = block * stride_vcb + in_block * stride_vcs + head * stride_vch
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=v_mask)
        if KV_FP8 != "none":
            v = _quantise(v, VDescale, offs_r, use_v_descale, FP8_MAX, VCache.dtype.element_ty)
        tl.store(VCache + vc_rows[:, None] + offs_d[None, :], v, mask=v_mask)
