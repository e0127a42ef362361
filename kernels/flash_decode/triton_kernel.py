"""Split-KV decoding attention in Triton: the two kernels of ``flash_decode``.

This file is the source fingerprint of both kernels, so everything they call
lives here, but for the rotary embedding the split kernel shares with
kv_append (``kernels/rotary.py``, its helper: in its fingerprint too). It
imports triton: only ``lazytriton.compiler`` may import it.

Layout is FlashAttention-2's kvcache one: q and out (B, Sq, Hq, D); the cache
either contiguous (B_cache, S_cache, Hk, D), row ``BatchIdx[b]`` (or b) for
batch b, or paged (num_blocks, page_size, Hk, D), key position p of batch b
at row ``p % page_size`` of block ``BlockTable[r, p // page_size]``, r =
``BatchIdx[b]`` (or b) (``PAGED=true``). New keys are already in the cache when these kernels run
(the binding appends them first): batch b has ``len_b = Seqlens[b] +
seqlen_new`` keys (``seqlen_const + seqlen_new`` without a Seqlens tensor).

``flash_decode_split_kernel``: one program per (query-row block, split) x
key/value head x batch. Its M rows pack the query heads of the GQA group
times the queries, row r = i * group_size + g (query i, head kv_head *
group_size + g), so one K/V tile load serves the whole group: with one query
and 32/8 heads, 4 of a 16-row tile. The keys the rows can see form one range,
cut in ``num_splits`` chunks of whole BLOCK_N blocks from the length of this
batch's own range (never from the cache's capacity, so a short sequence in a
long cache spreads over every split). With ``PAGED`` a block starts at a
multiple of BLOCK_N, which divides page_size: a block never straddles pages.
Pages BLOCK_N does not divide (smaller, or not a multiple of it) take
``PAGE_GATHER`` too: each key of a block finds its own page in the table
(a vector load, masked to the keys the rows may see, so a table entry of a
page the sequence does not use is never read).
One split writes out and the natural-log logsumexp straight to Out and Lse;
several write float32 partials (out normalised by its own sum, and its lse in
base 2) to OutPart/LsePart for the combine kernel.

Visibility is FlashAttention-2's, aligned bottom-right per batch (offset =
len_b - Sq): key j is seen by query i when j < len_b, with ``LEFTPAD`` when
j >= ``LeftPad[b]`` (the cache's first key: cache_leftpad), with ``CAUSAL``
when j <= i + offset, and with ``WINDOW`` when i + offset - window_left <= j
<= i + offset + window_right (the binding bounds an unbounded side), and with
``CHUNK`` (FlashAttention-3's ``attention_chunk``) when j lies in the chunk of
``attention_chunk`` keys that holds i + offset; whole key blocks outside every
row's chunk are skipped. With ``LEFTPAD`` the chunks count from the cache's
first key, LeftPad[b] (FlashAttention-3 shifts the keys by the pad, so its
chunk boundaries are relative to it; every other bound is unmoved by a shift).
``SOFTCAP`` caps the scaled scores (softcap * tanh(s / softcap)), then
``ALIBI`` adds -slope * |i + offset - j| (slopes float32, (Hq,) or (B, Hq)
through ``stride_ab`` 0 or Hq): FlashAttention-2's order. A query that sees
no key gets output 0 and logsumexp -inf.

``ROTARY`` rotates each row's query as it is loaded (``rotary.rotate``:
FlashAttention's rotary embedding of its first ``rotary_dim`` columns,
``ROTARY_INTERLEAVED`` pairs or halves) at position base + i with
``rotary_per_query``, else base (every query), base = ``RotarySeqlens[b]``
with ``use_rotary_seqlens``, else the cached length len_b - seqlen_new (the
new keys were rotated at the same positions by ``kv_append``). Under
``PDL`` the split kernel waits for its stream predecessor's writes
(``gdc_wait``) before it reads anything: launched as that kernel's
programmatic dependent (``DEPENDENT_SPLIT``) it may have started before they
landed; launched plainly the wait returns at once. A rotary split kernel,
always launched right after kv_append as its dependent, waits after the
rotation, before its first key.
``SINKS`` (attention sinks: gpt-oss's, FlashAttention-3 forks' ``s_aux``)
reads each query head's float32 sink logit from ``Sinks``: it joins the
row's denominator and lse once and adds no value, a raw logit beside the
scaled (capped, ALiBi-biased) scores. With one split the split kernel adds it
in its epilogue (``_with_sink``); with several, the splits' partials leave
it out and the combine kernel counts it once, as one more partial of lse =
the sink and out 0. A query that sees no key then gets out 0 and lse = its
sink.

``VARLEN_Q`` packs the queries as FlashAttention's varlen calls do (vLLM's
mixed batch of prefills and decodes in one call): batch b's are rows
``CuSeqlensQ[b]`` .. ``CuSeqlensQ[b + 1] - 1`` of q and out (stride_qb and
stride_ob 0) and of each head's lse, (heads, seqlen_q) with seqlen_q the
packed total; its own count aligns its causal mask, window and ALiBi
bottom-right. The sequences' row blocks are flattened over the grid
(``split_grid``: about total rows / BLOCK_M + one a sequence, not the longest
sequence's count for each), each program finding its sequence in
CuSeqlensQ; a block past its sequence's rows reads no key and writes
nothing. The combine kernel sees them as one batch of seqlen_q queries.

``KV_FP8`` (``e4m3`` or ``e5m2``; ``none``, a cache of q's dtype) reads a
float8 cache (``flash_decode.kv_fp8``: it holds k / k_descale and v /
v_descale): K and V point at float8 bytes, which each tile converts to
float16 in registers (exactly: both formats fit in float16), so the loop
reads half the bytes of a 16-bit cache. Both dots then run in float16, for
bfloat16 queries too: sm_90 converts a pair of float8 values to float16 in
one instruction (``cvt.rn.f16x2.e4m3x2``) and to bfloat16 only through
float16, one more instruction an element and its moves (the PTX of the
contiguous e4m3 split kernel at head dim 128: 8,088 instructions against
10,903 with bfloat16 dots, Triton 3.9; 8,229 against 11,047 with 3.6). The
query (and qv) is scaled once by the power of two that brings its largest
magnitude into [2**13, 2**14): a bfloat16 element within 2**27 of the
largest is then exact in float16 (smaller ones round in its subnormals). P
is scaled by 2**15 before it is rounded to float16 (float16's normal range
then holds P down to 2**-29, with 11 significant bits to bfloat16's 8).
Both scales are undone in float32, exactly. The sequence's key/value
head's k_descale (``KDescale`` at batch x ``stride_kdb`` + head x
``stride_kdh``: per tensor, per head or per (batch, head) through the
strides; 1.0 without ``use_k_descale``) joins the softmax scale, and its
v_descale multiplies the accumulator once, after the loop.

``QV`` (FlashAttention-3's ``qv``, DeepSeek's MLA) adds qv . v to every
score: each row of Q holds head_dim_v columns of qv, then head_dim of the
query (the binding lays q out so: MLA's cache form, q = [q_nope | q_pe]
against a cache whose first head_dim_v columns are v, is that layout as
given), so S = (q . k + qv . v) x sm_scale. The V tile loaded for P . V
serves the qv product too: each key's bytes are read once.

``KEY_MASK`` (lazytriton's own, for SDPA's boolean (batch, 1, 1, kv_len)
mask of a decoding step: ``key_mask.py``) reads one byte a (batch, key) from
``KeyMask`` at batch x ``stride_mb`` + key x ``stride_mn``, per key tile: a
key whose byte is 0 gets score -inf before the row's max (after the cap and
ALiBi, as SDPA's boolean mask after eager's cap), for every query row and
head of the batch. A row whose keys are all masked gets what a query that
sees no key gets: out 0 and lse -inf (with a sink: lse the sink), which is
PyTorch's SDPA's output for a fully masked row (0). A masked key's K and V
are still read (a NaN there reaches the output, as in SDPA).

``FUSED_COMBINE`` merges the splits in this kernel, one launch instead of
two: with several splits, each program writes its partial as above, then takes
a ticket from its (batch, key/value head, query-row block)'s int32 counter in
``Counters`` (zero before the call); the program that takes the last one
merges the block's rows as ``flash_decode_combine_kernel`` does (``_merge``,
one row at a time, its splits as many a step as the combine kernel's at that
value head dim), writes Out and Lse, and puts the counter back to 0. No
program returns early (a split with no keys stores lse -inf), so each takes
its ticket.

``flash_decode_combine_kernel``: one program per BLOCK_M rows of the
flattened (batch, query head, query) rows, in one pass over the splits,
BLOCK_N of them a step: a step loads those splits' lse and outputs together
(a [BLOCK_M, BLOCK_N, BLOCK_D] tile), so a row's splits are read in one
round trip when BLOCK_N covers them, and keeps the running max of the lse,
the sum of exp(lse_s - max) and the outputs weighted by it (both rescaled
when the max grows); out = that weighted sum over the total, lse = max +
log(total) (``_merge``, which the fused combine shares).
"""

import triton
import triton.language as tl

from lazytriton.kernels.chunk import chunk_start
from lazytriton.kernels.rotary import rotate

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# A float8 cache's dots run in float16 (KV_FP8): P is scaled by P_SCALE before it is rounded to float16 (P <= 1,
# so P x 2**15 < 65504), and the query by the power of two that brings its largest magnitude to [2**13, 2**14).
P_SCALE = tl.constexpr(32768.0)  # 2**15
Q_TOP = tl.constexpr(13)


@triton.jit
def _tanh(x):
    """The hyperbolic tangent through exp2 (exactly +-1 for large |x|): no libdevice, so the interpreter runs it."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _key_range(i_lo, i_hi, length, offset, window_left, window_right, leftpad, attention_chunk, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr, LEFTPAD: tl.constexpr, CHUNK: tl.constexpr):
    """(begin, end) of the keys queries i_lo..i_hi see: ``begin`` a multiple of BLOCK_N.

    Blocks from ``begin`` to ``end`` hold every key some row sees. With
    ``LEFTPAD`` no key before ``leftpad`` is seen: the blocks before the one
    holding it are skipped. With ``CHUNK`` the keys lie in the chunks of
    queries i_lo..i_hi (``chunk.chunk_start``; with ``LEFTPAD`` counted from
    the pad).
    """
    end = length
    if CAUSAL:
        end = tl.minimum(end, tl.maximum(i_hi + offset + 1, 0))
    begin = length * 0
    if WINDOW:
        end = tl.minimum(end, tl.maximum(i_hi + offset + window_right + 1, 0))
        begin = tl.maximum(i_lo + offset - window_left, 0)
    if CHUNK:
        if LEFTPAD:  # chunks count from the cache's first key, as FlashAttention-3's do
            first = chunk_start(i_lo + offset - leftpad, attention_chunk) + leftpad
            last = chunk_start(i_hi + offset - leftpad, attention_chunk) + leftpad
        else:
            first = chunk_start(i_lo + offset, attention_chunk)
            last = chunk_start(i_hi + offset, attention_chunk)
        end = tl.minimum(end, tl.maximum(last + attention_chunk, 0))
        begin = tl.maximum(begin, first)
    if LEFTPAD:
        begin = tl.maximum(begin, leftpad)
    begin = (begin // BLOCK_N) * BLOCK_N
    end = tl.maximum(end, begin)
    return begin, end


@triton.jit
def _attend(acc, l_i, m_i, q, qv, K, V, BlockTable, k_base, v_base, start_n, offs_n, offs_d, offs_dv, rows_i, slopes,
            length, offset, head_dim, head_dim_v, page_size, stride_ks, stride_vs, stride_kb, stride_vb,
            window_left, window_right, qk_scale, cap, leftpad, attention_chunk, key_mask, stride_mn,
            EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PAGED: tl.constexpr,
            CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
            IEEE: tl.constexpr, LEFTPAD: tl.constexpr, PAGE_GATHER: tl.constexpr, CHUNK: tl.constexpr,
            QV: tl.constexpr, KEY_MASK: tl.constexpr, F16: tl.constexpr, NV_CVT: tl.constexpr):
    """One step of the online softmax over keys [start_n, start_n + BLOCK_N) (scores in base 2).

    Every step masks its keys and scores. A split reads a few blocks at decoding's shapes: one loop of masked
    steps takes 4.2 µs against 6.2 for three loops (masked head, unmasked body, masked tail, each pipelined
    apart) at batch 1 with 1k keys and 16 splits (H100, ``experiments/probe_split_variants.py``), and a whole
    block's mask costs ~2% of the unmasked step.

    The tiles are converted to q's dtype as they are loaded (a no-op for a cache of q's dtype; float16 for a
    float8 cache, whose q the kernel scaled into float16). With ``F16`` (a float8 cache) P . V takes P x
    P_SCALE: the accumulator is that much larger, and l_i is not.
    With ``QV`` the scores add ``qv`` . v (the V tile of P . V). With ``KEY_MASK`` a key whose byte at
    ``key_mask`` + key x ``stride_mn`` is 0 scores -inf.
    """
    cols = start_n + offs_n
    if PAGE_GATHER:  # the block spans pages: each key's page (only those of keys in [leftpad, length) are read)
        blocks = tl.load(BlockTable + cols // page_size, mask=(cols < length) & (cols >= leftpad), other=0)
        rows = cols % page_size
        k_ptrs = K + blocks[None, :] * stride_kb + k_base + rows[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = V + blocks[:, None] * stride_vb + v_base + rows[:, None] * stride_vs + offs_dv[None, :]
    elif PAGED:
        block = tl.load(BlockTable + start_n // page_size)
        rows = (start_n % page_size) + offs_n
        k_ptrs = K + block * stride_kb + k_base + rows[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = V + block * stride_vb + v_base + rows[:, None] * stride_vs + offs_dv[None, :]
    else:
        k_ptrs = K + k_base + cols[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = V + v_base + cols[:, None] * stride_vs + offs_dv[None, :]
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < head_dim_v
    col_ok = cols < length
    if LEFTPAD:  # the pad before the cache's first key is never read (it may hold anything)
        col_ok = col_ok & (cols >= leftpad)
    if EVEN_D:
        k = tl.load(k_ptrs, mask=col_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    if EVEN_DV:
        v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
    k = k.to(q.dtype)
    if F16 and NV_CVT:
        v = _float8_to_float16(v)
    else:
        v = v.to(q.dtype)
    if IEEE:
        qk = tl.dot(q, k, input_precision="ieee")
        if QV:
            qk = tl.dot(qv, tl.trans(v), qk, input_precision="ieee")
    else:
        qk = tl.dot(q, k)
        if QV:
            qk = tl.dot(qv, tl.trans(v), qk)
    qk = qk * qk_scale
    if SOFTCAP:
        qk = _tanh(qk) * cap
    diag = rows_i[:, None] + offset  # the key each row's query sits on
    if ALIBI:
        qk = qk - (slopes * LOG2E)[:, None] * tl.abs(diag - cols[None, :]).to(tl.float32)
    keep = col_ok[None, :] & (rows_i >= 0)[:, None]
    if CAUSAL:
        keep = keep & (cols[None, :] <= diag)
    if WINDOW:
        keep = keep & (cols[None, :] >= diag - window_left) & (cols[None, :] <= diag + window_right)
    if CHUNK:
        if LEFTPAD:
            first = chunk_start(diag - leftpad, attention_chunk) + leftpad
        else:
            first = chunk_start(diag, attention_chunk)
        keep = keep & (cols[None, :] >= first) & (cols[None, :] < first + attention_chunk)
    if KEY_MASK:  # one byte a key of this batch: 0 is masked (SDPA's boolean mask, the same for every row)
        keep = keep & (tl.load(key_mask + cols * stride_mn, mask=cols < length, other=0) != 0)[None, :]
    qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with no visible key so far keeps m = -inf; subtract 0 instead (no NaN from -inf - -inf).
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    elif F16:
        acc = tl.dot((p * P_SCALE).to(tl.float16), v, acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _float8_to_float16(x):
    """A float8 tile (float8e4nv or float8e5) as float16, converted in the layout it was loaded in (sm_89+ PTX).

    P . V reads V's operand pairs along the keys, which lie a row apart: given Triton's own conversion, the
    compiler moves it after the shared-memory load into the dot's layout, and gathers V's bytes one by one
    (``ld.shared.b8``, then packs them). An inline conversion that may not be moved (``is_pure=False``) keeps
    it in the load's layout, 16 bytes a thread: the float16 tile then reaches the dot through ``ldmatrix
    .trans`` as a 16-bit cache's does (the contiguous e4m3 split kernel at head dim 128: 5,197 PTX
    instructions against 8,088, Triton 3.9).
    """
    bytes4 = x.to(tl.uint8, bitcast=True)  # four a 32-bit register: two pairs, one instruction each
    if x.dtype == tl.float8e4nv:
        y = tl.inline_asm_elementwise("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                      "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                                      "=r,=r,r", [bytes4], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = tl.inline_asm_elementwise("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                      "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
                                      "=r,=r,r", [bytes4], dtype=tl.float16, is_pure=False, pack=4)
    return y


@triton.jit
def _descale(Descale, offset, given):
    """A float8 cache's descale at ``offset`` when ``given`` (else 1.0; the pointer is then any valid float32)."""
    return tl.where(given != 0, tl.load(Descale + offset), 1.0)


@triton.jit
def _with_sink(m_i, l_i, sink):
    """The epilogue's (divisor of acc, base-2 lse) with the sink logit ``sink`` (natural log) in the denominator.

    flash_fwd's rule: the divisor is the whole denominator in m_i's terms,
    l / alpha, never NaN (inf, so out 0, where alpha underflows or the row has
    neither a key nor a sink, whose lse is -inf).
    """
    sink2 = sink * LOG2E
    m_f = tl.maximum(m_i, sink2)
    m_sub = tl.where(m_f == float("-inf"), 0.0, m_f)
    alpha = tl.math.exp2(m_i - m_sub)
    l_f = l_i * alpha + tl.math.exp2(sink2 - m_sub)
    none = l_f == 0.0
    lse2 = tl.where(none, float("-inf"), m_f + tl.math.log2(tl.where(none, 1.0, l_f)))
    return tl.where(none, 1.0, l_f) / alpha, lse2


@triton.jit
def _packed_sequence(block, CuSeqlensQ, n_seqs, group_size, BLOCK_M: tl.constexpr):
    """(sequence, its first packed query, its first row block) of flattened row block ``block`` (``VARLEN_Q``).

    Packed queries' row blocks are flattened over the grid (``split_grid``): sequence b's blocks start at
    cu_seqlens_q[b] x group_size // BLOCK_M + b, which leaves it at least cdiv(its rows, BLOCK_M) of them, so a
    one-query sequence beside a long prefill takes one or two programs, not the prefill's count. The sequence is
    the number of b in 1..n_seqs whose first block is at or before ``block`` (vector loads of SEARCH entries of
    cu_seqlens_q at a time); a block past the last sequence's gets that sequence and no rows of it.
    """
    SEARCH: tl.constexpr = 128
    count = block * 0
    for s0 in range(1, n_seqs + 1, SEARCH):
        idx = s0 + tl.arange(0, SEARCH)
        ok = idx <= n_seqs
        firsts = tl.load(CuSeqlensQ + idx, mask=ok, other=0) * group_size // BLOCK_M + idx
        count += tl.sum((ok & (firsts <= block)).to(tl.int32), 0)
    seq = tl.minimum(count, n_seqs - 1)
    q_start = tl.load(CuSeqlensQ + seq)
    return seq, q_start, q_start * group_size // BLOCK_M + seq


@triton.jit
def flash_decode_split_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart, Seqlens, BatchIdx, BlockTable, Alibi, LeftPad, RotaryCos, RotarySin,
    RotarySeqlens, Sinks, CuSeqlensQ, KDescale, VDescale, KeyMask, Counters,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_tb, stride_ab, stride_kdb, stride_kdh, stride_vdb, stride_vdh, stride_mb, stride_mn,
    group_size, heads_q, seqlen_q, head_dim, head_dim_v, seqlen_const, seqlen_new, use_seqlens, use_batch_idx,
    page_size, num_splits, window_left, window_right, attention_chunk, rotary_dim, seqlen_ro, use_rotary_seqlens,
    rotary_per_query, use_k_descale, use_v_descale, sm_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
    CAUSAL: tl.constexpr, PAGED: tl.constexpr = False, WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, LEFTPAD: tl.constexpr = False,
    PAGE_GATHER: tl.constexpr = False, ROTARY: tl.constexpr = False, ROTARY_INTERLEAVED: tl.constexpr = False,
    SINKS: tl.constexpr = False, VARLEN_Q: tl.constexpr = False, CHUNK: tl.constexpr = False,
    KV_FP8: tl.constexpr = "none", QV: tl.constexpr = False, KEY_MASK: tl.constexpr = False,
    FUSED_COMBINE: tl.constexpr = False,
    NV_CVT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    if PDL:  # the combine kernel may launch now: it waits for this grid's memory before it reads the partials
        tl.extra.cuda.gdc_launch_dependents()
        if not ROTARY:  # its stream predecessor's dependent (DEPENDENT_SPLIT): nothing read before that grid's memory
            tl.extra.cuda.gdc_wait()
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    row_block = tl.program_id(0) // num_splits  # of this program's sequence; VARLEN_Q: of the flattened blocks
    q_start = 0
    if VARLEN_Q:  # packed queries: this sequence's are rows q_start.. of q, out and lse (seqlen_q: all of them)
        row_block += tl.program_id(2) * (tl.num_programs(0) // num_splits)
        batch, q_start, first_block = _packed_sequence(row_block, CuSeqlensQ, tl.num_programs(2), group_size,
                                                       BLOCK_M)
        start_m = (row_block - first_block) * BLOCK_M
    else:
        start_m = row_block * BLOCK_M
        batch = tl.program_id(2)
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32
    if KV_FP8 == "e4m3":  # the description types K and V as q's dtype: the bytes are float8
        K = K.to(tl.pointer_type(tl.float8e4nv))
        V = V.to(tl.pointer_type(tl.float8e4nv))
    elif KV_FP8 == "e5m2":
        K = K.to(tl.pointer_type(tl.float8e5))
        V = V.to(tl.pointer_type(tl.float8e5))

    seqlen_b = seqlen_q
    if VARLEN_Q:
        seqlen_b = tl.load(CuSeqlensQ + batch + 1) - q_start
    n_rows = seqlen_b * group_size
    offs_r = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_r < n_rows
    rows_i = tl.where(row_ok, offs_r // group_size, -1)  # the query of each row (-1: padding)
    heads = kv_head * group_size + offs_r % group_size
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < head_dim_v

    q_rows = Q + batch * stride_qb + (q_start + rows_i) * stride_qs + heads * stride_qh
    if QV:  # each row is [qv | q]: qv's head_dim_v columns, then the query's
        if EVEN_DV:
            qv = tl.load(q_rows[:, None] + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
        else:
            qv = tl.load(q_rows[:, None] + offs_dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        q_rows = q_rows + head_dim_v
    q_ptrs = q_rows[:, None] + offs_d[None, :]
    if EVEN_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if not QV:
        qv = q  # unread

    if use_seqlens != 0:
        length = tl.load(Seqlens + batch) + seqlen_new
    else:
        length = seqlen_const + seqlen_new
    if ROTARY:
        base = length - seqlen_new
        if use_rotary_seqlens != 0:
            base = tl.load(RotarySeqlens + batch)
        q = rotate(q, q_rows, row_ok, base + rows_i * rotary_per_query, offs_d, RotaryCos, RotarySin, rotary_dim,
                   seqlen_ro, ROTARY_INTERLEAVED)
    if KV_FP8 != "none":  # the dots run in float16: q (and qv) x 2**q_shift, exactly, within float16's range
        q_top = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        if QV:
            q_top = tl.maximum(q_top, tl.max(tl.max(tl.abs(qv.to(tl.float32)), 1), 0))
        q_shift = tl.minimum(tl.maximum(Q_TOP - tl.floor(tl.math.log2(q_top)), -100.0), 100.0)  # q = 0: 100
        q_scale = tl.math.exp2(q_shift)
        q = (q.to(tl.float32) * q_scale).to(tl.float16)
        qv = (qv.to(tl.float32) * q_scale).to(tl.float16)
    offset = length - seqlen_b
    k_base = kv_head * stride_kh
    v_base = kv_head * stride_vh
    cache_row = batch  # the sequence's cache row, or with PAGED its row of the block table
    if use_batch_idx != 0:
        cache_row = tl.load(BatchIdx + batch)
    if not PAGED:
        k_base += cache_row * stride_kb
        v_base += cache_row * stride_vb
    table = BlockTable + cache_row * stride_tb
    key_mask = KeyMask + batch * stride_mb  # this batch's bytes (KEY_MASK; unread without it)
    slopes = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        slopes = tl.load(Alibi + batch * stride_ab + heads, mask=row_ok, other=0.0)
    if SOFTCAP:
        qk_scale = sm_scale / softcap
        cap = softcap * LOG2E
    else:
        qk_scale = sm_scale * LOG2E
        cap = qk_scale
    if KV_FP8 != "none":  # the cache holds k / k_descale: the descale joins the scale (cap keeps the caller's),
        # and q's power of two leaves it
        qk_scale = qk_scale * _descale(KDescale, batch * stride_kdb + kv_head * stride_kdh, use_k_descale) / q_scale

    leftpad = length * 0
    if LEFTPAD:
        leftpad = tl.load(LeftPad + batch)
    i_lo = start_m // group_size
    i_hi = (tl.minimum(start_m + BLOCK_M, n_rows) - 1) // group_size
    begin, end = _key_range(i_lo, i_hi, length, offset, window_left, window_right, leftpad, attention_chunk, BLOCK_N,
                            CAUSAL, WINDOW, LEFTPAD, CHUNK)
    if VARLEN_Q:  # a block past its sequence's rows reads no key
        end = tl.where(start_m < n_rows, end, begin)
    # This split's chunk: whole blocks, the range cut evenly in num_splits.
    n_blocks = (end - begin + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + num_splits - 1) // num_splits
    lo = begin + split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if PDL and ROTARY:  # kv_append's dependent: its new keys are in the cache after this
        tl.extra.cuda.gdc_wait()
    for start_n in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, qv, K, V, table, k_base, v_base, start_n, offs_n, offs_d, offs_dv,
                                rows_i, slopes, length, offset, head_dim, head_dim_v, page_size, stride_ks,
                                stride_vs, stride_kb, stride_vb, window_left, window_right, qk_scale, cap, leftpad,
                                attention_chunk, key_mask, stride_mn, EVEN_D, EVEN_DV, PAGED, CAUSAL, WINDOW,
                                SOFTCAP, ALIBI, IEEE, LEFTPAD, PAGE_GATHER, CHUNK, QV, KEY_MASK,
                                KV_FP8 != "none", NV_CVT)

    if KV_FP8 != "none":  # the cache holds v / v_descale; P . V took P x P_SCALE
        acc = acc * (_descale(VDescale, batch * stride_vdb + kv_head * stride_vdh, use_v_descale)
                     / P_SCALE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))  # base 2
    if VARLEN_Q:
        lse_rows = heads * seqlen_q + q_start + rows_i  # (head, packed query): FlashAttention's varlen lse
    else:
        lse_rows = (batch * heads_q + heads) * seqlen_q + rows_i  # (batch, head, query), contiguous
    if num_splits == 1:
        if SINKS:  # one split: the sink joins here (with several, in the combine kernel)
            div, lse2 = _with_sink(m_i, l_i, tl.load(Sinks + heads, mask=row_ok, other=0.0))
            out = acc / div[:, None]
        o_rows = Out + batch * stride_ob + (q_start + rows_i) * stride_os + heads * stride_oh
        o_ptrs = o_rows[:, None] + offs_dv[None, :]
        if EVEN_DV:  # a mask constant along the row: 16-byte stores
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(Lse + lse_rows, lse2 * LN2, mask=row_ok)
    else:
        part = lse_rows * num_splits + split
        if EVEN_DV:  # head_dim_v is BLOCK_DV: no column mask (still 4-byte stores: OutPart's alignment is
            # not among the description's aligned parameters)
            tl.store(OutPart + part[:, None] * BLOCK_DV + offs_dv[None, :], out, mask=row_ok[:, None])
        else:
            tl.store(OutPart + part[:, None] * head_dim_v + offs_dv[None, :], out,
                     mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(LsePart + part, lse2, mask=row_ok)
        if FUSED_COMBINE:  # every program gets here (none returns early), so each takes its ticket
            # The CTA's partial stores, then one ticket: the barrier orders every thread's stores before it, the
            # atomic's release (acq_rel, gpu scope) publishes them, and its acquire, for the last ticket, sees every
            # other program's. Triton 3.6 and 3.9 lower it to bar.sync, then one thread's
            # atom.global.gpu.acq_rel.add.u32, its result broadcast through shared memory after a bar.sync (sm_90,
            # sm_80; gfx942: buffer_wbl2 sc1, global_atomic_add, buffer_inv sc1), and the merge's loads to
            # ld.global.cg (gfx942: nt loads): experiments/ptx_fused_combine.py prints them.
            tl.debug_barrier()
            counter = Counters + ((tl.program_id(2) * tl.num_programs(1) + kv_head)
                                  * (tl.num_programs(0) // num_splits) + tl.program_id(0) // num_splits)
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:  # the last of the row block's programs: merge, and leave the counter 0
                tl.store(counter, 0)
                _combine_block(OutPart, LsePart, Out, Lse, Sinks, batch, kv_head, start_m, n_rows, group_size,
                               q_start, heads_q, seqlen_q, head_dim_v, num_splits, stride_ob, stride_os, stride_oh,
                               BLOCK_M, BLOCK_DV, EVEN_DV, SINKS, VARLEN_Q)


@triton.jit
def _merge(OutPart, LsePart, rows, row_ok, m, total, num_splits, head_dim, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CACHE: tl.constexpr):
    """(out, natural-log lse) of lse rows ``rows`` merged over their splits' partials; ``m``, ``total``: the start.

    One pass over the splits, BLOCK_N at a time: each step loads its lse and its outputs together, a
    [BLOCK_M, BLOCK_N, BLOCK_D] tile, so a row's splits are read at once (not one dependent load a split). The
    running max m, the sum of exp2(lse - m) and the weighted outputs are rescaled when m grows. ``CACHE``: the
    loads' cache modifier ("": the default; ".cg": from L2, never a stale L1 line, the fused combine's).
    """
    offs_s = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        d_ok = offs_d < BLOCK_D
    else:
        d_ok = offs_d < head_dim
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_N):
        s_ok = (s0 + offs_s) < num_splits
        part = rows[:, None] * num_splits + s0 + offs_s[None, :]
        part_ok = row_ok[:, None] & s_ok[None, :]
        lse = tl.load(LsePart + part, mask=part_ok, other=float("-inf"), cache_modifier=CACHE)
        o = tl.load(OutPart + part[:, :, None] * head_dim + offs_d[None, None, :],
                    mask=part_ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.math.exp2(m - m_sub)
        weight = tl.math.exp2(lse - m_sub[:, None])
        total = total * scale + tl.sum(weight, 1)
        # A split that saw no key (lse -inf) adds nothing, whatever its output holds.
        acc = acc * scale[:, None] + tl.sum(tl.where((lse > float("-inf"))[:, :, None], weight[:, :, None] * o,
                                                     0.0), 1)
        m = m_new
    empty = total == 0.0
    lse_all = tl.where(empty, float("-inf"), m + tl.math.log2(tl.where(empty, 1.0, total)))
    return acc / tl.where(empty, 1.0, total)[:, None], lse_all * LN2


@triton.jit
def _combine_block(OutPart, LsePart, Out, Lse, Sinks, batch, kv_head, start_m, n_rows, group_size, q_start, heads_q,
                   seqlen_q, head_dim_v, num_splits, stride_ob, stride_os, stride_oh, BLOCK_M: tl.constexpr,
                   BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, SINKS: tl.constexpr, VARLEN_Q: tl.constexpr):
    """The fused combine: the split kernel's row block merged as ``flash_decode_combine_kernel`` merges it.

    One row at a time, as the combine kernel's programs of one row (``dispatch.COMBINE_BLOCK_M``) take them, its
    splits ``COMBINE_N`` a step (``dispatch.combine_block_n``: 32 up to a value head dim of 128, 16 at 256, 8 at
    512), so each row's merge is that kernel's, op for op; only the block's real rows, whatever BLOCK_M pads them to.
    """
    COMBINE_N: tl.constexpr = 32 if BLOCK_DV <= 128 else 4096 // BLOCK_DV
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < head_dim_v
    for r in range(0, tl.minimum(BLOCK_M, n_rows - start_m)):
        row = tl.zeros([1], dtype=tl.int32) + start_m + r
        query = row // group_size
        head = kv_head * group_size + row % group_size
        if VARLEN_Q:
            lse_row = head * seqlen_q + q_start + query
        else:
            lse_row = (batch * heads_q + head) * seqlen_q + query
        row_ok = row >= 0
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        total = tl.zeros([1], dtype=tl.float32)
        if SINKS:  # the sink: one more partial, as in the combine kernel
            m = tl.load(Sinks + head) * LOG2E
            total = tl.where(m == float("-inf"), 0.0, 1.0)
        out, lse = _merge(OutPart, LsePart, lse_row, row_ok, m, total, num_splits, head_dim_v, 1, COMBINE_N,
                          BLOCK_DV, EVEN_DV, ".cg")
        o_ptrs = Out + batch * stride_ob + (q_start + query) * stride_os + head * stride_oh
        tl.store(o_ptrs[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=dv_ok[None, :])
        tl.store(Lse + lse_row, lse)


@triton.jit
def flash_decode_combine_kernel(
    OutPart, LsePart, Out, Lse, Sinks,
    stride_ob, stride_os, stride_oh,
    heads_q, seqlen_q, head_dim, num_splits, n_rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    if PDL:  # launched as the split kernel's programmatic dependent: its partials are complete after this
        tl.extra.cuda.gdc_wait()
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        d_ok = offs_d < BLOCK_D
    else:
        d_ok = offs_d < head_dim
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # the sink: one more partial, lse the sink's and out 0 (m -inf with a sink of -inf: it adds 0)
        head = (offs_r // seqlen_q) % heads_q
        m = tl.load(Sinks + head, mask=row_ok, other=0.0) * LOG2E
        total = tl.where(m == float("-inf"), 0.0, 1.0)
    out, lse = _merge(OutPart, LsePart, offs_r, row_ok, m, total, num_splits, head_dim, BLOCK_M, BLOCK_N, BLOCK_D,
                      EVEN_D, "")

    query = offs_r % seqlen_q
    head = (offs_r // seqlen_q) % heads_q
    batch = offs_r // (seqlen_q * heads_q)
    o_ptrs = Out + batch[:, None] * stride_ob + query[:, None] * stride_os + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + offs_r, lse, mask=row_ok)
