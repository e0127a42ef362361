"""Host side of FlashAttention-2's varlen call: packed sequences on flash_fwd and flash_bwd with ``VARLEN=true``.

``flash_attn_varlen_func`` takes packed (total_tokens, heads, head_dim)
tensors and int32 cumulative lengths ``cu_seqlens_q``/``cu_seqlens_k``
(batch + 1 entries, sequence i is rows cu[i]:cu[i + 1]). The kernels are the
dense ones with the ``VARLEN`` flag: program z is the sequence, which reads
its start and length from the cumulative lengths (kernels/flash_fwd/
__init__.py). Everything else is the dense bindings' own machinery:

- ``check`` turns the caller's arguments into one ``VarlenCall`` or raises a
  ``TypeError``/``ValueError`` naming the argument before anything runs. The
  values of the cumulative lengths (cu[0] == 0, nondecreasing, cu[-1] ==
  total tokens, max_seqlen at least the longest sequence) need a
  device-to-host read; it is skipped while a CUDA graph is being captured or
  torch.compile traces (``values=False``), where only shapes, dtypes and
  devices are checked and the caller answers for the values.
- The packed tensors are handed to the dense ``pack`` as one batch of
  total_tokens rows (views in the kernel's (batch, heads, seqlen, head_dim)
  order, no copy), with the two cu_seqlens pointers: so the strides, the
  alignment rule, the 64-bit index rule and the seqlen ints (total tokens,
  which the kernels replace by each sequence's length) are the dense call's.
- Grid, memo key and variant use ``kernel_shape``: (batch, max_seqlen_q,
  max_seqlen_k), so dispatch picks tiles by the max_seqlen buckets, and the
  memo key is the dense one marked ``"varlen"`` (never a dense call's plan).
- The logsumexp is FlashAttention-2's varlen layout (>= 2.4): float32
  (heads_q, total_q); a row whose sequence has no key gets output 0 and
  logsumexp -inf (as lazytriton's dense call; FlashAttention-2 writes +inf).
- FlashAttention-3's ``seqused_q``/``seqused_k`` (int32, one per sequence,
  optional): sequence i's queries are the first seqused_q[i] rows of its
  cu_seqlens span and its keys the first seqused_k[i] (the kernels'
  ``SEQUSED_Q``/``SEQUSED_K``); its causal and window alignment and ALiBi
  use those lengths. The rest of a span is never read (garbage there cannot
  leak); its rows of out get 0 and of lse -inf (a row that sees no key), its
  rows of dq, dk and dv 0. Their values (0 <= seqused <= the span) are
  checked with the cumulative lengths, in the same read; max_seqlen_q and
  max_seqlen_k stay at least the longest span, which the grids cover.
- ALiBi (slopes (heads_q,) or (batch, heads_q), one row per sequence,
  bottom-right within each sequence) and dropout (the dense call's Philox
  [seed, offset]) are the dense calls' score modifications (``score_mods``),
  checked against the sequence count; the kernels index dropout's mask over
  the packed (1, heads_q, total_q, total_k) scores, so every element of the
  batch has its own index and the backward regenerates the forward's mask.
- Attention sinks (``sinks``: float32 (heads_q,), the dense calls', ``SINKS``)
  join every row's denominator and lse; a row that sees no key gets out 0 and
  lse = its head's sink. ``sinks_backward`` gives their gradient from the
  delta the backward's first kernel writes.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import launch, runtime
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_fwd import (
    FLASH_FWD,
    MOD_POINTERS,
    SEQUSED_POINTERS,
    SINKS_POINTERS,
    VARLEN_POINTERS,
    score_mods,
)
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.kernels.flash_fwd import sinks as fwd_sinks
from lazytriton.kernels.flash_fwd.binding import Call, Shape
from lazytriton.kernels.trust import indices_trusted
from lazytriton.record import NamedTuple
from lazytriton.variant import Variant

MARK = "varlen"  # first item of a varlen call's memo keys (a dense call's never starts with it)


class VarlenCall(NamedTuple):
    """A checked varlen call: ``call`` in the pack's terms (one batch of total tokens) and the kernels' sizes."""

    call: Call  # Shape(1, heads_q, heads_k, total_q, total_k, head_dim), causal, scale, window, softcap
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    # FlashAttention-3's used lengths: int32 (batch,) tensors on q's device, or None (the whole span is used).
    seqused_q: Any = None
    seqused_k: Any = None

    @property
    def used(self) -> tuple[bool, bool]:
        """The kernels' SEQUSED_Q and SEQUSED_K flags."""
        return (self.seqused_q is not None, self.seqused_k is not None)

    @property
    def kernel_shape(self) -> Shape:
        """(batch, heads, max_seqlen_q, max_seqlen_k): what the grid, dispatch and the memo key see."""
        _, hq, hk, _, _, d = self.call.shape
        return Shape(self.batch, hq, hk, self.max_seqlen_q, self.max_seqlen_k, d)


# ---------------------------------------------------------------------------
# Checks


def _packed(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must have 3 dims (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")
    return t


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, heads, head_dim) tensor as the kernels' (1, heads, total, head_dim) view (no copy)."""
    return t.unsqueeze(0).transpose(1, 2)


def _cu_seqlens(name: str, cu: Any, q: torch.Tensor) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    if cu.stride(0) != 1 and cu.numel() > 1:
        raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}")
    if cu.device != q.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; they must be on one device")
    return cu


def _seqused(name: str, t: Any, batch: int, q: torch.Tensor) -> torch.Tensor | None:
    """One of seqused_q/seqused_k: None, or an int32 (batch,) tensor, contiguous, on q's device."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or None, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), one used length per sequence, got shape "
                         f"{tuple(t.shape)}")
    if t.stride(0) != 1 and batch > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on one device")
    return t


def _max_seqlen(name: str, value: Any) -> int:
    """A max_seqlen: 0 (every sequence empty, as FlashAttention allows) to INT32_MAX."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= fwd.INT32_MAX:
        raise ValueError(f"{name} must be in 0..{fwd.INT32_MAX}, got {value}")
    return value


def reading_values_is_safe(cu_q: torch.Tensor, cu_k: torch.Tensor, *used: torch.Tensor | None) -> bool:
    """Whether cu_seqlens (and the seqused tensors given, None for absent) are read to the host now.

    Not while capturing a CUDA graph or tracing, nor inside
    ``trusted_indices()`` (kernels/trust.py: the caller built them right).
    """
    if indices_trusted() or torch.compiler.is_compiling():
        return False
    given = (cu_q, cu_k, *(t for t in used if t is not None))
    if any(type(t) is not torch.Tensor or t.device.type == "meta" for t in given):
        return False
    return not (cu_q.is_cuda and launch.capturing(cu_q.get_device()))


def check_values(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_seqlen_q: int,
                 max_seqlen_k: int, used_q: torch.Tensor | None = None, used_k: torch.Tensor | None = None) -> None:
    """The values of the cumulative lengths and seqused (one device-to-host read), or a ValueError naming it.

    ``used_q``/``used_k`` (seqused_q/seqused_k, None: absent): each in
    0..the length of its sequence's span.
    """
    read = torch.cat([t for t in (cu_q, cu_k, used_q, used_k) if t is not None]).tolist()
    n = cu_q.numel()  # batch + 1; each seqused tensor has batch values
    rest = read[2 * n:]
    used_values: list[list[int] | None] = []
    for t in (used_q, used_k):
        used_values.append(None if t is None else rest[:n - 1])
        rest = rest[0 if t is None else n - 1:]
    for name, cu, total, max_name, max_seqlen, used in (
            ("cu_seqlens_q", read[:n], total_q, "max_seqlen_q", max_seqlen_q, used_values[0]),
            ("cu_seqlens_k", read[n:2 * n], total_k, "max_seqlen_k", max_seqlen_k, used_values[1])):
        if cu[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
        lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        if any(n < 0 for n in lengths):
            at = next(i for i, n in enumerate(lengths) if n < 0)
            raise ValueError(f"{name} must be nondecreasing, got {name}[{at}] = {cu[at]} > {name}[{at + 1}] = "
                             f"{cu[at + 1]}")
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] must be the total number of tokens ({total}), got {cu[-1]}")
        longest = max(lengths, default=0)
        if longest > max_seqlen:
            raise ValueError(f"{max_name} ({max_seqlen}) must be at least the longest sequence in {name} "
                             f"({longest})")
        if used is not None:
            _check_used(f"seqused_{name[-1]}", used, lengths, name)


def _check_used(name: str, used: list[int], lengths: list[int], cu_name: str) -> None:
    """The values of seqused: sequence i uses 0..lengths[i] of its span (ValueError naming the first that does not)."""
    bad = next((i for i, (n, span) in enumerate(zip(used, lengths, strict=True)) if not 0 <= n <= span), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}] = {used[bad]}: must be in 0..{lengths[bad]} (sequence {bad}'s length in "
                         f"{cu_name})")


def check(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
          causal: Any = False, scale: Any = None, window: Any = fwd.NO_WINDOW, softcap: Any = 0.0,
          values: bool | None = None, alibi: Any = None, dropout_p: Any = 0.0, philox: Any = None,
          seqused_q: Any = None, seqused_k: Any = None, sinks: Any = None, attention_chunk: Any = 0,
          fp8: bool = False) -> VarlenCall:
    """The checked varlen call, or a TypeError/ValueError naming the argument.

    ``causal``: a bool, aligned bottom-right within each sequence (FlashAttention-2's rule, with
    seqused's lengths where given). ``values``: check the values of the cumulative
    lengths and seqused (a device-to-host read); None does so unless a CUDA graph capture
    or a torch.compile trace is in progress. ``alibi``, ``dropout_p`` and
    ``philox`` as ``score_mods.with_mods`` takes them, the slopes' batch being
    the number of sequences. ``seqused_q``, ``seqused_k``: FlashAttention-3's
    used lengths, int32 (batch,) tensors on q's device, or None. ``sinks``:
    attention sinks, float32 (heads_q,) on q's device, or None. ``attention_chunk``:
    FlashAttention-3's chunk size (0: off), each sequence's chunks aligned bottom-right. ``fp8``: float8_e4m3fn
    or float8_e5m2 tensors (the FP8 forward's), as ``binding.check`` takes them.
    """
    q, k, v = _packed("q", q), _packed("k", k), _packed("v", v)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same shape (total_k, heads_k, head_dim) but for v's head dim, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k has head dim {k.shape[2]} but q has head dim {q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) for GQA/MQA")
    cu_q, cu_k = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, q), _cu_seqlens("cu_seqlens_k", cu_seqlens_k, q)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got {cu_q.numel()} and "
                         f"{cu_k.numel()}")
    batch = cu_q.numel() - 1
    if batch > fwd.MAX_GRID_YZ:
        raise ValueError(f"batch (cu_seqlens_q has {batch} + 1 entries) must be at most {fwd.MAX_GRID_YZ}")
    used_q, used_k = _seqused("seqused_q", seqused_q, batch, q), _seqused("seqused_k", seqused_k, batch, q)
    sq, sk = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k", max_seqlen_k)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    call = fwd.check(kernel_view(q), kernel_view(k), kernel_view(v), "bottom_right" if causal else False, scale,
                     fwd.Names(scale="softmax_scale"), window, softcap, fp8)
    call = fwd.with_chunk(call, attention_chunk)
    call = fwd_sinks.with_sinks(call._replace(offset=0), q, sinks)  # offset: each sequence's own len_k - len_q
    if values is None:
        values = reading_values_is_safe(cu_q, cu_k, used_q, used_k)
    if values:
        check_values(cu_q, cu_k, q.shape[0], k.shape[0], sq, sk, used_q, used_k)
    vc = VarlenCall(call, batch, sq, sk, used_q, used_k)
    if alibi is None and (type(dropout_p) is float or type(dropout_p) is int) and dropout_p == 0:
        return vc
    # with_mods checks the slopes against the call's batch: the kernel shape's is the number of sequences.
    modded = score_mods.with_mods(call._replace(shape=vc.kernel_shape), q, alibi, None, dropout_p, philox,
                                  fwd.Names(scale="softmax_scale"))
    return vc._replace(call=modded._replace(shape=call.shape))


def check_grad(q: torch.Tensor, out: Any, lse: Any, do: Any, head_dim_v: int = 0) -> None:
    """Refuse ``do``/``out`` unless they match q's packed shape, dtype and device, and a wrong ``lse``.

    Their head dim is v's, ``head_dim_v`` (0: q's).
    """
    shape = (*q.shape[:2], head_dim_v or q.shape[2])
    for name, t in (("do", do), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype or t.device != q.device or tuple(t.shape) != shape:
            raise ValueError(f"{name} must have the output's shape {shape}, dtype {q.dtype} and device {q.device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
        if t.stride(-1) != 1 and t.shape[-1] > 1 and t.numel():
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    expected = (q.shape[1], q.shape[0])
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32 or lse.device != q.device or tuple(lse.shape) != expected:
        raise ValueError(f"lse must be the forward's float32 logsumexp of shape {expected} (heads_q, total_q) on "
                         f"{q.device}, got {lse.dtype} {tuple(lse.shape)} on {lse.device}")


# ---------------------------------------------------------------------------
# Memo keys, variants, constexprs


def _used_tail(vc: VarlenCall) -> tuple[Any, ...]:
    """A memo key's tail for seqused: none without it (the keys of calls without seqused are unchanged)."""
    return ("seqused", *vc.used) if vc.seqused_q is not None or vc.seqused_k is not None else ()


def memo_key(device_index: int | None, dtype: torch.dtype, vc: VarlenCall, aligned: bool,
             index64: bool) -> tuple[Any, ...]:
    """The forward's memo key: the dense one of the kernel shape, marked ``"varlen"`` (and seqused's flags)."""
    call = vc.call
    return (MARK, *fwd.memo_key(device_index, dtype, vc.kernel_shape, call.causal != "none", aligned, index64,
                                call.windowed, call.capped, call.mods, call.head_dim_v, sinks=call.sunk,
                                chunk=call.chunked),
            *_used_tail(vc))


def bwd_memo_key(device_index: int | None, dtype: torch.dtype, vc: VarlenCall, aligned: bool,
                 index64: bool) -> tuple[Any, ...]:
    """The backward's memo key: the dense backward's of the kernel shape, marked ``"varlen"`` (never SEQ16)."""
    call = vc.call
    return (MARK, *bwd.memo_key(device_index, dtype, vc.kernel_shape, call.causal != "none", aligned, index64,
                                call.windowed, call.capped, call.mods, call.head_dim_v, seq16=False,
                                chunk=call.chunked), *_used_tail(vc))


def variants(kernels: tuple[str, ...], target: Any, dtype: torch.dtype, vc: VarlenCall, aligned: bool,
             index64: bool) -> tuple[Variant, ...]:
    """The variants of ``kernels`` serving a varlen call (dispatch decides, by the max_seqlen buckets).

    The call's sinks are the forward's flag (the backward kernels read them through the lse).
    """
    call, shape = vc.call, vc.kernel_shape
    return tuple(dispatch.kernel_variant(kernel, target, fwd.DTYPES[dtype], shape.head_dim, call.causal != "none",
                                         aligned, shape.seqlen_q, shape.seqlen_k, index64=index64,
                                         window=call.windowed, softcap=call.capped, alibi=call.mods[0],
                                         dropout=call.mods[2], varlen=True, head_dim_v=call.head_dim_v,
                                         seqused_q=vc.used[0], seqused_k=vc.used[1],
                                         sinks=call.sunk and kernel in FORWARD, chunk=call.chunked)
                 for kernel in kernels)


FORWARD = (FLASH_FWD.name,)
# The pointers after each kernel's own that Triton's interpreter takes as tensors: cu_seqlens, the mods', seqused;
# the forward's sinks after them.
_SKIP_POINTERS = len(VARLEN_POINTERS) + len(MOD_POINTERS) + len(SEQUSED_POINTERS)
_SKIP_FWD_POINTERS = _SKIP_POINTERS + len(SINKS_POINTERS)
BACKWARD = (FLASH_BWD_DQ.name, FLASH_BWD_DKDV.name)


def _plan(rt: Any, key: tuple[Any, ...], kernels: tuple[str, ...], tile: tuple[str, ...], device: torch.device,
          dtype: torch.dtype, vc: VarlenCall, aligned: bool, index64: bool) -> tuple[Any, ...]:
    """(kernel, its grid tile, ...) for ``kernels``, memoised in ``rt.plans``; refused during a CUDA graph capture."""
    def choose(target: Any) -> launch.Choice:
        return tuple((variant, (name,)) for variant, name in zip(variants(kernels, target, dtype, vc, aligned,
                                                                          index64), tile, strict=True))

    return launch.plan(rt, key, device, choose, "run the varlen call once with this shape (forward and backward) "
                       "before the capture")


def host_lengths(vc: VarlenCall, cu_q: torch.Tensor, cu_k: torch.Tensor) -> VarlenCall:
    """``vc`` with max_seqlen_q/max_seqlen_k cut to the longest sequences, read from host cu_seqlens (no sync).

    On the CPU the interpreter walks every program of the grid, and the grid
    is sized by max_seqlen (a GPU call cannot read the lengths without a
    sync): a valid but huge max_seqlen_q (2**31 - 1) with a few real tokens
    would keep it busy for minutes. Each program reads its own sequence's
    length from cu_seqlens, so a grid cut to the longest sequence computes
    the same result. Never longer than the caller's max_seqlen.
    """
    if vc.batch == 0:
        return vc
    longest_q = int((cu_q[1:] - cu_q[:-1]).max())
    longest_k = int((cu_k[1:] - cu_k[:-1]).max())
    return vc._replace(max_seqlen_q=max(1, min(vc.max_seqlen_q, longest_q)),
                       max_seqlen_k=max(1, min(vc.max_seqlen_k, longest_k)))


def _used(vc: VarlenCall) -> tuple[Any, Any, dict[str, bool]]:
    """The seqused pointers as ``pack`` and Triton's interpreter take them (0 when absent) and their constexprs."""
    used_q, used_k = (0 if t is None else t for t in (vc.seqused_q, vc.seqused_k))
    return used_q, used_k, {"VARLEN": True, "SEQUSED_Q": vc.used[0], "SEQUSED_K": vc.used[1]}


def _pointer(t: Any) -> int:
    return t if isinstance(t, int) else t.data_ptr()


# ---------------------------------------------------------------------------
# Forward


def empty_outputs(q: torch.Tensor, head_dim_v: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs: out (q's packed shape and dtype) and lse, float32 (heads_q, total_q), FlashAttention-2's layout.

    out's head dim is v's, ``head_dim_v`` (0: q's).
    """
    return (fwd.empty_like_head_dim(q, head_dim_v or q.shape[2]),
            torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
            vc: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a checked varlen call: the kernel on a GPU, the interpreter on CPU, empty on meta."""
    out, lse = empty_outputs(q, vc.call.head_dim_v)
    if out.numel() == 0 or q.device.type == "meta" or vc.batch == 0:
        return out, lse
    if vc.max_seqlen_q == 0 or vc.max_seqlen_k == 0:  # no query, or no key to see: nothing to launch
        return out.zero_(), fwd_sinks.lse_of_no_key(vc.call, lse, 0)
    if q.device.type == "cpu":
        run_interpreter(q, k, v, out, lse, cu_q, cu_k, vc)
    else:
        launch_gpu(q, k, v, out, lse, cu_q, cu_k, vc)
    return out, lse


def run_interpreter(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    cu_q: torch.Tensor, cu_k: torch.Tensor, vc: VarlenCall) -> None:
    """The forward kernel through Triton's interpreter on CPU tensors (its grid cut to the longest sequence)."""
    from lazytriton import compiler

    views = (kernel_view(q), kernel_view(k), kernel_view(v), kernel_view(out), lse.unsqueeze(0))
    call = vc.call
    used_q, used_k, flags = _used(vc)
    ints = fwd.pack(*views, call, cu_q.data_ptr(), cu_k.data_ptr(), _pointer(used_q), _pointer(used_k))[0]
    vc = host_lengths(vc, cu_q, cu_k)
    shape = vc.kernel_shape
    fwd.warn_if_slow(shape)
    constexprs = {**fwd.interpreter_constexprs(shape, call.causal != "none", call.windowed, call.capped,
                                               call.mods, call.head_dim_v, call.sunk, call.chunked), **flags}
    args = (*views, cu_q, cu_k, *score_mods.mod_tensors(call, q), used_q, used_k, fwd_sinks.argument(call, q),
            *ints[_SKIP_FWD_POINTERS + fwd.N_TENSORS:], *fwd.floats(call))
    compiler.interpret(FLASH_FWD.name, fwd.grid(shape, constexprs["BLOCK_M"]), args, constexprs)


def launch_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               cu_q: torch.Tensor, cu_k: torch.Tensor, vc: VarlenCall) -> None:
    """The forward kernel's launch: pack, the memo key, the plan (made on a miss), one launch on the stream."""
    call = vc.call
    used_q, used_k, _ = _used(vc)
    ints, aligned, index64 = fwd.pack(kernel_view(q), kernel_view(k), kernel_view(v), kernel_view(out),
                                      lse.unsqueeze(0), call, cu_q.data_ptr(), cu_k.data_ptr(), _pointer(used_q),
                                      _pointer(used_k))
    device = q.device
    rt = runtime.get()
    key = memo_key(device.index, q.dtype, vc, aligned, index64)
    found = rt.plans.get(key)
    if found is None:
        found = _plan(rt, key, FORWARD, ("BLOCK_M",), device, q.dtype, vc, aligned, index64)
    kernel, block_m = found
    kernel.launch(fwd.grid(vc.kernel_shape, block_m), launch.raw_stream(device.index), ints, fwd.floats(call),
                  launch.scratch_alloc)


# ---------------------------------------------------------------------------
# Backward


def sinks_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   vc: VarlenCall) -> tuple[bwd.Grads, torch.Tensor]:
    """``backward`` and the gradient of the call's sinks, from the delta its first kernel writes.

    Rows past seqused_q, which the kernels skip, keep delta 0: they add nothing.
    """
    delta = torch.zeros(lse.shape, dtype=torch.float32, device=lse.device)
    grads = backward(q, k, v, out, lse, do, cu_q, cu_k, vc, delta)
    return grads, fwd_sinks.grad(vc.call.sinks, lse, delta, 0)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             do: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, vc: VarlenCall,
             delta: torch.Tensor | None = None) -> bwd.Grads:
    """(dq, dk, dv) of a checked varlen call; rows that see no key and keys no row sees get zero gradients.

    ``delta``: a float32 (heads_q, total_q) tensor the first kernel writes rowsum(dO * O) into (``sinks_backward``).
    """
    grads = bwd.empty_grads(q, k, v)
    if q.device.type == "meta":
        return grads
    if grads.dq.numel() == 0 or grads.dk.numel() == 0 or vc.batch == 0 or 0 in (vc.max_seqlen_q, vc.max_seqlen_k):
        for g in grads if delta is None else (*grads, delta):
            g.zero_()
        return grads
    lse = lse if lse.is_contiguous() else lse.contiguous()
    delta = torch.empty_like(lse) if delta is None else delta
    views = (kernel_view(q), kernel_view(k), kernel_view(v), kernel_view(out), kernel_view(do), lse.unsqueeze(0),
             delta.unsqueeze(0), kernel_view(grads.dq), kernel_view(grads.dk), kernel_view(grads.dv))
    call, shape = vc.call, vc.kernel_shape
    used_q, used_k, _ = _used(vc)
    dq_ints, dkdv_ints, aligned, _, index64 = bwd.pack(*views, call, cu_q.data_ptr(), cu_k.data_ptr(),
                                                       _pointer(used_q), _pointer(used_k))
    floats = fwd.floats(call)
    if q.device.type == "cpu":
        _interpret_backward(views, cu_q, cu_k, dq_ints, dkdv_ints, vc)
        return bwd.one_key_rows(grads, vc.call, vc.max_seqlen_k)
    device = q.device
    rt = runtime.get()
    key = bwd_memo_key(device.index, q.dtype, vc, aligned, index64)
    found = rt.plans.get(key)
    if found is None:
        found = _plan(rt, key, BACKWARD, ("BLOCK_M", "BLOCK_N"), device, q.dtype, vc, aligned, index64)
    dq_kernel, block_m, dkdv_kernel, block_n = found
    stream = launch.raw_stream(device.index)
    dq_grid, dkdv_grid = bwd.grids(shape, block_m, block_n)
    dq_kernel.launch(dq_grid, stream, dq_ints, floats, launch.scratch_alloc)
    dkdv_kernel.launch(dkdv_grid, stream, dkdv_ints, floats, launch.scratch_alloc)
    return bwd.one_key_rows(grads, vc.call, vc.max_seqlen_k)


def _interpret_backward(views: tuple[torch.Tensor, ...], cu_q: torch.Tensor, cu_k: torch.Tensor,
                        dq_ints: tuple[int, ...], dkdv_ints: tuple[int, ...], vc: VarlenCall) -> None:
    """Both backward kernels through Triton's interpreter on CPU tensors (views in the kernels' order)."""
    from lazytriton import compiler

    q, k, v, out, do, lse, delta, dq, dk, dv = views
    vc = host_lengths(vc, cu_q, cu_k)
    call, shape = vc.call, vc.kernel_shape
    fwd.warn_if_slow(shape)
    used_q, used_k, flags = _used(vc)
    constexprs = {**bwd.interpreter_constexprs(shape, call.causal != "none", call.windowed, call.capped, call.mods,
                                               call.head_dim_v, call.chunked), **flags}
    dq_grid, dkdv_grid = bwd.grids(shape, constexprs["BLOCK_M"], constexprs["BLOCK_N"])
    floats = fwd.floats(call)
    skip = bwd.N_TENSORS + _SKIP_POINTERS
    pointers = (cu_q, cu_k, *score_mods.mod_tensors(call, q), used_q, used_k)
    compiler.interpret(FLASH_BWD_DQ.name, dq_grid,
                       (q, k, v, out, do, lse, delta, dq, *pointers, *dq_ints[skip:], *floats), constexprs)
    compiler.interpret(FLASH_BWD_DKDV.name, dkdv_grid,
                       (q, k, v, do, lse, delta, dk, dv, *pointers, *dkdv_ints[skip:], *floats), constexprs)
