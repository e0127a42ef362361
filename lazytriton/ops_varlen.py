"""Torch ops of the varlen call (packed sequences), with their fake twins and autograd.

``lazytriton::flash_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left=-1,
window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, philox=None,
seqused_q=None, seqused_k=None, sinks=None, attention_chunk=0) -> (out, lse)`` takes FlashAttention-2's packed
(total_tokens, heads, head_dim) tensors and int32 cumulative lengths;
``causal`` is a bool, aligned bottom-right within each sequence. ``out`` has
q's shape; ``lse`` is float32 (heads_q, total_q), FlashAttention-2's varlen
layout. The fakes allocate through the binding's own ``empty_outputs`` and
``empty_grads``, so their shapes, dtypes and strides are the real ones.
``alibi_slopes`` and ``philox`` (dropout's int64 [seed, offset], drawn by the
caller) are the dense op's (``lazytriton.ops``); ``seqused_q``/``seqused_k``
are FlashAttention-3's used lengths (``kernels/flash_fwd/varlen.py``); none
of them gets a gradient. ``sinks`` (attention sinks, float32 (heads_q,)) do:
a call with them differentiates through ``lazytriton::flash_varlen_bwd_sinks``
(their tensor after ``lse``; (dq, dk, dv, dsinks)). ``attention_chunk`` is FlashAttention-3's
chunked local attention (0: off), the last argument of every varlen op.

``lazytriton::flash_varlen_bwd(do, q, k, v, out, lse, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, ...) ->
(dq, dk, dv)`` is its autograd formula (``register_autograd``), as
``lazytriton.ops`` does for the dense op; ``lse`` is non-differentiable.

Both check their arguments again (they can be called directly), the values
of the cumulative lengths and seqused included, through one device-to-host read, unless
a CUDA graph is being captured or torch.compile traces
(``kernels/flash_fwd/varlen.py``). The cumulative lengths and the slopes are
first made plain contiguous tensors (``kernels/arguments.py``): a subclass
such as ``nn.Parameter`` is checked like the tensor it holds.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_fwd import varlen

_ARGS = ("Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
         "bool causal, int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
         "float dropout_p=0.0, Tensor? philox=None, Tensor? seqused_q=None, Tensor? seqused_k=None")
_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {_ARGS}, Tensor? sinks=None, int attention_chunk=0) "
               "-> (Tensor, Tensor)")
_BWD_SCHEMA = (f"(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_ARGS}, int attention_chunk=0) "
               "-> (Tensor, Tensor, Tensor)")
_BWD_SINKS_SCHEMA = (f"(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor sinks, {_ARGS}, "
                     "int attention_chunk=0) -> (Tensor, Tensor, Tensor, Tensor)")
# The forward op's sinks among its inputs (their gradient's position in the autograd formula's answer).
_SINKS_INPUT = 17


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _indices(*tensors: Any) -> tuple[Any, ...]:
    """The index tensors plain and contiguous (``arguments.index_tensor``): the values checked are those read."""
    return tuple(index_tensor(t) for t in tensors)


@torch.library.custom_op("lazytriton::flash_varlen_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                     causal: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                     alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0.0,
                     philox: torch.Tensor | None = None, seqused_q: torch.Tensor | None = None,
                     seqused_k: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2's varlen forward through the kernel cache: ``(out, lse)``."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cu_seqlens_q, cu_seqlens_k, alibi_slopes, seqused_q, seqused_k = _indices(cu_seqlens_q, cu_seqlens_k,
                                                                              alibi_slopes, seqused_q, seqused_k)
    call = varlen.check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                        (window_left, window_right), float(softcap), alibi=alibi_slopes, dropout_p=float(dropout_p),
                        philox=philox, seqused_q=seqused_q, seqused_k=seqused_k, sinks=sinks,
                        attention_chunk=attention_chunk)
    return varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, call)


@flash_varlen_fwd.register_fake
def _flash_varlen_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return varlen.empty_outputs(q, 0 if v.shape[-1] == q.shape[-1] else v.shape[-1])


@torch.library.custom_op("lazytriton::flash_varlen_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def flash_varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int = -1,
                     window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                     dropout_p: float = 0.0, philox: torch.Tensor | None = None,
                     seqused_q: torch.Tensor | None = None,
                     seqused_k: torch.Tensor | None = None,
                     attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2's varlen backward through the kernel cache: ``(dq, dk, dv)`` for the gradient ``do``."""
    return tuple(_run_backward(do, q, k, v, out, lse, None, cu_seqlens_q, cu_seqlens_k,  # type: ignore[return-value]
                               max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                               alibi_slopes, dropout_p, philox, seqused_q, seqused_k, attention_chunk)[0])


def _run_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, sinks: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, *rest: Any) -> tuple[Any, torch.Tensor | None]:
    """Both backward ops' body: the call checked again, then ``(grads, dsinks)`` (dsinks None without sinks).

    ``rest``: max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
    alibi_slopes, dropout_p, philox, seqused_q, seqused_k, attention_chunk, as the schemas order them.
    """
    max_q, max_k, scale, causal, left, right, softcap, alibi, dropout_p, philox, used_q, used_k, chunk = rest
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out, do = _last_dim_contiguous(out), _last_dim_contiguous(do)
    cu_q, cu_k, alibi, used_q, used_k = _indices(cu_seqlens_q, cu_seqlens_k, alibi, used_q, used_k)
    call = varlen.check(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, (left, right), float(softcap), alibi=alibi,
                        dropout_p=float(dropout_p), philox=philox, seqused_q=used_q, seqused_k=used_k, sinks=sinks,
                        attention_chunk=chunk)
    varlen.check_grad(q, out, lse, do, call.call.head_dim_v)
    if sinks is None:
        return varlen.backward(q, k, v, out, lse, do, cu_q, cu_k, call), None
    return varlen.sinks_backward(q, k, v, out, lse, do, cu_q, cu_k, call)


@flash_varlen_bwd.register_fake
def _flash_varlen_bwd_fake(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.empty_like(t) for t in (q, k, v))  # type: ignore[return-value]


@torch.library.custom_op("lazytriton::flash_varlen_bwd_sinks", mutates_args=(), schema=_BWD_SINKS_SCHEMA)
def flash_varlen_bwd_sinks(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, sinks: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                           causal: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0.0,
                           philox: torch.Tensor | None = None, seqused_q: torch.Tensor | None = None,
                           seqused_k: torch.Tensor | None = None, attention_chunk: int = 0,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen backward of a call with attention sinks: ``(dq, dk, dv, dsinks)``."""
    grads, dsinks = _run_backward(do, q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                                  dropout_p, philox, seqused_q, seqused_k, attention_chunk)
    return (*grads, dsinks)


@flash_varlen_bwd_sinks.register_fake
def _flash_varlen_bwd_sinks_fake(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *args: Any,
                                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.empty_like(t) for t in (q, k, v, sinks))  # type: ignore[return-value]


# The arguments after (cu_seqlens_q, cu_seqlens_k), with their defaults: the inputs may stop early.
_REST_DEFAULTS: tuple[Any, ...] = (None, None, None, None, -1, -1, 0.0, None, 0.0, None, None, None, None, 0)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, cu_q, cu_k, *given = inputs
    *scalars, alibi, dropout_p, philox, used_q, used_k, sinks, chunk = (*given, *_REST_DEFAULTS[len(given):])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi, philox, used_q, used_k, sinks)
    ctx.rest = (*scalars, dropout_p)  # max_seqlen_q, max_seqlen_k, scale, causal, window, softcap, dropout_p
    ctx.chunk = chunk
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, cu_q, cu_k, alibi, philox, used_q, used_k, sinks = ctx.saved_tensors
    n_rest = len(ctx.needs_input_grad) - 3  # the cumulative lengths, the scalars and the mods: no gradient
    if grad_out is None:  # only lse was used, and it carries no gradient
        return (None,) * (3 + n_rest)
    *scalars, dropout_p = ctx.rest
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    if sinks is None:
        dq, dk, dv = flash_varlen_bwd_op(grad_out, q, k, v, out, lse, cu_q, cu_k, *scalars, alibi, dropout_p, philox,
                                         used_q, used_k, ctx.chunk)
        return (dq if need_q else None, dk if need_k else None, dv if need_v else None, *(None,) * n_rest)
    # Given sinks, every input up to them was given.
    dq, dk, dv, dsinks = flash_varlen_bwd_sinks_op(grad_out, q, k, v, out, lse, sinks, cu_q, cu_k, *scalars, alibi,
                                                   dropout_p, philox, used_q, used_k, ctx.chunk)
    rest: list[Any] = [None] * n_rest
    if ctx.needs_input_grad[_SINKS_INPUT]:
        rest[_SINKS_INPUT - 3] = dsinks
    return (dq if need_q else None, dk if need_k else None, dv if need_v else None, *rest)


flash_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)

flash_varlen_fwd_op = torch.ops.lazytriton.flash_varlen_fwd.default
flash_varlen_bwd_op = torch.ops.lazytriton.flash_varlen_bwd.default
flash_varlen_bwd_sinks_op = torch.ops.lazytriton.flash_varlen_bwd_sinks.default
