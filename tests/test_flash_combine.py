"""``flash_attn_combine``: FlashAttention-3's merge of attention over disjoint key chunks, forward only.

Numerics follow FlashAttention-3's own combine test (``test_flash_attn_combine``
of hopper/test_flash_attn.py): out may be at most twice as far from the
float64 reference as that reference rounded to out's dtype is, plus a small
floor, and lse within 1e-5 (relative to max(1, |lse|)). The reference
(``kernels/flash_combine/reference.py``) is FlashAttention-3's
``attention_combine_ref``. On CPU the kernel runs through Triton's
interpreter (tiles of 4 rows and 4 splits, so every loop takes several steps)
over a covering design of split counts (1, 2, 3, 7, 64: past every tile),
head dims (64, 128, 96, 256, 40, 512: padded, chunked), output dtypes,
layouts (contiguous, FlashAttention-3's strided partials, packed sequences)
and splits that saw no key (some, whole rows, all). Then: out written in
place, torch.compile, bad input refused before any launch, and two ends to
end: our split-KV decoding's own partials combined here give its output, and
``flash_attn_with_kvcache`` over disjoint chunks of a cache combined here
gives one call over all the keys (context parallelism). The GPU tests run
the same at serving sizes, and under a CUDA graph.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import gpu
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, seed_of

import lazytriton
from lazytriton import combine_op, compiler
from lazytriton.kernels.flash_combine.reference import combine_reference
from lazytriton.kernels.flash_decode import binding as decode_binding
from lazytriton.kernels.flash_decode.reference import kvcache_reference

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INF = float("inf")


@dataclass(frozen=True)
class Case:
    splits: int
    head_dim: int
    dtype: torch.dtype
    layout: str  # "contiguous", "strided" (FlashAttention-3's test's views), "packed" (total_q, no batch dim)
    empty: str  # "none", "some" (splits past the half, in some rows), "rows" (every split of some rows), "all"

    def __str__(self) -> str:
        return f"n{self.splits}-d{self.head_dim}-{str(self.dtype)[6:]}-{self.layout}-{self.empty}"


def cpu_cases() -> list[Case]:
    """18 cases: each split count with three head dims, every layout and every dtype; each head dim three times."""
    splits, dims = (1, 2, 3, 7, 64, 17), (64, 128, 96, 256, 40, 512)
    layouts, empties = ("contiguous", "strided", "packed"), ("none", "some", "rows", "all")
    cases = []
    for i, n in enumerate(splits):
        for j in range(3):
            cases.append(Case(n, dims[(i + 2 * j) % 6], DTYPES[(i + j) % 3], layouts[(2 * i + j) % 3],
                              empties[(i + 3 * j) % 4]))
    return cases


def partials(case: Case, batch: int = 2, seqlen: int = 3, heads: int = 4,
             device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(out_partial, lse_partial) of a case; a split that saw no key has lse -inf and NaN in its output."""
    gen = torch.Generator(device=device).manual_seed(seed_of(case, batch, seqlen, heads))
    n, d = case.splits, case.head_dim
    if case.layout == "strided":  # FlashAttention-3's test: partials and lse both non-contiguous views
        out_partial = torch.randn(n * 2, batch, heads, seqlen, d, generator=gen, device=device).transpose(2, 3)[:n]
        lse_partial = torch.randn(n, batch, heads * 2, seqlen, generator=gen, device=device).transpose(-1, -2)
        lse_partial = lse_partial[:, :, :, :heads]
    else:
        rows = (batch * seqlen,) if case.layout == "packed" else (batch, seqlen)
        out_partial = torch.randn(n, *rows, heads, d, generator=gen, device=device)
        lse_partial = torch.randn(n, *rows, heads, generator=gen, device=device)
    lse_partial.mul_(4)  # splits of very different weights (in place: the views keep their strides)
    if case.empty == "some":
        lse_partial[n // 2:, : max(1, lse_partial.shape[1] // 2)] = -INF
    elif case.empty == "rows":
        lse_partial[:, 0] = -INF  # every split of batch 0 (packed: of query 0)
    elif case.empty == "all":
        lse_partial.fill_(-INF)
    out_partial.masked_fill_((lse_partial == -INF).unsqueeze(-1), float("nan"))  # never read
    return out_partial, lse_partial


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def check_combined(out: torch.Tensor, lse: torch.Tensor, out_partial: torch.Tensor, lse_partial: torch.Tensor) -> None:
    """FlashAttention-3's rule for out and lse; rows whose every split is -inf: out exactly 0, lse -inf."""
    ref_out, ref_lse = combine_reference(out_partial, lse_partial)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows without keys must have lse -inf, and only they"
    assert not lse.isnan().any() and not out.isnan().any()
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    same_err = max_err(ref_out.to(out.dtype), ref_out)
    floor = OUT_FLOOR[out.dtype] * max(1.0, float(ref_out.abs().max()) if ref_out.numel() else 0.0)
    err = max_err(out, ref_out)
    assert err <= 2 * same_err + floor, f"out: max error {err:.3g} > 2 x {same_err:.3g} + {floor:.3g}"
    if seen.any():
        lse_err = max_err(lse[seen], ref_lse[seen])
        assert lse_err <= LSE_FLOOR * max(1.0, float(ref_lse[seen].abs().max())), f"lse: max error {lse_err:.3g}"


# ---------------------------------------------------------------------------
# Numerics on CPU, through Triton's interpreter


@pytest.mark.parametrize("case", cpu_cases(), ids=str)
def test_combine_matches_the_float64_reference(case: Case) -> None:
    out_partial, lse_partial = partials(case)
    out, lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=case.dtype)
    assert out.dtype == case.dtype and out.shape == out_partial.shape[1:] and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == lse_partial.shape[1:]
    assert lse.transpose(-1, -2).is_contiguous(), "FlashAttention-3's lse: (batch, heads, seqlen) transposed"
    check_combined(out, lse, out_partial, lse_partial)


def test_the_default_output_is_float32_and_one_split_is_itself() -> None:
    out_partial, lse_partial = partials(Case(1, 64, torch.float32, "contiguous", "none"))
    out, lse = lazytriton.flash_attn_combine(out_partial, lse_partial)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, out_partial[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lse_partial[0], rtol=0, atol=0)


def test_out_is_written_in_place_through_its_strides() -> None:
    out_partial, lse_partial = partials(Case(3, 96, torch.bfloat16, "strided", "some"))
    buffer = torch.randn(3, 2, 4, 2, 128).bfloat16()
    before = buffer.clone()
    out = buffer[:, :, :, 1, :96].transpose(0, 1)  # (batch, seqlen, heads, head_dim), head dim contiguous
    got, lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out=out)
    assert got is out and got.dtype == torch.bfloat16  # out's dtype when out_dtype is not given
    check_combined(out, lse, out_partial, lse_partial)
    outside = torch.ones(buffer.shape, dtype=torch.bool)
    outside[:, :, :, 1, :96] = False
    assert torch.equal(buffer[outside], before[outside]), "wrote outside out"
    got, _ = lazytriton.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=torch.bfloat16)
    assert got is out


def test_no_split_or_no_row_gives_zero_and_minus_inf() -> None:
    out, lse = lazytriton.flash_attn_combine(torch.empty(0, 2, 3, 4, 64), torch.empty(0, 2, 3, 4))
    assert torch.equal(out, torch.zeros(2, 3, 4, 64)) and torch.equal(lse, torch.full((2, 3, 4), -INF))
    out, lse = lazytriton.flash_attn_combine(torch.empty(4, 0, 3, 4, 64), torch.empty(4, 0, 3, 4))
    assert out.shape == (0, 3, 4, 64) and lse.shape == (0, 3, 4)


def test_meta_tensors_give_the_shapes_and_launch_nothing(no_launch: None) -> None:
    out, lse = lazytriton.flash_attn_combine(torch.empty(5, 2, 3, 4, 200, device="meta"),
                                             torch.empty(5, 2, 3, 4, device="meta"), out_dtype=torch.float16)
    assert out.shape == (2, 3, 4, 200) and out.dtype == torch.float16 and lse.stride() == (12, 1, 3)


# ---------------------------------------------------------------------------
# torch.compile: the two ops


def test_torch_compile_traces_the_call_with_and_without_out() -> None:
    torch._dynamo.reset()
    out_partial, lse_partial = partials(Case(5, 64, torch.float32, "strided", "some"))

    def fresh(op: torch.Tensor, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = lazytriton.flash_attn_combine(op * 2, lp, out_dtype=torch.bfloat16)
        return out * 3, lse

    want = fresh(out_partial, lse_partial)
    got = torch.compile(fresh, fullgraph=True, backend="eager")(out_partial, lse_partial)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    def into(op: torch.Tensor, lp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_combine(op, lp, out=out)[1] + 1

    eager_out, compiled_out = torch.zeros(2, 3, 4, 64), torch.zeros(2, 3, 4, 64)
    want_lse = into(out_partial, lse_partial, eager_out)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compiled_out.zero_()
        got_lse = torch.compile(into, fullgraph=True, backend=backend)(out_partial, lse_partial, compiled_out)
        torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
        torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    lse = torch.ops.lazytriton.flash_combine_out(out_partial, lse_partial, compiled_out.zero_())
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(lse + 1, want_lse, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Bad input: an error naming the argument, before anything is allocated or launched


def _bad_calls() -> list[tuple[dict[str, Any], type[Exception], str]]:
    op, lp = torch.randn(2, 1, 3, 4, 64), torch.randn(2, 1, 3, 4)
    return [
        ({"out_partial": op.numpy()}, TypeError, "out_partial must be a torch.Tensor"),
        ({"out_partial": op.half()}, TypeError, "out_partial must be float32"),
        ({"out_partial": op[0, 0]}, ValueError, "out_partial must have 5 dims"),
        ({"out_partial": op.transpose(-1, -2).contiguous().transpose(-1, -2)}, ValueError,
         "out_partial must have a contiguous last dim"),
        ({"out_partial": op[..., :0], "lse_partial": lp}, ValueError, "head dim .* must be >= 1"),
        ({"lse_partial": lp.double()}, TypeError, "lse_partial must be float32"),
        ({"lse_partial": lp[:, :, :2]}, ValueError, r"lse_partial must have shape \(2, 1, 3, 4\)"),
        ({"lse_partial": lp.to("meta")}, ValueError, "lse_partial is on meta but out_partial is on cpu"),
        ({"out": torch.empty(1, 3, 4, 32)}, ValueError, r"out must have shape \(1, 3, 4, 64\)"),
        ({"out": torch.empty(1, 3, 4, 64).numpy()}, TypeError, "out must be a torch.Tensor or None"),
        ({"out": torch.empty(1, 3, 4, 64, device="meta")}, ValueError, "out is on meta"),
        ({"out": torch.empty(1, 3, 64, 4).transpose(-1, -2)}, ValueError, "out must have a contiguous last dim"),
        ({"out": torch.empty(1, 1, 1, 64).expand(1, 3, 4, 64)}, ValueError, "broadcast"),
        ({"out": torch.empty(1, 3, 4, 64, dtype=torch.int32)}, TypeError, "out must be float32, float16 or bfloat16"),
        ({"out": torch.empty(1, 3, 4, 64), "out_dtype": torch.float16}, TypeError,
         "out has dtype torch.float32 but out_dtype is torch.float16"),
        ({"out_dtype": torch.float64}, TypeError, "out_dtype must be float32, float16 or bfloat16"),
        ({"out_dtype": "bf16"}, TypeError, "out_dtype must be a torch.dtype or None, got 'bf16'"),
    ]


@pytest.mark.parametrize(("changes", "error", "match"), _bad_calls(),
                         ids=[f"{i}-{m[:30]}" for i, (_, _, m) in enumerate(_bad_calls())])
def test_bad_input_is_refused_before_any_launch(no_launch: None, changes: dict[str, Any], error: type[Exception],
                                                match: str) -> None:
    args: dict[str, Any] = {"out_partial": torch.randn(2, 1, 3, 4, 64), "lse_partial": torch.randn(2, 1, 3, 4),
                            **changes}
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_combine(**args)
    out, out_dtype = args.get("out"), args.get("out_dtype")
    typed = all(isinstance(args[name], torch.Tensor) for name in ("out_partial", "lse_partial"))
    if not typed or not isinstance(out, (torch.Tensor, type(None))) or not isinstance(out_dtype, (torch.dtype,
                                                                                                  type(None))):
        return  # the ops' schemas refuse what is not a tensor or a dtype themselves
    with pytest.raises(error, match=match):  # the ops check again: they can be called directly
        if out is None:
            combine_op.flash_combine_op(args["out_partial"], args["lse_partial"], out_dtype)
        elif out_dtype is None:
            combine_op.flash_combine_out_op(args["out_partial"], args["lse_partial"], out)
        else:  # the out op takes no out_dtype: only the public function sees the pair
            raise error(match)


# ---------------------------------------------------------------------------
# End to end: split-KV decoding and context parallelism


def test_our_split_kv_decodings_partials_combined_here_give_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attn_with_kvcache's own partials (base-2 lse, (batch, heads, seqlen_q, splits) rows) combined here."""
    seen: list[dict[str, Any]] = []
    interpret = compiler.interpret

    def spy(kernel: str, grid: Any, args: Any, constexprs: Any) -> None:
        if kernel == "flash_decode_combine":
            named = dict(zip(decode_binding.COMBINE_INT_PARAMS, args, strict=True))
            seen.append({name: (t.clone() if isinstance(t, torch.Tensor) else t) for name, t in named.items()})
        interpret(kernel, grid, args, constexprs)

    monkeypatch.setattr(compiler, "interpret", spy)
    gen = torch.Generator().manual_seed(11)
    batch, seqlen_q, heads, heads_k, dim = 2, 2, 4, 2, 64
    q = torch.randn(batch, seqlen_q, heads, dim, generator=gen)
    k_cache, v_cache = (torch.randn(batch, 100, heads_k, dim, generator=gen) for _ in range(2))
    lens = torch.tensor([100, 40], dtype=torch.int32)  # 5 splits of 100 keys: sequence 1's last ones see none
    out, lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=5,
                                                 return_softmax_lse=True)
    assert len(seen) == 1
    parts = seen[0]
    splits = parts["num_splits"]
    assert splits == 5
    out_partial = parts["OutPart"].view(batch, heads, seqlen_q, splits, dim).permute(3, 0, 2, 1, 4)
    lse_partial = (parts["LsePart"].view(batch, heads, seqlen_q, splits) * math.log(2)).permute(3, 0, 2, 1)
    assert (lse_partial[:, 1] == -INF).any(), "some split of the shorter sequence saw no key"
    got, got_lse = lazytriton.flash_attn_combine(out_partial, lse_partial)
    torch.testing.assert_close(got, out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got_lse, lse.transpose(1, 2), rtol=2e-6, atol=2e-6)


CONTEXT_PARALLEL = [(torch.float32, (0, 37, 64, 64, 120), False), (torch.float32, (0, 50, 120), True),
                    (torch.bfloat16, (0, 16, 48, 120), False), (torch.float16, (0, 70, 120), False)]


@pytest.mark.parametrize(("dtype", "bounds", "packed"), CONTEXT_PARALLEL,
                         ids=[f"{str(d)[6:]}-{len(b) - 1}chunks{'-packed' if p else ''}"
                              for d, b, p in CONTEXT_PARALLEL])
def test_attention_over_disjoint_chunks_combined_is_attention_over_all(dtype: torch.dtype, bounds: tuple[int, ...],
                                                                       packed: bool) -> None:
    """Context parallelism: each rank attends to its chunk of the keys; the combine gives one call's result.

    One chunk (64..64) is empty: that rank saw no key, its lse is -inf.
    """
    gen = torch.Generator().manual_seed(seed_of(dtype, bounds))
    batch, seqlen_q, heads, heads_k, dim = 2, 3, 4, 2, 64
    q = torch.randn(batch, seqlen_q, heads, dim, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(batch, bounds[-1], heads_k, dim, generator=gen).to(dtype) for _ in range(2))
    chunks = []
    for lo, hi in itertools.pairwise(bounds):
        if hi == lo:  # a rank without keys: what its attention returns (out 0, lse -inf)
            chunks.append((torch.zeros(batch, seqlen_q, heads, dim), torch.full((batch, heads, seqlen_q), -INF)))
            continue
        out, lse = lazytriton.flash_attn_with_kvcache(q, k_cache[:, lo:hi], v_cache[:, lo:hi],
                                                     return_softmax_lse=True)
        chunks.append((out.float(), lse))
    out_partial = torch.stack([out for out, _ in chunks])  # (splits, batch, seqlen_q, heads, dim)
    lse_partial = torch.stack([lse for _, lse in chunks]).transpose(-1, -2)  # (splits, batch, seqlen_q, heads)
    if packed:
        out_partial, lse_partial = out_partial.flatten(1, 2), lse_partial.flatten(1, 2)
    combined, lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
    one_call, one_lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    ref_out, ref_lse, *_ = kvcache_reference(q.double(), k_cache.double(), v_cache.double())
    same_out, *_ = kvcache_reference(q, k_cache, v_cache)
    if packed:
        combined, lse = combined.view(batch, seqlen_q, heads, dim), lse.view(batch, seqlen_q, heads)
    floor = OUT_FLOOR[dtype] * max(1.0, float(ref_out.abs().max()))
    # FlashAttention's rule against float64 holds for the combined chunks as for the one call, though each chunk's
    # output was rounded to the dtype before the combine (as a rank's is): bf16 4.5e-3 against the same-dtype
    # reference's 2.3e-3 and the one call's 3.0e-3 (this test's seed)
    err, same_err, one_err = max_err(combined, ref_out), max_err(same_out, ref_out), max_err(one_call, ref_out)
    assert one_err <= 2 * same_err + floor
    assert err <= 2 * same_err + floor, f"out: {err:.3g} > 2 x {same_err:.3g} + {floor:.3g} (one call: {one_err:.3g})"
    torch.testing.assert_close(lse, one_lse.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.transpose(1, 2), ref_lse.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# GPU: serving sizes, and a CUDA graph


GPU_CASES = [Case(n, d, dt, layout, empty) for n, d, dt, layout, empty in (
    (1, 128, torch.bfloat16, "contiguous", "none"), (2, 64, torch.float16, "strided", "some"),
    (7, 96, torch.float32, "packed", "rows"), (32, 128, torch.bfloat16, "strided", "some"),
    (64, 256, torch.bfloat16, "contiguous", "some"), (133, 512, torch.float32, "contiguous", "rows"),
    (256, 128, torch.float16, "packed", "some"), (17, 192, torch.bfloat16, "strided", "all"))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize(("batch", "seqlen"), [(16, 1), (2, 256)])
def test_combine_gpu(case: Case, batch: int, seqlen: int) -> None:
    out_partial, lse_partial = partials(case, batch, seqlen, 32, device="cuda")
    out, lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=case.dtype)
    check_combined(out, lse, out_partial, lse_partial)


@gpu
@pytest.mark.gpu
def test_combine_gpu_cuda_graph_and_chunks_of_a_cache() -> None:
    """Chunks of a decode's cache combined under a CUDA graph, replayed with new keys, against one call."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(8, 1, 32, 128, device="cuda", generator=gen).bfloat16()
    k_cache, v_cache = (torch.randn(8, 4096, 8, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    bounds = (0, 1000, 2048, 4096)
    out = torch.empty(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        parts = [lazytriton.flash_attn_with_kvcache(q, k_cache[:, lo:hi], v_cache[:, lo:hi], return_softmax_lse=True)
                 for lo, hi in itertools.pairwise(bounds)]
        out_partial = torch.stack([o.float() for o, _ in parts])
        lse_partial = torch.stack([lse for _, lse in parts]).transpose(-1, -2)
        return lazytriton.flash_attn_combine(out_partial, lse_partial, out=out)[1]

    step()  # loads every kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lse = step()
    k_cache.copy_(torch.randn(k_cache.shape, device="cuda", generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    one_call, one_lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    torch.testing.assert_close(out, one_call, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, one_lse.transpose(1, 2), rtol=1e-4, atol=1e-4)
