"""``preload``: load now, on the GPU, the kernels that calls of given shapes will use (before a CUDA graph capture).

``import lazytriton`` does not import this module (it imports torch): the
name is re-exported lazily by ``lazytriton/__init__.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.arguments import check_bool
from lazytriton.kernels.flash_fwd import binding

_NO_WINDOW = (-1, -1)  # attn_fwd's default: no sliding window

def preload(q: torch.Tensor | tuple[int, ...], k: torch.Tensor | tuple[int, ...], *, causal: bool | str = False,
            layout: str = "bhsd", dtype: torch.dtype | None = None, device: Any = None,
            backward: bool = False, window_size: tuple[int, int] = _NO_WINDOW, softcap: float = 0.0,
            alibi: bool = False, dropout: bool = False, attn_mask: bool = False,
            head_dim_v: int | None = None, deterministic: bool = False, sinks: bool = False,
            bias_grad: bool = False, attention_chunk: int = 0) -> list[str]:
    """Load now, on the GPU, the kernels that calls of these shapes will use; the variants loaded.

    Call it before capturing a CUDA graph (or before ``torch.compile(...,
    mode="reduce-overhead")``): a call whose kernel is not loaded yet cannot
    load or compile it during a capture, and raises a clear error instead. The
    kernels come from the images, the cache or, failing those, the JIT.

    Args:
        q: an example query tensor (on the target GPU) or its shape.
        k: an example key tensor or its shape (v has k's shape).
        causal: as in ``attn_fwd`` (False, True/"top_left", "bottom_right"); the
            two alignments share one kernel.
        layout: "bhsd" (SDPA, ``attn_fwd``) or "bshd" (``flash_attn_func``).
        dtype: for shapes (default float16); taken from ``q`` when it is a tensor. float8_e4m3fn (or
            float8_e5m2) loads the FP8 forward's kernel (``q_descale``'s calls; a call without descales
            needs nothing more: the kernel reads an absent one's null pointer as 1.0).
        device: for shapes (default the current CUDA device); taken from ``q``
            when it is a tensor.
        backward: also load the backward's kernels (to capture a training
            step's backward in a CUDA graph).
        window_size: as in ``attn_fwd``: calls with a window use their own kernels.
        softcap: as in ``attn_fwd``: calls with a softcap use their own kernels.
        alibi: calls with ALiBi slopes use their own kernels.
        dropout: calls with dropout_p > 0 use their own kernels (to capture
            dropout in a CUDA graph, preload with ``dropout=True``).
        attn_mask: SDPA calls with an attn_mask use their own kernels.
        head_dim_v: v's head dim where it differs from k's (None: k's).
        deterministic: with ``backward``, the kernels of a deterministic
            backward (``flash_attn_func(..., deterministic=True)``, or
            ``torch.use_deterministic_algorithms(True)`` while it is on).
        sinks: calls with attention sinks use their own forward kernels.
        bias_grad: with ``backward`` and ``attn_mask``, the kernels of a
            backward that also computes the mask's gradient (an attn_mask
            that requires grad).
        attention_chunk: as in ``attn_fwd``: calls with a chunk use their own
            kernels (one for every chunk size: the size is a runtime argument).

    Both 16-byte-aligned and unaligned kernels exist; for shapes the aligned
    one is loaded when every stride of a contiguous tensor allows it (as
    torch's allocations do), and for tensors the one their pointers select.

    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if check_bool("bias_grad", bias_grad) and not check_bool("backward", backward):
        raise ValueError("bias_grad=True describes the backward: pass backward=True (and attn_mask=True)")
    shapes = [t if isinstance(t, torch.Tensor) else _shape(name, t) for name, t in (("q", q), ("k", k))]
    if isinstance(q, torch.Tensor):
        dtype, device = q.dtype, q.device
    dtype = torch.float16 if dtype is None else dtype
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA/ROCm GPU (preload loads GPU kernels), got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tensors = [t if isinstance(t, torch.Tensor) else torch.empty(t, dtype=dtype, device="meta") for t in shapes]
    if layout == "bshd":
        tensors = [t.transpose(1, 2) for t in tensors]
    qt, kt = tensors
    vt = kt
    if head_dim_v is not None:
        if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
            raise TypeError(f"head_dim_v must be an int or None, got {type(head_dim_v).__name__}")
        vt = binding.empty_like_head_dim(kt.to("meta"), head_dim_v)
    if dtype in binding.FP8_DTYPES:
        return _fp8(device, qt, kt, vt, causal, window_size, softcap, attention_chunk,
                    {"alibi": alibi, "dropout": dropout, "attn_mask": attn_mask, "sinks": sinks, "backward": backward})
    call = binding.check(qt, kt, vt, causal, None, window=window_size, softcap=softcap)
    call = _meta_mods(call, qt, check_bool("alibi", alibi), check_bool("dropout", dropout),
                      check_bool("attn_mask", attn_mask))
    if check_bool("sinks", sinks):  # a stand-in: only the flag matters
        call = call._replace(sinks=torch.empty(call.shape.heads_q, device="meta"))
    call = binding.with_chunk(call, attention_chunk)
    # The binding's own rule; shapes are meta tensors, whose pointers (0) count as aligned.
    out, lse = binding.empty_outputs(qt, call.shape, call.head_dim_v)
    _, aligned, index64 = binding.pack(qt, kt, vt, out, lse, call)
    loaded = [str(binding.preload(device, dtype, call, aligned, index64))]
    if check_bool("backward", backward):
        from lazytriton.kernels.flash_bwd import binding as bwd_binding

        # The backward's own rule (SEQ16 when the seqlens are multiples of 16 too), on the same meta tensors.
        grads = bwd_binding.empty_grads(qt, kt, vt)
        _, _, bwd_aligned, seq16, bwd_index64 = bwd_binding.pack(qt, kt, vt, out, out, lse, lse, *grads, call)
        loaded += [str(v) for v in bwd_binding.preload(device, dtype, call, bwd_aligned, bwd_index64, seq16,
                                                       check_bool("deterministic", deterministic),
                                                       bias_grad=bias_grad)]
    return loaded


def _fp8(device: torch.device, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Any, window_size: Any,
         softcap: Any, attention_chunk: Any, refused: dict[str, Any]) -> list[str]:
    """The FP8 forward's preload (float8 inputs): its kernel; forward only."""
    from lazytriton.kernels.flash_fwd import fp8

    for name, value in refused.items():
        if check_bool(name, value):
            raise ValueError(f"{name}=True: the FP8 forward (float8 inputs) takes no ALiBi, dropout, mask or sinks, "
                             "and has no backward")
    call = binding.with_chunk(binding.check(q, k, v, causal, None, window=window_size, softcap=softcap, fp8=True),
                              attention_chunk)
    return [str(fp8.preload(device, q, k, v, call))]


def _meta_mods(call: binding.Call, q: torch.Tensor, alibi: bool, dropout: bool, attn_mask: bool) -> binding.Call:
    """``call`` with stand-in (meta) slopes, bias and Philox tensors for the flags asked: only the flags matter."""
    if not (alibi or dropout or attn_mask):
        return call
    b, hq, _, sq, sk, _ = call.shape
    meta = torch.device("meta")
    return call._replace(alibi=torch.empty(hq, dtype=torch.float32, device=meta) if alibi else None,
                         bias=torch.empty(1, dtype=q.dtype, device=meta).expand(b, hq, sq, sk) if attn_mask else None,
                         dropout_p=0.5 if dropout else 0.0,
                         philox=torch.empty(2, dtype=torch.int64, device=meta) if dropout else None)


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 4 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise TypeError(f"{name} must be a tensor or a shape of 4 non-negative ints, got {shape!r}")
    return tuple(shape)


__all__ = ["preload"]
