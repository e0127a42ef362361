"""flash_bwd's choices: the two kernels' default tiles and tuning rows, SEQ16, and when the Gluon kernels serve.

``variant`` gives the variant of ``flash_bwd_dq`` or ``flash_bwd_dkdv`` for a call (the attention kernels'
common fields from ``kernels.attention``, plus SEQ16). Where its tables have a row the call fits,
``flash_bwd_fused_default_variants`` gives the fused backward's two kernels in place of those two, and
``flash_bwd_dkdv_gluon_default_variant`` the Gluon dK/dV kernel in place of ``flash_bwd_dkdv``. Pure, given the
tuning table.
"""

from __future__ import annotations

from lazytriton import tuning
from lazytriton.geometry import value_pieces
from lazytriton.kernels import attention
from lazytriton.kernels.flash_bwd import fused, gluon
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import SMALL_SHARED_CUDA, Config, seqlen_class
from lazytriton.variant import Variant

BWD_KERNELS = ("flash_bwd_dq", "flash_bwd_dkdv")
# The switch of the Gluon kernels: False, dispatch never picks flash_bwd_dkdv_gluon nor the fused backward
# itself, whatever BWD_GLUON_TABLE and BWD_FUSED_TABLE say (they are then launched by variant only, as the
# probes and `lazytriton tune` do). Read when a shape is first described: set it (or edit a table) before the
# first call, or clear the runtime's plans after.
GLUON_BY_DEFAULT = True


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
    warps, 2 stages (2.67; 2.80). (64/128 at 4 warps ran the whole backward
    at 146 TFLOP/s against 345 in bench_flash_bwd.py.) The tuning table
    (kernels/flash_bwd/tuning.csv, ``lazytriton tune --kernel flash_bwd``)
    covers 1k-16k tokens for bf16/fp16 at head dims 64, 128 and 256 and the
    split head dims 80, 96, 160 and 192; these defaults serve the rest.
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
    elif target.capability in SMALL_SHARED_CUDA:
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


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """``kernels.dispatch.kernel_config`` for this family: the kernel's tuning row, else ``bwd_default_config``.

    ``split``: whether the variant runs in split tiles (``attention.table_config``); ``paged`` does not apply.
    """
    return attention.table_config(kernel, target, dtype, head_dim, causal, seqlen_q, seqlen_k, table, split,
                                  lambda padded: bwd_default_config(kernel, target, dtype, padded, seqlen_q,
                                                                    seqlen_k, causal))


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """``kernels.dispatch.kernel_variant`` for the backward's two kernels: the attention kernels' fields and SEQ16.

    ``SEQ16=true`` (the seqlens and lse strides are multiples of 16: more
    divisibility hints) is written only when set, and only with ALIGN16:
    ``seq16`` None decides by ``seq_aligned`` from the seqlens as given (not
    their buckets), which is why the backward's memo keys carry it. ``paged``
    and ``page_size`` do not apply; ``tma`` only refuses split tiles (these
    kernels have no TMA). ``bias_grad`` (a call with a bias that wants its
    gradient) writes ``BIAS_GRAD=true`` on flash_bwd_dq, the kernel that
    computes it (dS, from the tiles its dQ loop computes); flash_bwd_dkdv's
    variant is the bias call's. Never without ``bias``, nor with ``varlen``.
    """
    aligned, varlen = request.aligned, request.varlen
    seq16 = request.seq16
    if request.bias_grad and (not request.bias or varlen):
        raise ValueError(f"bias_grad=True (the bias's gradient) needs a dense call with a bias, got bias="
                         f"{request.bias}, varlen={varlen}")
    if seq16 is None:
        seq16 = seq_aligned(kernel, aligned, request.seqlen_q, request.seqlen_k, varlen)

    def seq16_field(fields: dict[str, bool | int], even: bool) -> None:
        if seq16 and kernel in BWD_KERNELS:
            if not aligned or varlen:
                raise ValueError(f"seq16=True needs an aligned call (ALIGN16) of dense sequences, got "
                                 f"aligned={aligned}, varlen={varlen}")
            fields["SEQ16"] = True
        if request.bias_grad and kernel == "flash_bwd_dq":
            fields["BIAS_GRAD"] = True

    return attention.variant(kernel, target, request, kernel_config, seq16_field)


# ---------------------------------------------------------------------------
# flash_bwd_dkdv_gluon: the Gluon (FlashAttention-3-style) dK/dV kernel, an alternative to flash_bwd_dkdv
# (kernels/flash_bwd/gluon.py has its rule). Served, under the same master switch GLUON_BY_DEFAULT, where
# BWD_GLUON_TABLE has a row for the call's (dtype, head dim, causal), its tiles divide the seqlens and
# seqlen_k reaches the row's minimum (flash_bwd_gluon_fits; the backward's memo key carries the answer,
# binding.GLUON_TAIL). The rows are where it won in the whole backward: the probe (benchmarks/
# probe_gluon_bwd.py, bf16, Triton 3.6, 2026-12-01) timed the dK/dV kernel alone, gluon over Triton, at
# 1.06-1.18x for head dim 128 and head dim 64 causal from 4k tokens (0.78-0.97x at 1k and at head dim 64
# non-causal, hence the minimum seqlen). Served through bench_flash_bwd.py, of the three candidate rows only
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
# (0.90x at 1k), causal 1.00-1.17x from 4k with BLOCK_M 64 and the rows prefetched (0.93x at 1k). Head dim 256
# (64 keys a program, the warpgroups split by columns; probe of 2026-12-01): 1.44-2.19x the two kernels and
# 0.88-1.09x cuDNN from 1k, lse and delta prefetched. At 1k keys the prep and the accumulator's 4 bytes an element
# (written, read and cast) weigh most, so a row starts at 1k keys only where the fused plan is faster there, the
# two plans timed in turns (the rows' comments); else at 2k. fp16 takes bf16's rows.
BwdFusedTiling = tuple[int, bool, int]  # BLOCK_M, PREFETCH, min seqlen_k
_BWD_FUSED_BF16: dict[tuple[int, bool], BwdFusedTiling] = {
    # Time fused / two kernels at 1k keys, bf16 / fp16 (H200, probe_bwd_overhead.py --fused-from 1024: the two plans
    # timed in turns, 2026-12-02). From 1k: hd128 full 1.009 and 1.000 bf16, 0.973 and 0.957 fp16 over two runs; with
    # head_dim marked 8-divisible (KernelSpec.eight_params: the dK/dV stores and the prep's loads 16 bytes wide)
    # hd128 causal 0.853 / 0.846, hd64 full 0.915 / 0.904, hd192 causal 0.971 / 0.950. From 2k: hd64 causal 1.064 /
    # 1.061, hd192 full 1.101 / 1.130 (80 and 96: below)
    (128, False): (64, False, 1024),
    (128, True): (64, False, 1024),
    (64, False): (128, False, 1024),
    (64, True): (64, True, 2048),
    (256, False): (64, True, 1024),
    (256, True): (64, True, 1024),
    # Head dims between the powers of two: 224 in 256's padded tile (fused.tile), 80 and 96 in two chunks in the
    # narrow program, 192 in the wide one (fused.chunks). H200, bf16 TFLOP/s, full / causal. 224, bench_flash_bwd.py
    # (2026-12-01): 4k 315 / 258 against the two kernels' 105 / 106 (padded there too). Split (2026-12-01), 4k / 16k
    # full: 353 / 401 at 80 (310 / 349 in 128's padded tile; cuDNN 349 / 362), 372 / 432 at 96 (367 / 407; cuDNN
    # 398 / 418), 309 / 353 at 192 (cuDNN 323 / 299). Against flash_bwd's split tiles with tuned rows (`lazytriton
    # tune --kernel flash_bwd --head-dim 80,96,160,192`, 1k-16k; bench_flash_bwd.py, 2026-12-02, the two kernels
    # through the JIT) the fused program wins at 80 and 96 by 10-30%, at 192 from 4k
    # (16k 350 / 325 against 320 / 303; 4k level); at 160 it loses at every seqlen, so 160 has no row (two kernels
    # against fused, cuDNN: 4k 320 / 293 against 266 / 234 (270 / 242), 16k 348 / 348 against 290 / 283 (266 /
    # 261); fp16 alike). The narrow program computes dQ by chunk (one product and one reduction a warpgroup a step,
    # which ptxas 3.6 compiles without spills), bf16 TFLOP/s against each warpgroup taking half of each chunk
    # (probe_fused_variants.py, 2026-12-02): hd96 full 4k 491 / 406, 16k 515 / 435, causal 4k 422 / 361; hd80 full
    # 4k 436 / 356, causal 16k 443 / 366; at 1k, the two plans in turns (probe_bwd_overhead.py --fused-from 1024),
    # fused / two kernels: hd96 full 0.865, causal 0.933, hd80 full 0.916, causal 1.000 (level: from 2k)
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
    row = _bwd_fused_row(dtype, head_dim, causal)
    if row is None:
        return None
    block_m, prefetch, _ = row
    return fused.variants(str(target), dtype, head_dim, "top_left" if causal else "none", aligned, index64,
                          seqlen_q, seqlen_k, block_m, prefetch)


def prewarm_alignments(kernel: str, aligned: tuple[bool, ...]) -> tuple[tuple[bool, bool], ...]:
    """(ALIGN16, SEQ16) pairs of prewarm's ``aligned`` axis: an aligned backward call has SEQ16 or not.

    Both, so that an odd length (or packed sequences, which never have SEQ16)
    with aligned tensors is served as well as 4096 is.
    """
    return tuple(pair for a in aligned for pair in (((True, True), (True, False)) if a else ((False, False),)))


# The feature flags prewarm plans the backward kernels with: all but attention sinks, which reach the backward
# through the forward's lse alone (its variants are the plain call's).
PREWARM_FEATURES = ("window", "softcap", "varlen", "seqused", "alibi", "dropout", "bias", "bias_grad", "leftpad",
                    "chunk")


def prewarm_head_dims_v(head_dim_v: int) -> tuple[int, ...]:
    """The v head dims a call with v of ``head_dim_v`` columns runs these kernels at, for prewarm's --head-dim-v.

    Up to 256 its own; 257..512 v's two pieces (``geometry.value_pieces``; ``lazytriton.value_split``).
    """
    return value_pieces(head_dim_v)


def prewarm_twins(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                  index64: bool, seqlen_q: int, seqlen_k: int) -> list[tuple[Variant, str]]:
    """The variants beside the two kernels' that a plain backward of this shape runs, for prewarm.

    With ``flash_bwd_dkdv``: the Gluon dK/dV kernel (``BWD_GLUON_TABLE``) and
    the fused backward's two kernels (``BWD_FUSED_TABLE``; an image holds them
    beside flash_bwd's, which deterministic mode runs). Causal calls are
    bottom-right, as the forward's.
    """
    offset = seqlen_k - seqlen_q if causal else 0
    if kernel != "flash_bwd_dkdv" or offset < 0:
        return []
    twins: list[tuple[Variant, str]] = []
    if flash_bwd_gluon_fits(dtype, head_dim, causal, offset, seqlen_q, seqlen_k):
        found = flash_bwd_dkdv_gluon_default_variant(target, dtype, head_dim, causal, aligned, index64, seqlen_q,
                                                     seqlen_k)
        twins += [] if found is None else [(found, "gluon table")]
    if flash_bwd_fused_fits(dtype, head_dim, causal, offset, seqlen_q, seqlen_k):
        pair = flash_bwd_fused_default_variants(target, dtype, head_dim, causal, aligned, index64, seqlen_q, seqlen_k)
        twins += [(variant, "fused table") for variant in pair or ()]
    return twins
