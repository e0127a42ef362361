"""``lazytriton tune --kernel flash_decode``: the pure parts on CPU (an injected timer), the split heuristic's inputs.

The GPU timing itself (``tune_decode.gpu_timer``) runs on the GPU host; here
the candidates, the sweeps, the choice over a bucket's cases, the rows and
dispatch's reading of them, and the binding's forced launch (with a fake
runtime) are checked with made-up inputs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lazytriton import machine, tuning
from lazytriton.cli import tune
from lazytriton.cli.tune import common
from lazytriton.cli.tune import flash_decode as tune_decode
from lazytriton.cli.tune.flash_decode import COMBINE, SPLIT, Case
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

SM90 = Target.parse("sm_90")
SLOTS = 132 * binding.PROGRAMS_PER_SM  # an H200


def cases(lengths: tuple[int, ...] = (4096,), batches: tuple[int, ...] = (1, 8, 32, 64)) -> list[Case]:
    return tune_decode.grid("bf16", 128, [(32, 8)], batches, lengths, ["contiguous", "paged"])


# ---------------------------------------------------------------------------
# The split heuristic's inputs


def test_the_heuristic_fills_two_programs_per_sm_with_splits_of_flash_attention_2s_size() -> None:
    def call(batch: int, length: int, head_dim: int = 128) -> checks.Call:
        return checks.Call(batch, 32, 8, 1, head_dim, 0, length, 0, batch, length, False, 0.1)

    gpu = lambda c: binding.splits_for(c, 16, 64, SLOTS, binding.min_split_keys(c.head_dim))  # noqa: E731
    assert gpu(call(16, 32768)) == 2, "128 programs filled 1 of 2 slots a SM: now split in 2"
    assert gpu(call(32, 32768)) == 1, "256 programs fill the slots"
    assert gpu(call(1, 1024)) == 8, "1k keys at head dim 128: splits of at least 128 keys"
    assert gpu(call(1, 1024, 64)) == 8, "head dim 64: at least 128 keys too"
    assert gpu(call(1, 32768)) > 8
    assert [binding.min_split_keys(d) for d in (32, 64, 96, 128, 256)] == [128, 128, 128, 128, 64]
    # The interpreter keeps one BLOCK_N a split (min_keys 0), so its small caches still run the combine kernel.
    mqa = checks.Call(1, 4, 1, 1, 128, 0, 64, 0, 1, 64, False, 0.1)
    assert binding.splits_for(mqa, 16, 16, binding.INTERPRETER_SMS) == 4
    # A forced count is what it says, whatever the heuristic's inputs.
    assert binding.splits_for(call(1, 1024)._replace(num_splits=3), 16, 64, SLOTS, 128) == 3


def test_the_slots_count_what_the_split_kernels_shared_memory_lets_one_sm_hold() -> None:
    h100 = 233472  # bytes of shared memory an H100 SM has
    assert binding.programs_per_sm(0, h100) == binding.programs_per_sm(98304, 0) == binding.PROGRAMS_PER_SM
    assert binding.programs_per_sm(98304, h100) == 2, "the default tiles: 64 keys x 3 stages, ~96 KB"
    assert binding.programs_per_sm(197632, h100) == 1, "128 keys x 3 stages: one a SM"
    assert binding.programs_per_sm(300000, h100) == 1, "never fewer than one"
    assert binding.programs_per_sm(16384, 65536) == 2 and binding.programs_per_sm(40000, 65536) == 1  # a CU's LDS
    call = checks.Call(1, 32, 8, 1, 128, 0, 16384, 0, 1, 16384, False, 0.1)  # batch 1, 16k keys, 8 kv heads
    two, one = (binding.splits_for(call, 16, 128, 132 * n, binding.min_split_keys(128)) for n in (2, 1))
    assert (two, one) == (32, 15), "one program a SM: about half the splits, each twice the keys"


def test_head_dim_64_reads_tiles_as_wide_in_bytes_as_head_dim_128() -> None:
    wide = decode_dispatch.decode_default_config(SPLIT, SM90, "bf16", 64, 4)
    assert (wide.block_m, wide.block_n) == (16, 128)
    # Paged: 64 keys, so the one default binary prewarm plans serves every page size that is a multiple of 64.
    assert decode_dispatch.decode_default_config(SPLIT, SM90, "bf16", 64, 4, 256, paged=True).block_n == 64
    assert decode_dispatch.decode_default_config(SPLIT, SM90, "fp32", 64, 4).block_n == 32


# ---------------------------------------------------------------------------
# Candidates and sweeps


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "sm_86", "gfx942"])
def test_candidates_start_with_the_default_and_fit(target: str) -> None:
    t = Target.parse(target)
    for kernel in decode_dispatch.DECODE_KERNELS:
        for dtype in ("bf16", "fp32"):
            for head_dim in (64, 128, 256):
                for rows in (1, 4, 32, 64):
                    configs = tune_decode.candidates(kernel, t, dtype, head_dim, rows)
                    assert configs[0] == decode_dispatch.decode_default_config(kernel, t, dtype, head_dim, rows)
                    assert len(set(configs)) == len(configs) > (5 if dtype == "bf16" and head_dim < 256 else 0)
                    if kernel == SPLIT:
                        row_class = decode_dispatch.decode_rows_class(rows)
                        assert {c.block_m for c in configs} == {m for m in (16, 32, 64) if m <= row_class}
                        assert all(c.num_warps > 1 for c in configs)  # one warp lost at every batch-1 shape
                        if head_dim == 256 or dtype == "fp32":
                            assert all(c.block_n <= 64 for c in configs)
                    if t.backend == "hip":
                        assert all(c.num_stages <= 2 and c.waves_per_eu == 2 for c in configs)
    big = [c for c in tune_decode.candidates(SPLIT, Target.parse("sm_86"), "bf16", 128, 4) if c.block_n == 256]
    assert all(c.num_stages <= 2 for c in big), "99 KiB of shared memory: 256-key tiles at 2 stages at most"
    with pytest.raises(ValueError, match="kernel must be one of"):
        tune_decode.candidates("flash_fwd", SM90, "bf16", 128, 4)


def test_sweeps_line_up_candidates_across_cases_and_cut_paged_tiles_to_the_page() -> None:
    grid = tune_decode.grid("bf16", 128, [(32, 8)], [1, 64], [4096], ["contiguous", "paged"], page_size=64)
    sweeps = tune_decode.sweep_variants(SM90, grid, table=tuning.Table(()))
    contiguous, paged = grid[0], grid[2]
    assert paged.paged and not contiguous.paged
    for kernel in decode_dispatch.DECODE_KERNELS:
        lists = [sweeps[kernel][c] for c in grid]
        assert len({len(x) for x in lists}) == 1
        assert sweeps[kernel][contiguous][0] == tune_decode.variant_for(kernel, SM90, contiguous, None,
                                                                         tuning.Table(()))
    for a, b in zip(sweeps[SPLIT][contiguous], sweeps[SPLIT][paged], strict=True):
        assert b.get("PAGED") is True and b.get("BLOCK_N") == min(a.get("BLOCK_N"), 64)
        assert (a.get("num_warps"), a.get("num_stages")) == (b.get("num_warps"), b.get("num_stages"))
    paged_default = tune_decode.variant_for(SPLIT, SM90, paged, None, tuning.Table(()))
    assert paged_default in sweeps[SPLIT][paged], "the paged default (5 stages) is a candidate too"
    assert sweeps[COMBINE][contiguous] == sweeps[COMBINE][paged], "the combine kernel does not see the layout"


def test_grid_buckets_and_the_bench_grid() -> None:
    grid = tune_decode.grid("bf16", 128, [(32, 8), (32, 32)], [1, 8, 32, 64], [1024, 4096, 16384, 32768],
                            ["contiguous", "paged"])
    assert len(grid) == 2 * 4 * 2 * 4
    groups = tune_decode.by_bucket(grid)
    assert set(groups) == {(r, n) for r in (4, 1) for n in (1024, 4096, 16384, 32768)}
    assert all(len(v) == 8 for v in groups.values())
    odd = Case("paged", 2, 1000, 32, 8, 128, "bf16", 256)
    assert odd.capacity == 1024 and odd.bucket == (4, 1024)
    assert odd.bytes == 2 * 2 * 128 * (2 * 1000 * 8 + 2 * 32)


def test_case_splits_is_the_calls_split_count() -> None:
    small, big = Case("contiguous", 1, 4096, 32, 8, 128, "bf16"), Case("paged", 64, 4096, 32, 8, 128, "bf16")
    assert tune_decode.case_splits(big, 16, 64, SLOTS) == 1
    assert tune_decode.case_splits(small, 16, 64, SLOTS) > 1
    call = checks.Call(1, 32, 8, 1, 128, 0, 4096, 0, 1, 4096, False, 0.1)
    assert tune_decode.case_splits(small, 16, 64, SLOTS) == binding.splits_for(call, 16, 64, SLOTS, 128)


# ---------------------------------------------------------------------------
# Choosing over a bucket


def test_score_is_the_worst_and_the_geometric_mean_over_each_cases_best() -> None:
    # candidate 0: 1x and 4x the best; candidate 1: 2x and 2x; candidate 2 failed a case
    scores = common.score([[1.0, 4.0], [2.0, 1.0], [None, 0.5]])
    assert scores[0] == (pytest.approx(8.0), pytest.approx(math.sqrt(1 * 8)))
    assert scores[1] == (pytest.approx(2.0), pytest.approx(2.0))
    assert scores[2] is None
    assert common.score([]) == []


def test_the_winner_loses_least_on_its_worst_case_then_on_the_geometric_mean() -> None:
    # a tile 3% faster on three large batches but 12% slower at batch 1 loses to the even one
    times = [[1.12, 1.0, 1.0, 1.0], [1.0, 1.03, 1.03, 1.03]]
    assert common.pick(common.score(times)) == 1
    # worst ratios within WORST_SLACK tie, and the geometric mean decides
    times = [[1.01, 1.0, 1.0, 1.0], [1.0, 1.015, 1.015, 1.015]]
    assert common.pick(common.score(times)) == 0
    assert common.pick([None, None]) is None and common.pick([]) is None


def _costs(sweeps: dict[str, dict[Case, list[Variant]]], grid: list[Case]) -> dict[tuple[str, Case], float]:
    """Made-up ms: later candidates are faster on every case, except candidate 2: by far the fastest at batch 1
    and by farther the slowest elsewhere; later combine candidates are faster too."""
    cost = {}
    for kernel, per_case in sweeps.items():
        for case in grid:
            for i, v in enumerate(per_case[case]):
                ms = 2.0 - i / 20 if kernel == SPLIT else 0.01 * (len(per_case[case]) - i)
                if kernel == SPLIT and i == 2:
                    ms = 0.1 if case.batch == 1 else 50.0
                cost[(str(v), case)] = ms
    return cost


def test_tune_bucket_takes_the_best_on_every_case_then_the_combine_on_the_cases_that_split() -> None:
    grid = cases()
    sweeps = tune_decode.sweep_variants(SM90, grid, table=tuning.Table(()))
    cost = _costs(sweeps, grid)
    n = len(sweeps[SPLIT][grid[0]])
    wrong = sweeps[SPLIT][grid[0]][-1]  # the fastest: wrong on one case
    failed = sweeps[SPLIT][grid[0]][-2]  # did not compile (the contiguous cases' variant)
    calls: list[tuple[Case, Variant, Variant]] = []

    def timer(case: Case, split: Variant, combine: Variant) -> tuple[float, float]:
        calls.append((case, split, combine))
        return cost[(str(split), case)] + cost[(str(combine), case)], 0.5 if split == wrong else 1e-3

    won = tune_decode.tune_bucket(grid, sweeps, timer, SLOTS, frozenset({str(failed)}))
    assert won is not None
    # Candidate 2 is 12x faster at batch 1 but 40x slower elsewhere: its worst case loses, and the next fastest
    # wins (the fastest failed or was wrong).
    assert all(won.split[c] == sweeps[SPLIT][c][n - 3] for c in grid)
    splitting = [c for c in grid if tune_decode.case_splits(c, 16, int(won.split[c].get("BLOCK_N")), SLOTS) > 1]
    assert splitting and len(splitting) < len(grid)
    split_calls = len(grid) * n - 4  # the failed variant is not timed on the 4 contiguous cases
    assert all(comb == sweeps[COMBINE][c][0] for c, _, comb in calls[:split_calls]), \
        "the split sweep holds the combine kernel at dispatch's choice"
    assert [c for c, _, _ in calls[:n - 1]] == [grid[0]] * (n - 1), "cases outermost: one case's tensors at a time"
    combine_calls = calls[split_calls:]
    assert {c for c, _, _ in combine_calls} == set(splitting), "the combine is timed only where the call splits"
    assert all(s == won.split[c] for c, s, _ in combine_calls), "with the split kernel at its winner"
    assert won.combine_tuned and all(won.combine[c] == sweeps[COMBINE][c][-1] for c in grid)

    none = tune_decode.tune_bucket(grid, sweeps, lambda c, s, m: (1.0, 1.0), SLOTS)
    assert none is None, "no candidate correct on every case: no row"

    # A candidate that fails to launch (more shared memory than the estimate) is skipped, not fatal.
    from lazytriton.driver.gpu import DriverError

    def refusing(case: Case, split: Variant, combine: Variant) -> tuple[float, float]:
        if split == sweeps[SPLIT][case][n - 3]:
            raise DriverError("cuLaunchKernel: too many resources requested for launch")
        return timer(case, split, combine)

    won = tune_decode.tune_bucket(grid, sweeps, refusing, SLOTS, frozenset({str(failed)}))
    assert won is not None and all(won.split[c] == sweeps[SPLIT][c][n - 4] for c in grid)


def test_rows_make_dispatch_pick_the_winners(tmp_path: Path) -> None:
    grid = cases()
    sweeps = tune_decode.sweep_variants(SM90, grid, table=tuning.Table(()))
    cost = _costs(sweeps, grid)
    won = tune_decode.tune_bucket(grid, sweeps, lambda c, s, m: (cost[(str(s), c)] + cost[(str(m), c)], 0.0),
                                  SLOTS)
    assert won is not None
    rows = tune_decode.rows_for(won, grid, "test GPU", "2026-11-30")
    assert [r.kernel for r in rows] == [SPLIT, COMBINE]
    assert all((r.seqlen_q, r.seqlen_k, r.causal, r.head_dim) == (4, 4096, False, 128) for r in rows)
    assert all(r.tflops > 0 and r.gpu == "test GPU" for r in rows)
    path = tmp_path / "flash_decode.csv"
    common.save_rows(path, rows)
    table = tuning.Table.parse(path.read_text())
    for case in grid:  # a call in the bucket (another batch, a length in the same bucket) runs the winners
        call_case = case._replace(batch=3, cache_len=3000)
        for kernel, winners in ((SPLIT, won.split), (COMBINE, won.combine)):
            chosen = tune_decode.variant_for(kernel, SM90, call_case, None, table)
            assert chosen == winners[case], (kernel, case)


def test_tune_group_compiles_once_and_rows_each_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[Variant] = []

    def compile_all(variants: list[Variant], jobs: int) -> dict[str, str]:
        compiled.extend(variants)
        return {}

    monkeypatch.setattr(common, "compile_all", compile_all)
    monkeypatch.setattr(tune_decode, "gpu_timer",
                        lambda reps: lambda c, s, m: (1.0 + s.get("BLOCK_N") / 1000 + m.get("BLOCK_M") / 1e4, 0.0))
    grid = cases(lengths=(1024, 32768))
    rows = tune_decode.tune_group(SM90, "bf16", 128, grid, 1, 1, "fake GPU", SLOTS)
    assert len(compiled) == len(set(compiled)), "each variant compiled once"
    assert {(r.kernel, r.seqlen_k) for r in rows} == {(k, n) for k in (SPLIT, COMBINE) for n in (1024, 32768)}
    assert all(r.BLOCK_N == 32 for r in rows if r.kernel == SPLIT), "the made-up timer favours narrow tiles"


def test_tune_command_line_for_flash_decode(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert tune.families_of(decode_dispatch.DECODE_KERNELS) == {"flash_decode": decode_dispatch.DECODE_KERNELS}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--kernel", "flash_decode", "--heads", "32/8,64/8", "--lengths", "1k,32k"]) == 1  # no GPU
    for bad in (["--heads", "32/5"], ["--lengths", "0"], ["--layouts", "ragged"], ["--page-size", "0"]):
        with pytest.raises(SystemExit):
            tune.main(["--kernel", "flash_decode", *bad])
    assert "--heads items must look like 32/8" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one config, nothing to tune: refused before any compile
        tune.main(["--kernel", "flash_decode,kv_append"])
    assert "kv_append has no tiles to tune" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# The binding's forced launch (a fake runtime: no GPU here)


class _Kernel:
    def __init__(self, name: str, log: list[tuple[str, Any, Any]]) -> None:
        self.name, self.log = name, log

    def launch(self, grid: Any, stream: Any, ints: Any, floats: Any, alloc: Any) -> None:
        self.log.append((self.name, grid, ints))


def test_forced_variants_launch_as_a_call_with_the_heuristics_split_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton import launch, runtime

    log: list[tuple[str, Any, Any]] = []

    class FakeRuntime:
        def kernel(self, variant: Variant, device: int) -> _Kernel:
            return _Kernel(str(variant), log)

    monkeypatch.setattr(runtime, "get", lambda: FakeRuntime())
    monkeypatch.setattr(binding, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch, "raw_stream", lambda device: 0)
    case = Case("contiguous", 1, 4096, 32, 8, 128, "bf16")
    q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    kc = torch.zeros(1, 4096, 8, 128, dtype=torch.bfloat16)
    t = checks.Inputs(q, kc, kc.clone())
    call = checks.check(t)
    out, lse = binding.empty_outputs(q, call)
    split = tune_decode.variant_for(SPLIT, SM90, case, Config(16, 128, 4, 3))
    combine = tune_decode.variant_for(COMBINE, SM90, case, Config(32, 16, 4, 1))
    binding.launch_gpu(t, out, lse, call, forced=(split, combine))
    splits = tune_decode.case_splits(case, 16, 128, SLOTS)
    assert splits > 1
    assert [name for name, _, _ in log] == [str(split), str(combine)]
    assert log[0][1] == binding.split_grid(call.rows, 16, splits, 8, 1)
    assert log[1][1] == binding.combine_grid(32, 32), "the combine grid from the forced variant's BLOCK_M"


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_tuners_inputs_and_reference_agree_with_the_kernels(layout: str) -> None:
    # What gpu_timer checks each candidate against, on the CPU: the interpreter's output is within MAX_ERROR.
    case = Case(layout, 2, 40, 4, 2, 32, "fp32", page_size=16)
    inputs = tune_decode.make_inputs(case, device="cpu")
    t, call = inputs["t"], inputs["call"]
    assert (t.block_table is not None) == (layout == "paged") and call.capacity == case.capacity
    out, _ = binding.forward(t, call)
    assert float((out[0, 0] - inputs["ref"]).abs().max()) < tune_decode.MAX_ERROR / 100


def test_the_command_line_tunes_the_bench_grid_into_the_table(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    # tune.main end to end with the GPU faked: the rows land in the table and dispatch serves them.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake H200")
    monkeypatch.setattr(machine, "target_of_device", lambda device: SM90)
    monkeypatch.setattr(binding, "sm_count", lambda device: 132)
    monkeypatch.setattr(common, "compile_all", lambda variants, jobs: {})
    timed: list[Case] = []

    def timer(reps: int) -> tune_decode.Timer:
        def time_pair(case: Case, split: Variant, combine: Variant) -> tuple[float, float]:
            timed.append(case)
            return 1.0 + (split.get("num_warps") == 8) + split.get("num_stages") / 100, 0.0
        return time_pair

    monkeypatch.setattr(tune_decode, "gpu_timer", timer)
    table = tmp_path / "flash_decode.csv"
    assert tune.main(["--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "64,128", "--table",
                      str(table)]) == 0
    assert {(c.head_dim, c.layout, c.batch, c.cache_len) for c in timed} == {
        (d, layout, b, n) for d in (64, 128) for layout in ("contiguous", "paged") for b in (1, 8, 32, 64)
        for n in (1024, 4096, 16384, 32768)}
    rows = tuning.Table.parse(table.read_text())
    splits = [r for r in rows if r.kernel == SPLIT]
    assert {(r.head_dim, r.seqlen_q, r.seqlen_k) for r in splits} == {
        (d, 4, n) for d in (64, 128) for n in (1024, 4096, 16384, 32768)}
    assert all(r.num_warps != 8 and r.num_stages == 2 and r.gpu == "fake H200" for r in splits)
    case = Case("paged", 5, 20000, 32, 8, 128, "bf16")
    chosen = tune_decode.variant_for(SPLIT, SM90, case, None, rows)
    assert (chosen.get("num_stages"), chosen.get("PAGED")) == (2, True)
