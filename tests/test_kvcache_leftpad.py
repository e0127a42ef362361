"""``cache_leftpad`` in ``flash_attn_with_kvcache``: FlashAttention's left-padded KV cache.

Sequence b's keys are cache positions cache_leftpad[b] .. cache_seqlens[b] +
seqlen_new - 1; new keys still land at cache_seqlens[b], and positions stay
absolute, so causal, window and ALiBi are what they are without a pad. The
float64 reference (``kernels/flash_decode/reference.py``) is first checked
against FlashAttention's own test reference (``attention_ref`` with
``key_leftpad``, ``construct_local_mask``, ``attn_bias_from_alibi_slopes``),
transcribed here; then the kernels, through Triton's interpreter, against the
reference with FlashAttention's rule (``test_kvcache.check_against_reference``)
over a covering design: contiguous, cache_batch_idx and paged caches, new
keys or none, causal, windows, softcap, ALiBi, MHA/GQA/MQA, one query and a
few, forced and heuristic split counts, pads of 0, random and the whole
cached length. Then what the flag reaches: bad input, the variant (LEFTPAD
written only when set), the memo key, the op under torch.compile, prewarm,
``cache explain`` and the miss log.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpu
from test_flash_fwd import seed_of
from test_kvcache import DTYPES, HEADS, Case, check_against_reference, make_inputs, run, serving_cache

import lazytriton
from lazytriton import compiler
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, dispatch
from lazytriton.kernels.flash_decode import binding, checks, split_grid
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.prewarm.enumeration import Axes, enumerate_variants, variants_from_misses
from lazytriton.target import Target
from lazytriton.tuning import Table
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

SM90 = Target.parse("sm_90")
DECODE = FAMILIES["flash_decode"]


def cached_lengths(args: dict[str, Any]) -> list[int]:
    """Each sequence's cached length before the new keys (cache_seqlens, else the whole cache)."""
    batch = args["q"].shape[0]
    lens = args.get("cache_seqlens")
    if isinstance(lens, torch.Tensor):
        return [int(x) for x in lens]
    if isinstance(lens, int):
        return [lens] * batch
    table = args.get("block_table")
    return [table.shape[1] * args["k_cache"].shape[1] if table is not None else args["k_cache"].shape[1]] * batch


def with_leftpad(args: dict[str, Any], mode: str, seed: int) -> dict[str, Any]:
    """``args`` with cache_leftpad: "zero", "end" (the cached length: only new keys seen) or "random" (0..cached,
    one sequence at the cached length when it has new keys, so some sequence sees only them)."""
    gen = torch.Generator().manual_seed(seed)
    cached = cached_lengths(args)
    if mode == "zero":
        pads = [0] * len(cached)
    elif mode == "end":
        pads = cached
    else:
        pads = [int(torch.randint(0, c + 1, (1,), generator=gen)) for c in cached]
        pads[-1] = cached[-1] if "k" in args else max(cached[-1] - 3, 0)
    return {**args, "cache_leftpad": torch.tensor(pads, dtype=torch.int32)}


# ---------------------------------------------------------------------------
# The reference is FlashAttention's


def _fa_local_mask(seqlen_q: int, seqlen_k: int, window: tuple[int, int], key_padding_mask: torch.Tensor,
                   key_leftpad: torch.Tensor) -> torch.Tensor:
    """FlashAttention's tests/test_flash_attn.py ``construct_local_mask`` with key_padding_mask and key_leftpad."""
    row_idx = torch.arange(seqlen_q)[:, None]
    col_idx = torch.arange(seqlen_k)[None, None, None, :].expand(key_leftpad.shape[0], 1, 1, seqlen_k)
    pad = key_leftpad[:, None, None, None].long()
    col_idx = torch.where(col_idx >= pad, col_idx - pad, 2**32)
    sk = key_padding_mask.sum(-1)[:, None, None, None]
    if window[0] < 0:
        return col_idx > row_idx + sk - seqlen_q + window[1]  # type: ignore[no-any-return]
    return torch.logical_or(col_idx > torch.minimum(row_idx + sk - seqlen_q + window[1], sk),
                            col_idx < row_idx + sk - seqlen_q - window[0])


def _fa_alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, key_padding_mask: torch.Tensor,
                   causal: bool, key_leftpad: torch.Tensor) -> torch.Tensor:
    """FlashAttention's ``attn_bias_from_alibi_slopes`` with key_padding_mask and key_leftpad."""
    slopes = slopes[:, :, None, None]
    if causal:
        return torch.arange(-seqlen_k + 1, 1, dtype=torch.float64) * slopes
    row_idx = torch.arange(seqlen_q)[:, None]
    col_idx = torch.arange(seqlen_k)[None, None, None, :].expand(key_leftpad.shape[0], 1, 1, seqlen_k)
    pad = key_leftpad[:, None, None, None].long()
    col_idx = torch.where(col_idx >= pad, col_idx - pad, 2**32)
    sk = key_padding_mask.sum(-1)[:, None, None, None]
    return -slopes * (row_idx + sk - seqlen_q - col_idx).abs().to(slopes.dtype)


def fa_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None, cache_seqlens: torch.Tensor, cache_leftpad: torch.Tensor, causal: bool,
                 window: tuple[int, int], softcap: float,
                 alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) as FlashAttention's ``test_flash_attn_kvcache`` computes them with has_leftpad (float64).

    The append (``k_cache_ref[update_mask] = k``), the key padding mask
    (``arange < cache_seqlens + seqlen_new`` and ``arange >= cache_leftpad``),
    then ``attention_ref``: scale, softcap, the padding and local masks, the
    ALiBi bias, softmax; a row whose local mask hides everything gets 0. lse
    is the logsumexp of the same masked, biased scores.
    """
    batch, sq, hq, d = q.shape
    seqlen_k, hk = k_cache.shape[1], k_cache.shape[2]
    new = 0 if k is None else k.shape[1]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    arange = torch.arange(seqlen_k)[None, :]
    lens = cache_seqlens.long()[:, None]
    if k is not None and v is not None:
        update = (arange >= lens) & (arange < lens + new)
        k_ref[update], v_ref[update] = k.reshape(-1, hk, d), v.reshape(-1, hk, v.shape[-1])
    key_padding_mask = (arange < lens + new) & (arange >= cache_leftpad.long()[:, None])
    if causal:
        window = (window[0], 0)
    keys = k_ref.repeat_interleave(hq // hk, dim=2)
    values = v_ref.repeat_interleave(hq // hk, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), keys)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    local = window[0] >= 0 or window[1] >= 0
    if local:
        local_mask = _fa_local_mask(sq, seqlen_k, window, key_padding_mask, cache_leftpad)
        scores = scores.masked_fill(local_mask, float("-inf"))
    if alibi_slopes is not None:
        slopes = alibi_slopes.double() if alibi_slopes.dim() == 2 else alibi_slopes.double().expand(batch, hq)
        scores = scores + _fa_alibi_bias(slopes, sq, seqlen_k, key_padding_mask, causal, cache_leftpad)
    attention = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if local:
        attention = attention.masked_fill(torch.all(local_mask, dim=-1, keepdim=True), 0.0)
    out = torch.einsum("bhts,bshd->bthd", attention, values)
    return out, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize(("causal", "window", "softcap", "alibi", "new"), [
    (False, (-1, -1), 0.0, False, 0), (True, (-1, -1), 0.0, False, 2), (False, (7, 3), 0.0, False, 1),
    (True, (12, 0), 2.0, False, 0), (False, (-1, -1), 0.0, True, 2), (True, (-1, -1), 0.0, True, 1),
    (False, (9, 4), 3.0, True, 0)])
def test_the_reference_is_flash_attentions_with_key_leftpad(causal: bool, window: tuple[int, int], softcap: float,
                                                           alibi: bool, new: int) -> None:
    """Out and lse of the reference equal FlashAttention's test reference (lse: up to ALiBi's causal row constant)."""
    gen = torch.Generator().manual_seed(seed_of(causal, window, softcap, alibi, new))
    batch, sq, hq, hk, d, seqlen_k = 3, 3, 4, 2, 16, 40
    q = torch.randn(batch, sq, hq, d, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(batch, seqlen_k, hk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = ((torch.randn(batch, new, hk, d, generator=gen, dtype=torch.float64) for _ in range(2)) if new
            else (None, None))
    lens = torch.tensor([30, 5, 37 - new], dtype=torch.int32)
    pads = torch.tensor([11, 4, 20], dtype=torch.int32)  # FlashAttention's test draws them in [0, cache_seqlens)
    slopes = torch.rand(batch, hq, generator=gen, dtype=torch.float64) * 0.3 if alibi else None
    want_out, want_lse = fa_reference(q, k_cache, v_cache, k, v, lens, pads, causal, window, softcap, slopes)
    out, lse, k_after, _ = kvcache_reference(q, k_cache, v_cache, k, v, lens, causal=causal, window_size=window,
                                             softcap=softcap, alibi_slopes=slopes, cache_leftpad=pads)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.double()), seen)
    if not (alibi and causal):  # FlashAttention's causal ALiBi bias is -slope |i + offset - j| plus a row constant
        torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-6, atol=1e-6)
    if k is not None:
        assert torch.equal(k_after[0, 30:30 + new], k[0]), "new keys land at cache_seqlens, not after the pad"


def test_a_pad_is_the_cache_without_it() -> None:
    """FlashAttention's kernel starts sequence b's keys at its pad: the padded call is the call on the cache with
    its first cache_leftpad[b] positions cut off (causal, window and ALiBi alike), through the kernels too."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, 32, generator=gen)
    k_cache, v_cache = torch.randn(2, 60, 2, 32, generator=gen), torch.randn(2, 60, 2, 32, generator=gen)
    k, v = torch.randn(2, 2, 2, 32, generator=gen), torch.randn(2, 2, 2, 32, generator=gen)
    lens, pads = torch.tensor([45, 30], dtype=torch.int32), torch.tensor([21, 0], dtype=torch.int32)
    slopes = torch.rand(2, 4, generator=gen) * 0.3
    opts: dict[str, Any] = {"causal": True, "window_size": (17, 0), "alibi_slopes": slopes}
    padded = run({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": lens,
                  "cache_leftpad": pads}, num_splits=3, **opts)
    for b, pad in enumerate((21, 0)):
        cut = {"q": q[b:b + 1], "k_cache": k_cache[b:b + 1, pad:], "v_cache": v_cache[b:b + 1, pad:],
               "k": k[b:b + 1], "v": v[b:b + 1], "cache_seqlens": lens[b:b + 1] - pad}
        alone = run(cut, num_splits=3, **{**opts, "alibi_slopes": slopes[b:b + 1]})
        torch.testing.assert_close(padded[0][b:b + 1], alone[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(padded[1][b:b + 1], alone[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(padded[2][b, pad:], alone[2][0]), "new keys land at cache_seqlens, pad or not"
        ref = kvcache_reference(**{n: t.double() if n != "cache_seqlens" else t for n, t in cut.items()},
                                **{**opts, "alibi_slopes": slopes[b:b + 1]})
        torch.testing.assert_close(alone[0].double(), ref[0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# The kernels against the reference, on CPU through Triton's interpreter


def covering_cases(n: int = 16) -> list[tuple[Case, str]]:
    """Every option of each axis in varied company, each with a pad mode (moduli mostly coprime)."""
    windows = ((-1, -1), (9, 0), (-1, -1), (20, 3), (-1, 5))
    cases = []
    for i in range(n):
        lens = ("tensor", "tensor", "int", "none")[i % 4]
        new = 0 if lens == "none" else (0, 1, 3)[i % 3]
        case = Case(DTYPES[i % 3], (64, 40, 128, 64)[i % 4], (1, 4)[(i // 3) % 2], HEADS[i % 4], new,
                    ("contiguous", "page16", "batch_idx", "page32")[i % 4 if i % 8 < 4 else (i + 1) % 4], lens,
                    bool(i % 2), windows[i % 5], (0.0, 2.0)[(i // 3) % 2], ("", "heads", "batch")[i % 3],
                    (1, 2, 5, 0)[(i // 2) % 4])
        cases.append((case, ("random", "random", "zero", "end", "random")[i % 5]))
    return cases


CASES = covering_cases()


def test_the_covering_design_covers_every_option() -> None:
    for axis, values in (("dtype", DTYPES), ("seqlen_q", (1, 4)), ("heads", HEADS), ("new", (0, 1, 3)),
                         ("layout", ("contiguous", "batch_idx", "page16", "page32")),
                         ("lens", ("tensor", "int", "none")), ("causal", (False, True)), ("softcap", (0.0, 2.0)),
                         ("alibi", ("", "heads", "batch")), ("splits", (0, 1, 2, 5))):
        assert {getattr(c, axis) for c, _ in CASES} == set(values), axis
    assert {c.window for c, _ in CASES} == {(-1, -1), (9, 0), (20, 3), (-1, 5)}
    assert {mode for _, mode in CASES} == {"random", "zero", "end"}
    assert any(c.layout.startswith("page") and c.new and mode == "random" for c, mode in CASES)
    assert any(c.seqlen_q > 1 and c.causal and c.new for c, _ in CASES)


@pytest.mark.parametrize(("case", "mode"), CASES, ids=[f"{c}-pad_{m}" for c, m in CASES])
def test_leftpad_cpu(case: Case, mode: str) -> None:
    seed = seed_of(str(case), mode)
    args = with_leftpad(make_inputs(case, seed=seed), mode, seed)
    got = run(args, causal=case.causal, window_size=case.window, softcap=case.softcap, num_splits=case.splits)
    check_against_reference(args, got, causal=case.causal, window_size=case.window, softcap=case.softcap)


def test_a_pad_at_the_cached_length_sees_only_the_new_keys_or_none() -> None:
    case = Case(torch.float32, 64, 1, (4, 2), 0, "contiguous", "tensor", False, (-1, -1), 0.0, "", 2)
    args = make_inputs(case, seed=1)
    args["cache_seqlens"] = torch.tensor([30, 50], dtype=torch.int32)
    args["cache_leftpad"] = torch.tensor([30, 50], dtype=torch.int32)
    out, lse, _, _ = got = run(args, num_splits=2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    check_against_reference(args, got)
    k, v = torch.randn(2, 2, 2, 64), torch.randn(2, 2, 2, 64)
    appended = {**args, "k": k, "v": v, "cache_seqlens": torch.tensor([30, 48], dtype=torch.int32),
                "cache_leftpad": torch.tensor([30, 48], dtype=torch.int32)}
    got = run(appended, num_splits=1)
    assert torch.isfinite(got[1]).all()
    check_against_reference(appended, got)
    only_new = kvcache_reference(appended["q"], k, v, None, None, 2)  # a cache of just the new keys
    torch.testing.assert_close(got[0], only_new[0], rtol=1e-5, atol=1e-6)


def _split_partials(args: dict[str, Any], splits: int, causal: bool = False) -> torch.Tensor:
    """The split kernel alone (interpreter): each split's base-2 lse, (batch, heads, seqlen_q, splits)."""
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], None, None, args["cache_seqlens"], None,
                      args.get("block_table"), None, args["cache_leftpad"])
    call = checks.check(t, None, causal, checks.NO_WINDOW, 0.0, splits)
    split_c, _ = binding.interpreter_constexprs(call)
    out, lse = binding.empty_outputs(args["q"], call)
    rows = call.batch * call.heads_q * call.seqlen_q
    part_out, part_lse = torch.empty(rows * splits * call.value_dim), torch.empty(rows * splits)
    ints = binding.split_ints(t, out, lse, part_out, part_lse, call, splits, pointers=lambda x: x)
    compiler.interpret("flash_decode_split", split_grid(call.rows, split_c["BLOCK_M"], splits, call.heads_k,
                                                        call.batch), (*ints, *binding.floats(call)), split_c)
    return part_lse.view(call.batch, call.heads_q, call.seqlen_q, splits)


@pytest.mark.parametrize("layout", ["contiguous", "page32"])
def test_a_long_pad_is_cut_into_splits_from_the_pad(layout: str) -> None:
    """Keys 96..255 are 10 blocks of 16: five splits get two each (cut from 0, the first would get only pad)."""
    page = 32 if layout == "page32" else 0
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 4, 32, generator=gen)
    if page:
        k_cache, v_cache = torch.randn(16, page, 2, 32, generator=gen), torch.randn(16, page, 2, 32, generator=gen)
        table = torch.randperm(16, generator=gen).reshape(2, 8).to(torch.int32)
    else:
        k_cache, v_cache = torch.randn(2, 256, 2, 32, generator=gen), torch.randn(2, 256, 2, 32, generator=gen)
        table = None
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": table,
            "cache_seqlens": torch.tensor([256, 256], dtype=torch.int32),
            "cache_leftpad": torch.tensor([96, 96], dtype=torch.int32)}
    partial = _split_partials(args, 5)
    assert torch.isfinite(partial).all(), partial[0, 0, 0]
    for splits in (5, 0):
        check_against_reference(args, run(args, num_splits=splits))


@pytest.mark.parametrize("layout", ["contiguous", "page16"])
def test_the_pad_is_never_read(layout: str) -> None:
    """NaN keys and values before the pad, and (paged) table entries -1 for the pages wholly before it."""
    case = Case(torch.float32, 64, 2, (4, 2), 1, layout, "tensor", True, (-1, -1), 0.0, "heads", 3)
    args = make_inputs(case, seed=2)
    args["cache_seqlens"] = torch.tensor([40, 45], dtype=torch.int32)
    args["cache_leftpad"] = torch.tensor([37, 10], dtype=torch.int32)
    clean = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    for b, pad in enumerate((37, 10)):
        if layout == "contiguous":
            args["k_cache"][b, :pad] = float("nan")
            args["v_cache"][b, :pad] = float("nan")
            clean["k_cache"][b, :pad] = 0.0
            clean["v_cache"][b, :pad] = 0.0
        else:
            for p in range(pad):
                block, row = int(args["block_table"][b, p // 16]), p % 16
                for cache, value in ((args, float("nan")), (clean, 0.0)):
                    cache["k_cache"][block, row] = value
                    cache["v_cache"][block, row] = value
            args["block_table"][b, :pad // 16] = -1  # pages 0..1 of sequence 0: never looked up
    out, lse, _, _ = run(args, causal=True, num_splits=3)
    assert torch.isfinite(out).all()
    ref_out, ref_lse, _, _ = kvcache_reference(**{n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point()
                                                 and n != "alibi_slopes" else t for n, t in clean.items()},
                                               causal=True)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-4, atol=1e-5)


def test_trusted_bad_pads_read_nothing_outside_the_keys() -> None:
    """Unchecked (trusted) pads past the length or below 0: the kernel still reads only [max(pad, 0), length)."""
    case = Case(torch.float32, 64, 1, (2, 2), 0, "page16", "tensor", False, (-1, -1), 0.0, "", 2)
    args = make_inputs(case, seed=4)
    args["cache_seqlens"] = torch.tensor([20, 33], dtype=torch.int32)
    args["cache_leftpad"] = torch.tensor([10**6, -5], dtype=torch.int32)
    args["block_table"][0, :] = -1  # sequence 0 sees nothing: no page of it is looked up
    with lazytriton.kvcache.trusted_indices():
        out, lse, _, _ = run(args, num_splits=2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    zero = {**args, "cache_leftpad": torch.tensor([0], dtype=torch.int32), "block_table": args["block_table"][1:],
            "q": args["q"][1:], "cache_seqlens": args["cache_seqlens"][1:]}
    torch.testing.assert_close(out[1:], run(zero, num_splits=2)[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Bad input: an error naming cache_leftpad, before anything is written or launched


def _valid() -> dict[str, Any]:
    case = Case(torch.float16, 64, 1, (4, 2), 1, "page16", "tensor", False, (-1, -1), 0.0, "", 0)
    args = make_inputs(case, seed=3)
    args["cache_seqlens"] = torch.tensor([5, 40], dtype=torch.int32)
    return {**args, "cache_leftpad": torch.tensor([2, 40], dtype=torch.int32)}


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"cache_leftpad": torch.tensor([2, 3])}, TypeError, r"cache_leftpad must be torch.int32, got torch.int64"),
    ({"cache_leftpad": torch.tensor([2], dtype=torch.int32)}, ValueError,
     r"cache_leftpad must have shape \(2,\) \(batch,\), got \(1,\)"),
    ({"cache_leftpad": torch.zeros(2, 1, dtype=torch.int32)}, ValueError, r"cache_leftpad must have 1 dims"),
    ({"cache_leftpad": torch.zeros(2, dtype=torch.int32, device="meta")}, ValueError,
     r"cache_leftpad is on meta but q is on cpu"),
    ({"cache_leftpad": [0, 0]}, TypeError, r"cache_leftpad must be a torch.Tensor, got list"),
    ({"cache_leftpad": torch.tensor([-1, 0], dtype=torch.int32)}, ValueError,
     r"cache_leftpad\[0\] = -1: must be in 0..5 \(sequence 0's keys start there, and it holds 5 cached keys"),
    ({"cache_leftpad": torch.tensor([2, 41], dtype=torch.int32)}, ValueError, r"cache_leftpad\[1\] = 41: must be in "
                                                                              r"0..40"),
    ({"cache_leftpad": torch.tensor([3, 3], dtype=torch.int32), "cache_seqlens": 2}, ValueError,
     r"cache_leftpad\[0\] = 3: must be in 0..2"),
])
def test_bad_cache_leftpad_is_refused_before_anything_runs(change: dict[str, Any], error: type[Exception],
                                                            match: str, no_launch: None) -> None:
    args = {**_valid(), **change}
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


def test_pages_wholly_before_the_pad_are_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binding, "run_interpreter", lambda *a, **kw: None)
    args = _valid()
    args["cache_leftpad"] = torch.tensor([2, 33], dtype=torch.int32)
    args["block_table"][1, :2] = 99  # keys 0..31 of sequence 1: before its pad
    lazytriton.flash_attn_with_kvcache(**args)
    args["block_table"][1, 2] = 99  # keys 32..47: the pad's page
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = 99 points past the cache: .* sequence 1 uses its "
                                         r"keys 33..40"):
        lazytriton.flash_attn_with_kvcache(**args)


# ---------------------------------------------------------------------------
# Variants, memo keys, the op


def test_leftpad_is_written_in_the_split_variant_only_when_set() -> None:
    plain = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096)
    assert "LEFTPAD" not in str(plain)
    assert decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096,
                                          leftpad=False) == plain
    padded = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096,
                                            leftpad=True)
    assert "LEFTPAD=true" in str(padded)
    assert str(padded).replace(",LEFTPAD=true", "").replace("maxnreg=128,", "") == str(plain)
    assert padded.key() != plain.key()
    assert check_fields(Variant.parse(str(padded))) == padded
    combine = decode_dispatch.decode_variant("flash_decode_combine", SM90, "bf16", 128, False, True, 4, 4096,
                                             leftpad=True)
    assert "LEFTPAD" not in str(combine)
    assert dispatch.kernel_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096, leftpad=True) == \
        padded
    assert "LEFTPAD" not in str(dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, False, True, 128, 128,
                                                        leftpad=True))


def test_the_binding_carries_the_flag_and_the_pointer() -> None:
    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      None, args["block_table"], None, args["cache_leftpad"])
    call = checks.check(t)
    assert call.leftpad and not checks.check(t._replace(cache_leftpad=None)).leftpad
    split, combine = binding.variants(SM90, torch.float16, call, True, False)
    assert split.get("LEFTPAD") is True and "LEFTPAD" not in str(combine)
    assert binding.memo_key(0, torch.float16, call, True, False) != \
        binding.memo_key(0, torch.float16, call._replace(leftpad=False), True, False)
    out, lse = binding.empty_outputs(args["q"], call)
    named = dict(zip(binding.SPLIT_INT_PARAMS, binding.split_ints(t, out, lse, lse, lse, call, 2), strict=True))
    assert named["LeftPad"] == args["cache_leftpad"].data_ptr()
    unpadded = binding.split_ints(t._replace(cache_leftpad=None), out, lse, lse, lse, call, 2)
    assert dict(zip(binding.SPLIT_INT_PARAMS, unpadded, strict=True))["LeftPad"] == lse.data_ptr()
    assert binding.interpreter_constexprs(call)[0]["LEFTPAD"] is True


def test_the_capi_planner_asks_for_the_leftpad_variant() -> None:
    from lazytriton.capi import embedded_kvcache

    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], None, None, args["cache_seqlens"], None,
                      args["block_table"], None, args["cache_leftpad"])
    call = checks.check(t)
    got = embedded_kvcache.plan_variants(90, 1, 64, call.causal, True, False, call.rows, call.capacity,
                                         call.page_size, False, False, False, 64, True)
    assert got == binding.variants(Target("cuda", "90", 32), torch.float16, call, True, False)
    assert got[0].get("LEFTPAD") is True


def test_a_leftpad_variant_compiles_to_what_the_c_launcher_passes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A real sm_90 entry with every flag (Triton's compiler, not the interpreter): the C launcher's 39 pointers
    and integers, then two fp32."""
    from compiled_once import compiled, shared_dir

    from lazytriton.capi import embedded_kvcache

    variant = decode_dispatch.decode_variant("flash_decode_split", SM90, "fp16", 64, True, True, 4, 4096, page_size=64,
                                             paged=True, window=True, softcap=True, alibi=True, leftpad=True)
    entry = compiled(variant, shared_dir(tmp_path_factory))
    embedded_kvcache.check_launch_layout(entry, variant.kernel)
    assert entry.arg_types[binding.SPLIT_INT_PARAMS.index("LeftPad")] == "*i32"


def test_the_op_and_torch_compile_trace_the_pad() -> None:
    torch._dynamo.reset()
    case = Case(torch.float32, 64, 1, (4, 2), 1, "page16", "tensor", True, (-1, -1), 0.0, "", 2)
    args = with_leftpad(make_inputs(case, seed=5), "random", 5)

    def step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor, table: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
        out = lazytriton.flash_attn_with_kvcache(q * 2, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                                 num_splits=2, cache_leftpad=pads)
        read = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + 1, block_table=table,
                                                  cache_leftpad=pads)
        return out * 3 + read  # type: ignore[no-any-return]

    inputs = (args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
              args["block_table"], args["cache_leftpad"])
    eager_k, eager_v = args["k_cache"].clone(), args["v_cache"].clone()
    want = step(args["q"], eager_k, eager_v, *inputs[3:])
    got = torch.compile(step, fullgraph=True, backend="eager")(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(args["k_cache"], eager_k) and torch.equal(args["v_cache"], eager_v)
    op_out, _ = torch.ops.lazytriton.flash_kvcache_read(args["q"], eager_k, eager_v, None, None,
                                                        args["cache_seqlens"] + 1, -1, None, args["block_table"],
                                                        0.125, True, -1, -1, 0.0, None, 0, args["cache_leftpad"])
    plain = lazytriton.flash_attn_with_kvcache(args["q"], eager_k, eager_v, cache_seqlens=args["cache_seqlens"] + 1,
                                               block_table=args["block_table"], cache_leftpad=args["cache_leftpad"],
                                               causal=True)
    torch.testing.assert_close(op_out, plain, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Prewarm, cache explain, the miss log


EMPTY = Table(())


def test_prewarm_plans_leftpad_only_when_asked() -> None:
    plain = enumerate_variants(Axes((SM90,), kernels=DECODE), EMPTY)
    assert not any(dict(p.variant.functional).get("LEFTPAD") for p in plain)
    both = enumerate_variants(Axes((SM90,), kernels=DECODE, leftpad=(False, True)), EMPTY)
    padded = [p.variant for p in both if dict(p.variant.functional).get("LEFTPAD")]
    assert padded and {v.kernel for v in padded} == {"flash_decode_split"}
    assert {p.key for p in plain} < {p.key for p in both}
    planned = {p.key for p in both}
    for dtype, head_dim, causal, rows, page in (("bf16", 128, False, 4, 0), ("fp16", 64, True, 33, 256),
                                                 ("bf16", 64, True, 64, 64)):
        chosen = decode_dispatch.decode_variant("flash_decode_split", SM90, dtype, head_dim, causal, True, rows,
                                                32768, page_size=page, paged=page > 0, table=EMPTY, leftpad=True)
        assert chosen.key() in planned, chosen
    fwd = enumerate_variants(Axes((SM90,), kernels=("flash_fwd",), dtypes=("bf16",), head_dims=(64,),
                                  leftpad=(False, True)), EMPTY)
    assert {p.key for p in fwd} == {p.key for p in enumerate_variants(
        Axes((SM90,), kernels=("flash_fwd",), dtypes=("bf16",), head_dims=(64,)), EMPTY)}


def test_prewarm_cli_takes_leftpad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["prewarm", "--target", "sm_90", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128",
            "--list"]
    assert cli_main(base) == 0
    plain = capsys.readouterr().out
    assert cli_main([*base, "--leftpad"]) == 0
    listed = capsys.readouterr().out
    assert "LEFTPAD=true" not in plain and "LEFTPAD=true" in listed
    assert set(plain.splitlines()) < set(listed.splitlines())
    misses = tmp_path / "misses.jsonl"
    variant = decode_dispatch.decode_variant("flash_decode_split", SM90, "fp16", 64, True, True, 8, 4096,
                                             leftpad=True, window=True)
    misses.write_text(json.dumps({"variant": str(variant), "key": variant.key(), "compile_s": 1.0}) + "\n")
    plan, problems = variants_from_misses(misses.read_text().splitlines(), "m")
    assert not problems and [p.variant for p in plan] == [variant]
    assert cli_main(["prewarm", "--from-misses", str(misses), "--list"]) == 0
    assert capsys.readouterr().out.split()[0] == variant.key()
    assert cli_main(["prewarm", "--from-misses", str(misses), "--leftpad", "--list"]) == 2
    assert "--leftpad cannot narrow it" in capsys.readouterr().err


def test_explain_describes_a_left_padded_call(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4",
            "--seqlen-k", "4096", "--target", "sm_90", "--page-size", "64"]
    assert cli_main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--leftpad", "--json"]) == 0
    padded = json.loads(capsys.readouterr().out)
    assert padded["call"]["leftpad"] is True and plain["call"]["leftpad"] is False
    split, combine = (Variant.parse(k["variant"]) for k in padded["kernels"])
    assert split.get("LEFTPAD") is True and "LEFTPAD" not in str(combine)
    assert str(split).replace(",LEFTPAD=true", "").replace("maxnreg=128,", "") == plain["kernels"][0]["variant"]
    assert padded["kernels"][1]["key"] == plain["kernels"][1]["key"]
    assert cli_main([*args, "--leftpad"]) == 0
    assert "left-padded (cache_leftpad, LEFTPAD=true)" in capsys.readouterr().out
    fwd = ["cache", "explain", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "128", "--target", "sm_90"]
    assert cli_main([*fwd, "--leftpad"]) == 2
    assert "--leftpad is flash_attn_with_kvcache's cache_leftpad" in capsys.readouterr().err
    assert cli_main(["cache", "explain", "--kernel", "kv_append", "--dtype", "bf16", "--head-dim", "64",
                     "--seqlen-q", "1", "--target", "sm_90", "--leftpad", "--json"]) == 0


# ---------------------------------------------------------------------------
# On the GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("paged", "new"), [(False, 0), (True, 0), (False, 1), (True, 3)])
def test_leftpad_gpu_serving_shapes(paged: bool, new: int) -> None:
    """32/8 heads, head dim 128, bf16, pages of 256: random pads up to the length, several splits, the reference."""
    gen = torch.Generator(device="cuda").manual_seed(new + 10 * paged)
    batch, capacity = 8, 8192
    q = torch.randn(batch, 1 + new, 32, 128, device="cuda", generator=gen).bfloat16()
    k_cache, table = serving_cache(batch, capacity, paged, gen)
    v_cache = torch.randn_like(k_cache)
    k = v = None
    if new:
        k = torch.randn(batch, new, 8, 128, device="cuda", generator=gen).bfloat16()
        v = torch.randn_like(k)
    lens = torch.randint(1, capacity - new, (batch,), device="cuda", generator=gen).int()
    pads = torch.minimum((torch.rand(batch, device="cuda", generator=gen) * (lens + 1)).int(), lens)
    pads[0], pads[1] = lens[0], (lens[1] - 300).clamp(min=0)  # no cached key; a long pad, few keys after it
    cpu = {"q": q.cpu(), "k_cache": k_cache.cpu(), "v_cache": v_cache.cpu(), "cache_seqlens": lens.cpu(),
           "block_table": None if table is None else table.cpu(), "cache_leftpad": pads.cpu(),
           "k": None if k is None else k.cpu(), "v": None if v is None else v.cpu()}
    for splits in (0, 7):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = lazytriton.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                      cache_leftpad=pads, causal=True, num_splits=splits,
                                                      return_softmax_lse=True)
        check_against_reference(cpu, (out.cpu(), lse.cpu(), kc.cpu(), vc.cpu()), causal=True)
