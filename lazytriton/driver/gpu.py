"""CUDA and HIP driver APIs through cffi's ABI mode, and the loaded kernel.

Launch metadata comes from the Entry alone: entry name, block size
(warp size x num_warps), dynamic shared memory (the per-function limit is
raised first when it exceeds 48 KiB), and the parameter layout
(``fastlaunch.layout``): the kernel's own arguments, host tensor descriptors
as their encoded 128-byte maps followed by their sizes and strides, then the
hidden scratch pointers Triton appends, passed as NULL when their size is 0
and allocated per launch otherwise.

The HIP path mirrors the CUDA one call for call; it is built and type-checked
here but has not run on an AMD GPU (none is available to this project).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lazytriton import codepack
from lazytriton.cache_format import Entry
from lazytriton.driver import fastlaunch, helpers
from lazytriton.driver.cdefs import CUDA_CDEF, HIP_CDEF, make_ffi

if TYPE_CHECKING:
    from cffi import FFI

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_DEFAULT_SHARED_LIMIT = 48 * 1024
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class DriverError(RuntimeError):
    """A GPU driver call failed; the message names the call and the driver's error."""


class _ArgBuffers:
    """One thread's argument storage: the arrays the params array points into.

    Pointers and integers live in int64 slots (the driver reads 4 bytes of an
    i32 parameter: on little-endian hosts the low half, which holds the value,
    negative values included), fp32 in float slots, each host descriptor's
    encoded map in 128 bytes aligned to 64; ``keys`` holds the integers each
    map was last encoded from.
    """

    __slots__ = ("ints", "floats", "params", "aux", "zero", "maps", "keys")

    def __init__(self, api: _GpuApi, slots: tuple[int, ...], n_descs: int) -> None:
        ffi = api.ffi
        self.aux = api.aux()
        self.ints = ffi.new("int64_t[]", max(1, fastlaunch.int_slots(slots)))
        self.floats = ffi.new("float[]", max(1, sum(1 for slot in slots if -fastlaunch.MAX_PARAMS <= slot < 0)))
        self.zero = ffi.new("int64_t *")
        self.maps = ffi.new("char[]", fastlaunch.MAP_BYTES * n_descs + 64)
        self.keys: list[tuple[int, ...] | None] = [None] * n_descs
        self.params = ffi.new("void *[]", max(1, len(slots)))
        for i, slot in enumerate(slots):
            if slot >= 0:
                self.params[i] = ffi.addressof(self.ints, slot)
            elif slot == fastlaunch.NULL_SLOT:
                self.params[i] = self.zero
            elif slot <= fastlaunch.DESC_SLOT:
                self.params[i] = self.map(api, fastlaunch.DESC_SLOT - slot)
            else:
                self.params[i] = ffi.addressof(self.floats, -1 - slot)

    def map(self, api: _GpuApi, d: int) -> Any:
        """Descriptor ``d``'s 128 bytes, 64-byte aligned as a CUtensorMap is."""
        offset = -int(api.ffi.cast("uintptr_t", self.maps)) % 64
        return self.maps + offset + fastlaunch.MAP_BYTES * d


class LoadedKernel:
    """An entry loaded on one device, ready to launch."""

    __slots__ = ("entry", "device_index", "function", "block", "shared", "fast", "dependent", "_api", "_tls",
                 "_n_ints", "_scratch", "_launcher", "_slots", "_descs")

    def __init__(self, api: _GpuApi, entry: Entry, device_index: int, function: Any, dependent: bool = False) -> None:
        self.entry = entry
        self.device_index = device_index
        self.function = function
        self.dependent = dependent  # launched as its stream predecessor's programmatic dependent (KernelSpec's)
        self.block = entry.block_threads
        self.shared = entry.shared
        self._api = api
        self._tls = threading.local()
        sizes = [_scratch_size(entry, name) for name in entry.hidden_args]
        try:
            self._slots = fastlaunch.layout(entry.arg_types, sizes, entry.tensordesc_meta, limit=False)
        except fastlaunch.LayoutError as exc:
            raise DriverError(f"entry {entry.key}: {exc}") from None
        if entry.tensordesc_meta and not api.descriptors:
            raise DriverError(f"entry {entry.key} takes host tensor descriptors, which only the CUDA driver encodes")
        hidden = self._slots[len(self._slots) - len(sizes):]
        self._scratch = [(slot, size) for slot, size in zip(hidden, sizes, strict=True) if size > 0]
        self._n_ints = fastlaunch.int_slots(self._slots) - len(self._scratch)
        self._descs = tuple(zip(fastlaunch.descriptor_bases(self._slots), entry.tensordesc_meta, strict=True))
        # The compiled helper's launcher (fastlaunch.py), or None: the ABI-mode path below. ``fast`` is
        # the same for callers that launch it themselves (the warm path), set only when the entry needs no
        # scratch memory: fast(grid_x, grid_y, grid_z, stream, ints, floats) -> status,
        # a status other than 0 to be passed to ``fail``.
        takes = fastlaunch.helper_takes(self._slots)  # else more parameters than the helper takes: the ABI path
        self._launcher = api.fast_launcher(self, self._slots) if takes else None
        self.fast = None if self._scratch else self._launcher

    def launch(self, grid: tuple[int, int, int], stream: int, ints: Sequence[int], floats: Sequence[float],
               scratch_alloc: Callable[[int, int], Any] | None = None) -> None:
        """Launch on ``stream`` with the kernel's integer/pointer and float arguments, each in order.

        ``scratch_alloc(nbytes, device_index)`` returns device memory (an
        object with ``data_ptr()``) for entries that need scratch space.
        """
        fast = self._launcher
        if fast is not None:
            keep = None
            if self._scratch:
                keep = self._scratch_memory(grid, scratch_alloc)
                ints = (*ints, *(memory.data_ptr() for memory in keep))
            status = fast(grid[0], grid[1], grid[2], stream, ints, floats)
            del keep  # the allocator orders reuse after the launch on this stream
            if status:
                self.fail(status, grid)
            return
        buffers = self._tls.__dict__.get("b")
        if buffers is None:
            buffers = self._tls.b = _ArgBuffers(self._api, self._slots, len(self._descs))
        if len(ints) != self._n_ints:
            raise ValueError(f"launch(): ints has {len(ints)} items; the kernel takes {self._n_ints}")
        buffers.ints[0:self._n_ints] = ints
        if floats:
            buffers.floats[0:len(floats)] = floats
        if self._descs:
            self._encode(buffers)
        keep = None
        if self._scratch:
            keep = self._fill_scratch(buffers, grid, scratch_alloc)
        self._api.launch(self, grid, stream, buffers)
        del keep  # the allocator orders reuse after the launch on this stream

    def _encode(self, buffers: _ArgBuffers) -> None:
        """Encode each descriptor's map whose base, sizes or strides differ from the last launch's (ABI path)."""
        for d, (base, meta) in enumerate(self._descs):
            key = tuple(buffers.ints[base:base + 1 + 2 * meta.rank])
            if key != buffers.keys[d]:
                buffers.keys[d] = None
                self._api.encode(buffers.map(self._api, d), meta.swizzle, *fastlaunch.encode_args(meta, key))
                buffers.keys[d] = key

    def fail(self, status: int, grid: tuple[int, int, int]) -> None:
        """Raise the DriverError for a status other than 0 from the compiled helper (``fast``)."""
        call, error = fastlaunch.describe(status)
        name = f"cuLaunchKernel({self.entry.name}, grid={grid})" if call == "cuLaunchKernel" else call
        self._api.check(error, name)
        raise DriverError(f"{name} failed with status {status}")  # check() raises for any error but 0

    def _scratch_memory(self, grid: tuple[int, int, int], scratch_alloc: Callable[[int, int], Any] | None) -> list[Any]:
        """One allocation per hidden scratch parameter of nonzero size, in slot order."""
        if scratch_alloc is None:
            raise DriverError(f"entry {self.entry.key} needs scratch memory; pass scratch_alloc")
        programs = grid[0] * grid[1] * grid[2] * self.entry.num_ctas
        return [scratch_alloc(programs * size, self.device_index) for _, size in self._scratch]

    def _fill_scratch(self, buffers: _ArgBuffers, grid: tuple[int, int, int],
                      scratch_alloc: Callable[[int, int], Any] | None) -> list[Any]:
        keep = self._scratch_memory(grid, scratch_alloc)
        for (slot, _), memory in zip(self._scratch, keep, strict=True):
            buffers.ints[slot] = memory.data_ptr()
        return keep


def _scratch_size(entry: Entry, name: str) -> int:
    """Bytes per program of a hidden scratch parameter (0: passed as NULL)."""
    sizes = {"global_scratch": entry.global_scratch_size, "profile_scratch": entry.profile_scratch_size}
    return sizes.get(name, 0)


class _GpuApi:
    ffi: FFI
    lib: Any
    descriptors = False  # whether ``encode`` builds host tensor descriptors (CUDA only)

    def encode(self, out: Any, swizzle: int, dtype: int, rank: int, base: int, dims: list[int],
               strides: list[int], box: list[int]) -> None:
        """Write one CUtensorMap into ``out`` (128 bytes): cuTensorMapEncodeTiled's arguments, innermost first."""
        raise DriverError("host tensor descriptors need the CUDA driver")

    def aux(self) -> Any:
        """Per-thread scratch the launch call needs (an out-parameter)."""
        return None

    def check(self, status: int, call: str) -> None:
        """Raise a DriverError naming ``call`` for a status other than 0."""
        if status != 0:
            raise DriverError(f"{call} failed: error {status}")

    def fast_launcher(self, kernel: LoadedKernel, slots: tuple[int, ...]) -> Callable[..., int] | None:
        """The compiled helper's launcher for ``kernel``, or None for the ABI-mode path (the default)."""
        return None

    def load(self, entry: Entry, device_index: int, dependent: bool = False) -> LoadedKernel:
        raise NotImplementedError

    def launch(self, kernel: LoadedKernel, grid: tuple[int, int, int], stream: int, buffers: _ArgBuffers) -> None:
        raise NotImplementedError


class CudaApi(_GpuApi):
    """libcuda through cffi."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self.ffi = make_ffi("cuda", CUDA_CDEF)
        try:
            self.lib = self.ffi.dlopen(library)
        except OSError as exc:
            raise DriverError(f"cannot load the CUDA driver ({library}): {exc}") from None
        self._launch = self.lib.cuLaunchKernel
        self._ctx_get = self.lib.cuCtxGetCurrent
        self._contexts: dict[int, Any] = {}
        self.check(self.lib.cuInit(0), "cuInit")
        self.driver_functions = tuple(self._address(name) for name in (
            "cuLaunchKernel", "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"))
        # CUDA 12.0+ drivers; without it, descriptor kernels fail at launch with a clear error. Then cuLaunchKernelEx
        # where a CUDA graph can capture a programmatic launch (12.3+): else a programmatic dependent launches
        # plainly (its wait returns at once).
        self.driver_functions += (self._optional("cuTensorMapEncodeTiled"),
                                  self._optional("cuLaunchKernelEx") if self._driver_version() >= 12030 else 0)
        self._launch_ex = self.lib.cuLaunchKernelEx if self.driver_functions[5] else None
        self.descriptors = True

    def _driver_version(self) -> int:
        """The driver's CUDA version (12030 for 12.3), 0 where it does not say."""
        if not self._optional("cuDriverGetVersion"):
            return 0
        version = self.ffi.new("int *")
        return int(version[0]) if self.lib.cuDriverGetVersion(version) == 0 else 0

    def _optional(self, name: str) -> int:
        """A driver function's address, 0 where the library lacks it."""
        try:
            return self._address(name)
        except (AttributeError, self.ffi.error):  # cffi: ffi.error for a symbol the library lacks
            return 0

    def _address(self, name: str) -> int:
        return int(self.ffi.cast("uintptr_t", getattr(self.lib, name)))

    def fast_launcher(self, kernel: LoadedKernel, slots: tuple[int, ...]) -> Callable[..., int] | None:
        ctx = self._contexts[kernel.device_index][0]
        return fastlaunch.launcher(fastlaunch.make_driver(*self.driver_functions),
                                   int(self.ffi.cast("uintptr_t", kernel.function)),
                                   int(self.ffi.cast("uintptr_t", ctx)), kernel.block, kernel.shared, slots,
                                   kernel.entry.tensordesc_meta, kernel.dependent)

    def encode(self, out: Any, swizzle: int, dtype: int, rank: int, base: int, dims: list[int],
               strides: list[int], box: list[int]) -> None:
        if not self.driver_functions[4]:
            raise DriverError("this CUDA driver has no cuTensorMapEncodeTiled (CUDA 12.0+): host tensor "
                              "descriptors cannot be encoded")
        ffi = self.ffi
        status = self.lib.cuTensorMapEncodeTiled(
            out, dtype, rank, ffi.cast("void *", base), ffi.new("uint64_t[]", dims),
            ffi.new("uint64_t[]", strides or [0]), ffi.new("uint32_t[]", box), ffi.new("uint32_t[]", [1] * rank),
            0, swizzle, 2, 0)  # no interleave, L2 promotion 128B, zero fill: as Triton's fillTMADescriptorTiled
        if status != 0:
            self.check(status, f"cuTensorMapEncodeTiled(dtype={dtype}, rank={rank}, base={base:#x}, dims={dims}, "
                               f"byte strides={strides}, box={box}, swizzle={swizzle})")

    def check(self, status: int, call: str) -> None:
        if status != 0:
            text = self.ffi.new("const char **")
            self.lib.cuGetErrorString(status, text)
            message = self.ffi.string(text[0]).decode() if text[0] != self.ffi.NULL else "unknown error"
            raise DriverError(f"{call} failed: CUDA error {status} ({message})")

    def _context(self, device_index: int) -> Any:
        if device_index not in self._contexts:
            dev = self.ffi.new("CUdevice *")
            self.check(self.lib.cuDeviceGet(dev, device_index), "cuDeviceGet")
            ctx = self.ffi.new("CUcontext *")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctx, dev[0]), "cuDevicePrimaryCtxRetain")
            optin = self.ffi.new("int *")
            self.check(self.lib.cuDeviceGetAttribute(optin, _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                                     dev[0]), "cuDeviceGetAttribute")
            self._contexts[device_index] = (ctx[0], optin[0])
        return self._contexts[device_index]

    def load(self, entry: Entry, device_index: int, dependent: bool = False) -> LoadedKernel:
        ctx, shared_limit = self._context(device_index)
        if entry.shared > shared_limit:
            raise DriverError(f"entry {entry.key} needs {entry.shared} bytes of shared memory; "
                              f"device {device_index} allows {shared_limit}")
        self.check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            module = self.ffi.new("CUmodule *")
            image = self.ffi.from_buffer(entry.binary)
            self.check(self.lib.cuModuleLoadData(module, image), f"cuModuleLoadData({entry.name})")
            function = self.ffi.new("CUfunction *")
            self.check(self.lib.cuModuleGetFunction(function, module[0], entry.name.encode()), "cuModuleGetFunction")
            if entry.shared > _DEFAULT_SHARED_LIMIT:
                self.check(self.lib.cuFuncSetAttribute(function[0], _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                       entry.shared), "cuFuncSetAttribute")
        finally:
            self.lib.cuCtxPopCurrent_v2(self.ffi.new("CUcontext *"))
        return LoadedKernel(self, entry, device_index, function[0], dependent)

    def aux(self) -> Any:
        return self.ffi.new("CUcontext *")

    def launch(self, kernel: LoadedKernel, grid: tuple[int, int, int], stream: int, buffers: _ArgBuffers) -> None:
        ctx = self._contexts[kernel.device_index][0]
        out = buffers.aux
        self._ctx_get(out)
        pushed = out[0] != ctx
        if pushed:  # a function runs only in the context it was loaded in
            self.check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            if kernel.dependent and self._launch_ex is not None:
                config, _attribute = self._dependent_config(kernel, grid, stream)  # the config points at it
                status = self._launch_ex(config, kernel.function, buffers.params, self.ffi.NULL)
            else:
                status = self._launch(kernel.function, grid[0], grid[1], grid[2], kernel.block, 1, 1,
                                      kernel.shared, stream, buffers.params, self.ffi.NULL)
        finally:
            if pushed:
                self.lib.cuCtxPopCurrent_v2(out)
        if status != 0:
            self.check(status, f"cuLaunchKernel({kernel.entry.name}, grid={grid})")

    def _dependent_config(self, kernel: LoadedKernel, grid: tuple[int, int, int], stream: int) -> tuple[Any, Any]:
        """The configuration of a launch with programmatic stream serialization, and its attribute.

        For cuLaunchKernelEx; the configuration points at the attribute: the caller keeps both alive through it.
        """
        config = self.ffi.new("CUlaunchConfig *")
        attribute = self.ffi.new("CUlaunchAttribute *")
        attribute.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmatic = 1
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = kernel.block, 1, 1
        config.sharedMemBytes, config.hStream = kernel.shared, stream
        config.attrs, config.numAttrs = attribute, 1
        return config, attribute


class HipApi(_GpuApi):
    """libamdhip64 through cffi (not run here: no AMD GPU is available)."""

    def __init__(self) -> None:
        self.ffi = make_ffi("hip", HIP_CDEF)
        try:
            self.lib = self.ffi.dlopen("libamdhip64.so")
        except OSError as exc:
            raise DriverError(f"cannot load the HIP runtime (libamdhip64.so): {exc}") from None

    def check(self, status: int, call: str) -> None:
        if status != 0:
            message = self.ffi.string(self.lib.hipGetErrorString(status)).decode()
            raise DriverError(f"{call} failed: HIP error {status} ({message})")

    def _with_device(self, device_index: int) -> int:
        current = self.ffi.new("int *")
        self.check(self.lib.hipGetDevice(current), "hipGetDevice")
        if current[0] != device_index:
            self.check(self.lib.hipSetDevice(device_index), "hipSetDevice")
        return int(current[0])

    def load(self, entry: Entry, device_index: int, dependent: bool = False) -> LoadedKernel:
        previous = self._with_device(device_index)
        try:
            module = self.ffi.new("hipModule_t *")
            self.check(self.lib.hipModuleLoadData(module, self.ffi.from_buffer(entry.binary)), "hipModuleLoadData")
            function = self.ffi.new("hipFunction_t *")
            self.check(self.lib.hipModuleGetFunction(function, module[0], entry.name.encode()), "hipModuleGetFunction")
        finally:
            self.lib.hipSetDevice(previous)
        return LoadedKernel(self, entry, device_index, function[0])

    def launch(self, kernel: LoadedKernel, grid: tuple[int, int, int], stream: int, buffers: _ArgBuffers) -> None:
        previous = self._with_device(kernel.device_index)
        try:
            status = self.lib.hipModuleLaunchKernel(kernel.function, grid[0], grid[1], grid[2], kernel.block, 1, 1,
                                                    kernel.shared, stream, buffers.params, self.ffi.NULL)
        finally:
            if previous != kernel.device_index:
                self.lib.hipSetDevice(previous)
        self.check(status, f"hipModuleLaunchKernel({kernel.entry.name}, grid={grid})")


@functools.cache
def cuda() -> CudaApi:
    """The process's CUDA driver binding (loaded on first use).

    The first use is when the compiled helpers are looked for in the cache dir and, where one is missing, built
    there in the background for the next process (helpers.py), and so is the package's code pack (codepack.py):
    a few ``stat`` calls, never a wait.
    """
    api = CudaApi()
    helpers.on_first_use()
    codepack.on_first_use()
    return api


@functools.cache
def hip() -> HipApi:
    """The process's HIP runtime binding (loaded on first use; its first use builds the code pack, as ``cuda``'s)."""
    api = HipApi()
    codepack.on_first_use()
    return api
