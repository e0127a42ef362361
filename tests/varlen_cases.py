"""Packed sequences for the varlen tests: cu_seqlens of a batch's lengths and a reference taken sequence by sequence."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import lazytriton
from lazytriton.kernels.flash_fwd.reference import attention_reference


def cu(lengths: tuple[int, ...]) -> torch.Tensor:
    """cu_seqlens of ``lengths``: 0, then each running total, int32."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def packed_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans_q: tuple[int, ...],
                     spans_k: tuple[int, ...], *, used_q: tuple[int, ...] | None = None,
                     used_k: tuple[int, ...] | None = None, causal: bool = False,
                     window: tuple[int, int] = (-1, -1), softcap: float = 0.0, slopes: torch.Tensor | None = None,
                     keep: torch.Tensor | None = None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of packed (total, heads, head_dim) q, k, v with ``attention_reference``, one sequence at a time.

    Sequence i's queries are the first ``used_q[i]`` rows of its span of ``spans_q[i]`` rows (the whole span
    without ``used_q``), its keys likewise; ``causal`` aligns bottom-right within the used lengths. out holds the
    used rows, packed, and lse is (heads_q, used rows). ``slopes``: ALiBi's, (heads_q,) or (batch, heads_q).
    ``keep``: dropout's mask over the packed (1, heads_q, total_q, total_k) scores, of which each sequence's used
    rows and keys take their block.
    """
    outs, lses = [], []
    cq, ck = cu(spans_q).tolist(), cu(spans_k).tolist()
    used_q, used_k = used_q or spans_q, used_k or spans_k
    for i in range(len(spans_q)):
        qs = q[cq[i]:cq[i] + used_q[i]].transpose(0, 1)[None]
        ks, vs = (t[ck[i]:ck[i] + used_k[i]].transpose(0, 1)[None] for t in (k, v))
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[i])
        block = None if keep is None else keep[:, :, cq[i]:cq[i] + used_q[i], ck[i]:ck[i] + used_k[i]]
        out, lse = attention_reference(qs, ks, vs, causal="bottom_right" if causal else False, window_size=window,
                                       softcap=softcap, alibi_slopes=sl, dropout_p=dropout_p, keep=block)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def assert_refused(args: dict[str, Any], name: str, change: Callable[[dict[str, Any]], Any],
                   error: type[Exception], match: str) -> None:
    """flash_attn_varlen_func(**args) with ``args[name]`` replaced by ``change(args)`` raises ``error`` (``match``)."""
    args = {**args, name: change(args)}
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_varlen_func(**args)
