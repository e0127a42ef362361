"""Queries packed by cu_seqlens_q over a KV cache: a serving engine's mixed batch of prefills and decodes in one call.

``flash_attn_with_kvcache(q, ..., cu_seqlens_q=, max_seqlen_q=)`` (FlashAttention-3's names) and
``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, seqused_k=,
block_table=)`` (vLLM's calling convention) run the decoding kernels with VARLEN_Q=true: sequence b's queries
are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q, aligned bottom-right against its own key count.
Numerics follow FlashAttention's rule against a float64 reference (``varlen_q_reference``: each sequence a call
of its own) on CPU through Triton's interpreter: a prefill of several queries, decodes of one, an empty sequence;
paged (pages of 16 and of 5 keys) and contiguous caches; GQA; causal or not, windows, softcap, ALiBi, sinks, new
keys appended; one split and several. The packed call must equal each sequence run alone, bad input must raise
before anything is written, and variant strings and memo keys of calls without packed queries stay as they were.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import gpu
from test_flash_fwd import seed_of
from test_kvcache import check_out_lse, max_err

import lazytriton
from lazytriton.kernels.flash_decode import binding, checks, values
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.reference import varlen_q_reference
from lazytriton.prewarm.enumeration import Axes, enumerate_variants, variants_from_misses
from lazytriton.record import replace
from lazytriton.target import Target
from lazytriton.tuning import Table
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

QUERIES = (5, 1, 0, 1, 3)  # a prefill of 5, decodes of 1, an empty sequence, a chunk of 3
CAPACITY = 40  # keys a sequence may hold: a contiguous cache's length, or pages x page size (rounded up)


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    heads: tuple[int, int]
    layout: str  # "contiguous", "batch_idx", "page16", "page5"
    new: int  # new keys appended per sequence (0: none)
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi: bool
    splits: int

    def __str__(self) -> str:
        return (f"{checks.DTYPES[self.dtype]}-h{self.heads[0]}_{self.heads[1]}-{self.layout}-new{self.new}-"
                f"causal{int(self.causal)}-w{self.window[0]}_{self.window[1]}-cap{self.softcap}-"
                f"alibi{int(self.alibi)}-s{self.splits}")


CASES = [
    Case(torch.float32, (4, 2), "page16", 0, True, (-1, -1), 0.0, False, 1),
    Case(torch.float16, (4, 2), "page5", 2, True, (-1, -1), 0.0, False, 3),
    Case(torch.bfloat16, (4, 1), "contiguous", 1, False, (-1, -1), 0.0, True, 0),
    Case(torch.float32, (2, 2), "batch_idx", 0, True, (6, 0), 0.0, False, 2),
    Case(torch.float16, (6, 3), "page16", 3, False, (7, 2), 2.0, False, 1),
    Case(torch.bfloat16, (4, 2), "page5", 0, False, (-1, -1), 1.5, True, 4),
    Case(torch.float32, (4, 1), "contiguous", 2, True, (-1, -1), 3.0, False, 0),
]


def packed(queries: tuple[int, ...] = QUERIES) -> torch.Tensor:
    """cu_seqlens_q of these query counts, int32."""
    return torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)


def make_inputs(case: Case, seed: int, queries: tuple[int, ...] = QUERIES, d: int = 32) -> dict[str, Any]:
    """A mixed batch's arguments: random data, random block tables, cached lengths from 0 to the cache's end."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    batch, (hq, hk) = len(queries), case.heads
    cu = packed(queries)
    args: dict[str, Any] = {"q": randn(int(cu[-1]), hq, d), "cu_seqlens_q": cu, "max_seqlen_q": max(queries)}
    if case.layout.startswith("page"):
        page = int(case.layout[4:])
        per = -(-CAPACITY // page)
        blocks = 2 * batch * per + 1
        args["k_cache"], args["v_cache"] = randn(blocks, page, hk, d), randn(blocks, page, hk, d)
        args["block_table"] = torch.randperm(blocks, generator=gen)[:batch * per].view(batch, per).int()
        capacity = per * page
    else:
        rows = 2 * batch if case.layout == "batch_idx" else batch
        args["k_cache"], args["v_cache"] = randn(rows, CAPACITY, hk, d), randn(rows, CAPACITY, hk, d)
        if case.layout == "batch_idx":
            args["cache_batch_idx"] = torch.randperm(rows, generator=gen)[:batch].int()
        capacity = CAPACITY
    if case.new:
        args["k"], args["v"] = randn(batch, case.new, hk, d), randn(batch, case.new, hk, d)
    lens = torch.randint(0, capacity - case.new + 1, (batch,), generator=gen)
    lens[0], lens[1] = capacity - case.new, 0  # the prefill fills its cache; a decode starts from nothing
    args["cache_seqlens"] = lens.int()
    if case.alibi:
        args["alibi_slopes"] = torch.rand(batch, hq, generator=gen) * 0.3
    return args


def options(case: Case) -> dict[str, Any]:
    return {"causal": case.causal, "window_size": case.window, "softcap": case.softcap}


def run(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, ...]:
    """The packed call on copies of the caches: (out, lse, k_cache, v_cache after the call)."""
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **opts, return_softmax_lse=True)
    return out, lse, mine["k_cache"], mine["v_cache"]


def check_against_reference(args: dict[str, Any], got: tuple[torch.Tensor, ...], **opts: Any) -> None:
    """FlashAttention's rule for out and lse (2x the same-dtype reference's error), the caches bitwise."""
    out, lse, k_cache, v_cache = got
    plain = {n: t for n, t in args.items() if n != "max_seqlen_q"}
    wide = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() and n != "alibi_slopes" else t
            for n, t in plain.items()}
    ref_out, ref_lse, _, _ = varlen_q_reference(**wide, **opts)
    same_out, same_lse, same_k, same_v = varlen_q_reference(**plain, **opts)
    assert torch.equal(k_cache, same_k) and torch.equal(v_cache, same_v), "the new keys/values landed elsewhere"
    # check_out_lse reads (batch, seqlen, heads, dim) and (batch, heads, seqlen): one batch of total_q.
    check_out_lse((out[None], lse[None]), (ref_out[None], ref_lse[None]), (same_out[None], same_lse[None]))


# ---------------------------------------------------------------------------
# Numerics on CPU, through Triton's interpreter


@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_q_cpu(case: Case) -> None:
    args = make_inputs(case, seed_of(str(case)))
    out, lse, k_cache, v_cache = run(args, **options(case), num_splits=case.splits)
    assert out.shape == args["q"].shape and lse.shape == (case.heads[0], args["q"].shape[0])
    check_against_reference(args, (out, lse, k_cache, v_cache), **options(case))


@pytest.mark.parametrize("splits", [1, 3])
def test_the_packed_call_is_each_sequence_alone(splits: int) -> None:
    """Row for row the call of each sequence by itself (sinks and a paged cache of 5-key pages included)."""
    case = Case(torch.float32, (4, 2), "page5", 2, True, (-1, -1), 0.0, True, splits)
    args = make_inputs(case, seed_of("alone", splits))
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))
    out, lse, k_cache, v_cache = run(args, **options(case), num_splits=splits, sinks=sinks)
    cu = args["cu_seqlens_q"]
    kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
    for b in range(len(QUERIES)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        one = {n: args[n][b:b + 1] for n in ("k", "v", "cache_seqlens", "block_table", "alibi_slopes")}
        alone, alone_lse = lazytriton.flash_attn_with_kvcache(args["q"][None, lo:hi], kc, vc, **one,
                                                              **options(case), num_splits=splits, sinks=sinks,
                                                              return_softmax_lse=True)
        assert torch.equal(out[lo:hi], alone[0]), f"sequence {b}: out differs from its call alone"
        assert torch.equal(lse[:, lo:hi], alone_lse[0]), f"sequence {b}: lse differs from its call alone"
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


def test_every_sequence_empty_or_max_seqlen_q_above_the_longest() -> None:
    case = Case(torch.float32, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 2)
    args = make_inputs(case, seed=5, queries=(0, 0))
    out, lse, k_cache, _ = run(args, **options(case))
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)
    assert not torch.equal(k_cache, args["k_cache"]), "the new keys are appended even without queries"
    args = make_inputs(case, seed=6, queries=(2, 1, 3))
    got = run({**args, "max_seqlen_q": 40}, **options(case))  # a loose bound: more programs, the same result
    check_against_reference(args, got, **options(case))


def test_many_short_sequences_beside_a_long_one_each_find_their_rows() -> None:
    """More sequences than one search step of cu_seqlens_q (128), several row blocks for the long ones."""
    queries = tuple([9, 1, 0, 1, 2, 1, 1, 17][i % 8] for i in range(150))
    case = Case(torch.float32, (4, 1), "page16", 0, True, (-1, -1), 0.0, False, 2)
    args = make_inputs(case, seed=7, queries=queries, d=16)
    check_against_reference(args, run(args, **options(case), num_splits=2), **options(case))


def test_the_packed_grid_counts_rows_not_the_longest_sequence_per_sequence() -> None:
    from lazytriton.kernels.flash_decode import split_grid, split_programs

    # 256 one-query decodes beside a 2048-query prefill, 4 query rows a key/value head, 64-row tiles
    packed_rows = 4 * (2048 + 256)
    grid = split_grid(4 * 2048, 64, 3, 8, 257, packed_rows)
    blocks = packed_rows // 64 + 257  # each sequence's first block: cu_seqlens_q[b] x 4 // 64 + b
    assert grid[1:] == (8, 257) and grid[0] % 3 == 0 and blocks <= grid[0] // 3 * 257 < blocks + 257
    assert split_programs(4 * 2048, 64, 8, 257, packed_rows) == grid[0] // 3 * 8 * 257
    assert split_grid(4 * 2048, 64, 3, 8, 257) == (128 * 3, 8, 257)  # without packing: the longest's blocks each
    assert split_grid(0, 64, 1, 8, 2, 0) == (1, 8, 2)  # every sequence empty: a block each, no rows


# ---------------------------------------------------------------------------
# flash_attn_varlen_func with a block table: vLLM's calling convention


def varlen_func_args(args: dict[str, Any]) -> dict[str, Any]:
    """vLLM's call of the same batch: k and v the paged caches, cu_seqlens_k None, seqused_k the lengths."""
    return {"q": args["q"], "k": args["k_cache"], "v": args["v_cache"], "cu_seqlens_q": args["cu_seqlens_q"],
            "cu_seqlens_k": None, "max_seqlen_q": args["max_seqlen_q"],
            "max_seqlen_k": int(args["cache_seqlens"].max()), "seqused_k": args["cache_seqlens"],
            "block_table": args["block_table"], **({"alibi_slopes": args["alibi_slopes"]}
                                                   if "alibi_slopes" in args else {})}


@pytest.mark.parametrize("case", [c for c in CASES if c.layout.startswith("page") and not c.new], ids=str)
def test_the_varlen_func_form_is_the_kvcache_form(case: Case) -> None:
    args = make_inputs(case, seed_of("varlen", str(case)))
    sinks = torch.randn(case.heads[0], generator=torch.Generator().manual_seed(2))
    want, want_lse = lazytriton.flash_attn_with_kvcache(**args, **options(case), num_splits=case.splits,
                                                        sinks=sinks, return_softmax_lse=True)
    out = torch.full_like(want, float("nan"))
    got, lse, none = lazytriton.flash_attn_varlen_func(**varlen_func_args(args), **options(case), s_aux=sinks,
                                                       num_splits=case.splits, return_attn_probs=True, out=out)
    assert got is out and none is None
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert torch.equal(lazytriton.flash_attn_varlen_func(**varlen_func_args(args), **options(case), sinks=sinks,
                                                         num_splits=case.splits), want)


def test_the_varlen_func_form_traces_with_torch_compile() -> None:
    torch._dynamo.reset()
    args = make_inputs(Case(torch.float32, (4, 2), "page16", 0, True, (-1, -1), 0.0, False, 2), seed=11)
    call = varlen_func_args(args)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, used: torch.Tensor,
             table: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        lazytriton.flash_attn_varlen_func(q * 2, k, v, cu, None, 5, 40, causal=True, seqused_k=used,
                                          block_table=table, num_splits=2, out=out)
        return out + 1

    inputs = (call["q"], call["k"], call["v"], call["cu_seqlens_q"], call["seqused_k"], call["block_table"])
    want = step(*inputs)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


VARLEN_BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("cu_seqlens_k", lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_q"]}, ValueError, "cu_seqlens_k must be None"),
    ("no_seqused_k", lambda a: {**a, "seqused_k": None}, ValueError, "block_table needs seqused_k"),
    ("seqused_k_int", lambda a: {**a, "seqused_k": 3}, TypeError, "seqused_k must be an int32 tensor"),
    ("seqused_k_int64", lambda a: {**a, "seqused_k": a["seqused_k"].long()}, TypeError, "seqused_k must be"),
    ("seqused_k_past_end", lambda a: {**a, "seqused_k": torch.full((5,), 99, dtype=torch.int32)}, ValueError,
     r"seqused_k\[0\] = 99"),
    ("seqused_q", lambda a: {**a, "seqused_q": a["seqused_k"]}, ValueError, "seqused_q is not taken"),
    ("dropout", lambda a: {**a, "dropout_p": 0.1}, ValueError, "dropout_p must be 0 with block_table"),
    ("max_seqlen_k", lambda a: {**a, "max_seqlen_k": -1}, TypeError, "max_seqlen_k must be an int >= 0"),
    ("num_splits", lambda a: {**a, "num_splits": 300}, ValueError, "num_splits must be in 0..256"),
    ("out_shape", lambda a: {**a, "out": torch.empty(3, 4, 32)}, ValueError, "out must have shape"),
    ("out_dtype", lambda a: {**a, "out": torch.empty(10, 4, 32)}, TypeError, "out must be torch.float16"),
    ("grad", lambda a: {**a, "q": a["q"].float().requires_grad_(), "k": a["k"].float(), "v": a["v"].float()},
     ValueError, "forward only"),
    ("k_heads", lambda a: {**a, "k": a["k"][:, :, :1].contiguous()}, ValueError, "k \\(the paged cache\\)"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), VARLEN_BAD, ids=[b[0] for b in VARLEN_BAD])
def test_bad_varlen_func_input_is_refused_before_anything_runs(name: str, change: Any, error: type[Exception],
                                                               match: str) -> None:
    args = {**varlen_func_args(_valid()), "causal": True}
    before = (args["k"].clone(), args["v"].clone())
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_varlen_func(**change(args))
    assert torch.equal(args["k"], before[0]) and torch.equal(args["v"], before[1])


def test_num_splits_and_out_without_a_block_table() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(7, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    want = lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True)
    out = torch.empty_like(want)
    assert lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, num_splits=1, out=out) is out
    assert torch.equal(out, want)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, num_splits=1.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Bad input: refused before anything runs


def _valid() -> dict[str, Any]:
    return make_inputs(Case(torch.float16, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 0), seed=0)


def _set(name: str, fn: Any) -> Any:
    return lambda a: {**a, name: fn(a)}


BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("cu_int64", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q"),
    ("cu_2d", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"][None]), ValueError, "cu_seqlens_q must have 1 dims"),
    ("cu_one_entry", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:1]), ValueError, "batch \\+ 1 >= 2"),
    ("cu_not_tensor", _set("cu_seqlens_q", lambda a: [0, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ("q_4d", _set("q", lambda a: a["q"][None]), ValueError, "q must have 3 dims"),
    ("no_max", lambda a: {n: t for n, t in a.items() if n != "max_seqlen_q"}, ValueError,
     "cu_seqlens_q needs max_seqlen_q"),
    ("max_without_cu", lambda a: {**{n: t for n, t in a.items() if n != "cu_seqlens_q"}, "q": a["q"][None]},
     ValueError, "max_seqlen_q .* is read only with cu_seqlens_q"),
    ("max_float", _set("max_seqlen_q", lambda a: 5.0), TypeError, "max_seqlen_q must be an int"),
    ("max_negative", _set("max_seqlen_q", lambda a: -1), ValueError, "max_seqlen_q must be in"),
    ("max_too_small", _set("max_seqlen_q", lambda a: 4), ValueError, "sequence 0 has 5 queries"),
    ("cu_start", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"] + 1), ValueError, r"cu_seqlens_q\[0\] = 1"),
    ("cu_end", _set("cu_seqlens_q", lambda a: torch.tensor([0, 5, 6, 6, 7, 9], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q\[5\] = 9: must be total_q = 10"),
    ("cu_decreasing", _set("cu_seqlens_q", lambda a: torch.tensor([0, 5, 4, 6, 7, 10], dtype=torch.int32)),
     ValueError, "nondecreasing"),
    ("k_batch", _set("k", lambda a: a["k"][:4]), ValueError, "k must have shape"),
    ("seqlens_batch", _set("cache_seqlens", lambda a: a["cache_seqlens"][:4]), ValueError, "cache_seqlens"),
    ("table_rows", _set("block_table", lambda a: a["block_table"][:4]), ValueError, "block_table has 4 rows"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_anything_runs(name: str, change: Any, error: type[Exception],
                                                   match: str) -> None:
    args = change(_valid())
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1]), "a cache was written"


def test_trusted_indices_skip_the_cu_seqlens_check(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(values, "check_values", lambda t, call, names: seen.append(t.cu_seqlens_q is not None))
    monkeypatch.setattr(binding, "run_interpreter", lambda *a, **kw: None)
    lazytriton.flash_attn_with_kvcache(**_valid())
    with lazytriton.kvcache.trusted_indices():
        lazytriton.flash_attn_with_kvcache(**_valid())
    assert seen == [True]


# ---------------------------------------------------------------------------
# Variants, memo keys, the op


def test_varlen_q_is_written_in_the_split_variant_only_when_set() -> None:
    target = Target("cuda", 90, 0)
    for paged, sinks in ((False, False), (True, True)):
        plain = {k: decode_dispatch.decode_variant(k, target, "bf16", 128, True, True, 64, 4096, paged=paged,
                                                   sinks=sinks) for k in decode_dispatch.DECODE_KERNELS}
        packed_v = {k: decode_dispatch.decode_variant(k, target, "bf16", 128, True, True, 64, 4096, paged=paged,
                                                      sinks=sinks, varlen_q=True)
                    for k in decode_dispatch.DECODE_KERNELS}
        assert "VARLEN_Q" not in str(plain["flash_decode_split"])
        assert "VARLEN_Q=true" in str(packed_v["flash_decode_split"])
        assert dict(packed_v["flash_decode_split"].constexprs) == {**dict(plain["flash_decode_split"].constexprs),
                                                                  "VARLEN_Q": True}
        assert packed_v["flash_decode_combine"] == plain["flash_decode_combine"]
        check_fields(Variant.parse(str(packed_v["flash_decode_split"])))


def test_memo_keys_without_packed_queries_are_unchanged() -> None:
    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], cache_seqlens=args["cache_seqlens"],
                      block_table=args["block_table"], cu_seqlens_q=args["cu_seqlens_q"])
    call = checks.check(t, max_seqlen_q=5)
    assert call.varlen_q and call.total_q == 10 and call.batch == 5 and call.seqlen_q == 5
    key = binding.memo_key(0, torch.float16, call, True, False)
    plain = binding.memo_key(0, torch.float16, call._replace(varlen_q=False, total_q=0), True, False)
    assert key == (*plain, *binding.VARLEN_Q_TAG) and "varlen_q" not in plain


def test_the_op_and_torch_compile_trace_packed_queries() -> None:
    torch._dynamo.reset()
    case = Case(torch.float32, (4, 2), "page5", 1, True, (-1, -1), 0.0, False, 2)
    args = make_inputs(case, seed=9)

    def step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor, table: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = lazytriton.flash_attn_with_kvcache(q * 2, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                      block_table=table, causal=True, num_splits=2,
                                                      cu_seqlens_q=cu, max_seqlen_q=5, return_softmax_lse=True)
        return out * 3, lse

    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "cu_seqlens_q")
    eager = [args[n].clone() if n.endswith("_cache") else args[n] for n in names]
    want = step(*eager)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*(args[n] for n in names))
    # The same output, and the same new keys appended to the compiled call's caches as to the eager call's.
    torch.testing.assert_close((*got, args["k_cache"], args["v_cache"]), (*want, eager[1], eager[2]), rtol=0, atol=0)


def test_the_binding_carries_the_pointer_and_the_packed_layout() -> None:
    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], cache_seqlens=args["cache_seqlens"],
                      block_table=args["block_table"], cu_seqlens_q=args["cu_seqlens_q"])
    call = checks.check(t, causal=True, max_seqlen_q=5)
    out, lse = binding.empty_outputs(args["q"], call)
    assert out.shape == (10, 4, 32) and lse.shape == (4, 10)
    named = dict(zip(binding.SPLIT_INT_PARAMS, binding.split_ints(t, out, lse, lse, lse, call, 2), strict=True))
    assert named["CuSeqlensQ"] == args["cu_seqlens_q"].data_ptr()
    assert (named["stride_qb"], named["stride_ob"], named["seqlen_q"]) == (0, 0, 10)
    combine = dict(zip(binding.COMBINE_INT_PARAMS, binding.combine_ints(lse, lse, out, lse, call, 2), strict=True))
    assert (combine["seqlen_q"], combine["n_rows"]) == (10, 40)
    assert binding.interpreter_constexprs(call)[0]["VARLEN_Q"] is True
    split, combine_v = binding.variants(Target("cuda", 90, 0), torch.float16, call, True, False)
    assert split.get("VARLEN_Q") is True and "VARLEN_Q" not in str(combine_v)


def test_prewarm_plans_packed_queries_on_request_and_the_miss_log_reads_them() -> None:
    axes = Axes((Target("cuda", 90, 0),), kernels=decode_dispatch.DECODE_KERNELS, dtypes=("bf16",),
                head_dims=(128,))
    plain = [str(p.variant) for p in enumerate_variants(axes, Table(()))]
    both = [str(p.variant) for p in enumerate_variants(replace(axes, varlen_q=(False, True)), Table(()))]
    assert not any("VARLEN_Q" in v for v in plain)
    packed_variants = [v for v in both if "VARLEN_Q=true" in v]
    assert packed_variants and all(v.startswith("flash_decode_split") for v in packed_variants)
    assert sorted(v for v in both if "VARLEN_Q" not in v) == sorted(plain)
    planned, problems = variants_from_misses([json.dumps({"variant": packed_variants[0]})])
    assert not problems and [str(p.variant) for p in planned] == [packed_variants[0]]


def test_cache_explain_describes_packed_queries(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    base = ["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q",
            "64", "--seqlen-k", "4096", "--page-size", "16", "--causal", "bottom_right", "--target", "sm_90",
            "--json"]
    assert cli_main(base + ["--varlen-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["call"]["varlen_q"] is True
    split = next(k for k in report["kernels"] if k["kernel"] == "flash_decode_split")
    assert "VARLEN_Q=true" in split["variant"]
    assert cli_main(base) == 0
    assert "VARLEN_Q" not in capsys.readouterr().out
    assert cli_main(base[:3] + ["flash_fwd"] + base[4:8] + ["--seqlen-q", "64", "--varlen-q"]) == 2
    assert "--varlen-q is flash_attn_with_kvcache's cu_seqlens_q" in capsys.readouterr().err


def test_a_varlen_q_variant_compiles_to_what_the_c_launcher_passes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A real sm_90 entry with packed queries and every flag (Triton's compiler, not the interpreter)."""
    from compiled_once import compiled, shared_dir

    from lazytriton.capi import embedded_kvcache

    variant = decode_dispatch.decode_variant("flash_decode_split", Target("cuda", 90, 0), "fp16", 64, True, True, 4,
                                             4096, page_size=5, paged=True, window=True, softcap=True, alibi=True,
                                             leftpad=True, sinks=True, varlen_q=True)
    entry = compiled(variant, shared_dir(tmp_path_factory))
    embedded_kvcache.check_launch_layout(entry, variant.kernel)
    assert entry.arg_types[binding.SPLIT_INT_PARAMS.index("CuSeqlensQ")] == "*i32"


# ---------------------------------------------------------------------------
# On the GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_q_gpu(case: Case) -> None:
    args = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in make_inputs(case, seed=7).items()}
    got = run(args, **options(case), num_splits=case.splits)
    cpu = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    check_against_reference(cpu, tuple(t.cpu() for t in got), **options(case))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])
def test_varlen_q_gpu_serving_batch(page: int) -> None:
    """A serving step (32/8 heads, head dim 128, bf16): a 1000-query prefill beside 60 decodes, one call."""
    gen = torch.Generator(device="cuda").manual_seed(page)
    queries = (1000, *([1] * 60))
    cu = packed(queries).cuda()
    lens = torch.randint(100, 4000, (len(queries),), device="cuda", generator=gen).int()
    lens[0] = 3000
    per = 8192 // page
    blocks = len(queries) * per
    k_cache = torch.randn(blocks, page, 8, 128, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, device="cuda", generator=gen).view(len(queries), per).int()
    q = torch.randn(int(cu[-1]), 32, 128, device="cuda", generator=gen).bfloat16()
    out = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                             causal=True, cu_seqlens_q=cu, max_seqlen_q=1000)
    for b in (0, 1, 60):
        lo, hi = int(cu[b]), int(cu[b + 1])
        alone = lazytriton.flash_attn_with_kvcache(q[None, lo:hi], k_cache, v_cache, cache_seqlens=lens[b:b + 1],
                                                   block_table=table[b:b + 1], causal=True)
        assert max_err(out[lo:hi], alone[0]) < 2e-2


def test_layout_flags_take_packed_queries() -> None:
    """The GPU launch's layout read over packed (3-D) queries and output: aligned, 32-bit indices, no error."""
    from types import SimpleNamespace
    q = torch.randn(7, 4, 64)
    cache = torch.randn(2, 32, 2, 64)
    out = torch.empty(7, 4, 64)
    aligned, index64 = binding.layout_flags(SimpleNamespace(q=q, k_cache=cache, v_cache=cache, key_mask=None), out)
    assert aligned == (q.data_ptr() % 16 == 0 and cache.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0)
    assert not index64
    odd = torch.randn(7 * 4 * 64 + 1)[1:].view(7, 4, 64)  # a 4-byte offset: not 16-byte aligned
    stub = SimpleNamespace(q=odd, k_cache=cache, v_cache=cache, key_mask=None)
    assert binding.layout_flags(stub, out) == (False, False)
