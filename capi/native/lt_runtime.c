/*
 * lt_runtime.c: the native core's serving half: the open images, a kernel's
 * lookup across them (in the order given, as the image tier does), its load
 * and launch through the CUDA driver API, and a miss: LT_MISS, its message
 * and the miss log line.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "../lazytriton.h"
#include "../lazytriton_native.h"
#include "lt_native.h"

static __thread char native_error[2048];

const char *lt_native_last_error(void) { return native_error; }

/* Where else a message goes: the C API's lt_last_error in liblazytriton_native.so (lt_front.c defines it). */
__attribute__((weak)) void ltn_note_error(const char *message) { (void)message; }

static int fail(int status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(native_error, sizeof native_error, format, args);
    va_end(args);
    ltn_note_error(native_error);
    return status;
}

/* ---- the images -------------------------------------------------------------------------------------- */

#define MAX_IMAGES 64

static pthread_rwlock_t images_lock = PTHREAD_RWLOCK_INITIALIZER;
static ltn_image *images[MAX_IMAGES];
static int n_images;

int lt_open_images(const char *paths) {
    if (paths == NULL)
        paths = getenv("LAZYTRITON_IMAGES");
    ltn_image *opened[MAX_IMAGES];
    int n = 0, status = LT_OK;
    char *list = strdup(paths ? paths : "");
    if (list == NULL)
        return fail(LT_ERROR_INTERNAL, "out of memory");
    for (char *save = NULL, *path = strtok_r(list, ":", &save); path; path = strtok_r(NULL, ":", &save)) {
        ltn_error err;
        if (n == MAX_IMAGES) {
            status = fail(LT_ERROR_INVALID_ARGUMENT, "more than %d images", MAX_IMAGES);
            break;
        }
        if (ltn_image_open(path, &opened[n], &err) != LTN_OK) {
            status = fail(LT_ERROR_IMAGE, "cannot serve from image %s", err.message);
            break;
        }
        n++;
    }
    free(list);
    if (status != LT_OK) {
        while (n > 0)
            ltn_image_close(opened[--n]);
        return status;
    }
    pthread_rwlock_wrlock(&images_lock);
    for (int i = 0; i < n_images; i++)
        ltn_image_close(images[i]);
    memcpy(images, opened, sizeof opened[0] * (size_t)n);
    n_images = n;
    pthread_rwlock_unlock(&images_lock);
    return LT_OK;
}

int lt_images_count(void) { return n_images; }

uint64_t ltn_images_entries(void) {
    uint64_t total = 0;
    pthread_rwlock_rdlock(&images_lock);
    for (int i = 0; i < n_images; i++)
        total += ltn_image_count(images[i]);
    pthread_rwlock_unlock(&images_lock);
    return total;
}

/* ---- libcuda, through dlopen ---------------------------------------------------------------------------- */

typedef int CUresult;
static struct {
    CUresult (*init)(unsigned int);
    CUresult (*device_get)(int *, int);
    CUresult (*primary_ctx_retain)(void **, int);
    CUresult (*ctx_get_current)(void **);
    CUresult (*ctx_push)(void *);
    CUresult (*ctx_pop)(void **);
    CUresult (*module_load_data)(void **, const void *);
    CUresult (*module_get_function)(void **, void *, const char *);
    CUresult (*func_set_attribute)(void *, int, int);
    CUresult (*error_string)(CUresult, const char **);
    CUresult (*launch)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                       unsigned int, void *, void **, void **);
} cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static char cu_error[512];

static void cu_load(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        snprintf(cu_error, sizeof cu_error, "cannot load the CUDA driver (libcuda.so.1): %s", why ? why : "?");
        return;
    }
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&cu.init, "cuInit"}, {(void **)&cu.device_get, "cuDeviceGet"},
        {(void **)&cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.ctx_get_current, "cuCtxGetCurrent"}, {(void **)&cu.ctx_push, "cuCtxPushCurrent_v2"},
        {(void **)&cu.ctx_pop, "cuCtxPopCurrent_v2"}, {(void **)&cu.module_load_data, "cuModuleLoadData"},
        {(void **)&cu.module_get_function, "cuModuleGetFunction"},
        {(void **)&cu.func_set_attribute, "cuFuncSetAttribute"}, {(void **)&cu.error_string, "cuGetErrorString"},
        {(void **)&cu.launch, "cuLaunchKernel"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++)
        if ((*symbols[i].slot = dlsym(lib, symbols[i].name)) == NULL) {
            snprintf(cu_error, sizeof cu_error, "libcuda.so.1 has no %s", symbols[i].name);
            return;
        }
    CUresult r = cu.init(0);
    if (r != 0)
        snprintf(cu_error, sizeof cu_error, "cuInit failed: CUDA error %d (no usable GPU?)", r);
}

static int cuda_fail(CUresult r, const char *call) {
    const char *text = NULL;
    if (cu.error_string == NULL || cu.error_string(r, &text) != 0 || text == NULL)
        text = "unknown error";
    return fail(LT_ERROR_CUDA, "%s failed: CUDA error %d (%s)", call, r, text);
}

/* Makes context current (pushed if it was not): whether it was pushed. */
static int enter(void *context, int *pushed) {
    void *current = NULL;
    cu.ctx_get_current(&current);
    *pushed = current != context;
    CUresult r;
    if (*pushed && (r = cu.ctx_push(context)) != 0)
        return cuda_fail(r, "cuCtxPushCurrent");
    return LT_OK;
}

static void leave(int pushed) {
    void *previous;
    if (pushed)
        cu.ctx_pop(&previous);
}

/* ---- kernels -------------------------------------------------------------------------------------------- */

enum { FUNC_MAX_DYNAMIC_SHARED = 8, STATIC_SHARED_LIMIT = 48 * 1024, MAX_ARGS = 256 };

struct lt_kernel {
    void *function, *context;
    uint32_t grid_block, shared, n_args, n_hidden, num_warps, warp_size;
    uint32_t n_leading_ints, n_trailing_fp32; /* parameters that are pointers or integers from the first on; fp32
                                                 ones from the last back */
    char key[33];
    char *variant, *name, *image;
};

/* The miss log: CACHE_DIR/misses.jsonl, CACHE_DIR as Python's settings read it. */
static int miss_log_path(char *out, size_t size) {
    const char *dir = getenv("LAZYTRITON_CACHE_DIR"), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (dir && *dir && dir[0] == '~' && dir[1] == '/' && home)
        n = snprintf(out, size, "%s/%s/misses.jsonl", home, dir + 2);
    else if (dir && *dir)
        n = snprintf(out, size, "%s/misses.jsonl", dir);
    else if (xdg && *xdg)
        n = snprintf(out, size, "%s/lazytriton/misses.jsonl", xdg);
    else if (home && *home)
        n = snprintf(out, size, "%s/.cache/lazytriton/misses.jsonl", home);
    else
        return -1;
    return n > 0 && (size_t)n < size ? 0 : -1;
}

static void json_string(char *out, size_t size, const char *s) {
    size_t at = 0;
    out[at++] = '"';
    for (; *s && at + 8 < size; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            at += (size_t)snprintf(out + at, size - at, "\\%c", c);
        else if (c < 0x20)
            at += (size_t)snprintf(out + at, size - at, "\\u%04x", c);
        else
            out[at++] = (char)c;
    }
    out[at++] = '"';
    out[at] = '\0';
}

/* Appends the miss to the miss log, one line in one O_APPEND write, never through a link or into a FIFO;
   where it went ("" if it could not be written: the miss is still reported). */
static void log_miss(const char *key, const char *variant, char *where, size_t where_size) {
    char path[4096], quoted_variant[1100], line[1400];
    where[0] = '\0';
    if (miss_log_path(path, sizeof path) != 0)
        return;
    char *slash = strrchr(path, '/');
    if (slash != NULL) { /* the cache dir and its parents, as Python's mkdir(parents=True) */
        *slash = '\0';
        for (char *p = path + 1; *p; p++)
            if (*p == '/') {
                *p = '\0';
                mkdir(path, 0777);
                *p = '/';
            }
        mkdir(path, 0777);
        *slash = '/';
    }
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    struct stat st;
    struct timeval now;
    gettimeofday(&now, NULL);
    json_string(quoted_variant, sizeof quoted_variant, variant);
    int n = snprintf(line, sizeof line, "{\"compile_s\": 0.0, \"key\": \"%s\", \"time\": %.3f, \"variant\": %s}\n",
                     key, (double)now.tv_sec + now.tv_usec / 1e6, quoted_variant);
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && n > 0 && (size_t)n < sizeof line &&
        write(fd, line, (size_t)n) == n)
        snprintf(where, where_size, "%s", path);
    close(fd);
}

static int miss(const char *key, const char *variant) {
    char where[4096];
    const char *named = variant && *variant ? variant : key;
    log_miss(key, variant && *variant ? variant : "", where, sizeof where);
    if (where[0])
        return fail(LT_MISS, "no image holds %.900s (key %s; %d images open); the miss is logged in %s: build "
                    "an image of it with `lazytriton prewarm --from-misses %s --out IMAGE`, then add IMAGE to "
                    "LAZYTRITON_IMAGES", named, key, n_images, where, where);
    return fail(LT_MISS, "no image holds %.900s (key %s; %d images open); the miss log could not be written: "
                "build it with `lazytriton prewarm --from-misses FILE --out IMAGE`, FILE holding the line "
                "{\"variant\": \"%.900s\"}", named, key, n_images, named);
}

/* The entry of key from the first image that holds it: LT_OK, LT_MISS (nothing written), LT_ERROR_IMAGE. */
static int find_entry(const char *key, ltn_entry *entry, const char **image_path) {
    int status = LT_MISS;
    pthread_rwlock_rdlock(&images_lock);
    for (int i = 0; i < n_images && status == LT_MISS; i++) {
        ltn_error err;
        int read = ltn_image_read(images[i], key, entry, &err);
        if (read == LTN_OK) {
            status = LT_OK;
            *image_path = ltn_image_path(images[i]);
        } else if (read == LTN_ARGUMENT)
            status = fail(LT_ERROR_INVALID_ARGUMENT, "%s", err.message);
        else if (read != LTN_ABSENT)
            status = fail(LT_ERROR_IMAGE, "%s", err.message);
    }
    pthread_rwlock_unlock(&images_lock);
    return status;
}

static int launchable(const ltn_entry *e) {
    if (strcmp(e->kind.s, "cubin") != 0)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s is a %s: the native launcher loads cubins only", e->key.s,
                    e->kind.s);
    if (e->n_tensordesc > 0 || e->global_scratch_size > 0 || e->profile_scratch_size > 0)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s takes host descriptors or scratch memory, which the native "
                    "launcher does not provide yet", e->key.s);
    for (uint32_t i = 0; i < e->n_hidden_args; i++)
        if (strcmp(e->hidden_args[i].s, "global_scratch") != 0 && strcmp(e->hidden_args[i].s, "profile_scratch") != 0)
            return fail(LT_ERROR_UNSUPPORTED, "entry %s has a hidden parameter %.100s", e->key.s,
                        e->hidden_args[i].s);
    if (e->name.len != strlen(e->name.s))
        return fail(LT_ERROR_IMAGE, "entry %s names a kernel with a NUL in it", e->key.s);
    return LT_OK;
}

static int load_function(const ltn_entry *e, int32_t device_index, lt_kernel *k) {
    pthread_once(&cu_once, cu_load);
    if (cu_error[0])
        return fail(LT_ERROR_NO_GPU, "%s", cu_error);
    int device, pushed, status;
    CUresult r;
    if ((r = cu.device_get(&device, device_index)) != 0)
        return fail(LT_ERROR_NO_GPU, "no CUDA device %d (cuDeviceGet: CUDA error %d)", device_index, r);
    if ((r = cu.primary_ctx_retain(&k->context, device)) != 0)
        return cuda_fail(r, "cuDevicePrimaryCtxRetain");
    if ((status = enter(k->context, &pushed)) != LT_OK)
        return status;
    void *module = NULL;
    if ((r = cu.module_load_data(&module, e->binary)) != 0)
        status = cuda_fail(r, "cuModuleLoadData");
    else if ((r = cu.module_get_function(&k->function, module, e->name.s)) != 0)
        status = cuda_fail(r, "cuModuleGetFunction");
    else if (e->shared > STATIC_SHARED_LIMIT &&
             (r = cu.func_set_attribute(k->function, FUNC_MAX_DYNAMIC_SHARED, (int)e->shared)) != 0)
        status = cuda_fail(r, "cuFuncSetAttribute");
    leave(pushed);
    return status;
}

/* A parameter the C API passes from an int64 (capi/embedded.py's check_launch_layout): a pointer or an integer. */
static int int_param(const ltn_str *type) {
    static const char *const kinds[] = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"};
    if (type->s[0] == '*')
        return 1;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (strcmp(type->s, kinds[i]) == 0)
            return 1;
    return 0;
}

int ltn_kernel_layout(const lt_kernel *k, uint32_t n_ints, uint32_t n_floats, void **function, void **context,
                      uint32_t *n_hidden) {
    if (k->n_args != n_ints + n_floats || k->n_leading_ints < n_ints || k->n_trailing_fp32 < n_floats)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s has %u parameters (%u pointers or integers first, %u fp32 last); "
                    "the C API's launcher passes %u pointers or integers, then %u fp32", k->key, k->n_args,
                    k->n_leading_ints, k->n_trailing_fp32, n_ints, n_floats);
    *function = k->function, *context = k->context, *n_hidden = k->n_hidden;
    return LT_OK;
}

int lt_kernel_load(const char *key, const char *variant, int32_t device_index, lt_kernel **out) {
    if (key == NULL || out == NULL)
        return fail(LT_ERROR_NULL_POINTER, "lt_kernel_load: key and out must not be NULL");
    *out = NULL;
    ltn_entry entry;
    const char *image = NULL;
    int status = find_entry(key, &entry, &image);
    if (status == LT_MISS)
        return miss(key, variant);
    if (status != LT_OK)
        return status;
    lt_kernel *k = calloc(1, sizeof *k);
    if (k == NULL)
        status = fail(LT_ERROR_INTERNAL, "out of memory");
    if (status == LT_OK && (status = launchable(&entry)) == LT_OK) {
        memcpy(k->key, entry.key.s, 33);
        k->variant = strdup(entry.variant.s);
        k->name = strdup(entry.name.s);
        k->image = strdup(image);
        k->grid_block = entry.num_warps * entry.warp_size;
        k->num_warps = entry.num_warps, k->warp_size = entry.warp_size;
        k->shared = entry.shared;
        k->n_args = entry.n_arg_types;
        k->n_hidden = entry.n_hidden_args;
        while (k->n_leading_ints < entry.n_arg_types && int_param(&entry.arg_types[k->n_leading_ints]))
            k->n_leading_ints++;
        while (k->n_trailing_fp32 < entry.n_arg_types &&
               strcmp(entry.arg_types[entry.n_arg_types - 1 - k->n_trailing_fp32].s, "fp32") == 0)
            k->n_trailing_fp32++;
        if (k->variant == NULL || k->name == NULL || k->image == NULL)
            status = fail(LT_ERROR_INTERNAL, "out of memory");
        else
            status = load_function(&entry, device_index, k);
    }
    ltn_entry_free(&entry);
    if (status != LT_OK) {
        lt_kernel_destroy(k);
        return status;
    }
    *out = k;
    return LT_OK;
}

int lt_kernel_get_info(const lt_kernel *k, lt_kernel_info *info) {
    if (k == NULL || info == NULL)
        return fail(LT_ERROR_NULL_POINTER, "lt_kernel_get_info: kernel and info must not be NULL");
    if (info->struct_size != sizeof *info || info->version != LT_KERNEL_INFO_VERSION)
        return fail(LT_ERROR_VERSION, "lt_kernel_info has struct_size %u and version %u; this library's are %zu "
                    "and %d", info->struct_size, info->version, sizeof *info, LT_KERNEL_INFO_VERSION);
    info->key = k->key, info->variant = k->variant, info->name = k->name, info->image = k->image;
    info->block_threads = k->grid_block, info->shared_bytes = k->shared, info->n_args = k->n_args;
    info->warp_size = k->warp_size, info->num_warps = k->num_warps;
    return LT_OK;
}

int lt_kernel_launch(const lt_kernel *k, const uint32_t grid[3], void *stream, void **args, size_t n_args) {
    if (k == NULL || grid == NULL || (args == NULL && n_args > 0))
        return fail(LT_ERROR_NULL_POINTER, "lt_kernel_launch: kernel, grid and args must not be NULL");
    if (n_args != k->n_args)
        return fail(LT_ERROR_INVALID_ARGUMENT, "kernel %s takes %u parameters, got %zu", k->name, k->n_args, n_args);
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0)
        return fail(LT_ERROR_INVALID_ARGUMENT, "grid (%u, %u, %u) has an empty dimension", grid[0], grid[1],
                    grid[2]);
    void *params[MAX_ARGS + 2];
    void *null_slot[2] = {NULL, NULL};
    memcpy(params, args, sizeof *args * n_args);
    for (uint32_t i = 0; i < k->n_hidden; i++)
        params[n_args + i] = &null_slot[i];
    int pushed, status;
    if ((status = enter(k->context, &pushed)) != LT_OK)
        return status;
    CUresult r = cu.launch(k->function, grid[0], grid[1], grid[2], k->grid_block, 1, 1, k->shared, stream, params,
                           NULL);
    leave(pushed);
    return r != 0 ? cuda_fail(r, "cuLaunchKernel") : LT_OK;
}

void lt_kernel_destroy(lt_kernel *k) {
    if (k == NULL)
        return;
    free(k->variant);
    free(k->name);
    free(k->image);
    free(k);
}
