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

In place. Where each sequence's packed queries are one run of its rows and
its packed keys another (padding on the left, on the right or both: a
prefill, a bidirectional encoder, several new tokens against a left-padded
cache), no gather is needed either (``Runs``): the varlen call reads the
layer's padded tensors as packed ones whose sequence b starts at row
``b * rows + first[b]`` (``rows``: the tensor's batch stride in rows), uses
the first ``seqused`` rows of each span (FlashAttention-3's
seqused_q/seqused_k), and writes the output straight into the padded
(batch, q_len, heads, head_dim) layout, zeros in every row no packed query
holds (a leading empty sequence spans the rows before the first one's). One
launch a layer, against the gather route's three gathers, a zero fill, the
call and a scatter. The computation is the gather route's, bit for bit:
each sequence's rows and keys, tiles and alignment are the same. The gather
route stays for masks whose tokens have holes, for calls that want
gradients (the packed views of k and v overlap across heads), and for
tensors whose batch stride is not a whole number of rows.

Cost: the analysis runs once per forward and mask (all layers share the mask
object) and reads one small summary to the host (one sync: the packed sizes
must be known to allocate); seqused, cu_seqlens and the gather indices are
built on the device from it without another sync, the in-place route's
cu_seqlens once per forward and tensor layout, the gather indices on the
first layer that gathers. A causal prefill without a cache gets its layout
from the mask function instead (``remember_prefill``: read off the 2D
padding mask in ~20 small ops where the analysis takes ~90, one sync all
the same), and the in-place call of plain eager tensors is checked once per
forward and layout (``checked_varlen_call``): each layer is then one
``varlen.forward``, one launch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import lazytriton
from lazytriton import geometry, interface
from lazytriton.kernels.flash_fwd import varlen
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
class Runs:
    """Each sequence's packed queries are one run of its rows, and its packed keys another: no gather needed.

    Sequence b's packed queries are rows [q_first[b], q_first[b] + n_q[b]) of its own, its keys rows
    [k_first[b], k_first[b] + n_k[b]). ``seqused_q``/``seqused_k``: int32 (batch + 1,), 0 for the leading empty
    sequence, then n_q (n_k); ``q_spread``/``k_spread``: max(first) - min(first), so that every span of the call
    is at most a sequence's rows plus its spread.
    """

    q_first: torch.Tensor  # (batch,) int64, on the mask's device
    k_first: torch.Tensor
    seqused_q: torch.Tensor
    seqused_k: torch.Tensor
    q_spread: int
    k_spread: int
    made: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    # The varlen call checked once per layout (``checked_varlen_call``): every other layer of the forward launches it.
    calls: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    def cu_seqlens(self, side: str, rows: int, total: int) -> torch.Tensor:
        """int32 (batch + 2,): 0, then b * rows + first[b] for each sequence, then ``total``; made once per layout.

        ``side``: "q" or "k"; ``rows``: rows between two sequences' first rows in the packed view; ``total``: its rows.
        """
        key = (side, rows, total)
        found = self.made.get(key)
        if found is None:
            first = self.q_first if side == "q" else self.k_first
            starts = torch.arange(first.numel(), device=first.device) * rows + first
            found = torch.cat((first.new_zeros(1), starts, first.new_full((1,), total))).to(torch.int32)
            self.made[key] = found  # a race makes the same tensor twice: harmless
        return found


@dataclass(frozen=True)
class Packed:
    """One varlen call on the packed queries and keys (selected in (batch, length) masks), its sizes and window.

    The gather indices and cu_seqlens are made on first use (the in-place route, ``runs``, needs neither).
    """

    q_sel: torch.Tensor  # (batch, q_len) bool: the packed queries
    k_sel: torch.Tensor  # (batch, kv_len) bool: the packed keys
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: tuple[int, int]
    runs: Runs | None = None
    made: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def _made(self, name: str, make: Callable[[], Any]) -> Any:
        found = self.made.get(name)
        if found is None:
            found = self.made[name] = make()  # a race makes the same tensors twice: harmless
        return found

    @property
    def q_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, position) of each packed query, in order."""
        return self._made("q_index", lambda: _index(self.q_sel, self.total_q))  # type: ignore[no-any-return]

    @property
    def k_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, position) of each packed key, in order."""
        return self._made("k_index", lambda: _index(self.k_sel, self.total_k))  # type: ignore[no-any-return]

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """int32 (batch + 1,): the packed queries' cumulative counts."""
        return self._made("cu_q", lambda: _cumulative(self.q_sel))  # type: ignore[no-any-return]

    @property
    def cu_seqlens_k(self) -> torch.Tensor:
        """int32 (batch + 1,): the packed keys' cumulative counts."""
        return self._made("cu_k", lambda: _cumulative(self.k_sel))  # type: ignore[no-any-return]


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


def remember_prefill(mask: torch.Tensor, padding: torch.Tensor) -> None:
    """Give ``layout`` a causal prefill's layout, read off its (batch, length) boolean padding mask, where it is one.

    ``mask`` must be ``sdpa_mask``'s for the plain causal mask function without a cache (q_len == kv_len == the
    padding's length, no offsets): query q of sequence b sees key k when k <= q and padding[b, k]. Where each
    row's real tokens are one run, they are its packed queries and its packed keys (its last query sees them all),
    bottom-right aligned, no window: ``Runs``' layout in ~20 small ops on the padding instead of the analysis'
    ~90 on the (batch, length, length) mask; one sync all the same (the sizes). A row with holes, or a batch
    without padding (the analysis makes that a dense call), gives nothing: the analysis runs as usual.
    """
    global _layouts
    batch, length = padding.shape
    if padding.dtype != torch.bool or tuple(mask.shape) != (batch, 1, length, length) or mask.dtype != torch.bool:
        return
    count = padding.sum(dim=-1)
    first, run = _first_and_run(padding, count)
    summary = torch.stack([run.to(torch.int64), count.amax(), count.sum(), first.amax() - first.amin()])
    run_, longest, total, spread = summary.tolist()  # one sync
    if not run_ or total == batch * length:
        return
    used = torch.nn.functional.pad(count, (1, 0)).to(torch.int32)
    found = Packed(padding, padding, total, total, max(longest, 1), max(longest, 1), True, NO_WINDOW,
                   Runs(first, first, used, used, spread, spread))
    live = [e for e in _layouts if e[0]() is not None][-(_KEPT - 1):]
    _layouts = [*live, (weakref.ref(mask), mask._version, (batch, length, length, True), found)]


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
    q_first, q_run = _first_and_run(q_sel, n_q)
    k_first, k_run = _first_and_run(k_sel, n_k)
    summary = torch.stack([t.to(torch.int64) for t in (
        wrong, dense, n_q.amax(), n_k.amax(), n_q.sum(), n_k.sum(), start, stop, left, right, q_run & k_run,
        q_first.amax() - q_first.amin(), k_first.amax() - k_first.amin())])
    (wrong_, dense_, max_q, max_k, total_q, total_k, start_, stop_, left_, right_, runs_, q_spread,
     k_spread) = summary.tolist()  # one sync
    if wrong_ or min(left_, right_) < 0:
        return None
    left_ = -1 if left_ >= unbounded else left_
    if causal:  # plain kernels unless a window cuts in (causal sets right to 0 anyway)
        window = NO_WINDOW if left_ < 0 else (left_, 0)
    else:  # here right = 0 is a window (a causal-shaped mask on a bidirectional layer)
        window = (left_, -1 if right_ >= unbounded else right_)
    if dense_:
        return Dense(start_, stop_, causal, window)
    runs = None
    if runs_:
        pad = torch.nn.functional.pad
        runs = Runs(q_first, k_first, pad(n_q, (1, 0)).to(torch.int32), pad(n_k, (1, 0)).to(torch.int32), q_spread,
                    k_spread)
    return Packed(q_sel, k_sel, total_q, total_k, max(max_q, 1), max(max_k, 1), causal, window, runs)


def _first_and_run(selected: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first selected position (0 if none) and whether every row's selected positions are one run."""
    first = selected.to(torch.uint8).argmax(dim=-1)
    positions = torch.arange(selected.shape[1], device=selected.device)
    run = (positions >= first[:, None]) & (positions < (first + count)[:, None])
    return first, (run == selected).all()


def _cumulative(selected: torch.Tensor) -> torch.Tensor:
    """int32 (batch + 1,): 0, then the running count of a (batch, length) mask's selected entries per row."""
    return torch.nn.functional.pad(selected.sum(dim=-1).cumsum(0), (1, 0)).to(torch.int32)


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
    """The attention output, (batch, q_len, heads_q, head_dim_v): in place where it can, else gather, call, scatter.

    Zeros in every row no packed query holds.
    """
    if found.runs is not None:
        out = _run_in_place(found, found.runs, query, key, value, scaling, features)
        if out is not None:
            return out
    batch, heads, q_len = query.shape[:3]
    out = query.new_zeros(batch, q_len, heads, value.shape[3])
    if found.total_q == 0:
        return out
    q_index, k_index = found.q_index, found.k_index
    q = query.transpose(1, 2)[q_index]  # (total_q, heads_q, head_dim): one gather, contiguous
    k = key.transpose(1, 2)[k_index]
    v = value.transpose(1, 2)[k_index]
    # cu_seqlens come from the mask this forward already read once (the layout's one sync), so each layer's
    # call skips its own read of them (kernels/trust.py): no device-to-host sync per layer.
    with trusted_indices():
        packed = lazytriton.flash_attn_varlen_func(q, k, v, found.cu_seqlens_q, found.cu_seqlens_k,
                                                   found.max_seqlen_q, found.max_seqlen_k, softmax_scale=scaling,
                                                   causal=found.causal, window_size=found.window, **features)
    return out.index_put_(q_index, packed)  # in place on the fresh zeros: autograd records it


_Tensor = torch.Tensor


def _run_in_place(found: Packed, runs: Runs, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float | None, features: dict[str, Any]) -> torch.Tensor | None:
    """``run_packed``'s output by one varlen call on views of the padded tensors (module docstring), or None.

    None where it does not apply: a gradient wanted, a tensor subclass, or k and v whose batch strides are not
    the same whole number of rows.
    """
    if not (type(query) is _Tensor and type(key) is _Tensor and type(value) is _Tensor):
        return None
    sinks = features.get("sinks")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or (isinstance(sinks, _Tensor) and sinks.requires_grad)):
        return None  # the packed views of k and v overlap: their gradient would take autograd's slow path
    k_rows, v_rows = _rows(key), _rows(value)
    if k_rows is None or k_rows != v_rows:
        return None
    batch, heads, q_len, dim = query.shape
    q = query.transpose(1, 2)
    if not q.is_contiguous():  # the output's layout: (batch, q_len, heads, head_dim), one sequence every q_len rows
        q = q.contiguous()
    q = q.view(batch * q_len, heads, dim)
    k, v = _packed_view(key, k_rows), _packed_view(value, k_rows)
    cu_q, cu_k = runs.cu_seqlens("q", q_len, q.shape[0]), runs.cu_seqlens("k", k_rows, k.shape[0])
    # Every value comes from the mask this forward already read once (the layout's one sync): no call reads them
    # again (kernels/trust.py); max_seqlen bounds every span.
    max_q, max_k = q_len + runs.q_spread, k_rows + runs.k_spread
    if _checked_once(q, k, v, features):
        out = checked_varlen_call(q, k, v, cu_q, cu_k, max_q, max_k, causal=found.causal, window_size=found.window,
                                  softmax_scale=scaling, seqused_q=runs.seqused_q, seqused_k=runs.seqused_k,
                                  calls=runs.calls, **features)
    else:
        with trusted_indices():
            out = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling,
                                                    causal=found.causal, window_size=found.window,
                                                    seqused_q=runs.seqused_q, seqused_k=runs.seqused_k, **features)
    return out.view(batch, q_len, heads, out.shape[-1])  # type: ignore[no-any-return]


_CHECKED_ONCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _checked_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: dict[str, Any]) -> bool:
    """Whether ``checked_varlen_call`` serves the call.

    Eager plain tensors (no trace, no dispatch mode; the caller refused gradients), float16/bfloat16/float32, v's
    head dim up to 256, no sinks (each layer has its own).
    """
    return (len(features) == ("softcap" in features) and q.dtype in _CHECKED_ONCE_DTYPES
            and v.shape[-1] <= geometry.MAX_HEAD_DIM and interface.direct(q, k, v))


def checked_varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                        window_size: tuple[int, int], softmax_scale: float | None, seqused_q: torch.Tensor,
                        seqused_k: torch.Tensor, calls: dict[tuple[Any, ...], Any],
                        softcap: float = 0.0) -> torch.Tensor:
    """``flash_attn_varlen_func``'s output for an eager call (``_checked_once``), checked once per entry of ``calls``.

    ``varlen.check`` runs once for the call's sizes, strides, dtype, device, scale and softcap (the index tensors
    and flags are ``calls``' owner's, one forward's: the same for every layer), its values trusted; then
    ``varlen.forward``, what the public function runs for such a call, on every layer.
    """
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, softmax_scale, softcap)
    call = calls.get(key)
    if call is None:
        call = varlen.check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                            window_size, softcap, values=False, seqused_q=seqused_q, seqused_k=seqused_k)
        calls[key] = call
    return varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, call)[0]  # type: ignore[no-any-return]


def _rows(t: torch.Tensor) -> int | None:
    """The rows between two sequences' first rows of a (batch, heads, length, d) tensor read as packed rows, or None.

    Its batch stride over its row stride, when that is a whole number of rows of at least its length (a
    DynamicCache's (batch, heads_k, kv_len, d): heads_k * kv_len); None otherwise, or without a contiguous last dim.
    """
    batch, _, length, _ = t.shape
    stride_b, _, stride_n, stride_d = t.stride()
    if stride_d != 1 and t.shape[3] > 1:
        return None
    if batch == 1:
        return length
    if stride_n <= 0 or stride_b % stride_n or stride_b // stride_n < length:
        return None
    return stride_b // stride_n


def _packed_view(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(batch, heads, length, d) as packed (total, heads, d) rows (a view): sequence b's row n is row b * rows + n.

    Heads further apart than a row overlap other rows; only each sequence's own rows are read.
    """
    batch, heads, length, dim = t.shape
    return t.as_strided(((batch - 1) * rows + length, heads, dim), (t.stride(2), t.stride(1), t.stride(3)))
