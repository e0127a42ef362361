"""``lazytriton.scaled_dot_product_attention`` on nested tensors, as torch's SDPA takes them.

Inputs (batch, heads, ragged seqlen, head_dim), the ``transpose(1, 2)`` of nested tensors of (seqlen, heads,
head_dim) sequences, strided or jagged, mixed with dense ones and broadcast as torch broadcasts them (a batch of 1,
one head). Each output sequence and each gradient is checked with FlashAttention's rule against the float64
attention of that sequence alone, and the output keeps the query's layout. On CPU the kernels run through Triton's
interpreter; the GPU test compares with torch's own fused backend on the same nested inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flash_rule import check_rule
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import OUT_FLOOR, on_gpu

import lazytriton
from lazytriton.sdpa import SDPAError, SDPATypeError

LAYOUTS = [torch.strided, torch.jagged]


def _leaves(lengths: list[int], heads: int, dim: int, dtype: torch.dtype, seed: int,
            device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(n, heads, dim, generator=gen, device=device, dtype=dtype).requires_grad_() for n in lengths]


def _nested(leaves: list[torch.Tensor], layout: torch.layout) -> torch.Tensor:
    """(batch, heads, ragged, dim): the nested tensor of (seqlen, heads, dim) leaves, transposed as SDPA takes it."""
    return torch.nested.as_nested_tensor(leaves, layout=layout).transpose(1, 2)


def _sequence_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        dtype: torch.dtype | None) -> torch.Tensor:
    """One sequence's attention from (seqlen, heads, dim) tensors, in ``dtype`` (None: theirs), as (heads, s, dv)."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    qh, kh, vh = (cast(t).transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=qh.shape[0] != kh.shape[0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "causal"), [(torch.float16, False), (torch.bfloat16, True),
                                               (torch.float32, False)])
def test_each_sequence_and_its_gradients_follow_flash_attentions_rule(layout: torch.layout, dtype: torch.dtype,
                                                                      causal: bool) -> None:
    lengths_q = [5, 1, 9]
    lengths_k = lengths_q if causal else [7, 3, 2]
    qs = _leaves(lengths_q, 4, 16, dtype, 1)
    ks = _leaves(lengths_k, 2, 16, dtype, 2)
    vs = _leaves(lengths_k, 2, 24, dtype, 3)  # v's head dim differs, as torch allows
    out = lazytriton.scaled_dot_product_attention(_nested(qs, layout), _nested(ks, layout), _nested(vs, layout),
                                                  is_causal=causal, enable_gqa=True)
    assert out.is_nested and out.layout == layout and out.dim() == 4
    pieces = out.unbind()
    assert [tuple(p.shape) for p in pieces] == [(4, n, 24) for n in lengths_q]
    gen = torch.Generator().manual_seed(4)
    douts = [torch.randn(p.shape, generator=gen, dtype=dtype) for p in pieces]
    grads = torch.autograd.grad(pieces, qs + ks + vs, douts)
    for i, (q, k, v, dout) in enumerate(zip(qs, ks, vs, douts, strict=True)):
        exact = _sequence_reference(q, k, v, causal, torch.float64)
        same = _sequence_reference(q, k, v, causal, None)
        check_rule(f"out[{i}]", pieces[i], exact, same, OUT_FLOOR[dtype])
        exact_grads = torch.autograd.grad(exact, (q, k, v), dout.double())
        same_grads = torch.autograd.grad(same, (q, k, v), dout)
        for name, g, e, s in zip("qkv", (grads[i], grads[3 + i], grads[6 + i]),
                                 exact_grads, same_grads, strict=True):
            check_rule(f"d{name}[{i}]", g, e, s, GRAD_FLOOR[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dense_query_and_single_heads_broadcast_as_torch_broadcasts_them(layout: torch.layout) -> None:
    """torch's own ``test_fused_kernels_nested_broadcasting_query_dense`` in small: a dense (1, heads, 1, d) query
    serves every sequence, a value of one head serves every head."""
    lengths = [3, 6, 1, 4]
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(1, 4, 1, 16, generator=gen)
    ks = _leaves(lengths, 4, 16, torch.float32, 8)
    vs = _leaves(lengths, 1, 8, torch.float32, 9)
    out = lazytriton.scaled_dot_product_attention(query, _nested(ks, layout), _nested(vs, layout))
    assert out.is_nested and out.layout == layout
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        q = query[0].transpose(0, 1)
        want = _sequence_reference(q.double(), k.double(), v.double().expand(-1, 4, -1), False, None)
        torch.testing.assert_close(out.unbind()[i].double(), want, atol=2e-6, rtol=0)


def test_a_nested_input_of_one_sequence_serves_every_sequence_and_one_query_head_every_head() -> None:
    qs = _leaves([2, 5, 3], 1, 16, torch.float32, 10)
    ks = _leaves([4], 3, 16, torch.float32, 11)
    vs = _leaves([4], 3, 16, torch.float32, 12)
    out = lazytriton.scaled_dot_product_attention(_nested(qs, torch.strided), _nested(ks, torch.strided),
                                                  _nested(vs, torch.strided))
    for i, q in enumerate(qs):
        want = _sequence_reference(q.double().expand(-1, 3, -1), ks[0].double(), vs[0].double(), False, None)
        torch.testing.assert_close(out.unbind()[i].double(), want, atol=2e-6, rtol=0)


def test_jagged_inputs_run_without_a_copy_and_give_the_general_paths_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jagged q, k and v that need no broadcast: their values and offsets go to the packed call as they are."""
    from lazytriton import sdpa_nested

    leaves = _leaves([5, 3, 7], 4, 48, torch.float32, 30)  # one projection: q, k and v share their offsets
    strided = [_nested([t[..., i * 16:(i + 1) * 16] for t in leaves], torch.strided) for i in range(3)]
    general = lazytriton.scaled_dot_product_attention(*strided, is_causal=True)
    q, k, v = (t.transpose(1, 2) for t in torch.nested.as_nested_tensor(leaves, layout=torch.jagged).chunk(3, -1))
    assert sdpa_nested.jagged_call(q, k, v, True, False) is not None

    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("the jagged path packed its inputs")

    monkeypatch.setattr(torch, "cat", no_copy)
    out = lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.undo()
    assert out.layout == torch.jagged
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), general.unbind(), strict=True))
    grads = torch.autograd.grad([p.sum() for p in out.unbind()], leaves)
    want = torch.autograd.grad([p.sum() for p in general.unbind()], leaves)
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True))


def test_a_warm_process_never_hands_nested_inputs_to_the_warm_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once warm, dense SDPA calls take the warm path, which reads sizes that a strided nested tensor lacks."""
    from lazytriton import sdpa

    class Warm:
        calls = 0

        def output_bhsd(self, q: torch.Tensor, *args: object) -> None:
            Warm.calls += 1
            q.shape  # noqa: B018 (what the warm path reads first: a strided nested tensor raises here)

    monkeypatch.setattr(sdpa, "hot", Warm())
    dense = [torch.randn(2, 2, 4, 16) for _ in range(3)]
    lazytriton.scaled_dot_product_attention(*dense)
    assert Warm.calls == 1
    leaves = [_leaves([3, 5], 2, 16, torch.float32, seed) for seed in (40, 41, 42)]
    out = lazytriton.scaled_dot_product_attention(*(_nested(t, torch.strided) for t in leaves))
    assert Warm.calls == 1 and out.is_nested
    for i in range(2):
        want = _sequence_reference(*(t[i].detach().double() for t in leaves), False, None)
        torch.testing.assert_close(out.unbind()[i].double(), want, atol=2e-6, rtol=0)


def test_the_jagged_path_leaves_broadcasts_and_unknown_lengths_to_the_general_one() -> None:
    from lazytriton import sdpa_nested

    q = _nested(_leaves([5, 3], 4, 16, torch.float32, 32), torch.jagged)
    other = _nested(_leaves([5, 3], 4, 16, torch.float32, 33), torch.jagged)
    one_head = _nested(_leaves([5, 3], 1, 16, torch.float32, 34), torch.jagged)
    assert sdpa_nested.jagged_call(q, q, q, False, False) is not None
    assert sdpa_nested.jagged_call(q, other, q, False, False) is None  # k's and v's offsets: two tensors
    assert sdpa_nested.jagged_call(one_head, q, q, False, False) is None  # one query head broadcast
    assert sdpa_nested.jagged_call(q, other, other, True, False) is None  # causal: equal lengths unknown
    assert sdpa_nested.jagged_call(_nested(_leaves([5, 3], 4, 16, torch.float32, 35), torch.strided), q, q, False,
                                   False) is None
    values = torch.randn(8, 4, 16)
    unknown = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 5, 8])).transpose(1, 2)
    assert sdpa_nested.jagged_call(unknown, unknown, unknown, False, False) is None  # lengths not on the host
    out = lazytriton.scaled_dot_product_attention(unknown, unknown, unknown)
    want = lazytriton.scaled_dot_product_attention(*(_nested([values[:5], values[5:]], torch.strided),) * 3)
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), want.unbind(), strict=True))


def test_under_torch_compile_the_nested_call_is_a_graph_break_that_runs_eagerly() -> None:
    leaves = _leaves([5, 3, 7], 2, 48, torch.float32, 40)

    def layer(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in x.chunk(3, -1))
        return lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) * 2.0

    x = torch.nested.as_nested_tensor(leaves, layout=torch.jagged)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")
    assert torch.equal(compiled(x).values(), layer(x).values())
    torch._dynamo.reset()  # the graph-broken frames are cached on layer's code
    whole = torch.compile(layer, backend="eager", fullgraph=True)  # one graph asked for: dynamo says where it breaks
    with pytest.raises(Exception, match=r"torch\.compiler\.disable"):
        whole(x)


def test_dropout_runs_on_nested_inputs_and_zero_dropout_is_the_plain_call() -> None:
    qs = _leaves([6, 4], 2, 16, torch.float32, 13)
    q = _nested(qs, torch.jagged)
    plain = lazytriton.scaled_dot_product_attention(q, q, q)
    torch.manual_seed(3)
    dropped = lazytriton.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(3)
    again = lazytriton.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert all(torch.equal(a, b) for a, b in zip(dropped.unbind(), again.unbind(), strict=True))
    assert any(not torch.allclose(a, b) for a, b in zip(dropped.unbind(), plain.unbind(), strict=True))


@pytest.mark.parametrize(("case", "error", "match"), [
    ("mask", SDPAError, "attn_mask is not supported with nested tensors"),
    ("causal_lengths", SDPAError, "is_causal with nested tensors needs each sequence's query and key lengths"),
    ("empty_sequence", SDPAError, "at least one position .*\"No available kernel\""),  # torch's words, quoted
    ("kv_lengths", SDPAError, "sequence 1 has a key length of 5 and a value length of 3 .*\"No available kernel\""),
    # key's one sequence broadcast to the batch (torch's test_fused_kernels_nested_broadcasting_error_cases)
    ("broadcast_kv_lengths", SDPAError, "sequence 0 has a key length of 1 and a value length of 2"),
    ("heads", SDPAError, "query has 4 heads and key/value 3"),
    ("batch", SDPAError, "key has a batch of 2, which does not broadcast to 3"),
    ("dims", SDPAError, "must be 4-D"),
    ("dropout", SDPAError, "dropout_p"),
    ("causal_type", TypeError, "is_causal"),
    ("value_type", SDPATypeError, "argument 'value' must be Tensor"),
])
def test_misuse_with_nested_inputs_names_the_argument_before_anything_runs(case: str, error: type[Exception],
                                                                           match: str) -> None:
    q = _nested(_leaves([2, 3, 4], 4, 16, torch.float32, 14), torch.strided)
    k = v = _nested(_leaves([2, 3, 4], 4, 16, torch.float32, 15), torch.strided)
    kwargs: dict[str, object] = {}
    if case == "mask":
        kwargs["attn_mask"] = torch.ones(4, 4, dtype=torch.bool)
    elif case == "causal_lengths":
        k = v = _nested(_leaves([2, 5, 4], 4, 16, torch.float32, 15), torch.strided)
        kwargs["is_causal"] = True
    elif case == "empty_sequence":
        k = v = _nested(_leaves([2, 0, 4], 4, 16, torch.float32, 15), torch.strided)
    elif case == "kv_lengths":
        k = _nested(_leaves([2, 5, 4], 4, 16, torch.float32, 15), torch.strided)
    elif case == "broadcast_kv_lengths":
        k = _nested(_leaves([1], 4, 16, torch.float32, 15), torch.strided)
    elif case == "heads":
        k = v = _nested(_leaves([2, 3, 4], 3, 16, torch.float32, 15), torch.strided)
    elif case == "batch":
        k = _nested(_leaves([2, 3], 4, 16, torch.float32, 15), torch.strided)
    elif case == "dims":
        k = v = torch.randn(3, 4, 16)
    elif case == "dropout":
        kwargs["dropout_p"] = 1.5
    elif case == "causal_type":
        kwargs["is_causal"] = "yes"
    elif case == "value_type":
        v = "v"  # type: ignore[assignment]
    with pytest.raises(error, match=match):
        lazytriton.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]


@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_nested_sdpa_against_torchs_fused_backend(layout: torch.layout) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths = [17, 300, 1, 64, 129]
    qs, ks, vs = (_leaves(lengths, 8, 64, torch.float16, seed, "cuda") for seed in (20, 21, 22))
    q, k, v = (_nested(t, layout) for t in (qs, ks, vs))
    ours = lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for i, (a, b) in enumerate(zip(ours.unbind(), theirs.unbind(), strict=True)):
        exact = _sequence_reference(qs[i], ks[i], vs[i], True, torch.float64)
        check_rule(f"out[{i}]", a, exact, b, OUT_FLOOR[torch.float16])
