"""What the peers' test suites pass that lazytriton's API took in for them: window_size as FlashAttention's callers
pass it (a list, an integer tensor of two), and FlashAttention-3's FP8 decoding call (a float8 q over a float8 cache).

CPU, Triton's interpreter, tiny shapes: each form gives the tuple form's result bit for bit, and the results follow
FlashAttention's rule against a float64 reference. Bad forms raise TypeError naming the argument before anything
is launched (``no_launch``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flash_rule import check_rule, references, seed_of
from test_flash_fwd import OUT_FLOOR

import lazytriton
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.kernels.flash_fwd.reference import attention_reference
from lazytriton.window import window_pair

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize(("given", "want"), [
    ((3, 0), (3, 0)), ([3, 0], [3, 0]), (torch.tensor([5, -1]), (5, -1)),
    (torch.tensor([2, 7], dtype=torch.int32), (2, 7)), ([torch.tensor(4), 1], (4, 1)),
    ((torch.tensor(4, dtype=torch.int16), torch.tensor(-1)), (4, -1)), ("x", "x"), (None, None)])
def test_window_pair_reads_the_tensor_forms_and_passes_the_rest(given: Any, want: Any) -> None:
    got = window_pair(given)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 2.0]), torch.tensor([1, 2, 3]), torch.tensor([[1, 2]]),
                                 torch.tensor(3), [torch.tensor([1, 2]), 0], (torch.tensor(1.5), 0),
                                 torch.tensor([True, False])])
def test_window_pair_refuses_other_tensors_by_name(bad: Any) -> None:
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        window_pair(bad)


def _qkv(seed: int, b: int = 2, sq: int = 9, sk: int = 13, hq: int = 4, hk: int = 2, d: int = 32,
         dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=gen).to(dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["list", "tensor", "int32-tensor", "tensor-items"])
def test_flash_attn_func_takes_a_window_of_any_form(form: str, causal: bool) -> None:
    q, k, v = _qkv(seed_of("window", form, causal))
    window = (4, 2)
    given: Any = {"list": list(window), "tensor": torch.tensor(window),
                  "int32-tensor": torch.tensor(window, dtype=torch.int32),
                  "tensor-items": (torch.tensor(window[0]), torch.tensor(window[1]))}[form]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lazytriton.flash_attn_func(*leaves, causal=causal, window_size=given)
    want = lazytriton.flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert torch.equal(out, want)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    exact, same = references(lambda *t: tuple(x.transpose(1, 2) if x.dim() == 4 else x for x in attention_reference(
        *(x.transpose(1, 2) for x in t), causal="bottom_right" if causal else False, window_size=window)),
        (q, k, v), do)
    check_rule("out", out, exact.out, same.out, OUT_FLOOR[q.dtype])
    for name, g, e, s in zip("qkv", grads, exact.grads, same.grads, strict=True):
        check_rule(f"d{name}", g, e, s, 2e-3, factor=3)


def test_varlen_and_kvcache_take_a_tensor_window() -> None:
    q, k, v = (t[0] for t in _qkv(seed_of("varlen-window"), b=1, sq=12, sk=12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    want = lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, window_size=(3, 0))
    assert torch.equal(lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True,
                                                         window_size=torch.tensor([3, 0])), want)
    qd, kc, vc = _qkv(seed_of("kvcache-window"), sq=1, sk=16)
    lens = torch.tensor([9, 16], dtype=torch.int32)
    want = lazytriton.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, window_size=(5, 0))
    assert torch.equal(lazytriton.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                                          window_size=torch.tensor([5, 0])), want)


def test_a_bad_window_tensor_is_refused_before_any_launch(no_launch: None) -> None:
    q, k, v = _qkv(1)
    for call in (lambda w: lazytriton.flash_attn_func(q, k, v, window_size=w),
                 lambda w: lazytriton.attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               window_size=w),
                 lambda w: lazytriton.flash_attn_with_kvcache(q, k, v, cache_seqlens=3, window_size=w)):
        with pytest.raises(TypeError, match="window_size"):
            call(torch.tensor([1.0, 0.0]))
        with pytest.raises(TypeError, match="window_size"):
            call([1.5, 0])  # the checks' own refusal, unchanged


def _fp8_call(fmt: torch.dtype, new: bool, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def cast(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).clamp(-8, 8).to(fmt)

    args: dict[str, Any] = {"q": cast(2, 3, 4, 32), "k_cache": cast(2, 24, 2, 32), "v_cache": cast(2, 24, 2, 32),
                            "cache_seqlens": torch.tensor([7, 19], dtype=torch.int32)}
    if new:
        args.update(k=cast(2, 3, 2, 32), v=cast(2, 3, 2, 32))
    return args


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("new", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_a_float8_q_over_a_float8_cache_is_the_bfloat16_call(fmt: torch.dtype, new: bool, causal: bool) -> None:
    args = _fp8_call(fmt, new, seed_of("fp8-q", fmt, new, causal))
    caches = (args["k_cache"].clone(), args["v_cache"].clone())
    out, lse = lazytriton.flash_attn_with_kvcache(**args, causal=causal, window_size=torch.tensor([6, 0]),
                                                  return_softmax_lse=True)
    assert out.dtype == torch.bfloat16
    widened = {name: t.to(torch.bfloat16) if name in ("q", "k", "v") else t for name, t in args.items()}
    widened.update(k_cache=caches[0].clone(), v_cache=caches[1].clone())
    want, want_lse = lazytriton.flash_attn_with_kvcache(**widened, causal=causal, window_size=(6, 0),
                                                        return_softmax_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(args["k_cache"].view(torch.uint8), widened["k_cache"].view(torch.uint8))  # the same append
    ref = {name: t.double() if name in ("q", "k", "v") else t for name, t in args.items()}
    ref.update(k_cache=caches[0], v_cache=caches[1])
    exact = kvcache_reference(**ref, causal=causal, window_size=(6, 0))
    same = kvcache_reference(**{**widened, "k_cache": caches[0], "v_cache": caches[1]}, causal=causal,
                             window_size=(6, 0))
    check_rule("out", out, exact[0], same[0], OUT_FLOOR[torch.bfloat16])
    if new:  # the new keys land in the float8 cache as they were given (exact widening, no descale)
        for cache, added in ((args["k_cache"], args["k"]), (args["v_cache"], args["v"])):
            for b, start in enumerate((7, 19)):
                assert torch.equal(cache[b, start:start + 3].view(torch.uint8), added[b].view(torch.uint8))


def test_a_float8_q_needs_a_cache_of_its_dtype(no_launch: None) -> None:
    args = _fp8_call(torch.float8_e4m3fn, False, 3)
    for cache in (args["k_cache"].to(torch.bfloat16), args["k_cache"].to(torch.float32).to(torch.float8_e5m2)):
        with pytest.raises(TypeError, match="k_cache must be torch.float8_e4m3fn"):
            lazytriton.flash_attn_with_kvcache(**{**args, "k_cache": cache})
    with pytest.raises(TypeError, match="k_cache"):
        lazytriton.flash_attn_with_kvcache(args["q"], None, args["v_cache"])
    new = _fp8_call(torch.float8_e4m3fn, True, 4)
    for name in ("k", "v"):
        with pytest.raises(TypeError, match=f"{name} must be torch.float8_e4m3fn"):
            lazytriton.flash_attn_with_kvcache(**{**new, name: new[name].to(torch.bfloat16)})
    rotary = torch.rand(32, 16).to(torch.bfloat16)
    with pytest.raises(TypeError, match="rotary_cos must be torch.float8_e4m3fn"):
        lazytriton.flash_attn_with_kvcache(**new, rotary_cos=rotary, rotary_sin=rotary)
