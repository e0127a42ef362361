"""Benchmark prewarm and images: build throughput, image size, per-entry load time, cold start.

CPU (any machine), on one prewarm set (``--set``, prewarm's own axis flags):

- throughput: variants/s of ``lazytriton prewarm`` at ``-j 1`` and at all cores
  (wall clock of the whole command, worker start-up included; nothing reused),
  beside how many cores that many CPU-bound processes really get here;
- size: the image against the raw binaries (cubin/HSACO bytes) and the raw
  encoded entries;
- load: ``Image(path)`` open, and lookup + decompress + verify of one entry
  (``Image.read``), median over the entries, in µs.

``--cold-start`` (a CUDA host): the time from a new process's start to its
first result, each measured as a fresh subprocess from before its start to
the moment its result is ready (a system-wide monotonic clock), median of
``--reps``, for two scenarios (benchmarks/cold_start.py):

- ``one_kernel``: one forward, bf16 (4, 16, 2048, 128) causal (1 variant);
- ``working_set``: a Whisper-style encoder-decoder's attention, forward and
  backward (8 variants on sm_90).

Providers:

- ``torch_init``: torch alone: the same randn inputs on CUDA, synchronized;
- ``lazytriton_image``: served from an image (LAZYTRITON_IMAGES, an empty
  cache dir, LAZYTRITON_JIT=0); the child checks that every kernel came from
  the image with 0 compiles;
- ``lazytriton_plain``: the same entries from an image that stores them as
  they are (``prewarm --merge IMAGE --codec none``): no zstandard to import,
  no dictionary, no decompression, for ~4x the bytes;
- ``triton_jit_cold`` (one_kernel): the same kernel and config through
  Triton's own JIT (``fn[grid](...)``, arguments from the binding:
  ``cold_start.triton_jit_call``) with an empty TRITON_CACHE_DIR;
- ``triton_jit_warm`` (one_kernel): the same, with a TRITON_CACHE_DIR a
  previous process filled;
- ``lazytriton_jit`` (working_set): lazytriton with no image and an empty
  cache dir: each variant compiled by Triton on first use;
- ``torch_sdpa``: the same calls through torch's own
  ``scaled_dot_product_attention`` (its fused backends): what the scenario
  costs a model without lazytriton, torch's first uses of its kernels and
  of autograd included. Lazytriton's figure over it is printed beside.

The figure that matters is the time after torch's CUDA initialisation (the
inputs on the GPU, synchronized): targets 10 ms for one_kernel and 25 ms for
working_set. Without ``--image`` the image is built here the way a deployment
builds one: a first run of each scenario with JIT on records its misses, and
``lazytriton prewarm --from-misses`` packs exactly those. Rows are appended
to a long-format CSV.

Usage: python benchmarks/bench_prewarm.py [--set "--target sm_90 --dtype bf16"] [--csv PATH]
       python benchmarks/bench_prewarm.py --cold-start [--image IMG] [--keep-image PATH] [--reps 5] [--jit-reps 3]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import cold_start

import lazytriton
from lazytriton.cache_format.image import Image

FIELDS = ["kernel", "provider", "mode", "metric", "value", "unit", "n", "detail", "host", "gpu", "torch", "triton",
          "lazytriton", "timestamp"]
DEFAULT_SET = "--target sm_90 --dtype bf16,fp16 --head-dim 64,128"


def prewarm(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``lazytriton prewarm ARGS`` in a subprocess; its result and wall-clock seconds."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "lazytriton.cli", "prewarm", *args], capture_output=True,
                            text=True, env={**os.environ, "SOURCE_DATE_EPOCH": "0", **(env or {})}, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"prewarm {shlex.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result, seconds


def parallel_capacity(jobs: int) -> float:
    """How many cores ``jobs`` CPU-bound processes get together (``jobs`` on an idle machine).

    Prewarm's speedup at -j N is bounded by this: on a shared CI machine other
    work can take cores that ``nproc`` still counts.
    """
    burn = [sys.executable, "-c", "sum(range(30_000_000))"]

    def wall(n: int) -> float:
        start = time.perf_counter()
        for proc in [subprocess.Popen(burn) for _ in range(n)]:
            proc.wait()
        return time.perf_counter() - start

    return jobs * wall(1) / wall(jobs)


def throughput(set_args: list[str], jobs_all: int, work: Path, rows: list[dict[str, Any]]) -> Path:
    """Build the set at -j 1 and at all cores; the image of the second build."""
    capacity = parallel_capacity(jobs_all)
    print(f"{jobs_all} CPU-bound processes get {capacity:.2f} cores together here")
    rows.append({"provider": "machine", "mode": "build", "metric": "parallel_capacity", "value": round(capacity, 2),
                 "unit": "cores", "n": jobs_all, "detail": "jobs x one process's time / jobs processes' time"})
    out = work
    for jobs in dict.fromkeys((1, jobs_all)):
        out = work / f"j{jobs}.ltimg"
        result, seconds = prewarm([*set_args, "-j", str(jobs), "--out", str(out)])
        compiled = int(re.search(r"(\d+) compiled", result.stdout).group(1))  # type: ignore[union-attr]
        rate = compiled / seconds
        print(f"prewarm -j {jobs}: {compiled} variants in {seconds:.1f} s = {rate:.2f} variants/s")
        rows.append({"provider": "prewarm", "mode": "build", "metric": "throughput", "value": round(rate, 3),
                     "unit": "variants/s", "n": compiled, "detail": f"-j {jobs}; {shlex.join(set_args)}"})
    return out


def size_and_load(path: Path, rows: list[dict[str, Any]], reps: int = 5) -> None:
    """Image size against the raw binaries, and per-entry load time."""
    opens, reads = [], []
    for _ in range(reps):
        start = time.perf_counter()
        image = Image(path)
        opens.append(time.perf_counter() - start)
        keys = list(image.keys())
        for key in keys:
            start = time.perf_counter()
            image.read(key)
            reads.append(time.perf_counter() - start)
        image.close()
    with Image(path) as image:
        entries = [image.read(key) for key in image.keys()]
        raw_entries = sum(image.sizes(key)[1] for key in image.keys())
    binaries = sum(len(e.binary) for e in entries if e is not None)
    size = path.stat().st_size
    print(f"image: {len(entries)} entries, {size / 1024:.0f} KiB; raw binaries {binaries / 1024:.0f} KiB "
          f"(1/{binaries / size:.1f}); raw entries {raw_entries / 1024:.0f} KiB (1/{raw_entries / size:.1f})")
    open_us, read_us = statistics.median(opens) * 1e6, statistics.median(reads) * 1e6
    print(f"load: Image open {open_us:.0f} µs (median of {reps}); lookup + decompress + verify of one entry "
          f"{read_us:.0f} µs (median of {len(reads)}, p90 {statistics.quantiles(reads, n=10)[-1] * 1e6:.0f} µs)")
    n = len(entries)
    rows += [
        {"metric": "image_bytes", "value": size, "unit": "B", "n": n},
        {"metric": "raw_binary_bytes", "value": binaries, "unit": "B", "n": n},
        {"metric": "raw_entry_bytes", "value": raw_entries, "unit": "B", "n": n},
        {"metric": "size_ratio_binaries", "value": round(binaries / size, 2), "unit": "x", "n": n},
        {"metric": "open", "value": round(open_us, 1), "unit": "us", "n": reps},
        {"metric": "read_entry", "value": round(read_us, 1), "unit": "us", "n": len(reads)},
    ]
    for row in rows[-6:]:
        row.update({"provider": "image", "mode": "load" if row["unit"] == "us" else "size"})


# --- cold start (GPU) ------------------------------------------------------------------------------------------

# Each child prints the monotonic time at which its first result is ready (CLOCK_MONOTONIC is system-wide), and
# when torch's own CUDA initialisation was done (inputs on the GPU, synchronized): the time after that is what
# the attention calls themselves cost. The inputs are made before that mark (cold_start.py, imported first).
_PREAMBLE = """
import json, os, sys, time
sys.path.insert(0, {bench_dir!r})
import torch
import cold_start
"""
_INPUTS = {
    "one_kernel": "inputs = cold_start.call_inputs('cuda')\n",
    "working_set": "inputs = cold_start.working_set_inputs('cuda')\n",
}
_READY = """torch.cuda.synchronize()
inputs_ready = time.monotonic()
"""
_TORCH = """print(json.dumps({"ready": time.monotonic(), "inputs": inputs_ready}))
"""
_LAZYTRITON = """from lazytriton import runtime
from lazytriton.flash import attn_fwd
imported = time.monotonic()
if SCENARIO == "one_kernel":
    results = attn_fwd(*inputs, causal=cold_start.CALL[1])
else:
    results = cold_start.working_set_step(inputs)
returned = time.monotonic()
torch.cuda.synchronize()
ready = time.monotonic()
rt = runtime.get()
print(json.dumps({"ready": ready, "inputs": inputs_ready, "served": dict(rt.served), "compiles": rt.compiles,
                  "loaded": len(rt.loaded_kernels()), "finite": all(bool(t.isfinite().all()) for t in results),
                  "phases": {"import": imported - inputs_ready, "call": returned - imported, "gpu": ready - returned}}))
"""
_TRITON = """import triton
from lazytriton.machine import target_of_device
# Kernels that make TMA descriptors on the device take global scratch, which Triton's JIT allocates through
# the allocator its user sets (lazytriton's launcher allocates it itself)
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
q, k, v = inputs
fn, grid, args, constexprs, options, out, lse = cold_start.triton_jit_call(q, k, v, cold_start.CALL[1],
                                                                           target_of_device(q.device))
imported = time.monotonic()
fn[grid](*args, **constexprs, **options)
returned = time.monotonic()
torch.cuda.synchronize()
ready = time.monotonic()
print(json.dumps({"ready": ready, "inputs": inputs_ready, "finite": bool(out.isfinite().all()),
                  "phases": {"import": imported - inputs_ready, "call": returned - imported, "gpu": ready - returned}}))
"""
_SDPA = """import torch.nn.functional as F
imported = time.monotonic()
if SCENARIO == "one_kernel":
    results = [F.scaled_dot_product_attention(*inputs, is_causal=cold_start.CALL[1])]
else:
    results = cold_start.working_set_step(inputs, sdpa=True)
returned = time.monotonic()
torch.cuda.synchronize()
ready = time.monotonic()
print(json.dumps({"ready": ready, "inputs": inputs_ready, "finite": all(bool(t.isfinite().all()) for t in results),
                  "phases": {"import": imported - inputs_ready, "call": returned - imported, "gpu": ready - returned}}))
"""
# (scenario, provider) -> the child's code after its inputs are ready
PROVIDERS = {
    ("one_kernel", "torch_init"): _TORCH,
    ("one_kernel", "lazytriton_image"): _LAZYTRITON,
    ("one_kernel", "lazytriton_plain"): _LAZYTRITON,
    ("one_kernel", "torch_sdpa"): _SDPA,
    ("one_kernel", "triton_jit_cold"): _TRITON,
    ("one_kernel", "triton_jit_warm"): _TRITON,
    ("working_set", "torch_init"): _TORCH,
    ("working_set", "lazytriton_image"): _LAZYTRITON,
    ("working_set", "lazytriton_plain"): _LAZYTRITON,
    ("working_set", "torch_sdpa"): _SDPA,
    ("working_set", "lazytriton_jit"): _LAZYTRITON,
}
JIT_PROVIDERS = ("triton_jit_cold", "triton_jit_warm", "lazytriton_jit")  # run --jit-reps times (seconds each)
SERVED = ("lazytriton_image", "lazytriton_plain")  # from the image; from its entries stored plainly (--codec none)
TARGET_MS = {"one_kernel": 10.0, "working_set": 25.0}  # after torch's CUDA initialisation


def child_code(scenario: str, provider: str) -> str:
    """The Python source a fresh child process runs for one measurement."""
    return (_PREAMBLE.format(bench_dir=str(Path(__file__).resolve().parent)) + f"SCENARIO = {scenario!r}\n"
            + _INPUTS[scenario] + _READY + PROVIDERS[(scenario, provider)])


def time_child(code: str, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """Seconds from before a fresh interpreter starts to its first synchronized result, and what it printed."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                            check=False, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"cold-start child failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["ready"] - start, report


def _lazytriton_env(work: Path, name: str, image: Path | None) -> dict[str, str]:
    """A child's settings: serve from ``image`` only (JIT off), or, without one, compile (JIT on); an empty cache."""
    cache = tempfile.mkdtemp(prefix=f"cache-{name}-", dir=work)
    if image is None:
        return {"LAZYTRITON_IMAGES": "", "LAZYTRITON_JIT": "1", "LAZYTRITON_CACHE_DIR": cache}
    return {"LAZYTRITON_IMAGES": str(image), "LAZYTRITON_JIT": "0", "LAZYTRITON_CACHE_DIR": cache}


def cold_start_image(work: Path) -> Path:
    """An image of exactly what the scenarios load: each run once with JIT on, its misses packed by prewarm."""
    logs = []
    for scenario in _INPUTS:
        env = _lazytriton_env(work, f"record-{scenario}", None)
        _, report = time_child(child_code(scenario, "lazytriton_image"), env)  # its code; JIT on, no image
        print(f"{scenario}: {report['compiles']} variants compiled to record them")
        logs += ["--from-misses", str(Path(env["LAZYTRITON_CACHE_DIR"]) / "misses.jsonl")]
    out = work / "cold.ltimg"
    prewarm([*logs, "--out", str(out)])
    return out


def plain_copy(image: Path, work: Path) -> Path:
    """The image's entries in an image that stores them as they are (``prewarm --codec none``): no zstandard."""
    out = work / "cold-plain.ltimg"
    prewarm(["--merge", str(image), "--out", str(out), "--codec", "none"])
    return out


def compile_bytecode() -> None:
    """Write lazytriton's .pyc files, as an installed package has them.

    An editable install has none until a process writes them, and with
    PYTHONDONTWRITEBYTECODE set (as on our hosts) no process does: every child
    would then compile lazytriton's modules from source, which a deployment
    never pays (measured here on a 2-core CPU machine: import 32 ms from
    source, 16 ms from .pyc).
    """
    import lazytriton
    import lazytriton.cache_format
    import lazytriton.kernels

    folders = {str(Path(m.__file__).parent) for m in (lazytriton, lazytriton.kernels, lazytriton.cache_format)}
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sorted(folders)], check=True, capture_output=True)


def _check_report(scenario: str, provider: str, report: dict[str, Any]) -> None:
    if not report.get("finite", True):
        raise SystemExit(f"{scenario} {provider}: the result holds non-finite values: {report}")
    if provider in SERVED and (report["compiles"] or set(report["served"]) - {"image", "memory"}):
        raise SystemExit(f"{scenario}: not everything was served from the image (does it hold the scenario's "
                         f"variants?): {report}")


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def measure_cold_start(args: argparse.Namespace, work: Path, rows: list[dict[str, Any]]) -> None:
    import torch

    from lazytriton import machine

    compile_bytecode()
    target = machine.target_of_device(0)
    image = args.image or cold_start_image(work)
    if args.keep_image:
        shutil.copyfile(image, args.keep_image)
    images = {"lazytriton_image": image, "lazytriton_plain": plain_copy(image, work), "lazytriton_jit": None}
    warm_cache = work / "triton-warm"
    time_child(child_code("one_kernel", "triton_jit_warm"), {"TRITON_CACHE_DIR": str(warm_cache)})  # fills it
    totals: dict[tuple[str, str], list[float]] = {case: [] for case in PROVIDERS}
    after: dict[tuple[str, str], list[float]] = {case: [] for case in PROVIDERS}
    phases: dict[tuple[str, str, str], list[float]] = {}  # import, call (host), gpu (synchronize)
    for rep in range(args.reps):  # round-robin, so drift on the host hits every provider alike
        for scenario, provider in PROVIDERS:
            if provider in JIT_PROVIDERS and rep >= args.jit_reps:
                continue
            env = _lazytriton_env(work, f"{scenario}-{provider}-{rep}", images.get(provider, image))
            triton_cache = warm_cache if provider == "triton_jit_warm" else work / f"cold-{rep}-{scenario}"
            env["TRITON_CACHE_DIR"] = str(triton_cache)
            seconds, report = time_child(child_code(scenario, provider), env)
            _check_report(scenario, provider, report)
            totals[(scenario, provider)].append(seconds)
            after[(scenario, provider)].append(report["ready"] - report["inputs"])
            for phase, value in report.get("phases", {}).items():
                phases.setdefault((scenario, provider, phase), []).append(value)
            if provider == "lazytriton_image" and rep == 0:
                print(f"{scenario}: {report['loaded']} kernels loaded from the image")
    print(f"\ncold start on {torch.cuda.get_device_name(0)} ({target}), fresh processes; medians (min-max):")
    for scenario in _INPUTS:
        what = (f"bf16 {cold_start.CALL[0]} causal forward" if scenario == "one_kernel"
                else "Whisper-style encoder-decoder attention, forward + backward")
        print(f"\n{scenario}: {what}")
        print(f"  {'provider':<18} {'start->result ms':>17} {'after torch CUDA init ms':>25}   phases (ms)")
        for case in [case for case in PROVIDERS if case[0] == scenario]:
            provider = case[1]
            total, beyond = _median_ms(totals[case]), _median_ms(after[case])
            spread = f"{min(after[case]) * 1e3:.1f}-{max(after[case]) * 1e3:.1f}"
            parts = {phase: _median_ms(v) for (s, p, phase), v in phases.items() if (s, p) == case}
            detail = f"{scenario}; after torch CUDA init {spread} ms"
            rows.append({"kernel": scenario, "provider": provider, "mode": "cold_start",
                         "metric": "start_to_first_result", "value": round(total, 1), "unit": "ms",
                         "n": len(totals[case]), "detail": detail})
            rows.append({"kernel": scenario, "provider": provider, "mode": "cold_start",
                         "metric": "after_torch_cuda_init", "value": round(beyond, 1), "unit": "ms",
                         "n": len(after[case]), "detail": detail})
            rows += [{"kernel": scenario, "provider": provider, "mode": "cold_start", "metric": f"phase_{phase}",
                      "value": round(value, 2), "unit": "ms", "n": len(after[case]),
                      "detail": "import: until the launch; call: until it returns; gpu: synchronize"}
                     for phase, value in parts.items()]
            shown = ", ".join(f"{phase} {value:.1f}" for phase, value in parts.items())
            print(f"  {provider:<18} {total:17.1f} {beyond:14.1f} ({spread:>11})   {shown}")
        peer = _median_ms(after[(scenario, "torch_sdpa")])
        for provider, how in zip(SERVED, ("", ", entries stored plainly"), strict=True):
            beyond = _median_ms(after[(scenario, provider)])
            verdict = "met" if beyond <= TARGET_MS[scenario] else "NOT met"
            print(f"  lazytriton{how} beyond torch's CUDA initialisation: {beyond:.1f} ms "
                  f"(target: at most {TARGET_MS[scenario]:.0f} ms: {verdict})")
        beyond = _median_ms(after[(scenario, "lazytriton_image")])
        print(f"  torch's own SDPA, the same calls: {peer:.1f} ms; lazytriton / SDPA {beyond / peer:.2f}x "
              f"({beyond - peer:+.1f} ms)")


def meta(gpu: str) -> dict[str, str]:
    def ver(name: str) -> str:
        try:
            return version(name)
        except Exception:
            return "not installed"

    return {"kernel": "flash_fwd", "host": platform.node(), "gpu": gpu, "torch": ver("torch"),
            "triton": ver("triton"), "lazytriton": lazytriton.__version__,
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def write_csv(path: Path, rows: list[dict[str, Any]], common: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows({**common, "detail": "", **row} for row in rows)
    print(f"{len(rows)} rows appended to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default=DEFAULT_SET, help=f"prewarm's axis flags (default: {DEFAULT_SET!r})")
    parser.add_argument("--jobs", type=int, default=None, help="the 'all cores' -j (default: all cores)")
    parser.add_argument("--cold-start", action="store_true", help="measure cold start on this CUDA host instead")
    parser.add_argument("--image", type=Path, default=None, help="--cold-start: serve from this image")
    parser.add_argument("--keep-image", type=Path, default=None, help="--cold-start: copy the image served to here")
    parser.add_argument("--reps", type=int, default=5, help="--cold-start: fresh processes per measurement")
    parser.add_argument("--jit-reps", type=int, default=3,
                        help="--cold-start: fresh processes per JIT measurement (seconds each)")
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "prewarm.csv")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-prewarm-") as tmp:
        if args.cold_start:
            import torch

            if not torch.cuda.is_available():
                print("--cold-start needs a CUDA GPU", file=sys.stderr)
                return 2
            gpu = torch.cuda.get_device_name(0)
            measure_cold_start(args, Path(tmp), rows)
        else:
            from lazytriton.prewarm.cli import default_jobs

            gpu = "none"
            image = throughput(shlex.split(args.set), args.jobs or default_jobs(), Path(tmp), rows)
            size_and_load(image, rows)
    write_csv(args.csv, rows, meta(gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
