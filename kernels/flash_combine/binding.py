"""Host side of flash_combine: the one owner of the combine kernel's launch ABI.

Everything that launches ``flash_combine`` (the public
``flash_attn_combine``, its torch ops, benchmarks) goes through here, after
``checks.check`` passed the call: ``empty_outputs`` allocates out and lse
(the torch ops' fakes too, so shapes and strides agree; ``empty_lse`` only
lse when the caller gives out), ``ints`` lays the
arguments out in the description's order, ``layout_flags`` reads the
alignment and index width, ``plan`` loads the variant (memoised in the
runtime's plans, refused during a CUDA graph capture if not loaded), and
``forward`` runs it: the cached binary on a GPU, Triton's interpreter on the
CPU, nothing on meta.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import launch, runtime
from lazytriton.kernels.flash_combine import FAMILY, FLASH_COMBINE, INT_PARAMS, block_d, grid, variant
from lazytriton.kernels.flash_combine.checks import DTYPES, INT32_MAX, Call

_LAYOUT = ("OutPart", "LsePart", "Out", "Lse", *(f"stride_op{d}" for d in "nbsh"),
           *(f"stride_lp{d}" for d in "nbsh"), *(f"stride_o{d}" for d in "bsh"), *(f"stride_l{d}" for d in "bsh"),
           "heads", "seqlen", "head_dim", "num_splits", "n_rows")
if _LAYOUT != INT_PARAMS:  # pragma: no cover (an edit of one side only)
    raise ImportError(f"ints writes {_LAYOUT}, the description has {INT_PARAMS}")
INTERPRETER_BLOCK_M = 4  # the CPU path's tiles: smaller than the test shapes, so every loop takes several steps
INTERPRETER_BLOCK_N = 4


def _ptr(x: Any) -> int:
    return int(x.data_ptr())


def _rows(t: torch.Tensor, packed: bool, dims: int) -> tuple[int, ...]:
    """The strides of t's first ``dims`` dims in the kernel's (batch, query, head) order: 0 for a packed batch."""
    strides = tuple(t.stride()[:dims])
    return (*strides[:-2], 0, *strides[-2:]) if packed else strides


def empty_lse(out_partial: torch.Tensor, call: Call) -> torch.Tensor:
    """lse: float32 (batch, seqlen, heads), or (total_q, heads) packed.

    A transposed view of a contiguous (batch, heads, seqlen), as FlashAttention-3 returns it.
    """
    device = out_partial.device
    if call.packed:
        return torch.empty((call.heads, call.seqlen), dtype=torch.float32, device=device).transpose(0, 1)
    return torch.empty((call.batch, call.heads, call.seqlen), dtype=torch.float32, device=device).transpose(1, 2)


def empty_outputs(out_partial: torch.Tensor, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """out: contiguous, ``call.out_shape`` in ``call.out_dtype``; and ``empty_lse``."""
    out = torch.empty(call.out_shape, dtype=call.out_dtype, device=out_partial.device)
    return out, empty_lse(out_partial, call)


def ints(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, call: Call,
         pointers: Any = _ptr) -> tuple[Any, ...]:
    """The kernel's arguments in ``_LAYOUT``'s order (pointers through ``pointers``: data_ptr, or the tensor)."""
    packed = call.packed
    dims = out_partial.dim() - 1
    return (pointers(out_partial), pointers(lse_partial), pointers(out), pointers(lse),
            *_rows(out_partial, packed, dims), *_rows(lse_partial, packed, dims), *_rows(out, packed, dims - 1),
            *_rows(lse, packed, dims - 1), call.heads, call.seqlen, call.head_dim, call.num_splits, call.n_rows)


# What capi/lt_combine.c passes for each parameter (p: the caller's lt_flash_combine_params, its rows packed: batch 1
# of seqlen rows, batch strides 0; c: its checked call; op/lp/o/l: its tensors). tests/test_capi_combine.py
# compares the C initializer with these, field by field.
_C_INTS = {"OutPart": "LT__PTR(p->out_partial)", "LsePart": "LT__PTR(p->lse_partial)", "Out": "LT__PTR(p->out)",
           "Lse": "LT__PTR(p->lse)",
           "stride_opn": "op->strides[0]", "stride_opb": "0", "stride_ops": "op->strides[1]",
           "stride_oph": "op->strides[2]",
           "stride_lpn": "lp->strides[0]", "stride_lpb": "0", "stride_lps": "lp->strides[1]",
           "stride_lph": "lp->strides[2]",
           "stride_ob": "0", "stride_os": "o->strides[0]", "stride_oh": "o->strides[1]",
           "stride_lb": "0", "stride_ls": "l->strides[0]", "stride_lh": "l->strides[1]",
           "heads": "c->heads", "seqlen": "c->rows", "head_dim": "c->head_dim", "num_splits": "c->splits",
           "n_rows": "c->n_rows"}


def c_initializer() -> str:
    """The C launcher's (capi/lt_combine.c) integer-argument initializer, in the description's order."""
    return ", ".join(_C_INTS[name] for name in INT_PARAMS)


def _extent(t: torch.Tensor) -> int:
    """How far past its first element a tensor's last one lies (elements)."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 0)


def layout_flags(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[bool, bool]:
    """(aligned, index64) of a call's tensors.

    aligned: the partial outputs' and out's pointers and outer strides are multiples of 16 (``aligned_params``);
    index64: some tensor spans 2**31 elements or more.
    """
    bits = out_partial.data_ptr() | out.data_ptr()
    for stride in (*out_partial.stride()[:-1], *out.stride()[:-1]):
        bits |= stride
    index64 = max(_extent(t) for t in (out_partial, lse_partial, out, lse)) >= INT32_MAX
    return not bits & 15, index64


def memo_key(device_index: int | None, dtype: torch.dtype, head_dim: int, aligned: bool, index64: bool
             ) -> tuple[Any, ...]:
    """Everything ``variant`` reads: the head dim through its chunk and whether the chunk divides it."""
    cols = block_d(head_dim)
    return (FAMILY, device_index, dtype, cols, head_dim % cols == 0, aligned, index64)


def plan(device: torch.device, dtype: torch.dtype, head_dim: int, aligned: bool, index64: bool) -> tuple[Any, ...]:
    """(kernel, BLOCK_M, BLOCK_D), loaded, memoised in the runtime's plans.

    During a CUDA graph capture, a kernel not loaded yet raises ``CaptureError``.
    """
    rt = runtime.get()
    key = memo_key(device.index, dtype, head_dim, aligned, index64)
    found = rt.plans.get(key)
    if found is not None:
        return found  # type: ignore[no-any-return]

    def choose(target: Any) -> launch.Choice:
        return ((variant(target, DTYPES[dtype], head_dim, aligned, index64), ("BLOCK_M", "BLOCK_D")),)

    return launch.plan(rt, key, device, choose, "run flash_attn_combine once with this head dim and output dtype "
                       "before the capture")


def launch_gpu(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               call: Call) -> None:
    """Launch the cached kernel for a checked call on GPU tensors."""
    device = out_partial.device
    aligned, index64 = layout_flags(out_partial, lse_partial, out, lse)
    kernel, block_m, cols = plan(device, call.out_dtype, call.head_dim, aligned, index64)
    kernel.launch(grid(call.n_rows, call.head_dim, block_m, cols), launch.raw_stream(device.index),
                  ints(out_partial, lse_partial, out, lse, call), (), launch.scratch_alloc)


def interpreter_constexprs(call: Call) -> dict[str, Any]:
    """The constexprs for Triton's interpreter: the call's column chunk, small row and split tiles."""
    cols = block_d(call.head_dim)
    return {"BLOCK_M": INTERPRETER_BLOCK_M, "BLOCK_N": INTERPRETER_BLOCK_N, "BLOCK_D": cols,
            "EVEN_D": call.head_dim % cols == 0}


def run_interpreter(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    call: Call) -> None:
    """Run the kernel through Triton's interpreter on CPU tensors."""
    from lazytriton import compiler

    constexprs = interpreter_constexprs(call)
    compiler.interpret(FLASH_COMBINE.name, grid(call.n_rows, call.head_dim, INTERPRETER_BLOCK_M, constexprs["BLOCK_D"]),
                       ints(out_partial, lse_partial, out, lse, call, pointers=lambda x: x), constexprs)


def forward(out_partial: torch.Tensor, lse_partial: torch.Tensor, call: Call, out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a checked call: into ``out`` when given (in place), else new tensors (``empty_outputs``).

    The kernel on a GPU, the interpreter on the CPU, nothing on meta.
    """
    if out is None:
        out, lse = empty_outputs(out_partial, call)
    else:
        lse = empty_lse(out_partial, call)
    if out_partial.device.type == "meta" or call.n_rows == 0:
        return out, lse
    if out_partial.device.type == "cpu":
        run_interpreter(out_partial, lse_partial, out, lse, call)
    else:
        launch_gpu(out_partial, lse_partial, out, lse, call)
    return out, lse
