"""The description of ``flash_bwd_dkdv_gluon`` (``gluon_kernel.py``), apart from its rule (``gluon``).

The kernel registry (``lazytriton.kernels.get``) reads it from here; ``gluon`` builds its variants.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV

NAME = "flash_bwd_dkdv_gluon"

FLASH_BWD_DKDV_GLUON = KernelSpec(
    name=NAME,
    module="lazytriton.kernels.flash_bwd.gluon_kernel",
    function="flash_bwd_dkdv_gluon_kernel",
    params=FLASH_BWD_DKDV.params,
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "CAUSAL", "OVERLAP"),
    aligned_params=FLASH_BWD_DKDV.aligned_params,
    seq_aligned_params=FLASH_BWD_DKDV.seq_aligned_params,
)
