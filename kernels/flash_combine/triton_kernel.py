"""The attention combine in Triton: ``flash_combine_kernel`` merges attention computed over disjoint key chunks.

This file is the kernel's source fingerprint. It imports triton: only
``lazytriton.compiler`` may import it.

Split n of row (b, s, h) (batch b, query s, head h) holds its output
``OutPart[n, b, s, h, :]`` (float32) and the natural-log logsumexp of its
scores ``LsePart[n, b, s, h]`` (float32). The combined row is
``lse = log(sum_n exp(lse_n))`` and ``out = sum_n exp(lse_n - lse) * out_n``:
exact, no rescaling of running sums. A split whose lse is -inf saw no key:
its weight is 0 and its output is not read (a workspace it never wrote may
hold anything). A row whose every split is -inf gets out 0 and lse -inf.

One program per BLOCK_M rows of the flattened (batch, query, head) rows (head
fastest: the rows of one query are adjacent in FlashAttention's layout) x
one BLOCK_D-column chunk of the head dim (several chunks only above 256
columns; EVEN_D: head_dim is a multiple of BLOCK_D, no column mask). One
pass over the splits, BLOCK_N of them a step: a step loads their lse and
outputs together, and keeps the running max of the lse, the sum of
exp(lse_n - max) and the outputs weighted by it (rescaled when the max
grows); out = the weighted sum over the total. ``num_splits`` is a runtime
argument: one binary serves every split count. The first column chunk
writes Lse.
"""

import triton
import triton.language as tl


@triton.jit
def flash_combine_kernel(
    OutPart, LsePart, Out, Lse,
    stride_opn, stride_opb, stride_ops, stride_oph,
    stride_lpn, stride_lpb, stride_lps, stride_lph,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls, stride_lh,
    heads, seqlen, head_dim, num_splits, n_rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < n_rows
    head = offs_r % heads
    query = (offs_r // heads) % seqlen
    batch = offs_r // heads // seqlen
    lse_rows = batch * stride_lpb + query * stride_lps + head * stride_lph
    part_rows = batch * stride_opb + query * stride_ops + head * stride_oph
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if EVEN_D:
        cols_ok = row_ok[:, None]
    else:
        cols_ok = row_ok[:, None] & (offs_d < head_dim)[None, :]

    # One pass over the splits, BLOCK_N a step: a step loads those splits' lse and outputs together (a
    # [BLOCK_M, BLOCK_N, BLOCK_D] tile), so a row's splits are read in one round trip when BLOCK_N covers them.
    # The running max m, the sum of exp(lse - m) and the weighted outputs are rescaled when m grows.
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, num_splits, BLOCK_N):
        n_ok = (n0 + offs_n) < num_splits
        parts_ok = row_ok[:, None] & n_ok[None, :]
        lse = tl.load(LsePart + lse_rows[:, None] + (n0 + offs_n)[None, :] * stride_lpn, mask=parts_ok,
                      other=float("-inf"))
        o = tl.load(OutPart + (part_rows[:, None] + (n0 + offs_n)[None, :] * stride_opn)[:, :, None]
                    + offs_d[None, None, :], mask=parts_ok[:, :, None] & cols_ok[:, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - m_sub)
        weight = tl.exp(lse - m_sub[:, None])
        total = total * scale + tl.sum(weight, 1)
        # A split whose lse is -inf saw no key: it adds nothing, whatever its output holds (never written).
        acc = acc * scale[:, None] + tl.sum(tl.where((lse > float("-inf"))[:, :, None], weight[:, :, None] * o, 0.0),
                                            1)
        m = m_new
    empty = total == 0.0
    lse_all = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    acc = acc / tl.where(empty, 1.0, total)[:, None]
    out_rows = batch * stride_ob + query * stride_os + head * stride_oh
    tl.store(Out + out_rows[:, None] + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=cols_ok)
    if tl.program_id(1) == 0:
        tl.store(Lse + batch * stride_lb + query * stride_ls + head * stride_lh, lse_all, mask=row_ok)
