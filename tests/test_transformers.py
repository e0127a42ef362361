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

from conftest import gpu, syncs_raise  # noqa: E402

import lazytriton  # noqa: E402
from lazytriton.integrations import transformers as lt_transformers  # noqa: E402
from lazytriton.integrations import transformers_varlen  # noqa: E402

PAD = 0


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    lt_transformers.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=100,
                                      pad_token_id=PAD)
    return transformers.LlamaForCausalLM(config).eval()


Call = tuple[str, tuple[int, ...], object, object]


def test_the_name_kernels_is_not_the_checkouts_folder() -> None:
    """transformers 5.25+ imports Hugging Face's ``kernels``; the checkout's kernels/ (lazytriton.kernels) must not
    answer for it, whatever the working directory (tests/conftest.py takes the checkout's root off sys.path)."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not Path(spec.origin or repo).resolve().is_relative_to(repo), spec


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Records each lazytriton call the integration makes: (entry point, query shape, causal, window_size).

    The entry points: "dense" (attn_fwd), "varlen" (flash_attn_varlen_func, or the integration's call of it checked
    once a forward, ``transformers_varlen.checked_varlen_call``), "sdpa" (the SDPA drop-in),
    "masked" (the drop-in's body with a softcap, ``sdpa.masked``), "decoding" (a decoding step's masked call).
    """
    from lazytriton import sdpa

    seen: list[Call] = []

    def spy(kind: str, module: object, name: str) -> None:
        real = getattr(module, name)

        def recorded(q: torch.Tensor, *args: object, **kw: object) -> object:
            if sys._getframe(1).f_globals.get("__name__") != "lazytriton.sdpa":  # not the drop-in's own body
                seen.append((kind, tuple(q.shape), kw.get("causal"), kw.get("window_size")))
            return real(q, *args, **kw)

        monkeypatch.setattr(module, name, recorded)

    for kind, module, name in (("dense", lazytriton, "attn_fwd"), ("varlen", lazytriton, "flash_attn_varlen_func"),
                               ("varlen", transformers_varlen, "checked_varlen_call"),
                               ("sdpa", lazytriton, "scaled_dot_product_attention"), ("masked", sdpa, "masked"),
                               ("decoding", lt_transformers, "decoding_step")):
        spy(kind, module, name)
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


def _real(logits: torch.Tensor, padding: str) -> torch.Tensor:
    """The logits of real tokens: a right-padded sequence's pad queries give zeros in lazytriton (as in
    transformers' flash_attention_2), where SDPA lets them see the real keys; their output feeds no real token."""
    return logits if MASKS[padding] is None else logits[MASKS[padding].bool()]


@pytest.mark.parametrize("padding", list(MASKS))
def test_logits_match_sdpa(model: torch.nn.Module, calls: list[Call], padding: str) -> None:
    inputs = {"input_ids": IDS}
    if MASKS[padding] is not None:
        inputs["attention_mask"] = MASKS[padding]
    want = _logits(model, "sdpa", **inputs)
    got = _logits(model, "lazytriton", **inputs)
    torch.testing.assert_close(_real(got, padding), _real(want, padding), atol=1e-5, rtol=1e-5)
    if padding == "left_padded":  # pad rows too: a left-padded pad query sees no key, zeros in both
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    # One call per layer: dense on the batch unpadded, varlen padded, on the padded batch's 12 rows read in place
    # (each sequence's real tokens are one run: transformers_varlen.Runs).
    want_calls = ([("dense", (2, 4, 6, 8), True, None)] if padding == "unpadded"
                  else [("varlen", (12, 4, 8), True, (-1, -1))])
    assert calls == want_calls * layers


def test_padded_batch_is_one_varlen_call_per_layer(calls: list[Call]) -> None:
    """A deeper model, 3 sequences padded on either side: exactly one varlen call per layer, nothing else."""
    lt_transformers.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=4, vocab_size=100, pad_token_id=PAD)
    llama = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 100, (3, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    want = _logits(llama, "sdpa", input_ids=ids, attention_mask=mask)
    got = _logits(llama, "lazytriton", input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    assert calls == [("varlen", (15, 4, 8), True, (-1, -1))] * 4  # the 15 padded rows, read in place


@pytest.mark.filterwarnings("ignore:.*right-padding was detected")
@pytest.mark.parametrize("padding, cache", [("left_padded", "dynamic"), ("right_padded", "dynamic"),
                                            ("left_padded", "static")])
def test_generate_matches_sdpa(model: torch.nn.Module, calls: list[Call], padding: str, cache: str) -> None:
    """Greedy tokens and scores; the prefill is one varlen call per layer, each decoding step one SDPA call.

    A decoding step's mask becomes an additive bias (nothing read back to the host); a static cache has empty
    slots after the tokens (masked there); right padding leaves pads between prompt and new tokens.
    A right-padded prompt's first new token comes from its last position, a pad, whose attention output is zeros
    in lazytriton (as in transformers' flash_attention_2) but not in SDPA: transformers warns that such
    generation is wrong anyway; the unpadded row is compared there.
    """
    outs = {}
    for impl in ("sdpa", "lazytriton"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=IDS, attention_mask=MASKS[padding], max_new_tokens=4, do_sample=False,
                                    pad_token_id=PAD, output_scores=True, return_dict_in_generate=True,
                                    cache_implementation=cache)
    rows = [1] if padding == "right_padded" else [0, 1]
    assert torch.equal(outs["lazytriton"].sequences[rows], outs["sdpa"].sequences[rows])
    for got, want in zip(outs["lazytriton"].scores, outs["sdpa"].scores, strict=True):
        torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    assert [c[0] for c in calls] == ["varlen"] * layers + ["decoding"] * layers * 3, calls  # the prefill, 3 steps
    decoding = [c for c in calls if c[1][:3] == (2, 4, 1)]  # one query for each of the 2 sequences
    assert len(decoding) == layers * 3, calls


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
def test_chunked_prefill_with_dynamic_cache(model: torch.nn.Module, calls: list[Call]) -> None:
    """Two chunks of 3 into a DynamicCache: q_len < kv_len with q_len > 1 (bottom-right causal)."""
    def logits(impl: str) -> torch.Tensor:
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=IDS[:, :3], past_key_values=cache, use_cache=True)
            return model(input_ids=IDS[:, 3:], past_key_values=cache, use_cache=True).logits

    torch.testing.assert_close(logits("lazytriton"), logits("sdpa"), atol=1e-5, rtol=1e-5)
    # The second chunk, unpadded: one dense call for the whole batch on the whole cache.
    assert ("dense", (2, 4, 3, 8), "bottom_right", None) in calls


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


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float) -> torch.Tensor:
    """transformers' "eager" attention in float64: scores scaled, capped, then masked; (batch, q_len, heads, d)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = softcap * torch.tanh(q.double() @ k.transpose(-1, -2) * scale / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype).transpose(1, 2)


def test_attention_forward_gathers_keys_around_pads(calls: list[Call]) -> None:
    """Generation after right padding: the cache holds pads between the prompt and the new tokens (varlen)."""
    q, k, v = _qkv(2, 4, 2, 2, 7)
    valid = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    causal = torch.arange(7)[None, :] <= torch.arange(5, 7)[:, None]  # queries are the last two positions
    mask = (valid[:, None, :] & causal[None])[:, None]
    got, weights = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    assert weights is None
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    assert calls == [("varlen", (4, 4, 8), True, (-1, -1))]


def test_attention_forward_reanalyses_a_mask_changed_in_place(calls: list[Call]) -> None:
    """The per-forward analysis is cached by the mask object and its version: an in-place edit is seen."""
    q, k, v = _qkv(2, 2, 2, 4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    mask = (torch.ones(2, 4, dtype=torch.bool)[:, None, :] & causal[None])[:, None].clone()
    for _ in range(2):
        got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    mask[1, :, 3, 1] = False  # query 3 of sequence 1 stops seeing key 1, keys 0 and 2 it still sees: a hole
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    mask[1, :, 3, 1] = True
    mask[1, :, :, 0] = False  # key 0 is now a pad: sequence 1 is left-padded, its query 0 sees nothing
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))  # a fully masked query: zeros, as SDPA's
    # Unpadded twice (the second call from the cache), the hole, the left padding.
    assert [c[0] for c in calls] == ["dense", "dense", "sdpa", "varlen"]


def test_attention_forward_bidirectional_padding(calls: list[Call]) -> None:
    """Every query is packed (pad rows see the real keys, as in SDPA), the real keys only: one varlen call."""
    q, k, v = _qkv(2, 2, 2, 5, 5)
    valid = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    mask = valid[:, None, None, :].expand(2, 1, 5, 5)
    got, _ = lt_transformers.attention_forward(_Module(False), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    assert calls == [("varlen", (10, 2, 8), False, (-1, -1))]


def test_attention_forward_no_mask_static_cache_prefill_and_decode() -> None:
    """No mask with kv_len > q_len: SDPA's meaning (top-left causal prefill; a single query sees every key)."""
    q, k, v = _qkv(1, 2, 2, 3, 6)
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, None, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, None, True), atol=1e-5, rtol=1e-5)
    got, _ = lt_transformers.attention_forward(_Module(True), q[:, :, :1], k, v, None, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q[:, :, :1], k, v, None, False), atol=1e-5, rtol=1e-5)


def _host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each read of a tensor's values back to the host made from lazytriton's code (the fake GPU's sync).

    On a GPU each of these (``item``, ``tolist``, ``bool``, ``int``, ``float``, ``cpu``, ``numpy``, ``nonzero``)
    waits for the device; on CPU they are plain calls, so they are counted where lazytriton's modules make them.
    """
    import sys as _sys

    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _real: object = real, _name: str = name,
                    **kwargs: object) -> object:
            caller = _sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("lazytriton"):
                reads.append(f"{_name} in {caller}")
            return _real(self, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.mark.parametrize("case", ["left", "right", "hole", "static", "softcap"])
def test_a_decoding_step_reads_nothing_back_to_the_host(calls: list[Call], monkeypatch: pytest.MonkeyPatch,
                                                         case: str) -> None:
    """One query a sequence against a cache, whatever the mask: one SDPA call, no device-to-host read, SDPA's
    output; every layer of the forward reuses the bias made for the mask object. With a softcap (Gemma 2), the
    drop-in's body caps the scores before the mask (eager's order)."""
    q, k, v = _qkv(2, 4, 2, 1, 7)
    valid = {"left": [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]],
             "right": [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]],
             "hole": [[1, 0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1]],
             "static": [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]],  # a static cache's empty slots
             "softcap": [[0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]}[case]
    mask = torch.tensor(valid, dtype=torch.bool)[:, None, None, :]
    features = {"softcap": 0.5} if case == "softcap" else {}
    if features:
        q = q * 8  # scores well past the cap
        want = _eager(q, k, v, mask, 0.3, 0.5)
        assert not torch.allclose(want, _sdpa(q, k, v, mask, False), atol=1e-2), "the cap changes the result"
    else:
        want = _sdpa(q, k, v, mask, False)
    reads = _host_reads(monkeypatch)
    for _ in range(2):  # two layers of one forward: the same mask object
        got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3, **features)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert reads == [], reads
    assert [c[0] for c in calls] == ["decoding", "decoding"]


def test_the_host_read_counter_sees_a_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter of the test above is not blind: a prefill's padding analysis reads one summary back."""
    q, k, v = _qkv(2, 2, 2, 4, 4)
    valid = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    mask = (valid[:, None, :] & torch.ones(4, 4, dtype=torch.bool).tril()[None])[:, None]
    reads = _host_reads(monkeypatch)
    lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    assert "tolist in lazytriton.integrations.transformers_varlen" in reads, reads  # the summary, one read


@gpu
@pytest.mark.gpu
def test_gpu_a_decoding_step_never_synchronises() -> None:
    """On the GPU, torch's sync debug mode raises at any synchronisation inside the attention function."""
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(8, 16, 4, 1, 512))
    valid = torch.ones(8, 512, dtype=torch.bool, device="cuda")
    valid[0, :100] = False  # left padding
    mask = valid[:, None, None, :]
    lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)  # loads the kernel
    with syncs_raise():
        for _ in range(3):
            got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    want = _sdpa(q.float(), k.float(), v.float(), mask, False)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("padding, kind", [("left", "varlen"), ("right", "sdpa")])
def test_attention_forward_is_differentiable_with_padding(calls: list[Call], padding: str, kind: str) -> None:
    """Gradients through the varlen call, and through the SDPA drop-in: a right-padded causal mask alone (not
    from the mask function, so the pad queries are not known as such) is not plain padding, its pad query sees
    keys before it."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 1, 4, 4))
    valid = torch.tensor([[1, 1, 1, 0] if padding == "right" else [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    mask = (valid[:, None, :] & torch.ones(4, 4, dtype=torch.bool).tril()[None])[:, None]
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want = torch.autograd.grad(_sdpa(q, k, v, mask, False).sum(), (q, k, v))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert [c[0] for c in calls] == [kind]


def test_custom_4d_mask_is_one_sdpa_call_per_layer(model: torch.nn.Module, calls: list[Call]) -> None:
    arbitrary = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(2)) > 0.5
    arbitrary[..., 0] = True
    want = _logits(model, "sdpa", input_ids=IDS, attention_mask=arbitrary)
    torch.testing.assert_close(_logits(model, "lazytriton", input_ids=IDS, attention_mask=arbitrary), want,
                               atol=1e-5, rtol=1e-5)
    assert [c[0] for c in calls] == ["sdpa"] * model.config.num_hidden_layers


def test_packed_documents_are_one_sdpa_call_per_layer(model: torch.nn.Module, calls: list[Call]) -> None:
    """Two documents packed in one row (position_ids restart): transformers draws a block-diagonal causal mask."""
    inputs = {"input_ids": IDS[:1], "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]), "use_cache": False}
    want = _logits(model, "sdpa", **inputs)
    torch.testing.assert_close(_logits(model, "lazytriton", **inputs), want, atol=1e-5, rtol=1e-5)
    assert [c[0] for c in calls] == ["sdpa"] * model.config.num_hidden_layers
    separate = _logits(model, "sdpa", input_ids=IDS[:1, 3:], use_cache=False)
    torch.testing.assert_close(want[:, 3:], separate, atol=1e-5, rtol=1e-5)  # the mask did separate them


@pytest.mark.parametrize("case", ["hole", "float_mask", "per_head"])
def test_arbitrary_masks_match_sdpa(calls: list[Call], case: str) -> None:
    q, k, v = _qkv(2, 2, 2, 4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    float_mask = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(4))
    float_mask[0, 0, 1:, 2] = float("-inf")
    masks = {
        "hole": (causal & ~torch.eye(4, dtype=torch.bool).roll(-1, 1))[None, None],  # query i skips key i - 1
        "float_mask": float_mask,  # additive
        "per_head": torch.stack([causal, causal.T])[None],
    }
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, masks[case], scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, masks[case], False), atol=1e-5, rtol=1e-5)
    assert [c[0] for c in calls] == ["sdpa"]


def test_masks_refused() -> None:
    """Softcap on a mask with holes (the SDPA drop-in has no softcap, the per-sequence plan no holes); 3 dims."""
    q, k, v = _qkv(1, 2, 2, 4, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    hole = (causal & ~torch.eye(4, dtype=torch.bool).roll(-1, 1))[None, None]
    with pytest.raises(NotImplementedError, match="not supported together with softcap"):
        lt_transformers.attention_forward(_Module(True), q, k, v, hole, softcap=2.0)
    with pytest.raises(ValueError, match="attention_mask must have 4 dims"):
        lt_transformers.attention_forward(_Module(True), q, k, v, causal[None])


@pytest.mark.parametrize("kwargs", [{"dropout": 0.1}, {"indices": torch.zeros(2)},
                                    {"position_bias": torch.zeros(1, 2, 4, 4)}])
def test_unsupported_features_raise(kwargs: dict) -> None:
    q, k, v = _qkv(1, 2, 2, 4, 4)
    with pytest.raises(NotImplementedError, match="lazytriton attention"):
        lt_transformers.attention_forward(_Module(True), q, k, v, None, **kwargs)


def test_import_lazytriton_does_not_import_transformers() -> None:
    code = ("import sys, lazytriton, lazytriton.integrations; lazytriton.attn_fwd; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
