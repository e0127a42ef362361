"""Description of the attention sinks' gradient kernel (``triton_kernel.py``): d(sinks) on the GPU, in one launch.

The family ``flash_bwd_dsinks`` has one kernel, ``flash_bwd_dsinks``: after
the backward's kernels (``flash_bwd``), whose first one writes delta =
rowsum(dO * O), it reduces the sinks' gradient

    d(sinks)_h = -sum over batch and rows i of head h of exp(sink_h - lse_i) * delta_i

(``flash_fwd.sinks.grad``'s formula) over the forward's lse layout: dense
(batch, heads_q, seqlen_q), or packed (heads_q, total_q) with the cumulative
query lengths (``VARLEN``) and, with ``SEQUSED_Q``, each sequence's used rows.
One program a query head sums its rows in a fixed order (deterministic: no
atomics, the C API's result is the same bits every run). ``INDEX64`` makes
the lse strides 64-bit. ``BLOCK_M`` is the rows a step; one config serves
every call (the kernel reads 8 bytes a row: bound by memory, not tuned yet).
"""

from __future__ import annotations

from typing import Any

from lazytriton.kernels.flash_bwd_dsinks.spec import FAMILY
from lazytriton.kernels.flash_bwd_dsinks.spec import FLASH_BWD_DSINKS as FLASH_BWD_DSINKS  # re-exported
from lazytriton.kernels.flash_bwd_dsinks.spec import INT_PARAMS as INT_PARAMS  # re-exported
from lazytriton.kernels.flash_bwd_dsinks.spec import KERNELS as KERNELS  # re-exported
from lazytriton.kernels.flash_bwd_dsinks.spec import MODULE as MODULE  # re-exported

# 256 rows a step (prewarm.limits' cap on BLOCK_M), 4 warps: 2 rows of lse and delta a thread a step; chosen by the
# reduction's shape (one pass over 8 bytes a row), not measured yet (benchmarks/bench_flash_bwd_dsinks.py measures it
# against torch's formula).
BLOCK_M = 256
NUM_WARPS = 4


def grid(heads_q: int) -> tuple[int, int, int]:
    """Programs: one a query head (each sums all its rows: the order, and so the bits, fixed)."""
    return (heads_q, 1, 1)


def variant(target: Any, varlen: bool, seqused_q: bool, index64: bool) -> Any:
    """The flash_bwd_dsinks variant serving a call (pure): one config (``BLOCK_M``, ``NUM_WARPS``), dtype fp32.

    Functional: INDEX64, and VARLEN with SEQUSED_Q (only with VARLEN) written only when true.
    """
    from lazytriton.variant import Variant, pairs

    if seqused_q and not varlen:
        raise ValueError("seqused_q needs packed sequences (varlen=True): it cuts their spans")
    functional: dict[str, bool | int] = {"INDEX64": bool(index64)}
    for name, flag in (("VARLEN", varlen), ("SEQUSED_Q", seqused_q)):
        if flag:
            functional[name] = True
    options = {"num_warps": NUM_WARPS, "num_stages": 1}
    if target.backend == "hip":
        options["waves_per_eu"] = 2  # the decoding kernels' AMD default; untuned
    return Variant(FAMILY, str(target), "fp32", pairs(functional), pairs({"BLOCK_M": BLOCK_M}), pairs(options))
