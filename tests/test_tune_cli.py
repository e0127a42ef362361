"""``lazytriton tune``'s command line: the vocabulary it shares with prewarm and explain, and its exit statuses.

Exit status 2 is a usage error (a bad flag, found before any work) and 1 a
failure of the work (no GPU to time on), as for every ``lazytriton`` command.
The GPU is faked where the test follows a parsed command to the groups it
would tune; the timing itself runs on the GPU host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import has_cuda

from lazytriton import geometry, machine, tuning
from lazytriton.cli import tune
from lazytriton.target import Target

SM90 = Target.parse("sm_90")
no_gpu = pytest.mark.skipif(has_cuda(), reason="checks the message of a machine without a GPU")


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, str, int, bool]]:
    """Run ``tune.main`` as on a GPU host, recording the (family, dtype, head dim, causal) groups it would tune."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake H200")
    monkeypatch.setattr(machine, "target_of_device", lambda device: SM90)
    seen: list[tuple[str, str, int, bool]] = []

    def record(family: str, kernels: Any, target: Target, dtype: str, head_dim: int, causal: bool,
               *rest: Any) -> list[tuning.Row]:
        seen.append((family, dtype, head_dim, causal))
        return []

    monkeypatch.setattr(tune, "tune_family_group", record)
    return seen


# ---------------------------------------------------------------------------
# Exit statuses


@no_gpu
def test_without_a_gpu_tune_fails_the_work_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "lazytriton", "tune", "--head-dim", "64"], capture_output=True,
                            text=True, timeout=300, check=False, cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("lazytriton tune:") and "GPU" in lines[0], lines[0]
    assert result.stdout == ""


@no_gpu
def test_without_a_gpu_main_returns_1() -> None:
    assert tune.main(["--kernel", "flash_bwd"]) == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--pairs", "4096by4096"], "--pairs items must look like 4096x4096"),
    (["--pairs", "0x128"], "--pairs items must look like 4096x4096"),
    (["--dtype", "fp8"], "--dtype must be among bf16, fp16, fp32"),
    (["--head-dim", "300"], "--head-dim must be integers in 1..256"),
    (["--head-dim", "x"], "--head-dim must be integers in 1..256"),
    (["--causal", "sideways"], "--causal must be among none, top_left, bottom_right"),
    (["--causal", "top_left,maybe"], "got 'maybe'"),
])
def test_a_bad_flag_is_a_usage_error_before_any_work(flags: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        tune.main(flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------
# --causal: prewarm's and cache explain's modes


def test_causal_takes_the_modes_of_prewarm_and_explain() -> None:
    assert tune.causal_flags("none") == (False,)
    assert tune.causal_flags("top_left") == (True,)
    assert tune.causal_flags("bottom_right") == (True,), "both causal modes run one binary: one row"
    assert tune.causal_flags("none,top_left,bottom_right") == (False, True)
    assert tune.causal_flags("BOTTOM_RIGHT, none") == (True, False)
    assert set(tune.CAUSAL_MODES) == set(geometry.CAUSAL_MODES)


def test_causal_reads_the_aliases_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert tune.causal_flags("causal") == (True,)  # prewarm's alias of top_left
    assert "--causal causal read as top_left" in capsys.readouterr().err
    assert tune.causal_flags("both") == (False, True)  # the former spelling, kept for scripts
    assert "--causal both read as none,top_left" in capsys.readouterr().err


def test_help_names_the_modes_and_not_the_hidden_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tune.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--causal CAUSAL" in shown and "none,top_left,bottom_right" in shown
    assert "both" not in shown.split("--causal", 1)[1].split("--pairs", 1)[0]


def test_causal_selects_the_groups_tuned(groups: list[tuple[str, str, int, bool]], tmp_path: Path) -> None:
    table = ["--table", str(tmp_path / "t.csv")]
    assert tune.main(["--dtype", "bf16", "--head-dim", "64", *table]) == 0
    assert groups == [("flash_fwd", "bf16", 64, False), ("flash_fwd", "bf16", 64, True)], "default: both"
    groups.clear()
    assert tune.main(["--dtype", "bf16", "--head-dim", "64,128", "--causal", "bottom_right", *table]) == 0
    assert groups == [("flash_fwd", "bf16", 64, True), ("flash_fwd", "bf16", 128, True)]
    groups.clear()
    assert tune.main(["--kernel", "flash_bwd", "--dtype", "fp16", "--head-dim", "96", "--causal", "none",
                      "--causal", "top_left", *table]) == 0  # the flag repeats, as prewarm's does
    assert groups == [("flash_bwd", "fp16", 96, False), ("flash_bwd", "fp16", 96, True)]
    groups.clear()
    assert tune.main(["--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "64", "--causal", "top_left",
                      *table]) == 0
    assert groups == [("flash_decode", "bf16", 64, False)], "decoding is tuned unmasked whatever --causal says"
