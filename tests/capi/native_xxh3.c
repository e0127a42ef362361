/*
 * native_xxh3.c: the native core's digests (capi/native/lt_xxh3.c) over inputs
 * from tests/test_native_xxh3.py.
 *
 * Reads records from stdin until it ends: the input's length and a split point
 * (each 8 bytes, little-endian), then the input. Answers each with one line:
 * XXH3-64 (16 hex digits), XXH3-128 in canonical form (32 hex digits), and
 * XXH3-64 of the input given as two separate buffers cut at the split point.
 * Each input is hashed from an address 1 to 7 bytes past a malloc'd one, so a
 * read that assumes alignment shows under UBSan.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lt_xxh3.h"

#define MAX_INPUT ((size_t)64 << 20)

static int read_exact(void *buf, size_t size) { return fread(buf, 1, size, stdin) == size ? 0 : -1; }

static size_t read_le64(const unsigned char *p) {
    unsigned long long v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v > MAX_INPUT ? MAX_INPUT + 1 : (size_t)v;
}

int main(void) {
    unsigned char head[16];
    for (unsigned long long count = 0; read_exact(head, 16) == 0; count++) {
        size_t size = read_le64(head), split = read_le64(head + 8);
        if (size > MAX_INPUT || split > size) {
            fprintf(stderr, "record %llu: size %zu or split %zu out of bounds\n", count, size, split);
            return 2;
        }
        size_t shift = 1 + count % 7;
        unsigned char *base = malloc(size + 8), *tail = malloc(size - split + 1);
        if (base == NULL || tail == NULL) {
            fprintf(stderr, "record %llu: cannot allocate %zu bytes\n", count, size);
            return 2;
        }
        unsigned char *data = base + shift;
        if (read_exact(data, size) != 0) {
            fprintf(stderr, "record %llu: the input ends within its %zu bytes\n", count, size);
            return 2;
        }
        memcpy(tail, data + split, size - split);
        uint8_t digest[16];
        ltn_xxh3_128(data, size, digest);
        printf("%016llx ", (unsigned long long)ltn_xxh3_64(data, size));
        for (int i = 0; i < 16; i++)
            printf("%02x", digest[i]);
        printf(" %016llx\n", (unsigned long long)ltn_xxh3_64_pair(data, split, tail, size - split));
        fflush(stdout);
        free(base);
        free(tail);
    }
    return feof(stdin) ? 0 : 2;
}
