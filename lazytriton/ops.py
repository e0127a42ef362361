"""Torch ops: each kernel entry as a ``torch.library`` custom op with its fake twin.

``lazytriton::flash_fwd(q, k, v, softmax_scale, causal) -> (out, lse)`` takes
tensors in the kernel's (batch, heads, seqlen, head_dim) order, any strides
with a contiguous last dim (the public functions pass views, never copies),
and ``causal`` as one of "none", "top_left", "bottom_right". Its fake (meta)
implementation gives the exact shapes, dtypes and strides of the real one
(both allocate through ``binding.empty_outputs``), so ``torch.compile``,
``torch.export`` and FakeTensor tracing see through it without running it.

The public functions (``lazytriton.interface``) check their arguments, then
call the op, or, when nothing is tracing, the binding directly: the op's
dispatch is measured in benchmarks/NOTES.md. Autograd is registered on this op
by the backward issue.
"""

from __future__ import annotations

import torch

from lazytriton.kernels.flash_fwd import binding as flash_fwd_binding

_FLASH_FWD_SCHEMA = "(Tensor q, Tensor k, Tensor v, float softmax_scale, str causal) -> (Tensor, Tensor)"


@torch.library.custom_op("lazytriton::flash_fwd", mutates_args=(), schema=_FLASH_FWD_SCHEMA)
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
              causal: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward through the kernel cache: ``(out, lse)``."""
    # Checked again here: the op can be called directly (torch.ops.lazytriton.flash_fwd),
    # and a compiler may hand it inputs laid out otherwise than the eager trace had them.
    q, k, v = (t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in (q, k, v))
    call = flash_fwd_binding.check(q, k, v, causal, softmax_scale)
    return flash_fwd_binding.forward(q, k, v, call)


@flash_fwd.register_fake
def _flash_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                    causal: str) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, sq, d = q.shape
    return flash_fwd_binding.empty_outputs(q, flash_fwd_binding.Shape(b, hq, k.shape[1], sq, k.shape[2], d))


# The overload itself: calling it skips CustomOpDef's Python wrapper (measured in NOTES.md).
flash_fwd_op = torch.ops.lazytriton.flash_fwd.default
