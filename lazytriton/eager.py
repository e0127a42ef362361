"""Differentiable eager calls without the torch op: flash_fwd's forward and backward as an autograd Function.

``lazytriton.ops`` registers the forward as a torch op with its autograd
formula, which tracing (``torch.compile``, ``torch.export``, dispatch modes)
needs. An eager call that needs gradients does not: this Function runs the
same binding calls the op's forward and backward run (``binding.forward``,
then ``flash_bwd``'s ``check_grad`` and ``backward``, with the forward's
``deterministic``), and saves the same tensors. It skips the op's dispatch,
whose first call in a process imports ``torch._dynamo`` (a torch op's kernel
is wrapped in ``torch._disable_dynamo``: 1.35 s of thread CPU on the 2-core
development machine), and the op's registration (``import lazytriton.ops``):
a training process served from an image starts without either.

The callers (``lazytriton.interface``) take it only for plain tensors with
nothing tracing, as they take ``binding.forward`` for calls without
gradients. As in the op, ``lse`` carries no gradient (``mark_non_differentiable``).
The call's bias is an input of its own, so that one which requires grad gets
its gradient (the backward's ``dbias``, as the op's ``bias_grad``); so are
its attention sinks (``call.sinks``), whose gradient the backward gives too
(``flash_bwd``'s ``sinks_backward``).
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.flash_bwd import binding as flash_bwd_binding
from lazytriton.kernels.flash_fwd import binding as flash_fwd_binding


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy with a contiguous last dim if it has none (a gradient may come expanded: stride 0)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


class FlashAttention(torch.autograd.Function):
    """``(out, lse)`` of a checked call, differentiable in q, k, v, its bias (``call.bias``) and its sinks."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                call: flash_fwd_binding.Call, deterministic: bool,
                sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return flash_fwd_binding.forward(q, k, v, call._replace(sinks=sinks))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        q, k, v, _, call, deterministic, sinks = inputs
        out, lse = output
        # The score modifications' tensors go through save_for_backward too (saved-tensor hooks see them).
        ctx.save_for_backward(q, k, v, out, lse, call.alibi, call.bias, call.philox, sinks)
        ctx.call = call._replace(alibi=None, bias=None, philox=None, sinks=None)
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple[Any, ...]:
        if grad_out is None:  # only lse was used, and it carries no gradient
            return None, None, None, None, None, None, None
        q, k, v, out, lse, alibi, bias, philox, sinks = ctx.saved_tensors
        call = ctx.call._replace(alibi=alibi, bias=bias, philox=philox, sinks=sinks)
        do = last_dim_contiguous(grad_out)
        flash_bwd_binding.check_grad(q, out, lse, do, call)
        need_q, need_k, need_v, need_bias = ctx.needs_input_grad[:4]
        dbias = flash_bwd_binding.empty_bias_grad(q, call) if need_bias else None
        dsinks = None
        if sinks is None:
            dq, dk, dv = flash_bwd_binding.backward(q, k, v, out, lse, do, call, deterministic=ctx.deterministic,
                                                    dbias=dbias)
        else:
            (dq, dk, dv), dsinks = flash_bwd_binding.sinks_backward(q, k, v, out, lse, do, call, ctx.deterministic,
                                                                    dbias)
        return (dq if need_q else None, dk if need_k else None, dv if need_v else None, dbias, None, None,
                dsinks if ctx.needs_input_grad[6] else None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: flash_fwd_binding.Call,
              deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a checked eager call whose inputs require grad; ``deterministic`` is for its backward.

    The call's bias and sinks are inputs of their own, so a gradient reaches them.
    """
    return FlashAttention.apply(q, k, v, call.bias, call._replace(sinks=None),  # type: ignore[no-any-return]
                                deterministic, call.sinks)
