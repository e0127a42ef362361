"""Checks of a slot-addressed KV-cache write: its tensors become one ``Call``, or an error naming the argument.

``check`` reads shapes, dtypes, strides and devices only (nothing is read
from a tensor's memory: the slots' values are the kernel's to bound), and
raises a ``TypeError`` (a wrong type or dtype) or a ``ValueError`` (a wrong
shape, stride, device or size) naming the argument, the value and what was
expected, before anything is launched.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lazytriton.kernels.arguments import shown
from lazytriton.kernels.kv_slots import MAX_BLOCK_D

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Float8 caches (flash_decode/kv_fp8.py: the cache holds x / descale), written from keys of any of DTYPES.
KV_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
SLOT_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
MAX_GRID_Y = 65535  # head-dim chunks: CUDA's and HIP's grid y limit
_ROW_MARGIN = 1024  # the kernel's row indices (program x BLOCK_M + lane) stay in 32 bits past the last row


class Call(NamedTuple):
    """A checked write in the kernel's terms.

    ``num_tokens``: slot_mapping's length (key and value may hold more rows:
    vLLM's padding, not written); ``num_slots``: num_blocks x block_size.
    ``head_dim_v`` is value's head dim, 0 when it is key's. ``kv_fp8``: the
    caches' float8 format (``e4m3``, ``e5m2``; ``none``: key's dtype).
    """

    num_tokens: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    block_size: int
    num_slots: int
    slot64: bool
    kv_fp8: str = "none"

    @property
    def value_dim(self) -> int:
        """Value's head dim."""
        return self.head_dim_v or self.head_dim

    @property
    def n_rows(self) -> int:
        """The (token, head) rows written."""
        return self.num_tokens * self.heads_k


def _tensor(name: str, t: Any, dims: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {shown(t)}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims {layout}, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def _cache(name: str, t: Any, dtype: torch.dtype | None) -> torch.Tensor:
    t = _tensor(name, t, 4, "(num_blocks, block_size, heads_k, head_dim)")
    if t.dtype not in DTYPES and t.dtype not in KV_FP8:
        raise TypeError(f"{name} must be float16, bfloat16, float32, float8_e4m3fn or float8_e5m2, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but key_cache has {dtype}; the caches must have one dtype")
    if any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride(), strict=True)):
        raise ValueError(f"{name} must not have a broadcast (stride 0) dim: its slots would overlap, got strides "
                         f"{t.stride()}")
    return t


def _slots(slot_mapping: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor, got {shown(slot_mapping)}")
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must have 1 dim (num_tokens,), got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but key_cache is on {device}; they must be on "
                         "one device")
    return slot_mapping


def _descales(k_descale: Any, v_descale: Any, key_cache: torch.Tensor) -> None:
    """A descale is one float32 on the caches' device, and only a float8 cache takes one."""
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
        if descale is None:
            continue
        if not isinstance(descale, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {shown(descale)}")
        if key_cache.dtype not in KV_FP8:
            raise ValueError(f"{name} is given but key_cache is {key_cache.dtype}, not a float8 cache "
                             f"({', '.join(map(str, KV_FP8))}); descales apply to float8 caches only")
        if descale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {descale.dtype}")
        if tuple(descale.shape) not in ((), (1,)):
            raise ValueError(f"{name} must hold one value (shape () or (1,): per tensor), got shape "
                             f"{tuple(descale.shape)}")
        if descale.device != key_cache.device:
            raise ValueError(f"{name} is on {descale.device} but key_cache is on {key_cache.device}; they must be "
                             "on one device")


def check(key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any, k_descale: Any = None,
          v_descale: Any = None) -> Call:
    """The ``Call`` of a write of ``key``/``value`` into ``key_cache``/``value_cache`` at ``slot_mapping``.

    key (num_tokens', heads_k, head_dim) and value (num_tokens', heads_k,
    head_dim_v), num_tokens' >= len(slot_mapping), the caches' dtype and
    device; key_cache (num_blocks, block_size, heads_k, head_dim) and
    value_cache (num_blocks, block_size, heads_k, head_dim_v), float16,
    bfloat16 or float32, or float8 (float8_e4m3fn, float8_e5m2: key and value
    then float16, bfloat16 or float32, quantised on the way in); slot_mapping
    int32 or int64 (num_tokens,). Every tensor's last dim contiguous; any
    other strides. k_descale and v_descale: one float32 each (shape () or
    (1,)) on the caches' device, for a float8 cache only (None: 1.0).
    """
    key_cache = _cache("key_cache", key_cache, None)
    value_cache = _cache("value_cache", value_cache, key_cache.dtype)
    device, dtype = key_cache.device, key_cache.dtype
    _descales(k_descale, v_descale, key_cache)
    if value_cache.device != device:
        raise ValueError(f"value_cache is on {value_cache.device} but key_cache is on {device}; they must be on one "
                         "device")
    if tuple(value_cache.shape[:3]) != tuple(key_cache.shape[:3]):
        raise ValueError(f"value_cache must have key_cache's (num_blocks, block_size, heads_k) = "
                         f"{tuple(key_cache.shape[:3])}, got shape {tuple(value_cache.shape)}")
    num_blocks, block_size, heads_k, head_dim = (int(n) for n in key_cache.shape)
    head_dim_v = int(value_cache.shape[3])
    slots = _slots(slot_mapping, device)
    num_tokens = int(slots.shape[0])
    for name, t, dim in (("key", key, head_dim), ("value", value, head_dim_v)):
        t = _tensor(name, t, 3, "(num_tokens, heads_k, head_dim)")
        if dtype in KV_FP8 and t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32 (written into a {dtype} cache), got "
                            f"{t.dtype}")
        if dtype not in KV_FP8 and t.dtype != dtype:
            raise TypeError(f"{name} must have the caches' dtype {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but key_cache is on {device}; they must be on one device")
        if tuple(t.shape[1:]) != (heads_k, dim):
            raise ValueError(f"{name} must have shape (num_tokens, {heads_k}, {dim}) (heads_k and head dim of its "
                             f"cache), got {tuple(t.shape)}")
        if t.shape[0] < num_tokens:
            raise ValueError(f"{name} must have at least len(slot_mapping) = {num_tokens} rows, got "
                             f"{t.shape[0]}")
    if min(head_dim, head_dim_v) < 1 or block_size < 1:
        raise ValueError(f"the caches' block_size and head dims must be >= 1, got key_cache "
                         f"{tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)}")
    if num_tokens * heads_k > INT32_MAX - _ROW_MARGIN:
        raise ValueError(f"slot_mapping's {num_tokens} tokens x {heads_k} heads are more than "
                         f"{INT32_MAX - _ROW_MARGIN} (token, head) rows (32-bit row indices)")
    if -(-max(head_dim, head_dim_v) // MAX_BLOCK_D) > MAX_GRID_Y:
        raise ValueError(f"the head dims must be at most {MAX_GRID_Y * MAX_BLOCK_D}, got {head_dim} and {head_dim_v}")
    if key.dtype != value.dtype:
        raise TypeError(f"value must have key's dtype {key.dtype}, got {value.dtype}")
    return Call(num_tokens, heads_k, head_dim, 0 if head_dim_v == head_dim else head_dim_v, block_size,
                num_blocks * block_size, slots.dtype == torch.int64, KV_FP8.get(dtype, "none"))
