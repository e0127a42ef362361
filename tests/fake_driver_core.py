"""What the fake GPU drivers share (tests/fake_libcuda.py, tests/fake_libhip.py): the record of a launch, the
logs, the scratch allocator, the module loads, the build and the Python reader.

A fake's C source is ``CORE_SOURCE`` followed by its own API: the API's functions call the core's
``core_configure``, ``record_launch``, ``scratch_alloc``/``scratch_free`` and ``load_module``/``get_function``,
and the fake defines ``current_place()``: the context (CUDA) or device (HIP) current during a call, which the
launch, allocation and load records hold. The core exports the readers (``CORE_CDEF``): ``fake_read`` (the last
launch: each parameter's first bytes in its own 128-byte record, NULL-ness and address modulo 64, and the state
counters), ``fake_launch_log``, ``fake_allocations`` and ``fake_loads``; every log keeps the last 64 calls since
the fake was configured.

``FakeDriver`` is the Python side: a fake's class names its API's declarations (``CDEF``), the order of its
state counters (``STATE``), the launch log's fields (``LOGGED``) and its word for the current place (``PLACE``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, ClassVar

SCRATCH_BASE = 0x5C0000000000  # the first scratch allocation's address; the next ones follow 4 KiB-aligned
MODULE_BASE = 0xA000  # load n's module handle is MODULE_BASE + n
FUNCTION = 0xF000  # every function handle

CORE_SOURCE = f"""
#define SCRATCH_BASE {SCRATCH_BASE:#x}ull
#define MODULE_BASE {MODULE_BASE:#x}
#define FUNCTION {FUNCTION:#x}
""" + r"""
#include <stdint.h>
#include <string.h>

static int64_t current_place(void); /* the fake's context (CUDA) or device (HIP) current now */

static int n_sizes, sizes[1024];
static unsigned char seen[128 * 1024];
static int seen_null[1024], seen_align[1024];
static int64_t state[16];
static int64_t launch_log[64 * 8], alloc_log[64 * 6], load_log[64 * 6];
static char load_names[64][256];
static int n_launches, n_allocs, n_loads;
static uint64_t next_scratch = SCRATCH_BASE;

/* Read sizes[i] bytes behind parameter i at each launch from now on; clear the state and the logs. */
static int core_configure(int n, const int *param_sizes) {
    if (n < 0 || n > 1024) return -1;
    n_sizes = n;
    memcpy(sizes, param_sizes, sizeof(int) * (size_t)n);
    memset(state, 0, sizeof state);
    n_launches = n_allocs = n_loads = 0;
    next_scratch = SCRATCH_BASE;
    return 0;
}

/* A launch: counted in state[0]; grid, block (y * 1000 + z), shared memory, stream, function, the place current
   and whether extra was NULL in state[at..at+9]; logged; each parameter's bytes, NULL-ness and alignment kept. */
static void record_launch(int at, void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                          unsigned int by, unsigned int bz, unsigned int shared, uintptr_t stream, void **params,
                          void **extra) {
    int64_t *s = state + at, *log = launch_log + 8 * (n_launches & 63);
    state[0]++;
    s[0] = gx; s[1] = gy; s[2] = gz; s[3] = bx; s[4] = by * 1000 + bz; s[5] = shared; s[6] = (int64_t)stream;
    s[7] = (int64_t)(uintptr_t)f; s[8] = current_place(); s[9] = extra == NULL;
    n_launches++;
    log[0] = gx; log[1] = gy; log[2] = gz; log[3] = bx; log[4] = shared; log[5] = (int64_t)(uintptr_t)f;
    log[6] = current_place(); log[7] = 0;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < n_sizes; i++) {
        seen_null[i] = params[i] == NULL;
        seen_align[i] = (int)((uintptr_t)params[i] % 64);
        if (params[i] != NULL) memcpy(seen + 128 * i, params[i], (size_t)sizes[i]);
    }
}

/* call 1: an allocation, 2: a free; with the place current and the launches before it */
static void log_alloc(int64_t call, int64_t bytes, uint64_t address, uintptr_t stream) {
    int64_t *rec = alloc_log + 6 * (n_allocs & 63);
    n_allocs++;
    rec[0] = call; rec[1] = bytes; rec[2] = (int64_t)address; rec[3] = (int64_t)stream;
    rec[4] = current_place(); rec[5] = state[0];
}
/* The next of the 4 KiB-aligned addresses from SCRATCH_BASE, one after the other; or status when it is not 0. */
static int scratch_alloc(uint64_t *ptr, size_t bytes, uintptr_t stream, int status) {
    log_alloc(1, (int64_t)bytes, status ? 0 : next_scratch, stream);
    if (status) return status;
    *ptr = next_scratch;
    next_scratch += (bytes + 4095) / 4096 * 4096 + 4096;
    return 0;
}
static int scratch_free(uint64_t ptr, uintptr_t stream) { log_alloc(2, 0, ptr, stream); return 0; }

/* A module load, logged with the place current and the image's first 4 bytes: MODULE_BASE + its number. */
static int load_module(void **module, const void *image, int status) {
    int64_t *rec = load_log + 6 * (n_loads & 63);
    uint32_t head;
    memcpy(&head, image, 4);
    memset(rec, 0, 6 * sizeof *rec);
    rec[0] = current_place(); rec[1] = head; rec[2] = MODULE_BASE + n_loads;
    n_loads++;
    if (status) return status;
    *module = (void *)(uintptr_t)rec[2];
    return 0;
}
/* A function lookup, logged on the last load: the module asked of, the place current, the name. */
static int get_function(void **function, void *module, const char *name, int status) {
    if (n_loads > 0) {
        int64_t *rec = load_log + 6 * ((n_loads - 1) & 63);
        rec[3] = (int64_t)(uintptr_t)module; rec[4] = current_place();
        strncpy(load_names[(n_loads - 1) & 63], name, 255);
    }
    if (status) return status;
    *function = (void *)FUNCTION;
    return 0;
}

void fake_read(unsigned char *out, int *nulls, int64_t *out_state, int *aligns) {
    memcpy(out, seen, sizeof seen);
    memcpy(nulls, seen_null, sizeof seen_null);
    memcpy(aligns, seen_align, sizeof seen_align);
    memcpy(out_state, state, sizeof state);
}
int fake_launch_log(int64_t *out) { memcpy(out, launch_log, sizeof launch_log); return n_launches; }
int fake_allocations(int64_t *out) { memcpy(out, alloc_log, sizeof alloc_log); return n_allocs; }
int fake_loads(int64_t *out, char *out_names) {
    memcpy(out, load_log, sizeof load_log);
    memcpy(out_names, load_names, sizeof load_names);
    return n_loads;
}
"""

CORE_CDEF = """
void fake_read(unsigned char *out, int *nulls, int64_t *out_state, int *aligns);
int fake_launch_log(int64_t *out);
int fake_allocations(int64_t *out);
int fake_loads(int64_t *out, char *out_names);
"""


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


def last_records(raw: Any, count: int, width: int, limit: int = 64) -> list[list[int]]:
    """The last ``limit`` of ``count`` records of ``width`` int64s in the ring ``raw``, oldest first."""
    return [[int(raw[width * (n % limit) + i]) for i in range(width)] for n in range(max(0, count - limit), count)]


class FakeDriver:
    """A loaded fake driver: read back its last launch and its logs."""

    CDEF: ClassVar[str]  # the fake's own functions, beside CORE_CDEF
    STATE: ClassVar[tuple[str, ...]]  # the names of state[0..]
    LOGGED: ClassVar[tuple[str, ...]]  # the names of a launch log record's fields, in order
    PLACE: ClassVar[str]  # "context" or "device": what current_place() records

    def __init__(self, library: Path) -> None:
        from cffi import FFI

        self.ffi = FFI()
        self.ffi.cdef(CORE_CDEF + self.CDEF)
        self.lib = self.ffi.dlopen(str(library))
        self.sizes: list[int] = []

    def last_launch(self, aligns: list[int] | None = None) -> tuple[list[Any], dict[str, int]]:
        """(each parameter's bytes, or None for a NULL pointer; the last launch's state by name).

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
        return params, {name: int(state[i]) for i, name in enumerate(self.STATE)}

    def launch_log(self) -> list[dict[str, int]]:
        """The launches since ``configure`` (the last 64), oldest first: grid, block, shared memory, function..."""
        raw = self.ffi.new("int64_t[]", 64 * 8)
        count = self.lib.fake_launch_log(raw)
        return [dict(zip(self.LOGGED, rec, strict=False)) for rec in last_records(raw, count, 8)]

    def allocations(self) -> list[dict[str, Any]]:
        """The scratch allocations and frees since ``configure`` (the last 64), oldest first."""
        raw = self.ffi.new("int64_t[]", 64 * 6)
        count = self.lib.fake_allocations(raw)
        names = ("call", "bytes", "address", "stream", self.PLACE, "launches_before")
        calls: list[dict[str, Any]] = []
        for rec in last_records(raw, count, 6):
            call: dict[str, Any] = dict(zip(names, rec, strict=True))
            call["call"] = {1: "alloc", 2: "free"}[call["call"]]
            calls.append(call)
        return calls

    def loads(self) -> list[dict[str, Any]]:
        """The module loads since ``configure`` (the last 64), oldest first, each with its function lookup."""
        raw = self.ffi.new("int64_t[]", 64 * 6)
        names = self.ffi.new("char[]", 64 * 256)
        count = self.lib.fake_loads(raw, names)
        fields = (self.PLACE, "head", "module", "function_of", f"function_{self.PLACE}")
        return [{**dict(zip(fields, rec, strict=False)), "name": self.ffi.string(names + 256 * (n & 63)).decode()}
                for n, rec in zip(range(max(0, count - 64), count), last_records(raw, count, 6), strict=True)]
