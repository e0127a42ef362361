"""A call of a kernel described by its sizes and flags: what a family's choice of variant reads.

``kernels.dispatch.kernel_variant`` builds one ``Request`` from its keywords and gives it to the kernel's family
(``variant(kernel, target, request)`` in its ``dispatch``); ``lazytriton cache explain`` builds one from its
flags and asks ``kernels.dispatch.choice``. A leaf: the families and ``kernels.dispatch`` import it, it imports
only the record decorator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytriton.record import record

if TYPE_CHECKING:
    from lazytriton import tuning
    from lazytriton.tiles import Config


@record
class Request:
    """A call described by its sizes and flags, in ``kernels.dispatch.kernel_variant``'s order of arguments.

    ``seqlen_q``/``seqlen_k``: the attention kernels' seqlens (max_seqlen_q and
    max_seqlen_k with ``varlen``); the decoding kernels read them as query rows
    per key/value head (group size x seqlen_q) and the cache's length per
    sequence. ``aligned``: every pointer 16-byte aligned and every outer stride
    a multiple of 16 (ALIGN16); ``index64``: some tensor spans 2**31 elements
    or more. ``config`` None: the family's tuning table (``table``, else the
    kernel's file), then its default. The feature flags (``window``,
    ``softcap``, ``alibi``, ``bias``: SDPA's attn_mask, ``dropout``, ``paged``:
    a decoding call on a paged cache, ``varlen``: packed sequences) are written
    ``NAME=true`` in a variant only when set. ``head_dim_v``: v's head dim (0
    or ``head_dim``: the same). ``split_d``: split tiles
    (``kernels.attention.split_chunks``; None: the head dim's default). The
    families' own: flash_fwd's ``tma`` (None: its rule decides), the
    backward's ``seq16`` (None: from the seqlens as given), and the decoding
    kernels' ``page_size`` (a paged cache's keys a page, which BLOCK_N must
    divide, or, under ``flash_decode.dispatch.GATHER_BELOW``, whose keys are
    gathered one page at a time, PAGE_GATHER=true; 0: a contiguous cache, or with ``paged`` a page
    size every BLOCK_N divides, as prewarm plans them by default) and
    ``leftpad`` (a decoding call with cache_leftpad, LEFTPAD=true).
    ``rotary``/``rotary_interleaved``: a decoding call with rotary_cos and
    rotary_sin, rotating pairs or halves (ROTARY=true, ROTARY_INTERLEAVED=true
    on the split kernel and kv_append; ``rotary_interleaved`` counts only with
    ``rotary``).
    ``seqused_q``/``seqused_k``: a packed call (``varlen``) with
    FlashAttention-3's used lengths (SEQUSED_Q=true, SEQUSED_K=true), which
    only the Triton attention kernels take. ``sinks``: attention sinks (gpt-oss's:
    one logit a query head in every row's denominator, SINKS=true), which the
    forward kernels and the decoding kernels take. ``bias_grad``: a backward call
    with a bias (``bias``) whose gradient it also computes (BIAS_GRAD=true on
    flash_bwd_dq, the kernel that writes it; every other kernel of the call
    has the bias call's variant).
    forward kernels and the decoding kernels take. ``varlen_q``: a decoding call
    whose queries are packed by cu_seqlens_q (VARLEN_Q=true on the split kernel;
    ``seqlen_q`` then counts the longest sequence's rows). ``kv_fp8``: a decoding
    call's float8 cache (``e4m3``, ``e5m2``; KV_FP8 on the split kernel and
    kv_append), ``none`` for a cache of ``dtype``. ``slot64``: a
    slot-addressed cache write (kv_slots) whose slot_mapping is int64
    (SLOT64=true; false: int32). ``qv``: a decoding call with
    FlashAttention-3's qv (DeepSeek's MLA: the scores add qv . v; QV=true on the split kernel).
    ``key_mask``: a decoding call with lazytriton's per-(batch, key) boolean mask (KEY_MASK=true on the split
    kernel: a transformers decoding step's mask).
    ``kv_pairs``: a decoding call's (sequence, key/value head) pairs, batch x heads_k, which a float8 cache's split
    tiles follow (``flash_decode.dispatch.fp8_cuda_tile``; 0: the fewest).
    """

    dtype: str
    head_dim: int
    causal: bool
    aligned: bool
    seqlen_q: int
    seqlen_k: int
    config: Config | None = None
    index64: bool = False
    table: tuning.Table | None = None
    tma: bool | None = None
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    bias: bool = False
    dropout: bool = False
    paged: bool = False
    varlen: bool = False
    head_dim_v: int = 0
    split_d: bool | None = None
    seq16: bool | None = None
    page_size: int = 0
    leftpad: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    rotary: bool = False
    rotary_interleaved: bool = False
    sinks: bool = False
    bias_grad: bool = False
    varlen_q: bool = False
    chunk: bool = False
    kv_fp8: str = "none"
    slot64: bool = False
    qv: bool = False
    key_mask: bool = False
    kv_pairs: int = 0
