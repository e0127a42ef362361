"""``flash_attn_combine``: FlashAttention-3's merge of attention computed over disjoint key chunks.

Layering is the other entry points': this thin function checks its
arguments (a ``TypeError``/``ValueError`` naming the argument before
anything is allocated or launched), then calls the binding
(``kernels/flash_combine/binding.py``) directly when nothing is tracing, or
else the torch ops of ``lazytriton.combine_op``.

``import lazytriton`` does not import this module (it imports torch): the
name is re-exported lazily by ``lazytriton/__init__.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.flash_combine import binding, checks

_is_compiling = torch.compiler.is_compiling
_dispatch_mode = getattr(torch.utils._python_dispatch, "_get_current_dispatch_mode", lambda: None)
_Tensor = torch.Tensor


def _direct(*tensors: Any) -> bool:
    """True when the op's dispatch adds nothing: plain tensors, nothing tracing, no dispatch mode."""
    return (all(t is None or type(t) is _Tensor for t in tensors) and not _is_compiling()
            and _dispatch_mode() is None)


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-3's ``flash_attn_combine``: attention over disjoint key chunks merged into attention over all.

    Each split n holds the attention of the same queries over its own chunk
    of the keys (split-KV decoding, or one rank of context parallelism): its
    output and the natural-log logsumexp of its scaled scores, as
    ``flash_attn_with_kvcache(..., return_softmax_lse=True)`` returns them.
    The result is attention over the union of the chunks:
    ``lse = log(sum_n exp(lse_n))`` and ``out = sum_n exp(lse_n - lse) *
    out_n``. A split whose lse is -inf saw no key and counts for nothing (its
    output is not read: an unwritten workspace may hold anything); where
    every split is -inf, out is 0 and lse -inf (no NaN).

    Args:
        out_partial: (num_splits, batch, seqlen, heads, head_dim), or
            (num_splits, total_q, heads, head_dim) for packed sequences,
            float32, any strides with a contiguous last dim. Any number of
            splits and any head dim.
        lse_partial: out_partial's shape without head_dim, float32, any
            strides (FlashAttention-3's own, contiguous in seqlen, is the
            transpose of (num_splits, batch, heads, seqlen)).
        out: optional, out_partial's shape without num_splits, any strides
            with a contiguous last dim: written in place and returned.
        out_dtype: float32, float16 or bfloat16; default out's dtype, else
            float32 (out_partial's, as FlashAttention-3).

    Returns:
        (out, lse): out (batch, seqlen, heads, head_dim), or (total_q, heads,
        head_dim), in out_dtype; lse float32 (batch, seqlen, heads), or
        (total_q, heads), a transposed view of a contiguous (batch, heads,
        seqlen), as FlashAttention-3 returns it.

    CUDA/ROCm tensors run a cached kernel (compiled on first use if no tier
    holds it; CUDA-graph capturable once loaded); CPU tensors run the same
    kernel through Triton's interpreter; torch.compile(fullgraph=True)
    traces the call through the ops ``torch.ops.lazytriton.flash_combine``
    and ``flash_combine_out``. Not differentiable.

    FlashAttention-3 takes at most 256 splits and, given ``out``, requires
    out_dtype to be its dtype (float32 unless given); here any count serves
    and ``out``'s dtype is the default.

    """
    call = checks.check(out_partial, lse_partial, out, out_dtype)
    if _direct(out_partial, lse_partial, out):
        return binding.forward(out_partial, lse_partial, call, out)
    from lazytriton.combine_op import flash_combine_op, flash_combine_out_op

    if out is None:
        combined, lse = flash_combine_op(out_partial, lse_partial, call.out_dtype)
        return combined, lse
    return out, flash_combine_out_op(out_partial, lse_partial, out)


__all__ = ["flash_attn_combine"]
