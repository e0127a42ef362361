/*
 * lt_alias.c: the tensors a call writes must own their memory. Included by lazytriton.c after lt_check.c (one
 * translation unit).
 *
 * The kernels write their outputs while other programs still read the inputs: an output that shares memory
 * with an input, with another output, or with itself (a stride of 0, or strides that interleave its rows) gives
 * a result that depends on the order the programs run in. Such a call is refused with
 * LT_ERROR_INVALID_ARGUMENT before anything runs, and the message names both tensors.
 *
 * Two tensors share memory when an element of one lies on an element of the other. For two tensors with the
 * same strides and element size (views of one buffer, such as FlashAttention's packed dqkv (batch, seqlen, 3,
 * heads, head_dim), whose dq, dk and dv interleave without sharing an element) the test is exact; otherwise
 * the byte ranges they span decide, as torch's own test for out= arguments does: ranges that interleave are
 * refused even where no element coincides.
 */

#define LT__ALIAS_MAX_STEPS 4096 /* the exact test's search: past this, the tensors count as sharing memory */
#define LT__ALIAS_MAX_OUTPUTS 8  /* the most tensors a call writes (the backward: 5) */
#define LT__ALIAS_MAX_INPUTS 24  /* the most tensors a call reads beside them (decoding: 19) */

typedef struct {
    const char *name;
    const lt_tensor *t;
} lt__named;

static int64_t lt__item_bytes(int32_t dtype) {
    return dtype == LT_DTYPE_FP8_E4M3 || dtype == LT_DTYPE_FP8_E5M2 ? 1 : dtype == LT_DTYPE_FP16 || dtype == LT_DTYPE_BF16 ? 2 : 4;
}

/* The bytes [begin, end) a tensor spans; has 0 when it has no data or no elements (nothing of it is read or
 * written). */
typedef struct {
    __int128 begin, end;
    int has;
} lt__span;

/* Inlined: every tensor of every call goes through it (a plan launch's checks are measured in ns). */
__attribute__((always_inline)) static inline lt__span lt__span_of(const lt_tensor *t) {
    lt__span span = {0, 0, 0};
    if (t->data == NULL || t->ndim <= 0 || t->ndim > 4)
        return span;
    __int128 last = 0; /* the last element's offset, in elements: at most 4 x 2**63 x 2**48 */
    for (int i = 0; i < t->ndim; i++) {
        if (t->sizes[i] <= 0)
            return span;
        last += (__int128)(t->sizes[i] - 1) * t->strides[i];
    }
    span.begin = (__int128)(uintptr_t)t->data;
    span.end = span.begin + (last + 1) * lt__item_bytes(t->dtype);
    span.has = 1;
    return span;
}

/* Whether two index tuples of t reach one element: sorted by stride, some dim of size > 1 does not step past
 * all the dims below it (a stride of 0 included). */
static int lt__self_overlaps(const lt_tensor *t) {
    int64_t stride[4], size[4];
    int n = 0, sorted = 1;
    if (t->data == NULL || t->ndim <= 0 || t->ndim > 4)
        return 0;
    for (int i = t->ndim - 1; i >= 0; i--) { /* last dim first: a row-major layout comes sorted */
        if (t->sizes[i] == 0)
            return 0; /* no elements */
        if (t->sizes[i] > 1) {
            stride[n] = t->strides[i], size[n] = t->sizes[i];
            sorted = sorted && (n == 0 || stride[n - 1] <= stride[n]);
            n++;
        }
    }
    for (int i = 1; i < n && !sorted; i++) /* insertion sort, by stride (the order of equal strides does not matter) */
        for (int j = i; j > 0 && stride[j] < stride[j - 1]; j--) {
            int64_t swap_stride = stride[j], swap_size = size[j];
            stride[j] = stride[j - 1], size[j] = size[j - 1];
            stride[j - 1] = swap_stride, size[j - 1] = swap_size;
        }
    __int128 reach = 0; /* the farthest offset the dims below reach */
    for (int i = 0; i < n; i++) {
        if (stride[i] <= reach)
            return 1;
        reach += (__int128)(size[i] - 1) * stride[i];
    }
    return 0;
}

/* Whether sum(delta[i] * stride[i]) == target for some delta[i] in lo[i]..hi[i] (dims n..: by stride, largest
 * first). *steps bounds the search. */
static int lt__reachable(__int128 target, const int64_t *stride, const __int128 *lo, const __int128 *hi, int n,
                         int *steps) {
    if (n == 0)
        return target == 0;
    if (++*steps > LT__ALIAS_MAX_STEPS)
        return 1;
    __int128 rest_lo = 0, rest_hi = 0; /* what the smaller dims can add */
    for (int i = 1; i < n; i++)
        rest_lo += lo[i] * stride[i], rest_hi += hi[i] * stride[i];
    /* delta with target - delta * s in rest_lo..rest_hi: delta in (target - rest_hi) / s .. (target - rest_lo) / s */
    __int128 s = stride[0], from = target - rest_hi, to = target - rest_lo;
    __int128 first = from >= 0 ? (from + s - 1) / s : -((-from) / s);
    __int128 last = to >= 0 ? to / s : -((-to + s - 1) / s);
    first = first > lo[0] ? first : lo[0];
    last = last < hi[0] ? last : hi[0];
    for (__int128 d = first; d <= last; d++)
        if (lt__reachable(target - d * s, stride + 1, lo + 1, hi + 1, n - 1, steps))
            return 1;
    return 0;
}

/* Whether two spans have a byte in common. */
static int lt__spans_meet(const lt__span *a, const lt__span *b) {
    return a->has && b->has && a->begin < b->end && b->begin < a->end;
}

/* Whether a and b, whose spans as and bs meet, have an element at one address (a conservative "yes" when the
 * exact test does not apply or takes too long). */
static int lt__share_memory(const lt_tensor *a, const lt__span *as, const lt_tensor *b, const lt__span *bs) {
    __int128 a0 = as->begin, b0 = bs->begin;
    int64_t item = lt__item_bytes(a->dtype);
    if (a->ndim != b->ndim || item != lt__item_bytes(b->dtype) || (b0 - a0) % item != 0 ||
        memcmp(a->strides, b->strides, sizeof(int64_t) * (size_t)a->ndim) != 0)
        return 1;
    /* a's element at i, b's at j: one address when sum((i - j) * stride) == (b0 - a0) / item. */
    int64_t stride[4];
    __int128 lo[4], hi[4];
    int n = 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->strides[i] > 0) {
            int at = n++;
            for (; at > 0 && stride[at - 1] < a->strides[i]; at--) /* largest stride first */
                stride[at] = stride[at - 1], lo[at] = lo[at - 1], hi[at] = hi[at - 1];
            stride[at] = a->strides[i], lo[at] = -(__int128)(b->sizes[i] - 1), hi[at] = a->sizes[i] - 1;
        }
    int steps = 0;
    return lt__reachable((b0 - a0) / item, stride, lo, hi, n, &steps);
}

/* Refuse a call that writes memory another of its tensors uses: an output with itself, with another output, or
 * with an input. Each tensor's span is computed once. */
static lt_status lt__check_writes(const lt__named *outputs, int n_outputs, const lt__named *inputs, int n_inputs) {
    lt__span out[LT__ALIAS_MAX_OUTPUTS], in[LT__ALIAS_MAX_INPUTS];
    int read[LT__ALIAS_MAX_INPUTS], n_read = 0; /* the inputs with a span, in order */
    if (n_outputs > LT__ALIAS_MAX_OUTPUTS || n_inputs > LT__ALIAS_MAX_INPUTS)
        return lt__fail(LT_ERROR_INTERNAL, "lt__check_writes: %d outputs and %d inputs; at most %d and %d",
                        n_outputs, n_inputs, LT__ALIAS_MAX_OUTPUTS, LT__ALIAS_MAX_INPUTS);
    for (int j = 0; j < n_inputs; j++)
        if ((in[n_read] = lt__span_of(inputs[j].t)).has)
            read[n_read++] = j;
    for (int i = 0; i < n_outputs; i++) {
        out[i] = lt__span_of(outputs[i].t);
        if (lt__self_overlaps(outputs[i].t))
            return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s's sizes and strides put several of its elements at one "
                            "address (a stride of 0, or strides that interleave its rows); a tensor the call writes "
                            "must have one address per element", outputs[i].name);
        for (int j = 0; j < i; j++)
            if (lt__spans_meet(&out[i], &out[j]) && lt__share_memory(outputs[i].t, &out[i], outputs[j].t, &out[j]))
                return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s and %s share memory; the tensors a call writes must "
                                "not overlap each other", outputs[j].name, outputs[i].name);
        for (int r = 0; r < n_read; r++)
            if (lt__spans_meet(&out[i], &in[r]) && lt__share_memory(outputs[i].t, &out[i], inputs[read[r]].t, &in[r]))
                return lt__fail(LT_ERROR_INVALID_ARGUMENT, "%s shares memory with %s; a tensor the call writes must "
                                "not overlap one it reads", outputs[i].name, inputs[read[r]].name);
    }
    return LT_OK;
}

/* A forward call (lt__check passed it): out, lse and the workspace against q, k, v, the cumulative and the used
 * lengths, the sinks and the descales. */
static lt_status lt__fwd_writes(const lt_attn_fwd_params *p) {
    const lt__named outputs[3] = {{"out", &p->out}, {"lse", &p->lse}, {"workspace", &p->workspace}};
    const lt__named inputs[11] = {{"q", &p->q}, {"k", &p->k}, {"v", &p->v}, {"cu_seqlens_q", &p->cu_seqlens_q},
                                  {"cu_seqlens_k", &p->cu_seqlens_k}, {"seqused_q", &p->seqused_q},
                                  {"seqused_k", &p->seqused_k}, {"sinks", &p->sinks}, {"q_descale", &p->q_descale},
                                  {"k_descale", &p->k_descale}, {"v_descale", &p->v_descale}};
    return lt__check_writes(outputs, lt__given(&p->workspace) ? 3 : 2, inputs, 11);
}
