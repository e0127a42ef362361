"""The FP8 forward's warm path: a warm dense call served from an entry made when its shape was first described.

A dense FP8 call is checked by ``fp8.checked`` and packed by ``fp8.pack`` from its tensors' sizes, strides, dtypes
and devices, its flags and its descales' shapes: the same inputs give the same checks, the same constant integers
(every one but the pointers) and the same memo keys. A warm path looks those up in one dict read keyed on exactly
what the checks read (q, k and v's sizes, strides, dtypes and devices; the flags; each descale's sizes, strides,
dtype, device and requires_grad), then allocates the outputs and V's transpose, reads the pointers (their
alignment picks the aligned or unaligned plan, as ``fp8.pack`` decides), copies V and launches. ``describe``
makes the entry on the first call of a shape with ``fp8.checked`` and ``fp8.pack`` themselves, so the checks and
the packing stay in one place.

Anything else returns None and the caller takes the general path (``fp8.checked`` then ``fp8.forward``), which
raises the errors (naming the caller's argument) and memoises the plan: a call the checks refuse (no entry is
made for it), a first call (no plan memoised yet), CPU or meta tensors, inputs or descales that require grad, an
argument of an unusual type (``causal`` 1, a window of bools: equal as dict keys to valid ones, so never looked
up), an empty output or no keys (``fp8.forward`` writes those without a launch). An entry remembers the runtime's
plans it was made against: a rebuilt runtime makes it again.

V's transpose: the kernel reads V as (B, Hk, Dv, Sk) with keys contiguous, rows a multiple of 16 keys
(``fp8.empty_vt``). The warm path allocates it as a (B, Hk, Sk, Dv) tensor with those strides (one
``empty_strided``, its storage ending at the last key: the padding past seqlen_k is never read) and copies V
into it: one device copy, V read and written once, no view made around it where the keys stay in order; the
plan says whether its kernel reads them in operand order (``fp8.copy_v``).

The warm paths are module attributes made by ``make``: ``forward_bhsd`` (the kernel's order, ``(out, lse)``:
``fp8_calls.attention``, the torch op ``lazytriton::flash_fwd_fp8``), ``forward_bshd`` and ``output_bshd``
(``flash_attn_func``'s layout, through ``fp8_calls.flash_attn_warm``: out comes back in it, with or without lse).
Tests and benchmarks/profile_hot.py make them for CPU tensors (``cuda=False``) with their own runtime and stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lazytriton import launch, runtime
from lazytriton.kernels.flash_fwd import binding, fp8, hot
from lazytriton.kernels.flash_fwd import grid as _grid
from lazytriton.kernels.flash_fwd.fp8_spec import FLASH_FWD_FP8

# The pointers, in the description's order, that the per-call tuple writes before the entry's constant ints.
POINTERS = ("Q", "K", "V", "Out", "Lse", "Cu_seqlens_q", "Cu_seqlens_k", "Seqused_q", "Seqused_k", "Q_descale",
            "K_descale", "V_descale")
if fp8.INT_PARAMS[:len(POINTERS)] != POINTERS or any(kind.startswith("*") for name, kind in FLASH_FWD_FP8.params
                                                     if name not in POINTERS):
    raise RuntimeError(f"fp8_hot.py: flash_fwd_fp8's pointers are no longer {POINTERS}")
# The pointers whose 16-byte alignment the aligned plan needs (the rest of ``aligned_params`` are strides, constant).
ALIGNED_POINTERS = ("Q", "K", "V", "Out", "Lse")
if {name for name in FLASH_FWD_FP8.aligned_params if name in POINTERS} != set(ALIGNED_POINTERS):
    raise RuntimeError(f"fp8_hot.py: flash_fwd_fp8's aligned pointers are no longer {ALIGNED_POINTERS}")
_STRIDE_SLOTS = tuple(fp8.INT_PARAMS.index(name) for name in FLASH_FWD_FP8.aligned_params if name not in POINTERS)
MAX_SHAPES = 4096  # distinct entries remembered; past it the table starts again
_F32 = torch.float32
# The current stream's raw handle: the C function itself where torch has it (~0.3 µs on the H200), as hot.py's.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or launch.raw_stream


class Entry:
    """What a described shape's calls share: allocation shapes, constant ints and floats, the plans' memo keys."""

    __slots__ = ("plans", "device", "device_index", "out_size", "out_stride", "lse_template", "lse_numel",
                 "vt_size", "vt_stride", "tail", "floats", "strides_aligned", "dims",
                 "key_aligned", "key_unaligned", "launch_aligned", "launch_unaligned")

    plans: dict[Any, Any]
    device: torch.device
    device_index: int
    out_size: tuple[int, ...]
    out_stride: tuple[int, ...]
    # On the host (hot.lse_template): an entry keeps no device memory. The FP8 op reaches this warm path in
    # cudagraph trees' warm-up too, whose allocations come from the graph's pool, which refuses a block kept alive.
    lse_template: torch.Tensor
    lse_numel: int
    vt_size: tuple[int, ...]
    vt_stride: tuple[int, ...]
    tail: tuple[int, ...]
    floats: tuple[float, ...]
    strides_aligned: bool
    dims: tuple[int, int, int]
    key_aligned: tuple[Any, ...]
    key_unaligned: tuple[Any, ...]
    launch_aligned: tuple[Any, tuple[int, int, int], bool] | None
    launch_unaligned: tuple[Any, tuple[int, int, int], bool] | None

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    def launch(self, aligned: bool) -> tuple[Any, tuple[int, int, int], bool] | None:
        """(kernel, grid, operand) of the plan memoised for aligned or unaligned pointers; None: not yet.

        Kept once found. ``operand``: whether the kernel reads V's keys in operand order (``fp8.copy_v``).
        """
        plan = self.plans.get(self.key_aligned if aligned else self.key_unaligned)
        if plan is None:
            return None
        kernel, block_m, operand_order = plan
        found = (kernel, _grid(*self.dims, block_m), operand_order)
        if aligned:
            self.launch_aligned = found
        else:
            self.launch_unaligned = found
        return found


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t


def _from_bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


# A layout's view of the caller's tensors in the kernel's (B, H, S, D) order (and back: a transpose is its own).
LAYOUTS = {"bhsd": _bhsd, "bshd": _from_bshd}


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Any, scale: Any, given: tuple[Any, Any, Any],
             window: Any, softcap: Any, chunk: Any, plans: dict[Any, Any], layout: str = "bhsd") -> Entry | None:
    """The entry of a call the warm path may serve (``fp8.checked``, ``fp8.pack``); None: the general path's.

    ``layout``: the caller's tensors' order ("bshd": flash_attn_func's (B, S, H, D)); out and V's copy are
    allocated in it.
    """
    view = LAYOUTS[layout]
    q, k, v = view(q), view(k), view(v)
    try:
        call = fp8.checked(q, k, v, causal, scale, binding.NAMES, window, softcap, chunk, given, {})
    except (TypeError, ValueError):
        return None  # the general path raises it again, naming the caller's argument
    shape = call.shape
    if shape.seqlen_k == 0 or any(t is not None and t.requires_grad for t in given):
        return None
    # Stand-ins with the tensors' sizes and strides: the outputs and V's copy the general path would make, without
    # an allocation or a copy (describe may run during a CUDA graph capture).
    q_meta, v_meta = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (q, v))
    out, lse = fp8.empty_outputs(q_meta, call.dv)
    if out.numel() == 0:
        return None
    scales = fp8.descales(given, q, shape.batch, shape.heads_k)  # an absent one: None, a null pointer
    vt = fp8.empty_vt(v_meta)
    ints, _, index64 = fp8.pack(q, k, vt, out, lse, call, scales)
    device = q.device
    out, v_copy = view(out), view(vt.transpose(2, 3))
    return Entry(
        plans=plans, device=device, device_index=q.get_device(), out_size=tuple(out.shape), out_stride=out.stride(),
        lse_template=hot.lse_template(*lse.shape), lse_numel=lse.numel(),
        vt_size=tuple(v_copy.shape), vt_stride=v_copy.stride(), tail=ints[len(POINTERS):], floats=fp8.floats(call),
        strides_aligned=not any(ints[slot] & 15 for slot in _STRIDE_SLOTS),
        dims=(shape.seqlen_q, shape.heads_q, shape.batch),
        key_aligned=fp8.memo_key(device.index, call, shape, True, index64, dtype=binding.FP8_DTYPES[q.dtype]),
        key_unaligned=fp8.memo_key(device.index, call, shape, False, index64, dtype=binding.FP8_DTYPES[q.dtype]))


def make(layout: str = "bhsd", result: str = "forward", cuda: bool = True,
         get_runtime: Callable[[], Any] = runtime.get, raw_stream: Callable[[int], int] = _RAW_STREAM,
         spare: dict[int, tuple[int, int]] | None = None,
         spare_lse: Callable[[int, int], torch.Tensor] = hot.spare_lse) -> Callable[..., Any]:
    """The warm path ``serve(q, k, v, causal, scale, given, window=(-1, -1), softcap=0.0, chunk=0)``.

    ``layout``: "bhsd" (the kernel's order) or "bshd" (flash_attn_func's: out comes back in it, with no view
    made); ``result``: "forward" gives ``(out, lse)``, "output" ``out`` alone, its lse written into hot.py's spare
    buffer (``hot.SPARE``, or ``spare``), which nobody reads. ``given``: (q_descale, k_descale, v_descale), each
    None or a plain tensor (the callers' check, as of q, k and v). None: the general path's call. ``cuda=False``:
    CPU tensors too (tests, profile_hot's fake driver).
    """
    shapes: dict[tuple[Any, ...], Entry] = {}
    empty_strided, empty_like, scratch_alloc = torch.empty_strided, torch.empty_like, launch.scratch_alloc
    copy_v = fp8.copy_v
    out_dtype, no_window = fp8.OUT_DTYPE, binding.NO_WINDOW
    spares = hot.SPARE if spare is None else spare
    forward = result == "forward"
    if result not in ("forward", "output") or layout not in LAYOUTS:
        raise ValueError(f"fp8_hot.make: no {result!r} warm path for layout {layout!r}")
    view = LAYOUTS[layout]

    def serve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Any, scale: Any,
              given: tuple[Any, Any, Any], window: Any = no_window, softcap: Any = 0.0, chunk: Any = 0) -> Any:
        if cuda and not (q.is_cuda and k.is_cuda and v.is_cuda) or q.requires_grad or k.requires_grad \
                or v.requires_grad:
            return None
        if not (causal is False or causal is True or type(causal) is str) or not (scale is None or type(scale)
                                                                                   is float):
            return None
        if window is not no_window and (type(window) is not tuple or len(window) != 2 or type(window[0]) is not int
                                        or type(window[1]) is not int) or type(softcap) is not float \
                or type(chunk) is not int:
            return None
        qd, kd, vd = given
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.get_device(), k.get_device(), v.get_device(), causal, scale, window, softcap, chunk,
               None if qd is None else (qd.shape, qd.stride(), qd.dtype, qd.get_device(), qd.requires_grad),
               None if kd is None else (kd.shape, kd.stride(), kd.dtype, kd.get_device(), kd.requires_grad),
               None if vd is None else (vd.shape, vd.stride(), vd.dtype, vd.get_device(), vd.requires_grad))
        plans = get_runtime().plans
        entry = shapes.get(key)
        if entry is None or entry.plans is not plans:
            entry = describe(q, k, v, causal, scale, given, window, softcap, chunk, plans, layout)
            if entry is None:
                return None
            if len(shapes) >= MAX_SHAPES:
                shapes.clear()
            shapes[key] = entry
        device = entry.device
        out = empty_strided(entry.out_size, entry.out_stride, dtype=out_dtype, device=device)
        if forward:
            lse = empty_like(entry.lse_template, device=device)
            lse_ptr = lse.data_ptr()
        else:
            spare_held = spares.get(entry.device_index)
            if spare_held is None or spare_held[0] < entry.lse_numel:
                lse = spare_lse(entry.device_index, entry.lse_numel)  # alive in this frame until after the launch
                lse_ptr = lse.data_ptr()
            else:
                lse_ptr = spare_held[1]
        vt = empty_strided(entry.vt_size, entry.vt_stride, dtype=v.dtype, device=device)
        q_ptr, k_ptr, vt_ptr, out_ptr = q.data_ptr(), k.data_ptr(), vt.data_ptr(), out.data_ptr()
        if entry.strides_aligned and not (q_ptr | k_ptr | vt_ptr | out_ptr | lse_ptr) & 15:
            found = entry.launch_aligned or entry.launch(True)
        else:
            found = entry.launch_unaligned or entry.launch(False)
        if found is None:
            return None  # no plan memoised for this key yet: the general path plans it
        kernel, grid, operand_order = found
        if operand_order:
            copy_v(view(vt), view(v), True)  # in the kernel's (B, H, S, D) order: the keys are dim 2
        else:
            vt.copy_(v)
        # An absent descale's pointer is null: the kernel reads 1.0 (its strides in the entry's tail are 0).
        ints = (q_ptr, k_ptr, vt_ptr, out_ptr, lse_ptr, 0, 0, 0, 0, 0 if qd is None else qd.data_ptr(),
                0 if kd is None else kd.data_ptr(), 0 if vd is None else vd.data_ptr()) + entry.tail
        stream = raw_stream(entry.device_index)
        fast = kernel.fast
        if fast is None:
            kernel.launch(grid, stream, ints, entry.floats, scratch_alloc)
        else:
            status = fast(grid[0], grid[1], grid[2], stream, ints, entry.floats)
            if status:
                kernel.fail(status, grid)
        return (out, lse) if forward else out

    return serve


# The warm paths the callers use: fp8_calls.attention and the torch op (the kernel's order, (out, lse)), and
# flash_attn_func (its own order, out alone or with lse).
forward_bhsd = make("bhsd", "forward")
forward_bshd = make("bshd", "forward")
output_bshd = make("bshd", "output")
