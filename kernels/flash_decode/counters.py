"""The fused combine's counters: int32, one a (batch, key/value head, query-row block) of a call, zero between calls.

A program of the split kernel with ``FUSED_COMBINE=true`` increments its row block's counter once its partial is
written; the one that takes the last ticket merges the block and puts the counter back to 0. So a buffer zeroed
once stays zero after every call, and the binding keeps one a (device, stream) for eager calls: the calls of one
stream run in order and share it; two streams never do (their programs would take each other's tickets). A call
that needs more counters than its stream's buffer holds gets a new, larger, zeroed one, allocated while that stream
is current (the zeroing runs on it, before the kernel; the old buffer goes back to torch's allocator, which gives
its memory to that stream's later work only). The host never reads the counters.

A buffer kept across calls must never come from a CUDA graph's private pool: cudagraph trees
(``torch.compile(mode="reduce-overhead")``) warm a graph up and record it with the allocations made meanwhile in
the graph's pool, and refuse a pool block that no output holds ("tensor(s) in the cudagraph pool not tracked as
outputs"); torch has no public query that says a warm-up is underway. So a call gets counters of its own, as it
gets its partials, wherever a graph may be made of it:

- a call through the torch op (``lazytriton::flash_kvcache``: ``own=True``), the form torch.compile's graphs run,
  and so the only form cudagraph trees warm up and record (an eager call runs outside them: a graph break runs its
  code between the compiled graphs);
- a call under a ``torch.cuda.graph`` capture (``launch.capturing``).

Such a call's buffer is allocated for it (under a capture from the graph's pool, which the graph keeps for its
life) and zeroed by a fill just before the kernel: each replay then starts from zeros, whichever stream replays it
and whatever ran before, and no two graphs, nor a graph and the eager calls of the stream it was captured on, share
counters. The cost is that fill (and an allocation) a call: one small fill node a call in a graph
(experiments/probe_decode_b1.py --fused measures the replay), one fill launch a call of a compiled graph that
cudagraph trees do not replay.
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
    """The counter buffers of the decoding calls of a process: one a (device, stream); the op's and a capture's own.

    ``capturing(device_index)``: whether a CUDA graph capture is underway on that GPU's current stream
    (``launch.capturing``; tests pass a fake). ``zeros(n, device)``: a zeroed int32 buffer on the current stream.
    """

    def __init__(self, capturing: Callable[[int | None], bool] = launch.capturing,
                 zeros: Callable[[int, torch.device], torch.Tensor] | None = None) -> None:
        self.capturing = capturing
        self.zeros = zeros or (lambda n, device: torch.zeros(n, dtype=_I32, device=device))
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, device: torch.device, device_index: int, stream: int, needed: int,
            own: bool = False) -> torch.Tensor:
        """Zeroed counters, at least ``needed``, for a call on ``stream`` (``device_index``: -1 for the CPU).

        ``own``: the call's own, made now and kept by nobody (a call through the torch op); so is a captured call's.
        The caller keeps the tensor referenced until its launch is queued.
        """
        if own or device.type == "cuda" and self.capturing(device_index):
            return self.zeros(needed, device)  # the call's own: a graph's, or a call's a graph may be made of
        key = (device_index, stream)
        found = self.buffers.get(key)
        if found is None or found.numel() < needed:
            size = max(needed, MIN_COUNTERS, 0 if found is None else 2 * found.numel())
            found = self.buffers[key] = self.zeros(size, device)
        return found


COUNTERS = Counters()  # the binding's and the warm path's
