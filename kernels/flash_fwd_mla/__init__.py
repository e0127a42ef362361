"""Description of the MLA forward (``triton_kernel.py``): FlashAttention-3's ``qv`` and v's head dim up to 512.

FlashAttention-3's forward takes two things flash_fwd does not: ``qv`` (DeepSeek's MLA with the absorbed
projections: qv (batch, seqlen_q, heads, head_dim_v), scores (q . k + qv . v) x softmax_scale, default
1/sqrt(head_dim + head_dim_v)) and v of head dim up to 512 beside q and k of a smaller one (its tests: 64 with
256 and 512, with and without qv). ``flash_fwd_mla`` is that forward, a family of its own: flash_fwd's
parameters, which its warm paths, the Gluon forward and the C API share, and its keys stay as they are. A call
with ``qv``, or with v's head dim over ``geometry.MAX_HEAD_DIM`` (256), comes here from ``flash_attn_func`` and
``flash_attn_varlen_func``; forward only (FlashAttention-3 has no such backward either).

``QV`` is a flag (written only when true): the kernel loads qv's (BLOCK_M, BLOCK_DV) tile once and adds qv . v
from the V tile it already holds for P . V, so each value is read once for both products. Without it, ``Qv``
and its strides are not read (0). ``BLOCK_DV``/``EVEN_DV`` are v's tile and evenness, always written (v's
head dim is the family's reason to exist); ``BLOCK_D``/``EVEN_D`` q's and k's. ``WINDOW``, ``SOFTCAP``,
``VARLEN`` are flash_fwd's (``kernels/flash_fwd/__init__.py``): runtime window sides and cap, packed
sequences through ``Cu_seqlens_q``/``Cu_seqlens_k`` (0 when dense) with the lse in FlashAttention-2's varlen
layout (heads_q, total_q). So are ``CHUNK`` (FlashAttention-3's ``attention_chunk``, the runtime
``attention_chunk``; its bounds are ``kernels/chunk.py``'s, a helper of this kernel as of flash_fwd's) and, with
``VARLEN``, ``SEQUSED_Q``/``SEQUSED_K`` (FlashAttention-3's ``seqused_q``/``seqused_k``: ``Seqused_q``/
``Seqused_k``, int32 one a sequence, 0 when not read).

Tiles (``dispatch.default_config``). With v of 512 the accumulator is BLOCK_M x 512 float32: at BLOCK_M 64
and 8 warps (two warpgroups, each 64 x 256 of it) that is 128 registers a thread, what Hopper leaves room for
beside the scores; BLOCK_M 128 would need 256. Shared memory holds qv's tile (64 x 512 x 2 bytes: 64 KiB,
loop-invariant, the wgmma A operand), q's and, per pipeline stage, a K tile and a V tile of BLOCK_N keys (V:
BLOCK_N x 512 x 2 bytes). BLOCK_N 32 with 2 stages keeps that near 150 KiB of sm_90's 227 KiB (and under
sm_80's 163 KiB); BLOCK_N 64 would put the V stages alone at 128 KiB and the whole within a few KiB of the
limit. FlashAttention-3 runs 64 x 64 tiles here (hopper/tile_size.h, headdim_v 512), with its V in TMA-fed
buffers Triton does not give us. The compiled figures, read from the entries' metadata, are in
``benchmarks/NOTES.md`` and held by tests/test_flash_fwd_mla.py.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

_STRIDES = tuple((f"stride_{t}{d}", "{index}") for t in ("q", "k", "v", "qv", "o") for d in ("b", "h", "s"))

FLASH_FWD_MLA = KernelSpec(
    name="flash_fwd_mla",
    module="lazytriton.kernels.flash_fwd_mla.triton_kernel",
    function="flash_fwd_mla_kernel",
    params=(
        ("Q", "*{dtype}"),
        ("K", "*{dtype}"),
        ("V", "*{dtype}"),
        ("Qv", "*{dtype}"),
        ("Out", "*{dtype}"),
        ("Lse", "*fp32"),
        ("Cu_seqlens_q", "*i32"),
        ("Cu_seqlens_k", "*i32"),
        ("Seqused_q", "*i32"),
        ("Seqused_k", "*i32"),
        *_STRIDES,
        ("stride_lb", "{index}"),
        ("stride_lh", "{index}"),
        ("group_size", "i32"),
        ("seqlen_q", "i32"),
        ("seqlen_k", "i32"),
        ("head_dim", "i32"),
        ("head_dim_v", "i32"),
        ("causal_offset", "i32"),
        ("window_left", "i32"),
        ("window_right", "i32"),
        ("attention_chunk", "i32"),
        ("sm_scale", "fp32"),
        ("softcap", "fp32"),
    ),
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "BLOCK_DV", "EVEN_DV", "CAUSAL", "WINDOW", "SOFTCAP",
                "VARLEN", "QV", "CHUNK", "SEQUSED_Q", "SEQUSED_K"),
    aligned_params=("Q", "K", "V", "Qv", "Out", "Lse") + tuple(name for name, _ in _STRIDES),
    helpers=("lazytriton.kernels.chunk",),
)


def grid(seqlen_q: int, heads_q: int, batch: int, block_m: int) -> tuple[int, int, int]:
    """Programs: query blocks x query heads x batch (sequences when packed)."""
    return ((seqlen_q + block_m - 1) // block_m, heads_q, batch)
