"""Probe kernel: flash_bwd_fused_gluon's narrow program (head dims 64/128) with its consumers decoupled.

The served narrow program (kernels/flash_bwd/fused_kernel.py) makes each consumer warpgroup wait for the other's
half of dS^T in the step that wrote it, before its dQ product: the two warpgroups meet every step, so their
softmax phases line up and the tensor cores idle under both. Here (``DEFER``) a warpgroup computes step j's dQ
in step j + 1, after its own softmax of step j + 1, from three dS^T buffers (buffer j % 3 is written again at
step j + 3, whose Q/dO slot is loaded only after both warpgroups released step j + 1's, dQ_j's product
retired by then). ``PINGPONG`` adds FlashAttention-3's ping-pong: the warpgroups take turns issuing their
batches of products (S and dP; then dV, dK and the deferred dQ), so one's softmax runs under the other's
products.

Usage: benchmarks/probe_fused_variants.py times it beside the served kernel (same arguments plus the two flags).
"""

import triton  # noqa: F401 (the JIT's decorators below)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lazytriton.kernels.flash_bwd.fused_kernel import probs, produce, tma_reduce_add
from lazytriton.kernels.flash_bwd.gluon_kernel import load_kv, query_steps

LOG2E = gl.constexpr(1.4426950408889634)
WG_ROWS = gl.constexpr(64)
BLOCK_N = gl.constexpr(128)
STAGES = gl.constexpr(2)
DS_BUFS = gl.constexpr(3)


@gluon.jit
def _turn(turn, b, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Wait for our turn to issue batch ``b``: warpgroup 0's b after warpgroup 1's b - 1, 1's b after 0's b."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn.index(1), (b - 1) & 1, pred=b > 0)
        else:
            mbarrier.wait(turn.index(0), b & 1)


@gluon.jit
def _turn_done(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(WG), count=1)


@gluon.jit
def _send_dq(dq, dq_smem, dqa_desc, row, sm_scale, WG: gl.constexpr):
    COLS: gl.constexpr = dq.type.shape[1]
    tma.store_wait(0)  # the previous reduction has read our dQ tile
    dq_smem.store(dq * sm_scale)
    fence_async_shared()
    tma_reduce_add(dqa_desc, [row, WG * COLS], dq_smem)


@gluon.jit
def _deferred_step(k_w, v_w, k_cols, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_smem, full, empty, ds_ready,
                   turn, dqa_desc, batch, head, heads_q, seqlen_q, causal_offset, sm_scale, qk_scale,
                   offs_n, zero, zero_dq, dk, dv, prev_row, cur, step, m_first, n_masked, BLOCK_M: gl.constexpr,
                   CAUSAL: gl.constexpr, PREFETCH: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Step ``cur`` (``step`` of query head ``head``): its S, dP, dV and dK, and the previous step's dQ."""
    dtype: gl.constexpr = k_w.dtype
    s_layout: gl.constexpr = zero.type.layout
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    slot = cur % STAGES
    buf = cur % DS_BUFS
    start_m = (m_first + step) * BLOCK_M
    mbarrier.wait(full.index(slot), (cur // STAGES) & 1)
    q_s = q_bufs.index(slot)
    do_s = do_bufs.index(slot)
    _turn(turn, 2 * cur, WG, PINGPONG)
    s = warpgroup_mma(k_w, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(v_w, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    _turn_done(turn, WG, PINGPONG)
    if PREFETCH:
        lse2 = lse_bufs.index(slot).load(gl.SliceLayout(0, s_layout)) * LOG2E
        delta = delta_bufs.index(slot).load(gl.SliceLayout(0, s_layout))
    s, dp = warpgroup_mma_wait(0, deps=(s, dp))
    if not PREFETCH:
        lse2 = lse_bufs.index(slot).load(gl.SliceLayout(0, s_layout)) * LOG2E
        delta = delta_bufs.index(slot).load(gl.SliceLayout(0, s_layout))
    p, ds = probs(s, dp, start_m, lse2, delta, offs_n, qk_scale, causal_offset, step < n_masked, CAUSAL)
    ds_w = ds_bufs.index(buf).slice(WG * WG_ROWS, WG_ROWS, dim=0)
    ds_w.store(ds.to(dtype))
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(buf), count=1)
    p_op = gl.convert_layout(p.to(dtype), op_layout)
    _turn(turn, 2 * cur + 1, WG, PINGPONG)
    dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
    dk = warpgroup_mma(ds_w, q_s, dk, is_async=True)
    # The previous step's dQ: both halves of its dS^T are in (the wait is skipped at the first step, whose
    # product reads an unwritten buffer and is not sent).
    prev = (cur + DS_BUFS - 1) % DS_BUFS
    mbarrier.wait(ds_ready.index(prev), ((cur + DS_BUFS - 1) // DS_BUFS - 1) & 1, pred=cur > 0)
    dq = warpgroup_mma(ds_bufs.index(prev).permute((1, 0)), k_cols, zero_dq, use_acc=False, is_async=True)
    _turn_done(turn, WG, PINGPONG)
    dv, dk, dq, p_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op))
    mbarrier.arrive(empty.index(slot), count=1)
    if cur > 0:
        _send_dq(dq, dq_smem, dqa_desc, prev_row, sm_scale, WG)
    return dk, dv, (batch * heads_q + head) * seqlen_q + start_m


@gluon.jit
def _consume_deferred(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_smem, kv_bar, full, empty,
                      ds_ready, turn, dqa_desc, DK, DV, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh,
                      stride_dvs, batch, kv_head, group_size, heads_q, seqlen_q,
                      causal_offset, sm_scale, start_n, m_first, n_steps, n_masked, BLOCK_M: gl.constexpr,
                      CAUSAL: gl.constexpr, PREFETCH: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                      FLAT: gl.constexpr):
    """One consumer warpgroup, step j's dQ product issued in step j + 1 beside its dV and dK products."""
    BLOCK_D: gl.constexpr = k_smem.type.shape[1]
    COLS: gl.constexpr = BLOCK_D // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, COLS, 16])
    k_w = k_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    v_w = v_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    k_cols = k_smem.slice(WG * COLS, COLS, dim=1)
    qk_scale = sm_scale * LOG2E
    offs_n = start_n + WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=o_layout)
    dv = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=o_layout)
    zero = gl.zeros([WG_ROWS, BLOCK_M], dtype=gl.float32, layout=s_layout)
    zero_dq = gl.zeros([BLOCK_M, COLS], dtype=gl.float32, layout=dq_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    prev_row = 0  # dQ's accumulator row of the previous step (its dQ is this step's)
    if FLAT:
        for cur in range(group_size * n_steps):
            g = cur // n_steps
            dk, dv, prev_row = _deferred_step(
                k_w, v_w, k_cols, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_smem, full, empty, ds_ready,
                turn, dqa_desc, batch, kv_head * group_size + g, heads_q, seqlen_q, causal_offset,
                sm_scale, qk_scale, offs_n, zero, zero_dq, dk, dv, prev_row, cur, cur - g * n_steps, m_first,
                n_masked, BLOCK_M, CAUSAL, PREFETCH, WG, PINGPONG)
    else:
        it = 0
        for g in range(group_size):
            for step in range(n_steps):
                dk, dv, prev_row = _deferred_step(
                    k_w, v_w, k_cols, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_smem, full, empty,
                    ds_ready, turn, dqa_desc, batch, kv_head * group_size + g, heads_q, seqlen_q,
                    causal_offset, sm_scale, qk_scale, offs_n, zero, zero_dq, dk, dv, prev_row, it + step, step,
                    m_first, n_masked, BLOCK_M, CAUSAL, PREFETCH, WG, PINGPONG)
            it += n_steps
    last = group_size * n_steps - 1
    if last >= 0:
        mbarrier.wait(ds_ready.index(last % DS_BUFS), (last // DS_BUFS) & 1)
        dq = warpgroup_mma(ds_bufs.index(last % DS_BUFS).permute((1, 0)), k_cols, zero_dq, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        _send_dq(dq, dq_smem, dqa_desc, prev_row, sm_scale, WG)
    tma.store_wait(0)
    rows = start_n + WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(DK + batch * stride_dkb + kv_head * stride_dkh + rows[:, None] * stride_dks + cols[None, :],
             (dk * sm_scale).to(dtype))
    gl.store(DV + batch * stride_dvb + kv_head * stride_dvh + rows[:, None] * stride_dvs + cols[None, :],
             dv.to(dtype))


@gluon.jit
def flash_bwd_fused_gluon_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DQA,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_lb, stride_lh,
    group_size, heads_q, seqlen_q, seqlen_k, causal_offset, sm_scale,
    BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, PREFETCH: gl.constexpr,
    PINGPONG: gl.constexpr, FLAT: gl.constexpr,
):
    gl.static_assert(BLOCK_D <= 128, "the probe covers the narrow program (head dims 64 and 128)")
    COLS: gl.constexpr = BLOCK_D // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, COLS], gl.float32)

    start_n = gl.program_id(0) * BLOCK_N
    kv_head = gl.program_id(1)
    batch = gl.program_id(2)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [DS_BUFS, BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, COLS], dq_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(DS_BUFS):
        mbarrier.init(ds_ready.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()

    load_kv(K + batch * stride_kb + kv_head * stride_kh, V + batch * stride_vb + kv_head * stride_vh, stride_ks,
            stride_vs, seqlen_k, start_n, k_smem, v_smem, kv_bar)
    m_first, n_steps, n_masked = query_steps(start_n, causal_offset, seqlen_q, BLOCK_M, BLOCK_N, CAUSAL)
    dqa_desc = tma.make_tensor_descriptor(DQA, [gl.num_programs(2) * heads_q * seqlen_q, BLOCK_D], [BLOCK_D, 1],
                                          [BLOCK_M, COLS], dq_layout)
    gl.warp_specialize([
        (_consume_deferred, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_smem.index(0),
                             kv_bar, full, empty, ds_ready, turn, dqa_desc, DK, DV, stride_dkb, stride_dkh, stride_dks,
                             stride_dvb, stride_dvh, stride_dvs, batch, kv_head, group_size,
                             heads_q, seqlen_q, causal_offset, sm_scale, start_n, m_first, n_steps, n_masked,
                             BLOCK_M, CAUSAL, PREFETCH, 0, PINGPONG, FLAT)),
        (_consume_deferred, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_smem.index(1),
                             kv_bar, full, empty, ds_ready, turn, dqa_desc, DK, DV, stride_dkb, stride_dkh, stride_dks,
                             stride_dvb, stride_dvh, stride_dvs, batch, kv_head, group_size,
                             heads_q, seqlen_q, causal_offset, sm_scale, start_n, m_first, n_steps, n_masked,
                             BLOCK_M, CAUSAL, PREFETCH, 1, PINGPONG, FLAT)),
        (produce, (Q, DO, Lse, Delta, q_bufs, do_bufs, lse_bufs, delta_bufs, full, empty, stride_qb, stride_qh,
                    stride_qs, stride_dob, stride_doh, stride_dos, stride_lb, stride_lh, batch, kv_head, group_size,
                    seqlen_q, m_first, n_steps, BLOCK_M)),
    ], [4, 1], [240, 24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(DS_BUFS):
        mbarrier.invalidate(ds_ready.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
    mbarrier.invalidate(kv_bar.index(0))
