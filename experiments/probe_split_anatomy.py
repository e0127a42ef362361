"""Where a decoding split program's device time goes: the split kernel taken apart, stage by stage.

``probe_decode_b1.py`` found batch 1's split kernel at 6.4-7.6 µs of device time with one 64-key tile a program
(1k keys, 16 splits), where cuDNN's whole kernel reads the 1k keys in 4.5. This probe times one stand-in kernel
at the production call's grid (splits x 8 key/value heads x batch, the GQA group of 4 in a 16-row tile, bf16,
head dim 128), built up a stage at a time, each stage a row:

- ``empty``: each program stores one float (the launch and the grid's floor);
- ``length``: the length loaded from a tensor, its split's range computed and stored;
- ``loads``: q, then each K and V tile of the split's range, summed (no dots, no softmax);
- ``math``: the online softmax with both dots, partials stored (the split kernel's work, without its features).

Each stage runs with the length as an argument (``int``) and loaded from a tensor (``tensor``: the key tiles'
addresses wait on that load), at 1, 2 and 4 warps and 1-3 stages of Triton's pipelining. Beside them: the
production split kernel (``flash_attn_with_kvcache`` with the same split count, the profiler's device µs of its
split kernel) and cuDNN's SDPA. Times: device µs a launch from torch.profiler, and µs a launch of 50 launches
replayed from one CUDA graph (the gaps between kernels counted). The ``math`` rows' partials are merged in
float32 and checked against a float32 reference before anything is timed.

Usage: python3 experiments/probe_split_anatomy.py [--lengths 1024,4096] [--splits 16,8,4] [--batch 1]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from probe_decode_b1 import event_us, graphed  # noqa: E402

HQ, HK, D, BLOCK_M = 32, 8, 128, 16
GROUP = HQ // HK


@triton.jit
def anatomy_kernel(Q, K, V, OutPart, LsePart, Seqlens, const_len, num_splits, stride_kb, stride_ks, stride_kh,
                   sm_scale, STAGE: tl.constexpr, USE_LEN: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    slot = (batch * tl.num_programs(1) + kv_head) * num_splits + split  # this program's partial
    if STAGE == 0:
        tl.store(LsePart + slot * BLOCK_M, 1.0)
        return
    if USE_LEN:
        length = tl.load(Seqlens + batch)
    else:
        length = const_len
    lo, hi = split_range(length, split, num_splits, BLOCK_N)
    if STAGE == 1:
        tl.store(LsePart + slot * BLOCK_M, (hi - lo).to(tl.float32))
        return
    q, offs_m, offs_d = group_query(Q, batch, kv_head, GROUP, BLOCK_M, D)
    offs_n = tl.arange(0, BLOCK_N)
    base = batch * stride_kb + kv_head * stride_kh
    m_i, l_i, acc = fresh_state(BLOCK_M, D)
    qk_scale = sm_scale * 1.4426950408889634
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        ok = keys < hi
        k = tl.load(K + base + keys[:, None] * stride_ks + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + base + keys[:, None] * stride_ks + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_i, l_i, acc = tile_step(q, k, v, ok, m_i, l_i, acc, qk_scale, STAGE == 3)
    store_partials(OutPart, LsePart, slot, m_i, l_i, acc, offs_m, offs_d, BLOCK_M, D)


@triton.jit
def split_range(length, split, num_splits, BLOCK_N: tl.constexpr):
    """[lo, hi): a split's keys, whole BLOCK_N blocks of the length cut evenly in num_splits."""
    n_blocks = (length + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + num_splits - 1) // num_splits
    lo = split * per_split * BLOCK_N
    return lo, tl.minimum(lo + per_split * BLOCK_N, length)


@triton.jit
def group_query(Q, batch, kv_head, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """(q, row offsets, column offsets): the GQA group's query rows of a (batch, 1, heads, D) q in a BLOCK_M tile."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    heads = kv_head * GROUP + offs_m % GROUP
    q = tl.load(Q + (batch * tl.num_programs(1) * GROUP + heads)[:, None] * D + offs_d[None, :],
                mask=(offs_m < GROUP)[:, None], other=0.0)
    return q, offs_m, offs_d


@triton.jit
def fresh_state(BLOCK_M: tl.constexpr, D: tl.constexpr):
    """(m, l, acc) of the online softmax before its first tile."""
    return (tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M, D], dtype=tl.float32))


@triton.jit
def tile_step(q, k, v, ok, m_i, l_i, acc, qk_scale, MATH: tl.constexpr):
    """One K/V tile: the online softmax with both dots (``MATH``), else the tiles summed (the loads alone)."""
    if not MATH:
        acc += (tl.sum(k.to(tl.float32), 0) + tl.sum(v.to(tl.float32), 0))[None, :]
        return m_i, l_i + 1.0, acc
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    qk = tl.where(ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def store_partials(OutPart, LsePart, slot, m_i, l_i, acc, offs_m, offs_d, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """A program's partial: out normalised by its own sum, and its base-2 lse (-inf where no key was seen)."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(OutPart + (slot * BLOCK_M + offs_m)[:, None] * D + offs_d[None, :], out)
    tl.store(LsePart + slot * BLOCK_M + offs_m, lse)


def graph_us(fn, launches: int = 50) -> float:
    """µs a launch: ``launches`` launches captured in one CUDA graph, the replay timed (probe_decode_b1's)."""
    return event_us(graphed(fn, launches), 1) / launches


def device_us(fn, name: str, launches: int = 50) -> float:
    """The profiler's device µs a launch of the kernels whose name holds ``name``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(launches):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if name in e.key:
            total += getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
    return total / launches


def served_call(q, k, v, lens, splits):
    """The production call (``flash_attn_with_kvcache``, trusted indices) at ``splits`` splits."""
    import lazytriton
    from lazytriton.kernels.trust import trusted_indices

    with trusted_indices():
        return lazytriton.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--splits", default="16,8,4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-n", type=int, default=64)
    args = parser.parse_args()
    b, bn = args.batch, args.block_n
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(length)
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, length, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        scale = D ** -0.5
        ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                             v.transpose(1, 2).float(), enable_gqa=True).transpose(1, 2)
        for splits in (int(x) for x in args.splits.split(",")):
            part = torch.empty(b * HK * splits * BLOCK_M, D, device="cuda", dtype=torch.float32)
            lse = torch.empty(b * HK * splits * BLOCK_M, device="cuda", dtype=torch.float32)
            for stage, stage_name in enumerate(("empty", "length", "loads", "math")):
                for use_len in (0, 1):
                    if stage == 0 and use_len:
                        continue
                    for warps, stages in ((1, 1), (1, 2), (2, 2), (4, 1), (4, 2), (4, 3)):
                        if stage < 2 and (warps, stages) != (4, 2):
                            continue

                        launch = functools.partial(
                            anatomy_kernel[(splits, HK, b)], q, k, v, part, lse, lens, length, splits, k.stride(0),
                            k.stride(1), k.stride(2), scale, STAGE=stage, USE_LEN=use_len, GROUP=GROUP,
                            BLOCK_M=BLOCK_M, BLOCK_N=bn, D=D, num_warps=warps, num_stages=stages)
                        launch()
                        err = float("nan")
                        if stage == 3:
                            torch.cuda.synchronize()
                            lp = lse.view(b, HK, splits, BLOCK_M)[..., :GROUP]
                            op = part.view(b, HK, splits, BLOCK_M, D)[..., :GROUP, :]
                            w = torch.exp2(lp - lp.amax(2, keepdim=True))
                            merged = (op * w[..., None]).sum(2) / w.sum(2)[..., None]  # (b, HK, GROUP, D)
                            err = float((merged.reshape(b, 1, HQ, D) - ref).abs().max())
                            if not err < 2e-2:
                                raise SystemExit(f"math stage wrong: max err {err} ({length} keys, {splits} splits)")
                        label = f"{stage_name}/{'tensor' if use_len else 'int'} w{warps} s{stages}"
                        rows.append((length, splits, label, device_us(launch, "anatomy"), graph_us(launch), err))

            served = functools.partial(served_call, q, k, v, lens, splits)
            out = served()
            err = float((out.float() - ref).abs().max())
            rows.append((length, splits, "served split kernel", device_us(served, "split"), graph_us(served), err))
            rows.append((length, splits, "served combine kernel", device_us(served, "combine"), float("nan"), err))

        sdpa = functools.partial(F.scaled_dot_product_attention, q.transpose(1, 2), k.transpose(1, 2),
                                 v.transpose(1, 2), enable_gqa=True)
        sdpa()
        rows.append((length, 0, "cuDNN/SDPA (all kernels)", device_us(sdpa, ""), graph_us(sdpa), float("nan")))
    print(f"\nsplit anatomy: batch {b}, bf16, hd {D}, {HQ}/{HK} heads, BLOCK_N {bn}, {torch.cuda.get_device_name()}")
    print(f"{'keys':>6} {'splits':>6}  {'stage':<28}{'device µs':>10}{'graph µs':>10}  max err")
    for length, splits, label, dev, graph, err in rows:
        print(f"{length:>6} {splits:>6}  {label:<28}{dev:>10.2f}{graph:>10.2f}  {err:.1e}")


if __name__ == "__main__":
    main()
