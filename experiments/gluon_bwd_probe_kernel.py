"""Probe kernel of the backward: the fused backward (dK, dV and atomic dQ) in Gluon for Hopper.

Not served by lazytriton: ``experiments/probe_gluon_bwd.py`` launches it through
Triton's JIT beside flash_bwd's kernels, the served Gluon dK/dV kernel
(``flash_bwd_dkdv_gluon``, whose helpers this file reuses) and cuDNN.

It is ``flash_bwd_dkdv_gluon``'s plain schedule plus dQ, FlashAttention-3's
way: dS^T also goes to shared memory, a fifth wgmma reads it transposed for the
step's dQ share ``dS K`` (into a float32 accumulator ``DQA``, zeroed by the
caller), which goes out through shared memory as one TMA bulk reduction
(``cp.reduce.async.bulk.tensor``); the next step waits for it only before it
reuses that buffer. 5 products instead of flash_bwd's 7, no dQ kernel; delta
comes from a pre-pass (``bwd_atomic_probe_kernel.delta_kernel``). Triton
3.6's Gluon has the TMA reduction's op but not its Python wrapper (3.9's
``tma.async_atomic_add``): the served ``fused_kernel.tma_reduce_add`` builds it.

Scope: fp16/bf16, head dim 64 or 128, seqlens multiples of the tiles, causal
offset >= 0, dense (B, H, S, D) tensors with any (batch, head) strides, ``Lse``
and ``Delta`` contiguous (B, Hq, Sq) float32.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lazytriton.kernels.flash_bwd.fused_kernel import tma_reduce_add
from lazytriton.kernels.flash_bwd.gluon_kernel import issue_scores, load_kv, load_step, query_steps, step_probs

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _head_fused(k_smem, v_smem, q_desc, do_desc, bars, q_bufs, do_bufs, lse_ptr, delta_ptr, dk, dv, it, n_steps,
                n_masked, m_first, offs_n, qk_scale, causal_offset, dq_desc, ds_smem, dq_smem, sm_scale,
                s_layout: gl.constexpr, op_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """One query head's shares of dK and dV, and its query blocks' dQ shares reduced into the accumulator."""
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    BLOCK_D: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = k_smem.dtype
    for i in gl.static_range(STAGES):
        load_step(q_desc, do_desc, bars, q_bufs, do_bufs, it + i, i, n_steps, m_first, BLOCK_M, STAGES)
    zero = gl.zeros([BLOCK_N, BLOCK_M], dtype=gl.float32, layout=s_layout)
    for step in range(0, n_steps):
        cur = it + step
        s, dp, q_s, do_s = issue_scores(k_smem, v_smem, bars, q_bufs, do_bufs, cur, zero, STAGES)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        p, ds = step_probs(s, dp, lse_ptr, delta_ptr, (m_first + step) * BLOCK_M, offs_n, qk_scale, causal_offset,
                           step < n_masked, BLOCK_M, CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        ds_smem.store(ds.to(dtype))  # dS^T to shared memory: dQ's product reads it transposed
        fence_async_shared()
        dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
        dq0 = gl.zeros([BLOCK_M, BLOCK_D], dtype=gl.float32, layout=dq_layout)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq0, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        tma.store_wait(0)  # the previous step's reduction has read dq_smem
        dq_smem.store(dq * sm_scale)
        fence_async_shared()
        tma_reduce_add(dq_desc, [(m_first + step) * BLOCK_M, 0], dq_smem)
        load_step(q_desc, do_desc, bars, q_bufs, do_bufs, cur + STAGES, step + STAGES, n_steps, m_first, BLOCK_M,
                  STAGES)
    tma.store_wait(0)
    return dk, dv, it + n_steps


@gluon.jit
def gluon_bwd_fused_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DQA,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_dqb, stride_dqh, stride_dqs,
    group_size, heads_q, seqlen_q, seqlen_k, causal_offset, sm_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr,
    STAGES: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    gl.static_assert(BLOCK_N == 16 * NUM_WARPS, "each warp owns 16 key rows: BLOCK_N = 16 x warps")
    dtype: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # dQ's share [BLOCK_M, BLOCK_D]: one warpgroup over its rows, a second (8 warps) over half its columns.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                        instr_shape=[16, BLOCK_D // (NUM_WARPS // 4), 16])
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], gl.float32)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)

    start_n = gl.program_id(0) * BLOCK_N
    kv_head = gl.program_id(1)
    batch = gl.program_id(2)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_D], dq_smem_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    load_kv(K + batch * stride_kb + kv_head * stride_kh, V + batch * stride_vb + kv_head * stride_vh, stride_ks,
            stride_vs, seqlen_k, BLOCK_D, start_n, k_smem, v_smem, kv_bar)
    m_first, n_steps, n_masked = query_steps(start_n, causal_offset, seqlen_q, BLOCK_M, BLOCK_N, CAUSAL)

    qk_scale = sm_scale * LOG2E
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=o_layout)
    dv = gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    it = 0
    for g in range(0, group_size):
        head = kv_head * group_size + g
        q_desc = tma.make_tensor_descriptor(Q + batch * stride_qb + head * stride_qh, [seqlen_q, BLOCK_D],
                                            [stride_qs, 1], [BLOCK_M, BLOCK_D], q_layout)
        do_desc = tma.make_tensor_descriptor(DO + batch * stride_dob + head * stride_doh, [seqlen_q, BLOCK_D],
                                             [stride_dos, 1], [BLOCK_M, BLOCK_D], q_layout)
        row = (batch * heads_q + head) * seqlen_q
        dq_desc = tma.make_tensor_descriptor(DQA + batch * stride_dqb + head * stride_dqh, [seqlen_q, BLOCK_D],
                                             [stride_dqs, 1], [BLOCK_M, BLOCK_D], dq_smem_layout)
        if n_steps > 0:
            dk, dv, it = _head_fused(k_smem, v_smem, q_desc, do_desc, bars, q_bufs, do_bufs, Lse + row, Delta + row,
                                     dk, dv, it, n_steps, n_masked, m_first, offs_n, qk_scale, causal_offset, dq_desc,
                                     ds_smem, dq_smem, sm_scale, s_layout, op_layout, dq_layout, BLOCK_M, STAGES,
                                     CAUSAL)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(kv_bar.index(0))
    rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(DK + batch * stride_dkb + kv_head * stride_dkh + rows[:, None] * stride_dks + cols[None, :],
             (dk * sm_scale).to(dtype))
    gl.store(DV + batch * stride_dvb + kv_head * stride_dvh + rows[:, None] * stride_dvs + cols[None, :],
             dv.to(dtype))
