/*
 * native_launch: a C program served from an image by liblazytriton_native.so, against the fake libcuda
 * (tests/fake_libcuda.py, loaded as libcuda.so.1). Prints one JSON object: the kernel loaded, what the
 * fake's cuLaunchKernel saw, the miss of another key, and whether a libpython was mapped into the process.
 *
 *   native_launch KEY VARIANT MISSING_KEY MISSING_VARIANT     (images: LAZYTRITON_IMAGES)
 *
 * It also reports the time from lt_open_images to the kernel's load (open_load_us) and of its first launch.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lazytriton_native.h"
#include "native_json.h"

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int python_mapped(void) {
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[4096];
    int found = 0;
    while (maps && fgets(line, sizeof line, maps))
        found |= strstr(line, "libpython") != NULL;
    if (maps)
        fclose(maps);
    return found;
}


int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: native_launch KEY VARIANT MISSING_KEY MISSING_VARIANT\n");
        return 2;
    }
    double start = now_us();
    int status = lt_open_images(NULL);
    if (status != 0) {
        printf("{\"open\":%d,\"error\":", status);
        json_str(lt_native_last_error());
        printf("}\n");
        return 0;
    }
    lt_kernel *kernel;
    status = lt_kernel_load(argv[1], argv[2], 0, &kernel);
    double loaded = now_us();
    printf("{\"open\":0,\"images\":%d,\"load\":%d,\"open_load_us\":%.1f", lt_images_count(), status,
           loaded - start);
    if (status != 0) {
        printf(",\"error\":");
        json_str(lt_native_last_error());
    } else {
        lt_kernel_info info;
        memset(&info, 0, sizeof info);
        info.struct_size = sizeof info, info.version = LT_KERNEL_INFO_VERSION;
        lt_kernel_get_info(kernel, &info);
        printf(",\"name\":");
        json_str(info.name);
        printf(",\"variant\":");
        json_str(info.variant);
        printf(",\"n_args\":%u,\"block_threads\":%u,\"shared\":%u", info.n_args, info.block_threads,
               info.shared_bytes);
        /* The fake records 8 bytes behind each parameter pointer, hidden ones included. */
        void *fake = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        int (*configure)(int, const int *, int) = fake ? (int (*)(int, const int *, int))dlsym(fake, "fake_configure") : NULL;
        void (*read)(unsigned char *, int *, long long *, int *) =
            fake ? (void (*)(unsigned char *, int *, long long *, int *))dlsym(fake, "fake_read") : NULL;
        if (configure == NULL || read == NULL) {
            printf(",\"fake\":false}\n");
            return 1;
        }
        int sizes[300];
        unsigned long long values[300];
        void *args[300];
        for (unsigned i = 0; i < info.n_args + 2; i++)
            sizes[i] = 8, values[i] = 0x1111ull * (i + 1), args[i] = &values[i];
        configure((int)info.n_args + 2, sizes, 0);
        uint32_t grid[3] = {7, 5, 3};
        double before = now_us();
        status = lt_kernel_launch(kernel, grid, (void *)0x5EA, args, info.n_args);
        printf(",\"launch\":%d,\"launch_us\":%.1f", status, now_us() - before);
        print_fake_launch(read, (int)info.n_args + 2, sizes);
        int wrong = lt_kernel_launch(kernel, grid, NULL, args, info.n_args + 1);
        printf(",\"wrong_args\":%d", wrong);
        lt_kernel_destroy(kernel);
    }
    lt_kernel *missing;
    status = lt_kernel_load(argv[3], argv[4], 0, &missing);
    printf(",\"miss\":%d,\"miss_error\":", status);
    json_str(lt_native_last_error());
    printf(",\"python\":%d}\n", python_mapped());
    return 0;
}
