"""kv_append's choice: one config for every call (``kv_append.variant``), in ``kernels.dispatch``'s terms.

Prewarm plans it with the decoding kernels (``flash_decode.dispatch.PREWARM_WITH``): over their dtypes, head
dims (and v's), layouts, alignments and index widths, with no seqlen axis; prewarm's ``varlen`` axis (packed
sequences) is its new keys packed by cu_seqlens_k_new (VARLEN=true), which also plans ``kv_append_lengths``
(the split kernel's lengths after such an append: ``kv_append/lengths.py``, one variant a target).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from lazytriton import geometry, tuning
from lazytriton.kernels import kv_append
from lazytriton.kernels.flash_decode import kv_fp8 as fp8
from lazytriton.kernels.kv_append import lengths
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

PREWARM_DTYPES = ("bf16", "fp16")  # the decoding kernels' (flash_decode.dispatch.PREWARM_*)
PREWARM_HEAD_DIMS = (64, 128)
PREWARM_PAGED = True
PREWARM_MAX_HEAD_DIM_V = 512  # the decoding kernels' (MLA's latent: v of 512)


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """Nothing to choose: kv_append has one config for every call (``kv_append.BLOCK_M``), no tuning rows."""
    raise ValueError("kv_append has one config for every call (kv_append.variant): nothing to look up")


PREWARM_AXES = ("rotary", "kv_fp8", "varlen")  # the keyword axes prewarm_variants takes


def prewarm_variants(target: Target, dtypes: Iterable[str], head_dims: Iterable[int], head_dims_v: Iterable[int],
                     paged: Iterable[bool], aligned: Iterable[bool], index64: Iterable[bool],
                     rotary: Iterable[str] = ("none",), kv_fp8: Iterable[str] = ("none",),
                     varlen: Iterable[bool] = (False,)) -> list[Variant]:
    """kv_append's variants for prewarm's axes: one for each combination of their values.

    ``rotary``: the rotary modes (``geometry.ROTARY_MODES``) of the calls planned; ``kv_fp8``: their caches'
    formats (``none``, ``e4m3``, ``e5m2``), those ``target`` cannot build left out (``kv_fp8.unsupported``);
    ``varlen``: prewarm's packed-sequences axis, here new keys packed by cu_seqlens_k_new (VARLEN=true), with
    ``kv_append_lengths``' one variant (the lengths after such an append, which a GPU call launches next).
    """
    formats = [kv for kv in kv_fp8 if fp8.unsupported(target, kv) is None]
    varlen = tuple(varlen)
    appends = [kv_append.variant(target, dtype, head_dim, 0 if dim_v == head_dim else dim_v, is_paged, is_aligned,
                                 wide, *geometry.rotary_flags(mode), kv_fp8=kv, varlen=packed)
               for dtype, head_dim, dim_v, is_paged, is_aligned, wide, mode, kv, packed in itertools.product(
                   dtypes, head_dims, head_dims_v, paged, aligned, index64, rotary, formats, varlen)]
    return [lengths.variant(target), *appends] if True in varlen else appends


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """``kernels.dispatch.kernel_variant`` for kv_append: ``kv_append.variant`` (the layout and rotary fields).

    The request's ``varlen`` (packed sequences) is kv_append's packed new keys (cu_seqlens_k_new, VARLEN=true).
    ``kv_append_lengths`` has one variant a target, whatever the request.
    """
    if kernel == lengths.KERNEL:
        return lengths.variant(target)
    dim_v = 0 if request.head_dim_v == request.head_dim else request.head_dim_v
    return kv_append.variant(target, request.dtype, request.head_dim, dim_v, request.paged, request.aligned,
                             request.index64, request.rotary, request.rotary_interleaved, request.kv_fp8,
                             request.varlen)


def explained(kernel: str, target: Target, call: Request) -> tuple[Variant, Config, tuning.Row | None]:
    """``kernels.dispatch.choice`` for kv_append: its one variant and that config (no tuning row)."""
    found = variant(kernel, target, call)
    if kernel == lengths.KERNEL:
        return found, Config(int(found.get("BLOCK")), 0, int(found.get("num_warps")), 1), None
    return found, Config(int(found.get("BLOCK_M")), 0, int(found.get("num_warps")), 1), None
