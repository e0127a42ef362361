/*
 * capi_fake_bench.c: host time per call of the C API beside its bare launches, on the fake libcuda
 * (tests/fake_libcuda.py, light: its cuLaunchKernel and cuLaunchKernelEx only count), CPU only (bench_capi.py
 * --fake-driver builds and runs it against liblazytriton_native.so and an image of the call's entries).
 *
 *   capi_fake_bench [fwd|kvcache] [ROUNDS]
 *
 * fwd (the default): lt_plan_launch and lt_attn_fwd beside a bare cuLaunchKernel; bf16 q (1, 4, 300, 128), k and
 * v (1, 2, 500, 128), not causal.
 * kvcache: lt_attn_kvcache beside its bare launches; bf16 q (1, 1, 32, 128), one new key k and v (1, 1, 8, 128),
 * cache_seqlens (1,) int32, a contiguous cache (1, 4096, 8, 128) and a paged one (16 pages of 256 keys, a block
 * table (1, 16)). The bare launches are those the call made, read from the fake's launch log after one call with
 * the fake recording (grid, block, shared memory, function, programmatic dependent or not); first a line per
 * layout: "launches NAME N PROGRAMMATIC", the call's kernels and how many of them launched as programmatic
 * dependents.
 *
 * Every pointer is a made-up device address. Each provider is timed over ROUNDS (default 300) rounds of BATCH
 * calls; prints one line per provider: name, p50, mean, min of the rounds' per-call times, in µs.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lazytriton.h"

#include "bench_clock.h"
#include "bench_launches.h"

enum { BATCH = 1000, WARMUP = 20000, N_PARAMS = 80, MAX_LAUNCHES = 8 };
enum { BARE, PLAN_LAUNCH, ATTN_FWD, KVCACHE, KVCACHE_PAGED };

#define ADDRESS(i) ((void *)(0x7f0000000000ull + ((unsigned long long)(i) << 20)))
#define STREAM ((void *)0x5EA)

static void *params[N_PARAMS];
static int64_t zeros[N_PARAMS];
static lt_plan *plan;
static lt_attn_fwd_params fwd;
static lt_attn_kvcache_params kv[2]; /* contiguous, paged */
static bench_launch bare[MAX_LAUNCHES];
static int n_bare;

static int call(int provider) {
    switch (provider) {
    case BARE: return bench_launches_run(bare, n_bare);
    case PLAN_LAUNCH: return lt_plan_launch(plan, &fwd, STREAM);
    case ATTN_FWD: return lt_attn_fwd(&fwd, STREAM);
    default: return lt_attn_kvcache(&kv[provider - KVCACHE], STREAM);
    }
}

static void run(const char *name, int provider, int rounds) {
    double out[3];
    int status = bench_rounds(call, provider, rounds, BATCH, WARMUP, NULL, out);
    if (status != 0) {
        fprintf(stderr, "%s failed: status %d (%s)\n", name, status, lt_last_error());
        exit(1);
    }
    printf("%s %.4f %.4f %.4f\n", name, out[0], out[1], out[2]);
}

static int fwd_setup(void) {
    int64_t qs[4] = {1, 4, 300, 128}, ks[4] = {1, 2, 500, 128};
    lt_attn_fwd_params_init(&fwd);
    lt_tensor_init(&fwd.q, ADDRESS(1), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&fwd.k, ADDRESS(2), LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&fwd.v, ADDRESS(3), LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&fwd.out, ADDRESS(4), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&fwd.lse, ADDRESS(5), LT_DTYPE_FP32, 3, qs, LT_DEVICE_CUDA, 0);
    bench_launch launch = {(void *)0xF000, {5, 4, 1}, 256, 49152, 0, params};
    bare[0] = launch, n_bare = 1;
    return lt_attn_fwd_plan(&fwd, &plan);
}

/* kv[paged]: its tensors at made-up addresses (the paged layout's its own), its workspace as the API sizes it. */
static int kvcache_setup(int paged) {
    int64_t B = 1, Hq = 32, Hk = 8, D = 128, S = 4096, pages = 16, page = 256;
    int64_t qs[4] = {B, 1, Hq, D}, cs[4] = {B, S, Hk, D}, ps[4] = {pages, page, Hk, D}, ts[2] = {B, pages};
    int64_t ns[4] = {B, 1, Hk, D}, ls[3] = {B, Hq, 1}, bs[1] = {B};
    lt_attn_kvcache_params *p = &kv[paged];
    int at = paged ? 200 : 100;
    lt_attn_kvcache_params_init(p);
    lt_tensor_init(&p->q, ADDRESS(at + 1), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->k_cache, ADDRESS(at + 2), LT_DTYPE_BF16, 4, paged ? ps : cs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->v_cache, ADDRESS(at + 40), LT_DTYPE_BF16, 4, paged ? ps : cs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->out, ADDRESS(at + 80), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->lse, ADDRESS(at + 81), LT_DTYPE_FP32, 3, ls, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->cache_seqlens, ADDRESS(at + 82), LT_DTYPE_INT32, 1, bs, LT_DEVICE_CUDA, 0);
    if (paged)
        lt_tensor_init(&p->block_table, ADDRESS(at + 83), LT_DTYPE_INT32, 2, ts, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->k, ADDRESS(at + 84), LT_DTYPE_BF16, 4, ns, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->v, ADDRESS(at + 85), LT_DTYPE_BF16, 4, ns, LT_DEVICE_CUDA, 0);
    size_t bytes = 0;
    int status = lt_attn_kvcache_workspace_size(p, &bytes);
    int64_t ws[1] = {(int64_t)(bytes / 4)};
    lt_tensor_init(&p->workspace, ADDRESS(at + 90), LT_DTYPE_FP32, 1, ws, LT_DEVICE_CUDA, 0);
    return status;
}

/* One call of kv[paged] with the fake recording; its launches become the bare ones (each with params). */
static int kvcache_launches(void *fake, int paged) {
    int (*configure)(int, const int *, int) = (int (*)(int, const int *, int))dlsym(fake, "fake_configure");
    int (*log)(long long *) = (int (*)(long long *))dlsym(fake, "fake_launch_log");
    static long long launches[64 * 8];
    int status, programmatic = 0, no_sizes[1] = {0};
    if (configure == NULL || log == NULL)
        return -1;
    configure(0, no_sizes, 0);
    if ((status = lt_attn_kvcache(&kv[paged], STREAM)) != LT_OK)
        return status;
    n_bare = log(launches);
    if (n_bare < 1 || n_bare > MAX_LAUNCHES)
        return -1;
    for (int i = 0; i < n_bare; i++) {
        const long long *l = &launches[8 * i];
        bench_launch launch = {(void *)(uintptr_t)l[5], {(unsigned)l[0], (unsigned)l[1], (unsigned)l[2]},
                               (unsigned)l[3], (unsigned)l[4], (int)l[7], params};
        bare[i] = launch, programmatic += (int)l[7];
    }
    printf("launches %s %d %d\n", paged ? "lt_attn_kvcache_paged" : "lt_attn_kvcache", n_bare, programmatic);
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "fwd";
    int rounds = argc > 2 ? atoi(argv[2]) : 300, kvcache = strcmp(mode, "kvcache") == 0;
    if (argc > 3 || (!kvcache && strcmp(mode, "fwd") != 0) || rounds < 1) {
        fprintf(stderr, "usage: capi_fake_bench [fwd|kvcache] [ROUNDS >= 1]\n");
        return 2;
    }
    void *fake = dlopen("libcuda.so.1", RTLD_NOW);
    void (*light)(int) = fake ? (void (*)(int))dlsym(fake, "fake_set_light") : NULL;
    if (light == NULL || bench_launches_open(fake) != 0) {
        fprintf(stderr, "libcuda.so.1 is not the fake with fake_set_light\n");
        return 2;
    }
    for (int i = 0; i < N_PARAMS; i++)
        params[i] = &zeros[i];
    int s;
    if ((s = lt_init(NULL)) != LT_OK) {
        fprintf(stderr, "lt_init: %d %s\n", s, lt_last_error());
        return 1;
    }
    if (!kvcache) {
        light(1);
        if ((s = fwd_setup()) != LT_OK) {
            fprintf(stderr, "lt_attn_fwd_plan: %d %s\n", s, lt_last_error());
            return 1;
        }
        bench_launches_prepare(bare, n_bare, STREAM);
        run("bare_cuLaunchKernel", BARE, rounds);
        run("lt_plan_launch", PLAN_LAUNCH, rounds);
        run("lt_attn_fwd", ATTN_FWD, rounds);
        return 0;
    }
    const char *names[2][2] = {{"bare_launches", "lt_attn_kvcache"}, {"bare_launches_paged", "lt_attn_kvcache_paged"}};
    for (int paged = 0; paged < 2; paged++) {
        light(0);
        if ((s = kvcache_setup(paged)) != LT_OK || (s = kvcache_launches(fake, paged)) != LT_OK) {
            fprintf(stderr, "lt_attn_kvcache (%s): %d %s\n", paged ? "paged" : "contiguous", s,
                    s > 0 ? lt_last_error() : "its launches are not in the fake's log");
            return 1;
        }
        light(1);
        bench_launches_prepare(bare, n_bare, STREAM);
        run(names[paged][0], BARE, rounds);
        run(names[paged][1], KVCACHE + paged, rounds);
    }
    return 0;
}
