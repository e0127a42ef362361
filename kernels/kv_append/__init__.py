"""Description of the KV-cache append kernel (``triton_kernel.py``): new keys and values written into a cache.

The family ``kv_append`` has one kernel, ``kv_append``: it writes
``flash_attn_with_kvcache``'s new ``k`` (batch, seqlen_new, heads_k,
head_dim) and ``v`` (batch, seqlen_new, heads_k, head_dim_v) into k_cache and
v_cache at each sequence's cached length, where FlashAttention-2 puts them:
key n of sequence b at position p = cache_seqlens[b] + n, row r =
``cache_batch_idx[b]`` (or b) of a contiguous cache, or row ``p % page_size``
of block ``block_table[r, p // page_size]`` of a paged one. It runs before
the decoding kernels (``flash_decode``) on the same stream, on a GPU and in
the C API (one launch, no torch indexing); on the CPU through Triton's
interpreter. The index values were checked before (``flash_decode.checks``)
where they could be read; where not (device memory in the C API, a CUDA
graph's replays, ``trusted_indices``), ``capacity`` and ``cache_rows`` bound
every write: a key whose position, block or cache row is out of range is
not written.

Parameters follow the attention kernels' conventions: pointers, then strides
in the (batch, seqlen, heads) order of FlashAttention's layout, then sizes.
Unused pointers (no cache_seqlens tensor, no cache_batch_idx, no block table,
no rotary tables) get any valid pointer and a size that says so. ``PAGED`` is
a flag (the page size is a runtime parameter); so are ``ROTARY`` and
``ROTARY_INTERLEAVED`` (each new key rotated on its way in by rotary_cos and
rotary_sin, pairs or halves; their width, length and the positions' base
``RotarySeqlens`` are runtime parameters); ``BLOCK_DV``/``EVEN_DV`` are written only when
v's head dim pads differently from k's (``lazytriton.variant``'s rule);
``ALIGN16`` and ``INDEX64`` are the attention kernels' (over k, v and the two
caches). ``BLOCK_M`` is the (new key, head) rows one program copies.
``KV_FP8`` (``e4m3``, ``e5m2``; written only for a float8 cache,
``flash_decode/kv_fp8.py``) quantises each key and value on its way in:
x / descale (``KDescale``/``VDescale``, float32, per tensor, per head or per
(batch, head) through their strides; 1.0 without ``use_k_descale``/
``use_v_descale``), saturated, rounded to nearest even. ``VARLEN``
(``variant``'s packed-sequences flag) takes FlashAttention-3's
cu_seqlens_k_new: k (total_new, heads_k, head_dim) and v packed, sequence
b's new keys rows ``CuSeqlensKNew[b]`` .. ``CuSeqlensKNew[b + 1] - 1``; the
grid is then the packed rows alone (batch 1), each row finding its sequence
among the ``num_seqs`` by a binary search. Without it ``CuSeqlensKNew`` is
any valid pointer, never read.
"""

from __future__ import annotations

from typing import Any

from lazytriton import geometry
from lazytriton.kernels.kv_append.spec import FAMILY
from lazytriton.kernels.kv_append.spec import INT_PARAMS as INT_PARAMS  # re-exported
from lazytriton.kernels.kv_append.spec import KERNELS as KERNELS  # re-exported
from lazytriton.kernels.kv_append.spec import KV_APPEND as KV_APPEND  # re-exported
from lazytriton.kernels.kv_append.spec import MODULE as MODULE  # re-exported

# Rows of (new key, key/value head) per program, 4 warps, one stage: a copy, bound by memory, untuned (no GPU
# measured it yet). 16 rows of head dim 128 at 16 bits are 4 KB of k and 4 KB of v per program, 32 bytes per
# thread; a decoding step (one new key, 8 heads) is one program per sequence.
BLOCK_M = 16
NUM_WARPS = 4


def grid(seqlen_new: int, heads_k: int, batch: int, block_m: int) -> tuple[int, int, int]:
    """Programs: blocks of BLOCK_M (new key, head) rows, at least one, x batch (y < 65536: checked with the call).

    With no new key the one block writes nothing (a rotary call launches it all the same).
    """
    return (max(1, (seqlen_new * heads_k + block_m - 1) // block_m), batch, 1)


def variant(target: Any, dtype: str, head_dim: int, head_dim_v: int, paged: bool, aligned: bool,
            index64: bool, rotary: bool = False, rotary_interleaved: bool = False, kv_fp8: str = "none",
            varlen: bool = False) -> Any:
    """The kv_append variant serving a call (pure): one config for every shape (``BLOCK_M``, ``NUM_WARPS``).

    ``head_dim_v`` 0 (or ``head_dim``): v's head dim is k's. The functional
    fields are the attention kernels' (ALIGN16, BLOCK_D, EVEN_D, INDEX64,
    BLOCK_DV/EVEN_DV where they differ), PAGED, ROTARY and ROTARY_INTERLEAVED
    (``rotary_interleaved`` counts only with ``rotary``), written only when true;
    KV_FP8 for a float8 cache (``kv_fp8``; ValueError naming k_cache on a
    target that cannot build it); VARLEN for new keys packed by cu_seqlens_k_new (``varlen``).
    """
    from lazytriton.kernels.flash_decode import kv_fp8 as fp8
    from lazytriton.variant import Variant, pairs

    padded, dv = geometry.padded_head_dim(head_dim), head_dim_v or head_dim
    padded_v = geometry.padded_value_dim(dv)  # up to 512 (MLA's latent)
    functional: dict[str, bool | int | str] = {"ALIGN16": bool(aligned), "BLOCK_D": padded,
                                               "EVEN_D": head_dim == padded, "INDEX64": bool(index64)}
    if (padded_v, dv == padded_v) != (padded, head_dim == padded):
        functional.update(BLOCK_DV=padded_v, EVEN_DV=dv == padded_v)
    for name, flag in (("PAGED", paged), ("ROTARY", rotary), ("ROTARY_INTERLEAVED", rotary and rotary_interleaved),
                       ("VARLEN", varlen)):
        if flag:
            functional[name] = True
    fp8.require(target, kv_fp8)
    functional.update(fp8.flags(kv_fp8))
    options = {"num_warps": NUM_WARPS, "num_stages": 1}
    if target.backend == "hip":
        options["waves_per_eu"] = 2  # the decoding kernels' AMD default (decode_default_config); untuned
    return Variant(FAMILY, str(target), dtype, pairs(functional), pairs({"BLOCK_M": BLOCK_M}), pairs(options))
