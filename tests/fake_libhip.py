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
can be made to fail (``fail``) with a status until the next ``configure``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fake_libcuda import compile_library

SOURCE = r"""
#include <stdint.h>
#include <string.h>

enum { LOAD, GET_FUNCTION, LAUNCH, MALLOC, SET_DEVICE, N_CALLS };
static int fail_status[N_CALLS];
static int n_sizes, sizes[1024];
static unsigned char seen[128 * 1024];
static int seen_null[1024];
static int64_t state[16];
static int device;
static int64_t launch_log[64 * 8], alloc_log[64 * 6], load_log[64 * 6], set_log[64];
static char names[64][256];
static int n_launches, n_allocs, n_loads, n_functions, n_sets;
static uint64_t next_scratch = 0x5C0000000000ull;

int fake_configure(int n, const int *param_sizes) {
    if (n < 0 || n > 1024) return -1;
    n_sizes = n;
    memcpy(sizes, param_sizes, sizeof(int) * (size_t)n);
    memset(state, 0, sizeof state);
    memset(fail_status, 0, sizeof fail_status);
    device = 0;
    n_launches = n_allocs = n_loads = n_functions = n_sets = 0;
    next_scratch = 0x5C0000000000ull;
    return 0;
}
void fake_fail(int call, int status) { if (call >= 0 && call < N_CALLS) fail_status[call] = status; }
void fake_set_device(int d) { device = d; }
int fake_device(void) { return device; }
int fake_launch_log(int64_t *out) { memcpy(out, launch_log, sizeof launch_log); return n_launches; }
int fake_allocations(int64_t *out) { memcpy(out, alloc_log, sizeof alloc_log); return n_allocs; }
int fake_device_sets(int64_t *out) { memcpy(out, set_log, sizeof set_log); return n_sets; }
int fake_loads(int64_t *out, char *out_names) {
    memcpy(out, load_log, sizeof load_log);
    memcpy(out_names, names, sizeof names);
    return n_loads;
}
void fake_read(unsigned char *out, int *nulls, int64_t *out_state) {
    memcpy(out, seen, sizeof seen);
    memcpy(nulls, seen_null, sizeof seen_null);
    memcpy(out_state, state, sizeof state);
}

int hipGetDevice(int *d) { *d = device; return 0; }
int hipSetDevice(int d) {
    set_log[n_sets++ & 63] = d;
    if (fail_status[SET_DEVICE]) return fail_status[SET_DEVICE];
    if (d < 0 || d >= 8) return 101; /* hipErrorInvalidDevice */
    device = d;
    return 0;
}
const char *hipGetErrorString(int error) { return error == 101 ? "invalid device ordinal" : "fake hip error"; }
int hipModuleLoadData(void **module, const void *image) {
    int64_t *rec = load_log + 6 * (n_loads & 63);
    uint32_t head;
    memcpy(&head, image, 4);
    memset(rec, 0, 6 * sizeof *rec);
    rec[0] = device; rec[1] = head; rec[2] = 0xA000 + n_loads;
    n_loads++;
    if (fail_status[LOAD]) return fail_status[LOAD];
    *module = (void *)(uintptr_t)rec[2];
    return 0;
}
int hipModuleGetFunction(void **function, void *module, const char *name) {
    if (n_loads > 0) {
        int64_t *rec = load_log + 6 * ((n_loads - 1) & 63);
        rec[3] = (int64_t)(uintptr_t)module; rec[4] = device;
        strncpy(names[(n_loads - 1) & 63], name, 255);
    }
    n_functions++;
    if (fail_status[GET_FUNCTION]) return fail_status[GET_FUNCTION];
    *function = (void *)0xF000;
    return 0;
}
static void log_alloc(int64_t call, int64_t bytes, uint64_t address, uintptr_t stream) {
    int64_t *rec = alloc_log + 6 * (n_allocs & 63);
    n_allocs++;
    rec[0] = call; rec[1] = bytes; rec[2] = (int64_t)address; rec[3] = (int64_t)stream;
    rec[4] = device; rec[5] = state[0];
}
/* call 1: an allocation (4 KiB-aligned addresses, one after the other), 2: a free */
int hipMallocAsync(void **ptr, size_t bytes, uintptr_t stream) {
    log_alloc(1, (int64_t)bytes, fail_status[MALLOC] ? 0 : next_scratch, stream);
    if (fail_status[MALLOC]) return fail_status[MALLOC];
    *ptr = (void *)(uintptr_t)next_scratch;
    next_scratch += (bytes + 4095) / 4096 * 4096 + 4096;
    return 0;
}
int hipFreeAsync(void *ptr, uintptr_t stream) { log_alloc(2, 0, (uint64_t)(uintptr_t)ptr, stream); return 0; }
int hipModuleLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                          unsigned int by, unsigned int bz, unsigned int shared, uintptr_t stream, void **params,
                          void **extra) {
    state[0]++;
    state[1] = gx; state[2] = gy; state[3] = gz; state[4] = bx; state[5] = by * 1000 + bz; state[6] = shared;
    state[7] = (int64_t)stream; state[8] = (int64_t)(uintptr_t)f; state[9] = device; state[10] = extra == NULL;
    int64_t *log = launch_log + 8 * (n_launches & 63);
    n_launches++;
    log[0] = gx; log[1] = gy; log[2] = gz; log[3] = bx; log[4] = shared; log[5] = (int64_t)(uintptr_t)f;
    log[6] = device;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < n_sizes; i++) {
        seen_null[i] = params[i] == NULL;
        if (params[i] != NULL) memcpy(seen + 128 * i, params[i], (size_t)sizes[i]);
    }
    return fail_status[LAUNCH];
}
"""

CDEF = """
int fake_configure(int n, const int *param_sizes);
void fake_fail(int call, int status);
void fake_set_device(int d);
int fake_device(void);
int fake_launch_log(int64_t *out);
int fake_allocations(int64_t *out);
int fake_device_sets(int64_t *out);
int fake_loads(int64_t *out, char *out_names);
void fake_read(unsigned char *out, int *nulls, int64_t *out_state);
"""
SCRATCH_BASE = 0x5C0000000000
FAKE_DEVICES = 8
HIP_ERROR_INVALID_DEVICE = 101
FUNCTION = 0xF000
CALLS = ("load", "get_function", "launch", "malloc", "set_device")  # fake_fail's call numbers, in order
STATE = ("launches", "grid_x", "grid_y", "grid_z", "block_x", "block_yz", "shared", "stream", "function", "device",
         "extra_null")
LOGGED = ("grid_x", "grid_y", "grid_z", "block_x", "shared", "function", "device")


def build(directory: Path) -> Path | None:
    """Compile the fake into ``directory``; None when there is no C compiler."""
    return compile_library(directory, "fakehip", SOURCE)


class Fake:
    """The loaded fake: configure it, read back what was called."""

    def __init__(self, library: Path) -> None:
        from cffi import FFI

        self.ffi = FFI()
        self.ffi.cdef(CDEF)
        self.lib = self.ffi.dlopen(str(library))
        self.sizes: list[int] = []

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

    def last_launch(self) -> tuple[list[Any], dict[str, int]]:
        """(each parameter's bytes, or None for a NULL pointer; the last launch's state by name)."""
        raw = self.ffi.new("unsigned char[]", 128 * 1024)
        nulls = self.ffi.new("int[]", 1024)
        state = self.ffi.new("int64_t[]", 16)
        self.lib.fake_read(raw, nulls, state)
        data = bytes(self.ffi.buffer(raw))
        params = [None if nulls[i] else data[128 * i:128 * i + size] for i, size in enumerate(self.sizes)]
        return params, {name: int(state[i]) for i, name in enumerate(STATE)}

    def launch_log(self) -> list[dict[str, int]]:
        """The launches since ``configure`` (the last 64), oldest first."""
        raw = self.ffi.new("int64_t[]", 64 * 8)
        count = self.lib.fake_launch_log(raw)
        return [{name: int(raw[8 * (n & 63) + i]) for i, name in enumerate(LOGGED)}
                for n in range(max(0, count - 64), count)]

    def loads(self) -> list[dict[str, Any]]:
        """The module loads since ``configure`` (the last 64), oldest first, each with its function lookup."""
        raw = self.ffi.new("int64_t[]", 64 * 6)
        names = self.ffi.new("char[]", 64 * 256)
        count = self.lib.fake_loads(raw, names)
        out = []
        for n in range(max(0, count - 64), count):
            rec = [int(raw[6 * (n & 63) + i]) for i in range(5)]
            name = self.ffi.string(names + 256 * (n & 63)).decode()
            out.append({"device": rec[0], "head": rec[1], "module": rec[2], "function_of": rec[3],
                        "function_device": rec[4], "name": name})
        return out

    def allocations(self) -> list[dict[str, Any]]:
        """hipMallocAsync and hipFreeAsync calls since ``configure`` (the last 64), oldest first."""
        raw = self.ffi.new("int64_t[]", 64 * 6)
        count = self.lib.fake_allocations(raw)
        names = ("call", "bytes", "address", "stream", "device", "launches_before")
        calls = []
        for n in range(max(0, count - 64), count):
            rec = {name: int(raw[6 * (n & 63) + i]) for i, name in enumerate(names)}
            rec["call"] = {1: "alloc", 2: "free"}[rec["call"]]
            calls.append(rec)
        return calls

    def device_sets(self) -> list[int]:
        """The devices hipSetDevice was called with since ``configure`` (the last 64), oldest first."""
        raw = self.ffi.new("int64_t[]", 64)
        count = self.lib.fake_device_sets(raw)
        return [int(raw[n & 63]) for n in range(max(0, count - 64), count)]
