"""The public functions' MLA forward calls (``qv``, or v's head dim over 256): checked, then the binding or the op.

``flash_attn_func`` and ``flash_attn_varlen_func`` send a call here when it has FlashAttention-3's ``qv`` or a
v whose head dim flash_fwd does not take (257..512). Without qv, a call that uses ALiBi, dropout or sinks (which
the MLA forward lacks), attention_chunk or seqused, or wants a gradient (``value_split.wanted``) runs flash_fwd over
v's column pieces (``lazytriton.value_split``), which has each of them and a backward. Every other call runs the family
``kernels/flash_fwd_mla``, every argument checked first (a TypeError/ValueError naming it, before anything runs),
attention_chunk and (packed) seqused_q/seqused_k included (its CHUNK, SEQUSED_Q, SEQUSED_K); with qv, what it does
not take (ALiBi, dropout, sinks) is refused by name. A plain eager call that wants no gradient runs the binding; any
other goes through the torch op (``lazytriton.mla_op``, imported on first use), which torch.compile traces and
whose backward raises NotImplementedError: FlashAttention-3 has no backward with qv or v of more than 256 columns
either.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import geometry, value_split
from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_fwd.names import Names
from lazytriton.kernels.flash_fwd_mla import binding
from lazytriton.value_split import Extras as Extras  # the public functions build it: mla_calls.Extras

_Tensor = torch.Tensor


_TAKEN = ("attention_chunk", "seqused_q", "seqused_k")  # Extras the MLA forward takes (CHUNK, SEQUSED_Q/K)


def _refuse(extras: Extras) -> None:
    for name, on in extras.given().items():
        if on and name not in _TAKEN:
            raise ValueError(f"{name} is not taken with qv (the MLA forward, FlashAttention-3's): it has no ALiBi, "
                             "dropout or sinks (without qv, a v of more than "
                             f"{geometry.MAX_HEAD_DIM} columns takes them: flash_fwd over v's column pieces)")


def _eager(tensors: tuple[Any, ...]) -> bool:
    """Plain tensors, and no gradient wanted through them: the binding serves the call without the op."""
    if not all(t is None or type(t) is _Tensor for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def attention(q: Any, k: Any, v: Any, qv: Any, causal: Any, scale: Any, names: Names, window: Any, softcap: Any,
              extras: Extras, plain: bool, run: value_split.Run) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense call: q, k, v in (B, H, S, D) order, qv in FlashAttention's (B, Sq, Hq, Dv) or None: (out, lse).

    ``plain``: ``interface.direct``; ``run``: ``interface.run`` (flash_fwd's, for v's pieces). qv is checked in the
    caller's layout (its errors name the caller's shapes).
    """
    if value_split.wanted(v, qv, extras, q, k):
        return value_split.attention(q, k, v, causal, scale, names, window, softcap, extras, run)
    _refuse(extras)
    chunk = extras.attention_chunk
    if qv is not None:
        binding.check(q, k, v, None, causal, scale, names, window, softcap, chunk)
        binding.check_qv(qv, q.transpose(1, 2), v.shape[-1])
        qv = qv.transpose(1, 2)
    call = binding.check(q, k, v, qv, causal, scale, names, window, softcap, chunk)
    if plain and _eager((q, k, v, qv)):
        return binding.forward(q, k, v, qv, call)
    from lazytriton.mla_op import flash_fwd_mla_op

    c = call.attn
    return flash_fwd_mla_op(q, k, v, qv, c.scale, c.causal, c.window_left, c.window_right,  # type: ignore[no-any-return]
                            c.softcap, c.attention_chunk)


def varlen_attention(q: Any, k: Any, v: Any, qv: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                     max_seqlen_k: Any, causal: Any, scale: Any, window: Any, softcap: Any,
                     extras: Extras, plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed call ((total, heads, dim) tensors, qv too): (out, lse (heads_q, total_q)).

    Through the op, the op reads the values of cu_seqlens (one device-to-host read a call, not two).
    """
    if value_split.wanted(v, qv, extras, q, k):
        return value_split.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                            scale, window, softcap, extras, plain)
    _refuse(extras)
    cu_q, cu_k = index_tensor(cu_seqlens_q), index_tensor(cu_seqlens_k)
    used_q, used_k = index_tensor(extras.seqused_q), index_tensor(extras.seqused_k)
    plain = plain and _eager((q, k, v, qv)) and all(t is None or type(t) is _Tensor for t in (cu_q, cu_k, used_q,
                                                                                               used_k))
    vc, _ = binding.check_varlen(q, k, v, qv, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                                 softcap, values=None if plain else False, seqused_q=used_q, seqused_k=used_k,
                                 attention_chunk=extras.attention_chunk)
    if plain:
        return binding.varlen_forward(q, k, v, qv, cu_q, cu_k, vc)
    from lazytriton.mla_op import flash_varlen_fwd_mla_op

    c = vc.call
    return flash_varlen_fwd_mla_op(  # type: ignore[no-any-return]
        q, k, v, qv, cu_q, cu_k, vc.max_seqlen_q, vc.max_seqlen_k, c.scale, causal, c.window_left, c.window_right,
        c.softcap, used_q, used_k, c.attention_chunk)
