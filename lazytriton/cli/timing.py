"""GPU timing shared by ``lazytriton tune`` and the benchmarks: medians of CUDA-event-timed runs.

METHOD.md's rules: warm up first, time each run with a pair of CUDA events on
the current stream, wait for the end event, and report the median (robust to
the host's noise). Imports torch only when called.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def event_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median time of ``fn()`` on the GPU in ms, over ``reps`` event-timed runs after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_ms(fn: Callable[[], object], on_gpu: bool, warmup: int = 3, reps: int = 20) -> float:
    """``event_ms`` on a GPU; on the CPU (the benchmarks' smoke runs) the median of wall-clock runs in ms."""
    import time

    if on_gpu:
        return event_ms(fn, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)
