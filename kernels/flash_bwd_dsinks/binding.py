"""Host side of flash_bwd_dsinks: the one owner of the sinks' gradient kernel's launch ABI.

Everything that launches ``flash_bwd_dsinks`` goes through here (the C API's
backward launches it from C with ``c_initializer``'s arguments, tested
against this table): ``ints`` lays the arguments out in the description's
order, ``plan`` loads the variant (memoised in the runtime's plans, refused
during a CUDA graph capture if not loaded), and ``dsinks`` runs it: the cached
binary on a GPU, Triton's interpreter on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import launch, runtime
from lazytriton.kernels.flash_bwd_dsinks import FAMILY, FLASH_BWD_DSINKS, INT_PARAMS, grid, variant

INT32_MAX = 2**31 - 1
INTERPRETER_BLOCK_M = 4  # the CPU path's tile: smaller than the test shapes, so every loop takes several steps

# What lt_bwd.c passes for each parameter (p: the backward's view, its packed tensors as (1, heads, total) lse and
# delta; c: its checked call). A dense call's lse is contiguous (batch, heads_q, seqlen_q); a packed one's
# (heads_q, total_q): no batch stride, the rows of head h from h * total_q. Absent index tensors: lse's pointer,
# never read.
_C_INTS = {"Sinks": "c->sinks", "Lse": "(int64_t)(uintptr_t)p->lse.data", "Delta": "(int64_t)(uintptr_t)p->delta.data",
           "DSinks": "(int64_t)(uintptr_t)p->dsinks.data",
           "CuSeqlensQ": "c->varlen ? c->cu_seqlens_q : (int64_t)(uintptr_t)p->lse.data",
           "SequsedQ": "c->seqused_q ? c->seqused_q : (int64_t)(uintptr_t)p->lse.data",
           "stride_lb": "c->varlen ? 0 : c->hq * c->sq", "stride_lh": "c->sq",
           "batch": "c->varlen ? c->batch : c->b", "seqlen_q": "c->sq"}


def c_initializer() -> str:
    """The C launcher's (capi/lt_bwd.c) argument initializer, in the description's order."""
    return ", ".join(_C_INTS[name] for name in INT_PARAMS)


def _ptr(x: Any) -> int:
    return int(x.data_ptr())


def ints(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, out: torch.Tensor,
         cu_seqlens_q: torch.Tensor | None = None, seqused_q: torch.Tensor | None = None,
         pointers: Any = _ptr) -> tuple[Any, ...]:
    """The kernel's arguments in the description's order (pointers through ``pointers``: data_ptr, or the tensor).

    Dense: lse and delta (batch, heads_q, seqlen_q), contiguous. Packed (``cu_seqlens_q``): (heads_q, total_q),
    contiguous. An absent index tensor is lse (never read).
    """
    if cu_seqlens_q is None:
        batch, heads, seqlen = lse.shape
        strides: tuple[int, int] = (heads * seqlen, seqlen)
    else:
        batch, seqlen = cu_seqlens_q.numel() - 1, lse.shape[1]
        strides = (0, seqlen)
    return (pointers(sinks), pointers(lse), pointers(delta), pointers(out),
            pointers(lse if cu_seqlens_q is None else cu_seqlens_q), pointers(lse if seqused_q is None else seqused_q),
            *strides, batch, seqlen)


def memo_key(device_index: int | None, varlen: bool, seqused_q: bool, index64: bool) -> tuple[Any, ...]:
    """Everything ``variant`` reads."""
    return (FAMILY, device_index, varlen, seqused_q, index64)


def plan(device: torch.device, varlen: bool, seqused_q: bool, index64: bool) -> Any:
    """The loaded kernel, memoised in the runtime's plans; during a capture, an unloaded one raises CaptureError."""
    rt = runtime.get()
    key = memo_key(device.index, varlen, seqused_q, index64)
    found = rt.plans.get(key)
    if found is None:
        def choose(target: Any) -> launch.Choice:
            return ((variant(target, varlen, seqused_q, index64), ()),)

        found = launch.plan(rt, key, device, choose, "run a backward with sinks of this layout once before the "
                            "capture")
    return found[0]


def dsinks(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
           seqused_q: torch.Tensor | None = None) -> torch.Tensor:
    """d(sinks), float32 (heads_q,): -sum of exp(sinks[h] - lse) * delta over head h's rows, in one launch.

    Layouts as ``ints`` reads them (the forward's lse: dense (batch, heads_q, seqlen_q), packed (heads_q, total_q)
    with the cumulative query lengths and, optionally, the used ones). The cached kernel on a GPU, Triton's
    interpreter on the CPU.
    """
    out = torch.empty(sinks.numel(), dtype=torch.float32, device=sinks.device)
    if sinks.numel() == 0:
        return out
    varlen, used = cu_seqlens_q is not None, seqused_q is not None
    if sinks.device.type == "cpu":
        from lazytriton import compiler

        constexprs = {"BLOCK_M": INTERPRETER_BLOCK_M, "INDEX64": False, "VARLEN": varlen, "SEQUSED_Q": used}
        compiler.interpret(FLASH_BWD_DSINKS.name, grid(sinks.numel()),
                           ints(sinks, lse, delta, out, cu_seqlens_q, seqused_q, pointers=lambda x: x), constexprs)
        return out
    kernel = plan(sinks.device, varlen, used, lse.numel() > INT32_MAX)
    kernel.launch(grid(sinks.numel()), launch.raw_stream(sinks.device.index),
                  ints(sinks, lse, delta, out, cu_seqlens_q, seqused_q), (), launch.scratch_alloc)
    return out


