/* native_requests.h: the request loop of the native launcher's test programs against a fake driver
   (tests/capi/native_params.c: the fake libcuda; native_hip.c: the fake HIP runtime; both fakes share
   tests/fake_driver_core.py's record of a launch). One request a line on stdin, one JSON object a line on stdout:

     load KEY ...                  lt_kernel_load: its status, error and lt_kernel_info (load_kernel), then what
                                   the program adds
     launch GX GY GZ SCRATCH OWN... N_SIZES SIZE... N_ARGS ARG...
                                   the fake configured with the parameter sizes (the program's configure, given
                                   its OWN tokens), then one launch of the last kernel loaded: its status and
                                   error, the fake's state counters, each parameter's bytes it read (hex; null for
                                   NULL) and their addresses modulo 64, its allocations, then what the program adds
     anything else                 the program's own requests, or {"bad_request":-1}

   SCRATCH: "own" (lt_kernel_launch) or "given:G:P" (lt_kernel_launch_scratch with those addresses, 0 a NULL).
   ARG: "i:V" an int64, "f:V" a float, "d:R:BASE:SIZES...:STRIDES..." an lt_tensor_descriptor of rank R.
   A bad launch request answers {"bad_request":I}, I the argument it could not read. */
#ifndef NATIVE_REQUESTS_H
#define NATIVE_REQUESTS_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lazytriton_native.h"
#include "native_json.h"

#define MAX_PARAMS 512
#define MAX_OWN 4

static lt_kernel *kernel; /* the last kernel loaded */
static void *fake;        /* the fake driver the library loaded (each program opens it its way) */

/* A launch request read: the grid, the scratch mode, the program's own tokens, the sizes and the arguments. */
typedef struct {
    uint32_t grid[3];
    char *scratch;
    char *own[MAX_OWN];
    int n_sizes, sizes[MAX_PARAMS];
    int n_args;
    void *args[MAX_PARAMS];
} launch_request;

static void *fake_fn(const char *name) { return dlsym(fake, name); }

static void print_info(void) {
    lt_kernel_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info, info.version = LT_KERNEL_INFO_VERSION;
    int status = lt_kernel_get_info(kernel, &info);
    printf(",\"info\":%d,\"name\":", status);
    json_str(info.name);
    printf(",\"kind\":");
    json_str(info.kind);
    printf(",\"n_args\":%u,\"n_descriptors\":%u,\"num_ctas\":%u,\"block_threads\":%u,\"shared\":%u,"
           "\"scratch\":[%u,%u,%u,%u],\"arg_types\":[",
           info.n_args, info.n_descriptors, info.num_ctas, info.block_threads, info.shared_bytes,
           info.global_scratch_size, info.global_scratch_align, info.profile_scratch_size,
           info.profile_scratch_align);
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

/* {"load":STATUS,"error":...[,info]: the last kernel replaced by KEY's on device (the object left open). */
static int load_kernel(const char *key, int device) {
    lt_kernel_destroy(kernel);
    kernel = NULL;
    int status = lt_kernel_load(key, NULL, device, &kernel);
    printf("{\"load\":%d,\"error\":", status);
    json_str(status ? lt_native_last_error() : "");
    if (status == 0)
        print_info();
    return status;
}

/* ,"NAME":[the last n_max of the fake's records of width int64s, oldest first] from the fake's SYMBOL. */
static void print_records(const char *symbol, int width, int n_max, const char *name) {
    static int64_t raw[64 * 32];
    int count = ((int (*)(int64_t *))fake_fn(symbol))(raw);
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
    char *save = NULL, *kind = token ? strtok_r(token, ":", &save) : NULL;
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

/* "GX GY GZ SCRATCH OWN... N_SIZES SIZE... N_ARGS ARG..." (n_own OWN tokens) into r: 0, or -1 after printing
   {"bad_request":I}. The arguments' storage lives until the next request. */
static int read_launch(char *line, int n_own, launch_request *r) {
    static int64_t values[MAX_PARAMS];
    static float numbers[MAX_PARAMS];
    static lt_tensor_descriptor descs[MAX_PARAMS];
    char *save = NULL;
    for (int i = 0; i < 3; i++)
        r->grid[i] = (uint32_t)strtoul(strtok_r(i ? NULL : line, " \n", &save), NULL, 0);
    r->scratch = strtok_r(NULL, " \n", &save);
    for (int i = 0; i < n_own && i < MAX_OWN; i++)
        r->own[i] = strtok_r(NULL, " \n", &save);
    r->n_sizes = atoi(strtok_r(NULL, " \n", &save));
    for (int i = 0; i < r->n_sizes && i < MAX_PARAMS; i++)
        r->sizes[i] = atoi(strtok_r(NULL, " \n", &save));
    r->n_args = atoi(strtok_r(NULL, " \n", &save));
    for (int i = 0; i < r->n_args && i < MAX_PARAMS; i++)
        if (parse_arg(strtok_r(NULL, " \n", &save), &values[i], &numbers[i], &descs[i], &r->args[i]) != 0) {
            printf("{\"bad_request\":%d}\n", i);
            return -1;
        }
    return 0;
}

/* The launch r asks of the last kernel loaded, and the fake's record of it: {"launch":STATUS,"error":...,
   "state":[the first n_state counters],"launches":N,"params":[...],"aligns":[...],"allocations":[...] (the
   object left open). */
static void launch_kernel(launch_request *r, int n_state) {
    static unsigned char seen[128 * 1024];
    int nulls[1024], aligns[1024];
    long long state[16];
    int status;
    if (strcmp(r->scratch, "own") == 0) {
        status = lt_kernel_launch(kernel, r->grid, (void *)0x5EA, r->args, (size_t)r->n_args);
    } else {
        char *at = NULL;
        strtok_r(r->scratch, ":", &at);
        void *given[2];
        for (int s = 0; s < 2; s++)
            given[s] = (void *)(uintptr_t)strtoull(strtok_r(NULL, ":", &at), NULL, 0);
        status = lt_kernel_launch_scratch(kernel, r->grid, (void *)0x5EA, r->args, (size_t)r->n_args, given);
    }
    printf("{\"launch\":%d,\"error\":", status);
    json_str(status ? lt_native_last_error() : "");
    ((fake_read_fn)fake_fn("fake_read"))(seen, nulls, state, aligns);
    printf(",\"state\":[");
    for (int i = 0; i < n_state; i++)
        printf("%s%lld", i ? "," : "", state[i]);
    printf("],\"launches\":%lld,\"params\":[", state[0]);
    for (int i = 0; i < r->n_sizes; i++) {
        printf("%s", i ? "," : "");
        if (nulls[i]) {
            printf("null");
            continue;
        }
        putchar('"');
        for (int b = 0; b < r->sizes[i]; b++)
            printf("%02x", seen[128 * i + b]);
        putchar('"');
    }
    printf("],\"aligns\":[");
    for (int i = 0; i < r->n_sizes; i++)
        printf("%s%d", i ? "," : "", aligns[i]);
    printf("]");
    print_records("fake_allocations", 6, 64, "allocations");
}

/* The request loop: "load " lines to load, "launch " lines (a kernel loaded) to launch, any other to other (0: a
   bad request). Without images it prints {"open":STATUS,"error":...} and ends. */
static int serve(void (*load)(char *rest), void (*launch)(char *rest), int (*other)(const char *line)) {
    static char line[1 << 16];
    (void)print_fake_launch; /* native_json.h's; these programs print the bytes themselves */
    int status = lt_open_images(NULL);
    if (status != 0) {
        printf("{\"open\":%d,\"error\":", status);
        json_str(lt_native_last_error());
        printf("}\n");
        return 0;
    }
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "load ", 5) == 0)
            load(line + 5);
        else if (strncmp(line, "launch ", 7) == 0 && kernel != NULL)
            launch(line + 7);
        else if (!other(line))
            printf("{\"bad_request\":-1}\n");
        fflush(stdout);
    }
    lt_kernel_destroy(kernel);
    return 0;
}

#endif
