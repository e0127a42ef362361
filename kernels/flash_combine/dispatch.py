"""flash_combine's choice: one config a head dim (``flash_combine.default_config``), in ``kernels.dispatch``'s terms.

The combine sees only outputs: the head dim it serves is v's (a ``Request``'s
``head_dim_v``, else its ``head_dim``), its dtype the output's, and its
seqlens, causal mode and feature flags do not apply. It has no tuning rows
yet (``tuning.csv`` is empty): its config depends on the head dim alone.

Prewarm plans it through ``prewarm_variants``: every output dtype (float32
is FlashAttention-3's default, the 16-bit ones what a model takes next), and
head dims 64, 128 and 96, which cover the head dims calls use: 128 holds 128,
256 and MLA's 512 too (chunks of 128 columns), 96 every head dim above 64
that is not a multiple of 128 (80, 96, 192, ...). Other sizes compile on
first use and come back through the miss log.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from lazytriton import tuning
from lazytriton.kernels import flash_combine
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

PREWARM_DTYPES = ("fp32", "bf16", "fp16")
PREWARM_HEAD_DIMS = (64, 128, 96)


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """The head dim's one config (``flash_combine.default_config``) and no tuning row: nothing else applies."""
    return flash_combine.default_config(target, head_dim), None


def prewarm_variants(target: Target, dtypes: Iterable[str], head_dims: Iterable[int], head_dims_v: Iterable[int],
                     paged: Iterable[bool], aligned: Iterable[bool], index64: Iterable[bool]) -> list[Variant]:
    """flash_combine's variants for prewarm's axes: one an (output dtype, head dim, alignment, index width).

    The head dims are v's (``head_dims_v`` where given: what the combine
    sees); ``paged`` does not apply.
    """
    dims = [dim for dim in head_dims_v if dim] or list(head_dims)
    return [flash_combine.variant(target, dtype, dim, is_aligned, wide)
            for dtype, dim, is_aligned, wide in itertools.product(dtypes, dims, aligned, index64)]


def variant(kernel: str, target: Target, request: Request) -> Variant:
    """``kernels.dispatch.kernel_variant`` for flash_combine: ``flash_combine.variant`` at v's head dim."""
    return flash_combine.variant(target, request.dtype, request.head_dim_v or request.head_dim, request.aligned,
                                 request.index64, request.config)


def explained(kernel: str, target: Target, call: Request) -> tuple[Variant, Config, tuning.Row | None]:
    """``kernels.dispatch.choice`` for flash_combine: its variant at v's head dim and that config (no tuning row)."""
    found = variant(kernel, target, call)
    return found, kernel_config(kernel, target, call.dtype, call.head_dim_v or call.head_dim, False, 1, 1)[0], None
