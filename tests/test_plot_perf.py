"""benchmarks/plot_perf.py on CPU: its selection rule (pure, on made-up rows), its table, and one drawn PNG."""

from __future__ import annotations

import csv
import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

SCRIPT = REPO / "benchmarks" / "plot_perf.py"
FWD_COLUMNS = ["kernel", "provider", "mode", "dtype", "head_dim", "causal", "batch", "heads", "seqlen", "p50_ms",
               "tflops", "us_per_call", "rel_err", "gpu", "torch", "triton", "lazytriton", "timestamp"]
BWD_COLUMNS = FWD_COLUMNS[:13] + ["check"] + FWD_COLUMNS[13:]
EARLY, LATE = "2026-11-30T10:00:00+00:00", "2026-11-30T12:00:00+00:00"


@pytest.fixture
def plot(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The script as a module, imported from the benchmarks folder as when it is run."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    yield importlib.import_module("plot_perf")


def _row(provider: str, tflops: str, timestamp: str = LATE, *, mode: str = "bwd", seqlen: int = 1024,
         check: str | None = "ok", gpu: str = "NVIDIA H200", head_dim: int = 64, causal: bool = False,
         dtype: str = "bfloat16") -> dict[str, str]:
    fields = {"kernel": "flash_" + mode, "provider": provider, "mode": mode, "dtype": dtype,
              "head_dim": str(head_dim), "causal": str(causal), "batch": str(16384 // seqlen), "heads": "32",
              "seqlen": str(seqlen), "p50_ms": "1.0", "tflops": tflops, "us_per_call": "", "rel_err": "1e-03",
              "gpu": gpu, "torch": "2.11.0", "triton": "3.6.0", "lazytriton": "0.1.0", "timestamp": timestamp}
    if check is not None:
        fields["check"] = check
    return fields


def _rows(plot: ModuleType, dicts: list[dict[str, str]]) -> list[object]:
    return [plot.Row("made-up.csv", n, d) for n, d in enumerate(dicts, start=2)]


def _key(plot: ModuleType, provider: str, mode: str = "bwd", seqlen: int = 1024) -> object:
    return plot.Key(provider, mode, "bfloat16", 64, False, seqlen)


def test_latest_run_wins_whatever_the_file_order(plot: ModuleType) -> None:
    rows = _rows(plot, [_row("lazytriton", "300", LATE), _row("lazytriton", "100", EARLY),
                        _row("sdpa_cudnn", "200", EARLY)])
    selected = plot.select_latest(rows, "NVIDIA H200")
    assert selected[_key(plot, "lazytriton")].tflops == 300.0
    # A provider only the earlier run timed keeps that run's value.
    assert selected[_key(plot, "sdpa_cudnn")].tflops == 200.0
    # Same timestamp: the row appended later wins.
    same = plot.select_latest(_rows(plot, [_row("lazytriton", "1", LATE), _row("lazytriton", "2", LATE)]),
                              "NVIDIA H200")
    assert same[_key(plot, "lazytriton")].tflops == 2.0


def test_failed_checks_empty_tflops_and_other_gpus_are_skipped(plot: ModuleType) -> None:
    rows = _rows(plot, [
        _row("lazytriton", "100", EARLY),
        _row("lazytriton", "999", LATE, check="failed"),   # newer, but failed the gradient rule
        _row("sdpa_flash", "999", LATE, check=""),         # a check column with no verdict is not ok
        _row("sdpa_cudnn", "", LATE),                      # no throughput (a failed provider)
        _row("triton_jit", "999", LATE, gpu="NVIDIA H100"),
        _row("triton_jit", "50", EARLY, mode="fwd", check=None),  # the forward CSV has no check column
    ])
    selected = plot.select_latest(rows, "NVIDIA H200")
    assert selected == {
        _key(plot, "lazytriton"): plot.Point(100.0, "NVIDIA H200", selected[_key(plot, "lazytriton")].timestamp),
        _key(plot, "triton_jit", "fwd"): plot.Point(50.0, "NVIDIA H200",
                                                     selected[_key(plot, "triton_jit", "fwd")].timestamp),
    }
    assert selected[_key(plot, "lazytriton")].timestamp.isoformat() == EARLY


def test_newest_gpu_is_the_default(plot: ModuleType) -> None:
    rows = _rows(plot, [_row("lazytriton", "1", LATE, gpu="NVIDIA H100"), _row("lazytriton", "1", EARLY),
                        _row("lazytriton", "1", "2026-12-01T00:00:00+00:00", gpu="NVIDIA B200", check="failed")])
    assert plot.newest_gpu(rows) == "NVIDIA H100"


def test_a_newer_fp8_run_on_another_gpu_does_not_move_the_16_bit_figure(plot: ModuleType) -> None:
    rows = _rows(plot, [_row("lazytriton", "1", EARLY), _row("lazytriton_fp8", "1", LATE, gpu="NVIDIA H100",
                                                                 dtype="e4m3")])
    assert plot.newest_gpu(rows) == "NVIDIA H100"
    assert plot.newest_gpu(rows, plot.DTYPES.values()) == "NVIDIA H200"


@pytest.mark.parametrize(("column", "value", "expected"), [
    ("tflops", "nan", "a positive finite number"),
    ("tflops", "-3", "a positive finite number"),
    ("seqlen", "1k", "a positive integer"),
    ("causal", "yes", "True or False"),
    ("timestamp", "yesterday", "an ISO 8601 timestamp"),
])
def test_a_malformed_row_names_file_line_column_and_value(plot: ModuleType, column: str, value: str,
                                                         expected: str) -> None:
    bad = _row("lazytriton", "100")
    bad[column] = value
    with pytest.raises(ValueError, match=rf"made-up.csv:3: column {column}='{value}': expected {expected}"):
        plot.select_latest(_rows(plot, [_row("sdpa_cudnn", "1"), bad]), "NVIDIA H200")


def test_summary_ratios_pair_points_of_the_same_case(plot: ModuleType) -> None:
    rows = _rows(plot, [
        _row("lazytriton", "100", mode="fwd", seqlen=1024), _row("sdpa_cudnn", "200", mode="fwd", seqlen=1024),
        _row("lazytriton", "200", mode="fwd", seqlen=4096), _row("sdpa_cudnn", "100", mode="fwd", seqlen=4096),
        _row("lazytriton", "300", mode="fwd", seqlen=16384),  # no cuDNN point: left out
        _row("lazytriton", "150", EARLY), _row("sdpa_cudnn", "100", LATE),  # a pair across runs
    ])
    selected = plot.select_latest(rows, "NVIDIA H200")
    ratio = plot.geomean_ratio(selected, "fwd", "sdpa_cudnn", ["bfloat16"])
    assert ratio.geomean == pytest.approx(1.0) and (ratio.low, ratio.high, ratio.cases, ratio.mixed) == (0.5, 2, 2, 0)
    assert plot.geomean_ratio(selected, "fwd", "sdpa_flash", ["bfloat16"]) is None
    table = plot.summary_table(selected)
    assert "| forward: lazytriton / SDPA cuDNN | 1.00x | 1.00x | 0.50-2.00x | 2 |" in table
    assert "| backward: lazytriton / SDPA cuDNN | 1.50x | 1.50x | 1.50-1.50x | 1 |" in table
    assert "SDPA flash" not in table
    assert "1 of these ratios compare points from different runs" in table


def _write(path: Path, columns: list[str], rows: list[Mapping[str, str]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_the_script_draws_the_same_png_twice(plot: ModuleType, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    fwd, bwd = [], []
    for head_dim in (64, 128):
        for causal in (False, True):
            for i, seqlen in enumerate((1024, 4096, 16384)):
                for j, provider in enumerate(("lazytriton", "sdpa_cudnn", "sdpa_flash", "triton_jit")):
                    case = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen}
                    fwd.append(_row(provider, str(200 + 50 * i + 10 * j), mode="fwd", check=None, **case))
                    bwd.append(_row(provider, str(150 + 40 * i + 10 * j), EARLY, **case))
                    if provider != "triton_jit":  # the later run left out one provider: its line is dashed
                        bwd.append(_row(provider, str(160 + 40 * i + 10 * j), LATE, **case))
    fwd.append(_row("torch_add", "", mode="host", check=None))  # a host-cost row: no tflops, skipped
    args = ["--fwd-csv", str(_write(tmp_path / "fwd.csv", FWD_COLUMNS, fwd)),
            "--bwd-csv", str(_write(tmp_path / "bwd.csv", BWD_COLUMNS, bwd))]
    # By default rows before plot.DEVICE_TIME_SINCE (timed with each call's host latency) are left out: all here
    with pytest.raises(ValueError, match="no fwd/bwd points"):
        plot.main([*args, "--out", str(tmp_path / "old.png")])
    with pytest.raises(SystemExit):
        plot.main([*args, "--since", "last week"])
    args += ["--since", EARLY]
    pngs = [tmp_path / "a" / "perf.png", tmp_path / "b.png"]
    for png in pngs:
        assert plot.main([*args, "--out", str(png)]) == 0
    data = pngs[0].read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert b"Software" not in data and b"matplotlib" not in data
    assert pngs[1].read_bytes() == data  # deterministic: same CSVs, same bytes
    capsys.readouterr()
    assert plot.main([*args, "--summary"]) == 0
    assert "| backward: lazytriton / SDPA cuDNN |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="dtype='float16': no fwd/bwd points"):
        plot.main([*args, "--dtype", "fp16", "--out", str(tmp_path / "c.png")])
    assert not (tmp_path / "c.png").exists()
    # --head-dims keeps those rows only: one head dim's panels, a narrower figure than both's is not asked for
    assert plot.main([*args, "--head-dims", "128", "--out", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").read_bytes() != data
    capsys.readouterr()
    assert plot.main([*args, "--summary"]) == 0
    assert "| 12 |" in capsys.readouterr().out  # both head dims: 12 cases a ratio
    assert plot.main([*args, "--summary", "--head-dims", "64"]) == 0
    out = capsys.readouterr().out
    assert "| 6 |" in out and "| 12 |" not in out  # head dim 64's 6 cases (causal or not x 3 seqlens)
    with pytest.raises(ValueError, match="no fwd/bwd points"):
        plot.main([*args, "--head-dims", "96", "--out", str(tmp_path / "e.png")])
    with pytest.raises(SystemExit):
        plot.main([*args, "--head-dims", "x"])


def test_a_csv_without_the_benchmark_columns_is_refused(plot: ModuleType, tmp_path: Path) -> None:
    path = _write(tmp_path / "other.csv", ["kernel", "provider"], [{"kernel": "x", "provider": "y"}])
    with pytest.raises(ValueError, match=r"other.csv: missing columns \['mode'"):
        plot.read_rows(path)
