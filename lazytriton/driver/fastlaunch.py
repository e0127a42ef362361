"""The compiled launch helper, when it is built, and the slot layout it launches from.

``fastlaunch_build.py`` compiles ``lazytriton.driver._fastlaunch`` (a small
CPython extension): into this package's folder when run as a command, or
into the cache dir in the background on first GPU use (helpers.py), where it
is looked for when the package has none. With it, a launch is one C call
that takes the integer and float argument tuples as they are, points
``params[i]`` at slot ``layout[i]`` and calls ``cuLaunchKernel`` (after the
same context check as the ABI path).
Without it (not built yet, no compiler, a HIP device) ``LoadedKernel.launch``
fills its per-thread argument arrays through cffi's ABI mode: same
parameters, same buffer contents, slower.

``layout`` is the one description both paths launch from: it comes from an
Entry's ``arg_types``, hidden arguments and host descriptors alone, so it
serves any kernel.

A host tensor descriptor parameter (``tensordesc<...>``, rank r) takes
1 + 2r of the caller's integers: the tensor's base pointer, its r sizes, its
r strides in elements (innermost 1). The kernel receives 1 + 2r parameters:
the 128-byte CUtensorMap encoded from them (``cuTensorMapEncodeTiled``, with
the Entry's ``tensordesc_meta``), then the sizes as i32 and the strides as
i64, read from the same integer slots. Both paths keep the last encoded map
per descriptor and encode again only when the integers change: Triton
encodes on every call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lazytriton.cache_format import tensordesc
from lazytriton.cache_format.tensordesc import TensorDescMeta

log = logging.getLogger("lazytriton.driver")

MODULE = "lazytriton.driver._fastlaunch"
PLAN_VERSION = 3  # the helper's PLAN_VERSION: 2 added the encode address and host descriptors, 3 cuLaunchKernelEx's
NULL_SLOT = -32768  # the helper's LT_FAST_NULL_SLOT: a NULL pointer (hidden scratch of size 0)
MAX_PARAMS = 512  # LT_FAST_MAX_PARAMS
MAX_SLOTS = 32767
PUSH_FAILED = 1 << 24  # LT_FAST_PUSH_FAILED + CUDA error: cuCtxPushCurrent failed
ENCODE_FAILED = 2 << 24  # LT_ENCODE_FAILED + CUDA error: cuTensorMapEncodeTiled failed
DESC_SLOT = -16384  # descriptor d is slot DESC_SLOT - d (LT_DESC_SLOT): its encoded map
MAX_DESCS = 16  # LT_MAX_DESCS
MAP_BYTES = 128  # sizeof(CUtensorMap); passed by value, 64-byte aligned
CACHE_RECORD = 12 * 8 + MAP_BYTES  # the helper's lt_desc_cache: valid flag, base, 5 sizes, 5 strides, the map
_DESC = struct.Struct("<5i5I")  # the helper's lt_desc: base slot, rank, swizzle, elem size, host dtype, box[5]

_INT_TYPES = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"}
_enabled = [True]


class LayoutError(ValueError):
    """An entry's parameters cannot be described to the helper (a type it does not take, too many)."""


def layout(arg_types: Sequence[str], scratch_sizes: Sequence[int],
           descriptors: Sequence[TensorDescMeta] = (), limit: bool = True) -> tuple[int, ...]:
    """Where each compiled kernel parameter is read from.

    An int slot (>= 0), a float slot (-1 - j), NULL_SLOT or a descriptor's
    map (DESC_SLOT - d). Pointers and integers take int slots in order, fp32 float slots in order,
    a host descriptor its map, then its sizes and strides from the 2r int slots
    after its base pointer's; then one entry per hidden scratch parameter:
    NULL_SLOT when its size is 0, else the next int slot (the caller appends
    the scratch pointer to the integers). ``limit``: refuse what the helper
    cannot take (the ABI path takes any count).
    """
    slots: list[int] = []
    n_ints = n_floats = n_descs = 0
    for kind in arg_types:
        if tensordesc.is_descriptor(kind):
            if n_descs >= len(descriptors):
                raise LayoutError(f"descriptor parameter {kind!r} has no tensordesc_meta")
            rank = descriptors[n_descs].rank
            slots.append(DESC_SLOT - n_descs)
            slots.extend(range(n_ints + 1, n_ints + 1 + 2 * rank))
            n_ints += 1 + 2 * rank
            n_descs += 1
        elif kind.startswith("*") or kind in _INT_TYPES:
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
    if n_descs != len(descriptors) or n_descs > MAX_DESCS:
        raise LayoutError(f"{n_descs} descriptor parameters for {len(descriptors)} tensordesc_meta entries "
                          f"(at most {MAX_DESCS})")
    if limit and (len(slots) > MAX_PARAMS or n_ints > MAX_SLOTS or n_floats > MAX_PARAMS):
        raise LayoutError(f"{len(slots)} parameters; the helper takes at most {MAX_PARAMS}")
    return tuple(slots)


def helper_takes(slots: Sequence[int]) -> bool:
    """Whether the helper takes ``layout(..., limit=False)``'s slots: what ``layout``'s limit refuses, read off them.

    A loaded kernel lays its parameters out once for both paths (the ABI
    path takes any count) and asks this for the helper's.
    """
    floats = sum(1 for slot in slots if DESC_SLOT < slot < 0)  # -1 - j; maps and NULL lie at or below DESC_SLOT
    return len(slots) <= MAX_PARAMS and int_slots(slots) <= MAX_SLOTS and floats <= MAX_PARAMS


def int_slots(slots: Sequence[int]) -> int:
    """How many integers a launch takes (scratch pointers included): one past the highest int slot.

    Not the count of int-slot parameters: a descriptor's base pointer has a slot but no parameter.
    """
    return 1 + max((slot for slot in slots if slot >= 0), default=-1)


def descriptor_bases(slots: Sequence[int]) -> tuple[int, ...]:
    """The int slot of each descriptor's base pointer (its sizes and strides follow), from ``layout``'s slots."""
    bases = []
    for i, slot in enumerate(slots):
        if DESC_SLOT - MAX_DESCS < slot <= DESC_SLOT:
            bases.append(slots[i + 1] - 1)
    return tuple(bases)


def encode_args(meta: TensorDescMeta, values: Sequence[int]) -> tuple[int, int, int, list[int], list[int], list[int]]:
    """The arguments of cuTensorMapEncodeTiled for one descriptor, as Triton's fillTMADescriptorTiled builds them.

    ``values``: base, sizes, strides (elements). Returns (host dtype, rank,
    base, globalDim, globalStrides in bytes, boxDim), innermost first; the
    rank - 1 strides skip the innermost one, which must be 1.
    """
    rank = meta.rank
    base, shape, strides = values[0], values[1:1 + rank], values[1 + rank:1 + 2 * rank]
    if strides[-1] != 1:
        raise ValueError(f"descriptor strides {list(strides)}: the innermost must be 1")
    return (meta.host_dtype, rank, base, list(reversed(shape)),
            [s * meta.elem_size for s in reversed(strides[:-1])], list(reversed(meta.block_size)))


def enable(on: bool) -> bool:
    """Use the helper for kernels loaded from now on (when built); the previous setting (tests, benchmarks)."""
    previous = _enabled[0]
    _enabled[0] = on
    return previous


def _import_package() -> Any:
    """The package's own build (``fastlaunch_build``), or None."""
    try:
        return importlib.import_module(MODULE)
    except Exception as exc:  # not built, or built for another Python / cffi
        log.debug("launch helper %s not in the package (%s)", MODULE, exc)
        return None


def import_file(where: str, path: Path) -> Any:
    """The helper module from ``where`` (a path the loader opens); None, and one log line, if it does not import."""
    from lazytriton.driver import trusted

    try:
        return trusted.load_extension(MODULE, where, path)
    except Exception as exc:  # built for another Python, a broken file
        log.warning("launch helper %s does not load (%s): launches go through cffi's ABI mode", path, exc)
        return None


def _usable(module: Any) -> bool:
    if module is None:
        return False
    if getattr(module, "PLAN_VERSION", 1) != PLAN_VERSION:  # built by an older lazytriton: another plan layout
        log.warning("launch helper %s reads plan version %s, this lazytriton packs %s: not used (python -m "
                    "lazytriton.driver.fastlaunch_build rebuilds it)", getattr(module, "__file__", MODULE),
                    getattr(module, "PLAN_VERSION", 1), PLAN_VERSION)
        return False
    return True


@functools.cache
def _module() -> Any:
    """The helper: the package's own build, else the cache dir's (helpers.py: trusted files only), else None."""
    from lazytriton.driver import helpers

    module = _import_package()
    if _usable(module):
        return module
    module = helpers.load_cached(helpers.FASTLAUNCH, None, import_file)
    if _usable(module):
        sys.modules.setdefault(MODULE, module)
        return module
    log.debug("no launch helper: launches go through cffi's ABI mode")
    return None


def origin() -> str | None:
    """Where the helper in use comes from: the file it was loaded from (package or cache dir), or None."""
    module = _module()
    return None if module is None else str(getattr(module, "__file__", MODULE))


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


def make_driver(launch: int, ctx_get_current: int, ctx_push: int, ctx_pop: int,
                encode: int = 0, launch_ex: int = 0) -> tuple[int, ...] | None:
    """The addresses of the driver functions the helper calls; None without the helper.

    ``encode`` is cuTensorMapEncodeTiled's, ``launch_ex`` cuLaunchKernelEx's (a programmatic dependent's
    launch), each 0 when the driver lacks it.
    """
    if _module() is None:
        return None
    return (launch, ctx_get_current, ctx_push, ctx_pop, encode, launch_ex)


def pack_plan(driver: tuple[int, ...], function: int, context: int, block: int, shared: int,
              slots: Sequence[int], descriptors: Sequence[TensorDescMeta] = (),
              dependent: bool = False) -> bytes | bytearray:
    """The helper's plan for one loaded kernel: its C struct ``lt_plan``, the int16 slots, an ``lt_desc`` each.

    With descriptors the plan is a bytearray whose tail is the helper's cache
    of encoded maps (zeros: empty). ``dependent``: the kernel is launched as
    its stream predecessor's programmatic dependent (``KernelSpec.dependent``),
    through cuLaunchKernelEx where the driver has it (the plan's launch_ex
    address; 0: cuLaunchKernel, which the kernel's wait makes right too).
    """
    n_ints = int_slots(slots)
    n_floats = sum(1 for slot in slots if -MAX_PARAMS <= slot < 0)
    driver = tuple(driver) + (0,) * (6 - len(driver))
    launch_ex = driver[5] if dependent else 0
    header = struct.pack("<8Q2I4i", *driver[:5], launch_ex, function, context, block, shared, len(slots), n_ints,
                         n_floats, len(descriptors))
    plan = header + struct.pack(f"<{len(slots)}h", *slots)
    if not descriptors:
        return plan
    for base, meta in zip(descriptor_bases(slots), descriptors, strict=True):
        box = tuple(reversed(meta.block_size)) + (0,) * (5 - meta.rank)
        plan += _DESC.pack(base, meta.rank, meta.swizzle, meta.elem_size, meta.host_dtype, *box)
    return bytearray(plan + bytes(CACHE_RECORD * len(descriptors)))


def launcher(driver: tuple[int, ...] | None, function: int, context: int, block: int, shared: int,
             slots: Sequence[int], descriptors: Sequence[TensorDescMeta] = (),
             dependent: bool = False) -> Callable[..., int] | None:
    """``fast(grid_x, grid_y, grid_z, stream, ints, floats) -> status`` for one loaded kernel.

    None when the helper is off or not built. Status 0 is success, another
    value the CUDA error of ``cuLaunchKernel`` (``PUSH_FAILED`` + error: of
    the context push; ``describe`` tells). Arguments of the wrong type or
    count raise TypeError/ValueError before anything is launched.
    """
    module = _module()
    if driver is None or module is None or not _enabled[0]:
        return None
    if descriptors and driver[4] == 0:
        return None  # the driver has no cuTensorMapEncodeTiled: the ABI path says so at launch
    return functools.partial(module.launch, pack_plan(driver, function, context, block, shared, slots, descriptors,
                                                      dependent))


def plan_bytes(fast: Callable[..., int] | None) -> bytes | bytearray | None:
    """The plan a launcher from ``launcher`` launches from (the C++ warm path launches the same bytes); else None."""
    module = _module()
    if isinstance(fast, functools.partial) and module is not None and fast.func is module.launch:
        plan: bytes | bytearray = fast.args[0]
        return plan
    return None


def describe(status: int) -> tuple[str, int]:
    """(which driver call failed, its CUDA error) for a helper status other than 0."""
    if status >= ENCODE_FAILED:
        return "cuTensorMapEncodeTiled", status - ENCODE_FAILED
    if status >= PUSH_FAILED:
        return "cuCtxPushCurrent", status - PUSH_FAILED
    return "cuLaunchKernel", status
