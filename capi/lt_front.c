/*
 * lt_front.c: lazytriton.h's API in liblazytriton_native.so, with no Python.
 *
 * The C half of liblazytriton.so (lazytriton.c: every check, the plans, the
 * launches) compiled with LT__NATIVE_FRONT, and here the functions that the
 * embedded build has Python answer:
 *
 *   - a plan of flash_fwd, flash_bwd_dq or flash_bwd_dkdv: the variant and key
 *     computed in C (native/lt_choice.c), the entry read from the images
 *     lt_init opened (native/lt_runtime.c) and loaded through libcuda;
 *   - what the images cannot serve (a miss, decoding's plans, host memory,
 *     lt_prewarm): liblazytriton.so, opened with dlopen on the first such call
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

static const int32_t lt__front_ints[] = {LT__KERNEL_INTS, LT__BWD_DQ_PARAMS - LT__BWD_FLOATS,
                                         LT__BWD_DKDV_PARAMS - LT__BWD_FLOATS};

/* The kernel of request from the images: LT_OK (request filled), LT_MISS, or another failure. */
static int lt__native_plan(lt__plan_request *request) {
    ltn_attn_request r = {
        .kernel = request->kernel, .capability = request->capability, .dtype = request->dtype,
        .head_dim = request->head_dim, .head_dim_v = request->head_dim_v, .causal = request->causal,
        .aligned = request->aligned & 1, .seq16 = (request->aligned & 2) != 0, .index64 = request->index64,
        .window = request->window, .softcap = request->softcap, .varlen = request->varlen & 1,
        .seqused_q = (request->varlen & 2) != 0, .seqused_k = (request->varlen & 4) != 0,
        .seqlen_q = request->seqlen_q, .seqlen_k = request->seqlen_k, .sinks = request->sinks};
    ltn_variant variant;
    ltn_error err;
    char key[33];
    if (ltn_attn_variant(&r, &variant, &err) != LTN_OK)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s", err.message);
    if (ltn_variant_string(&variant, request->variant, sizeof request->variant) != 0 ||
        ltn_variant_key(&variant, key) != 0)
        return lt__fail(LT_ERROR_INTERNAL, "the variant of kernel %d has no string or key", request->kernel);
    lt_kernel *kernel = NULL;
    int status = lt_kernel_load(key, request->variant, request->device_index, &kernel);
    if (status != LT_OK)
        return status;
    void *function = NULL, *context = NULL;
    uint32_t n_hidden = 0;
    lt_kernel_info info = {sizeof info, LT_KERNEL_INFO_VERSION, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0};
    status = ltn_kernel_layout(kernel, (uint32_t)lt__front_ints[r.kernel], LT__BWD_FLOATS, &function, &context,
                               &n_hidden);
    if (status == LT_OK)
        status = lt_kernel_get_info(kernel, &info);
    if (status == LT_OK) {
        request->function = (uint64_t)(uintptr_t)function; /* its module stays loaded, as the embedded planner's */
        request->block_threads = info.block_threads, request->shared_bytes = info.shared_bytes;
        request->block_m = (uint32_t)ltn_variant_get(&variant, r.kernel == LTN_KERNEL_BWD_DKDV ? "BLOCK_N" : "BLOCK_M",
                                                      0);
        request->n_hidden = n_hidden; /* scratch pointers, passed NULL (lt_kernel_load refuses entries needing any) */
    }
    lt_kernel_destroy(kernel);
    return status;
}

static int lt__py_plan(lt__plan_request *request) {
    int status = lt__native_plan(request);
    if (status != LT_MISS)
        return status;
    char miss[2048];
    snprintf(miss, sizeof miss, "%s", lt_last_error());
    lt_status s = lt__embedded_ready(request->variant);
    if (s == LT_MISS)
        return lt__fail(LT_MISS, "%s (the JIT fallback is off: LAZYTRITON_JIT=1 or lt_config.jit = LT_JIT_ON "
                        "allows it)", miss);
    if (s != LT_OK)
        return s;
    return lt__embedded_result((lt_status)lt__embedded.plan(request));
}

static int lt__py_kvcache_plan(lt__kvcache_plan_request *request) {
    lt_status s = lt__embedded_ready("decoding (lt_attn_kvcache)");
    if (s == LT_MISS)
        return lt__fail(LT_MISS, "the native core does not choose decoding's variants (flash_decode_split, "
                        "flash_decode_combine, kv_append): lt_attn_kvcache needs the JIT fallback "
                        "(LAZYTRITON_JIT=1 or lt_config.jit = LT_JIT_ON, and liblazytriton.so)");
    return s != LT_OK ? s : lt__embedded_result((lt_status)lt__embedded.kvcache_plan(request));
}

static int lt__py_combine_plan(lt__combine_plan_request *request) {
    lt_status s = lt__embedded_ready("lt_flash_combine");
    if (s == LT_MISS)
        return lt__fail(LT_MISS, "the native core does not choose flash_combine's variant: lt_flash_combine needs the "
                        "JIT fallback (LAZYTRITON_JIT=1 or lt_config.jit = LT_JIT_ON, and liblazytriton.so)");
    return s != LT_OK ? s : lt__embedded_result((lt_status)lt__embedded.combine_plan(request));
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
