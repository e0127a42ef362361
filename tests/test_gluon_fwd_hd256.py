"""flash_fwd_gluon at head dim 256: tiles, registers and spills, both Tritons, dispatch plumbing, GPU numerics.

FlashAttention-3's hdim256 forward: BLOCK_M 128 (two consumer warpgroups of
64 rows, or ping-pong), BLOCK_N 64, 2 stages: Q 64 KiB and four 32 KiB K/V
buffers, 192 KiB of sm_90's 227; O is 64 x 256 fp32 a warpgroup, 128
registers a thread. flash_fwd.dispatch.GLUON_TABLE's hd256 rows are the H200
sweep's winner (experiments/probe_gluon.py --head-dims 256, 2026-12-01); the
plumbing tests here patch a row in, so they hold whatever the table ships.
The GPU tests run on the H200 host.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, ptxas_report
from test_flash_fwd import check_attention, make_qkv, on_gpu, seed_of
from test_gluon_fwd import SM90, gluon_variant, sm90_ptx

from lazytriton import machine
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import gluon
from lazytriton.variant import Variant

GLUON = "flash_fwd_gluon"


# ---------------------------------------------------------------------------
# Head dim 256: FlashAttention-3's hdim256 tiles (BLOCK_M 128, BLOCK_N 64, 2 stages), fit and registers


def test_head_dim_256_takes_only_the_tiles_that_fit_shared_memory() -> None:
    assert gluon.configs(256) == ((128, 64, 8), (64, 64, 4))
    assert gluon.configs(256, pingpong=True) == ((128, 64, 4),)
    assert gluon.configs(128) == gluon.CONFIGS and gluon.configs(64, pingpong=True) == gluon.PINGPONG_CONFIGS
    why = gluon.reason("sm_90", "bf16", 256, "none", True, False, 4096, 4096, 128, 128)
    assert why is not None and "shared memory" in why and "327680" in why  # Q 64 KiB + 2 x 2 x 64 KiB
    with pytest.raises(ValueError, match=r"at head dim 256, got \(128, 128, 8\)"):
        gluon_variant(256, tiles=(128, 128, 8))
    with pytest.raises(ValueError, match=r"at head dim 256 with pingpong, got \(128, 128, 4\)"):
        gluon_variant(256, pingpong=True, tiles=(128, 128, 4))
    v = gluon_variant(256, True)
    assert v is not None and (v.get("BLOCK_M"), v.get("BLOCK_N"), v.get("num_warps")) == (128, 64, 8)
    assert v.get("BLOCK_D") == 256 and v.get("num_stages") == 2
    pp = gluon_variant(256, True, pingpong=True)
    assert pp is not None and (pp.get("BLOCK_M"), pp.get("BLOCK_N"), pp.get("num_warps")) == (128, 64, 4)
    assert gluon_variant(256, sq=4096 + 64) is None  # whole 128-row query tiles
    assert gluon_variant(256, sk=4096 + 64) is not None  # 64-key tiles


@pytest.mark.parametrize("tiles, producer, pingpong", [((128, 64, 8), False, False), ((128, 64, 8), True, False),
                                                       ((128, 64, 4), True, True), ((64, 64, 4), False, False)])
def test_head_dim_256_tilings_fit_the_registers_without_spills(tiles: tuple[int, int, int], producer: bool,
                                                               pingpong: bool, tmp_path: Path) -> None:
    """Every hd256 tiling the probe sweeps, causal (the most registers): O is 64 x 256 fp32 a warpgroup, 128
    registers a thread. ptxas -v (Triton 3.9's 13.4; 3.6's bundled one alike): 217-247 of 255 without warp
    specialisation; 168 at launch with it (setmaxnreg then gives each consumer 240); never a spill."""
    variant = gluon_variant(256, True, tiles=tiles, producer=producer, pingpong=pingpong)
    assert variant is not None
    ptx = sm90_ptx(variant)
    regs, stores, loads = ptxas_report(ptx, tmp_path)
    assert (stores, loads) == (0, 0)
    assert regs <= (168 if producer else 255)
    if producer:
        assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx and ptx.count("setmaxnreg") >= 2
    # A 512-byte row is over the 128-byte swizzle span of one TMA box: Triton issues 64-column boxes.
    assert re.search(r"tensormap\.replace\.tile\.box_dim[^\n]*0x0, %r\d+;", ptx)
    assert ptx.count("wgmma.mma_async") > 0 and "ld.local" not in ptx


OTHER_TRITON = "LAZYTRITON_TEST_OTHER_TRITON_PYTHON"


def test_head_dim_256_compiles_under_the_other_triton_too() -> None:
    """The GPU host runs Triton 3.6 and CI 3.9: with ``$LAZYTRITON_TEST_OTHER_TRITON_PYTHON`` naming a Python
    whose environment has the other version (and this checkout's lazytriton), each hd256 tiling compiles there
    too, with the same shared memory. (This whole file also runs under either version as it is.)"""
    python = os.environ.get(OTHER_TRITON)
    if not python:
        pytest.skip(f"set {OTHER_TRITON} to a Python with the other Triton version (3.6 beside 3.9) to run this")
    code = (
        "from lazytriton.compiler import compile_variant, triton_version\n"
        "from lazytriton.kernels.flash_fwd import gluon\n"
        "for tiles, producer, pingpong in (((128, 64, 8), False, False), ((128, 64, 8), True, False),\n"
        "                                  ((128, 64, 4), True, True), ((64, 64, 4), False, False)):\n"
        "    v = gluon.variant('sm_90', 'bf16', 256, 'top_left', True, False, 4096, 4096, tiles=tiles,\n"
        "                      producer=producer, pingpong=pingpong)\n"
        "    print('ENTRY', triton_version(), tiles, pingpong, compile_variant(v).shared)\n")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=900, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split(" ", 2) for line in done.stdout.splitlines() if line.startswith("ENTRY")]
    from lazytriton.compiler import triton_version

    assert len(lines) == 4 and all(version != triton_version() for _, version, _ in lines)
    assert [int(line[2].rsplit(" ", 1)[1]) for line in lines] == [196808, 196812, 197096, 164040]


# ---------------------------------------------------------------------------
# Head dim 256 end to end: what a GLUON_TABLE row for it serves (the fixture sets the row)

HD256_ROW = ((128, 64, 4), True, True)  # ping-pong 128 x 64 x 4: made up here, not a measurement
HD256_TILINGS = [((128, 64, 8), False, False), ((128, 64, 8), True, False), ((128, 64, 4), True, True),
                 ((64, 64, 4), False, False)]


@pytest.fixture
def hd256_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_fwd.dispatch.GLUON_TABLE with a head dim 256 row for both dtypes and causal modes (the rest as it is)."""
    table = dict(fwd_dispatch.GLUON_TABLE)
    table.update({(dtype, 256, causal): HD256_ROW for dtype in gluon.DTYPES for causal in (False, True)})
    monkeypatch.setattr(fwd_dispatch, "GLUON_TABLE", table)


@pytest.mark.usefixtures("hd256_row")
def test_a_head_dim_256_row_reaches_the_memo_key_the_plan_and_prewarm() -> None:
    from lazytriton import tuning
    from lazytriton.kernels.flash_fwd import binding
    from lazytriton.prewarm import enumeration

    fits = fwd_dispatch.flash_fwd_gluon_fits
    assert fits("bf16", 256, True, 0, 0.0625, 4096, 4096) and fits("fp16", 256, False, 0, 0.0625, 128, 64)
    assert not fits("bf16", 256, False, 0, 0.0625, 4096 + 64, 4096)  # 128-row query tiles
    q, k, v = make_qkv(1, (2, 2), (256, 512), 256, torch.bfloat16)
    call = binding.check(q, k, v, "bottom_right")
    key = binding.memo_key(-1, torch.bfloat16, call.shape, True, True, False, offset=call.offset, scale=call.scale)
    assert key[-2:] == binding.gluon_tail(2) and key[2] == 256  # 2 query tiles a program (GLUON_Q_TILES)
    assert binding.gluon_key(key)
    served = binding.variant(SM90, torch.bfloat16, call.shape, True, True, False, gluon=True)
    assert served == fwd_dispatch.flash_fwd_gluon_default_variant(SM90, "bf16", 256, True, True, False, 256, 512)
    assert (served.kernel, served.get("BLOCK_D"), served.get("BLOCK_N"), served.get("PINGPONG")) == (
        "flash_fwd_gluon", 256, 64, True)
    assert binding.variant(SM90, torch.bfloat16, call.shape, True, True, False).kernel == "flash_fwd"  # no tail
    axes = enumeration.Axes((SM90,), ("flash_fwd",), dtypes=("bf16",), head_dims=(256,), causal=(False, True),
                            seqlens_q=(4096,))
    twins = [p for p in enumeration.enumerate_variants(axes, tuning.Table(())) if p.variant.kernel == GLUON]
    assert {(t.variant.get("CAUSAL"), t.origin) for t in twins} == {(False, "gluon table"), (True, "gluon table")}
    for twin in twins:  # prewarm plans exactly the variant dispatch serves (its compile is tested above)
        assert (twin.variant.get("BLOCK_D"), twin.variant.get("BLOCK_N"), twin.variant.get("PINGPONG")) == (256, 64,
                                                                                                            True)


def test_the_shipped_head_dim_256_rows_are_the_measured_ping_pong_tiles() -> None:
    """experiments/probe_gluon.py --head-dims 256 (H200, 2026-12-01): 128 x 64, 4 warps a warpgroup, ping-pong."""
    for dtype in ("bf16", "fp16"):
        for causal in (False, True):
            assert fwd_dispatch.GLUON_TABLE[(dtype, 256, causal)] == ((128, 64, 4), True, True)
            assert fwd_dispatch.flash_fwd_gluon_fits(dtype, 256, causal, 0, 0.0625, 4096, 4096)


def test_without_a_row_head_dim_256_keeps_flash_fwd(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton.kernels.flash_fwd import binding

    monkeypatch.setattr(fwd_dispatch, "GLUON_TABLE", {key: row for key, row in fwd_dispatch.GLUON_TABLE.items()
                                                      if key[1] != 256})
    assert not fwd_dispatch.flash_fwd_gluon_fits("bf16", 256, True, 0, 0.0625, 4096, 4096)
    shape = binding.Shape(batch=1, heads_q=8, heads_k=8, seqlen_q=4096, seqlen_k=4096, head_dim=256)
    assert binding.variant(SM90, torch.bfloat16, shape, True, True, False, gluon=True).kernel == "flash_fwd"



@on_gpu
@pytest.mark.parametrize("tiling", HD256_TILINGS, ids=str)
@pytest.mark.parametrize("dtype, causal, heads, seqlens", [
    (torch.bfloat16, False, (4, 4), (256, 256)),
    (torch.bfloat16, True, (8, 2), (512, 512)),  # GQA
    (torch.float16, "bottom_right", (2, 2), (256, 768)),  # causal offset 512
    (torch.bfloat16, True, (2, 2), (128, 128)),  # one query tile, two key tiles (64 x 64: two of each)
], ids=str)
def test_head_dim_256_numerics_on_gpu(tiling: tuple[tuple[int, int, int], bool, bool], dtype: torch.dtype,
                                      causal: bool | str, heads: tuple[int, int], seqlens: tuple[int, int]) -> None:
    """Each hd256 tiling, forced through the binding, under FlashAttention's rule (experiments/probe_gluon.py
    checks the same at the benchmark's sizes)."""
    from lazytriton.kernels.flash_fwd import binding

    q, k, v = make_qkv(2, heads, seqlens, 256, dtype, "cuda", seed_of("gluon256", tiling, causal, seqlens))
    call = binding.check(q, k, v, causal)
    target = machine.target_of_device(q.device)
    if str(target) != "sm_90":
        pytest.skip(f"flash_fwd_gluon is built for sm_90, this GPU is {target}")
    tiles, producer, pingpong = tiling
    variant = fwd_dispatch.flash_fwd_gluon_variant(target, binding.DTYPES[dtype], 256, call.causal, True, False,
                                                   call.shape.seqlen_q, call.shape.seqlen_k, tiles=tiles,
                                                   scale=call.scale, producer=producer, pingpong=pingpong)
    assert variant is not None
    out, lse = binding.empty_outputs(q, call.shape)
    binding.launch_gpu(q, k, v, out, lse, call, variant=variant)
    torch.cuda.synchronize()
    check_attention(q, k, v, out, lse, causal=causal)


@on_gpu
@pytest.mark.usefixtures("hd256_row")
def test_a_head_dim_256_row_serves_attn_fwd_on_gpu(resolved: list[Variant]) -> None:
    """With a GLUON_TABLE row at head dim 256, a plain call runs flash_fwd_gluon, cold and warm, within the rule."""
    from lazytriton import flash
    q, k, v = make_qkv(1, (4, 4), (384, 640), 256, torch.bfloat16, "cuda", seed_of("gluon256-row"))
    if str(machine.target_of_device(q.device)) != "sm_90":
        pytest.skip("flash_fwd_gluon is built for sm_90")
    for _ in range(2):  # cold (plans the shape), then warm
        out, lse = flash.attn_fwd(q, k, v, causal="bottom_right")
        check_attention(q, k, v, out, lse, causal="bottom_right")
    assert any(v.kernel == GLUON and v.get("BLOCK_D") == 256 for v in resolved), resolved


def test_a_row_whose_tiles_do_not_fit_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """128 x 128 at head dim 256 needs 320 KiB: such a row is left out, and flash_fwd serves, never a ValueError."""
    table = dict(fwd_dispatch.GLUON_TABLE)
    table[("bf16", 256, False)] = ((128, 128, 8), False, False)
    monkeypatch.setattr(fwd_dispatch, "GLUON_TABLE", table)
    assert fwd_dispatch.flash_fwd_gluon_default("bf16", 256, False) is None
    assert not fwd_dispatch.flash_fwd_gluon_fits("bf16", 256, False, 0, 0.0625, 4096, 4096)
    assert fwd_dispatch.flash_fwd_gluon_default_variant(SM90, "bf16", 256, False, True, False, 4096, 4096) is None
    table[("bf16", 256, False)] = HD256_ROW
    assert fwd_dispatch.flash_fwd_gluon_default("bf16", 256, False) == HD256_ROW
