"""Attention sinks (gpt-oss's; FlashAttention-3 forks' ``s_aux``): the argument's checks and its gradient.

A sink is one learned float32 logit a query head. It joins every softmax
row's denominator beside the scaled (capped, biased) scores and contributes no
value: out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)), and the
lse the kernels return includes it (a row that sees no key: out 0, lse =
sink). The forward kernels take it in their epilogue (``SINKS``); the
backward kernels need nothing new, since dq, dk and dv are the usual formulas
of the lse that includes the sink, and the sink's own gradient is

    d(sinks)_h = -sum over batch and rows i of head h of exp(sink_h - lse_i) * Delta_i

with Delta_i = rowsum(dO_i * O_i), which the backward's first kernel writes
anyway (``grad``): no pass over K or V.

The public functions take the keyword ``sinks``, and ``s_aux`` as its other
name (the keyword of vLLM's FlashAttention-3 fork and transformers' gpt-oss
attention interface); ``given`` resolves the two. Only float32 is taken:
FlashAttention-3's fork wants bf16 ``s_aux``, which a caller converts with
``.float()`` (differentiable: the gradient flows back to the bf16 parameter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lazytriton.kernels.flash_fwd.names import NAMES, Names

if TYPE_CHECKING:
    from lazytriton.kernels.flash_fwd.binding import Call


def given(sinks: Any, s_aux: Any) -> Any:
    """The sinks of a call that may name them ``sinks`` or ``s_aux`` (one of them, or None); both: a TypeError."""
    if s_aux is None:
        return sinks
    if sinks is not None:
        raise TypeError("sinks and s_aux are two names of one argument (attention sinks): pass one of them")
    return s_aux


def checked(sinks: Any, q: torch.Tensor, heads_q: int, names: Names = NAMES) -> torch.Tensor | None:
    """``sinks`` checked (None, or float32 of shape (heads_q,) on q's device), contiguous; else a TypeError/ValueError.

    A non-contiguous tensor (a strided view) is copied. An ``nn.Parameter`` is
    taken as it is (its gradient comes through autograd).
    """
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{names.sinks} must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype != torch.float32:
        raise TypeError(f"{names.sinks} must be float32 (one logit a query head; convert with .float()), got "
                        f"{sinks.dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"{names.sinks} must have shape ({heads_q},) (one logit a query head of {names.q}), got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{names.sinks} is on {sinks.device} but {names.q} is on {q.device}")
    return sinks if sinks.stride(0) == 1 or heads_q <= 1 else sinks.contiguous()


def with_sinks(call: Call, q: torch.Tensor, sinks: Any, names: Names = NAMES) -> Call:
    """``call`` with its sinks checked (``checked``) in its ``sinks`` field."""
    if sinks is None:
        return call
    return call._replace(sinks=checked(sinks, q, call.shape.heads_q, names))


def argument(call: Call, q: torch.Tensor) -> torch.Tensor:
    """The Sinks argument for Triton's launchers (interpreter, JIT): the call's, or an empty stand-in never read."""
    return torch.empty(0, dtype=torch.float32, device=q.device) if call.sinks is None else call.sinks


def grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, head_axis: int) -> torch.Tensor:
    """d(sinks): -sum of exp(sink_h - lse) * delta over every axis of lse but ``head_axis`` (float32, (heads,)).

    ``lse`` and ``delta`` (rowsum(dO * O)) share a shape: the dense (batch,
    heads, seqlen_q), or the varlen (heads, total_q) with ``head_axis`` 0. A
    row with neither a key nor a sink (lse -inf, a sink of -inf) adds 0.
    """
    shape = [1] * lse.dim()
    shape[head_axis] = sinks.numel()
    share = torch.exp((sinks.view(shape) - lse).nan_to_num(nan=float("-inf")))
    axes = tuple(i for i in range(lse.dim()) if i != head_axis)
    return -(share * delta).sum(axes)


def lse_of_no_key(call: Call, lse: torch.Tensor, head_axis: int) -> torch.Tensor:
    """``lse`` filled as every row's that sees no key: the head's sink (-inf without sinks)."""
    if call.sinks is None:
        return lse.fill_(float("-inf"))
    shape = [1] * lse.dim()
    shape[head_axis] = call.sinks.numel()
    return lse.copy_(call.sinks.view(shape).expand_as(lse))
