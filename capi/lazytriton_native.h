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

/* What a loaded kernel launches with (from its entry). Version 1 (struct_size 64) ends at n_args; version 2
   adds the fields after it. lt_kernel_get_info fills either. */
typedef struct {
    uint32_t struct_size;  /* sizeof(lt_kernel_info) */
    uint32_t version;      /* LT_KERNEL_INFO_VERSION */
    const char *key;       /* the entry's key, 32 hex digits */
    const char *variant;   /* the entry's variant string */
    const char *name;      /* the kernel's symbol */
    const char *image;     /* the image it came from */
    uint32_t num_warps, warp_size, block_threads, shared_bytes;
    uint32_t n_args;       /* the kernel's own parameters: lt_kernel_launch takes this many */
    /* version 2 */
    const char *const *arg_types; /* the n_args parameters' Triton types ("*bf16", "i32", "fp32",
                                     "tensordesc<bf16[64, 64]>") */
    const char *kind;      /* "cubin" (loaded through libcuda) or "hsaco" (through libamdhip64) */
    uint32_t n_descriptors; /* parameters that are host tensor descriptors (an lt_tensor_descriptor each) */
    uint32_t num_ctas;
    uint32_t global_scratch_size, global_scratch_align;   /* bytes a program (0: none), alignment */
    uint32_t profile_scratch_size, profile_scratch_align; /* the same, for Triton's profiler */
} lt_kernel_info;
#define LT_KERNEL_INFO_VERSION 2

/* The value of a host tensor descriptor parameter (type "tensordesc<dtype[block]>", rank r = the block's
   dims): the launcher encodes the CUtensorMap the kernel takes (cuTensorMapEncodeTiled, with the entry's
   swizzle, element type and box, as Triton's launcher does), then passes the r sizes (i32) and the r strides
   (i64) after it. base must be 16-byte aligned and every stride but the innermost a multiple of 16 bytes. */
typedef struct {
    void *base;          /* the tensor's first element, device memory */
    int64_t sizes[5];    /* outermost first: the first r are read, each 1..2^31-1 */
    int64_t strides[5];  /* in elements, outermost first: the first r are read, the innermost must be 1 */
} lt_tensor_descriptor;

/* The images to serve from: colon-separated image files (NULL: LAZYTRITON_IMAGES). Each is opened and
   checked now; one that cannot be opened is LT_ERROR_IMAGE naming it (and nothing is replaced). An empty
   list closes every image. Not to be called while other calls are in flight. */
LT_NATIVE_API int lt_open_images(const char *paths);
/* How many images are open. */
LT_NATIVE_API int lt_images_count(void);
/* The kernel of key (the variant's cache key, 32 lowercase hex digits), loaded on device device_index (CUDA for
   a cubin entry; HIP, through libamdhip64, for an hsaco entry):
   LT_OK; LT_MISS when no image holds it (variant, if not NULL, is named in the message and the miss log);
   LT_ERROR_IMAGE for a damaged entry; LT_ERROR_NO_GPU, LT_ERROR_CUDA from the driver; LT_ERROR_UNSUPPORTED
   for an entry this launcher cannot launch (a parameter type it does not pass, more than 16 host
   descriptors, a driver without cuTensorMapEncodeTiled for an entry that has them). */
LT_NATIVE_API int lt_kernel_load(const char *key, const char *variant, int32_t device_index, lt_kernel **out);
LT_NATIVE_API int lt_kernel_get_info(const lt_kernel *kernel, lt_kernel_info *info);
/* cuLaunchKernel on stream (a CUstream): grid (x, y, z), the kernel's n_args parameters (pointers to each
   value, as cuLaunchKernel takes them; a host tensor descriptor's value is an lt_tensor_descriptor). Triton's
   hidden scratch parameters follow: NULL where the entry needs none, else memory of lt_kernel_scratch_bytes
   allocated on the stream (cuMemAllocAsync) before the launch and freed on it (cuMemFreeAsync) after, so
   that the launch may be captured in a CUDA graph. Every argument is checked before anything is launched.
   An hsaco kernel: hipModuleLaunchKernel on stream (a hipStream_t), scratch from hipMallocAsync/hipFreeAsync. */
LT_NATIVE_API int lt_kernel_launch(const lt_kernel *kernel, const uint32_t grid[3], void *stream, void **args,
                                   size_t n_args);
/* The scratch memory a launch of grid needs, in bytes: bytes[0] global, bytes[1] profile (0: none); each the
   entry's size a program times the programs (grid x num_ctas). LT_ERROR_INVALID_ARGUMENT if it overflows. */
LT_NATIVE_API int lt_kernel_scratch_bytes(const lt_kernel *kernel, const uint32_t grid[3], uint64_t bytes[2]);
/* lt_kernel_launch with the caller's scratch memory: scratch[0] global, scratch[1] profile, each at least
   lt_kernel_scratch_bytes and aligned to the entry's alignment, on the kernel's device, kept until the
   launch has run (scratch may be NULL when the entry needs none; a pointer where none is needed is ignored). */
LT_NATIVE_API int lt_kernel_launch_scratch(const lt_kernel *kernel, const uint32_t grid[3], void *stream,
                                           void **args, size_t n_args, void *const scratch[2]);
LT_NATIVE_API void lt_kernel_destroy(lt_kernel *kernel);
/* The calling thread's last error message of the functions above (lt_last_error in liblazytriton_native.so says
   the same). */
LT_NATIVE_API const char *lt_native_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
