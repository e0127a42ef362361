"""Description of the split-KV decoding kernels (``triton_kernel.py``): ``flash_attn_with_kvcache``.

The family ``flash_decode`` has two kernels, launched in this order on one
stream: ``flash_decode_split`` (each program one query-row block x split of
one key/value head of one batch; one split writes the output itself) and
``flash_decode_combine`` (merges the splits' float32 partials by their
logsumexp; launched only when there are several splits). New keys and
values, when a call has them, are written into the cache before both by
the family ``kv_append`` (``kernels/kv_append``). Parameters follow
the attention kernels' conventions: pointers, then strides (in the (batch,
seqlen, heads) order of FlashAttention's layout), then sizes, then the two
floats. Unused pointers (no cache_seqlens tensor, no cache_batch_idx, no block
table, no ALiBi, no cache_leftpad, no rotary tables) get any valid pointer
and a size or flag that says so.

``PAGED`` (a block table), ``WINDOW``, ``SOFTCAP``, ``ALIBI``, ``LEFTPAD``
(cache_leftpad: each sequence's first key, ``LeftPad``) and ``ROTARY`` with
``ROTARY_INTERLEAVED`` (the query rotated as it is loaded: rotary_cos and
rotary_sin, ``RotaryCos``/``RotarySin``, pairs or halves) are flags, written
in a variant only when true; their values (page size, window bounds, cap,
slopes, left pads, the rotary tables, their width and length, the positions'
base ``RotarySeqlens`` and whether each query has its own) are runtime
parameters, so one binary serves every page size
that BLOCK_N divides, every window and every cap. ``PAGE_GATHER`` (with
``PAGED``) serves the pages BLOCK_N does not divide, of any size: each key
finds its own page in the block table (``dispatch.page_gather`` says which
page sizes take it), so one binary serves all of them. ``CAUSAL`` is always
written, as in the other attention kernels. ``ALIGN16`` variants may assume
every pointer and outer stride of q, the cache and out is a multiple of 16
(``aligned_params``); ``INDEX64`` makes the strides 64-bit (a paged cache
pool easily spans 2**31 elements).

``SINKS`` (attention sinks: float32, one logit a query head, ``Sinks``; any
valid pointer without them) is a flag of both kernels, written only when true:
the split kernel adds the sink when it writes the output itself (one split),
the combine kernel when it merges several.

``VARLEN_Q`` (queries packed by ``cu_seqlens_q``, ``CuSeqlensQ``: FlashAttention's
varlen layout, (total_q, heads, head_dim); any valid pointer without it) is a
flag of the split kernel, written only when true; ``seqlen_q`` is then the
packed total (the lse's row length) and the grid covers ``max_seqlen_q``. The
combine kernel needs no flag: it merges the packed rows as one batch.

``KV_FP8`` (``e4m3`` or ``e5m2``: a float8 cache, ``kv_fp8.py``) is a field
of the split kernel, written only for a float8 cache: K and V then point at
float8 bytes (typed as q's dtype in the description, one parameter list for
every variant; the kernel reads them as float8), dequantised by ``KDescale``
and ``VDescale`` (float32, per tensor, per key/value head or per (batch,
head) through ``stride_kdb``/``stride_kdh`` and ``stride_vdb``/``stride_vdh``;
``use_k_descale``/``use_v_descale`` 0: 1.0, any valid pointer). The combine
kernel merges float32 partials already scaled: it has no such field.

A value head dim of its own (``head_dim_v``, DeepSeek's MLA) is the split
kernel's ``BLOCK_DV``/``EVEN_DV``, written in a variant only where they differ
from ``BLOCK_D``/``EVEN_D`` (``lazytriton.variant``'s rule for every attention
kernel); the combine kernel sees only outputs, so its ``head_dim``, ``BLOCK_D``
and ``EVEN_D`` are v's head dim, up to 512.

``QV`` (FlashAttention-3's ``qv``, DeepSeek's MLA: the scores add qv . v) is
a flag of the split kernel, written only when true: each row of ``Q`` then
holds ``head_dim_v`` columns of qv followed by ``head_dim`` of the query (its
strides are that tensor's), so it needs no parameter of its own; the binding
lays the call out so (``mla.py``: MLA's latent cache is that layout as given,
``K`` pointing at the key columns after v's).

``KEY_MASK`` (lazytriton's own: a per-(batch, key) boolean mask, ``key_mask.py``)
is a flag of the split kernel, written only when true: ``KeyMask`` points at
one byte a (batch, key position), batch x ``stride_mb`` + key x ``stride_mn``
(any valid pointer and strides 0 without it); a key whose byte is 0 is not
seen. The combine kernel merges what the splits saw: it has no such field.

``FUSED_COMBINE`` (the split kernel's own flag, ``KernelSpec.flags``: written
only when true) merges the splits in the split kernel itself, one launch
instead of two: with several splits, each program writes its partial, then
takes a ticket from ``Counters`` (int32, one a (batch, key/value head,
query-row block), zero before the call: ``counters.py``), and the one that
takes the last merges the row block's partials as the combine kernel does and
puts its counter back to 0. Without it ``Counters`` is any valid pointer,
unread; one split never reads it.

``NV_CVT`` is set by the compile target, not the variant (``capability_flags``):
true on CUDA from capability ``NV_CVT_FROM`` (89 or more; None: nowhere), where a
float8 cache's V tile is converted to float16 by PTX's
``cvt.rn.f16x2.e4m3x2``/``e5m2x2`` in the load's own layout (see
``triton_kernel.py``); false elsewhere and in the interpreter, where
Triton's conversion runs.

``PDL`` (a capability flag of both kernels, true on CUDA from ``PDL_FROM``)
is Hopper's programmatic dependent launch of the pair: the split kernel lets
the combine kernel launch as soon as every split program runs
(``gdc_launch_dependents``), and the combine kernel, launched with
programmatic stream serialization (``dependent``), waits for the split grid's
memory (``gdc_wait``) before it reads the partials, so its launch and start
overlap the split grid's tail. With ``DEPENDENT_SPLIT`` the split kernel is
in turn its own stream predecessor's dependent, whatever kernel that is: it
waits for that grid's memory (``gdc_wait``) before it reads anything, so a
predecessor that releases its dependents early lets the split grid launch
and start during its tail. kv_append does (a call with new keys launches it
right before the split kernel), and so does the split kernel itself (a
decoding call right after another with one split). A kernel that never
releases them lets the split grid launch when it ends, as a plain launch
would. Without it only a rotary call's split kernel is a dependent
(``dependent_flag``), and the others' wait returns at once. A rotary call's
split kernel (``ROTARY``) waits later: a rotary call always launches
kv_append right before it (new keys or none), and the split kernel loads its
query, lengths and rotary tables and rotates the query while kv_append writes
the cache, waiting for kv_append's memory before its first key. Nothing it
reads before that wait is written between kv_append's launch and its own.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

FAMILY = "flash_decode"
# NV_CVT's least CUDA capability (89 can run it), None: off. Its PTX has a third fewer instructions than Triton's
# conversion (contiguous e4m3 tile at head dim 128), but the tile's shared memory doubles (one program a SM where
# there were two): on an H100 it ties the plain kernel at the best tile for each and loses at the shipped ones
# (experiments/probe_decode_fp8_tiles.py --nv-cvt; benchmarks/NOTES.md, 12-07).
NV_CVT_FROM: int | None = None
# PDL's least CUDA capability (90: Hopper's griddepcontrol), None: off. On from sm_90: on an H100 a batch-1 call
# takes 6-18% less device time at 1k-16k keys, a batch-8 call up to 2.5% less (within 0.4% at worst), the same bits
# (experiments/probe_decode_pdl.py times the pair with and without it).
PDL_FROM: int | None = 90
# Whether every split kernel is launched as its stream predecessor's programmatic dependent under PDL (a decoding
# step's split kernel then starts while kv_append writes its new keys), or only a rotary call's (False). Off: on an
# H100 (experiments/probe_decode_appended.py, three turns alike) a step with a new key gains 1.5-3% at batch 1 / 32k
# keys but loses 2-3% at batch 8 (4k and 32k keys, eager and replayed) and 6% replayed at batch 1 / 4k (10.3 against
# 11.0 us); only calls that follow another decoding call back to back gain everywhere (up to 17%), and a model's
# step follows its projections' GEMMs. Its GPU tests pass either way (tests/test_decode_pdl.py).
DEPENDENT_SPLIT = False
MODULE = "lazytriton.kernels.flash_decode.triton_kernel"


def _strides(*tensors: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"stride_{t}{d}", "{index}") for t in tensors for d in ("b", "s", "h"))


_SPLIT_POINTERS = (("Q", "*{dtype}"), ("K", "*{dtype}"), ("V", "*{dtype}"), ("Out", "*{dtype}"), ("Lse", "*fp32"),
                   ("OutPart", "*fp32"), ("LsePart", "*fp32"), ("Seqlens", "*i32"), ("BatchIdx", "*i32"),
                   ("BlockTable", "*i32"), ("Alibi", "*fp32"), ("LeftPad", "*i32"), ("RotaryCos", "*{dtype}"),
                   ("RotarySin", "*{dtype}"), ("RotarySeqlens", "*i32"), ("Sinks", "*fp32"),
                   ("CuSeqlensQ", "*i32"), ("KDescale", "*fp32"), ("VDescale", "*fp32"), ("KeyMask", "*u8"),
                   ("Counters", "*i32"))
_SPLIT_STRIDES = _strides("q", "k", "v", "o") + (("stride_tb", "{index}"), ("stride_ab", "{index}"),
                                                 ("stride_kdb", "i32"), ("stride_kdh", "i32"),
                                                 ("stride_vdb", "i32"), ("stride_vdh", "i32"),
                                                 ("stride_mb", "{index}"), ("stride_mn", "{index}"))

FLASH_DECODE_SPLIT = KernelSpec(
    name="flash_decode_split",
    module=MODULE,
    function="flash_decode_split_kernel",
    params=(
        *_SPLIT_POINTERS,
        *_SPLIT_STRIDES,
        ("group_size", "i32"),
        ("heads_q", "i32"),
        ("seqlen_q", "i32"),
        ("head_dim", "i32"),
        ("head_dim_v", "i32"),
        ("seqlen_const", "i32"),
        ("seqlen_new", "i32"),
        ("use_seqlens", "i32"),
        ("use_batch_idx", "i32"),
        ("page_size", "i32"),
        ("num_splits", "i32"),
        ("window_left", "i32"),
        ("window_right", "i32"),
        ("attention_chunk", "i32"),
        ("rotary_dim", "i32"),
        ("seqlen_ro", "i32"),
        ("use_rotary_seqlens", "i32"),
        ("rotary_per_query", "i32"),
        ("use_k_descale", "i32"),
        ("use_v_descale", "i32"),
        ("sm_scale", "fp32"),
        ("softcap", "fp32"),
    ),
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "BLOCK_DV", "EVEN_DV", "CAUSAL", "PAGED", "WINDOW",
                "SOFTCAP", "ALIBI", "LEFTPAD", "PAGE_GATHER", "ROTARY", "ROTARY_INTERLEAVED", "SINKS",
                "VARLEN_Q", "CHUNK", "KV_FP8", "QV", "KEY_MASK", "FUSED_COMBINE"),
    aligned_params=("Q", "K", "V", "Out") + tuple(name for name, _ in _strides("q", "k", "v", "o")),
    helpers=("lazytriton.kernels.rotary", "lazytriton.kernels.chunk"),
    flags=("FUSED_COMBINE",),
    capability_flags=(("NV_CVT", NV_CVT_FROM), ("PDL", PDL_FROM)),
    dependent="PDL",
    dependent_flag="" if DEPENDENT_SPLIT else "ROTARY",
)

_COMBINE_STRIDES = _strides("o")

FLASH_DECODE_COMBINE = KernelSpec(
    name="flash_decode_combine",
    module=MODULE,
    function="flash_decode_combine_kernel",
    params=(
        ("OutPart", "*fp32"),
        ("LsePart", "*fp32"),
        ("Out", "*{dtype}"),
        ("Lse", "*fp32"),
        ("Sinks", "*fp32"),
        *_COMBINE_STRIDES,
        ("heads_q", "i32"),
        ("seqlen_q", "i32"),
        ("head_dim", "i32"),
        ("num_splits", "i32"),
        ("n_rows", "i32"),
    ),
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "SINKS"),
    aligned_params=("Out",) + tuple(name for name, _ in _COMBINE_STRIDES),
    capability_flags=(("PDL", PDL_FROM),),
    dependent="PDL",
)

KERNELS = (FLASH_DECODE_SPLIT, FLASH_DECODE_COMBINE)


def split_grid(rows: int, block_m: int, num_splits: int, heads_k: int, batch: int,
               packed_rows: int | None = None) -> tuple[int, int, int]:
    """Split programs: (query-row blocks x splits) x key/value heads x batch (y and z stay under 65536).

    ``rows``: the query rows of a key/value head (group size x seqlen_q). ``packed_rows`` (queries packed by
    cu_seqlens_q, VARLEN_Q: group size x total_q): the sequences' row blocks flattened, packed_rows // block_m
    + batch of them (``triton_kernel._packed_sequence``: each sequence gets at least its own count), laid out
    as batch x their share; ``rows`` (the longest sequence's) is then unused.
    """
    if packed_rows is None:
        return (((rows + block_m - 1) // block_m) * num_splits, heads_k, batch)
    return (-(-(packed_rows // block_m + batch) // max(batch, 1)) * num_splits, heads_k, batch)


def split_programs(rows: int, block_m: int, heads_k: int, batch: int, packed_rows: int | None = None) -> int:
    """The split kernel's programs a split (``split_grid``'s, one split): what the split heuristic fills SMs with."""
    x, y, z = split_grid(rows, block_m, 1, heads_k, batch, packed_rows)
    return x * y * z


def combine_grid(n_rows: int, block_m: int) -> tuple[int, int, int]:
    """Combine programs: blocks of BLOCK_M flattened (batch, query head, query) rows."""
    return ((n_rows + block_m - 1) // block_m, 1, 1)
