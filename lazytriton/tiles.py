"""Tiles: a kernel variant's tuned constexprs and compile options, as every family's dispatch chooses them.

Pure records and rules of thumb shared by the families' defaults; no family is named here.
"""

from __future__ import annotations

from lazytriton.record import record
from lazytriton.target import Target

# CUDA targets with 99 KiB of shared memory per block (sm_86, sm_89, sm_120): tiles sized for sm_80's 163 KiB
# or sm_90's 227 KiB do not fit there (prewarm/limits.py's estimate), so the families' defaults halve them.
SMALL_SHARED_CUDA = (86, 89, 120, 121)


def seqlen_class(seqlen_q: int) -> int:
    """The largest BLOCK_M worth using for ``seqlen_q`` query rows (16, 64 or 128)."""
    if seqlen_q <= 16:
        return 16
    if seqlen_q <= 64:
        return 64
    return 128


@record
class Config:
    """Tuned constexprs and compile options for one variant."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0

    def tuned(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}

    def options(self, target: Target) -> dict[str, int]:
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if target.backend == "hip":
            opts["waves_per_eu"] = self.waves_per_eu
        return opts
