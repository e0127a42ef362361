"""A fake libcuda for CPU tests of the launch paths: it records what cuLaunchKernel would read.

Built with the system C compiler into a test's temporary folder (tests skip
without one). ``configure(sizes)`` says how many bytes the fake reads behind
each parameter pointer; ``last_launch()`` returns them with the grid, block,
shared memory, stream, function and the context current during the launch.
Each parameter is read into its own 128-byte record (a host descriptor's
CUtensorMap is 128 bytes), with the pointer's address modulo 64.

Every launch since ``configure`` is also logged (``launch_log``: grid, block, shared memory, function), so a
call of several kernels (decoding: kv_append, the split and the combine kernel) can be followed launch by launch.
The device has compute capability 9.0 and ``FAKE_SMS`` SMs.

``cuMemAllocAsync`` and ``cuMemFreeAsync`` (a launcher's scratch memory) are faked too: an allocation gets
the next of a series of 4 KiB-aligned addresses from ``SCRATCH_BASE``, and each call is logged
(``allocations()``: the call, bytes, address, stream, the context current then, and the launches before it).

``fake_set_light(1)`` makes cuLaunchKernel only count its calls (a benchmark's floor: the host cost of its
caller, not of the fake's record).

``cuTensorMapEncodeTiled`` is faked too: it counts its calls, records the
last call's arguments (``encodes()``) and writes a map that is a fixed
serialisation of those arguments (``fake_map``): two maps are equal exactly
when they were encoded from the same arguments.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

SOURCE = r"""
#include <stdint.h>
#include <string.h>

static int n_sizes;
static int sizes[1024];
static unsigned char seen[128 * 1024];
static int seen_null[1024];
static int seen_align[1024];
static int64_t encodes[16 * 32];
static int n_encodes;
static int encode_status;
static int64_t state[16];
static void *stack[8];
static int depth;
static void *current;
static int launch_status;
static int64_t launch_log[64 * 8];
static int n_logged;
static int64_t alloc_log[64 * 6];
static int n_allocs, alloc_status;
static uint64_t next_scratch = 0x5C0000000000ull;
static int light; /* cuLaunchKernel only counts (benchmarks: the host cost of what calls it) */
void fake_set_light(int on) { light = on; }

int fake_configure(int n, const int *param_sizes, int status) {
    if (n < 0 || n > 1024) return -1;
    n_sizes = n;
    memcpy(sizes, param_sizes, sizeof(int) * (size_t)n);
    launch_status = status;
    memset(state, 0, sizeof state);
    current = NULL;
    depth = 0;
    n_encodes = 0;
    encode_status = 0;
    n_logged = 0;
    n_allocs = 0;
    alloc_status = 0;
    next_scratch = 0x5C0000000000ull;
    return 0;
}
void fake_set_alloc_status(int status) { alloc_status = status; }
int fake_allocations(int64_t *out) { memcpy(out, alloc_log, sizeof alloc_log); return n_allocs; }
static void log_alloc(int64_t call, int64_t bytes, uint64_t address, uintptr_t stream) {
    int64_t *rec = alloc_log + 6 * (n_allocs & 63);
    n_allocs++;
    rec[0] = call; rec[1] = bytes; rec[2] = (int64_t)address; rec[3] = (int64_t)stream;
    rec[4] = (int64_t)(uintptr_t)current; rec[5] = state[0];
}
/* call 1: an allocation (4 KiB-aligned addresses, one after the other), 2: a free */
int cuMemAllocAsync(uint64_t *ptr, size_t bytes, uintptr_t stream) {
    log_alloc(1, (int64_t)bytes, alloc_status ? 0 : next_scratch, stream);
    if (alloc_status) return alloc_status;
    *ptr = next_scratch;
    next_scratch += (bytes + 4095) / 4096 * 4096 + 4096;
    return 0;
}
int cuMemFreeAsync(uint64_t ptr, uintptr_t stream) { log_alloc(2, 0, ptr, stream); return 0; }
int fake_launch_log(int64_t *out) { memcpy(out, launch_log, sizeof launch_log); return n_logged; }
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
void fake_read(unsigned char *out, int *nulls, int64_t *out_state, int *aligns) {
    memcpy(out, seen, sizeof seen);
    memcpy(nulls, seen_null, sizeof seen_null);
    memcpy(aligns, seen_align, sizeof seen_align);
    memcpy(out_state, state, sizeof state);
}

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
int cuModuleLoadData(void **module, const void *image) { *module = (void *)0xA000; return 0; }
int cuModuleGetFunction(void **function, void *module, const char *name) { *function = (void *)0xF000; return 0; }
int cuFuncSetAttribute(void *function, int attribute, int value) { return 0; }
int cuGetErrorString(int error, const char **text) { *text = "fake error"; return 0; }
int cuLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                   unsigned int bz, unsigned int shared, uintptr_t stream, void **params, void **extra) {
    state[0]++;
    if (light) return launch_status;
    state[3] = gx; state[4] = gy; state[5] = gz; state[6] = bx; state[7] = by * 1000 + bz; state[8] = shared;
    state[9] = (int64_t)stream; state[10] = (int64_t)(uintptr_t)f; state[11] = (int64_t)(uintptr_t)current;
    state[12] = extra == NULL;
    int64_t *log = launch_log + 8 * (n_logged & 63);
    n_logged++;
    log[0] = gx; log[1] = gy; log[2] = gz; log[3] = bx; log[4] = shared; log[5] = (int64_t)(uintptr_t)f;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < n_sizes; i++) {
        seen_null[i] = params[i] == NULL;
        seen_align[i] = (int)((uintptr_t)params[i] % 64);
        if (params[i] != NULL) memcpy(seen + 128 * i, params[i], (size_t)sizes[i]);
    }
    return launch_status;
}
"""

CDEF = """
int fake_configure(int n, const int *param_sizes, int status);
void fake_set_current(uintptr_t ctx);
void fake_read(unsigned char *out, int *nulls, int64_t *out_state, int *aligns);
void fake_set_encode_status(int status);
int fake_encodes(int64_t *out);
int fake_launch_log(int64_t *out);
void fake_set_alloc_status(int status);
int fake_allocations(int64_t *out);
void fake_set_light(int on);
"""
SCRATCH_BASE = 0x5C0000000000
FAKE_SMS = 132
LOGGED = ("grid_x", "grid_y", "grid_z", "block_x", "shared", "function")

STATE = ("launches", "pushes", "pops", "grid_x", "grid_y", "grid_z", "block_x", "block_yz", "shared", "stream",
         "function", "context", "extra_null")


def compile_library(directory: Path, stem: str, source_text: str) -> Path | None:
    """``source_text`` compiled into ``directory``/lib``stem``.so (a fake driver); None when there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = directory / f"{stem}.c"
    source.write_text(source_text)
    library = directory / f"lib{stem}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return library


def build(directory: Path) -> Path | None:
    """Compile the fake into ``directory``; None when there is no C compiler."""
    return compile_library(directory, "fakecuda", SOURCE)


class Fake:
    """The loaded fake: configure it, read back the last launch."""

    def __init__(self, library: Path) -> None:
        from cffi import FFI

        self.ffi = FFI()
        self.ffi.cdef(CDEF)
        self.lib = self.ffi.dlopen(str(library))

    def configure(self, sizes: list[int], status: int = 0) -> None:
        assert self.lib.fake_configure(len(sizes), self.ffi.new("int[]", sizes or [0]), status) == 0
        self.sizes = sizes

    def set_current(self, ctx: int) -> None:
        self.lib.fake_set_current(ctx)

    def set_encode_status(self, status: int) -> None:
        """Make cuTensorMapEncodeTiled fail with ``status`` (0: succeed) until the next ``configure``."""
        self.lib.fake_set_encode_status(status)

    def last_launch(self, aligns: list[int] | None = None) -> tuple[list[Any], dict[str, int]]:
        """(each parameter's bytes, or None for a NULL pointer; the launch's state by name).

        ``aligns``, when given, receives each parameter pointer's address modulo 64.
        """
        raw = self.ffi.new("unsigned char[]", 128 * 1024)
        nulls = self.ffi.new("int[]", 1024)
        state = self.ffi.new("int64_t[]", 16)
        align = self.ffi.new("int[]", 1024)
        self.lib.fake_read(raw, nulls, state, align)
        data = bytes(self.ffi.buffer(raw))
        params = [None if nulls[i] else data[128 * i:128 * i + size] for i, size in enumerate(self.sizes)]
        if aligns is not None:
            aligns[:] = [int(align[i]) for i in range(len(self.sizes))]
        return params, {name: int(state[i]) for i, name in enumerate(STATE)}

    def launch_log(self) -> list[dict[str, int]]:
        """The launches since ``configure`` (the last 64), oldest first: grid, block, shared memory, function."""
        raw = self.ffi.new("int64_t[]", 64 * 8)
        count = self.lib.fake_launch_log(raw)
        return [{name: int(raw[8 * (n & 63) + i]) for i, name in enumerate(LOGGED)}
                for n in range(max(0, count - 64), count)]

    def set_alloc_status(self, status: int) -> None:
        """Make cuMemAllocAsync fail with ``status`` (0: succeed) until the next ``configure``."""
        self.lib.fake_set_alloc_status(status)

    def allocations(self) -> list[dict[str, Any]]:
        """cuMemAllocAsync and cuMemFreeAsync calls since ``configure`` (the last 64), oldest first."""
        raw = self.ffi.new("int64_t[]", 64 * 6)
        count = self.lib.fake_allocations(raw)
        names = ("call", "bytes", "address", "stream", "context", "launches_before")
        calls = []
        for n in range(max(0, count - 64), count):
            rec = {name: int(raw[6 * (n & 63) + i]) for i, name in enumerate(names)}
            rec["call"] = {1: "alloc", 2: "free"}[rec["call"]]
            calls.append(rec)
        return calls

    def encodes(self) -> tuple[int, list[dict[str, Any]]]:
        """(cuTensorMapEncodeTiled calls since ``configure``, the last 16 calls' arguments, oldest first)."""
        raw = self.ffi.new("int64_t[]", 16 * 32)
        count = self.lib.fake_encodes(raw)
        calls = []
        for n in range(max(0, count - 16), count):
            rec = [int(raw[32 * (n & 15) + j]) for j in range(32)]
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
