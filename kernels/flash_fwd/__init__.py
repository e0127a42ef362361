"""Description of the FlashAttention-2 forward kernel (``triton_kernel.py``).

Parameter order puts pointers and integers first and the one float last; the
launcher relies on nothing but this list. Strides are 32-bit unless some
tensor spans 2**31 elements or more (``INDEX64=true``): on the H200, 64-bit
strides cost 12-16% of throughput at head dim 128 (bench_flash_fwd.py,
2026-11-30: 391 vs 457 TFLOP/s, bf16, 4k, against the same kernel through
Triton's JIT, which passes them as i32).

``TMA`` is a flag like ``ALIGN16`` and ``INDEX64``: a variant without it is
the pointer kernel (``TMA=false``), and dispatch writes it only when true, so
pointer variants keep the strings they had before it. ``TMA=true`` needs
``ALIGN16=true`` and a CUDA target with a tensor memory accelerator (sm_90+);
dispatch decides (``flash_fwd.dispatch.flash_fwd_tma``). It also needs a head dim that
fills its tile (``EVEN_D``): on the H200 with Triton 3.6, a descriptor store
with head dim 59 in a 64-wide tile wrote into the columns past head dim,
though the interpreters clip them.

``WINDOW`` (sliding window) and ``SOFTCAP`` (logit softcapping) are flags too,
written only when true; their values are runtime parameters (``window_left``,
``window_right``, ``softcap``), so one binary serves every window and cap.
The two new integers sit after the old ones and ``softcap`` after
``sm_scale``: integers first, floats last, as the C launchers lay them out.

``VARLEN`` (FlashAttention-2's ``flash_attn_varlen_func``: packed
(total_tokens, heads, head_dim) tensors and int32 cumulative lengths) is a
flag too, written only when true. Its two pointers, ``Cu_seqlens_q`` and
``Cu_seqlens_k`` (``VARLEN_POINTERS``), follow the kernel's last pointer
(``Lse``), before the strides; a dense call passes 0 for both. With it, the
grid's z is the sequence index, each program reads its sequence's start and
length from them, and the batch strides and ``causal_offset`` are not read
(the kernel uses each sequence's own len_k - len_q); the binding
(``flash_fwd/varlen.py``) packs the tensors as one batch of total_tokens rows.

``SEQUSED_Q`` and ``SEQUSED_K`` (FlashAttention-3's ``seqused_q``/``seqused_k``,
with ``VARLEN`` only) are flags too, written only when true: each sequence's
used query and key lengths, read from ``Seqused_q``/``Seqused_k``
(``SEQUSED_POINTERS``, int32, one per sequence, after the score
modifications' pointers; 0 for a call without them), cut its cu_seqlens span
to its first used rows; the rest of the span is written as rows that see no
key (``triton_kernel.py``).

``SINKS`` (attention sinks: gpt-oss's, FlashAttention-3 forks' ``s_aux``) is a flag
too, written only when true: ``Sinks`` (``SINKS_POINTERS``, float32, one logit per
query head, after the used lengths; 0 for a call without them) joins every row's
softmax denominator once, in the epilogue, and the lse; it adds no value.

``CHUNK`` (FlashAttention-3's ``attention_chunk``: chunked local attention) is a
flag too, written only when true; the chunk size is the runtime integer
``attention_chunk`` (after the window's, 0 for a call without it), so one
binary serves every chunk size.

``ALIBI`` (FlashAttention-2's ALiBi), ``BIAS`` (an additive bias: the SDPA
drop-in's ``attn_mask``) and ``DROPOUT`` follow the same rule: flags written
only when true, their data runtime arguments. Their pointers (``Alibi``,
``Bias``, ``Philox``) follow the kernel's own, their integers (the slopes'
batch stride, the bias's four strides, 0 on broadcast dims) the window's, and
``dropout_p`` comes after ``softcap``. A call without them passes null
pointers and zeros, which the kernels never read. With ``VARLEN`` the slopes'
batch is the sequence, and dropout indexes the packed (1, heads_q, total_q,
total_k) scores (``triton_kernel.py``).

``ALIGN16`` here covers the pointers and the tensors' strides only, never the
seqlens or the lse strides (the backward has a flag of its own for those,
``SEQ16``): a packed or odd-length forward keeps every hint it has.

``head_dim_v`` (after ``head_dim``, in every attention kernel's ``SIZES``) is
v's head dim, which out, dout and dv share; it may differ from q's and k's
``head_dim``. Its tile and evenness are the constexprs ``BLOCK_DV`` and
``EVEN_DV``, which a variant holds only where they differ from ``BLOCK_D`` and
``EVEN_D`` (``variant.kernel_constexprs`` fills in those values otherwise), so
the strings of equal-dim variants are what they were.

``BLOCK_D2`` (split tiles: the head dim in two power-of-two chunks, BLOCK_D
then BLOCK_D2, instead of one padded tile) is written only when set; absent,
it is 0 (padding), so every other variant's string is unchanged.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

_STRIDES = tuple(
    (f"stride_{t}{d}", "{index}") for t in ("q", "k", "v", "o") for d in ("b", "h", "s")
) + (("stride_lb", "{index}"), ("stride_lh", "{index}"))

# Every attention kernel's last pointers (the backward's too): the varlen kernels' cumulative
# lengths, 0 (unused) in a dense call. Not in aligned_params: a slice of a cu_seqlens tensor may
# start anywhere, and two scalar loads gain nothing from the hint.
VARLEN_POINTERS = (("Cu_seqlens_q", "*i32"), ("Cu_seqlens_k", "*i32"))

# The score modifications' pointers, after each kernel's own: ALiBi slopes (float32,
# (heads,) or (batch, heads)), the additive bias (q's dtype), the Philox [seed, offset].
MOD_POINTERS = (("Alibi", "*fp32"), ("Bias", "*{dtype}"), ("Philox", "*i64"))

# The varlen kernels' used lengths (FlashAttention-3's seqused_q/seqused_k: int32, one per
# sequence), after the score modifications' pointers; 0 (unused) unless SEQUSED_Q/SEQUSED_K.
SEQUSED_POINTERS = (("Seqused_q", "*i32"), ("Seqused_k", "*i32"))

# The forward kernels' attention sinks (gpt-oss's; FlashAttention-3 forks' ``s_aux``: float32, one logit
# per query head), after the used lengths; 0 (unused) unless SINKS. The backward kernels take none: the
# sink enters their gradients only through the forward's lse.
SINKS_POINTERS = (("Sinks", "*fp32"),)

# The scalar tail every attention kernel takes, in this order (the backward's too).
# The bias strides are 64-bit in every variant: a broadcast bias costs nothing
# to address, and a full one may span 2**31 elements where q, k and v do not.
SIZES = (
    ("group_size", "i32"),
    ("seqlen_q", "i32"),
    ("seqlen_k", "i32"),
    ("head_dim", "i32"),
    ("head_dim_v", "i32"),
    ("causal_offset", "i32"),
    ("window_left", "i32"),
    ("window_right", "i32"),
    ("attention_chunk", "i32"),
    ("stride_alibi_b", "i32"),
    ("stride_biasb", "i64"),
    ("stride_biash", "i64"),
    ("stride_biasm", "i64"),
    ("stride_biasn", "i64"),
    ("sm_scale", "fp32"),
    ("softcap", "fp32"),
    ("dropout_p", "fp32"),
)

FLASH_FWD = KernelSpec(
    name="flash_fwd",
    module="lazytriton.kernels.flash_fwd.triton_kernel",
    function="flash_fwd_kernel",
    params=(
        ("Q", "*{dtype}"),
        ("K", "*{dtype}"),
        ("V", "*{dtype}"),
        ("Out", "*{dtype}"),
        ("Lse", "*fp32"),
        *VARLEN_POINTERS,
        *MOD_POINTERS,
        *SEQUSED_POINTERS,
        *SINKS_POINTERS,
        *_STRIDES,
        *SIZES,
    ),
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "CAUSAL", "TMA", "WINDOW", "SOFTCAP", "VARLEN", "ALIBI",
                "BIAS", "DROPOUT", "BLOCK_DV", "EVEN_DV", "BLOCK_D2", "SEQUSED_Q", "SEQUSED_K", "SINKS", "CHUNK"),
    aligned_params=("Q", "K", "V", "Out", "Lse") + tuple(
        name for name, _ in _STRIDES if not name.startswith("stride_l")
    ),
    helpers=("lazytriton.kernels.chunk",),
)


def grid(seqlen_q: int, heads_q: int, batch: int, block_m: int) -> tuple[int, int, int]:
    """Programs: query blocks x query heads x batch (y and z stay under 65536)."""
    return ((seqlen_q + block_m - 1) // block_m, heads_q, batch)


# The forward with K and V read through host tensor descriptors (a probe variant, off by default: no
# dispatch path selects it; experiments/probe_host_tma.py compiles and launches it). Each descriptor
# parameter takes three things from the caller, in the integer arguments: the tensor's base pointer, its
# four sizes (B, Hk, Sk, D), its four strides in elements; the launcher encodes the CUtensorMap.
HOST_TMA_DESCRIPTOR = "tensordesc<{dtype}[1, 1, {BLOCK_N}, {BLOCK_D}]>"
FLASH_FWD_HOST_TMA = KernelSpec(
    name="flash_fwd_host_tma",
    module="lazytriton.kernels.flash_fwd.triton_kernel",
    function="flash_fwd_host_tma_kernel",
    params=(
        ("Q", "*{dtype}"),
        ("K_desc", HOST_TMA_DESCRIPTOR),
        ("V_desc", HOST_TMA_DESCRIPTOR),
        ("Out", "*{dtype}"),
        ("Lse", "*fp32"),
        *((f"stride_{t}{d}", "i32") for t in ("q", "o") for d in ("b", "h", "s")),
        ("stride_lb", "i32"),
        ("stride_lh", "i32"),
        ("group_size", "i32"),
        ("seqlen_q", "i32"),
        ("seqlen_k", "i32"),
        ("head_dim", "i32"),
        ("causal_offset", "i32"),
        ("sm_scale", "fp32"),
    ),
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "CAUSAL"),
    aligned_params=("Q", "Out", "Lse", "stride_qb", "stride_qh", "stride_qs", "stride_ob", "stride_oh", "stride_os"),
)
