"""Probe: the fused backward kernel's cost a step and a program, alone (no prep, no cast), by seqlen_q.

At a fixed grid (bench_flash_bwd.py's 1k shape: batch 16, hidden 2048, seqlen_k 1024, so the same programs), a
non-causal call whose seqlen_q is 128 ... 2048 gives each program seqlen_q / BLOCK_M steps. The kernel's time
against steps is then a line: its slope is a step's cost in a wave of programs, its intercept what a program
pays besides its steps (K/V's load, the descriptors, the ring's fill and drain, dK/dV's store). The causal 1k
and 4k calls are then set against what that line predicts for their steps (every program's steps, the programs
in waves of one a SM), so what causality costs beyond its steps shows. Also: the prep kernel and dQ's cast at
1k alone (memory-bound, as GB/s).

``--trace NAME=FILE`` (repeatable): a copy of fused_kernel.py (``make_trace_kernel.py`` writes it) whose
kernel takes a ``Trace`` pointer after ``sm_scale`` and writes %globaltimer stamps into 16 int64 a program (0 the
program's start, 1 its partitions' start, 2 K and V in, 3 the first Q tile in, 4 the steps done, 8 the last dQ
reduction out of shared memory, 5 dK and dV stored, 6 the producer's descriptors made, 7 the SM): where a program's
time goes, by phase, and the gap between one program's end and the next one's start on an SM. ``--variant
NAME=FILE`` (repeatable): a copy with the served kernel's signature, timed beside it at 1k and 4k.

Usage: python experiments/probe_fused_steps.py [--head-dims 256,128] [--reps 20] [--trace NAME=FILE]
       [--variant NAME=FILE] [--no-fit]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch

from lazytriton.cli.timing import event_ms
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_bwd import fused, fused_kernel

SEQLENS_Q = (128, 256, 512, 1024, 2048)


def _launch(d, b, h, sq, sk, causal, kernel=None, trace=None):
    """A closure launching the fused kernel alone on random inputs (lse and delta finite), and its grid.

    ``kernel``/``trace``: a tracing copy's kernel and its int64 buffer (passed after sm_scale)."""
    kernel = kernel or fused_kernel.flash_bwd_fused_gluon_kernel
    extra = () if trace is None else (trace,)
    dt = torch.bfloat16
    block_m, prefetch, _ = bwd_dispatch.BWD_FUSED_TABLE[("bf16", d, causal)]
    q, do = (torch.randn(b, h, sq, d, device="cuda", dtype=dt) for _ in range(2))
    k, v = (torch.randn(b, h, sk, d, device="cuda", dtype=dt) for _ in range(2))
    lse = 4.0 + torch.rand(b, h, sq, device="cuda")
    delta = torch.randn(b, h, sq, device="cuda") * 0.1
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dqa = torch.zeros((b, h, sq, fused.tile(d)), dtype=torch.float32, device="cuda")
    grid = fused.grids(b, h, h, sq, sk, d)[1]
    block_d, block_d2 = fused.chunks(d)

    def run():
        kernel[grid](
            q, k, v, do, lse, delta, dk, dv, dqa, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2], 1, h, sq, sk, d, sk - sq,
            d ** -0.5, *extra, BLOCK_M=block_m, BLOCK_D=block_d, CAUSAL=causal, PREFETCH=prefetch, BLOCK_D2=block_d2,
            num_warps=4)
    return run, grid, block_m


def _steps(sq, sk, block_m, keys, causal):
    """Each program's steps (query blocks), as query_steps counts them (offset sk - sq)."""
    n_m = sq // block_m
    if not causal:
        return [n_m] * (sk // keys)
    return [n_m - max(start - (sk - sq), 0) // block_m for start in range(0, sk, keys)]


def run_head_dim(d, reps, sms, log):
    b, h, sk = 16, 2048 // d, 1024
    keys = fused.block_n(d)
    xs, ys = [], []
    for sq in SEQLENS_Q:
        run, grid, block_m = _launch(d, b, h, sq, sk, False)
        ms = event_ms(run, reps=reps)
        programs = grid[0] * grid[1] * grid[2]
        waves = programs / sms
        steps = sq // block_m
        xs.append(steps)
        ys.append(ms * 1e3 / waves)  # µs a program-slot
        log(f"hd{d} full sq {sq:5d} sk {sk}: {ms:.3f} ms, {programs} programs, {steps} steps each, "
            f"{ys[-1]:.1f} µs a program in a wave")
        del run
    slope, intercept = statistics.linear_regression(xs, ys)
    log(f"hd{d}: a step {slope:.2f} µs, a program's own {intercept:.1f} µs (fit over {len(xs)} seqlens)")
    rows = [(d, "fit", slope, intercept)]
    for s in (1024, 4096):
        bb = max(1, 16384 // s)
        for causal in (False, True):
            run, grid, block_m = _launch(d, bb, h, s, s, causal)
            ms = event_ms(run, reps=reps)
            per_bh = _steps(s, s, block_m, keys, causal)
            pairs = grid[1] * grid[2]
            # LPT-ish: the programs' work spread over the SMs
            work = sum(intercept + slope * n for n in per_bh) * pairs / sms
            log(f"hd{d} {'causal' if causal else 'full  '} {s}: kernel {ms:.3f} ms, the line predicts "
                f"{work / 1e3:.3f} ms ({ms * 1e3 / work:.2f}x); steps a program {min(per_bh)}-{max(per_bh)}")
            rows.append((d, f"{'causal' if causal else 'full'} {s}", ms, work / 1e3))
            del run
    return rows


def parts(d, reps, log):
    """flash_bwd_prep and the cast at bench 1k (memory-bound)."""
    b, h, s = 16, 2048 // d, 1024
    out, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    width = fused.tile(d)
    dqa = torch.empty((b, h, s, width), dtype=torch.float32, device="cuda")
    delta = torch.empty((b, h, s), dtype=torch.float32, device="cuda")
    dq = torch.empty_like(out)
    grid = fused.grids(b, h, h, s, s, d)[0]

    def prep():
        fused_kernel.flash_bwd_prep_kernel[grid](out, do, delta, dqa, *out.stride()[:3], *do.stride()[:3],
                                                 *delta.stride()[:2], h, s, d, BLOCK_M=fused.PREP_BLOCK_M,
                                                 BLOCK_D=width, num_warps=4)
    n = b * h * s
    ms = event_ms(prep, reps=reps)
    log(f"hd{d} 1k prep: {ms:.3f} ms ({n * (4 * d + 4 * width) / ms / 1e6:.0f} GB/s)")
    cast_ms = event_ms(lambda: dq.copy_(dqa[..., :d]), reps=reps)
    log(f"hd{d} 1k cast: {cast_ms:.3f} ms ({n * d * 6 / cast_ms / 1e6:.0f} GB/s)")
    return ms, cast_ms


PHASES = (("prologue", 0, 1), ("K/V in", 0, 2), ("producer descs", 0, 6), ("first Q in", 0, 3),
          ("steps", 3, 4), ("dQ drain", 4, 8), ("dK/dV stores", 8, 5), ("program", 0, 5))


def load_kernel(path):
    """flash_bwd_fused_gluon_kernel of a copy of fused_kernel.py at ``path``."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"probe_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flash_bwd_fused_gluon_kernel


def trace_case(name, path, d, s, causal, sms, log):
    """One traced launch of the copy at ``path``: medians of each phase (µs), SM time by phase, the SMs' gaps."""
    b, h = max(1, 16384 // s), 2048 // d
    grid = fused.grids(b, h, h, s, s, d)[1]
    programs = grid[0] * grid[1] * grid[2]
    trace = torch.zeros((programs, 16), dtype=torch.int64, device="cuda")
    run, _, _ = _launch(d, b, h, s, s, causal, load_kernel(path), trace)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    t = trace.cpu().tolist()
    label = f"{name} hd{d} {'causal' if causal else 'full'} {s}"
    cells = []
    for name, a, z in PHASES:
        us = statistics.median((row[z] - row[a]) / 1e3 for row in t)
        cells.append(f"{name} {us:.1f}")
    span = (max(row[5] for row in t) - min(row[0] for row in t)) / 1e3
    by_sm: dict[int, list] = {}
    for row in t:
        by_sm.setdefault(row[7], []).append(row)
    gaps, busy, steps = [], 0.0, 0.0
    for rows in by_sm.values():
        rows.sort(key=lambda r: r[0])
        gaps += [(nxt[0] - cur[5]) / 1e3 for cur, nxt in itertools.pairwise(rows)]
        busy += sum((r[5] - r[0]) / 1e3 for r in rows)
        steps += sum((r[4] - r[3]) / 1e3 for r in rows)
    log(f"{label}: {programs} programs on {len(by_sm)} SMs, span {span:.0f} µs; medians (µs): " + ", ".join(cells)
        + f"; gap end -> next start on an SM {statistics.median(gaps):.1f} (mean {statistics.fmean(gaps):.1f})"
        + f"; SM time in programs {busy / (span * sms):.0%}, in steps {steps / (span * sms):.0%}")
    return label, cells, statistics.median(gaps), busy / (span * sms), steps / (span * sms)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="256,128")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--trace", action="append", default=[], help="NAME=FILE: a tracing copy (see above)")
    parser.add_argument("--variant", action="append", default=[], help="NAME=FILE: a copy timed beside the kernel")
    parser.add_argument("--no-fit", action="store_true", help="skip the seqlen_q line and the prep/cast parts")
    args = parser.parse_args(argv)
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    log = lambda m: print(m, flush=True)  # noqa: E731
    table = []
    traced = []
    head_dims = [int(x) for x in args.head_dims.split(",")]
    variants = [("served", None)] + [(v.split("=", 1)[0], load_kernel(v.split("=", 1)[1])) for v in args.variant]
    if args.variant:
        timed = []
        for d in head_dims:
            for s in (1024, 4096):
                for causal in (False, True):
                    row = []
                    for _name, kernel in variants:
                        run, _, _ = _launch(d, max(1, 16384 // s), 2048 // d, s, s, causal, kernel)
                        row.append(event_ms(run, reps=args.reps))
                        del run
                    label = f"hd{d} {'causal' if causal else 'full'} {s}"
                    log(f"{label}: " + ", ".join(f"{n} {ms:.3f} ms" for (n, _), ms in zip(variants, row, strict=True)))
                    timed.append((label, row))
        print("\ncase | " + " | ".join(n for n, _ in variants) + " (kernel alone, ms; ratio to served)")
        for label, row in timed:
            print(f"{label} | " + " | ".join(f"{ms:.3f} ({row[0] / ms:.2f}x)" for ms in row))
    for item in args.trace:
        name, path = item.split("=", 1)
        for d in head_dims:
            for s in (1024, 4096):
                for causal in (False, True):
                    traced.append(trace_case(name, path, d, s, causal, sms, log))
        print("\ncase | medians (µs) | gap | SM time in programs | in steps")
        for label, cells, gap, busy, steps in traced:
            print(f"{label} | {', '.join(cells)} | {gap:.1f} | {busy:.0%} | {steps:.0%}")
    if args.no_fit:
        return 0
    for d in head_dims:
        table += run_head_dim(d, args.reps, sms, log)
        prep_ms, cast_ms = parts(d, args.reps, log)
        table.append((d, "prep / cast 1k", prep_ms, cast_ms))
    print("\nhead dim | case | measured | line (µs a step and a program for 'fit'; ms otherwise)")
    for d, case, a, b in table:
        print(f"{d:8d} | {case:14s} | {a:8.3f} | {b:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
