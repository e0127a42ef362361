"""FlashAttention-3's ``seqused_q``/``seqused_k`` in ``flash_attn_varlen_func``: forward, backward, checks, plans.

Sequence i's queries are the first seqused_q[i] rows of its cu_seqlens_q span
and its keys the first seqused_k[i] of its cu_seqlens_k span; causal, window
and ALiBi alignment use those used lengths (bottom-right with seqlen_q =
seqused_q[i], seqlen_k = seqused_k[i]), as FlashAttention-3's
``test_flash_attn_varlen_output`` builds its reference (``attention_ref`` with
padding masks of the used lengths). FlashAttention-3 leaves the unused rows of
out, lse, dq and the unused keys' dk/dv as its ``torch.empty`` had them (its
test masks them to 0 before comparing); lazytriton writes them: out 0, lse
-inf (a row that sees no key), dq, dk and dv 0. Unused rows and keys hold NaN
here, so a read of any of them would show.

Numerics follow FlashAttention's rule against a float64 reference of the used
rows, sequence by sequence: out and lse at most twice the same-dtype
reference's error, the gradients three times (FlashAttention-3's factor), plus
the dtype's floor. Small shapes through Triton's interpreter, with spans past
the interpreter's tiles (32 query rows forward, 16 backward, 16 keys), so that
whole blocks of unused rows and keys occur. Also: ALiBi, dropout (each used
element keeps its bit of the packed mask), the descriptor (TMA) forward, the
checks, torch.compile, variants and memo keys, prewarm, ``cache explain`` and
the C API's specs (its calls are in tests/test_capi.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from flash_rule import check_rule, references, seed_of
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, on_gpu
from varlen_cases import assert_refused, cu, packed_reference

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_fwd import varlen
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
NO_WINDOW = (-1, -1)


class Case(NamedTuple):
    dtype: torch.dtype
    head_dim: int
    heads: tuple[int, int]
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi: str  # none, heads, batch
    spans_q: tuple[int, ...]
    spans_k: tuple[int, ...]
    used_q: tuple[int, ...] | None
    used_k: tuple[int, ...] | None

    def __str__(self) -> str:
        def lengths(name: str, spans: tuple[int, ...], used: tuple[int, ...] | None) -> str:
            return f"{name}{'_'.join(map(str, spans))}" + ("" if used is None else f"u{'_'.join(map(str, used))}")

        return (f"{str(self.dtype).removeprefix('torch.')}-d{self.head_dim}-h{self.heads[0]}x{self.heads[1]}-"
                f"{'causal' if self.causal else 'full'}-w{self.window[0]}_{self.window[1]}-cap{self.softcap}-"
                f"alibi_{self.alibi}-{lengths('q', self.spans_q, self.used_q)}-"
                f"{lengths('k', self.spans_k, self.used_k)}")

    def lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The used lengths of each sequence (the span where seqused is not given)."""
        return self.used_q or self.spans_q, self.used_k or self.spans_k


CASES = [
    # seqused_q alone: an empty span, a used length of 0, one equal to its span, a whole unused block (33..40)
    Case(F16, 32, (4, 4), False, NO_WINDOW, 0.0, "none", (5, 0, 17, 1, 40), (7, 3, 17, 0, 20),
         (3, 0, 17, 0, 6), None),
    # seqused_k alone, causal (bottom-right with the used key length), GQA, whole unused key blocks
    Case(BF16, 64, (4, 2), True, NO_WINDOW, 0.0, "none", (9, 40, 12), (13, 35, 40), None, (13, 4, 21)),
    # both, causal, MQA: more used queries than keys (rows that see no key), a used length of 0
    Case(F32, 32, (2, 1), True, NO_WINDOW, 0.0, "none", (20, 33, 6), (40, 9, 6), (7, 33, 0), (30, 2, 6)),
    # both, a sliding window
    Case(F16, 32, (2, 2), False, (3, 2), 0.0, "none", (19, 6), (25, 6), (12, 6), (20, 3)),
    # both, softcap, head dim 40 (split tiles in the backward)
    Case(F32, 40, (4, 2), False, NO_WINDOW, 1.5, "none", (13, 21, 2), (18, 5, 19), (13, 9, 1), (11, 5, 0)),
    # both, causal with a left window, ALiBi per sequence
    Case(BF16, 32, (4, 2), True, (5, -1), 0.0, "batch", (34, 8), (17, 12), (20, 8), (9, 12)),
    # seqused_k alone, ALiBi per head, fewer used keys than queries
    Case(F32, 16, (2, 1), True, NO_WINDOW, 0.0, "heads", (11, 18), (26, 7), None, (4, 7)),
]


def _inputs(case: Case) -> dict[str, Any]:
    """q, k, v, do (unused rows and keys hold NaN), the cu_seqlens, seqused and the slopes of a case."""
    gen = torch.Generator().manual_seed(seed_of(str(case)))
    (hq, hk), d = case.heads, case.head_dim

    def randn(total: int, heads: int) -> torch.Tensor:
        return torch.randn((total, heads, d), generator=gen).to(case.dtype)

    q, do = randn(sum(case.spans_q), hq), randn(sum(case.spans_q), hq)
    k, v = randn(sum(case.spans_k), hk), randn(sum(case.spans_k), hk)
    used_q, used_k = case.lengths()
    for t, spans, used in ((q, case.spans_q, used_q), (do, case.spans_q, used_q), (k, case.spans_k, used_k),
                           (v, case.spans_k, used_k)):
        for start, span, n in zip(itertools.accumulate((0, *spans)), spans, used, strict=False):
            t[start + n:start + span] = float("nan")
    batch = len(case.spans_q)
    slopes = None if case.alibi == "none" else torch.rand((hq,) if case.alibi == "heads" else (batch, hq),
                                                          generator=gen) * 0.7
    used = {name: None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
            for name, lengths in (("seqused_q", case.used_q), ("seqused_k", case.used_k))}
    return {"q": q, "k": k, "v": v, "do": do, "cu_seqlens_q": cu(case.spans_q), "cu_seqlens_k": cu(case.spans_k),
            "max_seqlen_q": max(case.spans_q), "max_seqlen_k": max(case.spans_k), "alibi_slopes": slopes, **used}


def _used_rows(spans: tuple[int, ...], used: tuple[int, ...]) -> torch.Tensor:
    """The packed rows that are used, as a boolean mask over the spans' rows."""
    return torch.cat([torch.arange(span) < n for span, n in zip(spans, used, strict=True)]) if spans else \
        torch.zeros(0, dtype=torch.bool)


def _reference(case: Case, slopes: torch.Tensor | None, keep: torch.Tensor | None = None,
               dropout_p: float = 0.0) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """(q, k, v) -> (out, lse) of the used rows of the packed q, k, v only, sequence by sequence.

    ``keep``: dropout's mask over the packed (1, heads_q, total_q, total_k) scores; each sequence's used rows
    and keys take their block of it.
    """
    return lambda q, k, v: packed_reference(q, k, v, case.spans_q, case.spans_k, used_q=case.used_q,
                                            used_k=case.used_k, causal=case.causal, window=case.window,
                                            softcap=case.softcap, slopes=slopes, keep=keep, dropout_p=dropout_p)


def _call(inputs: dict[str, Any], case: Case, *leaves: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _ = lazytriton.flash_attn_varlen_func(
        *leaves, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], inputs["max_seqlen_q"], inputs["max_seqlen_k"],
        causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=inputs["alibi_slopes"],
        return_attn_probs=True, seqused_q=inputs["seqused_q"], seqused_k=inputs["seqused_k"])
    return out, lse


@pytest.mark.parametrize("case", CASES, ids=str)
def test_used_rows_follow_flashattentions_rule_and_unused_ones_are_zero(case: Case) -> None:
    inputs = _inputs(case)
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _call(inputs, case, *leaves)
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    rows_q, rows_k = _used_rows(case.spans_q, case.lengths()[0]), _used_rows(case.spans_k, case.lengths()[1])

    # The rows past each used length: written as rows that see no key, zero gradients (NaN inputs never read).
    assert (out[~rows_q] == 0).all() and torch.isneginf(lse[:, ~rows_q]).all() and (dq[~rows_q] == 0).all()
    assert (dk[~rows_k] == 0).all() and (dv[~rows_k] == 0).all()

    exact, same = references(_reference(case, inputs["alibi_slopes"]), (q, k, v), do[rows_q])

    no_key = torch.isneginf(exact.lse)
    assert torch.equal(torch.isneginf(lse[:, rows_q]), no_key), "lse is -inf exactly where a used row sees no key"
    check_rule("out", out[rows_q], exact.out, same.out, OUT_FLOOR[case.dtype], 2)
    check_rule("lse", lse[:, rows_q][~no_key], exact.lse[~no_key], same.lse[~no_key], LSE_FLOOR, 2)
    for name, g, x, s, rows in zip(("dq", "dk", "dv"), (dq, dk, dv), exact.grads, same.grads,
                                   (rows_q, rows_k, rows_k), strict=True):
        check_rule(name, g[rows], x[rows], s[rows], GRAD_FLOOR[case.dtype], 3)


def test_dropout_keeps_each_elements_packed_mask_bit() -> None:
    """With dropout, sequence i's used rows and keys take their block of the packed mask, as without seqused."""
    from lazytriton.kernels.flash_fwd import score_mods
    from lazytriton.kernels.flash_fwd.reference import dropout_keep

    case = Case(F32, 16, (2, 1), True, NO_WINDOW, 0.0, "none", (9, 20, 3), (12, 6, 19), (5, 20, 0), (12, 2, 10))
    inputs = _inputs(case)
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    out = lazytriton.flash_attn_varlen_func(*leaves, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], 20, 19,
                                            dropout_p=0.3, causal=True, seqused_q=inputs["seqused_q"],
                                            seqused_k=inputs["seqused_k"])
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    torch.manual_seed(7)  # the pair the call drew
    keep = dropout_keep(score_mods.draw_philox(torch.device("cpu"), 0), (1, 2, sum(case.spans_q), sum(case.spans_k)),
                        0.3)
    rows_q, rows_k = _used_rows(case.spans_q, case.lengths()[0]), _used_rows(case.spans_k, case.lengths()[1])
    assert (out[~rows_q] == 0).all() and (dq[~rows_q] == 0).all() and (dk[~rows_k] == 0).all()
    exact, same = references(_reference(case, None, keep, 0.3), (q, k, v), do[rows_q])
    check_rule("out", out[rows_q], exact.out, same.out, OUT_FLOOR[F32], 2)
    for name, g, x, s, rows in zip(("dq", "dk", "dv"), (dq, dk, dv), exact.grads, same.grads,
                                   (rows_q, rows_k, rows_k), strict=True):
        check_rule(name, g[rows], x[rows], s[rows], GRAD_FLOOR[F32], 3)


def test_the_kernels_write_the_unused_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """out, lse and the gradients start as NaN: the zeros (and -inf) of the unused rows are the kernels' writes."""
    case = CASES[2]
    inputs = _inputs(case)

    def nan_outputs(q: torch.Tensor, head_dim_v: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.fill_(float("nan")) for t in real_outputs(q, head_dim_v))  # type: ignore[return-value]

    def nan_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bwd_binding.Grads:
        return bwd_binding.Grads(*(t.fill_(float("nan")) for t in real_grads(q, k, v)))

    real_outputs, real_grads = varlen.empty_outputs, bwd_binding.empty_grads
    monkeypatch.setattr(varlen, "empty_outputs", nan_outputs)
    monkeypatch.setattr(bwd_binding, "empty_grads", nan_grads)
    vc = varlen.check(inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
                      inputs["max_seqlen_q"], inputs["max_seqlen_k"], True, seqused_q=inputs["seqused_q"],
                      seqused_k=inputs["seqused_k"])
    out, lse = varlen.forward(inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
                              vc)
    grads = varlen.backward(inputs["q"], inputs["k"], inputs["v"], out, lse, inputs["do"], inputs["cu_seqlens_q"],
                            inputs["cu_seqlens_k"], vc)
    rows_q, rows_k = _used_rows(case.spans_q, case.lengths()[0]), _used_rows(case.spans_k, case.lengths()[1])
    assert not out.isnan().any() and not lse.isnan().any() and not any(g.isnan().any() for g in grads)
    assert (out[~rows_q] == 0).all() and torch.isneginf(lse[:, ~rows_q]).all()
    assert (grads.dq[~rows_q] == 0).all() and (grads.dk[~rows_k] == 0).all() and (grads.dv[~rows_k] == 0).all()


def test_the_tma_forward_reads_and_writes_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The descriptor path (TMA=true; the interpreter runs it too): rows cut at the used length, stored to the span."""
    from lazytriton.kernels.flash_fwd import binding as fwd_binding

    case = Case(F32, 32, (2, 1), True, NO_WINDOW, 0.0, "none", (5, 40, 15), (7, 2, 31), (3, 34, 0), (7, 1, 15))
    inputs = _inputs(case)
    args = [inputs[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    vc = varlen.check(*args, 40, 31, True, seqused_q=inputs["seqused_q"], seqused_k=inputs["seqused_k"])
    pointers = varlen.forward(*args, vc)
    real_constexprs, real_outputs = fwd_binding.interpreter_constexprs, varlen.empty_outputs
    monkeypatch.setattr(fwd_binding, "interpreter_constexprs",
                        lambda *a, **k: {**real_constexprs(*a, **k), "TMA": True})
    monkeypatch.setattr(varlen, "empty_outputs", lambda *a: tuple(t.fill_(float("nan")) for t in real_outputs(*a)))
    descriptors = varlen.forward(*args, vc)
    for a, b in zip(pointers, descriptors, strict=True):
        assert torch.equal(a.isneginf(), b.isneginf()) and not b.isnan().any()
        torch.testing.assert_close(a[a.isfinite()], b[b.isfinite()], rtol=1e-5, atol=1e-5)


def test_used_lengths_equal_to_the_spans_are_the_call_without_them() -> None:
    case = Case(F16, 32, (4, 2), True, NO_WINDOW, 0.0, "none", (5, 0, 37), (9, 3, 20), None, None)
    inputs = _inputs(case)
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    results = []
    for used in (None, "spans"):
        args = {name: None if used is None else torch.tensor(spans, dtype=torch.int32)
                for name, spans in (("seqused_q", case.spans_q), ("seqused_k", case.spans_k))}
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, _ = lazytriton.flash_attn_varlen_func(*leaves, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], 37,
                                                        20, causal=True, return_attn_probs=True, **args)
        results.append((out, lse, *torch.autograd.grad(out, leaves, do)))
    for without, with_spans in zip(*results, strict=True):
        assert torch.equal(without, with_spans)


def test_eager_calls_without_gradients_equal_the_op() -> None:
    """The direct path (no gradients: the binding without the op) and the op's give the same bits."""
    case = CASES[3]
    inputs = _inputs(case)
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    direct = _call(inputs, case, q, k, v)
    with lazytriton.interface.always_through_op():
        through_op = _call(inputs, case, q, k, v)
    for a, b in zip(direct, through_op, strict=True):
        assert torch.equal(a, b)


def test_max_seqlen_stays_at_least_the_longest_span(no_launch: None) -> None:
    inputs = _inputs(CASES[0])  # spans_q up to 40, used up to 17
    args = {n: inputs[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_k", "seqused_q")}
    with pytest.raises(ValueError, match=r"max_seqlen_q \(17\) must be at least the longest sequence in "
                                         r"cu_seqlens_q \(40\)"):
        lazytriton.flash_attn_varlen_func(**args, max_seqlen_q=17)


def test_a_larger_max_seqlen_gives_the_same_answer() -> None:
    case = CASES[1]
    inputs = _inputs(case)
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    out, lse = _call(inputs, case, q, k, v)
    inputs.update(max_seqlen_q=200, max_seqlen_k=300)
    bigger = _call(inputs, case, q, k, v)
    assert torch.equal(out, bigger[0]) and torch.equal(lse, bigger[1])


def test_a_strided_or_subclassed_seqused_is_read_as_its_values() -> None:
    case = CASES[3]
    inputs = _inputs(case)
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    want = _call(inputs, case, q, k, v)
    inputs["seqused_q"] = torch.stack((inputs["seqused_q"], torch.zeros(2, dtype=torch.int32)), dim=1)[:, 0]
    inputs["seqused_k"] = torch.nn.Parameter(inputs["seqused_k"], requires_grad=False)
    assert inputs["seqused_q"].stride(0) == 2
    got = _call(inputs, case, q, k, v)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


# ---------------------------------------------------------------------------
# Bad input: refused before anything runs, each argument named


def _good() -> dict[str, Any]:
    inputs = _inputs(Case(F16, 32, (4, 2), False, NO_WINDOW, 0.0, "none", (3, 0, 5), (4, 6, 0), (2, 0, 5), (4, 1, 0)))
    for name in ("do", "alibi_slopes"):
        inputs.pop(name)
    return inputs


BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("seqused_q", lambda a: [2, 0, 5], TypeError, "seqused_q must be a torch.Tensor of int32 or None, got list"),
    ("seqused_k", lambda a: a["seqused_k"].long(), TypeError, "seqused_k must have dtype torch.int32, got torch.int64"),
    ("seqused_q", lambda a: torch.zeros(4, dtype=torch.int32), ValueError,
     r"seqused_q must have shape \(batch,\) = \(3,\), one used length per sequence, got shape \(4,\)"),
    ("seqused_k", lambda a: a["seqused_k"][None], ValueError, r"seqused_k must have shape \(batch,\) = \(3,\)"),
    ("seqused_q", lambda a: a["seqused_q"].to("meta"), ValueError, "seqused_q is on meta but q is on cpu"),
    ("seqused_q", lambda a: torch.tensor([2, 1, 5], dtype=torch.int32), ValueError,
     r"seqused_q\[1\] = 1: must be in 0..0 \(sequence 1's length in cu_seqlens_q\)"),
    ("seqused_k", lambda a: torch.tensor([4, -1, 0], dtype=torch.int32), ValueError,
     r"seqused_k\[1\] = -1: must be in 0..6"),
    ("seqused_k", lambda a: torch.tensor([5, 1, 0], dtype=torch.int32), ValueError,
     r"seqused_k\[0\] = 5: must be in 0..4 \(sequence 0's length in cu_seqlens_k\)"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_seqused_is_refused_before_anything_runs(no_launch: None, name: str, change: Any,
                                                     error: type[Exception], match: str) -> None:
    assert_refused(_good(), name, change, error, match)


def test_the_ops_check_seqused_too(no_launch: None) -> None:
    from lazytriton.ops_varlen import flash_varlen_bwd_op, flash_varlen_fwd_op

    a = _good()
    rest = (a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6, 0.5, False, -1, -1, 0.0, None, 0.0, None)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 7: must be in 0..4"):
        flash_varlen_fwd_op(a["q"], a["k"], a["v"], *rest, a["seqused_q"], torch.full((3,), 7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seqused_q\[1\] = 9: must be in 0..0"):
        flash_varlen_bwd_op(a["q"], a["q"], a["k"], a["v"], a["q"], torch.zeros(4, 8), *rest,
                            torch.tensor([0, 9, 0], dtype=torch.int32), None)


def test_values_are_not_read_while_tracing_or_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _good()
    bad = torch.tensor([9, 9, 9], dtype=torch.int32)
    # values=False (a capture or a trace): the shapes are checked, the values are the caller's
    vc = varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6, values=False,
                      seqused_q=bad, seqused_k=bad)
    assert vc.used == (True, True) and vc.seqused_q is bad
    with pytest.raises(ValueError, match=r"seqused_q must have shape \(batch,\)"):
        varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6, values=False,
                     seqused_q=bad[:2])
    assert not varlen.reading_values_is_safe(a["cu_seqlens_q"], a["cu_seqlens_k"], bad.to("meta"))
    reads: list[int] = []
    real = varlen.check_values
    monkeypatch.setattr(varlen, "check_values", lambda *args: reads.append(1) or real(*args))
    args = {**a, "seqused_q": bad}
    with pytest.raises(ValueError, match=r"seqused_q\[0\] = 9"):
        lazytriton.flash_attn_varlen_func(**args)
    assert len(reads) == 1, "one read of cu_seqlens and seqused together"
    with lazytriton.trusted_indices():
        varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6, seqused_q=bad)
    assert len(reads) == 1


def test_torch_compile_traces_forward_and_backward_in_one_graph() -> None:
    torch._dynamo.reset()
    case = CASES[2]
    inputs = _inputs(case)
    q, k, v, do = (torch.nan_to_num(inputs[n]) for n in ("q", "k", "v", "do"))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used_q: torch.Tensor,
           used_k: torch.Tensor) -> torch.Tensor:
        out = lazytriton.flash_attn_varlen_func(q * 2, k, v, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
                                                inputs["max_seqlen_q"], inputs["max_seqlen_k"], causal=True,
                                                seqused_q=used_q, seqused_k=used_k)
        return out * 3  # type: ignore[no-any-return]

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got_out = compiled(*leaves, inputs["seqused_q"], inputs["seqused_k"])
    got = torch.autograd.grad(got_out, leaves, do)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = fn(*eager, inputs["seqused_q"], inputs["seqused_k"])
    want = torch.autograd.grad(want_out, eager, do)
    assert torch.equal(got_out, want_out)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


# ---------------------------------------------------------------------------
# Variants, memo keys, plans


SM90 = Target.parse("sm_90")


def test_variants_say_seqused_only_when_set_and_other_strings_are_unchanged() -> None:
    for kernel in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"):
        packed = dispatch.kernel_variant(kernel, SM90, "bf16", 128, True, True, 4096, 4096, varlen=True)
        assert "SEQUSED" not in str(packed)
        for used_q, used_k in ((True, False), (False, True), (True, True)):
            used = dispatch.kernel_variant(kernel, SM90, "bf16", 128, True, True, 4096, 4096, varlen=True,
                                           seqused_q=used_q, seqused_k=used_k)
            text = str(used)
            assert ("SEQUSED_Q=true" in text) == used_q and ("SEQUSED_K=true" in text) == used_k
            assert text.replace(",SEQUSED_Q=true", "").replace(",SEQUSED_K=true", "") == str(packed)
            assert Variant.parse(text) == used and check_fields(used) is used and used.key() != packed.key()
        with pytest.raises(ValueError, match="seqused_q/seqused_k need packed sequences"):
            dispatch.kernel_variant(kernel, SM90, "bf16", 128, True, True, 4096, 4096, seqused_k=True)
    dense = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, True, True, 4096, 4096)
    forged = Variant.parse(str(dense).replace("INDEX64=false", "INDEX64=false,SEQUSED_K=true"))
    with pytest.raises(ValueError, match="SEQUSED_K=true needs VARLEN=true"):
        check_fields(forged)


def test_memo_keys_without_seqused_are_unchanged_and_with_it_marked() -> None:
    a = _good()
    plain = varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6)
    used = varlen.check(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6,
                        seqused_k=a["seqused_k"])
    for key in (varlen.memo_key, varlen.bwd_memo_key):
        assert key(0, torch.float16, used, True, False) == (*key(0, torch.float16, plain, True, False), "seqused",
                                                            False, True)
    assert varlen.memo_key(0, torch.float16, plain, True, False)[-1] != "seqused"
    chosen = varlen.variants(varlen.BACKWARD + varlen.FORWARD, SM90, torch.float16, used, True, False)
    assert all(v.constexprs.get("VARLEN") is True and v.constexprs.get("SEQUSED_K") is True
               and "SEQUSED_Q" not in str(v) for v in chosen)


def test_prewarm_plans_seqused_variants_for_packed_calls_only() -> None:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    kernels = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")
    table = tuning.tables_for(kernels)

    def axes(**flags: tuple[bool, ...]) -> Axes:
        return Axes((SM90,), kernels=kernels, dtypes=("bf16",), head_dims=(128,), causal=(True,), seqlens_q=(4096,),
                    **flags)

    plain = enumerate_variants(axes(varlen=(False, True)), table)
    assert not any("SEQUSED" in str(p.variant) for p in plain)
    used = enumerate_variants(axes(varlen=(False, True), seqused=(False, True)), table)
    texts = {str(p.variant) for p in used}
    assert {str(p.variant) for p in plain} <= texts
    extra = [Variant.parse(t) for t in texts - {str(p.variant) for p in plain}]
    assert all(v.constexprs.get("VARLEN") is True for v in extra)
    for kernel in kernels:  # each of seqused_q, seqused_k and both, for each packed variant of the kernel
        packed = sum(1 for p in plain if p.variant.kernel == kernel and p.variant.constexprs.get("VARLEN") is True)
        assert sum(1 for v in extra if v.kernel == kernel) == 3 * packed
    decode = Axes((SM90,), kernels=("flash_decode_split",), dtypes=("bf16",), head_dims=(128,),
                  varlen=(False, True), seqused=(False, True))
    assert not any("SEQUSED" in str(p.variant)
                   for p in enumerate_variants(decode, tuning.tables_for(("flash_decode_split",))))


def test_prewarm_cli_takes_seqused_with_varlen(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    small = ["--target", "sm_90", "--kernel", "flash_fwd", "--dtype", "bf16", "--head-dim", "64", "--causal",
             "bottom_right", "--seqlen-q", "4096", "--list"]
    assert cli_main(["prewarm", *small, "--varlen", "--seqused"]) == 0
    listed = [Variant.parse(line.split()[2]) for line in capsys.readouterr().out.splitlines()]
    packed = sum(v.constexprs.get("VARLEN") is True and "SEQUSED" not in str(v) for v in listed)
    assert packed and sum(v.constexprs.get("SEQUSED_Q") is True for v in listed) == 2 * packed
    assert sum(v.constexprs.get("SEQUSED_K") is True for v in listed) == 2 * packed
    assert cli_main(["prewarm", *small, "--seqused"]) == 2
    assert "--seqused builds packed-sequence variants" in capsys.readouterr().err


def test_cache_explain_describes_seqused(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    call = ["cache", "explain", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4096", "--target", "sm_90",
            "--causal", "bottom_right", "--varlen", "--seqused-k"]
    assert cli_main(call) == 0
    out = capsys.readouterr().out
    want = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, True, True, 4096, 4096, varlen=True,
                                   seqused_k=True)
    assert f"variant  {want}" in out and "seqused_k (SEQUSED_K=true)" in out
    assert cli_main([*call[:-2], "--seqused-q"]) != 0
    assert "--seqused-q need --varlen" in capsys.readouterr().err


def test_c_api_specs_and_plans_take_seqused() -> None:
    from lazytriton.capi import embedded, embedded_prewarm

    (fwd,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64 varlen=1 seqused_k=1")
    assert fwd.get("SEQUSED_K") is True and "SEQUSED_Q" not in str(fwd)
    dq, dkdv = embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=bf16 head_dim=64 varlen=1 seqused_q=1 "
                                    "seqused_k=1")
    assert all(v.constexprs.get("SEQUSED_Q") is True and v.constexprs.get("SEQUSED_K") is True for v in (dq, dkdv))
    with pytest.raises(ValueError, match="need varlen=1"):
        embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64 seqused_q=1")
    planned = embedded.plan_variant("flash_bwd_dkdv", 90, 2, 64, True, True, False, 300, 257, varlen=True,
                                    seqused=(False, True))
    assert planned == dispatch.kernel_variant("flash_bwd_dkdv", SM90, "bf16", 64, True, True, 300, 257, varlen=True,
                                              seqused_k=True)


# ---------------------------------------------------------------------------
# On the GPU (the lead runs these on the H200)


@on_gpu
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("causal", "window", "softcap", "which"), [
    (False, NO_WINDOW, 0.0, "both"), (True, NO_WINDOW, 0.0, "k"), (True, NO_WINDOW, 0.0, "both"),
    (True, (256, 0), 0.0, "q"), (False, NO_WINDOW, 30.0, "both")])
def test_gpu_seqused(dtype: torch.dtype, head_dim: int, causal: bool, window: tuple[int, int], softcap: float,
                     which: str) -> None:
    gen = torch.Generator().manual_seed(seed_of(dtype, head_dim, causal, window, softcap, which))
    spans_q = tuple(int(n) for n in torch.randint(1, 1500, (7,), generator=gen)) + (1, 0, 2048)
    spans_k = tuple(max(0, n + int(d)) for n, d in zip(spans_q, torch.randint(-64, 900, (10,), generator=gen),
                                                        strict=True))
    used_q = tuple(int(torch.randint(0, n + 1, (1,), generator=gen)) for n in spans_q) if which != "k" else None
    used_k = tuple(int(torch.randint(0, n + 1, (1,), generator=gen)) for n in spans_k) if which != "q" else None
    case = Case(dtype, head_dim, (16, 4), causal, window, softcap, "none", spans_q, spans_k, used_q, used_k)
    inputs = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in _inputs(case).items()}
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _call(inputs, case, *leaves)
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    rows_q = _used_rows(spans_q, case.lengths()[0]).cuda()
    rows_k = _used_rows(spans_k, case.lengths()[1]).cuda()
    assert (out[~rows_q] == 0).all() and torch.isneginf(lse[:, ~rows_q]).all() and (dq[~rows_q] == 0).all()
    assert (dk[~rows_k] == 0).all() and (dv[~rows_k] == 0).all()
    cq, ck = cu(spans_q).tolist(), cu(spans_k).tolist()
    lq, lk = case.lengths()
    for i in (0, 7, 9):  # a few sequences against the float64 reference (all of it: ~1 GiB of scores)
        one = Case(dtype, head_dim, (16, 4), causal, window, softcap, "none", (lq[i],), (lk[i],), None, None)
        parts = [t[a:a + n] for t, a, n in ((q, cq[i], lq[i]), (k, ck[i], lk[i]), (v, ck[i], lk[i]))]
        exact, same = references(_reference(one, None), parts, do[cq[i]:cq[i] + lq[i]])
        check_rule("out", out[cq[i]:cq[i] + lq[i]], exact.out, same.out, OUT_FLOOR[dtype], 2)
        got = (dq[cq[i]:cq[i] + lq[i]], dk[ck[i]:ck[i] + lk[i]], dv[ck[i]:ck[i] + lk[i]])
        for name, g, x, s in zip(("dq", "dk", "dv"), got, exact.grads, same.grads, strict=True):
            check_rule(name, g, x, s, GRAD_FLOOR[dtype], 3)
