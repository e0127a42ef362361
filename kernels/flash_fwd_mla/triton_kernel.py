"""The MLA forward in Triton: FlashAttention-3's ``qv`` and v's head dim up to 512 (the source of its keys).

Layout is flash_fwd's: q (B, Hq, Sq, D), k (B, Hk, Sk, D), v (B, Hk, Sk, Dv), qv (B, Hq, Sq, Dv), out (B, Hq,
Sq, Dv), any strides with a contiguous last dim; query head h reads key/value head h // group_size. One
program computes BLOCK_M query rows of one (batch, query head).

Scores are q . k, plus qv . v with ``QV`` (the V tile P . V reads serves both: each value is loaded once a
block), times ``sm_scale``; ``SOFTCAP`` caps them (softcap x tanh(s / softcap)), then the masks apply: key j
is visible to query i when j < seqlen_k and, with ``CAUSAL``, j <= i + causal_offset and, with ``WINDOW``,
i + causal_offset - window_left <= j <= i + causal_offset + window_right (flash_fwd's rules: the caller
passes the offset and bounded sides). Key blocks outside every row's window are skipped by the loop bounds,
blocks inside every row's run unmasked. A row that sees no key gets out 0 and lse -inf.

``VARLEN``: packed (total, heads, dim) tensors seen as one batch (the binding passes (1, heads, total, dim)
views); program z is sequence ``batch``, whose rows start at ``Cu_seqlens_q[batch]`` and keys at
``Cu_seqlens_k[batch]``, its own lengths and bottom-right offset len_k - len_q (``causal_offset`` is not
read); the lse is (heads_q, total_q). With ``SEQUSED_Q``/``SEQUSED_K`` (FlashAttention-3's seqused_q/seqused_k)
the sequence's lengths are ``Seqused_q[batch]``/``Seqused_k[batch]`` (the offset too): keys past the used length
are never read, rows past it (to the span's end) get out 0 and lse -inf, and a block of such rows visits no key.

``CHUNK`` (FlashAttention-3's attention_chunk): key j is visible to query i only when j and p = i + causal_offset
lie in the same chunk of ``attention_chunk`` keys, on top of the masks above; each row's chunk, cut to its
window, is a window of its own (``kernels/chunk.py``'s ``row_chunks``, flash_fwd's bounds), and the key blocks
outside every row's chunk are skipped by the loop bounds.
"""

import triton
import triton.language as tl

from lazytriton.kernels.chunk import row_chunks

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    """The hyperbolic tangent through exp2 (exactly +-1 for large |x|): no libdevice, so the interpreter runs it."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _block(
    acc, l_i, m_i, q, qv, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv, seqlen_k, head_dim,
    head_dim_v, causal_offset, window_left, window_right, qk_scale, cap, stride_ks, stride_vs,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr, SOFTCAP: tl.constexpr, QV: tl.constexpr, IEEE: tl.constexpr,
):
    """One step of the online softmax over keys [start_n, start_n + BLOCK_N): scores, masks, p, the accumulator.

    ``LOCAL``: the window masks apply, with scalar sides (``WINDOW``) or each row's chunk as its window ([M, 1]).
    """
    cols = start_n + offs_n
    keep_k = (offs_d < head_dim)[:, None] | EVEN_D
    keep_v = (offs_dv < head_dim_v)[None, :] | EVEN_DV
    if MASKED:
        keep_k = keep_k & (cols < seqlen_k)[None, :]
        keep_v = keep_v & (cols < seqlen_k)[:, None]
    if MASKED or not EVEN_D:
        k = tl.load(k_ptrs + start_n * stride_ks, mask=keep_k, other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_ks)
    if MASKED or not EVEN_DV:
        v = tl.load(v_ptrs + start_n * stride_vs, mask=keep_v, other=0.0)
    else:
        v = tl.load(v_ptrs + start_n * stride_vs)
    if IEEE:
        qk = tl.dot(q, k, input_precision="ieee")
        if QV:
            qk = tl.dot(qv, tl.trans(v), qk, input_precision="ieee")
    else:
        qk = tl.dot(q, k)
        if QV:
            qk = tl.dot(qv, tl.trans(v), qk)
    qk = qk * qk_scale
    if SOFTCAP:
        qk = _tanh(qk) * cap
    if MASKED:
        rows = offs_m[:, None]
        keep = (cols < seqlen_k)[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows + causal_offset)
        if LOCAL:
            keep = keep & (cols[None, :] >= rows + causal_offset - window_left)
            keep = keep & (cols[None, :] <= rows + causal_offset + window_right)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with no visible key so far keeps m = -inf; subtract 0 so that exp2(-inf - -inf) is never NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_new
    p = tl.math.exp2(qk - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def flash_fwd_mla_kernel(
    Q, K, V, Qv, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Seqused_q, Seqused_k,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_qvb, stride_qvh, stride_qvs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk, sm_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, VARLEN: tl.constexpr = False, QV: tl.constexpr = False,
    CHUNK: tl.constexpr = False, SEQUSED_Q: tl.constexpr = False, SEQUSED_K: tl.constexpr = False,
):
    # Heaviest query blocks first: with a causal mask the last blocks see the most keys.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    kv_head = head // group_size
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32
    if VARLEN:
        q_start = tl.load(Cu_seqlens_q + batch)
        seqlen_q = tl.load(Cu_seqlens_q + batch + 1) - q_start
        k_start = tl.load(Cu_seqlens_k + batch)
        seqlen_k = tl.load(Cu_seqlens_k + batch + 1) - k_start
        span_q = seqlen_q  # the rows this sequence's programs write, used or not
        if SEQUSED_Q:
            seqlen_q = tl.load(Seqused_q + batch)
        if SEQUSED_K:
            seqlen_k = tl.load(Seqused_k + batch)
        causal_offset = seqlen_k - seqlen_q
        if start_m >= span_q:
            return
        q_base = Q + q_start * stride_qs + head * stride_qh
        k_base = K + k_start * stride_ks + kv_head * stride_kh
        v_base = V + k_start * stride_vs + kv_head * stride_vh
        qv_base = Qv + q_start * stride_qvs + head * stride_qvh
        o_base = Out + q_start * stride_os + head * stride_oh
        lse_ptrs = Lse + head * stride_lh + q_start
    else:
        q_base = Q + batch * stride_qb + head * stride_qh
        k_base = K + batch * stride_kb + kv_head * stride_kh
        v_base = V + batch * stride_vb + kv_head * stride_vh
        qv_base = Qv + batch * stride_qvb + head * stride_qvh
        o_base = Out + batch * stride_ob + head * stride_oh
        lse_ptrs = Lse + batch * stride_lb + head * stride_lh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    q_keep = row_ok[:, None] & ((offs_d < head_dim)[None, :] | EVEN_D)
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_keep, other=0.0)
    qv = q  # not read without QV
    if QV:
        qv_keep = row_ok[:, None] & ((offs_dv < head_dim_v)[None, :] | EVEN_DV)
        qv = tl.load(qv_base + offs_m[:, None] * stride_qvs + offs_dv[None, :], mask=qv_keep, other=0.0)
    # K is read transposed, (BLOCK_D, BLOCK_N), so that q @ k needs no permute; V as (BLOCK_N, BLOCK_DV).
    k_ptrs = k_base + offs_n[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_dv[None, :]

    if SOFTCAP:
        qk_scale = sm_scale / softcap
        cap = softcap * LOG2E
    else:
        qk_scale = sm_scale * LOG2E
        cap = qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Keys [full_begin, full_end) are visible to every row of the block (no mask); [begin, full_begin) and
    # [full_end, end) are the window's left edge, the causal diagonal and the ragged tail.
    end = seqlen_k
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    begin = 0
    full_begin = 0
    if CAUSAL:
        end = tl.minimum(end, tl.maximum(start_m + BLOCK_M + causal_offset, 0))
        full_end = tl.minimum(full_end, (tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N) * BLOCK_N)
    # The chunk's or the window's bounds, per row, else the window's alone.
    LOCAL: tl.constexpr = WINDOW or CHUNK
    if CHUNK:  # each row's chunk (inside its window): the blocks' bounds, and the per-row window they are masked with
        begin, full_begin, full_end, end, window_left, window_right = row_chunks(
            offs_m, causal_offset, attention_chunk, window_left, window_right, end, full_end, BLOCK_N, WINDOW)
    elif WINDOW:
        begin = (tl.maximum(start_m + causal_offset - window_left, 0) // BLOCK_N) * BLOCK_N
        full_begin = tl.maximum(start_m + BLOCK_M - 1 + causal_offset - window_left, 0)
        full_begin = ((full_begin + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        end = tl.minimum(end, tl.maximum(start_m + BLOCK_M + causal_offset + window_right, 0))
        full_end = tl.minimum(full_end,
                              (tl.maximum(start_m + causal_offset + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    if SEQUSED_Q:  # a block of unused rows only: no key to visit
        end = tl.where(start_m < seqlen_q, end, 0)
    full_end = tl.minimum(full_end, end)
    if LOCAL:
        full_end = tl.maximum(full_end, begin)
        full_begin = tl.minimum(tl.maximum(full_begin, begin), full_end)
        for start_n in range(begin, full_begin, BLOCK_N):
            acc, l_i, m_i = _block(acc, l_i, m_i, q, qv, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv,
                                   seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
                                   qk_scale, cap, stride_ks, stride_vs, EVEN_D, EVEN_DV, True, CAUSAL, LOCAL,
                                   SOFTCAP, QV, IEEE)
    for start_n in range(full_begin, full_end, BLOCK_N):
        acc, l_i, m_i = _block(acc, l_i, m_i, q, qv, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv,
                               seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right, qk_scale,
                               cap, stride_ks, stride_vs, EVEN_D, EVEN_DV, False, CAUSAL, LOCAL, SOFTCAP, QV, IEEE)
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _block(acc, l_i, m_i, q, qv, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv,
                               seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right, qk_scale,
                               cap, stride_ks, stride_vs, EVEN_D, EVEN_DV, True, CAUSAL, LOCAL, SOFTCAP, QV, IEEE)

    if SEQUSED_Q:  # rows past the used length: a row that sees no key (out 0, lse -inf), stored to the span's end
        unused = offs_m >= seqlen_q
        acc = tl.where(unused[:, None], 0.0, acc)
        l_i = tl.where(unused, 0.0, l_i)
        row_ok = offs_m < span_q
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_keep = row_ok[:, None] & ((offs_dv < head_dim_v)[None, :] | EVEN_DV)
    tl.store(o_base + offs_m[:, None] * stride_os + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=o_keep)
    tl.store(lse_ptrs + offs_m, lse, mask=row_ok)
