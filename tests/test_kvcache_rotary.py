"""Rotary embeddings in ``flash_attn_with_kvcache``: FlashAttention's rotary_cos, rotary_sin, rotary_interleaved
and FlashAttention-3's rotary_seqlens, applied inside the kernels.

New keys are rotated by kv_append on their way into the cache, at positions
base_b + j; the query by the split kernel as it loads it, at base_b + i when
causal or local (a window side bounded within the cache), else all at base_b;
base_b is cache_seqlens[b], or rotary_seqlens[b], and cache_leftpad does not
move it. The float64 reference (``kernels/flash_decode/reference.py``) is first
checked against FlashAttention's own statement of the rule (its test rotates q
and k with ``apply_rotary_emb`` and seqlen_offsets=cache_seqlens, transcribed
here); then the kernels, through Triton's interpreter, against it with
FlashAttention's rule over a covering design: pairs and halves, rotary_dim
below and at the head dim (and widths no multiple of 16), causal, windows and
neither, one query and a few, contiguous, cache_batch_idx, paged and gathered
pages, cache_leftpad, rotary_seqlens, MHA/GQA/MQA, forced and heuristic split
counts. Then what the flag reaches: bad input, the variants (ROTARY and
ROTARY_INTERLEAVED written only when set), the memo keys, the op under
torch.compile, prewarm, ``cache explain``, the miss log and the C planner.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpu
from test_flash_fwd import OUT_FLOOR, seed_of
from test_kvcache import Case, check_out_lse, make_inputs, max_err

import lazytriton
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, dispatch, kv_append
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.kernels.kv_append import binding as append_binding
from lazytriton.prewarm.enumeration import Axes, enumerate_variants, variants_from_misses
from lazytriton.target import Target
from lazytriton.tuning import Table
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

SM90 = Target.parse("sm_90")
DECODE = FAMILIES["flash_decode"]
EMPTY = Table(())


def tables(seqlen_ro: int, rotary_dim: int, dtype: torch.dtype, seed: int = 0,
           device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of random angles, (seqlen_ro, rotary_dim / 2), in ``dtype`` (FlashAttention's test's tables)."""
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return angle.cos().to(dtype).to(device), angle.sin().to(dtype).to(device)


def check_rotary(args: dict[str, Any], got: tuple[torch.Tensor, ...], **opts: Any) -> None:
    """FlashAttention's rule (error <= 2 x the same-dtype reference's + a floor) for out, lse and the rotated keys
    in the cache; v_cache exactly the reference's."""
    out, lse, k_cache, v_cache = got
    wide = {name: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() and name != "alibi_slopes"
                   else t) for name, t in args.items()}
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**wide, **opts)
    same_out, same_lse, same_k, same_v = kvcache_reference(**args, **opts)
    assert torch.equal(v_cache.double(), ref_v), "the new values landed elsewhere"
    k_floor = OUT_FLOOR[k_cache.dtype] * max(1.0, float(ref_k.abs().max()))
    k_err, same_k_err = max_err(k_cache, ref_k), max_err(same_k, ref_k)
    assert k_err <= 2 * same_k_err + k_floor, f"k_cache: max error {k_err:.3g} > 2 x {same_k_err:.3g}"
    check_out_lse((out, lse), (ref_out, ref_lse), (same_out, same_lse))


def run(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, ...]:
    """The call on copies of the caches: (out, lse, k_cache, v_cache after the call)."""
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **opts, return_softmax_lse=True)
    return out, lse, mine["k_cache"], mine["v_cache"]


# ---------------------------------------------------------------------------
# The reference is FlashAttention's


def _fa_rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``flash_attn.layers.rotary.rotate_half``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def fa_apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlen_offsets: torch.Tensor,
                        interleaved: bool) -> torch.Tensor:
    """``apply_rotary_emb(x, cos, sin, seqlen_offsets, interleaved)`` on (batch, seqlen, heads, d): position
    seqlen_offsets[b] + s (``apply_rotary_emb_torch``'s arithmetic, per sequence)."""
    dim = cos.shape[1] * 2
    out = x.clone()
    for b in range(x.shape[0]):
        positions = torch.arange(x.shape[1]) + int(seqlen_offsets[b])
        c, s = cos[positions], sin[positions]
        pattern = (lambda t: t.repeat_interleave(2, dim=-1)) if interleaved else (lambda t: torch.cat((t, t), -1))
        c, s = pattern(c)[:, None, :], pattern(s)[:, None, :]
        part = x[b, ..., :dim]
        out[b, ..., :dim] = part * c + _fa_rotate_half(part, interleaved) * s
    return out


@pytest.mark.parametrize(("interleaved", "causal", "window", "rotary_dim"), [
    (True, False, (-1, -1), 16), (False, False, (-1, -1), 32), (True, True, (-1, -1), 32), (False, True, (-1, -1), 16),
    (True, False, (5, -1), 16), (False, False, (-1, 2), 32), (True, False, (60, -1), 16)])
def test_the_reference_is_flash_attentions_rotary(interleaved: bool, causal: bool, window: tuple[int, int],
                                                  rotary_dim: int) -> None:
    """FlashAttention's test rotates q and k outside the call (q of a causal or local call at cache_seqlens + i,
    else all of it at cache_seqlens) and attends over the rotated inputs: the reference with rotary equals that.
    A window side of the cache's length or more bounds nothing: not local (the (60, -1) case)."""
    gen = torch.Generator().manual_seed(seed_of(interleaved, causal, window, rotary_dim))
    batch, sq, hq, hk, d, seqlen_k, new = 2, 3, 4, 2, 32, 40, 3
    q = torch.randn(batch, sq, hq, d, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(batch, seqlen_k, hk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, new, hk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    lens = torch.tensor([30, 5], dtype=torch.int32)
    cos, sin = tables(seqlen_k, rotary_dim, torch.float64, seed=3)
    if causal or window != (-1, -1) and min(w for w in window if w >= 0) < seqlen_k:
        q_ro = fa_apply_rotary_emb(q, cos, sin, lens, interleaved)
    else:
        q_ro = fa_apply_rotary_emb(q.reshape(batch, 1, sq * hq, d), cos, sin, lens, interleaved).reshape(q.shape)
    k_ro = fa_apply_rotary_emb(k, cos, sin, lens, interleaved)
    opts: dict[str, Any] = {"causal": causal, "window_size": window}
    want = kvcache_reference(q_ro, k_cache, v_cache, k_ro, v, lens, **opts)
    got = kvcache_reference(q, k_cache, v_cache, k, v, lens, rotary_cos=cos, rotary_sin=sin,
                            rotary_interleaved=interleaved, **opts)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_rotary_seqlens_and_leftpad_in_the_reference() -> None:
    """rotary_seqlens replaces cache_seqlens as the base (FlashAttention-3's seqlen_rotary); cache_leftpad moves
    nothing (FlashAttention-2's kernel rotates at leftpad + seqlen_k_cache = cache_seqlens)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 2, 16, generator=gen, dtype=torch.float64)
    k_cache, v_cache = torch.randn(2, 30, 2, 16, dtype=torch.float64), torch.randn(2, 30, 2, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 16, dtype=torch.float64), torch.randn(2, 2, 2, 16, dtype=torch.float64)
    lens, bases = torch.tensor([10, 3], dtype=torch.int32), torch.tensor([40, 0], dtype=torch.int32)
    cos, sin = tables(64, 16, torch.float64)
    opts: dict[str, Any] = {"causal": True, "rotary_cos": cos, "rotary_sin": sin}
    moved = kvcache_reference(q, k_cache, v_cache, k, v, lens, rotary_seqlens=bases, **opts)
    by_hand = kvcache_reference(fa_apply_rotary_emb(q, cos, sin, bases, True), k_cache, v_cache,
                                fa_apply_rotary_emb(k, cos, sin, bases, True), v, lens, causal=True)
    for mine, theirs in zip(moved, by_hand, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    padded = kvcache_reference(q, k_cache, v_cache, k, v, lens, cache_leftpad=torch.tensor([4, 1], dtype=torch.int32),
                               **opts)
    plain = kvcache_reference(q, k_cache, v_cache, k, v, lens, **opts)
    torch.testing.assert_close(padded[2], plain[2], rtol=0, atol=0)  # the same rotated keys, pad or not


# ---------------------------------------------------------------------------
# The kernels against the reference, on CPU through Triton's interpreter


@dataclass(frozen=True)
class Rotary:
    interleaved: bool
    dim: int  # 0: the head dim
    bases: bool  # rotary_seqlens given
    leftpad: bool


def rotary_args(case: Case, rot: Rotary, seed: int) -> dict[str, Any]:
    """``make_inputs``'s call with rotary tables covering every position (and rotary_seqlens, cache_leftpad)."""
    args = make_inputs(case, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = args["q"].shape[0]
    capacity = (args["block_table"].shape[1] * args["k_cache"].shape[1] if "block_table" in args
                else args["k_cache"].shape[1])
    seqlen_ro = capacity + case.seqlen_q
    args["rotary_cos"], args["rotary_sin"] = tables(seqlen_ro, rot.dim or case.head_dim, case.dtype, seed)
    lens = args["cache_seqlens"]
    cached = [int(x) for x in lens] if isinstance(lens, torch.Tensor) else [lens] * batch
    if rot.bases:
        span = max(case.new, case.seqlen_q)
        args["rotary_seqlens"] = torch.randint(0, seqlen_ro - span + 1, (batch,), generator=gen, dtype=torch.int32)
    if rot.leftpad:
        args["cache_leftpad"] = torch.tensor([int(torch.randint(0, c + 1, (1,), generator=gen)) for c in cached],
                                             dtype=torch.int32)
    return args


def covering_cases(n: int = 14) -> list[tuple[Case, Rotary]]:
    """Every option of each axis in varied company (moduli mostly coprime); new keys always (rotary needs them)."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    heads = ((4, 2), (4, 1), (2, 2), (6, 3))
    windows = ((-1, -1), (9, 0), (-1, -1), (20, 3), (-1, 5), (100, -1))
    cases = []
    for i in range(n):
        head_dim = (64, 40, 64, 32)[i % 4]
        case = Case(dtypes[i % 3], head_dim, (1, 3)[(i // 2) % 2], heads[i % 4], (1, 3)[i % 2],
                    ("contiguous", "page16", "batch_idx", "page32", "page8")[i % 5], ("tensor", "tensor", "int")[i % 3],
                    (False, True, False)[i % 3], windows[i % 6], (0.0, 2.0)[(i // 3) % 2], ("", "heads", "")[i % 3],
                    (0, 1, 3, 2)[(i // 2) % 4])
        rot = Rotary(bool(i % 2 == 0) != bool(i // 7), (0, 16, 6, 0, 20)[i % 5], i % 4 == 3, i % 3 == 1)
        cases.append((case, rot))
    return cases


CASES = covering_cases()


def test_the_covering_design_covers_every_option() -> None:
    for axis, values in (("dtype", {torch.float16, torch.bfloat16, torch.float32}), ("seqlen_q", {1, 3}),
                         ("new", {1, 3}), ("causal", {False, True}), ("splits", {0, 1, 2, 3}),
                         ("layout", {"contiguous", "batch_idx", "page16", "page32", "page8"}),
                         ("lens", {"tensor", "int"}), ("heads", {(4, 2), (4, 1), (2, 2), (6, 3)})):
        assert {getattr(c, axis) for c, _ in CASES} == values, axis
    assert {c.window for c, _ in CASES} == {(-1, -1), (9, 0), (20, 3), (-1, 5), (100, -1)}
    assert {r.interleaved for _, r in CASES} == {False, True} and {r.dim for _, r in CASES} == {0, 16, 6, 20}
    assert {r.bases for _, r in CASES} == {False, True} and {r.leftpad for _, r in CASES} == {False, True}
    assert any(c.seqlen_q > 1 and not c.causal and c.window == (-1, -1) for c, _ in CASES)  # q at one position
    assert any(c.seqlen_q > 1 and c.window == (100, -1) for c, _ in CASES)  # a window past the cache: not local
    assert any(c.seqlen_q > 1 and c.causal for c, _ in CASES) and any(r.dim == 6 and r.interleaved is False
                                                                      for _, r in CASES)


@pytest.mark.parametrize(("case", "rot"), CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_rotary_cpu(case: Case, rot: Rotary) -> None:
    seed = seed_of(str(case), str(rot))
    args = rotary_args(case, rot, seed)
    opts: dict[str, Any] = {"causal": case.causal, "window_size": case.window, "softcap": case.softcap,
                            "rotary_interleaved": rot.interleaved}
    got = run(args, num_splits=case.splits, **opts)
    check_rotary(args, got, **opts)


@pytest.mark.parametrize("new", ["none", "one", "packed"])
def test_kv_append_is_the_last_launch_before_a_rotary_split_kernel(new: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotary call's split kernel is kv_append's programmatic dependent (flash_decode's PDL): kv_append is the
    launch right before it, also with no new key (one block a sequence, writing nothing), and packed new keys'
    lengths are computed before it. The result holds: FlashAttention's rule against the float64 reference; packed
    keys as the same keys unpacked."""
    from lazytriton import compiler
    from lazytriton.kernels.flash_decode import values

    order: list[tuple[str, Any]] = []
    interpret, lengths = compiler.interpret, values.lengths

    def spy_interpret(name: str, grid: Any, *rest: Any, **kw: Any) -> Any:
        order.append((name, grid))
        return interpret(name, grid, *rest, **kw)

    def spy_lengths(*a: Any) -> Any:
        order.append(("lengths", None))
        return lengths(*a)

    monkeypatch.setattr(compiler, "interpret", spy_interpret)
    monkeypatch.setattr(values, "lengths", spy_lengths)
    case = Case(torch.float32, 32, 1, (4, 2), 0 if new == "none" else 1, "contiguous", "tensor", True, (-1, -1),
                0.0, "", 2)
    args = rotary_args(case, Rotary(False, 0, False, False), seed=5)
    if new == "none":
        args["k"], args["v"] = (torch.zeros(2, 0, 2, 32) for _ in range(2))
    got = run({**args, "k": args["k"].flatten(0, 1), "v": args["v"].flatten(0, 1),
               "cu_seqlens_k_new": torch.tensor([0, 1, 2], dtype=torch.int32)} if new == "packed" else args,
              causal=True, num_splits=2)
    names = [name for name, _ in order]
    at = names.index("kv_append")
    assert names[at + 1] == "flash_decode_split" and names.count("kv_append") == 1, names
    assert order[at][1][0] >= 1 and ("lengths" not in names or names.index("lengths") < at), order
    if new == "packed":
        want = run(args, causal=True, num_splits=2)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(got, want, strict=True))
    else:
        check_rotary(args, got, causal=True)
        if new == "none":
            assert torch.equal(got[2], args["k_cache"]) and torch.equal(got[3], args["v_cache"])


def test_rotated_keys_are_rounded_once_from_float32() -> None:
    """kv_append rotates in float32 and rounds once to the cache's dtype, as FlashAttention's kernels do: on the CPU
    the cache holds exactly the same-dtype reference's keys."""
    case = Case(torch.bfloat16, 64, 2, (4, 2), 3, "page16", "tensor", True, (-1, -1), 0.0, "", 2)
    for interleaved in (True, False):
        args = rotary_args(case, Rotary(interleaved, 0, False, False), 9)
        got = run(args, causal=True, rotary_interleaved=interleaved)
        same = kvcache_reference(**args, causal=True, rotary_interleaved=interleaved)
        assert torch.equal(got[2], same[2]) and torch.equal(got[3], same[3])


def test_rotary_inside_is_the_call_on_inputs_rotated_outside() -> None:
    """The kernels' rotary equals FlashAttention's test's way (apply_rotary_emb on q and k, then the call without
    rotary), through the kernels both times; non-causal: every query at cache_seqlens."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(2, 3, 4, 32, generator=gen)
    k_cache, v_cache = torch.randn(2, 48, 2, 32, generator=gen), torch.randn(2, 48, 2, 32, generator=gen)
    k, v = torch.randn(2, 2, 2, 32, generator=gen), torch.randn(2, 2, 2, 32, generator=gen)
    lens = torch.tensor([17, 40], dtype=torch.int32)
    cos, sin = tables(64, 24, torch.float32, seed=2)
    for causal, interleaved in ((False, True), (True, False)):
        inside = run({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": lens},
                     causal=causal, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, num_splits=2)
        q_ro = (fa_apply_rotary_emb(q, cos, sin, lens, interleaved) if causal
                else fa_apply_rotary_emb(q.reshape(2, 1, 12, 32), cos, sin, lens, interleaved).reshape(q.shape))
        outside = run({"q": q_ro, "k_cache": k_cache, "v_cache": v_cache, "v": v, "cache_seqlens": lens,
                       "k": fa_apply_rotary_emb(k, cos, sin, lens, interleaved)}, causal=causal, num_splits=2)
        for mine, theirs in zip(inside, outside, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_a_strided_table_is_read_as_its_values() -> None:
    case = Case(torch.float32, 32, 2, (2, 1), 1, "contiguous", "tensor", True, (-1, -1), 0.0, "", 1)
    args = rotary_args(case, Rotary(True, 0, False, False), 5)
    wide = torch.randn(args["rotary_cos"].shape[0], 32)
    wide[:, ::2] = args["rotary_cos"]
    strided = {**args, "rotary_cos": wide[:, ::2]}
    assert not strided["rotary_cos"].is_contiguous()
    for mine, theirs in zip(run(strided, causal=True), run(args, causal=True), strict=True):
        assert torch.equal(mine, theirs)


def test_trusted_positions_past_the_tables_are_left_unrotated() -> None:
    """Unchecked (trusted_indices) positions outside rotary_cos read nothing: that row is kept as it is."""
    case = Case(torch.float32, 32, 1, (2, 1), 1, "contiguous", "tensor", False, (-1, -1), 0.0, "", 1)
    args = rotary_args(case, Rotary(True, 0, False, False), 6)
    seqlen_ro = args["rotary_cos"].shape[0]
    args["rotary_seqlens"] = torch.tensor([seqlen_ro + 3, -5], dtype=torch.int32)
    with lazytriton.kvcache.trusted_indices():
        out, lse, k_cache, _ = run(args)
    plain = run({n: t for n, t in args.items() if not n.startswith("rotary")})
    assert torch.equal(k_cache, plain[2]) and torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


# ---------------------------------------------------------------------------
# Bad input


def _valid() -> dict[str, Any]:
    case = Case(torch.float16, 64, 2, (4, 2), 1, "page16", "tensor", True, (-1, -1), 0.0, "", 0)
    args = make_inputs(case)
    args["cache_seqlens"] = torch.tensor([5, 40], dtype=torch.int32)
    args["rotary_cos"], args["rotary_sin"] = tables(64, 64, torch.float16)
    return args


def _short(a: dict[str, Any], rows: int) -> dict[str, Any]:
    return {**a, "rotary_cos": a["rotary_cos"][:rows], "rotary_sin": a["rotary_sin"][:rows]}


BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("cos_dtype", lambda a: {**a, "rotary_cos": a["rotary_cos"].float()}, TypeError,
     r"rotary_cos has dtype torch.float32 but q has torch.float16"),
    ("sin_dtype", lambda a: {**a, "rotary_sin": a["rotary_sin"].bfloat16()}, TypeError, r"rotary_sin has dtype"),
    ("cos_rank", lambda a: {**a, "rotary_cos": a["rotary_cos"][0]}, ValueError,
     r"rotary_cos must have 2 dims \(seqlen_ro, rotary_dim / 2\), got shape \(32,\)"),
    ("cos_device", lambda a: {**a, "rotary_cos": a["rotary_cos"].to("meta")}, ValueError,
     "rotary_cos is on meta but q is on cpu"),
    ("cos_list", lambda a: {**a, "rotary_cos": [[1.0]]}, TypeError, "rotary_cos must be a torch.Tensor, got list"),
    ("sin_shape", lambda a: {**a, "rotary_sin": a["rotary_sin"][:, :8]}, ValueError,
     r"rotary_sin must have rotary_cos's shape \(64, 32\) \(seqlen_ro, rotary_dim / 2\), got \(64, 8\)"),
    ("rotary_dim_past_head_dim", lambda a: {**a, "rotary_cos": torch.ones(64, 40, dtype=torch.float16),
                                            "rotary_sin": torch.ones(64, 40, dtype=torch.float16)}, ValueError,
     r"rotary_dim \(2 x rotary_cos.shape\[1\]\) must be in 2..64 \(q's head dim\), got 80"),
    ("rotary_dim_zero", lambda a: {**a, "rotary_cos": torch.ones(64, 0, dtype=torch.float16),
                                   "rotary_sin": torch.ones(64, 0, dtype=torch.float16)}, ValueError,
     r"rotary_dim \(2 x rotary_cos.shape\[1\]\) must be in 2..64 \(q's head dim\), got 0"),
    ("cos_alone", lambda a: {**a, "rotary_sin": None}, ValueError,
     "rotary_cos and rotary_sin must be given together, got only rotary_cos"),
    ("sin_alone", lambda a: {**a, "rotary_cos": None}, ValueError, "got only rotary_sin"),
    ("no_new_keys", lambda a: {**a, "k": None, "v": None}, ValueError, r"rotary_cos and rotary_sin need new keys"),
    ("interleaved_int", lambda a: {**a, "rotary_interleaved": 1}, TypeError, "rotary_interleaved must be a bool"),
    ("short_tables", lambda a: _short(a, 41), ValueError,
     r"rotary_cos has 41 positions \(seqlen_ro\) but sequence 1 rotates positions 40..41 \(cache_seqlens\[1\] = 40\): "
     r"seqlen_ro must be at least 42"),
    ("short_tables_int_lens", lambda a: {**_short(a, 10), "cache_seqlens": 9}, ValueError,
     r"rotary_cos has 10 positions \(seqlen_ro\) but the call rotates positions 9..10 \(cache_seqlens = 9\)"),
    ("bases_past_tables", lambda a: {**a, "rotary_seqlens": torch.tensor([0, 63], dtype=torch.int32)}, ValueError,
     r"rotary_seqlens\[1\] = 63: must be in 0..62 \(rotary_cos holds 64 positions, and sequence 1 rotates 2"),
    ("bases_negative", lambda a: {**a, "rotary_seqlens": torch.tensor([-1, 0], dtype=torch.int32)}, ValueError,
     r"rotary_seqlens\[0\] = -1"),
    ("bases_int64", lambda a: {**a, "rotary_seqlens": torch.tensor([0, 1])}, TypeError,
     "rotary_seqlens must be torch.int32"),
    ("bases_shape", lambda a: {**a, "rotary_seqlens": torch.zeros(3, dtype=torch.int32)}, ValueError,
     r"rotary_seqlens must have shape \(2,\) \(batch,\)"),
    ("bases_without_tables", lambda a: {**a, "rotary_cos": None, "rotary_sin": None,
                                        "rotary_seqlens": torch.zeros(2, dtype=torch.int32)}, ValueError,
     "rotary_seqlens needs rotary_cos and rotary_sin"),
    ("unknown_keyword", lambda a: {**a, "rotary_base": 10000.0}, TypeError,
     "unexpected keyword argument 'rotary_base'"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_rotary_input_is_refused_before_anything_is_written(name: str, change: Any, error: type[Exception],
                                                               match: str, no_launch: None) -> None:
    args = change(_valid())
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_with_kvcache(**args, causal=True)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


def test_the_tables_cover_the_positions_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal with 2 queries and 1 new key: sequence b rotates cache_seqlens[b] .. + 1 (its queries'), so 42 rows
    serve lengths up to 40; non-causal every query sits at cache_seqlens: 41 rows serve."""
    monkeypatch.setattr(binding, "run_interpreter", lambda *a, **kw: None)
    monkeypatch.setattr(append_binding, "append", lambda *a: None)
    lazytriton.flash_attn_with_kvcache(**_short(_valid(), 42), causal=True)
    lazytriton.flash_attn_with_kvcache(**_short(_valid(), 41), causal=False)
    with pytest.raises(ValueError, match="seqlen_ro must be at least 42"):
        lazytriton.flash_attn_with_kvcache(**_short(_valid(), 41), causal=False, window_size=(3, -1))
    with lazytriton.kvcache.trusted_indices():  # the value check is skipped, as the other index checks are
        lazytriton.flash_attn_with_kvcache(**_short(_valid(), 41), causal=True)


# ---------------------------------------------------------------------------
# Variants, memo keys, the op


def test_rotary_is_written_in_the_variants_only_when_set() -> None:
    plain = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096)
    assert "ROTARY" not in str(plain)
    assert decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096,
                                          rotary_interleaved=True) == plain  # read only with rotary
    halves = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096,
                                            rotary=True)
    pairs = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096,
                                           rotary=True, rotary_interleaved=True)
    # a feature's split variant also caps its registers (dispatch.capped_registers)
    assert str(halves).replace(",ROTARY=true", "").replace("maxnreg=128,", "") == str(plain)
    assert "ROTARY_INTERLEAVED" not in str(halves)
    assert str(pairs).replace(",ROTARY=true,ROTARY_INTERLEAVED=true", "").replace("maxnreg=128,", "") == str(plain)
    assert len({plain.key(), halves.key(), pairs.key()}) == 3
    for v in (halves, pairs):
        assert check_fields(Variant.parse(str(v))) == v
    combine = decode_dispatch.decode_variant("flash_decode_combine", SM90, "bf16", 128, False, True, 4, 4096,
                                             rotary=True, rotary_interleaved=True)
    assert "ROTARY" not in str(combine)
    append_plain = kv_append.variant(SM90, "bf16", 128, 0, True, True, False)
    append_pairs = kv_append.variant(SM90, "bf16", 128, 0, True, True, False, True, True)
    assert "ROTARY" not in str(append_plain)
    assert str(append_pairs).replace(",ROTARY=true,ROTARY_INTERLEAVED=true", "") == str(append_plain)
    assert check_fields(Variant.parse(str(append_pairs))) == append_pairs
    assert dispatch.kernel_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096, rotary=True,
                                   rotary_interleaved=True) == pairs
    assert dispatch.kernel_variant("kv_append", SM90, "bf16", 128, False, True, 1, 1, paged=True, rotary=True,
                                   rotary_interleaved=True) == append_pairs
    assert "ROTARY" not in str(dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, False, True, 128, 128,
                                                       rotary=True))


def test_the_bindings_carry_the_flags_and_the_pointers() -> None:
    args = _valid()
    args["rotary_seqlens"] = torch.tensor([1, 2], dtype=torch.int32)
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table", "alibi_slopes",
             "cache_leftpad", "rotary_cos", "rotary_sin", "rotary_seqlens")
    t = checks.Inputs(*(args.get(n) for n in names))
    call = checks.check(t, None, True, checks.NO_WINDOW, 0.0, 0, False)
    assert (call.rotary_dim, call.rotary_interleaved, call.seqlen_ro, call.rotary_per_query,
            call.rotary_seqlens) == (64, False, 64, True, True)
    plain = checks.check(t._replace(rotary_cos=None, rotary_sin=None, rotary_seqlens=None), None, True)
    assert not plain.rotary and not plain.rotary_interleaved
    split, combine = binding.variants(SM90, torch.float16, call, True, False)
    assert split.get("ROTARY") is True and "ROTARY_INTERLEAVED" not in str(split) and "ROTARY" not in str(combine)
    keys = {binding.memo_key(0, torch.float16, c, True, False) for c in
            (call, plain, call._replace(rotary_interleaved=True))}
    assert len(keys) == 3
    assert append_binding.memo_key(0, torch.float16, call, True, False) != \
        append_binding.memo_key(0, torch.float16, plain, True, False)
    out, lse = binding.empty_outputs(args["q"], call)
    named = dict(zip(binding.SPLIT_INT_PARAMS, binding.split_ints(t, out, lse, lse, lse, call, 2), strict=True))
    assert (named["RotaryCos"], named["RotarySin"], named["RotarySeqlens"]) == tuple(
        args[n].data_ptr() for n in ("rotary_cos", "rotary_sin", "rotary_seqlens"))
    assert (named["rotary_dim"], named["seqlen_ro"], named["use_rotary_seqlens"], named["rotary_per_query"]) == \
        (64, 64, 1, 1)
    appended = dict(zip(kv_append.INT_PARAMS, append_binding.ints(t, call), strict=True))
    assert appended["RotaryCos"] == args["rotary_cos"].data_ptr() and appended["rotary_dim"] == 64
    bare = dict(zip(binding.SPLIT_INT_PARAMS, binding.split_ints(t._replace(rotary_cos=None, rotary_sin=None,
                                                                            rotary_seqlens=None), out, lse, lse,
                                                                 lse, plain, 2), strict=True))
    assert bare["RotaryCos"] == args["q"].data_ptr() and bare["rotary_dim"] == 0
    assert binding.interpreter_constexprs(call)[0]["ROTARY"] is True
    assert append_binding.interpreter_constexprs(call)["ROTARY"] is True


@pytest.mark.parametrize(("causal", "window", "seqlen_q", "per_query"), [
    (False, (-1, -1), 3, False), (True, (-1, -1), 3, True), (False, (5, -1), 3, True), (False, (-1, 0), 3, True),
    (False, (64, -1), 3, False), (False, (63, -1), 3, True), (True, (-1, -1), 1, False)])
def test_which_calls_rotate_each_query_at_its_own_position(causal: bool, window: tuple[int, int], seqlen_q: int,
                                                           per_query: bool) -> None:
    """FlashAttention-2's rule: causal or local, local being a window side below the cache's length (64 here)."""
    args = _valid()
    args["q"] = args["q"][:, :1].expand(-1, seqlen_q, -1, -1)
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      None, args["block_table"], None, None, args["rotary_cos"], args["rotary_sin"])
    assert checks.check(t, None, causal, window).rotary_per_query is per_query


def test_the_op_and_torch_compile_trace_rotary() -> None:
    torch._dynamo.reset()
    case = Case(torch.float32, 32, 2, (4, 2), 1, "page16", "tensor", True, (-1, -1), 0.0, "", 2)
    args = rotary_args(case, Rotary(False, 16, True, True), 5)

    def step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor, table: torch.Tensor, pads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             bases: torch.Tensor) -> torch.Tensor:
        out = lazytriton.flash_attn_with_kvcache(q * 2, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                                 causal=True, num_splits=2, cache_leftpad=pads, rotary_cos=cos,
                                                 rotary_sin=sin, rotary_interleaved=False, rotary_seqlens=bases)
        again = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens // 2,
                                                   block_table=table, rotary_cos=cos, rotary_sin=sin)
        return out * 3 + again  # type: ignore[no-any-return]

    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "cache_leftpad", "rotary_cos",
             "rotary_sin", "rotary_seqlens")
    inputs = tuple(args[n] for n in names)
    eager_k, eager_v = args["k_cache"].clone(), args["v_cache"].clone()
    want = step(args["q"], eager_k, eager_v, *inputs[3:])
    got = torch.compile(step, fullgraph=True, backend="eager")(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(args["k_cache"], eager_k) and torch.equal(args["v_cache"], eager_v)


# ---------------------------------------------------------------------------
# Prewarm, cache explain, the miss log, the C planner


def test_prewarm_plans_rotary_only_when_asked() -> None:
    plain = enumerate_variants(Axes((SM90,), kernels=DECODE), EMPTY)
    assert not any("ROTARY" in str(p.variant) for p in plain)
    every = enumerate_variants(Axes((SM90,), kernels=DECODE, rotary=("none", "interleaved", "halves")), EMPTY)
    rotary = [p.variant for p in every if dict(p.variant.functional).get("ROTARY")]
    assert {v.kernel for v in rotary} == {"flash_decode_split", "kv_append"}
    assert {bool(dict(v.functional).get("ROTARY_INTERLEAVED")) for v in rotary} == {False, True}
    assert {p.key for p in plain} < {p.key for p in every}
    planned = {p.key for p in every}
    for dtype, head_dim, causal, rows, page, interleaved in (("bf16", 128, False, 4, 0, True),
                                                            ("fp16", 64, True, 33, 256, False)):
        chosen = decode_dispatch.decode_variant("flash_decode_split", SM90, dtype, head_dim, causal, True, rows,
                                                32768, page_size=page, paged=page > 0, table=EMPTY, rotary=True,
                                                rotary_interleaved=interleaved)
        assert chosen.key() in planned, chosen
        appended = kv_append.variant(SM90, dtype, head_dim, 0, page > 0, True, False, True, interleaved)
        assert appended.key() in planned, appended
    with pytest.raises(ValueError, match="rotary modes must be among"):
        Axes((SM90,), rotary=("pairs",))


def test_prewarm_cli_takes_rotary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["prewarm", "--target", "sm_90", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128",
            "--list"]
    assert cli_main(base) == 0
    plain = set(capsys.readouterr().out.splitlines())
    listed = {}
    for choice in ("interleaved", "halves", "both"):
        assert cli_main([*base, "--rotary", choice]) == 0
        listed[choice] = set(capsys.readouterr().out.splitlines())
        assert plain < listed[choice]
    assert not any("ROTARY" in line for line in plain)
    assert listed["both"] == listed["interleaved"] | listed["halves"]
    assert not any("ROTARY_INTERLEAVED" in line for line in listed["halves"])
    misses = tmp_path / "misses.jsonl"
    variant = decode_dispatch.decode_variant("flash_decode_split", SM90, "fp16", 64, True, True, 8, 4096,
                                             rotary=True, rotary_interleaved=True, leftpad=True)
    appended = kv_append.variant(SM90, "fp16", 64, 0, False, True, False, True, False)
    misses.write_text("".join(json.dumps({"variant": str(v), "key": v.key(), "compile_s": 1.0}) + "\n"
                              for v in (variant, appended)))
    plan, problems = variants_from_misses(misses.read_text().splitlines(), "m")
    assert not problems and [p.variant for p in plan] == [variant, appended]
    assert cli_main(["prewarm", "--from-misses", str(misses), "--rotary", "both", "--list"]) == 2
    assert "--rotary cannot narrow it" in capsys.readouterr().err


def test_explain_describes_a_rotary_call(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4",
            "--seqlen-k", "4096", "--target", "sm_90", "--json"]
    assert cli_main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["call"]["rotary"] == "none"
    assert cli_main([*args, "--rotary", "interleaved"]) == 0
    rotary = json.loads(capsys.readouterr().out)
    split, combine = (Variant.parse(k["variant"]) for k in rotary["kernels"])
    assert split.get("ROTARY") is True and split.get("ROTARY_INTERLEAVED") is True and "ROTARY" not in str(combine)
    assert str(split).replace(",ROTARY=true,ROTARY_INTERLEAVED=true", "").replace("maxnreg=128,", "") == \
        plain["kernels"][0]["variant"]
    assert rotary["kernels"][1]["key"] == plain["kernels"][1]["key"]
    assert cli_main(["cache", "explain", "--kernel", "kv_append", "--dtype", "bf16", "--head-dim", "64",
                     "--seqlen-q", "1", "--target", "sm_90", "--rotary", "halves", "--json"]) == 0
    appended = Variant.parse(json.loads(capsys.readouterr().out)["variant"])
    assert appended.get("ROTARY") is True and "ROTARY_INTERLEAVED" not in str(appended)
    assert cli_main([*args[:-1], "--rotary", "halves"]) == 0
    assert "rotary embeddings (halves: ROTARY=true, q rotated in the split kernel" in capsys.readouterr().out
    fwd = ["cache", "explain", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "128", "--target", "sm_90"]
    assert cli_main([*fwd, "--rotary", "interleaved"]) == 2
    assert "--rotary is flash_attn_with_kvcache's rotary_cos/rotary_sin" in capsys.readouterr().err


def test_the_capi_planner_asks_for_the_rotary_variants() -> None:
    from lazytriton.capi import embedded_kvcache

    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      None, args["block_table"], None, None, args["rotary_cos"], args["rotary_sin"])
    for interleaved in (True, False):
        call = checks.check(t, None, True, checks.NO_WINDOW, 0.0, 0, interleaved)
        got = embedded_kvcache.plan_variants(90, 1, 64, call.causal, True, False, call.rows, call.capacity,
                                             call.page_size, False, False, False, 64, False, True, interleaved)
        assert got == binding.variants(Target("cuda", "90", 32), torch.float16, call, True, False)
        assert got[0].get("ROTARY") is True and ("ROTARY_INTERLEAVED=true" in str(got[0])) is interleaved
        appended = embedded_kvcache.append_variant(90, 1, 64, 64, True, True, False, True, interleaved)
        assert appended == kv_append.variant(SM90, "fp16", 64, 0, True, True, False, True, interleaved)


def test_rotary_variants_compile_to_what_the_c_launcher_passes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real sm_90 entries (Triton's compiler, not the interpreter): the C launcher's pointers and integers (and the
    split kernel's two fp32); the tables' pointers have q's type."""
    from compiled_once import compiled, shared_dir

    from lazytriton.capi import embedded_kvcache

    split = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, True, True, 4, 4096,
                                           page_size=64, paged=True, leftpad=True, rotary=True,
                                           rotary_interleaved=True)
    appended = kv_append.variant(SM90, "bf16", 128, 0, True, True, False, True, False)
    for variant, params in ((split, binding.SPLIT_INT_PARAMS), (appended, kv_append.INT_PARAMS)):
        entry = compiled(variant, shared_dir(tmp_path_factory))
        embedded_kvcache.check_launch_layout(entry, variant.kernel)
        assert entry.arg_types[params.index("RotaryCos")] == "*bf16"
        assert entry.arg_types[params.index("RotarySeqlens")] == "*i32"


# ---------------------------------------------------------------------------
# On the GPU


def _gpu_call(paged: bool, new: int, rotary_dim: int, interleaved: bool, seed: int,
              dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """32/8 heads, head dim 128, a cache of 8192 (pages of 256), lengths at random, tables covering them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch, capacity = 8, 8192
    q = torch.randn(batch, max(new, 1), 32, 128, device="cuda", generator=gen).to(dtype)
    if paged:
        blocks = batch * capacity // 256
        k_cache = torch.randn(blocks, 256, 8, 128, device="cuda", generator=gen).to(dtype)
        table: torch.Tensor | None = torch.randperm(blocks, device="cuda", generator=gen).reshape(batch, -1).int()
    else:
        k_cache = torch.randn(batch, capacity, 8, 128, device="cuda", generator=gen).to(dtype)
        table = None
    cos, sin = tables(capacity + 8, rotary_dim, dtype, seed, device="cuda")
    return {"q": q, "k_cache": k_cache, "v_cache": torch.randn_like(k_cache), "block_table": table,
            "k": torch.randn(batch, new, 8, 128, device="cuda", generator=gen).to(dtype),
            "v": torch.randn(batch, new, 8, 128, device="cuda", generator=gen).to(dtype),
            "cache_seqlens": torch.randint(0, capacity - new, (batch,), device="cuda", generator=gen).int(),
            "rotary_cos": cos, "rotary_sin": sin}


def _on_cpu(args: dict[str, Any]) -> dict[str, Any]:
    return {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in args.items()}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("paged", "new", "rotary_dim", "interleaved"), [
    (False, 1, 128, True), (True, 1, 64, False), (False, 3, 64, True), (True, 3, 128, False)])
def test_rotary_gpu_serving_shapes(paged: bool, new: int, rotary_dim: int, interleaved: bool) -> None:
    """A decoding step (one query, one new key) and a few at once, causal, several splits, the float64 reference."""
    args = _gpu_call(paged, new, rotary_dim, interleaved, seed=new + 10 * paged)
    for splits in (0, 5):
        mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
        out, lse = lazytriton.flash_attn_with_kvcache(**mine, causal=True, num_splits=splits,
                                                      rotary_interleaved=interleaved, return_softmax_lse=True)
        check_rotary(_on_cpu(args), (out.cpu(), lse.cpu(), mine["k_cache"].cpu(), mine["v_cache"].cpu()),
                     causal=True, rotary_interleaved=interleaved)


@gpu
@pytest.mark.gpu
def test_rotary_gpu_captured_in_a_cuda_graph() -> None:
    """Under capture the value checks are skipped (nothing can be read); replays rotate at the lengths of the
    moment, as eager calls do."""
    args = _gpu_call(True, 1, 128, True, seed=3)
    args["cache_seqlens"] = args["cache_seqlens"].clamp(max=8000)
    eager, graphed = ({**args, **{n: args[n].clone() for n in ("k_cache", "v_cache", "cache_seqlens")}}
                      for _ in range(2))
    lazytriton.flash_attn_with_kvcache(**{**graphed, "k_cache": graphed["k_cache"].clone(),
                                          "v_cache": graphed["v_cache"].clone()}, causal=True)  # load the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lazytriton.flash_attn_with_kvcache(**graphed, causal=True)
    for step in range(3):
        graph.replay()
        want = lazytriton.flash_attn_with_kvcache(**eager, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(captured, want) and torch.equal(graphed["k_cache"], eager["k_cache"]), step
        for lens in (graphed["cache_seqlens"], eager["cache_seqlens"]):
            lens.add_(1)
