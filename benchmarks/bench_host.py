"""Host time of one warm call, each public entry point beside its peers, in one run (GPU).

Per call, on a tiny shape (1 x 2 x 16 x 64 bf16, so the host is what costs):
``attn_fwd``, ``flash_attn_func`` and the SDPA drop-in through each launch
path (the warm path's C++ tail, kernels/flash_fwd/_hotpath.cpp, the compiled
helper, lazytriton/driver/fastlaunch.py, and cffi's ABI mode), beside
``torch.add``, torch's SDPA (default backend) and the same kernel through
Triton's JIT. The target (issue 12): an eager warm call costs
at most 1.5x torch.add's host time.

Host time, not GPU time: each round times ``--calls`` calls (fewer than the
driver's launch queue holds, so no launch waits for the GPU) and synchronises
outside the timed span; the figure is the median over ``--rounds`` rounds,
the providers' rounds interleaved so that a slow spell of the machine hits
all of them. Builds the helper and the C++ tail into the package folder
first if they are missing (``--no-build`` to skip: then only what the
runtime finds, in the package or the cache dir, is used, and the first GPU
use builds what is missing in the background for the next process, as a
fresh install does), and says which launch path each row used. Its last
line names the fastest launch path this process had and attn_fwd's ratio on
it (benchmarks/host_fresh.sh reads it).

Usage: python benchmarks/bench_host.py [--csv PATH] [--rounds N] [--calls N] [--no-build] [--no-jit]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from csvlog import append_rows

import lazytriton
from lazytriton import config, runtime
from lazytriton.driver import fastlaunch, helpers
from lazytriton.kernels.flash_fwd import hot, hotpath

FIELDS = ["benchmark", "provider", "mode", "value", "unit", "ratio_to_torch_add", "rounds", "calls", "gpu", "torch",
          "triton", "lazytriton", "timestamp"]
TARGET = 1.5
HELPER, ABI, CPP = "compiled helper", "cffi ABI mode", "C++ tail"
# In the C++ tail's group, its warm forward function called directly (no public wrapper), three ways: the lse from
# the entry's stock (hot.CPP_LSE_STOCKS True) or from at::empty (False, the default), and the latter with the stream
# read in Python rather than by the C++ tail (where its module has STREAM_INSIDE); the same kernels, one group.
FORWARD_STOCKED, FORWARD_ALLOCATED = "hot.forward_bhsd, lse stocked", "hot.forward_bhsd, lse allocated"
FORWARD_PY_STREAM = "hot.forward_bhsd, lse allocated, stream from Python"
# The entry lookup in Python rather than in C++ (hot.py's front, ``serve``; with STREAM_INSIDE only).
FORWARD_PY_LOOKUP = "hot.forward_bhsd, lse allocated, lookup in Python"


def ensure_helper(build: bool) -> str:
    """The helper's state, building it into the package folder when missing and ``build``."""
    if fastlaunch.available():
        return f"installed: {fastlaunch.origin()}"
    if not build:
        return "not built (--no-build)"
    try:
        from lazytriton.driver import fastlaunch_build

        path = fastlaunch_build.build()
    except Exception as exc:  # no compiler, no Python headers, read-only install
        return f"build failed ({type(exc).__name__}: {exc})"
    return f"built now: {path}" if fastlaunch.refresh() else f"built at {path} but it does not import"


def ensure_cpp(build: bool) -> str:
    """The C++ tail's state, building it into the package folder when missing and ``build``."""
    if hotpath.module() is not None:
        return f"installed: {hotpath.origin()}"
    if not build:
        return "not built (--no-build)"
    try:
        from lazytriton.kernels.flash_fwd import hotpath_build

        path = hotpath_build.build()
    except Exception as exc:  # no C++ compiler, no torch headers (the message says which), read-only install
        return f"build failed ({type(exc).__name__}: {exc})"
    return f"built now: {path}" if hotpath.refresh() else f"built at {path} but it does not load"


def entry_points(path: str) -> dict[str, Callable[[], object]]:
    """The three public calls, warm, with kernels loaded under launch path ``path``."""
    previous = fastlaunch.enable(path != ABI)
    previous_cpp = hotpath.enable(path == CPP)
    hot.regenerate()  # the warm paths are made again with the C++ tail or without it
    try:
        runtime.reset()  # kernels take the launch path of the setting they are loaded under
        q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        calls: dict[str, Callable[[], object]] = {
            "attn_fwd": lambda: lazytriton.attn_fwd(q, k, v),
            "flash_attn_func": lambda: lazytriton.flash_attn_func(qb, kb, vb),
            "lazytriton_sdpa": lambda: lazytriton.scaled_dot_product_attention(q, k, v),
        }
        if path == CPP:
            previous_stocks = hot.CPP_LSE_STOCKS
            for name, stocked, inside, front in ((FORWARD_STOCKED, True, None, True),
                                                 (FORWARD_ALLOCATED, False, None, True),
                                                 (FORWARD_PY_LOOKUP, False, None, False),
                                                 (FORWARD_PY_STREAM, False, False, True)):
                hot.CPP_LSE_STOCKS = stocked
                forward = hot.generate("bhsd", "forward", stream_inside=inside, with_front=front)
                calls[name] = lambda forward=forward: forward(q, k, v, False, None)
            hot.CPP_LSE_STOCKS = previous_stocks
        for fn in calls.values():
            fn()
            fn()
        kernel, _ = next(iter(runtime.get().plans.values()))
        used = ABI if kernel.fast is None else CPP if hotpath.module() is not None else HELPER
        if used != path:
            raise SystemExit(f"asked for launch path {path!r}, the loaded kernel has {used!r}")
        return calls
    finally:
        fastlaunch.enable(previous)
        hotpath.enable(previous_cpp)


def peers(with_jit: bool) -> dict[str, Callable[[], object]]:
    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    calls: dict[str, Callable[[], object]] = {
        "torch_add": lambda: torch.add(q, q),
        "sdpa_default": lambda: F.scaled_dot_product_attention(q, k, v),
    }
    if with_jit:
        from bench_flash_fwd import triton_jit

        calls["triton_jit"] = triton_jit(q, k, v, False)
    return calls


def measure(providers: dict[tuple[str, str], Callable[[], object]], rounds: int, calls: int) -> dict[
        tuple[str, str], float]:
    """Median over interleaved rounds of the host µs per call (launches never wait for the GPU)."""
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in providers}
    for fn in providers.values():
        for _ in range(100):
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for key, fn in providers.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[key].append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return {key: statistics.median(values) for key, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "host.csv")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=400, help="calls per round (stay under the launch queue)")
    parser.add_argument("--no-build", action="store_true", help="do not build the helper or the C++ tail if missing")
    parser.add_argument("--no-jit", action="store_true", help="leave out Triton's JIT (no triton import)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_host needs a CUDA GPU", file=sys.stderr)
        return 2
    helper = ensure_helper(not args.no_build)
    print(f"launch helper: {helper}")
    paths = [HELPER, ABI] if fastlaunch.available() else [ABI]
    if fastlaunch.available():
        cpp = ensure_cpp(not args.no_build)
        print(f"C++ tail: {cpp}; reads the stream itself: {bool(getattr(hotpath.module(), 'STREAM_INSIDE', 0))}")
        if hotpath.module() is not None:
            paths.insert(0, CPP)
    started = time.perf_counter()
    results: dict[tuple[str, str], float] = {}
    adds: dict[str, float] = {}
    jit = not args.no_jit
    # One group per launch path (one runtime at a time: a reset drops the other path's kernels), each with its
    # own torch.add; the peers (SDPA, Triton's JIT) in a group of their own, last, so that their calls do not
    # share rounds with a launch path's (the JIT's ~30 µs of Python between them slowed that group's torch.add).
    for path in [*paths, "-"]:
        add = peers(False)["torch_add"]
        providers = {(name, path): fn for name, fn in entry_points(path).items()} if path != "-" else {
            (name, "-"): fn for name, fn in peers(jit).items() if name != "torch_add"}
        providers[("torch_add", "-")] = add
        measured = measure(providers, args.rounds, args.calls)
        adds[path] = measured[("torch_add", "-")]
        results.update({key: value for key, value in measured.items() if key[1] != "-" or path == "-"})
    triton_version = "-"
    if not args.no_jit:
        import triton

        triton_version = triton.__version__
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton_version,
            "lazytriton": lazytriton.__version__, "rounds": args.rounds, "calls": args.calls,
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}

    def ratio(name: str, path: str, value: float) -> float:
        return value / adds[path]

    append_rows(args.csv, FIELDS, ({**meta, "benchmark": "host", "provider": name, "mode": path,
                                    "value": round(value, 2), "unit": "us_per_call",
                                    "ratio_to_torch_add": round(ratio(name, path, value), 3)}
                                   for (name, path), value in results.items()))
    print(f"\nhost µs per warm call, median of {args.rounds} rounds x {args.calls} calls "
          f"({time.perf_counter() - started:.0f} s; {meta['gpu']}, torch {meta['torch']}, triton {triton_version})")
    print("ratios are to torch.add measured in the same group: " +
          ", ".join(f"{path if path != '-' else 'peers'} {value:.2f} µs" for path, value in adds.items()))
    print(f"{'call':<52} {'launch path':<16} {'host µs':>8} {'vs torch.add':>13}")
    for (name, path), value in results.items():
        r = ratio(name, path, value)
        verdict = "" if path == "-" else ("  meets 1.5x" if r <= TARGET else "  over 1.5x")
        print(f"{name:<52} {path:<16} {value:8.2f} {r:12.2f}x{verdict}")
    print(f"rows appended to {args.csv}")
    cache_dir = config.settings().cache_dir
    for name in helpers.registry():
        state = helpers.status(name, cache_dir, torch.__version__)
        print(f"{name} helper now: {state.state}: {state.detail}" + (f" ({state.path})" if state.path else ""))
    best = paths[0]
    print(f"this process: launch path {best}; attn_fwd {ratio('attn_fwd', best, results[('attn_fwd', best)]):.2f}x "
          f"torch.add (target 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
