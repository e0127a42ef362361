/*
 * lt_bwd.c: the backward of the C API: lt_attn_bwd, its checks, plans and
 * launch. Included at the end of lazytriton.c (one translation unit): it uses
 * the forward's checks (lt_check.c), plan keys, memo and launch helpers.
 *
 * The two kernels (kernels/flash_bwd): flash_bwd_dq (delta, then dq; one
 * program per query block) and then flash_bwd_dkdv (dk and dv; one program
 * per key block of a key/value head), on one stream. Their integer arguments
 * are the binding's (binding.c_initializer, tested field by field), and so are
 * the two alignment rules (binding.ALIGNED_PARAMS: ALIGN16, binding.SEQ_ALIGNED_PARAMS: SEQ16).
 */

#define LT__BWD_PLAN_MAGIC 0x6c747062u /* "ltpb" */
#define LT__BWD_DQ_PARAMS 56           /* flash_bwd_dq: 53 pointers and integers, then sm_scale, softcap, dropout_p */
#define LT__BWD_DKDV_PARAMS 52         /* flash_bwd_dkdv: 49 pointers and integers, then sm_scale, softcap, dropout_p */
#define LT__BWD_FLOATS 3
#define LT__BWD_DSINKS_PARAMS 10       /* flash_bwd_dsinks: 10 pointers and integers (kernels/flash_bwd_dsinks) */
#define LT__ALIGN16 1 /* c->aligned's bits for the backward (lt__bwd_aligned) */
#define LT__SEQ16 2

/* ------------------------------------------------------------------------- */
/* Checks: the forward's on q, k, v, out, lse and the options, then the rest. */

/* A version 1 struct: everything before the packed-sequence fields; version 2: before the window; version 3:
 * before the used lengths; version 4: before the sinks; version 5: before attention_chunk. */
#define LT__BWD_PARAMS_V1_SIZE offsetof(lt_attn_bwd_params, cu_seqlens_q)
#define LT__BWD_PARAMS_V2_SIZE offsetof(lt_attn_bwd_params, window_left)
#define LT__BWD_PARAMS_V3_SIZE offsetof(lt_attn_bwd_params, seqused_q)
#define LT__BWD_PARAMS_V4_SIZE offsetof(lt_attn_bwd_params, sinks)
#define LT__BWD_PARAMS_V5_SIZE offsetof(lt_attn_bwd_params, attention_chunk)

static lt_status lt__check_bwd_struct(const lt_attn_bwd_params *p) {
    if (p == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "params is NULL");
    if ((p->struct_size == LT__BWD_PARAMS_V1_SIZE && p->version == 1) ||
        (p->struct_size == LT__BWD_PARAMS_V2_SIZE && p->version == 2) ||
        (p->struct_size == LT__BWD_PARAMS_V3_SIZE && p->version == 3) ||
        (p->struct_size == LT__BWD_PARAMS_V4_SIZE && p->version == 4) ||
        (p->struct_size == LT__BWD_PARAMS_V5_SIZE && p->version == 5))
        return LT_OK; /* read as the call it always was: no chunk (no sinks before 5, no seqused before 4, ...) */
    if (p->struct_size != sizeof(lt_attn_bwd_params))
        return lt__fail(LT_ERROR_VERSION,
                        "params->struct_size is %u but this lazytriton %d.%d.%d takes %zu for lt_attn_bwd_params: "
                        "rebuild against its lazytriton.h and fill params with lt_attn_bwd_params_init()",
                        p->struct_size, LT_VERSION_MAJOR, LT_VERSION_MINOR, LT_VERSION_PATCH,
                        sizeof(lt_attn_bwd_params));
    if (p->version != LT_ATTN_BWD_PARAMS_VERSION)
        return lt__fail(LT_ERROR_VERSION, "params->version is %u but this lazytriton takes lt_attn_bwd_params "
                        "version %d", p->version, LT_ATTN_BWD_PARAMS_VERSION);
    return LT_OK;
}

/* The forward's view of a backward call: the same q, k, v, out, lse, causal mode, flags and scale. */
static lt_attn_fwd_params lt__fwd_view(const lt_attn_bwd_params *p) {
    lt_attn_fwd_params f;
    memset(&f, 0, sizeof f);
    f.struct_size = sizeof f, f.version = LT_ATTN_FWD_PARAMS_VERSION;
    f.q = p->q, f.k = p->k, f.v = p->v, f.out = p->out, f.lse = p->lse;
    f.causal = p->causal, f.flags = p->flags, f.sm_scale = p->sm_scale;
    f.cu_seqlens_q = p->cu_seqlens_q, f.cu_seqlens_k = p->cu_seqlens_k;
    f.max_seqlen_q = p->max_seqlen_q, f.max_seqlen_k = p->max_seqlen_k;
    f.window_left = p->window_left, f.window_right = p->window_right, f.softcap = p->softcap;
    f.seqused_q = p->seqused_q, f.seqused_k = p->seqused_k, f.sinks = p->sinks;
    f.attention_chunk = p->attention_chunk;
    return f;
}

/* As lt__fwd_prepare: the caller's struct as this version's in *norm, and in *view a packed call's ten tensors
 * as the kernels' views (q, k, v, out, dout, dq, dk, dv: (1, heads, total, head_dim); lse, delta: (1, heads, total)). */
static lt_status lt__bwd_prepare(const lt_attn_bwd_params *p, lt_attn_bwd_params *norm, lt_attn_bwd_params *view) {
    lt_status s;
    if ((s = lt__check_bwd_struct(p)) != LT_OK)
        return s;
    memset(norm, 0, sizeof *norm);
    memcpy(norm, p, p->struct_size);
    if (p->struct_size <= LT__BWD_PARAMS_V2_SIZE) /* no window (zeros would mean a window of 0) */
        norm->window_left = -1, norm->window_right = -1;
    norm->struct_size = sizeof *norm, norm->version = LT_ATTN_BWD_PARAMS_VERSION;
    *view = *norm;
    if (!lt__wants_varlen(&norm->cu_seqlens_q, &norm->cu_seqlens_k))
        return LT_OK;
    lt_tensor *ts[8] = {&view->q, &view->k, &view->v, &view->out, &view->dout, &view->dq, &view->dk, &view->dv};
    static const char *names[8] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv"};
    for (int i = 0; i < 8; i++)
        if ((s = lt__packed_view(names[i], ts[i], 0)) != LT_OK)
            return s;
    if ((s = lt__packed_view("lse", &view->lse, 1)) != LT_OK)
        return s;
    return lt__packed_view("delta", &view->delta, 1);
}

static const char *lt__device_name(int32_t device_type) { return device_type == LT_DEVICE_CPU ? "cpu" : "cuda"; }

/* One of dout, dq, dk, dv: like the tensor it is the gradient of (dtype, shape, device, contiguous last dim). */
static lt_status lt__check_grad(const char *name, const lt_tensor *t, const char *of_name, const lt_tensor *of,
                                const lt_tensor *q) {
    lt_status s;
    if ((s = lt__check_tensor(name, t, 4, "(batch, heads, seqlen, head_dim)")) != LT_OK)
        return s;
    if (t->dtype != of->dtype)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %s but %s.dtype is %s; they must match", name,
                        lt__dtype_name(t->dtype), of_name, lt__dtype_name(of->dtype));
    const int64_t *a = t->sizes, *b = of->sizes;
    if (!lt__same_sizes(t, of))
        return lt__fail(LT_ERROR_SHAPE, "%s has shape (%lld, %lld, %lld, %lld); expected %s's shape (%lld, %lld, "
                        "%lld, %lld)", name, (long long)a[0], (long long)a[1], (long long)a[2], (long long)a[3],
                        of_name, (long long)b[0], (long long)b[1], (long long)b[2], (long long)b[3]);
    if (t->strides[3] != 1 && a[3] > 1)
        return lt__fail(LT_ERROR_SHAPE, "%s.strides[3] is %lld; the last dim must be contiguous (stride 1)", name,
                        (long long)t->strides[3]);
    if (t->device_type != q->device_type || t->device_index != q->device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is on %s:%d but q is on %s:%d; all tensors of a call must "
                        "be on one device", name, lt__device_name(t->device_type), t->device_index,
                        lt__device_name(q->device_type), q->device_index);
    return LT_OK;
}

/* delta: a float32 workspace of lse's shape, contiguous, on q's device. */
static lt_status lt__check_delta(const lt_attn_bwd_params *p, const lt__call *c) {
    const lt_tensor *t = &p->delta;
    lt_status s;
    if ((s = lt__check_tensor("delta", t, 3, "(batch, heads_q, seqlen_q)")) != LT_OK)
        return s;
    if (t->dtype != LT_DTYPE_FP32)
        return lt__fail(LT_ERROR_DTYPE, "delta.dtype is %s; expected LT_DTYPE_FP32 (a float32 workspace)",
                        lt__dtype_name(t->dtype));
    const int64_t *ds = t->sizes, expect[3] = {c->hq * c->sq, c->sq, 1};
    if (ds[0] != c->b || ds[1] != c->hq || ds[2] != c->sq)
        return lt__fail(LT_ERROR_SHAPE, "delta has shape (%lld, %lld, %lld); expected (batch, heads_q, seqlen_q) = "
                        "(%lld, %lld, %lld)", (long long)ds[0], (long long)ds[1], (long long)ds[2], (long long)c->b,
                        (long long)c->hq, (long long)c->sq);
    for (int i = 0; i < 3 && c->b * c->hq * c->sq > 0; i++) /* a delta with no elements has no layout */
        if (ds[i] > 1 && t->strides[i] != expect[i])
            return lt__fail(LT_ERROR_SHAPE, "delta must be contiguous: strides (%lld, %lld, 1) for its sizes, got "
                            "(%lld, %lld, %lld)", (long long)expect[0], (long long)expect[1],
                            (long long)t->strides[0], (long long)t->strides[1], (long long)t->strides[2]);
    if (t->device_type != p->q.device_type || t->device_index != p->q.device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "delta is on %s:%d but q is on %s:%d; all tensors of a call "
                        "must be on one device", lt__device_name(t->device_type), t->device_index,
                        lt__device_name(p->q.device_type), p->q.device_index);
    return LT_OK;
}

/* dsinks, given: the sinks' layout (lt__check_sinks), with sinks given; c->dsinks its pointer. On a GPU the
 * flash_bwd_dsinks kernel reduces it after the two backward kernels. */
static lt_status lt__check_dsinks(const lt_attn_bwd_params *p, lt__call *c) {
    lt_status s;
    if (!lt__given(&p->dsinks))
        return LT_OK;
    if (c->sinks == 0 && !lt__given(&p->sinks))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "dsinks is given but the call has no sinks: dsinks is the "
                        "gradient of the forward's attention sinks (give them in sinks)");
    if ((s = lt__check_sinks("dsinks", &p->dsinks, &p->q, c->hq, &c->dsinks)) != LT_OK)
        return s;
    return LT_OK;
}

static int64_t lt__numel(const lt_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->sizes[i];
    return n;
}

/* The backward's work: the forward's call has some (not empty, keys to attend to). */
static int lt__bwd_has_work(const lt__call *c) { return !c->empty && c->sk > 0; }

/* The call's alignment, as c->aligned holds it for the backward: bit 0 (ALIGN16) every pointer and every stride
 * of the eight tensors is a multiple of 16 (the binding's ALIGNED_PARAMS); bit 1 (SEQ16) also, in a dense call,
 * the seqlens and the lse/delta strides (SEQ_ALIGNED_PARAMS). */
static int lt__bwd_aligned(const lt_attn_bwd_params *p, const lt__call *c) {
    const lt_tensor *q = &p->q, *k = &p->k, *v = &p->v, *o = &p->out, *dout = &p->dout;
    const lt_tensor *dq = &p->dq, *dk = &p->dk, *dv = &p->dv;
    uint64_t bits = (uint64_t)(
        (int64_t)(uintptr_t)q->data | (int64_t)(uintptr_t)k->data | (int64_t)(uintptr_t)v->data |
        (int64_t)(uintptr_t)o->data | (int64_t)(uintptr_t)dout->data | (int64_t)(uintptr_t)p->lse.data |
        (int64_t)(uintptr_t)p->delta.data | (int64_t)(uintptr_t)dq->data |
        q->strides[0] | q->strides[1] | q->strides[2] | k->strides[0] | k->strides[1] | k->strides[2] |
        v->strides[0] | v->strides[1] | v->strides[2] | o->strides[0] | o->strides[1] | o->strides[2] |
        dout->strides[0] | dout->strides[1] | dout->strides[2] | dq->strides[0] | dq->strides[1] | dq->strides[2] |
        (int64_t)(uintptr_t)dk->data | (int64_t)(uintptr_t)dv->data |
        dk->strides[0] | dk->strides[1] | dk->strides[2] | dv->strides[0] | dv->strides[1] | dv->strides[2]);
    uint64_t seq_bits = (uint64_t)(c->hq * c->sq | c->sq | c->sq | c->sk);
    if (bits & 15)
        return 0;
    return (seq_bits & 15) == 0 && !c->varlen ? LT__ALIGN16 | LT__SEQ16 : LT__ALIGN16;
}

/* 64-bit offsets once some tensor spans 2**31 elements (the binding's pack: all eight 4-dim tensors). */
static lt_status lt__bwd_index64(const lt_attn_bwd_params *p, lt__call *c) {
    const lt_tensor *ts[8] = {&p->q, &p->out, &p->dout, &p->dq, &p->k, &p->v, &p->dk, &p->dv};
    static const char *names[8] = {"q", "out", "dout", "dq", "k", "v", "dk", "dv"};
    int64_t extent = c->b * c->hq * c->sq;
    for (int i = 0; i < 8; i++) {
        int64_t e = i < 4 ? lt__last_offset(ts[i], c->b, c->hq, c->sq) : lt__last_offset(ts[i], c->b, c->hk, c->sk);
        if (e < 0)
            return lt__fail(LT_ERROR_SHAPE, "%s's sizes and strides reach past 2**62 elements", names[i]);
        e += ts[i]->sizes[3];
        extent = e > extent ? e : extent;
    }
    c->index64 = extent > INT32_MAX;
    return LT_OK;
}

/* Fill *c from params, or fail with the first problem found. */
static lt_status lt__bwd_check(const lt_attn_bwd_params *p, lt__call *c) {
    lt_status s;
    if ((s = lt__check_bwd_struct(p)) != LT_OK)
        return s;
    const lt_tensor *inputs_qkv[3] = {&p->q, &p->k, &p->v};
    static const char *qkv_names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++)
        if (lt__is_fp8(inputs_qkv[i]->dtype))
            return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s.dtype is %s: the FP8 forward has no backward "
                            "(FlashAttention-3's has none either)", qkv_names[i], lt__dtype_name(inputs_qkv[i]->dtype));
    lt_attn_fwd_params forward = lt__fwd_view(p);
    if ((s = lt__check(&forward, c)) != LT_OK)
        return s;
    const lt_tensor *grads[4] = {&p->dout, &p->dq, &p->dk, &p->dv}, *of[4] = {&p->out, &p->q, &p->k, &p->v};
    static const char *names[4] = {"dout", "dq", "dk", "dv"}, *of_names[4] = {"out", "q", "k", "v"};
    for (int i = 0; i < 4; i++)
        if ((s = lt__check_grad(names[i], grads[i], of_names[i], of[i], &p->q)) != LT_OK)
            return s;
    if ((s = lt__check_delta(p, c)) != LT_OK || (s = lt__check_dsinks(p, c)) != LT_OK)
        return s;
    int work = lt__bwd_has_work(c);
    for (int i = 0; i < 4; i++) /* with no work, only the gradients to zero are written */
        if (grads[i]->data == NULL && (work || (i > 0 && lt__numel(grads[i]) > 0)))
            return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", names[i]);
    if (work && p->delta.data == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "delta.data is NULL (the workspace: batch * heads_q * seqlen_q "
                        "floats)");
    /* no work: delta is not written */
    const lt__named outputs[5] = {{"dq", &p->dq}, {"dk", &p->dk}, {"dv", &p->dv}, {"dsinks", &p->dsinks},
                                  {"delta", &p->delta}};
    const lt__named inputs[11] = {{"q", &p->q}, {"k", &p->k}, {"v", &p->v}, {"out", &p->out}, {"lse", &p->lse},
                                  {"dout", &p->dout}, {"cu_seqlens_q", &p->cu_seqlens_q},
                                  {"cu_seqlens_k", &p->cu_seqlens_k}, {"seqused_q", &p->seqused_q},
                                  {"seqused_k", &p->seqused_k}, {"sinks", &p->sinks}};
    if ((s = lt__check_writes(outputs, work ? 5 : 4, inputs, 11)) != LT_OK)
        return s;
    if (!work)
        return LT_OK;
    c->aligned = lt__bwd_aligned(p, c);
    return lt__bwd_index64(p, c);
}

/* A call with no work on the CPU: zero the gradients that have elements (as the Python API does). */
static void lt__zero_host(const lt_tensor *t) {
    if (lt__numel(t) == 0)
        return;
    size_t item = t->dtype == LT_DTYPE_FP32 ? 4 : 2;
    for (int64_t b = 0; b < t->sizes[0]; b++)
        for (int64_t h = 0; h < t->sizes[1]; h++)
            for (int64_t s = 0; s < t->sizes[2]; s++) {
                int64_t at = b * t->strides[0] + h * t->strides[1] + s * t->strides[2];
                memset((char *)t->data + (size_t)at * item, 0, (size_t)t->sizes[3] * item);
            }
}

/* ------------------------------------------------------------------------- */
/* Plans: the two kernels, resolved once for a shape class.                    */

typedef struct {
    lt__CUfunction function;
    uint32_t block_threads, shared_bytes, tile, n_hidden; /* tile: BLOCK_M for dq, BLOCK_N for dk/dv */
    char variant[512];
} lt__bwd_kernel;

struct lt_bwd_plan {
    uint32_t magic;
    lt__plan_key key;
    lt__CUcontext context;
    lt__bwd_kernel dq, dkdv;
    lt__bwd_kernel dsinks; /* with key.dsinks: the sinks' gradient, after dk and dv */
};

static lt__plan_key lt__bwd_key_of(const lt__call *c) {
    lt__plan_key key = lt__key_of(c);
    key.kernel = LT__KERNEL_BWD_DQ;
    key.sinks = 0; /* the backward's kernels are the same with sinks (they read them through lse) */
    key.dsinks = c->dsinks != 0;
    return key;
}

static void lt__bwd_kernel_of(const lt__plan_request *req, lt__bwd_kernel *k) {
    k->function = (lt__CUfunction)(uintptr_t)req->function; /* its module is never unloaded */
    k->block_threads = req->block_threads, k->shared_bytes = req->shared_bytes;
    k->tile = req->block_m, k->n_hidden = req->n_hidden;
    memcpy(k->variant, req->variant, sizeof k->variant);
}

static lt_status lt__make_bwd_plan(const lt__call *c, lt_bwd_plan **out) {
    lt_status s;
    lt__CUcontext context;
    int32_t capability;
    lt__plan_request dq, dkdv, dsinks;
    if ((s = lt__plannable(c, "lt_attn_bwd")) != LT_OK ||
        (s = lt__device_context(c->device_index, &context, &capability)) != LT_OK)
        return s;
    /* Every kernel is looked up even after a miss, so the miss log holds all of the plan's missing kernels and one
       `lazytriton prewarm --from-misses` covers the call; the status is the first kernel's failure (LT_MISS: the
       message names the last kernel missed). */
    lt_status dq_s = lt__plan_kernel(c, LT__KERNEL_BWD_DQ, capability, &dq);
    if (dq_s != LT_OK && dq_s != LT_MISS)
        return dq_s;
    s = lt__plan_kernel(c, LT__KERNEL_BWD_DKDV, capability, &dkdv);
    if (s != LT_OK && s != LT_MISS)
        return s;
    if (c->dsinks != 0) {
        lt_status ds_s = lt__plan_kernel(c, LT__KERNEL_BWD_DSINKS, capability, &dsinks);
        if (ds_s != LT_OK && (s == LT_OK || ds_s != LT_MISS))
            s = ds_s;
    }
    if (dq_s != LT_OK)
        return dq_s;
    if (s != LT_OK)
        return s;
    lt_bwd_plan *plan = (lt_bwd_plan *)calloc(1, sizeof *plan);
    if (plan == NULL)
        return lt__fail(LT_ERROR_INTERNAL, "out of memory");
    plan->magic = LT__BWD_PLAN_MAGIC;
    plan->key = lt__bwd_key_of(c);
    plan->context = context;
    lt__bwd_kernel_of(&dq, &plan->dq);
    lt__bwd_kernel_of(&dkdv, &plan->dkdv);
    if (c->dsinks != 0)
        lt__bwd_kernel_of(&dsinks, &plan->dsinks);
    *out = plan;
    return LT_OK;
}

/* The parameter array of one kernel: its integer slots, the three floats, then NULL hidden scratch pointers. */
static void lt__bind(void **params, int64_t *ints, int n_params, float *floats, uint32_t n_hidden) {
    int n_ints = n_params - LT__BWD_FLOATS;
    for (int i = 0; i < n_ints; i++)
        params[i] = &ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only */
    for (int i = 0; i < LT__BWD_FLOATS; i++)
        params[n_ints + i] = &floats[i];
    for (uint32_t h = 0; h < n_hidden; h++)
        params[n_params + h] = &ints[n_ints + h]; /* zero: NULL scratch */
}

/* The sinks' gradient (flash_bwd_dsinks, one program a query head) from the delta dq's kernel wrote: its
 * parameters in its description's order (flash_bwd_dsinks.binding.c_initializer). */
static lt_status lt__dsinks_launch(const lt_bwd_plan *plan, const lt_attn_bwd_params *p, const lt__call *c,
                                   void *stream) {
    const lt__bwd_kernel *k = &plan->dsinks;
    int64_t ints[LT__BWD_DSINKS_PARAMS + LT__MAX_HIDDEN] = {
        c->sinks, (int64_t)(uintptr_t)p->lse.data, (int64_t)(uintptr_t)p->delta.data,
        (int64_t)(uintptr_t)p->dsinks.data, c->varlen ? c->cu_seqlens_q : (int64_t)(uintptr_t)p->lse.data,
        c->seqused_q ? c->seqused_q : (int64_t)(uintptr_t)p->lse.data, c->varlen ? 0 : c->hq * c->sq, c->sq,
        c->varlen ? c->batch : c->b, c->sq};
    void *params[LT__BWD_DSINKS_PARAMS + LT__MAX_HIDDEN];
    for (uint32_t i = 0; i < LT__BWD_DSINKS_PARAMS + k->n_hidden; i++)
        params[i] = &ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only; zero: NULL scratch */
    return lt__cu_launch(k->function, plan->context, (unsigned int)c->hq, 1, 1, k->block_threads, k->shared_bytes,
                         stream, params);
}

/* The launch: each kernel's parameters in its description's order (binding.c_initializer), dq first; then, with
 * dsinks, the sinks' gradient. */
static lt_status lt__bwd_launch(const lt_bwd_plan *plan, const lt_attn_bwd_params *p, const lt__call *c,
                                void *stream) {
    const lt_tensor *q = &p->q, *k = &p->k, *v = &p->v, *o = &p->out, *dout = &p->dout;
    const lt_tensor *dq = &p->dq, *dk = &p->dk, *dv = &p->dv;
    /* No ALiBi, bias, bias gradient or dropout (null pointers, zero strides, p = 0); the window, softcap and chunk
     * are lt__check's. */
    int64_t dq_ints[LT__BWD_DQ_PARAMS - LT__BWD_FLOATS + LT__MAX_HIDDEN] = {
        (int64_t)(uintptr_t)q->data, (int64_t)(uintptr_t)k->data, (int64_t)(uintptr_t)v->data,
        (int64_t)(uintptr_t)o->data, (int64_t)(uintptr_t)dout->data, (int64_t)(uintptr_t)p->lse.data,
        (int64_t)(uintptr_t)p->delta.data, (int64_t)(uintptr_t)dq->data, c->cu_seqlens_q, c->cu_seqlens_k, 0, 0, 0,
        c->seqused_q, c->seqused_k, 0,
        q->strides[0], q->strides[1], q->strides[2], k->strides[0], k->strides[1], k->strides[2],
        v->strides[0], v->strides[1], v->strides[2], o->strides[0], o->strides[1], o->strides[2],
        dout->strides[0], dout->strides[1], dout->strides[2], dq->strides[0], dq->strides[1], dq->strides[2],
        c->hq * c->sq, c->sq, 0, 0, 0, c->hq / c->hk, c->sq, c->sk, c->d, c->dv, c->offset, c->window_left,
        c->window_right, c->attention_chunk, 0, 0, 0, 0, 0};
    int64_t dkdv_ints[LT__BWD_DKDV_PARAMS - LT__BWD_FLOATS + LT__MAX_HIDDEN] = {
        (int64_t)(uintptr_t)q->data, (int64_t)(uintptr_t)k->data, (int64_t)(uintptr_t)v->data,
        (int64_t)(uintptr_t)dout->data, (int64_t)(uintptr_t)p->lse.data, (int64_t)(uintptr_t)p->delta.data,
        (int64_t)(uintptr_t)dk->data, (int64_t)(uintptr_t)dv->data, c->cu_seqlens_q, c->cu_seqlens_k, 0, 0, 0,
        c->seqused_q, c->seqused_k,
        q->strides[0], q->strides[1], q->strides[2], k->strides[0], k->strides[1], k->strides[2],
        v->strides[0], v->strides[1], v->strides[2], dout->strides[0], dout->strides[1], dout->strides[2],
        dk->strides[0], dk->strides[1], dk->strides[2], dv->strides[0], dv->strides[1], dv->strides[2],
        c->hq * c->sq, c->sq, c->hq / c->hk, c->sq, c->sk, c->d, c->dv, c->offset, c->window_left,
        c->window_right, c->attention_chunk, 0, 0, 0, 0, 0};
    float floats[LT__BWD_FLOATS] = {c->scale, c->softcap, 0.0f};
    void *dq_params[LT__BWD_DQ_PARAMS + LT__MAX_HIDDEN], *dkdv_params[LT__BWD_DKDV_PARAMS + LT__MAX_HIDDEN];
    lt__bind(dq_params, dq_ints, LT__BWD_DQ_PARAMS, floats, plan->dq.n_hidden);
    lt__bind(dkdv_params, dkdv_ints, LT__BWD_DKDV_PARAMS, floats, plan->dkdv.n_hidden);
    const lt__bwd_kernel *a = &plan->dq, *b = &plan->dkdv;
    unsigned int grid_z = (unsigned int)(c->varlen ? c->batch : c->b); /* a packed call: one z per sequence */
    lt_status s = lt__cu_launch(a->function, plan->context,
                                (unsigned int)((lt__dispatch_sq(c) + a->tile - 1) / a->tile), (unsigned int)c->hq,
                                grid_z, a->block_threads, a->shared_bytes, stream, dq_params);
    if (s != LT_OK)
        return s;
    s = lt__cu_launch(b->function, plan->context, (unsigned int)((lt__dispatch_sk(c) + b->tile - 1) / b->tile),
                      (unsigned int)c->hk, grid_z, b->block_threads, b->shared_bytes, stream, dkdv_params);
    if (s != LT_OK || !plan->key.dsinks)
        return s;
    return lt__dsinks_launch(plan, p, c, stream);
}

/* ------------------------------------------------------------------------- */
/* The API.                                                                   */

LT_API lt_status lt_attn_bwd_params_init(lt_attn_bwd_params *params) {
    if (params == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_attn_bwd_params_init: params is NULL");
    memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params, params->version = LT_ATTN_BWD_PARAMS_VERSION;
    params->causal = LT_CAUSAL_NONE;
    params->sm_scale = NAN;
    params->window_left = -1, params->window_right = -1; /* softcap 0: off */
    return LT_OK;
}

/* No work (seqlen_q or seqlen_k 0, batch or heads 0): zero what has elements, on the CPU. */
static lt_status lt__bwd_no_work(const lt_attn_bwd_params *p, const lt__call *c) {
    int64_t n = lt__numel(&p->dq) + lt__numel(&p->dk) + lt__numel(&p->dv) + (lt__given(&p->dsinks) ? c->hq : 0);
    if (n == 0)
        return LT_OK;
    if (c->device_type != LT_DEVICE_CPU)
        return lt__fail(LT_ERROR_UNSUPPORTED, "a backward with no work but gradients to zero (batch %lld, heads "
                        "%lld, seqlen_q %lld, seqlen_k %lld) on a GPU is not supported by the C API: the gradients "
                        "are 0 (zero them with cuMemsetD8Async)", (long long)c->b, (long long)c->hq, (long long)c->sq,
                        (long long)c->sk);
    lt__zero_host(&p->dq), lt__zero_host(&p->dk), lt__zero_host(&p->dv);
    if (lt__given(&p->dsinks) && c->hq > 0) /* no row sees a value: every delta is 0 */
        memset(p->dsinks.data, 0, (size_t)c->hq * sizeof(float));
    return LT_OK;
}

LT_API lt_status lt_attn_bwd(const lt_attn_bwd_params *user, void *stream) {
    lt__call c;
    lt_status s;
    lt_attn_bwd_params norm, view, *params = &view;
    if ((s = lt__require_init()) != LT_OK || (s = lt__bwd_prepare(user, &norm, &view)) != LT_OK ||
        (s = lt__bwd_check(&view, &c)) != LT_OK)
        return s;
    if (!lt__bwd_has_work(&c))
        return lt__bwd_no_work(params, &c);
    if (c.device_type == LT_DEVICE_CPU)
        return (lt_status)lt__py_attn_bwd_cpu(&norm); /* the caller's layout: Python checks and packs it again */
    lt__plan_key key = lt__bwd_key_of(&c);
    lt_bwd_plan *plan = lt__memo_find(&key);
    if (plan != NULL)
        return lt__bwd_launch(plan, params, &c, stream);
    lt_bwd_plan *made = NULL;
    if ((s = lt__make_bwd_plan(&c, &made)) != LT_OK)
        return s;
    plan = lt__memo_add(&key, made);
    s = lt__bwd_launch(plan != NULL ? plan : made, params, &c, stream);
    if (plan != made)
        free(made); /* another thread's plan was kept, or the table is full */
    return s;
}

LT_API lt_status lt_attn_bwd_plan(const lt_attn_bwd_params *params, lt_bwd_plan **plan) {
    lt__call c;
    lt_status s;
    lt_attn_bwd_params norm, view;
    if (plan == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_attn_bwd_plan: plan (the out pointer) is NULL");
    *plan = NULL;
    if ((s = lt__require_init()) != LT_OK || (s = lt__bwd_prepare(params, &norm, &view)) != LT_OK ||
        (s = lt__bwd_check(&view, &c)) != LT_OK)
        return s;
    return lt__make_bwd_plan(&c, plan);
}

LT_API lt_status lt_bwd_plan_launch(const lt_bwd_plan *plan, const lt_attn_bwd_params *user, void *stream) {
    lt__call c;
    lt_status s;
    lt_attn_bwd_params norm, view, *params = &view;
    if (plan == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_bwd_plan_launch: plan is NULL");
    if (plan->magic != LT__BWD_PLAN_MAGIC)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "lt_bwd_plan_launch: plan is not a live backward plan "
                        "(destroyed, or not made by lt_attn_bwd_plan)");
    if ((s = lt__bwd_prepare(user, &norm, &view)) != LT_OK || (s = lt__bwd_check(params, &c)) != LT_OK)
        return s;
    if (!lt__bwd_has_work(&c)) /* checked first: a call without work has no alignment to compare */
        return lt__plannable(&c, "lt_attn_bwd");
    if ((s = lt__check_key(&plan->key, &c)) != LT_OK)
        return s;
    return lt__bwd_launch(plan, params, &c, stream);
}

LT_API lt_status lt_bwd_plan_destroy(lt_bwd_plan *plan) {
    if (plan == NULL)
        return LT_OK;
    if (plan->magic != LT__BWD_PLAN_MAGIC)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "lt_bwd_plan_destroy: plan is not a live backward plan "
                        "(destroyed twice?)");
    plan->magic = 0;
    free(plan);
    return LT_OK;
}
