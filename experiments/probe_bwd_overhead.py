"""Probe: what the fused backward spends outside its main kernel (flash_bwd_prep, dQ's cast, the host, the gaps).

For bench_flash_bwd.py's shapes (bf16, batch x seqlen = 16k, hidden 2048), it times the served backward as the
bench does (CUDA events around each call, so the host's time to the first launch counts), the host time of a
call with the GPU idle, and lists the kernels it launches with their device times (torch.profiler); the rest
of the total is outside the kernels. ``--fused-from N`` also times the fused backward where its table row
starts above the seqlen, in turns with the two kernels (one call of each a round); ``--quiet`` then skips the
host time and the kernel list. ``--parts`` times each part alone: flash_bwd_prep through Triton's JIT at several
(BLOCK_M, warps), the accumulator's zero fill by torch and the cast ``dq.copy_(dqa)``, as GB/s.

Usage: python experiments/probe_bwd_overhead.py [--head-dims 128,64] [--seqlens 1024,4096] [--fused-from 1024]
[--row 64,1] [--dtype bf16|fp16] [--parts] [--quiet]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch
from probe_bwd_timing import host_us, kernel_us  # the script's folder is on sys.path

from lazytriton.cli.timing import event_ms, interleaved_ms
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_bwd import fused, fused_kernel
from lazytriton.kernels.flash_fwd import binding as fwd

PREP_TILINGS = ((64, 4), (128, 4), (128, 8), (32, 4), (256, 8))


def parts(q, out, do, reps):
    """flash_bwd_prep's tilings, the zero fill and the cast, each alone."""
    b, h, s, d = q.shape
    n = b * h * s * d
    dqa = torch.empty((b, h, s, d), dtype=torch.float32, device="cuda")
    delta = torch.empty((b, h, s), dtype=torch.float32, device="cuda")
    dq = torch.empty_like(q)
    for bm, warps in PREP_TILINGS:
        grid = ((s + bm - 1) // bm, h, b)

        def prep(bm=bm, warps=warps, grid=grid):
            fused_kernel.flash_bwd_prep_kernel[grid](out, do, delta, dqa, *out.stride()[:3], *do.stride()[:3],
                                                     *delta.stride()[:2], h, s, d, BLOCK_M=bm, BLOCK_D=d,
                                                     num_warps=warps)
        ms = event_ms(prep, reps=reps)
        print(f"    prep BLOCK_M {bm:3d} warps {warps}: {ms:.3f} ms ({8 * n / ms / 1e6:.0f} GB/s)", flush=True)
    ms = event_ms(dqa.zero_, reps=reps)
    print(f"    dqa.zero_(): {ms:.3f} ms ({4 * n / ms / 1e6:.0f} GB/s)")
    ms = event_ms(lambda: dq.copy_(dqa), reps=reps)
    print(f"    dq.copy_(dqa): {ms:.3f} ms ({6 * n / ms / 1e6:.0f} GB/s)", flush=True)
    print(f"    fused grid {fused.grids(b, h, h, s, s, d)[1]}")


def run_case(d, s, causal, args):
    b, h = max(1, 16384 // s), 2048 // d
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda").to(dtype) for _ in range(4))
    call = fwd.check(q, k, v, causal)
    out, lse = fwd.forward(q, k, v, call)

    def backward():
        return bwd.backward(q, k, v, out, lse, do, call)

    total = event_ms(backward, reps=args.reps)
    print(f"hd{d} {s} causal={causal}: served backward {total:.3f} ms", flush=True)
    key = (args.dtype, d, causal)
    row = bwd_dispatch.BWD_FUSED_TABLE.get(key)
    trial = row or (args.row and (*args.row, 1 << 30))  # a head dim without a row: --row's tiles, never served
    if args.fused_from and trial and args.fused_from <= s < trial[2]:
        def with_row(min_seqlen):
            def run():
                bwd_dispatch.BWD_FUSED_TABLE[key] = (*trial[:2], min_seqlen)
                try:
                    return backward()
                finally:
                    if row is None:
                        del bwd_dispatch.BWD_FUSED_TABLE[key]
                    else:
                        bwd_dispatch.BWD_FUSED_TABLE[key] = row
            return run

        two, fused_ms = interleaved_ms([with_row(trial[2]), with_row(args.fused_from)], True, warmup=5,
                                       reps=args.reps)
        print(f"    in turns: the two kernels {two:.3f} ms, fused from {args.fused_from} {fused_ms:.3f} ms "
              f"(fused / two {fused_ms / two:.3f})", flush=True)
    if args.quiet:
        return
    # host time of a call with the GPU idle: what the first event waits for
    print(f"    host time of a call {host_us(backward, 30) / 1e3:.3f} ms (median of 30, GPU idle)")
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            backward()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    busy = 0.0
    for kernel, us in kernel_us(backward, 3):
        busy += us / 1e3
        print(f"    {us / 1e3:8.3f} ms  {kernel[:70]}", flush=True)
    print(f"    {busy:8.3f} ms  kernels in all; {total - busy:.3f} ms of the total outside them")
    if args.parts:
        parts(q, out, do, args.reps)


def parse_row(text: str) -> tuple[int, bool]:
    """``--row``'s ``64,1`` -> (64, True): BLOCK_M and PREFETCH of a trial table row."""
    block_m, _, prefetch = text.partition(",")
    if not block_m.isdigit() or prefetch not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected BLOCK_M,PREFETCH such as 64,1, got {text!r}")
    return int(block_m), prefetch == "1"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--quiet", action="store_true", help="only the served time and the A/B of --fused-from")
    parser.add_argument("--parts", action="store_true", help="also time prep's tilings, the zero fill and the cast")
    parser.add_argument("--cprofile", action="store_true", help="also profile 50 calls' host time (cProfile)")
    parser.add_argument("--fused-from", type=int, default=0,
                        help="also time the fused backward where its table row starts above the seqlen, from this one")
    parser.add_argument("--row", type=parse_row, default=None, metavar="BLOCK_M,PREFETCH",
                        help="with --fused-from, the fused kernel's tiles where a head dim has no table row (160)")
    args = parser.parse_args(argv)
    for d in (int(x) for x in args.head_dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                run_case(d, s, causal, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
