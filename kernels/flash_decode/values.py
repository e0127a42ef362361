"""The values of a ``flash_attn_with_kvcache`` call's index tensors, read once the shapes are checked.

``check_values`` reads cache_seqlens, cache_batch_idx, cache_leftpad,
block_table, rotary_seqlens, cu_seqlens_q and cu_seqlens_k_new: a length past
the cache's end or a block table entry past the cache would make the kernel
read, and the append write, outside the cache; a left pad past a sequence's
cached length has no meaning (its new keys would land before its first key);
a rotary position outside rotary_cos/rotary_sin has no angle. On a GPU that
read costs one host synchronisation, so it is skipped while a CUDA graph is
being captured (nothing can be read then) and inside ``trusted_indices()``
(``values_checked``). Errors name the tensors by the caller's ``Names``.
"""

from __future__ import annotations

import torch

from lazytriton import launch
from lazytriton.kernels.flash_decode.checks import KVCACHE, Call, Inputs, Names, holds
from lazytriton.kernels.trust import indices_trusted


def values_checked(t: Inputs) -> bool:
    """Whether ``check_values`` runs: not inside ``trusted_indices()``, a capture on q's device, or on meta."""
    if indices_trusted() or t.q.device.type == "meta":
        return False
    if t.q.device.type != "cuda":
        return True
    return not launch.capturing(t.q.get_device())


def cached(t: Inputs, call: Call) -> torch.Tensor:
    """Each sequence's key count before the append (cache_seqlens), int64 (batch,), on q's device."""
    if not isinstance(t.cache_seqlens, torch.Tensor) or call.seqlen_const >= 0:
        return torch.full((call.batch,), call.seqlen_const, dtype=torch.int64, device=t.q.device)
    return t.cache_seqlens.long()


def new_counts(t: Inputs, call: Call) -> torch.Tensor | int:
    """Each sequence's new keys: int64 (batch,) from cu_seqlens_k_new, else seqlen_new (every sequence's)."""
    if not call.varlen_new:
        return call.seqlen_new
    cu = t.cu_seqlens_k_new.long()  # type: ignore[union-attr]
    return cu[1:] - cu[:-1]


def lengths(t: Inputs, call: Call) -> torch.Tensor:
    """Each sequence's key count after the append, int64 (batch,), on q's device."""
    return cached(t, call) + new_counts(t, call)


def check_values(t: Inputs, call: Call, names: Names = KVCACHE) -> None:
    """Refuse index values that would read or write outside the cache (one host synchronisation on a GPU)."""
    problems = []
    if call.varlen_new:
        problems.append(_bad_cu_seqlens_k_new(t, call).any())
    if isinstance(t.cache_seqlens, torch.Tensor):
        lens = t.cache_seqlens.long()
        problems.append(((lens < 0) | (lens + new_counts(t, call) > call.capacity)).any())
    if t.cache_batch_idx is not None:
        problems.append(_bad_rows(t, call).any())
    if t.cache_leftpad is not None:
        problems.append(_bad_leftpad(t, call).any())
    if t.block_table is not None:
        table = _tables(t)
        problems.append((((table < 0) | (table >= call.cache_rows)) & _used_pages(t, call)).any())
    rotary_positions = call.rotary and (call.rotary_seqlens or isinstance(t.cache_seqlens, torch.Tensor)
                                        or call.varlen_new)
    if rotary_positions:
        problems.append(_bad_rotary(t, call).any())
    if t.cu_seqlens_q is not None:
        problems.append(_bad_cu_seqlens(t, call).any())
    if not problems:
        return
    found = torch.stack(problems).tolist()  # the one synchronisation
    fields = [n for n, given in (("cu_seqlens_k_new", call.varlen_new),
                                 ("cache_seqlens", isinstance(t.cache_seqlens, torch.Tensor)),
                                ("cache_batch_idx", t.cache_batch_idx is not None),
                                ("cache_leftpad", t.cache_leftpad is not None),
                                ("block_table", t.block_table is not None),
                                ("rotary_seqlens" if call.rotary_seqlens else "rotary_cos", rotary_positions),
                                ("cu_seqlens_q", t.cu_seqlens_q is not None))
             if given]
    for field, bad in zip(fields, found, strict=True):
        if bad:
            raise ValueError(_value_error(field, t, call, names))


def _row_count(t: Inputs, call: Call) -> int:
    """How many rows cache_batch_idx picks from: the block table's with one, else k_cache's batch."""
    return call.cache_rows if t.block_table is None else t.block_table.shape[0]


def _bad_rows(t: Inputs, call: Call) -> torch.Tensor:
    """Which sequences' cache_batch_idx is outside 0..rows - 1, (batch,)."""
    rows = t.cache_batch_idx.long()  # type: ignore[union-attr]
    return (rows < 0) | (rows >= _row_count(t, call))


def _tables(t: Inputs) -> torch.Tensor:
    """(batch, max_blocks): each sequence's row of the block table, cache_batch_idx's (clamped: checked apart)."""
    table = t.block_table
    assert table is not None
    if t.cache_batch_idx is None:
        return table
    return table.index_select(0, t.cache_batch_idx.long().clamp(0, table.shape[0] - 1))


def _bad_leftpad(t: Inputs, call: Call) -> torch.Tensor:
    """Which sequences' left pads are outside 0..cached length (cache_seqlens, before the new keys), (batch,)."""
    pads = t.cache_leftpad.long()  # type: ignore[union-attr]
    return (pads < 0) | (pads > cached(t, call))


def _rotary_base(t: Inputs, call: Call) -> torch.Tensor:
    """Each sequence's first rotary position, int64 (batch,): rotary_seqlens, else cache_seqlens."""
    if call.rotary_seqlens:
        return t.rotary_seqlens.long()  # type: ignore[union-attr]
    return cached(t, call)


def _rotary_span(t: Inputs, call: Call) -> torch.Tensor | int:
    """How many positions each sequence rotates from its base: ``Call.rotary_span``, with its own new keys'."""
    if not call.varlen_new:
        return call.rotary_span
    queries = call.seqlen_q if call.rotary_per_query else min(call.seqlen_q, 1)
    return new_counts(t, call).clamp(min=queries)  # type: ignore[union-attr]


def _bad_rotary(t: Inputs, call: Call) -> torch.Tensor:
    """Which sequences rotate a position outside rotary_cos/rotary_sin's 0..seqlen_ro - 1, (batch,)."""
    base = _rotary_base(t, call)
    return (base < 0) | (base + _rotary_span(t, call) > call.seqlen_ro)


def _bad_cu_seqlens(t: Inputs, call: Call) -> torch.Tensor:
    """(batch + 2,) bool: cu_seqlens_q[0] != 0, each sequence's count outside 0..max_seqlen_q, the end != total_q."""
    cu = t.cu_seqlens_q.long()  # type: ignore[union-attr]
    counts = cu[1:] - cu[:-1]
    return torch.cat(((cu[:1] != 0), (counts < 0) | (counts > call.seqlen_q), (cu[-1:] != call.total_q)))


def _bad_cu_seqlens_k_new(t: Inputs, call: Call) -> torch.Tensor:
    """(batch + 2,) bool: cu_seqlens_k_new[0] != 0, a sequence's count below 0, the end != total_new (k.shape[0])."""
    cu = t.cu_seqlens_k_new.long()  # type: ignore[union-attr]
    return torch.cat(((cu[:1] != 0), (cu[1:] - cu[:-1]) < 0, (cu[-1:] != call.seqlen_new)))


def _cu_seqlens_k_new_error(t: Inputs, call: Call) -> str:
    """The message for bad cu_seqlens_k_new values, naming the first bad entry."""
    cu = t.cu_seqlens_k_new.long()  # type: ignore[union-attr]
    bad = int(torch.nonzero(_bad_cu_seqlens_k_new(t, call))[0, 0])
    if bad == 0:
        return f"cu_seqlens_k_new[0] = {int(cu[0])}: must be 0 (the first sequence's new keys start at k's first row)"
    if bad == call.batch + 1:
        return (f"cu_seqlens_k_new[{call.batch}] = {int(cu[-1])}: must be total_new = {call.seqlen_new} (k.shape[0]: "
                "the last sequence's new keys end at k's last row)")
    return (f"cu_seqlens_k_new must be nondecreasing, got cu_seqlens_k_new[{bad - 1}] = {int(cu[bad - 1])} > "
            f"cu_seqlens_k_new[{bad}] = {int(cu[bad])}")


def _cu_seqlens_error(t: Inputs, call: Call) -> str:
    """The message for bad cu_seqlens_q values, naming the first bad entry."""
    cu = t.cu_seqlens_q.long()  # type: ignore[union-attr]
    bad = int(torch.nonzero(_bad_cu_seqlens(t, call))[0, 0])
    if bad == 0:
        return f"cu_seqlens_q[0] = {int(cu[0])}: must be 0 (the first sequence starts at q's first row)"
    if bad == call.batch + 1:
        return (f"cu_seqlens_q[{call.batch}] = {int(cu[-1])}: must be total_q = {call.total_q} (q.shape[0]: the "
                "last sequence ends at q's last row)")
    start, end = int(cu[bad - 1]), int(cu[bad])
    if end < start:
        return (f"cu_seqlens_q must be nondecreasing, got cu_seqlens_q[{bad - 1}] = {start} > cu_seqlens_q[{bad}] = "
                f"{end}")
    return (f"sequence {bad - 1} has {end - start} queries (cu_seqlens_q[{bad}] - cu_seqlens_q[{bad - 1}]) but "
            f"max_seqlen_q is {call.seqlen_q}: it must be at least the longest sequence's")


def _used_pages(t: Inputs, call: Call) -> torch.Tensor:
    """(batch, max_blocks) bool: the pages holding some key of [left pad, length) (the only ones read or written)."""
    pages = torch.arange(t.block_table.shape[1], device=t.q.device)[None, :]  # type: ignore[union-attr]
    used = pages * call.page_size < lengths(t, call)[:, None]
    if t.cache_leftpad is not None:
        used &= (pages + 1) * call.page_size > t.cache_leftpad.long()[:, None]
    return used


def _value_error(name: str, t: Inputs, call: Call, names: Names) -> str:
    """The message for a bad index tensor (``name``: its ``Inputs`` field), naming its first bad value.

    The tensors are named by ``names``; the error path may synchronise again.
    """
    if name == "cache_seqlens":
        lens, new = t.cache_seqlens.long(), lengths(t, call) - cached(t, call)  # type: ignore[union-attr]
        bad = int(torch.nonzero((lens < 0) | (lens + new > call.capacity))[0, 0])
        n = int(new[bad])
        return (f"{names.cache_seqlens}[{bad}] = {int(lens[bad])}: must be in 0..{call.capacity - n} "
                f"({holds(call.capacity, call.page_size)}, {n} of them new)")
    if name == "cu_seqlens_k_new":
        return _cu_seqlens_k_new_error(t, call)
    if name == "cache_batch_idx":
        bad = int(torch.nonzero(_bad_rows(t, call))[0, 0])
        of = f"{names.k_cache}'s batch" if t.block_table is None else "block_table's rows"
        return (f"cache_batch_idx[{bad}] = {int(t.cache_batch_idx[bad])}: must be in "  # type: ignore[index]
                f"0..{_row_count(t, call) - 1} ({of})")
    if name == "cache_leftpad":
        pads = t.cache_leftpad.long()  # type: ignore[union-attr]
        bad = int(torch.nonzero(_bad_leftpad(t, call))[0, 0])
        cached_b = int(cached(t, call)[bad])
        return (f"cache_leftpad[{bad}] = {int(pads[bad])}: must be in 0..{cached_b} (sequence {bad}'s keys start "
                f"there, and it holds {cached_b} cached keys before the new ones)")
    if name == "cu_seqlens_q":
        return _cu_seqlens_error(t, call)
    if name in ("rotary_seqlens", "rotary_cos"):
        bad = int(torch.nonzero(_bad_rotary(t, call))[0, 0])
        spans = _rotary_span(t, call)
        base, span = int(_rotary_base(t, call)[bad]), int(spans if isinstance(spans, int) else spans[bad])
        if name == "rotary_seqlens":
            return (f"rotary_seqlens[{bad}] = {base}: must be in 0..{call.seqlen_ro - span} (rotary_cos holds "
                    f"{call.seqlen_ro} positions, and sequence {bad} rotates {span} from its base)")
        return (f"rotary_cos has {call.seqlen_ro} positions (seqlen_ro) but sequence {bad} rotates positions "
                f"{base}..{base + span - 1} ({names.cache_seqlens}[{bad}] = {base}): seqlen_ro must be at least "
                f"{base + span}")
    table = _tables(t).long()
    b, j = (int(x) for x in torch.nonzero(((table < 0) | (table >= call.cache_rows)) & _used_pages(t, call))[0])
    length = int(lengths(t, call)[b])
    keys = (f"its first {length} keys" if t.cache_leftpad is None
            else f"its keys {int(t.cache_leftpad[b])}..{length - 1}")
    row = b if t.cache_batch_idx is None else int(t.cache_batch_idx[b])
    whose = "" if t.cache_batch_idx is None else f" (its row, cache_batch_idx[{b}])"
    return (f"block_table[{row}, {j}] = {int(table[b, j])} points past the cache: blocks are "
            f"0..{call.cache_rows - 1} ({names.k_cache}.shape[0]), and sequence {b}{whose} uses {keys}")
