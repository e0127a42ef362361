"""benchmarks/plot_serving.py on CPU: its selection rules (pure, on made-up rows), tables and PNG; the README."""

from __future__ import annotations

import csv
import importlib
import re
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

SCRIPT = REPO / "benchmarks" / "plot_serving.py"
README = REPO / "README.md"
DECODE_COLUMNS = ["kernel", "provider", "layout", "dtype", "head_dim", "batch", "heads_q", "heads_k", "cache_len",
                  "page_size", "p50_ms", "gb_s", "bw_frac", "max_err", "check", "gpu", "torch", "triton", "lazytriton",
                  "timestamp"]
GENERATION_COLUMNS = ["time", "device", "torch", "transformers", "config", "batch", "impl", "metric", "value", "check"]
EARLY, LATE = "2026-12-05T10:00:00+00:00", "2026-12-05T12:00:00+00:00"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
MODEL = "llama h2048 heads 16/4 layers 8 bfloat16"


@pytest.fixture
def plot(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The script as a module, imported from the benchmarks folder as when it is run."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    yield importlib.import_module("plot_serving")


def _decode(provider: str, gb_s: str, timestamp: str = LATE, *, batch: int = 1, cache_len: int = 4096,
            check: str = "ok", gpu: str = H100, layout: str = "contiguous", page_size: str = "") -> dict[str, str]:
    return {"kernel": "flash_decode", "provider": provider, "layout": layout, "dtype": "bfloat16", "head_dim": "128",
            "batch": str(batch), "heads_q": "32", "heads_k": "8", "cache_len": str(cache_len),
            "page_size": page_size, "p50_ms": "0.1", "gb_s": gb_s, "bw_frac": "0.5", "max_err": "5e-04",
            "check": check, "gpu": gpu, "torch": "2.11.0", "triton": "3.6.0", "lazytriton": "0.1.0",
            "timestamp": timestamp}


def _generation(impl: str, metric: str, value: str, time: str = LATE, *, config: str = f"{MODEL} dynamic cache",
                batch: int = 8, check: str = "", device: str = H200) -> dict[str, str]:
    return {"time": time, "device": device, "torch": "2.11.0", "transformers": "5.25.0", "config": config,
            "batch": str(batch), "impl": impl, "metric": metric, "value": value, "check": check}


def _rows(plot: ModuleType, dicts: list[dict[str, str]]) -> list[object]:
    return [plot.Row("made-up.csv", n, d) for n, d in enumerate(dicts, start=2)]


def _key(plot: ModuleType, provider: str, batch: int = 1, cache_len: int = 4096) -> object:
    return plot.DecodeKey(provider, "contiguous", "bfloat16", 128, 32, 8, batch, cache_len, 0)


def _write(path: Path, columns: list[str], rows: list[Mapping[str, str]]) -> Path:
    """A CSV as the benchmarks write it: csv's default CRLF line ends."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    assert b"\r\n" in path.read_bytes()
    return path


def test_decode_latest_run_wins_whatever_the_file_order(plot: ModuleType) -> None:
    rows = _rows(plot, [_decode("lazytriton", "300", LATE), _decode("lazytriton", "100", EARLY),
                        _decode("sdpa", "200", EARLY)])
    selected = plot.select_decode(rows, H100)
    assert selected[_key(plot, "lazytriton")].gb_s == 300.0
    assert selected[_key(plot, "sdpa")].gb_s == 200.0  # only the earlier run timed it: kept
    same = plot.select_decode(_rows(plot, [_decode("sdpa", "1", LATE), _decode("sdpa", "2", LATE)]), H100)
    assert same[_key(plot, "sdpa")].gb_s == 2.0  # same timestamp: the row appended later wins


def test_decode_failed_checks_empty_values_and_other_gpus_are_skipped(plot: ModuleType) -> None:
    rows = _rows(plot, [
        _decode("lazytriton", "100", EARLY),
        _decode("lazytriton", "999", LATE, check="wrong"),  # newer, but its output failed the check
        _decode("sdpa", "999", LATE, check=""),              # no verdict is not ok
        _decode("sdpa", "", LATE),                           # no throughput
        _decode("sdpa", "999", LATE, gpu=H200),
        _decode("lazytriton", "50", LATE, layout="paged", page_size="256"),
    ])
    selected = plot.select_decode(rows, H100)
    assert {k: p.gb_s for k, p in selected.items()} == {
        _key(plot, "lazytriton"): 100.0, _key(plot, "lazytriton")._replace(layout="paged", page_size=256): 50.0}
    assert selected[_key(plot, "lazytriton")].timestamp.isoformat() == EARLY


def test_the_default_gpu_is_the_newest_usable_rows_never_a_cpu_smoke(plot: ModuleType) -> None:
    rows = _rows(plot, [_decode("sdpa", "1", EARLY, gpu=H200), _decode("sdpa", "1", LATE),
                        _decode("sdpa", "1", "2026-12-06T00:00:00+00:00", gpu="NVIDIA B200", check="failed"),
                        _decode("sdpa", "1", "2026-12-07T00:00:00+00:00", gpu="cpu")])
    assert plot.newest_device(rows, plot.decode_usable, "gpu", "timestamp") == H100
    with pytest.raises(ValueError, match="no usable row of a GPU"):
        plot.newest_device(rows[2:], plot.decode_usable, "gpu", "timestamp")


@pytest.mark.parametrize(("column", "value", "expected"), [
    ("gb_s", "inf", "a positive finite number"),
    ("cache_len", "4k", "a positive integer"),
    ("page_size", "0", "empty or a positive integer"),
    ("timestamp", "today", "an ISO 8601 timestamp"),
])
def test_a_malformed_decode_row_names_file_line_column_and_value(plot: ModuleType, column: str, value: str,
                                                                 expected: str) -> None:
    bad = _decode("lazytriton", "100")
    bad[column] = value
    with pytest.raises(ValueError, match=rf"made-up.csv:3: column {column}='{value}': expected {expected}"):
        plot.select_decode(_rows(plot, [_decode("sdpa", "1"), bad]), H100)


def test_the_decode_table(plot: ModuleType) -> None:
    rows = _rows(plot, [
        _decode("lazytriton", "100", batch=1, cache_len=4096), _decode("sdpa", "200", batch=1, cache_len=4096),
        _decode("lazytriton", "400", batch=1, cache_len=32768), _decode("sdpa", "200", batch=1, cache_len=32768),
        _decode("lazytriton", "3000", batch=32, cache_len=4096),  # SDPA missing: "-", no ratio
        _decode("lazytriton", "1500", EARLY, batch=32, cache_len=32768),  # an earlier run's pair: marked
        _decode("sdpa", "1000", EARLY, batch=32, cache_len=32768),
        _decode("sdpa_gather", "5", batch=1, cache_len=4096),  # not a provider of the table
        _decode("lazytriton", "7", batch=8, cache_len=4096, layout="paged", page_size="256"),  # another view
    ])
    selected = plot.select_decode(rows, H100)
    assert plot.decode_table(selected, plot.View()).splitlines() == [
        "| batch | 4k keys | 32k keys |",
        "|---|---|---|",
        "| 1 | 100 / 200 (0.50x) | 400 / 200 (2.00x) |",
        "| 32 | 3000 / - | 1500 / 1000 (1.50x) * |",
        "",
        "GB/s, lazytriton / SDPA (ratio); lazytriton / SDPA geomean 1.14x over 3 cases (0.50-2.00x). "
        "NVIDIA H100 80GB HBM3, contiguous cache, bfloat16, head dim 128, 32/8 heads, 2026-12-05.",
        "Cells marked * (1) come from a run before the newest (2026-12-05 12:00 UTC), which did not time them.",
    ]
    paged = plot.decode_table(selected, plot.View(layout="paged", page_size=256))
    assert "| 8 | 7 / - |" in paged and "paged cache (256-key pages)" in paged
    assert "no case has both providers" in paged and "Cells marked" not in paged
    # a length one batch lacks entirely is "-"
    only = plot.select_decode(_rows(plot, [_decode("sdpa", "10", batch=1), _decode("sdpa", "20", batch=8,
                                                                                   cache_len=8192)]), H100)
    assert "| 1 | - / 10 | - |" in plot.decode_table(only, plot.View())
    assert "| 32 |" not in plot.decode_table(selected, plot.View(), batches=[1])
    with pytest.raises(ValueError, match="no lazytriton or sdpa point"):
        plot.decode_table(selected, plot.View(head_dim=64))


def test_the_decode_png_is_written_and_the_same_twice(plot: ModuleType, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rows = [_decode(provider, str(500 + 100 * i + 40 * j + batch + (5 if stamp == LATE else 0)), stamp, batch=batch,
                    cache_len=n)
            for batch in (1, 8, 32) for i, n in enumerate((1024, 4096, 32768))
            for j, provider in enumerate(("lazytriton", "sdpa")) for stamp in (EARLY, LATE)
            if stamp == EARLY or n != 4096]  # the later run left out 4k: hollow points
    rows.append(_decode("lazytriton", "9", "2026-12-06T00:00:00+00:00", gpu="cpu"))  # a CPU smoke: not the GPU
    args = ["--decode", "--csv", str(_write(tmp_path / "decode.csv", DECODE_COLUMNS, rows))]
    pngs = [tmp_path / "a" / "decode.png", tmp_path / "b.png"]
    for png in pngs:
        assert plot.main([*args, "--out", str(png)]) == 0
    data = pngs[0].read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert b"Software" not in data and b"matplotlib" not in data
    assert pngs[1].read_bytes() == data  # deterministic: same CSV, same bytes
    assert plot.main([*args, "--batches", "1,8,32", "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes() != data
    # plot_perf.py hands --decode to this script
    perf = importlib.import_module("plot_perf")
    assert perf.main([*args, "--out", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").read_bytes() == data
    capsys.readouterr()
    assert perf.main([*args, "--summary"]) == 0
    assert "| 8 | 513 / 553 (0.93x) |" in capsys.readouterr().out  # batch 8, 1k keys: the later run
    with pytest.raises(ValueError, match="no lazytriton or sdpa point"):
        plot.main([*args, "--batches", "64", "--out", str(tmp_path / "e.png")])
    assert not (tmp_path / "e.png").exists()
    for bad in ([*args, "--batches", "0"], [*args, "--heads", "32"], [*args, "--since", "soon"],
                [*args[1:], "--summary"], ["--generation", "--csv", args[-1]], [*args, "--generation"]):
        with pytest.raises(SystemExit):
            plot.main(bad)


def test_generation_takes_each_configs_newest_run_on_one_gpu(plot: ModuleType) -> None:
    static = f"{MODEL} static cache compiled"
    rows = _rows(plot, [
        _generation("sdpa", "gen_tokens_per_s", "100", EARLY),
        _generation("lazytriton", "gen_tokens_per_s", "50", EARLY),
        _generation("sdpa", "gen_tokens_per_s", "200", LATE),
        _generation("sdpa", "gen_tokens_per_s", "210", LATE),  # same run: the later row wins
        _generation("lazytriton", "gen_tokens_per_s", "", LATE),  # no value: not a row of the run
        _generation("lazytriton", "gen_tokens_per_s", "999", "2026-12-06T00:00:00+00:00", device=H100),
        _generation("sdpa", "prefill_ms", "10", EARLY, config=static),
    ])
    runs = plot.select_generation(rows, H200)
    assert [(r.config, r.time.isoformat()) for r in runs] == [(static, EARLY), (f"{MODEL} dynamic cache", LATE)]
    assert runs[1].metrics == {("sdpa", "gen_tokens_per_s"): plot.Metric("210", "")}  # the earlier run's 50 is not
    assert plot.newest_device(rows, plot.generation_usable, "device", "time") == H100


def test_the_generation_table(plot: ModuleType) -> None:
    long = f"{MODEL} dynamic cache prompts 8192-32768"
    rows = _rows(plot, [
        *(_generation(impl, metric, value, check=check) for impl, metric, value, check in (
            ("sdpa", "logits_max_err_vs_fp32", "0.618317", "ok"), ("sdpa", "prefill_ms", "11.0549", ""),
            ("sdpa", "gen_tokens_per_s", "1071.71", ""), ("lazytriton", "logits_max_err_vs_fp32", "0.628067", "ok"),
            ("lazytriton", "prefill_ms", "12.3687", ""), ("lazytriton", "gen_tokens_per_s", "1095.74", ""),
            ("lazytriton", "greedy_tokens_equal_of_compared", "337/343", "ok"),
            ("lazytriton", "calls_prefill_and_one_step", "decoding_step 8, varlen 8", ""))),
        _generation("sdpa", "prefill_ms", "120", config=long, batch=1),
        _generation("lazytriton", "prefill_ms", "100", config=long, batch=1),
        _generation("lazytriton", "logits_max_err_vs_fp32", "9.5", config=long, batch=1, check="FAIL"),
        _generation("lazytriton", "greedy_tokens_equal_of_compared", "1/4", config=long, batch=1, check="FAIL"),
    ])
    table = plot.generation_table(plot.select_generation(rows, H200), H200)
    assert table.splitlines()[2:] == [
        "| dynamic cache | 8 | 11.05 / 12.37 | 0.89x | 1071.7 / 1095.7 | 1.02x | 0.618 / 0.628 (ok) | 337/343 (ok) |",
        "| dynamic cache prompts 8192-32768 | 1 | 120.00 / 100.00 | 1.20x | - / - | - | - / 9.500 (FAIL) "
        "| 1/4 (FAIL) |",
        "",
        f"Speedups above 1 mean lazytriton is faster; model: {MODEL}; NVIDIA H200, 2026-12-05.",
    ]
    one = plot.generation_table(plot.select_generation(rows[:1], H200), H200)
    assert "| dynamic cache | 8 | - / - | - | - / - | - | 0.618 / - (ok) | - |" in one
    # configs of different models (or one naming the model alone) are shown whole
    other = _rows(plot, [dict(rows[0].fields), _generation("sdpa", "prefill_ms", "1", config=MODEL)])
    assert plot.shared_model([r.fields["config"] for r in other]) == ""
    assert f"| {MODEL} dynamic cache | 8 |" in plot.generation_table(plot.select_generation(other, H200), H200)
    with pytest.raises(ValueError, match="no transformers run"):
        plot.generation_table(plot.select_generation(rows, H100), H100)
    bad = _rows(plot, [_generation("sdpa", "prefill_ms", "fast")])
    with pytest.raises(ValueError, match=r"sdpa prefill_ms='fast': expected a positive finite number"):
        plot.generation_table(plot.select_generation(bad, H200), H200)


def test_a_csv_without_the_columns_is_refused(plot: ModuleType, tmp_path: Path) -> None:
    path = _write(tmp_path / "other.csv", ["time", "device"], [{"time": LATE, "device": H200}])
    with pytest.raises(ValueError, match=r"other.csv: missing columns \['config'"):
        plot.main(["--generation", "--summary", "--csv", str(path)])


def _table_lines(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("mode", ["--decode", "--generation"])
def test_the_results_files_give_tables(plot: ModuleType, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plot.main([mode, "--summary"]) == 0
    lines = _table_lines(capsys.readouterr().out)
    assert len(lines) >= 3 and set(lines[1]) == {"---"}
    assert all(len(line) == len(lines[0]) for line in lines)


def test_the_readme_serving_tables_are_plot_servings_summaries(plot: ModuleType,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text()
    asked = re.findall(r"`plot_serving\.py (--(?:decode|generation) --summary[^`]*)`", text)
    assert sorted(a.split()[0] for a in asked) == ["--decode", "--generation"], asked
    for command in asked:
        capsys.readouterr()
        assert plot.main(shlex.split(command)) == 0
        printed = [line for line in capsys.readouterr().out.splitlines() if line]
        missing = [line for line in printed if line not in text]
        assert not missing, f"README.md lacks plot_serving.py {command}'s lines:\n" + "\n".join(printed)
