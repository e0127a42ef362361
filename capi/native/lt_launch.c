/*
 * lt_launch.c: what the native launcher passes a kernel, from its entry alone (lazytriton/driver/fastlaunch.py's
 * layout, and Triton's launcher): the kernel's own parameters in order, each host tensor descriptor as its
 * 128-byte CUtensorMap then its sizes (i32) and strides (i64), then Triton's hidden scratch pointers (NULL
 * where the entry's size is 0, else size x programs bytes). No driver calls here: lt_runtime.c makes them.
 */
#include <stdint.h>
#include <string.h>

#include "../lazytriton_native.h"
#include "lt_native.h"

/* cache_format/tensordesc.py's DEVICE_TO_HOST_DTYPE (Triton's TMA_DTYPE_DEVICE_TO_HOST, 3.6 and 3.9 alike). */
static uint32_t host_dtype(uint32_t elem_type) {
    return elem_type == 8 ? 10 : elem_type == 9 ? 8 : elem_type == 10 ? 9 : elem_type;
}

static int str_is(const ltn_str *s, const char *text) {
    return s->len == strlen(text) && memcmp(s->s, text, s->len) == 0;
}

/* A parameter passed from one value of its own size: a pointer, an integer, fp32. */
static int value_param(const ltn_str *type) {
    static const char *const kinds[] = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64", "fp32"};
    if (type->len > 0 && type->s[0] == '*')
        return 1;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (str_is(type, kinds[i]))
            return 1;
    return 0;
}

static int is_power_of_two(uint32_t x) { return x != 0 && (x & (x - 1)) == 0; }

static int hidden_layout(const ltn_entry *e, ltn_layout *l, ltn_error *err) {
    uint32_t sizes[2] = {e->global_scratch_size, e->profile_scratch_size};
    uint32_t aligns[2] = {e->global_scratch_align, e->profile_scratch_align};
    int seen[2] = {0, 0};
    if (e->n_hidden_args > 2)
        return ltn_fail(err, -1, "entry %s has %u hidden parameters; Triton appends at most global_scratch and "
                        "profile_scratch", e->key.s, e->n_hidden_args);
    for (uint32_t i = 0; i < e->n_hidden_args; i++) {
        int k = str_is(&e->hidden_args[i], "global_scratch") ? LTN_GLOBAL_SCRATCH
                : str_is(&e->hidden_args[i], "profile_scratch") ? LTN_PROFILE_SCRATCH : -1;
        if (k < 0 || seen[k]++)
            return ltn_fail(err, -1, "entry %s has a hidden parameter %.100s %s", e->key.s, e->hidden_args[i].s,
                            k < 0 ? "the launcher does not know" : "twice");
        l->hidden[i] = (uint32_t)k;
    }
    for (int k = 0; k < 2; k++) {
        l->scratch_size[k] = seen[k] ? sizes[k] : 0; /* a size without its parameter is not passed */
        l->scratch_align[k] = aligns[k] ? aligns[k] : 1;
        if (l->scratch_size[k] > 0 && !is_power_of_two(l->scratch_align[k]))
            return ltn_fail(err, -1, "entry %s: %s_align=%u is not a power of two", e->key.s,
                            k == LTN_GLOBAL_SCRATCH ? "global_scratch" : "profile_scratch", l->scratch_align[k]);
    }
    l->n_hidden = e->n_hidden_args;
    return 0;
}

int ltn_layout_of(const ltn_entry *e, ltn_layout *l, ltn_error *err) {
    memset(l, 0, sizeof *l);
    if (e->n_arg_types > sizeof l->desc_of)
        return ltn_fail(err, -1, "entry %s has %u parameters, more than %zu", e->key.s, e->n_arg_types,
                        sizeof l->desc_of);
    if (e->n_tensordesc > LTN_MAX_DESCS)
        return ltn_fail(err, -1, "entry %s takes %u host descriptors; the launcher takes at most %d", e->key.s,
                        e->n_tensordesc, LTN_MAX_DESCS);
    uint32_t params = 0;
    for (uint32_t i = 0; i < e->n_arg_types; i++) {
        const ltn_str *type = &e->arg_types[i];
        if (type->len >= 10 && memcmp(type->s, "tensordesc", 10) == 0) { /* checked by ltn_tensordesc_check */
            if (l->n_descs >= e->n_tensordesc)
                return ltn_fail(err, -1, "entry %s: descriptor parameter %.200s has no tensordesc_meta", e->key.s,
                                type->s);
            const ltn_tensordesc *m = &e->tensordesc[l->n_descs];
            ltn_desc_layout *d = &l->descs[l->n_descs];
            d->swizzle = m->swizzle, d->elem_size = m->elem_size, d->host_dtype = host_dtype(m->elem_type);
            d->rank = m->rank;
            for (uint32_t j = 0; j < m->rank; j++)
                d->box[j] = m->block_size[m->rank - 1 - j];
            l->desc_of[i] = (uint8_t)(++l->n_descs);
            params += 1 + 2 * m->rank;
        } else if (value_param(type)) {
            params++;
        } else {
            return ltn_fail(err, -1, "entry %s: parameter type %.200s is not supported by the launcher", e->key.s,
                            type->s);
        }
    }
    if (l->n_descs != e->n_tensordesc)
        return ltn_fail(err, -1, "entry %s: %u descriptor parameters for %u tensordesc_meta entries", e->key.s,
                        l->n_descs, e->n_tensordesc);
    if (hidden_layout(e, l, err) != 0)
        return -1;
    l->n_args = e->n_arg_types;
    l->n_params = params + l->n_hidden;
    l->num_ctas = e->num_ctas ? e->num_ctas : 1;
    if (l->n_params > LTN_MAX_PARAMS)
        return ltn_fail(err, -1, "entry %s takes %u parameters; the launcher passes at most %d", e->key.s,
                        l->n_params, LTN_MAX_PARAMS);
    return 0;
}

int ltn_scratch_bytes(const ltn_layout *l, const uint32_t grid[3], uint64_t bytes[2]) {
    uint64_t programs = (uint64_t)grid[0] * grid[1], total;
    int overflow = __builtin_mul_overflow(programs, (uint64_t)grid[2], &programs) ||
                   __builtin_mul_overflow(programs, (uint64_t)l->num_ctas, &programs);
    for (int k = 0; k < 2; k++) {
        overflow |= __builtin_mul_overflow(programs, (uint64_t)l->scratch_size[k], &total);
        bytes[k] = overflow ? 0 : total;
    }
    return overflow ? -1 : 0;
}

int ltn_encode_call_of(const ltn_layout *l, uint32_t d, uint32_t arg, const void *value, ltn_encode_call *c,
                       ltn_error *err) {
    const ltn_desc_layout *desc = &l->descs[d];
    const lt_tensor_descriptor *v = value;
    uint32_t r = desc->rank;
    memset(c, 0, sizeof *c);
    if (v == NULL)
        return ltn_fail(err, -1, "parameter %u (host descriptor %u): args[%u] is NULL", arg, d, arg);
    if ((uintptr_t)v->base % 16 != 0)
        return ltn_fail(err, -1, "parameter %u (host descriptor %u): base %p is not 16-byte aligned", arg, d,
                        v->base);
    if (v->strides[r - 1] != 1)
        return ltn_fail(err, -1, "parameter %u (host descriptor %u): the innermost stride must be 1, got %lld", arg,
                        d, (long long)v->strides[r - 1]);
    for (uint32_t j = 0; j < r; j++) {
        uint32_t i = r - 1 - j; /* innermost first */
        if (v->sizes[i] < 1 || v->sizes[i] > INT32_MAX)
            return ltn_fail(err, -1, "parameter %u (host descriptor %u): sizes[%u]=%lld, expected 1..2^31-1", arg,
                            d, i, (long long)v->sizes[i]);
        if (v->strides[i] < 0 || v->strides[i] > ((int64_t)1 << 40) / desc->elem_size ||
            (j > 0 && v->strides[i] * desc->elem_size % 16 != 0))
            return ltn_fail(err, -1, "parameter %u (host descriptor %u): strides[%u]=%lld elements of %u bytes; "
                            "a descriptor's outer strides are multiples of 16 bytes below 2^40", arg, d, i,
                            (long long)v->strides[i], desc->elem_size);
        c->dims[j] = (uint64_t)v->sizes[i];
        c->box[j] = desc->box[j];
        c->element_strides[j] = 1;
        if (j > 0)
            c->strides[j - 1] = (uint64_t)v->strides[i] * desc->elem_size;
    }
    /* no interleave, L2 promotion 128B, zero fill: Triton's fillTMADescriptorTiled */
    c->dtype = (int)desc->host_dtype, c->rank = r, c->base = v->base, c->interleave = 0;
    c->swizzle = (int)desc->swizzle, c->l2 = 2, c->oob = 0;
    return 0;
}

void ltn_params(const ltn_layout *l, void **args, unsigned char (*maps)[128], void *const *scratch, void **params) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < l->n_args; i++) {
        if (l->desc_of[i] == 0) {
            params[n++] = args[i];
            continue;
        }
        uint32_t d = l->desc_of[i] - 1u, r = l->descs[d].rank;
        lt_tensor_descriptor *v = args[i];
        params[n++] = maps[d];
        for (uint32_t j = 0; j < r; j++) /* i32: the driver reads the low half (little-endian hosts) */
            params[n++] = &v->sizes[j];
        for (uint32_t j = 0; j < r; j++)
            params[n++] = &v->strides[j];
    }
    for (uint32_t h = 0; h < l->n_hidden; h++)
        params[n++] = (void *)&scratch[l->hidden[h]];
}
