"""Probe: the TMA and pointer variants of flash_fwd, same config, timed through lazytriton's own launcher.

For bf16/fp16 x head dim 64/128 x causal or not x seqlen 4k/16k (batch x
seqlen = 16k, hidden 2048: bench_flash_fwd.py's shapes), each variant is
forced through ``binding.launch_gpu(..., variant)``, exactly as a call
launches it (cache entry, cffi launch, global scratch from ``scratch_alloc``),
checked against SDPA, then timed (median of CUDA-event-timed runs). The config
is dispatch's for the shape; ``--sweep`` also times a few configs that FACTS.md
found best for a host-descriptor TMA forward on the H200 (BLOCK_M 128, BLOCK_N
64/128, 4 warps, 2-3 stages). Prints one table; ``--csv`` appends long-format
rows (provider ``lazytriton_ptr`` / ``lazytriton_tma``).

Usage: python experiments/probe_tma.py [--quick] [--sweep] [--csv PATH]
Needs an sm_90 GPU: TMA variants are built for sm_90 only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the benchmarks' helpers
from bench_flash_fwd import FIELDS, rel_err, time_ms  # noqa: E402
from csvlog import append_rows  # noqa: E402

import lazytriton  # noqa: E402
from lazytriton import (
    machine,
    runtime,  # noqa: E402
)
from lazytriton.kernels.flash_fwd import binding  # noqa: E402
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm.limits import refusal  # noqa: E402
from lazytriton.tiles import Config
from lazytriton.variant import Variant  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# FACTS.md: best host-descriptor TMA configs on the H200 (Triton 3.6): 128/64 at head dim 128, 128/128 at 64,
# 4 warps, 2-3 stages.
SWEEP = (Config(128, 64, 4, 2), Config(128, 64, 4, 3), Config(128, 128, 4, 2),
         Config(128, 128, 4, 3), Config(128, 64, 8, 3))


def variants(target: object, dtype: str, d: int, causal: bool, s: int, sweep: bool) -> list[tuple[Variant, Variant]]:
    """(pointer, TMA) pairs of one shape: dispatch's config, then the sweep's (those prewarm would not refuse)."""
    configs: list[Config | None] = [None, *(SWEEP if sweep else ())]
    pairs = []
    for config in configs:
        ptr, tma = (fwd_dispatch.flash_fwd_variant(target, dtype, d, causal, True, s, config=config, seqlen_k=s,  # type: ignore[arg-type]
                                                   tma=flag) for flag in (False, True))
        if config is not None and (refusal(ptr) or refusal(tma) or ptr.tuned == pairs[0][0].tuned
                                   and ptr.options == pairs[0][0].options):
            continue
        pairs.append((ptr, tma))
    return pairs


def time_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, variant: Variant,
                 ref: torch.Tensor) -> tuple[float, float, int]:
    """(ms, relative error against SDPA, shared bytes) of one variant; ms is NaN when its output is wrong."""
    call = binding.check(q, k, v, causal)
    out, lse = binding.empty_outputs(q, call.shape)

    def run() -> torch.Tensor:
        binding.launch_gpu(q, k, v, out, lse, call, variant)
        return out

    err = rel_err(run(), ref)
    ms = time_ms(run) if err < 2e-2 else math.nan
    return ms, err, runtime.get().kernel(variant, q.device.index).entry.shared


def config_name(variant: Variant) -> str:
    return "{}/{}/{}w/{}s".format(*(variant.get(n) for n in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seqlen 4k only")
    parser.add_argument("--sweep", action="store_true", help="also time a few TMA-friendly configs per shape")
    parser.add_argument("--csv", type=Path, help="append long-format rows to this CSV")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    target = machine.target_of_device(torch.device("cuda"))
    if str(target) != "sm_90":
        print(f"TMA variants are built for sm_90; this GPU is {target}", file=sys.stderr)
        return 2
    import triton

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "lazytriton": lazytriton.__version__, "timestamp": dt.datetime.now(dt.timezone.utc).isoformat()}
    header = (f"{'dtype':5} {'d':>4} {'causal':6} {'seqlen':>6} {'config':14} {'ptr TF/s':>9} {'tma TF/s':>9} "
              f"{'tma/ptr':>7} {'smem ptr/tma KiB':>17} {'err ptr/tma':>17}")
    print(header)
    print("-" * len(header))
    rows: list[dict[str, object]] = []
    ratios = []
    for dtype, torch_dtype in DTYPES.items():
        for d in (64, 128):
            for causal in (False, True):
                for s in (4096,) if args.quick else (4096, 16384):
                    b, h = 16384 // s, 2048 // d
                    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch_dtype) for _ in range(3))
                    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    flops = 4 * b * h * s * s * d / (2 if causal else 1)
                    for ptr, tma in variants(target, dtype, d, causal, s, args.sweep):
                        try:
                            (ms_p, err_p, sh_p), (ms_t, err_t, sh_t) = (time_variant(q, k, v, causal, x, ref)
                                                                        for x in (ptr, tma))
                        except Exception as exc:  # a config that does not fit or compile is reported, not fatal
                            print(f"{dtype:5} {d:>4} {causal!s:6} {s:>6} {config_name(ptr):14} "
                                  f"{type(exc).__name__}: {str(exc)[:100]}", flush=True)
                            continue
                        tf_p, tf_t = flops / ms_p / 1e9, flops / ms_t / 1e9
                        ratios.append(tf_t / tf_p)
                        print(f"{dtype:5} {d:>4} {causal!s:6} {s:>6} {config_name(ptr):14} {tf_p:9.1f} {tf_t:9.1f} "
                              f"{tf_t / tf_p:6.2f}x {sh_p / 1024:8.0f}/{sh_t / 1024:<8.0f} "
                              f"{err_p:8.1e}/{err_t:<8.1e}", flush=True)
                        for provider, ms, err in (("lazytriton_ptr", ms_p, err_p), ("lazytriton_tma", ms_t, err_t)):
                            rows.append({"kernel": f"flash_fwd[{config_name(ptr)}]", "provider": provider,
                                         "mode": "fwd", "dtype": dtype, "head_dim": d, "causal": causal, "batch": b,
                                         "heads": h, "seqlen": s, "p50_ms": ms, "tflops": flops / ms / 1e9,
                                         "us_per_call": "", "rel_err": err, **meta})
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    if finite:
        print(f"geomean tma/ptr over {len(finite)} rows: {math.exp(sum(map(math.log, finite)) / len(finite)):.3f}x")
    if args.csv:
        append_rows(args.csv, FIELDS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
