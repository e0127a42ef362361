"""``write_kvcache_slots``: the slot-addressed KV-cache write serving engines run every step, from lazytriton's cache.

vLLM's ``reshape_and_cache_flash`` and SGLang's ``set_kv_buffer``: each new
token's key and value written at the cache slot the engine chose for it.
Layering is the other entry points': this thin function checks its
arguments (a ``TypeError``/``ValueError`` naming the argument before
anything is launched), then calls the binding
(``kernels/kv_slots/binding.py``) directly when nothing is tracing, or else
the torch op ``lazytriton::kvcache_slots`` (``lazytriton.kvcache_slots_op``).
``reshape_and_cache_flash`` is the same write with vLLM's arguments.

``import lazytriton`` does not import this module (it imports torch): the
names are re-exported lazily by ``lazytriton/__init__.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.arguments import index_tensor, shown
from lazytriton.kernels.kv_slots import binding, checks

_is_compiling = torch.compiler.is_compiling
_dispatch_mode = getattr(torch.utils._python_dispatch, "_get_current_dispatch_mode", lambda: None)
_Tensor = torch.Tensor


def _direct(*tensors: Any) -> bool:
    """True when the op's dispatch adds nothing: plain tensors, nothing tracing, no dispatch mode."""
    return all(type(t) is _Tensor for t in tensors) and not _is_compiling() and _dispatch_mode() is None


def write_kvcache_slots(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_descale: torch.Tensor | None = None,
                        v_descale: torch.Tensor | None = None) -> None:
    """Write token t's key and value into slot ``slot_mapping[t]`` of a paged KV cache, in place: one launch.

    Slot s is row ``s % block_size`` of block ``s // block_size``; a
    negative slot is skipped (vLLM's padding), and so is a slot at or past
    num_blocks x block_size: the slots are never read on the host (no
    synchronisation, nothing to trust), and the kernel bounds every write by
    the cache. Two tokens with one slot leave either one's key there.

    Args:
        key: (num_tokens', heads_k, head_dim), num_tokens' >= num_tokens:
            rows past len(slot_mapping) are not read (vLLM's padding). Any
            strides with a contiguous last dim: a view of a fused qkv tensor
            serves as it is.
        value: (num_tokens', heads_k, head_dim_v), the same.
        key_cache: (num_blocks, block_size, heads_k, head_dim), float16,
            bfloat16 or float32 of key's dtype, or float8 (float8_e4m3fn,
            float8_e5m2: key / k_descale is written, saturated to the
            format's range, rounded to nearest even), key's device; any block_size
            (1 too: SGLang's token pool ``(size, heads_k, head_dim)`` is
            ``.unsqueeze(1)`` of it) and any strides with a contiguous last
            dim (vLLM's ``kv_cache.unbind(0)``, or a permuted HND cache).
        value_cache: (num_blocks, block_size, heads_k, head_dim_v), key_cache's
            dtype and device.
        slot_mapping: int32 or int64 (num_tokens,): each token's slot. A
            strided view is copied first (the kernel reads it through its
            pointer).
        k_descale: for a float8 cache, one float32 (shape () or (1,), per
            tensor: vLLM's k_scale) on the caches' device; None: 1.0. Given
            with a cache that is not float8: ValueError.
        v_descale: value's, the same.

    CUDA/ROCm tensors run a cached kernel (compiled on first use if no tier
    holds it; CUDA-graph capturable once loaded); CPU tensors run the same
    kernel through Triton's interpreter; torch.compile(fullgraph=True)
    traces it through the op ``torch.ops.lazytriton.kvcache_slots``, which
    declares both caches mutated. Keys and values are copied bit for bit into a
    cache of their dtype; a float8_e4m3fn cache needs a target that has it
    (sm_89 or newer on CUDA; ``kv_fp8.unsupported``).

    """
    slot_mapping = index_tensor(slot_mapping)
    call = checks.check(key, value, key_cache, value_cache, slot_mapping, k_descale, v_descale)
    if _direct(key, value, key_cache, value_cache, slot_mapping) and _direct(
            *(d for d in (k_descale, v_descale) if d is not None)):
        binding.write(key, value, key_cache, value_cache, slot_mapping, call, k_descale, v_descale)
        return
    from lazytriton.kvcache_slots_op import kvcache_slots_op

    kvcache_slots_op(key, value, key_cache, value_cache, slot_mapping, k_descale, v_descale)


# vLLM's kv_cache_dtype names of a float8 cache: the format the cache holds.
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _scale(name: str, scale: Any) -> None:
    if isinstance(scale, bool) or not (scale is None or isinstance(scale, (torch.Tensor, float, int))):
        raise TypeError(f"{name} must be a tensor, a float or None, got {shown(scale)}")


def _fp8_cache(name: str, cache: Any, kv_cache_dtype: str) -> Any:
    """A float8 cache of ``kv_cache_dtype``'s format: that dtype as it is, uint8 bytes (vLLM's) viewed as it."""
    fmt = FP8_CACHE_DTYPES[kv_cache_dtype]
    if not isinstance(cache, torch.Tensor):
        return cache  # checks.check names it
    if cache.dtype == torch.uint8:
        return cache.view(fmt)
    if cache.dtype != fmt:
        raise TypeError(f"{name} must be {fmt} (or uint8 bytes) for kv_cache_dtype {kv_cache_dtype!r}, got "
                        f"{cache.dtype}")
    return cache


def _descale(name: str, scale: Any, cache: Any) -> torch.Tensor | None:
    """The descale of vLLM's per-tensor scale: a tensor as it is, a float as one float32 on the cache's device."""
    _scale(name, scale)
    if isinstance(scale, (float, int)) and isinstance(cache, torch.Tensor):
        return torch.full((1,), float(scale), dtype=torch.float32, device=cache.device)
    return scale  # type: ignore[no-any-return]


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                            k_scale: Any = None, v_scale: Any = None) -> None:
    """The write with vLLM's ``reshape_and_cache_flash``'s arguments, in its order: ``write_kvcache_slots``.

    ``kv_cache_dtype`` ``"auto"``: the caches hold key's dtype; ``k_scale``
    and ``v_scale`` are then not read, as in vLLM. ``"fp8"`` or
    ``"fp8_e4m3"``: float8_e4m3fn caches, ``"fp8_e5m2"``: float8_e5m2 (uint8
    caches, vLLM's bytes, are viewed as that format); the caches get
    key / k_scale and value / v_scale (``k_scale``/``v_scale``: one float32
    tensor each, vLLM's per-tensor scales, or a float; None: 1.0).
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {shown(kv_cache_dtype)}")
    if kv_cache_dtype == "auto":
        _scale("k_scale", k_scale)
        _scale("v_scale", v_scale)
        write_kvcache_slots(key, value, key_cache, value_cache, slot_mapping)
        return
    if kv_cache_dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {tuple(FP8_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    key_cache = _fp8_cache("key_cache", key_cache, kv_cache_dtype)
    value_cache = _fp8_cache("value_cache", value_cache, kv_cache_dtype)
    write_kvcache_slots(key, value, key_cache, value_cache, slot_mapping, _descale("k_scale", k_scale, key_cache),
                        _descale("v_scale", v_scale, key_cache))


__all__ = ["reshape_and_cache_flash", "write_kvcache_slots"]
