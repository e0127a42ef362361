"""lt_attn_kvcache_params version 7: MLA's qv and new keys packed by cu_seqlens_k_new in the C API.

On CPU tensors through the built library (Triton's interpreter), in a fresh process as the other C API tests do:
out, lse and the caches equal ``flash_attn_with_kvcache``'s with the same qv and packed new keys, bit for bit
(qv the first head_dim_v columns of q's rows, as the C API takes it; dense and packed queries, contiguous and
paged caches, new keys, several splits, v of 512); a version 6 struct is read without them whatever its memory
holds past its end; bad input is a status naming the argument, the caches untouched. The plan side (no GPU here):
the planner's variants are a Python call's (QV on the split kernel). On a GPU (marked): qv launched from C equals
the Python call, with packed new keys too (kv_append_lengths writes the lengths into the workspace).
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

CODES[torch.float8_e5m2] = 6

def rows(*shape, dv, dtype=torch.float32):
    # q and qv as the two parts of one row [qv | q] (DeepSeek's absorbed q_nope, then q_pe)
    row = torch.randn(*shape[:-1], dv + shape[-1]).to(dtype)
    return row[..., dv:], row[..., :dv]

# qv, dense queries over a paged cache, new keys, causal, several splits; the default scale counts qv's columns.
q, qv = rows(2, 3, 4, 16, dv=48)
pages = torch.randn(8, 16, 1, 16), torch.randn(8, 16, 1, 48)
table = torch.randperm(8, dtype=torch.int32)[:6].reshape(2, 3).contiguous()
dense = {"q": q, "k_cache": pages[0], "v_cache": pages[1], "k": torch.randn(2, 2, 1, 16), "v": torch.randn(2, 2, 1, 48),
         "cache_seqlens": torch.tensor([30, 4], dtype=torch.int32), "block_table": table, "qv": qv}
case("qv_paged", dense, {"qv": qv, "causal": True, "num_splits": 2}, causal=1, num_splits=2)

# qv with packed queries (3, 0, 2) over a contiguous cache, one split; then v of 512 (MLA's latent width).
q, qv = rows(5, 4, 32, dv=64)
cache = torch.randn(3, 24, 2, 32), torch.randn(3, 24, 2, 64)
cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
packed = {"q": q, "k_cache": cache[0], "v_cache": cache[1], "cu_seqlens_q": cu, "qv": qv,
          "cache_seqlens": torch.tensor([24, 7, 11], dtype=torch.int32)}
case("qv_packed", packed, {"qv": qv, "causal": True, "max_seqlen_q": 3}, causal=1, max_seqlen_q=3)
q, qv = rows(1, 2, 2, 16, dv=512)
wide = {"q": q, "k_cache": torch.randn(1, 20, 1, 16), "v_cache": torch.randn(1, 20, 1, 512), "qv": qv}
case("qv_512", wide, {"qv": qv, "num_splits": 3}, num_splits=3)

# New keys packed by cu_seqlens_k_new (2, 0, 3), paged, causal, with packed queries; then with qv too.
cu_new = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
pages = torch.randn(12, 16, 2, 32), torch.randn(12, 16, 2, 32)
table = torch.randperm(12, dtype=torch.int32)[:9].reshape(3, 3).contiguous()
new_keys = {"q": torch.randn(5, 4, 32), "k_cache": pages[0], "v_cache": pages[1], "k": torch.randn(5, 2, 32),
            "v": torch.randn(5, 2, 32), "cache_seqlens": torch.tensor([40, 0, 17], dtype=torch.int32),
            "block_table": table, "cu_seqlens_q": cu, "cu_seqlens_k_new": cu_new}
case("packed_new", new_keys, {"cu_seqlens_k_new": cu_new, "causal": True, "max_seqlen_q": 3, "num_splits": 2},
     causal=1, max_seqlen_q=3, num_splits=2)
q, qv = rows(5, 4, 32, dv=32)
both = {**{n: t.clone() for n, t in new_keys.items()}, "q": q, "qv": qv}
case("packed_new_qv", both, {"cu_seqlens_k_new": both["cu_seqlens_k_new"], "qv": qv, "max_seqlen_q": 3},
     max_seqlen_q=3)

# A version 6 struct: taken, and qv and cu_seqlens_k_new described past its end are not read.
def as_version_6(p):
    describe(p.qv, torch.randn(2, 3, 4, 48))
    describe(p.cu_seqlens_k_new, cu_new)
    p.struct_size, p.version = ffi.offsetof("lt_attn_kvcache_params", "qv"), 6
plain = {n: t.clone() for n, t in dense.items() if n != "qv"}
case("version_6", plain, {"causal": True, "num_splits": 2}, as_version_6, causal=1, num_splits=2)

# Bad input: a status and a message naming the argument, the caches untouched.
def bad(change, base=dense):
    tensors = {n: t.clone() if n not in ("q", "qv") else t for n, t in base.items()}
    q, dv = tensors["q"], tensors["v_cache"].shape[-1]
    out = torch.empty(*q.shape[:-1], dv, dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0]) if q.dim() == 3 else torch.empty(q.shape[0], q.shape[2], q.shape[1])
    return refused({**tensors, "out": out, "lse": lse}, change,
                   **({"max_seqlen_q": 3} if "cu_seqlens_q" in base else {}))

apart = torch.randn(2, 3, 4, 64)[..., :48]  # q's strides, its own buffer
q16, qv16 = rows(2, 3, 4, 16, dv=48, dtype=torch.float16)
fp8 = {"q": q16, "qv": qv16, "k_cache": dense["k_cache"].to(torch.float8_e5m2),
       "v_cache": dense["v_cache"].to(torch.float8_e5m2), "cache_seqlens": dense["cache_seqlens"],
       "block_table": dense["block_table"]}
report["errors"] = [
    bad(lambda p: describe(p.qv, apart)),
    bad(lambda p: describe(p.qv, dense["qv"].clone())),
    bad(lambda p: describe(p.qv, dense["qv"][:, :, :2])),
    bad(lambda p: describe(p.qv, dense["qv"].half())),
    bad(lambda p: None, base=fp8),
    bad(lambda p: describe(p.cu_seqlens_k_new, cu_new.long()), base=new_keys),
    bad(lambda p: describe(p.cu_seqlens_k_new, cu_new[:3]), base=new_keys),
    bad(lambda p: describe(p.k, torch.randn(1, 5, 2, 32)), base=new_keys),
    bad(lambda p: (absent(p.k), absent(p.v)), base=new_keys),
    bad(lambda p: describe(p.cu_seqlens_k_new, torch.tensor([0, 2, 1, 5], dtype=torch.int32)), base=new_keys),
]
print(json.dumps(report))
"""


def test_qv_and_packed_new_keys_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    report = report_of(IN_PROCESS, prefix)
    for name in ("qv_paged", "qv_packed", "qv_512", "packed_new", "packed_new_qv", "version_6"):
        r = report[name]
        assert r["status"] == 0, (name, r["error"])
        assert r["out"] and r["lse"] and r["caches"], (name, r)
    expected = [(5, "q.data must be qv.data + head_dim_v (48) elements"),
                (5, "qv.strides[0] is 576 but q.strides[0] is 768"),
                (5, "qv must have shape (2, 3, 4, 48)"),
                (4, "qv.dtype is fp16 but q.dtype is fp32"),
                (1, "qv with a float8 cache is not supported"),
                (4, "cu_seqlens_k_new.dtype is 5"),
                (5, "cu_seqlens_k_new must have shape (batch + 1,)"),
                (5, "k.ndim is 4; expected 3 (total_new, heads_k, head_dim) with cu_seqlens_k_new"),
                (1, "cu_seqlens_k_new is given without k and v"),
                (1, "cu_seqlens_k_new")]
    assert_statuses(report["errors"], expected)


def test_the_planners_variants_take_qv() -> None:
    import torch

    from lazytriton.kernels.flash_decode import binding, checks
    from lazytriton.target import Target

    sm90 = Target("cuda", "90", 32)
    for paged, varlen_q in ((False, False), (True, True)):
        split, combine = embedded_kvcache.plan_variants(90, 2, 64, True, True, False, 32, 8192, 64 if paged else 0,
                                                        False, False, False, 512, varlen_q=varlen_q, qv=True)
        call = checks.Call(1, 16, 1, 2, 64, 0, 8192, 64 if paged else 0, 1, 8192, True, 1.0, head_dim_v=512,
                           varlen_q=varlen_q, qv=True)
        assert (split, combine) == binding.variants(sm90, torch.bfloat16, call, True, False)
        assert "QV=true" in str(split) and "BLOCK_DV=512" in str(split) and "QV" not in str(combine)


GPU_IN_PROCESS = IN_PROCESS_PRELUDE + CUDA_DESCRIBE + r"""
torch.manual_seed(0)
report = {}
row = torch.randn(3, 2, 128, 576, device="cuda", dtype=torch.bfloat16)  # [qv (512) | q (64)]: MLA's absorbed q
q, qv = row[..., 512:], row[..., :512]
k_cache = torch.randn(96, 64, 1, 64, device="cuda", dtype=torch.bfloat16)
v_cache = torch.randn(96, 64, 1, 512, device="cuda", dtype=torch.bfloat16)
table = torch.randperm(96, device="cuda", dtype=torch.int32).view(3, 32)
lens = torch.tensor([2000, 17, 1024], dtype=torch.int32, device="cuda")

def params(splits, **extra):
    out, lse = torch.empty(3, 2, 128, 512, device="cuda", dtype=torch.bfloat16), torch.empty(3, 128, 2, device="cuda")
    work = torch.empty(4 * 3 * 2 * 128 * 513 * splits, device="cuda")
    p = ffi.new("lt_attn_kvcache_params *")
    call("lt_attn_kvcache_params_init", p)
    for name, t in (("q", q), ("qv", qv), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", lens),
                    ("block_table", table), ("out", out), ("lse", lse), ("workspace", work), *extra.items()):
        describe(getattr(p, name), t)
    p.causal, p.num_splits = 1, splits
    return p, out, lse

for splits in (1, 4):
    p, out, lse = params(splits)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    torch.cuda.synchronize()
    want, want_lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                        qv=qv, causal=True, num_splits=splits,
                                                        return_softmax_lse=True)
    report[str(splits)] = [status, dll.lt_last_error().decode(), (out.float() - want.float()).abs().max().item(),
                           (lse - want_lse).abs().max().item()]
# Packed new keys (1, 0, 3): kv_append (VARLEN), kv_append_lengths into the workspace, then the split kernel.
new_k = torch.randn(4, 1, 64, device="cuda", dtype=torch.bfloat16)
new_v = torch.randn(4, 1, 512, device="cuda", dtype=torch.bfloat16)
cu_new = torch.tensor([0, 1, 1, 4], dtype=torch.int32, device="cuda")
caches = k_cache.clone(), v_cache.clone()
p, out, lse = params(1, k=new_k, v=new_v, cu_seqlens_k_new=cu_new)
status = call("lt_attn_kvcache", p, ffi.NULL)
torch.cuda.synchronize()
want, want_lse = lazytriton.flash_attn_with_kvcache(q, caches[0], caches[1], k=new_k, v=new_v, cache_seqlens=lens,
                                                    block_table=table, qv=qv, causal=True, num_splits=1,
                                                    cu_seqlens_k_new=cu_new, return_softmax_lse=True)
report["packed_new"] = [status, dll.lt_last_error().decode(), (out.float() - want.float()).abs().max().item(),
                        (lse - want_lse).abs().max().item()]
report["packed_new_caches"] = torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_qv_on_a_gpu_is_the_python_call(prefix: Path, cache_dir: Path) -> None:
    report = report_of(GPU_IN_PROCESS, prefix)
    assert report.pop("packed_new_caches"), "C's append wrote the caches as Python's"
    for splits, (status, message, out_err, lse_err) in report.items():
        assert status == 0, (splits, message)
        assert out_err <= 2e-2 and lse_err <= 1e-3, (splits, out_err, lse_err)
