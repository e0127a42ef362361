"""``scaled_dot_product_attention`` over nested tensors: torch's layout, lazytriton's packed (varlen) call.

torch takes nested tensors in SDPA as (batch, heads, ragged seqlen, head_dim): the ``transpose(1, 2)`` of a nested
tensor of (seqlen_b, heads, head_dim) sequences, strided or jagged, and serves them with its fused kernels' packed
forms. Here each input's sequences are read off it (``unbind``), a dense input's batch entries too, so nested and
dense inputs mix as torch mixes them: an input whose batch is 1 serves every sequence, and one head broadcasts to the
others' count. The sequences are packed into (total, heads, head_dim) tensors with their cumulative lengths (known on
the host: no device read) and run as one ``flash_attn_varlen_func`` call; its output is cut back into sequences and
returned as a nested tensor of the query's layout, transposed as torch returns it. Every step is differentiable, so
the gradients reach nested and dense inputs alike.

Not with ``attn_mask`` (torch's fused kernels refuse a mask on nested inputs too), and ``is_causal`` only where each
sequence has as many queries as keys (SDPA's causal mask is top-left, the packed call's bottom-right: the two agree
there).
"""

from __future__ import annotations

from typing import Any

import torch

from lazytriton import interface


def given(*tensors: Any) -> bool:
    """Whether any of the inputs is a nested tensor."""
    return any(isinstance(t, torch.Tensor) and t.is_nested for t in tensors)


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


def attention(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any,
              enable_gqa: Any) -> torch.Tensor:
    """SDPA with nested inputs (``given``); a ValueError/TypeError naming the argument for misuse."""
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported with nested tensors (torch's fused kernels refuse it too)")
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
    q, lengths_q = _packed(q_rows)
    k, lengths_k = _packed(k_rows)
    v, _ = _packed(v_rows)
    if any(n == 0 for n in lengths_q + lengths_k):
        raise ValueError("every sequence of a nested query, key and value needs at least one position")
    out = interface.flash_attn_varlen_func(
        q, k, v, _cumulative(lengths_q, q.device), _cumulative(lengths_k, q.device), max(lengths_q),
        max(lengths_k), dropout_p=dropout_p, softmax_scale=scale, causal=is_causal)
    pieces = list(out.split(lengths_q))
    layout = query.layout if isinstance(query, torch.Tensor) and query.is_nested else key.layout
    return torch.nested.as_nested_tensor(pieces, layout=layout).transpose(1, 2)
