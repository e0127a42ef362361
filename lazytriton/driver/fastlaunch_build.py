"""Build the compiled launch helper: ``python -m lazytriton.driver.fastlaunch_build``.

The helper is a small CPython extension module (``lazytriton.driver._fastlaunch``,
one ``METH_FASTCALL`` function), compiled with setuptools and the system C
compiler as ``capi/build.py`` compiles liblazytriton, with no CUDA headers:
the driver's functions reach it as addresses. It exists because cffi's ABI
mode converts each of a launch's arguments through libffi (about 6.7 µs of a
19.7 µs warm call on the H200 host). A cffi API-mode function was tried first:
its generic conversion of the 26-int tuple still cost ~2 µs a call on the CPU
machine (fake driver), against ~0.3 µs here, where one C call reads the
argument tuples with ``PyLong_AsLongLong``, builds ``void *params[]`` on its
stack from the kernel's slot layout, checks the context and calls
``cuLaunchKernel``.

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

# The plan a launcher holds, as ``fastlaunch.launcher`` packs it (struct "<6Q2I4i", then int16 slots).
C_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*lt_cu_launch_t)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, uintptr_t, void **, void **);
typedef int (*lt_cu_ctx_get_t)(void **);
typedef int (*lt_cu_ctx_push_t)(void *);
typedef int (*lt_cu_ctx_pop_t)(void **);

typedef struct {
    uint64_t launch, ctx_get_current, ctx_push, ctx_pop; /* driver function addresses */
    uint64_t function, context;                          /* CUfunction, the CUcontext it was loaded in */
    uint32_t block, shared;
    int32_t n_params, n_ints, n_floats, reserved;
} lt_plan; /* followed by int16_t layout[n_params] */

#define LT_MAX_PARAMS 512
#define LT_NULL_SLOT (-32768)
#define LT_PUSH_FAILED (1 << 24)

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

/* launch(plan, grid_x, grid_y, grid_z, stream, ints, floats) -> status
   layout[i] says where kernel parameter i lives: >= 0 an index into ints (pointers and integers, 8 bytes
   each; the driver reads 4 of an i32, the low half on little-endian hosts), -1 - j floats[j], LT_NULL_SLOT
   a NULL pointer (a hidden scratch parameter of size 0). ints and floats must have the plan's lengths.
   Status: 0, the CUDA error of cuLaunchKernel, or LT_PUSH_FAILED + that of cuCtxPushCurrent. */
static PyObject *lt_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    lt_plan plan;
    int64_t ints[LT_MAX_PARAMS];
    float floats[LT_MAX_PARAMS];
    void *params[LT_MAX_PARAMS];
    static const int64_t null_value = 0;
    unsigned int gx, gy, gz;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "launch() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) < (Py_ssize_t)sizeof plan) {
        PyErr_SetString(PyExc_TypeError, "launch(): plan must be the bytes fastlaunch.launcher packs");
        return NULL;
    }
    memcpy(&plan, PyBytes_AS_STRING(args[0]), sizeof plan);
    if (plan.n_params < 0 || plan.n_params > LT_MAX_PARAMS || plan.n_ints < 0 || plan.n_ints > LT_MAX_PARAMS ||
        plan.n_floats < 0 || plan.n_floats > LT_MAX_PARAMS ||
        PyBytes_GET_SIZE(args[0]) != (Py_ssize_t)(sizeof plan + 2 * (size_t)plan.n_params)) {
        PyErr_SetString(PyExc_ValueError, "launch(): malformed plan");
        return NULL;
    }
    const unsigned char *layout = (const unsigned char *)PyBytes_AS_STRING(args[0]) + sizeof plan;
    if (lt_grid(args[1], "grid_x", &gx) || lt_grid(args[2], "grid_y", &gy) || lt_grid(args[3], "grid_z", &gz))
        return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[4]);
    if (stream == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[5], "launch(): ints must be a tuple or list");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n != plan.n_ints) {
        PyErr_Format(PyExc_ValueError, "launch(): ints has %zd items; the kernel takes %d", n, (int)plan.n_ints);
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
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
    n = PySequence_Fast_GET_SIZE(seq);
    items = PySequence_Fast_ITEMS(seq);
    if (n != plan.n_floats) {
        PyErr_Format(PyExc_ValueError, "launch(): floats has %zd items; the kernel takes %d", n,
                     (int)plan.n_floats);
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double value = PyFloat_AsDouble(items[i]);
        if (value == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        floats[i] = (float)value;
    }
    Py_DECREF(seq);
    for (int32_t i = 0; i < plan.n_params; i++) {
        int16_t slot;
        memcpy(&slot, layout + 2 * i, 2);
        if (slot >= 0 && slot < plan.n_ints)
            params[i] = &ints[slot];
        else if (slot == LT_NULL_SLOT)
            params[i] = (void *)&null_value;
        else if (slot < 0 && -1 - slot < plan.n_floats)
            params[i] = &floats[-1 - slot];
        else {
            PyErr_Format(PyExc_ValueError, "launch(): malformed plan (slot %d of parameter %d)", slot, i);
            return NULL;
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
        status = ((lt_cu_launch_t)(uintptr_t)plan.launch)((void *)(uintptr_t)plan.function, gx, gy, gz, plan.block,
                                                          1, 1, plan.shared, (uintptr_t)stream, params, NULL);
        if (pushed)
            ((lt_cu_ctx_pop_t)(uintptr_t)plan.ctx_pop)(&current);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

static PyMethodDef lt_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))lt_launch, METH_FASTCALL,
     "launch(plan, grid_x, grid_y, grid_z, stream, ints, floats) -> status: cuLaunchKernel from a packed plan"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lt_module = {PyModuleDef_HEAD_INIT, "_fastlaunch", NULL, -1, lt_methods};

PyMODINIT_FUNC PyInit__fastlaunch(void) {
    PyObject *module = PyModule_Create(&lt_module);
    if (module != NULL && (PyModule_AddIntConstant(module, "PLAN_VERSION", 1) < 0 ||
                           PyModule_AddIntConstant(module, "MAX_PARAMS", LT_MAX_PARAMS) < 0)) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
"""


def build(directory: Path | None = None, verbose: bool = False) -> Path:
    """Compile the helper and install it into ``directory`` (default: this package's folder); its path.

    The file is written beside its final name and renamed (a running process
    keeps the module it loaded).
    """
    from setuptools import Distribution, Extension

    target_dir = Path(directory) if directory is not None else Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="lazytriton-fastlaunch-") as tmp:
        source = Path(tmp) / "fastlaunch.c"
        source.write_text(C_SOURCE)
        extension = Extension(MODULE, sources=[str(source)], extra_compile_args=["-O2", "-std=gnu11", "-Wall"])
        dist = Distribution({"name": "lazytriton-fastlaunch", "ext_modules": [extension]})
        dist.verbose = verbose  # type: ignore[attr-defined]
        command = dist.get_command_obj("build_ext")
        command.build_lib = str(Path(tmp) / "lib")  # type: ignore[attr-defined]
        command.build_temp = str(Path(tmp) / "temp")  # type: ignore[attr-defined]
        command.ensure_finalized()
        command.run()
        built = Path(command.get_ext_fullpath(MODULE))  # type: ignore[attr-defined]
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
