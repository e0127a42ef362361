"""Dispatch: from a call's description to the Variant that serves it.

``target_of_device`` is the one thin function that reads the machine; all the
rest is pure and tested with made-up inputs. Until the tuning table exists
(see the prewarm issue), tile sizes come from ``default_config``.
"""

from __future__ import annotations

import functools
from typing import Any

from lazytriton import tuning

# Geometry, re-exported: dispatch.padded_head_dim and the others are read through dispatch too.
from lazytriton.geometry import CAUSAL_MODES as CAUSAL_MODES
from lazytriton.geometry import HEAD_DIMS as HEAD_DIMS
from lazytriton.geometry import MAX_HEAD_DIM as MAX_HEAD_DIM
from lazytriton.geometry import MIN_CHUNK as MIN_CHUNK
from lazytriton.geometry import causal_mode, padded_head_dim, split_head_dim
from lazytriton.kernels.flash_fwd.tma import require_tma, tma_possible
from lazytriton.record import record
from lazytriton.target import Target, target_from_cuda_capability, target_from_gcn_arch
from lazytriton.variant import Variant, pairs

# Split tiles: a head dim that is not a power of two as two power-of-two chunks
# (geometry.split_head_dim: 96 = 64 + 32) instead of one padded tile (128). On by
# default since benchmarks/bench_split_d.py measured flash_fwd on the H200 (bf16, 4k,
# Triton 3.6): 1.42-2.22x the padded kernel's TFLOP/s at head dims 40, 72, 80, 96,
# 160 and 192; split_d=False asks for padding. The backward kernels split by the same
# rule (bench_split_d.py --mode bwd, H200 bf16 4k: 1.34-4.14x).
SPLIT_BY_DEFAULT = True
SPLIT_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")


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


# CUDA targets with 99 KiB of shared memory per block (sm_86, sm_89, sm_120):
# head dim 128's 128x64 tiles over 3 stages need ~160 KiB (prewarm/limits.py's
# estimate), so above head dim 64 they get 64x64 tiles over 2 stages (~48 KiB).
_SMALL_SHARED_CUDA = (86, 89, 120, 121)


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
    block_m = seqlen_class(seqlen_q)
    if target.backend == "hip":
        cfg = Config(128, 64, 4, 2, waves_per_eu=2)
    elif head_dim <= 64:
        cfg = Config(128, 64, 8, 4)
    elif target.capability in _SMALL_SHARED_CUDA:
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
    """The config for a call from the tuning table, else the default; and the row used (or None).

    A head dim that split tiles hold (96 = 64 + 32: ``split_head_dim``) has
    rows of its own when ``lazytriton tune`` measured it; else it takes its
    padded tile's rows (128's), as a padded call does. ``split``: whether the
    variant runs in split tiles (None: as a call of this head dim does by
    default, ``split_chunks``); its own rows are those of split variants
    (``lazytriton tune`` keys a padded winner by its padded head dim), so a
    padded call of it (``split_d=False``, or v's head dim another) takes the
    padded tile's rows: the split tiles' shared memory is not its budget.
    """
    padded = padded_head_dim(head_dim)
    rows = tuning.table_for("flash_fwd") if table is None else table
    row = None
    if _own_rows("flash_fwd", head_dim, split):
        row = tuning.lookup(rows, str(target), "flash_fwd", dtype, head_dim, causal, seqlen_q, seqlen_k)
    if row is None:
        row = tuning.lookup(rows, str(target), "flash_fwd", dtype, padded, causal, seqlen_q, seqlen_k)
    if row is None:
        return default_config(target, dtype, padded, seqlen_q, causal), None
    return Config(row.BLOCK_M, row.BLOCK_N, row.num_warps, row.num_stages, row.waves_per_eu), row


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
    ValueError (``kernels.flash_fwd.tma.require_tma``).
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
                      head_dim_v: int = 0, split_d: bool | None = None) -> Variant:
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
    ``split_d``: split tiles (``kernel_variant``).
    """
    return kernel_variant("flash_fwd", target, dtype, head_dim, causal, aligned, seqlen_q,
                          seqlen_q if seqlen_k is None else seqlen_k, config, index64, table, tma, window, softcap,
                          alibi=alibi, bias=bias, dropout=dropout, varlen=varlen, head_dim_v=head_dim_v,
                          split_d=split_d)


# ---------------------------------------------------------------------------
# flash_bwd: two kernels, flash_bwd_dq then flash_bwd_dkdv

BWD_KERNELS = ("flash_bwd_dq", "flash_bwd_dkdv")


def bwd_default_config(kernel: str, target: Target, dtype: str, head_dim: int, seqlen_q: int,
                       seqlen_k: int, causal: bool = False) -> Config:
    """A sane backward config when the tuning table has no row (it never errors).

    BLOCK_M is the query tile and BLOCK_N the key tile in both kernels: the dQ
    kernel holds BLOCK_M query rows and streams keys, the dK/dV kernel holds
    BLOCK_N key rows and streams queries. CUDA choices from a sweep of each
    kernel alone on the H200 (experiments/sweep_flash_bwd.py, Triton 3.6, bf16,
    seqlen 4k, hidden 2048, 48 candidates a kernel, 2026-11-30), ms of the
    winner against the tutorial's 128-held x 32-streamed:
    head dim 128: dq 128/64, 8 warps, 3 stages (1.30 full, 0.75 causal; 1.50
    and 0.88); dkdv 32/64, 4 warps, 3 stages (2.70 full, 1.57 causal; 6.04
    and 3.50: 128 held key rows spill registers at head dim 128).
    head dim 64: dq 64/64, 4 warps, 3 stages (1.44; 1.52); dkdv 128/64, 4
    warps, 2 stages (2.67; 2.80). (64/128 at 4 warps, chosen first by a
    misreading of that sweep, ran the whole backward at 146 TFLOP/s against
    345 in bench_flash_bwd.py.) The tuning table (kernels/flash_bwd/tuning.csv,
    ``lazytriton tune --kernel flash_bwd``) covers 1k-16k tokens for bf16/fp16
    at head dims 64, 128 and 256 and the split head dims 80, 96, 160 and 192;
    these defaults serve the rest.
    Head dim 256 and fp32 halve the tiles (registers and shared memory; fp32
    dots use no tensor cores); short sequences get tiles no longer than
    needed. AMD values are a guess (no AMD GPU here).
    """
    if kernel not in BWD_KERNELS:
        raise ValueError(f"kernel must be one of {BWD_KERNELS}, got {kernel!r}")
    hip = target.backend == "hip"
    if head_dim == 256 or dtype == "fp32":
        dq, dkdv = Config(64, 32, 4, 1), Config(32, 64, 4, 1)
        if head_dim == 256 and dtype == "fp32":  # 64x16 tiles need 164 KiB of shared memory: over sm_80's 163
            dq, dkdv = Config(32, 16, 4, 1), Config(16, 32, 4, 1)
    elif hip:
        dq, dkdv = Config(128, 32, 4, 2), Config(32, 128, 4, 2)
    elif head_dim <= 64:
        dq, dkdv = Config(64, 64, 4, 3), Config(128, 64, 4, 2)
    elif target.capability in _SMALL_SHARED_CUDA:
        dq, dkdv = Config(64, 32, 4, 2), Config(32, 64, 4, 2)
    else:
        dq, dkdv = Config(128, 64, 8, 3), Config(32, 64, 4, 3)
    waves = 2 if hip else 0
    if kernel == "flash_bwd_dq":
        held = min(dq.block_m, seqlen_class(seqlen_q))
        return Config(held, min(dq.block_n, 64) if held < dq.block_m else dq.block_n,
                      dq.num_warps if held == dq.block_m else 4, dq.num_stages, waves)
    held = min(dkdv.block_n, seqlen_class(seqlen_k))
    return Config(dkdv.block_m, held, dkdv.num_warps, dkdv.num_stages, waves)


def seq_aligned(kernel: str, aligned: bool, seqlen_q: int, seqlen_k: int, varlen: bool = False) -> bool:
    """SEQ16 for a call described by its sizes (pure): a backward kernel's seqlens are 16-divisible.

    The backward's binding computes the same from what it passes (the seqlens
    and the lse strides heads_q x seqlen_q and seqlen_q; its ``pack``); this is
    the rule for callers that describe a call by its sizes (prewarm axes, the C
    API's specs, ``cache explain``, tune). Only with ``aligned`` (ALIGN16), so a
    call has one of three alignments; never for packed sequences, whose
    kernels read each sequence's own length.
    """
    return kernel in BWD_KERNELS and bool(aligned) and not varlen and seqlen_q % 16 == 0 and seqlen_k % 16 == 0


def _own_rows(kernel: str, head_dim: int, split: bool | None) -> bool:
    """Whether a call of ``kernel`` at ``head_dim`` looks up the head dim's own tuning rows (its split tiles')."""
    if split is None:
        split = split_chunks(kernel, head_dim) is not None
    return split and head_dim != padded_head_dim(head_dim)


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """The config of any kernel for a call: its tuning table's row, else its default; and the row used.

    ``paged``: a decoding call on a paged cache (``decode_config``); other kernels ignore it. ``split``:
    whether the variant runs in split tiles (``flash_fwd_config``; None: as this head dim's call does by default).
    """
    if kernel == "flash_fwd":
        return flash_fwd_config(target, dtype, head_dim, causal, seqlen_q, seqlen_k, table, split)
    if kernel in DECODE_KERNELS:
        return decode_config(kernel, target, dtype, head_dim, causal, seqlen_q, seqlen_k, table=table,
                             paged=paged and kernel == "flash_decode_split")
    padded = padded_head_dim(head_dim)
    rows = tuning.table_for(kernel) if table is None else table
    row = None
    if _own_rows(kernel, head_dim, split):  # a split variant's own rows first (tune_bwd.row_for), as flash_fwd_config
        row = tuning.lookup(rows, str(target), kernel, dtype, head_dim, causal, seqlen_q, seqlen_k)
    if row is None:
        row = tuning.lookup(rows, str(target), kernel, dtype, padded, causal, seqlen_q, seqlen_k)
    if row is None:
        return bwd_default_config(kernel, target, dtype, padded, seqlen_q, seqlen_k, causal), None
    return Config(row.BLOCK_M, row.BLOCK_N, row.num_warps, row.num_stages, row.waves_per_eu), row


def kernel_variant(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                   seqlen_q: int, seqlen_k: int, config: Config | None = None, index64: bool = False,
                   table: tuning.Table | None = None, tma: bool | None = None, window: bool = False,
                   softcap: bool = False, alibi: bool = False, bias: bool = False, dropout: bool = False,
                   paged: bool = False, varlen: bool = False, head_dim_v: int = 0,
                   split_d: bool | None = None, seq16: bool | None = None) -> Variant:
    """The variant of any kernel (``flash_fwd``, ``flash_bwd_dq``, ``flash_bwd_dkdv``) serving a call (pure).

    The decoding kernels (``DECODE_KERNELS``) go to ``decode_variant``, with
    ``paged`` and a page size BLOCK_N divides (prewarm's view of them).

    Every attention kernel has the same functional fields (padded head dim,
    causal, EVEN_D, ALIGN16, INDEX64) and sees seqlens only through their
    buckets, so the hot paths' memo keys may stand for them. ``flash_fwd``
    also has TMA=true where ``flash_fwd_tma`` says so (from target, dtype and
    alignment); absent, it means false. ``WINDOW=true`` (a sliding window)
    and ``SOFTCAP=true`` (logit softcapping), on all three kernels, are
    likewise written only when set, so the strings of calls without them are
    what they were; the window and the cap themselves are runtime arguments.
    The tile sizes are the plain call's (not tuned for windows). ``ALIBI``,
    ``BIAS`` and ``DROPOUT`` (ALiBi slopes, an additive bias, dropout) are
    such flags too, on all three kernels. ``VARLEN=true``
    (packed sequences, FlashAttention-2's varlen) likewise; its seqlens are
    the call's max_seqlen_q/max_seqlen_k, whose buckets pick the tiles.
    ``head_dim_v`` (0: the same as ``head_dim``): v's head dim, as DeepSeek's
    MLA has (q/k 192, v 128); where its padded size or evenness differs from
    the q/k head dim's, ``BLOCK_DV``/``EVEN_DV`` say so (absent, they are
    BLOCK_D's and EVEN_D's: the strings of equal-dim calls are unchanged),
    and the tiles are those of the larger head dim. ``split_d`` (flash_fwd
    and the backward kernels; None: ``SPLIT_BY_DEFAULT``): split tiles
    (``split_chunks``), with BLOCK_D the first chunk and BLOCK_D2 the second,
    written only when set; the tiles are the split head dim's own tuning
    rows where ``lazytriton tune`` wrote some, else the padded head dim's. True where no
    split helps (a power of two, v's head dim another, TMA) is a ValueError.

    ``SEQ16=true`` (the backward kernels' seqlens and lse strides are
    multiples of 16: more divisibility hints) is written only when set, and
    only with ALIGN16: ``seq16`` None decides by ``seq_aligned`` from the
    seqlens as given (not their buckets), which is why the backward's memo keys
    carry it. The other kernels have no seqlen hints and ignore it.
    """
    if kernel in DECODE_KERNELS:
        return decode_variant(kernel, target, dtype, head_dim, causal, aligned, seqlen_q, seqlen_k, config=config,
                              index64=index64, table=table, paged=paged, window=window, softcap=softcap,
                              alibi=alibi, head_dim_v=head_dim_v)
    padded = padded_head_dim(head_dim)
    dv = head_dim_v or head_dim
    padded_v = padded_head_dim(dv)
    sq, sk = tuning.bucket(seqlen_q), tuning.bucket(seqlen_k)
    chunks = split_chunks(kernel, head_dim, dv, tma, split_d)
    cfg = config or kernel_config(kernel, target, dtype, max(head_dim, dv), causal, sq, sk, table,
                                  split=chunks is not None)[0]
    functional = {"ALIGN16": bool(aligned), "BLOCK_D": padded, "CAUSAL": bool(causal), "EVEN_D": head_dim == padded,
                  "INDEX64": bool(index64)}
    if (padded_v, dv == padded_v) != (padded, head_dim == padded):
        functional.update(BLOCK_DV=padded_v, EVEN_DV=dv == padded_v)
    even = head_dim == padded and dv == padded_v
    if chunks is not None:
        functional.update(BLOCK_D=chunks[0], EVEN_D=sum(chunks) == head_dim, BLOCK_D2=chunks[1])
        even = False  # no TMA: the pointer kernel only
    if kernel == "flash_fwd" and flash_fwd_tma(target, dtype, aligned, tma, even):
        functional["TMA"] = True  # written only when set: a pointer variant's string is what it was before TMA
    if seq16 is None:
        seq16 = seq_aligned(kernel, aligned, seqlen_q, seqlen_k, varlen)
    if seq16 and kernel in BWD_KERNELS:
        if not aligned or varlen:
            raise ValueError(f"seq16=True needs an aligned call (ALIGN16) of dense sequences, got aligned={aligned}, "
                             f"varlen={varlen}")
        functional["SEQ16"] = True
    if window:
        functional["WINDOW"] = True
    if softcap:
        functional["SOFTCAP"] = True
    for flag, on in (("ALIBI", alibi), ("BIAS", bias), ("DROPOUT", dropout), ("VARLEN", varlen)):
        if on:
            functional[flag] = True
    return Variant(kernel, str(target), dtype, pairs(functional), pairs(cfg.tuned()), pairs(cfg.options(target)))


def split_chunks(kernel: str, head_dim: int, head_dim_v: int = 0, tma: bool | None = None,
                 split_d: bool | None = None) -> tuple[int, int] | None:
    """The split-tile chunks of a call of ``kernel``, or None (padding); ``split_d=True`` where none helps: ValueError.

    flash_fwd and the backward kernels (``BWD_KERNELS``) have split tiles;
    ``split_d`` None is ``SPLIT_BY_DEFAULT``; ``head_dim_v`` 0 is ``head_dim``.
    """
    wanted = SPLIT_BY_DEFAULT if split_d is None else split_d
    if not wanted:
        return None
    chunks = split_head_dim(head_dim) if kernel in SPLIT_KERNELS else None
    if chunks is None or (head_dim_v or head_dim) != head_dim or tma:
        if split_d is None:
            return None
        raise ValueError(f"split_d=True needs flash_fwd or a backward kernel ({', '.join(BWD_KERNELS)}), a head dim "
                         f"that two power-of-two chunks hold in less than its padded tile (40, 72, 80, 96, 160, 192, "
                         f"...), v's head dim equal to it and no TMA; got {kernel}, head dim {head_dim}, v's "
                         f"{head_dim_v}, tma={tma}")
    return chunks


# ---------------------------------------------------------------------------
# flash_decode: flash_decode_split, then (several splits) flash_decode_combine

DECODE_KERNELS = ("flash_decode_split", "flash_decode_combine")


def decode_rows_class(rows: int) -> int:
    """BLOCK_M for ``rows`` packed query rows per key/value head (group size x seqlen_q): 16, 32 or 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def page_block_limit(page_size: int) -> int:
    """The largest BLOCK_N that divides ``page_size`` (its largest power-of-two divisor); 0 (contiguous): none."""
    return page_size & -page_size if page_size > 0 else 1 << 30


def decode_default_config(kernel: str, target: Target, dtype: str, head_dim: int, rows: int,
                          page_size: int = 0, paged: bool = False) -> Config:
    """A sane decoding config when the tuning table has no row (it never errors). Untuned: no GPU measured it yet.

    Decoding reads the whole cache once per call and is bound by memory, not
    by tensor cores, so the split kernel takes the smallest query tile a dot
    allows (16 rows: a GQA group of 4 with one query fills 4 of them) and key
    tiles of 64 rows (128 at head dim <= 64 contiguous, 32 at head dim 256 or fp32), 4 warps,
    3 stages of loads in flight where shared memory allows (2 on the 99 KiB
    targets and AMD). A paged call's BLOCK_N must divide its page size, so
    pages of 16 or 32 keys take tiles of 16 or 32. A paged call reads its
    block table inside the loop, and Triton's pipeliner gives that read a
    stage of its own: at 3 (and 4) stages the K and V tiles get one buffer,
    at 5 two, as the contiguous kernel has at 3 (Triton 3.9's TTGIR for
    sm_90, bf16, head dim 128: 71696 bytes of shared memory at 5 stages,
    38928 at 3 and 4; 71680 for the contiguous kernel at 3). So paged calls
    on CUDA take 5 stages (at most 76 KB, under the 99 KiB targets' limit).
    Not measured on a GPU yet. The combine kernel reads 16 rows x 16 splits
    of logsumexp at a time.
    """
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
    hip = target.backend == "hip"
    waves = 2 if hip else 0
    if kernel == "flash_decode_combine":
        return Config(16, 16, 4, 1, waves)
    # Equal bytes per tile across head dims (16 KB of K and 16 KB of V per step at 16 bits): 128 keys at
    # head dim <= 64, 64 at 128, 32 at 256 or fp32 (registers). Until the table has rows (lazytriton tune
    # --kernel flash_decode), head dim 64 read 8 KB tiles at 64 keys. A paged call keeps at most 64 keys, so
    # that one default binary serves every page size that is a multiple of 64 (what prewarm plans).
    block_n = 32 if head_dim == 256 or dtype == "fp32" else 128 if head_dim <= 64 and not paged else 64
    stages = 2 if hip or target.capability in _SMALL_SHARED_CUDA else 3
    if paged and not hip:
        stages = 5
    return Config(decode_rows_class(rows), min(block_n, page_block_limit(page_size)), 4, stages, waves)


def decode_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, rows: int, capacity: int,
                  page_size: int = 0, table: tuning.Table | None = None,
                  paged: bool = False) -> tuple[Config, tuning.Row | None]:
    """A decoding kernel's config: its tuning row (rows: seqlen_q column, cache capacity: seqlen_k), else the default.

    A row's BLOCK_N is cut down to what the page size allows.
    """
    padded = padded_head_dim(head_dim)
    rows_table = tuning.table_for(kernel) if table is None else table
    row = tuning.lookup(rows_table, str(target), kernel, dtype, padded, causal, rows, capacity)
    if row is None:
        return decode_default_config(kernel, target, dtype, padded, rows, page_size, paged), None
    limit = page_block_limit(page_size) if kernel == "flash_decode_split" else 1 << 30
    return Config(min(row.BLOCK_M, 64), min(row.BLOCK_N, limit), row.num_warps, row.num_stages,
                  row.waves_per_eu), row


def decode_variant(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool, rows: int,
                   capacity: int, config: Config | None = None, index64: bool = False,
                   table: tuning.Table | None = None, page_size: int = 0, paged: bool = False,
                   window: bool = False, softcap: bool = False, alibi: bool = False, head_dim_v: int = 0) -> Variant:
    """The variant of a decoding kernel serving a call (pure, given the table).

    ``rows``: query rows per key/value head (group size x seqlen_q), seen
    through their bucket; ``capacity``: the cache's length per sequence
    (table lookup only). The split kernel's functional fields are the
    attention kernels' (ALIGN16, BLOCK_D, CAUSAL, EVEN_D, INDEX64) plus the
    flags PAGED, WINDOW, SOFTCAP and ALIBI, written only when true; the
    combine kernel has only ALIGN16, BLOCK_D, EVEN_D and INDEX64 (it sees no
    scores). With one query a causal mask hides nothing: the binding asks for
    CAUSAL=false then, so both share a binary. ``head_dim_v`` (0: the same
    as ``head_dim``): v's head dim; the split kernel gets ``BLOCK_DV``/``EVEN_DV``
    where its padded size or evenness differs (the attention kernels' rule) and
    the tiles of the larger head dim; the combine kernel sees only outputs, so
    its head dim is v's.
    """
    dv = head_dim_v or head_dim
    if kernel == "flash_decode_combine":
        head_dim = dv
    padded, padded_v = padded_head_dim(head_dim), padded_head_dim(dv)
    sq, sk = tuning.bucket(rows), tuning.bucket(capacity)
    cfg = config or decode_config(kernel, target, dtype, max(head_dim, dv), causal, sq, sk, page_size, table,
                                  paged and kernel == "flash_decode_split")[0]
    functional: dict[str, bool | int] = {"ALIGN16": bool(aligned), "BLOCK_D": padded, "EVEN_D": head_dim == padded,
                                         "INDEX64": bool(index64)}
    if (padded_v, dv == padded_v) != (padded, head_dim == padded):
        functional.update(BLOCK_DV=padded_v, EVEN_DV=dv == padded_v)
    if kernel == "flash_decode_split":
        functional["CAUSAL"] = bool(causal)
        for name, flag in (("PAGED", paged), ("WINDOW", window), ("SOFTCAP", softcap), ("ALIBI", alibi)):
            if flag:
                functional[name] = True
    return Variant(kernel, str(target), dtype, pairs(functional), pairs(cfg.tuned()), pairs(cfg.options(target)))


def target_of_device(device: Any) -> Target:
    """The compile target of a torch CUDA/ROCm device (reads the machine)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return target_from_gcn_arch(props.gcnArchName)
    return target_from_cuda_capability(props.major, props.minor)


# ---------------------------------------------------------------------------
# flash_fwd_gluon: the Gluon (FlashAttention-3-style) Hopper forward, an alternative to flash_fwd
# (kernels/flash_fwd/gluon.py has its rule). Dispatch serves it by default where GLUON_TABLE has a
# row for the call's (dtype, head dim, causal) and the call fits that row's tiles (flash_fwd_gluon_fits);
# the rest keeps flash_fwd. The rows are the H200 probe's winners over flash_fwd
# (experiments/probe_gluon.py --quick --sweep prints them ready to paste; bf16, seqlen 4k, batch x
# seqlen 16k, hidden 2048, Triton 3.6, 2026-11-30, second round with the ping-pong tilings; TFLOP/s
# gluon / flash_fwd / cuDNN in the comments). fp16 takes bf16's rows: the same kernel and tiles (the
# probe checks its numerics; bench_flash_fwd.py times both dtypes through dispatch). Head dim 64 causal was
# not served until the 19th session (gluon 347 < flash_fwd 373 at 4k). The warm path's memo key carries
# whether a call fits (binding.memo_key's GLUON_TAIL, computed once per shape), so a gluon plan is never
# used for a call its tiles do not divide.
GluonTiling = tuple[tuple[int, int, int], bool, bool]  # (BLOCK_M, BLOCK_N, num_warps), producer, pingpong
_GLUON_BF16: dict[tuple[int, bool], GluonTiling] = {
    # 2026-12-01, third session, with the query tiles below (`--q-tiles 2,4,8`): ping-pong 128 x 128 x 4 walking
    # 4 tiles a program, 1.03-1.08x flash_fwd at 4k-16k (436 / 423 / 434, 450 / 419 / 473), against the 128 x 64
    # x 8 row it replaces (437 / 421 / 469 on 11-30); 8 tiles at 1k tie flash_fwd (326 / 329 / 399)
    (64, False): ((128, 128, 4), True, True),
    # 19th session: causal to 1k (GLUON_WIDE's bound), 8 query tiles a program, since warpgroup 0 takes its
    # diagonal block in a half step and the output store is waited for a step later (probe_fwd_variants.py, bf16
    # 1k: 303 against flash_fwd's 288 and the kernel's 287 before; cuDNN 328)
    (64, True): ((128, 128, 4), True, True),
    (128, False): ((128, 128, 4), True, True),  # 592 / 440 / 647
    (128, True): ((128, 128, 4), True, True),  # 492 / 407 / 543
    # 2026-12-01, `--head-dims 256`, mean of 1k and 4k: 1.28-1.58x flash_fwd, 0.88-1.04x cuDNN
    (256, False): ((128, 64, 4), True, True),  # 594 / 393 / 609
    (256, True): ((128, 64, 4), True, True),  # 443 / 317 / 462
    # Split and padded head dims (gluon.chunks), 2026-12-01 (7th session): ping-pong, the padded tile's tiles at
    # 80, 96 and 224; `bench_flash_fwd.py --head-dims 80,96,160,192,224`, bf16 4k full / causal (lazytriton /
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
# memo key's seqlen bucket. H200, bf16, `probe_gluon.py --head-dims 64 --wide` (15th session), TFLOP/s of the
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
# pair their tiles since the 18th session (flash_fwd_gluon_kernel's _tile_row), which made several tiles win to 4k
# at 128, 160, 192 and 256; from 8k one tile (before pairing: hd128 causal 16k 8 tiles 393 against 645). A split or
# padded head dim without rows of its own takes its padded tile's (gluon_q_tiles); 80, 96 and 224 have their own.
GLUON_Q_TILES: dict[tuple[int, bool], tuple[tuple[int, int], ...]] = {
    (64, False): ((1024, 8), (1 << 31, 4)),
    (64, True): ((1024, 8),),  # GLUON_TABLE's causal row ends at 1k (GLUON_WIDE's bound)
    # 18th session, causal programs paired (probe_gluon --quick --q-tiles 2,4,8; many / one / cuDNN): hd128 full 4k
    # x4 687 / 658 / 673, causal 4k x4 600 / 561 / 573 (x2 589, x8 568), causal 1k x8 386 (x4 372); hd256 full 1k x2
    # 613 / 606 / 622, 4k x2 754 / 748 / 729 (x4 759), causal 1k x2 454 / 417 / 449, 4k x2 683 / 622 / 598
    (128, False): ((4096, 4),),
    (128, True): ((1024, 8), (4096, 4)),
    (256, False): ((4096, 2),),
    (256, True): ((4096, 2),),
    # The padded and split head dims took 128's and 256's rows; in the grid (18th session, bf16 / fp16 ratios to
    # cuDNN, one tile -> those rows) 224 full lost at 1k and 4k with 2 tiles (0.98 -> 0.91, 1.04 -> 0.94), causal
    # flat; 96 full 4k with 4 (1.06 -> 0.97), causal 4k -0.01-0.03; 80 causal 4k gained with 4 (1.03 -> 1.07), full
    # 4k -0.01-0.02. So rows of their own: 128's before the 18th for 96 and 80 full, one tile at 224
    (80, False): ((1024, 4),),
    (80, True): ((1024, 8), (4096, 4)),
    (96, False): ((1024, 4),),
    (96, True): ((1024, 8),),
    (224, False): (),
    (224, True): (),
    # Head dim 192 at 1k (probe_gluon --q-tiles 2,4, 7th session, before pairing): 2 tiles 417 / 286 against 365 /
    # 272 for one, 4 tiles 379 / 269 (cuDNN 449 / 291); at 4k one tile won then (593 / 485 against 602 / 452).
    # 18th session, causal programs of several tiles paired (tile j with N - 1 - j: the same work in every program;
    # probe_gluon --quick --q-tiles 2,4): 2 tiles win to 4k, full 1k 551 / 523 (x4 477; cuDNN 594), 4k 663 / 649
    # (568; 695), causal 1k 407 / 366 (356; 444), 4k 594 / 556 (502; 596)
    (192, False): ((4096, 2),),
    (192, True): ((4096, 2),),
    # Head dim 160 at 1k (probe_gluon --q-tiles 2,4,8, 16th session; one Q buffer, gluon.q_buffers): full 4 tiles
    # 545 against 495 for one (x2 538, x8 397; cuDNN 496), causal 2 tiles 319 against 310 (x4 291; cuDNN 372).
    # Paired (18th): full 1k x2 555 / x4 546 / one 529 (cuDNN 498), 4k 702 / 701 / 690 (588); causal 1k 371 / 356 /
    # 338 (371), 4k 605 / 611 / 571 (507)
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
# The master switch: False, dispatch never picks flash_fwd_gluon nor flash_bwd_dkdv_gluon (BWD_GLUON_TABLE,
# below) itself whatever the tables say (they are then launched by variant only, as the probes and
# `lazytriton tune` do). Read when a shape is first described: set it (or edit a table) before the first
# call, or clear the runtime's plans after.
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
    from lazytriton.kernels.flash_fwd import gluon

    wide = gluon.wide_configs(head_dim) if producer and not pingpong else ()
    return tiles in gluon.configs(head_dim, pingpong=pingpong) + wide


@functools.cache
def _gluon_rows(block_m: int) -> int:
    from lazytriton.kernels.flash_fwd import gluon

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
                                    index64: bool, seqlen_q: int, seqlen_k: int) -> Variant | None:
    """The default flash_fwd_gluon variant for a call that ``flash_fwd_gluon_fits``, or None (flash_fwd serves).

    None also where the target, alignment or 64-bit offsets rule the kernel out.
    """
    row = flash_fwd_gluon_default(dtype, head_dim, causal, seqlen_q)
    if row is None:
        return None
    tiles, producer, pingpong = row
    q_tiles = gluon_q_tiles(head_dim, causal, seqlen_q, tiles[0]) if pingpong else 1
    return flash_fwd_gluon_variant(target, dtype, head_dim, "top_left" if causal else "none", aligned, index64,
                                   seqlen_q, seqlen_k, tiles=tiles, producer=producer, pingpong=pingpong,
                                   q_tiles=q_tiles)


# ---------------------------------------------------------------------------
# flash_bwd_dkdv_gluon: the Gluon (FlashAttention-3-style) dK/dV kernel, an alternative to flash_bwd_dkdv
# (kernels/flash_bwd/gluon.py has its rule). Served, under the same master switch GLUON_BY_DEFAULT, where
# BWD_GLUON_TABLE has a row for the call's (dtype, head dim, causal), its tiles divide the seqlens and
# seqlen_k reaches the row's minimum (flash_bwd_gluon_fits; the backward's memo key carries the answer,
# binding.GLUON_TAIL). The rows are where it won in the whole backward: the probe (benchmarks/
# probe_gluon_bwd.py, bf16, Triton 3.6, 2026-12-01) timed the dK/dV kernel alone, gluon over Triton, at
# 1.06-1.18x for head dim 128 and head dim 64 causal from 4k tokens (0.78-0.97x at 1k and at head dim 64
# non-causal, hence the minimum seqlen); then bench_flash_bwd.py served all three candidate rows, and only
# head dim 128 non-causal gained over the same run's Triton kernels (lazytriton / Triton JIT, bf16 and fp16:
# 4k 1.09x / 1.05x, 16k 1.06x / 1.06x). Head dim 128 causal was level (0.97-1.02x) and head dim 64 causal
# lost (0.87-0.91x), so they keep flash_bwd_dkdv. fp16 takes bf16's row.
BwdGluonTiling = tuple[tuple[int, int, int], bool, int]  # (BLOCK_N, BLOCK_M, num_warps), OVERLAP, min seqlen_k
_BWD_GLUON_BF16: dict[tuple[int, bool], BwdGluonTiling] = {
    (128, False): ((64, 64, 4), True, 2048),
}
BWD_GLUON_TABLE: dict[tuple[str, int, bool], BwdGluonTiling] = {
    (dtype, d, causal): row for dtype in ("bf16", "fp16") for (d, causal), row in _BWD_GLUON_BF16.items()}


def flash_bwd_gluon_fits(dtype: str, head_dim: int, causal: bool, offset: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether a plain backward call is one flash_bwd_dkdv_gluon serves by default, as far as its shape says.

    A BWD_GLUON_TABLE row, seqlens that are positive multiples of its tiles, seqlen_k at least the row's
    minimum, a causal offset >= 0. Target, alignment and 64-bit offsets are the plan's to check
    (``flash_bwd_dkdv_gluon_default_variant``).
    """
    row = BWD_GLUON_TABLE.get((dtype, head_dim, bool(causal))) if GLUON_BY_DEFAULT else None
    if row is None:
        return False
    (block_n, block_m, _), _, min_seqlen_k = row
    return (0 < seqlen_q and seqlen_q % block_m == 0 and min_seqlen_k <= seqlen_k and seqlen_k % block_n == 0
            and (not causal or offset >= 0))


def flash_bwd_dkdv_gluon_default_variant(target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                                         index64: bool, seqlen_q: int, seqlen_k: int) -> Variant | None:
    """The flash_bwd_dkdv_gluon variant for a call that ``flash_bwd_gluon_fits``, or None (flash_bwd_dkdv serves).

    None also where the target, alignment or 64-bit offsets rule the kernel out.
    """
    from lazytriton.kernels.flash_bwd import gluon

    row = BWD_GLUON_TABLE.get((dtype, head_dim, bool(causal))) if GLUON_BY_DEFAULT else None
    if row is None:
        return None
    tiles, overlap, _ = row
    return gluon.variant(str(target), dtype, head_dim, "top_left" if causal else "none", aligned, index64, seqlen_q,
                         seqlen_k, tiles, overlap)


# ---------------------------------------------------------------------------
# The fused backward (kernels/flash_bwd/fused.py: flash_bwd_prep, then flash_bwd_fused_gluon, FlashAttention-3's
# warp-specialised backward with dQ summed by TMA reductions), in place of flash_bwd's two kernels, under the
# same master switch GLUON_BY_DEFAULT, where BWD_FUSED_TABLE has a row for the call's (dtype, head dim, causal),
# the tiles divide the seqlens and seqlen_k reaches the row's minimum (flash_bwd_fused_fits; the backward's memo
# key carries the answer, binding.FUSED_TAIL). The rows are the H200 probe's winners (benchmarks/
# probe_gluon_bwd.py, bf16, Triton 3.6, 2026-12-01, the whole backward with the prep kernel and the cast,
# against flash_bwd's two kernels through Triton's JIT): head dim 128 1.22-1.31x non-causal, 1.10-1.27x causal
# (BLOCK_M 64, lse and delta loaded after the scores); head dim 64 non-causal 1.22-1.24x from 4k with BLOCK_M 128
# (0.90x at 1k), causal 1.00-1.17x from 4k with BLOCK_M 64 and the rows prefetched (0.93x at 1k). In
# bench_flash_bwd.py's grid the 1k rows at head dim 128 lost to the two kernels (0.76-0.91x: the prep, the
# accumulator's 4 bytes an element written, read and cast weigh most in the shortest backward), so every row
# started at 2k keys. Then the served entries were found slower than the JIT's (probe_fused_served.py: lse's
# strides and the causal offset not marked divisible by 16); marked, the probe had the fused kernel beat the
# two at hd128 1k (0.98 against 1.11 ms non-causal, 0.81 against 0.85 causal), but the grid run with hd128's
# rows from 1k lost there again (0.92x and 0.87x the two kernels through the JIT), so they stay at 2k, as hd64's
# (1.19 against 1.17 ms, 0.95 against 0.76 at 1k in the probe). Head dim 256 (64 keys a program, the
# warpgroups split by columns; probe of 2026-12-01, 5th session): 1.44-2.19x the two kernels and 0.88-1.09x
# cuDNN from 1k, lse and delta prefetched. fp16 takes bf16's rows.
BwdFusedTiling = tuple[int, bool, int]  # BLOCK_M, PREFETCH, min seqlen_k
_BWD_FUSED_BF16: dict[tuple[int, bool], BwdFusedTiling] = {
    # Head dim 128 non-causal from 1k keys since 12-02 (12th session: with the parallel prologue and the staged
    # dK/dV stores, probe_bwd_overhead.py --fused-from 1024, the two plans timed in turns, fused / two kernels
    # 1.009 and 1.000 bf16, 0.973 and 0.957 fp16 over two runs); causal kept 2k then (1.07-1.10 at 1k).
    # 12-02 (14th session), with head_dim marked 8-divisible (KernelSpec.eight_params: the dK/dV stores and the
    # prep's loads 16 bytes wide), the same probe at 1k, fused / two kernels bf16 and fp16: hd128 causal 0.853 /
    # 0.846, hd64 full 0.915 / 0.904 and hd192 causal 0.971 / 0.950 now start at 1k; hd64 causal 1.064 / 1.061,
    # hd80 full 1.072 / 1.068 and causal 1.142 / 1.126, hd96 full 1.015 / 1.011 and causal 1.072 / 1.054, hd192
    # full 1.101 / 1.130 keep 2k
    (128, False): (64, False, 1024),
    (128, True): (64, False, 1024),
    (64, False): (128, False, 1024),
    (64, True): (64, True, 2048),
    (256, False): (64, True, 1024),
    (256, True): (64, True, 1024),
    # Head dims in a padded tile (then fused.tile: 80 and 96 in 128's, 160 to 224 in 256's; now 224 only, the rest
    # in two chunks, fused.chunks), the tile's rows; H200,
    # bench_flash_bwd.py (12-01, 7th session), bf16 TFLOP/s fused against the two kernels' split tiles in the run
    # before, full / causal: 96 4k 367 / 306 against 315 / 282, 16k 407 / 397 against 329 / 310; 80 16k 349 / 344
    # against 285 / 293; 192 4k 269 / 233 against 239 / 215; 224 (padded there too) 4k 315 / 258 against 105 /
    # 106. At 1k the split kernels keep 160 and 192 (213 / 122 against 169 / 128 at 160, 200 / 149 against 200 /
    # 140 at 192): 2048 keys at least, as 80 and 96. 160 and 192 then ran split in the wide program (fused.chunks;
    # 12-01, 8th session): bf16 4k / 16k full 264 / 289 at 160 and 309 / 353 at 192 (cuDNN 269 / 257, 323 /
    # 299); at 1k still no better than the split kernels (bf16 full / causal: 180 / 123 against 205 / 116 at 160,
    # 202 / 132 against 203 / 150 at 192), so the rows keep 2048. 80 and 96 split in the narrow program (same
    # session): bf16 4k / 16k full 353 / 401 at 80 (was 310 / 349; cuDNN 349 / 362) and 372 / 432 at 96 (367 /
    # 407; cuDNN 398 / 418); at 1k 228 / 137 at 80 and 244 / 149 at 96 against the split kernels' 230 / 192 and
    # 271 / 202 (full / causal): 2048 keys at least there too. Then flash_bwd's split tiles got rows of their own
    # (12-02, 10th session: `lazytriton tune --kernel flash_bwd --head-dim 80,96,160,192`, 1k-16k), and at 160 the
    # two kernels beat the fused one at every seqlen, so 160 has no row: bench_flash_bwd.py, bf16 full / causal,
    # TFLOP/s two kernels (through the JIT) against fused, cuDNN: 4k 320 / 293 against 266 / 234 (270 / 242), 16k
    # 348 / 348 against 290 / 283 (266 / 261); fp16 alike. At 192 the fused one still wins from 4k (bf16 16k 350 /
    # 325 against 320 / 303; 4k level), at 80 and 96 by 10-30%. 12-02 (16th session): the narrow program's dQ by
    # chunk (one product and one reduction a warpgroup a step; ptxas 3.6 no longer spills there), bf16 TFLOP/s
    # against the kernel before (probe_fused_variants.py): hd96 full 4k 491 / 406, 16k 515 / 435, causal 4k 422 /
    # 361; hd80 full 4k 436 / 356, causal 16k 443 / 366; and at 1k, the two plans in turns (probe_bwd_overhead.py
    # --fused-from 1024), fused / two kernels: hd96 full 0.865, causal 0.933, hd80 full 0.916, causal 1.000 (kept)
    (80, False): (64, False, 1024),
    (80, True): (64, False, 2048),
    (96, False): (64, False, 1024),
    (96, True): (64, False, 1024),
    (192, False): (64, True, 2048),
    (192, True): (64, True, 1024),
    (224, False): (64, True, 1024),
    (224, True): (64, True, 1024),
}
BWD_FUSED_TABLE: dict[tuple[str, int, bool], BwdFusedTiling] = {
    (dtype, d, causal): row for dtype in ("bf16", "fp16") for (d, causal), row in _BWD_FUSED_BF16.items()}


def _bwd_fused_row(dtype: str, head_dim: int, causal: bool) -> BwdFusedTiling | None:
    """BWD_FUSED_TABLE's row for (dtype, head dim, causal), or None (none, or GLUON_BY_DEFAULT off)."""
    return BWD_FUSED_TABLE.get((dtype, head_dim, bool(causal))) if GLUON_BY_DEFAULT else None


def flash_bwd_fused_fits(dtype: str, head_dim: int, causal: bool, offset: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether a plain backward call is one the fused backward serves by default, as far as its shape says.

    A BWD_FUSED_TABLE row, seqlens that are positive multiples of its tiles (BLOCK_M queries, ``fused.block_n``),
    seqlen_k at least the row's minimum, a causal offset >= 0. Target, alignment and 64-bit offsets are the
    plan's to check (``flash_bwd_fused_default_variants``).
    """
    from lazytriton.kernels.flash_bwd import fused

    row = _bwd_fused_row(dtype, head_dim, causal)
    if row is None:
        return False
    block_m, _, min_seqlen_k = row
    return (0 < seqlen_q and seqlen_q % block_m == 0 and min_seqlen_k <= seqlen_k
            and seqlen_k % fused.block_n(head_dim) == 0 and (not causal or offset >= 0))


def flash_bwd_fused_default_variants(target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                                     index64: bool, seqlen_q: int, seqlen_k: int) -> tuple[Variant, Variant] | None:
    """The (flash_bwd_prep, flash_bwd_fused_gluon) variants for a call that ``flash_bwd_fused_fits``, or None.

    None also where the target, alignment or 64-bit offsets rule the kernel out (flash_bwd's kernels serve).
    """
    from lazytriton.kernels.flash_bwd import fused

    row = _bwd_fused_row(dtype, head_dim, causal)
    if row is None:
        return None
    block_m, prefetch, _ = row
    return fused.variants(str(target), dtype, head_dim, "top_left" if causal else "none", aligned, index64,
                          seqlen_q, seqlen_k, block_m, prefetch)


def flash_fwd_gluon_variant(target: Target, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool,
                            seqlen_q: int, seqlen_k: int, features: bool = False,
                            tiles: tuple[int, int, int] | None = None, scale: float = 1.0,
                            producer: bool = False, pingpong: bool = False, q_tiles: int = 1) -> Variant | None:
    """The ``flash_fwd_gluon`` variant for a call, or None where it cannot serve it (pure; see its rule)."""
    from lazytriton.kernels.flash_fwd import gluon

    return gluon.variant(str(target), dtype, head_dim, causal_mode(causal), aligned, index64, seqlen_q, seqlen_k,
                         features, tiles, scale, producer, pingpong, q_tiles)
