"""The FP8 forward on the host: descales, V's transpose, the argument packing and the launch of its kernels.

FlashAttention-3's FP8 forward: float8_e4m3fn (or float8_e5m2) q, k and v, all three one dtype (checked by
``binding.check(..., fp8=True)`` or ``varlen.check(..., fp8=True)``, shapes and
flags as any call's), FlashAttention-3's ``q_descale``, ``k_descale`` and
``v_descale`` (``descales``), a bf16 output. The kernel reads V from its
transpose, (B, Hk, head_dim_v, Sk) with the keys contiguous
(``fp8_spec``/``triton_kernel._load_k_vt`` say why), which ``copy_v``
writes once a call (a read and a write of v, each byte once: small beside the
attention's work), its rows padded to 16 keys so that the 16-byte alignment
hints hold, and its keys in the order the plan's kernel reads them. There is no
backward (FlashAttention-3 has none): a call whose q, k or v requires grad
runs through the torch op (``lazytriton.fp8_op``), whose backward raises
NotImplementedError, as FlashAttention-3's forward takes such inputs and fails
only on a backward. Two kernels share this ABI:
``flash_fwd_fp8`` (Triton) and, on sm_90 for the calls its table and rule
take, ``flash_fwd_fp8_gluon`` (``fp8_gluon``; ``variant`` chooses, the memo
key's last bit says whether a call fits). ``checked``/``checked_varlen``
check a whole call and ``forward``/``varlen_forward`` run it: the public
functions' ``lazytriton.fp8_calls`` and the torch ops of ``lazytriton.fp8_op``
call them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lazytriton import launch, machine, runtime, tuning
from lazytriton.kernels.flash_fwd import binding, fp8_gluon
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import grid as _grid
from lazytriton.kernels.flash_fwd.fp8_spec import FLASH_FWD_FP8
from lazytriton.record import NamedTuple

DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
OUT_DTYPE = torch.bfloat16  # FlashAttention-3's output dtype for FP8 inputs
INT_PARAMS = tuple(name for name, kind in FLASH_FWD_FP8.params if not kind.startswith("fp"))
_N_POINTERS = sum(1 for _, kind in FLASH_FWD_FP8.params if kind.startswith("*"))
# The memo key's first item: no plain, varlen or decoding key starts with it.
MARK = "fp8"


class Descales(NamedTuple):
    """q_descale, k_descale and v_descale as (batch, heads_k) float32 views (0 strides where one serves all).

    None where the descale is absent: the kernels get a null pointer and strides 0, and read it as 1.0 (as the C
    API passes an absent one), so a call without descales needs no device memory of its own.
    """

    q: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None


def is_fp8(t: Any) -> bool:
    """Whether ``t`` is a tensor of an FP8 dtype the forward takes."""
    return isinstance(t, torch.Tensor) and t.dtype in binding.FP8_DTYPES


def refuse_descales(q: Any, given: tuple[Any, Any, Any]) -> None:
    """A TypeError naming the first descale given for a call whose q is not FP8."""
    for name, t in zip(DESCALE_NAMES, given, strict=True):
        if t is not None:
            dtype = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
            raise TypeError(f"{name} is for float8_e4m3fn inputs or float8_e5m2 ones (FlashAttention-3's FP8 "
                            f"forward), but q is {dtype}; pass None")


def check_descales(given: tuple[Any, Any, Any], q: torch.Tensor, batch: int, heads_k: int) -> None:
    """FlashAttention-3's descales checked: a TypeError/ValueError naming the argument.

    Each is None (1.0), a float32 tensor on q's device of shape (batch,
    heads_k) (FlashAttention-3's: per sequence and key/value head; with packed
    sequences ``batch`` is their count), or one value for the tensor, shape
    (1,) or ().
    """
    for name, t in zip(DESCALE_NAMES, given, strict=True):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on one device")
        if tuple(t.shape) not in ((batch, heads_k), (1,), ()):
            raise ValueError(f"{name} must have shape (batch, heads_k) = ({batch}, {heads_k}), or (1,) or () for one "
                             f"value, got {tuple(t.shape)}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but the FP8 forward has no backward")


def descales(given: tuple[Any, Any, Any], q: torch.Tensor, batch: int, heads_k: int) -> Descales:
    """Checked descales (``check_descales``) as (batch, heads_k) views: None stays None, one value is broadcast."""
    return Descales(*(None if t is None else t.reshape(()).expand(batch, heads_k) if t.dim() < 2 else t
                      for t in given))


def _address(t: torch.Tensor | None) -> int:
    """A descale's pointer: 0 (null, read as 1.0) for an absent one."""
    return 0 if t is None else t.data_ptr()


def _interpreted(t: torch.Tensor | None) -> torch.Tensor:
    """A descale as Triton's interpreter takes it: an absent one as an empty CPU tensor, whose data pointer is 0.

    The interpreter takes a tensor for a pointer parameter (an int 0 would be an integer there); the kernel masks
    its load off the null pointer, as on a GPU.
    """
    return torch.empty(0, dtype=torch.float32) if t is None else t


def empty_vt(v: torch.Tensor) -> torch.Tensor:
    """V's copy for V (B, Hk, Sk, Dv), not yet written: a (B, Hk, Dv, Sk) view, rows a multiple of 16 keys."""
    b, hk, sk, dv = v.shape
    padded = -(-max(sk, 1) // 16) * 16
    return torch.empty((b, hk, dv, padded), dtype=v.dtype, device=v.device)[..., :sk]


def copy_v(dst: torch.Tensor, v: torch.Tensor, operand_order: bool) -> None:
    """Write V (B, Hk, Sk, Dv) into ``dst``, V's copy seen in V's own (B, Hk, Sk, Dv) order: one device copy.

    ``operand_order`` (the plan's last item, ``fp8_gluon.reads_operand_order``): the keys of every 32 in
    ``flash_fwd_fp8_gluon``'s order, where key 16a + 8b + 2q + e goes to position 16a + 4q + 2b + e (its kernel's
    docstring says why); seqlen_k a multiple of 32 (that kernel's tiles divide it). Else the keys in order.
    """
    if not operand_order:
        dst.copy_(v)
        return
    b, hk, sk, dv = v.shape
    if sk % fp8_gluon.KEY_GROUP:
        raise ValueError(f"V's keys in operand order need a multiple of {fp8_gluon.KEY_GROUP}, got seqlen_k {sk}")
    chunks = sk // fp8_gluon.KEY_GROUP
    # key digits (a, b, q, e) -> position digits (a, q, b, e)
    dst.view(b, hk, chunks, 2, 4, 2, 2, dv).copy_(v.view(b, hk, chunks, 2, 2, 4, 2, dv).permute(0, 1, 2, 3, 5, 4, 6, 7))


def transposed_v(v: torch.Tensor, operand_order: bool = False) -> torch.Tensor:
    """V (B, Hk, Sk, Dv) as the kernels read it (``empty_vt`` written by ``copy_v``): (B, Hk, Dv, Sk)."""
    made = empty_vt(v)
    copy_v(made.transpose(2, 3), v, operand_order)
    return made


def pack(q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
         call: binding.Call, scales: Descales, cu_q: int = 0, cu_k: int = 0, used_q: int = 0,
         used_k: int = 0) -> tuple[tuple[int, ...], bool, bool]:
    """(ints in ``INT_PARAMS``' order, aligned, index64) for ``flash_fwd_fp8``.

    Tensors in (B, H, S, D) order, vt (B, Hk, Dv, Sk).
    """
    b, hq, hk, sq, sk, d = call.shape
    dv = call.dv
    qs, ks, vs, os = q.stride(), k.stride(), vt.stride(), out.stride()
    values = {
        "Q": q.data_ptr(), "K": k.data_ptr(), "V": vt.data_ptr(), "Out": out.data_ptr(), "Lse": lse.data_ptr(),
        "Cu_seqlens_q": cu_q, "Cu_seqlens_k": cu_k, "Seqused_q": used_q, "Seqused_k": used_k,
        "Q_descale": _address(scales.q), "K_descale": _address(scales.k), "V_descale": _address(scales.v),
        "stride_qb": qs[0], "stride_qh": qs[1], "stride_qs": qs[2], "stride_kb": ks[0], "stride_kh": ks[1],
        "stride_ks": ks[2], "stride_vb": vs[0], "stride_vh": vs[1], "stride_vs": vs[2], "stride_ob": os[0],
        "stride_oh": os[1], "stride_os": os[2], "stride_lb": hq * sq, "stride_lh": sq,
        "group_size": hq // hk, "seqlen_q": sq, "seqlen_k": sk, "head_dim": d, "head_dim_v": dv,
        "causal_offset": call.offset, "window_left": call.window_left, "window_right": call.window_right,
        "attention_chunk": call.attention_chunk,
        **{f"stride_{t}d{x}": 0 if s is None else s.stride(i) for t, s in zip("qkv", scales, strict=True)
           for i, x in enumerate("bh")},
    }
    aligned = not any(values[name] & 15 for name in FLASH_FWD_FP8.aligned_params)
    index64 = max((b - 1) * qs[0] + (hq - 1) * qs[1] + (sq - 1) * qs[2] + d,
                  (b - 1) * os[0] + (hq - 1) * os[1] + (sq - 1) * os[2] + dv,
                  (b - 1) * ks[0] + (hk - 1) * ks[1] + (sk - 1) * ks[2] + d,
                  (b - 1) * vs[0] + (hk - 1) * vs[1] + (dv - 1) * vs[2] + sk, b * hq * sq) > binding.INT32_MAX
    return tuple(values[name] for name in INT_PARAMS), aligned, index64


# What capi/lazytriton.c's FP8 launcher passes for each integer parameter (p: lt__fwd_prepare's view of the caller's
# lt_attn_fwd_params, v as given: transposed; c: its checked call; q/k/v/o: its tensors; tests/test_capi_fp8.py
# compares the C initializer with these, field by field).
_C = {"Q": "LT__DATA(q)", "K": "LT__DATA(k)", "V": "LT__DATA(v)", "Out": "LT__DATA(o)", "Lse": "LT__DATA(&p->lse)",
      "Cu_seqlens_q": "c->cu_seqlens_q", "Cu_seqlens_k": "c->cu_seqlens_k", "Seqused_q": "c->seqused_q",
      "Seqused_k": "c->seqused_k", "Q_descale": "c->descale[0]", "K_descale": "c->descale[1]",
      "V_descale": "c->descale[2]",
      **{f"stride_{t}{d}": f"{t}->strides[{i}]" for t in "qkvo" for i, d in enumerate(("b", "h", "s"))},
      "stride_lb": "c->hq * c->sq", "stride_lh": "c->sq", "group_size": "c->hq / c->hk", "seqlen_q": "c->sq",
      "seqlen_k": "c->sk", "head_dim": "c->d", "head_dim_v": "c->dv", "causal_offset": "c->offset",
      "window_left": "c->window_left", "window_right": "c->window_right", "attention_chunk": "c->attention_chunk",
      **{f"stride_{t}d{d}": f"c->descale_strides[{i}][{j}]" for i, t in enumerate("qkv") for j, d in enumerate("bh")}}


def c_initializer() -> str:
    """The C launcher's integer-argument initializer of ``flash_fwd_fp8``, in its description's order."""
    return ", ".join(_C[name] for name in INT_PARAMS)


def floats(call: binding.Call) -> tuple[float, float]:
    """The float parameters: sm_scale and softcap."""
    return (call.scale, call.softcap)


def gluon_fits(call: binding.Call, shape: binding.Shape, packed: tuple[bool, bool, bool]) -> bool:
    """Whether the call's shape and flags fit the Gluon FP8 forward's table (``fp8_gluon.fits``): the key's last bit."""
    features = call.windowed or call.capped or call.chunked or any(packed)
    return fp8_gluon.fits(shape.head_dim, call.dv, call.causal != "none", call.offset, call.scale, shape.seqlen_q,
                          shape.seqlen_k, features)


def memo_key(device_index: int | None, call: binding.Call, shape: binding.Shape, aligned: bool, index64: bool,
             packed: tuple[bool, bool, bool] = (False, False, False), *, dtype: str) -> tuple[Any, ...]:
    """The plan's memo key: what ``variant`` reads, seqlens through the tuning buckets. ``packed``: varlen, seqused.

    Its last item is ``gluon_fits``: the part of the Gluon FP8 forward's rule the buckets cannot see.
    """
    return (MARK, device_index, dtype, shape.head_dim, call.head_dim_v, call.causal != "none", aligned, index64,
            tuning.bucket_index(shape.seqlen_q), tuning.bucket_index(shape.seqlen_k), call.windowed, call.capped,
            call.chunked, *packed, gluon_fits(call, shape, packed))


def variant(target: Any, call: binding.Call, shape: binding.Shape, aligned: bool, index64: bool,
            packed: tuple[bool, bool, bool] = (False, False, False), *, dtype: str) -> Any:
    """The variant serving a call of FP8 ``dtype`` (``FP8_DTYPES``' names: e4m3, e5m2); dispatch's.

    ``flash_fwd_fp8_gluon`` on sm_90 where the call ``gluon_fits`` (its table's tiles divide the seqlens, dense,
    no window, softcap or chunk), aligned, 32-bit offsets (``fp8_gluon.default_variant``); else ``flash_fwd_fp8``.
    A ValueError for a target without FP8 tensor cores.
    """
    if gluon_fits(call, shape, packed):
        served = fp8_gluon.default_variant(str(target), dtype, shape.head_dim, call.causal != "none", aligned,
                                           index64, shape.seqlen_q, shape.seqlen_k)
        if served is not None:
            return served
    return fwd_dispatch.flash_fwd_variant(
        target, dtype, shape.head_dim, call.causal != "none", aligned, shape.seqlen_q, index64=index64,
        seqlen_k=shape.seqlen_k, window=call.windowed, softcap=call.capped, head_dim_v=call.head_dim_v,
        varlen=packed[0], seqused_q=packed[1], seqused_k=packed[2], chunk=call.chunked)


def interpreter_constexprs(call: binding.Call, shape: binding.Shape,
                           packed: tuple[bool, bool, bool] = (False, False, False)) -> dict[str, Any]:
    """Constexprs for Triton's interpreter: small tiles (BLOCK_N 32: FP8 dots take 32 keys and more on the GPU)."""
    fields = binding.head_dim_constexprs(shape.head_dim, call.head_dim_v)
    return {"BLOCK_M": 32, "BLOCK_N": 32, **fields, "CAUSAL": call.causal != "none", "WINDOW": call.windowed,
            "SOFTCAP": call.capped, "VARLEN": packed[0], "SEQUSED_Q": packed[1], "SEQUSED_K": packed[2],
            "CHUNK": call.chunked}


def _plan(rt: Any, key: tuple[Any, ...], device: torch.device, call: binding.Call, shape: binding.Shape,
          aligned: bool, index64: bool, packed: tuple[bool, bool, bool], dtype: str) -> Any:
    """``launch.plan`` of the call's variant (either FP8 kernel), memoised at ``key``: (kernel, BLOCK_M, operand).

    ``operand``: whether the kernel reads V's keys in operand order (``copy_v``).
    """
    def choose(target: Any) -> Any:
        chosen = variant(target, call, shape, aligned, index64, packed, dtype=dtype)
        return ((chosen, ("BLOCK_M", fp8_gluon.reads_operand_order(chosen))),)

    return launch.plan(rt, key, device, choose,
                       "run the FP8 call once with this shape before the capture, or lazytriton.preload it")


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        call: binding.Call, scales: Descales, shape: binding.Shape, pointers: tuple[Any, ...] = (0, 0, 0, 0),
        packed: tuple[bool, bool, bool] = (False, False, False)) -> None:
    """Launch ``flash_fwd_fp8`` (GPU: ``launch_gpu``) or interpret it (CPU) on (B, H, S, D) tensors.

    ``shape`` sizes the grid; ``pointers``: cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k (tensors, or 0 when
    absent); ``packed``: the VARLEN, SEQUSED_Q and SEQUSED_K flags.
    """
    if q.device.type != "cpu":
        launch_gpu(q, k, v, out, lse, call, scales, shape, pointers, packed)
        return
    vt = transposed_v(v)
    ints, _, _ = pack(q, k, vt, out, lse, call, scales, *(p if isinstance(p, int) else p.data_ptr() for p in pointers))
    binding.warn_if_slow(shape)
    constexprs = interpreter_constexprs(call, shape, packed)
    args = (q, k, vt, out, lse, *pointers, *map(_interpreted, scales), *ints[_N_POINTERS:], *floats(call))
    from lazytriton import compiler  # on CPU tensors only: the interpreter

    compiler.interpret(FLASH_FWD_FP8.name, _grid(shape.seqlen_q, shape.heads_q, shape.batch, constexprs["BLOCK_M"]),
                       args, constexprs)


def launch_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               call: binding.Call, scales: Descales, shape: binding.Shape, pointers: tuple[Any, ...] = (0, 0, 0, 0),
               packed: tuple[bool, bool, bool] = (False, False, False)) -> None:
    """``run``'s GPU side: V's copy, ``pack``, the memoised plan (one dict lookup once warm), the launch.

    V's transpose is written once the plan says in which key order its kernel reads it.
    """
    vt = empty_vt(v)
    addresses = tuple(p if isinstance(p, int) else p.data_ptr() for p in pointers)
    ints, aligned, index64 = pack(q, k, vt, out, lse, call, scales, *addresses)
    device = q.device
    rt = runtime.get()
    dtype = binding.FP8_DTYPES[q.dtype]
    key = memo_key(device.index, call, shape, aligned, index64, packed, dtype=dtype)
    kernel, block_m, operand_order = (rt.plans.get(key)
                                      or _plan(rt, key, device, call, shape, aligned, index64, packed, dtype))
    copy_v(vt.transpose(2, 3), v, operand_order)
    kernel.launch(_grid(shape.seqlen_q, shape.heads_q, shape.batch, block_m), launch.raw_stream(device.index), ints,
                  floats(call), launch.scratch_alloc)


def empty_outputs(q: torch.Tensor, head_dim_v: int, varlen: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) before the kernel writes them: out bf16 like q with v's head dim; lse float32.

    lse is (batch, heads_q, seqlen_q) for a dense q (B, H, S, D), (heads_q, total_q) for a packed (total, H, D)
    one (FlashAttention-2's varlen layout). The torch op's fake gives the same.
    """
    out = binding.empty_like_head_dim(q, head_dim_v, OUT_DTYPE)
    shape = (q.shape[1], q.shape[0]) if varlen else tuple(q.shape[:3])
    return out, torch.empty(shape, dtype=torch.float32, device=q.device)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: binding.Call,
            given: tuple[Any, Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16, lse) of a checked dense FP8 call (B, H, S, D) and its descales: the kernel, or the interpreter."""
    shape = call.shape
    out, lse = empty_outputs(q, call.dv)
    if out.numel() == 0 or q.device.type == "meta":
        return out, lse
    if shape.seqlen_k == 0:
        return out.zero_(), lse.fill_(-math.inf)
    run(q, k, v, out, lse, call, descales(given, q, shape.batch, shape.heads_k), shape)
    return out, lse


def _refuse(unsupported: dict[str, Any]) -> None:
    """A ValueError naming the first argument the FP8 forward does not take (given a value that is not its default)."""
    for name, on in unsupported.items():
        if on:
            raise ValueError(f"{name} is not taken with float8_e4m3fn or float8_e5m2 inputs: the FP8 forward "
                             "(FlashAttention-3's) has no ALiBi, dropout, sinks or bias")


def checked(q: Any, k: Any, v: Any, causal: Any, scale: Any, names: binding.Names, window: Any, softcap: Any,
            attention_chunk: Any, given: tuple[Any, Any, Any], unsupported: dict[str, Any]) -> binding.Call:
    """The dense FP8 call (tensors in (B, H, S, D) order) checked, descales included; nothing runs.

    ``unsupported``: the caller's arguments the FP8 forward does not take, by name, true where given.
    """
    _refuse(unsupported)
    call = binding.with_chunk(binding.check(q, k, v, causal, scale, names, window, softcap, fp8=True),
                              attention_chunk)
    check_descales(given, q, call.shape.batch, call.shape.heads_k)
    return call


def checked_varlen(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
                   causal: Any, scale: Any, window: Any, softcap: Any, seqused_q: Any, seqused_k: Any,
                   attention_chunk: Any, given: tuple[Any, Any, Any], unsupported: dict[str, Any],
                   values: bool | None = None) -> Any:
    """``flash_attn_varlen_func``'s FP8 call on packed (total, heads, head_dim) tensors checked: its ``VarlenCall``.

    ``values``: ``varlen.check``'s (None: read cu_seqlens and seqused to the host unless tracing or capturing).
    """
    from lazytriton.kernels.flash_fwd import varlen

    _refuse(unsupported)
    vc = varlen.check(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
                      values=values, seqused_q=seqused_q, seqused_k=seqused_k, attention_chunk=attention_chunk,
                      fp8=True)
    check_descales(given, q, vc.batch, k.shape[1])
    return vc


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   vc: Any, given: tuple[Any, Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16, lse (heads_q, total_q)) of a checked packed FP8 call (``checked_varlen``)."""
    from lazytriton.kernels.flash_fwd import varlen

    out, lse = empty_outputs(q, vc.call.dv, varlen=True)
    if out.numel() == 0 or q.device.type == "meta" or vc.batch == 0:
        return out, lse
    if vc.max_seqlen_q == 0 or vc.max_seqlen_k == 0:
        return out.zero_(), lse.fill_(-math.inf)
    if q.device.type == "cpu":
        vc = varlen.host_lengths(vc, cu_q, cu_k)
    used_q, used_k = vc.seqused_q, vc.seqused_k
    views = (varlen.kernel_view(q), varlen.kernel_view(k), varlen.kernel_view(v), varlen.kernel_view(out),
             lse.unsqueeze(0))
    run(*views, vc.call, descales(given, q, vc.batch, k.shape[1]), vc.kernel_shape,
        (cu_q, cu_k, 0 if used_q is None else used_q, 0 if used_k is None else used_k), (True, *vc.used))
    return out, lse


def preload(device: torch.device, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: binding.Call) -> Any:
    """Load the kernel a dense FP8 call of this shape runs on ``device`` now (an absent descale needs nothing).

    q, k, v: (B, H, S, D) tensors or meta stand-ins (whose pointers, 0, count as aligned); the variant loaded.
    """
    shape = call.shape
    out, lse = empty_outputs(q.to("meta"), call.dv)  # the call's own are fresh allocations: aligned
    _, aligned, index64 = pack(q, k, empty_vt(v.to("meta")), out, lse, call, Descales(None, None, None))
    dtype = binding.FP8_DTYPES[q.dtype]
    key = memo_key(device.index, call, shape, aligned, index64, dtype=dtype)
    _plan(runtime.get(), key, device, call, shape, aligned, index64, (False, False, False), dtype)
    return variant(machine.target_of_device(device), call, shape, aligned, index64, dtype=dtype)


def run_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: binding.Call, given: tuple[Any, Any, Any],
                chosen: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a checked dense FP8 call (B, H, S, D) on the GPU through the variant ``chosen``, not the plan's.

    Either FP8 kernel (they share ``pack``'s arguments and the grid): the tuner, the benchmark's providers and the
    GPU tests run a tiling or a kernel dispatch would not pick. No memo; a ValueError where ``chosen`` is neither.
    """
    if chosen.kernel not in (FLASH_FWD_FP8.name, fp8_gluon.NAME):
        raise ValueError(f"chosen must be a variant of {FLASH_FWD_FP8.name} or {fp8_gluon.NAME}, got {chosen.kernel}")
    shape = call.shape
    out, lse = empty_outputs(q, call.dv)
    vt = transposed_v(v, fp8_gluon.reads_operand_order(chosen))
    ints, _, _ = pack(q, k, vt, out, lse, call, descales(given, q, shape.batch, shape.heads_k))
    kernel = runtime.get().kernel(chosen, q.device.index)
    kernel.launch(_grid(shape.seqlen_q, shape.heads_q, shape.batch, int(chosen.get("BLOCK_M"))),
                  launch.raw_stream(q.device.index), ints, floats(call), launch.scratch_alloc)
    return out, lse
