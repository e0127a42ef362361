"""``flash_bwd_dkdv_gluon``: the backward's dK/dV kernel written in Gluon (``gluon_kernel.py``), and its rule.

A kernel of its own, as ``flash_fwd_gluon`` is for the forward (its module
docstring says why not a flag): its own source fingerprint, so no
``flash_bwd_dkdv`` key changes, and ``flash_bwd_dkdv``'s host ABI as it is:
the same parameters (``FLASH_BWD_DKDV.params``: ``binding.pack``'s dK/dV
arguments and the C launcher's layout hold), the same grid (key blocks x
key/value heads x batch, BLOCK_N from the variant), the same outputs. The
backward launches it in flash_bwd_dkdv's place, after ``flash_bwd_dq`` (which
writes delta). It is in no family: an alternative to a kernel, not a launch.

``reason`` is the rule, pure: None when the kernel computes a call exactly,
else why not. Dispatch serves the kernel for the rows of
``flash_bwd.dispatch.BWD_GLUON_TABLE`` (the H200 probe's winners over flash_bwd_dkdv)
to calls whose memo key carries ``binding.GLUON_TAIL`` (the tiles divide the
seqlens, and the seqlens reach the row's minimum). Its source compiles for
sm_90 with Triton 3.6.0 and 3.9.0 alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytriton.kernels.flash_bwd.gluon_spec import FLASH_BWD_DKDV_GLUON as FLASH_BWD_DKDV_GLUON  # re-exported
from lazytriton.kernels.flash_bwd.gluon_spec import NAME

if TYPE_CHECKING:  # lazytriton.variant imports this package: import it where it is used
    from lazytriton.variant import Variant

TARGETS = ("sm_90",)  # wgmma and TMA: Hopper's
DTYPES = ("fp16", "bf16")
# Head dim 256 would hold two 64 x 256 float32 accumulators a warpgroup: 256 registers a thread for them alone.
HEAD_DIMS = (64, 128)
# Every (BLOCK_N held keys, BLOCK_M streamed queries, num_warps) the kernel takes: BLOCK_N = 16 x
# num_warps (each warp owns 16 key rows of a wgmma), BLOCK_M 32, 64 or 128 (the N of the S^T product).
CONFIGS = ((64, 64, 4), (128, 64, 8), (128, 32, 8), (64, 32, 4), (128, 128, 8), (64, 128, 4))
STAGES = 2  # the kernel's Q/dO ring (gluon_kernel.STAGES)
SM90_SHARED = 232448  # as flash_fwd_gluon: sm_90's opt-in shared memory for one CTA
SHARED_SLACK = 1024  # mbarriers and alignment


def shared_bytes(head_dim: int, block_n: int, block_m: int) -> int:
    """The shared memory the kernel allocates, within ``SHARED_SLACK``: K and V held, STAGES Q and dO tiles."""
    return 2 * head_dim * (2 * block_n + 2 * STAGES * block_m)


def configs(head_dim: int) -> tuple[tuple[int, int, int], ...]:
    """``CONFIGS`` whose buffers fit sm_90's shared memory at ``head_dim``."""
    return tuple(t for t in CONFIGS if shared_bytes(head_dim, t[0], t[1]) + SHARED_SLACK <= SM90_SHARED)


def reason(target: str, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool, seqlen_q: int,
           seqlen_k: int, block_n: int, block_m: int, features: bool = False) -> str | None:
    """None if ``flash_bwd_dkdv_gluon`` with tiles (block_n keys, block_m queries) computes this call exactly.

    ``causal``: "none", "top_left" or "bottom_right". ``features``: the call
    has a window, softcap, ALiBi, bias, dropout, packed sequences, split tiles
    or a head_dim_v, which this kernel does not implement.
    """
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} is not one of {HEAD_DIMS}"
    return common_reason(target, dtype, causal, aligned, index64, seqlen_q, seqlen_k, block_n, block_m, features)


def common_reason(target: str, dtype: str, causal: str, aligned: bool, index64: bool, seqlen_q: int, seqlen_k: int,
                  block_n: int, block_m: int, features: bool = False) -> str | None:
    """``reason`` without the head dim: what Hopper's TMA-fed backward kernels (this one, the fused one) all need."""
    if target not in TARGETS:
        return f"target {target} is not one of {TARGETS} (wgmma)"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of {DTYPES}"
    if not aligned or index64:
        return "TMA needs 16-byte aligned pointers and strides, and the kernel 32-bit offsets"
    if features:
        return "window, softcap, ALiBi, bias, dropout, varlen, split tiles and head_dim_v are not implemented"
    if seqlen_q % block_m or seqlen_k % block_n or seqlen_q == 0 or seqlen_k == 0:
        return f"seqlens ({seqlen_q}, {seqlen_k}) must be positive multiples of the tiles ({block_m}, {block_n})"
    if causal == "bottom_right" and seqlen_q > seqlen_k:
        return "bottom-right causal with seqlen_q > seqlen_k leaves rows without keys"
    return None


def variant(target: str, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool, seqlen_q: int,
            seqlen_k: int, tiles: tuple[int, int, int] = (64, 64, 4), overlap: bool = True,
            features: bool = False) -> Variant | None:
    """The ``flash_bwd_dkdv_gluon`` variant for a call, or None where ``reason`` refuses it (pure).

    ``tiles``: (BLOCK_N, BLOCK_M, num_warps), one of ``configs(head_dim)``
    (else a ValueError naming them); ``overlap``: the tuned field OVERLAP.
    Its functional fields are flash_bwd_dkdv's for a plain aligned call
    (ALIGN16, BLOCK_D, CAUSAL, EVEN_D, INDEX64), so ``cache explain`` reads
    both alike; num_stages records the kernel's ring depth.
    """
    from lazytriton.variant import Variant, pairs

    allowed = configs(head_dim) if head_dim in HEAD_DIMS else CONFIGS
    if tuple(tiles) not in allowed:
        raise ValueError(f"tiles must be one of {allowed} (BLOCK_N, BLOCK_M, num_warps) at head dim {head_dim}, "
                         f"got {tiles!r}")
    block_n, block_m, num_warps = tiles
    if reason(target, dtype, head_dim, causal, aligned, index64, seqlen_q, seqlen_k, block_n, block_m, features):
        return None
    functional = {"ALIGN16": True, "BLOCK_D": head_dim, "CAUSAL": causal != "none", "EVEN_D": True, "INDEX64": False}
    tuned = {"BLOCK_M": block_m, "BLOCK_N": block_n, "OVERLAP": bool(overlap)}
    return Variant(NAME, target, dtype, pairs(functional), pairs(tuned),
                   pairs({"num_stages": STAGES, "num_warps": num_warps}))
