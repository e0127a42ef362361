"""FlashAttention-2 forward in Triton: the source compiled into cache entries.

This is the only file that the source fingerprint of ``flash_fwd`` covers, so
everything the kernel calls lives here. It imports triton: only
``lazytriton.compiler`` may import it.

Layout is SDPA's: q (B, Hq, Sq, D), k and v (B, Hk, Sk, D), any strides with a
contiguous last dim. One program computes BLOCK_M query rows of one (batch,
query head); query head h reads key/value head h // group_size (GQA/MQA).

Causal masking keeps key j for query i when ``j <= i + causal_offset``: the
caller passes 0 for SDPA's top-left alignment and Sk - Sq for FlashAttention's
bottom-right one, so both share one binary. A row that sees no key at all
(bottom-right with Sq > Sk) gets output 0 and logsumexp -inf.

``TMA=true`` reads Q, K and V and writes Out through tensor descriptors made
on the device (``tl.make_tensor_descriptor``: Hopper's tensor memory
accelerator), one 2-D (seqlen, head_dim) descriptor per tensor over this
program's (batch, head) slice, so any (batch, head) strides work. A descriptor
fills rows past seqlen and columns past head_dim with zeros and clips stores
there, so its loads need no masks; the scores keep theirs. It needs a 16-byte
aligned base, 16-byte multiples for the row stride (``ALIGN16``) and a
contiguous last dim, and global scratch for the four descriptors, 128 bytes
each, per program (Triton's hidden ``global_scratch`` parameter, 512 bytes a
program: the launcher allocates grid x 512). ``TMA=false`` (the default, for
callers that predate it) is the pointer kernel, which every target and the CPU
interpreter run. Both compile for sm_90 with Triton 3.6.0 and 3.9.0 alike
(same launch metadata), and both versions' interpreters run descriptors. One
limit: Triton 3.6.0 computes a program's scratch offset (linear program id x
512) in 32 bits, so an entry it compiled must not launch 2**22 or more
programs; 3.9.0 computes it in 64 bits (read from their PTX).

``WINDOW=true`` is FlashAttention-2's sliding window: key j is visible to
query i when ``i + causal_offset - window_left <= j <= i + causal_offset +
window_right`` (the binding passes causal_offset = Sk - Sq, and a side the
caller left unbounded (-1) as max(Sq, Sk), which bounds nothing). Key blocks
wholly outside a query block's window are skipped by the loop bounds, blocks
wholly inside run unmasked. ``SOFTCAP=true`` caps the scaled scores:
``s -> softcap * tanh(s / softcap)`` before the softmax (FlashAttention-2's
order: scale first). Both are off by default and then compile away: with
Triton 3.9 for sm_90, the PTX of four pointer variants (bf16/fp16/fp32,
causal or not, aligned or not) and of the backward's eight is instruction for
instruction what it was before them, apart from the three unused parameters
in the signature and debug labels; the TMA variant's differs only in the
numbering of one register.

``CHUNK=true`` is FlashAttention-3's ``attention_chunk`` (Llama 4's chunked
local attention): key j is visible to query i when j and p = i + causal_offset
lie in the same chunk of ``attention_chunk`` keys (floor(j / C) == floor(p /
C)), on top of the causal mask and, with ``WINDOW``, inside the window: each
row's chunk is a window of its own (p mod C to its left, C - 1 - p mod C to
its right, each side the tighter of it and the window's). Key blocks outside
every row's chunk are skipped by the loop bounds, as the window's are.

``VARLEN=true`` is FlashAttention-2's varlen call: Q, K, V and Out are packed
(total_tokens, heads, head_dim) tensors, seen as one batch of total_tokens
rows (the binding passes their (1, heads, total, head_dim) views), and
``Cu_seqlens_q``/``Cu_seqlens_k`` hold each sequence's first row (batch + 1
int32, cumulative). Program z is sequence ``batch``: it reads its start and
length, offsets its base pointers by start x the row stride (the batch strides
are not read), takes its own lengths as seqlen_q/seqlen_k and its own
bottom-right offset len_k - len_q (the ``causal_offset`` parameter is not
read), and a program whose query block starts past its sequence returns at
once (the grid covers max_seqlen_q). Lse is (heads_q, total_q), FlashAttention
2.4+'s varlen layout. Unbounded window sides come from the binding as
max(total_q, total_k), which bounds no sequence. Off by default, it compiles
away: with Triton 3.9 for sm_90, eleven variants of the three kernels (the
dtypes, causal or not, aligned or not, head dims 64/80/128, TMA, window and
softcap) hold the same PTX instructions as before (registers and parameters
renumbered, a few independent instructions in another order) and assemble
(Triton 3.9's ptxas, sm_90a) to the same SASS, instruction for instruction,
apart from the constant-bank offsets of the parameters after the two new
pointers.

``SEQUSED_Q``/``SEQUSED_K`` (with ``VARLEN``; FlashAttention-3's
``seqused_q``/``seqused_k``) read sequence ``batch``'s used lengths from
``Seqused_q``/``Seqused_k`` (int32, one per sequence): its queries are the
first seqused_q[batch] rows of its cu_seqlens span and its keys the first
seqused_k[batch], and those lengths are its seqlen_q/seqlen_k (loop bounds,
masks, the bottom-right offset, ALiBi's). Keys past the used length are never
read. Rows past it are written as a row that sees no key (out 0, lse -inf),
to the span's end: the grid covers the spans (max_seqlen_q), and a block of
such rows only visits no key.

``SINKS`` (gpt-oss's attention sinks; FlashAttention-3 forks' ``s_aux``)
reads one float32 logit a query head from ``Sinks``, a raw logit beside the
scaled (capped, biased) scores: it joins each row's denominator once, in the
epilogue (``_with_sink``), and contributes no value, so out_i = sum_j
exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink)) and lse_i = log(sum_j exp(s_ij)
+ exp(sink)). A row that sees no key gets out 0 and lse = sink (so do rows
past ``SEQUSED_Q``'s length); a sink of -inf is none. The loop is untouched.

Three more flags modify the scores, each off by default:

- ``ALIBI``: FlashAttention-2's ALiBi, ``s -= slope[b, h] * |i + seqlen_k -
  seqlen_q - j|`` (``Alibi``: float32 slopes, ``stride_alibi_b`` 0 for one
  slope per head), after the scale and the cap (its reference's order). The
  same formula serves causal calls: over the visible keys it differs from
  FlashAttention-2's causal form (``slope * j``) by a constant per row, so
  out and the gradients are the same; lse is that of the formula above.
- ``BIAS``: an additive bias (``Bias``, q's dtype, four 64-bit strides, 0 on
  broadcast dims), added likewise: SDPA's ``attn_mask``. A bias of -inf can
  hide every key of a row, so with it the unmasked blocks guard m = -inf too.
- ``DROPOUT``: element (b, h, i, j) is kept when element ``offset + ((b *
  Hq + h) * Sq + i) * Sk + j`` of curand's Philox4_32_10 stream for ``seed``,
  as ``curand_uniform`` makes it a float, is above dropout_p (64-bit index; with
  ``VARLEN`` the same over the packed (1, Hq, total_q, total_k) scores, i and
  j counted from the first packed row and key, so no two elements of the
  batch share an index; ``Philox``
  holds [seed, offset], drawn on the device by the caller), kept
  probabilities are scaled by 1 / (1 - p) at the end, and l, m (so lse) are
  those of the undropped scores. That stream and rule are PyTorch's
  memory-efficient backend's, so with the seed and offset torch's CUDA
  generator hands it (``score_mods.draw_philox``) the mask is torch's
  (``_fill_mem_eff_dropout_mask_``). ``tl.randint4x`` is the same Philox
  4x32-10 in Triton 3.6 and 3.9, and the backward calls it with the same
  arguments, so it regenerates the mask.

``BLOCK_DV``/``EVEN_DV`` (with the runtime ``head_dim_v``) are v's head dim,
which may differ from q's and k's (DeepSeek's MLA: q/k 192, v 128): V is read,
the accumulator held and Out written BLOCK_DV wide, masked at head_dim_v unless
EVEN_DV. A variant writes them only where they differ from BLOCK_D/EVEN_D;
absent, the compiler passes BLOCK_D's and EVEN_D's values (0, the default,
means the same for callers that predate them), so equal-dim calls compile as
before, with head_dim_v = head_dim.

``BLOCK_D2`` > 0 (split tiles; 0, the default, pads) holds a head dim that is
not a power of two in two power-of-two chunks instead of one padded tile: 96 =
64 + 32, 160 = 128 + 32, 192 = 128 + 64, 80 = 64 + 16, 72 = 64 + 16 (the
second chunk masked at head_dim, EVEN_D then false). BLOCK_D is the first
chunk, whole; scores are q k + q2 k2 and V's chunks fill two accumulators.
Pointer kernel only (not TMA), with v's head dim equal to q's.

Off, they compile away: with Triton 3.9 for sm_90, the PTX of the plain
variants above (and of the backward's) has the same instructions in the same
order, apart from the eight new unused parameters, where the parameter loads
sit, register numbers and debug information. All flags together compile for
sm_90 with Triton 3.6 and 3.9 (TMA too).
"""

import triton
import triton.language as tl

from lazytriton.kernels.chunk import row_chunks

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    """The hyperbolic tangent through exp2 (exactly +-1 for large |x|): no libdevice, so the interpreter runs it."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _visible(keep, rows, cols, causal_offset, window_left, window_right, CAUSAL: tl.constexpr,
             WINDOW: tl.constexpr):
    """``keep`` narrowed by the causal mask and the sliding window (rows: [M, 1], cols: [1, N])."""
    if CAUSAL:
        keep = keep & (cols <= rows + causal_offset)
    if WINDOW:
        keep = keep & (cols >= rows + causal_offset - window_left) & (cols <= rows + causal_offset + window_right)
    return keep


@triton.jit
def _modified(qk, rows, cols, seqlen_q, seqlen_k, slope2, bias_rows, stride_bn, ALIBI: tl.constexpr,
              BIAS: tl.constexpr):
    """Base-2 scores plus ALiBi's ``-slope * |i + seqlen_k - seqlen_q - j|`` and the additive bias (both x log2 e).

    rows and cols broadcast against qk ([M, 1] and [1, N], or transposed); ``bias_rows``
    points at column 0 of each row's bias (64-bit offsets).
    """
    if ALIBI:
        qk = qk - slope2 * tl.abs(rows + (seqlen_k - seqlen_q) - cols).to(tl.float32)
    if BIAS:
        bias = tl.load(bias_rows + cols * stride_bn, mask=(rows < seqlen_q) & (cols < seqlen_k), other=0.0)
        qk = qk + bias.to(tl.float32) * LOG2E
    return qk


@triton.jit
def _kept(seed, drop_rows, cols, dropout_p):
    """Dropout's keep mask, PyTorch's memory-efficient attention's rule.

    (b, h, i, j) stays when element n = offset + ((b * Hq + h) * Sq + i) * Sk + j of curand's Philox4_32_10
    stream for ``seed`` (word n % 4 of Philox(counter n // 4)), made a float as ``curand_uniform`` does
    (x * 2**-32 + 2**-33), is above p.

    ``drop_rows`` is offset + ((b * Hq + h) * Sq + i) * Sk, in 64 bits.
    """
    n = drop_rows + cols
    w0, w1, w2, w3 = tl.randint4x(seed, n >> 2)
    word = n & 3
    x = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    return x.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10 > dropout_p


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d,
    seqlen_k, head_dim, causal_offset, qk_scale,
    stride_ks, stride_vs, window_left, window_right, cap, mods, offs_dv, head_dim_v,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr,
    DROPOUT: tl.constexpr, EVEN_DV: tl.constexpr, V_T: tl.constexpr = False,
):
    """One step of the online softmax over keys [start_n, start_n + BLOCK_N), read through pointers.

    K's head dim is offs_d (head_dim, EVEN_D), V's offs_dv (head_dim_v, EVEN_DV).
    ``V_T``: ``v_ptrs`` address V's transpose, a (BLOCK_DV, BLOCK_N) tile with the keys contiguous.
    """
    cols = start_n + offs_n
    if V_T:
        k, v = _load_k_vt(k_ptrs, v_ptrs, start_n, cols, offs_d, offs_dv, seqlen_k, head_dim, head_dim_v,
                          stride_ks, EVEN_D, EVEN_DV, MASKED)
    elif MASKED:
        col_ok = cols < seqlen_k
        if EVEN_D:
            k = tl.load(k_ptrs + start_n * stride_ks, mask=col_ok[None, :], other=0.0)
        else:
            d_ok = offs_d < head_dim
            k = tl.load(k_ptrs + start_n * stride_ks, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs + start_n * stride_vs, mask=col_ok[:, None], other=0.0)
        else:
            dv_ok = offs_dv < head_dim_v
            v = tl.load(v_ptrs + start_n * stride_vs, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs + start_n * stride_ks)
        else:
            d_ok = offs_d < head_dim
            k = tl.load(k_ptrs + start_n * stride_ks, mask=d_ok[:, None], other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs + start_n * stride_vs)
        else:
            dv_ok = offs_dv < head_dim_v
            v = tl.load(v_ptrs + start_n * stride_vs, mask=dv_ok[None, :], other=0.0)
    return _softmax_step(acc, l_i, m_i, q, k, v, cols, offs_m, seqlen_k, causal_offset, qk_scale,
                         window_left, window_right, cap, mods, MASKED, CAUSAL, IEEE, WINDOW, SOFTCAP, ALIBI,
                         BIAS, DROPOUT)


@triton.jit
def _load_k_vt(k_ptrs, vt_ptrs, start_n, cols, offs_d, offs_dv, seqlen_k, head_dim, head_dim_v, stride_ks,
               EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MASKED: tl.constexpr):
    """K's (BLOCK_D, BLOCK_N) tile and V's (BLOCK_N, BLOCK_DV) tile read from V's transpose (keys contiguous).

    The FP8 forward's layout: Hopper's FP8 wgmma takes its B operand K-major
    only, which for p @ v means the keys contiguous; read so, V's tiles are
    pipelined like K's (asynchronous copies into shared memory, a free
    transposed view), where a row-major V goes through registers every step.
    """
    keep_k = (offs_d < head_dim)[:, None] | EVEN_D
    keep_v = (offs_dv < head_dim_v)[:, None] | EVEN_DV
    if MASKED:
        keep_k = keep_k & (cols < seqlen_k)[None, :]
        keep_v = keep_v & (cols < seqlen_k)[None, :]
    if MASKED or not EVEN_D:
        k = tl.load(k_ptrs + start_n * stride_ks, mask=keep_k, other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_ks)
    if MASKED or not EVEN_DV:
        vt = tl.load(vt_ptrs + start_n, mask=keep_v, other=0.0)
    else:
        vt = tl.load(vt_ptrs + start_n)
    return k, vt.T


@triton.jit
def _attend_block_tma(
    acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n,
    seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """The same step with K and V read through descriptors (rows past seqlen_k come back as zeros)."""
    k = k_desc.load([start_n, 0]).T
    v = v_desc.load([start_n, 0])
    return _softmax_step(acc, l_i, m_i, q, k, v, start_n + offs_n, offs_m, seqlen_k, causal_offset, qk_scale,
                         window_left, window_right, cap, mods, MASKED, CAUSAL, IEEE, WINDOW, SOFTCAP, ALIBI,
                         BIAS, DROPOUT)


@triton.jit
def _softmax_step(
    acc, l_i, m_i, q, k, v, cols, offs_m, seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Scores of q against one (BLOCK_D, BLOCK_N) key tile k, then the online softmax update with v.

    With SOFTCAP, ``qk_scale`` is scale / softcap and ``cap`` is softcap * log2(e):
    the scores become softcap * tanh(scale * s / softcap), in base 2. ALIBI, BIAS,
    DROPOUT and ``mods`` (seqlen_q, slope * log2 e, bias row
    pointers, the bias's column stride, Philox seed, dropout row offsets,
    dropout_p): ALiBi and the bias are added after the cap; dropout zeroes
    probabilities after they entered the row sum, so l (and lse) are the
    undropped ones.
    """
    if IEEE:
        qk = tl.dot(q, k, input_precision="ieee")
    else:
        qk = tl.dot(q, k)
    p, alpha, l_i, m_new = _online(qk, l_i, m_i, cols, offs_m, seqlen_k, causal_offset, qk_scale, window_left,
                                   window_right, cap, mods, MASKED, CAUSAL, WINDOW, SOFTCAP, ALIBI, BIAS, DROPOUT,
                                   v.dtype)
    return _accumulate(acc, alpha, p, v, IEEE), l_i, m_new


@triton.jit
def _online(
    qk, l_i, m_i, cols, offs_m, seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    BIAS: tl.constexpr, DROPOUT: tl.constexpr, P_DTYPE: tl.constexpr,
):
    """The online softmax over one block of raw scores qk: (p, alpha, l_i, m_new), ``_softmax_step``'s rules.

    With BIAS (SDPA's attn_mask) the row sum adds the probabilities as rounded
    to ``P_DTYPE`` (v's dtype) for their product with v, so that out's weights
    sum to 1 and the backward's delta = rowsum(dO * out) carries no systematic
    rounding: with all-positive values and output gradients (torch's
    ``torch.rand`` tests) a sum of the unrounded ones biases every dS of a row
    alike, and dQ by it. lse then holds the rounded sum (an SDPA mask's lse is
    never returned; the backward's probabilities, exp(s - lse), are normalised by the same sum).
    """
    seqlen_q, slope2, bias_rows, stride_bn, seed, drop_rows, dropout_p = mods
    qk = qk * qk_scale
    if SOFTCAP:
        qk = _tanh(qk) * cap
    if ALIBI or BIAS:
        qk = _modified(qk, offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, slope2, bias_rows, stride_bn, ALIBI,
                       BIAS)
    if MASKED:
        keep = _visible((cols < seqlen_k)[None, :], offs_m[:, None], cols[None, :], causal_offset, window_left,
                        window_right, CAUSAL, WINDOW)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with no visible key so far keeps m = -inf; subtract 0 instead so
        # that exp2(-inf - -inf) never makes a NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    elif BIAS:  # a bias of -inf may hide every key of a row from an unmasked block too
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_new
    p = tl.math.exp2(qk - m_sub[:, None])
    if BIAS:
        p = p.to(P_DTYPE).to(tl.float32)
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_kept(seed, drop_rows, cols[None, :], dropout_p), p, 0.0)
    return p, alpha, l_i, m_new


@triton.jit
def _accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
    """The accumulator rescaled by alpha, plus p @ v.

    p is rounded to v's dtype, but to e4m3 for an e5m2 v (one more mantissa
    bit for the probabilities: the dot mixes the two float8 formats, which
    sm_90's wgmma takes, e4m3 x e5m2, with Triton 3.6 and 3.9 alike).
    """
    acc = acc * alpha[:, None]
    if v.dtype == tl.float8e5:
        p = p.to(tl.float8e4nv)
    else:
        p = p.to(v.dtype)
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p, v, acc)
    return acc


@triton.jit
def _attend_block_split(
    acc, acc2, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, start_n, offs_m, offs_n, d2_ok,
    seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap, mods,
    EVEN_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """``_attend_block`` with the head dim in two power-of-two chunks (``BLOCK_D2``): qk = q k + q2 k2.

    The first chunk (BLOCK_D wide) is whole; the second (BLOCK_D2) is masked at
    head_dim unless EVEN_D. V is split the same way into acc and acc2.
    """
    cols = start_n + offs_n
    col_ok = cols < seqlen_k
    if MASKED:
        k = tl.load(k_ptrs + start_n * stride_ks, mask=col_ok[None, :], other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vs, mask=col_ok[:, None], other=0.0)
        if EVEN_D:
            k2 = tl.load(k2_ptrs + start_n * stride_ks, mask=col_ok[None, :], other=0.0)
            v2 = tl.load(v2_ptrs + start_n * stride_vs, mask=col_ok[:, None], other=0.0)
        else:
            k2 = tl.load(k2_ptrs + start_n * stride_ks, mask=col_ok[None, :] & d2_ok[:, None], other=0.0)
            v2 = tl.load(v2_ptrs + start_n * stride_vs, mask=col_ok[:, None] & d2_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_ks)
        v = tl.load(v_ptrs + start_n * stride_vs)
        if EVEN_D:
            k2 = tl.load(k2_ptrs + start_n * stride_ks)
            v2 = tl.load(v2_ptrs + start_n * stride_vs)
        else:
            k2 = tl.load(k2_ptrs + start_n * stride_ks, mask=d2_ok[:, None], other=0.0)
            v2 = tl.load(v2_ptrs + start_n * stride_vs, mask=d2_ok[None, :], other=0.0)
    if IEEE:
        qk = tl.dot(q, k, input_precision="ieee")
        qk = tl.dot(q2, k2, qk, input_precision="ieee")
    else:
        qk = tl.dot(q, k)
        qk = tl.dot(q2, k2, qk)
    p, alpha, l_i, m_new = _online(qk, l_i, m_i, cols, offs_m, seqlen_k, causal_offset, qk_scale, window_left,
                                   window_right, cap, mods, MASKED, CAUSAL, WINDOW, SOFTCAP, ALIBI, BIAS, DROPOUT,
                                   v.dtype)
    return _accumulate(acc, alpha, p, v, IEEE), _accumulate(acc2, alpha, p, v2, IEEE), l_i, m_new


@triton.jit
def _with_sink(m_i, l_i, sink):
    """The epilogue's (divisor of acc, lse) with the sink logit ``sink`` (natural log) in the denominator.

    m_i and l_i are the row's base-2 max and sum (m_i -inf: no key seen). The
    divisor is the whole denominator rescaled to m_i's terms, l_i +
    exp2(sink2 - m_i), written as l / alpha so that it is never NaN: inf (out
    0) where alpha underflows or the row has neither a key nor a sink, whose lse is -inf.
    """
    sink2 = sink * LOG2E
    m_f = tl.maximum(m_i, sink2)
    m_sub = tl.where(m_f == float("-inf"), 0.0, m_f)
    alpha = tl.math.exp2(m_i - m_sub)
    l_f = l_i * alpha + tl.math.exp2(sink2 - m_sub)
    none = l_f == 0.0
    lse = tl.where(none, float("-inf"), (m_f + tl.math.log2(tl.where(none, 1.0, l_f))) * LN2)
    return tl.where(none, 1.0, l_f) / alpha, lse


@triton.jit
def _mods(Alibi, Bias, Philox, batch, head, offs_m, seqlen_q, lse_base, drop_k, drop_col,
          stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn, dropout_p,
          ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    """What the score modifications need for rows ``offs_m`` of one (batch, query head), as ``_softmax_step`` takes it.

    (seqlen_q, slope * log2 e, bias row pointers [M, 1], the bias's column stride,
    Philox seed, dropout row offsets [M, 1] (64-bit), dropout_p); zeros for what is off.
    Dropout's index of (row, 0) is offset + (lse_base + row) * drop_k + drop_col
    (the lse's offset of row 0, the keys per row and the first key's column).
    """
    slope2 = 0.0
    bias_rows = Bias
    seed = 0
    drop_rows = 0
    if ALIBI:
        slope2 = tl.load(Alibi + batch * stride_alibi_b + head) * LOG2E
    if BIAS:
        bias_rows = (Bias + batch.to(tl.int64) * stride_biasb + head.to(tl.int64) * stride_biash
                     + offs_m[:, None].to(tl.int64) * stride_biasm)
    if DROPOUT:
        seed = tl.load(Philox)
        # The linear index of (batch, head, row, 0) in (B, Hq, Sq, Sk): the lse's offset is (b * Hq + h) * Sq.
        lse_rows = lse_base.to(tl.int64) + offs_m[:, None].to(tl.int64)
        drop_rows = tl.load(Philox + 1) + lse_rows * drop_k + drop_col
    return (seqlen_q, slope2, bias_rows, stride_biasn, seed, drop_rows, dropout_p)


@triton.jit
def _forward(
    Q, K, V, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Alibi, Bias, Philox, Seqused_q, Seqused_k, Sinks,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk,
    stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn,
    sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr = False,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, VARLEN: tl.constexpr = False,
    ALIBI: tl.constexpr = False, BIAS: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    BLOCK_DV: tl.constexpr = 0, EVEN_DV: tl.constexpr = True, BLOCK_D2: tl.constexpr = 0,
    SEQUSED_Q: tl.constexpr = False, SEQUSED_K: tl.constexpr = False, SINKS: tl.constexpr = False,
    CHUNK: tl.constexpr = False, FP8: tl.constexpr = False, v_descale=1.0,
):
    """``flash_fwd_kernel``'s body; ``FP8``: ``flash_fwd_fp8_kernel``'s (V read from its transpose, out x v_descale)."""
    # Heaviest query blocks first: with a causal mask the last blocks see the
    # most keys, and starting them early evens out the tail of the grid.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    kv_head = head // group_size
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32

    if VARLEN:
        # Sequence ``batch`` of the packed tensors: its rows, lengths and own bottom-right offset.
        total_k = seqlen_k
        q_start = tl.load(Cu_seqlens_q + batch)
        seqlen_q = tl.load(Cu_seqlens_q + batch + 1) - q_start
        k_start = tl.load(Cu_seqlens_k + batch)
        seqlen_k = tl.load(Cu_seqlens_k + batch + 1) - k_start
        span_q = seqlen_q  # the rows this sequence's programs write, used or not
        if SEQUSED_Q:
            seqlen_q = tl.load(Seqused_q + batch)
        if SEQUSED_K:
            seqlen_k = tl.load(Seqused_k + batch)
        causal_offset = seqlen_k - seqlen_q
        if start_m >= span_q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # V's head dim (and Out's): BLOCK_DV/EVEN_DV, or BLOCK_D/EVEN_D's when 0 (callers that predate them).
    BLOCK_V: tl.constexpr = BLOCK_DV if BLOCK_DV > 0 else BLOCK_D
    EVEN_V: tl.constexpr = EVEN_DV if BLOCK_DV > 0 else EVEN_D
    offs_dv = tl.arange(0, BLOCK_V)
    row_ok = offs_m < seqlen_q

    if VARLEN:
        q_base = Q + q_start * stride_qs + head * stride_qh
        k_base = K + k_start * stride_ks + kv_head * stride_kh
        if FP8:
            v_base = V + k_start + kv_head * stride_vh
        else:
            v_base = V + k_start * stride_vs + kv_head * stride_vh
    else:
        q_base = Q + batch * stride_qb + head * stride_qh
        k_base = K + batch * stride_kb + kv_head * stride_kh
        v_base = V + batch * stride_vb + kv_head * stride_vh
    if TMA:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[seqlen_q, head_dim], strides=[stride_qs, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        k_desc = tl.make_tensor_descriptor(k_base, shape=[seqlen_k, head_dim], strides=[stride_ks, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[seqlen_k, head_dim_v], strides=[stride_vs, 1],
                                           block_shape=[BLOCK_N, BLOCK_V])
        q = q_desc.load([start_m, 0])
    else:
        q_ptrs = q_base + offs_m[:, None] * stride_qs + offs_d[None, :]
        # K is read transposed, (BLOCK_D, BLOCK_N), so that q @ k needs no permute.
        k_ptrs = k_base + offs_n[None, :] * stride_ks + offs_d[:, None]
        if FP8:  # V's transpose, (B, Hk, head_dim_v, Sk): stride_vs is between its head-dim rows
            v_ptrs = v_base + offs_dv[:, None] * stride_vs + offs_n[None, :]
        else:
            v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_dv[None, :]
        if EVEN_D:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        if BLOCK_D2 > 0:  # split tiles: head dims [BLOCK_D, BLOCK_D + BLOCK_D2), masked at head_dim (v's too)
            offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
            d2_ok = offs_d2 < head_dim
            if EVEN_D:  # the chunks hold the head dim: rows masked only, so a thread's columns stay whole
                q2 = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d2[None, :], mask=row_ok[:, None], other=0.0)
            else:
                q2 = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d2[None, :],
                             mask=row_ok[:, None] & d2_ok[None, :], other=0.0)
            k2_ptrs = k_base + offs_n[None, :] * stride_ks + offs_d2[:, None]
            v2_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d2[None, :]
            acc2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)

    if SOFTCAP:
        qk_scale = sm_scale / softcap
        cap = softcap * LOG2E
    else:
        qk_scale = sm_scale * LOG2E
        cap = qk_scale
    if VARLEN:  # dropout over the packed (1, Hq, total_q, total_k) scores
        lse_base = head * stride_lh + q_start
        drop_k = total_k
        drop_col = k_start
    else:
        lse_base = batch * stride_lb + head * stride_lh
        drop_k = seqlen_k
        drop_col = 0
    mods = _mods(Alibi, Bias, Philox, batch, head, offs_m, seqlen_q, lse_base, drop_k, drop_col,
                 stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn, dropout_p,
                 ALIBI, BIAS, DROPOUT)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)

    # Keys [0, full_end) are visible to every row of this block and need no
    # mask; keys [full_end, end) are the ragged tail and the causal diagonal.
    end = seqlen_k
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        end = tl.minimum(end, tl.maximum(start_m + BLOCK_M + causal_offset, 0))
        first_row_limit = tl.maximum(start_m + causal_offset + 1, 0)
        full_end = tl.minimum(full_end, (first_row_limit // BLOCK_N) * BLOCK_N)
    begin = 0
    full_begin = 0
    # The chunk's or the window's bounds, per row, else the window's alone.
    LOCAL: tl.constexpr = WINDOW or CHUNK
    if CHUNK:  # each row's chunk (inside its window): the blocks' bounds, and the per-row window they are masked with
        begin, full_begin, full_end, end, window_left, window_right = row_chunks(
            offs_m, causal_offset, attention_chunk, window_left, window_right, end, full_end, BLOCK_N, WINDOW)
    elif WINDOW:
        # Keys below ``begin`` are left of every row's window; from ``full_begin``
        # on they are right of the last row's left edge; up to ``full_end`` they
        # are left of the first row's right edge, and ``end`` is past the last one's.
        begin = (tl.maximum(start_m + causal_offset - window_left, 0) // BLOCK_N) * BLOCK_N
        full_begin = tl.maximum(start_m + BLOCK_M - 1 + causal_offset - window_left, 0)
        full_begin = ((full_begin + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        end = tl.minimum(end, tl.maximum(start_m + BLOCK_M + causal_offset + window_right, 0))
        right_limit = tl.maximum(start_m + causal_offset + window_right + 1, 0)
        full_end = tl.minimum(full_end, (right_limit // BLOCK_N) * BLOCK_N)
    if SEQUSED_Q:  # a block of unused rows only: no key to visit
        end = tl.where(start_m < seqlen_q, end, 0)
    full_end = tl.minimum(full_end, end)
    if LOCAL:
        full_end = tl.maximum(full_end, begin)
        full_begin = tl.minimum(tl.maximum(full_begin, begin), full_end)

    if TMA:
        if LOCAL:
            for start_n in range(begin, full_begin, BLOCK_N):
                acc, l_i, m_i = _attend_block_tma(
                    acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n,
                    seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods, True, CAUSAL, IEEE, LOCAL,
                    SOFTCAP, ALIBI, BIAS, DROPOUT,
                )
        for start_n in range(full_begin, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_block_tma(
                acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n,
                seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods, False, CAUSAL, IEEE, LOCAL,
                SOFTCAP, ALIBI, BIAS, DROPOUT,
            )
        for start_n in range(full_end, end, BLOCK_N):
            acc, l_i, m_i = _attend_block_tma(
                acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n,
                seqlen_k, causal_offset, qk_scale, window_left, window_right, cap, mods, True, CAUSAL, IEEE, LOCAL,
                SOFTCAP, ALIBI, BIAS, DROPOUT,
            )
    elif BLOCK_D2 > 0:
        if LOCAL:
            for start_n in range(begin, full_begin, BLOCK_N):
                acc, acc2, l_i, m_i = _attend_block_split(
                    acc, acc2, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, start_n, offs_m, offs_n, d2_ok,
                    seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap, mods,
                    EVEN_D, True, CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS, DROPOUT,
                )
        for start_n in range(full_begin, full_end, BLOCK_N):
            acc, acc2, l_i, m_i = _attend_block_split(
                acc, acc2, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, start_n, offs_m, offs_n, d2_ok,
                seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap, mods,
                EVEN_D, False, CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS, DROPOUT,
            )
        for start_n in range(full_end, end, BLOCK_N):
            acc, acc2, l_i, m_i = _attend_block_split(
                acc, acc2, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, v2_ptrs, start_n, offs_m, offs_n, d2_ok,
                seqlen_k, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right, cap, mods,
                EVEN_D, True, CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS, DROPOUT,
            )
    else:
        if LOCAL:
            for start_n in range(begin, full_begin, BLOCK_N):
                acc, l_i, m_i = _attend_block(
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d,
                    seqlen_k, head_dim, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right,
                    cap, mods, offs_dv, head_dim_v, BLOCK_N, EVEN_D, True, CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI,
                    BIAS, DROPOUT, EVEN_V, FP8,
                )
        for start_n in range(full_begin, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d,
                seqlen_k, head_dim, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right,
                cap, mods, offs_dv, head_dim_v, BLOCK_N, EVEN_D, False, CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS,
                DROPOUT, EVEN_V, FP8,
            )
        for start_n in range(full_end, end, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d,
                seqlen_k, head_dim, causal_offset, qk_scale, stride_ks, stride_vs, window_left, window_right,
                cap, mods, offs_dv, head_dim_v, BLOCK_N, EVEN_D, True, CAUSAL, IEEE, LOCAL, SOFTCAP, ALIBI, BIAS,
                DROPOUT, EVEN_V, FP8,
            )

    if SEQUSED_Q:  # rows past the used length: a row that sees no key (out 0, lse -inf), stored to the span's end
        unused = offs_m >= seqlen_q
        acc = tl.where(unused[:, None], 0.0, acc)
        if BLOCK_D2 > 0:
            acc2 = tl.where(unused[:, None], 0.0, acc2)
        l_i = tl.where(unused, 0.0, l_i)
        if SINKS:
            m_i = tl.where(unused, float("-inf"), m_i)
        seqlen_q = span_q
        row_ok = offs_m < seqlen_q
    if SINKS:  # l_i becomes the divisor of acc (never 0), the lse the sink's
        l_i, sink_lse = _with_sink(m_i, l_i, tl.load(Sinks + head))
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    if FP8:
        out = out * v_descale
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2)
    if SINKS:
        lse = sink_lse

    if VARLEN:
        o_base = Out + q_start * stride_os + head * stride_oh
    else:
        o_base = Out + batch * stride_ob + head * stride_oh
    if TMA:
        # The store clips rows past seqlen_q and columns past head_dim_v.
        o_desc = tl.make_tensor_descriptor(o_base, shape=[seqlen_q, head_dim_v], strides=[stride_os, 1],
                                           block_shape=[BLOCK_M, BLOCK_V])
        o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    else:
        o_ptrs = o_base + offs_m[:, None] * stride_os + offs_dv[None, :]
        if EVEN_V:
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < head_dim_v))
        if BLOCK_D2 > 0:
            out2 = acc2 / tl.where(empty, 1.0, l_i)[:, None]
            if DROPOUT:
                out2 = out2 * (1.0 / (1.0 - dropout_p))
            o2_ptrs = o_base + offs_m[:, None] * stride_os + offs_d2[None, :]
            if EVEN_D:
                tl.store(o2_ptrs, out2.to(Out.dtype.element_ty), mask=row_ok[:, None])
            else:
                tl.store(o2_ptrs, out2.to(Out.dtype.element_ty), mask=row_ok[:, None] & d2_ok[None, :])
    if VARLEN:  # FlashAttention-2's varlen layout: (heads_q, total_q)
        tl.store(Lse + head * stride_lh + q_start + offs_m, lse, mask=row_ok)
    else:
        tl.store(Lse + batch * stride_lb + head * stride_lh + offs_m, lse, mask=row_ok)


@triton.jit
def flash_fwd_kernel(
    Q, K, V, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Alibi, Bias, Philox, Seqused_q, Seqused_k, Sinks,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk,
    stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn,
    sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr = False,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, VARLEN: tl.constexpr = False,
    ALIBI: tl.constexpr = False, BIAS: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    BLOCK_DV: tl.constexpr = 0, EVEN_DV: tl.constexpr = True, BLOCK_D2: tl.constexpr = 0,
    SEQUSED_Q: tl.constexpr = False, SEQUSED_K: tl.constexpr = False, SINKS: tl.constexpr = False,
    CHUNK: tl.constexpr = False,
):
    _forward(
        Q, K, V, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Alibi, Bias, Philox, Seqused_q, Seqused_k, Sinks,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
        attention_chunk, stride_alibi_b, stride_biasb, stride_biash, stride_biasm, stride_biasn,
        sm_scale, softcap, dropout_p,
        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, CAUSAL, TMA, WINDOW, SOFTCAP, VARLEN, ALIBI, BIAS, DROPOUT, BLOCK_DV,
        EVEN_DV, BLOCK_D2, SEQUSED_Q, SEQUSED_K, SINKS, CHUNK,
    )


@triton.jit
def _descale(Descale, offset):
    """One FP8 descale: the float32 at ``Descale + offset``, or 1.0 where ``Descale`` is null (a descale not given)."""
    return tl.load(Descale + offset, mask=Descale.to(tl.int64) != 0, other=1.0)


@triton.jit
def flash_fwd_fp8_kernel(
    Q, K, V, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Seqused_q, Seqused_k, Q_descale, K_descale, V_descale,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
    attention_chunk, stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    sm_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    VARLEN: tl.constexpr = False, BLOCK_DV: tl.constexpr = 0, EVEN_DV: tl.constexpr = True,
    SEQUSED_Q: tl.constexpr = False, SEQUSED_K: tl.constexpr = False, CHUNK: tl.constexpr = False,
):
    """The FP8 forward: float8 Q, K, V (all e4m3 or all e5m2), FlashAttention-3's descales, V transposed, Out bf16.

    ``Q_descale``, ``K_descale``, ``V_descale``: float32, element (batch,
    kv head) at ``batch * stride_xdb + kv_head * stride_xdh`` (both 0 for one
    per tensor); a null pointer is 1.0 (nothing is read). The scores are
    ``(q . k) * q_descale * k_descale * sm_scale`` (then capped, masked), P
    is rounded to e4m3 for ``p @ v`` (as FlashAttention-3 does; with e5m2
    inputs too, ``_accumulate``) and the output is multiplied by v_descale.
    V is (B, Hk, head_dim_v, Sk) with the keys contiguous (``stride_vs``
    between its head-dim rows; packed: (1, Hk, head_dim_v, total_k)).
    """
    batch = tl.program_id(2)
    kv_head = tl.program_id(1) // group_size
    qk_descale = (_descale(Q_descale, batch * stride_qdb + kv_head * stride_qdh)
                  * _descale(K_descale, batch * stride_kdb + kv_head * stride_kdh))
    v_descale = _descale(V_descale, batch * stride_vdb + kv_head * stride_vdh)
    _forward(
        Q, K, V, Out, Lse, Cu_seqlens_q, Cu_seqlens_k, Q_descale, Q, Seqused_q, Seqused_q, Seqused_k, Q_descale,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, causal_offset, window_left, window_right,
        attention_chunk, 0, 0, 0, 0, 0,
        sm_scale * qk_descale, softcap, 0.0,
        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, CAUSAL, False, WINDOW, SOFTCAP, VARLEN, False, False, False, BLOCK_DV,
        EVEN_DV, 0, SEQUSED_Q, SEQUSED_K, False, CHUNK, True, v_descale,
    )


@triton.jit
def _attend_block_host_tma(
    acc, l_i, m_i, q, K_desc, V_desc, batch, kv_head, start_n, offs_m, offs_n, seqlen_k, causal_offset, qk_scale,
    mods, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One online-softmax step with K and V read through host descriptors (rows past seqlen_k are zeros)."""
    k = K_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D).T
    v = V_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    return _softmax_step(acc, l_i, m_i, q, k, v, start_n + offs_n, offs_m, seqlen_k, causal_offset, qk_scale,
                         0, 0, qk_scale, mods, MASKED, CAUSAL, IEEE, False, False, False, False, False)


@triton.jit
def flash_fwd_host_tma_kernel(
    Q, K_desc, V_desc, Out, Lse,
    stride_qb, stride_qh, stride_qs, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    group_size, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """The forward with K and V read through host tensor descriptors (a probe variant, off by default).

    ``K_desc``/``V_desc`` are 4-D (B, Hk, Sk, D) descriptors with block
    (1, 1, BLOCK_N, BLOCK_D), encoded by the launcher (``Entry.tensordesc_meta``):
    any (batch, head, row) strides that are 16-byte multiples, each head's rows
    past seqlen_k read as zeros. Q, Out and Lse go through pointers as in
    ``flash_fwd_kernel``; no window, varlen, softcap, ALiBi, bias or dropout.
    """
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    kv_head = head // group_size
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    d_ok = offs_d < head_dim
    if EVEN_D:
        d_ok = offs_d < BLOCK_D
    q_ptrs = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = sm_scale * LOG2E
    mods = _mods(Q, Q, Q, batch, head, offs_m, seqlen_q, seqlen_k, stride_lb, stride_lh, 0, 0, 0, 0, 0, 0.0,
                 False, False, False)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = seqlen_k
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        end = tl.minimum(end, tl.maximum(start_m + BLOCK_M + causal_offset, 0))
        full_end = tl.minimum(full_end, (tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N) * BLOCK_N)
    full_end = tl.minimum(full_end, end)
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_block_host_tma(acc, l_i, m_i, q, K_desc, V_desc, batch, kv_head, start_n, offs_m,
                                               offs_n, seqlen_k, causal_offset, qk_scale, mods, BLOCK_N, BLOCK_D,
                                               False, CAUSAL, IEEE)
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _attend_block_host_tma(acc, l_i, m_i, q, K_desc, V_desc, batch, kv_head, start_n, offs_m,
                                               offs_n, seqlen_k, causal_offset, qk_scale, mods, BLOCK_N, BLOCK_D,
                                               True, CAUSAL, IEEE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2)
    o_ptrs = Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + batch * stride_lb + head * stride_lh + offs_m, lse, mask=row_ok)
