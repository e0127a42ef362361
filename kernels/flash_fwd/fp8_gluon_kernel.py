"""FlashAttention-3's FP8 forward for Hopper (sm_90) in Gluon: the source of ``flash_fwd_fp8_gluon``.

This file and ``gluon_tma`` (TMA copies) make the source fingerprint of ``flash_fwd_fp8_gluon``. It imports
triton: only ``lazytriton.compiler`` may import it. It compiles for ``cuda:90`` with Triton 3.6.0 (the GPU host)
and 3.9.0 (CI) from the same source (``tests/test_fp8_gluon.py`` compiles it under both).

Same parameters, grid, outputs and semantics as ``flash_fwd_fp8`` (``fp8.pack`` packs its arguments, the grid
is query blocks x heads x batch): float8 Q (B, Hq, Sq, D) and K (B, Hk, Sk, D), all e4m3 or all e5m2; V read
from its transpose Vt (B, Hk, D, Sk), the keys contiguous, in operand order with V_OPERAND_ORDER (``fp8.copy_v``;
rows padded to 16 keys, so every row starts 16-byte aligned); float32 descales per (batch, kv head) or per
tensor (a null pointer: 1.0); Out (B, Hq, Sq, D) bf16 and Lse (B, Hq, Sq) float32 in natural log. The scores are
``(q . k) * q_descale * k_descale * sm_scale`` (the descales folded into the softmax scale), P is rounded to
e4m3 for ``P @ V`` (e5m2 inputs too: sm_90's wgmma takes e4m3 x e5m2) and the output is multiplied by
v_descale in the epilogue.

What it covers (``fp8_gluon.reason`` enforces it; the rest keeps ``flash_fwd_fp8``): head dims 64, 128 and 256
(one power-of-two tile; v's head dim the same), every pointer 16-byte aligned and row strides multiples of 16
bytes (TMA), 32-bit offsets, seqlen_q a multiple of BLOCK_M and seqlen_k of BLOCK_N (no ragged tile, no bounds
masks), causal_offset >= 0 (every row sees key 0), no window, softcap, chunk or packed sequences: those
parameters are taken (the shared ABI) and never read.

The pipeline is ``flash_fwd_gluon``'s ping-pong (see ``gluon_kernel.py`` for each choice), in FP8:

- **A producer warp** (24 registers) TMA-loads K tiles (BLOCK_N x D) and Vt tiles (D x BLOCK_N) into a ring
  of ``STAGES`` buffers each (3 where a K tile is at most 16 KiB, else 2), waiting on each buffer's "empty"
  mbarrier, which both consumer partitions arrive on once their last wgmma reading it has retired.
- **Two consumer warpgroups** (240 registers each) own 64 query rows each (their Q loaded by themselves, one
  TMA tile), share every K/Vt tile and take turns (two ``turn`` mbarriers) to issue each step's wgmmas,
  S_j = Q K_j^T and O += P_{j-1} V_{j-1}, so one's softmax runs while the other's products hold the tensor
  cores; within a warpgroup the softmax of S_j runs under the PV of block j - 1 (``warpgroup_mma_wait(1)``).
- **Both FP8 wgmma operands K-major**: Hopper's FP8 wgmma reads shared-memory operands with the reduction dim
  contiguous only. Q K^T: Q's rows and K's rows hold D contiguous (K^T a permuted view). P V: the reduction is
  over keys, so B is Vt's tile (D x BLOCK_N, keys contiguous) as a permuted view; P (e4m3) comes from registers
  (the wgmma's A operand, FlashAttention-3's choice).
- **P enters the wgmma without leaving its thread** (``_operand``, with V_OPERAND_ORDER: the Python calls'). The S
  accumulator gives each thread, of every 32 keys, the columns 8i + 2q + e (i < 4, e < 2, q its lane's quad); the
  8-bit A operand wants the positions 16a + 4q + j (a < 2, j < 4), the same rows. A product over keys is the same in
  any key order, so position 16a + 4q + 2b + e takes the probability of key 16a + 8b + 2q + e, and Vt holds the keys
  in that order (``fp8.copy_v``'s operand order: digits (a, b, q, e) of each 32 keys read as (a, q, b, e)). The
  conversion is then checked trivial at compile time (``assert_trivial``): no shuffle, no shared memory. Each four
  probabilities become one register by two ``cvt.rn.satfinite.e4m3x2.f32`` (the rounding ``.to(float8e4nv)``
  compiles to), right before the wgmma that reads them: P crosses the loop as float32 (``_carried``). Without
  V_OPERAND_ORDER (the C API's plans: their callers give Vt with the keys in order) P's keys stay in order, its
  conversion exchanges values within each quad of lanes and P crosses the loop as e4m3 (~225 more instructions a
  step at 128 keys).
- **Key tiles twice as long as bf16's** where shared memory holds them: float8 is half the bytes, so 128 x 128
  at head dim 256 takes what 128 x 64 takes in bf16.
- **Output**: O x v_descale / l in bf16, stored from the accumulator's registers (no shared buffer: Q's fp8
  buffer is half an output tile), the Lse beside it.

Causal: both warpgroups run the tile's whole block count (they must run the same steps to alternate); the upper
half's last diagonal block is masked whole for some rows, exact since every row has seen key 0 in block 0.
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

from lazytriton.kernels.gluon_tma import tma_load

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


# The barrier, softmax and block-count steps of flash_fwd_gluon's ping-pong (gluon_kernel.py's, the same text: a
# kernel's key covers its own files, so each kernel keeps its copy and neither's keys move with the other's edits).


@gluon.jit
def _wait_slot(bars, block, STAGES: gl.constexpr):
    """Wait until key block ``block``'s tile has landed in its buffer."""
    mbarrier.wait(bars.index(block % STAGES), (block // STAGES) & 1)


@gluon.jit
def _wait_turn(turn, step, WG: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr):
    """Ping-pong: wait until the other consumer warpgroup has issued its wgmmas of the step before ours.

    Warpgroup 0's step s waits for warpgroup 1's arrive after its step s - 1
    (turn[0]'s completion s - 1); warpgroup 1's step s waits for warpgroup 0's
    arrive after its step s (turn[1]'s completion s). Strict alternation, so a
    waiter is never two phases behind and the parity names the phase.
    Warpgroup 0's first step waits for nobody.
    """
    if PINGPONG:
        if WG == 0:
            if not FIRST:
                mbarrier.wait(turn.index(0), (step - 1) & 1)
        else:
            mbarrier.wait(turn.index(1), step & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: our wgmmas of this step are issued; the other warpgroup may issue its own."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _scores_softmax(s, m_i, l_i, offs_m, start_n, qk_scale, causal_offset, MASKED: gl.constexpr,
                    CAUSAL: gl.constexpr):
    """Online softmax of one score tile in base 2, its first key ``start_n``: (p, alpha, m_new, l_new).

    The row max is taken on the raw scores and scaled once per row, and p is
    ``exp2(s * scale - m)`` (one FMA per element). MASKED applies the causal
    mask (the tiles are whole, so no bounds mask); every row keeps a finite m
    because causal_offset >= 0 lets every row see key 0, in the first block
    (a tile whose keys a row cannot see at all leaves its m and l as they were).
    """
    if MASKED and CAUSAL:
        KEYS: gl.constexpr = s.type.shape[1]
        cols = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s.type.layout))
        keep = cols[None, :] <= (offs_m + causal_offset)[:, None]
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _block_counts(tile_m, seqlen_k, causal_offset, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr):
    """(n_blocks, n_full) of the query tile at row ``tile_m``.

    Key blocks [0, n_full) are visible to every row, [n_full, n_blocks) hold
    the causal diagonal (both seqlen_k // BLOCK_N without CAUSAL).
    """
    n_blocks = seqlen_k // BLOCK_N
    n_full = n_blocks
    if CAUSAL:
        n_blocks = gl.minimum(n_blocks, (tile_m + TILE_M + causal_offset + BLOCK_N - 1) // BLOCK_N)
        n_full = gl.minimum(n_full, (tile_m + causal_offset + 1) // BLOCK_N)
    return n_blocks, n_full


@gluon.jit
def _carried(p, like, V_OPERAND_ORDER: gl.constexpr):
    """What crosses the loop of P_j (float32, the S accumulator's layout) to the P V wgmma of the next step.

    V_OPERAND_ORDER: P itself, which ``_operand`` converts right before that wgmma (a float8 tensor carried in
    the loop is held a byte a register and packed again: six instructions a register more). Else (V's keys in
    order, as the C API's callers give it) the e4m3 operand in ``like``'s layout, made here: its conversion
    exchanges values within each quad of lanes, and at head dim 256 carrying P in float32 spills.
    """
    if not V_OPERAND_ORDER:
        p = gl.convert_layout(p.to(gl.float8e4nv), like.type.layout)
    return p


@gluon.jit
def _operand(carried, like, V_OPERAND_ORDER: gl.constexpr):
    """The P V wgmma's e4m3 A operand in ``like``'s layout from what ``_carried`` gave.

    V_OPERAND_ORDER: position 16a + 4q + 2b + e of every 32 keys takes key 16a + 8b + 2q + e (the module's
    docstring), which leaves every value in its thread: the layout conversion is asserted trivial. Four values
    to a register, the first in the low byte: two cvt.rn.satfinite.e4m3x2.f32 (whose first source fills the
    high byte of its pair). Else the operand as carried.
    """
    p = carried
    if V_OPERAND_ORDER:
        ROWS: gl.constexpr = p.type.shape[0]
        KEYS: gl.constexpr = p.type.shape[1]
        p = gl.reshape(p, [ROWS, KEYS // 32, 2, 2, 4, 2])  # key digits (a, b, q, e)
        p = gl.permute(p, [0, 1, 2, 4, 3, 5])  # read as (a, q, b, e)
        p = gl.convert_layout(gl.reshape(p, [ROWS, KEYS]), like.type.layout, assert_trivial=True)
        p = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)
    return p


@gluon.jit
def _descale(Descale, offset):
    """One FP8 descale: the float32 at ``Descale + offset``, or 1.0 where ``Descale`` is null (a descale not given)."""
    return gl.load(Descale + offset, mask=Descale.to(gl.int64) != 0, other=1.0)


@gluon.jit
def _load_kv(k_desc, vt_desc, k_bars, v_bars, k_bufs, v_bufs, block, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA-load key block ``block``: K's rows [block x BLOCK_N, +BLOCK_N), Vt's columns there, each on its barrier."""
    slot = block % STAGES
    k_buf = k_bufs.index(slot)
    v_buf = v_bufs.index(slot)
    mbarrier.expect(k_bars.index(slot), k_buf.type.shape[0] * k_buf.type.shape[1])
    tma_load(k_desc, [block * BLOCK_N, 0], k_bars.index(slot), k_buf)
    mbarrier.expect(v_bars.index(slot), v_buf.type.shape[0] * v_buf.type.shape[1])
    tma_load(vt_desc, [0, block * BLOCK_N], v_bars.index(slot), v_buf)


@gluon.jit
def _produce(K, Vt, stride_ks, stride_vs, seqlen_k, head_dim, k_bufs, v_bufs, k_bars, v_bars, k_empty, v_empty,
             start_m, causal_offset, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CAUSAL: gl.constexpr):
    """The producer warp: K's and Vt's descriptors, then every key block, each once its buffer's readers are done.

    Block b reuses the buffer of block b - STAGES, whose release is the (b // STAGES - 1)-th completion of that
    buffer's empty barrier: parity ((b // STAGES) & 1) ^ 1, which a fresh barrier already shows for the first
    STAGES blocks (``gluon_kernel._produce``'s rule).
    """
    BLOCK_D: gl.constexpr = k_bufs.type.shape[2]
    k_desc = tma.make_tensor_descriptor(K, [seqlen_k, head_dim], [stride_ks, 1], [BLOCK_N, BLOCK_D],
                                                         k_bufs.type.layout)
    vt_desc = tma.make_tensor_descriptor(Vt, [head_dim, seqlen_k], [stride_vs, 1],
                                                          [BLOCK_D, BLOCK_N], v_bufs.type.layout)
    n_blocks, n_full = _block_counts(start_m, seqlen_k, causal_offset, TILE_M, BLOCK_N, CAUSAL)
    for block in range(n_blocks):
        slot = block % STAGES
        free = ((block // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.wait(v_empty.index(slot), free)
        _load_kv(k_desc, vt_desc, k_bars, v_bars, k_bufs, v_bufs, block, BLOCK_N, STAGES)


@gluon.jit
def _step(block, q_smem, k_bufs, v_bufs, k_bars, v_bars, k_empty, v_empty, turn, acc, m_i, l_i, p_prev, p_like,
          offs_m, qk_scale, causal_offset, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr, V_OPERAND_ORDER: gl.constexpr):
    """One ping-pong step: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued in our turn, S_j's softmax under the PV.

    ``p_prev``: P_{j-1} as ``_carried`` gives it (``_operand`` makes the A operand here); returns P_j the same way.
    """
    ROWS: gl.constexpr = q_smem.type.shape[0]
    p_op = _operand(p_prev, p_like, V_OPERAND_ORDER)
    slot = block % STAGES
    prev = (block - 1) % STAGES
    _wait_slot(k_bars, block, STAGES)
    _wait_slot(v_bars, block - 1, STAGES)  # both tiles in before taking the turn: it is held only while issuing
    _wait_turn(turn, block, WG, True, False)
    zero = gl.zeros([ROWS, BLOCK_N], dtype=gl.float32, layout=s_layout)
    s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, v_bufs.index(prev).permute((1, 0)), acc, is_async=True)
    _pass_turn(turn, WG, True)
    # wgmma groups retire in issue order: the PV left outstanding means S_j is done, the PV may not be.
    s = warpgroup_mma_wait(1, deps=(s,))
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _scores_softmax(s, m_i, l_i, offs_m, block * BLOCK_N, qk_scale, causal_offset, MASKED,
                                         CAUSAL)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return acc, m_i, l_i, _carried(p, p_like, V_OPERAND_ORDER)


@gluon.jit
def _consume(Q, Out, Lse, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim, q_smem, k_bufs, v_bufs, q_bar,
             k_bars, v_bars, k_empty, v_empty, turn, prog_m, qk_scale, v_descale, causal_offset,
             TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
             WG: gl.constexpr, V_OPERAND_ORDER: gl.constexpr):
    """Consumer warpgroup ``WG`` (0 or 1): its 64 query rows' scores, softmax, O and epilogue.

    ``Q``, ``Out``, ``Lse``: this program's (batch, head) bases; ``qk_scale`` is sm_scale x q_descale x
    k_descale x log2(e). Both warpgroups take the whole tile's block counts (they alternate step by step).
    """
    ROWS: gl.constexpr = TILE_M // 2
    BLOCK_D: gl.constexpr = q_smem.type.shape[2]
    NUM_WARPS: gl.constexpr = ROWS // 16
    # wgmma accumulators: warps stacked along M; an 8-bit wgmma's k-step is 32.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)

    start_m = prog_m + WG * ROWS
    my_q = q_smem.index(WG)
    q_desc = tma.make_tensor_descriptor(Q, [seqlen_q, head_dim], [stride_qs, 1], [ROWS, BLOCK_D],
                                                         q_smem.type.layout)
    mbarrier.expect(q_bar.index(WG), ROWS * BLOCK_D)
    tma_load(q_desc, [start_m, 0], q_bar.index(WG), my_q)
    n_blocks, n_full = _block_counts(prog_m, seqlen_k, causal_offset, TILE_M, BLOCK_N, CAUSAL)

    offs_m = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, BLOCK_D], gl.float32, layout=o_layout)

    # Block 0, peeled: its scores alone (nothing to overlap yet), always through the masked step.
    mbarrier.wait(q_bar.index(WG), 0)
    _wait_slot(k_bars, 0, STAGES)
    _wait_turn(turn, 0, WG, True, True)
    zero = gl.zeros([ROWS, BLOCK_N], dtype=gl.float32, layout=s_layout)
    s = warpgroup_mma(my_q, k_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    _pass_turn(turn, WG, True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _scores_softmax(s, m_i, l_i, offs_m, 0, qk_scale, causal_offset, True, CAUSAL)
    p_like = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=p_layout)  # the A operand's layout, by example
    p_prev = _carried(p, p_like, V_OPERAND_ORDER)

    for block in range(1, n_full):
        acc, m_i, l_i, p_prev = _step(block, my_q, k_bufs, v_bufs, k_bars, v_bars, k_empty, v_empty, turn, acc,
                                      m_i, l_i, p_prev, p_like, offs_m, qk_scale, causal_offset, s_layout, BLOCK_N,
                                      STAGES, False, CAUSAL, WG, V_OPERAND_ORDER)
    for block in range(gl.maximum(n_full, 1), n_blocks):
        acc, m_i, l_i, p_prev = _step(block, my_q, k_bufs, v_bufs, k_bars, v_bars, k_empty, v_empty, turn, acc,
                                      m_i, l_i, p_prev, p_like, offs_m, qk_scale, causal_offset, s_layout, BLOCK_N,
                                      STAGES, True, CAUSAL, WG, V_OPERAND_ORDER)

    # The last block's PV, then the epilogue.
    last = n_blocks - 1
    p_op = _operand(p_prev, p_like, V_OPERAND_ORDER)
    _wait_slot(v_bars, last, STAGES)
    _wait_turn(turn, n_blocks, WG, True, False)
    acc = warpgroup_mma(p_op, v_bufs.index(last % STAGES).permute((1, 0)), acc, is_async=True)
    _pass_turn(turn, WG, True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)

    gl.store(Lse + offs_m, (m_i + gl.log2(l_i)) * LN2)
    scale = v_descale / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    rows = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(Out + rows[:, None] * stride_os + cols[None, :], (acc * scale[:, None]).to(gl.bfloat16))


@gluon.jit
def flash_fwd_fp8_gluon_kernel(
    Q, K, V, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Seqused_q, Seqused_k, Q_descale, K_descale, V_descale,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk, stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    sm_scale, softcap,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, EVEN_D: gl.constexpr,
    CAUSAL: gl.constexpr, V_OPERAND_ORDER: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    gl.static_assert(BLOCK_M == 2 * 16 * NUM_WARPS, "two consumer warpgroups of 16 rows a warp: BLOCK_M = 32 x warps")
    dtype: gl.constexpr = Q.dtype.element_ty
    # 3 stages where a K tile is at most 16 KiB (fp8_gluon.stages), else 2.
    STAGES: gl.constexpr = 3 if BLOCK_D * BLOCK_N <= 128 * 128 else 2
    ROWS: gl.constexpr = BLOCK_M // 2

    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    head = gl.program_id(1)
    batch = gl.program_id(2)
    kv_head = head // group_size
    qk_scale = (sm_scale * LOG2E * _descale(Q_descale, batch * stride_qdb + kv_head * stride_qdh)
                * _descale(K_descale, batch * stride_kdb + kv_head * stride_kdh))
    v_descale = _descale(V_descale, batch * stride_vdb + kv_head * stride_vdh)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_D], dtype)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_D, BLOCK_N], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_D], q_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], k_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_D, BLOCK_N], v_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrive from each consumer partition
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before its first arrive

    q_base = Q + batch * stride_qb + head * stride_qh
    k_base = K + batch * stride_kb + kv_head * stride_kh
    vt_base = V + batch * stride_vb + kv_head * stride_vh
    o_base = Out + batch * stride_ob + head * stride_oh
    lse_base = Lse + batch * stride_lb + head * stride_lh
    gl.warp_specialize([(_consume, (q_base, o_base, lse_base, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim,
                                    q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, k_empty, v_empty, turn, start_m,
                                    qk_scale, v_descale, causal_offset, BLOCK_M, BLOCK_N, STAGES, CAUSAL, 0,
                                    V_OPERAND_ORDER)),
                        (_consume, (q_base, o_base, lse_base, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim,
                                    q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, k_empty, v_empty, turn, start_m,
                                    qk_scale, v_descale, causal_offset, BLOCK_M, BLOCK_N, STAGES, CAUSAL, 1,
                                    V_OPERAND_ORDER)),
                        (_produce, (k_base, vt_base, stride_ks, stride_vs, seqlen_k, head_dim, k_bufs, v_bufs,
                                    k_bars, v_bars, k_empty, v_empty, start_m, causal_offset, BLOCK_M, BLOCK_N,
                                    STAGES, CAUSAL))],
                       [NUM_WARPS, 1], [240, 24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
        mbarrier.invalidate(q_bar.index(i))
