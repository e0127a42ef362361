"""Torch ops of the MLA forward (``kernels/flash_fwd_mla``), with their fake twins and a backward that refuses.

``lazytriton::flash_fwd_mla(q, k, v, qv, softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0,
attention_chunk=0) -> (out, lse)`` takes tensors in the kernel's (batch, heads, seqlen, head_dim) order (any
strides with a contiguous last dim), ``qv`` (batch, heads_q, seqlen_q, head_dim_v) or None, ``causal`` as one of "none",
"top_left", "bottom_right", and the window and softcap as ``lazytriton::flash_fwd`` does; out has v's head dim,
lse is float32 (batch, heads_q, seqlen_q).

``lazytriton::flash_varlen_fwd_mla(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0, seqused_q=None, seqused_k=None,
attention_chunk=0) -> (out, lse)`` is the packed form (``flash_attn_varlen_func``'s, FlashAttention-3's seqused
and attention_chunk); lse float32 (heads_q, total_q).

The public functions call them while torch.compile traces, under a dispatch mode, with tensor subclasses, or
when an input requires grad. Each op checks its arguments again (it can be called directly) and its fake gives
the real outputs' shapes, dtypes and strides. The autograd formula raises NotImplementedError: there is no
backward with qv or v of more than 256 columns (FlashAttention-3 has none either).
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import forward_only
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.kernels.flash_fwd import varlen
from lazytriton.kernels.flash_fwd_mla import binding

_FEATURES = "int window_left=-1, int window_right=-1, float softcap=0.0"
_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, Tensor? qv, float softmax_scale, str causal, {_FEATURES}, "
               "int attention_chunk=0) -> (Tensor, Tensor)")
_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? qv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                  f"int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, {_FEATURES}, "
                  "Tensor? seqused_q=None, Tensor? seqused_k=None, int attention_chunk=0) -> (Tensor, Tensor)")
NO_BACKWARD = ("the MLA forward (qv, or v's head dim over 256) has no backward (FlashAttention-3 has none either): "
               "detach its inputs or run it under torch.no_grad(); a v of at most 256 columns without qv runs "
               "flash_fwd, which has one")


def _last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@torch.library.custom_op("lazytriton::flash_fwd_mla", mutates_args=(), schema=_FWD_SCHEMA)
def flash_fwd_mla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None, softmax_scale: float,
                  causal: str, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLA forward through the kernel cache: ``(out, lse)``."""
    q, k, v = (t.contiguous() if t.stride(-1) != 1 and t.shape[-1] > 1 else t for t in (q, k, v))
    qv = _last_dim_contiguous(qv)
    call = binding.check(q, k, v, qv, causal, softmax_scale, fwd.NAMES, (window_left, window_right), float(softcap),
                         attention_chunk)
    return binding.forward(q, k, v, qv, call)  # type: ignore[arg-type]


@flash_fwd_mla.register_fake
def _flash_fwd_mla_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out = fwd.empty_like_head_dim(q, v.shape[-1])
    return out, torch.empty(tuple(q.shape[:3]), dtype=torch.float32, device=q.device)


@torch.library.custom_op("lazytriton::flash_varlen_fwd_mla", mutates_args=(), schema=_VARLEN_SCHEMA)
def flash_varlen_fwd_mla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int = -1,
                         window_right: int = -1, softcap: float = 0.0, seqused_q: torch.Tensor | None = None,
                         seqused_k: torch.Tensor | None = None,
                         attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed MLA forward through the kernel cache: ``(out, lse (heads_q, total_q))``."""
    q, k, v = (t.contiguous() if t.stride(-1) != 1 and t.shape[-1] > 1 else t for t in (q, k, v))
    qv = _last_dim_contiguous(qv)
    vc, _ = binding.check_varlen(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale, (window_left, window_right), float(softcap), seqused_q=seqused_q,
                                 seqused_k=seqused_k, attention_chunk=attention_chunk)
    return binding.varlen_forward(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, vc)  # type: ignore[arg-type]


@flash_varlen_fwd_mla.register_fake
def _flash_varlen_fwd_mla_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return varlen.empty_outputs(q, v.shape[-1])


forward_only.register(NO_BACKWARD, flash_fwd_mla, flash_varlen_fwd_mla)

# The overloads themselves: calling one skips CustomOpDef's Python wrapper (as lazytriton.ops does).
flash_fwd_mla_op = torch.ops.lazytriton.flash_fwd_mla.default
flash_varlen_fwd_mla_op = torch.ops.lazytriton.flash_varlen_fwd_mla.default
