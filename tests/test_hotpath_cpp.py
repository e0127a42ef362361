"""The C++ warm-path tail (kernels/flash_fwd/_hotpath.cpp) launches exactly what the Python tail launches.

On CPU: the extension is built once for this session against the installed
torch (a missing C++ compiler or header fails the test, with the build's own
message). The warm path's generated text runs on CPU tensors (``cuda=False``)
through the real ``CudaApi``, ``LoadedKernel`` and compiled launch helper on
the fake libcuda (tests/fake_libcuda.py), once with the C++ tail and once
without; the fake's record of each launch (every parameter's bytes, grid,
block, stream) must agree, field by field, with ``binding.pack``. On a GPU:
results and CUDA graph capture through the loaded module.
"""

from __future__ import annotations

import functools
import logging
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import hotpathlib
import pytest
import torch
from fake_libcuda import Fake
from hotpathlib import Runtime
from test_driver import _entry
from test_flash_fwd import make_qkv, on_gpu
from test_hot import CPU_CASES, _inputs

import lazytriton
from lazytriton import runtime
from lazytriton.driver import DriverError, fastlaunch, gpu, helpers, helpers_build
from lazytriton.kernels.flash_fwd import binding, hot, hotpath, hotpath_build

ARG_TYPES = hotpathlib.arg_types("flash_fwd")
SIZES = hotpathlib.param_sizes(ARG_TYPES)
built, cpp, helper = hotpathlib.tail_fixtures(hotpath, hotpath_build, "hotpath")


@pytest.fixture(scope="module")
def fake(fake_library: Path) -> Fake:
    made = Fake(fake_library)
    made.library = fake_library  # type: ignore[attr-defined]
    return made


def _paths(fake: Fake, helper: Any, cpp: Any, monkeypatch: pytest.MonkeyPatch, result: str, layout: str,
           spare: torch.Tensor, stream_inside: bool = False) -> tuple[Runtime, Any, dict[str, Any], list[Any]]:
    """(runtime, kernel on the fake, {"python": fn, "cpp": fn}, what run_cpp returned) for one warm path."""
    monkeypatch.setattr(fastlaunch, "_module", lambda: helper)
    kernel = gpu.CudaApi(str(fake.library)).load(_entry(ARG_TYPES), 0)  # type: ignore[attr-defined]
    assert fastlaunch.plan_bytes(kernel.fast) is not None
    fake.configure(SIZES)
    rt, served = Runtime(), []

    def run(*args: Any) -> Any:
        done = cpp.run(*args)
        served.append(done)
        return done

    scope = {"get_runtime": lambda: rt, "raw_stream": lambda di: 0x5EED,
             "SPARE": {-1: (spare.numel(), spare.data_ptr())}}
    paths = {"python": hot.generate(layout, result, cuda=False, cpp=False, **scope),
             "cpp": hot.generate(layout, result, cuda=False, cpp=cpp, stream_inside=stream_inside, **scope,
                                 run_cpp=run)}
    return rt, kernel, paths, served


def _launched(fake: Fake) -> tuple[list[int], list[float], dict[str, int]]:
    """(ints, floats, state) of the fake's last launch, decoded by parameter type."""
    params, state = fake.last_launch()
    return (*hotpathlib.decoded(params, ARG_TYPES), state)


def _plan(rt: Runtime, kernel: Any, q: Any, k: Any, v: Any, call: Any, dtype: torch.dtype) -> tuple[bool, bool]:
    """Memoise the plan under both alignments: block_m 64 when aligned, 32 when not (the grids tell them apart)."""
    out0, lse0 = binding.empty_outputs(q, call.shape)
    _, aligned, index64 = binding.pack(q, k, v, out0, lse0, call)
    for flag, block_m in ((True, 64), (False, 32)):
        rt.plans[binding.memo_key(-1, dtype, call.shape, call.causal != "none", flag, index64, offset=call.offset,
                                  scale=call.scale)] = (kernel, block_m)
    return aligned, index64


@pytest.mark.parametrize("result", ["forward", "output"])
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_cpp_tail_launches_what_the_python_tail_launches(case: tuple[Any, ...], result: str, fake: Fake, helper: Any,
                                                         cpp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, _, _, _, causal, scale, dtype, _ = case
    q, k, v, view = _inputs(case)
    spare = torch.empty(1 << 16, dtype=torch.float32)
    rt, kernel, paths, served = _paths(fake, helper, cpp, monkeypatch, result, layout, spare)
    call = binding.check(view(q), view(k), view(v), causal, scale)
    _plan(rt, kernel, view(q), view(k), view(v), call, dtype)
    seen = {}
    for name, warm in paths.items():
        for _ in range(2):  # the first call describes the shape, the second is served from its entry
            done = warm(q, k, v, causal, scale)
            assert done is not None
        out, lse = done if result == "forward" else (done, None)
        ints, floats, state = _launched(fake)
        if lse is None:  # the spare buffer: what the kernel writes lse into when nobody reads it
            lse = spare[:call.shape.batch * call.shape.heads_q * call.shape.seqlen_q].view(
                call.shape.batch, call.shape.heads_q, call.shape.seqlen_q)
        expected, _, _ = binding.pack(view(q), view(k), view(v), view(out), lse, call)
        assert ints == list(expected), f"{name}: every int/pointer parameter, in FLASH_FWD.params order"
        assert floats == [struct.unpack("<f", struct.pack("<f", x))[0] for x in binding.floats(call)], name
        assert out.dtype == q.dtype and out.shape == q.shape
        if result == "forward":
            assert lse.shape == (call.shape.batch, call.shape.heads_q, call.shape.seqlen_q)
            assert lse.dtype == torch.float32 and lse.is_contiguous()
        state = {key: state[key] for key in ("grid_x", "grid_y", "grid_z", "block_x", "stream", "function")}
        seen[name] = (out.stride(), state)
    assert seen["cpp"] == seen["python"], "the same out strides (empty_like(q)'s) and the same launch"
    assert len(served) == 2 and all(done is not None for done in served), "the C++ tail served every call"


def test_cpp_tail_picks_the_unaligned_plan_for_an_unaligned_pointer(fake: Fake, helper: Any, cpp: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    spare = torch.empty(1 << 12, dtype=torch.float32)
    rt, kernel, paths, served = _paths(fake, helper, cpp, monkeypatch, "forward", "bhsd", spare)
    base = torch.randn(2 * 64 * 64 + 1)
    q = base[1:].view(1, 2, 64, 64)  # 4 bytes off: the pointer is not 16-byte aligned, the strides are
    k = v = base[:-1].view(1, 2, 64, 64)
    _plan(rt, kernel, k, k, v, binding.check(k, k, v), torch.float32)
    grids = {}
    for name, warm in paths.items():
        for args in ((q, k, v), (k, k, v)):  # the same sizes and strides: one entry, both plans
            warm(*args, False, None)
            warm(*args, False, None)
            grids[name, args[0] is q] = _launched(fake)[2]["grid_x"]
    assert grids == {("python", True): 2, ("python", False): 1, ("cpp", True): 2, ("cpp", False): 1}
    assert served[-1] is not None


def test_cpp_tail_leaves_an_unmemoised_plan_to_the_python_tail(fake: Fake, helper: Any, cpp: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    spare = torch.empty(1 << 12, dtype=torch.float32)
    rt, kernel, paths, served = _paths(fake, helper, cpp, monkeypatch, "output", "bhsd", spare)
    q, k, v = make_qkv(1, (2, 2), (16, 16), 32, torch.float32)
    call = binding.check(q, k, v)
    assert paths["cpp"](q, k, v, False, None) is None  # nothing memoised: the general path's turn
    rt.plans[binding.memo_key(-1, torch.float32, call.shape, False, False, False)] = (kernel, 16)  # unaligned only
    assert paths["cpp"](q, k, v, False, None) is None  # aligned pointers, no aligned plan: C++ None, Python None
    assert served == [None]
    rt.plans[binding.memo_key(-1, torch.float32, call.shape, False, True, False)] = (kernel, 16)
    assert paths["cpp"](q, k, v, False, None) is not None
    assert served[-1] is not None, "the record is made again once the plan is memoised"


def test_cpp_tail_raises_the_launch_error_as_the_kernel_does(fake: Fake, helper: Any, cpp: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    spare = torch.empty(1 << 12, dtype=torch.float32)
    rt, kernel, paths, _ = _paths(fake, helper, cpp, monkeypatch, "forward", "bhsd", spare)
    q, k, v = make_qkv(1, (2, 2), (16, 16), 32, torch.float32)
    _plan(rt, kernel, q, k, v, binding.check(q, k, v), torch.float32)
    fake.configure(SIZES, status=700)
    for warm in paths.values():
        with pytest.raises(DriverError, match=r"cuLaunchKernel\(k, grid=\(1, 2, 1\)\) failed: CUDA error 700"):
            warm(q, k, v, False, None)


def test_cpp_tail_hands_out_the_stocks_lse_and_checks_one_it_is_given(fake: Fake, helper: Any, cpp: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spare = torch.empty(1 << 12, dtype=torch.float32)
    monkeypatch.setattr(hot, "CPP_LSE_STOCKS", True)
    rt, kernel, paths, served = _paths(fake, helper, cpp, monkeypatch, "forward", "bhsd", spare)
    q, k, v = make_qkv(1, (2, 2), (16, 16), 32, torch.float32)
    _plan(rt, kernel, q, k, v, binding.check(q, k, v), torch.float32)
    (_, first), (_, second) = paths["cpp"](q, k, v, False, None), paths["cpp"](q, k, v, False, None)
    assert all(done is not None for done in served), "the C++ tail served both calls"
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr(), "stock-mates: one block"
    assert first.data_ptr() != second.data_ptr() and first.shape == (1, 2, 16) and first.is_contiguous()
    assert second.data_ptr() in _launched(fake)[0], "the kernel writes the stock's lse"
    (entry,) = paths["cpp"].__globals__["SHAPES"].values()
    record = entry[hot.FIELD["cpp_record"]]
    for bad in (torch.empty(1, 2, 15), torch.empty(1, 2, 16, dtype=torch.float64), torch.empty(1, 2, 32)[..., ::2]):
        with pytest.raises(ValueError, match="lse is not a contiguous float32"):
            cpp.run(q, k, v, 7, {7: [bad]}, record)
    for bad in (1234, [torch.empty(1, 2, 16)]):
        with pytest.raises(TypeError, match="lse must be the entry's stocks"):
            cpp.run(q, k, v, 7, bad, record)
    stocks: dict[int, list[torch.Tensor]] = {7: [], 8: [torch.empty(1, 2, 16)]}
    refill = record[5]
    template, device = refill.args[1:]
    assert template.untyped_storage().nbytes() == 4 and device == entry[hot.FIELD["device"]], (
        "the lse template on the host (4 bytes); the stocks on the entry's device")
    record = (*record[:5], functools.partial(refill.func, stocks, *refill.args[1:]))
    _, lse = cpp.run(q, k, v, 7, stocks, record)  # an empty stock: restocked, one handed out, the rest kept
    assert lse.shape == (1, 2, 16) and len(stocks[7]) > 1 and all(t.shape == (1, 2, 16) for t in stocks[7])
    assert lse.untyped_storage().data_ptr() == stocks[7][0].untyped_storage().data_ptr()
    kept = stocks[8][0]
    assert cpp.run(q, k, v, 8, stocks, record)[1] is kept and stocks[8] == [], "the stock's own tensor, popped"
    out, lse = cpp.run(q, k, v, 0, None, record)  # None: allocated here
    assert lse.shape == (1, 2, 16) and lse.dtype == torch.float32 and out.shape == q.shape
    monkeypatch.setattr(hot, "CPP_LSE_STOCKS", False)  # the default (bench_host's "hot.forward_bhsd, lse allocated")
    rt, kernel, paths, served = _paths(fake, helper, cpp, monkeypatch, "forward", "bhsd", spare)
    _plan(rt, kernel, q, k, v, binding.check(q, k, v), torch.float32)
    (_, first), (_, second) = paths["cpp"](q, k, v, False, None), paths["cpp"](q, k, v, False, None)
    assert len(served) == 2 and None not in served
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr(), "two allocations"


def test_cpp_tail_declines_tensor_subclasses(fake: Fake, helper: Any, cpp: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    spare = torch.empty(1 << 12, dtype=torch.float32)
    rt, kernel, paths, served = _paths(fake, helper, cpp, monkeypatch, "forward", "bhsd", spare)
    class Sub(torch.Tensor):
        pass

    q, k, v = (t.as_subclass(Sub) for t in make_qkv(1, (2, 2), (16, 16), 32, torch.float32))
    _plan(rt, kernel, q, k, v, binding.check(q, k, v), torch.float32)
    out, _ = paths["cpp"](q, k, v, False, None)
    assert served == [None] and type(out) is Sub, "torch.empty_like's own rules for a subclass: the Python tail"


def test_a_module_built_for_another_torch_is_never_loaded(built: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    hotpathlib.never_loads_another_torchs_build(hotpath, built, tmp_path, caplog)


@pytest.fixture
def cache_dir_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """No package-folder build of the C++ tail: the cache dir's is what a fresh process would load."""
    monkeypatch.delenv(helpers.VARIABLE, raising=False)
    monkeypatch.setattr(helpers, "PACKAGE_DIR", tmp_path / "package")
    helpers.reset()
    yield
    helpers.reset()
    monkeypatch.undo()
    hotpath.refresh()


def test_the_cpp_tail_is_loaded_from_the_cache_dir(built: Path, cache_dir: Path, cache_dir_only: None) -> None:
    assert not hotpath.refresh(), "nothing in the package folder or the cache dir yet"
    version = torch.__version__
    assert helpers.make_folder(cache_dir, hotpath.NAME, version) is None
    target = helpers.folder(cache_dir, hotpath.NAME, version) / hotpath.file_name(version)
    shutil.copyfile(built, target)  # as the background builder leaves it
    target.chmod(0o755)
    assert hotpath.refresh() and hotpath.origin() == str(target)
    assert hotpath.module().TORCH_VERSION == version
    assert helpers.status(hotpath.NAME, cache_dir, version).state == helpers.CACHE
    target.chmod(0o775)
    assert not hotpath.refresh(), "writable by the group: refused"


def test_the_background_builder_builds_the_cpp_tail_under_its_key(built: Path, cache_dir: Path, cache_dir_only: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hotpath_build, "build", hotpathlib.build_by_copying(hotpath, built))
    version = torch.__version__
    with hotpathlib.builder_lock(hotpath, cache_dir, version) as (where, lock):
        other = helpers.key(hotpath.NAME, "2.11.0")  # a key the builder's own torch does not give
        assert helpers_build.child(hotpath.NAME, cache_dir, other, lock) == 1
        assert "whose key is" in (cache_dir / helpers.FOLDER / other / helpers.FAILED).read_text()
        assert helpers_build.child(hotpath.NAME, cache_dir, where.name, lock) == 0
    assert helpers.status(hotpath.NAME, cache_dir, version).state == helpers.CACHE
    assert hotpath.refresh() and hotpath.origin() == str(where / hotpath.file_name(version))


def test_the_build_command_takes_torchs_abi_and_version() -> None:
    argv = hotpath_build.command("g++", Path("/s/_hotpath.cpp"), Path("/o.so"), ["/inc"], ["/lib"], "2.11.0+cu128",
                                 False, 2)
    assert "-D_GLIBCXX_USE_CXX11_ABI=0" in argv and '-DLT_TORCH_VERSION="2.11.0+cu128"' in argv
    assert {"-O2", "-std=c++17", "-ltorch", "-ltorch_cpu", "-lc10", "-ltorch_python"} <= set(argv)
    with pytest.raises(hotpath_build.BuildError, match="torch version"):
        hotpath_build.command("g++", Path("/s.cpp"), Path("/o.so"), [], [], '2.11"; rm -rf /', True, 2)


def test_the_build_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/no/torch/include"])
    with pytest.raises(hotpath_build.BuildError) as raised:
        hotpath_build.toolchain()
    assert "a C++ compiler" in str(raised.value) and "/no/torch/include" in str(raised.value)


@on_gpu
def test_gpu_cpp_tail_gives_the_python_tails_results_and_captures() -> None:
    if hotpath.module() is None:
        pytest.skip("the C++ warm path is not built for this torch "
                    "(python -m lazytriton.kernels.flash_fwd.hotpath_build)")
    if not fastlaunch.available():
        pytest.skip("the launch helper is not built (python -m lazytriton.driver.fastlaunch_build)")
    runtime.reset()
    q, k, v = make_qkv(2, (4, 2), (300, 257), 64, torch.bfloat16, device="cuda", seed=11)
    lazytriton.attn_fwd(q, k, v, causal="bottom_right")  # memoise the plan
    lazytriton.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    served: list[Any] = []
    fronts: list[Any] = []  # serve()'s results: the entry lookup in C++, where the module reads the stream itself

    def run(*args: Any) -> Any:
        done = hotpath.module().run(*args)
        served.append(done)
        return done

    def serve(*args: Any) -> Any:
        done = hotpath.module().serve(*args)
        fronts.append(done)
        return done

    results = {}
    for name, cpp in (("python", False), ("cpp", hotpath.module())):
        extra = {"run_cpp": run, "serve": serve} if cpp else {}
        forward = hot.generate("bhsd", "forward", cpp=cpp, **extra)
        output = hot.generate("bhsd", "output", cpp=cpp, **extra)
        results[name] = (forward(q, k, v, "bottom_right", None), output(q, k, v, False, None))
    torch.cuda.synchronize()
    assert served and all(done is not None for done in served)
    (out_p, lse_p), sdpa_p = results["python"]
    (out_c, lse_c), sdpa_c = results["cpp"]
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c) and torch.equal(sdpa_p, sdpa_c)
    assert out_c.stride() == out_p.stride() and lse_c.stride() == lse_p.stride()

    forward = hot.generate("bhsd", "forward", cpp=hotpath.module(), run_cpp=run, serve=serve)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        forward(q, k, v, "bottom_right", None)
        served.clear()
        fronts.clear()
        with torch.cuda.graph(graph):
            captured = forward(q, k, v, "bottom_right", None)
    torch.cuda.current_stream().wait_stream(stream)
    if hotpath.module().STREAM_INSIDE:  # the entry filed by the call before: the C++ lookup serves the capture
        assert len(fronts) == 1 and fronts[0] is not None and served == [], "captured through serve()"
    else:
        assert len(served) == 1 and served[0] is not None, "the captured call went through the C++ tail"
    fresh = make_qkv(2, (4, 2), (300, 257), 64, torch.bfloat16, device="cuda", seed=12)
    for old, new in zip((q, k, v), fresh, strict=True):
        old.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    expect_out, expect_lse = binding.forward(q, k, v, binding.check(q, k, v, "bottom_right"))
    assert torch.equal(captured[0], expect_out) and torch.equal(captured[1], expect_lse)
    runtime.reset()


def test_a_module_with_another_calling_convention_is_left_unused(cpp: Any, helper: Any,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    import types

    assert hot.usable(cpp) and cpp.INTERFACE == hot.CPP_INTERFACE and cpp.TEMPLATE == hot.CPP_TEMPLATE.format
    older = types.SimpleNamespace(TEMPLATE=cpp.TEMPLATE, INTERFACE=cpp.INTERFACE - 1, run=cpp.run)
    assert not hot.usable(older), "an older _hotpath.cpp's build, same template, another run(): never called"
    assert not hot.usable(types.SimpleNamespace(TEMPLATE=cpp.TEMPLATE, run=cpp.run)), "one that names none"
    monkeypatch.setattr(fastlaunch, "_module", lambda: helper)
    monkeypatch.setattr(hotpath, "module", lambda: older)
    hot.warn_stale_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="lazytriton.driver"):
        fn = hot.generate("bhsd", "forward", cuda=False)
    assert fn.__globals__["run_cpp"] is None and "built from another _hotpath.cpp" in caplog.text


# torch's AOTInductor C shim, as a CUDA torch's libtorch_cuda exports it: here a fake one, global before a second
# copy of the module loads (a CPU torch has none, so the module the other tests use reads no stream itself).
STREAM_GETTER_C = r"""
#include <stdint.h>
int32_t aoti_torch_get_current_cuda_stream(int32_t device_index, void **stream) {
    *stream = (void *)(uintptr_t)(0xC0FFEE00u + (uint32_t)(device_index + 1));
    return 0;
}
"""


@pytest.fixture(scope="module")
def cpp_reading_the_stream(built: Path, cpp: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A second copy of the module, loaded after a fake getter is global (``cpp``, loaded first, finds none)."""
    import ctypes

    if shutil.which("gcc") is None:
        pytest.fail("no C compiler for the fake stream getter")
    where = tmp_path_factory.mktemp("stream-getter")
    (where / "getter.c").write_text(STREAM_GETTER_C)
    library = where / "libgetter.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(where / "getter.c")], check=True)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    copy = tmp_path_factory.mktemp("hotpath-copy")
    shutil.copyfile(built, copy / built.name)  # another path: CPython runs its init again, which looks it up
    module = hotpath.load(copy, torch.__version__, fastlaunch.PLAN_VERSION)
    assert module is not None and module.STREAM_INSIDE == 1
    return module


@pytest.mark.parametrize("result", ["forward", "output"])
def test_cpp_tail_reads_the_current_stream_itself_where_torch_offers_it(result: str, fake: Fake, helper: Any,
                                                                        cpp: Any, cpp_reading_the_stream: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpp.STREAM_INSIDE == 0, "this CPU torch has no libtorch_cuda"
    text = hot.source("bhsd", result, cpp=True, stream_inside=True)
    assert "raw_stream" not in text[:text.index("run_cpp(")], "no Python stream read before the C++ tail"
    spare = torch.empty(1 << 12, dtype=torch.float32)
    rt, kernel, paths, served = _paths(fake, helper, cpp_reading_the_stream, monkeypatch, result, "bhsd", spare,
                                       stream_inside=True)
    q, k, v = make_qkv(1, (2, 2), (16, 16), 32, torch.float32)
    _plan(rt, kernel, q, k, v, binding.check(q, k, v), torch.float32)
    for _ in range(2):
        assert paths["cpp"](q, k, v, False, None) is not None
    assert served[-1] is not None, "the C++ tail served it"
    assert _launched(fake)[2]["stream"] == 0xC0FFEE00, "the getter's stream for q's device (-1 on the CPU)"
    (entry,) = paths["cpp"].__globals__["SHAPES"].values()
    lse = 0 if result == "output" else None
    record = entry[hot.FIELD["cpp_record"]]
    assert cpp.run(q, k, v, None, lse, record) is None, "no getter: declined, the Python tail reads the stream"
    assert _launched(fake)[2]["stream"] == 0xC0FFEE00


def _front_paths(fake: Fake, helper: Any, cpp: Any, monkeypatch: pytest.MonkeyPatch, result: str, layout: str,
                 spare: torch.Tensor) -> tuple[Runtime, Any, dict[str, Any], list[Any]]:
    """_paths with the entry lookup in C++ (a module reading the stream itself): its serve() results recorded."""
    served: list[Any] = []

    def serve(*args: Any) -> Any:
        done = cpp.serve(*args)
        served.append(done)
        return done

    monkeypatch.setattr(hot, "generate", functools.partial(hot.generate, serve=serve))
    rt, kernel, paths, _ = _paths(fake, helper, cpp, monkeypatch, result, layout, spare, stream_inside=True)
    return rt, kernel, paths, served


@pytest.mark.parametrize("result", ["forward", "output"])
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_front_serves_from_its_table_what_the_python_path_launches(case: tuple[Any, ...], result: str, fake: Fake,
                                                                   helper: Any, cpp_reading_the_stream: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    layout, _, _, _, causal, scale, dtype, _ = case
    q, k, v, view = _inputs(case)
    spare = torch.empty(1 << 16, dtype=torch.float32)
    rt, kernel, paths, served = _front_paths(fake, helper, cpp_reading_the_stream, monkeypatch, result, layout, spare)
    assert "done = serve(" in hot.source(layout, result, cpp=True, stream_inside=True)
    assert "serve(" not in hot.source(layout, result, cpp=True, stream_inside=True, with_front=False)
    _plan(rt, kernel, view(q), view(k), view(v), binding.check(view(q), view(k), view(v), causal, scale), dtype)
    seen = {}
    for name, warm in paths.items():
        for _ in range(3):  # describe (and file the record), then twice from the C++ table
            done = warm(q, k, v, causal, scale)
            assert done is not None
        out = done[0] if result == "forward" else done
        ints, floats, state = _launched(fake)
        assert ints[:4] == [t.data_ptr() for t in (q, k, v, out)], name
        if result == "forward":  # a new lse at every call; the output path's is the spare buffer's, in both
            assert ints[4] == done[1].data_ptr()
            ints[4] = 0
        assert state["stream"] == (0xC0FFEE00 if name == "cpp" else 0x5EED), "the getter's stream, read in C++"
        state = {key: state[key] for key in ("grid_x", "grid_y", "grid_z", "block_x", "function")}
        seen[name] = (ints[4:], floats, out.stride(), state)
    assert seen["cpp"] == seen["python"], "every parameter but the input pointers and the stream"
    assert [done is not None for done in served] == [False, True, True], "filed by the first call, then served"
    assert len(paths["cpp"].__globals__["TABLE"]) == 1


def _filed(fake: Fake, helper: Any, cpp: Any, monkeypatch: pytest.MonkeyPatch,
           result: str) -> tuple[Runtime, Any, list[Any], tuple[torch.Tensor, ...]]:
    """(runtime, the C++-fronted warm function, serve()'s results, (q, k, v)) after one call filed its record."""
    spare = torch.empty(1 << 12, dtype=torch.float32)
    rt, kernel, paths, served = _front_paths(fake, helper, cpp, monkeypatch, result, "bhsd", spare)
    q, k, v = make_qkv(1, (2, 2), (16, 16), 32, torch.float32)
    _plan(rt, kernel, q, k, v, binding.check(q, k, v), torch.float32)
    warm = paths["cpp"]
    warm(q, k, v, False, None)
    warm.__globals__["SPARE_KEPT"] = spare  # alive as long as the function's scope
    return rt, warm, served, (q, k, v)


def test_front_declines_what_its_key_does_not_cover(fake: Fake, helper: Any, cpp_reading_the_stream: Any, cpp: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    plain = cpp
    cpp = cpp_reading_the_stream
    rt, warm, served, (q, k, v) = _filed(fake, helper, cpp, monkeypatch, "output")
    spare = warm.__globals__["SPARE_KEPT"]
    scope = warm.__globals__
    table, spares = scope["TABLE"], scope["SPARE"]

    def serve(*args: Any, plans: Any = rt.plans, spare: Any = spares, cuda: bool = False) -> Any:
        return cpp.serve(*args, table, plans, spare, cuda)

    assert serve(q, k, v, False, None, True) is not None, "the filed call"

    class Sub(torch.Tensor):
        pass

    grad = q.clone().requires_grad_()
    declined = {
        "q requires grad": (grad, k, v, False, None, True),
        "a subclass": (q.as_subclass(Sub), k, v, False, None, True),
        "k of another dtype": (q, k.double(), v, False, None, True),
        "3 dims": (q[0], k[0], v[0], False, None, True),
        "other strides": (q.transpose(2, 3).contiguous().transpose(2, 3), k, v, False, None, True),
        "other sizes": (q[:, :, :8], k, v, False, None, True),
        "causal not filed": (q, k, v, True, None, True),
        "causal an int": (q, k, v, 1, None, True),
        "causal another string": (q, k, v, "bogus", None, True),
        "scale an int": (q, k, v, False, 1, True),
        "scale nan": (q, k, v, False, float("nan"), True),
        "gqa not a bool": (q, k, v, False, None, None),
        "gqa False: another key": (q, k, v, False, None, False),
    }
    for why, args in declined.items():
        assert serve(*args) is None, why
    assert serve(q, k, v, False, None, True, cuda=True) is None, "CPU tensors where CUDA ones are required"
    assert serve(q, k, v, False, None, True, plans={}) is None, "another runtime's plans"
    assert serve(q, k, v, False, None, True, spare={}) is None, "no spare lse buffer for the device"
    assert serve(q, k, v, False, None, True, spare={-1: (31, spare.data_ptr())}) is None, "a spare too small"
    assert serve(q, k, v, False, None, True, spare={-1: (32, spare.data_ptr())}) is not None, "b * hq * sq = 32"
    with pytest.raises(TypeError, match=r"serve\(q, k, v"):
        cpp.serve(q, k, v, False, None, True, [], rt.plans, spares, False)
    assert not plain.STREAM_INSIDE, "this CPU torch has no libtorch_cuda"
    assert plain.serve(q, k, v, False, None, True, table, rt.plans, spares, False) is None, "no stream getter"


def test_front_compares_the_whole_key_and_follows_the_runtime(fake: Fake, helper: Any, cpp_reading_the_stream: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cpp = cpp_reading_the_stream
    rt, warm, served, (q, k, v) = _filed(fake, helper, cpp, monkeypatch, "forward")
    table = warm.__globals__["TABLE"]
    assert warm(q, k, v, False, None) is not None and served[-1] is not None
    ((hashed, (key, plans, record, numel)),) = table.items()
    assert len(key) == 224 and plans is rt.plans and numel == 2 * 16
    table[hashed] = (key[:-1] + bytes([key[-1] ^ 1]), plans, record, numel)  # same hash, another key: a collision
    assert warm(q, k, v, False, None) is not None and served[-1] is None, "a miss: the Python path serves it"
    assert table[hashed][0] == key, "and files it again"
    assert warm(q, k, v, False, None) is not None and served[-1] is not None
    rt.plans = dict(rt.plans)  # settings changed: the runtime's new plans dict (memoised again, here copied)
    assert warm(q, k, v, False, None) is not None and served[-1] is None, "another runtime: described again"
    assert warm(q, k, v, False, None) is not None and served[-1] is not None
    assert table[hashed][1] is rt.plans
    for size in (8, 4):  # the table starts again once it holds max entries
        q2, k2, v2 = make_qkv(1, (2, 2), (size, size), 32, torch.float32)
        assert cpp.remember(q2, k2, v2, False, None, True, table, rt.plans, record, 0, 2)
    assert len(table) == 1
    assert not cpp.remember(q[0], k[0], v[0], False, None, True, table, rt.plans, record, 0, 2), "no key: not filed"
    with pytest.raises(TypeError, match=r"remember\(q, k, v"):
        cpp.remember(q, k, v, False, None, True, table, rt.plans, ("not a record",), 0, 2)
