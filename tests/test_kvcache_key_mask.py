"""The decoding kernels' key mask (KEY_MASK, ``kernels/flash_decode/key_mask.py``): SDPA's boolean mask, per key.

Through Triton's interpreter, ``kvcache.with_key_mask`` against the float64 reference
(``kernels/flash_decode/reference.py`` with ``key_mask``) under FlashAttention's rule
(``test_kvcache.check_out_lse``), over a covering design: left pads, holes, rows with every key masked, a mask
broadcast over the batch, bool and uint8 bytes, a view of transformers' (batch, 1, 1, kv_len) mask; contiguous
caches, transformers' (batch, heads_k, kv_len, d) caches read as views, paged caches; GQA, MQA and MHA; head dims
64 and 128; fp16, bf16 and fp32; one split and several; new keys appended; softcap, sinks, cache_seqlens as a
tensor, a causal call of two queries. A fully masked row gives out 0 (lse -inf, or the sink), SDPA's output.
Then the warm path: bit for bit the general path's result, and its launches the general path's, integer for
integer. Then the reach: bad input, the variant (KEY_MASK written only when set), the memo key, prewarm's
``--key-mask``, ``cache explain --key-mask`` and a miss log's line. On the GPU: the same rule at serving sizes,
and the warm path bit for bit the cold one.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import gpu, syncs_raise
from test_flash_fwd import seed_of
from test_kvcache import check_out_lse
from test_kvcache_hot import (  # noqa: F401  (fixtures)
    STREAM,
    Runtime,
    _named,
    _roles,
    bits,
    gpu_path,
    interpreting,
    memoise,
    recording,
    warm,
)

from lazytriton import kvcache
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES
from lazytriton.kernels.flash_decode import binding, checks, hot
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.prewarm.enumeration import Axes, enumerate_variants, variants_from_misses
from lazytriton.target import Target
from lazytriton.tuning import Table
from lazytriton.variant import Variant

# A row that sees no key: log2(0) in its lse, and with a sink the kernels' divisor l / 0 (inf: out 0).
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning")]

SM90 = Target.parse("sm_90")
EMPTY = Table(())
PAGE = 16


def make_call(dtype: torch.dtype, head_dim: int, heads: tuple[int, int], layout: str, mask: str, seed: int,
              batch: int = 3, capacity: int = 48, seqlen_q: int = 1, device: str = "cpu") -> dict[str, Any]:
    """A key-masked call's arguments, fresh random values: ``layout`` contiguous, transformers (views of (batch,
    heads_k, kv_len, d)) or paged; ``mask`` left (left pads, sequence 1 fully masked), holes, broadcast (one row
    for every sequence), uint8 (bytes 0, 1 and 7) or view4d (a (batch, 1, 1, kv_len) mask's view)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    args: dict[str, Any] = {"q": randn(batch, seqlen_q, hq, head_dim)}
    if layout == "paged":
        per = capacity // PAGE
        blocks = batch * per + 3
        args["k_cache"], args["v_cache"] = randn(blocks, PAGE, hk, head_dim), randn(blocks, PAGE, hk, head_dim)
        args["block_table"] = torch.randperm(blocks, generator=gen)[:batch * per].view(batch, per).int().to(device)
    elif layout == "transformers":
        args["k_cache"] = randn(batch, hk, capacity, head_dim).transpose(1, 2)
        args["v_cache"] = randn(batch, hk, capacity, head_dim).transpose(1, 2)
    else:
        args["k_cache"], args["v_cache"] = randn(batch, capacity, hk, head_dim), randn(batch, capacity, hk, head_dim)
    keys = torch.arange(capacity)
    if mask == "left":
        pads = torch.randint(0, capacity - 1, (batch,), generator=gen)
        seen = keys[None, :] >= pads[:, None]
        seen[min(1, batch - 1)] = False  # a sequence whose keys are all masked
    elif mask == "broadcast":
        seen = (torch.rand(1, capacity, generator=gen) < 0.6).expand(batch, capacity)
    else:
        seen = torch.rand(batch, capacity, generator=gen) < 0.6
    if mask == "uint8":
        args["key_mask"] = (seen * torch.randint(1, 8, seen.shape, generator=gen)).to(torch.uint8).to(device)
    elif mask == "view4d":
        args["key_mask"] = seen[:, None, None, :].to(device)[:, 0, 0]
    else:
        args["key_mask"] = seen.to(device)
    return args


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a reference call with attention sinks: each head's sink one more term of the denominator."""
    total = torch.logaddexp(lse.double(), sinks.double()[None, :, None])  # (batch, heads, seqlen_q)
    weight = torch.exp(lse.double() - total).transpose(1, 2)[..., None]
    return (out.double() * weight).to(out.dtype), total.to(lse.dtype)


def reference(args: dict[str, Any], wide: bool, **opts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the reference, in float64 (``wide``) or in the call's dtype, sinks included."""
    opts = {n: x for n, x in opts.items() if n != "num_splits"}
    sinks = opts.pop("sinks", None)
    data = {n: (x.double() if wide and isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in args.items()}
    out, lse, _, _ = kvcache_reference(**data, **opts)
    return (out, lse) if sinks is None else with_sinks(out, lse, sinks)


def check(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The call on copies of the caches, against the reference by FlashAttention's rule; its (out, lse)."""
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    got = kvcache.with_key_mask(**mine, **opts, return_softmax_lse=True)
    check_out_lse(got, reference(args, True, **opts), reference(args, False, **opts))
    return got


CASES = [  # (dtype, head dim, (heads, heads_k), layout, mask, options)
    (torch.float16, 64, (8, 2), "contiguous", "left", {}),
    (torch.bfloat16, 128, (8, 2), "transformers", "left", {"num_splits": 3}),
    (torch.float32, 64, (4, 1), "transformers", "holes", {}),
    (torch.bfloat16, 64, (4, 1), "paged", "left", {"num_splits": 2}),
    (torch.float16, 128, (2, 2), "paged", "holes", {}),
    (torch.bfloat16, 64, (8, 2), "contiguous", "broadcast", {"num_splits": 4}),
    (torch.float16, 64, (4, 2), "transformers", "uint8", {}),
    (torch.bfloat16, 128, (4, 1), "contiguous", "view4d", {"num_splits": 1}),
    (torch.float16, 64, (8, 2), "transformers", "left", {"softcap": 0.7}),
    (torch.bfloat16, 64, (4, 1), "contiguous", "left", {"sinks": "random", "num_splits": 3}),
    (torch.float32, 64, (4, 2), "paged", "left", {"sinks": "random", "num_splits": 1}),
    (torch.float16, 64, (4, 2), "contiguous", "holes", {"cache_seqlens": "tensor", "num_splits": 2}),
    (torch.bfloat16, 64, (4, 2), "contiguous", "left", {"causal": True, "seqlen_q": 2}),
    (torch.float16, 64, (4, 1), "paged", "holes", {"new_keys": 2, "num_splits": 3}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:5]) + str(sorted(c[5])))
def test_key_mask_matches_the_float64_reference(case: tuple[Any, ...]) -> None:
    dtype, head_dim, heads, layout, mask, options = case
    options = dict(options)
    seed = seed_of(str(case))
    args = make_call(dtype, head_dim, heads, layout, mask, seed, seqlen_q=options.pop("seqlen_q", 1))
    gen = torch.Generator().manual_seed(seed + 1)
    batch, _, hq, _ = args["q"].shape
    hk = args["k_cache"].shape[2]
    new = options.pop("new_keys", 0)
    if options.get("sinks") == "random":
        options["sinks"] = torch.randn(hq, generator=gen) * 2
    if options.get("cache_seqlens") == "tensor":
        options["cache_seqlens"] = torch.randint(0, 49, (batch,), generator=gen, dtype=torch.int32)
    if new:
        args["k"] = torch.randn(batch, new, hk, head_dim, generator=gen).to(dtype)
        args["v"] = torch.randn(batch, new, hk, head_dim, generator=gen).to(dtype)
        options["cache_seqlens"] = torch.randint(0, 48 - new + 1, (batch,), generator=gen, dtype=torch.int32)
    out, lse = check(args, **options)
    masked = ~args["key_mask"].bool().any(1)
    if mask == "left":  # sequence 1 sees no key: SDPA's 0 (and lse -inf, or the sink)
        assert masked[1]
    if masked.any():
        assert torch.equal(out[masked], torch.zeros_like(out[masked]))
        sinks = options.get("sinks")
        if sinks is None:
            assert torch.equal(lse[masked], torch.full_like(lse[masked], float("-inf")))
        else:  # the sink, through the kernels' base-2 round trip
            torch.testing.assert_close(lse[masked], sinks[None, :, None].expand_as(lse[masked]).float())


def test_a_fully_masked_row_is_what_sdpa_gives() -> None:
    """PyTorch's SDPA gives 0 for a fully masked row (its math backend's _safe_softmax): so does the key mask."""
    q, k, v = (torch.randn(2, 4, n, 16, dtype=torch.float64) for n in (1, 9, 9))
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0] = False
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = kvcache.with_key_mask(q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                mask[:, 0, 0])
    assert torch.equal(sdpa[0], torch.zeros_like(sdpa[0]))
    torch.testing.assert_close(got.transpose(1, 2).double(), sdpa, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# Bad input, the variant, the memo key


def test_bad_key_masks_raise_naming_it() -> None:
    args = make_call(torch.float16, 64, (4, 2), "contiguous", "holes", 0)
    bad = [(args["key_mask"].float(), TypeError, "torch.bool or torch.uint8"),
           (args["key_mask"][:, :-1], ValueError, r"shape \(3, 48\)"),
           (args["key_mask"][:2], ValueError, r"shape \(3, 48\)"),
           (args["key_mask"].to("meta"), ValueError, "one device"),
           ([[True] * 48] * 3, TypeError, "key_mask must be a torch.Tensor")]
    for mask, error, message in bad:
        with pytest.raises(error, match="key_mask") as raised:
            kvcache.with_key_mask(**{**args, "key_mask": mask})
        assert raised.match(message)
    out = torch.empty(3, 1, 4, 64, dtype=torch.float16)
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], key_mask=out.view(torch.uint8)[:, 0, 0, :48])
    with pytest.raises(ValueError, match="out shares memory with key_mask"):
        checks.check_out(out, t, checks.check(t))


def test_key_mask_is_written_only_when_set() -> None:
    common = ("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096)
    plain = decode_dispatch.decode_variant(*common)
    masked = decode_dispatch.decode_variant(*common, key_mask=True)
    assert "KEY_MASK" not in str(plain) and masked.get("KEY_MASK") is True
    assert str(masked).replace(",KEY_MASK=true", "").replace("maxnreg=128,", "") == str(plain)
    combine = decode_dispatch.decode_variant("flash_decode_combine", SM90, "bf16", 128, False, True, 4, 4096,
                                             key_mask=True)
    assert "KEY_MASK" not in str(combine)
    assert Variant.parse(str(masked)) == masked
    args = make_call(torch.bfloat16, 64, (4, 2), "contiguous", "left", 0)
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], key_mask=args["key_mask"])
    call, unmasked = checks.check(t), checks.check(t._replace(key_mask=None))
    assert call.key_mask and not unmasked.key_mask
    key = binding.memo_key(0, torch.bfloat16, call, True, False)
    assert key[-1] == "key_mask" and key[:-1] == binding.memo_key(0, torch.bfloat16, unmasked, True, False)


# ---------------------------------------------------------------------------
# The warm path: bit for bit the general path's, and its launches


def warm_case(seed: int) -> dict[str, Any]:
    pick = random.Random(seed)
    args = make_call(pick.choice([torch.float16, torch.bfloat16, torch.float32]), pick.choice([32, 64]),
                     pick.choice([(4, 1), (8, 2), (2, 2)]), pick.choice(["contiguous", "transformers", "paged"]),
                     pick.choice(["left", "holes", "view4d", "uint8"]), seed, batch=pick.choice([1, 3]))
    args["num_splits"] = pick.choice([0, 1, 3])
    if pick.random() < 0.5:
        args["cache_seqlens"] = pick.randrange(0, 49)
    args["return_softmax_lse"] = pick.random() < 0.5
    return args


def cold(args: dict[str, Any]) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hot, "serve", lambda *a: None)
        return kvcache.with_key_mask(**args)


@pytest.mark.parametrize("seed", range(8))
def test_warm_key_masked_calls_equal_the_general_path_bit_for_bit(warm: tuple[Runtime, list[bool]],  # noqa: F811
                                                                  seed: int) -> None:
    rt, served = warm
    args = warm_case(seed)
    memoise(rt, args, interpreting)
    want = cold(args)
    kvcache.with_key_mask(**args)  # describes the shape
    got = kvcache.with_key_mask(**args)
    assert served == [True, True]
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,),
                    strict=True):
        assert w.dtype == g.dtype and w.shape == g.shape and torch.equal(bits(w), bits(g)), seed


@pytest.mark.parametrize("seed", range(20, 24))
def test_warm_key_masked_launches_equal_the_general_paths(gpu_path: tuple[Runtime, list[bool]],  # noqa: F811
                                                          seed: int) -> None:
    rt, served = gpu_path
    log: list[tuple[Any, ...]] = []
    args = warm_case(seed)
    memoise(rt, args, recording(log, True), tiles=(16, 64, 16))
    result = cold(args)
    named = {**_named(args, result), args["key_mask"].data_ptr(): "key_mask"}
    want = _roles(log, named)
    split = binding.SPLIT_INT_PARAMS.index("KeyMask")
    assert want[0][4][split] == "key_mask"
    for _ in range(2):
        log.clear()
        result = kvcache.with_key_mask(**args)
        assert _roles(log, {**_named(args, result), args["key_mask"].data_ptr(): "key_mask"}) == want
    assert served == [True, True]


def test_warm_path_passes_softcap_and_sinks_on() -> None:
    """The warm path takes neither: with_key_mask sends those calls to the general path before any lookup."""
    seen: list[Any] = []
    args = make_call(torch.float32, 32, (4, 2), "contiguous", "left", 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hot, "serve", lambda *a: seen.append(a))
        kvcache.with_key_mask(**args, softcap=0.5)
        kvcache.with_key_mask(**args, sinks=torch.zeros(4))
        assert seen == []
        kvcache.with_key_mask(**args)
        assert len(seen) == 1 and seen[0][-1] is args["key_mask"]


# ---------------------------------------------------------------------------
# Prewarm, cache explain, the miss log


def test_prewarm_plans_key_masks_only_when_asked() -> None:
    decode = FAMILIES["flash_decode"]
    plain = enumerate_variants(Axes((SM90,), kernels=decode), EMPTY)
    assert not any(dict(p.variant.functional).get("KEY_MASK") for p in plain)
    both = enumerate_variants(Axes((SM90,), kernels=decode, key_mask=(False, True)), EMPTY)
    masked = [p.variant for p in both if dict(p.variant.functional).get("KEY_MASK")]
    assert masked and {v.kernel for v in masked} == {"flash_decode_split"}
    assert {p.key for p in plain} < {p.key for p in both}
    planned = {p.key for p in both}
    for dtype, head_dim, rows, page in (("bf16", 128, 4, 0), ("fp16", 64, 8, 256), ("bf16", 64, 64, 0)):
        chosen = decode_dispatch.decode_variant("flash_decode_split", SM90, dtype, head_dim, False, True, rows, 4096,
                                                page_size=page, paged=page > 0, table=EMPTY, key_mask=True)
        assert chosen.key() in planned, chosen
    fwd = {"kernels": ("flash_fwd",), "dtypes": ("bf16",), "head_dims": (64,)}
    assert {p.key for p in enumerate_variants(Axes((SM90,), **fwd), EMPTY)} == {
        p.key for p in enumerate_variants(Axes((SM90,), **fwd, key_mask=(False, True)), EMPTY)}


def test_prewarm_cli_and_the_miss_log_take_key_masks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["prewarm", "--target", "sm_90", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128",
            "--list"]
    assert cli_main(base) == 0
    plain = capsys.readouterr().out
    assert cli_main([*base, "--key-mask"]) == 0
    listed = capsys.readouterr().out
    assert "KEY_MASK=true" not in plain and "KEY_MASK=true" in listed
    assert set(plain.splitlines()) < set(listed.splitlines())
    misses = tmp_path / "misses.jsonl"
    variant = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 1024,
                                             key_mask=True, softcap=True)
    misses.write_text(json.dumps({"variant": str(variant), "key": variant.key(), "compile_s": 1.0}) + "\n")
    plan, problems = variants_from_misses(misses.read_text().splitlines(), "m")
    assert not problems and [p.variant for p in plan] == [variant]
    assert cli_main(["prewarm", "--from-misses", str(misses), "--key-mask", "--list"]) == 2
    assert "--key-mask cannot narrow it" in capsys.readouterr().err


def test_explain_describes_a_key_masked_call(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4",
            "--seqlen-k", "576", "--target", "sm_90"]
    assert cli_main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--key-mask", "--json"]) == 0
    masked = json.loads(capsys.readouterr().out)
    assert masked["call"]["key_mask"] is True and plain["call"]["key_mask"] is False
    split, combine = (Variant.parse(k["variant"]) for k in masked["kernels"])
    assert split.get("KEY_MASK") is True and "KEY_MASK" not in str(combine)
    assert str(split).replace(",KEY_MASK=true", "").replace("maxnreg=128,", "") == plain["kernels"][0]["variant"]
    planned = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 576,
                                             key_mask=True)
    assert masked["kernels"][0]["key"] == planned.key()
    assert cli_main([*args, "--key-mask"]) == 0
    assert "a key mask (KEY_MASK=true on the split kernel)" in capsys.readouterr().out
    fwd = ["cache", "explain", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "128", "--target", "sm_90"]
    assert cli_main([*fwd, "--key-mask"]) == 2
    assert "--key-mask is the decoding kernels' key mask" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# On the GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["transformers", "paged"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_key_mask_matches_the_float64_reference(layout: str, head_dim: int) -> None:
    """Serving sizes (batch 8, 16/4 heads, 640 keys, left pads up to 512 and a fully masked row), bf16."""
    args = make_call(torch.bfloat16, head_dim, (16, 4), layout, "left", seed_of(layout, head_dim), batch=8,
                     capacity=640, device="cuda")
    got = kvcache.with_key_mask(**args, return_softmax_lse=True)
    cpu = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    check_out_lse(tuple(x.cpu() for x in got), reference(cpu, True), reference(cpu, False))


@gpu
@pytest.mark.gpu
def test_gpu_warm_key_masked_call_equals_the_cold_one_and_never_synchronises() -> None:
    args = make_call(torch.bfloat16, 128, (16, 4), "transformers", "left", 7, batch=8, capacity=576, device="cuda")
    want = cold(args)
    kvcache.with_key_mask(**args)  # plans and describes
    with syncs_raise():
        got = kvcache.with_key_mask(**args)
    assert torch.equal(bits(want), bits(got))
    assert math.isfinite(float(got.float().abs().max()))
