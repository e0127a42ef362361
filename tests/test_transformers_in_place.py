"""The transformers integration's in-place varlen route: one call on views of the padded tensors, no gather.

A mask whose packed queries and keys are one run of rows per sequence runs as one ``flash_attn_varlen_func``
call that reads the layer's q, k and v where they are and writes the output in its padded layout
(``transformers_varlen.Runs``). Its result must be the gather route's bit for bit (same rows, keys, tiles and
alignment per sequence), SDPA's on every packed row, zeros elsewhere. CPU, through Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("triton")
from conftest import gpu, syncs_raise  # noqa: E402
from transformers import masking_utils  # noqa: E402

import lazytriton  # noqa: E402
from lazytriton.integrations import transformers as lt_transformers  # noqa: E402
from lazytriton.integrations import transformers_varlen  # noqa: E402

D = 16
LENGTHS = (7, 3, 5)  # real tokens a sequence; 7 rows each


def _padding(style: str, total: int) -> torch.Tensor:
    rows = []
    for n in LENGTHS:
        n = min(n, total)
        if style == "left":
            rows.append([False] * (total - n) + [True] * n)
        elif style == "right":
            rows.append([True] * n + [False] * (total - n))
        else:  # both sides
            start = (total - n) // 2
            rows.append([False] * start + [True] * n + [False] * (total - n - start))
    return torch.tensor(rows)


def _case(style: str, causal: bool = True, q_len: int = 7, past: int = 0, empty: int = 0,
          window: int | None = None, heads: tuple[int, int] = (4, 2),
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, mask) as a Llama layer gets them: q a transposed view, k and v a cache's (empty slots at the end)."""
    gen = torch.Generator().manual_seed(seed)
    batch, (hq, hk) = len(LENGTHS), heads
    total = past + q_len
    if causal:
        function = (masking_utils.causal_mask_function if window is None
                    else masking_utils.sliding_window_causal_mask_function(window))
    else:
        function = masking_utils.bidirectional_mask_function
    mask = lt_transformers.mask(batch_size=batch, q_length=q_len, kv_length=total + empty, q_offset=past,
                                mask_function=function, attention_mask=_padding(style, total),
                                allow_is_causal_skip=False)
    q = torch.randn(batch, q_len, hq, D, generator=gen).transpose(1, 2)
    k, v = (torch.randn(batch, hk, total + empty, D, generator=gen) for _ in range(2))
    return q, k, v, mask


def _gather_route(found: transformers_varlen.Packed) -> transformers_varlen.Packed:
    return dataclasses.replace(found, runs=None, made={})


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float = 0.0) -> torch.Tensor:
    """float64 attention under the boolean mask, (batch, q_len, heads, d); a row that sees no key gives zeros."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return (scores.softmax(-1).nan_to_num(0.0) @ v).transpose(1, 2)


CASES = {
    "left, causal": {"style": "left"},
    "right, causal": {"style": "right"},
    "both sides, causal": {"style": "both"},
    "left, bidirectional": {"style": "left", "causal": False},
    "right, bidirectional": {"style": "right", "causal": False},
    "left, static cache's empty slots": {"style": "left", "empty": 3},
    "left, two new tokens against a cache": {"style": "left", "q_len": 2, "past": 5},
    "left, a window that cuts in": {"style": "left", "window": 3},
    "left, multi-query": {"style": "left", "heads": (4, 1)},
    "left, one head each": {"style": "left", "heads": (1, 1)},
}


# The integration's varlen calls: the public function, and its call checked once a forward (an eager call).
VARLEN_CALLS = ((lazytriton, "flash_attn_varlen_func"), (transformers_varlen, "checked_varlen_call"))


def _spy(real: Any, seen: list[tuple[torch.Tensor, ...]]) -> Any:
    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        seen.append((*args[:3], out))
        return out

    return spy


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    """(q, k, v, out) of each varlen call the integration makes, as they are made."""
    seen: list[tuple[torch.Tensor, ...]] = []
    for module, name in VARLEN_CALLS:
        monkeypatch.setattr(module, name, _spy(getattr(module, name), seen))
    return seen


def _rows(seen: list[tuple[torch.Tensor, ...]]) -> list[int]:
    """The query rows each recorded call packed."""
    return [call[0].shape[0] for call in seen]


@pytest.mark.parametrize("case", list(CASES))
def test_in_place_is_the_gather_route_bit_for_bit(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, mask = _case(**CASES[case])
    batch, _, q_len = q.shape[:3]
    found = transformers_varlen.layout(mask, batch, q_len, k.shape[2], CASES[case].get("causal", True))
    assert isinstance(found, transformers_varlen.Packed) and found.runs is not None
    seen = _recorded(monkeypatch)
    got = transformers_varlen.run_packed(found, q, k, v, 0.3, {})
    assert len(seen) == 1  # one call, on views of the layer's own tensors: nothing gathered, nothing scattered
    qp, kp, vp, out = seen[0]
    assert qp.data_ptr() == q.data_ptr() and kp.data_ptr() == k.data_ptr() and vp.data_ptr() == v.data_ptr()
    assert got.data_ptr() == out.data_ptr() and got.is_contiguous()
    want = transformers_varlen.run_packed(_gather_route(found), q, k, v, 0.3, {})
    assert len(seen) == 2 and seen[1][0].shape[0] == found.total_q  # the gather route's packed queries
    assert torch.equal(got, want)
    packed = found.q_sel[:, :, None, None]
    reference = _reference(q, k, v, mask, 0.3).float()
    torch.testing.assert_close(got, torch.where(packed, reference, 0.0), atol=1e-5, rtol=1e-5)


def test_softcap_and_sinks_take_the_in_place_route(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recorded(monkeypatch)
    q, k, v, mask = _case("both")
    found = transformers_varlen.layout(mask, 3, 7, 7, True)
    features = {"softcap": 5.0, "sinks": torch.randn(4, generator=torch.Generator().manual_seed(1))}
    got = transformers_varlen.run_packed(found, q, k, v, 0.3, features)
    assert torch.equal(got, transformers_varlen.run_packed(_gather_route(found), q, k, v, 0.3, features))
    assert _rows(seen) == [21, found.total_q]


def test_where_it_does_not_apply_the_gather_route_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient wanted, a batch stride that is not a whole number of rows, k and v of other layouts: gathers."""
    seen = _recorded(monkeypatch)
    q, k, v, mask = _case("left")
    found = transformers_varlen.layout(mask, 3, 7, 7, True)
    batch, hk, length, _ = k.shape
    odd = torch.randn(batch * (hk * length * D + 8)).as_strided(k.shape, (hk * length * D + 8, length * D, D, 1))
    odd.copy_(k)
    by_rows = v.transpose(1, 2).contiguous().transpose(1, 2)  # (batch, kv_len, heads_k, d) memory: other rows
    want = transformers_varlen.run_packed(_gather_route(found), q, k, v, 0.3, {})
    for keys, values in ((odd, v), (k, by_rows)):
        assert torch.equal(transformers_varlen.run_packed(found, q, keys, values, 0.3, {}), want)
    q.requires_grad_()
    got = transformers_varlen.run_packed(found, q, k, v, 0.3, {})
    assert torch.equal(got.detach(), want) and got.requires_grad
    assert _rows(seen) == [found.total_q] * 4
    with torch.no_grad():
        assert torch.equal(transformers_varlen.run_packed(found, q, k, v, 0.3, {}), want)
    assert _rows(seen)[-1] == 3 * 7  # in place: every row of the padded batch


def test_a_q_in_another_layout_is_copied_once() -> None:
    """q contiguous as (batch, heads, q_len, d): one copy into the output's layout, the same result."""
    q, k, v, mask = _case("right", seed=2)
    found = transformers_varlen.layout(mask, 3, 7, 7, True)
    want = transformers_varlen.run_packed(found, q, k, v, 0.3, {})
    assert torch.equal(transformers_varlen.run_packed(found, q.contiguous(), k, v, 0.3, {}), want)


def test_runs_and_their_cu_seqlens() -> None:
    """Left padding 0, 4 and 2: each sequence one run; cu_seqlens per layout, made once and kept."""
    q, k, v, mask = _case("left")
    found = transformers_varlen.layout(mask, 3, 7, 7, True)
    runs = found.runs
    assert runs is not None
    assert runs.q_first.tolist() == runs.k_first.tolist() == [0, 4, 2]
    assert runs.seqused_q.tolist() == runs.seqused_k.tolist() == [0, 7, 3, 5]
    assert runs.seqused_q.dtype == torch.int32 and (runs.q_spread, runs.k_spread) == (4, 4)
    cu = runs.cu_seqlens("k", 14, 35)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 0, 18, 30, 35]
    assert runs.cu_seqlens("k", 14, 35) is cu
    holes = mask.clone()
    holes[1, 0, :, 5] = False  # a key some queries skip: not one run, the gather route
    assert transformers_varlen.layout(holes, 3, 7, 7, True) is None or (
        transformers_varlen.layout(holes, 3, 7, 7, True).runs is None)


def test_a_left_padded_prefill_is_one_in_place_call_per_layer_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-padded prefill of a tiny Llama through the in-place route gives SDPA's logits on real tokens."""
    transformers = pytest.importorskip("transformers")
    lt_transformers.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=100, pad_token_id=0)
    llama = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 100, (3, 7), generator=torch.Generator().manual_seed(4))
    pad = _padding("left", 7).long()
    seen = _recorded(monkeypatch)
    checks: list[object] = []
    check = transformers_varlen.varlen.check
    monkeypatch.setattr(transformers_varlen.varlen, "check", lambda *a, **k: checks.append(a) or check(*a, **k))
    seeded: list[object] = []
    seed = transformers_varlen.remember_prefill
    monkeypatch.setattr(transformers_varlen, "remember_prefill", lambda *a: seeded.append(a) or seed(*a))
    logits = {}
    for impl in ("sdpa", "lazytriton"):
        llama.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = llama(input_ids=ids, attention_mask=pad).logits
    torch.testing.assert_close(logits["lazytriton"], logits["sdpa"], atol=1e-5, rtol=1e-5)
    assert _rows(seen) == [21, 21]
    assert len(checks) == 1  # checked on the first layer; the second launches the checked call
    assert len(seeded) == 1  # the layout read off the padding mask by the mask function


@pytest.mark.parametrize("style", ["left", "right", "both", "holes"])
def test_a_causal_prefill_s_layout_is_read_off_its_padding(style: str) -> None:
    """The mask function gives a prefill's layout from the 2D padding mask: the analysis' own, field for field."""
    padding = _padding("left" if style == "holes" else style, 7)
    if style == "holes":
        padding[0, 3] = False
    mask = lt_transformers.mask(batch_size=3, q_length=7, kv_length=7, q_offset=0, kv_offset=0,
                                mask_function=masking_utils.causal_mask_function, attention_mask=padding,
                                allow_is_causal_skip=False)
    seeded = transformers_varlen.layout(mask, 3, 7, 7, True)
    clone = mask.clone()  # a new mask object: analysed, with the same real queries
    transformers_varlen.remember_queries(clone, padding)
    analysed = transformers_varlen.layout(clone, 3, 7, 7, True)
    assert isinstance(seeded, transformers_varlen.Packed) and isinstance(analysed, transformers_varlen.Packed)
    if style == "holes":  # one run no more: nothing seeded, the analysis' gather layout
        assert seeded.runs is None
        return
    assert seeded is not analysed and seeded.runs is not None and analysed.runs is not None
    for name in ("total_q", "total_k", "max_seqlen_q", "max_seqlen_k", "causal", "window"):
        assert getattr(seeded, name) == getattr(analysed, name), name
    for name in ("q_sel", "k_sel"):
        assert torch.equal(getattr(seeded, name), getattr(analysed, name)), name
    for name in ("q_first", "k_first", "seqused_q", "seqused_k"):
        assert torch.equal(getattr(seeded.runs, name), getattr(analysed.runs, name)), name
    assert (seeded.runs.q_spread, seeded.runs.k_spread) == (analysed.runs.q_spread, analysed.runs.k_spread)


@gpu
@pytest.mark.gpu
def test_gpu_in_place_is_the_gather_route_bit_for_bit_and_never_synchronises() -> None:
    """bench_transformers' layer on the GPU: 8 left-padded prompts of 64-512 tokens, 16/4 heads, hd128, bf16."""
    gen = torch.Generator().manual_seed(5)
    lengths = [512, *torch.randint(64, 513, (7,), generator=gen).tolist()]
    padding = torch.tensor([[False] * (512 - n) + [True] * n for n in lengths], device="cuda")
    mask = lt_transformers.mask(batch_size=8, q_length=512, kv_length=512, q_offset=0, kv_offset=0,
                                mask_function=masking_utils.causal_mask_function, attention_mask=padding,
                                allow_is_causal_skip=False)
    q = torch.randn(8, 512, 16, 128, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(8, 4, 512, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    found = transformers_varlen.layout(mask, 8, 512, 512, True)
    assert isinstance(found, transformers_varlen.Packed) and found.runs is not None
    with torch.no_grad():
        want = transformers_varlen.run_packed(_gather_route(found), q, k, v, 0.088, {})
        transformers_varlen.run_packed(found, q, k, v, 0.088, {})  # loads the kernel, checks the call
        with syncs_raise():
            got = transformers_varlen.run_packed(found, q, k, v, 0.088, {})
    assert torch.equal(got, want)
    reference = _reference(q.float(), k.float(), v.float(), mask, 0.088).float()
    rows = found.q_sel[:, :, None, None].to(got.device)
    torch.testing.assert_close(got.float(), torch.where(rows, reference, 0.0), atol=2e-2, rtol=2e-2)
