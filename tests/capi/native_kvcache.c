/*
 * native_kvcache: lazytriton.h's lt_attn_kvcache and lt_flash_combine served by liblazytriton_native.so
 * (tests/test_native_decode.py).
 *
 * native_kvcache JIT kvcache PAGED APPEND SPLITS [ROTARY]: lt_init with config.jit = JIT and the images
 * LAZYTRITON_IMAGES names, then one lt_attn_kvcache of bf16 q (2, 1, 8, 64) over a cache of 2 key/value heads,
 * contiguous (2, 1024, 2, 64) or PAGED (16 pages of 64 keys, a block table (2, 8)), cache_seqlens (2,), with APPEND
 * new keys k and v (2, 1, 2, 64) (APPEND 2: k and v of no key, (2, 0, 2, 64)), num_splits SPLITS (0: the
 * heuristic), with ROTARY rotary_cos and rotary_sin (2048, 32), the workspace lt_attn_kvcache_workspace_size asks
 * for.
 * native_kvcache JIT combine: one lt_flash_combine of fp32 partials (4, 3, 8, 64) into bf16 out (3, 8, 64).
 * Every pointer is a made-up device address; the fake libcuda records the launches. NATIVE_SIZES (comma-separated
 * byte sizes) says how many parameters the last launch takes and how many bytes each; NATIVE_DRIVER_VERSION what
 * the fake's cuDriverGetVersion answers (its own default: 13000). One JSON line: the
 * statuses, the message, each launch (grid x, y, z, block x, shared bytes, function,
 * programmatic: 1 for a programmatic dependent's launch), the last launch's record.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lazytriton.h"
#include "native_json.h"

#define ADDRESS(i) ((void *)(0x7f0000000000ull + ((unsigned long long)(i) << 20)))

static int kvcache(int paged, int append, int splits, int rotary) {
    int64_t B = 2, Hq = 8, Hk = 2, D = 64, S = 1024, pages = 16, page = 64, per_seq = 8;
    int64_t qs[4] = {B, 1, Hq, D}, cs[4] = {B, S, Hk, D}, ps[4] = {pages, page, Hk, D}, ts[2] = {B, per_seq};
    int64_t ns[4] = {B, append == 2 ? 0 : 1, Hk, D}, ls[3] = {B, Hq, 1}, bs[1] = {B}, ro[2] = {2048, D / 2};
    lt_attn_kvcache_params p;
    lt_attn_kvcache_params_init(&p);
    lt_tensor_init(&p.q, ADDRESS(1), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.k_cache, ADDRESS(2), LT_DTYPE_BF16, 4, paged ? ps : cs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.v_cache, ADDRESS(40), LT_DTYPE_BF16, 4, paged ? ps : cs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.out, ADDRESS(80), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.lse, ADDRESS(81), LT_DTYPE_FP32, 3, ls, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.cache_seqlens, ADDRESS(82), LT_DTYPE_INT32, 1, bs, LT_DEVICE_CUDA, 0);
    if (paged)
        lt_tensor_init(&p.block_table, ADDRESS(83), LT_DTYPE_INT32, 2, ts, LT_DEVICE_CUDA, 0);
    if (append) {
        lt_tensor_init(&p.k, ADDRESS(84), LT_DTYPE_BF16, 4, ns, LT_DEVICE_CUDA, 0);
        lt_tensor_init(&p.v, ADDRESS(85), LT_DTYPE_BF16, 4, ns, LT_DEVICE_CUDA, 0);
    }
    if (rotary) {
        lt_tensor_init(&p.rotary_cos, ADDRESS(86), LT_DTYPE_BF16, 2, ro, LT_DEVICE_CUDA, 0);
        lt_tensor_init(&p.rotary_sin, ADDRESS(87), LT_DTYPE_BF16, 2, ro, LT_DEVICE_CUDA, 0);
    }
    p.num_splits = splits;
    size_t bytes = 0;
    int status = lt_attn_kvcache_workspace_size(&p, &bytes);
    if (status != LT_OK)
        return status;
    int64_t ws[1] = {(int64_t)(bytes / 4)};
    lt_tensor_init(&p.workspace, ADDRESS(100), LT_DTYPE_FP32, 1, ws, LT_DEVICE_CUDA, 0);
    return lt_attn_kvcache(&p, (void *)0x5EA);
}

static int combine(void) {
    int64_t op[4] = {4, 3, 8, 64}, lp[3] = {4, 3, 8}, os[3] = {3, 8, 64}, ls[2] = {3, 8};
    lt_flash_combine_params p;
    lt_flash_combine_params_init(&p);
    lt_tensor_init(&p.out_partial, ADDRESS(1), LT_DTYPE_FP32, 4, op, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.lse_partial, ADDRESS(2), LT_DTYPE_FP32, 3, lp, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.out, ADDRESS(3), LT_DTYPE_BF16, 3, os, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p.lse, ADDRESS(4), LT_DTYPE_FP32, 2, ls, LT_DEVICE_CUDA, 0);
    return lt_flash_combine(&p, (void *)0x5EA);
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[2], "kvcache") == 0 && argc < 6)) {
        fprintf(stderr, "usage: native_kvcache JIT kvcache PAGED APPEND SPLITS [ROTARY] | native_kvcache JIT combine\n");
        return 2;
    }
    int sizes[64], n = 0;
    const char *given = getenv("NATIVE_SIZES");
    for (const char *at = given; at != NULL && *at != '\0' && n < 64; n++) {
        sizes[n] = atoi(at);
        at = strchr(at, ',');
        at = at != NULL ? at + 1 : NULL;
    }
    void *fake = dlopen("libcuda.so.1", RTLD_NOW);
    int (*configure)(int, const int *, int) = fake ? (int (*)(int, const int *, int))dlsym(fake, "fake_configure") : NULL;
    int (*log)(long long *) = fake ? (int (*)(long long *))dlsym(fake, "fake_launch_log") : NULL;
    fake_read_fn read = fake ? (fake_read_fn)dlsym(fake, "fake_read") : NULL;
    if (configure == NULL || log == NULL || read == NULL) {
        fprintf(stderr, "libcuda.so.1 is not the fake (tests/fake_libcuda.py)\n");
        return 2;
    }
    configure(n, sizes, 0);
    void (*set_version)(int) = (void (*)(int))dlsym(fake, "fake_set_driver_version");
    if (getenv("NATIVE_DRIVER_VERSION") != NULL && set_version != NULL)
        set_version(atoi(getenv("NATIVE_DRIVER_VERSION")));
    lt_config config;
    lt_config_init(&config);
    config.jit = atoi(argv[1]);
    int init = lt_init(&config);
    printf("{\"init\":%d", init);
    int status = init;
    if (init == LT_OK)
        status = strcmp(argv[2], "combine") == 0 ? combine()
                                                 : kvcache(atoi(argv[3]), atoi(argv[4]), atoi(argv[5]),
                                                           argc > 6 ? atoi(argv[6]) : 0);
    printf(",\"status\":%d,\"error\":", status);
    json_str(status == LT_OK ? "" : lt_last_error());
    static long long launches[64 * 8];
    int count = log(launches);
    printf(",\"launches\":[");
    for (int i = 0; i < count && i < 64; i++)
        printf("%s[%lld,%lld,%lld,%lld,%lld,%lld,%lld]", i ? "," : "", launches[8 * i], launches[8 * i + 1],
               launches[8 * i + 2], launches[8 * i + 3], launches[8 * i + 4], launches[8 * i + 5],
               launches[8 * i + 7]);
    printf("]");
    if (status == LT_OK && count > 0)
        print_fake_launch(read, n, sizes);
    printf("}\n");
    return 0;
}
