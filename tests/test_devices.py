"""Every GPU of the host, on CPU: a kernel for cuda:1 is loaded in device 1's context, launched there, kept per device.

The real ``CudaApi``, ``LoadedKernel``, compiled launch helper and runtime
run on a fake libcuda of two devices (tests/fake_devices.py): contexts per
device, a stack of current contexts per thread, modules owned by the context
current at their load, and launches refused (CUDA_ERROR_INVALID_HANDLE) when
the function or the stream belongs to another device than the current
context's. So a launch the fake accepts ran in its kernel's own context, on a
stream of its own device, and the calling thread's context stack is checked
to be as it was.

The capture checks (whether a CUDA graph is being captured, which decides
whether a call may load a kernel, take a stocked lse or read index values)
must ask the call's device, not the current one.

tests/test_multi_gpu.py runs the same questions on real devices.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from compiled_once import small_variant
from fake_devices import CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE, FakeDevices, as_int, context, stream
from test_driver import _entry
from test_flash_fwd import make_qkv
from test_hot import _plan_for, _Recorder, _Runtime

from lazytriton import launch, machine, runtime
from lazytriton.cache_format import Entry, Provenance
from lazytriton.driver import DriverError, fastlaunch, gpu
from lazytriton.kernels.flash_fwd import binding, hot
from lazytriton.target import Target

OPTIN = 232448  # an H200's opt-in shared memory per block
ARG_TYPES = ("*fp16", "i32", "fp32")
INTS, FLOATS = (16, 3), (1.5,)
VARIANT = small_variant("sm_90")
CALLS_PER_THREAD = 300


@pytest.fixture(scope="module")
def devices_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fake_devices import build

    library = build(tmp_path_factory.mktemp("fakedevices"))
    if library is None:
        pytest.skip("no C compiler for the fake libcuda")
    return library


@pytest.fixture
def fake(devices_library: Path) -> Iterator[FakeDevices]:
    made = FakeDevices(devices_library)
    made.configure([OPTIN, OPTIN])
    yield made
    made.set_current(0)


@pytest.fixture
def helper_module(launch_helper: Any) -> Any:
    return launch_helper


@pytest.fixture(params=["abi", "helper"])
def api(request: pytest.FixtureRequest, devices_library: Path, fake: FakeDevices,
        monkeypatch: pytest.MonkeyPatch) -> gpu.CudaApi:
    """A CudaApi on the fake whose kernels launch through cffi's ABI mode or through the compiled helper."""
    module = request.getfixturevalue("helper_module") if request.param == "helper" else None
    monkeypatch.setattr(fastlaunch, "_module", lambda: module)
    monkeypatch.setattr(fastlaunch, "_enabled", [True])
    made = gpu.CudaApi(str(devices_library))
    monkeypatch.setattr(gpu, "cuda", lambda: made)  # what lazytriton.driver.load (the runtime's loads) uses
    return made


def _function(kernel: gpu.LoadedKernel) -> int:
    return as_int(kernel.function, kernel._api.ffi)


def _entry_of(variant: Any, shared: int = 0) -> Entry:
    return Entry(
        key=variant.key(), variant=str(variant), target=variant.target, kind="cubin", binary=b"\x7fELF" + bytes(64),
        name="k", num_warps=4, num_ctas=1, warp_size=32, shared=shared, global_scratch_size=0, global_scratch_align=1,
        profile_scratch_size=0, profile_scratch_align=1, arg_types=ARG_TYPES, hidden_args=(),
        provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1))


# ---------------------------------------------------------------------------
# The fake itself: it refuses what the real driver refuses


def test_the_fake_refuses_a_function_or_stream_of_another_device(fake: FakeDevices) -> None:
    assert fake.load_raw() == (CUDA_ERROR_INVALID_CONTEXT, 0), "a load with no current context"
    fake.set_current(context(1))
    status, on_one = fake.load_raw()
    assert status == 0 and fake.modules() == [1]
    assert fake.launch_raw(on_one, stream(1)) == 0 and fake.launch_raw(on_one, 0) == 0
    assert fake.launch_raw(on_one, stream(0)) == CUDA_ERROR_INVALID_HANDLE, "device 0's stream"
    fake.set_current(context(0))
    assert fake.launch_raw(on_one, stream(0)) == CUDA_ERROR_INVALID_HANDLE, "device 1's function in device 0's context"
    assert fake.push(context(1)) == 0 and fake.depth() == 2
    assert fake.launch_raw(on_one, stream(1)) == 0
    assert fake.pop() == 0 and fake.current() == context(0) and fake.depth() == 1
    assert [r["status"] for r in fake.launches()] == [0, 0, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_HANDLE, 0]


# ---------------------------------------------------------------------------
# Loading: device 1's context, whatever is current


@pytest.mark.parametrize("current", [0, context(0), context(1)], ids=["none", "device0", "device1"])
def test_a_kernel_loads_in_its_devices_context_whatever_is_current(api: gpu.CudaApi, fake: FakeDevices,
                                                                   current: int) -> None:
    fake.set_current(current)
    depth = fake.depth()
    kernel = api.load(_entry(ARG_TYPES), 1)
    assert fake.modules() == [1], "the module belongs to device 1's context"
    assert kernel.device_index == 1
    assert (fake.current(), fake.depth()) == (current, depth), "the caller's context stack is as it was"


def test_each_device_has_its_own_limit_and_a_missing_device_is_a_driver_error(api: gpu.CudaApi,
                                                                              fake: FakeDevices) -> None:
    fake.configure([OPTIN, 101376])  # device 1: an sm_80's opt-in shared memory
    big = _entry_of(VARIANT, shared=200 * 1024)
    assert api.load(big, 0).device_index == 0
    with pytest.raises(DriverError, match="needs 204800 bytes of shared memory; device 1 allows 101376"):
        api.load(big, 1)
    with pytest.raises(DriverError, match="cuDeviceGet"):
        api.load(big, 2)
    assert fake.modules() == [0] and fake.depth() == 0


def test_the_runtime_keeps_one_handle_per_device(api: gpu.CudaApi, fake: FakeDevices) -> None:
    rt = runtime.get()
    rt.local.put(VARIANT.key(), _entry_of(VARIANT))
    fake.set_current(context(0))
    on_zero, on_one = rt.kernel(VARIANT, 0), rt.kernel(VARIANT, 1)
    assert (on_zero.device_index, on_one.device_index) == (0, 1)
    assert _function(on_zero) != _function(on_one)
    assert rt.kernel(VARIANT, 1) is on_one and rt.loaded(VARIANT, 1) is on_one and rt.loaded(VARIANT, 0) is on_zero
    assert fake.modules() == [0, 1], "one load per device, each in its own context"
    assert sorted(k.device_index for k in rt.loaded_kernels()) == [0, 1]
    assert rt.resolve(VARIANT).source == "memory", "one entry, read once, whatever the device count"


# ---------------------------------------------------------------------------
# Launching: device 1's context and stream


@pytest.mark.parametrize("current", [0, context(0), context(1)], ids=["none", "device0", "device1"])
def test_a_launch_on_device_1_runs_in_device_1s_context(api: gpu.CudaApi, fake: FakeDevices, current: int) -> None:
    kernel = api.load(_entry(ARG_TYPES), 1)
    fake.set_current(current)
    depth, before = fake.depth(), fake.counts()
    kernel.launch((7, 1, 1), stream(1), INTS, FLOATS)
    kernel.launch((8, 1, 1), 0, INTS, FLOATS)  # device 1's legacy default stream: its context's
    launches = fake.launches()
    assert [(r["grid_x"], r["status"], r["function_device"], r["context_device"]) for r in launches] == [
        (7, 0, 1, 1), (8, 0, 1, 1)]
    assert (fake.current(), fake.depth()) == (current, depth)
    after = fake.counts()
    pushes, pops = after["pushes"] - before["pushes"], after["pops"] - before["pops"]
    assert pushes == pops == 2 * (current != context(1)), "pushed only when another context is current"


def test_the_helpers_plan_holds_the_loading_devices_context(api: gpu.CudaApi, fake: FakeDevices) -> None:
    kernel = api.load(_entry(ARG_TYPES), 1)
    plan = fastlaunch.plan_bytes(kernel.fast)
    if plan is None:
        assert kernel.fast is None, "the ABI path holds no plan"
        return
    function, ctx = struct.unpack_from("<8Q", plan)[6:8]
    assert (function, ctx) == (_function(kernel), context(1))


def test_a_launch_on_another_devices_stream_is_the_drivers_error(api: gpu.CudaApi, fake: FakeDevices) -> None:
    kernel = api.load(_entry(ARG_TYPES), 1)
    fake.set_current(context(0))
    with pytest.raises(DriverError, match=f"cuLaunchKernel.*CUDA error {CUDA_ERROR_INVALID_HANDLE}"):
        kernel.launch((1, 1, 1), stream(0), INTS, FLOATS)
    assert (fake.current(), fake.depth()) == (context(0), 1), "popped after the failed launch too"


# ---------------------------------------------------------------------------
# Two threads, two devices, at once


def test_two_threads_drive_two_devices_at_once(api: gpu.CudaApi, fake: FakeDevices) -> None:
    fake.configure([OPTIN, OPTIN], yield_in_launch=True)  # the other thread runs between a push and its pop
    rt = runtime.get()
    rt.local.put(VARIANT.key(), _entry_of(VARIANT))
    start = threading.Barrier(2)
    results: dict[int, dict[str, Any]] = {}

    def drive(device: int) -> None:
        seen: dict[str, Any] = {}
        results[device] = seen
        try:
            fake.set_tag(device)
            fake.set_current(context(1 - device))  # torch's current device is the other one
            start.wait()
            for i in range(CALLS_PER_THREAD):
                rt.kernel(VARIANT, device).launch((i + 1, 1, 1), stream(device), INTS, FLOATS)
            seen["after"] = (fake.current(), fake.depth())
        except BaseException as exc:  # reported by the main thread
            seen["error"] = exc

    threads = [threading.Thread(target=drive, args=(device,)) for device in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for device in (0, 1):
        assert "error" not in results[device], results[device].get("error")
        assert results[device]["after"] == (context(1 - device), 1), "each thread's stack is as it was"
    launches = fake.launches()
    assert fake.counts()["launch_errors"] == 0
    for device in (0, 1):
        mine = [r for r in launches if r["tag"] == device]
        assert [r["grid_x"] for r in mine] == list(range(1, CALLS_PER_THREAD + 1))
        assert {(r["function_device"], r["context_device"], r["stream"]) for r in mine} == {
            (device, device, stream(device))}
    assert sorted(fake.modules()) == [0, 1], "one load per device, though both threads asked at once"
    assert sorted(k.device_index for k in rt.loaded_kernels()) == [0, 1]


# ---------------------------------------------------------------------------
# The capture checks ask the call's device


class _Devices:
    """torch's current device and which device's current stream is being captured, as the checks read them."""

    def __init__(self, current: int, captured: int) -> None:
        self.current, self.captured = current, captured

    def current_device(self) -> int:
        return self.current

    def is_capturing(self) -> bool:
        return self.current == self.captured

    @contextmanager
    def device(self, index: int) -> Iterator[None]:
        saved, self.current = self.current, index
        try:
            yield
        finally:
            self.current = saved


class _LoadingRuntime:
    """A runtime whose kernels are never loaded yet: ``kernel`` records the devices it would load on."""

    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}
        self.loads: list[int] = []

    def loaded(self, variant: Any, device_index: int) -> Any:
        return None

    def kernel(self, variant: Any, device_index: int) -> Any:
        self.loads.append(device_index)
        return object()


def _devices(monkeypatch: pytest.MonkeyPatch, current: int, captured: int) -> _Devices:
    devices = _Devices(current, captured)
    monkeypatch.setattr(launch, "is_capturing", devices.is_capturing)
    monkeypatch.setattr(launch, "current_device", devices.current_device, raising=False)
    monkeypatch.setattr(torch.cuda, "device", devices.device)
    return devices


def _plan(rt: _LoadingRuntime, device: int) -> Any:
    shape = binding.Shape(1, 2, 2, 100, 100, 64)
    return binding.plan(rt, ("key", device), torch.device("cuda", device), torch.bfloat16, shape, False, True, False)


def test_a_capture_on_the_current_device_refuses_its_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "target_of_device", lambda device: Target.parse("sm_90"))
    devices = _devices(monkeypatch, current=0, captured=0)
    rt = _LoadingRuntime()
    with pytest.raises(launch.CaptureError, match="not loaded on cuda:0"):
        _plan(rt, 0)
    assert rt.loads == [] and devices.current == 0


def test_a_capture_on_device_1_refuses_its_loads_while_device_0_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "target_of_device", lambda device: Target.parse("sm_90"))
    devices = _devices(monkeypatch, current=0, captured=1)
    rt = _LoadingRuntime()
    _plan(rt, 0)  # device 0 is not being captured: its kernel loads
    assert rt.loads == [0]
    with pytest.raises(launch.CaptureError, match="not loaded on cuda:1"):
        _plan(rt, 1)
    assert rt.loads == [0] and devices.current == 0, "nothing loaded on device 1; the current device is back"


def test_a_call_on_another_device_than_the_current_one_takes_no_stocked_lse() -> None:
    rt = _Runtime()
    current = [-1]  # the CPU tensors' "device" (get_device() is -1)
    warm = hot.generate("bhsd", "forward", cuda=False, get_runtime=lambda: rt, raw_stream=lambda di: 0x5EED,
                        is_capturing=lambda: False, current_device=lambda: current[0])
    q, k, v = make_qkv(1, (2, 2), (4, 4), 16, torch.float32)
    kernel = _plan_for(rt, q, k, v)
    assert isinstance(kernel, _Recorder)
    assert warm(q, k, v, False, None)[1]._base is not None, "on the current device: a stocked lse"
    current[0] = 0  # another device is current: the tensors' own may be in a capture, which is not asked
    lse = warm(q, k, v, False, None)[1]
    assert lse._base is None and lse.untyped_storage().nbytes() == 4 * lse.numel(), "an lse of its own"
    assert len(kernel.launches) == 2
