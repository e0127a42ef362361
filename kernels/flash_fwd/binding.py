"""Host side of flash_fwd: the one owner of this kernel's launch ABI.

Everything that launches ``flash_fwd`` (the torch op, the public functions,
``lazytriton tune``, the C API, benchmarks) goes through here:

- ``check`` turns the caller's tensors and options into one ``Call`` (a shape
  record, the causal mode and offset, the softmax scale, the sliding window
  and the softcap), or raises a ``TypeError``/``ValueError`` naming the
  argument before anything runs;
- ``memo_key`` derives the hot path's memo key from dispatch's own seqlen
  bucketing (``tuning.bucket_index``), so the memo never serves a call that
  dispatch would have given another variant;
- ``pack`` is generated from the kernel's parameter description
  (``FLASH_FWD.params``) and ``PARAM_SOURCES`` into ``pack_generated.py``
  (``pack_module_text``, checked by a test); the C launcher's argument
  layout (``capi/lazytriton.c``) is tested against ``c_initializer()``, which
  comes from the same table;
- ``grid`` and ``interpreter_constexprs`` for the two ways of running it;
- ``forward`` allocates the outputs and runs the kernel: a cached binary on a
  GPU, Triton's interpreter on the CPU.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from lazytriton import geometry, launch, machine, runtime, tuning
from lazytriton.kernels.arguments import MAX_CHUNK, check_chunk, shown
from lazytriton.kernels.flash_fwd import FLASH_FWD, SEQUSED_POINTERS, SINKS_POINTERS, VARLEN_POINTERS, pack_generated
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import grid as _grid
from lazytriton.kernels.flash_fwd import sinks as _sinks
from lazytriton.kernels.flash_fwd.names import NAMES, Names
from lazytriton.kernels.flash_fwd.score_mods import mod_tensors
from lazytriton.record import NamedTuple
from lazytriton.variant import Variant

log = logging.getLogger("lazytriton.flash")

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# The FP8 forward's dtypes (``flash_fwd.fp8``: its own kernel, flash_fwd_fp8); ``check(fp8=True)`` takes them.
FP8_DTYPES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
INT32_MAX = 2**31 - 1
MAX_GRID_YZ = 65535  # grid y (heads) and z (batch) limits of CUDA and HIP
DEVICE_TYPES = ("cuda", "cpu")  # ROCm tensors are "cuda" too
_CAUSAL_FAST = {False: "none", True: "top_left", "top_left": "top_left", "bottom_right": "bottom_right"}

# Above this many query-key-dim products (sq * sk * d * batch * heads) a CPU
# call through the interpreter takes minutes (2x16x4096x128: over 200 s on the
# 2-core CI machine); warn once, since the CPU path is for checking, not speed.
SLOW_CPU_WORK = 2**31


class Shape(NamedTuple):
    """The sizes of one call, in the kernel's (batch, heads, seqlen, head_dim) terms."""

    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int


class Call(NamedTuple):
    """A checked call: its shape, causal mode, the kernel's causal offset, softmax scale, window and softcap.

    The window is the kernel's: (-1, -1) when off, else both sides bounded
    (a side the caller left unbounded is max(seqlen_q, seqlen_k), which
    bounds nothing), with a causal call's right side 0 (FlashAttention-2's
    rule). ``softcap`` 0.0 is off.
    """

    shape: Shape
    causal: str  # "none", "top_left" or "bottom_right"
    offset: int  # key j is seen by query i when j <= i + offset (causal), and inside the window around i + offset
    scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    # The score modifications (``with_mods``): ALiBi slopes (float32, (heads_q,) or
    # (batch, heads_q)), the additive bias as a (batch, heads_q, seqlen_q, seqlen_k)
    # view of q's dtype (0 strides where it broadcasts), dropout's probability and
    # its Philox [seed, offset] int64 tensor on q's device.
    alibi: Any = None
    bias: Any = None
    dropout_p: float = 0.0
    philox: Any = None
    # v's head dim where it differs from q's and k's (``shape.head_dim``), else 0: out, dout and
    # dv then have this last dim (DeepSeek's MLA: q/k 192, v 128).
    head_dim_v: int = 0
    # Attention sinks (``sinks.with_sinks``): float32 (heads_q,) on q's device, one logit a query
    # head in every row's denominator (the kernels' SINKS), or None.
    sinks: Any = None
    # FlashAttention-3's attention_chunk (``with_chunk``): query i sees the keys j of its own chunk,
    # j // attention_chunk == (i + offset) // attention_chunk (the kernels' CHUNK); 0 is off.
    attention_chunk: int = 0

    @property
    def dv(self) -> int:
        """The head dim of v (and out)."""
        return self.head_dim_v or self.shape.head_dim

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0

    @property
    def capped(self) -> bool:
        return self.softcap > 0.0

    @property
    def mods(self) -> tuple[bool, bool, bool]:
        """The flags (ALIBI, BIAS, DROPOUT) of the kernel this call needs."""
        return (self.alibi is not None, self.bias is not None, self.dropout_p > 0.0)

    @property
    def sunk(self) -> bool:
        """The kernels' SINKS flag: the call has attention sinks."""
        return self.sinks is not None

    @property
    def chunked(self) -> bool:
        """The kernels' CHUNK flag: the call has FlashAttention-3's attention_chunk."""
        return self.attention_chunk > 0


# ---------------------------------------------------------------------------
# Checks


def _check_tensor(name: str, t: object, fp8: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (FP8_DTYPES if fp8 else DTYPES):
        raise TypeError(f"{name} must be {'float8_e4m3fn or float8_e5m2' if fp8 else 'float16, bfloat16 or float32'}, "
                        f"got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def _fast_check(q: Any, k: Any, v: Any, causal: Any, scale: Any) -> Call | None:
    """The common, valid call in as few tensor reads as possible; None sends it to the full check."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    dtype, device = q.dtype, q.device
    if dtype not in DTYPES or k.dtype != dtype or v.dtype != dtype or k.device != device or v.device != device:
        return None
    if device.type not in DEVICE_TYPES:  # meta, mps, ...: the full check names or allows the device
        return None
    qshape, kshape = q.shape, k.shape
    if len(qshape) != 4 or len(kshape) != 4 or v.shape != kshape:
        return None
    b, hq, sq, d = qshape
    bk, hk, sk, dk = kshape
    if bk != b or dk != d or not 0 < d <= geometry.MAX_HEAD_DIM or hk == 0 or hq % hk:
        return None
    if (q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1) and d > 1:
        return None
    if sq > INT32_MAX or sk > INT32_MAX or b > MAX_GRID_YZ or hq > MAX_GRID_YZ:
        return None
    mode = _CAUSAL_FAST.get(causal) if isinstance(causal, (bool, str)) else None
    if mode is None:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif type(scale) is not float or not math.isfinite(scale):
        return None
    return Call(Shape(b, hq, hk, sq, sk, d), mode, sk - sq if mode == "bottom_right" else 0, scale)


NO_WINDOW = (-1, -1)
NO_MODS = (False, False, False)  # Call.mods of a call without ALiBi, bias or dropout
# With a window, the kernels compute row + offset +- window in 32 bits.
MAX_WINDOWED_SEQLEN = 2**29


def check(q: Any, k: Any, v: Any, causal: Any = False, scale: Any = None, names: Names = NAMES,
          window: Any = NO_WINDOW, softcap: Any = 0.0, fp8: bool = False) -> Call:
    """The checked call, or a TypeError/ValueError naming the argument (tensors in (B, H, S, D) order).

    ``causal``: False/None, True (= "top_left"), "top_left" or "bottom_right".
    ``scale``: the softmax scale, default 1/sqrt(head_dim). Tensors may be on
    a GPU, the CPU or the meta device (for shape inference). ``window``:
    FlashAttention-2's ``window_size`` (left, right), -1 for unbounded;
    ``softcap``: 0.0 (off) or the cap of the scaled scores. ``fp8``: the
    tensors must be float8_e4m3fn or float8_e5m2, all three one (``FP8_DTYPES``: the FP8 forward's), not
    float16, bfloat16 or float32.
    """
    call = _check_tensors(q, k, v, causal, scale, names, fp8)
    if type(window) is tuple and window == NO_WINDOW and type(softcap) is float and softcap == 0.0:
        return call
    return with_features(call, window, softcap, names)


def with_features(call: Call, window: Any, softcap: Any, names: Names = NAMES) -> Call:
    """``call`` with its sliding window and softcap checked and in the kernel's terms.

    FlashAttention-2's rule: key j is visible to query i when
    ``i + offset - left <= j <= i + offset + right``, offset = seqlen_k -
    seqlen_q (bottom-right; a top-left causal call keeps offset 0), -1
    unbounded; causal means right = 0.
    """
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"{names.window} must be a pair of ints (left, right), got {shown(window)}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"{names.window} sizes must be -1 (unbounded) or >= 0, got {tuple(window)!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{names.softcap} must be a float, got {type(softcap).__name__}")
    cap = float(softcap)
    if not (math.isfinite(cap) and cap >= 0.0):
        raise ValueError(f"{names.softcap} must be a finite float >= 0 (0 is off), got {softcap!r}")
    _, _, _, sq, sk, _ = call.shape
    if call.causal != "none":
        right = 0
    if left < 0 and (right < 0 or call.causal != "none"):  # no window beyond the causal mask
        return call._replace(softcap=cap)
    if max(sq, sk) >= MAX_WINDOWED_SEQLEN:
        raise ValueError(f"with {names.window} set, seqlens must be below {MAX_WINDOWED_SEQLEN}, got seqlen_q {sq}, "
                         f"seqlen_k {sk}")
    full = max(sq, sk, 1)  # reaches every key from every query: no bound
    offset = 0 if call.causal == "top_left" else sk - sq
    return call._replace(offset=offset, window_left=min(left, full) if left >= 0 else full,
                         window_right=min(right, full) if right >= 0 else full, softcap=cap)


def with_chunk(call: Call, attention_chunk: Any, name: str = "attention_chunk") -> Call:
    """``call`` with FlashAttention-3's attention_chunk checked and in the kernel's terms.

    Query i sees key j when j // C == p // C (floor division) for p = i +
    offset, offset = seqlen_k - seqlen_q (bottom-right; a top-left causal call
    keeps offset 0), on top of the causal mask and the window. 0 is off.
    """
    chunk = check_chunk(name, attention_chunk)
    if chunk == 0:
        return call
    _, _, _, sq, sk, _ = call.shape
    if max(sq, sk) >= MAX_WINDOWED_SEQLEN:
        raise ValueError(f"with {name} set, seqlens must be below {MAX_WINDOWED_SEQLEN}, got seqlen_q {sq}, "
                         f"seqlen_k {sk}")
    offset = 0 if call.causal == "top_left" else sk - sq
    return call._replace(offset=offset, attention_chunk=min(chunk, MAX_CHUNK))


def _check_tensors(q: Any, k: Any, v: Any, causal: Any, scale: Any, names: Names, fp8: bool = False) -> Call:
    fast = None if fp8 else _fast_check(q, k, v, causal, scale)
    if fast is not None:
        return fast
    q = _check_tensor(names.q, q, fp8)
    for name, t in ((names.k, k), (names.v, v)):  # a dtype unlike q's is named as such
        if isinstance(t, torch.Tensor) and isinstance(q, torch.Tensor) and t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {names.q} has {q.dtype}; all three must match")
    k, v = _check_tensor(names.k, k, fp8), _check_tensor(names.v, v, fp8)
    for name, t in ((names.k, k), (names.v, v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {names.q} is on {q.device}; all three must be on one "
                             "device")
    if q.device.type not in DEVICE_TYPES and q.device.type != "meta":
        raise ValueError(f"{names.q} must be on a CUDA/ROCm GPU or on the CPU (interpreter), got {q.device}")
    b, hq, sq, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{names.k} and {names.v} must have the same shape but for the head dim, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    bk, hk, sk, dk = k.shape
    dv = v.shape[3]
    if bk != b:
        raise ValueError(f"{names.k} has batch {bk} but {names.q} has batch {b}")
    if dk != d:
        raise ValueError(f"{names.k} has head dim {dk} but {names.q} has head dim {d}")
    if not 1 <= d <= geometry.MAX_HEAD_DIM:
        raise ValueError(f"head dim ({names.q}.shape[-1]) must be in 1..{geometry.MAX_HEAD_DIM}, got {d}")
    if not 1 <= dv <= geometry.MAX_HEAD_DIM:
        raise ValueError(f"{names.v}'s head dim ({names.v}.shape[-1]) must be in 1..{geometry.MAX_HEAD_DIM}, got {dv}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"{names.q} heads ({hq}) must be a multiple of {names.k}/{names.v} heads ({hk}) for "
                         "GQA/MQA")
    if max(sq, sk) > INT32_MAX or max(b, hq) > MAX_GRID_YZ:
        raise ValueError(f"seqlens must be < 2**31 and batch, heads <= {MAX_GRID_YZ}; got {names.q} "
                         f"{tuple(q.shape)}, {names.k} {tuple(k.shape)}")
    mode = causal_mode(causal, names.causal)
    return Call(Shape(b, hq, hk, sq, sk, d), mode, sk - sq if mode == "bottom_right" else 0,
                softmax_scale(scale, d, names.scale), head_dim_v=0 if dv == d else dv)


def causal_mode(causal: object, name: str = "causal") -> str:
    """``causal`` as one of geometry.CAUSAL_MODES, or a ValueError naming ``name``."""
    try:
        return geometry.causal_mode(causal)
    except ValueError:
        raise ValueError(f"{name} must be False, True, 'top_left' or 'bottom_right', got {shown(causal)}") from None


def softmax_scale(scale: object, head_dim: int, name: str = "sm_scale") -> float:
    """The softmax scale: 1/sqrt(head_dim) for None, else a finite float."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {scale}")
    return value


# ---------------------------------------------------------------------------
# Argument packing, generated from the parameter description

# Where each runtime parameter of flash_fwd comes from, as a Python expression
# over ``pack``'s locals and a C expression over lazytriton.c's ``lt__launch``
# locals. Lse is always a contiguous (batch, heads_q, seqlen_q) float32 tensor,
# so both launchers derive its strides from the shape.
# The varlen pointers, the lse strides and the scalar tail (``SIZES``), shared with the backward's
# binding. ``cu_q``/``cu_k`` and ``used_q``/``used_k`` are ``pack``'s optional arguments (0: a dense
# call, or one without seqused; varlen.py passes the cu_seqlens and seqused pointers) and the C
# launchers' checked call's fields (0 for a dense call).
SHARED_SOURCES: dict[str, tuple[str, str]] = {
    "Cu_seqlens_q": ("cu_q", "c->cu_seqlens_q"),
    "Cu_seqlens_k": ("cu_k", "c->cu_seqlens_k"),
    "Seqused_q": ("used_q", "c->seqused_q"),
    "Seqused_k": ("used_k", "c->seqused_k"),
    "stride_lb": ("hq * sq", "c->hq * c->sq"),
    "stride_lh": ("sq", "c->sq"),
    "group_size": ("hq // hk", "c->hq / c->hk"),
    "seqlen_q": ("sq", "c->sq"),
    "seqlen_k": ("sk", "c->sk"),
    "head_dim": ("d", "c->d"),
    "head_dim_v": ("dim_v", "c->dv"),
    "causal_offset": ("offset", "c->offset"),
    "window_left": ("call.window_left", "c->window_left"),  # lt_check.c's lt__check_window: with_features's
    "window_right": ("call.window_right", "c->window_right"),
    "attention_chunk": ("call.attention_chunk", "c->attention_chunk"),  # lt_check.c's lt__check_chunk: with_chunk's
    # The C API has no score modifications either: null pointers, zero strides, dropout_p 0.
    "Alibi": ("0 if alibi is None else alibi.data_ptr()", "0"),
    "Bias": ("0 if bias is None else bias.data_ptr()", "0"),
    "Philox": ("0 if philox is None else philox.data_ptr()", "0"),
    "Sinks": ("0 if sinks is None else sinks.data_ptr()", "c->sinks"),  # lt_check.c's lt__check_sinks
    "stride_alibi_b": ("0 if alibi is None or alibi.dim() == 1 else alibi.stride(0)", "0"),
    **{f"stride_bias{d}": (f"0 if bias is None else bias.stride({i})", "0") for i, d in enumerate("bhmn")},
    "sm_scale": ("scale", "scale"),
    "softcap": ("call.softcap", "c->softcap"),
    "dropout_p": ("call.dropout_p", "0.0f"),
}
# The lines ``pack`` functions start with, so that the sources above find their locals.
MOD_LOCALS = "alibi, bias, philox, sinks = call.alibi, call.bias, call.philox, call.sinks"
# A call without score modifications (the warm path's only kind): null pointers, zero strides.
_PLAIN = {"head_dim_v": "d", "window_left": "-1", "window_right": "-1", "attention_chunk": "0",
          "Cu_seqlens_q": "0", "Cu_seqlens_k": "0", "Seqused_q": "0", "Seqused_k": "0", "Sinks": "0", "Alibi": "0",
          "Bias": "0", "Philox": "0", "stride_alibi_b": "0", **{f"stride_bias{d}": "0" for d in "bhmn"}}
PARAM_SOURCES: dict[str, tuple[str, str]] = {
    "Q": ("q.data_ptr()", "(int64_t)(uintptr_t)q->data"),
    "K": ("k.data_ptr()", "(int64_t)(uintptr_t)k->data"),
    "V": ("v.data_ptr()", "(int64_t)(uintptr_t)v->data"),
    "Out": ("out.data_ptr()", "(int64_t)(uintptr_t)o->data"),
    "Lse": ("lse.data_ptr()", "(int64_t)(uintptr_t)p->lse.data"),
    **{f"stride_{t}{d}": (f"{t}s[{i}]", f"{c}->strides[{i}]")
       for t, c in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")) for i, d in enumerate("bhs")},
    **SHARED_SOURCES,
}

FLOAT_PARAMS = tuple(name for name, kind in FLASH_FWD.params if kind.startswith("fp"))
INT_PARAMS = tuple(name for name, kind in FLASH_FWD.params if not kind.startswith("fp"))
# Generated-source snippets shared by ``pack`` and the warm path (hot.py), over the
# same locals (qs, ks, vs, os: strides in the kernel's (b, h, s) order; b, hq, hk,
# sq, sk, d: sizes). ALIGNED_SOURCE: every pointer 16-byte aligned and every outer
# stride a multiple of 16 (the description's aligned_params). INDEX64_SOURCE: some
# tensor's last element lies 2**31 or more elements past its first.
INTS_SOURCE = ", ".join(PARAM_SOURCES[name][0] for name in INT_PARAMS)
# The same for a dense call without window (the warm path's only kind): its values written in as constants.
PLAIN_INTS_SOURCE = ", ".join(_PLAIN.get(name, PARAM_SOURCES[name][0]) for name in INT_PARAMS)

ALIGNED_SOURCE = f"not ({' | '.join(PARAM_SOURCES[name][0] for name in FLASH_FWD.aligned_params)}) & 15"
INDEX64_SOURCE = f"""max((b - 1) * qs[0] + (hq - 1) * qs[1] + (sq - 1) * qs[2] + d,
        (b - 1) * os[0] + (hq - 1) * os[1] + (sq - 1) * os[2] + dim_v,
        (b - 1) * ks[0] + (hk - 1) * ks[1] + (sk - 1) * ks[2] + d,
        (b - 1) * vs[0] + (hk - 1) * vs[1] + (sk - 1) * vs[2] + dim_v,
        b * hq * sq) > {INT32_MAX}"""


PACK_MODULE = "pack_generated.py"  # beside this file: ``pack`` written out by ``pack_module_text``


def pack_module_text() -> str:
    """The text of ``pack_generated.py``: ``pack``, written out from FLASH_FWD.params and ``PARAM_SOURCES``.

    A module, not text compiled at import: a process imports its bytecode
    (``.pyc``) instead of compiling the function each time (~0.3 ms).
    tests/test_cold_paths.py checks that the file is this text;
    ``write_pack_module()`` writes it after a change to the description or the
    sources above.
    """
    ints = "".join(f"        {PARAM_SOURCES[name][0]},\n" for name in INT_PARAMS)
    pointers = "\n        | ".join(PARAM_SOURCES[name][0] for name in FLASH_FWD.aligned_params)
    return f'''"""flash_fwd's argument packing, generated by ``binding.pack_module_text()``: do not edit.

``binding.write_pack_module()`` writes it again from the kernel's parameter
description (``FLASH_FWD.params``) and ``binding.PARAM_SOURCES``.
"""


def pack(q, k, v, out, lse, call, cu_q=0, cu_k=0, used_q=0, used_k=0):
    """``(ints, aligned, index64)`` of a flash_fwd launch (``binding.pack``'s description)."""
    b, hq, hk, sq, sk, d = call.shape
    dim_v = call.head_dim_v or d
    offset = call.offset
    {MOD_LOCALS}
    qs, ks, vs, os = q.stride(), k.stride(), v.stride(), out.stride()
    ints = (
{ints}    )
    aligned = not (
        {pointers}
    ) & 15
    index64 = {INDEX64_SOURCE}
    return ints, aligned, index64
'''


def write_pack_module() -> str:
    """Write ``pack_generated.py`` beside this file from ``pack_module_text()``; its path."""
    from pathlib import Path

    path = Path(__file__).with_name(PACK_MODULE)
    path.write_text(pack_module_text())
    return str(path)


# ``pack(q, k, v, out, lse, call, cu_q=0, cu_k=0, used_q=0, used_k=0) -> (ints, aligned, index64)``: one
# function with the tuple written out keeps the hot path at one call, not one per parameter (24 of them).
# ``aligned``: every pointer 16-byte aligned and every outer stride a multiple of 16. ``index64``: some
# tensor's last element lies 2**31 or more elements past its first. ``cu_q``, ``cu_k``: the varlen kernel's
# cu_seqlens pointers (0 when dense); ``used_q``, ``used_k``: its seqused pointers (0 without them).
pack = pack_generated.pack


def floats(call: Call) -> tuple[float, ...]:
    """The float parameters (after the ints, in the description's order: sm_scale, softcap, dropout_p)."""
    return (call.scale, call.softcap, call.dropout_p)


def c_initializer() -> str:
    """The C launcher's integer-argument initializer, from the same table as ``pack`` (tested against it)."""
    return ", ".join(PARAM_SOURCES[name][1] for name in INT_PARAMS)


# ---------------------------------------------------------------------------
# Grid, memo key, variant


def grid(shape: Shape, block_m: int) -> tuple[int, int, int]:
    """Programs: query blocks x query heads x batch."""
    return _grid(shape.seqlen_q, shape.heads_q, shape.batch, block_m)


# The memo key's last item for a call flash_fwd_gluon serves (see memo_key): a str, which no other key item is;
# followed by the query tiles its programs walk where more than one (``gluon_tail``).
GLUON_TAIL = ("gluon",)
# A call's memo key begins with these fields, in this order (``memo_key``); the warm path (hot.py) writes the
# same key out from this tuple, so a plan one memoises is the plan the other finds.
PLAIN_KEY = ("device_index", "dtype", "head_dim", "causal", "aligned", "index64", "bucket_q", "bucket_k")


# The memo key's item for a call with attention sinks (``memo_key``): a str, as GLUON_TAIL's.
SINKS_TAG = ("sinks",)
# The same for a call with attention_chunk, after SINKS_TAG where both are.
CHUNK_TAG = ("chunk",)


def gluon_tail(q_tiles: int) -> tuple[Any, ...]:
    """The memo key's tail for ``dispatch.flash_fwd_gluon_q_tiles``' answer: none (0), GLUON_TAIL, or it and n."""
    return () if not q_tiles else GLUON_TAIL if q_tiles == 1 else GLUON_TAIL + (q_tiles,)


def gluon_key(key: tuple[Any, ...]) -> bool:
    """Whether a memo key ends in a ``gluon_tail``: its plan may be flash_fwd_gluon."""
    return key[-1:] == GLUON_TAIL or key[-2:-1] == GLUON_TAIL


def memo_key(device_index: int | None, dtype: torch.dtype, shape: Shape, causal: bool, aligned: bool,
             index64: bool, window: bool = False, softcap: bool = False,
             mods: tuple[bool, bool, bool] = NO_MODS, head_dim_v: int = 0, offset: int | None = None,
             scale: float = 0.0, sinks: bool = False, chunk: bool = False) -> tuple[Any, ...]:
    """The hot path's memo key: everything dispatch looks at, seqlens through dispatch's own buckets.

    A windowed or softcapped call's key is longer (the two flags appended), so
    a plain call's key, which the warm path (hot.py) writes out, is unchanged
    and never finds such a call's kernel. ``mods`` (ALiBi, bias, dropout)
    lengthens it again, so the keys of windowed and capped calls stay as they were.
    ``head_dim_v`` (v's head dim where it differs, else 0) is appended with a tag.
    A plain call that ``flash_fwd.dispatch.flash_fwd_gluon_fits`` (from its causal
    ``offset`` and ``scale``; without an offset, never) gets ``GLUON_TAIL``
    appended: the one key whose plan may be flash_fwd_gluon, which the buckets
    alone cannot tell from a bucket-mate its tiles do not divide (hot.py appends the same).
    ``sinks`` (attention sinks) puts ``SINKS_TAG`` after the first eight fields,
    before any other: no key without it changes, and none with it is a plain call's;
    ``chunk`` (attention_chunk) puts ``CHUNK_TAG`` after it the same way (never flash_fwd_gluon).
    """
    key: tuple[Any, ...] = (device_index, dtype, shape.head_dim, causal, aligned, index64,
                            tuning.bucket_index(shape.seqlen_q), tuning.bucket_index(shape.seqlen_k))
    if sinks:
        key += SINKS_TAG
    if chunk:
        key += CHUNK_TAG
    if head_dim_v:
        return key + (window, softcap, *mods, "head_dim_v", head_dim_v)
    if offset is not None and not (window or softcap or chunk) and mods == NO_MODS and dtype in DTYPES:
        tail = gluon_tail(fwd_dispatch.flash_fwd_gluon_q_tiles(DTYPES[dtype], shape.head_dim, causal, offset, scale,
                                                               shape.seqlen_q, shape.seqlen_k))
        if tail:
            return key + tail
    if mods != NO_MODS:
        return key + (window, softcap, *mods)
    return key + (window, softcap) if window or softcap else key


def variant(target: Any, dtype: torch.dtype, shape: Shape, causal: bool, aligned: bool, index64: bool,
            window: bool = False, softcap: bool = False, mods: tuple[bool, bool, bool] = NO_MODS,
            head_dim_v: int = 0, gluon: bool = False, sinks: bool = False, chunk: bool = False) -> Variant:
    """The variant that serves a call of this shape (dispatch decides).

    ``gluon``: the call's memo key ends in ``GLUON_TAIL`` (it fits dispatch's
    flash_fwd_gluon row): that kernel, where target and alignment allow it.
    ``sinks``: attention sinks (SINKS=true on either kernel). ``chunk``:
    attention_chunk (CHUNK=true), which the Triton kernel alone takes.
    """
    if gluon and not head_dim_v and not chunk:
        found = fwd_dispatch.flash_fwd_gluon_default_variant(target, DTYPES[dtype], shape.head_dim, causal, aligned,
                                                             index64, shape.seqlen_q, shape.seqlen_k, sinks)
        if found is not None:
            return found
    return fwd_dispatch.flash_fwd_variant(target, DTYPES[dtype], shape.head_dim, causal, aligned, shape.seqlen_q,
                                          index64=index64, seqlen_k=shape.seqlen_k, window=window, softcap=softcap,
                                          alibi=mods[0], bias=mods[1], dropout=mods[2], head_dim_v=head_dim_v,
                                          sinks=sinks, chunk=chunk)


def head_dim_constexprs(head_dim: int, head_dim_v: int = 0) -> dict[str, Any]:
    """BLOCK_D, EVEN_D, BLOCK_DV and EVEN_DV for the interpreter (v's head dim: ``head_dim_v``, 0 the same)."""
    padded, padded_v = geometry.padded_head_dim(head_dim), geometry.padded_head_dim(head_dim_v or head_dim)
    return {"BLOCK_D": padded, "EVEN_D": padded == head_dim, "BLOCK_DV": padded_v,
            "EVEN_DV": padded_v == (head_dim_v or head_dim)}


def interpreter_constexprs(shape: Shape, causal: bool, window: bool = False,
                           softcap: bool = False, mods: tuple[bool, bool, bool] = NO_MODS,
                           head_dim_v: int = 0, sinks: bool = False, chunk: bool = False) -> dict[str, Any]:
    """Constexprs for Triton's interpreter on CPU tensors.

    Small tiles: the interpreter's cost is per program and per op, and tiles
    smaller than the test shapes exercise the unmasked loop as well as the tail.
    The pointer kernel (TMA=false): it runs wherever the CPU tensors came from.
    """
    return {"BLOCK_M": 32, "BLOCK_N": 16, **head_dim_constexprs(shape.head_dim, head_dim_v), "CAUSAL": causal,
            "TMA": False, "WINDOW": window, "SOFTCAP": softcap, "VARLEN": False, "ALIBI": mods[0], "BIAS": mods[1],
            "DROPOUT": mods[2], "BLOCK_D2": 0, "SEQUSED_Q": False, "SEQUSED_K": False, "SINKS": sinks,
            "CHUNK": chunk}


# ---------------------------------------------------------------------------
# Running it


def plan(rt: Any, key: tuple[Any, ...], device: torch.device, dtype: torch.dtype, shape: Shape, causal: bool,
         aligned: bool, index64: bool, window: bool = False, softcap: bool = False,
         mods: tuple[bool, bool, bool] = NO_MODS, head_dim_v: int = 0, sinks: bool = False,
         chunk: bool = False) -> tuple[Any, int]:
    """The loaded kernel and BLOCK_M for a memo key, memoised in ``rt.plans`` (``launch.plan``).

    During a CUDA graph capture, a kernel that is not loaded yet would touch
    the driver (module load) or the compiler; that raises ``CaptureError``
    first, naming the variant and the fix (``lazytriton.preload``).
    """
    def choose(target: Any) -> launch.Choice:
        return ((variant(target, dtype, shape, causal, aligned, index64, window, softcap, mods, head_dim_v,
                         gluon_key(key), sinks, chunk), ("BLOCK_M",)),)

    return launch.plan(rt, key, device, choose, "call lazytriton.preload(...) with this shape (or run the call "
                       "once) before the capture")  # type: ignore[return-value]


def launch_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               call: Call, variant: Variant | None = None) -> None:
    """Launch the cached kernel for a checked call on GPU tensors (the warm path: one dict lookup).

    ``variant`` forces a variant instead of dispatch's choice (``lazytriton
    tune`` times candidates so, launched exactly as a call launches them).
    """
    ints, aligned, index64 = pack(q, k, v, out, lse, call)
    shape = call.shape
    device = q.device
    rt = runtime.get()
    if variant is None:
        causal = call.causal != "none"
        key = memo_key(device.index, q.dtype, shape, causal, aligned, index64, call.windowed, call.capped,
                       call.mods, call.head_dim_v, call.offset, call.scale, call.sunk, call.chunked)
        found = rt.plans.get(key)
        if found is None:
            found = plan(rt, key, device, q.dtype, shape, causal, aligned, index64, call.windowed, call.capped,
                         call.mods, call.head_dim_v, call.sunk, call.chunked)
    else:
        found = (rt.kernel(variant, device.index), int(variant.get("BLOCK_M")))
    kernel, block_m = found
    kernel.launch(_grid(shape.seqlen_q, shape.heads_q, shape.batch, block_m), launch.raw_stream(device.index),
                  ints, floats(call), launch.scratch_alloc)


def run_interpreter(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    call: Call) -> None:
    """Run the kernel through Triton's interpreter on CPU tensors."""
    from lazytriton import compiler

    shape = call.shape
    warn_if_slow(shape)
    constexprs = interpreter_constexprs(shape, call.causal != "none", call.windowed, call.capped, call.mods,
                                        call.head_dim_v, call.sunk, call.chunked)
    args = triton_args(q, k, v, out, lse, call)
    compiler.interpret(FLASH_FWD.name, grid(shape, constexprs["BLOCK_M"]), args, constexprs)


# The kernel's own tensors, which Triton's launchers take as tensors: the cu_seqlens pointers follow them
# (0 when dense), then the score modifications' (tensors or None), then the seqused pointers (0 without
# them), then the sinks (a tensor); _N_POINTERS counts them all.
N_TENSORS = [name for name, _ in FLASH_FWD.params].index(VARLEN_POINTERS[0][0])
_N_POINTERS = sum(1 for _, kind in FLASH_FWD.params if kind.startswith("*"))
_N_SINKS = _N_POINTERS - len(SINKS_POINTERS)
_N_SEQUSED = _N_SINKS - len(SEQUSED_POINTERS)


def triton_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                call: Call) -> tuple[Any, ...]:
    """The runtime arguments as Triton's own launchers take them (tensors for pointers): interpreter, JIT."""
    ints = pack(q, k, v, out, lse, call)[0]
    return (q, k, v, out, lse, *ints[N_TENSORS:N_TENSORS + len(VARLEN_POINTERS)], *mod_tensors(call, q),
            *ints[_N_SEQUSED:_N_SINKS], _sinks.argument(call, q), *ints[_N_POINTERS:], *floats(call))


_warned_slow = False


def warn_if_slow(shape: Shape) -> None:
    """Warn once per process when a CPU call through the interpreter may take minutes."""
    global _warned_slow
    work = shape.batch * shape.heads_q * shape.seqlen_q * shape.seqlen_k * shape.head_dim
    if work >= SLOW_CPU_WORK and not _warned_slow:
        _warned_slow = True
        log.warning("attention on CPU tensors of %s runs through Triton's interpreter and may take minutes; "
                    "the CPU path is for checking results, not for speed",
                    ", ".join(f"{name} {size}" for name, size in zip(shape._fields, shape, strict=True)))


def empty_like_head_dim(t: torch.Tensor, head_dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor like ``t`` (dtype or ``dtype``, device, the order of its strides) but with ``head_dim`` as its last dim.

    With t's own last dim this is ``torch.empty_like(t)`` (t's strides for a dense t).
    """
    if head_dim == t.shape[-1]:
        return torch.empty_like(t, dtype=dtype)
    strides = t.stride()
    outer = sorted(range(t.dim() - 1), key=lambda i: -strides[i])
    sizes = [t.shape[i] for i in outer] + [head_dim]
    made = torch.empty(sizes, dtype=dtype or t.dtype, device=t.device)
    return made.permute([outer.index(i) for i in range(t.dim() - 1)] + [t.dim() - 1])


def empty_outputs(q: torch.Tensor, shape: Shape, head_dim_v: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs: out (q's shape, dtype and, for a dense q, stride order) and lse (batch, heads_q, seqlen_q) float32.

    out's head dim is v's, ``head_dim_v`` (0: q's).
    """
    out = empty_like_head_dim(q, head_dim_v or q.shape[-1])
    lse = torch.empty((shape.batch, shape.heads_q, shape.seqlen_q), dtype=torch.float32, device=q.device)
    return out, lse


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a checked call: the kernel on a GPU, the interpreter on CPU, empty on meta."""
    shape = call.shape
    out, lse = empty_outputs(q, shape, call.head_dim_v)
    if out.numel() == 0 or q.device.type == "meta":
        return out, lse
    if shape.seqlen_k == 0:
        return out.zero_(), _sinks.lse_of_no_key(call, lse, 1)
    if q.device.type == "cpu":
        run_interpreter(q, k, v, out, lse, call)
    else:
        launch_gpu(q, k, v, out, lse, call)
    return out, lse


def preload(device: torch.device, dtype: torch.dtype, call: Call, aligned: bool = True,
            index64: bool = False) -> Variant:
    """Load the kernel a call of this shape would use on ``device`` now (images, cache or JIT); its variant."""
    shape = call.shape
    causal = call.causal != "none"
    rt = runtime.get()
    dv = call.head_dim_v
    key = memo_key(device.index, dtype, shape, causal, aligned, index64, call.windowed, call.capped, call.mods, dv,
                   call.offset, call.scale, call.sunk, call.chunked)
    plan(rt, key, device, dtype, shape, causal, aligned, index64, call.windowed, call.capped, call.mods, dv,
         call.sunk, call.chunked)
    return variant(machine.target_of_device(device), dtype, shape, causal, aligned, index64, call.windowed,
                   call.capped, call.mods, dv, gluon_key(key), call.sunk, call.chunked)
