"""Torch ops of the FP8 forward (FlashAttention-3's, ``kernels/flash_fwd/fp8.py``), with their fake twins.

``lazytriton::flash_fwd_fp8(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left=-1,
window_right=-1, softcap=0.0, attention_chunk=0) -> (out, lse)`` takes float8 (e4m3fn, e5m2) tensors in the kernel's
(batch, heads, seqlen, head_dim) order (any strides with a contiguous last dim), FlashAttention-3's descales
(None, or float32 (batch, heads_k), (1,) or ()), ``causal`` as one of "none", "top_left", "bottom_right", and the
window, softcap and chunk as ``lazytriton::flash_fwd`` does; out is bfloat16, lse float32 (batch, heads_q,
seqlen_q).

``lazytriton::flash_varlen_fwd_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale,
k_descale, v_descale, softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0, seqused_q=None,
seqused_k=None, attention_chunk=0) -> (out, lse)`` is the packed form (``flash_attn_varlen_func``'s), descales per
sequence; lse float32 (heads_q, total_q).

The public functions call them while torch.compile traces (or under a dispatch mode, or with tensor subclasses);
an eager call of plain tensors goes to the binding directly, as the other ops' callers do. Each op checks its
arguments again (it can be called directly; a warm dense call of plain tensors is served by ``fp8_hot``, whose
entry the same checks made) and its fake gives the real outputs' shapes, dtypes and strides (both allocate through
``fp8.empty_outputs``; the warm path, the shapes and strides it gave). The FP8 forward has no backward
(FlashAttention-3's has none): the ops take inputs that require grad, as FlashAttention-3's forward does, and their
backward raises NotImplementedError (``NO_BACKWARD``).
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import forward_only
from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_hot

_DESCALES = "Tensor? q_descale, Tensor? k_descale, Tensor? v_descale"
NO_BACKWARD = ("the FP8 forward (float8 q, k, v) has no backward (FlashAttention-3's has none either): detach the "
               "float8 inputs or run the call under torch.no_grad()")
_FEATURES = "int window_left=-1, int window_right=-1, float softcap=0.0"
_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {_DESCALES}, float softmax_scale, str causal, {_FEATURES}, "
               "int attention_chunk=0) -> (Tensor, Tensor)")
_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                  f"int max_seqlen_k, {_DESCALES}, float softmax_scale, bool causal, {_FEATURES}, "
                  "Tensor? seqused_q=None, Tensor? seqused_k=None, int attention_chunk=0) -> (Tensor, Tensor)")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@torch.library.custom_op("lazytriton::flash_fwd_fp8", mutates_args=(), schema=_FWD_SCHEMA)
def flash_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
                  k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, softmax_scale: float, causal: str,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward through the kernel cache: ``(out bf16, lse)``."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    given = (q_descale, k_descale, v_descale)
    window, cap = (window_left, window_right), float(softcap)
    if all(type(t) is torch.Tensor for t in (q, k, v)) and all(t is None or type(t) is torch.Tensor for t in given):
        warm = fp8_hot.forward_bhsd(q, k, v, causal, softmax_scale, given, window, cap, attention_chunk)
        if warm is not None:
            return warm  # type: ignore[no-any-return]
    call = fp8.checked(q, k, v, causal, softmax_scale, binding.NAMES, window, cap, attention_chunk, given, {})
    return fp8.forward(q, k, v, call, given)


@flash_fwd_fp8.register_fake
def _flash_fwd_fp8_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.empty_outputs(q, v.shape[-1])


@torch.library.custom_op("lazytriton::flash_varlen_fwd_fp8", mutates_args=(), schema=_VARLEN_SCHEMA)
def flash_varlen_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         q_descale: torch.Tensor | None, k_descale: torch.Tensor | None,
                         v_descale: torch.Tensor | None, softmax_scale: float, causal: bool, window_left: int = -1,
                         window_right: int = -1, softcap: float = 0.0, seqused_q: torch.Tensor | None = None,
                         seqused_k: torch.Tensor | None = None,
                         attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed FP8 forward through the kernel cache: ``(out bf16, lse (heads_q, total_q))``."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cu_q, cu_k, used_q, used_k = (index_tensor(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    given = (q_descale, k_descale, v_descale)
    vc = fp8.checked_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                            (window_left, window_right), float(softcap), used_q, used_k, attention_chunk, given, {})
    return fp8.varlen_forward(q, k, v, cu_q, cu_k, vc, given)


@flash_varlen_fwd_fp8.register_fake
def _flash_varlen_fwd_fp8_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.empty_outputs(q, v.shape[-1], varlen=True)


forward_only.register(NO_BACKWARD, flash_fwd_fp8, flash_varlen_fwd_fp8)

# The overloads themselves: calling one skips CustomOpDef's Python wrapper (as lazytriton.ops does).
flash_fwd_fp8_op = torch.ops.lazytriton.flash_fwd_fp8.default
flash_varlen_fwd_fp8_op = torch.ops.lazytriton.flash_varlen_fwd_fp8.default
