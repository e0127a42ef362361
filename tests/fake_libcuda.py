"""A fake libcuda for CPU tests of the launch paths: it records what cuLaunchKernel would read.

Built with the system C compiler into a test's temporary folder (tests skip
without one). ``configure(sizes)`` says how many bytes the fake reads behind
each parameter pointer; ``last_launch()`` returns them with the grid, block,
shared memory, stream, function and the context current during the launch.
Each parameter is read into its own 128-byte record (a host descriptor's
CUtensorMap is 128 bytes), with the pointer's address modulo 64.

Every launch since ``configure`` is also logged (``launch_log``: grid, block, shared memory, function, the context
current, and ``programmatic``: 1 for a ``cuLaunchKernelEx`` with programmatic stream serialization), so a
call of several kernels (decoding: kv_append, the split and the combine kernel) can be followed launch by launch.
The device has compute capability 9.0 and ``FAKE_SMS`` SMs.

``cuMemAllocAsync`` and ``cuMemFreeAsync`` (a launcher's scratch memory) are faked too: an allocation gets
the next of a series of 4 KiB-aligned addresses from ``SCRATCH_BASE``, and each call is logged
(``allocations()``: the call, bytes, address, stream, the context current then, and the launches before it).
Each cuModuleLoadData is logged with the cuModuleGetFunction after it (``loads()``: the context current, the
image's first 4 bytes, the module handle, ``0xA000`` plus the load's number, and the kernel's name).
The launch record, the logs and the allocator are tests/fake_driver_core.py's, which tests/fake_libhip.py
shares.

An application's own memory calls (``cuCtxSetCurrent``, ``cuMemAlloc_v2``/``cuMemFree_v2``, the two
``cuMemcpy``s, ``cuCtxSynchronize``) work on host memory: a program that sets its context and places its tensors
as on a GPU runs on the fake (benchmarks/native_first_launch.c).

``fake_set_light(1)`` makes cuLaunchKernel only count its calls (a benchmark's floor: the host cost of its
caller, not of the fake's record).

``cuTensorMapEncodeTiled`` is faked too: it counts its calls, records the
last call's arguments (``encodes()``) and writes a map that is a fixed
serialisation of those arguments (``fake_map``): two maps are equal exactly
when they were encoded from the same arguments.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from fake_driver_core import CORE_SOURCE, SCRATCH_BASE, FakeDriver, compile_library, last_records

__all__ = ["FAKE_SMS", "SCRATCH_BASE", "Fake", "build", "fake_map"]

SOURCE = CORE_SOURCE + r"""
#include <stdlib.h>

static int64_t encodes[16 * 32];
static int n_encodes;
static int encode_status;
static void *stack[8];
static int depth;
static void *current;
static int launch_status;
static int alloc_status;
static int light; /* cuLaunchKernel only counts (benchmarks: the host cost of what calls it) */
void fake_set_light(int on) { light = on; }
static int64_t current_place(void) { return (int64_t)(uintptr_t)current; }

int fake_configure(int n, const int *param_sizes, int status) {
    if (core_configure(n, param_sizes) != 0) return -1;
    launch_status = status;
    current = NULL;
    depth = 0;
    n_encodes = 0;
    encode_status = 0;
    alloc_status = 0;
    return 0;
}
void fake_set_alloc_status(int status) { alloc_status = status; }
int cuMemAllocAsync(uint64_t *ptr, size_t bytes, uintptr_t stream) {
    return scratch_alloc(ptr, bytes, stream, alloc_status);
}
int cuMemFreeAsync(uint64_t ptr, uintptr_t stream) { return scratch_free(ptr, stream); }
void fake_set_encode_status(int status) { encode_status = status; }
int fake_encodes(int64_t *out) { memcpy(out, encodes, sizeof encodes); return n_encodes; }

/* The map is the arguments, serialised: 11 bytes of dtype, rank, interleave, swizzle, l2, oob and the five
   element strides, 5 zero bytes, the address, 5 dims, 4 byte strides (u64), 5 box dims (u32), "FAKE". */
int cuTensorMapEncodeTiled(void *map, int dtype, uint32_t rank, void *address, const uint64_t *dims,
                           const uint64_t *strides, const uint32_t *box, const uint32_t *element_strides,
                           int interleave, int swizzle, int l2, int oob) {
    unsigned char *m = map;
    int64_t *rec = encodes + 32 * (n_encodes & 15);
    n_encodes++;
    memset(rec, 0, 32 * sizeof *rec);
    rec[0] = dtype; rec[1] = rank; rec[2] = (int64_t)(uintptr_t)address; rec[3] = interleave; rec[4] = swizzle;
    rec[5] = l2; rec[6] = oob; rec[7] = (int64_t)((uintptr_t)map % 64);
    if (encode_status) return encode_status;
    if (rank < 1 || rank > 5) return 1;
    memset(m, 0, 128);
    m[0] = (unsigned char)dtype; m[1] = (unsigned char)rank; m[2] = (unsigned char)interleave;
    m[3] = (unsigned char)swizzle; m[4] = (unsigned char)l2; m[5] = (unsigned char)oob;
    for (uint32_t i = 0; i < rank; i++) {
        rec[8 + i] = (int64_t)dims[i]; rec[18 + i] = box[i]; rec[23 + i] = element_strides[i];
        m[6 + i] = (unsigned char)element_strides[i];
        memcpy(m + 24 + 8 * i, &dims[i], 8);
        memcpy(m + 96 + 4 * i, &box[i], 4);
    }
    for (uint32_t i = 0; i + 1 < rank; i++) {
        rec[13 + i] = (int64_t)strides[i];
        memcpy(m + 64 + 8 * i, &strides[i], 8);
    }
    uint64_t addr = (uint64_t)(uintptr_t)address;
    memcpy(m + 16, &addr, 8);
    memcpy(m + 124, "FAKE", 4);
    return 0;
}
void fake_set_current(uintptr_t ctx) { current = (void *)ctx; }

int cuInit(unsigned int flags) { return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
/* compute capability 9.0 (75, 76), 132 SMs (16), else 232448 */
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    *value = attribute == 75 ? 9 : attribute == 76 ? 0 : attribute == 16 ? 132 : 232448;
    return 0;
}
int cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = (void *)(uintptr_t)(0xC000 + device); return 0; }
int cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { state[1]++; stack[depth++ & 7] = current; current = ctx; return 0; }
int cuCtxPopCurrent_v2(void **ctx) {
    state[2]++;
    if (ctx) *ctx = current;
    current = depth > 0 ? stack[--depth & 7] : NULL;
    return 0;
}
int cuModuleLoadData(void **module, const void *image) { return load_module(module, image, 0); }
int cuModuleGetFunction(void **function, void *module, const char *name) {
    return get_function(function, module, name, 0);
}
int cuFuncSetAttribute(void *function, int attribute, int value) { return 0; }
int cuGetErrorString(int error, const char **text) { *text = "fake error"; return 0; }
int cuLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                   unsigned int bz, unsigned int shared, uintptr_t stream, void **params, void **extra) {
    if (light)
        state[0]++;
    else
        record_launch(3, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
    return launch_status;
}
static int driver_version = 13000;
void fake_set_driver_version(int version) { driver_version = version; }
int cuDriverGetVersion(int *version) { *version = driver_version; return 0; }
/* cuLaunchKernelEx: recorded as cuLaunchKernel is, the log's last field 1 for programmatic stream serialization */
typedef struct { int id, pad; union { char bytes[64]; int programmatic; uint64_t align; } value; } fake_attribute;
typedef struct {
    unsigned int gx, gy, gz, bx, by, bz, shared;
    uintptr_t stream;
    fake_attribute *attrs;
    unsigned int n_attrs;
} fake_config;
int cuLaunchKernelEx(const fake_config *c, void *f, void **params, void **extra) {
    if (light) {
        state[0]++;
        return launch_status;
    }
    record_launch(3, f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->shared, c->stream, params, extra);
    for (unsigned int i = 0; i < c->n_attrs; i++)
        if (c->attrs[i].id == 6 && c->attrs[i].value.programmatic)
            launch_log[8 * ((n_launches - 1) & 63) + 7] = 1;
    return launch_status;
}
/* an application's own device memory: host memory (calloc), copies are memcpy, nothing to wait for */
int cuCtxSetCurrent(void *ctx) { current = ctx; return 0; }
int cuMemAlloc_v2(uint64_t *ptr, size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    *ptr = (uint64_t)(uintptr_t)p;
    return p == NULL ? 2 : 0;
}
int cuMemFree_v2(uint64_t ptr) { free((void *)(uintptr_t)ptr); return 0; }
int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t bytes) {
    memcpy((void *)(uintptr_t)dst, src, bytes);
    return 0;
}
int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t bytes) {
    memcpy(dst, (const void *)(uintptr_t)src, bytes);
    return 0;
}
int cuCtxSynchronize(void) { return 0; }
"""

CDEF = """
int fake_configure(int n, const int *param_sizes, int status);
void fake_set_driver_version(int version);
void fake_set_current(uintptr_t ctx);
void fake_set_encode_status(int status);
int fake_encodes(int64_t *out);
void fake_set_alloc_status(int status);
void fake_set_light(int on);
"""
FAKE_SMS = 132
LOGGED = ("grid_x", "grid_y", "grid_z", "block_x", "shared", "function", "context", "programmatic")
STATE = ("launches", "pushes", "pops", "grid_x", "grid_y", "grid_z", "block_x", "block_yz", "shared", "stream",
         "function", "context", "extra_null")


def build(directory: Path) -> Path | None:
    """Compile the fake into ``directory``; None when there is no C compiler."""
    return compile_library(directory, "fakecuda", SOURCE)


class Fake(FakeDriver):
    """The loaded fake: configure it, read back the last launch."""

    CDEF = CDEF
    STATE = STATE
    LOGGED = LOGGED
    PLACE = "context"

    def configure(self, sizes: list[int], status: int = 0) -> None:
        assert self.lib.fake_configure(len(sizes), self.ffi.new("int[]", sizes or [0]), status) == 0
        self.sizes = sizes

    def set_driver_version(self, version: int) -> None:
        """What cuDriverGetVersion says (13000, CUDA 13.0, until set)."""
        self.lib.fake_set_driver_version(version)

    def set_current(self, ctx: int) -> None:
        self.lib.fake_set_current(ctx)

    def set_encode_status(self, status: int) -> None:
        """Make cuTensorMapEncodeTiled fail with ``status`` (0: succeed) until the next ``configure``."""
        self.lib.fake_set_encode_status(status)

    def set_alloc_status(self, status: int) -> None:
        """Make cuMemAllocAsync fail with ``status`` (0: succeed) until the next ``configure``."""
        self.lib.fake_set_alloc_status(status)

    def encodes(self) -> tuple[int, list[dict[str, Any]]]:
        """(cuTensorMapEncodeTiled calls since ``configure``, the last 16 calls' arguments, oldest first)."""
        raw = self.ffi.new("int64_t[]", 16 * 32)
        count = self.lib.fake_encodes(raw)
        calls = []
        for rec in last_records(raw, count, 32, 16):
            rank = rec[1]
            calls.append({"dtype": rec[0], "rank": rank, "address": rec[2], "interleave": rec[3], "swizzle": rec[4],
                          "l2": rec[5], "oob": rec[6], "map_align": rec[7], "dims": rec[8:8 + rank],
                          "strides": rec[13:13 + rank - 1], "box": rec[18:18 + rank],
                          "element_strides": rec[23:23 + rank]})
        return count, calls


def fake_map(dtype: int, rank: int, address: int, dims: list[int], strides: list[int], box: list[int],
             element_strides: list[int], interleave: int, swizzle: int, l2: int, oob: int) -> bytes:
    """The 128 bytes the fake cuTensorMapEncodeTiled writes for these arguments (innermost first)."""
    m = bytearray(128)
    m[0:6] = bytes((dtype, rank, interleave, swizzle, l2, oob))
    m[6:6 + rank] = bytes(element_strides)
    m[16:24] = struct.pack("<Q", address)
    for i in range(rank):
        m[24 + 8 * i:32 + 8 * i] = struct.pack("<Q", dims[i])
        m[96 + 4 * i:100 + 4 * i] = struct.pack("<I", box[i])
    for i in range(rank - 1):
        m[64 + 8 * i:72 + 8 * i] = struct.pack("<Q", strides[i])
    m[124:128] = b"FAKE"
    return bytes(m)
