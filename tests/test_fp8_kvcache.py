"""Float8 KV caches in ``flash_attn_with_kvcache``: e4m3 and e5m2 caches with k_descale/v_descale.

The cache holds x / descale (``kernels/flash_decode/kv_fp8.py``). On CPU the
kernels run through Triton's interpreter, whose float8 conversions
``lazytriton.interpreter`` makes exact (``fp8_encode``/``fp8_decode``,
checked here against torch over every float8 value and their midpoints).

- Numerics: FlashAttention's rule against a float64 reference computed from
  the dequantised cache (``kvcache_reference`` with the descales), over a
  covering design of test_kvcache's axes crossed with the two formats, the
  query dtypes and every descale shape; the new keys and values land
  bit-exact as torch's ``(x.float() / descale).clamp(-max, max).to(fp8)``.
- The features (sinks, packed queries, attention_chunk, cache_leftpad,
  MLA's head dims, gathered pages, rotary): with descales that are powers of
  two, dequantising is exact, and the float8 call returns exactly what the
  same call returns on the dequantised 16-bit cache.
- Bad input raises, naming the argument, before anything is written.
- The variants: KV_FP8 on the split kernel and kv_append only, sm_80 refuses
  e4m3 (Triton has no float8e4nv there) and builds e5m2.
"""

from __future__ import annotations

import importlib
import itertools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import gpu
from test_flash_fwd import seed_of
from test_kvcache import HEADS, Case, check_out_lse, make_inputs

import lazytriton
from lazytriton.interpreter import fp8_decode, fp8_encode
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_decode import NV_CVT_FROM, binding, checks, kv_fp8
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.reference import FP8_MAX, kvcache_reference, quantised
from lazytriton.record import replace
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields, kernel_constexprs

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
DESCALES = ("none", "scalar", "one", "heads", "batch", "k_only")


@dataclass(frozen=True)
class Fp8Case:
    base: Case
    fmt: torch.dtype
    descale: str

    def __str__(self) -> str:
        return f"{checks.KV_FP8[self.fmt]}-{self.descale}-{self.base}"


def covering_cases(n: int = 16) -> list[Fp8Case]:
    """test_kvcache's axes (bf16 and fp16 queries) with every format and descale shape, in varied company."""
    windows = ((-1, -1), (9, 0), (-1, -1), (20, 3))
    layouts = ("contiguous", "page16", "batch_idx", "page32")
    cases = []
    for i in range(n):
        new = (0, 1, 3)[i % 3]
        lens = ("tensor", "int", "tensor", "none")[i % 4]
        new = 0 if lens == "none" else new
        base = Case((torch.bfloat16, torch.float16)[i % 2], (64, 128, 40, 64)[(i // 2) % 4], (1, 4, 1)[i % 3],
                    HEADS[i % 4], new, layouts[(i // 3) % 4], lens, bool((i // 2) % 2), windows[i % 4],
                    (0.0, 2.0, 0.0)[(i // 4) % 3], ("", "heads", "batch")[i % 3], (0, 1, 3, 2)[(i + 1) % 4])
        cases.append(Fp8Case(base, FORMATS[(i // 2) % 2], DESCALES[i % 6]))
    return cases


CASES = covering_cases()


def descales(kind: str, batch: int, heads_k: int, gen: torch.Generator,
             pow2: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k_descale, v_descale) of a shape kind, fresh random positive values (powers of two with ``pow2``)."""
    shape = {"scalar": (), "one": (1,), "heads": (heads_k,), "batch": (batch, heads_k),
             "k_only": (heads_k,)}.get(kind)
    if shape is None:
        return None, None

    def draw() -> torch.Tensor:
        if pow2:
            return torch.exp2(torch.randint(-6, -1, shape, generator=gen).float())
        return torch.rand(shape, generator=gen) * 0.05 + 0.01

    return draw(), None if kind == "k_only" else draw()


def to_fp8(x: torch.Tensor, fmt: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A float8 cache of x's shape: random values of the format's range (x is only its shape)."""
    return (torch.randn(x.shape, generator=gen) * 8).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt)


def fp8_inputs(case: Fp8Case, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    args = make_inputs(case.base, batch=batch, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    args["k_cache"], args["v_cache"] = to_fp8(args["k_cache"], case.fmt, gen), to_fp8(args["v_cache"], case.fmt, gen)
    kd, vd = descales(case.descale, batch, case.base.heads[1], gen)
    if kd is not None:
        args["k_descale"] = kd
    if vd is not None:
        args["v_descale"] = vd
    if "k" in args:  # new keys at a magnitude that uses the format's range (and saturates some with e4m3)
        args["k"], args["v"] = args["k"] * 4, args["v"] * 4
    return args


def run(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, ...]:
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **opts, return_softmax_lse=True)
    return out, lse, mine["k_cache"], mine["v_cache"]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def check_fp8(args: dict[str, Any], got: tuple[torch.Tensor, ...], **opts: Any) -> None:
    """The caches bit-exact as the reference appends (torch's conversion); out and lse by FlashAttention's rule."""
    out, lse, k_cache, v_cache = got
    wide = {name: (t.double() if name in ("q", "k", "v") else t) for name, t in args.items()}
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**wide, **opts)
    same_out, same_lse, same_k, same_v = kvcache_reference(**args, **opts)
    assert torch.equal(bits(k_cache), bits(same_k)) and torch.equal(bits(v_cache), bits(same_v)), \
        "the new keys/values are not the reference's float8 bytes"
    assert torch.equal(bits(ref_k), bits(same_k)) and torch.equal(bits(ref_v), bits(same_v))
    check_out_lse((out, lse), (ref_out, ref_lse), (same_out, same_lse))


# ---------------------------------------------------------------------------
# The interpreter's float8 conversions, against torch


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: checks.KV_FP8[f])
def test_the_interpreters_float8_conversions_are_torchs(fmt: torch.dtype) -> None:
    name = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}[fmt]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = fp8_decode(every.numpy(), name)
    want = every.view(fmt).float().numpy()
    assert np.array_equal(decoded, want, equal_nan=True)
    finite = torch.from_numpy(decoded)[torch.isfinite(torch.from_numpy(decoded))].unique()
    gen = torch.Generator().manual_seed(7)
    spread = torch.randn(50000, generator=gen) * torch.exp2(torch.randint(-28, 18, (50000,), generator=gen).float())
    x = torch.cat([spread, (finite[1:] + finite[:-1]) / 2, finite, torch.tensor([float("inf"), -float("inf"), 1e30])])
    limit = FP8_MAX[fmt]
    assert torch.equal(torch.from_numpy(fp8_encode(x.numpy(), name)), bits(x.clamp(-limit, limit).to(fmt)))
    assert np.isnan(fp8_decode(fp8_encode(np.array([np.nan], np.float32), name), name)).all()


# ---------------------------------------------------------------------------
# Numerics on CPU, through Triton's interpreter


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_kvcache_cpu(case: Fp8Case) -> None:
    args = fp8_inputs(case, seed=seed_of(str(case)))
    opts = {"causal": case.base.causal, "window_size": case.base.window, "softcap": case.base.softcap}
    check_fp8(args, run(args, **opts, num_splits=case.base.splits), **opts)


def test_the_covering_design_covers_every_option() -> None:
    for axis, values in (("fmt", set(FORMATS)), ("descale", set(DESCALES))):
        assert {getattr(c, axis) for c in CASES} == values, axis
    for axis, values in (("dtype", {torch.bfloat16, torch.float16}), ("new", {0, 1, 3}), ("seqlen_q", {1, 4}),
                         ("layout", {"contiguous", "page16", "batch_idx", "page32"}), ("causal", {False, True}),
                         ("softcap", {0.0, 2.0}), ("alibi", {"", "heads", "batch"}), ("splits", {0, 1, 2, 3}),
                         ("heads", set(HEADS))):
        assert {getattr(c.base, axis) for c in CASES} == values, axis
    assert {(c.fmt, c.base.dtype) for c in CASES} == set(itertools.product(FORMATS, (torch.bfloat16, torch.float16)))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: checks.KV_FP8[f])
def test_appended_keys_saturate_and_round_to_nearest_even_as_torch(fmt: torch.dtype) -> None:
    """Values past the range, ties between two float8 values, subnormals: kv_append's bytes are torch's."""
    gen = torch.Generator().manual_seed(3)
    batch, new, hk, d = 2, 5, 2, 64
    kd, vd = torch.tensor([0.25, 0.5]), torch.tensor([[0.125, 1.0], [2.0, 0.0625]])
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    finite = every[torch.isfinite(every)].unique()
    ties = ((finite[1:] + finite[:-1]) / 2)
    pool = torch.cat([ties, finite, torch.tensor([1e5, -1e5, 3e38, -3e38]), torch.randn(200, generator=gen)])
    k = pool[torch.randint(0, pool.numel(), (batch, new, hk, d), generator=gen)]
    v = pool[torch.randint(0, pool.numel(), (batch, new, hk, d), generator=gen)]
    k, v = (k * kd[None, None, :, None]).bfloat16(), (v * vd[:, None, :, None]).bfloat16()
    q = torch.randn(batch, 1, 4, d, generator=gen, dtype=torch.float32).bfloat16()
    k_cache, v_cache = torch.zeros(batch, 16, hk, d, dtype=fmt), torch.zeros(batch, 16, hk, d, dtype=fmt)
    lens = torch.tensor([3, 11], dtype=torch.int32)
    lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, k_descale=kd, v_descale=vd)
    limit = FP8_MAX[fmt]
    for b in range(batch):
        at = slice(int(lens[b]), int(lens[b]) + new)
        want_k = (k[b].float() / kd[None, :, None]).clamp(-limit, limit).to(fmt)
        want_v = (v[b].float() / vd[b][None, :, None]).clamp(-limit, limit).to(fmt)
        assert torch.equal(bits(k_cache[b, at]), bits(want_k)) and torch.equal(bits(v_cache[b, at]), bits(want_v))
    assert bits(k_cache).eq(0x7E if fmt == torch.float8_e4m3fn else 0x7B).any(), "no value saturated"


# ---------------------------------------------------------------------------
# The features: exactly the call on the dequantised cache (descales powers of two)


def dequantised_twin(args: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The same call on 16-bit caches holding the float8 cache x its descale (exact for powers of two)."""
    twin = {n: t for n, t in args.items() if n not in ("k_descale", "v_descale")}
    hk = args["k_cache"].shape[2]
    for cache, name in (("k_cache", "k_descale"), ("v_cache", "v_descale")):
        scale = args.get(name)
        scale = torch.ones(hk) if scale is None else scale.reshape(-1).expand(hk)
        twin[cache] = (args[cache].double() * scale.double()[:, None]).to(dtype)
    return twin


def representable(x: torch.Tensor, scale: torch.Tensor | None, fmt: torch.dtype) -> torch.Tensor:
    """x moved onto float8 values times ``scale`` (per head), so that quantising it is exact."""
    s = torch.ones(x.shape[2]) if scale is None else scale.reshape(-1).expand(x.shape[2])
    return (quantised(x, s.double(), fmt).double() * s.double()[:, None]).to(x.dtype)


FEATURES = {
    "sinks": {"sinks": True},
    "leftpad_causal": {"leftpad": True, "causal": True},
    "chunk": {"attention_chunk": 7, "causal": True},
    "head_dim_v": {"head_dim_v": 32},
    "gathered_pages": {"page": 5},
    "varlen_q": {"varlen_q": True},
    "window_alibi": {"window_size": (6, 2), "alibi": True},
}


def feature_args(name: str, fmt: torch.dtype, dtype: torch.dtype, seed: int
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arguments, options) of a call with one feature, new keys representable, descales powers of two."""
    spec = FEATURES[name]
    gen = torch.Generator().manual_seed(seed)
    batch, hq, hk, d, sq, new = 3, 4, 2, 64, 3, 2
    dv = spec.get("head_dim_v", d)
    page = spec.get("page", 0)
    rows = (batch * 40 // page + 8) if page else batch
    length = page if page else 40
    kd, vd = descales("heads", batch, hk, gen, pow2=True)
    args: dict[str, Any] = {
        "k_cache": to_fp8(torch.empty(rows, length, hk, d), fmt, gen),
        "v_cache": to_fp8(torch.empty(rows, length, hk, dv), fmt, gen),
        "cache_seqlens": torch.tensor([20, 0, 38][:batch], dtype=torch.int32), "k_descale": kd, "v_descale": vd}
    if spec.get("varlen_q"):
        counts = [2, 0, 3]
        args["q"] = torch.randn(sum(counts), hq, d, generator=gen).to(dtype)
        args["cu_seqlens_q"] = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
        options: dict[str, Any] = {"max_seqlen_q": 3, "causal": True}
    else:
        args["q"] = torch.randn(batch, sq, hq, d, generator=gen).to(dtype)
        options = {k: v for k, v in spec.items() if k in ("causal", "window_size", "attention_chunk")}
    k = torch.randn(batch, new, hk, d, generator=gen).to(dtype) * 4
    v = torch.randn(batch, new, hk, dv, generator=gen).to(dtype) * 4
    args["k"], args["v"] = representable(k, kd, fmt), representable(v, vd, fmt)
    if page:
        args["block_table"] = torch.randperm(rows, generator=gen)[:batch * -(-40 // page)].reshape(
            batch, -1).to(torch.int32)
    if spec.get("sinks"):
        args["sinks"] = torch.randn(hq, generator=gen)
    if spec.get("leftpad"):
        args["cache_leftpad"] = torch.tensor([5, 0, 17], dtype=torch.int32)
    if spec.get("alibi"):
        args["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.3
    return args, options


@pytest.mark.parametrize(("name", "fmt"), list(itertools.product(FEATURES, FORMATS)),
                         ids=lambda x: checks.KV_FP8.get(x, x) if isinstance(x, torch.dtype) else x)
def test_the_fp8_call_is_the_call_on_the_dequantised_cache(name: str, fmt: torch.dtype) -> None:
    """A float8 cache's dots run in float16 (q scaled by a power of two): the float16 call on its float16 twin.

    With bfloat16 queries (here e4m3's) the twin takes them in float16 (exact at these magnitudes) and its
    output is rounded once more, to bfloat16: within one bfloat16 step of the float8 call's.
    """
    dtype = torch.bfloat16 if fmt == torch.float8_e4m3fn else torch.float16
    args, opts = feature_args(name, fmt, dtype, seed_of(name, str(fmt)))
    out, lse, k_cache, v_cache = run(args, **opts, num_splits=2)
    halves = {n: t.to(torch.float16) if isinstance(t, torch.Tensor) and t.dtype == dtype else t
              for n, t in args.items()}
    assert all(torch.equal(halves[n].to(dtype), t) for n, t in args.items() if n in ("q", "k", "v"))
    twin = run(dequantised_twin(halves, torch.float16), **opts, num_splits=2)
    assert torch.equal(lse, twin[1])
    if dtype == torch.float16:
        assert torch.equal(out, twin[0])
    else:
        step = twin[0].float().abs().clamp_min(2.0**-126) * 2.0**-7  # one bfloat16 step (8 significant bits)
        assert ((out.float() - twin[0].to(dtype).float()).abs() <= step).all()
    after = dequantised_twin({**args, "k_cache": k_cache, "v_cache": v_cache}, torch.float16)
    assert torch.equal(after["k_cache"], twin[2]) and torch.equal(after["v_cache"], twin[3]), \
        "the appended keys are not the twin's"


@pytest.mark.parametrize("shift", [20, -40, 0])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: checks.KV_FP8[f])
def test_a_query_past_float16s_range_is_scaled_into_it_exactly(fmt: torch.dtype, shift: int) -> None:
    """q x 2**shift with softmax_scale x 2**-shift gives the same bits: the kernel's float16 q is the same.

    2**20 puts the query past float16's largest value (65504) and 2**-40 below its smallest (2**-24): the kernel
    scales q by a power of two from its own largest magnitude, so neither overflows nor flushes (bfloat16
    queries: float16 ones cannot hold such values).
    """
    args, opts = feature_args("sinks", fmt, torch.bfloat16, seed_of("range", str(fmt)))
    want = run(args, **opts, num_splits=2, softmax_scale=0.125)
    scaled = {**args, "q": (args["q"].double() * 2.0**shift).to(torch.bfloat16)}
    assert torch.equal(scaled["q"].double() * 2.0**-shift, args["q"].double())  # exact in q's dtype
    got = run(scaled, **opts, num_splits=2, softmax_scale=0.125 * 2.0**-shift)
    assert torch.isfinite(got[0]).all()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_rotary_keys_are_rotated_then_quantised() -> None:
    from test_kvcache_rotary import tables

    fmt, dtype = torch.float8_e4m3fn, torch.bfloat16
    base = Case(dtype, 64, 2, (4, 2), 3, "page16", "tensor", True, (-1, -1), 0.0, "", 2)
    case = Fp8Case(base, fmt, "batch")
    args = fp8_inputs(case, seed=11)
    args["rotary_cos"], args["rotary_sin"] = tables(64, 32, dtype, 11)
    opts = {"causal": True, "rotary_interleaved": False}
    got = run(args, **opts, num_splits=2)
    same = kvcache_reference(**args, **opts)
    assert torch.equal(bits(got[2]), bits(same[2])) and torch.equal(bits(got[3]), bits(same[3]))
    wide = {n: (t.double() if n in ("q",) else t) for n, t in args.items()}
    ref = kvcache_reference(**wide, **opts)
    check_out_lse(got[:2], ref[:2], same[:2])


def test_the_op_and_torch_compile_take_the_descales() -> None:
    torch._dynamo.reset()
    case = Fp8Case(Case(torch.bfloat16, 64, 1, (4, 2), 1, "page16", "tensor", False, (-1, -1), 0.0, "", 2),
                   torch.float8_e5m2, "heads")
    args = fp8_inputs(case, seed=2)

    def step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor, table: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,  # type: ignore
                                                  block_table=table, num_splits=2, k_descale=kd, v_descale=vd)

    inputs = [args[n] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "k_descale",
                                "v_descale")]
    eager_k, eager_v = args["k_cache"].clone(), args["v_cache"].clone()
    want = step(inputs[0], eager_k, eager_v, *inputs[3:])
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    assert torch.equal(got, want)
    assert torch.equal(bits(args["k_cache"]), bits(eager_k)) and torch.equal(bits(args["v_cache"]), bits(eager_v))


# ---------------------------------------------------------------------------
# Bad input: named, before anything is written


def _valid(fmt: torch.dtype = torch.float8_e4m3fn) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"q": torch.randn(2, 1, 4, 64, generator=gen).bfloat16(),
            "k_cache": to_fp8(torch.empty(2, 32, 2, 64), fmt, gen),
            "v_cache": to_fp8(torch.empty(2, 32, 2, 64), fmt, gen),
            "k": torch.randn(2, 1, 2, 64, generator=gen).bfloat16(),
            "v": torch.randn(2, 1, 2, 64, generator=gen).bfloat16(),
            "cache_seqlens": torch.tensor([3, 9], dtype=torch.int32), "k_descale": torch.full((2,), 0.5),
            "v_descale": torch.full((2, 2), 0.25)}


BAD = [
    ("v_cache bf16", lambda a: a.update(v_cache=a["v_cache"].bfloat16()), TypeError, "v_cache has dtype"),
    ("mixed formats", lambda a: a.update(v_cache=a["v_cache"].float().to(torch.float8_e5m2)), TypeError,
     "v_cache has dtype"),
    ("fp8 query", lambda a: a.update(q=a["q"].to(torch.float8_e4m3fn)), TypeError, "k must be torch.float8_e4m3fn"),
    ("fp32 query", lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()), TypeError,
     "q must be float16 or bfloat16 with a float8 k_cache"),
    ("fp8 new keys", lambda a: a.update(k=a["k"].to(torch.float8_e4m3fn)), TypeError, "k must be"),
    ("descale on a bf16 cache", lambda a: a.update(k_cache=a["k_cache"].bfloat16(), v_cache=a["v_cache"].bfloat16()),
     ValueError, "k_descale is given but k_cache is torch.bfloat16"),
    ("v_descale only, bf16 cache", lambda a: a.update(k_cache=a["k_cache"].bfloat16(),
                                                     v_cache=a["v_cache"].bfloat16(), k_descale=None),
     ValueError, "v_descale is given"),
    ("misshaped k_descale", lambda a: a.update(k_descale=torch.ones(4)), ValueError, "k_descale must have shape"),
    ("misshaped v_descale", lambda a: a.update(v_descale=torch.ones(2, 4)), ValueError, "v_descale must have shape"),
    ("batch x heads swapped", lambda a: a.update(v_descale=torch.ones(1, 2, 2)), ValueError, "v_descale must have"),
    ("float64 descale", lambda a: a.update(k_descale=torch.ones(2, dtype=torch.float64)), TypeError,
     "k_descale must be torch.float32"),
    ("bf16 descale", lambda a: a.update(v_descale=torch.ones(2, dtype=torch.bfloat16)), TypeError,
     "v_descale must be torch.float32"),
    ("a float descale", lambda a: a.update(k_descale=0.5), TypeError, "k_descale must be a torch.Tensor"),
]


@pytest.mark.parametrize(("what", "change", "error", "needle"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_before_anything_is_written(what: str, change: Any, error: type, needle: str) -> None:
    args = _valid()
    change(args)
    before = [args[name].clone() for name in ("k_cache", "v_cache")]
    with pytest.raises(error, match=re.escape(needle)):
        lazytriton.flash_attn_with_kvcache(**args)
    for name, old in zip(("k_cache", "v_cache"), before, strict=True):
        assert torch.equal(args[name].view(torch.uint8), old.view(torch.uint8)), f"{name} was written"


def test_a_target_without_e4m3_refuses_it_naming_k_cache() -> None:
    sm80 = Target.parse("sm_80")
    for kernel in ("flash_decode_split", "kv_append"):
        with pytest.raises(ValueError, match="k_cache is a float8 .e4m3. cache but sm_80 has no float8_e4m3fn"):
            dispatch.kernel_variant(kernel, sm80, "bf16", 128, False, True, 16, 4096, kv_fp8="e4m3")
        assert dispatch.kernel_variant(kernel, sm80, "bf16", 128, False, True, 16, 4096,
                                       kv_fp8="e5m2").get("KV_FP8") == "e5m2"
    assert kv_fp8.unsupported(Target.parse("sm_89"), "e4m3") is None
    assert kv_fp8.unsupported(Target.parse("gfx942"), "e4m3") is None
    assert "sm_86" in str(kv_fp8.unsupported(Target.parse("sm_86"), "e4m3"))


# ---------------------------------------------------------------------------
# Variants and memo keys


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_kv_fp8_is_a_field_of_the_split_kernel_and_kv_append_only(kv: str) -> None:
    sm90 = Target.parse("sm_90")
    plain = {k: dispatch.kernel_variant(k, sm90, "bf16", 128, False, True, 16, 4096, paged=True)
             for k in ("flash_decode_split", "flash_decode_combine", "kv_append")}
    fp8 = {k: dispatch.kernel_variant(k, sm90, "bf16", 128, False, True, 16, 4096, paged=True, kv_fp8=kv)
           for k in plain}
    assert "KV_FP8" not in str(plain["flash_decode_split"]) and "KV_FP8" not in str(plain["kv_append"])
    assert fp8["flash_decode_combine"] == plain["flash_decode_combine"]
    for kernel in ("flash_decode_split", "kv_append"):
        variant = fp8[kernel]
        assert f"KV_FP8={kv}" in str(variant) and Variant.parse(str(variant)) == variant
        assert check_fields(variant) is variant and variant.key() != plain[kernel].key()
    assert str(fp8["kv_append"]).replace(f",KV_FP8={kv}", "") == str(plain["kv_append"])  # the plain call's tiles
    # the split kernel's functional fields are the plain call's; its tile the measured paged float8 one
    functional = str(fp8["flash_decode_split"]).split(":")[3]
    assert functional.replace(f",KV_FP8={kv}", "") == str(plain["flash_decode_split"]).split(":")[3]
    split = fp8["flash_decode_split"]
    assert (int(split.get("BLOCK_N")), int(split.get("num_warps")), int(split.get("num_stages"))) == (
        decode_dispatch.fp8_cuda_tile(128, 4096, paged=True))
    assert kernel_constexprs(plain["flash_decode_split"], ("KV_FP8",)) == {"KV_FP8": "none"}
    assert kernel_constexprs(fp8["kv_append"], ("KV_FP8",)) == {"KV_FP8": kv}


@pytest.mark.parametrize("value", ["e3m4", "fp8", "true"])
def test_check_fields_refuses_other_kv_fp8_values(value: str) -> None:
    text = str(dispatch.kernel_variant("kv_append", Target.parse("sm_90"), "bf16", 64, False, True, 1, 1,
                                       kv_fp8="e4m3")).replace("KV_FP8=e4m3", f"KV_FP8={value}")
    with pytest.raises(ValueError, match="KV_FP8"):
        check_fields(Variant.parse(text))


def test_the_memo_keys_carry_the_format() -> None:
    from lazytriton.kernels.kv_append import binding as append_binding

    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      k_descale=args["k_descale"], v_descale=args["v_descale"])
    call = checks.check(t)
    assert call.kv_fp8 == "e4m3"
    plain = call._replace(kv_fp8="none")
    assert binding.memo_key(0, torch.bfloat16, call, True, False)[-2:] == ("e4m3", 0)  # format, pair class
    assert binding.memo_key(0, torch.bfloat16, plain, True, False)[-1] != "e4m3"
    assert append_binding.memo_key(0, torch.bfloat16, call, True, False)[-1] == "e4m3"
    assert len(binding.split_ints(t, *binding.empty_outputs(args["q"], call), args["q"], args["q"], call, 1,
                                  pointers=id)) == len(binding.SPLIT_INT_PARAMS)


# ---------------------------------------------------------------------------
# Prewarm, cache explain, the miss log, the compiler


def test_prewarm_plans_float8_caches_only_when_asked_and_leaves_e4m3_out_of_sm80() -> None:
    from lazytriton.kernels import FAMILIES
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants, left_out
    from lazytriton.tuning import Table

    targets = (Target.parse("sm_90"), Target.parse("sm_80"))
    plain = enumerate_variants(Axes(targets, kernels=FAMILIES["flash_decode"]), Table(()))
    assert not any("KV_FP8" in str(p.variant) for p in plain)
    axes = Axes(targets, kernels=FAMILIES["flash_decode"], kv_fp8=("none", "e4m3", "e5m2"))
    every = enumerate_variants(axes, Table(()))
    assert {p.key for p in plain} < {p.key for p in every}
    fp8 = {(p.variant.kernel, p.variant.target, str(p.variant.get("KV_FP8"))) for p in every
           if "KV_FP8" in str(p.variant)}
    assert fp8 == {(k, t, kv) for k in ("flash_decode_split", "kv_append") for t, kv in
                   (("sm_90", "e4m3"), ("sm_90", "e5m2"), ("sm_80", "e5m2"))}
    assert left_out(axes) == [f"the e4m3 KV caches for sm_80: {kv_fp8.unsupported(targets[1], 'e4m3')}"]
    planned = {p.key for p in every}
    for kernel in ("flash_decode_split", "kv_append"):
        wanted = dispatch.kernel_variant(kernel, targets[0], "bf16", 128, False, True, 16, 16, paged=True,
                                         table=Table(()), kv_fp8="e4m3")
        assert wanted.key() in planned, wanted
    with pytest.raises(ValueError, match="kv_fp8 formats must be among"):
        Axes(targets, kv_fp8=("fp8",))


def test_prewarm_plans_a_float8_paged_cache_for_pages_of_any_multiple_of_64_keys() -> None:
    """The default plan (no --page-size) holds the paged float8 variants of pages of 64, 128, 192 and 256 keys: at
    16k keys and more the measured tile has 128 keys, cut to 64 on pages 128 does not divide."""
    from lazytriton import tuning
    from lazytriton.kernels import FAMILIES
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    sm90 = Target.parse("sm_90")
    kernels = FAMILIES["flash_decode"]
    table = tuning.tables_for(kernels)
    planned = {p.key for p in enumerate_variants(Axes((sm90,), kernels=kernels, kv_fp8=("e4m3",),
                                                      head_dims=(128,), seqlens_k=(4096, 32768)), table)}
    block_n = set()
    for capacity, page, pairs in itertools.product((4096, 32768), (64, 128, 192, 256), (1, 16, 64, 300)):
        wanted = dispatch.kernel_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, capacity,
                                         paged=True, page_size=page, table=table, kv_fp8="e4m3", kv_pairs=pairs)
        assert wanted.key() in planned, (capacity, page, pairs, wanted)
        block_n.add(int(wanted.get("BLOCK_N")))
    assert block_n == {64, 128}
    # and a contiguous cache's every pair class (4k keys: 64-key tiles below 256 pairs, 128 from)
    contiguous = {p.key for p in enumerate_variants(Axes((sm90,), kernels=kernels, kv_fp8=("e4m3",), head_dims=(128,),
                                                         seqlens_k=(4096,), paged=(False,)), table)}
    tiles = set()
    for pairs in (1, 32, 256):
        wanted = dispatch.kernel_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, 4096, table=table,
                                         kv_fp8="e4m3", kv_pairs=pairs)
        assert wanted.key() in contiguous, (pairs, wanted)
        tiles.add(int(wanted.get("BLOCK_N")))
    assert tiles == {64, 128}


def test_prewarm_cli_and_the_miss_log_take_the_format(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lazytriton.cli import main as cli_main
    from lazytriton.prewarm.enumeration import variants_from_misses

    base = ["prewarm", "--target", "sm_90,sm_80", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128",
            "--list"]
    assert cli_main([*base, "--kv-dtype", "e4m3"]) == 0
    captured = capsys.readouterr()
    assert "prewarm: left out the e4m3 KV caches for sm_80" in captured.err
    assert any("KV_FP8=e4m3" in line and "sm_90" in line for line in captured.out.splitlines())
    assert not any("KV_FP8" in line and "sm_80" in line for line in captured.out.splitlines())
    sm80, sm90 = Target.parse("sm_80"), Target.parse("sm_90")
    good = dispatch.kernel_variant("flash_decode_split", sm80, "fp16", 64, True, True, 8, 4096, kv_fp8="e5m2")
    bad = str(dispatch.kernel_variant("kv_append", sm90, "fp16", 64, False, True, 1, 1, kv_fp8="e4m3")).replace(
        "sm_90", "sm_80")
    lines = [json.dumps({"variant": text, "key": "0" * 32}) for text in (str(good), bad)]
    plan, problems = variants_from_misses(lines, "m")
    assert [p.variant for p in plan] == [good]
    assert len(problems) == 1 and "m:2: refused" in problems[0] and "float8e4nv needs sm_89" in problems[0]


def test_explain_describes_a_float8_cache(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lazytriton.cli import main as cli_main

    args = ["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4",
            "--seqlen-k", "4096", "--target", "sm_90", "--page-size", "256", "--json"]
    assert cli_main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--kv-dtype", "e5m2"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["call"]["kv_dtype"] == "e5m2" and plain["call"]["kv_dtype"] == "none"
    split, combine = (Variant.parse(k["variant"]) for k in fp8["kernels"])
    assert split.get("KV_FP8") == "e5m2" and "KV_FP8" not in str(combine)
    # the plain call's functional fields, at the paged float8 tile (dispatch.fp8_cuda_tile)
    assert str(split).split(":")[3].replace(",KV_FP8=e5m2", "") == plain["kernels"][0]["variant"].split(":")[3]
    assert (int(split.get("BLOCK_N")), int(split.get("num_warps")), int(split.get("num_stages"))) == (
        decode_dispatch.fp8_cuda_tile(128, 4096, paged=True))
    assert fp8["kernels"][1]["key"] == plain["kernels"][1]["key"]
    assert cli_main([*args[:-1], "--kv-dtype", "e4m3"]) == 0
    assert "a float8 cache (e4m3: KV_FP8=e4m3 on the split kernel" in capsys.readouterr().out
    # a batch of 8 sequences of 8 key/value heads: the paged float8 tile of 64 pairs at 4k keys
    assert cli_main([*args, "--kv-dtype", "e4m3", "--kv-pairs", "64"]) == 0
    wide = json.loads(capsys.readouterr().out)
    assert wide["call"]["kv_pairs"] == 64 and fp8["call"]["kv_pairs"] == 1
    split = Variant.parse(wide["kernels"][0]["variant"])
    assert (int(split.get("BLOCK_N")), int(split.get("num_warps")), int(split.get("num_stages"))) == (
        decode_dispatch.fp8_cuda_tile(128, 4096, paged=True, kv_pairs=64)) == (128, 4, 5)
    assert cli_main([*args, "--kv-dtype", "e4m3", "--kv-pairs", "0"]) == 2
    assert "a count >= 1, got 0" in capsys.readouterr().err
    assert cli_main([*args, "--kv-pairs", "8"]) == 2
    assert "got 8 without --kv-dtype" in capsys.readouterr().err
    for refused, needle in ((["--target", "sm_80"], "sm_80 has no float8_e4m3fn"),
                            (["--dtype", "fp32"], "q must be float16 or bfloat16 with a float8 k_cache")):
        changed = [*args[:-1], "--kv-dtype", "e4m3"]
        flag, value = refused
        changed[changed.index(flag) + 1] = value
        assert cli_main(changed) == 2
        assert needle in capsys.readouterr().err
    fwd = ["cache", "explain", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "128", "--target", "sm_90"]
    assert cli_main([*fwd, "--kv-dtype", "e4m3"]) == 2
    assert "--kv-dtype is flash_attn_with_kvcache's float8 cache" in capsys.readouterr().err


@pytest.mark.parametrize(("target", "kv"), [("sm_90", "e4m3"), ("sm_80", "e5m2"), ("gfx942", "e4m3")])
def test_float8_variants_compile(target: str, kv: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real entries (Triton's compiler, no GPU): the split kernel and kv_append of a float8 cache, paged."""
    from compiled_once import compiled, shared_dir

    from lazytriton.kernels import get

    where = shared_dir(tmp_path_factory)
    for kernel in ("flash_decode_split", "kv_append"):
        variant = dispatch.kernel_variant(kernel, Target.parse(target), "bf16", 128, False, True, 4, 4096,
                                          paged=True, kv_fp8=kv)
        entry = compiled(variant, where)
        assert len(entry.arg_types) == len(get(kernel).params)


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_nv_cvt_converts_v_in_the_loads_layout(kv: str) -> None:
    """NV_CVT (off by default): V's float8 tile reaches the dot through float16 ``ldmatrix .trans``, not byte loads.

    Compiled for sm_90 (PTX, no GPU) with the flag as the compile target sets it where it is on, and without it.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lazytriton.compiler import divisibility_hints
    from lazytriton.kernels import get

    spec = get("flash_decode_split")
    assert spec.target_constexprs("cuda", 90)["NV_CVT"] == (NV_CVT_FROM is not None and 90 >= NV_CVT_FROM)
    on = replace(spec, capability_flags=(("NV_CVT", 89), ("PDL", None)))
    assert on.target_constexprs("cuda", 90) == {"NV_CVT": True, "PDL": False}
    assert on.target_constexprs("cuda", 80) == on.target_constexprs("hip", 0) == {"NV_CVT": False, "PDL": False}
    variant = dispatch.kernel_variant("flash_decode_split", Target.parse("sm_90"), "bf16", 128, False, True, 4,
                                      4096, kv_fp8=kv)
    fn = getattr(importlib.import_module(spec.module), spec.function)
    ptx = {}
    for flag in (True, False):
        constexprs = {**kernel_constexprs(variant, spec.constexprs), "NV_CVT": flag, "PDL": False}
        source = ASTSource(fn, on.signature("bf16", False, constexprs), constexprs=constexprs,
                           attrs=divisibility_hints(spec, variant))
        ptx[flag] = str(triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                       options=dict(variant.options)).asm["ptx"])
    assert f"cvt.rn.f16x2.{kv}x2" in ptx[True] and "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx[True]
    assert "ld.shared.b8" not in ptx[True] and "ld.shared.b8" in ptx[False]


# ---------------------------------------------------------------------------
# On the GPU, at real sizes


def _gpu_cache(fmt: torch.dtype, batch: int, capacity: int, hk: int, d: int, paged: bool, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if not paged:
        return (to_fp8(torch.empty(batch, capacity, hk, d), fmt, gen).cuda(),
                to_fp8(torch.empty(batch, capacity, hk, d), fmt, gen).cuda(), None)
    page, blocks = 256, capacity // 256
    table = torch.randperm(batch * blocks * 2, generator=gen)[:batch * blocks].reshape(batch, blocks).int().cuda()
    return (to_fp8(torch.empty(batch * blocks * 2, page, hk, d), fmt, gen).cuda(),
            to_fp8(torch.empty(batch * blocks * 2, page, hk, d), fmt, gen).cuda(), table)


@gpu
@pytest.mark.parametrize(("fmt", "dtype", "paged", "batch", "heads"), [
    (torch.float8_e4m3fn, torch.bfloat16, False, 4, (32, 8)), (torch.float8_e4m3fn, torch.bfloat16, True, 16, (32, 8)),
    (torch.float8_e5m2, torch.float16, True, 2, (16, 16)), (torch.float8_e4m3fn, torch.float16, False, 1, (8, 1))],
    ids=str)
def test_fp8_kvcache_gpu(fmt: torch.dtype, dtype: torch.dtype, paged: bool, batch: int, heads: tuple[int, int]
                         ) -> None:
    if fmt == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3fn caches need sm_89 or newer (kv_fp8.unsupported)")
    gen = torch.Generator().manual_seed(seed_of(str(fmt), paged, batch))
    hq, hk = heads
    d, capacity, new = 128, 4096, 1
    k_cache, v_cache, table = _gpu_cache(fmt, batch, capacity, hk, d, paged, gen)
    args: dict[str, Any] = {"q": torch.randn(batch, 1, hq, d, generator=gen).to(dtype).cuda(), "k_cache": k_cache,
                            "v_cache": v_cache, "block_table": table,
                            "k": (torch.randn(batch, new, hk, d, generator=gen) * 4).to(dtype).cuda(),
                            "v": (torch.randn(batch, new, hk, d, generator=gen) * 4).to(dtype).cuda(),
                            "cache_seqlens": torch.randint(1000, capacity - new, (batch,), generator=gen).int().cuda(),
                            "k_descale": (torch.rand(batch, hk, generator=gen) * 0.05 + 0.01).cuda(),
                            "v_descale": (torch.rand(hk, generator=gen) * 0.05 + 0.01).cuda()}
    got = run(args, causal=True)
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    check_fp8(cpu, tuple(t.cpu() for t in got), causal=True)


@gpu
def test_kv_append_quantises_on_the_gpu_as_torch_does() -> None:
    fmt = torch.float8_e4m3fn if torch.cuda.get_device_capability() >= (8, 9) else torch.float8_e5m2
    gen = torch.Generator().manual_seed(5)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    finite = every[torch.isfinite(every)].unique()
    pool = torch.cat([(finite[1:] + finite[:-1]) / 2, finite, torch.tensor([1e5, -1e5]),
                      torch.randn(500, generator=gen)])
    batch, new, hk, d = 8, 16, 8, 128
    kd = (torch.rand(batch, hk, generator=gen) + 0.1)
    k = (pool[torch.randint(0, pool.numel(), (batch, new, hk, d), generator=gen)] * kd[:, None, :, None]).bfloat16()
    k_cache = torch.zeros(batch, 64, hk, d, dtype=fmt).cuda()
    v_cache = torch.zeros(batch, 64, hk, d, dtype=fmt).cuda()
    q = torch.randn(batch, 1, hk, d, generator=gen).bfloat16().cuda()
    lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, k.cuda(), k.cuda(), cache_seqlens=7, k_descale=kd.cuda())
    limit = FP8_MAX[fmt]
    want = (k.float() / kd[:, None, :, None]).clamp(-limit, limit).to(fmt)
    assert torch.equal(bits(k_cache[:, 7:7 + new].cpu()), bits(want))
    assert torch.equal(bits(v_cache[:, 7:7 + new].cpu()), bits(k.float().clamp(-limit, limit).to(fmt)))


def test_the_gpu_tests_skip_with_a_reason_on_cpu() -> None:
    assert gpu.kwargs["reason"].startswith("needs a CUDA GPU")


def test_bench_decode_times_the_float8_cache_beside_the_bf16_one(tmp_path: Any) -> None:
    """``bench_decode.py --quick --kv-dtype e4m3`` on CPU: a lazytriton_fp8 row per case, checked, and its table."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode.py"
    out_csv = tmp_path / "decode.csv"
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(bench), "--quick", "--kv-dtype", "e4m3", "--csv", str(out_csv)],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split(",") for line in out_csv.read_text().splitlines()]
    provider = rows[0].index("provider")
    fp8 = [row for row in rows[1:] if row[provider] == "lazytriton_fp8"]
    assert len(fp8) == 3 and all(row[rows[0].index("check")] == "ok" for row in fp8)
    assert "float8 cache" in proc.stdout and "x bf16" in proc.stdout


@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(64, 64), (128, 128), (256, 256), (64, 512)])
def test_a_contiguous_float8_cache_tile_holds_the_16_bit_tiles_bytes(head_dim: int, head_dim_v: int) -> None:
    """Twice the keys a split tile in a contiguous float8 cache (as many bytes as the bf16 tile), or on CUDA the
    measured tile of its head dim at the cache's capacity (``fp8_cuda_tile``); paged caches without a measured tile
    and MLA's v of 512 keep the bf16 tiles; the combine kernel and a forced config are untouched."""
    for target, capacity in itertools.product((Target.parse("sm_90"), Target.parse("gfx942")), (4096, 32768)):
        def split(kv: str, paged: bool, target: Target = target, capacity: int = capacity) -> Variant:
            return dispatch.kernel_variant("flash_decode_split", target, "bf16", head_dim, False, True, 4, capacity,
                                           paged=paged, kv_fp8=kv, head_dim_v=head_dim_v)

        plain, fp8 = split("none", False), split("e4m3", False)
        doubled = head_dim_v <= 256
        measured = (decode_dispatch.fp8_cuda_tile(head_dim_v, capacity) if doubled and target.backend == "cuda"
                    else None)
        if measured is not None:
            assert (int(fp8.get("BLOCK_N")), int(fp8.get("num_warps")), int(fp8.get("num_stages"))) == measured
            assert fp8.get("BLOCK_M") == plain.get("BLOCK_M")
        else:
            assert int(fp8.get("BLOCK_N")) == int(plain.get("BLOCK_N")) * (2 if doubled else 1)
            assert (fp8.get("num_warps"), fp8.get("num_stages"), fp8.get("BLOCK_M")) == (
                plain.get("num_warps"), plain.get("num_stages"), plain.get("BLOCK_M"))
    sm90 = Target.parse("sm_90")

    def split(kv: str, paged: bool) -> Variant:
        return dispatch.kernel_variant("flash_decode_split", sm90, "bf16", head_dim, False, True, 4, 4096,
                                       paged=paged, kv_fp8=kv, head_dim_v=head_dim_v)

    paged_tile = decode_dispatch.fp8_cuda_tile(head_dim_v, 4096, paged=True) if head_dim_v <= 256 else None
    assert int(split("e5m2", True).get("BLOCK_N")) == (paged_tile[0] if paged_tile is not None
                                                       else int(split("none", True).get("BLOCK_N")))


# (paged, capacity, (sequence, key/value head) pairs, the tile an H100 measured fastest at head dim 128 with 8 key/value
# heads: experiments/probe_decode_fp8_tiles.py, batches 1-32, the heuristic's split counts; benchmarks/NOTES.md)
MEASURED_FP8_TILES = [
    (False, 4096, 8, (64, 4, 3)), (False, 4096, 64, (64, 4, 3)), (False, 4096, 256, (128, 4, 3)),
    (False, 16384, 8, (64, 4, 3)), (False, 16384, 32, (128, 4, 3)), (False, 16384, 256, (128, 4, 3)),
    (False, 32768, 8, (128, 4, 3)), (False, 32768, 256, (128, 4, 3)),
    (True, 4096, 8, (64, 4, 5)), (True, 4096, 16, (64, 4, 5)), (True, 4096, 64, (128, 4, 5)),
    (True, 4096, 256, (128, 4, 5)), (True, 16384, 8, (64, 4, 5)), (True, 16384, 16, (128, 4, 5)),
    (True, 32768, 8, (128, 4, 5)), (True, 32768, 256, (128, 4, 5)),
]


@pytest.mark.parametrize(("paged", "capacity", "pairs", "tile"), MEASURED_FP8_TILES)
def test_the_measured_float8_tiles_follow_the_capacity_and_the_pairs(paged: bool, capacity: int, pairs: int,
                                                                      tile: tuple[int, int, int]) -> None:
    """Head dim 128 on CUDA: each measured case's fastest tile is the one served, through the table, the variant a
    call of that many (sequence, key/value head) pairs gets, and a call of the same class; a head dim without a
    row has none."""
    assert decode_dispatch.fp8_cuda_tile(128, capacity, paged, pairs) == tile
    assert decode_dispatch.fp8_cuda_tile(64, capacity, paged, pairs) is None
    sm90 = Target.parse("sm_90")
    cls = decode_dispatch.fp8_pairs_class(pairs)
    assert cls <= pairs and decode_dispatch.fp8_cuda_tile(128, capacity, paged, cls) == tile
    for count in (pairs, cls, 2 * cls - 1 if cls else pairs):
        v = dispatch.kernel_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, capacity, paged=paged,
                                    page_size=256 if paged else 0, kv_fp8="e4m3", kv_pairs=count)
        assert (int(v.get("BLOCK_N")), int(v.get("num_warps")), int(v.get("num_stages"))) == tile, count


def test_the_pair_classes_are_the_tables_least_counts() -> None:
    """A count's class is the largest least count it reaches; prewarm plans every class; the classes are powers of
    two (the C API's plan key tells them apart by a count's bit length)."""
    leasts = sorted({row[3] for row in decode_dispatch.FP8_CUDA_TILES})
    assert decode_dispatch.PREWARM_KV_PAIRS == tuple(leasts) and leasts[0] == 0
    assert all(least & (least - 1) == 0 for least in leasts)
    for count in range(0, 600):
        assert decode_dispatch.fp8_pairs_class(count) == max(least for least in leasts if least <= count)


def test_the_memo_key_carries_the_pairs_class_of_a_float8_call_only() -> None:
    """Float8 calls of one pair class share a plan; of two classes not; a 16-bit call's key holds no count."""
    args = _valid()
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      k_descale=args["k_descale"], v_descale=args["v_descale"])
    call = checks.check(t)

    def key(batch: int, heads_k: int, kv: str = "e4m3") -> tuple[Any, ...]:
        return binding.memo_key(0, torch.bfloat16, call._replace(batch=batch, heads_k=heads_k, heads_q=heads_k * 4,
                                                                 kv_fp8=kv), True, False)

    assert binding.kv_pairs(call._replace(batch=3, heads_k=8)) == 24
    assert binding.kv_pairs(call._replace(batch=3, heads_k=8, kv_fp8="none")) == 0
    assert key(1, 8) == key(1, 1) != key(2, 8)  # classes 0 and 16
    assert key(4, 8) == key(2, 16) != key(8, 8)  # 32 and 64
    assert key(1, 8, "none") == key(64, 8, "none")


def test_a_paged_float8_cache_takes_its_measured_tiles_cut_to_the_page() -> None:
    """Head dim 128, pages on CUDA: 64 keys x 4 warps x 5 stages at batch 1 up to the 16k bucket, 128 keys from 32k
    (the block-table read takes a stage); cut to 64 keys on pages of 64 (or 192); gathered pages (16 keys) and AMD
    keep the 16-bit tiles."""
    sm90, gfx942 = Target.parse("sm_90"), Target.parse("gfx942")

    def split(target: Target, capacity: int, page: int, kv: str = "e4m3") -> tuple[int, int, int]:
        v = dispatch.kernel_variant("flash_decode_split", target, "bf16", 128, False, True, 4, capacity, paged=True,
                                    page_size=page, kv_fp8=kv)
        return int(v.get("BLOCK_N")), int(v.get("num_warps")), int(v.get("num_stages"))

    assert split(sm90, 4096, 256) == (64, 4, 5)
    assert split(sm90, 32768, 256) == split(sm90, 32768, 128) == (128, 4, 5)
    assert split(sm90, 32768, 64) == split(sm90, 32768, 192) == (64, 4, 5)
    for capacity in (4096, 32768):
        assert split(sm90, capacity, 16) == split(sm90, capacity, 16, "none")  # gathered
        assert split(gfx942, capacity, 256) == split(gfx942, capacity, 256, "none")
