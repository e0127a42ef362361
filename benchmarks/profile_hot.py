"""Host cost of each step of a warm attn_fwd call on a tiny shape (µs per call, median of rounds).

On a GPU: each step of the real warm path, then the whole call through each
launch path (the compiled helper and cffi's ABI mode) and through the op.
Where the C++ tail is built (``python -m lazytriton.kernels.flash_fwd.hotpath_build``),
the warm path is timed with it ("C++ tail") and without it.

``--cpu-fake``: no GPU needed (the thread's CPU time in interleaved rounds,
best and quartiles: the CPU machine is shared). The warm path's own generated
text (``hot.generate(cuda=False)``) runs on CPU tensors against a fake libcuda
(tests/fake_libcuda.py, compiled with the system C compiler) whose
cuLaunchKernel only records its arguments, through the real ``CudaApi`` and
``LoadedKernel``: everything but the driver's own time and the CUDA
allocator. The public functions are timed with their warm path swapped for
these CPU ones; "lse allocated" is ``hot.forward_bhsd`` without lse stocks (a
big lse's path: ``empty_like`` of the host template, on the call's device).
``--cpu-fake --fp8``: an FP8 ``flash_attn_func``'s host path (its warm
path, ``fp8_hot``, on CPU tensors; and with it off) beside a bf16 call's, the
same way; ``--fp8`` on a GPU (sm_90+): the FP8 call's host time, warm and
with its warm path off, beside the bf16 call's. ``--kvcache``: a decoding
``flash_attn_with_kvcache`` call's host time on CPU with the fake driver, warm
(``flash_decode/hot.py``) and with its warm path off (profile_kvcache.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lazytriton import flash, launch, ops, runtime
from lazytriton.driver import fastlaunch
from lazytriton.kernels.flash_fwd import binding, hot, hotpath


def us(fn: Callable[[], object], calls: int = 2000, rounds: int = 15, sync: Callable[[], None] = lambda: None,
       best: bool = False) -> float:
    """Median (``best``: minimum, for a shared, noisy machine) over rounds of the mean µs per call."""
    for _ in range(200):
        fn()
    sync()
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        results.append((time.perf_counter() - start) / calls * 1e6)
    return min(results) if best else statistics.median(results)


def gpu_steps() -> None:
    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = flash.attn_fwd(q, k, v)
    call = binding.check(q, k, v)
    ints, _, _ = binding.pack(q, k, v, out, lse, call)
    kernel, block_m = next(iter(runtime.get().plans.values()))
    grid = binding.grid(call.shape, block_m)
    stream = launch.raw_stream(0)
    floats = binding.floats(call)
    template, device = hot.lse_template(1, 2, 16), hot.device_of(0)  # a warm lse: empty_like(template, device=)
    on_device = torch.empty(1, dtype=torch.float32, device=device).expand(1, 2, 16)
    steps: dict[str, Callable[[], object]] = {
        "full attn_fwd": lambda: flash.attn_fwd(q, k, v),
        "full attn_fwd through the op": lambda: ops.flash_fwd_op(q, k, v, call.scale, call.causal),
        "warm path (hot.forward_bhsd)": lambda: hot.forward_bhsd(q, k, v, False, None),
        "warm path, out only (hot.output_bhsd)": lambda: hot.output_bhsd(q, k, v, False, None),
        "empty_like(q)": lambda: torch.empty_like(q),
        "empty lse (new_empty)": lambda: q.new_empty((1, 2, 16), dtype=torch.float32),
        "empty lse (empty_like of the host template, device=)": lambda: torch.empty_like(template, device=device),
        "empty lse (empty_like of a template on the device)": lambda: torch.empty_like(on_device),
        "runtime.get().plans": lambda: runtime.get().plans,
        "pack": lambda: binding.pack(q, k, v, out, lse, call),
        "raw stream": lambda: launch.raw_stream(0),
        "kernel.launch (what the general path calls)": lambda: kernel.launch(grid, stream, ints, floats),
        "torch.add": lambda: torch.add(q, q),
    }
    cpp = hotpath.module()
    for name, with_cpp in (("Python tail", False), ("C++ tail", cpp)):
        if with_cpp is not None:
            forward = hot.generate("bhsd", "forward", cpp=with_cpp)
            output = hot.generate("bhsd", "output", cpp=with_cpp)
            steps[f"warm path, {name} (forward_bhsd)"] = lambda fn=forward: fn(q, k, v, False, None)
            steps[f"warm path, {name} (output_bhsd)"] = lambda fn=output: fn(q, k, v, False, None)
    if kernel.fast is not None:
        fast = kernel.fast
        steps["kernel.fast (the helper, as the warm path calls it)"] = lambda: fast(
            grid[0], grid[1], grid[2], stream, ints, floats)
    print(f"launch path: {fastlaunch.path_name()}; C++ tail: {'built' if cpp is not None else 'not built'}")
    for name, fn in steps.items():
        print(f"{name:<56} {us(fn, sync=torch.cuda.synchronize):7.2f} µs")


def gpu_fp8_steps() -> None:
    """An FP8 flash_attn_func's host time on the GPU (sm_90+): warm, with its warm path off, and its parts.

    (1, 16, 2, 64) tensors, flash_attn_func's layout, causal; beside the bf16 call's warm path and torch.add.
    """
    from lazytriton.kernels.flash_fwd import fp8, fp8_hot

    bshd = [torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in bshd)
    per_head = torch.ones(1, 2, device="cuda")
    vt = fp8.transposed_v(v8.transpose(1, 2))

    def fp8_call(**descales: Any) -> Callable[[], object]:
        return lambda: flash.flash_attn_func(q8, k8, v8, causal=True, **descales)

    steps: dict[str, Callable[[], object]] = {
        "torch.add": lambda: torch.add(bshd[0], bshd[0]),
        "bf16 flash_attn_func warm": lambda: flash.flash_attn_func(*bshd, causal=True),
        "fp8 flash_attn_func warm, descales (b, hk)": fp8_call(q_descale=per_head, k_descale=per_head,
                                                               v_descale=per_head),
        "fp8 flash_attn_func warm, no descales": fp8_call(),
        "fp8 flash_attn_func warm, out and lse": lambda: flash.flash_attn_func(
            q8, k8, v8, causal=True, q_descale=per_head, return_attn_probs=True),
        "fp8: V's copy alone (copy_)": lambda: vt.copy_(v8.transpose(1, 2).transpose(2, 3)),
    }
    for fn in steps.values():  # plan and describe every call
        fn()
        fn()
    for name, fn in steps.items():
        print(f"{name:<48} {us(fn, sync=torch.cuda.synchronize):7.2f} µs")
    names = ("forward_bhsd", "forward_bshd", "output_bshd")
    saved = [getattr(fp8_hot, name) for name in names]
    for name in names:
        setattr(fp8_hot, name, lambda *args, **kwargs: None)
    try:
        fn = steps["fp8 flash_attn_func warm, descales (b, hk)"]
        print(f"{'fp8 flash_attn_func, warm path off (b, hk)':<48} {us(fn, sync=torch.cuda.synchronize):7.2f} µs")
    finally:
        for name, warm in zip(names, saved, strict=True):
            setattr(fp8_hot, name, warm)


def _fake_kernels(directory: Path) -> dict[str, Any]:
    """flash_fwd's parameter layout loaded on the fake driver, once per launch path."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fake_libcuda import Fake, build
    from test_driver import _entry

    from lazytriton.driver import gpu
    from lazytriton.kernels import get

    library = build(directory)
    if library is None:
        raise SystemExit("--cpu-fake needs a C compiler (cc) for the fake libcuda")
    arg_types = tuple(t for t in get("flash_fwd").signature("bf16").values() if t != "constexpr")
    Fake(library).configure([4 if t in ("i32", "fp32") else 8 for t in arg_types] + [8, 8])  # + 2 hidden
    kernels = {}
    for name, on in (("compiled helper", True), ("cffi ABI mode", False)):
        if on and not fastlaunch.available():
            print("the launch helper is not built (python -m lazytriton.driver.fastlaunch_build): ABI mode only")
            continue
        previous = fastlaunch.enable(on)
        kernels[name] = gpu.CudaApi(str(library)).load(_entry(arg_types), 0)
        fastlaunch.enable(previous)
    if "compiled helper" in kernels:  # the C++ tail launches the helper's plan: the same kernel
        if hotpath.module() is not None:
            kernels[CPP] = kernels["compiled helper"]
        else:
            print("the C++ tail is not built (python -m lazytriton.kernels.flash_fwd.hotpath_build): Python tail only")
    return kernels


CPP = "C++ tail"  # the compiled helper's kernel, the warm path's tail in C++ (kernels/flash_fwd/_hotpath.cpp)


class _Plans:
    def __init__(self, plans: dict[Any, Any]) -> None:
        self.plans = plans


def cpu_fake_rows(rounds: int = 40, calls: int = 500) -> list[tuple[str, str, float, float, float, float]]:
    """(call, launch path, best, q1, median, q3 µs) of each public entry point's warm path, CPU tensors, fake driver.

    The thread's CPU time over ``rounds`` rounds (time the shared machine gives
    other processes is not counted), the rows interleaved within each round (a
    slow spell hits every row); each row's warm functions are swapped into
    ``hot`` before its timed span.
    """
    from lazytriton import interface, sdpa

    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    spare = torch.empty(4096, dtype=torch.float32)
    providers: dict[tuple[str, str], tuple[dict[str, Any], Callable[[], object]]] = {
        ("torch.add", "-"): ({}, lambda: torch.add(q, q))}
    saved = {name: getattr(hot, name) for name in ("forward_bhsd", "forward_bshd", "output_bhsd", "output_bshd")}
    with tempfile.TemporaryDirectory() as tmp:
        for path, kernel in _fake_kernels(Path(tmp)).items():
            plans: dict[Any, Any] = {}
            scope = {"get_runtime": lambda plans=plans: _Plans(plans), "raw_stream": lambda di: 0,
                     "SPARE": {-1: (spare.numel(), spare.data_ptr())}}
            cpp = hotpath.module() if path == CPP else False
            cpu = {f"{r}_{layout}": hot.generate(layout, r, cuda=False, cpp=cpp, **scope)
                   for r in ("forward", "output") for layout in ("bhsd", "bshd")}
            for key_q, key_k in ((q, k), (q.transpose(1, 2), k.transpose(1, 2))):  # fill the memo, both layouts
                call = binding.check(key_q, key_k, key_k)
                out, lse = binding.empty_outputs(key_q, call.shape)
                _, aligned, index64 = binding.pack(key_q, key_k, key_k, out, lse, call)
                plans[binding.memo_key(-1, q.dtype, call.shape, False, aligned, index64)] = (kernel, 64)
            allocated = hot.generate("bhsd", "forward", cuda=False, cpp=cpp, **scope,
                                     lse_stocks=lambda template: None)  # as a big lse's: no stocks
            providers.update({(name, path): (cpu, fn) for name, fn in {
                "hot.forward_bhsd": lambda fn=cpu["forward_bhsd"]: fn(q, k, v, False, None),
                "hot.forward_bhsd, lse allocated": lambda fn=allocated: fn(q, k, v, False, None),
                "hot.output_bhsd": lambda fn=cpu["output_bhsd"]: fn(q, k, v, False, None),
                "attn_fwd": lambda: interface.attn_fwd(q, k, v),
                "flash_attn_func": lambda: interface.flash_attn_func(qb, kb, vb),
                "lazytriton_sdpa": lambda: sdpa.scaled_dot_product_attention(q, k, v),
            }.items()})
        spans: dict[tuple[str, str], list[float]] = {key: [] for key in providers}
        try:
            for round_ in range(rounds + 1):  # round 0 warms up
                for key, (cpu, fn) in providers.items():
                    for name, warm in cpu.items():
                        setattr(hot, name, warm)
                    assert fn() is not None
                    start = time.thread_time()
                    for _ in range(calls):
                        fn()
                    if round_:
                        spans[key].append((time.thread_time() - start) / calls * 1e6)
        finally:
            for name, fn in saved.items():
                setattr(hot, name, fn)
    return [(name, path, min(values), *statistics.quantiles(values, n=4))
            for (name, path), values in spans.items()]


def cpu_fake_fp8_rows(rounds: int = 40, calls: int = 500) -> list[tuple[str, float]]:
    """(call, µs) of FP8 calls' host paths beside bf16 calls', on CPU tensors and the fake driver.

    Public functions: ``flash_attn_func`` warm (FP8: ``fp8_hot``'s warm path, made for CPU tensors; bf16: hot.py's
    ``output_bshd``, with the compiled helper), and the FP8 call with its warm path off (``fp8.checked``, then
    ``fp8.forward`` with ``fp8.launch_gpu`` in place of the interpreter). Binding level: ``fp8.checked``, its
    outputs, the descales' views and ``fp8.launch_gpu`` (V's transpose, ``pack``, the memo lookup, the launch),
    beside the bf16 call's general path (``binding.check``, its outputs, ``binding.launch_gpu``: what a bf16 call
    costs when the warm path declines it), and the copy V's transpose makes alone. Best of ``rounds`` interleaved
    rounds, each row's swaps made before its timed span; (1, 16, 2, 64) tensors, flash_attn_func's layout.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fake_libcuda import Fake, build
    from test_driver import _entry

    from lazytriton import interface
    from lazytriton.driver import gpu
    from lazytriton.kernels import get
    from lazytriton.kernels.flash_fwd import fp8, fp8_hot

    bshd = [torch.randn(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in bshd)  # flash_attn_func's views
    bshd8 = [t.to(torch.float8_e4m3fn) for t in bshd]
    q8, k8, v8 = (t.transpose(1, 2) for t in bshd8)
    one = torch.ones(())
    per_head = torch.ones(1, 2)
    plans: dict[Any, Any] = {}
    warm_names = ("forward_bhsd", "forward_bshd", "output_bshd")
    saved = runtime.get, launch.raw_stream, fp8.run, hot.output_bshd, *(getattr(fp8_hot, n) for n in warm_names)
    spare = torch.empty(4096, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        library = build(Path(tmp))
        if library is None:
            raise SystemExit("--cpu-fake needs a C compiler (cc) for the fake libcuda")
        fake = Fake(library)
        api = gpu.CudaApi(str(library))
        sizes, kernels = {}, {}
        for name, dtype in (("flash_fwd", "bf16"), ("flash_fwd_fp8", "e4m3")):
            arg_types = tuple(t for t in get(name).signature(dtype).values() if t != "constexpr")
            sizes[name] = [4 if t in ("i32", "fp32") else 8 for t in arg_types] + [8, 8]  # + 2 hidden
            fake.configure(sizes[name])
            kernels[name] = api.load(_entry(arg_types), 0)
        call = binding.check(q, k, v, "bottom_right")
        out, lse = binding.empty_outputs(q, call.shape)
        _, aligned, index64 = binding.pack(q, k, v, out, lse, call)
        plans[binding.memo_key(None, q.dtype, call.shape, True, aligned, index64, call.windowed, call.capped,
                               call.mods, call.head_dim_v, call.offset, call.scale, call.sunk,
                               call.chunked)] = (kernels["flash_fwd"], 64)
        plans[binding.memo_key(-1, q.dtype, call.shape, True, aligned, index64)] = (kernels["flash_fwd"], 64)
        call8 = fp8.checked(q8, k8, v8, "bottom_right", None, binding.NAMES, binding.NO_WINDOW, 0.0, 0, (one,) * 3, {})
        out8, lse8 = fp8.empty_outputs(q8, call8.dv)
        scales = fp8.descales((one,) * 3, q8, 1, 2)
        _, aligned, index64 = fp8.pack(q8, k8, fp8.transposed_v(v8), out8, lse8, call8, scales)
        plans[fp8.memo_key(None, call8, call8.shape, aligned, index64, dtype="e4m3")] = (kernels["flash_fwd_fp8"], 64,
                                                                                        False)
        def get_plans() -> _Plans:
            return _Plans(plans)

        spares = {-1: (spare.numel(), spare.data_ptr())}
        warm8 = {name: fp8_hot.make(*name.split("_")[::-1], cuda=False, get_runtime=get_plans,
                                    raw_stream=lambda di: 0, spare=spares) for name in warm_names}
        warm16 = hot.generate("bshd", "output", cuda=False, cpp=False, get_runtime=get_plans,
                              raw_stream=lambda di: 0, SPARE=spares)

        def bf16() -> None:
            c = binding.check(q, k, v, "bottom_right")
            binding.launch_gpu(q, k, v, *binding.empty_outputs(q, c.shape), c)

        def fp8_call(given: tuple[Any, Any, Any]) -> None:
            c = fp8.checked(q8, k8, v8, "bottom_right", None, binding.NAMES, binding.NO_WINDOW, 0.0, 0, given, {})
            fp8.launch_gpu(q8, k8, v8, *fp8.empty_outputs(q8, c.dv), c, fp8.descales(given, q8, 1, 2), c.shape)

        def public(**descales: Any) -> Callable[[], object]:
            return lambda: interface.flash_attn_func(*bshd8, causal=True, **descales)

        warm_off = {**{name: lambda *args: None for name in warm_names}, "run": fp8.launch_gpu}
        providers: dict[str, tuple[str, dict[str, Any], Callable[[], object]]] = {
            "torch.add": ("flash_fwd", {}, lambda: torch.add(q, q)),
            "bf16 flash_attn_func warm": ("flash_fwd", {}, lambda: interface.flash_attn_func(*bshd, causal=True)),
            "fp8 flash_attn_func warm, descales (1,)": ("flash_fwd_fp8", {}, public(
                q_descale=one, k_descale=one, v_descale=one)),
            "fp8 flash_attn_func warm, descales (b, hk)": ("flash_fwd_fp8", {}, public(
                q_descale=per_head, k_descale=per_head, v_descale=per_head)),
            "fp8 flash_attn_func warm, no descales": ("flash_fwd_fp8", {}, public()),
            "fp8 flash_attn_func, warm path off": ("flash_fwd_fp8", warm_off, public(
                q_descale=one, k_descale=one, v_descale=one)),
            "bf16 general path": ("flash_fwd", {}, bf16),
            "fp8 general path, descales": ("flash_fwd_fp8", {}, lambda: fp8_call((one, one, one))),
            "fp8 general path, no descales": ("flash_fwd_fp8", {}, lambda: fp8_call((None, None, None))),
            "fp8: V's transpose alone": ("flash_fwd_fp8", {}, lambda: fp8.transposed_v(v8)),
        }
        best = dict.fromkeys(providers, math.inf)
        runtime.get, launch.raw_stream = get_plans, (lambda device_index: 0)  # type: ignore
        hot.output_bshd = warm16
        try:
            for round_ in range(rounds + 1):  # round 0 warms up (and describes the warm paths' shapes)
                for name, (kernel, swaps, fn) in providers.items():
                    fake.configure(sizes[kernel])
                    for warm_name in warm_names:
                        setattr(fp8_hot, warm_name, swaps.get(warm_name, warm8[warm_name]))
                    fp8.run = swaps.get("run", fp8.launch_gpu)
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    if round_:
                        best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
        finally:
            runtime.get, launch.raw_stream, fp8.run, hot.output_bshd = saved[:4]  # type: ignore[assignment]
            for name, fn in zip(warm_names, saved[4:], strict=True):
                setattr(fp8_hot, name, fn)
    return list(best.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-fake", action="store_true", help="time the warm path on CPU with a fake driver")
    parser.add_argument("--fp8", action="store_true", help="an FP8 call's host path beside a bf16 call's")
    parser.add_argument("--kvcache", action="store_true", help="a decoding call's host path, warm and off (CPU, "
                        "fake driver)")
    args = parser.parse_args()
    if args.kvcache:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import profile_kvcache

        return profile_kvcache.main()
    if args.fp8 and not args.cpu_fake:
        if not torch.cuda.is_available():
            print("profile_hot --fp8 needs a CUDA GPU (or --cpu-fake)", file=sys.stderr)
            return 2
        gpu_fp8_steps()
        return 0
    if args.fp8:
        rows8 = cpu_fake_fp8_rows()
        print(f"{'call':<44} {'µs':>7}  vs torch.add (CPU tensors, fake driver, {fastlaunch.path_name()})")
        for name, value in rows8:
            print(f"{name:<44} {value:7.2f}  {value / rows8[0][1]:5.2f}x")
        return 0
    if not args.cpu_fake:
        if not torch.cuda.is_available():
            print("profile_hot needs a CUDA GPU (or --cpu-fake)", file=sys.stderr)
            return 2
        gpu_steps()
        return 0
    rows = cpu_fake_rows()
    add = rows[0][2]
    print(f"{'call':<32} {'launch path':<16} {'best µs':>7}  vs torch.add  {'q1':>5} {'median':>6} {'q3':>5}  "
          "(thread CPU; CPU tensors, fake driver)")
    for name, path, best, q1, median, q3 in rows:
        print(f"{name:<32} {path:<16} {best:7.2f}  {best / add:5.2f}x       {q1:5.2f} {median:6.2f} {q3:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
