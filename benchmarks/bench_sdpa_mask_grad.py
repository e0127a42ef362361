"""Benchmark the SDPA backward with a float attn_mask that requires grad, beside torch's mem-efficient backend.

Four providers, timed in turns (``interleaved_ms``: one call of each a
round, so their ratios hold while the GPU's clock moves), each timing
``torch.autograd.grad(out, inputs, do, retain_graph=True)`` after one forward:

- ``lazytriton_mask_grad``: ``lazytriton.scaled_dot_product_attention`` with
  the mask requiring grad (inputs q, k, v and the mask: flash_bwd_dq's
  BIAS_GRAD variant writes dS, autograd sums it over the mask's broadcast dims);
- ``lazytriton_detached``: the same call with the mask detached (inputs q, k,
  v): our own backward with a bias, without its gradient;
- ``efficient_mask_grad`` and ``efficient_detached``: torch SDPA pinned to the
  mem-efficient backend (``SDPBackend.EFFICIENT_ATTENTION``), the one torch
  backend that computes a mask's gradient, likewise.

The mask has q's dtype and one of the forms ``--masks`` lists: ``full``
(batch, heads, seqlen, seqlen), ``heads`` (1, heads, seqlen, seqlen: a
relative-position bias shared over the batch), ``batch`` (batch, 1, seqlen,
seqlen), ``2d`` (seqlen, seqlen), ``keys`` (batch, 1, 1, seqlen: a padding
bias). Shapes: batch x seqlen = 16k tokens, heads x head dim = 2048, not
causal (torch refuses a mask with is_causal). Backward FLOPs are 2.5x the
forward's 4*B*H*S*S*D. Each provider's first mask gradient is compared with
the mem-efficient backend's (``max|ours - torch| / max|torch|``, column
``mask_rel``), and its peak memory above the inputs during one backward is
reported (``peak_mib``: torch allocates a full-size grad_bias too).

Rows go to a long-format CSV; with ``$OUT`` set the printed report is also
written to ``$OUT/bench_sdpa_mask_grad.log``.

Usage: python benchmarks/bench_sdpa_mask_grad.py [--csv PATH] [--dtypes bf16,fp16] [--head-dims 64,128]
       [--seqlens 1k,4k] [--masks full,heads,batch,2d,keys] [--warmup N] [--reps N]
       python benchmarks/bench_sdpa_mask_grad.py --cpu-smoke   (one tiny case on CPU: the interpreter)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from csvlog import append_rows, run_meta

import lazytriton
from lazytriton.cli.timing import interleaved_ms

FIELDS = ["kernel", "provider", "mode", "dtype", "head_dim", "mask", "batch", "heads", "seqlen", "p50_ms", "tflops",
          "mask_rel", "peak_mib", "check", "gpu", "torch", "triton", "lazytriton", "timestamp"]
PROVIDERS = ("lazytriton_mask_grad", "lazytriton_detached", "efficient_mask_grad", "efficient_detached")
MASKS = ("full", "heads", "batch", "2d", "keys")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS, HIDDEN = 16384, 2048


def mask_shape(form: str, batch: int, heads: int, seqlen: int) -> tuple[int, ...]:
    """The mask's shape for a form of ``MASKS``."""
    return {"full": (batch, heads, seqlen, seqlen), "heads": (1, heads, seqlen, seqlen),
            "batch": (batch, 1, seqlen, seqlen), "2d": (seqlen, seqlen), "keys": (batch, 1, 1, seqlen)}[form]


def _seqlen(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "sdpa_mask_grad.csv")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--seqlens", default="1k,4k")
    parser.add_argument("--masks", default="heads,batch,2d,full")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="one tiny case on CPU (Triton's interpreter): checks the script runs end to end")
    args = parser.parse_args(argv)
    try:
        args.dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
        args.head_dims = [int(d) for d in args.head_dims.split(",")]
        args.seqlens = [_seqlen(s) for s in args.seqlens.split(",")]
    except (KeyError, ValueError) as exc:
        parser.error(f"bad --dtypes, --head-dims or --seqlens: {exc}")
    args.masks = args.masks.split(",")
    args.providers = args.providers.split(",")
    bad = [m for m in args.masks if m not in MASKS] + [p for p in args.providers if p not in PROVIDERS]
    if bad:
        parser.error(f"unknown masks or providers {bad}: masks are {MASKS}, providers {PROVIDERS}")
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    return args


def setup(provider: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          do: torch.Tensor) -> tuple[Callable[[], Sequence[torch.Tensor]], torch.Tensor | None]:
    """(the timed backward, its first mask gradient or None): one forward, with the provider's leaves."""
    wants_mask = provider.endswith("mask_grad")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    m = mask.detach().requires_grad_(wants_mask)
    if provider.startswith("lazytriton"):
        out = lazytriton.scaled_dot_product_attention(*leaves, attn_mask=m)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, attn_mask=m)
    inputs = (*leaves, m) if wants_mask else tuple(leaves)

    def run() -> Sequence[torch.Tensor]:
        return torch.autograd.grad(out, inputs, do, retain_graph=True)

    first = run()
    return run, first[3] if wants_mask else None


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Memory allocated above the current level during one call of ``fn``, in MiB (NaN on the CPU)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def run_case(dtype: torch.dtype, head_dim: int, seqlen: int, form: str, batch: int, heads: int,
             args: argparse.Namespace, device: torch.device, log: Callable[[str], None]) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(seqlen + head_dim)
    q, k, v, do = (torch.randn(batch, heads, seqlen, head_dim, generator=gen, device=device, dtype=dtype)
                   for _ in range(4))
    mask = torch.randn(mask_shape(form, batch, heads, seqlen), generator=gen, device=device, dtype=dtype)
    ready: dict[str, tuple[Callable[[], Sequence[torch.Tensor]], float]] = {}
    grads: dict[str, torch.Tensor | None] = {}
    rows = []
    for provider in args.providers:
        try:
            fn, grads[provider] = setup(provider, q, k, v, mask, do)
            ready[provider] = (fn, peak_mib(fn, device))
        except Exception as exc:  # a backend missing on this GPU/torch is reported, not fatal
            log(f"  {provider:22s} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}")
    peer = grads.get("efficient_mask_grad")
    times = interleaved_ms([fn for fn, _ in ready.values()], device.type == "cuda", args.warmup, args.reps)
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim
    for (provider, (_, peak)), ms in zip(ready.items(), times, strict=True):
        mine = grads[provider]
        rel = float("nan")
        if mine is not None and peer is not None and mine is not peer:
            rel = float((mine.double() - peer.double()).abs().max() / peer.double().abs().max().clamp_min(1e-30))
        rows.append({"provider": provider, "mode": "bwd", "dtype": str(dtype).removeprefix("torch."),
                     "head_dim": head_dim, "mask": form, "batch": batch, "heads": heads, "seqlen": seqlen,
                     "p50_ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "mask_rel": f"{rel:.3g}",
                     "peak_mib": round(peak, 1), "check": "ok" if rel != rel or rel < 2e-2 else "wrong"})
        log(f"  {provider:22s} {ms:9.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s  peak {peak:9.1f} MiB  mask_rel {rel:.3g}")
    del ready, grads, peer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    out = os.environ.get("OUT")
    path = Path(out) / "bench_sdpa_mask_grad.log" if out else None

    def log(line: str) -> None:
        print(line, flush=True)
        if path is not None:
            with path.open("a") as f:
                f.write(line + "\n")

    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    if args.cpu_smoke:
        cases = [(torch.float16, 16, 24, form, 1, 2) for form in ("heads", "keys")]
        args.warmup, args.reps = 0, 1
    else:
        cases = [(dtype, d, s, form, max(1, TOKENS // s), HIDDEN // d) for dtype in args.dtypes
                 for d in args.head_dims for s in args.seqlens for form in args.masks]
    meta = run_meta("sdpa_mask_grad", device)
    rows = []
    for dtype, d, s, form, batch, heads in cases:
        log(f"{str(dtype).removeprefix('torch.')} hd{d} seqlen {s} mask {form} {mask_shape(form, batch, heads, s)} "
            f"(batch {batch}, heads {heads})")
        rows += [{**meta, **row} for row in run_case(dtype, d, s, form, batch, heads, args, device, log)]
    append_rows(args.csv, FIELDS, rows)
    log(f"{len(rows)} rows appended to {args.csv}")
    return 0 if all(row["check"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
