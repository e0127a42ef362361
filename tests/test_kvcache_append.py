"""The ``kv_append`` kernel and head_dim_v in ``flash_attn_with_kvcache`` (issue 11, items 2, 3 and 5).

New keys and values are written into the cache by one kernel (``kernels/kv_append``), on the CPU through
Triton's interpreter: they must land exactly where FlashAttention-2 puts them (its test's statement,
``flash_decode/reference.py``, and the plain torch twin ``kv_append/reference.py``), in a contiguous
cache, through ``cache_batch_idx`` and through random block tables, at every cache_seqlens from 0 to the
cache's end. A value head dim of its own (d=64/dv=32, d=96/dv=64, d=40/dv=72) is checked against the
float64 reference with FlashAttention's rule, paged and contiguous, with and without new keys. Bad
input raises a ValueError naming the argument before anything is written.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from conftest import gpu
from test_kvcache import check_against_reference, run

import lazytriton
from lazytriton.kernels import get, kv_append
from lazytriton.kernels.flash_decode import checks, values
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.kernels.kv_append import binding as append_binding
from lazytriton.kernels.kv_append.reference import append_reference
from lazytriton.prewarm.limits import refusal
from lazytriton.target import Target
from lazytriton.variant import check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

SM90 = Target.parse("sm_90")
LAYOUTS = ("contiguous", "batch_idx", "page16", "page32")
CONTIGUOUS_LEN = 37


def make(layout: str, batch: int, heads: tuple[int, int], d: int, dv: int, new: int, dtype: torch.dtype,
         seed: int, seqlen_q: int = 1, lens: str = "tensor") -> dict[str, Any]:
    """A call's arguments: random data and block tables (3x the pages needed); lengths 0 .. the end, shuffled."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    hq, hk = heads
    args: dict[str, Any] = {"q": randn(batch, seqlen_q, hq, d)}
    if layout.startswith("page"):
        page = int(layout[4:])
        max_blocks = 64 // page
        blocks = 3 * batch * max_blocks
        args["k_cache"], args["v_cache"] = randn(blocks, page, hk, d), randn(blocks, page, hk, dv)
        args["block_table"] = torch.randperm(blocks, generator=gen)[:batch * max_blocks].reshape(batch, -1).int()
        capacity = max_blocks * page
    else:
        rows = batch + 3 if layout == "batch_idx" else batch
        args["k_cache"], args["v_cache"] = randn(rows, CONTIGUOUS_LEN, hk, d), randn(rows, CONTIGUOUS_LEN, hk, dv)
        if layout == "batch_idx":
            args["cache_batch_idx"] = torch.randperm(rows, generator=gen)[:batch].int()
        capacity = CONTIGUOUS_LEN
    if new:
        args["k"], args["v"] = randn(batch, new, hk, d), randn(batch, new, hk, dv)
    top = capacity - new
    if lens == "tensor":
        starts = torch.arange(batch) * top // max(1, batch - 1)  # 0 .. the end, evenly
        args["cache_seqlens"] = starts[torch.randperm(batch, generator=gen)].int()
    elif lens == "int":
        args["cache_seqlens"] = top // 2
    return args


def inputs(args: dict[str, Any]) -> checks.Inputs:
    return checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"),
                         args.get("cache_seqlens"), args.get("cache_batch_idx"), args.get("block_table"))


# ---------------------------------------------------------------------------
# The append kernel (interpreter) against FlashAttention-2's statement and the torch twin


@pytest.mark.parametrize(("layout", "dims", "new"), [
    (layout, dims, new) for (layout, dims), new in zip(itertools.product(LAYOUTS, ((64, 64), (64, 32), (40, 72))),
                                                       itertools.cycle((1, 3, 5)), strict=False)])
def test_appended_keys_land_where_flash_attention_2_puts_them(layout: str, dims: tuple[int, int], new: int) -> None:
    d, dv = dims
    capacity = CONTIGUOUS_LEN if not layout.startswith("page") else 64
    batch = capacity - new + 1  # every start from 0 to the end, one sequence each
    args = make(layout, batch, (2, 2), d, dv, new, torch.float16, seed=batch * d + dv)
    assert sorted(args["cache_seqlens"].tolist()) == list(range(capacity - new + 1))
    t = inputs(args)
    call = checks.check(t)
    values.check_values(t, call)
    mine = t._replace(k_cache=t.k_cache.clone(), v_cache=t.v_cache.clone())
    append_binding.append(mine, call)
    twin_k, twin_v = t.k_cache.clone(), t.v_cache.clone()
    append_reference(t.k, t.v, twin_k, twin_v, t.cache_seqlens, t.cache_batch_idx,  # type: ignore[arg-type]
                     t.block_table)
    _, _, fa2_k, fa2_v = kvcache_reference(**args)
    assert torch.equal(mine.k_cache, fa2_k) and torch.equal(mine.v_cache, fa2_v), "landed elsewhere than FA2's"
    assert torch.equal(twin_k, fa2_k) and torch.equal(twin_v, fa2_v)
    assert not torch.equal(mine.k_cache, t.k_cache), "something was written"


@pytest.mark.parametrize(("layout", "bad"), [("contiguous", "start_past_end"), ("contiguous", "start_negative"),
                                           ("batch_idx", "row_past_end"), ("batch_idx", "row_negative"),
                                           ("page16", "block_past_end"), ("page16", "block_negative"),
                                           ("page32", "start_past_end")])
def test_index_values_nobody_checked_never_write_outside_the_caches(layout: str, bad: str) -> None:
    """The C API's device memory, a graph's replays, ``trusted_indices``: out-of-range values write nothing.

    Sequence 0 is good, sequence 1's value is out of range: the caches end as the append of sequence 0 alone.
    """
    args = make(layout, 2, (2, 2), 64, 32, 3, torch.float32, seed=11)
    args["cache_seqlens"] = torch.tensor([0, 5], dtype=torch.int32)
    capacity = 64 if layout.startswith("page") else CONTIGUOUS_LEN
    if bad == "start_past_end":
        args["cache_seqlens"][1] = capacity
    elif bad == "start_negative":
        args["cache_seqlens"][1] = -4
    elif bad.startswith("row"):
        args["cache_batch_idx"][1] = args["k_cache"].shape[0] if bad == "row_past_end" else -1
    else:
        args["block_table"][1] = args["k_cache"].shape[0] + 2 if bad == "block_past_end" else -1
    t = inputs(args)
    with pytest.raises(ValueError):  # a checked call refuses these values
        values.check_values(t, checks.check(t))
    mine = t._replace(k_cache=t.k_cache.clone(), v_cache=t.v_cache.clone())
    append_binding.append(mine, checks.check(t))
    if layout == "contiguous":  # sequence 0 (start 0) alone: row 0, slots 0..2
        alone = t._replace(k_cache=t.k_cache.clone(), v_cache=t.v_cache.clone())
        alone.k_cache[0, :3], alone.v_cache[0, :3] = t.k[0], t.v[0]  # type: ignore[index]
    else:
        good = checks.Inputs(*(x[:1] if isinstance(x, torch.Tensor) and x is not t.k_cache and x is not t.v_cache
                               else x for x in t))
        alone = good._replace(k_cache=t.k_cache.clone(), v_cache=t.v_cache.clone())
        append_binding.append(alone, checks.check(good))
    assert not torch.equal(alone.k_cache, t.k_cache), "sequence 0 was written"
    assert torch.equal(mine.k_cache, alone.k_cache) and torch.equal(mine.v_cache, alone.v_cache)


@pytest.mark.parametrize("lens", ["int", "tensor"])
def test_an_int_length_and_strided_new_keys(lens: str) -> None:
    args = make("page16", 3, (4, 2), 64, 32, 2, torch.float32, seed=7, lens=lens)
    wide = torch.randn(3, 2, 2, 160)
    args["k"], args["v"] = wide[..., :64], wide[..., 96:128]  # views: strided heads and tokens
    t = inputs(args)
    call = checks.check(t)
    mine = t._replace(k_cache=t.k_cache.clone(), v_cache=t.v_cache.clone())
    append_binding.append(mine, call)
    _, _, fa2_k, fa2_v = kvcache_reference(**args)
    assert torch.equal(mine.k_cache, fa2_k) and torch.equal(mine.v_cache, fa2_v)


def test_the_description_the_arguments_and_the_variants_agree() -> None:
    spec = get("kv_append")
    assert spec is kv_append.KV_APPEND and kv_append.INT_PARAMS == tuple(n for n, _ in spec.params)
    args = make("batch_idx", 2, (2, 2), 64, 32, 1, torch.float16, seed=1)
    t = inputs(args)
    ints = append_binding.ints(t, checks.check(t), pointers=lambda x: x)
    assert len(ints) == len(spec.params)
    # heads_k, seqlen_new, d, dv, seqlen_const, flags, page, capacity, cache rows (batch + 3 here); no rotary, no
    # descales; the batch (num_seqs, read only with packed new keys)
    assert ints[-16:] == (2, 1, 64, 32, 0, 1, 1, 0, CONTIGUOUS_LEN, 5, 0, 0, 0, 0, 0, 2)
    same = kv_append.variant(SM90, "bf16", 128, 0, False, True, False)
    assert "BLOCK_DV" not in str(same) and "PAGED" not in str(same)
    mla = kv_append.variant(SM90, "bf16", 192, 128, True, True, False)
    assert (mla.get("BLOCK_D"), mla.get("BLOCK_DV"), mla.get("PAGED")) == (256, 128, True)
    for variant in (same, mla, kv_append.variant(Target.parse("gfx942"), "fp16", 40, 0, False, False, True)):
        assert check_fields(variant) is variant and refusal(variant) is None
    assert len({v.key() for v in (same, mla, kv_append.variant(SM90, "bf16", 192, 128, False, True, False))}) == 3


# ---------------------------------------------------------------------------
# head_dim_v: numerics against the float64 reference (FlashAttention's rule)

HEAD_DIM_V_CASES = [
    # (d, dv), layout, new, seqlen_q, causal, dtype, splits
    ((64, 32), "contiguous", 0, 1, False, torch.float16, 0),
    ((64, 32), "page16", 2, 3, True, torch.float32, 3),
    ((96, 64), "page32", 0, 2, True, torch.bfloat16, 1),
    ((96, 64), "batch_idx", 1, 1, False, torch.float32, 2),
    ((40, 72), "page16", 3, 1, False, torch.float16, 0),
    ((128, 64), "contiguous", 2, 4, True, torch.bfloat16, 4),
]


@pytest.mark.parametrize(("dims", "layout", "new", "seqlen_q", "causal", "dtype", "splits"), HEAD_DIM_V_CASES)
def test_head_dim_v_against_the_float64_reference(dims: tuple[int, int], layout: str, new: int, seqlen_q: int,
                                                  causal: bool, dtype: torch.dtype, splits: int) -> None:
    d, dv = dims
    args = make(layout, 3, (4, 2), d, dv, new, dtype, seed=d * 1000 + dv + new, seqlen_q=seqlen_q)
    got = run(args, causal=causal, num_splits=splits)
    assert got[0].shape == (3, seqlen_q, 4, dv) and got[0].dtype == dtype
    check_against_reference(args, got, causal=causal)


def test_head_dim_v_on_meta_and_under_the_op_has_vs_shape() -> None:
    args = make("page16", 2, (4, 2), 96, 64, 1, torch.float16, seed=3)
    meta = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    out, lse = lazytriton.flash_attn_with_kvcache(**meta, return_softmax_lse=True)
    assert out.shape == (2, 1, 4, 64) and lse.shape == (2, 4, 1)
    from lazytriton.kvcache_op import flash_kvcache_op

    fake_out, fake_lse = flash_kvcache_op(meta["q"], meta["k_cache"], meta["v_cache"], meta["k"], meta["v"],
                                          meta["cache_seqlens"], -1, None, meta["block_table"], 0.1, False, -1,
                                          -1, 0.0, None, 0)
    assert fake_out.shape == (2, 1, 4, 64) and fake_lse.shape == (2, 4, 1)


# ---------------------------------------------------------------------------
# Bad input: a ValueError naming the argument, nothing written, nothing launched

BAD = [
    ("v", lambda a: {**a, "v": a["v"][..., :16]},
     r"v must have shape \(2, 1, 2, 32\) \(k's batch, seqlen_new and heads, and v_cache's head dim\), "
     r"got \(2, 1, 2, 16\)"),
    ("v_seqlen", lambda a: {**a, "v": torch.cat([a["v"], a["v"]], 1)}, r"v must have shape \(2, 1, 2, 32\)"),
    ("v_cache_heads", lambda a: {**a, "v_cache": a["v_cache"][:, :, :1]}, "v_cache must have k_cache's first three"),
    ("v_cache_head_dim", lambda a: {**a, "v_cache": torch.zeros(*a["v_cache"].shape[:3], 600).half()},
     r"v_cache's head dim \(head_dim_v, v_cache.shape\[-1\]\) must be in 1..512, got 600"),
    ("k_head_dim", lambda a: {**a, "k": a["k"][..., :32]}, r"k must have shape \(2, seqlen_new, 2, 64\)"),
    ("block_table", lambda a: {**a, "block_table": a["block_table"].index_fill(1, torch.tensor([0]), 10**5)},
     r"block_table\[0, 0\] = 100000 points past the cache"),
    ("cache_seqlens", lambda a: {**a, "cache_seqlens": torch.tensor([64, 0], dtype=torch.int32)},
     r"cache_seqlens\[0\] = 64: must be in 0..63"),
]


@pytest.mark.parametrize(("name", "change", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_anything_is_written(name: str, change: Any, match: str,
                                                         no_launch: None) -> None:
    args = change(make("page16", 2, (4, 2), 64, 32, 1, torch.float16, seed=11))
    before = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    with pytest.raises(ValueError, match=match):
        lazytriton.flash_attn_with_kvcache(**args)
    assert all(torch.equal(args[n], before[n]) for n in before)


# ---------------------------------------------------------------------------
# On the GPU (the lead runs these on the H200)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "dims"), list(itertools.product(LAYOUTS, ((128, 128), (192, 128), (96, 64)))))
def test_append_and_head_dim_v_on_the_gpu(layout: str, dims: tuple[int, int]) -> None:
    d, dv = dims
    args = make(layout, 5, (8, 2), d, dv, 3, torch.bfloat16, seed=d + dv, seqlen_q=2)
    cuda = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    out, lse, k_cache, v_cache = run(cuda, causal=True)
    check_against_reference(args, (out.cpu(), lse.cpu(), k_cache.cpu(), v_cache.cpu()), causal=True)


@gpu
@pytest.mark.gpu
def test_the_gpu_append_is_one_kernel_and_capturable() -> None:
    args = make("page16", 4, (8, 2), 128, 64, 1, torch.bfloat16, seed=5)
    args["cache_seqlens"] = torch.tensor([0, 15, 16, 40], dtype=torch.int32)
    cuda = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    t = inputs(cuda)
    call = checks.check(t)
    append_binding.append(t, call)  # loads kv_append
    expect_k, expect_v = kvcache_reference(**args)[2:]
    assert torch.equal(t.k_cache.cpu(), expect_k) and torch.equal(t.v_cache.cpu(), expect_v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_binding.append(t, call)
    t.cache_seqlens.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    moved = {**args, "cache_seqlens": args["cache_seqlens"] + 1, "k_cache": expect_k, "v_cache": expect_v}
    again_k, again_v = kvcache_reference(**moved)[2:]
    assert torch.equal(t.k_cache.cpu(), again_k) and torch.equal(t.v_cache.cpu(), again_v)
