/*
 * native_dump: the test driver of the native core's readers (capi/native).
 *
 *   native_dump dump IMAGE DIR   every entry of IMAGE: one JSON line of metadata each on stdout, its binary
 *                                written to DIR/<key>.bin
 *   native_dump serve            reads requests from stdin, one a line, and answers each with one JSON line:
 *                                "image PATH": open it, read every key in index order (and an absent key);
 *                                "entry PATH KEY": decode the file as an entry under KEY ("-": any key)
 *
 * Statuses are ltn_status values (0 ok, 1 absent, 2 damaged, 3 io, 4 nomem, 5 argument).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lt_native.h"

static void json_str(FILE *out, const char *s, size_t n) {
    fputc('"', out);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            fprintf(out, "\\%c", c);
        else if (c < 0x20)
            fprintf(out, "\\u%04x", c);
        else
            fputc(c, out);
    }
    fputc('"', out);
}

static void json_field(FILE *out, const char *name, const ltn_str *s) {
    fprintf(out, ",\"%s\":", name);
    json_str(out, s->s, s->len);
}

static void json_list(FILE *out, const char *name, const ltn_str *items, uint32_t n) {
    fprintf(out, ",\"%s\":[", name);
    for (uint32_t i = 0; i < n; i++) {
        if (i)
            fputc(',', out);
        json_str(out, items[i].s, items[i].len);
    }
    fputc(']', out);
}

static void print_entry(FILE *out, const ltn_entry *e) {
    fprintf(out, "{\"format_version\":%u", e->format_version);
    json_field(out, "key", &e->key);
    json_field(out, "variant", &e->variant);
    json_field(out, "target", &e->target);
    json_field(out, "kind", &e->kind);
    json_field(out, "name", &e->name);
    fprintf(out, ",\"binary_size\":%zu,\"num_warps\":%u,\"num_ctas\":%u,\"warp_size\":%u,\"shared\":%u", e->binary_size,
            e->num_warps, e->num_ctas, e->warp_size, e->shared);
    fprintf(out, ",\"global_scratch_size\":%u,\"global_scratch_align\":%u,\"profile_scratch_size\":%u"
            ",\"profile_scratch_align\":%u", e->global_scratch_size, e->global_scratch_align,
            e->profile_scratch_size, e->profile_scratch_align);
    json_list(out, "arg_types", e->arg_types, e->n_arg_types);
    json_list(out, "hidden_args", e->hidden_args, e->n_hidden_args);
    fprintf(out, ",\"provenance\":{\"created\":%.17g,\"launch_abi\":%u", e->created, e->launch_abi);
    json_field(out, "compiler", &e->compiler);
    json_field(out, "compiler_version", &e->compiler_version);
    json_field(out, "source_fingerprint", &e->source_fingerprint);
    fprintf(out, "},\"tensordesc_meta\":[");
    for (uint32_t i = 0; i < e->n_tensordesc; i++) {
        const ltn_tensordesc *m = &e->tensordesc[i];
        fprintf(out, "%s{\"swizzle\":%u,\"elem_size\":%u,\"elem_type\":%u,\"block_size\":[", i ? "," : "",
                m->swizzle, m->elem_size, m->elem_type);
        for (uint32_t k = 0; k < m->rank; k++)
            fprintf(out, "%s%u", k ? "," : "", m->block_size[k]);
        fprintf(out, "]}");
    }
    fprintf(out, "]}");
}

static int dump(const char *path, const char *dir) {
    ltn_image *image;
    ltn_error err;
    int status = ltn_image_open(path, &image, &err);
    if (status != LTN_OK) {
        fprintf(stderr, "open: %d %s\n", status, err.message);
        return 1;
    }
    int failed = 0;
    for (uint32_t i = 0; i < ltn_image_count(image); i++) {
        char key[33], file[4096];
        ltn_entry e;
        ltn_image_key_at(image, i, key);
        if ((status = ltn_image_read(image, key, &e, &err)) != LTN_OK) {
            fprintf(stderr, "read %s: %d %s\n", key, status, err.message);
            failed = 1;
            continue;
        }
        snprintf(file, sizeof file, "%s/%s.bin", dir, key);
        FILE *f = fopen(file, "wb");
        if (f == NULL || fwrite(e.binary, 1, e.binary_size, f) != e.binary_size || fclose(f) != 0) {
            fprintf(stderr, "cannot write %s\n", file);
            return 1;
        }
        print_entry(stdout, &e);
        fputc('\n', stdout);
        ltn_entry_free(&e);
    }
    ltn_image_close(image);
    return failed;
}

static void serve_image(const char *path) {
    ltn_image *image;
    ltn_error err;
    int status = ltn_image_open(path, &image, &err);
    printf("{\"open\":%d", status);
    if (status != LTN_OK) {
        printf(",\"error\":");
        json_str(stdout, err.message, strlen(err.message));
        printf("}\n");
        return;
    }
    printf(",\"count\":%u,\"codec\":%u,\"misordered\":%u,\"reads\":[", ltn_image_count(image),
           ltn_image_codec(image), ltn_image_misordered(image));
    for (uint32_t i = 0; i < ltn_image_count(image); i++) {
        char key[33];
        ltn_entry e;
        ltn_image_key_at(image, i, key);
        int found = ltn_image_contains(image, key, &err);
        status = ltn_image_read(image, key, &e, &err);
        if ((found == LTN_ABSENT) != (status == LTN_ABSENT))
            status = -1; /* contains and read disagree */
        printf("%s%d", i ? "," : "", status);
        ltn_entry_free(&e);
    }
    ltn_entry e;
    printf("],\"absent\":%d}\n", ltn_image_read(image, "00000000000000000000000000000000", &e, &err));
    ltn_image_close(image);
}

static void serve_entry(const char *path, const char *key) {
    FILE *f = fopen(path, "rb");
    static uint8_t data[1 << 20];
    size_t n = f ? fread(data, 1, sizeof data, f) : 0;
    if (f)
        fclose(f);
    ltn_entry e;
    ltn_error err;
    int status = ltn_entry_decode(data, n, strcmp(key, "-") ? key : NULL, &e, &err);
    printf("{\"status\":%d", status);
    if (status == LTN_OK) {
        printf(",\"entry\":");
        print_entry(stdout, &e);
        ltn_entry_free(&e);
    } else {
        printf(",\"error\":");
        json_str(stdout, err.message, strlen(err.message));
    }
    printf("}\n");
}

static int serve(void) {
    char line[8192];
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        if (strncmp(line, "image ", 6) == 0)
            serve_image(line + 6);
        else if (strncmp(line, "entry ", 6) == 0) {
            char *key = strrchr(line, ' ');
            *key++ = '\0';
            serve_entry(line + 6, key);
        } else
            printf("{\"bad request\":true}\n");
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "dump") == 0)
        return dump(argv[2], argv[3]);
    if (argc == 2 && strcmp(argv[1], "serve") == 0)
        return serve();
    fprintf(stderr, "usage: native_dump dump IMAGE DIR | native_dump serve\n");
    return 2;
}
