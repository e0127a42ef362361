"""A fake libcuda for CPU tests of the launch paths: it records what cuLaunchKernel would read.

Built with the system C compiler into a test's temporary folder (tests skip
without one). ``configure(sizes)`` says how many bytes the fake reads behind
each parameter pointer; ``last_launch()`` returns them with the grid, block,
shared memory, stream, function and the context current during the launch.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

SOURCE = r"""
#include <stdint.h>
#include <string.h>

static int n_sizes;
static int sizes[1024];
static unsigned char seen[8 * 1024];
static int seen_null[1024];
static int64_t state[16];
static void *stack[8];
static int depth;
static void *current;
static int launch_status;

int fake_configure(int n, const int *param_sizes, int status) {
    if (n < 0 || n > 1024) return -1;
    n_sizes = n;
    memcpy(sizes, param_sizes, sizeof(int) * (size_t)n);
    launch_status = status;
    memset(state, 0, sizeof state);
    current = NULL;
    depth = 0;
    return 0;
}
void fake_set_current(uintptr_t ctx) { current = (void *)ctx; }
void fake_read(unsigned char *out, int *nulls, int64_t *out_state) {
    memcpy(out, seen, sizeof seen);
    memcpy(nulls, seen_null, sizeof seen_null);
    memcpy(out_state, state, sizeof state);
}

int cuInit(unsigned int flags) { return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) { *value = 232448; return 0; }
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
    state[3] = gx; state[4] = gy; state[5] = gz; state[6] = bx; state[7] = by * 1000 + bz; state[8] = shared;
    state[9] = (int64_t)stream; state[10] = (int64_t)(uintptr_t)f; state[11] = (int64_t)(uintptr_t)current;
    state[12] = extra == NULL;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < n_sizes; i++) {
        seen_null[i] = params[i] == NULL;
        if (params[i] != NULL) memcpy(seen + 8 * i, params[i], (size_t)sizes[i]);
    }
    return launch_status;
}
"""

CDEF = """
int fake_configure(int n, const int *param_sizes, int status);
void fake_set_current(uintptr_t ctx);
void fake_read(unsigned char *out, int *nulls, int64_t *out_state);
"""

STATE = ("launches", "pushes", "pops", "grid_x", "grid_y", "grid_z", "block_x", "block_yz", "shared", "stream",
         "function", "context", "extra_null")


def build(directory: Path) -> Path | None:
    """Compile the fake into ``directory``; None when there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = directory / "fake_libcuda.c"
    source.write_text(SOURCE)
    library = directory / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return library


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

    def last_launch(self) -> tuple[list[Any], dict[str, int]]:
        """(each parameter's bytes, or None for a NULL pointer; the launch's state by name)."""
        raw = self.ffi.new("unsigned char[]", 8 * 1024)
        nulls = self.ffi.new("int[]", 1024)
        state = self.ffi.new("int64_t[]", 16)
        self.lib.fake_read(raw, nulls, state)
        data = bytes(self.ffi.buffer(raw))
        params = [None if nulls[i] else data[8 * i:8 * i + size] for i, size in enumerate(self.sizes)]
        return params, {name: int(state[i]) for i, name in enumerate(STATE)}
