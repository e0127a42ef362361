/*
 * native_params: liblazytriton_native.so's launches against the fake libcuda (tests/fake_libcuda.py, loaded as
 * libcuda.so.1), one request a line on stdin, one JSON object a line on stdout (tests/test_native_tma.py):
 *
 *   load KEY                      lt_kernel_load on device 0: its status, error and lt_kernel_info
 *   launch GX GY GZ SCRATCH N_SIZES SIZE... N_ARGS ARG...
 *                                 the fake configured with the parameter sizes, then one launch of the last
 *                                 kernel loaded: its status and error, each parameter's bytes the fake's
 *                                 cuLaunchKernel read (hex; null for NULL), their addresses modulo 64, and the
 *                                 fake's encode and allocation records
 *
 *   fail_encode STATUS, fail_alloc STATUS
 *                                 the fake's cuTensorMapEncodeTiled, cuMemAllocAsync fail so (0: succeed)
 *
 * SCRATCH: "own" (lt_kernel_launch) or "given:G:P" (lt_kernel_launch_scratch with those addresses, 0 a NULL).
 * ARG: "i:V" an int64, "f:V" a float, "d:R:BASE:SIZES...:STRIDES..." an lt_tensor_descriptor of rank R.
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

typedef int (*configure_fn)(int, const int *, int);
typedef void (*read_fn)(unsigned char *, int *, long long *, int *);
typedef int (*records_fn)(int64_t *);

static lt_kernel *kernel;
static int encode_status, alloc_status; /* the fake's failures for the next launches (fail_encode, fail_alloc) */

static void print_info(void) {
    lt_kernel_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info, info.version = LT_KERNEL_INFO_VERSION;
    int status = lt_kernel_get_info(kernel, &info);
    printf(",\"info\":%d,\"name\":", status);
    json_str(info.name);
    printf(",\"kind\":");
    json_str(info.kind);
    printf(",\"n_args\":%u,\"n_descriptors\":%u,\"num_ctas\":%u,\"scratch\":[%u,%u,%u,%u],\"arg_types\":[",
           info.n_args, info.n_descriptors, info.num_ctas, info.global_scratch_size, info.global_scratch_align,
           info.profile_scratch_size, info.profile_scratch_align);
    for (uint32_t i = 0; i < info.n_args; i++) {
        printf("%s", i ? "," : "");
        json_str(info.arg_types[i]);
    }
    printf("]");
    /* a version 1 struct (64 bytes) is still filled, and nothing past it written */
    unsigned char v1[sizeof info + 16] __attribute__((aligned(8)));
    memset(v1, 0xAB, sizeof v1);
    lt_kernel_info *old = (lt_kernel_info *)(void *)v1;
    old->struct_size = 64, old->version = 1;
    status = lt_kernel_get_info(kernel, old);
    int untouched = 1;
    for (size_t i = 64; i < sizeof v1; i++)
        untouched &= v1[i] == 0xAB;
    printf(",\"info_v1\":%d,\"info_v1_n_args\":%u,\"info_v1_untouched\":%d", status, old->n_args, untouched);
}

static void print_records(records_fn get, int width, int n_max, const char *name) {
    static int64_t raw[64 * 32];
    int count = get(raw);
    printf(",\"%s\":[", name);
    int first = count > n_max ? count - n_max : 0;
    for (int n = first; n < count; n++) {
        printf("%s[", n > first ? "," : "");
        for (int j = 0; j < width; j++)
            printf("%s%lld", j ? "," : "", (long long)raw[width * (n % n_max) + j]);
        printf("]");
    }
    printf("]");
}

/* One argument token into its storage: 0, or -1 for a token it cannot read. */
static int parse_arg(char *token, int64_t *value, float *number, lt_tensor_descriptor *desc, void **arg) {
    char *save = NULL, *kind = strtok_r(token, ":", &save);
    if (kind == NULL)
        return -1;
    if (strcmp(kind, "i") == 0 || strcmp(kind, "f") == 0) {
        char *text = strtok_r(NULL, ":", &save);
        if (text == NULL)
            return -1;
        if (kind[0] == 'i')
            *value = strtoll(text, NULL, 0), *arg = value;
        else
            *number = strtof(text, NULL), *arg = number;
        return 0;
    }
    char *text = strtok_r(NULL, ":", &save);
    int rank = text ? atoi(text) : 0;
    if (strcmp(kind, "d") != 0 || rank < 1 || rank > 5 || (text = strtok_r(NULL, ":", &save)) == NULL)
        return -1;
    memset(desc, 0, sizeof *desc);
    desc->base = (void *)(uintptr_t)strtoull(text, NULL, 0);
    for (int j = 0; j < 2 * rank; j++) {
        if ((text = strtok_r(NULL, ":", &save)) == NULL)
            return -1;
        (j < rank ? desc->sizes : desc->strides)[j % rank] = strtoll(text, NULL, 0);
    }
    *arg = desc;
    return 0;
}

static void launch(char *line) {
    static int64_t values[MAX];
    static float numbers[MAX];
    static lt_tensor_descriptor descs[MAX];
    static void *args[MAX];
    static int sizes[MAX];
    static unsigned char seen[128 * 1024];
    int nulls[1024], aligns[1024];
    long long state[16];
    char *save = NULL, *mode;
    uint32_t grid[3];
    for (int i = 0; i < 3; i++)
        grid[i] = (uint32_t)strtoul(strtok_r(i ? NULL : line, " \n", &save), NULL, 0);
    mode = strtok_r(NULL, " \n", &save);
    int n_sizes = atoi(strtok_r(NULL, " \n", &save));
    for (int i = 0; i < n_sizes && i < MAX; i++)
        sizes[i] = atoi(strtok_r(NULL, " \n", &save));
    int n_args = atoi(strtok_r(NULL, " \n", &save));
    for (int i = 0; i < n_args && i < MAX; i++)
        if (parse_arg(strtok_r(NULL, " \n", &save), &values[i], &numbers[i], &descs[i], &args[i]) != 0) {
            printf("{\"bad_request\":%d}\n", i);
            return;
        }
    void *fake = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    configure_fn configure = (configure_fn)dlsym(fake, "fake_configure");
    read_fn read = (read_fn)dlsym(fake, "fake_read");
    configure(n_sizes, sizes, 0);
    ((void (*)(int))dlsym(fake, "fake_set_encode_status"))(encode_status);
    ((void (*)(int))dlsym(fake, "fake_set_alloc_status"))(alloc_status);
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
    read(seen, nulls, state, aligns);
    printf(",\"launches\":%lld,\"params\":[", state[0]);
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
    printf("],\"aligns\":[");
    for (int i = 0; i < n_sizes; i++)
        printf("%s%d", i ? "," : "", aligns[i]);
    printf("]");
    print_records((records_fn)dlsym(fake, "fake_encodes"), 32, 16, "encodes");
    print_records((records_fn)dlsym(fake, "fake_allocations"), 6, 64, "allocations");
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
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "load ", 5) == 0) {
            char key[64] = {0};
            sscanf(line + 5, "%63s", key);
            lt_kernel_destroy(kernel);
            kernel = NULL;
            status = lt_kernel_load(key, NULL, 0, &kernel);
            printf("{\"load\":%d,\"error\":", status);
            json_str(status ? lt_native_last_error() : "");
            if (status == 0)
                print_info();
            printf("}\n");
        } else if (sscanf(line, "fail_encode %d", &encode_status) == 1 ||
                   sscanf(line, "fail_alloc %d", &alloc_status) == 1) {
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
