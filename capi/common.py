"""What the Python halves of liblazytriton.so share (``embedded``, ``embedded_kvcache``, ``embedded_combine``).

The lt_status values (lazytriton.h; ``embedded.attach`` checks them against the library's), the error that
carries one, a torch tensor over the caller's host memory, and the check that a loaded entry takes what a C
launcher passes.
"""

from __future__ import annotations

from typing import Any

_INT_KINDS = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"}
MAX_HIDDEN = 8  # LT__MAX_HIDDEN in lazytriton.c

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


def check_entry_layout(entry: Any, n_ints: int, floats: tuple[str, ...]) -> None:
    """Refuse an entry a C launcher would not pass correctly: ``n_ints`` pointers or integers, then ``floats``.

    An entry needing scratch memory, or more hidden arguments than the launchers pass as NULL, is refused too.
    """
    kinds = tuple(entry.arg_types)
    if (len(kinds) != n_ints + len(floats) or kinds[n_ints:] != floats
            or not all(k.startswith("*") or k in _INT_KINDS for k in kinds[:n_ints])):
        raise CapiError(UNSUPPORTED, f"entry {entry.key} has parameter types {kinds}; the C launcher takes "
                                     f"{n_ints} pointers or integers, then {len(floats)} fp32")
    sizes = {"global_scratch": entry.global_scratch_size, "profile_scratch": entry.profile_scratch_size}
    if any(sizes.get(name, 0) > 0 for name in entry.hidden_args) or len(entry.hidden_args) > MAX_HIDDEN:
        raise CapiError(UNSUPPORTED, f"entry {entry.key} needs scratch memory, which C plans do not allocate")
