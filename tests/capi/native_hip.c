/*
 * native_hip: liblazytriton_native.so's loads and launches of AMD entries against the fake HIP runtime
 * (tests/fake_libhip.py, found as libamdhip64.so or .so.6 on LD_LIBRARY_PATH), one request a line on stdin,
 * one JSON object a line on stdout (tests/test_native_hip.py); the loop and the launch record are
 * tests/capi/native_requests.h's:
 *
 *   load KEY DEVICE CURRENT       the fake configured (its device CURRENT), then lt_kernel_load on DEVICE: its
 *                                 status, error, lt_kernel_info, the fake's module loads and device after
 *   launch GX GY GZ SCRATCH CURRENT N_SIZES SIZE... N_ARGS ARG...
 *                                 the fake configured with the parameter sizes (its device CURRENT), then one
 *                                 launch of the last kernel loaded: its status and error, the fake's 11 state
 *                                 counters, each parameter's bytes hipModuleLaunchKernel read (hex; null for
 *                                 NULL), the fake's allocations, its hipSetDevice calls and the device after
 *   fail CALL STATUS              the fake's call (fake_libhip.CALLS' number) fails so at the next request
 *
 * Without the fake on the path, a load prints its status and error only.
 */
#define _GNU_SOURCE
#include "native_requests.h"

static int fail_call = -1, fail_status;

static void configure(int n, const int *sizes, int current) {
    if (fake == NULL)
        return;
    ((int (*)(int, const int *))fake_fn("fake_configure"))(n, sizes);
    ((void (*)(int))fake_fn("fake_set_device"))(current);
    if (fail_call >= 0)
        ((void (*)(int, int))fake_fn("fake_fail"))(fail_call, fail_status);
    fail_call = -1;
}

/* ,"sets":[each hipSetDevice's device],"device":the fake's device now */
static void print_device(void) {
    print_records("fake_device_sets", 1, 64, "sets");
    printf(",\"device\":%d", ((int (*)(void))fake_fn("fake_device"))());
}

static void load(char *line) {
    static int64_t raw[64 * 6];
    static char names[64 * 256];
    char key[64] = {0};
    int device = 0, current = 0;
    sscanf(line, "%63s %d %d", key, &device, &current);
    configure(0, NULL, current);
    load_kernel(key, device);
    if (fake == NULL) { /* no HIP runtime on the path: the load's status and error only */
        printf("}\n");
        return;
    }
    int count = ((int (*)(int64_t *, char *))fake_fn("fake_loads"))(raw, names);
    printf(",\"loads\":[");
    for (int n = 0; n < count && n < 64; n++) {
        printf("%s{\"device\":%lld,\"head\":%lld,\"module\":%lld,\"function_of\":%lld,\"name\":", n ? "," : "",
               (long long)raw[6 * n], (long long)raw[6 * n + 1], (long long)raw[6 * n + 2],
               (long long)raw[6 * n + 3]);
        json_str(names + 256 * n);
        printf("}");
    }
    printf("]");
    print_device();
    printf("}\n");
}

static void launch(char *line) {
    launch_request r;
    if (read_launch(line, 1, &r) != 0)
        return;
    configure(r.n_sizes, r.sizes, atoi(r.own[0]));
    launch_kernel(&r, 11);
    print_device();
    printf("}\n");
}

static int other(const char *line) {
    if (sscanf(line, "fail %d %d", &fail_call, &fail_status) != 2)
        return 0;
    printf("{}\n");
    return 1;
}

int main(void) {
    /* the fake as the library finds it: the first of its names the loader resolves (none: loads only) */
    static const char *const names[] = {"libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"};
    for (size_t i = 0; fake == NULL && i < sizeof names / sizeof names[0]; i++)
        fake = dlopen(names[i], RTLD_NOW);
    return serve(load, launch, other);
}
