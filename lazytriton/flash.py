"""FlashAttention forward, served from the kernel cache.

``attn_fwd`` validates its inputs, picks a Variant through dispatch, fetches
the loaded kernel (memory, then disk, then the compiler) once per call shape
class, and launches it. A warm call is a dict lookup on a small tuple, two
output allocations and one driver launch; it never imports triton.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from lazytriton import dispatch, runtime
from lazytriton.kernels.flash_fwd import grid as flash_grid

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_INT32_MAX = 2**31 - 1
_DEVICE_TYPES = ("cuda", "cpu")  # ROCm tensors are "cuda" too
_CAUSAL_FAST = {False: "none", True: "top_left", "top_left": "top_left", "bottom_right": "bottom_right"}


class _Shape(NamedTuple):
    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def _fast_validate(q: Any, k: Any, v: Any, causal: Any, sm_scale: Any) -> tuple[_Shape, str, float] | None:
    """The common, valid call in as few tensor reads as possible; None sends it to ``_validate``."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    dtype, device = q.dtype, q.device
    if dtype not in _DTYPES or k.dtype != dtype or v.dtype != dtype or k.device != device or v.device != device:
        return None
    if device.type not in _DEVICE_TYPES:  # meta, mps, ...: _validate names the device
        return None
    qshape, kshape = q.shape, k.shape
    if len(qshape) != 4 or len(kshape) != 4 or v.shape != kshape:
        return None
    b, hq, sq, d = qshape
    bk, hk, sk, dk = kshape
    if bk != b or dk != d or not 0 < d <= dispatch.MAX_HEAD_DIM or hk == 0 or hq % hk:
        return None
    if (q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1) and d > 1:
        return None
    if sq > _INT32_MAX or sk > _INT32_MAX or b > 65535 or hq > 65535:
        return None
    mode = _CAUSAL_FAST.get(causal) if isinstance(causal, (bool, str)) else None
    if mode is None:
        return None
    if sm_scale is None:
        scale = 1.0 / math.sqrt(d)
    elif type(sm_scale) is float and math.isfinite(sm_scale):
        scale = sm_scale
    else:
        return None
    return _Shape(b, hq, hk, sq, sk, d), mode, scale


def _validate(q: Any, k: Any, v: Any, causal: Any, sm_scale: Any) -> tuple[_Shape, str, float]:
    fast = _fast_validate(q, k, v, causal, sm_scale)
    if fast is not None:
        return fast
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all three must be on one device")
    if q.device.type not in _DEVICE_TYPES:
        raise ValueError(f"q must be on a CUDA/ROCm GPU or on the CPU (interpreter), got {q.device}")
    b, hq, sq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    bk, hk, sk, dk = k.shape
    if bk != b:
        raise ValueError(f"k has batch {bk} but q has batch {b}")
    if dk != d:
        raise ValueError(f"k has head dim {dk} but q has head dim {d}")
    if not 1 <= d <= dispatch.MAX_HEAD_DIM:
        raise ValueError(f"head dim (q.shape[3]) must be in 1..{dispatch.MAX_HEAD_DIM}, got {d}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hk}) for GQA/MQA")
    if max(sq, sk) > _INT32_MAX or max(b, hq) > 65535:
        raise ValueError(f"seqlens must be < 2**31 and batch, heads <= 65535; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    mode = dispatch.causal_mode(causal)
    if sm_scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    else:
        scale = float(sm_scale)
        if not math.isfinite(scale):
            raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    return _Shape(b, hq, hk, sq, sk, d), mode, scale


def _kernel_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 shape: _Shape, offset: int) -> tuple[tuple[int, ...], bool, bool]:
    """flash_fwd's integer and pointer parameters in the description's order, and (aligned, index64).

    aligned: every pointer is 16-byte aligned and every outer stride a
    multiple of 16. index64: some tensor's last element lies 2**31 or more
    elements past its first, so offsets need 64-bit arithmetic.
    """
    qs0, qs1, qs2, _ = q.stride()
    ks0, ks1, ks2, _ = k.stride()
    vs0, vs1, vs2, _ = v.stride()
    os0, os1, os2, _ = out.stride()
    qp, kp, vp, op, lp = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    b, hq, hk, sq, sk, d = shape
    args = (qp, kp, vp, op, lp, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2,
            hq * sq, sq, hq // hk, sq, sk, d, offset)
    aligned = not (qp | kp | vp | op | lp | qs0 | qs1 | qs2 | ks0 | ks1 | ks2 | vs0 | vs1 | vs2 | os0 | os1 | os2) & 15
    extent = max((b - 1) * qs0 + (hq - 1) * qs1 + (sq - 1) * qs2, (b - 1) * os0 + (hq - 1) * os1 + (sq - 1) * os2,
                 (b - 1) * ks0 + (hk - 1) * ks1 + (sk - 1) * ks2, (b - 1) * vs0 + (hk - 1) * vs1 + (sk - 1) * vs2,
                 b * hq * sq - d) + d
    return args, aligned, extent > _INT32_MAX


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~0.3 µs; the public API ~3 µs


def _raw_stream(device_index: int) -> int:
    if _GET_RAW_STREAM is not None:
        return int(_GET_RAW_STREAM(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


def _gpu_plan(rt: runtime.Runtime, plan_key: tuple[Any, ...], q: torch.Tensor, shape: _Shape,
              causal: bool, aligned: bool, index64: bool) -> Any:
    variant = dispatch.flash_fwd_variant(dispatch.target_of_device(q.device), _DTYPES[q.dtype], shape.head_dim,
                                         causal, aligned, shape.seqlen_q, index64=index64, seqlen_k=shape.seqlen_k)
    kernel = rt.kernel(variant, q.device.index)
    plan = (kernel, int(variant.get("BLOCK_M")))
    rt.plans[plan_key] = plan
    return plan


def _run_interpreter(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     shape: _Shape, causal: bool, offset: int, scale: float) -> None:
    from lazytriton import compiler

    # Small tiles: the interpreter's cost is per program and per op, and tiles
    # smaller than the test shapes exercise the unmasked loop as well as the tail.
    padded = dispatch.padded_head_dim(shape.head_dim)
    block_m, block_n = 32, 16
    ints = _kernel_args(q, k, v, out, lse, shape, offset)[0]
    args = (q, k, v, out, lse, *ints[5:])
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": padded,
                  "EVEN_D": padded == shape.head_dim, "CAUSAL": causal}
    compiler.interpret("flash_fwd", flash_grid(shape.seqlen_q, shape.heads_q, shape.batch, block_m),
                       (*args, scale), constexprs)


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | str = False,
             sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention forward, FlashAttention-2 style.

    Args:
        q: queries, shape (batch, heads_q, seqlen_q, head_dim), the SDPA layout,
            float16, bfloat16 or float32, any strides with a contiguous last dim.
        k: keys, shape (batch, heads_k, seqlen_k, head_dim); heads_q must be a
            multiple of heads_k (GQA; heads_k = 1 is MQA).
        v: values, same shape as k.
        causal: False; True or "top_left" (key j is seen by query i when
            j <= i, SDPA's meaning); "bottom_right" (j <= i + seqlen_k -
            seqlen_q, FlashAttention's meaning). A query that sees no key gets
            output 0 and logsumexp -inf.
        sm_scale: the softmax scale; default 1/sqrt(head_dim).

    Returns:
        ``(out, lse)``: out has q's shape and dtype; lse is the float32
        natural-log logsumexp of the scaled scores, shape (batch, heads_q, seqlen_q).

    CUDA/ROCm tensors run a compiled kernel from the cache (compiled on first
    use if no tier holds it); CPU tensors run the same kernel through Triton's
    interpreter. Bad input raises TypeError/ValueError before any launch.
    Forward only: there is no backward yet.

    """
    shape, mode, scale = _validate(q, k, v, causal, sm_scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("attn_fwd has no backward yet; call it under torch.no_grad() or with detached inputs")
    is_causal = mode != "none"
    offset = shape.seqlen_k - shape.seqlen_q if mode == "bottom_right" else 0
    out = torch.empty_like(q)
    lse = torch.empty((shape.batch, shape.heads_q, shape.seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if shape.seqlen_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if q.device.type == "cpu":
        _run_interpreter(q, k, v, out, lse, shape, is_causal, offset, scale)
        return out, lse
    rt = runtime._runtime or runtime.get()
    args, aligned, index64 = _kernel_args(q, k, v, out, lse, shape, offset)
    # Tuning-table buckets are powers of two, so (n - 1).bit_length() tells
    # apart every pair of seqlens the table (or default_config) could treat differently.
    plan_key = (q.device.index, q.dtype, shape.head_dim, is_causal, aligned, index64,
                (shape.seqlen_q - 1).bit_length(), (shape.seqlen_k - 1).bit_length())
    plan = rt.plans.get(plan_key)
    if plan is None:
        plan = _gpu_plan(rt, plan_key, q, shape, is_causal, aligned, index64)
    kernel, block_m = plan
    kernel.launch(flash_grid(shape.seqlen_q, shape.heads_q, shape.batch, block_m), _raw_stream(q.device.index),
                  args, (scale,), _scratch_alloc)
    return out, lse


def _scratch_alloc(nbytes: int, device_index: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device_index))
