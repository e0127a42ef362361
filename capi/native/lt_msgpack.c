/*
 * lt_msgpack.c: a bounded msgpack reader, the subset of msgpack-python's unpackb
 * that the entry and image readers rely on: the same limits on string, binary,
 * array, map and ext lengths, strict UTF-8 strings (raw=False), map keys str or
 * bin only (strict_map_key), containers nested at most 1024 deep, no data
 * after the value. It never allocates: values point into the buffer.
 */
#include <string.h>

#include "lt_native.h"

#define LTN_MP_MAX_DEPTH 1024 /* msgpack-python refuses a 1025th nested container (StackError) */

static int fail(ltn_mp_reader *r, const char *why) {
    r->error = why;
    return -1;
}

static int take(ltn_mp_reader *r, size_t n, const uint8_t **at) {
    if ((size_t)(r->end - r->p) < n)
        return fail(r, "msgpack value truncated");
    *at = r->p;
    r->p += n;
    return 0;
}

static uint64_t big_endian(const uint8_t *p, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

static int read_uint(ltn_mp_reader *r, size_t n, uint64_t *v) {
    const uint8_t *at;
    if (take(r, n, &at) != 0)
        return -1;
    *v = big_endian(at, n);
    return 0;
}

/* Strict UTF-8, as Python's decoder: no overlong forms, no surrogates, nothing past U+10FFFF. */
static int utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t more;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            more = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            more = 2;
            if (c == 0xE0)
                lo = 0xA0;
            else if (c == 0xED)
                hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            more = 3;
            if (c == 0xF0)
                lo = 0x90;
            else if (c == 0xF4)
                hi = 0x8F;
        } else
            return 0;
        if (n - i - 1 < more)
            return 0;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (size_t k = 2; k <= more; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF)
                return 0;
        i += more + 1;
    }
    return 1;
}

static int bytes_value(ltn_mp_reader *r, ltn_mp_value *v, ltn_mp_type type, uint64_t n) {
    const ltn_mp_bounds *b = r->bounds;
    if (type == LTN_MP_STR && n > b->max_str)
        return fail(r, "msgpack string over its bound");
    if (type == LTN_MP_BIN && n > b->max_bin)
        return fail(r, "msgpack binary over its bound");
    v->type = type;
    v->u = n;
    if (take(r, (size_t)n, &v->ptr) != 0)
        return -1;
    if (type == LTN_MP_STR && !utf8_valid(v->ptr, (size_t)n))
        return fail(r, "msgpack string is not valid UTF-8");
    return 0;
}

static int ext_value(ltn_mp_reader *r, ltn_mp_value *v, uint64_t n) {
    const uint8_t *code;
    if (n > r->bounds->max_ext)
        return fail(r, "msgpack ext over its bound");
    if (take(r, 1, &code) != 0)
        return -1;
    v->type = LTN_MP_EXT;
    v->u = n;
    if (take(r, (size_t)n, &v->ptr) != 0)
        return -1;
    if (*code == 0xFF) { /* ext -1, a timestamp: msgpack-python decodes it and refuses a malformed one */
        if (n == 4)
            return 0;
        if (n == 8 && (big_endian(v->ptr, 8) >> 34) < 1000000000u)
            return 0;
        if (n == 12 && big_endian(v->ptr, 4) < 1000000000u)
            return 0;
        return fail(r, "msgpack timestamp is malformed");
    }
    return 0;
}

static int container(ltn_mp_reader *r, ltn_mp_value *v, ltn_mp_type type, uint64_t n) {
    if (type == LTN_MP_ARRAY && n > r->bounds->max_array)
        return fail(r, "msgpack array over its bound");
    if (type == LTN_MP_MAP && n > r->bounds->max_map)
        return fail(r, "msgpack map over its bound");
    v->type = type;
    v->u = n;
    return 0;
}

static int integer(ltn_mp_reader *r, ltn_mp_value *v, size_t n, int is_signed) {
    uint64_t raw;
    if (read_uint(r, n, &raw) != 0)
        return -1;
    if (is_signed) {
        int shift = (int)(64 - 8 * n);
        int64_t value = (int64_t)(raw << shift) >> shift; /* sign-extend */
        v->type = value < 0 ? LTN_MP_NEGATIVE : LTN_MP_UINT;
        v->u = (uint64_t)value;
        return 0;
    }
    v->type = LTN_MP_UINT;
    v->u = raw;
    return 0;
}

int ltn_mp_head(ltn_mp_reader *r, ltn_mp_value *v) {
    const uint8_t *at;
    uint64_t n;
    memset(v, 0, sizeof *v);
    if (take(r, 1, &at) != 0)
        return -1;
    uint8_t c = *at;
    if (c <= 0x7F) {
        v->type = LTN_MP_UINT;
        v->u = c;
        return 0;
    }
    if (c >= 0xE0) {
        v->type = LTN_MP_NEGATIVE;
        v->u = (uint64_t)(int64_t)(int8_t)c;
        return 0;
    }
    if (c <= 0x8F)
        return container(r, v, LTN_MP_MAP, c & 0x0F);
    if (c <= 0x9F)
        return container(r, v, LTN_MP_ARRAY, c & 0x0F);
    if (c <= 0xBF)
        return bytes_value(r, v, LTN_MP_STR, c & 0x1F);
    switch (c) {
    case 0xC0: v->type = LTN_MP_NIL; return 0;
    case 0xC2: case 0xC3: v->type = LTN_MP_BOOL; v->u = c == 0xC3; return 0;
    case 0xC4: case 0xC5: case 0xC6:
        if (read_uint(r, (size_t)1 << (c - 0xC4), &n) != 0)
            return -1;
        return bytes_value(r, v, LTN_MP_BIN, n);
    case 0xC7: case 0xC8: case 0xC9:
        if (read_uint(r, (size_t)1 << (c - 0xC7), &n) != 0)
            return -1;
        return ext_value(r, v, n);
    case 0xCA: {
        uint64_t bits;
        if (read_uint(r, 4, &bits) != 0)
            return -1;
        uint32_t b32 = (uint32_t)bits;
        float f;
        memcpy(&f, &b32, sizeof f);
        v->type = LTN_MP_FLOAT;
        v->f = f;
        return 0;
    }
    case 0xCB: {
        uint64_t bits;
        if (read_uint(r, 8, &bits) != 0)
            return -1;
        memcpy(&v->f, &bits, sizeof v->f);
        v->type = LTN_MP_FLOAT;
        return 0;
    }
    case 0xCC: case 0xCD: case 0xCE: case 0xCF: return integer(r, v, (size_t)1 << (c - 0xCC), 0);
    case 0xD0: case 0xD1: case 0xD2: case 0xD3: return integer(r, v, (size_t)1 << (c - 0xD0), 1);
    case 0xD4: case 0xD5: case 0xD6: case 0xD7: case 0xD8: return ext_value(r, v, (uint64_t)1 << (c - 0xD4));
    case 0xD9: case 0xDA: case 0xDB:
        if (read_uint(r, (size_t)1 << (c - 0xD9), &n) != 0)
            return -1;
        return bytes_value(r, v, LTN_MP_STR, n);
    case 0xDC: case 0xDD:
        if (read_uint(r, (size_t)2 << (c - 0xDC), &n) != 0)
            return -1;
        return container(r, v, LTN_MP_ARRAY, n);
    case 0xDE: case 0xDF:
        if (read_uint(r, (size_t)2 << (c - 0xDE), &n) != 0)
            return -1;
        return container(r, v, LTN_MP_MAP, n);
    default: /* 0xC1, never used */
        return fail(r, "msgpack byte 0xc1 is not a value");
    }
}

static int skip(ltn_mp_reader *r, int depth) {
    ltn_mp_value v;
    if (ltn_mp_head(r, &v) != 0)
        return -1;
    if (v.type != LTN_MP_ARRAY && v.type != LTN_MP_MAP)
        return 0;
    if (depth >= LTN_MP_MAX_DEPTH)
        return fail(r, "msgpack containers nested too deep");
    for (uint64_t i = 0; i < v.u; i++) {
        if (v.type == LTN_MP_MAP) {
            ltn_mp_value key;
            if (ltn_mp_head(r, &key) != 0)
                return -1;
            if (key.type != LTN_MP_STR && key.type != LTN_MP_BIN)
                return fail(r, "msgpack map key is neither str nor bin");
        }
        if (skip(r, depth + 1) != 0)
            return -1;
    }
    return 0;
}

int ltn_mp_skip(ltn_mp_reader *r) { return skip(r, 0); }

int ltn_mp_check(const uint8_t *data, size_t size, const ltn_mp_bounds *bounds, ltn_mp_type *top, const char **why) {
    ltn_mp_reader r = {data, data + size, bounds, NULL};
    ltn_mp_reader peek = r;
    ltn_mp_value v;
    if (ltn_mp_skip(&r) != 0) {
        *why = r.error;
        return -1;
    }
    if (r.p != r.end) {
        *why = "data after the msgpack value";
        return -1;
    }
    ltn_mp_head(&peek, &v);
    *top = v.type;
    return 0;
}
