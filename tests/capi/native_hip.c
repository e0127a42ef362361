/*
 * native_hip: liblazytriton_native.so's loads and launches of AMD entries against the fake HIP runtime
 * (tests/fake_libhip.py, found as libamdhip64.so or .so.6 on LD_LIBRARY_PATH), one request a line on stdin,
 * one JSON object a line on stdout (tests/test_native_hip.py):
 *
 *   load KEY DEVICE CURRENT       the fake configured (its device CURRENT), then lt_kernel_load on DEVICE: its
 *                                 status, error, lt_kernel_info, the fake's module loads and device after
 *   launch GX GY GZ SCRATCH CURRENT N_SIZES SIZE... N_ARGS ARG...
 *                                 the fake configured with the parameter sizes (its device CURRENT), then one
 *                                 launch of the last kernel loaded: its status and error, each parameter's bytes
 *                                 hipModuleLaunchKernel read (hex; null for NULL), the launch's state, the fake's
 *                                 allocations, its hipSetDevice calls and the device after
 *   fail CALL STATUS              the fake's call (fake_libhip.CALLS' number) fails so at the next request
 *
 * Without the fake on the path, a load prints its status and error only.
 *
 * SCRATCH: "own" (lt_kernel_launch) or "given:G:P" (lt_kernel_launch_scratch with those addresses, 0 a NULL).
 * ARG: "i:V" an int64, "f:V" a float.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lazytriton_native.h"
#include "native_json.h"

#define MAX 512

static lt_kernel *kernel;
static void *fake;
static int fail_call = -1, fail_status;

static void *fake_fn(const char *name) { return dlsym(fake, name); }

static void configure(int n, const int *sizes, int current) {
    if (fake == NULL)
        return;
    ((int (*)(int, const int *))fake_fn("fake_configure"))(n, sizes);
    ((void (*)(int))fake_fn("fake_set_device"))(current);
    if (fail_call >= 0)
        ((void (*)(int, int))fake_fn("fake_fail"))(fail_call, fail_status);
    fail_call = -1;
}

static void print_records(const char *symbol, int width, const char *name) {
    static int64_t raw[64 * 8];
    int count = ((int (*)(int64_t *))fake_fn(symbol))(raw);
    printf(",\"%s\":[", name);
    int first = count > 64 ? count - 64 : 0;
    for (int n = first; n < count; n++) {
        printf("%s[", n > first ? "," : "");
        for (int j = 0; j < width; j++)
            printf("%s%lld", j ? "," : "", (long long)raw[width * (n % 64) + j]);
        printf("]");
    }
    printf("],\"device\":%d", ((int (*)(void))fake_fn("fake_device"))());
}

static void print_info(void) {
    lt_kernel_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info, info.version = LT_KERNEL_INFO_VERSION;
    int status = lt_kernel_get_info(kernel, &info);
    printf(",\"info\":%d,\"name\":", status);
    json_str(info.name);
    printf(",\"kind\":");
    json_str(info.kind);
    printf(",\"n_args\":%u,\"block_threads\":%u,\"shared\":%u,\"scratch\":[%u,%u,%u,%u]", info.n_args,
           info.block_threads, info.shared_bytes, info.global_scratch_size, info.global_scratch_align,
           info.profile_scratch_size, info.profile_scratch_align);
}

static void load(char *line) {
    static int64_t raw[64 * 6];
    static char names[64 * 256];
    char key[64] = {0};
    int device = 0, current = 0;
    sscanf(line, "%63s %d %d", key, &device, &current);
    configure(0, NULL, current);
    lt_kernel_destroy(kernel);
    kernel = NULL;
    int status = lt_kernel_load(key, NULL, device, &kernel);
    printf("{\"load\":%d,\"error\":", status);
    json_str(status ? lt_native_last_error() : "");
    if (status == 0)
        print_info();
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
    print_records("fake_device_sets", 1, "sets");
    printf("}\n");
}

static void launch(char *line) {
    static int64_t values[MAX];
    static float numbers[MAX];
    static void *args[MAX];
    static int sizes[MAX];
    static unsigned char seen[128 * 1024];
    int nulls[1024];
    int64_t state[16];
    char *save = NULL;
    uint32_t grid[3];
    for (int i = 0; i < 3; i++)
        grid[i] = (uint32_t)strtoul(strtok_r(i ? NULL : line, " \n", &save), NULL, 0);
    char *mode = strtok_r(NULL, " \n", &save);
    int current = atoi(strtok_r(NULL, " \n", &save));
    int n_sizes = atoi(strtok_r(NULL, " \n", &save));
    for (int i = 0; i < n_sizes && i < MAX; i++)
        sizes[i] = atoi(strtok_r(NULL, " \n", &save));
    int n_args = atoi(strtok_r(NULL, " \n", &save));
    for (int i = 0; i < n_args && i < MAX; i++) {
        char *token = strtok_r(NULL, " \n", &save);
        if (token == NULL || (token[0] != 'i' && token[0] != 'f') || token[1] != ':') {
            printf("{\"bad_request\":%d}\n", i);
            return;
        }
        if (token[0] == 'i')
            values[i] = strtoll(token + 2, NULL, 0), args[i] = &values[i];
        else
            numbers[i] = strtof(token + 2, NULL), args[i] = &numbers[i];
    }
    configure(n_sizes, sizes, current);
    int status;
    if (strcmp(mode, "own") == 0) {
        status = lt_kernel_launch(kernel, grid, (void *)0x5EA, args, (size_t)n_args);
    } else {
        char *at = NULL;
        strtok_r(mode, ":", &at);
        void *given[2];
        for (int s = 0; s < 2; s++)
            given[s] = (void *)(uintptr_t)strtoull(strtok_r(NULL, ":", &at), NULL, 0);
        status = lt_kernel_launch_scratch(kernel, grid, (void *)0x5EA, args, (size_t)n_args, given);
    }
    printf("{\"launch\":%d,\"error\":", status);
    json_str(status ? lt_native_last_error() : "");
    ((void (*)(unsigned char *, int *, int64_t *))fake_fn("fake_read"))(seen, nulls, state);
    printf(",\"state\":[");
    for (int i = 0; i < 11; i++)
        printf("%s%lld", i ? "," : "", (long long)state[i]);
    printf("],\"params\":[");
    for (int i = 0; i < n_sizes; i++) {
        printf("%s", i ? "," : "");
        if (nulls[i]) {
            printf("null");
            continue;
        }
        putchar('"');
        for (int b = 0; b < sizes[i]; b++)
            printf("%02x", seen[128 * i + b]);
        putchar('"');
    }
    printf("]");
    print_records("fake_allocations", 6, "allocations");
    print_records("fake_device_sets", 1, "sets");
    printf("}\n");
}

int main(void) {
    static char line[1 << 16];
    (void)print_fake_launch; /* native_json.h's; this program prints the bytes themselves */
    int status = lt_open_images(NULL);
    if (status != 0) {
        printf("{\"open\":%d,\"error\":", status);
        json_str(lt_native_last_error());
        printf("}\n");
        return 0;
    }
    /* the fake as the library finds it: the first of its names the loader resolves (none: loads only) */
    static const char *const names[] = {"libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"};
    for (size_t i = 0; fake == NULL && i < sizeof names / sizeof names[0]; i++)
        fake = dlopen(names[i], RTLD_NOW);
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "load ", 5) == 0) {
            load(line + 5);
        } else if (sscanf(line, "fail %d %d", &fail_call, &fail_status) == 2) {
            printf("{}\n");
        } else if (strncmp(line, "launch ", 7) == 0 && kernel != NULL) {
            launch(line + 7);
        } else {
            printf("{\"bad_request\":-1}\n");
        }
        fflush(stdout);
    }
    lt_kernel_destroy(kernel);
    return 0;
}
