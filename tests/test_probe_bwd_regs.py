"""experiments/probe_bwd_regs.py on CPU: its reading of ptxas -v logs, its occupancy estimate, its config syntax.

The logs below are what Triton 3.9 (ptxas 12.9, "ptxas-blackwell") and
Triton 3.6 (ptxas 12.8) printed for the backward's kernels at head dim 256,
sm_90, bf16 (this machine, 2026-12-01).
"""

from __future__ import annotations

import csv
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

PROBE = REPO / "experiments" / "probe_bwd_regs.py"

# dK/dV 64/64, 4 warps, 2 stages (Triton 3.9): spills, and the wgmma were serialised.
LOG_SPILLING = """\
ptxas-blackwell info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
insufficient register resources for the function 'flash_bwd_dkdv_kernel'
ptxas-blackwell info    : 11 bytes gmem
ptxas-blackwell info    : Compiling entry function 'flash_bwd_dkdv_kernel' for 'sm_90a'
ptxas-blackwell info    : Function properties for flash_bwd_dkdv_kernel
    1672 bytes stack frame, 2692 bytes spill stores, 2196 bytes spill loads
ptxas-blackwell info    : Used 255 registers, used 1 barriers, 1672 bytes cumulative stack size
ptxas-blackwell info    : Compile time = 1015.896 ms
"""

# dq 128/32, 8 warps, 3 stages: no spills; a second function in the same log (made up) must not be mixed in.
LOG_CLEAN_TWO_FUNCTIONS = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'flash_bwd_dq_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_bwd_dq_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 233 registers, used 1 barriers, 464 bytes cmem[0]
ptxas info    : Compiling entry function 'other_kernel' for 'sm_90a'
ptxas info    : Function properties for other_kernel
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, 384 bytes cmem[0]
"""


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(PROBE.parent))
    module = importlib.import_module("probe_bwd_regs")
    yield module
    sys.modules.pop("probe_bwd_regs", None)


def test_parse_reads_registers_spills_and_the_serialised_wgmma(probe: ModuleType) -> None:
    info = probe.parse_ptxas(LOG_SPILLING)
    assert info == probe.PtxasInfo("flash_bwd_dkdv_kernel", 255, 1672, 2692, 2196, True)
    assert probe.parse_ptxas(LOG_SPILLING, "flash_bwd_dkdv_kernel") == info


def test_parse_keeps_functions_apart(probe: ModuleType) -> None:
    assert probe.parse_ptxas(LOG_CLEAN_TWO_FUNCTIONS) == probe.PtxasInfo("flash_bwd_dq_kernel", 233, 0, 0, 0, False)
    assert probe.parse_ptxas(LOG_CLEAN_TWO_FUNCTIONS, "other_kernel") == probe.PtxasInfo("other_kernel", 40, 8, 4, 4,
                                                                                          False)


@pytest.mark.parametrize("log", ["", "ptxas info    : 11 bytes gmem\n", LOG_SPILLING.replace("Used 255", "Used x")])
def test_parse_without_a_register_count_is_a_value_error(probe: ModuleType, log: str) -> None:
    with pytest.raises(ValueError, match="no register count"):
        probe.parse_ptxas(log)
    with pytest.raises(ValueError, match="no register count for function 'missing'"):
        probe.parse_ptxas(LOG_SPILLING, "missing")


def test_occupancy_by_registers_and_shared_memory(probe: ModuleType) -> None:
    kib = 1024
    # 255 registers round to 256 a thread: 8192 a warp, 2 warps per sub-partition, 8 warps an SM.
    assert probe.occupancy(255, 4, int(192.5 * kib)) == (2, 1, 1)
    assert probe.occupancy(255, 8, 96 * kib) == (1, 2, 1)
    # 233 round to 240: 7680 a warp, still 2 per sub-partition.
    assert probe.occupancy(233, 8, 224 * kib) == (1, 1, 1)
    # 128 registers, 4 warps: 16 warps an SM, 4 CTAs; shared memory allows 227 // 33 = 6.
    assert probe.occupancy(128, 4, 32 * kib) == (4, 6, 4)
    # Tiny kernels stop at the SM's 64 warps and 32 CTAs.
    assert probe.occupancy(16, 1, 0) == (64, 32, 32)
    # Too much shared memory for one CTA: 0.
    assert probe.occupancy(200, 8, 256 * kib)[1:] == (0, 0)
    with pytest.raises(ValueError, match="registers and num_warps must be positive"):
        probe.occupancy(0, 4, 0)


def test_config_syntax(probe: ModuleType) -> None:
    from lazytriton.tiles import Config

    assert probe.parse_config("dq:128/32/8/3") == ("flash_bwd_dq", Config(128, 32, 8, 3))
    assert probe.parse_config("dkdv:64/32/8/2") == ("flash_bwd_dkdv", Config(64, 32, 8, 2))
    for bad in ("fwd:1/2/3/4", "dq:1/2/3", "dq:a/2/3/4", "dq128/32/8/3"):
        with pytest.raises(ValueError, match="--config must be"):
            probe.parse_config(bad)


def test_table_row_of_a_failed_compile_says_so(probe: ModuleType) -> None:
    failed = probe.Probe("flash_bwd_dq", "bf16", 256, False, 64, 32, 4, 1, None, 0, 1.0, "CompileError: boom")
    row = probe.table_row(failed, probe.SmLimits())
    assert len(row) == len(probe.HEADER) and row[5:7] == ("error", "CompileError: boom")
    ok = failed._replace(info=probe.PtxasInfo("f", 255, 8, 4, 4, True), shared=96 * 1024, error="")
    row = probe.table_row(ok, probe.SmLimits())
    assert len(row) == len(probe.HEADER)
    assert dict(zip(probe.HEADER, row, strict=True)) | {"compile_s": ""} == {
        "kernel": "dq", "dtype": "bf16", "hd": "256", "causal": "0", "M/N/w/s": "64/32/4/1", "regs": "255",
        "stack": "8", "spill_st": "4", "spill_ld": "4", "wgmma_ser": "yes", "mma": "?", "ldl+stl": "?",
        "smem_KiB": "96.0", "cta_regs": "2",
        "cta_smem": "2", "cta_sm": "2", "warps_sm": "8", "compile_s": ""}
    with_sass = ok._replace(ops=probe.sass_ops(SASS))
    assert probe.table_row(with_sass, probe.SmLimits())[10:12] == ("wgmma", "3")


# Lines of `cuobjdump -sass` of dK/dV 64/64, 4 warps, 2 stages at head dim 256 (Triton 3.6), encodings cut.
SASS = """\
        /*0940*/              @!P3 LDG.E.128 R128, desc[UR4][R18.64] ;
        /*0b80*/                   STL [R1], RZ ;
        /*0cd0*/               @P3 LOP3.LUT R0, R0, 0x80, RZ, 0xfc, !PT ;
        /*1d00*/              @!PT LDS RZ, [RZ] ;
        /*3df0*/                   LDL R15, [R1+0x2e8] ;
        /*3e10*/                   LDL R2, [R1+0x3f0] ;
        /*5480*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*5ae0*/                   WARPGROUP.ARRIVE ;
        /*5bd0*/                   HGMMA.64x64x16.F32.BF16 R152, gdesc[UR56], RZ, !UPT, gsb0 ;
        /*5ce0*/                   HGMMA.64x64x16.F32.BF16 R152, gdesc[UR8], R152, gsb0 ;
"""


def test_sass_ops_count_opcodes_and_name_the_matrix_instructions(probe: ModuleType) -> None:
    ops = probe.sass_ops(SASS)
    assert ops == {"LDG": 1, "STL": 1, "LOP3": 1, "LDS": 1, "LDL": 2, "BAR": 1, "WARPGROUP": 1, "HGMMA": 2}
    assert probe.mma_kind(ops) == "wgmma" and probe.mma_kind({"HGMMA": 3, "HMMA": 1}) == "wgmma+mma"
    assert probe.mma_kind({"HMMA": 1}) == "mma"
    assert probe.mma_kind({"FFMA": 9}) == "none"


def test_one_variant_end_to_end(probe: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real compile for sm_90 (Triton's ptxas log captured, SASS read) writes a full row to the CSV."""
    out = tmp_path / "probe.csv"
    probe.main(["--head-dims", "64", "--causal", "0", "--kernels", "dq", "--config", "dq:64/32/4/2",
                "--csv", str(out)])
    header, row = list(csv.reader(out.open()))
    assert tuple(header) == probe.HEADER
    got = dict(zip(header, row, strict=True))
    assert got["kernel"] == "dq" and got["M/N/w/s"] == "64/32/4/2", got
    assert 0 < int(got["regs"]) <= 255 and int(got["spill_st"]) >= 0, got
    assert got["mma"] == "wgmma" and float(got["smem_KiB"]) > 0 and int(got["cta_sm"]) >= 1, got
    assert "# Triton" in capsys.readouterr().out
