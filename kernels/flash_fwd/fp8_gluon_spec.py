"""The description of ``flash_fwd_fp8_gluon`` (``fp8_gluon_kernel.py``), apart from its rule (``fp8_gluon``).

The kernel registry (``lazytriton.kernels.get``) reads it from here. A kernel of its own beside
``flash_fwd_fp8`` (as ``flash_fwd_gluon`` is beside ``flash_fwd``): its key covers its own source and helpers,
and it shares ``flash_fwd_fp8``'s host ABI whole (the same parameters, so ``fp8.pack`` packs its arguments and
the grid is the same, BLOCK_M from the variant; the same outputs, V read from its transpose).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytriton.kernels import KernelSpec, specialised_warps
from lazytriton.kernels.flash_fwd.fp8_spec import FLASH_FWD_FP8

if TYPE_CHECKING:
    from lazytriton.variant import Variant

NAME = "flash_fwd_fp8_gluon"


def warps(variant: Variant) -> int:
    """The warps an entry of ``variant`` launches: two consumer warpgroups of num_warps and the producer warp's."""
    num_warps = int(variant.get("num_warps"))
    return specialised_warps(num_warps, (num_warps, 1))


FLASH_FWD_FP8_GLUON = KernelSpec(
    name=NAME,
    module="lazytriton.kernels.flash_fwd.fp8_gluon_kernel",
    function="flash_fwd_fp8_gluon_kernel",
    params=FLASH_FWD_FP8.params,
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "CAUSAL", "V_OPERAND_ORDER"),
    aligned_params=FLASH_FWD_FP8.aligned_params,
    helpers=("lazytriton.kernels.gluon_tma",),  # tma_load
    warps=warps,
    # V's copy with each 32 keys in the P V wgmma's operand order (fp8.copy_v writes it): the Python calls'
    # variants. Absent (false): the keys in order, as the C API's callers give V transposed.
    flags=("V_OPERAND_ORDER",),
)
