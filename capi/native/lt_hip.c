/*
 * lt_hip.c: an AMD entry's (kind "hsaco") load and launch through the HIP runtime, opened with dlopen
 * (libamdhip64.so, else .so.6, else .so.5), as lazytriton/driver/gpu.py's HipApi and Triton's HIP launcher make
 * them: hipModuleLoadData and hipModuleGetFunction on the device (hipSetDevice, the caller's device restored
 * after), hipModuleLaunchKernel with the entry's block (warp size x num_warps) and shared memory and the
 * parameters as an array of pointers (lt_launch.c's layout: the kernel's own parameters, then Triton's hidden
 * global_scratch and profile_scratch pointers, Triton 3.6 and 3.9 alike), no extra. Scratch memory the caller
 * does not pass is allocated on the stream (hipMallocAsync) and freed there after the launch (hipFreeAsync).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "../lazytriton.h"
#include "lt_native.h"

typedef int hipError_t;
static struct {
    hipError_t (*get_device)(int *);
    hipError_t (*set_device)(int);
    hipError_t (*module_load_data)(void **, const void *);
    hipError_t (*module_get_function)(void **, void *, const char *);
    const char *(*error_string)(hipError_t);
    hipError_t (*launch)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                         unsigned int, void *, void **, void **);
    /* optional: NULL where the runtime lacks them (ROCm 5.3+) */
    hipError_t (*malloc_async)(void **, size_t, void *);
    hipError_t (*free_async)(void *, void *);
} hip;
static pthread_once_t hip_once = PTHREAD_ONCE_INIT;
static char hip_error[512];

/* The names the HIP runtime is looked for under, in order: the one HipApi opens first. */
static const char *const HIP_LIBRARIES[] = {"libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"};

static void hip_load(void) {
    void *lib = NULL;
    char why[256] = "?"; /* the first name's failure (dlerror's text lasts only until the next dlopen) */
    for (size_t i = 0; lib == NULL && i < sizeof HIP_LIBRARIES / sizeof HIP_LIBRARIES[0]; i++) {
        const char *error;
        if ((lib = dlopen(HIP_LIBRARIES[i], RTLD_NOW | RTLD_LOCAL)) == NULL && i == 0 && (error = dlerror()))
            snprintf(why, sizeof why, "%s", error);
    }
    if (lib == NULL) {
        snprintf(hip_error, sizeof hip_error, "cannot load the HIP runtime (libamdhip64.so, .so.6 or .so.5): %s",
                 why);
        return;
    }
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&hip.get_device, "hipGetDevice"}, {(void **)&hip.set_device, "hipSetDevice"},
        {(void **)&hip.module_load_data, "hipModuleLoadData"},
        {(void **)&hip.module_get_function, "hipModuleGetFunction"},
        {(void **)&hip.error_string, "hipGetErrorString"}, {(void **)&hip.launch, "hipModuleLaunchKernel"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++)
        if ((*symbols[i].slot = dlsym(lib, symbols[i].name)) == NULL) {
            snprintf(hip_error, sizeof hip_error, "the HIP runtime has no %s", symbols[i].name);
            return;
        }
    *(void **)&hip.malloc_async = dlsym(lib, "hipMallocAsync");
    *(void **)&hip.free_async = dlsym(lib, "hipFreeAsync");
}

static int hip_fail(ltn_error *err, hipError_t r, const char *call) {
    const char *text = hip.error_string ? hip.error_string(r) : NULL;
    return ltn_fail(err, LT_ERROR_CUDA, "%s failed: HIP error %d (%s)", call, r, text ? text : "unknown error");
}

/* Makes device current: LT_OK with the device that was (*previous), to be restored by leave. */
static int enter(int32_t device, int *previous, ltn_error *err) {
    hipError_t r = hip.get_device(previous);
    if (r != 0)
        return hip_fail(err, r, "hipGetDevice");
    if (*previous != device && (r = hip.set_device(device)) != 0)
        return ltn_fail(err, LT_ERROR_NO_GPU, "no HIP device %d (hipSetDevice: HIP error %d)", device, r);
    return LT_OK;
}

static void leave(int32_t device, int previous) {
    if (previous != device)
        hip.set_device(previous);
}

int ltn_hip_load(const ltn_entry *e, int32_t device_index, void **function, ltn_error *err) {
    pthread_once(&hip_once, hip_load);
    if (hip_error[0])
        return ltn_fail(err, LT_ERROR_NO_GPU, "%s", hip_error);
    if (e->n_tensordesc > 0)
        return ltn_fail(err, LT_ERROR_UNSUPPORTED, "entry %s takes host tensor descriptors, which only the CUDA "
                        "driver encodes", e->key.s);
    if (e->num_ctas > 1) /* Triton launches those with hipDrvLaunchKernelEx and a cluster: not this launcher */
        return ltn_fail(err, LT_ERROR_UNSUPPORTED, "entry %s has num_ctas=%u; the HIP launcher launches one CTA a "
                        "program", e->key.s, e->num_ctas);
    int previous, status = enter(device_index, &previous, err);
    if (status != LT_OK)
        return status;
    void *module = NULL;
    hipError_t r;
    if ((r = hip.module_load_data(&module, e->binary)) != 0)
        status = hip_fail(err, r, "hipModuleLoadData");
    else if ((r = hip.module_get_function(function, module, e->name.s)) != 0)
        status = hip_fail(err, r, "hipModuleGetFunction");
    leave(device_index, previous);
    return status;
}

/* Scratch memory of bytes, aligned to align, on stream: LT_OK with *raw (to free) and *aligned (to pass). */
static int scratch_alloc(uint64_t bytes, uint32_t align, void *stream, void **raw, void **aligned, ltn_error *err) {
    uint64_t pad = align > 256 ? align - 1 : 0; /* the runtime's allocations are 256-byte aligned */
    hipError_t r = hip.malloc_async(raw, (size_t)(bytes + pad), stream);
    if (r != 0)
        return hip_fail(err, r, "hipMallocAsync");
    uintptr_t base = (uintptr_t)*raw, at = (base + align - 1) & ~(uintptr_t)(align - 1);
    if (at - base > pad) {
        hip.free_async(*raw, stream);
        return ltn_fail(err, LT_ERROR_CUDA, "hipMallocAsync returned %p, not %u-byte aligned", *raw, align);
    }
    *aligned = (void *)at;
    return LT_OK;
}

int ltn_hip_launch(const ltn_hip_launch_call *c, ltn_error *err) {
    if (c->allocate && (hip.malloc_async == NULL || hip.free_async == NULL))
        return ltn_fail(err, LT_ERROR_UNSUPPORTED, "kernel %s needs scratch memory, and this HIP runtime has no "
                        "hipMallocAsync (ROCm 5.3+): pass it with lt_kernel_launch_scratch", c->name);
    int previous, status = enter(c->device, &previous, err);
    if (status != LT_OK)
        return status;
    void *scratch[2] = {c->scratch[0], c->scratch[1]}, *own[2] = {NULL, NULL};
    for (int s = 0; s < 2 && status == LT_OK; s++)
        if (c->allocate && c->bytes[s] > 0)
            status = scratch_alloc(c->bytes[s], c->layout->scratch_align[s], c->stream, &own[s], &scratch[s], err);
    if (status == LT_OK) {
        void *params[LTN_MAX_PARAMS];
        ltn_params(c->layout, c->args, NULL, scratch, params);
        hipError_t r = hip.launch(c->function, c->grid[0], c->grid[1], c->grid[2], c->block, 1, 1, c->shared,
                                  c->stream, params, NULL);
        if (r != 0)
            status = hip_fail(err, r, "hipModuleLaunchKernel");
    }
    for (int s = 0; s < 2; s++) { /* stream-ordered: freed once the launch has run */
        hipError_t r = own[s] ? hip.free_async(own[s], c->stream) : 0;
        if (r != 0 && status == LT_OK)
            status = hip_fail(err, r, "hipFreeAsync");
    }
    leave(c->device, previous);
    return status;
}
