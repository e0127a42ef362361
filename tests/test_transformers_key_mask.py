"""transformers' decoding steps through the decoding kernels with the mask as their key mask (KEY_MASK).

A decoding step (one query a sequence, a boolean (batch, 1, 1, kv_len) mask) goes to ``kvcache.with_key_mask``
on the cache's tensors as views: counted here, with no read back to the host (the fake GPU's count of
``test_transformers``), SDPA's output (eager's with a softcap), every layer the same route; generate with a
left-padded batch takes it at every step and layer and gives SDPA's tokens. Where the route does not apply
(gradients wanted, a tensor subclass, a per-head mask), the bias path runs as before. On the GPU: the route under
``set_sync_debug_mode("error")``, near SDPA in bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from conftest import gpu, syncs_raise  # noqa: E402
from test_transformers import _eager, _host_reads, _Module, _qkv, _sdpa  # noqa: E402

from lazytriton import kvcache  # noqa: E402
from lazytriton.integrations import transformers as lt_transformers  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning")]


@pytest.fixture(autouse=True)
def every_step_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route from the first key, whatever the library's ``KEY_MASK_MIN_KEYS`` (a switch for short steps): these
    tests' caches are a few keys long."""
    monkeypatch.setattr(lt_transformers, "KEY_MASK_MIN_KEYS", 0)


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Records each ``kvcache.with_key_mask`` call the integration makes: (q's shape and strides, the mask's)."""
    seen: list[tuple[Any, ...]] = []
    real = kvcache.with_key_mask

    def recorded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_mask: torch.Tensor,
                 *args: Any, **kw: Any) -> Any:
        seen.append((tuple(q.shape), q.stride(), tuple(k_cache.shape), k_cache.stride(), tuple(key_mask.shape)))
        return real(q, k_cache, v_cache, key_mask, *args, **kw)

    monkeypatch.setattr(kvcache, "with_key_mask", recorded)
    return seen


VALID = {"left": [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]],
         "right": [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]],
         "hole": [[1, 0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1]],
         "static": [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]],  # a static cache's empty slots
         "none_seen": [[0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 1, 1]]}


@pytest.mark.parametrize("case", [*VALID, "softcap", "sinks"])
def test_a_decoding_step_takes_the_key_mask_route_and_reads_nothing_back(
        routed: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    q, k, v = _qkv(2, 4, 2, 1, 7)
    mask = torch.tensor(VALID.get(case, VALID["left"]), dtype=torch.bool)[:, None, None, :]
    features: dict[str, Any] = {}
    if case == "softcap":
        q = q * 8  # scores well past the cap
        features = {"softcap": 0.5}
        want = _eager(q, k, v, mask, 0.3, 0.5).float()
    elif case == "sinks":
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
        features = {"s_aux": sinks}
        scores = torch.cat((q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3,
                            sinks.double()[None, :, None, None].expand(2, 4, 1, 1)), -1)
        scores[..., :-1] = scores[..., :-1].masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, -1)[..., :-1]
        want = (probs @ v.double().repeat_interleave(2, 1)).transpose(1, 2).float()
    else:
        want = _sdpa(q, k, v, mask, False)
    reads = _host_reads(monkeypatch)
    for _ in range(2):  # two layers of one forward: the same mask object
        got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3, **features)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert reads == [], reads
    assert len(routed) == 2
    assert routed[0][:4] == ((2, 1, 4, 8), q.transpose(1, 2).stride(), (2, 7, 2, 8), k.transpose(1, 2).stride())
    if case == "none_seen":  # SDPA's zeros for a sequence that sees nothing
        assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_where_the_route_does_not_apply_the_bias_path_runs(routed: list[tuple[Any, ...]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(2, 4, 2, 1, 7)
    mask = torch.tensor(VALID["left"], dtype=torch.bool)[:, None, None, :]
    monkeypatch.setattr(lt_transformers, "KEY_MASK_MIN_KEYS", 8)  # shorter steps: the bias path
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, False), atol=1e-5, rtol=1e-5)
    assert routed == []
    monkeypatch.setattr(lt_transformers, "KEY_MASK_MIN_KEYS", 0)
    mask = torch.tensor(VALID["left"], dtype=torch.bool)[:, None, None, :]
    want = _sdpa(q, k, v, mask, False)
    q_grad = q.clone().requires_grad_(True)
    got, _ = lt_transformers.attention_forward(_Module(True), q_grad, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.sum().backward()  # the bias path is differentiable; the decoding kernels are not
    assert q_grad.grad is not None and routed == []
    with torch.no_grad():
        got, _ = lt_transformers.attention_forward(_Module(True), q_grad, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(routed) == 1


@pytest.mark.parametrize("case", ["left", "hole", "softcap"])
def test_under_torch_compile_the_step_is_the_key_masked_op_in_one_graph(case: str) -> None:
    """fullgraph: the route's checks trace, the mask's view is made in the graph, the call is the torch op."""
    q, k, v = _qkv(2, 4, 2, 1, 7)
    mask = torch.tensor(VALID["left" if case == "softcap" else case], dtype=torch.bool)[:, None, None, :]
    features = {"softcap": 0.5} if case == "softcap" else {}
    if case == "softcap":
        q = q * 8
    graphs: list[Any] = []

    def recording(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3, **features)[0]

    torch._dynamo.reset()
    try:
        got = torch.compile(step, fullgraph=True, backend=recording)(q, k, v, mask)
    finally:
        torch._dynamo.reset()
    want = _eager(q, k, v, mask, 0.3, 0.5).float() if case == "softcap" else _sdpa(q, k, v, mask, False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, step(q, k, v, mask), atol=0, rtol=0)  # the eager route's bits
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1 and torch.ops.lazytriton.flash_kvcache_read.default in targets, targets
    assert torch.ops.aten.masked_fill.Scalar not in targets  # no bias made


@pytest.mark.parametrize("seed", range(40))
def test_a_decoding_step_s_mask_is_sdpa_mask_s_without_it(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamic and static caches' steps (an int or a tensor position, keys past the 2D mask, a key offset)."""
    from transformers import masking_utils

    rng = torch.Generator().manual_seed(seed)
    batch, length = int(torch.randint(1, 4, (1,), generator=rng)), int(torch.randint(1, 9, (1,), generator=rng))
    padding = torch.randint(0, 2, (batch, length), generator=rng)
    if seed % 3 == 0:
        padding = padding.bool()
    kv_offset = int(torch.randint(0, 3, (1,), generator=rng)) if seed % 4 == 0 else 0
    kv_len = max(1, length - kv_offset + int(torch.randint(0, 4, (1,), generator=rng)))
    position = int(torch.randint(0, kv_offset + kv_len + 1, (1,), generator=rng))
    q_offset: Any = torch.tensor(position) if seed % 2 else position
    kwargs = {"batch_size": batch, "q_length": 1, "kv_length": kv_len, "q_offset": q_offset, "kv_offset": kv_offset,
              "mask_function": masking_utils.causal_mask_function, "attention_mask": padding,
              "allow_is_causal_skip": False, "dtype": torch.float32, "use_vmap": False, "device": torch.device("cpu")}
    want = masking_utils.sdpa_mask(**kwargs)
    built: list[Any] = []
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: built.append(k))
    got = lt_transformers.mask(**{**kwargs, "allow_is_causal_skip": True})
    assert built == [] and got.dtype == torch.bool and got.shape == (batch, 1, 1, kv_len), kwargs
    assert torch.equal(got, want.expand_as(got)), (kwargs, got, want)


def test_other_masks_are_sdpa_mask_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import masking_utils

    padding = torch.ones(2, 6, dtype=torch.long)
    base = {"batch_size": 2, "q_length": 1, "kv_length": 6, "q_offset": 5, "kv_offset": 0,
            "mask_function": masking_utils.causal_mask_function, "attention_mask": padding}
    built: list[Any] = []
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: built.append(k))
    window = masking_utils.sliding_window_causal_mask_function(3)
    for other in ({"q_length": 2}, {"mask_function": window}, {"attention_mask": None}, {"local_size": 2},
                  {"attention_mask": padding[None]}, {"batch_size": 3}):
        lt_transformers.mask(**{**base, **other})
    assert len(built) == 6


def test_a_broadcast_mask_is_read_with_batch_stride_0(routed: list[tuple[Any, ...]]) -> None:
    q, k, v = _qkv(3, 4, 2, 1, 7)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask.expand(3, 1, 1, 7), False), atol=1e-5, rtol=1e-5)
    assert routed[0][4] == (3, 7)


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    lt_transformers.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=100, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def test_generate_with_left_padding_takes_the_route_at_every_step(model: torch.nn.Module,
                                                                  routed: list[tuple[Any, ...]]) -> None:
    ids = torch.randint(1, 100, (3, 6), generator=torch.Generator().manual_seed(2))
    padding = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    tokens = {}
    for impl in ("sdpa", "lazytriton"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(input_ids=ids, attention_mask=padding, max_new_tokens=4, min_new_tokens=4,
                                          do_sample=False, pad_token_id=0)
    assert torch.equal(tokens["sdpa"], tokens["lazytriton"])
    assert len(routed) == 3 * 2  # 3 decoding steps (the first new token is the prefill's) x 2 layers
    assert [r[2][1] for r in routed] == [7, 7, 8, 8, 9, 9]  # the dynamic cache's length, read in place


@gpu
@pytest.mark.gpu
def test_gpu_a_key_masked_decoding_step_never_synchronises(routed: list[tuple[Any, ...]]) -> None:
    """bench_transformers' shape: batch 8, 16/4 heads, head dim 128, bf16, left pads up to 448 of 512 keys."""
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(8, 16, 4, 1, 512, d=128))
    valid = torch.arange(512, device="cuda")[None, :] >= torch.arange(0, 512, 64, device="cuda")[:, None]
    mask = valid[:, None, None, :]
    lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.088)  # loads the kernels
    with syncs_raise():
        for _ in range(3):
            got, _ = lt_transformers.attention_forward(_Module(True), q, k, v, mask, scaling=0.088)
    assert len(routed) == 4
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            enable_gqa=True, scale=0.088).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
