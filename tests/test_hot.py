"""The warm path (kernels/flash_fwd/hot.py) against the general one: same launch, same result (GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_flash_fwd import make_qkv, on_gpu

import lazytriton
from lazytriton import runtime
from lazytriton.kernels.flash_fwd import binding, hot


def test_warm_path_declines_what_it_does_not_serve() -> None:
    q, k, v = make_qkv(1, (2, 2), (8, 8), 16, torch.float16, seed=1)
    assert hot.forward_bhsd(q, k, v, False, None) is None  # CPU tensors: the general path's interpreter
    assert hot.forward_bshd(q, k, v, True, None) is None


CASES = [  # (layout, heads, seqlens, head dim, causal, scale, dtype)
    ("bhsd", (4, 2), (300, 257), 64, "bottom_right", None, torch.bfloat16),
    ("bhsd", (3, 1), (1, 1000), 128, True, 0.3, torch.float16),
    ("bhsd", (2, 2), (129, 129), 40, False, None, torch.float32),
    ("bshd", (8, 2), (77, 513), 128, "bottom_right", None, torch.bfloat16),
    ("bshd", (2, 2), (64, 64), 256, False, 0.05, torch.float16),
]


@on_gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_warm_path_launches_exactly_what_the_general_path_launches(case: tuple[Any, ...],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    layout, heads, seqlens, d, causal, scale, dtype = case
    runtime.reset()
    q, k, v = make_qkv(2, heads, seqlens, d, dtype, device="cuda", seed=sum(seqlens))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    view = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    call = binding.check(view(q), view(k), view(v), causal, scale)
    general = binding.forward(view(q), view(k), view(v), call)  # fills the memo
    launches: list[tuple[Any, ...]] = []
    kernel, _ = next(iter(runtime.get().plans.values()))
    original = type(kernel).launch

    def spy(self: Any, grid: Any, stream: Any, ints: Any, floats: Any, scratch: Any = None) -> None:
        launches.append((grid, tuple(ints), tuple(floats)))
        original(self, grid, stream, ints, floats, scratch)

    monkeypatch.setattr(type(kernel), "launch", spy)
    warm = (hot.forward_bshd if layout == "bshd" else hot.forward_bhsd)(q, k, v, causal, scale)
    assert warm is not None, "a memoised bucket must be served by the warm path"
    out, lse = warm
    expected_out = binding.empty_outputs(view(q), call.shape)[0]
    ints, _, _ = binding.pack(view(q), view(k), view(v), view(out), lse, call)
    assert launches[0][1] == ints and launches[0][2] == binding.floats(call)
    assert out.shape == q.shape and out.stride() == (expected_out.transpose(1, 2).stride() if layout == "bshd" else
                                                     expected_out.stride())
    torch.cuda.synchronize()
    assert torch.equal(view(out), general[0]) and torch.equal(lse, general[1])


@on_gpu
def test_gpu_public_functions_take_the_warm_path_once_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = make_qkv(1, (4, 2), (100, 100), 64, torch.float16, device="cuda", seed=3)
    lazytriton.attn_fwd(q, k, v)
    lazytriton.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    lazytriton.flash_attn_func(qb, kb, vb)

    def general(*args: Any) -> None:
        raise AssertionError("the general path ran for a warm call")

    monkeypatch.setattr(binding, "check", general)
    lazytriton.attn_fwd(q, k, v)
    lazytriton.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    lazytriton.flash_attn_func(qb, kb, vb)
