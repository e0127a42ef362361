"""benchmarks/bench_flash_fwd.py on CPU: its providers timed in turns, and one failing while timed.

The benchmark itself needs a CUDA GPU; ``_turns`` is what decides which time
each provider gets, so it is pinned here with the timers replaced.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import ModuleType

import pytest
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_flash_fwd.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    import importlib

    monkeypatch.syspath_prepend(str(BENCH.parent))
    yield importlib.import_module("bench_flash_fwd")


def test_a_cases_providers_are_timed_together_in_turns(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def turns(fns, on_gpu, warmup, reps):
        seen.append((len(fns), on_gpu, warmup, reps))
        return [float(i + 1) for i in range(len(fns))]

    monkeypatch.setattr(bench, "interleaved_ms", turns)
    names, times = bench._turns({"lazytriton": lambda: None, "sdpa_cudnn": lambda: None})
    assert names == ["lazytriton", "sdpa_cudnn"] and times == [1.0, 2.0]
    assert seen == [(2, True, 5, 30)]


def test_a_provider_failing_while_timed_leaves_the_others_timed_alone(bench: ModuleType,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def turns(fns, on_gpu, warmup, reps):
        raise RuntimeError("CUDA error: an illegal memory access")

    def alone(fn, warmup=5, reps=30):
        return fn()

    def broken():
        raise RuntimeError("backend missing")

    monkeypatch.setattr(bench, "interleaved_ms", turns)
    monkeypatch.setattr(bench, "time_ms", alone)
    names, times = bench._turns({"a": lambda: 0.5, "broken": broken, "c": lambda: 0.25})
    assert names == ["a", "broken", "c"]
    assert times[0] == 0.5 and math.isnan(times[1]) and times[2] == 0.25
