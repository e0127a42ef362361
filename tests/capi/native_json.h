/* native_json.h: what the native core's test programs print with (tests/capi/native_launch.c, native_front.c,
   native_kvcache.c, native_requests.h; benchmarks/native_first_launch.c): JSON strings, lt_cache_stats' counts, and
   the fake libcuda's record of the last launch (tests/fake_libcuda.py). Inline, so a program that calls some of
   them builds under -Wall -Werror. */
#ifndef NATIVE_JSON_H
#define NATIVE_JSON_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "lazytriton.h"

/* s as a JSON string (NULL as ""). */
static inline void json_str(const char *s) {
    putchar('"');
    for (; s && *s; s++)
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else if ((unsigned char)*s < 0x20)
            printf("\\u%04x", *s);
        else
            putchar(*s);
    putchar('"');
}

/* ,"stats":lt_cache_stats' status,"plans":the plans,"image_entries":the entries the images hold */
static inline void print_cache_stats(void) {
    lt_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats, stats.version = LT_STATS_VERSION;
    int status = lt_cache_stats(&stats);
    printf(",\"stats\":%d,\"plans\":%llu,\"image_entries\":%llu", status, (unsigned long long)stats.plans,
           (unsigned long long)stats.image_entries);
}

typedef void (*fake_read_fn)(unsigned char *, int *, long long *, int *);

/* ,"state":[the fake's 13 counters],"params":[each of the n parameters' first sizes[i] bytes, -1 for NULL] */
static inline void print_fake_launch(fake_read_fn read, int n, const int *sizes) {
    static unsigned char seen[128 * 1024];
    int nulls[1024], aligns[1024];
    long long state[16];
    read(seen, nulls, state, aligns);
    printf(",\"state\":[");
    for (int i = 0; i < 13; i++)
        printf("%s%lld", i ? "," : "", state[i]);
    printf("],\"params\":[");
    for (int i = 0; i < n; i++) {
        long long v = 0;
        if (sizes[i] == 4) {
            int32_t v32;
            memcpy(&v32, seen + 128 * i, 4);
            v = v32;
        } else {
            memcpy(&v, seen + 128 * i, 8);
        }
        printf("%s%lld", i ? "," : "", nulls[i] ? -1LL : v);
    }
    printf("]");
}

#endif
