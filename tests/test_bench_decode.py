"""benchmarks/bench_decode.py on CPU: its case grid, its filters, its table, and one ``--quick`` run end to end.

The benchmark itself needs the H200; these keep it importable and runnable
(``--quick`` runs a tiny contiguous and a tiny paged case through Triton's
interpreter, with the same providers, checks, CSV rows and table as the GPU
run).
"""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from benchlib import bench_module, run_bench
from conftest import REPO

BENCH = REPO / "benchmarks" / "bench_decode.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The benchmark as a module (it imports its neighbour csvlog, as when run as a script)."""
    yield bench_module(monkeypatch, BENCH)


def passed(bench: ModuleType, cases: Sequence[Any], providers: Sequence[str],
           ms: Sequence[Sequence[float]]) -> list[Any]:
    """A checked ``bench.Result`` (max error 1e-3) for each case and provider: ``ms[i][j]`` for ``cases[i]`` under
    ``providers[j]``."""
    return [bench.Result(case, provider, t, 1e-3, "ok") for case, row in zip(cases, ms, strict=True)
            for provider, t in zip(providers, row, strict=True)]


def test_the_grid_is_the_issues_decoding_grid(bench: ModuleType) -> None:
    args = bench.parse_args([])
    grid = bench.cases(args.batches, args.lengths, args.layouts, args.page_size)
    assert len(grid) == 32
    assert {(c.layout, c.batch, c.cache_len) for c in grid} == {
        (layout, b, n) for layout in ("contiguous", "paged") for b in (1, 8, 32, 64)
        for n in (1024, 4096, 16384, 32768)}
    case = next(c for c in grid if c.batch == 64 and c.cache_len == 32768 and c.layout == "paged")
    assert (case.heads_q, case.heads_k, case.head_dim, case.page_size) == (32, 8, 128, 256)
    assert case.bytes == 2 * 64 * 128 * (2 * 32768 * 8 + 2 * 32)  # bf16 K and V, q and out
    assert bench.providers(case) == ["lazytriton", "sdpa", "sdpa_gather"]
    assert bench.providers(case._replace(layout="contiguous")) == ["lazytriton", "sdpa"]


def test_head_dims_and_heads_widen_the_grid(bench: ModuleType) -> None:
    args = bench.parse_args(["--head-dims", "64,128", "--heads", "32/8,32/32", "--lengths", "1k"])
    grid = bench.cases(args.batches, args.lengths, args.layouts, args.page_size, args.head_dims, args.heads)
    assert len(grid) == 2 * 2 * 2 * 4
    assert {(c.head_dim, c.heads_q, c.heads_k) for c in grid} == {(d, 32, k) for d in (64, 128) for k in (8, 32)}
    assert "d64 32/32" in next(c for c in grid if c.head_dim == 64 and c.heads_k == 32).label
    assert "d128" not in next(c for c in grid if c.head_dim == 128 and c.heads_k == 8).label


def test_page_sizes_give_a_paged_case_each(bench: ModuleType) -> None:
    """``--page-size 1,16``: pages of 1 key (gathered) beside pages of 16, one contiguous case."""
    args = bench.parse_args(["--page-size", "1,16", "--batches", "8", "--lengths", "32k"])
    grid = bench.cases(args.batches, args.lengths, args.layouts, args.page_size)
    assert [(c.layout, c.page_size) for c in grid] == [("contiguous", 1), ("paged", 1), ("paged", 16)]
    assert [c.label.split()[-1] for c in grid] == ["32k", "p1", "p16"]
    assert bench.Case("paged", 8, 4096).label == "paged      b8     4k"  # pages of 256: no suffix


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--lengths", "4q"], ["--layouts", "ring"],
                                  ["--page-size", "0"], ["--reps", "0"], ["--heads", "32/5"],
                                  ["--head-dims", "x"]])
def test_bad_filters_are_refused(bench: ModuleType, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_table_reports_speedups_a_wrong_row_and_a_failure(bench: ModuleType) -> None:
    case = bench.Case("paged", 8, 4096)
    ms = case.bytes / 4000.0 / 1e6  # 4000 GB/s
    results = [bench.Result(case, "lazytriton", ms, 1e-3, "ok"),
               bench.Result(case, "sdpa", ms * 2, 1e-3, "ok"),
               bench.Result(case, "sdpa_gather", ms * 4, 0.5, "wrong")]
    other = bench.Case("contiguous", 8, 4096)
    results += [bench.Result(other, "lazytriton", ms, 1e-3, "ok"),
                bench.Result(other, "sdpa", None, None, "failed", "RuntimeError: no kernel")]
    log = bench.Log()
    bench.print_table(results, 4800.0, log)
    row = next(line for line in log.lines if line.startswith("paged      b8"))
    assert row.split()[3:] == ["4000", "2000", "1000*", "83%", "2.00", "-"]
    assert next(line for line in log.lines if line.startswith("geomean")).split()[1:] == ["2.00", "-"]
    assert "  sdpa failed on contiguous b8 4k: RuntimeError: no kernel" in log.lines
    assert any("sdpa_gather wrong on paged b8 4k: max error 5.0e-01" in line for line in log.lines)


def test_python_lookup_times_the_call_beside_its_python_lookup(bench: ModuleType) -> None:
    case, other = bench.Case("contiguous", 1, 1024), bench.Case("paged", 1, 1024)
    assert bench.parse_args(["--python-lookup"]).python_lookup
    assert bench.providers(case, python_lookup=True) == ["lazytriton", "sdpa", "lazytriton_pylookup"]
    results = passed(bench, (case, other), ("lazytriton", "lazytriton_pylookup"), ((0.010, 0.0125), (0.020, 0.020)))
    log = bench.Log()
    bench.print_lookup(results, log)
    assert log.lines[0].startswith("C++ lookup: contiguous") and log.lines[0].endswith("1.250x over the Python lookup")
    assert "geomean 1.118x, min 1.000x, max 1.250x over 2 cases" in log.lines[-1]


def test_quick_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    rows, _ = run_bench(BENCH, tmp_path / "decode.csv", "--quick", out_dir=out_dir)
    assert {(r["provider"], r["layout"]): r["check"] for r in rows} == {
        ("lazytriton", "contiguous"): "ok", ("sdpa", "contiguous"): "ok", ("lazytriton", "paged"): "ok",
        ("sdpa", "paged"): "ok", ("sdpa_gather", "paged"): "ok"}
    assert all(r["kernel"] == "flash_decode" and float(r["p50_ms"]) > 0 and r["gb_s"] for r in rows)
    log = (out_dir / "bench_decode.log").read_text()
    assert "GB/s (peak unknown)" in log and log.splitlines()[-1].startswith("min")


def test_rotary_adds_the_step_without_and_with_it(bench: ModuleType) -> None:
    args = bench.parse_args(["--rotary", "halves"])
    case = bench.Case("paged", 8, 4096)
    assert bench.providers(case, args.rotary is not None)[-2:] == ["lazytriton_append", "lazytriton_rotary"]
    assert bench.providers(case) == ["lazytriton", "sdpa", "sdpa_gather"]
    other = bench.Case("contiguous", 8, 4096)
    results = passed(bench, (case, other), ("lazytriton_append", "lazytriton_rotary"), ((1.0, 1.05), (2.0, 2.4)))
    log = bench.Log()
    bench.print_rotary(results, log)
    assert next(line for line in log.lines if line.startswith("paged      b8")).split()[-1] == "1.050"
    assert log.lines[-1].split()[:2] == ["max", "1.200"] and "(over 1.10)" in log.lines[-1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--rotary", "neox"])


def test_quick_rotary_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    """The step's reference rotates q and the new key: a call that skipped the rotation would be ``wrong``."""
    rows, stdout = run_bench(BENCH, tmp_path / "decode.csv", "--quick", "--rotary", "interleaved")
    assert {r["provider"] for r in rows if r["check"] == "ok"} >= {"lazytriton_append", "lazytriton_rotary"}
    assert all(r["check"] == "ok" for r in rows)
    assert "rotary (ms)" in stdout and stdout.splitlines()[-1].startswith("max")


def test_quick_packed_new_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    """The step with cu_seqlens_k_new and out= beside the step with k (batch, 1, ...): both checked ``ok``."""
    out_csv = tmp_path / "decode.csv"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--packed-new", "--csv", str(out_csv)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader(out_csv.open()))
    assert {r["provider"] for r in rows} >= {"lazytriton_append", "lazytriton_packed_new"}
    assert all(r["check"] == "ok" for r in rows)


def test_bench_mixed_quick_runs_end_to_end_on_cpu() -> None:
    """benchmarks/bench_mixed.py: a mixed batch as one call against its prefill and decode parts, checked equal."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_mixed.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[-4:] == ["one_call_ms", "parts_ms", "ratio", "max_err"]
    assert len(lines) == 4 and "WRONG" not in proc.stdout
    assert lines[-1].startswith("one_call / parts: geomean")


def test_mla_grid_and_quick_run_end_to_end_on_cpu(bench: ModuleType, tmp_path: Path) -> None:
    """``--mla``: MLA's 576/512 latent cache, its qv form and SDPA; the grid from 4k keys, 128 and 16 heads."""
    mla = __import__("bench_decode_mla")
    args = bench.parse_args(["--mla"])
    grid = mla.cases(args.batches, [n for n in args.lengths if n >= 4096], args.layouts)
    assert {(c.heads, c.cache_len, c.dim, c.latent) for c in grid} == {
        (h, n, 576, 512) for h in (128, 16) for n in (4096, 16384, 32768)}
    assert grid[0].bytes == 1 * 2 * (4096 * 576 + 128 * (576 + 512))  # the cache once, q and out
    out_csv = tmp_path / "decode.csv"
    proc = subprocess.run([sys.executable, str(BENCH), "--mla", "--quick", "--csv", str(out_csv)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader(out_csv.open()))
    assert {r["provider"] for r in rows} == {"lazytriton_mla", "lazytriton_qv", "sdpa"}
    assert all(r["check"] == "ok" for r in rows), rows
    assert {r["head_dim"] for r in rows} == {"96/64"}
    assert "mla/sdpa" in proc.stdout


def test_the_peak_is_the_gpus_own_datasheet_figure() -> None:
    from csvlog import memory_peak_gb_s

    assert memory_peak_gb_s("NVIDIA H200") == 4800.0
    assert memory_peak_gb_s("NVIDIA H100 80GB HBM3") == 3350.0
    assert memory_peak_gb_s("NVIDIA H100 PCIe") == 2000.0
    assert memory_peak_gb_s("AMD Instinct MI300X") == 5300.0
    assert memory_peak_gb_s("cpu") is None and memory_peak_gb_s("NVIDIA GeForce RTX 4090") is None


def test_leftpad_times_the_call_with_cache_leftpad_a_key_read(bench: ModuleType) -> None:
    assert bench.parse_args(["--leftpad"]).leftpad
    case, other = bench.Case("contiguous", 1, 1024), bench.Case("paged", 8, 4096)
    assert bench.providers(case, leftpad=True) == ["lazytriton", "sdpa", "lazytriton_leftpad"]
    # a key read: the padded call reads the pads' mean, 32 keys, fewer (1024 / 992 = 1.032; 1.25 x 4096 / 4064)
    results = passed(bench, (case, other), ("lazytriton", "lazytriton_leftpad"), ((0.010, 0.010), (0.040, 0.050)))
    log = bench.Log()
    bench.print_table(results, None, log)
    line = next(line for line in log.lines if line.startswith("with cache_leftpad"))
    assert "geomean 1.140, highest 1.260 over 2 cases" in line


def test_quick_leftpad_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    """The reference reads the keys from the pad on: a call that ignored cache_leftpad would be ``wrong``."""
    rows, _ = run_bench(BENCH, tmp_path / "decode.csv", "--quick", "--leftpad")
    assert {r["layout"]: r["check"] for r in rows if r["provider"] == "lazytriton_leftpad"} == {
        "contiguous": "ok", "paged": "ok"}


def test_the_leftpad_reference_differs_from_the_unpadded_one(bench: ModuleType) -> None:
    """Beyond the check's tolerance on every quick case: a call that ignored the pads would be ``wrong``."""
    for seed, case in enumerate(bench.QUICK_CASES):
        t = bench.make_inputs(case, torch.device("cpu"), 1000 + seed)  # main's seeds
        assert 1 <= int(t.leftpad[0]) <= case.cache_len // 2
        gap = (bench.reference(t, "lazytriton_leftpad") - bench.reference(t)).abs().max()
        assert float(gap) > bench.TOLERANCE, case


def test_layers_cycle_each_providers_calls_through_sets_of_caches(bench: ModuleType) -> None:
    """``--layers``: a count or auto (the fewest sets whose caches are twice the L2), each call the next set."""
    assert bench.parse_args([]).layers == 1 and bench.parse_args([]).csv.name == "decode.csv"
    args = bench.parse_args(["--layers", "auto"])
    assert args.layers == "auto" and args.csv.name == "decode_layers.csv"
    assert bench.parse_args(["--layers", "3", "--csv", "x.csv"]).csv == Path("x.csv")
    for bad in ("0", "-2", "two", ""):
        with pytest.raises(SystemExit):
            bench.parse_args(["--layers", bad])
    with pytest.raises(SystemExit):
        bench.parse_args(["--mla", "--layers", "2"])
    small, large = bench.Case("contiguous", 8, 1024), bench.Case("contiguous", 64, 32768)
    l2 = 50 * 2**20
    assert small.bytes == 8 * 128 * (2 * 1024 * 8 * 2 + 2 * 32 * 2)  # 33.6 MB: under the H100's L2
    assert bench.layer_count(small, "auto", l2) == 4 and bench.layer_count(large, "auto", l2) == 1
    assert bench.layer_count(small, 5, l2) == 5 and bench.layer_count(small, "auto", 0) == 1
    calls: list[int] = []
    fns = [lambda i=i: calls.append(i) or torch.zeros(1) for i in range(3)]
    cycle = bench.cycling(fns)
    for _ in range(7):
        cycle()
    assert calls == [0, 1, 2, 0, 1, 2, 0]
    assert bench.cycling(fns[:1]) is fns[0]


def test_quick_runs_with_layers_and_writes_their_count(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    rows, _ = run_bench(BENCH, tmp_path / "layers.csv", "--quick", "--layers", "2", out_dir=out_dir)
    assert rows and all(r["layers"] == "2" and r["check"] == "ok" for r in rows)
    log = (out_dir / "bench_decode.log").read_text()
    assert "each call reads the next of --layers 2 sets of caches" in log and "(2 layers)" in log
