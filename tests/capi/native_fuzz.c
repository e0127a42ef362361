/*
 * native_fuzz: a bounded, deterministic mutation fuzzer of the native core's image and entry readers
 * (tests/test_native_fuzz.py builds it with ASan and UBSan and runs it in CI).
 *
 * native_fuzz image|entry SEED_FILE ITERATIONS SEED SCRATCH_FILE: each iteration mutates the seed's bytes (bit
 * flips, random bytes, 32-bit boundary values, truncation, a copied range; 1 to 8 of them, from a xorshift
 * generator seeded by SEED) and reads the result as an image (written to SCRATCH_FILE: open, then every index
 * record's entry) or as an entry (its payload mutated and its header's length and checksum made to match, so
 * the mutations reach the msgpack and schema checks behind the checksum). Any byte sequence must give a status, never a crash, a leak or undefined
 * behaviour (the sanitizers abort on those). Prints one JSON line of how many of each verdict.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lt_native.h"

static uint64_t state;

static uint64_t next(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
}

static size_t mutate(uint8_t *data, size_t size, size_t capacity) {
    int n = 1 + (int)(next() % 8);
    for (int i = 0; i < n && size > 0; i++) {
        size_t at = (size_t)(next() % size);
        switch (next() % 6) {
        case 0: data[at] ^= (uint8_t)(1u << (next() % 8)); break;
        case 1: data[at] = (uint8_t)next(); break;
        case 2: { /* a 32-bit boundary value: sizes and offsets at their limits */
            static const uint32_t values[] = {0, 1, 0x7fffffffu, 0x80000000u, 0xffffffffu, 0x10000u};
            uint32_t v = values[next() % 6];
            if (at + 4 <= size)
                memcpy(data + at, &v, 4);
            break;
        }
        case 3: size = at; break;
        case 4: { /* copy a range over another */
            size_t from = (size_t)(next() % size), len = (size_t)(next() % 64);
            if (from + len <= size && at + len <= size)
                memmove(data + at, data + from, len);
            break;
        }
        default: /* grow by repeating the tail */
            if (size < capacity)
                data[size] = data[at], size++;
        }
    }
    return size;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: native_fuzz image|entry SEED_FILE ITERATIONS SEED SCRATCH_FILE\n");
        return 2;
    }
    int image_mode = strcmp(argv[1], "image") == 0;
    FILE *f = fopen(argv[2], "rb");
    if (f == NULL)
        return 2;
    static uint8_t seed[1 << 20], work[(1 << 20) + 4096];
    size_t seed_size = fread(seed, 1, sizeof seed, f);
    fclose(f);
    long iterations = atol(argv[3]);
    state = (uint64_t)atoll(argv[4]) * 2654435761u + 1;
    long verdicts[6] = {0}, entries_read = 0;
    for (long it = 0; it < iterations; it++) {
        memcpy(work, seed, seed_size);
        size_t size = mutate(work, seed_size, sizeof work);
        ltn_error err;
        if (!image_mode) {
            if (seed_size > LTN_ENTRY_HEADER) { /* payload mutations under a header that still matches */
                memcpy(work, seed, seed_size);
                size = LTN_ENTRY_HEADER + mutate(work + LTN_ENTRY_HEADER, seed_size - LTN_ENTRY_HEADER,
                                                 sizeof work - LTN_ENTRY_HEADER);
                uint32_t length = (uint32_t)(size - LTN_ENTRY_HEADER);
                uint64_t checksum = ltn_xxh3_64(work + LTN_ENTRY_HEADER, length);
                memcpy(work + 12, &length, 4); /* "<8sIIQ": magic, version, length, xxh3-64 (little-endian) */
                memcpy(work + 16, &checksum, 8);
            }
            ltn_entry entry;
            int status = ltn_entry_decode(work, size, NULL, &entry, &err);
            verdicts[status]++;
            if (status == LTN_OK)
                ltn_entry_free(&entry);
            continue;
        }
        FILE *out = fopen(argv[5], "wb");
        if (out == NULL || fwrite(work, 1, size, out) != size)
            return 3;
        fclose(out);
        ltn_image *image = NULL;
        int status = ltn_image_open(argv[5], &image, &err);
        verdicts[status]++;
        if (status != LTN_OK)
            continue;
        for (uint32_t i = 0; i < ltn_image_count(image); i++) {
            char key[33];
            ltn_entry entry;
            ltn_image_key_at(image, i, key);
            if (ltn_image_read(image, key, &entry, &err) == LTN_OK) {
                entries_read++;
                ltn_entry_free(&entry);
            }
        }
        ltn_image_close(image);
    }
    printf("{\"ok\":%ld,\"absent\":%ld,\"damaged\":%ld,\"io\":%ld,\"nomem\":%ld,\"argument\":%ld,\"entries_read\":%ld}\n",
           verdicts[0], verdicts[1], verdicts[2], verdicts[3], verdicts[4], verdicts[5], entries_read);
    return 0;
}
