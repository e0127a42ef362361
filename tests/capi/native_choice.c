/*
 * native_choice: the native core's choice of variant and key, one call a line (tests/test_native_choice.py).
 *
 * Each line of stdin: kernel capability dtype head_dim head_dim_v causal aligned seq16 index64 window softcap
 * varlen seqused_q seqused_k seqlen_q seqlen_k [sinks [chunk]]. Each answer, one line: "ok VARIANT KEY" or "error MESSAGE".
 */
#include <stdio.h>
#include <string.h>

#include "native_choice.h"

int main(void) {
    char line[512];
    while (fgets(line, sizeof line, stdin) != NULL) {
        ltn_attn_request r;
        long long sq = 0, sk = 0;
        memset(&r, 0, sizeof r);
        int n = sscanf(line, "%d %d %d %d %d %d %d %d %d %d %d %d %d %d %lld %lld %d %d", &r.kernel, &r.capability,
                       &r.dtype, &r.head_dim, &r.head_dim_v, &r.causal, &r.aligned, &r.seq16, &r.index64, &r.window,
                       &r.softcap, &r.varlen, &r.seqused_q, &r.seqused_k, &sq, &sk, &r.sinks, &r.chunk);
        if (n < 16 || n > 18) { /* sinks and chunk: 0 when left out */
            printf("error bad request line\n");
            continue;
        }
        r.seqlen_q = sq, r.seqlen_k = sk;
        ltn_variant v;
        ltn_error err;
        print_choice(ltn_attn_variant(&r, &v, &err), &v, &err);
    }
    return 0;
}
