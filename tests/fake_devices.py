"""A fake libcuda of several devices, for CPU tests of which context a kernel is loaded and launched in.

tests/fake_libcuda.py records the bytes a launch passes, with one current
context for the whole process. This one models what the device tests need
instead, as the real driver behaves:

- a primary context per device (``context(d)``), and a stack of current
  contexts per thread (``cuCtxPushCurrent``/``cuCtxPopCurrent``; ``set_current``
  replaces its top, as ``cudaSetDevice`` does for torch);
- ``cuModuleLoadData`` loads into the calling thread's current context (none:
  CUDA_ERROR_INVALID_CONTEXT) and the module's functions belong to that context;
- ``cuLaunchKernel`` fails with CUDA_ERROR_INVALID_HANDLE when the function
  or the stream (``stream(d, n)``: a stream handle of device d) belongs to
  another device than the current context's, and with
  CUDA_ERROR_INVALID_CONTEXT when no context is current;
- every launch is logged under a lock (threads launch at once), with the
  calling thread's tag (``set_tag``), the devices of the function, the
  current context and the stream, the grid's x and the status.

Built with the system C compiler into a test's temporary folder (tests skip
without one).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
MAX_SHARED_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
CONTEXT_BASE = 0xC0000  # device d's primary context is CONTEXT_BASE + d
STREAM_BASE = 0x50000  # stream n of device d is STREAM_BASE | d << 8 | n
MAX_LOG = 8192

SOURCE = r"""
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEVICES 8
#define MAX_MODULES 1024
#define MAX_LOG 8192
#define CONTEXT_BASE 0xC0000
#define MODULE_BASE 0xA00000
#define FUNCTION_BASE 0xF00000
#define STREAM_BASE 0x50000
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define INVALID_HANDLE 400

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int n_devices = 2;
static int optin[MAX_DEVICES];
static int module_device[MAX_MODULES];
static int n_modules;
static int64_t records[MAX_LOG][7];
static int n_records;
static int64_t counts[4]; /* retains, pushes, pops, launch errors */
static int yield_in_launch;
static __thread void *stack[16];
static __thread int depth;
static __thread int64_t tag;

static int context_device(void *ctx) {
    uintptr_t c = (uintptr_t)ctx;
    return c >= CONTEXT_BASE && c < CONTEXT_BASE + (uintptr_t)n_devices ? (int)(c - CONTEXT_BASE) : -1;
}
static void *current(void) { return depth > 0 ? stack[depth - 1] : NULL; }
/* The device of the module a module or function handle belongs to; -1: not a handle the fake gave out. */
static int device_of(uintptr_t handle, uintptr_t base) {
    if (handle < base || (handle - base) % 16 != 0) return -1;
    uintptr_t i = (handle - base) / 16;
    pthread_mutex_lock(&lock);
    int device = i < (uintptr_t)n_modules ? module_device[i] : -1;
    pthread_mutex_unlock(&lock);
    return device;
}

int fake_configure(int devices, const int *shared_optin, int yield) {
    if (devices < 1 || devices > MAX_DEVICES) return -1;
    pthread_mutex_lock(&lock);
    n_devices = devices;
    memcpy(optin, shared_optin, sizeof(int) * (size_t)devices);
    n_modules = 0;
    n_records = 0;
    memset(counts, 0, sizeof counts);
    yield_in_launch = yield;
    pthread_mutex_unlock(&lock);
    depth = 0;
    tag = 0;
    return 0;
}
void fake_set_current(uintptr_t ctx) {
    if (ctx == 0) depth = 0;
    else if (depth == 0) stack[depth++] = (void *)ctx;
    else stack[depth - 1] = (void *)ctx;
}
uintptr_t fake_current(void) { return (uintptr_t)current(); }
int fake_depth(void) { return depth; }
void fake_set_tag(int64_t value) { tag = value; }
int fake_modules(int *out) {
    pthread_mutex_lock(&lock);
    int n = n_modules;
    memcpy(out, module_device, sizeof(int) * (size_t)n);
    pthread_mutex_unlock(&lock);
    return n;
}
int fake_records(int64_t *out, int64_t *out_counts) {
    pthread_mutex_lock(&lock);
    int n = n_records;
    memcpy(out, records, sizeof(records[0]) * (size_t)n);
    memcpy(out_counts, counts, sizeof counts);
    pthread_mutex_unlock(&lock);
    return n;
}

int cuInit(unsigned int flags) { return 0; }
int cuDeviceGet(int *device, int ordinal) {
    if (ordinal < 0 || ordinal >= n_devices) return INVALID_DEVICE;
    *device = ordinal;
    return 0;
}
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    if (device < 0 || device >= n_devices) return INVALID_DEVICE;
    *value = attribute == 97 ? optin[device] : attribute == 75 ? 9 : 0; /* 75, 76: compute capability 9.0 */
    return 0;
}
int cuDevicePrimaryCtxRetain(void **ctx, int device) {
    if (device < 0 || device >= n_devices) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    counts[0]++;
    pthread_mutex_unlock(&lock);
    *ctx = (void *)(uintptr_t)(CONTEXT_BASE + device);
    return 0;
}
int cuCtxGetCurrent(void **ctx) { *ctx = current(); return 0; }
int cuCtxPushCurrent_v2(void *ctx) {
    if (context_device(ctx) < 0 || depth == 16) return INVALID_CONTEXT;
    stack[depth++] = ctx;
    pthread_mutex_lock(&lock);
    counts[1]++;
    pthread_mutex_unlock(&lock);
    return 0;
}
int cuCtxPopCurrent_v2(void **ctx) {
    if (depth == 0) return INVALID_CONTEXT;
    if (ctx) *ctx = stack[depth - 1];
    depth--;
    pthread_mutex_lock(&lock);
    counts[2]++;
    pthread_mutex_unlock(&lock);
    return 0;
}
int cuModuleLoadData(void **module, const void *image) {
    int device = context_device(current());
    if (device < 0) return INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    int i = n_modules < MAX_MODULES ? n_modules++ : -1;
    if (i >= 0) module_device[i] = device;
    pthread_mutex_unlock(&lock);
    if (i < 0) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *module = (void *)(uintptr_t)(MODULE_BASE + 16 * i);
    return 0;
}
int cuModuleGetFunction(void **function, void *module, const char *name) {
    int device = device_of((uintptr_t)module, MODULE_BASE);
    if (device < 0) return INVALID_HANDLE;
    if (context_device(current()) != device) return INVALID_CONTEXT;
    *function = (void *)(uintptr_t)(FUNCTION_BASE + ((uintptr_t)module - MODULE_BASE));
    return 0;
}
int cuFuncSetAttribute(void *function, int attribute, int value) {
    return device_of((uintptr_t)function, FUNCTION_BASE) < 0 ? INVALID_HANDLE : 0;
}
int cuGetErrorString(int error, const char **text) { *text = "fake error"; return 0; }
int cuTensorMapEncodeTiled(void *map, int dtype, uint32_t rank, void *address, const uint64_t *dims,
                           const uint64_t *strides, const uint32_t *box, const uint32_t *element_strides,
                           int interleave, int swizzle, int l2, int oob) {
    memset(map, 0, 128);
    return 0;
}
int cuLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                   unsigned int bz, unsigned int shared, uintptr_t stream, void **params, void **extra) {
    int device = context_device(current());
    int function_device = device_of((uintptr_t)f, FUNCTION_BASE);
    int stream_device = stream == 0 ? device
                        : (stream & ~(uintptr_t)0xffff) == STREAM_BASE ? (int)((stream >> 8) & 0xff) : -1;
    int status = device < 0 ? INVALID_CONTEXT
                 : function_device != device || stream_device != device ? INVALID_HANDLE : 0;
    if (yield_in_launch) sched_yield(); /* lets the other thread run between a push and its pop */
    pthread_mutex_lock(&lock);
    if (n_records < MAX_LOG) {
        int64_t *r = records[n_records++];
        r[0] = tag; r[1] = function_device; r[2] = device; r[3] = (int64_t)stream; r[4] = gx; r[5] = status;
        r[6] = depth;
    }
    if (status) counts[3]++;
    pthread_mutex_unlock(&lock);
    return status;
}
"""

CDEF = """
int fake_configure(int devices, const int *shared_optin, int yield);
void fake_set_current(uintptr_t ctx);
uintptr_t fake_current(void);
int fake_depth(void);
void fake_set_tag(int64_t value);
int fake_modules(int *out);
int fake_records(int64_t *out, int64_t *out_counts);
int cuCtxPushCurrent_v2(void *ctx);
int cuCtxPopCurrent_v2(void **ctx);
int cuModuleLoadData(void **module, const void *image);
int cuModuleGetFunction(void **function, void *module, const char *name);
int cuLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                   unsigned int bz, unsigned int shared, uintptr_t stream, void **params, void **extra);
"""

RECORD = ("tag", "function_device", "context_device", "stream", "grid_x", "status", "depth")
COUNTS = ("retains", "pushes", "pops", "launch_errors")


def build(directory: Path) -> Path | None:
    """Compile the fake into ``directory``; None when there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = directory / "fake_devices.c"
    source.write_text(SOURCE)
    library = directory / "libfakedevices.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(library), str(source)], check=True)
    return library


def context(device: int) -> int:
    """The handle of device ``device``'s primary context."""
    return CONTEXT_BASE + device


def stream(device: int, n: int = 1) -> int:
    """A stream handle of device ``device`` (n: 1..255, to tell several apart)."""
    return STREAM_BASE | device << 8 | n


class FakeDevices:
    """The loaded fake: configure it, set the calling thread's current context, read back loads and launches."""

    def __init__(self, library: Path) -> None:
        from cffi import FFI

        self.ffi = FFI()
        self.ffi.cdef(CDEF)
        self.lib = self.ffi.dlopen(str(library))

    def configure(self, shared_optin: list[int], yield_in_launch: bool = False) -> None:
        """As many devices as ``shared_optin`` has items (their opt-in shared memory); clears every record.

        Resets the calling thread's context stack; other threads keep theirs.
        """
        assert self.lib.fake_configure(len(shared_optin), self.ffi.new("int[]", shared_optin),
                                       int(yield_in_launch)) == 0

    def set_current(self, ctx: int) -> None:
        """Make ``ctx`` the calling thread's current context (0: none), as cudaSetDevice/cuCtxSetCurrent do."""
        self.lib.fake_set_current(ctx)

    def current(self) -> int:
        """The calling thread's current context (0: none)."""
        return int(self.lib.fake_current())

    def depth(self) -> int:
        """How many contexts the calling thread's stack holds."""
        return int(self.lib.fake_depth())

    def set_tag(self, value: int) -> None:
        """A number logged with each launch the calling thread makes."""
        self.lib.fake_set_tag(value)

    def modules(self) -> list[int]:
        """The device each module loaded since ``configure`` was loaded on, in load order."""
        out = self.ffi.new("int[]", 1024)
        return [int(out[i]) for i in range(self.lib.fake_modules(out))]

    def launches(self) -> list[dict[str, int]]:
        """Each launch since ``configure``, in the order they reached the driver (see RECORD)."""
        raw = self.ffi.new("int64_t[]", MAX_LOG * len(RECORD))
        counts = self.ffi.new("int64_t[]", len(COUNTS))
        n = self.lib.fake_records(raw, counts)
        return [{name: int(raw[len(RECORD) * i + j]) for j, name in enumerate(RECORD)} for i in range(n)]

    def counts(self) -> dict[str, int]:
        """Primary-context retains, pushes, pops and failed launches since ``configure``, all threads together."""
        raw = self.ffi.new("int64_t[]", MAX_LOG * len(RECORD))
        counts = self.ffi.new("int64_t[]", len(COUNTS))
        self.lib.fake_records(raw, counts)
        return {name: int(counts[i]) for i, name in enumerate(COUNTS)}

    def launch_raw(self, function: int, stream_handle: int) -> int:
        """cuLaunchKernel of ``function`` on ``stream_handle`` from the calling thread, no parameters: its status."""
        return int(self.lib.cuLaunchKernel(self.ffi.cast("void *", function), 1, 1, 1, 32, 1, 1, 0, stream_handle,
                                           self.ffi.NULL, self.ffi.NULL))

    def load_raw(self) -> tuple[int, int]:
        """(status, function) of cuModuleLoadData + cuModuleGetFunction in the calling thread's current context."""
        module = self.ffi.new("void **")
        status = int(self.lib.cuModuleLoadData(module, self.ffi.new("char[]", b"\x7fELF")))
        if status:
            return status, 0
        function = self.ffi.new("void **")
        status = int(self.lib.cuModuleGetFunction(function, module[0], b"k"))
        return status, int(self.ffi.cast("uintptr_t", function[0]))

    def push(self, ctx: int) -> int:
        return int(self.lib.cuCtxPushCurrent_v2(self.ffi.cast("void *", ctx)))

    def pop(self) -> int:
        return int(self.lib.cuCtxPopCurrent_v2(self.ffi.NULL))


def as_int(handle: Any, ffi: Any) -> int:
    """A cffi pointer (a CUfunction) as an int."""
    return int(ffi.cast("uintptr_t", handle))
