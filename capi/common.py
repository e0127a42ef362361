"""What the Python halves of liblazytriton.so share (``embedded``, ``embedded_kvcache``).

The lt_status values (lazytriton.h; ``embedded.attach`` checks them against the library's), the error that
carries one, and a torch tensor over the caller's host memory.
"""

from __future__ import annotations

from typing import Any

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

    dtype = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32, 4: torch.int32}[view.dtype]
    sizes = tuple(int(view.sizes[i]) for i in range(view.ndim))
    strides = tuple(int(view.strides[i]) for i in range(view.ndim))
    if 0 in sizes:
        return torch.empty(sizes, dtype=dtype)
    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    item = torch.empty((), dtype=dtype).element_size()
    buffer = ffi.buffer(ffi.cast("char *", view.data), extent * item)
    return torch.frombuffer(buffer, dtype=dtype, count=extent).as_strided(sizes, strides)
