"""GPU timing shared by ``lazytriton tune`` and the benchmarks: medians of CUDA-event-timed runs.

METHOD.md's rules: warm up first, time each run with a pair of CUDA events on
the current stream (the device kept busy while the host enqueues the run, so
the pair holds device time only), wait for the end event, and report the
median (robust to the host's noise). Imports torch only when called.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

# The device spins this many cycles before each timed call (about 1 ms at the H200's 1.98 GHz, more at lower
# clocks), so the host enqueues the start event, the call's launches and the end event while it is busy, and the
# events hold the call's device time alone. Without it the device idles from the previous sync until the call's
# first launch, and the pair holds the host's time to get there as well: H200, 12-02 (probe_bwd_timing.py), a 1k
# backward's cuDNN time 0.96 ms timed so against 0.74 queued back to back (autograd and cuDNN's plan: 0.16-0.35 ms of
# host a call), lazytriton's 1.10 against 1.03.
LEAD_CYCLES = 2_000_000


def one_event_ms(fn: Callable[[], object], lead: bool = True) -> float:
    """One call of ``fn`` between a pair of CUDA events on the current stream, in ms (waits for the end event).

    ``lead``: the device spins ``LEAD_CYCLES`` before the start event, so
    the host's time to enqueue the call is not in the pair (False: the
    device idles until the call's first launch, which the pair then holds).
    """
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if lead:
        torch.cuda._sleep(LEAD_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def _one_wall_ms(fn: Callable[[], object]) -> float:
    """One call of ``fn`` by the wall clock, in ms."""
    import time

    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3


def event_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median time of ``fn()`` on the GPU in ms, over ``reps`` event-timed runs after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(one_event_ms(fn) for _ in range(reps))


def median_ms(fn: Callable[[], object], on_gpu: bool, warmup: int = 3, reps: int = 20) -> float:
    """``event_ms`` on a GPU; on the CPU (the benchmarks' smoke runs) the median of wall-clock runs in ms."""
    if on_gpu:
        return event_ms(fn, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    return statistics.median(_one_wall_ms(fn) for _ in range(reps))


def interleaved_ms(fns: Sequence[Callable[[], object]], on_gpu: bool, warmup: int = 3,
                   reps: int = 20) -> list[float]:
    """Each of ``fns``' median time in ms, timed in turns: each round runs every one of them once, in order.

    A ratio between two of them then holds while the GPU's clock moves
    during a run: a slow stretch falls on all of them alike, where one
    function's whole series after the other's can fall in or out of it (H200,
    12-02: the same 1k backward case's cuDNN time moved 10-15% between two
    runs of the grid, one provider's series after the other's). Each call is
    timed as ``event_ms`` times it on a GPU, by the wall clock on the CPU.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    if on_gpu:
        import torch

        torch.cuda.synchronize()
    one = one_event_ms if on_gpu else _one_wall_ms
    for _ in range(reps):
        for fn, series in zip(fns, times, strict=True):
            series.append(one(fn))
    return [statistics.median(series) for series in times]
