"""The per-sequence plan of the "lazytriton" transformers attention: only for softcapped calls on arbitrary masks.

The varlen path (``transformers_varlen``) runs every mask that is padding
combined with causal or bidirectional attention and a sliding window, in one
call per layer, and the SDPA drop-in runs any other mask in one call, but
the SDPA drop-in has no softcap. A softcapped layer (Gemma 2) whose mask is
neither (a sliding window across pads between a right-padded prompt and its
new tokens, chunks) comes here: the boolean mask is decomposed, per
sequence, into the keys that any query sees and, for each query, the
contiguous range of those keys it sees; the range is rebuilt and compared
with the mask element for element, and the calls planned from the ranges
are rebuilt from their own arguments (FlashAttention-2's window rule) and
compared with the ranges. A mask it does not reproduce exactly (a query
whose keys have holes, per-head or float masks) raises NotImplementedError,
never a wrong result. It costs one launch per group of equal sequences and
query run; the analysis is computed once per forward and mask (all layers
share the mask object).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

import lazytriton
from lazytriton.integrations.transformers_varlen import NO_WINDOW


@dataclass(frozen=True)
class Segment:
    """Queries [start, stop) of a sequence, run as one call on its selected keys [key_start, key_stop).

    ``causal`` (False or "bottom_right", on that key slice) and ``window`` (FlashAttention-2's (left, right),
    (-1, -1) for none) are the call's own arguments; ``key_start == key_stop``: the queries see no key (zeros,
    no launch).
    """

    start: int
    stop: int
    key_start: int
    key_stop: int
    causal: bool | str = False
    window: tuple[int, int] = NO_WINDOW


@dataclass(frozen=True)
class Group:
    """Batch rows [first, last) sharing one key selection and one list of query segments.

    ``key_range`` is (start, stop) when the selected keys are contiguous, else None and ``key_index``
    holds their positions.
    """

    first: int
    last: int
    key_range: tuple[int, int] | None
    key_index: torch.Tensor | None
    segments: tuple[Segment, ...]


# The plans of the last few masks seen: every layer of one forward gets the same mask object (one per
# attention type in hybrid models, e.g. Gemma's sliding and full layers, which alternate), so the analysis
# and its device-to-host copy run once per forward and mask, not once per layer. Weak references: a plan
# never keeps a mask alive, and a new mask at a dead one's address never matches.
_PLANS_KEPT = 4
_plans: list[tuple[weakref.ReferenceType[torch.Tensor], int, tuple[int, ...], tuple[Group, ...]]] = []


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
              scaling: float | None, features: dict[str, Any]) -> torch.Tensor:
    """The attention output, (batch, heads_q, q_len, head_dim_v), of ``attention_mask``'s plan."""
    batch, _, q_len = query.shape[:3]
    return run_plan(plan(attention_mask, batch, q_len, key.shape[2]), query, key, value, scaling, features)


def run_plan(groups: tuple[Group, ...], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             scaling: float | None, features: dict[str, Any]) -> torch.Tensor:
    """The attention output, (batch, heads_q, q_len, head_dim_v), of a plan: one lazytriton call per segment."""
    parts = []
    for group in groups:
        rows = slice(group.first, group.last)
        if group.key_range is not None:
            k = key[rows, :, group.key_range[0]:group.key_range[1]]
            v = value[rows, :, group.key_range[0]:group.key_range[1]]
        else:
            k, v = key[rows][:, :, group.key_index], value[rows][:, :, group.key_index]
        pieces = []
        for seg in group.segments:
            q = query[rows, :, seg.start:seg.stop]
            if seg.key_start == seg.key_stop:
                pieces.append(q.new_zeros(q.shape[:3] + (value.shape[3],)))
                continue
            keys = slice(seg.key_start, seg.key_stop)
            extra = features if seg.window == NO_WINDOW else {**features, "window_size": seg.window}
            pieces.append(lazytriton.attn_fwd(q, k[:, :, keys], v[:, :, keys], causal=seg.causal,
                                              sm_scale=scaling, **extra)[0])
        parts.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def plan(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> tuple[Group, ...]:
    """The groups of ``attention_mask``, cached for the mask object (and version) it was computed from."""
    global _plans
    shape = (batch, q_len, kv_len)
    plans = _plans  # replaced, never mutated: safe to read while another thread updates it
    for ref, version, plan_shape, groups in plans:
        if ref() is attention_mask and version == attention_mask._version and plan_shape == shape:
            return groups
    groups = analyse(attention_mask, batch, q_len, kv_len)
    live = [p for p in plans if p[0]() is not None][-(_PLANS_KEPT - 1):]
    _plans = [*live, (weakref.ref(attention_mask), attention_mask._version, shape, groups)]
    return groups


def analyse(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> tuple[Group, ...]:
    """Decompose a boolean mask into key selections and query segments, or raise NotImplementedError.

    Each query row must see a contiguous range of the keys its sequence sees at all (any row): that holds
    for padding (anywhere) combined with causal or bidirectional attention, causal sliding windows and
    chunked attention, and for nothing with holes. The segments are rebuilt from the calls' own arguments
    and compared with the rows, and the rows with the mask, element for element: what the plan runs is
    exactly the mask, or the mask is refused.
    """
    m = _mask_3d(attention_mask, batch, q_len, kv_len)
    seen = m.any(dim=1)  # (batch, kv_len): the keys the sequence attends to at all
    rank = seen.cumsum(dim=-1) - 1  # 0-based position of each seen key among them
    counts = m.sum(dim=-1)  # (batch, q_len): how many keys each query sees
    first = rank.gather(-1, m.to(torch.uint8).argmax(dim=-1))  # the first key each query sees, if any
    first = torch.where(counts > 0, first, 0)
    rebuilt = seen[:, None, :] & (rank[:, None, :] >= first[:, :, None]) & (
        rank[:, None, :] < (first + counts)[:, :, None])
    if not torch.equal(rebuilt, m):
        b, i = (rebuilt != m).nonzero()[0, :2].tolist()
        raise NotImplementedError(
            "lazytriton attention: this attention mask is not padding combined with causal, full, sliding-window "
            f"or chunked attention: query {i} of sequence {b} sees keys that are not a contiguous range of the keys "
            "its sequence attends to (an arbitrary custom 4D mask?); arbitrary masks are not supported together "
            "with softcap (the SDPA drop-in, which takes them, has no softcap)")
    groups: list[Group] = []
    first_and_counts = torch.stack((first, counts), dim=1).tolist()  # (batch, 2, q_len): one copy, not two
    rows: list[tuple[list[bool], list[int], list[int]]] = [
        (s, fc[0], fc[1]) for s, fc in zip(seen.tolist(), first_and_counts, strict=True)]
    b = 0
    while b < batch:  # consecutive sequences with the same pattern share one call (all of them, unpadded)
        last = b + 1
        while last < batch and rows[last] == rows[b]:
            last += 1
        index = [j for j, s in enumerate(rows[b][0]) if s]
        if not index or index[-1] - index[0] + 1 == len(index):
            key_range, key_index = ((index[0], index[-1] + 1) if index else (0, 0)), None
        else:  # pads between keys (e.g. generation after right padding): gather the seen keys
            key_range, key_index = None, torch.tensor(index, device=attention_mask.device)
        lo, count = rows[b][1], rows[b][2]
        hi = [f + c for f, c in zip(lo, count, strict=True)]
        segments = _segments(lo, hi)
        if planned_rows(segments) != list(zip(lo, hi, strict=True)):  # a bug here must never become a wrong result
            raise NotImplementedError(f"lazytriton attention: the plan for sequence {b} does not reproduce its "
                                      "attention mask (a bug in lazytriton; please report it with the mask)")
        groups.append(Group(b, last, key_range, key_index, segments))
        b = last
    return tuple(groups)


def _mask_3d(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The mask as (batch, q_len, kv_len) booleans, or NotImplementedError/ValueError."""
    if attention_mask.dtype != torch.bool:
        raise NotImplementedError(f"lazytriton attention: only boolean attention masks are supported (True = "
                                  f"attend), got dtype {attention_mask.dtype} (an additive float mask)")
    if attention_mask.dim() != 4:
        raise NotImplementedError(f"lazytriton attention: attention_mask must have 4 dims (batch, heads, q_len, "
                                  f"kv_len), got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[1] != 1 and not bool((attention_mask == attention_mask[:, :1]).all()):
        raise NotImplementedError("lazytriton attention: per-head attention masks are not supported")
    try:
        return attention_mask[:, 0].expand(batch, q_len, kv_len)
    except RuntimeError:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} does not broadcast to (batch, "
                         f"heads, q_len, kv_len) = ({batch}, *, {q_len}, {kv_len})") from None


def _segments(lo: list[int], hi: list[int]) -> tuple[Segment, ...]:
    """Split queries, query i seeing selected keys [lo[i], hi[i]), into runs that one call each reproduces.

    A run's last key either moves one key per query (bottom-right causal on the run's keys) or stays (not
    causal), and its first key stays, then moves one key per query (a sliding window's left edge; the
    window is used only once it moves, so masks without one keep the plain kernels). Queries that see no
    key are runs of their own (zeros, no launch).
    """
    segments = []
    i, q_len = 0, len(lo)
    while i < q_len:
        j = i + 1
        if hi[i] == lo[i]:
            while j < q_len and hi[j] == lo[j]:
                j += 1
            segments.append(Segment(i, j, 0, 0))
            i = j
            continue
        rise = int(j < q_len and hi[j] == hi[i] + 1)  # causal run; else the last key stays
        slide = -1  # the first query whose first key moved
        while j < q_len and hi[j] > lo[j] and hi[j] - hi[j - 1] == rise and lo[j] - lo[j - 1] in (0, 1):
            if lo[j] > lo[j - 1]:
                slide = j if slide < 0 else slide
            elif slide >= 0:
                break
            j += 1
        n, first, last = j - i, lo[i], hi[j - 1]
        causal = "bottom_right" if rise and n > 1 else False
        # Query r of the run sees keys >= r + offset - left, offset = (last - first) - n (bottom-right); the
        # query before ``slide`` is the last one at ``first``: left = last - n + (slide - 1 - i) - first.
        left = -1 if slide < 0 else last - n + slide - 1 - i - first
        window = NO_WINDOW if left < 0 else (left, 0 if causal else -1)
        segments.append(Segment(i, j, first, last, causal, window))
        i = j
    return tuple(segments)


def planned_rows(segments: tuple[Segment, ...]) -> list[tuple[int, int]]:
    """The keys [lo, hi) each query sees in these calls, by FlashAttention-2's rule (attn_fwd's docstring).

    Query r of a call with n queries and s keys sees key j when r + offset - left <= j <= r + offset +
    right, offset = s - n; causal means right = 0; -1 is unbounded. A query that sees none is (0, 0).
    """
    rows = []
    for seg in segments:
        n, s = seg.stop - seg.start, seg.key_stop - seg.key_start
        left, right = seg.window
        right = 0 if seg.causal else right
        for r in range(n):
            lo = 0 if left < 0 else max(0, r + s - n - left)
            hi = s if right < 0 else min(s, r + s - n + right + 1)
            rows.append((seg.key_start + lo, seg.key_start + hi) if hi > lo else (0, 0))
    return rows
