"""What the Triton attention kernels (``flash_fwd``, ``flash_bwd_dq``, ``flash_bwd_dkdv``) choose alike.

They have the same functional fields (padded head dim, causal, EVEN_D, ALIGN16, INDEX64, the feature flags),
see seqlens only through their buckets, split a head dim into two power-of-two tiles by the same rule, and look
a config up in their tuning tables the same way. Each family's ``dispatch`` adds its own fields (flash_fwd's
TMA, the backward's SEQ16) and its own defaults. Pure: the tuning table comes in as a value or from the family's
file.
"""

from __future__ import annotations

from collections.abc import Callable

from lazytriton import tuning
from lazytriton.geometry import padded_head_dim, split_head_dim
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant, pairs

# Split tiles: a head dim that is not a power of two as two power-of-two chunks
# (geometry.split_head_dim: 96 = 64 + 32) instead of one padded tile (128). On by
# default since benchmarks/bench_split_d.py measured flash_fwd on the H200 (bf16, 4k,
# Triton 3.6): 1.42-2.22x the padded kernel's TFLOP/s at head dims 40, 72, 80, 96,
# 160 and 192; split_d=False asks for padding. The backward kernels split by the same
# rule (bench_split_d.py --mode bwd, H200 bf16 4k: 1.34-4.14x).
SPLIT_BY_DEFAULT = True
SPLIT_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")
# The attention kernels that take attention sinks (SINKS): the forward's.
SINKS_KERNELS = ("flash_fwd",)
# The attention kernels that take FlashAttention-3's attention_chunk (CHUNK): the Triton forward and backward pair.
CHUNK_KERNELS = ("flash_fwd", "flash_fwd_fp8", "flash_bwd_dq", "flash_bwd_dkdv")


def split_chunks(kernel: str, head_dim: int, head_dim_v: int = 0, tma: bool | None = None,
                 split_d: bool | None = None) -> tuple[int, int] | None:
    """The split-tile chunks of a call of ``kernel``, or None (padding); ``split_d=True`` where none helps: ValueError.

    The kernels of ``SPLIT_KERNELS`` have split tiles; ``split_d`` None is
    ``SPLIT_BY_DEFAULT``; ``head_dim_v`` 0 is ``head_dim``.
    """
    wanted = SPLIT_BY_DEFAULT if split_d is None else split_d
    if not wanted:
        return None
    chunks = split_head_dim(head_dim) if kernel in SPLIT_KERNELS else None
    if chunks is None or (head_dim_v or head_dim) != head_dim or tma:
        if split_d is None:
            return None
        raise ValueError(f"split_d=True needs flash_fwd or a backward kernel ({', '.join(SPLIT_KERNELS[1:])}), "
                         f"a head dim that two power-of-two chunks hold in less than its padded tile (40, 72, 80, 96, "
                         f"160, 192, ...), v's head dim equal to it and no TMA; got {kernel}, head dim {head_dim}, v's "
                         f"{head_dim_v}, tma={tma}")
    return chunks


def _own_rows(kernel: str, head_dim: int, split: bool | None) -> bool:
    """Whether a call of ``kernel`` at ``head_dim`` looks up the head dim's own tuning rows (its split tiles')."""
    if split is None:
        split = split_chunks(kernel, head_dim) is not None
    return split and head_dim != padded_head_dim(head_dim)


def table_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                 seqlen_k: int, table: tuning.Table | None, split: bool | None,
                 default: Callable[[int], Config]) -> tuple[Config, tuning.Row | None]:
    """The config of a call from ``kernel``'s tuning table, else ``default(padded head dim)``; and the row used.

    A head dim that split tiles hold (96 = 64 + 32: ``split_head_dim``) has
    rows of its own when ``lazytriton tune`` measured it; else it takes its
    padded tile's rows (128's), as a padded call does. ``split``: whether the
    variant runs in split tiles (None: as a call of this head dim does by
    default); its own rows are those of split variants (``lazytriton tune``
    keys a padded winner by its padded head dim), so a padded call of it
    (``split_d=False``, or v's head dim another) takes the padded tile's
    rows: the split tiles' shared memory is not its budget.
    """
    padded = padded_head_dim(head_dim)
    rows = tuning.table_for(kernel) if table is None else table
    row = None
    if _own_rows(kernel, head_dim, split):
        row = tuning.lookup(rows, str(target), kernel, dtype, head_dim, causal, seqlen_q, seqlen_k)
    if row is None:
        row = tuning.lookup(rows, str(target), kernel, dtype, padded, causal, seqlen_q, seqlen_k)
    if row is None:
        return default(padded), None
    return Config(row.BLOCK_M, row.BLOCK_N, row.num_warps, row.num_stages, row.waves_per_eu), row


def functional(head_dim: int, head_dim_v: int, causal: bool, aligned: bool, index64: bool,
               chunks: tuple[int, int] | None) -> tuple[dict[str, bool | int], bool]:
    """The functional fields every attention kernel has, and whether both head dims fill their tiles (EVEN).

    ``head_dim_v`` (0: ``head_dim``): where v's padded size or evenness
    differs from q/k's, ``BLOCK_DV``/``EVEN_DV`` say so (absent, they are
    BLOCK_D's and EVEN_D's: the strings of equal-dim calls are unchanged).
    ``chunks``: split tiles, BLOCK_D the first chunk and BLOCK_D2 the second
    (then never even: the pointer kernel only, no TMA).
    """
    padded = padded_head_dim(head_dim)
    dv = head_dim_v or head_dim
    padded_v = padded_head_dim(dv)
    fields: dict[str, bool | int] = {"ALIGN16": bool(aligned), "BLOCK_D": padded, "CAUSAL": bool(causal),
                                     "EVEN_D": head_dim == padded, "INDEX64": bool(index64)}
    if (padded_v, dv == padded_v) != (padded, head_dim == padded):
        fields.update(BLOCK_DV=padded_v, EVEN_DV=dv == padded_v)
    even = head_dim == padded and dv == padded_v
    if chunks is not None:
        fields.update(BLOCK_D=chunks[0], EVEN_D=sum(chunks) == head_dim, BLOCK_D2=chunks[1])
        even = False
    return fields, even


def add_flags(fields: dict[str, bool | int], **flags: bool) -> dict[str, bool | int]:
    """``fields`` with each flag that is on written as ``NAME=true`` (off flags are absent: old strings hold)."""
    for name, on in flags.items():
        if on:
            fields[name.upper()] = True
    return fields


def variant(kernel: str, target: Target, request: Request,
            config_of: Callable[..., tuple[Config, tuning.Row | None]],
            own_fields: Callable[[dict[str, bool | int], bool], None]) -> Variant:
    """The variant of an attention kernel serving ``request`` (pure, given the table).

    ``request.config`` (None: ``config_of``, the family's table-then-default
    choice at the seqlens' buckets and the larger head dim);
    ``own_fields(fields, even)`` adds the family's fields; the feature flags
    (window, softcap, alibi, bias, dropout, varlen, and with varlen seqused_q
    and seqused_k, sinks, chunk) are written ``NAME=true`` only when on; seqused
    without varlen is a ValueError, and so are sinks on a kernel that does not take
    them (the backward's: the sink reaches its gradients through the lse alone) and
    chunk on one outside ``CHUNK_KERNELS``.
    """
    if (request.seqused_q or request.seqused_k) and not request.varlen:
        raise ValueError(f"seqused_q/seqused_k need packed sequences (varlen=True), got seqused_q="
                         f"{request.seqused_q}, seqused_k={request.seqused_k}, varlen=False")
    if request.sinks and kernel not in SINKS_KERNELS:
        raise ValueError(f"sinks (SINKS=true) are taken by {', '.join(SINKS_KERNELS)} only, got {kernel}: the "
                         "backward reads the forward's lse, which holds them")
    if request.chunk and kernel not in CHUNK_KERNELS:
        raise ValueError(f"attention_chunk (CHUNK=true) is taken by {', '.join(CHUNK_KERNELS)} only, got {kernel}")
    dv = request.head_dim_v or request.head_dim
    sq, sk = tuning.bucket(request.seqlen_q), tuning.bucket(request.seqlen_k)
    chunks = split_chunks(kernel, request.head_dim, dv, request.tma, request.split_d)
    cfg = request.config or config_of(kernel, target, request.dtype, max(request.head_dim, dv), request.causal, sq,
                                      sk, request.table, split=chunks is not None)[0]
    fields, even = functional(request.head_dim, dv, request.causal, request.aligned, request.index64, chunks)
    own_fields(fields, even)
    add_flags(fields, window=request.window, softcap=request.softcap, alibi=request.alibi, bias=request.bias,
              dropout=request.dropout, varlen=request.varlen, seqused_q=request.seqused_q,
              seqused_k=request.seqused_k, sinks=request.sinks, chunk=request.chunk)
    return Variant(kernel, str(target), request.dtype, pairs(fields), pairs(cfg.tuned()), pairs(cfg.options(target)))
