"""Does a batch-1 decoding split program stream K and V faster through TMA than through cp.async?

At batch 1 the split kernel runs ~16-32 programs a key/value head, one or two an SM, and reads 16k keys at ~68% of
an H100's peak bandwidth (29.3 µs of graph replay, 67 MB of bf16 K and V at head dim 128, 8 key/value heads), where
32 sequences of the same cache stream at ~94%: each program's loads in flight, not the bytes, set the rate. The
split kernel's tiles reach shared memory through ``cp.async`` (Triton's pipelining of pointer loads: 16 bytes a
thread an instruction); a TMA copy moves a whole tile on one thread's instruction.

This probe times one stand-in split kernel (``probe_split_anatomy.py``'s ``math`` stage: the GQA group of 4 in a
16-row tile, both dots, the online softmax, partials stored) with its K and V tiles loaded three ways:

- ``ptr``: pointer loads, masked past the length (the served kernel's way);
- ``tma-dev``: tensor descriptors made on the device, one a program over its sequence's (length, head dim) keys of
  its head (``tl.make_tensor_descriptor``: rows past the length read as zeros);
- ``tma-host``: one descriptor for the whole cache made on the host, (batch x capacity, heads, head dim), its block
  (BLOCK_N, 1, head dim); V's rows past the length are zeroed after the load (they may hold any bits);

and a ``loads`` stage of each (the tiles summed: no dots) for the streaming rate alone. Beside them: the served
call's split kernel (``flash_attn_with_kvcache``, its own split count and tile) and SDPA's kernels. Every ``math``
row's partials are merged in float32 and checked against a float32 reference first. Times: device µs a launch
(torch.profiler) and the bytes' share of the GPU's peak bandwidth. Prints a table; ``--csv`` appends rows.

Usage: python3 experiments/probe_decode_tma.py [--lengths 16384,32768] [--splits 16,32,64] [--batch 1]
       [--configs 64x4x3,128x4x3] [--modes ptr,tma-dev,tma-host]
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
from probe_split_anatomy import (  # noqa: E402
    device_us,
    fresh_state,
    group_query,
    served_call,
    split_range,
    store_partials,
    tile_step,
)

HQ, HK, D, BLOCK_M = 32, 8, 128, 16
GROUP = HQ // HK
PEAK_GBS = {"H100": 3350.0, "H200": 4800.0}
MODES = {"ptr": 0, "tma-dev": 1, "tma-host": 2}


@triton.jit
def tma_split_kernel(Q, K, V, K_desc, V_desc, OutPart, LsePart, Seqlens, capacity, num_splits, stride_kb, stride_ks,
                     stride_kh, sm_scale, MODE: tl.constexpr, MATH: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    slot = (batch * tl.num_programs(1) + kv_head) * num_splits + split
    length = tl.load(Seqlens + batch)
    lo, hi = split_range(length, split, num_splits, BLOCK_N)
    q, offs_m, offs_d = group_query(Q, batch, kv_head, GROUP, BLOCK_M, D)
    offs_n = tl.arange(0, BLOCK_N)
    base = batch * stride_kb + kv_head * stride_kh
    if MODE == 1:
        k_dev = tl.make_tensor_descriptor(K + base, shape=[length, D], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, D])
        v_dev = tl.make_tensor_descriptor(V + base, shape=[length, D], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, D])
    m_i, l_i, acc = fresh_state(BLOCK_M, D)
    qk_scale = sm_scale * 1.4426950408889634
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        ok = keys < hi
        if MODE == 0:
            k = tl.load(K + base + keys[:, None] * stride_ks + offs_d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(V + base + keys[:, None] * stride_ks + offs_d[None, :], mask=ok[:, None], other=0.0)
        elif MODE == 1:
            k = k_dev.load([start_n, 0])
            v = v_dev.load([start_n, 0])
        else:
            k = K_desc.load([batch * capacity + start_n, kv_head, 0]).reshape(BLOCK_N, D)
            v = V_desc.load([batch * capacity + start_n, kv_head, 0]).reshape(BLOCK_N, D)
            v = tl.where(ok[:, None], v, 0.0)
        m_i, l_i, acc = tile_step(q, k, v, ok, m_i, l_i, acc, qk_scale, MATH)
    store_partials(OutPart, LsePart, slot, m_i, l_i, acc, offs_m, offs_d, BLOCK_M, D)


def host_descriptor(x: torch.Tensor, block_n: int):
    """One descriptor over a (batch, capacity, heads, D) cache: (batch x capacity, heads, D), block (BLOCK_N, 1, D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, s, h, d = x.shape
    return TensorDescriptor(x, shape=[b * s, h, d], strides=[h * d, d, 1], block_shape=[block_n, 1, d])


def merged(part, lse, b, splits):
    """The splits' partials merged in float32: (b, 1, HQ, D)."""
    lp = lse.view(b, HK, splits, BLOCK_M)[..., :GROUP]
    op = part.view(b, HK, splits, BLOCK_M, D)[..., :GROUP, :]
    w = torch.exp2(lp - lp.amax(2, keepdim=True))
    return ((op * w[..., None]).sum(2) / w.sum(2)[..., None]).reshape(b, 1, HQ, D)


def peak_gbs() -> float:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_GBS.items() if k in name), float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--splits", default="16,32,64")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--configs", default="64x4x2,64x4x3,64x4x4,128x4x2,128x4x3,64x8x3",
                        help="BLOCK_N x warps x stages")
    parser.add_argument("--modes", default="ptr,tma-dev,tma-host")
    parser.add_argument("--loads", action="store_true", help="add each config's loads-only stage")
    parser.add_argument("--interpret", action="store_true",
                        help="CPU check through the interpreter (small shapes, float16)")
    parser.add_argument("--csv", default="")
    args = parser.parse_args()
    device = "cpu" if args.interpret else "cuda"
    b = args.batch
    dtype = torch.float16 if args.interpret else torch.bfloat16  # the interpreter's bf16 dots are wrong
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    peak = peak_gbs()
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(length)
        capacity = length + 40  # rows past the length hold garbage a TMA tile may read
        q = torch.randn(b, 1, HQ, D, device=device, dtype=dtype)
        k, v = (torch.randn(b, capacity, HK, D, device=device, dtype=dtype) for _ in range(2))
        v[:, length:] = float("nan")
        lens = torch.full((b,), length, dtype=torch.int32, device=device)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k[:, :length].transpose(1, 2).float(),
                                             v[:, :length].transpose(1, 2).float(), enable_gqa=True).transpose(1, 2)
        for splits in (int(x) for x in args.splits.split(",")):
            part = torch.empty(b * HK * splits * BLOCK_M, D, device=device, dtype=torch.float32)
            lse = torch.empty(b * HK * splits * BLOCK_M, device=device, dtype=torch.float32)
            for config in args.configs.split(","):
                bn, warps, stages = (int(x) for x in config.split("x"))
                kd, vd = host_descriptor(k, bn), host_descriptor(v, bn)
                for mode in args.modes.split(","):
                    for math in ((1, 0) if args.loads else (1,)):
                        launch = functools.partial(
                            tma_split_kernel[(splits, HK, b)], q, k, v, kd, vd, part, lse, lens, capacity, splits,
                            k.stride(0), k.stride(1), k.stride(2), D ** -0.5, MODE=MODES[mode], MATH=math,
                            GROUP=GROUP, BLOCK_M=BLOCK_M, BLOCK_N=bn, D=D, num_warps=warps, num_stages=stages)
                        launch()
                        err = float("nan")
                        if math:
                            err = float((merged(part, lse, b, splits) - ref).abs().max())
                            if not err < 2e-2:
                                raise SystemExit(f"{mode} {config} wrong: max err {err} ({length} keys, {splits})")
                        if args.interpret:
                            rows.append((length, splits, f"{mode} {config}", float("nan"), err))
                            continue
                        us = device_us(launch, "tma_split")
                        rows.append((length, splits, f"{mode}{'' if math else ' loads'} {config}", us, err))
        if args.interpret:
            continue
        served = functools.partial(served_call, q, k, v, lens, 0)
        err = float((served().float() - ref).abs().max())
        rows.append((length, 0, "served split kernel", device_us(served, "split"), err))
        sdpa = functools.partial(F.scaled_dot_product_attention, q.transpose(1, 2), k[:, :length].transpose(1, 2),
                                 v[:, :length].transpose(1, 2), enable_gqa=True)
        sdpa()
        rows.append((length, 0, "SDPA (all kernels)", device_us(sdpa, ""), float("nan")))
    name = torch.cuda.get_device_name() if not args.interpret else "interpreter"
    print(f"\ndecode TMA probe: batch {b}, bf16, hd {D}, {HQ}/{HK} heads, {name}, peak {peak:.0f} GB/s")
    print(f"{'keys':>6} {'splits':>6}  {'load / config':<30}{'device µs':>10}{'GB/s':>8}{'% peak':>8}  max err")
    for length, splits, label, us, err in rows:
        gbs = 2 * b * length * HK * D * 2 / 1e3 / us
        print(f"{length:>6} {splits:>6}  {label:<30}{us:>10.2f}{gbs:>8.0f}{100 * gbs / peak:>8.1f}  {err:.1e}")
        if args.csv:
            with open(args.csv, "a") as f:
                f.write(f"{name},{b},{length},{splits},{label},{us:.3f},{gbs:.1f},{err:.2e}\n")


if __name__ == "__main__":
    main()
