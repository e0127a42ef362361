"""Split tiles in the backward (issue 11, item 4): flash_bwd_dq and flash_bwd_dkdv with ``BLOCK_D2``.

A head dim like 96 runs as two power-of-two chunks (64 + 32) in both backward
kernels, as in the forward (tests/test_split_d.py), where dispatch splits
(``attention.SPLIT_BY_DEFAULT``). On CPU the public entry points run the
backward through Triton's interpreter with dispatch's head-dim constexprs
(``flash_bwd.binding.head_dim_constexprs``), so these tests run the split
kernels; numerics against a float64 reference with FlashAttention's rule
(tests/test_flash_bwd.py's ``check_grads``), and against the padded kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_flash_bwd import check_grads, grads_of
from test_flash_fwd import make_qkv, on_gpu

import lazytriton
from lazytriton import compiler, geometry, machine, runtime, tuning
from lazytriton.cli.tune import flash_bwd as tune_bwd
from lazytriton.kernels import attention, dispatch
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import binding
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant, check_fields, kernel_constexprs, pairs

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

SM90 = Target.parse("sm_90")
BWD = (FLASH_BWD_DQ.name, FLASH_BWD_DKDV.name)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every (kernel, constexprs) the interpreter runs during the test, recorded."""
    seen: list[tuple[str, dict[str, Any]]] = []
    real = compiler.interpret

    def spy(kernel: str, grid: Any, args: Any, constexprs: dict[str, Any]) -> None:
        seen.append((kernel, dict(constexprs)))
        real(kernel, grid, args, constexprs)

    monkeypatch.setattr(compiler, "interpret", spy)
    yield seen


def _split_runs(seen: list[tuple[str, dict[str, Any]]]) -> dict[str, int]:
    return {kernel: constexprs["BLOCK_D2"] for kernel, constexprs in seen if kernel in BWD}


# ---------------------------------------------------------------------------
# Dispatch and variants


@pytest.mark.parametrize("kernel", BWD)
def test_dispatch_splits_the_backward_kernels_at_96_and_not_at_128(kernel: str) -> None:
    split = check_fields(dispatch.kernel_variant(kernel, SM90, "bf16", 96, True, True, 4096, 4096))
    padded = dispatch.kernel_variant(kernel, SM90, "bf16", 96, True, True, 4096, 4096, split_d=False)
    assert (split.get("BLOCK_D"), split.get("BLOCK_D2"), split.get("EVEN_D")) == (64, 32, True)
    # Without rows of its own (the shipped table has 96's at 1k, tuned in split tiles), the padded head dim's tiles
    table = tuning.Table([r for r in tuning.table_for(kernel).rows if r.head_dim != 96])
    untuned = dispatch.kernel_variant(kernel, SM90, "bf16", 96, True, True, 4096, 4096, table=table)
    assert untuned.tuned == padded.tuned and untuned.options == padded.options, "the padded head dim's tiles"
    assert Variant.parse(str(split)) == split and split.key() != padded.key()
    odd = dispatch.kernel_variant(kernel, SM90, "fp16", 72, False, True, 128, 128)
    assert (odd.get("BLOCK_D"), odd.get("BLOCK_D2"), odd.get("EVEN_D")) == (64, 16, False)
    for d in (64, 128, 224):  # powers of two, and a dim no split shrinks
        assert "BLOCK_D2" not in str(dispatch.kernel_variant(kernel, SM90, "bf16", d, False, True, 4096, 4096))
    # v's head dim of its own: padding (BLOCK_DV), as the forward; split_d=True there says why.
    mla = dispatch.kernel_variant(kernel, SM90, "bf16", 96, False, True, 4096, 4096, head_dim_v=64)
    assert "BLOCK_D2" not in str(mla) and mla.get("BLOCK_DV") == 64
    with pytest.raises(ValueError, match="v's head dim equal to it"):
        dispatch.kernel_variant(kernel, SM90, "bf16", 96, False, True, 4096, 4096, head_dim_v=64, split_d=True)
    bad = Variant(split.kernel, split.target, split.dtype,
                  pairs({**dict(split.functional), "BLOCK_DV": 64, "EVEN_DV": True}), split.tuned, split.options)
    with pytest.raises(ValueError, match="split tiles"):
        check_fields(bad)


# The strings of main before split tiles reached the backward (padded variants): unchanged.
PADDED = {
    ("flash_bwd_dq", 96, True): "flash_bwd_dq:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=true,EVEN_D=false,"
                                "INDEX64=false,SEQ16=true:BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8",
    ("flash_bwd_dq", 128, False): "flash_bwd_dq:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
                                  "INDEX64=false,SEQ16=true:BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8",
    ("flash_bwd_dkdv", 96, True): "flash_bwd_dkdv:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=true,EVEN_D=false,"
                                  "INDEX64=false,SEQ16=true:BLOCK_M=64,BLOCK_N=64:num_stages=2,num_warps=4",
    ("flash_bwd_dkdv", 128, False): "flash_bwd_dkdv:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
                                    "INDEX64=false,SEQ16=true:BLOCK_M=64,BLOCK_N=128:num_stages=3,num_warps=8",
}


@pytest.mark.parametrize(("kernel", "head_dim", "causal"), sorted(PADDED))
def test_padded_backward_variants_keep_their_strings_and_key_encoding(kernel: str, head_dim: int,
                                                                      causal: bool) -> None:
    split_d = False if head_dim == 96 else None  # 128: dispatch's own choice pads
    variant = dispatch.kernel_variant(kernel, SM90, "bf16", head_dim, causal, True, 4096, 4096, split_d=split_d)
    before = Variant.parse(PADDED[kernel, head_dim, causal])
    assert str(variant) == PADDED[kernel, head_dim, causal] and variant == before
    # The key hashes these fields and the source fingerprint: for a fixed fingerprint, the same bytes.
    assert variant.canonical("f" * 16) == before.canonical("f" * 16)
    assert kernel_constexprs(variant, ("BLOCK_D2",)) == {"BLOCK_D2": 0}


def test_interpreter_constexprs_follow_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    for d, want in ((96, (64, True, 32)), (72, (64, False, 16)), (40, (32, False, 16)), (128, (128, True, 0))):
        got = bwd_binding.head_dim_constexprs(d)
        assert (got["BLOCK_D"], got["EVEN_D"], got["BLOCK_D2"]) == want, d
        variant = dispatch.kernel_variant(FLASH_BWD_DQ.name, SM90, "fp32", d, False, True, 64, 64)
        names = ("BLOCK_D", "EVEN_D", "BLOCK_DV", "EVEN_DV", "BLOCK_D2")
        assert kernel_constexprs(variant, names) == {n: got[n] for n in names}, d
    assert bwd_binding.head_dim_constexprs(96, 64)["BLOCK_D2"] == 0
    monkeypatch.setattr(attention, "SPLIT_BY_DEFAULT", False)
    assert bwd_binding.head_dim_constexprs(96) == {"BLOCK_D": 128, "EVEN_D": False, "BLOCK_DV": 128,
                                                   "EVEN_DV": False, "BLOCK_D2": 0}


def test_tune_bwd_keys_a_split_winner_by_its_own_head_dim_and_never_changes_the_padded_calls() -> None:
    """A split winner's tiles serve its head dim only: the padded tile's calls (hd128, and hd100, which pads to it)
    keep theirs, whatever order the head dims were tuned in (the split width's shared-memory budget is not theirs)."""
    sm86 = Target.parse("sm_86")
    for d, padded in ((96, 128), (40, 64), (192, 256)):
        variant = dispatch.kernel_variant(FLASH_BWD_DQ.name, SM90, "bf16", d, False, True, 4096, 4096)
        assert variant.get("BLOCK_D2")
        assert tune_bwd.row_for(variant, 4096, 4096, 100.0, "test", "2026-12-01", d).head_dim == d
        plain = dispatch.kernel_variant(FLASH_BWD_DQ.name, SM90, "bf16", padded, False, True, 4096, 4096)
        assert tune_bwd.row_for(plain, 4096, 4096, 100.0, "test", "2026-12-01", padded).head_dim == padded
    # A 96 winner that fits 96's split width on sm_86 (99 KiB) but would not fit hd128's tile there.
    split = dispatch.kernel_variant(FLASH_BWD_DQ.name, sm86, "bf16", 96, False, True, 4096, 4096,
                                    config=Config(128, 64, 8, 3))
    row = tune_bwd.row_for(split, 4096, 4096, 100.0, "test", "2026-12-01", 96)
    table = tuning.Table((row,))
    got = dispatch.kernel_variant(FLASH_BWD_DQ.name, sm86, "bf16", 96, False, True, 4096, 4096, table=table)
    assert (got.get("BLOCK_M"), got.get("BLOCK_N"), got.get("num_warps"), got.get("num_stages")) == (128, 64, 8, 3)
    for other in (128, 100):
        served = dispatch.kernel_variant(FLASH_BWD_DQ.name, sm86, "bf16", other, False, True, 4096, 4096,
                                         table=table)
        assert served == dispatch.kernel_variant(FLASH_BWD_DQ.name, sm86, "bf16", other, False, True, 4096, 4096,
                                                 table=tuning.Table(())), other


def test_prewarm_plans_the_split_backward_variants_calls_use() -> None:
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    axes = Axes((SM90,), BWD, dtypes=("bf16",), head_dims=(96, 128), causal=(True,), seqlens_q=(4096,),
                aligned=(True,))
    plan = {str(p.variant) for p in enumerate_variants(axes, tuning.Table(()))}
    calls = {str(dispatch.kernel_variant(kernel, SM90, "bf16", d, True, True, 4096, 4096, seq16=seq16,
                                         table=tuning.Table(())))
             for kernel in BWD for d in (96, 128) for seq16 in (True, False)}
    # A plain call from 2k keys is the fused backward's: prewarm plans its pair beside the two kernels (hd96's
    # fused kernel in its chunks too, its prep kernel 128's, as hd128's)
    calls |= {str(v) for d in (96, 128)
              for v in bwd_dispatch.flash_bwd_fused_default_variants(SM90, "bf16", d, True, True, False, 4096, 4096)
              or ()}
    # 2 kernels x SEQ16 or not, and the fused kernel
    assert plan == calls and sum("BLOCK_D=64,BLOCK_D2=32" in v for v in plan) == 5


# ---------------------------------------------------------------------------
# Numerics through the public entry points (Triton's interpreter)


def _fa2(causal: bool, **kwargs: Any) -> Callable[..., torch.Tensor]:
    """flash_attn_func on (B, H, S, D) tensors: FlashAttention-2's layout is (B, S, H, D)."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = [x.transpose(1, 2) for x in (q, k, v)]
        return lazytriton.flash_attn_func(*t, causal=causal, **kwargs).transpose(1, 2)
    return run


CASES = [(96, False, (2, 2), torch.float16), (96, True, (4, 1), torch.bfloat16), (72, True, (2, 2), torch.float16),
         (72, False, (2, 2), torch.float32), (40, True, (2, 2), torch.bfloat16), (40, False, (4, 2), torch.float16)]


@pytest.mark.parametrize(("head_dim", "causal", "heads", "dtype"), CASES, ids=str)
def test_flash_attn_func_gradients_follow_flashattentions_rule(head_dim: int, causal: bool, heads: tuple[int, int],
                                                               dtype: torch.dtype, interpreted: list[Any]) -> None:
    q, k, v = make_qkv(1, heads, (37, 45), head_dim, dtype, seed=head_dim + causal)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(head_dim)).to(dtype)
    got = grads_of(_fa2(causal), q, k, v, do)
    check_grads(q, k, v, do, got, causal="bottom_right" if causal else False)  # FlashAttention-2's causal
    assert _split_runs(interpreted) == {name: geometry.split_head_dim(head_dim)[1] for name in BWD}  # type: ignore


def test_attn_fwd_backward_top_left_with_more_queries_than_keys(interpreted: list[Any]) -> None:
    q, k, v = make_qkv(2, (2, 2), (41, 19), 96, torch.float16, seed=3)
    do = torch.randn(q.shape).half()
    got = grads_of(lambda *t: lazytriton.attn_fwd(*t, causal=True)[0], q, k, v, do)
    check_grads(q, k, v, do, got, causal="top_left")
    assert _split_runs(interpreted) == {name: 32 for name in BWD}


def _both(fn: Callable[[], tuple[torch.Tensor, ...]],
          monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``fn()`` with dispatch's split tiles, then padded (the GPU's memoised plans forgotten before each)."""
    runtime.get().plans.clear()
    split = fn()
    with monkeypatch.context() as m:
        m.setattr(attention, "SPLIT_BY_DEFAULT", False)
        runtime.get().plans.clear()
        padded = fn()
    runtime.get().plans.clear()
    return split, padded


def test_split_equals_padded_with_window_softcap_alibi_and_dropout(monkeypatch: pytest.MonkeyPatch,
                                                                   interpreted: list[Any]) -> None:
    q, k, v = make_qkv(1, (2, 2), (29, 41), 72, torch.float32, seed=7)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    slopes = torch.tensor([0.25, 0.5])

    def run() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1234)  # the same dropout mask in both runs
        return grads_of(_fa2(True, window_size=(9, 3), softcap=5.0, alibi_slopes=slopes, dropout_p=0.25), q, k, v,
                        do)

    split, padded = _both(run, monkeypatch)
    assert sorted({c["BLOCK_D2"] for name, c in interpreted if name in BWD}) == [0, 16]
    for a, b in zip(split, padded, strict=True):
        assert torch.isfinite(a).all() and float((a - b).abs().max()) < 1e-5


def test_split_equals_padded_in_the_varlen_backward(monkeypatch: pytest.MonkeyPatch, interpreted: list[Any]) -> None:
    gen = torch.Generator().manual_seed(9)
    lens_q, lens_k = [5, 0, 23], [17, 4, 30]
    q, k, v = (torch.randn(sum(lens), heads, 96, generator=gen)
               for lens, heads in ((lens_q, 4), (lens_k, 2), (lens_k, 2)))
    do = torch.randn(q.shape, generator=gen)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                  for lens in (lens_q, lens_k))

    def run() -> tuple[torch.Tensor, ...]:
        return grads_of(lambda *t: lazytriton.flash_attn_varlen_func(*t, cu_q, cu_k, max(lens_q), max(lens_k),
                                                                       causal=True), q, k, v, do)

    split, padded = _both(run, monkeypatch)
    assert sorted({c["BLOCK_D2"] for name, c in interpreted if name in BWD}) == [0, 32]
    for a, b in zip(split, padded, strict=True):
        assert torch.isfinite(a).all() and float((a - b).abs().max()) < 1e-5


# ---------------------------------------------------------------------------
# Compiled for sm_90 (no GPU needed)


@pytest.mark.parametrize(("head_dim", "dtype", "flags"), [(96, "bf16", {}), (72, "fp16", {"window": True}),
                                                          (40, "fp32", {"varlen": True})])
def test_split_backward_variants_compile_for_sm_90(head_dim: int, dtype: str, flags: dict[str, bool]) -> None:
    pytest.importorskip("triton")
    for kernel in BWD:
        variant = dispatch.kernel_variant(kernel, SM90, dtype, head_dim, True, True, 4096, 4096, **flags)
        assert variant.get("BLOCK_D2")
        entry = compiler.compile_variant(variant)
        assert entry.kind == "cubin" and entry.binary and entry.arg_types[0] == f"*{dtype}"


# ---------------------------------------------------------------------------
# On the GPU


@on_gpu
@pytest.mark.parametrize(("heads", "seqlens", "dtype", "causal"), [
    ((16, 16), (4096, 4096), torch.bfloat16, False),
    ((16, 2), (1000, 4099), torch.float16, True),
    ((6, 3), (777, 333), torch.float32, True),
])
@pytest.mark.parametrize("head_dim", [40, 72, 96, 160, 192])
def test_gpu_split_gradients(heads: tuple[int, int], seqlens: tuple[int, int], dtype: torch.dtype, causal: bool,
                             head_dim: int) -> None:
    q, k, v = make_qkv(1, heads, seqlens, head_dim, dtype, device="cuda", seed=head_dim)
    do = torch.randn(q.shape, device="cuda").to(dtype)
    check_grads(q, k, v, do, grads_of(_fa2(causal), q, k, v, do), causal="bottom_right" if causal else False)
    call = binding.check(q, k, v, "bottom_right" if causal else False)
    for variant in bwd_binding.variants(machine.target_of_device(q.device), dtype, call.shape, causal, True, False):
        assert variant.get("BLOCK_D2") == geometry.split_head_dim(head_dim)[1]  # type: ignore[index]


@on_gpu
def test_gpu_split_equals_padded_within_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = make_qkv(2, (8, 2), (1024, 1024), 96, torch.float32, device="cuda", seed=96)
    do = torch.randn(q.shape, device="cuda")
    split, padded = _both(lambda: grads_of(_fa2(True), q, k, v, do), monkeypatch)
    for a, b in zip(split, padded, strict=True):
        assert float((a - b).abs().max()) < 1e-4 * max(1.0, float(b.abs().max()))
