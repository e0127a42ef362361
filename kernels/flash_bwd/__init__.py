"""Description of the FlashAttention-2 backward kernels (``triton_kernel.py``).

The family ``flash_bwd`` has two kernels, launched in this order on one stream:
``flash_bwd_dq`` (delta = rowsum(dO * O), then dQ; one program per query
block) and ``flash_bwd_dkdv`` (dK and dV; one program per key block of a
key/value head). Their parameters follow the forward's conventions: pointers,
then strides in (batch, head, seqlen) order, then sizes, then the one float.
``Lse`` and ``Delta`` are contiguous (batch, heads_q, seqlen_q) float32 and
share ``stride_lb``/``stride_lh``. ``WINDOW``, ``SOFTCAP``, ``ALIBI``, ``BIAS`` and
``DROPOUT`` are the forward's flags (written only when true) with the
forward's runtime values and pointers (the same ``Philox`` tensor regenerates
the forward's dropout mask), and so is ``VARLEN``, with the forward's two
pointers (``Cu_seqlens_q``, ``Cu_seqlens_k``) after each kernel's own
pointers (then the score modifications'); with it ``Lse`` and ``Delta`` are
(heads_q, total_q). ``SEQUSED_Q``/``SEQUSED_K`` are the forward's used lengths,
with its two pointers (``Seqused_q``, ``Seqused_k``) after the score
modifications'. ``ALIGN16`` variants may assume every
pointer and every stride of the eight (b, h, s, d) tensors is a multiple of
16 (``aligned_params``); ``SEQ16`` variants (dense calls only, always with
``ALIGN16``) also the seqlens and the lse/delta strides, heads_q x seqlen_q
and seqlen_q (``seq_aligned_params``). ``BLOCK_D2`` is the forward's split
tiles (the head dim as BLOCK_D then BLOCK_D2), written only when set; absent,
it is 0 (padding), so the strings of padded variants are what they were.
``BIAS_GRAD`` (``flash_bwd_dq`` only, with ``BIAS``, written only when true)
stores the bias's gradient dS into ``DBias`` (q's dtype, (batch, heads_q,
seqlen_q, seqlen_k) with 64-bit strides ``stride_dbias{b,h,m}`` and a
contiguous last dim), the pointer after the seqused pointers and its strides
after the lse strides; 0 without it.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec
from lazytriton.kernels.flash_fwd import MOD_POINTERS as _MOD_POINTERS
from lazytriton.kernels.flash_fwd import SEQUSED_POINTERS as _SEQUSED_POINTERS
from lazytriton.kernels.flash_fwd import SIZES as _SIZES
from lazytriton.kernels.flash_fwd import VARLEN_POINTERS as _VARLEN_POINTERS

FAMILY = "flash_bwd"
MODULE = "lazytriton.kernels.flash_bwd.triton_kernel"
_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "CAUSAL", "WINDOW", "SOFTCAP", "VARLEN", "ALIBI", "BIAS",
               "DROPOUT", "BLOCK_DV", "EVEN_DV", "BLOCK_D2", "SEQUSED_Q", "SEQUSED_K")
# flash_bwd_dq's bias gradient: its pointer (after the seqused pointers) and strides (after the lse strides).
# The strides are 64-bit as the bias's are; the binding allocates the gradient with its last dim padded to a
# multiple of 16 (torch's mem-efficient backend pads its grad_bias the same way), so they take ALIGN16's hints.
DBIAS_POINTER = (("DBias", "*{dtype}"),)
DBIAS_STRIDES = (("stride_dbiasb", "i64"), ("stride_dbiash", "i64"), ("stride_dbiasm", "i64"))


# With SEQ16 the seqlens (and so the lse/delta strides, heads_q x seqlen_q and
# seqlen_q) are multiples of 16: the row masks are then uniform over 16 rows
# and masked loads vectorise. Triton's JIT infers this for 4096 and ran these
# kernels 10% faster than our entries without it (bench_flash_bwd.py, H200,
# hd128 bf16: 369 against 330 TFLOP/s at 4k). It is a flag of its own, apart
# from ALIGN16 (pointers and data strides): when one flag covered both, an odd
# length or any varlen call lost every hint and ran 3x slower (130 against 389
# TFLOP/s on the H200).
_SEQ_SIZES = ("seqlen_q", "seqlen_k")
_LSE_STRIDES = (("stride_lb", "{index}"), ("stride_lh", "{index}"))


def _strides(*tensors: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"stride_{t}{d}", "{index}") for t in tensors for d in ("b", "h", "s"))


def _spec(name: str, function: str, pointers: tuple[tuple[str, str], ...], strided: tuple[str, ...],
          bias_grad: bool = False) -> KernelSpec:
    strides = _strides(*strided)
    dbias, dbias_strides = (DBIAS_POINTER, DBIAS_STRIDES) if bias_grad else ((), ())
    return KernelSpec(
        name=name,
        module=MODULE,
        function=function,
        params=(*pointers, *_VARLEN_POINTERS, *_MOD_POINTERS, *_SEQUSED_POINTERS, *dbias, *strides, *_LSE_STRIDES,
                *dbias_strides, *_SIZES),
        constexprs=_CONSTEXPRS + (("BIAS_GRAD",) if bias_grad else ()) + ("CHUNK",),
        aligned_params=tuple(p for p, _ in (*pointers, *dbias)) + tuple(s for s, _ in (*strides, *dbias_strides)),
        seq_aligned_params=tuple(s for s, _ in _LSE_STRIDES) + _SEQ_SIZES,
        helpers=("lazytriton.kernels.chunk",),
    )


FLASH_BWD_DQ = _spec(
    "flash_bwd_dq", "flash_bwd_dq_kernel",
    (("Q", "*{dtype}"), ("K", "*{dtype}"), ("V", "*{dtype}"), ("Out", "*{dtype}"), ("DO", "*{dtype}"),
     ("Lse", "*fp32"), ("Delta", "*fp32"), ("DQ", "*{dtype}")),
    ("q", "k", "v", "o", "do", "dq"),
    bias_grad=True,
)

FLASH_BWD_DKDV = _spec(
    "flash_bwd_dkdv", "flash_bwd_dkdv_kernel",
    (("Q", "*{dtype}"), ("K", "*{dtype}"), ("V", "*{dtype}"), ("DO", "*{dtype}"), ("Lse", "*fp32"),
     ("Delta", "*fp32"), ("DK", "*{dtype}"), ("DV", "*{dtype}")),
    ("q", "k", "v", "do", "dk", "dv"),
)

KERNELS = (FLASH_BWD_DQ, FLASH_BWD_DKDV)


def dq_grid(seqlen_q: int, heads_q: int, batch: int, block_m: int) -> tuple[int, int, int]:
    """DQ programs: query blocks x query heads x batch."""
    return ((seqlen_q + block_m - 1) // block_m, heads_q, batch)


def dkdv_grid(seqlen_k: int, heads_k: int, batch: int, block_n: int) -> tuple[int, int, int]:
    """dK/dV programs: key blocks x key/value heads x batch (each sums its group of query heads)."""
    return ((seqlen_k + block_n - 1) // block_n, heads_k, batch)
