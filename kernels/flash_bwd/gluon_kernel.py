"""FlashAttention-3-style dK/dV kernel for Hopper (sm_90) in Gluon: the source of ``flash_bwd_dkdv_gluon``.

This is the only file the source fingerprint of ``flash_bwd_dkdv_gluon``
covers, so everything the kernel calls lives here. It imports triton: only
``lazytriton.compiler`` may import it. It compiles for ``cuda:90`` with
Triton 3.6.0 (the GPU host) and 3.9.0 (CI) from the same source.

Same parameters, grid, outputs and semantics as ``flash_bwd_dkdv`` (the
binding launches it in that kernel's place, after ``flash_bwd_dq``, which
writes delta): one program per key block of one key/value head, summing dK and
dV over its group's query heads (GQA) in a fixed order, so the gradients stay
bitwise reproducible. ``Lse`` and ``Delta`` are (B, Hq, Sq) float32 with
``stride_lb``/``stride_lh``.

What it covers (``gluon.reason`` is the rule; the rest keeps the Triton
kernel): fp16/bf16, head dim 64 or 128 exactly, every pointer 16-byte aligned
and row strides multiples of 16 bytes (TMA), 32-bit offsets, seqlen_q a
multiple of BLOCK_M and seqlen_k of BLOCK_N (no ragged tile, so no bounds
masks), causal_offset >= 0 (every query sees key 0: no row has an empty
softmax), no window, softcap, ALiBi, bias, dropout, varlen, split tiles or
head_dim_v (nor varlen's seqused lengths). Those parameters are taken (the shared
ABI) and never read.

The pipeline, in the transposed frame of ``flash_bwd_dkdv`` (rows are the
program's keys), with the forward Gluon kernel's machinery
(``flash_fwd/gluon_kernel.py``):

- K and V are loaded once by TMA into shared memory and stay there; Q and dO
  stream through a two-deep TMA ring, one mbarrier per slot for both. The
  descriptors are made on the device (Triton's global scratch, 128 bytes
  each): K's and V's once, Q's and dO's once per query head of the group.
- Four async wgmmas a step: ``S^T = K Q^T`` and ``dP^T = V dO^T`` read both
  operands from shared memory (Q and dO transposed by permuted views);
  ``dV += P^T dO`` and ``dK += dS^T Q`` take P^T and dS^T from registers (they
  never go through shared memory) and dO, Q from the ring.
- The accumulators stack warps along the keys: 4 warps own 64 key rows, 8
  warps 128 (two warpgroups sharing each Q/dO tile).
- ``OVERLAP`` (FlashAttention-3's intra-warpgroup overlap): step j issues
  S^T_j and dP^T_j, then dV and dK of step j - 1, waits only for the first
  two and computes P^T_j and dS^T_j while the previous step's products run.
  Without it every step waits for all four.
- Causal: the steps that cross the diagonal come first and take the mask
  (a runtime flag per step); the rest see every key.

Measured on the H200 (benchmarks/probe_gluon_bwd.py and bench_flash_bwd.py,
NOTES.md 12-01): alone, 1.06-1.18x ``flash_bwd_dkdv`` at head dim 128 and at
head dim 64 causal from 4k tokens, slower at 1k and at head dim 64
non-causal; in the whole backward only head dim 128 non-causal gained
(1.05-1.10x), so that is the one row of ``dispatch.BWD_GLUON_TABLE``.
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

# The name Triton renamed between 3.6 and 3.9 (3.9 removed the old one): TMA copy global -> shared.
# Public: fused_kernel.py loads with it too.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

LOG2E = gl.constexpr(1.4426950408889634)
STAGES = gl.constexpr(2)  # Q/dO ring depth (gluon.shared_bytes counts it)


@gluon.jit
def load_step(q_desc, do_desc, bars, q_bufs, do_bufs, it, step, n_steps, m_first, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr):
    """Start the TMA loads of this head's query block ``m_first + step`` into ring slot ``it % STAGES``."""
    slot = it % STAGES
    bar = bars.index(slot)
    live = step < n_steps
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=live)
    tma_load(q_desc, [(m_first + step) * BLOCK_M, 0], bar, q_bufs.index(slot), pred=live)
    tma_load(do_desc, [(m_first + step) * BLOCK_M, 0], bar, do_bufs.index(slot), pred=live)


@gluon.jit
def kv_tile(dtype: gl.constexpr, KEYS: gl.constexpr, BLOCK_D: gl.constexpr):
    """(start_n, kv_head, batch, k_smem, v_smem): the program's key block, its K and V tiles in shared memory.

    The tiles (KEYS x BLOCK_D each) are the program's first allocations; ``load_kv`` fills them.
    """
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_D], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [KEYS, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [KEYS, BLOCK_D], kv_layout)
    return gl.program_id(0) * KEYS, gl.program_id(1), gl.program_id(2), k_smem, v_smem


@gluon.jit
def load_kv(k_base, v_base, stride_ks, stride_vs, seqlen_k, head_dim, start_n, k_smem, v_smem, kv_bar):
    """Start the TMA loads of the program's K and V tiles (keys from ``start_n``) into their buffers, one barrier.

    The descriptors' extent is ``head_dim``: a tile wider than it (a padded head dim) is zero-filled past it.
    """
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    BLOCK_D: gl.constexpr = k_smem.type.shape[1]
    k_desc = tma.make_tensor_descriptor(k_base, [seqlen_k, head_dim], [stride_ks, 1], [BLOCK_N, BLOCK_D],
                                        k_smem.type.layout)
    v_desc = tma.make_tensor_descriptor(v_base, [seqlen_k, head_dim], [stride_vs, 1], [BLOCK_N, BLOCK_D],
                                        v_smem.type.layout)
    mbarrier.expect(kv_bar.index(0), 2 * k_desc.block_type.nbytes)
    tma_load(k_desc, [start_n, 0], kv_bar.index(0), k_smem)
    tma_load(v_desc, [start_n, 0], kv_bar.index(0), v_smem)


@gluon.jit
def query_steps(start_n, causal_offset, seqlen_q, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr):
    """(m_first, n_steps, n_masked): the query blocks the program's keys see, from m_first, the first masked.

    Query blocks [m_first, m_first + n_masked) cross this key block's causal
    diagonal (masked); the rest see every key.
    """
    n_m = seqlen_q // BLOCK_M
    m_first = 0
    m_full = 0
    if CAUSAL:
        m_first = gl.maximum(start_n - causal_offset, 0) // BLOCK_M
        m_full = gl.minimum((gl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0) + BLOCK_M - 1) // BLOCK_M, n_m)
    return m_first, n_m - m_first, m_full - m_first


@gluon.jit
def step_probs(s, dp, lse_ptr, delta_ptr, start_m, offs_n, qk_scale, causal_offset, masked,
               BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(P^T, dS^T) of one step from the raw S^T = K Q^T and dP^T = V dO^T (float32, the scores' layout).

    ``masked`` (a runtime flag, causal only): the step crosses the diagonal.
    """
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s.type.layout))
    lse2 = gl.load(lse_ptr + offs_m) * LOG2E
    delta = gl.load(delta_ptr + offs_m)
    x = s * qk_scale - lse2[None, :]
    if CAUSAL and masked:
        x = gl.where(offs_n[:, None] <= (offs_m + causal_offset)[None, :], x, float("-inf"))
    p = gl.exp2(x)
    ds = p * (dp - delta[None, :])
    return p, ds


@gluon.jit
def issue_scores(k_smem, v_smem, bars, q_bufs, do_bufs, it, zero, STAGES: gl.constexpr):
    """Wait for ring step ``it``'s Q and dO tiles, then issue S^T = K Q^T and dP^T = V dO^T (async); both tiles too."""
    mbarrier.wait(bars.index(it % STAGES), (it // STAGES) & 1)
    q_s = q_bufs.index(it % STAGES)
    do_s = do_bufs.index(it % STAGES)
    s = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    return s, dp, q_s, do_s


@gluon.jit
def _head(k_smem, v_smem, q_desc, do_desc, bars, q_bufs, do_bufs, lse_ptr, delta_ptr, dk, dv, it, n_steps,
          n_masked, m_first, offs_n, qk_scale, causal_offset, s_layout: gl.constexpr, op_layout: gl.constexpr,
          BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr):
    """The shares of dK and dV from one query head: its query blocks m_first.., the first ``n_masked`` masked."""
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = k_smem.dtype
    for i in gl.static_range(STAGES):
        load_step(q_desc, do_desc, bars, q_bufs, do_bufs, it + i, i, n_steps, m_first, BLOCK_M, STAGES)
    zero = gl.zeros([BLOCK_N, BLOCK_M], dtype=gl.float32, layout=s_layout)
    if OVERLAP:
        # Step 0, peeled: its scores alone.
        s, dp, q_s, do_s = issue_scores(k_smem, v_smem, bars, q_bufs, do_bufs, it, zero, STAGES)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        p, ds = step_probs(s, dp, lse_ptr, delta_ptr, m_first * BLOCK_M, offs_n, qk_scale, causal_offset,
                           n_masked > 0, BLOCK_M, CAUSAL)
        p_prev = gl.convert_layout(p.to(dtype), op_layout)
        ds_prev = gl.convert_layout(ds.to(dtype), op_layout)
        for step in range(1, n_steps):
            cur = it + step
            prev = cur - 1
            s, dp, q_s, do_s = issue_scores(k_smem, v_smem, bars, q_bufs, do_bufs, cur, zero, STAGES)
            dv = warpgroup_mma(p_prev, do_bufs.index(prev % STAGES), dv, is_async=True)
            dk = warpgroup_mma(ds_prev, q_bufs.index(prev % STAGES), dk, is_async=True)
            # Groups retire in issue order: two left outstanding means S^T_j and dP^T_j are done.
            s, dp = warpgroup_mma_wait(2, deps=(s, dp))
            p, ds = step_probs(s, dp, lse_ptr, delta_ptr, (m_first + step) * BLOCK_M, offs_n, qk_scale,
                               causal_offset, step < n_masked, BLOCK_M, CAUSAL)
            dv, dk, p_prev, ds_prev = warpgroup_mma_wait(0, deps=(dv, dk, p_prev, ds_prev))
            # The previous step's slot is free: it takes the block STAGES steps after it.
            load_step(q_desc, do_desc, bars, q_bufs, do_bufs, prev + STAGES, step - 1 + STAGES, n_steps, m_first,
                       BLOCK_M, STAGES)
            p_prev = gl.convert_layout(p.to(dtype), op_layout)
            ds_prev = gl.convert_layout(ds.to(dtype), op_layout)
        last = it + n_steps - 1
        dv = warpgroup_mma(p_prev, do_bufs.index(last % STAGES), dv, is_async=True)
        dk = warpgroup_mma(ds_prev, q_bufs.index(last % STAGES), dk, is_async=True)
        dv, dk, p_prev, ds_prev = warpgroup_mma_wait(0, deps=(dv, dk, p_prev, ds_prev))
    else:
        for step in range(0, n_steps):
            cur = it + step
            s, dp, q_s, do_s = issue_scores(k_smem, v_smem, bars, q_bufs, do_bufs, cur, zero, STAGES)
            s, dp = warpgroup_mma_wait(0, deps=(s, dp))
            p, ds = step_probs(s, dp, lse_ptr, delta_ptr, (m_first + step) * BLOCK_M, offs_n, qk_scale,
                               causal_offset, step < n_masked, BLOCK_M, CAUSAL)
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
            dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            load_step(q_desc, do_desc, bars, q_bufs, do_bufs, cur + STAGES, step + STAGES, n_steps, m_first,
                       BLOCK_M, STAGES)
    return dk, dv, it + n_steps



@gluon.jit
def flash_bwd_dkdv_gluon_kernel(
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, EVEN_D: gl.constexpr,
    CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    gl.static_assert(EVEN_D, "flash_bwd_dkdv_gluon needs a head dim equal to its tile (64 or 128)")
    gl.static_assert(BLOCK_N == 16 * NUM_WARPS, "each warp owns 16 key rows: BLOCK_N = 16 x warps")
    dtype: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)

    start_n, kv_head, batch, k_smem, v_smem = kv_tile(dtype, BLOCK_N, BLOCK_D)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before its first arrive

    load_kv(K + batch * stride_kb + kv_head * stride_kh, V + batch * stride_vb + kv_head * stride_vh, stride_ks,
            stride_vs, seqlen_k, BLOCK_D, start_n, k_smem, v_smem, kv_bar)
    m_first, n_steps, n_masked = query_steps(start_n, causal_offset, seqlen_q, BLOCK_M, BLOCK_N, CAUSAL)

    qk_scale = sm_scale * LOG2E
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=o_layout)
    dv = gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    it = 0  # ring steps so far, over the group's heads: each slot's barrier phase follows it
    for g in range(0, group_size):
        head = kv_head * group_size + g
        q_desc = tma.make_tensor_descriptor(Q + batch * stride_qb + head * stride_qh, [seqlen_q, BLOCK_D],
                                            [stride_qs, 1], [BLOCK_M, BLOCK_D], q_layout)
        do_desc = tma.make_tensor_descriptor(DO + batch * stride_dob + head * stride_doh, [seqlen_q, BLOCK_D],
                                             [stride_dos, 1], [BLOCK_M, BLOCK_D], q_layout)
        lse_row = batch * stride_lb + head * stride_lh
        if n_steps > 0:
            dk, dv, it = _head(k_smem, v_smem, q_desc, do_desc, bars, q_bufs, do_bufs, Lse + lse_row,
                               Delta + lse_row, dk, dv, it, n_steps, n_masked, m_first, offs_n, qk_scale,
                               causal_offset, s_layout, op_layout, BLOCK_M, STAGES, CAUSAL, OVERLAP)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(kv_bar.index(0))
    rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(DK + batch * stride_dkb + kv_head * stride_dkh + rows[:, None] * stride_dks + cols[None, :],
             (dk * sm_scale).to(dtype))
    gl.store(DV + batch * stride_dvb + kv_head * stride_dvh + rows[:, None] * stride_dvs + cols[None, :],
             dv.to(dtype))
