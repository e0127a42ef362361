"""Host time per call of the C API beside the bare driver launches of the same kernels.

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

``--fake-driver`` (CPU, no GPU): ``capi_fake_bench.c`` against liblazytriton_native.so (built now, or
``--native-lib``'s) and the fake libcuda (tests/fake_libcuda.py, light: its cuLaunchKernel only counts),
serving a bf16 call from an image of its entry (tests/test_native_tma.py's, without scratch): the host cost of
lt_plan_launch and lt_attn_fwd over the bare cuLaunchKernel. Target: lt_plan_launch within 0.2 µs of it.
``--runs N`` runs the program N times and reports each provider's median of the runs' p50s; ``--against LIB``
(another build's liblazytriton_native.so, e.g. main's, with ``--against-header-dir``) runs it interleaved with
this one, run for run, so both see the same load. The load average is printed (the machine may be shared).
``--rounds N``: the program's timed rounds (300 by default) of 1000 calls.

``--kernel kvcache``: the decoding call, lt_attn_kvcache (capi_decode.py): bf16, batch 1, 32 query heads over 8
key/value heads, head dim 128, one new key appended to a cache of 4096 keys (cache_seqlens a device tensor), with
a contiguous and with a paged cache (pages of 256 keys): three kernels a call (kv_append; the split kernel, which
``flash_decode.DEPENDENT_SPLIT`` makes kv_append's programmatic dependent; the combine kernel, the split kernel's).
Beside it, its bare launches: the same cuLaunchKernel and cuLaunchKernelEx calls, each launch's parameters built
once. With ``--fake-driver``, on the fake libcuda (an image of the calls' kernels as the C plan chooses them on
sm_90, entries without a real compile); on a GPU, in this process (capi_decode_bench.c as a shared library), with
the Python call ``flash_attn_with_kvcache`` beside it and the bare launches checked to write the call's out.
Target: lt_attn_kvcache within 0.5 µs of its bare launches.

Usage: python benchmarks/bench_capi.py [--prefix DIR] [--csv PATH] [--shape B H S D]
       python benchmarks/bench_capi.py --kernel kvcache [--prefix DIR] [--rounds N] [--csv PATH]
       python benchmarks/bench_capi.py --fake-driver [--kernel flash_fwd|kvcache] [--rounds N]
                                       [--native-lib PATH --header-dir DIR] [--runs N]
                                       [--against LIB [--against-header-dir DIR]] [--csv PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import capi_decode as decode
from csvlog import append_rows

import lazytriton
from lazytriton import runtime
from lazytriton.capi import build
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import target_from_cuda_capability

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"  # the fake libcuda's helpers (--fake-driver), capi/cuda_driver.h (capi_bench.c's)
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


class FakeMode(NamedTuple):
    """One ``--kernel``'s run on the fake driver: capi_fake_bench's mode, the CSV's kernel and shape, each call
    beside its floor (the bare launch(es) of the same kernels) for the target line, the target."""

    program_mode: str
    kernel: str
    shape: str
    pairs: tuple[tuple[str, str], ...]
    target_us: float


# lt_attn_kvcache over its bare launches, on the fake driver and on a GPU (the same host code: the call's checks,
# its alias check over 10 tensors, its split count and three parameter arrays). Chosen at about 3x the forward's
# plan launch (0.15 µs for one kernel and 5 tensors); measured on the fake driver (median of 5 runs' p50s of 300
# rounds of 1000 calls, 2 cores, load 1.0): 0.69 µs contiguous, 0.72 paged; about 0.3 µs of it is the split
# heuristic (capi/lt_splits.c's lt__splits_for, run on every call). Without new keys: 0.59 µs with the heuristic's
# 32 splits, 0.29 µs with num_splits 2, the same two kernels launched (capi_decode_bench.c's loops, fake driver).
KVCACHE_TARGET_US = 0.5
FAKE_MODES = {
    # lt_plan_launch over the bare cuLaunchKernel
    "flash_fwd": FakeMode("fwd", "flash_fwd", "1x4x300x128", (("lt_plan_launch", "bare_cuLaunchKernel"),), 0.2),
    # lt_attn_kvcache over its three bare launches (kv_append, split, combine as a programmatic dependent)
    "kvcache": FakeMode("kvcache", "flash_decode", decode.SHAPE_NAME,
                        (("lt_attn_kvcache", "bare_launches"), ("lt_attn_kvcache_paged", "bare_launches_paged")),
                        KVCACHE_TARGET_US),
}
GPU_ROUNDS = 200  # --kernel kvcache on a GPU: rounds a provider


def _fake_program(library: Path, header_dir: Path, program: Path) -> Path:
    """capi_fake_bench.c compiled against ``library`` and its ``header_dir``'s lazytriton.h into ``program``."""
    from lazytriton.capi import native_build

    subprocess.run([native_build.compiler(), "-O2", "-std=c99", "-D_POSIX_C_SOURCE=200809L", f"-I{header_dir}",
                    "-o", str(program), str(HERE / "capi_fake_bench.c"), f"-L{library.parent}",
                    f"-Wl,-rpath,{library.parent}", "-l:" + library.name, "-ldl"], check=True)
    return program


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def fake_entries(kernel: str) -> list[Any]:
    """An image's entries for ``kernel``'s calls on the fake driver (no real compile: tests/test_native_front.py's)."""
    from test_native_front import call_variant, fake_entry

    if kernel == "flash_fwd":
        return [fake_entry(call_variant(False))]
    variants = {v.key(): v for paged in (False, True) for v in decode.variants_on("meta", paged, 90)}
    return [fake_entry(v) for v in variants.values()]


def fake_driver(native_lib: Path | None, header_dir: Path | None, csv: Path, runs: int = 1,
                against: Path | None = None, against_header_dir: Path | None = None, kernel: str = "flash_fwd",
                rounds: int = 300) -> int:
    """``--fake-driver``: capi_fake_bench on the fake libcuda, CPU only; rows (this build's) to ``csv``."""
    sys.path.insert(0, str(TESTS))
    from fake_libcuda import build as build_fake

    from lazytriton.cache_format.image import write_image
    from lazytriton.capi import native_build

    mode = FAKE_MODES[kernel]
    builds = {"this": (native_lib, header_dir or HERE.parent / "capi")}
    if against is not None:
        builds["against"] = (against, against_header_dir or HERE.parent / "capi")
    p50s: dict[str, dict[str, list[float]]] = {name: {} for name in builds}
    last: dict[str, tuple[float, float]] = {}
    launches: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lazytriton-bench-capi-fake-") as tmp:
        work = Path(tmp)
        driver = work / "driver"
        driver.mkdir()
        fake = build_fake(work)
        if fake is None:
            raise SystemExit("--fake-driver needs a C compiler")
        (driver / "libcuda.so.1").symlink_to(fake)
        image = work / "call.ltimg"
        write_image(image, fake_entries(kernel))
        programs = {name: _fake_program(library or native_build.build(work / "lib"), headers, work / f"bench_{name}")
                    for name, (library, headers) in builds.items()}
        env = {**os.environ, "LD_LIBRARY_PATH": str(driver), "LAZYTRITON_IMAGES": str(image),
               "LAZYTRITON_CACHE_DIR": str(work / "cache")}
        load_before = os.getloadavg()
        for _ in range(runs):
            for name, program in programs.items():  # interleaved: each run of one beside a run of the other
                run = subprocess.run([str(program), mode.program_mode, str(rounds)], capture_output=True, text=True,
                                     env=env, check=False)
                if run.returncode != 0:
                    print(run.stdout, run.stderr, file=sys.stderr)
                    return 1
                for line in run.stdout.splitlines():
                    if line.startswith("launches "):  # launches CALL N PROGRAMMATIC
                        _, call, count, programmatic = line.split()
                        launches[call] = (f"{count} launches a call ({programmatic} programmatic "
                                          f"dependent{'' if programmatic == '1' else 's'})")
                        continue
                    provider, *times = line.split()  # p50, mean, min
                    p50s[name].setdefault(provider, []).append(float(times[0]))
                    if name == "this":
                        last[provider] = (float(times[1]), float(times[2]))
        load_after = os.getloadavg()
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print(f"host time per call on the fake libcuda, {native_lib or 'this checkout'}; {runs} run(s) of {rounds} "
          f"rounds, {os.cpu_count()} CPUs, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    for call, said in launches.items():
        print(f"{call}: {said}, its bare launches the same")
    rows = []
    for name in builds:
        print(f"{name}: {builds[name][0] or 'this checkout'}")
        print(f"{'provider':<22}{'p50 µs':>10}" + ("" if runs > 1 else f"{'mean µs':>10}{'min µs':>10}"))
        for provider, values in p50s[name].items():
            print(f"{provider:<22}{_median(values):>10.3f}" +
                  ("" if runs > 1 else f"{last[provider][0]:>10.3f}{last[provider][1]:>10.3f}"))
    targeted = {call for call, _ in mode.pairs}
    for provider, values in p50s["this"].items():
        mean, low = last[provider]
        shape = mode.shape + (f" paged{decode.SHAPE[-1]}" if provider.endswith("_paged") else "")
        rows.append({"kernel": mode.kernel, "provider": provider, "mode": "host_per_call_fake_driver",
                     "dtype": "bf16", "shape": shape, "p50_us": f"{_median(values):.4f}",
                     "mean_us": mean if runs == 1 else "", "min_us": low if runs == 1 else "",
                     "target_us": mode.target_us if provider in targeted else "", "gpu": "fake libcuda (CPU)",
                     "lazytriton": lazytriton.__version__, "timestamp": stamp})
    for name in builds:
        for call, floor in mode.pairs:
            over = _median(p50s[name][call]) - _median(p50s[name][floor])
            print(f"{name}: {call} over {floor}: {over:.3f} µs "
                  f"({'within' if over <= mode.target_us else 'OVER'} the {mode.target_us} µs target)")
    append_rows(csv, FIELDS, rows)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=sorted(FAKE_MODES), default="flash_fwd",
                        help="the call timed: lt_plan_launch/lt_attn_fwd (flash_fwd) or lt_attn_kvcache (kvcache)")
    parser.add_argument("--prefix", type=Path, help="a prefix where `lazytriton capi build` installed the library")
    parser.add_argument("--csv", type=Path, default=HERE / "results" / "capi.csv")
    parser.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "S", "D"),
                        help="flash_fwd on a GPU: the shape (default 1 1 128 64)")
    parser.add_argument("--fake-driver", action="store_true", help="CPU: time the plan launch on the fake libcuda")
    parser.add_argument("--native-lib", type=Path, help="with --fake-driver: this liblazytriton_native.so")
    parser.add_argument("--header-dir", type=Path, help="with --native-lib: the folder of its lazytriton.h")
    parser.add_argument("--runs", type=int, default=1, help="with --fake-driver: runs of the program (median)")
    parser.add_argument("--rounds", type=int, help="timed rounds a provider (default: 300 on the fake driver, "
                        f"{GPU_ROUNDS} on a GPU for --kernel kvcache)")
    parser.add_argument("--against", type=Path, help="with --fake-driver: another liblazytriton_native.so, "
                        "run interleaved with this one")
    parser.add_argument("--against-header-dir", type=Path, help="with --against: the folder of its lazytriton.h")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs is {args.runs}; expected >= 1")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds is {args.rounds}; expected >= 1")
    if args.shape is not None and (args.fake_driver or args.kernel != "flash_fwd"):
        parser.error("--shape is the GPU forward's (--kernel flash_fwd without --fake-driver); the fake driver's "
                     "and the decoding call's shapes are fixed")
    if args.shape is not None and min(args.shape) < 1:
        parser.error(f"--shape is {' '.join(map(str, args.shape))}; expected four sizes >= 1")
    if not args.fake_driver and (args.native_lib or args.header_dir or args.against or args.against_header_dir
                                 or args.runs != 1):
        parser.error("--native-lib, --header-dir, --runs, --against and --against-header-dir go with --fake-driver")
    if args.fake_driver:
        return fake_driver(args.native_lib, args.header_dir, args.csv, args.runs, args.against,
                           args.against_header_dir, args.kernel, args.rounds or 300)
    if args.kernel == "kvcache":
        return decode.gpu_kvcache(args.prefix, args.csv, args.rounds or GPU_ROUNDS, FIELDS, KVCACHE_TARGET_US)
    if args.rounds is not None:
        parser.error("--rounds goes with --fake-driver or --kernel kvcache (capi_bench.c's rounds are fixed)")
    shape = tuple(args.shape or (1, 1, 128, 64))
    with tempfile.TemporaryDirectory(prefix="lazytriton-bench-capi-") as tmp:
        work = Path(tmp)
        prefix = args.prefix or build.build(work / "prefix").prefix
        program = work / "capi_bench"
        include, lib = prefix / "include", prefix / "lib"
        subprocess.run(["gcc", "-O2", "-std=c99", "-D_POSIX_C_SOURCE=200809L", f"-I{include}",
                        f"-I{TESTS / 'capi'}", "-o", str(program), str(HERE / "capi_bench.c"), f"-L{lib}",
                        f"-Wl,-rpath,{lib}", "-llazytriton", "-ldl"], check=True)
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
