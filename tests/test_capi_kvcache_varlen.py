"""lt_attn_kvcache_params version 4: attention sinks and queries packed by cu_seqlens_q.

On CPU tensors through the built library (Triton's interpreter), in a fresh
process as tests/test_capi_kvcache.py does: out, lse and the caches equal
``flash_attn_with_kvcache``'s with the same sinks and packed queries, bit for
bit; a version 3 struct is read without them whatever its memory holds past
its end; bad input is a status naming the argument. The plan side (no GPU
here): the planner's variants are a Python call's (SINKS, VARLEN_Q); the
workspace of a packed call is sized by total_q.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from capilib import CUDA_DESCRIBE, IN_PROCESS_PRELUDE, KVCACHE_CASE, KVCACHE_PRELUDE, assert_statuses, report_of
from conftest import gpu

from lazytriton.capi import embedded_kvcache

IN_PROCESS = KVCACHE_PRELUDE + KVCACHE_CASE + r"""
torch.manual_seed(0)
report = {}
# Sinks: contiguous, GQA 4/2, one split and several (the combine kernel adds the sink), causal with 3 queries.
sinks = torch.randn(4)
cache = torch.randn(2, 40, 2, 32), torch.randn(2, 40, 2, 32)
lens = torch.tensor([33, 9], dtype=torch.int32)
dense = {"q": torch.randn(2, 3, 4, 32), "k_cache": cache[0], "v_cache": cache[1], "cache_seqlens": lens,
         "sinks": sinks}
case("sinks_one_split", dense, {"causal": True, "num_splits": 1}, causal=1, num_splits=1)
case("sinks_splits", dense, {"causal": True, "num_splits": 3}, causal=1, num_splits=3)
report["sinks_count"] = not torch.equal(
    lazytriton.flash_attn_with_kvcache(dense["q"], *cache, cache_seqlens=lens, return_softmax_lse=True)[1],
    lazytriton.flash_attn_with_kvcache(dense["q"], *cache, cache_seqlens=lens, sinks=sinks,
                                       return_softmax_lse=True)[1])

# Packed queries (3, 0, 4 and 1 queries) over a paged cache with new keys, causal, several splits, and sinks.
pages = torch.randn(12, 16, 2, 32), torch.randn(12, 16, 2, 32)
table = torch.randperm(12, dtype=torch.int32)[:12].reshape(4, 3).contiguous()
cu = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)
packed = {"q": torch.randn(8, 4, 32), "k_cache": pages[0], "v_cache": pages[1], "k": torch.randn(4, 2, 2, 32),
          "v": torch.randn(4, 2, 2, 32), "cache_seqlens": torch.tensor([5, 0, 30, 46], dtype=torch.int32),
          "block_table": table, "cu_seqlens_q": cu}
case("packed", packed, {"causal": True, "num_splits": 2, "max_seqlen_q": 4}, causal=1, num_splits=2,
     max_seqlen_q=4)
packed_sinks = {**{n: t.clone() for n, t in packed.items()}, "sinks": sinks}
case("packed_sinks", packed_sinks, {"max_seqlen_q": 5, "window_size": (6, -1)}, max_seqlen_q=5, window_left=6)

# A version 3 struct (no sinks, no packed queries): taken, and sinks described past its end are not read.
def as_version_3(p):
    describe(p.sinks, sinks)
    p.max_seqlen_q = 7
    p.struct_size, p.version = ffi.offsetof("lt_attn_kvcache_params", "sinks"), 3
plain = {n: t for n, t in dense.items() if n != "sinks"}
case("version_3", plain, {"causal": True, "num_splits": 2}, as_version_3, causal=1, num_splits=2)

# The workspace a GPU call needs: packed, total_q rows (8 x 4 heads x (32 + 1) floats a split).
size = ctypes.c_size_t(0)
p = params({**packed, "out": torch.empty(8, 4, 32), "lse": torch.empty(4, 8)}, num_splits=5, max_seqlen_q=4)
report["workspace"] = [call("lt_attn_kvcache_workspace_size", p, ctypes.byref(size)), size.value]

# Bad input: a status and a message naming the argument, the caches untouched.
def bad(change, base=packed, **options):
    tensors = {n: t.clone() for n, t in base.items()}
    q = tensors["q"]
    out, lse = torch.empty(*q.shape[:2], 32), torch.empty(q.shape[1], q.shape[0])
    return refused({**tensors, "out": out, "lse": lse}, change, **{"max_seqlen_q": 4, **options})

decreasing = torch.tensor([0, 3, 2, 7, 8], dtype=torch.int32)
report["errors"] = [
    bad(lambda p: describe(p.sinks, torch.randn(4).half())),
    bad(lambda p: describe(p.sinks, torch.randn(3))),
    bad(lambda p: describe(p.q, torch.randn(1, 8, 4, 32))),
    bad(lambda p: absent(p.cu_seqlens_q), base=dense),
    bad(lambda p: describe(p.cu_seqlens_q, torch.zeros(1, dtype=torch.int32))),
    bad(lambda p: setattr(p, "max_seqlen_q", -3)),
    bad(lambda p: describe(p.lse, torch.empty(8, 4))),
    bad(lambda p: describe(p.out, torch.empty(8, 4, 16))),
    bad(lambda p: describe(p.cu_seqlens_q, decreasing)),
    bad(lambda p: describe(p.cu_seqlens_q, torch.tensor([0, 3, 3, 7, 8]))),
    bad(lambda p: setattr(p.sinks, "data", p.lse.data), base=packed_sinks),
]
print(json.dumps(report))
"""


def test_sinks_and_packed_queries_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    report = report_of(IN_PROCESS, prefix)
    for name in ("sinks_one_split", "sinks_splits", "packed", "packed_sinks", "version_3"):
        r = report[name]
        assert r["status"] == 0, (name, r["error"])
        assert r["out"] and r["lse"] and r["caches"], (name, r)
    assert report["sinks_count"], "the sinks change lse"
    assert report["workspace"] == [0, 4 * 8 * 4 * 33 * 5]
    expected = [(4, "sinks.dtype is 1; expected LT_DTYPE_FP32"), (5, "sinks must be 1-dim with heads_q = 4"),
                (5, "q.ndim is 4; expected 3 (total_q, heads, head_dim) with cu_seqlens_q"),
                (1, "max_seqlen_q is 4 but cu_seqlens_q is absent"),
                (5, "cu_seqlens_q must have batch + 1 >= 2 entries"),
                (1, "max_seqlen_q is -3; with cu_seqlens_q it must be in 0..2147483647"),
                (5, "lse must have shape (4, 8) (heads_q, total_q) with cu_seqlens_q, got (8, 4)"),
                (5, "out must have shape (8, 4, 32)"),
                (1, "cu_seqlens_q must be nondecreasing"), (4, "cu_seqlens_q.dtype is 5"),
                (1, "lse shares memory with sinks")]
    assert_statuses(report["errors"], expected)


def test_the_planners_variants_take_sinks_and_packed_queries() -> None:
    import torch

    from lazytriton.kernels.flash_decode import binding, checks
    from lazytriton.target import Target

    sm90 = Target("cuda", "90", 32)
    for sinks, varlen_q in ((True, False), (False, True), (True, True)):
        split, combine = embedded_kvcache.plan_variants(90, 2, 64, True, True, False, 8, 512, 16, False, False,
                                                        False, sinks=sinks, varlen_q=varlen_q)
        call = checks.Call(1, 8, 1, 1, 64, 0, 512, 16, 1, 512, True, 1.0, sinks=sinks,
                           varlen_q=varlen_q)
        assert (split, combine) == binding.variants(sm90, torch.bfloat16, call, True, False)
        assert (dict(split.functional).get("SINKS", False), dict(split.functional).get("VARLEN_Q", False)) == (
            sinks, varlen_q)
        assert dict(combine.functional).get("SINKS", False) == sinks


GPU_IN_PROCESS = IN_PROCESS_PRELUDE + CUDA_DESCRIBE + r"""
torch.manual_seed(0)
report = {}
cu = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32, device="cuda")
q = torch.randn(13, 8, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(4, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.tensor([1000, 7, 512, 1024], dtype=torch.int32, device="cuda")
sinks = torch.randn(8, device="cuda")
for splits in (1, 4):
    out, lse = torch.empty_like(q), torch.empty(8, 13, device="cuda")
    work = torch.empty(4 * 13 * 8 * 129 * splits, device="cuda")
    p = ffi.new("lt_attn_kvcache_params *")
    call("lt_attn_kvcache_params_init", p)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", lens), ("out", out),
                    ("lse", lse), ("sinks", sinks), ("cu_seqlens_q", cu), ("workspace", work)):
        describe(getattr(p, name), t)
    p.causal, p.max_seqlen_q, p.num_splits = 1, 7, splits
    status = call("lt_attn_kvcache", p, ffi.NULL)
    torch.cuda.synchronize()
    want, want_lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                        sinks=sinks, cu_seqlens_q=cu, max_seqlen_q=7,
                                                        num_splits=splits, return_softmax_lse=True)
    report[str(splits)] = [status, dll.lt_last_error().decode(), (out.float() - want.float()).abs().max().item(),
                           (lse - want_lse).abs().max().item()]
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_sinks_and_packed_queries_on_a_gpu_are_the_python_call(prefix: Path, cache_dir: Path) -> None:
    report = report_of(GPU_IN_PROCESS, prefix)
    for splits, (status, message, out_err, lse_err) in report.items():
        assert status == 0, (splits, message)
        assert out_err <= 2e-2 and lse_err <= 1e-3, (splits, out_err, lse_err)
