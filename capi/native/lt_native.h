/*
 * lt_native.h: the native core's internal interface (no Python): statuses,
 * errors, the bounded msgpack reader, entries and images.
 *
 * Every byte read from an image is untrusted: sizes are bounded before they
 * are allocated, offsets checked before they are read, and any byte sequence
 * gives a status and a message, never a crash. The formats are those of
 * cache_format/SPEC.md; the checks are the Python readers' (cache_format/
 * entry.py, image.py, tensordesc.py), so that an image or entry the Python
 * side refuses the C side refuses too, and the other way round
 * (tests/test_native_image.py holds both to it).
 */
#ifndef LT_NATIVE_H
#define LT_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "lt_xxh3.h" /* ltn_xxh3_64: every checksum of an entry or image */

typedef enum {
    LTN_OK = 0,
    LTN_ABSENT = 1,   /* the image does not hold the key */
    LTN_DAMAGED = 2,  /* bytes that are not a valid image or entry (Python: ImageError, EntryError) */
    LTN_IO = 3,       /* the file cannot be opened or read (Python: OSError) */
    LTN_NOMEM = 4,    /* an allocation within the format's bounds failed */
    LTN_ARGUMENT = 5  /* a key that is not 32 lowercase hex digits, a NULL (Python: ValueError) */
} ltn_status;

#define LTN_ERROR_SIZE 640
typedef struct {
    char message[LTN_ERROR_SIZE];
} ltn_error;

/* Writes the message (printf format) into err (may be NULL) and returns status. */
int ltn_fail(ltn_error *err, int status, const char *format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ---- msgpack, bounded (the limits msgpack-python's unpackb takes) ------- */

typedef struct {
    uint32_t max_str, max_bin, max_array, max_map, max_ext;
} ltn_mp_bounds;

typedef enum {
    LTN_MP_NIL, LTN_MP_BOOL, LTN_MP_UINT, LTN_MP_NEGATIVE, LTN_MP_FLOAT,
    LTN_MP_STR, LTN_MP_BIN, LTN_MP_ARRAY, LTN_MP_MAP, LTN_MP_EXT
} ltn_mp_type;

typedef struct {
    ltn_mp_type type;
    uint64_t u;         /* BOOL 0/1; UINT the value; NEGATIVE the int64's bits; STR/BIN/EXT bytes; ARRAY/MAP items */
    double f;           /* FLOAT */
    const uint8_t *ptr; /* STR/BIN/EXT: the bytes */
} ltn_mp_value;

typedef struct {
    const uint8_t *p, *end;
    const ltn_mp_bounds *bounds;
    const char *error; /* why the last call failed */
} ltn_mp_reader;

/* The next value's head (a container's item count, not its items): 0, or -1 with r->error. A str is
   checked to be UTF-8 (strict, as Python decodes it); every length against the bounds. */
int ltn_mp_head(ltn_mp_reader *r, ltn_mp_value *v);
/* Checks and skips one whole value, containers nested at most 1024 deep (msgpack-python's stack); map keys
   must be str or bin (strict_map_key). 0, or -1 with r->error. */
int ltn_mp_skip(ltn_mp_reader *r);
/* Whether data holds exactly one valid value within bounds (msgpack-python's unpackb succeeds): 0 or -1. */
int ltn_mp_check(const uint8_t *data, size_t size, const ltn_mp_bounds *bounds, ltn_mp_type *top, const char **why);

/* ---- entries (SPEC.md "Entry") ----------------------------------------- */

#define LTN_ENTRY_HEADER 24
#define LTN_MAX_ENTRY_BYTES (64u << 20)
#define LTN_MAX_RANK 5

typedef struct {
    const char *s; /* NUL-terminated copy (the string may hold NUL itself: len is its length) */
    uint32_t len;
} ltn_str;

typedef struct {
    uint32_t swizzle, elem_size, elem_type, rank;
    uint32_t block_size[LTN_MAX_RANK];
} ltn_tensordesc;

typedef struct {
    uint32_t format_version; /* 1, or 2 with host descriptors */
    ltn_str key, variant, target, kind, name;
    const uint8_t *binary;
    size_t binary_size;
    uint32_t num_warps, num_ctas, warp_size, shared;
    uint32_t global_scratch_size, global_scratch_align, profile_scratch_size, profile_scratch_align;
    uint32_t n_arg_types, n_hidden_args, n_tensordesc;
    const ltn_str *arg_types, *hidden_args;
    const ltn_tensordesc *tensordesc;
    ltn_str compiler, compiler_version, source_fingerprint;
    double created;
    uint32_t launch_abi;
    void *owned_data_; /* the entry's bytes (binary points into them) */
    void *arena_;      /* the strings and arrays */
} ltn_entry;

/* Decodes an entry's bytes, taking ownership of data (malloc'd; freed here on failure). expected_key (32
   characters, or NULL) must be the key it holds. On LTN_OK, free with ltn_entry_free. */
int ltn_entry_decode_owned(uint8_t *data, size_t size, const char *expected_key, ltn_entry *out, ltn_error *err);
/* The same on a copy of data. */
int ltn_entry_decode(const uint8_t *data, size_t size, const char *expected_key, ltn_entry *out, ltn_error *err);
void ltn_entry_free(ltn_entry *entry);

/* Whether arg_types and the descriptors agree (tensordesc.check): 0, or -1 with a message in err. */
int ltn_tensordesc_check(const ltn_str *arg_types, uint32_t n_arg_types, const ltn_tensordesc *metas,
                         uint32_t n_metas, ltn_error *err);

/* ---- a loaded kernel's parameters (lt_launch.c): what the launcher passes, from an entry alone ---------- */

#define LTN_MAX_DESCS 16   /* host descriptors a kernel takes (fastlaunch.MAX_DESCS) */
#define LTN_MAX_PARAMS 512 /* parameters a kernel takes, descriptors expanded and hidden ones included */
enum { LTN_GLOBAL_SCRATCH = 0, LTN_PROFILE_SCRATCH = 1 };

typedef struct {
    uint32_t swizzle, elem_size, host_dtype, rank; /* host_dtype: CUtensorMapDataType */
    uint32_t box[LTN_MAX_RANK];                    /* innermost first */
} ltn_desc_layout;

typedef struct {
    uint32_t n_args;   /* the kernel's own parameters: the caller's args */
    uint32_t n_params; /* what the kernel takes: a descriptor 1 + 2 rank, then the hidden ones */
    uint32_t n_descs, n_hidden, num_ctas;
    uint8_t desc_of[256];              /* per arg: 0 a value, d + 1 host descriptor d */
    ltn_desc_layout descs[LTN_MAX_DESCS];
    uint32_t hidden[2];                /* each hidden parameter's scratch: LTN_GLOBAL_SCRATCH or _PROFILE_ */
    uint32_t scratch_size[2], scratch_align[2]; /* by scratch: bytes a program (0: NULL), alignment (power of 2) */
} ltn_layout;

/* The arguments of one cuTensorMapEncodeTiled call, innermost first. */
typedef struct {
    int dtype, interleave, swizzle, l2, oob;
    uint32_t rank;
    void *base;
    uint64_t dims[LTN_MAX_RANK], strides[LTN_MAX_RANK]; /* strides in bytes: rank - 1 of them */
    uint32_t box[LTN_MAX_RANK], element_strides[LTN_MAX_RANK];
} ltn_encode_call;

/* How the entry's kernel is launched (fastlaunch.layout's rule): 0, or -1 with a message for an entry the
   launcher cannot lay out (a parameter type it does not pass, too many descriptors or parameters, hidden
   parameters other than each scratch once, a scratch alignment that is not a power of two). */
int ltn_layout_of(const ltn_entry *e, ltn_layout *out, ltn_error *err);
/* The scratch bytes of a launch of grid, by scratch: 0, or -1 when they overflow 64 bits. */
int ltn_scratch_bytes(const ltn_layout *l, const uint32_t grid[3], uint64_t bytes[2]);
/* The encode of descriptor d from the caller's value (lazytriton_native.h's lt_tensor_descriptor), as Triton's
   fillTMADescriptorTiled calls it: 0, or -1 with a message naming the parameter for a value it cannot take. */
int ltn_encode_call_of(const ltn_layout *l, uint32_t d, uint32_t arg, const void *value, ltn_encode_call *out,
                       ltn_error *err);
/* The kernel's parameter array: args (one per own parameter), maps (the encoded map of each descriptor,
   128 bytes each, 64-byte aligned), scratch (pointers by scratch: each hidden parameter points at its own). */
void ltn_params(const ltn_layout *l, void **args, unsigned char (*maps)[128], void *const *scratch, void **params);

/* ---- an AMD entry's load and launch through the HIP runtime (lt_hip.c) ------------------------------- */

/* One launch of a loaded HIP kernel: the checks done, the scratch bytes computed. */
typedef struct {
    void *function, *stream;
    const char *name;              /* the kernel's, for messages */
    int32_t device;                /* the HIP device it was loaded on */
    uint32_t grid[3], block, shared;
    const ltn_layout *layout;
    void **args;                   /* the kernel's own parameters (no host descriptors: refused at load) */
    uint64_t bytes[2];             /* scratch bytes by scratch (0: passed NULL) */
    int allocate;                  /* 1: allocated here on the stream; 0: scratch[] is the caller's */
    void *scratch[2];
} ltn_hip_launch_call;

/* Loads entry e (kind "hsaco") on HIP device device_index: LT_OK with its hipFunction_t, else LT_ERROR_NO_GPU
   (no HIP runtime or device), LT_ERROR_UNSUPPORTED (host descriptors) or LT_ERROR_CUDA (a HIP call failed), with
   a message in err. */
int ltn_hip_load(const ltn_entry *e, int32_t device_index, void **function, ltn_error *err);
/* hipModuleLaunchKernel of the call on its device (the caller's current device restored): LT_OK, or a status
   and a message in err. */
int ltn_hip_launch(const ltn_hip_launch_call *call, ltn_error *err);

/* ---- images (SPEC.md "Image") ------------------------------------------ */

#define LTN_IMAGE_HEADER 96
#define LTN_IMAGE_RECORD 40
#define LTN_MAX_DICT_BYTES (16u << 20)
#define LTN_MAX_META_BYTES (1u << 20)
/* The C reader's own bound on the entry count (Python has none): an index of 40 MiB. Hostile headers could
   otherwise ask for an index the size of a sparse file. */
#define LTN_MAX_IMAGE_ENTRIES (1u << 20)

typedef struct ltn_image ltn_image;

/* Opens and checks an image (header, sections, index and dictionary+meta checksums, meta). */
int ltn_image_open(const char *path, ltn_image **out, ltn_error *err);
void ltn_image_close(ltn_image *image);
const char *ltn_image_path(const ltn_image *image);
uint32_t ltn_image_count(const ltn_image *image);
uint32_t ltn_image_codec(const ltn_image *image); /* 0 none, 1 zstd, 2 zstd with a dictionary */
/* The key of index record i (in index order) as 32 hex digits and a NUL. */
void ltn_image_key_at(const ltn_image *image, uint32_t i, char hex[33]);
/* Index records out of key order (a lookup could miss them): how many. */
uint32_t ltn_image_misordered(const ltn_image *image);
/* Whether the image holds key: LTN_OK, LTN_ABSENT, or LTN_ARGUMENT for a key that is not 32 lowercase hex. */
int ltn_image_contains(const ltn_image *image, const char *key, ltn_error *err);
/* The verified entry of key: LTN_OK (free it with ltn_entry_free), LTN_ABSENT, LTN_ARGUMENT, LTN_DAMAGED,
   LTN_IO or LTN_NOMEM. Thread-safe. */
int ltn_image_read(ltn_image *image, const char *key, ltn_entry *out, ltn_error *err);

/* ---- the choice of an attention kernel's variant, and its key (lt_choice.c) --------------------------- */

enum { LTN_KERNEL_FWD = 0, LTN_KERNEL_BWD_DQ = 1, LTN_KERNEL_BWD_DKDV = 2 };

/* A call of flash_fwd or a backward kernel as the C API's plans describe it (lazytriton.c's plan request). */
typedef struct {
    int32_t kernel;       /* LTN_KERNEL_* */
    int32_t capability;   /* the CUDA device's compute capability, e.g. 90 */
    int32_t dtype;        /* lt_dtype: 1 fp16, 2 bf16, 3 fp32; 5 e4m3, 6 e5m2 (flash_fwd: flash_fwd_fp8) */
    int32_t head_dim, head_dim_v; /* head_dim_v 0: head_dim */
    int32_t causal, aligned, seq16, index64, window, softcap;
    int32_t varlen, seqused_q, seqused_k; /* seqused_*: only with varlen (a dense call's are ignored) */
    int64_t seqlen_q, seqlen_k; /* a packed call's max_seqlen_q, max_seqlen_k */
    int32_t sinks;              /* attention sinks (SINKS): flash_fwd only */
    int32_t chunk;              /* FlashAttention-3's attention_chunk (CHUNK): all three kernels */
} ltn_attn_request;

typedef struct {
    char name[24];
    int32_t is_bool;
    int64_t value;
    const char *text; /* a name-valued field (variant._CHOICES: KV_FP8), a static string; else NULL */
} ltn_variant_field;

#define LTN_MAX_FIELDS 24
typedef struct {
    char kernel[32], target[16], dtype[8];
    ltn_variant_field fields[3][LTN_MAX_FIELDS]; /* functional, tuned, options: each sorted by name */
    int32_t n_fields[3];
} ltn_variant;

/* The variant serving r (capi/embedded.py's plan_variant): LTN_OK, or LTN_ARGUMENT with a message. */
int ltn_attn_variant(const ltn_attn_request *r, ltn_variant *v, ltn_error *err);
/* The FP8 forward's twin, flash_fwd_fp8_gluon (capi/embedded.py's fp8_twin: fp8_gluon.default_variant where
   BY_DEFAULT and its table have a row, sm_90, aligned, 32-bit, no window, softcap, chunk or packed sequences, v's
   head dim q's): LTN_OK, LTN_ABSENT where flash_fwd_fp8 serves every call of r's class, LTN_ARGUMENT for a
   request that is not an FP8 forward's. */
int ltn_fp8_gluon_variant(const ltn_attn_request *r, ltn_variant *v, ltn_error *err);
/* flash_bwd_dsinks's variant (flash_bwd_dsinks.variant: one config; VARLEN, SEQUSED_Q only with it, INDEX64) on a
   CUDA device of capability: LTN_OK, or LTN_ARGUMENT with a message. */
int ltn_dsinks_variant(int32_t capability, int32_t varlen, int32_t seqused_q, int32_t index64, ltn_variant *v,
                       ltn_error *err);
/* A field's value (bools 0/1), or absent. */
int64_t ltn_variant_get(const ltn_variant *v, const char *name, int64_t absent);
/* The one-line string (Variant.__str__): 0, or -1 when size is too small. */
int ltn_variant_string(const ltn_variant *v, char *out, size_t size);
/* The cache key (Variant.key): 0, or -1 for a kernel the tables do not know. */
int ltn_variant_key(const ltn_variant *v, char hex[33]);
/* A plan kernel's scratch memory (lazytriton.c's lt__scratch_need, field for field). */
typedef struct {
    uint32_t num_ctas, size[2], align[2];
    uint8_t hidden[8];
} ltn_scratch_need;
/* Whether a loaded kernel (lazytriton_native.h's lt_kernel) takes n_ints pointers or integers, then n_floats fp32,
   and no host descriptors, nor scratch memory unless need is given (a forward plan passes it; the other C
   launchers pass NULL scratch pointers): LT_OK with its CUfunction, context, hidden parameter count and, in *need,
   its scratch (lt_launch.c's layout), else LT_ERROR_UNSUPPORTED with a message. */
struct lt_kernel;
int ltn_kernel_layout(const struct lt_kernel *k, uint32_t n_ints, uint32_t n_floats, void **function,
                      void **context, uint32_t *n_hidden, ltn_scratch_need *need);
/* ---- what the choices share (lt_choice.c), and the decoding kernels' choice (lt_decode_choice.c) ----- */

/* A kernel's tiles and options (tiles.Config). */
typedef struct {
    int block_m, block_n, num_warps, num_stages, waves_per_eu;
} ltn_config;

/* geometry.padded_head_dim: the compiled head dim holding head_dim, or -1 past the largest. */
int ltn_padded_head_dim(int head_dim);
/* tuning.bucket: the power-of-two bucket of a seqlen (1 for 0 and 1). */
int64_t ltn_bucket(int64_t seqlen);
/* tuning.lookup over the generated rows: 1 with *out filled, or 0 when the group has no row. */
int ltn_tuning_lookup(const char *target, const char *kernel, const char *dtype, int head_dim, int causal,
                      int64_t seqlen_q, int64_t seqlen_k, ltn_config *out);
/* Adds a field to a group (0 functional, 1 tuned, 2 options); ltn_variant_sort orders each group by name. */
void ltn_variant_add(ltn_variant *v, int group, const char *name, int is_bool, int64_t value);
/* Adds a name-valued field (its value 0; text a static string) to the functional group. */
void ltn_variant_add_text(ltn_variant *v, const char *name, const char *text);
void ltn_variant_sort(ltn_variant *v);

enum { LTN_KERNEL_DECODE_SPLIT = 3, LTN_KERNEL_DECODE_COMBINE = 4, LTN_KERNEL_KV_APPEND = 5,
       LTN_KERNEL_FLASH_COMBINE = 6, LTN_KERNEL_KV_APPEND_LENGTHS = 7 };

/* A call of a decoding kernel as the C API's plans describe it (lt_kvcache.c's and lt_combine.c's plan
   requests): flash_decode_split and flash_decode_combine (binding.variants), kv_append (kv_append.variant),
   flash_combine (flash_combine.variant: dtype is out's, head_dim its own; the other fields are ignored). */
typedef struct {
    int32_t kernel;              /* LTN_KERNEL_DECODE_SPLIT, _DECODE_COMBINE, _KV_APPEND or _FLASH_COMBINE */
    int32_t capability, dtype;   /* as ltn_attn_request's */
    int32_t head_dim, head_dim_v; /* head_dim_v 0: head_dim */
    int32_t causal, aligned, index64;
    int64_t rows;                /* query rows per key/value head (group size x seqlen_q) */
    int64_t capacity, page_size; /* keys a sequence's cache holds; keys a page (0: a contiguous cache) */
    int32_t paged;               /* kv_append's PAGED (the decoding kernels read page_size > 0) */
    int32_t window, softcap, alibi, leftpad, rotary, rotary_interleaved, sinks, varlen_q;
    int32_t chunk;               /* attention_chunk: CHUNK on flash_decode_split */
    int32_t kv_fp8;              /* a float8 cache's lt_dtype (5 e4m3, 6 e5m2): KV_FP8 on the split kernel and
                                    kv_append; 0: q's dtype */
    int32_t qv;                  /* MLA's qv: QV on the split kernel (head_dim q's own, head_dim_v up to 512) */
    int32_t varlen_new;          /* new keys packed by cu_seqlens_k_new: VARLEN on kv_append */
    int64_t kv_pairs;            /* a float8 cache's (sequence, key/value head) pairs, whose split tiles follow
                                    them (dispatch.fp8_cuda_tile); 0: the fewest */
} ltn_decode_request;

/* The variant serving r (capi/embedded_kvcache.py's plan_variants and append_variant, embedded_combine.py's
   plan_variant): LTN_OK, or LTN_ARGUMENT with a message. */
int ltn_decode_variant(const ltn_decode_request *r, ltn_variant *v, ltn_error *err);
/* binding.min_split_keys: the fewest keys a split takes on a GPU, by head dim. */
int64_t ltn_decode_min_split_keys(int head_dim);
/* binding.programs_per_sm: the split programs the heuristic counts per SM, for a kernel of `shared` bytes on an SM
   of `capacity` (either 0: not known, PROGRAMS_PER_SM). */
int64_t ltn_decode_programs_per_sm(int64_t shared, int64_t capacity);

/* Entries in the open images, all together. */
uint64_t ltn_images_entries(void);
/* The kernel's source fingerprint (kernels.source_fingerprint when the library was built), or NULL. */
const char *ltn_source_fingerprint(const char *kernel);
/* Whether the variant's binary for a CUDA target of this capability launches as its stream predecessor's
   programmatic dependent (kernels/__init__.py's dependent_launch: KernelSpec.dependent and, where the kernel names
   one, its dependent_flag among the variant's fields, as the library was built): 1 or 0. */
int ltn_dependent_launch(const ltn_variant *v, int32_t capability);

#endif
