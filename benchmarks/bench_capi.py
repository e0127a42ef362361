"""Host time per call of the C API beside a bare driver launch of the same kernel.

Builds liblazytriton.so (``lazytriton capi build`` into a temporary prefix,
unless ``--prefix`` names a built one), compiles ``capi_bench.c`` against
it, resolves the kernel the C API will pick for a tiny fp16 shape (compiling
it into the cache if needed) and writes its cubin for the bare launch, then
runs the C program, which times on one non-blocking stream:

- ``bare_cuLaunchKernel``: cuLaunchKernel with a parameter array built once:
  the floor;
- ``lt_plan_launch``: checks the call against the plan, builds the parameter
  array and launches, in C;
- ``lt_attn_fwd``: the same, after finding the plan in its memo.

Target: lt_plan_launch at most 5 µs per call. Prints a table and appends rows
to a long-format CSV (``benchmarks/results/capi.csv`` by default). Needs a
CUDA GPU, gcc, and cffi.

Usage: python benchmarks/bench_capi.py [--prefix DIR] [--csv PATH] [--shape B H S D]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from csvlog import append_rows

import lazytriton
from lazytriton import runtime
from lazytriton.capi import build
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import target_from_cuda_capability

HERE = Path(__file__).resolve().parent
FIELDS = ["kernel", "provider", "mode", "dtype", "shape", "p50_us", "mean_us", "min_us", "target_us", "gpu",
          "lazytriton", "timestamp"]
TARGET_US = 5.0  # lt_plan_launch, the target


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:
        return "unknown"


def _kernel_for(shape: tuple[int, int, int, int], cubin: Path) -> list[str]:
    """Resolve the variant the C API picks for this call; write its cubin; return capi_bench's launch arguments."""
    from lazytriton.driver import gpu

    _, _, s, d = shape
    api = gpu.cuda()
    device, major, minor = api.ffi.new("CUdevice *"), api.ffi.new("int *"), api.ffi.new("int *")
    api.check(api.lib.cuDeviceGet(device, 0), "cuDeviceGet")
    api.check(api.lib.cuDeviceGetAttribute(major, 75, device[0]), "cuDeviceGetAttribute")
    api.check(api.lib.cuDeviceGetAttribute(minor, 76, device[0]), "cuDeviceGetAttribute")
    target = target_from_cuda_capability(major[0], minor[0])
    # As lazytriton.c: cuMemAlloc'd pointers and these strides are 16-byte aligned; the shape is far from 2**31.
    variant = fwd_dispatch.flash_fwd_variant(target, "fp16", d, False, True, s, index64=False, seqlen_k=s)
    entry = runtime.get().resolve(variant).entry
    cubin.write_bytes(entry.binary)
    print(f"kernel: {variant}")
    return [str(cubin), entry.name, str(entry.shared), str(entry.block_threads), str(variant.get("BLOCK_M")),
            str(len(entry.hidden_args))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=Path, help="a prefix where `lazytriton capi build` installed the library")
    parser.add_argument("--csv", type=Path, default=HERE / "results" / "capi.csv")
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 1, 128, 64], metavar=("B", "H", "S", "D"))
    args = parser.parse_args()
    shape = tuple(args.shape)
    with tempfile.TemporaryDirectory(prefix="lazytriton-bench-capi-") as tmp:
        work = Path(tmp)
        prefix = args.prefix or build.build(work / "prefix").prefix
        program = work / "capi_bench"
        include, lib = prefix / "include", prefix / "lib"
        subprocess.run(["gcc", "-O2", "-std=c99", "-D_POSIX_C_SOURCE=200809L", f"-I{include}", "-o", str(program),
                        str(HERE / "capi_bench.c"), f"-L{lib}", f"-Wl,-rpath,{lib}", "-llazytriton", "-ldl"],
                       check=True)
        launch = _kernel_for(shape, work / "kernel.cubin")  # type: ignore[arg-type]
        run = subprocess.run([str(program), *launch, *map(str, shape)], capture_output=True, text=True,
                             env=dict(os.environ), check=False)
        if run.returncode != 0:
            print(run.stdout, run.stderr, file=sys.stderr)
            return 1
    rows = []
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    gpu_name = _gpu_name()
    print(f"\nhost time per call, fp16 {shape} (B, H, S, D), not causal, {gpu_name}")
    print(f"{'provider':<22}{'p50 µs':>10}{'mean µs':>10}{'min µs':>10}")
    for line in run.stdout.splitlines():
        name, p50, mean, low = line.split()
        print(f"{name:<22}{float(p50):>10.2f}{float(mean):>10.2f}{float(low):>10.2f}")
        rows.append({"kernel": "flash_fwd", "provider": name, "mode": "host_per_call", "dtype": "fp16",
                     "shape": "x".join(map(str, shape)), "p50_us": p50, "mean_us": mean, "min_us": low,
                     "target_us": TARGET_US if name == "lt_plan_launch" else "", "gpu": gpu_name,
                     "lazytriton": lazytriton.__version__, "timestamp": stamp})
    plan = next(float(r["p50_us"]) for r in rows if r["provider"] == "lt_plan_launch")
    print(f"lt_plan_launch p50 {plan:.2f} µs: {'within' if plan <= TARGET_US else 'OVER'} the {TARGET_US} µs target")
    append_rows(args.csv, FIELDS, rows)
    print(f"rows appended to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
