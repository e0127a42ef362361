/*
 * native_front: lazytriton.h's lt_attn_fwd served by liblazytriton_native.so (tests/test_native_front.py,
 * benchmarks/bench_native.py).
 *
 * native_front JIT DEVICE CAUSAL [OUT]: lt_init with config.jit = JIT (0 default, 1 on, 2 off) and the images
 * LAZYTRITON_IMAGES names, then one lt_attn_fwd of bf16 q (1, 4, 300, 128), k and v (1, 2, 500, 128) on DEVICE
 * ("cuda": made-up device pointers, launched against the fake libcuda, whose record of the launch is printed;
 * "cpu": host memory, q, k and v filled from a formula, out written to the file OUT). One JSON line: the
 * statuses, the message, the microseconds from lt_init to lt_attn_fwd's return, and on "cuda" the launch.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lazytriton.h"
#include "native_json.h"

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}


static uint16_t bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)(bits >> 16);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: native_front JIT cuda|cpu CAUSAL [OUT]\n");
        return 2;
    }
    int cpu = strcmp(argv[2], "cpu") == 0;
    int64_t B = 1, Hq = 4, Hk = 2, Sq = cpu ? 24 : 300, Sk = cpu ? 40 : 500, D = cpu ? 32 : 128;
    int64_t qs[4] = {B, Hq, Sq, D}, ks[4] = {B, Hk, Sk, D};
    uint16_t *host[4] = {NULL, NULL, NULL, NULL};
    float *lse_host = NULL;
    void *data[5] = {(void *)0x7f0000100000ull, (void *)0x7f0000200000ull, (void *)0x7f0000300000ull,
                     (void *)0x7f0000400000ull, (void *)0x7f0000500000ull};
    if (cpu) {
        int64_t sizes[4] = {B * Hq * Sq * D, B * Hk * Sk * D, B * Hk * Sk * D, B * Hq * Sq * D};
        for (int t = 0; t < 4; t++) {
            host[t] = calloc((size_t)sizes[t], 2);
            for (int64_t i = 0; t < 3 && i < sizes[t]; i++)
                host[t][i] = bf16((float)((i * (t + 3) * 7919) % 97) / 97.0f - 0.5f);
            data[t] = host[t];
        }
        lse_host = calloc((size_t)(B * Hq * Sq), 4);
        data[4] = lse_host;
    }
    lt_device_type device = cpu ? LT_DEVICE_CPU : LT_DEVICE_CUDA;
    double start = now_us();
    lt_config config;
    lt_config_init(&config);
    config.jit = atoi(argv[1]);
    int init = lt_init(&config);
    printf("{\"init\":%d", init);
    if (init != LT_OK) {
        printf(",\"error\":");
        json_str(lt_last_error());
        printf("}\n");
        return 0;
    }
    lt_attn_fwd_params p;
    lt_attn_fwd_params_init(&p);
    lt_tensor_init(&p.q, data[0], LT_DTYPE_BF16, 4, qs, device, 0);
    lt_tensor_init(&p.k, data[1], LT_DTYPE_BF16, 4, ks, device, 0);
    lt_tensor_init(&p.v, data[2], LT_DTYPE_BF16, 4, ks, device, 0);
    lt_tensor_init(&p.out, data[3], LT_DTYPE_BF16, 4, qs, device, 0);
    lt_tensor_init(&p.lse, data[4], LT_DTYPE_FP32, 3, qs, device, 0);
    p.causal = atoi(argv[3]) ? LT_CAUSAL_BOTTOM_RIGHT : LT_CAUSAL_NONE;
    void *fake = cpu ? NULL : dlopen("libcuda.so.1", RTLD_NOW);
    int (*configure)(int, const int *, int) = fake ? (int (*)(int, const int *, int))dlsym(fake, "fake_configure") : NULL;
    void (*read)(unsigned char *, int *, long long *, int *) =
        fake ? (void (*)(unsigned char *, int *, long long *, int *))dlsym(fake, "fake_read") : NULL;
    /* flash_fwd's pointers and integers (passed as int64; the test gives its description's count), then 3 floats
       and 2 hidden pointers */
    const char *ints_given = getenv("NATIVE_FRONT_INTS");
    int ints = ints_given != NULL ? atoi(ints_given) : 0, n = ints + 5, sizes[64];
    if (ints < 1 || n > 64) {
        fprintf(stderr, "NATIVE_FRONT_INTS must be in 1..59\n");
        return 2;
    }
    for (int i = 0; i < n; i++)
        sizes[i] = i >= ints && i < ints + 3 ? 4 : 8;
    if (configure != NULL)
        configure(n, sizes, 0);
    int status = lt_attn_fwd(&p, (void *)0x5EA);
    double took = now_us() - start;
    printf(",\"fwd\":%d,\"first_launch_us\":%.1f,\"error\":", status, took);
    json_str(status == LT_OK ? "" : lt_last_error());
    if (read != NULL && status == LT_OK)
        print_fake_launch(read, n, sizes);
    print_cache_stats();
    printf("}\n");
    if (cpu && status == LT_OK && argc > 4) {
        FILE *f = fopen(argv[4], "wb");
        if (f == NULL || fwrite(host[3], 2, (size_t)(B * Hq * Sq * D), f) != (size_t)(B * Hq * Sq * D))
            return 1;
        fclose(f);
    }
    for (int t = 0; t < 4; t++)
        free(host[t]);
    free(lse_host);
    return 0;
}
