"""The C API: build liblazytriton.so, compile C programs against it, run them.

The library is built once per test process (module fixture) with the CLI,
into a temporary prefix; C programs are compiled through pkg-config and
CMake and run as subprocesses, each with the test's own cache dir.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from capilib import IN_PROCESS_PRELUDE, assert_statuses, report_of
from capilib import exit_ok as _ok
from capilib import run_program as _run
from conftest import REPO, gpu

from lazytriton.capi import build, default_prefix, embedded, embedded_prewarm

EXAMPLE = REPO / "examples" / "c"
CHECK_SOURCE = REPO / "tests" / "capi" / "capi_check.c"
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (apt-get install gcc)")
needs_pkg_config = pytest.mark.skipif(shutil.which("pkg-config") is None,
                                      reason="needs pkg-config (apt-get install pkg-config)")
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake (apt-get install cmake)")


@pytest.fixture(scope="module")
def pkg_env(prefix: Path) -> dict[str, str]:
    return {"PKG_CONFIG_PATH": str(prefix / "lib" / "pkgconfig")}


def _pkg_config(pkg_env: dict[str, str], *args: str) -> list[str]:
    return _ok(_run(["pkg-config", *args, "lazytriton"], env=pkg_env)).split()


@pytest.fixture(scope="module")
def check_program(prefix: Path, pkg_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/capi/capi_check.c, compiled with gcc through pkg-config."""
    if shutil.which("pkg-config") is None:
        pytest.skip("needs pkg-config (apt-get install pkg-config)")
    program = tmp_path_factory.mktemp("check") / "capi_check"
    _ok(_run(["gcc", "-O1", "-Wall", "-Wextra", "-Werror", "-std=c99", "-D_POSIX_C_SOURCE=200809L",
              *_pkg_config(pkg_env, "--cflags"), "-o", program, CHECK_SOURCE, *_pkg_config(pkg_env, "--libs"),
              "-lm", "-ldl", "-lpthread"]))
    return program


@pytest.fixture(scope="module")
def example(prefix: Path, pkg_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/c/attention.c, built with its Makefile (pkg-config), out of the source tree."""
    if shutil.which("pkg-config") is None or shutil.which("make") is None:
        pytest.skip("needs pkg-config and make")
    out = tmp_path_factory.mktemp("example-make")
    _ok(_run(["make", "-C", EXAMPLE, f"OUT={out}", "CFLAGS=-O2 -Wall -Wextra -Werror -std=c99"], env=pkg_env))
    return out / "attention"


# ---------------------------------------------------------------------------
# Build and install


def test_build_installs_library_header_pc_and_cmake(prefix: Path) -> None:
    for path in ("lib/liblazytriton.so", "include/lazytriton.h", "lib/pkgconfig/lazytriton.pc",
                 "lib/cmake/lazytriton/lazytritonConfig.cmake", "lib/cmake/lazytriton/lazytritonConfigVersion.cmake"):
        assert (prefix / path).is_file(), path
    major, minor, patch = build.version()
    assert f"Version: {major}.{minor}.{patch}" in (prefix / "lib/pkgconfig/lazytriton.pc").read_text()
    if shutil.which("nm"):
        exported = {line.split()[-1] for line in _ok(_run(["nm", "-D", "--defined-only",
                                                          prefix / "lib/liblazytriton.so"])).splitlines()
                    if " T " in line}
        api = {"lt_version", "lt_last_error", "lt_config_init", "lt_init", "lt_attn_fwd_params_init", "lt_tensor_init",
               "lt_attn_fwd", "lt_attn_fwd_plan", "lt_plan_launch", "lt_plan_destroy", "lt_prewarm", "lt_cache_stats",
               "lt_plan_workspace_size", "lt_attn_fwd_workspace_size",
               "lt_attn_bwd_params_init", "lt_attn_bwd", "lt_attn_bwd_plan", "lt_bwd_plan_launch",
               "lt_bwd_plan_destroy", "lt_attn_kvcache_params_init", "lt_attn_kvcache",
               "lt_attn_kvcache_workspace_size", "lt_flash_combine_params_init", "lt_flash_combine"}
        # lt__embedded_*: what liblazytriton_native.so's JIT fallback calls (lazytriton.c's private interface)
        assert {name for name in exported if not name.startswith("PyInit_")} == {
            *api, "lt__embedded_plan", "lt__embedded_kvcache_plan", "lt__embedded_combine_plan"}
        native = {line.split()[-1] for line in _ok(_run(["nm", "-D", "--defined-only",
                                                         prefix / "lib/liblazytriton_native.so"])).splitlines()
                  if " T " in line}
        assert native >= api | {"lt_open_images", "lt_kernel_load", "lt_kernel_launch", "lt_native_last_error"}


@needs_gcc
def test_header_is_strict_c99_and_cxx(prefix: Path, tmp_path: Path) -> None:
    source = tmp_path / "uses.c"
    source.write_text("#include <lazytriton.h>\nint main(void) { lt_attn_fwd_params p; lt_attn_bwd_params g; "
                      "return lt_attn_fwd_params_init(&p) == LT_OK && lt_attn_bwd_params_init(&g) == LT_OK ? 0 "
                      ": (int)sizeof(lt_stats); }\n")
    _ok(_run(["gcc", "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-fsyntax-only",
              f"-I{prefix / 'include'}", source]))
    if shutil.which("g++"):
        _ok(_run(["g++", "-x", "c++", "-std=c++11", "-Wall", "-Wextra", "-pedantic", "-Werror", "-fsyntax-only",
                  f"-I{prefix / 'include'}", source]))


@needs_pkg_config
def test_pkg_config_flags(pkg_env: dict[str, str], prefix: Path) -> None:
    assert f"-I{prefix / 'include'}" in _pkg_config(pkg_env, "--cflags")
    libs = _pkg_config(pkg_env, "--libs")
    assert "-llazytriton" in libs and f"-L{prefix / 'lib'}" in libs
    assert _pkg_config(pkg_env, "--modversion") == [".".join(map(str, build.version()))]


def test_cli_prints_the_default_prefix(cache_dir: Path) -> None:
    out = _ok(_run([sys.executable, "-m", "lazytriton.cli", "capi", "--prefix"])).strip()
    assert out == str(default_prefix())
    if sys.prefix == sys.base_prefix:  # not a venv: a folder of the cache dir, named after this Python
        assert out == str(cache_dir / "capi" / sys.implementation.cache_tag)


# ---------------------------------------------------------------------------
# The example on the CPU (host pointers, through the interpreter)


def test_example_pkg_config_fp32(example: Path) -> None:
    out = _ok(_run([example]))
    assert "fp32" in out and "cpu (interpreter)" in out and out.strip().endswith("OK")


def test_example_fp16_top_left_gqa(example: Path) -> None:
    out = _ok(_run([example, "--dtype", "fp16", "--causal", "top_left", "--heads-q", "6", "--heads-k", "3",
                    "--head-dim", "24"]))
    assert out.strip().endswith("OK")


# The backward through the example: lt_attn_fwd, then lt_attn_bwd on its out and lse and a random dout, each
# gradient checked against the C loop in double. GQA in every case (heads 4/2 by default); odd, unequal seqlens.
BACKWARD_CASES = [
    ["--dtype", "fp32"],
    ["--dtype", "fp32", "--causal", "bottom_right", "--seqlen-q", "29", "--seqlen-k", "17"],  # rows with no key
    ["--dtype", "fp16", "--causal", "top_left", "--heads-q", "6", "--heads-k", "3", "--head-dim", "24",
     "--seqlen-q", "37", "--seqlen-k", "51"],
    ["--dtype", "fp16", "--causal", "bottom_right", "--heads-q", "4", "--heads-k", "1", "--seqlen-q", "33",
     "--seqlen-k", "47", "--head-dim", "72"],
    ["--dtype", "bf16", "--causal", "top_left", "--seqlen-q", "45", "--seqlen-k", "19", "--batch", "1"],
]


@pytest.mark.parametrize("args", BACKWARD_CASES, ids=lambda args: "-".join(a.strip("-") for a in args))
def test_example_backward_on_cpu(example: Path, args: list[str]) -> None:
    out = _ok(_run([example, "--backward", *args]))
    line = next(line for line in out.splitlines() if line.startswith("backward (lt_attn_bwd)"))
    errors = [float(x) for x in re.findall(r"d[qkv] ([0-9.e+-]+),?", line)]
    tolerance = float(re.search(r"tolerance ([0-9.e+-]+)\)", line)[1])  # type: ignore[index]
    assert len(errors) == 3 and max(errors) <= tolerance, line
    assert out.strip().endswith("OK")


@needs_cmake
def test_example_cmake_bf16_bottom_right_plan(prefix: Path, tmp_path: Path) -> None:
    build_dir = tmp_path / "build"
    _ok(_run(["cmake", "-S", EXAMPLE, "-B", build_dir, f"-DCMAKE_PREFIX_PATH={prefix}"]))
    _ok(_run(["cmake", "--build", build_dir]))
    out = _ok(_run([build_dir / "attention", "--dtype", "bf16", "--causal", "bottom_right", "--seqlen-q", "50",
                    "--seqlen-k", "30", "--plan", "--backward"]))
    assert "plans need a GPU" in out  # documented: on the CPU, lt_attn_fwd_plan says so and the example falls back
    assert ", planned" not in out and "not planned" in out  # its summary line does not claim a plan it lacked
    assert "lt_attn_bwd_plan: plans need a GPU" in out and "call lt_attn_bwd instead" in out
    assert "backward (lt_attn_bwd)" in out  # fell back to lt_attn_bwd, and says so
    assert out.strip().endswith("OK")


# ---------------------------------------------------------------------------
# Errors, threads, prewarm: tests/capi/capi_check.c


def test_every_error_path(check_program: Path, tmp_path: Path) -> None:
    out = _ok(_run([check_program, "errors", tmp_path / "lt-cache"]))
    assert "FAIL" not in out and out.count("\nok ") > 100
    # The backward's own: versioned struct, each tensor named, workspace, plans, no-work calls, strided dq.
    for name in ("bwd struct size", "bwd dout shape", "bwd delta strides", "bwd delta null", "bwd launch dead plan",
                 "bwd strided dq is bitwise the same", "bwd seqlen_q 0 zeroes dk dv", "bwd no work on gpu"):
        assert f"\nok {name}" in out, name


def test_python_that_cannot_start_is_a_status(check_program: Path) -> None:
    out = _ok(_run([check_program, "nopython"], env={"PYTHONHOME": "/nonexistent"}))
    assert "alive" in out


def test_bad_setting_is_reported_by_init(check_program: Path) -> None:
    out = _ok(_run([check_program, "badenv"], env={"LAZYTRITON_JIT": "maybe"}))
    assert "alive" in out


def test_eight_threads_at_once(check_program: Path) -> None:
    out = _ok(_run([check_program, "threads"]))
    assert out.count("own error") == 8
    assert out.count("own backward error") == 8 and out.count("backward\n") == 8  # lt_attn_bwd from 8 threads


def test_prewarm_and_cache_stats(check_program: Path) -> None:
    variant = embedded_prewarm.parse_spec("target=sm_90 dtype=fp16 head_dim=16 seqlen_q=16")
    out = _ok(_run([check_program, "prewarm", str(variant)]))
    assert "FAIL" not in out


def test_library_inside_a_python_process(prefix: Path) -> None:
    # A host that already runs Python: the library uses that interpreter and leaves its exit alone.
    code = (f"import ctypes; lib = ctypes.CDLL({str(prefix / 'lib/liblazytriton.so')!r}); "
            "lib.lt_last_error.restype = ctypes.c_char_p; status = lib.lt_init(None); "
            "import lazytriton.runtime as r; print(status, r._runtime is not None, lib.lt_last_error())")
    assert _ok(_run([sys.executable, "-c", code])).split()[:2] == ["0", "True"]


# Packed sequences through the C API on the CPU: a version 2 struct against the Python varlen call, a
# version 1 struct (the old size) still taken as a dense call, and errors before anything runs.
VARLEN_IN_PROCESS = """
import ctypes, json, sys
# lt_init before the host imports torch: the other order hangs in lt_init (the same with dense calls).
dll = ctypes.CDLL(sys.argv[1])
dll.lt_last_error.restype = ctypes.c_char_p
assert dll.lt_init(None) == 0, dll.lt_last_error()
import torch
from cffi import FFI
from lazytriton.capi import build
import lazytriton

# cffi lays the structs out from the header; ctypes calls the library (as a host program would, GIL released).
ffi = FFI()
ffi.cdef(build.header_cdef(open(sys.argv[2]).read()))

class Lib:
    def __getattr__(self, name):
        fn = getattr(dll, name)
        return lambda *args: fn(*(ctypes.c_void_p(int(ffi.cast("uintptr_t", a))) if isinstance(a, ffi.CData)
                                  else a for a in args))

lib = Lib()
CODES = {torch.float32: 3, torch.int32: 4}

def describe(view, t):
    view.data = ffi.cast("void *", t.data_ptr())
    view.dtype, view.ndim, view.device_type, view.device_index = CODES[t.dtype], t.dim(), 1, 0
    for i in range(t.dim()):
        view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)

def error():
    return dll.lt_last_error().decode()

torch.manual_seed(0)
cq = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)  # lengths 3, 0, 17, 1
ck = torch.tensor([0, 5, 9, 18, 18], dtype=torch.int32)  # lengths 5, 4, 9, 0
q, do = torch.randn(21, 4, 16), torch.randn(21, 4, 16)
k, v = torch.randn(18, 2, 16), torch.randn(18, 2, 16)
out, lse = torch.full_like(q, 7.0), torch.full((4, 21), 7.0)
p = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(p)
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
    describe(getattr(p, name), t)
p.causal, p.max_seqlen_q, p.max_seqlen_k = 2, 17, 9
report = {"fwd": lib.lt_attn_fwd(p, ffi.NULL), "fwd_error": error()}
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
want_out, want_lse, _ = lazytriton.flash_attn_varlen_func(*leaves, cq, ck, 17, 9, causal=True, return_attn_probs=True)
report["out_equal"] = torch.equal(out, want_out.detach()) and torch.equal(lse, want_lse)

g = ffi.new("lt_attn_bwd_params *")
lib.lt_attn_bwd_params_init(g)
grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
delta = torch.empty(4, 21)
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", do), ("dq", grads[0]),
                ("dk", grads[1]), ("dv", grads[2]), ("delta", delta), ("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
    describe(getattr(g, name), t)
g.causal, g.max_seqlen_q, g.max_seqlen_k = 2, 17, 9
report["bwd"], report["bwd_error"] = lib.lt_attn_bwd(g, ffi.NULL), error()
wanted = torch.autograd.grad(want_out, leaves, do)
report["grads_equal"] = all(torch.equal(a, b) for a, b in zip(grads, wanted))

def status_of(change):
    bad = ffi.new("lt_attn_fwd_params *")
    ffi.memmove(bad, p, ffi.sizeof("lt_attn_fwd_params"))
    change(bad)
    return [lib.lt_attn_fwd(bad, ffi.NULL), error()]

decreasing = torch.tensor([0, 3, 2, 20, 21], dtype=torch.int32)
report["errors"] = [
    status_of(lambda b: setattr(b, "causal", 1)),
    status_of(lambda b: setattr(b.cu_seqlens_k, "dtype", 3)),
    status_of(lambda b: b.cu_seqlens_k.sizes.__setitem__(0, 4)),
    status_of(lambda b: setattr(b, "max_seqlen_k", 0)),
    status_of(lambda b: setattr(b.q, "ndim", 4)),
    status_of(lambda b: setattr(b.cu_seqlens_q, "data", ffi.cast("void *", decreasing.data_ptr()))),
]
# A version 1 struct (the old size and version): the dense call it always was.
qd, kd = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 7, 16)
outd, lsed = torch.empty_like(qd), torch.empty(1, 2, 5)
old = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(old)
for name, t in (("q", qd), ("k", kd), ("v", kd), ("out", outd), ("lse", lsed)):
    describe(getattr(old, name), t)
old.struct_size, old.version = ffi.offsetof("lt_attn_fwd_params", "cu_seqlens_q"), 1
old.cu_seqlens_q.ndim = 1  # past a version 1 struct's end: never read
report["v1"] = lib.lt_attn_fwd(old, ffi.NULL)
report["v1_equal"] = torch.equal(outd, lazytriton.attn_fwd(qd, kd, kd)[0])
print(json.dumps(report))
"""


def test_packed_sequences_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    report = report_of(VARLEN_IN_PROCESS, prefix)
    assert (report["fwd"], report["bwd"]) == (0, 0), (report["fwd_error"], report["bwd_error"])
    assert report["out_equal"] and report["grads_equal"]
    expected = [(1, "causal is LT_CAUSAL_TOP_LEFT"), (4, "cu_seqlens_k.dtype is 3"),
                (5, "must both have batch + 1 entries, got 5 and 4"), (1, "max_seqlen_k is 0"), (5, "q.ndim is 4"),
                (1, "cu_seqlens_q must be nondecreasing")]
    assert_statuses(report["errors"], expected)
    assert report["v1"] == 0 and report["v1_equal"]


# FlashAttention-3's seqused_q/seqused_k through the C API on the CPU: a version 4 struct against the Python
# call (out, lse and the gradients start at 7.0, so the unused rows' 0 and -inf are the call's writes), a
# version 3 struct (its smaller size) still taken as the call without them, and errors before anything runs.
SEQUSED_IN_PROCESS = IN_PROCESS_PRELUDE + r"""
def error():
    return dll.lt_last_error().decode()

torch.manual_seed(0)
cq = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)  # spans 3, 0, 17, 1
ck = torch.tensor([0, 5, 9, 18, 18], dtype=torch.int32)  # spans 5, 4, 9, 0
uq = torch.tensor([2, 0, 11, 1], dtype=torch.int32)
uk = torch.tensor([5, 1, 4, 0], dtype=torch.int32)
q, do = torch.randn(21, 4, 16), torch.randn(21, 4, 16)
k, v = torch.randn(18, 2, 16), torch.randn(18, 2, 16)
report = {}

def forward(version):
    out, lse = torch.full_like(q, 7.0), torch.full((4, 21), 7.0)
    p = ffi.new("lt_attn_fwd_params *")
    call("lt_attn_fwd_params_init", p)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("cu_seqlens_q", cq),
                    ("cu_seqlens_k", ck), ("seqused_q", uq), ("seqused_k", uk)):
        describe(getattr(p, name), t)
    p.causal, p.max_seqlen_q, p.max_seqlen_k = 2, 17, 9
    if version == 3:  # the seqused fields lie past a version 3 struct's end: never read
        p.struct_size, p.version = ffi.offsetof("lt_attn_fwd_params", "seqused_q"), 3
    return p, out, lse, [call("lt_attn_fwd", p, ffi.NULL), error()]

def backward(version, out, lse):
    g = ffi.new("lt_attn_bwd_params *")
    call("lt_attn_bwd_params_init", g)
    grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", do), ("dq", grads[0]),
                    ("dk", grads[1]), ("dv", grads[2]), ("delta", torch.empty(4, 21)), ("cu_seqlens_q", cq),
                    ("cu_seqlens_k", ck), ("seqused_q", uq), ("seqused_k", uk)):
        describe(getattr(g, name), t)
    g.causal, g.max_seqlen_q, g.max_seqlen_k = 2, 17, 9
    if version == 3:
        g.struct_size, g.version = ffi.offsetof("lt_attn_bwd_params", "seqused_q"), 3
    return grads, [call("lt_attn_bwd", g, ffi.NULL), error()]

for version, used in ((4, {"seqused_q": uq, "seqused_k": uk}), (3, {})):
    p, out, lse, report[f"fwd{version}"] = forward(version)
    grads, report[f"bwd{version}"] = backward(version, out, lse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse, _ = lazytriton.flash_attn_varlen_func(*leaves, cq, ck, 17, 9, causal=True,
                                                              return_attn_probs=True, **used)
    wanted = torch.autograd.grad(want_out, leaves, do)
    report[f"equal{version}"] = (torch.equal(out, want_out.detach()) and torch.equal(lse, want_lse)
                                 and all(torch.equal(a, b) for a, b in zip(grads, wanted)))
unused_q = torch.cat([torch.arange(n) >= u for n, u in zip((3, 0, 17, 1), uq.tolist())])
unused_k = torch.cat([torch.arange(n) >= u for n, u in zip((5, 4, 9, 0), uk.tolist())])
p, out, lse, _ = forward(4)
grads, _ = backward(4, out, lse)
report["unused"] = bool((out[unused_q] == 0).all() and torch.isneginf(lse[:, unused_q]).all()
                        and (grads[0][unused_q] == 0).all() and (grads[1][unused_k] == 0).all()
                        and (grads[2][unused_k] == 0).all() and unused_q.any() and unused_k.any())

def status_of(change):
    bad = ffi.new("lt_attn_fwd_params *")
    ffi.memmove(bad, p, ffi.sizeof("lt_attn_fwd_params"))
    change(bad)
    return [call("lt_attn_fwd", bad, ffi.NULL), error()]

too_long = torch.tensor([2, 1, 11, 1], dtype=torch.int32)
dense_q, dense_out = torch.randn(1, 2, 5, 16), torch.empty(1, 2, 5, 16)

def dense(b):
    for name, t in (("q", dense_q), ("k", dense_q), ("v", dense_q), ("out", dense_out),
                    ("lse", torch.empty(1, 2, 5))):
        describe(getattr(b, name), t)
    b.cu_seqlens_q, b.cu_seqlens_k = ffi.new("lt_tensor *")[0], ffi.new("lt_tensor *")[0]

report["errors"] = [
    status_of(lambda b: setattr(b.seqused_q, "dtype", 3)),
    status_of(lambda b: b.seqused_k.sizes.__setitem__(0, 5)),
    status_of(lambda b: setattr(b.seqused_q, "data", ffi.cast("void *", too_long.data_ptr()))),
    status_of(dense),
]
print(json.dumps(report))
"""


def test_seqused_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    report = report_of(SEQUSED_IN_PROCESS, prefix)
    for version in (4, 3):
        assert report[f"fwd{version}"][0] == 0 and report[f"bwd{version}"][0] == 0, report
        assert report[f"equal{version}"], f"version {version}: the C call differs from the Python one"
    assert report["unused"], "unused rows: out 0, lse -inf, dq 0; unused keys: dk, dv 0"
    expected = [(4, "seqused_q.dtype is 3"), (5, "seqused_k must be 1-dim with batch = 4 entries"),
                (1, "seqused_q[1] = 1: must be in 0..0"), (1, "seqused_q is given but the call is dense")]
    assert_statuses(report["errors"], expected)


# Specs lt_prewarm must refuse with LT_ERROR_INVALID_ARGUMENT before compiling anything: a well-formed
# variant string naming no fields (was a KeyError, LT_ERROR_PYTHON), axes out of range (compiled), an
# unknown target, and a variant that cannot fit its target (the poisoned miss-log line).
BAD_PREWARM_SPECS = [
    ("flash_fwd:sm_90:fp16:::", "lacks BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, CAUSAL, num_warps, num_stages"),
    ("target=sm_90 dtype=fp16 head_dim=0 seqlen_q=-5", "head_dim='0': expected an integer in 1..256"),
    ("target=sm_90 dtype=fp16 head_dim=16 seqlen_q=-5", "seqlen_q='-5': expected an integer in 1..2147483647"),
    ("target=sm_90 dtype=fp16 head_dim=16 seqlen_k=0", "seqlen_k='0'"),
    ("target=sm_90 dtype=fp16 head_dim=x", "head_dim='x'"),
    ("target=sm_999 dtype=fp16 head_dim=16", "unknown target 'sm_999'; known targets: sm_80"),
    ("flash_fwd:sm_90:fp16:ALIGN16=true,BLOCK_D=16,CAUSAL=false,EVEN_D=true:BLOCK_M=16:num_stages=1,num_warps=4",
     "lacks BLOCK_N"),
    ("flash_fwd:sm_90:fp32:ALIGN16=true,BLOCK_D=256,CAUSAL=false,EVEN_D=true,INDEX64=false:BLOCK_M=1024,"
     "BLOCK_N=1024:num_stages=1,num_warps=4", "BLOCK_M=1024 is over the cap of 256"),
]

PREWARM_IN_PROCESS = """
import ctypes, json, os, sys
lib = ctypes.CDLL(sys.argv[1])
lib.lt_last_error.restype = ctypes.c_char_p
assert lib.lt_init(None) == 0, lib.lt_last_error()
results = []
for spec in json.loads(os.environ["SPECS"]):
    specs = (ctypes.c_char_p * 1)(spec.encode())
    status = lib.lt_prewarm(specs, ctypes.c_size_t(1), None, None)
    results.append([status, lib.lt_last_error().decode()])
import lazytriton.runtime as r
print(json.dumps({"results": results, "compiles": r.get().compiles}))
"""


def test_prewarm_refuses_bad_specs_as_invalid_arguments_before_compiling(prefix: Path, cache_dir: Path) -> None:
    import json

    specs = [spec for spec, _ in BAD_PREWARM_SPECS]
    out = _ok(_run([sys.executable, "-c", PREWARM_IN_PROCESS, prefix / "lib/liblazytriton.so"],
                   env={"SPECS": json.dumps(specs)}))
    report = json.loads(out.splitlines()[-1])
    for (spec, needle), (status, message) in zip(BAD_PREWARM_SPECS, report["results"], strict=True):
        assert status == embedded.INVALID_ARGUMENT, (spec, status, message)
        assert "specs[0]" in message and needle in message, (spec, message)
    assert report["compiles"] == 0 and not (cache_dir / "misses.jsonl").exists()


# ---------------------------------------------------------------------------
# The backward's launcher against its binding (pure: reads lt_bwd.c)

BWD_SOURCE = REPO / "capi" / "lt_bwd.c"


def _initializer(kernel: str, macro: str) -> list[str]:
    body = re.search(rf"int64_t {kernel}_ints\[{macro} - LT__BWD_FLOATS \+ LT__MAX_HIDDEN\] = \{{(.*?)\}};",
                     BWD_SOURCE.read_text(), re.S)
    assert body, f"the {kernel} argument initializer was not found in lt_bwd.c"
    return [" ".join(item.split()) for item in body[1].split(",")]


@pytest.mark.parametrize(("kernel", "macro"), [("flash_bwd_dq", "LT__BWD_DQ_PARAMS"),
                                               ("flash_bwd_dkdv", "LT__BWD_DKDV_PARAMS")])
def test_the_c_backward_launcher_passes_each_description_field_by_field(kernel: str, macro: str) -> None:
    from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
    from lazytriton.kernels.flash_bwd import binding as bwd

    spec = {"flash_bwd_dq": FLASH_BWD_DQ, "flash_bwd_dkdv": FLASH_BWD_DKDV}[kernel]
    names = embedded.int_params(kernel)
    c_items = _initializer(kernel.removeprefix("flash_bwd_"), macro)
    expected = [" ".join(item.split()) for item in bwd.c_initializer(kernel).split(", ")]
    assert len(c_items) == len(names) == len(spec.params) - 3
    for name, c_item, want in zip(names, c_items, expected, strict=True):
        assert c_item == want, f"lt_bwd.c passes {c_item!r} as {kernel}'s {name}; the binding says {want!r}"
    floats = ["sm_scale", "softcap", "dropout_p"]
    assert [name for name, kind in spec.params if kind.startswith("fp")] == floats  # floats last
    assert all(not kind.startswith("fp") for _, kind in spec.params[:-3])
    defined = re.search(rf"#define {macro} (\d+)", BWD_SOURCE.read_text())
    assert defined and int(defined[1]) == len(spec.params)


@pytest.mark.parametrize(("variable", "params"), [("bits", "ALIGNED_PARAMS"), ("seq_bits", "SEQ_ALIGNED_PARAMS")])
def test_the_c_backward_alignment_rules_are_the_bindings(variable: str, params: str) -> None:
    """ALIGN16 (pointers, data strides) and SEQ16 (seqlens, lse strides): each C expression is the binding's."""
    from lazytriton.kernels.flash_bwd import binding as bwd

    body = re.search(rf"uint64_t {variable} = \(uint64_t\)\((.*?)\);", BWD_SOURCE.read_text(), re.S)
    assert body, f"lt__bwd_aligned's {variable} expression was not found in lt_bwd.c"
    c_items = [" ".join(item.split()) for item in body[1].split("|")]
    assert c_items == [bwd.PARAM_SOURCES[name][1] for name in getattr(bwd, params)]
    assert "!c->varlen ? LT__ALIGN16 | LT__SEQ16 : LT__ALIGN16" in BWD_SOURCE.read_text()  # never for packed calls


def test_the_c_kernel_codes_are_the_planners() -> None:
    text = (REPO / "capi" / "lazytriton.c").read_text()
    codes = {int(n): name for name, n in re.findall(r"LT__KERNEL_(\w+) = (\d+)", text)}
    assert {n: f"flash_{name.lower()}" for n, name in codes.items()} == embedded.KERNELS


def test_plan_variant_is_the_bindings_choice() -> None:
    import torch

    from lazytriton.kernels.flash_bwd import binding as bwd
    from lazytriton.kernels.flash_fwd import binding as fwd
    from lazytriton.target import Target

    shape = fwd.Shape(1, 1, 1, 300, 257, 72)
    dq, dkdv = bwd.variants(Target("cuda", "90", 32), torch.bfloat16, shape, True, True, False)
    assert embedded.plan_variant("flash_bwd_dq", 90, 2, 72, True, True, False, 300, 257) == dq
    assert embedded.plan_variant("flash_bwd_dkdv", 90, 2, 72, True, True, False, 300, 257) == dkdv
    assert (dq.kernel, dkdv.kernel) == ("flash_bwd_dq", "flash_bwd_dkdv")
    assert embedded.plan_variant("flash_fwd", 90, 2, 72, True, True, False, 300, 257) == fwd.variant(
        Target("cuda", "90", 32), torch.bfloat16, shape, True, True, False)


def test_plan_variant_and_prewarm_specs_of_packed_sequences() -> None:
    from lazytriton.kernels import dispatch
    from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
    from lazytriton.kernels.flash_fwd import varlen
    from lazytriton.target import Target

    sm90 = Target("cuda", "90", 32)
    want = dispatch.kernel_variant("flash_bwd_dkdv", sm90, "bf16", 72, True, True, 300, 257, varlen=True)
    assert embedded.plan_variant("flash_bwd_dkdv", 90, 2, 72, True, True, False, 300, 257, True) == want
    assert want.get("VARLEN") is True and "VARLEN" not in str(
        embedded.plan_variant("flash_bwd_dkdv", 90, 2, 72, True, True, False, 300, 257))
    import torch

    q = torch.empty(10, 2, 72, dtype=torch.bfloat16)
    call = varlen.check(q, q, q, torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32),
                        300, 257, causal=True)
    assert varlen.variants(varlen.BACKWARD, sm90, torch.bfloat16, call, True, False)[1] == want  # the binding's
    (fwd,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=64 varlen=1")
    assert fwd.get("VARLEN") is True
    both = embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=bf16 head_dim=64 varlen=1")
    assert [v.kernel for v in both] == list(bwd_dispatch.BWD_KERNELS) and all(v.get("VARLEN") is True for v in both)


@pytest.mark.parametrize("kernel", ["flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"])
def test_check_launch_layout_per_kernel(kernel: str) -> None:
    n = len(embedded.int_params(kernel))
    good = SimpleNamespace(key="k", arg_types=("*fp16",) * 8 + ("i32",) * (n - 8) + ("fp32",) * 3, hidden_args=(),
                           global_scratch_size=0, profile_scratch_size=0)
    embedded.check_launch_layout(good, kernel)
    for bad in (good.arg_types[:-1], good.arg_types + ("fp32",), ("fp32",) + good.arg_types[1:]):
        with pytest.raises(embedded.CapiError, match="the C launcher takes"):
            embedded.check_launch_layout(SimpleNamespace(**{**vars(good), "arg_types": bad}), kernel)


# ---------------------------------------------------------------------------
# Pure parts of the Python half


def test_parse_spec_axes_and_variant_strings() -> None:
    variant = embedded_prewarm.parse_spec("target=cuda:90, dtype=bf16 head_dim=80 causal=1 seqlen_q=4096 aligned=0")
    assert (variant.target, variant.dtype, variant.get("CAUSAL")) == ("sm_90", "bf16", True)
    # head dim 80: split tiles (64 + 16; attention.SPLIT_BY_DEFAULT), which add up to it exactly
    assert (variant.get("BLOCK_D"), variant.get("BLOCK_D2"), variant.get("EVEN_D")) == (64, 16, True)
    assert variant.get("ALIGN16") is False
    assert embedded_prewarm.parse_spec(str(variant)) == variant
    for bad, needle in (("target=sm_90 dtype=bf16", "lack head_dim"), ("target=sm_90 dtype=bf16 head_dim=64 x=1",
                                                                        "not an axis"),
                        ("kernel=flash_xyz target=sm_90 dtype=bf16 head_dim=64", "expected flash_fwd, flash_bwd"),
                        ("kernel=flash_bwd target=sm_90 dtype=bf16 head_dim=64", "names 2 variants"),
                        ("target=sm_90 dtype=bf16 head_dim=64 causal=maybe", "causal='maybe'")):
        with pytest.raises(ValueError, match=needle):
            embedded_prewarm.parse_spec(bad)


def test_parse_specs_kernel_flash_bwd_gives_the_bindings_two_variants() -> None:
    import torch

    from lazytriton.kernels.flash_bwd import binding as bwd
    from lazytriton.kernels.flash_fwd import binding as fwd
    from lazytriton.target import Target

    got = embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=fp16 head_dim=72 causal=1 seqlen_q=300 "
                               "seqlen_k=257 aligned=0")
    want = bwd.variants(Target.parse("sm_90"), torch.float16, fwd.Shape(1, 1, 1, 300, 257, 72), True, False, False)
    assert got == want and [v.kernel for v in got] == ["flash_bwd_dq", "flash_bwd_dkdv"]
    assert embedded_prewarm.parse_specs(str(got[1])) == (got[1],)  # a backward variant string, as the miss log has it
    assert embedded_prewarm.parse_specs("target=sm_90 dtype=fp16 head_dim=72") == (
        embedded_prewarm.parse_spec("kernel=flash_fwd target=sm_90 dtype=fp16 head_dim=72"),)
    with pytest.raises(ValueError, match="dtype='fp64': expected one of fp16, bf16, fp32"):
        embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=fp64 head_dim=72")


@pytest.mark.parametrize(("spec", "needle"), BAD_PREWARM_SPECS)
def test_parse_spec_refuses_what_must_not_compile(spec: str, needle: str) -> None:
    with pytest.raises(ValueError) as caught:
        embedded_prewarm.parse_spec(spec)
    assert needle in str(caught.value)


def test_settings_of_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(build.header_cdef((build.HERE / "lazytriton.h").read_text()))
    monkeypatch.setattr(embedded, "_ffi", ffi)
    cfg = ffi.new("lt_config *")
    assert embedded.settings_of(cfg) == {}
    keep = [ffi.new("char[]", b"/tmp/x"), ffi.new("char[]", b"/a.ltimg::/b")]
    cfg.cache_dir, cfg.images, cfg.log_level, cfg.jit = keep[0], keep[1], 20, 2
    assert embedded.settings_of(cfg) == {"cache_dir": "/tmp/x", "images": ["/a.ltimg", "/b"], "log_level": "INFO",
                                         "jit": False}
    cfg.jit = 3
    with pytest.raises(ValueError, match="config.jit is 3"):
        embedded.settings_of(cfg)


# ---------------------------------------------------------------------------
# GPU (device memory, plans): skipped without CUDA


@gpu
@pytest.mark.gpu
def test_example_on_gpu_with_and_without_plan(example: Path) -> None:
    for extra in ([], ["--plan"], ["--dtype", "bf16", "--causal", "bottom_right", "--plan"]):
        out = _ok(_run([example, "--gpu", "--seqlen-q", "300", "--seqlen-k", "257", "--head-dim", "128", *extra]))
        assert "cuda:0" in out and out.strip().endswith("OK")


@gpu
@pytest.mark.gpu
def test_example_backward_on_gpu_with_and_without_plan(example: Path) -> None:
    for extra in ([], ["--plan"], ["--dtype", "bf16", "--causal", "bottom_right", "--plan"],
                  ["--dtype", "fp32", "--causal", "top_left", "--heads-q", "8", "--heads-k", "2"]):
        out = _ok(_run([example, "--gpu", "--backward", "--seqlen-q", "300", "--seqlen-k", "257", "--head-dim", "128",
                        *extra]))
        assert "cuda:0" in out and "backward (lt_" in out and out.strip().endswith("OK")
        if "--plan" in extra:
            assert "backward (lt_bwd_plan_launch)" in out


@gpu
@pytest.mark.gpu
def test_gpu_plans_and_mismatches(check_program: Path) -> None:
    out = _ok(_run([check_program, "gpu"]))
    assert "FAIL" not in out


# A value head dim different from q's (DeepSeek's MLA: 192 and 128) through the C API on the CPU: v, out,
# dout and dv with their own head dim, against the Python call; and what does not fit refused before it runs.
HEAD_DIM_V_IN_PROCESS = VARLEN_IN_PROCESS.split("torch.manual_seed(0)")[0] + """
torch.manual_seed(0)
q, k, v, do = torch.randn(2, 4, 9, 40), torch.randn(2, 2, 13, 40), torch.randn(2, 2, 13, 72), torch.randn(2, 4, 9, 72)
out, lse = torch.full_like(do, 7.0), torch.full((2, 4, 9), 7.0)
p = ffi.new("lt_attn_fwd_params *")
lib.lt_attn_fwd_params_init(p)
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
    describe(getattr(p, name), t)
p.causal = 2
report = {"fwd": lib.lt_attn_fwd(p, ffi.NULL), "fwd_error": error()}
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
want_out, want_lse = lazytriton.attn_fwd(*leaves, causal="bottom_right")
report["out_equal"] = torch.equal(out, want_out.detach()) and torch.equal(lse, want_lse)
g = ffi.new("lt_attn_bwd_params *")
lib.lt_attn_bwd_params_init(g)
grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
delta = torch.empty(2, 4, 9)
for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", do), ("dq", grads[0]),
                ("dk", grads[1]), ("dv", grads[2]), ("delta", delta)):
    describe(getattr(g, name), t)
g.causal = 2
report["bwd"], report["bwd_error"] = lib.lt_attn_bwd(g, ffi.NULL), error()
report["grads_equal"] = all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(want_out, leaves, do)))

def status_of(change):
    bad = ffi.new("lt_attn_fwd_params *")
    ffi.memmove(bad, p, ffi.sizeof("lt_attn_fwd_params"))
    change(bad)
    return [lib.lt_attn_fwd(bad, ffi.NULL), error()]

report["errors"] = [
    status_of(lambda b: b.out.sizes.__setitem__(3, 40)),
    status_of(lambda b: b.v.sizes.__setitem__(2, 12)),
    status_of(lambda b: (b.v.sizes.__setitem__(3, 300), b.out.sizes.__setitem__(3, 300))),
]
gq = ffi.new("lt_attn_bwd_params *")
ffi.memmove(gq, g, ffi.sizeof("lt_attn_bwd_params"))
gq.dv.sizes[3] = 40
report["bwd_errors"] = [[lib.lt_attn_bwd(gq, ffi.NULL), error()]]
print(json.dumps(report))
"""


def test_a_value_head_dim_of_its_own_on_the_cpu_through_the_c_api(prefix: Path, cache_dir: Path) -> None:
    report = report_of(HEAD_DIM_V_IN_PROCESS, prefix)
    assert (report["fwd"], report["bwd"]) == (0, 0), (report["fwd_error"], report["bwd_error"])
    assert report["out_equal"] and report["grads_equal"]
    expected = [(5, "out has shape (2, 4, 9, 40); expected q's shape with v's head dim (2, 4, 9, 72)"),
                (5, "k and v must have the same shape but for the head dim"),
                (6, "v's head dim (v.sizes[3]) must be in 1..256, got 300")]
    assert_statuses(report["errors"], expected)
    (status, message), = report["bwd_errors"]
    assert status == 5 and "dv has shape (2, 2, 13, 40); expected v's shape (2, 2, 13, 72)" in message


def test_plan_variant_and_prewarm_specs_of_a_value_head_dim() -> None:
    import torch

    from lazytriton.kernels.flash_bwd import binding as bwd
    from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
    from lazytriton.kernels.flash_fwd import binding as fwd
    from lazytriton.target import Target

    sm90 = Target("cuda", "90", 32)
    shape = fwd.Shape(1, 1, 1, 300, 257, 192)
    dq, dkdv = bwd.variants(sm90, torch.bfloat16, shape, True, True, False, head_dim_v=128)
    assert embedded.plan_variant("flash_bwd_dq", 90, 2, 192, True, True, False, 300, 257, False, 128) == dq
    assert embedded.plan_variant("flash_bwd_dkdv", 90, 2, 192, True, True, False, 300, 257, False, 128) == dkdv
    mla = embedded.plan_variant("flash_fwd", 90, 2, 192, True, True, False, 300, 257, False, 128)
    assert mla == fwd.variant(sm90, torch.bfloat16, shape, True, True, False, head_dim_v=128)
    assert mla.get("BLOCK_DV") == 128
    assert embedded.plan_variant("flash_fwd", 90, 2, 192, True, True, False, 300, 257, False, 192) == fwd.variant(
        sm90, torch.bfloat16, shape, True, True, False)
    (spec,) = embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=192 head_dim_v=128")
    assert spec.get("BLOCK_DV") == 128 and spec.get("BLOCK_D") == 256
    both = embedded_prewarm.parse_specs("kernel=flash_bwd target=sm_90 dtype=bf16 head_dim=192 head_dim_v=128 varlen=1")
    assert [v.kernel for v in both] == list(bwd_dispatch.BWD_KERNELS)
    assert all(v.get("BLOCK_DV") == 128 and v.get("VARLEN") is True for v in both)
    with pytest.raises(ValueError, match="head_dim_v='0'"):
        embedded_prewarm.parse_specs("target=sm_90 dtype=bf16 head_dim=192 head_dim_v=0")
