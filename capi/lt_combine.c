/*
 * lt_combine.c: lt_flash_combine, the C twin of lazytriton.flash_attn_combine: its checks, plan and launch.
 * Included at the end of lazytriton.c (one translation unit): it uses lt__fail, lt_check.c's tensor checks,
 * lt_alias.c's write checks, the plan memo and lt__cu_launch.
 *
 * The checks are kernels/flash_combine/checks.py's (shapes, dtypes, strides, devices, sizes), with messages that
 * name the argument. The kernel (kernels/flash_combine) takes its rows as (batch, query, head); the C API's rows
 * are FlashAttention-3's packed ones, batch 1 of seqlen rows (the binding's packed call: batch strides 0). Its
 * integer arguments are the binding's (binding.c_initializer, tested field by field), and so is the variant
 * (the planner calls the binding's variant).
 */

#define LT__COMBINE_PARAMS 23           /* flash_combine: 23 pointers and integers */
#define LT__COMBINE_MAX_BLOCK_D 128     /* flash_combine.MAX_BLOCK_D: a program's head-dim columns at most */
#define LT__COMBINE_ROW_MARGIN 256      /* checks._ROW_MARGIN: row indices stay in 32 bits past the last row */
#define LT__COMBINE_PLAN_MAGIC 0x6c747063u /* "ltpc" */
#define LT__KERNEL_COMBINE 4               /* a plan key's kernel: flash_combine (not a planner code) */

typedef struct {
    int64_t splits, rows, heads, head_dim, n_rows;
    int32_t dtype, device_type, device_index; /* dtype: out's */
    int aligned, index64;
} lt__combine_call;

/* What lt_flash_combine asks the planner (embedded_combine.py) for, and its answer (also in build.py's cdef). */
typedef struct {
    int32_t device_index, dtype, head_dim, aligned, index64; /* in: dtype is out's */
    uint64_t function;                                       /* out */
    uint32_t block_threads, shared_bytes, block_m, block_d, n_hidden;
    char variant[512];
} lt__combine_plan_request;

static int lt__py_combine_plan(lt__combine_plan_request *request);
static int lt__py_flash_combine_cpu(const lt_flash_combine_params *params);

typedef struct {
    uint32_t magic;
    lt__plan_key key;
    lt__CUcontext context;
    lt__combine_plan_request r;
} lt__combine_plan;

/* ------------------------------------------------------------------------- */
/* Checks                                                                     */

static lt_status lt__combine_struct(const lt_flash_combine_params *p) {
    if (p == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "params is NULL");
    if (p->struct_size != sizeof(lt_flash_combine_params))
        return lt__fail(LT_ERROR_VERSION, "params->struct_size is %u but this lazytriton %d.%d.%d takes %zu for "
                        "lt_flash_combine_params: rebuild against its lazytriton.h and fill params with "
                        "lt_flash_combine_params_init()", p->struct_size, LT_VERSION_MAJOR, LT_VERSION_MINOR,
                        LT_VERSION_PATCH, sizeof(lt_flash_combine_params));
    if (p->version != LT_FLASH_COMBINE_PARAMS_VERSION)
        return lt__fail(LT_ERROR_VERSION, "params->version is %u but this lazytriton takes lt_flash_combine_params "
                        "version %d", p->version, LT_FLASH_COMBINE_PARAMS_VERSION);
    return LT_OK;
}

static lt_status lt__combine_same_device(const char *name, const lt_tensor *t, const lt_tensor *first) {
    if (t->device_type != first->device_type || t->device_index != first->device_index)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s is on %s:%d but out_partial is on %s:%d; all tensors of a "
                        "call must be on one device", name, lt__device_name(t->device_type), t->device_index,
                        lt__device_name(first->device_type), first->device_index);
    return LT_OK;
}

/* A float32 tensor of the partials or lse, on out_partial's device. */
static lt_status lt__combine_fp32(const char *name, const lt_tensor *t, int32_t ndim, const char *layout,
                                  const lt_tensor *first) {
    lt_status s;
    if ((s = lt__check_tensor(name, t, ndim, layout)) != LT_OK)
        return s;
    if (t->dtype != LT_DTYPE_FP32)
        return lt__fail(LT_ERROR_DTYPE, "%s.dtype is %s; expected LT_DTYPE_FP32 (FlashAttention-3's partial results "
                        "and logsumexps are float32)", name, lt__dtype_name(t->dtype));
    return lt__combine_same_device(name, t, first);
}

/* Fill *c from params, or fail with the first problem found (checks.check's order). */
static lt_status lt__combine_check(const lt_flash_combine_params *p, lt__combine_call *c) {
    lt_status s;
    memset(c, 0, sizeof *c);
    const lt_tensor *op = &p->out_partial, *lp = &p->lse_partial, *o = &p->out, *l = &p->lse;
    if ((s = lt__combine_struct(p)) != LT_OK ||
        (s = lt__combine_fp32("out_partial", op, 4, "(num_splits, rows, heads, head_dim)", op)) != LT_OK ||
        (s = lt__combine_fp32("lse_partial", lp, 3, "(num_splits, rows, heads)", op)) != LT_OK)
        return s;
    const int64_t *ps = op->sizes;
    c->splits = ps[0], c->rows = ps[1], c->heads = ps[2], c->head_dim = ps[3];
    if (lp->sizes[0] != ps[0] || lp->sizes[1] != ps[1] || lp->sizes[2] != ps[2])
        return lt__fail(LT_ERROR_SHAPE, "lse_partial must have shape (%lld, %lld, %lld) (out_partial's without its "
                        "head dim), got (%lld, %lld, %lld)", (long long)ps[0], (long long)ps[1], (long long)ps[2],
                        (long long)lp->sizes[0], (long long)lp->sizes[1], (long long)lp->sizes[2]);
    if (c->head_dim < 1)
        return lt__fail(LT_ERROR_HEAD_DIM, "out_partial's head dim (sizes[3]) must be >= 1, got %lld",
                        (long long)c->head_dim);
    if (c->head_dim > 1 && op->strides[3] != 1)
        return lt__fail(LT_ERROR_SHAPE, "out_partial.strides[3] is %lld; the last dim must be contiguous (stride 1)",
                        (long long)op->strides[3]);
    if ((s = lt__check_tensor("out", o, 3, "(rows, heads, head_dim)")) != LT_OK ||
        (s = lt__combine_same_device("out", o, op)) != LT_OK)
        return s;
    if (o->sizes[0] != c->rows || o->sizes[1] != c->heads || o->sizes[2] != c->head_dim)
        return lt__fail(LT_ERROR_SHAPE, "out must have shape (%lld, %lld, %lld) (out_partial's without its splits), "
                        "got (%lld, %lld, %lld)", (long long)c->rows, (long long)c->heads, (long long)c->head_dim,
                        (long long)o->sizes[0], (long long)o->sizes[1], (long long)o->sizes[2]);
    if (c->head_dim > 1 && o->strides[2] != 1)
        return lt__fail(LT_ERROR_SHAPE, "out.strides[2] is %lld; the last dim must be contiguous (stride 1)",
                        (long long)o->strides[2]);
    if ((s = lt__combine_fp32("lse", l, 2, "(rows, heads)", op)) != LT_OK)
        return s;
    if (l->sizes[0] != c->rows || l->sizes[1] != c->heads)
        return lt__fail(LT_ERROR_SHAPE, "lse must have shape (%lld, %lld) (rows, heads), got (%lld, %lld)",
                        (long long)c->rows, (long long)c->heads, (long long)l->sizes[0], (long long)l->sizes[1]);
    if (p->flags != 0 || p->reserved != 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "flags and reserved must be 0, got 0x%x and 0x%x", p->flags,
                        p->reserved);
    c->n_rows = c->rows * c->heads;
    if (c->n_rows > INT32_MAX - LT__COMBINE_ROW_MARGIN)
        return lt__fail(LT_ERROR_SHAPE, "out_partial has %lld (rows, heads) rows; at most %d are supported (32-bit "
                        "row indices)", (long long)c->n_rows, INT32_MAX - LT__COMBINE_ROW_MARGIN);
    if (c->head_dim > 65535LL * LT__COMBINE_MAX_BLOCK_D)
        return lt__fail(LT_ERROR_HEAD_DIM, "out_partial's head dim must be at most %lld, got %lld",
                        65535LL * LT__COMBINE_MAX_BLOCK_D, (long long)c->head_dim);
    if (c->splits > INT32_MAX)
        return lt__fail(LT_ERROR_SHAPE, "num_splits (out_partial.sizes[0]) is %lld; at most 2147483647",
                        (long long)c->splits);
    c->dtype = o->dtype, c->device_type = op->device_type, c->device_index = op->device_index;
    const lt__named all[4] = {{"out_partial", op}, {"lse_partial", lp}, {"out", o}, {"lse", l}};
    for (int i = 0; i < 4 && c->n_rows > 0; i++)
        if (all[i].t->data == NULL && (i >= 2 || c->splits > 0))
            return lt__fail(LT_ERROR_NULL_POINTER, "%s.data is NULL", all[i].name);
    /* binding.layout_flags: the partial outputs' and out's pointers and outer strides; 64-bit past 2**31. */
    uint64_t bits = (uint64_t)(uintptr_t)op->data | (uint64_t)(uintptr_t)o->data |
                    (uint64_t)(op->strides[0] | op->strides[1] | op->strides[2] | o->strides[0] | o->strides[1]);
    c->aligned = (bits & 15) == 0;
    int64_t extent = 0;
    for (int i = 0; i < 4; i++) {
        int64_t e = 0, part;
        for (int d = 0; d < all[i].t->ndim; d++) {
            if (all[i].t->sizes[d] == 0)
                continue;
            if (__builtin_mul_overflow(all[i].t->sizes[d] - 1, all[i].t->strides[d], &part) ||
                __builtin_add_overflow(e, part, &e) || e > INT64_MAX / 2)
                return lt__fail(LT_ERROR_SHAPE, "%s's sizes and strides reach past 2**62 elements", all[i].name);
        }
        extent = e > extent ? e : extent;
    }
    c->index64 = extent >= INT32_MAX;
    const lt__named outputs[2] = {{"out", o}, {"lse", l}}, inputs[2] = {{"out_partial", op}, {"lse_partial", lp}};
    return lt__check_writes(outputs, 2, inputs, 2);
}

/* ------------------------------------------------------------------------- */
/* Plans and the launch                                                       */

static lt__plan_key lt__combine_key_of(const lt__combine_call *c) {
    lt__plan_key key;
    memset(&key, 0, sizeof key);
    key.kernel = LT__KERNEL_COMBINE, key.device_index = c->device_index, key.dtype = c->dtype;
    key.head_dim = (int32_t)c->head_dim, key.aligned = c->aligned, key.index64 = c->index64;
    return key;
}

static lt_status lt__combine_make_plan(const lt__combine_call *c, lt__combine_plan **out) {
    lt_status s;
    lt__CUcontext context;
    int32_t capability;
    if ((s = lt__device_context(c->device_index, &context, &capability)) != LT_OK)
        return s;
    lt__combine_plan *plan = (lt__combine_plan *)calloc(1, sizeof *plan);
    if (plan == NULL)
        return lt__fail(LT_ERROR_INTERNAL, "out of memory");
    lt__combine_plan_request *r = &plan->r;
    r->device_index = c->device_index, r->dtype = c->dtype, r->head_dim = (int32_t)c->head_dim;
    r->aligned = c->aligned, r->index64 = c->index64;
    if ((s = (lt_status)lt__py_combine_plan(r)) != LT_OK) {
        free(plan);
        return s;
    }
    r->variant[sizeof r->variant - 1] = '\0';
    if (r->function == 0 || r->block_threads == 0 || r->block_m == 0 || r->block_d == 0 ||
        r->n_hidden > LT__MAX_HIDDEN) {
        s = lt__fail(LT_ERROR_INTERNAL, "the planner answered an unusable combine plan for %s", r->variant);
        free(plan);
        return s;
    }
    plan->magic = LT__COMBINE_PLAN_MAGIC, plan->key = lt__combine_key_of(c), plan->context = context;
    *out = plan;
    return LT_OK;
}

/* flash_combine's parameters in its description's order (binding.c_initializer): the rows as batch 1 of rows
 * (batch strides 0), then NULL hidden scratch pointers. */
static lt_status lt__combine_launch(const lt__combine_plan *plan, const lt_flash_combine_params *p,
                                    const lt__combine_call *c, void *stream) {
    const lt__combine_plan_request *r = &plan->r;
    const lt_tensor *op = &p->out_partial, *lp = &p->lse_partial, *o = &p->out, *l = &p->lse;
    int64_t ints[LT__COMBINE_PARAMS + LT__MAX_HIDDEN] = {
        LT__PTR(p->out_partial), LT__PTR(p->lse_partial), LT__PTR(p->out), LT__PTR(p->lse),
        op->strides[0], 0, op->strides[1], op->strides[2], lp->strides[0], 0, lp->strides[1], lp->strides[2],
        0, o->strides[0], o->strides[1], 0, l->strides[0], l->strides[1],
        c->heads, c->rows, c->head_dim, c->splits, c->n_rows};
    void *params[LT__COMBINE_PARAMS + LT__MAX_HIDDEN];
    for (int i = 0; i < LT__COMBINE_PARAMS + (int)r->n_hidden; i++)
        params[i] = &ints[i]; /* an i32 parameter reads the low 4 bytes: little-endian hosts only */
    return lt__cu_launch((lt__CUfunction)(uintptr_t)r->function, plan->context,
                         (unsigned int)lt__ceil_div(c->n_rows, r->block_m),
                         (unsigned int)lt__ceil_div(c->head_dim, r->block_d), 1, r->block_threads, r->shared_bytes,
                         stream, params);
}

/* ------------------------------------------------------------------------- */
/* The API.                                                                   */

LT_API lt_status lt_flash_combine_params_init(lt_flash_combine_params *params) {
    if (params == NULL)
        return lt__fail(LT_ERROR_NULL_POINTER, "lt_flash_combine_params_init: params is NULL");
    memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params, params->version = LT_FLASH_COMBINE_PARAMS_VERSION;
    return LT_OK;
}

LT_API lt_status lt_flash_combine(const lt_flash_combine_params *params, void *stream) {
    lt__combine_call c;
    lt_status s;
    if ((s = lt__require_init()) != LT_OK || (s = lt__combine_check(params, &c)) != LT_OK)
        return s;
    if (c.n_rows == 0)
        return LT_OK;
    if (c.device_type == LT_DEVICE_CPU)
        return (lt_status)lt__py_flash_combine_cpu(params);
    lt__plan_key key = lt__combine_key_of(&c);
    lt__combine_plan *plan = lt__memo_find(&key);
    if (plan != NULL)
        return lt__combine_launch(plan, params, &c, stream);
    lt__combine_plan *made = NULL;
    if ((s = lt__combine_make_plan(&c, &made)) != LT_OK)
        return s;
    plan = lt__memo_add(&key, made);
    s = lt__combine_launch(plan != NULL ? plan : made, params, &c, stream);
    if (plan != made)
        free(made); /* another thread's plan was kept, or the table is full */
    return s;
}
