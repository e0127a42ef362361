"""Prewarm's parallel scaling: one plan built at -j 1 and at -j N in one run, and the speedup per core.

The plan is fixed: ``--count`` variants (default 96) spread evenly over the
default sm_90 plan's fp16 and bf16 variants (every kernel: forward, dq,
dK/dV; head dims 16-256; causal or not; the three seqlen classes). fp32 is
left out by default (``--dtypes`` puts it back): a few fp32 variants compile
for 30-80 s each (``flash_bwd_dkdv`` at head dim 128, a 2 MB cubin), and a
plan that holds one ends when it does, whatever the pool does
(benchmarks/NOTES.md, "Prewarm scaling").

Each build is ``lazytriton.prewarm.build`` into its own fresh folder
(nothing reused), timed from the call to the image on disk: worker start-up,
every compile and the image write. (The ``lazytriton prewarm`` command adds
its interpreter start and the enumeration, about 0.3 s, to both.) The two
images must be byte-identical (SOURCE_DATE_EPOCH semantics: ``created`` is
fixed), else the run fails. Printed and appended to ``--csv`` (long format):
variants/s at each -j, the speedup and speedup / cores, how many cores N
CPU-bound processes get here, each build's time from its last compile to the
image on disk (the image is compressed while the build compiles: what is left
then, and how many entries were compressed by then), the sum of the compile
times at -j N over that at -j 1 (what sharing the machine costs a compile),
and the plan's own bound: the sum of the compile times at -j 1 over
max(longest compile, sum / N).

``--float8-targets sm_90,sm_80`` builds another plan at -j 1 and -j N: the
decoding kernels (split, combine, kv_append) for a bf16 cache and both float8
caches (e4m3 where the target has it), bf16, head dim 64, not causal,
contiguous and paged, for those targets: float8 variants of several CUDA
targets in one build. Where the installed Triton fixes a process's float8
lowering (3.6: ``lazytriton.float8_lowering``) the pool binds each worker to
one target's float8 variants; the workers' line says how many it replaced.

``--fork-ab R`` instead builds the plan at -j N only, R times with the
pool's fork server and R times without (``LAZYTRITON_PREWARM_FORK=0``),
alternating, and prints each build's wall time and its workers' first
answers (from the build's start: worker start-up, imports, first compile).

Usage: python benchmarks/bench_prewarm_scaling.py [--jobs N] [--count 96] [--dtypes fp16,bf16] [--csv PATH]
       python benchmarks/bench_prewarm_scaling.py --float8-targets sm_90,sm_80 [--jobs N] [--csv PATH]
       python benchmarks/bench_prewarm_scaling.py --fork-ab 3 [--jobs N] [--count 16] [--csv PATH]
       python benchmarks/bench_prewarm_scaling.py --quick [--csv PATH]   (CPU CI: 3 tiny variants, -j 1 and -j 2)
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench_prewarm import FIELDS, meta, parallel_capacity
from csvlog import append_rows

from lazytriton import tuning
from lazytriton.prewarm.builder import BuildReport, build
from lazytriton.prewarm.enumeration import Axes, Planned, all_kernels, enumerate_variants
from lazytriton.target import Target

EPOCH = 0.0  # every entry's provenance.created, as SOURCE_DATE_EPOCH=0 gives: both images hold the same bytes


def scaling_plan(count: int, dtypes: tuple[str, ...], target: str = "sm_90") -> list[Planned]:
    """``count`` variants spread evenly over the default plan's variants of ``dtypes`` (all of them if fewer), each
    kernel of the plan among them.

    The backward's aligned variants count once (SEQ16, the binaries of the
    ALIGN16 variants before the flags split), so the mix and the figures stay
    comparable with earlier runs.
    """
    pool = [p for p in enumerate_variants(Axes(targets=(Target.parse(target),)), tuning.tables_for(all_kernels()))
            if p.variant.dtype in dtypes and not (p.variant.kernel.startswith("flash_bwd")
                                                  and p.variant.constexprs.get("SEQ16") is not True)]
    if count >= len(pool):
        return pool
    picked = [pool[i * len(pool) // count] for i in range(count)]
    # every kernel of the pool at least once (a kernel of a few variants can fall between two picks): its first
    # variant takes the place of the last pick of the kernel picked most
    for kernel in dict.fromkeys(p.variant.kernel for p in pool):
        if all(p.variant.kernel != kernel for p in picked):
            counts = Counter(p.variant.kernel for p in picked)
            most = max(counts, key=lambda k: counts[k])
            at = max(i for i, p in enumerate(picked) if p.variant.kernel == most)
            picked[at] = next(p for p in pool if p.variant.kernel == kernel)
    return picked


def quick_plan() -> list[Planned]:
    """Three small forward variants (fp16, head dim 16, not causal, the three seqlen classes): a CI smoke run."""
    axes = Axes(targets=(Target.parse("sm_90"),), kernels=("flash_fwd",), dtypes=("fp16",), head_dims=(16,),
                causal=(False,))
    return enumerate_variants(axes, tuning.tables_for(("flash_fwd",)))


def float8_plan(targets: tuple[str, ...]) -> list[Planned]:
    """The decoding kernels for a bf16 cache and both float8 caches at head dim 64 (module docstring), ``targets``."""
    kernels = ("flash_decode_split", "flash_decode_combine", "kv_append")
    axes = Axes(targets=tuple(Target.parse(t) for t in targets), kernels=kernels, dtypes=("bf16",), head_dims=(64,),
                causal=(False,), kv_fp8=("none", "e4m3", "e5m2"))
    return enumerate_variants(axes, tuning.tables_for(kernels))


def timed_build(plan: list[Planned], jobs: int, folder: Path) -> tuple[float, BuildReport, bytes]:
    """Build ``plan`` at ``-j jobs`` into a fresh ``folder``: seconds, the report, the image's bytes."""
    out = folder / f"j{jobs}.ltimg"
    start = time.perf_counter()
    report = build(plan, out, jobs, created=EPOCH, stream=io.StringIO())
    seconds = time.perf_counter() - start
    if report.failures or report.compiled != len(plan):
        raise SystemExit(f"-j {jobs}: {report.compiled} of {len(plan)} compiled; failures: "
                         + "; ".join(f"{p.variant}: {e[:300]}" for p, e in report.failures))
    return seconds, report, out.read_bytes()


def plan_bound(times: dict[str, float], jobs: int) -> tuple[float, float, float]:
    """The sum and the longest of the compile times, and the speedup the plan allows at ``jobs`` workers."""
    total, longest = sum(times.values()), max(times.values(), default=0.0)
    return total, longest, total / max(longest, total / jobs) if total else 0.0


def first_answers(report: BuildReport) -> list[tuple[float, float]]:
    """Each worker's first answer, in seconds from the build's start, earliest first, with that variant's seconds
    as its worker measured them (a fresh interpreter's first compile includes its imports of Triton; a forked
    worker's does not)."""
    per_worker: dict[int, tuple[float, float]] = {}
    for key, (worker, _, ended) in report.spans.items():
        first = (ended - report.started, report.compile_times[key])
        per_worker[worker] = min(per_worker.get(worker, first), first)
    return sorted(per_worker.values())


def workers_line(report: BuildReport) -> str:
    started = report.workers
    if started is None:
        return "  workers: none started"
    server = "no fork server" if started.server_ready is None else \
        f"fork server ready {started.server_ready:.2f} s after compile_all began"
    rebound = f"; {started.rebound} of them replaced a worker bound to another target's float8 lowering" \
        if started.rebound else ""
    return f"  workers: {started.forked} forked, {started.plain} fresh interpreters{rebound}; {server}"


def fork_ab(plan: list[Planned], jobs: int, repeats: int) -> list[dict[str, Any]]:
    """Build ``plan`` at -j ``jobs`` with and without the fork server, alternating; print and return the rows."""
    walls: dict[str, list[float]] = {"fork server": [], "plain": []}
    firsts: dict[str, list[float]] = {"fork server": [], "plain": []}
    ready: dict[str, list[float]] = {"fork server": [], "plain": []}
    images = set()
    for r in range(repeats):
        for mode in (("fork server", "plain") if r % 2 == 0 else ("plain", "fork server")):
            os.environ["LAZYTRITON_PREWARM_FORK"] = "1" if mode == "fork server" else "0"
            with tempfile.TemporaryDirectory(prefix=f"bench-prewarm-fork-ab-{r}-") as tmp:
                seconds, report, image = timed_build(plan, jobs, Path(tmp))
            images.add(image)
            first = first_answers(report)
            walls[mode].append(seconds)
            firsts[mode].append(statistics.fmean(answer for answer, _ in first))
            ready[mode].append(statistics.fmean(took for _, took in first))
            print(f"{mode:>11}, run {r + 1}: {seconds:.2f} s; first answers "
                  + ", ".join(f"{answer:.2f} ({took:.2f} in the worker)" for answer, took in first) + " s",
                  flush=True)
            print(workers_line(report), flush=True)
    os.environ.pop("LAZYTRITON_PREWARM_FORK", None)
    if len(images) != 1:
        raise SystemExit("the images built with and without the fork server differ")
    rows = []
    for mode in walls:
        print(f"{mode:>11}: median {statistics.median(walls[mode]):.2f} s a build; workers' first answer (mean) "
              f"median {statistics.median(firsts[mode]):.2f} s, of which in the worker (mean) median "
              f"{statistics.median(ready[mode]):.2f} s ({repeats} builds at -j {jobs})")
        slug = mode.replace(" ", "_")
        rows += [{"metric": f"wall_{slug}", "value": round(statistics.median(walls[mode]), 3), "unit": "s",
                  "detail": f"-j {jobs}, median of {repeats} builds"},
                 {"metric": f"first_answer_{slug}", "value": round(statistics.median(firsts[mode]), 3), "unit": "s",
                  "detail": f"-j {jobs}, median of {repeats} builds of the workers' mean first answer"},
                 {"metric": f"first_variant_in_worker_{slug}", "value": round(statistics.median(ready[mode]), 3),
                  "unit": "s", "detail": f"-j {jobs}, median of {repeats} builds of the mean seconds the workers "
                                         "measured for their first variant (imports included in a fresh one)"}]
    print("images identical")
    return [{"provider": "prewarm", "mode": "fork_ab", "n": len(plan), **row} for row in rows]


def schedule_lines(report: BuildReport, plan: list[Planned], jobs: int, seconds: float) -> list[str]:
    """Where -j N's wall clock went, from the build's spans: the workers' first answers (start-up and a first
    compile), how busy the workers were, the idle time at the end, and the variants that finished last."""
    spans = report.spans
    if not spans:
        return []
    start = report.started
    end = max(ended for _, _, ended in spans.values())
    per_worker: dict[int, list[tuple[float, float]]] = {}
    for worker, began, ended in spans.values():
        per_worker.setdefault(worker, []).append((began, ended))
    first = sorted(min(ended for _, ended in got) - start for got in per_worker.values())
    busy = sum(ended - began for _, began, ended in spans.values()) / (len(per_worker) * (end - start))
    tail = sorted(end - max(ended for _, ended in got) for got in per_worker.values())
    last_handout = max(began for _, began, _ in spans.values()) - start
    variants = {p.key: p.variant for p in plan}
    lines = [f"  -j {jobs} schedule: {len(per_worker)} workers; first answers {first[0]:.2f}-{first[-1]:.2f} s after "
             f"the start; workers busy {busy:.1%} of the compile span ({end - start:.2f} s of {seconds:.2f}); last "
             f"variant handed out at {last_handout:.2f} s; idle at the end: median {statistics.median(tail):.2f} s, "
             f"mean {statistics.fmean(tail):.2f} s"]
    for key, (worker, began, ended) in sorted(spans.items(), key=lambda item: -item[1][2])[:3]:
        lines.append(f"    finished at {ended - start:.2f} s: worker {worker}, handed out at {began - start:.2f} s, "
                     f"{report.compile_times[key]:.2f} s compiling: {variants.get(key, key)}")
    return lines


def run(plan: list[Planned], jobs: int, capacity: float | None, detail: str) -> list[dict[str, Any]]:
    """Build at -j 1 and -j ``jobs``, check the images are identical, print and return the rows."""
    results = {}
    for j in (1, jobs):
        with tempfile.TemporaryDirectory(prefix=f"bench-prewarm-j{j}-") as tmp:
            results[j] = timed_build(plan, j, Path(tmp))
        seconds, report = results[j][0], results[j][1]
        print(f"-j {j:>2}: {len(plan)} variants in {seconds:.1f} s = {len(plan) / seconds:.2f} variants/s; after "
              f"the last compile {report.write_seconds:.2f} s to the image on disk ({report.compressed_early} of "
              f"{len(plan)} entries compressed by then)", flush=True)
        if j > 1:
            print("\n".join([*schedule_lines(report, plan, j, seconds), workers_line(report)]), flush=True)
    if results[1][2] != results[jobs][2]:
        raise SystemExit(f"the images built at -j 1 and -j {jobs} differ: a build's bytes must not depend on -j")
    speedup = results[1][0] / results[jobs][0]
    total, longest, bound = plan_bound(results[1][1].compile_times, jobs)
    shared = sum(results[jobs][1].compile_times.values()) / total if total else 0.0
    print(f"speedup at -j {jobs}: {speedup:.2f}x = {speedup / jobs:.2f} x the cores (target >= 0.8); images "
          f"identical ({len(results[1][2])} bytes)")
    print(f"the plan: compiles sum to {total:.1f} s at -j 1, the longest {longest:.1f} s: at most {bound:.1f}x "
          f"at -j {jobs}" + (f"; {jobs} CPU-bound processes get {capacity:.2f} cores here" if capacity else ""))
    print(f"at -j {jobs} the compiles sum to {shared:.2f} x their -j 1 sum (what sharing the machine costs a compile)")
    rows = [{"metric": "throughput", "value": round(len(plan) / results[j][0], 3), "unit": "variants/s",
             "detail": f"-j {j}; {detail}"} for j in (1, jobs)]
    rows += [
        {"metric": "speedup", "value": round(speedup, 2), "unit": "x", "detail": f"-j {jobs} vs -j 1; {detail}"},
        {"metric": "speedup_per_core", "value": round(speedup / jobs, 3), "unit": "x",
         "detail": f"-j {jobs} vs -j 1 over {jobs} cores; target >= 0.8"},
        {"metric": "plan_bound", "value": round(bound, 2), "unit": "x",
         "detail": f"sum of compiles {total:.1f} s / max(longest {longest:.1f} s, sum / {jobs})"},
    ]
    rows += [{"metric": "image_write", "value": round(results[j][1].write_seconds, 3), "unit": "s",
              "detail": f"-j {j}: from the last compile to the image on disk; {results[j][1].compressed_early} of "
                        f"{len(plan)} entries compressed by then"} for j in (1, jobs)]
    rows.append({"metric": "compile_sum_ratio", "value": round(shared, 3), "unit": "x",
                 "detail": f"sum of compile times at -j {jobs} over their sum at -j 1"})
    if capacity is not None:
        rows.append({"metric": "parallel_capacity", "value": round(capacity, 2), "unit": "cores",
                     "detail": f"{jobs} CPU-bound processes' share of the machine"})
    return [{"provider": "prewarm", "mode": "scaling", "n": len(plan), **row} for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="the N of -j N (default: all cores)")
    parser.add_argument("--count", type=int, default=96, help="variants in the plan (default 96)")
    parser.add_argument("--dtypes", default="fp16,bf16", help="dtypes the plan is drawn from (default fp16,bf16)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: 3 tiny variants at -j 1 and -j 2")
    parser.add_argument("--float8-targets", default=None, metavar="T1,T2",
                        help="the decoding kernels' float8 plan for these targets instead (module docstring)")
    parser.add_argument("--fork-ab", type=int, default=0, metavar="R",
                        help="build at -j N only, R times with the fork server and R times without, alternating")
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "prewarm.csv")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.count < 1:
        parser.error(f"--jobs and --count must be positive, got {args.jobs} and {args.count}")
    jobs = 2 if args.quick else args.jobs
    if args.float8_targets:
        targets = tuple(args.float8_targets.split(","))
        plan, detail = float8_plan(targets), f"the decoding kernels' float8 plan for {'+'.join(targets)}"
    else:
        plan = quick_plan() if args.quick else scaling_plan(args.count, tuple(args.dtypes.split(",")))
        detail = f"{len(plan)} variants of the default sm_90 plan"
    if not plan:
        parser.error(f"--dtypes {args.dtypes}: no variant of the default plan has these dtypes")
    if args.fork_ab > 0:
        print(f"prewarm fork server A/B: {len(plan)} variants at -j {jobs}, {args.fork_ab} builds each", flush=True)
        rows = fork_ab(plan, jobs, args.fork_ab)
    else:
        print(f"prewarm scaling: {len(plan)} variants, -j 1 then -j {jobs}", flush=True)
        capacity = None if args.quick else parallel_capacity(jobs)
        rows = run(plan, jobs, capacity, detail)
    kernels = "+".join(sorted({p.variant.kernel for p in plan}))
    append_rows(args.csv, FIELDS, [{**meta("none"), "kernel": kernels, **row} for row in rows])
    print(f"{len(rows)} rows appended to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
