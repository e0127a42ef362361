"""Probe: a fused backward with atomic dQ (5 matrix products) against flash_bwd's two kernels (7) and cuDNN.

``bwd_atomic_probe_kernel.fused_bwd_kernel`` (through Triton's JIT) is run as a
whole backward: zero a float32 dQ accumulator, ``delta_kernel``, the fused
kernel, then dQ cast to the inputs' dtype. Beside it in the same run: the
backward lazytriton serves today (``flash_bwd``: dQ kernel, then dK/dV) and
SDPA's cuDNN backend. Shapes are bench_flash_bwd.py's (batch x seqlen = 16k,
hidden 2048); every tiling's gradients are checked against the float32
reference on a slice first (FlashAttention's rule: within 3x the same-precision
reference's error, plus a floor). TFLOP/s count the backward as 2.5x the
forward, FlashAttention's convention. Prints one table (the best tiling of
each case) and, for each case, every tiling.

On the CPU (``--cpu-smoke``) the two probe kernels run through Triton's
interpreter on one tiny fp16 shape per case and are checked only (Triton's
own interpreter multiplies bf16 bit patterns as integers; lazytriton's copy
fixes that, but runs only our kernel families).

Usage: python experiments/probe_bwd_atomic.py [--quick] [--dtypes bf16] [--head-dims 64,128] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bwd_atomic_probe_kernel as probe  # noqa: E402

from lazytriton.cli.timing import event_ms  # noqa: E402
from lazytriton.kernels.flash_bwd import binding as bwd  # noqa: E402
from lazytriton.kernels.flash_bwd.reference import attention_backward_reference  # noqa: E402
from lazytriton.kernels.flash_fwd import binding as fwd  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (BLOCK_N held keys, BLOCK_M streamed queries, warps, stages)
TILINGS = {64: ((128, 64, 8, 2), (128, 32, 4, 2), (128, 64, 4, 2)),
           128: ((128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2))}


def fused_backward(q, k, v, out, lse, do, causal, tiling, rotate=True, dq_tma=False):
    """A closure running the fused backward; returns (dq, dk, dv)."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    block_n, block_m, warps, stages = tiling
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    dqa = torch.empty((b, hq, sq, d), dtype=torch.float32, device=q.device)
    lse = lse.contiguous()
    grid = ((sk + block_n - 1) // block_n, hk, b)
    if q.is_cuda:
        from triton.tools.tensor_descriptor import TensorDescriptor

        dq_desc = TensorDescriptor.from_tensor(dqa.view(b * hq, sq, d), [1, block_m, d])
    else:
        dq_desc = dqa  # the interpreter has no descriptor atomics: never read without DQ_TMA

    def run():
        dqa.zero_()
        probe.delta_kernel[((sq + 63) // 64, hq, b)](out, do, delta, *out.stride()[:3], *do.stride()[:3], sq, hq,
                                                     BLOCK_M=64, BLOCK_D=d)
        compiled = probe.fused_bwd_kernel[grid](
            q, k, v, do, lse, delta, dk, dv, dqa, dq_desc, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *dqa.stride()[:3],
            hq // hk, hq, sq, sk, sk - sq, d ** -0.5,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d, CAUSAL=causal, ROTATE=rotate, DQ_TMA=dq_tma, num_warps=warps,
            num_stages=stages)
        run.info = f"{getattr(compiled, 'n_regs', '?')} regs, {getattr(compiled, 'n_spills', '?')} B spilled"
        return dqa.to(q.dtype), dk, dv
    run.info = ""
    return run


def check(got, ref, same):
    """Worst (error / allowed) over dq, dk, dv: allowed is 3x the same-precision reference's error plus 1e-3."""
    worst = 0.0
    for g, r, s in zip(got, ref, same, strict=True):
        err = float((g.float() - r).abs().max())
        allowed = 3 * float((s.float() - r).abs().max()) + 1e-3
        worst = max(worst, err / allowed)
    return worst


def run_case(dtype, d, causal, s, reps, on_gpu, log):
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        b, h = max(1, 16384 // s), 2048 // d
    else:
        b, h = 1, 2
    gen = torch.Generator(device=device).manual_seed(s + d + causal)
    q, k, v, do = (torch.randn(b, h, s, d, device=device, generator=gen).to(DTYPES[dtype]) for _ in range(4))
    call = fwd.check(q, k, v, "bottom_right" if causal else False, None)
    out, lse = fwd.forward(q, k, v, call)
    sl = (slice(0, 1), slice(0, min(h, 2)))
    ref = attention_backward_reference(*(x[sl].float() for x in (q, k, v, do)), causal="bottom_right" if causal
                                       else False)
    same = attention_backward_reference(*(x[sl] for x in (q, k, v, do)), causal="bottom_right" if causal else False)
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    label = f"{dtype} hd{d} {'causal' if causal else 'full  '} {s // 1024}k"
    rows = {}
    if on_gpu:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        cur = bwd.backward(q, k, v, out, lse, do, call)
        rows["flash_bwd"] = (event_ms(lambda: bwd.backward(q, k, v, out, lse, do, call), reps=reps),
                             check([g[sl] for g in cur], ref, same))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        dout = torch.empty_like(o).copy_(do)
        rows["cudnn"] = (event_ms(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), reps=reps), 0.0)
    for tiling in (TILINGS[d] if on_gpu else ((16, 16, 4, 1),)):
        kinds = [(rotate, False) for rotate in ((False, True) if not causal and on_gpu else (True,))]
        kinds += [(True, True)] if on_gpu else []
        for rotate, dq_tma in kinds:
            name = ("fused " + "/".join(map(str, tiling)) + (" rot" if rotate and not causal else "")
                    + (" tma" if dq_tma else ""))
            try:
                run = fused_backward(q, k, v, out, lse, do, causal, tiling, rotate, dq_tma)
                worst = check([g[sl] for g in run()], ref, same)
                ms = event_ms(run, reps=reps) if on_gpu else float("nan")
            except Exception as exc:  # noqa: BLE001 (a tiling that fails is reported, not fatal)
                log(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            rows[name] = (ms, worst)
            log(f"  {label} {name}: {run.info}")
    for name, (ms, worst) in rows.items():  # noqa: B007
        log(f"  {label} {name:24s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  err/allowed {worst:.2f}")
    return label, rows, flops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4k only")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cpu-smoke", action="store_true", help="interpreter, tiny shapes, checks only")
    args = parser.parse_args(argv)
    on_gpu = not args.cpu_smoke
    seqlens = [4096] if args.quick else [int(x) for x in args.seqlens.split(",")]
    dtypes = args.dtypes.split(",")
    if not on_gpu:  # the interpreter multiplies bf16 bit patterns as integers (lazytriton.interpreter's docstring)
        seqlens, dtypes = [40], ["fp16"]
    summary = []
    failed = False
    for dtype in dtypes:
        for d in (int(x) for x in args.head_dims.split(",")):
            for causal in (False, True):
                for s in seqlens:
                    label, rows, flops = run_case(dtype, d, causal, s, args.reps, on_gpu, print)
                    ok = {n: r for n, r in rows.items() if r[1] <= 1.0}
                    failed |= any(r[1] > 1.0 for r in rows.values())
                    fused = {n: r for n, r in ok.items() if n.startswith("fused")}
                    summary.append((label, rows, flops, min(fused.items(), key=lambda x: x[1][0]) if fused else None))
    print("\ncase                    | flash_bwd | cudnn | best fused (tiling)          | fused/cudnn fused/flash_bwd")
    for label, rows, flops, best in summary:
        def tf(name, rows=rows, flops=flops):
            return f"{flops / rows[name][0] / 1e9:5.0f}" if name in rows else "    -"
        if best is None:
            print(f"{label:23s} | {tf('flash_bwd')}     | {tf('cudnn')} | none passed")
            continue
        name, (ms, _) = best
        ratio_c = rows["cudnn"][0] / ms if "cudnn" in rows else float("nan")
        ratio_f = rows["flash_bwd"][0] / ms if "flash_bwd" in rows else float("nan")
        print(f"{label:23s} | {tf('flash_bwd')}     | {tf('cudnn')} | {flops / ms / 1e9:5.0f} {name[6:]:22s} | "
              f"{ratio_c:5.2f}x {ratio_f:5.2f}x")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
