"""FlashAttention-2's ``flash_attn`` package over lazytriton (its public functions, ``flash_attn_interface``).

The package's other modules (``bert_padding``, ``layers``, ``ops``: the peer's test helpers and references) come
from the peer's checkout: ``LAZYTRITON_PEER_DIR`` (set by ``benchmarks/peer_suites.py``) adds its ``flash_attn/``
folder after this one to the package's path.
"""

from __future__ import annotations

import os
from pathlib import Path

_peer = os.environ.get("LAZYTRITON_PEER_DIR")
if _peer:
    __path__.append(str(Path(_peer) / "flash_attn"))

from flash_attn.flash_attn_interface import (  # noqa: E402 (after the package's path is complete)
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
