/*
 * attention.c: lazytriton's C API on one attention call (and, with
 * --backward, its gradients), checked against a naive C loop.
 *
 *   attention [--gpu] [--plan] [--backward] [--dtype fp32|fp16|bf16] [--causal none|top_left|bottom_right]
 *             [--batch B] [--heads-q H] [--heads-k H] [--seqlen-q S] [--seqlen-k S] [--head-dim D]
 *
 * Host memory by default (lazytriton runs the kernel through Triton's
 * interpreter: slow, small shapes only). --gpu puts the tensors in CUDA device
 * memory, allocated through the driver API (libcuda.so.1, opened with dlopen,
 * so this builds without CUDA headers). --plan resolves the kernel once with
 * lt_attn_fwd_plan and launches it with lt_plan_launch (GPU only: on the CPU
 * the plan is refused, which the example shows, then it calls lt_attn_fwd).
 * --backward then computes dq, dk and dv with lt_attn_bwd (--plan: through
 * lt_attn_bwd_plan and lt_bwd_plan_launch) from the forward's out and lse and
 * a random dout, and checks them against the gradients computed in double.
 *
 * Exit status: 0 when the result matches the reference, 1 when it does not,
 * 2 on an error (with lazytriton's message).
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lazytriton.h>

typedef struct {
    int gpu, plan, backward;
    lt_dtype dtype;
    lt_causal causal;
    int64_t batch, heads_q, heads_k, seqlen_q, seqlen_k, head_dim;
} options;

/* ---- fp16 and bf16 in C (round to nearest even) ------------------------- */

static uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

static uint16_t to_fp16(float x) { /* normal and subnormal values; no inf/NaN needed here */
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    float a = fabsf(x);
    if (a < 6.103515625e-05f) /* subnormal: a multiple of 2**-24 */
        return sign | (uint16_t)lrintf(a * 16777216.0f);
    int exponent;
    float mantissa = frexpf(a, &exponent); /* a = mantissa * 2**exponent, mantissa in [0.5, 1) */
    long m = lrintf((mantissa * 2.0f - 1.0f) * 1024.0f);
    int e = exponent - 1 + 15;
    if (m == 1024) m = 0, e++;
    return sign | (uint16_t)(e << 10) | (uint16_t)m;
}

static float from_fp16(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float a = e == 0 ? ldexpf((float)m, -24) : ldexpf(1.0f + (float)m / 1024.0f, e - 15);
    return (h & 0x8000) ? -a : a;
}

static size_t item_size(lt_dtype dtype) { return dtype == LT_DTYPE_FP32 ? 4 : 2; }

/* Store x in element i of buf as dtype; returns the value stored (after rounding). */
static float store(void *buf, int64_t i, float x, lt_dtype dtype) {
    if (dtype == LT_DTYPE_FP32) {
        ((float *)buf)[i] = x;
        return x;
    }
    uint16_t h = dtype == LT_DTYPE_FP16 ? to_fp16(x) : to_bf16(x);
    ((uint16_t *)buf)[i] = h;
    return dtype == LT_DTYPE_FP16 ? from_fp16(h) : from_bf16(h);
}

static float load(const void *buf, int64_t i, lt_dtype dtype) {
    if (dtype == LT_DTYPE_FP32)
        return ((const float *)buf)[i];
    uint16_t h = ((const uint16_t *)buf)[i];
    return dtype == LT_DTYPE_FP16 ? from_fp16(h) : from_bf16(h);
}

/* ---- the reference: softmax(q k^T * scale) v, one query row at a time ---- */

static void reference(const options *o, const float *q, const float *k, const float *v, double *out, double *lse) {
    double scale = 1.0 / sqrt((double)o->head_dim);
    int64_t group = o->heads_q / o->heads_k, d = o->head_dim, sq = o->seqlen_q, sk = o->seqlen_k;
    double *p = (double *)malloc(sizeof(double) * (size_t)(sk > 0 ? sk : 1));
    for (int64_t b = 0; b < o->batch; b++)
        for (int64_t h = 0; h < o->heads_q; h++)
            for (int64_t i = 0; i < sq; i++) {
                const float *qi = q + ((b * o->heads_q + h) * sq + i) * d;
                const float *kb = k + (b * o->heads_k + h / group) * sk * d;
                const float *vb = v + (b * o->heads_k + h / group) * sk * d;
                double *oi = out + ((b * o->heads_q + h) * sq + i) * d;
                int64_t last = o->causal == LT_CAUSAL_NONE ? sk - 1
                             : o->causal == LT_CAUSAL_TOP_LEFT ? i : i + sk - sq; /* last key seen */
                if (last > sk - 1) last = sk - 1;
                double m = -INFINITY, sum = 0.0;
                for (int64_t j = 0; j <= last; j++) {
                    double s = 0.0;
                    for (int64_t c = 0; c < d; c++) s += (double)qi[c] * kb[j * d + c];
                    p[j] = s * scale;
                    if (p[j] > m) m = p[j];
                }
                for (int64_t j = 0; j <= last; j++) sum += (p[j] = exp(p[j] - m));
                for (int64_t c = 0; c < d; c++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j <= last; j++) acc += p[j] * vb[j * d + c];
                    oi[c] = last >= 0 ? acc / sum : 0.0; /* a query that sees no key: 0 and -inf */
                }
                lse[(b * o->heads_q + h) * sq + i] = last >= 0 ? m + log(sum) : -INFINITY;
            }
    free(p);
}

/* The gradients of sum(out * dout) in double: with P = exp(scale q k^T - lse) (masked),
 * dv = P^T dout, ds = P * (dout v^T - rowsum(dout * out)), dq = scale ds k, dk = scale ds^T q;
 * GQA: dk and dv summed over each group of query heads. dq, dk, dv start zeroed. */
static void reference_bwd(const options *o, const float *q, const float *k, const float *v, const float *dout,
                          const double *out, const double *lse, double *dq, double *dk, double *dv) {
    double scale = 1.0 / sqrt((double)o->head_dim);
    int64_t group = o->heads_q / o->heads_k, d = o->head_dim, sq = o->seqlen_q, sk = o->seqlen_k;
    for (int64_t b = 0; b < o->batch; b++)
        for (int64_t h = 0; h < o->heads_q; h++)
            for (int64_t i = 0; i < sq; i++) {
                int64_t row = ((b * o->heads_q + h) * sq + i) * d, kv = (b * o->heads_k + h / group) * sk * d;
                int64_t last = o->causal == LT_CAUSAL_NONE ? sk - 1
                             : o->causal == LT_CAUSAL_TOP_LEFT ? i : i + sk - sq;
                if (last > sk - 1) last = sk - 1;
                double delta = 0.0, l = lse[(b * o->heads_q + h) * sq + i];
                for (int64_t c = 0; c < d; c++) delta += (double)dout[row + c] * out[row + c];
                for (int64_t j = 0; j <= last; j++) { /* a query that sees no key: no gradient */
                    const float *kj = k + kv + j * d, *vj = v + kv + j * d;
                    double s = 0.0, dp = 0.0;
                    for (int64_t c = 0; c < d; c++)
                        s += (double)q[row + c] * kj[c], dp += (double)dout[row + c] * vj[c];
                    double p = exp(s * scale - l), ds = p * (dp - delta);
                    for (int64_t c = 0; c < d; c++) {
                        dq[row + c] += scale * ds * kj[c];
                        dk[kv + j * d + c] += scale * ds * q[row + c];
                        dv[kv + j * d + c] += p * dout[row + c];
                    }
                }
            }
}

/* max |got - want| / max |want| (max |want| floored at 1e-6, so zero gradients compare absolutely). */
static double relative_error(const void *got, const double *want, int64_t n, lt_dtype dtype) {
    double err = 0.0, size = 1e-6;
    for (int64_t i = 0; i < n; i++)
        err = fmax(err, fabs(load(got, i, dtype) - want[i])), size = fmax(size, fabs(want[i]));
    return err / size;
}

/* ---- device memory through the CUDA driver API (dlopen'd) -------------- */

static struct {
    int (*init)(unsigned);
    int (*device_get)(int *, int);
    int (*primary_ctx_retain)(void **, int);
    int (*ctx_set_current)(void *);
    int (*mem_alloc)(uint64_t *, size_t);
    int (*mem_free)(uint64_t);
    int (*htod)(uint64_t, const void *, size_t);
    int (*dtoh)(void *, uint64_t, size_t);
    int (*ctx_synchronize)(void);
} cu;

static int cuda_open(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        fprintf(stderr, "--gpu: cannot load libcuda.so.1: %s\n", dlerror());
        return -1;
    }
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&cu.init, "cuInit"}, {(void **)&cu.device_get, "cuDeviceGet"},
        {(void **)&cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.ctx_set_current, "cuCtxSetCurrent"}, {(void **)&cu.mem_alloc, "cuMemAlloc_v2"},
        {(void **)&cu.mem_free, "cuMemFree_v2"}, {(void **)&cu.htod, "cuMemcpyHtoD_v2"},
        {(void **)&cu.dtoh, "cuMemcpyDtoH_v2"}, {(void **)&cu.ctx_synchronize, "cuCtxSynchronize"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++)
        if ((*symbols[i].slot = dlsym(lib, symbols[i].name)) == NULL) {
            fprintf(stderr, "--gpu: libcuda.so.1 has no %s\n", symbols[i].name);
            return -1;
        }
    int device;
    void *context;
    if (cu.init(0) || cu.device_get(&device, 0) || cu.primary_ctx_retain(&context, device) ||
        cu.ctx_set_current(context)) {
        fprintf(stderr, "--gpu: no usable CUDA device 0\n");
        return -1;
    }
    return 0;
}

/* A copy of host buffer in device memory (or, on the CPU, the host buffer itself). */
static void *place(const options *o, void *host, size_t bytes) {
    if (!o->gpu)
        return host;
    uint64_t device = 0;
    if (cu.mem_alloc(&device, bytes ? bytes : 1) || cu.htod(device, host, bytes)) {
        fprintf(stderr, "--gpu: cuMemAlloc/cuMemcpyHtoD of %zu bytes failed\n", bytes);
        exit(2);
    }
    return (void *)(uintptr_t)device;
}

static void fetch(const options *o, void *host, void *placed, size_t bytes) {
    if (o->gpu && (cu.ctx_synchronize() || cu.dtoh(host, (uint64_t)(uintptr_t)placed, bytes))) {
        fprintf(stderr, "--gpu: cuCtxSynchronize/cuMemcpyDtoH failed\n");
        exit(2);
    }
}

/* ---- the call ----------------------------------------------------------- */

static int fail(const char *what, lt_status status) {
    fprintf(stderr, "%s failed: status %d: %s\n", what, (int)status, lt_last_error());
    return 2;
}

static int parse(int argc, char **argv, options *o) {
    *o = (options){0, 0, 0, LT_DTYPE_FP32, LT_CAUSAL_NONE, 2, 4, 2, 40, 56, 40};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *value = i + 1 < argc ? argv[i + 1] : "";
        int64_t *number = !strcmp(a, "--batch") ? &o->batch : !strcmp(a, "--heads-q") ? &o->heads_q
                        : !strcmp(a, "--heads-k") ? &o->heads_k : !strcmp(a, "--seqlen-q") ? &o->seqlen_q
                        : !strcmp(a, "--seqlen-k") ? &o->seqlen_k : !strcmp(a, "--head-dim") ? &o->head_dim : NULL;
        if (!strcmp(a, "--gpu")) o->gpu = 1;
        else if (!strcmp(a, "--plan")) o->plan = 1;
        else if (!strcmp(a, "--backward")) o->backward = 1;
        else if (number != NULL) *number = atoll(value), i++;
        else if (!strcmp(a, "--dtype") && (!strcmp(value, "fp32") || !strcmp(value, "fp16") || !strcmp(value, "bf16")))
            o->dtype = !strcmp(value, "fp32") ? LT_DTYPE_FP32 : !strcmp(value, "fp16") ? LT_DTYPE_FP16 : LT_DTYPE_BF16, i++;
        else if (!strcmp(a, "--causal") && (!strcmp(value, "none") || !strcmp(value, "top_left") || !strcmp(value, "bottom_right")))
            o->causal = !strcmp(value, "none") ? LT_CAUSAL_NONE : !strcmp(value, "top_left") ? LT_CAUSAL_TOP_LEFT
                      : LT_CAUSAL_BOTTOM_RIGHT, i++;
        else {
            fprintf(stderr, "usage: %s [--gpu] [--plan] [--backward] [--dtype fp32|fp16|bf16] [--causal none|top_left|"
                    "bottom_right] [--batch B] [--heads-q H] [--heads-k H] [--seqlen-q S] [--seqlen-k S] "
                    "[--head-dim D]\n", argv[0]);
            return -1;
        }
    }
    return 0;
}

/* Runs the call, through a plan if asked and possible; *used names the function whose status it returns. */
static lt_status run(const options *o, lt_attn_fwd_params *params, const char **used) {
    *used = "lt_attn_fwd";
    if (!o->plan)
        return lt_attn_fwd(params, NULL);
    lt_plan *plan = NULL;
    lt_status status = lt_attn_fwd_plan(params, &plan);
    if (status == LT_ERROR_UNSUPPORTED) { /* host memory: plans need a GPU */
        printf("lt_attn_fwd_plan: %s\n", lt_last_error());
        return lt_attn_fwd(params, NULL);
    }
    *used = status == LT_OK ? "lt_plan_launch" : "lt_attn_fwd_plan";
    if (status != LT_OK)
        return status;
    for (int i = 0; i < 3 && status == LT_OK; i++) /* the hot path: no Python, no GIL */
        status = lt_plan_launch(plan, params, NULL);
    lt_plan_destroy(plan);
    return status;
}

/* The backward's run, through a plan if asked and possible (as run() for the forward). */
static lt_status run_bwd(const options *o, lt_attn_bwd_params *params, const char **used) {
    *used = "lt_attn_bwd";
    if (!o->plan)
        return lt_attn_bwd(params, NULL);
    lt_bwd_plan *plan = NULL;
    lt_status status = lt_attn_bwd_plan(params, &plan);
    if (status == LT_ERROR_UNSUPPORTED) { /* host memory: plans need a GPU */
        printf("lt_attn_bwd_plan: %s\n", lt_last_error());
        return lt_attn_bwd(params, NULL);
    }
    *used = status == LT_OK ? "lt_bwd_plan_launch" : "lt_attn_bwd_plan";
    if (status != LT_OK)
        return status;
    for (int i = 0; i < 3 && status == LT_OK; i++) /* each launch writes the whole of dq, dk, dv */
        status = lt_bwd_plan_launch(plan, params, NULL);
    lt_bwd_plan_destroy(plan);
    return status;
}

/* The gradients of sum(out * dout) for a random dout, from the forward's out and lse (fwd's tensors, where the
 * forward left them), checked against reference_bwd. Returns 1 when they match, 0 when not, 2 on an error. */
static int backward(const options *o, const lt_attn_fwd_params *fwd, const float *qf, const float *kf,
                    const float *vf, const double *out_ref, const double *lse_ref) {
    int64_t qn = o->batch * o->heads_q * o->seqlen_q * o->head_dim;
    int64_t kn = o->batch * o->heads_k * o->seqlen_k * o->head_dim, ln = o->batch * o->heads_q * o->seqlen_q;
    size_t item = item_size(o->dtype);
    void *dout = malloc((size_t)qn * item), *dq = malloc((size_t)qn * item);
    void *dk = malloc((size_t)kn * item), *dv = malloc((size_t)kn * item);
    float *doutf = malloc(sizeof(float) * (size_t)qn), *delta = malloc(sizeof(float) * (size_t)ln);
    double *ref = calloc((size_t)(qn + 2 * kn), sizeof(double)); /* dq, dk, dv */
    uint32_t seed = 777;
    for (int64_t i = 0; i < qn; i++)
        doutf[i] = store(dout, i, ((seed = seed * 1664525u + 1013904223u) >> 8) / 16777216.0f * 2.0f - 1.0f,
                         o->dtype);
    lt_device_type device = o->gpu ? LT_DEVICE_CUDA : LT_DEVICE_CPU;
    int64_t qs[4] = {o->batch, o->heads_q, o->seqlen_q, o->head_dim};
    int64_t ks[4] = {o->batch, o->heads_k, o->seqlen_k, o->head_dim};
    void *at[5] = {place(o, dout, (size_t)qn * item), place(o, dq, (size_t)qn * item), place(o, dk, (size_t)kn * item),
                   place(o, dv, (size_t)kn * item), place(o, delta, sizeof(float) * (size_t)ln)};
    lt_attn_bwd_params params;
    lt_attn_bwd_params_init(&params);
    params.q = fwd->q, params.k = fwd->k, params.v = fwd->v, params.out = fwd->out, params.lse = fwd->lse;
    lt_tensor_init(&params.dout, at[0], o->dtype, 4, qs, device, 0);
    lt_tensor_init(&params.dq, at[1], o->dtype, 4, qs, device, 0);
    lt_tensor_init(&params.dk, at[2], o->dtype, 4, ks, device, 0);
    lt_tensor_init(&params.dv, at[3], o->dtype, 4, ks, device, 0);
    lt_tensor_init(&params.delta, at[4], LT_DTYPE_FP32, 3, qs, device, 0); /* (B, Hq, Sq) workspace */
    params.causal = fwd->causal, params.sm_scale = fwd->sm_scale;
    const char *used;
    lt_status status = run_bwd(o, &params, &used);
    int result = 2;
    if (status != LT_OK) {
        fail(used, status);
    } else {
        fetch(o, dq, at[1], (size_t)qn * item);
        fetch(o, dk, at[2], (size_t)kn * item);
        fetch(o, dv, at[3], (size_t)kn * item);
        reference_bwd(o, qf, kf, vf, doutf, out_ref, lse_ref, ref, ref + qn, ref + qn + kn);
        double eq = relative_error(dq, ref, qn, o->dtype), ek = relative_error(dk, ref + qn, kn, o->dtype);
        double ev = relative_error(dv, ref + qn + kn, kn, o->dtype);
        double tol = o->dtype == LT_DTYPE_FP32 ? 1e-3 : o->dtype == LT_DTYPE_FP16 ? 1e-2 : 5e-2;
        printf("backward (%s): max |grad - reference| / max |reference|: dq %.3g, dk %.3g, dv %.3g (tolerance "
               "%.0e)\n", used, eq, ek, ev, tol);
        result = eq <= tol && ek <= tol && ev <= tol;
    }
    if (o->gpu)
        for (int i = 0; i < 5; i++) cu.mem_free((uint64_t)(uintptr_t)at[i]);
    free(dout), free(dq), free(dk), free(dv), free(doutf), free(delta), free(ref);
    return result;
}

int main(int argc, char **argv) {
    options o;
    if (parse(argc, argv, &o) != 0)
        return 2;
    if (o.gpu && cuda_open() != 0)
        return 2;
    int major, minor, patch;
    lt_version(&major, &minor, &patch);
    lt_status status = lt_init(NULL); /* starts the embedded Python; LAZYTRITON_* settings apply */
    if (status != LT_OK)
        return fail("lt_init", status);

    int64_t qn = o.batch * o.heads_q * o.seqlen_q * o.head_dim, kn = o.batch * o.heads_k * o.seqlen_k * o.head_dim;
    int64_t ln = o.batch * o.heads_q * o.seqlen_q;
    size_t item = item_size(o.dtype);
    void *q = malloc((size_t)qn * item), *k = malloc((size_t)kn * item), *v = malloc((size_t)kn * item);
    void *out = malloc((size_t)qn * item);
    float *lse = (float *)malloc(sizeof(float) * (size_t)ln);
    float *qf = malloc(sizeof(float) * (size_t)qn), *kf = malloc(sizeof(float) * (size_t)kn);
    float *vf = malloc(sizeof(float) * (size_t)kn);
    double *out_ref = malloc(sizeof(double) * (size_t)qn), *lse_ref = malloc(sizeof(double) * (size_t)ln);
    uint32_t seed = 12345;
#define RANDOM() ((seed = seed * 1664525u + 1013904223u), (float)(seed >> 8) / 16777216.0f * 2.0f - 1.0f)
    for (int64_t i = 0; i < qn; i++) qf[i] = store(q, i, RANDOM(), o.dtype);
    for (int64_t i = 0; i < kn; i++) kf[i] = store(k, i, RANDOM(), o.dtype);
    for (int64_t i = 0; i < kn; i++) vf[i] = store(v, i, RANDOM(), o.dtype);

    lt_device_type device = o.gpu ? LT_DEVICE_CUDA : LT_DEVICE_CPU;
    void *q_at = place(&o, q, (size_t)qn * item), *k_at = place(&o, k, (size_t)kn * item);
    void *v_at = place(&o, v, (size_t)kn * item), *out_at = place(&o, out, (size_t)qn * item);
    void *lse_at = place(&o, lse, sizeof(float) * (size_t)ln);
    int64_t qs[4] = {o.batch, o.heads_q, o.seqlen_q, o.head_dim}, ks[4] = {o.batch, o.heads_k, o.seqlen_k, o.head_dim};
    lt_attn_fwd_params params;
    lt_attn_fwd_params_init(&params); /* sm_scale NaN: 1/sqrt(head_dim) */
    lt_tensor_init(&params.q, q_at, o.dtype, 4, qs, device, 0);
    lt_tensor_init(&params.k, k_at, o.dtype, 4, ks, device, 0);
    lt_tensor_init(&params.v, v_at, o.dtype, 4, ks, device, 0);
    lt_tensor_init(&params.out, out_at, o.dtype, 4, qs, device, 0);
    lt_tensor_init(&params.lse, lse_at, LT_DTYPE_FP32, 3, qs, device, 0);
    params.causal = o.causal;
    const char *used;
    if ((status = run(&o, &params, &used)) != LT_OK)
        return fail(used, status);
    int planned = !strcmp(used, "lt_plan_launch");
    fetch(&o, out, out_at, (size_t)qn * item);
    fetch(&o, lse, lse_at, sizeof(float) * (size_t)ln);

    reference(&o, qf, kf, vf, out_ref, lse_ref);
    double out_err = 0.0, lse_err = 0.0;
    for (int64_t i = 0; i < qn; i++) out_err = fmax(out_err, fabs(load(out, i, o.dtype) - out_ref[i]));
    for (int64_t i = 0; i < ln; i++) {
        int both_inf = isinf(lse[i]) && isinf(lse_ref[i]) && lse[i] < 0 && lse_ref[i] < 0;
        lse_err = fmax(lse_err, both_inf ? 0.0 : fabs(lse[i] - lse_ref[i]));
    }
    double tol = o.dtype == LT_DTYPE_FP32 ? 2e-3 : o.dtype == LT_DTYPE_FP16 ? 4e-3 : 3e-2;
    static const char *dtypes[] = {"", "fp16", "bf16", "fp32"}, *causal[] = {"none", "top_left", "bottom_right"};
    lt_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats, stats.version = LT_STATS_VERSION;
    if ((status = lt_cache_stats(&stats)) != LT_OK)
        return fail("lt_cache_stats", status);
    printf("lazytriton %d.%d.%d: attention %s q (%lld, %lld, %lld, %lld) k (%lld, %lld, %lld, %lld) causal=%s on %s%s\n",
           major, minor, patch, dtypes[o.dtype], (long long)o.batch, (long long)o.heads_q, (long long)o.seqlen_q,
           (long long)o.head_dim, (long long)o.batch, (long long)o.heads_k, (long long)o.seqlen_k,
           (long long)o.head_dim, causal[o.causal], o.gpu ? "cuda:0" : "cpu (interpreter)",
           planned ? ", planned" : o.plan ? ", not planned (plans need a GPU): lt_attn_fwd" : "");
    printf("max |out - reference| = %.3g, max |lse - reference| = %.3g (tolerance %.0e)\n", out_err, lse_err, tol);
    printf("cache: %llu local entries, %llu compiles by this process, %llu plans\n",
           (unsigned long long)stats.local_entries, (unsigned long long)stats.process_compiles,
           (unsigned long long)stats.plans);
    int ok = out_err <= tol && lse_err <= tol;
    if (o.backward) {
        int grads_ok = backward(&o, &params, qf, kf, vf, out_ref, lse_ref);
        if (grads_ok == 2)
            return 2;
        ok = ok && grads_ok;
    }
    printf("%s\n", ok ? "OK" : "MISMATCH");
    if (o.gpu) {
        void *placed[] = {q_at, k_at, v_at, out_at, lse_at};
        for (int i = 0; i < 5; i++) cu.mem_free((uint64_t)(uintptr_t)placed[i]);
    }
    free(q), free(k), free(v), free(out), free(lse), free(qf), free(kf), free(vf), free(out_ref), free(lse_ref);
    return ok ? 0 : 1;
}
