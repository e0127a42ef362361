"""The C API's attention_chunk: lt_attn_fwd_params and lt_attn_bwd_params version 6, lt_attn_kvcache_params version 5.

Through the built library on CPU tensors (Triton's interpreter), in a fresh
process as tests/test_capi.py does: out, lse, dq, dk and dv equal the Python
entry points' with the same chunk bit for bit (dense at every causal mode,
packed sequences, the KV cache contiguous and paged with new keys), a struct
of the previous version is read without a chunk whatever its memory holds past
its end, and a bad chunk is a status naming it. The plan side (no GPU here):
a plan of a chunked call loads the bindings' CHUNK variants on all three
attention kernels and on the decoding split kernel (tests/test_native_choice.py
and tests/test_native_decode_choice.py hold the native core's choice to these),
and the launchers pass the checked chunk (tests/test_binding.py, test_capi.py
and test_capi_kvcache.py hold their initializers to the bindings'). The GPU test
runs chunked calls through plans at real sizes against float64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from capilib import ATTN_PARAMS, CUDA_DESCRIBE, KVCACHE_CASE, KVCACHE_PRELUDE
from capilib import exit_ok as _ok
from capilib import run_program as _run
from conftest import gpu
from test_capi import VARLEN_IN_PROCESS

from lazytriton.capi import embedded, embedded_kvcache, embedded_prewarm
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_decode import binding as decode
from lazytriton.kernels.flash_fwd import binding as fwd

ATTENTION_IN_PROCESS = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0] + ATTN_PARAMS + """
torch.manual_seed(0)
q, k, v = torch.randn(2, 4, 21, 16), torch.randn(2, 2, 29, 16), torch.randn(2, 2, 29, 16)
report = {}

def forward(q, k, v, causal, chunk, struct=None, **extra):
    out, lse = torch.full(q.shape, 7.0), torch.full(q.shape[:3], 7.0)
    p = attn_params("fwd", {"q": q, "k": k, "v": v, "out": out, "lse": lse}, struct, causal=causal,
                    attention_chunk=chunk, **extra)
    return [lib.lt_attn_fwd(p, ffi.NULL), error()], out, lse

def backward(out, lse, do, causal, chunk, struct=None):
    tensors, grads = bwd_tensors(q, k, v, out, lse, do)
    g = attn_params("bwd", tensors, struct, causal=causal, attention_chunk=chunk)
    return [lib.lt_attn_bwd(g, ffi.NULL), error()], grads

names = {0: False, 1: "top_left", 2: "bottom_right"}
report["dense"] = []
for causal in (0, 1, 2):
    for chunk in (5, 16):
        status, out, lse = forward(q, k, v, causal, chunk)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want_out, want_lse = lazytriton.attn_fwd(*leaves, causal=names[causal], attention_chunk=chunk)
        do = torch.randn_like(out)
        wanted = torch.autograd.grad(want_out, leaves, do)
        bwd_status, grads = backward(out, lse, do, causal, chunk)
        report["dense"].append([causal, chunk, status, bwd_status,
                                torch.equal(out, want_out.detach()) and torch.equal(lse, want_lse),
                                all(torch.equal(a, b) for a, b in zip(grads, wanted)),
                                not torch.equal(lse, lazytriton.attn_fwd(q, k, v, causal=names[causal])[1])])

# With a window too: the tighter bound wins on each side.
status, out, lse = forward(q, k, v, 2, 7, window_left=3, window_right=-1)
want_out, want_lse = lazytriton.attn_fwd(q, k, v, causal="bottom_right", window_size=(3, -1), attention_chunk=7)
report["window"] = [status, torch.equal(out, want_out) and torch.equal(lse, want_lse)]

# A version 5 struct ends before the chunk: whatever lies past its end is not read.
status, out, lse = forward(q, k, v, 0, 5, struct=(ffi.offsetof("lt_attn_fwd_params", "attention_chunk"), 5))
plain_out, plain_lse = lazytriton.attn_fwd(q, k, v)
report["v5"] = [status, torch.equal(out, plain_out) and torch.equal(lse, plain_lse)]
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
plain_out, plain_lse = lazytriton.attn_fwd(*leaves)
do = torch.randn_like(plain_out)
status, grads = backward(plain_out.detach(), plain_lse.detach(), do, 0, 5,
                         struct=(ffi.offsetof("lt_attn_bwd_params", "attention_chunk"), 5))
report["bwd_v5"] = [status, all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(plain_out, leaves, do)))]

# Packed sequences, each chunked bottom-right against its own keys, against flash_attn_varlen_func's autograd.
cq = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)  # lengths 3, 0, 17, 1
ck = torch.tensor([0, 5, 9, 18, 18], dtype=torch.int32)  # lengths 5, 4, 9, 0
pq, pk, pv, pdo = torch.randn(21, 4, 16), torch.randn(18, 2, 16), torch.randn(18, 2, 16), torch.randn(21, 4, 16)
out, lse = torch.full_like(pq, 7.0), torch.full((4, 21), 7.0)
packed = {"cu_seqlens_q": cq, "cu_seqlens_k": ck}
p = attn_params("fwd", {"q": pq, "k": pk, "v": pv, "out": out, "lse": lse, **packed}, max_seqlen_q=17,
                max_seqlen_k=9, causal=2, attention_chunk=4)
status = [lib.lt_attn_fwd(p, ffi.NULL), error()]
leaves = [t.clone().requires_grad_() for t in (pq, pk, pv)]
want_out, want_lse, _ = lazytriton.flash_attn_varlen_func(*leaves, cq, ck, 17, 9, causal=True,
                                                          return_attn_probs=True, attention_chunk=4)
wanted = torch.autograd.grad(want_out, leaves, pdo)
tensors, grads = bwd_tensors(pq, pk, pv, out, lse, pdo)
g = attn_params("bwd", {**tensors, **packed}, max_seqlen_q=17, max_seqlen_k=9, causal=2, attention_chunk=4)
report["varlen"] = [status, [lib.lt_attn_bwd(g, ffi.NULL), error()],
                    torch.equal(out, want_out.detach()) and torch.equal(lse, want_lse),
                    all(torch.equal(a, b) for a, b in zip(grads, wanted))]

report["errors"] = [forward(q, k, v, 0, -1)[0], forward(q, k, v, 0, 5, struct=(ffi.sizeof("lt_attn_fwd_params"), 5))[0]]
do = torch.randn(2, 4, 21, 16)
report["bwd_errors"] = [backward(torch.zeros(2, 4, 21, 16), torch.zeros(2, 4, 21), do, 0, -3)[0]]
print(json.dumps(report))
"""


def test_chunked_attention_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    out = _ok(_run([sys.executable, "-c", ATTENTION_IN_PROCESS, prefix / "lib/liblazytriton.so",
                    prefix / "include/lazytriton.h"]))
    report = json.loads(out.splitlines()[-1])
    for causal, chunk, fwd_status, bwd_status, out_equal, grads_equal, chunked in report["dense"]:
        assert fwd_status[0] == 0 and bwd_status[0] == 0, (causal, chunk, fwd_status, bwd_status)
        assert out_equal and grads_equal, f"causal {causal}, chunk {chunk}: the C call differs from the Python one"
        assert chunked, f"causal {causal}, chunk {chunk}: the chunk changes lse"
    assert report["window"][0][0] == 0 and report["window"][1], report["window"]
    assert report["v5"][0][0] == 0 and report["v5"][1], "a version 5 struct has no chunk"
    assert report["bwd_v5"][0][0] == 0 and report["bwd_v5"][1], "a version 5 backward struct has no chunk"
    fwd_status, bwd_status, out_equal, grads_equal = report["varlen"]
    assert fwd_status[0] == 0 and bwd_status[0] == 0, (fwd_status, bwd_status)
    assert out_equal and grads_equal, "packed sequences with a chunk: the C call differs from the Python one"
    (negative, message), (size, size_message) = report["errors"]
    assert negative == 1 and "attention_chunk is -1; expected 0 (off)" in message, message
    assert size == 3 and "version" in size_message, size_message  # this size is version 6's
    (status, message), = report["bwd_errors"]
    assert status == 1 and "attention_chunk is -3" in message, message


KVCACHE_IN_PROCESS = KVCACHE_PRELUDE + KVCACHE_CASE + r"""
torch.manual_seed(0)
report = {}

cache = torch.randn(2, 40, 2, 32), torch.randn(2, 40, 2, 32)
lens = torch.tensor([33, 9], dtype=torch.int32)
dense = {"q": torch.randn(2, 3, 4, 32), "k_cache": cache[0], "v_cache": cache[1], "cache_seqlens": lens}
chunked = case("dense_one_split", dense, {"causal": True, "num_splits": 1, "attention_chunk": 8}, causal=1,
               num_splits=1, attention_chunk=8)
case("dense_splits", dense, {"num_splits": 3, "attention_chunk": 5}, num_splits=3, attention_chunk=5)
report["chunked"] = not torch.equal(chunked, lazytriton.flash_attn_with_kvcache(
    dense["q"], *cache, cache_seqlens=lens, causal=True, return_softmax_lse=True)[1])

pages = torch.randn(12, 16, 2, 32), torch.randn(12, 16, 2, 32)
table = torch.randperm(12, dtype=torch.int32).reshape(4, 3).contiguous()
cu = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)
packed = {"q": torch.randn(8, 4, 32), "k_cache": pages[0], "v_cache": pages[1], "k": torch.randn(4, 2, 2, 32),
          "v": torch.randn(4, 2, 2, 32), "cache_seqlens": torch.tensor([5, 0, 30, 46], dtype=torch.int32),
          "block_table": table, "cu_seqlens_q": cu}
case("packed_paged", packed, {"causal": True, "num_splits": 2, "max_seqlen_q": 4, "attention_chunk": 16}, causal=1,
     num_splits=2, max_seqlen_q=4, attention_chunk=16)

def as_version_4(p):  # no chunk: a chunk past its end is not read
    p.attention_chunk = 3
    p.struct_size, p.version = ffi.offsetof("lt_attn_kvcache_params", "attention_chunk"), 4
case("version_4", dense, {"causal": True, "num_splits": 2}, as_version_4, causal=1, num_splits=2)

out, lse = torch.empty(2, 3, 4, 32), torch.empty(2, 4, 3)
p = params({**dense, "out": out, "lse": lse}, attention_chunk=-2)
report["error"] = [call("lt_attn_kvcache", p, ffi.NULL), error()]
print(json.dumps(report))
"""


def test_chunked_decoding_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    out = _ok(_run([sys.executable, "-c", KVCACHE_IN_PROCESS, prefix / "lib/liblazytriton.so",
                    prefix / "include/lazytriton.h"]))
    report = json.loads(out.splitlines()[-1])
    for name in ("dense_one_split", "dense_splits", "packed_paged", "version_4"):
        case = report[name]
        assert case["status"] == 0, (name, case["error"])
        assert case["out"] and case["lse"] and case["caches"], (name, case)
    assert report["chunked"], "the chunk changes lse"
    status, message = report["error"]
    assert status == 1 and "attention_chunk is -2" in message, message


def _flag(variant: object, name: str) -> bool:
    return dict(variant.functional).get(name, False) is True  # type: ignore[attr-defined]


def test_a_chunked_plan_loads_the_bindings_chunk_variants() -> None:
    import torch

    from lazytriton.target import Target

    sm90 = Target("cuda", "90", 32)
    shape = fwd.Shape(1, 1, 1, 300, 257, 128)
    chosen = embedded.plan_variant("flash_fwd", 90, 2, 128, True, True, False, 300, 257, chunk=True)
    assert chosen == fwd.variant(sm90, torch.bfloat16, shape, True, True, False, chunk=True) and _flag(chosen, "CHUNK")
    pair = bwd.variants(sm90, torch.bfloat16, shape, True, True, False, chunk=True)
    for kernel, want in zip(("flash_bwd_dq", "flash_bwd_dkdv"), pair, strict=True):
        got = embedded.plan_variant(kernel, 90, 2, 128, True, True, False, 300, 257, chunk=True)
        assert got == want and _flag(got, "CHUNK"), kernel
    packed = embedded.plan_variant("flash_fwd", 90, 2, 128, False, True, False, 300, 257, True, chunk=True)
    assert _flag(packed, "VARLEN") and _flag(packed, "CHUNK")
    split, combine = embedded_kvcache.plan_variants(90, 2, 128, True, True, False, 4, 4096, 0, False, False, False,
                                                    chunk=True)
    assert _flag(split, "CHUNK") and not _flag(combine, "CHUNK")


def test_the_c_launchers_pass_the_checked_chunk() -> None:
    assert "c->attention_chunk" in fwd.c_initializer().split(", ")
    assert all("c->attention_chunk" in bwd.c_initializer(k).split(", ") for k in ("flash_bwd_dq", "flash_bwd_dkdv"))
    assert "c->attention_chunk" in decode.c_initializer("flash_decode_split").split(", ")


GPU_IN_PROCESS = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0] + CUDA_DESCRIBE + """
torch.manual_seed(0)
q, k, v = (torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(2, 8, 1000, device="cuda")
p = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(p)
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
    describe(getattr(p, name), t)
p.causal, p.attention_chunk = 2, 256
report = {"fwd": [lib.lt_attn_fwd(p, ffi.NULL), error()]}
plan = ffi.new("lt_plan **")
report["plan"] = [lib.lt_attn_fwd_plan(p, plan), error()]
plain = ffi.new("lt_attn_fwd_params *")
ffi.memmove(plain, p, ffi.sizeof("lt_attn_fwd_params"))
plain.attention_chunk = 0
report["mismatch"] = [lib.lt_plan_launch(plan[0], plain, ffi.NULL), error()]
torch.cuda.synchronize()

def reference(q, k, v, dtype):  # causal bottom-right (square: top-left), each query within its chunk of 256
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(dtype), k.to(dtype)) / 128 ** 0.5
    i, j = torch.arange(1000, device="cuda")[:, None], torch.arange(1000, device="cuda")[None]
    s = s.masked_fill((j > i) | (j // 256 != i // 256), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.to(dtype)), s.logsumexp(-1)

ref, ref_lse = reference(q, k, v, torch.float64)
same, _ = reference(q, k, v, torch.bfloat16)
report["fwd_error"] = [(out.double() - ref).abs().max().item(), (same.double() - ref).abs().max().item(),
                       (lse.double() - ref_lse).abs().max().item()]
do = torch.randn_like(out)
leaves = [t.double().requires_grad_() for t in (q, k, v)]
wanted = torch.autograd.grad(reference(*leaves, torch.float64)[0], leaves, do.double())
low = [t.clone().requires_grad_() for t in (q, k, v)]
same_grads = torch.autograd.grad(reference(*low, torch.bfloat16)[0], low, do)
grads = [torch.empty_like(t) for t in (q, k, v)]
g = ffi.new("lt_attn_bwd_params *")
lib.lt_attn_bwd_params_init(g)
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", do), ("dq", grads[0]),
                ("dk", grads[1]), ("dv", grads[2]), ("delta", torch.empty(2, 8, 1000, device="cuda"))):
    describe(getattr(g, name), t)
g.causal, g.attention_chunk = 2, 256
report["bwd"] = [lib.lt_attn_bwd(g, ffi.NULL), error()]
torch.cuda.synchronize()
report["grad_error"] = [[(a.double() - w).abs().max().item(), (b.double() - w).abs().max().item()]
                        for a, b, w in zip(grads, same_grads, wanted)]
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_chunked_attention_through_plans_on_the_gpu(prefix: Path, cache_dir: Path) -> None:
    """FlashAttention's rule against float64: forward error at most 2x bf16 PyTorch's, gradients 3x."""
    out = _ok(_run([sys.executable, "-c", GPU_IN_PROCESS, prefix / "lib/liblazytriton.so",
                    prefix / "include/lazytriton.h"]))
    report = json.loads(out.splitlines()[-1])
    assert report["fwd"][0] == 0 and report["plan"][0] == 0 and report["bwd"][0] == 0, report
    status, message = report["mismatch"]
    assert status == 10 and "attention_chunk" in message, message
    mine, same, lse_error = report["fwd_error"]
    assert mine <= 2 * same + 1e-5 and lse_error <= 1e-3, report["fwd_error"]
    for mine, same in report["grad_error"]:
        assert mine <= 3 * same + 1e-5, report["grad_error"]


def test_prewarm_specs_take_prewarm_s_sinks_and_attention_chunk_axes() -> None:
    """lt_prewarm's axes name them as `lazytriton prewarm` does (--sinks, --attention-chunk)."""
    from lazytriton.kernels import flash_bwd_dsinks
    from lazytriton.target import Target

    sm90 = Target.parse("sm_90")
    (plain,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64")
    (chunked,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64 attention_chunk=1")
    (sunk,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64 sinks=1")
    assert _flag(chunked, "CHUNK") and _flag(sunk, "SINKS") and not (_flag(plain, "CHUNK") or _flag(plain, "SINKS"))
    assert chunked == embedded.plan_variant("flash_fwd", 90, 2, 64, False, True, False, 4096, 4096, chunk=True)
    dq, dkdv = embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=bf16 head_dim=64 attention_chunk=1")
    assert _flag(dq, "CHUNK") and _flag(dkdv, "CHUNK")
    *pair, reduction = embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=bf16 head_dim=64 sinks=1 "
                                                    "varlen=1 seqused_q=1")
    assert reduction == flash_bwd_dsinks.variant(sm90, True, True, False)
    assert not any(_flag(v, "SINKS") for v in pair)
    with pytest.raises(ValueError, match="attention_chunk='2'"):
        embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64 attention_chunk=2")
