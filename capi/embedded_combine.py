"""The Python half of ``lt_flash_combine`` (capi/lt_combine.c): its planner and its host-memory call.

``embedded.attach`` binds these to the library. The C half has checked every
argument before they run. The planner resolves the combine kernel through
the binding (``flash_combine.variant``, as a Python call of that shape class
would), loads it on the device and answers what the C launch needs. The
host-memory call checks the call again (``checks.check``) and runs the
binding's interpreter on the caller's memory (no copy), writing out and lse
in place.
"""

from __future__ import annotations

from typing import Any

from lazytriton.capi.common import PYTHON, check_entry_layout, host_tensor

_ffi: Any = None


def flash_combine_cpu(p: Any) -> int:
    """lt_flash_combine on host memory: the binding's interpreter run into the caller's out and lse."""
    import torch

    from lazytriton.kernels.flash_combine import binding, checks

    out_partial, lse_partial, out, lse = (host_tensor(_ffi, t) for t in (p.out_partial, p.lse_partial, p.out,
                                                                          p.lse))
    call = checks.check(out_partial, lse_partial, out)
    with torch.no_grad():
        binding.run_interpreter(out_partial, lse_partial, out, lse, call)
    return 0


def plan_variant(capability: int, dtype_code: int, head_dim: int, aligned: bool, index64: bool) -> Any:
    """The flash_combine variant a C plan launches (pure): the binding's, for out's dtype (``dtype_code``)."""
    from lazytriton.kernels.flash_combine import variant
    from lazytriton.target import Target

    return variant(Target("cuda", str(capability), 32), {1: "fp16", 2: "bf16", 3: "fp32"}[dtype_code], head_dim,
                   aligned, index64)


def check_launch_layout(entry: Any) -> None:
    """Refuse an entry whose parameters lt_combine.c would not pass correctly (the binding's integers only)."""
    from lazytriton.kernels.flash_combine import INT_PARAMS

    check_entry_layout(entry, len(INT_PARAMS), ())


def plan(req: Any) -> int:
    """Resolve and load the combine kernel for the request's shape class; answer what lt_combine.c launches with."""
    import torch

    from lazytriton import runtime

    props = torch.cuda.get_device_properties(req.device_index)
    chosen = plan_variant(props.major * 10 + props.minor, req.dtype, req.head_dim, bool(req.aligned),
                          bool(req.index64))
    kernel = runtime.get().kernel(chosen, req.device_index)
    check_launch_layout(kernel.entry)
    req.function = int(_ffi.cast("uintptr_t", kernel.function))
    req.block_threads, req.shared_bytes = kernel.block, kernel.shared
    req.block_m, req.block_d = int(chosen.get("BLOCK_M")), int(chosen.get("BLOCK_D"))
    req.n_hidden = len(kernel.entry.hidden_args)
    text = str(chosen).encode()[:511]
    _ffi.memmove(req.variant, text, len(text))
    return 0


def attach(ffi: Any, guarded: Any) -> None:
    """Bind ``lt__py_combine_plan`` and ``lt__py_flash_combine_cpu`` (``guarded`` maps exceptions to statuses)."""
    global _ffi
    _ffi = ffi
    for name, fn in (("lt__py_combine_plan", plan), ("lt__py_flash_combine_cpu", flash_combine_cpu)):
        ffi.def_extern(name=name, error=PYTHON)(guarded(fn))
