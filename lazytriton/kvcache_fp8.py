"""A float8 q in ``flash_attn_with_kvcache``: FlashAttention-3's FP8 decoding call over a float8 cache.

FlashAttention-3 takes q, the caches and the new keys in one float8 dtype (its FP8 forward) and returns bfloat16.
lazytriton's decoding kernels read a float8 cache with 16-bit queries (the cache dequantised in registers,
``kernels/flash_decode/kv_fp8.py``), so a float8 q and what comes with it (qv, the new keys and values, the rotary
tables, all of q's dtype in FlashAttention-3's call) are widened to bfloat16 first. Every float8_e4m3fn and
float8_e5m2 value is a bfloat16 value, so the widening is exact; the new keys are then written into the float8
cache as ``k / k_descale`` rounded to nearest, which gives back the same float8 values with no descale. Out is
bfloat16, as FlashAttention-3's. The scores and P @ V are computed from those values in the 16-bit path, so the
result is at least as close to a float64 reference as FlashAttention-3's (which rounds P to float8).
"""

from __future__ import annotations

from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(t: Any) -> bool:
    """Whether ``t`` is a tensor of a float8 dtype (the call's q takes this path)."""
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def widened(q: torch.Tensor, k_cache: Any, **tensors: Any) -> tuple[Any, ...]:
    """(q, *tensors' values) with q and each of ``tensors`` given as bfloat16; None stays None.

    ``k_cache`` and each given tensor must be of q's float8 dtype (FlashAttention-3's rule: one dtype for the
    call): a TypeError naming the first that is not, before anything is read or launched.
    """
    for name, t in (("k_cache", k_cache), *tensors.items()):
        if (name == "k_cache" or t is not None) and (not isinstance(t, torch.Tensor) or t.dtype != q.dtype):
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"with a {q.dtype} q, {name} must be {q.dtype} too (FlashAttention-3's FP8 call: q, "
                            f"the caches, the new keys and the rotary tables in one float8 dtype), got {got}")
    return tuple(None if t is None else t.to(torch.bfloat16) for t in (q, *tensors.values()))


__all__ = ["FP8_DTYPES", "is_fp8", "widened"]
