"""``scaled_dot_product_attention``: torch's SDPA signature over the forward's binding.

The layout work (batch dims and heads broadcast as torch's, the output's
shape) and the ``attn_mask`` as an additive bias are here; the call itself
goes the way ``lazytriton.interface``'s functions go (``interface.run``:
the binding directly when nothing traces, else the torch op).
``import lazytriton`` does not import this module: ``lazytriton/__init__.py``
re-exports its names lazily.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from lazytriton import interface, sdpa_nested
from lazytriton.forward_routes import WarmPathsLater
from lazytriton.kernels.arguments import check_bool, check_dropout
from lazytriton.kernels.flash_fwd import binding
from lazytriton.kernels.flash_fwd import sinks as attention_sinks

hot: Any = WarmPathsLater(globals(), "hot")  # kernels/flash_fwd/hot.py once a warm path can serve
NAMES = binding.Names(q="query", k="key", v="value", causal="is_causal", scale="scale")


class SDPAError(ValueError, RuntimeError):
    """Misuse of ``scaled_dot_product_attention``: a ValueError, and the RuntimeError torch raises for it."""


class SDPATypeError(TypeError, RuntimeError):
    """A wrong type in ``scaled_dot_product_attention``: a TypeError, and the RuntimeError torch raises for it."""


def broadcast_shapes(*shapes: tuple[int, ...] | torch.Size) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to under torch's rule, or None where they do not broadcast.

    ``torch.broadcast_shapes``' answer on concrete sizes, at a tenth of its
    cost (~2 µs against ~18: it goes through torch's symbolic-shape guards),
    which a decoding step pays twice a layer.
    """
    rank = 0
    for shape in shapes:
        rank = max(rank, len(shape))
    out = [1] * rank
    for shape in shapes:
        for i, size in enumerate(shape, rank - len(shape)):
            if size != out[i]:
                if out[i] != 1 and size != 1:
                    return None
                if size != 1:
                    out[i] = size
    return tuple(out)


def layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """q, k, v as (batch, heads, seqlen, head_dim) views, and the output's shape.

    Dims before the last three (-3 is heads) are batch dims; they broadcast as
    in torch, and are flattened into one (a view where the strides allow it,
    else a copy). Heads broadcast too (a key/value head count of 1 is MQA, no
    copy); with ``enable_gqa`` the key/value heads may divide the query heads.
    """
    def heads(t: torch.Tensor) -> int:
        return t.shape[-3] if t.dim() >= 3 else 1

    batch = broadcast_shapes(*(t.shape[:-3] for t in (query, key, value)))
    if batch is None:
        raise SDPAError(f"the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                        f"{tuple(value.shape)} do not broadcast")
    hq, hk, hv = heads(query), heads(key), heads(value)
    if hk != hv:
        raise SDPAError(f"key has {hk} heads but value has {hv}; they must match")
    if enable_gqa:
        if hk == 0 or hq % hk:
            raise SDPAError(f"with enable_gqa=True the heads of key and value ({hk}) must divide the heads of "
                            f"query ({hq})")
    elif hk not in (hq, 1) and hq != 1:
        raise SDPAError(f"query has {hq} heads but key and value have {hk}: the sizes must match (or be 1); "
                        "for grouped-query attention pass enable_gqa=True")
    hq_out = hq if enable_gqa or hk == 1 else max(hq, hk)

    def to4(t: torch.Tensor, h: int) -> torch.Tensor:
        t3 = t if t.dim() >= 3 else t.unsqueeze(0)
        target = (*batch, h, *t3.shape[-2:])
        full = t3 if tuple(t3.shape) == target else t3.expand(target)
        return full if full.dim() == 4 else full.reshape(-1, h, *t3.shape[-2:])

    out_shape = (*batch, hq_out, query.shape[-2], value.shape[-1]) if query.dim() >= 3 else tuple(query.shape)
    return to4(query, hq_out), to4(key, hk), to4(value, hk), out_shape


def additive_bias(attn_mask: Any, q4: torch.Tensor, out_shape: tuple[int, ...], seqlen_k: int,
               is_causal: bool) -> torch.Tensor:
    """SDPA's ``attn_mask`` as the kernel's additive bias: a (batch, heads, seqlen_q, seqlen_k) view of q's dtype.

    A boolean mask becomes 0/-inf at its own size, then every broadcast dim
    is an expanded (stride 0) view: nothing is materialised at full size.
    A float mask that requires grad stays in the graph (its conversion,
    expand and reshape are autograd's): the backward's gradient of the bias,
    dS at (batch, heads, seqlen_q, seqlen_k) as torch's mem-efficient
    backend materialises its grad_bias, comes back summed over every dim the
    mask broadcasts along and in the mask's dtype. That sum is one torch
    reduction of a tensor each of whose tiles the dQ kernel wrote once, not
    float32 atomics into the mask's size: it keeps the backward bitwise
    reproducible (flash_bwd's kernels use no atomics) and needs no zeroed
    accumulator nor a pass to cast it, at the memory torch's own backend takes.
    """
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if is_causal:
        raise ValueError("attn_mask and is_causal=True were both given; torch refuses the pair too (\"Explicit "
                         "attn_mask should not be set when is_causal=True\"): fold the causal mask into attn_mask")
    if attn_mask.dtype not in (torch.bool, torch.float32, q4.dtype):
        raise TypeError(f"attn_mask must be boolean, float32 or query's dtype {q4.dtype}, got {attn_mask.dtype}")
    if attn_mask.device != q4.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {q4.device}")
    target = (*out_shape[:-1], seqlen_k)
    if broadcast_shapes(attn_mask.shape, target) != target:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (..., heads, seqlen_q, "
                         f"seqlen_k) = {target}")
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=q4.dtype, device=q4.device).masked_fill_(~attn_mask, float("-inf"))
    else:
        bias = attn_mask.to(q4.dtype)
    b, h, sq, _ = q4.shape
    return bias.expand(target).reshape(b, h, sq, seqlen_k)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, served from lazytriton's kernel cache.

    A drop-in for torch's function: same arguments, same layout
    (..., heads, seqlen, head_dim), same semantics: ``is_causal`` is top-left
    aligned (query i sees key j when j <= i), the batch dims and a key/value
    head count of 1 broadcast, grouped-query attention only with
    ``enable_gqa=True``, and misuse that torch reports with a RuntimeError
    raises an error that is both that RuntimeError and a ValueError/TypeError
    naming the argument (``SDPAError``, ``SDPATypeError``).

    Args:
        query: (..., heads_q, seqlen_q, head_dim), float16, bfloat16 or float32; or float8_e4m3fn/e5m2 (key
            and value the same): FlashAttention-3's FP8 forward with every descale 1.0, as torch's
            FlashAttention-3 route runs it (a UserWarning says so; ``attn_fwd`` takes the descales), out
            bfloat16, no attn_mask, dropout or backward.
        key: (..., heads_k, seqlen_k, head_dim).
        value: (..., heads_k, seqlen_k, head_dim_v): its head dim may differ
            from the query's (as torch allows; DeepSeek's MLA: 192 and 128).
        attn_mask: boolean (True: attend) or additive float mask,
            broadcastable to (..., heads_q, seqlen_q, seqlen_k); a float mask
            of another dtype than query's (float32 with half queries, as
            torch allows) is converted to query's dtype first (an fp16 mask
            turns values below -65504 into -inf). Broadcast dims are never
            materialised; a boolean mask becomes an additive 0/-inf tensor
            of its own size. A query whose keys are all masked gets output 0
            (and zero gradients), as torch gives. A float mask that
            requires grad gets its gradient, as torch's mem-efficient backend
            gives it (dS, summed over the dims it broadcasts along, in its
            own dtype; 0 where it is -inf and on rows with every key
            masked). Not together with ``is_causal`` (torch raises too).
        dropout_p: dropout probability in [0, 1), applied whenever > 0 (as
            torch's function does; pass 0.0 in evaluation). On a CUDA
            device the mask is torch's memory-efficient backend's: the same
            Philox stream, seeded and offset by torch's CUDA generator, which
            advances as for that backend, so after the same
            ``torch.manual_seed`` both drop the same elements (inside a CUDA
            graph or a compiled graph the pair is drawn on the device instead,
            fresh at each replay).
        is_causal: top-left causal mask.
        scale: default 1/sqrt(head_dim).
        enable_gqa: allow heads_k to divide heads_q (GQA/MQA).

    Nested tensors (strided or jagged, (batch, heads, ragged seqlen,
    head_dim) as torch takes them, mixed with dense inputs and broadcast as
    torch does) run as one packed call and return a nested output of the
    query's layout (``sdpa_nested``): no attn_mask, and is_causal only where
    each sequence has as many queries as keys.

    Returns:
        The attention output, (..., heads_q, seqlen_q, head_dim_v), query's dtype.
        Differentiable with respect to any of query, key, value and a float
        attn_mask (broadcast batch dims and heads get their gradients
        summed, as in torch).

    """
    if (attn_mask is None and dropout_p == 0.0 and type(is_causal) is bool and type(enable_gqa) is bool
            and interface.direct(query, key, value)  # the warm path checks the rest (4 dims, heads, head dims)
            and not (query.is_nested or key.is_nested or value.is_nested)):  # a strided nested tensor has no sizes
        warm = hot.output_bhsd(query, key, value, is_causal, scale, enable_gqa)
        if warm is not None:
            return warm  # type: ignore[no-any-return]
    return masked(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
           dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with every argument checked, and the ``softcap`` and ``sinks`` it lacks.

    ``softcap`` > 0 caps the scaled scores (softcap * tanh(s / softcap)) before
    the mask's bias is added: the order of transformers' "eager" attention
    (Gemma 2), which SDPA cannot express. ``sinks``: float32 (heads of
    query,), attention sinks (gpt-oss's), one logit a query head joining
    every row's denominator after the mask (differentiable).
    """
    if sdpa_nested.given(query, key, value):
        check_bool("is_causal", is_causal)
        check_bool("enable_gqa", enable_gqa)
        if softcap or sinks is not None:
            raise SDPAError("softcap and sinks are not supported with nested tensors")
        try:
            check_dropout("dropout_p", dropout_p)
            return sdpa_nested.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        except (SDPAError, SDPATypeError):
            raise
        except TypeError as exc:
            raise SDPATypeError(str(exc)) from None
        except ValueError as exc:
            raise SDPAError(str(exc)) from None
    if isinstance(query, torch.Tensor) and query.dtype in binding.FP8_DTYPES:  # its modules imported then
        return _fp8(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks)
    mode = causal_bias_mode(attn_mask, is_causal, query, key)
    q4, k4, v4, call, out_shape = prepared(query, key, value, None if mode else attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa, softcap, mode)
    call = with_sinks(call, q4, sinks)
    out = interface.run(q4, k4, v4, call)[0]
    return out if out.shape == out_shape else out.reshape(out_shape)


FP8_WARNING = ("scaled_dot_product_attention on float8 inputs runs the FP8 forward with every descale 1.0 "
               "(SDPA has no descale arguments; torch's FlashAttention-3 route does the same, and warns too): for "
               "quantised inputs pass q_descale, k_descale and v_descale to lazytriton.attn_fwd or flash_attn_func")


def _fp8(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: Any,
         is_causal: Any, scale: Any, enable_gqa: Any, softcap: float, sinks: Any) -> torch.Tensor:
    """SDPA on float8 tensors (e4m3 or e5m2): FlashAttention-3's FP8 forward with every descale 1.0, out bfloat16.

    Torch's SDPA takes no descales; where it serves FP8 (its FlashAttention-3 implementation) it runs them as 1.0
    and warns (``FP8_WARNING``, here outside torch.compile's trace, which a warning would break). No attn_mask,
    dropout or sinks (the FP8 forward has none), no backward.
    """
    from lazytriton import fp8_calls

    try:
        check_bool("is_causal", is_causal)
        check_bool("enable_gqa", enable_gqa)
        q4, k4, v4, out_shape = layout(query, key, value, enable_gqa)
        unsupported = {"attn_mask": attn_mask is not None, "dropout_p": check_dropout("dropout_p", dropout_p) != 0.0,
                       "sinks": sinks is not None}
        out = fp8_calls.attention(q4, k4, v4, is_causal, scale, NAMES, binding.NO_WINDOW, softcap, 0, (None,) * 3,
                                  unsupported, interface.direct(q4, k4, v4))[0]
    except SDPAError:
        raise
    except TypeError as exc:
        raise SDPATypeError(str(exc)) from None
    except ValueError as exc:
        raise SDPAError(str(exc)) from None
    if not torch.compiler.is_compiling():
        warnings.warn(FP8_WARNING, UserWarning, stacklevel=4)
    return out if out.shape == out_shape else out.reshape(out_shape)


def causal_bias_mode(attn_mask: Any, is_causal: Any, query: Any, key: Any) -> str | None:
    """The causal mode a torch ``CausalBias`` mask stands for, or None for any other ``attn_mask``.

    ``causal_upper_left`` is "top_left", ``causal_lower_right`` "bottom_right": torch serves such a mask as that
    causal mask (its ``__torch_function__``), never as a tensor of values. Its sizes must be the call's, and
    ``is_causal`` must be False (torch's own refusal, in torch's words).
    """
    bias_module = sys.modules.get("torch.nn.attention.bias")  # loaded wherever a CausalBias was made
    if bias_module is None or not isinstance(attn_mask, bias_module.CausalBias):
        return None
    if is_causal:
        raise SDPAError("CausalBias should not be used with causal=True")
    sizes = (getattr(query, "shape", (0, 0))[-2], getattr(key, "shape", (0, 0))[-2])
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != sizes:
        raise SDPAError(f"attn_mask is a CausalBias of ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) query and "
                        f"key positions, but query and key have {sizes[0]} and {sizes[1]}")
    variant = bias_module.CausalVariant
    if attn_mask.variant == variant.UPPER_LEFT:
        return "top_left"
    if attn_mask.variant == variant.LOWER_RIGHT:
        return "bottom_right"
    raise SDPAError(f"attn_mask is a CausalBias of an unknown variant {attn_mask.variant!r}")


def prepared(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
             dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float = 0.0,
             causal_mode: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, binding.Call, tuple[int, ...]]:
    """``masked``'s checks and layout: (q4, k4, v4, the checked call, the output's shape), nothing launched.

    ``causal_mode`` ("top_left" or "bottom_right"): the causal mask a ``CausalBias`` stands for
    (``causal_bias_mode``), taking is_causal's place.

    The call depends on the tensors' sizes, strides, dtype and device, the
    scale, the cap and the mask's bias (it holds the bias tensor, and dropout's
    Philox draw when ``dropout_p`` > 0): a caller that repeats all of them may
    run it again on other tensors of the same layout (``interface.run``).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):  # argument types: a TypeError, as torch's own
            raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be Tensor, not "
                            f"{type(t).__name__}")
    check_bool("is_causal", is_causal)
    check_bool("enable_gqa", enable_gqa)
    try:  # misuse torch reports as a RuntimeError: ValueError/TypeError and RuntimeError here
        check_dropout("dropout_p", dropout_p)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() < 2:
                raise ValueError(f"{name} must have at least 2 dims (..., seqlen, head_dim), got shape "
                                 f"{tuple(t.shape)}")
        q4, k4, v4, out_shape = layout(query, key, value, enable_gqa)
        call = binding.check(q4, k4, v4, causal_mode or is_causal, scale, NAMES, softcap=softcap)
        bias = None if attn_mask is None else additive_bias(attn_mask, q4, out_shape, key.shape[-2], is_causal)
        call = interface.with_mods(call, q4, None, bias, dropout_p, NAMES)
    except SDPAError:
        raise
    except TypeError as exc:
        raise SDPATypeError(str(exc)) from None
    except ValueError as exc:
        raise SDPAError(str(exc)) from None
    return q4, k4, v4, call, out_shape


def with_sinks(call: binding.Call, q4: torch.Tensor, sinks: torch.Tensor | None) -> binding.Call:
    """``prepared``'s call with attention sinks (float32 (heads of query,), checked), or as it is without them."""
    if sinks is None:
        return call
    try:
        return attention_sinks.with_sinks(call, q4, sinks, NAMES)
    except TypeError as exc:
        raise SDPATypeError(str(exc)) from None
    except ValueError as exc:
        raise SDPAError(str(exc)) from None


__all__ = ["SDPAError", "SDPATypeError", "scaled_dot_product_attention"]
