/*
 * lt_front.c: lazytriton.h's API in liblazytriton_native.so, with no Python.
 *
 * The C half of liblazytriton.so (lazytriton.c: every check, the plans, the
 * launches) compiled with LT__NATIVE_FRONT, and here the functions that the
 * embedded build has Python answer:
 *
 *   - a plan of flash_fwd, flash_bwd_dq or flash_bwd_dkdv, of lt_attn_kvcache
 *     (kv_append, flash_decode_split, flash_decode_combine) or of
 *     lt_flash_combine: the variants and keys computed in C
 *     (native/lt_choice.c, native/lt_decode_choice.c), the entries read from
 *     the images lt_init opened (native/lt_runtime.c) and loaded through
 *     libcuda, the split heuristic's inputs read from the device;
 *   - what the images cannot serve (a miss, host memory, lt_prewarm):
 *     liblazytriton.so, opened with dlopen on the first such call
 *     when the JIT fallback is allowed, does it (its lt__embedded_plan, or the
 *     same public function); else LT_MISS or LT_ERROR_UNSUPPORTED naming what
 *     to do.
 *
 * The fallback is allowed by lt_config.jit = LT_JIT_ON, or with
 * LT_JIT_DEFAULT by LAZYTRITON_JIT=1 (unset: off; a native deployment has no
 * Python to fall back to). The embedded library is LAZYTRITON_CAPI_EMBEDDED,
 * else liblazytriton.so beside this library.
 */
#define _GNU_SOURCE
#define LT__NATIVE_FRONT 1
#include "lazytriton.c"

#include <strings.h>

#include "lazytriton_native.h"
#include "native/lt_native.h"

void ltn_note_error(const char *message) { lt__set_error(message); }

static lt_status lt__start_python(void) { return LT_OK; }

/* ---- the embedded library, for the fallback ---------------------------------------------------------------- */

static struct {
    int allowed;         /* the JIT fallback may be used (lt_init's setting) */
    int has_config;      /* lt_init was given a config (copied below, its strings too) */
    lt_config config;
    char strings[3][4096];
} lt__fallback;

static struct {
    void *handle;
    lt_status (*init)(const lt_config *);
    const char *(*last_error)(void);
    int (*plan)(lt__plan_request *);
    int (*kvcache_plan)(lt__kvcache_plan_request *);
    int (*combine_plan)(lt__combine_plan_request *);
    lt_status (*attn_fwd)(const lt_attn_fwd_params *, void *);
    lt_status (*attn_bwd)(const lt_attn_bwd_params *, void *);
    lt_status (*attn_kvcache)(const lt_attn_kvcache_params *, void *);
    lt_status (*flash_combine)(const lt_flash_combine_params *, void *);
    lt_status (*prewarm)(const char *const *, size_t, size_t *, size_t *);
    lt_status (*cache_stats)(lt_stats *);
} lt__embedded;
static pthread_mutex_t lt__embedded_lock = PTHREAD_MUTEX_INITIALIZER;

/* The embedded library's path: LAZYTRITON_CAPI_EMBEDDED, else liblazytriton.so in this library's folder. */
static void lt__embedded_path(char *out, size_t size) {
    const char *env = getenv("LAZYTRITON_CAPI_EMBEDDED");
    Dl_info info;
    if (env != NULL && env[0] != '\0') {
        snprintf(out, size, "%s", env);
    } else if (dladdr((void *)lt__embedded_path, &info) != 0 && info.dli_fname != NULL &&
               strrchr(info.dli_fname, '/') != NULL) {
        int folder = (int)(strrchr(info.dli_fname, '/') - info.dli_fname);
        snprintf(out, size, "%.*s/liblazytriton.so", folder, info.dli_fname);
    } else {
        snprintf(out, size, "liblazytriton.so");
    }
}

/* Opens and initialises liblazytriton.so once: LT_OK, or its failure (say why and how to allow or avoid it). */
static lt_status lt__embedded_ready(const char *what) {
    if (!lt__fallback.allowed)
        return LT_MISS;
    lt_status s = LT_OK;
    pthread_mutex_lock(&lt__embedded_lock);
    if (lt__embedded.handle == NULL) {
        char path[4096];
        lt__embedded_path(path, sizeof path);
        void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (handle == NULL) {
            const char *why = dlerror();
            s = lt__fail(LT_ERROR_PYTHON, "%s needs the JIT fallback, liblazytriton.so, which cannot be loaded "
                         "(%s): build it with `lazytriton capi build`, or set LAZYTRITON_CAPI_EMBEDDED to it",
                         what, why ? why : path);
        } else {
            struct { void **slot; const char *name; } symbols[] = {
                {(void **)&lt__embedded.init, "lt_init"}, {(void **)&lt__embedded.last_error, "lt_last_error"},
                {(void **)&lt__embedded.plan, "lt__embedded_plan"},
                {(void **)&lt__embedded.kvcache_plan, "lt__embedded_kvcache_plan"},
                {(void **)&lt__embedded.combine_plan, "lt__embedded_combine_plan"},
                {(void **)&lt__embedded.attn_fwd, "lt_attn_fwd"}, {(void **)&lt__embedded.attn_bwd, "lt_attn_bwd"},
                {(void **)&lt__embedded.attn_kvcache, "lt_attn_kvcache"},
                {(void **)&lt__embedded.flash_combine, "lt_flash_combine"},
                {(void **)&lt__embedded.prewarm, "lt_prewarm"}, {(void **)&lt__embedded.cache_stats, "lt_cache_stats"},
            };
            for (size_t i = 0; i < sizeof symbols / sizeof symbols[0] && s == LT_OK; i++)
                if ((*symbols[i].slot = dlsym(handle, symbols[i].name)) == NULL)
                    s = lt__fail(LT_ERROR_PYTHON, "%s has no %s: not the liblazytriton.so of this lazytriton",
                                 path, symbols[i].name);
            if (s == LT_OK && (s = lt__embedded.init(lt__fallback.has_config ? &lt__fallback.config : NULL)) != LT_OK)
                lt__set_error(lt__embedded.last_error());
            if (s == LT_OK)
                lt__embedded.handle = handle;
            else
                dlclose(handle);
        }
    }
    pthread_mutex_unlock(&lt__embedded_lock);
    return s;
}

/* A status of the embedded library's, with its message as this thread's. */
static lt_status lt__embedded_result(lt_status s) {
    if (s != LT_OK)
        lt__set_error(lt__embedded.last_error());
    return s;
}

static const char *lt__copy(int i, const char *text) {
    if (text == NULL)
        return NULL;
    snprintf(lt__fallback.strings[i], sizeof lt__fallback.strings[i], "%s", text);
    return lt__fallback.strings[i];
}

static int lt__env_on(const char *name) {
    const char *v = getenv(name);
    return v != NULL && (strcmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0 ||
                         strcasecmp(v, "on") == 0);
}

/* ---- what liblazytriton.so's Python answers, answered here ------------------------------------------------- */

static int lt__py_init(const lt_config *config) {
    const char *images = config != NULL && config->images != NULL ? config->images : getenv("LAZYTRITON_IMAGES");
    int32_t jit = config != NULL ? config->jit : LT_JIT_DEFAULT;
    if (jit < LT_JIT_DEFAULT || jit > LT_JIT_OFF)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "config.jit is %d; expected LT_JIT_DEFAULT (0), LT_JIT_ON (1) "
                        "or LT_JIT_OFF (2)", jit);
    int status = lt_open_images(images != NULL ? images : "");
    if (status != LT_OK)
        return status; /* its message is this thread's (ltn_note_error) */
    lt__fallback.allowed = jit == LT_JIT_ON || (jit == LT_JIT_DEFAULT && lt__env_on("LAZYTRITON_JIT"));
    lt__fallback.has_config = config != NULL;
    if (config != NULL) {
        lt__fallback.config = *config;
        lt__fallback.config.cache_dir = lt__copy(0, config->cache_dir);
        lt__fallback.config.images = lt__copy(1, config->images);
        lt__fallback.config.shared_tier = lt__copy(2, config->shared_tier);
    }
    return LT_OK;
}

enum { LT__MULTIPROCESSOR_COUNT = 16 }; /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */
enum { LT__SHARED_PER_MULTIPROCESSOR = 81 }; /* CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */

static const int32_t lt__front_ints[] = {LT__KERNEL_INTS, LT__BWD_DQ_PARAMS - LT__BWD_FLOATS,
                                         LT__BWD_DKDV_PARAMS - LT__BWD_FLOATS, LT__BWD_DSINKS_PARAMS};

typedef struct {
    uint64_t function;
    uint32_t threads, shared, hidden, block_m, block_n, block_d;
    int32_t dependent;     /* launched as its stream predecessor's programmatic dependent (ltn_dependent_launch) */
    ltn_scratch_need need; /* a forward plan's kernels' (the others take no scratch memory) */
    char variant[512];
} lt__native_kernel;

/* lt__scratch_need and ltn_scratch_need are one layout (lazytriton.c's and lt_native.h's). */
_Static_assert(sizeof(lt__scratch_need) == sizeof(ltn_scratch_need), "lt__scratch_need is ltn_scratch_need");

/* The attention kernel of variant (its key) from the images, loaded on device_index and held to the C launcher's
   n_ints pointers or integers then n_floats fp32, its scratch memory passed where scratch is set: LT_OK (*out
   filled, but its variant), LT_MISS (logged), or another failure. */
static int lt__native_attn_load(const ltn_variant *variant, const char *key, int32_t device_index, int scratch,
                                uint32_t n_ints, uint32_t n_floats, lt__native_kernel *out) {
    char text[512];
    memset(out, 0, sizeof *out);
    if (ltn_variant_string(variant, text, sizeof text) != 0)
        return lt__fail(LT_ERROR_INTERNAL, "a variant of kernel %s has no string", variant->kernel);
    lt_kernel *kernel = NULL;
    int status = lt_kernel_load(key, text, device_index, &kernel);
    if (status != LT_OK)
        return status;
    void *function = NULL, *context = NULL;
    lt_kernel_info info = {sizeof info, LT_KERNEL_INFO_VERSION, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0,
                           NULL, NULL, 0, 0, 0, 0, 0, 0};
    status = ltn_kernel_layout(kernel, n_ints, n_floats, &function, &context, &out->hidden,
                               scratch ? &out->need : NULL);
    if (status == LT_OK)
        status = lt_kernel_get_info(kernel, &info);
    if (status == LT_OK) {
        out->function = (uint64_t)(uintptr_t)function; /* its module stays loaded, as the embedded planner's */
        out->threads = info.block_threads, out->shared = info.shared_bytes;
        out->block_m = (uint32_t)ltn_variant_get(variant, "BLOCK_M", 0);
        out->block_n = (uint32_t)ltn_variant_get(variant, "BLOCK_N", 0);
    }
    lt_kernel_destroy(kernel);
    return status;
}

/* The kernel of request from the images: LT_OK (request filled), LT_MISS, or another failure. */
static int lt__native_plan(lt__plan_request *request) {
    ltn_attn_request r = {
        .kernel = request->kernel, .capability = request->capability, .dtype = request->dtype,
        .head_dim = request->head_dim, .head_dim_v = request->head_dim_v, .causal = request->causal,
        .aligned = request->aligned & 1, .seq16 = (request->aligned & 2) != 0, .index64 = request->index64,
        .window = request->window, .softcap = request->softcap, .varlen = request->varlen & 1,
        .seqused_q = (request->varlen & 2) != 0, .seqused_k = (request->varlen & 4) != 0,
        .seqlen_q = request->seqlen_q, .seqlen_k = request->seqlen_k, .sinks = request->sinks,
        .chunk = request->chunk};
    ltn_variant variant;
    ltn_error err;
    char key[33];
    int dsinks = request->kernel == LT__KERNEL_BWD_DSINKS; /* the sinks' gradient: its own small choice */
    if ((dsinks ? ltn_dsinks_variant(r.capability, r.varlen, r.seqused_q, r.index64, &variant, &err)
                : ltn_attn_variant(&r, &variant, &err)) != LTN_OK)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s", err.message);
    if (ltn_variant_string(&variant, request->variant, sizeof request->variant) != 0 ||
        ltn_variant_key(&variant, key) != 0)
        return lt__fail(LT_ERROR_INTERNAL, "the variant of kernel %d has no string or key", request->kernel);
    int fp8 = r.kernel == LTN_KERNEL_FWD && (r.dtype == LT_DTYPE_FP8_E4M3 || r.dtype == LT_DTYPE_FP8_E5M2);
    lt__native_kernel main;
    int status = lt__native_attn_load(&variant, key, request->device_index, r.kernel == LTN_KERNEL_FWD,
                                      fp8 ? LT__FP8_KERNEL_INTS : (uint32_t)lt__front_ints[r.kernel],
                                      dsinks ? 0 : fp8 ? LT__FP8_KERNEL_PARAMS - LT__FP8_KERNEL_INTS : LT__BWD_FLOATS,
                                      &main);
    if (status != LT_OK)
        return status;
    request->function = main.function, request->block_threads = main.threads, request->shared_bytes = main.shared;
    request->block_m = r.kernel == LTN_KERNEL_BWD_DKDV ? main.block_n : main.block_m;
    request->n_hidden = main.hidden; /* the backward's get NULL: ltn_kernel_layout refuses them scratch */
    memcpy(&request->scratch, &main.need, sizeof request->scratch);
    if (!fp8 || (status = ltn_fp8_gluon_variant(&r, &variant, &err)) == LTN_ABSENT)
        return LT_OK;
    if (status != LTN_OK)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s", err.message);
    char twin_variant[512];
    if (ltn_variant_string(&variant, twin_variant, sizeof twin_variant) != 0 || ltn_variant_key(&variant, key) != 0)
        return lt__fail(LT_ERROR_INTERNAL, "the FP8 forward's Gluon variant has no string or key");
    lt__native_kernel twin; /* flash_fwd_fp8's host ABI */
    if ((status = lt__native_attn_load(&variant, key, request->device_index, 1, LT__FP8_KERNEL_INTS,
                                       LT__FP8_KERNEL_PARAMS - LT__FP8_KERNEL_INTS, &twin)) != LT_OK)
        return status;
    request->twin.function = twin.function, request->twin.block_threads = twin.threads;
    request->twin.shared_bytes = twin.shared, request->twin.block_m = twin.block_m;
    request->twin.block_n = twin.block_n, request->twin.n_hidden = twin.hidden;
    memcpy(&request->twin.scratch, &twin.need, sizeof request->twin.scratch);
    return LT_OK;
}

/* After a native plan's LT_MISS (its message this thread's): LT_OK when the JIT fallback is ready to plan the
   call instead; else LT_MISS, its message saying how to allow the fallback, or the fallback's failure to load. */
static int lt__fallback_for_miss(const char *what) {
    char miss[2048];
    snprintf(miss, sizeof miss, "%s", lt_last_error());
    lt_status s = lt__embedded_ready(what);
    if (s == LT_MISS)
        return lt__fail(LT_MISS, "%s (the JIT fallback is off: LAZYTRITON_JIT=1 or lt_config.jit = LT_JIT_ON "
                        "allows it)", miss);
    return s;
}

static int lt__py_plan(lt__plan_request *request) {
    int s = lt__native_plan(request);
    if (s == LT_MISS && (s = lt__fallback_for_miss(request->variant)) == LT_OK)
        return lt__embedded_result((lt_status)lt__embedded.plan(request));
    return s;
}

/* ---- decoding and lt_flash_combine: their variants chosen in C (native/lt_decode_choice.c) ------------------ */


/* The kernel of r from the images, loaded on device_index and held to the C launcher's n_ints pointers or
   integers then n_floats fp32: LT_OK (*out filled), LT_MISS (logged), or another failure. */
static int lt__native_load(const ltn_decode_request *r, int32_t device_index, uint32_t n_ints, uint32_t n_floats,
                           lt__native_kernel *out) {
    ltn_variant variant;
    ltn_error err;
    char key[33];
    memset(out, 0, sizeof *out);
    if (ltn_decode_variant(r, &variant, &err) != LTN_OK)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s", err.message);
    if (ltn_variant_string(&variant, out->variant, sizeof out->variant) != 0 || ltn_variant_key(&variant, key) != 0)
        return lt__fail(LT_ERROR_INTERNAL, "the variant of kernel %d has no string or key", r->kernel);
    lt_kernel *kernel = NULL;
    int status = lt_kernel_load(key, out->variant, device_index, &kernel);
    if (status != LT_OK)
        return status;
    void *function = NULL, *context = NULL;
    lt_kernel_info info = {sizeof info, LT_KERNEL_INFO_VERSION, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0,
                           NULL, NULL, 0, 0, 0, 0, 0, 0};
    status = ltn_kernel_layout(kernel, n_ints, n_floats, &function, &context, &out->hidden, NULL);
    if (status == LT_OK)
        status = lt_kernel_get_info(kernel, &info);
    if (status == LT_OK) {
        out->function = (uint64_t)(uintptr_t)function; /* its module stays loaded, as the embedded planner's */
        out->threads = info.block_threads, out->shared = info.shared_bytes;
        out->block_m = (uint32_t)ltn_variant_get(&variant, "BLOCK_M", ltn_variant_get(&variant, "BLOCK", 0));
        out->block_n = (uint32_t)ltn_variant_get(&variant, "BLOCK_N", 0);
        out->block_d = (uint32_t)ltn_variant_get(&variant, "BLOCK_D", 0);
        out->dependent = ltn_dependent_launch(&variant, r->capability);
    }
    lt_kernel_destroy(kernel);
    return status;
}

/* Every kernel of a call is looked up, so that one miss log names all a call lacks: the first failure is kept
   (its message this thread's), a later one only counted. */
static int lt__native_first(int status, int next, char *message, size_t size, int *more) {
    if (next == LT_OK)
        return status;
    if (status != LT_OK) {
        (*more)++;
        return status;
    }
    snprintf(message, size, "%s", lt_last_error());
    return next;
}

static int lt__native_result(int status, const char *message, int more) {
    if (status == LT_OK)
        return LT_OK;
    if (more > 0)
        return lt__fail(status, "%s (and %d more of this call's kernels, also logged)", message, more);
    return lt__fail(status, "%s", message);
}

/* The SMs of the device and the shared memory of one (0 where the driver does not say), for the split
   heuristic's slots (binding.gpu_slots). */
static lt_status lt__sm_count(int32_t device_index, int64_t *sms, int64_t *sm_shared) {
    lt__CUdevice device;
    int count = 0, shared = 0;
    lt__CUresult r;
    if ((r = lt__cu.device_get(&device, device_index)) != 0)
        return lt__fail(LT_ERROR_NO_GPU, "no CUDA device %d (cuDeviceGet: CUDA error %d)", device_index, r);
    if ((r = lt__cu.device_attribute(&count, LT__MULTIPROCESSOR_COUNT, device)) != 0)
        return lt__cuda_fail(r, "cuDeviceGetAttribute");
    if (count < 1)
        return lt__fail(LT_ERROR_CUDA, "device %d reports %d SMs", device_index, count);
    if (lt__cu.device_attribute(&shared, LT__SHARED_PER_MULTIPROCESSOR, device) != 0 || shared < 0)
        shared = 0;
    *sms = count, *sm_shared = shared;
    return LT_OK;
}

/* lt_attn_kvcache's plan from the images: kv_append (with new keys), the split and the combine kernel. */
static int lt__native_kvcache_plan(lt__kvcache_plan_request *q) {
    lt__CUcontext context;
    int32_t capability;
    int64_t sms = 0, sm_shared = 0;
    lt_status s;
    if ((s = lt__device_context(q->device_index, &context, &capability)) != LT_OK ||
        (s = lt__sm_count(q->device_index, &sms, &sm_shared)) != LT_OK)
        return s;
    ltn_decode_request r = {
        .kernel = LTN_KERNEL_DECODE_SPLIT, .capability = capability, .dtype = q->dtype, .head_dim = q->head_dim,
        .head_dim_v = q->head_dim_v, .causal = q->causal, .aligned = q->aligned, .index64 = q->index64,
        .rows = q->rows, .capacity = q->capacity, .page_size = q->page_size, .paged = q->paged, .window = q->window,
        .softcap = q->softcap, .alibi = q->alibi, .leftpad = q->leftpad, .rotary = q->rotary,
        .rotary_interleaved = q->rotary_interleaved, .sinks = q->sinks, .varlen_q = q->varlen_q, .chunk = q->chunk,
        .kv_fp8 = q->kv_fp8, .qv = q->qv, .kv_pairs = q->kv_pairs};
    lt__native_kernel split, combine, append, lengths;
    char message[2048] = "";
    int more = 0, status = LT_OK;
    if (q->append) {
        ltn_decode_request a = r;
        a.kernel = LTN_KERNEL_KV_APPEND, a.aligned = q->append_aligned, a.index64 = q->append_index64;
        a.varlen_new = q->varlen_new;
        status = lt__native_first(status, lt__native_load(&a, q->device_index, LT__APPEND_PARAMS, 0, &append),
                                  message, sizeof message, &more);
    }
    if (q->varlen_new) { /* packed new keys: kv_append_lengths, the split kernel's lengths after the append */
        ltn_decode_request l = r;
        l.kernel = LTN_KERNEL_KV_APPEND_LENGTHS;
        status = lt__native_first(status, lt__native_load(&l, q->device_index, LT__LENGTHS_PARAMS, 0, &lengths),
                                  message, sizeof message, &more);
    }
    status = lt__native_first(status, lt__native_load(&r, q->device_index, LT__DECODE_SPLIT_PARAMS -
                                                       LT__DECODE_SPLIT_FLOATS, LT__DECODE_SPLIT_FLOATS, &split),
                              message, sizeof message, &more);
    r.kernel = LTN_KERNEL_DECODE_COMBINE;
    status = lt__native_first(status, lt__native_load(&r, q->device_index, LT__DECODE_COMBINE_PARAMS, 0, &combine),
                              message, sizeof message, &more);
    if (status != LT_OK)
        return lt__native_result(status, message, more);
    if (q->append) {
        q->append_function = append.function, q->append_threads = append.threads;
        q->append_shared = append.shared, q->append_block_m = append.block_m, q->append_hidden = append.hidden;
    }
    if (q->varlen_new) {
        q->lengths_function = lengths.function, q->lengths_threads = lengths.threads;
        q->lengths_shared = lengths.shared, q->lengths_hidden = lengths.hidden;
        q->lengths_block = lengths.block_m; /* its BLOCK */
    }
    q->split_function = split.function, q->split_threads = split.threads, q->split_shared = split.shared;
    q->split_block_m = split.block_m, q->split_block_n = split.block_n, q->split_hidden = split.hidden;
    q->combine_function = combine.function, q->combine_threads = combine.threads;
    q->combine_shared = combine.shared, q->combine_block_m = combine.block_m, q->combine_hidden = combine.hidden;
    q->combine_dependent = combine.dependent, q->split_dependent = split.dependent;
    q->slots = sms * ltn_decode_programs_per_sm(split.shared, sm_shared), q->min_keys = ltn_decode_min_split_keys(q->head_dim);
    snprintf(q->variant, sizeof q->variant, "%s", split.variant);
    return LT_OK;
}

/* lt_flash_combine's plan from the images. */
static int lt__native_combine_plan(lt__combine_plan_request *q) {
    lt__CUcontext context;
    int32_t capability;
    lt_status s;
    if ((s = lt__device_context(q->device_index, &context, &capability)) != LT_OK)
        return s;
    ltn_decode_request r = {.kernel = LTN_KERNEL_FLASH_COMBINE, .capability = capability, .dtype = q->dtype,
                            .head_dim = q->head_dim, .aligned = q->aligned, .index64 = q->index64};
    lt__native_kernel k;
    int status = lt__native_load(&r, q->device_index, LT__COMBINE_PARAMS, 0, &k);
    if (status != LT_OK)
        return status;
    q->function = k.function, q->block_threads = k.threads, q->shared_bytes = k.shared;
    q->block_m = k.block_m, q->block_d = k.block_d, q->n_hidden = k.hidden;
    snprintf(q->variant, sizeof q->variant, "%s", k.variant);
    return LT_OK;
}

static int lt__py_kvcache_plan(lt__kvcache_plan_request *request) {
    int s = lt__native_kvcache_plan(request);
    if (s == LT_MISS && (s = lt__fallback_for_miss("decoding (lt_attn_kvcache)")) == LT_OK)
        return lt__embedded_result((lt_status)lt__embedded.kvcache_plan(request));
    return s;
}

static int lt__py_combine_plan(lt__combine_plan_request *request) {
    int s = lt__native_combine_plan(request);
    if (s == LT_MISS && (s = lt__fallback_for_miss("lt_flash_combine")) == LT_OK)
        return lt__embedded_result((lt_status)lt__embedded.combine_plan(request));
    return s;
}

/* Host memory runs through Triton's interpreter, in the embedded Python. */
static lt_status lt__host_call(const char *what) {
    lt_status s = lt__embedded_ready(what);
    if (s == LT_MISS)
        return lt__fail(LT_ERROR_UNSUPPORTED, "%s with host memory (LT_DEVICE_CPU) runs through Triton's "
                        "interpreter, in the embedded Python: allow the JIT fallback (LAZYTRITON_JIT=1 or "
                        "lt_config.jit = LT_JIT_ON) or pass device memory", what);
    return s;
}

static int lt__py_attn_fwd_cpu(const lt_attn_fwd_params *params) {
    lt_status s = lt__host_call("lt_attn_fwd");
    return s != LT_OK ? s : lt__embedded_result(lt__embedded.attn_fwd(params, NULL));
}

static int lt__py_attn_bwd_cpu(const lt_attn_bwd_params *params) {
    lt_status s = lt__host_call("lt_attn_bwd");
    return s != LT_OK ? s : lt__embedded_result(lt__embedded.attn_bwd(params, NULL));
}

static int lt__py_attn_kvcache_cpu(const lt_attn_kvcache_params *params) {
    lt_status s = lt__host_call("lt_attn_kvcache");
    return s != LT_OK ? s : lt__embedded_result(lt__embedded.attn_kvcache(params, NULL));
}

static int lt__py_flash_combine_cpu(const lt_flash_combine_params *params) {
    lt_status s = lt__host_call("lt_flash_combine");
    return s != LT_OK ? s : lt__embedded_result(lt__embedded.flash_combine(params, NULL));
}

static int lt__py_prewarm(const char *const *specs, size_t n_specs, size_t *compiled, size_t *cached) {
    lt_status s = lt__embedded_ready("lt_prewarm");
    if (s == LT_MISS)
        return lt__fail(LT_ERROR_UNSUPPORTED, "lt_prewarm compiles kernels, in the embedded Python: allow the JIT "
                        "fallback (LAZYTRITON_JIT=1 or lt_config.jit = LT_JIT_ON), or build images with `lazytriton "
                        "prewarm`");
    return s != LT_OK ? s : lt__embedded_result(lt__embedded.prewarm(specs, n_specs, compiled, cached));
}

/* The native core's counts: the images' entries and the plans (lt_cache_stats adds the plans); the embedded
   library's counts when it is loaded. */
static int lt__py_cache_stats(lt_stats *stats) {
    if (lt__embedded.handle != NULL)
        return lt__embedded_result(lt__embedded.cache_stats(stats));
    uint32_t size = stats->struct_size, version = stats->version;
    memset(stats, 0, sizeof *stats);
    stats->struct_size = size, stats->version = version;
    stats->image_entries = ltn_images_entries();
    return LT_OK;
}

static void lt__py_flush(void) {}
