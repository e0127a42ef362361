/*
 * native_params: liblazytriton_native.so's launches against the fake libcuda (tests/fake_libcuda.py, loaded as
 * libcuda.so.1), one request a line on stdin, one JSON object a line on stdout (tests/test_native_tma.py); the
 * loop and the launch record are tests/capi/native_requests.h's:
 *
 *   load KEY                      lt_kernel_load on device 0: its status, error and lt_kernel_info
 *   launch GX GY GZ SCRATCH N_SIZES SIZE... N_ARGS ARG...
 *                                 the fake configured with the parameter sizes, then one launch of the last
 *                                 kernel loaded: its status and error, the fake's 13 state counters, each
 *                                 parameter's bytes its cuLaunchKernel read (hex; null for NULL), their
 *                                 addresses modulo 64, and the fake's allocation and encode records
 *
 *   fail_encode STATUS, fail_alloc STATUS
 *                                 the fake's cuTensorMapEncodeTiled, cuMemAllocAsync fail so (0: succeed)
 */
#define _GNU_SOURCE
#include "native_requests.h"

static int encode_status, alloc_status; /* the fake's failures for the next launches (fail_encode, fail_alloc) */

static void load(char *line) {
    char key[64] = {0};
    sscanf(line, "%63s", key);
    load_kernel(key, 0);
    printf("}\n");
}

static void launch(char *line) {
    launch_request r;
    if (read_launch(line, 0, &r) != 0)
        return;
    fake = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    ((int (*)(int, const int *, int))fake_fn("fake_configure"))(r.n_sizes, r.sizes, 0);
    ((void (*)(int))fake_fn("fake_set_encode_status"))(encode_status);
    ((void (*)(int))fake_fn("fake_set_alloc_status"))(alloc_status);
    launch_kernel(&r, 13);
    print_records("fake_encodes", 32, 16, "encodes");
    printf("}\n");
}

static int other(const char *line) {
    if (sscanf(line, "fail_encode %d", &encode_status) == 1 || sscanf(line, "fail_alloc %d", &alloc_status) == 1) {
        printf("{}\n");
        return 1;
    }
    return 0;
}

int main(void) { return serve(load, launch, other); }
