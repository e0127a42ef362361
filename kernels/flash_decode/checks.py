"""Checks of a ``flash_attn_with_kvcache`` call, before the cache append and the kernels that follow them.

``check`` turns the caller's tensors and options into one ``Call`` or raises
a ``TypeError``/``ValueError`` naming the argument, the value and what was
expected, reading shapes, dtypes and devices only; ``values.check_values``
then reads the index tensors' values. Both name the arguments as the public
function calls them (``Names``: flash_attn_with_kvcache's, or the paged form
of flash_attn_varlen_func's k, v and seqused_k). The append of the new keys
and values (``kernels/kv_append``) runs only after both checks.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from lazytriton.kernels.arguments import MAX_CHUNK, check_chunk, shown
from lazytriton.kernels.flash_decode import key_mask, mla
from lazytriton.record import NamedTuple

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Float8 caches (kv_fp8.py: the cache holds x / descale), read by queries of these dtypes.
KV_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
FP8_QUERY_DTYPES = (torch.float16, torch.bfloat16)
INT32_MAX = 2**31 - 1
MAX_GRID_YZ = 65535  # grid y (key/value heads) and z (batch) limits of CUDA and HIP
MAX_SPLITS = 256
MAX_WINDOWED_SEQLEN = 2**29  # with a window the kernel computes query + offset +- window in 32 bits
_is_compiling = torch.compiler.is_compiling
NO_WINDOW = (-1, -1)  # window_size's default: the public function's, so that the common call is an identity test


class Inputs(NamedTuple):
    """The tensors of a call (None where the caller gave none)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | int | None = None
    cache_batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None
    rotary_seqlens: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    qv: torch.Tensor | None = None
    cu_seqlens_k_new: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None  # lazytriton's own (batch, capacity) boolean mask (key_mask.py)


class Names(NamedTuple):
    """What a public function calls the caches and their lengths, for the errors of ``check`` and ``check_values``.

    ``flash_attn_with_kvcache``'s are the defaults (``KVCACHE``); ``flash_attn_varlen_func``'s paged form calls
    the caches k and v and their key counts seqused_k (``PAGED_VARLEN``). Every other argument has one name in
    both.
    """

    k_cache: str = "k_cache"
    v_cache: str = "v_cache"
    cache_seqlens: str = "cache_seqlens"


KVCACHE = Names()
PAGED_VARLEN = Names(k_cache="k (the paged cache)", v_cache="v (the paged cache)", cache_seqlens="seqused_k")


class Call(NamedTuple):
    """A checked call in the kernels' terms.

    ``capacity``: keys the cache holds per sequence (seqlen_cache, or
    max_blocks x page_size when paged); ``seqlen_const``: every sequence's
    cached length when cache_seqlens is an int or None (None: the whole
    cache), -1 when it is a tensor. The window is the kernels': (-1, -1) when
    off, else both sides bounded (an unbounded side is capacity + seqlen_q,
    which bounds nothing), right 0 when causal and windowed. ``causal`` is
    False for one query (bottom-right, one query sees every key: the mask
    hides nothing). ``leftpad``: a cache_leftpad tensor is given (each
    sequence's keys start there; positions stay absolute). ``rotary_dim``:
    the columns rotary_cos/rotary_sin rotate (0: no rotary), pairs
    (``rotary_interleaved``) or halves, over ``seqlen_ro`` positions from each
    sequence's base (its cache_seqlens, or its ``rotary_seqlens`` when that
    tensor is given); ``rotary_per_query``: query i sits at base + i (causal
    or a window, FlashAttention's rule), else every query at base. ``sinks``:
    attention sinks are given (float32 (heads_q,): one logit a query head in
    every row's denominator, joined once: with several splits in the merge).
    ``varlen_q``: queries packed by cu_seqlens_q (q (total_q, heads,
    head_dim), FlashAttention-3's): ``batch`` is then the number of
    sequences, ``seqlen_q`` max_seqlen_q (the grid's rows and the tiles) and
    ``total_q`` the packed rows. ``kv_fp8``: the caches' float8 format
    (``e4m3``, ``e5m2``; ``none``: q's dtype), read with ``k_descale`` and
    ``v_descale`` when given (1.0 when not). ``varlen_new``: the new keys packed
    by cu_seqlens_k_new (k (total_new, heads_k, head_dim), FlashAttention-3's):
    ``seqlen_new`` is then total_new, and sequence b appends its own count.
    """

    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    head_dim: int
    seqlen_new: int
    capacity: int
    page_size: int  # 0: a contiguous cache
    cache_rows: int  # k_cache.shape[0]: batch_cache, or num_blocks when paged
    seqlen_const: int
    causal: bool
    scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: bool = False
    num_splits: int = 0  # 0: the heuristic decides
    head_dim_v: int = 0  # v's head dim where it differs from q's and k's (0: the same)
    leftpad: bool = False
    rotary_dim: int = 0
    rotary_interleaved: bool = False
    seqlen_ro: int = 0
    rotary_per_query: bool = False
    rotary_seqlens: bool = False
    sinks: bool = False
    varlen_q: bool = False
    total_q: int = 0
    attention_chunk: int = 0  # FlashAttention-3's chunked local attention (CHUNK); 0: off
    kv_fp8: str = "none"  # the caches' float8 format (KV_FP8), or none: q's dtype
    qv: bool = False  # MLA's qv . v in the scores (QV; mla.py): head_dim is then q's without qv's columns
    varlen_new: bool = False  # new keys packed by cu_seqlens_k_new (seqlen_new: total_new)
    key_mask: bool = False  # a (batch, capacity) boolean mask of the keys each sequence sees (KEY_MASK; key_mask.py)

    @property
    def value_dim(self) -> int:
        """The head dim of v and out (head_dim_v, or head_dim when they are equal)."""
        return self.head_dim_v or self.head_dim

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_k

    @property
    def rows(self) -> int:
        """Query rows per key/value head, packed into the split kernel's M tile."""
        return self.group * self.seqlen_q

    @property
    def packed_rows(self) -> int | None:
        """Queries packed by cu_seqlens_q: every sequence's rows per key/value head (group x total_q); else None."""
        return self.group * self.total_q if self.varlen_q else None

    @property
    def out_batch(self) -> int:
        """The batch of out as the kernels index it: 1 for packed queries (one batch of total_q rows)."""
        return 1 if self.varlen_q else self.batch

    @property
    def out_seqlen(self) -> int:
        """The query rows of each batch of out and lse as the kernels index them: total_q for packed queries."""
        return self.total_q if self.varlen_q else self.seqlen_q

    @property
    def lse_rows(self) -> int:
        """The rows of lse (and of the combine kernel): batch x heads x seqlen_q, or heads x total_q."""
        return self.out_batch * self.heads_q * self.out_seqlen

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0

    @property
    def chunked(self) -> bool:
        return self.attention_chunk > 0

    @property
    def rotary(self) -> bool:
        return self.rotary_dim > 0

    @property
    def rotary_span(self) -> int:
        """How many positions from its base a sequence rotates: its new keys', and its queries' (one when shared)."""
        return max(self.seqlen_new, self.seqlen_q if self.rotary_per_query else min(self.seqlen_q, 1))


def _tensor(name: str, t: object, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims {what}, got shape {tuple(t.shape)}")
    return t


def _same_place(name: str, t: torch.Tensor, q: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on one device")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _data(name: str, t: object, q: torch.Tensor | None, what: str, dims: int = 4) -> torch.Tensor:
    t = _tensor(name, t, dims, what)
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if q is not None:
        _same_place(name, t, q)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def _int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return value


def _index(name: str, t: object, q: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    t = _tensor(name, t, len(shape), what)
    _same_place(name, t, q, torch.int32)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}, got {tuple(t.shape)}")
    return t


def check(t: Inputs, softmax_scale: Any = None, causal: Any = False, window_size: Any = NO_WINDOW,
          softcap: Any = 0.0, num_splits: Any = 0, rotary_interleaved: Any = True, max_seqlen_q: Any = None,
          attention_chunk: Any = 0, names: Names = KVCACHE) -> Call:
    """The checked call, or a TypeError/ValueError naming the argument (``names``: the caller's names)."""
    kn, vn = names.k_cache, names.v_cache
    if t.cu_seqlens_q is None and max_seqlen_q is None:
        q = _data("q", t.q, None, "(batch, seqlen_q, heads, head_dim)")
        b, sq, hq, d = q.shape
        total = b * sq
    else:
        q, b, sq, total = _packed(t, max_seqlen_q)
        hq, d = q.shape[1:]
    if q.device.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"q must be on a CUDA/ROCm GPU or on the CPU (interpreter), got {q.device}")
    kc = _cache(kn, t.k_cache, q, "(batch_cache or num_blocks, seqlen_cache or page_size, heads_k, head_dim)")
    vc = _cache(vn, t.v_cache, q, f"like {kn}, with its own head dim (head_dim_v)")
    if vc.dtype != kc.dtype:
        raise TypeError(f"{vn} has dtype {vc.dtype} but {kn} has {kc.dtype}; the two caches must have one dtype "
                        "(q's, or one float8 format)")
    if vc.shape[:3] != kc.shape[:3]:
        raise ValueError(f"{vn} must have {kn}'s first three dims {tuple(kc.shape[:3])} (its head dim may "
                         f"differ: head_dim_v), got {tuple(vc.shape)}")
    rows_c, s_c, hk, dk = kc.shape
    dv = int(vc.shape[3])
    if dk != d:
        raise ValueError(f"{kn} has head dim {dk} but q has head dim {d}")
    shared = mla.shared_cache(kc, vc)  # MLA's latent cache: v_cache = k_cache[..., :dv]
    mla.check_head_dims(d, dv, shared)
    if hk == 0 or hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of {kn} heads ({hk}) for GQA/MQA")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    page_size, capacity = _layout(t, q, b, rows_c, s_c, names)
    seqlen_new = _new_keys(t, q, b, hk, d, dv, names)
    mla.check_new_keys(kc, vc, t.k, t.v, shared)
    seqlen_const = _seqlens(t, q, b, capacity, page_size, 0 if t.cu_seqlens_k_new is not None else seqlen_new, names)
    if max(b, hk) > MAX_GRID_YZ or max(capacity + sq, total * hq, b * sq * hq, rows_c * max(s_c, 1),
                                       seqlen_new * hk) > INT32_MAX:
        raise ValueError(f"batch and heads_k must be <= {MAX_GRID_YZ} and lengths < 2**31; got q {tuple(q.shape)}, "
                         f"{kn} {tuple(kc.shape)}")
    scale = _scale(softmax_scale, d)
    splits = _int("num_splits", num_splits, 0, MAX_SPLITS)
    call = Call(b, hq, hk, sq, d, seqlen_new, capacity, page_size, rows_c, seqlen_const, causal and sq > 1, scale,
                num_splits=splits, head_dim_v=0 if dv == d else dv)
    if t.cu_seqlens_q is not None:
        call = call._replace(varlen_q=True, total_q=total)
    if t.cu_seqlens_k_new is not None:
        call = call._replace(varlen_new=True)
    if kc.dtype in KV_FP8 or t.k_descale is not None or t.v_descale is not None:
        call = _fp8(t, q, call, kc.dtype, kn)
    if not ((window_size is NO_WINDOW or (type(window_size) is tuple and all(type(w) is int for w in window_size)
                                         and window_size == NO_WINDOW))
            and type(softcap) is float and softcap == 0.0):
        call = _features(call, causal, window_size, softcap)  # the common call (neither) skips this
    if t.alibi_slopes is not None:
        slopes = t.alibi_slopes
        if not isinstance(slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
        _same_place("alibi_slopes", slopes, q, torch.float32)
        if tuple(slopes.shape) not in ((hq,), (b, hq)):
            raise ValueError(f"alibi_slopes must have shape ({hq},) or ({b}, {hq}), got {tuple(slopes.shape)}")
        call = call._replace(alibi=True)
    if t.cache_leftpad is not None:
        _index("cache_leftpad", t.cache_leftpad, q, (b,), "(batch,)")
        call = call._replace(leftpad=True)
    if t.sinks is not None:
        if not isinstance(t.sinks, torch.Tensor):
            raise TypeError(f"sinks must be a torch.Tensor or None, got {type(t.sinks).__name__}")
        _same_place("sinks", t.sinks, q, torch.float32)
        if tuple(t.sinks.shape) != (hq,):
            raise ValueError(f"sinks must have shape ({hq},) (one logit a query head of q), got "
                             f"{tuple(t.sinks.shape)}")
        call = call._replace(sinks=True)
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if t.rotary_cos is not None or t.rotary_sin is not None or t.rotary_seqlens is not None:
        call = _rotary(t, q, call, window_size, rotary_interleaved, names.cache_seqlens)
    if type(attention_chunk) is not int or attention_chunk != 0:
        call = _chunk(call, attention_chunk)
    if t.qv is not None or shared:
        call = mla.with_qv(call, t, q, softmax_scale, shared)
    if t.key_mask is not None:
        key_mask.check(t.key_mask, q, b, capacity, kn)
        call = call._replace(key_mask=True)
    return call


def check_out(out: Any, t: Inputs, call: Call, names: Names = KVCACHE) -> None:
    """Refuse an ``out`` (the caller's output tensor) of the wrong shape, dtype or device, or sharing memory.

    The kernels write out while they read q and the caches (and the append writes k and v into the caches), so
    out may share no byte with them, nor two of its own elements one byte (a stride of 0). A traced or meta
    tensor has no memory to compare: only its shape, dtype and device are checked.
    """
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    q = t.q
    want = (*q.shape[:-1], call.value_dim)
    if tuple(out.shape) != want:
        raise ValueError(f"out must have shape {want} (q's, with {names.v_cache}'s head dim), got {tuple(out.shape)}")
    if out.dtype != q.dtype or out.device != q.device:
        raise TypeError(f"out must be {q.dtype} on {q.device} (q's), got {out.dtype} on {out.device}")
    if type(out) is not torch.Tensor or out.device.type == "meta" or out.numel() == 0 or _is_compiling():
        return
    if _self_overlapping(out):
        raise ValueError(f"out has elements sharing memory (strides {out.stride()} for shape {tuple(out.shape)}): "
                         "each output element needs bytes of its own")
    for name, x in (("q", q), (names.k_cache, t.k_cache), (names.v_cache, t.v_cache), ("k", t.k), ("v", t.v),
                    ("key_mask", t.key_mask)):
        if type(x) is torch.Tensor and _shares_memory(out, x):
            raise ValueError(f"out shares memory with {name}: the kernels read {name} while they write out, so out "
                             "must not overlap it; pass an out of its own")


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: some stride below the reach of the dims of smaller ones."""
    reach = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride < reach:
            return True
        reach += stride * (size - 1)
    return False


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two tensors (first to last element) meet."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(x: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True))
        return x.data_ptr(), x.data_ptr() + (last + 1) * x.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _cache(name: str, t: object, q: torch.Tensor, what: str) -> torch.Tensor:
    """k_cache or v_cache: q's dtype, or a float8 format read by float16 or bfloat16 queries."""
    t = _tensor(name, t, 4, what)
    if t.dtype not in KV_FP8:
        return _data(name, t, q, what)
    if q.dtype not in FP8_QUERY_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16 with a float8 {name} ({t.dtype}), got {q.dtype}")
    _same_place(name, t, q)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def _fp8(t: Inputs, q: torch.Tensor, call: Call, cache_dtype: torch.dtype, k_cache: str) -> Call:
    """``call`` with its float8 cache's format, k_descale and v_descale checked (only a float8 cache takes them)."""
    if cache_dtype not in KV_FP8:
        name = "k_descale" if t.k_descale is not None else "v_descale"
        raise ValueError(f"{name} is given but {k_cache} is {cache_dtype}, not a float8 cache "
                         f"({', '.join(map(str, KV_FP8))}); descales apply to float8 caches only")
    shapes = ((), (1,), (call.heads_k,), (call.batch, call.heads_k))
    for name, descale in (("k_descale", t.k_descale), ("v_descale", t.v_descale)):
        if descale is None:
            continue
        if not isinstance(descale, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(descale).__name__}")
        _same_place(name, descale, q, torch.float32)
        if tuple(descale.shape) not in shapes:
            raise ValueError(f"{name} must have shape () or (1,) (per tensor), ({call.heads_k},) (per key/value "
                             f"head) or ({call.batch}, {call.heads_k}) (per sequence and head), got "
                             f"{tuple(descale.shape)}")
    return call._replace(kv_fp8=KV_FP8[cache_dtype])


def descale_strides(descale: torch.Tensor | None) -> tuple[int, int]:
    """(batch, head) strides of a descale as the kernels index it: 0 along a dim it does not have."""
    if descale is None or descale.dim() == 0 or tuple(descale.shape) == (1,):
        return 0, 0
    if descale.dim() == 1:
        return 0, descale.stride(0)
    return descale.stride(0), descale.stride(1)


def _chunk(call: Call, attention_chunk: object) -> Call:
    """``call`` with FlashAttention-3's attention_chunk checked (an int >= 0; 0: off), bottom-right as the window."""
    chunk = check_chunk("attention_chunk", attention_chunk)
    if chunk == 0:
        return call
    if call.capacity + call.seqlen_q >= MAX_WINDOWED_SEQLEN:
        raise ValueError(f"with attention_chunk set, the cache's length plus seqlen_q must be below "
                         f"{MAX_WINDOWED_SEQLEN}, got {call.capacity} + {call.seqlen_q}")
    return call._replace(attention_chunk=min(chunk, MAX_CHUNK))


def _packed(t: Inputs, max_seqlen_q: Any) -> tuple[torch.Tensor, int, int, int]:
    """(q, batch, max_seqlen_q, total_q) of queries packed by cu_seqlens_q (FlashAttention-3's varlen q)."""
    if t.cu_seqlens_q is None:
        raise ValueError(f"max_seqlen_q ({shown(max_seqlen_q)}) is read only with cu_seqlens_q (queries packed "
                         "(total_q, heads, head_dim)); pass both or neither")
    q = _data("q", t.q, None, "(total_q, heads, head_dim) with cu_seqlens_q", dims=3)
    cu = _tensor("cu_seqlens_q", t.cu_seqlens_q, 1, "(batch + 1,)")
    _same_place("cu_seqlens_q", cu, q, torch.int32)
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must have batch + 1 >= 2 entries (0, then each sequence's end in q), got "
                         f"shape {tuple(cu.shape)}")
    if max_seqlen_q is None:
        raise ValueError("cu_seqlens_q needs max_seqlen_q: the longest sequence's query count (it sizes the grid)")
    sq = _int("max_seqlen_q", max_seqlen_q, 0, INT32_MAX)
    return q, int(cu.shape[0]) - 1, sq, int(q.shape[0])


def _rotary(t: Inputs, q: torch.Tensor, call: Call, window: tuple[int, int], interleaved: bool,
            cache_seqlens: str) -> Call:
    """``call`` with FlashAttention's rotary embedding: the tables' shape, and the positions when they are known.

    As in FlashAttention, rotary needs new keys (the keys it rotates are the
    new ones) and queries sit at base + i when the call is causal or local
    (FlashAttention-2's rule: a window side bounded within the cache),
    else all at base. rotary_dim may be any even width up to the head dim
    (FlashAttention asks for a multiple of 16).
    """
    cos, sin = t.rotary_cos, t.rotary_sin
    if cos is None and sin is None:
        raise ValueError("rotary_seqlens needs rotary_cos and rotary_sin: it is the base of their positions")
    if cos is None or sin is None:
        raise ValueError(f"rotary_cos and rotary_sin must be given together, got only "
                         f"{'rotary_cos' if sin is None else 'rotary_sin'}")
    for name, table in (("rotary_cos", cos), ("rotary_sin", sin)):
        table = _tensor(name, table, 2, "(seqlen_ro, rotary_dim / 2)")
        _same_place(name, table, q)
        if table.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {table.dtype} but q has {q.dtype}; they must match")
        if not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {table.stride()}")
    if sin.shape != cos.shape:
        raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(cos.shape)} (seqlen_ro, rotary_dim / 2), "
                         f"got {tuple(sin.shape)}")
    seqlen_ro, half = (int(n) for n in cos.shape)
    if not 1 <= 2 * half <= call.head_dim:
        raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1]) must be in 2..{call.head_dim} (q's head dim), got "
                         f"{2 * half}")
    if seqlen_ro * half > INT32_MAX:
        raise ValueError(f"rotary_cos must have fewer than 2**31 elements, got shape {tuple(cos.shape)}")
    if t.k is None:
        raise ValueError("rotary_cos and rotary_sin need new keys (k and v): they rotate the new keys and q at the "
                         "new keys' positions (FlashAttention's rule); rotate q yourself for a call without them")
    left, right = window
    local = 0 <= left < call.capacity or 0 <= right < call.capacity
    call = call._replace(rotary_dim=2 * half, rotary_interleaved=interleaved, seqlen_ro=seqlen_ro,
                         rotary_per_query=call.seqlen_q > 1 and (call.causal or local),
                         rotary_seqlens=t.rotary_seqlens is not None)
    if t.rotary_seqlens is not None:
        _index("rotary_seqlens", t.rotary_seqlens, q, (call.batch,), "(batch,)")
    elif call.seqlen_const >= 0 and not call.varlen_new and call.seqlen_const + call.rotary_span > seqlen_ro:
        raise ValueError(f"rotary_cos has {seqlen_ro} positions (seqlen_ro) but the call rotates positions "
                         f"{call.seqlen_const}..{call.seqlen_const + call.rotary_span - 1} ({cache_seqlens} = "
                         f"{call.seqlen_const}): seqlen_ro must be at least {call.seqlen_const + call.rotary_span}")
    return call


def _layout(t: Inputs, q: torch.Tensor, b: int, rows_c: int, s_c: int, names: Names) -> tuple[int, int]:
    """(page_size, capacity): 0 and seqlen_cache for a contiguous cache, else the page and max_blocks x page."""
    if t.block_table is None:
        if t.cache_batch_idx is None:
            if rows_c != b:
                raise ValueError(f"{names.k_cache} has batch {rows_c} but q has batch {b}; pass cache_batch_idx to "
                                 "pick rows of a larger cache")
        else:
            _index("cache_batch_idx", t.cache_batch_idx, q, (b,), "(batch,)")
        return 0, s_c
    table = _tensor("block_table", t.block_table, 2, "(batch, max_blocks_per_seq)")
    _same_place("block_table", table, q, torch.int32)
    if t.cache_batch_idx is None:
        if table.shape[0] != b:
            raise ValueError(f"block_table has {table.shape[0]} rows but q has batch {b}; pass cache_batch_idx to "
                             "pick rows of a larger table")
    else:  # FlashAttention-3's: each sequence's row of the table (its blocks), any number of rows
        _index("cache_batch_idx", t.cache_batch_idx, q, (b,), "(batch,)")
        if table.shape[0] < 1:
            raise ValueError("block_table has no rows but cache_batch_idx picks rows of it")
    if s_c < 1:  # any size serves: pages not a multiple of 64 keys are read key by key (dispatch.page_gather)
        raise ValueError(f"with block_table, {names.k_cache}.shape[1] is the page size and must be >= 1 (keys a page), "
                         f"got {s_c}")
    return s_c, table.shape[1] * s_c


def _new_keys(t: Inputs, q: torch.Tensor, b: int, hk: int, d: int, dv: int, names: Names) -> int:
    """seqlen_new: the number of new keys per sequence (0 without k and v)."""
    if (t.k is None) != (t.v is None):
        raise ValueError("k and v must be given together (new keys and values) or both be None")
    if t.k is None:
        if t.cu_seqlens_k_new is not None:
            raise ValueError("cu_seqlens_k_new is given without k and v: it packs the new keys and values")
        return 0
    if t.cu_seqlens_k_new is not None:
        return _packed_new_keys(t, q, b, hk, d, dv, names)
    k = _data("k", t.k, q, "(batch, seqlen_new, heads_k, head_dim)")
    v = _data("v", t.v, q, "(batch, seqlen_new, heads_k, head_dim_v)")
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, hk, d):
        raise ValueError(f"k must have shape ({b}, seqlen_new, {hk}, {d}) (q's batch, the cache's heads and head "
                         f"dim), got {tuple(k.shape)}")
    if tuple(v.shape) != (b, k.shape[1], hk, dv):
        raise ValueError(f"v must have shape ({b}, {k.shape[1]}, {hk}, {dv}) (k's batch, seqlen_new and heads, and "
                         f"{names.v_cache}'s head dim), got {tuple(v.shape)}")
    if t.cache_seqlens is None:
        raise ValueError(f"k and v need {names.cache_seqlens}: the new keys are written at {names.cache_seqlens}")
    return int(k.shape[1])


def _packed_new_keys(t: Inputs, q: torch.Tensor, b: int, hk: int, d: int, dv: int, names: Names) -> int:
    """total_new: the new keys of every sequence packed by cu_seqlens_k_new (FlashAttention-3's), k and v 3-D."""
    k = _data("k", t.k, q, "(total_new, heads_k, head_dim) with cu_seqlens_k_new", dims=3)
    v = _data("v", t.v, q, "(total_new, heads_k, head_dim_v) with cu_seqlens_k_new", dims=3)
    if tuple(k.shape[1:]) != (hk, d):
        raise ValueError(f"k must have shape (total_new, {hk}, {d}) with cu_seqlens_k_new (the cache's heads and "
                         f"head dim), got {tuple(k.shape)}")
    if tuple(v.shape) != (k.shape[0], hk, dv):
        raise ValueError(f"v must have shape ({k.shape[0]}, {hk}, {dv}) (k's total_new and heads, and "
                         f"{names.v_cache}'s head dim), got {tuple(v.shape)}")
    _index("cu_seqlens_k_new", t.cu_seqlens_k_new, q, (b + 1,), "(batch + 1,)")
    if t.cache_seqlens is None:
        raise ValueError(f"k and v need {names.cache_seqlens}: the new keys are written at {names.cache_seqlens}")
    return int(k.shape[0])


def holds(capacity: int, page_size: int) -> str:
    """What bounds a sequence's keys, for the messages of lengths past it: the cache's rows or the block table's."""
    if not page_size:
        return f"the cache holds {capacity} keys per sequence"
    return (f"block_table's {capacity // page_size} pages of {page_size} keys hold {capacity} keys per sequence")


def _seqlens(t: Inputs, q: torch.Tensor, b: int, capacity: int, page_size: int, seqlen_new: int,
             names: Names) -> int:
    """seqlen_const (every sequence's cached length when not a tensor; -1 for a tensor)."""
    lens = t.cache_seqlens
    if lens is None:
        return capacity
    if isinstance(lens, torch.Tensor):
        _index(names.cache_seqlens, lens, q, (b,), "(batch,)")
        return -1
    if isinstance(lens, bool) or not isinstance(lens, int):
        raise TypeError(f"{names.cache_seqlens} must be an int, an int32 tensor of shape (batch,) or None, got "
                        f"{type(lens).__name__}")
    if not 0 <= lens <= capacity - seqlen_new:
        raise ValueError(f"{names.cache_seqlens} must be in 0..{capacity - seqlen_new} "
                         f"({holds(capacity, page_size)}, {seqlen_new} of them new), got {lens}")
    return lens


def _scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"softmax_scale must be a finite float or None, got {shown(scale)}")
    return float(scale)


def _features(call: Call, causal: bool, window: object, softcap: object) -> Call:
    """``call`` with FlashAttention-2's window (causal: right = 0) and softcap in the kernels' terms."""
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {shown(window)}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window_size sizes must be -1 (unbounded) or >= 0, got {tuple(window)!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite float >= 0 (0 is off), got {softcap!r}")
    call = call._replace(softcap=float(softcap))
    if causal:
        right = 0
    if left < 0 and (right < 0 or causal):  # no window beyond the causal mask
        return call
    full = call.capacity + call.seqlen_q  # reaches every key from every query: no bound
    if full >= MAX_WINDOWED_SEQLEN:
        raise ValueError(f"with window_size set, the cache's length plus seqlen_q must be below {MAX_WINDOWED_SEQLEN}, "
                         f"got {full}")
    return call._replace(window_left=min(left, full) if left >= 0 else full,
                         window_right=min(right, full) if right >= 0 else full)
