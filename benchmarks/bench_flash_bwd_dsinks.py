"""Benchmark the sinks' gradient kernel (``flash_bwd_dsinks``) beside the torch formula the Python backward runs.

d(sinks)_h = -sum over batch and rows of head h of exp(sink_h - lse) * delta reads 8 bytes a row (lse and delta,
float32): bound by memory, so the report is microseconds and GB/s (the median of CUDA-event-timed runs, the two
providers interleaved). Providers:

- ``kernel``: ``flash_bwd_dsinks.binding.dsinks`` (one launch, one program a query head, deterministic);
- ``torch``: ``flash_fwd.sinks.grad`` (what ``flash_bwd.binding.sinks_backward`` runs today: sub, nan_to_num,
  exp, mul, sum).

The Python backward takes the kernel in place of the formula if ``kernel`` is as fast or faster across the grid
(not measured yet: the Python path runs the formula). Each result is checked against the float64 formula
(``ok``/``wrong``). Rows go to ``benchmarks/results/flash_bwd_dsinks.csv``.

Usage: python benchmarks/bench_flash_bwd_dsinks.py [--csv PATH] [--warmup N] [--reps N]
       python benchmarks/bench_flash_bwd_dsinks.py --list   (the cases; no GPU needed)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from csvlog import append_rows, run_meta

# (batch, heads_q, seqlen_q): decoding-sized to long prefill, few heads (one program each) to many.
CASES = ((1, 8, 1024), (8, 32, 4096), (8, 64, 8192), (1, 64, 131072), (2, 8, 65536), (32, 128, 1024))
FIELDS = ("kernel", "gpu", "torch", "triton", "lazytriton", "time", "provider", "batch", "heads", "seqlen_q",
          "us_p50", "gb_s", "check")


def _timed(fn: Callable[[], torch.Tensor], warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "flash_bwd_dsinks.csv")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    if args.list:
        for case in CASES:
            print("batch {} heads {} seqlen_q {}".format(*case))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (--list needs none)", file=sys.stderr)
        return 2
    from lazytriton.kernels.flash_bwd_dsinks import binding, reference
    from lazytriton.kernels.flash_fwd import sinks as fwd_sinks

    device = torch.device("cuda", 0)
    meta = run_meta("flash_bwd_dsinks", device)
    rows = []
    for batch, heads, seqlen in CASES:
        gen = torch.Generator(device=device).manual_seed(0)
        sinks = torch.randn(heads, device=device, generator=gen)
        lse = torch.randn(batch, heads, seqlen, device=device, generator=gen) + 3
        delta = torch.randn(batch, heads, seqlen, device=device, generator=gen)
        want = reference.dsinks(sinks.cpu(), lse.cpu(), delta.cpu())
        calls = {"kernel": lambda s=sinks, x=lse, d=delta: binding.dsinks(s, x, d),
                 "torch": lambda s=sinks, x=lse, d=delta: fwd_sinks.grad(s, x, d, 1)}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(5):  # interleaved rounds
            for name, fn in calls.items():
                times[name] += _timed(fn, args.warmup, max(1, args.reps // 5))
        for name, fn in calls.items():
            p50 = sorted(times[name])[len(times[name]) // 2]
            error = (fn().double().cpu() - want).abs().max().item()
            check = "ok" if error <= 1e-3 * max(1.0, want.abs().max().item()) else "wrong"
            gb_s = 8 * batch * heads * seqlen / (p50 * 1e-6) / 1e9
            print(f"{name:6s} batch {batch:3d} heads {heads:4d} seqlen_q {seqlen:7d}: {p50:8.2f} us "
                  f"{gb_s:7.1f} GB/s {check}")
            rows.append({**meta, "provider": name, "batch": batch, "heads": heads, "seqlen_q": seqlen,
                         "us_p50": f"{p50:.3f}", "gb_s": f"{gb_s:.1f}", "check": check})
    append_rows(args.csv, FIELDS, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
