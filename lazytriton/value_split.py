"""A v of 257..512 columns without qv, where the MLA forward cannot serve the call: flash_fwd over v's column pieces.

Attention is linear in v: softmax(s) @ [v1 | v2] = [softmax(s) @ v1 | softmax(s) @ v2], and a row's logsumexp
reads only q and k. So such a call runs the regular forward (``kernels/flash_fwd``, through the public functions'
own path: the binding, ``lazytriton.eager`` or the torch ops) twice, on v's first 256 columns and on the rest
(``geometry.value_pieces``), with the same q, k and flags, and concatenates the outputs; the logsumexp is the
first call's (the second's is the same). The result is exact, and the backward is the regular one: autograd sums
dq and dk over the pieces and joins dv's. Dropout draws one Philox pair for both calls, so they drop the same
probabilities.

``lazytriton.mla_calls`` sends a call here when it has no qv and uses ALiBi, dropout or sinks (which the MLA
forward, ``kernels/flash_fwd_mla``, lacks), attention_chunk or seqused_q/seqused_k (which it has, forward only),
or wants a gradient (``wanted``): the regular forward has each of them and a backward. The choice reads shapes,
flags and ``requires_grad`` only, never a tensor's values, so torch.compile traces it and a CUDA graph captures it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lazytriton import geometry
from lazytriton.kernels.arguments import index_tensor
from lazytriton.kernels.flash_fwd import binding, score_mods, sinks, varlen
from lazytriton.kernels.flash_fwd.names import Names
from lazytriton.kernels.flash_fwd_mla.binding import check_head_dim_v
from lazytriton.record import NamedTuple

_Tensor = torch.Tensor
# The public functions' run (``lazytriton.interface.run``): (q, k, v, call, deterministic) -> (out, lse).
Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, binding.Call, bool], tuple[torch.Tensor, torch.Tensor]]


class Extras(NamedTuple):
    """A call's arguments that flash_fwd takes (the MLA forward takes the chunk and seqused ones too), as given."""

    alibi_slopes: Any = None
    dropout_p: float = 0.0  # checked by the public function
    sinks: Any = None  # ``sinks`` or ``s_aux``, whichever was given
    attention_chunk: Any = 0
    seqused_q: Any = None
    seqused_k: Any = None
    deterministic: bool = False

    def given(self) -> dict[str, bool]:
        """Which of them the call sets, by the public functions' names (the MLA forward refuses each by name)."""
        return {"alibi_slopes": self.alibi_slopes is not None, "dropout_p": self.dropout_p != 0.0,
                "sinks": self.sinks is not None, "attention_chunk": not (type(self.attention_chunk) is int
                                                                         and self.attention_chunk == 0),
                "seqused_q": self.seqused_q is not None, "seqused_k": self.seqused_k is not None}


def grad_wanted(*tensors: Any) -> bool:
    """Autograd records the call: it is on, and one of the tensors requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, _Tensor) and t.requires_grad for t in tensors)


def wanted(v: Any, qv: Any, extras: Extras, q: Any, k: Any) -> bool:
    """The call runs over v's pieces: no qv, v over 256 columns, and something the MLA forward lacks."""
    if qv is not None or not (isinstance(v, _Tensor) and v.dim() > 0 and v.shape[-1] > geometry.MAX_HEAD_DIM):
        return False
    return any(extras.given().values()) or grad_wanted(q, k, v, extras.sinks)


def pieces(v: torch.Tensor, name: str = "v") -> tuple[torch.Tensor, torch.Tensor]:
    """V's two column pieces (views), its head dim checked first (1..512, a ValueError naming ``name``)."""
    first, _ = geometry.value_pieces(check_head_dim_v(v, name))
    return v[..., :first], v[..., first:]


def _second(call: binding.Call, v2: torch.Tensor) -> binding.Call:
    """The first piece's call for the second piece: only v's head dim differs."""
    dv = v2.shape[-1]
    return call._replace(head_dim_v=0 if dv == call.shape.head_dim else dv)


def attention(q: Any, k: Any, v: Any, causal: Any, scale: Any, names: Names, window: Any, softcap: Any,
              extras: Extras, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense call, q, k, v in (B, H, S, D) order, over v's pieces: (out, lse). ``run``: ``interface.run``."""
    v1, v2 = pieces(v, names.v)
    call = binding.check(q, k, v1, causal, scale, names, window, softcap)
    call = binding.with_chunk(sinks.with_sinks(call, q, extras.sinks, names), extras.attention_chunk)
    if extras.alibi_slopes is not None or extras.dropout_p > 0.0:  # interface.with_mods' draw, once for both
        philox = (score_mods.draw_philox(q.device, score_mods.dense_elements(call)) if extras.dropout_p > 0.0
                  else None)
        call = score_mods.with_mods(call, q, index_tensor(extras.alibi_slopes), None, extras.dropout_p, philox, names)
    out1, lse = run(q, k, v1, call, extras.deterministic)
    out2, _ = run(q, k, v2, _second(call, v2), extras.deterministic)
    return torch.cat((out1, out2), dim=-1), lse


def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                     max_seqlen_k: Any, causal: Any, scale: Any, window: Any, softcap: Any, extras: Extras,
                     plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed call ((total, heads, dim) tensors) over v's pieces: (out, lse (heads_q, total_q)).

    ``plain``: ``interface.direct``. A plain call that wants no gradient reads the values of cu_seqlens and seqused
    once (one device-to-host read) and runs the binding twice; any other runs the torch op twice, each of which
    checks the values (two reads, none while tracing or capturing).
    """
    v1, v2 = pieces(v)
    cu_q, cu_k, alibi = index_tensor(cu_seqlens_q), index_tensor(cu_seqlens_k), index_tensor(extras.alibi_slopes)
    used_q, used_k = index_tensor(extras.seqused_q), index_tensor(extras.seqused_k)
    eager = (plain and all(t is None or type(t) is _Tensor for t in (cu_q, cu_k, used_q, used_k))
             and not grad_wanted(q, k, v, extras.sinks))
    p = extras.dropout_p
    philox = (score_mods.draw_philox(q.device, score_mods.packed_elements(q, k)) if p > 0.0 and isinstance(q, _Tensor)
              else None)
    vc = varlen.check(q, k, v1, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
                      values=None if eager else False, alibi=alibi, dropout_p=p, philox=philox, seqused_q=used_q,
                      seqused_k=used_k, sinks=extras.sinks, attention_chunk=extras.attention_chunk)
    if eager:
        out1, lse = varlen.forward(q, k, v1, cu_q, cu_k, vc)
        out2, _ = varlen.forward(q, k, v2, cu_q, cu_k, vc._replace(call=_second(vc.call, v2)))
        return torch.cat((out1, out2), dim=-1), lse
    from lazytriton.ops_varlen import flash_varlen_fwd_op

    c = vc.call
    rest = (vc.max_seqlen_q, vc.max_seqlen_k, c.scale, causal, c.window_left, c.window_right, c.softcap, c.alibi,
            c.dropout_p, c.philox, used_q, used_k, c.sinks, c.attention_chunk)
    out1, lse = flash_varlen_fwd_op(q, k, v1, cu_q, cu_k, *rest)
    out2, _ = flash_varlen_fwd_op(q, k, v2, cu_q, cu_k, *rest)
    return torch.cat((out1, out2), dim=-1), lse
