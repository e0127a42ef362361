"""lazytriton.cli.timing on the CPU path: medians, and the turns that interleaved_ms takes."""

from __future__ import annotations

import pytest

from lazytriton.cli.timing import interleaved_ms, median_ms


def test_interleaved_ms_runs_one_call_of_each_a_round_after_each_ones_warmup() -> None:
    calls: list[str] = []
    times = interleaved_ms([lambda: calls.append("a"), lambda: calls.append("b"), lambda: calls.append("c")],
                           on_gpu=False, warmup=2, reps=3)
    assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] * 3
    assert len(times) == 3 and all(t >= 0.0 for t in times)


def test_interleaved_ms_gives_each_its_own_median(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake clock advances by each call's own cost: the medians come back in the functions' order."""
    import time

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def cost(seconds: float):
        def fn() -> None:
            now[0] += seconds
        return fn

    assert interleaved_ms([cost(0.002), cost(0.005)], on_gpu=False, warmup=0, reps=5) == pytest.approx([2.0, 5.0])
    assert median_ms(cost(0.003), on_gpu=False, warmup=0, reps=3) == pytest.approx(3.0)


def test_interleaved_ms_of_nothing_is_nothing() -> None:
    assert interleaved_ms([], on_gpu=False, reps=4) == []
