"""benchmarks/bench_flash_fwd.py on CPU: its providers timed in turns, and one failing while timed.

The benchmark itself needs a CUDA GPU; ``_turns`` is what decides which time
each provider gets, so it is pinned here with the timers replaced.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import ModuleType

import pytest
from benchlib import bench_module
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_flash_fwd.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    yield bench_module(monkeypatch, BENCH)


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


def test_the_grid_flags_select_cases_and_providers(bench: ModuleType) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_grid_arguments(parser, bench.FWD_PROVIDERS)
    args = bench.parse_grid(parser, ["--head-dims", "96,192", "--seqlens", "1k", "--causal", "causal",
                                     "--dtypes", "fp16", "--providers", "sdpa_cudnn,lazytriton"])
    assert [(c.dtype, c.head_dim, c.causal, c.seqlen, c.batch, c.heads) for c in bench.grid_of(args)] == [
        ("fp16", 96, True, 1024, 16, 21), ("fp16", 192, True, 1024, 16, 10)]
    assert args.providers == ["sdpa_cudnn", "lazytriton"]
    assert bench.parse_grid(parser, ["--quick"]).seqlens == [1024, 4096]


@pytest.mark.parametrize("argv", [["--providers", "sdpa_math"], ["--seqlens", "4q"], ["--head-dims", "0"]])
def test_bad_flags_are_refused_by_name(bench: ModuleType, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err
