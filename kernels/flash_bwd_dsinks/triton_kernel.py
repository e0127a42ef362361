"""The attention sinks' gradient: d(sinks)_h = -sum over batch and rows of head h of exp(sink_h - lse) * delta.

One program a query head walks its rows in a fixed order (each sequence, then
BLOCK_M rows a step), summing into a BLOCK_M accumulator it reduces once at
the end: no atomics, so the result is the same bits from run to run. ``Lse``
and ``Delta`` (rowsum(dO * O), which the backward's first kernel writes) share
the forward's lse layout: row i of sequence b of head h at b * stride_lb + h *
stride_lh + i, dense; packed (``VARLEN``), at h * stride_lh + CuSeqlensQ[b] +
i, over the first ``SequsedQ[b]`` rows with ``SEQUSED_Q`` (the rows past it
were never written). A row whose sink - lse is NaN (both -inf: no key and no
sink) adds 0, as ``flash_fwd.sinks.grad``.
"""

import triton
import triton.language as tl


@triton.jit
def flash_bwd_dsinks_kernel(Sinks, Lse, Delta, DSinks, CuSeqlensQ, SequsedQ, stride_lb, stride_lh, batch, seqlen_q,
                            BLOCK_M: tl.constexpr, INDEX64: tl.constexpr, VARLEN: tl.constexpr,
                            SEQUSED_Q: tl.constexpr):
    head = tl.program_id(0)
    if INDEX64:
        head = head.to(tl.int64)
    sink = tl.load(Sinks + head)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for b in range(0, batch):
        if VARLEN:
            start = tl.load(CuSeqlensQ + b)
            if SEQUSED_Q:
                n = tl.load(SequsedQ + b)
            else:
                n = tl.load(CuSeqlensQ + b + 1) - start
            base = head * stride_lh + start
        else:
            n = seqlen_q
            base = b * stride_lb + head * stride_lh
        for i in range(0, n, BLOCK_M):
            at = i + rows
            ok = at < n
            lse = tl.load(Lse + base + at, mask=ok, other=0.0)
            delta = tl.load(Delta + base + at, mask=ok, other=0.0)
            gap = sink - lse
            share = tl.exp(tl.where(gap == gap, gap, float("-inf")))
            acc += tl.where(ok, share * delta, 0.0)
    tl.store(DSinks + head, -tl.sum(acc, axis=0))
