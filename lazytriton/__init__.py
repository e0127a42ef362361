"""lazytriton: Triton FlashAttention kernels served from a cache.

No call waits for a compiler that could have run earlier.

``import lazytriton`` is light: it imports neither torch nor triton until an
attention call (``lazytriton.flash.attn_fwd``) needs torch, and triton only
when something must be compiled or interpreted.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = ("flash", "runtime", "dispatch", "config", "compiler")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"lazytriton.{name}")
    raise AttributeError(f"module 'lazytriton' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
