"""The description of ``flash_fwd_gluon`` (``gluon_kernel.py``), apart from its rule (``gluon``).

The kernel registry (``lazytriton.kernels.get``) reads it from here; ``gluon`` holds what the kernel runs
(tiles, shared memory) and builds its variants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytriton.kernels import KernelSpec, specialised_warps
from lazytriton.kernels.flash_fwd import FLASH_FWD

if TYPE_CHECKING:
    from lazytriton.variant import Variant

NAME = "flash_fwd_gluon"


def warps(variant: Variant) -> int:
    """The warps an entry of ``variant`` launches: its partitions' (the kernel's own rule, ``WGS``).

    A query tile (BLOCK_M / BLOCK_TILES rows) is 16 rows a warp of
    ``num_warps``-warp consumer warpgroups: one without PRODUCER, which runs
    alone (num_warps); with it the first is the default partition and the
    others (ping-pong's second, the wide tiles' second and third) and the
    producer warp are workers (``specialised_warps``): 128 x 128 x 8 with the
    producer 12, ping-pong's 128 x 64 x 4 12, the wide 192 x 128 x 4 16.
    """
    constexprs = variant.constexprs
    num_warps = int(variant.get("num_warps"))
    if constexprs.get("PRODUCER") is not True:
        return num_warps
    tile_m = int(constexprs["BLOCK_M"]) // max(1, int(constexprs.get("BLOCK_TILES", 1)))
    consumers = max(1, tile_m // (16 * num_warps))
    return specialised_warps(num_warps, (num_warps,) * (consumers - 1) + (1,))


FLASH_FWD_GLUON = KernelSpec(
    name=NAME,
    module="lazytriton.kernels.flash_fwd.gluon_kernel",
    function="flash_fwd_gluon_kernel",
    params=FLASH_FWD.params,
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "CAUSAL", "PRODUCER", "PINGPONG", "BLOCK_TILES",
                "BLOCK_D2", "SINKS"),
    aligned_params=FLASH_FWD.aligned_params,
    wide_blocks=("BLOCK_M",),  # WIDE_CONFIGS: 192 rows, three warpgroups of 64
    helpers=("lazytriton.kernels.gluon_tma",),  # descriptors, copy_in, copy_out
    warps=warps,  # warp-specialised with PRODUCER: more than num_warps
)
