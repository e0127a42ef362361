"""Host side of kv_append: the one owner of the append kernel's launch ABI.

Everything that launches ``kv_append`` (``flash_decode.binding.forward``, the
C API's plans through ``c_initializer``) goes through here: ``ints`` lays
the arguments out in the description's order, ``layout_flags`` reads the
alignment and index width over k, v and the caches, ``plan`` loads the
variant (memoised in the runtime's plans, refused during a CUDA graph capture
if not loaded), and ``append`` runs it: the cached binary on a GPU, Triton's
interpreter on the CPU. The call was checked before (``flash_decode.checks``:
shapes and, unless trusted, the index values), so nothing here checks.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import geometry, launch, runtime
from lazytriton.kernels.flash_decode.checks import DTYPES, INT32_MAX, Call, Inputs, descale_strides
from lazytriton.kernels.kv_append import BLOCK_M, FAMILY, INT_PARAMS, KV_APPEND, grid, variant

_LAYOUT = ("K", "V", "KCache", "VCache", "Seqlens", "BatchIdx", "BlockTable", "RotaryCos", "RotarySin",
           "RotarySeqlens", "KDescale", "VDescale", "CuSeqlensKNew",
           *(f"stride_{n}{d}" for n in ("k", "v", "kc", "vc") for d in "bsh"),
           "stride_tb", "stride_kdb", "stride_kdh", "stride_vdb", "stride_vdh",
           "heads_k", "seqlen_new", "head_dim", "head_dim_v", "seqlen_const", "use_seqlens", "use_batch_idx",
           "page_size", "capacity", "cache_rows", "rotary_dim", "seqlen_ro", "use_rotary_seqlens", "use_k_descale",
           "use_v_descale", "num_seqs")
if _LAYOUT != INT_PARAMS:  # pragma: no cover (an edit of one side only)
    raise ImportError(f"ints writes {_LAYOUT}, the description has {INT_PARAMS}")


def _ptr(x: Any) -> int:
    return int(x.data_ptr())


def ints(t: Inputs, call: Call, pointers: Any = _ptr) -> tuple[Any, ...]:
    """The kernel's arguments in ``_LAYOUT``'s order (an absent index tensor: k, never read, and a 0 flag).

    New keys packed by cu_seqlens_k_new (k and v 3-D) get batch stride 0: their rows are the packed keys.
    """
    k, v = t.k, t.v
    assert k is not None and v is not None  # the caller appends only with new keys
    seqlens = t.cache_seqlens if isinstance(t.cache_seqlens, torch.Tensor) else None
    rows, table = t.cache_batch_idx, t.block_table
    cos, sin, bases = t.rotary_cos, t.rotary_sin, t.rotary_seqlens
    kd, vd, cu = t.k_descale, t.v_descale, t.cu_seqlens_k_new
    ks, vs, kcs, vcs = k.stride(), v.stride(), t.k_cache.stride(), t.v_cache.stride()
    if cu is not None:
        ks, vs = (0, *ks), (0, *vs)
    kds, vds = descale_strides(kd), descale_strides(vd)
    return (pointers(k), pointers(v), pointers(t.k_cache), pointers(t.v_cache),
            pointers(k if seqlens is None else seqlens), pointers(k if rows is None else rows),
            pointers(k if table is None else table), pointers(k if cos is None else cos),
            pointers(k if sin is None else sin), pointers(k if bases is None else bases),
            pointers(k if kd is None else kd), pointers(k if vd is None else vd), pointers(k if cu is None else cu),
            ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2],
            0 if table is None else table.stride(0), kds[0], kds[1], vds[0], vds[1],
            call.heads_k, call.seqlen_new, call.head_dim, call.value_dim, max(call.seqlen_const, 0),
            int(seqlens is not None), int(rows is not None), call.page_size, call.capacity, call.cache_rows,
            call.rotary_dim, call.seqlen_ro, int(call.rotary_seqlens), int(kd is not None), int(vd is not None),
            call.batch)


# What capi/lt_kvcache.c passes for each parameter (p: the caller's lt_attn_kvcache_params, c: its checked call;
# tests/test_capi_kvcache.py compares the C initializer with these, field by field).
_C = {"K": "LT__PTR(p->k)", "V": "LT__PTR(p->v)", "KCache": "LT__PTR(p->k_cache)", "VCache": "LT__PTR(p->v_cache)",
      "Seqlens": "LT__OR_K(p->cache_seqlens)", "BatchIdx": "LT__OR_K(p->cache_batch_idx)",
      "BlockTable": "LT__OR_K(p->block_table)", "RotaryCos": "LT__OR_K(p->rotary_cos)",
      "RotarySin": "LT__OR_K(p->rotary_sin)", "RotarySeqlens": "LT__OR_K(p->rotary_seqlens)",
      "KDescale": "LT__OR_K(p->k_descale)", "VDescale": "LT__OR_K(p->v_descale)",
      "CuSeqlensKNew": "c->varlen_new ? LT__PTR(p->cu_seqlens_k_new) : LT__PTR(p->k)",  # k's: unread without VARLEN
      "num_seqs": "c->b",
      **{f"stride_{t}d{d}": f"c->descale_strides[{i}][{j}]" for i, t in enumerate("kv") for j, d in enumerate("bh")},
      "use_k_descale": "c->descale[0] != 0", "use_v_descale": "c->descale[1] != 0",
      **{f"stride_{n}{d}": f"p->{t}.strides[{i}]" for n, t in (("k", "k"), ("v", "v"), ("kc", "k_cache"),
                                                               ("vc", "v_cache")) for i, d in enumerate("bsh")},
      "stride_tb": "c->paged ? p->block_table.strides[0] : 0", "heads_k": "c->hk", "seqlen_new": "c->seqlen_new",
      "head_dim": "c->d", "head_dim_v": "c->dv", "seqlen_const": "c->seqlen_const > 0 ? c->seqlen_const : 0",
      "use_seqlens": "c->use_seqlens", "use_batch_idx": "c->use_batch_idx", "page_size": "c->page_size",
      "capacity": "c->capacity", "cache_rows": "c->cache_rows", "rotary_dim": "c->rotary_dim",
      "seqlen_ro": "c->seqlen_ro", "use_rotary_seqlens": "c->rotary_seqlens"}


def c_initializer() -> str:
    """The C launcher's argument initializer of kv_append, in its description's order."""
    return ", ".join(_C[name] for name in INT_PARAMS)


def _extent(t: torch.Tensor) -> int:
    shape, strides = t.shape, t.stride()
    return sum((shape[i] - 1) * strides[i] for i in range(t.dim() - 1)) + shape[-1] - 1


def layout_flags(t: Inputs) -> tuple[bool, bool]:
    """(aligned, index64) over k, v and the caches: 16-byte aligned pointers and outer strides; 2**31 elements."""
    tensors = (t.k, t.v, t.k_cache, t.v_cache)
    bits = 0
    for x in tensors:
        for s in x.stride()[:-1]:  # type: ignore[union-attr]
            bits |= s
        bits |= x.data_ptr()  # type: ignore[union-attr]
    return not bits & 15, max(_extent(x) for x in tensors) >= INT32_MAX  # type: ignore[arg-type]


def memo_key(device_index: int | None, dtype: torch.dtype, call: Call, aligned: bool, index64: bool
             ) -> tuple[Any, ...]:
    """Everything ``variant`` reads."""
    return (FAMILY, device_index, dtype, call.head_dim, call.head_dim_v, call.paged, aligned, index64, call.rotary,
            call.rotary_interleaved, *((call.kv_fp8,) if call.kv_fp8 != "none" else ()),
            *(VARLEN_TAG if call.varlen_new else ()))


VARLEN_TAG = ("varlen_new",)  # the memo key's last item for new keys packed by cu_seqlens_k_new


def plan(device: torch.device, dtype: torch.dtype, call: Call, aligned: bool, index64: bool) -> Any:
    """The loaded kernel, memoised in the runtime's plans; during a capture, an unloaded one raises CaptureError."""
    rt = runtime.get()
    key = memo_key(device.index, dtype, call, aligned, index64)
    found = rt.plans.get(key)
    if found is None:
        def choose(target: Any) -> launch.Choice:
            return ((variant(target, DTYPES[dtype], call.head_dim, call.head_dim_v, call.paged, aligned, index64,
                             call.rotary, call.rotary_interleaved, call.kv_fp8, call.varlen_new), ()),)

        found = launch.plan(rt, key, device, choose, "run flash_attn_with_kvcache once with new keys of this shape "
                            "before the capture")
    return found[0]


def interpreter_constexprs(call: Call) -> dict[str, Any]:
    """The constexprs for Triton's interpreter (a small row tile, so several programs run on test shapes)."""
    padded, padded_v = geometry.padded_head_dim(call.head_dim), geometry.padded_value_dim(call.value_dim)
    return {"BLOCK_M": 4, "BLOCK_D": padded, "EVEN_D": padded == call.head_dim, "BLOCK_DV": padded_v,
            "EVEN_DV": padded_v == call.value_dim, "PAGED": call.paged, "ROTARY": call.rotary,
            "ROTARY_INTERLEAVED": call.rotary_interleaved, "KV_FP8": call.kv_fp8, "VARLEN": call.varlen_new}


def append(t: Inputs, call: Call) -> None:
    """Write k and v into the caches at cache_seqlens (through the block table when paged), in place: one launch.

    Runs only after ``flash_decode.checks`` passed the call (shapes and index values). The call's split kernel,
    launched right after it, is its programmatic dependent (flash_decode's PDL) where a rotary call's, or every call's
    with ``DEPENDENT_SPLIT``. A rotary call launches it with no new key too (programs that write nothing): its split
    kernel reads q and the rotary tables before it waits.
    """
    if (t.k is None or t.v is None or (call.seqlen_new == 0 and not call.rotary) or call.batch == 0
            or call.heads_k == 0):
        return
    device = t.q.device
    if device.type == "cpu":
        from lazytriton import compiler

        constexprs = interpreter_constexprs(call)
        compiler.interpret(KV_APPEND.name, grid(call.seqlen_new, call.heads_k, _grid_batch(call),
                                                constexprs["BLOCK_M"]), ints(t, call, pointers=lambda x: x), constexprs)
        return
    launch_on_device(t, call, launch.raw_stream(device.index))


def launch_on_device(t: Inputs, call: Call, stream: int) -> None:
    """``append``'s GPU branch: the planned kernel launched on ``stream`` (tests drive it with CPU tensors)."""
    aligned, index64 = layout_flags(t)
    kernel = plan(t.q.device, t.q.dtype, call, aligned, index64)
    kernel.launch(grid(call.seqlen_new, call.heads_k, _grid_batch(call), BLOCK_M), stream, ints(t, call), (),
                  launch.scratch_alloc)


def _grid_batch(call: Call) -> int:
    """The grid's batch: 1 for packed new keys (each row finds its sequence in cu_seqlens_k_new), else batch."""
    return 1 if call.varlen_new else call.batch
