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
first attention result (bf16 (4, 16, 2048, 128), causal, CUDA tensors,
synchronized), each measured as a fresh subprocess from before its start to
the moment its result is ready (a system-wide monotonic clock), median of
``--reps``:

- ``torch_init``: torch alone: the same randn inputs on CUDA, synchronized;
- ``lazytriton_image``: ``attn_fwd`` served from an image (LAZYTRITON_IMAGES,
  an empty cache dir, LAZYTRITON_JIT=0); the child checks that the kernel came
  from the image with 0 compiles;
- ``triton_jit_cold``: the same kernel and config through Triton's JIT
  (``flash_fwd_kernel[grid](...)``) with an empty TRITON_CACHE_DIR;
- ``triton_jit_warm``: the same, with a TRITON_CACHE_DIR a previous process filled.

The figure that matters is lazytriton_image - torch_init: the cost beyond
torch's own CUDA initialisation. Rows are appended to a long-format CSV.

Usage: python benchmarks/bench_prewarm.py [--set "--target sm_90 --dtype bf16"] [--csv PATH]
       python benchmarks/bench_prewarm.py --cold-start [--image IMG] [--reps 5]
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
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lazytriton
from lazytriton.cache_format.image import Image

FIELDS = ["kernel", "provider", "mode", "metric", "value", "unit", "n", "detail", "host", "gpu", "torch", "triton",
          "lazytriton", "timestamp"]
DEFAULT_SET = "--target sm_90 --dtype bf16,fp16 --head-dim 64,128"
SHAPE = (4, 16, 2048, 128)  # batch, heads, seqlen, head dim of the cold-start call


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

# Each child prints the monotonic time at which its first result is ready (CLOCK_MONOTONIC is system-wide).
# Each also records when torch's own CUDA initialisation is done (inputs on the GPU,
# synchronized): the time after that is what the attention call itself costs.
INPUTS = f"""
import os, time, json, torch
q, k, v = (torch.randn({SHAPE}, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
inputs_ready = time.monotonic()
"""
CHILD_TORCH = INPUTS + """
print(json.dumps({"ready": time.monotonic(), "inputs": inputs_ready}))
"""
CHILD_IMAGE = INPUTS + """
from lazytriton import runtime
from lazytriton.flash import attn_fwd
imported = time.monotonic()
out, lse = attn_fwd(q, k, v, causal=True)
returned = time.monotonic()
torch.cuda.synchronize()
ready = time.monotonic()
rt = runtime.get()
print(json.dumps({"ready": ready, "inputs": inputs_ready, "served": dict(rt.served), "compiles": rt.compiles,
                  "finite": bool(out.isfinite().all()),
                  "phases": {"import": imported - inputs_ready, "call": returned - imported,
                             "gpu": ready - returned}}))
"""
CHILD_TRITON = INPUTS + """
import math
from lazytriton.kernels.flash_fwd.triton_kernel import flash_fwd_kernel
cfg = json.loads(os.environ["BENCH_CONFIG"])
b, h, s, d = q.shape
out = torch.empty_like(q)
lse = torch.empty((b, h, s), device="cuda", dtype=torch.float32)
grid = ((s + cfg["BLOCK_M"] - 1) // cfg["BLOCK_M"], h, b)
flash_fwd_kernel[grid](
    q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], h * s, s, 1, s, s, d, 0,
    1.0 / math.sqrt(d), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=d, EVEN_D=True, CAUSAL=True,
    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
torch.cuda.synchronize()
print(json.dumps({"ready": time.monotonic(), "inputs": inputs_ready, "finite": bool(out.isfinite().all())}))
"""


def time_child(code: str, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """Seconds from before a fresh interpreter starts to its first synchronized result, and what it printed."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                            check=False, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"cold-start child failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["ready"] - start, report


def cold_start_image(target: str, image: Path | None, work: Path) -> Path:
    """The image to serve the cold-start call: ``image``, else one prewarm builds for it here."""
    if image is not None:
        return image
    out = work / "cold.ltimg"
    b, h, s, d = SHAPE
    prewarm(["--target", target, "--dtype", "bf16", "--head-dim", str(d), "--causal", "causal",
             "--seqlen-q", str(s), "--seqlen-k", str(s), "--out", str(out)])
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


def cold_start(args: argparse.Namespace, work: Path, rows: list[dict[str, Any]]) -> None:
    import torch

    from lazytriton import dispatch

    compile_bytecode()
    target = dispatch.target_of_device(0)
    image = cold_start_image(str(target), args.image, work)
    cfg = dispatch.flash_fwd_config(target, "bf16", SHAPE[3], True, SHAPE[2], SHAPE[2])[0]
    config = json.dumps({"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "num_warps": cfg.num_warps,
                         "num_stages": cfg.num_stages})
    warm_cache = work / "triton-warm"
    time_child(CHILD_TRITON, {"TRITON_CACHE_DIR": str(warm_cache), "BENCH_CONFIG": config})  # fills it
    children = (("torch_init", CHILD_TORCH), ("lazytriton_image", CHILD_IMAGE),
                ("triton_jit_cold", CHILD_TRITON), ("triton_jit_warm", CHILD_TRITON))
    totals: dict[str, list[float]] = {name: [] for name, _ in children}
    after: dict[str, list[float]] = {name: [] for name, _ in children}
    phases: dict[str, list[float]] = {}  # lazytriton's share after torch's init: import, call (CPU), GPU wait
    for rep in range(args.reps):  # round-robin, so drift on the host hits every provider alike
        for name, code in children:
            env = {"BENCH_CONFIG": config, "LAZYTRITON_IMAGES": str(image), "LAZYTRITON_JIT": "0",
                   "LAZYTRITON_CACHE_DIR": str(work / f"empty-cache-{name}-{rep}"),
                   "TRITON_CACHE_DIR": str(warm_cache if name == "triton_jit_warm" else work / f"cold-{rep}")}
            seconds, report = time_child(code, env)
            if name == "lazytriton_image" and (not report["served"].get("image") or report["compiles"]):
                raise SystemExit(f"the cold-start call was not served from the image: {report}")
            totals[name].append(seconds)
            after[name].append(report["ready"] - report["inputs"])
            for phase, value in report.get("phases", {}).items():
                phases.setdefault(phase, []).append(value)
    print(f"\ncold start on {torch.cuda.get_device_name(0)} ({target}), bf16 {SHAPE} causal, "
          f"median of {args.reps} fresh processes:")
    print(f"  {'provider':<18} {'start->result':>14} {'after torch CUDA init':>22}")
    for name, _ in children:
        total, beyond = statistics.median(totals[name]) * 1e3, statistics.median(after[name]) * 1e3
        spread = f"min {min(totals[name]) * 1e3:.1f} max {max(totals[name]) * 1e3:.1f} ms"
        rows.append({"provider": name, "mode": "cold_start", "metric": "start_to_first_result",
                     "value": round(total, 1), "unit": "ms", "n": args.reps,
                     "detail": f"bf16 {SHAPE} causal; {spread}"})
        rows.append({"provider": name, "mode": "cold_start", "metric": "after_torch_cuda_init",
                     "value": round(beyond, 1), "unit": "ms", "n": args.reps,
                     "detail": "first result minus inputs synchronized on the GPU"})
        print(f"  {name:<18} {total:11.1f} ms {beyond:19.1f} ms")
    for phase, values in phases.items():
        rows.append({"provider": "lazytriton_image", "mode": "cold_start", "metric": f"phase_{phase}",
                     "value": round(statistics.median(values) * 1e3, 2), "unit": "ms", "n": args.reps,
                     "detail": "import: lazytriton.flash; call: attn_fwd returns; gpu: synchronize"})
    print("  lazytriton phases (median ms): "
          + ", ".join(f"{phase} {statistics.median(values) * 1e3:.1f}" for phase, values in phases.items()))
    beyond = statistics.median(after["lazytriton_image"]) * 1e3
    print(f"lazytriton beyond torch's CUDA initialisation: {beyond:.1f} ms (target: at most 50 ms)")


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
    parser.add_argument("--reps", type=int, default=5, help="--cold-start: fresh processes per measurement")
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
            cold_start(args, Path(tmp), rows)
        else:
            from lazytriton.prewarm.cli import default_jobs

            gpu = "none"
            image = throughput(shlex.split(args.set), args.jobs or default_jobs(), Path(tmp), rows)
            size_and_load(image, rows)
    write_csv(args.csv, rows, meta(gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
