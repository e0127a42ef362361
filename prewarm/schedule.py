"""The order in which a build hands variants to its workers: longest first (LPT), from an estimate.

A parallel build ends when its last variant does. Compile times are heavy
tailed: on the default sm_90 plan most variants take 0.6-2 s, fp32 ones 3-9
s, and fp32 ``flash_bwd_dkdv`` at head dim 128 with BLOCK_N=64 30-80 s (a 2
MB cubin). In plan order (kernel, dtype, head dim) the heaviest come last,
so 15 of 16 workers idled while the last fp32 variants compiled. Handing out
the longest first (LPT: longest processing time first) lets the short ones
fill in around them; its makespan is at most 4/3 of the best possible.

The order needs only a rank, so ``estimate_seconds`` is a rough model,
fitted on 52 variants of the default sm_90 plan compiled one at a time
(Triton 3.9, 2-core AMD EPYC, 2026-11-30; log-space RMS error 0.37, Spearman
rank correlation 0.89 with the measured times; benchmarks/NOTES.md, "Prewarm
scaling")::

    seconds = SCALE[dtype class] * KERNEL[kernel] * (BLOCK_M * BLOCK_N * BLOCK_D / threads) ** EXPONENT[dtype class]

The tile volume per thread is what Triton unrolls into each thread's code: a
16-bit dot becomes a few tensor-core instructions (exponent 0.29), an fp32
dot becomes FMAs (0.88), whence the fp32 outliers. A variant without those
fields (a kernel family added later) gets ``UNKNOWN_SECONDS``. Everything
here is pure; the order is deterministic, and it changes only when variants
are compiled, never what is built: the image's bytes do not depend on it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from lazytriton.prewarm.enumeration import Planned
from lazytriton.variant import Variant

# Per-kernel factor: the backward kernels hold more dots per loop (dq three, dK/dV four; the forward two).
# The decoding kernels' factors: the geometric mean of measured over estimated time relative
# to the forward's, on the bench plan's 24 split and 2 combine variants (Triton 3.6, CPU seconds, this
# machine, 2026-11-30; log-space spread 0.14). Without them the split kernel, the longest of the bench
# plan (1.6-3.5 s against 0.4-3.1 for the rest), was estimated at 1.0x and handed out among the last.
KERNEL_FACTOR = {"flash_fwd": 1.0, "flash_bwd_dq": 1.28, "flash_bwd_dkdv": 2.16, "flash_decode_split": 2.7,
                 "flash_decode_combine": 1.1}
# flash_fwd_gluon, by (PINGPONG, CAUSAL), on the tile a program holds (BLOCK_M / BLOCK_TILES rows): fitted on 8 of
# its variants compiled one at a time beside 4 flash_fwd ones (Triton 3.9, this machine, 2026-12-01; measured over
# estimated time, flash_fwd's ratio 0.81-1.23): plain 0.61-0.84; ping-pong 1.22-1.43, causal 1.62-2.26 (two
# consumer partitions and a producer, each with its loops). Without them the H200 bench's two longest compiles
# (hd256 ping-pong causal, 3.7-3.9 s) were estimated at 2 s, handed out at 5.6 s of 10.6 and finished last.
GLUON_FACTOR = {(False, False): 0.72, (False, True): 0.72, (True, False): 1.34, (True, True): 1.88}
# Its wide tiles (three consumer partitions of 64 rows and a producer warp: BLOCK_M 192 at 4 warps, PINGPONG off),
# by CAUSAL: fitted on their hd64 variants beside ping-pong hd128 and hd256 causal ones, compiled one at a time
# (Triton 3.9, this machine, 2026-12-02, wall seconds with ptxas: wide causal 4.11, full 3.42, ping-pong 3.30 and
# 4.26). Taken as plain they were estimated at 1.3 s: on the H200 (2026-12-02, 96 variants at -j 16) they were
# handed out at 7.9-8.2 s of 12.3, compiled 2.9-4.0 s and finished last, the workers idle 2 s (median) at the end.
GLUON_WIDE_FACTOR = {False: 1.65, True: 1.98}
# The fused backward's kernels have no BLOCK_N field: the keys a program holds (flash_bwd_fused_gluon: two
# warpgroups of 64, or 64 split by columns at head dim 256: WIDE_HELD_KEYS) or one (flash_bwd_prep: a row-wise
# pass). Factors fitted on its 8 variants of the default table (bf16, hd64/128, both causal modes) compiled
# twice beside 4 flash_fwd ones (Triton 3.6, this machine, 2026-12-01; measured over estimated time relative to
# flash_fwd's): fused 1.38-1.55 (three partitions, five products a step), prep 0.67-0.75. Without them both took
# UNKNOWN_SECONDS: the fused kernel, 1.6-1.8 s of compile against flash_fwd's 0.7-1.1, was ranked with the
# median variant. The hd256 program compiled in 1.1-2.4 s here (Triton 3.6), as hd128's: the same factor.
HELD_KEYS = {"flash_bwd_fused_gluon": 128, "flash_bwd_prep": 1}
WIDE_HELD_KEYS = {"flash_bwd_fused_gluon": 64}  # above head dim 128 (kernels/flash_bwd/fused.py: block_n)
KERNEL_FACTOR.update({"flash_bwd_fused_gluon": 1.45, "flash_bwd_prep": 0.7})
SCALE = {"16-bit": 0.119, "fp32": 0.0109}
EXPONENT = {"16-bit": 0.29, "fp32": 0.88}
UNKNOWN_SECONDS = 1.0  # about the median of the default plan's variants
_WARP_THREADS = {"cuda": 32, "hip": 64}


def estimate_seconds(variant: Variant) -> float:
    """A rough compile time of ``variant`` in seconds (module docstring): only its rank among others matters."""
    try:
        block_m, block_d, warps = (int(variant.get(name)) for name in ("BLOCK_M", "BLOCK_D", "num_warps"))
        block_d += int(variant.constexprs.get("BLOCK_D2", 0))  # type: ignore[call-overload]  # split: both chunks
        held = WIDE_HELD_KEYS if block_d > 128 and variant.kernel in WIDE_HELD_KEYS else HELD_KEYS
        block_n = held[variant.kernel] if variant.kernel in held else int(variant.get("BLOCK_N"))
    except (KeyError, TypeError, ValueError):
        return UNKNOWN_SECONDS
    threads = max(1, warps) * _WARP_THREADS["hip" if variant.target.startswith("gfx") else "cuda"]
    factor = KERNEL_FACTOR.get(variant.kernel, 1.0)
    if variant.kernel == "flash_fwd_gluon":
        constexprs = variant.constexprs
        block_m //= max(1, int(constexprs.get("BLOCK_TILES", 1)))  # type: ignore[call-overload]
        causal = bool(constexprs.get("CAUSAL"))
        if block_m // (16 * max(1, warps)) == 3:  # three consumer partitions: the wide tiles
            factor = GLUON_WIDE_FACTOR[causal]
        else:
            factor = GLUON_FACTOR[bool(constexprs.get("PINGPONG")), causal]
    per_thread = max(1.0, block_m * block_n * block_d / threads)
    kind = "fp32" if variant.dtype == "fp32" else "16-bit"
    return SCALE[kind] * factor * per_thread ** EXPONENT[kind]


def longest_first(todo: Sequence[Planned]) -> list[Planned]:
    """``todo`` ordered by estimated compile time, longest first; ties keep their order in ``todo``."""
    return sorted(todo, key=lambda planned: -estimate_seconds(planned.variant))


def samples_first(order: Sequence[Planned], samples: Collection[str]) -> list[Planned]:
    """``order`` with the variants whose keys are in ``samples`` moved to the front, each part in its own order.

    The image's dictionary is trained on its first entries in key order
    (``packing``); compiled first, they let every later entry be compressed
    while the rest compile. On the bench plan's 96 variants (their Triton 3.6
    CPU times, 16 workers, no sharing) the compiles end at 7.56 s with its 32
    samples moved ahead against 7.58 s in plain longest-first order (ideal
    7.29): the end of the order, the shortest variants, is what fills the tail.
    """
    wanted = set(samples)
    return [p for p in order if p.key in wanted] + [p for p in order if p.key not in wanted]
