"""The Python half of ``lt_attn_kvcache`` (capi/lt_kvcache.c): its planner and its host-memory call.

``embedded.attach`` binds these to the library. The C half has checked every
argument before they run. The planner resolves both decoding kernels through
the binding (``binding.variants``, as a Python call of that shape class
would), and for a call with new keys the append kernel (``kv_append.variant``,
as ``kv_append.binding.plan`` would), loads them on the device and answers
what the C launch needs,
including the split heuristic's inputs (``binding.gpu_slots``,
``binding.min_split_keys``), so the C split count (lt_splits.c) is the
binding's. The host-memory call runs ``binding.forward`` on the caller's
memory (no copy): the value checks of the index tensors, the append of new
keys into the caches, and the kernels through Triton's interpreter.
"""

from __future__ import annotations

import math
from typing import Any

from lazytriton.capi.common import PYTHON, check_entry_layout, host_tensor

KERNELS = ("flash_decode_split", "flash_decode_combine")
APPEND = "kv_append"
LENGTHS = "kv_append_lengths"  # packed new keys: each sequence's length after the append
KV_FP8 = {0: "none", 5: "e4m3", 6: "e5m2"}  # the plan request's kv_fp8 (a float8 cache's lt_dtype) as KV_FP8

_ffi: Any = None


def _optional(view: Any) -> Any:
    """A host tensor of an optional view, or None when absent (data NULL and ndim 0: lt_kvcache.c's lt__absent)."""
    if view.data == _ffi.NULL and view.ndim == 0:
        return None
    return host_tensor(_ffi, view)


def inputs_of(p: Any) -> tuple[Any, Any, Any]:
    """(Inputs over the caller's memory, out, lse) of an lt_attn_kvcache_params on host memory."""
    from lazytriton.kernels.flash_decode import checks

    q, k_cache, v_cache, out, lse = (host_tensor(_ffi, t) for t in (p.q, p.k_cache, p.v_cache, p.out, p.lse))
    k, v, lens, rows, table, slopes, pads, cos, sin, bases, sinks, cu_q = (
        _optional(t) for t in (p.k, p.v, p.cache_seqlens, p.cache_batch_idx, p.block_table, p.alibi_slopes,
                               p.cache_leftpad, p.rotary_cos, p.rotary_sin, p.rotary_seqlens, p.sinks,
                               p.cu_seqlens_q))
    if lens is None and p.cache_seqlen >= 0:
        lens = int(p.cache_seqlen)
    # k_descale, v_descale: version 6 fields; qv, cu_seqlens_k_new: version 7 (lt__kv_prepare leaves an older
    # struct's absent)
    return checks.Inputs(q, k_cache, v_cache, k, v, lens, rows, table, slopes, pads, cos, sin, bases, sinks,
                         cu_q, _optional(p.k_descale), _optional(p.v_descale), _optional(p.qv),
                         _optional(p.cu_seqlens_k_new)), out, lse


def call_of(p: Any, t: Any) -> Any:
    """The binding's checked Call of the params (the checks run again, in Python).

    max_seqlen_q -1 is absent (lt__kv_prepare gives an older struct -1); attention_chunk 0 is off (an older
    struct's).
    """
    from lazytriton.kernels.flash_decode import checks

    scale = None if math.isnan(p.sm_scale) else float(p.sm_scale)
    max_seqlen_q = None if p.max_seqlen_q == -1 else int(p.max_seqlen_q)
    return checks.check(t, scale, bool(p.causal), (int(p.window_left), int(p.window_right)), float(p.softcap),
                        int(p.num_splits), bool(p.rotary_interleaved), max_seqlen_q, int(p.attention_chunk))


def attn_kvcache_cpu(p: Any) -> int:
    """lt_attn_kvcache on host memory: ``binding.forward`` (value checks, append, interpreter), out and lse copied."""
    import torch

    from lazytriton.kernels.flash_decode import binding

    t, out, lse = inputs_of(p)
    with torch.no_grad():
        result, logsumexp = binding.forward(t, call_of(p, t))
    out.copy_(result)
    lse.copy_(logsumexp)
    return 0


def plan_variants(capability: int, dtype_code: int, head_dim: int, causal: bool, aligned: bool, index64: bool,
                  rows: int, capacity: int, page_size: int, window: bool, softcap: bool, alibi: bool,
                  head_dim_v: int = 0, leftpad: bool = False, rotary: bool = False,
                  rotary_interleaved: bool = False, sinks: bool = False, varlen_q: bool = False,
                  chunk: bool = False, kv_fp8: str = "none", qv: bool = False, kv_pairs: int = 0) -> Any:
    """The (split, combine) variants a C plan launches (pure): ``binding.variants``, as for a Python call.

    ``sinks``: SINKS on both kernels; ``varlen_q``: queries packed by cu_seqlens_q (VARLEN_Q on the split kernel);
    ``chunk``: attention_chunk (CHUNK on the split kernel); ``kv_fp8``: a float8 cache's format (KV_FP8 on the
    split kernel; a ValueError for e4m3 on a target below sm_89); ``qv``: MLA's qv (QV on the split kernel,
    ``head_dim`` q's own); ``kv_pairs``: the call's (sequence, key/value head) pairs, which a float8 cache's split
    tiles follow.
    """
    import torch

    from lazytriton.kernels.flash_decode import binding, checks
    from lazytriton.target import Target

    dtype = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}[dtype_code]
    # Dispatch reads rows (heads_q // heads_k x seqlen_q) and the cache's capacity, and a float8 cache's tiles the
    # (sequence, key/value head) pairs (batch x heads_k): here batch, with one head.
    call = checks.Call(max(1, kv_pairs), rows, 1, 1, head_dim, 0, capacity, page_size, 1, capacity, causal, 1.0,
                       window_left=0 if window else -1, softcap=1.0 if softcap else 0.0, alibi=alibi,
                       head_dim_v=0 if head_dim_v == head_dim else head_dim_v, leftpad=leftpad,
                       rotary_dim=2 if rotary else 0, rotary_interleaved=rotary and rotary_interleaved, sinks=sinks,
                       varlen_q=varlen_q, attention_chunk=1 if chunk else 0, kv_fp8=kv_fp8, qv=qv)
    return binding.variants(Target("cuda", str(capability), 32), dtype, call, aligned, index64)


def check_launch_layout(entry: Any, kernel: str) -> None:
    """Refuse an entry whose parameters lt_kvcache.c would not pass correctly (its binding's ints, then floats)."""
    from lazytriton.kernels import kv_append
    from lazytriton.kernels.flash_decode import binding
    from lazytriton.kernels.kv_append import lengths

    ints = {KERNELS[0]: binding.SPLIT_INT_PARAMS, KERNELS[1]: binding.COMBINE_INT_PARAMS,
            APPEND: kv_append.INT_PARAMS, LENGTHS: lengths.INT_PARAMS}[kernel]
    check_entry_layout(entry, len(ints), ("fp32", "fp32") if kernel == KERNELS[0] else ())


def plan(req: Any) -> int:
    """Resolve and load both kernels for the request's shape class; answer what lt_kvcache.c launches with."""
    import torch

    from lazytriton import runtime
    from lazytriton.kernels.flash_decode import binding

    props = torch.cuda.get_device_properties(req.device_index)
    capability = props.major * 10 + props.minor
    split, combine = plan_variants(capability, req.dtype, req.head_dim, bool(req.causal), bool(req.aligned),
                                   bool(req.index64), req.rows, req.capacity, req.page_size, bool(req.window),
                                   bool(req.softcap), bool(req.alibi), req.head_dim_v, bool(req.leftpad),
                                   bool(req.rotary), bool(req.rotary_interleaved), bool(req.sinks),
                                   bool(req.varlen_q), bool(req.chunk), KV_FP8[req.kv_fp8], bool(req.qv),
                                   req.kv_pairs)
    rt = runtime.get()
    if req.append:
        _plan_append(req, rt, capability)
    if req.varlen_new:
        _plan_lengths(req, rt, capability)
    loaded = []
    for variant in (split, combine):
        kernel = rt.kernel(variant, req.device_index)
        check_launch_layout(kernel.entry, variant.kernel)
        loaded.append(kernel)
    s, c = loaded
    req.split_function, req.combine_function = (int(_ffi.cast("uintptr_t", k.function)) for k in loaded)
    req.split_threads, req.split_shared = s.block, s.shared
    req.split_block_m, req.split_block_n = int(split.get("BLOCK_M")), int(split.get("BLOCK_N"))
    req.split_hidden = len(s.entry.hidden_args)
    req.combine_threads, req.combine_shared = c.block, c.shared
    req.combine_block_m, req.combine_hidden = int(combine.get("BLOCK_M")), len(c.entry.hidden_args)
    req.combine_dependent = int(c.dependent)  # launched as the split kernel's programmatic dependent
    req.split_dependent = int(s.dependent)  # a rotary call's: launched as kv_append's programmatic dependent
    req.slots, req.min_keys = binding.gpu_slots(req.device_index, s.shared), binding.min_split_keys(req.head_dim)
    text = str(split).encode()[:511]
    _ffi.memmove(req.variant, text, len(text))
    return 0


def append_variant(capability: int, dtype_code: int, head_dim: int, head_dim_v: int, paged: bool, aligned: bool,
                   index64: bool, rotary: bool = False, rotary_interleaved: bool = False, kv_fp8: str = "none",
                   varlen: bool = False) -> Any:
    """The kv_append variant a C plan with new keys launches first (pure): ``kv_append.variant``, as in Python.

    ``varlen``: new keys packed by cu_seqlens_k_new (VARLEN=true).
    """
    from lazytriton.kernels import kv_append
    from lazytriton.target import Target

    dtype = {1: "fp16", 2: "bf16", 3: "fp32"}[dtype_code]
    return kv_append.variant(Target("cuda", str(capability), 32), dtype, head_dim,
                             0 if head_dim_v == head_dim else head_dim_v, paged, aligned, index64, rotary,
                             rotary_interleaved, kv_fp8, varlen)


def _plan_append(req: Any, rt: Any, capability: int) -> None:
    """Load kv_append for the request and answer its launch fields."""
    chosen = append_variant(capability, req.dtype, req.head_dim, req.head_dim_v, bool(req.paged),
                            bool(req.append_aligned), bool(req.append_index64), bool(req.rotary),
                            bool(req.rotary_interleaved), KV_FP8[req.kv_fp8], bool(req.varlen_new))
    kernel = rt.kernel(chosen, req.device_index)
    check_launch_layout(kernel.entry, APPEND)
    req.append_function = int(_ffi.cast("uintptr_t", kernel.function))
    req.append_threads, req.append_shared = kernel.block, kernel.shared
    req.append_block_m, req.append_hidden = int(chosen.get("BLOCK_M")), len(kernel.entry.hidden_args)


def _plan_lengths(req: Any, rt: Any, capability: int) -> None:
    """Load kv_append_lengths (packed new keys: the lengths after the append) and answer its launch fields."""
    from lazytriton.kernels.kv_append import lengths
    from lazytriton.target import Target

    chosen = lengths.variant(Target("cuda", str(capability), 32))
    kernel = rt.kernel(chosen, req.device_index)
    check_launch_layout(kernel.entry, LENGTHS)
    req.lengths_function = int(_ffi.cast("uintptr_t", kernel.function))
    req.lengths_threads, req.lengths_shared = kernel.block, kernel.shared
    req.lengths_block, req.lengths_hidden = int(chosen.get("BLOCK")), len(kernel.entry.hidden_args)


def attach(ffi: Any, guarded: Any) -> None:
    """Bind ``lt__py_kvcache_plan`` and ``lt__py_attn_kvcache_cpu`` (``guarded`` maps exceptions to statuses)."""
    global _ffi
    _ffi = ffi
    for name, fn in (("lt__py_kvcache_plan", plan), ("lt__py_attn_kvcache_cpu", attn_kvcache_cpu)):
        ffi.def_extern(name=name, error=PYTHON)(guarded(fn))
