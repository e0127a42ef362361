"""Probe: the backward's Gluon kernels (the served dK/dV one, and a fused one with TMA-reduced dQ) beside cuDNN.

For each case (bf16, head dim 64/128, causal or not, 1k/4k/16k tokens; batch x
seqlen = 16k, hidden 2048, bench_flash_bwd.py's shapes) the probe runs
flash_bwd's two Triton kernels through Triton's JIT with the variants dispatch
serves (the dQ kernel also writes delta), then on the same delta every tiling
of ``flash_bwd_dkdv_gluon`` (kernels/flash_bwd/gluon_kernel.py, with its own
ABI: flash_bwd_dkdv's arguments from the binding), then every tiling of the
fused probe kernel (``gluon_bwd_probe_kernel.py``: the whole backward, dQ
reduced by TMA, delta from a pre-pass). Each is checked against the float32
reference on a slice (FlashAttention's rule: 3x the same-precision reference's
error, plus a floor) and timed (median of CUDA-event-timed runs), beside
cuDNN's whole backward. Two tables: the dK/dV kernel alone, with the backward
it projects (dQ kernel + best Gluon dK/dV), and the fused backward whole, in
TFLOP/s (the backward counted as 2.5x the forward).

Usage: python experiments/probe_gluon_bwd.py [--quick] [--head-dims 64,128] [--reps 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the benchmarks' helpers
import bwd_atomic_probe_kernel  # noqa: E402
import gluon_bwd_probe_kernel as probe  # noqa: E402
from bench_flash_bwd import jit_launches  # noqa: E402

from lazytriton.cli.timing import event_ms  # noqa: E402
from lazytriton.kernels.flash_bwd import (  # noqa: E402
    FLASH_BWD_DKDV,
    fused,  # noqa: E402
    fused_kernel,
    gluon_kernel,
)
from lazytriton.kernels.flash_bwd import binding as bwd  # noqa: E402
from lazytriton.kernels.flash_bwd.reference import attention_backward_reference  # noqa: E402
from lazytriton.kernels.flash_fwd import binding as fwd  # noqa: E402

# flash_bwd_dkdv_gluon: (BLOCK_N held keys = 16 x warps, BLOCK_M streamed queries, warps, OVERLAP)
TILINGS = {64: ((128, 64, 8, True), (128, 64, 8, False), (128, 128, 8, True), (64, 64, 4, True)),
           128: ((128, 64, 8, True), (128, 64, 8, False), (128, 32, 8, True), (64, 64, 4, True))}
# The fused probe kernel (dQ by TMA reduction, 5 products): (BLOCK_N, BLOCK_M, warps, stages)
FUSED_TILINGS = {64: ((64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 1)),
                 128: ((64, 64, 4, 2), (64, 64, 4, 1), (128, 64, 8, 2))}
# The served fused backward (kernels/flash_bwd/fused_kernel.py: flash_bwd_prep, then flash_bwd_fused_gluon,
# 128 held keys, 2 consumer warpgroups and a producer warp): (BLOCK_M, PREFETCH)
WS_TILINGS = {64: ((64, True), (64, False), (128, False), (128, True)),
              128: ((64, False), (64, True)),
              256: ((64, False), (64, True))}


WS_ONLY = False


def _alloc(size: int, alignment: int, stream: object) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def gluon_dkdv(q, k, v, out, lse, do, delta, call, causal, tiling):
    """The served Gluon dK/dV kernel at ``tiling``, launched through Triton's JIT with flash_bwd_dkdv's arguments."""
    block_n, block_m, warps, overlap = tiling
    grads = bwd.empty_grads(q, k, v)
    args = bwd.triton_args(FLASH_BWD_DKDV.name, q, k, v, out, lse, do, delta, grads, call)
    kernel = gluon_kernel.flash_bwd_dkdv_gluon_kernel[bwd.dkdv_grid(k.shape[2], k.shape[1], k.shape[0], block_n)]

    def run():
        kernel(*args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=q.shape[-1], EVEN_D=True, CAUSAL=causal,
               OVERLAP=overlap, num_warps=warps)
        return grads.dk, grads.dv
    return run


def fused_backward(q, k, v, out, lse, do, causal, tiling):
    """The fused probe kernel as a whole backward: dQ's accumulator zeroed, delta, the kernel, dQ cast."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    block_n, block_m, warps, stages = tiling
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dqa = torch.empty((b, hq, sq, d), dtype=torch.float32, device=q.device)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    grid = (sk // block_n, hk, b)

    def run():
        dqa.zero_()
        bwd_atomic_probe_kernel.delta_kernel[((sq + 63) // 64, hq, b)](
            out, do, delta, *out.stride()[:3], *do.stride()[:3], sq, hq, BLOCK_M=64, BLOCK_D=d)
        probe.gluon_bwd_fused_kernel[grid](
            q, k, v, do, lse, delta, dk, dv, dqa, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *dqa.stride()[:3], hq // hk, hq, sq, sk, sk - sq,
            d ** -0.5, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d, CAUSAL=causal, STAGES=stages, num_warps=warps)
        return dqa.to(q.dtype), dk, dv
    return run


def ws_backward(q, k, v, out, lse, do, causal, tiling, kernel=None):
    """The served fused backward at ``tiling``: flash_bwd_prep (delta, zeroed accumulator), the kernel, dQ cast.

    ``kernel``: the fused kernel's JIT function (default: fused_kernel's, as Triton's JIT specialises it).
    """
    kernel = kernel or fused_kernel.flash_bwd_fused_gluon_kernel
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    block_m, prefetch = tiling
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    block_d, block_d2 = fused.chunks(d)  # a split or padded head dim as the binding runs it
    dqa = torch.empty((b, hq, sq, fused.tile(d)), dtype=torch.float32, device=q.device)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    prep_grid, grid = fused.grids(b, hq, hk, sq, sk, d)

    def run():
        fused_kernel.flash_bwd_prep_kernel[prep_grid](out, do, delta, dqa, *out.stride()[:3], *do.stride()[:3],
                                                      *delta.stride()[:2], hq, sq, d, BLOCK_M=fused.PREP_BLOCK_M,
                                                      BLOCK_D=fused.tile(d))
        kernel[grid](
            q, k, v, do, lse, delta, dk, dv, dqa, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2], hq // hk, hq, sq, sk, d,
            sk - sq, d ** -0.5, BLOCK_M=block_m, BLOCK_D=block_d, CAUSAL=causal, PREFETCH=prefetch, BLOCK_D2=block_d2,
            num_warps=4)
        return dqa[..., :d].to(q.dtype), dk, dv
    return run


def _timed(label, name, run, sl, ref, same, reps, log):
    """(ms, err/allowed) of a checked run, or None when it fails or breaks the rule (logged)."""
    try:
        got = run()
        torch.cuda.synchronize()
        worst = check([g[sl] for g in got], ref, same)
        ms = event_ms(run, reps=reps)
    except Exception as exc:  # noqa: BLE001 (a tiling that fails is reported, not fatal)
        log(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:300]}")
        return None
    log(f"  {label} {name:22s} {ms:7.3f} ms  err/allowed {worst:.2f}{'' if worst <= 1.0 else '  WRONG'}")
    return ms if worst <= 1.0 else None


def check(got, ref, same):
    worst = 0.0
    for g, r, s in zip(got, ref, same, strict=True):
        err = float((g.float() - r).abs().max())
        worst = max(worst, err / (3 * float((s.float() - r).abs().max()) + 1e-3))
    return worst


def make_case(d, causal, s):
    """One case of the grid (bf16, batch x seqlen = 16k, hidden 2048): inputs, the forward's out and lse, the
    float32 and same-precision references on a slice, the backward's FLOPs and a label."""
    b, h = max(1, 16384 // s), 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(s + d + causal)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4))
    call = fwd.check(q, k, v, "bottom_right" if causal else False, None)
    out, lse = fwd.forward(q, k, v, call)
    sl = (slice(0, 1), slice(0, 2))
    mode = "bottom_right" if causal else False
    ref = attention_backward_reference(*(x[sl].float() for x in (q, k, v, do)), causal=mode)
    same = attention_backward_reference(*(x[sl] for x in (q, k, v, do)), causal=mode)
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    label = f"bf16 hd{d} {'causal' if causal else 'full  '} {s // 1024}k"
    return (q, k, v, do), call, out, lse.contiguous(), sl, ref, same, flops, label


def run_case(d, causal, s, reps, log):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (q, k, v, do), call, out, lse, sl, ref, same, flops, label = make_case(d, causal, s)
    b, h = q.shape[:2]
    grads = bwd.empty_grads(q, k, v)
    delta = torch.empty((b, h, s), dtype=torch.float32, device="cuda")
    dq_launch, dkdv_launch = jit_launches(q, k, v, out, lse, do, delta, grads, call, causal)
    dq_launch()
    dkdv_launch()
    rows = {"dq (triton)": event_ms(dq_launch, reps=reps), "dkdv (triton)": event_ms(dkdv_launch, reps=reps)}
    log(f"  {label} triton dkdv err/allowed {check([grads.dk[sl], grads.dv[sl]], ref[1:], same[1:]):.2f}")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    dout = torch.empty_like(o).copy_(do)
    rows["cudnn bwd"] = event_ms(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), reps=reps)
    kinds = (("ws", WS_TILINGS[d]),) if WS_ONLY else (("gluon", TILINGS[d]), ("fused", FUSED_TILINGS[d]),
                                                           ("ws", WS_TILINGS[d]))
    for kind, tilings in kinds:
        for tiling in tilings:
            if kind == "ws":
                name = "ws " + "/".join(str(int(x)) for x in tiling)
                ms = _timed(label, name, ws_backward(q, k, v, out, lse, do, causal, tiling), sl, ref, same, reps, log)
            elif kind == "gluon":
                name = "gluon " + "/".join(str(int(x)) for x in tiling[:3]) + (" ovl" if tiling[3] else "")
                ms = _timed(label, name, gluon_dkdv(q, k, v, out, lse, do, delta, call, causal, tiling), sl, ref[1:],
                            same[1:], reps, log)
            else:
                name = "fused " + "/".join(str(int(x)) for x in tiling)
                ms = _timed(label, name, fused_backward(q, k, v, out, lse, do, causal, tiling), sl, ref, same, reps,
                            log)
            if ms is not None:
                rows[name] = ms
    best = min((n for n in rows if n.startswith("gluon ")), key=rows.__getitem__, default=None)
    fused_best = min((n for n in rows if n.startswith(("fused ", "ws "))), key=rows.__getitem__, default=None)
    return label, rows, flops, best, fused_best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4k only")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--ws-only", action="store_true", help="only the warp-specialised fused kernel's tilings")
    args = parser.parse_args(argv)
    global WS_ONLY
    WS_ONLY = args.ws_only
    import triton

    triton.set_allocator(_alloc)  # device-side tensor descriptors' global scratch
    seqlens = [4096] if args.quick else [int(x) for x in args.seqlens.split(",")]
    summary = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (False, True):
            for s in seqlens:
                summary.append(run_case(d, causal, s, args.reps, lambda m: print(m, flush=True)))
    print("\ncase                  | dq ms  dkdv ms gluon ms | flash_bwd cudnn projected TFLOP/s | dkdv gain  "
          "proj/cudnn | best gluon")
    for label, rows, flops, best, _ in summary:
        dq, dkdv, cudnn = rows["dq (triton)"], rows["dkdv (triton)"], rows["cudnn bwd"]
        g = rows[best] if best else float("nan")
        proj = dq + g
        print(f"{label:21s} | {dq:6.3f} {dkdv:6.3f} {g:7.3f}  | {flops / (dq + dkdv) / 1e9:6.0f} "
              f"{flops / cudnn / 1e9:6.0f} {flops / proj / 1e9:6.0f}             | {dkdv / g:5.2f}x   "
              f"{cudnn / proj:5.2f}x     | {best}")
    print("\ncase                  | flash_bwd cudnn fused TFLOP/s | fused/cudnn fused/flash_bwd | best fused")
    for label, rows, flops, _, fused_best in summary:
        two = rows["dq (triton)"] + rows["dkdv (triton)"]
        f = rows[fused_best] if fused_best else float("nan")
        print(f"{label:21s} | {flops / two / 1e9:6.0f} {flops / rows['cudnn bwd'] / 1e9:6.0f} {flops / f / 1e9:6.0f}"
              f"        | {rows['cudnn bwd'] / f:5.2f}x      {two / f:5.2f}x        | {fused_best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
