"""The launcher's argument marshalling, checked by reading back what the driver would read."""

from __future__ import annotations

import importlib
import struct
from typing import Any

import pytest

from lazytriton.cache_format import Entry, Provenance
from lazytriton.driver import gpu
from lazytriton.driver.cdefs import CUDA_CDEF, HIP_CDEF, cdef_hash, make_ffi
from lazytriton.kernels import get


def _entry(arg_types: tuple[str, ...], hidden: tuple[str, ...] = ("global_scratch", "profile_scratch"),
           global_scratch: int = 0) -> Entry:
    return Entry(
        key="0" * 32, variant="v", target="sm_90", kind="cubin", binary=b"\x7fELF", name="k", num_warps=4,
        num_ctas=1, warp_size=32, shared=0, global_scratch_size=global_scratch, global_scratch_align=1,
        profile_scratch_size=0, profile_scratch_align=1, arg_types=arg_types, hidden_args=hidden,
        provenance=Provenance("triton", "3.9.0", "f" * 16, 0.0, 1),
    )


class _FakeApi(gpu._GpuApi):
    """Records, for each launch, the parameter values as the driver would read them."""

    def __init__(self) -> None:
        self.ffi = make_ffi("cuda", CUDA_CDEF)
        self.launches: list[tuple[Any, ...]] = []

    def launch(self, kernel: gpu.LoadedKernel, grid: tuple[int, int, int], stream: int, buffers: Any) -> None:
        values = []
        types = kernel.entry.arg_types + tuple("*i8" for _ in kernel.entry.hidden_args)
        for i, kind in enumerate(types):
            size, fmt = {"i32": (4, "<i"), "fp32": (4, "<f")}.get(kind, (8, "<q"))
            raw = bytes(self.ffi.buffer(self.ffi.cast("char *", buffers.params[i]), size))
            values.append(struct.unpack(fmt, raw)[0])
        self.launches.append((grid, stream, kernel.block, tuple(values)))


def test_pre_parsed_declarations_are_current() -> None:
    for name, cdef in (("cuda", CUDA_CDEF), ("hip", HIP_CDEF)):
        module = importlib.import_module(f"lazytriton.driver._{name}_ffi")
        assert module.CDEF_HASH == cdef_hash(cdef), f"run python -m lazytriton.driver.ffi_build ({name})"
        assert make_ffi(name, cdef) is module.ffi


def test_stale_pre_parsed_module_falls_back_to_parsing() -> None:
    ffi = make_ffi("cuda", CUDA_CDEF + "\nCUresult cuCtxSynchronize(void);\n")
    assert ffi is not importlib.import_module("lazytriton.driver._cuda_ffi").ffi
    assert "CUctx_st" in str(ffi.typeof("CUcontext"))


def test_flash_fwd_arguments_reach_the_driver_as_written() -> None:
    spec = get("flash_fwd")
    arg_types = tuple(t for t in spec.signature("bf16").values() if t != "constexpr")
    api = _FakeApi()
    kernel = gpu.LoadedKernel(api, _entry(arg_types), 0, None)
    ints = tuple(range(1, len(arg_types) - 2))  # every parameter but the trailing sm_scale, softcap, dropout_p
    # causal_offset may be negative, and so are window_left/right (-1: none); then the five strides of ALiBi/bias
    ints = ints[:-8] + (-7, -1, -1) + ints[-5:]
    kernel.launch((3, 2, 1), 1234, ints, (0.125, 2.5, 0.25))
    grid, stream, block, values = api.launches[0]
    assert (grid, stream, block) == ((3, 2, 1), 1234, 128)
    assert values[: len(ints)] == ints
    assert values[len(ints):len(ints) + 3] == (0.125, 2.5, 0.25)
    assert values[len(ints) + 3:] == (0, 0)  # NULL scratch pointers


def test_each_thread_gets_its_own_argument_buffers() -> None:
    import threading

    api = _FakeApi()
    kernel = gpu.LoadedKernel(api, _entry(("*fp16", "i32", "fp32")), 0, None)
    seen: list[Any] = []

    def launch(value: int) -> None:
        kernel.launch((1, 1, 1), 0, (value, value), (float(value),))
        seen.append(kernel._tls.b)

    threads = [threading.Thread(target=launch, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(b) for b in seen}) == 4
    assert sorted(v[3][0] for v in api.launches) == [0, 1, 2, 3]


def test_scratch_is_allocated_per_launch_when_the_entry_needs_it() -> None:
    api = _FakeApi()
    kernel = gpu.LoadedKernel(api, _entry(("*fp16",), global_scratch=256), 0, None)
    with pytest.raises(gpu.DriverError, match="scratch"):
        kernel.launch((2, 3, 1), 0, (16,), ())

    class Memory:
        def data_ptr(self) -> int:
            return 4096

    sizes: list[tuple[int, int]] = []
    kernel.launch((2, 3, 1), 0, (16,), (), lambda n, dev: sizes.append((n, dev)) or Memory())
    assert sizes == [(2 * 3 * 256, 0)]
    assert api.launches[-1][3] == (16, 4096, 0)


def test_unsupported_parameter_type_is_refused() -> None:
    with pytest.raises(gpu.DriverError, match="fp16"):
        gpu.LoadedKernel(_FakeApi(), _entry(("*fp16", "fp16")), 0, None).launch((1, 1, 1), 0, (1,), (1.0,))


def test_missing_driver_library_is_a_clear_error() -> None:
    try:
        gpu.CudaApi()
    except gpu.DriverError as exc:
        assert "libcuda" in str(exc)
    else:
        pytest.skip("a CUDA driver is installed here; the missing-library path cannot be shown")
