"""The description of the combine kernel (``flash_combine``, ``triton_kernel.py``); the package says what it does.

The kernel registry (``lazytriton.kernels.get``) reads it from here; the package builds its variant.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

FAMILY = "flash_combine"
MODULE = "lazytriton.kernels.flash_combine.triton_kernel"


def _strides(tensor: str, dims: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"stride_{tensor}{d}", "{index}") for d in dims)


# out_partial and lse_partial: split (n), batch, query, head; out and lse: batch, query, head.
_PART_STRIDES = _strides("op", "nbsh")
_OUT_STRIDES = _strides("o", "bsh")

FLASH_COMBINE = KernelSpec(
    name="flash_combine",
    module=MODULE,
    function="flash_combine_kernel",
    params=(
        ("OutPart", "*fp32"),
        ("LsePart", "*fp32"),
        ("Out", "*{dtype}"),
        ("Lse", "*fp32"),
        *_PART_STRIDES,
        *_strides("lp", "nbsh"),
        *_OUT_STRIDES,
        *_strides("l", "bsh"),
        ("heads", "i32"),
        ("seqlen", "i32"),
        ("head_dim", "i32"),
        ("num_splits", "i32"),
        ("n_rows", "i32"),
    ),
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D"),
    # The outputs' rows: the logsumexps are read and written one float a row, and FlashAttention's own layout of
    # them has a stride of 1 (lse_partial contiguous in the query dim), so they take no hint.
    aligned_params=("OutPart", "Out") + tuple(name for name, _ in (*_PART_STRIDES, *_OUT_STRIDES)),
)

KERNELS = (FLASH_COMBINE,)
INT_PARAMS = tuple(name for name, _ in FLASH_COMBINE.params)  # every parameter is a pointer or an integer
