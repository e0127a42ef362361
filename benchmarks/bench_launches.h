/* bench_launches.h: a C API call's kernels launched bare, as the benches' floor: the driver's cuLaunchKernel, and
   cuLaunchKernelEx with programmatic stream serialization for a programmatic dependent (where the driver is 12.3 or
   later, as capi/lazytriton.c decides), each launch's configuration and parameter array built once. */
#ifndef BENCH_LAUNCHES_H
#define BENCH_LAUNCHES_H

#include <dlfcn.h>
#include <string.h>

/* cuda.h's CUlaunchAttribute and CUlaunchConfig (capi/lazytriton.c's lt__CUlaunchAttribute/lt__CUlaunchConfig). */
typedef struct {
    int id;
    int pad;
    union { char bytes[64]; int programmatic; unsigned long long align; } value;
} bench_attribute;
typedef struct {
    unsigned int grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
    void *stream;
    bench_attribute *attrs;
    unsigned int n_attrs;
} bench_config;
enum { BENCH_ATTRIBUTE_PROGRAMMATIC = 6, BENCH_PROGRAMMATIC_DRIVER = 12030 };

/* One launch: what cuLaunchKernel takes (block: x threads), dependent 1 for a programmatic dependent. */
typedef struct {
    void *function;
    unsigned int grid[3], block, shared;
    int dependent;
    void **params;
} bench_launch;

static struct {
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                  void **);
    int (*launch_ex)(const bench_config *, void *, void **, void **); /* NULL: a driver before 12.3 */
    bench_attribute attribute;
    bench_config configs[8];
} bench_cu;

/* The launch entry points from libcuda's handle lib: 0, or -1 without cuLaunchKernel. */
static int bench_launches_open(void *lib) {
    int (*driver_version)(int *) = NULL;
    int version = 0;
    *(void **)&bench_cu.launch = dlsym(lib, "cuLaunchKernel");
    *(void **)&driver_version = dlsym(lib, "cuDriverGetVersion");
    bench_cu.launch_ex = NULL;
    if (driver_version != NULL && driver_version(&version) == 0 && version >= BENCH_PROGRAMMATIC_DRIVER)
        *(void **)&bench_cu.launch_ex = dlsym(lib, "cuLaunchKernelEx");
    memset(&bench_cu.attribute, 0, sizeof bench_cu.attribute);
    bench_cu.attribute.id = BENCH_ATTRIBUTE_PROGRAMMATIC, bench_cu.attribute.value.programmatic = 1;
    return bench_cu.launch != NULL ? 0 : -1;
}

/* Build the configurations of n launches (at most 8) on stream once: 0, or -1 for too many. */
static int bench_launches_prepare(const bench_launch *launches, int n, void *stream) {
    if (n < 0 || n > 8)
        return -1;
    for (int i = 0; i < n; i++) {
        const bench_launch *l = &launches[i];
        bench_config c = {l->grid[0], l->grid[1], l->grid[2], l->block, 1, 1, l->shared, stream,
                          &bench_cu.attribute, 1};
        bench_cu.configs[i] = c;
    }
    return 0;
}

/* The n launches prepared, in order: 0, or the first launch's nonzero status. */
static int bench_launches_run(const bench_launch *launches, int n) {
    int status;
    for (int i = 0; i < n; i++) {
        const bench_launch *l = &launches[i];
        const bench_config *c = &bench_cu.configs[i];
        status = l->dependent && bench_cu.launch_ex != NULL
                     ? bench_cu.launch_ex(c, l->function, l->params, NULL)
                     : bench_cu.launch(l->function, c->grid_x, c->grid_y, c->grid_z, c->block_x, 1, 1, c->shared,
                                       c->stream, l->params, NULL);
        if (status != 0)
            return status;
    }
    return 0;
}

#endif
