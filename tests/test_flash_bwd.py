"""Tests of the backward (kernels/flash_bwd): numerics, autograd on every entry point, determinism, training.

Numerics follow FlashAttention's rule for gradients: the error of each of
dq, dk, dv against a float64 reference may be at most twice the error of the
same-dtype PyTorch reference (autograd through ``attention_reference`` on the
inputs as given) against that float64 reference, plus a small floor. On CPU
the kernels run through Triton's interpreter, over the forward's covering
design (``test_flash_fwd.cpu_matrix``: every head dim x causal mode pair,
dtypes, GQA ratios and unequal/odd seqlens including 1 rotated around them).
Fresh random inputs and a random dO for every case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import recording_backend
from test_flash_fwd import Case, cpu_matrix, expected_empty_rows, make_qkv, on_gpu, randn, seed_of

import lazytriton
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_bwd.reference import attention_backward_reference
from lazytriton.kernels.flash_fwd import binding
from lazytriton.kernels.flash_fwd.reference import attention_reference

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

# Floors on max |error|, added to 2x the same-dtype reference's error, relative
# to max(1, max |reference gradient|): one unit of rounding of the dtype (fp16
# 2**-10, bf16 2**-7) for a gradient rounded once to it, twice that since the
# gradients sum two rounded products (dS K, P^T dO). fp32: 1e-4, ten times the
# forward's, because dS = P * (dP - delta) cancels: dP and delta are of order
# sqrt(head_dim) and their difference may be exactly 0 (a row that sees one
# key: its dS is 0 in exact arithmetic), so float32 rounding of the two (1e-7 x 16
# at head dim 256) summed over a few hundred query rows leaves ~1e-5 (the kernels'
# own dk: 1.4e-5 at head dim 256, 77 queries x 4 heads, one key each; a call whose
# every row sees one key gets exact zeros, tests/test_bwd_one_key.py). Half
# precision would miss by 10x.
GRAD_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}


def grads_of(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             do: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of ``fn(q, k, v)`` for the output gradient ``do``, through autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, do)


def check_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, got: tuple[torch.Tensor, ...],
                causal: bool | str = False, sm_scale: float | None = None) -> None:
    """Assert FlashAttention's rule for (dq, dk, dv), and zero gradients where no key/query is seen."""
    def ref(*t: torch.Tensor) -> torch.Tensor:
        return attention_reference(*t, causal=causal, sm_scale=sm_scale)[0]

    exact = grads_of(ref, q.double(), k.double(), v.double(), do.double())
    same = grads_of(ref, q, k, v, do)
    for name, g, r, s, x in zip(("dq", "dk", "dv"), got, exact, same, (q, k, v), strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype and g.device == x.device, name
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
        if not g.numel():
            continue
        err = float((g.double() - r).abs().max())
        same_err = float((s.double() - r).abs().max())
        floor = GRAD_FLOOR[q.dtype] * max(1.0, float(r.abs().max()))
        assert err <= 2 * same_err + floor, (
            f"{name}: max error {err:.3g} > 2 x same-dtype's {same_err:.3g} + {floor:.3g}")
    sq, sk = q.shape[2], k.shape[2]
    empty = expected_empty_rows(sq, sk, causal)
    assert (got[0][:, :, :empty] == 0).all(), "a query row that sees no key must get dq exactly 0"
    if causal and causal != "bottom_right" and sk > sq:  # top-left: keys past the last query are seen by none
        assert (got[1][:, :, sq:] == 0).all() and (got[2][:, :, sq:] == 0).all()


def _lt(causal: bool | str, sm_scale: float | None = None) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: lazytriton.attn_fwd(q, k, v, causal=causal, sm_scale=sm_scale)[0]


def case_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    q, k, v = make_qkv(case.batch, case.heads, case.seqlens, case.head_dim, case.dtype, seed=seed_of(case))
    gen = torch.Generator().manual_seed(seed_of(case, "do"))
    return q, k, v, randn(tuple(q.shape), case.dtype, "cpu", gen)


# ---------------------------------------------------------------------------
# Numerics on CPU, through Triton's interpreter


@pytest.mark.parametrize("case", cpu_matrix(), ids=str)
def test_gradients_cpu(case: Case) -> None:
    q, k, v, do = case_inputs(case)
    check_grads(q, k, v, do, grads_of(_lt(case.causal), q, k, v, do), causal=case.causal)


@pytest.mark.parametrize(("head_dim", "dtype", "causal"), [(1, torch.float32, "bottom_right"),
                                                           (3, torch.float16, False), (8, torch.bfloat16, True)])
def test_gradients_at_head_dims_below_the_covering_designs(head_dim: int, dtype: torch.dtype,
                                                           causal: bool | str) -> None:
    q, k, v = make_qkv(2, (4, 2), (9, 14), head_dim, dtype, seed=head_dim)
    do = torch.randn(q.shape).to(dtype)
    check_grads(q, k, v, do, grads_of(_lt(causal), q, k, v, do), causal=causal)


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_reference_twin_is_autograd_of_the_forward_reference(causal: bool | str) -> None:
    q, k, v = make_qkv(2, (4, 2), (9, 13), 8, torch.float64, seed=5)
    do = torch.randn_like(q)
    twin = attention_backward_reference(q, k, v, do, causal=causal, sm_scale=0.3)
    auto = grads_of(lambda *t: attention_reference(*t, causal=causal, sm_scale=0.3)[0], q, k, v, do)
    for a, b in zip(twin, auto, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_custom_scale_and_noncontiguous_inputs() -> None:
    q, k, v = make_qkv(1, (4, 2), (21, 34), 32, torch.float32, seed=6)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # (b, s, h, d) memory
    assert not qt.is_contiguous()
    do = torch.randn(q.shape)[..., :].transpose(1, 2).contiguous().transpose(1, 2)
    check_grads(q, k, v, do, grads_of(_lt("bottom_right", 0.37), qt, kt, vt, do), causal="bottom_right",
                sm_scale=0.37)


def test_any_subset_of_inputs_gets_gradients() -> None:
    q, k, v = make_qkv(1, (2, 1), (12, 20), 16, torch.float32, seed=7)
    full = grads_of(_lt(True), q, k, v, torch.ones_like(q))
    for which in range(3):
        leaves = [t.clone().requires_grad_(i == which) for i, t in enumerate((q, k, v))]
        lazytriton.attn_fwd(*leaves, causal=True)[0].sum().backward()
        for i, leaf in enumerate(leaves):
            assert (leaf.grad is not None) == (i == which)
        assert torch.equal(leaves[which].grad, full[which])


def test_the_logsumexp_carries_no_gradient() -> None:
    q, k, v = (t.requires_grad_() for t in make_qkv(1, (2, 2), (5, 5), 8, torch.float32, seed=8))
    out, lse = lazytriton.attn_fwd(q, k, v)
    assert out.requires_grad and not lse.requires_grad


def test_empty_sequences_give_zero_gradients() -> None:
    for sq, sk in ((0, 5), (5, 0)):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, (2, 2), (sq, sk), 8, torch.float32, seed=9))
        out, _ = lazytriton.attn_fwd(q, k, v)
        out.sum().backward()
        for t in (q, k, v):
            assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


def test_gradcheck_float32() -> None:
    q, k, v = (t.requires_grad_() for t in make_qkv(1, (2, 1), (3, 5), 3, torch.float32, seed=10))
    for causal in (False, "top_left", "bottom_right"):
        assert torch.autograd.gradcheck(_lt(causal, 0.5), (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_deterministic_gradients_are_bitwise_equal() -> None:
    q, k, v = make_qkv(2, (4, 2), (37, 45), 32, torch.bfloat16, seed=11)
    do = torch.randn(q.shape).to(torch.bfloat16)
    first = grads_of(_lt("bottom_right"), q, k, v, do)
    second = grads_of(_lt("bottom_right"), q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


# ---------------------------------------------------------------------------
# Every entry point is differentiable


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


ENTRIES: dict[str, Callable[..., torch.Tensor]] = {
    "attn_fwd": lambda q, k, v: lazytriton.attn_fwd(q, k, v, causal="bottom_right")[0],
    "flash_attn_func": lambda q, k, v: _bshd(lazytriton.flash_attn_func(_bshd(q), _bshd(k), _bshd(v), causal=True)),
    "sdpa": lambda q, k, v: lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
}
CAUSAL_OF = {"attn_fwd": "bottom_right", "flash_attn_func": "bottom_right", "sdpa": "top_left"}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_entry_point_is_differentiable(entry: str) -> None:
    q, k, v = make_qkv(2, (4, 2), (19, 11), 16, torch.float16, seed=12)
    do = torch.randn(q.shape).half()
    check_grads(q, k, v, do, grads_of(ENTRIES[entry], q, k, v, do), causal=CAUSAL_OF[entry])


def test_sdpa_broadcast_batch_and_heads_sum_their_gradients() -> None:
    q = torch.randn(2, 3, 4, 9, 8, requires_grad=True)
    k = torch.randn(3, 1, 6, 8, requires_grad=True)  # batch dim broadcast over 2, one head for four
    v = torch.randn(3, 1, 6, 8, requires_grad=True)
    lazytriton.scaled_dot_product_attention(q, k, v).pow(2).sum().backward()
    got = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.nn.functional.scaled_dot_product_attention(q, k, v).pow(2).sum().backward()
    for g, t in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_torch_compile_traces_forward_and_backward_in_one_graph(entry: str) -> None:
    torch._dynamo.reset()
    q, k, v = make_qkv(1, (4, 2), (13, 9), 16, torch.float32, seed=13)
    do = torch.randn(q.shape)
    fn = ENTRIES[entry]
    graphs: list[str] = []
    backend = recording_backend(graphs)

    compiled = torch.compile(lambda q, k, v: fn(q * 2, k, v) * 3, fullgraph=True, backend=backend)
    got = grads_of(compiled, q, k, v, do)
    want = grads_of(lambda q, k, v: fn(q * 2, k, v) * 3, q, k, v, do)
    assert len(graphs) == 2, "one forward graph and one backward graph"
    assert "lazytriton.flash_fwd" in graphs[0] and "lazytriton.flash_bwd" in graphs[1]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


# ---------------------------------------------------------------------------
# Training: a two-layer attention model tracks the same model on SDPA


class TwoLayerAttention(torch.nn.Module):
    def __init__(self, attention: Callable[..., torch.Tensor], dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attention, self.heads = attention, heads
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(2))
        self.outs = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        for qkv, out in zip(self.layers, self.outs, strict=True):
            q, k, v = qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            x = x + out(self.attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, dim))
        return x


def test_training_tracks_sdpa_loss_by_loss() -> None:
    torch.manual_seed(14)
    ours = TwoLayerAttention(lazytriton.scaled_dot_product_attention)
    theirs = TwoLayerAttention(torch.nn.functional.scaled_dot_product_attention)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 24, 32)
    target = x.roll(1, dims=1) * 0.5  # learnable: each token's target is half the previous token
    losses: dict[str, list[float]] = {"ours": [], "theirs": []}
    for name, model in (("ours", ours), ("theirs", theirs)):
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        for _ in range(20):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["ours"][-1] < 0.95 * losses["ours"][0], "the model trains"
    for step, (a, b) in enumerate(zip(losses["ours"], losses["theirs"], strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: loss {a} vs SDPA's {b}"
    for p, r in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Bad input


def _bwd_args(**changes: Any) -> tuple[Any, ...]:
    q, k, v = make_qkv(1, (2, 2), (6, 6), 8, torch.float16, seed=15)
    out, lse = torch.randn_like(q), torch.randn(1, 2, 6)  # the forward's forms (no launch under no_launch)
    args = {"do": torch.randn_like(out), "q": q, "k": k, "v": v, "out": out, "lse": lse}
    args.update({name: make(args) for name, make in changes.items()})
    return tuple(args.values())


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(("changes", "error", "match"), [
    ({"do": lambda a: a["do"][:, :, :5]}, ValueError, r"do must have the output's shape"),
    ({"do": lambda a: a["do"].float()}, TypeError, r"do has dtype torch.float32 but q has torch.float16"),
    ({"do": lambda a: a["do"].to("meta")}, ValueError, r"do is on meta but q is on cpu"),
    ({"do": lambda a: a["do"].transpose(-1, -2).contiguous().transpose(-1, -2)}, None, None),  # copied, then fine
    ({"do": lambda a: "grad"}, TypeError, r"do must be a torch.Tensor"),
    ({"out": lambda a: a["out"][:1, :1]}, ValueError, r"out must have the output's shape"),
    ({"lse": lambda a: a["lse"].double()}, ValueError, r"lse must be the forward's float32"),
    ({"lse": lambda a: a["lse"][:, :, :3]}, ValueError, r"lse must be the forward's float32"),
], ids=["do-shape", "do-dtype", "do-device", "do-strided", "do-type", "out-shape", "lse-dtype", "lse-shape"])
def test_bad_gradient_input_is_refused_before_any_launch(changes: dict[str, Any], error: type[Exception] | None,
                                                         match: str | None) -> None:
    args = _bwd_args(**changes)
    q, k, v = args[1:4]
    call = binding.check(q, k, v, False, None)
    if error is None:
        bwd_binding.check_grad(q, args[4], args[5], args[0].contiguous(), call)
        return
    with pytest.raises(error, match=match):
        bwd_binding.check_grad(q, args[4], args[5], args[0], call)


def test_the_backward_op_refuses_a_wrong_do() -> None:
    from lazytriton.ops import flash_bwd_op

    do, q, k, v, out, lse = _bwd_args(do=lambda a: a["do"][:, :1])
    with pytest.raises(ValueError, match="do must have the output's shape"):
        flash_bwd_op(do, q, k, v, out, lse, 0.5, "none")


def test_pack_covers_every_parameter_of_both_kernels() -> None:
    from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ

    do, q, k, v, out, lse = _bwd_args()
    call = binding.check(q, k, v, "bottom_right", 0.5)
    grads = bwd_binding.empty_grads(q, k, v)
    delta = torch.empty_like(lse)
    dq_ints, dkdv_ints, aligned, seq16, index64 = bwd_binding.pack(q, k, v, out, do, lse, delta, *grads, call)
    for spec, ints in ((FLASH_BWD_DQ, dq_ints), (FLASH_BWD_DKDV, dkdv_ints)):
        names = [name for name, kind in spec.params if not kind.startswith("fp")]
        assert len(ints) == len(names)
        values = dict(zip(names, ints, strict=True))
        assert values["Q"] == q.data_ptr() and values["Lse"] == lse.data_ptr() and values["Delta"] == delta.data_ptr()
        assert values["causal_offset"] == 0 and values["seqlen_k"] == 6 and values["group_size"] == 1
        assert values["stride_qs"] == q.stride(2) and values["stride_lh"] == 6
    assert index64 is False and isinstance(aligned, bool) and seq16 is False  # seqlen 6


# ---------------------------------------------------------------------------
# On the GPU


@on_gpu
@pytest.mark.parametrize(("heads", "seqlens", "dtype", "causal"), [
    ((16, 16), (4096, 4096), torch.bfloat16, "top_left"),
    ((16, 2), (4096, 4096), torch.float16, False),
    ((8, 1), (1000, 4099), torch.bfloat16, "bottom_right"),
    ((6, 3), (4099, 1000), torch.float16, "bottom_right"),
    ((4, 2), (777, 333), torch.float32, True),
])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_gpu_gradients(heads: tuple[int, int], seqlens: tuple[int, int], dtype: torch.dtype, causal: bool | str,
                       head_dim: int) -> None:
    q, k, v = make_qkv(1, heads, seqlens, head_dim, dtype, device="cuda", seed=seed_of(heads, seqlens, head_dim))
    do = torch.randn(q.shape, device="cuda").to(dtype)
    check_grads(q, k, v, do, grads_of(_lt(causal), q, k, v, do), causal=causal)


@on_gpu
@pytest.mark.parametrize("head_dim", [16, 256])
def test_gpu_gradients_small_and_large_head_dims(head_dim: int) -> None:
    q, k, v = make_qkv(2, (4, 2), (300, 257), head_dim, torch.bfloat16, device="cuda", seed=head_dim)
    do = torch.randn(q.shape, device="cuda").bfloat16()
    check_grads(q, k, v, do, grads_of(_lt("bottom_right"), q, k, v, do), causal="bottom_right")


@on_gpu
def test_gpu_deterministic_gradients_are_bitwise_equal() -> None:
    q, k, v = make_qkv(2, (16, 2), (2048, 2048), 128, torch.bfloat16, device="cuda", seed=16)
    do = torch.randn(q.shape, device="cuda").bfloat16()
    runs = [grads_of(_lt(True), q, k, v, do) for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@on_gpu
def test_gpu_backward_in_a_cuda_graph() -> None:
    q, k, v = (t.requires_grad_() for t in make_qkv(1, (4, 2), (512, 512), 64, torch.float16, device="cuda",
                                                      seed=17))
    do = torch.randn(q.shape, device="cuda").half()
    lazytriton.preload(q, k, causal=True, backward=True)
    want = grads_of(_lt(True), q, k, v, do)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = torch.autograd.grad(lazytriton.attn_fwd(q, k, v, causal=True)[0], (q, k, v), do)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@on_gpu
def test_gpu_inductor_forward_and_backward() -> None:
    torch._dynamo.reset()
    q, k, v = make_qkv(2, (8, 2), (256, 256), 64, torch.bfloat16, device="cuda", seed=18)
    do = torch.randn(q.shape, device="cuda").bfloat16()
    fn = ENTRIES["sdpa"]
    compiled = torch.compile(lambda q, k, v: fn(q * 2, k, v) * 3, fullgraph=True)
    got = grads_of(compiled, q, k, v, do)
    want = grads_of(lambda q, k, v: fn(q * 2, k, v) * 3, q, k, v, do)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("seqlen", "seq16"), [(100, False), (128, True)])
def test_preload_backward_loads_the_variants_a_backward_will_use(monkeypatch: pytest.MonkeyPatch, seqlen: int,
                                                                 seq16: bool) -> None:
    """The backward's SEQ16 needs seqlens divisible by 16, its ALIGN16 not: preload asks for what the call will pick."""
    asked: list[tuple[bool, bool, bool, bool]] = []
    monkeypatch.setattr(binding, "preload", lambda *args: "flash_fwd:...")
    monkeypatch.setattr(bwd_binding, "preload",
                        lambda device, dtype, call, al, i64, s16, det, bias_grad=False:
                        asked.append((al, i64, s16, det)) or ())
    lazytriton.preload((1, 2, seqlen, 64), (1, 2, seqlen, 64), device="cuda:0", backward=True)
    assert asked == [(True, False, seq16, False)]  # not deterministic unless asked (test_fused_bwd.py)
