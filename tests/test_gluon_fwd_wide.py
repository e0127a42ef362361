"""flash_fwd_gluon's wide tiles: three consumer warpgroups of 64 query rows on every K/V tile, without turns.

FlashAttention-3 runs its forward at head dim 64 on H100 this way (192 x 128
tiles, 16 warps, 160 registers a consumer thread). 192 rows do not divide the
usual seqlens, so the tiles are laid out from seqlen_q down (a multiple of 64
here): the grid's last program, the lowest rows, may start before row 0, and a
warpgroup with no rows there only releases the K/V buffers the others read.
With causal masking each warpgroup stops at its own rows' last key block and
releases the rest of the tile's. On CPU: the variant's fields, the rule, and
real sm_90 compiles (warps, shared memory, descriptors, registers, no spill
where the H200's Triton 3.6 has none). On the GPU: calls served by the wide
tiles within FlashAttention's rule, ragged last programs included.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_flash_fwd import make_qkv, on_gpu, seed_of
from test_gluon_fwd import gluon_served, sm90_ptx

from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import gluon
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

SM90 = Target.parse("sm_90")


def wide(head_dim: int = 64, causal: str = "none", sq: int = 1024, sk: int = 1024,
         tiles: tuple[int, int, int] = (192, 128, 4)) -> Variant | None:
    return gluon.variant("sm_90", "bf16", head_dim, causal, True, False, sq, sk, producer=True, tiles=tiles)


def test_the_wide_variant_is_producer_without_pingpong_at_192_rows() -> None:
    variant = wide()
    assert variant is not None and check_fields(variant) is variant
    assert str(variant) == ("flash_fwd_gluon:sm_90:bf16:ALIGN16=true,BLOCK_D=64,CAUSAL=false,EVEN_D=true,"
                            "INDEX64=false:BLOCK_M=192,BLOCK_N=128,PINGPONG=false,PRODUCER=true:"
                            "num_stages=3,num_warps=4")
    assert Variant.parse(str(variant)) == variant


def test_only_the_kernels_wide_block_may_be_three_times_a_power_of_two() -> None:
    text = str(wide())
    assert check_fields(Variant.parse(text)).get("BLOCK_M") == 192
    assert check_fields(Variant.parse(text.replace("BLOCK_M=192", "BLOCK_M=48"))).get("BLOCK_M") == 48  # 3 x 16
    for bad, name in ((text.replace("BLOCK_N=128", "BLOCK_N=192"), "BLOCK_N=192"),  # not a wide block
                      (text.replace("BLOCK_M=192", "BLOCK_M=320"), "BLOCK_M=320"),  # 5 x 64
                      (text.replace("BLOCK_M=192", "BLOCK_M=24"), "BLOCK_M=24")):  # 3 x 8: no whole warp's rows
        with pytest.raises(ValueError, match=re.escape(name) + r" must be a power of two"):
            check_fields(Variant.parse(bad))
    plain = fwd_dispatch.flash_fwd_variant(SM90, "bf16", 64, False, True, 4096, seqlen_k=4096)
    odd = str(plain).replace(f"BLOCK_M={plain.get('BLOCK_M')}", "BLOCK_M=192")
    with pytest.raises(ValueError, match=r"BLOCK_M=192 must be a power of two in"):
        check_fields(Variant.parse(odd))  # flash_fwd's BLOCK_M is one Triton tile


def test_the_wide_tiles_need_the_producer_one_query_tile_and_no_pingpong() -> None:
    with pytest.raises(ValueError, match=r"tiles must be one of .* got \(192, 128, 4\)"):
        gluon.variant("sm_90", "bf16", 64, "none", True, False, 1024, 1024, tiles=(192, 128, 4))
    with pytest.raises(ValueError, match=r"with pingpong, got \(192, 128, 4\)"):
        gluon.variant("sm_90", "bf16", 64, "none", True, False, 1024, 1024, pingpong=True, tiles=(192, 128, 4))
    with pytest.raises(ValueError, match="q_tiles"):
        gluon.variant("sm_90", "bf16", 64, "none", True, False, 1024, 1024, producer=True, tiles=(192, 128, 4),
                      q_tiles=2)


def test_seqlen_q_need_only_be_whole_warpgroups_of_rows() -> None:
    assert gluon.whole_rows(192) == 64 and gluon.whole_rows(128) == 128 and gluon.whole_rows(128, 4) == 512
    for sq in (64, 128, 1024, 4096, 16384, 576):  # only 576 a multiple of 192
        assert wide(sq=sq) is not None, sq
    assert wide(sq=1000) is None
    assert "multiples of the tiles (64, 128)" in str(gluon.reason("sm_90", "bf16", 64, "none", True, False, 1000,
                                                                    1024, 192, 128))
    assert wide(sk=1024 + 64) is None  # keys stay whole BLOCK_N tiles
    assert wide(sk=1024 + 64, tiles=(192, 64, 4)) is not None


def test_the_wide_tiles_are_kept_where_their_buffers_fit_and_their_registers_do() -> None:
    # Q 192 rows + 3 stages of 128 x 64 K and V at head dim 64: 120 KiB
    assert gluon.wide_configs(64) == gluon.WIDE_CONFIGS
    assert gluon.shared_bytes(64, 192, 128) == 2 * 64 * (192 + 2 * 3 * 128)
    # O's width / 2 registers and BLOCK_N for the scores and P: 80 / 128 would need 168 of the 160
    assert gluon.wide_configs(80) == gluon.wide_configs(96) == gluon.wide_configs(160) == ((192, 64, 4),)
    assert gluon.fits(256, 192, 64) and not gluon.wide_configs(256)  # the buffers fit, O alone is 128 registers
    assert not gluon.wide_configs(192)
    with pytest.raises(ValueError, match="tiles must be one of"):
        wide(256)


def test_dispatch_serves_a_wide_row_for_seqlens_of_whole_warpgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    row = ((192, 128, 4), True, False)
    monkeypatch.setitem(fwd_dispatch.GLUON_TABLE, ("bf16", 64, True), row)
    assert fwd_dispatch.flash_fwd_gluon_default("bf16", 64, True) == row
    assert fwd_dispatch.flash_fwd_gluon_fits("bf16", 64, True, 0, 0.125, 1024, 1024)
    assert not fwd_dispatch.flash_fwd_gluon_fits("bf16", 64, True, 0, 0.125, 1000, 1024)
    assert fwd_dispatch.flash_fwd_gluon_q_tiles("bf16", 64, True, 0, 0.125, 1024, 1024) == 1
    got = fwd_dispatch.flash_fwd_gluon_default_variant(SM90, "bf16", 64, True, True, False, 1024, 1024)
    assert got is not None and got.get("BLOCK_M") == 192 and got.get("PINGPONG") is False
    monkeypatch.setitem(fwd_dispatch.GLUON_TABLE, ("bf16", 256, True), ((192, 64, 4), True, False))
    assert fwd_dispatch.flash_fwd_gluon_default("bf16", 256, True) is None  # over the registers: flash_fwd serves


@pytest.mark.parametrize("head_dim, causal, tiles", [(64, "none", (192, 128, 4)), (64, "top_left", (192, 128, 4)),
                                                     (96, "top_left", (192, 64, 4))])
def test_compiles_for_sm90_with_sixteen_warps_and_three_consumers_of_160_registers(head_dim: int, causal: str,
                                                                                  tiles: tuple[int, int, int]) -> None:
    from lazytriton.compiler import compile_variant

    variant = wide(head_dim, causal, tiles=tiles)
    assert variant is not None
    entry = compile_variant(variant)
    assert entry.num_warps == 16  # 3 consumer warpgroups + the producer warp's, padded to a warpgroup
    assert 0 <= entry.shared - gluon.shared_bytes(head_dim, 192, tiles[1]) <= gluon.SHARED_SLACK
    # one a tensor: 96 = 64 + 32 shares its descriptors between the chunks (kernels/gluon_tma.py, 17th session)
    descriptors = 1
    assert entry.global_scratch_size == descriptors * 8 * 128  # each consumer Q's and Out's, the producer K's, V's
    ptx = sm90_ptx(variant)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t160;") == 2  # the two worker consumers
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx  # the producer
    assert not re.search(r"setmaxnreg\.\w+\.sync\.aligned\.u32 \t240;", ptx)  # no ping-pong budget
    assert "mbarrier.try_wait.parity" in ptx and "cp.async.bulk.tensor.2d.global.shared" in ptx


@on_gpu
@pytest.mark.parametrize("dtype, head_dim, causal, heads, seqlens, tiles", [
    (torch.bfloat16, 64, False, (4, 4), (1024, 1024), (192, 128, 4)),  # 6 programs, the last with one warpgroup
    (torch.bfloat16, 64, True, (4, 4), (1024, 1024), (192, 128, 4)),
    (torch.float16, 64, True, (8, 2), (576, 1024), (192, 128, 4)),  # GQA; 576 = 3 x 192: no ragged program
    (torch.bfloat16, 64, "bottom_right", (2, 2), (640, 1536), (192, 128, 4)),  # causal offset 896
    (torch.bfloat16, 64, True, (2, 2), (128, 128), (192, 128, 4)),  # one program, two of its rows' warpgroups
    (torch.bfloat16, 96, True, (4, 4), (1024, 1024), (192, 64, 4)),  # split head dim (64 + 32)
    (torch.float16, 80, False, (4, 4), (1024, 1024), (192, 64, 4)),  # split head dim (64 + 16)
], ids=str)
def test_the_wide_tiles_serve_attn_fwd_on_gpu(dtype: torch.dtype, head_dim: int, causal: bool | str,
                                              heads: tuple[int, int], seqlens: tuple[int, int],
                                              tiles: tuple[int, int, int], resolved: list[Variant],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A GLUON_TABLE row with the wide tiles, served by a plain call cold and warm, within FlashAttention's rule."""
    from lazytriton import runtime

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    monkeypatch.setitem(fwd_dispatch.GLUON_TABLE, (name, head_dim, causal is not False), (tiles, True, False))
    runtime.reset()  # plans memoised by another test would hide the variant from the resolve spy
    q, k, v = make_qkv(2, heads, seqlens, head_dim, dtype, "cuda", seed_of("gluon-wide", head_dim, causal, seqlens))
    served = gluon_served(q, k, v, causal, resolved)
    assert served and served[-1].get("BLOCK_M") == 192, served
    runtime.reset()
