"""The torch ops of ``flash_attn_combine``: ``lazytriton::flash_combine`` and ``lazytriton::flash_combine_out``.

``lazytriton::flash_combine(out_partial, lse_partial, out_dtype) -> (out,
lse)`` allocates its outputs; ``lazytriton::flash_combine_out(out_partial,
lse_partial, out) -> lse`` writes the combined output into ``out``, which it
declares mutated (``Tensor(a!)``), so that ``torch.compile`` keeps the write
in order and the caller's tensor is the one written. Two ops, because a
custom op may not return a tensor aliasing its input, as FlashAttention-3's
``fwd_combine`` does with ``out``. Forward only. The fakes give the exact
shapes, dtypes and strides of the real outputs (both allocate through
``binding.empty_outputs``/``empty_lse``).

Registered on first use by ``lazytriton.combine`` (an eager call with nothing
tracing goes to the binding directly and never registers it).
"""

from __future__ import annotations

import torch

from lazytriton.kernels.flash_combine import binding, checks


@torch.library.custom_op("lazytriton::flash_combine", mutates_args=(),
                         schema="(Tensor out_partial, Tensor lse_partial, ScalarType? out_dtype) -> (Tensor, Tensor)")
def flash_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                  out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The combined ``(out, lse)`` in new tensors (checked again: the op can be called directly)."""
    return binding.forward(out_partial, lse_partial, checks.check(out_partial, lse_partial, None, out_dtype))


@flash_combine.register_fake
def _flash_combine_fake(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                        out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    return binding.empty_outputs(out_partial, checks.check(out_partial, lse_partial, None, out_dtype))


@torch.library.custom_op("lazytriton::flash_combine_out", mutates_args=("out",),
                         schema="(Tensor out_partial, Tensor lse_partial, Tensor(a!) out) -> Tensor")
def flash_combine_out(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The combined output written into ``out`` in place; returns lse."""
    call = checks.check(out_partial, lse_partial, out, None)
    return binding.forward(out_partial, lse_partial, call, out)[1]


@flash_combine_out.register_fake
def _flash_combine_out_fake(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                            out: torch.Tensor) -> torch.Tensor:
    return binding.empty_lse(out_partial, checks.check(out_partial, lse_partial, out, None))


# The overloads themselves: calling them skips CustomOpDef's Python wrapper.
flash_combine_op = torch.ops.lazytriton.flash_combine.default
flash_combine_out_op = torch.ops.lazytriton.flash_combine_out.default
