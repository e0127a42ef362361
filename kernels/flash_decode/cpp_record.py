"""The C++ tail's record of one warm-path entry (``hotpath_record``'s layout), made from what hot.py's Entry holds.

``header`` packs what every call of the entry shares (describe's sizes, spans and flags); ``split_item`` and
``append_item`` pack a kernel's launch once its plan of one alignment is memoised (hot.py's ``Entry.split_launch``
and ``append_launch``): the constant ints with a 0 in each pointer slot, the slot of an int length, the floats,
the grid, and which of the call's pointers each slot takes (``ROLES``). A pointer slot takes the pointer hot.py's
Python run puts there: the call's tensor where the call has it, else the kernel's filler (a valid address the
kernel never reads: lse for the split and combine kernels, k for kv_append). None: the C++ tail cannot launch it
(a kernel without the compiled launch helper's plan, or values a C int64/float32/uint32 cannot hold); hot.py then
serves the entry in Python.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from lazytriton.driver import fastlaunch
from lazytriton.kernels.flash_decode import hotpath_record

ROLE = {name: index for index, name in enumerate(hotpath_record.ROLES)}
OPTIONAL = ("lens", "table", "key_mask")  # roles a call may lack: the kernel's filler stands in
# Each kernel's pointers (its description's names) -> role; the others take the filler.
SPLIT_ROLES = {"Q": "q", "K": "k_cache", "V": "v_cache", "Out": "out", "Lse": "lse", "OutPart": "part_out",
               "LsePart": "part_lse", "Seqlens": "lens", "BlockTable": "table", "RotaryCos": "q", "RotarySin": "q",
               "KeyMask": "key_mask"}
COMBINE_ROLES = {"OutPart": "part_out", "LsePart": "part_lse", "Out": "out", "Lse": "lse"}
SPLIT_AT = (hotpath_record.RECORD.index("split_unaligned"), hotpath_record.RECORD.index("split_aligned"))
APPEND_AT = (hotpath_record.RECORD.index("append_unaligned"), hotpath_record.RECORD.index("append_aligned"))
APPEND_ROLES = {"K": "k", "V": "v", "KCache": "k_cache", "VCache": "v_cache", "Seqlens": "lens", "BlockTable": "table"}


def header(out_size: tuple[int, ...] | None, lse_size: tuple[int, ...], lse_numel: int, lens_max: int,
           spans: dict[str, int], lens_int: bool, split_strides_aligned: bool, append_strides_aligned: bool
           ) -> list[Any] | None:
    """A new record: the header and no launch items yet; None where a value does not fit its C field."""
    try:
        packed = hotpath_record.HEADER.pack(*(out_size or (0, 0, 0, 0)), *lse_size, lse_numel, lens_max,
                                            *(spans[name] for name in hotpath_record.SPANS), out_size is not None,
                                            lens_int, split_strides_aligned, append_strides_aligned)
    except struct.error:
        return None
    return [packed, None, None, None, None]


def drop(record: list[Any]) -> None:
    """Leave ``record`` without launch items: the C++ front, which may hold it, declines its entry from now on."""
    record[1:] = [None] * (len(record) - 1)


def roles(pointers: Sequence[str], named: dict[str, str], filler: str, present: frozenset[str]) -> list[int]:
    """The role of each pointer slot: its own where the call has that tensor, else ``filler``'s."""
    found = []
    for name in pointers:
        role = named.get(name, filler)
        found.append(ROLE[filler if role in OPTIONAL and role not in present else role])
    return found


def launch(kernel: Any, grid: Sequence[int], pointer_roles: list[int], tail: Sequence[int], length_at: int,
           floats: Sequence[float], splits: int = 1, work_floats: int = 0, partial_lse: int = 0
           ) -> tuple[Any, Any, Any] | None:
    """(launch bytes, plan, fail) of one kernel; None where the C++ tail cannot launch it.

    ``tail``: the ints after its pointers; ``length_at``: the int length's index in it (-1: none).
    """
    plan = fastlaunch.plan_bytes(getattr(kernel, "fast", None))
    n_pointers = len(pointer_roles)
    if plan is None or n_pointers > hotpath_record.MAX_POINTERS:
        return None
    ints = (0,) * n_pointers + tuple(tail)
    try:
        packed = (hotpath_record.LAUNCH.pack(splits, work_floats, partial_lse, *grid, len(ints), len(floats),
                                             n_pointers, n_pointers + length_at if length_at >= 0 else -1,
                                             *pointer_roles, *(0,) * (hotpath_record.MAX_POINTERS - n_pointers))
                  + struct.pack(f"<{len(ints)}q{len(floats)}f", *ints, *floats))
    except (struct.error, OverflowError):  # a scale past float32's range, say
        return None
    return packed, plan, kernel.fail


def split_item(found: tuple[Any, ...], pointers: tuple[Sequence[str], Sequence[str]], lens_int: bool,
               present: frozenset[str]) -> tuple[Any, ...] | None:
    """The split (and combine) item from hot.py's ``Entry.split_launch`` tuple; None: the C++ tail cannot run it.

    ``pointers``: the split and combine kernels' pointer names.
    """
    (split_kernel, grid, floats, head, rest, splits, work, partial_lse, combine_kernel, combine_grid, combine_tail,
     tickets) = found
    if tickets:  # the fused combine's counters: the Python run's
        return None
    split = launch(split_kernel, grid, roles(pointers[0], SPLIT_ROLES, "lse", present),
                   (*head, 0, *rest) if lens_int else head, len(head) if lens_int else -1, floats, splits, work,
                   partial_lse)
    combine: tuple[Any, ...] | None = (None, None, None)
    if combine_kernel is not None and splits > 1:
        combine = launch(combine_kernel, combine_grid, roles(pointers[1], COMBINE_ROLES, "lse", present),
                         combine_tail, -1, ())
    if split is None or combine is None:
        return None
    return (*split, *combine)


def append_item(found: tuple[Any, ...], pointers: Sequence[str], lens_int: bool,
                present: frozenset[str]) -> tuple[Any, ...] | None:
    """The kv_append item from hot.py's ``Entry.append_launch`` tuple; None: the C++ tail cannot run it."""
    kernel, grid, head, rest = found
    item = launch(kernel, grid, roles(pointers, APPEND_ROLES, "k", present),
                  (*head, 0, *rest) if lens_int else head, len(head) if lens_int else -1, ())
    return None if item is None else (*item, None, None, None)
