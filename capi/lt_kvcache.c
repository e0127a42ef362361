/*
 * lt_kvcache.c: decoding over a KV cache in the C API: lt_attn_kvcache, its checks, plans and launch.
 * Included at the end of lazytriton.c (one translation unit): it uses lt__fail, lt_check.c's tensor checks,
 * the plan memo and lt__cu_launch.
 *
 * The checks are kernels/flash_decode/checks.py's (check: shapes, dtypes, devices, options), with messages
 * that name the argument; the values of the index tensors are checked by Python on the CPU and not read on a
 * GPU. The kernels: with new keys, kv_append (kernels/kv_append) writes them into the caches first; then
 * (kernels/flash_decode) flash_decode_split and, with several splits, flash_decode_combine on the caller's
 * workspace, all on the caller's stream. Their integer arguments are the bindings' (c_initializer, tested field
 * by field), and so are the variants (the planner calls the bindings) and the split count (lt_splits.c).
 * v_cache, v and out may have a head dim of their own (head_dim_v). A version 1 params struct (before
 * cache_leftpad) is taken as the same call without a left pad, a version 2 one (before the rotary tables) as
 * the same call without rotary, a version 3 one (before the sinks) without sinks or packed queries, a version 4
 * one (before attention_chunk) without a chunk, a version 5 one (before the descales) with caches of q's dtype, a
 * version 6 one (before qv) without qv or packed new keys: every function reads the caller's struct through
 * lt__kv_prepare, which copies it into this version's, zero-extended.
 * Packed queries (cu_seqlens_q) are checked and launched through views: q and out (total_q, heads, dim) as
 * (1, total_q, heads, dim) with batch stride 0, lse (heads, total_q) as (1, heads, total_q), the kernels' one
 * batch of total_q rows (binding.split_ints); batch is then cu_seqlens_q's and seqlen_q max_seqlen_q (qv likewise).
 * qv (MLA, QV=true on the split kernel, kernels/flash_decode/mla.py) is the first head_dim_v columns of q's rows:
 * the kernel reads each row [qv | q] from qv's pointer with q's strides. New keys packed by cu_seqlens_k_new
 * (k, v (total_new, heads_k, dim), viewed as (1, total_new, heads_k, dim) with batch stride 0, kv_append's VARLEN)
 * run through kv_append's VARLEN variant (grid batch 1); on a GPU kv_append_lengths then writes each sequence's
 * length after the append (cache_seqlens + its new count, int32) at the front of the caller's workspace
 * (lt_attn_kvcache_workspace_size counts it), and the split kernel reads those lengths with seqlen_new 0 and,
 * with rotary tables and no rotary_seqlens, cache_seqlens as the rotary base (kv_append.lengths, flash_decode's
 * after_packed_append). On host memory the call runs through Python.
 */

#include "lt_splits.c"

#define LT__DECODE_SPLIT_PARAMS 63   /* flash_decode_split: 61 pointers and integers, then sm_scale, softcap */
#define LT__DECODE_SPLIT_FLOATS 2
#define LT__DECODE_COMBINE_PARAMS 13 /* flash_decode_combine: 13 pointers and integers */
#define LT__APPEND_PARAMS 46         /* kv_append: 46 pointers and integers */
#define LT__LENGTHS_PARAMS 6         /* kv_append_lengths: 6 pointers and integers */
#define LT__MAX_WINDOWED (INT64_C(1) << 29)
#define LT__KV_PARAMS_V1_SIZE offsetof(lt_attn_kvcache_params, cache_leftpad) /* version 1: before cache_leftpad */
#define LT__KV_PARAMS_V2_SIZE offsetof(lt_attn_kvcache_params, rotary_cos)    /* version 2: before the rotary tables */
#define LT__KV_PARAMS_V3_SIZE offsetof(lt_attn_kvcache_params, sinks)         /* version 3: before the sinks */
#define LT__KV_PARAMS_V4_SIZE offsetof(lt_attn_kvcache_params, attention_chunk) /* version 4: before the chunk */
#define LT__KV_PARAMS_V5_SIZE offsetof(lt_attn_kvcache_params, k_descale)       /* version 5: before the descales */
#define LT__KV_PARAMS_V6_SIZE offsetof(lt_attn_kvcache_params, qv)              /* version 6: before qv */
#define LT__MAX_HEAD_DIM_V 512 /* geometry.MAX_HEAD_DIM_V: v's head dim in the decoding kernels (MLA's latent) */

typedef struct {
    int64_t b, hq, hk, sq, d, dv, seqlen_new, capacity, page_size, cache_rows, seqlen_const;
    int64_t window_left, window_right, num_splits, workspace;
    int32_t dtype, device_type, device_index;
    int causal, alibi, softcap_on, use_seqlens, use_batch_idx, paged, aligned, index64, leftpad;
    int append_aligned, append_index64; /* kv_append's layout flags, over k, v and the caches */
    int64_t rotary_dim, seqlen_ro;      /* rotary: the columns rotated (0: none) and the tables' positions */
    int rotary_interleaved, rotary_seqlens, rotary_per_query;
    int sinks, varlen_q;               /* SINKS; VARLEN_Q (queries packed by cu_seqlens_q) */
    int64_t attention_chunk;           /* CHUNK: the kernel's chunk (checks._chunk's), 0 when off */
    int64_t out_batch, out_seqlen;     /* out's and lse's batch and rows as the kernels index them (Call's) */
    int64_t lse_rows;                  /* out_batch x heads_q x out_seqlen: the combine's rows */
    float scale, softcap;
    int32_t kv_fp8;                    /* KV_FP8: the caches' float8 lt_dtype (e4m3 or e5m2), 0 for q's dtype */
    int64_t descale[2];                /* k_descale, v_descale pointers: 0 when absent (1.0) */
    int64_t descale_strides[2][2];     /* their (batch, head) strides (checks.descale_strides): 0 on a broadcast dim */
    int qv, varlen_new;                /* QV (qv . v in the scores); new keys packed by cu_seqlens_k_new */
} lt__kv_call;

/* Whether a call launches kv_append: with new keys, and in every rotary call (programs that write nothing when it
   has none), whose split kernel is kv_append's programmatic dependent (kv_append.binding.append). */
static int lt__kv_appends(const lt__kv_call *c) { return c->seqlen_new > 0 || c->rotary_dim > 0; }

/* What lt_attn_kvcache asks the planner (embedded_kvcache.py) for, and its answer (also in build.py's cdef). */
typedef struct {
    int32_t device_index, dtype, head_dim, causal, aligned, index64, paged, window, softcap, alibi; /* in */
    int64_t rows, capacity, page_size;                                                               /* in */
    int32_t head_dim_v, append, append_aligned, append_index64; /* in: v's head dim; kv_append wanted, its flags */
    int32_t leftpad;                                            /* in: cache_leftpad given (LEFTPAD=true) */
    int32_t rotary, rotary_interleaved; /* in: rotary tables given (ROTARY=true), pairs (ROTARY_INTERLEAVED=true) */
    int32_t sinks, varlen_q;            /* in: attention sinks (SINKS=true), packed queries (VARLEN_Q=true) */
    int32_t chunk;                      /* in: attention_chunk (CHUNK=true on the split kernel) */
    int32_t kv_fp8;                     /* in: a float8 cache's lt_dtype (KV_FP8 on split and kv_append), else 0 */
    int32_t qv;                         /* in: qv given (QV=true on the split kernel) */
    uint64_t split_function, combine_function;                                                        /* out */
    uint32_t split_threads, split_shared, split_block_m, split_block_n, split_hidden;
    uint32_t combine_threads, combine_shared, combine_block_m, combine_hidden;
    int64_t slots, min_keys; /* the heuristic's inputs: SMs x programs per SM, the fewest keys a split takes */
    uint64_t append_function; /* out, with append: kv_append */
    uint32_t append_threads, append_shared, append_block_m, append_hidden;
    int32_t varlen_new;          /* in: new keys packed by cu_seqlens_k_new (VARLEN on kv_append, then the lengths) */
    uint64_t lengths_function;   /* out, with varlen_new: kv_append_lengths */
    uint32_t lengths_threads, lengths_shared, lengths_block, lengths_hidden;
    int32_t combine_dependent; /* out: the combine kernel is the split kernel's programmatic dependent */
    int32_t split_dependent;   /* out: the split kernel is kv_append's programmatic dependent (a rotary call) */
    int64_t kv_pairs; /* in: a float8 cache's (sequence, key/value head) pairs, whose split tiles follow them; else 0 */
    char variant[512];
} lt__kvcache_plan_request;

static int lt__py_kvcache_plan(lt__kvcache_plan_request *request);
static int lt__py_attn_kvcache_cpu(const lt_attn_kvcache_params *params);

typedef struct {
    uint32_t magic;
    lt__plan_key key;
    lt__CUcontext context;
    lt__kvcache_plan_request r;
} lt__kvcache_plan;

#define LT__KVCACHE_PLAN_MAGIC 0x6c74706bu /* "ltpk" */
#define LT__KERNEL_DECODE 3                /* a plan key's kernel: the decoding pair (not a planner code) */

/* ------------------------------------------------------------------------- */
/* Checks                                                                     */

static int lt__absent(const lt_tensor *t) { return t->data == NULL && t->ndim == 0; }

static lt_status lt__kv_struct(const lt_attn_kvcache_params *p) {
    if (p == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "params is NULL");
    if ((p->struct_size == LT__KV_PARAMS_V1_SIZE && p->version == 1) ||
        (p->struct_size == LT__KV_PARAMS_V2_SIZE && p->version == 2) ||
        (p->struct_size == LT__KV_PARAMS_V3_SIZE && p->version == 3) ||
        (p->struct_size == LT__KV_PARAMS_V4_SIZE && p->version == 4) ||
        (p->struct_size == LT__KV_PARAMS_V5_SIZE && p->version == 5) ||
        (p->struct_size == LT__KV_PARAMS_V6_SIZE && p->version == 6))
        return LT_OK; /* the call it always was: no qv (1 to 6), no float8 cache (1 to 5), no chunk (1 to 4), ... */
    if (p->struct_size != sizeof(lt_attn_kvcache_params))
        return lt__fail(LT_ERROR_VERSION, "params->struct_size is %u but this lazytriton %d.%d.%d takes %zu for "
                        "lt_attn_kvcache_params: rebuild against its lazytriton.h and fill params with "
                        "lt_attn_kvcache_params_init()", p->struct_size, LT_VERSION_MAJOR, LT_VERSION_MINOR,
                        LT_VERSION_PATCH, sizeof(lt_attn_kvcache_params));
    if (p->version != LT_ATTN_KVCACHE_PARAMS_VERSION)
        return lt__fail(LT_ERROR_VERSION, "params->version is %u but this lazytriton takes lt_attn_kvcache_params "
                        "version %d", p->version, LT_ATTN_KVCACHE_PARAMS_VERSION);
    return LT_OK;
}

/* A packed (total, heads, dim) tensor as the kernels' (1, total, heads, dim) view (batch stride 0); lse
 * (heads, total) as (1, heads, total). */
static lt_status lt__kv_packed_view(const char *name, lt_tensor *t, int lse, const char *layout) {
    lt_status s;
    if ((s = lt__check_tensor(name, t, lse ? 2 : 3, layout)) != LT_OK)
        return s;
    for (int i = t->ndim; i > 0; i--)
        t->sizes[i] = t->sizes[i - 1], t->strides[i] = t->strides[i - 1];
    t->ndim += 1, t->sizes[0] = 1, t->strides[0] = 0;
    return LT_OK;
}

/* The caller's struct as this version's in *norm (an older one zero-extended: its new tensors absent,
 * max_seqlen_q -1), and in *view, with cu_seqlens_q, the packed q, out and lse as the kernels' views (else
 * *norm). Python's host-memory call takes *norm: the caller's layout. */
static lt_status lt__kv_prepare(const lt_attn_kvcache_params *p, lt_attn_kvcache_params *norm,
                                lt_attn_kvcache_params *view) {
    lt_status s;
    if ((s = lt__kv_struct(p)) != LT_OK)
        return s;
    memset(norm, 0, sizeof *norm);
    memcpy(norm, p, p->struct_size);
    if (p->struct_size <= LT__KV_PARAMS_V3_SIZE)
        norm->max_seqlen_q = -1;
    norm->struct_size = sizeof *norm, norm->version = LT_ATTN_KVCACHE_PARAMS_VERSION;
    *view = *norm;
    const char *rows = "(total_q, heads, head_dim) with cu_seqlens_q";
    if (!lt__absent(&norm->cu_seqlens_k_new) && !lt__absent(&norm->k) && !lt__absent(&norm->v) &&
        ((s = lt__kv_packed_view("k", &view->k, 0, "(total_new, heads_k, head_dim) with cu_seqlens_k_new")) != LT_OK ||
         (s = lt__kv_packed_view("v", &view->v, 0, "(total_new, heads_k, head_dim_v) with cu_seqlens_k_new")) != LT_OK))
        return s;
    if (lt__absent(&norm->cu_seqlens_q))
        return LT_OK;
    if ((s = lt__kv_packed_view("q", &view->q, 0, rows)) != LT_OK || (s = lt__kv_packed_view("out", &view->out, 0, rows)) != LT_OK ||
        (!lt__absent(&norm->qv) && (s = lt__kv_packed_view("qv", &view->qv, 0, "(total_q, heads, head_dim_v) with "
                                                           "cu_seqlens_q")) != LT_OK))
        return s;
    return lt__kv_packed_view("lse", &view->lse, 1, "(heads_q, total_q) with cu_seqlens_q");
}

static lt_status lt__kv_same_device(const char *name, const lt_tensor *t, const lt_tensor *q) {
    if (t->device_type != q->device_type || t->device_index != q->device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is on %s:%d but q is on %s:%d; all tensors of a call must "
                        "be on one device", name, lt__device_name(t->device_type), t->device_index,
                        lt__device_name(q->device_type), q->device_index);
    return LT_OK;
}

/* q, the caches, k, v, out: a 4-dim float tensor of q's dtype and device with a contiguous last dim. */
static lt_status lt__kv_data(const char *name, const lt_tensor *t, const lt_tensor *q, const char *layout) {
    lt_status s;
    if ((s = lt__check_tensor(name, t, 4, layout)) != LT_OK)
        return s;
    if (t != q && t->dtype != q->dtype)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %s but q.dtype is %s; they must match", name,
                        lt__dtype_name(t->dtype), lt__dtype_name(q->dtype));
    if (t->strides[3] != 1 && t->sizes[3] > 1)
        return lt__fail(LT_ERROR_SHAPE, "%s.strides[3] is %lld; the last dim must be contiguous (stride 1)", name,
                        (long long)t->strides[3]);
    return lt__kv_same_device(name, t, q);
}

/* k_cache or v_cache: q's dtype, or (version 6) a float8 format read by fp16 or bf16 queries, the other cache's. */
static lt_status lt__kv_cache(const char *name, const lt_tensor *t, const lt_attn_kvcache_params *p,
                              const char *layout) {
    lt_status s;
    if (!lt__is_fp8(t->dtype))
        return lt__kv_data(name, t, &p->q, layout);
    if ((s = lt__check_data_tensor(name, t, 4, layout, 1)) != LT_OK)
        return s;
    if (p->q.dtype != LT_DTYPE_FP16 && p->q.dtype != LT_DTYPE_BF16)
        return lt__fail(LT_ERROR_DTYPE, "q.dtype is %s; with a float8 %s (%s) q must be fp16 or bf16",
                        lt__dtype_name(p->q.dtype), name, lt__dtype_name(t->dtype));
    if (p->k_cache.dtype != p->v_cache.dtype)
        return lt__fail(LT_ERROR_DTYPE, "k_cache.dtype is %s but v_cache.dtype is %s; a float8 cache holds both in "
                        "one format", lt__dtype_name(p->k_cache.dtype), lt__dtype_name(p->v_cache.dtype));
    if (t->strides[3] != 1 && t->sizes[3] > 1)
        return lt__fail(LT_ERROR_SHAPE, "%s.strides[3] is %lld; the last dim must be contiguous (stride 1)", name,
                        (long long)t->strides[3]);
    return lt__kv_same_device(name, t, &p->q);
}

/* A float8 cache's k_descale or v_descale (checks._fp8): fp32, (1), (heads_k) or (batch, heads_k), any strides below
 * 2**31, on q's device; only with a float8 cache. Its pointer and (batch, head) strides into c at i. */
static lt_status lt__kv_descale(const char *name, const lt_tensor *t, const lt_attn_kvcache_params *p, lt__kv_call *c,
                                int i) {
    if (lt__absent(t))
        return LT_OK;
    if (c->kv_fp8 == 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is given but k_cache is %s, not a float8 cache "
                        "(LT_DTYPE_FP8_E4M3 or LT_DTYPE_FP8_E5M2); descales apply to float8 caches only", name,
                        lt__dtype_name(p->k_cache.dtype));
    if (t->dtype != LT_DTYPE_FP32)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %s; expected LT_DTYPE_FP32 (3)", name, lt__dtype_name(t->dtype));
    int one = t->ndim == 1 && t->sizes[0] == 1, head = t->ndim == 1 && t->sizes[0] == c->hk;
    int both = t->ndim == 2 && t->sizes[0] == c->b && t->sizes[1] == c->hk;
    if (!one && !head && !both)
        return lt__fail(LT_ERROR_SHAPE, "%s must have shape (1) (per tensor), (%lld) (per key/value head) or (%lld, "
                        "%lld) (per sequence and head), got ndim %d, sizes (%lld, %lld)", name, (long long)c->hk,
                        (long long)c->b, (long long)c->hk, t->ndim, (long long)t->sizes[0],
                        (long long)(t->ndim > 1 ? t->sizes[1] : 0));
    for (int d = 0; d < t->ndim; d++)
        if (t->strides[d] < 0 || t->strides[d] > INT32_MAX)
            return lt__fail(LT_ERROR_SHAPE, "%s.strides[%d] is %lld; expected 0..2**31 - 1", name, d,
                            (long long)t->strides[d]);
    lt_status s = lt__kv_same_device(name, t, &p->q);
    if (s != LT_OK)
        return s;
    if (t->data == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", name);
    c->descale[i] = (int64_t)(uintptr_t)t->data;
    c->descale_strides[i][0] = both ? t->strides[0] : 0;
    c->descale_strides[i][1] = both ? t->strides[1] : head ? t->strides[0] : 0;
    return LT_OK;
}

/* An index or float32 tensor of given dtype and sizes (ndim of them), contiguous, on q's device. */
static lt_status lt__kv_small(const char *name, const lt_tensor *t, const lt_tensor *q, int32_t dtype, int32_t ndim,
                              const int64_t *sizes, const char *layout) {
    if (t->dtype != dtype)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %d; expected %s", name, t->dtype,
                        dtype == LT_DTYPE_INT32 ? "LT_DTYPE_INT32 (4)" : "LT_DTYPE_FP32 (3)");
    int bad = t->ndim != ndim;
    for (int i = 0; i < ndim && !bad; i++)
        bad = sizes[i] >= 0 && t->sizes[i] != sizes[i];
    if (bad)
        return lt__fail(LT_ERROR_SHAPE, "%s must have shape %s; got ndim %d, sizes (%lld, %lld, %lld)", name, layout,
                        t->ndim, (long long)t->sizes[0], (long long)t->sizes[1], (long long)t->sizes[2]);
    int64_t expect = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        if (t->sizes[i] > 1 && t->strides[i] != expect)
            return lt__fail(LT_ERROR_SHAPE, "%s must be contiguous; strides[%d] is %lld, expected %lld", name, i,
                            (long long)t->strides[i], (long long)expect);
        expect *= t->sizes[i];
    }
    return lt__kv_same_device(name, t, q);
}

/* Packed queries (checks._packed): cu_seqlens_q int32 (batch + 1 >= 2), contiguous, on q's device; max_seqlen_q
 * in 0..2**31 - 1; without cu_seqlens_q, max_seqlen_q -1. p holds the views (q (1, total_q, heads, dim)). */
static lt_status lt__kv_varlen_q(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    lt_status s;
    if (lt__absent(&p->cu_seqlens_q)) {
        if (p->max_seqlen_q != -1)
            return lt__fail(LT_ERROR_INVALID_ARGUMENT, "max_seqlen_q is %lld but cu_seqlens_q is absent: it is read "
                            "only with cu_seqlens_q (queries packed (total_q, heads, head_dim)); leave it -1",
                            (long long)p->max_seqlen_q);
        c->out_batch = c->b, c->out_seqlen = c->sq;
        return LT_OK;
    }
    int64_t any[1] = {-1};
    if ((s = lt__kv_small("cu_seqlens_q", &p->cu_seqlens_q, &p->q, LT_DTYPE_INT32, 1, any, "(batch + 1,)")) != LT_OK)
        return s;
    if (p->cu_seqlens_q.sizes[0] < 2)
        return lt__fail(LT_ERROR_SHAPE, "cu_seqlens_q must have batch + 1 >= 2 entries (0, then each sequence's end "
                        "in q), got %lld", (long long)p->cu_seqlens_q.sizes[0]);
    if (p->max_seqlen_q < 0 || p->max_seqlen_q > INT32_MAX)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "max_seqlen_q is %lld; with cu_seqlens_q it must be in "
                        "0..2147483647 (the longest sequence's query count)", (long long)p->max_seqlen_q);
    c->varlen_q = 1, c->out_batch = 1, c->out_seqlen = c->sq; /* the view's rows: total_q */
    c->b = p->cu_seqlens_q.sizes[0] - 1, c->sq = p->max_seqlen_q;
    return LT_OK;
}

/* The cache's layout: contiguous (cache_batch_idx or not) or paged; capacity and page size. */
static lt_status lt__kv_layout(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    lt_status s;
    int64_t rows_c = p->k_cache.sizes[0], s_c = p->k_cache.sizes[1], b1[1] = {c->b};
    c->cache_rows = rows_c;
    if (lt__absent(&p->block_table)) {
        c->capacity = s_c;
        if (lt__absent(&p->cache_batch_idx)) {
            if (rows_c != c->b)
                return lt__fail(LT_ERROR_SHAPE, "k_cache has batch %lld but q has batch %lld; pass cache_batch_idx "
                                "to pick rows of a larger cache", (long long)rows_c, (long long)c->b);
            return LT_OK;
        }
        c->use_batch_idx = 1;
        return lt__kv_small("cache_batch_idx", &p->cache_batch_idx, &p->q, LT_DTYPE_INT32, 1, b1, "(batch,)");
    }
    /* With cache_batch_idx, each sequence's row of the table (FlashAttention-3's): the table has any rows. */
    int picked = !lt__absent(&p->cache_batch_idx);
    int64_t table[2] = {picked ? -1 : c->b, -1};
    if ((s = lt__kv_small("block_table", &p->block_table, &p->q, LT_DTYPE_INT32, 2, table,
                          picked ? "(table_rows, max_blocks_per_seq)" : "(batch, max_blocks_per_seq)")) != LT_OK)
        return s;
    if (picked) {
        if (p->block_table.sizes[0] < 1)
            return lt__fail(LT_ERROR_SHAPE, "block_table has no rows but cache_batch_idx picks rows of it");
        c->use_batch_idx = 1;
        if ((s = lt__kv_small("cache_batch_idx", &p->cache_batch_idx, &p->q, LT_DTYPE_INT32, 1, b1, "(batch,)")) != LT_OK)
            return s;
    }
    if (s_c < 1) /* any size: pages no key tile divides are read key by key (flash_decode.dispatch.page_gather) */
        return lt__fail(LT_ERROR_SHAPE, "with block_table, k_cache.sizes[1] is the page size and must be >= 1 (keys "
                        "a page), got %lld", (long long)s_c);
    c->paged = 1, c->page_size = s_c, c->capacity = p->block_table.sizes[1] * s_c;
    return LT_OK;
}

/* The new keys and values (k, v) and the cached lengths (cache_seqlens or cache_seqlen). */
static lt_status lt__kv_lengths(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    lt_status s;
    int has_lens = !lt__absent(&p->cache_seqlens), packed = !lt__absent(&p->cu_seqlens_k_new);
    if (lt__absent(&p->k) != lt__absent(&p->v))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "k and v must be given together (new keys and values) or both be "
                        "absent");
    if (packed && lt__absent(&p->k))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "cu_seqlens_k_new is given without k and v: it packs the new keys "
                        "and values");
    if (!lt__absent(&p->k)) {
        if ((s = lt__kv_data("k", &p->k, &p->q, "(batch, seqlen_new, heads_k, head_dim)")) != LT_OK ||
            (s = lt__kv_data("v", &p->v, &p->q, "(batch, seqlen_new, heads_k, head_dim_v)")) != LT_OK)
            return s;
        const int64_t *ks = p->k.sizes, *vs = p->v.sizes; /* packed: the (1, total_new, ...) views */
        int64_t b1[1] = {c->b + 1};
        if (packed && (ks[2] != c->hk || ks[3] != c->d))
            return lt__fail(LT_ERROR_SHAPE, "k must have shape (total_new, %lld, %lld) with cu_seqlens_k_new (the "
                            "cache's heads and head dim), got (%lld, %lld, %lld)", (long long)c->hk, (long long)c->d,
                            (long long)ks[1], (long long)ks[2], (long long)ks[3]);
        if (packed && (vs[1] != ks[1] || vs[2] != c->hk || vs[3] != c->dv))
            return lt__fail(LT_ERROR_SHAPE, "v must have shape (%lld, %lld, %lld) with cu_seqlens_k_new (k's total_new "
                            "and heads, and v_cache's head dim), got (%lld, %lld, %lld)", (long long)ks[1],
                            (long long)c->hk, (long long)c->dv, (long long)vs[1], (long long)vs[2], (long long)vs[3]);
        if (packed && (s = lt__kv_small("cu_seqlens_k_new", &p->cu_seqlens_k_new, &p->q, LT_DTYPE_INT32, 1, b1,
                                        "(batch + 1,)")) != LT_OK)
            return s;
        if (packed)
            c->varlen_new = 1;
        else if (ks[0] != c->b || ks[2] != c->hk || ks[3] != c->d)
            return lt__fail(LT_ERROR_SHAPE, "k must have shape (%lld, seqlen_new, %lld, %lld) (q's batch, the cache's "
                            "heads and head dim), got (%lld, %lld, %lld, %lld)", (long long)c->b, (long long)c->hk,
                            (long long)c->d, (long long)ks[0], (long long)ks[1], (long long)ks[2], (long long)ks[3]);
        else if (vs[0] != c->b || vs[1] != ks[1] || vs[2] != c->hk || vs[3] != c->dv)
            return lt__fail(LT_ERROR_SHAPE, "v must have shape (%lld, %lld, %lld, %lld) (k's batch, seqlen_new and "
                            "heads, and v_cache's head dim), got (%lld, %lld, %lld, %lld)", (long long)c->b,
                            (long long)ks[1], (long long)c->hk, (long long)c->dv, (long long)vs[0], (long long)vs[1],
                            (long long)vs[2], (long long)vs[3]);
        if (!has_lens && p->cache_seqlen < 0)
            return lt__fail(LT_ERROR_INVALID_ARGUMENT, "k and v need cache_seqlens (or cache_seqlen >= 0): the new "
                            "keys are written at each sequence's cached length");
        c->seqlen_new = ks[1];
    }
    if (has_lens && p->cache_seqlen != -1)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "cache_seqlens (a tensor) and cache_seqlen (%lld) are both given; "
                        "leave cache_seqlen at -1 with a tensor", (long long)p->cache_seqlen);
    if (has_lens) {
        int64_t b[1] = {c->b};
        c->use_seqlens = 1, c->seqlen_const = -1;
        return lt__kv_small("cache_seqlens", &p->cache_seqlens, &p->q, LT_DTYPE_INT32, 1, b, "(batch,)");
    }
    if (p->cache_seqlen == -1) {
        c->seqlen_const = c->capacity;
        return LT_OK;
    }
    int64_t fresh = c->varlen_new ? 0 : c->seqlen_new; /* packed new keys: each sequence's own count, checked later */
    if (p->cache_seqlen < 0 || p->cache_seqlen > c->capacity - fresh)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "cache_seqlen must be -1 (the whole cache) or in 0..%lld (the "
                        "cache holds %lld keys per sequence, %lld of them new), got %lld",
                        (long long)(c->capacity - fresh), (long long)c->capacity, (long long)fresh,
                        (long long)p->cache_seqlen);
    c->seqlen_const = p->cache_seqlen;
    return LT_OK;
}

/* attention_chunk in the kernels' terms (checks._chunk): >= 0 (0: off), the cache's length plus seqlen_q below
 * 2**29, the size cut at LT__MAX_CHUNK. */
static lt_status lt__kv_chunk(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    if (p->attention_chunk < 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "attention_chunk is %lld; expected 0 (off) or a chunk of >= 1 keys",
                        (long long)p->attention_chunk);
    if (p->attention_chunk == 0)
        return LT_OK;
    if (c->capacity + c->sq >= LT__MAX_WINDOWED)
        return lt__fail(LT_ERROR_SHAPE, "with attention_chunk set, the cache's length plus seqlen_q must be below "
                        "2**29, got %lld + %lld", (long long)c->capacity, (long long)c->sq);
    c->attention_chunk = p->attention_chunk < LT__MAX_CHUNK ? p->attention_chunk : LT__MAX_CHUNK;
    return LT_OK;
}

/* window and softcap in the kernels' terms (checks._features): causal bounds the right side at 0, an unbounded
 * side is capacity + seqlen_q, no window is (-1, -1). */
static lt_status lt__kv_features(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    int64_t left = p->window_left, right = p->window_right;
    if (left < -1 || right < -1)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "window sizes must be -1 (unbounded) or >= 0, got (%lld, %lld)",
                        (long long)left, (long long)right);
    if (!(isfinite(p->softcap) && p->softcap >= 0.0))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "softcap must be a finite value >= 0 (0 is off), got %g",
                        p->softcap);
    c->softcap = (float)p->softcap, c->softcap_on = p->softcap > 0.0;
    c->window_left = c->window_right = -1;
    if (p->causal)
        right = 0;
    if (left < 0 && (right < 0 || p->causal))
        return LT_OK;
    int64_t full = c->capacity + c->sq;
    if (full >= LT__MAX_WINDOWED)
        return lt__fail(LT_ERROR_SHAPE, "with a window, the cache's length plus seqlen_q must be below 2**29, got "
                        "%lld", (long long)full);
    c->window_left = left >= 0 ? (left < full ? left : full) : full;
    c->window_right = right >= 0 ? (right < full ? right : full) : full;
    return LT_OK;
}

static lt_status lt__kv_outputs(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    lt_status s;
    if ((s = lt__kv_data("out", &p->out, &p->q, "(batch, seqlen_q, heads_q, head_dim_v)")) != LT_OK)
        return s;
    const int64_t *os = p->out.sizes;
    if (c->varlen_q && (os[1] != c->out_seqlen || os[2] != c->hq || os[3] != c->dv))
        return lt__fail(LT_ERROR_SHAPE, "out must have shape (%lld, %lld, %lld) (q's, with v_cache's head dim), got "
                        "(%lld, %lld, %lld)", (long long)c->out_seqlen, (long long)c->hq, (long long)c->dv,
                        (long long)os[1], (long long)os[2], (long long)os[3]);
    if (os[0] != c->out_batch || os[1] != c->out_seqlen || os[2] != c->hq || os[3] != c->dv)
        return lt__fail(LT_ERROR_SHAPE, "out must have shape (%lld, %lld, %lld, %lld) (q's, with v_cache's head dim), "
                        "got (%lld, %lld, %lld, %lld)", (long long)c->b, (long long)c->sq, (long long)c->hq,
                        (long long)c->dv, (long long)os[0], (long long)os[1], (long long)os[2], (long long)os[3]);
    int64_t lse[3] = {c->out_batch, c->hq, c->out_seqlen};
    if (c->varlen_q && (p->lse.sizes[1] != c->hq || p->lse.sizes[2] != c->out_seqlen))
        return lt__fail(LT_ERROR_SHAPE, "lse must have shape (%lld, %lld) (heads_q, total_q) with cu_seqlens_q, got "
                        "(%lld, %lld)", (long long)c->hq, (long long)c->out_seqlen, (long long)p->lse.sizes[1],
                        (long long)p->lse.sizes[2]);
    if ((s = lt__kv_small("lse", &p->lse, &p->q, LT_DTYPE_FP32, 3, lse, "(batch, heads_q, seqlen_q)")) != LT_OK)
        return s;
    if (!lt__absent(&p->workspace)) {
        int64_t any[1] = {-1};
        if ((s = lt__kv_small("workspace", &p->workspace, &p->q, LT_DTYPE_FP32, 1, any, "(elements,)")) != LT_OK)
            return s;
        c->workspace = p->workspace.sizes[0];
    }
    if (!lt__absent(&p->alibi_slopes)) {
        const lt_tensor *a = &p->alibi_slopes;
        int64_t one[1] = {c->hq}, two[2] = {c->b, c->hq};
        if ((s = a->ndim == 2 ? lt__kv_small("alibi_slopes", a, &p->q, LT_DTYPE_FP32, 2, two, "(heads_q,) or "
                                             "(batch, heads_q)")
                              : lt__kv_small("alibi_slopes", a, &p->q, LT_DTYPE_FP32, 1, one, "(heads_q,) or "
                                             "(batch, heads_q)")) != LT_OK)
            return s;
        c->alibi = 1;
    }
    if (!lt__absent(&p->cache_leftpad)) {
        int64_t b[1] = {c->b};
        if ((s = lt__kv_small("cache_leftpad", &p->cache_leftpad, &p->q, LT_DTYPE_INT32, 1, b, "(batch,)")) != LT_OK)
            return s;
        c->leftpad = 1;
    }
    if (!lt__absent(&p->sinks)) {
        int64_t pointer = 0;
        if ((s = lt__check_sinks("sinks", &p->sinks, &p->q, c->hq, &pointer)) != LT_OK)
            return s;
        c->sinks = 1;
    }
    return LT_OK;
}

/* Rotary embeddings (checks._rotary): the tables' shape and dtype, new keys, and the positions when they are
 * known here (cache_seqlen; a tensor's values are not read on a GPU: the kernels leave a position past the
 * tables unrotated). */
static lt_status lt__kv_rotary(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    lt_status s;
    int has_cos = !lt__absent(&p->rotary_cos), has_sin = !lt__absent(&p->rotary_sin);
    if (!has_cos && !has_sin) {
        if (!lt__absent(&p->rotary_seqlens))
            return lt__fail(LT_ERROR_INVALID_ARGUMENT, "rotary_seqlens needs rotary_cos and rotary_sin: it is the "
                            "base of their positions");
        return LT_OK;
    }
    if (has_cos != has_sin)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "rotary_cos and rotary_sin must be given together, got only %s",
                        has_cos ? "rotary_cos" : "rotary_sin");
    const lt__named tables[2] = {{"rotary_cos", &p->rotary_cos}, {"rotary_sin", &p->rotary_sin}};
    int64_t any[2] = {-1, -1};
    for (int i = 0; i < 2; i++) {
        if (tables[i].t->dtype != p->q.dtype)
            return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %s but q.dtype is %s; they must match", tables[i].name,
                            lt__dtype_name(tables[i].t->dtype), lt__dtype_name(p->q.dtype));
        if ((s = lt__kv_small(tables[i].name, tables[i].t, &p->q, p->q.dtype, 2, any,
                              "(seqlen_ro, rotary_dim / 2)")) != LT_OK)
            return s;
    }
    const int64_t *cs = p->rotary_cos.sizes, *ss = p->rotary_sin.sizes;
    if (ss[0] != cs[0] || ss[1] != cs[1])
        return lt__fail(LT_ERROR_SHAPE, "rotary_sin must have rotary_cos's shape (%lld, %lld) (seqlen_ro, rotary_dim "
                        "/ 2), got (%lld, %lld)", (long long)cs[0], (long long)cs[1], (long long)ss[0],
                        (long long)ss[1]);
    if (cs[1] < 1 || 2 * cs[1] > c->d)
        return lt__fail(LT_ERROR_SHAPE, "rotary_dim (2 x rotary_cos.sizes[1]) must be in 2..%lld (q's head dim), got "
                        "%lld", (long long)c->d, (long long)(2 * cs[1]));
    if (cs[0] > INT32_MAX / cs[1])
        return lt__fail(LT_ERROR_SHAPE, "rotary_cos must have fewer than 2**31 elements, got (%lld, %lld)",
                        (long long)cs[0], (long long)cs[1]);
    if (lt__absent(&p->k))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "rotary_cos and rotary_sin need new keys (k and v): they rotate "
                        "the new keys and q at the new keys' positions (FlashAttention's rule)");
    if (p->rotary_interleaved != 0 && p->rotary_interleaved != 1)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "rotary_interleaved must be 0 or 1, got %d", p->rotary_interleaved);
    int local = (p->window_left >= 0 && p->window_left < c->capacity) ||
                (p->window_right >= 0 && p->window_right < c->capacity);
    c->rotary_dim = 2 * cs[1], c->seqlen_ro = cs[0], c->rotary_interleaved = p->rotary_interleaved;
    c->rotary_per_query = c->sq > 1 && (p->causal || local);
    int64_t q_span = c->rotary_per_query ? c->sq : (c->sq < 1 ? c->sq : 1);
    int64_t span = c->seqlen_new > q_span ? c->seqlen_new : q_span;
    if (!lt__absent(&p->rotary_seqlens)) {
        int64_t b[1] = {c->b};
        c->rotary_seqlens = 1;
        return lt__kv_small("rotary_seqlens", &p->rotary_seqlens, &p->q, LT_DTYPE_INT32, 1, b, "(batch,)");
    }
    if (c->seqlen_const >= 0 && !c->varlen_new && c->seqlen_const + span > c->seqlen_ro)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "rotary_cos has %lld positions (seqlen_ro) but the call rotates "
                        "positions %lld..%lld (cache_seqlen = %lld): seqlen_ro must be at least %lld",
                        (long long)c->seqlen_ro, (long long)c->seqlen_const, (long long)(c->seqlen_const + span - 1),
                        (long long)c->seqlen_const, (long long)(c->seqlen_const + span));
    return LT_OK;
}

/* qv (mla.with_qv): q's shape with v_cache's head dim, q's dtype and device, a contiguous last dim, no float8
 * cache; and the first head_dim_v columns of q's rows (q.data = qv.data + head_dim_v elements, the same strides),
 * which the split kernel reads as one [qv | q] row. p holds the views (packed: (1, total_q, heads, dim)). */
static lt_status lt__kv_qv(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    lt_status s;
    if (lt__absent(&p->qv))
        return LT_OK;
    if (c->kv_fp8 != 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "qv with a float8 cache is not supported (FlashAttention-3 has no "
                        "such call either)");
    if ((s = lt__kv_data("qv", &p->qv, &p->q, "(batch, seqlen_q, heads_q, head_dim_v)")) != LT_OK)
        return s;
    const int64_t *qs = p->q.sizes, *vs = p->qv.sizes;
    if (vs[0] != qs[0] || vs[1] != qs[1] || vs[2] != qs[2] || vs[3] != c->dv)
        return lt__fail(LT_ERROR_SHAPE, "qv must have shape (%lld, %lld, %lld, %lld) (q's, with v_cache's head dim; "
                        "with cu_seqlens_q the last three), got (%lld, %lld, %lld, %lld)", (long long)qs[0],
                        (long long)qs[1], (long long)qs[2], (long long)c->dv, (long long)vs[0], (long long)vs[1],
                        (long long)vs[2], (long long)vs[3]);
    for (int i = 0; i < 3; i++)
        if (p->qv.strides[i] != p->q.strides[i] && vs[i] > 1)
            return lt__fail(LT_ERROR_SHAPE, "qv.strides[%d] is %lld but q.strides[%d] is %lld: qv and q must be the "
                            "two parts of one row [qv | q] (the split kernel reads them so), with equal strides", i,
                            (long long)p->qv.strides[i], i, (long long)p->q.strides[i]);
    if ((const char *)p->q.data != (const char *)p->qv.data + c->dv * lt__item_bytes(p->q.dtype))
        return lt__fail(LT_ERROR_SHAPE, "q.data must be qv.data + head_dim_v (%lld) elements: the split kernel reads "
                        "each query row as [qv | q] (qv = row[..., :%lld], q = row[..., %lld:]); write qv and q into "
                        "one buffer", (long long)c->dv, (long long)c->dv, (long long)c->dv);
    c->qv = 1;
    return LT_OK;
}

/* How far past its first element a tensor's last one lies (binding._extent); -1 past 2**62. */
static int64_t lt__kv_extent(const lt_tensor *t) {
    int64_t e = t->sizes[3] - 1, part;
    for (int i = 0; i < 3; i++)
        if (__builtin_mul_overflow(t->sizes[i] - 1, t->strides[i], &part) || __builtin_add_overflow(e, part, &e) ||
            e > INT64_MAX / 2)
            return -1;
    return e;
}

/* Fill *c from params (this version's struct: lt__kv_prepare's), or fail with the first problem found
 * (checks.check's order where it matters). */
static lt_status lt__kv_check(const lt_attn_kvcache_params *p, lt__kv_call *c) {
    lt_status s;
    memset(c, 0, sizeof *c);
    if ((s = lt__kv_data("q", &p->q, &p->q, "(batch, seqlen_q, heads_q, head_dim)")) != LT_OK)
        return s;
    const char *cache = "(batch_cache or num_blocks, seqlen_cache or page_size, heads_k, head_dim)";
    if ((s = lt__kv_cache("k_cache", &p->k_cache, p, cache)) != LT_OK ||
        (s = lt__kv_cache("v_cache", &p->v_cache, p, cache)) != LT_OK)
        return s;
    c->kv_fp8 = lt__is_fp8(p->k_cache.dtype) ? p->k_cache.dtype : 0;
    const int64_t *qs = p->q.sizes, *ks = p->k_cache.sizes, *vs = p->v_cache.sizes;
    c->b = qs[0], c->sq = qs[1], c->hq = qs[2], c->d = qs[3], c->hk = ks[2], c->dv = vs[3];
    if ((s = lt__kv_varlen_q(p, c)) != LT_OK)
        return s;
    if (vs[0] != ks[0] || vs[1] != ks[1] || vs[2] != ks[2])
        return lt__fail(LT_ERROR_SHAPE, "v_cache must have k_cache's first three dims (%lld, %lld, %lld) (its head "
                        "dim may differ: head_dim_v), got (%lld, %lld, %lld, %lld)", (long long)ks[0],
                        (long long)ks[1], (long long)ks[2], (long long)vs[0], (long long)vs[1], (long long)vs[2],
                        (long long)vs[3]);
    if (ks[3] != c->d)
        return lt__fail(LT_ERROR_SHAPE, "k_cache has head dim %lld but q has head dim %lld", (long long)ks[3],
                        (long long)c->d);
    if (c->d < 1 || c->d > LT__MAX_HEAD_DIM)
        return lt__fail(LT_ERROR_HEAD_DIM, "head dim (q.sizes[3]) must be in 1..%d, got %lld", LT__MAX_HEAD_DIM,
                        (long long)c->d);
    if (c->dv < 1 || c->dv > LT__MAX_HEAD_DIM_V)
        return lt__fail(LT_ERROR_HEAD_DIM, "v_cache's head dim (head_dim_v, v_cache.sizes[3]) must be in 1..%d, got "
                        "%lld", LT__MAX_HEAD_DIM_V, (long long)c->dv);
    if (c->hk == 0 || c->hq % c->hk != 0)
        return lt__fail(LT_ERROR_SHAPE, "q heads (%lld) must be a multiple of k_cache heads (%lld) for GQA/MQA",
                        (long long)c->hq, (long long)c->hk);
    if (p->causal != 0 && p->causal != 1)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "causal is %d; expected 0 or 1 (bottom-right)", p->causal);
    if ((s = lt__kv_layout(p, c)) != LT_OK || (s = lt__kv_lengths(p, c)) != LT_OK)
        return s;
    int64_t big = c->capacity + c->sq;
    big = c->b * c->sq * c->hq > big ? c->b * c->sq * c->hq : big;
    big = c->out_seqlen * c->hq > big ? c->out_seqlen * c->hq : big; /* packed: total_q x heads_q */
    big = c->cache_rows * (ks[1] > 1 ? ks[1] : 1) > big ? c->cache_rows * (ks[1] > 1 ? ks[1] : 1) : big;
    big = c->seqlen_new * c->hk > big ? c->seqlen_new * c->hk : big; /* kv_append's rows */
    if (c->b > 65535 || c->hk > 65535 || big > INT32_MAX)
        return lt__fail(LT_ERROR_SHAPE, "batch and heads_k must be <= 65535 and lengths < 2**31; got q (%lld, %lld, "
                        "%lld, %lld)", (long long)c->b, (long long)c->sq, (long long)c->hq, (long long)c->d);
    if (isinf(p->sm_scale))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "sm_scale is %g; expected a finite value, or NaN for "
                        "1/sqrt(head_dim)", p->sm_scale);
    if (p->num_splits < 0 || p->num_splits > 256)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "num_splits must be in 0..256 (0: the heuristic), got %d",
                        p->num_splits);
    if (p->flags != 0 || p->reserved != 0 || p->reserved3 != 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "flags, reserved and reserved3 must be 0, got 0x%x, 0x%x and 0x%x",
                        p->flags, p->reserved, p->reserved3);
    if ((s = lt__kv_features(p, c)) != LT_OK || (s = lt__kv_outputs(p, c)) != LT_OK ||
        (s = lt__kv_rotary(p, c)) != LT_OK || (s = lt__kv_chunk(p, c)) != LT_OK ||
        (s = lt__kv_descale("k_descale", &p->k_descale, p, c, 0)) != LT_OK ||
        (s = lt__kv_descale("v_descale", &p->v_descale, p, c, 1)) != LT_OK || (s = lt__kv_qv(p, c)) != LT_OK)
        return s;
    /* mla.with_qv: the default scale counts qv's columns */
    c->scale = isnan(p->sm_scale) ? (float)(1.0 / sqrt((double)(c->d + (c->qv ? c->dv : 0)))) : (float)p->sm_scale;
    c->num_splits = p->num_splits, c->causal = p->causal && c->sq > 1;
    c->dtype = p->q.dtype, c->device_type = p->q.device_type, c->device_index = p->q.device_index;
    c->lse_rows = c->out_batch * c->hq * c->out_seqlen;
    const lt_tensor *data[19] = {&p->q, &p->k_cache, &p->v_cache, &p->out, &p->lse, &p->k, &p->v,
                                 &p->cache_seqlens, &p->cache_batch_idx, &p->block_table, &p->alibi_slopes,
                                 &p->cache_leftpad, &p->rotary_cos, &p->rotary_sin, &p->rotary_seqlens, &p->sinks,
                                 &p->cu_seqlens_q, &p->qv, &p->cu_seqlens_k_new};
    static const char *names[19] = {"q", "k_cache", "v_cache", "out", "lse", "k", "v", "cache_seqlens",
                                    "cache_batch_idx", "block_table", "alibi_slopes", "cache_leftpad",
                                    "rotary_cos", "rotary_sin", "rotary_seqlens", "sinks", "cu_seqlens_q", "qv",
                                    "cu_seqlens_k_new"};
    for (int i = 0; i < 19; i++)
        if (data[i]->data == NULL && data[i]->ndim != 0 && lt__numel(data[i]) > 0)
            return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", names[i]);
    if (c->workspace > 0 && p->workspace.data == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "workspace.data is NULL");
    /* binding.layout_flags: pointers, outer strides and extents of q, the caches and out (out spans more than q
       when head_dim_v > head_dim). */
    const lt_tensor *ts[4] = {&p->q, &p->k_cache, &p->v_cache, &p->out};
    uint64_t bits = 0;
    int64_t extent = 0;
    for (int i = 0; i < 4; i++) {
        bits |= (uint64_t)(uintptr_t)ts[i]->data | (uint64_t)(ts[i]->strides[0] | ts[i]->strides[1] |
                                                               ts[i]->strides[2]);
        int64_t e = lt__kv_extent(ts[i]);
        if (e < 0)
            return lt__fail(LT_ERROR_SHAPE, "%s's sizes and strides reach past 2**62 elements", names[i]);
        extent = e > extent ? e : extent;
    }
    c->aligned = (bits & 15) == 0, c->index64 = extent >= INT32_MAX;
    if (lt__kv_appends(c)) { /* kv_append.binding.layout_flags: k, v and the caches */
        const lt_tensor *as[4] = {&p->k, &p->v, &p->k_cache, &p->v_cache};
        static const char *as_names[4] = {"k", "v", "k_cache", "v_cache"};
        bits = 0, extent = 0;
        for (int i = 0; i < 4; i++) {
            bits |= (uint64_t)(uintptr_t)as[i]->data | (uint64_t)(as[i]->strides[0] | as[i]->strides[1] |
                                                                   as[i]->strides[2]);
            int64_t e = lt__kv_extent(as[i]);
            if (e < 0)
                return lt__fail(LT_ERROR_SHAPE, "%s's sizes and strides reach past 2**62 elements", as_names[i]);
            extent = e > extent ? e : extent;
        }
        c->append_aligned = (bits & 15) == 0, c->append_index64 = extent >= INT32_MAX;
    }
    /* What the call writes (out, lse, the workspace; the caches when it appends) owns its memory. */
    int append = c->seqlen_new > 0;
    const lt__named outputs[5] = {{"out", &p->out}, {"lse", &p->lse}, {"workspace", &p->workspace},
                                  {"k_cache", &p->k_cache}, {"v_cache", &p->v_cache}};
    const lt__named inputs[19] = {{"q", &p->q}, {"k", &p->k}, {"v", &p->v}, {"cache_seqlens", &p->cache_seqlens},
                                  {"cache_batch_idx", &p->cache_batch_idx}, {"block_table", &p->block_table},
                                  {"alibi_slopes", &p->alibi_slopes}, {"cache_leftpad", &p->cache_leftpad},
                                  {"rotary_cos", &p->rotary_cos}, {"rotary_sin", &p->rotary_sin},
                                  {"rotary_seqlens", &p->rotary_seqlens}, {"sinks", &p->sinks},
                                  {"cu_seqlens_q", &p->cu_seqlens_q}, {"k_descale", &p->k_descale},
                                  {"v_descale", &p->v_descale}, {"qv", &p->qv},
                                  {"cu_seqlens_k_new", &p->cu_seqlens_k_new}, {"k_cache", &p->k_cache},
                                  {"v_cache", &p->v_cache}};
    return lt__check_writes(outputs, append ? 5 : 3, inputs, append ? 17 : 19);
}

/* ------------------------------------------------------------------------- */
/* Plans: both kernels of a shape class, resolved once through the planner.   */

/* binding.kv_pairs: a float8 cache's (sequence, key/value head) pairs, 0 for a 16-bit cache. */
static int64_t lt__kv_pairs(const lt__kv_call *c) { return c->kv_fp8 != 0 ? c->b * c->hk : 0; }

static lt__plan_key lt__kv_key_of(const lt__kv_call *c) {
    lt__plan_key key;
    memset(&key, 0, sizeof key);
    /* flash_decode.dispatch.page_block_limit: it caps BLOCK_N and, under GATHER_BELOW, sets PAGE_GATHER */
    int32_t page_bits = c->paged ? lt__bits((c->page_size & -c->page_size) + 1) : 0;
    key.kernel = LT__KERNEL_DECODE, key.device_index = c->device_index, key.dtype = c->dtype;
    key.head_dim = (int32_t)c->d, key.causal = c->causal, key.aligned = c->aligned, key.index64 = c->index64;
    key.sq_bits = lt__bits(c->hq / c->hk * c->sq), key.sk_bits = lt__bits(c->capacity);
    key.varlen = c->paged | (c->window_left >= 0) << 1 | c->softcap_on << 2 | c->alibi << 3 | page_bits << 8;
    key.varlen |= lt__kv_appends(c) << 4 | c->append_aligned << 5 | c->append_index64 << 6; /* kv_append */
    key.varlen |= c->leftpad << 7 | (c->rotary_dim > 0) << 16 | c->rotary_interleaved << 17;
    key.varlen |= c->sinks << 18 | c->varlen_q << 19 | (c->attention_chunk > 0) << 20;
    key.varlen |= (c->kv_fp8 == LT_DTYPE_FP8_E4M3) << 21 | (c->kv_fp8 == LT_DTYPE_FP8_E5M2) << 22 | c->qv << 23;
    key.varlen |= c->varlen_new << 24;
    /* a float8 cache's split tiles follow the (sequence, key/value head) pairs (flash_decode.dispatch's
       FP8_CUDA_TILES), whose least counts are powers of two: the count's bit length keeps the classes apart */
    key.varlen |= lt__bits(lt__kv_pairs(c) + 1) << 25;
    key.head_dim_v = (int32_t)c->dv;
    return key;
}

static lt_status lt__kv_make_plan(const lt__kv_call *c, lt__kvcache_plan **out) {
    lt_status s;
    lt__CUcontext context;
    int32_t capability;
    if ((s = lt__device_context(c->device_index, &context, &capability)) != LT_OK)
        return s;
    lt__kvcache_plan *plan = (lt__kvcache_plan *)calloc(1, sizeof *plan);
    if (plan == NULL)
        return lt__fail(LT_ERROR_INTERNAL, "out of memory");
    lt__kvcache_plan_request *r = &plan->r;
    r->device_index = c->device_index, r->dtype = c->dtype, r->head_dim = (int32_t)c->d, r->causal = c->causal;
    r->aligned = c->aligned, r->index64 = c->index64, r->paged = c->paged, r->window = c->window_left >= 0;
    r->softcap = c->softcap_on, r->alibi = c->alibi, r->leftpad = c->leftpad;
    r->rotary = c->rotary_dim > 0, r->rotary_interleaved = c->rotary_interleaved;
    r->sinks = c->sinks, r->varlen_q = c->varlen_q, r->chunk = c->attention_chunk > 0, r->kv_fp8 = c->kv_fp8;
    r->qv = c->qv, r->kv_pairs = lt__kv_pairs(c);
    r->rows = c->hq / c->hk * c->sq, r->capacity = c->capacity, r->page_size = c->page_size;
    r->head_dim_v = (int32_t)c->dv, r->append = lt__kv_appends(c);
    r->append_aligned = c->append_aligned, r->append_index64 = c->append_index64, r->varlen_new = c->varlen_new;
    if ((s = (lt_status)lt__py_kvcache_plan(r)) != LT_OK) {
        free(plan);
        return s;
    }
    r->variant[sizeof r->variant - 1] = '\0';
    if (r->split_function == 0 || r->combine_function == 0 || r->split_block_m == 0 || r->split_block_n == 0 ||
        r->combine_block_m == 0 || r->slots <= 0 || r->split_hidden > LT__MAX_HIDDEN ||
        r->combine_hidden > LT__MAX_HIDDEN ||
        (r->append && (r->append_function == 0 || r->append_block_m == 0 || r->append_hidden > LT__MAX_HIDDEN)) ||
        (r->varlen_new && (r->lengths_function == 0 || r->lengths_block == 0 || r->lengths_hidden > LT__MAX_HIDDEN))) {
        s = lt__fail(LT_ERROR_INTERNAL, "the planner answered an unusable decoding plan for %s", r->variant);
        free(plan);
        return s;
    }
    plan->magic = LT__KVCACHE_PLAN_MAGIC, plan->key = lt__kv_key_of(c), plan->context = context;
    *out = plan;
    return LT_OK;
}

/* The workspace's first elements, with packed new keys: the int32 lengths after the append (kv_append_lengths),
 * rounded up to 4 elements (16 bytes) so that the partial results after them keep the workspace's alignment. */
static int64_t lt__kv_lengths_elements(const lt__kv_call *c) { return c->varlen_new ? (c->b + 3) / 4 * 4 : 0; }

/* Packed queries: every sequence's rows a key/value head (group x total_q, Call.packed_rows); else -1. */
static int64_t lt__kv_packed_rows(const lt__kv_call *c) { return c->varlen_q ? c->hq / c->hk * c->out_seqlen : -1; }

/* The split count: the heuristic's (or the forced one), capped by what the workspace holds. */
static int64_t lt__kv_splits(const lt__kvcache_plan *plan, const lt__kv_call *c) {
    const lt__kvcache_plan_request *r = &plan->r;
    int64_t n = lt__splits_for(c->b, c->hq, c->hk, c->sq, c->dv, c->capacity, c->window_left, c->window_right,
                               c->attention_chunk, c->num_splits, r->split_block_m, r->split_block_n, r->slots,
                               r->min_keys, c->lse_rows, lt__kv_packed_rows(c));
    int64_t per_split = c->lse_rows * (c->dv + 1);
    int64_t fits = per_split > 0 ? (c->workspace - lt__kv_lengths_elements(c)) / per_split : 0;
    return n < fits ? n : (fits > 1 ? fits : 1);
}

#define LT__PTR(t) ((int64_t)(uintptr_t)(t).data)
#define LT__OR_LSE(t) (lt__absent(&(t)) ? LT__PTR(p->lse) : LT__PTR(t))
#define LT__OR_K(t) (lt__absent(&(t)) ? LT__PTR(p->k) : LT__PTR(t))
#define LT__OR_Q(t) (lt__absent(&(t)) ? LT__PTR(p->q) : LT__PTR(t))

/* kv_append: the new keys and values into the caches (quantised into a float8 one), its parameters in its
 * description's order (kv_append.binding.c_initializer); an absent descale's pointer is k's, unread, and so is
 * k's for cu_seqlens_k_new without packed new keys. Packed new keys: one batch of total_new rows (VARLEN). */
static lt_status lt__kv_append(const lt__kvcache_plan *plan, const lt_attn_kvcache_params *p, const lt__kv_call *c,
                               void *stream) {
    const lt__kvcache_plan_request *r = &plan->r;
    int64_t ints[LT__APPEND_PARAMS + LT__MAX_HIDDEN] = {
        LT__PTR(p->k), LT__PTR(p->v), LT__PTR(p->k_cache), LT__PTR(p->v_cache), LT__OR_K(p->cache_seqlens),
        LT__OR_K(p->cache_batch_idx), LT__OR_K(p->block_table), LT__OR_K(p->rotary_cos), LT__OR_K(p->rotary_sin),
        LT__OR_K(p->rotary_seqlens), LT__OR_K(p->k_descale), LT__OR_K(p->v_descale),
        c->varlen_new ? LT__PTR(p->cu_seqlens_k_new) : LT__PTR(p->k), p->k.strides[0], p->k.strides[1], p->k.strides[2],
        p->v.strides[0], p->v.strides[1], p->v.strides[2], p->k_cache.strides[0], p->k_cache.strides[1],
        p->k_cache.strides[2], p->v_cache.strides[0], p->v_cache.strides[1], p->v_cache.strides[2],
        c->paged ? p->block_table.strides[0] : 0, c->descale_strides[0][0], c->descale_strides[0][1],
        c->descale_strides[1][0], c->descale_strides[1][1], c->hk, c->seqlen_new, c->d, c->dv,
        c->seqlen_const > 0 ? c->seqlen_const : 0, c->use_seqlens, c->use_batch_idx, c->page_size, c->capacity,
        c->cache_rows, c->rotary_dim, c->seqlen_ro, c->rotary_seqlens, c->descale[0] != 0, c->descale[1] != 0, c->b};
    void *params[LT__APPEND_PARAMS + LT__MAX_HIDDEN];
    for (int i = 0; i < LT__APPEND_PARAMS + (int)r->append_hidden; i++)
        params[i] = &ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only */
    return lt__cu_launch((lt__CUfunction)(uintptr_t)r->append_function, plan->context,
                         (unsigned int)(c->seqlen_new > 0 ? lt__ceil_div(c->seqlen_new * c->hk, r->append_block_m) : 1),
                         c->varlen_new ? 1u : (unsigned int)c->b, 1, r->append_threads, r->append_shared, stream,
                         params);
}

/* kv_append_lengths: each sequence's length after a packed append, int32, into lens (the workspace's front), its
 * parameters in its description's order (kv_append.lengths.c_initializer). */
static lt_status lt__kv_lengths_launch(const lt__kvcache_plan *plan, const lt_attn_kvcache_params *p,
                                       const lt__kv_call *c, int64_t lens, void *stream) {
    const lt__kvcache_plan_request *r = &plan->r;
    int64_t ints[LT__LENGTHS_PARAMS + LT__MAX_HIDDEN] = {
        LT__OR_K(p->cache_seqlens), LT__PTR(p->cu_seqlens_k_new), lens, c->b,
        c->seqlen_const > 0 ? c->seqlen_const : 0, c->use_seqlens};
    void *params[LT__LENGTHS_PARAMS + LT__MAX_HIDDEN];
    for (int i = 0; i < LT__LENGTHS_PARAMS + (int)r->lengths_hidden; i++)
        params[i] = &ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only */
    return lt__cu_launch((lt__CUfunction)(uintptr_t)r->lengths_function, plan->context,
                         (unsigned int)lt__ceil_div(c->b, r->lengths_block), 1, 1, r->lengths_threads,
                         r->lengths_shared, stream, params);
}

/* The launches: kv_append (new keys), then both decoding kernels, each kernel's parameters in its description's
 * order (binding.c_initializer); an absent descale's pointer is lse's, unread, and so are the key mask's (the C API
 * takes none: KEY_MASK is off, its strides 0) and the fused combine's counters (its plans leave FUSED_COMBINE off:
 * flash_decode.dispatch.FUSED_COMBINE_BY_DEFAULT). */
static lt_status lt__kv_launch(const lt__kvcache_plan *plan, const lt_attn_kvcache_params *p, const lt__kv_call *c,
                               void *stream) {
    const lt__kvcache_plan_request *r = &plan->r;
    lt_status s;
    /* Packed new keys' lengths first (from the call's inputs): kv_append is the last launch before the split
       kernel, a rotary call's split kernel being its programmatic dependent. */
    int64_t lens = LT__PTR(p->workspace);
    int attends = c->lse_rows * c->dv != 0 && c->sq != 0;
    if (attends && c->varlen_new && (s = lt__kv_lengths_launch(plan, p, c, lens, stream)) != LT_OK)
        return s;
    if (lt__kv_appends(c) && c->b * c->hk > 0 && (s = lt__kv_append(plan, p, c, stream)) != LT_OK)
        return s;
    if (!attends)
        return LT_OK;
    /* Packed new keys: the split kernel reads the lengths after the append (seqlen_new 0), cache_seqlens as the
       rotary base (flash_decode.binding.after_packed_append). */
    int64_t seqlen_new = c->varlen_new ? 0 : c->seqlen_new;
    int64_t seqlens = c->varlen_new ? lens : LT__OR_LSE(p->cache_seqlens);
    int64_t use_seqlens = c->varlen_new ? 1 : c->use_seqlens, seqlen_const = c->varlen_new ? 0 : c->seqlen_const;
    int64_t bases = c->varlen_new && c->rotary_dim > 0 && !c->rotary_seqlens ? LT__PTR(p->cache_seqlens)
                                                                              : LT__OR_LSE(p->rotary_seqlens);
    int64_t use_bases = c->rotary_seqlens || (c->varlen_new && c->rotary_dim > 0);
    int64_t splits = lt__kv_splits(plan, c), n_rows = c->lse_rows;
    int64_t work = LT__PTR(p->workspace) + 4 * lt__kv_lengths_elements(c);
    int64_t part_out = splits > 1 ? work : LT__PTR(p->lse);
    int64_t part_lse = splits > 1 ? part_out + 4 * n_rows * splits * c->dv : LT__PTR(p->lse);
    const lt_tensor *q = &p->q, *kc = &p->k_cache, *vc = &p->v_cache, *o = &p->out;
    int64_t split_ints[LT__DECODE_SPLIT_PARAMS - LT__DECODE_SPLIT_FLOATS + LT__MAX_HIDDEN] = {
        c->qv ? LT__PTR(p->qv) : LT__PTR(p->q), LT__PTR(p->k_cache), LT__PTR(p->v_cache), LT__PTR(p->out), LT__PTR(p->lse), part_out,
        part_lse, seqlens, LT__OR_LSE(p->cache_batch_idx), LT__OR_LSE(p->block_table),
        LT__OR_LSE(p->alibi_slopes), LT__OR_LSE(p->cache_leftpad), LT__OR_Q(p->rotary_cos), LT__OR_Q(p->rotary_sin),
        bases, LT__OR_LSE(p->sinks), LT__OR_LSE(p->cu_seqlens_q),
        LT__OR_LSE(p->k_descale), LT__OR_LSE(p->v_descale), LT__PTR(p->lse), LT__PTR(p->lse), q->strides[0],
        q->strides[1], q->strides[2],
        kc->strides[0], kc->strides[1], kc->strides[2], vc->strides[0], vc->strides[1], vc->strides[2], o->strides[0], o->strides[1], o->strides[2],
        c->paged ? p->block_table.strides[0] : 0, p->alibi_slopes.ndim == 2 ? p->alibi_slopes.strides[0] : 0,
        c->descale_strides[0][0], c->descale_strides[0][1], c->descale_strides[1][0], c->descale_strides[1][1], 0, 0,
        c->hq / c->hk, c->hq, c->out_seqlen, c->d, c->dv, seqlen_const > 0 ? seqlen_const : 0, seqlen_new,
        use_seqlens, c->use_batch_idx, c->page_size, splits, c->window_left, c->window_right, c->attention_chunk,
        c->rotary_dim, c->seqlen_ro, use_bases, c->rotary_per_query, c->descale[0] != 0, c->descale[1] != 0};
    float floats[LT__DECODE_SPLIT_FLOATS] = {c->scale, c->softcap};
    void *params[LT__DECODE_SPLIT_PARAMS + LT__MAX_HIDDEN];
    int n_ints = LT__DECODE_SPLIT_PARAMS - LT__DECODE_SPLIT_FLOATS;
    for (int i = 0; i < n_ints; i++)
        params[i] = &split_ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only */
    for (int i = 0; i < LT__DECODE_SPLIT_FLOATS; i++)
        params[n_ints + i] = &floats[i];
    for (uint32_t h = 0; h < r->split_hidden; h++)
        params[LT__DECODE_SPLIT_PARAMS + h] = &split_ints[n_ints + h]; /* zero: NULL scratch */
    int64_t blocks = lt__split_row_blocks(c->hq / c->hk * c->sq, r->split_block_m, c->b, lt__kv_packed_rows(c));
    s = lt__cu_launch_as((lt__CUfunction)(uintptr_t)r->split_function, plan->context,
                         (unsigned int)(blocks * splits), (unsigned int)c->hk, (unsigned int)c->b, r->split_threads,
                         r->split_shared, stream, params, r->split_dependent);
    if (s != LT_OK || splits == 1)
        return s;
    int64_t combine_ints[LT__DECODE_COMBINE_PARAMS + LT__MAX_HIDDEN] = {
        part_out, part_lse, LT__PTR(p->out), LT__PTR(p->lse), LT__OR_LSE(p->sinks), o->strides[0], o->strides[1],
        o->strides[2], c->hq, c->out_seqlen, c->dv, splits, n_rows};
    void *combine_params[LT__DECODE_COMBINE_PARAMS + LT__MAX_HIDDEN];
    for (int i = 0; i < LT__DECODE_COMBINE_PARAMS + (int)r->combine_hidden; i++)
        combine_params[i] = &combine_ints[i];
    return lt__cu_launch_as((lt__CUfunction)(uintptr_t)r->combine_function, plan->context,
                            (unsigned int)lt__ceil_div(n_rows, r->combine_block_m), 1, 1, r->combine_threads,
                            r->combine_shared, stream, combine_params, r->combine_dependent);
}

/* ------------------------------------------------------------------------- */
/* The API.                                                                   */

LT_API lt_status lt_attn_kvcache_params_init(lt_attn_kvcache_params *params) {
    if (params == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_attn_kvcache_params_init: params is NULL");
    memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params, params->version = LT_ATTN_KVCACHE_PARAMS_VERSION;
    params->cache_seqlen = -1, params->window_left = -1, params->window_right = -1;
    params->sm_scale = NAN, params->rotary_interleaved = 1, params->max_seqlen_q = -1;
    return LT_OK;
}

LT_API lt_status lt_attn_kvcache_workspace_size(const lt_attn_kvcache_params *params, size_t *bytes) {
    lt__kv_call c;
    lt_attn_kvcache_params norm, view;
    lt_status s;
    if (bytes == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_attn_kvcache_workspace_size: bytes (the out pointer) is NULL");
    *bytes = 0;
    if ((s = lt__kv_prepare(params, &norm, &view)) != LT_OK || (s = lt__kv_check(&view, &c)) != LT_OK)
        return s;
    int64_t splits = c.num_splits > 0 ? c.num_splits : LT__MAX_HEURISTIC_SPLITS;
    *bytes = (size_t)(4 * (c.lse_rows * (c.dv + 1) * splits + lt__kv_lengths_elements(&c)));
    return LT_OK;
}

LT_API lt_status lt_attn_kvcache(const lt_attn_kvcache_params *user, void *stream) {
    lt__kv_call c;
    lt_attn_kvcache_params norm, view, *params = &view;
    lt_status s;
    if ((s = lt__require_init()) != LT_OK || (s = lt__kv_prepare(user, &norm, &view)) != LT_OK ||
        (s = lt__kv_check(params, &c)) != LT_OK)
        return s;
    if (c.device_type == LT_DEVICE_CPU)
        return (lt_status)lt__py_attn_kvcache_cpu(&norm); /* the caller's layout: Python checks and packs it again */
    if (c.varlen_new && c.lse_rows * c.dv > 0 && c.sq > 0 && c.workspace < lt__kv_lengths_elements(&c))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "workspace holds %lld elements but cu_seqlens_k_new (packed new "
                        "keys) on a GPU needs at least %lld at its front for each sequence's length after the append: "
                        "size it with lt_attn_kvcache_workspace_size", (long long)c.workspace,
                        (long long)lt__kv_lengths_elements(&c));
    if (c.varlen_new && c.rotary_dim > 0 && !c.rotary_seqlens && !c.use_seqlens)
        return lt__fail(LT_ERROR_UNSUPPORTED, "cu_seqlens_k_new with rotary tables and a constant cache_seqlen on a "
                        "GPU needs rotary_seqlens or cache_seqlens (a tensor): the rotary base of each sequence");
    if ((c.lse_rows * c.dv == 0 || c.sq == 0) && (c.seqlen_new == 0 || c.b * c.hk == 0))
        return LT_OK; /* nothing to attend and nothing to append */
    lt__plan_key key = lt__kv_key_of(&c);
    lt__kvcache_plan *plan = lt__memo_find(&key);
    if (plan != NULL)
        return lt__kv_launch(plan, params, &c, stream);
    lt__kvcache_plan *made = NULL;
    if ((s = lt__kv_make_plan(&c, &made)) != LT_OK)
        return s;
    plan = lt__memo_add(&key, made);
    s = lt__kv_launch(plan != NULL ? plan : made, params, &c, stream);
    if (plan != made)
        free(made); /* another thread's plan was kept, or the table is full */
    return s;
}
