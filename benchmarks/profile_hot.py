"""Host cost of each step of a warm attn_fwd call on a tiny shape (µs per call, best of 3 x 5000 calls)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lazytriton import flash, ops, runtime
from lazytriton.kernels.flash_fwd import binding, hot


def us(fn: Callable[[], object], calls: int = 5000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = flash.attn_fwd(q, k, v)
    call = binding.check(q, k, v)
    ints, _, _ = binding.pack(q, k, v, out, lse, call)
    kernel, block_m = next(iter(runtime.get().plans.values()))
    grid = binding.grid(call.shape, block_m)
    stream = binding.raw_stream(0)
    steps = {
        "full attn_fwd": lambda: flash.attn_fwd(q, k, v),
        "full attn_fwd through the op": lambda: ops.flash_fwd_op(q, k, v, call.scale, call.causal),
        "check": lambda: binding.check(q, k, v),
        "empty_outputs": lambda: binding.empty_outputs(q, call.shape),
        "empty_like(q)": lambda: torch.empty_like(q),
        "empty lse": lambda: torch.empty((1, 2, 16), dtype=torch.float32, device=q.device),
        "empty lse (device index)": lambda: torch.empty((1, 2, 16), dtype=torch.float32, device=0),
        "empty lse (new_empty)": lambda: q.new_empty((1, 2, 16), dtype=torch.float32),
        "warm path (hot.forward_bhsd)": lambda: hot.forward_bhsd(q, k, v, False, None),
        "runtime.get().plans": lambda: runtime.get().plans,
        "pack": lambda: binding.pack(q, k, v, out, lse, call),
        "memo key": lambda: binding.memo_key(0, q.dtype, call.shape, False, True, False),
        "raw stream": lambda: binding.raw_stream(0),
        "launch (fill + ctx check + cuLaunchKernel)": lambda: kernel.launch(grid, stream, ints, binding.floats(call)),
        "launch_gpu (pack + memo + launch)": lambda: binding.launch_gpu(q, k, v, out, lse, call),
        "torch.add": lambda: torch.add(q, q),
    }
    for name, fn in steps.items():
        print(f"{name:<48} {us(fn):7.2f} µs")


if __name__ == "__main__":
    main()
