/*
 * lt_xxh3.h: the two digests of cache_format/SPEC.md, XXH3-64 (every
 * checksum of an entry or image) and XXH3-128 (the cache key), with seed 0
 * and the default secret: the values Python's xxhash package gives
 * (xxh3_64_intdigest, xxh3_128_digest), in portable C99 with no library
 * and no header beyond the C library's.
 */
#ifndef LT_XXH3_H
#define LT_XXH3_H

#include <stddef.h>
#include <stdint.h>

/* XXH3-64 of size bytes at data (data may be NULL when size is 0). */
uint64_t ltn_xxh3_64(const void *data, size_t size);

/* XXH3-64 of a's a_size bytes followed by b's b_size bytes, as if they lay in one buffer (no allocation). */
uint64_t ltn_xxh3_64_pair(const void *a, size_t a_size, const void *b, size_t b_size);

/* XXH3-128 of size bytes at data in canonical form: the high 64 bits, then the low 64 bits, each
   big-endian (Python's xxh3_128_digest; its hex is xxh3_128_hexdigest, the cache key). */
void ltn_xxh3_128(const void *data, size_t size, uint8_t out[16]);

#endif
