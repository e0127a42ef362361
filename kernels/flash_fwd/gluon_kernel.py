"""FlashAttention-3-style forward for Hopper (sm_90) in Gluon: the source of ``flash_fwd_gluon``.

This is the only file the source fingerprint of ``flash_fwd_gluon`` covers,
so everything the kernel calls lives here. It imports triton: only
``lazytriton.compiler`` may import it. It compiles for ``cuda:90`` with
Triton 3.6.0 (the GPU host) and 3.9.0 (CI) alike, from the same source: every
name it uses exists in both (``tests/test_gluon_fwd.py`` compiles it under
whichever is installed; the 3.6 venv of the brief runs the same test).

Same parameters, grid, outputs and semantics as ``flash_fwd`` (the binding
launches it unchanged): q (B, Hq, Sq, D), k and v (B, Hk, Sk, D), Out like q,
Lse (B, Hq, Sq) float32 in natural log; query head h reads key/value head
h // group_size; causal keeps key j for query i when j <= i + causal_offset.
Program (x, h, b) computes query rows [x', x' + BLOCK_M) of (b, h), heaviest
causal blocks first, as flash_fwd does.

What it covers (dispatch.flash_fwd_gluon_reason enforces it; the rest keeps
the Triton kernel): fp16/bf16, any head dim from 16 to 256 that is a multiple
of 8 (``gluon.chunks`` picks the tiles: one power-of-two tile, two chunks, or
the padded tile; see "Head dims" below), every
pointer 16-byte aligned and row strides multiples of 16 bytes (a TMA
descriptor needs both), 32-bit offsets, seqlen_q a multiple of BLOCK_M and
seqlen_k of BLOCK_N (no ragged tile: no bounds masks at all), causal_offset
>= 0 (every row sees key 0, so no row is empty and m never stays -inf), no
window, softcap, ALiBi, bias, dropout or varlen (nor its seqused lengths). Those
parameters are taken (the shared ABI) and never read.

``SINKS`` (flash_fwd's flag: gpt-oss's attention sinks) is the one feature it
carries: each consumer warpgroup's epilogue puts its query head's sink logit
(``Sinks``, float32) into its rows' denominator and lse (``_with_sink``); the
pipeline is untouched. Off (absent from a variant), it compiles away.

The pipeline, and why each choice:

- **TMA loads into a shared-memory ring.** Q is loaded once; K and V go
  through ``STAGES`` buffers each (3 when a K tile is at most 16 KiB, else
  2: 160 KiB of shared memory with Q at head dim 128 and 128x128 tiles,
  under sm_90's 227 KiB; a third stage there would leave no room for a
  second CTA or the output tile and FlashAttention-3 uses 2 there; head
  dim 256 takes 128x64 tiles, Q 64 KiB and four 32 KiB buffers, 192 KiB,
  FlashAttention-3's hdim256 ring). A 256-wide row is 512 bytes, over the
  128-byte swizzle span of one TMA box: Triton splits each copy into four
  64-column boxes (issued by four warps, or all four by the producer warp),
  one barrier and byte count for the whole tile as before. Registers at
  head dim 256 (ptxas 13.4 -v, sm_90a): O is 64x256 fp32 per warpgroup,
  128 a thread; 217 (247 causal) of 255 at 128x64x8, 240 per consumer
  with the producer warp or ping-pong; no spills in any of them.
  Each buffer has its own mbarrier;
  ``mbarrier.expect`` + ``tma.async_copy_global_to_shared`` fill it, and the
  consumer waits on the barrier's phase (block j uses buffer j % STAGES,
  phase (j // STAGES) & 1). K and V have separate barriers because they are
  consumed at different times (K by block j's QK^T, V by block j-1's PV), so
  each is refilled as soon as its own reader has retired.
- **Descriptors made on the device** (``tma.make_tensor_descriptor`` over
  this program's (batch, head) (seqlen, head_dim) slice): the launcher takes
  no 128-byte CUtensorMap by value, and device-side descriptors need only
  Triton's hidden global scratch, which lazytriton's launcher allocates
  (128 bytes a descriptor: Q, K, V and Out, twice each with SPLIT but at
  96, 160 and 192, where one serves both chunks: ``kernels/gluon_tma.py``,
  +2-6% at 1k and 4k on the H200, 17th session). Any
  (batch, head) strides work. Each one is written to that scratch and
  fenced at GPU scope, ~0.7 µs of its partition's time on the H200, on
  every CTA: so each load is issued as soon as its own descriptor exists
  (Q's, then K's tiles, then V's), and Out's descriptor, which only the
  epilogue needs, is built last, while the tiles are in flight. With
  ping-pong each partition makes the ones it uses, at once: each consumer
  warpgroup Q's (loading its own half) and Out's, the producer warp K's and
  V's (with several query tiles the producer makes Q's and loads every Q,
  the consumers make Out's alone), so six descriptors a program (five with
  several tiles). This prologue weighs most where a CTA has few key
  blocks: short sequences and causal tiles (made in turn before the
  partitions split, it cost the 1k causal rows at split head dims 5-8%:
  benchmarks/NOTES.md, 12-02).
- **Async wgmma for both products.** QK^T reads Q and K from shared memory
  (K transposed by a permuted view, no copy); PV takes P from registers
  (FlashAttention-3's choice: P never goes through shared memory) and V
  from shared memory. The accumulators use an NVMMA (wgmma v3) layout with
  warps stacked along M, so each warpgroup owns 64 query rows: num_warps 8
  gives BLOCK_M 128 = two consumer warpgroups sharing each K/V tile.
- **Softmax overlapped with the next wgmma** (FlashAttention-3's
  intra-warpgroup pipelining): iteration j issues S_j = Q K_j^T, then
  O += P_{j-1} V_{j-1}, waits only for S_j (``warpgroup_mma_wait(1)``:
  wgmma groups retire in order) and runs the softmax of S_j while the PV
  product of the previous block is still on the tensor cores; then it waits
  for O, rescales it by alpha_j, and refills the two freed buffers with the
  tiles STAGES blocks ahead. The first block is peeled (its softmax has no
  PV to hide behind) and the last PV is issued after the loop.
- **Unmasked and masked loops.** Keys [0, full_end) are visible to every
  row of the block (no mask work); the causal diagonal blocks follow with
  the mask. The peeled first block always takes the masked step (exact for
  any block; it runs once).
- **Head dims** (BLOCK_D, BLOCK_D2, EVEN_D from ``gluon.chunks``). A
  power of two is one tile. A head dim that two power-of-two chunks hold in
  less than its padded tile (96 = 64 + 32, 192 = 128 + 64; Gluon's tensors
  and shared buffers must have power-of-two shapes) has a second set of Q,
  K, V buffers and descriptors for its columns [BLOCK_D, BLOCK_D + BLOCK_D2):
  both chunks load on one barrier, S = Q K^T is two wgmmas into one
  accumulator, O += P V two wgmmas into two (``acc2``), and each chunk goes
  out through its own Q buffer. Nothing padded is multiplied. The others
  (224) run in their padded tile. Every descriptor's extent is the head dim,
  so TMA fills the columns past it with zeros (which add nothing to Q K^T
  and make zero output columns) and the store never writes them.
- **Output through shared memory and a TMA store**, reusing Q's buffer
  (Q is dead once the last QK^T has retired): saves 16-32 KiB.

- **A producer warp, optionally** (``PRODUCER=true``, warp
  specialisation through ``gl.warp_specialize``, same signature in 3.6 and
  3.9): one warp issues every K/V load, waiting on an "empty" mbarrier per
  buffer that the consumer partition arrives on as soon as a buffer's last
  wgmma has retired (K_j right after S_j, V_{j-1} after O). Gluon lowers a
  partition's arrive as a bar.sync of its 256 threads and one thread's
  arrive (read from the PTX), so one arrival per release is right. It takes
  24 registers and the two consumer warpgroups 240 (setmaxnreg); the entry
  runs 12 warps (the one-warp partition padded to a warpgroup). Without it
  the consumers issue the refills themselves, after a CTA barrier that
  Triton's shared-memory analysis inserts before each TMA write. Which is
  faster is for the H200 to say (benchmarks/probe_gluon.py times both).

- **Ping-pong, optionally** (``PINGPONG=true``, with PRODUCER:
  FlashAttention-3's schedule). Two consumer partitions of num_warps (4)
  each own one half of the BLOCK_M = 128 query rows (Q loaded as two 64-row
  TMA tiles), share every K/V tile (their empty barriers take one arrive from
  each), and take turns to issue wgmmas: two mbarriers ``turn`` order them
  (warpgroup 0 issues step s after warpgroup 1 issued step s - 1, warpgroup 1
  issues step s after warpgroup 0 issued step s; a step is the pair
  S_j = Q K_j^T, O += P_{j-1} V_{j-1}), so one's softmax runs while the
  other's products hold the tensor cores, on top of the intra-warpgroup
  overlap above. Both run the whole tile's block counts (they must run the
  same steps to alternate). Causal at 128 x 128, seqlen_q and seqlen_k are
  multiples of 128 and so is the causal offset: where a tile holds the
  diagonal (its last key block), warpgroup 0's rows see exactly that
  block's first 64 keys, and it takes the block in a half step (S, the
  softmax and the last PV over those keys; up to a width of 96, where ptxas
  3.6 keeps it without a spill). At 128 x 64 the upper half's last block is
  masked whole, exact since its rows have all seen key 0. Registers: 240 per consumer
  thread, 24 for the producer (setmaxnreg; 504 of 512); each partition syncs
  on its own named barrier (0 and 2, read from the PTX). The entry runs 12
  warps. Without PINGPONG no ``turn`` barrier is allocated, so the other
  tilings compile as before (same shared memory).

- **Three consumer warpgroups, optionally** (the wide tiles: BLOCK_M 192
  at num_warps 4, with PRODUCER and without PINGPONG; FlashAttention-3's
  forward at head dim 64). Three partitions of 64 rows each share every
  K/V tile (the empty barriers take three arrives) and run without turns,
  the warp schedulers interleaving their products and softmaxes; 160
  registers a consumer thread (168 for the default partition), 24 for the
  producer, 16 warps in all. K/V traffic a FLOP falls by a third against
  128-row tiles. Each partition stops at its own rows' last key block
  (causal: the lower rows' diagonal comes sooner) and then releases the
  rest of the tile's blocks unread, each once it has landed, so the
  producer's wait on its buffer holds. 192 rows do not divide the usual
  seqlens, so the tiles are laid out from seqlen_q down (a multiple of 64):
  the last program, the lowest rows, starts before row 0, and a partition
  with no rows there makes no descriptor and only releases. Causal, that
  program is the lightest; laid out from row 0 the ragged one held the
  longest rows with a third of its warpgroups busy.

- **Several query tiles a program, optionally** (``BLOCK_TILES`` = n > 1,
  with PINGPONG; dispatch.GLUON_Q_TILES picks n for short sequences). The
  program's BLOCK_M rows are n ping-pong tiles of BLOCK_M / n rows, walked
  one after another: the four descriptors are made once, and the producer
  warp loads every tile's Q (two buffers where both fit beside the ring:
  tile t's in buffer t % 2, refilled once both consumer partitions have
  released it, after tile t - 2's output went out through it; else one,
  refilled once tile t - 1's output went out, as at head dim 160 in 128 x
  128 tiles or 256) and K/V tiles through one ring whose position and
  phases run on across tiles, so the next tile's first key blocks (and with
  two buffers its Q) land while this tile's last steps and epilogue run.
  With two Q buffers a consumer does not wait for its tile's output store
  (out of its Q buffer) at the tile's end: it waits after the next tile's
  first step, by when the store has read the buffer, and releases the
  buffer then (with one, the next Q needs it at once). The consumers release the
  last V buffer of each tile too (a later tile's loads wait for it), and the
  ping-pong steps count on across tiles (a tile of n_blocks key blocks takes
  n_blocks + 1). Causal programs pair their tiles: program i of P walks
  tiles [i n / 2, (i + 1) n / 2) and then their mirrors from the top (tile j
  with tile P n - 1 - j, ``_tile_row``), so every program holds the same key
  blocks; in order the highest tiles' programs held most (n = 2 at 1k: 30
  key blocks against 6) and the grid's last wave waited on them. The grid is
  unchanged (BLOCK_M is the program's rows), so the
  binding and the C launcher launch it as any other variant. Not a persistent
  grid over (batch, head): the program count still follows the shape.
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

from lazytriton.kernels.gluon_tma import copy_in, copy_out, descriptors

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_tile(desc, desc2, bar, buf, buf2, row, SPLIT: gl.constexpr, pred=True):
    """TMA-load the tile of ``row`` into ``buf`` (and with SPLIT its second head-dim chunk into ``buf2``) on ``bar``.

    One barrier and one byte count for both chunks: a box that runs past the
    head dim is zero-filled and still counts whole. The descriptors are
    ``gluon_tma.descriptors``' (the second chunk at column BLOCK_D).
    """
    BLOCK_D: gl.constexpr = buf.type.shape[1]
    WIDTH: gl.constexpr = BLOCK_D + buf2.type.shape[1] if SPLIT else BLOCK_D
    mbarrier.expect(bar, buf.type.shape[0] * WIDTH * buf.dtype.primitive_bitwidth // 8, pred=pred)
    copy_in(desc, row, 0, bar, buf, pred=pred)
    if SPLIT:
        copy_in(desc2, row, BLOCK_D, bar, buf2, pred=pred)


@gluon.jit
def _load_q(q_desc, q2_desc, bar, q_smem, q2_smem, first, row, WGS: gl.constexpr, SPLIT: gl.constexpr):
    """TMA-load a query tile's WGS row blocks (one a consumer warpgroup) into Q buffers ``first`` on, on ``bar``."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    BLOCK_D: gl.constexpr = q_smem.type.shape[2]
    WIDTH: gl.constexpr = BLOCK_D + q2_smem.type.shape[2] if SPLIT else BLOCK_D
    mbarrier.expect(bar, WGS * ROWS * WIDTH * q_smem.dtype.primitive_bitwidth // 8)
    for w in gl.static_range(WGS):
        copy_in(q_desc, row + w * ROWS, 0, bar, q_smem.index(first + w))
        if SPLIT:
            copy_in(q2_desc, row + w * ROWS, BLOCK_D, bar, q2_smem.index(first + w))


@gluon.jit
def _issue_load(desc, desc2, bars, bufs, bufs2, block, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                SPLIT: gl.constexpr):
    """Start the TMA load of key block ``block`` into buffer ``block % STAGES`` (nothing past the last block)."""
    slot = block % STAGES
    _load_tile(desc, desc2, bars.index(slot), bufs.index(slot), bufs2.index(slot), block * BLOCK_N, SPLIT,
               pred=block < n_blocks)


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
def _with_sink(m_i, l_i, sink):
    """(divisor of acc, lse) with the sink logit ``sink`` (natural log) in each row's denominator.

    m_i is finite here (every row sees key 0), so the max with the sink is too; the divisor is
    the denominator in m_i's terms, l_i + exp2(sink2 - m_i), written as l / alpha.
    """
    sink2 = sink * LOG2E
    m_f = gl.maximum(m_i, sink2)
    alpha = gl.exp2(m_i - m_f)
    l_f = l_i * alpha + gl.exp2(sink2 - m_f)
    return l_f / alpha, (m_f + gl.log2(l_f)) * LN2


@gluon.jit
def _scores(q_smem, q2_smem, k_buf, k2_buf, zero, SPLIT: gl.constexpr):
    """Issue S = Q K^T (async): over the second head-dim chunk too with SPLIT, into the same accumulator."""
    s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
    if SPLIT:
        s = warpgroup_mma(q2_smem, k2_buf.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _attend(block, n_blocks, q_smem, q2_smem, k_desc, k2_desc, v_desc, v2_desc, k_bufs, k2_bufs, v_bufs, v2_bufs,
            k_bars, v_bars, k_empty, v_empty, turn, acc, acc2, m_i, l_i, p_prev, offs_m, qk_scale, causal_offset, g0,
            s0, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
            CAUSAL: gl.constexpr, PRODUCER: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
            SPLIT: gl.constexpr, KEYS: gl.constexpr = 0):
    """One pipelined step: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight, softmax of S_j under the PV.

    ``g0``: the ring position of this tile's key block 0 (0 but in a program walking several query tiles,
    BLOCK_TILES, where the ring and its phases run on across tiles); ``s0``: likewise for the ping-pong steps.
    With SPLIT each product is two wgmmas, one per head-dim chunk (acc2: O's second chunk). KEYS (0: all
    BLOCK_N): the block's first KEYS keys alone (a half step, ``_consume``), in ``s_layout`` of that width; P
    comes back that wide.
    """
    BLOCK_M: gl.constexpr = q_smem.type.shape[0]
    WIDTH: gl.constexpr = KEYS if KEYS > 0 else BLOCK_N
    ring = g0 + block
    slot = ring % STAGES
    prev = (ring - 1) % STAGES
    _wait_slot(k_bars, ring, STAGES)
    if PINGPONG:  # both tiles in before taking the turn: the turn is held only while issuing
        _wait_slot(v_bars, ring - 1, STAGES)
        _wait_turn(turn, s0 + block, WG, PINGPONG, False)
    zero = gl.zeros([BLOCK_M, WIDTH], dtype=gl.float32, layout=s_layout)
    if KEYS > 0:
        s = _scores(q_smem, q2_smem, k_bufs.index(slot).slice(0, KEYS), k2_bufs.index(slot).slice(0, KEYS), zero,
                    SPLIT)
    else:
        s = _scores(q_smem, q2_smem, k_bufs.index(slot), k2_bufs.index(slot), zero, SPLIT)
    if not PINGPONG:
        _wait_slot(v_bars, ring - 1, STAGES)
    acc = warpgroup_mma(p_prev, v_bufs.index(prev), acc, is_async=True)
    if SPLIT:
        acc2 = warpgroup_mma(p_prev, v2_bufs.index(prev), acc2, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    # wgmma groups retire in issue order: the PV's left outstanding means S_j is done, the PV may not be.
    s = warpgroup_mma_wait(2 if SPLIT else 1, deps=(s,))
    if PRODUCER:  # K_j's buffer is free: the producer warp may refill it while the softmax runs
        mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _scores_softmax(s, m_i, l_i, offs_m, block * BLOCK_N, qk_scale, causal_offset, MASKED,
                                         CAUSAL)
    if SPLIT:
        acc, acc2, p_prev = warpgroup_mma_wait(0, deps=(acc, acc2, p_prev))
        acc2 = acc2 * gl.convert_layout(alpha, gl.SliceLayout(1, acc2.type.layout))[:, None]
    else:
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    if PRODUCER:
        mbarrier.arrive(v_empty.index(prev), count=1)
    else:  # both readers have retired: K_j's buffer takes K_{j+STAGES}, V_{j-1}'s takes V_{j-1+STAGES}
        _issue_load(k_desc, k2_desc, k_bars, k_bufs, k2_bufs, block + STAGES, n_blocks, BLOCK_N, STAGES, SPLIT)
        _issue_load(v_desc, v2_desc, v_bars, v_bufs, v2_bufs, block - 1 + STAGES, n_blocks, BLOCK_N, STAGES, SPLIT)
    p_prev = gl.convert_layout(p.to(q_smem.dtype), p_prev.type.layout)
    return acc, acc2, m_i, l_i, p_prev


@gluon.jit
def _produce(k_desc, k2_desc, v_desc, v2_desc, k_bufs, k2_bufs, v_bufs, v2_bufs, k_bars, v_bars, k_empty, v_empty,
             n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """The producer warp (PRODUCER=true): K and V tiles in block order, each once its buffer's last reader is done.

    Block b reuses the buffer of block b - STAGES, whose release is the
    (b // STAGES - 1)-th completion of that buffer's empty barrier: parity
    ((b // STAGES) & 1) ^ 1, which a fresh barrier already shows for the
    first STAGES blocks. Block 0 was loaded with Q (the kernel's prologue).
    """
    for block in range(1, n_blocks):  # block 0's tiles went out with Q, before the partitions split
        free = ((block // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(block % STAGES), free)
        _issue_load(k_desc, k2_desc, k_bars, k_bufs, k2_bufs, block, n_blocks, BLOCK_N, STAGES, SPLIT)
        mbarrier.wait(v_empty.index(block % STAGES), free)
        _issue_load(v_desc, v2_desc, v_bars, v_bufs, v2_bufs, block, n_blocks, BLOCK_N, STAGES, SPLIT)


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
def _tile_row(prog_m, t, seqlen_q, TILES: gl.constexpr, TILE_M: gl.constexpr, CAUSAL: gl.constexpr):
    """The first row of query tile ``t`` of a program walking TILES tiles from ``prog_m``.

    Without CAUSAL the tiles follow each other. With it a program's first
    TILES / 2 tiles are its own, from ``prog_m``, and the rest their mirrors
    from the top (tile j's partner is tile N - 1 - j of seqlen_q's N, a
    multiple of the program's rows: gluon.reason), so every program holds the
    same key blocks (flash_fwd_gluon_kernel's start rows).
    """
    row = prog_m + t * TILE_M
    if CAUSAL:
        if t >= TILES // 2:
            row = seqlen_q - prog_m - (TILES - t) * TILE_M
    return row


@gluon.jit
def _produce_tiles(q_desc, q2_desc, k_desc, k2_desc, v_desc, v2_desc, q_smem, q2_smem, k_bufs, k2_bufs, v_bufs,
                   v2_bufs, q_bar, q_empty, k_bars, v_bars, k_empty, v_empty, prog_m, seqlen_q, seqlen_k,
                   causal_offset, TILES: gl.constexpr, TILE_M: gl.constexpr, WGS: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    """The producer warp of a program walking TILES query tiles (BLOCK_TILES): each tile's Q, then its K and V tiles.

    Q goes through QBUFS buffers (tile t in buffer t % QBUFS, refilled once both consumer partitions released
    it after tile t - QBUFS's output went out through it), K and V through the one ring whose position runs on
    across tiles (``g``), so the next tile's first key blocks (and with two buffers its Q) load under this
    tile's last steps and epilogue. Every wait follows ``_produce``'s parity rule. Tile 0's Q and key block 0
    are loaded before (``_produce_part``).
    """
    QBUFS: gl.constexpr = q_smem.type.shape[0] // WGS
    g = 0
    for t in range(TILES):
        tile_m = _tile_row(prog_m, t, seqlen_q, TILES, TILE_M, CAUSAL)
        n_blocks, n_full = _block_counts(tile_m, seqlen_k, causal_offset, TILE_M, BLOCK_N, CAUSAL)
        buf = t % QBUFS
        if t > 0:  # tile 0's Q and key block 0 went out in _produce_part, between its descriptors
            mbarrier.wait(q_empty.index(buf), ((t // QBUFS) & 1) ^ 1)
            _load_q(q_desc, q2_desc, q_bar.index(buf), q_smem, q2_smem, buf * WGS, tile_m, WGS, SPLIT)
        for block in range(1 - gl.minimum(t, 1), n_blocks):
            ring = g + block
            slot = ring % STAGES
            free = ((ring // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free)
            _load_tile(k_desc, k2_desc, k_bars.index(slot), k_bufs.index(slot), k2_bufs.index(slot),
                       block * BLOCK_N, SPLIT)
            mbarrier.wait(v_empty.index(slot), free)
            _load_tile(v_desc, v2_desc, v_bars.index(slot), v_bufs.index(slot), v2_bufs.index(slot),
                       block * BLOCK_N, SPLIT)
        g += n_blocks


@gluon.jit
def _produce_part(Q, K, V, stride_qs, stride_ks, stride_vs, seqlen_q, seqlen_k, head_dim, q_smem, q2_smem,
                  k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar, q_empty, k_bars, v_bars, k_empty, v_empty, prog_m,
                  causal_offset, TILES: gl.constexpr, TILE_M: gl.constexpr, WGS: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    """The producer warp of 2 or 3 consumer partitions, with its prologue: K's, V's and (TILES > 1) Q's descriptors.

    ``Q``, ``K``, ``V``: this program's (batch, head) bases. Each load goes
    out as soon as its descriptor exists (Q's first tile, K's block 0, then
    V's), while the consumer warpgroups make their own: a descriptor made on
    the device costs ~0.7 µs of its partition's time, and made in turn before
    the partitions split (four, eight with SPLIT) they held every program's
    first step back (the backward's trace, benchmarks/probe_fused_steps.py).
    With one tile the consumers load their own Q rows.
    """
    if TILES > 1:
        q_desc, q2_desc = descriptors(Q, seqlen_q, head_dim, stride_qs, q_smem, q2_smem, SPLIT)
        _load_q(q_desc, q2_desc, q_bar.index(0), q_smem, q2_smem, 0, prog_m, WGS, SPLIT)
    k_desc, k2_desc = descriptors(K, seqlen_k, head_dim, stride_ks, k_bufs, k2_bufs, SPLIT)
    _load_tile(k_desc, k2_desc, k_bars.index(0), k_bufs.index(0), k2_bufs.index(0), 0, SPLIT)
    v_desc, v2_desc = descriptors(V, seqlen_k, head_dim, stride_vs, v_bufs, v2_bufs, SPLIT)
    _load_tile(v_desc, v2_desc, v_bars.index(0), v_bufs.index(0), v2_bufs.index(0), 0, SPLIT)
    if TILES > 1:
        _produce_tiles(q_desc, q2_desc, k_desc, k2_desc, v_desc, v2_desc, q_smem, q2_smem, k_bufs, k2_bufs, v_bufs,
                       v2_bufs, q_bar, q_empty, k_bars, v_bars, k_empty, v_empty, prog_m, seqlen_q, seqlen_k,
                       causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, SPLIT)
    else:
        n_blocks, n_full = _block_counts(prog_m, seqlen_k, causal_offset, TILE_M, BLOCK_N, CAUSAL)
        _produce(k_desc, k2_desc, v_desc, v2_desc, k_bufs, k2_bufs, v_bufs, v2_bufs, k_bars, v_bars, k_empty,
                 v_empty, n_blocks, BLOCK_N, STAGES, SPLIT)


@gluon.jit
def _consume_part(Q, Out, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim, q_smem, q2_smem, k_bufs, k2_bufs,
                  v_bufs, v2_bufs, q_bar, q_empty, k_bars, v_bars, k_empty, v_empty, turn, lse_base, prog_m,
                  sm_scale, causal_offset, TILES: gl.constexpr, TILE_M: gl.constexpr, WGS: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr,
                  SPLIT: gl.constexpr, sink, SINKS: gl.constexpr):
    """Consumer warpgroup ``WG`` of ``WGS`` with its share of the prologue: Out's descriptors, and Q's with one tile.

    Two partitions take turns (ping-pong), three run freely (the wide
    tiles). With one tile a program, the warpgroup makes Q's descriptor and
    loads its own rows (barrier ``q_bar[WG]``), then makes Out's while Q and
    the producer's K are in flight. The K/V descriptors ``_consume`` takes are
    the producer's to use (PRODUCER): Out's stand in for them, never read.
    """
    ROWS: gl.constexpr = TILE_M // WGS
    PINGPONG: gl.constexpr = WGS == 2
    if TILES > 1:
        # ``_consume`` for each tile: tile t's rows are in Q buffer t % QBUFS, released to the producer after the
        # tile's output went out through it; the ring position and the ping-pong step count run on across tiles.
        QBUFS: gl.constexpr = q_smem.type.shape[0] // WGS
        o_desc, o2_desc = descriptors(Out, seqlen_q, head_dim, stride_os, q_smem, q2_smem, SPLIT)
        g = 0
        step = 0
        for t in range(TILES):
            tile_m = _tile_row(prog_m, t, seqlen_q, TILES, TILE_M, CAUSAL)
            n_blocks, n_full = _block_counts(tile_m, seqlen_k, causal_offset, TILE_M, BLOCK_N, CAUSAL)
            buf = t % QBUFS
            # With two Q buffers the tile's output store is waited for after the next tile's first step, which
            # then releases its buffer (DEFER); with one the next Q needs the buffer at once.
            _consume(q_smem.index(buf * WGS + WG), q2_smem.index(buf * WGS + WG), o_desc, o2_desc, o_desc, o2_desc,
                     k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar.index(buf), (t // QBUFS) & 1, k_bars, v_bars, k_empty,
                     v_empty, turn, o_desc, o2_desc, lse_base, tile_m + WG * ROWS, n_blocks, n_full, sm_scale,
                     causal_offset, g, step, BLOCK_N, STAGES, CAUSAL, True, WG, True, SPLIT, False, True,
                     q_empty.index((t + 1) % QBUFS), t > 0, QBUFS == 2, sink=sink, SINKS=SINKS)
            if QBUFS == 1:
                mbarrier.arrive(q_empty.index(buf), count=1)
            g += n_blocks
            step += n_blocks + 1
        tma.store_wait(0)
    elif PINGPONG:
        q_desc, q2_desc = descriptors(Q, seqlen_q, head_dim, stride_qs, q_smem, q2_smem, SPLIT)
        start_m = prog_m + WG * ROWS
        _load_tile(q_desc, q2_desc, q_bar.index(WG), q_smem.index(WG), q2_smem.index(WG), start_m, SPLIT)
        o_desc, o2_desc = descriptors(Out, seqlen_q, head_dim, stride_os, q_smem, q2_smem, SPLIT)
        # Both warpgroups take the whole tile's block counts (they must run the same steps to alternate): the
        # upper half's extra diagonal block is masked, exact since every row has already seen key 0.
        n_blocks, n_full = _block_counts(prog_m, seqlen_k, causal_offset, TILE_M, BLOCK_N, CAUSAL)
        _consume(q_smem.index(WG), q2_smem.index(WG), o_desc, o2_desc, o_desc, o2_desc, k_bufs, k2_bufs, v_bufs,
                 v2_bufs, q_bar.index(WG), 0, k_bars, v_bars, k_empty, v_empty, turn, o_desc, o2_desc, lse_base,
                 start_m, n_blocks, n_full, sm_scale, causal_offset, 0, 0, BLOCK_N, STAGES, CAUSAL, True, WG, True,
                 SPLIT, sink=sink, SINKS=SINKS)
    else:
        # The wide tiles: partitions without turns, each on its own rows' key blocks (causal: fewer for the lower
        # rows), then releasing the rest of the tile's blocks, which the producer loads for the others. The last
        # program may start before row 0 (the tiles end at seqlen_q, a multiple of ROWS): a partition with no
        # rows there only releases.
        start_m = prog_m + WG * ROWS
        n_tile, _ = _block_counts(prog_m, seqlen_k, causal_offset, TILE_M, BLOCK_N, CAUSAL)
        n_blocks, n_full = _block_counts(start_m, seqlen_k, causal_offset, ROWS, BLOCK_N, CAUSAL)
        if start_m < 0:
            n_blocks = 0
        if n_blocks > 0:
            q_desc, q2_desc = descriptors(Q, seqlen_q, head_dim, stride_qs, q_smem, q2_smem, SPLIT)
            _load_tile(q_desc, q2_desc, q_bar.index(WG), q_smem.index(WG), q2_smem.index(WG), start_m, SPLIT)
            o_desc, o2_desc = descriptors(Out, seqlen_q, head_dim, stride_os, q_smem, q2_smem, SPLIT)
            _consume(q_smem.index(WG), q2_smem.index(WG), o_desc, o2_desc, o_desc, o2_desc, k_bufs, k2_bufs,
                     v_bufs, v2_bufs, q_bar.index(WG), 0, k_bars, v_bars, k_empty, v_empty, turn, o_desc, o2_desc,
                     lse_base, start_m, n_blocks, n_full, sm_scale, causal_offset, 0, 0, BLOCK_N, STAGES, CAUSAL,
                     True, WG, False, SPLIT, True, True, sink=sink, SINKS=SINKS)
        _release(k_bars, v_bars, k_empty, v_empty, n_blocks, n_tile, STAGES)


@gluon.jit
def _release(k_bars, v_bars, k_empty, v_empty, first, n_blocks, STAGES: gl.constexpr):
    """Release key blocks [first, n_blocks) unread: each buffer once its tile has landed.

    Waiting for the tile keeps each arrive in its own phase: the load of
    block b went out only after block b - STAGES's release was complete.
    """
    for block in range(first, n_blocks):
        _wait_slot(k_bars, block, STAGES)
        mbarrier.arrive(k_empty.index(block % STAGES), count=1)
        _wait_slot(v_bars, block, STAGES)
        mbarrier.arrive(v_empty.index(block % STAGES), count=1)


@gluon.jit
def _last_pv(p, v_buf, v2_buf, v_bars, v_empty, turn, acc, acc2, last, step, STAGES: gl.constexpr, WG: gl.constexpr,
             PINGPONG: gl.constexpr, SPLIT: gl.constexpr, RELEASE_LAST: gl.constexpr):
    """O += P V of the tile's last key block (ring position ``last``, ping-pong step ``step``), waited for.

    ``v_buf``/``v2_buf``: that block's V buffers, or their first rows where P is narrower (a half step).
    RELEASE_LAST: the buffer goes back to the producer (a later tile's loads need it).
    """
    _wait_slot(v_bars, last, STAGES)
    _wait_turn(turn, step, WG, PINGPONG, False)
    acc = warpgroup_mma(p, v_buf, acc, is_async=True)
    if SPLIT:
        acc2 = warpgroup_mma(p, v2_buf, acc2, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    if SPLIT:
        acc, acc2, p = warpgroup_mma_wait(0, deps=(acc, acc2, p))
    else:
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    if RELEASE_LAST:
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    return acc, acc2


@gluon.jit
def _store_out(acc, l_o, q_smem, o_desc, start_m, col):
    """O's chunk ``acc`` / l to rows from ``start_m`` and columns from ``col``, through ``q_smem`` and a TMA store.

    ``q_smem`` is Q's buffer, free now; ``o_desc`` is ``gluon_tma.descriptors``' (the second chunk at BLOCK_D).
    """
    q_smem.store((acc / l_o[:, None]).to(q_smem.dtype))
    fence_async_shared()
    copy_out(o_desc, start_m, col, q_smem)


@gluon.jit
def _consume(q_smem, q2_smem, k_desc, k2_desc, v_desc, v2_desc, k_bufs, k2_bufs, v_bufs, v2_bufs, q_ready, q_phase,
             k_bars, v_bars, k_empty, v_empty, turn, o_desc, o2_desc, lse_base, start_m, n_blocks, n_full, sm_scale,
             causal_offset, g0, s0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
             PRODUCER: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr, SPLIT: gl.constexpr,
             FIRST: gl.constexpr = True, RELEASE_LAST: gl.constexpr = False, q_prev_empty=None, pending=False,
             DEFER: gl.constexpr = False, sink=None, SINKS: gl.constexpr = False):
    """The consumer warpgroups: Q's scores against every key block, the online softmax, O, and the epilogue.

    ``q_smem`` holds this partition's query rows [start_m, start_m + rows):
    the whole tile, or with PINGPONG one warpgroup's 64 rows (``WG`` says
    which), the other warpgroup running the same steps on the other half.
    ``q_ready`` is Q's barrier, completing phase ``q_phase``. ``g0``/``s0``:
    the ring position and ping-pong step of this tile's first block (0, but
    with several tiles a program); FIRST: this is the program's first step (no turn
    to wait for); RELEASE_LAST: the last V buffer is released to the
    producer too (a next tile's loads need it). SPLIT: the head dim is two
    chunks, the second in ``q2_smem``, ``k2_bufs``, ``v2_bufs`` and ``o2_desc``
    (otherwise those are the first chunk's, never read). DEFER: the output
    store is left in flight; the previous tile's is waited for after this
    tile's peeled step, and its Q buffer released on ``q_prev_empty`` where
    there is one (``pending``): the caller waits for the last. SINKS: ``sink`` points at this
    head's sink logit, which joins the rows' denominator and lse in the epilogue.
    """
    BLOCK_M: gl.constexpr = q_smem.type.shape[0]
    BLOCK_D: gl.constexpr = q_smem.type.shape[1]
    BLOCK_D2: gl.constexpr = q2_smem.type.shape[1]
    NUM_WARPS: gl.constexpr = BLOCK_M // 16  # this partition's warps (a warp owns 16 rows of a wgmma)
    dtype: gl.constexpr = q_smem.dtype
    # wgmma accumulators: warps stacked along M (a warpgroup owns 64 rows), one instruction spans the tile's N.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    o2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_D2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qk_scale = sm_scale * LOG2E
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout)
    acc2 = gl.zeros([BLOCK_M, BLOCK_D2], gl.float32, layout=o2_layout)  # SPLIT's; else never issued

    # Block 0, peeled: its scores alone (nothing to overlap yet), always through the masked step.
    mbarrier.wait(q_ready, q_phase)
    _wait_slot(k_bars, g0, STAGES)
    _wait_turn(turn, s0, WG, PINGPONG, FIRST)
    zero = gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=s_layout)
    s = _scores(q_smem, q2_smem, k_bufs.index(g0 % STAGES), k2_bufs.index(g0 % STAGES), zero, SPLIT)
    _pass_turn(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, alpha, m_i, l_i = _scores_softmax(s, m_i, l_i, offs_m, 0, qk_scale, causal_offset, True, CAUSAL)
    if PRODUCER:
        mbarrier.arrive(k_empty.index(g0 % STAGES), count=1)
    else:
        _issue_load(k_desc, k2_desc, k_bars, k_bufs, k2_bufs, STAGES, n_blocks, BLOCK_N, STAGES, SPLIT)
    if DEFER:  # the previous tile's output has been read out of its Q buffer by now: the producer may refill it
        tma.store_wait(0)
        mbarrier.arrive(q_prev_empty, count=1, pred=pending)
    p_prev = gl.convert_layout(p.to(dtype), p_layout)

    # Causal ping-pong at 128 x 128 tiles: both warpgroups run the tile's block count, and where the tile holds
    # the diagonal (its last block, n_full < n_blocks) warpgroup 0's rows see exactly that block's first half:
    # seqlen_q and seqlen_k are multiples of 128, so the causal offset is too. Warpgroup 0 takes that block in a
    # half step (HALF_N keys: its S product, softmax and PV half as wide) after the loops, where it is not the
    # peeled block 0 (``half``). A tile past seqlen_k (top-left, seqlen_q > seqlen_k) sees every key: no half.
    # Up to a width of 96: from 128 on ptxas spills with it (Triton 3.6: 28 / 72 bytes at 128 x 128, 4 tiles).
    HALF: gl.constexpr = (CAUSAL and PINGPONG and WG == 0 and BLOCK_N == 2 * BLOCK_M
                          and BLOCK_D + (BLOCK_D2 if SPLIT else 0) <= 96)
    HALF_N: gl.constexpr = BLOCK_N // 2
    n_loop = n_blocks
    half = False  # a Python bool where HALF is off: the tail's ``if half`` then compiles to its else alone
    if HALF:
        half = (n_blocks > 1) & (n_full < n_blocks)
        n_loop = n_blocks - half.to(gl.int32)
    for block in range(1, n_full):
        acc, acc2, m_i, l_i, p_prev = _attend(block, n_blocks, q_smem, q2_smem, k_desc, k2_desc, v_desc, v2_desc,
                                              k_bufs, k2_bufs, v_bufs, v2_bufs, k_bars, v_bars, k_empty, v_empty,
                                              turn, acc, acc2, m_i, l_i, p_prev, offs_m, qk_scale, causal_offset,
                                              g0, s0, s_layout, BLOCK_N, STAGES, False, CAUSAL, PRODUCER, WG,
                                              PINGPONG, SPLIT)
    for block in range(gl.maximum(n_full, 1), n_loop):
        acc, acc2, m_i, l_i, p_prev = _attend(block, n_blocks, q_smem, q2_smem, k_desc, k2_desc, v_desc, v2_desc,
                                              k_bufs, k2_bufs, v_bufs, v2_bufs, k_bars, v_bars, k_empty, v_empty,
                                              turn, acc, acc2, m_i, l_i, p_prev, offs_m, qk_scale, causal_offset,
                                              g0, s0, s_layout, BLOCK_N, STAGES, True, CAUSAL, PRODUCER, WG,
                                              PINGPONG, SPLIT)

    # The last block's PV (of its first HALF_N keys after a half step), then the epilogue.
    last = g0 + n_blocks - 1
    if half:
        h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, HALF_N, 16])
        rows: gl.constexpr = gl.SliceLayout(1, h_layout)
        acc, acc2, m_h, l_h, p_h = _attend(n_blocks - 1, n_blocks, q_smem, q2_smem, k_desc, k2_desc, v_desc, v2_desc,
                                           k_bufs, k2_bufs, v_bufs, v2_bufs, k_bars, v_bars, k_empty, v_empty, turn,
                                           acc, acc2, gl.convert_layout(m_i, rows), gl.convert_layout(l_i, rows),
                                           p_prev, gl.convert_layout(offs_m, rows), qk_scale, causal_offset, g0, s0,
                                           h_layout, BLOCK_N, STAGES, True, CAUSAL, PRODUCER, WG, PINGPONG, SPLIT,
                                           HALF_N)
        m_i = gl.convert_layout(m_h, m_i.type.layout)
        l_i = gl.convert_layout(l_h, l_i.type.layout)
        acc, acc2 = _last_pv(p_h, v_bufs.index(last % STAGES).slice(0, HALF_N),
                             v2_bufs.index(last % STAGES).slice(0, HALF_N), v_bars, v_empty, turn, acc, acc2, last,
                             s0 + n_blocks, STAGES, WG, PINGPONG, SPLIT, RELEASE_LAST)
    else:
        acc, acc2 = _last_pv(p_prev, v_bufs.index(last % STAGES), v2_bufs.index(last % STAGES), v_bars, v_empty,
                             turn, acc, acc2, last, s0 + n_blocks, STAGES, WG, PINGPONG, SPLIT, RELEASE_LAST)

    if SINKS:  # l_i becomes the divisor of acc
        l_i, lse = _with_sink(m_i, l_i, gl.load(sink + offs_m * 0))
    else:
        lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(lse_base + offs_m, lse)
    # Q's buffers are free (the last QK^T retired): the output tile goes out through them.
    _store_out(acc, gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), q_smem, o_desc, start_m, 0)
    if SPLIT:
        _store_out(acc2, gl.convert_layout(l_i, gl.SliceLayout(1, o2_layout)), q2_smem, o2_desc, start_m, BLOCK_D)
    if not DEFER:
        tma.store_wait(0)


@gluon.jit
def flash_fwd_gluon_kernel(
    Q, K, V, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Alibi, Bias, Philox, Seqused_q, Seqused_k, Sinks,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk, stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn,
    sm_scale, softcap, dropout_p,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, EVEN_D: gl.constexpr,
    CAUSAL: gl.constexpr, PRODUCER: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_TILES: gl.constexpr,
    BLOCK_D2: gl.constexpr, SINKS: gl.constexpr = False,
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    gl.static_assert(not PINGPONG or PRODUCER, "PINGPONG needs PRODUCER: the producer warp loads for both warpgroups")
    # BLOCK_D2 (0: none): the head dim's second chunk (split tiles: columns [BLOCK_D, BLOCK_D + BLOCK_D2)), in
    # buffers and descriptors of its own. Without it, a head dim under BLOCK_D (EVEN_D false) is padded: the
    # descriptors' extent is head_dim, so TMA loads zeros past it and the output store stops at it.
    # EVEN_D (the tiles hold the head dim exactly) only describes the variant: TMA needs no masks either way.
    SPLIT: gl.constexpr = BLOCK_D2 > 0
    # BLOCK_TILES (0 or 1: one): a program's BLOCK_M rows are BLOCK_TILES query tiles, walked in turn (PINGPONG only).
    TILES: gl.constexpr = BLOCK_TILES if BLOCK_TILES > 1 else 1
    gl.static_assert(TILES == 1 or PINGPONG, "BLOCK_TILES needs PINGPONG: its producer warp loads every tile's Q")
    TILE_M: gl.constexpr = BLOCK_M // TILES
    gl.static_assert(TILE_M * TILES == BLOCK_M, "BLOCK_M must be BLOCK_TILES whole tiles")
    # Consumer partitions of the entry's num_warps each, each owning ROWS of the tile's rows: one, or with
    # PINGPONG two taking turns, or three that run freely (TILE_M 192 at 4 warps: the wide tiles, PRODUCER).
    WGS: gl.constexpr = TILE_M // (16 * NUM_WARPS)
    ROWS: gl.constexpr = TILE_M // WGS
    gl.static_assert(ROWS * WGS == TILE_M and ROWS == 16 * NUM_WARPS,
                     "each warp of a warpgroup owns 16 rows: BLOCK_M = 16 x warps x partitions")
    gl.static_assert(WGS == 1 or PRODUCER, "several consumer partitions need PRODUCER: one warp loads for them")
    gl.static_assert(WGS <= 3 and (PINGPONG == (WGS == 2)), "ping-pong is two partitions; three run without turns")
    gl.static_assert(WGS < 3 or TILES == 1, "three partitions walk one query tile a program")
    dtype: gl.constexpr = Q.dtype.element_ty
    # gluon.stages' rule on the whole width: 3 when a K tile is at most 16 KiB (head dim 64; 128 at BLOCK_N 64),
    # else 2.
    STAGES: gl.constexpr = 3 if (BLOCK_D + BLOCK_D2) * BLOCK_N <= 64 * 128 else 2

    # 96 = 64 + 32 and 160 = 128 + 32: the second chunk's rows are 64 bytes, one span of its 64-byte swizzle; the
    # first chunk's buffers take that swizzle too (the layout of BLOCK_D2 columns; conflict-free for wgmma as the
    # 128-byte one), so one descriptor a tensor serves both chunks (gluon_tma.descriptors), as at 192
    LAYOUT_D: gl.constexpr = BLOCK_D2 if SPLIT and BLOCK_D2 * dtype.primitive_bitwidth == 512 else BLOCK_D
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, LAYOUT_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LAYOUT_D], dtype)

    if WGS == 3:  # the wide tiles end at seqlen_q, so a ragged program is the last one, the lowest rows (causal: the
        # lightest), its lower warpgroups' rows before row 0; aligned at row 0 it was the heaviest, a third full
        start_m = seqlen_q - (gl.program_id(0) + 1) * BLOCK_M
    elif CAUSAL and TILES > 1:
        # Programs of several causal query tiles pair tile j with tile N - 1 - j (_tile_row): program i of P
        # walks tiles [i x TILES / 2, (i + 1) x TILES / 2) and their mirrors, so all P hold the same key blocks
        # (a tile's count grows with its row). In order, program i's were [i x TILES, (i + 1) x TILES): the
        # lowest a few blocks, the highest most, and the grid's last wave then waited on its heaviest programs.
        start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * (BLOCK_M // 2)
    else:
        start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    head = gl.program_id(1)
    batch = gl.program_id(2)
    kv_head = head // group_size
    # Q buffers (gluon.q_buffers' rule): with several tiles two where both fit beside the ring (tile t's Q in buffer
    # t % 2: the next one loads under this one), else one; sm_90's 227 KiB less gluon.SHARED_SLACK.
    TWO_Q_BYTES: gl.constexpr = 2 * (BLOCK_D + BLOCK_D2) * (2 * TILE_M + 2 * STAGES * BLOCK_N)
    QBUFS: gl.constexpr = (2 if TWO_Q_BYTES <= 232448 - 1024 else 1) if TILES > 1 else 1
    q_smem = gl.allocate_shared_memory(dtype, [QBUFS * WGS, ROWS, BLOCK_D], q_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    if SPLIT:
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_D2], dtype)
        kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D2], dtype)
        q2_smem = gl.allocate_shared_memory(dtype, [QBUFS * WGS, ROWS, BLOCK_D2], q2_layout)
        k2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D2], kv2_layout)
        v2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D2], kv2_layout)
    else:  # never read: the first chunk's stand in, the shared memory as it was
        q2_smem = q_smem
        k2_bufs = k_bufs
        v2_bufs = v_bufs
    # Q's barriers: with several tiles one a Q buffer (the producer loads both halves), with one tile one a
    # consumer warpgroup (each loads its own rows).
    QBARS: gl.constexpr = WGS if TILES == 1 else QBUFS
    q_bar = gl.allocate_shared_memory(gl.int64, [QBARS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(QBARS):
        mbarrier.init(q_bar.index(i), count=1)
    if TILES > 1:  # q_empty[b]: both consumer partitions are done with Q buffer b (its output went out)
        q_empty = gl.allocate_shared_memory(gl.int64, [QBUFS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QBUFS):
            mbarrier.init(q_empty.index(i), count=WGS)
    else:
        q_empty = q_bar  # never touched with one tile: no barrier of its own
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        # One arrive per consumer partition (Gluon lowers it as all its warps meeting, then one thread's arrive).
        mbarrier.init(k_empty.index(i), count=WGS)
        mbarrier.init(v_empty.index(i), count=WGS)
    if PINGPONG:  # turn[w]: warpgroup w may issue its next step's wgmmas
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    else:
        turn = k_empty  # never touched without ping-pong: no barrier of its own, the shared memory as it was
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before its first arrive

    lse_base = Lse + batch * stride_lb + head * stride_lh
    if SINKS:  # this head's sink logit, read in the consumers' epilogue
        sink = Sinks + head
    else:  # never read
        sink = lse_base
    q_base = Q + batch * stride_qb + head * stride_qh
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    o_base = Out + batch * stride_ob + head * stride_oh
    if WGS == 3:
        # The wide tiles (FlashAttention-3's at head dim 64): three consumer warpgroups of 64 rows on every K/V
        # tile, each on its own schedule (no turns: the warp schedulers interleave them), one warp loading for
        # all three; 160 registers a consumer thread and 24 for the producer (504 of 512 a warpgroup's share).
        gl.warp_specialize([(_consume_part, (q_base, o_base, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim,
                                             q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar, q_empty,
                                             k_bars, v_bars, k_empty, v_empty, turn, lse_base, start_m, sm_scale,
                                             causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, 0, SPLIT, sink,
                                             SINKS)),
                            (_consume_part, (q_base, o_base, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim,
                                             q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar, q_empty,
                                             k_bars, v_bars, k_empty, v_empty, turn, lse_base, start_m, sm_scale,
                                             causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, 1, SPLIT, sink,
                                             SINKS)),
                            (_consume_part, (q_base, o_base, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim,
                                             q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar, q_empty,
                                             k_bars, v_bars, k_empty, v_empty, turn, lse_base, start_m, sm_scale,
                                             causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, 2, SPLIT, sink,
                                             SINKS)),
                            (_produce_part, (q_base, k_base, v_base, stride_qs, stride_ks, stride_vs, seqlen_q,
                                             seqlen_k, head_dim, q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, v2_bufs,
                                             q_bar, q_empty, k_bars, v_bars, k_empty, v_empty, start_m,
                                             causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, SPLIT))],
                           [NUM_WARPS, NUM_WARPS, 1], [160, 160, 24])
    elif PINGPONG:
        # FlashAttention-3's schedule: warpgroup 0 (the default partition) and warpgroup 1 take turns to issue
        # their wgmmas, so one's softmax runs under the other's products; one warp loads for both. Every
        # descriptor is made in the partition that uses it, at once in the three (_produce_part). With
        # TILES > 1 a program walks TILES query tiles of TILE_M rows, the producer running ahead across tiles
        # (the next Q and key blocks load under this tile's end and epilogue).
        gl.warp_specialize([(_consume_part, (q_base, o_base, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim,
                                             q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar, q_empty,
                                             k_bars, v_bars, k_empty, v_empty, turn, lse_base, start_m, sm_scale,
                                             causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, 0, SPLIT, sink,
                                             SINKS)),
                            (_consume_part, (q_base, o_base, stride_qs, stride_os, seqlen_q, seqlen_k, head_dim,
                                             q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar, q_empty,
                                             k_bars, v_bars, k_empty, v_empty, turn, lse_base, start_m, sm_scale,
                                             causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, 1, SPLIT, sink,
                                             SINKS)),
                            (_produce_part, (q_base, k_base, v_base, stride_qs, stride_ks, stride_vs, seqlen_q,
                                             seqlen_k, head_dim, q_smem, q2_smem, k_bufs, k2_bufs, v_bufs, v2_bufs,
                                             q_bar, q_empty, k_bars, v_bars, k_empty, v_empty, start_m,
                                             causal_offset, TILES, TILE_M, WGS, BLOCK_N, STAGES, CAUSAL, SPLIT))],
                           [NUM_WARPS, 1], [240, 24])
    else:
        # Key blocks [0, n_full) are visible to every row; [n_full, n_blocks) hold the causal diagonal.
        n_blocks, n_full = _block_counts(start_m, seqlen_k, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)

        # Each descriptor is written to global scratch and fenced (a release and an acquire at GPU scope, then
        # a CTA barrier: read from the PTX), one after another. Each load goes out as soon as its own
        # descriptor exists, so the later descriptors (Out's last, needed only by the epilogue) are built while
        # Q, K and V are in flight. With SPLIT each tensor's second chunk is read at column BLOCK_D, through a
        # second descriptor or the first one (gluon_tma.descriptors).
        q_desc, q2_desc = descriptors(q_base, seqlen_q, head_dim, stride_qs, q_smem, q2_smem, SPLIT)
        _load_q(q_desc, q2_desc, q_bar.index(0), q_smem, q2_smem, 0, start_m, WGS, SPLIT)
        # With the producer warp, block 0's K and V are loaded here and the producer starts at block 1.
        PRELOAD: gl.constexpr = 1 if PRODUCER else STAGES
        k_desc, k2_desc = descriptors(k_base, seqlen_k, head_dim, stride_ks, k_bufs, k2_bufs, SPLIT)
        for i in gl.static_range(PRELOAD):
            _issue_load(k_desc, k2_desc, k_bars, k_bufs, k2_bufs, i, n_blocks, BLOCK_N, STAGES, SPLIT)
        v_desc, v2_desc = descriptors(v_base, seqlen_k, head_dim, stride_vs, v_bufs, v2_bufs, SPLIT)
        for i in gl.static_range(PRELOAD):
            _issue_load(v_desc, v2_desc, v_bars, v_bufs, v2_bufs, i, n_blocks, BLOCK_N, STAGES, SPLIT)
        o_desc, o2_desc = descriptors(o_base, seqlen_q, head_dim, stride_os, q_smem, q2_smem, SPLIT)
        if PRODUCER:
            # One warp issues every K/V load (24 registers); the 2 consumer warpgroups get 240 each.
            gl.warp_specialize([(_consume, (q_smem.index(0), q2_smem.index(0), k_desc, k2_desc, v_desc, v2_desc,
                                            k_bufs, k2_bufs, v_bufs, v2_bufs, q_bar.index(0), 0, k_bars, v_bars,
                                            k_empty, v_empty, turn, o_desc, o2_desc, lse_base, start_m, n_blocks,
                                            n_full, sm_scale, causal_offset, 0, 0, BLOCK_N, STAGES, CAUSAL, True, 0,
                                            False, SPLIT, True, False, q_bar.index(0), False, False, sink, SINKS)),
                                (_produce, (k_desc, k2_desc, v_desc, v2_desc, k_bufs, k2_bufs, v_bufs, v2_bufs,
                                            k_bars, v_bars, k_empty, v_empty, n_blocks, BLOCK_N, STAGES, SPLIT))],
                               [1], [24])
        else:
            _consume(q_smem.index(0), q2_smem.index(0), k_desc, k2_desc, v_desc, v2_desc, k_bufs, k2_bufs, v_bufs,
                     v2_bufs, q_bar.index(0), 0, k_bars, v_bars, k_empty, v_empty, turn, o_desc, o2_desc, lse_base,
                     start_m, n_blocks, n_full, sm_scale, causal_offset, 0, 0, BLOCK_N, STAGES, CAUSAL, False, 0,
                     False, SPLIT, sink=sink, SINKS=SINKS)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
    if PINGPONG:
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))
    for i in gl.static_range(QBARS):
        mbarrier.invalidate(q_bar.index(i))
    if TILES > 1:
        for i in gl.static_range(QBUFS):
            mbarrier.invalidate(q_empty.index(i))
