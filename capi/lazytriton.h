/*
 * lazytriton.h: the C API of lazytriton (liblazytriton.so), C99.
 *
 * FlashAttention kernels (forward and backward) served from lazytriton's persistent cache:
 * prewarmed images, the local cache, the shared tier, and a just-in-time
 * compile when none of them holds the kernel, behind a small, stable C ABI.
 *
 * Conventions:
 * - Every function returns an lt_status: LT_OK (0) or a named error code.
 *   Results are written through pointer arguments.
 * - lt_last_error() returns the calling thread's last error message, which
 *   stays valid until the next failing call on that thread.
 * - Structs passed in carry their own size and version (struct_size =
 *   sizeof(the struct), version = its LT_*_VERSION macro); a struct of another
 *   size or version is refused with LT_ERROR_VERSION, never misread. The
 *   *_init() helpers fill both. A params struct of an older version (its
 *   size and version) is still taken, and means what it meant then.
 * - The library embeds the CPython it was built with and starts it in
 *   lt_init(); the host program needs no Python of its own. Every Python
 *   exception becomes a status and a message: no call exits or aborts the
 *   host process.
 * - All functions may be called from several threads at once, except that
 *   lt_init() must not run while other calls are in flight.
 * - A call reads its params struct (and the lt_tensor views in it) where the
 *   caller keeps it: the struct must not change until the call returns.
 *
 * The hot path: lt_attn_fwd_plan() resolves a kernel once (dispatch, cache,
 * JIT, through Python); lt_plan_launch() then checks a call against the
 * plan and launches it in pure C (no Python, no GIL; no allocation but a scratch-taking kernel's, on the stream,
 * when the call gives no workspace: see version 8 below).
 * lt_attn_fwd() keeps such plans itself, one per shape class, so a warm GPU
 * call of lt_attn_fwd does not enter Python either. The backward has the same
 * three: lt_attn_bwd(), lt_attn_bwd_plan() and lt_bwd_plan_launch(). lt_attn_kvcache() (decoding over a KV
 * cache) and lt_flash_combine() (merging attention over key chunks) keep their plans the same way.
 */
#ifndef LAZYTRITON_H
#define LAZYTRITON_H

#include <stddef.h>
#include <stdint.h>

#define LT_VERSION_MAJOR 0
#define LT_VERSION_MINOR 1
#define LT_VERSION_PATCH 0

/* Versions of the structs below; bumped whenever a struct's layout changes. */
#define LT_CONFIG_VERSION 1
#define LT_ATTN_FWD_PARAMS_VERSION 8 /* 2: packed sequences (cu_seqlens_*); 3: sliding window, softcap; 4: seqused_*; 5: sinks; 6: attention_chunk; 7: FP8 (descales, v_transposed); 8: workspace; older structs are still taken */
#define LT_ATTN_BWD_PARAMS_VERSION 6 /* 2: packed sequences; 3: sliding window, softcap; 4: seqused_*; 5: sinks, dsinks; 6: attention_chunk; older structs are still taken */
#define LT_STATS_VERSION 1
#define LT_FLASH_COMBINE_PARAMS_VERSION 1
#define LT_ATTN_KVCACHE_PARAMS_VERSION 7 /* 2: cache_leftpad; 3: rotary embeddings; 4: sinks, packed queries; 5: attention_chunk; 6: float8 caches' k_descale, v_descale; 7: qv, cu_seqlens_k_new; older structs are still taken */

#if defined(__GNUC__) || defined(__clang__)
#define LT_API __attribute__((visibility("default")))
#else
#define LT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* BEGIN_CDEF: plain declarations, also parsed by cffi (no preprocessor lines inside). */

typedef enum {
    LT_OK = 0,
    LT_ERROR_INVALID_ARGUMENT = 1, /* a value out of range: causal mode, sm_scale, device, setting */
    LT_ERROR_NULL_POINTER = 2,     /* a required pointer is NULL */
    LT_ERROR_VERSION = 3,          /* struct_size or version of a struct is not this library's */
    LT_ERROR_DTYPE = 4,            /* unknown dtype, or dtypes that do not match */
    LT_ERROR_SHAPE = 5,            /* shapes or strides that do not fit together */
    LT_ERROR_HEAD_DIM = 6,         /* head dim outside 1..256 */
    LT_ERROR_NOT_INITIALIZED = 7,  /* lt_init() has not succeeded yet */
    LT_ERROR_NO_GPU = 8,           /* no CUDA driver, or no such device */
    LT_ERROR_UNSUPPORTED = 9,      /* valid, but not supported here (e.g. a plan for host pointers) */
    LT_ERROR_PLAN_MISMATCH = 10,   /* the call is outside the plan's shape class */
    LT_ERROR_KERNEL_NOT_FOUND = 11,/* no cache tier holds the kernel and JIT is off */
    LT_ERROR_COMPILE = 12,         /* the JIT compile failed */
    LT_ERROR_CUDA = 13,            /* a CUDA driver call failed */
    LT_ERROR_PYTHON = 14,          /* the embedded Python failed to start, or raised unexpectedly */
    LT_ERROR_INTERNAL = 15,        /* a bug in lazytriton: please report it with the message */
    LT_MISS = 16,                  /* liblazytriton_native.so: no image holds the kernel, and no JIT fallback */
    LT_ERROR_IMAGE = 17            /* liblazytriton_native.so: an image that cannot be opened, or a damaged entry */
} lt_status;

typedef enum {
    LT_DTYPE_FP16 = 1,
    LT_DTYPE_BF16 = 2,
    LT_DTYPE_FP32 = 3,
    LT_DTYPE_INT32 = 4, /* the index tensors only: cu_seqlens_*, seqused_*, cache_seqlens and the like */
    LT_DTYPE_FP8_E4M3 = 5, /* float8 e4m3 (torch.float8_e4m3fn; variants' dtype e4m3): lt_attn_fwd's q, k, v (FP8
                              forward, sm_90+), lt_attn_kvcache's k_cache and v_cache */
    LT_DTYPE_FP8_E5M2 = 6  /* float8 e5m2 (torch.float8_e5m2; variants' dtype e5m2): lt_attn_fwd's q, k, v (FP8
                              forward, sm_90+), lt_attn_kvcache's k_cache and v_cache */
} lt_dtype;

typedef enum {
    LT_DEVICE_CPU = 1,  /* host memory: runs through Triton's interpreter (slow; for tests) */
    LT_DEVICE_CUDA = 2  /* device memory of CUDA device device_index */
} lt_device_type;

typedef enum {
    LT_CAUSAL_NONE = 0,
    LT_CAUSAL_TOP_LEFT = 1,    /* key j is seen by query i when j <= i (PyTorch SDPA) */
    LT_CAUSAL_BOTTOM_RIGHT = 2 /* j <= i + seqlen_k - seqlen_q (FlashAttention) */
} lt_causal;

typedef enum {
    LT_LOG_DEFAULT = 0, /* LAZYTRITON_LOG_LEVEL, else WARNING */
    LT_LOG_DEBUG = 10,
    LT_LOG_INFO = 20,
    LT_LOG_WARNING = 30,
    LT_LOG_ERROR = 40,
    LT_LOG_CRITICAL = 50
} lt_log_level;

typedef enum {
    LT_JIT_DEFAULT = 0, /* LAZYTRITON_JIT, else on */
    LT_JIT_ON = 1,
    LT_JIT_OFF = 2      /* a kernel no tier holds is LT_ERROR_KERNEL_NOT_FOUND */
} lt_jit;

/* Settings for lt_init(). A NULL string or a *_DEFAULT value keeps what the
 * environment says (the LAZYTRITON_* variable named), else the default. */
typedef struct {
    uint32_t struct_size;    /* sizeof(lt_config) */
    uint32_t version;        /* LT_CONFIG_VERSION */
    const char *cache_dir;   /* LAZYTRITON_CACHE_DIR; default $XDG_CACHE_HOME/lazytriton */
    const char *images;      /* LAZYTRITON_IMAGES: colon-separated image files or folders */
    const char *shared_tier; /* LAZYTRITON_SHARED: redis://host:port/db or file:///path */
    int32_t log_level;       /* lt_log_level */
    int32_t jit;             /* lt_jit */
} lt_config;

/* A view of a tensor the caller owns: nothing is copied or freed. */
typedef struct {
    void *data;           /* first element; host or device pointer as device_type says */
    int32_t dtype;        /* lt_dtype */
    int32_t ndim;         /* 4 for q, k, v, out and the gradients; 3 for lse and delta; 1 for sinks */
    int64_t sizes[4];     /* the first ndim are used */
    int64_t strides[4];   /* in elements, not bytes; non-negative */
    int32_t device_type;  /* lt_device_type */
    int32_t device_index; /* CUDA device ordinal; 0 for the CPU */
} lt_tensor;

/* One attention forward call, the C twin of lazytriton.flash.attn_fwd:
 *   q   (batch, heads_q, seqlen_q, head_dim)   fp16, bf16 or fp32
 *   k   (batch, heads_k, seqlen_k, head_dim)   heads_q a multiple of heads_k (GQA/MQA)
 *   v   (batch, heads_k, seqlen_k, head_dim_v)  k's shape but for the head dim, which may
 *       differ from q's and k's (DeepSeek's MLA: 192 and 128); 1..256
 *   out (batch, heads_q, seqlen_q, head_dim_v) the dtype of q, written
 *   lse (batch, heads_q, seqlen_q) fp32, contiguous, written: the logsumexp
 * q, k, v and out take any strides with a contiguous last dim (stride 1).
 * out and lse must own their memory: sharing an element with q, k, v, the
 * cumulative lengths or each other (or out with itself: a stride of 0) is
 * LT_ERROR_INVALID_ARGUMENT; so for the backward's dq, dk, dv and delta, and
 * the decoding call's out, lse, workspace and (appending) caches.
 *
 * Packed sequences (version 2, the C twin of flash_attn_varlen_func): with
 * cu_seqlens_q.data and cu_seqlens_k.data set, sequence i is rows
 * cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1]
 * of k and v, and the tensors are
 *   q   (total_q, heads_q, head_dim), k (total_k, heads_k, head_dim),
 *   v   (total_k, heads_k, head_dim_v), out (total_q, heads_q, head_dim_v)
 *   lse (heads_q, total_q) fp32, contiguous (FlashAttention-2's varlen layout)
 *   cu_seqlens_q, cu_seqlens_k  LT_DTYPE_INT32, (batch + 1), contiguous, on q's device
 * causal is LT_CAUSAL_NONE or LT_CAUSAL_BOTTOM_RIGHT (within each sequence).
 * The values of cu_seqlens_* are not read on a GPU (they are device memory):
 * as in FlashAttention-2 they must start at 0, not decrease, end at
 * total_q/total_k, and max_seqlen_q/max_seqlen_k must be at least the longest
 * sequence. On the CPU they are checked. Left zero (lt_attn_fwd_params_init),
 * the call is dense; a version 1 struct (its smaller struct_size) is dense.
 *
 * Sliding window and softcap (version 3, FlashAttention-2's rule, as
 * lazytriton.flash_attn_func's window_size and softcap): query i sees key j
 * only when i + offset - window_left <= j <= i + offset + window_right, where
 * offset = seqlen_k - seqlen_q (bottom-right; within each sequence when
 * packed), or 0 with LT_CAUSAL_TOP_LEFT; -1 leaves a side unbounded, and a
 * causal call's right side is 0. With softcap > 0 the scaled scores s become
 * softcap * tanh(s / softcap) before the softmax (Gemma 2). A version 1 or 2
 * struct has neither (window -1, -1; softcap 0).
 *
 * Used lengths (version 4, packed sequences only: FlashAttention-3's seqused_q and seqused_k, as
 * lazytriton.flash_attn_varlen_func's): with seqused_q.data set, LT_DTYPE_INT32, (batch), contiguous, on
 * q's device, sequence i's queries are only the first seqused_q[i] rows of its cu_seqlens_q span; likewise
 * seqused_k for its keys. Causal and window alignment use the used lengths (bottom-right with
 * seqlen_q = seqused_q[i], seqlen_k = seqused_k[i]). The rest of a span is never read; its rows of out
 * are written 0 and of lse -inf (and by lt_attn_bwd, of dq, dk and dv 0). max_seqlen_q/max_seqlen_k stay at
 * least the longest cu_seqlens span, used or not. As cu_seqlens, their values (0 <= seqused <= the span's
 * length) are checked on the CPU and not read on a GPU. Left zero (absent), or in a version 1 to 3 struct,
 * every row of each span is used.
 *
 * Attention sinks (version 5, gpt-oss's; as lazytriton.flash_attn_func's sinks): sinks, LT_DTYPE_FP32,
 * (heads_q), contiguous, on q's device: one logit a query head that joins the denominator of every softmax
 * row of that head (a key that no value carries), so lse = log(sum of exp(scores) + exp(sink)). A row that
 * sees no key gets out 0 and lse its head's sink. Dense or packed, with any other option. Left zero (absent),
 * or in a version 1 to 4 struct, there are none.
 *
 * Chunked local attention (version 6, FlashAttention-3's attention_chunk, Llama 4's; as
 * lazytriton.flash_attn_func's): with attention_chunk > 0, query i sees key j only when
 * floor(j / attention_chunk) == floor((i + offset) / attention_chunk), offset as the window's (bottom-right,
 * within each packed sequence; 0 with LT_CAUSAL_TOP_LEFT), on top of causal and the window. Seqlens must then be
 * below 2**29. 0 (the init), or a version 1 to 5 struct: off.
 *
 * FP8 (version 7, FlashAttention-3's FP8 forward; as lazytriton.flash_attn_func with float8_e4m3fn inputs):
 * q, k and v LT_DTYPE_FP8_E4M3, or all three LT_DTYPE_FP8_E5M2 (the probabilities rounded to e4m3 either way),
 * out LT_DTYPE_BF16, lse fp32; served on sm_90 and later only (a plan for an older
 * device is LT_ERROR_INVALID_ARGUMENT naming q.dtype). The kernel reads V from its transpose, so the caller gives
 * it transposed and says so: v_transposed = 1 and v (batch, heads_k, head_dim_v, seqlen_k) with the keys
 * contiguous (packed: (heads_k, head_dim_v, total_k)); rows of a multiple of 16 keys (padding past seqlen_k, never
 * read) keep the 16-byte-aligned variant. The C library writes no copy of v: the engine that quantises V to e4m3
 * writes it in that layout (FlashAttention-3's V_colmajor), so no transpose kernel and no workspace is needed.
 * q_descale, k_descale, v_descale: optional LT_DTYPE_FP32 tensors on q's device, (batch, heads_k) (packed: batch
 * = the sequences) or one element ((1)): the scores are (q . k) * q_descale * k_descale * sm_scale and out is
 * multiplied by v_descale. An absent descale is 1.0 (the kernel reads nothing for it: no device memory is
 * needed). The FP8 forward has no ALiBi, sinks or backward (lt_attn_bwd refuses float8 tensors); window,
 * softcap, attention_chunk and packed sequences are taken. A version 1 to 6 struct has no FP8: v_transposed 0 and
 * no descales, and a float8 q is refused.
 *
 * Workspace (version 8): some kernels take scratch memory on the device (Triton's global scratch: the FP8 forward's
 * Gluon kernel on sm_90 and flash_fwd's TMA variant make their TMA descriptors there), a few hundred bytes a
 * program. workspace, optional LT_DTYPE_FP32, 1-dim, contiguous, on q's device, gives it: the launch takes it from
 * the front of the workspace (lt_attn_fwd_workspace_size, lt_plan_workspace_size: the bytes a call needs; 0 for a
 * kernel that takes none), and a workspace too small for the call is LT_ERROR_INVALID_ARGUMENT before anything is
 * launched. Absent (data NULL, ndim 0: the init, or a version 1 to 7 struct), such a kernel's scratch is allocated
 * on the stream (cuMemAllocAsync) before its launch and freed on it (cuMemFreeAsync) after, which a CUDA graph
 * captures as well; a driver without them is LT_ERROR_UNSUPPORTED, naming the workspace. The caller keeps the
 * workspace until the launch has run, and one workspace serves one call at a time. */
typedef struct {
    uint32_t struct_size; /* sizeof(lt_attn_fwd_params) */
    uint32_t version;     /* LT_ATTN_FWD_PARAMS_VERSION */
    lt_tensor q;
    lt_tensor k;
    lt_tensor v;
    lt_tensor out;
    lt_tensor lse;
    int32_t causal;       /* lt_causal */
    uint32_t flags;       /* reserved: must be 0 */
    double sm_scale;      /* softmax scale; NaN: 1/sqrt(head_dim) (lt_attn_fwd_params_init sets NaN) */
    /* Version 2: packed sequences (see above); zero for a dense call. */
    lt_tensor cu_seqlens_q; /* int32 (batch + 1): cumulative query lengths */
    lt_tensor cu_seqlens_k; /* int32 (batch + 1): cumulative key lengths */
    int64_t max_seqlen_q;   /* >= the longest query sequence, >= 1 */
    int64_t max_seqlen_k;   /* >= the longest key sequence, >= 1 */
    /* Version 3: sliding window and softcap (see above); lt_attn_fwd_params_init sets -1, -1 and 0: off. */
    int64_t window_left;  /* -1 (unbounded) or >= 0 */
    int64_t window_right; /* -1 (unbounded) or >= 0; ignored (0) in a causal call */
    double softcap;       /* 0: off; else > 0, finite as a float */
    /* Version 4: used lengths of packed sequences (see above); absent (data NULL, ndim 0) when zero. */
    lt_tensor seqused_q;  /* int32 (batch): the used queries of each cu_seqlens_q span */
    lt_tensor seqused_k;  /* int32 (batch): the used keys of each cu_seqlens_k span */
    /* Version 5: attention sinks (see above); absent (data NULL, ndim 0) when zero. */
    lt_tensor sinks;      /* fp32 (heads_q): one logit a query head */
    /* Version 6: chunked local attention (see above). */
    int64_t attention_chunk; /* 0 (the init): off; else the chunk's keys, >= 1 */
    /* Version 7: FP8 (see above); absent descales (data NULL, ndim 0) are 1.0. */
    lt_tensor q_descale;  /* fp32 (batch, heads_k) or (1) */
    lt_tensor k_descale;  /* fp32 (batch, heads_k) or (1) */
    lt_tensor v_descale;  /* fp32 (batch, heads_k) or (1) */
    int32_t v_transposed; /* 1: v is (batch, heads_k, head_dim_v, seqlen_k), keys contiguous (FP8 calls: required);
                             0 (the init): v is (batch, heads_k, seqlen_k, head_dim_v) */
    uint32_t reserved7;   /* must be 0 */
    /* Version 8: the kernels' scratch memory (see above); absent (data NULL, ndim 0): allocated on the stream. */
    lt_tensor workspace;  /* fp32 (elements): at least lt_attn_fwd_workspace_size bytes */
} lt_attn_fwd_params;

/* One attention backward call, the gradients of lt_attn_fwd's out:
 *   q, k, v  as lt_attn_fwd's (the same tensors the forward took)
 *   out, lse the forward's outputs, as it wrote them
 *   dout     the gradient of out: out's shape and dtype
 *   dq       q's shape and dtype, written
 *   dk       k's shape and dtype, written (GQA/MQA: summed over each group of query heads)
 *   dv       v's shape and dtype, written (likewise summed)
 *   delta    (batch, heads_q, seqlen_q) fp32, contiguous: workspace the caller
 *            provides, so that no call allocates; afterwards, on a GPU, it holds
 *            rowsum(dout * out) (see attention sinks below); on the CPU it is not touched
 * causal and sm_scale must be the forward's. Any strides with a contiguous
 * last dim for the 4-dim tensors. Rows that saw no key get zero gradients,
 * and so do keys that no query saw.
 * Packed sequences (version 2): the forward's cu_seqlens_*, max_seqlen_*
 * and layouts; dout like out, dq like q, dk like k, dv like v, delta (heads_q, total_q).
 * Sliding window and softcap (version 3): the forward's, which they must be.
 * Used lengths (version 4): the forward's seqused_q/seqused_k; dq rows past seqused_q and dk, dv rows past
 * seqused_k are written 0.
 * Attention sinks (version 5): the forward's sinks (they reach dq, dk and dv through its lse), and
 * optionally dsinks, fp32 (heads_q), contiguous, on q's device, written: the sinks' gradient,
 *   dsinks[h] = -sum over the batch and the rows of head h of exp(sinks[h] - lse) * delta,
 * with delta = rowsum(dout * out) (rows past seqused_q add nothing). On a GPU a third kernel
 * (flash_bwd_dsinks, one program a query head, rows summed in a fixed order: the same bits every run) reduces it
 * after the two backward kernels, on the same stream; on the CPU it is written too.
 * Chunked local attention (version 6): the forward's attention_chunk, which it must be. */
typedef struct {
    uint32_t struct_size; /* sizeof(lt_attn_bwd_params) */
    uint32_t version;     /* LT_ATTN_BWD_PARAMS_VERSION */
    lt_tensor q;
    lt_tensor k;
    lt_tensor v;
    lt_tensor out;
    lt_tensor lse;
    lt_tensor dout;
    lt_tensor dq;
    lt_tensor dk;
    lt_tensor dv;
    lt_tensor delta;
    int32_t causal;       /* lt_causal */
    uint32_t flags;       /* reserved: must be 0 */
    double sm_scale;      /* softmax scale; NaN: 1/sqrt(head_dim) (lt_attn_bwd_params_init sets NaN) */
    /* Version 2: packed sequences, as lt_attn_fwd_params; zero for a dense call. */
    lt_tensor cu_seqlens_q;
    lt_tensor cu_seqlens_k;
    int64_t max_seqlen_q;
    int64_t max_seqlen_k;
    /* Version 3: the forward's window and softcap (lt_attn_bwd_params_init: -1, -1 and 0: off). */
    int64_t window_left;
    int64_t window_right;
    double softcap;
    /* Version 4: the forward's used lengths (absent when zero). */
    lt_tensor seqused_q;
    lt_tensor seqused_k;
    /* Version 5: the forward's attention sinks and their gradient (each absent when zero). */
    lt_tensor sinks;      /* fp32 (heads_q), read */
    lt_tensor dsinks;     /* fp32 (heads_q), written */
    /* Version 6: the forward's attention_chunk (0, the init: off). */
    int64_t attention_chunk;
} lt_attn_bwd_params;

/* One decoding call, the C twin of lazytriton.flash_attn_with_kvcache (FlashAttention-2's, forward only).
 * The layout is FlashAttention-2's kvcache one, (batch, seqlen, heads, head_dim), not lt_attn_fwd's:
 *   q        (batch, seqlen_q, heads_q, head_dim)              fp16, bf16 or fp32
 *   k_cache  (batch_cache, seqlen_cache, heads_k, head_dim), or with block_table a paged cache
 *            (num_blocks, page_size, heads_k, head_dim), page_size >= 1 (any size); q's dtype
 *   v_cache  like k_cache, with a head dim of its own allowed (head_dim_v, up to 512, as DeepSeek's MLA)
 *   k, v     optional (batch, seqlen_new, heads_k, head_dim) and (..., head_dim_v): new keys and values,
 *            written into the caches in place at each sequence's cache length before attending (on a GPU
 *            by the kv_append kernel, on the caller's stream before the decoding kernels)
 *   cache_seqlens    optional int32 (batch): each sequence's cached length before the new keys; without
 *                    it, cache_seqlen (-1: the whole cache) holds for every sequence
 *   cache_batch_idx  optional int32 (batch): the cache row of each sequence, or with block_table its
 *                    row of the table (FlashAttention-3's)
 *   block_table      optional int32 (batch, max_blocks_per_seq), or (table_rows, max_blocks_per_seq)
 *                    with cache_batch_idx: a paged cache
 *   alibi_slopes     optional fp32 (heads_q) or (batch, heads_q)
 *   cache_leftpad    optional int32 (batch) (version 2): where each sequence's keys start in the cache
 *                    (FlashAttention's cache_leftpad); sequence b sees positions cache_leftpad[b] ..
 *                    its length - 1, positions stay absolute (new keys still land at its cached length), and
 *                    0 <= cache_leftpad[b] <= its cached length. Keys before it are never read (whatever
 *                    its value: one out of range reads nothing outside the keys)
 *   rotary_cos       optional (seqlen_ro, rotary_dim / 2), q's dtype, contiguous (version 3): FlashAttention's
 *                    rotary embedding, applied inside the kernels: new key j of sequence b is rotated at
 *                    position base_b + j on its way into the cache, query i at base_b + i when causal or a
 *                    window side is bounded within the cache, else at base_b; base_b is cache_seqlens[b]
 *                    (rotary_seqlens[b] with that tensor). Its first rotary_dim columns (any even width up to
 *                    head_dim) are rotated. Needs k, v and rotary_sin
 *   rotary_sin       optional, rotary_cos's shape, dtype and device (version 3): the sines
 *   rotary_seqlens   optional int32 (batch) (version 3): each sequence's first rotary position (FlashAttention-3's)
 *   rotary_interleaved  1 (the init): rotate pairs (0, 1), (2, 3)...; 0: column j with j + rotary_dim / 2
 *   out      (batch, seqlen_q, heads_q, head_dim_v), q's dtype, written
 *   lse      fp32 (batch, heads_q, seqlen_q), contiguous, written: the logsumexp
 *   workspace optional fp32, 1-dim, contiguous: the float32 partials of several splits on a GPU
 *            (lt_attn_kvcache_workspace_size); without one, a GPU call runs one split
 * An optional tensor is absent when its data is NULL and its ndim 0 (lt_attn_kvcache_params_init).
 * Every tensor but the index ones takes any strides with a contiguous last dim; the index tensors, lse and
 * workspace are contiguous. On a GPU the values of cache_seqlens, cache_batch_idx, block_table,
 * cache_leftpad and rotary_seqlens are not read (device memory; as in FlashAttention-2 they must point inside
 * the cache, and rotary positions inside rotary_cos: one outside is left unrotated); on the CPU they are checked.
 * causal is bottom-right (FlashAttention-2's); window_left/window_right -1 leave a side unbounded.
 *   sinks            optional fp32 (heads_q), contiguous (version 4): attention sinks, one logit a query head that
 *                    joins every softmax row's denominator (as lt_attn_fwd's); a row that sees no key gets out 0
 *                    and lse its head's sink
 *   cu_seqlens_q     optional int32 (batch + 1), contiguous (version 4): queries packed as FlashAttention-3's
 *                    flash_attn_with_kvcache takes them: sequence b's queries are rows cu_seqlens_q[b] ..
 *                    cu_seqlens_q[b + 1] - 1, each aligned bottom-right against its own keys, and then
 *                      q   (total_q, heads_q, head_dim), out (total_q, heads_q, head_dim_v)
 *                      lse fp32 (heads_q, total_q), contiguous
 *                    batch is cu_seqlens_q's entries - 1 (the caches, k, v and the index tensors keep it), and
 *                    max_seqlen_q (0..2**31 - 1, at least the longest sequence's query count) sizes the grid. As
 *                    the other index tensors, its values are checked on the CPU and not read on a GPU (they must
 *                    start at 0, not decrease, and end at total_q). Without cu_seqlens_q, max_seqlen_q must be -1
 *                    (the init). The workspace then holds 4 * heads_q * total_q * (head_dim_v + 1) bytes a split.
 *   attention_chunk  (version 5) FlashAttention-3's chunked local attention: with attention_chunk > 0, query i of a
 *                    sequence sees cache position j only when floor(j / attention_chunk) ==
 *                    floor((i + offset) / attention_chunk), offset bottom-right (its keys - its queries), on top of
 *                    causal and the window; the cache's length plus seqlen_q must be below 2**29. 0: off
 *   k_descale, v_descale  optional fp32 (version 6), with a float8 cache (k_cache and v_cache both LT_DTYPE_FP8_E4M3 or
 *                    both LT_DTYPE_FP8_E5M2; q fp16 or bf16; new k and v in q's dtype): the cache holds k / k_descale
 *                    and v / v_descale (FlashAttention-3's convention; absent: 1.0). Shape (1) per tensor, (heads_k)
 *                    per key/value head or (batch, heads_k) per sequence and head, any strides, on q's device. New keys
 *                    are quantised on their way in (x / descale, saturated, rounded to nearest even); the split kernel
 *                    dequantises as it reads. e4m3 caches need sm_89 or later; e5m2 any CUDA target
 *   qv               optional (version 7), FlashAttention-3's (DeepSeek's MLA with the absorbed projections): (batch,
 *                    seqlen_q, heads_q, head_dim_v) ((total_q, heads_q, head_dim_v) with cu_seqlens_q), q's dtype and
 *                    device; the scores become (q . k + qv . v) x sm_scale, whose default (NaN) is then
 *                    1/sqrt(head_dim + head_dim_v). The split kernel reads each query row as [qv | q], so qv and q
 *                    are the two parts of one row: q.data is qv.data + head_dim_v elements and their strides are
 *                    equal (DeepSeek's q = [q_nope absorbed | q_pe], qv = row[..., :head_dim_v], q = row[...,
 *                    head_dim_v:]); no copy. head_dim_v up to 512; not with a float8 cache
 *   cu_seqlens_k_new optional int32 (batch + 1), contiguous (version 7), FlashAttention-3's: the new keys packed, k
 *                    (total_new, heads_k, head_dim) and v (total_new, heads_k, head_dim_v); sequence b's are rows
 *                    cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1] - 1, written at its cached length, and it then
 *                    attends over its cached length plus its own count. Host memory only: on a GPU the call is
 *                    LT_ERROR_UNSUPPORTED (the C launch has no device-side sum of the lengths after the append)
 * A version 1 to 6 struct (its smaller struct_size and its version) is the same call without what later versions
 * add (a version 1 to 5 struct's caches are q's dtype). */
typedef struct {
    uint32_t struct_size; /* sizeof(lt_attn_kvcache_params) */
    uint32_t version;     /* LT_ATTN_KVCACHE_PARAMS_VERSION */
    lt_tensor q;
    lt_tensor k_cache;
    lt_tensor v_cache;
    lt_tensor k;
    lt_tensor v;
    lt_tensor cache_seqlens;
    lt_tensor cache_batch_idx;
    lt_tensor block_table;
    lt_tensor alibi_slopes;
    lt_tensor out;
    lt_tensor lse;
    lt_tensor workspace;
    int64_t cache_seqlen;  /* without cache_seqlens: every sequence's cached length; -1 (the init): the whole cache */
    int32_t causal;        /* 0 or 1 */
    int32_t window_left;   /* -1 (the init): unbounded */
    int32_t window_right;  /* -1 (the init): unbounded */
    int32_t num_splits;    /* 0: a heuristic picks (FlashAttention-2's); 1..256 forces it */
    uint32_t flags;        /* reserved: must be 0 */
    uint32_t reserved;     /* must be 0 */
    double sm_scale;       /* softmax scale; NaN (the init): 1/sqrt(head_dim) */
    double softcap;        /* > 0: scores become softcap * tanh(score / softcap); 0 (the init): off */
    /* Version 2: a left-padded cache (absent, the init: each sequence's keys start at position 0). */
    lt_tensor cache_leftpad;
    /* Version 3: rotary embeddings (rotary_cos and rotary_sin absent, the init: none). */
    lt_tensor rotary_cos;
    lt_tensor rotary_sin;
    lt_tensor rotary_seqlens;
    int32_t rotary_interleaved; /* 1 (the init) or 0 */
    uint32_t reserved3;         /* must be 0 */
    /* Version 4: attention sinks and packed queries (each absent, the init: none; max_seqlen_q -1). */
    lt_tensor sinks;
    lt_tensor cu_seqlens_q;
    int64_t max_seqlen_q;
    /* Version 5: chunked local attention (0, the init: off), as lt_attn_fwd's. */
    int64_t attention_chunk;
    /* Version 6: a float8 cache's descales (each absent, the init: 1.0). */
    lt_tensor k_descale;
    lt_tensor v_descale;
    /* Version 7: MLA's qv and packed new keys (each absent, the init: none). */
    lt_tensor qv;
    lt_tensor cu_seqlens_k_new;
} lt_attn_kvcache_params;

/* One merge of attention computed over disjoint chunks of the keys, the C twin of
 * lazytriton.flash_attn_combine (FlashAttention-3's flash_attn_combine): each split n holds the attention of the
 * same query rows over its own chunk (split-KV decoding, or one rank of context parallelism), its output and the
 * natural-log logsumexp of its scaled scores; the call writes attention over all the chunks:
 *   lse = log(sum_n exp(lse_partial[n])), out = sum_n exp(lse_partial[n] - lse) * out_partial[n].
 * A split whose lse is -inf saw no key and counts for nothing (its output is not read); a row whose every split
 * is -inf gets out 0 and lse -inf. The rows are FlashAttention-3's packed layout (total_q); its dense
 * (num_splits, batch, seqlen, heads, head_dim) is rows = batch * seqlen where seqlen's stride times seqlen is
 * batch's (a contiguous tensor: describe it as (num_splits, batch * seqlen, heads, head_dim)):
 *   out_partial  fp32 (num_splits, rows, heads, head_dim), any strides with a contiguous last dim; head_dim >= 1
 *   lse_partial  fp32 (num_splits, rows, heads), any strides
 *   out          (rows, heads, head_dim), fp32, fp16 or bf16 (the output's dtype: FlashAttention-3's out_dtype),
 *                any strides with a contiguous last dim, written
 *   lse          fp32 (rows, heads), any strides, written
 * All on one device; any number of splits (0: out 0, lse -inf). */
typedef struct {
    uint32_t struct_size; /* sizeof(lt_flash_combine_params) */
    uint32_t version;     /* LT_FLASH_COMBINE_PARAMS_VERSION */
    lt_tensor out_partial;
    lt_tensor lse_partial;
    lt_tensor out;
    lt_tensor lse;
    uint32_t flags;       /* reserved: must be 0 */
    uint32_t reserved;    /* must be 0 */
} lt_flash_combine_params;

/* What the cache holds and what this process did (lt_cache_stats()). */
typedef struct {
    uint32_t struct_size;      /* set by the caller: sizeof(lt_stats) */
    uint32_t version;          /* set by the caller: LT_STATS_VERSION */
    uint64_t local_entries;    /* entries in the local cache dir */
    uint64_t local_bytes;      /* their bytes on disk */
    uint64_t image_entries;    /* entries in the read-only images found */
    uint64_t compiles;         /* JIT compiles recorded in the local cache (all processes, ever) */
    uint64_t hits;             /* tier hits recorded there (all processes, ever) */
    uint64_t process_compiles; /* JIT compiles by this process */
    uint64_t process_resolved; /* kernels this process resolved (from memory, a tier or JIT) */
    uint64_t loaded_kernels;   /* kernels this process loaded on its GPUs */
    uint64_t plans;            /* plans lt_attn_fwd and lt_attn_bwd keep (one per shape class) */
} lt_stats;

/* A resolved kernel for one shape class; made by lt_attn_fwd_plan(). */
typedef struct lt_plan lt_plan;

/* The backward's two resolved kernels for one shape class; made by lt_attn_bwd_plan(). */
typedef struct lt_bwd_plan lt_bwd_plan;

/* END_CDEF */

/* The library's version (the LT_VERSION_* macros it was built with). */
LT_API lt_status lt_version(int *major, int *minor, int *patch);

/* The calling thread's last error message ("" if none); never NULL. */
LT_API const char *lt_last_error(void);

/* Fill *config with this header's struct_size and version and all defaults. */
LT_API lt_status lt_config_init(lt_config *config);

/* Start the embedded Python and apply settings; NULL means the defaults.
 * Must succeed before the calls below; may be called again to change settings
 * (not while other calls are in flight). */
LT_API lt_status lt_init(const lt_config *config);

/* Fill *params with struct_size and version, sm_scale NaN (the default scale),
 * causal none, no window (-1, -1), softcap 0 and empty tensors. */
LT_API lt_status lt_attn_fwd_params_init(lt_attn_fwd_params *params);

/* Describe a contiguous (row-major) tensor of ndim (1..4) dims. */
LT_API lt_status lt_tensor_init(lt_tensor *tensor, void *data, lt_dtype dtype, int32_t ndim, const int64_t *sizes,
                                lt_device_type device_type, int32_t device_index);

/* Attention forward. CUDA tensors: enqueued on stream (a CUstream; NULL is the
 * legacy default stream), returns without waiting. CPU tensors: computed
 * before returning, through Triton's interpreter (stream is ignored). */
LT_API lt_status lt_attn_fwd(const lt_attn_fwd_params *params, void *stream);

/* Resolve the kernel for params' shape class once (through Python: dispatch,
 * cache, JIT) and capture what a launch needs in *plan. The shape class:
 * device, dtype, head dim, causal or not, 16-byte alignment of pointers and
 * strides, and 32- or 64-bit indexing; batch, heads and seqlens may change
 * from call to call (the tile sizes were chosen for params' seqlens).
 * Plans need a GPU: CPU tensors give LT_ERROR_UNSUPPORTED. */
LT_API lt_status lt_attn_fwd_plan(const lt_attn_fwd_params *params, lt_plan **plan);

/* Check params against plan's shape class and launch on stream, in pure C. */
LT_API lt_status lt_plan_launch(const lt_plan *plan, const lt_attn_fwd_params *params, void *stream);

/* Free a plan; NULL is accepted. */
LT_API lt_status lt_plan_destroy(lt_plan *plan);

/* The bytes of workspace a GPU call of params needs through plan (its kernel's scratch memory for the call's grid,
 * aligned from any 4-byte-aligned start): 0 when the kernel takes none. */
LT_API lt_status lt_plan_workspace_size(const lt_plan *plan, const lt_attn_fwd_params *params, size_t *bytes);

/* The bytes of workspace lt_attn_fwd needs for a GPU call of params (as lt_plan_workspace_size, through the plan
 * lt_attn_fwd keeps for its shape class: made now, through Python, if it has none yet). */
LT_API lt_status lt_attn_fwd_workspace_size(const lt_attn_fwd_params *params, size_t *bytes);

/* Fill *params with struct_size and version, sm_scale NaN (the default scale),
 * causal none, no window (-1, -1), softcap 0 and empty tensors. */
LT_API lt_status lt_attn_bwd_params_init(lt_attn_bwd_params *params);

/* Attention backward: dq, dk and dv from q, k, v, out, lse and dout. Two
 * kernels, one after the other on stream: dq (which also writes delta), then
 * dk and dv. No float atomics: the gradients are bitwise identical from run to
 * run. CUDA tensors: enqueued on stream, returns without waiting; a call with
 * gradients to zero but no work (seqlen_q or seqlen_k 0) is LT_ERROR_UNSUPPORTED
 * there. CPU tensors: computed before returning, through Triton's interpreter
 * (stream is ignored; delta is not touched). */
LT_API lt_status lt_attn_bwd(const lt_attn_bwd_params *params, void *stream);

/* Resolve the backward's two kernels for params' shape class once (as
 * lt_attn_fwd_plan: the same shape class, alignment and indexing over all ten
 * tensors). Plans need a GPU: CPU tensors give LT_ERROR_UNSUPPORTED. */
LT_API lt_status lt_attn_bwd_plan(const lt_attn_bwd_params *params, lt_bwd_plan **plan);

/* Check params against plan's shape class and launch both kernels on stream, in pure C. */
LT_API lt_status lt_bwd_plan_launch(const lt_bwd_plan *plan, const lt_attn_bwd_params *params, void *stream);

/* Free a backward plan; NULL is accepted. */
LT_API lt_status lt_bwd_plan_destroy(lt_bwd_plan *plan);

/* Fill *params with struct_size and version, sm_scale NaN, cache_seqlen -1, window (-1, -1), no split count,
 * max_seqlen_q -1, and empty (absent) tensors. */
LT_API lt_status lt_attn_kvcache_params_init(lt_attn_kvcache_params *params);

/* Decoding attention over a KV cache (flash_attn_with_kvcache): the split kernel and, when the keys are cut in
 * several splits, the combine kernel, one after the other on stream; with new k/v, the kv_append kernel
 * writes them into the caches first, on the same stream. CUDA tensors: all launched from C (the plans, one
 * per shape class, go through Python once), returns without waiting. CPU tensors: computed before returning,
 * through Triton's interpreter, the new keys written into the caches first. */
LT_API lt_status lt_attn_kvcache(const lt_attn_kvcache_params *params, void *stream);

/* The bytes of workspace a GPU call of params needs to run its split count (the forced num_splits, else the
 * most the heuristic picks): 4 * batch * heads_q * seqlen_q * (head_dim_v + 1) * splits (with packed queries,
 * total_q for batch * seqlen_q). A smaller workspace
 * caps the splits at what fits (none: one split). */
LT_API lt_status lt_attn_kvcache_workspace_size(const lt_attn_kvcache_params *params, size_t *bytes);

/* Fill *params with struct_size and version and empty tensors. */
LT_API lt_status lt_flash_combine_params_init(lt_flash_combine_params *params);

/* Merge split attention (flash_attn_combine): one kernel, flash_combine. CUDA tensors: launched from C on stream
 * (the plan, one per shape class, goes through Python once), returns without waiting. CPU tensors: computed
 * before returning, through Triton's interpreter. */
LT_API lt_status lt_flash_combine(const lt_flash_combine_params *params, void *stream);

/* Compile kernels into the cache ahead of use. Each spec is either a variant
 * string (as `lazytriton cache` and the miss log print them) or axes, such as
 * "target=sm_90 dtype=bf16 head_dim=128 causal=1 seqlen_q=4096" (also
 * seqlen_k, aligned=1, index64=0, varlen=0, head_dim_v (default head_dim), window=0, softcap=0, sinks=0,
 * attention_chunk=0, and with varlen=1 seqused_q=0 and seqused_k=0; dtype=e4m3|e5m2: the FP8 forward; kernel=flash_bwd
 * for the backward's two kernels, as lt_attn_bwd would choose them, and with sinks=1 the sinks' gradient kernel its
 * dsinks launches; kernel=flash_decode for lt_attn_kvcache's kernels: seqlen_q the query rows a key/value head,
 * seqlen_k the cache's capacity, new_keys=1 with kv_append, kv_dtype=e4m3|e5m2 for a float8 cache and with it
 * kv_pairs, the calls' batch x heads_k, default 1, which its split tiles follow).
 * All specs are parsed before anything is compiled. *compiled and *cached (either may be NULL) count the kernels
 * compiled now and those already in a cache tier. */
LT_API lt_status lt_prewarm(const char *const *specs, size_t n_specs, size_t *compiled, size_t *cached);

/* Fill *stats (whose struct_size and version the caller sets). */
LT_API lt_status lt_cache_stats(lt_stats *stats);

#ifdef __cplusplus
}
#endif

#endif /* LAZYTRITON_H */
