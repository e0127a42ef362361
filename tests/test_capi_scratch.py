"""The C API's forward plans over entries that take scratch memory, held to the Python launcher's bytes.

An sm_90 image ``lazytriton prewarm --from-misses`` builds holds flash_fwd's ``TMA=true`` variant (its TMA
descriptors made on the device, in Triton's global scratch), ``flash_fwd_fp8`` and ``flash_fwd_fp8_gluon`` (the
Gluon FP8 forward: global scratch too). liblazytriton_native.so, built with the dispatch switches on
(``fwd_dispatch.TMA_BY_DEFAULT``, ``fp8_gluon.DEFAULT_HEAD_DIMS`` and ``KEY_ORDER_HEAD_DIMS`` at every head dim)
or as shipped (the C API's flash_fwd_fp8 at head dim 128),
plans a call from the image and launches it with ``lt_plan_launch`` against the fake libcuda; in the same
process the Python launcher (``lazytriton.driver.gpu``) launches the same entry for the same tensors. Every
parameter's bytes must be equal, the scratch pointer included: from the call's workspace (version 8) when it
gives one, else from cuMemAllocAsync on the stream, freed after the launch. A workspace too small is
LT_ERROR_INVALID_ARGUMENT before any launch. The FP8 plan runs the Gluon kernel exactly for the calls
``fp8.variant`` gives it (switched on), else flash_fwd_fp8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from capilib import CUDA_DESCRIBE, IN_PROCESS_PRELUDE, exit_ok, run_program
from conftest import gpu
from fake_libcuda import SCRATCH_BASE
from nativelib import STREAM, fake_drivers, need_toolchain, prewarmed_image

from lazytriton.capi import embedded, native_build
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import fp8_gluon
from lazytriton.target import Target

REPO = Path(__file__).resolve().parents[1]
LT_OK, LT_ERROR_INVALID_ARGUMENT = 0, 1
TMA_CALL = {"dtype": "fp16", "b": 1, "hq": 2, "hk": 2, "sq": 256, "sk": 256, "d": 64}
FP8_CALL = {"dtype": "e4m3", "b": 1, "hq": 4, "hk": 2, "sq": 256, "sk": 384, "d": 128}


def image_variants() -> list[str]:
    """What the switched-on plans load for TMA_CALL and FP8_CALL (plan_variant's and fp8_twin's, sm_90)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fwd_dispatch, "TMA_BY_DEFAULT", True)
        m.setattr(fp8_gluon, "BY_DEFAULT", True)
        m.setattr(fp8_gluon, "DEFAULT_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))
        m.setattr(fp8_gluon, "KEY_ORDER_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))
        tma = embedded.plan_variant("flash_fwd", 90, 1, 64, False, True, False, 256, 256, head_dim_v=64)
        fp8 = embedded.plan_variant("flash_fwd", 90, 5, 128, False, True, False, 256, 384, head_dim_v=128)
        twin = embedded.fp8_twin(90, 5, 128, 128, False, True, False, False)
    assert "TMA=true" in str(tma) and fp8.kernel == "flash_fwd_fp8" and twin.kernel == "flash_fwd_fp8_gluon"
    return [str(tma), str(fp8), str(twin)]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image prewarm builds from a miss log of the three variants (once a session, shared by xdist workers)."""
    return prewarmed_image(tmp_path_factory, "capi-scratch", variants=image_variants(), timeout=1800)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose libcuda.so.1 is the fake."""
    need_toolchain()
    return fake_drivers(tmp_path_factory.mktemp("capi-scratch-driver"))["driver"]


def native_library(directory: Path, switched_on: bool) -> Path:
    """liblazytriton_native.so with its tables generated under the switches (on) or as shipped."""
    with pytest.MonkeyPatch.context() as m:
        if switched_on:
            m.setattr(fwd_dispatch, "TMA_BY_DEFAULT", True)
            m.setattr(fp8_gluon, "BY_DEFAULT", True)
            m.setattr(fp8_gluon, "DEFAULT_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))
            m.setattr(fp8_gluon, "KEY_ORDER_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))
        return native_build.build(directory)


# One process: the C plan's launch, then the Python launcher's of the entry the plan serves, on the same fake.
PROGRAM = r"""
import json, sys
import torch
from cffi import FFI
from fake_libcuda import Fake
from nativelib import STREAM, param_sizes, recorded_launch
from lazytriton.cache_format.image import Image
from lazytriton.capi import build, embedded
from lazytriton.driver import fastlaunch, gpu
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_gluon
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target

library, header, image, fake_path, cases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
ffi = FFI()
ffi.cdef(build.header_cdef(open(header).read()) + '''
int lt_config_init(lt_config *config);
int lt_init(const lt_config *config);
const char *lt_last_error(void);
int lt_attn_fwd_params_init(lt_attn_fwd_params *params);
int lt_attn_fwd_plan(const lt_attn_fwd_params *params, lt_plan **plan);
int lt_plan_launch(const lt_plan *plan, const lt_attn_fwd_params *params, void *stream);
int lt_plan_workspace_size(const lt_plan *plan, const lt_attn_fwd_params *params, size_t *bytes);
int lt_plan_destroy(lt_plan *plan);
''')
lib = ffi.dlopen(library)
config = ffi.new("lt_config *")
lib.lt_config_init(config)
keep = [ffi.new("char[]", image.encode())]
config.images, config.jit = keep[0], 2
assert lib.lt_init(config) == 0, ffi.string(lib.lt_last_error())
fake = Fake(fake_path)
setattr(fastlaunch, "_module", lambda: None)  # the Python launcher's cffi path (test_native_tma holds the helper's)
CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float8_e4m3fn: 5}

def describe(view, t):
    view.data = ffi.cast("void *", t.data_ptr())
    view.dtype, view.ndim, view.device_type, view.device_index = CODES[t.dtype], t.dim(), 2, 0
    for i in range(t.dim()):
        view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)

def run(case):
    if case["switched_on"]:  # else as shipped
        fwd_dispatch.TMA_BY_DEFAULT = True
        fp8_gluon.DEFAULT_HEAD_DIMS = fp8_gluon.KEY_ORDER_HEAD_DIMS = frozenset(fp8_gluon.HEAD_DIMS)
    b, hq, hk, sq, sk, d = (case[n] for n in ("b", "hq", "hk", "sq", "sk", "d"))
    fp8_call = case["dtype"] == "e4m3"
    dtype = torch.float8_e4m3fn if fp8_call else torch.float16
    q = torch.randn(b, hq, sq, d).to(dtype)
    k = torch.randn(b, hk, sk, d).to(dtype)
    v = torch.randn(b, hk, d, sk).to(dtype) if fp8_call else torch.randn(b, hk, sk, d).to(dtype)
    out = torch.empty(b, hq, sq, d, dtype=torch.bfloat16 if fp8_call else dtype)
    lse = torch.empty(b, hq, sq)
    scales = [torch.rand(b, hk) + 0.5 for _ in range(3)]
    p = ffi.new("lt_attn_fwd_params *")
    lib.lt_attn_fwd_params_init(p)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        describe(getattr(p, name), t)
    if fp8_call:
        p.v_transposed = 1
        for name, t in zip(("q_descale", "k_descale", "v_descale"), scales):
            describe(getattr(p, name), t)
    workspace = None
    if case.get("workspace") is not None:
        workspace = torch.empty(case["workspace"])
        describe(p.workspace, workspace)
    plan = ffi.new("lt_plan **")
    report = {"plan": lib.lt_attn_fwd_plan(p, plan), "error": ffi.string(lib.lt_last_error()).decode()}
    if report["plan"] != 0:
        return report
    size = ffi.new("size_t *")
    report["workspace_size"] = [lib.lt_plan_workspace_size(plan[0], p, size), int(size[0])]
    # The entry the plan serves the call from: Python's choice for it.
    if fp8_call:
        call = binding.check(q, k, v.transpose(2, 3).contiguous(), False, fp8=True)  # its shape: v as rows
        variant = fp8.variant(Target.parse("sm_90"), call, call.shape, True, False, dtype="e4m3")
        if variant.kernel == fp8_gluon.NAME:  # the C API's twin (V's keys in order) where it serves one, else
            variant = (embedded.fp8_twin(90, 5, d, d, False, True, False, False)  # flash_fwd_fp8 (the plan's)
                       or embedded.plan_variant("flash_fwd", 90, 5, d, False, True, False, sq, sk, head_dim_v=d))
        ints = fp8.pack(q, k, v, out, lse, call, fp8.Descales(*scales))[0]
        floats = fp8.floats(call)
    else:
        call = binding.check(q, k, v, False)
        variant = embedded.plan_variant("flash_fwd", 90, 1, d, False, True, False, sq, sk, head_dim_v=d)
        ints, floats = binding.pack(q, k, v, out, lse, call)[0], binding.floats(call)
    report["variant"] = str(variant)
    entry = Image(image).read(variant.key())
    fake.configure(param_sizes(entry))
    report["launch"] = lib.lt_plan_launch(plan[0], p, ffi.cast("void *", STREAM))
    report["launch_error"] = ffi.string(lib.lt_last_error()).decode()
    params, state = fake.last_launch()
    report["c_params"] = [None if x is None else x.hex() for x in params]
    report["c_state"], report["c_allocs"] = state, fake.allocations()
    report["workspace_at"] = None if workspace is None else workspace.data_ptr()
    if report["launch"] != 0:
        return report
    hidden = len(entry.arg_types)
    scratch_at = int.from_bytes(params[hidden], "little") if entry.hidden_args and params[hidden] else 0
    kernel = gpu.CudaApi(fake_path).load(entry, 0)
    fake.configure(param_sizes(entry))
    grid = binding.grid(call.shape, int(variant.get("BLOCK_M")))
    report["py_params"], state, _, allocs = recorded_launch(kernel, fake, grid, ints, floats, [scratch_at])
    report["py_state"], report["py_allocs"] = state, [nbytes for nbytes, _ in allocs]
    report["entry"] = {"hidden": hidden, "global_scratch_size": entry.global_scratch_size,
                       "global_scratch_align": entry.global_scratch_align, "num_ctas": entry.num_ctas}
    report["grid"] = list(grid)
    lib.lt_plan_destroy(plan[0])
    return report

print(json.dumps([run(case) for case in cases]))
"""


def serve(library: Path, image: Path, driver: Path, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(driver), "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]), "LAZYTRITON_CACHE_DIR": str(library.parent)}
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(library), str(REPO / "capi" / "lazytriton.h"),
                           str(image), str(driver / "libcuda.so.1"), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    reports: list[dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])
    return reports


def scratch_bytes(report: dict[str, Any]) -> int:
    e, grid = report["entry"], report["grid"]
    return int(grid[0] * grid[1] * grid[2] * max(1, e["num_ctas"]) * e["global_scratch_size"])


def test_plans_pass_scratch_memory_with_the_python_launchers_bytes(image: Path, driver: Path,
                                                                   tmp_path: Path) -> None:
    library = native_library(tmp_path / "on", switched_on=True)
    cases = [{**TMA_CALL, "switched_on": True}, {**TMA_CALL, "switched_on": True, "workspace": 1},
             {**FP8_CALL, "switched_on": True}, {**FP8_CALL, "switched_on": True, "sq": 200}]
    cases.insert(2, {**TMA_CALL, "switched_on": True, "workspace": 0})  # sized below from the first report
    first = serve(library, image, driver, cases[:1])[0]
    assert first["plan"] == LT_OK and first["workspace_size"][0] == LT_OK, first
    need = first["workspace_size"][1]
    cases[2]["workspace"] = (need + 3) // 4
    tma, small, sized, fit, unfit = serve(library, image, driver, cases)

    # TMA=true, no workspace: scratch from the stream, the Python launcher's bytes exactly.
    assert "TMA=true" in tma["variant"] and tma["launch"] == LT_OK, tma
    assert tma["c_params"] == tma["py_params"]
    nbytes = scratch_bytes(tma)
    assert nbytes > 0 and tma["py_allocs"] == [nbytes]
    assert need == nbytes + tma["entry"]["global_scratch_align"] - 1
    alloc, free = tma["c_allocs"]
    assert (alloc["call"], alloc["bytes"], alloc["address"], alloc["stream"], alloc["context"],
            alloc["launches_before"]) == ("alloc", nbytes, SCRATCH_BASE, STREAM, 0xC000, 0)
    assert (free["call"], free["address"], free["stream"], free["launches_before"]) == ("free", SCRATCH_BASE,
                                                                                         STREAM, 1)
    hidden = tma["entry"]["hidden"]
    assert tma["c_params"][hidden] == SCRATCH_BASE.to_bytes(8, "little").hex()

    # A workspace too small: refused before any launch, nothing allocated.
    assert small["launch"] == LT_ERROR_INVALID_ARGUMENT and "workspace holds 4 bytes" in small["launch_error"]
    assert small["c_state"]["launches"] == 0 and small["c_allocs"] == [], small
    # One of lt_plan_workspace_size's bytes: the scratch from its front, aligned; nothing allocated.
    assert sized["launch"] == LT_OK and sized["c_allocs"] == [] and sized["c_params"] == sized["py_params"], sized
    align = sized["entry"]["global_scratch_align"]
    at = int.from_bytes(bytes.fromhex(sized["c_params"][hidden]), "little")
    assert at % align == 0 and sized["workspace_at"] <= at < sized["workspace_at"] + align

    # FP8, switched on: the Gluon kernel for a call that fits its tiles (its scratch from the stream), else
    # flash_fwd_fp8; each with the Python launcher's bytes.
    assert fit["variant"].startswith("flash_fwd_fp8_gluon:") and fit["launch"] == LT_OK, fit
    assert fit["c_params"] == fit["py_params"] and scratch_bytes(fit) > 0
    assert [a["bytes"] for a in fit["c_allocs"]] == [scratch_bytes(fit), 0]
    assert unfit["variant"].startswith("flash_fwd_fp8:") and unfit["launch"] == LT_OK, unfit
    assert unfit["c_params"] == unfit["py_params"]
    assert unfit["c_allocs"] == [] or scratch_bytes(unfit) > 0


def test_the_fp8_plan_follows_the_gluon_switch_off(image: Path, driver: Path, tmp_path: Path) -> None:
    assert 128 not in fp8_gluon.served_head_dims(operand_order=False)  # as shipped: the C API's flash_fwd_fp8
    library = native_library(tmp_path / "off", switched_on=False)
    (report,) = serve(library, image, driver, [{**FP8_CALL, "switched_on": False}])
    assert report["variant"].startswith("flash_fwd_fp8:") and report["launch"] == LT_OK, report
    assert report["c_params"] == report["py_params"]


def test_the_planner_holds_the_gluon_twin_where_dispatch_serves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton.kernels.flash_fwd import binding, fp8

    assert embedded.fp8_twin(90, 5, 128, 128, False, True, False, False) is None  # as shipped: not at 128
    assert embedded.fp8_twin(90, 5, 256, 256, False, True, False, False).kernel == "flash_fwd_fp8_gluon"
    monkeypatch.setattr(fp8_gluon, "KEY_ORDER_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))
    for d, causal, sq, sk in ((64, False, 256, 512), (128, True, 256, 384), (256, False, 128, 128)):
        call = binding.Call(binding.Shape(1, 2, 2, sq, sk, d), "bottom_right" if causal else "none", 0 if not causal
                            else sk - sq, d**-0.5)
        served = fp8.variant(Target.parse("sm_90"), call, call.shape, True, False, dtype="e4m3")
        twin = embedded.fp8_twin(90, 5, d, d, causal, True, False, False)
        # Python's variant but for V_OPERAND_ORDER: the C API's callers give V transposed with its keys in order
        assert fp8_gluon.reads_operand_order(served) and not fp8_gluon.reads_operand_order(twin), (d, causal)
        assert twin == fp8_gluon.variant("sm_90", "e4m3", d, "top_left" if causal else "none", True, False, sq, sk,
                                         tiles=fp8_gluon.TABLE[(d, causal)], operand_order=False), (d, causal)
        assert (twin.tuned, twin.options) == (served.tuned, served.options), (d, causal)
        assert dict(twin.functional) == {k: v for k, v in served.functional if k != "V_OPERAND_ORDER"}, (d, causal)
    for refused in ((80, 5, 128, 128, False, True, False, False), (90, 5, 128, 128, False, False, False, False),
                    (90, 5, 128, 128, False, True, True, False), (90, 5, 128, 128, False, True, False, True),
                    (90, 5, 128, 64, False, True, False, False), (90, 5, 96, 96, False, True, False, False)):
        assert embedded.fp8_twin(*refused) is None, refused


GPU_PROGRAM = IN_PROCESS_PRELUDE.split("CODES = ")[0] + CUDA_DESCRIBE.replace(
    "torch.int32: 4}", "torch.int32: 4, torch.float8_e4m3fn: 5}") + r"""
class Lib:  # the library's functions through the prelude's call() (ctypes, cffi pointers)
    def __getattr__(self, name):
        return lambda *args: call(name, *args)

lib = Lib()
from lazytriton.kernels.flash_fwd import fp8_gluon
fp8_gluon.KEY_ORDER_HEAD_DIMS = frozenset(fp8_gluon.HEAD_DIMS)  # head dim 128 too: the C API's twin there
torch.manual_seed(0)
report = []
b, hq, hk, s, d = 2, 8, 2, 1024, 128
scales = [torch.rand(b, hk, device="cuda") + 0.5 for _ in range(3)]
q, k, v = [(torch.randn(b, h, s, d, device="cuda") * 2).to(torch.float8_e4m3fn) for h in (hq, hk, hk)]
vt = v.transpose(2, 3).contiguous()
# The C plan serves the Gluon twin that reads V's keys in order (Python's calls: in operand order), so the bits
# to match are that variant's, run through Python's launcher.
from lazytriton.capi import embedded
from lazytriton.kernels.flash_fwd import binding, fp8
twin = embedded.fp8_twin(90, 5, d, d, False, True, False, False)
assert twin is not None and not fp8_gluon.reads_operand_order(twin)
want, want_lse = fp8.run_variant(q, k, v, binding.check(q, k, v, False, None, fp8=True), tuple(scales), twin)
for given in (False, True):
    out = torch.full((b, hq, s, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b, hq, s), float("nan"), device="cuda")
    p = ffi.new("lt_attn_fwd_params *")
    lib.lt_attn_fwd_params_init(p)
    for name, t in (("q", q), ("k", k), ("v", vt), ("out", out), ("lse", lse), ("q_descale", scales[0]),
                    ("k_descale", scales[1]), ("v_descale", scales[2])):
        describe(getattr(p, name), t)
    p.v_transposed = 1
    size = ffi.new("size_t *")
    sized = lib.lt_attn_fwd_workspace_size(p, size)
    if given:
        workspace = torch.empty((size[0] + 3) // 4, device="cuda")
        describe(p.workspace, workspace)
    status = lib.lt_attn_fwd(p, ffi.NULL)
    torch.cuda.synchronize()
    report.append([given, status, sized, int(size[0]), torch.equal(out, want), torch.equal(lse, want_lse)])
print(json.dumps({"runs": report}))
"""


@gpu
@pytest.mark.gpu
def test_on_a_gpu_the_fp8_gluon_plan_matches_python(prefix: Path, cache_dir: Path) -> None:
    """sm_90: lt_attn_fwd of an FP8 call that fits the Gluon kernel's tiles, fp8_gluon switched on, its scratch
    from the stream and from a workspace: out and lse bit for bit those of Python's launcher of the same variant
    (the twin, V's keys in order)."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("flash_fwd_fp8_gluon is built for sm_90; this GPU is another")
    out = exit_ok(run_program([sys.executable, "-c", GPU_PROGRAM, prefix / "lib/liblazytriton.so",
                               prefix / "include/lazytriton.h"], timeout=900))
    report = json.loads(out.splitlines()[-1])
    for _given, status, sized, need, same_out, same_lse in report["runs"]:
        assert (status, sized) == (LT_OK, LT_OK) and need > 0, report
        assert same_out and same_lse, report  # the kernel tests/test_fp8_gluon.py holds to FA3's FP8 rule
