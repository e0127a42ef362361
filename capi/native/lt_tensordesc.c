/*
 * lt_tensordesc.c: the host descriptors an entry of format version 2 carries
 * (cache_format/tensordesc.py, check): one meta per `tensordesc<dtype[block]>`
 * parameter, in order, each something cuTensorMapEncodeTiled can encode.
 */
#include <string.h>

#include "lt_native.h"

static int is_descriptor(const ltn_str *kind) { return kind->len >= 10 && memcmp(kind->s, "tensordesc", 10) == 0; }

static int contains(const ltn_str *s, const char *needle) {
    size_t n = strlen(needle);
    for (size_t i = 0; i + n <= s->len; i++)
        if (memcmp(s->s + i, needle, n) == 0)
            return 1;
    return 0;
}

/* The element size of a Triton dtype name a descriptor may hold, 0 for any other. */
static uint32_t elem_size(const char *dtype, size_t n) {
    static const struct { const char *name; uint32_t size; } sizes[] = {
        {"i8", 1}, {"u8", 1}, {"fp8e4nv", 1}, {"fp8e5", 1}, {"fp8e4b15", 1}, {"i16", 2}, {"u16", 2},
        {"fp16", 2}, {"bf16", 2}, {"i32", 4}, {"u32", 4}, {"fp32", 4}, {"i64", 8}, {"u64", 8}, {"fp64", 8},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (strlen(sizes[i].name) == n && memcmp(sizes[i].name, dtype, n) == 0)
            return sizes[i].size;
    return 0;
}

/* tensordesc<([a-z0-9]+)\[([0-9, ]+)\](,[^>]*)?> in full, without "input_rank", each comma-separated dim
   digits once stripped of spaces, 1..5 of them: the dtype's element size (0 if unknown) and the rank. */
static int parse_type(const ltn_str *kind, uint32_t *size, uint32_t *rank) {
    const char *s = kind->s, *end = kind->s + kind->len;
    if (contains(kind, "input_rank") || kind->len < 11 || memcmp(s, "tensordesc<", 11) != 0)
        return -1;
    const char *dtype = s += 11;
    while (s < end && ((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9')))
        s++;
    if (s == dtype || s == end || *s != '[')
        return -1;
    *size = elem_size(dtype, (size_t)(s - dtype));
    const char *dims = ++s;
    while (s < end && ((*s >= '0' && *s <= '9') || *s == ',' || *s == ' '))
        s++;
    if (s == dims || s == end || *s != ']')
        return -1;
    const char *dims_end = s++;
    if (s < end && *s == ',')
        while (s < end && *s != '>')
            s++;
    if (s != end - 1 || *s != '>')
        return -1;
    *rank = 0;
    for (const char *p = dims; p <= dims_end; p++) { /* each piece between commas: digits, spaces around */
        const char *start = p;
        while (p < dims_end && *p != ',')
            p++;
        const char *a = start, *b = p;
        while (a < b && *a == ' ')
            a++;
        while (b > a && b[-1] == ' ')
            b--;
        if (a == b)
            return -1;
        for (const char *c = a; c < b; c++)
            if (*c < '0' || *c > '9')
                return -1;
        ++*rank;
    }
    return *rank >= 1 && *rank <= LTN_MAX_RANK ? 0 : -1;
}

static int check_one(const ltn_tensordesc *m, ltn_error *err) {
    static const uint32_t span[] = {0, 32, 64, 128};
    if (m->swizzle > 3)
        return ltn_fail(err, -1, "entry host descriptors: swizzle=%u, expected 0..3", m->swizzle);
    if (m->elem_size != 1 && m->elem_size != 2 && m->elem_size != 4 && m->elem_size != 8)
        return ltn_fail(err, -1, "entry host descriptors: elem_size=%u, expected 1, 2, 4 or 8", m->elem_size);
    if (m->elem_type > 15)
        return ltn_fail(err, -1, "entry host descriptors: elem_type=%u, expected 0..15", m->elem_type);
    if (m->rank < 1 || m->rank > LTN_MAX_RANK)
        return ltn_fail(err, -1, "entry host descriptors: block of %u dims", m->rank);
    for (uint32_t i = 0; i < m->rank; i++)
        if (m->block_size[i] < 1 || m->block_size[i] > 256)
            return ltn_fail(err, -1, "entry host descriptors: block dim %u outside 1..256", m->block_size[i]);
    uint32_t inner = m->block_size[m->rank - 1] * m->elem_size;
    if (span[m->swizzle] && inner > span[m->swizzle])
        return ltn_fail(err, -1, "entry host descriptors: the inner box (%u bytes) exceeds the %u-byte swizzle "
                        "span", inner, span[m->swizzle]);
    return 0;
}

int ltn_tensordesc_check(const ltn_str *arg_types, uint32_t n_arg_types, const ltn_tensordesc *metas,
                         uint32_t n_metas, ltn_error *err) {
    uint32_t kinds = 0;
    for (uint32_t i = 0; i < n_arg_types; i++)
        kinds += is_descriptor(&arg_types[i]);
    if (kinds != n_metas)
        return ltn_fail(err, -1, "entry host descriptors: %u descriptor parameters but %u tensordesc_meta "
                        "entries", kinds, n_metas);
    uint32_t m = 0;
    for (uint32_t i = 0; i < n_arg_types; i++) {
        if (!is_descriptor(&arg_types[i]))
            continue;
        uint32_t size = 0, rank = 0;
        if (parse_type(&arg_types[i], &size, &rank) != 0)
            return ltn_fail(err, -1, "entry host descriptors: parameter type %.200s is not a tiled host "
                            "descriptor type (tensordesc<dtype[block]>)", arg_types[i].s);
        if (check_one(&metas[m], err) != 0)
            return -1;
        if (rank != metas[m].rank)
            return ltn_fail(err, -1, "entry host descriptors: parameter %.200s has rank %u, its block %u",
                            arg_types[i].s, rank, metas[m].rank);
        if (size != metas[m].elem_size)
            return ltn_fail(err, -1, "entry host descriptors: parameter %.200s: elem_size=%u, expected %u",
                            arg_types[i].s, metas[m].elem_size, size);
        m++;
    }
    return 0;
}
