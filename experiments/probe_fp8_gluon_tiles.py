"""Probe: the Gluon FP8 forward's tilings beside the served one, including tilings outside its configs (GPU).

``fp8_gluon.CONFIGS`` holds the tilings that compile without a spill under both Tritons; a wider key tile that
spills a little (head dim 128 at 256 keys: 44 bytes under Triton 3.6) may still pay, since it halves the per-step
work that does not grow with the keys (the row reductions' shuffles, the O rescale, the barriers). Per head dim
and causal flag, at ``bench_flash_fwd.py --fp8``'s shape (batch 1, hidden 2048, 16k tokens, e4m3, descales 1),
this times the served variant and each ``--tiles`` candidate (BLOCK_M x BLOCK_N, 4 warps a consumer warpgroup)
through ``fp8.run_variant``, checks each output against the served one's, and prints TFLOP/s and the ratio.
Candidates are variant strings built here, not through ``fp8_gluon.variant`` (which keeps to the configs).

Usage: python experiments/probe_fp8_gluon_tiles.py [--head-dims 128] [--tiles 128x256,128x64] [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import math

import torch

from lazytriton.cli.timing import event_ms
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_gluon
from lazytriton.machine import target_of_device
from lazytriton.variant import Variant, pairs

TOKENS = 16384


def candidate(served: Variant, block_m: int, block_n: int) -> Variant:
    """``served`` at other tiles: its functional fields, the kernel's own ring depth for them."""
    head_dim = int(served.get("BLOCK_D"))
    return Variant(served.kernel, served.target, served.dtype, served.functional,
                   pairs({"BLOCK_M": block_m, "BLOCK_N": block_n}),
                   pairs({"num_stages": fp8_gluon.stages(head_dim, block_n), "num_warps": block_m // 32}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--tiles", default="128x256", help="BLOCK_MxBLOCK_N candidates, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    target = target_of_device(torch.device("cuda"))
    tilings = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        heads = 2048 // head_dim
        torch.manual_seed(head_dim)
        q, k, v = (torch.randn(1, heads, TOKENS, head_dim, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        scales = tuple(torch.ones(1, heads, device="cuda") for _ in range(3))
        for causal in (False, True):
            call = binding.check(q, k, v, causal, None, fp8=True)
            served = fp8_gluon.variant(str(target), "e4m3", head_dim, call.causal, True, False, TOKENS, TOKENS,
                                       tiles=fp8_gluon.TABLE[(head_dim, causal)])
            assert served is not None, "the Gluon FP8 forward serves sm_90 only"
            flops = 4 * TOKENS * TOKENS * head_dim * heads / (2 if causal else 1)
            want, _ = fp8.run_variant(q, k, v, call, scales, served)
            line = []
            for chosen in [served, *(candidate(served, m, n) for m, n in tilings)]:
                tiles = f"{chosen.get('BLOCK_M')}x{chosen.get('BLOCK_N')}"
                try:
                    got, _ = fp8.run_variant(q, k, v, call, scales, chosen)
                    err = float(((got.float() - want.float()).norm() / want.float().norm()).item())
                    run = functools.partial(fp8.run_variant, q, k, v, call, scales, chosen)
                    ms = event_ms(run, reps=args.reps)
                except Exception as exc:  # a tiling that does not compile or launch: said, not fatal
                    line.append(f"{tiles} {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                tflops = flops / ms / 1e9
                line.append(f"{tiles} {tflops:.1f} TFLOP/s (err {err:.1e})" if math.isfinite(err) else f"{tiles} NaN")
            print(f"hd{head_dim} {'causal' if causal else 'full  '}: " + "  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
