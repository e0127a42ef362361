"""The description of the sinks' gradient kernel (``flash_bwd_dsinks``, ``triton_kernel.py``).

The package says what it does and builds its variant; the kernel registry (``lazytriton.kernels.get``) reads the
description from here.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

FAMILY = "flash_bwd_dsinks"
MODULE = "lazytriton.kernels.flash_bwd_dsinks.triton_kernel"

FLASH_BWD_DSINKS = KernelSpec(
    name="flash_bwd_dsinks",
    module=MODULE,
    function="flash_bwd_dsinks_kernel",
    params=(
        ("Sinks", "*fp32"),
        ("Lse", "*fp32"),
        ("Delta", "*fp32"),
        ("DSinks", "*fp32"),
        ("CuSeqlensQ", "*i32"),
        ("SequsedQ", "*i32"),
        ("stride_lb", "{index}"),
        ("stride_lh", "{index}"),
        ("batch", "i32"),
        ("seqlen_q", "i32"),
    ),
    constexprs=("BLOCK_M", "INDEX64", "VARLEN", "SEQUSED_Q"),
    aligned_params=(),
)

KERNELS = (FLASH_BWD_DSINKS,)
INT_PARAMS = tuple(name for name, _ in FLASH_BWD_DSINKS.params)  # every parameter is a pointer or an integer
