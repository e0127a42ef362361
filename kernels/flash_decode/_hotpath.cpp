// flash_decode's warm path in C++: the entry lookup (serve), then the per-call checks no key holds, the allocations,
// the pointers, the launches (run).
//
// kernels/flash_decode/hot.py calls serve() first and run() after its own entry lookup, when this module is built for
// the running torch (hotpath.py loads it; python -m lazytriton.kernels.flash_decode.hotpath_build builds it). Every
// decision that makes a shape eligible stays in Python (hot.py's describe); serve() finds the record hot.py made for a
// shape by the key hot.py's lookup reads (remember() files it), and run() trusts that record and does what hot.py's
// Python run() does, in the same order: an int length's range, the caches' and out's bytes,
// out's allocation, the alignment choice, the index values' check (a Python callable, when hot.py passes one), the
// workspace, then kv_append (new keys), the split kernel and, with several splits, the combine kernel. What Python
// pays per torch call (an allocation ~1 us, a launch's argument tuple, ~0.1 us a data_ptr) is what this file saves.
//
// lt_plan.h is fastlaunch_build.PLAN_SOURCE, written beside this file at build time: the plan layout and the launch
// (lt_plan_launch) are the same text the compiled launch helper (_fastlaunch) compiles. lt_tail.h is what every
// family's C++ warm path shares (lazytriton/driver/lt_tail.h: the stream read here, the launch, the entry table).
// lt_record.h is hotpath_record.header(): the record's fields, the pointer roles and the structs' formats, from Python.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "lt_plan.h"
#include "lt_record.h"
#include "lt_tail.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

// What run() reads of an entry (hotpath_record.HEADER packs it).
struct Header {
    int64_t out_size[4];                // out's sizes when run() allocates it (q's dtype, contiguous)
    int64_t lse_size[3];                // lse's sizes (float32, contiguous)
    int64_t lse_numel;
    int64_t lens_max;                   // the largest int length (capacity - seqlen_new)
    int64_t span[LT_SPAN_COUNT];        // bytes from each tensor's first element past its last (0: none, empty)
    int32_t allocate_out;               // 1: run() allocates out; 0: the caller's
    int32_t lens_int;                   // cache_seqlens is an int (its range checked, its value in length_slot)
    int32_t split_strides_aligned;      // the alignment rule's part the strides decide (describe)
    int32_t append_strides_aligned;
};
static_assert(sizeof(Header) == LT_HEADER_SIZE, "Header must be what hotpath_record.HEADER packs");

// One kernel's launch (hotpath_record.LAUNCH packs it), then n_ints int64 (the first n_pointers are pointer slots,
// 0 in the template) and n_floats float32.
struct Launch {
    int64_t splits;                     // the split kernel's split count (1 elsewhere)
    int64_t work_floats;                // the workspace's floats before lse (split kernel)
    int64_t partial_lse;                // the partial lse's byte offset in the workspace (split kernel)
    uint32_t grid[3];
    int32_t n_ints, n_floats, n_pointers;
    int32_t length_slot;                // the int slot of an int cache_seqlens; -1: none
    int8_t role[LT_MAX_POINTERS];       // the pointer each slot takes (LT_ROLE_*)
};
static_assert(sizeof(Launch) == LT_LAUNCH_SIZE, "Launch must be what hotpath_record.LAUNCH packs");

// run()'s, serve()'s and remember()'s calling convention: hotpath_record.INTERFACE must be the same, or hotpath.py
// refuses the module. 2: serve() and remember(), the entry lookup in C++, beside run().
#define LT_INTERFACE 2

// A launch item of the record, read: its struct, its ints and floats copied out, its plan and fail borrowed.
struct Item {
    Launch launch;
    int64_t ints[LT_MAX_PARAMS];
    float floats[LT_MAX_PARAMS];
    PyObject *plan, *fail;
};

// Read (launch bytes, plan, fail) at items[0..2]; false with a Python error set when malformed.
bool read_item(PyObject *const *items, Item *item) {
    PyObject *raw = items[0];
    if (!PyBytes_CheckExact(raw) || PyBytes_GET_SIZE(raw) < (Py_ssize_t)sizeof(Launch)) {
        PyErr_SetString(PyExc_ValueError, "run(): malformed launch");
        return false;
    }
    Launch &l = item->launch;
    memcpy(&l, PyBytes_AS_STRING(raw), sizeof l);
    if (l.n_ints < 0 || l.n_ints > LT_MAX_PARAMS || l.n_floats < 0 || l.n_floats > LT_MAX_PARAMS ||
        l.n_pointers < 0 || l.n_pointers > LT_MAX_POINTERS || l.n_pointers > l.n_ints || l.length_slot >= l.n_ints ||
        (l.length_slot >= 0 && l.length_slot < l.n_pointers) ||
        PyBytes_GET_SIZE(raw) != (Py_ssize_t)(sizeof l + 8 * (size_t)l.n_ints + 4 * (size_t)l.n_floats)) {
        PyErr_SetString(PyExc_ValueError, "run(): malformed launch");
        return false;
    }
    for (int i = 0; i < l.n_pointers; i++)
        if (l.role[i] < 0 || l.role[i] >= LT_ROLE_COUNT) {
            PyErr_SetString(PyExc_ValueError, "run(): malformed launch (a pointer role)");
            return false;
        }
    memcpy(item->ints, PyBytes_AS_STRING(raw) + sizeof l, 8 * (size_t)l.n_ints);
    memcpy(item->floats, PyBytes_AS_STRING(raw) + sizeof l + 8 * (size_t)l.n_ints, 4 * (size_t)l.n_floats);
    item->plan = items[1];
    item->fail = items[2];
    return true;
}

// Launch an item with the call's pointers (address[role]) and int length; false with the kernel's error raised.
bool launch(Item &item, const int64_t *address, int64_t length, uintptr_t stream) {
    Launch &l = item.launch;
    for (int i = 0; i < l.n_pointers; i++)
        item.ints[i] = address[l.role[i]];
    if (l.length_slot >= 0)
        item.ints[l.length_slot] = length;
    return launch_plan(item.plan, item.fail, l.grid, stream, item.ints, l.n_ints, item.floats, l.n_floats);
}

// The record's item at ``index`` (a new reference), or nullptr when it is not one (None: no plan memoised yet).
PyObject *item_at(PyObject *record, Py_ssize_t index) {
    PyObject *item = PyList_GET_ITEM(record, index);
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != LT_ITEM_SIZE)
        return nullptr;
    Py_INCREF(item);
    return item;
}

bool overlaps(int64_t a, int64_t a_span, int64_t b, int64_t b_span) {
    return a_span && b_span && a < b + b_span && b < a + a_span;
}

int64_t address_of(PyObject *tensor) {
    return (int64_t)(uintptr_t)THPVariable_Unpack(tensor).const_data_ptr();
}

enum Arg { RECORD, Q, K_CACHE, V_CACHE, K, V, LENS, TABLE, OUT, KEY_MASK, RETURN_LSE, STREAM, CHECK, N_ARGS };

// Whether each optional tensor argument is an exact tensor or None (hot.py's key has made sure; a mismatch here
// declines rather than reads a non-tensor).
bool plain(PyObject *const *args) {
    if (!THPVariable_CheckExact(args[Q]) || !THPVariable_CheckExact(args[K_CACHE]) ||
        !THPVariable_CheckExact(args[V_CACHE]))
        return false;
    for (int i : {K, V, TABLE, OUT, KEY_MASK})
        if (args[i] != Py_None && !THPVariable_CheckExact(args[i]))
            return false;
    return (args[K] == Py_None) == (args[V] == Py_None) &&
           (args[LENS] == Py_None || PyLong_CheckExact(args[LENS]) || THPVariable_CheckExact(args[LENS]));
}

PyObject *tail(PyObject *const *args) {
    PyObject *record = args[RECORD];
    PyObject *raw = PyList_GET_ITEM(record, LT_RECORD_HEADER);
    Header h;
    if (!PyBytes_CheckExact(raw) || PyBytes_GET_SIZE(raw) != (Py_ssize_t)sizeof h) {
        PyErr_SetString(PyExc_ValueError, "run(): malformed header");
        return nullptr;
    }
    memcpy(&h, PyBytes_AS_STRING(raw), sizeof h);
    int64_t length = 0;
    if (h.lens_int) {
        if (!PyLong_CheckExact(args[LENS]))
            Py_RETURN_NONE;
        int overflow = 0;
        length = PyLong_AsLongLongAndOverflow(args[LENS], &overflow);
        if (length == -1 && PyErr_Occurred())
            return nullptr;
        if (overflow || length < 0 || length > h.lens_max)
            Py_RETURN_NONE;  // the general path raises the range's error
    }
    bool new_keys = args[K] != Py_None;
    int64_t address[LT_ROLE_COUNT] = {0};
    address[LT_ROLE_Q] = address_of(args[Q]);
    address[LT_ROLE_K_CACHE] = address_of(args[K_CACHE]);
    address[LT_ROLE_V_CACHE] = address_of(args[V_CACHE]);
    int64_t kc = address[LT_ROLE_K_CACHE], vc = address[LT_ROLE_V_CACHE];
    if (overlaps(kc, h.span[LT_SPAN_K_CACHE], vc, h.span[LT_SPAN_V_CACHE]))
        Py_RETURN_NONE;  // caches sharing memory: the general path's rules (MLA's latent cache, or an error)
    if (new_keys) {
        address[LT_ROLE_K] = address_of(args[K]);
        address[LT_ROLE_V] = address_of(args[V]);
    }
    if (args[KEY_MASK] != Py_None)
        address[LT_ROLE_KEY_MASK] = address_of(args[KEY_MASK]);
    const at::Tensor &q = THPVariable_Unpack(args[Q]);
    at::Tensor out;
    if (h.allocate_out) {
        if (args[OUT] != Py_None)
            Py_RETURN_NONE;
        out = at::empty({h.out_size[0], h.out_size[1], h.out_size[2], h.out_size[3]}, q.options());
        address[LT_ROLE_OUT] = (int64_t)(uintptr_t)out.const_data_ptr();
    } else {
        if (args[OUT] == Py_None)
            Py_RETURN_NONE;
        int64_t o = address_of(args[OUT]), o_span = h.span[LT_SPAN_OUT];
        address[LT_ROLE_OUT] = o;
        if (overlaps(o, o_span, address[LT_ROLE_Q], h.span[LT_SPAN_Q]) || overlaps(o, o_span, kc, h.span[LT_SPAN_K_CACHE]) ||
            overlaps(o, o_span, vc, h.span[LT_SPAN_V_CACHE]) ||
            (new_keys && (overlaps(o, o_span, address[LT_ROLE_K], h.span[LT_SPAN_K]) ||
                          overlaps(o, o_span, address[LT_ROLE_V], h.span[LT_SPAN_V]))) ||
            (args[KEY_MASK] != Py_None && overlaps(o, o_span, address[LT_ROLE_KEY_MASK], h.span[LT_SPAN_KEY_MASK])))
            Py_RETURN_NONE;  // check_out's error, from the general path
    }
    int aligned = h.split_strides_aligned &&
                  !((address[LT_ROLE_Q] | kc | vc | address[LT_ROLE_OUT]) & 15);
    Owned split_item, append_item;  // held: the check below runs Python code
    split_item.p = item_at(record, LT_RECORD_SPLIT_UNALIGNED + aligned);
    if (split_item.p == nullptr)
        Py_RETURN_NONE;  // no plan memoised for this key yet: hot.py's Python run makes the item
    if (new_keys) {
        int new_aligned = h.append_strides_aligned &&
                          !((address[LT_ROLE_K] | address[LT_ROLE_V] | kc | vc) & 15);
        append_item.p = item_at(record, LT_RECORD_APPEND_UNALIGNED + new_aligned);
        if (append_item.p == nullptr)
            Py_RETURN_NONE;
    }
    uintptr_t stream = 0;
    int read = read_stream(args[STREAM], (int32_t)q.get_device(), &stream);  // None: q's device's current stream
    if (read <= 0) {
        if (read < 0)
            return nullptr;
        Py_RETURN_NONE;  // not read here: hot.py's Python run reads it
    }
    if (args[CHECK] != Py_None) {  // the index values' eager check (hot.py's Entry.check_values): raises
        PyObject *checked = PyObject_Vectorcall(args[CHECK], args + Q, TABLE - Q + 1, nullptr);  // q .. block_table
        if (checked == nullptr)
            return nullptr;
        Py_DECREF(checked);
    }
    Item split, combine, append;
    if (!read_item(&PyTuple_GET_ITEM(split_item.p, 0), &split))
        return nullptr;
    bool combines = PyTuple_GET_ITEM(split_item.p, LT_ITEM_COMBINE) != Py_None && split.launch.splits > 1;
    if (combines && !read_item(&PyTuple_GET_ITEM(split_item.p, LT_ITEM_COMBINE), &combine))
        return nullptr;
    if (new_keys && !read_item(&PyTuple_GET_ITEM(append_item.p, 0), &append))
        return nullptr;
    if (args[LENS] != Py_None && !h.lens_int)
        address[LT_ROLE_LENS] = address_of(args[LENS]);
    if (args[TABLE] != Py_None)
        address[LT_ROLE_TABLE] = address_of(args[TABLE]);
    int64_t splits = split.launch.splits, work_floats = split.launch.work_floats;
    bool return_lse = args[RETURN_LSE] == Py_True;
    at::Tensor lse, work;  // the workspace lives until the launches are made
    at::TensorOptions f32 = q.options().dtype(at::kFloat);
    if (return_lse) {
        lse = at::empty({h.lse_size[0], h.lse_size[1], h.lse_size[2]}, f32);
        address[LT_ROLE_LSE] = (int64_t)(uintptr_t)lse.const_data_ptr();
        if (splits > 1)
            work = at::empty({work_floats}, f32);
        address[LT_ROLE_PART_OUT] = splits > 1 ? (int64_t)(uintptr_t)work.const_data_ptr() : address[LT_ROLE_LSE];
    } else {  // lse at the workspace's end: one allocation
        work = at::empty({work_floats + h.lse_numel}, f32);
        address[LT_ROLE_PART_OUT] = (int64_t)(uintptr_t)work.const_data_ptr();
        address[LT_ROLE_LSE] = address[LT_ROLE_PART_OUT] + 4 * work_floats;
        if (splits <= 1)
            address[LT_ROLE_PART_OUT] = address[LT_ROLE_LSE];
    }
    address[LT_ROLE_PART_LSE] = splits > 1 ? address[LT_ROLE_PART_OUT] + split.launch.partial_lse : address[LT_ROLE_LSE];
    if (new_keys && !launch(append, address, length, stream))
        return nullptr;
    if (!launch(split, address, length, stream))
        return nullptr;
    if (combines && !launch(combine, address, length, stream))
        return nullptr;
    PyObject *out_obj;
    if (h.allocate_out) {
        out_obj = THPVariable_Wrap(std::move(out));
    } else {
        out_obj = args[OUT];
        Py_INCREF(out_obj);
    }
    if (out_obj == nullptr || !return_lse)
        return out_obj;
    return out_and_lse(out_obj, THPVariable_Wrap(std::move(lse)));
}

// run(record, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, key_mask, return_lse, stream, check)
//   -> out | (out, lse) | None
// record: the entry's list (hotpath_record.RECORD: header bytes, then the split and append items for unaligned and
// aligned pointers; an item is (launch, plan, fail, combine launch, combine plan, combine fail), None until its plan
// is memoised). stream: the raw stream handle (an int), or None: q's device's current stream, read here
// (STREAM_INSIDE). check: None, or the callable run() calls with (q, k_cache, v_cache, k, v, cache_seqlens,
// block_table) before it allocates the workspace (the eager index values' check; it raises). None: declined (an
// int length out of range, caches sharing memory, out overlapping an input, no item for the alignment): the caller
// goes on in Python.
PyObject *run(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS  // a c10::Error becomes the Python exception torch raises for it (OutOfMemoryError, ...)
    if (nargs != N_ARGS || !PyList_CheckExact(args[RECORD]) || PyList_GET_SIZE(args[RECORD]) != LT_RECORD_SIZE ||
        (args[CHECK] != Py_None && !PyCallable_Check(args[CHECK]))) {
        PyErr_SetString(PyExc_TypeError, "run(record, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, "
                                         "key_mask, return_lse, stream, check): hot.py's record expected");
        return nullptr;
    }
    if (!plain(args))
        Py_RETURN_NONE;  // a tensor subclass or an unexpected type: hot.py's Python run
    return tail(args);
    END_HANDLE_TH_ERRORS
}

// The entry lookup in C++ (hot.py's front): the key hot.py's serve() builds from some 40 Python attribute reads and
// a tuple hash (each tensor argument's sizes, strides, dtype and device, the length's kind, causal, the scale,
// num_splits, the fused-combine switch), read here from the TensorImpls into one fixed record and hashed. The table
// is a dict owned by hot.py's warm path: hash -> (key bytes, plans, record, check), filled by remember() each time
// hot.py's own lookup reaches run() with a record; serve() finds it there and runs tail(). The key bytes are
// compared whole (a hash collision is a miss), and plans must be the runtime's current dict (a settings change starts
// the runtime again: a miss, and hot.py describes the shape again). Whatever hot.py's lookup declines, serve()
// declines (None), as it does anything it does not recognise: hot.py's Python lookup then declines it or raises.

// One tensor argument: its dims, sizes and strides (the served calls' tensors have 4 dims at most), dtype and
// device; dim NO_TENSOR for None, INT_LENGTH for an int cache_seqlens (its value is no part of the key).
#define LT_KEY_DIMS 4
struct TensorKey {
    int64_t sizes[LT_KEY_DIMS];
    int64_t strides[LT_KEY_DIMS];
    int32_t dim, dtype, device_type, device_index;
};
enum { NO_TENSOR = -1, INT_LENGTH = -2 };
#define LT_KEY_TENSORS (KEY_MASK - Q + 1)  // q .. key_mask, run()'s order (Arg)
struct Key {
    TensorKey tensor[LT_KEY_TENSORS];
    double scale;
    int64_t num_splits;
    int32_t causal, scale_none, fused, unused;
};
static_assert(sizeof(TensorKey) == 80 && sizeof(Key) == LT_KEY_TENSORS * 80 + 32,
              "Key holds no padding: its bytes are its value");

// serve()'s and remember()'s arguments: hot.py's serve()'s (the public function's names), then their own.
enum FrontArg {
    F_Q, F_K_CACHE, F_V_CACHE, F_K, F_V, F_LENS, F_TABLE, F_SCALE, F_CAUSAL, F_SPLITS, F_ROTARY, F_RETURN_LSE, F_OUT,
    F_KEY_MASK, F_ENTRIES, F_PLANS, F_FUSED,
    F_REQUIRE_CUDA = F_FUSED + 1, F_STREAM, F_TRUSTED, F_SERVE_ARGS,  // serve()
    F_RECORD = F_FUSED + 1, F_CHECK, F_MOST, F_REMEMBER_ARGS,  // remember()
};
enum Device { ANY_DEVICE, CUDA_ONLY, CPU_ONLY };

// A tensor argument's part of the key (None: NO_TENSOR); false where hot.py's lookup would decline it (a tensor
// subclass, another type) or could not read it as the calls it serves have it (more than LT_KEY_DIMS dims, a layout
// without strides, symbolic sizes): the Python path's turn.
bool tensor_key(PyObject *obj, TensorKey *key) {
    if (obj == Py_None) {
        key->dim = NO_TENSOR;
        return true;
    }
    if (!THPVariable_CheckExact(obj))
        return false;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (t.layout() != at::kStrided || t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
        return false;
    int64_t dim = t.dim();
    if (dim > LT_KEY_DIMS)
        return false;
    key->dim = (int32_t)dim;
    for (int64_t d = 0; d < dim; d++) {
        key->sizes[d] = t.sizes()[d];
        key->strides[d] = t.strides()[d];
    }
    key->dtype = (int32_t)t.scalar_type();
    key->device_type = (int32_t)t.device().type();
    key->device_index = t.device().index();
    return true;
}

// The key of a call, or false where hot.py's serve() declines it before its lookup: q, k_cache or v_cache not an
// exact tensor, q not on CUDA (CUDA_ONLY) or not on the CPU (CPU_ONLY), causal or rotary_interleaved not a bool,
// softmax_scale not None or a float (nan: never described), num_splits not an int (a bool is not), cache_seqlens not
// None, an int or a tensor, k without v or v without k, a tensor argument that tensor_key refuses.
bool make_key(PyObject *const *args, Device device, int fused, Key *key) {
    memset(key, 0, sizeof *key);
    if (!THPVariable_CheckExact(args[F_Q]) || !THPVariable_CheckExact(args[F_K_CACHE]) ||
        !THPVariable_CheckExact(args[F_V_CACHE]))
        return false;
    const at::Tensor &q = THPVariable_Unpack(args[F_Q]);
    if ((device == CUDA_ONLY && !q.is_cuda()) || (device == CPU_ONLY && !q.is_cpu()))
        return false;
    PyObject *causal = args[F_CAUSAL], *splits = args[F_SPLITS], *rotary = args[F_ROTARY];
    if ((causal != Py_True && causal != Py_False) || (rotary != Py_True && rotary != Py_False))
        return false;
    key->causal = causal == Py_True;
    if (!read_scale(args[F_SCALE], &key->scale, &key->scale_none))
        return false;
    if (!PyLong_CheckExact(splits))
        return false;
    int overflow = 0;
    key->num_splits = PyLong_AsLongLongAndOverflow(splits, &overflow);
    if (overflow || (key->num_splits == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    key->fused = fused;
    if ((args[F_K] == Py_None) != (args[F_V] == Py_None))
        return false;
    PyObject *lens = args[F_LENS];
    TensorKey *tensor = key->tensor;
    if (PyLong_CheckExact(lens))
        tensor[LENS - Q].dim = INT_LENGTH;
    else if (!tensor_key(lens, &tensor[LENS - Q]))
        return false;
    const std::pair<FrontArg, Arg> tensors[] = {{F_Q, Q}, {F_K_CACHE, K_CACHE}, {F_V_CACHE, V_CACHE}, {F_K, K},
                                                {F_V, V}, {F_TABLE, TABLE}, {F_OUT, OUT}, {F_KEY_MASK, KEY_MASK}};
    for (const auto &[given, slot] : tensors)
        if (!tensor_key(args[given], &tensor[slot - Q]))
            return false;
    return true;
}

// The table's dict key: each present tensor's words and the scalars, a pair of words at a time,
// multiplied out to 128 bits with a salt of its place and folded; an absent tensor enters by its dim alone. The
// products are independent: ~40 ns with the Python int (CPU host, a read's 3 tensors) where one chain of multiplies
// over the whole 752-byte key took ~75.
uint64_t fold(uint64_t a, uint64_t b) {
    unsigned __int128 product = (unsigned __int128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

uint64_t key_hash(const Key &key) {
    constexpr size_t tensor_words = sizeof(TensorKey) / 8, scalar_words = (sizeof(Key) - sizeof key.tensor) / 8;
    static_assert(tensor_words % 2 == 0 && scalar_words % 2 == 0, "the words are folded in pairs");
    uint64_t words[sizeof(Key) / 8];
    memcpy(words, &key, sizeof key);
    uint64_t h = 0, dims = 0, place = 0;
    for (int i = 0; i < LT_KEY_TENSORS; i++) {
        dims = dims * 8 + (uint64_t)(key.tensor[i].dim - INT_LENGTH);  // 0 .. 6
        if (key.tensor[i].dim < 0)
            continue;
        const uint64_t *w = words + i * tensor_words;
        for (size_t j = 0; j < tensor_words; j += 2, place++)
            h ^= fold(w[j] ^ (0xa0761d6478bd642full * (place + 1)), w[j + 1] ^ 0xe7037ed1a0b428dbull);
    }
    const uint64_t *w = words + LT_KEY_TENSORS * tensor_words;
    for (size_t j = 0; j < scalar_words; j += 2, place++)
        h ^= fold(w[j] ^ (0xa0761d6478bd642full * (place + 1)), w[j + 1] ^ 0xe7037ed1a0b428dbull);
    return fold(h ^ dims, 0x8ebc6af09c88c6e3ull);
}

// serve(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits, rotary_interleaved,
//       return_lse, out, key_mask, table, plans, fused, require_cuda, stream, trusted) -> out | (out, lse) | None
// hot.py's serve()'s arguments, then: table, the dict remember() fills; plans, the runtime's current plans; fused,
// dispatch's fused-combine switch (part of the key); require_cuda, whether q must be on CUDA (else on the CPU: tests
// and profile_kvcache); stream, None (the current stream, read here: declined without torch's getter) or a callable
// giving the raw stream of a device index; trusted, hot.py's indices_trusted, called when the entry's check is
// there: the check runs only outside trusted_indices(). None: declined (a call hot.py declines, one not in the table,
// another runtime's plans, or one run() declines): the caller goes on in Python.
PyObject *serve(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != F_SERVE_ARGS || !PyDict_CheckExact(args[F_ENTRIES]) ||
        (args[F_STREAM] != Py_None && !PyCallable_Check(args[F_STREAM])) || !PyCallable_Check(args[F_TRUSTED])) {
        PyErr_SetString(PyExc_TypeError, "serve(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, "
                                         "causal, num_splits, rotary_interleaved, return_lse, out, key_mask, table, "
                                         "plans, fused, require_cuda, stream, trusted)");
        return nullptr;
    }
    int fused = PyObject_IsTrue(args[F_FUSED]), cuda = PyObject_IsTrue(args[F_REQUIRE_CUDA]);
    if (fused < 0 || cuda < 0)
        return nullptr;
    if (args[F_STREAM] == Py_None && stream_getter == nullptr)
        Py_RETURN_NONE;  // the stream read here, and torch offers no getter: hot.py reads it
    Key key;
    if (!make_key(args, cuda ? CUDA_ONLY : CPU_ONLY, fused, &key))
        Py_RETURN_NONE;
    PyObject *found = find_entry(args[F_ENTRIES], key_hash(key), &key, sizeof key, args[F_PLANS]);  // borrowed
    if (found == nullptr) {
        if (PyErr_Occurred())
            return nullptr;
        Py_RETURN_NONE;
    }
    PyObject *record = PyTuple_GET_ITEM(found, 2);
    if (!PyList_CheckExact(record) || PyList_GET_SIZE(record) != LT_RECORD_SIZE)
        Py_RETURN_NONE;
    Owned held;  // the entry stays alive through the check and the launches (which run Python code)
    Py_INCREF(found);
    held.p = found;
    PyObject *check = PyTuple_GET_ITEM(found, 3);
    if (check != Py_None) {  // the eager index values' check, outside trusted_indices()
        PyObject *trusted = PyObject_CallNoArgs(args[F_TRUSTED]);
        if (trusted == nullptr)
            return nullptr;
        int skip = PyObject_IsTrue(trusted);
        Py_DECREF(trusted);
        if (skip < 0)
            return nullptr;
        if (skip)
            check = Py_None;
    }
    Owned stream;  // None: tail() reads the current stream
    if (args[F_STREAM] == Py_None) {
        Py_INCREF(Py_None);
        stream.p = Py_None;
    } else {
        Owned device;
        device.p = PyLong_FromLong(THPVariable_Unpack(args[F_Q]).get_device());
        if (device.p == nullptr)
            return nullptr;
        stream.p = PyObject_CallOneArg(args[F_STREAM], device.p);
        if (stream.p == nullptr)
            return nullptr;
    }
    PyObject *tail_args[N_ARGS];
    tail_args[RECORD] = record;
    tail_args[Q] = args[F_Q];
    tail_args[K_CACHE] = args[F_K_CACHE];
    tail_args[V_CACHE] = args[F_V_CACHE];
    tail_args[K] = args[F_K];
    tail_args[V] = args[F_V];
    tail_args[LENS] = args[F_LENS];
    tail_args[TABLE] = args[F_TABLE];
    tail_args[OUT] = args[F_OUT];
    tail_args[KEY_MASK] = args[F_KEY_MASK];
    tail_args[RETURN_LSE] = args[F_RETURN_LSE];
    tail_args[STREAM] = stream.p;
    tail_args[CHECK] = check;
    return tail(tail_args);
    END_HANDLE_TH_ERRORS
}

// remember(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
//          rotary_interleaved, return_lse, out, key_mask, table, plans, fused, record, check, max entries) -> bool
// Files the entry's record (hot.py's list, which it goes on filling) and its eager check (Entry.check_values, or
// None where the call has no index tensor to check) under the call's key; the table is cleared first once it holds
// max entries. False when the call has no key (see make_key; its device is not checked): nothing filed.
PyObject *remember(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != F_REMEMBER_ARGS || !PyDict_CheckExact(args[F_ENTRIES]) || !PyList_CheckExact(args[F_RECORD]) ||
        PyList_GET_SIZE(args[F_RECORD]) != LT_RECORD_SIZE ||
        (args[F_CHECK] != Py_None && !PyCallable_Check(args[F_CHECK])) || !PyLong_CheckExact(args[F_MOST])) {
        PyErr_SetString(PyExc_TypeError, "remember(q, k_cache, v_cache, k, v, cache_seqlens, block_table, "
                                         "softmax_scale, causal, num_splits, rotary_interleaved, return_lse, out, "
                                         "key_mask, table, plans, fused, record, check, max entries)");
        return nullptr;
    }
    int fused = PyObject_IsTrue(args[F_FUSED]);
    if (fused < 0)
        return nullptr;
    Key key;
    if (!make_key(args, ANY_DEVICE, fused, &key))
        Py_RETURN_FALSE;
    return file_entry(args[F_ENTRIES], key_hash(key), &key, sizeof key, args[F_PLANS], args[F_RECORD], args[F_CHECK],
                      args[F_MOST]);
    END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(record, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, key_mask, return_lse, stream, check) "
     "-> out | (out, lse) | None: flash_decode's warm-path tail"},
    {"serve", (PyCFunction)(void (*)(void))serve, METH_FASTCALL,
     "serve(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits, "
     "rotary_interleaved, return_lse, out, key_mask, table, plans, fused, require_cuda, stream, trusted) "
     "-> out | (out, lse) | None: the entry lookup, then run()'s tail"},
    {"remember", (PyCFunction)(void (*)(void))remember, METH_FASTCALL,
     "remember(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits, "
     "rotary_interleaved, return_lse, out, key_mask, table, plans, fused, record, check, max entries) -> bool: "
     "file an entry's record for serve()"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMODINIT_FUNC PyInit__hotpath(void) { return create_module(methods, LT_INTERFACE, "LAYOUT", LT_LAYOUT); }
