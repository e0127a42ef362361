"""The KV-cache call's serving API: names, float8 caches in the paged varlen form, out=, cu_seqlens_k_new, no sync.

- The paged form of ``flash_attn_varlen_func`` names its own arguments (k, v, seqused_k) in every error, through
  ``checks.Names``, and takes float8 caches with k_descale/v_descale (vLLM's call of FlashAttention-3); q_descale
  is refused.
- ``out=`` (both forms) is written by the kernels through its strides, without a copy, whatever the split count;
  an out sharing memory with q, k, v or the caches is refused before anything runs.
- FlashAttention-3's ``cu_seqlens_k_new`` (new keys of different counts, packed): against the float64 reference
  with FlashAttention's rule, bit for bit the call of each sequence alone, float8 caches included.
- A warm decoding step reads nothing back to the host (inside ``trusted_indices()``, a serving loop's mode):
  counted on CPU, and on the GPU under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from conftest import gpu, syncs_raise
from test_flash_fwd import seed_of
from test_fp8_kvcache import bits, to_fp8
from test_kvcache import check_out_lse
from test_kvcache_varlen_q import QUERIES, Case, check_against_reference, make_inputs, varlen_func_args

import lazytriton
from lazytriton.kernels import kv_append
from lazytriton.kernels.flash_decode import binding, checks, values
from lazytriton.kernels.flash_decode.reference import varlen_q_reference
from lazytriton.kernels.kv_append import binding as append_binding
from lazytriton.target import Target
from lazytriton.variant import check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

NEW = (3, 1, 0, 2, 1)  # new keys of each of QUERIES' sequences: a chunk, decodes, none


def _varlen_valid() -> dict[str, Any]:
    return {**varlen_func_args(make_inputs(Case(torch.float16, (4, 2), "page16", 0, True, (-1, -1), 0.0, False, 0),
                                           seed=3)), "causal": True}


# ---------------------------------------------------------------------------
# Names: the paged varlen form's own


VARLEN_NAMES: list[tuple[str, Any, type[Exception], str]] = [
    ("k_3d", lambda a: {**a, "k": a["k"][0]}, ValueError, r"k \(the paged cache\) must have 4 dims"),
    ("v_heads", lambda a: {**a, "v": a["v"][:, :, :1].contiguous()}, ValueError,
     r"v \(the paged cache\) must have k \(the paged cache\)'s first three dims"),
    ("v_dtype", lambda a: {**a, "v": a["v"].float()}, TypeError, r"v \(the paged cache\) has dtype torch.float32"),
    ("k_head_dim", lambda a: {**a, "k": a["k"][..., :16].contiguous()}, ValueError,
     r"k \(the paged cache\) has head dim 16 but q has head dim 32"),
    ("seqused_k_batch", lambda a: {**a, "seqused_k": a["seqused_k"][:4]}, ValueError,
     r"seqused_k must have shape \(5,\)"),
    ("seqused_k_negative", lambda a: {**a, "seqused_k": a["seqused_k"] - 99}, ValueError, r"seqused_k\[0\] = -"),
    ("block_past_cache", lambda a: {**a, "block_table": a["block_table"] + 1000}, ValueError,
     r"points past the cache: blocks are 0\.\.\d+ \(k \(the paged cache\)\.shape\[0\]\)"),
    ("cu_seqlens_q_start", lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"] + 1}, ValueError,
     r"cu_seqlens_q\[0\] = 1"),
    ("k_descale_16bit", lambda a: {**a, "k_descale": torch.ones(())}, ValueError,
     r"k_descale is given but k \(the paged cache\) is torch.float16"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), VARLEN_NAMES, ids=[b[0] for b in VARLEN_NAMES])
def test_the_paged_varlen_form_names_its_own_arguments(name: str, change: Any, error: type[Exception],
                                                        match: str) -> None:
    args = _varlen_valid()
    with pytest.raises(error, match=match) as caught:
        lazytriton.flash_attn_varlen_func(**change(args))
    assert not any(word in str(caught.value) for word in ("k_cache", "v_cache", "cache_seqlens")), caught.value


def test_the_checks_take_the_callers_names() -> None:
    """``checks.check`` and ``values.check_values`` name the tensors by the ``Names`` given, the default being
    flash_attn_with_kvcache's."""
    args = make_inputs(Case(torch.float32, (4, 2), "page16", 0, True, (-1, -1), 0.0, False, 0), seed=4)
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"][..., :1, :], None, None, args["cache_seqlens"],
                      block_table=args["block_table"], cu_seqlens_q=args["cu_seqlens_q"])
    for names, cache in ((checks.KVCACHE, "v_cache must have k_cache's"),
                         (checks.PAGED_VARLEN, r"v \(the paged cache\) must have k \(the paged cache\)'s")):
        with pytest.raises(ValueError, match=cache):
            checks.check(t, max_seqlen_q=5, names=names)
    t = t._replace(v_cache=args["v_cache"], cache_seqlens=args["cache_seqlens"] + 999)
    call = checks.check(t, max_seqlen_q=5)
    for names, lens in ((checks.KVCACHE, r"cache_seqlens\[0\]"), (checks.PAGED_VARLEN, r"seqused_k\[0\]")):
        with pytest.raises(ValueError, match=lens):
            values.check_values(t, call, names)


# ---------------------------------------------------------------------------
# Float8 caches in the paged varlen form


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("descale", ["heads", "batch"])
def test_the_paged_varlen_form_reads_a_float8_cache(fmt: torch.dtype, descale: str) -> None:
    """vLLM's call of FlashAttention-3 on an fp8 cache: bf16 q, float8 k and v, k_descale/v_descale; the same as
    flash_attn_with_kvcache's call, and FlashAttention's rule against the float64 reference of the dequantised
    cache."""
    case = Case(torch.bfloat16, (4, 2), "page5", 0, True, (-1, -1), 0.0, False, 2)
    args = make_inputs(case, seed_of("fp8 varlen", str(fmt), descale))
    gen = torch.Generator().manual_seed(7)
    args["k_cache"], args["v_cache"] = to_fp8(args["k_cache"], fmt, gen), to_fp8(args["v_cache"], fmt, gen)
    shape = (2,) if descale == "heads" else (len(QUERIES), 2)
    kd, vd = (torch.rand(shape, generator=gen) * 0.05 + 0.01 for _ in range(2))
    call = varlen_func_args(args)
    got, lse, _ = lazytriton.flash_attn_varlen_func(**call, causal=True, num_splits=2, k_descale=kd, v_descale=vd,
                                                    return_attn_probs=True)
    want, want_lse = lazytriton.flash_attn_with_kvcache(**args, causal=True, num_splits=2, k_descale=kd,
                                                        v_descale=vd, return_softmax_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    plain = {n: t for n, t in args.items() if n != "max_seqlen_q"}
    ref_out, ref_lse, _, _ = varlen_q_reference(**{**plain, "q": args["q"].double()}, k_descale=kd, v_descale=vd,
                                                causal=True)
    same_out, same_lse, _, _ = varlen_q_reference(**plain, k_descale=kd, v_descale=vd, causal=True)
    check_out_lse((got[None], lse[None]), (ref_out[None], ref_lse[None]), (same_out[None], same_lse[None]))


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float8_e4m3fn])
def test_the_paged_varlen_form_refuses_q_descale(q_dtype: torch.dtype) -> None:
    args = _varlen_valid()
    with pytest.raises(ValueError, match="q_descale is not taken with block_table: the paged form reads float16 or "
                                         "bfloat16 queries"):
        lazytriton.flash_attn_varlen_func(**{**args, "q": args["q"].to(q_dtype)}, q_descale=torch.ones(()))


# ---------------------------------------------------------------------------
# out=: written by the kernels, in place


def _copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each ``Tensor.copy_`` made from lazytriton's code."""
    made: list[str] = []
    real = torch.Tensor.copy_

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("lazytriton"):
            made.append(caller)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    return made


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("form", ["kvcache", "varlen", "dense"])
def test_out_is_written_by_the_kernels_through_its_strides(monkeypatch: pytest.MonkeyPatch, form: str,
                                                           splits: int) -> None:
    """An out that is a strided view of a larger buffer (every other head, the first head_dim_v columns) gets the
    output with no copy, by the split kernel (one split) or the combine kernel; the buffer's other bytes keep
    their sentinel."""
    case = Case(torch.float16, (4, 2), "page16", 0 if form == "varlen" else 2, True, (-1, -1), 0.0, False, splits)
    args = make_inputs(case, seed_of("out", form, splits), queries=(3, 1, 2) if form == "dense" else QUERIES)
    if form == "dense":  # (batch, seqlen_q, heads, d): the sequences' queries padded to 3
        args = {**{n: t for n, t in args.items() if n not in ("cu_seqlens_q", "max_seqlen_q")},
                "q": args["q"][:6].reshape(3, 2, 4, 32)}
    caches = (args["k_cache"].clone(), args["v_cache"].clone())
    want = lazytriton.flash_attn_with_kvcache(**args, causal=True, num_splits=splits)
    args["k_cache"], args["v_cache"] = caches
    buffer = torch.full((*want.shape[:-2], 8, 40), 7.0, dtype=want.dtype)
    out = buffer[..., ::2, :32]
    made = _copies(monkeypatch)
    if form == "varlen":
        got = lazytriton.flash_attn_varlen_func(**varlen_func_args(args), causal=True, num_splits=splits, out=out)
    else:
        got = lazytriton.flash_attn_with_kvcache(**args, causal=True, num_splits=splits, out=out)
    assert made == [], made
    assert got is out and torch.equal(out, want)
    assert (buffer[..., 1::2, :] == 7).all() and (buffer[..., 32:] == 7).all()


def test_an_out_without_a_contiguous_last_dim_is_copied_into() -> None:
    args = make_inputs(Case(torch.float32, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 2), seed=8)
    caches = (args["k_cache"].clone(), args["v_cache"].clone())
    want = lazytriton.flash_attn_with_kvcache(**args, causal=True)
    args["k_cache"], args["v_cache"] = caches
    out = torch.empty(32, *want.shape[:-1]).permute(1, 2, 0)  # last dim of stride total_q x heads
    assert not binding.writes_into(out)
    assert lazytriton.flash_attn_with_kvcache(**args, causal=True, out=out) is out
    assert torch.equal(out, want)


def _overlapping_outs(a: dict[str, Any]) -> dict[str, tuple[torch.Tensor, str]]:
    """Outs of q's shape sharing memory with an input, or with themselves, and the error each gets."""
    shape, n = a["q"].shape, a["q"].numel()
    return {"q": (a["q"], "out shares memory with q"),
            "k_cache": (a["k_cache"].view(-1)[:n].view(shape), "out shares memory with k_cache"),
            "v_cache": (a["v_cache"].view(-1)[-n:].view(shape), "out shares memory with v_cache"),
            "expanded": (a["q"].new_empty(shape[-1]).expand(shape), "out has elements sharing memory")}


@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache", "expanded"])
def test_an_out_sharing_memory_is_refused_before_anything_runs(which: str) -> None:
    args = make_inputs(Case(torch.float32, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 2), seed=9)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    out, match = _overlapping_outs(args)[which]
    with pytest.raises(ValueError, match=match):
        lazytriton.flash_attn_with_kvcache(**args, causal=True, out=out)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1]), "nothing written"


def test_the_varlen_form_names_the_paged_cache_an_out_overlaps() -> None:
    args = _varlen_valid()
    out = args["k"].view(-1)[:args["q"].numel()].view(args["q"].shape)
    with pytest.raises(ValueError, match=r"out shares memory with k \(the paged cache\)"):
        lazytriton.flash_attn_varlen_func(**args, out=out)


@pytest.mark.parametrize(("out", "error", "match"), [
    (lambda q: torch.empty(3, 4, 32, dtype=q.dtype), ValueError, r"out must have shape \(10, 4, 32\)"),
    (lambda q: torch.empty(10, 4, 32, dtype=torch.float64), TypeError, "out must be torch.float16"),
    (lambda q: [0.0], TypeError, "out must be a torch.Tensor or None"),
])
def test_a_bad_out_is_named(out: Any, error: type[Exception], match: str) -> None:
    args = make_inputs(Case(torch.float16, (4, 2), "page16", 0, True, (-1, -1), 0.0, False, 0), seed=10)
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_with_kvcache(**args, out=out(args["q"]))


# ---------------------------------------------------------------------------
# cu_seqlens_k_new: new keys of different counts, packed


def packed_new(args: dict[str, Any], counts: tuple[int, ...] = NEW, seed: int = 0) -> dict[str, Any]:
    """``args`` with k and v packed (total_new, heads_k, d) by cu_seqlens_k_new, the cached lengths fitting them."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc = args["k_cache"], args["v_cache"]
    capacity = args["block_table"].shape[1] * kc.shape[1] if "block_table" in args else kc.shape[1]
    total = sum(counts)
    k, v = (torch.randn(total, kc.shape[2], x.shape[3], generator=gen).to(args["q"].dtype) for x in (kc, vc))
    top = torch.tensor([capacity - n for n in counts])
    lens = (torch.rand(len(counts), generator=gen) * (top + 1)).long().clamp(max=top)
    lens[0] = top[0]  # a sequence whose new keys fill its cache to the end
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return {**args, "k": k, "v": v, "cache_seqlens": lens.int(), "cu_seqlens_k_new": cu}


NEW_CASES = [
    Case(torch.float32, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 1),
    Case(torch.float16, (4, 2), "page5", 1, True, (-1, -1), 0.0, False, 3),
    Case(torch.bfloat16, (4, 1), "contiguous", 1, False, (-1, -1), 0.0, True, 0),
    Case(torch.float32, (6, 3), "batch_idx", 1, True, (6, 0), 2.0, False, 2),
]


@pytest.mark.parametrize("case", NEW_CASES, ids=str)
def test_packed_new_keys_against_the_float64_reference(case: Case) -> None:
    args = packed_new(make_inputs(case, seed_of("new", str(case))), seed=seed_of("new keys", str(case)))
    opts = {"causal": case.causal, "window_size": case.window, "softcap": case.softcap}
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **opts, num_splits=case.splits, return_softmax_lse=True)
    check_against_reference(args, (out, lse, mine["k_cache"], mine["v_cache"]), **opts)


@pytest.mark.parametrize("splits", [1, 2])
def test_packed_new_keys_are_each_sequences_call_alone(splits: int) -> None:
    """Bit for bit, sequence b's new keys k[cu[b]:cu[b + 1]] appended and attended by a call of its own (dense q:
    one query a sequence, as a decoding step; one int cache_seqlens for every sequence)."""
    case = Case(torch.float32, (4, 2), "page5", 1, True, (-1, -1), 0.0, False, splits)
    args = packed_new(make_inputs(case, seed_of("alone new", splits), queries=(1, 1, 1, 1, 1)), seed=splits)
    args = {**{n: t for n, t in args.items() if n not in ("cu_seqlens_q", "max_seqlen_q")},
            "q": args["q"][:, None], "cache_seqlens": 7}
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out = lazytriton.flash_attn_with_kvcache(**mine, causal=True, num_splits=splits)
    kc, vc, cu = args["k_cache"].clone(), args["v_cache"].clone(), args["cu_seqlens_k_new"]
    for b in range(len(NEW)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        alone = lazytriton.flash_attn_with_kvcache(args["q"][b:b + 1], kc, vc, args["k"][None, lo:hi],
                                                   args["v"][None, lo:hi], cache_seqlens=7,
                                                   block_table=args["block_table"][b:b + 1], causal=True,
                                                   num_splits=splits)
        assert torch.equal(out[b:b + 1], alone), f"sequence {b} differs from its call alone"
    assert torch.equal(mine["k_cache"], kc) and torch.equal(mine["v_cache"], vc)


def test_packed_new_keys_into_a_float8_cache_and_with_rotary() -> None:
    """The float8 bytes the reference quantises; rotary at each sequence's own positions (its cache_seqlens)."""
    case = Case(torch.bfloat16, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 2)
    args = packed_new(make_inputs(case, seed=12), seed=13)
    gen = torch.Generator().manual_seed(14)
    fmt = torch.float8_e4m3fn
    args["k_cache"], args["v_cache"] = to_fp8(args["k_cache"], fmt, gen), to_fp8(args["v_cache"], fmt, gen)
    kd, vd = (torch.rand(len(NEW), 2, generator=gen) * 0.05 + 0.01 for _ in range(2))
    angles = torch.rand(64, 8, generator=gen) * 6
    rotary = {"rotary_cos": angles.cos().to(torch.bfloat16), "rotary_sin": angles.sin().to(torch.bfloat16)}
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **rotary, k_descale=kd, v_descale=vd, causal=True,
                                                  num_splits=2, return_softmax_lse=True)
    plain = {n: t for n, t in args.items() if n != "max_seqlen_q"}
    wide = {**plain, "q": args["q"].double(), "k": args["k"].double(), "v": args["v"].double()}
    ref_out, ref_lse, ref_k, ref_v = varlen_q_reference(**wide, **rotary, k_descale=kd, v_descale=vd, causal=True)
    same_out, same_lse, same_k, same_v = varlen_q_reference(**plain, **rotary, k_descale=kd, v_descale=vd,
                                                            causal=True)
    assert torch.equal(bits(mine["k_cache"]), bits(same_k)) and torch.equal(bits(mine["v_cache"]), bits(same_v))
    check_out_lse((out[None], lse[None]), (ref_out[None], ref_lse[None]), (same_out[None], same_lse[None]))


def _new_valid() -> dict[str, Any]:
    return packed_new(make_inputs(Case(torch.float16, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 0), seed=15))


def _cu(*entries: int) -> Any:
    return lambda a: {**a, "cu_seqlens_k_new": torch.tensor(entries, dtype=torch.int32)}


NEW_BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("no_k", lambda a: {**a, "k": None, "v": None}, ValueError, "cu_seqlens_k_new is given without k and v"),
    ("k_4d", lambda a: {**a, "k": a["k"][None], "v": a["v"][None]}, ValueError,
     "k must have 3 dims .total_new, heads_k, head_dim. with cu_seqlens_k_new"),
    ("v_rows", lambda a: {**a, "v": a["v"][1:]}, ValueError, r"v must have shape \(7, 2, 32\)"),
    ("cu_int64", lambda a: {**a, "cu_seqlens_k_new": a["cu_seqlens_k_new"].long()}, TypeError,
     "cu_seqlens_k_new must be torch.int32"),
    ("cu_batch", lambda a: {**a, "cu_seqlens_k_new": a["cu_seqlens_k_new"][:-1]}, ValueError,
     r"cu_seqlens_k_new must have shape \(6,\)"),
    ("cu_start", _cu(1, 3, 4, 4, 6, 7), ValueError, r"cu_seqlens_k_new\[0\] = 1: must be 0"),
    ("cu_end", _cu(0, 3, 4, 4, 6, 6), ValueError, r"cu_seqlens_k_new\[5\] = 6: must be total_new = 7"),
    ("cu_decreasing", _cu(0, 3, 2, 4, 6, 7), ValueError, "cu_seqlens_k_new must be nondecreasing"),
    ("past_the_end", _cu(0, 7, 7, 7, 7, 7), ValueError,
     r"cache_seqlens\[0\] = \d+: must be in 0\.\.\d+ \(block_table's 3 pages of 16 keys hold 48 keys per sequence, "
     r"7 of them new\)"),
]


@pytest.mark.parametrize(("name", "change", "error", "match"), NEW_BAD, ids=[b[0] for b in NEW_BAD])
def test_bad_packed_new_keys_are_refused_before_anything_is_written(name: str, change: Any,
                                                                     error: type[Exception], match: str) -> None:
    args = _new_valid()
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_with_kvcache(**change(args), causal=True)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


def test_varlen_is_written_in_kv_appends_variant_and_memo_key_only_when_set() -> None:
    sm90 = Target.parse("sm_90")
    plain, packed = (kv_append.variant(sm90, "bf16", 128, 0, True, True, False, varlen=flag) for flag in (False, True))
    assert "VARLEN" not in str(plain) and packed.get("VARLEN") is True
    assert check_fields(packed) is packed and plain.key() != packed.key()
    args = _new_valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      block_table=args["block_table"], cu_seqlens_q=args["cu_seqlens_q"],
                      cu_seqlens_k_new=args["cu_seqlens_k_new"])
    call = checks.check(t, max_seqlen_q=5)
    assert call.varlen_new and call.seqlen_new == 7
    key = append_binding.memo_key(0, torch.float16, call, True, False)
    assert key[-1:] == append_binding.VARLEN_TAG
    assert append_binding.memo_key(0, torch.float16, call._replace(varlen_new=False), True, False) == key[:-1]


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "gfx942"])
def test_the_packed_append_compiles(target: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real entries (Triton's compiler, no GPU): kv_append with VARLEN (the binary search's loop), paged, float8 too."""
    from compiled_once import compiled, shared_dir

    from lazytriton.kernels import get

    where = shared_dir(tmp_path_factory)
    for kv in ("none", "e5m2"):
        variant = kv_append.variant(Target.parse(target), "bf16", 128, 0, True, True, False, kv_fp8=kv, varlen=True)
        assert len(compiled(variant, where).arg_types) == len(get("kv_append").params)


def test_the_op_and_torch_compile_take_cu_seqlens_k_new() -> None:
    torch._dynamo.reset()
    args = _new_valid()

    def step(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor, table: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,  # type: ignore[no-any-return]
                                                  block_table=table, cu_seqlens_q=cu_q, max_seqlen_q=5,
                                                  cu_seqlens_k_new=cu_k, causal=True, num_splits=2)

    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "cu_seqlens_q", "cu_seqlens_k_new")
    inputs = [args[n] for n in names]
    eager_k, eager_v = args["k_cache"].clone(), args["v_cache"].clone()
    want = step(inputs[0], eager_k, eager_v, *inputs[3:])
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    assert torch.equal(got, want)
    assert torch.equal(args["k_cache"], eager_k) and torch.equal(args["v_cache"], eager_v)


# ---------------------------------------------------------------------------
# No host synchronisation on a warm decoding step

# The CPU stand-ins of a GPU launch (Triton's interpreter) read values on the host by nature: not counted.
_LAUNCH_STAND_INS = ("lazytriton.interpreter", "lazytriton.compiler")


def _host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each read of a tensor's values back to the host made from lazytriton's code.

    On a GPU each of these (``item``, ``tolist``, ``bool``, ``int``, ``float``, ``cpu``, ``numpy``, ``nonzero``)
    waits for the device; on CPU they are plain calls, so they are counted where lazytriton's modules make them.
    """
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _real: object = real, _name: str = name,
                    **kwargs: object) -> object:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("lazytriton") and not caller.startswith(_LAUNCH_STAND_INS):
                reads.append(f"{_name} in {caller}")
            return _real(self, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def _decoding_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[Any]:
    """A serving loop's calls, each a closure: index tensors on the device (lengths, block tables, cu_seqlens)."""
    case = Case(dtype, (4, 2), "page16", 1, True, (-1, -1), 0.0, False, 0)
    args = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in make_inputs(case, seed=16).items()}
    dense = {n: t for n, t in args.items() if n not in ("cu_seqlens_q", "max_seqlen_q")}
    dense["q"], dense["k"], dense["v"] = args["q"][:5, None], args["k"][:, :1], args["v"][:, :1]
    dense["cache_seqlens"] = dense["cache_seqlens"].clamp(max=46)
    new = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in packed_new(args, seed=17).items()}
    out = torch.empty_like(dense["q"])
    varlen = varlen_func_args(args)  # its max_seqlen_k is read here, once, as a serving loop knows it
    return [lambda: lazytriton.flash_attn_with_kvcache(**dense, causal=True),
            lambda: lazytriton.flash_attn_with_kvcache(**dense, causal=True, num_splits=3, out=out),
            lambda: lazytriton.flash_attn_varlen_func(**varlen, causal=True),
            lambda: lazytriton.flash_attn_with_kvcache(**new, causal=True)]


def test_a_warm_decoding_step_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``trusted_indices()`` (a serving loop, whose indices are right by construction) a warm step of each
    form reads nothing back: the lengths after a packed append are computed on the device."""
    steps = _decoding_steps()
    with lazytriton.trusted_indices():
        for step in steps:
            step()  # warm
        reads = _host_reads(monkeypatch)
        for step in steps:
            step()
    assert reads == [], reads


def test_the_host_read_counter_sees_the_value_check() -> None:
    """The counter is not blind: outside ``trusted_indices()`` each call reads its index values once."""
    with pytest.MonkeyPatch.context() as patch:
        reads = _host_reads(patch)
        _decoding_steps()[0]()
    assert reads and all(r == "tolist in lazytriton.kernels.flash_decode.values" for r in reads), reads


@gpu
@pytest.mark.gpu
def test_gpu_a_warm_decoding_step_never_synchronises() -> None:
    """On the GPU, torch's sync debug mode raises at any synchronisation inside the warm steps."""
    steps = _decoding_steps("cuda", torch.bfloat16)
    with lazytriton.trusted_indices():
        for step in steps:
            step()
        with syncs_raise():
            for step in steps:
                step()
    torch.cuda.synchronize()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, torch.float8_e4m3fn])
def test_gpu_packed_new_keys_and_out_at_real_sizes(fmt: torch.dtype | None) -> None:
    """cu_seqlens_k_new and out= on the GPU (batch 16, 32/8 heads, head dim 128, 4k keys, pages of 16): the cache
    bytes and the output as the call of each sequence alone."""
    gen = torch.Generator().manual_seed(18)
    batch, hq, hk, d, page, per = 16, 32, 8, 128, 16, 256
    counts = [int(n) for n in torch.randint(0, 5, (batch,), generator=gen)]
    blocks = batch * per
    kc, vc = (torch.randn(blocks, page, hk, d, generator=gen).to(fmt or torch.bfloat16).cuda() for _ in range(2))
    table = torch.randperm(blocks, generator=gen).view(batch, per).int().cuda()
    lens = torch.randint(0, per * page - 4, (batch,), generator=gen).int().cuda()
    q = torch.randn(batch, 1, hq, d, generator=gen).bfloat16().cuda()
    k, v = (torch.randn(sum(counts), hk, d, generator=gen).bfloat16().cuda() for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    descales = {"k_descale": torch.full((hk,), 0.02).cuda(), "v_descale": torch.full((hk,), 0.03).cuda()} if fmt \
        else {}
    out = torch.empty(batch, 1, hq, 2 * d, dtype=torch.bfloat16, device="cuda")[..., :d]
    mine_k, mine_v = kc.clone(), vc.clone()
    got = lazytriton.flash_attn_with_kvcache(q, mine_k, mine_v, k, v, cache_seqlens=lens, block_table=table,
                                             cu_seqlens_k_new=cu, causal=True, num_splits=4, out=out, **descales)
    assert got is out
    for b in range(batch):
        lo, hi = int(cu[b]), int(cu[b + 1])
        alone = lazytriton.flash_attn_with_kvcache(q[b:b + 1], kc, vc, k[None, lo:hi], v[None, lo:hi],
                                                   cache_seqlens=lens[b:b + 1], block_table=table[b:b + 1],
                                                   causal=True, num_splits=4, **descales)
        torch.testing.assert_close(out[b:b + 1], alone, rtol=0, atol=0)
    assert torch.equal(bits(mine_k) if fmt else mine_k, bits(kc) if fmt else kc)
    assert torch.equal(bits(mine_v) if fmt else mine_v, bits(vc) if fmt else vc)
