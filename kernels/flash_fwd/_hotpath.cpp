// flash_fwd's warm-path tail in C++: allocate out (and lse), read the pointers, pick the plan, launch.
//
// kernels/flash_fwd/hot.py calls run() after its entry lookup, when this module is built for the running
// torch (hotpath.py loads it; python -m lazytriton.kernels.flash_fwd.hotpath_build builds it). Every
// check that decides whether a call may come here stays in Python (hot.py's describe); run() trusts the
// record hot.py made for the entry. What Python pays per torch call (~1.5 us on the H200 host for an
// allocation, ~0.3 per data_ptr) is what this file saves.
//
// lt_plan.h is fastlaunch_build.PLAN_SOURCE, written beside this file at build time: the plan layout and the
// launch (lt_plan_launch) are the same text the compiled launch helper (_fastlaunch) compiles. lt_tail.h is what
// every family's C++ warm path shares (lazytriton/driver/lt_tail.h: the stream read here, the launch, the entry
// table). lt_record.h is hotpath_record.header(): the index of each field of the record run() reads (LT_RECORD_*).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "lt_plan.h"
#include "lt_record.h"
#include "lt_tail.h"
static_assert(LT_RECORD_PLAN_UNALIGNED == LT_RECORD_PLAN_ALIGNED + 1
                  && LT_RECORD_FAIL_UNALIGNED == LT_RECORD_FAIL_ALIGNED + 1,
              "run() reads a kernel's plan and fail at the aligned field plus which (0: aligned, 1: not)");

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

enum Pointer { Q, K, V, OUT, LSE, N_POINTERS };

// The template of one describe entry (hot.py's CPP_TEMPLATE packs it, LT_TEMPLATE_FORMAT), followed by
// n_ints int64 values (the constant parameters; pointer slots hold 0) and n_floats float32 values.
struct Template {
    int64_t lse_shape[3];              // (b, hq, sq)
    uint32_t grid[2][3];               // [aligned, not aligned] (grid_x, grid_y, grid_z)
    int32_t strides_aligned;           // the alignment rule's part the strides decide (describe)
    int32_t forward;                   // 1: allocate lse, return (out, lse); 0: lse at lse_address, return out
    int32_t n_ints, n_floats;
    int16_t pointer_slot[N_POINTERS];  // the int slot taking q, k, v, out, lse's address; -1: none
    int16_t align_mask;                // bit p: pointer p enters the alignment rule (binding.ALIGNED_SOURCE)
};
#define LT_TEMPLATE_FORMAT "<3q6I4i6h4x"  // the module's TEMPLATE: hot.py uses it only when its own is the same
static_assert(sizeof(Template) == 80, "Template must be what LT_TEMPLATE_FORMAT packs");
// run()'s calling convention (its arguments and the record's items): hot.py's CPP_INTERFACE must be the same, or
// it leaves the module unused (one built from an older _hotpath.cpp, kept beside the package, until rebuilt).
// 2: the record's sixth item (restock), a forward's lse argument the entry's stocks or None.
// 3: the stream argument may be None: run() reads the current stream itself (STREAM_INSIDE).
// 4: serve() and remember(): the entry lookup in C++ (hot.py's front), beside run().
#define LT_INTERFACE 4

// The next lse of a forward_* entry's stock for this stream (hot.py's lse_stocks: dict stream -> list of lse
// tensors, views of one block), popped here; an empty or missing stock is refilled by the record's restock
// (hot.restock bound to the entry's stocks and lse template), called with the stream. A new reference, or
// nullptr with an exception set.
PyObject *next_lse(PyObject *stocks, PyObject *stream, PyObject *restock) {
    PyObject *stock = PyDict_GetItemWithError(stocks, stream);  // borrowed
    if (stock == nullptr && PyErr_Occurred())
        return nullptr;
    Py_ssize_t n = stock != nullptr && PyList_CheckExact(stock) ? PyList_GET_SIZE(stock) : 0;
    if (n == 0)
        return PyObject_CallOneArg(restock, stream);
    PyObject *lse = PyList_GET_ITEM(stock, n - 1);
    Py_INCREF(lse);
    if (PyList_SetSlice(stock, n - 1, n, nullptr) < 0) {
        Py_DECREF(lse);
        return nullptr;
    }
    return lse;
}

// run(q, k, v, stream, lse, record) -> out | (out, lse) | None
// stream: the raw stream handle (an int), or None: q's device's current stream, read here (STREAM_INSIDE; run
// returns None, the Python path's turn, where it cannot be read).
// lse: an output_* call passes the address (int) of a buffer nobody reads; a forward_* call passes the entry's
// lse stocks (a dict, see next_lse), or None to have its lse allocated here (a large lse; during a capture,
// from the graph's pool).
// record: (template bytes, plan aligned, plan not aligned, fail aligned, fail not aligned, restock); a plan is
// fastlaunch.pack_plan's bytes, or None while the general path has not memoised it (run returns None: the
// caller goes on in Python). fail is the kernel's LoadedKernel.fail, called with (status, grid) to raise.
// restock: see next_lse (None for an output_* entry).
bool is_record(PyObject *record) {
    return PyTuple_Check(record) && PyTuple_GET_SIZE(record) == LT_RECORD_SIZE
           && PyBytes_Check(PyTuple_GET_ITEM(record, LT_RECORD_TEMPLATE));
}

// run()'s work once its arguments are checked: args are q, k, v (exact tensors), stream, lse; record is_record.
PyObject *tail(PyObject *const *args, PyObject *record) {
    PyObject *raw = PyTuple_GET_ITEM(record, LT_RECORD_TEMPLATE);
    Template t;
    if (PyBytes_GET_SIZE(raw) < (Py_ssize_t)sizeof t) {
        PyErr_SetString(PyExc_ValueError, "run(): malformed template");
        return nullptr;
    }
    memcpy(&t, PyBytes_AS_STRING(raw), sizeof t);
    if (t.n_ints < 0 || t.n_ints > LT_MAX_PARAMS || t.n_floats < 0 || t.n_floats > LT_MAX_PARAMS ||
        PyBytes_GET_SIZE(raw) != (Py_ssize_t)(sizeof t + 8 * (size_t)t.n_ints + 4 * (size_t)t.n_floats)) {
        PyErr_SetString(PyExc_ValueError, "run(): malformed template");
        return nullptr;
    }
    const at::Tensor &q = THPVariable_Unpack(args[0]);
    uintptr_t stream = 0;
    int read = read_stream(args[3], (int32_t)q.get_device(), &stream);  // None: q's device's current stream
    if (read <= 0) {
        if (read < 0)
            return nullptr;
        Py_RETURN_NONE;  // not read here: hot.py's Python path reads it
    }
    unsigned long long lse_address = t.forward ? 0 : PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return nullptr;
    const at::Tensor &k = THPVariable_Unpack(args[1]);
    const at::Tensor &v = THPVariable_Unpack(args[2]);
    Owned stocked;  // a forward's lse from its stock, returned as is
    if (t.forward && args[4] != Py_None) {
        if (!PyDict_CheckExact(args[4])) {
            PyErr_SetString(PyExc_TypeError, "run(): lse must be the entry's stocks (a dict) or None");
            return nullptr;
        }
        stocked.p = next_lse(args[4], args[3], PyTuple_GET_ITEM(record, LT_RECORD_RESTOCK));
        if (stocked.p == nullptr)
            return nullptr;
        // The kernel writes b * hq * sq floats there: hot.py's contract, checked (a few field reads).
        if (!THPVariable_CheckExact(stocked.p)) {
            PyErr_SetString(PyExc_TypeError, "run(): a stock's lse must be a tensor");
            return nullptr;
        }
        const at::Tensor &given = THPVariable_Unpack(stocked.p);
        if (given.scalar_type() != at::kFloat || given.device() != q.device() || !given.is_contiguous() ||
            given.numel() != t.lse_shape[0] * t.lse_shape[1] * t.lse_shape[2]) {
            PyErr_SetString(PyExc_ValueError, "run(): lse is not a contiguous float32 (b, hq, sq) tensor on q's device");
            return nullptr;
        }
        lse_address = (uintptr_t)given.const_data_ptr();
    }
    at::Tensor out = at::empty_like(q);  // torch.empty_like(q): q's dtype and device, its strides when dense
    at::Tensor lse;
    if (t.forward && stocked.p == nullptr) {  // on the current stream; during a capture, from the graph's pool
        lse = at::empty({t.lse_shape[0], t.lse_shape[1], t.lse_shape[2]}, q.options().dtype(at::kFloat));
        lse_address = (uintptr_t)lse.const_data_ptr();
    }
    int64_t address[N_POINTERS];
    address[Q] = (int64_t)(uintptr_t)q.const_data_ptr();
    address[K] = (int64_t)(uintptr_t)k.const_data_ptr();
    address[V] = (int64_t)(uintptr_t)v.const_data_ptr();
    address[OUT] = (int64_t)(uintptr_t)out.const_data_ptr();
    address[LSE] = (int64_t)lse_address;
    int64_t low_bits = 0;
    for (int p = 0; p < N_POINTERS; p++)
        if (t.align_mask & (1 << p))
            low_bits |= address[p];
    int which = t.strides_aligned && !(low_bits & 15) ? 0 : 1;
    PyObject *plan = PyTuple_GET_ITEM(record, LT_RECORD_PLAN_ALIGNED + which);
    if (plan == Py_None)
        Py_RETURN_NONE;  // not memoised yet: hot.py's Python path, then the general path, fill it
    int64_t ints[LT_MAX_PARAMS];
    float floats[LT_MAX_PARAMS];
    memcpy(ints, PyBytes_AS_STRING(raw) + sizeof t, 8 * (size_t)t.n_ints);
    memcpy(floats, PyBytes_AS_STRING(raw) + sizeof t + 8 * (size_t)t.n_ints, 4 * (size_t)t.n_floats);
    for (int p = 0; p < N_POINTERS; p++)
        if (t.pointer_slot[p] >= 0 && t.pointer_slot[p] < t.n_ints)
            ints[t.pointer_slot[p]] = address[p];
    if (!launch_plan(plan, PyTuple_GET_ITEM(record, LT_RECORD_FAIL_ALIGNED + which), t.grid[which], stream, ints,
                     t.n_ints, floats, t.n_floats))
        return nullptr;
    if (!t.forward)
        return THPVariable_Wrap(std::move(out));
    PyObject *out_obj = THPVariable_Wrap(std::move(out));
    if (out_obj == nullptr)
        return nullptr;
    return out_and_lse(out_obj, stocked.p != nullptr ? stocked.release() : THPVariable_Wrap(std::move(lse)));
}

PyObject *run(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS  // a c10::Error becomes the Python exception torch raises for it (OutOfMemoryError, ...)
    if (nargs != 6 || !is_record(args[5])) {
        PyErr_SetString(PyExc_TypeError, "run(q, k, v, stream, lse, record): hot.py's record expected");
        return nullptr;
    }
    if (!THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) || !THPVariable_CheckExact(args[2]))
        Py_RETURN_NONE;  // a tensor subclass: hot.py's Python path (torch.empty_like dispatches on it)
    return tail(args, args[5]);
    END_HANDLE_TH_ERRORS
}

// The entry lookup in C++ (hot.py's front): what hot.py's generated function keys its entries by (sizes and
// strides of q, k, v; dtype; device; causal; scale; gqa), read from the TensorImpls into one fixed record and
// hashed, instead of ~20 Python attribute reads and a tuple hash. The table is a dict owned by the generated
// function: hash -> (key bytes, plans, record, lse numel), filled by remember() once the Python path has made an
// entry's record; serve() finds it and runs the tail. The key bytes are compared whole (a hash collision is a
// miss), and plans must be the runtime's current dict (a settings change starts the runtime again: a miss, and
// the Python path describes the shape again). Anything serve() does not recognise is declined (None): the Python
// path, which raises the errors and fills the table.
struct Key {
    int64_t sizes[3][4];
    int64_t strides[3][4];
    double scale;
    int32_t dtype, device_type, device_index, causal, scale_none, gqa;
};
static_assert(sizeof(Key) == 224, "Key holds no padding: its bytes are its value");

enum Causal { NOT_CAUSAL, CAUSAL, TOP_LEFT, BOTTOM_RIGHT };

// The key of a call, or false where the Python path's own checks (hot.py's _TEMPLATE) would decline it: a tensor
// subclass, a tensor not on CUDA (require_cuda), one that requires grad, dims other than 4, mixed dtypes or
// devices, causal other than False/True/"top_left"/"bottom_right", scale other than None or a float, gqa not a bool.
bool make_key(PyObject *const *args, bool require_cuda, Key *key) {
    if (!THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) || !THPVariable_CheckExact(args[2]))
        return false;
    memset(key, 0, sizeof *key);
    const at::Tensor &q = THPVariable_Unpack(args[0]);
    for (int i = 0; i < 3; i++) {
        const at::Tensor &t = THPVariable_Unpack(args[i]);
        if ((require_cuda && !t.is_cuda()) || t.requires_grad() || t.dim() != 4 ||
            t.scalar_type() != q.scalar_type() || t.device() != q.device())
            return false;
        for (int d = 0; d < 4; d++) {
            key->sizes[i][d] = t.sizes()[d];
            key->strides[i][d] = t.strides()[d];
        }
    }
    key->dtype = (int32_t)q.scalar_type();
    key->device_type = (int32_t)q.device().type();
    key->device_index = q.device().index();
    PyObject *causal = args[3], *gqa = args[5];
    if (causal == Py_False) {
        key->causal = NOT_CAUSAL;
    } else if (causal == Py_True) {
        key->causal = CAUSAL;
    } else if (PyUnicode_CheckExact(causal) && PyUnicode_CompareWithASCIIString(causal, "top_left") == 0) {
        key->causal = TOP_LEFT;
    } else if (PyUnicode_CheckExact(causal) && PyUnicode_CompareWithASCIIString(causal, "bottom_right") == 0) {
        key->causal = BOTTOM_RIGHT;
    } else {
        return false;
    }
    if (!read_scale(args[4], &key->scale, &key->scale_none))
        return false;
    if (gqa != Py_True && gqa != Py_False)
        return false;
    key->gqa = gqa == Py_True;
    return true;
}

// FNV-1a over the key's 8-byte words, finished by a multiply-xorshift: the table's dict key.
uint64_t key_hash(const Key &key) {
    uint64_t words[sizeof(Key) / 8];
    memcpy(words, &key, sizeof key);
    uint64_t h = 1469598103934665603ull;
    for (uint64_t w : words)
        h = (h ^ w) * 1099511628211ull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h;
}

int template_forward(PyObject *record) {
    Template t;
    PyObject *raw = PyTuple_GET_ITEM(record, LT_RECORD_TEMPLATE);
    if (PyBytes_GET_SIZE(raw) < (Py_ssize_t)sizeof t)
        return -1;
    memcpy(&t, PyBytes_AS_STRING(raw), sizeof t);
    return t.forward != 0;
}

// serve(q, k, v, causal, scale, gqa, table, plans, spare, require_cuda) -> out | (out, lse) | None
// spare: hot.py's SPARE (device index -> (numel, address) of the lse buffer nobody reads), for an output_* entry.
// None: declined (not in the table, another runtime's plans, no stream getter, a spare too small, or the tail
// declined): the caller goes on in Python.
PyObject *serve(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 10 || !PyDict_CheckExact(args[6]) || !PyDict_CheckExact(args[8])) {
        PyErr_SetString(PyExc_TypeError, "serve(q, k, v, causal, scale, gqa, table, plans, spare, require_cuda)");
        return nullptr;
    }
    if (stream_getter == nullptr)
        Py_RETURN_NONE;  // the front is for modules that read the stream themselves
    Key key;
    if (!make_key(args, PyObject_IsTrue(args[9]) == 1, &key))
        Py_RETURN_NONE;
    PyObject *found = find_entry(args[6], key_hash(key), &key, sizeof key, args[7]);  // borrowed
    if (found == nullptr) {
        if (PyErr_Occurred())
            return nullptr;
        Py_RETURN_NONE;
    }
    Owned held;  // the entry stays alive through the launch (which lets other threads run)
    Py_INCREF(found);
    held.p = found;
    PyObject *record = PyTuple_GET_ITEM(found, 2);
    int forward = is_record(record) ? template_forward(record) : -1;
    if (forward < 0)
        Py_RETURN_NONE;
    Owned lse;
    if (forward) {
        Py_INCREF(Py_None);
        lse.p = Py_None;  // the tail allocates it
    } else {
        long long needed = PyLong_AsLongLong(PyTuple_GET_ITEM(found, 3));
        if (needed == -1 && PyErr_Occurred())
            return nullptr;
        Owned device;
        device.p = PyLong_FromLong(key.device_index);
        if (device.p == nullptr)
            return nullptr;
        PyObject *spare = PyDict_GetItemWithError(args[8], device.p);  // borrowed: (numel, address)
        if (spare == nullptr && PyErr_Occurred())
            return nullptr;
        if (spare == nullptr || !PyTuple_CheckExact(spare) || PyTuple_GET_SIZE(spare) != 2)
            Py_RETURN_NONE;
        long long numel = PyLong_AsLongLong(PyTuple_GET_ITEM(spare, 0));
        if (numel == -1 && PyErr_Occurred())
            return nullptr;
        if (numel < needed)
            Py_RETURN_NONE;  // the Python path grows it
        lse.p = PyTuple_GET_ITEM(spare, 1);
        Py_INCREF(lse.p);
    }
    PyObject *tail_args[5] = {args[0], args[1], args[2], Py_None, lse.p};
    return tail(tail_args, record);
    END_HANDLE_TH_ERRORS
}

// remember(q, k, v, causal, scale, gqa, table, plans, record, lse numel, max entries) -> bool
// Files the entry's record under the call's key (the table is cleared first once it holds max entries). False
// when the call has no key (see make_key): nothing filed.
PyObject *remember(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 11 || !PyDict_CheckExact(args[6]) || !is_record(args[8]) || !PyLong_Check(args[9]) ||
        !PyLong_Check(args[10])) {
        PyErr_SetString(PyExc_TypeError,
                        "remember(q, k, v, causal, scale, gqa, table, plans, record, lse numel, max entries)");
        return nullptr;
    }
    Key key;
    if (!make_key(args, false, &key))
        Py_RETURN_FALSE;
    return file_entry(args[6], key_hash(key), &key, sizeof key, args[7], args[8], args[9], args[10]);
    END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(q, k, v, stream, lse, record) -> out | (out, lse) | None: flash_fwd's warm-path tail"},
    {"serve", (PyCFunction)(void (*)(void))serve, METH_FASTCALL,
     "serve(q, k, v, causal, scale, gqa, table, plans, spare, require_cuda) -> out | (out, lse) | None: "
     "the entry lookup, then run()'s tail"},
    {"remember", (PyCFunction)(void (*)(void))remember, METH_FASTCALL,
     "remember(q, k, v, causal, scale, gqa, table, plans, record, lse numel, max entries) -> bool: "
     "file an entry's record for serve()"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMODINIT_FUNC PyInit__hotpath(void) { return create_module(methods, LT_INTERFACE, "TEMPLATE", LT_TEMPLATE_FORMAT); }
