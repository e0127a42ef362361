"""What a prewarm may build: the targets it knows, and variants that cannot fit refused before compiling.

A miss log is input from another machine: one line asking for BLOCK_M=1024,
BLOCK_N=1024 at fp32 and head dim 256 kept a worker compiling for over six
minutes at 7.8 GiB before Triton gave up. ``refusal`` turns such a variant
away in microseconds, with a reason, from its tile sizes alone. It is pure.

The shared-memory estimate is a lower bound of what Triton allocates for
``flash_fwd``, measured against Triton 3.5's own figure (``Entry.shared``) on
the default configs (2026-11-30, this machine, no GPU needed to compile):

- CUDA: the Q tile plus the K and V tiles of every pipeline stage but the
  last, ``(BLOCK_M + 2 * BLOCK_N * max(1, num_stages - 1)) * BLOCK_D * bytes``.
  sm_90 fp16 128/64, 4 stages, head dim 128: estimate 128 KiB, Triton 160;
  sm_80 the same at 3 stages: 96 and 96; fp32 64/16, 1 stage, 256: 96 and 96.
- HIP: one K and one V tile, ``2 * BLOCK_N * BLOCK_D * bytes`` (Q is not kept
  in LDS): gfx942 fp16 128/64 at head dim 64, 128: 16 and 32 KiB, Triton 16
  and 32; 64/32 at 256: 32 and 36 KiB; fp32 64/16, 1 stage, 256: 32 and 64.

The backward kernels (``flash_bwd_dq``, ``flash_bwd_dkdv``) each hold one
pair of tiles for the whole program (q and dO of BLOCK_M rows in dq; k and v
of BLOCK_N rows in dK/dV) and stream the other pair (k and v; q and dO)
through the loop. Their bound, measured against Triton 3.9's ``Entry.shared``
(2026-11-30, this machine, compile_variant, default configs and a few more):

- CUDA: both held tiles plus both streamed tiles of every pipeline stage but
  the last, ``(2 * held + 2 * streamed * max(1, num_stages - 1)) * BLOCK_D *
  bytes``. sm_90 fp16 head dim 128, dq 128/32 and dK/dV 32/128, 3 stages:
  estimate 96 KiB, Triton 112 and 112.5; sm_80 the same: 96, Triton 96 and
  96.5; sm_90 bf16 256, 64/32 and 32/64, 1 stage: 96 and 96; sm_80 fp32 256,
  32/16 and 16/32: 96, Triton 96 and 98; sm_86 dK/dV fp16 128 32/64, 2 stages:
  48, Triton 52.25 (tests/test_prewarm_limits.py holds the table).
- HIP: one tile of each streamed pair, ``2 * streamed * BLOCK_D * bytes``
  (the held ones are not kept in LDS): gfx942 fp16 head dim 128, dq 128/32
  and dK/dV 32/128, 2 stages: 16 KiB, Triton 32 and 32.

Being a lower bound, it never refuses a variant that fits; it refuses those
that could not fit whatever the compiler did (a cubin needing more shared
memory than the GPU has compiles, but fails to load on it).
"""

from __future__ import annotations

from lazytriton.kernels.flash_decode import kv_fp8
from lazytriton.kernels.flash_fwd import fp8_gluon
from lazytriton.record import record
from lazytriton.target import Target
from lazytriton.variant import Variant

# Tiles above this are refused whatever the target: no tuned or default
# config uses more than 128, and Triton's compile time and memory grow with
# the tile (1024 x 1024 took minutes and gigabytes before failing).
MAX_BLOCK_MN = 256
MAX_BLOCK_D = 256
# v's tile goes to 512 (DeepSeek's MLA decode): BLOCK_DV, and the BLOCK_D of the kernel whose head dim is v's.
MAX_BLOCK_DV = 512
VALUE_TILE_KERNELS = ("flash_decode_combine",)
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "e4m3": 1, "e5m2": 1}


@record
class TargetLimits:
    """What a target offers one program: shared memory (LDS on AMD) per block, in bytes."""

    shared: int


_KIB = 1024
# Per-block maxima (opt-in) from the CUDA programming guide's table of compute
# capabilities and AMD's CDNA/RDNA ISA guides. A target not listed here is
# refused by ``--target`` (add it here once Triton compiles for it).
KNOWN_TARGETS: dict[str, TargetLimits] = {
    "sm_80": TargetLimits(163 * _KIB),
    "sm_86": TargetLimits(99 * _KIB),
    "sm_87": TargetLimits(163 * _KIB),
    "sm_89": TargetLimits(99 * _KIB),
    "sm_90": TargetLimits(227 * _KIB),
    "sm_100": TargetLimits(227 * _KIB),
    "sm_120": TargetLimits(99 * _KIB),
    "gfx90a": TargetLimits(64 * _KIB),
    "gfx942": TargetLimits(64 * _KIB),
    "gfx950": TargetLimits(160 * _KIB),  # CDNA4 grew the LDS to 160 KiB per CU
    "gfx1100": TargetLimits(64 * _KIB),
    "gfx1101": TargetLimits(64 * _KIB),
    "gfx1200": TargetLimits(64 * _KIB),
    "gfx1201": TargetLimits(64 * _KIB),
}


def known_target(text: str) -> Target:
    """The target ``text`` names, if prewarm knows it; else ValueError listing the known ones."""
    target = Target.parse(text)  # ValueError for a malformed name
    if str(target) not in KNOWN_TARGETS:
        raise ValueError(f"unknown target {text!r}; known targets: {', '.join(KNOWN_TARGETS)}")
    return target


# The kernels the estimate knows: ``refusal`` checks only the tile caps of any other.
ESTIMATED_KERNELS = ("flash_fwd", "flash_fwd_fp8", "flash_bwd_dq", "flash_bwd_dkdv")


def estimate_shared(variant: Variant) -> int:
    """A lower bound, in bytes, of the shared memory a variant of ``ESTIMATED_KERNELS`` needs (module docstring)."""
    block_m, block_n, block_d = (int(variant.get(name)) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_D"))
    block_d += int(dict(variant.functional).get("BLOCK_D2", 0))  # split tiles hold both chunks of every row
    tile = block_d * DTYPE_BYTES[variant.dtype]
    stages = max(1, int(variant.get("num_stages")) - 1)
    hip = Target.parse(variant.target).backend == "hip"
    if variant.kernel in ("flash_fwd", "flash_fwd_fp8"):
        return 2 * block_n * tile if hip else (block_m + 2 * block_n * stages) * tile
    if variant.kernel not in ESTIMATED_KERNELS:
        raise ValueError(f"no shared-memory estimate for kernel {variant.kernel!r}; known: {ESTIMATED_KERNELS}")
    held, streamed = (block_m, block_n) if variant.kernel == "flash_bwd_dq" else (block_n, block_m)
    return 2 * streamed * tile if hip else (2 * held + 2 * streamed * stages) * tile


def refusal(variant: Variant) -> str | None:
    """Why ``variant`` cannot be built (too large a tile, or more shared memory than its target has); None if it may.

    ``variant`` must have passed ``lazytriton.variant.check_fields``. A target
    missing from ``KNOWN_TARGETS``, or a kernel outside ``ESTIMATED_KERNELS``,
    is checked against the tile caps only. A float8 cache's kernels (KV_FP8) on a
    target without that format (``kv_fp8.unsupported``: e4m3 below sm_89) are refused too, and so is a
    ``flash_fwd_fp8_gluon`` variant off its target or tiles (``fp8_gluon.built``).
    """
    tiles = max(1, int(variant.constexprs.get("BLOCK_TILES", 0)))  # flash_fwd_gluon: BLOCK_M rows are that many tiles
    block_d_cap = MAX_BLOCK_DV if variant.kernel in VALUE_TILE_KERNELS else MAX_BLOCK_D
    for name, cap in (("BLOCK_M", MAX_BLOCK_MN), ("BLOCK_N", MAX_BLOCK_MN), ("BLOCK_D", block_d_cap),
                      ("BLOCK_D2", MAX_BLOCK_D), ("BLOCK_DV", MAX_BLOCK_DV)):
        value = int(variant.constexprs.get(name, 0))  # kv_append has no BLOCK_N (a copy, no key tile)
        value = value // tiles if name == "BLOCK_M" else value  # the cap is on a tile
        if value > cap:
            return f"{name}={value} is over the cap of {cap}"
    block_d2 = int(variant.constexprs.get("BLOCK_D2", 0))
    if block_d2 and block_d2 + int(variant.constexprs.get("BLOCK_D", 0)) > MAX_BLOCK_D:
        total = block_d2 + int(variant.constexprs.get("BLOCK_D", 0))
        return f"BLOCK_D + BLOCK_D2 = {total} is over the cap of {MAX_BLOCK_D}"
    if variant.kernel == fp8_gluon.NAME and (why := fp8_gluon.built(variant)) is not None:
        return why
    kv = variant.constexprs.get("KV_FP8")
    if isinstance(kv, str) and (why := kv_fp8.unsupported(Target.parse(variant.target), kv)) is not None:
        return why
    limits = KNOWN_TARGETS.get(variant.target)
    if limits is None or variant.kernel not in ESTIMATED_KERNELS:
        return None
    need = estimate_shared(variant)
    if need > limits.shared:
        return (f"needs at least {need / _KIB:g} KiB of shared memory (tiles BLOCK_M x BLOCK_N x BLOCK_D at "
                f"{variant.dtype}, num_stages={variant.get('num_stages')}); {variant.target} has "
                f"{limits.shared / _KIB:g} KiB")
    return None
