"""Which forward serves a call beside flash_fwd's general path: the warm path, the FP8 forward or the MLA forward.

Their modules are imported late. The public functions (``lazytriton.interface``, ``lazytriton.sdpa``) ask here
before their own checks. The FP8 forward's modules (``lazytriton.fp8_calls``, ``kernels/flash_fwd/fp8.py``) and
the MLA forward's (``lazytriton.mla_calls``, ``kernels/flash_fwd_mla``) come with the first call that needs
them, not with ``import lazytriton``: a cold process that never runs them never pays their import. The warm
paths' module (``kernels/flash_fwd/hot.py``) comes with the first call it can serve (``WarmPathsLater``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from lazytriton import geometry, runtime
from lazytriton.kernels.flash_fwd import binding

HOT = "lazytriton.kernels.flash_fwd.hot"


def _declined(*args: Any) -> None:
    """A warm path's answer while nothing can be served warm: None, the general path serves the call."""
    return None


class WarmPathsLater:
    """Stands in a module's globals for ``kernels/flash_fwd/hot.py`` until one of its warm paths can serve.

    A warm path serves only a shape the runtime has memoised a plan for, and
    never a call whose q, k or v requires grad (hot.py's own rule), so a fresh
    process's first call never needs hot.py (~40 KiB of bytecode, ~0.3-0.6 ms
    of import), nor does a training step's forward. Its functions read here
    (``hot.forward_bhsd``, ...) decline while no plan is memoised and hot.py is
    not imported; once a plan is memoised they decline calls with gradients
    and import the module for the first other call. From then on the module
    is in the caller's globals in this stand-in's place, so that its call
    sites read hot.py's own functions, at no cost per call after that.
    """

    def __init__(self, namespace: dict[str, Any], name: str) -> None:
        self._namespace = namespace
        self._name = name

    def __getattr__(self, function: str) -> Any:
        if function.startswith("_"):
            raise AttributeError(function)
        hot = sys.modules.get(HOT)
        if hot is None:
            rt = runtime.current()
            if rt is None or not rt.plans:
                return _declined
            first_use = self._first_use(function)
            # An attribute from now on, no __getattr__: a training call's decline costs what hot.py's would.
            setattr(self, function, first_use)
            return first_use
        self._namespace[self._name] = hot
        return getattr(hot, function)

    def _first_use(self, function: str) -> Any:
        """``function`` of hot.py for a call without gradients (imported then); None for one with them."""
        def first_use(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
            if q.requires_grad or k.requires_grad or v.requires_grad:  # the warm paths decline these
                return None
            hot = importlib.import_module(HOT)
            self._namespace[self._name] = hot
            return getattr(hot, function)(q, k, v, *args, **kwargs)

        return first_use


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
