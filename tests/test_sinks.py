"""Attention sinks (gpt-oss's; FlashAttention-3 forks' ``s_aux``): forward, backward, decoding, checks, plans.

A sink is one float32 logit a query head: it joins every softmax row's
denominator beside the scaled (capped, biased) scores and adds no value, so
out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)) and the lse
includes it; a row that sees no key outputs 0 with lse = sink. The reference
is FlashAttention-3's (``attention_ref`` in vLLM's fork: one more column of
scores, dropped before the product with v), which is also transformers'
gpt-oss eager attention, in float64 with autograd for dq, dk, dv and dsinks.

Numerics follow FlashAttention's rule: out and lse at most twice the error of
a same-dtype reference (plus the dtype's floor), the gradients three times.
CPU tests run the kernels through Triton's interpreter on small shapes; the
GPU tests (``-m gpu``) run real sizes, the Gluon forward's included.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import pytest
import torch
from conftest import assert_compiled_grads_equal
from flash_rule import check_rule, max_err
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, on_gpu, seed_of, skip_unless_sm90
from varlen_cases import cu

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_decode import binding as decode_binding
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_fwd import binding, gluon
from lazytriton.kernels.flash_fwd.reference import attention_reference
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
SM90 = Target.parse("sm_90")
NO_WINDOW = (-1, -1)


class Case(NamedTuple):
    dtype: torch.dtype
    head_dim: int
    heads: tuple[int, int]
    seqlens: tuple[int, int]
    causal: bool | str
    window: tuple[int, int] = NO_WINDOW
    softcap: float = 0.0
    alibi: bool = False

    def __str__(self) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')}-d{self.head_dim}-h{self.heads[0]}x{self.heads[1]}-"
                f"s{self.seqlens[0]}x{self.seqlens[1]}-{self.causal}-w{self.window[0]}_{self.window[1]}-"
                f"cap{self.softcap}-alibi{self.alibi}")


CASES = [
    Case(F32, 32, (4, 2), (37, 21), False),  # GQA, ragged tiles
    Case(F16, 64, (2, 2), (40, 40), "top_left"),  # attn_fwd's causal alignment
    Case(BF16, 32, (4, 1), (45, 19), "bottom_right"),  # MQA, rows that see no key (sq > sk)
    Case(F32, 40, (2, 1), (33, 50), "bottom_right", (6, -1)),  # split tiles, a left window
    Case(F16, 32, (2, 2), (24, 35), False, (4, 3), 2.0),  # a window both sides, softcap
    Case(F32, 16, (4, 2), (20, 27), "bottom_right", NO_WINDOW, 1.5, True),  # softcap and ALiBi
]


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed_of(str(case)))
    (hq, hk), (sq, sk), d = case.heads, case.seqlens, case.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    return {"q": randn(2, hq, sq, d), "k": randn(2, hk, sk, d), "v": randn(2, hk, sk, d), "do": randn(2, hq, sq, d),
            "sinks": torch.randn(hq, generator=gen) * 2, "alibi": torch.rand(hq, generator=gen) * 0.5}


def _reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
               slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_reference(q, k, v, causal=case.causal, window_size=case.window, softcap=case.softcap,
                               alibi_slopes=slopes, sinks=sinks)


def _kernel(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
            slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_fwd for a top-left case, else flash_attn_func (bottom-right or none), with s_aux for the latter."""
    if case.causal == "top_left" or slopes is not None:
        return lazytriton.attn_fwd(q, k, v, causal=case.causal, window_size=case.window, softcap=case.softcap,
                                   alibi_slopes=slopes, sinks=sinks)
    out, lse, _ = lazytriton.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             causal=case.causal == "bottom_right", window_size=case.window,
                                             softcap=case.softcap, s_aux=sinks, return_attn_probs=True)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients_follow_flashattentions_rule(case: Case) -> None:
    t = _inputs(case)
    slopes = t["alibi"] if case.alibi else None
    leaves = [x.clone().requires_grad_() for x in (t["q"], t["k"], t["v"], t["sinks"])]
    out, lse = _kernel(case, *leaves, slopes)
    got = torch.autograd.grad(out, leaves, t["do"])
    exact_leaves = [x.double().requires_grad_() for x in (t["q"], t["k"], t["v"], t["sinks"])]
    exact_out, exact_lse = _reference(case, *exact_leaves, None if slopes is None else slopes.double())
    exact = torch.autograd.grad(exact_out, exact_leaves, t["do"].double())
    same_leaves = [x.clone().requires_grad_() for x in (t["q"], t["k"], t["v"], t["sinks"])]
    same_out, same_lse = _reference(case, *same_leaves, slopes)
    same = torch.autograd.grad(same_out, same_leaves, t["do"])
    check_rule("out", out, exact_out, same_out, OUT_FLOOR[case.dtype], 2)
    check_rule("lse", lse, exact_lse, same_lse, LSE_FLOOR, 2)
    for name, g, e, s in zip(("dq", "dk", "dv", "dsinks"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[case.dtype], 3)
    assert got[3].dtype == torch.float32 and got[3].shape == t["sinks"].shape


def test_a_row_that_sees_no_key_outputs_zero_with_the_sinks_lse() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, n, 2, 16, generator=gen) for n in (9, 3, 3))
    sinks = torch.tensor([0.25, -1.5])
    out, lse, _ = lazytriton.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True)
    blind = 9 - 3  # bottom-right: the first six queries see no key
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    torch.testing.assert_close(lse[0, :, :blind], sinks[:, None].expand(2, blind), rtol=0, atol=1e-6)
    # No key at all: nothing launched, the same answer.
    empty = torch.empty(1, 0, 2, 16)
    out, lse, _ = lazytriton.flash_attn_func(q, empty, empty, sinks=sinks, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse[0], sinks[:, None].expand(2, 9))  # exact: copied


def test_a_sink_of_minus_infinity_is_no_sink() -> None:
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, n, 2, 16, generator=gen) for n in (9, 5, 5))
    none = torch.full((2,), float("-inf"))
    got = lazytriton.flash_attn_func(q, k, v, causal=True, sinks=none, return_attn_probs=True)
    want = lazytriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


def test_sinks_compose_with_dropout_and_give_the_gradient_of_their_share() -> None:
    """With dropout, d(sinks) is still -sum exp(sink - lse) * rowsum(dO * O): checked against the formula."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, do = (torch.randn(1, 20, 2, 16, generator=gen) for _ in range(4))
    sinks = torch.randn(2, generator=gen).requires_grad_()
    torch.manual_seed(3)
    out, lse, _ = lazytriton.flash_attn_func(q, k, v, dropout_p=0.3, sinks=sinks, return_attn_probs=True)
    (dsinks,) = torch.autograd.grad(out, (sinks,), do)
    delta = (do.double() * out.double()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    want = -(torch.exp(sinks.detach().double()[None, :, None] - lse.double()) * delta).sum((0, 2))
    torch.testing.assert_close(dsinks.double(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Packed sequences


def test_varlen_with_seqused_causal_window_and_gqa() -> None:
    gen = torch.Generator().manual_seed(11)
    spans_q, spans_k, used_q, used_k = (12, 0, 35, 7), (20, 6, 18, 3), (9, 0, 35, 5), (20, 2, 11, 3)
    hq, hk, d = 4, 2, 32
    q, do = (torch.randn(sum(spans_q), hq, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(sum(spans_k), hk, d, generator=gen) for _ in range(2))
    sinks = torch.randn(hq, generator=gen) * 2
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    used = {"seqused_q": torch.tensor(used_q, dtype=torch.int32), "seqused_k": torch.tensor(used_k, dtype=torch.int32)}
    out, lse, _ = lazytriton.flash_attn_varlen_func(*leaves[:3], cu(spans_q), cu(spans_k), max(spans_q),
                                                    max(spans_k), causal=True, window_size=(5, -1), sinks=leaves[3],
                                                    return_attn_probs=True, **used)
    got = torch.autograd.grad(out, leaves, do)
    exact_leaves = [x.double().requires_grad_() for x in (q, k, v, sinks)]
    total = torch.zeros((), dtype=torch.float64)
    starts_q, starts_k = itertools.accumulate((0, *spans_q)), itertools.accumulate((0, *spans_k))
    for sq0, sk0, span, nq, nk in zip(starts_q, starts_k, spans_q, used_q, used_k, strict=False):
        rows = slice(sq0, sq0 + nq)
        ref_out, ref_lse = attention_reference(exact_leaves[0][rows].transpose(0, 1)[None],
                                               exact_leaves[1][sk0:sk0 + nk].transpose(0, 1)[None],
                                               exact_leaves[2][sk0:sk0 + nk].transpose(0, 1)[None],
                                               causal="bottom_right", window_size=(5, -1), sinks=exact_leaves[3])
        assert max_err(out[rows], ref_out[0].transpose(0, 1)) < 1e-5
        assert max_err(lse[:, rows], ref_lse[0]) < 1e-5
        # Rows past seqused_q: out 0, lse the sink (a row that sees no key).
        assert torch.equal(out[sq0 + nq:sq0 + span], torch.zeros_like(out[sq0 + nq:sq0 + span]))
        torch.testing.assert_close(lse[:, sq0 + nq:sq0 + span], sinks[:, None].expand(hq, span - nq), rtol=0,
                                   atol=1e-6)
        total = total + (ref_out[0].transpose(0, 1) * do[rows].double()).sum()
    exact = torch.autograd.grad(total, exact_leaves, allow_unused=True)
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, exact, strict=True):
        assert max_err(g, e) < 2e-5 * max(1.0, float(e.abs().max())), name


# ---------------------------------------------------------------------------
# Decoding


def _paged(cache: torch.Tensor, page: int, table: torch.Tensor) -> torch.Tensor:
    """A contiguous (batch, capacity, heads, dim) cache as the pages of ``table`` (one spare page)."""
    b, _, h, d = cache.shape
    pool = torch.zeros(table.numel() + 1, page, h, d)
    for i, j in itertools.product(range(b), range(table.shape[1])):
        chunk = cache[i, j * page:(j + 1) * page]
        pool[table[i, j], :chunk.shape[0]] = chunk
    return pool


@pytest.mark.parametrize(("splits", "page"), [(1, 0), (3, 0), (1, 16), (4, 16)])
def test_kvcache_joins_the_sink_once_with_one_split_or_several(splits: int, page: int) -> None:
    gen = torch.Generator().manual_seed(seed_of(splits, page))
    b, hq, hk, d, capacity, sq = 3, 4, 2, 32, 70, 2
    kc, vc = (torch.randn(b, capacity, hk, d, generator=gen) for _ in range(2))
    q = torch.randn(b, sq, hq, d, generator=gen)
    lens = torch.tensor([0, 37, 68], dtype=torch.int32)  # the first sequence sees no key
    sinks = torch.randn(hq, generator=gen) * 2
    caches: dict[str, Any] = {"k_cache": kc, "v_cache": vc}
    if page:
        per = -(-capacity // page)
        table = torch.randperm(b * per + 1, generator=gen)[:b * per].view(b, per).to(torch.int32)
        caches = {"k_cache": _paged(kc, page, table), "v_cache": _paged(vc, page, table), "block_table": table}
    out, lse = lazytriton.flash_attn_with_kvcache(q, cache_seqlens=lens, causal=True, num_splits=splits,
                                                  return_softmax_lse=True, sinks=sinks, **caches)
    for i in range(b):
        n = int(lens[i])
        ref_out, ref_lse = attention_reference(q[i:i + 1].transpose(1, 2).double(),
                                               kc[i:i + 1, :n].transpose(1, 2).double(),
                                               vc[i:i + 1, :n].transpose(1, 2).double(), causal="bottom_right",
                                               sinks=sinks.double())
        assert max_err(out[i:i + 1], ref_out.transpose(1, 2)) < 1e-5
        assert max_err(lse[i:i + 1], ref_lse) < 1e-5
    torch.testing.assert_close(lse[0], sinks[:, None].expand(hq, sq), rtol=0, atol=1e-6)


def test_kvcache_memo_keys_and_variants() -> None:
    t = decode_binding.checks.Inputs(torch.empty(1, 1, 4, 64), torch.empty(1, 128, 2, 64), torch.empty(1, 128, 2, 64))
    plain = decode_binding.checks.check(t)
    sunk = decode_binding.checks.check(t._replace(sinks=torch.zeros(4)))
    assert sunk.sinks and not plain.sinks
    key = decode_binding.memo_key(0, torch.bfloat16, plain, True, False)
    assert decode_binding.memo_key(0, torch.bfloat16, sunk, True, False) == (*key, "sinks")
    split, combine = decode_binding.variants(SM90, torch.bfloat16, sunk, True, False)
    assert split.constexprs.get("SINKS") is True and combine.constexprs.get("SINKS") is True
    assert all("SINKS" not in str(v) for v in decode_binding.variants(SM90, torch.bfloat16, plain, True, False))
    assert "sinks" in decode_dispatch.PREWARM_FEATURES


# ---------------------------------------------------------------------------
# Bad input, before anything runs


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton import compiler

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a kernel ran for a call that should have been refused")

    monkeypatch.setattr(compiler, "interpret", refuse)


BAD = [(torch.zeros(2, dtype=torch.bfloat16), TypeError, "sinks must be float32"),
       (torch.zeros(3), ValueError, r"sinks must have shape \(2,\)"),
       (torch.zeros(1, 2), ValueError, r"sinks must have shape \(2,\)"),
       (torch.zeros(2, device="meta"), ValueError, "sinks is on meta"),
       ([0.0, 0.0], TypeError, "sinks must be a torch.Tensor")]


@pytest.mark.parametrize(("sinks", "error", "match"), BAD, ids=lambda x: str(x)[:30])
def test_bad_sinks_are_refused_by_name_before_any_launch(sinks: Any, error: type[Exception], match: str,
                                                         nothing_runs: None) -> None:
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_func(q, q, q, sinks=sinks)
    with pytest.raises(error, match=match):
        lazytriton.attn_fwd(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), sinks=sinks)
    packed, lengths = q[0], cu((5,))
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_varlen_func(packed, packed, packed, lengths, lengths, 5, 5, s_aux=sinks)
    with pytest.raises(error, match=match.replace("must be float32", "must be torch.float32")):
        lazytriton.flash_attn_with_kvcache(q, q, q, sinks=sinks)


def test_sinks_and_s_aux_together_are_refused(nothing_runs: None) -> None:
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(TypeError, match="sinks and s_aux are two names of one argument"):
        lazytriton.flash_attn_func(q, q, q, sinks=torch.zeros(2), s_aux=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks and s_aux are two names of one argument"):
        lazytriton.flash_attn_with_kvcache(q, q, q, sinks=torch.zeros(2), s_aux=torch.zeros(2))


# ---------------------------------------------------------------------------
# Variants, keys, plans


def test_variant_strings_without_sinks_are_unchanged_and_sinks_add_one_flag() -> None:
    plain = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, True, True, 4096, 4096)
    sunk = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, True, True, 4096, 4096, sinks=True)
    assert "SINKS" not in str(plain)
    assert str(sunk) == str(plain).replace("INDEX64=false", "INDEX64=false,SINKS=true")
    assert Variant.parse(str(sunk)) == sunk and check_fields(sunk) == sunk and sunk.key() != plain.key()
    assert str(binding.variant(SM90, torch.bfloat16, binding.Shape(1, 8, 8, 4096, 4096, 128), True, True,
                               False)) == str(plain)
    with pytest.raises(ValueError, match="sinks .* are taken by flash_fwd only"):
        dispatch.kernel_variant("flash_bwd_dq", SM90, "bf16", 128, True, True, 4096, 4096, sinks=True)


def test_memo_keys_of_plain_calls_hold_and_sinks_get_their_own() -> None:
    shape = binding.Shape(2, 8, 8, 4096, 4096, 128)
    plain = binding.memo_key(0, torch.bfloat16, shape, True, True, False, offset=0, scale=0.1)
    sunk = binding.memo_key(0, torch.bfloat16, shape, True, True, False, offset=0, scale=0.1, sinks=True)
    assert plain == (0, torch.bfloat16, 128, True, True, False, 12, 12, *plain[8:])
    assert sunk[:8] == plain[:8] and sunk[8:9] == binding.SINKS_TAG and sunk[9:] == plain[8:]
    assert binding.gluon_key(sunk) == binding.gluon_key(plain)  # the Gluon forward carries sinks
    assert binding.variant(SM90, torch.bfloat16, shape, True, True, False, gluon=binding.gluon_key(sunk),
                           sinks=True).constexprs.get("SINKS") is True


def test_the_gluon_forward_takes_sinks_and_compiles_them_for_sm90() -> None:
    pytest.importorskip("triton")
    from lazytriton.compiler import compile_variant

    variant = gluon.variant("sm_90", "bf16", 128, "top_left", True, False, 4096, 4096, tiles=(128, 128, 4),
                            producer=True, pingpong=True, q_tiles=2, sinks=True)
    assert variant is not None and variant.constexprs.get("SINKS") is True
    assert "SINKS" not in str(gluon.variant("sm_90", "bf16", 128, "top_left", True, False, 4096, 4096,
                                            tiles=(128, 128, 4), producer=True, pingpong=True, q_tiles=2))
    entry = compile_variant(variant)
    assert entry.kind == "cubin" and entry.binary


def test_prewarm_plans_sinks_for_the_forward_its_gluon_twin_and_decoding_not_the_backward() -> None:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    kernels = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv", "flash_decode_split", "flash_decode_combine")
    table = tuning.tables_for(kernels)

    def axes(**flags: tuple[bool, ...]) -> Axes:
        return Axes((SM90,), kernels=kernels, dtypes=("bf16",), head_dims=(128,), causal=(True,),
                    seqlens_q=(4096,), **flags)

    plain = {str(p.variant) for p in enumerate_variants(axes(), table)}
    both = {str(p.variant) for p in enumerate_variants(axes(sinks=(False, True)), table)}
    assert not any("SINKS" in v for v in plain) and plain <= both
    extra = {Variant.parse(v).kernel for v in both - plain}
    assert extra == {"flash_fwd", "flash_fwd_gluon", "flash_decode_split", "flash_decode_combine"}


def test_cache_explain_describes_sinks(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    call = ["cache", "explain", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "4096", "--target", "sm_90",
            "--causal", "bottom_right", "--sinks"]
    assert cli_main(call) == 0
    out = capsys.readouterr().out
    want = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 64, True, True, 4096, 4096, sinks=True)
    assert f"variant  {want}" in out and "sinks (SINKS=true)" in out
    assert cli_main([*call, "--kernel", "flash_bwd"]) == 0
    assert "SINKS" not in "".join(line for line in capsys.readouterr().out.splitlines() if line.startswith("variant"))


# ---------------------------------------------------------------------------
# torch.compile


def test_torch_compile_traces_forward_and_backward_with_sinks() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    q, k, v, do = (torch.randn(1, 18, 2, 16, generator=gen) for _ in range(4))
    sinks = torch.randn(2, generator=gen)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(q * 2, k, v, causal=True, sinks=sinks * 1.5) * 3  # type: ignore[no-any-return]

    assert_compiled_grads_equal(fn, (q, k, v, sinks), do)


def test_torch_compile_traces_varlen_and_kvcache_with_sinks() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(13)
    packed = [torch.randn(21, 2, 16, generator=gen) for _ in range(4)]
    sinks = torch.randn(2, generator=gen)
    lengths = cu((9, 12))

    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_varlen_func(q, k, v, lengths, lengths, 12, 12, causal=True,  # type: ignore
                                                 sinks=sinks)

    leaves = [t.clone().requires_grad_() for t in (*packed[:3], sinks)]
    got = torch.autograd.grad(torch.compile(varlen, fullgraph=True, backend="eager")(*leaves), leaves, packed[3])
    eager = [t.clone().requires_grad_() for t in (*packed[:3], sinks)]
    want = torch.autograd.grad(varlen(*eager), eager, packed[3])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)

    q, cache = torch.randn(2, 1, 2, 16, generator=gen), torch.randn(2, 30, 2, 16, generator=gen)
    lens = torch.tensor([7, 30], dtype=torch.int32)

    def decode(q: torch.Tensor, cache: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, sinks=sinks,  # type: ignore
                                                  num_splits=2)

    assert torch.equal(torch.compile(decode, fullgraph=True, backend="eager")(q, cache, sinks),
                       decode(q, cache, sinks))


# ---------------------------------------------------------------------------
# GPU: real sizes, the Gluon forward among them


def _gpu_inputs(b: int, s: int, h: int, d: int, dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda", dtype=dtype) for _ in range(3))
    return q, k, v, torch.randn(h, generator=gen, device="cuda") * 2


@on_gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward_with_sinks_at_real_sizes_the_gluon_kernel_on_sm90(head_dim: int, causal: bool) -> None:
    q, k, v, sinks = _gpu_inputs(2, 4096, 8, head_dim, BF16, seed_of(head_dim, causal))
    loaded = lazytriton.preload(q, k, causal="bottom_right" if causal else False, layout="bshd", sinks=True)
    assert loaded and all("SINKS=true" in variant for variant in loaded)
    out, lse, _ = lazytriton.flash_attn_func(q, k, v, causal=causal, sinks=sinks, return_attn_probs=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    exact_out, exact_lse = attention_reference(qt.float(), kt.float(), vt.float(), causal="bottom_right" if causal
                                               else False, sinks=sinks)
    same_out, same_lse = attention_reference(qt, kt, vt, causal="bottom_right" if causal else False, sinks=sinks)
    check_rule("out", out.transpose(1, 2), exact_out, same_out, OUT_FLOOR[BF16], 2)
    check_rule("lse", lse, exact_lse, same_lse, LSE_FLOOR, 2)
    call = binding.check(qt, kt, vt, "bottom_right" if causal else False)._replace(sinks=sinks)
    served = binding.preload(q.device, BF16, call)  # the variant this call ran
    assert served.constexprs.get("SINKS") is True
    key = binding.memo_key(q.device.index, BF16, call.shape, causal, True, False, offset=call.offset,
                           scale=call.scale, sinks=True)
    if binding.gluon_key(key):  # dispatch's Gluon table holds the shape: the Gluon forward served it, on sm_90
        skip_unless_sm90(q, "flash_fwd_gluon")
        assert served.kernel == "flash_fwd_gluon"


@on_gpu
def test_gpu_backward_with_sinks_and_the_plain_warm_path_unchanged() -> None:
    q, k, v, sinks = _gpu_inputs(2, 1024, 4, 128, BF16, 21)
    do = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    got = torch.autograd.grad(lazytriton.flash_attn_func(*leaves[:3], causal=True, sinks=leaves[3]), leaves, do)
    exact_leaves = [t.float().requires_grad_() for t in (q, k, v, sinks)]
    exact_out = attention_reference(*(t.transpose(1, 2) for t in exact_leaves[:3]), causal="bottom_right",
                                    sinks=exact_leaves[3])[0].transpose(1, 2)
    exact = torch.autograd.grad(exact_out, exact_leaves, do.float())
    same_leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    same_out = attention_reference(*(t.transpose(1, 2) for t in same_leaves[:3]), causal="bottom_right",
                                   sinks=same_leaves[3])[0].transpose(1, 2)
    same = torch.autograd.grad(same_out, same_leaves, do)
    for name, g, e, s in zip(("dq", "dk", "dv", "dsinks"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[BF16], 3)
    # A plain call after sink calls: the warm path serves it as before, with no sink in it.
    for _ in range(3):
        plain = lazytriton.flash_attn_func(q, k, v, causal=True)
        sunk_none = lazytriton.flash_attn_func(q, k, v, causal=True, sinks=torch.full_like(sinks, float("-inf")))
        torch.testing.assert_close(plain, sunk_none, rtol=0, atol=2e-2)


@on_gpu
@pytest.mark.parametrize("splits", [1, 0, 8])
def test_gpu_kvcache_with_sinks_forced_and_heuristic_splits(splits: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(splits)
    b, hq, hk, d, capacity = 4, 32, 8, 64, 8192
    q = torch.randn(b, 1, hq, d, generator=gen, device="cuda", dtype=BF16)
    kc, vc = (torch.randn(b, capacity, hk, d, generator=gen, device="cuda", dtype=BF16) for _ in range(2))
    lens = torch.tensor([0, 100, 4000, 8192], dtype=torch.int32, device="cuda")
    sinks = torch.randn(hq, generator=gen, device="cuda") * 2
    out, lse = lazytriton.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, sinks=sinks,
                                                  return_softmax_lse=True)
    for i in range(b):
        n = int(lens[i])
        ref_out, ref_lse = attention_reference(q[i:i + 1].transpose(1, 2).float(),
                                               kc[i:i + 1, :n].transpose(1, 2).float(),
                                               vc[i:i + 1, :n].transpose(1, 2).float(), causal="bottom_right",
                                               sinks=sinks)
        assert max_err(out[i:i + 1], ref_out.transpose(1, 2)) < 2e-2
        assert max_err(lse[i:i + 1], ref_lse) < 1e-3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sinks_beside_a_mask_that_requires_grad(compiled: bool) -> None:
    """The SDPA drop-in's body with a float mask and sinks, both requiring grad: every gradient against float64."""
    from lazytriton import sdpa

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen).requires_grad_() for _ in range(3))
    mask = torch.randn(1, 2, 5, 6, generator=gen)[..., :5].contiguous().requires_grad_()
    sinks = torch.randn(2, generator=gen).requires_grad_()

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             sinks: torch.Tensor) -> torch.Tensor:
        return sdpa.masked(q, k, v, mask, 0.0, False, None, False, sinks=sinks)

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  sinks: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / 4 + mask
        with_sink = torch.cat([scores, sinks[None, :, None, None].expand(1, 2, 5, 1)], -1)
        return with_sink.softmax(-1)[..., :-1] @ v  # type: ignore[no-any-return]

    run = torch.compile(call, backend="eager", fullgraph=True) if compiled else call
    inputs = (q, k, v, mask, sinks)
    out = run(*inputs)
    want = reference(*(t.double() for t in inputs))
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, inputs, grad)
    wanted = torch.autograd.grad(want, inputs, grad.double())
    assert max_err(out, want) < 1e-5
    for name, a, b in zip(("q", "k", "v", "mask", "sinks"), got, wanted, strict=True):
        assert b.abs().max() > 0 and max_err(a, b) < 1e-5, name
