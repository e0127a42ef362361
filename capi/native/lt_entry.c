/*
 * lt_entry.c: decoding an entry's bytes (cache_format/SPEC.md "Entry"), with the
 * checks of cache_format/entry.py and tensordesc.py: header, bounds, checksum,
 * msgpack within its bounds, exactly the schema's keys with their types, ints
 * in [0, 2^32), the kind, a binary, sane warps, the host descriptors, the key.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lt_native.h"

#define MAX_STR 4096
#define MAX_ARRAY 256
#define MAX_MAP 64

static const ltn_mp_bounds ENTRY_BOUNDS = {MAX_STR, LTN_MAX_ENTRY_BYTES, MAX_ARRAY, MAX_MAP, 0};

int ltn_fail(ltn_error *err, int status, const char *format, ...) {
    if (err != NULL) {
        va_list args;
        va_start(args, format);
        vsnprintf(err->message, sizeof err->message, format, args);
        va_end(args);
    }
    return status;
}

/* ---- a bump arena for the decoded strings and arrays ----------------------- */

typedef struct {
    uint8_t *base;
    size_t used, size;
} arena;

static void *arena_take(arena *a, size_t n) {
    size_t at = (a->used + 7) & ~(size_t)7;
    if (at > a->size || n > a->size - at)
        return NULL;
    a->used = at + n;
    return a->base + at;
}

static int copy_str(arena *a, const ltn_mp_value *v, ltn_str *out) {
    char *s = arena_take(a, (size_t)v->u + 1);
    if (s == NULL)
        return -1;
    memcpy(s, v->ptr, (size_t)v->u);
    s[v->u] = '\0';
    out->s = s;
    out->len = (uint32_t)v->u;
    return 0;
}

/* ---- maps with a fixed schema ----------------------------------------------- */

enum { T_STR, T_BIN, T_INT, T_FLOAT, T_LIST, T_MAP };

typedef struct {
    const char *name;
    int type;
} field;

/* One value per schema field: the reader positioned at it. */
typedef struct {
    ltn_mp_reader at[20];
} slots;

static const char *type_name(ltn_mp_type t) {
    static const char *names[] = {"NoneType", "bool", "int", "int", "float", "str", "bytes", "list", "dict",
                                  "ExtType"};
    return names[t];
}

/* Reads a map (the reader just past its head, n pairs) whose keys must be exactly the schema's names (a
   repeated key: the last one counts, as in a Python dict); each value's reader in slots, type-checked. */
static int schema_map(ltn_mp_reader *r, uint64_t n, const field *schema, size_t n_fields, slots *out,
                      const char *what, ltn_error *err) {
    uint32_t seen = 0;
    int extra = 0;
    for (uint64_t i = 0; i < n; i++) {
        ltn_mp_value key;
        if (ltn_mp_head(r, &key) != 0)
            return ltn_fail(err, LTN_DAMAGED, "%s: %s", what, r->error);
        size_t f = n_fields;
        if (key.type == LTN_MP_STR)
            for (f = 0; f < n_fields; f++)
                if (strlen(schema[f].name) == key.u && memcmp(schema[f].name, key.ptr, (size_t)key.u) == 0)
                    break;
        if (f == n_fields)
            extra = 1;
        else {
            seen |= 1u << f;
            out->at[f] = *r;
        }
        if (ltn_mp_skip(r) != 0)
            return ltn_fail(err, LTN_DAMAGED, "%s: %s", what, r->error);
    }
    if (extra || seen != (1u << n_fields) - 1)
        return ltn_fail(err, LTN_DAMAGED, "%s fields are not exactly the schema's (%s%s)", what,
                        extra ? "an extra or non-str key" : "missing ", extra ? "" : "a field");
    for (size_t f = 0; f < n_fields; f++) {
        ltn_mp_reader peek = out->at[f];
        ltn_mp_value v;
        ltn_mp_head(&peek, &v); /* read once already by the skip */
        static const ltn_mp_type wanted[] = {LTN_MP_STR, LTN_MP_BIN, LTN_MP_UINT, LTN_MP_FLOAT, LTN_MP_ARRAY,
                                             LTN_MP_MAP};
        int ok = v.type == wanted[schema[f].type] || (schema[f].type == T_INT && v.type == LTN_MP_NEGATIVE);
        if (!ok)
            return ltn_fail(err, LTN_DAMAGED, "%s field %s is %s, expected %s", what, schema[f].name,
                            type_name(v.type), type_name(wanted[schema[f].type]));
        if (schema[f].type == T_INT && (v.type == LTN_MP_NEGATIVE || v.u >= ((uint64_t)1 << 32)))
            return ltn_fail(err, LTN_DAMAGED, "%s field %s is out of range", what, schema[f].name);
    }
    return LTN_OK;
}

static ltn_mp_value value_of(const slots *s, int f) {
    ltn_mp_reader peek = s->at[f];
    ltn_mp_value v;
    ltn_mp_head(&peek, &v);
    return v;
}

enum {
    F_KEY, F_VARIANT, F_TARGET, F_KIND, F_BINARY, F_NAME, F_NUM_WARPS, F_NUM_CTAS, F_WARP_SIZE, F_SHARED,
    F_GS_SIZE, F_GS_ALIGN, F_PS_SIZE, F_PS_ALIGN, F_ARG_TYPES, F_HIDDEN_ARGS, F_PROVENANCE, F_TENSORDESC
};
static const field ENTRY_SCHEMA[] = {
    {"key", T_STR}, {"variant", T_STR}, {"target", T_STR}, {"kind", T_STR}, {"binary", T_BIN},
    {"name", T_STR}, {"num_warps", T_INT}, {"num_ctas", T_INT}, {"warp_size", T_INT}, {"shared", T_INT},
    {"global_scratch_size", T_INT}, {"global_scratch_align", T_INT}, {"profile_scratch_size", T_INT},
    {"profile_scratch_align", T_INT}, {"arg_types", T_LIST}, {"hidden_args", T_LIST}, {"provenance", T_MAP},
    {"tensordesc_meta", T_LIST},
};
enum { P_COMPILER, P_VERSION, P_FINGERPRINT, P_CREATED, P_ABI };
static const field PROVENANCE_SCHEMA[] = {
    {"compiler", T_STR}, {"compiler_version", T_STR}, {"source_fingerprint", T_STR}, {"created", T_FLOAT},
    {"launch_abi", T_INT},
};
enum { D_SWIZZLE, D_ELEM_SIZE, D_ELEM_TYPE, D_BLOCK };
static const field DESCRIPTOR_SCHEMA[] = {
    {"swizzle", T_INT}, {"elem_size", T_INT}, {"elem_type", T_INT}, {"block_size", T_LIST},
};

static int str_list(arena *a, const slots *s, int f, const ltn_str **out, uint32_t *count, ltn_error *err) {
    ltn_mp_reader r = s->at[f];
    ltn_mp_value v;
    ltn_mp_head(&r, &v);
    ltn_str *items = arena_take(a, sizeof *items * (size_t)(v.u ? v.u : 1));
    if (items == NULL)
        return ltn_fail(err, LTN_NOMEM, "entry decoder arena exhausted");
    for (uint64_t i = 0; i < v.u; i++) {
        ltn_mp_value item;
        ltn_mp_head(&r, &item);
        if (item.type != LTN_MP_STR)
            return ltn_fail(err, LTN_DAMAGED, "entry field %s must hold strings", ENTRY_SCHEMA[f].name);
        if (copy_str(a, &item, &items[i]) != 0)
            return ltn_fail(err, LTN_NOMEM, "entry decoder arena exhausted");
    }
    *out = items;
    *count = (uint32_t)v.u;
    return LTN_OK;
}

static int descriptors(arena *a, const slots *s, ltn_entry *e, ltn_error *err) {
    ltn_mp_reader r = s->at[F_TENSORDESC];
    ltn_mp_value list;
    ltn_mp_head(&r, &list);
    if (list.u == 0)
        return ltn_fail(err, LTN_DAMAGED, "entry format version 2 with no tensordesc_meta");
    ltn_tensordesc *metas = arena_take(a, sizeof *metas * (size_t)list.u);
    if (metas == NULL)
        return ltn_fail(err, LTN_NOMEM, "entry decoder arena exhausted");
    for (uint64_t i = 0; i < list.u; i++) {
        ltn_mp_value item;
        ltn_mp_reader start = r;
        if (ltn_mp_head(&r, &item) != 0 || item.type != LTN_MP_MAP)
            return ltn_fail(err, LTN_DAMAGED, "entry tensordesc_meta item %u is not a map", (unsigned)i);
        slots d;
        int status = schema_map(&r, item.u, DESCRIPTOR_SCHEMA, 4, &d, "entry tensordesc_meta", err);
        if (status != LTN_OK)
            return status;
        ltn_tensordesc *m = &metas[i];
        memset(m, 0, sizeof *m);
        m->swizzle = (uint32_t)value_of(&d, D_SWIZZLE).u;
        m->elem_size = (uint32_t)value_of(&d, D_ELEM_SIZE).u;
        m->elem_type = (uint32_t)value_of(&d, D_ELEM_TYPE).u;
        ltn_mp_reader b = d.at[D_BLOCK];
        ltn_mp_value block;
        ltn_mp_head(&b, &block);
        int in_range = block.u >= 1 && block.u <= LTN_MAX_RANK;
        for (uint64_t k = 0; k < block.u; k++) {
            ltn_mp_value dim;
            ltn_mp_head(&b, &dim);
            if (dim.type != LTN_MP_UINT && dim.type != LTN_MP_NEGATIVE)
                return ltn_fail(err, LTN_DAMAGED, "entry tensordesc_meta block_size must hold ints");
            if (dim.type == LTN_MP_NEGATIVE || dim.u < 1 || dim.u > 256)
                in_range = 0;
            else if (k < LTN_MAX_RANK)
                m->block_size[k] = (uint32_t)dim.u;
        }
        if (!in_range)
            return ltn_fail(err, LTN_DAMAGED, "entry host descriptors: descriptor block_size: 1 to %d dims, "
                            "each 1..256", LTN_MAX_RANK);
        m->rank = (uint32_t)block.u;
        r = start;
        ltn_mp_skip(&r);
    }
    e->tensordesc = metas;
    e->n_tensordesc = (uint32_t)list.u;
    return LTN_OK;
}

static int scalars(arena *a, const slots *s, ltn_entry *e, ltn_error *err) {
    ltn_str *strs[] = {&e->key, &e->variant, &e->target, &e->kind, NULL, &e->name};
    for (int f = F_KEY; f <= F_NAME; f++) {
        ltn_mp_value v = value_of(s, f);
        if (f == F_BINARY) {
            e->binary = v.ptr;
            e->binary_size = (size_t)v.u;
        } else if (copy_str(a, &v, strs[f]) != 0)
            return ltn_fail(err, LTN_NOMEM, "entry decoder arena exhausted");
    }
    uint32_t *ints[] = {&e->num_warps, &e->num_ctas, &e->warp_size, &e->shared, &e->global_scratch_size,
                        &e->global_scratch_align, &e->profile_scratch_size, &e->profile_scratch_align};
    for (int f = F_NUM_WARPS; f <= F_PS_ALIGN; f++)
        *ints[f - F_NUM_WARPS] = (uint32_t)value_of(s, f).u;
    return LTN_OK;
}

static int provenance(arena *a, const slots *s, ltn_entry *e, ltn_error *err) {
    ltn_mp_reader r = s->at[F_PROVENANCE];
    ltn_mp_value map;
    ltn_mp_head(&r, &map);
    slots p;
    int status = schema_map(&r, map.u, PROVENANCE_SCHEMA, 5, &p, "entry provenance", err);
    if (status != LTN_OK)
        return status;
    ltn_mp_value v;
    ltn_str *strs[] = {&e->compiler, &e->compiler_version, &e->source_fingerprint};
    for (int f = P_COMPILER; f <= P_FINGERPRINT; f++) {
        v = value_of(&p, f);
        if (copy_str(a, &v, strs[f]) != 0)
            return ltn_fail(err, LTN_NOMEM, "entry decoder arena exhausted");
    }
    e->created = value_of(&p, P_CREATED).f;
    e->launch_abi = (uint32_t)value_of(&p, P_ABI).u;
    return LTN_OK;
}

static int str_is(const ltn_str *s, const char *text) {
    return s->len == strlen(text) && memcmp(s->s, text, s->len) == 0;
}

static int decode_payload(const uint8_t *payload, size_t size, uint32_t version, ltn_entry *e, arena *a,
                          ltn_error *err) {
    ltn_mp_type top;
    const char *why;
    if (ltn_mp_check(payload, size, &ENTRY_BOUNDS, &top, &why) != 0)
        return ltn_fail(err, LTN_DAMAGED, "entry payload is not valid msgpack: %s", why);
    ltn_mp_reader r = {payload, payload + size, &ENTRY_BOUNDS, NULL};
    ltn_mp_value map;
    ltn_mp_head(&r, &map);
    if (map.type != LTN_MP_MAP)
        return ltn_fail(err, LTN_DAMAGED, "entry payload is a msgpack %s, not a map", type_name(map.type));
    slots s;
    size_t n_fields = version == 2 ? 18 : 17;
    int status = schema_map(&r, map.u, ENTRY_SCHEMA, n_fields, &s, "entry", err);
    if (status == LTN_OK)
        status = provenance(a, &s, e, err);
    if (status == LTN_OK && version == 2)
        status = descriptors(a, &s, e, err);
    if (status == LTN_OK)
        status = str_list(a, &s, F_ARG_TYPES, &e->arg_types, &e->n_arg_types, err);
    if (status == LTN_OK)
        status = str_list(a, &s, F_HIDDEN_ARGS, &e->hidden_args, &e->n_hidden_args, err);
    if (status == LTN_OK)
        status = scalars(a, &s, e, err);
    if (status != LTN_OK)
        return status;
    if (!str_is(&e->kind, "cubin") && !str_is(&e->kind, "hsaco"))
        return ltn_fail(err, LTN_DAMAGED, "entry kind is not cubin or hsaco");
    if (e->binary_size == 0)
        return ltn_fail(err, LTN_DAMAGED, "entry binary is empty");
    if (e->num_warps < 1 || e->num_warps > 32 || (e->warp_size != 32 && e->warp_size != 64))
        return ltn_fail(err, LTN_DAMAGED, "entry num_warps=%u warp_size=%u are not sane", e->num_warps,
                        e->warp_size);
    if (ltn_tensordesc_check(e->arg_types, e->n_arg_types, e->tensordesc, e->n_tensordesc, err) != 0)
        return LTN_DAMAGED;
    return LTN_OK;
}

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

int ltn_entry_decode_owned(uint8_t *data, size_t size, const char *expected_key, ltn_entry *out, ltn_error *err) {
    memset(out, 0, sizeof *out);
    int status = LTN_DAMAGED;
    if (size < LTN_ENTRY_HEADER)
        ltn_fail(err, status, "entry truncated: %zu bytes, header needs %d", size, LTN_ENTRY_HEADER);
    else if (size > LTN_MAX_ENTRY_BYTES)
        ltn_fail(err, status, "entry of %zu bytes exceeds the %u byte bound", size, LTN_MAX_ENTRY_BYTES);
    else if (memcmp(data, "LTENTRY\0", 8) != 0)
        ltn_fail(err, status, "not an entry: wrong magic");
    else if (le32(data + 8) != 1 && le32(data + 8) != 2)
        ltn_fail(err, status, "entry format version %u is not one of (1, 2)", le32(data + 8));
    else if (le32(data + 12) != size - LTN_ENTRY_HEADER)
        ltn_fail(err, status, "entry payload is %zu bytes, header says %u", size - LTN_ENTRY_HEADER,
                 le32(data + 12));
    else if (ltn_xxh3_64(data + LTN_ENTRY_HEADER, size - LTN_ENTRY_HEADER) != le64(data + 16))
        ltn_fail(err, status, "entry checksum mismatch");
    else
        status = LTN_OK;
    if (status != LTN_OK) {
        free(data);
        return status;
    }
    size_t payload = size - LTN_ENTRY_HEADER;
    /* The strings (at most 2 * MAX_ARRAY + 8 of them) copied with a NUL each, 8-byte aligned; the string and
       descriptor arrays. */
    arena a = {NULL, 0, payload + (2 * MAX_ARRAY + 16) * 16 + 2 * MAX_ARRAY * sizeof(ltn_str) +
                            MAX_ARRAY * sizeof(ltn_tensordesc)};
    a.base = malloc(a.size);
    if (a.base == NULL) {
        free(data);
        return ltn_fail(err, LTN_NOMEM, "cannot allocate %zu bytes to decode an entry", a.size);
    }
    out->owned_data_ = data;
    out->arena_ = a.base;
    out->format_version = le32(data + 8);
    status = decode_payload(data + LTN_ENTRY_HEADER, payload, out->format_version, out, &a, err);
    if (status == LTN_OK && expected_key != NULL &&
        (out->key.len != strlen(expected_key) || memcmp(out->key.s, expected_key, out->key.len) != 0))
        status = ltn_fail(err, LTN_DAMAGED, "entry holds key %.64s, expected %.64s", out->key.s, expected_key);
    if (status != LTN_OK)
        ltn_entry_free(out);
    return status;
}

int ltn_entry_decode(const uint8_t *data, size_t size, const char *expected_key, ltn_entry *out, ltn_error *err) {
    if (size > LTN_MAX_ENTRY_BYTES)
        return ltn_fail(err, LTN_DAMAGED, "entry of %zu bytes exceeds the %u byte bound", size,
                        LTN_MAX_ENTRY_BYTES);
    uint8_t *copy = malloc(size ? size : 1);
    if (copy == NULL)
        return ltn_fail(err, LTN_NOMEM, "cannot allocate %zu bytes for an entry", size);
    if (size)
        memcpy(copy, data, size);
    return ltn_entry_decode_owned(copy, size, expected_key, out, err);
}

void ltn_entry_free(ltn_entry *entry) {
    if (entry == NULL)
        return;
    free(entry->owned_data_);
    free(entry->arena_);
    memset(entry, 0, sizeof *entry);
}
