/* native_json.h: what the native core's test programs print with (tests/capi/native_launch.c, native_front.c):
   JSON strings, and the fake libcuda's record of the last launch (tests/fake_libcuda.py). */
#ifndef NATIVE_JSON_H
#define NATIVE_JSON_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* s as a JSON string (NULL as ""). */
static void json_str(const char *s) {
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

typedef void (*fake_read_fn)(unsigned char *, int *, long long *, int *);

/* ,"state":[the fake's 13 counters],"params":[each of the n parameters' first sizes[i] bytes, -1 for NULL] */
static void print_fake_launch(fake_read_fn read, int n, const int *sizes) {
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
