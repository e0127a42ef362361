"""Which forward serves a call beside flash_fwd's: the FP8 forward or the MLA forward, their modules imported late.

The public functions (``lazytriton.interface``) ask here before their own checks. The FP8 forward's modules
(``lazytriton.fp8_calls``, ``kernels/flash_fwd/fp8.py``) and the MLA forward's (``lazytriton.mla_calls``,
``kernels/flash_fwd_mla``) come with the first call that needs them, not with ``import lazytriton``: a cold
process that never runs them never pays their import.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import geometry
from lazytriton.kernels.flash_fwd import binding


def fp8_route(q: Any, descales: tuple[Any, Any, Any]) -> Any:
    """``lazytriton.fp8_calls`` when q is FP8; else None, once descales given without it are refused."""
    if isinstance(q, torch.Tensor) and q.dtype in binding.FP8_DTYPES:
        from lazytriton import fp8_calls

        return fp8_calls
    if descales[0] is not None or descales[1] is not None or descales[2] is not None:
        from lazytriton.kernels.flash_fwd import fp8

        fp8.refuse_descales(q, descales)
    return None


def mla_route(v: Any, qv: Any) -> Any:
    """``lazytriton.mla_calls`` when the call is the MLA forward's (qv given, or v over 256 columns); else None."""
    if qv is None and not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[-1] > geometry.MAX_HEAD_DIM):
        return None
    from lazytriton import mla_calls

    return mla_calls
