"""``scaled_dot_product_attention`` over nested tensors: torch's layout, lazytriton's packed (varlen) call.

torch takes nested tensors in SDPA as (batch, heads, ragged seqlen, head_dim): the ``transpose(1, 2)`` of a nested
tensor of (seqlen_b, heads, head_dim) sequences, strided or jagged, and serves them with its fused kernels' packed
forms. Here each input's sequences are read off it (``unbind``), a dense input's batch entries too, so nested and
dense inputs mix as torch mixes them: an input whose batch is 1 serves every sequence, and one head broadcasts to the
others' count. The sequences are packed into (total, heads, head_dim) tensors and run as one
``flash_attn_varlen_func`` call, inside ``trusted_indices`` (the cumulative lengths are built here from the
sequences' lengths, so the call reads nothing back; a strided nested tensor holds them on the host, unbinding a
jagged one reads its offsets); its output is cut back into sequences and returned as a nested tensor of the query's
layout, transposed as torch returns it. Every step is differentiable, so the gradients reach nested
and dense inputs alike. Jagged inputs that need no broadcast and whose lengths they hold on the host
(``jagged_call``) skip the packing: their values are the packed tensors already, their offsets the cumulative
lengths, and the output is a jagged tensor over the kernel's output with the query's offsets (no copy, no device
read).

Eager only: under ``torch.compile`` the call is a graph break (the lengths are data to a trace). Not with
``attn_mask`` (torch's fused kernels refuse a mask on nested inputs too), and ``is_causal`` only where each sequence
has as many queries as keys (SDPA's causal mask is top-left, the packed call's bottom-right: the two agree there).
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import interface
from lazytriton.kernels.trust import trusted_indices


def given(*tensors: Any) -> bool:
    """Whether any of the inputs is a nested tensor."""
    return any(isinstance(t, torch.Tensor) and t.is_nested for t in tensors)


# The words torch's SDPA raises where no fused kernel takes a nested call: refusals of the same calls quote them.
TORCH_REFUSAL = "No available kernel"


def _sequences(name: str, t: Any) -> list[torch.Tensor]:
    """``t``'s batch entries, each (heads, seqlen, head_dim): a nested tensor's sequences, a dense one's rows."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be Tensor, not {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim) with nested inputs, got "
                         f"{t.dim()} dims")
    rows = list(t.unbind(0))
    if not rows:
        raise ValueError(f"{name} has an empty batch")
    return rows


def _broadcast(name: str, rows: list[torch.Tensor], batch: int, heads: int) -> list[torch.Tensor]:
    """``rows`` for ``batch`` sequences of ``heads`` heads: a batch of 1 repeated, one head expanded."""
    if len(rows) not in (1, batch):
        raise ValueError(f"{name} has a batch of {len(rows)}, which does not broadcast to {batch}")
    if len(rows) == 1:
        rows = rows * batch
    return [r.expand(heads, -1, -1) if r.shape[0] != heads else r for r in rows]


def _heads(name: str, rows: list[torch.Tensor]) -> int:
    counts = {r.shape[0] for r in rows}
    if len(counts) != 1:
        raise ValueError(f"{name}'s sequences have different head counts {sorted(counts)}")
    return counts.pop()


def _packed(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """(total, heads, dim) of (heads, seqlen, dim) sequences, and their lengths."""
    return torch.cat([r.transpose(0, 1) for r in rows]), [r.shape[1] for r in rows]


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    total = [0]
    for n in lengths:
        total.append(total[-1] + n)
    host = torch.tensor(total, dtype=torch.int32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _jagged(t: Any) -> tuple[Any, int, int] | None:
    """A jagged (batch, heads, ragged, dim) input's (batch, ragged, heads, dim) view and longest and shortest lengths.

    None for any other input, and for a jagged one that does not hold its lengths on the host.
    """
    if not (isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged and t.dim() == 4):
        return None
    if [i for i, n in enumerate(t.shape) if not isinstance(n, int)] != [2]:
        return None
    packed = t.transpose(1, 2)
    longest, shortest = (getattr(packed, name, None) for name in ("_maybe_max_seqlen", "_maybe_min_seqlen"))
    if not isinstance(longest, int) or not isinstance(shortest, int):
        return None
    return packed, longest, shortest


def jagged_call(query: Any, key: Any, value: Any, is_causal: Any, enable_gqa: Any) -> tuple[Any, ...] | None:
    """The packed call's tensors when all three inputs are jagged and need no broadcast, else None.

    (q, k, v values, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, query's jagged (batch, ragged, heads,
    dim) view); the general path takes every other case, and raises for misuse.
    """
    found = [_jagged(t) for t in (query, key, value)]
    if any(f is None for f in found):
        return None
    (q, max_q, min_q), (k, max_k, min_k), (v, _, _) = found  # type: ignore[misc]  # none is None here
    offsets_q, offsets_k, offsets_v = q.offsets(), k.offsets(), v.offsets()
    if min(min_q, min_k) == 0 or not (len(offsets_q) == len(offsets_k) and offsets_k is offsets_v):
        return None
    hq, hk, hv = q.shape[2], k.shape[2], v.shape[2]
    if hk != hv or not (hq == hk or hk == 1 or (enable_gqa is True and hq % hk == 0)):
        return None
    if is_causal is True and offsets_q is not offsets_k:  # equal lengths unknown without a device read
        return None
    values = [t.values() for t in (q, k, v)]
    if any(t.stride(-1) != 1 for t in values):
        return None
    cu_q, cu_k = (o.to(torch.int32) for o in (offsets_q, offsets_k))
    return (*values, cu_q, cu_k, max_q, max_k, q)


@torch.compiler.disable  # the sequences' lengths are data to a trace: run eagerly, a graph break under compile
def attention(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any,
              enable_gqa: Any) -> torch.Tensor:
    """SDPA with nested inputs (``given``); a ValueError/TypeError naming the argument for misuse."""
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported with nested tensors (torch's fused kernels refuse it too)")
    fast = jagged_call(query, key, value, is_causal, enable_gqa)
    if fast is not None:
        q, k, v, cu_q, cu_k, max_q, max_k, view = fast
        with trusted_indices():  # torch's offsets and lengths: right by construction
            out = interface.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                                   softmax_scale=scale, causal=is_causal)
        return torch.nested.nested_tensor_from_jagged(out, view.offsets(), max_seqlen=max_q).transpose(1, 2)
    rows = {name: _sequences(name, t) for name, t in (("query", query), ("key", key), ("value", value))}
    batch = max(len(r) for r in rows.values())
    hq, hk, hv = (_heads(name, rows[name]) for name in ("query", "key", "value"))
    if hk != hv and 1 not in (hk, hv):
        raise ValueError(f"key has {hk} heads and value {hv}: they must match (or one be 1)")
    hkv = max(hk, hv)
    if hq == 1 and hkv > 1:
        hq = hkv  # one query head broadcasts to the key/value heads
    elif hq != hkv and hkv != 1 and not (enable_gqa and hq % hkv == 0):  # one key/value head: MQA
        raise ValueError(f"query has {hq} heads and key/value {hkv}: they must match, or one be 1, or "
                         f"enable_gqa=True with {hkv} dividing {hq}")
    q_rows = _broadcast("query", rows["query"], batch, hq)
    k_rows = _broadcast("key", rows["key"], batch, hkv)
    v_rows = _broadcast("value", rows["value"], batch, hkv)
    if is_causal is True and any(q.shape[1] != k.shape[1] for q, k in zip(q_rows, k_rows, strict=True)):
        raise ValueError("is_causal with nested tensors needs each sequence's query and key lengths equal (SDPA's "
                         "top-left mask and the packed call's bottom-right one differ otherwise)")
    lengths_k, lengths_v = [r.shape[1] for r in k_rows], [r.shape[1] for r in v_rows]
    mismatched = next((i for i, (nk, nv) in enumerate(zip(lengths_k, lengths_v, strict=True)) if nk != nv), None)
    if mismatched is not None:
        raise ValueError(f"key and value must have the same length in each sequence; sequence {mismatched} has a "
                         f"key length of {lengths_k[mismatched]} and a value length of {lengths_v[mismatched]} "
                         f"(torch's fused kernels refuse it too: \"{TORCH_REFUSAL}\")")
    if any(r.shape[1] == 0 for r in q_rows) or 0 in lengths_k:
        raise ValueError(f"every sequence of a nested query, key and value needs at least one position (torch's fused "
                         f"kernels refuse an empty one too: \"{TORCH_REFUSAL}\")")
    q, lengths_q = _packed(q_rows)
    k, _ = _packed(k_rows)
    v, _ = _packed(v_rows)
    with trusted_indices():  # built here from the sequences' lengths
        out = interface.flash_attn_varlen_func(
            q, k, v, _cumulative(lengths_q, q.device), _cumulative(lengths_k, q.device), max(lengths_q),
            max(lengths_k), dropout_p=dropout_p, softmax_scale=scale, causal=is_causal)
    pieces = list(out.split(lengths_q))
    layout = query.layout if isinstance(query, torch.Tensor) and query.is_nested else key.layout
    return torch.nested.as_nested_tensor(pieces, layout=layout).transpose(1, 2)
