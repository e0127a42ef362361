"""FlashAttention-3's ``qv`` (DeepSeek's MLA) in the serving calls: packed queries, packed new keys, the paged form.

``flash_attn_with_kvcache(q, ..., qv=, cu_seqlens_q=, cu_seqlens_k_new=)`` (a serving engine's mixed batch of
prefills and decodes) and ``flash_attn_varlen_func(..., qv=)`` with a block table (vLLM's calling convention) or
without one (packed keys, read as pages of one key) run the split kernel's QV variant. Numerics against the float64
reference (``varlen_q_reference`` with qv; for packed keys each sequence its own ``kvcache_reference`` over its
span) under FlashAttention's rule, on CPU through Triton's interpreter on small shapes; the paged form equals
``flash_attn_with_kvcache`` bit for bit; bad input is named before anything is written; GPU-marked tests at MLA's
sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import gpu
from test_kvcache import check_out_lse

import lazytriton
from lazytriton.kernels.flash_decode.reference import kvcache_reference, varlen_q_reference

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
QUERIES = (3, 1, 0, 2)  # a chunk of a prefill, a decode, an empty sequence, two speculative queries


def cumulative(counts: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def mixed_batch(dtype: torch.dtype, d: int, dv: int, heads: tuple[int, int], page: int, new: tuple[int, ...],
                seed: int, capacity: int = 40) -> dict[str, Any]:
    """A packed batch with qv over a paged (page > 0) or contiguous cache; new keys packed by cu_seqlens_k_new."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    batch, (hq, hk) = len(QUERIES), heads
    cu = cumulative(QUERIES)
    total = int(cu[-1])
    args: dict[str, Any] = {"q": randn(total, hq, d), "qv": randn(total, hq, dv), "cu_seqlens_q": cu,
                            "max_seqlen_q": max(QUERIES)}
    if page:
        per = -(-capacity // page)
        blocks = 2 * batch * per
        args["k_cache"], args["v_cache"] = randn(blocks, page, hk, d), randn(blocks, page, hk, dv)
        args["block_table"] = torch.randperm(blocks, generator=gen)[:batch * per].view(batch, per).int()
        capacity = per * page
    else:
        args["k_cache"], args["v_cache"] = randn(batch, capacity, hk, d), randn(batch, capacity, hk, dv)
    lens = [capacity - new[0], 0, capacity // 2, 7]
    args["cache_seqlens"] = torch.tensor([min(n, capacity - m) for n, m in zip(lens, new, strict=True)],
                                         dtype=torch.int32)
    if any(new):
        args["k"], args["v"] = randn(sum(new), hk, d), randn(sum(new), hk, dv)
        args["cu_seqlens_k_new"] = cumulative(new)
    return args


def reference_check(args: dict[str, Any], got: tuple[torch.Tensor, ...], **opts: Any) -> None:
    """out and lse under FlashAttention's rule against the float64 reference; the caches bit for bit."""
    out, lse, k_cache, v_cache = got
    plain = {n: t for n, t in args.items() if n != "max_seqlen_q"}
    wide = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in plain.items()}
    ref = varlen_q_reference(**wide, **opts)
    same = varlen_q_reference(**plain, **opts)
    assert torch.equal(k_cache, same[2]) and torch.equal(v_cache, same[3]), "the new keys landed elsewhere"
    check_out_lse((out[None], lse[None]), (ref[0][None], ref[1][None]), (same[0][None], same[1][None]))


def with_kvcache(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, ...]:
    """The call on copies of the caches: (out, lse, k_cache, v_cache after it)."""
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **opts, return_softmax_lse=True)
    return out, lse, mine["k_cache"], mine["v_cache"]


CASES = [  # (dtype, d, dv, heads, page, new keys per sequence, causal, splits)
    (F32, 16, 48, (4, 2), 16, (0, 0, 0, 0), True, 1),
    (BF16, 32, 64, (4, 1), 16, (2, 1, 0, 3), True, 3),
    (F16, 32, 64, (8, 1), 0, (1, 0, 2, 1), False, 0),
    (F16, 64, 512, (16, 1), 32, (1, 1, 0, 2), True, 2),  # MLA's own dims
    (BF16, 32, 128, (4, 2), 5, (0, 2, 1, 0), True, 0),  # pages no key tile divides (gathered)
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_queries_and_new_keys_take_qv(case: tuple[Any, ...]) -> None:
    dtype, d, dv, heads, page, new, causal, splits = case
    args = mixed_batch(dtype, d, dv, heads, page, new, seed=sum(map(ord, str(case))))
    reference_check(args, with_kvcache(args, causal=causal, num_splits=splits), causal=causal)


def test_the_paged_varlen_form_is_flash_attn_with_kvcache() -> None:
    """vLLM's call with qv: flash_attn_varlen_func(block_table=, seqused_k=, qv=) gives the kvcache call's bits."""
    args = mixed_batch(BF16, 32, 64, (4, 1), 16, (0, 0, 0, 0), seed=3)
    got = lazytriton.flash_attn_varlen_func(args["q"], args["k_cache"], args["v_cache"], args["cu_seqlens_q"], None,
                                            args["max_seqlen_q"], 40, causal=True, seqused_k=args["cache_seqlens"],
                                            block_table=args["block_table"], qv=args["qv"], return_attn_probs=True)
    want = with_kvcache(args, causal=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] is None
    reference_check(args, (*got[:2], args["k_cache"], args["v_cache"]), causal=True)


def packed_keys(dtype: torch.dtype, d: int, dv: int, heads: tuple[int, int], keys: tuple[int, ...],
                seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    cu_q, cu_k = cumulative(QUERIES), cumulative(keys)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    return {"q": torch.randn(total_q, hq, d, generator=gen).to(dtype),
            "k": torch.randn(total_k, hk, d, generator=gen).to(dtype),
            "v": torch.randn(total_k, hk, dv, generator=gen).to(dtype), "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "max_seqlen_q": max(QUERIES), "max_seqlen_k": max(keys),
            "qv": torch.randn(total_q, hq, dv, generator=gen).to(dtype)}


def packed_reference(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence on its own: its queries over its span of the packed keys, a whole contiguous cache."""
    q, qv, k, v, cu_q, cu_k = (args[n] for n in ("q", "qv", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    out = q.new_zeros((*q.shape[:2], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for b in range(cu_q.shape[0] - 1):
        (lo, hi), (first, end) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
        seq = kvcache_reference(q[None, lo:hi], k[None, first:end], v[None, first:end], qv=qv[None, lo:hi], **opts)
        out[lo:hi], lse[:, lo:hi] = seq[0][0], seq[1][0]
    return out, lse


@pytest.mark.parametrize(("dtype", "causal"), [(F16, True), (F32, False)])
def test_packed_keys_take_qv(dtype: torch.dtype, causal: bool) -> None:
    """FlashAttention-3's flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ..., qv=) without a table."""
    args = packed_keys(dtype, 32, 64, (4, 2), (9, 4, 3, 17), seed=5)
    out, lse, _ = lazytriton.flash_attn_varlen_func(**args, causal=causal, return_attn_probs=True)
    wide = {n: t.double() if t is not None and isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for n, t in args.items()}
    ref, same = packed_reference(wide, causal=causal), packed_reference(args, causal=causal)
    check_out_lse((out[None], lse[None]), (ref[0][None], ref[1][None]), (same[0][None], same[1][None]))


# ---------------------------------------------------------------------------
# Bad input: named before anything is written


def _bad(what: str) -> tuple[str, dict[str, Any], type, str]:
    args = mixed_batch(F16, 32, 64, (4, 1), 16, (1, 0, 1, 1), seed=9)
    qv = args["qv"]
    cases: dict[str, tuple[str, dict[str, Any], type, str]] = {
        "qv not packed": ("kvcache", {**args, "qv": qv[None]}, ValueError, "qv must have shape (6, 4, 64)"),
        "qv dtype": ("kvcache", {**args, "qv": qv.float()}, TypeError, "qv must be torch.float16"),
        "qv with float8 caches": ("kvcache", {**args, "k_cache": args["k_cache"].to(torch.float8_e4m3fn),
                                              "v_cache": args["v_cache"].to(torch.float8_e4m3fn)},
                                  ValueError, "qv with a float8 cache"),
        "paged qv shape": ("paged", {**args, "qv": qv[:, :, :32]}, ValueError, "qv must have shape"),
        "paged qv grad": ("paged", {**args, "qv": qv.float().requires_grad_(), "q": args["q"].float(),
                                    "k_cache": args["k_cache"].float(), "v_cache": args["v_cache"].float()},
                          ValueError, "with block_table is forward only"),
        "packed keys without cu_seqlens_k": ("packed", {"cu_seqlens_k": None}, TypeError, "cu_seqlens_k must be"),
        "packed keys of 4 dims": ("packed", {"k": torch.zeros(1, 33, 2, 32, dtype=F16)}, ValueError,
                                  "k must have 3 dims"),
        "packed qv alibi": ("packed", {"alibi_slopes": torch.ones(4)}, ValueError,
                            "alibi_slopes is not taken with qv"),
    }
    return cases[what]


@pytest.mark.parametrize("what", ["qv not packed", "qv dtype", "qv with float8 caches", "paged qv shape",
                                  "paged qv grad", "packed keys without cu_seqlens_k",
                                  "packed keys of 4 dims", "packed qv alibi"])
def test_bad_input_is_named_before_anything_is_written(what: str) -> None:
    form, args, error, needle = _bad(what)
    pattern = needle.replace("(", r"\(").replace(")", r"\)")
    if form == "packed":
        with pytest.raises(error, match=pattern):
            lazytriton.flash_attn_varlen_func(**{**packed_keys(F16, 32, 64, (4, 2), (9, 4, 3, 17), seed=1), **args})
        return
    before = args["k_cache"].clone()
    with pytest.raises(error, match=pattern):
        if form == "kvcache":
            lazytriton.flash_attn_with_kvcache(**args)
        else:
            lazytriton.flash_attn_varlen_func(args["q"], args["k_cache"], args["v_cache"], args["cu_seqlens_q"],
                                              None, 3, 40, seqused_k=args["cache_seqlens"],
                                              block_table=args["block_table"], qv=args["qv"])
    assert torch.equal(args["k_cache"].view(torch.uint8), before.view(torch.uint8)), "nothing written"


# ---------------------------------------------------------------------------
# On the GPU, at MLA's sizes


@gpu
@pytest.mark.parametrize("new", [False, True])
def test_mla_mixed_batch_with_qv_gpu(new: bool) -> None:
    """vLLM's MLA step: packed prefill chunks and decodes, 128 heads, q of 64 and qv of 512, a paged cache of 64."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    counts, pages, page = (17, 1, 1, 4, 0, 1), 256, 64
    cu = cumulative(counts).cuda()
    total = int(cu[-1])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda").to(BF16)

    q, qv = randn(total, 128, 64), randn(total, 128, 512)
    k_cache, v_cache = randn(len(counts) * pages, page, 1, 64), randn(len(counts) * pages, page, 1, 512)
    table = torch.randperm(len(counts) * pages, device="cuda", generator=gen).view(len(counts), pages).int()
    lens = torch.randint(1, pages * page - 8, (len(counts),), generator=gen, device="cuda").int()
    extra: dict[str, Any] = {}
    if new:
        added = (3, 1, 1, 2, 0, 1)
        extra = {"k": randn(sum(added), 1, 64), "v": randn(sum(added), 1, 512), "cu_seqlens_k_new": cumulative(added)}
        extra["cu_seqlens_k_new"] = extra["cu_seqlens_k_new"].cuda()
    args = {"q": q, "qv": qv, "k_cache": k_cache, "v_cache": v_cache, "block_table": table, "cache_seqlens": lens,
            "cu_seqlens_q": cu, "max_seqlen_q": max(counts), **extra}
    got = with_kvcache(args, causal=True)
    on_cpu = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    reference_check(on_cpu, tuple(x.cpu() for x in got), causal=True)
