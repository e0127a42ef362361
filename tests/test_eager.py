"""lazytriton.eager: the eager autograd Function against the torch op's forward and backward (CPU, interpreter).

Both run the same binding calls, so on the interpreter their outputs and
gradients are bitwise equal; the Function must also leave ``torch._dynamo``
and ``lazytriton.ops`` unimported (the op's dispatch imports the first, which
is what the Function is for).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from lazytriton import eager, interface
from lazytriton.kernels.flash_fwd import binding, score_mods

CASES = [  # (batch, heads_q, heads_k, seqlen_q, seqlen_k, head dim, causal, dtype)
    (2, 4, 2, 40, 24, 32, "bottom_right", torch.float16),
    (1, 2, 2, 33, 33, 16, False, torch.float32),
]


def _inputs(case: tuple[Any, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    b, hq, hk, sq, sk, d, _, dtype = case
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(dtype).requires_grad_()
                 for shape in ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, d)))


def _step(run: Any, case: tuple[Any, ...], grad: torch.Tensor | None = None) -> list[torch.Tensor]:
    q, k, v = _inputs(case)
    out, lse = run(q, k, v)
    (out * grad).sum().backward() if grad is not None else out.sum().backward()
    return [out, lse, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_function_gives_the_ops_outputs_and_gradients(case: tuple[Any, ...]) -> None:
    causal = case[6]
    grad = torch.randn(case[0], case[1], case[3], case[5], generator=torch.Generator().manual_seed(1)).to(case[7])

    def through_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return eager.attention(q, k, v, binding.check(q, k, v, causal))

    def through_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with interface.always_through_op():
            return interface.attn_fwd(q, k, v, causal=causal)

    got, expected = _step(through_eager, case, grad), _step(through_op, case, grad)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        assert torch.equal(a, b), name
    assert got[0].grad_fn is not None and not got[1].requires_grad  # lse: no gradient, as from the op


def test_score_modifications_reach_the_backward() -> None:
    # ALiBi slopes and a bias go through save_for_backward and back into the call of the backward.
    case = (1, 2, 1, 24, 24, 16, True, torch.float32)
    q, k, v = _inputs(case)
    slopes = torch.tensor([0.5, 0.25])
    bias = torch.randn(1, 1, 24, 24).expand(1, 2, 24, 24)

    def run(use_eager: bool) -> list[torch.Tensor]:
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        call = score_mods.with_mods(binding.check(qq, kk, vv, True), qq, slopes, bias, 0.0, None)
        if use_eager:
            out, _ = eager.attention(qq, kk, vv, call)
        else:
            from lazytriton.ops import flash_fwd_op

            out, _ = flash_fwd_op(qq, kk, vv, call.scale, call.causal, -1, -1, 0.0, call.alibi, call.bias)
        out.square().sum().backward()
        return [out, qq.grad, kk.grad, vv.grad]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


def test_an_expanded_gradient_is_made_contiguous_first() -> None:
    case = CASES[1]
    q, k, v = _inputs(case)
    out, _ = eager.attention(q, k, v, binding.check(q, k, v, False))
    out.sum().backward()  # the gradient of out: ones expanded, every stride 0
    expected = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = _inputs(case)
    out2, _ = eager.attention(q2, k2, v2, binding.check(q2, k2, v2, False))
    out2.backward(torch.ones_like(out2))
    assert all(torch.equal(a, t.grad) for a, t in zip(expected, (q2, k2, v2), strict=True))


def test_gradients_only_for_the_inputs_that_want_them() -> None:
    case = CASES[1]
    q, k, v = _inputs(case)
    k.requires_grad_(False)
    out, _ = eager.attention(q, k, v, binding.check(q, k, v, False))
    out.sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is not None


def test_a_training_step_imports_neither_dynamo_nor_the_op() -> None:
    code = """
import sys, torch
from lazytriton import eager
from lazytriton.kernels.flash_fwd import binding
q, k, v = (torch.randn(1, 2, 16, 16, requires_grad=True) for _ in range(3))
out, lse = eager.attention(q, k, v, binding.check(q, k, v, True))
out.sum().backward()
assert q.grad is not None
loaded = [name for name in ("torch._dynamo", "lazytriton.ops") if name in sys.modules]
assert not loaded, loaded
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
