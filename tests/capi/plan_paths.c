/*
 * plan_paths: lt_plan_launch reads a dense call of this version's struct where the caller keeps it, and copies an
 * older struct (or a packed call) first; both must launch the same and refuse the same (tests/test_capi_plan_paths.py).
 *
 * plan_paths SEED CALLS [trace]: lt_init with the images LAZYTRITON_IMAGES names, a plan of bf16 q (1, 4, 300, 128),
 * k and v (1, 2, 500, 128) at made-up device addresses, then CALLS calls made from it by random changes, hostile
 * ones included (dtypes, shapes, strides, aliasing outputs, null or misaligned pointers, devices, flags, window,
 * softcap, scale, chunk, sinks, descales, packed sequences). Each call goes through lt_plan_launch and lt_attn_fwd
 * twice: as this version's struct, and as a version 7 struct (the same call: no workspace) the library copies.
 * The status, the message and the fake libcuda's record of the launch must be the same both ways.
 *
 * Prints one JSON line: the calls, the launches, the statuses seen (how often), the mismatches and the first one.
 * With "trace", first one line a call: its statuses, message and the launch record's digest (the same program
 * against another build of the library gives the same lines when that build checks and launches the same).
 */
#include <dlfcn.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lazytriton.h"

enum { MAX_PARAMS = 64, RECORD = 128 };

typedef void (*fake_read_fn)(unsigned char *, int *, long long *, int *);
static int (*configure)(int, const int *, int);
static fake_read_fn read_launch;
static int n_params, sizes[MAX_PARAMS];

static uint64_t rng;

static uint64_t next(void) { /* xorshift64* */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1Dull;
}

static int64_t pick(int64_t lo, int64_t hi) { return lo + (int64_t)(next() % (uint64_t)(hi - lo + 1)); }

/* What one call did: its status and message, and (launched) a digest of the fake's record of the launch. */
typedef struct {
    int status;
    char message[512];
    int launches;
    uint64_t digest;
} outcome;

static uint64_t fnv(uint64_t h, const void *data, size_t n) {
    const unsigned char *b = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static outcome run(int plan_launch, const lt_plan *plan, const lt_attn_fwd_params *p) {
    static unsigned char seen[RECORD * 1024];
    int nulls[1024], aligns[1024];
    long long state[16];
    outcome o;
    memset(&o, 0, sizeof o);
    configure(n_params, sizes, 0);
    o.status = plan_launch ? lt_plan_launch(plan, p, (void *)0x5EA) : lt_attn_fwd(p, (void *)0x5EA);
    snprintf(o.message, sizeof o.message, "%s", o.status == LT_OK ? "" : lt_last_error());
    read_launch(seen, nulls, state, aligns);
    o.launches = (int)state[0];
    o.digest = 0xcbf29ce484222325ull;
    if (o.launches > 0) {
        o.digest = fnv(o.digest, state + 3, sizeof(long long) * 10); /* grid, block, shared, stream, function... */
        for (int i = 0; i < n_params; i++)
            o.digest = nulls[i] ? fnv(o.digest, "null", 4) : fnv(o.digest, seen + RECORD * i, (size_t)sizes[i]);
    }
    return o;
}

static void *at(uint64_t address) { return (void *)(uintptr_t)address; }

static const uint64_t Q = 0x7f0000100000ull, K = 0x7f0000200000ull, V = 0x7f0000300000ull,
                      OUT = 0x7f0000400000ull, LSE = 0x7f0000500000ull, EXTRA = 0x7f0000600000ull;

static void base_call(lt_attn_fwd_params *p, int64_t sq, int64_t sk) {
    int64_t qs[4] = {1, 4, sq, 128}, ks[4] = {1, 2, sk, 128};
    lt_attn_fwd_params_init(p);
    lt_tensor_init(&p->q, at(Q), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->k, at(K), LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->v, at(V), LT_DTYPE_BF16, 4, ks, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->out, at(OUT), LT_DTYPE_BF16, 4, qs, LT_DEVICE_CUDA, 0);
    lt_tensor_init(&p->lse, at(LSE), LT_DTYPE_FP32, 3, qs, LT_DEVICE_CUDA, 0);
}

static lt_tensor *tensor(lt_attn_fwd_params *p, int which) {
    lt_tensor *ts[5] = {&p->q, &p->k, &p->v, &p->out, &p->lse};
    return ts[which];
}

/* One random change of p. */
static void change(lt_attn_fwd_params *p) {
    int64_t one[1] = {1}, heads[1] = {4}, cu[1] = {2};
    lt_tensor *t = tensor(p, (int)pick(0, 4));
    switch (pick(0, 24)) {
    case 0: p->out.data = at(Q + 2 * (uint64_t)pick(-64, 300000)); break;  /* out on q */
    case 1: p->lse.data = at(K + 4 * (uint64_t)pick(-64, 300000)); break;  /* lse on k */
    case 2: p->out.data = at(LSE + 2 * (uint64_t)pick(-4096, 4096)); break; /* out on lse */
    case 3: t->strides[pick(0, t->ndim - 1)] = pick(0, 3) == 0 ? 0 : pick(1, 200000); break;
    case 4: t->dtype = (int32_t)pick(0, 7); break;
    case 5: t->sizes[pick(0, t->ndim - 1)] = pick(0, 3) == 0 ? pick(-1, 1) : pick(1, 700); break;
    case 6: { /* a seqlen_q of the same bucket or another, out and lse alike */
        int64_t sq = pick(0, 1) ? pick(257, 512) : pick(1, 2000);
        p->q.sizes[2] = p->out.sizes[2] = p->lse.sizes[2] = sq;
        p->q.strides[1] = p->out.strides[1] = sq * 128, p->q.strides[0] = p->out.strides[0] = 4 * sq * 128;
        p->lse.strides[1] = sq, p->lse.strides[0] = 4 * sq;
        break;
    }
    case 7: p->causal = (int32_t)pick(-1, 3); break;
    case 8: p->window_left = pick(-2, 600), p->window_right = pick(-2, 600); break;
    case 9: { const double caps[4] = {0.0, 30.0, -1.0, INFINITY}; p->softcap = caps[pick(0, 3)]; break; }
    case 10: { const double scales[4] = {NAN, 0.1, INFINITY, -0.5}; p->sm_scale = scales[pick(0, 3)]; break; }
    case 11: t->data = NULL; break;
    case 12: t->data = (char *)t->data + 2 * pick(1, 8); break;              /* no longer 16-byte aligned */
    case 13: t->device_index = (int32_t)pick(-1, 1); break;
    case 14: t->device_type = (int32_t)pick(0, 3); break;
    case 15: p->flags = (uint32_t)pick(0, 2); break;
    case 16: lt_tensor_init(&p->sinks, at(EXTRA), pick(0, 1) ? LT_DTYPE_FP32 : LT_DTYPE_BF16, 1, heads, LT_DEVICE_CUDA,
                            0); break;
    case 17: p->attention_chunk = pick(-1, 1) * pick(0, 400); break;
    case 18: { /* q in (batch, seqlen, heads, head_dim) memory */
        int64_t s = p->q.sizes[2];
        p->q.strides[0] = 4 * s * 128, p->q.strides[1] = 128, p->q.strides[2] = 4 * 128;
        break;
    }
    case 19: lt_tensor_init(&p->q_descale, at(EXTRA + 4096), LT_DTYPE_FP32, 1, one, LT_DEVICE_CUDA, 0); break;
    case 20: p->v_transposed = (int32_t)pick(0, 2); break;
    case 21: p->reserved7 = (uint32_t)pick(0, 1); break;
    case 22: /* packed sequences: both structs are copied (the kernels' views) */
        lt_tensor_init(&p->cu_seqlens_q, at(EXTRA + 8192), LT_DTYPE_INT32, 1, cu, LT_DEVICE_CUDA, 0);
        lt_tensor_init(&p->cu_seqlens_k, at(EXTRA + 8192 + 64), LT_DTYPE_INT32, 1, cu, LT_DEVICE_CUDA, 0);
        p->max_seqlen_q = pick(0, 600), p->max_seqlen_k = pick(0, 600);
        break;
    case 23: lt_tensor_init(&p->seqused_k, at(EXTRA + 12288), LT_DTYPE_INT32, 1, one, LT_DEVICE_CUDA, 0); break;
    default: p->lse.strides[pick(0, 2)] = pick(0, 5000); break;
    }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: plan_paths SEED CALLS [trace]\n");
        return 2;
    }
    rng = strtoull(argv[1], NULL, 10) * 2654435761ull + 1;
    long calls = atol(argv[2]);
    int trace = argc > 3 && strcmp(argv[3], "trace") == 0;
    void *fake = dlopen("libcuda.so.1", RTLD_NOW);
    *(void **)&configure = fake ? dlsym(fake, "fake_configure") : NULL;
    *(void **)&read_launch = fake ? dlsym(fake, "fake_read") : NULL;
    const char *ints = getenv("PLAN_PATHS_INTS"); /* flash_fwd's pointers and integers (the test gives them) */
    n_params = ints ? atoi(ints) + 5 : 0;         /* then 3 floats and 2 hidden pointers */
    if (configure == NULL || read_launch == NULL || n_params < 6 || n_params > MAX_PARAMS) {
        fprintf(stderr, "needs the fake libcuda as libcuda.so.1 and PLAN_PATHS_INTS in 1..59\n");
        return 2;
    }
    for (int i = 0; i < n_params; i++)
        sizes[i] = i >= n_params - 5 && i < n_params - 2 ? 4 : 8;
    lt_attn_fwd_params p;
    lt_plan *plan = NULL;
    base_call(&p, 300, 500);
    if (lt_init(NULL) != LT_OK || lt_attn_fwd_plan(&p, &plan) != LT_OK) {
        fprintf(stderr, "lt_init/lt_attn_fwd_plan: %s\n", lt_last_error());
        return 1;
    }
    long launched = 0, mismatches = 0, seen[32] = {0};
    char first[2048] = "";
    for (long i = 0; i < calls; i++) {
        base_call(&p, 300, 500);
        for (int n = (int)pick(0, 3); n > 0; n--)
            change(&p);
        lt_attn_fwd_params old = p; /* the same call as a version 7 struct: no workspace, which p never has */
        old.struct_size = (uint32_t)offsetof(lt_attn_fwd_params, workspace), old.version = 7;
        memset(&old.workspace, 0xA5, sizeof old.workspace); /* past a version 7 struct: never read */
        for (int api = 0; api < 2; api++) {
            outcome now = run(api == 0, plan, &p), copied = run(api == 0, plan, &old);
            seen[now.status & 31]++;
            launched += now.launches;
            if (trace)
                printf("%ld %d %d %d %016llx %s\n", i, api, now.status, now.launches,
                       (unsigned long long)now.digest, now.message);
            if (now.status != copied.status || strcmp(now.message, copied.message) != 0 ||
                now.launches != copied.launches || now.digest != copied.digest) {
                if (mismatches++ == 0)
                    snprintf(first, sizeof first, "call %ld, %s: status %d (%s) launches %d digest %016llx; as version "
                             "7: status %d (%s) launches %d digest %016llx", i, api == 0 ? "lt_plan_launch" :
                             "lt_attn_fwd", now.status, now.message, now.launches, (unsigned long long)now.digest,
                             copied.status, copied.message, copied.launches, (unsigned long long)copied.digest);
            }
        }
    }
    printf("{\"calls\":%ld,\"launches\":%ld,\"mismatches\":%ld,\"statuses\":{", calls, launched, mismatches);
    for (int s = 0, comma = 0; s < 32; s++)
        if (seen[s] > 0)
            printf("%s\"%d\":%ld", comma++ ? "," : "", s, seen[s]);
    printf("},\"first_mismatch\":\"");
    for (const char *c = first; *c; c++)
        if (*c != '"' && *c != '\\')
            putchar(*c);
    printf("\"}\n");
    lt_plan_destroy(plan);
    return 0;
}
