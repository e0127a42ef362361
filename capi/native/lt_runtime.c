/*
 * lt_runtime.c: the native core's serving half: the open images, a kernel's
 * lookup across them (in the order given, as the image tier does), its load
 * and launch through the CUDA driver API, or the HIP runtime for an AMD entry
 * (lt_hip.c), the parameters as lt_launch.c lays them out (host descriptors
 * encoded, scratch memory allocated on the stream), and a miss: LT_MISS, its
 * message and the miss log line.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
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
    /* optional: NULL where the driver lacks them (CUDA 12.0+, 11.2+) */
    CUresult (*encode)(void *, int, uint32_t, void *, const uint64_t *, const uint64_t *, const uint32_t *,
                       const uint32_t *, int, int, int, int);
    CUresult (*mem_alloc_async)(uint64_t *, size_t, void *);
    CUresult (*mem_free_async)(uint64_t, void *);
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
    *(void **)&cu.encode = dlsym(lib, "cuTensorMapEncodeTiled");
    *(void **)&cu.mem_alloc_async = dlsym(lib, "cuMemAllocAsync");
    *(void **)&cu.mem_free_async = dlsym(lib, "cuMemFreeAsync");
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

enum { FUNC_MAX_DYNAMIC_SHARED = 8, STATIC_SHARED_LIMIT = 48 * 1024 };

struct lt_kernel {
    void *function, *context;                 /* context: NULL for a HIP kernel (hip) */
    int hip;                                  /* an AMD entry ("hsaco"), loaded and launched by lt_hip.c */
    int32_t device;                           /* the device it was loaded on */
    uint32_t grid_block, shared, n_args, n_hidden, num_warps, warp_size;
    uint32_t n_leading_ints, n_trailing_fp32; /* parameters that are pointers or integers from the first on; fp32
                                                 ones from the last back */
    ltn_layout layout;                        /* what a launch passes (lt_launch.c) */
    char key[33];
    char *variant, *name, *image, *kind;
    char **arg_types;                         /* n_args strings, then NULL */
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

static int launchable(const ltn_entry *e, ltn_layout *layout) {
    if (strcmp(e->kind.s, "cubin") != 0 && strcmp(e->kind.s, "hsaco") != 0)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s is a %s: the native launcher loads cubins and hsaco only",
                    e->key.s, e->kind.s);
    ltn_error err;
    if (ltn_layout_of(e, layout, &err) != 0)
        return fail(LT_ERROR_UNSUPPORTED, "%s", err.message);
    if (e->name.len != strlen(e->name.s))
        return fail(LT_ERROR_IMAGE, "entry %s names a kernel with a NUL in it", e->key.s);
    return LT_OK;
}

static int load_function(const ltn_entry *e, int32_t device_index, lt_kernel *k) {
    k->device = device_index;
    if (k->hip) {
        ltn_error err;
        int status = ltn_hip_load(e, device_index, &k->function, &err);
        return status == LT_OK ? LT_OK : fail(status, "%s", err.message);
    }
    pthread_once(&cu_once, cu_load);
    if (cu_error[0])
        return fail(LT_ERROR_NO_GPU, "%s", cu_error);
    int device, pushed, status;
    CUresult r;
    if (k->layout.n_descs > 0 && cu.encode == NULL)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s takes host tensor descriptors, and this CUDA driver has no "
                    "cuTensorMapEncodeTiled (CUDA 12.0+)", e->key.s);
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
                      uint32_t *n_hidden, ltn_scratch_need *need) {
    const ltn_layout *l = &k->layout;
    if (k->hip)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s is an AMD kernel (hsaco); the C API's plans launch CUDA "
                    "kernels only (lt_kernel_launch launches it)", k->key);
    if (l->n_descs > 0)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s takes host tensor descriptors, which no kernel the C API plans "
                    "takes (lt_kernel_launch encodes them)", k->key);
    if (need == NULL && (l->scratch_size[0] > 0 || l->scratch_size[1] > 0))
        return fail(LT_ERROR_UNSUPPORTED, "entry %s needs scratch memory, which this C launcher does not pass (the "
                    "forward's plans and lt_kernel_launch do)", k->key);
    if (k->n_args != n_ints + n_floats || k->n_leading_ints < n_ints || k->n_trailing_fp32 < n_floats)
        return fail(LT_ERROR_UNSUPPORTED, "entry %s has %u parameters (%u pointers or integers first, %u fp32 last); "
                    "the C API's launcher passes %u pointers or integers, then %u fp32", k->key, k->n_args,
                    k->n_leading_ints, k->n_trailing_fp32, n_ints, n_floats);
    *function = k->function, *context = k->context, *n_hidden = k->n_hidden;
    if (need != NULL) { /* lt_launch.c's hidden_layout checked each name, once, and the alignments */
        memset(need, 0, sizeof *need);
        need->num_ctas = l->num_ctas;
        for (int s = 0; s < 2; s++)
            need->size[s] = l->scratch_size[s], need->align[s] = l->scratch_align[s];
        for (uint32_t h = 0; h < l->n_hidden && h < 8; h++)
            need->hidden[h] = (uint8_t)l->hidden[h];
    }
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
    if (status == LT_OK && (status = launchable(&entry, &k->layout)) == LT_OK) {
        memcpy(k->key, entry.key.s, 33);
        k->variant = strdup(entry.variant.s);
        k->name = strdup(entry.name.s);
        k->image = strdup(image);
        k->kind = strdup(entry.kind.s);
        k->hip = strcmp(entry.kind.s, "hsaco") == 0;
        k->arg_types = calloc(entry.n_arg_types + 1, sizeof *k->arg_types);
        for (uint32_t i = 0; k->arg_types && i < entry.n_arg_types; i++)
            if ((k->arg_types[i] = strdup(entry.arg_types[i].s)) == NULL)
                status = fail(LT_ERROR_INTERNAL, "out of memory");
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
        if (k->variant == NULL || k->name == NULL || k->image == NULL || k->kind == NULL || k->arg_types == NULL)
            status = fail(LT_ERROR_INTERNAL, "out of memory");
        else if (status == LT_OK)
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
    size_t v1_size = offsetof(lt_kernel_info, arg_types);
    int v1 = info->struct_size == v1_size && info->version == 1;
    if (!v1 && (info->struct_size != sizeof *info || info->version != LT_KERNEL_INFO_VERSION))
        return fail(LT_ERROR_VERSION, "lt_kernel_info has struct_size %u and version %u; this library's are %zu "
                    "and %d (or %zu and 1)", info->struct_size, info->version, sizeof *info, LT_KERNEL_INFO_VERSION,
                    v1_size);
    info->key = k->key, info->variant = k->variant, info->name = k->name, info->image = k->image;
    info->block_threads = k->grid_block, info->shared_bytes = k->shared, info->n_args = k->n_args;
    info->warp_size = k->warp_size, info->num_warps = k->num_warps;
    if (v1)
        return LT_OK; /* a version 1 struct ends here */
    const ltn_layout *l = &k->layout;
    info->arg_types = (const char *const *)k->arg_types, info->kind = k->kind;
    info->n_descriptors = l->n_descs, info->num_ctas = l->num_ctas;
    info->global_scratch_size = l->scratch_size[LTN_GLOBAL_SCRATCH];
    info->global_scratch_align = l->scratch_align[LTN_GLOBAL_SCRATCH];
    info->profile_scratch_size = l->scratch_size[LTN_PROFILE_SCRATCH];
    info->profile_scratch_align = l->scratch_align[LTN_PROFILE_SCRATCH];
    return LT_OK;
}

int lt_kernel_scratch_bytes(const lt_kernel *k, const uint32_t grid[3], uint64_t bytes[2]) {
    if (k == NULL || grid == NULL || bytes == NULL)
        return fail(LT_ERROR_NULL_POINTER, "lt_kernel_scratch_bytes: kernel, grid and bytes must not be NULL");
    if (ltn_scratch_bytes(&k->layout, grid, bytes) != 0)
        return fail(LT_ERROR_INVALID_ARGUMENT, "grid (%u, %u, %u) of %u CTAs: its scratch memory (%u and %u bytes "
                    "a program) overflows 64 bits", grid[0], grid[1], grid[2], k->layout.num_ctas,
                    k->layout.scratch_size[0], k->layout.scratch_size[1]);
    return LT_OK;
}

static const char *const SCRATCH_NAMES[2] = {"global", "profile"};

/* The arguments' checks, then each host descriptor's map: LT_OK or the error, before anything is launched. */
static int check_and_encode(const lt_kernel *k, const uint32_t grid[3], void **args, size_t n_args,
                            unsigned char (*maps)[128]) {
    if (k == NULL || grid == NULL || (args == NULL && n_args > 0))
        return fail(LT_ERROR_NULL_POINTER, "lt_kernel_launch: kernel, grid and args must not be NULL");
    if (n_args != k->n_args)
        return fail(LT_ERROR_INVALID_ARGUMENT, "kernel %s takes %u parameters, got %zu", k->name, k->n_args, n_args);
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0)
        return fail(LT_ERROR_INVALID_ARGUMENT, "grid (%u, %u, %u) has an empty dimension", grid[0], grid[1],
                    grid[2]);
    for (size_t i = 0; i < n_args; i++)
        if (args[i] == NULL)
            return fail(LT_ERROR_NULL_POINTER, "kernel %s: args[%zu] (%s) is NULL", k->name, i, k->arg_types[i]);
    const ltn_layout *l = &k->layout;
    for (uint32_t i = 0; i < l->n_args; i++) {
        if (l->desc_of[i] == 0)
            continue;
        uint32_t d = l->desc_of[i] - 1u;
        ltn_encode_call c;
        ltn_error err;
        if (ltn_encode_call_of(l, d, i, args[i], &c, &err) != 0)
            return fail(LT_ERROR_INVALID_ARGUMENT, "kernel %s: %s", k->name, err.message);
        CUresult r = cu.encode(maps[d], c.dtype, c.rank, c.base, c.dims, c.strides, c.box, c.element_strides,
                               c.interleave, c.swizzle, c.l2, c.oob);
        if (r != 0)
            return cuda_fail(r, "cuTensorMapEncodeTiled");
    }
    return LT_OK;
}

/* Scratch memory of bytes, aligned to align, on stream (the context is current): LT_OK with *raw (to free) and
   *aligned (to pass). */
static int scratch_alloc(uint64_t bytes, uint32_t align, void *stream, uint64_t *raw, void **aligned) {
    uint64_t pad = align > 256 ? align - 1 : 0; /* the driver's allocations are 256-byte aligned */
    CUresult r = cu.mem_alloc_async(raw, (size_t)(bytes + pad), stream);
    if (r != 0)
        return cuda_fail(r, "cuMemAllocAsync");
    uint64_t at = (*raw + align - 1) & ~(uint64_t)(align - 1);
    if (at - *raw > pad) {
        cu.mem_free_async(*raw, stream);
        return fail(LT_ERROR_CUDA, "cuMemAllocAsync returned %#llx, not %u-byte aligned", (unsigned long long)*raw,
                    align);
    }
    *aligned = (void *)(uintptr_t)at;
    return LT_OK;
}

static int hip_launch(const lt_kernel *k, const uint32_t grid[3], void *stream, void **args, const uint64_t bytes[2],
                      int allocate, void *const scratch[2]) {
    ltn_hip_launch_call c = {k->function, stream, k->name, k->device, {grid[0], grid[1], grid[2]}, k->grid_block,
                             k->shared, &k->layout, args, {bytes[0], bytes[1]}, allocate, {scratch[0], scratch[1]}};
    ltn_error err;
    int status = ltn_hip_launch(&c, &err);
    return status == LT_OK ? LT_OK : fail(status, "%s", err.message);
}

/* The launch: given (the caller's scratch) or NULL (allocated here on the stream, freed after the launch). */
static int launch(const lt_kernel *k, const uint32_t grid[3], void *stream, void **args, size_t n_args,
                  void *const *given) {
    unsigned char maps[LTN_MAX_DESCS][128] __attribute__((aligned(64)));
    int status = check_and_encode(k, grid, args, n_args, maps);
    uint64_t bytes[2] = {0, 0}, own[2] = {0, 0};
    if (status == LT_OK)
        status = lt_kernel_scratch_bytes(k, grid, bytes);
    if (status != LT_OK)
        return status;
    void *scratch[2] = {NULL, NULL};
    int allocate = 0;
    for (int s = 0; s < 2; s++) {
        if (bytes[s] == 0)
            continue;
        uint32_t align = k->layout.scratch_align[s];
        if (given == NULL)
            allocate = 1;
        else if (given[s] == NULL)
            return fail(LT_ERROR_NULL_POINTER, "kernel %s needs %llu bytes of %s scratch for grid (%u, %u, %u); "
                        "scratch[%d] is NULL", k->name, (unsigned long long)bytes[s], SCRATCH_NAMES[s], grid[0],
                        grid[1], grid[2], s);
        else if ((uintptr_t)given[s] % align != 0)
            return fail(LT_ERROR_INVALID_ARGUMENT, "kernel %s: scratch[%d] %p is not %u-byte aligned", k->name, s,
                        given[s], align);
        else
            scratch[s] = given[s];
    }
    if (k->hip)
        return hip_launch(k, grid, stream, args, bytes, allocate, scratch);
    if (allocate && (cu.mem_alloc_async == NULL || cu.mem_free_async == NULL))
        return fail(LT_ERROR_UNSUPPORTED, "kernel %s needs scratch memory, and this CUDA driver has no "
                    "cuMemAllocAsync (CUDA 11.2+): pass it with lt_kernel_launch_scratch", k->name);
    int pushed;
    if ((status = enter(k->context, &pushed)) != LT_OK)
        return status;
    for (int s = 0; s < 2 && status == LT_OK; s++)
        if (allocate && bytes[s] > 0)
            status = scratch_alloc(bytes[s], k->layout.scratch_align[s], stream, &own[s], &scratch[s]);
    if (status == LT_OK) {
        void *params[LTN_MAX_PARAMS];
        ltn_params(&k->layout, args, maps, scratch, params);
        CUresult r = cu.launch(k->function, grid[0], grid[1], grid[2], k->grid_block, 1, 1, k->shared, stream,
                               params, NULL);
        if (r != 0)
            status = cuda_fail(r, "cuLaunchKernel");
    }
    for (int s = 0; s < 2; s++) { /* stream-ordered: freed once the launch has run */
        CUresult r = own[s] ? cu.mem_free_async(own[s], stream) : 0;
        if (r != 0 && status == LT_OK)
            status = cuda_fail(r, "cuMemFreeAsync");
    }
    leave(pushed);
    return status;
}

int lt_kernel_launch(const lt_kernel *k, const uint32_t grid[3], void *stream, void **args, size_t n_args) {
    return launch(k, grid, stream, args, n_args, NULL);
}

int lt_kernel_launch_scratch(const lt_kernel *k, const uint32_t grid[3], void *stream, void **args, size_t n_args,
                             void *const scratch[2]) {
    static void *const none[2] = {NULL, NULL};
    return launch(k, grid, stream, args, n_args, scratch ? scratch : none);
}

void lt_kernel_destroy(lt_kernel *k) {
    if (k == NULL)
        return;
    for (uint32_t i = 0; k->arg_types && k->arg_types[i]; i++)
        free(k->arg_types[i]);
    free(k->arg_types);
    free(k->variant);
    free(k->name);
    free(k->image);
    free(k->kind);
    free(k);
}
