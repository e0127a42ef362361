"""``flash_bwd_fused_gluon`` and ``flash_bwd_prep``: the fused backward (``fused_kernel.py``), and its rule.

Two kernels of their own (own source fingerprint, own ABI), in no family:
where dispatch's ``BWD_FUSED_TABLE`` has a row for a plain call
(``flash_bwd.dispatch.flash_bwd_fused_fits``; the backward's memo key then ends in
``binding.FUSED_TAIL``), the binding launches ``flash_bwd_prep`` (delta and
dQ's zeroed float32 accumulator), then ``flash_bwd_fused_gluon`` (dK, dV and
dQ's sums), then casts the accumulator into dq, in place of flash_bwd's two
kernels. ``reason`` is the rule, pure: None when the fused kernel computes a
call exactly, else why not. Its source compiles for sm_90 with Triton 3.6.0
and 3.9.0 alike; the prep kernel is plain Triton (any target).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytriton import geometry
from lazytriton.kernels.flash_bwd.fused_spec import FLASH_BWD_FUSED_GLUON as FLASH_BWD_FUSED_GLUON  # re-exported
from lazytriton.kernels.flash_bwd.fused_spec import FLASH_BWD_PREP as FLASH_BWD_PREP  # re-exported
from lazytriton.kernels.flash_bwd.fused_spec import MODULE as MODULE  # re-exported
from lazytriton.kernels.flash_bwd.fused_spec import NAME, PREP
from lazytriton.kernels.flash_bwd.fused_spec import WORKER_WARPS as WORKER_WARPS  # re-exported
from lazytriton.kernels.flash_bwd.fused_spec import warps as warps  # re-exported

if TYPE_CHECKING:  # lazytriton.variant imports this package: import it where it is used
    from lazytriton.variant import Variant

# Targets and dtypes are flash_bwd_dkdv_gluon's (its rule checks them). Head dims 64 and 128: two float32
# accumulators of 64 keys x head dim a consumer thread, 128 registers at 128 of the 240 it has. Head dim 256:
# the program holds 64 keys and each warpgroup half of dK's and dV's columns (fused_kernel's wide program).
HEAD_DIMS = (64, 128, 256)  # the tiles' widths
# Other head dims run in their padded tile (``tile``): every descriptor's extent is the head dim, so TMA reads
# zeros past it (nothing added to S, dP or the products), the dK and dV stores stop at it, and dQ's float32
# accumulator is a tile wide (the binding copies its first head_dim columns). A multiple of 8 (TMA's 16-byte
# rows) over 32: 40-64 in 64's tile, 72-128 in 128's, 136-256 in 256's.
MIN_HEAD_DIM, MAX_HEAD_DIM = 40, 256
# Head dims that two chunks hold in less than the padded tile (``chunks``: 80 = 64 + 16, 96 = 64 + 32, 160 =
# 128 + 32, 192 = 128 + 64) run split instead, each chunk in tiles of its own (fused_kernel's BLOCK_D2): no padded
# column is multiplied.
BLOCK_N = 128  # keys a program holds at head dims 64 and 128 (fused_kernel.BLOCK_N: two warpgroups of 64)
WIDE_BLOCK_N = 64  # at head dim 256 (fused_kernel.WIDE_KEYS)
BLOCK_MS = (64, 128)  # query rows a step (the N of the S^T product; the M of S at head dim 256)
STAGES = 2  # the Q/dO ring (fused_kernel.STAGES); at head dim 256 Q's alone, dO has one buffer
WIDE_DQ_COLS = 64  # fused_kernel.WIDE_DQ_COLS
PREP_BLOCK_M = 64
SM90_SHARED = 232448  # sm_90's opt-in shared memory for one CTA
SHARED_SLACK = 1024  # mbarriers and alignment


def tile(head_dim: int) -> int:
    """The padded head dim of ``head_dim``: dQ's accumulator rows, and the tile a head dim not in ``chunks`` runs in."""
    return geometry.padded_head_dim(head_dim)


def chunks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D2): the fused kernel's head-dim tiles at ``head_dim`` (BLOCK_D2 0: one tile, ``tile``'s).

    A head dim that two chunks hold in less than its padded tile, the first
    one of the kernel's tiles (``geometry.split_head_dim``: 80 = 64 + 16,
    96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64; 72 = 64 + 16 and 176 =
    128 + 64 with the second zero-filled past the head dim) runs split; the
    rest (224, 40) in its padded tile.
    """
    split = geometry.split_head_dim(head_dim)
    if split is None or split[0] not in HEAD_DIMS:
        return tile(head_dim), 0
    return split


def block_n(head_dim: int) -> int:
    """Keys a program of the fused kernel holds at ``head_dim``: its grid's and seqlen_k's unit."""
    return WIDE_BLOCK_N if head_dim > 128 else BLOCK_N


def shared_bytes(head_dim: int, block_m: int) -> int:
    """Shared memory the fused kernel allocates, within ``SHARED_SLACK``: K and V, the ring, dS^T, dQ tiles."""
    block_d, block_d2 = chunks(head_dim)
    head_dim = block_d + block_d2
    if head_dim > 128:  # K, V; Q's ring and one dO tile; P^T and dS^T; a dQ tile a warpgroup (and one a chunk)
        return 2 * (2 * WIDE_BLOCK_N * head_dim + (STAGES + 1) * block_m * head_dim + 2 * WIDE_BLOCK_N * block_m) \
            + 4 * 2 * block_m * (WIDE_DQ_COLS + block_d2 // 2)
    # K, V; the ring's Q and dO tiles and lse and delta rows; two dS^T buffers; a dQ tile a warpgroup (a chunk)
    return 2 * (2 * BLOCK_N * head_dim + 2 * STAGES * block_m * head_dim + 2 * BLOCK_N * block_m) \
        + 4 * 2 * STAGES * block_m + 4 * 2 * block_m * head_dim // 2


def reason(target: str, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool, seqlen_q: int,
           seqlen_k: int, block_m: int, features: bool = False) -> str | None:
    """None if ``flash_bwd_fused_gluon`` with ``block_m`` query rows a step computes this call exactly.

    ``causal``: "none", "top_left" or "bottom_right". ``features``: the call
    has a window, softcap, ALiBi, bias, dropout, packed sequences or a
    head_dim_v, which this kernel does not implement (a head dim's split
    chunks it takes by itself: ``chunks``).
    """
    from lazytriton.kernels.flash_bwd import gluon

    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM or head_dim % 8:
        return f"head dim {head_dim} is not a multiple of 8 in {MIN_HEAD_DIM}..{MAX_HEAD_DIM} (TMA's 16-byte rows)"
    if block_m not in BLOCK_MS:
        return f"BLOCK_M {block_m} is not one of {BLOCK_MS}"
    if shared_bytes(head_dim, block_m) + SHARED_SLACK > SM90_SHARED:
        return f"BLOCK_M {block_m} at head dim {head_dim} needs more than sm_90's shared memory"
    # The rest is flash_bwd_dkdv_gluon's rule (same target, dtypes, TMA, features, whole tiles, causal offset).
    return gluon.common_reason(target, dtype, causal, aligned, index64, seqlen_q, seqlen_k, block_n(head_dim),
                               block_m, features)


def variants(target: str, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool, seqlen_q: int,
             seqlen_k: int, block_m: int = 64, prefetch: bool = False,
             features: bool = False) -> tuple[Variant, Variant] | None:
    """The (flash_bwd_prep, flash_bwd_fused_gluon) variants for a call, or None where ``reason`` refuses (pure).

    ``block_m`` and ``prefetch`` are the fused kernel's tuned fields (BLOCK_M,
    PREFETCH). Its functional fields are flash_bwd_dkdv's for a plain aligned
    call (ALIGN16, BLOCK_D, CAUSAL, INDEX64, SEQ16), so ``cache explain``
    reads them alike; num_stages records its ring's depth. A padded head dim
    (224) has its tile's variants (256's), a split one (96, 192) its chunks
    (``chunks``: BLOCK_D2 written as flash_bwd_dkdv's): the head dim is an
    argument. The prep kernel's BLOCK_D is ``tile``'s (dQ's accumulator rows).
    """
    from lazytriton.variant import Variant, pairs

    if reason(target, dtype, head_dim, causal, aligned, index64, seqlen_q, seqlen_k, block_m, features):
        return None
    block_d, block_d2 = chunks(head_dim)
    functional = {"ALIGN16": True, "BLOCK_D": block_d, "CAUSAL": causal != "none", "INDEX64": False,
                  "SEQ16": True}
    if block_d2:  # written only when set, as flash_bwd_dkdv's split variants
        functional["BLOCK_D2"] = block_d2
    fused = Variant(NAME, target, dtype, pairs(functional), pairs({"BLOCK_M": block_m, "PREFETCH": bool(prefetch)}),
                    pairs({"num_stages": STAGES, "num_warps": 4}))
    prep = Variant(PREP, target, dtype, pairs({"ALIGN16": True, "BLOCK_D": tile(head_dim), "INDEX64": False}),
                   pairs({"BLOCK_M": PREP_BLOCK_M}), pairs({"num_stages": 1, "num_warps": 4}))
    return prep, fused


def grids(batch: int, heads_q: int, heads_k: int, seqlen_q: int, seqlen_k: int, head_dim: int,
          block_m: int = PREP_BLOCK_M) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(prep, fused) grids: query blocks x query heads x batch, then ``block_n`` keys x key/value heads x batch."""
    return (((seqlen_q + block_m - 1) // block_m, heads_q, batch), (seqlen_k // block_n(head_dim), heads_k, batch))
