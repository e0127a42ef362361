"""The fused backward (flash_bwd_prep + flash_bwd_fused_gluon): registration, rule, table, keys, prewarm, compiles.

The fused kernel runs only on a Hopper GPU (Triton's interpreter does not run
Gluon): the GPU tests at the end check its gradients against the float64
reference (FlashAttention's rule) through autograd, with GQA, causal offsets,
fp16 and both head dims, and that deterministic mode keeps flash_bwd's two
kernels (tests/test_gluon_bwd.py's reproducibility test runs in that mode and
checks it). On the CPU: the specs match the kernels' signatures, the
rule refuses every call the kernel would not compute exactly, the memo key and
plans pick it only for calls that fit a row (and never in deterministic mode),
prewarm plans both kernels, the prep kernel's delta and zeroed accumulator are
checked through the interpreter, and the installed Triton compiles both for
cuda:90 through lazytriton's compile path.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ptxas_report, sass_of
from test_flash_bwd import check_grads, grads_of
from test_flash_fwd import make_qkv, on_gpu, skip_unless_sm90
from test_gluon_bwd import plain_call

import lazytriton
from lazytriton import geometry, launch, machine
from lazytriton.kernels import get, source_fingerprint
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_bwd import fused
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.prewarm import enumeration
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields, kernel_constexprs

SM90 = Target.parse("sm_90")


def pair(head_dim: int = 128, causal: bool = False, sq: int = 4096, sk: int = 4096,
         dtype: str = "bf16") -> tuple[Variant, Variant] | None:
    return bwd_dispatch.flash_bwd_fused_default_variants(SM90, dtype, head_dim, causal, True, False, sq, sk)


@pytest.fixture
def deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


# ---------------------------------------------------------------------------
# Registration, variants, the rule


@pytest.mark.parametrize("name", [fused.NAME, fused.PREP])
def test_each_spec_matches_its_kernels_signature_and_has_its_own_source(name: str) -> None:
    spec = get(name)
    assert spec.source_path.name == "fused_kernel.py"
    fn = getattr(importlib.import_module(spec.module), spec.function)
    assert list(fn.arg_names) == [n for n, _ in spec.params] + list(spec.constexprs)
    assert source_fingerprint(name) not in (source_fingerprint("flash_bwd_dkdv"),
                                            source_fingerprint("flash_bwd_dkdv_gluon"))
    assert source_fingerprint(fused.NAME) != source_fingerprint(fused.PREP)  # the descriptions differ


def test_the_fingerprint_covers_the_helpers_the_fused_kernel_calls(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """kv_tile and query_steps live in gluon_kernel.py, the TMA copies in gluon_tma.py (the forward's too): a change
    there must change the fused kernel's keys."""
    from lazytriton import kernels, record
    from lazytriton.kernels.flash_fwd import gluon as fwd_gluon

    spec = get(fused.NAME)
    assert [p.name for p in spec.source_paths] == ["fused_kernel.py", "gluon_kernel.py", "gluon_tma.py"]
    assert [p.name for p in get(fused.PREP).source_paths] == ["fused_kernel.py"]  # it calls neither
    assert [p.name for p in get(fwd_gluon.NAME).source_paths] == ["gluon_kernel.py", "gluon_tma.py"]
    fingerprint = source_fingerprint.__wrapped__  # type: ignore[attr-defined]
    before = fingerprint(fused.NAME)
    helper = tmp_path / "edited_helper.py"
    helper.write_bytes(spec.source_paths[1].read_bytes() + b"\n# edited\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    edited = record.replace(spec, helpers=("edited_helper",))
    monkeypatch.setattr(kernels, "get", lambda name: edited)
    assert fingerprint(fused.NAME) != before


def test_the_default_pair_is_complete_round_trips_and_keys_apart() -> None:
    found = pair(128, True)
    assert found is not None
    prep, kernel = found
    assert str(kernel) == ("flash_bwd_fused_gluon:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=true,INDEX64=false,"
                           "SEQ16=true:BLOCK_M=64,PREFETCH=false:num_stages=2,num_warps=4")
    assert str(prep) == "flash_bwd_prep:sm_90:bf16:ALIGN16=true,BLOCK_D=128,INDEX64=false:BLOCK_M=64:num_stages=1," \
                        "num_warps=4"
    for v in found:
        assert check_fields(v) is v and Variant.parse(str(v)) == v
    assert kernel_constexprs(kernel, get(fused.NAME).constexprs) == {"BLOCK_M": 64, "BLOCK_D": 128, "CAUSAL": True,
                                                                     "PREFETCH": False, "BLOCK_D2": 0}
    assert prep.key() != kernel.key() != pair(128, False)[1].key()  # type: ignore[index]


@pytest.mark.parametrize("head_dim, chunks", [
    (256, (256, 0)), (128, (128, 0)), (64, (64, 0)),  # one whole tile
    (96, (64, 32)), (80, (64, 16)), (72, (64, 16)),  # the narrow program in two chunks (72: zero-filled past it)
    (160, (128, 32)), (192, (128, 64)), (144, (128, 16)), (176, (128, 64)),  # the wide program in two chunks
    (224, (256, 0)),  # 128 + 96 rounds up to the padded tile
    (40, (64, 0)), (56, (64, 0)),  # 32 + 16 and 32 + 32: 32 is not one of the kernel's tiles
])
def test_the_kernel_splits_the_head_dims_two_chunks_hold(head_dim: int, chunks: tuple[int, int]) -> None:
    assert fused.chunks(head_dim) == chunks
    assert fused.tile(head_dim) == geometry.padded_head_dim(head_dim)  # dQ's accumulator rows
    found = fused.variants("sm_90", "bf16", head_dim, "none", True, False, 4096, 4096)
    assert found is not None
    prep, kernel = found
    assert (kernel.get("BLOCK_D"), kernel.constexprs.get("BLOCK_D2", 0)) == chunks
    assert prep.get("BLOCK_D") == fused.tile(head_dim) and "BLOCK_D2" not in prep.constexprs
    assert check_fields(kernel) is kernel and Variant.parse(str(kernel)) == kernel
    if chunks[1]:  # its own key, beside the padded tile's variant
        assert "BLOCK_D2=" in str(kernel)
        padded = fused.variants("sm_90", "bf16", fused.tile(head_dim), "none", True, False, 4096, 4096)
        assert padded is not None and kernel.key() != padded[1].key()


@pytest.mark.parametrize("target, dtype, head_dim, causal, aligned, index64, sq, sk, block_m, features, why", [
    ("sm_80", "bf16", 128, "none", True, False, 4096, 4096, 64, False, "target"),
    ("sm_90", "fp32", 128, "none", True, False, 4096, 4096, 64, False, "dtype"),
    ("sm_90", "bf16", 100, "none", True, False, 4096, 4096, 64, False, "head dim"),  # rows of 200 bytes: no TMA
    ("sm_90", "bf16", 32, "none", True, False, 4096, 4096, 64, False, "head dim"),  # under 64's tile
    ("sm_90", "bf16", 264, "none", True, False, 4096, 4096, 64, False, "head dim"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4096, 32, False, "BLOCK_M"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4096, 128, False, "shared memory"),
    ("sm_90", "bf16", 128, "none", False, False, 4096, 4096, 64, False, "TMA"),
    ("sm_90", "bf16", 128, "none", True, True, 4096, 4096, 64, False, "TMA"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4096, 64, True, "not implemented"),
    ("sm_90", "bf16", 128, "none", True, False, 4000, 4096, 64, False, "multiples"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4032, 64, False, "multiples"),  # 4032 = 63 x 64, not x 128
    ("sm_90", "bf16", 128, "bottom_right", True, False, 4096, 2048, 64, False, "rows without keys"),
    ("sm_90", "bf16", 256, "none", True, False, 4096, 4096, 128, False, "shared memory"),
    ("sm_90", "bf16", 256, "none", True, False, 4096, 4064, 64, False, "multiples"),  # 63.5 x 64 keys
])
def test_reason_refuses_what_the_kernel_does_not_compute(target: str, dtype: str, head_dim: int, causal: str,
                                                        aligned: bool, index64: bool, sq: int, sk: int, block_m: int,
                                                        features: bool, why: str) -> None:
    assert why in (fused.reason(target, dtype, head_dim, causal, aligned, index64, sq, sk, block_m, features) or "")
    assert fused.variants(target, dtype, head_dim, causal, aligned, index64, sq, sk, block_m, False, features) is None
    assert fused.reason("sm_90", "bf16", 128, "bottom_right", True, False, 2048, 4096, 64) is None


def test_every_table_row_is_a_pair_the_kernel_takes_within_shared_memory() -> None:
    for (dtype, head_dim, causal), (block_m, prefetch, _) in bwd_dispatch.BWD_FUSED_TABLE.items():
        assert fused.shared_bytes(head_dim, block_m) + fused.SHARED_SLACK <= fused.SM90_SHARED
        found = bwd_dispatch.flash_bwd_fused_default_variants(SM90, dtype, head_dim, causal, True, False, 4096, 4096)
        assert found is not None and found[1].get("BLOCK_M") == block_m and found[1].get("PREFETCH") is prefetch


@pytest.mark.parametrize("head_dim, causal, offset, sq, sk, fits", [
    (128, False, 0, 2048, 2048, True),
    (128, True, 0, 128, 2048, True),
    (128, False, 0, 1024, 1024, True),  # from 1k keys (12-02)
    (128, True, 0, 1024, 1024, True),  # from 1k keys (the head dim hint, 12-02)
    (128, True, 0, 512, 512, False),  # under the row's minimum seqlen_k: the two kernels win there
    (128, False, 0, 512, 512, False),  # under the row's minimum seqlen_k
    (128, False, 0, 2048, 2112, False),  # seqlen_k not a multiple of 128
    (128, True, -64, 2112, 2048, False),  # rows without keys
    (64, False, 0, 1024, 1024, True),  # from 1k keys (the head dim hint)
    (64, True, 0, 1024, 1024, False),  # under the row's minimum seqlen_k: flash_bwd wins there
    (64, False, 0, 4096, 4096, True),
    (64, False, 0, 4032, 4096, False),  # BLOCK_M 128 does not divide seqlen_q
    (256, False, 0, 1024, 1024, True),  # 64 keys a program at head dim 256
    (256, True, 0, 1024, 1088, True),
    (256, False, 0, 512, 512, False),  # under the row's minimum seqlen_k
    (96, False, 0, 4096, 4096, True),  # split: 64 + 32
    (96, False, 0, 1024, 1024, True),  # from 1k keys (dQ by chunk)
    (80, True, 0, 1024, 1024, False),  # causal 80 keeps 2k (a tie at 1k)
    (80, False, 0, 512, 512, False),  # under the row's minimum seqlen_k
    (224, True, 0, 1024, 1024, True),  # 256's tile: 64 keys a program
    (192, False, 0, 2048, 2048, True),  # split, 64 keys a program
    (160, True, 0, 2048, 2112, False),  # no row: flash_bwd's split tiles win at 160 (12-02)
    (192, True, 0, 2048, 2112, True),
    (192, True, 0, 1024, 1024, True),  # from 1k keys (the head dim hint)
    (192, False, 0, 1024, 1024, False),  # full keeps 2k
    (104, False, 0, 4096, 4096, False),  # no row
])
def test_fits_is_the_rule_the_buckets_cannot_see(head_dim: int, causal: bool, offset: int, sq: int, sk: int,
                                                 fits: bool) -> None:
    assert bwd_dispatch.flash_bwd_fused_fits("bf16", head_dim, causal, offset, sq, sk) is fits


def test_the_grids_cover_the_query_blocks_and_the_key_blocks_of_the_head_dim() -> None:
    assert fused.grids(2, 8, 2, 1000, 4096, 128) == ((16, 8, 2), (32, 2, 2))
    assert fused.grids(2, 8, 2, 1000, 4096, 256) == ((16, 8, 2), (64, 2, 2))  # 64 keys a program


# ---------------------------------------------------------------------------
# The binding: memo key and plans


def test_the_memo_key_carries_the_fused_tail_for_a_call_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    call = plain_call(causal="bottom_right")
    assert bwd.fused_fits(call, torch.bfloat16, True, False)
    assert not bwd.fused_fits(call, torch.bfloat16, False, False) and not bwd.fused_fits(call, torch.float32, True,
                                                                                          False)
    assert not bwd.fused_fits(plain_call(softcap=5.0), torch.bfloat16, True, False)
    assert not bwd.fused_fits(call, torch.bfloat16, True, False, seq16=False)  # lse's strides are marked /16
    key = bwd.memo_key(0, torch.bfloat16, call.shape, True, True, False, fused_=True)
    assert key[-1:] == bwd.FUSED_TAIL and key[:-1] == bwd.memo_key(0, torch.bfloat16, call.shape, True, True, False)
    monkeypatch.setattr(bwd_dispatch, "GLUON_BY_DEFAULT", False)
    assert not bwd.fused_fits(call, torch.bfloat16, True, False)


def test_deterministic_mode_keeps_the_two_kernels(deterministic: None) -> None:
    assert not bwd.fused_fits(plain_call(), torch.bfloat16, True, False)


def test_a_deterministic_call_keeps_the_two_kernels() -> None:
    call = plain_call(causal="bottom_right")
    assert bwd.fused_fits(call, torch.bfloat16, True, False)
    assert not bwd.fused_fits(call, torch.bfloat16, True, False, deterministic=True)


def test_preload_hands_deterministic_to_the_backward_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a CUDA graph: ``preload(backward=True, deterministic=True)`` loads the deterministic backward's pair."""
    seen: list[bool] = []
    monkeypatch.setattr(fwd, "preload", lambda *args: "forward")
    monkeypatch.setattr(bwd, "preload", lambda *args, **kwargs: seen.append(args[-1]) or ("dq", "dkdv"))
    shape = (1, 2, 256, 64)
    assert lazytriton.preload(shape, shape, device="cuda:0", backward=True, deterministic=True) == [
        "forward", "dq", "dkdv"]
    lazytriton.preload(shape, shape, device="cuda:0", backward=True)
    assert seen == [True, False]
    with pytest.raises(TypeError, match="deterministic"):
        lazytriton.preload(shape, shape, device="cuda:0", backward=True, deterministic="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("asked", [False, True])
def test_flash_attn_func_carries_deterministic_to_its_backward(monkeypatch: pytest.MonkeyPatch, asked: bool) -> None:
    """The op saves the call's ``deterministic`` and hands it to the binding's backward (CPU: the interpreter)."""
    seen: list[bool] = []
    real = bwd.backward

    def spy(*args: object, deterministic: bool = False, **kwargs: object) -> bwd.Grads:
        seen.append(deterministic)
        return real(*args, deterministic=deterministic, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(bwd, "backward", spy)
    q, k, v = make_qkv(1, (2, 2), (16, 16), 16, torch.float32, "cpu", seed=5)
    do = torch.randn(1, 2, 16, 16)

    def fa(*t: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(*(x.transpose(1, 2) for x in t), causal=True,
                                          deterministic=asked).transpose(1, 2)

    got = grads_of(fa, q, k, v, do)
    assert seen == [asked]
    check_grads(q, k, v, do, got, causal="bottom_right")


def test_the_plan_loads_the_prep_and_the_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[Variant] = []

    class FakeRuntime:
        plans: dict[object, object] = {}
        capturing = False

        def kernel(self, variant: Variant, index: int | None) -> str:
            loaded.append(variant)
            return variant.kernel

    monkeypatch.setattr(machine, "target_of_device", lambda device: SM90)
    monkeypatch.setattr(launch, "refuse_loads_in_capture", lambda *a: None)
    call = plain_call()
    rt = FakeRuntime()
    entry = bwd.plan(rt, ("k",), torch.device("cuda", 0), torch.bfloat16, call.shape, False, True, False,
                     fused_=True)
    assert entry == (fused.PREP, fused.PREP_BLOCK_M, fused.NAME, 0) and rt.plans[("k",)] == entry
    assert [v.kernel for v in loaded] == [fused.PREP, fused.NAME]


@pytest.mark.parametrize("gqa", [False, True])
def test_the_fused_launch_passes_each_kernel_its_integers_by_name(monkeypatch: pytest.MonkeyPatch,
                                                                  gqa: bool) -> None:
    """``_launch_fused`` picks each kernel's integers by position from pack's tuples: the names must line up."""
    launched: dict[str, tuple[tuple[int, int, int], tuple[int, ...], tuple[float, ...]]] = {}

    class FakeKernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def launch(self, grid: tuple[int, int, int], stream: int, ints: tuple[int, ...],
                   floats: tuple[float, ...], scratch_alloc: object) -> None:
            launched[self.name] = (grid, ints, floats)

    allocated: list[torch.Tensor] = []
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        allocated.append(out)
        return out

    b, hq, hk, s, d = 2, 4, 2 if gqa else 4, 256, 56 if gqa else 64  # 56: 64's tile, padded
    q = torch.randn(b, s, hq, d, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, S, D) views of a bshd layout
    k, v = (torch.randn(b, s, hk, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    out, do = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(b, hq, s)
    call = fwd.check(q, k, v, "bottom_right", 0.3)
    grads = bwd.empty_grads(q, k, v)
    delta = torch.empty(b, hq, s)
    dq_ints, dkdv_ints, *_ = bwd.pack(q, k, v, out, do, lse, delta, *grads, call)
    monkeypatch.setattr(torch, "empty", empty)
    bwd._launch_fused(FakeKernel("prep"), FakeKernel("fused"), 0, dq_ints, dkdv_ints, grads, call)
    (dqa,) = allocated
    assert dqa.shape == (b, hq, s, 64) and dqa.dtype == torch.float32  # rows of the tile
    values = {"Q": q.data_ptr(), "K": k.data_ptr(), "V": v.data_ptr(), "Out": out.data_ptr(), "DO": do.data_ptr(),
              "Lse": lse.data_ptr(), "Delta": delta.data_ptr(), "DK": grads.dk.data_ptr(),
              "DV": grads.dv.data_ptr(), "DQA": dqa.data_ptr(), "heads_q": hq, "group_size": hq // hk,
              "seqlen_q": s, "seqlen_k": s, "head_dim": d, "causal_offset": 0, "stride_lb": hq * s,
              "stride_lh": s}
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", do), ("dk", grads.dk), ("dv", grads.dv)):
        values.update({f"stride_{prefix}b": t.stride(0), f"stride_{prefix}h": t.stride(1),
                       f"stride_{prefix}s": t.stride(2)})
    for name, spec in (("prep", fused.FLASH_BWD_PREP), ("fused", fused.FLASH_BWD_FUSED_GLUON)):
        grid, ints, floats = launched[name]
        names = [n for n, kind in spec.params if not kind.startswith("fp")]
        assert ints == tuple(values[n] for n in names), name
    assert launched["fused"][2] == (0.3,) and launched["prep"][2] == ()
    assert (launched["prep"][0], launched["fused"][0]) == fused.grids(b, hq, hk, s, s, d)


def test_prewarm_plans_the_fused_pair_beside_flash_bwd() -> None:
    from lazytriton import tuning

    axes = enumeration.Axes((SM90,), ("flash_bwd_dq", "flash_bwd_dkdv"), dtypes=("bf16",), head_dims=(64, 128),
                            causal=(True,), seqlens_q=(1024, 4096))
    planned = enumeration.enumerate_variants(axes, tuning.Table(()))
    pairs_ = {(p.variant.kernel, p.variant.get("BLOCK_D")) for p in planned if p.origin == "fused table"}
    # 4096 only (1024 is under the rows' minimum); each pair once by key
    assert pairs_ == {(fused.PREP, 128), (fused.NAME, 128), (fused.PREP, 64), (fused.NAME, 64)}
    assert {p.variant for p in planned if p.origin == "fused table"} >= set(pair(128, True))  # type: ignore[arg-type]
    kernels = [p.variant.kernel for p in planned]
    assert kernels.index(fused.NAME) > kernels.index("flash_bwd_dkdv")


# ---------------------------------------------------------------------------
# The prep kernel through the interpreter, both kernels compiled for sm_90


@pytest.mark.parametrize("d", [64, 40])  # 40: in 64's tile, O and dO read up to the head dim only
def test_the_prep_kernel_writes_delta_and_zeroes_the_accumulator(d: int) -> None:
    from lazytriton import compiler

    gen = torch.Generator().manual_seed(7)
    b, h, s, tile = 2, 3, 80, fused.tile(d)
    out = torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16).transpose(1, 2)  # bshd layout
    do = torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16)
    delta = torch.full((b, h, s), float("nan"))
    dqa = torch.full((b, h, s, tile), float("nan"))  # rows of the tile (the binding's)
    grid = fused.grids(b, h, h, s, 128, d)[0]
    compiler.interpret(fused.PREP, grid, (out, do, delta, dqa, *out.stride()[:3], *do.stride()[:3],
                                          *delta.stride()[:2], h, s, d),
                       {"BLOCK_M": fused.PREP_BLOCK_M, "BLOCK_D": tile})
    want = (out.float() * do.float()).sum(-1)
    assert torch.allclose(delta, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(dqa, torch.zeros_like(dqa))


@pytest.mark.parametrize("head_dim, causal, block_m, prefetch", [(128, "none", 64, False),
                                                                 (64, "bottom_right", 64, True),
                                                                 (256, "bottom_right", 64, True),
                                                                 (192, "none", 64, True),  # split: 128 + 64
                                                                 (160, "bottom_right", 64, False),  # 128 + 32
                                                                 (96, "none", 64, False),  # 64 + 32
                                                                 (80, "bottom_right", 64, True)])  # 64 + 16
def test_both_kernels_compile_for_sm90_into_entries(head_dim: int, causal: str, block_m: int, prefetch: bool) -> None:
    from lazytriton.compiler import compile_variant

    found = fused.variants("sm_90", "bf16", head_dim, causal, True, False, 4096, 4096, block_m, prefetch)
    assert found is not None
    prep, kernel = (compile_variant(v) for v in found)
    assert kernel.num_warps == 12  # consumer warpgroup 0, then warpgroup 1 and the producer warp (padded)
    assert fused.shared_bytes(head_dim, block_m) <= kernel.shared <= fused.shared_bytes(head_dim, block_m) \
        + fused.SHARED_SLACK
    assert kernel.global_scratch_size > 0  # device-side descriptors
    assert prep.shared < 4096 and prep.num_warps == 4


@pytest.mark.parametrize("head_dim", [128, 256, 192, 224])
def test_the_served_kernels_move_rows_16_bytes_a_thread(head_dim: int, tmp_path: Path) -> None:
    """head_dim is marked 8-divisible (``eight_params``: the rule takes multiples of 8 only), so the masked dK/dV
    stores of the fused kernel and the prep kernel's masked O/dO loads are 16-byte accesses, as the JIT probes
    that measured them compiled them; unmarked they compile to 2-byte ones (H200, 12-02: the kernel 869 µs a call in
    the served backward at hd128 1k against 686 µs in the probe)."""
    from lazytriton.compiler import compile_variant

    found = fused.variants("sm_90", "bf16", head_dim, "none", True, False, 4096, 4096, 64, True)
    assert found is not None
    prep, kernel = (sass_of(compile_variant(v).binary, tmp_path) for v in found)
    stores = re.findall(r"STG\.E(\.[A-Z0-9]+)?", kernel)
    # No .U16 / .16, nor 4 bytes a thread from the MMA's layout; 8-byte ones where the split wide program stages its
    # second chunk of dK and dV through a float32 tile
    assert stores and set(stores) <= {".128", ".64"}, sorted(set(stores))
    assert ".128" in stores
    loads = re.findall(r"LDG\.E(\.[A-Z0-9]+)?(\.CONSTANT)?", prep)
    assert ".128" in {size for size, _ in loads} and not any(size in (".U16", ".16") for size, _ in loads)


def _fused_ptx(fn: object, head_dim: int, causal: bool, **flags: bool) -> str:
    """PTX of a fused-kernel function (the served one or a probe's copy) for sm_90, bf16, BLOCK_M 64."""
    import triton
    from triton.backends.compiler import GPUTarget
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:  # Triton 3.6
        from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = {"BLOCK_M": 64, "BLOCK_D": head_dim, "CAUSAL": causal, "PREFETCH": False, "BLOCK_D2": 0, **flags}
    names = fn.arg_names  # type: ignore[attr-defined]
    signature = {name: "i32" for name in names}
    signature.update({name: "*bf16" for name in ("Q", "K", "V", "DO", "DK", "DV")})
    signature.update({name: "*fp32" for name in ("Lse", "Delta", "DQA")}, sm_scale="fp32")
    signature.update({name: "constexpr" for name in constexprs})
    source = GluonASTSource(fn, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


def test_the_narrow_program_brings_lse_and_delta_through_the_ring() -> None:
    """At head dims 64/128 the producer loads each step's lse and delta rows by 1-D TMA with Q and dO (NOTES.md,
    2026-12-01: loaded from global memory they sit on every step's path); hd256 keeps its global loads (rows as M:
    2 a thread)."""
    from lazytriton.kernels.flash_bwd import fused_kernel

    fn = fused_kernel.flash_bwd_fused_gluon_kernel
    assert "cp.async.bulk.tensor.1d.shared" in _fused_ptx(fn, 128, True)
    assert "cp.async.bulk.tensor.1d.shared" not in _fused_ptx(fn, 256, False, PREFETCH=True)


def test_the_variant_probe_parses_its_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    variants = importlib.import_module("probe_fused_variants")
    assert variants.parse_variant("x=copy.py:EARLY=1,FLAT=0") == ("x", ("copy.py", {"EARLY": 1, "FLAT": 0}))
    assert variants.parse_variant("head=head.py") == ("head", ("head.py", {}))


def test_the_tracing_copy_of_the_fused_kernel_is_made_from_the_current_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_trace_kernel.py edits the kernel by exact strings: a change to the kernel that moves a traced line must
    fail here, not when a GPU round needs the trace."""
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    maker = importlib.import_module("make_trace_kernel")
    copy = maker.traced((REPO / "kernels" / "flash_bwd" / "fused_kernel.py").read_text())
    for slot in (0, 1, 2, 3, 4, 5, 6, 8):
        assert f"_stamp(Trace, {slot})" in copy
    assert "_stamp_sm(Trace)" in copy
    compile(copy, "fused_trace_kernel.py", "exec")  # it parses


def test_the_overhead_probe_parses_a_trial_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    probe = importlib.import_module("probe_bwd_overhead")
    assert probe.parse_row("64,1") == (64, True) and probe.parse_row("128,0") == (128, False)
    for bad in ("64", "64,2", "x,1", "64,true"):
        with pytest.raises(Exception, match="BLOCK_M,PREFETCH"):
            probe.parse_row(bad)


def _wgmma_columns(ptx: str) -> int:
    """The wgmma instructions' N summed (each m64 x k16): the work the kernel's products issue."""
    return sum(int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx))


@pytest.mark.parametrize("block_d, block_d2", [(128, 64), (128, 32), (128, 16), (64, 32), (64, 16)])
def test_the_split_programs_multiply_no_padded_column(block_d: int, block_d2: int) -> None:
    """A head dim in two chunks (192 = 128 + 64, ..., 80 = 64 + 16): every product (S, dP, dV, dK, dQ) issues its
    chunks' columns only, (BLOCK_D + BLOCK_D2) / padded tile of the padded program's wgmma work, and no
    accumulator as wide as the padded tile's."""
    from lazytriton.kernels.flash_bwd import fused_kernel

    fn = fused_kernel.flash_bwd_fused_gluon_kernel
    split = _fused_ptx(fn, block_d, False, BLOCK_D2=block_d2)
    padded = _fused_ptx(fn, 2 * block_d, False)
    assert _wgmma_columns(split) * 2 * block_d == _wgmma_columns(padded) * (block_d + block_d2)
    widest = max(int(n) for n in re.findall(r"\.m64n(\d+)k16", padded))
    assert f"m64n{widest}k16" not in split  # dK/dV of the padded tile (wide: its half) are gone
    # dQ's reductions, as many as the padded program's: the narrow one's warpgroups send a chunk each (one product
    # of the chunk's width), the wide one's the second chunk's half in place of its second 64 columns; at 192 a
    # warpgroup's first 64 columns go as two boxes of the descriptor both chunks share (_descriptors), one more
    shared = 1 if block_d2 * 2 == 128 else 0
    assert split.count("cp.reduce.async.bulk.tensor") == padded.count("cp.reduce.async.bulk.tensor") + 2 * shared
    if block_d < 128:
        assert f"m64n{block_d2 // 2}k16" not in split  # no product of half the second chunk's columns


@pytest.mark.parametrize("block_d, block_d2, made", [(128, 64, 6), (128, 32, 12), (64, 32, 12), (64, 16, 12),
                                                     (256, 0, 6), (128, 0, 8)])
def test_a_second_chunk_of_one_swizzle_span_shares_its_descriptors(block_d: int, block_d2: int, made: int) -> None:
    """At 192 = 128 + 64 the second chunk's rows are one 128-byte swizzle span, so its boxes tile the first chunk's
    buffers too: K, V, Q, dO and dQ's accumulator each take one descriptor, as at 256 (six a program: K, V, two of
    dQ's, Q and dO), not two. Each is made on the device at ~0.7 µs of its partition's time before the program's
    first step (H200 trace, 2026-12-02, a descriptor a chunk: K/V in 4.6-5.1 µs at 192 against 3.2-3.6 at 256).
    Other splits keep a descriptor a chunk."""
    from lazytriton.kernels.flash_bwd import fused_kernel

    ptx = _fused_ptx(fused_kernel.flash_bwd_fused_gluon_kernel, block_d, True, BLOCK_D2=block_d2)
    assert ptx.count("fence.proxy.tensormap::generic.acquire") == made


@pytest.mark.parametrize("block_d2, causal", [(32, False), (32, True), (16, True)])
def test_the_narrow_split_programs_keep_their_registers(block_d2: int, causal: bool, tmp_path: Path) -> None:
    """The served 96 = 64 + 32 and 80 = 64 + 16 programs (PREFETCH off) do not spill: with each warpgroup's dQ half
    of both chunks (two products, two tiles) ptxas of Triton 3.6 spilled 88-204 bytes a thread in all of them, and
    dQ by chunk made them 1.17-1.22x faster on the H200 (NOTES.md, 2026-12-02)."""
    from lazytriton.kernels.flash_bwd import fused_kernel

    _, stores, loads = ptxas_report(_fused_ptx(fused_kernel.flash_bwd_fused_gluon_kernel, 64, causal,
                                               BLOCK_D2=block_d2), tmp_path)
    assert (stores, loads) == (0, 0)


# ---------------------------------------------------------------------------
# GPU


@on_gpu
@pytest.mark.parametrize("dtype, causal, heads, seqlens, head_dim, layout", [
    # Keys from 2048: the rows' minimum (BWD_FUSED_TABLE)
    (torch.bfloat16, False, (4, 4), (256, 2048), 128, "bhsd"),
    (torch.bfloat16, "bottom_right", (8, 2), (256, 2304), 128, "bshd"),  # GQA, causal offset 2048
    (torch.float16, True, (2, 2), (2048, 2048), 128, "bhsd"),
    # 10 (batch, head) pairs: causal programs run longest first 8 pairs at a time, then the last 2
    (torch.bfloat16, True, (5, 5), (2048, 2048), 128, "bhsd"),
    (torch.bfloat16, False, (4, 1), (2048, 2048), 64, "bshd"),  # MQA
    (torch.float16, True, (2, 2), (2048, 2048), 64, "bhsd"),
    # The rows from 1k keys (BWD_FUSED_TABLE)
    (torch.float16, False, (4, 2), (1024, 1024), 64, "bhsd"),
    (torch.bfloat16, True, (3, 3), (1024, 1024), 128, "bhsd"),
    (torch.float16, True, (2, 2), (1024, 1024), 192, "bhsd"),
    (torch.bfloat16, True, (2, 2), (1024, 1024), 96, "bhsd"),  # from 1k keys (dQ by chunk)
    (torch.float16, False, (4, 2), (128, 1024), 80, "bshd"),
    # Head dim 256: 64 keys a program, from 1024 keys
    (torch.bfloat16, False, (4, 2), (128, 1024), 256, "bhsd"),  # GQA
    (torch.bfloat16, "bottom_right", (2, 2), (192, 1088), 256, "bshd"),  # causal offset 896
    (torch.float16, True, (2, 2), (1024, 1024), 256, "bhsd"),
    (torch.bfloat16, True, (5, 5), (1024, 1024), 256, "bhsd"),  # 10 pairs: longest first 8 at a time, then 2
    # Head dims between the powers of two: 224 in 256's tile, 80, 96, 160 and 192 in two chunks (fused.chunks);
    # dK and dV stop at the head dim (bshd: the next head's columns follow), dQ is the accumulator's first head_dim
    # columns
    (torch.bfloat16, False, (4, 4), (256, 2048), 96, "bhsd"),
    (torch.float16, "bottom_right", (4, 2), (256, 2304), 80, "bshd"),
    (torch.bfloat16, True, (2, 2), (1024, 1024), 224, "bhsd"),
    (torch.bfloat16, False, (4, 2), (128, 2048), 192, "bshd"),
    (torch.float16, True, (2, 2), (2048, 2048), 160, "bhsd"),
    (torch.float16, "bottom_right", (4, 2), (128, 2112), 160, "bshd"),  # GQA, causal offset 1984
    (torch.bfloat16, True, (2, 2), (2048, 2048), 192, "bhsd"),
    (torch.bfloat16, "bottom_right", (4, 2), (192, 1088), 192, "bshd"),  # one descriptor for both chunks
    (torch.bfloat16, True, (2, 2), (2048, 2048), 96, "bhsd"),
    (torch.bfloat16, False, (4, 2), (128, 2048), 80, "bshd"),
    # Split head dims without a table row (a row added for the test): a second chunk zero-filled past the head dim
    # (176 = 128 + 64) and the wide program's 16-column second chunk (144 = 128 + 16). (72 = 64 + 16 would too,
    # but its rows of 72 elements are no multiple of 16: never ALIGN16, so the fused kernel never serves it.)
    (torch.float16, True, (2, 2), (1024, 1024), 176, "bhsd"),
    (torch.bfloat16, "bottom_right", (4, 2), (192, 1088), 144, "bshd"),
], ids=str)
def test_the_fused_backward_serves_through_autograd_within_the_rule_on_gpu(
        resolved: list[Variant], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, causal: bool | str,
        heads: tuple[int, int], seqlens: tuple[int, int], head_dim: int, layout: str) -> None:
    key = (fwd.DTYPES[dtype], head_dim, causal is not False)
    if key not in bwd_dispatch.BWD_FUSED_TABLE:
        monkeypatch.setitem(bwd_dispatch.BWD_FUSED_TABLE, key, (64, False, 1024))
    q, k, v = make_qkv(2, heads, seqlens, head_dim, dtype, "cuda", seed=sum(seqlens) + head_dim)
    skip_unless_sm90(q, fused.NAME)
    do = torch.randn(q.shape, device="cuda").to(dtype)
    if layout == "bshd":  # flash_attn_func's layout: strided (b, h, s) views
        def fa(*t: torch.Tensor) -> torch.Tensor:
            return lazytriton.flash_attn_func(*(x.transpose(1, 2) for x in t), causal=causal is not False
                                              ).transpose(1, 2)
        if causal is True:
            pytest.skip("flash_attn_func's causal is bottom-right")
    else:
        def fa(*t: torch.Tensor) -> torch.Tensor:
            return lazytriton.attn_fwd(*t, causal=causal)[0]
    got = grads_of(fa, q, k, v, do)
    check_grads(q, k, v, do, got, causal=causal)
    served = [r for r in resolved if r.kernel == fused.NAME]
    assert served and served[0].get("BLOCK_D") == fused.chunks(head_dim)[0], resolved
    assert served[0].constexprs.get("BLOCK_D2", 0) == fused.chunks(head_dim)[1]


@on_gpu
def test_a_deterministic_call_is_reproducible_bit_for_bit_on_gpu(resolved: list[Variant]) -> None:
    """``flash_attn_func(deterministic=True)`` on a shape the fused table serves: the two kernels, bit for bit."""
    q, k, v = make_qkv(1, (4, 2), (1024, 2048), 128, torch.bfloat16, "cuda", seed=11)
    skip_unless_sm90(q, fused.NAME)
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)

    def fa(*t: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(*(x.transpose(1, 2) for x in t), causal=True,
                                          deterministic=True).transpose(1, 2)

    first = grads_of(fa, q, k, v, do)
    check_grads(q, k, v, do, first, causal="bottom_right")
    assert all(torch.equal(a, b) for a, b in zip(first, grads_of(fa, q, k, v, do), strict=True))
    assert not any(r.kernel == fused.NAME for r in resolved), resolved
