"""flash_bwd_dsinks's choice: one config for every call (``flash_bwd_dsinks.variant``), in ``kernels.dispatch``'s terms.

The kernel reads only float32 (sinks, lse, delta): its variant's dtype is
fp32 whatever the attention's, and head dims, seqlens and causal mode do not
apply; a ``Request``'s ``varlen``, ``seqused_q`` and ``index64`` do. Prewarm
plans it through ``prewarm_variants``: dense and packed calls (with and
without seqused_q), at each index width, a handful of variants a target.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from lazytriton import tuning
from lazytriton.kernels import flash_bwd_dsinks
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

PREWARM_DTYPES = ("fp32",)
PREWARM_HEAD_DIMS = (0,)
# (varlen, seqused_q): dense, packed, packed with used lengths.
_MODES = ((False, False), (True, False), (True, True))


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """The one config (``flash_bwd_dsinks.BLOCK_M`` rows a step, ``NUM_WARPS``) and no tuning row."""
    return Config(flash_bwd_dsinks.BLOCK_M, 0, flash_bwd_dsinks.NUM_WARPS, 1), None


def prewarm_variants(target: Target, dtypes: Iterable[str], head_dims: Iterable[int], head_dims_v: Iterable[int],
                     paged: Iterable[bool], aligned: Iterable[bool], index64: Iterable[bool]) -> list[Variant]:
    """flash_bwd_dsinks's variants for prewarm's axes: one a (dense/packed/seqused_q mode, index width).

    Dtypes, head dims, layouts and alignments do not apply (the kernel reads float32 rows).
    """
    return [flash_bwd_dsinks.variant(target, varlen, used, wide)
            for (varlen, used), wide in itertools.product(_MODES, index64)]


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """``kernels.dispatch.kernel_variant`` for flash_bwd_dsinks: its packed-sequence and index-width fields."""
    return flash_bwd_dsinks.variant(target, request.varlen, request.varlen and request.seqused_q, request.index64)


def explained(kernel: str, target: Target, call: Request) -> tuple[Variant, Config, tuning.Row | None]:
    """``kernels.dispatch.choice`` for flash_bwd_dsinks: its one variant and that config (no tuning row)."""
    return variant(kernel, target, call), kernel_config(kernel, target, "fp32", 0, False, 1, 1)[0], None
