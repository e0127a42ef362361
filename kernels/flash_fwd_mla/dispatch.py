"""flash_fwd_mla's choice: its fields, its tiles (by v's head dim), its prewarm plan, in ``kernels.dispatch``'s terms.

The tiles depend on the target, the dtype and v's padded head dim (``geometry.padded_value_dim``), the tile
that sizes the accumulator, V's pipeline stages and qv's tile; the package docstring says why 64 x 32 at 512.
One config serves calls with and without ``qv`` (its 64 KiB tile is counted in both). A tuning row (``lazytriton
tune`` has no tuner for this family yet; ``tuning.csv`` is empty) would be keyed by v's padded head dim.

Prewarm plans it through ``prewarm_variants``, only when a plan asks for MLA's calls: ``--qv`` or a
``--head-dim-v`` over 256 (most models have neither, so the default plan and every image built from it stay as
they are). Then: bf16 and fp16, q's head dim 64 (MLA's rotary part; ``--head-dim`` picks others), v's head dims
given (with ``--qv`` alone: 512 and 256, FlashAttention-3's qv sizes), with qv where ``--qv`` is given and
without it where v's head dim is over 256: a call without qv whose v's head dim is 256 or less is flash_fwd's
(it has a backward there). ``--window``, ``--softcap``, ``--varlen``, ``--attention-chunk`` (CHUNK) and, with
``--varlen``, ``--seqused`` (SEQUSED_Q, SEQUSED_K or both) add their flags.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from lazytriton import geometry, tuning
from lazytriton.kernels.attention import add_flags
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import SMALL_SHARED_CUDA, Config
from lazytriton.variant import Variant, pairs

KERNEL = "flash_fwd_mla"
PREWARM_DTYPES = ("bf16", "fp16")
PREWARM_HEAD_DIMS = (64,)
PREWARM_HEAD_DIMS_V = (512, 256)
PREWARM_MAX_HEAD_DIM_V = geometry.MAX_HEAD_DIM_V
# The keyword axes prewarm_variants takes.
PREWARM_AXES = ("causal", "window", "softcap", "varlen", "qv", "chunk", "seqused")
# What a call of this kernel may carry beyond its own flags: the Request fields it refuses, with the reason.
_REFUSED = {"alibi": "ALiBi", "bias": "an additive bias (attn_mask)", "dropout": "dropout", "paged": "a paged cache",
            "sinks": "attention sinks", "leftpad": "cache_leftpad", "rotary": "rotary embeddings",
            "varlen_q": "packed decoding queries", "bias_grad": "a bias gradient"}


_USED_MODES = ((False, False), (True, False), (False, True), (True, True))  # (seqused_q, seqused_k)


def served(head_dim_v: int, qv: bool) -> bool:
    """Whether a forward call of v's head dim ``head_dim_v`` (and ``qv``) is this kernel's, not flash_fwd's."""
    return qv or head_dim_v > geometry.MAX_HEAD_DIM


def default_config(target: Target, dtype: str, head_dim_v: int) -> Config:
    """The tiles at v's head dim ``head_dim_v`` (padded) where the tuning table has no row: untuned, sized to fit.

    CUDA, 16-bit: at 512, 64 x 32, 8 warps, 2 stages (the package docstring: the accumulator's registers, V's
    stages and qv's tile in shared memory); up to 256, 64 x 64, 4 warps (8 at 256), 2 stages. float32 halves
    BLOCK_N (twice the bytes a tile). sm_86/89/120 (99 KiB) take BLOCK_N 16 at 512. HIP (64 KiB of LDS):
    32 x 16, 4 warps, 1 stage at 512, 64 x 32 below.
    """
    padded = geometry.padded_value_dim(head_dim_v)
    wide = 2 if dtype == "fp32" else 1
    if target.backend == "hip":
        return Config(32, 16, 4, 1, 2) if padded >= 512 else Config(64, 32 // wide, 4, 1, 2)
    if padded >= 512:
        small = target.capability in SMALL_SHARED_CUDA
        return Config(64, 16 if small or wide > 1 else 32, 8, 2)
    return Config(64, 64 // wide, 8 if padded >= 256 else 4, 2)


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """The config at ``head_dim`` (v's: the tile that sizes this kernel), from the tuning table, else the default."""
    padded = geometry.padded_value_dim(head_dim)
    rows = tuning.table_for(kernel) if table is None else table
    row = tuning.lookup(rows, str(target), kernel, dtype, padded, causal, seqlen_q, seqlen_k)
    if row is None:
        return default_config(target, dtype, padded), None
    return Config(row.BLOCK_M, row.BLOCK_N, row.num_warps, row.num_stages, row.waves_per_eu), row


def refuse_unsupported(request: Request) -> None:
    """A ValueError naming the first flag of ``request`` this kernel does not take."""
    for name, what in _REFUSED.items():
        value = getattr(request, name)
        if value and value != "none":
            raise ValueError(f"{KERNEL} (FlashAttention-3's qv / v of up to 512) takes no {what} ({name}=True)")
    if request.kv_fp8 != "none" or request.dtype not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"{KERNEL} takes fp16, bf16 or fp32 tensors, got dtype {request.dtype}, "
                         f"kv_fp8 {request.kv_fp8}")
    if (request.seqused_q or request.seqused_k) and not request.varlen:
        raise ValueError(f"{KERNEL}: seqused_q/seqused_k need packed sequences (varlen=True), got seqused_q="
                         f"{request.seqused_q}, seqused_k={request.seqused_k}, varlen=False")


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """The variant serving ``request`` (pure, given the table): head dims' tiles, causal, alignment, flags, config.

    ``head_dim_v`` 0 is ``head_dim``. BLOCK_DV and EVEN_DV are always written.
    """
    refuse_unsupported(request)
    dv = request.head_dim_v or request.head_dim
    padded, padded_v = geometry.padded_head_dim(request.head_dim), geometry.padded_value_dim(dv)
    cfg = request.config or kernel_config(kernel, target, request.dtype, padded_v, request.causal,
                                          tuning.bucket(request.seqlen_q), tuning.bucket(request.seqlen_k),
                                          request.table)[0]
    fields: dict[str, bool | int] = {"ALIGN16": bool(request.aligned), "BLOCK_D": padded,
                                     "BLOCK_DV": padded_v, "CAUSAL": bool(request.causal),
                                     "EVEN_D": request.head_dim == padded, "EVEN_DV": dv == padded_v,
                                     "INDEX64": bool(request.index64)}
    add_flags(fields, window=request.window, softcap=request.softcap, varlen=request.varlen, qv=request.qv,
              chunk=request.chunk, seqused_q=request.seqused_q, seqused_k=request.seqused_k)
    return Variant(kernel, str(target), request.dtype, pairs(fields), pairs(cfg.tuned()), pairs(cfg.options(target)))


def explained(kernel: str, target: Target, call: Request) -> tuple[Variant, Config, tuning.Row | None]:
    """``kernels.dispatch.choice`` for flash_fwd_mla: its variant and the config at v's head dim."""
    config, row = kernel_config(kernel, target, call.dtype, call.head_dim_v or call.head_dim, call.causal,
                                tuning.bucket(call.seqlen_q), tuning.bucket(call.seqlen_k), call.table)
    return variant(kernel, target, call), config, row


def prewarm_variants(target: Target, dtypes: Iterable[str], head_dims: Iterable[int], head_dims_v: Iterable[int],
                     paged: Iterable[bool], aligned: Iterable[bool], index64: Iterable[bool],
                     causal: Iterable[bool] | None = None, window: Iterable[bool] = (False,),
                     softcap: Iterable[bool] = (False,), varlen: Iterable[bool] = (False,),
                     qv: Iterable[bool] = (False,), chunk: Iterable[bool] = (False,),
                     seqused: Iterable[bool] = (False,)) -> list[Variant]:
    """The variants for prewarm's axes (the module docstring): calls this kernel serves (``served``) only.

    None unless ``qv`` holds True or ``head_dims_v`` one over 256; ``head_dims_v``: v's (0 or none given:
    ``PREWARM_HEAD_DIMS_V``); ``causal`` None: both; ``paged`` does not apply. One config a (dtype, v's head dim),
    so no seqlen axis. ``chunk`` and ``seqused`` (True adds, to the packed calls, those with seqused_q, seqused_k
    and both) apply to calls with qv only.
    """
    qv = tuple(qv)
    dims_v = [dim for dim in head_dims_v if dim]
    if True not in qv and not any(served(dim, False) for dim in dims_v):
        return []
    dims_v = dims_v or list(PREWARM_HEAD_DIMS_V)
    used_modes = _USED_MODES if True in tuple(seqused) else _USED_MODES[:1]
    found = []
    axes: list[Iterable[Any]] = [dtypes, head_dims, dims_v, (False, True) if causal is None else causal, aligned,
                                 index64, window, softcap, varlen, qv, chunk, used_modes]
    for (dtype, head_dim, dim_v, is_causal, is_aligned, wide, windowed, capped, packed, with_qv, chunked,
         used) in itertools.product(*axes):
        # A chunk or seqused without qv runs flash_fwd over v's pieces (lazytriton.value_split), not this kernel.
        extra = chunked or any(used)
        if dtype in PREWARM_DTYPES + ("fp32",) and served(dim_v, with_qv) and (packed or not any(used)) and (
                with_qv or not extra):
            request = Request(dtype, head_dim, is_causal, is_aligned, 1, 1, index64=wide, window=windowed,
                              softcap=capped, varlen=packed, head_dim_v=dim_v, qv=with_qv, chunk=chunked,
                              seqused_q=used[0], seqused_k=used[1])
            found.append(variant(KERNEL, target, request))
    return found
