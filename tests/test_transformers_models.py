"""transformers integration on sliding windows and softcapping: Gemma 2 and 3, Mistral, Qwen2 under transformers.

A tiny random Gemma 2 (sliding and full layers, attention logit softcapping) gives the logits and greedy tokens of
the "eager" implementation (SDPA refuses softcap); a tiny Mistral and a hybrid Qwen2 whose window is shorter than the
prompt, and a tiny Gemma 3, give those of "sdpa". Below them, the attention function on masks transformers' own mask
functions build (sliding windows with padding and caches, chunks), against SDPA on the same boolean mask, and a
property test of the mask analysis. CPU, float32, through Triton's interpreter: shapes are tiny on purpose.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import masking_utils  # noqa: E402

import lazytriton  # noqa: E402
from lazytriton.integrations import transformers as lt_transformers  # noqa: E402
from lazytriton.integrations import transformers_plan, transformers_varlen  # noqa: E402

PAD = 0
WINDOW = 3  # keys a query sees, its own included: shorter than the 6-token prompts
CAP = 0.5  # Gemma 2's attention softcap, small enough to bend these random scores (see the test below)
IDS = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
MASKS = {
    "unpadded": None,
    "left_padded": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
    "right_padded": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
}
Call = tuple[tuple[int, ...], tuple[int, ...], object, object, object, str]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Records each lazytriton call (q shape, k shape, causal, window_size, softcap, entry point): lazytriton ran.

    The entry points: "dense" (attn_fwd), "varlen" (flash_attn_varlen_func, or the integration's call of it checked
    once a forward, ``transformers_varlen.checked_varlen_call``), "sdpa" (the SDPA drop-in).
    """
    seen: list[Call] = []

    def spy(kind: str, name: str, module: object = lazytriton) -> None:
        real = getattr(module, name)

        def recorded(q: torch.Tensor, k: torch.Tensor, *args: object, **kw: object) -> object:
            seen.append((tuple(q.shape), tuple(k.shape), kw.get("causal"), kw.get("window_size"), kw.get("softcap"),
                         kind))
            return real(q, k, *args, **kw)

        monkeypatch.setattr(module, name, recorded)

    for kind, name in (("dense", "attn_fwd"), ("varlen", "flash_attn_varlen_func"),
                       ("sdpa", "scaled_dot_product_attention")):
        spy(kind, name)
    spy("varlen", "checked_varlen_call", transformers_varlen)
    return seen


def _build(config: object, cls: type) -> torch.nn.Module:
    lt_transformers.register()
    torch.manual_seed(0)
    return cls(config).eval()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def gemma2() -> torch.nn.Module:
    config = transformers.Gemma2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        num_hidden_layers=2, vocab_size=100, pad_token_id=PAD, sliding_window=WINDOW, query_pre_attn_scalar=8,
        attn_logit_softcapping=CAP, initializer_range=0.2)  # larger weights than 0.02: scores the cap bends
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return _build(config, transformers.Gemma2ForCausalLM)


@pytest.fixture(scope="module")
def mistral() -> torch.nn.Module:
    config = transformers.MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=64, num_hidden_layers=1, vocab_size=100, pad_token_id=PAD,
                                        sliding_window=WINDOW)
    return _build(config, transformers.MistralForCausalLM)


def _logits(model: torch.nn.Module, impl: str, **inputs: object) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits  # type: ignore[no-any-return]


def _inputs(padding: str) -> dict[str, torch.Tensor]:
    mask = MASKS[padding]
    return {"input_ids": IDS} if mask is None else {"input_ids": IDS, "attention_mask": mask}


def _real(logits: torch.Tensor, padding: str) -> torch.Tensor:
    """The logits of real tokens: eager gives a query that sees no key the mean of all values, SDPA and lazytriton 0;
    a right-padded sequence's pad queries see the real keys in SDPA and eager, give zeros in lazytriton."""
    mask = MASKS[padding]
    return logits if mask is None else logits[mask.bool()]


def _generate(model: torch.nn.Module, impl: str, padding: str, **kw: object) -> object:
    model.set_attn_implementation(impl)
    return model.generate(**_inputs(padding), max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                          output_scores=True, return_dict_in_generate=True, **kw)


def _assert_same_generation(got: object, want: object, rows: list[int] | None = None) -> None:
    """The same tokens and scores in ``rows`` (default all). A right-padded prompt's first new token comes from a
    pad position (zeros in lazytriton, as in flash_attention_2): compare the unpadded row there."""
    rows = rows or list(range(got.sequences.shape[0]))  # type: ignore[attr-defined]
    assert torch.equal(got.sequences[rows], want.sequences[rows])  # type: ignore[attr-defined]
    for g, w in zip(got.scores, want.scores, strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(g[rows], w[rows], atol=1e-5, rtol=1e-5)


def test_gemma2_config_exercises_window_and_softcap(gemma2: torch.nn.Module) -> None:
    """The reference itself (eager) changes when the window is widened or the cap removed: the tests below can fail."""
    want = _logits(gemma2, "eager", input_ids=IDS)
    attn = [layer.self_attn for layer in gemma2.model.layers]
    try:
        for a in attn:
            a.attn_logit_softcapping = None
        assert (_logits(gemma2, "eager", input_ids=IDS) - want).abs().max() > 0.1
    finally:
        for a in attn:
            a.attn_logit_softcapping = CAP
    gemma2.config.sliding_window = 100
    try:
        assert (_logits(gemma2, "eager", input_ids=IDS) - want).abs().max() > 0.1
    finally:
        gemma2.config.sliding_window = WINDOW


@pytest.mark.parametrize("padding", ["unpadded", "left_padded"])
def test_gemma2_logits_match_eager(gemma2: torch.nn.Module, calls: list[Call], padding: str) -> None:
    want = _logits(gemma2, "eager", **_inputs(padding))
    got = _logits(gemma2, "lazytriton", **_inputs(padding))
    torch.testing.assert_close(_real(got, padding), _real(want, padding), atol=1e-5, rtol=1e-5)
    assert {c[4] for c in calls} == {CAP}  # every call capped
    # One call per layer: the full layer (no mask unpadded), then the sliding one, window (WINDOW - 1) keys back,
    # causal: dense on the batch unpadded, varlen on the 10 real tokens padded.
    causal = "bottom_right" if padding == "unpadded" else True
    assert [c[5] for c in calls] == ["dense" if padding == "unpadded" else "varlen"] * 2, calls
    assert [c[2:4] for c in calls if c[3] not in (None, (-1, -1))] == [(causal, (WINDOW - 1, 0))], calls


def test_gemma2_generate_left_padded_matches_eager(gemma2: torch.nn.Module, calls: list[Call]) -> None:
    _assert_same_generation(_generate(gemma2, "lazytriton", "left_padded"),
                            _generate(gemma2, "eager", "left_padded"))
    # A decoding step (a query a sequence) runs the capped, masked drop-in body, never the varlen analysis.
    assert not any(c[5] == "varlen" and c[0][0] == 2 for c in calls), calls


def test_gemma2_packed_documents_keep_the_per_sequence_plan(gemma2: torch.nn.Module, calls: list[Call]) -> None:
    """Softcap on a mask that is not padding (two documents packed in a row): the SDPA drop-in has no softcap, so
    the per-sequence plan runs it, one capped call per document and layer, as eager computes it."""
    inputs = {"input_ids": IDS[:1], "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]), "use_cache": False}
    want = _logits(gemma2, "eager", **inputs)
    torch.testing.assert_close(_logits(gemma2, "lazytriton", **inputs), want, atol=1e-5, rtol=1e-5)
    assert [(c[5], c[0], c[4]) for c in calls] == [("dense", (1, 4, 3, 8), CAP)] * 4, calls
    torch.testing.assert_close(want[:, 3:], _logits(gemma2, "eager", input_ids=IDS[:1, 3:], use_cache=False),
                               atol=1e-5, rtol=1e-5)  # the mask did separate the documents


def test_gemma3_left_padded_logits_match_sdpa(calls: list[Call]) -> None:
    """Gemma 3: sliding and full layers, no softcap, so SDPA is the reference (pad rows included)."""
    config = transformers.Gemma3TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        num_hidden_layers=2, vocab_size=100, pad_token_id=PAD, sliding_window=WINDOW, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"])
    gemma3 = _build(config, transformers.Gemma3ForCausalLM)
    want = _logits(gemma3, "sdpa", **_inputs("left_padded"))
    torch.testing.assert_close(_logits(gemma3, "lazytriton", **_inputs("left_padded")), want, atol=1e-5, rtol=1e-5)
    assert any(c[3] == (WINDOW - 1, 0) for c in calls), calls


@pytest.mark.parametrize("padding", list(MASKS))
def test_mistral_logits_match_sdpa(mistral: torch.nn.Module, calls: list[Call], padding: str) -> None:
    want = _logits(mistral, "sdpa", **_inputs(padding))
    got = _logits(mistral, "lazytriton", **_inputs(padding))
    torch.testing.assert_close(_real(got, padding), _real(want, padding), atol=1e-5, rtol=1e-5)
    if padding != "right_padded":  # pad rows too: zeros in both
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # One call: dense on the batch unpadded, varlen on the 10 real tokens padded; the window cuts in.
    expected = [("dense", "bottom_right", (2, 0))] if padding == "unpadded" else [("varlen", True, (2, 0))]
    assert [(c[5], *c[2:4]) for c in calls] == expected


@pytest.mark.filterwarnings("ignore:.*right-padding was detected")
@pytest.mark.parametrize("padding, cache", [("left_padded", "dynamic"), ("right_padded", "dynamic"),
                                            ("left_padded", "static"), ("left_padded", "full")])
def test_mistral_generate_matches_sdpa(mistral: torch.nn.Module, padding: str, cache: str) -> None:
    """Sliding caches (transformers keeps WINDOW - 1 past keys) and a full one (every key, more than the window)."""
    caches = []

    def kw() -> dict[str, object]:
        if cache == "full":  # no config: plain DynamicLayers that keep every key
            caches.append(transformers.DynamicCache())
            return {"cache": caches[-1]}
        return {"cache_implementation": cache}

    got = _generate(mistral, "lazytriton", padding, **kw())
    rows = [1] if padding == "right_padded" else None
    _assert_same_generation(got, _generate(mistral, "sdpa", padding, **kw()), rows)
    if cache == "full":
        assert caches[0].layers[0].keys.shape[2] > WINDOW + 1, "decoding steps saw more keys than the window"


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_qwen2_hybrid_chunked_prefill_matches_sdpa(calls: list[Call]) -> None:
    """Qwen2 with a full layer and a sliding one (two masks per forward), prefilled in two chunks of 3, left padded."""
    config = transformers.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=100, pad_token_id=PAD,
                                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    qwen2 = _build(config, transformers.Qwen2ForCausalLM)
    mask = MASKS["left_padded"]

    def logits(impl: str) -> torch.Tensor:
        qwen2.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=qwen2.config)
        with torch.no_grad():
            qwen2(input_ids=IDS[:, :3], attention_mask=mask[:, :3], past_key_values=cache, use_cache=True)
            return qwen2(input_ids=IDS[:, 3:], attention_mask=mask, past_key_values=cache, use_cache=True).logits

    torch.testing.assert_close(logits("lazytriton"), logits("sdpa"), atol=1e-5, rtol=1e-5)
    assert any(c[3] == (WINDOW - 1, 0) for c in calls), calls


# The attention function alone, on masks built by transformers' mask functions, against SDPA on the same mask.

class _Module(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


def _qkv(b: int, hq: int, hk: int, sq: int, sk: int, d: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sq * 100 + sk)
    return tuple(torch.randn(b, h, s, d, generator=g) for h, s in ((hq, sq), (hk, sk), (hk, sk)))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False,
          softcap: float | None = None) -> torch.Tensor:
    """SDPA, or with ``softcap`` the eager math (float64) of Gemma 2; rows that see no key give zeros."""
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                               enable_gqa=True, scale=0.3)
        return out.transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = softcap * torch.tanh(q64 @ k64.transpose(-1, -2) * 0.3 / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.nan_to_num(s.softmax(dim=-1))
    return (p @ v64).float().transpose(1, 2)


def _mask(function: object, padding: list[list[int]] | None, q_len: int, kv_len: int, q_offset: int = 0,
          kv_offset: int = 0) -> torch.Tensor:
    """transformers' own boolean mask (what the "lazytriton" mask function hands over), never skipped to None."""
    attention_mask = None if padding is None else torch.tensor(padding, dtype=torch.bool)
    mask = masking_utils.sdpa_mask(batch_size=2 if padding is None else len(padding), q_length=q_len,
                                   kv_length=kv_len, q_offset=q_offset, kv_offset=kv_offset, mask_function=function,
                                   attention_mask=attention_mask, allow_is_causal_skip=False)
    assert mask is not None
    return mask


SLIDING = masking_utils.sliding_window_causal_mask_function(WINDOW)
MASK_CASES = {
    # prefill, unpadded and padded on either side (a right-padded pad query sees a shrinking window)
    "unpadded": (SLIDING, None, 7, 7, 0, 0),
    "left_and_right_padded": (SLIDING, [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]], 7, 7, 0, 0),
    # a chunk of 2 queries against a cache far longer than the window; one sequence padded before, one after
    "cache_longer_than_window": (SLIDING, [[0, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 1, 1, 1]], 2, 9, 7, 0),
    # decoding after right padding: the window spans pads between the prompt and the new tokens
    "decode_across_pads": (SLIDING, [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]], 1, 7, 6, 0),
    # a sliding cache: keys from position 4 on (kv_offset), 3 queries
    "sliding_cache_offset": (SLIDING, [[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9], 3, 5, 6, 4),
    "chunked": (masking_utils.chunked_causal_mask_function(3, torch.tensor([0, 1])), [[1] * 8, [0] + [1] * 7],
                8, 8, 0, 0),
    "bidirectional_window": (masking_utils.sliding_window_bidirectional_mask_function(1),
                             [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], 6, 6, 0, 0),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_attention_forward_windowed_masks_match_sdpa(case: str, calls: list[Call]) -> None:
    function, padding, q_len, kv_len, q_offset, kv_offset = MASK_CASES[case]
    mask = _mask(function, padding, q_len, kv_len, q_offset, kv_offset)
    q, k, v = _qkv(2, 4, 2, q_len, kv_len)
    got, _ = lt_transformers.attention_forward(_Module(case != "bidirectional_window"), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)
    if case in ("unpadded", "cache_longer_than_window"):
        assert [c[3] for c in calls if c[3] not in (None, (-1, -1))], "the window reached the kernels"


def test_attention_forward_softcap_masked_and_unmasked(calls: list[Call]) -> None:
    q, k, v = _qkv(2, 4, 2, 5, 5)
    q = q * 4  # scores well past the cap
    for mask in (None, _mask(SLIDING, [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]], 5, 5)):
        got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3, softcap=1.5)
        reference_mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None] if mask is None else mask
        torch.testing.assert_close(got, _sdpa(q, k, v, reference_mask, softcap=1.5), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, _sdpa(q, k, v, reference_mask), atol=1e-2), "the cap changes the result"
    assert {c[4] for c in calls} == {1.5}


def test_attention_forward_unmasked_sliding_window_argument() -> None:
    """No mask but a model's ``sliding_window=`` cutting in: causal calls apply it (as transformers' masks draw it)."""
    q, k, v = _qkv(1, 2, 2, 6, 6)
    want = _sdpa(q, k, v, _mask(SLIDING, None, 6, 6)[:1])
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, None, scaling=0.3, sliding_window=WINDOW)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got, _ = lt_transformers.attention_forward(_Module(True), q[:, :, -1:], k, v, None, scaling=0.3,
                                               sliding_window=WINDOW)  # decoding: the last WINDOW keys
    torch.testing.assert_close(got, want[:, -1:], atol=1e-5, rtol=1e-5)
    wide, _ = lt_transformers.attention_forward(_Module(True), q, k, v, None, scaling=0.3, sliding_window=6)
    torch.testing.assert_close(wide, _sdpa(q, k, v, None, causal=True), atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        lt_transformers.attention_forward(_Module(False), q, k, v, None, sliding_window=WINDOW)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        lt_transformers.attention_forward(_Module(True), q, k, v, None, sliding_window=0)


# The mask analysis alone (no kernel): what it plans reproduces the mask exactly, or it refuses the mask.

def _planned_mask(mask: torch.Tensor) -> torch.Tensor:
    """The dense mask the plan's calls attend with (the rows the plan derives from its calls' arguments)."""
    batch, _, q_len, kv_len = mask.shape
    out = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for group in transformers_plan.analyse(mask, batch, q_len, kv_len):
        keys = (list(range(*group.key_range)) if group.key_range is not None else group.key_index.tolist())
        for i, (lo, hi) in enumerate(transformers_plan.planned_rows(group.segments)):
            out[group.first:group.last, i, keys[lo:hi]] = True
    return out[:, None]


@st.composite
def _structured_masks(draw: st.DrawFn) -> torch.Tensor:
    batch, q_len = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    kv_len = q_len + draw(st.integers(0, 6))
    window = draw(st.sampled_from([None, 1, 2, 3, 5]))
    function = {None: masking_utils.causal_mask_function}.get(window) or \
        masking_utils.sliding_window_causal_mask_function(window)
    if draw(st.booleans()):
        function = masking_utils.chunked_causal_mask_function(draw(st.integers(1, 4)), torch.zeros(batch, dtype=int))
    padding = [[draw(st.booleans()) or draw(st.booleans()) for _ in range(kv_len)] for _ in range(batch)]
    return _mask(function, padding, q_len, kv_len, kv_len - q_len)


@settings(max_examples=150, deadline=None)
@given(_structured_masks())
def test_analysis_reproduces_windowed_padded_masks(mask: torch.Tensor) -> None:
    """Any padding (holes included) under a causal, sliding or chunked mask, with a cache: planned exactly."""
    assert torch.equal(_planned_mask(mask), mask)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.data())
def test_analysis_refuses_or_reproduces_arbitrary_masks(batch: int, q_len: int, kv_len: int,
                                                        data: st.DataObject) -> None:
    bits = data.draw(st.lists(st.booleans(), min_size=batch * q_len * kv_len, max_size=batch * q_len * kv_len))
    mask = torch.tensor(bits, dtype=torch.bool).reshape(batch, 1, q_len, kv_len)
    try:
        planned = _planned_mask(mask)
    except NotImplementedError:
        return
    assert torch.equal(planned, mask)


def test_attention_forward_windowed_softcapped_is_differentiable() -> None:
    """Gradients through windowed, capped calls (a right-padded sequence under a window: two windowed runs)."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 1, 5, 5))
    mask = _mask(SLIDING, [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], 5, 5)
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3, softcap=1.5)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want = torch.autograd.grad(_sdpa(q, k, v, mask, softcap=1.5).sum(), (q, k, v))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
