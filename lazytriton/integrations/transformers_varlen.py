"""Padded batches of the "lazytriton" transformers attention: one ``flash_attn_varlen_func`` call per layer.

A boolean (batch, 1, q_len, kv_len) mask that is padding (anywhere)
combined with causal or bidirectional attention and at most a sliding window
runs as FlashAttention's varlen call: the queries and the keys each sequence
attends to are gathered into packed (total, heads, head_dim) tensors, the
call runs every sequence at once (bottom-right causal alignment within each
sequence, the window counted in its packed keys), and the output is
scattered back, zeros elsewhere (FlashAttention's ``unpad_input`` /
``pad_input``, as transformers' flash_attention_2 integration does).

Which tokens. A key is packed when a packed query sees it. For a causal
layer a query is packed when it is a real token (the last q_len columns of
transformers' 2D padding mask, handed over by the mask function through
``remember_queries``) and sees a key: a right-padded sequence's pad queries,
which see the real keys in SDPA, give zeros here, as in transformers'
flash_attention_2. For a bidirectional layer every query that sees a key is
packed (pad rows then match SDPA's). Queries that see no key give zeros, as
SDPA gives.

Exact or refused. From the mask alone, on the device, the window is
inferred (the farthest key a packed query sees on each side of its aligned
position, when some query is cut there), the mask the varlen call would
apply is rebuilt by FlashAttention-2's rule and compared with the mask on
every packed query's row. Only an exact match runs here; anything else
(chunks, packed documents, a window across pads between real keys, custom
masks) gets ``None`` and runs elsewhere. When every sequence packs all its
queries and the same contiguous keys (a mask without padding: a static
cache, a window that cuts in), a dense ``attn_fwd`` call on that key slice
replaces the varlen one (no gather).

Cost: the analysis runs once per forward and mask (all layers share the mask
object) and reads one small summary to the host (one sync: the packed sizes
must be known to allocate); cu_seqlens and the gather indices are built on
the device from it without another sync.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

import lazytriton
from lazytriton.kernels.trust import trusted_indices

NO_WINDOW = (-1, -1)
_KEPT = 8  # masks remembered: one per attention type and forward, a few forwards in flight


@dataclass(frozen=True)
class Dense:
    """Every sequence attends with the same contiguous keys [key_start, key_stop): one dense call on that slice."""

    key_start: int
    key_stop: int
    causal: bool
    window: tuple[int, int]


@dataclass(frozen=True)
class Packed:
    """One varlen call: gather indices (batch, position) of the packed queries and keys, their cu_seqlens."""

    q_index: tuple[torch.Tensor, torch.Tensor]
    k_index: tuple[torch.Tensor, torch.Tensor]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: tuple[int, int]


Layout = Dense | Packed | None

# Replaced, never mutated (safe to read while another thread updates them). Weak references: nothing here
# keeps a mask alive, and a new mask at a dead one's address never matches.
_queries: list[tuple[weakref.ReferenceType[torch.Tensor], torch.Tensor]] = []
_layouts: list[tuple[weakref.ReferenceType[torch.Tensor], int, tuple[Any, ...], Layout]] = []


def remember_queries(mask: torch.Tensor, real_queries: torch.Tensor) -> None:
    """Record, for the mask the mask function built, which query rows are real tokens ((batch, q_len) booleans)."""
    global _queries
    live = [e for e in _queries if e[0]() is not None][-(_KEPT - 1):]
    _queries = [*live, (weakref.ref(mask), real_queries)]


def _real_queries(mask: torch.Tensor) -> torch.Tensor | None:
    for ref, real in _queries:
        if ref() is mask:
            return real
    return None


def layout(mask: torch.Tensor, batch: int, q_len: int, kv_len: int, causal: bool) -> Layout:
    """How ``mask`` runs in one call (Dense or Packed), or None; cached for the mask object and its version."""
    global _layouts
    key = (batch, q_len, kv_len, causal)
    for ref, version, k, found in _layouts:
        if ref() is mask and version == mask._version and k == key:
            return found
    found = _analyse(mask, batch, q_len, kv_len, causal)
    live = [e for e in _layouts if e[0]() is not None][-(_KEPT - 1):]
    _layouts = [*live, (weakref.ref(mask), mask._version, key, found)]
    return found


def _mask_3d(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """The mask as (batch, q_len, kv_len) booleans when it is one boolean mask for all heads, else None."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or 0 in (batch, q_len, kv_len):
        return None
    try:
        return mask[:, 0].expand(batch, q_len, kv_len)
    except RuntimeError:
        return None


def _analyse(mask: torch.Tensor, batch: int, q_len: int, kv_len: int, causal: bool) -> Layout:
    """Infer the packed tokens and the window, rebuild the varlen call's mask and compare (module docstring)."""
    m = _mask_3d(mask, batch, q_len, kv_len)
    if m is None:
        return None
    counts = m.sum(dim=-1)  # (batch, q_len): keys each query sees
    q_sel = counts > 0
    real = _real_queries(mask)
    if causal and real is not None and real.shape == (batch, q_len):
        q_sel = q_sel & real
    k_sel = (m & q_sel[:, :, None]).any(dim=1)  # (batch, kv_len): keys some packed query sees
    n_q, n_k = q_sel.sum(dim=-1), k_sel.sum(dim=-1)
    rank_k = k_sel.cumsum(dim=-1) - 1
    # A packed query's position among its sequence's packed keys, bottom-right aligned (FlashAttention-2).
    pos = q_sel.cumsum(dim=-1) - 1 + (n_k - n_q)[:, None]
    first = rank_k.gather(-1, m.to(torch.uint8).argmax(dim=-1))  # the first key each query sees
    last = first + counts - 1  # the last one, if its keys are contiguous (the comparison below checks)
    unbounded = q_len + kv_len + 1  # an extent that cuts nothing
    left = _extent(q_sel, pos - first, q_sel & (first > 0), unbounded)
    right = torch.zeros_like(left) if causal else _extent(q_sel, last - pos, q_sel & (last < n_k[:, None] - 1),
                                                          unbounded)
    implied = k_sel[:, None, :] & (rank_k[:, None, :] >= (pos - left)[:, :, None]) & (
        rank_k[:, None, :] <= (pos + right)[:, :, None])
    wrong = ((implied != m) & q_sel[:, :, None]).any()
    positions = torch.arange(kv_len, device=m.device)
    start = torch.where(k_sel[0], positions, kv_len).amin()
    stop = torch.where(k_sel[0], positions + 1, 0).amax()
    dense = (n_q == q_len).all() & (k_sel == k_sel[:1]).all() & (stop - start == n_k[0])
    summary = torch.stack([t.to(torch.int64) for t in (wrong, dense, n_q.amax(), n_k.amax(), n_q.sum(), n_k.sum(),
                                                        start, stop, left, right)])
    wrong_, dense_, max_q, max_k, total_q, total_k, start_, stop_, left_, right_ = summary.tolist()  # one sync
    if wrong_ or min(left_, right_) < 0:
        return None
    left_ = -1 if left_ >= unbounded else left_
    if causal:  # plain kernels unless a window cuts in (causal sets right to 0 anyway)
        window = NO_WINDOW if left_ < 0 else (left_, 0)
    else:  # here right = 0 is a window (a causal-shaped mask on a bidirectional layer)
        window = (left_, -1 if right_ >= unbounded else right_)
    if dense_:
        return Dense(start_, stop_, causal, window)
    pad = torch.nn.functional.pad
    return Packed(_index(q_sel, total_q), _index(k_sel, total_k),
                  pad(n_q.cumsum(0), (1, 0)).to(torch.int32), pad(n_k.cumsum(0), (1, 0)).to(torch.int32),
                  max(max_q, 1), max(max_k, 1), causal, window)


def _extent(q_sel: torch.Tensor, distance: torch.Tensor, cut: torch.Tensor, unbounded: int) -> torch.Tensor:
    """The window's extent on one side: the farthest key a packed query sees there, if some query is cut there."""
    farthest = torch.where(q_sel, distance, -unbounded).amax()
    return torch.where(cut.any(), farthest, unbounded)


def _index(selected: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, position) of the ``total`` selected entries of a (batch, length) mask, in order, without a sync.

    Unlike ``nonzero``, whose output size the host must read, the size is known: each selected entry writes
    its flat position at its rank; the others all write into one spare slot, dropped.
    """
    flat = selected.flatten()
    slot = torch.where(flat, flat.cumsum(0) - 1, total)
    index = torch.empty(total + 1, dtype=torch.long, device=flat.device)
    index.scatter_(0, slot, torch.arange(flat.numel(), device=flat.device))
    index = index[:total]
    length = selected.shape[1]
    return index // length, index % length


def run_dense(found: Dense, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
              features: dict[str, Any]) -> torch.Tensor:
    """The attention output, (batch, heads_q, q_len, head_dim_v): one ``attn_fwd`` call on the key slice."""
    keys = slice(found.key_start, found.key_stop)
    extra = features if found.window == NO_WINDOW else {**features, "window_size": found.window}
    causal = "bottom_right" if found.causal else False
    return lazytriton.attn_fwd(query, key[:, :, keys], value[:, :, keys], causal=causal, sm_scale=scaling,
                               **extra)[0]


def run_packed(found: Packed, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
               features: dict[str, Any]) -> torch.Tensor:
    """The attention output, (batch, q_len, heads_q, head_dim_v): gather, one varlen call, scatter (zeros elsewhere)."""
    batch, heads, q_len = query.shape[:3]
    out = query.new_zeros(batch, q_len, heads, value.shape[3])
    if found.q_index[0].numel() == 0:
        return out
    q = query.transpose(1, 2)[found.q_index]  # (total_q, heads_q, head_dim): one gather, contiguous
    k = key.transpose(1, 2)[found.k_index]
    v = value.transpose(1, 2)[found.k_index]
    # cu_seqlens come from the mask this forward already read once (the layout's one sync), so each layer's
    # call skips its own read of them (kernels/trust.py): no device-to-host sync per layer.
    with trusted_indices():
        packed = lazytriton.flash_attn_varlen_func(q, k, v, found.cu_seqlens_q, found.cu_seqlens_k,
                                                   found.max_seqlen_q, found.max_seqlen_k, softmax_scale=scaling,
                                                   causal=found.causal, window_size=found.window, **features)
    return out.index_put_(found.q_index, packed)  # in place on the fresh zeros: autograd records it
