"""transformers integration: an attention implementation named "lazytriton".

Usage::

    from lazytriton.integrations import transformers as lt_transformers

    lt_transformers.register()  # once per process; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="lazytriton")
    model.set_attn_implementation("lazytriton")  # or switch a model already built

Every attention layer then runs through ``lazytriton.attn_fwd``: unpadded and
padded batches (left or right padding), prefill and generation with a KV
cache (``DynamicCache`` or ``StaticCache``, their sliding-window layers
included), bidirectional encoders with padding (BERT), grouped-query
attention (key/value heads passed as they come, never repeated), the layer's
``scaling``, sliding windows (Mistral, Qwen2's sliding layers, Gemma 2 and 3:
the window transformers' masks draw, ``sliding_window`` keys up to and
including the query's own) and attention logit softcapping (Gemma 2's
``softcap=``, passed to the kernels: FlashAttention-2's semantics, which are
those of transformers' "eager" implementation; SDPA refuses it).
Differentiable.

How the mask reaches the kernels. transformers builds the mask once per
forward with the implementation's *mask function* and hands it to every
layer; registering only an attention function is not enough (the model would
then build no mask at all for an unknown name and padded batches would be
silently wrong). The mask function registered here hands over what
transformers' own ``sdpa_mask`` builds, so the attention function sees
exactly what the "sdpa" implementation sees:

- ``None``: no padding. It means what it means for SDPA: causal
  (``q_len == kv_len``, and an empty static cache's prefill, where SDPA crops
  the keys to the queries) or, for a single query or a non-causal module, no
  mask. One lazytriton call for the whole batch. For a sliding layer
  transformers builds no mask only where the window does not cut in; should
  a model's ``sliding_window=`` cut in without a mask, a causal call (or a
  single query) applies it as ``window_size=(sliding_window - 1, 0)``, and a
  bidirectional one raises (its extent is ambiguous there).
- a boolean (batch, 1, q_len, kv_len) mask (True = attend): padding combined
  with causal or bidirectional attention, a sliding window or chunks. The
  kernels have no arbitrary-mask support yet, so the mask is decomposed, per
  sequence, into the keys that any query sees and, for each query, the
  contiguous range of those keys it sees; the range is rebuilt and compared
  with the mask element for element, and the calls planned from the ranges
  are rebuilt from their own arguments (FlashAttention-2's window rule) and
  compared with the ranges. Any mask it does not reproduce exactly (a query
  whose keys have holes, as arbitrary custom 4D or block masks can make;
  per-head masks; float additive masks) raises NotImplementedError naming
  what is unsupported, never a wrong result. A run of queries whose last key
  moves one key per query runs as one bottom-right causal call on the run's
  keys, one whose last key stays as one non-causal call; if the run's first
  key also moves one key per query (a sliding window's left edge, or a
  right-padded sequence's pad queries under a window), the call gets
  ``window_size=(left, ...)``. Only then: masks without a window that cuts
  in keep the plain kernels (windowed calls use the window kernels, their
  own cache entries: ``prewarm --window``, ``--softcap``). Queries that see
  no key get zeros without a launch (SDPA gives such a row zeros too; eager
  gives it the mean of all values, so Gemma 2's pad positions differ from
  eager's, its real tokens do not). Consecutive sequences with the same
  pattern share their calls, so an unpadded batch with a mask (chunked
  prefill against a cache, a sliding window) is one call; **a padded batch
  costs one launch per sequence (two for a right-padded sequence: its pad
  queries see every real key, or a shrinking window of them) until the
  varlen kernel of issue 11 lands**; chunked attention costs one launch per
  chunk. The decomposition is computed once per forward and mask (all layers
  share the mask object) and copies the mask's per-key and per-query
  summaries to the host once.

Not supported (NotImplementedError): dropout > 0 (set ``model.eval()`` or
``attention_dropout=0``), attention sinks (``s_aux``/``sinks``),
``position_bias`` (T5-style relative bias), sparse ``indices``, the masks
above. The data-dependent mask analysis makes ``torch.compile`` break the
graph at each layer with a mask. Tested with transformers 5.24 (Llama, BERT,
Mistral, Qwen2, Gemma 2 and 3).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

import lazytriton

NAME = "lazytriton"
# Keyword arguments some models pass to their attention function that change the math and that lazytriton
# does not implement yet; SDPA ignores them, lazytriton refuses them.
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "indices", "block_indices")
_NO_WINDOW = (-1, -1)  # lazytriton.attn_fwd's default: no sliding window


def register(name: str = NAME) -> None:
    """Register lazytriton's attention and mask functions with transformers under ``name``.

    Both are needed (see the module docstring). Idempotent; registration is
    process-wide (transformers' global attention and mask interfaces).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask)


def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function: transformers' ``sdpa_mask``, whose output ``attention_forward`` reads.

    A boolean (batch, 1, q_len, kv_len) mask, or None where SDPA's own
    ``is_causal`` handling would do (no padding). Kept as our own function so
    that the contract between the two halves is ours to change (a compact
    per-sequence description instead of a dense mask, once varlen lands).
    """
    from transformers.masking_utils import sdpa_mask

    # Older transformers, on torch < 2.6, unmask a query row that sees no key (SDPA then gave NaN there);
    # that would break the padding pattern, and lazytriton gives such a row zeros anyway. Later versions
    # ignore the argument.
    kwargs.setdefault("allow_torch_fix", False)
    return sdpa_mask(*args, **kwargs)  # type: ignore[no-any-return]


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function, with transformers' signature (that of ``sdpa_attention_forward``).

    query (batch, heads_q, q_len, head_dim), key/value (batch, heads_k, kv_len,
    head_dim), heads_q a multiple of heads_k; returns (attention output as
    (batch, q_len, heads_q, head_dim), None), the second being the attention
    weights, which no flash kernel materialises.
    """
    _check_supported(dropout, position_bias, kwargs)
    softcap = kwargs.get("softcap")
    features: dict[str, Any] = {} if softcap is None else {"softcap": softcap}  # None (and 0.0): off
    if attention_mask is None:
        out = _unmasked(module, query, key, value, scaling, is_causal, kwargs.get("sliding_window"), features)
    else:
        out = _masked(query, key, value, attention_mask, scaling, features)
    return out.transpose(1, 2).contiguous(), None


def _check_supported(dropout: float, position_bias: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    if dropout != 0.0:
        raise NotImplementedError(f"lazytriton attention: dropout={dropout!r} is not supported yet (issue 11); "
                                  "call model.eval() or set the config's attention dropout to 0")
    if position_bias is not None:
        raise NotImplementedError("lazytriton attention: position_bias (relative position bias) is not supported")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"lazytriton attention: {name}= is not supported yet (issue 11)")


def _unmasked(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scaling: float | None, is_causal: bool | None, sliding_window: int | None,
              features: dict[str, Any]) -> torch.Tensor:
    """No mask: SDPA's meaning, exactly as ``sdpa_attention_forward`` computes it, within ``sliding_window``."""
    module_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q_len = query.shape[2]
    causal = q_len > 1 and module_causal  # a single query sees every key (decoding)
    if causal and key.shape[2] > q_len:
        # Only an empty static cache's prefill gets here: SDPA aligns top-left, i.e. the keys past the
        # queries (empty cache slots) are never seen; crop them, as sdpa_attention_forward does.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    window = _window(sliding_window, key.shape[2], module_causal)
    if window != _NO_WINDOW:
        features = {**features, "window_size": window}
    return lazytriton.attn_fwd(query, key, value, causal=causal, sm_scale=scaling, **features)[0]


def _window(sliding_window: int | None, kv_len: int, causal: bool) -> tuple[int, int]:
    """The window_size of a causal module's call without a mask, for a model's ``sliding_window``.

    transformers' mask function builds no mask for a sliding layer only where its window does not cut in
    (fewer keys than the window), so this is (-1, -1) there. Elsewhere, the window transformers' masks draw:
    ``sliding_window`` keys up to and including the query's own position (FlashAttention-2's ``left =
    sliding_window - 1``, as transformers passes it to flash-attn).
    """
    if sliding_window is None:
        return _NO_WINDOW
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be None or an int >= 1 (keys seen, the query's own included), "
                         f"got {sliding_window!r}")
    if kv_len <= sliding_window:
        return _NO_WINDOW
    if not causal:
        raise NotImplementedError(f"lazytriton attention: sliding_window={sliding_window} on bidirectional "
                                  "attention without a mask (its extent is ambiguous); pass the mask")
    return (sliding_window - 1, 0)


@dataclass(frozen=True)
class _Segment:
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
    window: tuple[int, int] = _NO_WINDOW


@dataclass(frozen=True)
class _Group:
    """Batch rows [first, last) sharing one key selection and one list of query segments.

    ``key_range`` is (start, stop) when the selected keys are contiguous, else None and ``key_index``
    holds their positions.
    """

    first: int
    last: int
    key_range: tuple[int, int] | None
    key_index: torch.Tensor | None
    segments: tuple[_Segment, ...]


# The plans of the last few masks seen: every layer of one forward gets the same mask object (one per
# attention type in hybrid models, e.g. Gemma's sliding and full layers, which alternate), so the analysis
# and its device-to-host copy run once per forward and mask, not once per layer. Weak references: a plan
# never keeps a mask alive, and a new mask at a dead one's address never matches.
_PLANS_KEPT = 4
_plans: list[tuple[weakref.ReferenceType[torch.Tensor], int, tuple[int, ...], tuple[_Group, ...]]] = []


def _masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
            scaling: float | None, features: dict[str, Any]) -> torch.Tensor:
    batch, _, q_len = query.shape[:3]
    return _run_plan(_plan(attention_mask, batch, q_len, key.shape[2]), query, key, value, scaling, features)


def _run_plan(groups: tuple[_Group, ...], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
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
            extra = features if seg.window == _NO_WINDOW else {**features, "window_size": seg.window}
            pieces.append(lazytriton.attn_fwd(q, k[:, :, keys], v[:, :, keys], causal=seg.causal,
                                              sm_scale=scaling, **extra)[0])
        parts.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _plan(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> tuple[_Group, ...]:
    """The groups of ``attention_mask``, cached for the mask object (and version) it was computed from."""
    global _plans
    shape = (batch, q_len, kv_len)
    plans = _plans  # replaced, never mutated: safe to read while another thread updates it
    for ref, version, plan_shape, groups in plans:
        if ref() is attention_mask and version == attention_mask._version and plan_shape == shape:
            return groups
    groups = _analyse(attention_mask, batch, q_len, kv_len)
    live = [p for p in plans if p[0]() is not None][-(_PLANS_KEPT - 1):]
    _plans = [*live, (weakref.ref(attention_mask), attention_mask._version, shape, groups)]
    return groups


def _analyse(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> tuple[_Group, ...]:
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
            "its sequence attends to (an arbitrary custom 4D mask?); arbitrary masks are not supported yet "
            "(issue 11)")
    groups: list[_Group] = []
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
        if _rows(segments) != list(zip(lo, hi, strict=True)):  # a bug here must never become a wrong result
            raise NotImplementedError(f"lazytriton attention: the plan for sequence {b} does not reproduce its "
                                      "attention mask (a bug in lazytriton; please report it with the mask)")
        groups.append(_Group(b, last, key_range, key_index, segments))
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


def _segments(lo: list[int], hi: list[int]) -> tuple[_Segment, ...]:
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
            segments.append(_Segment(i, j, 0, 0))
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
        window = _NO_WINDOW if left < 0 else (left, 0 if causal else -1)
        segments.append(_Segment(i, j, first, last, causal, window))
        i = j
    return tuple(segments)


def _rows(segments: tuple[_Segment, ...]) -> list[tuple[int, int]]:
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
