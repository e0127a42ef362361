"""The C API's attention sinks (lt_attn_fwd_params and lt_attn_bwd_params version 5).

Through the built library on CPU tensors (Triton's interpreter), in a fresh
process as tests/test_capi.py does: out, lse, dq, dk, dv and dsinks equal
the Python entry points' bit for bit (dense, packed, no keys at all), an
older struct (version 4) is read without sinks whatever its memory holds past
its end, and bad sinks are statuses naming them. The plan side (no GPU here):
a plan of a call with sinks loads the binding's SINKS variant and the
backward's kernels have none (tests/test_native_choice.py holds the native
core's SINKS choice to this one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from capilib import ATTN_PARAMS, CUDA_DESCRIBE, assert_statuses, flag, report_of
from conftest import gpu
from test_capi import VARLEN_IN_PROCESS

from lazytriton.capi import embedded
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.target import Target

SINKS_IN_PROCESS = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0] + ATTN_PARAMS + """
torch.manual_seed(0)
q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16)
sinks = torch.randn(4)
report = {}

def forward(q, k, v, causal, sinks, struct=None):
    out, lse = torch.full(q.shape, 7.0), torch.full(q.shape[:3], 7.0)
    p = attn_params("fwd", {"q": q, "k": k, "v": v, "out": out, "lse": lse, "sinks": sinks}, struct,
                    causal=causal)
    return p, [lib.lt_attn_fwd(p, ffi.NULL), error()], out, lse

def backward(out, lse, do, causal, sinks, dsinks, struct=None):
    tensors, grads = bwd_tensors(q, k, v, out, lse, do)
    g = attn_params("bwd", {**tensors, "sinks": sinks, "dsinks": dsinks}, struct, causal=causal)
    return g, [lib.lt_attn_bwd(g, ffi.NULL), error()], grads

names = {0: False, 1: "top_left", 2: "bottom_right"}
report["dense"] = []
for causal in (0, 1, 2):
    _, status, out, lse = forward(q, k, v, causal, sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want_out, want_lse = lazytriton.attn_fwd(*leaves[:3], causal=names[causal], sinks=leaves[3])
    do = torch.randn_like(out)
    wanted = torch.autograd.grad(want_out, leaves, do)
    dsinks = torch.full((4,), 7.0)
    _, bwd_status, grads = backward(out, lse, do, causal, sinks, dsinks)
    report["dense"].append([status, bwd_status, torch.equal(out, want_out.detach()) and torch.equal(lse, want_lse),
                            all(torch.equal(a, b) for a, b in zip((*grads, dsinks), wanted)),
                            not torch.equal(lse, lazytriton.attn_fwd(q, k, v, causal=names[causal])[1])])

# Without dsinks the backward still takes the sinks (dq, dk and dv are the same).
_, status, out, lse = forward(q, k, v, 0, sinks)
do = torch.randn_like(out)
_, with_status, with_grads = backward(out, lse, do, 0, sinks, torch.empty(4))
_, without_status, without_grads = backward(out, lse, do, 0, sinks, None)
report["no_dsinks"] = [with_status, without_status, all(torch.equal(a, b) for a, b in zip(with_grads, without_grads))]

# No keys at all: lse is each head's sink, out 0 (as the Python call).
empty_k = torch.randn(2, 2, 0, 16)
_, status, out, lse = forward(q, empty_k, empty_k, 0, sinks)
want_out, want_lse = lazytriton.attn_fwd(q, empty_k, empty_k, sinks=sinks)
report["no_keys"] = [status, torch.equal(out, want_out) and torch.equal(lse, want_lse)]

# A version 4 struct ends before the sinks: whatever lies past its end is not read.
_, status, out, lse = forward(q, k, v, 0, sinks, struct=(ffi.offsetof("lt_attn_fwd_params", "sinks"), 4))
plain_out, plain_lse = lazytriton.attn_fwd(q, k, v)
report["v4"] = [status, torch.equal(out, plain_out) and torch.equal(lse, plain_lse)]
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
plain_out, plain_lse = lazytriton.attn_fwd(*leaves)
do = torch.randn_like(plain_out)
_, status, grads = backward(plain_out.detach(), plain_lse.detach(), do, 0, sinks, torch.full((4,), 7.0),
                            struct=(ffi.offsetof("lt_attn_bwd_params", "sinks"), 4))
report["bwd_v4"] = [status, all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(plain_out, leaves, do)))]

# Packed sequences with sinks, against flash_attn_varlen_func and its autograd.
cq = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)  # lengths 3, 0, 17, 1
ck = torch.tensor([0, 5, 9, 18, 18], dtype=torch.int32)  # lengths 5, 4, 9, 0
pq, pk, pv, pdo = torch.randn(21, 4, 16), torch.randn(18, 2, 16), torch.randn(18, 2, 16), torch.randn(21, 4, 16)
out, lse = torch.full_like(pq, 7.0), torch.full((4, 21), 7.0)
packed = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "sinks": sinks}
p = attn_params("fwd", {"q": pq, "k": pk, "v": pv, "out": out, "lse": lse, **packed}, max_seqlen_q=17,
                max_seqlen_k=9, causal=2)
status = [lib.lt_attn_fwd(p, ffi.NULL), error()]
leaves = [t.clone().requires_grad_() for t in (pq, pk, pv, sinks)]
want_out, want_lse, _ = lazytriton.flash_attn_varlen_func(*leaves[:3], cq, ck, 17, 9, causal=True,
                                                          return_attn_probs=True, sinks=leaves[3])
wanted = torch.autograd.grad(want_out, leaves, pdo)
tensors, grads = bwd_tensors(pq, pk, pv, out, lse, pdo)
grads.append(torch.full((4,), 7.0))
g = attn_params("bwd", {**tensors, **packed, "dsinks": grads[3]}, max_seqlen_q=17, max_seqlen_k=9, causal=2)
report["varlen"] = [status, [lib.lt_attn_bwd(g, ffi.NULL), error()],
                    torch.equal(out, want_out.detach()) and torch.equal(lse, want_lse),
                    all(torch.equal(a, b) for a, b in zip(grads, wanted))]

p, _, out, lse = forward(q, k, v, 0, sinks)

def status_of(change):
    bad = ffi.new("lt_attn_fwd_params *")
    ffi.memmove(bad, p, ffi.sizeof("lt_attn_fwd_params"))
    change(bad)
    return [lib.lt_attn_fwd(bad, ffi.NULL), error()]

def on_gpu(t):
    t.device_type = 2

report["errors"] = [
    status_of(lambda b: setattr(b.sinks, "dtype", 1)),
    status_of(lambda b: b.sinks.sizes.__setitem__(0, 3)),
    status_of(lambda b: setattr(b.sinks, "ndim", 2)),
    status_of(lambda b: b.sinks.strides.__setitem__(0, 2)),
    status_of(lambda b: on_gpu(b.sinks)),
    status_of(lambda b: setattr(b.sinks, "data", ffi.NULL)),
    status_of(lambda b: setattr(b.sinks, "data", b.lse.data)),
]
g, _, _ = backward(out, lse, torch.randn_like(out), 0, sinks, torch.empty(4))
no_sinks = ffi.new("lt_attn_bwd_params *")
ffi.memmove(no_sinks, g, ffi.sizeof("lt_attn_bwd_params"))
no_sinks.sinks = ffi.new("lt_tensor *")[0]
bad_dsinks = ffi.new("lt_attn_bwd_params *")
ffi.memmove(bad_dsinks, g, ffi.sizeof("lt_attn_bwd_params"))
bad_dsinks.dsinks.sizes[0] = 5
aliased = ffi.new("lt_attn_bwd_params *")
ffi.memmove(aliased, g, ffi.sizeof("lt_attn_bwd_params"))
aliased.dsinks.data = aliased.sinks.data
report["bwd_errors"] = [[lib.lt_attn_bwd(b, ffi.NULL), error()] for b in (no_sinks, bad_dsinks, aliased)]
print(json.dumps(report))
"""


def test_sinks_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    report = report_of(SINKS_IN_PROCESS, prefix)
    for causal, (fwd_status, bwd_status, out_equal, grads_equal, sinks_count) in enumerate(report["dense"]):
        assert fwd_status[0] == 0 and bwd_status[0] == 0, (causal, fwd_status, bwd_status)
        assert out_equal and grads_equal, f"causal {causal}: the C call differs from the Python one"
        assert sinks_count, "the sinks change lse"
    with_status, without_status, same = report["no_dsinks"]
    assert with_status[0] == 0 and without_status[0] == 0 and same, report["no_dsinks"]
    assert report["no_keys"][0][0] == 0 and report["no_keys"][1], report["no_keys"]
    assert report["v4"][0][0] == 0 and report["v4"][1], "a version 4 struct has no sinks"
    assert report["bwd_v4"][0][0] == 0 and report["bwd_v4"][1], "a version 4 backward struct has no sinks"
    fwd_status, bwd_status, out_equal, grads_equal = report["varlen"]
    assert fwd_status[0] == 0 and bwd_status[0] == 0, (fwd_status, bwd_status)
    assert out_equal and grads_equal, "packed sequences with sinks: the C call differs from the Python one"
    expected = [(4, "sinks.dtype is 1; expected LT_DTYPE_FP32"), (5, "sinks must be 1-dim with heads_q = 4"),
                (5, "sinks must be 1-dim"), (5, "sinks.strides[0] is 2; it must be contiguous"),
                (1, "sinks is on cuda:0 but q is on cpu:0"), (2, "sinks.data is NULL"),
                (1, "lse shares memory with sinks")]
    assert_statuses(report["errors"], expected)
    expected = [(1, "dsinks is given but the call has no sinks"), (5, "dsinks must be 1-dim with heads_q = 4"),
                (1, "dsinks shares memory with sinks")]
    assert_statuses(report["bwd_errors"], expected)


SINKS_GPU_IN_PROCESS = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0] + CUDA_DESCRIBE + """
torch.manual_seed(0)
q, k, v = (torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
sinks = torch.randn(8, device="cuda")
out, lse = torch.empty_like(q), torch.empty(2, 8, 300, device="cuda")
p = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(p)
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("sinks", sinks)):
    describe(getattr(p, name), t)
p.causal = 2
report = {"fwd": [lib.lt_attn_fwd(p, ffi.NULL), error()]}
torch.cuda.synchronize()
leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
want_out, want_lse = lazytriton.attn_fwd(*leaves[:3], causal="bottom_right", sinks=leaves[3])
report["errors"] = [(out.float() - want_out.float()).abs().max().item(), (lse - want_lse).abs().max().item()]
plan = ffi.new("lt_plan **")
report["plan"] = [lib.lt_attn_fwd_plan(p, plan), error()]
plain = ffi.new("lt_attn_fwd_params *")
ffi.memmove(plain, p, ffi.sizeof("lt_attn_fwd_params"))
plain.sinks = ffi.new("lt_tensor *")[0]
report["mismatch"] = [lib.lt_plan_launch(plan[0], plain, ffi.NULL), error()]
do = torch.randn_like(out)
wanted = torch.autograd.grad(want_out, leaves, do)
g = ffi.new("lt_attn_bwd_params *")
lib.lt_attn_bwd_params_init(g)
grads = [torch.empty_like(t) for t in (q, k, v)]
delta = torch.zeros(2, 8, 300, device="cuda")
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", do), ("dq", grads[0]),
                ("dk", grads[1]), ("dv", grads[2]), ("delta", delta), ("sinks", sinks)):
    describe(getattr(g, name), t)
g.causal = 2

def plain_bwd(g):  # the same call without dsinks: outside a plan made with them
    h = ffi.new("lt_attn_bwd_params *")
    ffi.memmove(h, g, ffi.sizeof("lt_attn_bwd_params"))
    h.dsinks = ffi.new("lt_tensor *")[0]
    return h

report["bwd"] = [lib.lt_attn_bwd(g, ffi.NULL), error()]
torch.cuda.synchronize()
report["grad_error"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, wanted))
dsinks = -(torch.exp(sinks.view(1, 8, 1) - lse) * delta).sum((0, 2))  # from delta, as the header says
report["dsinks_error"] = (dsinks - wanted[3]).abs().max().item()
gpu_dsinks = torch.full((8,), 7.0, device="cuda")
describe(g.dsinks, gpu_dsinks)
report["dsinks_gpu"] = [lib.lt_attn_bwd(g, ffi.NULL), error()]
torch.cuda.synchronize()
first = gpu_dsinks.clone()
report["dsinks_gpu_error"] = (gpu_dsinks - wanted[3]).abs().max().item()
report["dsinks_gpu_again"] = [lib.lt_attn_bwd(g, ffi.NULL), error()]
torch.cuda.synchronize()
report["dsinks_gpu_same_bits"] = torch.equal(first, gpu_dsinks)
bplan = ffi.new("lt_bwd_plan **")
report["dsinks_plan"] = [lib.lt_attn_bwd_plan(g, bplan), error()]
report["dsinks_plan_mismatch"] = [lib.lt_bwd_plan_launch(bplan[0], plain_bwd(g), ffi.NULL), error()]
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_sinks_through_plans_on_the_gpu(prefix: Path, cache_dir: Path) -> None:
    report = report_of(SINKS_GPU_IN_PROCESS, prefix)
    assert report["fwd"][0] == 0 and report["plan"][0] == 0, report
    out_err, lse_err = report["errors"]
    assert out_err <= 2e-2 and lse_err <= 1e-3, (out_err, lse_err)
    status, message = report["mismatch"]
    assert status == 10 and "sinks" in message, message
    assert report["bwd"][0] == 0 and report["grad_error"] <= 5e-2, report
    assert report["dsinks_error"] <= 5e-2, report["dsinks_error"]
    assert report["dsinks_gpu"][0] == 0 and report["dsinks_gpu_again"][0] == 0, report
    assert report["dsinks_gpu_error"] <= 5e-2 and report["dsinks_gpu_same_bits"], report
    assert report["dsinks_plan"][0] == 0, report["dsinks_plan"]
    status, message = report["dsinks_plan_mismatch"]
    assert status == 10 and "dsinks" in message, message


def test_a_plan_with_sinks_loads_the_bindings_sinks_variant() -> None:
    sm90 = Target("cuda", "90", 32)
    shape = fwd.Shape(1, 1, 1, 300, 257, 128)
    chosen = embedded.plan_variant("flash_fwd", 90, 2, 128, True, True, False, 300, 257, sinks=True)
    assert chosen == fwd.variant(sm90, torch.bfloat16, shape, True, True, False, sinks=True)
    assert flag(chosen, "SINKS")
    assert not flag(embedded.plan_variant("flash_fwd", 90, 2, 128, True, True, False, 300, 257), "SINKS")
    packed = embedded.plan_variant("flash_fwd", 90, 2, 128, False, True, False, 300, 257, True, sinks=True)
    assert flag(packed, "VARLEN") and flag(packed, "SINKS")
    with pytest.raises(ValueError, match="flash_bwd_dq with sinks: only flash_fwd has a SINKS variant"):
        embedded.plan_variant("flash_bwd_dq", 90, 2, 128, True, True, False, 300, 257, sinks=True)
