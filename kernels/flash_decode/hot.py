"""flash_decode's warm path: a warm ``flash_attn_with_kvcache`` call served from an entry made for its shape.

``checks.check`` and the binding's packing read a call's tensors' sizes, strides, dtypes and devices, its flags
and python types, and (for the caches and ``out``) where their bytes lie. The warm path keys an entry on exactly
the first of these: q, k_cache, v_cache, k, v, cache_seqlens (a tensor, an int, or None), block_table, out and
key_mask (each None or its sizes, strides, dtype and device), causal, softmax_scale and num_splits. ``describe``
makes the entry on the first call of a key with ``checks.check``, ``checks.check_out``, ``binding.split_ints``,
``kv_append.binding.ints`` and the two ``layout_flags`` themselves (on meta stand-ins of the tensors where it
needs their strides only), so the checks and the packing stay in one place. A call then does, per call, what no
key can hold:

- cache_seqlens as an int: its range (0 .. capacity - seqlen_new) and its slot in both kernels' arguments;
- the bytes: the caches must not overlap (a call whose caches share memory, such as MLA's latent cache, is the
  general path's), nor ``out`` q, k, v, the caches or key_mask (``check_out``'s rule, over the byte spans the
  entry keeps);
- the index tensors' values, outside ``trusted_indices()`` and a CUDA graph capture: ``values.check_values``,
  as the general path does on every eager call (one host synchronisation on a GPU);
- the pointers' 16-byte alignment, which picks the aligned or unaligned plans (as ``layout_flags`` decides).

Then it allocates out (unless given) and lse, and one float32 workspace for the split partials (and lse too when
the caller drops it), and launches kv_append (with new keys), the split kernel and, with several splits, the
combine kernel, each from its entry's constant arguments and the call's pointers. Where
``dispatch.FUSED_COMBINE_BY_DEFAULT`` is on (read on every call: part of the table's key) the split kernel merges
its own partials (FUSED_COMBINE): one launch, with the counters of the call's stream (``counters.py``; a captured
call's own).

Where the C++ tail is built for the running torch and the launch helper is there (``cpp_tail``: hotpath.py loads
``_hotpath.cpp``'s module), that per-call work, in the same order, is its ``run()``: an entry then carries a record
(``cpp_record.py``: the header made by describe, each launch's item made with the Python run's prepared launch),
the index values' eager check stays ``Entry.check_values``, which run() calls. An entry whose launches the record
cannot hold (the fused combine's counters, a kernel without the launch helper's plan) has none and takes the
Python run, as does every call run() declines (the int length's range, memory that overlaps, an item not made yet).
The lookup is then the module's too (``make``'s ``front``): its ``serve()`` reads the same key from the TensorImpls
and finds the record in a table its ``remember()`` fills each time the Python lookup reaches run() with one (with
the runtime's plans and the eager check); it declines whatever the Python lookup declines, and a call it declines
takes the Python lookup.

Served: a contiguous or paged cache, cache_seqlens as an int, an int32 tensor or None, new k and v (batch,
seqlen_new, heads_k, head_dim) or none, GQA/MQA, causal or not, ``out`` (last dim contiguous) or not,
return_softmax_lse, a forced num_splits, lazytriton's key_mask (``key_mask.py``: ``kvcache.with_key_mask``
passes it; its values need no check). Everything else returns None and the caller takes the general path
(``kvcache.serve``), which raises the errors, naming the caller's argument, and memoises the plans: a call the
checks refuse (no entry is made for it), a first call (no plan memoised yet), CPU or meta tensors, a tensor
subclass, an argument of an unusual type (``causal`` 1, an int scale, a bool num_splits: equal as dict keys to
valid ones, so never looked up), a strided index tensor (the general path copies it), caches sharing memory,
``out`` with a strided last dim, empty outputs or no new keys in a k of seqlen 0, and the rare features:
cache_batch_idx, alibi_slopes, cache_leftpad, rotary, sinks, packed queries (cu_seqlens_q) or new keys
(cu_seqlens_k_new), a window, softcap, attention_chunk, float8 caches and their descales, and qv (the public
function sends those to the general path before any lookup). An entry remembers the runtime's plans it was
made against: a rebuilt runtime makes it again. At most ``MAX_SHAPES`` entries are kept; past it the table
starts again.

``serve`` is the warm path ``kvcache.flash_attn_with_kvcache`` uses (GPU tensors); tests and
benchmarks/profile_kvcache.py make one for CPU tensors (``make(cuda=False)``) with their own runtime and stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lazytriton import launch, runtime
from lazytriton.kernels.flash_decode import (
    FLASH_DECODE_COMBINE,
    FLASH_DECODE_SPLIT,
    binding,
    checks,
    combine_grid,
    counters,
    cpp_record,
    hotpath_record,
    split_grid,
    values,
)
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.kv_append import BLOCK_M as APPEND_BLOCK_M
from lazytriton.kernels.kv_append import INT_PARAMS as APPEND_INT_PARAMS
from lazytriton.kernels.kv_append import KV_APPEND
from lazytriton.kernels.kv_append import binding as append_binding
from lazytriton.kernels.kv_append import grid as append_grid
from lazytriton.kernels.trust import indices_trusted

# Each kernel's pointers, in its description's order: the per-call tuple writes them before the entry's ints.
SPLIT_POINTERS = ("Q", "K", "V", "Out", "Lse", "OutPart", "LsePart", "Seqlens", "BatchIdx", "BlockTable", "Alibi",
                  "LeftPad", "RotaryCos", "RotarySin", "RotarySeqlens", "Sinks", "CuSeqlensQ", "KDescale",
                  "VDescale", "KeyMask", "Counters")
COMBINE_POINTERS = ("OutPart", "LsePart", "Out", "Lse", "Sinks")
APPEND_POINTERS = ("K", "V", "KCache", "VCache", "Seqlens", "BatchIdx", "BlockTable", "RotaryCos", "RotarySin",
                   "RotarySeqlens", "KDescale", "VDescale", "CuSeqlensKNew")
for _spec, _ints, _pointers in ((FLASH_DECODE_SPLIT, binding.SPLIT_INT_PARAMS, SPLIT_POINTERS),
                                (FLASH_DECODE_COMBINE, binding.COMBINE_INT_PARAMS, COMBINE_POINTERS),
                                (KV_APPEND, APPEND_INT_PARAMS, APPEND_POINTERS)):
    if _ints[:len(_pointers)] != _pointers or any(kind.startswith("*") for name, kind in _spec.params
                                                   if name not in _pointers):
        raise RuntimeError(f"flash_decode/hot.py: {_spec.name}'s pointers are no longer {_pointers}")
# Where the int cache_seqlens goes in each kernel's constant ints (the ints after its pointers), and the split count.
SPLIT_LENGTH = binding.SPLIT_INT_PARAMS.index("seqlen_const") - len(SPLIT_POINTERS)
SPLIT_COUNT = binding.SPLIT_INT_PARAMS.index("num_splits") - len(SPLIT_POINTERS)
APPEND_LENGTH = APPEND_INT_PARAMS.index("seqlen_const") - len(APPEND_POINTERS)
MAX_SHAPES = 4096  # distinct entries remembered; past it the table starts again
WORK_ALIGN = 64  # floats: each part of the float32 workspace (partial outputs, partial lse, lse) starts 256 bytes apart
_F32 = torch.float32
# The current stream's raw handle: the C function itself where torch has it (~0.3 µs on the H200), as hot.py's.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or launch.raw_stream
_Tensor = torch.Tensor


def _zero(x: Any) -> int:
    return 0


def _meta(x: Any) -> Any:
    """A stand-in with ``x``'s sizes, strides and dtype on meta (no memory), or ``x`` itself if not a tensor."""
    if not isinstance(x, _Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def _span(x: torch.Tensor | None) -> int:
    """The bytes from a tensor's first element to past its last (0: empty or None: it overlaps nothing)."""
    if x is None or x.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True)) + 1) * x.element_size()


def _round_up(n: int) -> int:
    return -(-n // WORK_ALIGN) * WORK_ALIGN


class Entry:
    """What a described shape's calls share: the checked call, allocation shapes, spans, constant ints, plans."""

    __slots__ = ("plans", "device", "device_index", "call", "out_size", "lse_size", "lse_numel", "value_checks",
                 "lens_int", "lens_max", "q_span", "kc_span", "vc_span", "k_span", "v_span", "out_span", "mask_span",
                 "split_strides_aligned", "append_strides_aligned", "split_keys", "append_keys", "split_tail",
                 "append_tail", "out_meta", "lse_meta", "split_ready", "append_ready", "present", "cpp")

    plans: dict[Any, Any]
    device: torch.device
    device_index: int
    call: checks.Call
    out_size: tuple[int, ...] | None  # None: the caller's out
    lse_size: tuple[int, ...]
    lse_numel: int
    value_checks: bool  # index tensors whose values an eager call checks (cache_seqlens, block_table)
    lens_int: bool
    lens_max: int
    q_span: int
    kc_span: int
    vc_span: int
    k_span: int
    v_span: int
    out_span: int
    mask_span: int  # key_mask's bytes (0: none)
    split_strides_aligned: bool
    append_strides_aligned: bool
    split_keys: tuple[Any, Any]  # binding.memo_key's, (unaligned, aligned)
    append_keys: tuple[Any, Any]  # kv_append.binding.memo_key's, (unaligned, aligned); None without new keys
    split_tail: tuple[int, ...]  # the split kernel's ints after its pointers, num_splits 0 (the plan decides it)
    append_tail: tuple[int, ...]
    out_meta: torch.Tensor
    lse_meta: torch.Tensor
    split_ready: list[Any]  # (unaligned, aligned): the prepared launches once their plans are memoised
    append_ready: list[Any]
    present: frozenset[str]  # the optional tensors the call has (cpp_record.OPTIONAL: lens a tensor, table, mask)
    cpp: list[Any] | None  # the C++ tail's record (cpp_record); None: the Python run serves the entry

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    def split_launch(self, aligned: int) -> tuple[Any, ...] | None:
        """The split (and combine) launches for aligned or unaligned pointers, kept once their plan is found.

        (split kernel, its grid, floats, its ints after the pointers (without the int length where the call
        has one: then the parts before and after it), splits, the workspace's floats before lse, where the
        partial lse starts, combine kernel, its grid, its ints after the pointers (the three None where the split
        kernel merges its own partials), the counters the fused combine takes (0: none)).
        """
        plan = self.plans.get(self.split_keys[aligned])
        if plan is None:
            return None
        split_kernel, block_m, block_n, combine_kernel, combine_m = plan
        fused = combine_m == binding.FUSED
        call = self.call
        splits = binding.splits_for(call, block_m, block_n,
                                    binding.gpu_slots(self.device.index, getattr(split_kernel, "shared", 0)),
                                    binding.min_split_keys(call.head_dim))
        tail = list(self.split_tail)
        tail[SPLIT_COUNT] = splits
        head, rest = (tail[:SPLIT_LENGTH], tail[SPLIT_LENGTH + 1:]) if self.lens_int else (tail, [])
        partial_out = call.lse_rows * splits * call.value_dim if splits > 1 else 0
        partial_lse = _round_up(partial_out)
        work = _round_up(partial_lse + call.lse_rows * splits) if splits > 1 else 0
        grid = split_grid(call.rows, block_m, splits, call.heads_k, call.batch, call.packed_rows)
        tickets = counters.count(grid[2], grid[1], grid[0] // splits) if fused and splits > 1 else 0
        combine: tuple[Any, Any, Any] = (None, None, None)
        if not fused:
            combine = (combine_kernel, combine_grid(call.lse_rows, combine_m),
                       binding.combine_ints(self.lse_meta, self.lse_meta, self.out_meta, self.lse_meta, call, splits,
                                            pointers=_zero)[len(COMBINE_POINTERS):])
        found = (split_kernel, grid, binding.floats(call), tuple(head), tuple(rest), splits, work, partial_lse * 4,
                 *combine, tickets)
        self.split_ready[aligned] = found
        if self.cpp is not None:
            item = cpp_record.split_item(found, (SPLIT_POINTERS, COMBINE_POINTERS), self.lens_int, self.present)
            self.cpp[cpp_record.SPLIT_AT[aligned]] = item
            if item is None:
                cpp_record.drop(self.cpp)
                self.cpp = None
        return found

    def append_launch(self, aligned: int) -> tuple[Any, ...] | None:
        """(kv_append kernel, its grid, its ints after the pointers: before and after the int length), once planned."""
        plan = self.plans.get(self.append_keys[aligned])
        if plan is None:
            return None
        tail = self.append_tail
        head, rest = (tail[:APPEND_LENGTH], tail[APPEND_LENGTH + 1:]) if self.lens_int else (tail, ())
        call = self.call
        found = (plan[0], append_grid(call.seqlen_new, call.heads_k, call.batch, APPEND_BLOCK_M), head, rest)
        self.append_ready[aligned] = found
        if self.cpp is not None:
            item = cpp_record.append_item(found, APPEND_POINTERS, self.lens_int, self.present)
            self.cpp[cpp_record.APPEND_AT[aligned]] = item
            if item is None:
                cpp_record.drop(self.cpp)
                self.cpp = None
        return found

    def check_values(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Any, v: Any, lens: Any,
                     block_table: Any) -> None:
        """The general path's eager check of the index values, its errors (an int length: this call's)."""
        t = checks.Inputs(q, k_cache, v_cache, k, v, lens, None, block_table)
        if values.values_checked(t):
            values.check_values(t, self.call._replace(seqlen_const=lens) if self.lens_int else self.call)


def describe(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Any, v: Any, lens: Any,
             block_table: Any, softmax_scale: Any, causal: bool, num_splits: int, out: Any,
             plans: dict[Any, Any], key_mask: Any = None, fused: bool = False, cpp: bool = False) -> Entry | None:
    """The entry of a call the warm path may serve (``checks.check``, ``checks.check_out``); None: the general path's.

    ``out``: the caller's, or None (the entry then allocates one, as ``binding.empty_outputs`` does). ``fused``: the
    split kernel merges its own partials (its plans' memo keys say so). ``cpp``: make the C++ tail's record too.
    """
    if any(type(x) is _Tensor and not x.is_contiguous() for x in (lens, block_table)):
        return None  # the general path reads a contiguous copy (index_tensor)
    t = checks.Inputs(q, k_cache, v_cache, k, v, lens, None, block_table, key_mask=key_mask)
    try:
        call = checks.check(t, softmax_scale, causal, checks.NO_WINDOW, 0.0, num_splits)
        checks.check_out(out, t, call)
    except (TypeError, ValueError):
        return None  # the general path raises it again, naming the caller's argument
    if (call.qv or call.kv_fp8 != "none" or call.rows == 0 or call.batch == 0 or q.device.type == "meta"
            or (k is not None and call.seqlen_new == 0) or (out is not None and not binding.writes_into(out))):
        return None
    # Stand-ins with the tensors' sizes and strides: the packing and the layout flags read no memory (describe may
    # run during a CUDA graph capture); their pointers are 0, so the flags' alignment is the strides' alone.
    mq, mk_cache, mv_cache, mk, mv, mlens, mtable = map(_meta, (q, k_cache, v_cache, k, v, lens, block_table))
    tm = checks.Inputs(mq, mk_cache, mv_cache, mk, mv, mlens, None, mtable, key_mask=_meta(key_mask))
    out_meta = _meta(out) if out is not None else binding.empty_outputs(tm.q, call)[0]
    lse_meta = binding.empty_lse(tm.q, call)
    split_aligned, split_index64 = binding.layout_flags(tm, out_meta)
    device = q.device
    append_keys, append_tail, append_aligned = None, (), False
    if k is not None:
        append_aligned, append_index64 = append_binding.layout_flags(tm)
        append_keys = tuple(append_binding.memo_key(device.index, q.dtype, call, aligned, append_index64)
                            for aligned in (False, True))
        append_tail = append_binding.ints(tm, call, pointers=_zero)[len(APPEND_POINTERS):]
    spans = {"q": _span(q), "k_cache": _span(k_cache), "v_cache": _span(v_cache), "k": _span(k), "v": _span(v),
             "out": _span(out), "key_mask": _span(key_mask)}
    out_size = None if out is not None else tuple(out_meta.shape)
    lens_int, lens_max = type(lens) is int, call.capacity - call.seqlen_new
    present = frozenset(name for name, x in (("lens", lens), ("table", block_table), ("key_mask", key_mask))
                        if type(x) is _Tensor)
    return Entry(
        plans=plans, device=device, device_index=q.get_device(), call=call, out_size=out_size,
        lse_size=tuple(lse_meta.shape), lse_numel=lse_meta.numel(),
        value_checks=type(lens) is _Tensor or block_table is not None, lens_int=lens_int, lens_max=lens_max,
        q_span=spans["q"], kc_span=spans["k_cache"], vc_span=spans["v_cache"], k_span=spans["k"], v_span=spans["v"],
        out_span=spans["out"], mask_span=spans["key_mask"],
        split_strides_aligned=split_aligned, append_strides_aligned=append_aligned,
        split_keys=tuple(binding.memo_key(device.index, q.dtype, call, aligned, split_index64, fused)
                         for aligned in (False, True)),
        append_keys=append_keys, append_tail=append_tail,
        split_tail=binding.split_ints(tm, out_meta, lse_meta, lse_meta, lse_meta, call, 0,
                                      pointers=_zero)[len(SPLIT_POINTERS):],
        out_meta=out_meta, lse_meta=lse_meta, split_ready=[None, None], append_ready=[None, None], present=present,
        cpp=cpp_record.header(out_size, tuple(lse_meta.shape), lse_meta.numel(), lens_max, spans, lens_int,
                              split_aligned, append_aligned) if cpp and not fused else None)


def _launch(kernel: Any, grid: tuple[int, int, int], stream: int, ints: tuple[Any, ...], floats: tuple[Any, ...],
            scratch_alloc: Any = launch.scratch_alloc) -> None:
    fast = kernel.fast
    if fast is None:
        kernel.launch(grid, stream, ints, floats, scratch_alloc)
    else:
        status = fast(grid[0], grid[1], grid[2], stream, ints, floats)
        if status:
            kernel.fail(status, grid)


def _device_of(x: torch.Tensor) -> torch.device:
    return x.device


def _overlaps(a: int, a_span: int, b: int, b_span: int) -> bool:
    return bool(a_span and b_span and a < b + b_span and b < a + a_span)


CPP_INTERFACE = hotpath_record.INTERFACE  # the calling convention of the C++ module's run(), serve(), remember()


def cpp_tail() -> Any:
    """The C++ tail's module where it and the launch helper are built for this torch and record; else False.

    hotpath.py logs why there is none.
    """
    from lazytriton.driver import fastlaunch
    from lazytriton.kernels.flash_decode import hotpath

    module = hotpath.module() if fastlaunch.available() else None
    return module if module is not None and getattr(module, "INTERFACE", None) == CPP_INTERFACE else False


def make(cuda: bool = True, get_runtime: Callable[[], Any] = runtime.get,
         raw_stream: Callable[[int], int] = _RAW_STREAM,
         tickets: counters.Counters = counters.COUNTERS, cpp: Any = None, front: bool = True) -> Callable[..., Any]:
    """The warm path: ``flash_attn_with_kvcache``'s result for a call it serves, or None.

    ``serve(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
    rotary_interleaved, return_softmax_lse, out, key_mask=None)``, the public function's arguments of those names
    (``key_mask``: lazytriton's own, ``kvcache.with_key_mask``'s).
    The caller has sent every call with a rare feature to the general path and checked return_softmax_lse.
    ``cuda=False``: CPU tensors too (tests, profile_kvcache's fake driver), their devices in the key by
    ``Tensor.device`` (a CPU and a meta tensor share ``get_device()``'s -1). ``tickets``: where the fused combine's
    counters come from. ``cpp``: the C++ tail's module (kernels/flash_decode/_hotpath.cpp: an entry's launches from its
    record, ``cpp_record``), False for none, None for ``cpp_tail()``'s, looked up when the first entry is made; an
    entry it cannot serve (the fused combine, a kernel without the launch helper's plan) takes the Python run.
    ``front``: the lookup in C++ too where the module has it (``serve()``, ``remember()``); False: in Python
    (profile_kvcache times both).
    """
    shapes: dict[tuple[Any, ...], Entry] = {}
    tail: list[Any] = [None]  # the module, False, or None until the first description looks it up
    table: dict[int, tuple[Any, ...]] = {}  # the C++ front's entries: hash -> (key bytes, plans, record, check)
    fronts: list[Any] = [None, None, None]  # its serve(), remember() and stream argument; None: no C++ front
    empty = torch.empty
    where = _Tensor.get_device if cuda else _device_of

    def use(module: Any) -> None:
        """Take the C++ module (False: none), and its front where it has one."""
        tail[0] = module
        if module is not False and front and getattr(module, "serve", None) is not None:
            # None: it reads the current stream itself; else the function giving a device's raw stream.
            stream = None if cuda and raw_stream is _RAW_STREAM and module.STREAM_INSIDE else raw_stream
            fronts[:] = [module.serve, module.remember, stream]

    if cpp is not None:
        use(cpp)

    def serve(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any,
              softmax_scale: Any, causal: Any, num_splits: Any, rotary_interleaved: Any, return_lse: bool,
              out: Any, key_mask: Any = None) -> Any:
        cpp_serve = fronts[0]
        if cpp_serve is not None:  # the lookup and the run in C++; None: declined, the same in Python below
            done = cpp_serve(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                             rotary_interleaved, return_lse, out, key_mask, table, get_runtime().plans,
                             decode_dispatch.FUSED_COMBINE_BY_DEFAULT, cuda, fronts[2], indices_trusted)
            if done is not None:
                return done
        if type(q) is not _Tensor or not (q.is_cuda if cuda else q.is_cpu) or type(k_cache) is not _Tensor \
                or type(v_cache) is not _Tensor:
            return None
        if not (causal is True or causal is False) or not (softmax_scale is None or type(softmax_scale) is float) \
                or type(num_splits) is not int or not (rotary_interleaved is True or rotary_interleaved is False):
            return None
        lens = cache_seqlens
        if type(lens) is _Tensor:
            lens_key: Any = (lens.shape, lens.stride(), lens.dtype, where(lens))
        elif lens is None or type(lens) is int:
            lens_key = None if lens is None else int
        else:
            return None
        if k is None:
            new_key: Any = None if v is None else False
        elif type(k) is _Tensor and type(v) is _Tensor:
            new_key = (k.shape, k.stride(), k.dtype, where(k), v.shape, v.stride(), v.dtype, where(v))
        else:
            return None
        if block_table is None:
            table_key: Any = None
        elif type(block_table) is _Tensor:
            table_key = (block_table.shape, block_table.stride(), block_table.dtype, where(block_table))
        else:
            return None
        if out is None:
            out_key: Any = None
        elif type(out) is _Tensor:
            out_key = (out.shape, out.stride(), out.dtype, where(out))
        else:
            return None
        fused = decode_dispatch.FUSED_COMBINE_BY_DEFAULT  # read on every call (dispatch's switch)
        key: tuple[Any, ...] = (q.shape, q.stride(), q.dtype, where(q), k_cache.shape, k_cache.stride(), k_cache.dtype,
               where(k_cache), v_cache.shape, v_cache.stride(), v_cache.dtype, where(v_cache), new_key, lens_key,
               table_key, out_key, causal, softmax_scale, num_splits, fused)
        if key_mask is not None:
            if type(key_mask) is not _Tensor:
                return None
            key += (key_mask.shape, key_mask.stride(), key_mask.dtype, where(key_mask))
        plans = get_runtime().plans
        entry = shapes.get(key)
        if entry is None or entry.plans is not plans:
            if new_key is False:
                return None
            if tail[0] is None:
                use(cpp_tail())
            entry = describe(q, k_cache, v_cache, k, v, lens, block_table, softmax_scale, causal, num_splits, out,
                             plans, key_mask, fused, tail[0] is not False)
            if entry is None:
                return None
            if len(shapes) >= MAX_SHAPES:
                shapes.clear()
            shapes[key] = entry
        if entry.cpp is not None and fronts[1] is not None:  # filed for the C++ front's next call of this key
            fronts[1](q, k_cache, v_cache, k, v, lens, block_table, softmax_scale, causal, num_splits,
                      rotary_interleaved, return_lse, out, key_mask, table, plans, fused, entry.cpp,
                      entry.check_values if entry.value_checks else None, MAX_SHAPES)
        return run(entry, q, k_cache, v_cache, k, v, lens, block_table, return_lse, out, key_mask)

    def run(entry: Entry, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Any, v: Any, lens: Any,
            block_table: Any, return_lse: bool, out: Any, key_mask: Any) -> Any:
        """The call of a described shape: what no key holds checked, then the outputs and the launches."""
        record = entry.cpp
        if record is not None:  # the same in C++ (None: declined, or an item not made yet: on in Python)
            module = tail[0]
            done = module.run(record, q, k_cache, v_cache, k, v, lens, block_table, out, key_mask, return_lse,
                              None if cuda and raw_stream is _RAW_STREAM and module.STREAM_INSIDE
                              else raw_stream(entry.device_index),
                              entry.check_values if entry.value_checks and not indices_trusted() else None)
            if done is not None:
                return done
        if entry.lens_int and not 0 <= lens <= entry.lens_max:
            return None  # the general path raises the range's error
        q_ptr, kc_ptr, vc_ptr = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        kc_span, vc_span = entry.kc_span, entry.vc_span
        if kc_ptr < vc_ptr + vc_span and vc_ptr < kc_ptr + kc_span and kc_span and vc_span:
            return None  # caches sharing memory: the general path's rules (MLA's latent cache, or an error)
        device = entry.device
        if out is None:
            out = empty(entry.out_size, dtype=q.dtype, device=device)  # type: ignore[arg-type]
            out_ptr = out.data_ptr()
        else:
            out_ptr, out_span = out.data_ptr(), entry.out_span
            if (_overlaps(out_ptr, out_span, q_ptr, entry.q_span) or _overlaps(out_ptr, out_span, kc_ptr, kc_span)
                    or _overlaps(out_ptr, out_span, vc_ptr, vc_span)
                    or (k is not None and (_overlaps(out_ptr, out_span, k.data_ptr(), entry.k_span)
                                           or _overlaps(out_ptr, out_span, v.data_ptr(), entry.v_span)))
                    or (key_mask is not None and _overlaps(out_ptr, out_span, key_mask.data_ptr(), entry.mask_span))):
                return None  # check_out's error, from the general path
        aligned = 1 if entry.split_strides_aligned and not (q_ptr | kc_ptr | vc_ptr | out_ptr) & 15 else 0
        split = entry.split_ready[aligned] or entry.split_launch(aligned)
        if split is None:
            return None  # no plan memoised for this key yet: the general path plans it
        append: Any = None
        if k is not None:
            k_ptr, v_ptr = k.data_ptr(), v.data_ptr()
            new_aligned = 1 if entry.append_strides_aligned and not (k_ptr | v_ptr | kc_ptr | vc_ptr) & 15 else 0
            append = entry.append_ready[new_aligned] or entry.append_launch(new_aligned)
            if append is None:
                return None
        if entry.value_checks and not indices_trusted():
            entry.check_values(q, k_cache, v_cache, k, v, lens, block_table)
        (split_kernel, grid, floats, head, rest, splits, work_floats, partial_lse, combine_kernel, combine_at,
         combine_tail, count) = split
        # The workspace stays referenced in this frame until after the launches.
        if return_lse:
            lse = empty(entry.lse_size, dtype=_F32, device=device)
            lse_ptr = lse.data_ptr()
            work = empty(work_floats, dtype=_F32, device=device) if splits > 1 else lse
            work_ptr = work.data_ptr()
        else:  # lse at the workspace's end: one allocation
            work = empty(work_floats + entry.lse_numel, dtype=_F32, device=device)
            work_ptr = work.data_ptr()
            lse_ptr = work_ptr + 4 * work_floats
        lens_ptr = lens.data_ptr() if type(lens) is _Tensor else None
        table_ptr = block_table.data_ptr() if block_table is not None else None
        stream = raw_stream(entry.device_index)
        if k is not None:
            kernel, append_at, append_head, append_rest = append
            ints = ((k_ptr, v_ptr, kc_ptr, vc_ptr, k_ptr if lens_ptr is None else lens_ptr, k_ptr,
                     k_ptr if table_ptr is None else table_ptr, k_ptr, k_ptr, k_ptr, k_ptr, k_ptr, k_ptr)
                    + append_head + ((lens,) + append_rest if entry.lens_int else ()))
            _launch(kernel, append_at, stream, ints, ())
        part_out, part_lse = (work_ptr, work_ptr + partial_lse) if splits > 1 else (lse_ptr, lse_ptr)
        # The fused combine's counters stay referenced in this frame until after the launch.
        ticket_buffer = tickets.get(device, entry.device_index, stream, count) if count else None
        ints = ((q_ptr, kc_ptr, vc_ptr, out_ptr, lse_ptr, part_out, part_lse,
                 lse_ptr if lens_ptr is None else lens_ptr, lse_ptr, lse_ptr if table_ptr is None else table_ptr,
                 lse_ptr, lse_ptr, q_ptr, q_ptr, lse_ptr, lse_ptr, lse_ptr, lse_ptr, lse_ptr,
                 lse_ptr if key_mask is None else key_mask.data_ptr(),
                 lse_ptr if ticket_buffer is None else ticket_buffer.data_ptr())
                + head + ((lens,) + rest if entry.lens_int else ()))
        _launch(split_kernel, grid, stream, ints, floats)
        if combine_kernel is not None and splits > 1:
            _launch(combine_kernel, combine_at, stream, (part_out, part_lse, out_ptr, lse_ptr, lse_ptr) + combine_tail,
                    ())
        return (out, lse) if return_lse else out

    return serve


# The warm path flash_attn_with_kvcache uses (GPU tensors).
serve = make()
