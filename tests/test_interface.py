"""The public entry points: flash_attn_func, scaled_dot_product_attention, attn_fwd, preload.

Numerics against the float64 reference with FlashAttention's rule (through
``check_attention`` of test_flash_fwd), fake-tensor shapes and strides,
``torch.compile(fullgraph=True)`` and ``torch.export`` on CPU tensors, and bad
input for every argument of every entry point, refused before anything runs.
CUDA graphs and inductor run on the GPU host (marked ``gpu``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_flash_fwd import check_attention, make_qkv, on_gpu
from torch._subclasses.fake_tensor import FakeTensorMode

import lazytriton
from lazytriton import interface, launch, runtime
from lazytriton.kernels.flash_fwd import binding

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


def bshd(t: torch.Tensor) -> torch.Tensor:
    """A (B, H, S, D) tensor's data laid out as FlashAttention's (B, S, H, D), contiguous."""
    return t.transpose(1, 2).contiguous()


# (dtype, head dim, (heads_q, heads_k), (seqlen_q, seqlen_k)): GQA, MQA, unequal and odd lengths, 1.
CASES = [
    (torch.float16, 64, (4, 2), (33, 17)),
    (torch.bfloat16, 40, (3, 1), (17, 65)),
    (torch.float32, 32, (2, 2), (1, 77)),
    (torch.float16, 128, (8, 2), (77, 1)),
    (torch.bfloat16, 16, (2, 1), (64, 64)),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("dtype", "head_dim", "heads", "seqlens"), CASES, ids=str)
def test_flash_attn_func_matches_the_reference(dtype: torch.dtype, head_dim: int, heads: tuple[int, int],
                                               seqlens: tuple[int, int], causal: bool) -> None:
    q, k, v = make_qkv(2, heads, seqlens, head_dim, dtype, seed=sum(seqlens) + head_dim)
    out, lse, probs = lazytriton.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=causal, return_attn_probs=True)
    assert probs is None
    assert out.shape == bshd(q).shape and out.is_contiguous()
    # FlashAttention's causal is bottom-right aligned.
    check_attention(q, k, v, out.transpose(1, 2), lse, causal="bottom_right" if causal else False)
    plain = lazytriton.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=causal)
    assert torch.equal(plain, out)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("dtype", "head_dim", "heads", "seqlens"), CASES, ids=str)
def test_sdpa_matches_the_reference(dtype: torch.dtype, head_dim: int, heads: tuple[int, int],
                                    seqlens: tuple[int, int], is_causal: bool) -> None:
    q, k, v = make_qkv(2, heads, seqlens, head_dim, dtype, seed=3 * sum(seqlens) + head_dim)
    out = lazytriton.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=heads[0] != heads[1])
    # SDPA's causal is top-left aligned; the lse is checked through attn_fwd, which shares the kernel.
    ref_out, ref_lse = lazytriton.attn_fwd(q, k, v, causal=is_causal)
    assert torch.equal(out, ref_out)
    check_attention(q, k, v, out, ref_lse, causal="top_left" if is_causal else False)


def test_noncontiguous_inputs_are_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = make_qkv(1, (4, 2), (20, 30), 32, torch.float16, seed=11)
    # FlashAttention's layout: a (B, S, H, D) view of a bigger buffer, heads sliced.
    qb, kb, vb = (torch.stack([bshd(t), torch.full_like(bshd(t), float("nan"))], dim=3)[:, :, :, 0] for t in (q, k, v))
    assert not qb.is_contiguous()
    seen: list[int] = []
    forward = binding.forward
    monkeypatch.setattr(binding, "forward", lambda q_, k_, v_, call: (seen.append(q_.data_ptr()), forward(
        q_, k_, v_, call))[1])
    out = lazytriton.flash_attn_func(qb, kb, vb, causal=True)
    assert seen == [qb.data_ptr()], "the kernel must read the caller's memory, not a copy"
    check_attention(q, k, v, out.transpose(1, 2), lazytriton.attn_fwd(q, k, v, causal="bottom_right")[1],
                    causal="bottom_right")


def test_sdpa_ranks_and_broadcasting() -> None:
    q, k, v = make_qkv(2, (4, 4), (9, 12), 16, torch.float32, seed=5)
    ref = torch.nn.functional.scaled_dot_product_attention
    # 3 dims (heads, seqlen, head_dim), 5 dims, a key/value batch of 1 and one key/value head.
    for args in [(q[0], k[0], v[0]), (q[None], k[None], v[None]), (q, k[:1], v[:1]), (q, k[:, :1], v[:, :1]),
                 (q[0, 0], k[0, 0], v[0, 0])]:
        out = lazytriton.scaled_dot_product_attention(*args)
        want = ref(*(t.double() for t in args))
        assert out.shape == want.shape
        assert torch.allclose(out.double(), want, atol=1e-5), [tuple(t.shape) for t in args]


@pytest.mark.parametrize("entry", ["attn_fwd", "flash_attn_func", "sdpa"])
def test_fake_tensors_give_exact_shapes_and_strides(entry: str) -> None:
    q, k, v = make_qkv(2, (4, 2), (5, 7), 32, torch.bfloat16, seed=1)
    if entry == "flash_attn_func":
        q, k, v = bshd(q), bshd(k), bshd(v)
    fn = _entry(entry)
    real = fn(q, k, v)
    with FakeTensorMode() as mode:
        fake = fn(*(mode.from_tensor(t) for t in (q, k, v)))
    for r, f in zip(_tensors(real), _tensors(fake), strict=True):
        assert (f.shape, f.stride(), f.dtype, f.device) == (r.shape, r.stride(), r.dtype, r.device)


def _entry(name: str) -> Callable[..., Any]:
    return {"attn_fwd": lambda q, k, v: lazytriton.attn_fwd(q, k, v, causal="bottom_right"),
            "flash_attn_func": lambda q, k, v: lazytriton.flash_attn_func(q, k, v, causal=True,
                                                                          return_attn_probs=True)[:2],
            "sdpa": lambda q, k, v: lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                            enable_gqa=True)}[name]


def _tensors(result: Any) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else list(result)


@pytest.mark.parametrize("entry", ["attn_fwd", "flash_attn_func", "sdpa"])
def test_torch_compile_fullgraph_traces_every_entry_point(entry: str) -> None:
    torch._dynamo.reset()
    q, k, v = make_qkv(1, (4, 2), (17, 9), 16, torch.float32, seed=2)
    if entry == "flash_attn_func":
        q, k, v = bshd(q), bshd(k), bshd(v)
    fn = _entry(entry)

    def model(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        return [t * 2 for t in _tensors(fn(q * 0.5, k, v))]

    graph_breaks: list[Any] = []
    compiled = torch.compile(model, fullgraph=True, backend=_counting_backend(graph_breaks))
    got, want = compiled(q, k, v), model(q, k, v)
    assert len(graph_breaks) == 1, "one graph, no breaks"
    assert "lazytriton.flash_fwd" in str(graph_breaks[0].graph)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _counting_backend(graphs: list[Any]) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd

    inner = aot_autograd(fw_compiler=lambda gm, _: gm)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return inner(gm, example_inputs)

    return backend


def test_torch_compile_aot_eager_backend() -> None:
    torch._dynamo.reset()
    q, k, v = make_qkv(1, (2, 2), (8, 8), 16, torch.float32, seed=3)
    compiled = torch.compile(lambda q, k, v: lazytriton.scaled_dot_product_attention(q, k, v), fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(q, k, v), lazytriton.scaled_dot_product_attention(q, k, v))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = lazytriton.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=True).transpose(1, 2)
        return self.proj(a + b)


def test_torch_export_exports_the_op() -> None:
    q, k, v = make_qkv(1, (4, 2), (8, 8), 16, torch.float32, seed=4)
    model = _Block().eval()
    with torch.no_grad():
        program = torch.export.export(model, (q, k, v))
        assert "torch.ops.lazytriton.flash_fwd.default" in program.graph_module.code
        assert torch.allclose(program.module()(q, k, v), model(q, k, v))


def test_the_direct_path_and_the_op_give_the_same_result() -> None:
    q, k, v = make_qkv(1, (2, 1), (13, 21), 32, torch.bfloat16, seed=9)
    direct = lazytriton.attn_fwd(q, k, v, causal=True)
    with interface.always_through_op():
        through_op = lazytriton.attn_fwd(q, k, v, causal=True)
    for a, b in zip(direct, through_op, strict=True):
        assert torch.equal(a, b)


def test_import_lazytriton_stays_light() -> None:
    code = ("import sys, lazytriton; heavy = [m for m in ('torch', 'triton', 'lazytriton.interface') if m in "
            "sys.modules]; print(heavy); lazytriton.flash_attn_func; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "False"


# ---------------------------------------------------------------------------
# Bad input: every argument of every entry point, refused before anything runs


def _fa(**changes: Any) -> dict[str, Any]:
    q, k, v = (bshd(t) for t in make_qkv(1, (4, 2), (5, 6), 32, torch.float16, seed=7))
    return {"q": q, "k": k, "v": v, **changes}


def _sd(**changes: Any) -> dict[str, Any]:
    q, k, v = make_qkv(1, (4, 2), (5, 6), 32, torch.float16, seed=7)
    return {"query": q, "key": k, "value": v, "enable_gqa": True, **changes}


F16 = torch.float16
FA_BAD: list[tuple[str, Callable[[], dict[str, Any]], type[Exception], str]] = [
    ("q_list", lambda: _fa(q=[1.0]), TypeError, r"\bq\b.*list"),
    ("k_rank3", lambda: _fa(k=torch.randn(1, 6, 32)), ValueError, r"\bk\b.*4 dims \(batch, seqlen, heads"),
    ("v_dtype", lambda: _fa(v=torch.randn(1, 6, 2, 32)), TypeError, r"\bv\b.*float32"),
    ("q_float64", lambda: _fa(q=torch.randn(1, 5, 4, 32, dtype=torch.float64)), TypeError, r"\bq\b.*float64"),
    ("heads", lambda: _fa(q=torch.randn(1, 5, 3, 32).to(F16)), ValueError, r"\bq\b heads \(3\).*\(2\)"),
    ("head_dim", lambda: _fa(k=torch.randn(1, 6, 2, 16).to(F16), v=torch.randn(1, 6, 2, 16).to(F16)), ValueError,
     r"\bk\b has head dim 16"),
    ("last_stride", lambda: _fa(q=torch.randn(1, 5, 4, 64).to(F16)[..., ::2]), ValueError, r"\bq\b.*stride"),
    ("dropout_p", lambda: _fa(dropout_p=1.0), ValueError, r"dropout_p.*\[0, 1\).*1\.0"),
    ("dropout_p_range", lambda: _fa(dropout_p=1.5), ValueError, r"dropout_p.*\[0, 1\)"),
    ("dropout_p_type", lambda: _fa(dropout_p="0"), TypeError, r"dropout_p.*str"),
    ("softmax_scale", lambda: _fa(softmax_scale="x"), TypeError, r"softmax_scale.*str"),
    ("softmax_scale_nan", lambda: _fa(softmax_scale=float("nan")), ValueError, r"softmax_scale.*nan"),
    ("causal", lambda: _fa(causal="bottom_right"), TypeError, r"causal.*bool"),
    ("window_size", lambda: _fa(window_size=(-2, 0)), ValueError, r"window_size.*-1 \(unbounded\).*\(-2, 0\)"),
    ("window_size_bool", lambda: _fa(window_size=(True, 0)), TypeError, r"window_size.*pair of ints"),
    ("window_size_type", lambda: _fa(window_size=4), TypeError, r"window_size.*pair"),
    ("softcap", lambda: _fa(softcap=-30.0), ValueError, r"softcap.*>= 0.*-30\.0"),
    ("softcap_nan", lambda: _fa(softcap=float("nan")), ValueError, r"softcap.*finite"),
    ("softcap_type", lambda: _fa(softcap=None), TypeError, r"softcap.*NoneType"),
    ("alibi_slopes", lambda: _fa(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape"),
    ("deterministic", lambda: _fa(deterministic="yes"), TypeError, r"deterministic.*str"),
    ("return_attn_probs", lambda: _fa(return_attn_probs=1), TypeError, r"return_attn_probs.*int"),
]

SDPA_BAD: list[tuple[str, Callable[[], dict[str, Any]], type[Exception], str]] = [
    ("query_list", lambda: _sd(query=[1.0]), TypeError, r"'query'.*list"),
    ("key_rank1", lambda: _sd(key=torch.randn(6).to(F16)), ValueError, r"\bkey\b.*at least 2 dims"),
    ("value_dtype", lambda: _sd(value=torch.randn(1, 2, 6, 32)), TypeError, r"\bvalue\b.*float32"),
    ("query_float64", lambda: _sd(query=torch.randn(1, 4, 5, 32, dtype=torch.float64)), TypeError,
     r"\bquery\b.*float64"),
    ("gqa_without_flag", lambda: _sd(enable_gqa=False), RuntimeError, r"enable_gqa=True"),
    ("gqa_not_dividing", lambda: _sd(query=torch.randn(1, 3, 5, 32).to(F16)), ValueError, r"must divide"),
    ("kv_heads", lambda: _sd(value=torch.randn(1, 1, 6, 32).to(F16)), ValueError, r"key has 2 heads.*value has 1"),
    ("kv_seqlen", lambda: _sd(value=torch.randn(1, 2, 7, 32).to(F16)), ValueError, r"\bkey\b and \bvalue\b"),
    ("head_dim_v", lambda: _sd(value=torch.randn(1, 2, 6, 300).to(F16)), ValueError,
     r"value's head dim \(value.shape\[-1\]\) must be in 1..256, got 300"),
    ("batch", lambda: _sd(query=torch.randn(2, 4, 5, 32).to(F16), key=torch.randn(3, 2, 6, 32).to(F16)), ValueError,
     r"do not broadcast"),
    ("attn_mask", lambda: _sd(attn_mask=torch.ones(5, 7, dtype=torch.bool)), ValueError, r"attn_mask.*broadcast"),
    ("dropout_p", lambda: _sd(dropout_p=1.0), ValueError, r"dropout_p.*\[0, 1\)"),
    ("dropout_p_range", lambda: _sd(dropout_p=-0.1), ValueError, r"dropout_p.*\[0, 1\)"),
    ("is_causal", lambda: _sd(is_causal="yes"), TypeError, r"is_causal.*str"),
    ("scale", lambda: _sd(scale="x"), TypeError, r"\bscale\b.*str"),
    ("scale_inf", lambda: _sd(scale=float("inf")), ValueError, r"\bscale\b.*inf"),
    ("enable_gqa", lambda: _sd(enable_gqa=None), TypeError, r"enable_gqa.*NoneType"),
]


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(("make", "error", "match"), [c[1:] for c in FA_BAD], ids=[c[0] for c in FA_BAD])
def test_flash_attn_func_bad_input(make: Callable[[], dict[str, Any]], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_func(**make())


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(("make", "error", "match"), [c[1:] for c in SDPA_BAD], ids=[c[0] for c in SDPA_BAD])
def test_sdpa_bad_input(make: Callable[[], dict[str, Any]], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as raised:
        lazytriton.scaled_dot_product_attention(**make())
    if error is ValueError or "dtype" in match or "float" in match:
        # Torch raises RuntimeError for the same misuse: so do we, as well.
        assert isinstance(raised.value, RuntimeError)


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(("args", "error", "match"), [
    ({"q": (1, 2, 3), "k": (1, 2, 3, 4)}, TypeError, r"\bq\b.*shape of 4"),
    ({"q": (1, 2, 3, 4), "k": "x"}, TypeError, r"\bk\b.*shape of 4"),
    ({"q": (1, 2, 3, 4), "k": (1, 2, 3, 4), "layout": "sbhd"}, ValueError, r"layout.*'sbhd'"),
    ({"q": (1, 2, 3, 4), "k": (1, 2, 3, 4), "device": "cpu"}, ValueError, r"device.*cpu"),
    ({"q": (1, 2, 3, 4), "k": (1, 2, 3, 4), "causal": "yes", "device": "cuda:0"}, ValueError, r"causal.*'yes'"),
    ({"q": (1, 3, 3, 4), "k": (1, 2, 3, 4), "device": "cuda:0"}, ValueError, r"heads"),
], ids=["q", "k", "layout", "device", "causal", "heads"])
def test_preload_bad_input(args: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        lazytriton.preload(**args)


# ---------------------------------------------------------------------------
# On a GPU: CUDA graphs, inductor, reduce-overhead


def check_replay(graph: torch.cuda.CUDAGraph, static: Sequence[torch.Tensor], fresh: Sequence[torch.Tensor],
                 out: torch.Tensor, out_only: torch.Tensor) -> None:
    """``fresh`` q, k and v copied into the captured ``static`` ones, then ``graph`` replayed: what it captured,
    attn_fwd's ``out`` (causal) and the SDPA drop-in's ``out_only`` (causal, GQA), equals the eager calls' on
    ``fresh`` bit for bit."""
    for s, f in zip(static, fresh, strict=True):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lazytriton.attn_fwd(*fresh, causal=True)[0])
    assert torch.equal(out_only, lazytriton.scaled_dot_product_attention(*fresh, is_causal=True, enable_gqa=True))


@on_gpu
def test_gpu_cuda_graph_capture_and_replay() -> None:
    q, k, v = make_qkv(2, (8, 2), (300, 257), 64, torch.bfloat16, device="cuda", seed=21)
    lazytriton.preload(q, k, causal=True)
    static = [t.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lazytriton.attn_fwd(*static, causal=True)  # warm on the capture stream
        with torch.cuda.graph(graph):
            out1, _ = lazytriton.attn_fwd(*static, causal=True)
            out2 = lazytriton.scaled_dot_product_attention(*static, is_causal=True, enable_gqa=True)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        check_replay(graph, static, make_qkv(2, (8, 2), (300, 257), 64, torch.bfloat16, device="cuda", seed=seed),
                     out1, out2)


@on_gpu
def test_gpu_capture_of_an_unloaded_kernel_raises_clearly() -> None:
    runtime.reset()
    q, k, v = make_qkv(1, (2, 2), (3000, 3000), 32, torch.float16, device="cuda", seed=3)  # a bucket no test loads
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(launch.CaptureError, match=r"lazytriton\.preload"):
        with torch.cuda.graph(graph):
            lazytriton.attn_fwd(q, k, v)
    torch.cuda.synchronize()
    lazytriton.preload(q, k)
    graph = torch.cuda.CUDAGraph()  # a graph whose capture failed cannot capture again
    with torch.cuda.graph(graph):
        out, _ = lazytriton.attn_fwd(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lazytriton.attn_fwd(q, k, v)[0])


@on_gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_inductor(mode: str | None) -> None:
    torch._dynamo.reset()
    q, k, v = make_qkv(2, (4, 2), (256, 256), 16, torch.float16, device="cuda", seed=8)
    model = _Block().cuda().half().eval()
    lazytriton.preload(q, k, causal=True)
    lazytriton.preload(bshd(q), bshd(k), causal="bottom_right", layout="bshd")
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with torch.no_grad():
        for _ in range(3):
            got = compiled(q, k, v)
        want = model(q, k, v)
    assert torch.allclose(got.float(), want.float(), atol=2e-3, rtol=2e-3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=1, max_size=4))
def test_sdpa_broadcast_shapes_is_torchs(shapes: list[list[int]]) -> None:
    """The drop-in's own broadcast of concrete sizes gives torch.broadcast_shapes' answer, or None where torch
    raises."""
    from lazytriton import sdpa

    try:
        want: tuple[int, ...] | None = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        want = None
    assert sdpa.broadcast_shapes(*(tuple(s) for s in shapes)) == want
