"""FlashAttention-2 backward in Triton: the two kernels of ``flash_bwd``.

This file is the source fingerprint of both kernels, so everything they call
lives here. It imports triton: only ``lazytriton.compiler`` may import it.

Layout and conventions are the forward's (``flash_fwd/triton_kernel.py``):
tensors (B, H, S, D) with any strides and a contiguous last dim; query head h
reads key/value head h // group_size; key j is visible to query i when
``j <= i + causal_offset`` (causal only). ``Lse`` is the forward's natural-log
logsumexp, (B, Hq, Sq) float32; a row that saw no key has -inf there and gets
zero gradients.

The gradient is split in two kernels, each owning the rows it writes, so no
float atomics are used and every run gives bitwise-identical gradients:

- ``flash_bwd_dq_kernel``, one program per query block: first
  ``delta = rowsum(dO * O)`` (stored for the second kernel), then
  ``dQ = scale * sum_j dS_ij K_j`` over the visible key blocks;
- ``flash_bwd_dkdv_kernel``, one program per key block of one key/value head:
  ``dV = sum_i P_ij dO_i`` and ``dK = scale * sum_i dS_ij Q_i`` over the
  visible query blocks of every query head of its group (GQA/MQA sums in the
  kernel, in a fixed order).

with ``P = exp(scale * Q K^T - lse)`` and ``dS = P * (dO V^T - delta)``.
``WINDOW`` and ``SOFTCAP`` are the forward's (``flash_fwd/triton_kernel.py``):
the same visibility rule and loop bounds (query blocks outside a key block's
window are skipped in dK/dV), and with a cap ``S = softcap * tanh(scale * Q
K^T / softcap)``, whose derivative multiplies dS by ``1 - tanh^2``.
``CHUNK`` (``attention_chunk``) is the forward's too: dQ bounds and masks each
row by its chunk as the forward does; dK/dV bounds and masks each key by the
queries of its chunk, a window of the key's own.
``ALIBI`` and ``BIAS`` add the forward's terms to the scores (no gradient of
their own); ``DROPOUT`` regenerates the forward's mask Z from the same
``Philox`` tensor and applies FlashAttention-2's formulas: ``dV = (P Z / (1 -
p))^T dO``, ``dP = (dO V^T) Z / (1 - p)``, ``dS = P (dP - delta)`` with delta
= rowsum(dO * O) of the dropped output.
``BIAS_GRAD`` (with ``BIAS``, dense calls; dQ's kernel only) stores the bias's
gradient: dS = P (dP - delta) itself, before a cap's factor (the bias is added
after the cap), each (query block, key block) tile of it once, from the tile
dQ's loop computes anyway, into ``DBias`` (batch, heads_q, seqlen_q, seqlen_k),
contiguous in its last dim; tiles the loop skips (causal, window) are not
written.
``SEQUSED_Q``/``SEQUSED_K`` (with ``VARLEN``) are the forward's used lengths:
queries and keys past them are never read; dQ rows past seqused_q are 0 (their
lse reads as +inf, so P = 0) and dK/dV rows past seqused_k are zeroed, both
stored to the span's end (the grids cover the spans), a block of unused rows or
keys only visiting nothing.
``BLOCK_DV``/``EVEN_DV`` and ``head_dim_v`` are the forward's: v, out, dO and
dV have v's head dim, q, k, dQ and dK have q's.
``BLOCK_D2`` > 0 is the forward's split tiles (0, the default, pads): a head
dim that is not a power of two held as two power-of-two chunks, BLOCK_D whole
then BLOCK_D2 masked at head_dim unless EVEN_D (96 = 64 + 32, 72 = 64 + 16).
Every tensor's head dim is split alike (v's equals q's there): scores are q k^T
+ q2 k2^T, dP is dO V^T + dO2 V2^T, and dQ, dK, dV each have two accumulators
(``_dq_block_split``, ``_dkdv_block_split``). Off, they compile away: with
Triton 3.9 for sm_90, the PTX of padded variants (hd 96, 128, and 72 with
window, softcap and dropout; both kernels) has the same instructions in the
same order as before split tiles, apart from register numbers and debug
information.
The price of determinism is one more pair of matrix products than a fused
kernel with atomic dQ (7 instead of 5): measured in benchmarks/NOTES.md.
"""

import triton
import triton.language as tl

from lazytriton.kernels.chunk import row_chunks

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """The hyperbolic tangent through exp2 (exactly +-1 for large |x|): no libdevice, so the interpreter runs it."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _scores(qk, qk_scale, cap, SOFTCAP: tl.constexpr):
    """Base-2 scores of the raw products qk, and the factor dS gets from the cap (1 - tanh^2; 1 without)."""
    qk = qk * qk_scale
    if SOFTCAP:
        t = _tanh(qk)
        qk = t * cap
        grad = 1.0 - t * t
    else:
        grad = 1.0
    return qk, grad


@triton.jit
def _scales(sm_scale, softcap, SOFTCAP: tl.constexpr):
    """(qk_scale, cap): scale * log2(e) and unused; with a cap, scale / softcap and softcap * log2(e)."""
    if SOFTCAP:
        qk_scale = sm_scale / softcap
        cap = softcap * LOG2E
    else:
        qk_scale = sm_scale * LOG2E
        cap = qk_scale
    return qk_scale, cap


@triton.jit
def _window_range(start, window_lo, window_hi, end, full_end, BLOCK: tl.constexpr,
                  TILE: tl.constexpr):
    """Tile bounds (begin, full_begin, full_end, end) of the other axis seen by ``TILE`` rows from ``start``.

    Along the streamed axis, position x is seen by row r when r + lo <= x <= r + hi
    (lo, hi: the window's edges relative to r): blocks of BLOCK below ``begin`` and
    from ``end`` on are seen by no row; those in [full_begin, full_end) by every row.
    """
    begin = (tl.maximum(start + window_lo, 0) // BLOCK) * BLOCK
    full_begin = tl.maximum(start + TILE - 1 + window_lo, 0)
    full_begin = ((full_begin + BLOCK - 1) // BLOCK) * BLOCK
    end = tl.minimum(end, tl.maximum(start + TILE + window_hi, 0))
    full_end = tl.minimum(full_end, (tl.maximum(start + window_hi + 1, 0) // BLOCK) * BLOCK)
    full_end = tl.maximum(tl.minimum(full_end, end), begin)
    full_begin = tl.minimum(tl.maximum(full_begin, begin), full_end)
    return begin, full_begin, full_end, end


@triton.jit
def _mods(Alibi, Bias, Philox, batch, head, rows, lse_base, drop_k, drop_col, stride_alibi_b, stride_biasb,
          stride_biash, stride_biasm, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    """(slope * log2 e, bias row pointers, Philox seed, dropout row offsets) for ``rows`` of one (batch, query head).

    The forward's (``flash_fwd/triton_kernel.py``): rows is [M, 1] (dQ) or [1, M]
    (dK/dV, transposed); zeros for what is off. ``batch`` is the sequence (a
    varlen call's too); dropout's index of (row, 0) is offset + (lse_base + row)
    * drop_k + drop_col, the forward's (the packed scores' with VARLEN).
    """
    slope2 = 0.0
    bias_rows = Bias
    seed = 0
    drop_rows = 0
    if ALIBI:
        slope2 = tl.load(Alibi + batch * stride_alibi_b + head) * LOG2E
    if BIAS:
        bias_rows = (Bias + batch.to(tl.int64) * stride_biasb + head.to(tl.int64) * stride_biash
                     + rows.to(tl.int64) * stride_biasm)
    if DROPOUT:
        seed = tl.load(Philox)
        drop_rows = tl.load(Philox + 1) + (lse_base.to(tl.int64) + rows.to(tl.int64)) * drop_k + drop_col
    return slope2, bias_rows, seed, drop_rows


@triton.jit
def _modified(qk, rows, cols, seqlen_q, seqlen_k, slope2, bias_rows, stride_bn, ALIBI: tl.constexpr,
              BIAS: tl.constexpr):
    """The forward's: base-2 scores plus ALiBi's ``-slope * |i + seqlen_k - seqlen_q - j|`` and the bias (x log2 e)."""
    if ALIBI:
        qk = qk - slope2 * tl.abs(rows + (seqlen_k - seqlen_q) - cols).to(tl.float32)
    if BIAS:
        bias = tl.load(bias_rows + cols * stride_bn, mask=(rows < seqlen_q) & (cols < seqlen_k), other=0.0)
        qk = qk + bias.to(tl.float32) * LOG2E
    return qk


@triton.jit
def _kept(seed, drop_rows, cols, dropout_p):
    """The forward's dropout keep mask, regenerated (``flash_fwd/triton_kernel.py``'s ``_kept``).

    Element drop_rows + cols of curand's Philox4_32_10 stream for ``seed``, as ``curand_uniform`` makes it a
    float, above p.
    """
    n = drop_rows + cols
    w0, w1, w2, w3 = tl.randint4x(seed, n >> 2)
    word = n & 3
    x = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    return x.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10 > dropout_p


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """A @ b + acc: IEEE float32 products for fp32 inputs (tf32 would lose their precision)."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _load_tile(ptrs, rows_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A (rows, BLOCK_D) tile; rows past the end and padded head dims read as 0."""
    if MASK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return tile


@triton.jit
def _store_tile(ptrs, tile, rows_ok, d_ok, EVEN_D: tl.constexpr):
    if EVEN_D:
        tl.store(ptrs, tile, mask=rows_ok[:, None])
    else:
        tl.store(ptrs, tile, mask=rows_ok[:, None] & d_ok[None, :])


@triton.jit
def _lse_log2(Lse, rows, rows_ok):
    """The forward's logsumexp in base 2, +inf for rows past the end or that saw no key (so P = 0 there)."""
    lse = tl.load(Lse + rows, mask=rows_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse * LOG2E


@triton.jit
def _dq_probs(
    qk, cols, col_ok, offs_m, lse2, seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    BIAS: tl.constexpr,
):
    """(P, the cap's factor of dS) of the raw products ``qk`` = Q K^T of keys ``cols`` (both chunks' with BLOCK_D2)."""
    seqlen_q, slope2, bias_rows, stride_bn, seed, drop_rows, dropout_p, dbias_rows = mods
    qk, grad = _scores(qk, qk_scale, cap, SOFTCAP)
    if ALIBI or BIAS:
        qk = _modified(qk, offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, slope2, bias_rows, stride_bn, ALIBI,
                       BIAS)
    if MASKED:
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
        if WINDOW:
            keep = keep & (cols[None, :] >= offs_m[:, None] + causal_offset - window_left)
            keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset + window_right)
        qk = tl.where(keep, qk, float("-inf"))
    return tl.math.exp2(qk - lse2[:, None]), grad


@triton.jit
def _dq_ds(p, grad, dp, delta, rows, cols, seqlen_k, mods, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
           BIAS_GRAD: tl.constexpr):
    """The gradient of the scores, dS = P * (dP - delta) (times the cap's factor), from the raw dP = dO V^T.

    With BIAS_GRAD, dS before the cap's factor is also stored as the bias's
    gradient at (rows, cols) (``mods``' last item: DBias's row pointers).
    """
    seqlen_q, slope2, bias_rows, stride_bn, seed, drop_rows, dropout_p, dbias_rows = mods
    if DROPOUT:  # dP = (dO V^T) * Z / (1 - p)
        dp = tl.where(_kept(seed, drop_rows, cols[None, :], dropout_p), dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    if BIAS_GRAD:
        tl.store(dbias_rows + cols[None, :], ds.to(dbias_rows.dtype.element_ty),
                 mask=(rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))
    if SOFTCAP:
        ds = ds * grad
    return ds


@triton.jit
def _dq_block(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, d_ok,
    seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap, mods, dv_ok,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_V: tl.constexpr, BIAS_GRAD: tl.constexpr,
):
    """DQ's share of keys [start_n, start_n + BLOCK_N), unscaled (V's head dim: dv_ok, EVEN_V).

    ``mods``: (seqlen_q, slope * log2 e, bias row pointers, the bias's column
    stride, Philox seed, dropout row offsets, dropout_p), as ``_mods`` gives them,
    then the bias gradient's row pointers (BIAS_GRAD).
    """
    cols = start_n + offs_n
    col_ok = cols < seqlen_k
    k = _load_tile(k_ptrs + start_n * stride_ks, col_ok, d_ok, MASKED, EVEN_D)
    v = _load_tile(v_ptrs + start_n * stride_vs, col_ok, dv_ok, MASKED, EVEN_V)
    p, grad = _dq_probs(_dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), IEEE), cols,
                        col_ok, offs_m, lse2, seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods,
                        MASKED, CAUSAL, WINDOW, SOFTCAP, ALIBI, BIAS)
    dp = _dot(do, tl.trans(v), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), IEEE)
    ds = _dq_ds(p, grad, dp, delta, offs_m, cols, seqlen_k, mods, SOFTCAP, DROPOUT, BIAS_GRAD)
    return _dot(ds.to(k.dtype), k, dq, IEEE)


@triton.jit
def _dq_block_split(
    dq, dq2, q, q2, do, do2, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, start_n, offs_m, offs_n, d2_ok,
    seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap, mods,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
):
    """``_dq_block`` with the head dim in two chunks (``BLOCK_D2``): Q K^T = q k^T + q2 k2^T, dQ's chunks dq, dq2.

    The first chunk is whole; the second is masked at head_dim unless EVEN_D
    (``d2_ok``). V's head dim is q's, split the same way.
    """
    cols = start_n + offs_n
    col_ok = cols < seqlen_k
    k = _load_tile(k_ptrs + start_n * stride_ks, col_ok, d2_ok, MASKED, True)
    v = _load_tile(v_ptrs + start_n * stride_vs, col_ok, d2_ok, MASKED, True)
    k2 = _load_tile(k2_ptrs + start_n * stride_ks, col_ok, d2_ok, MASKED, EVEN_D)
    v2 = _load_tile(v2_ptrs + start_n * stride_vs, col_ok, d2_ok, MASKED, EVEN_D)
    qk = _dot(q2, tl.trans(k2), _dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), IEEE),
              IEEE)
    p, grad = _dq_probs(qk, cols, col_ok, offs_m, lse2, seqlen_k, causal_offset, qk_scale, window_left,
                        window_right, cap, mods, MASKED, CAUSAL, WINDOW, SOFTCAP, ALIBI, BIAS)
    dp = _dot(do2, tl.trans(v2), _dot(do, tl.trans(v), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), IEEE),
              IEEE)
    ds = _dq_ds(p, grad, dp, delta, offs_m, cols, seqlen_k, mods, SOFTCAP, DROPOUT, BIAS_GRAD).to(k.dtype)
    return _dot(ds, k, dq, IEEE), _dot(ds, k2, dq2, IEEE)


@triton.jit
def _dq_range(
    dq, dq2, q, q2, do, do2, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, lo, hi, offs_m, offs_n, d_ok, d2_ok,
    dv_ok, seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap, mods,
    BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr, EVEN_D: tl.constexpr, EVEN_1: tl.constexpr,
    EVEN_V: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr,
):
    """(dq, dq2) after key blocks [lo, hi): ``_dq_block_split`` with split tiles (BLOCK_D2), else ``_dq_block``.

    Without split tiles dq2, q2, do2, k2_ptrs, v2_ptrs and d2_ok are
    placeholders, never read, and dq2 comes back as it was. The compiled code
    is the inline loops' (PTX the same but for register numbers, Triton 3.9, sm_90).
    """
    for start_n in range(lo, hi, BLOCK_N):
        if BLOCK_D2 > 0:
            dq, dq2 = _dq_block_split(dq, dq2, q, q2, do, do2, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, start_n,
                                      offs_m, offs_n, d2_ok, seqlen_k, causal_offset, qk_scale, stride_ks,
                                      stride_vs, window_left, window_right, cap, mods, EVEN_D, MASKED, CAUSAL, IEEE,
                                      WINDOW, SOFTCAP, ALIBI, BIAS, DROPOUT, BIAS_GRAD)
        else:
            dq = _dq_block(dq, q, do, lse2, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, d_ok,
                           seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap,
                           mods, dv_ok, EVEN_1, MASKED, CAUSAL, IEEE, WINDOW, SOFTCAP, ALIBI, BIAS, DROPOUT, EVEN_V,
                           BIAS_GRAD)
    return dq, dq2


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, Out, DO, Lse, Delta, DQ, Cu_seqlens_q, Cu_seqlens_k, Alibi, Bias, Philox, Seqused_q, Seqused_k, DBias,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    stride_lb, stride_lh,
    stride_dbiasb, stride_dbiash, stride_dbiasm,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk, stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn,
    sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    VARLEN: tl.constexpr = False,
    ALIBI: tl.constexpr = False, BIAS: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    BLOCK_DV: tl.constexpr = 0, EVEN_DV: tl.constexpr = True, BLOCK_D2: tl.constexpr = 0,
    SEQUSED_Q: tl.constexpr = False, SEQUSED_K: tl.constexpr = False, BIAS_GRAD: tl.constexpr = False,
    CHUNK: tl.constexpr = False,
):
    # Heaviest query blocks first, as in the forward.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    kv_head = head // group_size
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32
    seq = batch  # the slopes' row, also with VARLEN
    drop_k = seqlen_k  # dropout's keys per row: total_k with VARLEN (the forward's packed scores)
    drop_col = 0

    if VARLEN:  # as the forward: sequence ``batch`` of the packed tensors
        q_start = tl.load(Cu_seqlens_q + batch)
        seqlen_q = tl.load(Cu_seqlens_q + batch + 1) - q_start
        k_start = tl.load(Cu_seqlens_k + batch)
        drop_col = k_start
        seqlen_k = tl.load(Cu_seqlens_k + batch + 1) - k_start
        span_q = seqlen_q  # the rows of dQ this sequence's programs write, used or not
        if SEQUSED_Q:
            seqlen_q = tl.load(Seqused_q + batch)
        if SEQUSED_K:
            seqlen_k = tl.load(Seqused_k + batch)
        causal_offset = seqlen_k - seqlen_q
        if start_m >= span_q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # With split tiles (BLOCK_D2 > 0) the first chunk is whole: EVEN_D is the second's.
    EVEN_1: tl.constexpr = True if BLOCK_D2 > 0 else EVEN_D
    # V's head dim (and Out's, dO's): BLOCK_DV/EVEN_DV, or BLOCK_D/EVEN_D's when 0 (callers that predate them).
    BLOCK_V: tl.constexpr = BLOCK_DV if BLOCK_DV > 0 else BLOCK_D
    EVEN_V: tl.constexpr = True if BLOCK_D2 > 0 else EVEN_DV if BLOCK_DV > 0 else EVEN_D
    offs_dv = tl.arange(0, BLOCK_V)
    rows_ok = offs_m < seqlen_q
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < head_dim_v

    if VARLEN:
        Q = Q + q_start * stride_qs
        DO = DO + q_start * stride_dos
        Out = Out + q_start * stride_os
        DQ = DQ + q_start * stride_dqs
        K = K + k_start * stride_ks
        V = V + k_start * stride_vs
        batch = 0  # the batch strides are not used: each base above is its sequence's first row
    q = _load_tile(Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                   rows_ok, d_ok, True, EVEN_1)
    do = _load_tile(DO + batch * stride_dob + head * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :],
                    rows_ok, dv_ok, True, EVEN_V)
    o = _load_tile(Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :],
                   rows_ok, dv_ok, True, EVEN_V)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if BLOCK_D2 > 0:  # split tiles: head dims [BLOCK_D, BLOCK_D + BLOCK_D2) of every tensor, masked at head_dim
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2 < head_dim
        q2 = _load_tile(Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d2[None, :],
                        rows_ok, d2_ok, True, EVEN_D)
        do2 = _load_tile(DO + batch * stride_dob + head * stride_doh + offs_m[:, None] * stride_dos
                         + offs_d2[None, :], rows_ok, d2_ok, True, EVEN_D)
        o2 = _load_tile(Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_d2[None, :],
                        rows_ok, d2_ok, True, EVEN_D)
        delta += tl.sum(do2.to(tl.float32) * o2.to(tl.float32), 1)
        k2_ptrs = K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_ks + offs_d2[None, :]
        v2_ptrs = V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vs + offs_d2[None, :]
        dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    if VARLEN:  # lse and delta: (heads_q, total_q)
        lse_offset = head * stride_lh + q_start
    else:
        lse_offset = batch * stride_lb + head * stride_lh
    tl.store(Delta + lse_offset + offs_m, delta, mask=rows_ok)
    lse2 = _lse_log2(Lse + lse_offset, offs_m, rows_ok)

    k_ptrs = K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :]
    qk_scale, cap = _scales(sm_scale, softcap, SOFTCAP)
    slope2, bias_rows, seed, drop_rows = _mods(Alibi, Bias, Philox, seq, head, offs_m[:, None], lse_offset, drop_k,
                                               drop_col, stride_alibi_b, stride_biasb, stride_biash, stride_biasm,
                                               ALIBI, BIAS, DROPOUT)
    dbias_rows = DBias
    if BIAS_GRAD:
        dbias_rows = (DBias + batch.to(tl.int64) * stride_dbiasb + head.to(tl.int64) * stride_dbiash
                      + offs_m[:, None].to(tl.int64) * stride_dbiasm)
    mods = (seqlen_q, slope2, bias_rows, stride_biasn, seed, drop_rows, dropout_p, dbias_rows)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BLOCK_D2 == 0:  # _dq_range's split arguments: placeholders, never read without split tiles
        q2, do2, k2_ptrs, v2_ptrs, d2_ok, dq2 = q, do, k_ptrs, v_ptrs, d_ok, dq

    # Keys [0, full_end) are visible to every row of this block; [full_end, end)
    # are the ragged tail and the causal diagonal, masked.
    end = seqlen_k
    if SEQUSED_Q:  # a block of unused rows only: no key to visit
        end = tl.where(start_m < seqlen_q, end, 0)
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        end = tl.minimum(end, tl.maximum(start_m + BLOCK_M + causal_offset, 0))
        first_row_limit = tl.maximum(start_m + causal_offset + 1, 0)
        full_end = tl.minimum(full_end, (first_row_limit // BLOCK_N) * BLOCK_N)
    full_end = tl.minimum(full_end, end)
    full_begin = 0
    LOCAL: tl.constexpr = WINDOW or CHUNK
    if CHUNK:  # the forward's per-row chunk (inside the window), its bounds and its per-row window
        begin, full_begin, full_end, end, window_left, window_right = row_chunks(
            offs_m, causal_offset, attention_chunk, window_left, window_right, end, full_end, BLOCK_N, WINDOW)
        full_end = tl.maximum(tl.minimum(full_end, end), begin)
        full_begin = tl.minimum(tl.maximum(full_begin, begin), full_end)
    elif WINDOW:  # the forward's bounds: keys [begin, full_begin) and [full_end, end) are masked
        begin, full_begin, full_end, end = _window_range(start_m, causal_offset - window_left,
                                                         causal_offset + window_right, end, full_end, BLOCK_N,
                                                         BLOCK_M)
    if LOCAL:
        dq, dq2 = _dq_range(dq, dq2, q, q2, do, do2, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, begin, full_begin,
                            offs_m, offs_n, d_ok, d2_ok, dv_ok, seqlen_k, causal_offset, qk_scale, stride_ks,
                            stride_vs, window_left, window_right, cap, mods, BLOCK_N, BLOCK_D2, EVEN_D, EVEN_1,
                            EVEN_V, True, CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS, DROPOUT, BIAS_GRAD)
    dq, dq2 = _dq_range(dq, dq2, q, q2, do, do2, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, full_begin, full_end,
                        offs_m, offs_n, d_ok, d2_ok, dv_ok, seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs,
                        window_left, window_right, cap, mods, BLOCK_N, BLOCK_D2, EVEN_D, EVEN_1, EVEN_V, False,
                        CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS, DROPOUT, BIAS_GRAD)
    dq, dq2 = _dq_range(dq, dq2, q, q2, do, do2, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, full_end, end,
                        offs_m, offs_n, d_ok, d2_ok, dv_ok, seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs,
                        window_left, window_right, cap, mods, BLOCK_N, BLOCK_D2, EVEN_D, EVEN_1, EVEN_V, True,
                        CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS, DROPOUT, BIAS_GRAD)

    if SEQUSED_Q:  # rows past the used length hold 0 (their lse reads as +inf): stored to the span's end
        rows_ok = offs_m < span_q
    dq = dq * sm_scale
    _store_tile(DQ + batch * stride_dqb + head * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
                dq.to(DQ.dtype.element_ty), rows_ok, d_ok, EVEN_1)
    if BLOCK_D2 > 0:
        dq2 = dq2 * sm_scale
        _store_tile(DQ + batch * stride_dqb + head * stride_dqh + offs_m[:, None] * stride_dqs + offs_d2[None, :],
                    dq2.to(DQ.dtype.element_ty), rows_ok, d2_ok, EVEN_D)


@triton.jit
def _dkdv_probs(
    qk_t, rows, offs_n, lse2, seqlen_q, causal_offset, qk_scale, window_left, window_right, cap, mods,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """(P^T as dV takes it, P^T, the cap's factor of dS, dropout's keep mask) of the raw products qk_t = K Q^T.

    With dropout, dV takes P * Z / (1 - p) and the mask is returned for dP;
    without, the mask is P^T (unused).
    """
    (Alibi, Bias, Philox, batch, head, seqlen_k, lse_base, drop_k, drop_col, stride_alibi_b, stride_biasb,
     stride_biash, stride_biasm, stride_biasn, dropout_p) = mods
    qk_t, grad_t = _scores(qk_t, qk_scale, cap, SOFTCAP)
    if ALIBI or BIAS or DROPOUT:
        slope2, bias_rows, seed, drop_rows = _mods(Alibi, Bias, Philox, batch, head, rows[None, :], lse_base, drop_k,
                                                   drop_col, stride_alibi_b, stride_biasb, stride_biash, stride_biasm,
                                                   ALIBI, BIAS, DROPOUT)
    if ALIBI or BIAS:
        qk_t = _modified(qk_t, rows[None, :], offs_n[:, None], seqlen_q, seqlen_k, slope2, bias_rows, stride_biasn,
                         ALIBI, BIAS)
    if MASKED:  # the causal diagonal (key j is visible to query i when j <= i + causal_offset) and the window
        if CAUSAL:
            keep = offs_n[:, None] <= rows[None, :] + causal_offset
        else:
            keep = offs_n[:, None] >= 0
        if WINDOW:
            keep = keep & (offs_n[:, None] >= rows[None, :] + causal_offset - window_left)
            keep = keep & (offs_n[:, None] <= rows[None, :] + causal_offset + window_right)
        qk_t = tl.where(keep, qk_t, float("-inf"))
    p_t = tl.math.exp2(qk_t - lse2[None, :])
    if DROPOUT:  # dV = (P * Z / (1 - p))^T dO, and dP = (dO V^T) * Z / (1 - p) (``_dkdv_ds``)
        kept_t = _kept(seed, drop_rows, offs_n[:, None], dropout_p)
        pv_t = tl.where(kept_t, p_t * (1.0 / (1.0 - dropout_p)), 0.0)
    else:
        kept_t = p_t
        pv_t = p_t
    return pv_t, p_t, grad_t, kept_t


@triton.jit
def _dkdv_ds(p_t, grad_t, kept_t, dp_t, delta, mods, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr):
    """The transposed gradient of the scores, P^T * (dP^T - delta) (times the cap's factor), from V dO^T."""
    (Alibi, Bias, Philox, batch, head, seqlen_k, lse_base, drop_k, drop_col, stride_alibi_b, stride_biasb,
     stride_biash, stride_biasm, stride_biasn, dropout_p) = mods
    if DROPOUT:
        dp_t = tl.where(kept_t, dp_t * (1.0 / (1.0 - dropout_p)), 0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:
        ds_t = ds_t * grad_t
    return ds_t


@triton.jit
def _dkdv_block(
    dk, dv, k, v, q_ptrs, do_ptrs, Lse, Delta, start_m, offs_m, offs_n, d_ok,
    seqlen_q, causal_offset, qk_scale, stride_qs, stride_dos, window_left, window_right, cap, mods, dv_ok,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_V: tl.constexpr,
):
    """DK's (unscaled) and dV's shares of queries [start_m, start_m + BLOCK_M), computed transposed.

    ``mods``: (the pointers Alibi, Bias, Philox, sequence, query head, seqlen_k,
    dropout's lse_base, drop_k and drop_col, the slopes' and the bias's strides,
    dropout_p), for ``_mods``.
    """
    rows = start_m + offs_m
    rows_ok = rows < seqlen_q
    q = _load_tile(q_ptrs + start_m * stride_qs, rows_ok, d_ok, True, EVEN_D)
    do = _load_tile(do_ptrs + start_m * stride_dos, rows_ok, dv_ok, True, EVEN_V)
    lse2 = _lse_log2(Lse, rows, rows_ok)
    delta = tl.load(Delta + rows, mask=rows_ok, other=0.0)
    pv_t, p_t, grad_t, kept_t = _dkdv_probs(
        _dot(k, tl.trans(q), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32), IEEE), rows, offs_n, lse2,
        seqlen_q, causal_offset, qk_scale, window_left, window_right, cap, mods, MASKED, CAUSAL, WINDOW, SOFTCAP,
        ALIBI, BIAS, DROPOUT)
    dv = _dot(pv_t.to(do.dtype), do, dv, IEEE)
    dp_t = _dot(v, tl.trans(do), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32), IEEE)
    ds_t = _dkdv_ds(p_t, grad_t, kept_t, dp_t, delta, mods, SOFTCAP, DROPOUT)
    return _dot(ds_t.to(q.dtype), q, dk, IEEE), dv


@triton.jit
def _dkdv_block_split(
    dk, dk2, dv, dv2, k, k2, v, v2, q_ptrs, q2_ptrs, do_ptrs, do2_ptrs, Lse, Delta, start_m, offs_m, offs_n, d2_ok,
    seqlen_q, causal_offset, qk_scale, stride_qs, stride_dos, window_left, window_right, cap, mods,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """``_dkdv_block`` with the head dim in two chunks (``BLOCK_D2``): K Q^T = k q^T + k2 q2^T, dK's and dV's chunks.

    The first chunk is whole; the second is masked at head_dim unless EVEN_D (``d2_ok``).
    """
    rows = start_m + offs_m
    rows_ok = rows < seqlen_q
    q = _load_tile(q_ptrs + start_m * stride_qs, rows_ok, d2_ok, True, True)
    do = _load_tile(do_ptrs + start_m * stride_dos, rows_ok, d2_ok, True, True)
    q2 = _load_tile(q2_ptrs + start_m * stride_qs, rows_ok, d2_ok, True, EVEN_D)
    do2 = _load_tile(do2_ptrs + start_m * stride_dos, rows_ok, d2_ok, True, EVEN_D)
    lse2 = _lse_log2(Lse, rows, rows_ok)
    delta = tl.load(Delta + rows, mask=rows_ok, other=0.0)
    qk_t = _dot(k2, tl.trans(q2), _dot(k, tl.trans(q), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32), IEEE),
                IEEE)
    pv_t, p_t, grad_t, kept_t = _dkdv_probs(qk_t, rows, offs_n, lse2, seqlen_q, causal_offset, qk_scale,
                                            window_left, window_right, cap, mods, MASKED, CAUSAL, WINDOW, SOFTCAP,
                                            ALIBI, BIAS, DROPOUT)
    pv_t = pv_t.to(do.dtype)
    dv = _dot(pv_t, do, dv, IEEE)
    dv2 = _dot(pv_t, do2, dv2, IEEE)
    dp_t = _dot(v2, tl.trans(do2), _dot(v, tl.trans(do), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32), IEEE),
                IEEE)
    ds_t = _dkdv_ds(p_t, grad_t, kept_t, dp_t, delta, mods, SOFTCAP, DROPOUT).to(q.dtype)
    return _dot(ds_t, q, dk, IEEE), _dot(ds_t, q2, dk2, IEEE), dv, dv2


@triton.jit
def _dkdv_range(
    dk, dk2, dv, dv2, k, k2, v, v2, q_ptrs, q2_ptrs, do_ptrs, do2_ptrs, lse_ptr, delta_ptr, lo, hi, offs_m, offs_n,
    d_ok, d2_ok, dv_ok, seqlen_q, causal_offset, qk_scale, stride_qs, stride_dos, window_left, window_right, cap, mods,
    BLOCK_M: tl.constexpr, BLOCK_D2: tl.constexpr, EVEN_D: tl.constexpr, EVEN_1: tl.constexpr,
    EVEN_V: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """(dk, dk2, dv, dv2) after query blocks [lo, hi): ``_dkdv_block_split`` with split tiles, else ``_dkdv_block``.

    Without split tiles (BLOCK_D2 0) the split arguments are placeholders,
    never read, and dk2, dv2 come back as they were. The compiled code is the
    inline loops' (the same cubin, Triton 3.9, sm_90).
    """
    for start_m in range(lo, hi, BLOCK_M):
        if BLOCK_D2 > 0:
            dk, dk2, dv, dv2 = _dkdv_block_split(
                dk, dk2, dv, dv2, k, k2, v, v2, q_ptrs, q2_ptrs, do_ptrs, do2_ptrs, lse_ptr, delta_ptr, start_m,
                offs_m, offs_n, d2_ok, seqlen_q, causal_offset, qk_scale, stride_qs, stride_dos, window_left,
                window_right, cap, mods, EVEN_D, MASKED, IEEE, CAUSAL, WINDOW, SOFTCAP, ALIBI, BIAS, DROPOUT)
        else:
            dk, dv = _dkdv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m, offs_n,
                                 d_ok, seqlen_q, causal_offset, qk_scale, stride_qs, stride_dos, window_left,
                                 window_right, cap, mods, dv_ok, EVEN_1, MASKED, IEEE, CAUSAL, WINDOW, SOFTCAP,
                                 ALIBI, BIAS, DROPOUT, EVEN_V)
    return dk, dk2, dv, dv2


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, Cu_seqlens_q, Cu_seqlens_k, Alibi, Bias, Philox, Seqused_q, Seqused_k,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks,
    stride_dvb, stride_dvh, stride_dvs,
    stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk, stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn,
    sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    VARLEN: tl.constexpr = False,
    ALIBI: tl.constexpr = False, BIAS: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    BLOCK_DV: tl.constexpr = 0, EVEN_DV: tl.constexpr = True, BLOCK_D2: tl.constexpr = 0,
    SEQUSED_Q: tl.constexpr = False, SEQUSED_K: tl.constexpr = False, CHUNK: tl.constexpr = False,
):
    # Low key blocks first: under a causal mask they are seen by the most queries.
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32
    seq = batch  # the slopes' row, also with VARLEN
    drop_k = seqlen_k  # dropout's keys per row: total_k with VARLEN (the forward's packed scores)
    drop_col = 0
    lse_start = 0

    if VARLEN:  # as the forward, over this sequence's key blocks
        q_start = tl.load(Cu_seqlens_q + batch)
        seqlen_q = tl.load(Cu_seqlens_q + batch + 1) - q_start
        k_start = tl.load(Cu_seqlens_k + batch)
        lse_start = q_start
        drop_col = k_start
        seqlen_k = tl.load(Cu_seqlens_k + batch + 1) - k_start
        span_k = seqlen_k  # the rows of dK and dV this sequence's programs write, used or not
        if SEQUSED_Q:
            seqlen_q = tl.load(Seqused_q + batch)
        if SEQUSED_K:
            seqlen_k = tl.load(Seqused_k + batch)
        causal_offset = seqlen_k - seqlen_q
        if start_n >= span_k:
            return
        Q = Q + q_start * stride_qs
        DO = DO + q_start * stride_dos
        Lse = Lse + q_start
        Delta = Delta + q_start
        K = K + k_start * stride_ks
        V = V + k_start * stride_vs
        DK = DK + k_start * stride_dks
        DV = DV + k_start * stride_dvs
        batch = 0  # the batch strides are not used: each base above is its sequence's first row

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_1: tl.constexpr = True if BLOCK_D2 > 0 else EVEN_D  # as in the dQ kernel
    BLOCK_V: tl.constexpr = BLOCK_DV if BLOCK_DV > 0 else BLOCK_D
    EVEN_V: tl.constexpr = True if BLOCK_D2 > 0 else EVEN_DV if BLOCK_DV > 0 else EVEN_D
    offs_dv = tl.arange(0, BLOCK_V)
    cols_ok = offs_n < seqlen_k
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < head_dim_v

    k = _load_tile(K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                   cols_ok, d_ok, True, EVEN_1)
    v = _load_tile(V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                   cols_ok, dv_ok, True, EVEN_V)
    qk_scale, cap = _scales(sm_scale, softcap, SOFTCAP)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if BLOCK_D2 > 0:  # split tiles: head dims [BLOCK_D, BLOCK_D + BLOCK_D2) of every tensor, masked at head_dim
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2 < head_dim
        k2 = _load_tile(K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_ks + offs_d2[None, :],
                        cols_ok, d2_ok, True, EVEN_D)
        v2 = _load_tile(V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vs + offs_d2[None, :],
                        cols_ok, d2_ok, True, EVEN_D)
        dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)
        dv2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)
    else:  # _dkdv_range's split arguments: placeholders, never read without split tiles
        k2, v2, d2_ok, dk2, dv2 = k, v, d_ok, dk, dv

    # Queries [begin, full_begin) cross the causal diagonal of this key block and
    # are masked; queries [full_begin, seqlen_q) see all of its keys. Keys past
    # seqlen_k give rows of dK and dV that are never stored, and queries past
    # seqlen_q have P = 0 (their lse reads as +inf).
    begin = 0
    full_begin = 0
    if CAUSAL:
        begin = (tl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        last_key_row = tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0)
        full_begin = tl.maximum(((last_key_row + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, begin)
        full_begin = tl.minimum(full_begin, seqlen_q)
    end = seqlen_q
    full_end = seqlen_q
    LOCAL: tl.constexpr = WINDOW or CHUNK
    if CHUNK:
        # Key j is seen by the queries of its chunk: p = i + offset in [j - j mod C, j - j mod C + C), a window
        # of its own (C - 1 - j mod C to its left, j mod C to its right, each inside the window and the
        # causal mask), whose rows bound the loop as the window's do.
        into = offs_n % attention_chunk
        key_left = attention_chunk - 1 - into
        key_right = into
        if WINDOW:
            key_left = tl.minimum(key_left, window_left)
            key_right = tl.minimum(key_right, window_right)
        if CAUSAL:
            key_right = tl.minimum(key_right, 0)
        first = offs_n - causal_offset - key_right
        last = offs_n - causal_offset + key_left
        begin = (tl.maximum(tl.min(first, 0), 0) // BLOCK_M) * BLOCK_M
        full_begin = ((tl.maximum(tl.max(first, 0), 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        end = tl.minimum(end, tl.maximum(tl.max(last, 0) + 1, 0))
        full_end = tl.minimum(full_end, (tl.maximum(tl.min(last, 0) + 1, 0) // BLOCK_M) * BLOCK_M)
        full_end = tl.maximum(tl.minimum(full_end, end), begin)
        full_begin = tl.minimum(tl.maximum(full_begin, begin), full_end)
        window_left = key_left[:, None]
        window_right = key_right[:, None]
    elif WINDOW:
        # Query i sees key j when j - offset - right <= i <= j - offset + left: the
        # window's edges seen from this key block, with the forward's bounds.
        begin, full_begin, full_end, end = _window_range(start_n, -causal_offset - window_right,
                                                         window_left - causal_offset, end, full_end, BLOCK_M,
                                                         BLOCK_N)

    groups = group_size
    if SEQUSED_K:  # a block of unused keys only: no query to visit
        groups = tl.where(start_n < seqlen_k, group_size, 0)
    for g in range(0, groups):
        head = kv_head * group_size + g
        mods = (Alibi, Bias, Philox, seq, head, seqlen_k, batch * stride_lb + head * stride_lh + lse_start, drop_k,
                drop_col, stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn, dropout_p)
        q_ptrs = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
        do_ptrs = DO + batch * stride_dob + head * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :]
        lse_ptr = Lse + batch * stride_lb + head * stride_lh
        delta_ptr = Delta + batch * stride_lb + head * stride_lh
        if BLOCK_D2 > 0:
            q2_ptrs = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d2[None, :]
            do2_ptrs = DO + batch * stride_dob + head * stride_doh + offs_m[:, None] * stride_dos + offs_d2[None, :]
        else:  # _dkdv_range's split arguments: placeholders, never read without split tiles
            q2_ptrs, do2_ptrs = q_ptrs, do_ptrs
        dk, dk2, dv, dv2 = _dkdv_range(dk, dk2, dv, dv2, k, k2, v, v2, q_ptrs, q2_ptrs, do_ptrs, do2_ptrs, lse_ptr,
                                       delta_ptr, begin, full_begin, offs_m, offs_n, d_ok, d2_ok, dv_ok, seqlen_q,
                                       causal_offset, qk_scale, stride_qs, stride_dos, window_left, window_right, cap,
                                       mods, BLOCK_M, BLOCK_D2, EVEN_D, EVEN_1, EVEN_V, True, IEEE, CAUSAL, LOCAL,
                                       SOFTCAP, ALIBI, BIAS, DROPOUT)
        dk, dk2, dv, dv2 = _dkdv_range(dk, dk2, dv, dv2, k, k2, v, v2, q_ptrs, q2_ptrs, do_ptrs, do2_ptrs, lse_ptr,
                                       delta_ptr, full_begin, full_end, offs_m, offs_n, d_ok, d2_ok, dv_ok, seqlen_q,
                                       causal_offset, qk_scale, stride_qs, stride_dos, window_left, window_right, cap,
                                       mods, BLOCK_M, BLOCK_D2, EVEN_D, EVEN_1, EVEN_V, False, IEEE, CAUSAL, LOCAL,
                                       SOFTCAP, ALIBI, BIAS, DROPOUT)
        if LOCAL:
            dk, dk2, dv, dv2 = _dkdv_range(dk, dk2, dv, dv2, k, k2, v, v2, q_ptrs, q2_ptrs, do_ptrs, do2_ptrs, lse_ptr,
                                           delta_ptr, full_end, end, offs_m, offs_n, d_ok, d2_ok, dv_ok, seqlen_q,
                                           causal_offset, qk_scale, stride_qs, stride_dos, window_left, window_right,
                                           cap, mods, BLOCK_M, BLOCK_D2, EVEN_D, EVEN_1, EVEN_V, True, IEEE, CAUSAL,
                                           LOCAL, SOFTCAP, ALIBI, BIAS, DROPOUT)

    if SEQUSED_K:  # keys past the used length get zero gradients, stored to the span's end
        dk = tl.where(cols_ok[:, None], dk, 0.0)
        dv = tl.where(cols_ok[:, None], dv, 0.0)
        if BLOCK_D2 > 0:
            dk2 = tl.where(cols_ok[:, None], dk2, 0.0)
            dv2 = tl.where(cols_ok[:, None], dv2, 0.0)
        cols_ok = offs_n < span_k
    dk = dk * sm_scale
    _store_tile(DK + batch * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
                dk.to(DK.dtype.element_ty), cols_ok, d_ok, EVEN_1)
    _store_tile(DV + batch * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvs + offs_dv[None, :],
                dv.to(DV.dtype.element_ty), cols_ok, dv_ok, EVEN_V)
    if BLOCK_D2 > 0:
        dk2 = dk2 * sm_scale
        _store_tile(DK + batch * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dks + offs_d2[None, :],
                    dk2.to(DK.dtype.element_ty), cols_ok, d2_ok, EVEN_D)
        _store_tile(DV + batch * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvs + offs_d2[None, :],
                    dv2.to(DV.dtype.element_ty), cols_ok, d2_ok, EVEN_D)
