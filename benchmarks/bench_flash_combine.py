"""Benchmark lazytriton's ``flash_attn_combine`` beside the same merge in PyTorch, measured in the same run.

A combine reads every split's float32 output and logsumexp once and writes
the merged output: bound by memory, so throughput is reported in GB/s (bytes
read plus written, over the median of CUDA-event-timed runs, interleaved
with the other provider's) against the GPU's bandwidth (H200: 4.8 TB/s).

The grid: split-KV decoding (one query, 32 heads, head dim 128; batch 1, 16
and 64; 4, 16 and 64 splits), head dims 64 and 256, MLA's decoding (128
heads of head dim 512, 8 splits) and context parallelism's prefill (8192
queries, 32 heads, 2 and 8 ranks); partials in FlashAttention-3's layouts,
output bf16. Providers:

- ``lazytriton``: ``flash_attn_combine(out_partial, lse_partial,
  out_dtype=torch.bfloat16)``, the public call;
- ``torch``: FlashAttention-3's ``attention_combine_ref`` (logsumexp over the
  splits, the weights, the weighted sum), eager, then the cast to bf16.

Each provider's output is checked against the float64 reference of the
first batch element (max error at most 2e-2): ``ok`` or ``wrong``. Rows go
to a long-format CSV (``benchmarks/results/flash_combine.csv``); with
``$OUT`` set the report is also written to ``$OUT/bench_flash_combine.log``.

Usage: python benchmarks/bench_flash_combine.py [--csv PATH] [--warmup N] [--reps N]
       python benchmarks/bench_flash_combine.py --list     (the cases; no GPU needed)
       python benchmarks/bench_flash_combine.py --quick    (two tiny cases on CPU: the interpreter, CI)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from csvlog import append_rows, memory_peak_gb_s, run_meta

import lazytriton
from lazytriton.cli.timing import interleaved_ms
from lazytriton.kernels.flash_combine.reference import combine_reference

FIELDS = ["kernel", "provider", "case", "batch", "seqlen", "heads", "head_dim", "splits", "p50_ms", "gb_s",
          "bw_frac", "max_err", "check", "gpu", "torch", "triton", "lazytriton", "timestamp"]
PROVIDERS = ("lazytriton", "torch")
TOLERANCE = 2e-2


class Case(NamedTuple):
    name: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    splits: int

    @property
    def bytes(self) -> int:
        """Partials read (float32 outputs and logsumexps), bf16 out and float32 lse written."""
        rows = self.batch * self.seqlen * self.heads
        return rows * (self.splits * (self.head_dim + 1) * 4 + self.head_dim * 2 + 4)

    @property
    def label(self) -> str:
        return (f"{self.name:<8} b{self.batch:<3} s{self.seqlen:<5} h{self.heads:<4} d{self.head_dim:<4} "
                f"n{self.splits:<3}")


CASES = [*(Case("decode", b, 1, 32, 128, n) for b in (1, 16, 64) for n in (4, 16, 64)),
         Case("decode", 16, 1, 32, 64, 16), Case("decode", 16, 1, 32, 256, 16), Case("mla", 64, 1, 128, 512, 8),
         Case("prefill", 1, 8192, 32, 128, 2), Case("prefill", 1, 8192, 32, 128, 8)]
QUICK_CASES = [Case("decode", 2, 1, 4, 64, 5), Case("prefill", 1, 8, 2, 96, 2)]


def make_partials(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-3's layouts: out_partial contiguous, lse_partial contiguous along seqlen (a transposed view)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out_partial = torch.randn(case.splits, case.batch, case.seqlen, case.heads, case.head_dim, generator=gen,
                              device=device)
    lse_partial = torch.randn(case.splits, case.batch, case.heads, case.seqlen, generator=gen, device=device) * 3
    return out_partial, lse_partial.transpose(-1, -2)


def lazytriton_call(out_partial: torch.Tensor, lse_partial: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)[0]


def torch_call(out_partial: torch.Tensor, lse_partial: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        lse = torch.logsumexp(lse_partial, dim=0)
        scale = torch.exp(lse_partial - lse)
        scale = torch.where(torch.isinf(scale) | torch.isnan(scale), torch.zeros_like(scale), scale)
        return (scale.unsqueeze(-1) * out_partial).sum(0).to(torch.bfloat16)

    return run


class Result(NamedTuple):
    case: Case
    provider: str
    ms: float
    max_err: float
    check: str

    def gb_s(self) -> float:
        return self.case.bytes / (self.ms * 1e-3) / 1e9


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "flash_combine.csv")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="two tiny cases on CPU through Triton's interpreter")
    return parser.parse_args(argv)


def run_case(case: Case, device: torch.device, seed: int, warmup: int, reps: int) -> list[Result]:
    """Both providers on one case, timed in turns, each checked against the float64 reference of batch 0."""
    out_partial, lse_partial = make_partials(case, device, seed)
    ref, _ = combine_reference(out_partial[:, :1], lse_partial[:, :1])
    calls = [lazytriton_call(out_partial, lse_partial), torch_call(out_partial, lse_partial)]
    errors = [float((call()[:1].double() - ref).abs().max()) for call in calls]
    times = interleaved_ms(calls, device.type == "cuda", warmup=warmup, reps=reps)
    return [Result(case, provider, ms, err, "ok" if err <= TOLERANCE else "wrong")
            for provider, ms, err in zip(PROVIDERS, times, errors, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid; exit status 1 if a lazytriton row failed its check, 2 without a GPU."""
    args = parse_args(argv)
    quick = args.quick
    case_list = QUICK_CASES if quick else CASES
    if args.list:
        for case in case_list:
            print(f"{case.label}  {case.bytes / 1e9:.4f} GB per call")
        return 0
    device = torch.device("cpu" if quick else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_flash_combine needs a CUDA GPU (or --quick, --list)", file=sys.stderr)
        return 2
    warmup, reps = (0, 1) if quick else (args.warmup, args.reps)
    meta = run_meta("flash_combine", device)
    peak = memory_peak_gb_s(meta["gpu"])
    lines = [f"bench_flash_combine on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}, "
             f"peak {'unknown' if peak is None else f'{peak:.0f} GB/s'}"]
    print(lines[0])
    results: list[Result] = []
    for index, case in enumerate(case_list):
        found = run_case(case, device, 100 + index, warmup, reps)
        mine, theirs = found
        line = (f"{case.label}  lazytriton {mine.ms:8.4f} ms {mine.gb_s():6.0f} GB/s {mine.check:<5}  torch "
                f"{theirs.ms:8.4f} ms {theirs.gb_s():6.0f} GB/s {theirs.check:<5}  x{theirs.ms / mine.ms:.2f}")
        print(line)
        lines.append(line)
        results.extend(found)
    append_rows(args.csv, FIELDS, ({**meta, "provider": r.provider, "case": r.case.name, "batch": r.case.batch,
                                     "seqlen": r.case.seqlen, "heads": r.case.heads, "head_dim": r.case.head_dim,
                                     "splits": r.case.splits, "p50_ms": f"{r.ms:.5f}", "gb_s": f"{r.gb_s():.1f}",
                                     "bw_frac": "" if peak is None else f"{r.gb_s() / peak:.3f}",
                                     "max_err": f"{r.max_err:.2e}",
                                     "check": r.check} for r in results))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_flash_combine.log").write_text("\n".join(lines) + "\n")
    return 1 if any(r.provider == "lazytriton" and r.check != "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
