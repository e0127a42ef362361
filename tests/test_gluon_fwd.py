"""flash_fwd_gluon on CPU: its registration, dispatch's rule, its parameter layout, and real sm_90 compiles.

The kernel itself runs only on a Hopper GPU (Triton's interpreter does not
run Gluon): experiments/probe_gluon.py checks its numbers on the H200. Here,
the host side: the spec shares flash_fwd's parameters (so the binding packs
its arguments unchanged), dispatch's rule refuses every call the kernel does
not compute exactly, and the installed Triton (3.9 on CI; the same file runs
under 3.6 in the brief's second venv) compiles it for cuda:90 through
lazytriton's own compile path into an Entry with TMA, wgmma and mbarrier code.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import REPO
from test_flash_fwd import check_attention, make_qkv, on_gpu, seed_of

from lazytriton import machine
from lazytriton.kernels import get, source_fingerprint
from lazytriton.kernels.flash_fwd import FLASH_FWD, gluon
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

SM90 = Target.parse("sm_90")


def gluon_variant(head_dim: int = 128, causal: object = False, sq: int = 4096, sk: int = 4096,
                  dtype: str = "bf16", **kw: object) -> Variant | None:
    return fwd_dispatch.flash_fwd_gluon_variant(SM90, dtype, head_dim, causal, True, False, sq, sk, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Registration and parameter layout


def test_the_spec_shares_flash_fwds_parameters_and_has_its_own_source() -> None:
    spec = get("flash_fwd_gluon")
    assert spec.params == FLASH_FWD.params  # binding.pack, the grid and the C launcher's layout hold as they are
    assert spec.aligned_params == FLASH_FWD.aligned_params
    assert spec.source_path.name == "gluon_kernel.py"
    assert source_fingerprint("flash_fwd_gluon") != source_fingerprint("flash_fwd")


def test_the_variant_is_complete_round_trips_and_keys_apart_from_flash_fwd() -> None:
    v = gluon_variant(128, True)
    assert v is not None
    assert str(v) == ("flash_fwd_gluon:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=true,EVEN_D=true,INDEX64=false:"
                      "BLOCK_M=128,BLOCK_N=128,PINGPONG=false,PRODUCER=false:num_stages=2,num_warps=8")
    assert check_fields(v) is v
    assert Variant.parse(str(v)) == v
    plain = fwd_dispatch.flash_fwd_variant(SM90, "bf16", 128, True, True, 4096, seqlen_k=4096)
    assert plain.kernel == "flash_fwd"  # not the default: dispatch's own choice is unchanged
    assert v.functional == plain.functional  # the same call's functional fields, read alike by `cache explain`
    assert v.key() != plain.key()


def test_stages_follow_the_kernels_own_rule() -> None:
    assert [gluon.stages(d, n) for d, n in ((64, 64), (64, 128), (128, 64), (128, 128), (256, 64))] == [3, 3, 3, 2, 2]
    assert gluon_variant(64).get("num_stages") == 3  # type: ignore[union-attr]
    assert gluon_variant(256).get("num_stages") == 2  # type: ignore[union-attr]


def test_tiles_outside_the_kernels_configs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tiles must be one of .* got \(128, 128, 4\)"):
        gluon_variant(tiles=(128, 128, 4))  # BLOCK_M must be 16 x num_warps
    assert gluon_variant(tiles=(64, 64, 4)).tuned == (("BLOCK_M", 64), ("BLOCK_N", 64), ("PINGPONG", False),  # type: ignore[union-attr]
                                                      ("PRODUCER", False))
    assert gluon_variant(producer=True).get("PRODUCER") is True  # type: ignore[union-attr]


# ---------------------------------------------------------------------------
# Dispatch's rule: every call the kernel would not compute exactly goes to flash_fwd


@pytest.mark.parametrize("target, dtype, head_dim, causal, aligned, index64, sq, sk, features, why", [
    ("sm_80", "bf16", 128, "none", True, False, 4096, 4096, False, "target"),
    ("sm_100", "bf16", 128, "none", True, False, 4096, 4096, False, "target"),
    ("sm_90", "fp32", 128, "none", True, False, 4096, 4096, False, "dtype"),
    ("sm_90", "bf16", 100, "none", True, False, 4096, 4096, False, "head dim"),  # rows of 200 bytes: no TMA
    ("sm_90", "bf16", 8, "none", True, False, 4096, 4096, False, "head dim"),  # under wgmma's k-step
    ("sm_90", "bf16", 264, "none", True, False, 4096, 4096, False, "head dim"),
    ("sm_90", "bf16", 128, "none", False, False, 4096, 4096, False, "aligned"),
    ("sm_90", "bf16", 128, "none", True, True, 4096, 4096, False, "32-bit"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4096, True, "not implemented"),
    ("sm_90", "bf16", 128, "none", True, False, 4000, 4096, False, "multiples"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4000, False, "multiples"),
    ("sm_90", "bf16", 128, "none", True, False, 0, 4096, False, "positive"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 0, False, "positive"),  # no key block: nothing to wait for
    ("sm_90", "bf16", 128, "bottom_right", True, False, 2048, 1024, False, "without keys"),
])
def test_reason_refuses_what_the_kernel_does_not_compute(target: str, dtype: str, head_dim: int, causal: str,
                                                         aligned: bool, index64: bool, sq: int, sk: int,
                                                         features: bool, why: str) -> None:
    got = gluon.reason(target, dtype, head_dim, causal, aligned, index64, sq, sk, 128, 128, features)
    assert got is not None and why in got
    assert gluon.variant(target, dtype, head_dim, causal, aligned, index64, sq, sk, features) is None


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan")])
def test_reason_refuses_a_softmax_scale_that_is_not_positive(scale: float) -> None:
    got = gluon.reason("sm_90", "bf16", 128, "none", True, False, 4096, 4096, 128, 128, scale=scale)
    assert got is not None and "not positive" in got
    assert gluon_variant(scale=scale) is None
    assert gluon_variant(scale=0.01) is not None


@pytest.mark.parametrize("causal, sq, sk", [("none", 128, 128), ("top_left", 4096, 4096), ("top_left", 2048, 1024),
                                            ("bottom_right", 1024, 2048), ("bottom_right", 1024, 1024),
                                            ("none", 512, 1536)])
def test_reason_takes_dense_tiled_calls(causal: str, sq: int, sk: int) -> None:
    for dtype in gluon.DTYPES:
        for head_dim in gluon.HEAD_DIMS:
            block_m, block_n, _ = gluon.DEFAULT_TILES[head_dim]
            assert gluon.reason("sm_90", dtype, head_dim, causal, True, False, sq, sk, block_m, block_n) is None


def test_dispatch_normalises_causal_as_flash_fwd_does() -> None:
    assert gluon_variant(causal=True) == gluon_variant(causal="top_left")
    assert gluon_variant(causal=False).get("CAUSAL") is False  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="causal must be"):
        gluon_variant(causal="upper")


# ---------------------------------------------------------------------------
# Dispatch's default: GLUON_TABLE's rows, for calls whose memo key carries the gluon tail


def test_the_table_rows_are_variants_the_kernel_takes() -> None:
    for (dtype, head_dim, causal), (tiles, producer, pingpong) in fwd_dispatch.GLUON_TABLE.items():
        assert dtype in gluon.DTYPES and gluon.reason("sm_90", dtype, head_dim, "none", True, False, 4096, 4096,
                                                      *tiles[:2]) is None
        for seqlen in (1024, 4096, 16384):
            v = fwd_dispatch.flash_fwd_gluon_default_variant(SM90, dtype, head_dim, causal, True, False, seqlen, seqlen)
            assert v is not None and v.get("CAUSAL") is causal
            if seqlen > fwd_dispatch.GLUON_WIDE.get((dtype, head_dim, causal), (1 << 31,))[0]:
                assert (v.get("BLOCK_M"), v.get("PRODUCER"), v.get("PINGPONG")) == (192, True, False)  # GLUON_WIDE's
                continue
            q_tiles = fwd_dispatch.gluon_q_tiles(head_dim, causal, seqlen, tiles[0]) if pingpong else 1
            assert (v.get("BLOCK_M"), v.get("BLOCK_N"), v.get("num_warps")) == (tiles[0] * q_tiles, *tiles[1:])
            assert v.constexprs.get("BLOCK_TILES", 1) == q_tiles  # absent for one tile: no field in the string
            assert (v.get("PRODUCER"), v.get("PINGPONG")) == (producer or pingpong, pingpong)


def test_the_wide_rows_serve_past_their_bound_and_the_table_or_flash_fwd_up_to_it() -> None:
    assert fwd_dispatch.GLUON_WIDE  # measured rows (NOTES.md, 2026-12-02)
    for (dtype, head_dim, causal), (most, tiles) in fwd_dispatch.GLUON_WIDE.items():
        assert most & (most - 1) == 0 and tiles in gluon.wide_configs(head_dim)  # the memo key's buckets decide
        longer = fwd_dispatch.flash_fwd_gluon_default_variant(SM90, dtype, head_dim, causal, True, False, 2 * most,
                                                              2 * most)
        assert longer is not None and (longer.get("BLOCK_M"), longer.get("BLOCK_N")) == tiles[:2]
        assert fwd_dispatch.flash_fwd_gluon_q_tiles(dtype, head_dim, causal, 0, 0.1, 2 * most, 2 * most) == 1
        assert fwd_dispatch.flash_fwd_gluon_q_tiles(dtype, head_dim, causal, 0, 0.1, most + 64, 2 * most) == 1
        assert fwd_dispatch.flash_fwd_gluon_q_tiles(dtype, head_dim, causal, 0, 0.1, most + 32, 2 * most) == 0
        up_to = fwd_dispatch.flash_fwd_gluon_default_variant(SM90, dtype, head_dim, causal, True, False, most, most)
        table = fwd_dispatch.GLUON_TABLE.get((dtype, head_dim, causal))
        assert (up_to is None) == (table is None)  # a row up to the bound (hd64 causal's too)
        assert up_to is None or up_to.get("BLOCK_M") != 192
    assert fwd_dispatch.flash_fwd_gluon_q_tiles("bf16", 64, True, 0, 0.125, 1024, 1024) == 8  # ping-pong x8
    assert fwd_dispatch.flash_fwd_gluon_q_tiles("bf16", 64, True, 0, 0.125, 4096, 4096) == 1  # the wide tiles'


def test_query_tiles_follow_the_seqlen_bucket_and_divide_a_programs_rows() -> None:
    q_tiles = fwd_dispatch.flash_fwd_gluon_q_tiles
    assert q_tiles("bf16", 128, False, 0, 0.088, 1024, 1024) == 4
    assert q_tiles("bf16", 128, False, 0, 0.088, 768, 1024) == 2  # 6 tiles: 4 does not divide them, 2 does
    assert q_tiles("bf16", 128, False, 0, 0.088, 640, 1024) == 1
    assert q_tiles("bf16", 128, False, 0, 0.088, 4096, 4096) == 4 and q_tiles("bf16", 128, True, 0, 0.088, 4096,
                                                                               4096) == 4
    assert q_tiles("bf16", 128, False, 0, 0.088, 8192, 8192) == 1
    assert q_tiles("bf16", 128, True, 0, 0.088, 1024, 1024) == 8
    assert q_tiles("fp16", 64, False, 0, 0.125, 1024, 1024) == 8
    assert q_tiles("fp16", 64, False, 0, 0.125, 16384, 16384) == 1  # GLUON_WIDE's wide tiles
    assert q_tiles("bf16", 128, False, 0, 0.088, 1000, 1024) == 0  # not a gluon call
    assert q_tiles("bf16", 256, False, 0, 0.0625, 1024, 1024) == 2 and q_tiles("bf16", 256, True, 0, 0.0625, 16384,
                                                                                16384) == 1
    assert q_tiles("bf16", 160, False, 0, 0.079, 1024, 1024) == 4  # one Q buffer (gluon.q_buffers)
    assert q_tiles("bf16", 160, True, 0, 0.079, 1024, 1024) == 2 and q_tiles("bf16", 160, True, 0, 0.079, 4096,
                                                                             4096) == 2
    assert q_tiles("bf16", 160, False, 0, 0.079, 2048, 2048) == 2 and q_tiles("fp16", 192, True, 0, 0.072, 8192,
                                                                              8192) == 1
    for (head_dim, causal), bounds in fwd_dispatch.GLUON_Q_TILES.items():
        assert [most for most, _ in bounds] == sorted(most for most, _ in bounds)
        for most, count in bounds:  # the memo key's buckets decide them; every count's buffers fit
            assert most & (most - 1) == 0 and count in gluon.Q_TILES
            for dtype in gluon.DTYPES:
                tiles, _, pingpong = fwd_dispatch.GLUON_TABLE[(dtype, head_dim, causal)]
                assert pingpong and tiles in gluon.configs(head_dim, pingpong=True, q_tiles=count)
    with pytest.raises(ValueError, match="q_tiles must be one of"):
        gluon.variant("sm_90", "bf16", 128, "none", True, False, 1024, 1024, tiles=(128, 128, 8), q_tiles=2)
    with pytest.raises(ValueError, match="q_tiles must be one of"):
        gluon.variant("sm_90", "bf16", 128, "none", True, False, 1024, 1024, pingpong=True, q_tiles=3)
    assert gluon.variant("sm_90", "bf16", 128, "none", True, False, 768, 1024, pingpong=True, q_tiles=4) is None
    assert "positive multiples of the tiles (512, 128)" in str(gluon.reason(
        "sm_90", "bf16", 128, "none", True, False, 768, 1024, 128, 128, q_tiles=4))
    # Two Q buffers of 64 KiB do not fit beside hd256's ring: one does (q_buffers)
    assert gluon.configs(256, pingpong=True, q_tiles=2) == ((128, 64, 4),)


@pytest.mark.parametrize("head_dim, tiles, q_tiles, buffers", [
    (128, (128, 128), 4, 2), (64, (128, 128), 8, 2), (192, (128, 64), 2, 2),  # the served rows: two
    (160, (128, 128), 4, 1), (256, (128, 64), 2, 1),  # two would pass sm_90's 227 KiB
    (160, (128, 128), 1, 1), (128, (128, 128), 1, 1),  # one tile a program: one
])
def test_q_buffers_are_two_where_they_fit_beside_the_ring_else_one(head_dim: int, tiles: tuple[int, int],
                                                                   q_tiles: int, buffers: int) -> None:
    assert gluon.q_buffers(head_dim, *tiles, q_tiles) == buffers
    ring = 2 * gluon.stages(head_dim, tiles[1]) * tiles[1]
    assert gluon.shared_bytes(head_dim, *tiles, q_tiles) == 2 * gluon.width(head_dim) * (buffers * tiles[0] + ring)
    assert gluon.fits(head_dim, *tiles, q_tiles)
    if q_tiles > 1:
        assert (tiles[0], tiles[1], 4) in gluon.configs(head_dim, pingpong=True, q_tiles=q_tiles)
    assert (128, 128, 4) not in gluon.configs(192, pingpong=True, q_tiles=2)  # not even one Q buffer fits there


def test_a_program_of_several_query_tiles_in_one_q_buffer_compiles_within_its_shared_memory() -> None:
    """Head dim 160 at 128 x 128 walking 4 tiles: one Q buffer (two would need 245 KiB), refilled by the producer
    once both consumers released it after a tile's output went out; one Q barrier and one q_empty barrier."""
    from lazytriton.compiler import compile_variant

    variant = gluon.variant("sm_90", "bf16", 160, "top_left", True, False, 1024, 1024, pingpong=True, q_tiles=4,
                            tiles=(128, 128, 4))
    assert variant is not None and variant.constexprs["BLOCK_TILES"] == 4
    entry = compile_variant(variant)
    assert 0 <= entry.shared - gluon.shared_bytes(160, 128, 128, 4) <= gluon.SHARED_SLACK
    assert entry.shared + gluon.SHARED_SLACK <= gluon.SM90_SHARED < entry.shared + 2 * 160 * 128 * 2
    ptx = sm90_ptx(variant)
    assert "ld.local" not in ptx and "st.local" not in ptx
    two = sm90_ptx(gluon.variant("sm_90", "bf16", 128, "top_left", True, False, 1024, 1024, pingpong=True,  # type: ignore[arg-type]
                                 q_tiles=4, tiles=(128, 128, 4)))
    # Barriers: one Q and one q_empty barrier fewer than with two buffers (same ring: 2 stages at both head dims)
    assert ptx.count("mbarrier.init.shared") == two.count("mbarrier.init.shared") - 2


def test_fits_is_the_rule_the_buckets_cannot_see() -> None:
    assert fwd_dispatch.GLUON_BY_DEFAULT is True
    fits = fwd_dispatch.flash_fwd_gluon_fits
    assert fits("bf16", 128, True, 0, 0.088, 4096, 4096)
    assert not fits("bf16", 128, True, 0, 0.088, 4096 + 64, 4096)  # 128 x 128 tiles
    assert not fits("bf16", 128, True, -128, 0.088, 4096, 3968)  # bottom-right, seqlen_q > seqlen_k
    assert fits("bf16", 128, False, -128, 0.088, 4096, 3968)  # the offset means nothing without causal
    assert not fits("bf16", 128, False, 0, 0.0, 4096, 4096)
    assert fits("bf16", 64, True, 0, 0.125, 1024, 1024)  # ping-pong to 1k (GLUON_WIDE's bound)
    assert not fits("bf16", 112, True, 0, 0.0945, 1024, 1024)  # no row: flash_fwd serves
    assert fits("bf16", 64, True, 0, 0.125, 4096, 4096)  # GLUON_WIDE's wide tiles from 2k on
    assert fits("bf16", 64, True, 0, 0.125, 4096 + 64, 4096) and not fits("bf16", 64, True, 0, 0.125, 4096 + 32,
                                                                          4096)  # whole warpgroups of 64 rows
    assert fits("fp16", 128, False, 0, 0.088, 4096, 4096)  # bf16's rows
    assert fits("bf16", 64, False, 0, 0.125, 128, 128) and not fits("bf16", 64, False, 0, 0.125, 64, 128)
    assert not fits("bf16", 64, False, 0, 0.125, 128, 64)


def test_binding_serves_the_gluon_row_only_for_a_tailed_key_on_sm90_and_aligned() -> None:
    from lazytriton.kernels.flash_fwd import binding

    shape = binding.Shape(batch=2, heads_q=16, heads_k=16, seqlen_q=8192, seqlen_k=8192, head_dim=128)  # one tile
    got = binding.variant(SM90, torch.bfloat16, shape, True, True, False, gluon=True)
    assert got.kernel == "flash_fwd_gluon" and got.get("BLOCK_M") == 128 and got.get("PINGPONG") is True
    for target, aligned, gluon_bit in ((SM90, False, True), (Target.parse("sm_80"), True, True),
                                       (SM90, True, False)):
        assert binding.variant(target, torch.bfloat16, shape, True, aligned, False,
                               gluon=gluon_bit).kernel == "flash_fwd"


def test_gluon_by_default_false_is_the_old_behaviour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fwd_dispatch, "GLUON_BY_DEFAULT", False)
    assert not fwd_dispatch.flash_fwd_gluon_fits("bf16", 128, True, 0, 0.088, 4096, 4096)
    assert fwd_dispatch.flash_fwd_gluon_default_variant(SM90, "bf16", 128, True, True, False, 4096, 4096) is None
    assert gluon_variant(128, True) is not None  # still launched by variant, as the probe does


# ---------------------------------------------------------------------------
# Real compiles for cuda:90 with the installed Triton, through lazytriton's compile path


@pytest.mark.parametrize("head_dim, causal, tiles, producer, shared, warps", [  # tiles "pingpong": its default
    (64, True, (64, 64, 4), False, 57608, 4),
    (128, False, None, False, 164040, 8),
    (128, True, None, True, 164044, 12),  # the producer warp's partition is padded to a warpgroup
    (128, True, "pingpong", True, 164328, 12),  # 2 consumer warpgroups (4 warps each) + the producer's
    (64, False, "pingpong", True, 115232, 12),
    (128, False, (128, 64, 8), False, 131336, 8),  # a K tile of 16 KiB: 3 stages (gluon.stages)
    (256, False, None, False, 196808, 8),  # 128 x 64 x 8: Q 64 KiB + 2 stages of 32 KiB K and V
    (256, True, (128, 64, 8), True, 196812, 12),
    (256, True, "pingpong", True, 197096, 12),  # ping-pong 128 x 64 x 4
    (256, False, (64, 64, 4), False, 164040, 4),
])
def test_compiles_for_sm90_into_an_entry_with_flash_fwds_launch_layout(head_dim: int, causal: bool,
                                                                        tiles: tuple[int, int, int] | str | None,
                                                                        producer: bool, shared: int,
                                                                        warps: int) -> None:
    from lazytriton.compiler import compile_variant, triton_version

    pingpong = tiles == "pingpong"
    variant = gluon_variant(head_dim, causal, tiles=None if pingpong else tiles, producer=producer,
                            pingpong=pingpong)
    assert variant is not None
    entry = compile_variant(variant)
    assert entry.kind == "cubin" and entry.binary
    assert entry.num_warps == warps
    assert entry.shared == shared  # the same under Triton 3.6.0 and 3.9.0 (measured)
    block_m, block_n = variant.get("BLOCK_M"), variant.get("BLOCK_N")
    assert 0 <= shared - gluon.shared_bytes(head_dim, block_m, block_n) <= gluon.SHARED_SLACK  # type: ignore[arg-type]
    # Device-side TMA descriptors a program, 128 bytes each: Q, K, V and Out; with ping-pong each consumer
    # warpgroup makes its own Q's and Out's (_consume_part)
    assert entry.global_scratch_size == (6 if pingpong else 4) * 128
    assert entry.hidden_args == ("global_scratch", "profile_scratch")
    signature = FLASH_FWD.signature("bf16")
    assert entry.arg_types == tuple(kind for kind in signature.values() if kind != "constexpr")
    assert entry.provenance.compiler_version == triton_version()


def sm90_ptx(variant: Variant) -> str:
    """The PTX of a flash_fwd_gluon variant, compiled by the installed Triton for cuda:90."""
    import triton
    from triton.backends.compiler import GPUTarget
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:  # Triton 3.6
        from triton.experimental.gluon._runtime import GluonASTSource

    from lazytriton.variant import kernel_constexprs

    spec = get("flash_fwd_gluon")
    fn = getattr(importlib.import_module(spec.module), spec.function)
    source = GluonASTSource(fn, spec.signature("bf16"), constexprs=kernel_constexprs(variant, spec.constexprs),
                            attrs={(i,): [["tt.divisibility", 16]] for i, (name, _) in enumerate(spec.params)
                                   if name in spec.aligned_params})
    options = {"num_warps": variant.get("num_warps"), "enable_fp_fusion": True}
    return str(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])


def test_its_ptx_has_tma_loads_async_wgmma_and_mbarrier_waits() -> None:
    """The pipeline is what the source says: compiled by Triton for cuda:90, read from the PTX."""
    variant = gluon_variant(128, True)
    assert variant is not None
    ptx = sm90_ptx(variant)
    assert ptx.count("wgmma.mma_async") == 48  # QK^T and PV: 8 k-steps each, peeled block + 2 loops + last PV
    assert "wgmma.wait_group.sync.aligned 1;" in ptx  # the softmax waits for S_j only, PV_{j-1} still in flight
    assert ptx.count("cp.async.bulk.tensor.2d.shared") == 10  # Q, 2 stages x (K, V), the loops' K and V refills
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx  # the output's TMA store
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx  # no register spills


# ---------------------------------------------------------------------------
# The H200 probe's host side


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    return importlib.import_module("probe_gluon")


def test_every_probe_shape_is_one_the_kernel_takes(probe: ModuleType) -> None:
    args = argparse.Namespace(quick=False, sweep=True, skip=set())
    for dtype, _, _, _, sq, sk, d, causal, _ in probe.CHECKS:
        for tiles, _, _ in probe.tiles_for(args, d):  # with and without the producer warp: the same rule
            assert gluon.reason("sm_90", dtype, d, causal, True, False, sq, sk, tiles[0], tiles[1]) is None
    for dtype, d, causal, s in probe.time_shapes(args):
        for tiles, _, _ in probe.tiles_for(args, d):
            assert gluon.reason("sm_90", dtype, d, "top_left" if causal else "none", True, False, s, s, tiles[0],
                                tiles[1]) is None
    # The checks cover every tile width and every head dim the table serves in split or padded tiles.
    assert {d for *_, d, _, _ in probe.CHECKS} >= set(gluon.HEAD_DIMS) | {d for _, d, _ in fwd_dispatch.GLUON_TABLE}
    split = argparse.Namespace(quick=True, sweep=False, skip=set(), head_dims="192,96")
    assert probe.head_dims(split) == [192, 96] and {case[6] for case in probe.checks(split)} == {96, 192}
    assert {d for _, d, _, _ in probe.time_shapes(argparse.Namespace(quick=True))} == set(gluon.HEAD_DIMS)
    only = argparse.Namespace(quick=True, sweep=True, skip=set(), head_dims="256")  # --head-dims 256
    assert {d for _, d, _, _ in probe.time_shapes(only)} == {256} == {case[6] for case in probe.checks(only)}
    assert {v.get("BLOCK_D") for v in probe.compile_list(only)} == {256}


def test_the_table_gives_ratios_and_the_best_tiling(probe: ModuleType) -> None:
    shape = {"dtype": "bf16", "head_dim": 128, "causal": True, "seqlen": 4096}
    rows = [{**shape, "provider": "cudnn", "tflops": 500.0}, {**shape, "provider": "flash_fwd", "tflops": 400.0},
            {**shape, "provider": "gluon[128, 128, 8]", "tflops": 450.0},
            {**shape, "provider": "gluon[64, 64, 4]", "tflops": None}, {"job": "time", "index": 3, "crash": 1}]
    lines = probe.table(rows)
    assert "0.90" in lines[1] and "1.12" in lines[1] and "gluon[128, 128, 8]" in lines[1]
    assert probe.label(((128, 128, 8), True)) == "gluon[128, 128, 8]+producer"
    assert lines[-1].startswith("geomean gluon / cuDNN over 1 shapes: 0.900")


def test_a_crashing_child_is_reported_and_the_run_goes_on(probe: ModuleType, tmp_path: Path) -> None:
    """On this GPU-less machine the check child fails at once: one crash record, no exception, logged."""
    args = argparse.Namespace(deadline=300.0, reps=1, sweep=False, quick=True, skip=set(), jobs=1)
    log = tmp_path / "probe.log"
    got = probe.run_child(args, "check", 0, log)
    assert got == [{"job": "check", "index": 0, "crash": 1}]
    assert "exited 1" in log.read_text()
    assert "CRASHED or HUNG" in probe.check_line(args, got[0])


def test_the_producer_warp_loads_and_the_consumers_release_by_arrive() -> None:
    variant = gluon_variant(128, True, producer=True)
    assert variant is not None
    ptx = sm90_ptx(variant)
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    # Each release: the consumer partition's 256 threads meet, then one of them arrives on the empty barrier.
    releases = re.findall(r"bar\.sync\s+0, 256;\n(?:[^\n]*\n){0,3}?\s*@%p\d+ mbarrier\.arrive\.shared::cta\.b64", ptx)
    assert len(releases) == ptx.count("mbarrier.arrive.shared::cta.b64") >= 3
    assert ptx.count("wgmma.mma_async") == 48 and "ld.local" not in ptx


def test_a_tiling_that_fails_or_faults_a_check_is_not_timed(probe: ModuleType) -> None:
    args = argparse.Namespace(sweep=False, skip=set())
    plain, producer, pingpong = (probe.label(t) for t in probe.tiles_for(args, 128))
    assert producer == "gluon[128, 128, 8]+producer" and pingpong == "gluon[128, 128, 4]+pingpong"
    crashed = [{"tiles": plain, "ok": True}, {"job": "check", "index": 0, "crash": -9}]
    assert probe.suspects(args, 128, crashed) == {producer}  # it was running when the child died
    wrong = [{"tiles": plain, "ok": False}, {"tiles": producer, "ok": True}, {"tiles": pingpong, "ok": True}]
    assert probe.suspects(args, 128, wrong) == {plain}
    args.skip = {plain}
    assert [probe.label(t) for t in probe.tiles_for(args, 128)] == [producer, pingpong]


def test_the_compile_shards_cover_every_variant_once(probe: ModuleType) -> None:
    args = argparse.Namespace(sweep=True, skip=set(), jobs=3)
    every = probe.compile_list(args)
    # dtypes x causal x head dims x (every config that fits, the producer at the default tiles, each ping-pong
    # config that fits, each wide config that fits): head dim 256 keeps 128 x 64 x 8, 64 x 64 x 4 and ping-pong
    # 128 x 64 x 4; the wide tiles 192 x 128 x 4 and 192 x 64 x 4 at 64, 192 x 64 x 4 at 128
    per_head_dim = {d: len(gluon.configs(d)) + 1 + len(gluon.configs(d, pingpong=True)) + len(gluon.wide_configs(d))
                    for d in gluon.HEAD_DIMS}
    assert per_head_dim == {64: 9, 128: 8, 256: 4}
    assert len(every) == 2 * 2 * sum(per_head_dim.values())
    assert sum(v.get("PINGPONG") for v in every) == 2 * 2 * (2 + 2 + 1)
    assert all(v.kernel == "flash_fwd_gluon" for v in every)
    shards = [every[i::args.jobs] for i in range(args.jobs)]
    assert sorted(map(str, sum(shards, []))) == sorted(map(str, every))


# ---------------------------------------------------------------------------
# Ping-pong: two consumer warpgroups on the two halves of the query tile, taking turns


def test_pingpong_variants_imply_the_producer_and_take_only_their_own_configs() -> None:
    v = gluon_variant(128, True, pingpong=True)
    assert v is not None
    assert v.tuned == (("BLOCK_M", 128), ("BLOCK_N", 128), ("PINGPONG", True), ("PRODUCER", True))
    assert v.get("num_warps") == 4  # each consumer warpgroup's warps; the entry runs 12
    assert gluon_variant(64, False, pingpong=True, tiles=(128, 64, 4)).get("BLOCK_N") == 64  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"with pingpong, got \(128, 128, 8\)"):
        gluon_variant(pingpong=True, tiles=(128, 128, 8))  # 2 x 8 warps would be 256 rows
    assert gluon_variant(128, True, sq=4096 + 64, pingpong=True) is None  # the same rule: whole 128-row tiles


def test_a_program_of_several_query_tiles_compiles_with_two_q_buffers_and_no_spill() -> None:
    """BLOCK_TILES: the program's BLOCK_M rows are that many ping-pong tiles, walked in turn; its producer warp loads
    every Q (two buffers, each released by both consumer partitions) and K/V tile of them through one ring."""
    from lazytriton.compiler import compile_variant

    for head_dim, causal, q_tiles in ((128, False, 4), (128, True, 8), (64, False, 2), (64, True, 8)):
        variant = gluon.variant("sm_90", "bf16", head_dim, "top_left" if causal else "none", True, False, 1024, 1024,
                                pingpong=True, q_tiles=q_tiles)
        assert variant is not None and variant.get("BLOCK_M") == 128 * q_tiles
        assert variant.constexprs["BLOCK_TILES"] == q_tiles
        entry = compile_variant(variant)
        shared = gluon.shared_bytes(head_dim, 128, 128, q_tiles)
        assert 0 <= entry.shared - shared <= gluon.SHARED_SLACK and entry.num_warps == 12
        assert entry.global_scratch_size == 5 * 128  # Q, K, V (the producer's) and each consumer's Out, once
        ptx = sm90_ptx(variant)
        assert "ld.local" not in ptx and "st.local" not in ptx
        assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
        # Each consumer: the peeled block's QK^T, one or two loops of QK^T + PV, the last PV (k-steps of 16); causal
        # up to a width of 96, warpgroup 0 also a half step's QK^T and PV and its half-wide last PV.
        steps = head_dim // 16 + 128 // 16
        loops = 2 if causal else 1
        half = steps + 64 // 16 if causal and head_dim <= 96 else 0
        assert ptx.count("wgmma.mma_async") == 2 * (head_dim // 16 + loops * steps + 128 // 16) + half
        # The producer warp issues every load (Q's two halves, K, V), in its tile loop: none before the partitions.
        head = ptx[:ptx.index("setmaxnreg")]
        assert "cp.async.bulk.tensor.2d.shared" not in head and ptx.count("cp.async.bulk.tensor.2d.shared") >= 4
        assert ptx.count("mbarrier.init.shared") >= 2 + 2 + 4 * gluon.stages(head_dim, 128) + 2
    one = gluon.variant("sm_90", "bf16", 128, "none", True, False, 1024, 1024, pingpong=True)
    assert one is not None and "BLOCK_TILES" not in one.constexprs, "one tile: the variant string as before"


def gluon_served(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool | str,
                 resolved: list[Variant]) -> list[Variant]:
    """A plain call cold (it plans the shape) and warm, each within FlashAttention's rule: the gluon variants resolved.

    Skips off sm_90 (flash_fwd_gluon is built for it).
    """
    from lazytriton import flash

    if str(machine.target_of_device(q.device)) != "sm_90":
        pytest.skip("flash_fwd_gluon is built for sm_90")
    for _ in range(2):
        out, lse = flash.attn_fwd(q, k, v, causal=causal)
        torch.cuda.synchronize()
        check_attention(q, k, v, out, lse, causal=causal)
    return [variant for variant in resolved if variant.kernel == "flash_fwd_gluon"]


@on_gpu
@pytest.mark.parametrize("dtype, head_dim, causal, seqlens, q_tiles", [
    (torch.bfloat16, 160, True, (1024, 1024), 4),  # one Q buffer: 160 = 128 + 32 at 128 x 128
    (torch.float16, 160, False, (512, 1024), 2),
    (torch.bfloat16, 256, "bottom_right", (512, 1536), 2),  # 128 x 64, one 64 KiB Q buffer
])
def test_programs_of_several_query_tiles_in_one_q_buffer_serve_attn_fwd_on_gpu(
        dtype: torch.dtype, head_dim: int, causal: bool | str, seqlens: tuple[int, int], q_tiles: int,
        resolved: list[Variant], monkeypatch: pytest.MonkeyPatch) -> None:
    """A GLUON_Q_TILES row where two Q buffers do not fit: the tiles share one, within FlashAttention's rule."""
    from lazytriton import runtime

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    tiles = fwd_dispatch.GLUON_TABLE.get((name, head_dim, causal is not False), ((128, 64, 4), True, True))
    monkeypatch.setitem(fwd_dispatch.GLUON_TABLE, (name, head_dim, causal is not False), tiles)
    monkeypatch.setitem(fwd_dispatch.GLUON_Q_TILES, (head_dim, causal is not False), ((1024, q_tiles),))
    runtime.reset()
    q, k, v = make_qkv(2, (4, 2), seqlens, head_dim, dtype, "cuda", seed_of("gluon-one-q", head_dim, causal, seqlens))
    served = gluon_served(q, k, v, causal, resolved)
    assert served and served[-1].constexprs.get("BLOCK_TILES") == q_tiles, served
    assert gluon.q_buffers(head_dim, 128, served[-1].get("BLOCK_N"), q_tiles) == 1  # type: ignore[arg-type]
    runtime.reset()


@on_gpu
@pytest.mark.parametrize("dtype, head_dim, causal, heads, seqlens, q_tiles", [
    (torch.bfloat16, 128, True, (4, 4), (1024, 1024), 8),  # a program: the whole (batch, head)
    (torch.float16, 128, False, (8, 2), (768, 1024), 2),  # GQA; 6 tiles: programs of 2
    (torch.bfloat16, 128, "bottom_right", (2, 2), (512, 1536), 4),  # causal offset 1024
    (torch.bfloat16, 64, False, (4, 4), (1024, 512), 8),
    (torch.float16, 64, False, (2, 2), (1024, 2048), 8),  # longer queries take GLUON_WIDE's tiles
    # Causal programs of 2 tiles pair tile j with its mirror N - 1 - j (4 programs a head here, 4 key blocks apart)
    (torch.bfloat16, 192, True, (4, 4), (1024, 1024), 2),
    (torch.float16, 192, "bottom_right", (4, 2), (1024, 1536), 2),  # causal offset 512
    (torch.bfloat16, 160, True, (2, 2), (1024, 1024), 2),
    # hd64 causal to 1k: warpgroup 0 takes its diagonal block in a half step (64 of 128 keys)
    (torch.bfloat16, 64, True, (4, 4), (1024, 1024), 8),
    (torch.float16, 64, "bottom_right", (4, 2), (1024, 1536), 8),  # GQA, causal offset 512
    (torch.bfloat16, 64, True, (2, 2), (256, 256), 2),  # 8 tiles halved to 2: a program holds the (batch, head)
    # top-left causal with seqlen_q > seqlen_k: the tiles past seqlen_k see every key (no diagonal, no half step)
    (torch.bfloat16, 64, True, (2, 2), (1024, 512), 8),
    (torch.float16, 96, True, (4, 2), (1024, 256), 8),
], ids=str)
def test_programs_of_several_query_tiles_serve_attn_fwd_on_gpu(dtype: torch.dtype, head_dim: int, causal: bool | str,
                                                                heads: tuple[int, int], seqlens: tuple[int, int],
                                                                q_tiles: int, resolved: list[Variant]) -> None:
    """GLUON_Q_TILES' programs, served by a plain call cold and warm, within FlashAttention's rule."""
    from lazytriton import flash, runtime

    runtime.reset()  # plans memoised by another test would hide the variant from the resolve spy
    q, k, v = make_qkv(2, heads, seqlens, head_dim, dtype, "cuda", seed_of("gluon-tiles", head_dim, causal, seqlens))
    if str(machine.target_of_device(q.device)) != "sm_90":
        pytest.skip("flash_fwd_gluon is built for sm_90")
    for _ in range(2):  # cold (plans the shape), then warm (the hot path's key carries the count)
        out, lse = flash.attn_fwd(q, k, v, causal=causal)
        torch.cuda.synchronize()
        check_attention(q, k, v, out, lse, causal=causal)
    served = [v for v in resolved if v.kernel == "flash_fwd_gluon"]
    assert served and served[-1].constexprs.get("BLOCK_TILES", 1) == q_tiles, served


def test_pingpong_ptx_alternates_the_two_warpgroups_by_mbarrier() -> None:
    """Each warpgroup waits for its turn before its wgmmas and passes it after issuing them, on its own
    named barrier (bar.sync 0 / 2, 128 threads), and both get 240 registers, the producer 24."""
    variant = gluon_variant(128, True, pingpong=True)
    assert variant is not None
    ptx = sm90_ptx(variant)
    assert ptx.count("setmaxnreg.dec.sync.aligned.u32 \t240;") == 1  # the default partition (warpgroup 0)
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t240;") == 1  # warpgroup 1
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert ptx.count("wgmma.mma_async") == 96  # each warpgroup: the peeled block, 2 loops, the last PV
    assert {int(n) for n in re.findall(r"bar\.sync\s+(\d+), 128;", ptx)} == {0, 2}  # one barrier a warpgroup
    # Passing the turn follows the PV's commit in both loops: wgmma issued, then arrive, then wait for S only.
    passes = re.findall(r"wgmma\.commit_group\.sync\.aligned;\n(?:[^\n]*\n){0,6}?\s*bar\.sync\s+[02], 128;\n"
                        r"(?:[^\n]*\n){0,3}?\s*@%p\d+ mbarrier\.arrive\.shared::cta\.b64", ptx)
    assert len(passes) >= 8  # 2 warpgroups x (peeled, 2 loops, last PV) at least
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_the_probe_prints_table_rows_dispatch_takes(probe: ModuleType) -> None:
    shape = {"dtype": "bf16", "head_dim": 128, "causal": True}
    rows = [{**shape, "seqlen": s, "provider": name, "tflops": t}
            for s, cudnn, ffwd, pp, plain in ((1024, 400.0, 300.0, 350.0, 360.0), (4096, 540.0, 400.0, 600.0, 380.0))
            for name, t in (("cudnn", cudnn), ("flash_fwd", ffwd), ("gluon[128, 128, 4]+pingpong", pp),
                            ("gluon[64, 64, 4]", plain))]
    rows += [{**shape, "causal": False, "seqlen": 4096, "provider": name, "tflops": t}
             for name, t in (("flash_fwd", 500.0), ("gluon[64, 64, 4]", 450.0))]  # flash_fwd wins: no row
    (line,) = probe.table_rows(rows)
    assert line.startswith('    ("bf16", 128, True): ((128, 128, 4), True, True),  # 458 / 346 / 465')
    table = ast.literal_eval("{" + line + "\n}")  # it pastes into flash_fwd.dispatch.GLUON_TABLE as it is
    tiles, producer, pingpong = table[("bf16", 128, True)]
    assert fwd_dispatch.flash_fwd_gluon_variant(SM90, "bf16", 128, True, True, False, 4096, 4096, tiles=tiles,
                                                producer=producer, pingpong=pingpong) is not None
    for tiling in probe.sweep_tilings():
        assert probe.parse_label(probe.label(tiling)) == tiling


def test_a_hung_launch_ends_its_child_within_the_limit(probe: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    class Event:
        def __init__(self, done: bool) -> None:
            self.done = done

        def record(self) -> None:
            pass

        def query(self) -> bool:
            return self.done

    class Cuda:
        done = False

        def Event(self) -> Event:  # noqa: N802 (torch's name)
            return Event(self.done)

    fake = argparse.Namespace(cuda=Cuda())
    exits: list[int] = []
    monkeypatch.setattr(probe.os, "_exit", lambda code: exits.append(code) or (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit):
        probe.finish(fake, "gluon[128, 128, 4]+pingpong", limit=0.01)
    assert exits == [3] and "HANG: gluon[128, 128, 4]+pingpong" in capsys.readouterr().out
    fake.cuda.done = True
    probe.finish(fake, "done at once", limit=0.01)  # returns


def test_ptx_served_keeps_the_code_and_drops_where_the_source_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    ptx_served = importlib.import_module("ptx_served")
    ptx = (".version 8.7\n\t.loc\t1 611 1\n\tmov.b32 \t%r1, 1;\n$L__BB0_3:\n\t// a comment\n\tbra.uni \t$L__BB0_3;\n"
           "\t.section\t.debug_info\n.b8 224 // DW_AT_call_line\n")
    moved = ptx.replace("611", "615").replace("224", "228").replace("BB0_3", "BB0_4")  # the source moved
    assert ptx_served.code_of(ptx) == ptx_served.code_of(moved) and "mov.b32" in ptx_served.code_of(ptx)
    assert ptx_served.code_of(ptx) != ptx_served.code_of(ptx.replace("%r1, 1", "%r1, 2"))
    for head_dim, causal, seqlen in ptx_served.SERVED:  # every row it compiles is one dispatch serves
        assert fwd_dispatch.flash_fwd_gluon_default_variant(SM90, "bf16", head_dim, causal, True, False, seqlen,
                                                            seqlen) is not None


def test_skip_takes_labels_whose_tiles_have_commas(probe: ModuleType) -> None:
    labels = ["gluon[128, 128, 8]", "gluon[192, 128, 4]+producer", "gluon[128, 128, 4]+pingpongx4"]
    assert probe.parse_skip(",".join(labels)) == set(labels)  # as run_child hands it on
    assert probe.parse_skip("") == set() and probe.parse_skip("gluon[64, 64, 4], ") == {"gluon[64, 64, 4]"}
    assert {probe.label(probe.parse_label(name)) for name in labels} == set(labels)


def test_a_tiling_that_hangs_while_timed_is_not_timed_again(probe: ModuleType) -> None:
    args = argparse.Namespace(sweep=True, skip=set())
    names = [probe.label(t) for t in probe.tiles_for(args, 128)]
    crashed = names.index("gluon[128, 128, 4]+pingpong")
    got = [{"provider": "cudnn"}, {"provider": "flash_fwd"}, *({"provider": n} for n in names[:crashed]),
           {"job": "time", "index": 2, "crash": 3}]
    assert probe.time_suspect(args, 128, got) == names[crashed]
    assert probe.time_suspect(args, 128, got[:-1]) is None



def test_each_load_goes_out_before_the_next_descriptor_is_built() -> None:
    """Without ping-pong the prologue, in PTX order, is Q's descriptor, Q's load, K's descriptor, K's loads, V's,
    then Out's descriptor last (only the epilogue needs it), so the GPU-scope fences of the later descriptors run
    while Q, K and V are in flight."""
    variant = gluon_variant(128, True, pingpong=False)
    assert variant is not None
    ptx = sm90_ptx(variant)
    prologue = ptx[:ptx.index("wgmma.mma_async")]
    assert _descriptors_and_loads(prologue) == "DLDLLDLLD"  # K/V: the whole ring (2 stages)


def _descriptors_and_loads(ptx: str) -> str:
    """D for each descriptor made (its GPU-scope fence), L for each TMA load, in PTX order (a load's state space
    is shared::cta from Triton 3.9, shared::cluster in 3.6)."""
    events = re.findall(r"tensormap\.cp_fenceproxy|cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)
    return "".join("D" if e.startswith("tensormap") else "L" for e in events)


@pytest.mark.parametrize("q_tiles", [1, 8])
def test_with_ping_pong_each_partition_makes_its_own_descriptors(q_tiles: int) -> None:
    """Ping-pong: the partitions make their descriptors at once, none before they split (each ~0.7 µs: made in
    turn before the split, they would hold every program's first step back). One tile: each consumer warpgroup makes
    Q's, loads its half, then makes Out's; the producer K's, loads block 0, then V's. Several tiles: the
    consumers make Out's alone, the producer Q's, K's and V's, each load going out before the next one."""
    variant = gluon_variant(128, True, 1024, 1024, pingpong=True, q_tiles=q_tiles)
    assert variant is not None and variant.constexprs.get("BLOCK_TILES", 1) == q_tiles
    ptx = sm90_ptx(variant)
    assert "tensormap.cp_fenceproxy" not in ptx[:ptx.index("setmaxnreg")]
    order = _descriptors_and_loads(ptx)
    consumers = "DLD" * 2 if q_tiles == 1 else "D" * 2
    producer = r"DL+DL+" if q_tiles == 1 else r"DL+DL+DL+"
    assert re.fullmatch(consumers + producer + "L*", order), order
