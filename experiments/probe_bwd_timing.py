"""Probe: what a backward row of the grid holds, timed four ways for lazytriton and cuDNN.

For bench_flash_bwd.py's shapes (batch x seqlen = 16k, hidden 2048), each
provider's backward (lazytriton's ``bwd.backward``; SDPA's cuDNN backend
through ``torch.autograd.grad``) is timed

- ``idle``: one call between a pair of CUDA events, the device idle before
  it (how the grids timed every row until 12-02), so the host's time to the
  call's first launch is in the pair;
- ``lead``: one call between a pair of events, the device spinning before
  the start event while the host enqueues the call (``event_ms``, as the
  grids time rows since);
- ``turns``: the same, the two providers in turns (``interleaved_ms``, as
  the grids time them);
- ``queued``: ``--burst`` calls back to back between one pair of events,
  divided: the device's time a call while the host keeps ahead of it;
- ``host``: the host's wall time a call, from a synchronized start to the
  call's return (launches queued, nothing waited for).

``--profile``: then each provider's calls again under torch.profiler, its
kernels' device time a call (CUPTI's), so a row's time splits by kernel.

Usage: python experiments/probe_bwd_timing.py [--cases fp16:224:causal:1024,...] [--reps 20] [--burst 20]
       [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the benchmarks' helpers
import bench_flash_bwd  # noqa: E402
from benchgrid import DTYPES, cases  # noqa: E402

from lazytriton.cli.timing import event_ms, interleaved_ms, one_event_ms  # noqa: E402

DEFAULT_CASES = "fp16:224:causal:1024,bf16:224:causal:1024,bf16:128:full:1024,fp16:192:causal:1024,bf16:96:full:4096"


def queued_ms(fn: Callable[[], object], burst: int) -> float:
    """The device's time a call with ``burst`` calls queued back to back between one pair of events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(burst):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / burst


def host_us(fn: Callable[[], object], reps: int) -> float:
    """Median host wall time of one call from a synchronized start, in µs."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernel_us(fn: Callable[[], object], calls: int) -> list[tuple[str, float]]:
    """(kernel name, device µs a call) of ``calls`` calls of ``fn`` under torch.profiler, longest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / calls
    return sorted(totals.items(), key=lambda item: -item[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="dtype:head_dim:causal|full:seqlen, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="also each provider's kernels' device time a call")
    args = parser.parse_args(argv)
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    providers = {"lazytriton": bench_flash_bwd.lazytriton_bwd, "cudnn": bench_flash_bwd.sdpa_bwd("sdpa_cudnn")}
    rows = []
    for text in args.cases.split(","):
        dtype, d, mode, s = text.split(":")
        case = cases([dtype], [int(d)], [mode == "causal"], [int(s)])[0]
        shape = (case.batch, case.heads, case.seqlen, case.head_dim)
        tensors = tuple(torch.randn(shape, device="cuda", dtype=DTYPES[dtype]) for _ in range(4))
        fns = {name: make(tensors, case.causal) for name, make in providers.items()}
        for fn in fns.values():
            fn()
        turns = dict(zip(fns, interleaved_ms(list(fns.values()), True, 3, args.reps), strict=True))
        for name, fn in fns.items():
            idle = statistics.median(one_event_ms(fn, lead=False) for _ in range(args.reps))
            lead = event_ms(fn, reps=args.reps)
            rows.append((case.label, name, idle, lead, turns[name], queued_ms(fn, args.burst), host_us(fn, args.reps)))
            print(f"{rows[-1][0]} {name:10s} idle {idle:.3f}  lead {lead:.3f}  turns {turns[name]:.3f}  queued "
                  f"{rows[-1][5]:.3f} ms  host {rows[-1][6]:.0f} us", flush=True)
            if args.profile:
                for kernel, us in kernel_us(fn, args.reps):
                    print(f"    {us:9.1f} us  {kernel[:110]}", flush=True)
        del fns, tensors
        torch.cuda.empty_cache()
    print(f"\n{'case':24s} {'provider':10s} {'idle ms':>8s} {'lead':>7s} {'turns':>7s} {'queued':>7s} {'host us':>8s}")
    for label, name, idle, lead, turns_ms, queued, host in rows:
        print(f"{label:24s} {name:10s} {idle:8.3f} {lead:7.3f} {turns_ms:7.3f} {queued:7.3f} {host:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
