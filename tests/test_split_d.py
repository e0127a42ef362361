"""Split tiles for head dims that are not powers of two (issue 11, item 4), in flash_fwd (backward: test_bwd_split).

A head dim like 96 runs as two power-of-two chunks (64 + 32) instead of one
padded 128-wide tile: ``BLOCK_D2`` > 0 selects it, off by default in dispatch
until benchmarks/bench_split_d.py measures it against padding on the H200.
Numerics under Triton's interpreter against a float64 reference with
FlashAttention's rule (tests/test_flash_fwd.py's), and compiled for sm_90 here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import sass_of
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR

from lazytriton import compiler, geometry
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding, score_mods
from lazytriton.kernels.flash_fwd.reference import attention_reference
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields, kernel_constexprs, pairs

SM90 = Target.parse("sm_90")


def test_chunks_of_each_head_dim() -> None:
    want = {40: (32, 16), 72: (64, 16), 80: (64, 16), 96: (64, 32), 160: (128, 32), 192: (128, 64)}
    for d, chunks in want.items():
        assert geometry.split_head_dim(d) == chunks, d
    for d in (16, 24, 32, 64, 100, 128, 224, 256):  # powers of two, and dims a split does not shrink
        assert geometry.split_head_dim(d) is None, d


def test_split_tiles_are_the_default_padding_on_request_and_split_variants_say_so() -> None:
    padded = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 96, False, True, 4096, 4096, split_d=False)
    assert "BLOCK_D2" not in str(padded) and padded.get("BLOCK_D") == 128
    split = check_fields(dispatch.kernel_variant("flash_fwd", SM90, "bf16", 96, False, True, 4096, 4096,
                                                 split_d=True))
    assert dispatch.kernel_variant("flash_fwd", SM90, "bf16", 96, False, True, 4096, 4096) == split  # measured
    assert (split.get("BLOCK_D"), split.get("BLOCK_D2"), split.get("EVEN_D")) == (64, 32, True)
    assert Variant.parse(str(split)) == split and split.key() != padded.key() and split.tuned == padded.tuned
    assert kernel_constexprs(padded, ("BLOCK_D2",)) == {"BLOCK_D2": 0}
    for extra in ({"TMA": True}, {"BLOCK_DV": 32, "EVEN_DV": True}):  # the kernel would read the first chunk only
        bad = Variant(split.kernel, split.target, split.dtype, pairs({**dict(split.functional), **extra}),
                      split.tuned, split.options)
        with pytest.raises(ValueError, match="split tiles"):
            check_fields(bad)
    odd = dispatch.kernel_variant("flash_fwd", SM90, "fp16", 72, True, True, 128, 128, split_d=True)
    assert (odd.get("BLOCK_D"), odd.get("BLOCK_D2"), odd.get("EVEN_D")) == (64, 16, False)
    # split_d=None (dispatch's choice) never splits where it cannot; True there says why.
    # The backward kernels split too (tests/test_bwd_split.py).
    for kernel, d, extra in (("flash_fwd", 128, {}), ("flash_bwd_dq", 128, {}), ("flash_fwd", 96, {"head_dim_v": 64}),
                             ("flash_bwd_dkdv", 96, {"head_dim_v": 64}), ("flash_fwd", 96, {"tma": True})):
        with pytest.raises(ValueError, match="split_d=True needs flash_fwd"):
            dispatch.kernel_variant(kernel, SM90, "fp16", d, False, True, 128, 128, split_d=True, **extra)
        if "tma" not in extra:  # tma=None: dispatch may split 96 (no TMA for an odd tile), so only these
            assert "BLOCK_D2" not in str(dispatch.kernel_variant(kernel, SM90, "fp16", d, False, True, 128, 128,
                                                                 **extra))


CASES = [(96, False, torch.float16), (72, "bottom_right", torch.float16), (40, True, torch.bfloat16),
         (192, False, torch.float16), (160, "top_left", torch.float32), (80, False, torch.bfloat16)]


def run_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: binding.Call) -> tuple[torch.Tensor, ...]:
    """The split variant dispatch gives with split_d=True, through the interpreter (small tiles)."""
    shape = call.shape
    variant = dispatch.kernel_variant("flash_fwd", SM90, binding.DTYPES[q.dtype], shape.head_dim,
                                      call.causal != "none", True, shape.seqlen_q, shape.seqlen_k,
                                      window=call.windowed, softcap=call.capped, alibi=call.mods[0],
                                      bias=call.mods[1], dropout=call.mods[2], split_d=True)
    constexprs = {**kernel_constexprs(variant, FLASH_FWD.constexprs), "BLOCK_M": 32, "BLOCK_N": 16}
    assert constexprs["BLOCK_D2"] > 0
    out, lse = binding.empty_outputs(q, shape)
    out.fill_(float("nan"))
    compiler.interpret(FLASH_FWD.name, binding.grid(shape, 32), binding.triton_args(q, k, v, out, lse, call),
                       constexprs)
    return out, lse


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("head_dim, causal, dtype", CASES, ids=str)
def test_split_tiles_follow_flashattentions_rule(head_dim: int, causal: bool | str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in
               ((2, 4, 37, head_dim), (2, 2, 45, head_dim), (2, 2, 45, head_dim)))
    out, lse = run_split(q, k, v, binding.check(q, k, v, causal))
    exact_out, exact_lse = attention_reference(q.double(), k.double(), v.double(), causal=causal)
    same_out, same_lse = attention_reference(q, k, v, causal=causal)
    assert torch.isfinite(out).all(), "an element of out left unwritten"
    floor = OUT_FLOOR[dtype] * max(1.0, float(exact_out.abs().max()))
    assert max_err(out, exact_out) <= 2 * max_err(same_out, exact_out) + floor
    assert max_err(lse, exact_lse) <= 2 * max_err(same_lse, exact_lse) + LSE_FLOOR * float(exact_lse.abs().max())


def test_split_tiles_with_window_softcap_alibi_and_dropout_equal_the_padded_kernel() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(shape, generator=gen).to(torch.float32) for shape in
               ((1, 2, 29, 96), (1, 2, 41, 96), (1, 2, 41, 96)))
    call = binding.check(q, k, v, False, window=(9, 3), softcap=5.0)
    slopes = torch.tensor([0.25, 0.5])
    call = score_mods.with_mods(call, q, slopes, None, 0.25, torch.tensor([1234, 5], dtype=torch.int64))
    out, lse = run_split(q, k, v, call)
    padded_out, padded_lse = binding.empty_outputs(q, call.shape)
    binding.run_interpreter(q, k, v, padded_out, padded_lse, call)
    assert max_err(out, padded_out) < 1e-5 and max_err(lse, padded_lse) < 1e-5


@pytest.mark.parametrize("head_dim", [72, 96, 192])
def test_split_variants_compile_for_sm_90(head_dim: int) -> None:
    pytest.importorskip("triton")
    variant = dispatch.kernel_variant("flash_fwd", SM90, "bf16", head_dim, True, True, 4096, 4096, split_d=True)
    entry = compiler.compile_variant(variant)
    assert entry.kind == "cubin" and entry.binary and entry.arg_types[:5] == ("*bf16",) * 4 + ("*fp32",)


@pytest.mark.parametrize("kernel", ["flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"])
@pytest.mark.parametrize("head_dim", [96, 160])
def test_split_kernels_move_rows_16_bytes_a_thread_where_the_chunks_hold_the_head_dim(
        kernel: str, head_dim: int, tmp_path: Path) -> None:
    """EVEN_D (the chunks sum to the head dim): no access masked by column, so none is split into 2-byte ones.

    Masked at head_dim, flash_fwd's loads of Q's second chunk and stores of Out's compile to 32 LDG.E.U16 and
    32 STG.E.U16 a thread at 96 (SASS of the served entry, 2026-12-02).
    """
    variant = dispatch.kernel_variant(kernel, SM90, "bf16", head_dim, True, True, 1024, 1024)
    assert variant.get("BLOCK_D2") and variant.get("EVEN_D") is True, variant
    sass = sass_of(compiler.compile_variant(variant).binary, tmp_path)
    sizes = {size for _, size in re.findall(r"\b(LDG|STG)\.E(\.[A-Z0-9]+)?", sass)}
    assert ".128" in sizes and not sizes & {".U16", ".16", ".S16"}, sorted(sizes)
