/*
 * capi_fake_bench.c: host time per call of lt_plan_launch and lt_attn_fwd beside a bare cuLaunchKernel, on the
 * fake libcuda (tests/fake_libcuda.py, light: its cuLaunchKernel only counts), CPU only (bench_capi.py
 * --fake-driver builds and runs it against liblazytriton_native.so and an image of the call's entry).
 *
 * bf16 q (1, 4, 300, 128), k and v (1, 2, 500, 128) at made-up device addresses, not causal. Each provider is
 * timed over ROUNDS rounds of BATCH calls; prints one line per provider: name, p50, mean, min of the rounds'
 * per-call times, in µs.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "lazytriton.h"

#include "bench_clock.h"

enum { BATCH = 1000, ROUNDS = 300, WARMUP = 20000, N_PARAMS = 46 };

static int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                     void **);
static void *params[N_PARAMS];
static int64_t zeros[N_PARAMS];
static lt_plan *plan;
static lt_attn_fwd_params p;

static int call(int provider) {
    void *stream = (void *)0x5EA;
    switch (provider) {
    case 0: return launch((void *)0xF000, 5, 4, 1, 256, 1, 1, 49152, stream, params, NULL);
    case 1: return lt_plan_launch(plan, &p, stream);
    default: return lt_attn_fwd(&p, stream);
    }
}

static void run(const char *name, int provider) {
    double rounds[ROUNDS], sum = 0.0;
    for (int i = 0; i < WARMUP; i++)
        if (call(provider) != 0) {
            fprintf(stderr, "%s failed: %s\n", name, lt_last_error());
            exit(1);
        }
    for (int r = 0; r < ROUNDS; r++) {
        double start = now_us();
        for (int i = 0; i < BATCH; i++)
            call(provider);
        rounds[r] = (now_us() - start) / BATCH;
        sum += rounds[r];
    }
    qsort(rounds, ROUNDS, sizeof rounds[0], by_value);
    printf("%s %.4f %.4f %.4f\n", name, rounds[ROUNDS / 2], sum / ROUNDS, rounds[0]);
}

int main(void) {
    void *fake = dlopen("libcuda.so.1", RTLD_NOW);
    void (*light)(int) = fake ? (void (*)(int))dlsym(fake, "fake_set_light") : NULL;
    *(void **)&launch = fake ? dlsym(fake, "cuLaunchKernel") : NULL;
    if (light == NULL || launch == NULL) {
        fprintf(stderr, "libcuda.so.1 is not the fake with fake_set_light\n");
        return 2;
    }
    light(1);
    for (int i = 0; i < N_PARAMS; i++)
        params[i] = &zeros[i];
    int64_t qs[4] = {1, 4, 300, 128}, ks[4] = {1, 2, 500, 128};
    lt_attn_fwd_params_init(&p);
    lt_tensor_init(&p.q, (void *)0x7f0000100000ull, LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.k, (void *)0x7f0000200000ull, LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.v, (void *)0x7f0000300000ull, LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.out, (void *)0x7f0000400000ull, LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.lse, (void *)0x7f0000500000ull, LT_DTYPE_FP32, 3, qs, LT_DEVICE_CUDA, 0);
    int s;
    if ((s = lt_init(NULL)) != LT_OK || (s = lt_attn_fwd_plan(&p, &plan)) != LT_OK) {
        fprintf(stderr, "lt_init/lt_attn_fwd_plan: %d %s\n", s, lt_last_error());
        return 1;
    }
    run("bare_cuLaunchKernel", 0);
    run("lt_plan_launch", 1);
    run("lt_attn_fwd", 2);
    return 0;
}
