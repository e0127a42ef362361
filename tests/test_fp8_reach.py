"""The FP8 forward's reach: its torch ops under torch.compile, CUDA graphs, out=, SDPA, preload and prewarm's misses.

CPU tests trace and run the ops through Triton's interpreter (small shapes);
the GPU tests (marked) capture the FP8 forward in a CUDA graph and compile it
with inductor. Numerics are tests/test_fp8_fwd.py's: here each path is held
to the eager call's bits.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpu
from torch._subclasses.fake_tensor import FakeTensorMode

import lazytriton
from lazytriton import launch, runtime
from lazytriton.cli import main as cli_main
from lazytriton.kernels import dispatch
from lazytriton.prewarm.enumeration import variants_from_misses
from lazytriton.sdpa import FP8_WARNING, SDPAError
from lazytriton.target import Target

E4M3 = torch.float8_e4m3fn


def fp8(*shape: int, seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device).to(E4M3)


def scales(b: int, hk: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.rand(b, hk, generator=gen) * 2 + 0.05).to(device) for _ in range(3))


def _graphs_backend(graphs: list[str]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(str(gm.graph))
        return gm

    return backend


def _dense_entry(name: str) -> Callable[..., torch.Tensor]:
    if name == "attn_fwd":
        return lambda q, k, v, s: lazytriton.attn_fwd(q, k, v, causal="bottom_right", q_descale=s[0], k_descale=s[1],
                                                      v_descale=s[2])[0]
    # flash_attn_func takes (B, S, H, D): the same tensors transposed
    return lambda q, k, v, s: lazytriton.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, q_descale=s[0], k_descale=s[1],
        v_descale=s[2]).transpose(1, 2)


@pytest.mark.parametrize("entry", ["attn_fwd", "flash_attn_func"])
def test_torch_compile_fullgraph_one_graph_through_the_op(entry: str) -> None:
    torch._dynamo.reset()
    q, k, v = fp8(1, 4, 20, 32, seed=1), fp8(1, 2, 36, 32, seed=2), fp8(1, 2, 36, 32, seed=3)
    s = scales(1, 2, seed=4)
    fn = _dense_entry(entry)

    def model(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *s: torch.Tensor) -> torch.Tensor:
        return fn(q, k, v, s) * 2

    graphs: list[str] = []
    got = torch.compile(model, fullgraph=True, backend=_graphs_backend(graphs))(q, k, v, *s)
    assert len(graphs) == 1 and "lazytriton.flash_fwd_fp8" in graphs[0]
    assert got.dtype == torch.bfloat16 and torch.equal(got, model(q, k, v, *s))


def _packed(lens_q: list[int], lens_k: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = fp8(sum(lens_q), 2, 32, seed=seed), fp8(sum(lens_k), 1, 32, seed=seed + 1), fp8(sum(lens_k), 1, 32,
                                                                                             seed=seed + 2)
    return q, k, v, cu_q, cu_k


def test_varlen_under_torch_compile_with_seqused_and_out() -> None:
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _packed([9, 30, 0], [20, 33, 5], seed=5)
    used_k = torch.tensor([20, 17, 5], dtype=torch.int32)
    s = scales(3, 1, seed=6)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 33, causal=True, seqused_k=used_k, out=out,
                                          q_descale=s[0], k_descale=s[1], v_descale=s[2])
        return out * 2

    graphs: list[str] = []
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    got = torch.compile(fn, fullgraph=True, backend=_graphs_backend(graphs))(q, k, v, out)
    assert len(graphs) == 1 and "lazytriton.flash_varlen_fwd_fp8" in graphs[0]
    eager_out = torch.empty_like(out)
    assert torch.equal(got, fn(q, k, v, eager_out)) and torch.equal(out, eager_out)


def test_the_fakes_give_the_real_shapes_dtypes_and_strides() -> None:
    q, k, v = fp8(2, 36, 4, 32, seed=7), fp8(2, 20, 2, 32, seed=8), fp8(2, 20, 2, 16, seed=9)  # head_dim_v 16
    packed = _packed([9, 30], [20, 33], seed=10)

    def calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pq: torch.Tensor, pk: torch.Tensor,
              pv: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[torch.Tensor]:
        dense = lazytriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
        varlen = lazytriton.flash_attn_varlen_func(pq, pk, pv, cu_q, cu_k, 30, 33, return_attn_probs=True)[:2]
        return [*dense, *varlen]

    real = calls(q, k, v, *packed)
    with FakeTensorMode() as mode:
        fake = calls(*(mode.from_tensor(t) for t in (q, k, v, *packed)))
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype, f.device) == (r.shape, r.stride(), r.dtype, r.device)


def test_the_op_called_directly_checks_its_arguments() -> None:
    q = fp8(1, 2, 16, 32, seed=11)
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, heads_k\) = \(1, 2\)"):
        torch.ops.lazytriton.flash_fwd_fp8(q, q, q, torch.ones(3, 2), None, None, 0.125, "none")
    with pytest.raises(TypeError, match="q must be float8_e4m3fn or float8_e5m2, got torch.bfloat16"):
        torch.ops.lazytriton.flash_fwd_fp8(*(q.to(torch.bfloat16),) * 3, None, None, None, 0.125, "none")


def test_varlen_out_is_bf16_for_fp8_inputs() -> None:
    q, k, v, cu_q, cu_k = _packed([12, 7], [12, 20], seed=12)
    want = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 20, causal=True)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    got = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 20, causal=True, out=out)
    assert got is out and torch.equal(out, want)
    for dtype in (torch.float16, E4M3):  # FlashAttention-3 takes no other output dtype for FP8 inputs
        with pytest.raises(TypeError, match=r"out must be torch.bfloat16 on cpu \(the FP8 forward's output"):
            lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 20, out=torch.empty(q.shape, dtype=dtype))


# ---------------------------------------------------------------------------
# SDPA: torch's FlashAttention-3 route runs float8 inputs with every descale 1.0, and warns


def test_sdpa_runs_fp8_with_descales_of_one_and_warns() -> None:
    q, k, v = fp8(2, 4, 24, 32, seed=13), fp8(2, 2, 40, 32, seed=14), fp8(2, 2, 40, 32, seed=15)
    with pytest.warns(UserWarning, match="every descale 1.0") as caught:
        got = lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert str(caught[0].message) == FP8_WARNING and caught[0].filename == __file__
    want = lazytriton.attn_fwd(q, k, v, causal=True)[0]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    ones = torch.ones(())
    assert torch.equal(got, lazytriton.attn_fwd(q, k, v, causal=True, q_descale=ones, k_descale=ones,
                                                v_descale=ones)[0])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"attn_mask": torch.ones(24, 40, dtype=torch.bool)}, "attn_mask is not taken with float8_e4m3fn"),
    ({"dropout_p": 0.1}, "dropout_p is not taken"),
    ({"enable_gqa": False}, "for grouped-query attention pass enable_gqa=True")])
def test_sdpa_fp8_refusals_are_sdpa_errors(kwargs: dict[str, Any], match: str) -> None:
    q, k = fp8(1, 4, 24, 32, seed=16), fp8(1, 2, 40, 32, seed=17)
    kwargs = {"enable_gqa": True, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused call warns of nothing
        with pytest.raises(SDPAError, match=match):
            lazytriton.scaled_dot_product_attention(q, k, k, **kwargs)


def test_sdpa_fp8_under_torch_compile() -> None:
    torch._dynamo.reset()
    q, k, v = fp8(1, 2, 24, 32, seed=18), fp8(1, 2, 24, 32, seed=19), fp8(1, 2, 24, 32, seed=20)
    graphs: list[str] = []
    fn = torch.compile(lambda q, k, v: lazytriton.scaled_dot_product_attention(q, k, v) + 1, fullgraph=True,
                       backend=_graphs_backend(graphs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = lazytriton.scaled_dot_product_attention(q, k, v) + 1
    assert torch.equal(fn(q, k, v), want) and len(graphs) == 1


# ---------------------------------------------------------------------------
# preload and prewarm


def test_preload_refuses_what_the_fp8_forward_does_not_take() -> None:
    shape = (1, 64, 2, 64)
    with pytest.raises(ValueError, match="backward=True: the FP8 forward"):
        lazytriton.preload(shape, shape, dtype=E4M3, device="cuda:0", backward=True)


def _misses(tmp_path: Path) -> Path:
    fp8_90 = dispatch.kernel_variant("flash_fwd", Target.parse("sm_90"), "e4m3", 128, True, True, 4096, 4096)
    bf16_80 = dispatch.kernel_variant("flash_fwd", Target.parse("sm_80"), "bf16", 128, True, True, 4096, 4096)
    lines = [str(fp8_90).replace("sm_90", target) for target in ("sm_80", "gfx942")] + [str(fp8_90), str(bf16_80)]
    path = tmp_path / "misses.jsonl"
    path.write_text("".join(json.dumps({"variant": line}) + "\n" for line in lines))
    return path


def test_misses_naming_fp8_for_a_target_without_fp8_tensor_cores_are_refused(tmp_path: Path) -> None:
    path = _misses(tmp_path)
    plan, problems = variants_from_misses(path.read_text().splitlines(), "m.jsonl")
    assert [(p.variant.kernel, p.variant.target) for p in plan] == [("flash_fwd_fp8", "sm_90"), ("flash_fwd", "sm_80")]
    assert problems[0].startswith("m.jsonl:1: refused flash_fwd_fp8:sm_80:e4m3:")
    assert problems[0].endswith("sm_80 has no FP8 tensor cores (the FP8 forward needs sm_90 or later: Hopper's FP8 "
                                "wgmma)")
    assert problems[1].startswith("m.jsonl:2: refused flash_fwd_fp8:gfx942:") and len(problems) == 2
    assert "the FP8 forward serves CUDA sm_90+ only" in problems[1]


def test_prewarm_cli_lists_the_misses_without_the_refused_fp8_lines(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = _misses(tmp_path)
    assert cli_main(["prewarm", "--from-misses", str(path), "--list"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and "flash_fwd_fp8:sm_90" in out and "flash_fwd:sm_80" in out
    assert f"skipped {path}:1: refused flash_fwd_fp8:sm_80" in err and "no FP8 tensor cores" in err
    assert f"skipped {path}:2: refused flash_fwd_fp8:gfx942" in err


# ---------------------------------------------------------------------------
# GPU: CUDA graphs and inductor


@gpu
def test_gpu_cuda_graph_capture_and_replay() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 forward needs sm_90+ (refused elsewhere: test_fp8_fwd.py)")
    b, s, hq, hk, d = 2, 300, 8, 2, 128
    static = [fp8(b, s, h, d, seed=i, device="cuda") for i, h in enumerate((hq, hk, hk))]
    descales = list(scales(b, hk, seed=3, device="cuda"))
    assert "flash_fwd_fp8" in lazytriton.preload(static[0], static[1], causal="bottom_right", layout="bshd")[0]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = lazytriton.flash_attn_func(*static, causal=True, q_descale=descales[0], k_descale=descales[1],
                                         v_descale=descales[2])
        plain = lazytriton.flash_attn_func(*static, causal=True)  # no descales: null pointers, read as 1.0
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (10, 20):
        fresh = [fp8(b, s, h, d, seed=seed + i, device="cuda") for i, h in enumerate((hq, hk, hk))]
        fresh_scales = scales(b, hk, seed=seed, device="cuda")
        for t, f in zip([*static, *descales], [*fresh, *fresh_scales], strict=True):
            t.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        want = lazytriton.flash_attn_func(*fresh, causal=True, q_descale=fresh_scales[0],
                                          k_descale=fresh_scales[1], v_descale=fresh_scales[2])
        assert torch.equal(out, want) and torch.equal(plain, lazytriton.flash_attn_func(*fresh, causal=True))


@gpu
def test_gpu_capture_of_an_unloaded_fp8_kernel_raises_clearly() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 forward needs sm_90+")
    runtime.reset()
    q = fp8(1, 3000, 2, 64, seed=1, device="cuda")  # a bucket no other test loads
    one = torch.ones((), device="cuda")
    with pytest.raises(launch.CaptureError, match="preload"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        lazytriton.flash_attn_func(q, q, q, q_descale=one)
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_inductor(mode: str | None) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 forward needs sm_90+")
    torch._dynamo.reset()
    q, k, v = (fp8(2, 256, 4, 64, seed=i, device="cuda") for i in range(3))
    s = scales(2, 4, seed=4, device="cuda")
    lazytriton.preload(q, k, causal="bottom_right", layout="bshd")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(q, k, v, causal=True, q_descale=s[0], k_descale=s[1], v_descale=s[2]) * 2

    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    for _ in range(3):
        got = compiled(q, k, v)
    assert torch.equal(got, fn(q, k, v))
