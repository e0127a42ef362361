"""``flash_attn_with_kvcache`` (issue 11, part 2): decoding from a contiguous or paged KV cache, forward only.

Numerics follow FlashAttention's rule, as the other kernel tests do: out and
lse may be at most twice as far from a float64 reference as the same-dtype
PyTorch reference is, plus a small floor. The reference
(``kernels/flash_decode/reference.py``) is FlashAttention-2's
``test_flash_attn_kvcache`` written out one sequence at a time. On CPU the
kernels run through Triton's interpreter over a covering design of that
test's matrix, reduced: one query and a few; new k/v or none; contiguous,
with cache_batch_idx, or paged with random block tables of 16- and 32-key
pages; cache_seqlens from 0 to the cache's end (tensor, int or None);
causal, windows, softcap and ALiBi; MHA, GQA and MQA; fp16, bf16, fp32; head
dims 64, 128 and 40; split counts from the heuristic and forced. The keys
and values appended must land exactly where FlashAttention-2 puts them, and
bad input must raise before anything is written into the cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import gpu
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, seed_of

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode import values as index_values
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEADS = ((4, 2), (4, 1), (2, 2), (6, 3))
CONTIGUOUS_LEN = 50  # not a multiple of the interpreter's 16-key tiles


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_dim: int
    seqlen_q: int
    heads: tuple[int, int]
    new: int  # 0: no k/v
    layout: str  # "contiguous", "batch_idx", "page16", "page32"
    lens: str  # "tensor", "int", "none"
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi: str  # "", "heads", "batch"
    splits: int

    def __str__(self) -> str:
        return (f"{checks.DTYPES[self.dtype]}-d{self.head_dim}-q{self.seqlen_q}-h{self.heads[0]}_{self.heads[1]}"
                f"-new{self.new}-{self.layout}-lens_{self.lens}-causal{int(self.causal)}-w{self.window[0]}_"
                f"{self.window[1]}-cap{self.softcap}-alibi_{self.alibi or 'no'}-s{self.splits}")


def covering_cases(n: int = 30) -> list[Case]:
    """Every option of each axis several times, in varied company (moduli mostly coprime)."""
    windows = ((-1, -1), (-1, -1), (9, 0), (20, 3), (-1, 5))
    cases = []
    for i in range(n):
        new = (0, 1, 3)[i % 3]
        lens = ("tensor", "tensor", "int", "none")[i % 4]
        if lens == "none":
            new = 0  # new keys need cache_seqlens
        cases.append(Case(DTYPES[i % 3], (64, 128, 40, 64)[i % 4], (1, 1, 4)[i % 3 if i % 2 else (i // 2) % 3],
                          HEADS[i % 4], new, ("contiguous", "page16", "batch_idx", "page32", "page16")[i % 5], lens,
                          bool(i % 2), windows[i % 5], (0.0, 0.0, 2.0)[i % 3 if i % 5 else 2],
                          ("", "heads", "", "batch")[(i // 3) % 4], (0, 1, 3, 0, 6)[(i + 1) % 5]))
    return cases


CASES = covering_cases()


def make_inputs(case: Case, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """A call's arguments: random data; random block tables over 3x the pages needed; lengths 0 and the end."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    hq, hk = case.heads
    d = case.head_dim
    args: dict[str, Any] = {"q": randn(batch, case.seqlen_q, hq, d)}
    if case.layout.startswith("page"):
        page = int(case.layout[4:])
        max_blocks = 64 // page
        num_blocks = 3 * batch * max_blocks
        args["k_cache"], args["v_cache"] = randn(num_blocks, page, hk, d), randn(num_blocks, page, hk, d)
        perm = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks]
        args["block_table"] = perm.reshape(batch, max_blocks).to(torch.int32)
        capacity = max_blocks * page
    else:
        rows = 2 * batch if case.layout == "batch_idx" else batch
        args["k_cache"], args["v_cache"] = randn(rows, CONTIGUOUS_LEN, hk, d), randn(rows, CONTIGUOUS_LEN, hk, d)
        if case.layout == "batch_idx":
            args["cache_batch_idx"] = torch.randperm(rows, generator=gen)[:batch].to(torch.int32)
        capacity = CONTIGUOUS_LEN
    if case.new:
        args["k"], args["v"] = randn(batch, case.new, hk, d), randn(batch, case.new, hk, d)
    top = capacity - case.new
    if case.lens == "tensor":
        values = [int(torch.randint(0, top + 1, (1,), generator=gen)) for _ in range(batch)]
        values[seed % batch] = (0, top)[seed % 2]  # the ends: an empty cache, a full one
        args["cache_seqlens"] = torch.tensor(values, dtype=torch.int32)
    elif case.lens == "int":
        args["cache_seqlens"] = int(torch.randint(0, top + 1, (1,), generator=gen))
    if case.alibi:
        shape = (hq,) if case.alibi == "heads" else (batch, hq)
        args["alibi_slopes"] = torch.rand(shape, generator=gen) * 0.3
    return args


def options(case: Case) -> dict[str, Any]:
    return {"causal": case.causal, "window_size": case.window, "softcap": case.softcap}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def check_against_reference(args: dict[str, Any], got: tuple[torch.Tensor, ...], **opts: Any) -> None:
    """FlashAttention's rule for out and lse, and the caches (after the append) bitwise equal to the reference's."""
    out, lse, k_cache, v_cache = got
    wide = {name: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() and name != "alibi_slopes"
                   else t) for name, t in args.items()}
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**wide, **opts)
    same_out, same_lse, same_k, same_v = kvcache_reference(**args, **opts)
    assert torch.equal(k_cache, same_k) and torch.equal(v_cache, same_v), "the new keys/values landed elsewhere"
    assert torch.equal(same_k.double(), ref_k) and torch.equal(same_v.double(), ref_v)
    check_out_lse((out, lse), (ref_out, ref_lse), (same_out, same_lse))


def check_out_lse(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor],
                  same: tuple[torch.Tensor, torch.Tensor]) -> None:
    """FlashAttention's rule for (out, lse) against the float64 reference ``ref`` and the same-dtype one ``same``."""
    (out, lse), (ref_out, ref_lse), (same_out, same_lse) = got, ref, same
    floor = OUT_FLOOR[out.dtype] * max(1.0, float(ref_out.abs().max()) if ref_out.numel() else 0.0)
    out_err, same_err = max_err(out, ref_out), max_err(same_out, ref_out)
    assert out_err <= 2 * same_err + floor, f"out: max error {out_err:.3g} > 2 x {same_err:.3g} + {floor:.3g}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows without keys must have lse -inf, and only they"
    assert torch.equal(out.double()[~seen.transpose(1, 2)], torch.zeros_like(out.double()[~seen.transpose(1, 2)]))
    lse_err, same_lse_err = max_err(lse[seen], ref_lse[seen]), max_err(same_lse[seen], ref_lse[seen])
    lse_floor = LSE_FLOOR * max(1.0, float(ref_lse[seen].abs().max()) if seen.any() else 0.0)
    assert lse_err <= 2 * same_lse_err + lse_floor, f"lse: max error {lse_err:.3g} > 2 x {same_lse_err:.3g}"


def run(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, ...]:
    """The call on copies of the caches: (out, lse, k_cache, v_cache after the call)."""
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **opts, return_softmax_lse=True)
    return out, lse, mine["k_cache"], mine["v_cache"]


# ---------------------------------------------------------------------------
# Numerics on CPU, through Triton's interpreter


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kvcache_cpu(case: Case) -> None:
    args = make_inputs(case, seed=seed_of(str(case)))
    got = run(args, **options(case), num_splits=case.splits)
    check_against_reference(args, got, **options(case))


def test_the_covering_design_covers_every_option() -> None:
    for axis, values in (("dtype", DTYPES), ("head_dim", (64, 128, 40)), ("seqlen_q", (1, 4)), ("heads", HEADS),
                         ("new", (0, 1, 3)), ("layout", ("contiguous", "batch_idx", "page16", "page32")),
                         ("lens", ("tensor", "int", "none")), ("causal", (False, True)),
                         ("softcap", (0.0, 2.0)), ("alibi", ("", "heads", "batch")), ("splits", (0, 1, 3, 6))):
        assert {getattr(c, axis) for c in CASES} == set(values), axis
    assert {c.window for c in CASES} == {(-1, -1), (9, 0), (20, 3), (-1, 5)}
    assert any(c.seqlen_q > 1 and c.causal and c.new for c in CASES)
    assert any(c.layout.startswith("page") and c.new and c.lens == "tensor" for c in CASES)


def test_split_counts_give_the_same_result() -> None:
    case = Case(torch.float32, 64, 2, (4, 2), 1, "page16", "tensor", True, (-1, -1), 0.0, "batch", 1)
    args = make_inputs(case, batch=3, seed=5)
    args["cache_seqlens"] = torch.tensor([62, 17, 40], dtype=torch.int32)
    results = [run(args, causal=True, num_splits=n) for n in (1, 2, 3, 7)]
    for out, lse, k_cache, _ in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-6, atol=1e-6)
        assert torch.equal(k_cache, results[0][2])
    check_against_reference(args, results[2], causal=True)


def test_an_empty_cache_and_a_full_one() -> None:
    case = Case(torch.float16, 64, 1, (2, 1), 0, "contiguous", "tensor", False, (-1, -1), 0.0, "", 2)
    args = make_inputs(case)
    args["cache_seqlens"] = torch.tensor([0, CONTIGUOUS_LEN], dtype=torch.int32)
    out, lse, _, _ = got = run(args, num_splits=2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    check_against_reference(args, got)


def test_block_table_entries_past_a_sequence_are_never_read() -> None:
    case = Case(torch.float32, 64, 1, (2, 2), 1, "page16", "tensor", False, (-1, -1), 0.0, "", 0)
    args = make_inputs(case)
    args["cache_seqlens"] = torch.tensor([3, 20], dtype=torch.int32)  # pages 0, and 0-1, after the append
    args["block_table"][0, 1:] = -1
    args["block_table"][1, 2:] = 10**6
    check_against_reference(args, run(args))


def test_noncontiguous_q_and_cache_views() -> None:
    case = Case(torch.float32, 64, 3, (4, 2), 2, "contiguous", "tensor", True, (-1, -1), 0.0, "", 0)
    args = make_inputs(case)
    wide = torch.randn(2, 3, 4, 128)
    args["q"] = wide[..., ::1][..., :64]  # strided heads and tokens, contiguous last dim
    big_k, big_v = torch.randn(2, CONTIGUOUS_LEN, 4, 64), torch.randn(2, CONTIGUOUS_LEN, 4, 64)
    out, lse = lazytriton.flash_attn_with_kvcache(args["q"], big_k[:, :, ::2], big_v[:, :, 1::2], args["k"], args["v"],
                                                  cache_seqlens=args["cache_seqlens"], causal=True,
                                                  return_softmax_lse=True)
    ref_out, ref_lse, ref_k, _ = kvcache_reference(args["q"].double(), big_k[:, :, ::2].double(),
                                                   big_v[:, :, 1::2].double(), args["k"].double(),
                                                   args["v"].double(), args["cache_seqlens"], causal=True)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    assert torch.equal(big_k[:, :, ::2].double(), ref_k), "the append went through the view"
    assert out.is_contiguous() and out.shape == args["q"].shape and lse.shape == (2, 4, 3)


def test_the_op_and_torch_compile_trace_the_append_and_the_attention() -> None:
    torch._dynamo.reset()
    case = Case(torch.float32, 64, 1, (4, 2), 1, "page16", "tensor", False, (-1, -1), 0.0, "", 2)
    args = make_inputs(case, seed=3)

    def step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        out = lazytriton.flash_attn_with_kvcache(q * 2, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                 block_table=table, num_splits=2)
        return out * 3  # type: ignore[no-any-return]

    inputs = (args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
              args["block_table"])
    eager_k, eager_v = args["k_cache"].clone(), args["v_cache"].clone()
    want = step(args["q"], eager_k, eager_v, *inputs[3:])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(args["k_cache"], eager_k) and torch.equal(args["v_cache"], eager_v)
    op_k, op_v = args["k_cache"].clone(), args["v_cache"].clone()
    op_out, _ = torch.ops.lazytriton.flash_kvcache(args["q"] * 2, op_k, op_v, args["k"], args["v"],
                                                   args["cache_seqlens"], -1, None, args["block_table"], 0.125,
                                                   False, -1, -1, 0.0, None, 2)
    torch.testing.assert_close(op_out * 3, want, rtol=0, atol=0)


def test_a_compiled_read_copies_no_cache() -> None:
    """Without k/v the call goes to the read-only op: the traced graph neither clones nor writes back a cache."""
    torch._dynamo.reset()
    case = Case(torch.float32, 64, 1, (4, 2), 0, "page16", "tensor", False, (-1, -1), 0.0, "", 1)
    args = make_inputs(case, seed=4)
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._dynamo.backends.common import aot_autograd

        def keep(g: torch.fx.GraphModule, _: Any) -> torch.fx.GraphModule:
            graphs.append(str(g.graph))
            return g

        return aot_autograd(fw_compiler=keep)(gm, example_inputs)

    def read(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: torch.Tensor,
             table: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,  # type: ignore[no-any-return]
                                                 block_table=table)

    inputs = (args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], args["block_table"])
    got = torch.compile(read, fullgraph=True, backend=backend)(*inputs)
    torch.testing.assert_close(got, read(*inputs), rtol=0, atol=0)
    assert len(graphs) == 1 and "lazytriton.flash_kvcache_read" in graphs[0]
    assert "clone" not in graphs[0] and "copy_" not in graphs[0], graphs[0]


def _picked_rows(args: dict[str, Any], rows: list[int], table_rows: int,
                 bad_block: tuple[int, int] | None = None) -> dict[str, Any]:
    """The call with its block table spread over a ``table_rows``-row table, sequence b's at row rows[b]
    (cache_batch_idx); the other rows point past the cache (never read); ``bad_block``: an entry set past it."""
    table = torch.full((table_rows, args["block_table"].shape[1]), 10**6, dtype=torch.int32)
    table[rows] = args["block_table"]
    if bad_block is not None:
        table[bad_block] = args["k_cache"].shape[0]
    return {**args, "block_table": table, "cache_batch_idx": torch.tensor(rows, dtype=torch.int32)}


@pytest.mark.parametrize(("layout", "new", "splits", "dtype"),
                         [("page16", 3, 3, torch.float32), ("page5", 2, 2, torch.float16), ("page16", 0, 1,
                                                                                          torch.bfloat16)])
def test_cache_batch_idx_picks_each_sequences_row_of_the_block_table(layout: str, new: int, splits: int,
                                                                      dtype: torch.dtype) -> None:
    # FlashAttention-3's: with a block table, cache_batch_idx[b] is sequence b's row of the table (which may have
    # any number of rows); the new keys land in that row's blocks, and the attention reads them.
    case = Case(dtype, 64, 2, (4, 2), new, layout, "tensor", True, (-1, -1), 0.0, "", splits)
    args = _picked_rows(make_inputs(case, batch=3, seed=11), [4, 0, 2], 6)
    got = run(args, causal=True, num_splits=splits)
    check_against_reference(args, got, causal=True)
    plain = {k: v for k, v in args.items() if k != "cache_batch_idx"}
    plain["block_table"] = args["block_table"][[4, 0, 2]].contiguous()
    same = run(plain, causal=True, num_splits=splits)
    for a, b in zip(got, same, strict=True):
        assert torch.equal(a, b), "a picked row must give the call on that row's table"


# ---------------------------------------------------------------------------
# Bad input: an error naming the argument, before anything is written or launched


def _valid() -> dict[str, Any]:
    case = Case(torch.float16, 64, 1, (4, 2), 1, "page16", "tensor", False, (-1, -1), 0.0, "", 0)
    return make_inputs(case)


def _contiguous_valid() -> dict[str, Any]:
    case = Case(torch.float16, 64, 1, (4, 2), 1, "batch_idx", "tensor", False, (-1, -1), 0.0, "", 0)
    return make_inputs(case)


def _set(name: str, fn: Any) -> Any:
    return lambda a: {**a, name: fn(a)}


BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("seqlens_int64", _set("cache_seqlens", lambda a: a["cache_seqlens"].long()), TypeError, "cache_seqlens"),
    ("seqlens_shape", _set("cache_seqlens", lambda a: a["cache_seqlens"][:1]), ValueError, "cache_seqlens"),
    ("seqlens_past_end", _set("cache_seqlens", lambda a: torch.tensor([0, 64], dtype=torch.int32)), ValueError,
     r"cache_seqlens\[1\] = 64"),
    ("seqlens_negative", _set("cache_seqlens", lambda a: torch.tensor([-1, 0], dtype=torch.int32)), ValueError,
     r"cache_seqlens\[0\] = -1"),
    ("seqlens_int_past_end", _set("cache_seqlens", lambda a: 64), ValueError,
     r"cache_seqlens must be in 0..63 \(block_table's 4 pages of 16 keys hold 64 keys per sequence, 1 of them new\), "
     r"got 64"),
    ("seqlens_float", _set("cache_seqlens", lambda a: 3.0), TypeError, "cache_seqlens"),
    ("table_int64", _set("block_table", lambda a: a["block_table"].long()), TypeError, "block_table"),
    ("table_1d", _set("block_table", lambda a: a["block_table"][0]), ValueError, "block_table"),
    ("table_past_cache", _set("block_table", lambda a: a["block_table"].index_fill(1, torch.tensor([0]), 24)),
     ValueError, r"block_table\[0, 0\] = 24 points past the cache"),
    ("table_negative", _set("block_table", lambda a: a["block_table"].index_fill(1, torch.tensor([0]), -1)),
     ValueError, "points past the cache"),
    ("page_empty", lambda a: {**a, "k_cache": a["k_cache"][:, :0], "v_cache": a["v_cache"][:, :0]}, ValueError,
     "the page size and must be >= 1"),
    ("k_heads", lambda a: {**a, "k": a["k"][:, :, :1], "v": a["v"][:, :, :1]}, ValueError, "k must have shape"),
    ("k_without_v", _set("v", lambda a: None), ValueError, "k and v"),
    ("k_dtype", _set("k", lambda a: a["k"].float()), TypeError, "k has dtype"),
    ("v_shape", _set("v", lambda a: a["v"][:, :, :, :32]), ValueError,
     r"v must have shape \(2, 1, 2, 64\) \(k's batch, seqlen_new and heads, and v_cache's head dim\)"),
    ("v_seqlen", _set("v", lambda a: a["v"][:, :0]), ValueError, r"v must have shape \(2, 1, 2, 64\)"),
    ("k_without_seqlens", _set("cache_seqlens", lambda a: None), ValueError, "k and v need cache_seqlens"),
    ("q_heads", _set("q", lambda a: a["q"][:, :, :3]), ValueError, "multiple of k_cache heads"),
    ("q_head_dim", _set("q", lambda a: a["q"][..., :32]), ValueError, "head dim"),
    ("q_dtype", _set("q", lambda a: a["q"].float()), TypeError, "k_cache has dtype"),
    ("q_rank", _set("q", lambda a: a["q"][0]), ValueError, "q must have 4 dims"),
    ("cache_shapes", _set("v_cache", lambda a: a["v_cache"][:-1]), ValueError, "v_cache must have k_cache's first"),
    ("head_dim_v_mismatch", _set("v_cache", lambda a: a["v_cache"][..., :32]), ValueError,
     r"v must have shape \(2, 1, 2, 32\) \(k's batch, seqlen_new and heads, and v_cache's head dim\), got "
     r"\(2, 1, 2, 64\)"),
    ("head_dim_v_too_big", _set("v_cache", lambda a: torch.zeros(*a["v_cache"].shape[:3], 520,
                                                                  dtype=a["v_cache"].dtype)), ValueError,
     r"v_cache's head dim \(head_dim_v, v_cache.shape\[-1\]\) must be in 1..512, got 520"),
    ("window_below_minus_one", lambda a: {**a, "window_size": (-2, 0)}, ValueError, "window_size"),
    ("window_not_pair", lambda a: {**a, "window_size": 3}, TypeError, "window_size"),
    ("softcap_negative", lambda a: {**a, "softcap": -1.0}, ValueError, "softcap"),
    ("softcap_nan", lambda a: {**a, "softcap": float("nan")}, ValueError, "softcap"),
    ("scale_str", lambda a: {**a, "softmax_scale": "0.1"}, TypeError, "softmax_scale"),
    ("causal_int", lambda a: {**a, "causal": 1}, TypeError, "causal"),
    ("alibi_float16", lambda a: {**a, "alibi_slopes": torch.ones(4, dtype=torch.float16)}, TypeError, "alibi_slopes"),
    ("alibi_shape", lambda a: {**a, "alibi_slopes": torch.ones(2)}, ValueError, "alibi_slopes"),
    ("splits_negative", lambda a: {**a, "num_splits": -1}, ValueError, "num_splits"),
    ("splits_bool", lambda a: {**a, "num_splits": True}, TypeError, "num_splits"),
    ("splits_huge", lambda a: {**a, "num_splits": 10**6}, ValueError, "num_splits"),
    ("lse_flag", lambda a: {**a, "return_softmax_lse": 1}, TypeError, "return_softmax_lse"),
    ("rotary_cos_alone", lambda a: {**a, "rotary_cos": torch.ones(64, 16, dtype=torch.float16)}, ValueError,
     "rotary_cos and rotary_sin must be given together, got only rotary_cos"),
    ("rotary_sin_alone", lambda a: {**a, "rotary_sin": torch.ones(64, 16, dtype=torch.float16)}, ValueError,
     "got only rotary_sin"),
    ("unknown_kwarg", lambda a: {**a, "dropout_p": 0.1}, TypeError, "unexpected keyword argument 'dropout_p'"),
    ("table_rows_without_batch_idx", _set("block_table", lambda a: a["block_table"].repeat(2, 1)), ValueError,
     "block_table has 4 rows but q has batch 2; pass cache_batch_idx"),
    ("table_batch_idx_past_rows", _set("cache_batch_idx", lambda a: torch.tensor([0, 2], dtype=torch.int32)),
     ValueError, r"cache_batch_idx\[1\] = 2: must be in 0..1 \(block_table's rows\)"),
    ("table_batch_idx_shape", _set("cache_batch_idx", lambda a: torch.zeros(3, dtype=torch.int32)), ValueError,
     "cache_batch_idx must have shape"),
    ("table_picked_row_past_cache", lambda a: _picked_rows(a, [0, 2], 3, bad_block=(2, 0)), ValueError,
     r"block_table\[2, 0\] = 24 points past the cache: .* sequence 1 \(its row, cache_batch_idx\[1\]\)"),
]
BAD_CONTIGUOUS: list[tuple[str, Any, type[Exception], str]] = [
    ("batch_idx_past_cache", _set("cache_batch_idx", lambda a: torch.tensor([0, 4], dtype=torch.int32)), ValueError,
     r"cache_batch_idx\[1\] = 4"),
    ("batch_idx_int64", _set("cache_batch_idx", lambda a: a["cache_batch_idx"].long()), TypeError,
     "cache_batch_idx"),
    ("cache_batch_without_idx", _set("cache_batch_idx", lambda a: None), ValueError, "pass cache_batch_idx"),
    ("seqlens_past_contiguous_end", _set("cache_seqlens", lambda a: torch.tensor([50, 3], dtype=torch.int32)),
     ValueError, r"cache_seqlens\[0\] = 50: must be in 0..49"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"),
                         [(*b, ) for b in BAD] + [(f"contiguous-{n}", c, e, m) for n, c, e, m in BAD_CONTIGUOUS],
                         ids=[b[0] for b in BAD] + [f"contiguous-{b[0]}" for b in BAD_CONTIGUOUS])
def test_bad_input_is_refused_before_anything_runs(name: str, change: Any, error: type[Exception], match: str,
                                                   no_launch: None) -> None:
    base = _contiguous_valid() if name.startswith("contiguous-") else _valid()
    args = change(base)
    before = {n: t.clone() for n, t in args.items() if n in ("k_cache", "v_cache") and isinstance(t, torch.Tensor)}
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_with_kvcache(**args)
    for n, t in before.items():
        assert torch.equal(args[n], t), f"{n} was written despite the error"


def test_rotary_arguments_at_their_defaults_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def forward(t: checks.Inputs, call: checks.Call, *rest: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(call)
        return t.q, t.q

    monkeypatch.setattr(binding, "forward", forward)
    lazytriton.flash_attn_with_kvcache(**_valid())
    lazytriton.flash_attn_with_kvcache(**_valid(), rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                                       rotary_seqlens=None)
    lazytriton.flash_attn_with_kvcache(**_valid(), rotary_interleaved=False)  # read only with rotary_cos
    assert seen[0] == seen[1] == seen[2] and not seen[0].rotary


def test_trusted_indices_skip_the_value_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(index_values, "check_values", lambda t, call, names: calls.append(call))
    monkeypatch.setattr(binding, "run_interpreter", lambda *a, **kw: None)
    lazytriton.flash_attn_with_kvcache(**_valid())
    with lazytriton.kvcache.trusted_indices():
        lazytriton.flash_attn_with_kvcache(**_valid())
    lazytriton.flash_attn_with_kvcache(**_valid())
    assert len(calls) == 2


# ---------------------------------------------------------------------------
# Pure parts: splits, variants, argument layout


def test_split_heuristic_fills_the_gpu() -> None:
    sms = 132  # an H200
    assert binding.choose_splits(128, 512, sms) == 1  # 128 programs fill 80% of the SMs already
    assert binding.choose_splits(8, 1, sms) == 1  # nothing to split
    for programs, blocks in ((1, 16), (8, 512), (32, 64), (64, 16), (40, 512)):
        n = binding.choose_splits(programs, blocks, sms)
        assert 1 <= n <= min(blocks, binding.MAX_HEURISTIC_SPLITS)
        waves = programs * n / sms
        assert waves / -(-waves // 1) >= 0.85 * max(
            programs * m / sms / -(-(programs * m / sms) // 1) for m in range(1, min(blocks, sms) + 1)
            if m == 1 or -(-blocks // m) != -(-blocks // (m - 1)))
    # 8 x 16 = 128 of 132 SMs is the best (0.97 of a wave); 8 x 14 = 112 (0.85) is the first within 85% of it.
    assert binding.choose_splits(8, 512, sms) == 14
    assert binding.choose_splits(1, 16, sms) == 16  # one program: as many splits as blocks


def test_forced_splits_are_capped_by_the_partials_size() -> None:
    call = checks.Call(2, 4, 2, 1, 64, 0, 64, 0, 2, 64, False, 0.125, num_splits=5)
    assert binding.splits_for(call, 16, 16, 132) == 5
    huge = call._replace(batch=1024, heads_q=64, seqlen_q=64, head_dim=128, num_splits=256)
    assert binding.splits_for(huge, 16, 16, 132) == 3  # 3 x 1024 x 64 x 64 x 128 < 2**31 <= 4 x ...


@pytest.mark.parametrize(("rows", "page", "head_dim", "dtype", "block_m", "block_n"),
                         [(4, 0, 128, "bf16", 16, 64), (32, 256, 128, "bf16", 32, 64), (33, 16, 64, "fp16", 64, 64),
                          (1, 32, 256, "bf16", 16, 32), (8, 48, 128, "fp16", 16, 64), (8, 0, 64, "fp32", 16, 32),
                          (4, 192, 64, "bf16", 16, 64)])
def test_decode_configs_fit_the_rows_and_the_page(rows: int, page: int, head_dim: int, dtype: str, block_m: int,
                                                  block_n: int) -> None:
    cfg = decode_dispatch.decode_default_config("flash_decode_split", Target.parse("sm_90"), dtype, head_dim, rows,
                                                page, paged=page > 0)
    assert (cfg.block_m, cfg.block_n) == (block_m, block_n)
    assert cfg.num_stages == (5 if page else 3)  # the block table's read takes a pipeline stage of its own
    if page and not decode_dispatch.page_gather(page):  # a gathered page (16, 48) caps nothing
        assert page % cfg.block_n == 0


def test_decode_variants_write_flags_only_when_set() -> None:
    sm90 = Target.parse("sm_90")
    plain = decode_dispatch.decode_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, 4096)
    # The tile comes from kernels/flash_decode/tuning.csv's H200 row for this shape, when it has one.
    assert str(plain).startswith("flash_decode_split:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
                                 "INDEX64=false:BLOCK_M=16,")
    every = decode_dispatch.decode_variant("flash_decode_split", sm90, "fp16", 40, True, False, 8, 100, page_size=16,
                                           paged=True, window=True, softcap=True, alibi=True)
    assert {name for name, value in every.functional if value is True} >= {"PAGED", "WINDOW", "SOFTCAP", "ALIBI",
                                                                            "PAGE_GATHER"}
    assert every.get("BLOCK_N") == 64 and every.get("EVEN_D") is False and every.get("BLOCK_D") == 64
    combine = decode_dispatch.decode_variant("flash_decode_combine", sm90, "bf16", 128, True, True, 4, 4096, paged=True)
    assert "CAUSAL" not in dict(combine.functional) and "PAGED" not in dict(combine.functional)
    for v in (plain, every, combine):
        assert check_fields(Variant.parse(str(v))) == v
    assert dispatch.kernel_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, 4096, paged=True) == \
        decode_dispatch.decode_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, 4096, paged=True)


def test_one_query_shares_the_non_causal_binary() -> None:
    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      None, args["block_table"])
    assert checks.check(t, causal=True).causal is False
    t2 = t._replace(q=torch.cat([args["q"], args["q"]], dim=1))
    assert checks.check(t2, causal=True).causal is True


def test_argument_layout_covers_every_parameter() -> None:
    from lazytriton.kernels.flash_decode import FLASH_DECODE_COMBINE, FLASH_DECODE_SPLIT

    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      None, args["block_table"])
    call = checks.check(t)
    out, lse = binding.empty_outputs(args["q"], call)
    ints = binding.split_ints(t, out, lse, lse, lse, call, 3)
    assert len(ints) + 2 == len(FLASH_DECODE_SPLIT.params)
    named = dict(zip(binding.SPLIT_INT_PARAMS, ints, strict=True))
    assert named["Q"] == args["q"].data_ptr() and named["BlockTable"] == args["block_table"].data_ptr()
    assert named["stride_ks"] == args["k_cache"].stride(1) and named["page_size"] == 16
    assert named["use_seqlens"] == 1 and named["use_batch_idx"] == 0 and named["num_splits"] == 3
    comb = binding.combine_ints(lse, lse, out, lse, call, 3)
    assert len(comb) == len(FLASH_DECODE_COMBINE.params)


def test_import_lazytriton_stays_light() -> None:
    from conftest import run_python

    code = ("import sys, lazytriton; f = lazytriton.flash_attn_with_kvcache; "
            "print('triton' in sys.modules, 'lazytriton.kvcache_op' in sys.modules)")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------------------
# On the GPU (run on the H200)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kvcache_gpu(case: Case) -> None:
    args = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in make_inputs(case, batch=3).items()}
    out, lse, k_cache, v_cache = run(args, **options(case), num_splits=case.splits)
    cpu = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    check_against_reference(cpu, (out.cpu(), lse.cpu(), k_cache.cpu(), v_cache.cpu()), **options(case))


def serving_cache(batch: int, capacity: int, paged: bool, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(k_cache, block_table) of the serving GPU tests: 8 key/value heads, head dim 128, bf16; paged: pages of 256
    keys in a random order (``capacity`` a multiple of 256), else contiguous."""
    if paged:
        blocks = batch * capacity // 256
        k_cache = torch.randn(blocks, 256, 8, 128, device="cuda", generator=gen).bfloat16()
        return k_cache, torch.randperm(blocks, device="cuda", generator=gen).reshape(batch, -1).int()
    return torch.randn(batch, capacity, 8, 128, device="cuda", generator=gen).bfloat16(), None


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("paged", "batch", "length"), list(itertools.product((False, True), (1, 16), (1000, 8192))))
def test_kvcache_gpu_decode_shapes(paged: bool, batch: int, length: int) -> None:
    """Serving shapes (32/8 heads, head dim 128, bf16, pages of 256): heuristic splits against forced 1."""
    gen = torch.Generator(device="cuda").manual_seed(batch + length)
    q = torch.randn(batch, 1, 32, 128, device="cuda", generator=gen).bfloat16()
    capacity = 8192
    k_cache, table = serving_cache(batch, capacity, paged, gen)
    v_cache = torch.randn_like(k_cache)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    got = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
    one = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=1)
    torch.testing.assert_close(got, one, rtol=2e-2, atol=2e-2)
    args = {"q": q.cpu(), "k_cache": k_cache.cpu(), "v_cache": v_cache.cpu(), "cache_seqlens": lens.cpu(),
            "block_table": None if table is None else table.cpu()}
    ref = kvcache_reference(**{n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for n, t in args.items()})[0]
    torch.testing.assert_close(got.cpu().double(), ref, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.gpu
def test_kvcache_gpu_cuda_graph() -> None:
    """A decode step (append + attention, several splits) captured once, replayed with new lengths."""
    q = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(4, 2048, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(4, 1, 2, 128, device="cuda", dtype=torch.bfloat16), torch.randn(4, 1, 2, 128, device="cuda",
                                                                                         dtype=torch.bfloat16)
    lens = torch.tensor([0, 10, 100, 1000], dtype=torch.int32, device="cuda")
    lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, num_splits=4)  # load
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, num_splits=4)
    lens.copy_(torch.tensor([1, 11, 101, 1001], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = lazytriton.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), cache_seqlens=lens + 1,
                                              num_splits=1)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-2)


@pytest.mark.parametrize("lengths", [9, torch.tensor([3, 9], dtype=torch.int32)], ids=["int", "tensor"])
def test_lengths_past_a_contiguous_cache_name_the_caches_rows(lengths: Any) -> None:
    q = torch.randn(2, 1, 2, 16, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 8, 2, 16, dtype=torch.float16) for _ in range(2))
    shown = r"\[1\] = 9" if isinstance(lengths, torch.Tensor) else ""
    with pytest.raises(ValueError, match=rf"cache_seqlens{shown}:? must be in 0\.\.8 \(the cache holds 8 keys per "
                                         r"sequence, 0 of them new\)"):
        lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
