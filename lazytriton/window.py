"""``window_size`` in the forms FlashAttention-3's and -2's callers pass it, as the (left, right) pair the checks read.

FlashAttention indexes ``window_size[0]`` and ``window_size[1]`` and converts each to an int, so its callers (and
its own tests) pass a tuple, a list, a 1-D integer tensor of two (``torch.randint(0, n, (2,))``) or a pair of
0-dim integer tensors. The public functions turn the tensor forms into a tuple of ints here, before any check;
every other value goes on as given, to the checks that judge it (a pair of ints, -1 or >= 0), so a bad value is
refused with the same message whatever its form. Reading a tensor's values is a device-to-host copy on a GPU (a
stream sync), as FlashAttention's own conversion is; pass ints to avoid it.
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton.kernels.arguments import shown

_INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def window_pair(window_size: Any, name: str = "window_size") -> Any:
    """``window_size`` with its tensor forms as a tuple of two ints; any other value as given.

    A 1-D tensor of two integers, or a tuple or list holding a 0-dim integer tensor, becomes ``(left, right)``;
    a tensor of another dtype or shape raises TypeError naming ``name``, before anything is launched.
    """
    if isinstance(window_size, torch.Tensor):
        if window_size.dtype not in _INTEGER or window_size.dim() != 1 or window_size.numel() != 2:
            raise TypeError(f"{name} must be a pair of ints (left, right), or an integer tensor of shape (2,), got "
                            f"{shown(window_size)}")
        return tuple(int(w) for w in window_size.tolist())
    if type(window_size) in (tuple, list) and any(isinstance(w, torch.Tensor) for w in window_size):
        items = []
        for w in window_size:
            if isinstance(w, torch.Tensor):
                if w.dtype not in _INTEGER or w.dim() != 0:
                    raise TypeError(f"{name} must be a pair of ints (left, right), got {shown(window_size)}: a "
                                    "tensor item must be a 0-dim integer tensor")
                w = int(w.item())
            items.append(w)
        return tuple(items)
    return window_size


__all__ = ["window_pair"]
