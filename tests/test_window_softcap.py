"""Sliding-window attention and logit softcapping, forward and backward (issue 11, part 3).

Numerics follow FlashAttention's rule (as tests/test_flash_fwd.py and
tests/test_flash_bwd.py do): each of out, lse, dq, dk, dv may be at most twice
as far from a float64 reference as the same-dtype PyTorch reference is, plus
a small floor. The reference (``attention_reference``) applies
FlashAttention-2's window rule (its tests' ``construct_local_mask``) and its
softcap (``attention_ref``: cap the scaled scores). On CPU the kernels run
through Triton's interpreter, over a covering design: every window size meets
every causal mode and both softcap settings; dtypes, GQA ratios and
unequal/odd seqlens rotate around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from flash_rule import check_rule
from test_flash_bwd import GRAD_FLOOR, grads_of
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, make_qkv, seed_of, twin_line

import lazytriton
from lazytriton.interface import always_through_op
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_bwd.reference import attention_backward_reference
from lazytriton.kernels.flash_fwd import binding, hot
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd.reference import attention_reference, visible
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

# (0, 0): each query sees one key; (-1, 0): causal by another name; (3, -1): unbounded right;
# (17, 0), (1, 40): wider than the interpreter's 16-key blocks, so unmasked blocks run too.
WINDOWS = ((0, 0), (-1, 0), (3, -1), (2, 1), (5, 3), (0, 4), (17, 0), (1, 40))
CAUSAL_MODES: tuple[bool | str, ...] = (False, "bottom_right", "top_left")
SOFTCAPS = (0.0, 1.5)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEADS = ((1, 1), (4, 2), (4, 1), (2, 2))
# Unequal, odd and equal seqlens; more queries than keys leaves bottom-right rows without keys.
SEQLENS = ((37, 45), (45, 37), (40, 40), (1, 33), (70, 20), (16, 80), (33, 1))
HEAD_DIMS = (32, 16, 40)


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    window: tuple[int, int]
    causal: bool | str
    softcap: float
    heads: tuple[int, int]
    seqlens: tuple[int, int]
    head_dim: int

    def __str__(self) -> str:
        (hq, hk), (sq, sk) = self.heads, self.seqlens
        return (f"{binding.DTYPES[self.dtype]}-w{self.window[0]}_{self.window[1]}-causal_{self.causal}"
                f"-cap{self.softcap}-h{hq}x{hk}-s{sq}x{sk}-d{self.head_dim}")


def covering_design() -> list[Case]:
    """24 cases: every (window, causal mode) pair once, the other factors rotated around them.

    With w the window index (8) and c the causal index (3): softcap (w + c) % 2
    meets both settings for every window and every causal mode; dtype
    (w + c) % 3 meets every dtype for every window; seqlens (3w + c) % 7 and
    heads (w + 2c) % 4 vary with both.
    """
    return [Case(DTYPES[(w + c) % 3], window, causal, SOFTCAPS[(w + c) % 2], HEADS[(w + 2 * c) % 4],
                 SEQLENS[(3 * w + c) % 7], HEAD_DIMS[(w + c) % 3])
            for w, window in enumerate(WINDOWS) for c, causal in enumerate(CAUSAL_MODES)]


def test_covering_design_covers_the_pairs() -> None:
    cases = covering_design()
    assert {(c.window, c.causal) for c in cases} == {(w, m) for w in WINDOWS for m in CAUSAL_MODES}
    for window in WINDOWS:
        assert {c.softcap for c in cases if c.window == window} == set(SOFTCAPS)
        assert {c.dtype for c in cases if c.window == window} == set(DTYPES)
    assert any(c.heads[0] != c.heads[1] for c in cases) and {c.seqlens for c in cases} == set(SEQLENS)
    assert any(_no_key_rows(c).any() for c in cases), "some case must leave rows that see no key"


def _no_key_rows(case: Case) -> torch.Tensor:
    keep = visible(*case.seqlens, case.causal, case.window)
    return torch.zeros(case.seqlens[0], dtype=torch.bool) if keep is None else ~keep.any(-1)


@pytest.mark.parametrize("case", covering_design(), ids=str)
def test_forward_and_backward_follow_flash_attentions_rule(case: Case) -> None:
    q, k, v = make_qkv(1, case.heads, case.seqlens, case.head_dim, case.dtype, seed=seed_of(case))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed_of(case, "do"))).to(case.dtype)
    kwargs: dict[str, Any] = {"causal": case.causal, "window_size": case.window, "softcap": case.softcap}

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lazytriton.attn_fwd(*leaves, **kwargs)
    got = torch.autograd.grad(out, leaves, do)

    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), **kwargs)
    same_out, same_lse = attention_reference(q, k, v, **kwargs)
    no_key = _no_key_rows(case)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse is -inf exactly where a row sees no key"
    assert torch.equal(torch.isneginf(ref_lse[0, 0]), no_key)
    assert (out[:, :, no_key] == 0).all() and (got[0][:, :, no_key] == 0).all(), "rows without keys: 0 and dq 0"
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in got)
    check_rule("out", out, ref_out, same_out, OUT_FLOOR[case.dtype])
    seen = ~torch.isneginf(ref_lse)
    check_rule("lse", lse[seen], ref_lse[seen], same_lse[seen], LSE_FLOOR)

    def ref(*t: torch.Tensor) -> torch.Tensor:
        return attention_reference(*t, **kwargs)[0]

    exact = grads_of(ref, q.double(), k.double(), v.double(), do.double())
    same = grads_of(ref, q, k, v, do)
    for name, g, e, s in zip(("dq", "dk", "dv"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[case.dtype])


@pytest.mark.parametrize(("window", "softcap", "causal"), [((2, 1), 0.0, False), ((-1, -1), 2.0, False),
                                                            ((3, -1), 1.5, "bottom_right"), ((0, 2), 0.5, False)])
def test_backward_reference_twin_is_the_gradient_of_the_forward_reference(window: tuple[int, int], softcap: float,
                                                                         causal: bool | str) -> None:
    q, k, v = make_qkv(1, (4, 2), (9, 13), 8, torch.float64, seed=seed_of(window, softcap))
    do = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    kwargs: dict[str, Any] = {"causal": causal, "window_size": window, "softcap": softcap}
    auto = grads_of(lambda *t: attention_reference(*t, **kwargs)[0], q, k, v, do)
    twin = attention_backward_reference(q, k, v, do, **kwargs)
    for name, a, t in zip(("dq", "dk", "dv"), auto, twin, strict=True):
        torch.testing.assert_close(t, a, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize(("window", "softcap"), [((2, 1), 0.0), ((-1, -1), 1.5), ((1, 3), 0.8)])
def test_gradcheck_float32(window: tuple[int, int], softcap: float) -> None:
    """Finite differences in float32 (tolerances at float32's resolution, steps of 1e-2)."""
    q, k, v = make_qkv(1, (2, 1), (5, 7), 16, torch.float32, seed=seed_of("gradcheck", window, softcap))
    leaves = tuple(t.requires_grad_() for t in (q, k, v))

    def fn(*t: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(*(x.transpose(1, 2) for x in t), window_size=window, softcap=softcap)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-2, atol=5e-3, rtol=5e-3, fast_mode=True)


def test_flash_attn_func_is_bottom_right_and_causal_sets_the_right_side_to_zero() -> None:
    q, k, v = make_qkv(2, (4, 2), (20, 35), 32, torch.float32, seed=11)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = lazytriton.flash_attn_func(qt, kt, vt, causal=True, window_size=(4, 7), softcap=3.0)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), causal="bottom_right", window_size=(4, 0),
                                 softcap=3.0)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=1e-5, rtol=0)
    plain = lazytriton.flash_attn_func(qt, kt, vt, window_size=(4, 7))
    ref, _ = attention_reference(q.double(), k.double(), v.double(), window_size=(4, 7))
    torch.testing.assert_close(plain.transpose(1, 2).double(), ref, atol=1e-5, rtol=0)


def test_key_blocks_outside_every_window_are_never_read() -> None:
    """NaN in keys/values no query sees, and in queries/gradients that see no key, must not reach any result.

    A block that was read would spread NaN: 0 x NaN is NaN in P V, P^T dO
    and dS Q, so finite results show the loop bounds skip those blocks
    (interpreter tiles: 32 query rows x 16 keys forward, 16 x 16 backward).
    """
    # One query block of 16 rows, bottom-right with window (4, 0): rows see keys 108..127 of 128.
    q, k, v = make_qkv(1, (2, 1), (16, 128), 16, torch.float32, seed=3)
    k[:, :, :96], v[:, :, :96] = float("nan"), float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = lazytriton.attn_fwd(*leaves, window_size=(4, 0))
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.ones_like(out))
    clean = [t.nan_to_num(0.0) for t in (q, k, v)]
    ref, _ = attention_reference(*clean, window_size=(4, 0))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.isfinite(dq).all() and (dk[:, :, :96] == 0).all() and (dv[:, :, :96] == 0).all()
    # 128 queries and 16 keys: queries 0..111 see no key; their rows of q and dO are NaN.
    q, k, v = make_qkv(1, (2, 1), (128, 16), 16, torch.float32, seed=4)
    q[:, :, :112] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lazytriton.attn_fwd(*leaves, window_size=(4, 0))
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    do[:, :, :112] = float("nan")
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    assert (out[:, :, :112] == 0).all() and torch.isneginf(lse[:, :, :112]).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all() and (dq[:, :, :112] == 0).all()
    # Right edges: 96 queries and keys, window (0, 2): the first query block (rows 0..31) sees keys 0..33,
    # so NaN in keys 48.. must not reach its rows of out and dq.
    q, k, v = make_qkv(1, (1, 1), (96, 96), 16, torch.float32, seed=5)
    k[:, :, 48:], v[:, :, 48:] = float("nan"), float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = lazytriton.attn_fwd(*leaves, window_size=(0, 2))
    (dq,) = torch.autograd.grad(out[:, :, :32].sum(), leaves[:1])
    ref, _ = attention_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), window_size=(0, 2))
    torch.testing.assert_close(out[:, :, :32], ref[:, :, :32], atol=1e-5, rtol=0)
    assert torch.isfinite(dq[:, :, :32]).all()


# ---------------------------------------------------------------------------
# Arguments, variants, memo keys, the op


FA_BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"window_size": (-2, 0)}, ValueError, r"window_size.*-1 \(unbounded\) or >= 0.*\(-2, 0\)"),
    ({"window_size": (0, -5)}, ValueError, r"window_size.*\(0, -5\)"),
    ({"window_size": (1.0, 2)}, TypeError, r"window_size must be a pair of ints"),
    ({"window_size": (True, 2)}, TypeError, r"window_size must be a pair of ints"),
    ({"window_size": (1, 2, 3)}, TypeError, r"window_size must be a pair of ints"),
    ({"window_size": "4"}, TypeError, r"window_size must be a pair of ints"),
    ({"softcap": -1.0}, ValueError, r"softcap must be a finite float >= 0.*-1\.0"),
    ({"softcap": float("inf")}, ValueError, r"softcap must be a finite float"),
    ({"softcap": "1"}, TypeError, r"softcap must be a float, got str"),
    ({"softcap": True}, TypeError, r"softcap must be a float, got bool"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), FA_BAD, ids=lambda x: repr(x)[:30])
def test_bad_window_or_softcap_raises_before_anything_runs(kwargs: dict[str, Any], error: type[Exception], match: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: Any) -> None:
        raise AssertionError("a kernel ran for a bad call")

    monkeypatch.setattr(binding, "run_interpreter", no_run)
    q, k, v = make_qkv(1, (2, 2), (5, 6), 16, torch.float16)
    with pytest.raises(error, match=match):
        lazytriton.attn_fwd(q, k, v, **kwargs)
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)


def test_the_call_holds_the_window_in_the_kernels_terms() -> None:
    q, k, v = make_qkv(1, (2, 2), (5, 9), 16, torch.float16)
    assert binding.check(q, k, v) == binding.check(q, k, v, window=(-1, -1), softcap=0.0)
    plain = binding.check(q, k, v)
    assert not plain.windowed and not plain.capped and (plain.window_left, plain.window_right) == (-1, -1)
    call = binding.check(q, k, v, window=(3, -1))
    assert (call.offset, call.window_left, call.window_right) == (4, 3, 9)  # bottom-right; -1 -> max(sq, sk)
    call = binding.check(q, k, v, "top_left", window=(10**12, 7), softcap=2)
    assert (call.offset, call.window_left, call.window_right, call.softcap) == (0, 9, 0, 2.0)
    call = binding.check(q, k, v, "bottom_right", window=(-1, 5), softcap=0.5)  # causal alone: no window
    assert not call.windowed and call.capped and call.offset == 4
    assert binding.check(q, k, v, window=[2, 2]).windowed


def test_variants_gain_fields_only_when_on() -> None:
    target = Target.parse("sm_90")
    for kernel in ("flash_fwd", *bwd_dispatch.BWD_KERNELS):
        # 4095: no SEQ16 in the backward's strings, so SOFTCAP sorts right after INDEX64
        plain = dispatch.kernel_variant(kernel, target, "bf16", 128, True, True, 4095, 4095)
        assert "WINDOW" not in str(plain) and "SOFTCAP" not in str(plain)
        both = dispatch.kernel_variant(kernel, target, "bf16", 128, True, True, 4095, 4095, window=True, softcap=True)
        assert both.get("WINDOW") is True and both.get("SOFTCAP") is True
        assert check_fields(Variant.parse(str(both))) == both and both.key() != plain.key()
        assert str(plain).replace("INDEX64=false", "INDEX64=false,SOFTCAP=true") == str(
            dispatch.kernel_variant(kernel, target, "bf16", 128, True, True, 4095, 4095, softcap=True))
        with pytest.raises(ValueError, match="WINDOW=1 must be true or false"):
            check_fields(Variant.parse(str(plain).replace("INDEX64=false", "INDEX64=false,WINDOW=1")))
    # A string written before these flags existed still parses to the same variant.
    text = ("flash_fwd:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,INDEX64=false:"
            "BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8")
    assert str(dispatch.kernel_variant("flash_fwd", target, "bf16", 128, False, True, 4096, 4096)) == text


def test_memo_keys_of_plain_calls_are_unchanged_and_others_differ() -> None:
    shape = binding.Shape(1, 2, 2, 100, 100, 64)
    plain = binding.memo_key(0, torch.float16, shape, True, True, False)
    assert len(plain) == 8 and plain == binding.memo_key(0, torch.float16, shape, True, True, False, False, False)
    keys = {binding.memo_key(0, torch.float16, shape, True, True, False, w, s) for w in (False, True)
            for s in (False, True)}
    assert len(keys) == 4
    assert bwd_binding.memo_key(0, torch.float16, shape, True, True, False, True, False)[1:] == \
        binding.memo_key(0, torch.float16, shape, True, True, False, True, False)


def test_the_warm_path_is_never_offered_a_window_or_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    offered: list[Any] = []
    monkeypatch.setattr(hot, "forward_bhsd", lambda *args: offered.append(args))
    monkeypatch.setattr(hot, "forward_bshd", lambda *args: offered.append(args))
    q, k, v = make_qkv(1, (2, 2), (6, 6), 16, torch.float32)
    lazytriton.attn_fwd(q, k, v, window_size=(1, 1))
    lazytriton.attn_fwd(q, k, v, softcap=1.0)
    lazytriton.flash_attn_func(q, k, v, window_size=(1, 1))
    lazytriton.flash_attn_func(q, k, v, softcap=2.0)
    assert offered == []
    lazytriton.attn_fwd(q, k, v)
    assert len(offered) == 1


def test_op_schemas_and_fake_implementations() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lazytriton import ops

    fwd_args = [a.name for a in ops.flash_fwd_op._schema.arguments]
    bwd_args = [a.name for a in ops.flash_bwd_op._schema.arguments]
    window = fwd_args.index("window_left")
    assert fwd_args[window:window + 3] == bwd_args[bwd_args.index("window_left"):][:3] == [
        "window_left", "window_right", "softcap"]
    q, k, v = make_qkv(1, (4, 2), (7, 9), 16, torch.float32, seed=2)
    real = ops.flash_fwd_op(q, k, v, 0.25, "none", 2, 1, 1.5)
    real_grads = ops.flash_bwd_op(real[0], q, k, v, real[0], real[1], 0.25, "none", 2, 1, 1.5)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = ops.flash_fwd_op(fq, fk, fv, 0.25, "none", 2, 1, 1.5)
        fake_grads = ops.flash_bwd_op(fake[0], fq, fk, fv, fake[0], fake[1], 0.25, "none", 2, 1, 1.5)
    for r, f in zip((*real, *real_grads), (*fake, *fake_grads), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    ref, _ = attention_reference(q, k, v, sm_scale=0.25, window_size=(2, 1), softcap=1.5)
    torch.testing.assert_close(real[0], ref, atol=1e-5, rtol=0)


def test_autograd_through_the_op_matches_the_direct_path() -> None:
    q, k, v = make_qkv(1, (2, 1), (11, 17), 16, torch.float32, seed=9)
    results = []
    for through_op in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if through_op:
            with always_through_op():
                out, _ = lazytriton.attn_fwd(*leaves, window_size=(3, 2), softcap=2.0)
        else:
            out, _ = lazytriton.attn_fwd(*leaves, window_size=(3, 2), softcap=2.0)
        results.append((out, *torch.autograd.grad(out.sum(), leaves)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_interpreter_constexprs_carry_the_flags() -> None:
    shape = binding.Shape(1, 1, 1, 8, 8, 16)
    assert binding.interpreter_constexprs(shape, False, True, True)["WINDOW"] is True
    assert bwd_binding.interpreter_constexprs(shape, False, False, True) | {} == {
        **bwd_binding.interpreter_constexprs(shape, False), "SOFTCAP": True}


def test_prewarm_axes_add_window_and_softcap_variants(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton import tuning
    from lazytriton.cli import main as cli_main
    from lazytriton.prewarm.enumeration import Axes, all_kernels, enumerate_variants

    # The attention kernels (the decoding family's combine kernel has no window or cap: one variant for all).
    attention = ("flash_fwd", *bwd_dispatch.BWD_KERNELS)
    narrow = {"targets": (Target.parse("sm_90"),), "kernels": attention, "dtypes": ("bf16",), "head_dims": (64,),
              "causal": (False,), "seqlens_q": (4096,)}
    table = tuning.tables_for(all_kernels())
    def plan(axes: Axes) -> list[Any]:  # the Gluon twins serve plain calls only (tests/test_prewarm.py)
        return [p for p in enumerate_variants(axes, table) if p.origin not in ("gluon table", "fused table")]

    plain = plan(Axes(**narrow))
    assert all("WINDOW" not in p.variant.constexprs and "SOFTCAP" not in p.variant.constexprs for p in plain)
    both = plan(Axes(**narrow, window=(False, True), softcap=(False, True)))
    assert len(both) == 4 * len(plain) and {p.key for p in plain} < {p.key for p in both}
    flags = {("WINDOW" in p.variant.constexprs, "SOFTCAP" in p.variant.constexprs) for p in both}
    assert flags == {(False, False), (False, True), (True, False), (True, True)}
    common = ["prewarm", "--target", "sm_90", "--kernel", "flash_fwd,flash_bwd", "--dtype", "bf16", "--head-dim",
              "64", "--causal", "none", "--seqlen-q", "4096", "--list"]
    assert cli_main(common) == 0
    listed_plain = [line for line in capsys.readouterr().out.splitlines() if not twin_line(line)]
    assert cli_main([*common, "--window"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if not twin_line(line)]
    assert len(listed) == 2 * len(listed_plain) and sum("WINDOW=true" in line for line in listed) == len(listed_plain)
    assert not any("SOFTCAP" in line for line in listed)


# ---------------------------------------------------------------------------
# Compiling the new variants (no GPU needed: Triton compiles for sm_90 and sm_80 here)


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("kernel", ["flash_fwd", *bwd_dispatch.BWD_KERNELS])
def test_window_and_softcap_variants_compile(kernel: str, target: str) -> None:
    from test_compile import SHARED_LIMIT, check_elf

    from lazytriton.compiler import compile_variant
    from lazytriton.kernels import get

    parsed = Target.parse(target)
    variant = dispatch.kernel_variant(kernel, parsed, "bf16", 128, True, True, 4096, 4096, window=True, softcap=True)
    entry = compile_variant(variant)
    check_elf(entry, parsed)
    spec = get(kernel)
    assert entry.name == spec.function and entry.variant == str(variant)
    assert entry.arg_types == tuple(t for t in spec.signature("bf16", False).values() if t != "constexpr")
    # window_left, window_right, attention_chunk (then the ALiBi and bias strides)
    assert entry.arg_types[-11:-8] == ("i32", "i32", "i32")
    assert entry.arg_types[-3:-1] == ("fp32", "fp32")  # sm_scale, softcap (then dropout_p)
    assert 0 < entry.shared <= SHARED_LIMIT[target]


def test_tma_variant_with_window_and_softcap_compiles() -> None:
    from lazytriton.compiler import compile_variant

    variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, False, True, 4096, tma=True,
                                             window=True, softcap=True)
    assert variant.get("TMA") is True and variant.get("WINDOW") is True
    entry = compile_variant(variant)
    assert entry.global_scratch_size > 0 and entry.binary[:4] == b"\x7fELF"
