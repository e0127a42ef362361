"""A fake libamdhip64 for CPU tests of the HIP launch paths: it records what hipModuleLaunchKernel would read.

Built with the system C compiler into a test's temporary folder (``build``), as tests/fake_libcuda.py builds
its fake libcuda. ``configure(sizes)`` says how many bytes the fake reads behind each parameter pointer;
``last_launch()`` returns them, each in its own 128-byte record, with the grid, block, shared memory, stream,
function, the device current during the launch and whether ``extra`` was NULL.

Every call since ``configure`` is logged, oldest first:

- ``loads()``: each hipModuleLoadData (the device current, the image's first 4 bytes as an int, the module
  handle, ``0xA000`` plus the load's number) and the hipModuleGetFunction after it (the module it was asked
  of and the kernel's name);
- ``launch_log()``: each hipModuleLaunchKernel's grid, block, shared memory, function and device;
- ``allocations()``: each hipMallocAsync and hipFreeAsync (call, bytes, address, stream, device, launches
  before it); an allocation gets the next of a series of 4 KiB-aligned addresses from ``SCRATCH_BASE``;
- ``device_sets()``: each hipSetDevice's device.

The runtime has ``FAKE_DEVICES`` devices; hipSetDevice of another is ``HIP_ERROR_INVALID_DEVICE``. Each call
can be made to fail (``fail``) with a status until the next ``configure``. The launch record, the logs and the
allocator are tests/fake_driver_core.py's, which tests/fake_libcuda.py shares.
"""

from __future__ import annotations

from pathlib import Path

from fake_driver_core import CORE_SOURCE, FUNCTION, SCRATCH_BASE, FakeDriver, compile_library, last_records

__all__ = ["CALLS", "FAKE_DEVICES", "FUNCTION", "HIP_ERROR_INVALID_DEVICE", "SCRATCH_BASE", "Fake", "build"]

SOURCE = CORE_SOURCE + r"""
enum { LOAD, GET_FUNCTION, LAUNCH, MALLOC, SET_DEVICE, N_CALLS };
static int fail_status[N_CALLS];
static int device;
static int64_t set_log[64];
static int n_sets;
static int64_t current_place(void) { return device; }

int fake_configure(int n, const int *param_sizes) {
    if (core_configure(n, param_sizes) != 0) return -1;
    memset(fail_status, 0, sizeof fail_status);
    device = 0;
    n_sets = 0;
    return 0;
}
void fake_fail(int call, int status) { if (call >= 0 && call < N_CALLS) fail_status[call] = status; }
void fake_set_device(int d) { device = d; }
int fake_device(void) { return device; }
int fake_device_sets(int64_t *out) { memcpy(out, set_log, sizeof set_log); return n_sets; }

int hipGetDevice(int *d) { *d = device; return 0; }
int hipSetDevice(int d) {
    set_log[n_sets++ & 63] = d;
    if (fail_status[SET_DEVICE]) return fail_status[SET_DEVICE];
    if (d < 0 || d >= 8) return 101; /* hipErrorInvalidDevice */
    device = d;
    return 0;
}
const char *hipGetErrorString(int error) { return error == 101 ? "invalid device ordinal" : "fake hip error"; }
int hipModuleLoadData(void **module, const void *image) { return load_module(module, image, fail_status[LOAD]); }
int hipModuleGetFunction(void **function, void *module, const char *name) {
    return get_function(function, module, name, fail_status[GET_FUNCTION]);
}
int hipMallocAsync(void **ptr, size_t bytes, uintptr_t stream) {
    uint64_t address;
    int status = scratch_alloc(&address, bytes, stream, fail_status[MALLOC]);
    if (status == 0) *ptr = (void *)(uintptr_t)address;
    return status;
}
int hipFreeAsync(void *ptr, uintptr_t stream) { return scratch_free((uint64_t)(uintptr_t)ptr, stream); }
int hipModuleLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                          unsigned int by, unsigned int bz, unsigned int shared, uintptr_t stream, void **params,
                          void **extra) {
    record_launch(1, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
    return fail_status[LAUNCH];
}
"""

CDEF = """
int fake_configure(int n, const int *param_sizes);
void fake_fail(int call, int status);
void fake_set_device(int d);
int fake_device(void);
int fake_device_sets(int64_t *out);
"""
FAKE_DEVICES = 8
HIP_ERROR_INVALID_DEVICE = 101
CALLS = ("load", "get_function", "launch", "malloc", "set_device")  # fake_fail's call numbers, in order
STATE = ("launches", "grid_x", "grid_y", "grid_z", "block_x", "block_yz", "shared", "stream", "function", "device",
         "extra_null")
LOGGED = ("grid_x", "grid_y", "grid_z", "block_x", "shared", "function", "device")


def build(directory: Path) -> Path | None:
    """Compile the fake into ``directory``; None when there is no C compiler."""
    return compile_library(directory, "fakehip", SOURCE)


class Fake(FakeDriver):
    """The loaded fake: configure it, read back what was called."""

    CDEF = CDEF
    STATE = STATE
    LOGGED = LOGGED
    PLACE = "device"

    def configure(self, sizes: list[int]) -> None:
        """Read ``sizes[i]`` bytes behind parameter i at each launch; clear the logs, failures and device (0)."""
        assert self.lib.fake_configure(len(sizes), self.ffi.new("int[]", sizes or [0])) == 0
        self.sizes = sizes

    def fail(self, call: str, status: int) -> None:
        """Make ``call`` (one of CALLS) fail with ``status`` (0: succeed) until the next ``configure``."""
        self.lib.fake_fail(CALLS.index(call), status)

    def set_device(self, device: int) -> None:
        self.lib.fake_set_device(device)

    def device(self) -> int:
        return int(self.lib.fake_device())

    def device_sets(self) -> list[int]:
        """The devices hipSetDevice was called with since ``configure`` (the last 64), oldest first."""
        raw = self.ffi.new("int64_t[]", 64)
        count = self.lib.fake_device_sets(raw)
        return [rec[0] for rec in last_records(raw, count, 1)]
