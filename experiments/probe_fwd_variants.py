"""Probe: copies of the Gluon forward's kernel file, changed, beside the served forward and cuDNN.

A variant is a kernel file (a copy of kernels/flash_fwd/gluon_kernel.py with a change, in experiments/: the device
tool carries it, tracked or not). For bench_flash_fwd.py's shapes (bf16, batch x seqlen = 16k, hidden 2048), each
variant runs through Triton's JIT with a ping-pong tiling (dispatch's row for the head dim, causal or not; the
non-causal row's where dispatch has none, as at head dim 64 causal) and ``--q-tiles`` query tiles a program
(default dispatch's count for the shape, or the non-causal row's), is checked against a float32 reference on two
(batch, head) slices within FlashAttention's rule (at most twice cuDNN's error on the same slices, plus 1e-4), and
is timed (median of CUDA-event-timed runs, the providers' rounds interleaved) beside the served forward
(``flash.attn_fwd``, whatever dispatch picks) and SDPA's cuDNN backend.

Usage: python experiments/probe_fwd_variants.py [--head-dims 64,128] [--seqlens 1024,4096] [--causal both]
       [--q-tiles N] [--reps 30] [--rounds 3] --variant name=file.py [--variant ...]

Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lazytriton import flash
from lazytriton.cli.timing import event_ms
from lazytriton.kernels.flash_fwd import binding, gluon
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd.gluon import FLASH_FWD_GLUON
from lazytriton.variant import kernel_constexprs

HERE = Path(__file__).resolve().parent
# name -> the kernel file's flash_fwd_gluon_kernel (a JIT function), from --variant
VARIANTS: dict[str, Any] = {}


def load_kernel(path: str) -> Any:
    """The ``flash_fwd_gluon_kernel`` of a kernel file (relative to experiments/ or absolute)."""
    full = HERE / path
    spec = importlib.util.spec_from_file_location(f"fwd_variant_{full.stem}", full)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flash_fwd_gluon_kernel


def tiling_for(d: int, causal: bool, s: int, q_tiles: int) -> tuple[tuple[int, int, int], int]:
    """(tiles, query tiles a program) the variants run at: dispatch's ping-pong row for the shape, else the first
    ping-pong tiles that fit (``gluon.configs``) with the non-causal row's count (at head dim 64 causal flash_fwd
    serves to 1k and the wide tiles from there)."""
    row = fwd_dispatch.flash_fwd_gluon_default("bf16", d, causal, s)
    if row is not None and row[2]:
        tiles = row[0]
        count = fwd_dispatch.gluon_q_tiles(d, causal, s, tiles[0])
    else:
        tiles = gluon.configs(d, pingpong=True)[0]
        count = fwd_dispatch.gluon_q_tiles(d, False, s, tiles[0])
    return tiles, q_tiles or count


def launcher(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Any,
             tiles: tuple[int, int, int], q_tiles: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A run of ``kernel`` (a flash_fwd_gluon_kernel) at these tiles through Triton's JIT, flash_fwd's arguments."""
    b, hq, hk, sq, sk, d = call.shape
    variant = gluon.variant("sm_90", "bf16", d, call.causal, True, False, sq, sk, tiles=tiles, scale=call.scale,
                            pingpong=True, q_tiles=q_tiles)
    assert variant is not None, gluon.reason("sm_90", "bf16", d, call.causal, True, False, sq, sk, tiles[0],
                                             tiles[1], q_tiles=q_tiles)
    constexprs = kernel_constexprs(variant, FLASH_FWD_GLUON.constexprs)
    out, lse = binding.empty_outputs(q, call.shape)
    args = binding.triton_args(q, k, v, out, lse, call)
    launch = kernel[binding.grid(call.shape, int(variant.get("BLOCK_M")))]
    warps = int(variant.get("num_warps"))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        launch(*args, **constexprs, num_warps=warps)
        return out, lse
    return run


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, heads: int = 2) -> torch.Tensor:
    """float32 attention of batch 0's first ``heads`` heads."""
    s = (q[0, :heads].float() @ k[0, :heads].float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v[0, :heads].float()


def run_case(d: int, causal: bool, s: int, q_tiles: int, reps: int, rounds: int) -> tuple[str, dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h = 16384 // s, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    call = binding.check(q, k, v, causal)
    tiles, tiles_a_program = tiling_for(d, causal, s, q_tiles)
    label = f"hd{d} {'causal' if causal else 'full'} {s // 1024}k x{tiles_a_program}"

    def cudnn() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=causal)
    runs: dict[str, Callable[[], Any]] = {"cudnn": cudnn, "served": lambda: flash.attn_fwd(q, k, v, causal=causal)}
    runs.update({name: launcher(kernel, q, k, v, call, tiles, tiles_a_program) for name, kernel in VARIANTS.items()})
    ref = reference(q, k, v, causal)
    base = (cudnn()[0, :2].float() - ref).abs().max().item()
    rows: dict[str, Any] = {}
    for name, run in runs.items():
        try:
            got = run()
            out = got[0] if isinstance(got, tuple) else got
            torch.cuda.synchronize()
            err = (out[0, :2].float() - ref).abs().max().item()
        except Exception as exc:  # a variant that fails to compile or launch: reported, the others go on
            rows[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        if not err <= 2 * base + 1e-4:
            rows[name] = f"wrong: max error {err:.3g} against cuDNN's {base:.3g}"
            continue
        rows[name] = []
    for _ in range(rounds):  # interleaved rounds: a drift of the clocks falls on every provider alike
        for name, run in runs.items():
            if isinstance(rows[name], list):
                rows[name].append(event_ms(run, reps=reps))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    return label, {name: (flops / statistics.median(ms) / 1e9 if isinstance(ms, list) else ms)
                   for name, ms in rows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--causal", default="both", choices=("both", "causal", "full"))
    parser.add_argument("--q-tiles", type=int, default=0, help="query tiles a program (0: dispatch's count)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", required=True,
                        help="name=file.py: a kernel file to time (repeat for several)")
    args = parser.parse_args(argv)
    for text in args.variant:
        name, _, path = text.partition("=")
        VARIANTS[name] = load_kernel(path)
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    causals = {"both": (False, True), "causal": (True,), "full": (False,)}[args.causal]
    summary = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in causals:
            for s in (int(x) for x in args.seqlens.split(",")):
                label, rows = run_case(d, causal, s, args.q_tiles, args.reps, args.rounds)
                print(label, rows, flush=True)
                summary.append((label, rows))
    names = ["cudnn", "served", *VARIANTS]
    print("\nTFLOP/s (bf16), and each against cuDNN")
    print(f"{'case':22s} | " + " | ".join(f"{n:>14s}" for n in names))
    for label, rows in summary:
        cells = [f"{rows[n]:6.0f} ({rows[n] / rows['cudnn']:4.2f})" if isinstance(rows.get(n), float)
                 else f"{str(rows.get(n))[:14]:>14s}" for n in names]
        print(f"{label:22s} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
