"""experiments/probe_paged_stages.py on CPU: the rows it writes are what dispatch serves, and it leaves the user's
tuning table as it found it (its timing needs a GPU)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import load_experiment

from lazytriton import target, tuning
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    return load_experiment("probe_paged_stages")


@pytest.mark.parametrize("paged", [False, True])
def test_the_replaced_rows_are_the_tiles_dispatch_serves(probe: ModuleType, paged: bool) -> None:
    rows = probe.override_rows(128, [16384, 32768], 64, 4, 5)
    assert {r.seqlen_k for r in rows} == {16384, 32768}
    table = tuning.merge(tuning.read_table(tuning.table_path(probe.SPLIT)), rows)
    sm90 = target.target_from_cuda_capability(9, 0)
    for capacity in (16384, 32768):
        config, row = decode_dispatch.decode_config(probe.SPLIT, sm90, "bf16", 128, False, 4, capacity,
                                                    256 if paged else 0, table, paged)
        assert row is not None and (config.block_n, config.num_warps, config.num_stages) == (64, 4, 5)


def test_a_head_dim_without_rows_is_refused(probe: ModuleType) -> None:
    with pytest.raises(SystemExit, match="nothing to replace"):
        probe.override_rows(96, [32768], 64, 4, 5)


@pytest.mark.parametrize("had_table", [False, True])
def test_the_users_table_is_restored_after_the_runs(probe: ModuleType, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, had_table: bool) -> None:
    user = tmp_path / "tuning" / "flash_decode.csv"
    monkeypatch.setattr(probe.tuning, "user_table_path", lambda kernel: user)
    if had_table:
        user.parent.mkdir(parents=True)
        user.write_bytes(b"the user's own rows\n")
    seen: list[str | None] = []

    def fake_bench(args: argparse.Namespace, rows: list[tuning.Row] | None, path: Path, out_csv: Path) -> None:
        probe.write_user_table(rows, path)
        seen.append(path.read_text() if path.exists() else None)
        out_csv.write_text("provider,layout,batch,cache_len,p50_ms,gb_s\n"
                           "lazytriton,paged,1,32768,0.05,2500\nsdpa,paged,1,32768,0.048,2600\n")

    monkeypatch.setattr(probe, "run_bench", fake_bench)
    monkeypatch.setattr(sys, "argv", ["probe_paged_stages.py", "--lengths", "32k", "--stages", "2,5"])
    probe.main()
    assert seen[0] is None and all(text is not None and ",64,4," in text for text in seen[1:])
    assert len(seen) == 3
    assert (user.read_bytes() == b"the user's own rows\n") if had_table else not user.exists()


def test_page_sizes_reach_the_bench_and_stay_apart(probe: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(probe.tuning, "user_table_path", lambda kernel: tmp_path / "tuning" / "flash_decode.csv")
    asked: list[str] = []

    def fake_bench(args: argparse.Namespace, rows: list[tuning.Row] | None, path: Path, out_csv: Path) -> None:
        asked.append(args.page_size)
        out_csv.write_text("provider,layout,batch,cache_len,page_size,p50_ms,gb_s\n"
                           "lazytriton,paged,1,4096,1,0.02,1200\nsdpa,paged,1,4096,1,0.018,1300\n"
                           "lazytriton,paged,1,4096,16,0.03,900\nsdpa,paged,1,4096,16,0.018,1300\n"
                           "lazytriton,contiguous,1,4096,,0.015,1400\nsdpa,contiguous,1,4096,,0.014,1450\n")

    monkeypatch.setattr(probe, "run_bench", fake_bench)
    monkeypatch.setattr(sys, "argv", ["probe_paged_stages.py", "--lengths", "4k", "--stages", "3",
                                      "--page-size", "1,16"])
    probe.main()
    assert asked == ["1,16", "1,16"]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[2:]] == [["contiguous", "b1", "4k"], ["paged", "p1", "b1"],
                                                        ["paged", "p16", "b1"]]
    assert " 0.60 " in lines[-1] and " 0.90 " in lines[-2]  # each page size's own time against its SDPA row
