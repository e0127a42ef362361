"""Host side of ``kv_append_lengths``: each sequence's key count after new keys packed by cu_seqlens_k_new.

``variant`` is the one variant (pure; BLOCK sequences a program, int32 in and out, so the dtype field is fixed
to fp32: the call's dtype does not enter the binary); ``ints`` lays the arguments out in the description's
order (``c_initializer`` is the C API's side of the same list, compared field by field by the tests);
``lengths`` launches it: the cached binary on a GPU (one launch on the current stream, no host read, memoised
plan: capturable once planned), Triton's interpreter on the CPU. The values were checked before
(``flash_decode.values``) or are trusted, as kv_append's are.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import launch, runtime
from lazytriton.kernels.kv_append.lengths_spec import INT_PARAMS, KERNEL, KV_APPEND_LENGTHS

# Sequences a program, 1 warp, one stage: an add over at most 65535 int32s (batch's bound), untuned (nothing
# to tune: one program covers a batch of 256 in one wave).
BLOCK = 256
NUM_WARPS = 1
DTYPE = "fp32"  # Variant's dtype field: the kernel reads and writes int32 whatever the call's dtype
MEMO_TAG = (KERNEL,)  # the runtime plans' key: one plan per device


def variant(target: Any) -> Any:
    """The kv_append_lengths variant for ``target`` (pure): no functional field, BLOCK, 1 warp, 1 stage."""
    from lazytriton.variant import Variant, pairs

    options: dict[str, int] = {"num_warps": NUM_WARPS, "num_stages": 1}
    return Variant(KERNEL, str(target), DTYPE, (), pairs({"BLOCK": BLOCK}), pairs(options))


def grid(batch: int, block: int = BLOCK) -> tuple[int, int, int]:
    """Programs: blocks of ``block`` sequences."""
    return ((batch + block - 1) // block, 1, 1)


def ints(seqlens: torch.Tensor | None, cu_seqlens_k_new: torch.Tensor, lens: torch.Tensor, batch: int,
         seqlen_const: int, pointers: Any = lambda x: int(x.data_ptr())) -> tuple[Any, ...]:
    """The kernel's arguments in the description's order (no seqlens tensor: cu_seqlens_k_new, never read)."""
    return (pointers(cu_seqlens_k_new if seqlens is None else seqlens), pointers(cu_seqlens_k_new), pointers(lens),
            batch, max(seqlen_const, 0), int(seqlens is not None))


# What capi/lt_kvcache.c passes for each parameter (p: the caller's lt_attn_kvcache_params, c: its checked call,
# lens: the workspace's int32 lengths).
_C = {"Seqlens": "LT__OR_K(p->cache_seqlens)", "CuSeqlensKNew": "LT__PTR(p->cu_seqlens_k_new)", "Lens": "lens",
      "batch": "c->b", "seqlen_const": "c->seqlen_const > 0 ? c->seqlen_const : 0", "use_seqlens": "c->use_seqlens"}


def c_initializer() -> str:
    """The C launcher's argument initializer of kv_append_lengths, in its description's order."""
    return ", ".join(_C[name] for name in INT_PARAMS)


def plan(device: torch.device) -> Any:
    """The loaded kernel, memoised in the runtime's plans; during a capture, an unloaded one raises CaptureError."""
    rt = runtime.get()
    key = (*MEMO_TAG, device.index)
    found = rt.plans.get(key)
    if found is None:
        found = launch.plan(rt, key, device, lambda target: ((variant(target), ()),),
                            "run flash_attn_with_kvcache once with cu_seqlens_k_new before the capture")
    return found[0]


def lengths(seqlens: torch.Tensor | None, cu_seqlens_k_new: torch.Tensor, batch: int, seqlen_const: int = 0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 (batch,): seqlens[b] (or ``seqlen_const``) + cu_seqlens_k_new[b + 1] - cu_seqlens_k_new[b].

    ``seqlens`` int32 (batch,) or None; ``cu_seqlens_k_new`` int32 (batch + 1,); both on one device, checked
    before. ``out``: an int32 (batch,) tensor to write instead of a new one.
    """
    device = cu_seqlens_k_new.device
    lens = torch.empty(batch, dtype=torch.int32, device=device) if out is None else out
    if batch == 0:
        return lens
    if device.type == "cpu":
        from lazytriton import compiler

        block = 4  # a small tile, so several programs run on test shapes
        compiler.interpret(KV_APPEND_LENGTHS.name, grid(batch, block),
                           ints(seqlens, cu_seqlens_k_new, lens, batch, seqlen_const, pointers=lambda x: x),
                           {"BLOCK": block})
        return lens
    kernel = plan(device)
    kernel.launch(grid(batch), launch.raw_stream(device.index), ints(seqlens, cu_seqlens_k_new, lens, batch,
                                                                     seqlen_const), (), launch.scratch_alloc)
    return lens
