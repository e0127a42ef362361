"""Build the compiled launch helper: ``python -m lazytriton.driver.fastlaunch_build``.

The helper is a cffi API-mode extension module (``lazytriton.driver._fastlaunch``),
compiled the way ``capi/build.py`` compiles liblazytriton: cffi, setuptools and
a C compiler, no CUDA headers (the driver's functions reach it as pointers).
It exists because cffi's ABI mode converts each of a launch's arguments
through libffi (about 6.7 µs of a 19.7 µs warm call on the H200 host); in the
helper one C call takes the argument tuple, builds the ``void *params[]``
array on its stack from the kernel's slot layout, checks the context and
calls ``cuLaunchKernel``.

The module is written into this package's folder (next to this file), as an
install step would: the runtime imports it from there only, never from a
cache or shared folder. Without it, launches take the ABI-mode path
(``lazytriton.driver.fastlaunch`` decides).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

MODULE = "lazytriton.driver._fastlaunch"

CDEF = """
typedef int (*lt_cu_launch_t)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, uintptr_t, void **, void **);
typedef int (*lt_cu_ctx_get_t)(void **);
typedef int (*lt_cu_ctx_push_t)(void *);
typedef int (*lt_cu_ctx_pop_t)(void **);
typedef struct {
    lt_cu_launch_t launch;
    lt_cu_ctx_get_t ctx_get_current;
    lt_cu_ctx_push_t ctx_push;
    lt_cu_ctx_pop_t ctx_pop;
} lt_fast_driver;

#define LT_FAST_MAX_PARAMS 512
#define LT_FAST_NULL_SLOT -32768
#define LT_FAST_BAD_LAYOUT -1
#define LT_FAST_BAD_INT_SLOT -2
#define LT_FAST_BAD_FLOAT_SLOT -3
#define LT_FAST_BAD_COUNT -4
#define LT_FAST_PUSH_FAILED 16777216

int lt_fast_launch(const lt_fast_driver *driver, uintptr_t function, uintptr_t context, uint32_t block,
                   uint32_t shared, const int16_t *layout, int32_t n_params, int32_t want_ints, int32_t want_floats,
                   uint32_t grid_x, uint32_t grid_y, uint32_t grid_z, uintptr_t stream, const int64_t *ints,
                   int32_t n_ints, const float *floats, int32_t n_floats);
"""

C_SOURCE = r"""
#include <stdint.h>
#include <stddef.h>

typedef int (*lt_cu_launch_t)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, uintptr_t, void **, void **);
typedef int (*lt_cu_ctx_get_t)(void **);
typedef int (*lt_cu_ctx_push_t)(void *);
typedef int (*lt_cu_ctx_pop_t)(void **);
typedef struct {
    lt_cu_launch_t launch;
    lt_cu_ctx_get_t ctx_get_current;
    lt_cu_ctx_push_t ctx_push;
    lt_cu_ctx_pop_t ctx_pop;
} lt_fast_driver;

#define LT_FAST_MAX_PARAMS 512
#define LT_FAST_NULL_SLOT -32768
#define LT_FAST_BAD_LAYOUT -1
#define LT_FAST_BAD_INT_SLOT -2
#define LT_FAST_BAD_FLOAT_SLOT -3
#define LT_FAST_BAD_COUNT -4
#define LT_FAST_PUSH_FAILED 16777216

/* layout[i] says where kernel parameter i lives: >= 0 an index into ints (pointers and integers,
   8 bytes each; the driver reads 4 of an i32, the low half on little-endian hosts), -1 - j the
   float floats[j], LT_FAST_NULL_SLOT a NULL pointer (a hidden scratch parameter of size 0).
   The argument counts must be the layout's (want_ints, want_floats), and every index is checked
   against them: a tuple of the wrong length gives an error, never a wild read. */
static int lt_fast_launch(const lt_fast_driver *driver, uintptr_t function, uintptr_t context, uint32_t block,
                          uint32_t shared, const int16_t *layout, int32_t n_params, int32_t want_ints,
                          int32_t want_floats, uint32_t grid_x, uint32_t grid_y, uint32_t grid_z, uintptr_t stream,
                          const int64_t *ints, int32_t n_ints, const float *floats, int32_t n_floats) {
    static const int64_t null_value = 0;
    void *params[LT_FAST_MAX_PARAMS];
    if (driver == NULL || layout == NULL || n_params < 0 || n_params > LT_FAST_MAX_PARAMS)
        return LT_FAST_BAD_LAYOUT;
    if (n_ints != want_ints || n_floats != want_floats)
        return LT_FAST_BAD_COUNT;
    for (int32_t i = 0; i < n_params; i++) {
        int32_t slot = layout[i];
        if (slot >= 0) {
            if (slot >= n_ints)
                return LT_FAST_BAD_INT_SLOT;
            params[i] = (void *)&ints[slot];
        } else if (slot == LT_FAST_NULL_SLOT) {
            params[i] = (void *)&null_value;
        } else {
            if (-1 - slot >= n_floats)
                return LT_FAST_BAD_FLOAT_SLOT;
            params[i] = (void *)&floats[-1 - slot];
        }
    }
    void *current = NULL;
    driver->ctx_get_current(&current);
    int pushed = current != (void *)context; /* a function runs only in the context it was loaded in */
    if (pushed) {
        int status = driver->ctx_push((void *)context);
        if (status != 0)
            return LT_FAST_PUSH_FAILED + status;
    }
    int status = driver->launch((void *)function, grid_x, grid_y, grid_z, block, 1, 1, shared, stream, params,
                                NULL);
    if (pushed)
        driver->ctx_pop(&current);
    return status;
}
"""


def make_builder() -> object:
    """The cffi FFI builder of the helper module."""
    from cffi import FFI

    builder = FFI()
    builder.cdef(CDEF)
    builder.set_source(MODULE, C_SOURCE, extra_compile_args=["-O2", "-std=gnu11", "-Wall"])
    return builder


def build(directory: Path | None = None, verbose: bool = False) -> Path:
    """Compile the helper and install it into ``directory`` (default: this package's folder); its path.

    The file is written beside its final name and renamed (a running process
    keeps the module it loaded).
    """
    target_dir = Path(directory) if directory is not None else Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="lazytriton-fastlaunch-") as tmp:
        builder = make_builder()
        built = Path(builder.compile(tmpdir=tmp, verbose=verbose))  # type: ignore[attr-defined]
        target = target_dir / built.name
        fd, partial = tempfile.mkstemp(prefix=f".{built.name}.", dir=target_dir)
        try:
            with os.fdopen(fd, "wb") as out, open(built, "rb") as src:
                shutil.copyfileobj(src, out)
            os.chmod(partial, 0o755)
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    return target


def main() -> int:
    print(build(verbose="-v" in sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
