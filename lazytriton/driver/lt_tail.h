// What every family's C++ warm path (kernels/<family>/_hotpath.cpp) shares: the current stream read in C++, an owned
// reference, a plan's launch and its kernel's error, the (out, lse) pair, the scale's part of a key, the entry table
// that serve() reads and remember() fills, and the constants every such module says of itself.
//
// torch_build writes it beside the source at build time, after lt_plan.h (lt_plan_launch); its bytes enter every
// tail's source hash (torch_extension.TorchExtension.source), so a change here rebuilds each of them. Plain CPython
// and libdl: nothing of torch.
#pragma once
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include <initializer_list>

namespace {

// The current stream of a device without Python's torch._C._cuda_getCurrentRawStream (~0.3 us of a warm call):
// torch's AOTInductor C shim, aoti_torch_get_current_cuda_stream(device_index, &stream) -> 0 on success, a stable C
// ABI in libtorch_cuda (libtorch_hip on ROCm). Looked up once, when the module loads (create_module); absent (a CPU
// torch, an older one), the caller passes the stream (the module's STREAM_INSIDE is 0).
typedef int32_t (*StreamGetter)(int32_t, void **);
StreamGetter stream_getter = nullptr;

StreamGetter find_stream_getter() {
    const char *name = "aoti_torch_get_current_cuda_stream";
    void *found = dlsym(RTLD_DEFAULT, name);
    for (const char *library : {"libtorch_cuda.so", "libtorch_hip.so"}) {
        if (found != nullptr)
            break;
        void *handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);  // torch loaded it: only its handle is taken
        if (handle != nullptr) {
            found = dlsym(handle, name);
            dlclose(handle);  // NOLOAD took a reference; torch keeps the library loaded
        }
    }
    return reinterpret_cast<StreamGetter>(found);
}

// The stream a call launches on: ``given``, the raw stream handle (an int), or None: the current stream of
// ``device``, read here (STREAM_INSIDE). 1: read into ``stream``; 0: None given and no stream read (no getter, or it
// failed): the family's Python path reads it; -1: a Python error is set.
int read_stream(PyObject *given, int32_t device, uintptr_t *stream) {
    if (given == Py_None) {
        void *current = nullptr;
        if (stream_getter == nullptr || stream_getter(device, &current) != 0)
            return 0;
        *stream = (uintptr_t)current;
        return 1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(given);
    if (PyErr_Occurred())
        return -1;
    *stream = (uintptr_t)value;
    return 1;
}

// A new reference, released when it goes out of scope (an early return, a C++ exception).
struct Owned {
    PyObject *p = nullptr;
    ~Owned() { Py_XDECREF(p); }
    PyObject *release() {
        PyObject *q = p;
        p = nullptr;
        return q;
    }
};

// Launch ``plan`` (fastlaunch.pack_plan's bytes) on ``grid`` with the call's ints and floats; false with a Python
// error set: lt_plan_launch's own (a negative status), or the one ``fail`` raises (the kernel's LoadedKernel.fail,
// called with (status, grid): the DriverError naming the call and the CUDA error).
bool launch_plan(PyObject *plan, PyObject *fail, const uint32_t *grid, uintptr_t stream, const int64_t *ints,
                 int32_t n_ints, const float *floats, int32_t n_floats) {
    long status = lt_plan_launch(plan, grid[0], grid[1], grid[2], stream, ints, n_ints, floats, n_floats);
    if (status < 0)
        return false;
    if (status > 0) {
        PyObject *raised = PyObject_CallFunction(fail, "l(III)", status, grid[0], grid[1], grid[2]);
        Py_XDECREF(raised);
        if (raised != nullptr)
            PyErr_Format(PyExc_RuntimeError, "launch failed with status %ld", status);
        return false;
    }
    return true;
}

// The tuple (out, lse), taking both references; nullptr (both released) when either is nullptr or the tuple cannot
// be made.
PyObject *out_and_lse(PyObject *out, PyObject *lse) {
    PyObject *pair = out != nullptr && lse != nullptr ? PyTuple_New(2) : nullptr;
    if (pair == nullptr) {
        Py_XDECREF(out);
        Py_XDECREF(lse);
        return nullptr;
    }
    PyTuple_SET_ITEM(pair, 0, out);
    PyTuple_SET_ITEM(pair, 1, lse);
    return pair;
}

// softmax_scale as a key holds it: None (``*none`` set to 1) or a float (into ``*value``); false for a nan (the
// Python path raises for it) or anything else (its turn).
bool read_scale(PyObject *scale, double *value, int32_t *none) {
    if (scale == Py_None) {
        *none = 1;
        return true;
    }
    if (!PyFloat_CheckExact(scale))
        return false;
    *value = PyFloat_AS_DOUBLE(scale);
    return *value == *value;
}

// The entry table: a dict owned by the family's hot.py, the hash of a call's key (a Python int) -> (key bytes, plans,
// record, the family's fourth item). find_entry: the entry filed under ``hash`` whose key bytes are ``key`` whole (a
// hash collision is a miss) and whose plans are ``plans``, the runtime's current dict (a settings change starts the
// runtime again: a miss); borrowed. nullptr where there is none, with a Python error set only on an error.
PyObject *find_entry(PyObject *table, uint64_t hash, const void *key, size_t size, PyObject *plans) {
    Owned hashed;
    hashed.p = PyLong_FromUnsignedLongLong(hash);
    if (hashed.p == nullptr)
        return nullptr;
    PyObject *found = PyDict_GetItemWithError(table, hashed.p);  // borrowed
    if (found == nullptr || !PyTuple_CheckExact(found) || PyTuple_GET_SIZE(found) != 4 ||
        PyTuple_GET_ITEM(found, 1) != plans)
        return nullptr;
    PyObject *bytes = PyTuple_GET_ITEM(found, 0);
    if (!PyBytes_CheckExact(bytes) || PyBytes_GET_SIZE(bytes) != (Py_ssize_t)size ||
        memcmp(PyBytes_AS_STRING(bytes), key, size) != 0)
        return nullptr;
    return found;
}

// remember()'s filing: (key bytes, plans, record, fourth) under ``hash``, the table cleared first once it holds
// ``most`` entries (a Python int). A new reference to True, or nullptr with a Python error set.
PyObject *file_entry(PyObject *table, uint64_t hash, const void *key, size_t size, PyObject *plans, PyObject *record,
                     PyObject *fourth, PyObject *most) {
    long long limit = PyLong_AsLongLong(most);
    if (limit == -1 && PyErr_Occurred())
        return nullptr;
    Owned hashed, value;
    hashed.p = PyLong_FromUnsignedLongLong(hash);
    if (hashed.p == nullptr)
        return nullptr;
    value.p = Py_BuildValue("(y#OOO)", reinterpret_cast<const char *>(key), (Py_ssize_t)size, plans, record, fourth);
    if (value.p == nullptr)
        return nullptr;
    if (PyDict_GET_SIZE(table) >= limit)
        PyDict_Clear(table);
    if (PyDict_SetItem(table, hashed.p, value.p) < 0)
        return nullptr;
    Py_RETURN_TRUE;
}

// The module _hotpath with ``methods`` (its stream getter looked up first), the constants every tail says of itself
// (TORCH_VERSION, the torch it was compiled against; STREAM_INSIDE, whether it reads the current stream itself;
// PLAN_VERSION, the launch plan's layout it reads; INTERFACE, ``interface``: its functions' calling convention) and
// its family's own string constant ``name`` = ``value`` (its record's format). nullptr with a Python error set.
PyObject *create_module(PyMethodDef *methods, long interface, const char *name, const char *value) {
    static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_hotpath", nullptr, -1, nullptr,
                              nullptr, nullptr, nullptr, nullptr};
    def.m_methods = methods;
    stream_getter = find_stream_getter();
    PyObject *module = PyModule_Create(&def);
    if (module != nullptr && (PyModule_AddStringConstant(module, "TORCH_VERSION", LT_TORCH_VERSION) < 0 ||
                              PyModule_AddIntConstant(module, "STREAM_INSIDE", stream_getter != nullptr) < 0 ||
                              PyModule_AddIntConstant(module, "PLAN_VERSION", LT_PLAN_VERSION) < 0 ||
                              PyModule_AddIntConstant(module, "INTERFACE", interface) < 0 ||
                              PyModule_AddStringConstant(module, name, value) < 0)) {
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}

}  // namespace
