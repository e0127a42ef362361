"""The public functions' FP8 calls (FlashAttention-3's FP8 forward): checked, then the binding or the torch op.

``flash_attn_func``, ``attn_fwd``, ``flash_attn_varlen_func`` and the SDPA drop-in send float8_e4m3fn inputs here
with ``plain`` (``interface.direct``: plain tensors, nothing tracing, no dispatch mode). A plain dense call of a
shape already described is served by the warm path (``kernels/flash_fwd/fp8_hot.py``: one dict read of what the
checks read); otherwise every argument is checked first (``kernels/flash_fwd/fp8.py``); a plain call with plain
descales then runs the binding, any other goes through the torch op (``lazytriton.fp8_op``, imported on first use as ``lazytriton.ops`` is), which
torch.compile(fullgraph=True) traces without a break. The FP8 forward has no backward, so there is no autograd
here: an input that requires grad is refused by the checks.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_hot

_Tensor = torch.Tensor


def _plain(tensors: tuple[Any, ...]) -> bool:
    return all(t is None or type(t) is _Tensor for t in tensors)


def attention(q: Any, k: Any, v: Any, causal: Any, scale: Any, names: binding.Names, window: Any, softcap: Any,
              attention_chunk: Any, given: tuple[Any, Any, Any], unsupported: dict[str, Any],
              plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense FP8 call in (B, H, S, D) order: (out bf16, lse).

    ``unsupported``: the caller's arguments the FP8 forward does not take, by name, true where given. A plain call
    of a described shape is served by ``fp8_hot.serve`` (the warm path), which declines anything else.
    """
    if plain and _plain(given) and not any(unsupported.values()):
        warm = fp8_hot.serve(q, k, v, causal, scale, window, softcap, attention_chunk, given)
        if warm is not None:
            return warm  # type: ignore[no-any-return]
    call = fp8.checked(q, k, v, causal, scale, names, window, softcap, attention_chunk, given, unsupported)
    if plain and _plain(given):
        return fp8.forward(q, k, v, call, given)
    from lazytriton.fp8_op import flash_fwd_fp8_op

    return flash_fwd_fp8_op(q, k, v, *given, call.scale, call.causal, call.window_left,  # type: ignore[no-any-return]
                            call.window_right, call.softcap, call.attention_chunk)


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                     max_seqlen_k: Any, causal: Any, scale: Any, window: Any, softcap: Any, seqused_q: Any,
                     seqused_k: Any, attention_chunk: Any, given: tuple[Any, Any, Any], unsupported: dict[str, Any],
                     plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed FP8 call (``flash_attn_varlen_func``'s): (out bf16, lse (heads_q, total_q)).

    Through the op, the op reads the values of cu_seqlens and seqused (one device-to-host read a call, not two).
    """
    cu_q, cu_k, used_q, used_k = (index_tensor(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    plain = plain and _plain((cu_q, cu_k, used_q, used_k, *given))
    vc = fp8.checked_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, used_q,
                            used_k, attention_chunk, given, unsupported, values=None if plain else False)
    if plain:
        return fp8.varlen_forward(q, k, v, cu_q, cu_k, vc, given)
    from lazytriton.fp8_op import flash_varlen_fwd_fp8_op

    c = vc.call
    return flash_varlen_fwd_fp8_op(  # type: ignore[no-any-return]
        q, k, v, cu_q, cu_k, vc.max_seqlen_q, vc.max_seqlen_k, *given, c.scale, causal, c.window_left,
        c.window_right, c.softcap, used_q, used_k, c.attention_chunk)
