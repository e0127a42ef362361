"""transformers integration: a tiny random Llama gives SDPA's logits and tokens with attn_implementation="lazytriton".

CPU, float32, through Triton's interpreter: shapes are tiny on purpose.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

import lazytriton  # noqa: E402
from lazytriton.integrations import transformers as lt_transformers  # noqa: E402

PAD = 0


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    lt_transformers.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=100,
                                      pad_token_id=PAD)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], object]]:
    """Records each lazytriton.attn_fwd call (query shape, causal), proving lazytriton ran."""
    seen: list[tuple[tuple[int, ...], object]] = []
    real = lazytriton.attn_fwd

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((tuple(q.shape), kw.get("causal")))
        return real(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(lazytriton, "attn_fwd", spy)
    return seen


def _logits(model: torch.nn.Module, impl: str, **inputs: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits  # type: ignore[no-any-return]


IDS = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
MASKS = {
    "unpadded": None,
    "left_padded": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
    "right_padded": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
}


@pytest.mark.parametrize("padding", list(MASKS))
def test_logits_match_sdpa(model: torch.nn.Module, calls: list, padding: str) -> None:
    inputs = {"input_ids": IDS}
    if MASKS[padding] is not None:
        inputs["attention_mask"] = MASKS[padding]
    want = _logits(model, "sdpa", **inputs)
    got = _logits(model, "lazytriton", **inputs)
    # All positions, pad rows included: SDPA gives a fully masked query row zeros, and so does lazytriton;
    # a right-padded pad query sees every real key, in both.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    # One call per layer unpadded; padded: one per sequence, plus one for the pad queries of a right-padded
    # sequence (they see every real key); the pad queries of a left-padded one get zeros without a launch.
    expected = {"unpadded": 1, "left_padded": 2, "right_padded": 3}[padding]
    assert len(calls) == expected * layers, calls


def test_generate_left_padded_matches_sdpa(model: torch.nn.Module, calls: list) -> None:
    mask = MASKS["left_padded"]
    tokens = {}
    for impl in ("sdpa", "lazytriton"):
        model.set_attn_implementation(impl)
        out = model.generate(input_ids=IDS, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
        tokens[impl] = out
    assert torch.equal(tokens["lazytriton"].sequences, tokens["sdpa"].sequences)
    for got, want in zip(tokens["lazytriton"].scores, tokens["sdpa"].scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert any(shape[2] == 1 for shape, _ in calls), "decoding steps (one query against the cache) ran lazytriton"


@pytest.mark.parametrize("padding, cache", [("left_padded", "static"), ("right_padded", "dynamic")])
def test_generate_static_cache_and_right_padding_match_sdpa(model: torch.nn.Module, padding: str, cache: str) -> None:
    """A static cache (empty slots after the tokens) and right padding (pads between prompt and new tokens)."""
    outs = {}
    for impl in ("sdpa", "lazytriton"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=IDS, attention_mask=MASKS[padding], max_new_tokens=3, do_sample=False,
                                    pad_token_id=PAD, output_scores=True, return_dict_in_generate=True,
                                    cache_implementation=cache)
    assert torch.equal(outs["lazytriton"].sequences, outs["sdpa"].sequences)
    for got, want in zip(outs["lazytriton"].scores, outs["sdpa"].scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _tiny(cls_config: type, cls_model: type, **extra: object) -> torch.nn.Module:
    torch.manual_seed(0)
    config = cls_config(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                        vocab_size=100, pad_token_id=PAD, **extra)
    return cls_model(config).eval()  # type: ignore[no-any-return]


def test_bidirectional_padded_encoder_matches_sdpa() -> None:
    lt_transformers.register()
    bert = _tiny(transformers.BertConfig, transformers.BertModel)
    mask = MASKS["right_padded"]
    with torch.no_grad():
        bert.set_attn_implementation("sdpa")
        want = bert(input_ids=IDS, attention_mask=mask).last_hidden_state
        bert.set_attn_implementation("lazytriton")
        got = bert(input_ids=IDS, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_left_padded_matches_sdpa() -> None:
    lt_transformers.register()
    llama = _tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, num_key_value_heads=2).to(torch.bfloat16)
    inputs = {"input_ids": IDS, "attention_mask": MASKS["left_padded"]}
    got, want = _logits(llama, "lazytriton", **inputs), _logits(llama, "sdpa", **inputs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [3, 16])
def test_sliding_window_matches_sdpa(window: int) -> None:
    """Mistral's window: wider than the sequence the mask is causal; narrower, it cuts in (a windowed call)."""
    lt_transformers.register()
    mistral = _tiny(transformers.MistralConfig, transformers.MistralForCausalLM, num_key_value_heads=2,
                    sliding_window=window)
    want = _logits(mistral, "sdpa", input_ids=IDS)
    torch.testing.assert_close(_logits(mistral, "lazytriton", input_ids=IDS), want, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_chunked_prefill_with_dynamic_cache(model: torch.nn.Module, calls: list) -> None:
    """Two chunks of 3 into a DynamicCache: q_len < kv_len with q_len > 1 (bottom-right causal)."""
    def logits(impl: str) -> torch.Tensor:
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=IDS[:, :3], past_key_values=cache, use_cache=True)
            return model(input_ids=IDS[:, 3:], past_key_values=cache, use_cache=True).logits

    torch.testing.assert_close(logits("lazytriton"), logits("sdpa"), atol=1e-5, rtol=1e-5)
    assert (((2, 4, 3, 8), "bottom_right")) in calls  # the second chunk: one call for the whole batch


def test_from_pretrained_with_attn_implementation(model: torch.nn.Module, tmp_path: object) -> None:
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="lazytriton").eval()
    assert loaded.config._attn_implementation == "lazytriton"
    with torch.no_grad():
        got = loaded(input_ids=IDS, attention_mask=MASKS["left_padded"]).logits
    torch.testing.assert_close(got, _logits(model, "sdpa", input_ids=IDS, attention_mask=MASKS["left_padded"]),
                               atol=1e-5, rtol=1e-5)


class _Module(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


def _qkv(b: int, hq: int, hk: int, sq: int, sk: int, d: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sq * 100 + sk)
    return tuple(torch.randn(b, h, s, d, generator=g) for h, s in ((hq, sq), (hk, sk), (hk, sk)))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                           enable_gqa=True, scale=0.3)
    return out.transpose(1, 2)


def test_attention_forward_gathers_keys_around_pads() -> None:
    """Generation after right padding: the cache holds pads between the prompt and the new tokens."""
    q, k, v = _qkv(2, 4, 2, 2, 7)
    valid = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    causal = torch.arange(7)[None, :] <= torch.arange(5, 7)[:, None]  # queries are the last two positions
    mask = (valid[:, None, :] & causal[None])[:, None]
    got, weights = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    assert weights is None
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)


def test_attention_forward_reanalyses_a_mask_changed_in_place() -> None:
    """The per-forward plan cache is keyed by the mask object and its version: an in-place edit is seen."""
    q, k, v = _qkv(2, 2, 2, 4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    mask = (torch.ones(2, 4, dtype=torch.bool)[:, None, :] & causal[None])[:, None].clone()
    for _ in range(2):
        got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    mask[1, :, 3, 1] = False  # query 3 of sequence 1 stops seeing key 1, keys 0 and 2 it still sees: a hole
    with pytest.raises(NotImplementedError, match="query 3 of sequence 1"):
        lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    mask[1, :, 3, 1] = True
    mask[1, :, :, 0] = False  # key 0 is now a pad: sequence 1 is left-padded, its query 0 sees nothing
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))  # a fully masked query: zeros, as SDPA's


def test_attention_forward_bidirectional_padding() -> None:
    q, k, v = _qkv(2, 2, 2, 5, 5)
    valid = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    mask = valid[:, None, None, :].expand(2, 1, 5, 5)
    got, _ = lt_transformers.attention_forward(_Module(False), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)


def test_attention_forward_no_mask_static_cache_prefill_and_decode() -> None:
    """No mask with kv_len > q_len: SDPA's meaning (top-left causal prefill; a single query sees every key)."""
    q, k, v = _qkv(1, 2, 2, 3, 6)
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, None, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, None, True), atol=1e-5, rtol=1e-5)
    got, _ = lt_transformers.attention_forward(_Module(True), q[:, :, :1], k, v, None, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q[:, :, :1], k, v, None, False), atol=1e-5, rtol=1e-5)


def test_attention_forward_is_differentiable_with_padding() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 1, 4, 4))
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # right padding: a causal and a full run
    mask = (valid[:, None, :] & torch.ones(4, 4, dtype=torch.bool).tril()[None])[:, None]
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want = torch.autograd.grad(_sdpa(q, k, v, mask, False).sum(), (q, k, v))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_custom_4d_mask_raises(model: torch.nn.Module) -> None:
    model.set_attn_implementation("lazytriton")
    arbitrary = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(2)) > 0.5
    arbitrary[..., 0] = True
    with pytest.raises(NotImplementedError, match="arbitrary masks are not supported"), torch.no_grad():
        model(input_ids=IDS, attention_mask=arbitrary)


@pytest.mark.parametrize("case", ["hole", "float_mask", "per_head", "three_dims"])
def test_unsupported_masks_raise(case: str) -> None:
    q, k, v = _qkv(1, 2, 2, 4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    masks = {
        "hole": (causal & ~torch.eye(4, dtype=torch.bool).roll(-1, 1))[None, None],  # query i skips key i - 1
        "float_mask": torch.zeros(1, 1, 4, 4),
        "per_head": torch.stack([causal, causal.T])[None],
        "three_dims": causal[None],
    }
    with pytest.raises(NotImplementedError, match="lazytriton attention"):
        lt_transformers.attention_forward(_Module(True), q, k, v, masks[case])


@pytest.mark.parametrize("kwargs", [{"dropout": 0.1}, {"s_aux": torch.zeros(2)},
                                    {"position_bias": torch.zeros(1, 2, 4, 4)}])
def test_unsupported_features_raise(kwargs: dict) -> None:
    q, k, v = _qkv(1, 2, 2, 4, 4)
    with pytest.raises(NotImplementedError, match="lazytriton attention"):
        lt_transformers.attention_forward(_Module(True), q, k, v, None, **kwargs)


def test_import_lazytriton_does_not_import_transformers() -> None:
    code = ("import sys, lazytriton, lazytriton.integrations; lazytriton.attn_fwd; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
