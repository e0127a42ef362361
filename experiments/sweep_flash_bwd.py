"""Sweep configs of the two backward kernels on a GPU, each kernel timed alone.

For each case (dtype, head dim, causal, seqlen; batch x seqlen = 16k, hidden
2048) every candidate of ``flash_bwd_dq`` and of ``flash_bwd_dkdv`` is
compiled in parallel through the runtime (``lazytriton.cli.tune.common.compile_all``:
lock, lease, tiers, miss log), checked against the float32 reference, and
timed alone (median of event-timed launches). Prints the best few per
kernel, and their share of the backward's FLOPs as TFLOP/s (the whole
backward counted as 2.5x the forward, FlashAttention's convention, attributed
to each kernel by its share of the time).

Usage: python experiments/sweep_flash_bwd.py [--jobs 16] [--cases bf16:128:0:4096,...] [--reps 20]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

import torch

from lazytriton import launch as launching
from lazytriton import machine, runtime
from lazytriton.cli.timing import event_ms
from lazytriton.cli.tune.common import compile_all
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_bwd.reference import attention_backward_reference
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.tiles import Config
from lazytriton.variant import Variant

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def candidates(kernel: str, head_dim: int) -> list[Config]:
    """Held tile x streamed tile x warps x stages (held = BLOCK_M for dq, BLOCK_N for dkdv)."""
    held = (64, 128)
    streamed = (32, 64) if head_dim >= 128 else (32, 64, 128)
    out = []
    for h, s, w, st in itertools.product(held, streamed, (4, 8), (2, 3, 4)):
        if head_dim >= 256 and h * s > 64 * 64:
            continue
        out.append(Config(h, s, w, st) if kernel == "flash_bwd_dq" else Config(s, h, w, st))
    return out


def run_case(dtype: str, head_dim: int, causal: bool, seqlen: int, jobs: int, reps: int) -> None:
    heads, batch = 2048 // head_dim, max(1, 16384 // seqlen)
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)
    q, k, v, do = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", generator=gen).to(torch_dtype)
                   for _ in range(4))
    call = fwd.check(q, k, v, "bottom_right" if causal else False, None)
    out, lse = fwd.forward(q, k, v, call)
    ref = attention_backward_reference(q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), do[:1, :2].float(),
                                       causal="bottom_right" if causal else False)
    target = machine.target_of_device(q.device)
    plans: dict[str, list[Variant]] = {
        kernel: [dispatch.kernel_variant(kernel, target, dtype, head_dim, causal, True, seqlen, seqlen, config=c)
                 for c in candidates(kernel, head_dim)] for kernel in bwd_dispatch.BWD_KERNELS}
    failures = compile_all([vv for vs in plans.values() for vv in vs], jobs)
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    default = bwd.variants(target, torch_dtype, call.shape, causal, True, False)
    rt = runtime.get()
    grads = bwd.empty_grads(q, k, v)
    delta = torch.empty_like(lse)
    dq_ints, dkdv_ints, *_ = bwd.pack(q, k, v, out, do, lse, delta, *grads, call)
    stream = launching.raw_stream(q.device.index)
    best: dict[str, float] = {}
    for kernel, variants in plans.items():
        results = []
        for variant in [*variants, default[bwd_dispatch.BWD_KERNELS.index(kernel)]]:
            if str(variant) in failures:
                continue
            try:
                loaded = rt.kernel(variant, q.device.index)
            except Exception as exc:  # noqa: BLE001 (a candidate that cannot load is reported, not fatal)
                print(f"  {variant}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            bm, bn = int(variant.get("BLOCK_M")), int(variant.get("BLOCK_N"))
            dq_grid, dkdv_grid = bwd.grids(call.shape, bm, bn)
            if kernel == "flash_bwd_dq":
                def launch(loaded: Any = loaded, grid: Any = dq_grid) -> None:
                    loaded.launch(grid, stream, dq_ints, fwd.floats(call), launching.scratch_alloc)
            else:
                # dkdv reads delta, which the dq kernel writes: run the default dq once first.
                bwd.launch_gpu(q, k, v, out, lse, do, grads, call, forced=(default[0], default[1]))

                def launch(loaded: Any = loaded, grid: Any = dkdv_grid) -> None:
                    loaded.launch(grid, stream, dkdv_ints, fwd.floats(call), launching.scratch_alloc)
            try:
                ms = event_ms(launch, reps=reps)
            except Exception as exc:  # noqa: BLE001
                print(f"  {variant}: launch failed: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            got = grads.dq if kernel == "flash_bwd_dq" else grads.dk
            want = ref[0] if kernel == "flash_bwd_dq" else ref[1]
            err = float((got[:1, :2].float() - want).norm() / want.norm())
            tag = " (default)" if variant == default[bwd_dispatch.BWD_KERNELS.index(kernel)] else ""
            results.append((ms, err, f"{bm}/{bn}/{variant.get('num_warps')}/{variant.get('num_stages')}{tag}"))
        results.sort()
        ok = [r for r in results if r[1] < 2e-2]
        print(f"{dtype} d{head_dim} causal={int(causal)} s{seqlen} {kernel}: {len(ok)}/{len(variants)} ok; "
              f"{len(failures)} failed to compile")
        for ms, err, name in ok[:4]:
            print(f"    {name:24s} {ms:8.3f} ms  err {err:.1e}")
        defaults = [r for r in ok if "default" in r[2]]
        if defaults:
            print(f"    default: {defaults[0][0]:.3f} ms")
        if ok:
            best[kernel] = ok[0][0]
    if len(best) == 2:
        total = sum(best.values())
        print(f"  best pair: {total:.3f} ms = {flops / total / 1e9:.0f} TFLOP/s (dq {best['flash_bwd_dq']:.3f}, "
              f"dkdv {best['flash_bwd_dkdv']:.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cases", default="bf16:128:0:4096,bf16:128:1:4096,bf16:64:0:4096,bf16:64:1:4096",
                        help="dtype:head_dim:causal:seqlen, comma separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for text in args.cases.split(","):
        dtype, head_dim, causal, seqlen = text.split(":")
        run_case(dtype, int(head_dim), causal == "1", int(seqlen), args.jobs, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
