/* cuda_driver.h: the CUDA driver entry points the C API's test and benchmark programs call on device memory
   (tests/capi/capi_check.c, benchmarks/capi_bench.c and native_first_launch.c): libcuda.so.1 opened with dlopen,
   so a program builds with no CUDA toolkit, and device 0's primary context made current. */
#ifndef CUDA_DRIVER_H
#define CUDA_DRIVER_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    int (*init)(unsigned);
    int (*device_get)(int *, int);
    int (*primary_ctx_retain)(void **, int);
    int (*ctx_set_current)(void *);
    int (*mem_alloc)(uint64_t *, size_t);
    int (*htod)(uint64_t, const void *, size_t);
    int (*dtoh)(void *, uint64_t, size_t);
    int (*ctx_synchronize)(void);
} cuda_driver;

/* libcuda.so.1's handle (a program finds its other functions there), every entry point of *cu found in it; or NULL
   with *missing naming what failed: the library (dlerror's message) or the first function it lacks. */
static void *cuda_driver_open(cuda_driver *cu, const char **missing) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        *missing = dlerror();
        return NULL;
    }
    struct {
        void **slot;
        const char *name;
    } symbols[] = {
        {(void **)&cu->init, "cuInit"}, {(void **)&cu->device_get, "cuDeviceGet"},
        {(void **)&cu->primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu->ctx_set_current, "cuCtxSetCurrent"}, {(void **)&cu->mem_alloc, "cuMemAlloc_v2"},
        {(void **)&cu->htod, "cuMemcpyHtoD_v2"}, {(void **)&cu->dtoh, "cuMemcpyDtoH_v2"},
        {(void **)&cu->ctx_synchronize, "cuCtxSynchronize"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++)
        if ((*symbols[i].slot = dlsym(lib, symbols[i].name)) == NULL) {
            *missing = symbols[i].name;
            dlclose(lib);
            return NULL;
        }
    return lib;
}

/* 0 with device 0's primary context current on this thread, else the status of the driver call that failed. */
static int cuda_context_current(const cuda_driver *cu) {
    int device, r;
    void *context;
    if ((r = cu->init(0)) != 0 || (r = cu->device_get(&device, 0)) != 0 ||
        (r = cu->primary_ctx_retain(&context, device)) != 0)
        return r;
    return cu->ctx_set_current(context);
}

#endif
