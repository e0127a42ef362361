"""flash_fwd's choices: its default tiles, its tuning rows, the TMA rule, and when the Gluon forward serves.

``variant`` gives the ``flash_fwd`` variant of a call (the attention kernels' common fields from
``kernels.attention``, plus TMA); ``flash_fwd_gluon_default_variant`` the ``flash_fwd_gluon`` one where its
table has a row the call fits. Pure, given the tuning table; ``cache explain``, prewarm and tune ask the same
functions the binding does.
"""

from __future__ import annotations

import functools
import math

from lazytriton import tuning
from lazytriton.geometry import causal_mode, padded_head_dim, value_pieces
from lazytriton.kernels import attention
from lazytriton.kernels.flash_fwd import gluon
from lazytriton.kernels.flash_fwd.fp8_spec import FP8_DTYPES, fp8_default_config, fp8_refusal
from lazytriton.kernels.flash_fwd.fp8_spec import NAME as FP8_NAME
from lazytriton.kernels.request import Request
from lazytriton.record import replace
from lazytriton.target import Target
from lazytriton.tiles import SMALL_SHARED_CUDA, Config, seqlen_class
from lazytriton.tma import require_tma, tma_possible
from lazytriton.variant import Variant


def default_config(target: Target, dtype: str, head_dim: int, seqlen_q: int, causal: bool = False) -> Config:
    """A sane config when the tuning table has no row (it never errors).

    sm_90 choices from a sweep of this kernel through Triton's JIT on the H200
    (Triton 3.6, bf16, seqlen 4k, hidden 2048; bench_flash_fwd.py --sweep,
    2026-11-30), TFLOP/s of the winner against the runner-up:
    head dim 64: 128/64, 8 warps, 4 stages (388 full, 340 causal; 4 warps 373/312);
    head dim 128 full: 128/128, 8 warps, 3 stages (449; 128/64/8/3 444);
    head dim 128 causal: 64/64, 4 warps, 3 stages (411; 128/64/8/4 401).
    sm_80 has 163 KiB of shared memory, not 227: 128/128 x 3 stages does not
    fit at head dim 128, so it keeps 128/64. fp32 tiles are halved (twice the
    bytes, and IEEE dots use no tensor cores); head dim 256 tiles are halved
    to fit sm_80. AMD values are FlashAttention-on-ROCm's usual starting point
    (untuned here: no AMD GPU).
    """
    if dtype in FP8_DTYPES:
        return fp8_default_config(target, head_dim, seqlen_q)
    block_m = seqlen_class(seqlen_q)
    if target.backend == "hip":
        cfg = Config(128, 64, 4, 2, waves_per_eu=2)
    elif head_dim <= 64:
        cfg = Config(128, 64, 8, 4)
    elif target.capability in SMALL_SHARED_CUDA:
        cfg = Config(64, 64, 4, 2)
    elif causal:
        cfg = Config(64, 64, 4, 3)
    elif target.capability >= 90:
        cfg = Config(128, 128, 8, 3)
    else:
        cfg = Config(128, 64, 8, 3)
    if dtype == "fp32":
        cfg = Config(64, 32, 4, 2, cfg.waves_per_eu)
    if head_dim == 256:
        cfg = Config(64, 32 if dtype != "fp32" else 16, 4, 2 if dtype != "fp32" else 1, cfg.waves_per_eu)
    if block_m < cfg.block_m:
        cfg = Config(block_m, min(cfg.block_n, 64), 4, cfg.num_stages, cfg.waves_per_eu)
    return cfg


def flash_fwd_config(target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int,
                     table: tuning.Table | None = None, split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """The config for a call from the tuning table, else ``default_config``; and the row used (or None).

    ``split``: whether the variant runs in split tiles (None: as a call of
    this head dim does by default); ``attention.table_config`` says which rows it reads.
    """
    return attention.table_config("flash_fwd", target, dtype, head_dim, causal, seqlen_q, seqlen_k, table, split,
                                  lambda padded: default_config(target, dtype, padded, seqlen_q, causal))


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int,
           table: tuning.Table | None = None, paged: bool = False,
           split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """``kernels.dispatch.kernel_config`` for this family: ``flash_fwd_config`` (``paged`` does not apply)."""
    return flash_fwd_config(target, dtype, head_dim, causal, seqlen_q, seqlen_k, table, split)

# TMA (tensor memory accelerator) loads for flash_fwd: sm_90 only (the one GPU
# measured: FACTS.md, host descriptors +20% over pointer loads on the H200,
# Triton 3.6), fp16/bf16 only (fp32's IEEE dots are not bound by loads), and
# only for aligned calls (a descriptor needs a 16-byte aligned base and row
# stride). Off by default until bench_flash_fwd.py / probe_tma.py measure this
# kernel's device-side descriptors on the H200: a caller opts in with tma=True.
TMA_TARGETS = ("sm_90",)
TMA_DTYPES = ("fp16", "bf16")
TMA_BY_DEFAULT = False


def flash_fwd_tma(target: Target, dtype: str, aligned: bool, tma: bool | None = None, even_d: bool = True) -> bool:
    """Whether flash_fwd reads through TMA descriptors (pure): ``tma`` None decides by the rule above.

    ``tma=True`` where descriptors cannot work (unaligned, a target without
    TMA, or a head dim narrower than its tile: ``even_d`` false) is a
    ValueError (``lazytriton.tma.require_tma``).
    """
    possible = tma_possible(target, aligned, even_d)
    if tma is None:
        return TMA_BY_DEFAULT and possible and str(target) in TMA_TARGETS and dtype in TMA_DTYPES
    if tma:
        require_tma(target, aligned, even_d)
    return bool(tma)


def flash_fwd_variant(target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                      seqlen_q: int, config: Config | None = None, index64: bool = False,
                      seqlen_k: int | None = None, table: tuning.Table | None = None,
                      tma: bool | None = None, window: bool = False, softcap: bool = False, alibi: bool = False,
                      bias: bool = False, dropout: bool = False, varlen: bool = False,
                      head_dim_v: int = 0, split_d: bool | None = None, seqused_q: bool = False,
                      seqused_k: bool = False, sinks: bool = False, chunk: bool = False) -> Variant:
    """The variant of ``flash_fwd`` that serves a call (pure, given the table).

    ``aligned``: every pointer 16-byte aligned and every outer stride a
    multiple of 16 (lets Triton vectorise loads). ``index64``: some tensor
    spans 2**31 elements or more, so offsets need 64-bit arithmetic. Without
    ``config``, the tuning table (``table``, else the kernel's file) decides,
    then ``default_config``. ``tma``: read through TMA descriptors (None:
    ``flash_fwd_tma`` decides from target, dtype and alignment). ``window``,
    ``softcap``: the call has a sliding window, a logit softcap; ``alibi``,
    ``bias``, ``dropout``: ALiBi slopes, an additive bias (attn_mask), dropout;
    ``varlen``: packed sequences (seqlens are then the max_seqlen_q/max_seqlen_k);
    ``head_dim_v``: v's head dim where it differs from q's and k's (0: the same);
    ``split_d``: split tiles (``variant``); ``seqused_q``, ``seqused_k``: a
    packed call with FlashAttention-3's used lengths; ``sinks``: attention sinks;
    ``chunk``: FlashAttention-3's attention_chunk (CHUNK).
    """
    request = Request(dtype, head_dim, causal, aligned, seqlen_q, seqlen_q if seqlen_k is None else seqlen_k, config,
                      index64, table, tma, window, softcap, alibi, bias, dropout, varlen=varlen,
                      head_dim_v=head_dim_v, split_d=split_d, seqused_q=seqused_q, seqused_k=seqused_k,
                      sinks=sinks, chunk=chunk)
    return variant("flash_fwd", target, request)


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """``kernels.dispatch.kernel_variant`` for flash_fwd: the attention kernels' fields, and TMA.

    ``TMA=true`` where ``flash_fwd_tma`` says so, written only when set (a
    pointer variant's string has no TMA field). ``paged``, ``page_size`` and
    ``seq16`` do not apply to this kernel.
    """
    if request.dtype in FP8_DTYPES:
        return fp8_variant(target, request)

    def tma_field(fields: dict[str, bool | int], even: bool) -> None:
        if flash_fwd_tma(target, request.dtype, request.aligned, request.tma, even):
            fields["TMA"] = True

    return attention.variant(kernel, target, request, kernel_config, tma_field)


# Prewarm plans the FP8 forward when asked (--dtype e4m3), on the targets fp8_refusal does not refuse.
PREWARM_FP8 = FP8_DTYPES


def prewarm_leaves_out(target: Target, dtype: str) -> str | None:
    """Why prewarm leaves ``dtype``'s variants out for ``target`` (None: it plans them)."""
    return fp8_refusal(target) if dtype in FP8_DTYPES else None


def prewarm_head_dims_v(head_dim_v: int) -> tuple[int, ...]:
    """The v head dims a call with v of ``head_dim_v`` columns runs these kernels at, for prewarm's --head-dim-v.

    Up to 256 its own; 257..512 v's two pieces (``geometry.value_pieces``; ``lazytriton.value_split``).
    """
    return value_pieces(head_dim_v)


# What the FP8 forward (flash_fwd_fp8) does not take, as the Request's fields name them.
_FP8_REFUSED = ("alibi", "bias", "dropout", "sinks", "tma")


def fp8_variant(target: Target, request: Request) -> Variant:
    """The ``flash_fwd_fp8`` variant of an e4m3 call: a ValueError naming the target or feature it cannot serve.

    Pointer loads with V read from its transpose, padded head dims (no split
    tiles); tiles from the tuning table's e4m3 rows, else ``fp8_default_config``.
    """
    refusal = fp8_refusal(target)
    if refusal is not None:
        raise ValueError(f"dtype {request.dtype}: {refusal}")
    refused = [name for name in _FP8_REFUSED if getattr(request, name)]
    if refused:
        raise ValueError(f"the FP8 forward takes no {', '.join(refused)} (FlashAttention-3's has none either)")
    return attention.variant(FP8_NAME, target, replace(request, split_d=False), kernel_config,
                             lambda fields, even: None)


# ---------------------------------------------------------------------------
# flash_fwd_gluon: the Gluon (FlashAttention-3-style) Hopper forward, an alternative to flash_fwd
# (kernels/flash_fwd/gluon.py has its rule). Dispatch serves it by default where GLUON_TABLE has a
# row for the call's (dtype, head dim, causal) and the call fits that row's tiles (flash_fwd_gluon_fits);
# the rest keeps flash_fwd. The rows are the H200 probe's winners over flash_fwd
# (experiments/probe_gluon.py --quick --sweep prints them ready to paste; bf16, seqlen 4k, batch x
# seqlen 16k, hidden 2048, Triton 3.6, 2026-11-30, with the ping-pong tilings; TFLOP/s gluon / flash_fwd /
# cuDNN in the comments). fp16 takes bf16's rows: the same kernel and tiles (the probe checks its numerics;
# bench_flash_fwd.py times both dtypes through dispatch). The warm path's memo key carries whether a call fits
# (binding.memo_key's GLUON_TAIL, computed once per shape), so a gluon plan is never used for a call its tiles do
# not divide.
GluonTiling = tuple[tuple[int, int, int], bool, bool]  # (BLOCK_M, BLOCK_N, num_warps), producer, pingpong
_GLUON_BF16: dict[tuple[int, bool], GluonTiling] = {
    # 2026-12-01, with the query tiles below (`--q-tiles 2,4,8`): ping-pong 128 x 128 x 4 walking 4 tiles a
    # program, 1.03-1.08x flash_fwd at 4k-16k (436 / 423 / 434, 450 / 419 / 473; 128 x 64 x 8 437 / 421 / 469 on
    # 11-30); 8 tiles at 1k tie flash_fwd (326 / 329 / 399)
    (64, False): ((128, 128, 4), True, True),
    # Causal to 1k (GLUON_WIDE's bound), 8 query tiles a program: warpgroup 0 takes its diagonal block in a half
    # step and the output store is waited for a step later (probe_fwd_variants.py, bf16 1k, 2026-12-04: 303 against
    # flash_fwd's 288, 287 without the half step and the deferred wait; cuDNN 328)
    (64, True): ((128, 128, 4), True, True),
    (128, False): ((128, 128, 4), True, True),  # 592 / 440 / 647
    (128, True): ((128, 128, 4), True, True),  # 492 / 407 / 543
    # 2026-12-01, `--head-dims 256`, mean of 1k and 4k: 1.28-1.58x flash_fwd, 0.88-1.04x cuDNN
    (256, False): ((128, 64, 4), True, True),  # 594 / 393 / 609
    (256, True): ((128, 64, 4), True, True),  # 443 / 317 / 462
    # Split and padded head dims (gluon.chunks), 2026-12-01: ping-pong, the padded tile's tiles at 80, 96 and 224;
    # `bench_flash_fwd.py --head-dims 80,96,160,192,224`, bf16 4k full / causal (lazytriton /
    # flash_fwd's split tiles through the JIT / cuDNN): 80 423 / 352 (366 / 338 / 400 / 358), 96 478 / 405 (412 /
    # 340 / 498 / 371), 224 642 / 507 (380 / 328 / 610 / 491). 160 at 128 x 128 (fits beside a 160-wide Q): 609 /
    # 483 against 562 / 455 at 128 x 64 (probe_gluon --quick, 4k; cuDNN 558 / 415)
    (80, False): ((128, 128, 4), True, True),
    (80, True): ((128, 128, 4), True, True),
    (96, False): ((128, 128, 4), True, True),
    (96, True): ((128, 128, 4), True, True),
    (160, False): ((128, 128, 4), True, True),
    (160, True): ((128, 128, 4), True, True),
    (192, False): ((128, 64, 4), True, True),  # 603 / 496 (cuDNN 658 / 548)
    (192, True): ((128, 64, 4), True, True),
    (224, False): ((128, 64, 4), True, True),
    (224, True): ((128, 64, 4), True, True),
}
GLUON_TABLE: dict[tuple[str, int, bool], GluonTiling] = {
    (dtype, d, causal): tiling for dtype in ("bf16", "fp16") for (d, causal), tiling in _GLUON_BF16.items()}
# The wide tiles (gluon.WIDE_CONFIGS: three consumer warpgroups of 64 rows, FlashAttention-3's at head dim 64) for
# calls longer than a bound: per (dtype, head dim, causal), (largest seqlen_q that keeps GLUON_TABLE's row, or
# flash_fwd where it has none; the tiles from there on). The bound is a power of two, so the choice follows the
# memo key's seqlen bucket. H200, bf16, `probe_gluon.py --head-dims 64 --wide` (2026-12-02), TFLOP/s of the
# wide 192 x 128 x 4 / ping-pong 128 x 128 x 4 / flash_fwd / cuDNN: full 4k 480 / 424 / 429 / 482, 16k 529 / 462 /
# 439 / 496; causal 4k 390 / 355 / 385 / 430, 16k 514 / 436 / 420 / 470. At 1k the wide tiles lose (full 350
# against the served ping-pong x8's ~397; causal 182-218 against flash_fwd's 289): programs of a few key blocks,
# each making eight descriptors, and 1024 rows in six programs of 192, the last one a third full. 192 x 64 x 4 lost
# to 192 x 128 x 4 from 4k (433-472); at 80, 96 and 160 the wide tiles tied or lost to ping-pong.
_GLUON_WIDE_BF16: dict[tuple[int, bool], tuple[int, tuple[int, int, int]]] = {
    (64, False): (1024, (192, 128, 4)),
    (64, True): (1024, (192, 128, 4)),
}
GLUON_WIDE: dict[tuple[str, int, bool], tuple[int, tuple[int, int, int]]] = {
    (dtype, d, causal): row for dtype in ("bf16", "fp16") for (d, causal), row in _GLUON_WIDE_BF16.items()}
# Query tiles a program of a ping-pong row walks (gluon.variant's q_tiles), by seqlen_q: per (head dim, causal),
# (largest seqlen_q, q_tiles) pairs, the first that holds; 1 where none does. The bounds are powers of two, so the
# choice follows the memo key's seqlen bucket. The program makes its descriptors once and its producer warp loads
# the next tile under the current one's last steps and epilogue: what short sequences lack (H200, bf16, probe_gluon
# --q-tiles 2,4,8, 2026-12-01; TFLOP/s many tiles / one tile / cuDNN): hd128 1k 510 / 454 / 534 (4 tiles), causal
# 331 / 286 / 360 (8: a program then holds a whole (batch, head), every program the same work). Causal programs
# pair their tiles (tile j with N - 1 - j, flash_fwd_gluon_kernel's _tile_row: the same key blocks in every
# program), so several tiles win to 4k at 128, 160, 192 and 256 (2026-12-04); from 8k one tile (hd128 causal 16k,
# tiles unpaired: 8 tiles 393 against one's 645). A split or padded head dim without rows of its own takes its
# padded tile's (gluon_q_tiles); 80, 96 and 224 have their own.
GLUON_Q_TILES: dict[tuple[int, bool], tuple[tuple[int, int], ...]] = {
    (64, False): ((1024, 8), (1 << 31, 4)),
    (64, True): ((1024, 8),),  # GLUON_TABLE's causal row ends at 1k (GLUON_WIDE's bound)
    # 2026-12-04, causal programs paired (probe_gluon --quick --q-tiles 2,4,8; many / one / cuDNN): hd128 full 4k
    # x4 687 / 658 / 673, causal 4k x4 600 / 561 / 573 (x2 589, x8 568), causal 1k x8 386 (x4 372); hd256 full 1k x2
    # 613 / 606 / 622, 4k x2 754 / 748 / 729 (x4 759), causal 1k x2 454 / 417 / 449, 4k x2 683 / 622 / 598
    (128, False): ((4096, 4),),
    (128, True): ((1024, 8), (4096, 4)),
    (256, False): ((4096, 2),),
    (256, True): ((4096, 2),),
    # 80, 96 and 224: rows of their own. With their padded tile's rows (128's, 256's) against one tile, the grid
    # (2026-12-04, bf16 / fp16 ratios to cuDNN) had 224 full lose at 1k and 4k with 2 tiles (0.98 -> 0.91, 1.04 ->
    # 0.94), causal flat; 96 full 4k with 4 (1.06 -> 0.97), causal 4k -0.01-0.03; 80 causal 4k gain with 4 (1.03 ->
    # 1.07), full 4k -0.01-0.02. So one tile at 224, 128's rows at 80 causal, several tiles to 1k only at 96 and at
    # 80 full
    (80, False): ((1024, 4),),
    (80, True): ((1024, 8), (4096, 4)),
    (96, False): ((1024, 4),),
    (96, True): ((1024, 8),),
    (224, False): (),
    (224, True): (),
    # Head dim 192, causal programs paired (2026-12-04, probe_gluon --quick --q-tiles 2,4; 2 tiles / one): 2 tiles
    # win to 4k, full 1k 551 / 523 (x4 477; cuDNN 594), 4k 663 / 649 (568; 695), causal 1k 407 / 366 (356; 444), 4k
    # 594 / 556 (502; 596)
    (192, False): ((4096, 2),),
    (192, True): ((4096, 2),),
    # Head dim 160 (one Q buffer, gluon.q_buffers), probe_gluon --q-tiles 2,4,8 at 1k (2026-12-02): full 4 tiles 545
    # against 495 for one (x2 538, x8 397; cuDNN 496), causal 2 tiles 319 against 310 (x4 291; cuDNN 372). Causal
    # programs paired (2026-12-04): full 1k x2 555 / x4 546 / one 529 (cuDNN 498), 4k 702 / 701 / 690 (588); causal
    # 1k 371 / 356 / 338 (371), 4k 605 / 611 / 571 (507)
    (160, False): ((1024, 4), (4096, 2)),
    (160, True): ((4096, 2),),
}


def gluon_q_tiles(head_dim: int, causal: bool, seqlen_q: int, block_m: int) -> int:
    """The query tiles of ``block_m`` rows a program walks for ``seqlen_q`` (1: one a program).

    GLUON_Q_TILES' count, halved until the program's rows divide seqlen_q
    (which a multiple of ``block_m`` ends at 1).
    """
    tiles = 1
    rows = GLUON_Q_TILES.get((head_dim, bool(causal)))
    if rows is None:  # a split or padded head dim without rows of its own: its padded tile's
        rows = GLUON_Q_TILES.get((padded_head_dim(head_dim), bool(causal)), ())
    for most, count in rows:
        if seqlen_q <= most:
            tiles = count
            break
    while tiles > 1 and seqlen_q % (block_m * tiles):
        tiles //= 2
    return tiles
# The forward's switch of the Gluon kernel: False, dispatch never picks flash_fwd_gluon itself whatever the tables
# say (it is then launched by variant only, as the probes and `lazytriton tune` do; the backward has its own,
# flash_bwd.dispatch.GLUON_BY_DEFAULT). Read when a shape is first described: set it (or edit a table) before the
# first call, or clear the runtime's plans after.
GLUON_BY_DEFAULT = True


def flash_fwd_gluon_default(dtype: str, head_dim: int, causal: bool, seqlen_q: int = 0) -> GluonTiling | None:
    """The tiling for (dtype, head dim, causal) at ``seqlen_q``, or None where flash_fwd serves (reads the globals).

    GLUON_WIDE's wide tiles past its bound, else GLUON_TABLE's row. A row whose tiles the kernel does not take at
    that head dim (``gluon.configs``: over sm_90's shared memory, say 128 x 128 at 256) is not used: flash_fwd
    serves those calls, as without the row.
    """
    if not GLUON_BY_DEFAULT:
        return None
    wide = GLUON_WIDE.get((dtype, head_dim, bool(causal)))
    row = GLUON_TABLE.get((dtype, head_dim, bool(causal)))
    if wide is not None and seqlen_q > wide[0]:
        row = (wide[1], True, False)
    if row is None:
        return None
    return row if _gluon_takes(head_dim, tuple(row[0]), row[1], row[2]) else None


@functools.cache  # per call of the general path (binding.memo_key): the kernel's rule, once per tiling
def _gluon_takes(head_dim: int, tiles: tuple[int, int, int], producer: bool, pingpong: bool) -> bool:
    wide = gluon.wide_configs(head_dim) if producer and not pingpong else ()
    return tiles in gluon.configs(head_dim, pingpong=pingpong) + wide


@functools.cache
def _gluon_rows(block_m: int) -> int:
    return gluon.whole_rows(block_m)


def flash_fwd_gluon_q_tiles(dtype: str, head_dim: int, causal: bool, offset: int, scale: float, seqlen_q: int,
                            seqlen_k: int) -> int:
    """0 where ``flash_fwd_gluon_fits`` says no, else the query tiles a program of the call's variant walks.

    The memo key carries it (``binding.gluon_tail``): bucket-mates whose
    seqlen_q takes another count (768 and 1024 at head dim 128: 2 and 4) get
    keys, plans and grids of their own.
    """
    row = flash_fwd_gluon_default(dtype, head_dim, causal, seqlen_q)
    if row is None or not _gluon_row_fits(row, causal, offset, scale, seqlen_q, seqlen_k):
        return 0
    return gluon_q_tiles(head_dim, causal, seqlen_q, row[0][0]) if row[2] else 1


def flash_fwd_gluon_fits(dtype: str, head_dim: int, causal: bool, offset: int, scale: float, seqlen_q: int,
                         seqlen_k: int) -> bool:
    """Whether a plain call is one flash_fwd_gluon serves by default, as far as its shape says.

    The part of ``gluon.reason`` that the memo key's buckets cannot see: a
    table row, seqlens that are positive multiples of the row's tiles (of one
    warpgroup's rows for seqlen_q at the wide tiles: ``gluon.whole_rows``), a
    positive softmax scale, a causal offset >= 0 (bottom-right with
    seqlen_q > seqlen_k leaves rows without keys). Target, alignment and
    64-bit offsets are in the key already; the plan checks them (``flash_fwd_gluon_default_variant``).
    """
    return _gluon_row_fits(flash_fwd_gluon_default(dtype, head_dim, causal, seqlen_q), causal, offset, scale,
                           seqlen_q, seqlen_k)


def _gluon_row_fits(row: GluonTiling | None, causal: bool, offset: int, scale: float, seqlen_q: int,
                    seqlen_k: int) -> bool:
    """``flash_fwd_gluon_fits`` for the tiling ``flash_fwd_gluon_default`` gave (None: no)."""
    if row is None:
        return False
    block_m, block_n, _ = row[0]
    return (0 < seqlen_q and seqlen_q % _gluon_rows(block_m) == 0 and 0 < seqlen_k and seqlen_k % block_n == 0
            and scale > 0.0 and (not causal or offset >= 0))


def flash_fwd_gluon_default_variant(target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                                    index64: bool, seqlen_q: int, seqlen_k: int,
                                    sinks: bool = False) -> Variant | None:
    """The default flash_fwd_gluon variant for a call that ``flash_fwd_gluon_fits``, or None (flash_fwd serves).

    None also where the target, alignment or 64-bit offsets rule the kernel out. ``sinks``: the
    call has attention sinks, which the kernel carries (SINKS=true) on the same tiles.
    """
    row = flash_fwd_gluon_default(dtype, head_dim, causal, seqlen_q)
    if row is None:
        return None
    tiles, producer, pingpong = row
    q_tiles = gluon_q_tiles(head_dim, causal, seqlen_q, tiles[0]) if pingpong else 1
    return flash_fwd_gluon_variant(target, dtype, head_dim, "top_left" if causal else "none", aligned, index64,
                                   seqlen_q, seqlen_k, tiles=tiles, producer=producer, pingpong=pingpong,
                                   q_tiles=q_tiles, sinks=sinks)



def flash_fwd_gluon_variant(target: Target, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool,
                            seqlen_q: int, seqlen_k: int, features: bool = False,
                            tiles: tuple[int, int, int] | None = None, scale: float = 1.0,
                            producer: bool = False, pingpong: bool = False, q_tiles: int = 1,
                            sinks: bool = False) -> Variant | None:
    """The ``flash_fwd_gluon`` variant for a call, or None where it cannot serve it (pure; see its rule)."""
    return gluon.variant(str(target), dtype, head_dim, causal_mode(causal), aligned, index64, seqlen_q, seqlen_k,
                         features, tiles, scale, producer, pingpong, q_tiles, sinks)


def prewarm_twins(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                  index64: bool, seqlen_q: int, seqlen_k: int, sinks: bool = False) -> list[tuple[Variant, str]]:
    """The variants beside ``kernel``'s that a plain call of this shape runs, for prewarm: the Gluon forward's.

    An image must hold the flash_fwd_gluon variant ``GLUON_TABLE`` serves
    beside flash_fwd's: a call that fits the table's tiles runs it, and would
    otherwise compile it on first use. Prewarm's causal calls are
    FlashAttention's (bottom-right), so a causal offset is seqlen_k - seqlen_q.
    ``sinks``: the call has attention sinks, which the Gluon forward carries (SINKS=true).
    An FP8 call (e4m3, e5m2) runs the Gluon FP8 forward where ``fp8.variant`` serves it (``fp8_gluon.prewarm_twin``;
    the FP8 forward takes no sinks).
    """
    if dtype in FP8_DTYPES:
        from lazytriton.kernels.flash_fwd import fp8_gluon  # FP8's rule: a plain call's process never reads it

        fp8_twin = None if sinks else fp8_gluon.prewarm_twin(str(target), dtype, head_dim, causal, aligned, index64,
                                                              seqlen_q, seqlen_k)
        return [] if fp8_twin is None else [(fp8_twin, "fp8 gluon table")]
    offset = seqlen_k - seqlen_q if causal else 0
    if offset < 0 or not flash_fwd_gluon_fits(dtype, head_dim, causal, offset, 1.0 / math.sqrt(head_dim), seqlen_q,
                                              seqlen_k):
        return []
    gluon_variant = flash_fwd_gluon_default_variant(target, dtype, head_dim, causal, aligned, index64, seqlen_q,
                                                    seqlen_k, sinks)
    return [] if gluon_variant is None else [(gluon_variant, "gluon table")]
