"""The compiled launch helper against cffi's ABI-mode launch, through a fake libcuda that records each launch.

Both paths run the real ``CudaApi`` and ``LoadedKernel`` on a fake driver
(tests/fake_libcuda.py, compiled here): every parameter's bytes as
cuLaunchKernel reads them, the grid, block, shared memory, stream, function
and context must be the same. Skipped without a C compiler.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from fake_libcuda import Fake
from hypothesis import given, settings
from hypothesis import strategies as st
from test_driver import _entry

from lazytriton.cache_format.tensordesc import TensorDescMeta
from lazytriton.driver import DriverError, fastlaunch, gpu
from lazytriton.kernels import get


@pytest.fixture
def helper(launch_helper: Any) -> Any:
    return launch_helper


def _use_helper(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    monkeypatch.setattr(fastlaunch, "_module", lambda: module)


def _sizes(arg_types: tuple[str, ...], n_hidden: int) -> list[int]:
    return [4 if kind in ("i32", "fp32") else 8 for kind in arg_types] + [8] * n_hidden


def _launch_both(fake_library: Path, helper: Any, monkeypatch: pytest.MonkeyPatch, entry: Any, grid: Any,
                 ints: tuple[int, ...], floats: tuple[float, ...], current: int = 0,
                 scratch: Any = None) -> dict[str, tuple[Any, ...]]:
    """(params, state) of the same launch through the ABI path and the helper, on the fake."""
    fake = Fake(fake_library)
    seen = {}
    for name, module in (("abi", None), ("helper", helper)):
        monkeypatch.setattr(fastlaunch, "_module", lambda module=module: module)
        api = gpu.CudaApi(str(fake_library))
        kernel = api.load(entry, 0)
        assert (kernel.fast is not None) == (module is not None and not entry.global_scratch_size)
        fake.configure(_sizes(entry.arg_types, len(entry.hidden_args)))
        fake.set_current(current)
        kernel.launch(grid, 0x5EED, ints, floats, scratch)
        seen[name] = fake.last_launch()
    return seen


def _flash_fwd_types() -> tuple[str, ...]:
    return tuple(t for t in get("flash_fwd").signature("bf16").values() if t != "constexpr")


def test_layout_puts_ints_floats_and_null_scratch_in_order() -> None:
    assert fastlaunch.layout(("*fp16", "i32", "fp32", "i64", "fp32"), (0, 0)) == (
        0, 1, -1, 2, -2, fastlaunch.NULL_SLOT, fastlaunch.NULL_SLOT)
    assert fastlaunch.layout(("*fp16", "fp32"), (512, 0)) == (0, -1, 1, fastlaunch.NULL_SLOT)
    with pytest.raises(fastlaunch.LayoutError, match="fp16"):
        fastlaunch.layout(("*fp16", "fp16"), ())
    with pytest.raises(fastlaunch.LayoutError, match="at most"):
        fastlaunch.layout(("i32",) * 600, ())


def test_flash_fwd_launch_reads_the_same_bytes_through_both_paths(fake_library: Path, helper: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    arg_types = _flash_fwd_types()
    n_ints = sum(1 for t in arg_types if t != "fp32")
    ints = tuple(range(0x7F0000001000, 0x7F0000001000 + 5)) + tuple(range(6, n_ints + 1))
    ints = ints[:-3] + (-7, -1, -1)  # negative values read back sign-extended
    floats = (0.125, 2.5, 0.25, 4.0)[:len(arg_types) - n_ints]
    seen = _launch_both(fake_library, helper, monkeypatch, _entry(arg_types), (3, 2, 1), ints, floats)
    (abi_params, abi_state), (fast_params, fast_state) = seen["abi"], seen["helper"]
    for i, (a, f) in enumerate(zip(abi_params, fast_params, strict=True)):
        assert a == f, f"parameter {i} ({arg_types[i] if i < len(arg_types) else 'hidden'}) differs"
    assert abi_state == fast_state
    values = [struct.unpack({4: "<i", 8: "<q"}[len(raw)], raw)[0] if kind != "fp32" else
              struct.unpack("<f", raw)[0] for raw, kind in zip(fast_params, arg_types, strict=False)]
    assert tuple(values[:n_ints]) == ints and tuple(values[n_ints:]) == floats
    assert fast_params[len(arg_types):] == [bytes(8), bytes(8)]  # NULL scratch pointers, pointed at zeros
    assert fast_state["launches"] == 1 and fast_state["extra_null"] == 1
    assert (fast_state["grid_x"], fast_state["grid_y"], fast_state["grid_z"]) == (3, 2, 1)
    assert (fast_state["block_x"], fast_state["block_yz"], fast_state["stream"]) == (128, 1001, 0x5EED)


def test_both_paths_push_the_kernels_context_only_when_another_is_current(
        fake_library: Path, helper: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _entry(("*fp16", "i32", "fp32"))
    for current, pushes in ((0, 1), (0xBEEF, 1), (0xC000, 0)):  # 0xC000: the fake's context of device 0
        seen = _launch_both(fake_library, helper, monkeypatch, entry, (1, 1, 1), (16, 3), (1.5,), current)
        for name in ("abi", "helper"):
            state = seen[name][1]
            assert state["context"] == 0xC000, name
            assert (state["pushes"], state["pops"]) == (pushes, pushes), name


def test_scratch_pointers_reach_the_same_slots(fake_library: Path, helper: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    class Memory:
        def __init__(self, nbytes: int) -> None:
            self.nbytes = nbytes

        def data_ptr(self) -> int:
            return 0x100000 + self.nbytes

    entry = _entry(("*fp16", "i32", "fp32"), global_scratch=512)
    seen = _launch_both(fake_library, helper, monkeypatch, entry, (2, 3, 1), (16, 3), (1.5,),
                        scratch=lambda nbytes, device: Memory(nbytes))
    assert seen["abi"] == seen["helper"]
    assert seen["helper"][0][3] == struct.pack("<q", 0x100000 + 6 * 512)  # grid 6 programs x 512 bytes
    assert seen["helper"][0][4] == bytes(8)  # profile scratch: size 0, NULL


def test_launch_errors_name_the_call_on_both_paths(fake_library: Path, helper: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Fake(fake_library)
    for module in (None, helper):
        monkeypatch.setattr(fastlaunch, "_module", lambda module=module: module)
        kernel = gpu.CudaApi(str(fake_library)).load(_entry(("*fp16", "i32", "fp32")), 0)
        fake.configure([8, 4, 4, 8, 8], status=700)
        with pytest.raises(DriverError, match=r"cuLaunchKernel\(k, grid=\(1, 1, 1\)\) failed: CUDA error 700 "
                                              r"\(fake error\)"):
            kernel.launch((1, 1, 1), 0, (16, 3), (1.5,))


def test_helper_refuses_arguments_of_the_wrong_count_or_type(fake_library: Path, helper: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _use_helper(monkeypatch, helper)
    fake = Fake(fake_library)
    kernel = gpu.CudaApi(str(fake_library)).load(_entry(("*fp16", "i32", "fp32")), 0)
    fake.configure([8, 4, 4, 8, 8])
    assert kernel.fast is not None
    with pytest.raises(ValueError, match="ints has 1 items; the kernel takes 2"):
        kernel.fast(1, 1, 1, 0, (16,), (1.5,))
    with pytest.raises(ValueError, match="floats has 0 items; the kernel takes 1"):
        kernel.fast(1, 1, 1, 0, (16, 3), ())
    with pytest.raises(TypeError):
        kernel.fast(1, 1, 1, 0, (16, "3"), (1.5,))
    with pytest.raises(ValueError, match="grid_y"):
        kernel.fast(1, 0, 1, 0, (16, 3), (1.5,))
    with pytest.raises(TypeError, match="plan"):
        helper.launch(b"short", 1, 1, 1, 0, (16, 3), (1.5,))
    with pytest.raises(ValueError, match="ints has 3 items"):
        kernel.launch((1, 1, 1), 0, (16, 3, 4), (1.5,))
    assert fake.last_launch()[1]["launches"] == 0  # nothing reached the driver
    assert kernel.fast(1, 1, 1, 0, [16, 3], [1.5]) == 0  # lists are fine
    assert fake.last_launch()[1]["launches"] == 1


def test_a_malformed_plan_is_refused_not_read(helper: Any) -> None:
    plan = fastlaunch.pack_plan((1, 2, 3, 4), 5, 6, 128, 0, (0, -1))
    with pytest.raises(ValueError, match="malformed plan"):
        helper.launch(plan[:-1], 1, 1, 1, 0, (1,), (1.0,))
    bad_slot = bytearray(fastlaunch.pack_plan((1, 2, 3, 4), 5, 6, 128, 0, (0, 7)))
    struct.pack_into("<i", bad_slot, struct.calcsize("<8Q2Ii"), 2)  # n_ints 2: int slot 7 of 2 ints
    with pytest.raises(ValueError, match="slot 7 of parameter 1"):
        helper.launch(bytes(bad_slot), 1, 1, 1, 0, (1, 2), ())
    with pytest.raises(ValueError, match="malformed plan"):  # descriptors in an immutable plan: no cache to keep
        helper.launch(bytes(fastlaunch.pack_plan((1, 2, 3, 4, 5), 5, 6, 128, 0, (fastlaunch.DESC_SLOT, 1, 2),
                                                 (TensorDescMeta(0, 2, 6, (8,)),))), 1, 1, 1, 0, (1, 2, 3), ())


def test_without_the_helper_launches_take_the_abi_path(fake_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastlaunch, "_module", lambda: None)
    assert not fastlaunch.available() and fastlaunch.path_name() == "cffi ABI mode"
    api = gpu.CudaApi(str(fake_library))
    kernel = api.load(_entry(("*fp16", "i32", "fp32")), 0)
    assert kernel.fast is None
    fake = Fake(fake_library)
    fake.configure([8, 4, 4, 8, 8])
    kernel.launch((1, 1, 1), 7, (16, 3), (1.5,))
    params, state = fake.last_launch()
    assert state["launches"] == 1 and params[:3] == [struct.pack("<q", 16), struct.pack("<i", 3),
                                                     struct.pack("<f", 1.5)]


def test_helper_can_be_turned_off_for_kernels_loaded_afterwards(fake_library: Path, helper: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _use_helper(monkeypatch, helper)
    assert fastlaunch.path_name() == "compiled helper"
    previous = fastlaunch.enable(False)
    try:
        assert fastlaunch.path_name() == "cffi ABI mode"
        assert gpu.CudaApi(str(fake_library)).load(_entry(("*fp16", "i32", "fp32")), 0).fast is None
    finally:
        fastlaunch.enable(previous)
    assert gpu.CudaApi(str(fake_library)).load(_entry(("*fp16", "i32", "fp32")), 0).fast is not None


def test_a_kernel_the_helper_cannot_describe_takes_the_abi_path(fake_library: Path, helper: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _use_helper(monkeypatch, helper)
    wide = _entry(("*fp16",) + ("i32",) * 600 + ("fp32",))
    kernel = gpu.CudaApi(str(fake_library)).load(wide, 0)
    assert kernel.fast is None
    fake = Fake(fake_library)
    fake.configure(_sizes(wide.arg_types, 2))
    kernel.launch((1, 1, 1), 0, tuple(range(601)), (0.5,))
    params, state = fake.last_launch()
    assert state["launches"] == 1 and params[600] == struct.pack("<i", 600)


_KINDS = ("*fp16", "*bf16", "i32", "i64", "u1", "fp32", "tensordesc<bf16[64, 64]>")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_KINDS), max_size=700), st.lists(st.sampled_from((0, 0, 256)), max_size=3),
       st.integers(1, 5))
def test_helper_takes_what_layouts_limit_takes(kinds: list[str], scratch: list[int], rank: int) -> None:
    """A loaded kernel lays its parameters out once (no limit) and asks ``helper_takes`` for the helper's."""
    metas = [TensorDescMeta(128, 2, 10, (64,) * rank)] * sum(1 for kind in kinds if kind.startswith("tensordesc"))
    try:
        slots = fastlaunch.layout(kinds, scratch, metas, limit=False)
    except fastlaunch.LayoutError:  # more than 16 descriptors: refused either way
        with pytest.raises(fastlaunch.LayoutError):
            fastlaunch.layout(kinds, scratch, metas)
        return
    try:
        limited: tuple[int, ...] | None = fastlaunch.layout(kinds, scratch, metas)
    except fastlaunch.LayoutError:
        limited = None
    assert fastlaunch.helper_takes(slots) == (limited is not None)
    assert limited is None or limited == slots


def test_the_helpers_plan_layout_is_the_version_python_packs(helper: Any) -> None:
    """The C text's layout version is the one ``pack_plan`` packs, and a built helper reports it."""
    from lazytriton.driver import fastlaunch_build

    assert f"#define LT_FAST_PLAN_VERSION {fastlaunch.PLAN_VERSION} " in fastlaunch_build.PLAN_SOURCE
    assert helper.PLAN_VERSION == fastlaunch.PLAN_VERSION
    header = struct.calcsize("<8Q2I4i")
    plan = fastlaunch.pack_plan((1, 2, 3, 4, 5, 6), 7, 8, 128, 0, (0,), dependent=True)
    assert struct.unpack_from("<8Q", plan) == (1, 2, 3, 4, 5, 6, 7, 8) and len(plan) == header + 2
    assert struct.unpack_from("<8Q", fastlaunch.pack_plan((1, 2, 3, 4, 5, 6), 7, 8, 128, 0, (0,)))[5] == 0
