"""The public functions' FP8 calls (FlashAttention-3's FP8 forward): checked, then the binding or the torch op.

``flash_attn_func``, ``attn_fwd``, ``flash_attn_varlen_func`` and the SDPA drop-in send float8 inputs (e4m3, e5m2) here
with ``plain`` (``interface.direct``: plain tensors, nothing tracing, no dispatch mode). A plain dense call of a
shape already described is served by the warm path (``kernels/flash_fwd/fp8_hot.py``: one dict read of what the
checks read; ``flash_attn_func`` reaches it in its own layout through ``flash_attn_warm``); otherwise every
argument is checked first (``kernels/flash_fwd/fp8.py``); a plain call with plain descales then runs the binding,
any other goes through the torch op (``lazytriton.fp8_op``, imported on first use as ``lazytriton.ops`` is),
which torch.compile(fullgraph=True) traces without a break. The FP8 forward has no backward: a call whose q, k or v
requires grad (grad mode on) goes through the op too, whose backward raises NotImplementedError (FlashAttention-3's
forward takes such inputs and fails only on a backward).
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_hot

_Tensor = torch.Tensor


def _plain(tensors: tuple[Any, ...]) -> bool:
    return all(t is None or type(t) is _Tensor for t in tensors)


def _wants_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd records the call: the op's (raising) backward must then be attached to its outputs."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def attention(q: Any, k: Any, v: Any, causal: Any, scale: Any, names: binding.Names, window: Any, softcap: Any,
              attention_chunk: Any, given: tuple[Any, Any, Any], unsupported: dict[str, Any],
              plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense FP8 call in (B, H, S, D) order: (out bf16, lse).

    ``unsupported``: the caller's arguments the FP8 forward does not take, by name, true where given. A plain call
    of a described shape is served by ``fp8_hot.forward_bhsd`` (the warm path), which declines anything else.
    """
    if plain and _plain(given) and not any(unsupported.values()):
        warm = fp8_hot.forward_bhsd(q, k, v, causal, scale, given, window, softcap, attention_chunk)
        if warm is not None:
            return warm  # type: ignore[no-any-return]
    call = fp8.checked(q, k, v, causal, scale, names, window, softcap, attention_chunk, given, unsupported)
    if plain and _plain(given) and not _wants_grad(q, k, v):
        return fp8.forward(q, k, v, call, given)
    from lazytriton.fp8_op import flash_fwd_fp8_op

    return flash_fwd_fp8_op(q, k, v, *given, call.scale, call.causal, call.window_left,  # type: ignore[no-any-return]
                            call.window_right, call.softcap, call.attention_chunk)


def flash_attn_warm(q: Any, k: Any, v: Any, dropout_p: Any, softmax_scale: Any, causal: Any, window_size: Any,
                    softcap: Any, alibi_slopes: Any, deterministic: Any, return_attn_probs: Any, sinks: Any, s_aux: Any,
                    attention_chunk: Any, q_descale: Any, k_descale: Any, v_descale: Any) -> Any:
    """``flash_attn_func``'s FP8 call (plain (B, S, H, D) tensors: the caller's ``direct``) from its warm path.

    ``flash_attn_func``'s arguments in its order: its result (out, or ``(out, lse, None)``) for a call with
    nothing but causal, the scale and the descales set, of a shape already described (``fp8_hot``); None for
    anything else, which the caller sends through ``attention``.
    """
    if not (type(causal) is bool and type(dropout_p) is float and dropout_p == 0.0 and alibi_slopes is None
            and sinks is None and s_aux is None and type(softcap) is float and softcap == 0.0
            and type(window_size) is tuple and window_size == binding.NO_WINDOW and type(attention_chunk) is int
            and attention_chunk == 0 and type(deterministic) is bool and type(return_attn_probs) is bool
            and (q_descale is None or type(q_descale) is _Tensor) and (k_descale is None or type(k_descale) is _Tensor)
            and (v_descale is None or type(v_descale) is _Tensor)):
        return None
    given = (q_descale, k_descale, v_descale)
    if not return_attn_probs:
        return fp8_hot.output_bshd(q, k, v, "bottom_right" if causal else False, softmax_scale, given)
    warm = fp8_hot.forward_bshd(q, k, v, "bottom_right" if causal else False, softmax_scale, given)
    return None if warm is None else (*warm, None)


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                     max_seqlen_k: Any, causal: Any, scale: Any, window: Any, softcap: Any, seqused_q: Any,
                     seqused_k: Any, attention_chunk: Any, given: tuple[Any, Any, Any], unsupported: dict[str, Any],
                     plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed FP8 call (``flash_attn_varlen_func``'s): (out bf16, lse (heads_q, total_q)).

    Through the op, the op reads the values of cu_seqlens and seqused (one device-to-host read a call, not two).
    """
    cu_q, cu_k, used_q, used_k = (index_tensor(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    plain = plain and _plain((q, k, v, cu_q, cu_k, used_q, used_k, *given)) and not _wants_grad(q, k, v)
    vc = fp8.checked_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, used_q,
                            used_k, attention_chunk, given, unsupported, values=None if plain else False)
    if plain:
        return fp8.varlen_forward(q, k, v, cu_q, cu_k, vc, given)
    from lazytriton.fp8_op import flash_varlen_fwd_fp8_op

    c = vc.call
    return flash_varlen_fwd_fp8_op(  # type: ignore[no-any-return]
        q, k, v, cu_q, cu_k, vc.max_seqlen_q, vc.max_seqlen_k, *given, c.scale, causal, c.window_left,
        c.window_right, c.softcap, used_q, used_k, c.attention_chunk)
