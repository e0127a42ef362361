"""Probe: the persistent fused backward against the grid of one program a tile, the kernel before it, and cuDNN.

For bench_flash_bwd.py's shapes (bf16, batch x seqlen = 16k, hidden 2048), each case runs the whole fused
backward (flash_bwd_prep, the kernel, dQ's cast) through Triton's JIT at the table's tiling:

- ``head``: a copy of the kernel file from before the persistent change (``--head-kernel``, its own ABI: one
  program a tile, its grid (key blocks, key/value heads, batch)), if given;
- ``tiles``: this kernel with one program a tile (the counter hands each program one tile, then the stop);
- ``persistent``: this kernel with one program an SM, each taking tiles until none is left (as served);

then the served backward (the binding: entries, plans, the cast) and cuDNN's. Every run is checked against
the float32 reference on a slice (FlashAttention's rule) and timed (median of CUDA-event-timed runs). The table
gives TFLOP/s (backward = 2.5 forwards) and the ratios persistent / head, served / cuDNN.

Usage: python benchmarks/probe_fused_persistent.py [--head-dims 128,64,256] [--seqlens 1024,4096,16384]
       [--causal both|causal|full] [--head-kernel benchmarks/fused_head_kernel.py] [--reps 10] [--log FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_gluon_bwd  # noqa: E402

from lazytriton import dispatch  # noqa: E402
from lazytriton.cli.timing import event_ms  # noqa: E402
from lazytriton.kernels.flash_bwd import binding as bwd  # noqa: E402
from lazytriton.kernels.flash_bwd import fused  # noqa: E402


def load_module(path: str):
    """A kernel file (a copy of fused_kernel.py) as a module."""
    full = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"head_{full.stem}", full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def head_backward(module, q, k, v, out, lse, do, causal, tiling):
    """The whole backward through the kernel file from before the change: its ABI, one program a tile."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    block_m, prefetch = tiling
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dqa = torch.empty((b, hq, sq, fused.tile(d)), dtype=torch.float32, device=q.device)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    block_d, block_d2 = fused.chunks(d)
    prep_grid = ((sq + fused.PREP_BLOCK_M - 1) // fused.PREP_BLOCK_M, hq, b)
    grid = (sk // fused.block_n(d), hk, b)

    def run():
        module.flash_bwd_prep_kernel[prep_grid](out, do, delta, dqa, *out.stride()[:3], *do.stride()[:3],
                                                *delta.stride()[:2], hq, sq, d, BLOCK_M=fused.PREP_BLOCK_M,
                                                BLOCK_D=fused.tile(d))
        module.flash_bwd_fused_gluon_kernel[grid](
            q, k, v, do, lse, delta, dk, dv, dqa, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2], hq // hk, hq, sq, sk, d,
            sk - sq, d ** -0.5, BLOCK_M=block_m, BLOCK_D=block_d, CAUSAL=causal, PREFETCH=prefetch,
            BLOCK_D2=block_d2, num_warps=4)
        return dqa[..., :d].to(q.dtype), dk, dv
    return run


def run_case(d, causal, s, args, head, log):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (q, k, v, do), call, out, lse, sl, ref, same, flops, label = probe_gluon_bwd.make_case(d, causal, s)
    block_m, prefetch, _ = dispatch.BWD_FUSED_TABLE[("bf16", d, causal)]
    tiling = (block_m, prefetch)
    b, h = q.shape[:2]
    runs = {}
    if head is not None:
        runs["head"] = head_backward(head, q, k, v, out, lse, do, causal, tiling)
    runs["tiles"] = probe_gluon_bwd.ws_backward(q, k, v, out, lse, do, causal, tiling,
                                                programs=fused.tiles(b, h, s, d))
    runs["persistent"] = probe_gluon_bwd.ws_backward(q, k, v, out, lse, do, causal, tiling)
    rows = {}
    for name, run in runs.items():
        ms = probe_gluon_bwd._timed(label, name, run, sl, ref, same, args.reps, log)
        if ms is not None:
            rows[name] = ms
    fits = bwd.fused_fits(call, q.dtype, True, False)

    def served():
        return bwd.backward(q, k, v, out, lse, do, call)
    ms = probe_gluon_bwd._timed(label, f"served ({'fused' if fits else 'two kernels'})", served, sl, ref, same,
                                args.reps, log)
    if ms is not None:
        rows["served"] = ms
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    dout = torch.empty_like(o).copy_(do)
    rows["cudnn"] = event_ms(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), reps=args.reps)
    return label, rows, flops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="128,64,256")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    parser.add_argument("--head-kernel", default=None, help="a copy of fused_kernel.py from before the change")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--log", default=None, help="also append the log here")
    args = parser.parse_args(argv)
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    head = load_module(args.head_kernel) if args.head_kernel else None
    logfile = open(args.log, "a") if args.log else None  # noqa: SIM115 (closed below)

    def log(message: str) -> None:
        print(message, flush=True)
        if logfile:
            logfile.write(message + "\n")

    causals = {"both": (False, True), "causal": (True,), "full": (False,)}[args.causal]
    summary = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in causals:
            for s in (int(x) for x in args.seqlens.split(",")):
                summary.append(run_case(d, causal, s, args, head, log))
    names = ("head", "tiles", "persistent", "served", "cudnn")
    log("\ncase                  | " + " ".join(f"{n:>10s}" for n in names) + " | pers/head served/cudnn  (TFLOP/s)")
    for label, rows, flops in summary:
        rate = {n: flops / rows[n] / 1e9 if n in rows else float("nan") for n in names}
        log(f"{label:21s} | " + " ".join(f"{rate[n]:10.0f}" for n in names)
            + f" | {rate['persistent'] / rate['head']:9.3f} {rate['served'] / rate['cudnn']:11.3f}")
    if logfile:
        logfile.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
