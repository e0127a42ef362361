"""Host side of flash_bwd: the one owner of the backward kernels' launch ABI.

The backward takes the forward's checked ``Call`` (``flash_fwd.binding``:
shapes, causal mode and offset, scale) plus the forward's ``out`` and ``lse``
and the incoming gradient ``do``, and returns ``(dq, dk, dv)``:

- ``check_grad`` refuses a ``do``/``out``/``lse`` of the wrong shape, dtype,
  device or layout, naming the argument, before anything runs;
- ``pack`` (both kernels' integers) is generated from each kernel's parameter
  description (``FLASH_BWD_DQ.params``, ``FLASH_BWD_DKDV.params``) and
  ``PARAM_SOURCES`` into ``pack_generated.py``; the C launcher is tested
  against ``c_initializer``;
- ``memo_key`` is the forward's, marked with the family: both kernels see the
  same dispatch inputs (``dispatch.kernel_variant``);
- ``backward`` allocates the gradients and runs both kernels: cached binaries
  on a GPU, Triton's interpreter on the CPU. A plain GPU call whose geometry
  was served before takes the warm path (``_warm_backward``): the recorded
  launches with the call's pointers put in, the first kernel launched before
  the gradients are allocated.

The two kernels write disjoint outputs and use no atomics, so the gradients
are bitwise identical from run to run (see ``triton_kernel.py``).

Where dispatch's ``BWD_GLUON_TABLE`` has a row for a plain call that its
tiles divide (``gluon_fits``; the memo key then ends in ``GLUON_TAIL``), the
dK/dV kernel is ``flash_bwd_dkdv_gluon`` (``gluon_kernel.py``, Hopper only),
launched in flash_bwd_dkdv's place with the same arguments and grid; it too
sums in a fixed order without atomics. The C API's backward plans
(``capi/embedded.py``) keep flash_bwd_dkdv.

Where dispatch's ``BWD_FUSED_TABLE`` has a row for a plain call
(``fused_fits``; the memo key then ends in ``FUSED_TAIL``), the backward is
the fused one (``fused.py``, Hopper only): ``flash_bwd_prep`` (delta, dQ's
zeroed float32 accumulator), ``flash_bwd_fused_gluon`` (dK, dV, and dQ's sums
by TMA reductions), then the accumulator cast into dq. Its dQ sums in the
order the programs run, so dQ is not bitwise reproducible: under
``torch.use_deterministic_algorithms(True)``, or for a call that asks
(``backward(..., deterministic=True)``: ``flash_attn_func``'s argument), the
two kernels serve instead.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from lazytriton import launch, machine, runtime
from lazytriton.kernels import attention, dispatch
from lazytriton.kernels.arguments import shown
from lazytriton.kernels.flash_bwd import (
    DBIAS_POINTER,
    DBIAS_STRIDES,
    FAMILY,
    FLASH_BWD_DKDV,
    FLASH_BWD_DQ,
    dkdv_grid,
    dq_grid,
    fused,
    pack_generated,
)
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import SEQUSED_POINTERS, VARLEN_POINTERS, score_mods
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.kernels.flash_fwd import sinks as fwd_sinks
from lazytriton.kernels.flash_fwd.binding import INT32_MAX, Call, Shape
from lazytriton.record import NamedTuple
from lazytriton.variant import Variant


class Grads(NamedTuple):
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


# ---------------------------------------------------------------------------
# Checks


def check_grad(q: torch.Tensor, out: Any, lse: Any, do: Any, call: Call, names: fwd.Names = fwd.NAMES) -> None:
    """Refuse ``do`` (the gradient of out), ``out`` or ``lse`` unless they match the checked call.

    ``do`` and ``out`` must have q's shape (kernel order) but v's head dim,
    q's dtype and device and a contiguous last dim; ``lse`` must be the
    forward's float32 (batch, heads_q, seqlen_q) tensor.
    """
    b, hq, _, sq, _, _ = call.shape
    d = call.dv
    expected = (b, hq, sq, d)
    for name, t in (("do", do), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {names.q} has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {names.q} is on {q.device}; they must be on one device")
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have the output's shape {expected}, got {tuple(t.shape)}")
        if t.stride(-1) != 1 and d > 1 and t.numel():
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32 or lse.device != q.device or tuple(lse.shape) != (b, hq, sq):
        raise ValueError(f"lse must be the forward's float32 logsumexp of shape {(b, hq, sq)} on {q.device}, got "
                         f"{lse.dtype} {tuple(lse.shape)} on {lse.device}")


# ---------------------------------------------------------------------------
# Argument packing, generated from the parameter descriptions

# Where each runtime parameter comes from, as a Python expression over the pack
# functions' locals and a C expression over lazytriton.c's backward launcher.
# Lse and Delta are contiguous (batch, heads_q, seqlen_q) float32 tensors.
# Python local -> C local of each tensor ("do" is a C keyword).
_TENSORS = {"q": "q", "k": "k", "v": "v", "o": "o", "do": "dout", "dq": "dq", "dk": "dk", "dv": "dv"}
PARAM_SOURCES: dict[str, tuple[str, str]] = {
    **{("Out" if t == "o" else t.upper()): (f"{t}.data_ptr()", f"(int64_t)(uintptr_t){c}->data")
       for t, c in _TENSORS.items()},
    "Lse": ("lse.data_ptr()", "(int64_t)(uintptr_t)p->lse.data"),
    "Delta": ("delta.data_ptr()", "(int64_t)(uintptr_t)p->delta.data"),
    # flash_bwd_dq's bias gradient (BIAS_GRAD): the C API's backward has no bias, so none.
    "DBias": ("0 if dbias is None else dbias.data_ptr()", "0"),
    **{f"stride_dbias{d}": (f"0 if dbias is None else dbias.stride({i})", "0") for i, d in enumerate("bhm")},
    **{f"stride_{t}{d}": (f"{t}s[{i}]", f"{c}->strides[{i}]") for t, c in _TENSORS.items()
       for i, d in enumerate("bhs")},
    **fwd.SHARED_SOURCES,
}

# The score modifications' tensors the sources read (the backward has no sinks parameter: lse holds them).
_MOD_LOCALS = "alibi, bias, philox = call.alibi, call.bias, call.philox"
# One (b, h, s) stride triple per tensor name, read once by each pack function.
_STRIDE_LOCALS = "\n    ".join(f"{t}s = {t}.stride()" for t in _TENSORS)


def _int_params(spec: Any) -> tuple[str, ...]:
    return tuple(name for name, kind in spec.params if not kind.startswith("fp"))


DQ_INT_PARAMS = _int_params(FLASH_BWD_DQ)
DKDV_INT_PARAMS = _int_params(FLASH_BWD_DKDV)
# The bias gradient's pointer and strides take ALIGN16's hints too, but never decide it: ``check_bias_grad``
# holds them to 16 (``empty_bias_grad`` allocates them so), and the C API has no bias gradient.
_DBIAS_PARAMS = tuple(name for name, _ in (*DBIAS_POINTER, *DBIAS_STRIDES))
ALIGNED_PARAMS = tuple(name for name in dict.fromkeys(FLASH_BWD_DQ.aligned_params + FLASH_BWD_DKDV.aligned_params)
                       if name not in _DBIAS_PARAMS)
SEQ_ALIGNED_PARAMS = tuple(dict.fromkeys(FLASH_BWD_DQ.seq_aligned_params + FLASH_BWD_DKDV.seq_aligned_params))


PACK_MODULE = "pack_generated.py"  # beside this file: ``pack`` written out by ``pack_module_text``


def pack_module_text() -> str:
    """The text of ``pack_generated.py``: ``pack``, written out from both kernels' descriptions and ``PARAM_SOURCES``.

    A module, not text compiled at import: a process imports its bytecode
    (``.pyc``) instead of compiling the function each time (~0.5 ms on the
    2-core development machine). tests/test_cold_paths.py checks that the file
    is this text; ``write_pack_module()`` writes it after a change to the
    descriptions or the sources above.
    """
    def items(texts: list[str]) -> str:  # one a line, each ending in a comma
        return "".join(f"        {text},\n" for text in texts)

    def ored(params: tuple[str, ...]) -> str:
        return "\n        | ".join(PARAM_SOURCES[name][0] for name in params)

    def extent(t: str, h: str, s: str, last: str) -> str:
        return f"(b - 1) * {t}s[0] + ({h} - 1) * {t}s[1] + ({s} - 1) * {t}s[2] + {last}"

    extents = [extent(t, "hq", "sq", "dim_v" if t in ("o", "do") else "d") for t in ("q", "o", "do", "dq")]
    extents += [extent(t, "hk", "sk", "dim_v" if t in ("v", "dv") else "d") for t in ("k", "v", "dk", "dv")]
    return f'''"""flash_bwd's argument packing, generated by ``binding.pack_module_text()``: do not edit.

``binding.write_pack_module()`` writes it again from the kernels' parameter
descriptions (``FLASH_BWD_DQ.params``, ``FLASH_BWD_DKDV.params``) and
``binding.PARAM_SOURCES``.
"""


def pack(q, k, v, o, do, lse, delta, dq, dk, dv, call, cu_q=0, cu_k=0, used_q=0, used_k=0, dbias=None):
    """``(dq_ints, dkdv_ints, aligned, seq16, index64)`` of a flash_bwd launch (``binding.pack``'s description)."""
    b, hq, hk, sq, sk, d = call.shape
    dim_v = call.head_dim_v or d
    offset = call.offset
    {_MOD_LOCALS}
    {_STRIDE_LOCALS}
    aligned = not (
        {ored(ALIGNED_PARAMS)}
    ) & 15
    index64 = max(
{items([*extents, "b * hq * sq"])}    ) > {INT32_MAX}
    seq16 = aligned and not cu_q and not (
        {ored(SEQ_ALIGNED_PARAMS)}
    ) & 15
    dq_ints = (
{items([PARAM_SOURCES[name][0] for name in DQ_INT_PARAMS])}    )
    dkdv_ints = (
{items([PARAM_SOURCES[name][0] for name in DKDV_INT_PARAMS])}    )
    return dq_ints, dkdv_ints, aligned, seq16, index64
'''


def write_pack_module() -> str:
    """Write ``pack_generated.py`` beside this file from ``pack_module_text()``; its path."""
    from pathlib import Path

    path = Path(__file__).with_name(PACK_MODULE)
    path.write_text(pack_module_text())
    return str(path)


# ``pack(q, k, v, o, do, lse, delta, dq, dk, dv, call, cu_q=0, cu_k=0, used_q=0, used_k=0, dbias=None)`` ->
# ``(dq_ints, dkdv_ints, aligned, seq16, index64)``: one function with both argument tuples written out, from
# the two descriptions. ``aligned`` (ALIGN16): every pointer 16-byte aligned and every outer stride of the eight
# tensors a multiple of 16 (both kernels' aligned_params). ``seq16`` (SEQ16): that, a dense call, and the
# seqlens and lse strides multiples of 16 (seq_aligned_params). ``index64``: some tensor's last element lies
# 2**31 or more elements past its first. ``cu_q``, ``cu_k``: the varlen kernels' cu_seqlens pointers (0 when
# dense); the varlen kernels replace the seqlens by each sequence's own, so a packed call never has SEQ16.
# ``used_q``, ``used_k``: their seqused pointers (0 without them). ``dbias``: the bias's gradient flash_bwd_dq
# writes (``empty_bias_grad``; None without BIAS_GRAD).
pack = pack_generated.pack


def c_initializer(kernel: str) -> str:
    """The C launcher's integer-argument initializer of one kernel, from the same table as ``pack``."""
    params = {FLASH_BWD_DQ.name: DQ_INT_PARAMS, FLASH_BWD_DKDV.name: DKDV_INT_PARAMS}[kernel]
    return ", ".join(PARAM_SOURCES[name][1] for name in params)


# ---------------------------------------------------------------------------
# Memo key, variants, grids


def _seq16(seq16: bool | None, aligned: bool, shape: Shape) -> bool:
    """``seq16`` as given (``pack``'s), else dispatch's rule for a dense call of ``shape``."""
    if seq16 is None:
        return bwd_dispatch.seq_aligned(FLASH_BWD_DQ.name, aligned, shape.seqlen_q, shape.seqlen_k)
    return seq16


# The memo key's last item for a call flash_bwd_dkdv_gluon serves (see memo_key): the forward's tail.
GLUON_TAIL = fwd.GLUON_TAIL


def gluon_fits(call: Call, dtype: torch.dtype, aligned: bool, index64: bool) -> bool:
    """Whether dispatch serves this checked call's dK/dV with flash_bwd_dkdv_gluon (``dispatch.flash_bwd_gluon_fits``).

    Only a plain dense call: no window, softcap, ALiBi, bias, dropout,
    attention_chunk or head_dim_v (a varlen call has keys of its own, never this tail), aligned,
    with 32-bit offsets.
    """
    shape = call.shape
    return _plain(call, dtype, aligned, index64) and bwd_dispatch.flash_bwd_gluon_fits(
        fwd.DTYPES[dtype], shape.head_dim, call.causal != "none", call.offset, shape.seqlen_q, shape.seqlen_k)


def _plain(call: Call, dtype: torch.dtype, aligned: bool, index64: bool) -> bool:
    """A plain dense 16-bit call the Gluon backward kernels can take: aligned, 32-bit offsets, no features."""
    return (aligned and not index64 and not (call.windowed or call.capped or call.head_dim_v or call.chunked)
            and call.mods == fwd.NO_MODS and dtype in fwd.DTYPES)


# The memo key's last item for a call the fused backward serves (see memo_key).
FUSED_TAIL = ("FUSED",)


def fused_fits(call: Call, dtype: torch.dtype, aligned: bool, index64: bool, seq16: bool = True,
               deterministic: bool = False) -> bool:
    """Whether dispatch serves this checked call with the fused backward (``flash_bwd.dispatch.flash_bwd_fused_fits``).

    A plain dense call as for ``gluon_fits``, with SEQ16 (lse's strides
    multiples of 16: the fused kernel's entries are compiled so), and a
    deterministic backward asked for neither by the call (``deterministic``:
    ``flash_attn_func``'s) nor globally (``torch.use_deterministic_algorithms``):
    the fused kernel's dQ sums arrive in any order.
    """
    shape = call.shape
    return (seq16 and not deterministic and _plain(call, dtype, aligned, index64)
            and bwd_dispatch.flash_bwd_fused_fits(fwd.DTYPES[dtype], shape.head_dim, call.causal != "none", call.offset,
                                                  shape.seqlen_q, shape.seqlen_k)
            and not torch.are_deterministic_algorithms_enabled())


def memo_key(device_index: int | None, dtype: torch.dtype, shape: Shape, causal: bool, aligned: bool,
             index64: bool, window: bool = False, softcap: bool = False,
             mods: tuple[bool, bool, bool] = fwd.NO_MODS, head_dim_v: int = 0,
             seq16: bool | None = None, gluon: bool = False, fused_: bool = False,
             bias_grad: bool = False, chunk: bool = False) -> tuple[Any, ...]:
    """The forward's memo key, marked with the family (both live in ``Runtime.plans``), and "SEQ16" when set.

    The seqlens enter the forward's key only through their buckets, which
    4095 and 4096 share; SEQ16 tells them apart. ``seq16`` None: dispatch's
    rule for a dense call of ``shape`` (``flash_bwd.dispatch.seq_aligned``). ``gluon``
    (``gluon_fits``) appends ``GLUON_TAIL``: the one key whose plan may run
    flash_bwd_dkdv_gluon, which the buckets cannot tell from a bucket-mate its
    tiles do not divide. ``fused_`` (``fused_fits``) appends ``FUSED_TAIL``
    instead: the key whose plan runs the fused backward. ``bias_grad`` (a
    call with a bias that also wants its gradient: BIAS_GRAD) appends "BIAS_GRAD".
    ``chunk`` (attention_chunk) is the forward key's ``CHUNK_TAG``.
    """
    key = (FAMILY, *fwd.memo_key(device_index, dtype, shape, causal, aligned, index64, window, softcap, mods,
                                 head_dim_v, chunk=chunk))
    if _seq16(seq16, aligned, shape):
        key += ("SEQ16",)
    if bias_grad:
        key += ("BIAS_GRAD",)
    if fused_:
        return key + FUSED_TAIL
    return key + GLUON_TAIL if gluon else key


def variants(target: Any, dtype: torch.dtype, shape: Shape, causal: bool, aligned: bool,
             index64: bool, window: bool = False, softcap: bool = False,
             mods: tuple[bool, bool, bool] = fwd.NO_MODS, head_dim_v: int = 0,
             seq16: bool | None = None, gluon: bool = False, bias_grad: bool = False,
             chunk: bool = False) -> tuple[Variant, Variant]:
    """The (dq, dkdv) variants serving a call of this shape (dispatch decides).

    ``seq16`` and ``gluon`` as in ``memo_key``; with ``gluon`` the dK/dV
    kernel is flash_bwd_dkdv_gluon where target and alignment allow it.
    ``bias_grad``: flash_bwd_dq's BIAS_GRAD variant (it writes the bias's gradient);
    ``chunk``: attention_chunk (CHUNK=true on both).
    """
    seq16 = _seq16(seq16, aligned, shape)
    chosen = tuple(
        dispatch.kernel_variant(spec.name, target, fwd.DTYPES[dtype], shape.head_dim, causal, aligned,
                                shape.seqlen_q, shape.seqlen_k, index64=index64, window=window, softcap=softcap,
                                alibi=mods[0], bias=mods[1], dropout=mods[2], head_dim_v=head_dim_v, seq16=seq16,
                                bias_grad=bias_grad, chunk=chunk)
        for spec in (FLASH_BWD_DQ, FLASH_BWD_DKDV))
    if gluon:
        found = bwd_dispatch.flash_bwd_dkdv_gluon_default_variant(target, fwd.DTYPES[dtype], shape.head_dim, causal,
                                                                  aligned, index64, shape.seqlen_q, shape.seqlen_k)
        if found is not None:
            return chosen[0], found
    return chosen  # type: ignore[return-value]


def head_dim_constexprs(head_dim: int, head_dim_v: int = 0) -> dict[str, Any]:
    """BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV and BLOCK_D2 as a compiled variant of dispatch's would have them.

    Split tiles (``attention.split_chunks``: 96 = 64 + 32) where dispatch splits,
    the padded tile otherwise; ``variant.kernel_constexprs`` fills a split
    variant's absent BLOCK_DV/EVEN_DV with BLOCK_D's and EVEN_D's.
    """
    chunks = attention.split_chunks(FLASH_BWD_DQ.name, head_dim, head_dim_v)
    if chunks is None:
        return {**fwd.head_dim_constexprs(head_dim, head_dim_v), "BLOCK_D2": 0}
    even = sum(chunks) == head_dim
    return {"BLOCK_D": chunks[0], "EVEN_D": even, "BLOCK_DV": chunks[0], "EVEN_DV": even, "BLOCK_D2": chunks[1]}


def interpreter_constexprs(shape: Shape, causal: bool, window: bool = False,
                           softcap: bool = False, mods: tuple[bool, bool, bool] = fwd.NO_MODS,
                           head_dim_v: int = 0, chunk: bool = False) -> dict[str, Any]:
    """Constexprs for Triton's interpreter: tiles smaller than the test shapes, so every loop runs.

    The head dim's are dispatch's (``head_dim_constexprs``): split tiles where
    a GPU call would run them.
    """
    return {"BLOCK_M": 16, "BLOCK_N": 16, **head_dim_constexprs(shape.head_dim, head_dim_v), "CAUSAL": causal,
            "WINDOW": window, "SOFTCAP": softcap, "VARLEN": False, "ALIBI": mods[0], "BIAS": mods[1],
            "DROPOUT": mods[2], "SEQUSED_Q": False, "SEQUSED_K": False, "CHUNK": chunk}


def grids(shape: Shape, block_m: int, block_n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The (dq, dkdv) grids: dq over query blocks of BLOCK_M, dkdv over key blocks of BLOCK_N."""
    return (dq_grid(shape.seqlen_q, shape.heads_q, shape.batch, block_m),
            dkdv_grid(shape.seqlen_k, shape.heads_k, shape.batch, block_n))


# ---------------------------------------------------------------------------
# Running it


def fused_variants(target: Any, dtype: torch.dtype, shape: Shape, causal: bool, aligned: bool,
                   index64: bool) -> tuple[Variant, Variant] | None:
    """The (flash_bwd_prep, flash_bwd_fused_gluon) variants of a call ``fused_fits``, or None (target, alignment)."""
    return bwd_dispatch.flash_bwd_fused_default_variants(target, fwd.DTYPES[dtype], shape.head_dim, causal, aligned,
                                                         index64, shape.seqlen_q, shape.seqlen_k)


def plan(rt: Any, key: tuple[Any, ...], device: torch.device, dtype: torch.dtype, shape: Shape, causal: bool,
         aligned: bool, index64: bool, window: bool = False, softcap: bool = False,
         mods: tuple[bool, bool, bool] = fwd.NO_MODS, head_dim_v: int = 0,
         seq16: bool | None = None, gluon: bool = False, fused_: bool = False,
         bias_grad: bool = False, chunk: bool = False) -> tuple[Any, int, Any, int]:
    """(dq kernel, its BLOCK_M, dkdv kernel, its BLOCK_N) for a memo key, memoised in ``rt.plans``.

    With ``fused_`` (and a target that takes it): (flash_bwd_prep, its
    BLOCK_M, flash_bwd_fused_gluon, 0); a BLOCK_N of 0 marks the fused plan.
    Refuses, during a CUDA graph capture, to load or compile any kernel
    (``CaptureError`` naming the variant), as the forward does.
    """
    def choose(target: Any) -> launch.Choice:
        pair = fused_variants(target, dtype, shape, causal, aligned, index64) if fused_ else None
        if pair is not None:
            return ((pair[0], ("BLOCK_M",)), (pair[1], (0,)))
        dq_variant, dkdv_variant = variants(target, dtype, shape, causal, aligned, index64, window, softcap, mods,
                                            head_dim_v, seq16, gluon, bias_grad, chunk)
        return ((dq_variant, ("BLOCK_M",)), (dkdv_variant, ("BLOCK_N",)))

    return launch.plan(rt, key, device, choose, "run the backward once with this shape (or call "
                       "lazytriton.preload(..., backward=True)) before the capture")  # type: ignore[return-value]


def empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Grads:
    """The gradients: each with its input's shape, dtype and (for a dense input) strides."""
    return Grads(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))


def empty_bias_grad(q: torch.Tensor, call: Call) -> torch.Tensor:
    """The bias's gradient flash_bwd_dq writes (BIAS_GRAD): (batch, heads_q, seqlen_q, seqlen_k) of q's dtype.

    Its last dim is padded to a multiple of 16 (a view of the first seqlen_k
    columns), as torch's mem-efficient backend allocates its grad_bias, so
    every stride takes ALIGN16's hints. Zeros where the kernel skips tiles
    (a causal mask, a window or a chunk: their keys are never seen, their gradient is
    0); elsewhere every element is written once.
    """
    b, hq, _, sq, sk, _ = call.shape
    full = torch.zeros if call.causal != "none" or call.windowed or call.chunked else torch.empty
    return full((b, hq, sq, -(-sk // 16) * 16), dtype=q.dtype, device=q.device)[..., :sk]


def _delta(q: torch.Tensor, shape: Shape) -> torch.Tensor:
    return torch.empty((shape.batch, shape.heads_q, shape.seqlen_q), dtype=torch.float32, device=q.device)


def launch_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               do: torch.Tensor, grads: Grads, call: Call, forced: tuple[Variant, Variant] | None = None,
               deterministic: bool = False, delta: torch.Tensor | None = None,
               dbias: torch.Tensor | None = None) -> None:
    """Launch the cached kernels for a checked call on GPU tensors (``forced``: tune's candidates).

    ``deterministic``: bitwise reproducible gradients (flash_bwd's two
    kernels, never the fused one), as under ``torch.use_deterministic_algorithms``.
    ``delta``: where the first kernel writes rowsum(dO * O) (``backward``'s); None: a tensor of its own.
    ``dbias``: the bias's gradient (``empty_bias_grad``), written by flash_bwd_dq's BIAS_GRAD variant.
    """
    delta = _delta(q, call.shape) if delta is None else delta
    dq_ints, dkdv_ints, aligned, seq16, index64 = pack(q, k, v, out, do, lse, delta, *grads, call, dbias=dbias)
    shape = call.shape
    device = q.device
    rt = runtime.get()
    if forced is None:
        causal = call.causal != "none"
        fused_ = fused_fits(call, q.dtype, aligned, index64, seq16, deterministic)
        gluon = not fused_ and gluon_fits(call, q.dtype, aligned, index64)
        bias_grad = dbias is not None
        key = memo_key(device.index, q.dtype, shape, causal, aligned, index64, call.windowed, call.capped,
                       call.mods, call.head_dim_v, seq16, gluon, fused_, bias_grad=bias_grad, chunk=call.chunked)
        found = rt.plans.get(key)
        if found is None:
            found = plan(rt, key, device, q.dtype, shape, causal, aligned, index64, call.windowed, call.capped,
                         call.mods, call.head_dim_v, seq16, gluon, fused_, bias_grad=bias_grad, chunk=call.chunked)
    else:
        found = (rt.kernel(forced[0], device.index), int(forced[0].get("BLOCK_M")),
                 rt.kernel(forced[1], device.index), int(forced[1].get("BLOCK_N")))
    dq_kernel, block_m, dkdv_kernel, block_n = found
    stream = launch.raw_stream(device.index)
    floats = fwd.floats(call)
    if block_n == 0:  # the fused plan
        launches = _launch_fused(dq_kernel, dkdv_kernel, stream, dq_ints, dkdv_ints, grads, call)
    else:
        dq_grid_, dkdv_grid_ = grids(shape, block_m, block_n)
        dq_kernel.launch(dq_grid_, stream, dq_ints, floats, launch.scratch_alloc)
        dkdv_kernel.launch(dkdv_grid_, stream, dkdv_ints, floats, launch.scratch_alloc)
        launches = ((dq_kernel, dq_grid_, dq_ints, DQ_INT_PARAMS, floats),
                    (dkdv_kernel, dkdv_grid_, dkdv_ints, DKDV_INT_PARAMS, floats))
    if forced is None and _plain(call, q.dtype, True, False) and call.sinks is None:
        _remember(rt, (q, k, v, out, do, lse, delta), grads, call, deterministic, (aligned, index64, seq16),
                  (fused_, gluon), launches)


# ``_launch_fused`` takes both kernels' integers from one tuple: the two-kernel tuples ``pack`` made (the same
# tensors, strides and sizes), then dQ's accumulator and heads_q. Each kernel's are picked by position (a name
# both tuples hold has the same value in each: the first is taken).
_FUSED_SOURCES = (*DQ_INT_PARAMS, *DKDV_INT_PARAMS, "DQA", "heads_q")


def _picker(spec: Any) -> Any:
    """A function from the ``_FUSED_SOURCES`` tuple to ``spec``'s integer arguments in order (both take several)."""
    return operator.itemgetter(*(_FUSED_SOURCES.index(name) for name, kind in spec.params
                                 if not kind.startswith("fp")))


_PICK_PREP = _picker(fused.FLASH_BWD_PREP)
_PICK_FUSED = _picker(fused.FLASH_BWD_FUSED_GLUON)
_PREP_INT_PARAMS = _int_params(fused.FLASH_BWD_PREP)
_FUSED_INT_PARAMS = _int_params(fused.FLASH_BWD_FUSED_GLUON)
# One launch as the warm path repeats it: (kernel, grid, integers, their parameters' names, floats).
_Launch = tuple[Any, tuple[int, int, int], tuple[int, ...], tuple[str, ...], tuple[float, ...]]


def _dqa_shape(shape: Shape) -> tuple[int, int, int, int]:
    """The shape of dQ's float32 accumulator: rows of the fused kernel's tile (wider than a padded head dim)."""
    return (shape.batch, shape.heads_q, shape.seqlen_q, fused.tile(shape.head_dim))


def _cast_dq(grads: Grads, dqa: torch.Tensor, head_dim: int) -> None:
    """Cast dQ's accumulator (its first ``head_dim`` columns) into ``grads.dq``."""
    grads.dq.copy_(dqa if dqa.shape[-1] == head_dim else dqa[..., :head_dim])


def _launch_fused(prep: Any, kernel: Any, stream: int, dq_ints: tuple[int, ...], dkdv_ints: tuple[int, ...],
                  grads: Grads, call: Call) -> tuple[_Launch, _Launch]:
    """The fused backward: flash_bwd_prep, flash_bwd_fused_gluon, then dQ's accumulator cast into ``grads.dq``.

    Returns both launches (kernel, grid, integers, their names, floats), for the warm path to repeat.
    """
    shape = call.shape
    dqa = torch.empty(_dqa_shape(shape), dtype=torch.float32, device=grads.dq.device)
    ints = (*dq_ints, *dkdv_ints, dqa.data_ptr(), shape.heads_q)
    prep_grid, fused_grid = fused.grids(shape.batch, shape.heads_q, shape.heads_k, shape.seqlen_q, shape.seqlen_k,
                                        shape.head_dim)
    prep_ints, fused_ints = _PICK_PREP(ints), _PICK_FUSED(ints)
    prep.launch(prep_grid, stream, prep_ints, (), launch.scratch_alloc)
    kernel.launch(fused_grid, stream, fused_ints, (call.scale,), launch.scratch_alloc)
    _cast_dq(grads, dqa, shape.head_dim)
    return ((prep, prep_grid, prep_ints, _PREP_INT_PARAMS, ()),
            (kernel, fused_grid, fused_ints, _FUSED_INT_PARAMS, (call.scale,)))


# Each kernel's own tensors, which Triton's launchers take as tensors: the cu_seqlens pointers follow them
# (0 when dense), then the score modifications' (tensors or None), then the seqused pointers (0 without
# them), then flash_bwd_dq's bias gradient (a tensor with BIAS_GRAD, else 0). The positions are both kernels'.
N_TENSORS = [name for name, _ in FLASH_BWD_DQ.params].index(VARLEN_POINTERS[0][0])
_N_VARLEN_END = N_TENSORS + len(VARLEN_POINTERS)
_N_SEQUSED = [name for name, _ in FLASH_BWD_DQ.params].index(SEQUSED_POINTERS[0][0])
_N_DBIAS = DQ_INT_PARAMS.index("DBias")


def _dq_pointers(dq_ints: tuple[int, ...], dbias: torch.Tensor | None) -> tuple[Any, ...]:
    """flash_bwd_dq's integers from the seqused pointers on, with the bias gradient as a tensor where it has one."""
    if dbias is None:
        return dq_ints[_N_SEQUSED:]
    return (*dq_ints[_N_SEQUSED:_N_DBIAS], dbias, *dq_ints[_N_DBIAS + 1:])


def run_interpreter(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    do: torch.Tensor, grads: Grads, call: Call, delta: torch.Tensor | None = None,
                    dbias: torch.Tensor | None = None) -> None:
    """Run both kernels through Triton's interpreter on CPU tensors (``delta``, ``dbias``: ``launch_gpu``'s)."""
    from lazytriton import compiler

    shape = call.shape
    fwd.warn_if_slow(shape)
    delta = _delta(q, shape) if delta is None else delta
    dq_ints, dkdv_ints, *_ = pack(q, k, v, out, do, lse, delta, *grads, call, dbias=dbias)
    constexprs = interpreter_constexprs(shape, call.causal != "none", call.windowed, call.capped, call.mods,
                                        call.head_dim_v, call.chunked)
    dq_grid_, dkdv_grid_ = grids(shape, constexprs["BLOCK_M"], constexprs["BLOCK_N"])
    dq, dk, dv = grads
    floats = fwd.floats(call)
    mods = score_mods.mod_tensors(call, q)
    cu = dq_ints[N_TENSORS:_N_VARLEN_END]
    compiler.interpret(FLASH_BWD_DQ.name, dq_grid_, (q, k, v, out, do, lse, delta, dq, *cu, *mods,
                                                     *_dq_pointers(dq_ints, dbias), *floats),
                       {**constexprs, "BIAS_GRAD": dbias is not None})
    compiler.interpret(FLASH_BWD_DKDV.name, dkdv_grid_, (q, k, v, do, lse, delta, dk, dv, *cu, *mods,
                                                         *dkdv_ints[_N_SEQUSED:], *floats), constexprs)


def triton_args(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, do: torch.Tensor, delta: torch.Tensor, grads: Grads,
                call: Call, dbias: torch.Tensor | None = None) -> tuple[Any, ...]:
    """One kernel's runtime arguments as Triton's own launchers take them (tensors for pointers): benchmarks.

    ``dbias``: flash_bwd_dq's bias gradient (BIAS_GRAD), as for ``launch_gpu``.
    """
    dq_ints, dkdv_ints, *_ = pack(q, k, v, out, do, lse, delta, *grads, call, dbias=dbias)
    mods = score_mods.mod_tensors(call, q)
    if kernel == FLASH_BWD_DQ.name:
        return (q, k, v, out, do, lse, delta, grads.dq, *dq_ints[N_TENSORS:_N_VARLEN_END], *mods,
                *_dq_pointers(dq_ints, dbias), *fwd.floats(call))
    return (q, k, v, do, lse, delta, grads.dk, grads.dv, *dkdv_ints[N_TENSORS:_N_VARLEN_END], *mods,
            *dkdv_ints[_N_SEQUSED:], *fwd.floats(call))


# ---------------------------------------------------------------------------
# The warm path: a plain dense call on a GPU whose geometry the general path served before. It repeats that
# call's two launches with this call's pointers put in, without ``pack``, the memo key or the plan lookup, and
# launches the first kernel before allocating the gradients the second writes (the fused plan's prep kernel
# needs only delta and dQ's accumulator, one allocation here): on the H200 host a backward's Python ran 0.1-0.2
# ms before its first launch, which a 1k-token backward (0.7-1.5 ms) waits for when the GPU is idle.

# The warm entries live in one dict in ``Runtime.plans`` under this key (cleared with the plans), at most
# WARM_MAX of them: a geometry is exact (seqlens, not their buckets), so a run of ever new shapes empties it.
WARM_TAG = ("flash_bwd warm",)
WARM_MAX = 1024
# The tensors whose pointers a launch's integers hold, by parameter name: put in per call.
_CALL_POINTERS = frozenset(("Q", "K", "V", "Out", "DO", "Lse", "Delta", "DQ", "DK", "DV", "DQA"))


class _Warm(NamedTuple):
    """A geometry's launches: the flags the plan was chosen by, each launch's constant integers and pointer slots."""

    flags: tuple[bool, bool, bool]  # aligned, index64, seq16 (``pack``'s)
    tails: tuple[bool, bool]  # fused_, gluon: the memo key's tails, which dispatch's tables decide per call
    launches: tuple[tuple[Any, tuple[int, int, int], tuple[int, ...], tuple[tuple[int, str], ...],
                          tuple[float, ...]], ...]
    delta: int  # delta's elements (B x Hq x Sq)
    dqa: tuple[int, ...]  # dQ's float32 accumulator's shape (the fused plan), else ()


def _input_pointers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    do: torch.Tensor) -> dict[str, int]:
    """The inputs' pointers by parameter name (read once a call: the key's alignment and the launches use them)."""
    return {"Q": q.data_ptr(), "K": k.data_ptr(), "V": v.data_ptr(), "Out": out.data_ptr(), "DO": do.data_ptr(),
            "Lse": lse.data_ptr()}


def _warm_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              do: torch.Tensor, call: Call, deterministic: bool, pointers: dict[str, int]) -> tuple[Any, ...]:
    """A warm entry's key: the call, every input's strides, dtype, device, whether the pointers are 16-byte aligned."""
    aligned = not (pointers["Q"] | pointers["K"] | pointers["V"] | pointers["Out"] | pointers["DO"]
                   | pointers["Lse"]) & 15
    return (call, q.stride(), k.stride(), v.stride(), out.stride(), do.stride(), lse.stride(), q.dtype,
            q.get_device(), aligned, deterministic)


def _remember(rt: Any, tensors: tuple[torch.Tensor, ...], grads: Grads, call: Call, deterministic: bool,
              flags: tuple[bool, bool, bool], tails: tuple[bool, bool], launches: tuple[_Launch, ...]) -> None:
    """Keep a plain call's launches for the warm path (``_warm_backward``), keyed by its geometry.

    Not kept where the inputs' alignment is not the call's (a gradient or
    delta unaligned: never from torch's allocator) or a pointer slot does not
    hold its tensor's pointer (a layout the warm path would get wrong).
    """
    q, k, v, out, do, lse, delta = tensors
    key = _warm_key(q, k, v, out, lse, do, call, deterministic, _input_pointers(q, k, v, out, lse, do))
    if key[-2] != flags[0] or not lse.is_contiguous():
        return
    pointers = {"Q": q, "K": k, "V": v, "Out": out, "DO": do, "Lse": lse, "Delta": delta, "DQ": grads.dq,
                "DK": grads.dk, "DV": grads.dv}
    kept = []
    dqa: tuple[int, ...] = ()
    for kernel, grid, ints, names, floats in launches:
        slots = tuple((i, name) for i, name in enumerate(names) if name in _CALL_POINTERS)
        for i, name in slots:
            if name == "DQA":
                dqa = _dqa_shape(call.shape)
            elif ints[i] != pointers[name].data_ptr():
                return
        kept.append((kernel, grid, ints, slots, floats))
    entries = rt.plans.setdefault(WARM_TAG, {})
    if len(entries) >= WARM_MAX:
        entries.clear()
    entries[key] = _Warm(flags, tails, tuple(kept), delta.numel(), dqa)


def _fill(ints: tuple[int, ...], slots: tuple[tuple[int, str], ...], pointers: dict[str, int]) -> tuple[int, ...]:
    """A launch's integers with this call's pointers in their slots."""
    filled = list(ints)
    for i, name in slots:
        filled[i] = pointers[name]
    return tuple(filled)


def _warm_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, call: Call, deterministic: bool) -> Grads | None:
    """The gradients of a warm call (see the section's comment), or None: the general path serves it.

    None also where dispatch's tables would now choose another plan for it
    (its fused or Gluon tail differs from the entry's), as the memo key
    would tell the general path.
    """
    entries = runtime.get().plans.get(WARM_TAG)
    if not entries:
        return None
    pointers = _input_pointers(q, k, v, out, lse, do)
    warm = entries.get(_warm_key(q, k, v, out, lse, do, call, deterministic, pointers))
    if not warm:
        return None
    aligned, index64, seq16 = warm.flags
    fused_ = fused_fits(call, q.dtype, aligned, index64, seq16, deterministic)
    if (fused_, not fused_ and gluon_fits(call, q.dtype, aligned, index64)) != warm.tails:
        return None
    device = q.device
    stream = launch.raw_stream(q.get_device())
    (first, first_grid, first_ints, first_slots, first_floats), second = warm.launches
    if warm.dqa:  # the fused plan: delta and dQ's accumulator in one allocation, the prep kernel before the rest
        scratch = torch.empty(warm.delta + math.prod(warm.dqa), dtype=torch.float32, device=device)
        pointers["Delta"] = base = scratch.data_ptr()
        pointers["DQA"] = base + 4 * warm.delta
        first.launch(first_grid, stream, _fill(first_ints, first_slots, pointers), first_floats, launch.scratch_alloc)
        grads = empty_grads(q, k, v)
    else:
        delta = torch.empty(warm.delta, dtype=torch.float32, device=device)
        grads = empty_grads(q, k, v)
        pointers["Delta"] = delta.data_ptr()
        pointers["DQ"] = grads.dq.data_ptr()
        first.launch(first_grid, stream, _fill(first_ints, first_slots, pointers), first_floats, launch.scratch_alloc)
    pointers["DQ"], pointers["DK"], pointers["DV"] = grads.dq.data_ptr(), grads.dk.data_ptr(), grads.dv.data_ptr()
    kernel, grid, ints, slots, floats = second
    kernel.launch(grid, stream, _fill(ints, slots, pointers), floats, launch.scratch_alloc)
    if warm.dqa:
        _cast_dq(grads, scratch[warm.delta:].view(warm.dqa), call.shape.head_dim)
    return grads


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             do: torch.Tensor, call: Call, deterministic: bool = False,
             delta: torch.Tensor | None = None, dbias: torch.Tensor | None = None) -> Grads:
    """(dq, dk, dv) of a checked call: the kernels on a GPU, the interpreter on CPU, empty on meta.

    ``out`` and ``lse`` are the forward's; ``do`` is the gradient of ``out``.
    Rows that see no key get zero gradients, and so do keys no query sees.
    ``deterministic``: bitwise reproducible gradients on a GPU too (the
    interpreter's always are). ``delta``: a float32 (batch, heads_q, seqlen_q)
    tensor the backward writes rowsum(dO * O) into, for the sinks' gradient
    (``sinks_backward``); a call with it takes the general path. ``dbias``: for
    a call with a bias, its gradient is also written there
    (``empty_bias_grad``'s tensor: dS, each element once, by flash_bwd_dq's
    BIAS_GRAD variant; no atomics, so it is bitwise reproducible too); a call
    with it takes the general path.
    """
    if dbias is not None:
        check_bias_grad(q, call, dbias)
    elif q.is_cuda and delta is None:
        warm = _warm_backward(q, k, v, out, lse, do, call, deterministic)
        if warm is not None:
            return one_key_rows(warm, call, call.shape.seqlen_k)
    grads = _computed(q, k, v, out, lse, do, call, deterministic, delta, dbias)
    return one_key_rows(grads, call, call.shape.seqlen_k, dbias)


def one_key_rows(grads: Grads, call: Call, max_seqlen_k: int, dbias: torch.Tensor | None = None) -> Grads:
    """``grads`` with dq, dk (and ``dbias``) exactly zero where every row's softmax is over at most one key.

    A softmax over one key is 1 whatever its score, so the score's gradient
    dS = P * (dP - delta) is exactly zero (with a cap, ALiBi, a bias or
    dropout too); the kernels compute dP and delta = rowsum(dO * O) as sums
    in different orders, which leaves their rounding (~1e-7 of dP) in dq and
    dk. With sinks the sink joins every softmax, so P < 1 and dS is not zero:
    left as computed. Only calls whose keys are at most one (``max_seqlen_k``)
    pay the fills.
    """
    if max_seqlen_k == 1 and call.sinks is None:
        for g in (grads.dq, grads.dk, *(() if dbias is None else (dbias,))):
            g.zero_()
    return grads


def _computed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              do: torch.Tensor, call: Call, deterministic: bool, delta: torch.Tensor | None,
              dbias: torch.Tensor | None) -> Grads:
    """``backward``'s general path: the kernels on a GPU, the interpreter on CPU, empty on meta."""
    grads = empty_grads(q, k, v)
    if q.device.type == "meta":
        return grads
    if grads.dq.numel() == 0 or grads.dk.numel() == 0:
        for g in (*grads, *(() if delta is None else (delta,)), *(() if dbias is None else (dbias,))):
            g.zero_()
        return grads
    lse = lse if lse.is_contiguous() else lse.contiguous()
    if q.device.type == "cpu":
        run_interpreter(q, k, v, out, lse, do, grads, call, delta, dbias)
    else:
        launch_gpu(q, k, v, out, lse, do, grads, call, deterministic=deterministic, delta=delta, dbias=dbias)
    return grads


def sinks_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, call: Call, deterministic: bool = False,
                   dbias: torch.Tensor | None = None) -> tuple[Grads, torch.Tensor]:
    """``backward`` (``dbias`` as it takes it) and the sinks' gradient (float32, (heads_q,)) from its delta.

    d(sinks)_h = -sum over batch and rows of exp(sink_h - lse) * delta
    (``flash_fwd.sinks.grad``): no pass over K or V beyond the backward's own.
    """
    delta = _delta(q, call.shape)
    grads = backward(q, k, v, out, lse, do, call, deterministic, delta, dbias)
    return grads, fwd_sinks.grad(call.sinks, lse, delta, 1)


def check_bias_grad(q: torch.Tensor, call: Call, dbias: Any) -> None:
    """Refuse a bias gradient ``backward`` cannot write: a call without a bias, or not ``empty_bias_grad``'s.

    Its shape (batch, heads_q, seqlen_q, seqlen_k), q's dtype and device, a
    contiguous last dim, and a 16-byte aligned pointer and outer strides that
    are multiples of 16 (ALIGN16's hints cover them).
    """
    if call.bias is None:
        raise ValueError("dbias (the bias's gradient) was given for a call without a bias")
    b, hq, _, sq, sk, _ = call.shape
    if not isinstance(dbias, torch.Tensor) or dbias.dtype != q.dtype or dbias.device != q.device \
            or tuple(dbias.shape) != (b, hq, sq, sk) or (dbias.stride(-1) != 1 and sk > 1) \
            or (dbias.data_ptr() | dbias.stride(0) | dbias.stride(1) | dbias.stride(2)) & 15:
        raise ValueError(f"dbias must be a {q.dtype} tensor of shape {(b, hq, sq, sk)} on {q.device} with a "
                         f"contiguous last dim and 16-aligned strides (binding.empty_bias_grad's), got "
                         f"{shown(dbias)}")


def preload(device: torch.device, dtype: torch.dtype, call: Call, aligned: bool = True,
            index64: bool = False, seq16: bool | None = None,
            deterministic: bool = False, bias_grad: bool = False) -> tuple[Variant, Variant]:
    """Load the two kernels a backward of this shape would use on ``device`` now; their variants.

    The two are flash_bwd's, or the fused pair (``flash_bwd_prep``,
    ``flash_bwd_fused_gluon``) where it serves, which ``deterministic``
    (``backward``'s) rules out. ``seq16``: ``pack``'s; None, dispatch's rule
    for the shape (``flash_bwd.dispatch.seq_aligned``). ``bias_grad``: a
    call with a bias whose gradient is wanted (flash_bwd_dq's BIAS_GRAD variant).
    """
    shape = call.shape
    causal = call.causal != "none"
    rt = runtime.get()
    window, softcap, mods, dv = call.windowed, call.capped, call.mods, call.head_dim_v
    seq16 = _seq16(seq16, aligned, shape)
    fused_ = fused_fits(call, dtype, aligned, index64, seq16, deterministic)
    gluon = not fused_ and gluon_fits(call, dtype, aligned, index64)
    if bias_grad and not mods[1]:
        raise ValueError("bias_grad=True needs a call with a bias (attn_mask)")
    plan(rt, memo_key(device.index, dtype, shape, causal, aligned, index64, window, softcap, mods, dv, seq16, gluon,
                      fused_, bias_grad, call.chunked),
         device, dtype, shape, causal, aligned, index64, window, softcap, mods, dv, seq16, gluon, fused_,
         bias_grad=bias_grad, chunk=call.chunked)
    if fused_:
        pair = fused_variants(machine.target_of_device(device), dtype, shape, causal, aligned, index64)
        if pair is not None:
            return pair
    return variants(machine.target_of_device(device), dtype, shape, causal, aligned, index64, window, softcap,
                    mods, dv, seq16, gluon, bias_grad, call.chunked)

