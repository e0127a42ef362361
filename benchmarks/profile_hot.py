"""Host cost of each step of a warm attn_fwd call on a tiny shape (µs per call, best of 3 x 5000 calls)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lazytriton import flash, runtime


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
    shape, _, scale = flash._validate(q, k, v, False, None)
    args, _, _ = flash._kernel_args(q, k, v, out, lse, shape, 0)
    kernel, block_m = next(iter(runtime.get().plans.values()))
    grid = flash.flash_grid(16, 2, 1, block_m)
    stream = flash._raw_stream(0)
    api = kernel._api
    buffers = kernel._tls.b
    steps = {
        "full attn_fwd": lambda: flash.attn_fwd(q, k, v),
        "validate": lambda: flash._validate(q, k, v, False, None),
        "empty_like(q)": lambda: torch.empty_like(q),
        "empty lse": lambda: torch.empty((1, 2, 16), dtype=torch.float32, device=q.device),
        "empty lse (new_empty)": lambda: q.new_empty((1, 2, 16), dtype=torch.float32),
        "empty lse (device index)": lambda: torch.empty((1, 2, 16), dtype=torch.float32, device=0),
        "empty lse (empty_like)": lambda: torch.empty_like(lse),
        "kernel_args": lambda: flash._kernel_args(q, k, v, out, lse, shape, 0),
        "raw stream": lambda: flash._raw_stream(0),
        "launch (fill + ctx check + cuLaunchKernel)": lambda: kernel.launch(grid, stream, args, (scale,)),
        "api.launch only (ctx check + cuLaunchKernel)": lambda: api.launch(kernel, grid, stream, buffers),
        "bare cuLaunchKernel (cffi)": lambda: api._launch(kernel.function, grid[0], grid[1], grid[2], kernel.block,
                                                           1, 1, kernel.shared, stream, buffers.params, api.ffi.NULL),
        "cuCtxGetCurrent": lambda: api._ctx_get(buffers.aux),
        "torch.add": lambda: torch.add(q, q),
    }
    for name, fn in steps.items():
        print(f"{name:<48} {us(fn):7.2f} µs")


if __name__ == "__main__":
    main()
