"""The compiled launch helper, when it is built, and the slot layout it launches from.

``fastlaunch_build.py`` compiles ``lazytriton.driver._fastlaunch`` (a small
CPython extension). With it, a launch is one C call that takes the integer and float
argument tuples as they are, points ``params[i]`` at slot ``layout[i]`` and
calls ``cuLaunchKernel`` (after the same context check as the ABI path).
Without it (not built, no compiler where lazytriton was installed, a HIP
device) ``LoadedKernel.launch`` fills its per-thread argument arrays through
cffi's ABI mode as before: same parameters, same buffer contents, slower.

``layout`` is the one description both paths launch from: it comes from an
Entry's ``arg_types`` and hidden arguments alone, so it serves any kernel.
"""

from __future__ import annotations

import functools
import importlib
import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("lazytriton.driver")

MODULE = "lazytriton.driver._fastlaunch"
NULL_SLOT = -32768  # the helper's LT_FAST_NULL_SLOT: a NULL pointer (hidden scratch of size 0)
MAX_PARAMS = 512  # LT_FAST_MAX_PARAMS
MAX_SLOTS = 32767
PUSH_FAILED = 1 << 24  # LT_FAST_PUSH_FAILED + CUDA error: cuCtxPushCurrent failed

_INT_TYPES = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"}
_enabled = [True]


class LayoutError(ValueError):
    """An entry's parameters cannot be described to the helper (a type it does not take, too many)."""


def layout(arg_types: Sequence[str], scratch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each kernel parameter is read from: int slot (>= 0), float slot (-1 - j) or NULL_SLOT.

    Pointers and integers take int slots in order, fp32 float slots in order,
    then one entry per hidden scratch parameter: NULL_SLOT when its size is 0,
    else the next int slot (the caller appends the scratch pointer to the
    integers). The ABI path's ``_slots`` assigns the same order.
    """
    slots: list[int] = []
    n_ints = n_floats = 0
    for kind in arg_types:
        if kind.startswith("*") or kind in _INT_TYPES:
            slots.append(n_ints)
            n_ints += 1
        elif kind == "fp32":
            slots.append(-1 - n_floats)
            n_floats += 1
        else:
            raise LayoutError(f"parameter type {kind!r} is not supported by the launcher")
    for size in scratch_sizes:
        if size > 0:
            slots.append(n_ints)
            n_ints += 1
        else:
            slots.append(NULL_SLOT)
    if len(slots) > MAX_PARAMS or n_ints > MAX_SLOTS or n_floats > MAX_SLOTS:
        raise LayoutError(f"{len(slots)} parameters; the helper takes at most {MAX_PARAMS}")
    return tuple(slots)


def enable(on: bool) -> bool:
    """Use the helper for kernels loaded from now on (when built); the previous setting (tests, benchmarks)."""
    previous = _enabled[0]
    _enabled[0] = on
    return previous


@functools.cache
def _module() -> Any:
    try:
        return importlib.import_module(MODULE)
    except Exception as exc:  # not built, or built for another Python / cffi
        log.debug("launch helper %s unavailable (%s): launches go through cffi's ABI mode", MODULE, exc)
        return None


def refresh() -> bool:
    """Look for the helper again (after ``fastlaunch_build.build()`` in this process); whether it is there now.

    Kernels loaded before keep the path they were loaded with; ``runtime.reset()`` reloads them.
    """
    _module.cache_clear()
    return available()


def available() -> bool:
    """True when the compiled helper imports (it may still be disabled by ``enable(False)``)."""
    return _module() is not None


def path_name() -> str:
    """Which launch path a kernel loaded now would take: "compiled helper" or "cffi ABI mode"."""
    return "compiled helper" if _enabled[0] and available() else "cffi ABI mode"


def make_driver(launch: int, ctx_get_current: int, ctx_push: int, ctx_pop: int) -> tuple[int, ...] | None:
    """The addresses of the four driver functions the helper calls; None without the helper."""
    if _module() is None:
        return None
    return (launch, ctx_get_current, ctx_push, ctx_pop)


def pack_plan(driver: tuple[int, ...], function: int, context: int, block: int, shared: int,
              slots: Sequence[int]) -> bytes:
    """The helper's plan for one loaded kernel (its C struct ``lt_plan``, then the int16 slots)."""
    n_ints = sum(1 for slot in slots if slot >= 0)
    n_floats = sum(1 for slot in slots if NULL_SLOT < slot < 0)
    header = struct.pack("<6Q2I4i", *driver, function, context, block, shared, len(slots), n_ints, n_floats, 0)
    return header + struct.pack(f"<{len(slots)}h", *slots)


def launcher(driver: tuple[int, ...] | None, function: int, context: int, block: int, shared: int,
             slots: Sequence[int]) -> Callable[..., int] | None:
    """``fast(grid_x, grid_y, grid_z, stream, ints, floats) -> status`` for one loaded kernel.

    None when the helper is off or not built. Status 0 is success, another
    value the CUDA error of ``cuLaunchKernel`` (``PUSH_FAILED`` + error: of
    the context push; ``describe`` tells). Arguments of the wrong type or
    count raise TypeError/ValueError before anything is launched.
    """
    module = _module()
    if driver is None or module is None or not _enabled[0]:
        return None
    return functools.partial(module.launch, pack_plan(driver, function, context, block, shared, slots))


def describe(status: int) -> tuple[str, int]:
    """(which driver call failed, its CUDA error) for a helper status other than 0."""
    if status >= PUSH_FAILED:
        return "cuCtxPushCurrent", status - PUSH_FAILED
    return "cuLaunchKernel", status
