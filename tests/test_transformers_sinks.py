"""transformers integration with attention sinks: a tiny random gpt-oss gives "eager"'s logits, tokens and gradients.

gpt-oss passes each layer's ``sinks`` parameter to the attention function as ``s_aux``; lazytriton's kernels take
it as ``sinks`` on every path (the padded prefill's varlen call, a decoding step's masked call, unmasked calls, the
SDPA drop-in for any other mask). CPU, float32, through Triton's interpreter: shapes are tiny on purpose.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from lazytriton.integrations import transformers as lt_transformers  # noqa: E402

PAD = 0
IDS = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(1))
LEFT_PADDED = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


def _gpt_oss(sliding_window: int = 4) -> torch.nn.Module:
    """Two layers (a sliding one and a full one), 4 query and 2 key/value heads; sinks far from their zero init."""
    lt_transformers.register()
    torch.manual_seed(0)
    config = transformers.GptOssConfig(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                       num_experts_per_tok=2, vocab_size=100, sliding_window=sliding_window,
                                       layer_types=["sliding_attention", "full_attention"], pad_token_id=PAD)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 2)
    return model  # type: ignore[no-any-return]


def _logits(model: torch.nn.Module, impl: str, **inputs: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("mask", [None, LEFT_PADDED], ids=["unpadded", "left_padded"])
def test_gpt_oss_logits_match_eager(mask: torch.Tensor | None) -> None:
    model = _gpt_oss()
    inputs = {"input_ids": IDS} if mask is None else {"input_ids": IDS, "attention_mask": mask}
    want, got = _logits(model, "eager", **inputs), _logits(model, "lazytriton", **inputs)
    real = torch.ones_like(IDS, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    plain = {k: v for k, v in inputs.items()}
    for layer in model.model.layers:  # the sinks count: without them the logits move
        layer.self_attn.sinks.data.fill_(float("-inf"))
    assert not torch.allclose(_logits(model, "eager", **plain)[real], want[real], atol=1e-3)


def test_gpt_oss_generate_matches_eager() -> None:
    """Greedy tokens and scores of a left-padded batch: the prefill's varlen calls and the decoding steps' masked
    calls both carry each layer's sinks (the sliding layer's window cuts in after a few tokens)."""
    model = _gpt_oss(sliding_window=3)
    outs = {}
    for impl in ("eager", "lazytriton"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=IDS, attention_mask=LEFT_PADDED, max_new_tokens=4, do_sample=False,
                                    pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(outs["lazytriton"].sequences, outs["eager"].sequences)
    for got, want in zip(outs["lazytriton"].scores, outs["eager"].scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gpt_oss_sinks_get_eagers_gradient() -> None:
    model = _gpt_oss()
    grads = {}
    for impl in ("eager", "lazytriton"):
        model.zero_grad()
        model.set_attn_implementation(impl)
        logits = model(input_ids=IDS, attention_mask=LEFT_PADDED).logits
        (logits[LEFT_PADDED.bool()] ** 2).mean().backward()
        grads[impl] = [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]
        grads[impl].append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    for got, want in zip(grads["lazytriton"], grads["eager"], strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class _Module(torch.nn.Module):
    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = 2  # eager_attention_forward's repeat of the key/value heads
        self.sinks = torch.nn.Parameter(sinks)
        self.eval()


def _eager(module: _Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return eager_attention_forward(module, q, k, v, bias, scaling=q.shape[-1] ** -0.5)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["holes", "decoding"])
def test_attention_forward_takes_s_aux_on_the_mask_paths(kind: str) -> None:
    """A mask with holes (the SDPA drop-in) and a decoding step's mask (the cached masked call), bf16 sinks."""
    gen = torch.Generator().manual_seed(2)
    q_len = 1 if kind == "decoding" else 5
    q = torch.randn(2, 4, q_len, 16, generator=gen)
    k, v = (torch.randn(2, 2, 6, 16, generator=gen) for _ in range(2))
    mask = torch.rand(2, 1, q_len, 6, generator=gen) > 0.4
    mask[..., 0] = True
    module = _Module(torch.randn(4, generator=gen).bfloat16())
    want = _eager(module, q, k, v, mask)
    for _ in range(2):  # the second call runs the decoding step's cached call, with the sinks again
        got, _ = lt_transformers.attention_forward(module, q, k, v, mask, scaling=16 ** -0.5, s_aux=module.sinks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_s_aux_and_sinks_together_are_refused() -> None:
    q = torch.randn(1, 4, 1, 16)
    k = v = torch.randn(1, 2, 3, 16)
    sinks = torch.zeros(4)
    with pytest.raises(TypeError, match="two names of one argument"):
        lt_transformers.attention_forward(_Module(sinks), q, k, v, None, s_aux=sinks, sinks=sinks)
