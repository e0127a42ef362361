"""lt_flash_combine: the C twin of ``flash_attn_combine`` (FlashAttention-3's).

On CPU tensors through the built library (Triton's interpreter), in a fresh
process as tests/test_capi.py does: out and lse equal
``lazytriton.flash_attn_combine``'s bit for bit (packed rows, FlashAttention-3's
dense layout folded into rows, strided partials and lse, splits that saw no
key, each output dtype); bad input is a status naming the argument and
writes nothing. The launcher's arguments are the binding's, field by field,
and the planner's variant is the binding's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from capilib import CUDA_DESCRIBE, IN_PROCESS_PRELUDE, assert_statuses, report_of
from conftest import REPO, gpu

from lazytriton.capi import embedded_combine

COMBINE_SOURCE = REPO / "capi" / "lt_combine.c"

IN_PROCESS = IN_PROCESS_PRELUDE + r"""
def error():
    return dll.lt_last_error().decode()

def params(out_partial, lse_partial, out, lse):
    p = ffi.new("lt_flash_combine_params *")
    assert call("lt_flash_combine_params_init", p) == 0
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out), ("lse", lse)):
        describe(getattr(p, name), t)
    return p

torch.manual_seed(0)
report = {}

def case(name, out_partial, lse_partial, dtype=torch.float32, c_view=None):
    # C into 7.0-filled out and lse; Python's flash_attn_combine on the same partials.
    want, want_lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
    c_partial, c_lse_partial = c_view(out_partial, lse_partial) if c_view else (out_partial, lse_partial)
    rows, heads, dim = c_partial.shape[1:]
    out, lse = torch.full((rows, heads, dim), 7.0, dtype=dtype), torch.full((heads, rows), 7.0).t()
    status = call("lt_flash_combine", params(c_partial, c_lse_partial, out, lse), ffi.NULL)
    report[name] = [status, error() if status else "", torch.equal(out, want.reshape(out.shape)),
                    torch.equal(lse, want_lse.reshape(lse.shape))]

# Packed rows: 3 splits, 10 rows, 4 heads, head dim 40 (not a power of two); one split saw no key for some rows,
# and every split none for one row (out 0, lse -inf).
lse_partial = torch.randn(3, 10, 4)
lse_partial[1, :4] = float("-inf")
lse_partial[:, 7, 2] = float("-inf")
case("packed", torch.randn(3, 10, 4, 40), lse_partial)
# FlashAttention-3's dense (num_splits, batch, seqlen, heads, head_dim), contiguous: C takes it as rows.
dense, dense_lse = torch.randn(5, 2, 6, 3, 64), torch.randn(5, 2, 6, 3)
case("dense_as_rows", dense, dense_lse, c_view=lambda o, l: (o.reshape(5, 12, 3, 64), l.reshape(5, 12, 3)))
# Strided: the partials a slice of a wider buffer, lse_partial contiguous in the rows (FlashAttention-3's own).
wide = torch.randn(4, 9, 2, 200)[..., :130]
lse_rows_first = torch.randn(4, 2, 9).transpose(1, 2)
case("strided", wide, lse_rows_first)
case("fp16_out", torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2), dtype=torch.float16)
case("bf16_out", torch.randn(6, 3, 1, 256), torch.randn(6, 3, 1), dtype=torch.bfloat16)
case("one_split", torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2))

# Bad input: a status, a message naming the argument, and out untouched.
good = torch.randn(3, 10, 4, 40), torch.randn(3, 10, 4)

def bad(change):
    out, lse = torch.full((10, 4, 40), 7.0), torch.full((10, 4), 7.0)
    p = params(*good, out, lse)
    change(p)
    status = call("lt_flash_combine", p, ffi.NULL)
    return [status, error(), bool((out == 7.0).all() and (lse == 7.0).all())]

report["errors"] = [
    bad(lambda p: setattr(p, "version", 9)),
    bad(lambda p: describe(p.out_partial, good[0].half())),
    bad(lambda p: describe(p.lse_partial, torch.randn(3, 10, 5))),
    bad(lambda p: describe(p.out, torch.empty(10, 4, 41))),
    bad(lambda p: describe(p.lse, torch.empty(4, 10))),
    bad(lambda p: describe(p.out_partial, torch.randn(3, 10, 4, 40, 2)[..., 0])),
    bad(lambda p: setattr(p.lse, "device_type", 2)),
    bad(lambda p: setattr(p, "flags", 1)),
    bad(lambda p: setattr(p.out, "data", p.out_partial.data)),
    bad(lambda p: describe(p.out, torch.empty(10, 4, 40, dtype=torch.int32))),
    bad(lambda p: setattr(p.out, "data", ffi.NULL)),
]
print(json.dumps(report))
"""


def test_the_c_combine_is_the_python_call_on_the_cpu(prefix: Path, cache_dir: Path) -> None:
    report = report_of(IN_PROCESS, prefix)
    for name in ("packed", "dense_as_rows", "strided", "fp16_out", "bf16_out", "one_split"):
        status, message, out_equal, lse_equal = report[name]
        assert status == 0, (name, message)
        assert out_equal and lse_equal, f"{name}: the C call differs from flash_attn_combine"
    expected = [(3, "params->version is 9"), (4, "out_partial.dtype is fp16; expected LT_DTYPE_FP32"),
                (5, "lse_partial must have shape (3, 10, 4) (out_partial's without its head dim), got (3, 10, 5)"),
                (5, "out must have shape (10, 4, 40) (out_partial's without its splits), got (10, 4, 41)"),
                (5, "lse must have shape (10, 4) (rows, heads), got (4, 10)"),
                (5, "out_partial.strides[3] is 2; the last dim must be contiguous"),
                (1, "lse is on cuda:0 but out_partial is on cpu:0"), (1, "flags and reserved must be 0"),
                (1, "out shares memory with out_partial"), (4, "out.dtype is 4"), (2, "out.data is NULL")]
    assert_statuses(report["errors"], expected)


def test_the_c_combine_launcher_passes_each_description_field_by_field() -> None:
    from lazytriton.kernels.flash_combine import FLASH_COMBINE, INT_PARAMS, binding

    source = COMBINE_SOURCE.read_text()
    body = re.search(r"int64_t ints\[LT__COMBINE_PARAMS[^\]]*\] = \{(.*?)\};", source, re.S)
    assert body, "the launcher's initializer was not found in lt_combine.c"
    c_items = [" ".join(item.split()) for item in body[1].split(",")]
    expected = binding.c_initializer().split(", ")
    assert len(c_items) == len(expected) == len(INT_PARAMS)
    for param, c_item, want in zip(INT_PARAMS, c_items, expected, strict=True):
        assert c_item == want, f"lt_combine.c passes {c_item!r} as flash_combine's {param}; the binding says {want!r}"
    defined = re.search(r"#define LT__COMBINE_PARAMS (\d+)", source)
    assert defined and int(defined[1]) == len(FLASH_COMBINE.params)


def test_the_planners_variant_is_the_bindings() -> None:
    from lazytriton.kernels import flash_combine
    from lazytriton.target import Target

    sm90 = Target("cuda", "90", 32)
    for dtype_code, dtype in ((1, "fp16"), (2, "bf16"), (3, "fp32")):
        for head_dim in (40, 128, 300):
            for aligned, index64 in ((True, False), (False, True)):
                assert embedded_combine.plan_variant(90, dtype_code, head_dim, aligned, index64) == \
                    flash_combine.variant(sm90, dtype, head_dim, aligned, index64)


GPU_IN_PROCESS = IN_PROCESS_PRELUDE + CUDA_DESCRIBE + r"""
torch.manual_seed(0)
report = {}
for dtype, dim in ((torch.bfloat16, 128), (torch.float32, 300)):
    out_partial, lse_partial = torch.randn(7, 33, 8, dim, device="cuda"), torch.randn(7, 33, 8, device="cuda")
    lse_partial[2, :5] = float("-inf")
    out, lse = torch.empty(33, 8, dim, device="cuda", dtype=dtype), torch.empty(8, 33, device="cuda").t()
    p = ffi.new("lt_flash_combine_params *")
    call("lt_flash_combine_params_init", p)
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out), ("lse", lse)):
        describe(getattr(p, name), t)
    status = call("lt_flash_combine", p, ffi.NULL)
    torch.cuda.synchronize()
    want, want_lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
    report[str(dtype)] = [status, dll.lt_last_error().decode(), torch.equal(out, want), torch.equal(lse, want_lse)]
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_the_c_combine_on_a_gpu_is_the_python_call(prefix: Path, cache_dir: Path) -> None:
    report = report_of(GPU_IN_PROCESS, prefix)
    for dtype, (status, message, out_equal, lse_equal) in report.items():
        assert status == 0, (dtype, message)
        assert out_equal and lse_equal, f"{dtype}: the C launch differs from the Python one (the same kernel)"
