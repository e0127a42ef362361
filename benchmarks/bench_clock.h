/* The C benches' clock and sort order: wall-clock microseconds, and doubles compared for qsort (medians). */
#ifndef BENCH_CLOCK_H
#define BENCH_CLOCK_H

#include <time.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
