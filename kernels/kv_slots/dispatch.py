"""kv_slots' choice: one config a column chunk (``kv_slots.variant``), in ``kernels.dispatch``'s terms.

The write sees no scores: its seqlens, causal mode and feature flags do not
apply. It reads the dtype, the head dims of key and value (through their
column chunk, ``kv_slots.block_d``), the alignment, the index width and the
slots' dtype (a ``Request``'s ``slot64``). It has no tuning rows
(``tuning.csv`` is empty): one config a chunk.

Prewarm plans it through ``prewarm_variants``: the decoding kernels' dtypes
and head dims 64 and 128 (128 columns hold 128, 256 and wider head dims, in
chunks; 64 holds 64; a head dim such as 80 or 96 takes the 128-column chunk
with a mask), with int64 and int32 slots (vLLM and SGLang pass int64), into caches of
the keys' dtype; prewarm's ``--kv-dtype`` adds float8 caches of its formats
(``PREWARM_AXES``' ``kv_fp8``: those the target builds). Other sizes compile
on first use and come back through the miss log.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from lazytriton import tuning
from lazytriton.kernels import kv_slots
from lazytriton.kernels.flash_decode import kv_fp8 as fp8
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

PREWARM_DTYPES = ("bf16", "fp16")  # the decoding kernels' (flash_decode.dispatch.PREWARM_*)
PREWARM_HEAD_DIMS = (64, 128)
PREWARM_SLOT64 = (True, False)  # int64 slots (vLLM's slot_mapping, SGLang's out_cache_loc), then int32


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """The head dim's one config (``kv_slots.block_m`` rows of ``block_d`` columns) and no tuning row."""
    cols = kv_slots.block_d(head_dim, head_dim)
    return Config(kv_slots.block_m(cols), 0, kv_slots.NUM_WARPS, 1, 2 if target.backend == "hip" else 0), None


PREWARM_AXES = ("kv_fp8",)  # the keyword axes prewarm_variants takes


def prewarm_variants(target: Target, dtypes: Iterable[str], head_dims: Iterable[int], head_dims_v: Iterable[int],
                     paged: Iterable[bool], aligned: Iterable[bool], index64: Iterable[bool],
                     kv_fp8: Iterable[str] = ("none",)) -> list[Variant]:
    """kv_slots' variants for prewarm's axes: one a (dtype, column chunk, alignment, index width, slots' dtype, cache).

    ``paged`` does not apply (the cache is always paged). ``kv_fp8``: the caches' formats (``none``, ``e4m3``,
    ``e5m2``), those ``target`` cannot build left out (``kv_fp8.unsupported``).
    """
    formats = [kv for kv in kv_fp8 if fp8.unsupported(target, kv) is None]
    return [kv_slots.variant(target, dtype, head_dim, 0 if dim_v == head_dim else dim_v, is_aligned, wide, slot64,
                             kv)
            for dtype, head_dim, dim_v, is_aligned, wide, slot64, kv in itertools.product(
                dtypes, head_dims, head_dims_v, aligned, index64, PREWARM_SLOT64, formats)]


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """``kernels.dispatch.kernel_variant`` for kv_slots: ``kv_slots.variant`` (the layout fields and SLOT64)."""
    dim_v = 0 if request.head_dim_v == request.head_dim else request.head_dim_v
    return kv_slots.variant(target, request.dtype, request.head_dim, dim_v, request.aligned, request.index64,
                            request.slot64, request.kv_fp8)


def explained(kernel: str, target: Target, call: Request) -> tuple[Variant, Config, tuning.Row | None]:
    """``kernels.dispatch.choice`` for kv_slots: its variant and that config (no tuning row)."""
    found = variant(kernel, target, call)
    options = dict(found.options)
    return found, Config(int(found.get("BLOCK_M")), 0, int(options["num_warps"]), 1,
                         int(options.get("waves_per_eu", 0))), None
