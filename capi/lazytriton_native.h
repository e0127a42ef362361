/*
 * lazytriton_native.h: the C API's native core (C99).
 *
 * Kernels served from prewarmed images with no Python in the process: the
 * images are read in C (capi/native), the binary loaded and launched through
 * the CUDA driver API (libcuda opened with dlopen). A kernel no image holds is
 * LT_MISS: its message names the variant and the `lazytriton prewarm` command
 * that builds it, and the miss is appended to the miss log
 * (CACHE_DIR/misses.jsonl, the lines Python's runtime writes).
 *
 * The library: liblazytriton_native.so (capi/native_build.py builds it); it
 * links libzstd, libdl and libpthread, never libpython. Its statuses are
 * lazytriton.h's lt_status values (LT_MISS and LT_ERROR_IMAGE are its own).
 */
#ifndef LAZYTRITON_NATIVE_H
#define LAZYTRITON_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "lazytriton.h"

#if defined(__GNUC__) || defined(__clang__)
#define LT_NATIVE_API __attribute__((visibility("default")))
#else
#define LT_NATIVE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lt_kernel lt_kernel;

/* What a loaded kernel launches with (from its entry). */
typedef struct {
    uint32_t struct_size;  /* sizeof(lt_kernel_info) */
    uint32_t version;      /* LT_KERNEL_INFO_VERSION */
    const char *key;       /* the entry's key, 32 hex digits */
    const char *variant;   /* the entry's variant string */
    const char *name;      /* the kernel's symbol */
    const char *image;     /* the image it came from */
    uint32_t num_warps, warp_size, block_threads, shared_bytes;
    uint32_t n_args;       /* the kernel's own parameters: lt_kernel_launch takes this many */
} lt_kernel_info;
#define LT_KERNEL_INFO_VERSION 1

/* The images to serve from: colon-separated image files (NULL: LAZYTRITON_IMAGES). Each is opened and
   checked now; one that cannot be opened is LT_ERROR_IMAGE naming it (and nothing is replaced). An empty
   list closes every image. Not to be called while other calls are in flight. */
LT_NATIVE_API int lt_open_images(const char *paths);
/* How many images are open. */
LT_NATIVE_API int lt_images_count(void);
/* The kernel of key (the variant's cache key, 32 lowercase hex digits), loaded on CUDA device device_index:
   LT_OK; LT_MISS when no image holds it (variant, if not NULL, is named in the message and the miss log);
   LT_ERROR_IMAGE for a damaged entry; LT_ERROR_NO_GPU, LT_ERROR_CUDA from the driver; LT_ERROR_UNSUPPORTED
   for an entry this launcher cannot launch (HSACO, host descriptors, global scratch). */
LT_NATIVE_API int lt_kernel_load(const char *key, const char *variant, int32_t device_index, lt_kernel **out);
LT_NATIVE_API int lt_kernel_get_info(const lt_kernel *kernel, lt_kernel_info *info);
/* cuLaunchKernel on stream (a CUstream): grid (x, y, z), the kernel's n_args parameters (pointers to each
   value, as cuLaunchKernel takes them); the hidden scratch pointers are passed NULL. */
LT_NATIVE_API int lt_kernel_launch(const lt_kernel *kernel, const uint32_t grid[3], void *stream, void **args,
                                   size_t n_args);
LT_NATIVE_API void lt_kernel_destroy(lt_kernel *kernel);
/* The calling thread's last error message of the functions above (lt_last_error in liblazytriton_native.so says
   the same). */
LT_NATIVE_API const char *lt_native_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
