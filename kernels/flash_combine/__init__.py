"""Description of the attention combine kernel (``triton_kernel.py``): FlashAttention-3's ``flash_attn_combine``.

The family ``flash_combine`` has one kernel, ``flash_combine``: it merges
attention computed over disjoint chunks of the keys (split-KV decoding, or the
ranks of context parallelism), each chunk's float32 output and natural-log
logsumexp, into the output and logsumexp of attention over all the keys:
``lse = logsumexp_n lse_n`` and ``out = sum_n exp(lse_n - lse) * out_n``. A
chunk whose lse is -inf saw no key and counts for nothing (its output is not
read); a row whose every chunk is -inf gets out 0 and lse -inf. It is the
split-KV combine of the decoding kernels (``flash_decode_combine``) for any
caller: any strides (a contiguous head dim), any number of splits (a runtime
argument), any head dim, an output of float32, float16 or bfloat16.

Parameters follow the attention kernels' conventions: pointers, then strides
(split, batch, query, head for the partials; batch, query, head for the
outputs), then sizes. ``BLOCK_D`` is the head-dim columns one program
combines: the padded head dim up to ``MAX_BLOCK_D``; a wider head dim is cut
in chunks of that many columns, one program each (FlashAttention-3 cuts its
own at 128 too: a small tile of rows keeps enough programs for a decoding
batch). ``EVEN_D``: the head dim is a multiple of ``BLOCK_D`` (no column
mask). ``ALIGN16`` may assume the pointers and outer strides of the partial
outputs and the output are multiples of 16 (``aligned_params``); ``INDEX64``
makes the strides 64-bit (the partials of many splits span 2**31 elements
soon).
"""

from __future__ import annotations

from typing import Any

from lazytriton.kernels.flash_combine.spec import FAMILY
from lazytriton.kernels.flash_combine.spec import FLASH_COMBINE as FLASH_COMBINE  # re-exported
from lazytriton.kernels.flash_combine.spec import INT_PARAMS as INT_PARAMS  # re-exported
from lazytriton.kernels.flash_combine.spec import KERNELS as KERNELS  # re-exported
from lazytriton.kernels.flash_combine.spec import MODULE as MODULE  # re-exported
from lazytriton.tiles import Config

MIN_BLOCK_D = 16
MAX_BLOCK_D = 128
# Rows x splits x columns a program reads a step in float32 (TILE_ELEMENTS: 32 a thread at 4 warps), BLOCK_M from
# it: 2 rows at head dim 128, 4 at 64, at most 64; BLOCK_N splits a step (a row's splits in one round trip up to
# 16); 4 warps, one stage. A combine reads every partial once, bound by memory and, at a decoding batch's few rows
# (batch x heads), by the latency of its loads: one step a row's splits, on many programs.
TILE_ELEMENTS = 4096
MAX_BLOCK_M = 64
BLOCK_N = 16
NUM_WARPS = 4


def block_d(head_dim: int) -> int:
    """The head-dim columns one program combines: the next power of two, 16 to ``MAX_BLOCK_D``."""
    return max(MIN_BLOCK_D, min(MAX_BLOCK_D, 1 << max(head_dim - 1, 0).bit_length()))


def default_config(target: Any, head_dim: int) -> Config:
    """The one config of a head dim (pure): BLOCK_M rows of ``block_d`` columns, BLOCK_N splits a step."""
    rows = min(MAX_BLOCK_M, max(1, TILE_ELEMENTS // (BLOCK_N * block_d(head_dim))))
    return Config(rows, BLOCK_N, NUM_WARPS, 1, 2 if target.backend == "hip" else 0)


def grid(n_rows: int, head_dim: int, block_m: int, block_cols: int) -> tuple[int, int, int]:
    """Programs: blocks of BLOCK_M (batch, query, head) rows x chunks of BLOCK_D columns."""
    return ((n_rows + block_m - 1) // block_m, (head_dim + block_cols - 1) // block_cols, 1)


def variant(target: Any, dtype: str, head_dim: int, aligned: bool, index64: bool, config: Config | None = None
            ) -> Any:
    """The flash_combine variant serving a call (pure): ``dtype`` is the output's (the partials are float32).

    Functional: ALIGN16, BLOCK_D (``block_d``), EVEN_D, INDEX64; tuned:
    ``config`` (None: ``default_config``) BLOCK_M and BLOCK_N.
    """
    from lazytriton.variant import Variant, pairs

    cols = block_d(head_dim)
    cfg = config or default_config(target, head_dim)
    functional: dict[str, bool | int] = {"ALIGN16": bool(aligned), "BLOCK_D": cols, "EVEN_D": head_dim % cols == 0,
                                         "INDEX64": bool(index64)}
    return Variant(FAMILY, str(target), dtype, pairs(functional), pairs(cfg.tuned()), pairs(cfg.options(target)))
