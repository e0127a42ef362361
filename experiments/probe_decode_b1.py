"""Where a batch-1 decoding call's time goes on the GPU: kernels, their device time, and the call under a CUDA graph.

bench_decode.py's contiguous case (bf16, head dim 128, 32 query / 8 key-value heads, one query, ``--lengths``
keys, batch ``--batch``): ``flash_attn_with_kvcache`` inside ``trusted_indices()`` and SDPA on the same keys.
For each: the kernels one call launches and their device µs (torch.profiler, CUDA activity, ``--calls`` calls),
the event-timed µs of a call back to back (as the bench times it), and of the same call replayed from a CUDA
graph (no host work: what the device alone takes). Prints a table.

Usage: python3 experiments/probe_decode_b1.py [--batch 1] [--lengths 4096,16384] [--calls 50] [--splits 0,8,64]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import lazytriton
from lazytriton.kernels.trust import trusted_indices


def event_us(fn, calls: int) -> float:
    """Median over 5 rounds of the µs a call, ``calls`` calls back to back between two events."""
    rounds = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(rounds)


def graphed(fn, calls: int):
    """``fn`` ``calls`` times captured in one CUDA graph; its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def kernels(fn, calls: int) -> list[tuple[str, int, float]]:
    """(kernel name, launches a call, device µs a call) of ``calls`` calls, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if total > 0 and e.count >= calls:
            rows.append((e.key[:60], e.count // calls, total / calls))
    return sorted(rows, key=lambda r: -r[2])


def calls(batch: int, length: int, splits: int = 0):
    """(lazytriton's call, SDPA's call) on the same random keys: bf16, head dim 128, 32/8 heads, one query.

    ``splits``: lazytriton's ``num_splits`` (0: its heuristic's)."""
    hq, hk, d = 32, 8, 128
    torch.manual_seed(length)
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, length, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    ks, vs, qs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), q.transpose(1, 2)

    def lt() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    return lt, sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--splits", default="0", help="lazytriton's num_splits values, a row each (0: the heuristic)")
    args = parser.parse_args()
    table = []
    for length in (int(x) for x in args.lengths.split(",")):
        for splits in (int(x) for x in args.splits.split(",")):
            lt, sdpa = calls(args.batch, length, splits)
            ref = sdpa().transpose(1, 2).float()
            err = float((lt().float() - ref).abs().max())
            providers = [(f"lt/{splits or 'auto'}", lt)] + ([("sdpa", sdpa)] if splits == int(args.splits.split(",")[0])
                                                            else [])
            for name, fn in providers:
                for _ in range(5):
                    fn()
                eager = event_us(fn, args.calls)
                replay = graphed(fn, args.calls)
                graph = event_us(replay, 1) / args.calls
                found = kernels(fn, args.calls)
                table.append((length, name, eager, graph, found, err if name != "sdpa" else 0.0))
    print(f"\nbatch {args.batch}, bf16, head dim 128, 32/8 heads: µs a call")
    print(f"{'keys':>6} {'provider':<11}{'eager':>8}{'graph':>8}  kernels (launches a call, device µs a call)")
    for length, name, eager, graph, found, err in table:
        names = "; ".join(f"{k} x{n} {us:.1f}" for k, n, us in found[:5])
        print(f"{length:>6} {name:<11}{eager:>8.1f}{graph:>8.1f}  {names}" + (f"  (max err {err:.1e})" if err else ""))


if __name__ == "__main__":
    main()
