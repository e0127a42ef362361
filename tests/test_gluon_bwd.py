"""flash_bwd_dkdv_gluon: registration, dispatch's rule and table, the backward's memo key, prewarm, sm_90 compiles.

The kernel runs only on a Hopper GPU (Triton's interpreter does not run
Gluon): the GPU tests at the end check its gradients against the float64
reference (FlashAttention's rule) and against flash_bwd_dkdv, served by
default and forced tiling by tiling; experiments/probe_gluon_bwd.py times it.
On the CPU: the spec shares flash_bwd_dkdv's parameters (the binding packs
its arguments unchanged), the rule refuses every call it would not compute
exactly, the memo key and plans pick it only for calls that fit its row, and
the installed Triton compiles it for cuda:90 through lazytriton's compile path.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from test_flash_bwd import check_grads, grads_of
from test_flash_fwd import make_qkv, on_gpu, skip_unless_sm90

import lazytriton
from lazytriton import machine
from lazytriton.kernels import dispatch, get, source_fingerprint
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, fused, gluon
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields, kernel_constexprs

SM90 = Target.parse("sm_90")
SM80 = Target.parse("sm_80")
NAME = "flash_bwd_dkdv_gluon"


def default(head_dim: int = 128, causal: bool = False, sq: int = 4096, sk: int = 4096,
            dtype: str = "bf16") -> Variant | None:
    return bwd_dispatch.flash_bwd_dkdv_gluon_default_variant(SM90, dtype, head_dim, causal, True, False, sq, sk)


def plain_call(sq: int = 4096, sk: int = 4096, head_dim: int = 128, causal: bool | str = False,
               heads: tuple[int, int] = (2, 2), dtype: torch.dtype = torch.bfloat16, **kw: object) -> fwd.Call:
    q = torch.empty(1, heads[0], sq, head_dim, dtype=dtype, device="meta")
    k = torch.empty(1, heads[1], sk, head_dim, dtype=dtype, device="meta")
    return fwd.check(q, k, k, causal, None, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Registration and variants


def test_the_spec_shares_flash_bwd_dkdvs_parameters_and_has_its_own_source() -> None:
    spec = get(NAME)
    assert spec.params == FLASH_BWD_DKDV.params  # binding.pack, the grid and the C launcher's layout hold
    assert spec.aligned_params == FLASH_BWD_DKDV.aligned_params
    assert spec.source_path.name == "gluon_kernel.py" and spec.source_path.parent.name == "flash_bwd"
    assert source_fingerprint(NAME) != source_fingerprint("flash_bwd_dkdv")
    fn = getattr(importlib.import_module(spec.module), spec.function)
    assert list(fn.arg_names) == [name for name, _ in spec.params] + list(spec.constexprs)


def test_the_default_variant_is_complete_round_trips_and_keys_apart() -> None:
    v = default(128, False)
    assert v is not None
    assert str(v) == ("flash_bwd_dkdv_gluon:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
                      "INDEX64=false:BLOCK_M=64,BLOCK_N=64,OVERLAP=true:num_stages=2,num_warps=4")
    assert check_fields(v) is v and Variant.parse(str(v)) == v
    triton = dispatch.kernel_variant("flash_bwd_dkdv", SM90, "bf16", 128, False, True, 4096, 4096)
    assert triton.kernel == "flash_bwd_dkdv" and v.key() != triton.key()
    assert kernel_constexprs(v, get(NAME).constexprs) == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128,
                                                          "EVEN_D": True, "CAUSAL": False, "OVERLAP": True}
    causal = gluon.variant("sm_90", "bf16", 128, "bottom_right", True, False, 2048, 4096)
    assert causal is not None and causal.get("CAUSAL") is True and default(128, True) is None  # no causal row


def test_tiles_outside_the_kernels_configs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tiles must be one of .* got \(128, 64, 4\)"):
        gluon.variant("sm_90", "bf16", 128, "none", True, False, 4096, 4096, tiles=(128, 64, 4))  # 16 x warps
    v = gluon.variant("sm_90", "bf16", 64, "none", True, False, 4096, 4096, tiles=(128, 32, 8), overlap=False)
    assert v is not None and (v.get("BLOCK_N"), v.get("BLOCK_M"), v.get("num_warps"), v.get("OVERLAP")) == (
        128, 32, 8, False)


def test_configs_fit_shared_memory() -> None:
    for head_dim in gluon.HEAD_DIMS:
        for block_n, block_m, warps in gluon.configs(head_dim):
            assert block_n == 16 * warps
            assert gluon.shared_bytes(head_dim, block_n, block_m) + gluon.SHARED_SLACK <= gluon.SM90_SHARED


# ---------------------------------------------------------------------------
# The rule and dispatch's table


@pytest.mark.parametrize("target, dtype, head_dim, causal, aligned, index64, sq, sk, features, why", [
    ("sm_80", "bf16", 128, "none", True, False, 4096, 4096, False, "target"),
    ("sm_90", "fp32", 128, "none", True, False, 4096, 4096, False, "dtype"),
    ("sm_90", "bf16", 96, "none", True, False, 4096, 4096, False, "head dim"),
    ("sm_90", "bf16", 256, "none", True, False, 4096, 4096, False, "head dim"),
    ("sm_90", "bf16", 128, "none", False, False, 4096, 4096, False, "aligned"),
    ("sm_90", "bf16", 128, "none", True, True, 4096, 4096, False, "32-bit"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4096, True, "not implemented"),
    ("sm_90", "bf16", 128, "none", True, False, 4000, 4096, False, "multiples"),
    ("sm_90", "bf16", 128, "none", True, False, 4096, 4000, False, "multiples"),
    ("sm_90", "bf16", 128, "none", True, False, 0, 4096, False, "positive"),
    ("sm_90", "bf16", 128, "bottom_right", True, False, 4096, 2048, False, "without keys"),
])
def test_reason_refuses_what_the_kernel_does_not_compute(target: str, dtype: str, head_dim: int, causal: str,
                                                         aligned: bool, index64: bool, sq: int, sk: int,
                                                         features: bool, why: str) -> None:
    got = gluon.reason(target, dtype, head_dim, causal, aligned, index64, sq, sk, 64, 64, features)
    assert got is not None and why in got
    assert gluon.variant(target, dtype, head_dim, causal, aligned, index64, sq, sk, features=features) is None


def test_the_table_rows_are_variants_the_kernel_takes() -> None:
    assert bwd_dispatch.BWD_GLUON_TABLE  # measured rows (NOTES.md 12-01)
    for (dtype, head_dim, causal), (tiles, overlap, min_seqlen_k) in bwd_dispatch.BWD_GLUON_TABLE.items():
        assert tiles in gluon.configs(head_dim)
        v = default(head_dim, causal, 4096, max(4096, min_seqlen_k), dtype)
        assert v is not None and v.get("OVERLAP") is overlap
    assert set(bwd_dispatch.BWD_GLUON_TABLE) == {(dtype, 128, False) for dtype in ("bf16", "fp16")}  # where it won


@pytest.mark.parametrize("head_dim, causal, offset, sq, sk, fits", [
    (128, False, 0, 4096, 4096, True),
    (128, True, 0, 2048, 2048, False),  # no row (level with flash_bwd_dkdv on the H200)
    (128, False, 0, 1024, 1024, False),  # under the row's minimum seqlen_k (the Triton kernel is faster at 1k)
    (128, False, 0, 4096 + 16, 4096, False),  # a ragged query tile
    (128, False, 0, 4096, 4096 + 16, False),  # a ragged key tile
    (64, True, 0, 4096, 4096, False),  # no row (slower in the whole backward)
    (64, False, 0, 4096, 4096, False),
    (96, True, 0, 4096, 4096, False),
])
def test_fits_is_the_rule_the_buckets_cannot_see(head_dim: int, causal: bool, offset: int, sq: int, sk: int,
                                                 fits: bool) -> None:
    assert bwd_dispatch.flash_bwd_gluon_fits("bf16", head_dim, causal, offset, sq, sk) is fits


def test_gluon_by_default_false_keeps_flash_bwd_dkdv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwd_dispatch, "GLUON_BY_DEFAULT", False)
    assert not bwd_dispatch.flash_bwd_gluon_fits("bf16", 128, False, 0, 4096, 4096)
    assert default() is None


# ---------------------------------------------------------------------------
# The backward's memo key and plans


def test_gluon_fits_takes_only_plain_aligned_calls() -> None:
    assert bwd.gluon_fits(plain_call(), torch.bfloat16, True, False)
    assert bwd.gluon_fits(plain_call(sq=2048, sk=4096), torch.float16, True, False)
    assert not bwd.gluon_fits(plain_call(causal="bottom_right", sq=2048, sk=4096), torch.float16, True, False)
    assert not bwd.gluon_fits(plain_call(), torch.bfloat16, False, False)  # unaligned
    assert not bwd.gluon_fits(plain_call(), torch.bfloat16, True, True)  # 64-bit offsets
    assert not bwd.gluon_fits(plain_call(), torch.float32, True, False)
    assert not bwd.gluon_fits(plain_call(window=(128, 128)), torch.bfloat16, True, False)
    assert not bwd.gluon_fits(plain_call(softcap=30.0), torch.bfloat16, True, False)
    assert not bwd.gluon_fits(plain_call(sq=1024, sk=1024), torch.bfloat16, True, False)


def test_the_memo_key_carries_the_tail_and_the_plan_follows_it() -> None:
    call = plain_call()
    shape = call.shape
    plain = bwd.memo_key(0, torch.bfloat16, shape, False, True, False)
    tailed = bwd.memo_key(0, torch.bfloat16, shape, False, True, False, gluon=True)
    assert tailed == plain + bwd.GLUON_TAIL and tailed != plain
    dq, dkdv = bwd.variants(SM90, torch.bfloat16, shape, False, True, False, gluon=True)
    assert dq.kernel == "flash_bwd_dq" and dkdv.kernel == NAME
    assert int(dkdv.get("BLOCK_N")) == 64  # type: ignore[arg-type]  # the grid follows the variant's BLOCK_N
    assert [v.kernel for v in bwd.variants(SM90, torch.bfloat16, shape, False, True, False)] == [
        "flash_bwd_dq", "flash_bwd_dkdv"]  # no tail: as before
    assert [v.kernel for v in bwd.variants(SM80, torch.bfloat16, shape, False, True, False, gluon=True)] == [
        "flash_bwd_dq", "flash_bwd_dkdv"]  # no wgmma there
    assert [v.kernel for v in bwd.variants(SM90, torch.bfloat16, shape, False, False, False, gluon=True)] == [
        "flash_bwd_dq", "flash_bwd_dkdv"]  # unaligned


def test_prewarm_plans_the_gluon_twin_right_after_its_flash_bwd_dkdv() -> None:
    from lazytriton import tuning
    from lazytriton.prewarm import enumeration

    axes = enumeration.Axes((SM90,), ("flash_bwd_dq", "flash_bwd_dkdv"), dtypes=("bf16",), head_dims=(128,),
                            causal=(False, True), seqlens_q=(1024, 4096))
    twins = [p for p in enumeration.enumerate_variants(axes, tuning.Table(())) if p.variant.kernel == NAME]
    assert {(p.variant.get("CAUSAL"), p.origin) for p in twins} == {(False, "gluon table")}  # the one row
    # 4096 only (1024 is under the row's minimum), the variant dispatch serves, once per alignment pair
    assert {p.variant for p in twins} == {default(128, False)}
    planned = [p.variant.kernel for p in enumeration.enumerate_variants(axes, tuning.Table(()))]
    # Right after it, or after the fused pair of an earlier seqlen when its flash_bwd_dkdv was that one's too
    twins = {NAME, fused.NAME, fused.PREP}
    for i, kernel in enumerate(planned):
        if kernel == NAME:
            before = [k for k in planned[:i] if k not in twins]
            assert before[-1] == "flash_bwd_dkdv", planned


# ---------------------------------------------------------------------------
# sm_90 compiles (the installed Triton; tests/test_other_triton.py compiles it under the other one)


@pytest.mark.parametrize("head_dim, causal, tiles, overlap, shared", [
    (128, False, (64, 64, 4), True, 98456),  # K, V 16 KiB each + 2 x 2 Q/dO tiles of 16 KiB
    (128, True, (128, 64, 8), False, 131224),
    (64, True, (64, 64, 4), True, 49304),
])
def test_compiles_for_sm90_into_an_entry_with_flash_bwd_dkdvs_launch_layout(
        head_dim: int, causal: bool, tiles: tuple[int, int, int], overlap: bool, shared: int) -> None:
    from lazytriton.compiler import compile_variant, triton_version

    variant = gluon.variant("sm_90", "bf16", head_dim, "top_left" if causal else "none", True, False, 4096, 4096,
                            tiles=tiles, overlap=overlap)
    assert variant is not None
    entry = compile_variant(variant)
    assert entry.kind == "cubin" and entry.binary and entry.num_warps == tiles[2]
    assert entry.shared == shared  # the same under Triton 3.6.0 and 3.9.0 (measured)
    assert 0 <= shared - gluon.shared_bytes(head_dim, tiles[0], tiles[1]) <= gluon.SHARED_SLACK
    assert entry.global_scratch_size == 4 * 128  # device-side TMA descriptors: K, V, Q, dO
    signature = FLASH_BWD_DKDV.signature("bf16")
    assert entry.arg_types == tuple(kind for kind in signature.values() if kind != "constexpr")
    assert entry.provenance.compiler_version == triton_version()


def test_its_ptx_has_tma_loads_async_wgmma_and_mbarrier_waits() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:  # Triton 3.6
        from triton.experimental.gluon._runtime import GluonASTSource

    variant = gluon.variant("sm_90", "bf16", 128, "top_left", True, False, 4096, 4096)  # causal: both loops' code
    assert variant is not None
    spec = get(NAME)
    fn = getattr(importlib.import_module(spec.module), spec.function)
    source = GluonASTSource(fn, spec.signature("bf16"), constexprs=kernel_constexprs(variant, spec.constexprs))
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 2;" in ptx  # OVERLAP: S, dP retire first
    assert "cp.async.bulk.tensor.2d.shared" in ptx  # TMA loads of K, V, Q and dO
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx


def _probe(monkeypatch: pytest.MonkeyPatch, name: str) -> object:
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    return importlib.import_module(name)


def test_the_probes_tilings_are_ones_the_kernel_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = _probe(monkeypatch, "probe_gluon_bwd")
    for head_dim, tilings in probe.TILINGS.items():  # type: ignore[attr-defined]
        assert all(tuple(t[:3]) in gluon.configs(head_dim) for t in tilings), head_dim


def test_the_fused_probe_kernel_compiles_with_a_tma_reduction_of_dq(monkeypatch: pytest.MonkeyPatch) -> None:
    """experiments/gluon_bwd_probe_kernel.py (the fused backward): dQ leaves by cp.reduce.async.bulk, not red."""
    import triton
    from triton.backends.compiler import GPUTarget
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:  # Triton 3.6
        from triton.experimental.gluon._runtime import GluonASTSource

    fn = _probe(monkeypatch, "gluon_bwd_probe_kernel").gluon_bwd_fused_kernel  # type: ignore[attr-defined]
    constexprs = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128, "CAUSAL": True, "STAGES": 2}
    signature = {name: "i32" for name in fn.arg_names}
    signature.update({name: "*bf16" for name in ("Q", "K", "V", "DO", "DK", "DV")})
    signature.update({name: "*fp32" for name in ("Lse", "Delta", "DQA")}, sm_scale="fp32")
    signature.update({name: "constexpr" for name in constexprs})
    ptx = triton.compile(GluonASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    assert "cp.reduce.async.bulk.tensor" in ptx and "red.global" not in ptx


def test_the_atomic_dq_probe_runs_and_checks_on_cpu() -> None:
    """experiments/probe_bwd_atomic.py --cpu-smoke: the fused kernel with atomic dQ, interpreted, within the rule."""
    import subprocess
    import sys

    from conftest import REPO

    done = subprocess.run([sys.executable, str(REPO / "experiments" / "probe_bwd_atomic.py"), "--cpu-smoke"],
                          capture_output=True, text=True, timeout=600, check=False, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    checked = [line for line in done.stdout.splitlines() if "err/allowed" in line]
    assert len(checked) == 4 and all(float(line.split()[-1]) <= 1.0 for line in checked), checked


# ---------------------------------------------------------------------------
# On the GPU: gradients


@on_gpu
@pytest.mark.parametrize("tiles, overlap", [(t, o) for t in gluon.CONFIGS for o in (True, False)], ids=str)
@pytest.mark.parametrize("dtype, causal, heads, seqlens, head_dim", [
    (torch.bfloat16, False, (4, 4), (256, 512), 128),
    (torch.bfloat16, "bottom_right", (8, 2), (256, 768), 128),  # GQA, causal offset 512
    (torch.float16, True, (2, 2), (512, 512), 64),
    (torch.bfloat16, "bottom_right", (4, 1), (384, 384), 64),  # MQA
], ids=str)
def test_forced_tilings_give_flash_bwd_dkdvs_gradients_on_gpu(tiles: tuple[int, int, int], overlap: bool,
                                                              dtype: torch.dtype, causal: bool | str,
                                                              heads: tuple[int, int], seqlens: tuple[int, int],
                                                              head_dim: int) -> None:
    """Each tiling, forced through the binding in flash_bwd_dkdv's place, within FlashAttention's rule."""
    q, k, v = make_qkv(1, heads, seqlens, head_dim, dtype, "cuda", seed=sum(seqlens) + head_dim)
    skip_unless_sm90(q, NAME)
    do = torch.randn(q.shape, device="cuda").to(dtype)
    call = fwd.check(q, k, v, causal)
    mode = "top_left" if causal is True else causal or "none"
    variant = gluon.variant("sm_90", fwd.DTYPES[dtype], head_dim, mode, True, False, seqlens[0], seqlens[1],
                            tiles=tiles, overlap=overlap)
    if variant is None:
        pytest.skip(f"tiles {tiles} do not divide seqlens {seqlens}")
    out, lse = fwd.forward(q, k, v, call)
    dq_variant, triton = bwd.variants(machine.target_of_device(q.device), dtype, call.shape, causal is not False,
                                      True, False)
    want = bwd.empty_grads(q, k, v)
    bwd.launch_gpu(q, k, v, out, lse, do, want, call, forced=(dq_variant, triton))
    got = bwd.empty_grads(q, k, v)
    bwd.launch_gpu(q, k, v, out, lse, do, got, call, forced=(dq_variant, variant))
    torch.cuda.synchronize()
    check_grads(q, k, v, do, tuple(got), causal=causal)
    for name, a, b in (("dk", got.dk, want.dk), ("dv", got.dv, want.dv)):
        scale = max(1.0, float(b.abs().max()))
        assert float((a.float() - b.float()).abs().max()) <= 2e-2 * scale, name


@on_gpu
def test_a_table_row_serves_the_backward_and_is_reproducible_on_gpu(resolved: list[Variant]) -> None:
    """A plain call that fits a row runs flash_bwd_dkdv_gluon through autograd, within the rule, bit for bit twice.

    In deterministic mode, which keeps the fused backward (test_fused_bwd.py) out: it would serve the call.
    """
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _row_serves(resolved)
    finally:
        torch.use_deterministic_algorithms(before)


def _row_serves(resolved: list[Variant]) -> None:
    q, k, v = make_qkv(1, (4, 2), (1024, 2048), 128, torch.bfloat16, "cuda", seed=2048)
    skip_unless_sm90(q, NAME)
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)

    def fa(*t: torch.Tensor) -> torch.Tensor:
        return lazytriton.attn_fwd(*t)[0]

    first = grads_of(fa, q, k, v, do)
    check_grads(q, k, v, do, first)
    second = grads_of(fa, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # no atomics: deterministic
    assert any(r.kernel == NAME for r in resolved), resolved
    assert not any(r.kernel == "flash_bwd_fused_gluon" for r in resolved), resolved
