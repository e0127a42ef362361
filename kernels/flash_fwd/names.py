"""The caller's names for the attention arguments, so that errors speak the caller's language.

Every check of the attention families (``binding.check``, ``score_mods.with_mods``, the backward's
``check_grad``) takes a ``Names``; the public functions pass their own spelling (``sm_scale`` or
``softmax_scale``, ``query`` or ``q``).
"""

from __future__ import annotations

from lazytriton.record import NamedTuple


class Names(NamedTuple):
    """The caller's names for the arguments, so that errors speak the caller's language."""

    q: str = "q"
    k: str = "k"
    v: str = "v"
    causal: str = "causal"
    scale: str = "sm_scale"
    window: str = "window_size"
    softcap: str = "softcap"
    alibi: str = "alibi_slopes"
    bias: str = "attn_mask"
    dropout: str = "dropout_p"
    sinks: str = "sinks"


NAMES = Names()
