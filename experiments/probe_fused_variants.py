"""Probe: copies of the fused backward's kernel file, changed, beside the served kernel and cuDNN.

A variant is a kernel file (a copy of kernels/flash_bwd/fused_kernel.py with a change, untracked in experiments/: the
device tool carries it) and the extra constexprs its kernel takes. For bench_flash_bwd.py's shapes (bf16, batch x
seqlen = 16k, hidden 2048), every variant runs as a whole backward (flash_bwd_prep, the kernel, dQ's cast) through
Triton's JIT with the served kernel's table tiling, is checked against the float32 reference on a slice
(FlashAttention's rule), and is timed (median of CUDA-event-timed runs) beside the served kernel's JIT launch and
cuDNN's backward. The table gives TFLOP/s (backward = 2.5 forwards).

Usage: python experiments/probe_fused_variants.py [--head-dims 128,64] [--seqlens 4096,16384] [--reps 10]
       [--causal both|causal|full] --variant name=file.py[:FLAG=1,...] [--variant ...]

It measured (NOTES.md, 12-01 6th) the ring for lse and delta (landed), the dQ product deferred a step with or
without ping-pong, causal grids walked heaviest first, and the slot released before dQ's product (not landed).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_gluon_bwd  # noqa: E402

from lazytriton.cli.timing import event_ms  # noqa: E402
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch

# name -> (a kernel file, its extra constexprs), from --variant
VARIANTS: dict[str, tuple[str, dict[str, int]]] = {}


def parse_variant(text: str) -> tuple[str, tuple[str, dict[str, int]]]:
    """``name=file.py[:FLAG=1,...]`` (the file relative to experiments/ or absolute) -> VARIANTS' item."""
    name, _, rest = text.partition("=")
    path, _, flags = rest.partition(":")
    return name, (path, {k: int(v) for k, v in (f.split("=") for f in flags.split(",") if f)})


def load_kernel(path: str):
    """The flash_bwd_fused_gluon_kernel of a kernel file (a copy of fused_kernel.py or fused_variant_kernel.py)."""
    full = Path(__file__).resolve().parent / path
    spec = importlib.util.spec_from_file_location(f"variant_{full.stem}", full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flash_bwd_fused_gluon_kernel


class _With:
    """A JIT function whose launches take extra keyword arguments (the variant's flags)."""

    def __init__(self, fn, **extra):
        self.fn, self.extra = fn, extra

    def __getitem__(self, grid):
        launch = self.fn[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, **self.extra)


def run_case(d, causal, s, reps, log):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (q, k, v, do), _, out, lse, sl, ref, same, flops, label = probe_gluon_bwd.make_case(d, causal, s)
    block_m, prefetch, _ = bwd_dispatch.BWD_FUSED_TABLE[("bf16", d, causal)]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    dout = torch.empty_like(o).copy_(do)
    rows = {"cudnn": event_ms(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), reps=reps)}
    runs = {"served": probe_gluon_bwd.ws_backward(q, k, v, out, lse, do, causal, (block_m, prefetch))}
    for name, (path, extra) in VARIANTS.items():
        runs[name] = probe_gluon_bwd.ws_backward(q, k, v, out, lse, do, causal, (block_m, prefetch),
                                                 _With(load_kernel(path), **extra))
    for name, run in runs.items():
        ms = probe_gluon_bwd._timed(label, name, run, sl, ref, same, reps, log)
        if ms is not None:
            rows[name] = ms
    return label, rows, flops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--causal", default="both", choices=("both", "causal", "full"))
    parser.add_argument("--variant", action="append", required=True,
                        help="name=file.py[:FLAG=1,...]: a kernel file to time (repeat for several)")
    args = parser.parse_args(argv)
    VARIANTS.update(parse_variant(v) for v in args.variant)
    causals = {"both": (False, True), "causal": (True,), "full": (False,)}[args.causal]
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    summary = [run_case(d, causal, s, args.reps, lambda m: print(m, flush=True))
               for d in (int(x) for x in args.head_dims.split(","))
               for causal in causals for s in (int(x) for x in args.seqlens.split(","))]
    names = ["cudnn", "served", *VARIANTS]
    print("\nTFLOP/s (backward = 2.5 forwards), and each against cuDNN")
    print(f"{'case':21s} | " + " | ".join(f"{n:>18s}" for n in names))
    for label, rows, flops in summary:
        cells = []
        for n in names:
            ms = rows.get(n)
            cells.append(f"{'failed':>18s}" if ms is None else
                         f"{flops / ms / 1e9:7.0f} ({rows['cudnn'] / ms:4.2f}x)   ")
        print(f"{label:21s} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
