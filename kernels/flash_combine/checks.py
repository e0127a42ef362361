"""Checks of a ``flash_attn_combine`` call: its tensors and options become one ``Call``, or an error naming them.

``check`` reads shapes, dtypes, strides and devices only (nothing is read from
a tensor's memory), and raises a ``TypeError`` (a wrong type or dtype) or a
``ValueError`` (a wrong shape, stride, device or size) naming the argument,
the value and what was expected, before anything is allocated or launched.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.arguments import shown
from lazytriton.kernels.flash_combine import MAX_BLOCK_D
from lazytriton.record import NamedTuple

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}  # the output's
INT32_MAX = 2**31 - 1
MAX_GRID_Y = 65535  # head-dim chunks of BLOCK_D columns: CUDA's and HIP's grid y limit
_ROW_MARGIN = 256  # the kernel's row indices (program x BLOCK_M + lane) stay in 32 bits past the last row


class Call(NamedTuple):
    """A checked call in the kernel's terms.

    ``batch`` and ``seqlen``: out_partial's (num_splits, batch, seqlen, heads,
    head_dim); the packed form (num_splits, total_q, heads, head_dim) is batch
    1 of seqlen total_q (``packed``). ``out_dtype``: the output's dtype, from
    ``out_dtype``, else ``out``'s, else float32 (out_partial's).
    """

    num_splits: int
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    out_dtype: torch.dtype
    packed: bool

    @property
    def n_rows(self) -> int:
        """The (batch, query, head) rows combined."""
        return self.batch * self.seqlen * self.heads

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output's shape: (batch, seqlen, heads, head_dim), or (total_q, heads, head_dim) packed."""
        rows = (self.seqlen,) if self.packed else (self.batch, self.seqlen)
        return (*rows, self.heads, self.head_dim)


def _float32(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (FlashAttention-3's partial results are), got {t.dtype}")
    return t


def _out_dtype(out_dtype: Any, out: torch.Tensor | None) -> torch.dtype:
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got {shown(out_dtype)}")
    chosen = out_dtype if out_dtype is not None else out.dtype if out is not None else torch.float32
    if chosen not in DTYPES:
        which = "out_dtype" if out_dtype is not None else "out"
        raise TypeError(f"{which} must be float32, float16 or bfloat16, got {chosen}")
    if out is not None and out.dtype != chosen:
        raise TypeError(f"out has dtype {out.dtype} but out_dtype is {chosen}; they must match")
    return chosen


def _check_out(out: Any, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape} (out_partial's without its splits), got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but out_partial is on {device}; they must be on one device")
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dim (stride 1), got strides {out.stride()}")
    if any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride(), strict=True)):
        raise ValueError(f"out must not have a broadcast (stride 0) dim: its rows would overlap, got strides "
                         f"{out.stride()}")
    return out


def check(out_partial: Any, lse_partial: Any, out: Any = None, out_dtype: Any = None) -> Call:
    """The ``Call`` of ``flash_attn_combine(out_partial, lse_partial, out, out_dtype)``, or TypeError/ValueError.

    out_partial: (num_splits, batch, seqlen, heads, head_dim) or (num_splits,
    total_q, heads, head_dim), float32, its last dim contiguous; lse_partial:
    its shape without head_dim, float32, any strides; out: optional, the
    shape without num_splits, its last dim contiguous.
    """
    out_partial = _float32("out_partial", out_partial)
    if out_partial.dim() not in (4, 5):
        raise ValueError(f"out_partial must have 5 dims (num_splits, batch, seqlen, heads, head_dim) or 4 "
                         f"(num_splits, total_q, heads, head_dim), got shape {tuple(out_partial.shape)}")
    lse_partial = _float32("lse_partial", lse_partial)
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial's without its "
                         f"head dim), got {tuple(lse_partial.shape)}")
    device = out_partial.device
    if lse_partial.device != device:
        raise ValueError(f"lse_partial is on {lse_partial.device} but out_partial is on {device}; they must be on "
                         "one device")
    head_dim = int(out_partial.shape[-1])
    if head_dim < 1:
        raise ValueError(f"out_partial's head dim (its last) must be >= 1, got shape {tuple(out_partial.shape)}")
    if head_dim > 1 and out_partial.stride(-1) != 1:
        raise ValueError(f"out_partial must have a contiguous last dim (stride 1), got strides {out_partial.stride()}")
    packed = out_partial.dim() == 4
    num_splits, *rows, heads = (int(n) for n in out_partial.shape[:-1])
    batch, seqlen = (1, rows[0]) if packed else (rows[0], rows[1])
    if out is not None:
        out = _check_out(out, tuple(out_partial.shape[1:]), device)
    call = Call(num_splits, batch, seqlen, heads, head_dim, _out_dtype(out_dtype, out), packed)
    if call.n_rows > INT32_MAX - _ROW_MARGIN:
        raise ValueError(f"out_partial has {call.n_rows} (batch, seqlen, heads) rows; at most "
                         f"{INT32_MAX - _ROW_MARGIN} are supported (32-bit row indices)")
    if -(-head_dim // MAX_BLOCK_D) > MAX_GRID_Y:
        raise ValueError(f"out_partial's head dim must be at most {MAX_GRID_Y * MAX_BLOCK_D}, got {head_dim}")
    return call
