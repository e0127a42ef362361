"""Torch ops: each kernel entry as a ``torch.library`` custom op with its fake twin.

``lazytriton::flash_fwd(q, k, v, softmax_scale, causal, window_left=-1,
window_right=-1, softcap=0.0, alibi_slopes=None, attn_bias=None,
dropout_p=0.0, philox=None, deterministic=False, sinks=None, attention_chunk=0) -> (out, lse)`` takes tensors
in the kernel's
(batch, heads, seqlen, head_dim) order, any strides with a contiguous last
dim (the public functions pass views, never copies), ``causal`` as one of
"none", "top_left", "bottom_right", FlashAttention-2's sliding window (-1:
unbounded) and softcap (0.0: off), ALiBi slopes (float32, (heads_q,) or
(batch, heads_q)), an additive bias (q's dtype, a (batch, heads_q, seqlen_q,
seqlen_k) view, broadcast dims with stride 0; differentiable) and dropout with
its Philox [seed, offset] int64 tensor, drawn by the caller (so the op is a
pure function of its inputs: a recomputation, as activation checkpointing
does, drops the same elements); ``deterministic`` is read by its backward only
(bitwise reproducible gradients: no fused backward); ``sinks`` are attention
sinks (float32, (heads_q,): one logit a query head in every row's denominator); ``attention_chunk`` is
FlashAttention-3's chunked local attention (0: off). Its fake (meta)
implementation gives the exact shapes, dtypes and strides of the real one
(both allocate through ``binding.empty_outputs``), so ``torch.compile``,
``torch.export`` and FakeTensor tracing see through it without running it.

The public functions (``lazytriton.interface``) check their arguments, then
call the op, or, when nothing is tracing, the binding directly: the op's
dispatch is measured in benchmarks/NOTES.md.

``lazytriton::flash_bwd(do, q, k, v, out, lse, softmax_scale, causal,
window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
attn_bias=None, dropout_p=0.0, philox=None, deterministic=False,
bias_grad=False, attention_chunk=0) -> (dq, dk, dv, dbias)`` is the backward
(``kernels/flash_bwd``), registered as the forward op's autograd formula: the
forward saves q, k, v, out and lse (and the slopes, bias and Philox tensor, so
the backward regenerates the forward's dropout mask, and its
``deterministic``), and the backward runs its kernels once for all the
gradients. With ``bias_grad`` (the forward's ``attn_bias`` requires grad),
``dbias`` is the bias's gradient, (batch, heads_q, seqlen_q, seqlen_k) of q's
dtype (``flash_bwd.binding.empty_bias_grad``: last dim padded to 16), which
autograd sums over the dims the caller's mask broadcasts along; without it,
an empty tensor. The
logsumexp output is marked non-differentiable: it comes back as a constant
(``requires_grad`` False), so a loss through it alone raises torch's "does
not require grad" error, and in a loss that also uses ``out`` its share is not
differentiated. A call with sinks differentiates through
``lazytriton::flash_bwd_sinks`` instead, which takes them after ``lse`` and
returns their gradient last: (dq, dk, dv, dbias, dsinks), from the delta its
first kernel writes (no pass over K or V of its own).
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.flash_bwd import binding as flash_bwd_binding
from lazytriton.kernels.flash_fwd import binding as flash_fwd_binding
from lazytriton.kernels.flash_fwd import score_mods
from lazytriton.kernels.flash_fwd import sinks as fwd_sinks

_FEATURES = ("int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
             "Tensor? attn_bias=None, float dropout_p=0.0, Tensor? philox=None")
_FLASH_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, float softmax_scale, str causal, {_FEATURES}, "
                     "bool deterministic=False, Tensor? sinks=None, int attention_chunk=0) -> (Tensor, Tensor)")
_FLASH_BWD_SCHEMA = ("(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, "
                     f"str causal, {_FEATURES}, bool deterministic=False, bool bias_grad=False, "
                     "int attention_chunk=0) -> (Tensor, Tensor, Tensor, Tensor)")
_FLASH_BWD_SINKS_SCHEMA = ("(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor sinks, "
                           f"float softmax_scale, str causal, {_FEATURES}, bool deterministic=False, "
                           "bool bias_grad=False, int attention_chunk=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
# attn_bias's and sinks' positions among the forward op's inputs (their gradients', in the autograd formula's answer).
_BIAS_INPUT = 9
_SINKS_INPUT = 13


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@torch.library.custom_op("lazytriton::flash_fwd", mutates_args=(), schema=_FLASH_FWD_SCHEMA)
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: str,
              window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
              alibi_slopes: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
              dropout_p: float = 0.0, philox: torch.Tensor | None = None,
              deterministic: bool = False, sinks: torch.Tensor | None = None,
              attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward through the kernel cache: ``(out, lse)``; ``deterministic`` is for its backward."""
    # Checked again here: the op can be called directly (torch.ops.lazytriton.flash_fwd),
    # and a compiler may hand it inputs laid out otherwise than the eager trace had them.
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    call = _checked(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, attn_bias,
                    dropout_p, philox, sinks, attention_chunk)
    return flash_fwd_binding.forward(q, k, v, call)


def _checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: str,
             window_left: int, window_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
             attn_bias: torch.Tensor | None, dropout_p: float, philox: torch.Tensor | None,
             sinks: torch.Tensor | None = None, attention_chunk: int = 0) -> Any:
    call = flash_fwd_binding.check(q, k, v, causal, softmax_scale, window=(window_left, window_right),
                                   softcap=float(softcap))
    call = flash_fwd_binding.with_chunk(fwd_sinks.with_sinks(call, q, sinks), attention_chunk)
    if alibi_slopes is None and attn_bias is None and dropout_p == 0.0:
        return call
    return score_mods.with_mods(call, q, alibi_slopes, attn_bias, float(dropout_p), philox)


@flash_fwd.register_fake
def _flash_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: str,
                    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
                    dropout_p: float = 0.0, philox: torch.Tensor | None = None,
                    deterministic: bool = False, sinks: torch.Tensor | None = None,
                    attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, sq, d = q.shape
    dv = v.shape[-1]
    return flash_fwd_binding.empty_outputs(q, flash_fwd_binding.Shape(b, hq, k.shape[1], sq, k.shape[2], d),
                                           0 if dv == d else dv)


@torch.library.custom_op("lazytriton::flash_bwd", mutates_args=(), schema=_FLASH_BWD_SCHEMA)
def flash_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, softmax_scale: float, causal: str, window_left: int = -1, window_right: int = -1,
              softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
              dropout_p: float = 0.0, philox: torch.Tensor | None = None, deterministic: bool = False,
              bias_grad: bool = False, attention_chunk: int = 0,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention backward through the kernel cache: ``(dq, dk, dv, dbias)`` for the gradient ``do`` of ``out``.

    ``deterministic``: bitwise reproducible gradients (``binding.backward``'s);
    ``bias_grad``: ``dbias`` is ``attn_bias``'s gradient (else empty).
    """
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out, do = _last_dim_contiguous(out), _last_dim_contiguous(do)
    call = _checked(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, attn_bias,
                    dropout_p, philox, None, attention_chunk)
    flash_bwd_binding.check_grad(q, out, lse, do, call)
    dbias = _bias_grad(q, call, bias_grad)
    dq, dk, dv = flash_bwd_binding.backward(q, k, v, out, lse, do, call, deterministic=deterministic,
                                            dbias=dbias if bias_grad else None)
    return dq, dk, dv, dbias


def _bias_grad(q: torch.Tensor, call: Any, bias_grad: bool) -> torch.Tensor:
    """The op's ``dbias`` output before the kernels write it: ``empty_bias_grad``'s, or an empty tensor."""
    if not bias_grad:
        return q.new_empty(0)
    if call.bias is None:
        raise ValueError("bias_grad=True needs attn_bias (the bias whose gradient it computes)")
    return flash_bwd_binding.empty_bias_grad(q, call)


@flash_bwd.register_fake
def _flash_bwd_fake(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, softmax_scale: float, causal: str, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                    attn_bias: torch.Tensor | None = None, dropout_p: float = 0.0,
                    philox: torch.Tensor | None = None, deterministic: bool = False,
                    bias_grad: bool = False, attention_chunk: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = flash_bwd_binding.empty_grads(q, k, v)
    call = flash_fwd_binding.Call(flash_fwd_binding.Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                                                          q.shape[3]), causal, 0, softmax_scale,
                                  window_left, window_right, softcap, bias=attn_bias)
    return dq, dk, dv, _bias_grad(q, call, bias_grad)


@torch.library.custom_op("lazytriton::flash_bwd_sinks", mutates_args=(), schema=_FLASH_BWD_SINKS_SCHEMA)
def flash_bwd_sinks(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, sinks: torch.Tensor, softmax_scale: float, causal: str, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                    attn_bias: torch.Tensor | None = None, dropout_p: float = 0.0,
                    philox: torch.Tensor | None = None, deterministic: bool = False, bias_grad: bool = False,
                    attention_chunk: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a call with attention sinks: ``(dq, dk, dv, dbias, dsinks)`` (``flash_bwd``'s, the sinks')."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out, do = _last_dim_contiguous(out), _last_dim_contiguous(do)
    call = _checked(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, attn_bias,
                    dropout_p, philox, sinks, attention_chunk)
    flash_bwd_binding.check_grad(q, out, lse, do, call)
    dbias = _bias_grad(q, call, bias_grad)
    grads, dsinks = flash_bwd_binding.sinks_backward(q, k, v, out, lse, do, call, deterministic,
                                                     dbias if bias_grad else None)
    return (*grads, dbias, dsinks)


@flash_bwd_sinks.register_fake
def _flash_bwd_sinks_fake(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, sinks: torch.Tensor, softmax_scale: float, causal: str,
                          window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                          alibi_slopes: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
                          dropout_p: float = 0.0, philox: torch.Tensor | None = None, deterministic: bool = False,
                          bias_grad: bool = False, attention_chunk: int = 0,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dbias = _flash_bwd_fake(do, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                            alibi_slopes, attn_bias, dropout_p, philox, deterministic, bias_grad)[3]
    return (*flash_bwd_binding.empty_grads(q, k, v), dbias, torch.empty_like(sinks))


# The features after (softmax_scale, causal), then deterministic, sinks and attention_chunk, with their defaults:
# the inputs may stop early.
_FEATURE_DEFAULTS: tuple[Any, ...] = (-1, -1, 0.0, None, None, 0.0, None, False, None, 0)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, softmax_scale, causal, *given = inputs
    features: tuple[Any, ...] = (*given, *_FEATURE_DEFAULTS[len(given):])
    window_left, window_right, softcap, alibi, bias, dropout_p, philox, deterministic, sinks, chunk = features
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi, bias, philox, sinks)
    ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.chunk = softmax_scale, causal, deterministic, chunk
    ctx.features = (window_left, window_right, softcap, dropout_p)
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, alibi, bias, philox, sinks = ctx.saved_tensors
    n_rest = len(ctx.needs_input_grad) - 3  # scale, causal, the features and deterministic: no gradient
    if grad_out is None:  # only lse was used, and it carries no gradient
        return (None,) * (3 + n_rest)
    window_left, window_right, softcap, dropout_p = ctx.features
    features = (window_left, window_right, softcap, alibi, bias, dropout_p, philox, ctx.deterministic)
    need_bias = len(ctx.needs_input_grad) > _BIAS_INPUT and ctx.needs_input_grad[_BIAS_INPUT] and bias is not None
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    rest: list[Any] = [None] * n_rest
    if sinks is None:
        dq, dk, dv, dbias = flash_bwd_op(grad_out, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, *features,
                                         need_bias, ctx.chunk)
    else:  # given sinks, every input up to them was given
        dq, dk, dv, dbias, dsinks = flash_bwd_sinks_op(grad_out, q, k, v, out, lse, sinks, ctx.softmax_scale,
                                                       ctx.causal, *features, need_bias, ctx.chunk)
        if ctx.needs_input_grad[_SINKS_INPUT]:
            rest[_SINKS_INPUT - 3] = dsinks
    if need_bias:
        rest[_BIAS_INPUT - 3] = dbias
    return (dq if need_q else None, dk if need_k else None, dv if need_v else None, *rest)


flash_fwd.register_autograd(_backward, setup_context=_setup_context)

# The overload itself: calling it skips CustomOpDef's Python wrapper (measured in NOTES.md).
flash_fwd_op = torch.ops.lazytriton.flash_fwd.default
flash_bwd_op = torch.ops.lazytriton.flash_bwd.default
flash_bwd_sinks_op = torch.ops.lazytriton.flash_bwd_sinks.default
