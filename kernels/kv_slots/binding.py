"""Host side of kv_slots: the one owner of the slot write's launch ABI.

Everything that launches ``kv_slots`` (``lazytriton.write_kvcache_slots``,
its torch op, benchmarks) goes through here, after ``checks.check`` passed
the call: ``ints`` lays the arguments out in the description's order,
``layout_flags`` reads the alignment and index width over key, value and the
caches, ``plan`` loads the variant (memoised in the runtime's plans, refused
during a CUDA graph capture if not loaded), and ``write`` runs it: the cached
binary on a GPU, Triton's interpreter on the CPU, nothing on meta. No value
of any tensor is read on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import launch, runtime
from lazytriton.kernels.kv_slots import FAMILY, INT_PARAMS, KV_SLOTS, block_d, grid, variant
from lazytriton.kernels.kv_slots.checks import DTYPES, INT32_MAX, Call

_LAYOUT = ("K", "V", "KCache", "VCache", "Slots32", "Slots64", "KDescale", "VDescale",
           "stride_kt", "stride_kh", "stride_vt", "stride_vh",
           *(f"stride_{n}{d}" for n in ("kc", "vc") for d in "bsh"), "heads_k", "n_rows", "head_dim", "head_dim_v",
           "block_size", "num_slots", "use_k_descale", "use_v_descale")
if _LAYOUT != INT_PARAMS:  # pragma: no cover (an edit of one side only)
    raise ImportError(f"ints writes {_LAYOUT}, the description has {INT_PARAMS}")
INTERPRETER_BLOCK_M = 4  # the CPU path's row tile: smaller than the test shapes, so several programs run


def _ptr(x: Any) -> int:
    return int(x.data_ptr())


def ints(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
         slot_mapping: torch.Tensor, call: Call, pointers: Any = _ptr, k_descale: torch.Tensor | None = None,
         v_descale: torch.Tensor | None = None) -> tuple[Any, ...]:
    """The kernel's arguments in ``_LAYOUT``'s order (the slot pointer not read: the same tensor, any valid one).

    An absent descale: key's pointer, never read, and a 0 flag.
    """
    ks, vs, kcs, vcs = key.stride(), value.stride(), key_cache.stride(), value_cache.stride()
    slots = pointers(slot_mapping)
    return (pointers(key), pointers(value), pointers(key_cache), pointers(value_cache), slots, slots,
            pointers(key if k_descale is None else k_descale), pointers(key if v_descale is None else v_descale),
            ks[0], ks[1], vs[0], vs[1], kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2],
            call.heads_k, call.n_rows, call.head_dim, call.value_dim, call.block_size, call.num_slots,
            int(k_descale is not None), int(v_descale is not None))


def _extent(t: torch.Tensor) -> int:
    """How far past its first element a tensor's last one lies (elements)."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 0)


def layout_flags(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
                 ) -> tuple[bool, bool]:
    """(aligned, index64): 16-byte aligned pointers and outer strides; some tensor spans 2**31 elements or more."""
    bits = 0
    for t in (key, value, key_cache, value_cache):
        bits |= t.data_ptr()
        for stride in t.stride()[:-1]:
            bits |= stride
    index64 = max(_extent(t) for t in (key, value, key_cache, value_cache)) >= INT32_MAX
    return not bits & 15, index64


def memo_key(device_index: int | None, dtype: torch.dtype, call: Call, aligned: bool, index64: bool
             ) -> tuple[Any, ...]:
    """Everything ``variant`` reads: the head dims through their column chunk and whether it divides them."""
    cols = block_d(call.head_dim, call.value_dim)
    return (FAMILY, device_index, dtype, cols, call.head_dim % cols == 0, call.value_dim % cols == 0, aligned,
            index64, call.slot64, *((call.kv_fp8,) if call.kv_fp8 != "none" else ()))


def plan(device: torch.device, dtype: torch.dtype, call: Call, aligned: bool, index64: bool) -> tuple[Any, ...]:
    """(kernel, BLOCK_M, BLOCK_D), loaded, memoised; during a capture, an unloaded one raises CaptureError.

    ``dtype``: key's (a float8 cache's bytes are typed as key's dtype in the description).
    """
    rt = runtime.get()
    key = memo_key(device.index, dtype, call, aligned, index64)
    found = rt.plans.get(key)
    if found is not None:
        return found  # type: ignore[no-any-return]

    def choose(target: Any) -> launch.Choice:
        return ((variant(target, DTYPES[dtype], call.head_dim, call.head_dim_v, aligned, index64, call.slot64,
                         call.kv_fp8), ("BLOCK_M", "BLOCK_D")),)

    return launch.plan(rt, key, device, choose, "run lazytriton.write_kvcache_slots once with this head dim, dtype "
                       "and slot_mapping dtype before the capture")


def interpreter_constexprs(call: Call) -> dict[str, Any]:
    """The constexprs for Triton's interpreter: the call's column chunk, a small row tile."""
    cols = block_d(call.head_dim, call.value_dim)
    return {"BLOCK_M": INTERPRETER_BLOCK_M, "BLOCK_D": cols, "EVEN_D": call.head_dim % cols == 0,
            "EVEN_DV": call.value_dim % cols == 0, "SLOT64": call.slot64, "KV_FP8": call.kv_fp8}


def write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
          slot_mapping: torch.Tensor, call: Call, k_descale: torch.Tensor | None = None,
          v_descale: torch.Tensor | None = None) -> None:
    """Write key and value into the caches at slot_mapping, in place: one launch (after ``checks.check``).

    A float8 cache (``call.kv_fp8``) gets key / k_descale and value / v_descale (None: 1.0).
    """
    device = key_cache.device
    if device.type == "meta" or call.n_rows == 0:
        return
    if device.type == "cpu":
        from lazytriton import compiler

        constexprs = interpreter_constexprs(call)
        compiler.interpret(KV_SLOTS.name, grid(call.n_rows, call.head_dim, call.value_dim, INTERPRETER_BLOCK_M,
                                               constexprs["BLOCK_D"]),
                           ints(key, value, key_cache, value_cache, slot_mapping, call, pointers=lambda x: x,
                                k_descale=k_descale, v_descale=v_descale),
                           constexprs)
        return
    aligned, index64 = layout_flags(key, value, key_cache, value_cache)
    kernel, rows, cols = plan(device, key.dtype, call, aligned, index64)
    kernel.launch(grid(call.n_rows, call.head_dim, call.value_dim, rows, cols), launch.raw_stream(device.index),
                  ints(key, value, key_cache, value_cache, slot_mapping, call, k_descale=k_descale,
                       v_descale=v_descale), (), launch.scratch_alloc)

