"""Description of the slot-addressed KV-cache write (``triton_kernel.py``): keys and values written at cache slots.

The family ``kv_slots`` has one kernel, ``kv_slots``: the write serving
engines run every step before attention (vLLM's
``reshape_and_cache_flash``, SGLang's ``set_kv_buffer``). It writes key
(num_tokens, heads_k, head_dim) and value (num_tokens, heads_k, head_dim_v),
token t of each at slot ``slot_mapping[t]`` of a paged cache (num_blocks,
block_size, heads_k, head_dim): block ``slot // block_size``, row ``slot %
block_size``. One launch writes both; the slots are read by the kernel only,
never on the host. A slot outside ``[0, num_blocks x block_size)`` is
skipped: negative ones are vLLM's padding, and one past the cache cannot make
the kernel write outside it.

Parameters: pointers (the slots twice, as int32 and as int64: ``SLOT64``
says which one is read, the other gets any valid pointer), the strides of
key and value in (token, head) order and of the caches in (block, slot,
head) order, then sizes. ``BLOCK_D`` is the head-dim columns a program
copies (``block_d``: chunks of at most 128 columns, so any head dim serves,
and keys and values of different widths share a chunk's grid); ``EVEN_D``
and ``EVEN_DV`` (written only where it differs from ``EVEN_D``) drop the
column mask of a width that is a multiple of it. ``ALIGN16`` and ``INDEX64``
are the attention kernels' (over key, value and the two caches). ``BLOCK_M``
is the (token, head) rows one program copies. ``KV_FP8`` (``e4m3``,
``e5m2``; written only for a float8 cache, ``flash_decode/kv_fp8.py``)
quantises each key and value on its way in: x / descale (``KDescale``/
``VDescale``, one float32 each, per tensor: vLLM's k_scale and v_scale; 1.0
without ``use_k_descale``/``use_v_descale``), saturated, rounded to nearest
even; the variant's dtype is then key's.
"""

from __future__ import annotations

from typing import Any

from lazytriton.kernels.kv_slots.spec import FAMILY
from lazytriton.kernels.kv_slots.spec import INT_PARAMS as INT_PARAMS  # re-exported
from lazytriton.kernels.kv_slots.spec import KERNELS as KERNELS  # re-exported
from lazytriton.kernels.kv_slots.spec import KV_SLOTS as KV_SLOTS  # re-exported
from lazytriton.kernels.kv_slots.spec import MODULE as MODULE  # re-exported

MIN_BLOCK_D = 16
MAX_BLOCK_D = 128
# Elements a program copies of each of key and value (BLOCK_M rows of BLOCK_D columns), 4 warps, one stage: a copy,
# bound by memory, untuned (no GPU measured it yet). 2048 elements are 16 rows at head dim 128, 32 at 64 (4 KB of
# key and 4 KB of value at 16 bits, 32 bytes a thread); a decoding step of 32 tokens x 8 heads is 16 programs.
TILE_ELEMENTS = 2048
MAX_BLOCK_M = 64
NUM_WARPS = 4


def block_d(head_dim: int, head_dim_v: int) -> int:
    """The head-dim columns one program copies: the wider head dim's next power of two, 16 to ``MAX_BLOCK_D``."""
    widest = max(head_dim, head_dim_v)
    return max(MIN_BLOCK_D, min(MAX_BLOCK_D, 1 << max(widest - 1, 0).bit_length()))


def block_m(cols: int) -> int:
    """The (token, head) rows one program copies at ``cols`` columns (``TILE_ELEMENTS``, at most ``MAX_BLOCK_M``)."""
    return min(MAX_BLOCK_M, TILE_ELEMENTS // cols)


def grid(n_rows: int, head_dim: int, head_dim_v: int, rows: int, cols: int) -> tuple[int, int, int]:
    """Programs: blocks of ``rows`` (token, head) rows x chunks of ``cols`` columns of the wider head dim."""
    return ((n_rows + rows - 1) // rows, (max(head_dim, head_dim_v) + cols - 1) // cols, 1)


def variant(target: Any, dtype: str, head_dim: int, head_dim_v: int, aligned: bool, index64: bool,
            slot64: bool, kv_fp8: str = "none") -> Any:
    """The kv_slots variant serving a call (pure): one config a column chunk (``block_d``, ``block_m``).

    ``head_dim_v`` 0 (or ``head_dim``): value's head dim is key's. Functional:
    ALIGN16, BLOCK_D, EVEN_D (and EVEN_DV where it differs), INDEX64, and
    SLOT64 (slot_mapping is int64; false: int32), written true or false;
    KV_FP8 for a float8 cache (``kv_fp8``; ValueError naming key_cache on a
    target that cannot build it).
    """
    from lazytriton.kernels.flash_decode import kv_fp8 as fp8
    from lazytriton.variant import Variant, pairs

    dim_v = head_dim_v or head_dim
    cols = block_d(head_dim, dim_v)
    functional: dict[str, bool | int | str] = {"ALIGN16": bool(aligned), "BLOCK_D": cols,
                                               "EVEN_D": head_dim % cols == 0, "INDEX64": bool(index64),
                                               "SLOT64": bool(slot64)}
    if (dim_v % cols == 0) != (head_dim % cols == 0):
        functional["EVEN_DV"] = dim_v % cols == 0
    fp8.require(target, kv_fp8, "key_cache")
    functional.update(fp8.flags(kv_fp8))
    options = {"num_warps": NUM_WARPS, "num_stages": 1}
    if target.backend == "hip":
        options["waves_per_eu"] = 2  # the decoding kernels' AMD default, as kv_append; untuned
    return Variant(FAMILY, str(target), dtype, pairs(functional), pairs({"BLOCK_M": block_m(cols)}),
                   pairs(options))
