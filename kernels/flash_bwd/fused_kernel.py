"""The fused backward for Hopper (sm_90) in Gluon, warp-specialised as FlashAttention-3's: ``flash_bwd_fused_gluon``.

The source fingerprint of ``flash_bwd_prep`` covers this file, and that of
``flash_bwd_fused_gluon`` this file, ``gluon_kernel.py``, whose
``kv_tile``, ``query_steps`` and ``tma_load`` it calls, and
``kernels/gluon_tma.py`` (descriptors and copies; the spec's
``helpers``). It imports triton: only ``lazytriton.compiler`` may import
it. It compiles for ``cuda:90`` with Triton 3.6.0 (the GPU host) and 3.9.0
(CI) from one source.

A backward in three launches on one stream (``binding.launch_gpu``):

1. ``flash_bwd_prep`` (plain Triton): delta = rowsum(dO * O) into ``Delta``
   and zeros into ``DQA``, dQ's float32 accumulator ((B, Hq, Sq, D),
   contiguous), one program per query block of a query head.
2. ``flash_bwd_fused_gluon``: one program per 128 keys (64 at head dim 256) of a key/value head,
   summing its group's query heads (GQA) in a fixed order into dK and dV, and
   adding each query block's share of dQ into ``DQA`` by TMA bulk reductions.
   Five matrix products a step instead of the two-kernel backward's seven.
3. ``dq.copy_(dqa)``: the accumulator cast to the gradient's dtype (torch).

dQ's sums arrive in whatever order the programs run, so dQ is not bitwise
reproducible from run to run (dK and dV are): under
``torch.use_deterministic_algorithms(True)`` the binding keeps the two-kernel
backward.

The program's partitions (``gl.warp_specialize``):

- **Two consumer warpgroups** (240 registers a thread, ``setmaxnreg``), each
  owning 64 of the program's keys: its rows of S^T = K Q^T and dP^T = V dO^T
  (both operands from shared memory), P^T and dS^T in registers, dS^T to its
  half of a shared buffer, then dV += P^T dO (P^T from registers) and
  dK += dS^T Q (dS^T from that buffer). dQ's share ``dS K`` contracts over
  all 128 keys, so it waits for both halves of dS^T (an mbarrier of two
  arrivals per buffer); each warpgroup then computes half of dQ's columns
  (K's columns sliced in shared memory: FlashAttention-3's dQ layout at head
  dim 128), scales it, and sends it through its own shared tile as one TMA
  bulk reduction (``cp.reduce.async.bulk.tensor.add``). Two dS^T buffers: a
  warpgroup writes buffer b at step j + 2 only after the other arrived at
  step j + 1, which it does after its step-j dQ product retired.
- **A producer warp** (24 registers): Q and dO tiles, and the step's lse and
  delta rows (1-D tiles of BLOCK_M float32), through a two-deep ring, each
  slot released by both consumers (an empty barrier of two arrivals) once its
  last reader (dV reads dO, dK reads Q) retired. Its descriptors are made per
  query head of the group. With keys as the products' M, a thread holds 16 of
  a step's query columns, so lse and delta take 32 registers once read: from
  global memory their load sat on each step's path after the scores (or held
  those registers across the products, and spilled); from the ring they are
  a shared-memory read (H200, 12-01: +6-11% at head dim 128, +2-11% at 64).
- K and V are loaded once by TMA, K by consumer warpgroup 0 and V by 1,
  each making its own descriptor and dQ's (``_prologue_half``) while the
  producer makes Q's and dO's: a descriptor made on the device costs
  ~0.7 µs, and made in turn before the partitions split they put a
  program's first step 5.3-7.5 µs after its start, 3.7-4.9 µs now (H200,
  12-02, ``benchmarks/probe_fused_steps.py --trace``).
- dK and dV leave through the freed Q/dO ring (``_store_tile``), whole
  128-byte lines a warp.

At head dim 256 (``_program_wide``) the program holds 64 keys, and the two
consumer warpgroups split its work by keys, then by columns, as
FlashAttention-3 does there:

- each computes S = Q K^T and dP = dO V^T for 32 of the keys (query rows as
  the wgmma's M), P and dS in registers, and writes its rows of P^T and dS^T
  to shared memory; one mbarrier of two arrivals says both halves are in,
  another that both warpgroups' products have read them (one buffer each);
- then each accumulates its 128 columns of dV += P^T dO and dK += dS^T Q over
  all 64 keys, and sends its 128 columns of dQ = dS K as two 64-column TMA
  reductions, the second product issued after the first one's tile is out
  (two in flight spilled);
- the producer feeds Q through a two-deep ring and dO through one buffer (the
  shared memory holds no second: 208 KB in all), released as soon as dV's
  product retired, so the next dO loads under the next S product;
- the consumers run one flat loop over the group's heads and steps: a nest
  kept more registers live (512 bytes spilled, 30% slower on the H200).

Split head dims (``BLOCK_D2``, ``fused.chunks``: 80 = 64 + 16 and 96 =
64 + 32 in the program of 64 and 128, 160 = 128 + 32 and 192 = 128 + 64 in
the wide one) run in two chunks, as ``flash_fwd_gluon``'s split tiles: the
second chunk of K, V, Q and dO in buffers of its own (``_second_chunk``,
loaded on the same barriers from column BLOCK_D on; at 192 through the
first chunk's descriptors, ``gluon_tma.descriptors``: 6 a program instead
of 12, H200 17th session +4-8%), S
and dP two products each, dK and dV two accumulators (the wide program's
warpgroups half of each chunk's columns). dQ: in the narrow program
warpgroup 0 computes the first chunk's columns and 1 the second's, one
product and one TMA reduction each a step (half of each chunk, it was two
of each, the second 16 or 8 columns wide: H200, 12-02, 1.17-1.22x at 4k
and 16k, and ptxas of Triton 3.6 spilled 88-204 bytes a thread there); in
the wide one each warpgroup sends half of each chunk's columns, the second
through a tile and descriptor of its own. No padded column is multiplied
(the padded tile did 1.33x to 1.6x the work); dQ's accumulator rows stay
the padded tile's, as the prep kernel writes them.

Causal grids run their key blocks longest first, a few (batch, head) pairs
at a time (``_longest_first``).

``PREFETCH``: lse and delta of a step are read (from the ring at head dims 64
and 128, from global memory at 256) before its products are waited for
(2 x BLOCK_M / 4 registers a thread at 64 and 128), else after.

What it covers (``fused.reason`` is the rule; the rest keeps the two-kernel
backward): fp16/bf16, head dims 40 to 256 that are multiples of 8 (TMA's
16-byte rows), split (above) or in the tile of 64, 128 or 256 that holds
them (``fused.tile``; ``head_dim`` is an argument: the descriptors' extent,
so TMA reads zeros past it, and the dK/dV stores' column mask; dQ's
accumulator rows are the padded tile's width), 16-byte aligned pointers and
strides that are multiples of 16 elements (ALIGN16: so in practice head dims
that are multiples of 16), 32-bit offsets, seqlen_q a multiple of BLOCK_M and
seqlen_k of the keys a program holds (128, or 64 over head dim 128), causal
offset >= 0, no window, softcap, ALiBi, bias, dropout, varlen or head_dim_v.
``Lse`` and ``Delta`` are (B, Hq, Sq) float32 with ``stride_lb``/``stride_lh``
(multiples of 16: the entries are compiled so).

Measured on the H200 (benchmarks/probe_gluon_bwd.py, NOTES.md 12-01, bf16,
the whole backward with the prep and the cast): 1.10-1.31x flash_bwd's two
kernels at head dim 128, 1.17-1.24x at head dim 64 from 4k tokens, 1.44-2.19x
at head dim 256 (0.88-1.09x cuDNN).
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lazytriton.kernels.flash_bwd.gluon_kernel import kv_tile, query_steps, tma_load
from lazytriton.kernels.gluon_tma import copy_in, copy_out, descriptors, tma_reduce_add

LOG2E = gl.constexpr(1.4426950408889634)
WG_ROWS = gl.constexpr(64)  # keys a consumer warpgroup owns (4 warps x 16 rows of a wgmma)
BLOCK_N = gl.constexpr(128)  # keys a program holds: two consumer warpgroups
STAGES = gl.constexpr(2)  # the Q/dO ring's depth (fused.shared_bytes counts it)
# A barrier of the calling partition's warps: 3.6's name, else 3.9's (which renamed it).
_warps_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _store_tile(x, buf, base, stride_s, row0, col0, head_dim):
    """``x`` (float32, a warpgroup's MMA layout) into a tile of the matrix at ``base``, through shared ``buf``.

    The tile: rows [row0, + R) and columns [col0, + C), row stride
    ``stride_s``, in ``base``'s dtype. ``buf`` (R x C, shared, free for the
    warpgroup: of ``base``'s dtype, or a float32 tile) takes ``x`` in the
    MMA's layout and gives it back 16 bytes a thread, so that a warp stores
    whole lines: 16 bytes a thread from a 16-bit ``buf``, 8 from a float32
    one. Stored from the MMA's layout, each thread wrote 4 bytes at a time
    through its own 64-bit addresses: 3.5-4.4 µs a program for dK and dV,
    1.2-1.4 µs this way (H200, 12-02, ``benchmarks/probe_fused_steps.py
    --trace``). Columns from ``head_dim`` on (a padded tile's) stay
    unwritten.
    """
    R: gl.constexpr = x.type.shape[0]
    C: gl.constexpr = x.type.shape[1]
    VEC: gl.constexpr = 128 // buf.dtype.primitive_bitwidth  # 16 bytes of the buffer's dtype
    TPC: gl.constexpr = C // VEC if C // VEC < 32 else 32  # threads along a row
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPC, TPC], [4, 1], [1, 0])
    buf.store(x.to(buf.dtype))
    _warps_barrier()
    y = buf.load(layout)
    rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    gl.store(base + rows[:, None] * stride_s + cols[None, :], y.to(base.dtype.element_ty),
             mask=(cols < head_dim)[None, :])


@triton.jit
def flash_bwd_prep_kernel(Out, DO, Delta, DQA, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
                          stride_lb, stride_lh, heads_q, seqlen_q, head_dim, BLOCK_M: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Delta = rowsum(dO * O) in float32, and zeros into the rows of dQ's accumulator, for one query block.

    The accumulator's rows are BLOCK_D wide (the fused kernel's tile), O's and dO's ``head_dim`` (at most BLOCK_D).
    """
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = rows < seqlen_q
    inside = ok[:, None] & (cols < head_dim)[None, :]
    o = tl.load(Out + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + cols[None, :],
                mask=inside, other=0.0)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows[:, None] * stride_dos + cols[None, :],
                 mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + batch * stride_lb + head * stride_lh + rows, delta, mask=ok)
    dqa_rows = (batch * heads_q + head) * seqlen_q + rows
    tl.store(DQA + dqa_rows[:, None] * BLOCK_D + cols[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
             mask=ok[:, None])


LPT_HEADS = gl.constexpr(8)  # at most this many (batch, head) pairs' key blocks ordered longest first together
LPT_BYTES = gl.constexpr(16 << 20)  # ... whose Q and dO (the rows the programs stream) fit in this much of L2


@gluon.jit
def _longest_first(KEYS: gl.constexpr, WIDTH: gl.constexpr, seqlen_q, group_size):
    """(start_n, kv_head, batch) of this program in a causal grid: its key blocks longest first, a few heads at a time.

    Causal key blocks see fewer query blocks the later they start (the first
    all of them, the last one or none). In the grid's own order (key blocks
    fastest) each head's longest program comes a head's key blocks before
    the end, so the last wave can hold a long one while the other SMs idle.
    Here the programs of up to ``LPT_HEADS`` (batch, head) pairs at a time
    run key block 0 of each, then key block 1, ...: the longest first (LPT).
    The pairs in a group are as many as keep the Q and dO rows their
    programs read (``WIDTH`` columns of 2 bytes each, a group of query heads
    per pair) within ``LPT_BYTES`` of L2: one pair at long seqlens, which is
    the grid's own order. H200, bf16 causal, 8 pairs at every seqlen: 4k
    +1.5-5% at head dims 64-128, 16k -1% at 128 and -5-6% at 192 and 256,
    where 8 heads' rows overflow L2 (NOTES 12-01, 8th). The grid is
    unchanged: (key blocks, key/value heads, batch).
    """
    n_blocks = gl.num_programs(0)
    heads = gl.num_programs(1)
    pairs = heads * gl.num_programs(2)
    lpt = gl.maximum(gl.minimum(LPT_BYTES // (4 * WIDTH) // (seqlen_q * group_size), LPT_HEADS), 1)  # no overflow
    pid = gl.program_id(0) + n_blocks * (gl.program_id(1) + heads * gl.program_id(2))
    first = (pid // (lpt * n_blocks)) * lpt
    size = gl.minimum(pairs - first, lpt)
    local = pid - first * n_blocks
    pair = first + local % size
    return (local // size) * KEYS, pair % heads, pair // heads


@gluon.jit
def _q_do_descriptors(Q, DO, q_bufs, q2_bufs, stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos,
                      batch, head, seqlen_q, head_dim, SPLIT: gl.constexpr):
    """(q_desc, q2_desc, do_desc, do2_desc): one query head's Q and dO, tiles as ``q_bufs``' (``descriptors``).

    dO's tiles are laid out as Q's. Their extent is ``head_dim``: a padded tile is zero-filled past it.
    """
    q_desc, q2_desc = descriptors(Q + batch * stride_qb + head * stride_qh, seqlen_q, head_dim, stride_qs, q_bufs,
                                   q2_bufs, SPLIT)
    do_desc, do2_desc = descriptors(DO + batch * stride_dob + head * stride_doh, seqlen_q, head_dim, stride_dos,
                                     q_bufs, q2_bufs, SPLIT)
    return q_desc, q2_desc, do_desc, do2_desc


@gluon.jit
def _produce(Q, DO, Lse, Delta, q_bufs, do_bufs, q2_bufs, do2_bufs, lse_bufs, delta_bufs, full, empty, stride_qb,
             stride_qh, stride_qs, stride_dob, stride_doh, stride_dos, stride_lb, stride_lh, batch, kv_head,
             group_size, seqlen_q, head_dim, m_first, n_steps, BLOCK_M: gl.constexpr, SPLIT: gl.constexpr):
    """The producer warp: every step's Q, dO, lse and delta tiles, over the group's query heads, once the slot is free.

    lse and delta come as 1-D tiles of BLOCK_M float32 per query head (rows
    of ``stride_lb``/``stride_lh``, 16-byte aligned under the entries' SEQ16).
    SPLIT: Q's and dO's second head-dim chunk too, into ``q2_bufs`` and
    ``do2_bufs`` (else they stand in for the first's, never loaded).
    """
    it = 0
    for g in range(group_size):
        head = kv_head * group_size + g
        q_desc, q2_desc, do_desc, do2_desc = _q_do_descriptors(Q, DO, q_bufs, q2_bufs, stride_qb, stride_qh,
                                                               stride_qs, stride_dob, stride_doh, stride_dos, batch,
                                                               head, seqlen_q, head_dim, SPLIT)
        # The first step's Q and dO go out before lse's and delta's descriptors are made (~0.7 µs each, the
        # loads in flight meanwhile); its barrier expects all four tiles' bytes from the start.
        # (nothing with no step: no load may be left in flight at the program's end).
        any_step = n_steps > 0
        first = _produce_q_do(q_desc, do_desc, q2_desc, do2_desc, q_bufs, do_bufs, q2_bufs, do2_bufs, full, empty, it,
                              m_first * BLOCK_M, BLOCK_M * 4 * 2, SPLIT, any_step)
        lse_desc = tma.make_tensor_descriptor(Lse + batch * stride_lb + head * stride_lh, [seqlen_q], [1], [BLOCK_M],
                                              lse_bufs.type.layout)
        delta_desc = tma.make_tensor_descriptor(Delta + batch * stride_lb + head * stride_lh, [seqlen_q], [1],
                                                [BLOCK_M], delta_bufs.type.layout)
        tma_load(lse_desc, [m_first * BLOCK_M], full.index(first), lse_bufs.index(first), pred=any_step)
        tma_load(delta_desc, [m_first * BLOCK_M], full.index(first), delta_bufs.index(first), pred=any_step)
        it += any_step.to(gl.int32)
        for step in range(1, n_steps):
            row = (m_first + step) * BLOCK_M
            slot = _produce_q_do(q_desc, do_desc, q2_desc, do2_desc, q_bufs, do_bufs, q2_bufs, do2_bufs, full, empty,
                                 it, row, BLOCK_M * 4 * 2, SPLIT, True)
            tma_load(lse_desc, [row], full.index(slot), lse_bufs.index(slot))
            tma_load(delta_desc, [row], full.index(slot), delta_bufs.index(slot))
            it += 1


@gluon.jit
def _produce_q_do(q_desc, do_desc, q2_desc, do2_desc, q_bufs, do_bufs, q2_bufs, do2_bufs, full, empty, it, row,
                  ROWS_BYTES: gl.constexpr, SPLIT: gl.constexpr, pred):
    """Ring slot ``it % STAGES``, once free: its barrier expects a step's bytes, then Q's and dO's tiles at ``row``.

    A step's bytes: Q's and dO's tiles (both chunks with SPLIT) and
    ``ROWS_BYTES`` of lse and delta, which the caller loads on the same
    barrier. Slot reuse: its (it // STAGES - 1)-th release; a fresh barrier
    shows that parity for the first lap. Nothing is issued where ``pred`` is
    false. Returns the slot.
    """
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_D: gl.constexpr = q_bufs.type.shape[2]
    # Q's and dO's tiles, both chunks (SPLIT: the second's buffers are as wide as the first's otherwise, unused)
    WIDTH: gl.constexpr = BLOCK_D + q2_bufs.type.shape[2] if SPLIT else BLOCK_D
    TILES_BYTES: gl.constexpr = 2 * q_bufs.type.shape[1] * WIDTH * q_bufs.dtype.primitive_bitwidth // 8
    slot = it % STAGES
    mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1, pred=pred)
    bar = full.index(slot)
    mbarrier.expect(bar, ROWS_BYTES + TILES_BYTES, pred=pred)
    copy_in(q_desc, row, 0, bar, q_bufs.index(slot), pred=pred)
    copy_in(do_desc, row, 0, bar, do_bufs.index(slot), pred=pred)
    if SPLIT:
        copy_in(q2_desc, row, BLOCK_D, bar, q2_bufs.index(slot), pred=pred)
        copy_in(do2_desc, row, BLOCK_D, bar, do2_bufs.index(slot), pred=pred)
    return slot


@gluon.jit
def _probs(s, dp, start_m, lse2, delta, offs_n, qk_scale, causal_offset, masked, CAUSAL: gl.constexpr):
    """(P^T, dS^T) of one step from the raw S^T = K Q^T and dP^T = V dO^T (float32, the scores' layout).

    ``lse2`` (lse x log2 e) and ``delta`` are the step's rows in the scores'
    column layout. ``masked`` (a runtime flag, causal only): the step crosses
    the diagonal.
    """
    BLOCK_M: gl.constexpr = s.type.shape[1]
    x = s * qk_scale - lse2[None, :]
    if CAUSAL and masked:
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s.type.layout))
        x = gl.where(offs_n[:, None] <= (offs_m + causal_offset)[None, :], x, float("-inf"))
    p = gl.exp2(x)
    return p, p * (dp - delta[None, :])


@gluon.jit
def _consume(k_smem, v_smem, q_bufs, do_bufs, k2_smem, v2_smem, q2_bufs, do2_bufs, lse_bufs, delta_bufs, ds_bufs,
             dq_smem, kv_bar, full, empty, ds_ready, done, DQA, kv_src, stride_kvs, kv_dst, kv2_dst,
             seqlen_k, DK, DV, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, batch, kv_head,
             group_size, heads_q, seqlen_q, head_dim, causal_offset, sm_scale, start_n, m_first, n_steps, n_masked,
             BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, PREFETCH: gl.constexpr, WG: gl.constexpr,
             SPLIT: gl.constexpr):
    """One consumer warpgroup: keys [start_n + 64 WG, + 64) of the program, its dK and dV, its columns of dQ.

    dQ's columns go through ``dq_smem``, the warpgroup's tile: half of them,
    or with SPLIT (two head-dim chunks, the second in the ``*2`` buffers) a
    chunk's, warpgroup 0 the first, 1 the second. S^T and dP^T are then two
    products each and dK and dV two accumulators, but dQ stays one product
    and one TMA reduction a step: split into half of each chunk, it was two
    of each, the second at 16 or 8 columns (80 = 64 + 16), each re-reading
    dS^T's 16 KB from shared memory for a few columns of K.
    """
    BLOCK_D: gl.constexpr = k_smem.type.shape[1]
    BLOCK_D2: gl.constexpr = k2_smem.type.shape[1]  # SPLIT's; else never issued
    COLS: gl.constexpr = dq_smem.type.shape[1]  # dQ's columns this warpgroup computes
    COL0: gl.constexpr = (BLOCK_D if WG == 1 else 0) if SPLIT else WG * COLS
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    o2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_D2, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, COLS, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    k_w = k_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    v_w = v_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    k2_w = k2_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    v2_w = v2_smem.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    # dQ = dS K: this warpgroup's columns of K (a chunk with SPLIT, else half of them)
    if SPLIT:
        if WG == 1:
            k_cols = k2_smem
        else:
            k_cols = k_smem
    else:
        k_cols = k_smem.slice(WG * COLS, COLS, dim=1)
    qk_scale = sm_scale * LOG2E
    offs_n = start_n + WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=o_layout)
    dv = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=o_layout)
    dk2 = gl.zeros([WG_ROWS, BLOCK_D2], gl.float32, layout=o2_layout)  # SPLIT's
    dv2 = gl.zeros([WG_ROWS, BLOCK_D2], gl.float32, layout=o2_layout)
    zero = gl.zeros([WG_ROWS, BLOCK_M], dtype=gl.float32, layout=s_layout)
    zero_dq = gl.zeros([BLOCK_M, COLS], dtype=gl.float32, layout=dq_layout)
    _prologue_half(kv_src, stride_kvs, seqlen_k, head_dim, start_n, kv_dst, kv2_dst, kv_bar, SPLIT)
    dqa_desc, _ = _dqa_descriptors(DQA, heads_q, seqlen_q, dq_smem, dq_smem, 2 * BLOCK_D if SPLIT else BLOCK_D,
                                   False)
    mbarrier.wait(kv_bar.index(0), 0)
    it = 0  # ring steps so far, over the group's heads: the slots' and dS buffers' phases follow it
    for g in range(group_size):
        dqa_row = (batch * heads_q + kv_head * group_size + g) * seqlen_q
        for step in range(0, n_steps):
            cur = it + step
            slot = cur % STAGES
            buf = cur % 2
            start_m = (m_first + step) * BLOCK_M
            mbarrier.wait(full.index(slot), (cur // STAGES) & 1)
            q_s = q_bufs.index(slot)
            do_s = do_bufs.index(slot)
            q2_s = q2_bufs.index(slot)
            do2_s = do2_bufs.index(slot)
            s = warpgroup_mma(k_w, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
            if SPLIT:
                s = warpgroup_mma(k2_w, q2_s.permute((1, 0)), s, is_async=True)
            dp = warpgroup_mma(v_w, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
            if SPLIT:
                dp = warpgroup_mma(v2_w, do2_s.permute((1, 0)), dp, is_async=True)
            if PREFETCH:
                lse2 = lse_bufs.index(slot).load(gl.SliceLayout(0, s_layout)) * LOG2E
                delta = delta_bufs.index(slot).load(gl.SliceLayout(0, s_layout))
            s, dp = warpgroup_mma_wait(0, deps=(s, dp))
            if not PREFETCH:
                lse2 = lse_bufs.index(slot).load(gl.SliceLayout(0, s_layout)) * LOG2E
                delta = delta_bufs.index(slot).load(gl.SliceLayout(0, s_layout))
            p, ds = _probs(s, dp, start_m, lse2, delta, offs_n, qk_scale, causal_offset, step < n_masked, CAUSAL)
            # dS^T to our half of buffer cur % 2, which step cur - 2's dQ products read last: ours retired
            # then, the other warpgroup's before it arrived at step cur - 1's barrier, which we waited for.
            ds_w = ds_bufs.index(buf).slice(WG * WG_ROWS, WG_ROWS, dim=0)
            ds_w.store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
            if SPLIT:
                dv2 = warpgroup_mma(p_op, do2_s, dv2, is_async=True)
            dk = warpgroup_mma(ds_w, q_s, dk, is_async=True)
            if SPLIT:
                dk2 = warpgroup_mma(ds_w, q2_s, dk2, is_async=True)
            mbarrier.wait(ds_ready.index(buf), (cur // 2) & 1)  # both halves of dS^T are in
            ds_t = ds_bufs.index(buf).permute((1, 0))
            dq = warpgroup_mma(ds_t, k_cols, zero_dq, use_acc=False, is_async=True)
            if SPLIT:
                dv, dv2, dk, dk2, dq, p_op = warpgroup_mma_wait(0, deps=(dv, dv2, dk, dk2, dq, p_op))
            else:
                dv, dk, dq, p_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op))
            mbarrier.arrive(empty.index(slot), count=1)
            tma.store_wait(0)  # the previous step's reduction has read our dQ tile
            dq_smem.store(dq * sm_scale)
            fence_async_shared()
            tma_reduce_add(dqa_desc, [dqa_row + start_m, COL0], dq_smem)
        it += n_steps
    tma.store_wait(0)
    # dK and dV through the Q and dO ring (_store_tile), once both warpgroups' last products, which read it, retired.
    mbarrier.arrive(done.index(0), count=1)
    mbarrier.wait(done.index(0), 0)
    dk_base = DK + batch * stride_dkb + kv_head * stride_dkh
    dv_base = DV + batch * stride_dvb + kv_head * stride_dvh
    row0 = start_n + WG * WG_ROWS
    if WG == 0:
        stage = q_bufs
        stage2 = q2_bufs
    else:
        stage = do_bufs
        stage2 = do2_bufs
    _store_tile(dk * sm_scale, stage.index(0).slice(0, WG_ROWS, dim=0), dk_base, stride_dks, row0, 0, head_dim)
    _store_tile(dv, stage.index(1).slice(0, WG_ROWS, dim=0), dv_base, stride_dvs, row0, 0, head_dim)
    if SPLIT:
        _store_tile(dk2 * sm_scale, stage2.index(0).slice(0, WG_ROWS, dim=0), dk_base, stride_dks, row0, BLOCK_D,
                    head_dim)
        _store_tile(dv2, stage2.index(1).slice(0, WG_ROWS, dim=0), dv_base, stride_dvs, row0, BLOCK_D, head_dim)


# ---------------------------------------------------------------------------
# Head dim 256 (``BLOCK_D > 128``): dK and dV of 64 keys x 256 columns would take two 128-register accumulators
# a thread, so the program holds 64 keys (WIDE_KEYS) and its two consumer warpgroups split the work as
# FlashAttention-3 does at that head dim: S and dP by keys (32 each), dK, dV and dQ by columns (128 each), with
# P^T and dS^T exchanged through shared memory. Shared memory: K and V (64 KB), a two-deep Q ring (64 KB), one
# dO tile (32 KB: dV releases it first, and the step's S product runs under its next load), P^T and dS^T (16 KB),
# and a 64 x 64 float32 dQ tile a warpgroup (32 KB): 208 KB.
WIDE_KEYS = gl.constexpr(64)
WIDE_DQ_COLS = gl.constexpr(64)  # dQ columns a TMA reduction carries (two a warpgroup a step)


@gluon.jit
def _produce_wide(Q, DO, q_bufs, do_smem, q2_bufs, do2_smem, q_full, q_empty, do_full, do_empty, stride_qb,
                  stride_qh, stride_qs, stride_dob, stride_doh, stride_dos, batch, kv_head, group_size, seqlen_q,
                  head_dim, m_first, n_steps, BLOCK_M: gl.constexpr, SPLIT: gl.constexpr):
    """The producer warp at head dim 256: Q through its two-deep ring, dO through its one buffer.

    SPLIT: the head dim's second chunk (columns from Q's tile width on) into ``q2_bufs`` and ``do2_smem``, on the
    same barriers (else they stand in for the first chunk's, never loaded).
    """
    BLOCK_D: gl.constexpr = q_bufs.type.shape[-1]
    WIDTH: gl.constexpr = BLOCK_D + q2_bufs.type.shape[-1] if SPLIT else BLOCK_D  # both chunks
    TILE_BYTES: gl.constexpr = BLOCK_M * WIDTH * q_bufs.dtype.primitive_bitwidth // 8  # Q's or dO's, a step
    it = 0
    for g in range(group_size):
        head = kv_head * group_size + g
        q_desc, q2_desc, do_desc, do2_desc = _q_do_descriptors(Q, DO, q_bufs, q2_bufs, stride_qb, stride_qh,
                                                               stride_qs, stride_dob, stride_doh, stride_dos, batch,
                                                               head, seqlen_q, head_dim, SPLIT)
        for step in range(n_steps):
            row = (m_first + step) * BLOCK_M
            slot = it % STAGES
            mbarrier.wait(q_empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(q_full.index(slot), TILE_BYTES)
            copy_in(q_desc, row, 0, q_full.index(slot), q_bufs.index(slot))
            if SPLIT:
                copy_in(q2_desc, row, BLOCK_D, q_full.index(slot), q2_bufs.index(slot))
            mbarrier.wait(do_empty.index(0), (it & 1) ^ 1)
            mbarrier.expect(do_full.index(0), TILE_BYTES)
            copy_in(do_desc, row, 0, do_full.index(0), do_smem)
            if SPLIT:
                copy_in(do2_desc, row, BLOCK_D, do_full.index(0), do2_smem)
            it += 1


@gluon.jit
def _consume_wide(k_smem, v_smem, q_bufs, do_smem, k2_smem, v2_smem, q2_bufs, do2_smem, pt_smem, dst_smem, dq_smem,
                  dq2_smem, kv_bar, q_full, q_empty, do_full, do_empty, ps_ready, ps_free, DQA, kv_src, stride_kvs,
                  kv_dst, kv2_dst, seqlen_k, Lse,
                  Delta, DK, DV, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb,
                  stride_lh, batch, kv_head, group_size, heads_q, seqlen_q, head_dim, causal_offset, sm_scale,
                  start_n, m_first, n_steps, n_masked, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                  PREFETCH: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr):
    """A consumer warpgroup at head dim 256: S and dP of keys [32 WG, + 32), dK, dV, dQ of columns [128 WG, + 128).

    SPLIT (two head-dim chunks, the second in the ``*2`` buffers): S and dP
    are two products each, and the warpgroup's columns are half of each
    chunk: dK and dV in two accumulators, dQ's first 64 columns as at 256
    and its second chunk's through ``dq2_smem`` and ``dqa2_desc``.
    """
    BLOCK_D: gl.constexpr = k_smem.type.shape[1]
    KEYS: gl.constexpr = WIDE_KEYS // 2
    COLS: gl.constexpr = BLOCK_D // 2
    COLS2: gl.constexpr = k2_smem.type.shape[1] // 2  # SPLIT's; else never issued
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, COLS, 16])
    acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, COLS2, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, WIDE_DQ_COLS, 16])
    kt_w = k_smem.slice(WG * KEYS, KEYS, dim=0).permute((1, 0))  # S = Q K^T: our keys
    vt_w = v_smem.slice(WG * KEYS, KEYS, dim=0).permute((1, 0))
    kt2_w = k2_smem.slice(WG * KEYS, KEYS, dim=0).permute((1, 0))
    vt2_w = v2_smem.slice(WG * KEYS, KEYS, dim=0).permute((1, 0))
    pt_w = pt_smem.slice(WG * KEYS, KEYS, dim=0)
    dst_w = dst_smem.slice(WG * KEYS, KEYS, dim=0)
    ds = dst_smem.permute((1, 0))  # dQ = dS K over all 64 keys
    qk_scale = sm_scale * LOG2E
    offs_n = start_n + WG * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    dk = gl.zeros([WIDE_KEYS, COLS], gl.float32, layout=acc_layout)
    dv = gl.zeros([WIDE_KEYS, COLS], gl.float32, layout=acc_layout)
    dk2 = gl.zeros([WIDE_KEYS, COLS2], gl.float32, layout=acc2_layout)  # SPLIT's
    dv2 = gl.zeros([WIDE_KEYS, COLS2], gl.float32, layout=acc2_layout)
    _prologue_half(kv_src, stride_kvs, seqlen_k, head_dim, start_n, kv_dst, kv2_dst, kv_bar, SPLIT)
    dqa_desc, dqa2_desc = _dqa_descriptors(DQA, heads_q, seqlen_q, dq_smem, dq2_smem,
                                           2 * BLOCK_D if SPLIT else BLOCK_D, SPLIT)
    mbarrier.wait(kv_bar.index(0), 0)
    # One loop over the group's query heads and their steps (a nest keeps more registers live across it).
    for cur in range(group_size * n_steps):
        g = cur // n_steps
        step = cur - g * n_steps
        head = kv_head * group_size + g
        lse_ptr = Lse + batch * stride_lb + head * stride_lh
        delta_ptr = Delta + batch * stride_lb + head * stride_lh
        dqa_row = (batch * heads_q + head) * seqlen_q
        slot = cur % STAGES
        start_m = (m_first + step) * BLOCK_M
        q_s = q_bufs.index(slot)
        q2_s = q2_bufs.index(slot)
        mbarrier.wait(q_full.index(slot), (cur // STAGES) & 1)
        zero = gl.zeros([BLOCK_M, KEYS], dtype=gl.float32, layout=s_layout)
        s = warpgroup_mma(q_s, kt_w, zero, use_acc=False, is_async=True)
        if SPLIT:
            s = warpgroup_mma(q2_s, kt2_w, s, is_async=True)
        mbarrier.wait(do_full.index(0), cur & 1)
        dp = warpgroup_mma(do_smem, vt_w, zero, use_acc=False, is_async=True)
        if SPLIT:
            dp = warpgroup_mma(do2_smem, vt2_w, dp, is_async=True)
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        if PREFETCH:
            lse2 = gl.load(lse_ptr + offs_m) * LOG2E
            delta = gl.load(delta_ptr + offs_m)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        if not PREFETCH:
            lse2 = gl.load(lse_ptr + offs_m) * LOG2E
            delta = gl.load(delta_ptr + offs_m)
        x = s * qk_scale - lse2[:, None]
        if CAUSAL and step < n_masked:
            x = gl.where(offs_n[None, :] <= (offs_m + causal_offset)[:, None], x, float("-inf"))
        p = gl.exp2(x)
        dsv = p * (dp - delta[:, None])
        # Our rows of P^T and dS^T, once both warpgroups' products of the previous step have read them.
        mbarrier.wait(ps_free.index(0), (cur & 1) ^ 1)
        pt_w.store(gl.permute(p.to(dtype), (1, 0)))
        dst_w.store(gl.permute(dsv.to(dtype), (1, 0)))
        fence_async_shared()
        mbarrier.arrive(ps_ready.index(0), count=1)
        mbarrier.wait(ps_ready.index(0), cur & 1)  # both halves are in
        dv = warpgroup_mma(pt_smem, do_smem.slice(WG * COLS, COLS, dim=1), dv, is_async=True)
        if SPLIT:
            dv2 = warpgroup_mma(pt_smem, do2_smem.slice(WG * COLS2, COLS2, dim=1), dv2, is_async=True)
        dk = warpgroup_mma(dst_smem, q_s.slice(WG * COLS, COLS, dim=1), dk, is_async=True)
        if SPLIT:
            dk2 = warpgroup_mma(dst_smem, q2_s.slice(WG * COLS2, COLS2, dim=1), dk2, is_async=True)
        zero_dq = gl.zeros([BLOCK_M, WIDE_DQ_COLS], dtype=gl.float32, layout=dq_layout)
        dq0 = warpgroup_mma(ds, k_smem.slice(WG * COLS, WIDE_DQ_COLS, dim=1), zero_dq, use_acc=False,
                            is_async=True)
        # Groups retire in order: dV's read dO.
        if SPLIT:
            dv, dv2 = warpgroup_mma_wait(3, deps=(dv, dv2))
        else:
            dv = warpgroup_mma_wait(2, deps=(dv,))
        mbarrier.arrive(do_empty.index(0), count=1)
        if SPLIT:
            dk, dk2, dq0 = warpgroup_mma_wait(0, deps=(dk, dk2, dq0))
        else:
            dk, dq0 = warpgroup_mma_wait(0, deps=(dk, dq0))
        mbarrier.arrive(q_empty.index(slot), count=1)
        tma.store_wait(0)
        dq_smem.store(dq0 * sm_scale)
        fence_async_shared()
        copy_out(dqa_desc, dqa_row + start_m, WG * COLS, dq_smem, ADD=True)
        if SPLIT:  # dQ's second chunk: our half of its columns, through a tile of its own
            zero_dq2 = gl.zeros([BLOCK_M, COLS2], dtype=gl.float32, layout=acc2_layout)
            dq1 = warpgroup_mma(ds, k2_smem.slice(WG * COLS2, COLS2, dim=1), zero_dq2, use_acc=False,
                                is_async=True)
            dq1 = warpgroup_mma_wait(0, deps=(dq1,))
            mbarrier.arrive(ps_free.index(0), count=1)
            # dq2_smem's last reader, the previous step's second reduction, is done: store_wait(0) above.
            dq2_smem.store(dq1 * sm_scale)
            fence_async_shared()
            copy_out(dqa2_desc, dqa_row + start_m, BLOCK_D + WG * COLS2, dq2_smem, ADD=True)
        else:
            dq1 = warpgroup_mma(ds, k_smem.slice(WG * COLS + WIDE_DQ_COLS, WIDE_DQ_COLS, dim=1), zero_dq,
                                use_acc=False, is_async=True)
            dq1 = warpgroup_mma_wait(0, deps=(dq1,))
            mbarrier.arrive(ps_free.index(0), count=1)
            tma.store_wait(0)
            dq_smem.store(dq1 * sm_scale)
            fence_async_shared()
            tma_reduce_add(dqa_desc, [dqa_row + start_m, WG * COLS + WIDE_DQ_COLS], dq_smem)
    tma.store_wait(0)
    # dK and dV through our half of Q's ring's columns (_store_tile): its last readers were our own dK products and
    # both warpgroups' last S products, the other's done before it arrived at the last step's ps_ready.
    dk_base = DK + batch * stride_dkb + kv_head * stride_dkh
    dv_base = DV + batch * stride_dvb + kv_head * stride_dvh
    _store_tile(dk * sm_scale, q_bufs.index(0).slice(0, WIDE_KEYS, dim=0).slice(WG * COLS, COLS, dim=1), dk_base,
                stride_dks, start_n, WG * COLS, head_dim)
    _store_tile(dv, q_bufs.index(1).slice(0, WIDE_KEYS, dim=0).slice(WG * COLS, COLS, dim=1), dv_base, stride_dvs,
                start_n, WG * COLS, head_dim)
    if SPLIT:  # the second chunk's through our float32 tile of its dQ columns (WIDE_KEYS x COLS2, as dK2's)
        _store_tile(dk2 * sm_scale, dq2_smem, dk_base, stride_dks, start_n, BLOCK_D + WG * COLS2, head_dim)
        _warps_barrier()  # every warp has read dK2's tile back
        _store_tile(dv2, dq2_smem, dv_base, stride_dvs, start_n, BLOCK_D + WG * COLS2, head_dim)


@gluon.jit
def _second_chunk(k_smem, v_smem, q_bufs, do_bufs, BLOCK_D2: gl.constexpr):
    """The second head-dim chunk's K, V, Q ring and dO buffers.

    Shaped as the first chunk's (``do_bufs`` a ring or one tile), BLOCK_D2
    columns wide; with BLOCK_D2 0 the first chunk's buffers stand in (never
    read).
    """
    dtype: gl.constexpr = k_smem.dtype
    KEYS: gl.constexpr = k_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
    if BLOCK_D2 > 0:
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D2], dtype)
        kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_D2], dtype)
        k2_smem = gl.allocate_shared_memory(dtype, [KEYS, BLOCK_D2], kv2_layout)
        v2_smem = gl.allocate_shared_memory(dtype, [KEYS, BLOCK_D2], kv2_layout)
        q2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D2], q2_layout)
        if len(do_bufs.type.shape) == 3:
            do2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D2], q2_layout)
        else:
            do2_bufs = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D2], q2_layout)
    else:
        k2_smem = k_smem
        v2_smem = v_smem
        q2_bufs = q_bufs
        do2_bufs = do_bufs
    return k2_smem, v2_smem, q2_bufs, do2_bufs


@gluon.jit
def _dq_tiles(COUNT: gl.constexpr, BLOCK_M: gl.constexpr, COLS: gl.constexpr):
    """COUNT float32 tiles of BLOCK_M x COLS in shared memory: dQ's shares on their way to a TMA reduction."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, COLS], gl.float32)
    return gl.allocate_shared_memory(gl.float32, [COUNT, BLOCK_M, COLS], layout)


@gluon.jit
def _prologue_half(base, stride_s, seqlen_k, head_dim, start_n, smem, smem2, kv_bar, SPLIT: gl.constexpr):
    """A consumer warpgroup's share of its program's prologue: K's tiles (warpgroup 0) or V's (1) by TMA.

    Its descriptor (and SPLIT's second chunk's, columns from the tile's width
    on, into ``smem2``) is made here, so that the warpgroups and the
    producer warp, which makes the Q and dO descriptors, make theirs at
    once: a descriptor made on the device costs ~0.7 µs of its partition's
    time, and the program's first step waits for K, V and Q (H200, 12-02,
    benchmarks/probe_fused_steps.py --trace: made in turn before the
    partitions split, they put the first Q tile 5.3-7.5 µs after a
    program's start). ``kv_bar`` takes one arrival from each warpgroup.
    """
    KEYS: gl.constexpr = smem.type.shape[0]
    BLOCK_D: gl.constexpr = smem.type.shape[1]
    WIDTH: gl.constexpr = BLOCK_D + smem2.type.shape[1] if SPLIT else BLOCK_D  # both chunks
    desc, desc2 = descriptors(base, seqlen_k, head_dim, stride_s, smem, smem2, SPLIT)
    mbarrier.expect(kv_bar.index(0), KEYS * WIDTH * smem.dtype.primitive_bitwidth // 8)
    copy_in(desc, start_n, 0, kv_bar.index(0), smem)
    if SPLIT:
        copy_in(desc2, start_n, BLOCK_D, kv_bar.index(0), smem2)


@gluon.jit
def _dqa_descriptors(DQA, heads_q, seqlen_q, dq_smem, dq2_smem, DQA_D: gl.constexpr, SPLIT: gl.constexpr):
    """The dQ accumulator as one 2-D tensor of B x Hq x Sq rows: one descriptor serves every head.

    A row is DQA_D wide: the padded tile (twice the first chunk with SPLIT,
    as the prep kernel writes it). The tiles are ``dq_smem``'s (then, SPLIT,
    a second descriptor's are ``dq2_smem``'s, or the first's boxes are
    theirs: ``gluon_tma.descriptors``). Each consumer warpgroup makes its own, after
    its K or V load.
    """
    return descriptors(DQA, gl.num_programs(2) * heads_q * seqlen_q, DQA_D, DQA_D, dq_smem, dq2_smem, SPLIT)


@gluon.jit
def _program_wide(Q, K, V, DO, Lse, Delta, DK, DV, DQA, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
                  stride_ks, stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos, stride_dkb,
                  stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh, group_size,
                  heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, BLOCK_M: gl.constexpr,
                  BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, PREFETCH: gl.constexpr, BLOCK_D2: gl.constexpr):
    """``flash_bwd_fused_gluon``'s program at head dim 256: 64 keys, the warpgroups split by keys, then by columns.

    BLOCK_D2 > 0: the head dim in two chunks (160 = 128 + 32, 192 = 128 + 64), each in tiles of its own, so no
    padded column is multiplied; dQ's accumulator rows stay 2 x BLOCK_D wide (the padded tile's, as the prep
    kernel writes them).
    """
    SPLIT: gl.constexpr = BLOCK_D2 > 0
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WIDE_KEYS, BLOCK_M], dtype)

    start_n, kv_head, batch, k_smem, v_smem = kv_tile(dtype, WIDE_KEYS, BLOCK_D)
    if CAUSAL:
        start_n, kv_head, batch = _longest_first(WIDE_KEYS, BLOCK_D + BLOCK_D2, seqlen_q, group_size)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], q_layout)
    pt_smem = gl.allocate_shared_memory(dtype, [WIDE_KEYS, BLOCK_M], pt_layout)
    dst_smem = gl.allocate_shared_memory(dtype, [WIDE_KEYS, BLOCK_M], pt_layout)
    dq_smem = _dq_tiles(2, BLOCK_M, WIDE_DQ_COLS)
    k2_smem, v2_smem, q2_bufs, do2_smem = _second_chunk(k_smem, v_smem, q_bufs, do_smem, BLOCK_D2)
    if BLOCK_D2 > 0:  # each warpgroup's half of the second chunk's columns
        dq2_smem = _dq_tiles(2, BLOCK_M, BLOCK_D2 // 2)
    else:
        dq2_smem = dq_smem
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ps_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ps_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=2)  # K's and V's loads, one from each consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    mbarrier.init(do_full.index(0), count=1)
    mbarrier.init(do_empty.index(0), count=2)
    mbarrier.init(ps_ready.index(0), count=2)
    mbarrier.init(ps_free.index(0), count=2)
    fence_async_shared()

    # K (consumer warpgroup 0), V (1) and the dQ descriptors are the consumers' to load and make (_prologue_half).
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    m_first, n_steps, n_masked = query_steps(start_n, causal_offset, seqlen_q, BLOCK_M, WIDE_KEYS, CAUSAL)
    gl.warp_specialize([
        (_consume_wide, (k_smem, v_smem, q_bufs, do_smem, k2_smem, v2_smem, q2_bufs, do2_smem, pt_smem, dst_smem,
                         dq_smem.index(0), dq2_smem.index(0), kv_bar, q_full, q_empty, do_full, do_empty, ps_ready,
                         ps_free, DQA, k_base, stride_ks, k_smem, k2_smem, seqlen_k, Lse, Delta, DK, DV,
                         stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh,
                         batch, kv_head, group_size, heads_q, seqlen_q, head_dim, causal_offset, sm_scale, start_n,
                         m_first, n_steps, n_masked, BLOCK_M, CAUSAL, PREFETCH, 0, SPLIT)),
        (_consume_wide, (k_smem, v_smem, q_bufs, do_smem, k2_smem, v2_smem, q2_bufs, do2_smem, pt_smem, dst_smem,
                         dq_smem.index(1), dq2_smem.index(1), kv_bar, q_full, q_empty, do_full, do_empty, ps_ready,
                         ps_free, DQA, v_base, stride_vs, v_smem, v2_smem, seqlen_k, Lse, Delta, DK, DV,
                         stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh,
                         batch, kv_head, group_size, heads_q, seqlen_q, head_dim, causal_offset, sm_scale, start_n,
                         m_first, n_steps, n_masked, BLOCK_M, CAUSAL, PREFETCH, 1, SPLIT)),
        (_produce_wide, (Q, DO, q_bufs, do_smem, q2_bufs, do2_smem, q_full, q_empty, do_full, do_empty, stride_qb,
                         stride_qh, stride_qs, stride_dob, stride_doh, stride_dos, batch, kv_head, group_size,
                         seqlen_q, head_dim, m_first, n_steps, BLOCK_M, SPLIT)),
    ], [4, 1], [240, 24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(q_full.index(i))
        mbarrier.invalidate(q_empty.index(i))
    mbarrier.invalidate(do_full.index(0))
    mbarrier.invalidate(do_empty.index(0))
    mbarrier.invalidate(ps_ready.index(0))
    mbarrier.invalidate(ps_free.index(0))
    mbarrier.invalidate(kv_bar.index(0))


@gluon.jit
def flash_bwd_fused_gluon_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DQA,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_lb, stride_lh,
    group_size, heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale,
    BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, PREFETCH: gl.constexpr,
    BLOCK_D2: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 4, "the default partition is consumer warpgroup 0: launch with 4 warps")
    # BLOCK_D2 (0: none): the head dim's second chunk, columns [BLOCK_D, BLOCK_D + BLOCK_D2) (the wide program's).
    if BLOCK_D + BLOCK_D2 > 128:
        _program_wide(Q, K, V, DO, Lse, Delta, DK, DV, DQA, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
                      stride_ks, stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos, stride_dkb,
                      stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh, group_size,
                      heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, BLOCK_M, BLOCK_D, CAUSAL,
                      PREFETCH, BLOCK_D2)
    else:
        _program_narrow(Q, K, V, DO, Lse, Delta, DK, DV, DQA, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
                        stride_ks, stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos, stride_dkb,
                        stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh, group_size,
                        heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, BLOCK_M, BLOCK_D, CAUSAL,
                        PREFETCH, BLOCK_D2)


@gluon.jit
def _program_narrow(Q, K, V, DO, Lse, Delta, DK, DV, DQA, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
                    stride_ks, stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos, stride_dkb,
                    stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh, group_size,
                    heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, BLOCK_M: gl.constexpr,
                    BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, PREFETCH: gl.constexpr, BLOCK_D2: gl.constexpr):
    """``flash_bwd_fused_gluon``'s program at head dims 64 and 128: 128 keys, 64 a consumer warpgroup.

    BLOCK_D2 > 0: the head dim in two chunks (80 = 64 + 16, 96 = 64 + 32), each in tiles of its own, warpgroup 0
    computing the first chunk's dQ columns and 1 the second's; dQ's accumulator rows stay 2 x BLOCK_D wide (the
    padded tile's, as the prep kernel writes them).
    """
    SPLIT: gl.constexpr = BLOCK_D2 > 0
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)

    start_n, kv_head, batch, k_smem, v_smem = kv_tile(dtype, BLOCK_N, BLOCK_D)
    if CAUSAL:
        start_n, kv_head, batch = _longest_first(BLOCK_N, BLOCK_D + BLOCK_D2, seqlen_q, group_size)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    k2_smem, v2_smem, q2_bufs, do2_bufs = _second_chunk(k_smem, v_smem, q_bufs, do_bufs, BLOCK_D2)
    # A dQ tile a warpgroup: half of the columns each, or with SPLIT a chunk each (_consume)
    if SPLIT:
        dq_smem = _dq_tiles(1, BLOCK_M, BLOCK_D)
        dq2_smem = _dq_tiles(1, BLOCK_M, BLOCK_D2)
        dq_a = dq_smem.index(0)
        dq_b = dq2_smem.index(0)
    else:
        dq_smem = _dq_tiles(2, BLOCK_M, BLOCK_D // 2)
        dq_a = dq_smem.index(0)
        dq_b = dq_smem.index(1)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=2)  # K's and V's loads, one from each consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    mbarrier.init(done.index(0), count=2)  # both consumer warpgroups' steps are over
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before its first arrive

    # K (consumer warpgroup 0), V (1) and the dQ descriptors are the consumers' to load and make (_prologue_half).
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    m_first, n_steps, n_masked = query_steps(start_n, causal_offset, seqlen_q, BLOCK_M, BLOCK_N, CAUSAL)
    # A program whose keys no query sees (causal) runs no step: its consumers store zero dK and dV.
    gl.warp_specialize([
        (_consume, (k_smem, v_smem, q_bufs, do_bufs, k2_smem, v2_smem, q2_bufs, do2_bufs, lse_bufs, delta_bufs,
                    ds_bufs, dq_a, kv_bar, full, empty, ds_ready, done, DQA, k_base,
                    stride_ks, k_smem, k2_smem, seqlen_k, DK, DV,
                    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, batch, kv_head,
                    group_size, heads_q, seqlen_q, head_dim, causal_offset, sm_scale, start_n, m_first, n_steps,
                    n_masked, BLOCK_M, CAUSAL, PREFETCH, 0, SPLIT)),
        (_consume, (k_smem, v_smem, q_bufs, do_bufs, k2_smem, v2_smem, q2_bufs, do2_bufs, lse_bufs, delta_bufs,
                    ds_bufs, dq_b, kv_bar, full, empty, ds_ready, done, DQA, v_base,
                    stride_vs, v_smem, v2_smem, seqlen_k, DK, DV,
                    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, batch, kv_head,
                    group_size, heads_q, seqlen_q, head_dim, causal_offset, sm_scale, start_n, m_first, n_steps,
                    n_masked, BLOCK_M, CAUSAL, PREFETCH, 1, SPLIT)),
        (_produce, (Q, DO, Lse, Delta, q_bufs, do_bufs, q2_bufs, do2_bufs, lse_bufs, delta_bufs, full, empty,
                    stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos, stride_lb, stride_lh, batch,
                    kv_head, group_size, seqlen_q, head_dim, m_first, n_steps, BLOCK_M, SPLIT)),
    ], [4, 1], [240, 24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(ds_ready.index(i))
    mbarrier.invalidate(done.index(0))
    mbarrier.invalidate(kv_bar.index(0))
