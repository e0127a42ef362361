"""``flash_fwd_gluon``: the Hopper forward written in Gluon (``gluon_kernel.py``), and when it may serve a call.

Why a kernel of its own and not a ``GLUON=true`` flag on ``flash_fwd``: the
compiler maps one kernel name to one source function, and a kernel's key
covers the fingerprint of its one source file. A flag would have had to
switch source modules inside ``flash_fwd`` and fold a second file into its
fingerprint, which changes every existing ``flash_fwd`` key (every image
built so far would miss). A kernel of its own keeps those keys, gets its own
fingerprint, and still shares all of ``flash_fwd``'s host ABI: the same
parameters (``FLASH_FWD.params``, so ``binding.pack`` packs its arguments and
the C launcher's layout holds), the same grid (query blocks x heads x batch,
BLOCK_M from the variant), the same outputs (out like q, lse (B, Hq, Sq)
float32). The binding launches it as it launches flash_fwd
(``binding.launch_gpu(..., variant=...)``). It is not in ``FAMILIES``
(which lists the kernels each call launches, in order): it is an
alternative to flash_fwd, not a second launch.

``reason`` is the rule, pure: None when the kernel can serve a call, else
why not. Dispatch asks it (``flash_fwd.dispatch.flash_fwd_gluon_variant``), and serves
the kernel by default for the (dtype, head dim, causal) rows of
``flash_fwd.dispatch.GLUON_TABLE`` (the H200 probe's winners over flash_fwd) to calls
whose memo key carries ``binding.GLUON_TAIL`` (the tiles divide the seqlens).
Past ``flash_fwd.dispatch.GLUON_WIDE``'s bounds it serves the wide tiles
(``WIDE_CONFIGS``: three consumer warpgroups) instead of the table's row.
Its source compiles for sm_90 with Triton 3.6.0 and 3.9.0 (the two names
Triton renamed between them are looked up once at import), so no variant
here needs one Triton version in particular.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytriton import geometry
from lazytriton.kernels.flash_fwd.gluon_spec import FLASH_FWD_GLUON as FLASH_FWD_GLUON  # re-exported
from lazytriton.kernels.flash_fwd.gluon_spec import NAME
from lazytriton.kernels.flash_fwd.gluon_spec import warps as warps  # re-exported

if TYPE_CHECKING:  # lazytriton.variant imports this package: import it where it is used
    from lazytriton.variant import Variant

TARGETS = ("sm_90",)  # wgmma and TMA: Hopper's; sm_100 has neither wgmma nor this kernel's layouts
DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 128, 256)  # the tiles' own widths (the probe's default head dims)
# Every head dim from 16 to 256 that TMA can address (a multiple of 8: 16-byte rows) runs, in the tiles of
# ``chunks``: a power of two in one tile; one that two power-of-two chunks hold in less than its padded tile
# (geometry.split_head_dim: 80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64) in two, with the
# wgmmas of each product issued per chunk, so no work is padded; the rest (224, say) in its padded tile, the
# descriptors' extent being the head dim (TMA reads zeros past it and the output store stops at it).
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# (head dim) -> (BLOCK_M, BLOCK_N, num_warps): FlashAttention-3's forward tiles on H100 (128 x 128 at
# head dims 64 and 128, two consumer warpgroups of 64 rows; 128 x 64 at head dim 256, where a 128-key
# tile would not fit shared memory beside Q): what ``variant`` takes without tiles.
# What dispatch serves is flash_fwd.dispatch.GLUON_TABLE's (measured on the H200 by experiments/probe_gluon.py,
# which sweeps ``configs``).
DEFAULT_TILES = {64: (128, 128, 8), 128: (128, 128, 8), 256: (128, 64, 8)}  # other head dims: their padded tile's
# Every (BLOCK_M, BLOCK_N, num_warps) the kernel takes: BLOCK_M = 16 x num_warps (each warp of a
# warpgroup owns 16 rows of a wgmma), BLOCK_N 64 or 128 (one wgmma instruction spans the tile).
# ``configs(head_dim)`` keeps those whose buffers fit shared memory at that head dim. Every tiling that
# fits, at every head dim, causal or not, compiles for sm_90a under Triton 3.6 and 3.9 without a spill
# (ptxas -v, 2026-12-01): at most 247 registers (hd256 128 x 64 x 8 causal) of 255 without warp
# specialisation; with it 168 at launch, then 240 for each consumer (setmaxnreg).
CONFIGS = ((128, 128, 8), (128, 64, 8), (64, 128, 4), (64, 64, 4))
# Ping-pong (PINGPONG=true, which implies the producer warp): two consumer warpgroups of num_warps
# each own half of BLOCK_M (BLOCK_M = 2 x 16 x num_warps) and take turns to issue their wgmmas; the
# entry runs 2 x num_warps + 4 warps. FlashAttention-3's forward schedule on H100.
PINGPONG_CONFIGS = ((128, 128, 4), (128, 64, 4))
# The wide tiles (FlashAttention-3's forward at head dim 64 on H100: 192 query rows): three consumer
# warpgroups of num_warps (4) each own a third of BLOCK_M = 3 x 16 x num_warps and run without turns, beside
# the producer warp (PRODUCER, not PINGPONG, one query tile a program); the entry runs 16 warps, 160
# registers a consumer thread. 192 does not divide the usual seqlens, so the tiles are laid out from seqlen_q
# down, which must be a multiple of one warpgroup's rows (``whole_rows``): the last program may start before row
# 0, and a warpgroup with no rows there only releases its buffers.
WIDE_CONFIGS = ((192, 128, 4), (192, 64, 4))
# Query tiles a program may walk (``variant``'s q_tiles; BLOCK_TILES in the variant when above 1).
Q_TILES = (1, 2, 4, 8)
# sm_90's shared memory for one CTA (227 KiB, cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200), and
# what the kernel takes beside its Q, K and V buffers (mbarriers and alignment: 200-304 bytes measured
# under Triton 3.6 and 3.9, rounded up).
SM90_SHARED = 232448
SHARED_SLACK = 1024


def chunks(head_dim: int) -> tuple[int, int, bool]:
    """(BLOCK_D, BLOCK_D2, EVEN_D): the kernel's head-dim tiles at ``head_dim`` (BLOCK_D2 0: one tile).

    A power of two fills one tile; a head dim that split tiles hold (``geometry.split_head_dim``) takes two
    chunks, the second zero-filled past the head dim where it is not whole (72 = 64 + 16); the rest its padded
    tile (EVEN_D false).
    """
    padded = geometry.padded_head_dim(head_dim)
    split = geometry.split_head_dim(head_dim)
    if head_dim == padded or split is None:
        return padded, 0, head_dim == padded
    return split[0], split[1], sum(split) == head_dim


def takes(head_dim: int) -> bool:
    """Whether the kernel runs ``head_dim`` at all: a multiple of 8 (TMA's 16-byte rows) in MIN..MAX_HEAD_DIM."""
    return MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and not head_dim % 8


def width(head_dim: int) -> int:
    """The columns the kernel's Q, K and V buffers hold a row in at ``head_dim`` (its chunks together)."""
    block_d, block_d2, _ = chunks(head_dim)
    return block_d + block_d2


def default_tiles(head_dim: int) -> tuple[int, int, int]:
    """``DEFAULT_TILES`` at ``head_dim``: its padded tile's."""
    return DEFAULT_TILES[geometry.padded_head_dim(head_dim)]


def stages(head_dim: int, block_n: int) -> int:
    """K and V buffers in the kernel's ring: 3 when a K tile is at most 16 KiB, else 2 (the kernel's own rule).

    Shared memory at 128 x 128 tiles: head dim 64, 3 stages, 112 KiB; head
    dim 128, 2 stages, 160 KiB (Triton 3.6 and 3.9 for sm_90: 114760 and
    163880 bytes); a third stage at head dim 128 would leave sm_90's 227 KiB
    no room for a second CTA. Head dim 256 at 128 x 64 tiles: 2 stages, 192
    KiB (FlashAttention-3's hdim256 choice: Q 64 KiB, each K or V stage 32 KiB).
    Split and padded head dims count their chunks' width (``width``).
    """
    return 3 if width(head_dim) * block_n <= 64 * 128 else 2


def q_buffers(head_dim: int, block_m: int, block_n: int, q_tiles: int = 1) -> int:
    """The Q buffers of ``block_m`` rows the kernel allocates (its own rule, ``QBUFS``).

    One with one query tile a program. With several, two where both fit
    beside the ring (the next tile's Q loads under this one's last steps),
    else one: the next tile's Q then loads once this tile's output went out
    through the buffer, and only its key blocks load ahead (head dim 160 at
    128 x 128, 256 at 128 x 64, 192 at 128 x 128).
    """
    if q_tiles == 1:
        return 1
    two = 2 * width(head_dim) * (2 * block_m + 2 * stages(head_dim, block_n) * block_n)
    return 2 if two + SHARED_SLACK <= SM90_SHARED else 1


def shared_bytes(head_dim: int, block_m: int, block_n: int, q_tiles: int = 1) -> int:
    """The shared memory the kernel allocates at these tiles, within ``SHARED_SLACK`` (bf16 or fp16).

    Q (BLOCK_M x D, reused for the output tile; ``q_buffers`` of them when a
    program walks ``q_tiles`` > 1 query tiles of ``block_m`` rows) and
    ``stages`` K and V buffers (BLOCK_N x D each): ``tests/test_gluon_fwd.py``
    compares it with the compiled entries' shared memory.
    """
    q = q_buffers(head_dim, block_m, block_n, q_tiles)
    return 2 * width(head_dim) * (q * block_m + 2 * stages(head_dim, block_n) * block_n)


def fits(head_dim: int, block_m: int, block_n: int, q_tiles: int = 1) -> bool:
    """Whether the kernel's buffers at these tiles fit sm_90's shared memory (``SM90_SHARED``)."""
    return shared_bytes(head_dim, block_m, block_n, q_tiles) + SHARED_SLACK <= SM90_SHARED


def configs(head_dim: int, pingpong: bool = False, q_tiles: int = 1) -> tuple[tuple[int, int, int], ...]:
    """The tiles the kernel takes at ``head_dim``: ``CONFIGS`` (or ``PINGPONG_CONFIGS``) whose buffers fit.

    Head dim 256 keeps BLOCK_N 64 only: a 128-key K or V stage there is
    64 KiB, and Q plus two stages of each would need 320 KiB. ``q_tiles`` > 1
    (several query tiles a program, ping-pong only) doubles Q's buffer where
    that fits (``q_buffers``).
    """
    if q_tiles > 1 and not pingpong:
        return ()
    return tuple(t for t in (PINGPONG_CONFIGS if pingpong else CONFIGS) if fits(head_dim, t[0], t[1], q_tiles))


def wide_configs(head_dim: int) -> tuple[tuple[int, int, int], ...]:
    """``WIDE_CONFIGS`` whose buffers fit at ``head_dim`` and whose consumers keep to 160 registers a thread.

    A warpgroup's O holds width / 2 fp32 registers a thread, its scores and
    the two P tiles BLOCK_N together: at most 160, and a width of at most
    160 (ptxas 12.8 of Triton 3.6 for sm_90a, bf16: 64 / 128 and 160 / 64
    spill nothing; 80 / 128 spills 64 bytes, 96 / 128 208, 192 / 64 280).
    """
    return tuple(t for t in WIDE_CONFIGS if fits(head_dim, t[0], t[1])
                 and width(head_dim) <= 160 and width(head_dim) // 2 + t[1] <= 160)


def whole_rows(block_m: int, q_tiles: int = 1) -> int:
    """The rows seqlen_q must be a multiple of at these tiles: a program's, or one warpgroup's for the wide tiles."""
    return block_m // 3 if block_m in {t[0] for t in WIDE_CONFIGS} else block_m * q_tiles


def reason(target: str, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool, seqlen_q: int,
           seqlen_k: int, block_m: int, block_n: int, features: bool = False, scale: float = 1.0,
           q_tiles: int = 1) -> str | None:
    """None if ``flash_fwd_gluon`` with tiles (block_m, block_n) computes this call exactly, else why not (pure).

    ``causal``: "none", "top_left" or "bottom_right". ``features``: the call
    has a window, softcap, ALiBi, bias, dropout or packed sequences, which
    this kernel does not implement. ``scale``: the softmax scale, which must
    be positive (the kernel scales each row's max once instead of every score).
    ``q_tiles``: query tiles a program walks (its rows: q_tiles x block_m).
    """
    if target not in TARGETS:
        return f"target {target} is not one of {TARGETS} (wgmma)"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of {DTYPES}"
    if not takes(head_dim):
        return f"head dim {head_dim} is not a multiple of 8 in {MIN_HEAD_DIM}..{MAX_HEAD_DIM} (TMA's 16-byte rows)"
    if not aligned or index64:
        return "TMA needs 16-byte aligned pointers and strides, and the kernel 32-bit offsets"
    if features:
        return "window, softcap, ALiBi, bias, dropout and varlen are not implemented"
    if not fits(head_dim, block_m, block_n, q_tiles):
        return (f"tiles ({block_m}, {block_n}) at head dim {head_dim} need "
                f"{shared_bytes(head_dim, block_m, block_n, q_tiles)} bytes of shared memory, over sm_90's "
                f"{SM90_SHARED - SHARED_SLACK} for them")
    rows = whole_rows(block_m, q_tiles)
    if seqlen_q % rows or seqlen_k % block_n or seqlen_q == 0 or seqlen_k == 0:
        return f"seqlens ({seqlen_q}, {seqlen_k}) must be positive multiples of the tiles ({rows}, {block_n})"
    if not scale > 0.0:
        return f"softmax scale {scale} is not positive"
    if causal == "bottom_right" and seqlen_q > seqlen_k:
        return "bottom-right causal with seqlen_q > seqlen_k leaves rows without keys"
    return None


def variant(target: str, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool, seqlen_q: int,
            seqlen_k: int, features: bool = False, tiles: tuple[int, int, int] | None = None,
            scale: float = 1.0, producer: bool = False, pingpong: bool = False, q_tiles: int = 1,
            sinks: bool = False) -> Variant | None:
    """The ``flash_fwd_gluon`` variant serving a call, or None where ``reason`` refuses it (pure).

    ``tiles``: (BLOCK_M, BLOCK_N, num_warps), one of ``configs(head_dim)``
    (default ``DEFAULT_TILES``); a tiling outside ``CONFIGS``, or over
    shared memory at this head dim, is a ValueError. Its functional fields
    are flash_fwd's for the same call (ALIGN16, BLOCK_D, CAUSAL, EVEN_D,
    INDEX64, and BLOCK_D2 for a split head dim: ``chunks``), so ``lazytriton cache
    explain`` reads both alike; num_stages records the kernel's own ring
    depth (``stages``), which Gluon does not take from the option.
    ``producer``: one extra warp issues every K/V load (warp specialisation,
    tuned field PRODUCER); the entry then runs num_warps + 4 warps (Triton
    pads the one-warp partition to a warpgroup in the launch metadata).
    ``pingpong``: FlashAttention-3's ping-pong of two consumer warpgroups
    (tuned field PINGPONG, with PRODUCER); ``tiles`` one of
    ``configs(head_dim, pingpong=True)`` then (default its first).
    ``producer`` without ``pingpong`` also takes ``wide_configs(head_dim)``
    (three consumer warpgroups; seqlen_q a multiple of 64: ``whole_rows``).
    ``q_tiles`` (1, 2, 4 or 8; > 1 with ``pingpong`` only): each program walks
    that many query tiles of BLOCK_M rows, one after another (the variant's
    BLOCK_M, the grid's tile, is then q_tiles x BLOCK_M; BLOCK_TILES says how
    many): the descriptors are made once a program, and the producer warp
    loads the next tile's Q and key blocks under this tile's last steps and
    epilogue. What short sequences gain (``flash_fwd.dispatch.GLUON_Q_TILES`` picks the count).
    ``sinks``: attention sinks (SINKS=true, written only when set), which the
    kernel carries in its epilogue.
    """
    from lazytriton.variant import Variant, pairs

    if q_tiles not in Q_TILES or (q_tiles > 1 and not pingpong):
        raise ValueError(f"q_tiles must be one of {Q_TILES} (above 1 with pingpong only), got {q_tiles!r}")
    known = takes(head_dim)
    allowed = configs(head_dim, pingpong) if known else PINGPONG_CONFIGS if pingpong else CONFIGS
    if producer and not pingpong and q_tiles == 1:
        allowed += wide_configs(head_dim) if known else WIDE_CONFIGS
    if tiles is None:
        tiles = allowed[0] if pingpong or not known else default_tiles(head_dim)
    if tuple(tiles) not in allowed:
        raise ValueError(f"tiles must be one of {allowed} (BLOCK_M, BLOCK_N, num_warps) at head dim {head_dim}"
                         f"{' with pingpong' if pingpong else ''}, got {tiles!r}")
    block_m, block_n, num_warps = tiles
    if reason(target, dtype, head_dim, causal, aligned, index64, seqlen_q, seqlen_k, block_m, block_n, features,
              scale, q_tiles):
        return None
    block_d, block_d2, even_d = chunks(head_dim)
    functional = {"ALIGN16": True, "BLOCK_D": block_d, "CAUSAL": causal != "none", "EVEN_D": even_d, "INDEX64": False}
    if block_d2:  # absent: one tile, the strings of the variants before split tiles
        functional["BLOCK_D2"] = block_d2
    if sinks:
        functional["SINKS"] = True
    tuned = {"BLOCK_M": block_m * q_tiles, "BLOCK_N": block_n, "PINGPONG": bool(pingpong),
             "PRODUCER": bool(producer or pingpong)}
    if q_tiles > 1:  # absent: one tile a program, the strings of the variants before it
        tuned["BLOCK_TILES"] = q_tiles
    return Variant(NAME, target, dtype, pairs(functional), pairs(tuned),
                   pairs({"num_stages": stages(head_dim, block_n), "num_warps": num_warps}))
