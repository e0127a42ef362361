"""Dispatch's pure functions, called with made-up inputs (no GPU, no compiler)."""

from __future__ import annotations

import itertools

import pytest

from lazytriton import geometry, tuning
from lazytriton.geometry import causal_mode, padded_head_dim
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd.dispatch import default_config, flash_fwd_variant
from lazytriton.target import Target
from lazytriton.tiles import Config, seqlen_class
from lazytriton.variant import Variant, check_fields

TARGETS = ("sm_90", "sm_80", "gfx942", "gfx950")
DTYPES = ("fp16", "bf16", "fp32")
SEQLENS = (1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096, 2**31 - 1)


def test_padded_head_dim_every_size() -> None:
    for head_dim in range(1, 257):
        padded = padded_head_dim(head_dim)
        assert padded in geometry.HEAD_DIMS
        assert padded >= head_dim
        assert padded & (padded - 1) == 0, "tl.arange needs a power of two"
        smaller = [size for size in geometry.HEAD_DIMS if size < padded]
        assert not smaller or smaller[-1] < head_dim, f"{head_dim} is not padded to the smallest size"
    assert [padded_head_dim(d) for d in (1, 16, 17, 32, 33, 64, 65, 80, 96, 128, 129, 256)] == [
        16, 16, 32, 32, 64, 64, 128, 128, 128, 128, 256, 256]


@pytest.mark.parametrize("head_dim", [257, 512, 10**6])
def test_padded_head_dim_too_large(head_dim: int) -> None:
    with pytest.raises(ValueError, match=str(head_dim)):
        padded_head_dim(head_dim)


@pytest.mark.parametrize(("causal", "mode"), [
    (False, "none"), (None, "none"), (True, "top_left"),
    ("none", "none"), ("top_left", "top_left"), ("bottom_right", "bottom_right"),
])
def test_causal_mode(causal: object, mode: str) -> None:
    assert causal_mode(causal) == mode


@pytest.mark.parametrize("causal", [1, 0, "", "causal", "TOP_LEFT", "bottom-right", "true", 1.0, [True]])
def test_causal_mode_rejects(causal: object) -> None:
    with pytest.raises(ValueError, match="causal"):
        causal_mode(causal)


def test_seqlen_class() -> None:
    expected = {1: 16, 15: 16, 16: 16, 17: 64, 63: 64, 64: 64, 65: 128, 128: 128, 129: 128, 2**31 - 1: 128}
    assert {s: seqlen_class(s) for s in expected} == expected
    # Monotone: more rows never pick a smaller block.
    classes = [seqlen_class(s) for s in range(1, 300)]
    assert classes == sorted(classes)


def _check_sane(target: Target, dtype: str, head_dim: int, seqlen_q: int, cfg: Config) -> None:
    where = f"{target} {dtype} d={head_dim} sq={seqlen_q}: {cfg}"
    for name in ("block_m", "block_n"):
        value = getattr(cfg, name)
        assert value >= 16 and value & (value - 1) == 0, f"{name} must be a power of two >= 16 (tl.dot): {where}"
    assert cfg.block_m <= seqlen_class(seqlen_q), f"BLOCK_M above the seqlen class: {where}"
    assert cfg.num_warps in (1, 2, 4, 8), where
    assert cfg.num_stages >= 1, where
    if target.backend == "hip":
        assert cfg.waves_per_eu >= 0, where
        assert set(cfg.options(target)) == {"num_warps", "num_stages", "waves_per_eu"}
    else:
        assert set(cfg.options(target)) == {"num_warps", "num_stages"}
    assert cfg.tuned() == {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}


def test_default_config_never_errors() -> None:
    for name, dtype, head_dim, seqlen_q, causal in itertools.product(
            TARGETS, DTYPES, geometry.HEAD_DIMS, SEQLENS, (False, True)):
        target = Target.parse(name)
        _check_sane(target, dtype, head_dim, seqlen_q, default_config(target, dtype, head_dim, seqlen_q, causal))


def test_default_config_other_targets() -> None:
    # A target nobody tuned for still gets a config, never an error.
    for name in ("sm_75", "sm_86", "sm_100", "sm_120", "gfx90a", "gfx1100"):
        target = Target.parse(name)
        for dtype, head_dim, seqlen_q, causal in itertools.product(
                DTYPES, geometry.HEAD_DIMS, (1, 64, 4096), (False, True)):
            _check_sane(target, dtype, head_dim, seqlen_q, default_config(target, dtype, head_dim, seqlen_q, causal))


def test_default_config_is_pure() -> None:
    target = Target.parse("sm_90")
    assert default_config(target, "bf16", 128, 4096, True) == default_config(target, "bf16", 128, 4096, True)
    assert default_config(target, "bf16", 128, 4096) == default_config(target, "bf16", 128, 4096, False)


def test_default_config_fits_sm80_shared_memory_at_head_dim_128() -> None:
    # 128/128 x 3 stages is sm_90's pick but does not fit sm_80's 163 KiB (see default_config).
    for causal in (False, True):
        cfg = default_config(Target.parse("sm_80"), "bf16", 128, 4096, causal)
        assert cfg.block_n <= 64, cfg


@pytest.mark.parametrize("target_name", TARGETS)
def test_flash_fwd_variant_fields(target_name: str) -> None:
    target = Target.parse(target_name)
    for dtype, head_dim, causal, aligned, seqlen_q, index64 in itertools.product(
            DTYPES, (1, 16, 40, 64, 96, 128, 200, 256), (False, True), (False, True), (1, 64, 4096), (False, True)):
        # An empty table: this checks the default path (test_tuning.py covers table rows).
        v = flash_fwd_variant(target, dtype, head_dim, causal, aligned, seqlen_q, index64=index64,
                              table=tuning.Table(()), split_d=False)  # padding (tests/test_split_d.py: split)
        padded = padded_head_dim(head_dim)
        cfg = default_config(target, dtype, padded, seqlen_q, causal)
        assert (v.kernel, v.target, v.dtype) == ("flash_fwd", target_name, dtype)
        assert dict(v.functional) == {"ALIGN16": aligned, "BLOCK_D": padded, "CAUSAL": causal,
                                      "EVEN_D": head_dim == padded, "INDEX64": index64,
                                      **({"TMA": True} if fwd_dispatch.flash_fwd_tma(target, dtype, aligned) else {})}
        assert all(type(value) is bool for name, value in v.functional if name != "BLOCK_D")
        assert dict(v.tuned) == {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}
        assert dict(v.options) == cfg.options(target)
        assert Variant.parse(str(v)) == v


def test_flash_fwd_variant_takes_a_config() -> None:
    target = Target.parse("gfx942")
    v = flash_fwd_variant(target, "fp16", 64, True, True, 4096, config=Config(32, 16, 2, 1, waves_per_eu=3))
    assert dict(v.tuned) == {"BLOCK_M": 32, "BLOCK_N": 16}
    assert dict(v.options) == {"num_warps": 2, "num_stages": 1, "waves_per_eu": 3}
    v = flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, True, True, 4096, config=Config(32, 16, 2, 1, 3))
    assert dict(v.options) == {"num_warps": 2, "num_stages": 1}, "waves_per_eu is a HIP option only"


def test_flash_fwd_variant_normalises_truthy_flags() -> None:
    v = flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, 1, 0, 64, index64=1)  # type: ignore[arg-type]
    assert v == flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, True, False, 64, index64=True)
    assert v.key() != flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, True, False, 64).key()


def test_flash_fwd_variant_rejects_head_dim() -> None:
    with pytest.raises(ValueError, match="257"):
        flash_fwd_variant(Target.parse("sm_90"), "fp16", 257, False, True, 64)


# --- TMA: a pure decision from (target, dtype, alignment) ------------------------------------------------------


@pytest.mark.parametrize("by_default", [False, True])
def test_flash_fwd_tma_rule(by_default: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fwd_dispatch, "TMA_BY_DEFAULT", by_default)
    for target_name, dtype, aligned in itertools.product(TARGETS + ("sm_100", "sm_86"), DTYPES, (False, True)):
        expected = by_default and target_name == "sm_90" and dtype in ("fp16", "bf16") and aligned
        assert fwd_dispatch.flash_fwd_tma(Target.parse(target_name), dtype, aligned) is expected, (target_name, dtype)
        v = flash_fwd_variant(Target.parse(target_name), dtype, 128, False, aligned, 4096)
        assert dict(v.functional).get("TMA", False) is expected


def test_tma_needs_a_head_dim_that_fills_its_tile() -> None:
    # Measured on the H200 (Triton 3.6): a descriptor store with head dim 59 in a 64-wide tile wrote past head dim.
    sm90 = Target.parse("sm_90")
    assert fwd_dispatch.flash_fwd_tma(sm90, "fp16", True, True, even_d=True) is True
    with pytest.raises(ValueError, match="power-of-two head dim"):
        fwd_dispatch.flash_fwd_tma(sm90, "fp16", True, True, even_d=False)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        flash_fwd_variant(sm90, "fp16", 59, False, True, 4096, tma=True)
    assert "TMA" in dict(flash_fwd_variant(sm90, "fp16", 64, False, True, 4096, tma=True).functional)
    v = flash_fwd_variant(sm90, "fp16", 64, False, True, 4096, tma=True)
    uneven = Variant(v.kernel, v.target, v.dtype, tuple((k, False if k == "EVEN_D" else x) for k, x in v.functional),
                     v.tuned, v.options)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        check_fields(uneven)


def test_flash_fwd_tma_default_is_off_until_measured() -> None:
    # TMA_BY_DEFAULT stays off until experiments/probe_tma.py measures a gain on the H200: no call changes kernel.
    assert fwd_dispatch.TMA_BY_DEFAULT is False
    assert "TMA" not in dict(flash_fwd_variant(Target.parse("sm_90"), "bf16", 128, True, True, 4096).functional)


def test_flash_fwd_tma_opt_in_and_out() -> None:
    sm90 = Target.parse("sm_90")
    on = flash_fwd_variant(sm90, "bf16", 128, True, True, 4096, tma=True)
    off = flash_fwd_variant(sm90, "bf16", 128, True, True, 4096, tma=False)
    assert on.get("TMA") is True and on.key() != off.key()
    # Absent means false: a pointer variant's string is the one it had before TMA existed.
    assert "TMA" not in dict(off.functional) and off == flash_fwd_variant(sm90, "bf16", 128, True, True, 4096)
    assert {n: v for n, v in on.functional if n != "TMA"} == dict(off.functional)
    assert (on.tuned, on.options) == (off.tuned, off.options), "TMA changes the kernel, not its config"
    assert flash_fwd_variant(sm90, "fp32", 64, False, True, 64, tma=True).get("TMA") is True  # allowed, not chosen
    assert Variant.parse(str(on)) == on


@pytest.mark.parametrize(("target_name", "aligned"), [("sm_90", False), ("sm_80", True), ("gfx942", True)])
def test_flash_fwd_tma_refused_where_descriptors_cannot_work(target_name: str, aligned: bool) -> None:
    with pytest.raises(ValueError, match=f"tma=True needs .*got target {target_name}, aligned={aligned}"):
        flash_fwd_variant(Target.parse(target_name), "fp16", 64, False, aligned, 4096, tma=True)
    assert "TMA" not in dict(flash_fwd_variant(Target.parse(target_name), "fp16", 64, False, aligned, 4096,
                                               tma=False).functional)


def test_backward_kernels_have_no_tma_field() -> None:
    for kernel in bwd_dispatch.BWD_KERNELS:
        v = dispatch.kernel_variant(kernel, Target.parse("sm_90"), "bf16", 128, True, True, 4096, 4096)
        assert "TMA" not in dict(v.functional)


def test_flash_fwd_tma_follows_only_what_the_hot_memo_key_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    # The hot path memoises on (device, dtype, head dim, causal, aligned, index64, seqlen buckets): TMA must be
    # a function of those (the device gives the target), never of anything a warm call does not look at.
    monkeypatch.setattr(fwd_dispatch, "TMA_BY_DEFAULT", True)
    sm90 = Target.parse("sm_90")
    for dtype, aligned, head_dim in itertools.product(DTYPES, (False, True), (16, 59, 128, 256)):
        seen = {dict(flash_fwd_variant(sm90, dtype, head_dim, causal, aligned, seqlen, index64=index64,
                                       seqlen_k=seqlen_k).functional).get("TMA", False)
                for causal, seqlen, seqlen_k, index64 in itertools.product(
                    (False, True), (1, 100, 4096), (1, 5000), (False, True))}
        assert seen == {fwd_dispatch.flash_fwd_tma(sm90, dtype, aligned, even_d=head_dim == padded_head_dim(head_dim))}


def test_check_fields_takes_tma_and_its_absence() -> None:
    from lazytriton.variant import check_fields, kernel_constexprs

    sm90 = Target.parse("sm_90")
    on = flash_fwd_variant(sm90, "bf16", 128, True, True, 4096, tma=True)
    assert check_fields(on) is on
    # A variant string written before TMA existed still passes and means the pointer kernel.
    old = Variant.parse(str(on).replace(",TMA=true", ""))
    assert "TMA" not in dict(old.functional) and check_fields(old) is old
    assert kernel_constexprs(old, ("BLOCK_M", "TMA")) == {"BLOCK_M": on.get("BLOCK_M"), "TMA": False}
    assert kernel_constexprs(on, ("TMA",)) == {"TMA": True}
    with pytest.raises(ValueError, match="TMA=1 must be true or false"):
        check_fields(Variant.parse(str(on).replace("TMA=true", "TMA=1")))
    with pytest.raises(KeyError):
        kernel_constexprs(old, ("BLOCK_Q",))


@pytest.mark.parametrize(("old", "new"), [("ALIGN16=true", "ALIGN16=false"), (":sm_90:", ":sm_80:"),
                                          ("ALIGN16=true,", "")])
def test_check_fields_refuses_tma_where_descriptors_cannot_work(old: str, new: str) -> None:
    from lazytriton.variant import check_fields

    on = flash_fwd_variant(Target.parse("sm_90"), "bf16", 128, True, True, 4096, tma=True)
    bad = Variant.parse(str(on).replace(old, new))
    with pytest.raises(ValueError, match=r"variant flash_fwd:.*: tma=True needs a CUDA target with TMA"):
        check_fields(bad)
