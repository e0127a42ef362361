"""lazytriton: Triton FlashAttention kernels served from a cache.

No call waits for a compiler that could have run earlier.

The attention functions: ``flash_attn_func`` (FlashAttention-2's signature),
``scaled_dot_product_attention`` (torch's), ``attn_fwd`` (the lower-level
call, returning the logsumexp too) and ``preload`` (load kernels before a CUDA
graph capture); their docstrings are in ``lazytriton.interface``.

``import lazytriton`` is light: it imports neither torch nor triton until an
attention function is first looked up (then torch), and triton only when
something must be compiled or interpreted.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = ("flash", "runtime", "dispatch", "config", "compiler", "ops", "interface")
_FUNCTIONS = ("flash_attn_func", "scaled_dot_product_attention", "attn_fwd", "preload", "CaptureError")


def __getattr__(name: str) -> Any:
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module("lazytriton.interface"), name)
    elif name in _LAZY:
        value = importlib.import_module(f"lazytriton.{name}")
    else:
        raise AttributeError(f"module 'lazytriton' has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain attribute reads
    return value


__all__ = ["__version__", *_FUNCTIONS, *_LAZY]
