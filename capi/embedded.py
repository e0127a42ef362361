"""The Python half of liblazytriton.so: what its ``lt__py_*`` functions run.

The library's init code calls ``attach(ffi, lib)`` once, in the interpreter
the library embeds. The C half (``lazytriton.c``, ``lt_bwd.c``) has checked
every argument before any of these run; they turn a checked call into work:
settings, a plan (dispatch, cache, JIT) of one kernel, an attention forward
(FP8 included) or backward on host memory through the interpreter; the
decoding call, lt_flash_combine, and lt_prewarm with lt_cache_stats are
``embedded_kvcache``'s, ``embedded_combine``'s and ``embedded_prewarm``'s,
which ``attach`` binds too. The kernels' bindings decide everything about a kernel (variants,
checks, packing); nothing here repeats them.

Every function is wrapped so that no exception, not even ``SystemExit``,
leaves it: each becomes a status and a message (``lt_last_error``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lazytriton.capi.common import (
    COMPILE,
    CUDA,
    INVALID_ARGUMENT,
    KERNEL_NOT_FOUND,
    NO_GPU,
    OK,
    PYTHON,
    UNSUPPORTED,
    CapiError,
    check_entry_layout,
    fill_scratch,
    host_tensor,
)

log = logging.getLogger("lazytriton.capi")

DTYPE_NAMES = {1: "fp16", 2: "bf16", 3: "fp32", 5: "e4m3", 6: "e5m2"}
E4M3 = 5  # LT_DTYPE_FP8_E4M3: the FP8 forward's q, k and v (flash_fwd_fp8)
E5M2 = 6  # LT_DTYPE_FP8_E5M2: the FP8 forward's too, and a float8 KV cache's
FP8_CODES = {E4M3: "e4m3", E5M2: "e5m2"}  # the FP8 forward's dtypes (flash_fwd_fp8's variant dtype)
_LOG_LEVELS = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}
_CAUSAL: dict[int, bool | str] = {0: False, 1: "top_left", 2: "bottom_right"}

# lt__plan_request.kernel (LT__KERNEL_* in lazytriton.c): the kernels C launches.
KERNELS = {0: "flash_fwd", 1: "flash_bwd_dq", 2: "flash_bwd_dkdv", 3: "flash_bwd_dsinks"}

_ffi: Any = None
_lib: Any = None


def classify(exc: BaseException) -> tuple[int, str]:
    """The lt_status and message for an exception raised while serving a C call."""
    from lazytriton.compiler import CompileError
    from lazytriton.config import SettingsError
    from lazytriton.driver import DriverError
    from lazytriton.runtime import KernelNotFound

    if isinstance(exc, CapiError):
        return exc.status, str(exc)
    if isinstance(exc, SettingsError):  # a bad LAZYTRITON_* variable: the caller's setting, not a failure
        return INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KernelNotFound):
        return KERNEL_NOT_FOUND, str(exc)
    if isinstance(exc, CompileError):
        return COMPILE, str(exc)
    if isinstance(exc, DriverError):
        return CUDA, str(exc)
    if isinstance(exc, (ValueError, TypeError)):
        return INVALID_ARGUMENT, str(exc)
    return PYTHON, f"{type(exc).__name__} in the embedded Python: {exc}"


def _guarded(fn: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(fn)
    def call(*args: Any) -> int:
        try:
            return fn(*args)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: never leave the host's call
            try:
                status, message = classify(exc)
            except BaseException as inner:
                status, message = PYTHON, f"{type(exc).__name__}: {exc} (then {type(inner).__name__}: {inner})"
            log.debug("C API call %s failed", fn.__name__, exc_info=True)
            set_error(message)
            return status

    return call


def set_error(message: str) -> None:
    """Set the calling thread's last error message (``lt_last_error``)."""
    _lib.lt__set_error(message.encode("utf-8", "replace")[:2047])


def _text(pointer: Any, name: str) -> str | None:
    if pointer == _ffi.NULL:
        return None
    try:
        return str(_ffi.string(pointer).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8: {exc}") from None


# ---------------------------------------------------------------------------
# lt_init


def _expanded(path: str, name: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded; a ValueError naming ``name`` when it cannot be."""
    try:
        return str(Path(path).expanduser())
    except RuntimeError as exc:  # "~user" of no user here: pathlib's "Could not determine home directory."
        raise ValueError(f"{name} is {path!r}, whose {path.split('/', 1)[0]!r} names no home directory here "
                         f"({exc})") from None


def settings_of(cfg: Any) -> dict[str, Any]:
    """configure() keyword arguments from an lt_config (pure, given the struct)."""
    changes: dict[str, Any] = {}
    cache_dir = _text(cfg.cache_dir, "config.cache_dir")
    if cache_dir is not None:
        if not cache_dir.strip():
            raise ValueError("config.cache_dir is an empty string; pass NULL for the default")
        changes["cache_dir"] = _expanded(cache_dir, "config.cache_dir")
    images = _text(cfg.images, "config.images")
    if images is not None:
        changes["images"] = [_expanded(p, "config.images") for p in images.split(":") if p.strip()]
    if cfg.log_level != 0:
        if cfg.log_level not in _LOG_LEVELS:
            raise ValueError(f"config.log_level is {cfg.log_level}; expected LT_LOG_DEFAULT (0), LT_LOG_DEBUG (10), "
                             "LT_LOG_INFO (20), LT_LOG_WARNING (30), LT_LOG_ERROR (40) or LT_LOG_CRITICAL (50)")
        changes["log_level"] = _LOG_LEVELS[cfg.log_level]
    if cfg.jit not in (0, 1, 2):
        raise ValueError(f"config.jit is {cfg.jit}; expected LT_JIT_DEFAULT (0), LT_JIT_ON (1) or LT_JIT_OFF (2)")
    if cfg.jit:
        changes["jit"] = cfg.jit == 1
    return changes


def init(cfg: Any) -> int:
    from lazytriton import config, runtime

    changes: dict[str, Any] = {}
    if cfg != _ffi.NULL:
        changes = settings_of(cfg)
        url = _text(cfg.shared_tier, "config.shared_tier")
        if url:
            changes["shared"] = url
    config.reset()  # start from the environment, as a fresh process would
    config.settings()  # a bad LAZYTRITON_* variable is reported here, by lt_init
    if changes:
        config.configure(**changes)
    runtime.get()
    return OK


# ---------------------------------------------------------------------------
# lt_attn_fwd on host memory


def _host_tensor(view: Any) -> Any:
    """A torch tensor over the caller's host memory (no copy), with the view's sizes and strides."""
    return host_tensor(_ffi, view)


def _is_varlen(p: Any) -> bool:
    """Whether a (version 2) params struct describes packed sequences (lt_check.c's lt__wants_varlen)."""
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    return bool(cu_q.data != _ffi.NULL or cu_k.data != _ffi.NULL or cu_q.ndim or cu_k.ndim)


def _features(p: Any) -> tuple[tuple[int, int], float]:
    """A forward or backward struct's (window_left, window_right) and softcap.

    Version 3 fields: lt__fwd_prepare and lt__bwd_prepare give an older struct -1, -1 and 0.
    """
    return (int(p.window_left), int(p.window_right)), float(p.softcap)


def _chunk(p: Any) -> int:
    """A forward or backward struct's attention_chunk (0: off).

    A version 6 field: lt__fwd_prepare and lt__bwd_prepare give an older struct 0.
    """
    return int(p.attention_chunk)


def _used(view: Any) -> Any:
    """An optional tensor (seqused_q, seqused_k, sinks, dsinks) as a tensor, or None when absent (lt__given).

    lt__fwd_prepare and lt__bwd_prepare leave the fields an older struct lacks absent.
    """
    return None if view.data == _ffi.NULL and not view.ndim else _host_tensor(view)


def _varlen_call(p: Any, q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """(cu_seqlens_q, cu_seqlens_k, the varlen binding's checked call), the values of the lengths included.

    With seqused_q/seqused_k (version 4 fields; lt__fwd_prepare and lt__bwd_prepare leave an older struct's
    absent), the call carries them.
    """
    from lazytriton.kernels.flash_fwd import varlen

    cu_q, cu_k = _host_tensor(p.cu_seqlens_q), _host_tensor(p.cu_seqlens_k)
    scale = None if math.isnan(p.sm_scale) else float(p.sm_scale)
    window, softcap = _features(p)
    call = varlen.check(q, k, v, cu_q, cu_k, int(p.max_seqlen_q), int(p.max_seqlen_k), p.causal == 2, scale,
                        window=window, softcap=softcap, values=True, seqused_q=_used(p.seqused_q),
                        seqused_k=_used(p.seqused_k), sinks=_used(p.sinks), attention_chunk=_chunk(p))
    return cu_q, cu_k, call


def _descales(p: Any) -> tuple[Any, Any, Any]:
    """A version 7 struct's q_descale, k_descale, v_descale: None when absent (1.0), as an older struct's are."""
    return _used(p.q_descale), _used(p.k_descale), _used(p.v_descale)


def attn_fwd_fp8_cpu(p: Any, q: Any, k: Any, vt: Any, out: Any, lse: Any) -> int:
    """lt_attn_fwd of float8 q, k and v (version 7; e4m3 or e5m2) on host memory: the FP8 forward's checks and run.

    ``vt``: v as the caller gives it, transposed ((batch, heads_k, head_dim_v, seqlen_k), packed (heads_k,
    head_dim_v, total_k)); the Python calls take v in rows, so it is viewed back and copied contiguous (the
    binding writes its own transpose, whose values the kernel reads: the same bits as the Python call's).
    """
    import torch

    from lazytriton import flash
    from lazytriton.kernels.flash_fwd import fp8

    scale = None if math.isnan(p.sm_scale) else float(p.sm_scale)
    window, softcap = _features(p)
    given = _descales(p)
    if _is_varlen(p):
        v = vt.permute(2, 0, 1).contiguous()
        cu_q, cu_k = _host_tensor(p.cu_seqlens_q), _host_tensor(p.cu_seqlens_k)
        vc = fp8.checked_varlen(q, k, v, cu_q, cu_k, int(p.max_seqlen_q), int(p.max_seqlen_k), p.causal == 2, scale,
                                window, softcap, _used(p.seqused_q), _used(p.seqused_k), _chunk(p), given, {},
                                values=True)
        with torch.no_grad():
            result, logsumexp = fp8.varlen_forward(q, k, v, cu_q, cu_k, vc, given)
    else:
        with torch.no_grad():
            result, logsumexp = flash.attn_fwd(q, k, vt.transpose(2, 3).contiguous(), causal=_CAUSAL[p.causal],
                                               sm_scale=scale, window_size=window, softcap=softcap,
                                               attention_chunk=_chunk(p), q_descale=given[0], k_descale=given[1],
                                               v_descale=given[2])
    out.copy_(result)
    lse.copy_(logsumexp)
    return OK


def attn_fwd_cpu(p: Any) -> int:
    import torch

    from lazytriton import flash

    q, k, v, out, lse = (_host_tensor(t) for t in (p.q, p.k, p.v, p.out, p.lse))
    if p.q.dtype in FP8_CODES:
        return attn_fwd_fp8_cpu(p, q, k, v, out, lse)
    scale = None if math.isnan(p.sm_scale) else float(p.sm_scale)
    if _is_varlen(p):
        from lazytriton.kernels.flash_fwd import varlen

        cu_q, cu_k, call = _varlen_call(p, q, k, v)
        with torch.no_grad():
            result, logsumexp = varlen.forward(q, k, v, cu_q, cu_k, call)
        out.copy_(result)
        lse.copy_(logsumexp)
        return OK
    window, softcap = _features(p)
    with torch.no_grad():
        result, logsumexp = flash.attn_fwd(q, k, v, causal=_CAUSAL[p.causal], sm_scale=scale, window_size=window,
                                           softcap=softcap, sinks=_used(p.sinks), attention_chunk=_chunk(p))
    out.copy_(result)
    lse.copy_(logsumexp)
    return OK


def attn_bwd_cpu(p: Any) -> int:
    """lt_attn_bwd on host memory: the binding's checks, then its interpreter run, writing the caller's gradients.

    The gradients are the caller's memory (no copy). The interpreter run keeps
    its own delta, so the caller's workspace is not touched here. With sinks
    (a version 5 struct), dsinks, when given, is their gradient from that delta
    (the bindings' ``sinks_backward``).
    """
    import torch

    from lazytriton.kernels.flash_bwd import binding as bwd
    from lazytriton.kernels.flash_fwd import binding as fwd
    from lazytriton.kernels.flash_fwd import sinks as fwd_sinks

    q, k, v, out, lse, dout, dq, dk, dv = (_host_tensor(t) for t in (p.q, p.k, p.v, p.out, p.lse, p.dout, p.dq,
                                                                        p.dk, p.dv))
    sinks, dsinks = _used(p.sinks), _used(p.dsinks)
    if _is_varlen(p):
        from lazytriton.kernels.flash_fwd import varlen

        cu_q, cu_k, vcall = _varlen_call(p, q, k, v)
        varlen.check_grad(q, out, lse, dout, vcall.call.head_dim_v)
        with torch.no_grad():
            if dsinks is None:
                grads = varlen.backward(q, k, v, out, lse, dout, cu_q, cu_k, vcall)
            else:
                grads, sinks_grad = varlen.sinks_backward(q, k, v, out, lse, dout, cu_q, cu_k, vcall)
                dsinks.copy_(sinks_grad)
            for mine, got in zip((dq, dk, dv), grads, strict=True):
                mine.copy_(got)
        return OK
    scale = None if math.isnan(p.sm_scale) else float(p.sm_scale)
    window, softcap = _features(p)
    call = fwd.with_chunk(fwd_sinks.with_sinks(fwd.check(q, k, v, _CAUSAL[p.causal], scale, window=window,
                                                         softcap=softcap), q, sinks), _chunk(p))
    bwd.check_grad(q, out, lse, dout, call)
    with torch.no_grad():
        if dsinks is None:
            bwd.run_interpreter(q, k, v, out, lse, dout, bwd.Grads(dq, dk, dv), call)
            return OK
        grads, sinks_grad = bwd.sinks_backward(q, k, v, out, lse, dout, call)
        for mine, got in zip((dq, dk, dv, dsinks), (*grads, sinks_grad), strict=True):
            mine.copy_(got)
    return OK


# ---------------------------------------------------------------------------
# Plans


def int_params(kernel: str) -> tuple[str, ...]:
    """The integer parameters lazytriton.c passes to ``kernel``, in order (its binding's)."""
    if kernel in ("flash_fwd_fp8", "flash_fwd_fp8_gluon"):  # one host ABI (fp8.py launches either)
        from lazytriton.kernels.flash_fwd import fp8

        return fp8.INT_PARAMS
    if kernel == "flash_fwd":
        from lazytriton.kernels.flash_fwd import binding as fwd

        return fwd.INT_PARAMS
    if kernel == "flash_bwd_dsinks":
        from lazytriton.kernels import flash_bwd_dsinks

        return flash_bwd_dsinks.INT_PARAMS
    from lazytriton.kernels.flash_bwd import binding as bwd

    return {"flash_bwd_dq": bwd.DQ_INT_PARAMS, "flash_bwd_dkdv": bwd.DKDV_INT_PARAMS}[kernel]


def check_launch_layout(entry: Any, kernel: str = "flash_fwd") -> None:
    """Refuse an entry whose parameters lazytriton.c would not pass correctly.

    lazytriton.c passes each kernel's integer parameters as its binding's
    ``c_initializer`` lists them (tests/test_binding.py and tests/test_capi.py
    check the C text against it), then the three floats (sm_scale, softcap,
    dropout_p), or none for flash_bwd_dsinks; this checks the entry agrees.
    The forward's kernels (flash_fwd, the FP8 forward's two) get their scratch memory from the plan's launch
    (lt_scratch.c); the backward's get NULL, so an entry of theirs needing some is refused.
    """
    if kernel == "flash_bwd_dsinks":  # pointer loads only: no descriptors to refuse
        check_entry_layout(entry, len(int_params(kernel)), ())
        return
    if kernel in ("flash_fwd_fp8", "flash_fwd_fp8_gluon"):
        check_entry_layout(entry, len(int_params(kernel)), ("fp32", "fp32"), scratch=True)
        return
    kinds = tuple(entry.arg_types)
    if getattr(entry, "tensordesc_meta", ()) or any(kind.startswith("tensordesc") for kind in kinds):
        raise CapiError(UNSUPPORTED, f"entry {entry.key} takes host tensor descriptors, which no kernel the C API "
                                     "plans takes (lt_kernel_launch encodes them)")
    check_entry_layout(entry, len(int_params(kernel)), ("fp32", "fp32", "fp32"), scratch=kernel == "flash_fwd")


def plan_variant(kernel: str, capability: int, dtype_code: int, head_dim: int, causal: bool, aligned: bool,
                 index64: bool, seqlen_q: int, seqlen_k: int, varlen: bool = False, head_dim_v: int = 0,
                 seq16: bool | None = None, window: bool = False, softcap: bool = False,
                 seqused: tuple[bool, bool] = (False, False), sinks: bool = False, chunk: bool = False) -> Any:
    """The variant a C plan of ``kernel`` launches (pure): the kernel's binding decides, as for a Python call.

    ``varlen``: packed sequences, whose seqlens are max_seqlen_q/max_seqlen_k (as the varlen binding's),
    with ``seqused`` (SEQUSED_Q, SEQUSED_K: their used lengths);
    ``head_dim_v``: v's head dim (0 or ``head_dim``: the same).
    ``seq16``: the backward's SEQ16 as lt_bwd.c found it (bit 1 of the request's ``aligned``); None:
    dispatch's rule for the seqlens. ``window``, ``softcap``: the WINDOW and SOFTCAP variants.
    ``sinks``: attention sinks (SINKS, flash_fwd's only: the backward's kernels read them through lse).
    ``chunk``: FlashAttention-3's attention_chunk (CHUNK, on all three kernels).
    ``dtype_code`` e4m3 or e5m2 (``FP8_CODES``): flash_fwd's FP8 kernel, flash_fwd_fp8 (dispatch's
    ``fp8_variant``: a ValueError for a target without FP8 tensor cores, or for sinks); the plan holds
    ``fp8_twin``'s flash_fwd_fp8_gluon beside it for the calls that fit that kernel's tiles.
    """
    if kernel == "flash_bwd_dsinks":  # the sinks' gradient: it reads float32 rows, one config
        from lazytriton.kernels import flash_bwd_dsinks
        from lazytriton.target import Target as CudaTarget

        return flash_bwd_dsinks.variant(CudaTarget("cuda", str(capability), 32), varlen, varlen and seqused[0],
                                        index64)
    if sinks and kernel != "flash_fwd":  # attention.SINKS_KERNELS
        raise ValueError(f"plan request for {kernel} with sinks: only flash_fwd has a SINKS variant (the backward "
                         "reads them through lse)")
    dim_v = 0 if head_dim_v == head_dim else head_dim_v
    import torch

    from lazytriton.kernels.flash_fwd import binding as fwd
    from lazytriton.target import Target

    target = Target("cuda", str(capability), 32)
    if dtype_code in FP8_CODES:
        if kernel != "flash_fwd":
            raise ValueError(f"plan request for {kernel} with {FP8_CODES[dtype_code]} tensors: the FP8 forward has "
                             "no backward")
        from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

        return fwd_dispatch.flash_fwd_variant(target, FP8_CODES[dtype_code], head_dim, causal, aligned, seqlen_q,
                                              index64=index64, seqlen_k=seqlen_k, window=window, softcap=softcap,
                                              head_dim_v=dim_v, varlen=varlen, seqused_q=varlen and seqused[0],
                                              seqused_k=varlen and seqused[1], sinks=sinks, chunk=chunk)
    dtype = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}[dtype_code]
    shape = fwd.Shape(1, 1, 1, seqlen_q, seqlen_k, head_dim)  # dispatch reads no batch or heads
    if varlen:
        from lazytriton.kernels import dispatch

        return dispatch.kernel_variant(kernel, target, fwd.DTYPES[dtype], head_dim, causal, aligned, seqlen_q,
                                       seqlen_k, index64=index64, varlen=True, head_dim_v=dim_v, window=window,
                                       softcap=softcap, seqused_q=seqused[0], seqused_k=seqused[1], sinks=sinks,
                                       chunk=chunk)
    if kernel == "flash_fwd":
        return fwd.variant(target, dtype, shape, causal, aligned, index64, window, softcap, head_dim_v=dim_v,
                           sinks=sinks, chunk=chunk)
    from lazytriton.kernels.flash_bwd import binding as bwd

    dq, dkdv = bwd.variants(target, dtype, shape, causal, aligned, index64, window, softcap, head_dim_v=dim_v,
                            seq16=seq16, chunk=chunk)
    return dq if kernel == "flash_bwd_dq" else dkdv


def fp8_twin(capability: int, dtype_code: int, head_dim: int, head_dim_v: int, causal: bool, aligned: bool,
             index64: bool, features: bool) -> Any:
    """The flash_fwd_fp8_gluon variant an FP8 plan holds beside flash_fwd_fp8's, or None (pure).

    ``fp8.variant`` serves it where ``fp8_gluon.fits`` holds and ``default_variant`` gives one (sm_90, aligned,
    32-bit offsets; ``BY_DEFAULT`` on and a ``TABLE`` row), at the head dims the variant reading V's keys in order
    serves (``fp8_gluon.served_head_dims(False)``); the part of ``fits`` a plan's shape class cannot see
    (the seqlens dividing its tiles, a positive scale, a causal offset >= 0) is decided per call in C
    (lt_scratch.c's ``lt__twin_fits``). ``features``: a window, softcap, attention_chunk or packed sequences.
    Without V_OPERAND_ORDER: the C API's callers give V transposed with its keys in order.
    """
    from lazytriton.kernels.flash_fwd import fp8_gluon
    from lazytriton.target import Target

    tiles = fp8_gluon.default_tiles(head_dim, causal, operand_order=False)
    if tiles is None or features or dtype_code not in FP8_CODES or head_dim_v not in (0, head_dim):
        return None
    return fp8_gluon.default_variant(str(Target("cuda", str(capability), 32)), FP8_CODES[dtype_code], head_dim,
                                     causal, aligned, index64, tiles[0], tiles[1], operand_order=False)


def _plan_twin(req: Any) -> None:
    """An FP8 forward's request: ``fp8_twin``'s kernel, loaded, into ``req.twin`` (function 0 where none)."""
    from lazytriton import runtime

    features = bool(req.window or req.softcap or req.chunk or req.varlen)
    twin = fp8_twin(req.capability, req.dtype, req.head_dim, req.head_dim_v, bool(req.causal), bool(req.aligned & 1),
                    bool(req.index64), features)
    if twin is None:
        return
    kernel = runtime.get().kernel(twin, req.device_index)
    check_launch_layout(kernel.entry, twin.kernel)
    req.twin.function = int(_ffi.cast("uintptr_t", kernel.function))
    req.twin.block_threads, req.twin.shared_bytes = kernel.block, kernel.shared
    req.twin.block_m, req.twin.block_n = int(twin.get("BLOCK_M")), int(twin.get("BLOCK_N"))
    req.twin.n_hidden = len(kernel.entry.hidden_args)
    fill_scratch(req.twin.scratch, kernel.entry)
    log.info("C plan's twin for the calls that fit its tiles: %s", twin)


def plan(req: Any) -> int:
    from lazytriton import runtime

    name = KERNELS.get(req.kernel)
    if name is None:
        raise CapiError(INVALID_ARGUMENT, f"plan request for kernel {req.kernel}; expected one of {KERNELS}")
    # req.varlen: bit 0 packed sequences, bits 1 and 2 their used lengths (lazytriton.c's lt__varlen_bits)
    variant = plan_variant(name, req.capability, req.dtype, req.head_dim, bool(req.causal), bool(req.aligned & 1),
                           bool(req.index64), req.seqlen_q, req.seqlen_k, bool(req.varlen & 1), req.head_dim_v,
                           seq16=bool(req.aligned & 2), window=bool(req.window), softcap=bool(req.softcap),
                           seqused=(bool(req.varlen & 2), bool(req.varlen & 4)), sinks=bool(req.sinks),
                           chunk=bool(req.chunk))
    kernel = runtime.get().kernel(variant, req.device_index)
    check_launch_layout(kernel.entry, variant.kernel)
    req.function = int(_ffi.cast("uintptr_t", kernel.function))
    req.block_threads = kernel.block
    req.shared_bytes = kernel.shared
    req.block_m = int(variant.get("BLOCK_N" if name == "flash_bwd_dkdv" else "BLOCK_M"))  # the grid's x tile
    req.n_hidden = len(kernel.entry.hidden_args)
    if name == "flash_fwd":  # the forward's plans pass scratch memory (lt_scratch.c); the backward's NULL
        fill_scratch(req.scratch, kernel.entry)
    if name == "flash_fwd" and req.dtype in FP8_CODES:
        _plan_twin(req)
    text = str(variant).encode()[:511]
    _ffi.memmove(req.variant, text, len(text))
    log.info("C plan for %s: block %d threads, %d bytes shared", variant, kernel.block, kernel.shared)
    return OK


# ---------------------------------------------------------------------------


def _log_to_stderr() -> None:
    """A host program has configured no Python logging: give lazytriton's logger a stderr handler."""
    logger = logging.getLogger("lazytriton")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("lazytriton: %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def attach(ffi: Any, lib: Any) -> None:
    """Bind the library's ``lt__py_*`` functions to this module (called by its init code)."""
    global _ffi, _lib
    _ffi, _lib = ffi, lib
    for name, value in (("LT_OK", OK), ("LT_ERROR_INVALID_ARGUMENT", INVALID_ARGUMENT), ("LT_ERROR_NO_GPU", NO_GPU),
                        ("LT_ERROR_UNSUPPORTED", UNSUPPORTED), ("LT_ERROR_KERNEL_NOT_FOUND", KERNEL_NOT_FOUND),
                        ("LT_ERROR_COMPILE", COMPILE), ("LT_ERROR_CUDA", CUDA), ("LT_ERROR_PYTHON", PYTHON)):
        if getattr(lib, name) != value:
            raise RuntimeError(f"{name} is {getattr(lib, name)} in lazytriton.h but {value} in capi/embedded.py")
    _log_to_stderr()
    for name, fn in (("lt__py_init", init), ("lt__py_attn_fwd_cpu", attn_fwd_cpu),
                     ("lt__py_attn_bwd_cpu", attn_bwd_cpu), ("lt__py_plan", plan)):
        ffi.def_extern(name=name, error=PYTHON)(_guarded(fn))
    from lazytriton.capi import embedded_combine, embedded_kvcache, embedded_prewarm

    embedded_kvcache.attach(ffi, _guarded)
    embedded_combine.attach(ffi, _guarded)
    embedded_prewarm.attach(ffi, _guarded)
