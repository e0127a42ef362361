"""The descriptions of ``flash_bwd_fused_gluon`` and ``flash_bwd_prep`` (``fused_kernel.py``), not their rule.

The kernel registry (``lazytriton.kernels.get``) reads them from here; ``fused`` holds what the kernels run
(tiles, shared memory, grids) and builds their variants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytriton.kernels import KernelSpec, specialised_warps

if TYPE_CHECKING:
    from lazytriton.variant import Variant

NAME = "flash_bwd_fused_gluon"
PREP = "flash_bwd_prep"
MODULE = "lazytriton.kernels.flash_bwd.fused_kernel"


def _strides(*tensors: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"stride_{t}{d}", "i32") for t in tensors for d in ("b", "h", "s"))


_LSE_STRIDES = (("stride_lb", "i32"), ("stride_lh", "i32"))
_POINTERS = (("Q", "*{dtype}"), ("K", "*{dtype}"), ("V", "*{dtype}"), ("DO", "*{dtype}"), ("Lse", "*fp32"),
             ("Delta", "*fp32"), ("DK", "*{dtype}"), ("DV", "*{dtype}"), ("DQA", "*fp32"))
_DATA_STRIDES = _strides("q", "k", "v", "do", "dk", "dv")
# The worker partitions of fused_kernel's ``gl.warp_specialize`` (both programs, narrow and wide): the second
# consumer warpgroup and the producer warp; the first consumer warpgroup is the default partition (num_warps, 4).
WORKER_WARPS = (4, 1)


def warps(variant: Variant) -> int:
    """The warps an entry of ``variant`` launches: num_warps and ``WORKER_WARPS`` (``specialised_warps``: 12)."""
    return specialised_warps(int(variant.get("num_warps")), WORKER_WARPS)


FLASH_BWD_FUSED_GLUON = KernelSpec(
    name=NAME,
    module=MODULE,
    function="flash_bwd_fused_gluon_kernel",
    params=(*_POINTERS, *_DATA_STRIDES, *_LSE_STRIDES, ("group_size", "i32"), ("heads_q", "i32"),
            ("seqlen_q", "i32"), ("seqlen_k", "i32"), ("head_dim", "i32"), ("causal_offset", "i32"),
            ("sm_scale", "fp32")),
    constexprs=("BLOCK_M", "BLOCK_D", "CAUSAL", "PREFETCH", "BLOCK_D2"),
    # TMA needs them 16-byte aligned (the rule refuses the rest). The seqlens are multiples of the tiles (64 or
    # more), so are the causal offset (their difference) and lse's and delta's strides (seqlen_q and heads x
    # seqlen_q: the binding passes both contiguous). Marked, the lse and delta rows load as vectors: without the
    # strides and the offset marked, the H200 probe (experiments/probe_fused_served.py) ran 5-13% slower.
    aligned_params=tuple(p for p, _ in _POINTERS) + tuple(s for s, _ in _DATA_STRIDES),
    seq_aligned_params=("seqlen_q", "seqlen_k", "causal_offset", *(s for s, _ in _LSE_STRIDES)),
    # kv_tile, query_steps, tma_load; descriptors, copy_in
    helpers=("lazytriton.kernels.flash_bwd.gluon_kernel", "lazytriton.kernels.gluon_tma"),
    # ``reason`` takes multiples of 8 only: marked, dK's and dV's masked stores (fused_kernel._store_tile) go out
    # 16 bytes a thread, as they were measured to (unmarked they were 2-byte stores: the JIT probes mark every
    # multiple of 16 themselves, the served kernel did not, 12-02)
    eight_params=("head_dim",),
    warps=warps,  # warp-specialised: two consumer warpgroups and the producer warp
)

_PREP_STRIDES = _strides("o", "do")
FLASH_BWD_PREP = KernelSpec(
    name=PREP,
    module=MODULE,
    function="flash_bwd_prep_kernel",
    params=(("Out", "*{dtype}"), ("DO", "*{dtype}"), ("Delta", "*fp32"), ("DQA", "*fp32"), *_PREP_STRIDES,
            *_LSE_STRIDES, ("heads_q", "i32"), ("seqlen_q", "i32"), ("head_dim", "i32")),
    constexprs=("BLOCK_M", "BLOCK_D"),
    aligned_params=("Out", "DO", "Delta", "DQA") + tuple(s for s, _ in _PREP_STRIDES),
    eight_params=("head_dim",),  # launched in the fused plan only: O's and dO's masked loads 16 bytes wide
)
