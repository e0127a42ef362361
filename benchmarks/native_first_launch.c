/*
 * native_first_launch.c: from lt_init to the first lt_attn_fwd of a fresh process, on device memory
 * (benchmarks/bench_native.py --gpu builds and runs it against liblazytriton_native.so).
 *
 *   native_first_launch [OUT [INPUTS]]
 *
 * First the CUDA context, as the application would have it before lazytriton (cuInit, device 0's primary
 * context made current: timed apart), and bf16 q (1, 4, 300, 128), k and v (1, 2, 500, 128) filled from a
 * formula (bench_native.py's ``inputs``), copied to device memory with out and lse. Then the clock: lt_init
 * (LAZYTRITON_IMAGES opened) and one lt_attn_fwd on the legacy default stream, not causal (the variant and key
 * computed in C, the entry read from the image, its module loaded, the kernel launched): the microseconds to
 * its return, and to the kernel's completion (cuCtxSynchronize). Out is written to the file OUT where given;
 * INPUTS, where given, gets q, k and v as device memory holds them (bench_native.py's tests hold them to its
 * ``inputs``). One JSON line: the statuses, the message, the times and the completion's CLOCK_MONOTONIC time
 * (the parent's clock); on the fake libcuda (tests/fake_libcuda.py: host memory as device memory) also the
 * launches it counted.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lazytriton.h"

#include "bench_clock.h"
#include "cuda_driver.h"
#include "native_json.h"

enum { B = 1, HQ = 4, HK = 2, SQ = 300, SK = 500, D = 128 };

static cuda_driver cu;
static int (*fake_launch_log)(int64_t *); /* tests/fake_libcuda.py's alone */

/* One JSON line saying what failed, and exit 1. */
static void die(const char *what, int status) {
    printf("{\"failed\":");
    json_str(what);
    printf(",\"status\":%d}\n", status);
    exit(1);
}

static void cuda_open(void) {
    const char *missing = NULL;
    void *lib = cuda_driver_open(&cu, &missing);
    if (lib == NULL)
        die(missing, -1);
    *(void **)&fake_launch_log = dlsym(lib, "fake_launch_log");
}

/* x rounded to the nearest bf16, ties to even (torch's conversion; x is finite) */
static uint16_t bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Device memory of bytes, holding tensor t's formula (t < 3: q, k, v; v's columns j get j / 256 more, so each
   column of out differs from 0 and from the others) or zeros. */
static void *placed(int t, int64_t elements, size_t element_bytes) {
    size_t bytes = (size_t)elements * element_bytes;
    void *host = calloc(bytes, 1);
    uint64_t device = 0;
    if (host == NULL)
        die("calloc", -1);
    for (int64_t i = 0; t < 3 && i < elements; i++)
        ((uint16_t *)host)[i] = bf16((float)((i * (t + 3) * 7919) % 97) / 97.0f - 0.5f +
                                     (t == 2 ? (float)(i % D) / 256.0f : 0.0f));
    int r = cu.mem_alloc(&device, bytes);
    if (r != 0 || (r = cu.htod(device, host, bytes)) != 0)
        die("cuMemAlloc/cuMemcpyHtoD", r);
    free(host);
    return (void *)(uintptr_t)device;
}

/* Whether the n device buffers of sizes[i] bytes went to the file path, one after the other. */
static int written(const char *path, void *const *buffers, const size_t *sizes, int n) {
    FILE *f = fopen(path, "wb");
    int ok = f != NULL;
    for (int i = 0; ok && i < n; i++) {
        void *host = malloc(sizes[i]);
        ok = host != NULL && cu.dtoh(host, (uint64_t)(uintptr_t)buffers[i], sizes[i]) == 0 &&
             fwrite(host, 1, sizes[i], f) == sizes[i];
        free(host);
    }
    if (f != NULL)
        ok = fclose(f) == 0 && ok;
    return ok;
}

int main(int argc, char **argv) {
    if (argc > 3) {
        fprintf(stderr, "usage: native_first_launch [OUT [INPUTS]]\n");
        return 2;
    }
    cuda_open();
    double context_start = now_us();
    int r = cuda_context_current(&cu);
    if (r != 0)
        die("cuInit/cuDevicePrimaryCtxRetain/cuCtxSetCurrent", r);
    double context_us = now_us() - context_start;

    int64_t qs[4] = {B, HQ, SQ, D}, ks[4] = {B, HK, SK, D};
    void *q = placed(0, B * HQ * SQ * D, 2), *k = placed(1, B * HK * SK * D, 2), *v = placed(2, B * HK * SK * D, 2);
    void *out = placed(3, B * HQ * SQ * D, 2), *lse = placed(4, B * HQ * SQ, 4);
    if ((r = cu.ctx_synchronize()) != 0)
        die("cuCtxSynchronize", r);

    double start = now_us();
    lt_config config;
    lt_config_init(&config);
    config.jit = LT_JIT_OFF;
    int init = lt_init(&config), status = -1, synchronized = -1;
    double returned = 0, completed = 0, completed_at = 0;
    if (init == LT_OK) {
        lt_attn_fwd_params p;
        lt_attn_fwd_params_init(&p);
        lt_tensor_init(&p.q, q, LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
        lt_tensor_init(&p.k, k, LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
        lt_tensor_init(&p.v, v, LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
        lt_tensor_init(&p.out, out, LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
        lt_tensor_init(&p.lse, lse, LT_DTYPE_FP32, 3, qs, LT_DEVICE_CUDA, 0);
        status = lt_attn_fwd(&p, NULL);
        returned = now_us() - start;
        synchronized = cu.ctx_synchronize();
        completed_at = now_us();
        completed = completed_at - start;
    }
    printf("{\"context_us\":%.1f,\"init\":%d,\"fwd\":%d,\"synchronize\":%d,\"returned_us\":%.1f,\"completed_us\":%.1f,"
           "\"completed_at_us\":%.1f,\"error\":", context_us, init, status, synchronized, returned, completed,
           completed_at);
    json_str(init == LT_OK && status == LT_OK ? "" : lt_last_error());
    print_cache_stats();
    if (fake_launch_log != NULL) {
        static int64_t log[64 * 8];
        printf(",\"fake_launches\":%d", fake_launch_log(log));
    }
    printf("}\n");
    size_t q_bytes = (size_t)B * HQ * SQ * D * 2, k_bytes = (size_t)B * HK * SK * D * 2;
    void *given[3] = {q, k, v};
    size_t given_bytes[3] = {q_bytes, k_bytes, k_bytes};
    if (argc > 1 && status == LT_OK && !written(argv[1], &out, &q_bytes, 1))
        return 1;
    if (argc > 2 && !written(argv[2], given, given_bytes, 3))
        return 1;
    return 0;
}
