"""The varlen layout of the transformers integration: what one call runs is exactly the mask, or no layout at all.

No kernel runs here: the layout (packed queries and keys, cu_seqlens, causal, window) is turned back into the
mask it applies by FlashAttention-2's rule and compared with the mask transformers' own mask functions build,
on every packed query's row. Masks come through the integration's mask function, as in a model, so the real
query rows are known.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import masking_utils  # noqa: E402

from lazytriton.integrations import transformers as lt_transformers  # noqa: E402
from lazytriton.integrations import transformers_varlen  # noqa: E402


def _visible(r: int, c: int, n_q: int, n_k: int, causal: bool, window: tuple[int, int]) -> bool:
    """FlashAttention-2's rule: query r of n_q sees key c of n_k (bottom-right aligned)."""
    left, right = window
    right = 0 if causal else right
    off = n_k - n_q
    return (left < 0 or c >= r + off - left) and (right < 0 or c <= r + off + right)


def _applied(found: transformers_varlen.Dense | transformers_varlen.Packed, batch: int, q_len: int,
             kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mask the call applies (batch, q_len, kv_len), the packed query rows (batch, q_len))."""
    mask = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    packed = torch.zeros(batch, q_len, dtype=torch.bool)
    if isinstance(found, transformers_varlen.Dense):
        queries, keys = [list(range(q_len))] * batch, [list(range(found.key_start, found.key_stop))] * batch
    else:
        assert found.cu_seqlens_q.dtype == found.cu_seqlens_k.dtype == torch.int32
        cu_q, cu_k = found.cu_seqlens_q.tolist(), found.cu_seqlens_k.tolist()
        assert len(cu_q) == len(cu_k) == batch + 1 and cu_q[0] == cu_k[0] == 0
        assert found.max_seqlen_q >= max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False))
        assert found.max_seqlen_k >= max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False))
        for (rows, _), cu in ((found.q_index, cu_q), (found.k_index, cu_k)):  # each sequence's own tokens
            assert rows.tolist() == [b for b in range(batch) for _ in range(cu[b], cu[b + 1])]
        queries = [found.q_index[1][cu_q[b]:cu_q[b + 1]].tolist() for b in range(batch)]
        keys = [found.k_index[1][cu_k[b]:cu_k[b + 1]].tolist() for b in range(batch)]
        assert all(sorted(set(t)) == t for t in queries + keys)  # in order, once each
        _assert_runs(found.runs, queries, keys)
    for b in range(batch):
        for r, i in enumerate(queries[b]):
            packed[b, i] = True
            for c, j in enumerate(keys[b]):
                mask[b, i, j] = _visible(r, c, len(queries[b]), len(keys[b]), found.causal, found.window)
    return mask, packed


def _assert_runs(runs: transformers_varlen.Runs | None, queries: list[list[int]], keys: list[list[int]]) -> None:
    """The in-place route's runs are each sequence's packed rows exactly; none only where some are not one run."""
    one_run = [t == list(range(t[0], t[0] + len(t))) if t else True for t in queries + keys]
    if runs is None:
        assert not all(one_run)
        return
    assert all(one_run)
    for first, used, spread, rows in ((runs.q_first, runs.seqused_q, runs.q_spread, queries),
                                      (runs.k_first, runs.seqused_k, runs.k_spread, keys)):
        assert used.dtype == torch.int32 and used.tolist() == [0, *(len(t) for t in rows)]
        assert all(not t or t[0] == f for t, f in zip(rows, first.tolist(), strict=True))
        assert spread == max(first.tolist()) - min(first.tolist())


def _assert_exact(mask: torch.Tensor, causal: bool, real: torch.Tensor | None = None) -> bool:
    """The layout of ``mask`` is exact on its packed rows and leaves out only rows that are zeros; True if any."""
    batch, _, q_len, kv_len = mask.shape
    found = transformers_varlen.layout(mask, batch, q_len, kv_len, causal)
    if found is None:
        return False
    applied, packed = _applied(found, batch, q_len, kv_len)
    m = mask[:, 0]
    assert torch.equal(applied[packed], m[packed])
    left_out = ~packed & m.any(dim=-1)  # rows the mask gives keys but the call gives zeros: pad queries only
    assert not left_out.any() or (causal and real is not None and not (left_out & real).any())
    return True


@st.composite
def _model_masks(draw: st.DrawFn) -> tuple[torch.Tensor, bool, torch.Tensor, bool]:
    """(mask built by the integration's mask function, causal, real query rows, expected to have a layout)."""
    batch, q_len, past = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(0, 6))
    total = past + q_len
    kv_offset = draw(st.integers(0, past))  # a sliding cache keeps the last keys only
    empty = draw(st.integers(0, 3)) if kv_offset == 0 else 0  # a static cache's empty slots
    window = draw(st.sampled_from([None, 1, 2, 3, 5]))
    causal = draw(st.booleans())
    if causal:
        function = (masking_utils.causal_mask_function if window is None
                    else masking_utils.sliding_window_causal_mask_function(window))
    else:
        function = (masking_utils.bidirectional_mask_function if window is None
                    else masking_utils.sliding_window_bidirectional_mask_function(window))
    style = draw(st.sampled_from(["left", "right", "any"]))
    rows = []
    for _ in range(batch):
        n = draw(st.integers(0, total))
        if style == "any":
            rows.append([draw(st.booleans()) for _ in range(total)])
        else:
            rows.append([True] * n + [False] * (total - n) if style == "right" else [False] * (total - n) + [True] * n)
    padding = torch.tensor(rows, dtype=torch.bool)
    # A 2D mask reaching past the tokens (a static cache's full length): the queries are not its last columns.
    padding_2d = torch.cat((padding, torch.tensor(draw(st.sampled_from([[], [False], [True, False]]))).bool()
                            .expand(batch, -1)), dim=1)
    mask = lt_transformers.mask(batch_size=batch, q_length=q_len, kv_length=total - kv_offset + empty,
                                q_offset=past, kv_offset=kv_offset, mask_function=function, attention_mask=padding_2d,
                                allow_is_causal_skip=False)
    # One call is always possible without a window, and with one when the real keys have no pads between them.
    contiguous = style == "left" or (style == "right" and past == 0)
    expected = window is None or (causal and contiguous)
    if draw(st.integers(0, 3)) == 0:  # the layer's causality against the mask's: exact or no layout
        return mask, not causal, padding[:, -q_len:], False
    return mask, causal, padding[:, -q_len:], expected


@settings(max_examples=400, deadline=None)
@given(_model_masks())
def test_layout_of_padded_masks_is_exact(case: tuple[torch.Tensor, bool, torch.Tensor, bool]) -> None:
    """Padding anywhere, causal or bidirectional, windows, caches (sliding, static): exact, one call where expected."""
    mask, causal, real, expected = case
    ran = _assert_exact(mask, causal, real)
    assert ran or not expected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.booleans(), st.data())
def test_layout_of_arbitrary_masks_is_exact_or_none(batch: int, q_len: int, kv_len: int, causal: bool,
                                                    data: st.DataObject) -> None:
    """Random masks (not built by the mask function: no real query rows known): exact on every row, or None."""
    bits = data.draw(st.lists(st.booleans(), min_size=batch * q_len * kv_len, max_size=batch * q_len * kv_len))
    _assert_exact(torch.tensor(bits, dtype=torch.bool).reshape(batch, 1, q_len, kv_len), causal)


def test_layout_cases() -> None:
    """Hand-made: a chunked mask and packed documents have no layout; an unpadded window is dense; a float mask none."""
    chunks = masking_utils.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))
    chunked = masking_utils.sdpa_mask(batch_size=1, q_length=6, kv_length=6, allow_is_causal_skip=False,
                                      mask_function=chunks)
    assert not _assert_exact(chunked, True)
    documents = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool().tril()[None, None]
    assert not _assert_exact(documents, True)
    window = masking_utils.sdpa_mask(batch_size=2, q_length=6, kv_length=6, allow_is_causal_skip=False,
                                     mask_function=masking_utils.sliding_window_causal_mask_function(3))
    found = transformers_varlen.layout(window, 2, 6, 6, True)
    assert found == transformers_varlen.Dense(0, 6, True, (2, 0))
    assert transformers_varlen.layout(torch.zeros(1, 1, 6, 6), 1, 6, 6, True) is None
    # A causal mask on a bidirectional layer: right = 0 is a window there, not the absence of one.
    triangle = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    triangle[1, 0, :, 0] = False
    assert _assert_exact(triangle, False)
    assert transformers_varlen.layout(triangle, 2, 5, 5, False).window == (-1, 0)


def test_layout_is_cached_per_mask_and_version() -> None:
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    first = transformers_varlen.layout(mask, 2, 4, 4, True)
    assert transformers_varlen.layout(mask, 2, 4, 4, True) is first
    mask[0, 0, :, 0] = False  # key 0 of sequence 0 becomes a pad
    again = transformers_varlen.layout(mask, 2, 4, 4, True)
    assert isinstance(again, transformers_varlen.Packed) and again.cu_seqlens_k.tolist() == [0, 3, 7]
