"""Which variants to build: the ones dispatch would select, from axes, a tuning table or a miss log.

Everything here is pure: the tuning table, the axes and the miss-log lines
come in as values, and the tests call these functions with made-up tables.

Every kernel of every family is enumerated the same way (``flash_fwd``, and
``flash_bwd_dq`` and ``flash_bwd_dkdv`` of the family ``flash_bwd``): they
share their functional fields and dispatch picks each one's config through
``dispatch.kernel_config``. For each target and kernel, a *group* is (dtype,
padded head dim, causal). A group the tuning table has rows for is built at
the table's seqlen buckets (every row of it, so every config dispatch can pick
from the table); a group the table lacks is built at one seqlen per default
class (16, 64 and 4096, standing for <= 16, <= 64 and > 64 rows), with
seqlen_k = seqlen_q. That is every config dispatch can pick for it: the
defaults read the class of seqlen_q (``flash_fwd``, ``flash_bwd_dq``: the
query tile) or of seqlen_k (``flash_bwd_dkdv``: the key tile), and the pairs
(16, 16), (64, 64), (4096, 4096) cover every class of both. With no axis
given, the groups are the default grid:

    kernel    every kernel of every family (kernels.FAMILIES)
    dtype     fp16, bf16, fp32
    head dim  16, 32, 64, 128, 256 (the padded sizes; any 1..256 may be asked for)
    causal    none, causal (top_left and bottom_right share the causal binary)
    seqlen    the table's buckets for the group, else 16, 64, 4096
    aligned   true (``--unaligned`` adds false); for the backward kernels, true
              is two variants: SEQ16 (dense calls whose seqlens are multiples
              of 16) and ALIGN16 alone (any other length, and packed sequences)
    index64   false (``--index64`` adds true: calls where a tensor spans 2**31 elements or more)
    window    false (``--window`` adds true: calls with a sliding window, WINDOW=true)
    softcap   false (``--softcap`` adds true: calls with a logit softcap, SOFTCAP=true)
    varlen    false (``--varlen`` adds true: packed sequences, VARLEN=true, seqlens as max_seqlen; for kv_append
              new keys packed by cu_seqlens_k_new)
    seqused   false (``--seqused`` adds true: packed calls with FlashAttention-3's seqused_q, seqused_k or both,
              SEQUSED_Q=true and SEQUSED_K=true; only where varlen is true)
    alibi     false (``--alibi`` adds true: calls with ALiBi slopes, ALIBI=true)
    dropout   false (``--dropout`` adds true: calls with dropout_p > 0, DROPOUT=true)
    bias      false (``--attn-mask`` adds true: SDPA calls with an attn_mask, BIAS=true)
    bias_grad false (``--bias-grad`` adds true: with bias, dense backward calls that also write the mask's
              gradient, BIAS_GRAD=true on flash_bwd_dq; the other kernels' variants are the bias call's)
    leftpad   false (``--leftpad`` adds true: decoding calls with cache_leftpad, LEFTPAD=true)
    rotary    none (``--rotary`` adds interleaved, halves or both: decoding calls with rotary_cos/rotary_sin,
              ROTARY=true and, interleaved, ROTARY_INTERLEAVED=true, on the split kernel and kv_append)
    sinks     false (``--sinks`` adds true: calls with attention sinks, SINKS=true: the forward kernels, with the
              Gluon forward's twins, and the decoding kernels; the backward kernels take none)
    varlen_q  false (``--varlen-q`` adds true: decoding calls with queries packed by cu_seqlens_q, VARLEN_Q=true
              on the split kernel)
    chunk     false (``--attention-chunk`` adds true: calls with FlashAttention-3's attention_chunk, CHUNK=true on
              flash_fwd, flash_bwd_dq, flash_bwd_dkdv, flash_fwd_mla (with qv) and flash_decode's split kernel;
              the chunk size is a runtime argument, so one variant serves every size)
    key_mask  false (``--key-mask`` adds true: decoding calls under lazytriton's per-(batch, key) boolean mask,
              KEY_MASK=true on the split kernel: what the transformers integration's decoding steps run)
    qv        false (``--qv`` adds true: decoding calls with FlashAttention-3's qv or MLA's latent cache, QV=true
              on the split kernel; not with a float8 cache)
    kv_fp8    none (``--kv-dtype`` adds e4m3, e5m2 or both: decoding calls on a float8 cache, KV_FP8 on the
              split kernel, kv_append and kv_slots; a target without the format, sm_80 and sm_86 for e4m3, leaves
              it out: ``left_out`` says why)
    page size pages of any multiple of 64 keys (``--page-size`` gives the decoding kernels' page sizes)

The decoding kernels (family ``flash_decode``) default to what decoding
serves: dtype bf16 and fp16, head dims 64 and 128, a contiguous and a paged
cache (``--paged`` picks one), and their seqlen_q is the query rows per
key/value head (group size x seqlen_q), built at one per BLOCK_M class (16,
32, 64 rows). Their paged variants are planned for pages of any multiple of
64 keys (the widest tiles, and those tiles cut to 64 keys where a tile is
wider: a float8 cache's 128-key tiles); ``--page-size`` plans the pages a
deployment uses instead: pages of any multiple of 64 take the tiles that
divide them, and every other size (1, 2, 4, 8, 16, 32 keys, or 12, 48, 100...)
the one gathered variant (PAGE_GATHER=true) that serves them all. Pages not planned compile on
first use and come back through the miss log. They have no varlen, dropout or bias
variants (ALiBi they have), and they alone have left-padded ones (leftpad). The append kernel (family ``kv_append``: new
keys written into the cache before decoding) is planned with them, over
their dtypes, head dims (and v's), layouts, alignments, index widths and
rotary modes: one config, no seqlen axis. Rotary variants (``rotary``) are the
split kernel's and kv_append's alone.

Variants are deduplicated by key and come out in a stable order: targets as
given, then kernel (in ``FAMILIES`` order), dtype, head dim, causal, aligned,
index64, window, softcap, paged (then page size), varlen (then seqused), alibi, dropout, bias
(then bias_grad), leftpad, rotary, sinks, varlen_q, chunk, seqlen_q, seqlen_k. The variants with features take
the plain call's tile sizes (``dispatch.kernel_variant``).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lazytriton import geometry, tuning
from lazytriton.kernels import FAMILIES, attention, dispatch, get
from lazytriton.kernels.flash_decode import kv_fp8
from lazytriton.misslog import Line, MissLog
from lazytriton.prewarm.limits import refusal
from lazytriton.record import record
from lazytriton.target import Target
from lazytriton.variant import DTYPES, Variant, check_fields

KERNEL = "flash_fwd"  # the forward kernel, enumerated first
# FP8 (e4m3, e5m2) is planned only when asked for (--dtype e4m3,e5m2), for the families whose dispatch names it
# in PREWARM_FP8 (flash_fwd's FP8 forward), on the targets its ``prewarm_leaves_out`` does not refuse; on sm_90 with
# the Gluon FP8 forward's variants where a call runs them (flash_fwd's ``prewarm_twins``).
FP8_DTYPES = ("e4m3", "e5m2")
DEFAULT_DTYPES: tuple[str, ...] = tuple(dtype for dtype in DTYPES if dtype not in FP8_DTYPES)
DEFAULT_HEAD_DIMS: tuple[int, ...] = geometry.HEAD_DIMS
DEFAULT_CAUSAL: tuple[bool, ...] = (False, True)
# One seqlen per default_config class: <= 16, <= 64 and > 64 query rows.
DEFAULT_SEQLENS: tuple[int, ...] = (16, 64, 4096)
MAX_SEQLEN = 2**31 - 1


@record
class Planned:
    """A variant to build, its key, and why it is in the plan (``table``, ``default`` or ``misses FILE:LINE``)."""

    variant: Variant
    key: str
    origin: str


@record
class Axes:
    """The axes to enumerate; None means the default (see the module docstring)."""

    targets: tuple[Target, ...]
    kernels: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    causal: tuple[bool, ...] | None = None
    seqlens_q: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    aligned: tuple[bool, ...] = (True,)
    index64: tuple[bool, ...] = (False,)
    window: tuple[bool, ...] = (False,)
    softcap: tuple[bool, ...] = (False,)
    paged: tuple[bool, ...] | None = None  # decoding kernels only; None: both
    varlen: tuple[bool, ...] = (False,)
    seqused: tuple[bool, ...] = (False,)  # packed calls with seqused_q/seqused_k (with varlen)
    alibi: tuple[bool, ...] = (False,)
    dropout: tuple[bool, ...] = (False,)
    bias: tuple[bool, ...] = (False,)
    bias_grad: tuple[bool, ...] = (False,)  # with bias, dense calls only (the mask's gradient: BIAS_GRAD)
    leftpad: tuple[bool, ...] = (False,)  # decoding kernels only (cache_leftpad)
    rotary: tuple[str, ...] = ("none",)  # decoding kernels and kv_append only: geometry.ROTARY_MODES
    sinks: tuple[bool, ...] = (False,)  # attention sinks: the families whose PREWARM_FEATURES name them, and flash_fwd
    varlen_q: tuple[bool, ...] = (False,)  # decoding kernels only (queries packed by cu_seqlens_q)
    chunk: tuple[bool, ...] = (False,)  # attention_chunk: the families whose PREWARM_FEATURES name it, and flash_fwd
    qv: tuple[bool, ...] = (False,)  # qv (MLA): the families whose PREWARM_FEATURES name it
    key_mask: tuple[bool, ...] = (False,)  # a key mask (transformers' decoding steps): PREWARM_FEATURES naming it
    kv_fp8: tuple[str, ...] = ("none",)  # decoding kernels, kv_append and kv_slots only: the caches' float8 formats
    # v's head dims (DeepSeek's MLA: q/k 192, v 128); None: v's is q's.
    head_dims_v: tuple[int, ...] | None = None
    # The paged cache's keys a page (decoding kernels only); None: a page size every default BLOCK_N divides.
    page_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("targets must name at least one target, got none")
        known = all_kernels()
        for kernel in self.kernels or ():
            if kernel not in known:
                raise ValueError(f"kernel must be one of {known}, got {kernel!r}")
        for dtype in self.dtypes or ():
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        for head_dim in self.head_dims or ():
            if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 1 <= head_dim <= 256:
                raise ValueError(f"head dim must be an int in 1..{geometry.MAX_HEAD_DIM}, got {head_dim!r}")
        for head_dim_v in self.head_dims_v or ():
            if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int) \
                    or not 1 <= head_dim_v <= geometry.MAX_HEAD_DIM_V:
                raise ValueError(f"head_dim_v must be an int in 1..{geometry.MAX_HEAD_DIM_V}, got {head_dim_v!r}")
        for kv in self.kv_fp8:
            if kv not in (kv_fp8.NONE, *kv_fp8.FORMATS):
                raise ValueError(f"kv_fp8 formats must be among {(kv_fp8.NONE, *kv_fp8.FORMATS)}, got {kv!r}")
        for mode in self.rotary:
            if mode not in geometry.ROTARY_MODES:
                raise ValueError(f"rotary modes must be among {geometry.ROTARY_MODES}, got {mode!r}")
        for page in self.page_sizes or ():
            if isinstance(page, bool) or not isinstance(page, int) or not 1 <= page <= MAX_SEQLEN:
                raise ValueError(f"page sizes must be ints in 1..{MAX_SEQLEN} (keys a page), got {page!r}")
        for name in ("seqlens_q", "seqlens_k"):
            for seqlen in getattr(self, name) or ():
                if isinstance(seqlen, bool) or not isinstance(seqlen, int) or not 1 <= seqlen <= MAX_SEQLEN:
                    raise ValueError(f"{name} values must be ints in 1..{MAX_SEQLEN}, got {seqlen!r}")


def all_kernels() -> tuple[str, ...]:
    """Every kernel of every family, in ``FAMILIES`` order (the default of ``--kernel``)."""
    from lazytriton.kernels import FAMILIES

    return tuple(kernel for kernels in FAMILIES.values() for kernel in kernels)


def parse_kernels(text: str) -> tuple[str, ...]:
    """Kernels from ``--kernel``'s comma-separated families and kernel names (``flash_fwd,flash_bwd_dq``).

    A family stands for all its kernels; the result is unique, in ``FAMILIES``
    order. ValueError names an unknown item and lists the known ones.
    """
    from lazytriton.kernels import FAMILIES

    chosen: set[str] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item in FAMILIES:
            chosen.update(FAMILIES[item])
        elif item in all_kernels():
            chosen.add(item)
        else:
            raise ValueError(f"--kernel {item!r} is neither a kernel family ({', '.join(FAMILIES)}) nor a kernel "
                             f"({', '.join(all_kernels())})")
    if not chosen:
        raise ValueError(f"--kernel must name at least one kernel family or kernel, got {text!r}")
    return tuple(k for k in all_kernels() if k in chosen)


def _unique(items: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(items))


def table_buckets(table: tuning.Table, target: str,
                  kernel: str = KERNEL) -> dict[tuple[str, int, bool], tuple[tuple[int, ...], ...]]:
    """For each (dtype, head dim, causal) group of ``kernel`` for ``target`` in the table: its seqlen buckets."""
    found: dict[tuple[str, int, bool], tuple[set[int], set[int]]] = {}
    for row in table:
        if row.target == target and row.kernel == kernel and row.head_dim in geometry.HEAD_DIMS:
            qs, ks = found.setdefault((row.dtype, row.head_dim, row.causal), (set(), set()))
            qs.add(row.seqlen_q)
            ks.add(row.seqlen_k)
    return {group: (tuple(sorted(qs)), tuple(sorted(ks))) for group, (qs, ks) in found.items()}


def _seqlens(axes: Axes, buckets: tuple[tuple[int, ...], ...] | None,
             defaults: tuple[int, ...] = DEFAULT_SEQLENS) -> list[tuple[int, int]]:
    """The (seqlen_q, seqlen_k) pairs to build a group at."""
    if buckets is not None:
        qs = _unique(map(tuning.bucket, axes.seqlens_q)) if axes.seqlens_q else buckets[0]
        ks = _unique(map(tuning.bucket, axes.seqlens_k)) if axes.seqlens_k else buckets[1]
        return list(itertools.product(qs, ks))
    qs = _unique(map(tuning.bucket, axes.seqlens_q)) if axes.seqlens_q else defaults
    if not axes.seqlens_k:
        return [(q, q) for q in qs]  # a default reads one class, of seqlen_q or seqlen_k: (q, q) covers both
    return list(itertools.product(qs, _unique(map(tuning.bucket, axes.seqlens_k))))


def enumerate_variants(axes: Axes, table: tuning.Table) -> list[Planned]:
    """The variants dispatch would select for the calls ``axes`` describe, given ``table``; unique by key.

    ``table`` holds the rows of every kernel planned (``tuning.tables_for``);
    each kernel reads its own rows.
    """
    plan: dict[str, Planned] = {}
    for target in axes.targets:
        for kernel in _with_companions(axes.kernels or all_kernels()):
            for planned in _kernel_variants(axes, table, target, kernel):
                plan.setdefault(planned.key, planned)
    return list(plan.values())


def _with_companions(kernels: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels to plan, with each family's ``PREWARM_WITH`` (the decoding kernels bring kv_append).

    A decoding call with new keys launches kv_append first, so an image of decoding kernels holds it too.
    """
    extra = [k for kernel in kernels for k in getattr(dispatch.family_dispatch(kernel), "PREWARM_WITH", ())
             if k not in kernels]
    return (*kernels, *dict.fromkeys(extra))


def takes_kernel(chosen: Iterable[str], kernel: str) -> bool:
    """Whether ``--kernel``'s ``chosen`` kernels take a miss log's variant of ``kernel``.

    A kernel named, or one outside every ``FAMILIES`` list (a twin dispatch picks: flash_fwd_gluon,
    flash_fwd_fp8, flash_fwd_fp8_gluon, the Gluon backward's) whose family folder holds a chosen kernel: a
    call of that family runs it.
    """
    chosen = set(chosen)
    if kernel in chosen:
        return True
    if kernel in all_kernels():
        return False
    family = get(kernel).module.split(".")[2]  # lazytriton.kernels.<family>.<module>: its folder
    return not chosen.isdisjoint(FAMILIES.get(family, ()))


def _packed(varlen: tuple[bool, ...], seqused: tuple[bool, ...]) -> tuple[tuple[bool, bool, bool], ...]:
    """The (varlen, seqused_q, seqused_k) modes: dense and packed calls, the packed ones also with seqused."""
    used = ((False, False), (True, False), (False, True), (True, True)) if True in seqused else ((False, False),)
    return tuple((packed, *pair) for packed in varlen for pair in (used if packed else used[:1]))


def _biased(bias: tuple[bool, ...], bias_grad: tuple[bool, ...]) -> tuple[tuple[bool, bool], ...]:
    """The (bias, bias_grad) modes: calls without and with a bias, those with one also wanting its gradient."""
    return tuple((b, grad) for b in bias for grad in ((False, True) if b and True in bias_grad else (False,)))


def _fp8_planned(rules: Any, target: Target, dtype: str, kernel: str) -> bool:
    """Whether ``kernel``'s plan holds FP8 ``dtype`` on ``target``; where not, the reason is logged."""
    if dtype not in getattr(rules, "PREWARM_FP8", ()):
        return False
    reason = rules.prewarm_leaves_out(target, dtype)
    if reason is not None:
        logging.getLogger("lazytriton.prewarm").warning("prewarm leaves %s %s out for %s: %s", kernel, dtype, target,
                                                        reason)
    return reason is None


def _kernel_variants(axes: Axes, table: tuning.Table, target: Target, kernel: str) -> Iterable[Planned]:
    """``kernel``'s planned variants for ``target``: its family's ``dispatch`` answers, with its prewarm hooks.

    A family's dispatch module may set ``PREWARM_DTYPES``, ``PREWARM_HEAD_DIMS`` and ``PREWARM_SEQLENS`` (its
    default grid), ``PREWARM_PAGED`` (a paged axis, at ``axes.page_sizes``), ``PREWARM_FEATURES`` (the feature
    flags its calls take;
    absent: all), ``PREWARM_WITH`` (kernels planned with it) and define ``prewarm_alignments`` (its (ALIGN16,
    SEQ16) pairs), ``PREWARM_KV_PAIRS`` (the classes of (sequence, key/value head) pairs a float8 cache's calls
    are planned at), ``prewarm_twins`` (the variants a plain call of a shape runs beside the kernel's) or
    ``prewarm_variants`` (its whole plan, for a family with one config: the target, dtypes, head dims and
    layout axes, plus as keywords the further axes its ``PREWARM_AXES`` names, such as ``rotary`` or
    ``kv_fp8``).
    """
    rules = dispatch.family_dispatch(kernel)
    dtypes: tuple[str, ...] = axes.dtypes or tuple(getattr(rules, "PREWARM_DTYPES", DEFAULT_DTYPES))
    dtypes = tuple(dtype for dtype in dtypes if dtype not in FP8_DTYPES or _fp8_planned(rules, target, dtype, kernel))
    head_dims: tuple[int, ...] = axes.head_dims or tuple(getattr(rules, "PREWARM_HEAD_DIMS", DEFAULT_HEAD_DIMS))
    paged = (axes.paged or (False, True)) if getattr(rules, "PREWARM_PAGED", False) else (False,)
    # v's head dims over q's largest only for the families that take them (PREWARM_MAX_HEAD_DIM_V: the decoding ones)
    # or run them as pieces (prewarm_head_dims_v: flash_fwd's and flash_bwd's, lazytriton.value_split)
    most_v = getattr(rules, "PREWARM_MAX_HEAD_DIM_V", geometry.MAX_HEAD_DIM)
    pieces = getattr(rules, "prewarm_head_dims_v", lambda dim: (dim,))
    dims_v = tuple(dict.fromkeys(piece for dim in axes.head_dims_v or (0,) for piece in pieces(dim)
                                 if piece <= most_v)) or (0,)
    # Pages of any multiple of 64 keys by default: those of 128-key multiples take the widest tiles (page 0 sets no
    # limit), the others those tiles cut to 64 keys (planned at page 64; the same variants where no tile is wider).
    default_pages = (0, 64)
    layouts = [(is_paged, page) for is_paged in paged
               for page in ((axes.page_sizes or default_pages) if is_paged else (0,))]
    if hasattr(rules, "prewarm_variants"):
        extra = {name: getattr(axes, name) for name in getattr(rules, "PREWARM_AXES", ())}
        for variant in rules.prewarm_variants(target, dtypes, head_dims, dims_v, paged, axes.aligned, axes.index64,
                                              **extra):
            yield Planned(variant, variant.key(), "default")
        return
    in_table = table_buckets(table, str(target), kernel)
    features = getattr(rules, "PREWARM_FEATURES", None)

    def feature(name: str) -> tuple[Any, ...]:
        off = ("none",) if name in ("rotary", "kv_fp8") else (False,)
        chosen = getattr(axes, name) if features is None or name in features else off
        if name == "kv_fp8":  # the formats the target builds (left_out says why the others are not)
            chosen = tuple(kv for kv in chosen if kv_fp8.unsupported(target, str(kv)) is None)
        return chosen  # type: ignore[no-any-return]

    alignments = getattr(rules, "prewarm_alignments", lambda kernel, aligned: tuple((a, False) for a in aligned))
    twins = getattr(rules, "prewarm_twins", None)
    for dtype, head_dim, head_dim_v, causal in itertools.product(dtypes, head_dims, dims_v,
                                                                 axes.causal or DEFAULT_CAUSAL):
        head_dim_v = 0 if head_dim_v == head_dim else head_dim_v
        tiles = max(head_dim, head_dim_v)  # dispatch's rule: the larger head dim's tiles
        split = bool(attention.split_chunks(kernel, head_dim, head_dim_v))
        buckets = in_table.get((dtype, geometry.padded_value_dim(tiles), causal))
        seqlens = _seqlens(axes, buckets, getattr(rules, "PREWARM_SEQLENS", DEFAULT_SEQLENS))
        for ((aligned, seq16), index64, window, softcap, (is_paged, page), (varlen, *used), alibi, dropout,
             (bias, bias_grad), leftpad, rotary, sinks, varlen_q, chunk, kv, qv, key_mask,
             (seqlen_q, seqlen_k)) in itertools.product(
                alignments(kernel, axes.aligned), axes.index64, feature("window"), feature("softcap"), layouts,
                _packed(feature("varlen"), feature("seqused")), feature("alibi"), feature("dropout"),
                _biased(feature("bias"), feature("bias_grad")), feature("leftpad"), feature("rotary"),
                feature("sinks"), feature("varlen_q"), feature("chunk"), feature("kv_fp8"), feature("qv"),
                feature("key_mask"), seqlens):
            if bias_grad and varlen:  # the mask's gradient is the SDPA drop-in's: dense calls only
                continue
            if qv and kv != "none":  # qv takes no float8 cache (flash_decode.mla)
                continue
            config, row = dispatch.kernel_config(kernel, target, dtype, tiles, causal, seqlen_q, seqlen_k, table,
                                                 paged=is_paged, split=split)
            # the family's own choice from the table, as a call's (a float8 cache's measured decoding tiles too, at
            # each class of (sequence, key/value head) pairs they follow: PREWARM_KV_PAIRS)
            for pairs in getattr(rules, "PREWARM_KV_PAIRS", (0,)) if kv != "none" else (0,):
                variant = dispatch.kernel_variant(kernel, target, dtype, head_dim, causal, aligned, seqlen_q,
                                                  seqlen_k, table=table, index64=index64, window=window,
                                                  softcap=softcap, paged=is_paged, varlen=varlen, alibi=alibi,
                                                  bias=bias, dropout=dropout, head_dim_v=head_dim_v,
                                                  seq16=seq16 and not varlen, leftpad=leftpad, page_size=page,
                                                  seqused_q=used[0], seqused_k=used[1], rotary=rotary != "none",
                                                  rotary_interleaved=rotary == "interleaved", sinks=sinks,
                                                  bias_grad=bias_grad, varlen_q=varlen_q, chunk=chunk, kv_fp8=kv,
                                                  qv=qv, key_mask=key_mask, kv_pairs=pairs)
                yield Planned(variant, variant.key(), "table" if row is not None else "default")
            plain = not (window or softcap or varlen or alibi or dropout or bias or leftpad or rotary != "none"
                         or varlen_q or chunk or head_dim_v or kv != "none" or qv or key_mask)
            # A call with sinks runs the twins that carry them (the Gluon forward's: prewarm_twins' sinks).
            extra = {"sinks": True} if sinks else {}
            for twin, origin in (twins(kernel, target, dtype, head_dim, causal, aligned, index64, seqlen_q, seqlen_k,
                                       **extra)
                                 if plain and twins is not None else ()):
                yield Planned(twin, twin.key(), origin)


def left_out(axes: Axes) -> list[str]:
    """Why some of the axes' float8 cache formats are not planned for a target (``kv_fp8.unsupported``)."""
    return [f"the {kv} KV caches for {target}: {why}" for target in axes.targets for kv in axes.kv_fp8
            if (why := kv_fp8.unsupported(target, kv)) is not None]


def _left_out(variant: Variant) -> str | None:
    """Why the planner leaves ``variant``'s dtype out for its target (its family's ``prewarm_leaves_out``), or None.

    A miss log line asks for a variant, not a plan: the same reason refuses it (the FP8 forward for sm_80, say).
    """
    family = get(variant.kernel).module.split(".")[2]  # lazytriton.kernels.<family>.<module>: its folder
    try:
        rules = dispatch.family_dispatch(FAMILIES[family][0])
    except (KeyError, ValueError):  # a family without dispatch rules plans every dtype it names
        return None
    leaves_out = getattr(rules, "prewarm_leaves_out", None)
    return None if leaves_out is None else leaves_out(Target.parse(variant.target), variant.dtype)  # type: ignore


def variants_from_misses(lines: Iterable[str], where: str = "misses") -> tuple[list[Planned], list[str]]:
    """The variants a miss log (JSON lines with a ``"variant"`` field) names, unique by key; and its bad lines.

    A bad line (not JSON, nested too deeply, no ``variant``, a variant that
    does not parse or lacks a field its kernel needs) is reported as
    ``"FILE:LINE: reason"`` and skipped; so is a variant that cannot fit its
    target (``limits.refusal``) or whose dtype the planner leaves out for it
    (``_left_out``: an FP8 variant for sm_80): a miss log comes from another
    machine, and one poisoned line must not hold a build for minutes. Blank
    lines are ignored.
    """
    return _plan_misses((Line(number, line) for number, line in enumerate(lines, 1)), where)


def variants_from_miss_log(path: Path) -> tuple[list[Planned], list[str]]:
    """``variants_from_misses`` of a miss log file, read within ``lazytriton.misslog``'s bounds.

    A line that is not UTF-8 or over the line bound is one more bad line, and
    a log cut at the byte bound adds a problem that says so.

    OSError when it cannot be opened; ``misslog.NotRegularFile`` for a FIFO, a directory or a device.
    """
    with MissLog(path) as log:
        plan, problems = _plan_misses(log, str(path))
        if log.truncated:
            problems.append(log.truncation_note())
    return plan, problems


def _plan_misses(lines: Iterable[Line], where: str) -> tuple[list[Planned], list[str]]:
    plan: dict[str, Planned] = {}
    problems: list[str] = []
    for number, line, problem in lines:
        place = f"{where}:{number}"
        if line is None:
            problems.append(f"{place}: {problem}")
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            problems.append(f"{place}: not a JSON object ({exc})")
            continue
        except RecursionError:
            problems.append(f"{place}: not a JSON object (nested too deeply)")
            continue
        text = record.get("variant") if isinstance(record, dict) else None
        if not isinstance(text, str):
            problems.append(f"{place}: no \"variant\" string in {line.strip()[:120]!r}")
            continue
        try:
            variant = check_fields(Variant.parse(text))
            key = variant.key()
        except (ValueError, TypeError) as exc:
            problems.append(f"{place}: bad variant {text[:200]!r}: {exc}")
            continue
        why = refusal(variant) or _left_out(variant)
        if why is not None:
            problems.append(f"{place}: refused {variant}: {why}")
            continue
        plan.setdefault(key, Planned(variant, key, f"misses {place}"))
    return list(plan.values()), problems


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` (1 <= I <= N) as ``(I, N)``."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = 0
    if not sep or not 1 <= i <= n:
        raise ValueError(f"shard must be I/N with 1 <= I <= N (e.g. 2/3), got {text!r}")
    return i, n


def in_shard(key: str, shard: tuple[int, int]) -> bool:
    """Whether ``key`` belongs to shard ``(I, N)``: keys are uniform hashes, so their value modulo N splits evenly.

    The partition depends on the key alone, not on the rest of the plan: shards
    built on different machines from the same inputs never overlap and
    together build everything.
    """
    index, count = shard
    return int(key, 16) % count == index - 1


def select_shard(plan: Sequence[Planned], shard: tuple[int, int] | None) -> list[Planned]:
    """The part of ``plan`` that shard ``(I, N)`` builds (all of it for None), in plan order."""
    return list(plan) if shard is None else [p for p in plan if in_shard(p.key, shard)]
