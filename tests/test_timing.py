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


def test_a_timed_gpu_call_starts_after_the_device_is_given_work_to_spin_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lead (``torch.cuda._sleep``) is enqueued before the start event, the call between the events: the
    host's time to enqueue the call falls inside the spin, not between the events (fake CUDA, order only)."""
    import torch

    from lazytriton.cli import timing

    order: list[str] = []
    made: list[str] = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.name = ("start", "end")[len(made) % 2]
            made.append(self.name)

        def record(self) -> None:
            order.append(f"{self.name} recorded")

        def synchronize(self) -> None:
            order.append(f"{self.name} waited")

        def elapsed_time(self, other: FakeEvent) -> float:
            return 1.5

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append(f"spin {cycles}"))
    assert timing.one_event_ms(lambda: order.append("call")) == 1.5
    assert order == [f"spin {timing.LEAD_CYCLES}", "start recorded", "call", "end recorded", "end waited"]
    order.clear()
    assert timing.one_event_ms(lambda: order.append("call"), lead=False) == 1.5
    assert order == ["start recorded", "call", "end recorded", "end waited"]
