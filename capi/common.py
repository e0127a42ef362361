"""What the Python halves of liblazytriton.so share (``embedded``, ``embedded_kvcache``, ``embedded_combine``).

The lt_status values (lazytriton.h; ``embedded.attach`` checks them against the library's), the error that
carries one, a torch tensor over the caller's host memory, the check that a loaded entry takes what a C
launcher passes, and the scratch memory a forward plan passes it (``scratch_need``, ``fill_scratch``).
"""

from __future__ import annotations

from typing import Any

_INT_KINDS = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"}
MAX_HIDDEN = 8  # LT__MAX_HIDDEN in lazytriton.c
SCRATCH_NAMES = ("global_scratch", "profile_scratch")  # lt__scratch_need's regions 0 and 1 (lt_scratch.c)

# lt_status values (lazytriton.h).
OK = 0
INVALID_ARGUMENT = 1
UNSUPPORTED = 9
KERNEL_NOT_FOUND = 11
COMPILE = 12
CUDA = 13
PYTHON = 14
NO_GPU = 8


class CapiError(Exception):
    """An error with the lt_status it maps to."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def host_tensor(ffi: Any, view: Any) -> Any:
    """A torch tensor over the caller's host memory (no copy), with the view's sizes and strides."""
    import torch

    dtype = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32, 4: torch.int32, 5: torch.float8_e4m3fn,
             6: torch.float8_e5m2}[view.dtype]
    sizes = tuple(int(view.sizes[i]) for i in range(view.ndim))
    strides = tuple(int(view.strides[i]) for i in range(view.ndim))
    if 0 in sizes:
        return torch.empty(sizes, dtype=dtype)
    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    item = torch.empty((), dtype=dtype).element_size()
    buffer = ffi.buffer(ffi.cast("char *", view.data), extent * item)
    return torch.frombuffer(buffer, dtype=dtype, count=extent).as_strided(sizes, strides)


def check_entry_layout(entry: Any, n_ints: int, floats: tuple[str, ...], scratch: bool = False) -> None:
    """Refuse an entry a C launcher would not pass correctly: ``n_ints`` pointers or integers, then ``floats``.

    ``scratch``: the launcher passes scratch memory (a forward plan's, ``scratch_need``); without it an entry
    needing some is refused, and so is one with more hidden arguments than the launchers pass as NULL.
    """
    kinds = tuple(entry.arg_types)
    if (len(kinds) != n_ints + len(floats) or kinds[n_ints:] != floats
            or not all(k.startswith("*") or k in _INT_KINDS for k in kinds[:n_ints])):
        raise CapiError(UNSUPPORTED, f"entry {entry.key} has parameter types {kinds}; the C launcher takes "
                                     f"{n_ints} pointers or integers, then {len(floats)} fp32")
    if scratch:
        scratch_need(entry)
        return
    sizes = {"global_scratch": entry.global_scratch_size, "profile_scratch": entry.profile_scratch_size}
    if any(sizes.get(name, 0) > 0 for name in entry.hidden_args) or len(entry.hidden_args) > MAX_HIDDEN:
        raise CapiError(UNSUPPORTED, f"entry {entry.key} needs scratch memory, which this C launcher does not "
                                     "allocate (the forward's plans do)")


def scratch_need(entry: Any) -> tuple[int, tuple[int, int], tuple[int, int], tuple[int, ...]]:
    """(CTAs a program, bytes a program, alignments, each hidden argument's region) of a forward plan's entry.

    Regions are ``SCRATCH_NAMES``' indices: 0 global, 1 profile; a size is 0 where the entry has no such hidden
    argument (it gets NULL, as Triton's launcher passes it). An entry with another hidden argument, one twice or
    more than two, or an alignment that is not a power of two is refused: C would not pass it correctly.
    """
    hidden = tuple(entry.hidden_args)
    if any(name not in SCRATCH_NAMES for name in hidden) or len(set(hidden)) != len(hidden):
        raise CapiError(UNSUPPORTED, f"entry {entry.key} has hidden arguments {hidden}; the C launcher passes "
                                     f"{SCRATCH_NAMES}, each at most once")
    given = {"global_scratch": (entry.global_scratch_size, getattr(entry, "global_scratch_align", 1)),
             "profile_scratch": (entry.profile_scratch_size, getattr(entry, "profile_scratch_align", 1))}
    sizes, aligns = [0, 0], [1, 1]
    for region, name in enumerate(SCRATCH_NAMES):
        size, align = given[name]
        if name in hidden and size > 0:
            align = align or 1
            if align & (align - 1) or size >= 2**32 or align >= 2**32:
                raise CapiError(UNSUPPORTED, f"entry {entry.key}: {name} of {size} bytes aligned to {align}, which "
                                             "the C launcher does not pass (a power-of-two alignment, under 4 GiB)")
            sizes[region], aligns[region] = size, align
    return (max(1, int(getattr(entry, "num_ctas", 1))), (sizes[0], sizes[1]), (aligns[0], aligns[1]),
            tuple(SCRATCH_NAMES.index(name) for name in hidden))


def fill_scratch(need: Any, entry: Any) -> None:
    """Write ``scratch_need(entry)`` into a request's ``lt__scratch_need`` (lazytriton.c)."""
    num_ctas, sizes, aligns, hidden = scratch_need(entry)
    need.num_ctas = num_ctas
    for region in range(2):
        need.size[region], need.align[region] = sizes[region], aligns[region]
    for h, region in enumerate(hidden):
        need.hidden[h] = region
