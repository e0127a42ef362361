/*
 * capi_bench.c: host time per call of lt_attn_fwd, lt_plan_launch and a bare
 * cuLaunchKernel of the same kernel (built and run by bench_capi.py).
 *
 *   capi_bench CUBIN ENTRY_NAME SHARED_BYTES BLOCK_THREADS BLOCK_M N_HIDDEN B H S D
 *
 * fp16, not causal, q/k/v/out (B, H, S, D), lse (B, H, S), all on device 0.
 * Each provider is timed over rounds of BATCH calls (clock_gettime around the
 * loop, then a synchronize outside the timing): BATCH stays well under the
 * driver's queue depth, so launches never wait for the GPU. Prints one line
 * per provider: name, p50, mean and min of the rounds' per-call times, in µs.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <lazytriton.h>

#include "bench_clock.h"
#include "cuda_driver.h"

enum { BATCH = 200, ROUNDS = 200, WARMUP = 2000 };

static cuda_driver cu;

/* The driver's entry points beyond cuda_driver's: the tensors zeroed, the stream, the bare launch. */
static struct {
    int (*memset_d8)(uint64_t, unsigned char, size_t);
    int (*stream_create)(void **, unsigned);
    int (*module_load_data)(void **, const void *);
    int (*module_get_function)(void **, void *, const char *);
    int (*func_set_attribute)(void *, int, int);
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                  void **);
} bare_cu;

static void die(const char *what, int status) {
    fprintf(stderr, "%s failed: status %d (lazytriton's last error: %s)\n", what, status, lt_last_error());
    exit(1);
}

typedef struct {
    const char *name;
    int provider;
} bench;

/* provider 0: bare cuLaunchKernel, 1: lt_plan_launch, 2: lt_attn_fwd */
static void *g_function, *g_stream, **g_params;
static unsigned g_grid[3], g_block, g_shared;
static lt_plan *g_plan;
static lt_attn_fwd_params g_p;

static int call(int provider) {
    switch (provider) {
    case 0: return bare_cu.launch(g_function, g_grid[0], g_grid[1], g_grid[2], g_block, 1, 1, g_shared, g_stream,
                                  g_params, NULL);
    case 1: return lt_plan_launch(g_plan, &g_p, g_stream);
    default: return lt_attn_fwd(&g_p, g_stream);
    }
}

static void run(const char *name, int provider) {
    double out[3];
    int status = bench_rounds(call, provider, ROUNDS, BATCH, WARMUP, cu.ctx_synchronize, out);
    if (status != 0)
        die(name, status);
    printf("%s %.3f %.3f %.3f\n", name, out[0], out[1], out[2]);
}

int main(int argc, char **argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: %s CUBIN ENTRY_NAME SHARED BLOCK_THREADS BLOCK_M N_HIDDEN B H S D\n", argv[0]);
        return 2;
    }
    int64_t b = atoll(argv[7]), h = atoll(argv[8]), s = atoll(argv[9]), d = atoll(argv[10]);
    g_shared = (unsigned)atoi(argv[3]), g_block = (unsigned)atoi(argv[4]);
    unsigned block_m = (unsigned)atoi(argv[5]), n_hidden = (unsigned)atoi(argv[6]);
    const char *missing = NULL;
    void *lib = cuda_driver_open(&cu, &missing);
    if (lib == NULL) die(missing, -1);
    const char *names[] = {"cuMemsetD8_v2", "cuStreamCreate", "cuModuleLoadData", "cuModuleGetFunction",
                           "cuFuncSetAttribute", "cuLaunchKernel"};
    void **slots = (void **)&bare_cu;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((slots[i] = dlsym(lib, names[i])) == NULL) die(names[i], -1);
    int r;
    void *module;
    if ((r = cuda_context_current(&cu)) || (r = bare_cu.stream_create(&g_stream, 1 /* non-blocking */)))
        die("CUDA setup", r);

    /* The tensors: zeros (the values do not change the launch cost). */
    size_t qn = (size_t)(b * h * s * d);
    uint64_t at[5];
    size_t bytes[5] = {2 * qn, 2 * qn, 2 * qn, 2 * qn, 4 * (size_t)(b * h * s)};
    for (int i = 0; i < 5; i++)
        if ((r = cu.mem_alloc(&at[i], bytes[i])) || (r = bare_cu.memset_d8(at[i], 0, bytes[i]))) die("cuMemAlloc", r);
    int64_t sizes[4] = {b, h, s, d};
    lt_attn_fwd_params_init(&g_p);
    lt_tensor *views[5] = {&g_p.q, &g_p.k, &g_p.v, &g_p.out, &g_p.lse};
    for (int i = 0; i < 5; i++)
        lt_tensor_init(views[i], (void *)(uintptr_t)at[i], i < 4 ? LT_DTYPE_FP16 : LT_DTYPE_FP32, i < 4 ? 4 : 3, sizes,
                       LT_DEVICE_CUDA, 0);

    /* lazytriton: warm the cache and the plan memo, then make a plan. */
    if ((r = lt_init(NULL))) die("lt_init", r);
    if ((r = lt_attn_fwd(&g_p, g_stream))) die("lt_attn_fwd", r);
    if ((r = lt_attn_fwd_plan(&g_p, &g_plan))) die("lt_attn_fwd_plan", r);

    /* The bare launch: the same cubin, loaded here, its parameters built once. */
    FILE *f = fopen(argv[1], "rb");
    if (f == NULL) die("open cubin", -1);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *image = malloc((size_t)size);
    if (fread(image, 1, (size_t)size, f) != (size_t)size) die("read cubin", -1);
    fclose(f);
    if ((r = bare_cu.module_load_data(&module, image)) ||
        (r = bare_cu.module_get_function(&g_function, module, argv[2])))
        die("cuModuleLoadData/GetFunction", r);
    if (g_shared > 48 * 1024 && (r = bare_cu.func_set_attribute(g_function, 8, (int)g_shared)))
        die("cuFuncSetAttribute", r);
    /* flash_fwd's parameters (kernels/flash_fwd/__init__.py): 28 ints (pointers, the varlen pointers = 0 for a
     * dense call, strides, sizes, causal offset, window left/right = -1/-1 for no window), then sm_scale and
     * softcap (0 = off), then the hidden pointers. */
    enum { N_INTS = 28 };
    static int64_t ints[40];
    static float floats[2];
    static void *params[40];
    int64_t values[N_INTS] = {(int64_t)at[0], (int64_t)at[1], (int64_t)at[2], (int64_t)at[3], (int64_t)at[4], 0, 0,
                              h * s * d, s * d, d, h * s * d, s * d, d, h * s * d, s * d, d, h * s * d, s * d, d,
                              h * s, s, 1, s, s, d, 0, -1, -1};
    memcpy(ints, values, sizeof values);
    floats[0] = 0.125f, floats[1] = 0.0f;
    for (int i = 0; i < N_INTS; i++) params[i] = &ints[i];
    params[N_INTS] = &floats[0], params[N_INTS + 1] = &floats[1];
    for (unsigned i = 0; i < n_hidden; i++) params[N_INTS + 2 + i] = &ints[N_INTS + i];
    g_params = params;
    g_grid[0] = (unsigned)((s + block_m - 1) / block_m), g_grid[1] = (unsigned)h, g_grid[2] = (unsigned)b;

    run("bare_cuLaunchKernel", 0);
    run("lt_plan_launch", 1);
    run("lt_attn_fwd", 2);
    lt_plan_destroy(g_plan);
    return 0;
}
