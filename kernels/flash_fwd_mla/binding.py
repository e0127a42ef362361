"""Host side of flash_fwd_mla: checks, argument packing, the memo key, the plan and the launch (or the interpreter).

A call is flash_fwd's (``flash_fwd.binding.check`` and ``varlen.check`` check q, k, the causal mode, the scale,
the window, the softcap and, packed, cu_seqlens and the lengths; v through its first 256 columns, the most
flash_fwd takes, its own head dim checked here up to 512) plus ``qv``: ``Call`` holds flash_fwd's record with
v's head dim and whether qv is given. With qv the default scale is FlashAttention-3's 1/sqrt(head_dim +
head_dim_v). FlashAttention-3's ``attention_chunk`` is flash_fwd's (``fwd.with_chunk``: the call's
``attention_chunk``, the kernel's CHUNK) and, packed, ``seqused_q``/``seqused_k`` are varlen's (``VarlenCall``'s,
the kernel's SEQUSED_Q/SEQUSED_K). Tensors are in the kernel's (batch, heads, seqlen, head dim) order; packed ones
as varlen's (1, heads, total, head dim) views.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lazytriton import geometry, launch, machine, runtime, tuning
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.kernels.flash_fwd import varlen
from lazytriton.kernels.flash_fwd_mla import FLASH_FWD_MLA, grid
from lazytriton.kernels.flash_fwd_mla.dispatch import KERNEL
from lazytriton.record import NamedTuple
from lazytriton.variant import Variant

INT_PARAMS = tuple(name for name, kind in FLASH_FWD_MLA.params if not kind.startswith("fp"))
_N_POINTERS = sum(1 for _, kind in FLASH_FWD_MLA.params if kind.startswith("*"))
MARK = "mla"  # the memo key's first item: no other family's key starts with it
CHUNK_TAG = "chunk"  # the memo key's tail item of a call with attention_chunk (absent: the key without it)
NOT_USED = (False, False)  # SEQUSED_Q, SEQUSED_K of a call without seqused


class Call(NamedTuple):
    """A checked call: flash_fwd's record (v's head dim in ``head_dim_v``, 0 where q's) and whether qv is given."""

    attn: fwd.Call
    qv: bool


def check_head_dim_v(v: Any, name: str = "v") -> int:
    """V's head dim, checked against the kernel's 1..512 (TypeError/ValueError naming ``name``)."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() == 0 or not 1 <= v.shape[-1] <= geometry.MAX_HEAD_DIM_V:
        raise ValueError(f"{name}'s head dim ({name}.shape[-1]) must be in 1..{geometry.MAX_HEAD_DIM_V}, got "
                         f"{v.shape[-1] if v.dim() else 'a 0-dim tensor'}")
    return int(v.shape[-1])


def check_qv(qv: Any, q: torch.Tensor, head_dim_v: int, name: str = "qv") -> None:
    """``qv`` of q's shape but v's head dim, q's dtype and device, a contiguous last dim (else TypeError/ValueError)."""
    if not isinstance(qv, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(qv).__name__}")
    want = (*q.shape[:-1], head_dim_v)
    if tuple(qv.shape) != want:
        raise ValueError(f"{name} must have shape {want} (q's, with v's head dim {head_dim_v}), got {tuple(qv.shape)}")
    if qv.dtype != q.dtype or qv.device != q.device:
        raise TypeError(f"{name} must be {q.dtype} on {q.device} (q's), got {qv.dtype} on {qv.device}")
    if qv.stride(-1) != 1 and head_dim_v > 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {qv.stride()}")


def _stand_in(v: torch.Tensor) -> torch.Tensor:
    """V's first columns, as many as flash_fwd's checks take: the rest of its rules are v's own."""
    return v[..., :geometry.MAX_HEAD_DIM] if v.shape[-1] > geometry.MAX_HEAD_DIM else v


def _with_dims(call: fwd.Call, head_dim_v: int, qv: bool, scale: Any) -> fwd.Call:
    d = call.shape.head_dim
    if qv and scale is None:
        call = call._replace(scale=1.0 / math.sqrt(d + head_dim_v))
    return call._replace(head_dim_v=0 if head_dim_v == d else head_dim_v)


def check(q: Any, k: Any, v: Any, qv: Any, causal: Any = False, scale: Any = None, names: fwd.Names = fwd.NAMES,
          window: Any = fwd.NO_WINDOW, softcap: Any = 0.0, attention_chunk: Any = 0) -> Call:
    """The checked dense call ((B, H, S, D) tensors; qv (B, Hq, Sq, Dv) or None), or a TypeError/ValueError."""
    dv = check_head_dim_v(v, names.v)
    call = fwd.with_chunk(fwd.check(q, k, _stand_in(v), causal, scale, names, window, softcap), attention_chunk)
    if qv is not None:
        check_qv(qv, q, dv)
    return Call(_with_dims(call, dv, qv is not None, scale), qv is not None)


def check_varlen(q: Any, k: Any, v: Any, qv: Any, cu_q: Any, cu_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
                 causal: Any, scale: Any, window: Any, softcap: Any, values: bool | None = None,
                 seqused_q: Any = None, seqused_k: Any = None,
                 attention_chunk: Any = 0) -> tuple[varlen.VarlenCall, bool]:
    """A packed call ((total, heads, dim) tensors) checked: varlen's record with v's head dim, and whether qv is given.

    ``values``: ``varlen.check``'s (None: read cu_seqlens, and seqused, to the host unless tracing or capturing);
    ``seqused_q``, ``seqused_k``, ``attention_chunk``: FlashAttention-3's, as ``varlen.check`` takes them.
    """
    dv = check_head_dim_v(v)
    vc = varlen.check(q, k, _stand_in(v), cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
                      values=values, seqused_q=seqused_q, seqused_k=seqused_k, attention_chunk=attention_chunk)
    if qv is not None:
        check_qv(qv, q, dv)
    return vc._replace(call=_with_dims(vc.call, dv, qv is not None, scale)), qv is not None


def pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None, out: torch.Tensor,
         lse: torch.Tensor, call: Call, cu_q: int = 0, cu_k: int = 0, used_q: int = 0,
         used_k: int = 0) -> tuple[tuple[int, ...], bool, bool]:
    """(ints in ``INT_PARAMS``' order, aligned, index64); qv None: its pointer and strides 0 (not read).

    ``cu_q``, ``cu_k``, ``used_q``, ``used_k``: the addresses of cu_seqlens and seqused (0: not read).
    """
    c = call.attn
    b, hq, hk, sq, sk, d = c.shape
    dv = c.dv
    qs, ks, vs, os = q.stride(), k.stride(), v.stride(), out.stride()
    qvs = qv.stride() if qv is not None else (0, 0, 0, 0)
    values = {
        "Q": q.data_ptr(), "K": k.data_ptr(), "V": v.data_ptr(), "Qv": 0 if qv is None else qv.data_ptr(),
        "Out": out.data_ptr(), "Lse": lse.data_ptr(), "Cu_seqlens_q": cu_q, "Cu_seqlens_k": cu_k,
        "Seqused_q": used_q, "Seqused_k": used_k,
        **{f"stride_{t}{x}": s[i] for t, s in (("q", qs), ("k", ks), ("v", vs), ("qv", qvs), ("o", os))
           for i, x in enumerate("bhs")},
        "stride_lb": hq * sq, "stride_lh": sq, "group_size": hq // hk, "seqlen_q": sq, "seqlen_k": sk,
        "head_dim": d, "head_dim_v": dv, "causal_offset": c.offset, "window_left": c.window_left,
        "window_right": c.window_right, "attention_chunk": c.attention_chunk,
    }
    aligned = not any(values[name] & 15 for name in FLASH_FWD_MLA.aligned_params)
    index64 = max((b - 1) * qs[0] + (hq - 1) * qs[1] + (sq - 1) * qs[2] + d,
                  (b - 1) * qvs[0] + (hq - 1) * qvs[1] + (sq - 1) * qvs[2] + dv,
                  (b - 1) * os[0] + (hq - 1) * os[1] + (sq - 1) * os[2] + dv,
                  (b - 1) * ks[0] + (hk - 1) * ks[1] + (sk - 1) * ks[2] + d,
                  (b - 1) * vs[0] + (hk - 1) * vs[1] + (sk - 1) * vs[2] + dv, b * hq * sq) > fwd.INT32_MAX
    return tuple(values[name] for name in INT_PARAMS), aligned, index64


def floats(call: Call) -> tuple[float, float]:
    """The float parameters: sm_scale and softcap."""
    return (call.attn.scale, call.attn.softcap)


def memo_key(device_index: int | None, dtype: torch.dtype, call: Call, shape: fwd.Shape, aligned: bool,
             index64: bool, packed: bool = False, used: tuple[bool, bool] = NOT_USED) -> tuple[Any, ...]:
    """The plan's memo key: everything ``variant`` reads, seqlens through the tuning buckets.

    ``used``: the SEQUSED_Q/SEQUSED_K flags (packed only). A call with neither nor a chunk keeps the short key.
    """
    c = call.attn
    tail: tuple[Any, ...] = (CHUNK_TAG,) if c.chunked else ()
    tail += ("seqused", *used) if any(used) else ()
    return (MARK, device_index, dtype, shape.head_dim, c.dv, call.qv, c.causal != "none", aligned, index64,
            tuning.bucket_index(shape.seqlen_q), tuning.bucket_index(shape.seqlen_k), c.windowed, c.capped, packed,
            *tail)


def variant(target: Any, dtype: torch.dtype, call: Call, shape: fwd.Shape, aligned: bool, index64: bool,
            packed: bool = False, used: tuple[bool, bool] = NOT_USED) -> Variant:
    """The variant serving a call of this shape (the family's dispatch decides)."""
    c = call.attn
    return dispatch.kernel_variant(KERNEL, target, fwd.DTYPES[dtype], shape.head_dim, c.causal != "none", aligned,
                                   shape.seqlen_q, shape.seqlen_k, index64=index64, window=c.windowed,
                                   softcap=c.capped, varlen=packed, head_dim_v=c.dv, qv=call.qv, chunk=c.chunked,
                                   seqused_q=used[0], seqused_k=used[1])


def interpreter_constexprs(call: Call, shape: fwd.Shape, packed: bool = False,
                           used: tuple[bool, bool] = NOT_USED) -> dict[str, Any]:
    """Constexprs for Triton's interpreter: small tiles (the interpreter's cost is per program and op)."""
    c = call.attn
    padded, padded_v = geometry.padded_head_dim(shape.head_dim), geometry.padded_value_dim(c.dv)
    return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": padded, "EVEN_D": padded == shape.head_dim,
            "BLOCK_DV": padded_v, "EVEN_DV": padded_v == c.dv, "CAUSAL": c.causal != "none",
            "WINDOW": c.windowed, "SOFTCAP": c.capped, "VARLEN": packed, "QV": call.qv, "CHUNK": c.chunked,
            "SEQUSED_Q": used[0], "SEQUSED_K": used[1]}


def _plan(rt: Any, key: tuple[Any, ...], device: torch.device, dtype: torch.dtype, call: Call, shape: fwd.Shape,
          aligned: bool, index64: bool, packed: bool, used: tuple[bool, bool] = NOT_USED) -> Any:
    """``launch.plan`` of the call's variant: (kernel, BLOCK_M), memoised under ``key``."""
    return launch.plan(rt, key, device,
                       lambda target: ((variant(target, dtype, call, shape, aligned, index64, packed, used),
                                        ("BLOCK_M",)),),
                       "run the call once with this shape before the capture, or lazytriton.preload it")


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None, out: torch.Tensor,
        lse: torch.Tensor, call: Call, shape: fwd.Shape, cu: tuple[Any, Any] = (0, 0), packed: bool = False,
        seqused: tuple[Any, Any] = (None, None)) -> None:
    """Launch the kernel (GPU: the memoised plan, one dict lookup once warm) or interpret it (CPU).

    ``shape`` sizes the grid (packed: sequences x max_seqlen); ``cu``: cu_seqlens_q and cu_seqlens_k (tensors),
    or 0 when dense; ``seqused``: seqused_q and seqused_k (tensors, packed only) or None.
    """
    used = (seqused[0] is not None, seqused[1] is not None)
    used_args = tuple(0 if t is None else t for t in seqused)
    addresses = tuple(p if isinstance(p, int) else p.data_ptr() for p in (*cu, *used_args))
    ints, aligned, index64 = pack(q, k, v, qv, out, lse, call, *addresses)
    if q.device.type == "cpu":
        from lazytriton import compiler  # on CPU tensors only: the interpreter

        fwd.warn_if_slow(shape)
        constexprs = interpreter_constexprs(call, shape, packed, used)
        args = (q, k, v, 0 if qv is None else qv, out, lse, *cu, *used_args, *ints[_N_POINTERS:], *floats(call))
        compiler.interpret(KERNEL, grid(shape.seqlen_q, shape.heads_q, shape.batch, constexprs["BLOCK_M"]), args,
                           constexprs)
        return
    device = q.device
    rt = runtime.get()
    key = memo_key(device.index, q.dtype, call, shape, aligned, index64, packed, used)
    kernel, block_m = rt.plans.get(key) or _plan(rt, key, device, q.dtype, call, shape, aligned, index64, packed,
                                                 used)
    kernel.launch(grid(shape.seqlen_q, shape.heads_q, shape.batch, block_m), launch.raw_stream(device.index), ints,
                  floats(call), launch.scratch_alloc)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None,
            call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a checked dense call: the kernel on a GPU, the interpreter on CPU, empty on meta."""
    shape = call.attn.shape
    out, lse = fwd.empty_outputs(q, shape, call.attn.dv)
    if out.numel() == 0 or q.device.type == "meta":
        return out, lse
    if shape.seqlen_k == 0:
        return out.zero_(), lse.fill_(-math.inf)
    run(q, k, v, qv, out, lse, call, shape)
    return out, lse


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None, cu_q: torch.Tensor,
                   cu_k: torch.Tensor, vc: varlen.VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse (heads_q, total_q)) of a checked packed call (``check_varlen``) on (total, heads, dim) tensors."""
    out, lse = varlen.empty_outputs(q, vc.call.dv)
    if out.numel() == 0 or q.device.type == "meta" or vc.batch == 0:
        return out, lse
    if vc.max_seqlen_q == 0 or vc.max_seqlen_k == 0:
        return out.zero_(), lse.fill_(-math.inf)
    if q.device.type == "cpu":
        vc = varlen.host_lengths(vc, cu_q, cu_k)
    view = varlen.kernel_view
    run(view(q), view(k), view(v), None if qv is None else view(qv), view(out), lse.unsqueeze(0),
        Call(vc.call, qv is not None), vc.kernel_shape, (cu_q, cu_k), packed=True,
        seqused=(vc.seqused_q, vc.seqused_k))
    return out, lse


def preload(device: torch.device, dtype: torch.dtype, call: Call, aligned: bool = True,
            index64: bool = False) -> Variant:
    """Load the kernel a dense call of this shape runs on ``device`` now (images, cache or JIT); its variant."""
    shape = call.attn.shape
    key = memo_key(device.index, dtype, call, shape, aligned, index64)
    _plan(runtime.get(), key, device, dtype, call, shape, aligned, index64, False)
    return variant(machine.target_of_device(device), dtype, call, shape, aligned, index64)
