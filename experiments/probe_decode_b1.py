"""Where a batch-1 decoding call's time goes on the GPU: kernels, their device time, and the call under a CUDA graph.

bench_decode.py's contiguous case (bf16, head dim 128, 32 query / 8 key-value heads, one query, ``--lengths``
keys, batch ``--batch``): ``flash_attn_with_kvcache`` inside ``trusted_indices()`` and SDPA on the same keys.
For each: the kernels one call launches and their device µs (torch.profiler, CUDA activity, ``--calls`` calls),
the event-timed µs of a call back to back (as the bench times it), and of the same call replayed from a CUDA
graph (no host work: what the device alone takes). Prints a table.

``--fused`` adds lazytriton's call with the combine fused into the split kernel (``lt+fused``: one launch where the
call has several splits; ``flash_decode.dispatch.fusing_combine``), timed beside the two-kernel call, and a summary
of both calls' graph-replay µs (a captured fused call zeroes its own counters: one small fill node a call) and
their ratio. ``--batch`` takes several batches (``1,8``). ``--int-lengths`` adds lazytriton's call with
``cache_seqlens`` as a Python int (``lt-int``: the split kernel gets the length as an argument, so no program
waits on a length load before its first key tile's addresses are known).

Usage: python3 experiments/probe_decode_b1.py [--batch 1] [--lengths 4096,16384] [--calls 50] [--splits 0,8,64]
       [--int-lengths]
       python3 experiments/probe_decode_b1.py --fused --batch 1,8 --lengths 1024,4096,16384,32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import lazytriton
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.trust import trusted_indices


def event_us(fn, calls: int, spin: int = 0) -> float:
    """Median over 5 rounds of the µs a call, ``calls`` calls back to back between two events.

    ``spin``: cycles of a spin kernel before the first event, so the host enqueues every call before the device
    reaches them (the device's time alone).
    """
    rounds = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if spin:
            torch.cuda._sleep(spin)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(rounds)


def modes_in_processes(script: str, modes: tuple[str, ...], argv: list[str], scratch: Path) -> dict[str, dict]:
    """Each of ``modes`` run as ``script --mode MODE --scratch DIR argv...`` in a fresh process of its own, with its
    own cache dir (a mode's kernels compiled there), in order; each mode's rows, the JSON its last line prints."""
    found = {}
    for mode in modes:
        env = {**os.environ, "LAZYTRITON_CACHE_DIR": str(scratch / f"cache-{mode}")}
        done = subprocess.run([sys.executable, script, "--mode", mode, "--scratch", str(scratch), *argv],
                              capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"the {mode} process failed:\n{done.stderr[-3000:]}")
        found[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def compare_modes(script: str, doc: str, modes: tuple[str, ...], batches: str, lengths: str,
                  case: Callable[..., dict[str, float]], set_up: Callable[[str], None]) -> dict[str, dict] | None:
    """A probe that times ``case`` in each of ``modes``, each in a process of its own (``modes_in_processes``).

    Its command line: ``--batches``, ``--lengths``, ``--calls``. In a mode's process (``--mode``): ``set_up(mode)``,
    then ``case(batch, length, calls, scratch, mode)`` for each batch and length, printed as one JSON line keyed
    "batch,length"; None is returned. Otherwise every mode's rows, by mode.
    """
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--batches", default=batches)
    p.add_argument("--lengths", default=lengths)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--mode", choices=modes, help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.mode:
        return modes_in_processes(script, modes, ["--batches", args.batches, "--lengths", args.lengths, "--calls",
                                                  str(args.calls)], Path(tempfile.mkdtemp()))
    set_up(args.mode)
    rows = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            rows[f"{batch},{length}"] = case(batch, length, args.calls, Path(args.scratch), args.mode)
    print(json.dumps(rows))
    return None


def behind_spin_us(fn, calls: int) -> float:
    """Median over 5 rounds of the µs a call, ``calls`` calls enqueued behind a spin (the device never waits)."""
    return event_us(fn, calls, spin=40_000_000)  # ~20 ms: longer than the host takes to enqueue the calls


def graph_us(fn, calls: int) -> float:
    """The µs a call, ``calls`` calls captured in one CUDA graph and replayed behind a spin."""
    return behind_spin_us(graphed(fn, calls), 1) / calls


def decode_case(batch: int, length: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bench_decode.py's contiguous case, fresh random values seeded by the shape: (its generator, q, k_cache,
    v_cache)."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100_003 + length)
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                        for _ in range(2))
    return gen, q, k_cache, v_cache


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


def calls(batch: int, length: int, splits: int = 0, int_lengths: bool = False):
    """(lazytriton's call, SDPA's call, lazytriton's fused call) on the same random keys: bf16, head dim 128, 32/8
    heads, one query; ``int_lengths``: lazytriton's calls take the length as an int, not a tensor.

    ``splits``: lazytriton's ``num_splits`` (0: its heuristic's)."""
    hq, hk, d = 32, 8, 128
    torch.manual_seed(length)
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, length, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = length if int_lengths else torch.full((batch,), length, dtype=torch.int32, device="cuda")
    ks, vs, qs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), q.transpose(1, 2)

    def lt() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    def fused() -> torch.Tensor:
        # fusing_combine's switch, set without its context manager (whose ~1 µs the eager timing would count)
        saved, decode_dispatch.FUSED_COMBINE_BY_DEFAULT = decode_dispatch.FUSED_COMBINE_BY_DEFAULT, True
        try:
            return lt()
        finally:
            decode_dispatch.FUSED_COMBINE_BY_DEFAULT = saved

    return lt, sdpa, fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1", help="batches, a table each (1,8)")
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--splits", default="0", help="lazytriton's num_splits values, a row each (0: the heuristic)")
    parser.add_argument("--fused", action="store_true", help="also lazytriton's call with the combine fused (lt+fused)")
    parser.add_argument("--int-lengths", action="store_true", help="also lazytriton's call with an int cache_seqlens")
    args = parser.parse_args()
    for batch in (int(x) for x in args.batch.split(",")):
        probe(batch, args)


def probe(batch: int, args: argparse.Namespace) -> None:
    """One batch's table (and with --fused the graph-replay summary of the fused call against the two kernels)."""
    table = []
    for length in (int(x) for x in args.lengths.split(",")):
        for splits in (int(x) for x in args.splits.split(",")):
            lt, sdpa, fused = calls(batch, length, splits)
            ref = sdpa().transpose(1, 2).float()
            errs = {"lt": float((lt().float() - ref).abs().max()), "fused": float((fused().float() - ref).abs().max())}
            label = splits or "auto"
            providers = [(f"lt/{label}", lt, errs["lt"])] + ([(f"lt+fused/{label}", fused, errs["fused"])]
                                                              if args.fused else [])
            if args.int_lengths:
                lt_int = calls(batch, length, splits, int_lengths=True)[0]
                providers.append((f"lt-int/{label}", lt_int, float((lt_int().float() - ref).abs().max())))
            if splits == int(args.splits.split(",")[0]):
                providers.append(("sdpa", sdpa, 0.0))
            for name, fn, err in providers:
                for _ in range(5):
                    fn()
                eager = event_us(fn, args.calls)
                replay = graphed(fn, args.calls)
                graph = event_us(replay, 1) / args.calls
                found = kernels(fn, args.calls)
                table.append((length, name, eager, graph, found, err))
    print(f"\nbatch {batch}, bf16, head dim 128, 32/8 heads: µs a call")
    print(f"{'keys':>6} {'provider':<16}{'eager':>8}{'graph':>8}  kernels (launches a call, device µs a call)")
    for length, name, eager, graph, found, err in table:
        names = "; ".join(f"{k} x{n} {us:.1f}" for k, n, us in found[:5])
        print(f"{length:>6} {name:<16}{eager:>8.1f}{graph:>8.1f}  {names}" + (f"  (max err {err:.1e})" if err else ""))
    if args.fused:
        rows = {(length, name): (eager, graph) for length, name, eager, graph, _, _ in table}
        print(f"\nbatch {batch}: fused over two kernels (µs: two kernels -> fused, ratio two / fused)")
        for length, name, eager, graph, _, _ in table:
            if name.startswith("lt+fused/"):
                eager2, graph2 = rows[length, name.replace("lt+fused/", "lt/")]
                print(f"{length:>6} {name[9:]:<6} graph {graph2:7.1f} -> {graph:7.1f} ({graph2 / graph:.2f}x)   "
                      f"eager {eager2:7.1f} -> {eager:7.1f} ({eager2 / eager:.2f}x)")


if __name__ == "__main__":
    main()
