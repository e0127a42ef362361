"""Probe kernel of the backward: one dK/dV/dQ kernel with float32 atomic dQ (5 products, not 7).

Not served by lazytriton: ``experiments/probe_bwd_atomic.py`` launches it through
Triton's JIT to measure what the fused backward gives on the H200 before it
becomes a variant of ``flash_bwd``. Dense (B, H, S, D) tensors, head dim a
power of two (EVEN_D), no score modifications; causal is bottom-right aligned
(``causal_offset``) as in ``flash_bwd``.

One program per key block of one key/value head, as ``flash_bwd_dkdv_kernel``:
for every visible query block of every query head of its group it computes
``P^T``, ``dV += P^T dO``, ``dP^T = V dO^T``, ``dS^T = P^T (dP^T - delta)``,
``dK += dS^T Q`` and then the block's share of dQ, ``dS K``, added into a float32
(B, Hq, Sq, D) accumulator with relaxed atomics (``red.global.add.f32``). The
two kernels of ``flash_bwd`` recompute ``Q K^T`` and ``dO V^T`` in the dQ
kernel instead: 7 matrix products against these 5, but no atomics and
bitwise-reproducible gradients. ``delta = rowsum(dO * O)`` comes from
``delta_kernel`` first.

``DQ_TMA``: dQ's tile goes to the accumulator as one bulk tensor reduction
(``DQ_DESC``, a host tensor descriptor of the accumulator viewed as (B*Hq, Sq,
D), block (1, BLOCK_M, D): TMA's ``cp.reduce.async.bulk.tensor``, which is how
FlashAttention-3 adds dQ) instead of one ``red`` per element. GPU only: Triton's
interpreter has no descriptor atomics.

``ROTATE``: without a causal mask every program of a head walks the same query
blocks, so all of them add into the same dQ rows at once; rotated, program i
starts at its own query block and wraps around, spreading the atomics over
the accumulator.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def delta_kernel(Out, DO, Delta, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, seqlen_q,
                 heads, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O), (B, H, Sq) contiguous float32."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = rows < seqlen_q
    o = tl.load(Out + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + offs_d[None, :],
                mask=ok[:, None], other=0.0)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows[:, None] * stride_dos + offs_d[None, :],
                 mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (batch * heads + head) * seqlen_q + rows, delta, mask=ok)


@triton.jit
def _fused_block(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, dq_desc, bh, lse_ptr, delta_ptr, start_m, offs_m, offs_n,
                 seqlen_q, causal_offset, qk_scale, sm_scale, stride_qs, stride_dos, stride_dqs, MASKED: tl.constexpr,
                 DQ_TMA: tl.constexpr):
    rows = start_m + offs_m
    rows_ok = rows < seqlen_q
    q = tl.load(q_ptrs + start_m * stride_qs, mask=rows_ok[:, None], other=0.0)
    do = tl.load(do_ptrs + start_m * stride_dos, mask=rows_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + rows, mask=rows_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(delta_ptr + rows, mask=rows_ok, other=0.0)
    qk_t = tl.dot(k, tl.trans(q), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32)) * qk_scale
    if MASKED:
        qk_t = tl.where(offs_n[:, None] <= rows[None, :] + causal_offset, qk_t, float("-inf"))
    p_t = tl.math.exp2(qk_t - lse2[None, :])
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    dp_t = tl.dot(v, tl.trans(do), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32))
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk)
    dq = tl.dot(tl.trans(ds_t), k, tl.zeros([q.shape[0], k.shape[1]], dtype=tl.float32)) * sm_scale
    if DQ_TMA:  # one bulk reduction of the tile through shared memory (cp.reduce.async.bulk.tensor)
        dq_desc.atomic_add([bh, start_m, 0], dq.reshape([1, q.shape[0], k.shape[1]]))
    else:
        tl.atomic_add(dq_ptrs + start_m * stride_dqs, dq, mask=rows_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _fused_range(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, dq_desc, bh, lse_ptr, delta_ptr, lo, hi, offs_m, offs_n,
                 seqlen_q, causal_offset, qk_scale, sm_scale, stride_qs, stride_dos, stride_dqs, BLOCK_M: tl.constexpr,
                 MASKED: tl.constexpr, DQ_TMA: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        dk, dv = _fused_block(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, dq_desc, bh, lse_ptr, delta_ptr, start_m, offs_m,
                              offs_n, seqlen_q, causal_offset, qk_scale, sm_scale, stride_qs, stride_dos, stride_dqs,
                              MASKED, DQ_TMA)
    return dk, dv


@triton.jit
def fused_bwd_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DQA, DQ_DESC,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_dqb, stride_dqh, stride_dqs,
    group_size, heads_q, seqlen_q, seqlen_k, causal_offset, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ROTATE: tl.constexpr, DQ_TMA: tl.constexpr = False,
):
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    cols_ok = offs_n < seqlen_k
    k = tl.load(K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=cols_ok[:, None], other=0.0)
    v = tl.load(V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=cols_ok[:, None], other=0.0)
    qk_scale = sm_scale * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    begin = 0
    full_begin = 0
    if CAUSAL:
        begin = (tl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        last_key_row = tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0)
        full_begin = tl.maximum(((last_key_row + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, begin)
        full_begin = tl.minimum(full_begin, seqlen_q)
    for g in range(0, group_size):
        head = kv_head * group_size + g
        bh = batch * heads_q + head
        q_ptrs = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
        do_ptrs = DO + batch * stride_dob + head * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :]
        dq_ptrs = DQA + batch * stride_dqb + head * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :]
        lse_ptr = Lse + (batch * heads_q + head) * seqlen_q
        delta_ptr = Delta + (batch * heads_q + head) * seqlen_q
        if CAUSAL:
            dk, dv = _fused_range(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, DQ_DESC, bh, lse_ptr, delta_ptr,
                                  begin, full_begin, offs_m, offs_n, seqlen_q, causal_offset, qk_scale,
                                  sm_scale, stride_qs, stride_dos, stride_dqs, BLOCK_M, True, DQ_TMA)
            dk, dv = _fused_range(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, DQ_DESC, bh, lse_ptr, delta_ptr,
                                  full_begin, seqlen_q, offs_m, offs_n, seqlen_q, causal_offset, qk_scale,
                                  sm_scale, stride_qs, stride_dos, stride_dqs, BLOCK_M, False, DQ_TMA)
        elif ROTATE:
            pivot = ((start_n // BLOCK_M) * BLOCK_M) % (((seqlen_q + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
            dk, dv = _fused_range(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, DQ_DESC, bh, lse_ptr, delta_ptr,
                                  pivot, seqlen_q, offs_m, offs_n, seqlen_q, causal_offset, qk_scale,
                                  sm_scale, stride_qs, stride_dos, stride_dqs, BLOCK_M, False, DQ_TMA)
            dk, dv = _fused_range(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, DQ_DESC, bh, lse_ptr, delta_ptr,
                                  0, pivot, offs_m, offs_n, seqlen_q, causal_offset, qk_scale,
                                  sm_scale, stride_qs, stride_dos, stride_dqs, BLOCK_M, False, DQ_TMA)
        else:
            dk, dv = _fused_range(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, DQ_DESC, bh, lse_ptr, delta_ptr,
                                  0, seqlen_q, offs_m, offs_n, seqlen_q, causal_offset, qk_scale,
                                  sm_scale, stride_qs, stride_dos, stride_dqs, BLOCK_M, False, DQ_TMA)
    dk = dk * sm_scale
    tl.store(DK + batch * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=cols_ok[:, None])
    tl.store(DV + batch * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=cols_ok[:, None])
