/*
 * lt_check.c: the checks of an attention call, in C: everything
 * lazytriton.flash.attn_fwd's validation checks, with messages that name the
 * argument, its value and what was expected. Included by lazytriton.c (one
 * translation unit), after lt__fail.
 */

#define LT__MAX_HEAD_DIM 256
#define LT__MAX_STRIDE (INT64_C(1) << 48)

typedef struct {
    int64_t b, hq, hk, sq, sk, d;
    int64_t dv; /* v's head dim (out's, dout's, dv's): may differ from d, q's and k's */
    int32_t dtype, device_type, device_index, causal;
    int aligned, index64, empty;
    int64_t offset;
    float scale;
    int64_t cu_seqlens_q, cu_seqlens_k; /* the varlen kernels' pointers; 0 in a dense call */
    int64_t seqused_q, seqused_k;       /* the varlen kernels' used-length pointers; 0 when absent */
    int varlen;                         /* packed sequences: b, sq, sk are 1, total_q, total_k (the kernels' view) */
    int64_t batch, max_sq, max_sk;      /* varlen: the grid's z and the seqlens dispatch buckets */
    int64_t window_left, window_right;  /* the kernel's window (binding.with_features): -1, -1 when off */
    float softcap;                      /* 0: off */
    int64_t sinks;                      /* the forward kernel's Sinks pointer; 0 when absent */
    int64_t attention_chunk;            /* the kernels' chunk (binding.with_chunk): 0 when off */
    int64_t dsinks;                     /* the backward's dsinks pointer (lt_bwd.c's lt__check_dsinks); 0 when absent */
    int fp8;                            /* e4m3 or e5m2 q, k, v: flash_fwd_fp8 (v transposed, out bf16) */
    int64_t descale[3];                 /* FP8: q_descale, k_descale, v_descale pointers (0: absent, read as 1.0) */
    int64_t descale_strides[3][2];      /* FP8: each descale's (batch, kv head) strides, 0 on a broadcast dim */
    int64_t workspace, workspace_bytes; /* the caller's scratch memory (version 8): its pointer and bytes */
    int workspace_given;                /* a workspace is given (its bytes may still be 0) */
} lt__call;

static const char *lt__dtype_name(int32_t dtype) {
    switch (dtype) {
    case LT_DTYPE_FP16: return "fp16";
    case LT_DTYPE_BF16: return "bf16";
    case LT_DTYPE_FP32: return "fp32";
    case LT_DTYPE_FP8_E4M3: return "e4m3";
    case LT_DTYPE_FP8_E5M2: return "e5m2";
    default: return "unknown";
    }
}

/* A version 1 struct: everything before the packed-sequence fields; version 2: before the window; version 3:
 * before the used lengths; version 4: before the sinks; version 5: before attention_chunk; version 6: before the
 * FP8 fields. */
#define LT__FWD_PARAMS_V1_SIZE offsetof(lt_attn_fwd_params, cu_seqlens_q)
#define LT__FWD_PARAMS_V2_SIZE offsetof(lt_attn_fwd_params, window_left)
#define LT__FWD_PARAMS_V3_SIZE offsetof(lt_attn_fwd_params, seqused_q)
#define LT__FWD_PARAMS_V4_SIZE offsetof(lt_attn_fwd_params, sinks)
#define LT__FWD_PARAMS_V5_SIZE offsetof(lt_attn_fwd_params, attention_chunk)
#define LT__FWD_PARAMS_V6_SIZE offsetof(lt_attn_fwd_params, q_descale)
#define LT__FWD_PARAMS_V7_SIZE offsetof(lt_attn_fwd_params, workspace)
#define LT__MAX_WINDOWED_SEQLEN (INT64_C(1) << 29) /* binding.MAX_WINDOWED_SEQLEN: 32-bit row +- window */
#define LT__MAX_CHUNK (INT64_C(1) << 30)          /* arguments.MAX_CHUNK: a chunk that holds every key */

static lt_status lt__check_struct(const lt_attn_fwd_params *p) {
    if (p == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "params is NULL");
    if ((p->struct_size == LT__FWD_PARAMS_V1_SIZE && p->version == 1) ||
        (p->struct_size == LT__FWD_PARAMS_V2_SIZE && p->version == 2) ||
        (p->struct_size == LT__FWD_PARAMS_V3_SIZE && p->version == 3) ||
        (p->struct_size == LT__FWD_PARAMS_V4_SIZE && p->version == 4) ||
        (p->struct_size == LT__FWD_PARAMS_V5_SIZE && p->version == 5) ||
        (p->struct_size == LT__FWD_PARAMS_V6_SIZE && p->version == 6) ||
        (p->struct_size == LT__FWD_PARAMS_V7_SIZE && p->version == 7))
        return LT_OK; /* read as the call it always was: no FP8 (no chunk before 6, no sinks before 5, ...) */
    if (p->struct_size != sizeof(lt_attn_fwd_params))
        return lt__fail(LT_ERROR_VERSION,
                        "params->struct_size is %u but this lazytriton %d.%d.%d takes %zu: rebuild against its "
                        "lazytriton.h and fill params with lt_attn_fwd_params_init()",
                        p->struct_size, LT_VERSION_MAJOR, LT_VERSION_MINOR, LT_VERSION_PATCH,
                        sizeof(lt_attn_fwd_params));
    if (p->version != LT_ATTN_FWD_PARAMS_VERSION)
        return lt__fail(LT_ERROR_VERSION, "params->version is %u but this lazytriton takes version %d", p->version,
                        LT_ATTN_FWD_PARAMS_VERSION);
    return LT_OK;
}

static int lt__is_fp8(int32_t dtype) { return dtype == LT_DTYPE_FP8_E4M3 || dtype == LT_DTYPE_FP8_E5M2; }

/* A data tensor's dtype (fp16, bf16, fp32; with fp8, also the float8 formats), ndim, sizes, strides, device. */
static lt_status lt__check_data_tensor(const char *name, const lt_tensor *t, int32_t ndim, const char *layout,
                                       int fp8) {
    if ((t->dtype < LT_DTYPE_FP16 || t->dtype > LT_DTYPE_FP32) && !(fp8 && lt__is_fp8(t->dtype)))
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %d; expected LT_DTYPE_FP16 (1), LT_DTYPE_BF16 (2)%s "
                        "LT_DTYPE_FP32 (3)%s", name, t->dtype, fp8 ? "," : " or",
                        fp8 ? ", LT_DTYPE_FP8_E4M3 (5) or LT_DTYPE_FP8_E5M2 (6)" : "");
    if (t->ndim != ndim)
        return lt__fail(LT_ERROR_SHAPE, "%s.ndim is %d; expected %d %s", name, t->ndim, ndim, layout);
    for (int i = 0; i < ndim; i++) {
        if (t->sizes[i] < 0)
            return lt__fail(LT_ERROR_SHAPE, "%s.sizes[%d] is %lld; sizes must be >= 0", name, i,
                            (long long)t->sizes[i]);
        if (t->strides[i] < 0 || t->strides[i] >= LT__MAX_STRIDE)
            return lt__fail(LT_ERROR_SHAPE, "%s.strides[%d] is %lld; strides must be in 0..2**48 elements", name,
                            i, (long long)t->strides[i]);
    }
    if (t->device_type != LT_DEVICE_CPU && t->device_type != LT_DEVICE_CUDA)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s.device_type is %d; expected LT_DEVICE_CPU (1) or "
                        "LT_DEVICE_CUDA (2)", name, t->device_type);
    if (t->device_index < 0 || (t->device_type == LT_DEVICE_CPU && t->device_index != 0))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s.device_index is %d; expected a CUDA ordinal >= 0 (0 on "
                        "the CPU)", name, t->device_index);
    return LT_OK;
}

static lt_status lt__check_tensor(const char *name, const lt_tensor *t, int32_t ndim, const char *layout) {
    return lt__check_data_tensor(name, t, ndim, layout, 0);
}

/* Whether a call asks for packed sequences (a version 2 struct with either cu_seqlens tensor described). */
static int lt__wants_varlen(const lt_tensor *cu_q, const lt_tensor *cu_k) {
    return cu_q->data != NULL || cu_k->data != NULL || cu_q->ndim != 0 || cu_k->ndim != 0;
}

/* A packed (total, heads, head_dim) tensor as the kernels' (1, heads, total, head_dim) view; 2-dim lse
 * (heads, total) as (1, heads, total). The batch stride is never read (the kernels start each sequence's rows
 * at cu_seqlens[i] * the row stride): 0. */
static lt_status lt__packed_view(const char *name, lt_tensor *t, int lse) {
    lt_status s;
    if ((s = lt__check_data_tensor(name, t, lse ? 2 : 3, lse ? "(heads_q, total_q) for packed sequences"
                                   : "(total_tokens, heads, head_dim) for packed sequences", !lse)) != LT_OK)
        return s;
    lt_tensor v = *t;
    v.ndim = lse ? 3 : 4;
    v.sizes[0] = 1, v.strides[0] = 0;
    v.sizes[1] = t->sizes[lse ? 0 : 1], v.strides[1] = t->strides[lse ? 0 : 1];
    v.sizes[2] = t->sizes[lse ? 1 : 0], v.strides[2] = t->strides[lse ? 1 : 0];
    v.sizes[3] = lse ? 0 : t->sizes[2], v.strides[3] = lse ? 0 : t->strides[2];
    *t = v;
    return LT_OK;
}

/* A packed transposed v (heads_k, head_dim_v, total_k), keys contiguous, as the FP8 kernel's (1, heads_k,
 * head_dim_v, total_k) view (batch stride 0). */
static lt_status lt__packed_transposed_view(lt_tensor *t) {
    lt_status s;
    if ((s = lt__check_data_tensor("v", t, 3, "(heads_k, head_dim_v, total_k) for packed sequences with "
                                   "v_transposed", 1)) != LT_OK)
        return s;
    for (int i = 3; i > 0; i--)
        t->sizes[i] = t->sizes[i - 1], t->strides[i] = t->strides[i - 1];
    t->ndim = 4, t->sizes[0] = 1, t->strides[0] = 0;
    return LT_OK;
}

/* A forward call as the checks and the launch read it: norm, the caller's struct as this version's (a version 1
 * struct zero-extended: dense), and view, with packed sequences the kernels' views of its tensors (a dense call's
 * view is norm). A dense call in a struct of this version is read where the caller keeps it: both point at the
 * caller's struct and nothing is copied; otherwise they point at the copies here. */
typedef struct {
    const lt_attn_fwd_params *norm, *view;
    lt_attn_fwd_params norm_copy, view_copy;
} lt__fwd_call;

/* Fill *f from the caller's p, with struct_size and version checked. */
static lt_status lt__fwd_prepare(const lt_attn_fwd_params *p, lt__fwd_call *f) {
    lt_status s;
    if ((s = lt__check_struct(p)) != LT_OK)
        return s;
    if (p->struct_size == sizeof *p && !lt__wants_varlen(&p->cu_seqlens_q, &p->cu_seqlens_k)) {
        f->norm = f->view = p; /* this version's, dense: as the caller keeps it */
        return LT_OK;
    }
    lt_attn_fwd_params *norm = &f->norm_copy, *view = &f->view_copy;
    f->norm = norm, f->view = view;
    memset(norm, 0, sizeof *norm);
    memcpy(norm, p, p->struct_size);
    if (p->struct_size <= LT__FWD_PARAMS_V2_SIZE) /* no window (zeros would mean a window of 0) */
        norm->window_left = -1, norm->window_right = -1;
    norm->struct_size = sizeof *norm, norm->version = LT_ATTN_FWD_PARAMS_VERSION;
    *view = *norm;
    if (!lt__wants_varlen(&norm->cu_seqlens_q, &norm->cu_seqlens_k))
        return LT_OK;
    lt_tensor *ts[4] = {&view->q, &view->k, &view->v, &view->out};
    static const char *names[4] = {"q", "k", "v", "out"};
    for (int i = 0; i < 4; i++)
        if ((s = i == 2 && norm->v_transposed == 1 ? lt__packed_transposed_view(&view->v)
                                                    : lt__packed_view(names[i], ts[i], 0)) != LT_OK)
            return s;
    return lt__packed_view("lse", &view->lse, 1);
}

static int lt__same_sizes(const lt_tensor *a, const lt_tensor *b) {
    return memcmp(a->sizes, b->sizes, sizeof(int64_t) * (size_t)a->ndim) == 0;
}

static lt_status lt__check_tensors(const lt_attn_fwd_params *p) {
    static const char *qkvo = "(batch, heads, seqlen, head_dim)";
    const lt_tensor *ts[4] = {&p->q, &p->k, &p->v, &p->out};
    static const char *names[4] = {"q", "k", "v", "out"};
    lt_status s;
    for (int i = 0; i < 4; i++)
        if ((s = lt__check_data_tensor(names[i], ts[i], 4, i == 2 && p->v_transposed == 1 ?
                                       "(batch, heads_k, head_dim_v, seqlen_k) with v_transposed" : qkvo,
                                       i < 3)) != LT_OK)
            return s;
    if ((s = lt__check_tensor("lse", &p->lse, 3, "(batch, heads_q, seqlen_q)")) != LT_OK)
        return s;
    int fp8 = lt__is_fp8(p->q.dtype);
    for (int i = 1; i < 3; i++) {
        if (ts[i]->dtype != p->q.dtype)
            return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %s but q.dtype is %s; q, k and v must have one dtype",
                            names[i], lt__dtype_name(ts[i]->dtype), lt__dtype_name(p->q.dtype));
    }
    if (p->v_transposed != 0 && p->v_transposed != 1)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "v_transposed is %d; expected 0 or 1", p->v_transposed);
    if (p->v_transposed && !fp8)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "v_transposed is 1 but q.dtype is %s: only the FP8 forward "
                        "(LT_DTYPE_FP8_E4M3 or LT_DTYPE_FP8_E5M2 q, k, v) reads V transposed",
                        lt__dtype_name(p->q.dtype));
    if (fp8 && !p->v_transposed)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "v_transposed is 0 but q is %s: the FP8 forward "
                        "reads V transposed; give v as (batch, heads_k, head_dim_v, seqlen_k) (packed: (heads_k, "
                        "head_dim_v, total_k)), keys contiguous, and set v_transposed = 1",
                        lt__dtype_name(p->q.dtype));
    if (p->out.dtype != (fp8 ? LT_DTYPE_BF16 : p->q.dtype))
        return lt__fail(LT_ERROR_DTYPE, "out.dtype is %s but q.dtype is %s; out must be %s", lt__dtype_name(p->out.dtype),
                        lt__dtype_name(p->q.dtype), fp8 ? "bf16 (the FP8 forward's output, FlashAttention-3's)"
                        : "q's dtype");
    if (p->lse.dtype != LT_DTYPE_FP32)
        return lt__fail(LT_ERROR_DTYPE, "lse.dtype is %s; expected LT_DTYPE_FP32 (the logsumexp is float32)",
                        lt__dtype_name(p->lse.dtype));
    const lt_tensor *all[5] = {&p->q, &p->k, &p->v, &p->out, &p->lse};
    static const char *all_names[5] = {"q", "k", "v", "out", "lse"};
    for (int i = 1; i < 5; i++) {
        if (all[i]->device_type != p->q.device_type || all[i]->device_index != p->q.device_index)
            return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is on %s:%d but q is on %s:%d; all tensors of a call "
                            "must be on one device", all_names[i],
                            all[i]->device_type == LT_DEVICE_CPU ? "cpu" : "cuda", all[i]->device_index,
                            p->q.device_type == LT_DEVICE_CPU ? "cpu" : "cuda", p->q.device_index);
    }
    return LT_OK;
}

static lt_status lt__check_shapes(const lt_attn_fwd_params *p, lt__call *c) {
    const int64_t *qs = p->q.sizes, *ks = p->k.sizes;
    c->b = qs[0], c->hq = qs[1], c->sq = qs[2], c->d = qs[3];
    c->hk = ks[1], c->sk = ks[2], c->dv = p->v.sizes[3];
    if (p->v_transposed == 1) { /* (batch, heads_k, head_dim_v, seqlen_k): compare it as k's layout */
        const int64_t *vs = p->v.sizes;
        c->dv = vs[2];
        if (vs[0] != ks[0] || vs[1] != ks[1] || vs[3] != ks[2])
            return lt__fail(LT_ERROR_SHAPE, "v (v_transposed) must be (batch, heads_k, head_dim_v, seqlen_k) = "
                            "(%lld, %lld, head_dim_v, %lld) (k's), got (%lld, %lld, %lld, %lld)", (long long)ks[0],
                            (long long)ks[1], (long long)ks[2], (long long)vs[0], (long long)vs[1],
                            (long long)vs[2], (long long)vs[3]);
    } else if (memcmp(ks, p->v.sizes, 3 * sizeof(int64_t)) != 0)
        return lt__fail(LT_ERROR_SHAPE, "k and v must have the same shape but for the head dim, got (%lld, %lld, "
                        "%lld, %lld) and "
                        "(%lld, %lld, %lld, %lld)", (long long)ks[0], (long long)ks[1], (long long)ks[2],
                        (long long)ks[3], (long long)p->v.sizes[0], (long long)p->v.sizes[1],
                        (long long)p->v.sizes[2], (long long)p->v.sizes[3]);
    if (ks[0] != c->b)
        return lt__fail(LT_ERROR_SHAPE, "k has batch %lld but q has batch %lld", (long long)ks[0], (long long)c->b);
    if (ks[3] != c->d)
        return lt__fail(LT_ERROR_SHAPE, "k has head dim %lld but q has head dim %lld", (long long)ks[3],
                        (long long)c->d);
    const int64_t *os = p->out.sizes;
    if (os[0] != c->b || os[1] != c->hq || os[2] != c->sq || os[3] != c->dv)
        return lt__fail(LT_ERROR_SHAPE, "out has shape (%lld, %lld, %lld, %lld); expected q's shape with v's head "
                        "dim (%lld, %lld, %lld, %lld)", (long long)os[0], (long long)os[1], (long long)os[2],
                        (long long)os[3], (long long)c->b, (long long)c->hq, (long long)c->sq, (long long)c->dv);
    const int64_t *ls = p->lse.sizes;
    if (ls[0] != c->b || ls[1] != c->hq || ls[2] != c->sq)
        return lt__fail(LT_ERROR_SHAPE, "lse has shape (%lld, %lld, %lld); expected (batch, heads_q, seqlen_q) = "
                        "(%lld, %lld, %lld)", (long long)ls[0], (long long)ls[1], (long long)ls[2], (long long)c->b,
                        (long long)c->hq, (long long)c->sq);
    if (c->d < 1 || c->d > LT__MAX_HEAD_DIM)
        return lt__fail(LT_ERROR_HEAD_DIM, "head dim (q.sizes[3]) must be in 1..%d, got %lld", LT__MAX_HEAD_DIM,
                        (long long)c->d);
    if (c->dv < 1 || c->dv > LT__MAX_HEAD_DIM)
        return lt__fail(LT_ERROR_HEAD_DIM, "v's head dim (v.sizes[3]) must be in 1..%d, got %lld", LT__MAX_HEAD_DIM,
                        (long long)c->dv);
    if (c->hk == 0 || c->hq % c->hk != 0)
        return lt__fail(LT_ERROR_SHAPE, "q heads (%lld) must be a multiple of k/v heads (%lld) for GQA/MQA",
                        (long long)c->hq, (long long)c->hk);
    if (c->sq > INT32_MAX || c->sk > INT32_MAX || c->b > 65535 || c->hq > 65535)
        return lt__fail(LT_ERROR_SHAPE, "seqlens must be < 2**31 and batch, heads <= 65535; got q (%lld, %lld, "
                        "%lld, %lld), k seqlen %lld", (long long)c->b, (long long)c->hq, (long long)c->sq,
                        (long long)c->d, (long long)c->sk);
    return LT_OK;
}

static lt_status lt__check_strides(const lt_attn_fwd_params *p, const lt__call *c) {
    const lt_tensor *ts[4] = {&p->q, &p->k, &p->v, &p->out};
    static const char *names[4] = {"q", "k", "v", "out"};
    for (int i = 0; i < 4; i++)
        if (ts[i]->strides[3] != 1 && ts[i]->sizes[3] > 1)
            return lt__fail(LT_ERROR_SHAPE, "%s.strides[3] is %lld; the last dim must be contiguous (stride 1)",
                            names[i], (long long)ts[i]->strides[3]);
    const int64_t expect[3] = {c->hq * c->sq, c->sq, 1};
    for (int i = 0; i < 3 && c->b * c->hq * c->sq > 0; i++) /* an lse with no elements has no layout */
        if (p->lse.sizes[i] > 1 && p->lse.strides[i] != expect[i])
            return lt__fail(LT_ERROR_SHAPE, "lse must be contiguous: strides (%lld, %lld, 1) for its sizes, got "
                            "(%lld, %lld, %lld)", (long long)expect[0], (long long)expect[1],
                            (long long)p->lse.strides[0], (long long)p->lse.strides[1], (long long)p->lse.strides[2]);
    return LT_OK;
}

/* The offset of t's last element (b, h, s, all sizes > 0), or -1 if it overflows int64. */
static int64_t lt__last_offset(const lt_tensor *t, int64_t b, int64_t h, int64_t s) {
    int64_t parts[3], sum = 0;
    if (__builtin_mul_overflow(b - 1, t->strides[0], &parts[0]) ||
        __builtin_mul_overflow(h - 1, t->strides[1], &parts[1]) ||
        __builtin_mul_overflow(s - 1, t->strides[2], &parts[2]) || __builtin_add_overflow(parts[0], parts[1], &sum) ||
        __builtin_add_overflow(sum, parts[2], &sum) || sum > INT64_MAX / 2)
        return -1;
    return sum;
}

/* One of cu_seqlens_q/cu_seqlens_k: int32, (batch + 1), contiguous, on q's device, with data. */
/* An int32 index vector's layout: contiguous, on q's device. */
static lt_status lt__check_index_layout(const char *name, const lt_tensor *t, const lt_tensor *q) {
    if (t->sizes[0] > 1 && t->strides[0] != 1)
        return lt__fail(LT_ERROR_SHAPE, "%s.strides[0] is %lld; it must be contiguous (1)", name,
                        (long long)t->strides[0]);
    if (t->device_type != q->device_type || t->device_index != q->device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is not on q's device; all tensors of a call must be on one "
                        "device", name);
    return LT_OK;
}

static lt_status lt__check_cu(const char *name, const lt_tensor *t, const lt_tensor *q) {
    if (t->dtype != LT_DTYPE_INT32)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %d; expected LT_DTYPE_INT32 (4)", name, t->dtype);
    if (t->ndim != 1 || t->sizes[0] < 1)
        return lt__fail(LT_ERROR_SHAPE, "%s must be 1-dim with batch + 1 >= 1 entries, got ndim %d, sizes[0] %lld",
                        name, t->ndim, (long long)t->sizes[0]);
    lt_status layout = lt__check_index_layout(name, t, q);
    if (layout != LT_OK)
        return layout;
    if (t->data == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", name);
    return LT_OK;
}

/* Whether a call gives one of seqused_q/seqused_k (a version 4 struct with it described). */
static int lt__given(const lt_tensor *t) { return t->data != NULL || t->ndim != 0; }

/* One of seqused_q/seqused_k, given: int32, (batch), contiguous, on q's device, with data; *pointer its data. */
static lt_status lt__check_used(const char *name, const lt_tensor *t, const lt_tensor *q, int64_t batch,
                                int64_t *pointer) {
    if (t->dtype != LT_DTYPE_INT32)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %d; expected LT_DTYPE_INT32 (4)", name, t->dtype);
    if (t->ndim != 1 || t->sizes[0] != batch)
        return lt__fail(LT_ERROR_SHAPE, "%s must be 1-dim with batch = %lld entries (one used length per sequence), "
                        "got ndim %d, sizes[0] %lld", name, (long long)batch, t->ndim, (long long)t->sizes[0]);
    lt_status layout = lt__check_index_layout(name, t, q);
    if (layout != LT_OK)
        return layout;
    if (t->data == NULL && batch > 0)
        return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", name);
    *pointer = (int64_t)(uintptr_t)t->data;
    return LT_OK;
}

/* The packed-sequence part of a call (p holds the kernels' views): the cumulative lengths, max seqlens, causal. */
static lt_status lt__check_varlen(const lt_attn_fwd_params *p, lt__call *c) {
    lt_status s;
    if ((s = lt__check_cu("cu_seqlens_q", &p->cu_seqlens_q, &p->q)) != LT_OK ||
        (s = lt__check_cu("cu_seqlens_k", &p->cu_seqlens_k, &p->q)) != LT_OK)
        return s;
    if (p->cu_seqlens_q.sizes[0] != p->cu_seqlens_k.sizes[0])
        return lt__fail(LT_ERROR_SHAPE, "cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got %lld "
                        "and %lld", (long long)p->cu_seqlens_q.sizes[0], (long long)p->cu_seqlens_k.sizes[0]);
    c->batch = p->cu_seqlens_q.sizes[0] - 1;
    if (c->batch > 65535)
        return lt__fail(LT_ERROR_SHAPE, "batch (cu_seqlens_q.sizes[0] - 1) is %lld; at most 65535",
                        (long long)c->batch);
    if (c->batch == 0 && (c->sq > 0 || c->sk > 0))
        return lt__fail(LT_ERROR_SHAPE, "cu_seqlens_q has 1 entry (batch 0) but q has %lld and k %lld rows: its last "
                        "entry must be the total", (long long)c->sq, (long long)c->sk);
    const int64_t maxes[2] = {p->max_seqlen_q, p->max_seqlen_k};
    static const char *max_names[2] = {"max_seqlen_q", "max_seqlen_k"};
    for (int i = 0; i < 2; i++)
        if (maxes[i] < 1 || maxes[i] > INT32_MAX)
            return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is %lld; expected 1..2147483647 (at least the longest "
                            "sequence)", max_names[i], (long long)maxes[i]);
    if (p->causal == LT_CAUSAL_TOP_LEFT)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "causal is LT_CAUSAL_TOP_LEFT; packed sequences take "
                        "LT_CAUSAL_NONE or LT_CAUSAL_BOTTOM_RIGHT (within each sequence, as FlashAttention-2)");
    c->varlen = 1, c->max_sq = p->max_seqlen_q, c->max_sk = p->max_seqlen_k;
    c->cu_seqlens_q = (int64_t)(uintptr_t)p->cu_seqlens_q.data, c->cu_seqlens_k = (int64_t)(uintptr_t)p->cu_seqlens_k.data;
    if (lt__given(&p->seqused_q) && (s = lt__check_used("seqused_q", &p->seqused_q, &p->q, c->batch,
                                                        &c->seqused_q)) != LT_OK)
        return s;
    if (lt__given(&p->seqused_k) && (s = lt__check_used("seqused_k", &p->seqused_k, &p->q, c->batch,
                                                        &c->seqused_k)) != LT_OK)
        return s;
    return LT_OK;
}

/* The window and softcap in the kernel's terms (binding.with_features): window_left/right -1 when off, else both
 * bounded (an unbounded side reaches every key); a windowed dense call's offset is bottom-right unless top-left. */
static lt_status lt__check_window(const lt_attn_fwd_params *p, lt__call *c) {
    c->window_left = -1, c->window_right = -1;
    if (p->window_left < -1 || p->window_right < -1)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "window_left is %lld and window_right %lld; each must be -1 "
                        "(unbounded) or >= 0", (long long)p->window_left, (long long)p->window_right);
    if (!(p->softcap >= 0.0 && p->softcap <= FLT_MAX))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "softcap is %g; expected 0 (off) or a finite float > 0",
                        p->softcap);
    c->softcap = (float)p->softcap;
    int64_t left = p->window_left, right = p->causal != LT_CAUSAL_NONE ? 0 : p->window_right;
    if (left < 0 && (right < 0 || p->causal != LT_CAUSAL_NONE))
        return LT_OK; /* no window beyond the causal mask */
    if (c->sq >= LT__MAX_WINDOWED_SEQLEN || c->sk >= LT__MAX_WINDOWED_SEQLEN)
        return lt__fail(LT_ERROR_SHAPE, "with a window, seqlens must be below 2**29; got seqlen_q %lld, seqlen_k "
                        "%lld", (long long)c->sq, (long long)c->sk);
    int64_t full = c->sq > c->sk ? c->sq : c->sk; /* reaches every key from every query: no bound */
    full = full > 1 ? full : 1;
    if (!c->varlen)
        c->offset = p->causal == LT_CAUSAL_TOP_LEFT ? 0 : c->sk - c->sq;
    c->window_left = left >= 0 && left < full ? left : full;
    c->window_right = right >= 0 && right < full ? right : full;
    return LT_OK;
}

/* FlashAttention-3's attention_chunk in the kernel's terms (binding.with_chunk): >= 0 (0: off), seqlens below
 * 2**29, a dense call's offset bottom-right unless top-left (as the window's), the size cut at LT__MAX_CHUNK. */
static lt_status lt__check_chunk(int64_t attention_chunk, int32_t causal, lt__call *c) {
    if (attention_chunk < 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "attention_chunk is %lld; expected 0 (off) or a chunk of >= 1 keys",
                        (long long)attention_chunk);
    c->attention_chunk = 0;
    if (attention_chunk == 0)
        return LT_OK;
    if (c->sq >= LT__MAX_WINDOWED_SEQLEN || c->sk >= LT__MAX_WINDOWED_SEQLEN)
        return lt__fail(LT_ERROR_SHAPE, "with attention_chunk set, seqlens must be below 2**29; got seqlen_q %lld, "
                        "seqlen_k %lld", (long long)c->sq, (long long)c->sk);
    if (!c->varlen) /* a packed call's kernels use each sequence's own len_k - len_q */
        c->offset = causal == LT_CAUSAL_TOP_LEFT ? 0 : c->sk - c->sq;
    c->attention_chunk = attention_chunk < LT__MAX_CHUNK ? attention_chunk : LT__MAX_CHUNK;
    return LT_OK;
}

/* Attention sinks, given (a version 5 struct with them described): fp32, (heads_q), contiguous, on q's device,
 * with data; *pointer their data. name: "sinks" or "dsinks" (lt_bwd.c's gradient, of the same layout). */
static lt_status lt__check_sinks(const char *name, const lt_tensor *t, const lt_tensor *q, int64_t heads_q,
                                 int64_t *pointer) {
    if (t->dtype != LT_DTYPE_FP32)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %d; expected LT_DTYPE_FP32 (3): one float32 logit a query head",
                        name, t->dtype);
    if (t->ndim != 1 || t->sizes[0] != heads_q)
        return lt__fail(LT_ERROR_SHAPE, "%s must be 1-dim with heads_q = %lld entries (one logit a query head), got "
                        "ndim %d, sizes[0] %lld", name, (long long)heads_q, t->ndim, (long long)t->sizes[0]);
    if (t->sizes[0] > 1 && t->strides[0] != 1)
        return lt__fail(LT_ERROR_SHAPE, "%s.strides[0] is %lld; it must be contiguous (1)", name,
                        (long long)t->strides[0]);
    if (t->device_type != q->device_type || t->device_index != q->device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is on %s:%d but q is on %s:%d; all tensors of a call must be "
                        "on one device", name, t->device_type == LT_DEVICE_CPU ? "cpu" : "cuda", t->device_index,
                        q->device_type == LT_DEVICE_CPU ? "cpu" : "cuda", q->device_index);
    if (t->data == NULL && heads_q > 0)
        return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", name);
    *pointer = (int64_t)(uintptr_t)t->data;
    return LT_OK;
}

/* One of the FP8 forward's descales, given: fp32, (batch, heads_k) or one element (1), on q's device, strides
 * below 2**31 (the kernel's i32); its pointer and (batch, kv head) strides into c at i. */
static lt_status lt__check_descale(const char *name, const lt_tensor *t, const lt_tensor *q, int64_t batch,
                                   int64_t heads_k, lt__call *c, int i) {
    if (t->dtype != LT_DTYPE_FP32)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %s; expected LT_DTYPE_FP32 (3)", name, lt__dtype_name(t->dtype));
    int one = t->ndim == 1 && t->sizes[0] == 1, per_head = t->ndim == 2 && t->sizes[0] == batch &&
                                                           t->sizes[1] == heads_k;
    if (!one && !per_head)
        return lt__fail(LT_ERROR_SHAPE, "%s must have shape (batch, heads_k) = (%lld, %lld), or (1) for one value, got "
                        "ndim %d, sizes (%lld, %lld)", name, (long long)batch, (long long)heads_k, t->ndim,
                        (long long)t->sizes[0], (long long)(t->ndim > 1 ? t->sizes[1] : 0));
    for (int d = 0; d < t->ndim; d++)
        if (t->strides[d] < 0 || t->strides[d] > INT32_MAX)
            return lt__fail(LT_ERROR_SHAPE, "%s.strides[%d] is %lld; expected 0..2**31 - 1", name, d,
                            (long long)t->strides[d]);
    if (t->device_type != q->device_type || t->device_index != q->device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is not on q's device; all tensors of a call must be on one "
                        "device", name);
    if (t->data == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", name);
    c->descale[i] = (int64_t)(uintptr_t)t->data;
    c->descale_strides[i][0] = per_head ? t->strides[0] : 0, c->descale_strides[i][1] = per_head ? t->strides[1] : 0;
    return LT_OK;
}

/* The FP8 forward's part of a call (version 7): e4m3 or e5m2 q needs v_transposed, takes descales (each absent one
 * a null pointer, which the kernel reads as 1.0) and no sinks; a call of another dtype takes neither. */
static lt_status lt__check_fp8(const lt_attn_fwd_params *p, lt__call *c) {
    const lt_tensor *ds[3] = {&p->q_descale, &p->k_descale, &p->v_descale};
    static const char *names[3] = {"q_descale", "k_descale", "v_descale"};
    if (p->reserved7 != 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "reserved7 is %u; it must be 0", p->reserved7);
    c->fp8 = lt__is_fp8(p->q.dtype); /* v_transposed's agreement: lt__check_tensors' */
    if (!c->fp8) {
        for (int i = 0; i < 3; i++)
            if (lt__given(ds[i]))
                return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is given but q.dtype is %s: descales are for "
                                "LT_DTYPE_FP8_E4M3 or LT_DTYPE_FP8_E5M2 inputs (FlashAttention-3's FP8 forward)",
                                names[i],
                                lt__dtype_name(p->q.dtype));
        return LT_OK;
    }
    if (c->sinks)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "sinks are given but q is %s: the FP8 forward "
                        "(FlashAttention-3's) has no attention sinks", lt__dtype_name(p->q.dtype));
    int64_t batch = c->varlen ? c->batch : c->b;
    for (int i = 0; i < 3; i++) {
        lt_status s;
        if (lt__given(ds[i]) && (s = lt__check_descale(names[i], ds[i], &p->q, batch, c->hk, c, i)) != LT_OK)
            return s;
    }
    return LT_OK;
}

/* The workspace (version 8), given: fp32, 1-dim, contiguous, with data, on q's device; its pointer and bytes in c. */
static lt_status lt__check_workspace(const lt_attn_fwd_params *p, lt__call *c) {
    const lt_tensor *w = &p->workspace;
    if (!lt__given(w))
        return LT_OK;
    if (w->dtype != LT_DTYPE_FP32)
        return lt__fail(LT_ERROR_DTYPE, "workspace.dtype is %d; expected LT_DTYPE_FP32 (3)", w->dtype);
    if (w->ndim != 1 || w->sizes[0] < 0 || (w->sizes[0] > 1 && w->strides[0] != 1))
        return lt__fail(LT_ERROR_SHAPE, "workspace must be 1-dim and contiguous (elements,); got ndim %d, sizes[0] "
                        "%lld, strides[0] %lld", w->ndim, (long long)w->sizes[0], (long long)w->strides[0]);
    if (w->sizes[0] > INT64_MAX / 4)
        return lt__fail(LT_ERROR_SHAPE, "workspace.sizes[0] is %lld elements; expected at most 2**61",
                        (long long)w->sizes[0]);
    if (w->device_type != p->q.device_type || w->device_index != p->q.device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "workspace is on device %d:%d but q is on %d:%d; they must be on "
                        "one device", w->device_type, w->device_index, p->q.device_type, p->q.device_index);
    if (w->sizes[0] > 0 && w->data == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "workspace.data is NULL");
    c->workspace = (int64_t)(uintptr_t)w->data, c->workspace_bytes = 4 * w->sizes[0], c->workspace_given = 1;
    return LT_OK;
}

/* Fill *c from params (lt__fwd_prepare's view), or fail with the first problem found. */
static lt_status lt__check(const lt_attn_fwd_params *p, lt__call *c) {
    lt_status s;
    memset(c, 0, sizeof *c);
    if ((s = lt__check_struct(p)) != LT_OK || (s = lt__check_tensors(p)) != LT_OK ||
        (s = lt__check_shapes(p, c)) != LT_OK || (s = lt__check_strides(p, c)) != LT_OK)
        return s;
    if (p->causal < LT_CAUSAL_NONE || p->causal > LT_CAUSAL_BOTTOM_RIGHT)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "causal is %d; expected LT_CAUSAL_NONE (0), LT_CAUSAL_TOP_LEFT "
                        "(1) or LT_CAUSAL_BOTTOM_RIGHT (2)", p->causal);
    if (p->flags != 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "flags is 0x%x; no flags are defined yet, it must be 0",
                        p->flags);
    if (isinf(p->sm_scale))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "sm_scale is %g; expected a finite value, or NaN for "
                        "1/sqrt(head_dim)", p->sm_scale);
    c->dtype = p->q.dtype, c->device_type = p->q.device_type, c->device_index = p->q.device_index;
    c->causal = p->causal;
    c->offset = p->causal == LT_CAUSAL_BOTTOM_RIGHT ? c->sk - c->sq : 0;
    if (p->struct_size == sizeof *p && lt__wants_varlen(&p->cu_seqlens_q, &p->cu_seqlens_k)) {
        if ((s = lt__check_varlen(p, c)) != LT_OK)
            return s;
        c->offset = 0; /* the kernels use each sequence's own len_k - len_q */
    } else if (p->struct_size == sizeof *p && (lt__given(&p->seqused_q) || lt__given(&p->seqused_k))) {
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is given but the call is dense: seqused_q/seqused_k cut the "
                        "spans of packed sequences (give cu_seqlens_q and cu_seqlens_k)",
                        lt__given(&p->seqused_q) ? "seqused_q" : "seqused_k");
    }
    c->scale = isnan(p->sm_scale) ? (float)(1.0 / sqrt((double)c->d)) : (float)p->sm_scale;
    if ((s = lt__check_window(p, c)) != LT_OK || (s = lt__check_chunk(p->attention_chunk, p->causal, c)) != LT_OK)
        return s;
    if (lt__given(&p->sinks) && (s = lt__check_sinks("sinks", &p->sinks, &p->q, c->hq, &c->sinks)) != LT_OK)
        return s;
    if ((s = lt__check_fp8(p, c)) != LT_OK || (s = lt__check_workspace(p, c)) != LT_OK)
        return s;
    c->empty = c->b == 0 || c->hq == 0 || c->sq == 0;
    if (c->empty)
        return LT_OK;
    if (p->q.data == NULL || p->out.data == NULL || p->lse.data == NULL ||
        (c->sk > 0 && (p->k.data == NULL || p->v.data == NULL))) {
        const char *which = p->q.data == NULL ? "q" : p->out.data == NULL ? "out" : p->lse.data == NULL ? "lse"
                            : p->k.data == NULL ? "k" : "v";
        return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", which);
    }
    uint64_t bits = (uintptr_t)p->q.data | (uintptr_t)p->k.data | (uintptr_t)p->v.data | (uintptr_t)p->out.data |
                    (uintptr_t)p->lse.data;
    const lt_tensor *ts[4] = {&p->q, &p->k, &p->v, &p->out};
    for (int i = 0; i < 4; i++)
        bits |= (uint64_t)(ts[i]->strides[0] | ts[i]->strides[1] | ts[i]->strides[2]);
    c->aligned = (bits & 15) == 0;
    /* As the binding's pack: 64-bit offsets once a tensor (or lse) spans 2**31 elements. */
    int64_t extent = c->b * c->hq * c->sq;
    for (int i = 0; i < 4; i++) {
        if ((i == 1 || i == 2) && c->sk == 0)
            continue; /* k and v are not read */
        int64_t heads = i == 1 || i == 2 ? c->hk : c->hq, seqlen = i == 1 || i == 2 ? c->sk : c->sq;
        if (i == 2 && c->fp8)
            seqlen = c->dv; /* v transposed: (batch, heads_k, head_dim_v, seqlen_k) */
        int64_t e = lt__last_offset(ts[i], c->b, heads, seqlen);
        if (e < 0)
            return lt__fail(LT_ERROR_SHAPE, "%s's sizes and strides reach past 2**62 elements", i == 0 ? "q"
                            : i == 1 ? "k" : i == 2 ? "v" : "out");
        e += ts[i]->sizes[3];
        extent = e > extent ? e : extent;
    }
    c->index64 = extent > INT32_MAX;
    return LT_OK;
}

/* seqlen_k = 0 on the CPU: nothing to attend to, so out is 0 and lse is -inf (as attn_fwd). */
static void lt__fill_no_keys(const lt_attn_fwd_params *p, const lt__call *c) {
    size_t item = p->out.dtype == LT_DTYPE_FP32 ? 4 : 2;
    float *lse = (float *)p->lse.data;
    for (int64_t i = 0; i < c->b * c->hq * c->sq; i++)
        lse[i] = -INFINITY;
    for (int64_t b = 0; b < c->b; b++)
        for (int64_t h = 0; h < c->hq; h++)
            for (int64_t s = 0; s < c->sq; s++) {
                int64_t at = b * p->out.strides[0] + h * p->out.strides[1] + s * p->out.strides[2];
                memset((char *)p->out.data + (size_t)at * item, 0, (size_t)c->d * item);
            }
}
