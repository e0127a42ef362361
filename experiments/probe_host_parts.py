"""Where a warm call's host time goes, part by part, and what a launch costs per parameter (GPU).

bench_host.py gives the whole call (flash_attn_func 1.51x torch.add on the
H200, attn_fwd 1.92x). This probe times the pieces of the warm path in the
same interleaved rounds (bench_host.measure), so their sum can be read
against the whole:

- the allocations (``empty_like`` of q; of the expanded lse template, on the host with ``device=`` as the
  warm path makes it, beside one on the device and ``torch.empty(shape, dtype=, device=)``),
- four ``data_ptr()`` reads and the raw-stream read,
- the launch alone (the compiled helper with one call's captured arguments),
- the warm functions themselves (``hot.output_bhsd``, ``hot.forward_bhsd``)
  with their Python tail and with the C++ one (kernels/flash_fwd/_hotpath.cpp,
  built here if missing), the C++ tail alone, and the public calls (which
  take the C++ tail when it is built),
- an empty kernel with N 8-byte parameters (hand-written PTX, loaded with
  cuModuleLoadData) launched through the same helper, N = 4 .. 64: the
  driver's cost per parameter, which says whether dropping the parameters a
  plain call leaves unused (window, ALiBi, bias, dropout, varlen) is worth
  a kernel signature per feature set.

A no-op lambda is timed too; each figure includes one Python call of that cost.
Usage: python experiments/probe_host_parts.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the benchmarks' helpers
from bench_host import ensure_cpp, ensure_helper, measure  # noqa: E402

import lazytriton  # noqa: E402
from lazytriton import runtime  # noqa: E402
from lazytriton.driver import fastlaunch  # noqa: E402
from lazytriton.kernels.flash_fwd import (
    hot,  # noqa: E402
    hotpath,
)

PARAM_COUNTS = (4, 16, 32, 48, 64)


def empty_kernel_ptx(n: int) -> bytes:
    """PTX of ``probe_empty`` taking ``n`` u64 parameters and doing nothing."""
    params = ",\n".join(f"    .param .u64 p{i}" for i in range(n))
    return (f".version 7.8\n.target sm_90\n.address_size 64\n\n.visible .entry probe_empty(\n{params}\n)\n"
            "{\n    ret;\n}\n").encode() + b"\0"


def empty_launchers(api: Any, device_index: int) -> dict[int, Callable[[], int]]:
    """For each N, a call launching the empty N-parameter kernel on the current stream through the helper."""
    ffi, lib = api.ffi, api.lib
    dev, primary = ffi.new("CUdevice *"), ffi.new("CUcontext *")
    api.check(lib.cuDeviceGet(dev, device_index), "cuDeviceGet")
    api.check(lib.cuDevicePrimaryCtxRetain(primary, dev[0]), "cuDevicePrimaryCtxRetain")  # torch's context
    ctx = primary[0]
    calls: dict[int, Callable[[], int]] = {}
    stream = torch.cuda.current_stream(device_index).cuda_stream
    for n in PARAM_COUNTS:
        api.check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            module = ffi.new("CUmodule *")
            api.check(lib.cuModuleLoadData(module, ffi.from_buffer(empty_kernel_ptx(n))), "cuModuleLoadData")
            function = ffi.new("CUfunction *")
            api.check(lib.cuModuleGetFunction(function, module[0], b"probe_empty"), "cuModuleGetFunction")
        finally:
            lib.cuCtxPopCurrent_v2(ffi.new("CUcontext *"))
        fast = fastlaunch.launcher(fastlaunch.make_driver(*api.driver_functions),
                                   int(ffi.cast("uintptr_t", function[0])), int(ffi.cast("uintptr_t", ctx)),
                                   128, 0, tuple(range(n)))
        if fast is None:
            raise SystemExit("the compiled helper is not available")
        ints = tuple(range(1, n + 1))
        calls[n] = lambda fast=fast, ints=ints: fast(1, 1, 1, stream, ints, ())
    return calls


def captured_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], int]:
    """The warm path's own launch with one call's arguments, replayed alone."""
    kernel, _ = next(iter(runtime.get().plans.values()))
    fast = kernel.fast
    if fast is None:
        raise SystemExit("the flash kernel was not loaded through the compiled helper")
    seen: list[tuple[Any, ...]] = []
    kernel.fast = lambda *args: seen.append(args) or fast(*args)
    try:
        hot.generate("bhsd", "output", cpp=False)(q, k, v, False, None)  # the Python tail calls kernel.fast
    finally:
        kernel.fast = fast
    if not seen:
        raise SystemExit("the warm path did not launch through the helper")
    args = seen[0]
    return lambda: fast(*args)


def warm_tails(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[tuple[str, str], Callable[[], object]]:
    """forward_bhsd and output_bhsd with the Python tail and (when built) the C++ one; the C++ tail alone."""
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    cpp = hotpath.module()
    for tail, module in (("Python tail", False), ("C++ tail", cpp)):
        if module is None:
            continue
        for result in ("forward", "output"):
            fn = hot.generate("bhsd", result, cpp=module)
            calls[(f"hot.{result}_bhsd, {tail}", "warm fn")] = lambda fn=fn: fn(q, k, v, False, None)
    if cpp is not None:
        seen: list[tuple[Any, ...]] = []

        def run(*args: Any) -> Any:
            seen.append(args)
            return cpp.run(*args)

        hot.generate("bhsd", "forward", cpp=cpp, run_cpp=run)(q, k, v, False, None)
        if not seen:
            raise SystemExit("the warm path did not call the C++ tail")
        args = seen[-1]
        calls[("C++ tail alone (forward)", "part")] = lambda: cpp.run(*args)
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_host_parts needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"launch helper: {ensure_helper(True)}")
    print(f"C++ tail: {ensure_cpp(True)}")
    hot.regenerate()
    fastlaunch.enable(True)
    runtime.reset()
    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for _ in range(2):
        lazytriton.attn_fwd(q, k, v)
        lazytriton.flash_attn_func(qb, kb, vb)
        lazytriton.scaled_dot_product_attention(q, k, v)
    template = hot.lse_template(1, 2, 16)  # on the host: each lse is empty_like(template, device=)
    device = hot.device_of(0)
    on_device = torch.empty(1, dtype=torch.float32, device=device).expand(1, 2, 16)  # the forms it is held against
    stream_of = torch._C._cuda_getCurrentRawStream  # noqa: SLF001 (what the warm path calls)
    from lazytriton.driver.gpu import CudaApi

    api = CudaApi()
    providers: dict[tuple[str, str], Callable[[], object]] = {
        ("noop", "-"): lambda: None,
        ("torch_add", "-"): lambda: torch.add(q, q),
        ("empty_like(q)", "part"): lambda: torch.empty_like(q),
        ("empty_like(lse template)", "part"): lambda: torch.empty_like(template, device=device),
        ("empty_like(lse template on the device)", "part"): lambda: torch.empty_like(on_device),
        ("empty(lse shape, dtype=, device=)", "part"): lambda: torch.empty((1, 2, 16), dtype=torch.float32,
                                                                           device=device),
        ("4x data_ptr", "part"): lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr()),
        ("raw stream", "part"): lambda: stream_of(0),
        ("is capturing", "part"): hot.is_capturing,
        ("launch alone (helper)", "part"): captured_launch(q, k, v),
        **warm_tails(q, k, v),
        ("attn_fwd", "public"): lambda: lazytriton.attn_fwd(q, k, v),
        ("flash_attn_func", "public"): lambda: lazytriton.flash_attn_func(qb, kb, vb),
        ("sdpa drop-in", "public"): lambda: lazytriton.scaled_dot_product_attention(q, k, v),
    }
    for n, fn in empty_launchers(api, 0).items():
        providers[(f"empty kernel, {n} params", "launch")] = fn
    measured = measure(providers, args.rounds, args.calls)
    add = measured[("torch_add", "-")]
    print(f"\nhost µs per call, median of {args.rounds} rounds x {args.calls} calls ({torch.cuda.get_device_name()}, "
          f"torch {torch.__version__})")
    print(f"{'what':<28} {'kind':<8} {'µs':>7} {'vs add':>7}")
    for (name, kind), value in measured.items():
        print(f"{name:<28} {kind:<8} {value:7.2f} {value / add:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
