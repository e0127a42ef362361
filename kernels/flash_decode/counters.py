"""The fused combine's counters: int32, one a (batch, key/value head, query-row block) of a call, zero between calls.

A program of the split kernel with ``FUSED_COMBINE=true`` increments its row block's counter once its partial is
written; the one that takes the last ticket merges the block and puts the counter back to 0. So a buffer zeroed
once stays zero after every call, and the binding keeps one a (device, stream): the calls of one stream run in
order and share it; two streams never do (their programs would take each other's tickets). A call that needs more
counters than its stream's buffer holds gets a new, larger, zeroed one, allocated while that stream is current (the
zeroing runs on it, before the kernel; the old buffer goes back to torch's allocator, which gives its memory to
that stream's later work only). The host never reads the counters.

Under a CUDA graph capture a call gets counters of its own instead, as it gets its partials: a buffer allocated
during the capture (from the graph's private pool, which the graph keeps for its life) and zeroed by the fill
captured just before the kernel. Each replay then starts from zeros, whichever stream replays it and whatever ran
before, and no two graphs, nor a graph and the eager calls of the stream it was captured on, share counters; the
cost is one small fill node a call in the graph (experiments/probe_decode_b1.py --fused measures the replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lazytriton import launch

MIN_COUNTERS = 1024  # a stream's first buffer (4 KiB): batch 128 x 8 key/value heads of one row block
_I32 = torch.int32


def count(batch: int, heads_k: int, row_blocks: int) -> int:
    """The counters a call's split grid takes: one a (batch, key/value head, query-row block)."""
    return batch * heads_k * row_blocks


class Counters:
    """The counter buffers of the decoding calls of a process: one a (device, stream), a captured call's own.

    ``capturing(device_index)``: whether a CUDA graph capture is underway on that GPU's current stream
    (``launch.capturing``; tests pass a fake). ``zeros(n, device)``: a zeroed int32 buffer on the current stream.
    """

    def __init__(self, capturing: Callable[[int | None], bool] = launch.capturing,
                 zeros: Callable[[int, torch.device], torch.Tensor] | None = None) -> None:
        self.capturing = capturing
        self.zeros = zeros or (lambda n, device: torch.zeros(n, dtype=_I32, device=device))
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, device: torch.device, device_index: int, stream: int, needed: int) -> torch.Tensor:
        """Zeroed counters, at least ``needed``, for a call on ``stream`` (``device_index``: -1 for the CPU).

        The caller keeps the tensor referenced until its launch is queued.
        """
        if device.type == "cuda" and self.capturing(device_index):
            return self.zeros(needed, device)  # the graph's own
        key = (device_index, stream)
        found = self.buffers.get(key)
        if found is None or found.numel() < needed:
            size = max(needed, MIN_COUNTERS, 0 if found is None else 2 * found.numel())
            found = self.buffers[key] = self.zeros(size, device)
        return found


COUNTERS = Counters()  # the binding's and the warm path's
