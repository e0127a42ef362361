/* The C benches' clock, sort order and timing loop: wall-clock microseconds, doubles compared for qsort (medians),
   and a call timed over rounds of calls. */
#ifndef BENCH_CLOCK_H
#define BENCH_CLOCK_H

#include <stdlib.h>
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

/* call(provider) warmup times (its first nonzero status is returned), then timed over rounds of batch calls:
   out[0..2] the p50, mean and min of the rounds' per-call times, in µs. settle (NULL: none) runs before the first
   round and after each, outside the timed span (a GPU bench's synchronize: no launch waits for the device). */
static int bench_rounds(int (*call)(int), int provider, int rounds, int batch, int warmup, int (*settle)(void),
                        double out[3]) {
    int status;
    for (int i = 0; i < warmup; i++)
        if ((status = call(provider)) != 0)
            return status;
    double *times = malloc(sizeof *times * (size_t)(rounds > 0 ? rounds : 1)), sum = 0.0;
    if (times == NULL || rounds < 1 || batch < 1) {
        free(times);
        return -1;
    }
    if (settle != NULL)
        settle();
    for (int r = 0; r < rounds; r++) {
        double start = now_us();
        for (int i = 0; i < batch; i++)
            call(provider);
        times[r] = (now_us() - start) / batch;
        if (settle != NULL)
            settle();
        sum += times[r];
    }
    qsort(times, (size_t)rounds, sizeof *times, by_value);
    out[0] = times[rounds / 2], out[1] = sum / rounds, out[2] = times[0];
    free(times);
    return 0;
}

#endif
