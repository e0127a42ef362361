/*
 * liblazytriton.so: the C side of the C API (see lazytriton.h).
 *
 * Compiled by cffi's embedding mode (capi/build.py), after Python.h and
 * before the wrappers cffi generates for the lt__py_* functions, which run
 * Python code (capi/embedded.py) in the interpreter this library embeds.
 *
 * What runs here, without Python: argument checks (all of them, so a bad call
 * never reaches Python), the thread-local error message, the plans and their
 * launch through libcuda (dlopen'd: no CUDA headers or link-time dependency),
 * and the start of the embedded interpreter. The backward's own part (its
 * checks, plans and launch) is lt_bwd.c, included at the end.
 */
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lazytriton.h"

#ifndef LT__PYTHON_EXECUTABLE /* set by build.py: the interpreter the library was built with */
#define LT__PYTHON_EXECUTABLE ""
#endif
#ifndef LT__PYTHONPATH /* set by build.py: the build's PYTHONPATH, appended to the run's */
#define LT__PYTHONPATH ""
#endif
#ifndef LT__LIBPYTHON /* set by build.py: the soname of the libpython linked */
#define LT__LIBPYTHON ""
#endif

#define LT__INTERNAL __attribute__((visibility("hidden")))

/* ------------------------------------------------------------------------- */
/* The calling thread's last error.                                           */

static __thread char lt__error[2048];

LT__INTERNAL void lt__set_error(const char *message) {
    snprintf(lt__error, sizeof lt__error, "%s", message ? message : "");
}

__attribute__((format(printf, 2, 3))) static lt_status lt__fail(lt_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(lt__error, sizeof lt__error, format, args);
    va_end(args);
    return status;
}

LT_API const char *lt_last_error(void) { return lt__error; }

/* ------------------------------------------------------------------------- */
/* What C asks Python to plan, and what Python answers (also in build.py's cdef). */

/* A kernel's scratch memory (Triton's hidden global_scratch and profile_scratch parameters), from its entry. */
typedef struct {
    uint32_t num_ctas;      /* CTAs a program: a launch's scratch is size x grid x num_ctas */
    uint32_t size[2];       /* bytes a program: [0] global, [1] profile; 0: none (the parameter gets NULL) */
    uint32_t align[2];      /* their alignments: powers of two */
    uint8_t hidden[8];      /* hidden parameter h is scratch hidden[h] (0 global, 1 profile) */
} lt__scratch_need;

/* A second kernel of the same host ABI a plan may launch instead (the FP8 forward's Gluon kernel). */
typedef struct {
    uint64_t function;      /* CUfunction; 0: none */
    uint32_t block_threads, shared_bytes, block_m, block_n, n_hidden;
    lt__scratch_need scratch;
} lt__twin_answer;

/* The kernels C launches (lt__plan_request.kernel; embedded.py's KERNELS). */
enum { LT__KERNEL_FWD = 0, LT__KERNEL_BWD_DQ = 1, LT__KERNEL_BWD_DKDV = 2, LT__KERNEL_BWD_DSINKS = 3 };

typedef struct {
    int32_t device_index; /* in */
    int32_t capability;   /* in: compute capability, e.g. 90 */
    int32_t dtype;        /* in: lt_dtype; LT_DTYPE_FP8_E4M3 or _E5M2 with LT__KERNEL_FWD: flash_fwd_fp8 (2 floats) */
    int32_t head_dim;     /* in */
    int32_t causal;       /* in: 0 or 1 */
    int32_t aligned;      /* in: bit 0 ALIGN16; bit 1 SEQ16 (backward kernels only, lt_bwd.c) */
    int32_t index64;      /* in */
    int32_t kernel;       /* in: LT__KERNEL_* */
    int32_t varlen;       /* in: bit 0 packed sequences (VARLEN=true; the seqlens are then max_seqlen_q/max_seqlen_k),
                             bit 1 SEQUSED_Q, bit 2 SEQUSED_K (lt__varlen_bits) */
    int32_t head_dim_v;   /* in: v's head dim (out's, dout's, dv's); may differ from head_dim */
    int32_t window;       /* in: a sliding window (WINDOW=true) */
    int32_t softcap;      /* in: a softcap (SOFTCAP=true) */
    int32_t sinks;        /* in: attention sinks (SINKS=true; LT__KERNEL_FWD only: the backward's kernels read
                             them through the forward's lse) */
    int32_t chunk;        /* in: attention_chunk (CHUNK=true; every kernel here takes it) */
    int64_t seqlen_q;     /* in */
    int64_t seqlen_k;     /* in */
    uint64_t function;    /* out: CUfunction */
    uint32_t block_threads;
    uint32_t shared_bytes;
    uint32_t block_m;     /* the grid's tile along dim x: BLOCK_M (BLOCK_N for flash_bwd_dkdv) */
    uint32_t n_hidden;    /* hidden scratch pointers after the kernel's own parameters */
    char variant[512];    /* out: the variant, for messages */
    /* out, LT__KERNEL_FWD only (the backward's kernels take none: NULL is passed): Triton's scratch memory */
    lt__scratch_need scratch;
    /* out, the FP8 forward's: flash_fwd_fp8_gluon on sm_90 (twin.function 0: none), served instead of
       flash_fwd_fp8 for the calls that fit its tiles (lt__twin_fits); flash_fwd_fp8's host ABI */
    lt__twin_answer twin;
} lt__plan_request;

/* Defined by cffi after this file: each runs its Python twin in capi/embedded.py. */
static int lt__py_init(const lt_config *config);
static int lt__py_attn_fwd_cpu(const lt_attn_fwd_params *params);
static int lt__py_attn_bwd_cpu(const lt_attn_bwd_params *params);
static int lt__py_plan(lt__plan_request *request);
static int lt__py_prewarm(const char *const *specs, size_t n_specs, size_t *compiled, size_t *cached);
static int lt__py_cache_stats(lt_stats *stats);
static void lt__py_flush(void);

/* ------------------------------------------------------------------------- */
/* libcuda, through dlopen: the library builds and loads without CUDA.        */

typedef int lt__CUresult;
typedef int lt__CUdevice;
typedef void *lt__CUcontext;
typedef void *lt__CUfunction;

enum { LT__CC_MAJOR = 75, LT__CC_MINOR = 76 }; /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_* */

/* cuLaunchKernelEx's configuration: cuda.h's CUlaunchConfig and CUlaunchAttribute, as the Python launchers
   declare them (lazytriton/driver/cdefs.py's LAUNCH_CONFIG_CDEF; this file compiles without Python's help in
   liblazytriton_native.so). The one attribute used, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, is an
   int. */
typedef struct {
    int id;
    int pad;
    union { char bytes[64]; int programmatic; uint64_t align; } value;
} lt__CUlaunchAttribute;
typedef struct {
    unsigned int grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
    void *stream;
    lt__CUlaunchAttribute *attrs;
    unsigned int n_attrs;
} lt__CUlaunchConfig;
enum { LT__LAUNCH_ATTRIBUTE_PROGRAMMATIC = 6 };
/* The driver version from which a CUDA graph captures a programmatic launch (12.3); before it a programmatic
   dependent launches plainly (its wait then returns at once: the stream orders the two kernels). */
enum { LT__PROGRAMMATIC_DRIVER = 12030 };

static struct {
    lt__CUresult (*init)(unsigned int);
    lt__CUresult (*device_get)(lt__CUdevice *, int);
    lt__CUresult (*device_attribute)(int *, int, lt__CUdevice);
    lt__CUresult (*primary_ctx_retain)(lt__CUcontext *, lt__CUdevice);
    lt__CUresult (*ctx_get_current)(lt__CUcontext *);
    lt__CUresult (*ctx_push)(lt__CUcontext);
    lt__CUresult (*ctx_pop)(lt__CUcontext *);
    lt__CUresult (*error_string)(lt__CUresult, const char **);
    lt__CUresult (*launch)(lt__CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                           unsigned int, unsigned int, void *, void **, void **);
    /* optional (CUDA 11.2+; NULL without): a plan's scratch memory when the call gives no workspace */
    lt__CUresult (*mem_alloc_async)(uint64_t *, size_t, void *);
    lt__CUresult (*mem_free_async)(uint64_t, void *);
    /* optional (NULL without, or before LT__PROGRAMMATIC_DRIVER): a programmatic dependent's launch */
    lt__CUresult (*launch_ex)(const lt__CUlaunchConfig *, lt__CUfunction, void **, void **);
} lt__cu;
static pthread_once_t lt__cu_once = PTHREAD_ONCE_INIT;
static char lt__cu_error[512]; /* empty once libcuda is loaded */

static void lt__cu_load(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        snprintf(lt__cu_error, sizeof lt__cu_error, "cannot load the CUDA driver (libcuda.so.1): %s",
                 why ? why : "not found");
        return;
    }
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&lt__cu.init, "cuInit"},
        {(void **)&lt__cu.device_get, "cuDeviceGet"},
        {(void **)&lt__cu.device_attribute, "cuDeviceGetAttribute"},
        {(void **)&lt__cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&lt__cu.ctx_get_current, "cuCtxGetCurrent"},
        {(void **)&lt__cu.ctx_push, "cuCtxPushCurrent_v2"},
        {(void **)&lt__cu.ctx_pop, "cuCtxPopCurrent_v2"},
        {(void **)&lt__cu.error_string, "cuGetErrorString"},
        {(void **)&lt__cu.launch, "cuLaunchKernel"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        *symbols[i].slot = dlsym(lib, symbols[i].name);
        if (*symbols[i].slot == NULL) {
            snprintf(lt__cu_error, sizeof lt__cu_error, "libcuda.so.1 has no %s", symbols[i].name);
            return;
        }
    }
    *(void **)&lt__cu.mem_alloc_async = dlsym(lib, "cuMemAllocAsync");
    *(void **)&lt__cu.mem_free_async = dlsym(lib, "cuMemFreeAsync");
    lt__CUresult (*driver_version)(int *) = NULL;
    *(void **)&driver_version = dlsym(lib, "cuDriverGetVersion");
    int version = 0;
    if (driver_version != NULL && driver_version(&version) == 0 && version >= LT__PROGRAMMATIC_DRIVER)
        *(void **)&lt__cu.launch_ex = dlsym(lib, "cuLaunchKernelEx");
    lt__CUresult status = lt__cu.init(0);
    if (status != 0)
        snprintf(lt__cu_error, sizeof lt__cu_error, "cuInit failed: CUDA error %d (no usable GPU?)", status);
}

static lt_status lt__cuda_ready(void) {
    pthread_once(&lt__cu_once, lt__cu_load);
    if (lt__cu_error[0] != '\0')
        return lt__fail(LT_ERROR_NO_GPU, "%s", lt__cu_error);
    return LT_OK;
}

static lt_status lt__cuda_fail(lt__CUresult status, const char *call) {
    const char *text = NULL;
    if (lt__cu.error_string == NULL || lt__cu.error_string(status, &text) != 0 || text == NULL)
        text = "unknown error";
    return lt__fail(LT_ERROR_CUDA, "%s failed: CUDA error %d (%s)", call, status, text);
}

/* Device device_index's primary context (retained) and compute capability (e.g. 90). */
static lt_status lt__device_context(int32_t device_index, lt__CUcontext *context, int32_t *capability) {
    lt_status s;
    if ((s = lt__cuda_ready()) != LT_OK)
        return s;
    lt__CUdevice device;
    int major = 0, minor = 0;
    lt__CUresult r = lt__cu.device_get(&device, device_index);
    if (r != 0)
        return lt__fail(LT_ERROR_NO_GPU, "no CUDA device %d (cuDeviceGet: CUDA error %d)", device_index, r);
    if ((r = lt__cu.device_attribute(&major, LT__CC_MAJOR, device)) != 0 ||
        (r = lt__cu.device_attribute(&minor, LT__CC_MINOR, device)) != 0)
        return lt__cuda_fail(r, "cuDeviceGetAttribute");
    if ((r = lt__cu.primary_ctx_retain(context, device)) != 0)
        return lt__cuda_fail(r, "cuDevicePrimaryCtxRetain");
    *capability = major * 10 + minor;
    return LT_OK;
}

/* cuLaunchKernel in context (a function runs only in the context it was loaded in); dependent: as its stream
   predecessor's programmatic dependent (cuLaunchKernelEx with programmatic stream serialization, where the driver
   has it: the kernel's launch overlaps its predecessor's tail, and the kernel waits for its memory, gdc_wait,
   kernels/__init__.py's KernelSpec.dependent), else plainly. */
static lt_status lt__cu_launch_as(lt__CUfunction function, lt__CUcontext context, unsigned int grid_x,
                                  unsigned int grid_y, unsigned int grid_z, unsigned int threads, unsigned int shared,
                                  void *stream, void **params, int dependent) {
    lt__CUcontext current = NULL;
    lt__cu.ctx_get_current(&current);
    int pushed = current != context;
    lt__CUresult r;
    if (pushed && (r = lt__cu.ctx_push(context)) != 0)
        return lt__cuda_fail(r, "cuCtxPushCurrent");
    if (dependent && lt__cu.launch_ex != NULL) {
        lt__CUlaunchAttribute attribute;
        memset(&attribute, 0, sizeof attribute);
        attribute.id = LT__LAUNCH_ATTRIBUTE_PROGRAMMATIC, attribute.value.programmatic = 1;
        lt__CUlaunchConfig config = {grid_x, grid_y, grid_z, threads, 1, 1, shared, stream, &attribute, 1};
        r = lt__cu.launch_ex(&config, function, params, NULL);
    } else {
        r = lt__cu.launch(function, grid_x, grid_y, grid_z, threads, 1, 1, shared, stream, params, NULL);
    }
    if (pushed)
        lt__cu.ctx_pop(&current);
    if (r != 0)
        return lt__cuda_fail(r, dependent && lt__cu.launch_ex != NULL ? "cuLaunchKernelEx" : "cuLaunchKernel");
    return LT_OK;
}

static lt_status lt__cu_launch(lt__CUfunction function, lt__CUcontext context, unsigned int grid_x,
                               unsigned int grid_y, unsigned int grid_z, unsigned int threads, unsigned int shared,
                               void *stream, void **params) {
    return lt__cu_launch_as(function, context, grid_x, grid_y, grid_z, threads, shared, stream, params, 0);
}

#include "lt_check.c" /* lt__call, lt__check: every check of a call */
#include "lt_alias.c" /* lt__check_writes: what a call writes owns its memory */

/* ------------------------------------------------------------------------- */
/* Plans: a loaded kernel and what a launch needs, for one shape class.       */

#define LT__PLAN_MAGIC 0x6c74706cu /* "ltpl" */
#define LT__KERNEL_PARAMS 44       /* flash_fwd: 41 pointers and integers, then sm_scale, softcap, dropout_p */
#define LT__KERNEL_INTS 41
#define LT__FP8_KERNEL_PARAMS 43   /* flash_fwd_fp8: 41 pointers and integers, then sm_scale, softcap */
#define LT__FP8_KERNEL_INTS 41
#define LT__MAX_HIDDEN 8

typedef struct {
    int32_t kernel; /* LT__KERNEL_FWD, or LT__KERNEL_BWD_DQ for the backward's pair */
    /* varlen: lt__varlen_bits (packed sequences, and their used lengths) */
    int32_t device_index, dtype, head_dim, causal, aligned, index64, sq_bits, sk_bits, varlen, head_dim_v;
    int32_t window, softcap; /* the WINDOW and SOFTCAP variants */
    int32_t sinks;           /* the SINKS variant (a forward key's only) */
    int32_t chunk;           /* the CHUNK variant */
    int32_t dsinks;          /* a backward key's: the plan reduces the sinks' gradient (flash_bwd_dsinks) */
} lt__plan_key;

/* One kernel a plan launches: what cuLaunchKernel takes, the grid's x tile, the scratch it needs. */
typedef struct {
    lt__CUfunction function; /* NULL: none (a plan's twin) */
    uint32_t block_threads, shared_bytes, block_m, n_hidden;
    uint32_t block_n;        /* the twin's key tile: the seqlen_k it divides */
    int scratch;             /* some launch of it needs scratch memory */
    lt__scratch_need need;
} lt__kernel_plan;

struct lt_plan {
    uint32_t magic;
    lt__plan_key key;
    lt__CUcontext context;
    lt__kernel_plan kernel;  /* flash_fwd's variant, or flash_fwd_fp8's */
    lt__kernel_plan twin;    /* flash_fwd_fp8_gluon (function NULL: none), for the calls lt__twin_fits */
    char variant[512];
};

static int32_t lt__bits(int64_t n) { /* (n - 1).bit_length(): the seqlen bucket of flash.py's plan memo */
    int32_t bits = 0;
    for (uint64_t x = n > 0 ? (uint64_t)(n - 1) : 0; x; x >>= 1)
        bits++;
    return bits;
}

/* The seqlens dispatch buckets: a packed call's max_seqlen_q/max_seqlen_k, a dense call's own. */
static int64_t lt__dispatch_sq(const lt__call *c) { return c->varlen ? c->max_sq : c->sq; }
static int64_t lt__dispatch_sk(const lt__call *c) { return c->varlen ? c->max_sk : c->sk; }

/* Packed sequences (bit 0) and, with them, the used lengths (bit 1 SEQUSED_Q, bit 2 SEQUSED_K): a plan key's and
 * a plan request's varlen field. */
static int32_t lt__varlen_bits(const lt__call *c) {
    return c->varlen | (c->seqused_q != 0) << 1 | (c->seqused_k != 0) << 2;
}

static lt__plan_key lt__key_of(const lt__call *c) {
    lt__plan_key key = {LT__KERNEL_FWD, c->device_index, c->dtype, (int32_t)c->d, c->causal != LT_CAUSAL_NONE,
                        c->aligned, c->index64, lt__bits(lt__dispatch_sq(c)), lt__bits(lt__dispatch_sk(c)),
                        lt__varlen_bits(c), (int32_t)c->dv, c->window_left >= 0, c->softcap > 0.0f, c->sinks != 0,
                        c->attention_chunk > 0};
    return key;
}

static void lt__describe(char *buf, size_t size, const lt__plan_key *k) {
    snprintf(buf, size, "%s, head dim %d (v %d), cuda:%d, %s, %s pointers and strides%s, %d-bit indexing%s%s%s%s%s%s%s%s",
             lt__dtype_name(k->dtype), k->head_dim, k->head_dim_v, k->device_index,
             k->causal ? "causal" : "not causal", k->aligned ? "16-byte aligned" : "unaligned",
             k->aligned & 2 ? ", seqlens multiples of 16" : "", k->index64 ? 64 : 32,
             k->varlen ? ", packed sequences" : "", k->varlen & 2 ? ", seqused_q" : "",
             k->varlen & 4 ? ", seqused_k" : "", k->window ? ", sliding window" : "", k->softcap ? ", softcap" : "",
             k->sinks ? ", sinks" : "", k->chunk ? ", attention_chunk" : "", k->dsinks ? ", dsinks" : "");
}

/* Plans need device memory and work to do (what for depends on the caller: names the call to use instead). */
static lt_status lt__plannable(const lt__call *c, const char *instead) {
    if (c->device_type != LT_DEVICE_CUDA)
        return lt__fail(LT_ERROR_UNSUPPORTED, "plans need a GPU: q is in host memory (LT_DEVICE_CPU), which runs "
                        "through Triton's interpreter; call %s instead", instead);
    if (c->empty || c->sk == 0)
        return lt__fail(LT_ERROR_UNSUPPORTED, "plans need a call with work to do; got batch %lld, heads %lld, "
                        "seqlen_q %lld, seqlen_k %lld", (long long)c->b, (long long)c->hq, (long long)c->sq,
                        (long long)c->sk);
    return LT_OK;
}

#include "lt_scratch.c" /* a plan kernel's scratch memory and launch: lt__launch_kernel, lt__fwd_kernel */

/* Ask the planner (embedded.py) for one kernel (LT__KERNEL_*) of c's shape class on a device of capability. */
static lt_status lt__plan_kernel(const lt__call *c, int32_t kernel, int32_t capability, lt__plan_request *req) {
    lt_status s;
    memset(req, 0, sizeof *req);
    req->device_index = c->device_index, req->capability = capability, req->dtype = c->dtype;
    req->head_dim = (int32_t)c->d, req->causal = c->causal != LT_CAUSAL_NONE, req->aligned = c->aligned;
    req->index64 = c->index64, req->kernel = kernel, req->varlen = lt__varlen_bits(c), req->head_dim_v = (int32_t)c->dv;
    req->window = c->window_left >= 0, req->softcap = c->softcap > 0.0f;
    req->sinks = kernel == LT__KERNEL_FWD && c->sinks != 0;
    req->chunk = c->attention_chunk > 0 && kernel != LT__KERNEL_BWD_DSINKS; /* the reduction sees no scores */
    if (kernel == LT__KERNEL_BWD_DSINKS) /* it reads lse and delta alone: 64-bit offsets once they span 2**31 */
        req->index64 = (c->varlen ? c->hq * c->sq : c->b * c->hq * c->sq) > INT32_MAX;
    req->seqlen_q = lt__dispatch_sq(c), req->seqlen_k = lt__dispatch_sk(c);
    if ((s = (lt_status)lt__py_plan(req)) != LT_OK)
        return s;
    req->variant[sizeof req->variant - 1] = '\0';
    if (req->function == 0 || req->block_threads == 0 || req->block_m == 0 || req->n_hidden > LT__MAX_HIDDEN)
        return lt__fail(LT_ERROR_INTERNAL, "the planner answered function %llu, block %u, tile %u, %u hidden "
                        "parameters for %s", (unsigned long long)req->function, req->block_threads, req->block_m,
                        req->n_hidden, req->variant);
    if ((kernel != LT__KERNEL_FWD && (req->scratch.size[0] || req->scratch.size[1] || req->twin.function)) ||
        lt__bad_need(&req->scratch, req->n_hidden) ||
        (req->twin.function && (req->twin.block_threads == 0 || req->twin.block_m == 0 || req->twin.block_n == 0 ||
                                req->twin.n_hidden > LT__MAX_HIDDEN || lt__bad_need(&req->twin.scratch,
                                                                                  req->twin.n_hidden))))
        return lt__fail(LT_ERROR_INTERNAL, "the planner answered scratch memory (%u, %u bytes a program) or a twin "
                        "kernel that the C launcher of %s cannot pass", req->scratch.size[0], req->scratch.size[1],
                        req->variant);
    return LT_OK;
}

/* A plan kernel of one planner's answer. */
static lt__kernel_plan lt__kernel_plan_of(uint64_t function, uint32_t threads, uint32_t shared, uint32_t block_m,
                                          uint32_t block_n, uint32_t n_hidden, const lt__scratch_need *need) {
    lt__kernel_plan k = {(lt__CUfunction)(uintptr_t)function, threads, shared, block_m, n_hidden, block_n,
                         need->size[0] > 0 || need->size[1] > 0, *need}; /* its module is never unloaded */
    if (k.need.num_ctas == 0)
        k.need.num_ctas = 1;
    return k;
}

static lt_status lt__make_plan(const lt__call *c, lt_plan **out) {
    lt_status s;
    lt__CUcontext context;
    int32_t capability;
    lt__plan_request req;
    if ((s = lt__plannable(c, "lt_attn_fwd")) != LT_OK ||
        (s = lt__device_context(c->device_index, &context, &capability)) != LT_OK ||
        (s = lt__plan_kernel(c, LT__KERNEL_FWD, capability, &req)) != LT_OK)
        return s;
    lt_plan *plan = (lt_plan *)calloc(1, sizeof *plan);
    if (plan == NULL)
        return lt__fail(LT_ERROR_INTERNAL, "out of memory");
    plan->magic = LT__PLAN_MAGIC;
    plan->key = lt__key_of(c);
    plan->context = context;
    plan->kernel = lt__kernel_plan_of(req.function, req.block_threads, req.shared_bytes, req.block_m, 0, req.n_hidden,
                                      &req.scratch);
    const lt__twin_answer *w = &req.twin;
    if (w->function)
        plan->twin = lt__kernel_plan_of(w->function, w->block_threads, w->shared_bytes, w->block_m, w->block_n,
                                        w->n_hidden, &w->scratch);
    memcpy(plan->variant, req.variant, sizeof plan->variant);
    *out = plan;
    return LT_OK;
}

/* The call c against a plan's key (either direction's): LT_ERROR_PLAN_MISMATCH saying what both are. */
static lt_status lt__check_key(const lt__plan_key *k, const lt__call *c) {
    if (c->device_type != LT_DEVICE_CUDA || c->device_index != k->device_index || c->dtype != k->dtype ||
        c->d != k->head_dim || c->dv != k->head_dim_v || (c->causal != LT_CAUSAL_NONE) != k->causal ||
        (k->aligned & ~c->aligned) ||
        (c->index64 && !k->index64) || lt__varlen_bits(c) != k->varlen || (c->window_left >= 0) != k->window ||
        (c->softcap > 0.0f) != k->softcap || (k->kernel == LT__KERNEL_FWD && (c->sinks != 0) != k->sinks) ||
        (c->attention_chunk > 0) != k->chunk || (k->kernel == LT__KERNEL_BWD_DQ && (c->dsinks != 0) != k->dsinks)) {
        char want[256], got[256];
        lt__plan_key call_key = lt__key_of(c);
        lt__describe(want, sizeof want, k);
        lt__describe(got, sizeof got, &call_key);
        if (c->device_type != LT_DEVICE_CUDA)
            snprintf(got, sizeof got, "host memory (LT_DEVICE_CPU)");
        return lt__fail(LT_ERROR_PLAN_MISMATCH, "the plan is for %s; the call is %s", want, got);
    }
    if (c->empty || c->sk == 0)
        return lt__fail(LT_ERROR_UNSUPPORTED, "plans need a call with work to do; got batch %lld, heads %lld, "
                        "seqlen_q %lld, seqlen_k %lld", (long long)c->b, (long long)c->hq, (long long)c->sq,
                        (long long)c->sk);
    return LT_OK;
}

#define LT__DATA(t) ((int64_t)(uintptr_t)(t)->data)


/* The FP8 forward's launch: flash_fwd_fp8's parameters in its description's order (fp8.c_initializer), v as the
 * caller gives it (transposed), the descales' pointers and strides lt__check_fp8's (an absent one NULL, strides 0:
 * the kernel reads 1.0); grid as flash_fwd's. */
static lt_status lt__launch_fp8(const lt_plan *plan, const lt_attn_fwd_params *p, const lt__call *c, void *stream) {
    const lt_tensor *q = &p->q, *k = &p->k, *v = &p->v, *o = &p->out;
    int64_t ints[LT__FP8_KERNEL_INTS + LT__MAX_HIDDEN] = {
        LT__DATA(q), LT__DATA(k), LT__DATA(v), LT__DATA(o), LT__DATA(&p->lse), c->cu_seqlens_q, c->cu_seqlens_k,
        c->seqused_q, c->seqused_k, c->descale[0], c->descale[1], c->descale[2], q->strides[0], q->strides[1],
        q->strides[2], k->strides[0], k->strides[1], k->strides[2], v->strides[0], v->strides[1], v->strides[2],
        o->strides[0], o->strides[1], o->strides[2], c->hq * c->sq, c->sq, c->hq / c->hk, c->sq, c->sk, c->d, c->dv,
        c->offset, c->window_left, c->window_right, c->attention_chunk, c->descale_strides[0][0],
        c->descale_strides[0][1], c->descale_strides[1][0], c->descale_strides[1][1], c->descale_strides[2][0],
        c->descale_strides[2][1]};
    float floats[LT__FP8_KERNEL_PARAMS - LT__FP8_KERNEL_INTS] = {c->scale, c->softcap};
    void *params[LT__FP8_KERNEL_PARAMS + LT__MAX_HIDDEN];
    for (int i = 0; i < LT__FP8_KERNEL_INTS; i++)
        params[i] = &ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only */
    for (int i = LT__FP8_KERNEL_INTS; i < LT__FP8_KERNEL_PARAMS; i++)
        params[i] = &floats[i - LT__FP8_KERNEL_INTS];
    return lt__launch_kernel(plan, lt__fwd_kernel(plan, c), c, params, LT__FP8_KERNEL_PARAMS,
                             &ints[LT__FP8_KERNEL_INTS], stream);
}

/* The launch: flash_fwd's parameters in its description's order (binding.c_initializer); p is lt__fwd_prepare's
 * view (a packed call's tensors as one batch of total tokens), the grid's z the sequences of a packed call. An
 * e4m3 or e5m2 call's plan is flash_fwd_fp8's (its key's dtype): lt__launch_fp8. */
static lt_status lt__launch(const lt_plan *plan, const lt_attn_fwd_params *p, const lt__call *c, void *stream) {
    if (c->fp8)
        return lt__launch_fp8(plan, p, c, stream);
    const lt_tensor *q = &p->q, *k = &p->k, *v = &p->v, *o = &p->out;
    /* No ALiBi, bias or dropout (null pointers, zero strides, p = 0): the C API's calls have none of them. The
     * window and the chunk are lt__check's. */
    int64_t ints[LT__KERNEL_INTS + LT__MAX_HIDDEN] = {
        (int64_t)(uintptr_t)q->data, (int64_t)(uintptr_t)k->data, (int64_t)(uintptr_t)v->data,
        (int64_t)(uintptr_t)o->data, (int64_t)(uintptr_t)p->lse.data, c->cu_seqlens_q, c->cu_seqlens_k, 0, 0, 0,
        c->seqused_q, c->seqused_k, c->sinks,
        q->strides[0], q->strides[1], q->strides[2], k->strides[0], k->strides[1], k->strides[2],
        v->strides[0], v->strides[1], v->strides[2], o->strides[0], o->strides[1], o->strides[2],
        c->hq * c->sq, c->sq, c->hq / c->hk, c->sq, c->sk, c->d, c->dv, c->offset, c->window_left,
        c->window_right, c->attention_chunk, 0, 0, 0, 0, 0};
    float floats[LT__KERNEL_PARAMS - LT__KERNEL_INTS] = {c->scale, c->softcap, 0.0f};
    void *params[LT__KERNEL_PARAMS + LT__MAX_HIDDEN];
    for (int i = 0; i < LT__KERNEL_INTS; i++)
        params[i] = &ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only */
    for (int i = LT__KERNEL_INTS; i < LT__KERNEL_PARAMS; i++)
        params[i] = &floats[i - LT__KERNEL_INTS];
    return lt__launch_kernel(plan, &plan->kernel, c, params, LT__KERNEL_PARAMS, &ints[LT__KERNEL_INTS], stream);
}

/* lt_attn_fwd's and lt_attn_bwd's plans, one per shape class and seqlen bucket (as the bindings' memo).
 * Plans are never freed while the process runs (a few hundred bytes each), so a
 * pointer read from the table stays valid without a lock. */
#define LT__MEMO_SLOTS 256
static struct {
    lt__plan_key key;
    void *plan; /* an lt_plan, or an lt_bwd_plan for a backward key */
} lt__memo[LT__MEMO_SLOTS];
static int lt__memo_count;
static pthread_mutex_t lt__memo_lock = PTHREAD_MUTEX_INITIALIZER;

static void *lt__memo_find(const lt__plan_key *key) {
    void *found = NULL;
    pthread_mutex_lock(&lt__memo_lock);
    for (int i = 0; i < lt__memo_count && found == NULL; i++)
        if (memcmp(&lt__memo[i].key, key, sizeof *key) == 0)
            found = lt__memo[i].plan;
    pthread_mutex_unlock(&lt__memo_lock);
    return found;
}

/* Keep plan for key. Returns the plan kept (another thread's, if it got there
 * first), or NULL when the table is full and plan was not kept. */
static void *lt__memo_add(const lt__plan_key *key, void *plan) {
    void *kept = NULL;
    pthread_mutex_lock(&lt__memo_lock);
    for (int i = 0; i < lt__memo_count && kept == NULL; i++)
        if (memcmp(&lt__memo[i].key, key, sizeof *key) == 0)
            kept = lt__memo[i].plan;
    if (kept == NULL && lt__memo_count < LT__MEMO_SLOTS) {
        lt__memo[lt__memo_count].key = *key;
        lt__memo[lt__memo_count].plan = plan;
        lt__memo_count++;
        kept = plan;
    }
    pthread_mutex_unlock(&lt__memo_lock);
    return kept;
}

/* ------------------------------------------------------------------------- */
/* lt_init's state, and what it starts: the embedded interpreter (lt_python.c) */
/* in liblazytriton.so, the images in liblazytriton_native.so (lt_front.c).   */

static pthread_mutex_t lt__init_lock = PTHREAD_MUTEX_INITIALIZER;
static int lt__initialized;  /* lt_init succeeded (atomic) */

#ifndef LT__NATIVE_FRONT
#include "lt_python.c" /* lt__start_python: the embedded interpreter */
#else
static lt_status lt__start_python(void); /* lt_front.c's: nothing to start */
#endif

static lt_status lt__require_init(void) {
    if (!__atomic_load_n(&lt__initialized, __ATOMIC_ACQUIRE))
        return lt__fail(LT_ERROR_NOT_INITIALIZED, "lazytriton is not initialised: call lt_init() first (and check "
                        "that it returned LT_OK)");
    return LT_OK;
}

/* ------------------------------------------------------------------------- */
/* The API.                                                                   */

LT_API lt_status lt_version(int *major, int *minor, int *patch) {
    if (major == NULL || minor == NULL || patch == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_version: major, minor and patch must not be NULL");
    *major = LT_VERSION_MAJOR, *minor = LT_VERSION_MINOR, *patch = LT_VERSION_PATCH;
    return LT_OK;
}

LT_API lt_status lt_config_init(lt_config *config) {
    if (config == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_config_init: config is NULL");
    memset(config, 0, sizeof *config);
    config->struct_size = sizeof *config, config->version = LT_CONFIG_VERSION;
    return LT_OK;
}

LT_API lt_status lt_init(const lt_config *config) {
    if (config != NULL && (config->struct_size != sizeof(lt_config) || config->version != LT_CONFIG_VERSION))
        return lt__fail(LT_ERROR_VERSION, "config has struct_size %u and version %u; this lazytriton takes %zu and "
                        "%d (fill it with lt_config_init())", config->struct_size, config->version,
                        sizeof(lt_config), LT_CONFIG_VERSION);
    pthread_mutex_lock(&lt__init_lock);
    __atomic_store_n(&lt__initialized, 0, __ATOMIC_RELEASE);
    lt_status s = lt__start_python();
    if (s == LT_OK)
        s = (lt_status)lt__py_init(config);
    if (s == LT_OK) {
        /* Settings changed: plans made under the old ones are no longer looked up
         * (and, as all plans, never freed: a thread may still hold one). */
        pthread_mutex_lock(&lt__memo_lock);
        lt__memo_count = 0;
        pthread_mutex_unlock(&lt__memo_lock);
        __atomic_store_n(&lt__initialized, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&lt__init_lock);
    return s;
}

LT_API lt_status lt_attn_fwd_params_init(lt_attn_fwd_params *params) {
    if (params == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_attn_fwd_params_init: params is NULL");
    memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params, params->version = LT_ATTN_FWD_PARAMS_VERSION;
    params->causal = LT_CAUSAL_NONE;
    params->sm_scale = NAN;
    params->window_left = -1, params->window_right = -1; /* softcap 0: off */
    return LT_OK;
}

LT_API lt_status lt_tensor_init(lt_tensor *tensor, void *data, lt_dtype dtype, int32_t ndim, const int64_t *sizes,
                                lt_device_type device_type, int32_t device_index) {
    if (tensor == NULL || sizes == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_tensor_init: tensor and sizes must not be NULL");
    if (ndim < 1 || ndim > 4)
        return lt__fail(LT_ERROR_SHAPE, "lt_tensor_init: ndim is %d; expected 1..4", ndim);
    memset(tensor, 0, sizeof *tensor);
    tensor->data = data, tensor->dtype = dtype, tensor->ndim = ndim;
    tensor->device_type = device_type, tensor->device_index = device_index;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        tensor->sizes[i] = sizes[i];
        tensor->strides[i] = stride;
        stride *= sizes[i] > 0 ? sizes[i] : 1;
    }
    return LT_OK;
}

LT_API lt_status lt_attn_fwd(const lt_attn_fwd_params *user, void *stream) {
    lt__call c;
    lt_status s;
    lt__fwd_call f;
    if ((s = lt__require_init()) != LT_OK || (s = lt__fwd_prepare(user, &f)) != LT_OK ||
        (s = lt__check(f.view, &c)) != LT_OK || (s = lt__fwd_writes(f.view)) != LT_OK)
        return s;
    const lt_attn_fwd_params *params = f.view;
    if (c.empty)
        return LT_OK;
    if (c.device_type == LT_DEVICE_CPU) {
        if (c.sk == 0 && c.sinks == 0) { /* with sinks, lse is each head's sink: Python writes it */
            lt__fill_no_keys(params, &c);
            return LT_OK;
        }
        return (lt_status)lt__py_attn_fwd_cpu(f.norm); /* the caller's layout: Python checks and packs it again */
    }
    if (c.sk == 0)
        return lt__fail(LT_ERROR_UNSUPPORTED, "seqlen_k = 0 on a GPU is not supported by the C API (there is no "
                        "key to attend to; out would be 0 and lse -inf)");
    lt__plan_key key = lt__key_of(&c);
    lt_plan *plan = lt__memo_find(&key);
    if (plan != NULL)
        return lt__launch(plan, params, &c, stream);
    lt_plan *made = NULL;
    if ((s = lt__make_plan(&c, &made)) != LT_OK)
        return s;
    plan = lt__memo_add(&key, made);
    s = lt__launch(plan != NULL ? plan : made, params, &c, stream);
    if (plan != made)
        free(made); /* another thread's plan was kept, or the table is full */
    return s;
}

LT_API lt_status lt_attn_fwd_workspace_size(const lt_attn_fwd_params *user, size_t *bytes) {
    lt__call c;
    lt_status s;
    lt__fwd_call f;
    if (bytes == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_attn_fwd_workspace_size: bytes (the out pointer) is NULL");
    *bytes = 0;
    if ((s = lt__require_init()) != LT_OK || (s = lt__fwd_prepare(user, &f)) != LT_OK ||
        (s = lt__check(f.view, &c)) != LT_OK)
        return s;
    if (c.empty || c.sk == 0 || c.device_type != LT_DEVICE_CUDA)
        return LT_OK; /* nothing launched on a GPU */
    lt__plan_key key = lt__key_of(&c);
    lt_plan *plan = lt__memo_find(&key), *made = NULL;
    if (plan == NULL) {
        if ((s = lt__make_plan(&c, &made)) != LT_OK)
            return s;
        plan = lt__memo_add(&key, made);
    }
    s = lt__plan_need(plan != NULL ? plan : made, &c, bytes);
    if (plan != made)
        free(made);
    return s;
}

LT_API lt_status lt_attn_fwd_plan(const lt_attn_fwd_params *params, lt_plan **plan) {
    lt__call c;
    lt_status s;
    lt__fwd_call f;
    if (plan == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_attn_fwd_plan: plan (the out pointer) is NULL");
    *plan = NULL;
    if ((s = lt__require_init()) != LT_OK || (s = lt__fwd_prepare(params, &f)) != LT_OK ||
        (s = lt__check(f.view, &c)) != LT_OK)
        return s;
    return lt__make_plan(&c, plan);
}

LT_API lt_status lt_plan_launch(const lt_plan *plan, const lt_attn_fwd_params *user, void *stream) {
    lt__call c;
    lt_status s;
    lt__fwd_call f;
    if (plan == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_plan_launch: plan is NULL");
    if (plan->magic != LT__PLAN_MAGIC)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "lt_plan_launch: plan is not a live plan (destroyed, or not "
                        "made by lt_attn_fwd_plan)");
    if ((s = lt__fwd_prepare(user, &f)) != LT_OK || (s = lt__check(f.view, &c)) != LT_OK ||
        (s = lt__fwd_writes(f.view)) != LT_OK || (s = lt__check_key(&plan->key, &c)) != LT_OK)
        return s;
    return lt__launch(plan, f.view, &c, stream);
}

LT_API lt_status lt_plan_workspace_size(const lt_plan *plan, const lt_attn_fwd_params *user, size_t *bytes) {
    lt__call c;
    lt_status s;
    lt__fwd_call f;
    if (plan == NULL || bytes == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_plan_workspace_size: plan and bytes (the out pointer) must not be "
                        "NULL");
    *bytes = 0;
    if (plan->magic != LT__PLAN_MAGIC)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "lt_plan_workspace_size: plan is not a live plan (destroyed, or "
                        "not made by lt_attn_fwd_plan)");
    if ((s = lt__fwd_prepare(user, &f)) != LT_OK || (s = lt__check(f.view, &c)) != LT_OK ||
        (s = lt__check_key(&plan->key, &c)) != LT_OK)
        return s;
    return lt__plan_need(plan, &c, bytes);
}

LT_API lt_status lt_plan_destroy(lt_plan *plan) {
    if (plan == NULL)
        return LT_OK;
    if (plan->magic != LT__PLAN_MAGIC)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "lt_plan_destroy: plan is not a live plan (destroyed twice?)");
    plan->magic = 0;
    free(plan);
    return LT_OK;
}

LT_API lt_status lt_prewarm(const char *const *specs, size_t n_specs, size_t *compiled, size_t *cached) {
    size_t n_compiled = 0, n_cached = 0;
    lt_status s;
    if (specs == NULL && n_specs > 0)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_prewarm: specs is NULL but n_specs is %zu", n_specs);
    for (size_t i = 0; i < n_specs; i++)
        if (specs[i] == NULL)
            return lt__fail(LT_ERROR_NULL_POINTER, "lt_prewarm: specs[%zu] is NULL", i);
    if ((s = lt__require_init()) != LT_OK)
        return s;
    s = (lt_status)lt__py_prewarm(specs, n_specs, &n_compiled, &n_cached);
    if (compiled != NULL)
        *compiled = n_compiled;
    if (cached != NULL)
        *cached = n_cached;
    return s;
}

LT_API lt_status lt_cache_stats(lt_stats *stats) {
    lt_status s;
    if (stats == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_cache_stats: stats is NULL");
    if (stats->struct_size != sizeof(lt_stats) || stats->version != LT_STATS_VERSION)
        return lt__fail(LT_ERROR_VERSION, "stats has struct_size %u and version %u; this lazytriton takes %zu and "
                        "%d", stats->struct_size, stats->version, sizeof(lt_stats), LT_STATS_VERSION);
    if ((s = lt__require_init()) != LT_OK)
        return s;
    if ((s = (lt_status)lt__py_cache_stats(stats)) != LT_OK)
        return s;
    pthread_mutex_lock(&lt__memo_lock);
    stats->plans = (uint64_t)lt__memo_count;
    pthread_mutex_unlock(&lt__memo_lock);
    return LT_OK;
}

#include "lt_bwd.c" /* the backward: its checks, plans, launch and API */
#include "lt_kvcache.c" /* decoding over a KV cache: its checks, plans, launch and API */
#include "lt_combine.c" /* lt_flash_combine: its checks, plan, launch and API */

#ifndef LT__NATIVE_FRONT
/* What liblazytriton_native.so calls, through dlsym, for a kernel its images do not hold (its JIT fallback):
 * this library's planner of one kernel, after lt_init. Not part of lazytriton.h: the request structs are
 * the two libraries' shared private interface, compiled from this same file. */
__attribute__((visibility("default"))) int lt__embedded_plan(lt__plan_request *request) {
    lt_status s = lt__require_init();
    return s != LT_OK ? s : lt__py_plan(request);
}

__attribute__((visibility("default"))) int lt__embedded_kvcache_plan(lt__kvcache_plan_request *request) {
    lt_status s = lt__require_init();
    return s != LT_OK ? s : lt__py_kvcache_plan(request);
}

__attribute__((visibility("default"))) int lt__embedded_combine_plan(lt__combine_plan_request *request) {
    lt_status s = lt__require_init();
    return s != LT_OK ? s : lt__py_combine_plan(request);
}
#endif
