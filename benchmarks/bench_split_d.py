"""Benchmark split tiles against padding for head dims that are not powers of two, forward and backward.

A head dim like 96 runs today in a 128-wide tile (``BLOCK_D`` = 128,
``EVEN_D`` = false: a quarter of the matrix work is padding). Split tiles
(``BLOCK_D2`` > 0, ``geometry.split_head_dim``) hold it as 64 + 32. Both
variants of one call are forced through the binding (``binding.launch_gpu``'s
``variant``: launched exactly as a call launches them), for head dims 40, 72,
80, 96, 160 and 192, causal or not, bf16 (``--dtype fp16`` too), seqlen 4k with
batch x seqlen = 16k and heads x head dim ~ 2048 (FlashAttention's benchmark
shapes). By default both use the tiles dispatch gives (the padded head dim's
tuning row); ``--sweep`` also tries a few tile configs per variant and keeps
the fastest of each (``padded_best``, ``split_best``), since the split kernel
holds other tiles in registers.

Correctness first: each variant's output (and logsumexp) is checked against
a float32 reference (SDPA's math on float32 copies) with FlashAttention's rule
against the same-dtype reference, before it is timed; a wrong one is reported
and not timed. Then the median of CUDA-event-timed runs
(``lazytriton.cli.timing.median_ms``) and TFLOP/s of the real head dim's work
(4 * batch * heads * seqlen^2 * head_dim, halved if causal). Rows go to a
long-format CSV (``csvlog``); a table of padded against split comes last.
``--cpu-smoke`` runs tiny shapes through Triton's interpreter (numbers
meaningless, the checks real).

The backward (``--mode bwd``, or ``both``, the default) times flash_bwd's two
kernels (dq, then dK/dV) of one call, padded against split (``BLOCK_D2`` in
both), forced through ``flash_bwd.binding.launch_gpu`` with dispatch's tiles
(the padded head dim's tuning rows; ``--sweep`` is the forward's only), on the
forward's out and lse. Each pair's dq, dk and dv are checked first against a
float32 autograd reference with FlashAttention's rule (tests/test_flash_bwd.py's
floors); TFLOP/s count FlashAttention's 2.5 times the forward's work. Its rows
have mode ``bwd`` and kernel ``flash_bwd``.

Usage: python benchmarks/bench_split_d.py [--csv PATH] [--dtype bf16,fp16] [--head-dims 96,192] [--sweep]
       [--mode fwd|bwd|both]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from csvlog import append_rows, run_meta

from lazytriton import compiler, geometry, machine
from lazytriton.cli.timing import median_ms
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding
from lazytriton.kernels.flash_fwd.reference import attention_reference
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant, kernel_constexprs

FIELDS = ["kernel", "provider", "mode", "dtype", "head_dim", "block_d", "causal", "batch", "heads", "seqlen",
          "config", "p50_ms", "tflops", "rel_err", "check", "gpu", "torch", "triton", "lazytriton", "timestamp"]
HEAD_DIMS = (40, 72, 80, 96, 160, 192)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The tile configs --sweep tries beside dispatch's (BLOCK_M, BLOCK_N, num_warps, num_stages).
SWEEP = (Config(128, 64, 8, 3), Config(128, 128, 8, 3), Config(128, 64, 4, 3),
         Config(64, 64, 4, 3), Config(128, 32, 4, 4), Config(64, 128, 8, 2))
OUT_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # tests/test_flash_fwd.py's
GRAD_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # tests/test_flash_bwd.py's


@dataclass
class Result:
    provider: str
    dtype: str
    head_dim: int
    block_d: str
    causal: bool
    shape: tuple[int, int, int]  # batch, heads, seqlen
    config: str
    ms: float | None
    tflops: float | None
    err: float | None
    check: str
    mode: str = "fwd"


def variants_of(target: Target, dtype: str, head_dim: int, causal: bool, seqlen: int,
                sweep: bool) -> dict[str, list[Variant]]:
    """The padded and split variants to time: dispatch's tiles, and with ``sweep`` the SWEEP configs too."""
    found: dict[str, list[Variant]] = {}
    for provider, split in (("padded", False), ("split", True)):
        configs: list[Config | None] = [None, *(SWEEP if sweep else ())]
        found[provider] = [dispatch.kernel_variant("flash_fwd", target, dtype, head_dim, causal, True, seqlen, seqlen,
                                                   config=c, split_d=split, tma=False)
                           for c in configs]
    return found


def runner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: binding.Call,
           variant: Variant) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """One forced variant: the binding's GPU launch, or the interpreter (small tiles) on the CPU."""
    out, lse = binding.empty_outputs(q, call.shape)

    def on_gpu() -> tuple[torch.Tensor, torch.Tensor]:
        binding.launch_gpu(q, k, v, out, lse, call, variant)
        return out, lse

    def on_cpu() -> tuple[torch.Tensor, torch.Tensor]:
        constexprs = {**kernel_constexprs(variant, FLASH_FWD.constexprs), "BLOCK_M": 32, "BLOCK_N": 16}
        compiler.interpret(FLASH_FWD.name, binding.grid(call.shape, 32), binding.triton_args(q, k, v, out, lse, call),
                           constexprs)
        return out, lse

    return on_gpu if q.is_cuda else on_cpu


def check(got: tuple[torch.Tensor, torch.Tensor], exact: tuple[torch.Tensor, torch.Tensor],
          same: tuple[torch.Tensor, torch.Tensor]) -> tuple[bool, float]:
    """FlashAttention's rule for out (twice the same-dtype reference's error plus a floor) and lse; rel. error."""
    out, lse = got
    err = float((out.float() - exact[0]).abs().max())
    same_err = float((same[0].float() - exact[0]).abs().max())
    ok = bool(torch.isfinite(out).all()) and err <= 2 * same_err + OUT_FLOOR[out.dtype] * max(
        1.0, float(exact[0].abs().max()))
    ok = ok and float((lse - exact[1]).abs().max()) <= 2 * float((same[1] - exact[1]).abs().max()) + 1e-4
    return ok, float((out.float() - exact[0]).norm() / exact[0].norm())


def references(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(float32 reference, same-dtype reference), each (out, lse); on the GPU by chunks of heads to bound memory."""
    exact_parts, same_parts = [], []
    for h in range(0, q.shape[1], 4):
        qs, ks, vs = q[:, h:h + 4], k[:, h:h + 4], v[:, h:h + 4]
        exact_parts.append(attention_reference(qs.float(), ks.float(), vs.float(), causal=causal))
        same_parts.append(attention_reference(qs, ks, vs, causal=causal))
    return (tuple(torch.cat(p, 1) for p in zip(*exact_parts, strict=True)),  # type: ignore[return-value]
            tuple(torch.cat(p, 1) for p in zip(*same_parts, strict=True)))


def measure(dtype_name: str, head_dim: int, causal: bool, seqlen: int, batch: int, device: torch.device,
            args: argparse.Namespace) -> list[Result]:
    dtype = DTYPES[dtype_name]
    heads = max(1, 2048 // head_dim)
    gen = torch.Generator(device=device).manual_seed(head_dim * 2 + causal)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, generator=gen, device=device).to(dtype)
               for _ in range(3))
    call = binding.check(q, k, v, causal)
    exact, same = references(q, k, v, causal)
    flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    target = machine.target_of_device(device) if device.type == "cuda" else Target.parse("sm_90")
    results = []
    for provider, variants in variants_of(target, dtype_name, head_dim, causal, seqlen, args.sweep).items():
        best: Result | None = None
        for index, variant in enumerate(variants):
            block_d = f"{variant.get('BLOCK_D')}" + (f"+{variant.get('BLOCK_D2')}" if provider == "split" else "")
            config = "{}/{}/{}w/{}s".format(*(variant.get(n) for n in ("BLOCK_M", "BLOCK_N", "num_warps",
                                                                         "num_stages")))
            try:
                fn = runner(q, k, v, call, variant)
                ok, err = check(fn(), exact, same)
                ms = median_ms(fn, device.type == "cuda", args.warmup, args.reps) if ok else None
                r = Result(provider, dtype_name, head_dim, block_d, causal, (batch, heads, seqlen), config, ms,
                           flops / ms / 1e9 if ms else None, err, "ok" if ok else "wrong")
            except Exception as exc:  # a config that does not fit (shared memory) is reported, not fatal
                r = Result(provider, dtype_name, head_dim, block_d, causal, (batch, heads, seqlen), config, None,
                           None, None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            results.append(r)
            shown = f"{r.ms:.3f} ms {r.tflops:.0f} TFLOP/s" if r.ms and r.tflops else ""
            print(f"{dtype_name} d{head_dim} {'causal' if causal else 'full':<6} {provider:<6} {block_d:<7} "
                  f"{config:<14} {r.check:<6} {shown}", flush=True)
            if index and r.ms is not None and (best is None or best.ms is None or r.ms < best.ms):
                best = r
        if best is not None:
            base = next(r for r in results if r.provider == provider)
            if base.ms is None or (best.ms is not None and best.ms < base.ms):
                results.append(Result(**{**best.__dict__, "provider": f"{provider}_best"}))
            else:
                results.append(Result(**{**base.__dict__, "provider": f"{provider}_best"}))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------
# The backward: flash_bwd_dq then flash_bwd_dkdv, padded against split


def bwd_variants_of(target: Target, dtype: str, head_dim: int, causal: bool,
                    seqlen: int) -> dict[str, tuple[Variant, Variant]]:
    """The padded and split (dq, dkdv) pairs to time: dispatch's tiles, which are the padded head dim's for both."""
    return {provider: tuple(dispatch.kernel_variant(kernel, target, dtype, head_dim, causal, True,  # type: ignore
                                                    seqlen, seqlen, split_d=split)
                            for kernel in bwd_dispatch.BWD_KERNELS)
            for provider, split in (("padded", False), ("split", True))}


def bwd_runner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               do: torch.Tensor, call: binding.Call,
               pair: tuple[Variant, Variant]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One forced (dq, dkdv) pair: the binding's GPU launch, or the interpreter (tiles of 16) on the CPU."""
    grads = bwd_binding.empty_grads(q, k, v)

    def on_gpu() -> tuple[torch.Tensor, ...]:
        bwd_binding.launch_gpu(q, k, v, out, lse, do, grads, call, pair)
        return tuple(grads)

    def on_cpu() -> tuple[torch.Tensor, ...]:
        delta = torch.empty(tuple(lse.shape), dtype=torch.float32)
        for spec, variant, grid in zip((FLASH_BWD_DQ, FLASH_BWD_DKDV), pair, bwd_binding.grids(call.shape, 16, 16),
                                       strict=True):
            constexprs = {**kernel_constexprs(variant, spec.constexprs), "BLOCK_M": 16, "BLOCK_N": 16}
            compiler.interpret(spec.name, grid, bwd_binding.triton_args(spec.name, q, k, v, out, lse, do, delta,
                                                                        grads, call), constexprs)
        return tuple(grads)

    return on_gpu if q.is_cuda else on_cpu


def bwd_references(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                   causal: bool) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(float32 reference, same-dtype reference) of (dq, dk, dv) through autograd, by chunks of heads."""
    def grads(dtype: torch.dtype, h: int) -> tuple[torch.Tensor, ...]:
        leaves = [t[:, h:h + 4].to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention_reference(*leaves, causal=causal)[0]
        return torch.autograd.grad(out, leaves, do[:, h:h + 4].to(dtype))

    exact = [grads(torch.float32, h) for h in range(0, q.shape[1], 4)]
    same = [grads(q.dtype, h) for h in range(0, q.shape[1], 4)]
    return (tuple(torch.cat(p, 1) for p in zip(*exact, strict=True)),
            tuple(torch.cat(p, 1) for p in zip(*same, strict=True)))


def bwd_check(got: tuple[torch.Tensor, ...], exact: tuple[torch.Tensor, ...],
              same: tuple[torch.Tensor, ...]) -> tuple[bool, float]:
    """FlashAttention's rule for each of dq, dk, dv (tests/test_flash_bwd.py's); the worst relative error."""
    ok, worst = True, 0.0
    for g, r, s in zip(got, exact, same, strict=True):
        err = float((g.float() - r).abs().max())
        floor = GRAD_FLOOR[g.dtype] * max(1.0, float(r.abs().max()))
        ok = ok and bool(torch.isfinite(g).all()) and err <= 2 * float((s.float() - r).abs().max()) + floor
        worst = max(worst, float((g.float() - r).norm() / r.norm().clamp_min(1e-30)))
    return ok, worst


def measure_bwd(dtype_name: str, head_dim: int, causal: bool, seqlen: int, batch: int, device: torch.device,
                args: argparse.Namespace) -> list[Result]:
    """Time the backward's padded and split pairs on one call (inputs as ``measure``'s, a random dO)."""
    import lazytriton

    dtype = DTYPES[dtype_name]
    heads = max(1, 2048 // head_dim)
    gen = torch.Generator(device=device).manual_seed(head_dim * 2 + causal + 1)
    q, k, v, do = (torch.randn(batch, heads, seqlen, head_dim, generator=gen, device=device).to(dtype)
                   for _ in range(4))
    call = binding.check(q, k, v, causal)
    out, lse = lazytriton.attn_fwd(q, k, v, causal=causal)
    exact, same = bwd_references(q, k, v, do, causal)
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    target = machine.target_of_device(device) if device.type == "cuda" else Target.parse("sm_90")
    results = []
    for provider, pair in bwd_variants_of(target, dtype_name, head_dim, causal, seqlen).items():
        block_d = f"{pair[0].get('BLOCK_D')}" + (f"+{pair[0].get('BLOCK_D2')}" if provider == "split" else "")
        config = "dq {}/{}/{}w/{}s dkdv {}/{}/{}w/{}s".format(
            *(variant.get(n) for variant in pair for n in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")))
        try:
            fn = bwd_runner(q, k, v, out, lse, do, call, pair)
            ok, err = bwd_check(fn(), exact, same)
            ms = median_ms(fn, device.type == "cuda", args.warmup, args.reps) if ok else None
            r = Result(provider, dtype_name, head_dim, block_d, causal, (batch, heads, seqlen), config, ms,
                       flops / ms / 1e9 if ms else None, err, "ok" if ok else "wrong", "bwd")
        except Exception as exc:  # a pair that does not fit (shared memory) is reported, not fatal
            r = Result(provider, dtype_name, head_dim, block_d, causal, (batch, heads, seqlen), config, None, None,
                       None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", "bwd")
        results.append(r)
        shown = f"{r.ms:.3f} ms {r.tflops:.0f} TFLOP/s" if r.ms and r.tflops else ""
        print(f"bwd {dtype_name} d{head_dim} {'causal' if causal else 'full':<6} {provider:<6} {block_d:<7} "
              f"{config:<34} {r.check:<6} {shown}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return results


def csv_row(meta: dict[str, str], r: Result) -> dict[str, object]:
    b, h, s = r.shape
    return {**meta, "provider": r.provider, "mode": r.mode, "dtype": r.dtype, "head_dim": r.head_dim,
            "block_d": r.block_d, "causal": r.causal, "batch": b, "heads": h, "seqlen": s, "config": r.config,
            "p50_ms": "" if r.ms is None else round(r.ms, 4),
            "tflops": "" if r.tflops is None else round(r.tflops, 1),
            "rel_err": "" if r.err is None else f"{r.err:.1e}", "check": r.check}


def _cell(r: Result | None) -> str:
    return f"{r.tflops:12.0f}" if r is not None and r.tflops else f"{(r.check if r else '-')[:12]:>12}"


def print_table(results: Sequence[Result], mode: str = "fwd") -> None:
    """Per dtype, head dim and causal mode: padded and split TFLOP/s (dispatch's tiles; the sweep's best too)."""
    results = [r for r in results if r.mode == mode]
    if not results:
        return
    keys = sorted({(r.dtype, r.head_dim, r.causal) for r in results})
    swept = any(r.provider.endswith("_best") for r in results)
    cols = ["padded", "split"] + (["padded_best", "split_best"] if swept else [])
    kernel = "flash_fwd" if mode == "fwd" else "flash_bwd (dq + dK/dV)"
    print(f"\nTFLOP/s (real head dim's work), {kernel}, padded against split tiles")
    print(f"{'dtype':<5} {'d':>4} {'causal':<6} " + " ".join(f"{c:>12}" for c in cols) + f" {'split/padded':>13}")
    for dtype, d, causal in keys:
        got = {r.provider: r for r in results if (r.dtype, r.head_dim, r.causal) == (dtype, d, causal)
               and (r.provider in cols)}


        pair = ("padded_best", "split_best") if swept else ("padded", "split")
        a, b = got.get(pair[0]), got.get(pair[1])
        ratio = f"{b.tflops / a.tflops:13.2f}" if a and b and a.tflops and b.tflops else f"{'-':>13}"
        cells = " ".join(_cell(got.get(c)) for c in cols)
        print(f"{dtype:<5} {d:>4} {'yes' if causal else 'no':<6} {cells} {ratio}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "split_d.csv")
    parser.add_argument("--dtype", default="bf16", help="comma-separated: bf16,fp16")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--sweep", action="store_true", help="also try SWEEP's tile configs, keep each one's best "
                        "(forward only)")
    parser.add_argument("--mode", choices=("fwd", "bwd", "both"), default="both",
                        help="time the forward, the backward (flash_bwd's two kernels), or both")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through the interpreter (no GPU)")
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtype.split(",") if d]
    args.head_dim_list = [int(d) for d in args.head_dims.split(",") if d]
    if any(d not in DTYPES for d in args.dtypes) or any(geometry.split_head_dim(d) is None
                                                        for d in args.head_dim_list):
        parser.error(f"--dtype takes {', '.join(DTYPES)}; --head-dims only dims a split shrinks "
                     f"(e.g. {', '.join(map(str, HEAD_DIMS))})")
    if args.seqlen < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("--seqlen and --reps must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run; exit status 1 if a split variant gave a wrong answer (a config that does not fit is no error), 2 without
    a GPU."""
    args = parse_args(argv)
    causals = {"both": [False, True], "causal": [True], "full": [False]}[args.causal]
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.head_dim_list, args.dtypes, args.sweep = args.head_dim_list[:2], args.dtypes[:1], False
        args.warmup, args.reps, seqlen, batch = 0, 1, 40, 1
    elif not torch.cuda.is_available():
        print("bench_split_d needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    else:
        device, seqlen = torch.device("cuda"), args.seqlen
        batch = max(1, 16384 // seqlen)
    modes = {"fwd": ("fwd",), "bwd": ("bwd",), "both": ("fwd", "bwd")}[args.mode]
    metas = {mode: run_meta("flash_fwd" if mode == "fwd" else "flash_bwd", device) for mode in modes}
    results: list[Result] = []
    for mode in modes:
        for dtype in args.dtypes:
            for d in args.head_dim_list:
                for causal in causals:
                    found = (measure if mode == "fwd" else measure_bwd)(dtype, d, causal, seqlen, batch, device, args)
                    append_rows(args.csv, FIELDS, [csv_row(metas[mode], r) for r in found])
                    results += found
    for mode in modes:
        print_table(results, mode)
    return 1 if any(r.check == "wrong" for r in results if r.provider == "split") else 0


if __name__ == "__main__":
    sys.exit(main())
