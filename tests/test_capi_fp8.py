"""The C API's FP8: lt_attn_fwd_params version 7 (e4m3 or e5m2 q, k, v, V transposed, descales), kvcache params 6.

Through the built library on CPU tensors (Triton's interpreter), in a fresh
process as tests/test_capi_chunk.py does: out and lse equal the Python entry
points' with the same descales bit for bit (dense, causal or not, either
float8 format, descales given or absent; packed sequences; a float8 KV cache
of either format with new keys, the caches after the append too), and every
bad input is a status naming the argument (a descale misshaped or of another
dtype, V not transposed, dtype pairs, mixed formats, the backward). Older
structs keep working (test_capi_chunk.py and the other C API tests run the
version 1 to 6 structs). The plan side (no GPU here): the planner
gives the FP8 forward's variant and refuses a target without FP8 tensor cores,
lt_prewarm's axes name the variants, and the launchers' initializers are the
bindings' field by field. The GPU test launches both through plans, both
formats, with descales absent too (a null pointer, which the kernel reads as
1.0: the C library allocates no device memory for it).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from capilib import CUDA_DESCRIBE
from capilib import exit_ok as _ok
from capilib import run_program as _run
from conftest import gpu
from test_capi import VARLEN_IN_PROCESS

from lazytriton.capi import embedded, embedded_kvcache, embedded_prewarm
from lazytriton.kernels.flash_fwd import fp8
from lazytriton.kernels.flash_fwd.fp8_spec import FLASH_FWD_FP8
from lazytriton.variant import Variant

REPO = Path(__file__).resolve().parents[1]

PRELUDE = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0].replace(
    "CODES = {torch.float32: 3, torch.int32: 4}",
    "CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.int32: 4, torch.float8_e4m3fn: 5, "
    "torch.float8_e5m2: 6}")

FP8_IN_PROCESS = PRELUDE + r"""
torch.manual_seed(0)
report = {}
e4m3 = torch.float8_e4m3fn

def quantised(*shape, dtype=e4m3):
    return (torch.randn(*shape) * 2).to(dtype)

def forward(q, k, vt, causal=0, descales=(None, None, None), out=None, **extra):
    out = torch.full((*q.shape[:-1], vt.shape[-2]), 7.0, dtype=torch.bfloat16) if out is None else out
    lse = torch.full(q.shape[:3], 7.0)
    p = ffi.new("lt_attn_fwd_params *")
    lib.lt_attn_fwd_params_init(p)
    for name, t in (("q", q), ("k", k), ("v", vt), ("out", out), ("lse", lse)):
        describe(getattr(p, name), t)
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is not None:
            describe(getattr(p, name), t)
    p.causal, p.v_transposed = causal, 1
    for name, value in extra.items():
        setattr(p, name, value)
    return [lib.lt_attn_fwd(p, ffi.NULL), error()], out, lse

b, hq, hk, sq, sk, d = 2, 4, 2, 19, 37, 32
q, k, v = quantised(b, hq, sq, d), quantised(b, hk, sk, d), quantised(b, hk, sk, d)
vt = v.transpose(2, 3).contiguous()
per_head = [torch.rand(b, hk) + 0.5 for _ in range(3)]
one = [torch.rand(1) + 0.5 for _ in range(3)]
names = {0: False, 1: "top_left", 2: "bottom_right"}
report["dense"] = []
for causal in (0, 2):
    for descales in ((None, None, None), tuple(per_head), tuple(one), (per_head[0], None, one[2])):
        status, out, lse = forward(q, k, vt, causal, descales)
        want_out, want_lse = lazytriton.attn_fwd(q, k, v, causal=names[causal], q_descale=descales[0],
                                                 k_descale=descales[1], v_descale=descales[2])
        report["dense"].append([causal, status, torch.equal(out, want_out) and torch.equal(lse, want_lse)])
# With a window, softcap and attention_chunk too.
status, out, lse = forward(q, k, vt, 2, tuple(per_head), window_left=5, softcap=20.0, attention_chunk=16)
want_out, want_lse = lazytriton.attn_fwd(q, k, v, causal="bottom_right", window_size=(5, -1), softcap=20.0,
                                         attention_chunk=16, q_descale=per_head[0], k_descale=per_head[1],
                                         v_descale=per_head[2])
report["features"] = [status, torch.equal(out, want_out) and torch.equal(lse, want_lse),
                      (out.float() - want_out.float()).abs().max().item(), (lse - want_lse).abs().max().item()]
# e5m2 q, k and v: the same kernel of dtype e5m2, descales given or absent.
e5m2 = torch.float8_e5m2
q5, k5, v5 = (quantised(b, h, s, d, dtype=e5m2) for h, s in ((hq, sq), (hk, sk), (hk, sk)))
vt5 = v5.transpose(2, 3).contiguous()
report["e5m2"] = []
for causal, descales in ((0, (None, None, None)), (2, tuple(per_head)), (2, (None, one[1], None))):
    status, out, lse = forward(q5, k5, vt5, causal, descales)
    want_out, want_lse = lazytriton.attn_fwd(q5, k5, v5, causal=names[causal], q_descale=descales[0],
                                             k_descale=descales[1], v_descale=descales[2])
    report["e5m2"].append([causal, status, torch.equal(out, want_out) and torch.equal(lse, want_lse)])

# Packed sequences: v transposed (heads_k, head_dim_v, total_k).
cq = torch.tensor([0, 3, 3, 20], dtype=torch.int32)
ck = torch.tensor([0, 5, 9, 30], dtype=torch.int32)
pq, pk, pv = quantised(20, hq, d), quantised(30, hk, d), quantised(30, hk, d)
seq_scales = [torch.rand(3, hk) + 0.5 for _ in range(3)]
out, lse = torch.full((20, hq, d), 7.0, dtype=torch.bfloat16), torch.full((hq, 20), 7.0)
pvt = pv.permute(1, 2, 0).contiguous()  # kept alive: the struct holds only its pointer
p = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(p)
for name, t in (("q", pq), ("k", pk), ("v", pvt), ("out", out), ("lse", lse),
                ("cu_seqlens_q", cq), ("cu_seqlens_k", ck), ("q_descale", seq_scales[0]),
                ("k_descale", seq_scales[1]), ("v_descale", seq_scales[2])):
    describe(getattr(p, name), t)
p.max_seqlen_q, p.max_seqlen_k, p.causal, p.v_transposed = 17, 21, 2, 1
status = [lib.lt_attn_fwd(p, ffi.NULL), error()]
want_out, want_lse, _ = lazytriton.flash_attn_varlen_func(pq, pk, pv, cq, ck, 17, 21, causal=True,
                                                          return_attn_probs=True, q_descale=seq_scales[0],
                                                          k_descale=seq_scales[1], v_descale=seq_scales[2])
report["varlen"] = [status, torch.equal(out, want_out) and torch.equal(lse, want_lse),
                    (out.float() - want_out.float()).abs().max().item(), (lse - want_lse).abs().max().item()]

bf = torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
report["errors"] = {
    "not_transposed": forward(q, k, v, out=torch.zeros(b, hq, sq, d, dtype=torch.bfloat16), v_transposed=0)[0],
    "descale_shape": forward(q, k, vt, descales=(torch.ones(b, hk + 1), None, None))[0],
    "descale_dtype": forward(q, k, vt, descales=(None, torch.ones(b, hk, dtype=torch.float16), None))[0],
    "out_dtype": forward(q, k, vt, out=torch.zeros(b, hq, sq, d))[0],
    "k_dtype": forward(q, k.to(torch.float8_e5m2), vt)[0],
    "v_dtype": forward(q5, k5, vt)[0],  # one float8 format for q, k and v
    "reserved": forward(q, k, vt, reserved7=1)[0],
}
sinks = torch.zeros(hq)
p = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(p)
for name, t in (("q", q), ("k", k), ("v", vt), ("out", torch.zeros(b, hq, sq, d, dtype=torch.bfloat16)),
                ("lse", torch.zeros(b, hq, sq)), ("sinks", sinks)):
    describe(getattr(p, name), t)
p.v_transposed = 1
report["errors"]["sinks"] = [lib.lt_attn_fwd(p, ffi.NULL), error()]
# A bf16 call with v_transposed or a descale: refused, naming the field.
bk, bv = torch.randn(b, hk, sk, d, dtype=torch.bfloat16), torch.randn(b, hk, sk, d, dtype=torch.bfloat16)
out6, lse6 = torch.zeros_like(bf), torch.zeros(b, hq, sq)  # kept alive: the struct holds only pointers
p = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(p)
for name, t in (("q", bf), ("k", bk), ("v", bv), ("out", out6), ("lse", lse6)):
    describe(getattr(p, name), t)
p.v_transposed = 1
report["errors"]["bf16_transposed"] = [lib.lt_attn_fwd(p, ffi.NULL), error()]
p.v_transposed = 0
describe(p.q_descale, one[0])
report["errors"]["bf16_descale"] = [lib.lt_attn_fwd(p, ffi.NULL), error()]
# A version 6 struct ends before the FP8 fields: its bf16 call runs whatever lies past its end.
p.struct_size, p.version = ffi.offsetof("lt_attn_fwd_params", "q_descale"), 6
p.v_transposed = 1
v6 = [lib.lt_attn_fwd(p, ffi.NULL), error()]
report["v6"] = [v6, torch.equal(out6, lazytriton.attn_fwd(bf, bk, bv)[0])]
# No backward of an FP8 forward.
g = ffi.new("lt_attn_bwd_params *")
lib.lt_attn_bwd_params_init(g)
for name, t in (("q", q), ("k", k), ("v", v), ("out", torch.zeros(b, hq, sq, d, dtype=torch.bfloat16)),
                ("lse", torch.zeros(b, hq, sq)), ("dout", torch.zeros(b, hq, sq, d, dtype=torch.bfloat16)),
                ("dq", torch.zeros(b, hq, sq, d, dtype=torch.bfloat16)),
                ("dk", torch.zeros(b, hk, sk, d, dtype=torch.bfloat16)),
                ("dv", torch.zeros(b, hk, sk, d, dtype=torch.bfloat16)), ("delta", torch.zeros(b, hq, sq))):
    describe(getattr(g, name), t)
report["errors"]["backward"] = [lib.lt_attn_bwd(g, ffi.NULL), error()]

# A float8 KV cache: new keys quantised in, the split kernel dequantising, against flash_attn_with_kvcache.
def kvcache(q, k_cache, v_cache, k=None, v=None, lens=None, k_descale=None, v_descale=None, out=None):
    out = torch.full(q.shape, 7.0, dtype=q.dtype) if out is None else out
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), 7.0)
    p = ffi.new("lt_attn_kvcache_params *")
    lib.lt_attn_kvcache_params_init(p)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("cache_seqlens", lens), ("k_descale", k_descale), ("v_descale", v_descale), ("out", out),
                    ("lse", lse)):
        if t is not None:
            describe(getattr(p, name), t)
    p.causal = 1
    return [lib.lt_attn_kvcache(p, ffi.NULL), error()], out, lse

report["kvcache"] = []
for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
    for kd, vd, new in ((None, None, 0), (torch.rand(hk) + 0.5, torch.rand(1) + 0.5, 3),
                        (torch.rand(b, hk) + 0.5, torch.rand(b, hk) + 0.5, 2)):
        kq = torch.randn(b, 2, hq, d, dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, 40, hk, d) * 2).to(fmt), (torch.randn(b, 40, hk, d) * 2).to(fmt)
        lens = torch.tensor([9, 30], dtype=torch.int32)
        nk = torch.randn(b, new, hk, d, dtype=torch.bfloat16) if new else None
        nv = torch.randn(b, new, hk, d, dtype=torch.bfloat16) if new else None
        ckc, cvc = kc.clone(), vc.clone()
        status, out, lse = kvcache(kq, kc, vc, nk, nv, lens, kd, vd)
        want, want_lse = lazytriton.flash_attn_with_kvcache(kq, ckc, cvc, nk, nv, cache_seqlens=lens, causal=True,
                                                            return_softmax_lse=True, k_descale=kd, v_descale=vd)
        report["kvcache"].append([str(fmt), new, status, torch.equal(out, want), torch.equal(lse, want_lse),
                                  torch.equal(kc.view(torch.uint8), ckc.view(torch.uint8))
                                  and torch.equal(vc.view(torch.uint8), cvc.view(torch.uint8))])
kq = torch.randn(b, 1, hq, d, dtype=torch.bfloat16)
kc = torch.zeros(b, 8, hk, d).to(e4m3)
report["kv_errors"] = {
    "descale_shape": kvcache(kq, kc, kc.clone(), k_descale=torch.ones(3))[0],
    "descale_dtype": kvcache(kq, kc, kc.clone(), v_descale=torch.ones(hk, dtype=torch.float16))[0],
    "descale_plain": kvcache(kq, torch.zeros(b, 8, hk, d, dtype=torch.bfloat16),
                             torch.zeros(b, 8, hk, d, dtype=torch.bfloat16), k_descale=torch.ones(1))[0],
    "formats": kvcache(kq, kc, torch.zeros(b, 8, hk, d).to(torch.float8_e5m2))[0],
    "fp32_q": kvcache(kq.float(), kc, kc.clone(), out=torch.zeros(b, 1, hq, d))[0],
}
print(json.dumps(report))
"""


def test_fp8_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    out = _ok(_run([sys.executable, "-c", FP8_IN_PROCESS, prefix / "lib/liblazytriton.so",
                    prefix / "include/lazytriton.h"], timeout=900))
    report = json.loads(out.splitlines()[-1])
    assert len(report["dense"]) == 8
    for causal, status, equal in report["dense"]:
        assert status[0] == 0 and equal, (causal, status)
    assert report["features"][0][0] == 0 and report["features"][1], report["features"]
    assert report["varlen"][0][0] == 0 and report["varlen"][1], report["varlen"]
    assert len(report["e5m2"]) == 3
    for causal, status, equal in report["e5m2"]:
        assert status[0] == 0 and equal, (causal, status)
    expected = {"not_transposed": (1, "v_transposed"), "descale_shape": (5, "q_descale"),
                "descale_dtype": (4, "k_descale"), "out_dtype": (4, "out.dtype"), "k_dtype": (4, "k.dtype"),
                "v_dtype": (4, "v.dtype"), "sinks": (1, "sinks"), "reserved": (1, "reserved7"),
                "bf16_transposed": (1, "v_transposed"), "bf16_descale": (1, "q_descale"),
                "backward": (1, "q.dtype")}
    for name, (status, word) in expected.items():
        got = report["errors"][name]
        assert got[0] == status and word in got[1], (name, got)
    assert report["v6"][0][0] == 0 and report["v6"][1], "a version 6 struct has no FP8 fields"
    assert len(report["kvcache"]) == 6
    for fmt, new, status, out_equal, lse_equal, caches_equal in report["kvcache"]:
        assert status[0] == 0 and out_equal and lse_equal and caches_equal, (fmt, new, status)
    expected_kv = {"descale_shape": (5, "k_descale"), "descale_dtype": (4, "v_descale"),
                   "descale_plain": (1, "k_descale"), "formats": (4, "v_cache.dtype"), "fp32_q": (4, "q.dtype")}
    for name, (status, word) in expected_kv.items():
        got = report["kv_errors"][name]
        assert got[0] == status and word in got[1], (name, got)


def _initializer(source: Path, array: str) -> list[str]:
    body = re.search(rf"int64_t {array} = \{{(.*?)\}};", source.read_text(), re.S)
    assert body, f"{array} was not found in {source.name}"
    return [" ".join(item.split()) for item in body[1].split(",")]


def test_the_fp8_launcher_passes_each_description_field_by_field() -> None:
    c_items = _initializer(REPO / "capi/lazytriton.c", r"ints\[LT__FP8_KERNEL_INTS \+ LT__MAX_HIDDEN\]")
    expected = [" ".join(item.split()) for item in fp8.c_initializer().split(", ")]
    assert len(c_items) == len(fp8.INT_PARAMS) == len(FLASH_FWD_FP8.params) - 2
    for name, c_item, want in zip(fp8.INT_PARAMS, c_items, expected, strict=True):
        assert c_item == want, f"lazytriton.c passes {c_item!r} as flash_fwd_fp8's {name}; fp8.py says {want!r}"
    assert [name for name, kind in FLASH_FWD_FP8.params if kind.startswith("fp")] == ["sm_scale", "softcap"]
    text = (REPO / "capi/lazytriton.c").read_text()
    assert f"#define LT__FP8_KERNEL_PARAMS {len(FLASH_FWD_FP8.params)} " in text
    assert embedded.int_params("flash_fwd_fp8") == fp8.INT_PARAMS


def test_the_planner_gives_the_fp8_forward_and_refuses_other_targets() -> None:
    from lazytriton.kernels.flash_fwd import binding
    from lazytriton.target import Target

    planned = embedded.plan_variant("flash_fwd", 90, embedded.E4M3, 128, True, True, False, 4096, 4096,
                                    window=True, chunk=True)
    call = binding.Call(binding.Shape(1, 1, 1, 4096, 4096, 128), "bottom_right", 0, 0.1,
                        window_left=5, window_right=0, attention_chunk=7)
    assert planned == fp8.variant(Target.parse("sm_90"), call, call.shape, True, False, dtype="e4m3")
    assert planned.kernel == "flash_fwd_fp8" and planned.dtype == "e4m3"
    e5m2 = embedded.plan_variant("flash_fwd", 90, embedded.E5M2, 128, True, True, False, 4096, 4096, window=True,
                                 chunk=True)
    assert e5m2 == fp8.variant(Target.parse("sm_90"), call, call.shape, True, False, dtype="e5m2")
    assert e5m2.kernel == "flash_fwd_fp8" and e5m2.dtype == "e5m2" and e5m2.key() != planned.key()
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        embedded.plan_variant("flash_fwd", 80, embedded.E4M3, 128, False, True, False, 128, 128)
    for code in (embedded.E4M3, embedded.E5M2):
        with pytest.raises(ValueError, match="no backward"):
            embedded.plan_variant("flash_bwd_dq", 90, code, 128, False, True, False, 128, 128)
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        embedded.plan_variant("flash_fwd", 89, embedded.E5M2, 128, False, True, False, 128, 128)


def test_prewarm_axes_name_the_fp8_variants() -> None:
    (forward,) = embedded_prewarm.parse_specs("target=sm_90 dtype=e4m3 head_dim=128 causal=1")
    assert forward == embedded.plan_variant("flash_fwd", 90, embedded.E4M3, 128, True, True, False, 4096, 4096)
    (forward,) = embedded_prewarm.parse_specs("target=sm_90 dtype=e5m2 head_dim=128 causal=1")
    assert forward == embedded.plan_variant("flash_fwd", 90, embedded.E5M2, 128, True, True, False, 4096, 4096)
    with pytest.raises(ValueError, match="no backward"):
        embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=e5m2 head_dim=128")
    with pytest.raises(ValueError, match="FP8"):
        embedded_prewarm.parse_specs("target=sm_80 dtype=e4m3 head_dim=128")
    with pytest.raises(ValueError, match="no backward"):
        embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=e4m3 head_dim=128")
    append, split, combine = embedded_prewarm.parse_specs(
        "kernel=flash_decode target=sm_90 dtype=bf16 head_dim=128 kv_dtype=e4m3 new_keys=1 causal=1")
    assert (split, combine) == embedded_kvcache.plan_variants(90, 2, 128, True, True, False, 1, 4096, 0, False,
                                                              False, False, 128, kv_fp8="e4m3")
    assert "KV_FP8=e4m3" in str(split) and "KV_FP8=e4m3" in str(append) and "KV_FP8" not in str(combine)
    # kv_pairs: the calls' batch x heads_k, which the float8 split tiles follow (a contiguous cache of 4k keys:
    # 128-key tiles from 256 pairs)
    for pairs, block_n in (("1", 64), ("64", 64), ("256", 128)):
        wide, _ = embedded_prewarm.parse_specs(f"kernel=flash_decode target=sm_90 dtype=bf16 head_dim=128 "
                                               f"kv_dtype=e4m3 kv_pairs={pairs} seqlen_q=4")
        assert wide == embedded_kvcache.plan_variants(90, 2, 128, False, True, False, 4, 4096, 0, False, False,
                                                      False, 128, kv_fp8="e4m3", kv_pairs=int(pairs))[0]
        assert int(wide.get("BLOCK_N")) == block_n, pairs
    for bad, needle in (("kv_pairs=0", "kv_pairs='0'"), ("kv_dtype=none kv_pairs=8", "needs kv_dtype")):
        with pytest.raises(ValueError, match=needle):
            embedded_prewarm.parse_specs(f"kernel=flash_decode target=sm_90 dtype=bf16 head_dim=128 {bad}"
                                         + (" kv_dtype=e4m3" if "kv_dtype" not in bad else ""))
    with pytest.raises(ValueError, match="kv_pairs= is an axis of kernel=flash_decode"):
        embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=128 kv_pairs=8")
    plain = embedded_prewarm.parse_specs("kernel=flash_decode target=sm_80 dtype=fp16 head_dim=64")
    assert len(plain) == 2 and "KV_FP8" not in str(plain[0])
    e5m2, _ = embedded_prewarm.parse_specs("kernel=flash_decode target=sm_80 dtype=fp16 head_dim=64 kv_dtype=e5m2")
    assert "KV_FP8=e5m2" in str(e5m2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        embedded_prewarm.parse_specs("kernel=flash_decode target=sm_80 dtype=bf16 head_dim=64 kv_dtype=e4m3")
    with pytest.raises(ValueError, match="kv_dtype"):
        embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64 kv_dtype=e4m3")


GPU_FP8 = PRELUDE.split("CODES = ")[0] + CUDA_DESCRIBE.replace(
    "{torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.int32: 4}",
    "{torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.int32: 4, torch.float8_e4m3fn: 5, "
    "torch.float8_e5m2: 6}") + r"""
def error():
    return dll.lt_last_error().decode()

torch.manual_seed(0)
report = {"fwd": []}
b, hq, hk, sq, sk, d = 2, 8, 2, 1000, 1500, 128
scales = [torch.rand(b, hk, device="cuda") + 0.5 for _ in range(3)]
# Both formats; descales all given, all absent (NULL: the kernel reads 1.0), or some.
for fmt, given in ((torch.float8_e4m3fn, (0, 1, 2)), (torch.float8_e4m3fn, ()), (torch.float8_e5m2, (1,)),
                   (torch.float8_e5m2, ())):
    q, k, v = [(torch.randn(b, h, s, d, device="cuda") * 2).to(fmt) for h, s in ((hq, sq), (hk, sk), (hk, sk))]
    padded = torch.zeros(b, hk, d, (sk + 15) // 16 * 16, device="cuda").to(fmt)
    vt = padded[..., :sk]
    vt.copy_(v.transpose(2, 3))
    descales = [scales[i] if i in given else None for i in range(3)]
    out = torch.zeros(b, hq, sq, d, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(b, hq, sq, device="cuda")
    p = ffi.new("lt_attn_fwd_params *")
    lib.lt_attn_fwd_params_init(p)
    for name, t in (("q", q), ("k", k), ("v", vt), ("out", out), ("lse", lse), ("q_descale", descales[0]),
                    ("k_descale", descales[1]), ("v_descale", descales[2])):
        if t is not None:
            describe(getattr(p, name), t)
    p.causal, p.v_transposed = 2, 1
    status = [lib.lt_attn_fwd(p, ffi.NULL), error()]
    torch.cuda.synchronize()
    want, want_lse = lazytriton.attn_fwd(q, k, v, causal="bottom_right", q_descale=descales[0],
                                         k_descale=descales[1], v_descale=descales[2])
    report["fwd"].append([str(fmt), list(given), status, (out.float() - want.float()).abs().max().item(),
                          (lse - want_lse).abs().max().item()])
print(json.dumps(report))
"""


@gpu
def test_fp8_forward_on_the_gpu_through_a_plan(prefix: Path, cache_dir: Path) -> None:
    out = _ok(_run([sys.executable, "-c", GPU_FP8, prefix / "lib/liblazytriton.so", prefix / "include/lazytriton.h"],
                   timeout=900))
    report = json.loads(out.splitlines()[-1])
    assert len(report["fwd"]) == 4
    for fmt, given, status, out_error, lse_error in report["fwd"]:
        assert status[0] == 0, (fmt, given, status)
        assert out_error < 1e-2 and lse_error < 1e-3, report  # the same kernel and tiles as the Python call's


# A float8 KV cache through lt_attn_kvcache's plans on the GPU, the tiles following the (sequence, key/value head)
# pairs: one shape class but for the batch, asked in the order 1, 32, 1, 8 sequences (pairs 8, 256, 8, 64). After
# each C call the split variant dispatch gives a Python call of that batch (64 or 128 keys a tile) is among the
# kernels the process has loaded, before the Python reference call runs: a plan key that held one class for another
# would have run the other class's tile and loaded nothing new. Out and lse against flash_attn_with_kvcache's.
GPU_FP8_KVCACHE = GPU_FP8.split("torch.manual_seed(0)")[0] + r"""
from lazytriton import runtime
from lazytriton.kernels import dispatch
from lazytriton.machine import target_of_device

torch.manual_seed(0)
report = {"kvcache": []}
hq, hk, d, length = 32, 8, 128, 4096
target = target_of_device(torch.device("cuda"))
for fmt, paged, batch in ((torch.float8_e4m3fn, True, 1), (torch.float8_e4m3fn, True, 32),
                          (torch.float8_e4m3fn, True, 1), (torch.float8_e4m3fn, True, 8),
                          (torch.float8_e5m2, False, 256), (torch.float8_e5m2, False, 1)):
    q = torch.randn(batch, 1, hq, d, dtype=torch.bfloat16, device="cuda")
    shape = (batch * length // 256, 256, hk, d) if paged else (batch, length, hk, d)
    kc, vc = [(torch.randn(shape, device="cuda") * 2).to(fmt) for _ in range(2)]
    table = (torch.randperm(batch * length // 256, device="cuda").reshape(batch, -1).to(torch.int32) if paged
             else None)
    lens = torch.randint(length // 2, length + 1, (batch,), dtype=torch.int32, device="cuda")
    kd, vd = torch.rand(batch, hk, device="cuda") + 0.5, torch.rand(hk, device="cuda") + 0.5
    out = torch.full(q.shape, 7.0, dtype=q.dtype, device="cuda")
    lse = torch.full((batch, hq, 1), 7.0, device="cuda")
    p = ffi.new("lt_attn_kvcache_params *")
    lib.lt_attn_kvcache_params_init(p)
    for name, t in (("q", q), ("k_cache", kc), ("v_cache", vc), ("cache_seqlens", lens), ("block_table", table),
                    ("k_descale", kd), ("v_descale", vd), ("out", out), ("lse", lse)):
        if t is not None:
            describe(getattr(p, name), t)
    status = [lib.lt_attn_kvcache(p, ffi.NULL), error()]
    torch.cuda.synchronize()
    split = dispatch.kernel_variant("flash_decode_split", target, "bf16", d, False, True, hq // hk, length,
                                    paged=paged, page_size=256 if paged else 0,
                                    kv_fp8="e4m3" if fmt == torch.float8_e4m3fn else "e5m2", kv_pairs=batch * hk)
    loaded = {kernel.entry.key for kernel in runtime.get().loaded_kernels()}
    want, want_lse = lazytriton.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                        return_softmax_lse=True, k_descale=kd, v_descale=vd)
    report["kvcache"].append([str(fmt), paged, batch, status, split.key() in loaded, str(split),
                              (out.float() - want.float()).abs().max().item(),
                              (lse - want_lse.reshape(lse.shape)).abs().max().item()])
print(json.dumps(report))
"""


@gpu
def test_a_float8_cache_on_the_gpu_takes_each_pair_class_s_plan(prefix: Path, cache_dir: Path) -> None:
    out = _ok(_run([sys.executable, "-c", GPU_FP8_KVCACHE, prefix / "lib/liblazytriton.so",
                    prefix / "include/lazytriton.h"], timeout=900))
    report = json.loads(out.splitlines()[-1])
    assert len(report["kvcache"]) == 6
    assert {int(Variant.parse(case[5]).get("BLOCK_N")) for case in report["kvcache"]} == {64, 128}
    for fmt, paged, batch, status, loaded, split, out_error, lse_error in report["kvcache"]:
        assert status[0] == 0 and loaded, (fmt, paged, batch, status, split)
        assert out_error < 2e-2 and lse_error < 1e-3, (fmt, paged, batch, out_error, lse_error)
