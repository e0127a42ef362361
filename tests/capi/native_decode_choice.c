/*
 * native_decode_choice: the native core's choice of a decoding kernel's variant and key, one call a line
 * (tests/test_native_decode_choice.py).
 *
 * Each line of stdin: kernel capability dtype head_dim head_dim_v causal aligned index64 rows capacity page_size
 * paged window softcap alibi leftpad rotary rotary_interleaved sinks varlen_q chunk kv_fp8 qv kv_pairs
 * (ltn_decode_request's fields in order, varlen_new left out); answered "ok VARIANT KEY DEPENDENT" (DEPENDENT:
 * ltn_dependent_launch's 1 or 0 for the variant at the capability) or "error MESSAGE". A line "split HEAD_DIM"
 * is answered "MIN_SPLIT_KEYS PROGRAMS_PER_SM".
 */
#include <stdio.h>
#include <string.h>

#include "native_choice.h"

int main(void) {
    char line[512];
    while (fgets(line, sizeof line, stdin) != NULL) {
        int head_dim;
        long long shared, sm_shared;
        if (sscanf(line, "split %d %lld %lld", &head_dim, &shared, &sm_shared) == 3) {
            printf("%lld %lld\n", (long long)ltn_decode_min_split_keys(head_dim),
                   (long long)ltn_decode_programs_per_sm(shared, sm_shared));
            continue;
        }
        ltn_decode_request r;
        long long rows = 0, capacity = 0, page_size = 0, kv_pairs = 0;
        memset(&r, 0, sizeof r);
        int n = sscanf(line, "%d %d %d %d %d %d %d %d %lld %lld %lld %d %d %d %d %d %d %d %d %d %d %d %d %lld",
                       &r.kernel, &r.capability, &r.dtype, &r.head_dim, &r.head_dim_v, &r.causal, &r.aligned,
                       &r.index64, &rows, &capacity, &page_size, &r.paged, &r.window, &r.softcap, &r.alibi,
                       &r.leftpad, &r.rotary, &r.rotary_interleaved, &r.sinks, &r.varlen_q, &r.chunk, &r.kv_fp8, &r.qv,
                       &kv_pairs);
        if (n < 20 || n > 24) { /* chunk, kv_fp8, qv, kv_pairs: 0 when left out */
            printf("error bad request line\n");
            continue;
        }
        r.rows = rows, r.capacity = capacity, r.page_size = page_size, r.kv_pairs = kv_pairs;
        ltn_variant v;
        ltn_error err;
        char text[1024], key[33];
        int status = ltn_decode_variant(&r, &v, &err);
        if (status == LTN_OK && ltn_variant_string(&v, text, sizeof text) == 0 && ltn_variant_key(&v, key) == 0)
            printf("ok %s %s %d\n", text, key, ltn_dependent_launch(&v, r.capability));
        else
            print_choice(status, &v, &err);
    }
    return 0;
}
