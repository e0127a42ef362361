"""Probe kernel for the warp-specialisation lever (issue 12): Triton's automatic warp specialisation on Hopper.

Not served by lazytriton: ``benchmarks/probe_warp_spec.py`` launches it through
Triton's JIT to measure what ``tl.range(..., warp_specialize=True)`` gives on the
H200. K and V come through device-side tensor descriptors
(``tl.make_tensor_descriptor``), over a flattened (batch*heads*seqlen, head_dim)
view. What compiles (Triton 3.6 and 3.9, sm_90, checked on the CPU machine):

- one warp-specialised loop: yes (num_warps=4 becomes 12 warps: a producer
  and two consumer warpgroups);
- FlashAttention's causal split into an unmasked loop and a masked diagonal
  loop: no. The NVGPUWarpSpecialization pass asserts (MLIR Dominance
  "expected non-null blocks") as soon as a second loop follows the
  specialised one, whether or not the second is specialised. Hence
  ``CAUSAL_ONE_LOOP``: causal as one specialised loop up to the diagonal,
  masked on every block.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ws_inner(acc, l_i, m_i, q, dk, dv, base, lo, hi, start_m, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr, WS: tl.constexpr):
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = dk.load([base + start_n, 0])
        s = tl.dot(q, k.T) * scale
        if MASK:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([base + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def ws_fwd(Q, K, V, Out, sm_scale, Z, H, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, WS: tl.constexpr, CAUSAL: tl.constexpr, CAUSAL_ONE_LOOP: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    rows = Z * H * N_CTX
    dq = tl.make_tensor_descriptor(Q, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
    dk = tl.make_tensor_descriptor(K, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    dv = tl.make_tensor_descriptor(V, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    do = tl.make_tensor_descriptor(Out, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
    base = off_hz * N_CTX
    row0 = base + start_m * BLOCK_M
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    scale = sm_scale * 1.4426950408889634
    q = dq.load([row0, 0])
    if CAUSAL and CAUSAL_ONE_LOOP:  # one loop up to the diagonal, masked on every block
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, dk, dv, base, 0, (start_m + 1) * BLOCK_M, start_m, scale,
                                  BLOCK_M, BLOCK_N, True, WS)
    elif CAUSAL:  # FlashAttention's split: unmasked blocks, then the diagonal (fails to compile with WS)
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, dk, dv, base, 0, start_m * BLOCK_M, start_m, scale,
                                  BLOCK_M, BLOCK_N, False, WS)
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, dk, dv, base, start_m * BLOCK_M, (start_m + 1) * BLOCK_M,
                                  start_m, scale, BLOCK_M, BLOCK_N, True, False)
    else:
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, dk, dv, base, 0, N_CTX, start_m, scale, BLOCK_M, BLOCK_N, False, WS)
    acc = acc / l_i[:, None]
    do.store([row0, 0], acc.to(Out.dtype.element_ty))


@triton.jit
def ws_fwd_persistent(Q, K, V, Out, sm_scale, Z, H, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, WS: tl.constexpr, CAUSAL: tl.constexpr, CAUSAL_ONE_LOOP: tl.constexpr):
    """``ws_fwd`` as a persistent kernel: as many programs as SMs, each walking tiles (heaviest rows first)."""
    rows = Z * H * N_CTX
    dq = tl.make_tensor_descriptor(Q, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
    dk = tl.make_tensor_descriptor(K, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    dv = tl.make_tensor_descriptor(V, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    do = tl.make_tensor_descriptor(Out, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
    scale = sm_scale * 1.4426950408889634
    m_tiles = N_CTX // BLOCK_M
    n_tiles = m_tiles * Z * H
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        off_hz = tile % (Z * H)
        start_m = m_tiles - 1 - tile // (Z * H)  # the longest causal rows first
        base = off_hz * N_CTX
        row0 = base + start_m * BLOCK_M
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        q = dq.load([row0, 0])
        hi = (start_m + 1) * BLOCK_M if CAUSAL else N_CTX
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, dk, dv, base, 0, hi, start_m, scale, BLOCK_M, BLOCK_N, CAUSAL, WS)
        acc = acc / l_i[:, None]
        do.store([row0, 0], acc.to(Out.dtype.element_ty))
