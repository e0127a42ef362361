"""What every family's binding uses to plan and launch a kernel: one plan mechanism, the capture guard, the stream.

A family's warm call looks its memo key up in ``Runtime.plans`` (a dict read,
inline in the binding); on a miss it calls ``plan``, which does the rest the
same way for every family: the device's target (``machine``), the family's
choice of variants for it, the capture guard, the loads, and the memo. The
entry ``plan`` memoises is flat: each loaded kernel followed by the tile
fields its launch needs (the grid's BLOCK_M, say), so a warm call unpacks it
without a lookup by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lazytriton import machine
from lazytriton.target import Target
from lazytriton.variant import Variant


class CaptureError(RuntimeError):
    """A call would load or compile a kernel while a CUDA graph is being captured."""


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~0.3 µs; the public API ~3 µs
is_capturing = torch.cuda.is_current_stream_capturing  # the current device's current stream
current_device = getattr(torch._C, "_cuda_getDevice", None)  # torch's current CUDA device; None on a CPU build

# A family's choice for a target: each variant with the tile fields its launch reads, in the order the entry holds
# them (a name: the variant's value of that field; an int: that constant, a marker the warm call tests).
Choice = Sequence[tuple[Variant, tuple[str | int, ...]]]


def capturing(device_index: int | None) -> bool:
    """Whether a CUDA graph capture is underway on the current stream of GPU ``device_index``.

    torch's ``is_capturing`` asks the current device's stream. A call on
    another device (tensors on cuda:1 while cuda:0 is current, cuda:1's
    stream being captured) asks its own device's, made current for the
    question. None: the current device's.
    """
    if current_device is None or device_index is None or current_device() == device_index:
        return is_capturing()
    with torch.cuda.device(device_index):
        return is_capturing()


def refuse_loads_in_capture(rt: Any, variants: Any, device: torch.device, fix: str) -> None:
    """Raise ``CaptureError`` if a CUDA graph is being captured and one of ``variants`` is not loaded on ``device``.

    Loading or compiling would touch the driver or the compiler inside the
    capture; ``plan`` asks this before it resolves any kernel. ``fix`` tells
    the caller what to run before the capture.
    """
    if not capturing(device.index):
        return
    for chosen in variants:
        if rt.loaded(chosen, device.index) is None:
            raise CaptureError(f"{chosen} is not loaded on {device} and a CUDA graph is being captured, during "
                               f"which it can be neither loaded nor compiled; {fix}")


def plan(rt: Any, key: tuple[Any, ...], device: torch.device, choose: Callable[[Target], Choice],
         fix: str) -> tuple[Any, ...]:
    """The entry for memo key ``key`` on a miss: target, the family's choice, capture guard, loads; memoised.

    ``choose(target)`` is the family's dispatch for the call (pure); ``fix``
    is what to run before a capture that would need a load. The entry is the
    loaded kernels in the choice's order, each followed by its tile fields.
    """
    chosen = choose(machine.target_of_device(device))
    refuse_loads_in_capture(rt, [variant for variant, _ in chosen], device, fix)
    entry = tuple(item for variant, fields in chosen
                  for item in (rt.kernel(variant, device.index),
                               *(int(variant.get(field)) if isinstance(field, str) else field for field in fields)))
    rt.plans[key] = entry
    return entry


def raw_stream(device_index: int) -> int:
    """The current CUDA/HIP stream of a device, as the driver's handle."""
    if _GET_RAW_STREAM is not None:
        return int(_GET_RAW_STREAM(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


def scratch_alloc(nbytes: int, device_index: int) -> torch.Tensor:
    """Scratch memory Triton's hidden parameters ask for (torch's allocator: graph-safe)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device_index))
