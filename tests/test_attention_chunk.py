"""FlashAttention-3's ``attention_chunk`` (Llama 4's chunked local attention), forward and backward.

Query i sees key j only when j // C == (i + seqlen_k - seqlen_q) // C (a top-left
causal call: (i) // C), on top of the causal mask and the sliding window, as
FlashAttention-3's ``construct_chunk_mask`` (hopper/test_util.py) has it. Numerics
follow FlashAttention's rule: out and lse at most twice as far from a float64
reference as the same-dtype PyTorch reference is (plus a small floor), gradients
three times. On CPU the kernels run through Triton's interpreter (16-key blocks,
32- and 16-row query blocks), with chunks smaller and larger than those tiles and
not dividing the seqlens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import assert_compiled_grads_equal
from flash_rule import check_rule
from test_flash_bwd import GRAD_FLOOR, grads_of
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, make_qkv, on_gpu, seed_of

import lazytriton
from lazytriton.interface import always_through_op
from lazytriton.kernels import dispatch
from lazytriton.kernels.arguments import MAX_CHUNK
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_fwd import binding
from lazytriton.kernels.flash_fwd.reference import attention_reference, visible
from lazytriton.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

# 1: every query its own chunk of one key; 5, 7: below a key block, dividing no seqlen; 16: the key block;
# 20, 45: across blocks; 64: wider than every sequence below.
CHUNKS = (1, 5, 7, 16, 20, 45, 64)
CAUSAL_MODES: tuple[bool | str, ...] = (False, "bottom_right", "top_left")
WINDOWS = ((-1, -1), (3, -1), (6, 2))
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEADS = ((1, 1), (4, 2), (4, 1))
# Unequal, odd and equal seqlens; more queries than keys leaves bottom-right rows without keys.
SEQLENS = ((37, 45), (45, 37), (40, 40), (1, 33), (70, 20))


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    chunk: int
    causal: bool | str
    window: tuple[int, int]
    heads: tuple[int, int]
    seqlens: tuple[int, int]

    def __str__(self) -> str:
        (hq, hk), (sq, sk) = self.heads, self.seqlens
        return (f"{binding.DTYPES[self.dtype]}-c{self.chunk}-causal_{self.causal}-w{self.window[0]}_{self.window[1]}"
                f"-h{hq}x{hk}-s{sq}x{sk}")


def covering_design() -> list[Case]:
    """21 cases: every (chunk, causal mode) pair once; window, dtype, heads and seqlens rotate around them."""
    return [Case(DTYPES[(c + m) % 3], chunk, causal, WINDOWS[(c + 2 * m) % 3], HEADS[(2 * c + m) % 3],
                 SEQLENS[(c + 3 * m) % 5])
            for c, chunk in enumerate(CHUNKS) for m, causal in enumerate(CAUSAL_MODES)]


def test_covering_design_covers_windows_heads_and_rows_without_keys() -> None:
    cases = covering_design()
    assert {(c.chunk, c.causal) for c in cases} == {(c, m) for c in CHUNKS for m in CAUSAL_MODES}
    assert {c.window for c in cases} == set(WINDOWS) and {c.heads for c in cases} == set(HEADS)
    assert {c.seqlens for c in cases} == set(SEQLENS)
    assert any(_no_key_rows(c).any() for c in cases), "some case must leave rows that see no key"


def _no_key_rows(case: Case) -> torch.Tensor:
    keep = visible(*case.seqlens, case.causal, case.window, attention_chunk=case.chunk)
    assert keep is not None
    return ~keep.any(-1)


# ---------------------------------------------------------------------------
# The reference's mask is FlashAttention-3's


def _fa3_chunk_mask(sq: int, sk: int, chunk: int) -> torch.Tensor:
    """hopper/test_util.py's construct_chunk_mask (True: masked), written as it is there."""
    row = torch.arange(sq)[:, None]
    col = torch.arange(sk)[None, :]
    left = row + sk - sq - (row + sk - sq) % chunk
    return (col < left) | (col >= left + chunk)


@pytest.mark.parametrize(("sq", "sk"), [(5, 13), (13, 5), (9, 9)])
@pytest.mark.parametrize("chunk", [1, 3, 4, 20])
def test_the_reference_mask_is_flash_attention_3s(sq: int, sk: int, chunk: int) -> None:
    keep = visible(sq, sk, False, (-1, -1), attention_chunk=chunk)
    assert keep is not None and torch.equal(keep, ~_fa3_chunk_mask(sq, sk, chunk))
    causal = visible(sq, sk, "bottom_right", (-1, -1), attention_chunk=chunk)
    plain = visible(sq, sk, "bottom_right")
    assert causal is not None and plain is not None and torch.equal(causal, keep & plain)


# ---------------------------------------------------------------------------
# Forward and backward through the interpreter


@pytest.mark.parametrize("case", covering_design(), ids=str)
def test_forward_and_backward_follow_flash_attentions_rule(case: Case) -> None:
    q, k, v = make_qkv(1, case.heads, case.seqlens, 16, case.dtype, seed=seed_of(case))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed_of(case, "do"))).to(case.dtype)
    kwargs: dict[str, Any] = {"causal": case.causal, "window_size": case.window}

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lazytriton.attn_fwd(*leaves, **kwargs, attention_chunk=case.chunk)
    got = torch.autograd.grad(out, leaves, do)

    ref_kwargs = {**kwargs, "attention_chunk": case.chunk}
    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), **ref_kwargs)
    same_out, same_lse = attention_reference(q, k, v, **ref_kwargs)
    no_key = _no_key_rows(case)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse is -inf exactly where a row sees no key"
    assert (out[:, :, no_key] == 0).all() and (got[0][:, :, no_key] == 0).all(), "rows without keys: 0 and dq 0"
    check_rule("out", out, ref_out, same_out, OUT_FLOOR[case.dtype], 2)
    seen = ~torch.isneginf(ref_lse)
    check_rule("lse", lse[seen], ref_lse[seen], same_lse[seen], LSE_FLOOR, 2)

    def ref(*t: torch.Tensor) -> torch.Tensor:
        return attention_reference(*t, **ref_kwargs)[0]

    exact = grads_of(ref, q.double(), k.double(), v.double(), do.double())
    same = grads_of(ref, q, k, v, do)
    for name, g, e, s in zip(("dq", "dk", "dv"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[case.dtype], 3)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_chunks_bottom_right_with_a_window(causal: bool) -> None:
    q, k, v = make_qkv(2, (4, 2), (29, 53), 32, torch.float32, seed=5 + causal)
    out = lazytriton.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal, window_size=(9, 4),
                                     attention_chunk=12)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), causal="bottom_right" if causal else False,
                                 window_size=(9, 4), attention_chunk=12)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=2e-5, rtol=0)


def test_a_chunk_of_zero_is_the_call_without_one() -> None:
    q, k, v = make_qkv(1, (2, 1), (21, 30), 16, torch.float32, seed=3)
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    assert torch.equal(lazytriton.flash_attn_func(*bshd, causal=True, attention_chunk=0),
                       lazytriton.flash_attn_func(*bshd, causal=True))
    call = binding.check(q, k, v, "bottom_right")
    assert binding.with_chunk(call, 0) is call and not call.chunked


def test_a_chunk_wider_than_every_position_is_a_plain_call_on_both_sides_of_zero() -> None:
    """Non-causal with more queries than keys: rows left of key 0 are chunk -1 (no key), the rest chunk 0."""
    q, k, v = make_qkv(1, (1, 1), (30, 12), 16, torch.float32, seed=4)
    out, lse = lazytriton.attn_fwd(q, k, v, causal=False, attention_chunk=1000)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), attention_chunk=1000)
    assert torch.isneginf(lse[0, 0, :18]).all() and torch.isfinite(lse[0, 0, 18:]).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-5, rtol=0)


@pytest.mark.parametrize(("value", "error", "match"), [
    (-1, ValueError, "attention_chunk must be >= 0"),
    (8.0, TypeError, "attention_chunk must be an int"),
    (True, TypeError, "attention_chunk must be an int"),
    ("8", TypeError, "attention_chunk must be an int"),
])
def test_bad_attention_chunk_raises_before_anything_runs(value: Any, error: type[Exception], match: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: Any) -> None:
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(binding, "run_interpreter", no_run)
    q, k, v = make_qkv(1, (1, 1), (8, 8), 16, torch.float32)
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), attention_chunk=value)
    with pytest.raises(error, match=match):
        lazytriton.attn_fwd(q, k, v, attention_chunk=value)


def test_the_call_holds_the_chunk_and_the_offset_of_its_alignment() -> None:
    q, k, v = make_qkv(1, (1, 1), (8, 13), 16, torch.float32)
    assert binding.with_chunk(binding.check(q, k, v, False), 4)[2:4] == (5, binding.check(q, k, v).scale)
    assert binding.with_chunk(binding.check(q, k, v, "top_left"), 4).offset == 0
    assert binding.with_chunk(binding.check(q, k, v, "bottom_right"), 2**40).attention_chunk == MAX_CHUNK


# ---------------------------------------------------------------------------
# Variants, keys and routing


def test_variants_gain_chunk_only_when_set_and_only_on_the_triton_kernels() -> None:
    target = Target.parse("sm_90")
    for kernel in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"):
        plain = dispatch.kernel_variant(kernel, target, "bf16", 128, True, True, 4096, 4096)
        chunked = dispatch.kernel_variant(kernel, target, "bf16", 128, True, True, 4096, 4096, chunk=True)
        assert "CHUNK" not in str(plain) and chunked.get("CHUNK") is True
        assert {n: v for n, v in chunked.functional if n != "CHUNK"} == dict(plain.functional)
        assert (chunked.tuned, chunked.options) == (plain.tuned, plain.options)


def test_memo_keys_of_plain_calls_are_unchanged_and_chunked_ones_differ() -> None:
    shape = binding.Shape(1, 8, 8, 4096, 4096, 128)
    plain = binding.memo_key(0, torch.bfloat16, shape, True, True, False, offset=0, scale=0.088)
    chunked = binding.memo_key(0, torch.bfloat16, shape, True, True, False, offset=0, scale=0.088, chunk=True)
    assert chunked[:8] == plain[:8] and chunked[8:9] == binding.CHUNK_TAG and not binding.gluon_key(chunked)
    assert binding.CHUNK_TAG[0] not in plain
    assert bwd_binding.memo_key(0, torch.bfloat16, shape, True, True, False, chunk=True) != bwd_binding.memo_key(
        0, torch.bfloat16, shape, True, True, False)


def test_chunked_calls_never_take_the_gluon_or_fused_kernels() -> None:
    target = Target.parse("sm_90")
    shape = binding.Shape(1, 16, 16, 8192, 8192, 128)
    variant = binding.variant(target, torch.bfloat16, shape, True, True, False, gluon=True, chunk=True)
    assert variant.kernel == "flash_fwd" and variant.get("CHUNK") is True
    q = torch.empty(1, 16, 8192, 128, dtype=torch.bfloat16, device="meta")
    call = binding.with_chunk(binding.check(q, q, q, "bottom_right"), 8192)
    assert not bwd_binding.fused_fits(call, torch.bfloat16, True, False)
    assert not bwd_binding.gluon_fits(call, torch.bfloat16, True, False)


# ---------------------------------------------------------------------------
# The torch ops and torch.compile


def test_autograd_through_the_op_matches_the_direct_path() -> None:
    q, k, v = make_qkv(1, (2, 1), (23, 31), 16, torch.float32, seed=9)
    results = []
    for through_op in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if through_op:
            with always_through_op():
                out, _ = lazytriton.attn_fwd(*leaves, causal="bottom_right", attention_chunk=6)
        else:
            out, _ = lazytriton.attn_fwd(*leaves, causal="bottom_right", attention_chunk=6)
        results.append((out, *torch.autograd.grad(out.sum(), leaves)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_torch_compile_traces_forward_and_backward_with_a_chunk() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    q, k, v, do = (torch.randn(1, 26, 2, 16, generator=gen) for _ in range(4))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(q * 2, k, v, causal=True, attention_chunk=8) * 3  # type: ignore[no-any-return]

    assert_compiled_grads_equal(fn, (q, k, v), do)


# ---------------------------------------------------------------------------
# Packed sequences


def _cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(("chunk", "causal", "window"), [(7, True, (5, -1)), (16, False, (-1, -1)),
                                                         (3, False, (4, 2)), (40, True, (-1, -1))])
@pytest.mark.parametrize("through_op", [False, True])
def test_varlen_chunks_each_sequence_bottom_right(chunk: int, causal: bool, window: tuple[int, int],
                                                  through_op: bool) -> None:
    lens_q, lens_k = (9, 30, 17, 1), (20, 30, 11, 13)
    gen = torch.Generator().manual_seed(seed_of(chunk, causal, window))
    q, do = (torch.randn(sum(lens_q), 4, 16, generator=gen).half() for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=gen).half() for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kwargs: dict[str, Any] = {"causal": causal, "window_size": window, "attention_chunk": chunk}
    if through_op:
        with always_through_op():
            out = lazytriton.flash_attn_varlen_func(*leaves, _cu(lens_q), _cu(lens_k), 30, 30, **kwargs)
    else:
        out = lazytriton.flash_attn_varlen_func(*leaves, _cu(lens_q), _cu(lens_k), 30, 30, **kwargs)
    got = torch.autograd.grad(out, leaves, do)
    ref_kwargs = {**kwargs, "causal": "bottom_right" if causal else False}
    start_q = start_k = 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        rows, cols = slice(start_q, start_q + lq), slice(start_k, start_k + lk)
        seq = [t[span].transpose(0, 1)[None] for t, span in ((q, rows), (k, cols), (v, cols))]
        seq_do = do[rows].transpose(0, 1)[None]

        def ref(*t: torch.Tensor) -> torch.Tensor:
            return attention_reference(*t, **ref_kwargs)[0]

        exact_out, same_out = ref(*(t.double() for t in seq)), ref(*seq)
        check_rule("out", out[rows].transpose(0, 1)[None], exact_out, same_out, OUT_FLOOR[torch.float16], 2)
        exact = grads_of(ref, *(t.double() for t in seq), seq_do.double())
        same = grads_of(ref, *seq, seq_do)
        for name, g, span, e, s in zip(("dq", "dk", "dv"), got, (rows, cols, cols), exact, same, strict=True):
            check_rule(name, g[span].transpose(0, 1)[None], e, s, GRAD_FLOOR[torch.float16], 3)
        start_q, start_k = start_q + lq, start_k + lk


def test_torch_compile_traces_varlen_with_a_chunk() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(13)
    packed = [torch.randn(21, 2, 16, generator=gen) for _ in range(4)]
    lengths = _cu((9, 12))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_varlen_func(q, k, v, lengths, lengths, 12, 12, causal=True,  # type: ignore
                                                 attention_chunk=5)

    assert_compiled_grads_equal(fn, packed[:3], packed[3])


# ---------------------------------------------------------------------------
# The KV cache (the decoding kernels)


def _paged(cache: torch.Tensor, page: int, table: torch.Tensor) -> torch.Tensor:
    """``cache`` (batch, capacity, heads, dim) as pages of ``page`` keys, sequence b's i-th at table[b, i]."""
    pages = torch.empty(table.numel(), page, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    pages[table.flatten().long()] = cache.reshape(-1, page, *cache.shape[2:])
    return pages


def _kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page: int, gen: torch.Generator,
             kwargs: dict[str, Any]) -> torch.Tensor:
    """``flash_attn_with_kvcache`` over the caches as given (``page`` 0) or as pages of ``page`` keys, shuffled."""
    if not page:
        return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)  # type: ignore[no-any-return]
    table = torch.randperm(k_cache.shape[0] * k_cache.shape[1] // page, generator=gen)
    table = table.reshape(k_cache.shape[0], -1).to(torch.int32)
    return lazytriton.flash_attn_with_kvcache(  # type: ignore[no-any-return]
        q, _paged(k_cache, page, table), _paged(v_cache, page, table), block_table=table, **kwargs)


@pytest.mark.parametrize(("seqlen_q", "chunk", "causal", "window", "splits", "page"), [
    (1, 7, False, (-1, -1), 1, 0), (1, 16, True, (-1, -1), 3, 16), (5, 7, True, (9, -1), 3, 0),
    (5, 20, False, (-1, -1), 2, 8), (4, 3, True, (-1, -1), 0, 4), (6, 64, True, (2, -1), 4, 0)])
def test_kvcache_chunks_bottom_right_over_contiguous_and_paged_caches(seqlen_q: int, chunk: int, causal: bool,
                                                                      window: tuple[int, int], splits: int,
                                                                      page: int) -> None:
    gen = torch.Generator().manual_seed(seed_of(seqlen_q, chunk, causal, splits, page))
    b, hq, hk, d, capacity = 3, 4, 2, 16, 64
    q = torch.randn(b, seqlen_q, hq, d, generator=gen).half()
    k_cache, v_cache = (torch.randn(b, capacity, hk, d, generator=gen).half() for _ in range(2))
    lens = torch.tensor([40, 13, 57], dtype=torch.int32)
    kwargs: dict[str, Any] = {"cache_seqlens": lens, "causal": causal, "window_size": window, "num_splits": splits,
                              "attention_chunk": chunk}
    out = _kvcache(q, k_cache, v_cache, page, gen, kwargs)
    ref_kwargs = {"causal": "bottom_right" if causal else False, "window_size": window, "attention_chunk": chunk}
    for i, length in enumerate(lens.tolist()):
        seq = [q[i:i + 1].transpose(1, 2), *(c[i:i + 1, :length].transpose(1, 2) for c in (k_cache, v_cache))]
        exact = attention_reference(*(t.double() for t in seq), **ref_kwargs)[0]
        same = attention_reference(*seq, **ref_kwargs)[0]
        check_rule(f"out[{i}]", out[i:i + 1].transpose(1, 2), exact, same, OUT_FLOOR[torch.float16], 2)


@pytest.mark.parametrize(("seqlen_q", "chunk", "causal", "window", "splits", "page"), [
    (1, 96, True, (-1, -1), 1, 0), (1, 7, False, (-1, -1), 3, 16), (5, 7, True, (9, -1), 2, 0),
    (4, 16, True, (-1, -1), 0, 4), (3, 5, False, (-1, 2), 3, 8)])
def test_kvcache_chunks_count_from_the_left_pad(seqlen_q: int, chunk: int, causal: bool, window: tuple[int, int],
                                                splits: int, page: int) -> None:
    """FlashAttention-3's reference (``test_flash_attn_kvcache``) shifts a padded sequence's keys by its pad:
    sequence b is its keys cache_leftpad[b] .. length - 1 alone, so its chunks start at the pad."""
    gen = torch.Generator().manual_seed(seed_of(seqlen_q, chunk, causal, splits, page, 1))
    b, hq, hk, d, capacity = 4, 4, 2, 16, 64
    q = torch.randn(b, seqlen_q, hq, d, generator=gen).half()
    k_cache, v_cache = (torch.randn(b, capacity, hk, d, generator=gen).half() for _ in range(2))
    lens = torch.tensor([40, 13, 57, 64], dtype=torch.int32)
    pads = torch.tensor([5, 0, 33, 61], dtype=torch.int32)  # none a multiple of the chunks but 0
    kwargs: dict[str, Any] = {"cache_seqlens": lens, "cache_leftpad": pads, "causal": causal, "window_size": window,
                              "num_splits": splits, "attention_chunk": chunk}
    out = _kvcache(q, k_cache, v_cache, page, gen, kwargs)
    ref_kwargs = {"causal": "bottom_right" if causal else False, "window_size": window, "attention_chunk": chunk}
    for i, (length, pad) in enumerate(zip(lens.tolist(), pads.tolist(), strict=True)):
        seq = [q[i:i + 1].transpose(1, 2), *(c[i:i + 1, pad:length].transpose(1, 2) for c in (k_cache, v_cache))]
        exact = attention_reference(*(t.double() for t in seq), **ref_kwargs)[0]
        same = attention_reference(*seq, **ref_kwargs)[0]
        check_rule(f"out[{i}]", out[i:i + 1].transpose(1, 2), exact, same, OUT_FLOOR[torch.float16], 2)


def test_kvcache_with_packed_queries_and_new_keys_chunks_each_sequence() -> None:
    gen = torch.Generator().manual_seed(21)
    lens_q, hq, hk, d, capacity = (3, 1, 6), 2, 1, 16, 48
    q = torch.randn(sum(lens_q), hq, d, generator=gen)
    k_cache, v_cache = (torch.randn(3, capacity, hk, d, generator=gen) for _ in range(2))
    new_k, new_v = (torch.randn(3, 2, hk, d, generator=gen) for _ in range(2))
    lens = torch.tensor([20, 33, 5], dtype=torch.int32)
    caches = (k_cache.clone(), v_cache.clone())
    out = lazytriton.flash_attn_with_kvcache(q, *caches, new_k, new_v, cache_seqlens=lens, causal=True,
                                             cu_seqlens_q=_cu(lens_q), max_seqlen_q=6, attention_chunk=8,
                                             num_splits=2)
    start = 0
    for i, (lq, length) in enumerate(zip(lens_q, lens.tolist(), strict=True)):
        keys = [torch.cat([c[i, :length], n[i]]).transpose(0, 1)[None].double()
                for c, n in ((k_cache, new_k), (v_cache, new_v))]
        ref, _ = attention_reference(q[start:start + lq].transpose(0, 1)[None].double(), *keys,
                                     causal="bottom_right", attention_chunk=8)
        torch.testing.assert_close(out[start:start + lq].transpose(0, 1)[None].double(), ref, atol=2e-5, rtol=0)
        start += lq


def test_kvcache_chunk_of_zero_and_bad_chunks() -> None:
    gen = torch.Generator().manual_seed(22)
    q, cache = torch.randn(2, 1, 2, 16, generator=gen), torch.randn(2, 30, 2, 16, generator=gen)
    lens = torch.tensor([7, 30], dtype=torch.int32)
    assert torch.equal(lazytriton.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, attention_chunk=0),
                       lazytriton.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens))
    for value, error in ((-2, ValueError), (2.0, TypeError), (None, TypeError)):
        with pytest.raises(error, match="attention_chunk"):
            lazytriton.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, attention_chunk=value)


def test_decode_variants_and_keys_gain_chunk_only_when_set() -> None:
    from lazytriton.kernels.flash_decode import dispatch as decode_dispatch

    target = Target.parse("sm_90")
    plain = decode_dispatch.decode_variant("flash_decode_split", target, "bf16", 128, False, True, 8, 4096)
    chunked = decode_dispatch.decode_variant("flash_decode_split", target, "bf16", 128, False, True, 8, 4096,
                                             chunk=True)
    assert "CHUNK" not in str(plain) and chunked.get("CHUNK") is True
    assert {n: v for n, v in chunked.functional if n != "CHUNK"} == dict(plain.functional)
    combine = decode_dispatch.decode_variant("flash_decode_combine", target, "bf16", 128, False, True, 8, 4096,
                                             chunk=True)
    assert "CHUNK" not in str(combine)


def test_torch_compile_traces_kvcache_with_a_chunk() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(14)
    q, cache = torch.randn(2, 3, 2, 16, generator=gen), torch.randn(2, 30, 2, 16, generator=gen)
    lens = torch.tensor([7, 30], dtype=torch.int32)

    def decode(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, causal=True,  # type: ignore
                                                  attention_chunk=4, num_splits=2)

    assert torch.equal(torch.compile(decode, fullgraph=True, backend="eager")(q, cache), decode(q, cache))


# ---------------------------------------------------------------------------
# Compiling the chunked variants (no GPU needed: Triton compiles for sm_90 and sm_80 here)


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize(("kernel", "window"), [("flash_fwd", False), ("flash_fwd", True), ("flash_bwd_dq", True),
                                                ("flash_bwd_dkdv", False), ("flash_decode_split", True)])
def test_chunked_variants_compile(kernel: str, window: bool, target: str) -> None:
    from test_compile import SHARED_LIMIT, check_elf

    from lazytriton.compiler import compile_variant
    from lazytriton.kernels import get

    parsed = Target.parse(target)
    seqlen_q = 8 if kernel == "flash_decode_split" else 4096
    variant = dispatch.kernel_variant(kernel, parsed, "bf16", 128, True, True, seqlen_q, 4096, window=window,
                                      chunk=True)
    entry = compile_variant(variant)
    check_elf(entry, parsed)
    assert entry.variant == str(variant) and "CHUNK=true" in entry.variant
    assert entry.arg_types == tuple(t for t in get(kernel).signature("bf16", False).values() if t != "constexpr")
    assert 0 < entry.shared <= SHARED_LIMIT[target]


def test_tma_variant_with_a_chunk_compiles() -> None:
    from lazytriton.compiler import compile_variant
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

    variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, True, True, 4096, tma=True,
                                             chunk=True)
    assert variant.get("TMA") is True and variant.get("CHUNK") is True
    entry = compile_variant(variant)
    assert entry.global_scratch_size > 0 and entry.binary[:4] == b"\x7fELF"


# ---------------------------------------------------------------------------
# Prewarm, cache explain and the miss log


def test_prewarm_attention_chunk_adds_the_chunked_variants(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    common = ["prewarm", "--target", "sm_90", "--kernel", "flash_fwd,flash_bwd,flash_decode", "--dtype", "bf16",
              "--head-dim", "128", "--causal", "bottom_right", "--seqlen-q", "4096", "--paged", "contiguous", "--list"]
    assert cli_main(common) == 0
    plain = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines() if ":" in line}
    assert cli_main([*common, "--attention-chunk"]) == 0
    listed = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines() if ":" in line}
    assert set(plain) < set(listed) and not any("CHUNK" in v for v in plain.values())
    chunked = {v.split(":")[0] for k, v in listed.items() if k not in plain}
    assert chunked == {"flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv", "flash_decode_split"}
    assert all("CHUNK=true" in v for k, v in listed.items() if k not in plain)


def test_cache_explain_describes_a_chunked_call(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    assert cli_main(["cache", "explain", "--kernel", "flash_bwd", "--dtype", "bf16", "--head-dim", "128",
                     "--seqlen-q", "8192", "--causal", "bottom_right", "--attention-chunk", "--target", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "attention_chunk (CHUNK=true" in out and "fused backward take no chunk" in out
    assert sum("CHUNK=true" in line for line in out.splitlines() if line.startswith("variant")) == 2
    assert cli_main(["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128",
                     "--seqlen-q", "8", "--seqlen-k", "8192", "--attention-chunk", "--target", "sm_90"]) == 0
    variants = [line for line in capsys.readouterr().out.splitlines() if line.startswith("variant")]
    assert ["CHUNK=true" in line for line in variants] == [True, False]  # the split kernel's, not the combine's


def test_a_chunked_variant_in_the_miss_log_is_planned_again() -> None:
    from lazytriton.prewarm.enumeration import variants_from_misses

    target = Target.parse("sm_90")
    missed = [dispatch.kernel_variant(kernel, target, "bf16", 64, True, True, 1024, 1024, chunk=True)
              for kernel in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")]
    plan, problems = variants_from_misses([json.dumps({"variant": str(v)}) for v in missed])
    assert not problems and [p.variant for p in plan] == missed


# ---------------------------------------------------------------------------
# GPU (``-m gpu``): real sizes (Llama 4's chunk of 8192 keys), preload, the Triton pair routed to


def _gpu_qkv(b: int, s: int, hq: int, hk: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, torch.randn(b, s, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)


@on_gpu
@pytest.mark.parametrize(("seqlen", "chunk", "head_dim"), [(16384, 8192, 128), (4096, 1000, 64), (3000, 128, 128)])
def test_gpu_forward_and_backward_follow_flash_attentions_rule(seqlen: int, chunk: int, head_dim: int) -> None:
    q, k, v, do = _gpu_qkv(1, seqlen, 4, 1, head_dim, seed_of(seqlen, chunk))
    loaded = lazytriton.preload(q, k, causal="bottom_right", layout="bshd", backward=True, attention_chunk=chunk)
    assert loaded and all("CHUNK=true" in variant for variant in loaded)
    assert not any(v.startswith(("flash_fwd_gluon", "flash_bwd_fused", "flash_bwd_prep")) for v in loaded)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lazytriton.flash_attn_func(*leaves, causal=True, attention_chunk=chunk)
    got = torch.autograd.grad(out, leaves, do)
    kwargs: dict[str, Any] = {"causal": "bottom_right", "attention_chunk": chunk}

    def ref(*t: torch.Tensor) -> torch.Tensor:
        return attention_reference(*(x.transpose(1, 2) for x in t), **kwargs)[0].transpose(1, 2)

    exact = grads_of(ref, q.float(), k.float(), v.float(), do.float())
    same = grads_of(ref, q, k, v, do)
    check_rule("out", out, ref(q.float(), k.float(), v.float()), ref(q, k, v), OUT_FLOOR[torch.bfloat16], 2)
    for name, g, e, s in zip(("dq", "dk", "dv"), got, exact, same, strict=True):
        check_rule(name, g, e, s, GRAD_FLOOR[torch.bfloat16], 3)


@on_gpu
@pytest.mark.parametrize("splits", [1, 0, 8])
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_kvcache_with_a_chunk(splits: int, paged: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(splits + 10 * paged)
    b, hq, hk, d, capacity, page, chunk = 4, 32, 8, 128, 16384, 256, 8192
    q = torch.randn(b, 1, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, capacity, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    lens = torch.tensor([1, 8191, 8193, 16384], dtype=torch.int32, device="cuda")
    kwargs: dict[str, Any] = {"cache_seqlens": lens, "num_splits": splits, "attention_chunk": chunk}
    if paged:
        table = torch.randperm(b * capacity // page, device="cuda").reshape(b, -1).to(torch.int32)
        out = lazytriton.flash_attn_with_kvcache(q, _paged(k_cache, page, table), _paged(v_cache, page, table),
                                                 block_table=table, **kwargs)
    else:
        out = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    for i, length in enumerate(lens.tolist()):
        seq = [q[i:i + 1].transpose(1, 2), *(c[i:i + 1, :length].transpose(1, 2) for c in (k_cache, v_cache))]
        exact = attention_reference(*(t.float() for t in seq), attention_chunk=chunk)[0]
        same = attention_reference(*seq, attention_chunk=chunk)[0]
        check_rule(f"out[{i}]", out[i:i + 1].transpose(1, 2), exact, same, OUT_FLOOR[torch.bfloat16], 2)
