"""Build the compiled launch helper: ``python -m lazytriton.driver.fastlaunch_build``.

The helper is a small CPython extension module (``lazytriton.driver._fastlaunch``,
one ``METH_FASTCALL`` function), compiled by one command of the system C
compiler (``$CC``, else cc, gcc or clang) against Python's headers, with no
CUDA headers: the driver's functions reach it as addresses. It exists because cffi's ABI
mode converts each of a launch's arguments through libffi (about 6.7 µs of a
19.7 µs warm call on the H200 host). A cffi API-mode function was tried first:
its generic conversion of the 26-int tuple still cost ~2 µs a call on the CPU
machine (fake driver), against ~0.3 µs here, where one C call reads the
argument tuples with ``PyLong_AsLongLong``, builds ``void *params[]`` on its
stack from the kernel's slot layout, checks the context and calls
``cuLaunchKernel``.

This command writes the module into this package's folder (next to this
file), as an install step would; it takes precedence over a build in the
cache dir, which the runtime makes by itself in the background on first GPU
use (helpers.py). Without either, launches take the ABI-mode path
(``lazytriton.driver.fastlaunch`` decides). When the build cannot run (no C
compiler, no Python headers) it says exactly what is missing.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lazytriton import fsutil
from lazytriton.driver.cdefs import LAUNCH_CONFIG_CDEF

MODULE = "lazytriton.driver._fastlaunch"
FILE_NAME = "_fastlaunch" + importlib.machinery.EXTENSION_SUFFIXES[0]  # the name an import of MODULE finds first


class BuildError(RuntimeError):
    """What the build lacks or what the compiler said, plainly."""


# The plan a launcher holds, as ``fastlaunch.launcher`` packs it (struct "<8Q2I4i", int16 slots, then per host
# descriptor an lt_desc and, at the end, an lt_desc_cache each: the plan is then a bytearray the helper updates),
# and the launch from it: C that also compiles as C++, included by the C++ warm path (hotpath_build.py).
PLAN_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#ifdef __cplusplus
#define LT_ALIGN64 alignas(64)
#else
#define LT_ALIGN64 _Alignas(64)
#endif

typedef int (*lt_cu_launch_t)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, uintptr_t, void **, void **);
typedef int (*lt_cu_ctx_get_t)(void **);
typedef int (*lt_cu_ctx_push_t)(void *);
typedef int (*lt_cu_ctx_pop_t)(void **);
typedef int (*lt_cu_encode_t)(void *, int, uint32_t, void *, const uint64_t *, const uint64_t *, const uint32_t *,
                              const uint32_t *, int, int, int, int);

/* CUlaunchAttribute and CUlaunchConfig as cuda.h lays them out, for cuLaunchKernelEx (cdefs.LAUNCH_CONFIG_CDEF) */
""" + LAUNCH_CONFIG_CDEF.replace("CUlaunchAttribute", "lt_launch_attribute").replace(
    "CUlaunchConfig", "lt_launch_config") + r"""
typedef int (*lt_cu_launch_ex_t)(const lt_launch_config *, void *, void **, void **);
#define LT_PROGRAMMATIC_STREAM_SERIALIZATION 6 /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */

typedef struct {
    uint64_t launch, ctx_get_current, ctx_push, ctx_pop, encode; /* driver function addresses (encode may be 0) */
    uint64_t launch_ex; /* cuLaunchKernelEx for a programmatic dependent (KernelSpec.dependent), else 0 */
    uint64_t function, context;                          /* CUfunction, the CUcontext it was loaded in */
    uint32_t block, shared;
    int32_t n_params, n_ints, n_floats, n_descs;
} lt_plan; /* followed by int16_t layout[n_params], lt_desc[n_descs], lt_desc_cache[n_descs] */

typedef struct {
    int32_t base_slot, rank, swizzle, elem_size, dtype; /* dtype: CUtensorMapDataType */
    uint32_t box[5];                                     /* innermost first */
} lt_desc;

typedef struct {
    int64_t valid, key[11]; /* base, sizes, strides of the last encode (zeros past the rank) */
    unsigned char map[128];
} lt_desc_cache;

#define LT_FAST_PLAN_VERSION 3 /* this layout's version: fastlaunch.PLAN_VERSION */
#define LT_MAX_PARAMS 512
#define LT_MAX_DESCS 16
#define LT_NULL_SLOT (-32768)
#define LT_DESC_SLOT (-16384)
#define LT_PUSH_FAILED (1 << 24)
#define LT_ENCODE_FAILED (2 << 24)

/* The CUtensorMap of descriptor d, from the cache when its base, sizes and strides are those of the last
   encode (the GIL is held: the cache is the plan's own bytearray), else from cuTensorMapEncodeTiled with the
   arguments Triton's fillTMADescriptorTiled passes: dims innermost first, rank - 1 byte strides, element
   strides 1, no interleave, L2 promotion 128B, zero fill. Returns 0, -1 (Python error set) or a CUDA error. */
static int lt_encode(const lt_plan *plan, const lt_desc *desc, lt_desc_cache *cache, const int64_t *ints,
                     unsigned char *out) {
    int r = desc->rank;
    if (r < 1 || r > 5 || desc->base_slot < 0 || desc->base_slot + 2 * r >= plan->n_ints) {
        PyErr_SetString(PyExc_ValueError, "launch(): malformed plan (descriptor)");
        return -1;
    }
    const int64_t *v = ints + desc->base_slot;
    int64_t key[11] = {0};
    key[0] = v[0];
    for (int i = 0; i < r; i++) {
        key[1 + i] = v[1 + i];
        key[6 + i] = v[1 + r + i];
    }
    if (cache->valid && memcmp(cache->key, key, sizeof key) == 0) {
        memcpy(out, cache->map, 128);
        return 0;
    }
    if (v[2 * r] != 1) {
        PyErr_Format(PyExc_ValueError, "launch(): a descriptor's innermost stride must be 1, got %lld",
                     (long long)v[2 * r]);
        return -1;
    }
    uint64_t dims[5], strides[5] = {0};
    uint32_t element_strides[5] = {1, 1, 1, 1, 1};
    for (int i = 0; i < r; i++) {
        if (v[1 + i] <= 0 || v[1 + r + i] < 0) {
            PyErr_Format(PyExc_ValueError, "launch(): descriptor sizes must be positive and strides >= 0");
            return -1;
        }
        dims[i] = (uint64_t)v[r - i];
    }
    for (int i = 0; i + 1 < r; i++)
        strides[i] = (uint64_t)v[2 * r - 1 - i] * (uint64_t)desc->elem_size;
    if (plan->encode == 0) {
        PyErr_SetString(PyExc_RuntimeError, "launch(): the driver has no cuTensorMapEncodeTiled");
        return -1;
    }
    int status = ((lt_cu_encode_t)(uintptr_t)plan->encode)(out, desc->dtype, (uint32_t)r, (void *)(uintptr_t)v[0],
                                                           dims, strides, desc->box, element_strides, 0,
                                                           desc->swizzle, 2, 0);
    if (status != 0) {
        cache->valid = 0;
        return status;
    }
    memcpy(cache->key, key, sizeof key);
    memcpy(cache->map, out, 128);
    cache->valid = 1;
    return 0;
}

/* Reads and checks a plan's header: the bytes fastlaunch.pack_plan packs (a bytearray when it has descriptors). */
static int lt_plan_read(PyObject *plan_obj, lt_plan *plan, unsigned char **raw, Py_ssize_t *raw_size) {
    if (PyBytes_Check(plan_obj)) {
        *raw = (unsigned char *)PyBytes_AS_STRING(plan_obj);
        *raw_size = PyBytes_GET_SIZE(plan_obj);
    } else if (PyByteArray_Check(plan_obj)) {
        *raw = (unsigned char *)PyByteArray_AS_STRING(plan_obj);
        *raw_size = PyByteArray_GET_SIZE(plan_obj);
    } else {
        *raw = NULL;
        *raw_size = 0;
    }
    if (*raw == NULL || *raw_size < (Py_ssize_t)sizeof *plan) {
        PyErr_SetString(PyExc_TypeError, "launch(): plan must be the bytes fastlaunch.launcher packs");
        return -1;
    }
    memcpy(plan, *raw, sizeof *plan);
    if (plan->n_params < 0 || plan->n_params > LT_MAX_PARAMS || plan->n_ints < 0 || plan->n_ints > LT_MAX_PARAMS ||
        plan->n_floats < 0 || plan->n_floats > LT_MAX_PARAMS || plan->n_descs < 0 || plan->n_descs > LT_MAX_DESCS ||
        (plan->n_descs > 0 && !PyByteArray_Check(plan_obj)) ||
        *raw_size != (Py_ssize_t)(sizeof *plan + 2 * (size_t)plan->n_params +
                                  (sizeof(lt_desc) + sizeof(lt_desc_cache)) * (size_t)plan->n_descs)) {
        PyErr_SetString(PyExc_ValueError, "launch(): malformed plan");
        return -1;
    }
    return 0;
}

/* Launches a plan's kernel with arguments already converted: ints and floats must have the plan's counts.
   layout[i] says where kernel parameter i lives: >= 0 an index into ints (pointers and integers, 8 bytes
   each; the driver reads 4 of an i32, the low half on little-endian hosts), -1 - j floats[j], LT_NULL_SLOT
   a NULL pointer (a hidden scratch parameter of size 0), LT_DESC_SLOT - d the map of descriptor d (by value).
   Returns 0, the CUDA error of cuLaunchKernel (cuLaunchKernelEx for a plan with launch_ex), LT_PUSH_FAILED + that
   of cuCtxPushCurrent, LT_ENCODE_FAILED + that of cuTensorMapEncodeTiled, or -1 with a Python error set. Runs no
   Python code: the plan's bytes stay put.
   Shared by _fastlaunch (C) and _hotpath (C++): both compile this same text. */
static long lt_plan_launch(PyObject *plan_obj, unsigned int gx, unsigned int gy, unsigned int gz, uintptr_t stream,
                           const int64_t *ints, Py_ssize_t n_ints, const float *floats, Py_ssize_t n_floats) {
    lt_plan plan;
    void *params[LT_MAX_PARAMS];
    LT_ALIGN64 unsigned char maps[LT_MAX_DESCS][128];
    static const int64_t null_value = 0;
    unsigned char *raw;
    Py_ssize_t raw_size;
    if (lt_plan_read(plan_obj, &plan, &raw, &raw_size) < 0)
        return -1;
    if (n_ints != plan.n_ints) {
        PyErr_Format(PyExc_ValueError, "launch(): ints has %zd items; the kernel takes %d", n_ints, (int)plan.n_ints);
        return -1;
    }
    if (n_floats != plan.n_floats) {
        PyErr_Format(PyExc_ValueError, "launch(): floats has %zd items; the kernel takes %d", n_floats,
                     (int)plan.n_floats);
        return -1;
    }
    const unsigned char *layout = raw + sizeof plan;
    const unsigned char *descs = layout + 2 * (size_t)plan.n_params;
    unsigned char *caches = (unsigned char *)descs + sizeof(lt_desc) * (size_t)plan.n_descs;
    for (int32_t d = 0; d < plan.n_descs; d++) {
        lt_desc desc;
        lt_desc_cache cache;
        memcpy(&desc, descs + sizeof desc * (size_t)d, sizeof desc);
        memcpy(&cache, caches + sizeof cache * (size_t)d, sizeof cache);
        int status = lt_encode(&plan, &desc, &cache, ints, maps[d]);
        if (status < 0)
            return -1;
        memcpy(caches + sizeof cache * (size_t)d, &cache, sizeof cache);
        if (status > 0)
            return status + LT_ENCODE_FAILED;
    }
    for (int32_t i = 0; i < plan.n_params; i++) {
        int16_t slot;
        memcpy(&slot, layout + 2 * i, 2);
        if (slot >= 0 && slot < plan.n_ints)
            params[i] = (void *)&ints[slot];
        else if (slot == LT_NULL_SLOT)
            params[i] = (void *)&null_value;
        else if (slot < 0 && -1 - slot < plan.n_floats)
            params[i] = (void *)&floats[-1 - slot];
        else if (slot <= LT_DESC_SLOT && LT_DESC_SLOT - slot < plan.n_descs)
            params[i] = maps[LT_DESC_SLOT - slot];
        else {
            PyErr_Format(PyExc_ValueError, "launch(): malformed plan (slot %d of parameter %d)", slot, i);
            return -1;
        }
    }
    /* Without the GIL, as cffi calls the driver: a launch into a full queue waits for the GPU. */
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    void *current = NULL;
    ((lt_cu_ctx_get_t)(uintptr_t)plan.ctx_get_current)(&current);
    int pushed = current != (void *)(uintptr_t)plan.context; /* a function runs only in its own context */
    if (pushed)
        status = ((lt_cu_ctx_push_t)(uintptr_t)plan.ctx_push)((void *)(uintptr_t)plan.context);
    if (status != 0) {
        status += LT_PUSH_FAILED;
    } else {
        if (plan.launch_ex) { /* the stream's previous kernel may still run: this one waits for its memory */
            lt_launch_attribute attr;
            memset(&attr, 0, sizeof attr);
            attr.id = LT_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmatic = 1;
            lt_launch_config config = {gx, gy, gz, plan.block, 1, 1, plan.shared, (uintptr_t)stream, &attr, 1};
            status = ((lt_cu_launch_ex_t)(uintptr_t)plan.launch_ex)(&config, (void *)(uintptr_t)plan.function,
                                                                    params, NULL);
        } else {
            status = ((lt_cu_launch_t)(uintptr_t)plan.launch)((void *)(uintptr_t)plan.function, gx, gy, gz,
                                                              plan.block, 1, 1, plan.shared, (uintptr_t)stream,
                                                              params, NULL);
        }
        if (pushed)
            ((lt_cu_ctx_pop_t)(uintptr_t)plan.ctx_pop)(&current);
    }
    Py_END_ALLOW_THREADS
    return status;
}
"""

# The Python-facing module of the helper: argument conversion, then lt_plan_launch.
MODULE_SOURCE = r"""
static int lt_grid(PyObject *value, const char *name, unsigned int *out) {
    unsigned long v = PyLong_AsUnsignedLong(value);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v == 0 || v > 0x7fffffffUL) {
        PyErr_Format(PyExc_ValueError, "%s must be in 1..2**31-1, got %lu", name, v);
        return -1;
    }
    *out = (unsigned int)v;
    return 0;
}

/* launch(plan, grid_x, grid_y, grid_z, stream, ints, floats) -> status (see lt_plan_launch).
   plan: bytes, or a bytearray when the kernel takes host descriptors (its tail caches their encoded maps).
   ints and floats must have the plan's lengths. */
static PyObject *lt_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lt_plan plan;
    int64_t ints[LT_MAX_PARAMS];
    float floats[LT_MAX_PARAMS];
    unsigned int gx, gy, gz;
    unsigned char *raw;
    Py_ssize_t raw_size;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "launch() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    if (lt_plan_read(args[0], &plan, &raw, &raw_size) < 0)
        return NULL;
    if (lt_grid(args[1], "grid_x", &gx) || lt_grid(args[2], "grid_y", &gy) || lt_grid(args[3], "grid_z", &gz))
        return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[4]);
    if (stream == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[5], "launch(): ints must be a tuple or list");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n_ints = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n_ints != plan.n_ints) {
        PyErr_Format(PyExc_ValueError, "launch(): ints has %zd items; the kernel takes %d", n_ints, (int)plan.n_ints);
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_ints; i++) {
        ints[i] = PyLong_AsLongLong(items[i]);
        if (ints[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    seq = PySequence_Fast(args[6], "launch(): floats must be a tuple or list");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n_floats = PySequence_Fast_GET_SIZE(seq);
    items = PySequence_Fast_ITEMS(seq);
    if (n_floats != plan.n_floats) {
        PyErr_Format(PyExc_ValueError, "launch(): floats has %zd items; the kernel takes %d", n_floats,
                     (int)plan.n_floats);
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_floats; i++) {
        double value = PyFloat_AsDouble(items[i]);
        if (value == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        floats[i] = (float)value;
    }
    Py_DECREF(seq);
    /* Converting the arguments may have run Python code (a resized bytearray): lt_plan_launch reads it again. */
    long status = lt_plan_launch(args[0], gx, gy, gz, (uintptr_t)stream, ints, n_ints, floats, n_floats);
    return status < 0 ? NULL : PyLong_FromLong(status);
}

static PyMethodDef lt_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))lt_launch, METH_FASTCALL,
     "launch(plan, grid_x, grid_y, grid_z, stream, ints, floats) -> status: cuLaunchKernel from a packed plan"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lt_module = {PyModuleDef_HEAD_INIT, "_fastlaunch", NULL, -1, lt_methods};

PyMODINIT_FUNC PyInit__fastlaunch(void) {
    PyObject *module = PyModule_Create(&lt_module);
    if (module != NULL && (PyModule_AddIntConstant(module, "PLAN_VERSION", LT_FAST_PLAN_VERSION) < 0 ||
                           PyModule_AddIntConstant(module, "MAX_PARAMS", LT_MAX_PARAMS) < 0)) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
"""
C_SOURCE = "#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n" + PLAN_SOURCE + MODULE_SOURCE


def find_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` or ``clang`` on the PATH; None when there is none."""
    wanted = os.environ.get("CC", "").strip()
    if wanted:
        return wanted if shutil.which(wanted.split()[0]) else None
    return next((name for name in ("cc", "gcc", "clang") if shutil.which(name)), None)


def command(compiler: str, source: Path, output: Path, include: str) -> list[str]:
    """The one compiler command: -O2, C11 with GNU extensions, a shared object against Python's headers."""
    return [*compiler.split(), "-O2", "-std=gnu11", "-Wall", "-shared", "-fPIC", f"-I{include}", str(source), "-o",
            str(output)]


def build(directory: Path | None = None, verbose: bool = False, mode: int = 0o777) -> Path:
    """Compile the helper and install it into ``directory`` (default: this package's folder); its path.

    The file is written beside its final name and renamed (a running process
    keeps the module it loaded), with ``mode`` less the umask. BuildError
    says what is missing or what the compiler printed.
    """
    import sysconfig  # only to build: the runtime imports this module for FILE_NAME and C_SOURCE
    import tempfile

    compiler = find_compiler()
    include = sysconfig.get_paths()["include"]
    missing = []
    if compiler is None:
        missing.append("a C compiler: none of $CC, cc, gcc, clang on the PATH (e.g. apt-get install gcc)")
    if not (Path(include) / "Python.h").is_file():
        missing.append(f"Python's headers: no Python.h in {include} (e.g. apt-get install python3-dev)")
    if compiler is None or missing:
        raise BuildError("cannot build the launch helper; missing:\n  " + "\n  ".join(missing))
    target = (Path(directory) if directory is not None else Path(__file__).resolve().parent) / FILE_NAME
    with tempfile.TemporaryDirectory(prefix="lazytriton-fastlaunch-") as tmp:
        source, built = Path(tmp) / "fastlaunch.c", Path(tmp) / FILE_NAME
        source.write_text(C_SOURCE)
        compile_and_install(command(compiler, source, built, include), built, target, mode, verbose)
    return target


def compile_and_install(argv: list[str], built: Path, target: Path, mode: int, verbose: bool) -> None:
    """Run the compiler command ``argv`` (it writes ``built``), then install ``built`` as ``target`` atomically.

    BuildError carries the compiler's last output when it fails.
    """
    if verbose:
        print(" ".join(argv))
    done = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603 (our command)
    if done.returncode != 0:
        raise BuildError(f"{argv[0]} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    fsutil.write_atomically(target, [built.read_bytes()], mode=mode)  # a loader sees all of it or none


def main() -> int:
    try:
        print(build(verbose="-v" in sys.argv[1:]))
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
