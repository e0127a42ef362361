/*
 * capi_decode_bench.c: the timing loops of bench_capi.py --kernel kvcache on a GPU, a shared library its Python
 * process loads with ctypes (capi_decode_gpu.py): that process holds the device tensors (torch), the call's
 * lt_attn_kvcache_params and its kernels' bare launches (the cubins lazytriton's runtime loaded, their parameter
 * arrays built once); these loops time them on one stream, with no Python in the timed span.
 *
 *   decode_bench_open()                   libcuda's launch entry points: 0, or -1
 *   decode_bench_launch(L, N, STREAM)     the N bare launches L once: 0, or the driver's status
 *   decode_bench_time(PROVIDER, L, N, P, STREAM, ROUNDS, BATCH, WARMUP, OUT)
 *                                         PROVIDER 0: the bare launches, 1: lt_attn_kvcache(P, STREAM); OUT: the
 *                                         p50, mean and min per call of ROUNDS rounds of BATCH calls (a context
 *                                         synchronize after each round, outside the timed span), in µs; 0, or
 *                                         the first failing call's status
 */
#include <dlfcn.h>
#include <stddef.h>

#include <lazytriton.h>

#include "bench_clock.h"
#include "bench_launches.h"

static const bench_launch *g_launches;
static int g_n;
static const lt_attn_kvcache_params *g_params;
static void *g_stream;
static int (*g_synchronize)(void); /* cuCtxSynchronize */

static int call(int provider) {
    return provider == 0 ? bench_launches_run(g_launches, g_n) : (int)lt_attn_kvcache(g_params, g_stream);
}

int decode_bench_open(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL || bench_launches_open(lib) != 0)
        return -1;
    *(void **)&g_synchronize = dlsym(lib, "cuCtxSynchronize");
    return g_synchronize != NULL ? 0 : -1;
}

int decode_bench_launch(const bench_launch *launches, int n, void *stream) {
    if (bench_launches_prepare(launches, n, stream) != 0)
        return -1;
    return bench_launches_run(launches, n);
}

int decode_bench_time(int provider, const bench_launch *launches, int n, const lt_attn_kvcache_params *params,
                      void *stream, int rounds, int batch, int warmup, double *out) {
    if (provider == 0 && bench_launches_prepare(launches, n, stream) != 0)
        return -1;
    g_launches = launches, g_n = n, g_params = params, g_stream = stream;
    return bench_rounds(call, provider, rounds, batch, warmup, g_synchronize, out);
}
