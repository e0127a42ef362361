"""Host side of flash_decode: the one owner of the decoding kernels' launch ABI.

Everything that launches ``flash_decode_split``/``flash_decode_combine``
(the torch op, the public ``flash_attn_with_kvcache``, benchmarks) goes
through here:

- ``checks.check`` turns the call into a ``Call`` (shapes, dtypes, options)
  and ``values.check_values`` refuses index values outside the cache, both
  before anything is written or launched;
- ``num_splits`` picks the split count (FlashAttention-2's idea: enough
  programs to fill the GPU's SMs without splitting what already fills them);
- ``split_ints``/``combine_ints`` lay the integer arguments out in each
  description's order (``FLASH_DECODE_SPLIT.params``: tested against it);
- ``forward`` appends k/v to the cache (``kv_append.binding.append``: one
  launch of the ``kv_append`` kernel), then runs the split kernel and, with
  several splits, the combine kernel (or the split kernel alone, merging its
  own partials, where ``dispatch.FUSED_COMBINE_BY_DEFAULT`` says so, its
  counters from ``counters.COUNTERS``): cached binaries on a GPU, Triton's
  interpreter on the CPU, nothing on meta. The last kernel writes the
  caller's ``out`` through its strides when it has a contiguous last dim
  (``writes_into``), so nothing is copied.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lazytriton import geometry, launch, runtime
from lazytriton.kernels.flash_decode import (
    FAMILY,
    FLASH_DECODE_COMBINE,
    FLASH_DECODE_SPLIT,
    checks,
    combine_grid,
    counters,
    key_mask,
    mla,
    split_grid,
    split_programs,
    values,
)
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.checks import Call, Inputs
from lazytriton.kernels.kv_append import binding as kv_append
from lazytriton.variant import Variant

MAX_HEURISTIC_SPLITS = 128
FUSED = 0  # a plan's combine kernel and BLOCK_M where the split kernel merges its own partials (FUSED_COMBINE)
INTERPRETER_COMBINE_M = 2  # the interpreter's combine rows a program: several programs, a masked last one
INTERPRETER_SMS = 4  # the CPU path's pretend GPU: a few splits, so the interpreter runs the combine too
# Split programs the heuristic counts per SM. FlashAttention-2 fills 2 x the SMs ("we multiply number of
# SMs by 2 to hard-code the fact that we're using 128 threads per block", flash_api.cpp set_params_splitkv);
# the split kernel runs 4 warps (128 threads) in at most ~72 KB of shared memory, so 2 or 3 programs share an
# SM, and one program per SM leaves a memory-bound loop with half the loads in flight (at 1 a SM, batch 16 x 8
# heads = 128 programs run unsplit: H200, bench_decode.py; the figures are in benchmarks/NOTES.md).
PROGRAMS_PER_SM = 2
# Where the split kernel's shared memory leaves room for fewer (the tuned long-cache tiles, 128 keys x 3 stages of
# K and V at head dim 128: ~192 KB of an H100's 228 KB), the slots are what fits (``programs_per_sm``): counting 2
# there put 256 programs of a batch-1 call in two waves of one a SM (H100, 16k keys: 33.2 µs at 32 splits, 28.8
# at 16).
RESERVED_SHARED = 1024  # bytes the driver keeps for each resident program (sm_80 and later)
SPLIT_INT_PARAMS = tuple(name for name, kind in FLASH_DECODE_SPLIT.params if not kind.startswith("fp"))
COMBINE_INT_PARAMS = tuple(name for name, kind in FLASH_DECODE_COMBINE.params if not kind.startswith("fp"))


# ---------------------------------------------------------------------------
# Split count (pure), and the SM count it needs (reads the machine)


@functools.lru_cache(maxsize=4096)  # pure, and called on every launch: a decode loop repeats a few shapes
def choose_splits(programs: int, key_blocks: int, sms: int, max_splits: int = MAX_HEURISTIC_SPLITS) -> int:
    """How many splits to cut each program's keys in, so that the grid fills ``sms`` SMs evenly (pure).

    FlashAttention-2's heuristic (``num_splits_heuristic``): ``programs``
    (batch x key/value heads x query-row blocks) that nearly fill the GPU
    (80% of the SMs) get one split. Otherwise, for each split count whose
    blocks per split differ from the previous count's (11 and 12 splits of 64
    blocks are both 6 blocks a split), the efficiency is waves / ceil(waves),
    waves = programs x splits / SMs; the smallest count within 85% of the
    best wins.
    """
    if programs <= 0 or key_blocks <= 1 or programs >= 0.8 * sms:
        return 1
    limit = min(max_splits, sms, key_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or -(-key_blocks // n) != -(-key_blocks // (n - 1))

    efficiency = {}
    for n in range(1, limit + 1):
        if eligible(n):
            waves = programs * n / sms
            efficiency[n] = waves / -(-waves // 1)
    best = max(efficiency.values())
    return next(n for n, eff in efficiency.items() if eff >= 0.85 * best)


@functools.cache
def sm_count(device_index: int) -> int:
    """The number of SMs (CUs on AMD) of a GPU, read once per device."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def min_split_keys(head_dim: int) -> int:
    """The fewest keys a split is cut to on a GPU: 128 up to head dim 128, else 64.

    FlashAttention-2 counts a cache's blocks for its heuristic in such units
    (``set_params_splitkv``: 256 keys at head dim <= 64, 128 at <= 128, else
    64): a split then reads at least 16 KB of K and V per head (bf16), enough
    to pipeline, and the combine kernel reads few partials. A 1k cache is cut
    in at most 8 splits. Head dim 64 takes 128, not FlashAttention-2's 256: at
    batch 1 its best split counts are those 128-key splits give (1k keys: 8
    splits 7.7 µs against 4's 8.5; 4k: 32 against 16's 9.9, 9.4 µs; H100,
    ``lazytriton tune --kernel flash_decode --splits-report``), and from batch
    8 the heuristic's count is the same under either.
    """
    return 128 if head_dim <= 128 else 64


def splits_for(call: Call, block_m: int, block_n: int, sms: int, min_keys: int = 0) -> int:
    """The call's split count: ``num_splits`` if given, else ``choose_splits`` over the cache's capacity.

    ``sms``: the programs the GPU runs at once (``gpu_slots``); ``min_keys``:
    the fewest keys worth a split of their own (``min_split_keys`` on a GPU;
    0, one BLOCK_N, in the interpreter). Either way at most as many as keep
    the float32 partials under 2**31 elements (the kernels index them in 32
    bits).
    """
    most = max(1, checks.INT32_MAX // max(1, call.lse_rows * call.value_dim))
    if call.num_splits:
        return min(call.num_splits, most)
    programs = split_programs(call.rows, block_m, call.heads_k, call.batch, call.packed_rows)
    keys = call.capacity
    if call.windowed:  # a window bounds what one query row block reads
        keys = min(keys, call.window_left + call.window_right + call.seqlen_q)
    if call.attention_chunk:  # so does a chunk
        keys = min(keys, call.attention_chunk + call.seqlen_q)
    unit = max(block_n, min_keys)
    return min(choose_splits(programs, -(-keys // unit), sms), most)


@functools.cache
def sm_shared(device_index: int) -> int:
    """The shared memory of one SM (an AMD CU's LDS) in bytes, read once per device; 0 where torch does not say."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)


def programs_per_sm(shared: int, capacity: int) -> int:
    """Split programs one SM holds at once (pure): ``PROGRAMS_PER_SM``, or fewer where they do not fit.

    ``shared``: bytes a program (the loaded kernel's), ``capacity``: the SM's; 0 for either: not known, the
    default.
    """
    if shared <= 0 or capacity <= 0:
        return PROGRAMS_PER_SM
    return max(1, min(PROGRAMS_PER_SM, capacity // (shared + RESERVED_SHARED)))


def gpu_slots(device_index: int, shared: int = 0) -> int:
    """The split programs a GPU runs at once, as the heuristic counts them: SMs x ``programs_per_sm``.

    ``shared``: the split kernel's shared memory a program (0: not known, ``PROGRAMS_PER_SM`` a SM).
    """
    return sm_count(device_index) * programs_per_sm(shared, sm_shared(device_index) if shared > 0 else 0)


# ---------------------------------------------------------------------------
# Arguments, in the descriptions' order


def _ptr(x: Any) -> int:
    return int(x.data_ptr())


# The split kernel's integer parameters, in the order ``split_ints`` writes them (checked against the description).
_SPLIT_LAYOUT = ("Q", "K", "V", "Out", "Lse", "OutPart", "LsePart", "Seqlens", "BatchIdx", "BlockTable", "Alibi",
                 "LeftPad", "RotaryCos", "RotarySin", "RotarySeqlens", "Sinks", "CuSeqlensQ", "KDescale", "VDescale",
                 "KeyMask", "Counters", *(f"stride_{n}{d}" for n in "qkvo" for d in "bsh"), "stride_tb", "stride_ab",
                 "stride_kdb", "stride_kdh", "stride_vdb", "stride_vdh", "stride_mb", "stride_mn",
                 "group_size", "heads_q", "seqlen_q", "head_dim", "head_dim_v", "seqlen_const", "seqlen_new",
                 "use_seqlens", "use_batch_idx", "page_size", "num_splits", "window_left", "window_right",
                 "attention_chunk", "rotary_dim", "seqlen_ro", "use_rotary_seqlens", "rotary_per_query",
                 "use_k_descale", "use_v_descale")
if _SPLIT_LAYOUT != SPLIT_INT_PARAMS:  # pragma: no cover (an edit of one side only)
    raise ImportError(f"split_ints writes {_SPLIT_LAYOUT}, the description has {SPLIT_INT_PARAMS}")


def split_ints(t: Inputs, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
               call: Call, splits: int, pointers: Any = _ptr,
               tickets: torch.Tensor | None = None) -> tuple[Any, ...]:
    """The split kernel's integer arguments (pointers through ``pointers``: data_ptr, or the tensor itself).

    Written out in ``_SPLIT_LAYOUT``'s order (one tuple, no dict: this runs
    on every launch). An argument the call does not use gets ``lse`` (any
    valid pointer) and the flag or size that says so. Packed queries (q and
    out (total_q, heads, dim)) get batch stride 0 and seqlen_q total_q.
    ``tickets``: the fused combine's counters (``counters.py``; None: ``lse``, unread).
    """
    seqlens = t.cache_seqlens if isinstance(t.cache_seqlens, torch.Tensor) else None
    table, slopes, rows, pads, sinks = t.block_table, t.alibi_slopes, t.cache_batch_idx, t.cache_leftpad, t.sinks
    cos, sin, bases = t.rotary_cos, t.rotary_sin, t.rotary_seqlens
    qs, ks, vs, os = t.q.stride(), t.k_cache.stride(), t.v_cache.stride(), out.stride()
    cu, kd, vd, km = t.cu_seqlens_q, t.k_descale, t.v_descale, t.key_mask
    if km is not None:
        km = key_mask.kernel_view(km)
    if cu is not None:
        qs, os = (0, *qs), (0, *os)
    kds, vds = checks.descale_strides(kd), checks.descale_strides(vd)
    return (pointers(t.q), pointers(t.k_cache), pointers(t.v_cache), pointers(out), pointers(lse),
            pointers(part_out), pointers(part_lse), pointers(lse if seqlens is None else seqlens),
            pointers(lse if rows is None else rows), pointers(lse if table is None else table),
            pointers(lse if slopes is None else slopes), pointers(lse if pads is None else pads),
            pointers(t.q if cos is None else cos), pointers(t.q if sin is None else sin),
            pointers(lse if bases is None else bases),
            pointers(lse if sinks is None else sinks), pointers(lse if cu is None else cu),
            pointers(lse if kd is None else kd), pointers(lse if vd is None else vd),
            pointers(lse if km is None else km), pointers(lse if tickets is None else tickets),
            qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os[0], os[1], os[2],
            0 if table is None else table.stride(0), 0 if slopes is None or slopes.dim() == 1 else slopes.stride(0),
            kds[0], kds[1], vds[0], vds[1], *key_mask.strides(km),
            call.heads_q // call.heads_k, call.heads_q, call.out_seqlen, call.head_dim, call.value_dim,
            max(call.seqlen_const, 0),
            call.seqlen_new, int(seqlens is not None), int(rows is not None), call.page_size, splits,
            call.window_left, call.window_right, call.attention_chunk, call.rotary_dim, call.seqlen_ro,
            int(call.rotary_seqlens), int(call.rotary_per_query), int(kd is not None), int(vd is not None))


def combine_ints(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, call: Call,
                 splits: int, pointers: Any = _ptr, sinks: torch.Tensor | None = None) -> tuple[Any, ...]:
    """The combine kernel's integer arguments (``sinks``: the call's, else ``lse`` stands in, unread).

    Packed queries are one batch of total_q (``Call.out_batch``, ``out_seqlen``).
    """
    os = out.stride() if not call.varlen_q else (0, *out.stride())
    values = {"OutPart": pointers(part_out), "LsePart": pointers(part_lse), "Out": pointers(out),
              "Lse": pointers(lse), "Sinks": pointers(lse if sinks is None else sinks),
              "stride_ob": os[0], "stride_os": os[1], "stride_oh": os[2],
              "heads_q": call.heads_q, "seqlen_q": call.out_seqlen, "head_dim": call.value_dim, "num_splits": splits,
              "n_rows": call.lse_rows}
    return tuple(values[name] for name in COMBINE_INT_PARAMS)


# What capi/lt_kvcache.c passes for each integer parameter (p: the caller's lt_attn_kvcache_params as lt__kv_prepare
# views it, packed queries as one batch of total_q rows, qv's [qv | q] rows read from qv's pointer; c: its checked
# call; q/kc/vc/o: its tensors;
# tests/test_capi_kvcache.py compares the C initializers with these, field by field).
_C_SPLIT = {"Q": "c->qv ? LT__PTR(p->qv) : LT__PTR(p->q)", "K": "LT__PTR(p->k_cache)", "V": "LT__PTR(p->v_cache)",
            "Out": "LT__PTR(p->out)",            "Lse": "LT__PTR(p->lse)", "OutPart": "part_out", "LsePart": "part_lse",
            "Seqlens": "seqlens", "BatchIdx": "LT__OR_LSE(p->cache_batch_idx)",
            "BlockTable": "LT__OR_LSE(p->block_table)", "Alibi": "LT__OR_LSE(p->alibi_slopes)",
            "LeftPad": "LT__OR_LSE(p->cache_leftpad)", "RotaryCos": "LT__OR_Q(p->rotary_cos)",
            "RotarySin": "LT__OR_Q(p->rotary_sin)", "RotarySeqlens": "bases",
            "Sinks": "LT__OR_LSE(p->sinks)", "CuSeqlensQ": "LT__OR_LSE(p->cu_seqlens_q)",
            "KDescale": "LT__OR_LSE(p->k_descale)", "VDescale": "LT__OR_LSE(p->v_descale)",
            "KeyMask": "LT__PTR(p->lse)",  # the C API takes no key mask (KEY_MASK off): lse's pointer, unread
            "Counters": "LT__PTR(p->lse)",  # nor fuses the combine (FUSED_COMBINE off): lse's pointer, unread
            **{f"stride_{n}{d}": f"{t}->strides[{i}]" for n, t in (("q", "q"), ("k", "kc"), ("v", "vc"), ("o", "o"))
               for i, d in enumerate("bsh")},
            "stride_tb": "c->paged ? p->block_table.strides[0] : 0",
            "stride_ab": "p->alibi_slopes.ndim == 2 ? p->alibi_slopes.strides[0] : 0",
            **{f"stride_{t}d{d}": f"c->descale_strides[{i}][{j}]" for i, t in enumerate("kv")
               for j, d in enumerate("bh")}, "stride_mb": "0", "stride_mn": "0",
            "group_size": "c->hq / c->hk", "heads_q": "c->hq", "seqlen_q": "c->out_seqlen", "head_dim": "c->d",
            "head_dim_v": "c->dv", "seqlen_const": "seqlen_const > 0 ? seqlen_const : 0",
            "seqlen_new": "seqlen_new",  # lt_kvcache.c's locals: after_packed_append's view with packed new keys
            "use_seqlens": "use_seqlens", "use_batch_idx": "c->use_batch_idx", "page_size": "c->page_size",
            "num_splits": "splits", "window_left": "c->window_left", "window_right": "c->window_right",
            "attention_chunk": "c->attention_chunk",  # lt_kvcache.c's lt__kv_chunk: checks._chunk's
            "rotary_dim": "c->rotary_dim", "seqlen_ro": "c->seqlen_ro", "use_rotary_seqlens": "use_bases",
            "rotary_per_query": "c->rotary_per_query", "use_k_descale": "c->descale[0] != 0",
            "use_v_descale": "c->descale[1] != 0"}
_C_COMBINE = {"OutPart": "part_out", "LsePart": "part_lse", "Out": "LT__PTR(p->out)", "Lse": "LT__PTR(p->lse)",
              "Sinks": "LT__OR_LSE(p->sinks)",
              "stride_ob": "o->strides[0]", "stride_os": "o->strides[1]", "stride_oh": "o->strides[2]",
              "heads_q": "c->hq", "seqlen_q": "c->out_seqlen", "head_dim": "c->dv", "num_splits": "splits",
              "n_rows": "n_rows"}


def c_initializer(kernel: str) -> str:
    """The C launcher's integer-argument initializer of one decoding kernel, in its description's order."""
    if kernel == FLASH_DECODE_SPLIT.name:
        return ", ".join(_C_SPLIT[name] for name in SPLIT_INT_PARAMS)
    return ", ".join(_C_COMBINE[name] for name in COMBINE_INT_PARAMS)


def floats(call: Call) -> tuple[float, float]:
    """The split kernel's float parameters: sm_scale, softcap."""
    return (call.scale, call.softcap)


def layout_flags(t: Inputs, out: torch.Tensor) -> tuple[bool, bool]:
    """(aligned, index64): 16-byte aligned pointers and outer strides; some tensor spanning 2**31 elements."""
    q, kc, vc = t.q, t.k_cache, t.v_cache
    qs, ks, vs, os = q.stride(), kc.stride(), vc.stride(), out.stride()
    q_shape, out_shape = tuple(q.shape), tuple(out.shape)
    if q.dim() == 3:  # packed queries: no batch stride (one batch of all the rows)
        qs, os, q_shape, out_shape = (0, *qs), (0, *os), (1, *q_shape), (1, *out_shape)
    aligned = not (q.data_ptr() | kc.data_ptr() | vc.data_ptr() | out.data_ptr() | qs[0] | qs[1] | qs[2] | ks[0]
                   | ks[1] | ks[2] | vs[0] | vs[1] | vs[2] | os[0] | os[1] | os[2]) & 15
    # out counts too: with head_dim_v > head_dim it spans more than q.
    mask = t.key_mask  # its byte offsets too (KEY_MASK)
    index64 = max(_extent(q_shape, qs), _extent(kc.shape, ks), _extent(vc.shape, vs), _extent(out_shape, os),
                  0 if mask is None else _extent(mask.shape, mask.stride())) >= checks.INT32_MAX
    return aligned, index64


def _extent(shape: Any, strides: Any) -> int:
    """How far past its first element a tensor's last one lies (elements; strides are non-negative here)."""
    return sum((n - 1) * s for n, s in zip(shape, strides, strict=True))


# ---------------------------------------------------------------------------
# Variants and plans


def variants(target: Any, dtype: torch.dtype, call: Call, aligned: bool, index64: bool,
             fused: bool = False) -> tuple[Variant, Variant]:
    """The (split, combine) variants serving a call (dispatch decides; the combine kernel's head dim is v's).

    ``fused``: the split kernel's FUSED_COMBINE (the combine variant is then not launched).
    """
    common = dict(config=None, index64=index64, page_size=call.page_size, head_dim_v=call.head_dim_v)
    split = decode_dispatch.decode_variant(FLASH_DECODE_SPLIT.name, target, checks.DTYPES[dtype], call.head_dim,
                                           call.causal, aligned, call.rows, call.capacity, paged=call.paged,
                                           window=call.windowed, softcap=call.softcap > 0, alibi=call.alibi,
                                           leftpad=call.leftpad, rotary=call.rotary,
                                           rotary_interleaved=call.rotary_interleaved, sinks=call.sinks,
                                           varlen_q=call.varlen_q, chunk=call.chunked, kv_fp8=call.kv_fp8,
                                           qv=call.qv, key_mask=call.key_mask, fused_combine=fused,
                                           kv_pairs=kv_pairs(call), **common)  # type: ignore[arg-type]
    combine = decode_dispatch.decode_variant(FLASH_DECODE_COMBINE.name, target, checks.DTYPES[dtype], call.head_dim,
                                             False, aligned, call.rows, call.capacity, sinks=call.sinks,
                                             **common)  # type: ignore[arg-type]
    return split, combine


def kv_pairs(call: Call) -> int:
    """The call's (sequence, key/value head) pairs, which a float8 cache's split tiles follow (pure).

    0 for a 16-bit cache: its tiles do not follow them.
    """
    return call.batch * call.heads_k if call.kv_fp8 != "none" else 0


def memo_key(device_index: int | None, dtype: torch.dtype, call: Call, aligned: bool, index64: bool,
             fused: bool = False) -> tuple[Any, ...]:
    """Everything ``variants`` reads, the lengths through dispatch's buckets.

    The page size through ``page_block_limit``: its largest power-of-two
    divisor caps BLOCK_N, or under ``dispatch.GATHER_BELOW`` sets PAGE_GATHER
    (-1 in the key: every gathered page size is served alike).
    Sinks lengthen it (``SINKS_TAG``), packed queries too (``VARLEN_Q_TAG``),
    attention_chunk too (``CHUNK_TAG``), a float8 cache too (its format and its pairs' class,
    ``dispatch.fp8_pairs_class``), qv too (``QV_TAG``), a key mask too
    (``KEY_MASK_TAG``), the fused combine too (``FUSED_TAG``, last): a key without them is unchanged.
    """
    from lazytriton import tuning

    return (FAMILY, device_index, dtype, call.head_dim, call.head_dim_v, call.causal, aligned, index64,
            tuning.bucket_index(call.rows), tuning.bucket_index(call.capacity),
            -1 if decode_dispatch.page_gather(call.page_size) else decode_dispatch.page_block_limit(call.page_size),
            call.paged, call.windowed, call.softcap > 0, call.alibi,
            call.leftpad, call.rotary, call.rotary_interleaved, *(SINKS_TAG if call.sinks else ()),
            *(VARLEN_Q_TAG if call.varlen_q else ()), *(CHUNK_TAG if call.chunked else ()),
            *((call.kv_fp8, decode_dispatch.fp8_pairs_class(kv_pairs(call))) if call.kv_fp8 != "none" else ()),
            *(QV_TAG if call.qv else ()),
            *(KEY_MASK_TAG if call.key_mask else ()), *(FUSED_TAG if fused else ()))


FUSED_TAG = ("fused_combine",)  # the memo key's last item for a call whose split kernel merges its own partials
QV_TAG = ("qv",)  # the memo key's item for a call with qv . v in its scores (MLA)
KEY_MASK_TAG = ("key_mask",)  # the memo key's last item for a call with a key mask (KEY_MASK)
CHUNK_TAG = ("chunk",)  # the memo key's last item for a call with attention_chunk
SINKS_TAG = ("sinks",)  # the memo key's item for a call with attention sinks
VARLEN_Q_TAG = ("varlen_q",)  # the memo key's last item for a call whose queries are packed by cu_seqlens_q


def plan(device: torch.device, dtype: torch.dtype, call: Call, aligned: bool, index64: bool,
         fused: bool = False) -> tuple[Any, ...]:
    """(split kernel, BLOCK_M, BLOCK_N, combine kernel, its BLOCK_M), loaded, memoised in the runtime's plans.

    Both kernels are loaded together, so a CUDA graph may capture calls with
    one split and with several. During a capture, a kernel not loaded yet
    raises ``CaptureError`` naming it. ``fused``: the split kernel merges its
    own partials (FUSED_COMBINE), and the entry's combine kernel and its
    BLOCK_M are 0 (``FUSED``: none is loaded).
    """
    rt = runtime.get()
    key = memo_key(device.index, dtype, call, aligned, index64, fused)
    found = rt.plans.get(key)
    if found is not None:
        return found  # type: ignore[no-any-return]

    def choose(target: Any) -> launch.Choice:
        split, combine = variants(target, dtype, call, aligned, index64, fused)
        if fused:
            return ((split, ("BLOCK_M", "BLOCK_N", FUSED, FUSED)),)
        return ((split, ("BLOCK_M", "BLOCK_N")), (combine, ("BLOCK_M",)))

    return launch.plan(rt, key, device, choose, "run flash_attn_with_kvcache once with this shape before the capture")


# ---------------------------------------------------------------------------
# Running them


def empty_outputs(q: torch.Tensor, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """out: q's dtype, contiguous (batch, seqlen_q, heads, head_dim_v); lse: (batch, heads, seqlen_q), fp32.

    Packed queries (q (total_q, heads, head_dim)): out (total_q, heads, head_dim_v), lse (heads, total_q).
    """
    return torch.empty((*q.shape[:-1], call.value_dim), dtype=q.dtype, device=q.device), empty_lse(q, call)


def empty_lse(q: torch.Tensor, call: Call) -> torch.Tensor:
    """The float32 logsumexp alone (``empty_outputs``' second tensor), for a call writing the caller's out."""
    if call.varlen_q:
        return torch.empty((call.heads_q, call.total_q), dtype=torch.float32, device=q.device)
    return torch.empty((call.batch, call.heads_q, call.seqlen_q), dtype=torch.float32, device=q.device)


def writes_into(out: torch.Tensor) -> bool:
    """Whether the kernels write ``out`` in place: its last dim contiguous (they index the others by stride)."""
    return out.stride(-1) == 1 or out.shape[-1] <= 1


def after_packed_append(t: Inputs, call: Call) -> tuple[Inputs, Call]:
    """The attention's view of a call whose new keys were packed by cu_seqlens_k_new, once they are appended.

    Each sequence's keys are then its cached ones and its own new count, cache_seqlens[b] + n_b: a tensor the
    split kernel reads as its lengths (seqlen_new 0), computed on the device (no host read) from the call's inputs
    alone (the caller computes it before the append); its rotary base stays cache_seqlens (rotary_seqlens, when
    not given).
    """
    lens = values.lengths(t, call).to(torch.int32)
    bases = t.rotary_seqlens
    if call.rotary and bases is None:
        bases = values.cached(t, call).to(torch.int32)
    return (t._replace(cache_seqlens=lens, rotary_seqlens=bases, k=None, v=None, cu_seqlens_k_new=None),
            call._replace(seqlen_new=0, seqlen_const=-1, rotary_seqlens=call.rotary, varlen_new=False))


def _partials(lse: torch.Tensor, call: Call, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 workspace of several splits (one split writes out and lse itself: ``lse`` stands in, unread)."""
    if splits == 1:
        return lse, lse
    rows = call.lse_rows * splits
    return (torch.empty(rows * call.value_dim, dtype=torch.float32, device=lse.device),
            torch.empty(rows, dtype=torch.float32, device=lse.device))


def launch_gpu(t: Inputs, out: torch.Tensor, lse: torch.Tensor, call: Call,
               forced: tuple[Variant, Variant] | None = None, own_counters: bool = False) -> None:
    """Launch the cached kernels for a checked call on GPU tensors (the cache already appended).

    ``forced``: the (split, combine) variants to run instead of dispatch's
    (``lazytriton tune --kernel flash_decode`` times its candidates through
    here, so a candidate runs exactly as a call would run it; a split variant
    with FUSED_COMBINE=true runs alone). Otherwise the split kernel merges its
    own partials where ``dispatch.FUSED_COMBINE_BY_DEFAULT`` says so now.
    ``own_counters``: that merge's counters are the call's own (``counters.py``).
    """
    device = t.q.device
    if forced is None:
        fused = decode_dispatch.FUSED_COMBINE_BY_DEFAULT
        aligned, index64 = layout_flags(t, out)
        split_kernel, block_m, block_n, combine_kernel, combine_m = plan(device, t.q.dtype, call, aligned, index64,
                                                                         fused)
    else:
        rt = runtime.get()
        fused = forced[0].constexprs.get("FUSED_COMBINE") is True
        split_kernel = rt.kernel(forced[0], device.index)
        combine_kernel = FUSED if fused else rt.kernel(forced[1], device.index)
        block_m, block_n = int(forced[0].get("BLOCK_M")), int(forced[0].get("BLOCK_N"))
        combine_m = FUSED if fused else int(forced[1].get("BLOCK_M"))
    splits = splits_for(call, block_m, block_n, gpu_slots(device.index, getattr(split_kernel, "shared", 0)),
                        min_split_keys(call.head_dim))
    part_out, part_lse = _partials(lse, call, splits)
    stream = launch.raw_stream(device.index)
    grid = split_grid(call.rows, block_m, splits, call.heads_k, call.batch, call.packed_rows)
    tickets = _tickets(t.q, stream, grid, splits, own_counters) if fused and splits > 1 else None
    split_kernel.launch(grid, stream, split_ints(t, out, lse, part_out, part_lse, call, splits, tickets=tickets),
                        floats(call), launch.scratch_alloc)
    if splits > 1 and not fused:
        combine_kernel.launch(combine_grid(call.lse_rows, combine_m), stream,
                              combine_ints(part_out, part_lse, out, lse, call, splits, sinks=t.sinks), (),
                              launch.scratch_alloc)


def _tickets(q: torch.Tensor, stream: int, grid: tuple[int, int, int], splits: int, own: bool) -> torch.Tensor:
    """The fused combine's counters for a split grid on ``stream`` (``counters.COUNTERS``; ``own``: the call's)."""
    return counters.COUNTERS.get(q.device, q.get_device(), stream, counters.count(grid[2], grid[1], grid[0] // splits),
                                 own)


def interpreter_constexprs(call: Call, fused: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(split, combine) constexprs for Triton's interpreter: tiles smaller than the test shapes, so every loop runs.

    ``fused``: the split kernel's FUSED_COMBINE.
    """
    padded, padded_v = geometry.padded_head_dim(call.head_dim), geometry.padded_value_dim(call.value_dim)
    even, even_v = padded == call.head_dim, padded_v == call.value_dim
    split = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": padded, "EVEN_D": even, "BLOCK_DV": padded_v,
             "EVEN_DV": even_v, "CAUSAL": call.causal, "PAGED": call.paged, "WINDOW": call.windowed,
             "SOFTCAP": call.softcap > 0, "ALIBI": call.alibi, "LEFTPAD": call.leftpad,
             "PAGE_GATHER": decode_dispatch.page_gather(call.page_size), "ROTARY": call.rotary,
             "ROTARY_INTERLEAVED": call.rotary_interleaved, "SINKS": call.sinks, "VARLEN_Q": call.varlen_q,
             "CHUNK": call.chunked, "KV_FP8": call.kv_fp8, "QV": call.qv, "KEY_MASK": call.key_mask,
             "FUSED_COMBINE": fused}
    return split, {"BLOCK_M": INTERPRETER_COMBINE_M, "BLOCK_N": 4, "BLOCK_D": padded_v, "EVEN_D": even_v,
                   "SINKS": call.sinks}


def run_interpreter(t: Inputs, out: torch.Tensor, lse: torch.Tensor, call: Call, own_counters: bool = False) -> None:
    """Run the kernels through Triton's interpreter on CPU tensors (the cache already appended).

    The split kernel alone, merging its own partials, where ``dispatch.FUSED_COMBINE_BY_DEFAULT`` says so now.
    """
    from lazytriton import compiler

    fused = decode_dispatch.FUSED_COMBINE_BY_DEFAULT
    split_c, combine_c = interpreter_constexprs(call, fused)
    splits = splits_for(call, split_c["BLOCK_M"], split_c["BLOCK_N"], INTERPRETER_SMS)
    part_out, part_lse = _partials(lse, call, splits)
    grid = split_grid(call.rows, split_c["BLOCK_M"], splits, call.heads_k, call.batch, call.packed_rows)
    tickets = _tickets(t.q, 0, grid, splits, own_counters) if fused and splits > 1 else None
    ints = split_ints(t, out, lse, part_out, part_lse, call, splits, pointers=lambda x: x, tickets=tickets)
    compiler.interpret(FLASH_DECODE_SPLIT.name, grid, (*ints, *floats(call)), split_c)
    if splits > 1 and not fused:
        compiler.interpret(FLASH_DECODE_COMBINE.name, combine_grid(call.lse_rows, INTERPRETER_COMBINE_M),
                           combine_ints(part_out, part_lse, out, lse, call, splits, pointers=lambda x: x,
                                        sinks=t.sinks), combine_c)


def forward(t: Inputs, call: Call, out: torch.Tensor | None = None, names: checks.Names = checks.KVCACHE,
            own_counters: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a checked call, after its index values are checked and k/v appended to the cache.

    The kernels on a GPU, the interpreter on the CPU, empty outputs on meta. ``out`` (checked:
    ``checks.check_out``): the caller's, written by the kernels where ``writes_into`` allows, else copied into.
    ``names``: the caller's names of the arguments, for the value checks' errors. ``own_counters``: the fused
    combine's counters are the call's own, kept by nobody (the torch op's calls: ``counters.py`` says why).
    """
    if values.values_checked(t):
        values.check_values(t, call, names)
    given = out
    if out is None or not writes_into(out):
        out, lse = empty_outputs(t.q, call)
    else:
        lse = empty_lse(t.q, call)
    if t.q.device.type != "meta":
        if call.qv:  # q as [qv | q], k_cache from the columns after v's (mla.py)
            t = mla.kernel_inputs(t, call)
        # Packed new keys' lengths come from the call's inputs, so they are computed before the append: the append
        # is the last launch before the split kernel, a rotary call's split kernel being its programmatic dependent.
        attend, attend_call = after_packed_append(t, call) if call.varlen_new else (t, call)
        kv_append.append(t, call)
        t, call = attend, attend_call
        if out.numel() and call.rows:
            if t.q.device.type == "cpu":
                run_interpreter(t, out, lse, call, own_counters=own_counters)
            else:
                launch_gpu(t, out, lse, call, own_counters=own_counters)
    if given is not None and given is not out:  # a layout the kernels do not write: one copy
        out = given.copy_(out)
    return out, lse
