/*
 * lt_scratch.c: how a forward plan launches one of its kernels (included by lazytriton.c).
 *
 * A kernel whose entry takes scratch memory (Triton's hidden global_scratch and profile_scratch parameters, some
 * bytes a program: the TMA descriptors flash_fwd's TMA variant and the Gluon FP8 forward make on the device) gets
 * it per launch, never from the plan (plans are shared by threads and streams): from the front of the call's
 * workspace (lt_attn_fwd_params version 8) when it gives one, each region aligned to its entry's alignment, else
 * allocated on the stream with cuMemAllocAsync before the launch and freed with cuMemFreeAsync after it (stream
 * ordered: the memory is reused only once the launch has run, and a CUDA graph captures both as memory nodes).
 * Scratch pointers are laid out as lt_launch.c's ltn_params lays them (native/lt_launch.c): each hidden parameter
 * after the kernel's own, the global or profile scratch its entry names, NULL where the size is 0.
 *
 * The FP8 forward's plan may hold a twin, flash_fwd_fp8_gluon (sm_90): lt__twin_fits is fp8_gluon.fits for the
 * part of a call the plan's key cannot see (the seqlens dividing its tiles, a positive scale, a causal offset >= 0).
 */

/* The planner's scratch answer is one C can pass: each hidden parameter named once, aligns powers of two. */
static int lt__bad_need(const lt__scratch_need *n, uint32_t n_hidden) {
    int seen[2] = {0, 0};
    if (n->size[0] == 0 && n->size[1] == 0)
        return 0; /* every hidden parameter gets NULL */
    for (uint32_t h = 0; h < n_hidden && h < 8; h++) {
        if (n->hidden[h] > 1 || seen[n->hidden[h]]++)
            return 1;
    }
    for (int s = 0; s < 2; s++)
        if (n->size[s] > 0 && (!seen[s] || n->align[s] == 0 || (n->align[s] & (n->align[s] - 1)) != 0))
            return 1;
    return 0;
}

/* Whether the FP8 call c runs on plan's twin: fp8_gluon.fits on what the plan's key leaves open. */
static int lt__twin_fits(const lt_plan *plan, const lt__call *c) {
    const lt__kernel_plan *t = &plan->twin;
    return t->function != NULL && c->sq > 0 && c->sq % t->block_m == 0 && c->sk > 0 && c->sk % t->block_n == 0 &&
           c->scale > 0.0f && (c->causal == LT_CAUSAL_NONE || c->offset >= 0);
}

/* The kernel of plan that serves call c. */
static const lt__kernel_plan *lt__fwd_kernel(const lt_plan *plan, const lt__call *c) {
    return lt__twin_fits(plan, c) ? &plan->twin : &plan->kernel;
}

static void lt__fwd_grid(const lt__kernel_plan *k, const lt__call *c, unsigned int grid[3]) {
    grid[0] = (unsigned int)((lt__dispatch_sq(c) + k->block_m - 1) / k->block_m);
    grid[1] = (unsigned int)c->hq, grid[2] = (unsigned int)(c->varlen ? c->batch : c->b);
}

/* Each scratch region's bytes for grid, and the workspace that holds both from any 4-byte-aligned start (each
 * region's bytes plus its alignment - 1): 0, or -1 when it overflows 64 bits. */
static int lt__scratch_bytes(const lt__kernel_plan *k, const unsigned int grid[3], uint64_t bytes[2],
                             uint64_t *workspace) {
    uint64_t programs = (uint64_t)grid[0] * grid[1], total = 0;
    int overflow = __builtin_mul_overflow(programs, (uint64_t)grid[2], &programs) ||
                   __builtin_mul_overflow(programs, (uint64_t)k->need.num_ctas, &programs);
    for (int s = 0; s < 2; s++) {
        bytes[s] = 0;
        overflow = overflow || __builtin_mul_overflow(programs, (uint64_t)k->need.size[s], &bytes[s]);
        if (bytes[s] > 0)
            overflow = overflow || __builtin_add_overflow(total, bytes[s] + k->need.align[s] - 1, &total);
    }
    *workspace = overflow ? 0 : total;
    return overflow ? -1 : 0;
}

/* The scratch of one launch from the call's workspace: at[s] each region's address, or a status naming what the
 * workspace lacks. */
static lt_status lt__scratch_from_workspace(const lt__kernel_plan *k, const lt__call *c, const uint64_t bytes[2],
                                            uint64_t need, uint64_t at[2], const char *variant) {
    if (need > (uint64_t)c->workspace_bytes)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "workspace holds %lld bytes but %s needs %llu bytes of scratch "
                        "memory for this call (%llu and %llu bytes, aligned to %u and %u): size it with "
                        "lt_plan_workspace_size or lt_attn_fwd_workspace_size", (long long)c->workspace_bytes,
                        variant, (unsigned long long)need, (unsigned long long)bytes[0],
                        (unsigned long long)bytes[1], k->need.align[0], k->need.align[1]);
    uint64_t next = (uint64_t)c->workspace;
    for (int s = 0; s < 2; s++)
        if (bytes[s] > 0) {
            at[s] = (next + k->need.align[s] - 1) & ~(uint64_t)(k->need.align[s] - 1);
            next = at[s] + bytes[s];
        }
    return LT_OK;
}

/* Allocate each region on stream (the context current), aligned: own[s] to free, at[s] to pass. */
static lt_status lt__scratch_alloc(const lt__kernel_plan *k, const uint64_t bytes[2], void *stream, uint64_t own[2],
                                   uint64_t at[2]) {
    for (int s = 0; s < 2; s++) {
        if (bytes[s] == 0)
            continue;
        uint32_t align = k->need.align[s];
        uint64_t pad = align > 256 ? align - 1 : 0; /* the driver's allocations are 256-byte aligned */
        lt__CUresult r = lt__cu.mem_alloc_async(&own[s], (size_t)(bytes[s] + pad), stream);
        if (r != 0)
            return lt__cuda_fail(r, "cuMemAllocAsync");
        at[s] = (own[s] + align - 1) & ~(uint64_t)(align - 1);
        if (at[s] - own[s] > pad)
            return lt__fail(LT_ERROR_CUDA, "cuMemAllocAsync returned %#llx, not %u-byte aligned",
                            (unsigned long long)own[s], align);
    }
    return LT_OK;
}

/* A launch of k whose grid needs scratch memory: the workspace's, or the stream's for this launch alone. */
static lt_status lt__launch_scratch(const lt_plan *plan, const lt__kernel_plan *k, const lt__call *c,
                                    const unsigned int grid[3], void **params, uint32_t n_params, void *stream) {
    uint64_t bytes[2], need, at[2] = {0, 0}, own[2] = {0, 0};
    lt_status s;
    if (lt__scratch_bytes(k, grid, bytes, &need) != 0)
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "grid (%u, %u, %u): the scratch memory of %s (%u and %u bytes "
                        "a program) overflows 64 bits", grid[0], grid[1], grid[2], plan->variant, k->need.size[0],
                        k->need.size[1]);
    int given = c->workspace_given;
    if (given && (s = lt__scratch_from_workspace(k, c, bytes, need, at, plan->variant)) != LT_OK)
        return s;
    if (!given && need > 0 && (lt__cu.mem_alloc_async == NULL || lt__cu.mem_free_async == NULL))
        return lt__fail(LT_ERROR_UNSUPPORTED, "%s needs %llu bytes of scratch memory for this call, and this CUDA "
                        "driver has no cuMemAllocAsync (CUDA 11.2+): give a workspace (lt_attn_fwd_params version "
                        "8, lt_plan_workspace_size bytes)", plan->variant, (unsigned long long)need);
    for (uint32_t h = 0; h < k->n_hidden; h++)
        params[n_params + h] = &at[k->need.hidden[h]];
    lt__CUcontext current = NULL;
    lt__cu.ctx_get_current(&current);
    int pushed = current != plan->context;
    lt__CUresult r;
    if (pushed && (r = lt__cu.ctx_push(plan->context)) != 0)
        return lt__cuda_fail(r, "cuCtxPushCurrent");
    s = given ? LT_OK : lt__scratch_alloc(k, bytes, stream, own, at);
    if (s == LT_OK && (r = lt__cu.launch(k->function, grid[0], grid[1], grid[2], k->block_threads, 1, 1,
                                         k->shared_bytes, stream, params, NULL)) != 0)
        s = lt__cuda_fail(r, "cuLaunchKernel");
    for (int i = 0; i < 2; i++) /* stream-ordered: freed once the launch has run */
        if (own[i] && (r = lt__cu.mem_free_async(own[i], stream)) != 0 && s == LT_OK)
            s = lt__cuda_fail(r, "cuMemFreeAsync");
    if (pushed)
        lt__cu.ctx_pop(&current);
    return s;
}

/* Launch k of plan for call c: params holds the kernel's n_params parameters and room for its hidden ones, which
 * point at zero (NULL) where it takes no scratch memory. */
static lt_status lt__launch_kernel(const lt_plan *plan, const lt__kernel_plan *k, const lt__call *c, void **params,
                                   uint32_t n_params, const int64_t *zeros, void *stream) {
    unsigned int grid[3];
    lt__fwd_grid(k, c, grid);
    if (k->scratch)
        return lt__launch_scratch(plan, k, c, grid, params, n_params, stream);
    for (uint32_t h = 0; h < k->n_hidden; h++)
        params[n_params + h] = (void *)&zeros[h]; /* zero: NULL scratch */
    return lt__cu_launch(k->function, plan->context, grid[0], grid[1], grid[2], k->block_threads, k->shared_bytes,
                         stream, params);
}

/* The workspace bytes a call c needs through plan (0 without scratch memory); LT_ERROR_INVALID_ARGUMENT when the
 * scratch overflows 64 bits or size_t. */
static lt_status lt__plan_need(const lt_plan *plan, const lt__call *c, size_t *out) {
    const lt__kernel_plan *k = lt__fwd_kernel(plan, c);
    unsigned int grid[3];
    uint64_t bytes[2], need = 0;
    lt__fwd_grid(k, c, grid);
    if (k->scratch && (lt__scratch_bytes(k, grid, bytes, &need) != 0 || need > SIZE_MAX))
        return lt__fail(LT_ERROR_INVALID_ARGUMENT, "grid (%u, %u, %u): the scratch memory of %s overflows 64 bits",
                        grid[0], grid[1], grid[2], plan->variant);
    *out = (size_t)need;
    return LT_OK;
}
