"""examples/vllm: lazytriton as a vLLM v1 attention backend, checked without vLLM.

The backend is loaded from its folder (vLLM is not installed here: its base classes come from the example's
stand-in). Each case builds what vLLM's model runner would hand the backend for one step: a paged KV cache of
(2, num_blocks, block_size, num_kv_heads, head_size) holding each request's earlier keys, a mixed batch of
prefills (whole prompts and chunks) and decodes, vLLM's common metadata (query_start_loc, seq_lens, block table,
slot_mapping) through the backend's builder, and padded query/key/value rows past num_actual_tokens. After the
impl's forward, the cache must hold the new keys at their slots and nothing else changed (bitwise), and the output
must follow FlashAttention's rule against a float64 attention read from the same paged cache: page sizes 16 and 1,
GQA, sinks, sliding windows, softcap, ALiBi, a step of decodes only (the kv_append path) and the mixed call, and
FP8 KV caches (the new keys quantised by the layer's scales, bytes equal to torch's; the attention against the
float64 attention over the dequantised cache).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import REPO, gpu
from test_flash_fwd import OUT_FLOOR, seed_of

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in:RuntimeWarning")

PACKAGE = REPO / "examples" / "vllm" / "lazytriton_vllm"
# (context already cached, new tokens) a request: a whole prompt, decodes, a chunked prefill's later chunk.
MIXED = ((0, 7), (21, 1), (5, 1), (12, 4), (0, 1), (33, 1))
DECODES = ((19, 1), (0, 1), (40, 1), (7, 1))


def load_backend() -> ModuleType:
    """lazytriton_vllm.backend, the package loaded from examples/vllm (no folder put on sys.path)."""
    if "lazytriton_vllm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lazytriton_vllm", PACKAGE / "__init__.py",
                                                      submodule_search_locations=[str(PACKAGE)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["lazytriton_vllm"] = module
        spec.loader.exec_module(module)
    return importlib.import_module("lazytriton_vllm.backend")


@pytest.fixture(scope="module")
def be() -> ModuleType:
    return load_backend()


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    page: int
    heads: tuple[int, int]  # (num_heads, num_kv_heads)
    head_size: int = 32
    requests: tuple[tuple[int, int], ...] = MIXED
    window: int | None = None  # vLLM's sliding_window (tokens a query sees, itself included)
    sinks: bool = False
    softcap: float | None = None
    alibi: bool = False
    pad: int = 0  # padding rows past num_actual_tokens (and as many -1 slots)
    kv: str = "auto"  # vLLM's kv_cache_dtype: "fp8" (held as uint8 bytes, as vLLM may) or "fp8_e5m2" (as float8)

    def __str__(self) -> str:
        kind = "decodes" if all(q == 1 for _, q in self.requests) else "mixed"
        return (f"{str(self.dtype)[6:]}-page{self.page}-h{self.heads[0]}_{self.heads[1]}-d{self.head_size}-{kind}"
                f"-w{self.window}-sinks{int(self.sinks)}-cap{self.softcap}-alibi{int(self.alibi)}-pad{self.pad}"
                + ("" if self.kv == "auto" else f"-{self.kv}"))


FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALES = (0.25, 1.5)  # the layer's _k_scale and _v_scale over an FP8 cache


@dataclass
class Step:
    """One step's inputs as vLLM hands them to the impl, and what the cache must hold after it."""

    impl: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: Any
    output: torch.Tensor
    expected_cache: torch.Tensor  # kv_cache with the new keys at their slots, written by plain indexing
    block_table: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]
    window: int | None  # vLLM's sliding_window: a query sees the keys less than window positions before it
    layer: Any = None  # vLLM's Attention layer: its _k_scale and _v_scale over an FP8 cache
    scales: tuple[float, float] = (1.0, 1.0)  # the expected cache holds key / scales[0] and value / scales[1]


def make_step(be: ModuleType, case: Case, seed: int, device: str = "cpu") -> Step:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype).to(device)

    (hq, hk), d, page = case.heads, case.head_size, case.page
    query_lens = [q for _, q in case.requests]
    seq_lens = [c + q for c, q in case.requests]
    pages = [-(-s // page) for s in seq_lens]
    num_blocks = sum(pages) + 3
    width = max(pages) + 1
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)  # vLLM leaves unused entries 0
    at = 0
    for r, p in enumerate(pages):
        block_table[r, :p] = order[at:at + p]
        at += p
    slots = [int(block_table[r, pos // page]) * page + pos % page
             for r, (c, q) in enumerate(case.requests) for pos in range(c, c + q)]
    n = len(slots)
    kv_cache = randn(2, num_blocks, page, hk, d)
    query, key, value = randn(n + case.pad, hq, d), randn(n + case.pad, hk, d), randn(n + case.pad, hk, d)
    fmt, scales, layer = FP8.get(case.kv), (1.0, 1.0), None
    if fmt is not None:  # torch's quantisation of the new keys: x / scale, saturated, rounded to nearest even
        scales = SCALES
        layer = SimpleNamespace(_k_scale=torch.tensor(scales[0], device=device),
                                _v_scale=torch.tensor([scales[1]], device=device))
        kv_cache = kv_cache.to(fmt)
        key, value = (x * 300 if case.kv == "fp8" else x for x in (key, value))  # some of e4m3's saturate
        new = [(x.float() / s).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt) for x, s in zip((key, value), scales,
                                                                                            strict=True)]
    else:
        new = [key, value]
    expected = kv_cache.clone()
    for i, slot in enumerate(slots):
        expected[0, slot // page, slot % page], expected[1, slot // page, slot % page] = new[0][i], new[1][i]
    if case.kv == "fp8":
        kv_cache = kv_cache.view(torch.uint8)  # vLLM's bytes: the backend views them as float8_e4m3fn
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    common = be.CommonAttentionMetadata(
        query_start_loc=cu.to(device), query_start_loc_cpu=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                                                         device=device),
        num_reqs=len(seq_lens), num_actual_tokens=n, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.tensor(slots + [-1] * case.pad, dtype=torch.int64, device=device), causal=True)
    builder = be.LazyTritonMetadataBuilder(None, ["layers.0.attn"], None, torch.device(device))
    sinks = (torch.randn(hq, generator=gen) * 2).to(device) if case.sinks else None
    alibi = (torch.rand(hq, generator=gen) * 0.3).tolist() if case.alibi else None
    impl = be.LazyTritonAttentionImpl(hq, d, d ** -0.5, hk, alibi, case.window, case.kv,
                                      logits_soft_cap=case.softcap, sinks=sinks)
    output = torch.full((n + case.pad, hq * d), 7.0, dtype=case.dtype, device=device)  # vLLM's (tokens, heads x dim)
    return Step(impl, query, key, value, kv_cache, builder.build(0, common), output, expected, block_table,
                seq_lens, query_lens, case.window, layer, scales)


def forward(step: Step, **overrides: Any) -> torch.Tensor:
    impl = step.impl
    for name, value in overrides.items():
        setattr(impl, name, value)
    with torch.no_grad():
        got = impl.forward(step.layer, step.query, step.key, step.value, step.kv_cache, step.metadata,
                           output=step.output)
    assert got is step.output
    return step.output.view(step.output.shape[0], impl.num_heads, impl.head_size)


def reference(step: Step, dtype: torch.dtype) -> torch.Tensor:
    """Each request's attention over its pages of the expected cache, computed in ``dtype`` (rows: its queries).

    An FP8 cache is read dequantised: key x scales[0], value x scales[1].
    """
    impl, cache = step.impl, step.expected_cache.to(dtype)
    cache = cache * torch.tensor(step.scales, dtype=dtype).view(2, 1, 1, 1, 1)
    page = cache.shape[2]
    group = impl.num_heads // impl.num_kv_heads
    rows, start = [], 0
    for r, (seq, ql) in enumerate(zip(step.seq_lens, step.query_lens, strict=True)):
        blocks = step.block_table[r, torch.arange(seq) // page].long()
        k, v = (cache[i, blocks, torch.arange(seq) % page].repeat_interleave(group, dim=1) for i in (0, 1))
        q = step.query[start:start + ql].to(dtype)
        start += ql
        s = torch.einsum("qhd,khd->hqk", q, k) * impl.scale
        if impl.logits_soft_cap > 0:
            s = impl.logits_soft_cap * torch.tanh(s / impl.logits_soft_cap)
        i = torch.arange(ql)[:, None] + (seq - ql)  # each query's position
        j = torch.arange(seq)[None, :]
        if impl.alibi_slopes is not None:
            s = s - impl.alibi_slopes.to(dtype)[:, None, None] * (i - j).abs().to(dtype)
        seen = j <= i  # causal, bottom-right
        if step.window is not None:
            seen &= i - j < step.window
        s = s.masked_fill(~seen, -math.inf)
        if impl.sinks is not None:
            sink = impl.sinks.to(dtype)[:, None, None].expand(-1, ql, 1)
            lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1, keepdim=True)
        else:
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - lse).nan_to_num(0.0)  # a row that sees nothing: 0
        rows.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(rows)


def check_step(step: Step, out: torch.Tensor) -> None:
    """The cache bitwise; the output by FlashAttention's rule (2x the same-dtype reference's error + a floor)."""
    n = step.metadata.num_actual_tokens
    got, want = step.kv_cache, step.expected_cache
    if want.element_size() == 1:  # an FP8 cache: its bytes
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want), "new keys landed elsewhere, or a slot -1 was written"
    assert torch.all(out[n:] == 7.0), "rows past num_actual_tokens (vLLM's padding) must be left alone"
    wide = reference(step, torch.float64)
    same = reference(step, step.query.dtype)
    err = float((out[:n].double() - wide).abs().max())
    same_err = float((same.double() - wide).abs().max())
    floor = OUT_FLOOR[out.dtype] * max(1.0, float(wide.abs().max()))
    assert err <= 2 * same_err + floor, f"max error {err:.3g} > 2 x {same_err:.3g} + {floor:.3g}"


# ---------------------------------------------------------------------------
# The interface vLLM reads


def test_the_backend_has_vllms_interface(be: ModuleType) -> None:
    backend = be.LazyTritonAttentionBackend
    assert backend.get_name() == "CUSTOM" and backend.accept_output_buffer
    assert backend.get_impl_cls() is be.LazyTritonAttentionImpl
    assert backend.get_builder_cls() is be.LazyTritonMetadataBuilder
    assert backend.get_metadata_cls() is be.LazyTritonMetadata
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert backend.get_kv_cache_shape(10, 1, 2, 64) == (2, 10, 1, 2, 64), "pages of one key"
    assert [s.base for s in backend.get_supported_kernel_block_sizes()] == [1]
    assert backend.supports_dtype(torch.bfloat16) and backend.supports_dtype(torch.float16)
    assert backend.supports_head_size(128) and backend.supports_head_size(64) and not backend.supports_head_size(7)
    assert backend.supports_sink() and backend.supports_attn_type("decoder")
    assert not backend.supports_attn_type("encoder_only")
    assert issubclass(backend, be.AttentionBackend) and issubclass(be.LazyTritonAttentionImpl, be.AttentionImpl)


def test_without_vllm_the_stand_in_serves_and_vllm_is_not_imported(be: ModuleType) -> None:
    bases = importlib.import_module("lazytriton_vllm.bases")
    found = importlib.util.find_spec("vllm") is not None
    assert bases.VLLM_FOUND == found
    if not found:
        assert be.AttentionBackend is importlib.import_module("lazytriton_vllm.standin").AttentionBackend
        assert "vllm" not in sys.modules


def test_the_plugin_entry_point_names_register() -> None:
    text = (REPO / "examples" / "vllm" / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'lazytriton_vllm = "lazytriton_vllm:register"' in text
    load_backend()
    package = sys.modules["lazytriton_vllm"]
    assert callable(package.register)
    module, name = package.BACKEND.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is load_backend().LazyTritonAttentionBackend


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype"),
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"head_size": 7}, "head_size"),
    ({"attn_type": "encoder_only"}, "attn_type"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"logits_soft_cap": -1.0}, "logits_soft_cap"),
    ({"alibi_slopes": [0.1, 0.2]}, "alibi_slopes"),
    ({"sinks": torch.zeros(3)}, "sinks"),
])
def test_bad_layer_arguments_name_themselves(be: ModuleType, kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"num_heads": 4, "head_size": 32, "scale": 0.2, "num_kv_heads": 2, "alibi_slopes": None,
                            "sliding_window": None, "kv_cache_dtype": "auto"}
    with pytest.raises(ValueError, match=match):
        be.LazyTritonAttentionImpl(**{**args, **kwargs})


def test_bad_cache_shapes_and_calls_are_refused_before_anything_is_written(be: ModuleType) -> None:
    with pytest.raises(ValueError, match="block_size"):
        be.LazyTritonAttentionBackend.get_kv_cache_shape(10, 0, 2, 64)
    with pytest.raises(ValueError, match="cache_dtype_str"):
        be.LazyTritonAttentionBackend.get_kv_cache_shape(10, 16, 2, 64, "int8")
    assert be.LazyTritonAttentionBackend.get_kv_cache_shape(10, 16, 2, 64, "fp8") == (2, 10, 16, 2, 64)
    step = make_step(be, Case(torch.float32, 16, (4, 2)), seed=1)
    before = step.kv_cache.clone()
    with pytest.raises(ValueError, match="output"):
        step.impl.forward(None, step.query, step.key, step.value, step.kv_cache, step.metadata, output=None)
    assert torch.equal(step.kv_cache, before)


def test_a_slot_past_the_cache_is_skipped_not_written(be: ModuleType) -> None:
    """The slots are never read on the host: the write's kernel skips one outside the cache, as it skips -1."""
    step = make_step(be, Case(torch.float32, 16, (4, 2)), seed=1)
    n = step.metadata.num_actual_tokens
    past = step.kv_cache.shape[1] * step.kv_cache.shape[2]
    first = int(step.metadata.slot_mapping[0])
    step.metadata.slot_mapping[0] = past  # one past the cache: token 0 is not written
    before = step.kv_cache.clone()
    forward(step)
    page = step.kv_cache.shape[2]
    expected = step.expected_cache.clone()
    expected[:, first // page, first % page] = before[:, first // page, first % page]
    assert n > 1 and torch.equal(step.kv_cache, expected)


def test_a_profiling_run_zeroes_the_output(be: ModuleType) -> None:
    step = make_step(be, Case(torch.float32, 16, (4, 2)), seed=2)
    got = step.impl.forward(None, step.query, step.key, step.value, step.kv_cache, None, output=step.output)
    assert got is step.output and not step.output.any()


# ---------------------------------------------------------------------------
# Numerics on CPU, through Triton's interpreter

CASES = [
    Case(torch.float16, 16, (4, 2), pad=3),
    Case(torch.bfloat16, 1, (4, 1)),
    Case(torch.float32, 16, (4, 2), head_size=64, window=8, sinks=True),  # gpt-oss's sliding layers
    Case(torch.bfloat16, 1, (4, 2), window=6, sinks=True, pad=2),
    Case(torch.float16, 16, (4, 4), softcap=2.0, alibi=True),
    Case(torch.float16, 16, (4, 2), requests=DECODES, window=9, sinks=True, pad=2),
    Case(torch.bfloat16, 1, (4, 1), requests=DECODES, softcap=3.0),
    Case(torch.bfloat16, 16, (4, 2), pad=2, kv="fp8"),  # FP8 caches: the slot write, then the paged attention
    Case(torch.float16, 1, (4, 1), window=6, sinks=True, kv="fp8_e5m2"),
    Case(torch.bfloat16, 16, (4, 2), requests=DECODES, kv="fp8", pad=1),  # kv_append quantises
    Case(torch.float16, 16, (4, 2), requests=DECODES, kv="fp8_e5m2"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_step_writes_the_cache_and_attends_as_float64(be: ModuleType, case: Case) -> None:
    step = make_step(be, case, seed_of(case))
    check_step(step, forward(step))


@pytest.mark.parametrize("page", [16, 1])
def test_a_decode_step_appends_through_kv_append_as_through_slot_mapping(be: ModuleType, page: int) -> None:
    """The kv_append path (a step of decodes only) and the slot_mapping write give the same cache and output."""
    case = Case(torch.float16, page, (4, 2), requests=DECODES, sinks=True, pad=1)
    fused, plain = make_step(be, case, seed_of(case)), make_step(be, case, seed_of(case))
    out_fused = forward(fused)
    out_plain = forward(plain, fused_decode_append=False)
    assert torch.equal(fused.kv_cache, plain.kv_cache)
    check_step(fused, out_fused)
    check_step(plain, out_plain)


def test_a_layer_sharing_an_earlier_layers_cache_writes_nothing(be: ModuleType) -> None:
    case = Case(torch.float32, 16, (4, 2))
    step = make_step(be, case, seed_of(case))
    step.impl.kv_sharing_target_layer_name = "layers.0.attn"
    step.kv_cache.copy_(step.expected_cache)  # the earlier layer wrote them
    before = step.kv_cache.clone()
    out = forward(step)
    assert torch.equal(step.kv_cache, before)
    check_step(step, out)


def test_trusted_indices_give_the_same_step(be: ModuleType) -> None:
    case = Case(torch.float16, 16, (4, 2), pad=2)
    checked, trusted = make_step(be, case, seed_of(case)), make_step(be, case, seed_of(case))
    out = forward(checked)
    out_trusted = forward(trusted, trust_indices=True)
    assert torch.equal(checked.kv_cache, trusted.kv_cache) and torch.equal(out, out_trusted)


# ---------------------------------------------------------------------------
# On the GPU, at a serving engine's sizes

GPU_CASES = [
    # Llama-3-8B's attention a GPU of TP=1: 32 query heads, 8 KV heads, head size 128; 4 prefills, 60 decodes.
    Case(torch.bfloat16, 16, (32, 8), head_size=128,
         requests=((0, 700), (1200, 300), (0, 513), (2500, 64), *((100 + 61 * i, 1) for i in range(60))), pad=8),
    # gpt-oss's sliding layers: 64 query heads, 8 KV heads, head size 64, a 128-token window, sinks.
    Case(torch.bfloat16, 16, (64, 8), head_size=64, window=128, sinks=True,
         requests=((0, 600), (900, 200), *((50 + 83 * i, 1) for i in range(40)))),
    # pages of one key (SGLang's radix cache; vLLM's FlashAttention refuses them), fp16, a step of decodes.
    Case(torch.float16, 1, (32, 8), head_size=128, requests=tuple((37 * i + 1, 1) for i in range(64))),
    # Llama-3-8B's step over vLLM's FP8 cache (e4m3 as uint8 bytes; sm_89 or newer), then a step of decodes on e5m2.
    Case(torch.bfloat16, 16, (32, 8), head_size=128,
         requests=((0, 700), (1200, 300), *((100 + 61 * i, 1) for i in range(60))), pad=8, kv="fp8"),
    Case(torch.bfloat16, 16, (32, 8), head_size=128, requests=tuple((37 * i + 1, 1) for i in range(64)),
         kv="fp8_e5m2"),
]


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_a_serving_step_on_the_gpu(be: ModuleType, case: Case) -> None:
    step = make_step(be, case, seed_of(case), device="cuda")
    out = forward(step)
    torch.cuda.synchronize()
    step = Step(**{**step.__dict__, "query": step.query.cpu(), "kv_cache": step.kv_cache.cpu(),
                   "expected_cache": step.expected_cache.cpu()})
    step.impl.sinks = None if step.impl.sinks is None else step.impl.sinks.cpu()
    step.impl.alibi_slopes = None if step.impl.alibi_slopes is None else step.impl.alibi_slopes.cpu()
    check_step(step, out.cpu())
