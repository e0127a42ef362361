"""benchmarks/bench_flash_fwd_mla.py on CPU: one case checked against SDPA's joined form, timed, its rows written."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from conftest import REPO


def test_a_case_checks_and_times_its_providers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_flash_fwd_mla as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "MLA_TOKENS", 32)
    monkeypatch.setattr(bench, "MLA_HEADS", 2)
    seen: list[list[str]] = []

    def turns(fns: dict[str, Any]) -> tuple[list[str], list[float]]:
        seen.append(list(fns))
        return list(fns), [1.0] * len(fns)

    rows = bench.mla_case(16, 64, 512, True, True, {"kernel": "flash_fwd"}, turns)
    names = [row["provider"] for row in rows]
    assert names[0] == "lazytriton_mla" and names[-1] == "sdpa_efficient"
    assert "lazytriton_mla" in seen[0], "checked against SDPA within the error bound, then timed"
    assert float(str(rows[0]["rel_err"])) < bench.MAX_REL_ERR and rows[0]["mode"] == "fwd_mla_dv512_qv"
    sys.modules.pop("bench_flash_fwd_mla", None)
