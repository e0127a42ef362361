"""FlashAttention forward, served from the kernel cache: ``lazytriton.flash.attn_fwd``.

The lower-level call, returning ``(out, lse)`` in SDPA's layout; defined with
the other public functions in ``lazytriton.interface`` (its docstring is
there). ``lazytriton.flash_attn_func`` and
``lazytriton.scaled_dot_product_attention`` are the drop-ins for
FlashAttention-2 and torch.
"""

from __future__ import annotations

from lazytriton.interface import attn_fwd

__all__ = ["attn_fwd"]
