"""The C API's sliding window and softcap (lt_attn_fwd_params version 3).

Through the built library on CPU tensors (Triton's interpreter), in a fresh
process as tests/test_capi.py does: the results equal the Python entry
points' with the same window and softcap (dense, both causal alignments,
packed sequences), an older struct (version 2) is read without a window
whatever its memory holds past its end, and bad values are statuses naming
them. The plan side (no GPU here): the variant a plan loads is the binding's
windowed and capped one, and lt_prewarm's specs take the two axes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from capilib import ATTN_PARAMS, assert_statuses, flag, report_of
from conftest import gpu
from test_capi import VARLEN_IN_PROCESS

from lazytriton.capi import embedded, embedded_prewarm
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.target import Target

WINDOW_IN_PROCESS = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0] + ATTN_PARAMS + """
torch.manual_seed(0)
q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16)
report = {}

def dense(causal, window, softcap, struct=None):
    out, lse = torch.full((2, 4, 9, 16), 7.0), torch.full((2, 4, 9), 7.0)
    p = attn_params("fwd", {"q": q, "k": k, "v": v, "out": out, "lse": lse}, struct, causal=causal,
                    window_left=window[0], window_right=window[1], softcap=softcap)
    return lib.lt_attn_fwd(p, ffi.NULL), error(), out, lse

cases = [(0, (3, 2), 0.0), (0, (-1, 4), 5.0), (1, (4, -1), 0.0), (2, (2, 7), 2.5), (0, (-1, -1), 5.0),
         (2, (0, 0), 0.0)]
names = {0: False, 1: "top_left", 2: "bottom_right"}
report["dense"] = []
for causal, window, softcap in cases:
    status, message, out, lse = dense(causal, window, softcap)
    want_out, want_lse = lazytriton.attn_fwd(q, k, v, causal=names[causal], window_size=window, softcap=softcap)
    plain_out, _ = lazytriton.attn_fwd(q, k, v, causal=names[causal])
    report["dense"].append([status, message, torch.equal(out, want_out) and torch.equal(lse, want_lse),
                            torch.equal(out, plain_out)])

# A version 2 struct ends before the window: whatever lies past its end is not read.
v2 = ffi.offsetof("lt_attn_fwd_params", "window_left")
status, message, out, lse = dense(0, (0, 0), 3.0, struct=(v2, 2))
plain_out, plain_lse = lazytriton.attn_fwd(q, k, v)
report["v2"] = [status, message, torch.equal(out, plain_out) and torch.equal(lse, plain_lse)]
report["v3_short"] = list(dense(0, (0, 0), 0.0, struct=(v2, 3))[:2])

report["errors"] = [list(dense(0, window, softcap)[:2]) for window, softcap in
                    (((-2, 1), 0.0), ((1, -3), 0.0), ((-1, -1), -1.0), ((-1, -1), float("inf")),
                     ((-1, -1), float("nan")), ((-1, -1), 1e39))]

cq = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)  # lengths 3, 0, 17, 1
ck = torch.tensor([0, 5, 9, 18, 18], dtype=torch.int32)  # lengths 5, 4, 9, 0
pq, pk, pv = torch.randn(21, 4, 16), torch.randn(18, 2, 16), torch.randn(18, 2, 16)
out, lse = torch.full_like(pq, 7.0), torch.full((4, 21), 7.0)
p = attn_params("fwd", {"q": pq, "k": pk, "v": pv, "out": out, "lse": lse, "cu_seqlens_q": cq, "cu_seqlens_k": ck},
                max_seqlen_q=17, max_seqlen_k=9, causal=2, window_left=3, window_right=-1, softcap=4.0)
status = lib.lt_attn_fwd(p, ffi.NULL)
want_out, want_lse, _ = lazytriton.flash_attn_varlen_func(pq, pk, pv, cq, ck, 17, 9, causal=True, window_size=(3, -1),
                                                          softcap=4.0, return_attn_probs=True)
report["varlen"] = [status, error(), torch.equal(out, want_out) and torch.equal(lse, want_lse)]

# The backward (version 3): the forward's window and softcap, against autograd through the Python call.
def backward(causal, window, softcap, struct=None, in_memory=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lazytriton.attn_fwd(*leaves, causal=names[causal], window_size=window, softcap=softcap)
    do = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, do)
    out, lse = out.detach(), lse.detach()
    tensors, grads = bwd_tensors(q, k, v, out, lse, do)
    g = attn_params("bwd", tensors, struct, causal=causal, window_left=window[0], window_right=window[1],
                    softcap=softcap)
    if in_memory is not None:  # past a shorter struct's end: must not be read
        g.window_left, g.window_right, g.softcap = in_memory
    status = lib.lt_attn_bwd(g, ffi.NULL)
    return [status, error(), all(torch.equal(a, b) for a, b in zip(grads, want))]

report["bwd"] = [backward(causal, window, softcap) for causal, window, softcap in cases]
# A version 2 backward struct: no window whatever lies past its end (its forward had none: the grads match).
g2 = ffi.offsetof("lt_attn_bwd_params", "window_left")
report["bwd_v2"] = backward(0, (-1, -1), 0.0, struct=(g2, 2), in_memory=(0, 0, 3.0))
print(json.dumps(report))
"""


def test_window_and_softcap_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    report = report_of(WINDOW_IN_PROCESS, prefix)
    for status, message, equal, _ in report["dense"]:
        assert status == 0 and equal, message
    # Every case differs from the call without window and softcap: the values reach the kernel.
    assert [row[3] for row in report["dense"]] == [False, False, False, False, False, False]
    status, message, equal = report["v2"]
    assert status == 0 and equal, message
    status, message = report["v3_short"]
    assert status == 3 and "struct_size" in message
    assert_statuses(report["errors"], [(1, "window_left is -2 and window_right 1"),
                                       (1, "window_left is 1 and window_right -3"), (1, "softcap is -1"),
                                       (1, "softcap is inf"), (1, "softcap is nan"), (1, "softcap is 1e+39")])
    status, message, equal = report["varlen"]
    assert status == 0 and equal, message
    for status, message, equal in [*report["bwd"], report["bwd_v2"]]:
        assert status == 0 and equal, message


# The same through plans on the GPU: lt_attn_fwd (its memoised plan) and lt_attn_fwd_plan + lt_plan_launch, against
# the Python call on the same device tensors (FlashAttention's rule would allow more; the same variant gives ~0).
WINDOW_GPU_IN_PROCESS = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0] + """
torch.manual_seed(0)
dev = torch.device("cuda", 0)
q, k, v = (torch.randn(2, 8, s, 128, device=dev, dtype=torch.float16) for s in (300, 257, 257))
report = {"cases": []}

def describe_gpu(view, t):
    view.data = ffi.cast("void *", t.data_ptr())
    view.dtype = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}[t.dtype]
    view.ndim, view.device_type, view.device_index = t.dim(), 2, 0
    for i in range(t.dim()):
        view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)

def params(causal, window, softcap, out, lse):
    p = ffi.new("lt_attn_fwd_params *")
    lib.lt_attn_fwd_params_init(p)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        describe_gpu(getattr(p, name), t)
    p.causal, p.window_left, p.window_right, p.softcap = causal, window[0], window[1], softcap
    return p

names = {0: False, 1: "top_left", 2: "bottom_right"}
for causal, window, softcap in ((0, (64, 32), 0.0), (2, (100, -1), 0.0), (0, (-1, -1), 20.0), (1, (50, -1), 10.0)):
    want_out, want_lse = lazytriton.attn_fwd(q, k, v, causal=names[causal], window_size=window, softcap=softcap)
    for planned in (False, True):
        out, lse = torch.full_like(q, 7.0), torch.full((2, 8, 300), 7.0, device=dev)
        p = params(causal, window, softcap, out, lse)
        if planned:
            plan = ffi.new("lt_plan **")
            status = lib.lt_attn_fwd_plan(p, plan)
            status = status or lib.lt_plan_launch(plan[0], p, ffi.NULL)
        else:
            status = lib.lt_attn_fwd(p, ffi.NULL)
        torch.cuda.synchronize()
        # Rows that see no key (bottom-right causal, 300 queries over 257 keys) have -inf in both: equal, not nan.
        report["cases"].append([status, error(), (out - want_out).abs().max().item(),
                                torch.where(lse == want_lse, 0.0, (lse - want_lse).abs()).max().item()])
        if planned and status == 0:
            plain = params(causal, (-1, -1), 0.0, out, lse)  # outside the windowed/capped plan's shape class
            report.setdefault("mismatch", [lib.lt_plan_launch(plan[0], plain, ffi.NULL), error()])

# The backward through its plan (lt_attn_bwd), windowed and capped, against autograd through the Python call.
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
out, lse = lazytriton.attn_fwd(*leaves, causal="bottom_right", window_size=(100, -1), softcap=20.0)
do = torch.randn_like(out)
want = torch.autograd.grad(out, leaves, do)
g = ffi.new("lt_attn_bwd_params *")
lib.lt_attn_bwd_params_init(g)
grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
for name, t in (("q", q), ("k", k), ("v", v), ("out", out.detach()), ("lse", lse.detach()), ("dout", do),
                ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2]), ("delta", torch.empty(2, 8, 300, device=dev))):
    describe_gpu(getattr(g, name), t)
g.causal, g.window_left, g.window_right, g.softcap = 2, 100, -1, 20.0
status = lib.lt_attn_bwd(g, ffi.NULL)
torch.cuda.synchronize()
report["bwd"] = [status, error(), max((a - b).abs().max().item() for a, b in zip(grads, want))]
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_window_and_softcap_through_plans_on_the_gpu(prefix: Path, cache_dir: Path) -> None:
    report = report_of(WINDOW_GPU_IN_PROCESS, prefix)
    for status, message, out_err, lse_err in report["cases"]:
        assert status == 0, message
        assert out_err <= 2e-3 and lse_err <= 1e-4, (out_err, lse_err)
    status, message = report["mismatch"]
    assert status == 10 and "sliding window" in message, message
    status, message, grad_err = report["bwd"]
    assert status == 0 and grad_err <= 1e-2, (message, grad_err)


def test_a_windowed_capped_plan_loads_the_bindings_variant() -> None:
    sm90 = Target("cuda", "90", 32)
    shape = fwd.Shape(1, 1, 1, 300, 257, 128)
    for window, softcap in ((True, False), (False, True), (True, True)):
        chosen = embedded.plan_variant("flash_fwd", 90, 2, 128, True, True, False, 300, 257, window=window,
                                       softcap=softcap)
        assert chosen == fwd.variant(sm90, torch.bfloat16, shape, True, True, False, window, softcap)
        assert (flag(chosen, "WINDOW"), flag(chosen, "SOFTCAP")) == (window, softcap)
        packed = embedded.plan_variant("flash_fwd", 90, 2, 128, False, True, False, 300, 257, True, window=window,
                                       softcap=softcap)
        assert (flag(packed, "VARLEN"), flag(packed, "WINDOW"), flag(packed, "SOFTCAP")) == (True, window, softcap)
    assert embedded.plan_variant("flash_fwd", 90, 2, 128, True, True, False, 300, 257) == fwd.variant(
        sm90, torch.bfloat16, shape, True, True, False)


def test_prewarm_specs_take_the_window_and_softcap_axes() -> None:
    (spec,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=128 window=1 softcap=1")
    assert flag(spec, "WINDOW") and flag(spec, "SOFTCAP")
    (plain,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=128")
    assert not flag(plain, "WINDOW") and not flag(plain, "SOFTCAP")
    both = embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=bf16 head_dim=64 window=1")
    assert [v.kernel for v in both] == list(bwd_dispatch.BWD_KERNELS) and all(flag(v, "WINDOW") for v in both)
