/*
 * capi_check.c: what tests/test_capi.py runs against liblazytriton.so.
 *
 *   capi_check errors CACHE_DIR      every error path: status and message (lt_attn_fwd and lt_attn_bwd)
 *   capi_check nopython              the embedded Python cannot start (PYTHONHOME broken): statuses, no exit
 *   capi_check badenv                a bad LAZYTRITON_* variable: lt_init reports it
 *   capi_check threads               8 threads calling lt_attn_fwd at once, each checked
 *   capi_check prewarm VARIANT       lt_prewarm (axes and a variant string), lt_cache_stats, JIT off
 *   capi_check gpu                   device memory: lt_attn_fwd, lt_attn_bwd, plans, plan mismatches (needs a GPU)
 *
 * Each check prints "ok NAME" or "FAIL NAME: ..."; the exit status is the
 * number of failures.
 */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lazytriton.h>

#include "cuda_driver.h"

static int failures;

static void expect(const char *name, lt_status got, lt_status want, const char *needle) {
    const char *message = lt_last_error();
    if (got != want || (needle != NULL && strstr(message, needle) == NULL)) {
        printf("FAIL %s: status %d (want %d), message \"%s\" (want it to contain \"%s\")\n", name, (int)got,
               (int)want, message, needle ? needle : "");
        failures++;
    } else {
        printf("ok %s%s%s\n", name, got != LT_OK ? ": " : "", got != LT_OK ? message : "");
    }
}

static void check(const char *name, int condition, const char *detail) {
    if (!condition) {
        printf("FAIL %s: %s\n", name, detail);
        failures++;
    } else {
        printf("ok %s\n", name);
    }
}

/* ---- a small problem in fp32 and its naive reference ------------------- */

typedef struct {
    int64_t b, hq, hk, sq, sk, d;
    lt_causal causal;
    float *q, *k, *v, *out, *lse;
} problem;

static void problem_make(problem *p, int64_t b, int64_t hq, int64_t hk, int64_t sq, int64_t sk, int64_t d,
                         lt_causal causal, uint32_t seed) {
    *p = (problem){b, hq, hk, sq, sk, d, causal, NULL, NULL, NULL, NULL, NULL};
    size_t qn = (size_t)(b * hq * sq * d), kn = (size_t)(b * hk * sk * d);
    p->q = malloc(4 * qn), p->k = malloc(4 * kn), p->v = malloc(4 * kn), p->out = calloc(qn, 4);
    p->lse = calloc((size_t)(b * hq * sq), 4);
    float *all[3] = {p->q, p->k, p->v};
    size_t n[3] = {qn, kn, kn};
    for (int t = 0; t < 3; t++)
        for (size_t i = 0; i < n[t]; i++)
            all[t][i] = ((seed = seed * 1664525u + 1013904223u) >> 8) / 16777216.0f * 2.0f - 1.0f;
}

static void problem_free(problem *p) { free(p->q), free(p->k), free(p->v), free(p->out), free(p->lse); }

static void problem_params(const problem *p, lt_attn_fwd_params *params, void *q, void *k, void *v, void *out,
                           void *lse, lt_device_type device) {
    int64_t qs[4] = {p->b, p->hq, p->sq, p->d}, ks[4] = {p->b, p->hk, p->sk, p->d};
    lt_attn_fwd_params_init(params);
    lt_tensor_init(&params->q, q, LT_DTYPE_FP32, 4, qs, device, 0);
    lt_tensor_init(&params->k, k, LT_DTYPE_FP32, 4, ks, device, 0);
    lt_tensor_init(&params->v, v, LT_DTYPE_FP32, 4, ks, device, 0);
    lt_tensor_init(&params->out, out, LT_DTYPE_FP32, 4, qs, device, 0);
    lt_tensor_init(&params->lse, lse, LT_DTYPE_FP32, 3, qs, device, 0);
    params->causal = p->causal;
}

/* max |out - reference| over out and lse (-inf matching -inf counts as 0). */
static double problem_error(const problem *p, const float *out, const float *lse) {
    double scale = 1.0 / sqrt((double)p->d), worst = 0.0;
    int64_t group = p->hq / p->hk;
    double *s = malloc(sizeof(double) * (size_t)p->sk);
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t h = 0; h < p->hq; h++)
            for (int64_t i = 0; i < p->sq; i++) {
                const float *qi = p->q + ((b * p->hq + h) * p->sq + i) * p->d;
                int64_t kv = (b * p->hk + h / group) * p->sk * p->d;
                int64_t last = p->causal == LT_CAUSAL_NONE ? p->sk - 1
                             : p->causal == LT_CAUSAL_TOP_LEFT ? i : i + p->sk - p->sq;
                if (last > p->sk - 1) last = p->sk - 1;
                double m = -INFINITY, sum = 0.0;
                for (int64_t j = 0; j <= last; j++) {
                    double dot = 0.0;
                    for (int64_t c = 0; c < p->d; c++) dot += (double)qi[c] * p->k[kv + j * p->d + c];
                    s[j] = dot * scale;
                    m = s[j] > m ? s[j] : m;
                }
                for (int64_t j = 0; j <= last; j++) sum += (s[j] = exp(s[j] - m));
                for (int64_t c = 0; c < p->d; c++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j <= last; j++) acc += s[j] * p->v[kv + j * p->d + c];
                    double want = last >= 0 ? acc / sum : 0.0;
                    worst = fmax(worst, fabs(out[((b * p->hq + h) * p->sq + i) * p->d + c] - want));
                }
                double want_lse = last >= 0 ? m + log(sum) : -INFINITY, got = lse[(b * p->hq + h) * p->sq + i];
                if (!(isinf(want_lse) && isinf(got) && got < 0))
                    worst = fmax(worst, fabs(got - want_lse));
            }
    free(s);
    return worst;
}

/* ---- errors ------------------------------------------------------------- */

static void *other_thread_error(void *arg) {
    (void)arg;
    lt_version(NULL, NULL, NULL);
    return strstr(lt_last_error(), "lt_version") ? (void *)1 : NULL;
}

static void check_params_errors(const problem *p) {
    lt_attn_fwd_params good, bad;
    problem_params(p, &good, p->q, p->k, p->v, p->out, p->lse, LT_DEVICE_CPU);
    expect("null params", lt_attn_fwd(NULL, NULL), LT_ERROR_NULL_POINTER, "params is NULL");
#define CASE(name, change, status, needle) do { bad = good; change; expect(name, lt_attn_fwd(&bad, NULL), status, needle); } while (0)
    CASE("struct size", bad.struct_size -= 8, LT_ERROR_VERSION, "struct_size");
    CASE("struct version", bad.version = 9, LT_ERROR_VERSION, "version is 9");
    CASE("q dtype unknown", bad.q.dtype = 7, LT_ERROR_DTYPE, "q.dtype is 7");
    CASE("k dtype differs", bad.k.dtype = LT_DTYPE_FP16, LT_ERROR_DTYPE, "k.dtype is fp16 but q.dtype is fp32");
    CASE("lse dtype", (bad.lse.dtype = LT_DTYPE_FP16), LT_ERROR_DTYPE, "lse.dtype is fp16");
    CASE("head dim mismatch", (bad.k.sizes[3] = 8, bad.v.sizes[3] = 8), LT_ERROR_SHAPE, "k has head dim 8");
    CASE("k v differ", bad.v.sizes[2] = 3, LT_ERROR_SHAPE, "k and v must have the same shape");
    CASE("batch mismatch", (bad.k.sizes[0] = 2, bad.v.sizes[0] = 2), LT_ERROR_SHAPE, "k has batch 2");
    CASE("out shape", bad.out.sizes[2] = 5, LT_ERROR_SHAPE, "out has shape");
    CASE("lse shape", bad.lse.sizes[2] = 5, LT_ERROR_SHAPE, "lse has shape");
    CASE("gqa heads", (bad.q.sizes[1] = 3, bad.out.sizes[1] = 3, bad.lse.sizes[1] = 3, bad.k.sizes[1] = 2,
                       bad.v.sizes[1] = 2), LT_ERROR_SHAPE, "multiple of k/v heads");
    CASE("q ndim", bad.q.ndim = 3, LT_ERROR_SHAPE, "q.ndim is 3");
    CASE("negative size", bad.q.sizes[2] = -1, LT_ERROR_SHAPE, "q.sizes[2] is -1");
    CASE("negative stride", bad.k.strides[1] = -4, LT_ERROR_SHAPE, "k.strides[1] is -4");
    CASE("last stride", bad.v.strides[3] = 2, LT_ERROR_SHAPE, "v.strides[3] is 2");
    CASE("lse strides", bad.lse.strides[1] = 64, LT_ERROR_SHAPE, "lse must be contiguous");
    int64_t d0[4] = {p->b, p->hq, p->sq, 0}, k0[4] = {p->b, p->hk, p->sk, 0};
    int64_t d300[4] = {p->b, p->hq, p->sq, 300}, k300[4] = {p->b, p->hk, p->sk, 300};
    CASE("head dim 0", (memcpy(bad.q.sizes, d0, 32), memcpy(bad.out.sizes, d0, 32), memcpy(bad.k.sizes, k0, 32),
                        memcpy(bad.v.sizes, k0, 32)), LT_ERROR_HEAD_DIM, "must be in 1..256, got 0");
    CASE("head dim 300", (memcpy(bad.q.sizes, d300, 32), memcpy(bad.out.sizes, d300, 32),
                          memcpy(bad.k.sizes, k300, 32), memcpy(bad.v.sizes, k300, 32)), LT_ERROR_HEAD_DIM,
         "must be in 1..256, got 300");
    CASE("q data null", bad.q.data = NULL, LT_ERROR_NULL_POINTER, "q.data is NULL");
    CASE("lse data null", bad.lse.data = NULL, LT_ERROR_NULL_POINTER, "lse.data is NULL");
    CASE("causal mode", bad.causal = 5, LT_ERROR_INVALID_ARGUMENT, "causal is 5");
    CASE("sm_scale inf", bad.sm_scale = INFINITY, LT_ERROR_INVALID_ARGUMENT, "sm_scale is inf");
    CASE("flags", bad.flags = 1, LT_ERROR_INVALID_ARGUMENT, "flags is 0x1");
    CASE("device type", bad.q.device_type = 9, LT_ERROR_INVALID_ARGUMENT, "q.device_type is 9");
    CASE("mixed devices", bad.k.device_type = LT_DEVICE_CUDA, LT_ERROR_INVALID_ARGUMENT, "k is on cuda:0 but q is on cpu");
#undef CASE
    lt_plan *plan = (lt_plan *)&good;
    expect("plan on cpu", lt_attn_fwd_plan(&good, &plan), LT_ERROR_UNSUPPORTED, "plans need a GPU");
    check("plan on cpu leaves NULL", plan == NULL, "*plan was not set to NULL");
    expect("plan out null", lt_attn_fwd_plan(&good, NULL), LT_ERROR_NULL_POINTER, "plan (the out pointer) is NULL");
    expect("plan bad params", lt_attn_fwd_plan(NULL, &plan), LT_ERROR_NULL_POINTER, "params is NULL");
    expect("launch null plan", lt_plan_launch(NULL, &good, NULL), LT_ERROR_NULL_POINTER, "plan is NULL");
    uint64_t not_a_plan[128] = {0};
    expect("launch dead plan", lt_plan_launch((const lt_plan *)not_a_plan, &good, NULL), LT_ERROR_INVALID_ARGUMENT,
           "not a live plan");
    expect("destroy null", lt_plan_destroy(NULL), LT_OK, NULL);
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) ? (void *)1 : dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda == NULL) { /* no GPU here: device pointers are refused with a status */
        bad = good;
        bad.q.device_type = bad.k.device_type = bad.v.device_type = bad.out.device_type = bad.lse.device_type =
            LT_DEVICE_CUDA;
        expect("no gpu attn", lt_attn_fwd(&bad, NULL), LT_ERROR_NO_GPU, "libcuda.so.1");
        expect("no gpu plan", lt_attn_fwd_plan(&bad, &plan), LT_ERROR_NO_GPU, "libcuda.so.1");
    }
}

/* ---- the backward's errors ----------------------------------------------- */

typedef struct {
    float *dout, *dq, *dk, *dv, *delta, *strided; /* strided: dq with row stride d + 4 */
} grads;

static void grads_make(const problem *p, grads *g) {
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d), kn = (size_t)(p->b * p->hk * p->sk * p->d);
    g->dout = malloc(4 * qn), g->dq = malloc(4 * qn), g->dk = malloc(4 * kn), g->dv = malloc(4 * kn);
    g->delta = malloc(4 * (size_t)(p->b * p->hq * p->sq));
    g->strided = calloc((size_t)(p->b * p->hq * p->sq * (p->d + 4)), 4);
    uint32_t seed = 99;
    for (size_t i = 0; i < qn; i++)
        g->dout[i] = ((seed = seed * 1664525u + 1013904223u) >> 8) / 16777216.0f * 2.0f - 1.0f;
}

static void grads_free(grads *g) {
    free(g->dout), free(g->dq), free(g->dk), free(g->dv), free(g->delta), free(g->strided);
}

static void bwd_params(const problem *p, const grads *g, lt_attn_bwd_params *params) {
    lt_attn_fwd_params f;
    problem_params(p, &f, p->q, p->k, p->v, p->out, p->lse, LT_DEVICE_CPU);
    lt_attn_bwd_params_init(params);
    params->q = f.q, params->k = f.k, params->v = f.v, params->out = f.out, params->lse = f.lse;
    params->causal = f.causal;
    lt_tensor_init(&params->dout, g->dout, LT_DTYPE_FP32, 4, f.q.sizes, LT_DEVICE_CPU, 0);
    lt_tensor_init(&params->dq, g->dq, LT_DTYPE_FP32, 4, f.q.sizes, LT_DEVICE_CPU, 0);
    lt_tensor_init(&params->dk, g->dk, LT_DTYPE_FP32, 4, f.k.sizes, LT_DEVICE_CPU, 0);
    lt_tensor_init(&params->dv, g->dv, LT_DTYPE_FP32, 4, f.k.sizes, LT_DEVICE_CPU, 0);
    lt_tensor_init(&params->delta, g->delta, LT_DTYPE_FP32, 3, f.q.sizes, LT_DEVICE_CPU, 0);
}

static int all_zero(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (x[i] != 0.0f) return 0;
    return 1;
}

/* A valid backward, then the same with dq strided: bitwise the same dq (deterministic, strides honoured). */
static void check_bwd_valid(const problem *p, const grads *g, const lt_attn_bwd_params *good) {
    lt_attn_bwd_params strided = *good;
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d), kn = (size_t)(p->b * p->hk * p->sk * p->d);
    expect("bwd valid", lt_attn_bwd(good, NULL), LT_OK, NULL);
    check("bwd writes gradients", !all_zero(g->dq, qn) && !all_zero(g->dk, kn) && !all_zero(g->dv, kn),
          "a gradient is all zero");
    strided.dq.data = g->strided + 1; /* and 4 bytes off 16-byte alignment */
    strided.dq.strides[2] = p->d + 4, strided.dq.strides[1] = p->sq * (p->d + 4);
    strided.dq.strides[0] = p->hq * p->sq * (p->d + 4);
    expect("bwd strided dq", lt_attn_bwd(&strided, NULL), LT_OK, NULL);
    int same = 1;
    for (int64_t r = 0; r < p->b * p->hq * p->sq; r++)
        same = same && !memcmp(g->strided + 1 + r * (p->d + 4), g->dq + r * p->d, 4 * (size_t)p->d);
    check("bwd strided dq is bitwise the same", same, "dq through strides differs");
}

/* No work: seqlen_q 0 zeroes dk and dv, seqlen_k 0 zeroes dq; on a GPU it is refused before the driver. */
static void check_bwd_no_work(const problem *p, const grads *g, const lt_attn_bwd_params *good) {
    lt_attn_bwd_params bad = *good;
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d), kn = (size_t)(p->b * p->hk * p->sk * p->d);
    memset(g->dk, 0x7f, 4 * kn), memset(g->dv, 0x7f, 4 * kn), memset(g->dq, 0x7f, 4 * qn);
    bad.q.sizes[2] = bad.out.sizes[2] = bad.dout.sizes[2] = bad.dq.sizes[2] = bad.lse.sizes[2] = 0;
    bad.delta.sizes[2] = 0;
    expect("bwd seqlen_q 0", lt_attn_bwd(&bad, NULL), LT_OK, NULL);
    check("bwd seqlen_q 0 zeroes dk dv", all_zero(g->dk, kn) && all_zero(g->dv, kn), "dk or dv not zeroed");
    bad = *good;
    bad.k.sizes[2] = bad.v.sizes[2] = bad.dk.sizes[2] = bad.dv.sizes[2] = 0;
    expect("bwd seqlen_k 0", lt_attn_bwd(&bad, NULL), LT_OK, NULL);
    check("bwd seqlen_k 0 zeroes dq", all_zero(g->dq, qn), "dq not zeroed");
    bad.q.sizes[0] = bad.k.sizes[0] = bad.v.sizes[0] = bad.out.sizes[0] = bad.lse.sizes[0] = 0;
    bad.dout.sizes[0] = bad.dq.sizes[0] = bad.dk.sizes[0] = bad.dv.sizes[0] = bad.delta.sizes[0] = 0;
    bad.q.data = bad.dq.data = bad.dk.data = bad.dv.data = NULL;
    expect("bwd batch 0", lt_attn_bwd(&bad, NULL), LT_OK, NULL);
    bad = *good;
    bad.q.sizes[2] = bad.out.sizes[2] = bad.dout.sizes[2] = bad.dq.sizes[2] = bad.lse.sizes[2] = 0;
    bad.delta.sizes[2] = 0;
    lt_tensor *all[10] = {&bad.q, &bad.k, &bad.v, &bad.out, &bad.lse, &bad.dout, &bad.dq, &bad.dk, &bad.dv,
                          &bad.delta};
    for (int i = 0; i < 10; i++)
        all[i]->device_type = LT_DEVICE_CUDA;
    expect("bwd no work on gpu", lt_attn_bwd(&bad, NULL), LT_ERROR_UNSUPPORTED, "gradients to zero");
}

static void check_bwd_errors(const problem *p) {
    grads g;
    grads_make(p, &g);
    lt_attn_bwd_params good, bad;
    bwd_params(p, &g, &good);
    expect("bwd init null", lt_attn_bwd_params_init(NULL), LT_ERROR_NULL_POINTER, "params is NULL");
    expect("bwd null params", lt_attn_bwd(NULL, NULL), LT_ERROR_NULL_POINTER, "params is NULL");
#define CASE(name, change, status, needle) do { bad = good; change; expect(name, lt_attn_bwd(&bad, NULL), status, needle); } while (0)
    CASE("bwd struct size", bad.struct_size = sizeof(lt_attn_fwd_params), LT_ERROR_VERSION,
         "lt_attn_bwd_params_init()");
    CASE("bwd struct version", bad.version = 9, LT_ERROR_VERSION, "lt_attn_bwd_params version 6");
    CASE("bwd q dtype unknown", bad.q.dtype = 7, LT_ERROR_DTYPE, "q.dtype is 7");
    CASE("bwd lse shape", bad.lse.sizes[2] = 5, LT_ERROR_SHAPE, "lse has shape");
    CASE("bwd out shape", bad.out.sizes[1] = 1, LT_ERROR_SHAPE, "out has shape");
    CASE("bwd causal mode", bad.causal = 3, LT_ERROR_INVALID_ARGUMENT, "causal is 3");
    CASE("bwd sm_scale inf", bad.sm_scale = -INFINITY, LT_ERROR_INVALID_ARGUMENT, "sm_scale is -inf");
    CASE("bwd flags", bad.flags = 4, LT_ERROR_INVALID_ARGUMENT, "flags is 0x4");
    CASE("bwd dout dtype unknown", bad.dout.dtype = 9, LT_ERROR_DTYPE, "dout.dtype is 9");
    CASE("bwd dout dtype differs", bad.dout.dtype = LT_DTYPE_FP16, LT_ERROR_DTYPE,
         "dout.dtype is fp16 but out.dtype is fp32");
    CASE("bwd dout shape", bad.dout.sizes[2] = 3, LT_ERROR_SHAPE, "dout has shape (1, 2, 3, 16); expected out's shape");
    CASE("bwd dout ndim", bad.dout.ndim = 3, LT_ERROR_SHAPE, "dout.ndim is 3");
    CASE("bwd dout device", bad.dout.device_type = LT_DEVICE_CUDA, LT_ERROR_INVALID_ARGUMENT,
         "dout is on cuda:0 but q is on cpu:0");
    CASE("bwd dq shape", bad.dq.sizes[3] = 8, LT_ERROR_SHAPE, "dq has shape (1, 2, 8, 8); expected q's shape");
    CASE("bwd dq last stride", bad.dq.strides[3] = 2, LT_ERROR_SHAPE, "dq.strides[3] is 2");
    CASE("bwd dq negative stride", bad.dq.strides[0] = -1, LT_ERROR_SHAPE, "dq.strides[0] is -1");
    CASE("bwd dk shape", bad.dk.sizes[1] = 2, LT_ERROR_SHAPE, "dk has shape (1, 2, 8, 16); expected k's shape");
    CASE("bwd dv dtype", bad.dv.dtype = LT_DTYPE_BF16, LT_ERROR_DTYPE, "dv.dtype is bf16 but v.dtype is fp32");
    CASE("bwd dv device index", bad.dv.device_index = 1, LT_ERROR_INVALID_ARGUMENT, "dv.device_index is 1");
    CASE("bwd delta dtype", bad.delta.dtype = LT_DTYPE_FP16, LT_ERROR_DTYPE, "delta.dtype is fp16");
    CASE("bwd delta ndim", bad.delta.ndim = 4, LT_ERROR_SHAPE, "delta.ndim is 4");
    CASE("bwd delta shape", bad.delta.sizes[1] = 1, LT_ERROR_SHAPE, "delta has shape (1, 1, 8)");
    CASE("bwd delta strides", bad.delta.strides[1] = 16, LT_ERROR_SHAPE, "delta must be contiguous");
    CASE("bwd delta device", bad.delta.device_type = LT_DEVICE_CUDA, LT_ERROR_INVALID_ARGUMENT,
         "delta is on cuda:0 but q is on cpu:0");
    CASE("bwd dout null", bad.dout.data = NULL, LT_ERROR_NULL_POINTER, "dout.data is NULL");
    CASE("bwd dq null", bad.dq.data = NULL, LT_ERROR_NULL_POINTER, "dq.data is NULL");
    CASE("bwd dv null", bad.dv.data = NULL, LT_ERROR_NULL_POINTER, "dv.data is NULL");
    CASE("bwd delta null", bad.delta.data = NULL, LT_ERROR_NULL_POINTER, "delta.data is NULL");
    CASE("bwd k null", bad.k.data = NULL, LT_ERROR_NULL_POINTER, "k.data is NULL");
#undef CASE
    lt_bwd_plan *plan = (lt_bwd_plan *)&good;
    expect("bwd plan on cpu", lt_attn_bwd_plan(&good, &plan), LT_ERROR_UNSUPPORTED, "call lt_attn_bwd instead");
    check("bwd plan on cpu leaves NULL", plan == NULL, "*plan was not set to NULL");
    expect("bwd plan out null", lt_attn_bwd_plan(&good, NULL), LT_ERROR_NULL_POINTER, "plan (the out pointer)");
    expect("bwd plan bad params", lt_attn_bwd_plan(NULL, &plan), LT_ERROR_NULL_POINTER, "params is NULL");
    expect("bwd launch null plan", lt_bwd_plan_launch(NULL, &good, NULL), LT_ERROR_NULL_POINTER, "plan is NULL");
    uint64_t not_a_plan[256] = {0};
    expect("bwd launch dead plan", lt_bwd_plan_launch((const lt_bwd_plan *)not_a_plan, &good, NULL),
           LT_ERROR_INVALID_ARGUMENT, "not a live backward plan");
    expect("bwd destroy null", lt_bwd_plan_destroy(NULL), LT_OK, NULL);
    expect("bwd destroy dead plan", lt_bwd_plan_destroy((lt_bwd_plan *)not_a_plan), LT_ERROR_INVALID_ARGUMENT,
           "not a live backward plan");
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) ? (void *)1 : dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda == NULL) { /* no GPU here: device pointers are refused with a status */
        bad = good;
        lt_tensor *all[10] = {&bad.q, &bad.k, &bad.v, &bad.out, &bad.lse, &bad.dout, &bad.dq, &bad.dk, &bad.dv,
                              &bad.delta};
        for (int i = 0; i < 10; i++)
            all[i]->device_type = LT_DEVICE_CUDA;
        expect("bwd no gpu", lt_attn_bwd(&bad, NULL), LT_ERROR_NO_GPU, "libcuda.so.1");
        expect("bwd no gpu plan", lt_attn_bwd_plan(&bad, &plan), LT_ERROR_NO_GPU, "libcuda.so.1");
    }
    check_bwd_valid(p, &g, &good);
    check_bwd_no_work(p, &g, &good);
    grads_free(&g);
}

static int run_errors(const char *cache_dir) {
    problem p;
    problem_make(&p, 1, 2, 1, 8, 8, 16, LT_CAUSAL_NONE, 7);
    lt_attn_fwd_params params;
    problem_params(&p, &params, p.q, p.k, p.v, p.out, p.lse, LT_DEVICE_CPU);
    const char *spec[1] = {"target=sm_90 dtype=fp16 head_dim=16"};
    lt_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats, stats.version = LT_STATS_VERSION;
    lt_plan *plan = NULL;
    expect("attn before init", lt_attn_fwd(&params, NULL), LT_ERROR_NOT_INITIALIZED, "lt_init");
    lt_attn_bwd_params bwd;
    lt_bwd_plan *bwd_plan = NULL;
    lt_attn_bwd_params_init(&bwd);
    expect("bwd before init", lt_attn_bwd(&bwd, NULL), LT_ERROR_NOT_INITIALIZED, "lt_init");
    expect("bwd plan before init", lt_attn_bwd_plan(&bwd, &bwd_plan), LT_ERROR_NOT_INITIALIZED, "lt_init");
    expect("plan before init", lt_attn_fwd_plan(&params, &plan), LT_ERROR_NOT_INITIALIZED, "lt_init");
    expect("prewarm before init", lt_prewarm(spec, 1, NULL, NULL), LT_ERROR_NOT_INITIALIZED, "lt_init");
    expect("stats before init", lt_cache_stats(&stats), LT_ERROR_NOT_INITIALIZED, "lt_init");
    int major = -1, minor = -1, patch = -1;
    expect("version", lt_version(&major, &minor, &patch), LT_OK, NULL);
    check("version matches header", major == LT_VERSION_MAJOR && minor == LT_VERSION_MINOR &&
          patch == LT_VERSION_PATCH, "lt_version differs from the header's macros");
    expect("version null", lt_version(NULL, &minor, &patch), LT_ERROR_NULL_POINTER, "must not be NULL");
    pthread_t thread;
    void *seen = NULL;
    pthread_create(&thread, NULL, other_thread_error, NULL);
    pthread_join(thread, &seen);
    check("error is per thread", seen != NULL && strstr(lt_last_error(), "lt_version") != NULL &&
          strstr(lt_last_error(), "major") != NULL, "another thread's error showed, or its own did not");
    int64_t sizes[5] = {1, 1, 1, 1, 1};
    lt_tensor t;
    expect("tensor init ndim", lt_tensor_init(&t, NULL, LT_DTYPE_FP32, 5, sizes, LT_DEVICE_CPU, 0), LT_ERROR_SHAPE,
           "ndim is 5");
    expect("tensor init null", lt_tensor_init(NULL, NULL, LT_DTYPE_FP32, 4, sizes, LT_DEVICE_CPU, 0),
           LT_ERROR_NULL_POINTER, NULL);
    lt_config config;
    expect("config init null", lt_config_init(NULL), LT_ERROR_NULL_POINTER, NULL);
    lt_config_init(&config);
    config.struct_size -= 8;
    expect("init config size", lt_init(&config), LT_ERROR_VERSION, "struct_size");
    lt_config_init(&config);
    config.log_level = 7;
    expect("init log level", lt_init(&config), LT_ERROR_INVALID_ARGUMENT, "config.log_level is 7");
    expect("still not initialised", lt_attn_fwd(&params, NULL), LT_ERROR_NOT_INITIALIZED, "lt_init");
    lt_config_init(&config);
    config.jit = 5;
    expect("init jit", lt_init(&config), LT_ERROR_INVALID_ARGUMENT, "config.jit is 5");
    lt_config_init(&config);
    config.cache_dir = "";
    expect("init empty cache dir", lt_init(&config), LT_ERROR_INVALID_ARGUMENT, "config.cache_dir");
    lt_config_init(&config);
    config.cache_dir = cache_dir;
    config.log_level = LT_LOG_WARNING;
    expect("init", lt_init(&config), LT_OK, NULL);
    check_params_errors(&p);
    expect("forward for the backward", lt_attn_fwd(&params, NULL), LT_OK, NULL);
    check_bwd_errors(&p);
    const char *bad_specs[2] = {"target=sm_90 dtype=fp64 head_dim=16", "color=red"};
    expect("prewarm null specs", lt_prewarm(NULL, 1, NULL, NULL), LT_ERROR_NULL_POINTER, "specs is NULL");
    expect("prewarm bad dtype", lt_prewarm(bad_specs, 1, NULL, NULL), LT_ERROR_INVALID_ARGUMENT, "specs[0]");
    expect("prewarm bad axis", lt_prewarm(bad_specs + 1, 1, NULL, NULL), LT_ERROR_INVALID_ARGUMENT, "'color=red'");
    expect("prewarm nothing", lt_prewarm(NULL, 0, NULL, NULL), LT_OK, NULL);
    expect("stats null", lt_cache_stats(NULL), LT_ERROR_NULL_POINTER, "stats is NULL");
    stats.version = 9;
    expect("stats version", lt_cache_stats(&stats), LT_ERROR_VERSION, "version 9");
    stats.version = LT_STATS_VERSION;
    expect("stats", lt_cache_stats(&stats), LT_OK, NULL);
    lt_attn_fwd_params no_rows = params;
    int64_t q0[4] = {p.b, p.hq, 0, p.d};
    lt_tensor_init(&no_rows.q, p.q, LT_DTYPE_FP32, 4, q0, LT_DEVICE_CPU, 0);
    lt_tensor_init(&no_rows.out, p.out, LT_DTYPE_FP32, 4, q0, LT_DEVICE_CPU, 0);
    lt_tensor_init(&no_rows.lse, p.lse, LT_DTYPE_FP32, 3, q0, LT_DEVICE_CPU, 0);
    expect("seqlen_q 0 from lt_tensor_init", lt_attn_fwd(&no_rows, NULL), LT_OK, NULL);
    expect("valid call after errors", lt_attn_fwd(&params, NULL), LT_OK, NULL);
    double error = problem_error(&p, p.out, p.lse);
    check("valid call is right", error < 2e-3, "result differs from the reference");
    problem_free(&p);
    return failures;
}

static int run_nopython(void) {
    problem p;
    problem_make(&p, 1, 1, 1, 4, 4, 16, LT_CAUSAL_NONE, 3);
    lt_attn_fwd_params params;
    problem_params(&p, &params, p.q, p.k, p.v, p.out, p.lse, LT_DEVICE_CPU);
    expect("init without python", lt_init(NULL), LT_ERROR_PYTHON, "failed to start");
    expect("init again", lt_init(NULL), LT_ERROR_PYTHON, "failed to start");
    expect("attn without python", lt_attn_fwd(&params, NULL), LT_ERROR_NOT_INITIALIZED, "lt_init");
    printf("alive\n");
    problem_free(&p);
    return failures;
}

static int run_badenv(void) {
    expect("init with a bad variable", lt_init(NULL), LT_ERROR_INVALID_ARGUMENT, "LAZYTRITON_JIT");
    printf("alive\n");
    return failures;
}

/* ---- threads ------------------------------------------------------------ */

typedef struct {
    int index;
    double error;
    lt_status status, bad_status, bwd_status, bwd_bad_status;
    char message[256], bad_message[256], bwd_message[256], bwd_bad_message[256];
} job;

static void *thread_main(void *arg) {
    job *j = (job *)arg;
    problem p;
    int i = j->index;
    problem_make(&p, 1 + i % 2, 2, 1 + i % 2, 17 + 5 * i, 9 + 7 * i, i % 3 == 0 ? 16 : 24, (lt_causal)(i % 3),
                 100u + (uint32_t)i);
    lt_attn_fwd_params params;
    problem_params(&p, &params, p.q, p.k, p.v, p.out, p.lse, LT_DEVICE_CPU);
    params.sm_scale = i % 2 ? 0.3 : NAN;
    j->status = lt_attn_fwd(&params, NULL);
    snprintf(j->message, sizeof j->message, "%s", lt_last_error());
    if (i % 2) { /* problem_error takes 1/sqrt(d): compare against a run with that scale */
        params.sm_scale = 1.0 / sqrt((double)p.d);
        if (j->status == LT_OK)
            j->status = lt_attn_fwd(&params, NULL);
    }
    j->error = j->status == LT_OK ? problem_error(&p, p.out, p.lse) : INFINITY;
    params.q.sizes[3] = params.out.sizes[3] = params.k.sizes[3] = params.v.sizes[3] = 300 + i;
    j->bad_status = lt_attn_fwd(&params, NULL);
    snprintf(j->bad_message, sizeof j->bad_message, "%s", lt_last_error());
    grads g; /* the backward of the same call, and a bad one with this thread's own message */
    lt_attn_bwd_params bwd;
    grads_make(&p, &g);
    bwd_params(&p, &g, &bwd);
    j->bwd_status = lt_attn_bwd(&bwd, NULL);
    snprintf(j->bwd_message, sizeof j->bwd_message, "%s", lt_last_error());
    bwd.delta.sizes[2] = 1000 + i;
    j->bwd_bad_status = lt_attn_bwd(&bwd, NULL);
    snprintf(j->bwd_bad_message, sizeof j->bwd_bad_message, "%s", lt_last_error());
    grads_free(&g);
    problem_free(&p);
    return NULL;
}

static int run_threads(void) {
    enum { N = 8 };
    expect("init", lt_init(NULL), LT_OK, NULL);
    pthread_t threads[N];
    job jobs[N];
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].index = i;
        pthread_create(&threads[i], NULL, thread_main, &jobs[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_join(threads[i], NULL);
    for (int i = 0; i < N; i++) {
        char name[64], want[64], detail[600];
        snprintf(name, sizeof name, "thread %d", i);
        snprintf(detail, sizeof detail, "status %d (%s), max error %g", (int)jobs[i].status, jobs[i].message,
                 jobs[i].error);
        check(name, jobs[i].status == LT_OK && jobs[i].error < 2e-3, detail);
        snprintf(name, sizeof name, "thread %d own error", i);
        snprintf(want, sizeof want, "got %d", 300 + i);
        check(name, jobs[i].bad_status == LT_ERROR_HEAD_DIM && strstr(jobs[i].bad_message, want) != NULL,
              jobs[i].bad_message);
        snprintf(name, sizeof name, "thread %d backward", i);
        check(name, jobs[i].bwd_status == LT_OK, jobs[i].bwd_message);
        snprintf(name, sizeof name, "thread %d own backward error", i);
        snprintf(want, sizeof want, ", %d); expected", 1000 + i);
        check(name, jobs[i].bwd_bad_status == LT_ERROR_SHAPE && strstr(jobs[i].bwd_bad_message, want) != NULL,
              jobs[i].bwd_bad_message);
    }
    return failures;
}

/* ---- prewarm and stats --------------------------------------------------- */

static lt_stats stats_now(void) {
    lt_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s, s.version = LT_STATS_VERSION;
    expect("stats", lt_cache_stats(&s), LT_OK, NULL);
    return s;
}

static int run_prewarm(const char *variant) {
    const char *axes[1] = {"target=sm_90 dtype=fp16 head_dim=16 seqlen_q=16"};
    const char *by_name[1] = {variant};
    size_t compiled = 99, cached = 99;
    char detail[128];
    expect("init", lt_init(NULL), LT_OK, NULL);
    expect("prewarm axes", lt_prewarm(axes, 1, &compiled, &cached), LT_OK, NULL);
    snprintf(detail, sizeof detail, "compiled %zu, cached %zu", compiled, cached);
    check("prewarm compiled one", compiled == 1 && cached == 0, detail);
    lt_stats s = stats_now();
    snprintf(detail, sizeof detail, "local_entries %llu, compiles %llu, process_compiles %llu",
             (unsigned long long)s.local_entries, (unsigned long long)s.compiles,
             (unsigned long long)s.process_compiles);
    check("stats count it", s.local_entries == 1 && s.compiles == 1 && s.process_compiles == 1, detail);
    expect("prewarm again", lt_prewarm(axes, 1, &compiled, &cached), LT_OK, NULL);
    check("second prewarm is cached", compiled == 0 && cached == 1, "it compiled again");
    const char *backward[1] = {"kernel=flash_bwd target=sm_90 dtype=fp16 head_dim=16 seqlen_q=16"};
    expect("prewarm backward axes", lt_prewarm(backward, 1, &compiled, &cached), LT_OK, NULL);
    snprintf(detail, sizeof detail, "compiled %zu, cached %zu", compiled, cached);
    check("prewarm backward compiled its two kernels", compiled == 2 && cached == 0, detail);
    lt_config config;
    lt_config_init(&config);
    config.jit = LT_JIT_OFF;
    expect("init jit off", lt_init(&config), LT_OK, NULL);
    expect("prewarm variant string, jit off", lt_prewarm(by_name, 1, &compiled, &cached), LT_OK, NULL);
    check("served from the local tier", compiled == 0 && cached == 1, "not served from the cache");
    const char *missing[1] = {"target=sm_90 dtype=fp16 head_dim=32 seqlen_q=16"};
    expect("jit off miss", lt_prewarm(missing, 1, NULL, NULL), LT_ERROR_KERNEL_NOT_FOUND, "LAZYTRITON_JIT=0");
    s = stats_now();
    check("hits counted", s.hits >= 1, "no tier hit recorded");
    return failures;
}

/* ---- device memory (GPU) ------------------------------------------------- */

static cuda_driver cu;

static void *to_device(const void *host, size_t bytes) {
    uint64_t at = 0;
    if (cu.mem_alloc(&at, bytes + 16) || cu.htod(at, host, bytes)) {
        printf("FAIL cuMemAlloc/cuMemcpyHtoD\n");
        exit(100);
    }
    return (void *)(uintptr_t)at;
}

static double gpu_error(const problem *p, const lt_attn_fwd_params *params) {
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d), ln = (size_t)(p->b * p->hq * p->sq);
    if (cu.ctx_synchronize() || cu.dtoh(p->out, (uint64_t)(uintptr_t)params->out.data, 4 * qn) ||
        cu.dtoh(p->lse, (uint64_t)(uintptr_t)params->lse.data, 4 * ln))
        return INFINITY;
    return problem_error(p, p->out, p->lse);
}

static void device_params(problem *p, lt_attn_fwd_params *params) {
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d), kn = (size_t)(p->b * p->hk * p->sk * p->d);
    problem_params(p, params, to_device(p->q, 4 * qn), to_device(p->k, 4 * kn), to_device(p->v, 4 * kn),
                   to_device(p->out, 4 * qn), to_device(p->lse, 4 * (size_t)(p->b * p->hq * p->sq)),
                   LT_DEVICE_CUDA);
}

/* The backward on device memory, against the same call on host memory (the interpreter; the example checks
 * that one against a C loop in double): lt_attn_bwd, a plan, its launch for another shape, mismatches. */

typedef struct {
    problem *p;
    grads host;                    /* the host backward's gradients */
    lt_attn_bwd_params device;     /* the device call (q, k, v, out, lse: the device forward's) */
} bwd_case;

/* Overwrite the device's dq, dk and dv with 0x7f bytes (3.4e38), so that a launch that writes nothing fails. */
static void bwd_case_spoil(const bwd_case *t) {
    const problem *p = t->p;
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d), kn = (size_t)(p->b * p->hk * p->sk * p->d);
    size_t n[3] = {qn, kn, kn};
    void *at[3] = {t->device.dq.data, t->device.dk.data, t->device.dv.data};
    for (int i = 0; i < 3; i++) {
        void *junk = malloc(4 * n[i]);
        memset(junk, 0x7f, 4 * n[i]);
        if (cu.htod((uint64_t)(uintptr_t)at[i], junk, 4 * n[i])) {
            printf("FAIL cuMemcpyHtoD\n");
            exit(100);
        }
        free(junk);
    }
}

static void bwd_case_make(bwd_case *t, problem *p, const lt_attn_fwd_params *device_fwd) {
    lt_attn_fwd_params host_fwd;
    lt_attn_bwd_params host;
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d), kn = (size_t)(p->b * p->hk * p->sk * p->d);
    t->p = p;
    grads_make(p, &t->host);
    problem_params(p, &host_fwd, p->q, p->k, p->v, p->out, p->lse, LT_DEVICE_CPU);
    expect("host forward", lt_attn_fwd(&host_fwd, NULL), LT_OK, NULL);
    bwd_params(p, &t->host, &host);
    expect("host backward", lt_attn_bwd(&host, NULL), LT_OK, NULL);
    t->device = host;
    t->device.q = device_fwd->q, t->device.k = device_fwd->k, t->device.v = device_fwd->v;
    t->device.out = device_fwd->out, t->device.lse = device_fwd->lse;
    t->device.dout.data = to_device(t->host.dout, 4 * qn), t->device.dq.data = to_device(t->host.dq, 4 * qn);
    t->device.dk.data = to_device(t->host.dk, 4 * kn), t->device.dv.data = to_device(t->host.dv, 4 * kn);
    t->device.delta.data = to_device(t->host.delta, 4 * (size_t)(p->b * p->hq * p->sq));
    lt_tensor *all[5] = {&t->device.dout, &t->device.dq, &t->device.dk, &t->device.dv, &t->device.delta};
    for (int i = 0; i < 5; i++)
        all[i]->device_type = LT_DEVICE_CUDA;
    bwd_case_spoil(t);
}

/* max |device - host| / max |host| over dq, dk, dv; *bits gets a copy of the device's dq for bitwise checks. */
static double bwd_case_error(const bwd_case *t, float *bits) {
    const problem *p = t->p;
    size_t n[3] = {(size_t)(p->b * p->hq * p->sq * p->d), (size_t)(p->b * p->hk * p->sk * p->d),
                   (size_t)(p->b * p->hk * p->sk * p->d)};
    const float *want[3] = {t->host.dq, t->host.dk, t->host.dv};
    void *at[3] = {t->device.dq.data, t->device.dk.data, t->device.dv.data};
    double worst = 0.0;
    if (cu.ctx_synchronize())
        return INFINITY;
    for (int i = 0; i < 3; i++) {
        float *got = malloc(4 * n[i]);
        double err = 0.0, size = 1e-6;
        if (cu.dtoh(got, (uint64_t)(uintptr_t)at[i], 4 * n[i])) {
            free(got);
            return INFINITY;
        }
        for (size_t j = 0; j < n[i]; j++)
            err = fmax(err, fabs(got[j] - want[i][j])), size = fmax(size, fabs(want[i][j]));
        if (i == 0 && bits != NULL)
            memcpy(bits, got, 4 * n[0]);
        worst = fmax(worst, err / size);
        free(got);
    }
    return worst;
}

static double max_difference(const float *a, const float *b, size_t n) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs((double)a[i] - b[i]));
    return worst;
}

static void run_gpu_bwd(problem *p, problem *other, const lt_attn_fwd_params *params,
                        const lt_attn_fwd_params *params2) {
    bwd_case t, u;
    char detail[128];
    size_t qn = (size_t)(p->b * p->hq * p->sq * p->d);
    float *first = malloc(4 * qn), *again = malloc(4 * qn);
    expect("gpu forward again", lt_attn_fwd(params, NULL), LT_OK, NULL); /* the unaligned call above wrote out */
    expect("gpu forward again, other", lt_attn_fwd(params2, NULL), LT_OK, NULL);
    bwd_case_make(&t, p, params);
    bwd_case_make(&u, other, params2);
    expect("gpu bwd", lt_attn_bwd(&t.device, NULL), LT_OK, NULL);
    double e = bwd_case_error(&t, first);
    snprintf(detail, sizeof detail, "max relative error %g against the host's", e);
    check("gpu bwd is right", e < 1e-3, detail);
    lt_bwd_plan *plan = NULL;
    expect("gpu bwd plan", lt_attn_bwd_plan(&t.device, &plan), LT_OK, NULL);
    bwd_case_spoil(&t);
    expect("gpu bwd plan launch", lt_bwd_plan_launch(plan, &t.device, NULL), LT_OK, NULL);
    bwd_case_error(&t, again);
    check("gpu bwd is deterministic", !memcmp(first, again, 4 * qn), "dq differs between two runs");
    expect("gpu bwd plan launch, other sizes", lt_bwd_plan_launch(plan, &u.device, NULL), LT_OK, NULL);
    e = bwd_case_error(&u, NULL);
    snprintf(detail, sizeof detail, "max relative error %g against the host's", e);
    check("gpu bwd plan launch is right", e < 1e-3, detail);
    lt_attn_bwd_params bad = t.device;
    bad.causal = LT_CAUSAL_NONE;
    expect("bwd plan causal mismatch", lt_bwd_plan_launch(plan, &bad, NULL), LT_ERROR_PLAN_MISMATCH, "not causal");
    bad = t.device;
    bad.dk.data = (char *)bad.dk.data + 4; /* only a gradient is off 16-byte alignment */
    expect("bwd plan alignment mismatch", lt_bwd_plan_launch(plan, &bad, NULL), LT_ERROR_PLAN_MISMATCH, "unaligned");
    bwd_case_spoil(&t);
    expect("unaligned bwd", lt_attn_bwd(&bad, NULL), LT_OK, NULL);
    if (cu.ctx_synchronize() || cu.dtoh(again, (uint64_t)(uintptr_t)bad.dq.data, 4 * qn))
        printf("FAIL cuMemcpyDtoH\n"), failures++;
    snprintf(detail, sizeof detail, "dq differs by up to %g from the aligned run's", max_difference(first, again, qn));
    check("unaligned bwd is right", max_difference(first, again, qn) < 1e-4, detail);
    bad = t.device;
    bad.q.sizes[2] = bad.out.sizes[2] = bad.dout.sizes[2] = bad.dq.sizes[2] = bad.lse.sizes[2] = 0;
    bad.delta.sizes[2] = 0;
    expect("bwd plan no work", lt_bwd_plan_launch(plan, &bad, NULL), LT_ERROR_UNSUPPORTED, "work to do");
    expect("bwd plan destroy", lt_bwd_plan_destroy(plan), LT_OK, NULL);
    grads_free(&t.host), grads_free(&u.host);
    free(first), free(again);
}

static int run_gpu(void) {
    const char *missing = NULL;
    if (cuda_driver_open(&cu, &missing) == NULL) {
        printf("FAIL libcuda.so.1: %s\n", missing);
        return 1;
    }
    if (cuda_context_current(&cu) != 0) {
        printf("FAIL no CUDA device 0\n");
        return 1;
    }
    expect("init", lt_init(NULL), LT_OK, NULL);
    problem p, other;
    /* Seqlens are multiples of 16: the backward plans get SEQ16 on top of ALIGN16 (lt_bwd.c). */
    problem_make(&p, 2, 4, 2, 112, 144, 64, LT_CAUSAL_BOTTOM_RIGHT, 11);
    problem_make(&other, 1, 2, 1, 48, 304, 64, LT_CAUSAL_TOP_LEFT, 12); /* same shape class, other sizes */
    lt_attn_fwd_params params, params2, bad;
    device_params(&p, &params);
    device_params(&other, &params2);
    char detail[128];
    expect("gpu attn", lt_attn_fwd(&params, NULL), LT_OK, NULL);
    double e = gpu_error(&p, &params);
    snprintf(detail, sizeof detail, "max error %g", e);
    check("gpu attn is right", e < 2e-3, detail);
    lt_plan *plan = NULL;
    expect("gpu plan", lt_attn_fwd_plan(&params, &plan), LT_OK, NULL);
    expect("gpu plan launch", lt_plan_launch(plan, &params2, NULL), LT_OK, NULL);
    e = gpu_error(&other, &params2);
    snprintf(detail, sizeof detail, "max error %g", e);
    check("gpu plan launch is right", e < 2e-3, detail);
    bad = params;
    bad.q.sizes[3] = bad.k.sizes[3] = bad.v.sizes[3] = bad.out.sizes[3] = 32;
    expect("plan head dim mismatch", lt_plan_launch(plan, &bad, NULL), LT_ERROR_PLAN_MISMATCH, "head dim 32");
    bad = params;
    bad.causal = LT_CAUSAL_NONE;
    expect("plan causal mismatch", lt_plan_launch(plan, &bad, NULL), LT_ERROR_PLAN_MISMATCH, "not causal");
    bad = params;
    bad.q.data = (char *)bad.q.data + 4; /* fp32: still a valid element boundary, no longer 16-byte aligned */
    expect("plan alignment mismatch", lt_plan_launch(plan, &bad, NULL), LT_ERROR_PLAN_MISMATCH, "unaligned");
    expect("unaligned attn", lt_attn_fwd(&bad, NULL), LT_OK, NULL);
    bad = params;
    bad.q.device_index = bad.k.device_index = bad.v.device_index = bad.out.device_index = bad.lse.device_index = 99;
    expect("no such device", lt_attn_fwd(&bad, NULL), LT_ERROR_NO_GPU, "no CUDA device 99");
    expect("plan destroy", lt_plan_destroy(plan), LT_OK, NULL);
    run_gpu_bwd(&p, &other, &params, &params2);
    lt_stats s = stats_now();
    check("plans kept", s.plans >= 3 && s.loaded_kernels >= 4, "lt_attn_fwd and lt_attn_bwd kept no plans");
    problem_free(&p), problem_free(&other);
    return failures;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "errors") && argc > 2) return run_errors(argv[2]);
    if (!strcmp(mode, "nopython")) return run_nopython();
    if (!strcmp(mode, "badenv")) return run_badenv();
    if (!strcmp(mode, "threads")) return run_threads();
    if (!strcmp(mode, "prewarm") && argc > 2) return run_prewarm(argv[2]);
    if (!strcmp(mode, "gpu")) return run_gpu();
    fprintf(stderr, "usage: %s errors CACHE_DIR | nopython | badenv | threads | prewarm VARIANT | gpu\n", argv[0]);
    return 100;
}
