"""flash_decode's choices: the split and combine kernels' default tiles, their tuning rows, and their variants.

Pure, given the tuning table. Prewarm, ``cache explain`` and tune describe a decoding call by its query rows
per key/value head and its cache capacity, as the binding does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lazytriton import tuning
from lazytriton.geometry import padded_value_dim
from lazytriton.kernels.flash_decode import kv_fp8 as fp8
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import SMALL_SHARED_CUDA, Config
from lazytriton.variant import Variant, pairs

DECODE_KERNELS = ("flash_decode_split", "flash_decode_combine")
# A contiguous float8 cache's split tiles hold twice the 16-bit tiles' keys up to this head dim (MLA's v of 512
# keeps its own).
MAX_FP8_DOUBLED_DIM = 256
# Where a float8 tile was measured on a CUDA target, it replaces the doubled one: rows (head dim, paged, the least
# capacity bucket and the fewest (sequence, key/value head) pairs it serves from, BLOCK_N, num_warps, num_stages),
# the last row of the head dim and layout whose two least values the call reaches winning (``fp8_cuda_tile``).
# Head dim 128 (H100, experiments/probe_decode_fp8_tiles.py at the heuristic's split counts, batches 1-32 x 4k-32k
# keys, 8 key/value heads, the float16 dots; benchmarks/NOTES.md): 64 keys x 4 warps beat the doubled 16-bit tile
# (256 keys x 4 warps x 2 stages) by 5% geomean; 128 keys win from 32k keys at every batch (batch 1 / 32: 0.0361 /
# 0.7106 ms against 0.0369 / 0.7396), from 16k keys from 32 pairs (batch 4: 0.0626 against 0.0638; batch 1 keeps
# 64: 0.0211 against 0.0224), and at 4k keys from 256 pairs (batch 32: 0.0981 against 0.1022; batch 8 keeps 64:
# 0.0356 against 0.0363). Pages of 256 keys: the block table's read takes a pipeline stage, so their tiles take 5;
# 128 keys win from 32k keys, from 16k from 16 pairs (batch 2: 0.0388 against 0.0401; batch 1 keeps 64: 0.0230
# against 0.0235) and from 4k keys from 64 pairs (batch 8 / 32: 0.0367 / 0.0980 against 0.0384 / 0.1137; batch 2
# keeps 64: 0.0160 against 0.0175). Gathered pages (``page_gather``) keep the 16-bit tiles.
FP8_CUDA_TILES: tuple[tuple[int, bool, int, int, int, int, int], ...] = (
    (128, False, 0, 0, 64, 4, 3), (128, False, 4096, 256, 128, 4, 3), (128, False, 16384, 32, 128, 4, 3),
    (128, False, 32768, 0, 128, 4, 3),
    (128, True, 0, 0, 64, 4, 5), (128, True, 4096, 64, 128, 4, 5), (128, True, 16384, 16, 128, 4, 5),
    (128, True, 32768, 0, 128, 4, 5),
)


def fp8_cuda_tile(head_dim: int, capacity_bucket: int, paged: bool = False,
                  kv_pairs: int = 0) -> tuple[int, int, int] | None:
    """The measured float8 tile (BLOCK_N, num_warps, num_stages) of a head dim, layout and capacity bucket.

    ``kv_pairs``: the call's (sequence, key/value head) pairs (0: the fewest).
    """
    found = None
    for dim, on_pages, least, least_pairs, block_n, num_warps, num_stages in FP8_CUDA_TILES:
        if dim == head_dim and on_pages == paged and least <= capacity_bucket and least_pairs <= kv_pairs:
            found = (block_n, num_warps, num_stages)
    return found


def fp8_pairs_class(kv_pairs: int) -> int:
    """The least pair count of ``FP8_CUDA_TILES`` a call of ``kv_pairs`` pairs reaches (pure).

    Calls of one class are served alike, so the memo keys and prewarm's plan carry the class, not the count.
    """
    return max((least for *_, least, _, _, _ in FP8_CUDA_TILES if least <= kv_pairs), default=0)


# The pair classes prewarm plans a float8 cache's decoding calls at (each class's tiles; the same variant twice
# where a head dim or target has no measured tile, merged by its key).
PREWARM_KV_PAIRS = tuple(sorted({least for *_, least, _, _, _ in FP8_CUDA_TILES}))


MIN_BLOCK_N = 16  # the narrowest key tile: tl.dot takes no side under 16
# Pages whose largest power-of-two divisor is under this many keys are read key by key (PAGE_GATHER), at the paged
# call's tuned tiles, not in tiles that divide the page: on an H100 (bench_decode.py --page-size 1,16,256, batches
# 1/8/64 at 4k and 32k keys, head dim 128, 32/8 heads) pages of 16 keys in 16-key tiles ran 0.50-0.81x SDPA, pages
# of 1 key gathered 0.85-0.97x, pages of 256 in the tuned tiles 0.97-0.99x.
GATHER_BELOW = 64
# A feature's code takes the split kernel's tile past 128 registers a thread at head dims up to 128 (sm_90, bf16,
# Triton 3.9: the 4-warp tile of 64 keys at head dim 128 takes 108 plain, 130-141 with LEFTPAD, SINKS, WINDOW,
# ALIBI, CHUNK, KEY_MASK or VARLEN_Q; the 8-warp tile of 128 keys 134-137 with SINKS, LEFTPAD, WINDOW, ALIBI or
# ROTARY), so an SM holds 3 of its 4-warp programs instead of 4 (1 of its 8-warp ones instead of 2): batch 64 at 4k
# keys, 512 programs, then runs in two waves, 12% slower with sinks or a left pad (H100, bench_decode.py). On CUDA
# such a variant is compiled with at most this many registers (Triton's ``maxnreg``): the plain tile's occupancy,
# at 0-32 bytes of stack (Triton 3.6, sm_90, 16-byte aligned tensors, head dims 40 and 128, every feature). The plain
# variants keep the compiler's own count, and so do two kinds whose count the cap would halve: unaligned ones
# (ALIGN16=false: 192-255 registers, capped 160-608 bytes of stack) and gathered pages' (PAGE_GATHER: a pointer a
# key: 106-255 registers by tile and alignment). Capped, Triton 3.6's sm_90 binary of an unaligned gathered
# one (fp16, head dim 40, a window) got out wrong by 1.2 on an H100 (tests/test_kvcache.py); uncapped, right.
FEATURE_MAX_REGISTERS = 128
FEATURE_FLAGS = ("WINDOW", "SOFTCAP", "ALIBI", "LEFTPAD", "ROTARY", "SINKS", "VARLEN_Q", "CHUNK", "QV", "KEY_MASK")
MAX_CAPPED_HEAD_DIM = 128  # wider tiles need more registers plain (144 at head dim 256): not capped


# The combine kernel's tile: rows a program, and splits a step up to 4096 float32 outputs (32 a thread at 4 warps).
COMBINE_BLOCK_M = 1
COMBINE_TILE_ELEMENTS = 4096
COMBINE_MAX_BLOCK_N = 32
COMBINE_MIN_BLOCK_N = 4


# The split kernel merges its own partials (FUSED_COMBINE=true: the last program of each row block to finish runs
# the combine kernel's merge of that block, ``counters.py``): one launch instead of two where a call has several
# splits. Off: slower than the two kernels on an H100 (0.82-0.97x at batch 1 and 8, 1k and 4k keys: the last
# program's merge costs more than the launch it saves; benchmarks/NOTES.md, bench_decode.py --fused-combine,
# experiments/probe_decode_b1.py --fused). Read on every call, by the general path (its memo key) and the warm path
# (its table's key), so ``fusing_combine`` turns it on for the calls of a block. While it is off, prewarm plans
# what it planned; the C API (capi/lt_kvcache.c's launch, capi/embedded_kvcache.py's planner and
# capi/native/lt_decode_choice.c's native choice) plans and launches the two kernels whatever it says: turning it
# on by default takes them too (a counters buffer a stream in the C launcher).
FUSED_COMBINE_BY_DEFAULT = False


@contextmanager
def fusing_combine(on: bool = True) -> Iterator[None]:
    """Calls in this block fuse the combine (``on``) or not, whatever ``FUSED_COMBINE_BY_DEFAULT`` says.

    It sets the process's switch for the block (every thread's calls): what bench_decode.py's
    ``lazytriton_fused`` provider and experiments/probe_decode_b1.py time, interleaved with calls without it.
    """
    global FUSED_COMBINE_BY_DEFAULT
    saved, FUSED_COMBINE_BY_DEFAULT = FUSED_COMBINE_BY_DEFAULT, bool(on)
    try:
        yield
    finally:
        FUSED_COMBINE_BY_DEFAULT = saved


def combine_block_n(head_dim: int) -> int:
    """The combine kernel's splits a step at a (padded) value head dim: 32 up to 128, 16 at 256, 8 at 512."""
    return max(COMBINE_MIN_BLOCK_N, min(COMBINE_MAX_BLOCK_N, COMBINE_TILE_ELEMENTS // max(1, head_dim)))


def decode_rows_class(rows: int) -> int:
    """BLOCK_M for ``rows`` packed query rows per key/value head (group size x seqlen_q): 16, 32 or 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def page_block_limit(page_size: int) -> int:
    """The largest BLOCK_N that divides ``page_size`` (its largest power-of-two divisor); 0 (contiguous): none."""
    return page_size & -page_size if page_size > 0 else 1 << 30


def page_gather(page_size: int) -> bool:
    """Whether a paged cache of ``page_size`` keys a page is read key by key (PAGE_GATHER=true).

    A key block read through one block-table entry must lie in one page, so
    its BLOCK_N must divide the page size. Pages only narrow tiles divide
    (their largest power-of-two divisor under ``GATHER_BELOW``: 1 to 32 keys,
    or 12, 24, 48, 100...) are read key by key instead, each key's page from
    the table, at the tiles of a paged call: faster than the narrow tiles, and
    the only way for pages no tile divides (under ``MIN_BLOCK_N``). 0 (a
    contiguous cache): no.
    """
    return page_size > 0 and page_block_limit(page_size) < GATHER_BELOW


def key_block_limit(page_size: int) -> int:
    """The widest BLOCK_N the split kernel may take at ``page_size``: what divides the page, unless it is gathered.

    Contiguous caches (0) and gathered pages (``page_gather``) set no limit.
    """
    return 1 << 30 if page_gather(page_size) else page_block_limit(page_size)


def decode_default_config(kernel: str, target: Target, dtype: str, head_dim: int, rows: int,
                          page_size: int = 0, paged: bool = False) -> Config:
    """A sane decoding config when the tuning table has no row (it never errors). Untuned: no GPU measured it yet.

    Decoding reads the whole cache once per call and is bound by memory, not
    by tensor cores, so the split kernel takes the smallest query tile a dot
    allows (16 rows: a GQA group of 4 with one query fills 4 of them) and key
    tiles of 64 rows (128 at head dim <= 64 contiguous, 32 at head dim 256 or fp32), 4 warps,
    3 stages of loads in flight where shared memory allows (2 on the 99 KiB
    targets and AMD). A paged call's BLOCK_N must divide its page size; pages
    of fewer than ``GATHER_BELOW`` keys (or whose largest power-of-two divisor
    is) are gathered (``page_gather``) at the tiles of pages of 64. A paged call reads its
    block table inside the loop, and Triton's pipeliner gives that read a
    stage of its own: at 3 (and 4) stages the K and V tiles get one buffer,
    at 5 two, as the contiguous kernel has at 3 (Triton 3.9's TTGIR for
    sm_90, bf16, head dim 128: 71696 bytes of shared memory at 5 stages,
    38928 at 3 and 4; 71680 for the contiguous kernel at 3). So paged calls
    on CUDA take 5 stages (at most 76 KB, under the 99 KiB targets' limit).
    Not measured on a GPU yet. The combine kernel reads 16 rows x 16 splits
    of logsumexp at a time.

    A value head dim of 512 (DeepSeek's MLA, ``head_dim`` here being the
    larger of the two) holds a [BLOCK_M, 512] float32 accumulator and, with
    QV, a [BLOCK_M, 512] qv tile in registers: 8 warps and at most 32 rows a
    program (64 registers a thread for each), 32 keys a tile (32 KB of V at
    16 bits), 3 stages (2 on the 99 KiB targets and AMD), paged or not.
    Chosen from those register and shared-memory counts; not measured on a GPU.

    The combine kernel takes one row a program (``COMBINE_BLOCK_M``) and a
    row's splits in one step up to ``combine_block_n`` of them: the few rows
    of a small batch then spread over as many programs, each reading its
    splits' outputs in one round trip.
    """
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
    hip = target.backend == "hip"
    waves = 2 if hip else 0
    if kernel == "flash_decode_combine":
        return Config(COMBINE_BLOCK_M, combine_block_n(head_dim), 4, 1, waves)
    # Equal bytes per tile across head dims (16 KB of K and 16 KB of V per step at 16 bits): 128 keys at
    # head dim <= 64, 64 at 128, 32 at 256 or fp32 (registers). A paged call keeps at most 64 keys, so that one
    # default binary serves every page size that is a multiple of 64 (what prewarm plans).
    block_n = 32 if head_dim == 256 or dtype == "fp32" else 128 if head_dim <= 64 and not paged else 64
    stages = 2 if hip or target.capability in SMALL_SHARED_CUDA else 3
    if head_dim > 256:
        return Config(min(decode_rows_class(rows), 32), min(32, key_block_limit(page_size)), 8, stages, waves)
    if paged and not hip:
        stages = 5
    return Config(decode_rows_class(rows), min(block_n, key_block_limit(page_size)), 4, stages, waves)


def decode_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, rows: int, capacity: int,
                  page_size: int = 0, table: tuning.Table | None = None,
                  paged: bool = False) -> tuple[Config, tuning.Row | None]:
    """A decoding kernel's config: its tuning row (rows: seqlen_q column, cache capacity: seqlen_k), else the default.

    A row's BLOCK_N is cut down to what the page size allows (``key_block_limit``), and the split kernel's
    BLOCK_M to the rows' class (``decode_rows_class``): a row tuned for groups of 32 rows (MQA) serves a group of
    8 too, whose rows a 32-row tile would pad fourfold.
    """
    padded = padded_value_dim(head_dim)
    rows_table = tuning.table_for(kernel) if table is None else table
    row = tuning.lookup(rows_table, str(target), kernel, dtype, padded, causal, rows, capacity)
    if row is None:
        return decode_default_config(kernel, target, dtype, padded, rows, page_size, paged), None
    split = kernel == "flash_decode_split"
    limit = key_block_limit(page_size) if split else 1 << 30
    block_m = min(row.BLOCK_M, 64, decode_rows_class(rows) if split else 64)
    return Config(block_m, min(row.BLOCK_N, limit), row.num_warps, row.num_stages, row.waves_per_eu), row


def decode_variant(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool, rows: int,
                   capacity: int, config: Config | None = None, index64: bool = False,
                   table: tuning.Table | None = None, page_size: int = 0, paged: bool = False,
                   window: bool = False, softcap: bool = False, alibi: bool = False, head_dim_v: int = 0,
                   leftpad: bool = False, rotary: bool = False, rotary_interleaved: bool = False,
                   sinks: bool = False, varlen_q: bool = False, chunk: bool = False,
                   kv_fp8: str = fp8.NONE, qv: bool = False, key_mask: bool = False,
                   fused_combine: bool = False, kv_pairs: int = 0) -> Variant:
    """The variant of a decoding kernel serving a call (pure, given the table).

    ``rows``: query rows per key/value head (group size x seqlen_q), seen
    through their bucket; ``capacity``: the cache's length per sequence
    (table lookup only). The split kernel's functional fields are the
    attention kernels' (ALIGN16, BLOCK_D, CAUSAL, EVEN_D, INDEX64) plus the
    flags PAGED, WINDOW, SOFTCAP, ALIBI, LEFTPAD (cache_leftpad),
    PAGE_GATHER (a paged call at a ``page_size`` no key tile divides) and
    ROTARY with ROTARY_INTERLEAVED (the query rotated by rotary_cos/rotary_sin,
    pairs or halves; ``rotary_interleaved`` counts only with ``rotary``), written
    only when true; a given ``config``'s BLOCK_N is cut to what ``page_size``
    allows, as a tuning row's is. The
    combine kernel has only ALIGN16, BLOCK_D, EVEN_D and INDEX64 (it sees no
    scores). With one query a causal mask hides nothing: the binding asks for
    CAUSAL=false then, so both share a binary. ``head_dim_v`` (0: the same
    as ``head_dim``): v's head dim; the split kernel gets ``BLOCK_DV``/``EVEN_DV``
    where its padded size or evenness differs (the attention kernels' rule) and
    the tiles of the larger head dim; the combine kernel sees only outputs, so
    its head dim is v's. ``sinks`` (attention sinks) is SINKS=true on both
    kernels, written only when set: one split adds them, the combine the rest.
    ``varlen_q`` (queries packed by cu_seqlens_q; ``rows`` from the longest
    sequence) is VARLEN_Q=true on the split kernel, written only when set;
    ``chunk`` (FlashAttention-3's attention_chunk) is CHUNK=true on the split
    kernel, written only when set (the combine kernel sees no scores).
    ``kv_fp8`` (a float8 cache: ``e4m3``, ``e5m2``) is KV_FP8 on the split
    kernel, written only for one; a target that cannot build it (``kv_fp8.unsupported``)
    raises ValueError naming k_cache. Its tiles are the call's dtype's, with twice the keys in a contiguous
    cache (head dims up to ``MAX_FP8_DOUBLED_DIM``): the same bytes a tile as the 16-bit cache's, so as many
    bytes in flight; on CUDA, a head dim with a measured float8 tile (``fp8_cuda_tile``, by layout, capacity and
    ``kv_pairs``: the call's (sequence, key/value head) pairs, batch x heads_k; 0 the fewest) takes that one
    (``experiments/probe_decode_fp8_tiles.py``, batch 1-32, 4k-32k keys; benchmarks/NOTES.md). A paged cache
    takes its measured tile where one exists, cut to what the page size allows, and otherwise keeps the 16-bit
    tiles, as gathered pages always do.
    ``qv`` (FlashAttention-3's qv, DeepSeek's MLA: the scores add qv . v) is QV=true on the split kernel,
    written only when set; ``head_dim`` is then q's and k's without qv's columns (MLA's 64 beside v's 512).
    v's head dim goes up to 512 (``geometry.padded_value_dim``), q's and k's to 256.
    ``key_mask`` (lazytriton's per-(batch, key) boolean mask, ``key_mask.py``) is KEY_MASK=true on the split kernel,
    written only when set, at the tiles of the call without it.
    ``fused_combine`` (the split kernel merges its own partials: ``FUSED_COMBINE_BY_DEFAULT``) is FUSED_COMBINE=true
    on the split kernel, written only when set, at the same tiles.
    """
    dv = head_dim_v or head_dim
    if kernel == "flash_decode_combine":
        head_dim = dv
    padded, padded_v = padded_value_dim(head_dim), padded_value_dim(dv)
    sq, sk = tuning.bucket(rows), tuning.bucket(capacity)
    split = kernel == "flash_decode_split"
    cfg = config or decode_config(kernel, target, dtype, max(head_dim, dv), causal, sq, sk, page_size, table,
                                  paged and split)[0]
    if (config is None and split and kv_fp8 != fp8.NONE and max(head_dim, dv) <= MAX_FP8_DOUBLED_DIM
            and not (paged and page_gather(page_size))):
        measured = fp8_cuda_tile(max(head_dim, dv), sk, paged, kv_pairs) if target.backend == "cuda" else None
        if measured is not None:
            cfg = Config(cfg.block_m, *measured, cfg.waves_per_eu)
        elif not paged:
            cfg = Config(cfg.block_m, 2 * cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.waves_per_eu)
    if split and paged and cfg.block_n > key_block_limit(page_size):
        cfg = Config(cfg.block_m, key_block_limit(page_size), cfg.num_warps, cfg.num_stages, cfg.waves_per_eu)
    functional: dict[str, bool | int | str] = {"ALIGN16": bool(aligned), "BLOCK_D": padded,
                                               "EVEN_D": head_dim == padded, "INDEX64": bool(index64)}
    if (padded_v, dv == padded_v) != (padded, head_dim == padded):
        functional.update(BLOCK_DV=padded_v, EVEN_DV=dv == padded_v)
    if split:
        functional["CAUSAL"] = bool(causal)
        for name, flag in (("PAGED", paged), ("WINDOW", window), ("SOFTCAP", softcap), ("ALIBI", alibi),
                           ("LEFTPAD", leftpad), ("PAGE_GATHER", paged and page_gather(page_size)),
                           ("ROTARY", rotary), ("ROTARY_INTERLEAVED", rotary and rotary_interleaved),
                           ("VARLEN_Q", varlen_q), ("CHUNK", chunk), ("QV", qv), ("KEY_MASK", key_mask),
                           ("FUSED_COMBINE", fused_combine)):
            if flag:
                functional[name] = True
        fp8.require(target, kv_fp8)
        functional.update(fp8.flags(kv_fp8))
    if sinks:
        functional["SINKS"] = True
    options = cfg.options(target)
    if split and capped_registers(target, max(padded, padded_v), functional):
        options["maxnreg"] = FEATURE_MAX_REGISTERS
    return Variant(kernel, str(target), dtype, pairs(functional), pairs(cfg.tuned()), pairs(options))


def capped_registers(target: Target, padded_dim: int, functional: dict[str, bool | int | str]) -> bool:
    """Whether a split variant is compiled with ``FEATURE_MAX_REGISTERS`` registers a thread (pure).

    On CUDA, at a padded head dim (the larger of q's and v's) up to ``MAX_CAPPED_HEAD_DIM``, with one of
    ``FEATURE_FLAGS`` set, its tensors 16-byte aligned (ALIGN16) and its pages not gathered (PAGE_GATHER).
    """
    return (target.backend == "cuda" and padded_dim <= MAX_CAPPED_HEAD_DIM and functional.get("ALIGN16") is True
            and functional.get("PAGE_GATHER") is not True
            and any(functional.get(name) is True for name in FEATURE_FLAGS))


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """``kernels.dispatch.kernel_config`` for this family: ``decode_config`` (``paged`` for the split kernel only).

    ``seqlen_q`` is the query rows per key/value head and ``seqlen_k`` the cache's capacity; ``split`` does not
    apply (no split tiles).
    """
    return decode_config(kernel, target, dtype, head_dim, causal, seqlen_q, seqlen_k, table=table,
                         paged=paged and kernel == "flash_decode_split")


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """``kernels.dispatch.kernel_variant`` for the decoding kernels: ``decode_variant``.

    At ``request.page_size`` (0: a page size BLOCK_N divides, prewarm's
    default view of a paged call; one no key tile divides: PAGE_GATHER).
    ``tma``, ``bias``, ``dropout``, ``varlen`` (the attention kernels' packed
    keys; packed queries are ``varlen_q``), ``split_d`` and ``seq16`` do not apply.
    The split kernel's FUSED_COMBINE is ``FUSED_COMBINE_BY_DEFAULT``'s (what a call runs now).
    """
    return decode_variant(kernel, target, request.dtype, request.head_dim, request.causal, request.aligned,
                          request.seqlen_q, request.seqlen_k, config=request.config, index64=request.index64,
                          table=request.table, page_size=request.page_size, paged=request.paged,
                          window=request.window, softcap=request.softcap, alibi=request.alibi,
                          head_dim_v=request.head_dim_v, leftpad=request.leftpad, rotary=request.rotary,
                          rotary_interleaved=request.rotary_interleaved, sinks=request.sinks,
                          varlen_q=request.varlen_q, chunk=request.chunk, kv_fp8=request.kv_fp8, qv=request.qv,
                          key_mask=request.key_mask, fused_combine=FUSED_COMBINE_BY_DEFAULT,
                          kv_pairs=request.kv_pairs)


# Prewarm's default grid for decoding calls: what decoding serves (bf16 and fp16, head dims 64 and 128), a
# contiguous and a paged cache (pages of any multiple of 64 keys; prewarm's --page-size plans others, such as
# the gathered pages of 1 key), one query-row count per BLOCK_M class (seqlen_q stands for query rows per
# key/value head: group size x seqlen_q). Their calls have no varlen, dropout or bias variants; a call with new
# keys launches kv_append first, so it is planned with them.
PREWARM_DTYPES = ("bf16", "fp16")
PREWARM_HEAD_DIMS = (64, 128)
PREWARM_SEQLENS = (16, 32, 64)
PREWARM_PAGED = True
PREWARM_FEATURES = ("window", "softcap", "alibi", "leftpad", "rotary", "varlen_q", "sinks", "chunk", "kv_fp8", "qv",
                    "key_mask")
PREWARM_WITH = ("kv_append",)
PREWARM_MAX_HEAD_DIM_V = 512  # DeepSeek's MLA: v of 512 (--head-dim-v 512, with --qv for its latent cache)


def explained(kernel: str, target: Target, call: Request) -> tuple[Variant, Config, tuning.Row | None]:
    """``kernels.dispatch.choice`` for a decoding kernel: its variant for the call's page size, config and row.

    The split kernel's tiles are those of the larger head dim; the combine kernel sees only outputs (v's).
    """
    split = kernel == "flash_decode_split"
    dim_v = call.head_dim_v or call.head_dim
    dim = max(call.head_dim, dim_v) if split else dim_v
    config, row = decode_config(kernel, target, call.dtype, dim, call.causal, call.seqlen_q, call.seqlen_k,
                                call.page_size, paged=call.paged and split)
    return variant(kernel, target, call), config, row
