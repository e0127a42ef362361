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
                        slot_mapping: torch.Tensor) -> None:
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
            bfloat16 or float32, key's dtype and device; any block_size
            (1 too: SGLang's token pool ``(size, heads_k, head_dim)`` is
            ``.unsqueeze(1)`` of it) and any strides with a contiguous last
            dim (vLLM's ``kv_cache.unbind(0)``, or a permuted HND cache).
        value_cache: (num_blocks, block_size, heads_k, head_dim_v), key_cache's
            dtype and device.
        slot_mapping: int32 or int64 (num_tokens,): each token's slot. A
            strided view is copied first (the kernel reads it through its
            pointer).

    CUDA/ROCm tensors run a cached kernel (compiled on first use if no tier
    holds it; CUDA-graph capturable once loaded); CPU tensors run the same
    kernel through Triton's interpreter; torch.compile(fullgraph=True)
    traces it through the op ``torch.ops.lazytriton.kvcache_slots``, which
    declares both caches mutated. Keys and values are copied bit for bit (no
    conversion: an FP8 cache is refused).

    """
    slot_mapping = index_tensor(slot_mapping)
    call = checks.check(key, value, key_cache, value_cache, slot_mapping)
    if _direct(key, value, key_cache, value_cache, slot_mapping):
        binding.write(key, value, key_cache, value_cache, slot_mapping, call)
        return
    from lazytriton.kvcache_slots_op import kvcache_slots_op

    kvcache_slots_op(key, value, key_cache, value_cache, slot_mapping)


def _scale(name: str, scale: Any) -> None:
    if isinstance(scale, bool) or not (scale is None or isinstance(scale, (torch.Tensor, float, int))):
        raise TypeError(f"{name} must be a tensor, a float or None, got {shown(scale)}")


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                            k_scale: Any = None, v_scale: Any = None) -> None:
    """The write with vLLM's ``reshape_and_cache_flash``'s arguments, in its order: ``write_kvcache_slots``.

    ``kv_cache_dtype`` must be ``"auto"`` (the caches hold key's dtype);
    ``k_scale`` and ``v_scale`` are then not read, as in vLLM. An FP8 cache
    (``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``) raises ValueError: this write
    does not quantise.
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {shown(kv_cache_dtype)}")
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be 'auto' (caches of key's dtype: float16, bfloat16 or float32), got "
                         f"{kv_cache_dtype!r}: lazytriton's slot write does not quantise to an FP8 cache")
    _scale("k_scale", k_scale)
    _scale("v_scale", v_scale)
    write_kvcache_slots(key, value, key_cache, value_cache, slot_mapping)


__all__ = ["reshape_and_cache_flash", "write_kvcache_slots"]
