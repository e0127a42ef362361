"""When ``flash_fwd_fp8_gluon`` serves an FP8 call, and its variants: the rule, the tiles, the default table.

``flash_fwd_fp8_gluon`` (``fp8_gluon_kernel.py``, described in ``fp8_gluon_spec``) is FlashAttention-3's FP8
forward on ``flash_fwd_gluon``'s ping-pong pipeline, an alternative to ``flash_fwd_fp8`` with its host ABI (the
FP8 forward's binding, ``fp8.py``, launches either). ``reason`` is the rule, pure: None when the kernel computes
a call exactly, else why not. ``fp8.variant`` serves it where ``TABLE`` has a row for the call's (head dim,
causal) and ``fits`` holds (the part of the rule the memo key's buckets cannot see, carried in the key), on
sm_90; ``flash_fwd_fp8`` serves the rest. ``lazytriton cache explain --dtype e4m3`` prints ``explain``'s line
and reports ``served``'s variant; prewarm plans ``prewarm_twin`` (through ``dispatch.prewarm_twins``) and
refuses a miss log's variant that ``built`` turns away. The C API keeps ``flash_fwd_fp8``: this kernel makes
its TMA descriptors on the device, in global scratch memory, which the C API's plans do not pass.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lazytriton.kernels.flash_fwd.fp8_gluon_spec import FLASH_FWD_FP8_GLUON as FLASH_FWD_FP8_GLUON  # re-exported
from lazytriton.kernels.flash_fwd.fp8_gluon_spec import NAME
from lazytriton.kernels.flash_fwd.fp8_spec import FP8_DTYPES

if TYPE_CHECKING:  # lazytriton.variant imports this package: import it where it is used
    from lazytriton.variant import Variant

TARGETS = ("sm_90",)  # wgmma and TMA: Hopper's
HEAD_DIMS = (64, 128, 256)  # one power-of-two tile each; v's head dim the same
# (head dim) -> the (BLOCK_M, BLOCK_N, num_warps) the kernel takes: two consumer warpgroups of 4 warps (64 rows
# each) and the producer warp. float8 is half bf16's bytes, so the key tile doubles where the consumers' 240
# registers hold it: O takes head_dim / 2 fp32 registers a thread, S BLOCK_N / 2 and P (e4m3) BLOCK_N / 8.
# ptxas 13.4 (Triton 3.9) and 3.6's for sm_90a: 64 x 256 and 256 x 128 spill nothing; 128 x 256 spills 96 bytes
# (192 causal; 3.6: 96 / 296), so head dim 128 keeps 128 keys.
CONFIGS: dict[int, tuple[tuple[int, int, int], ...]] = {
    64: ((128, 256, 4), (128, 128, 4)),
    128: ((128, 128, 4),),
    256: ((128, 128, 4), (128, 64, 4)),
}
# The tiles dispatch serves per (head dim, causal): each head dim's first config (untuned: `lazytriton tune
# --kernel flash_fwd_fp8_gluon` on the H200 will say); FlashAttention-3's FP8 forward on H100 takes 192 x 160
# at head dim 64, 128 x 224 at 128 and 128 x 128 at 256 (its tile_size_fwd_sm90; Gluon's tiles are powers of two).
TABLE: dict[tuple[int, bool], tuple[int, int, int]] = {
    (d, causal): CONFIGS[d][0] for d in HEAD_DIMS for causal in (False, True)}
# The switch: False, dispatch never picks flash_fwd_fp8_gluon (``variant`` still builds it for probes, tune and the
# GPU tests, which run it by its variant). Read when a shape is first described (the memo key carries ``fits``):
# set it before the first call.
BY_DEFAULT = True
# The head dims dispatch serves with this kernel when ``BY_DEFAULT`` is on, for the Python calls, whose V's copy
# ``fp8.copy_v`` writes in the P V wgmma's operand order (V_OPERAND_ORDER): every head dim, where it beat
# flash_fwd_fp8 in `bench_flash_fwd.py --fp8` (H100, Triton 3.6, 16k tokens, e4m3, TFLOP/s full / causal: head dim
# 64 561 / 518 against 452 / 440, 128 803 / 728 against 695 / 626, 256 972 / 844 against 610 / 545). Its tests
# serve every head dim of ``TABLE``.
DEFAULT_HEAD_DIMS: frozenset[int] = frozenset({64, 128, 256})
# Those of them where the C API serves it: its callers give V transposed with the keys in order, which the variant
# without V_OPERAND_ORDER reads (P's conversion then exchanges values between lanes); in the same run that beat
# flash_fwd_fp8 at head dim 256 only (944 / 815; 128: 652 / 596, 64: 439 / 350).
KEY_ORDER_HEAD_DIMS: frozenset[int] = frozenset({256})
# sm_90's shared memory for one CTA (227 KiB) and what the kernel takes beside its Q, K and Vt buffers.
SM90_SHARED = 232448
SHARED_SLACK = 1024


# V's keys are read in the P V wgmma's operand order within every KEY_GROUP keys (``fp8.copy_v``).
KEY_GROUP = 32


def reads_operand_order(chosen: Variant) -> bool:
    """Whether the FP8 variant ``chosen`` reads V's keys in operand order (``fp8.copy_v``): V_OPERAND_ORDER's."""
    return chosen.kernel == NAME and bool(chosen.constexprs.get("V_OPERAND_ORDER", False))


def stages(head_dim: int, block_n: int) -> int:
    """K and Vt buffers in the ring: 3 when a K tile is at most 16 KiB, else 2 (the kernel's own rule, ``STAGES``)."""
    return 3 if head_dim * block_n <= 128 * 128 else 2


def shared_bytes(head_dim: int, block_m: int, block_n: int) -> int:
    """The shared memory of the kernel's buffers at these tiles (one byte an element): Q, and the K and Vt rings.

    Compiled for sm_90 (Triton 3.6 and 3.9 alike): 64 x 256 107040, 128 x 128 115232, 256 x 128 164328 bytes.
    """
    return head_dim * (block_m + 2 * stages(head_dim, block_n) * block_n)


def configs(head_dim: int) -> tuple[tuple[int, int, int], ...]:
    """The tiles the kernel takes at ``head_dim`` (none outside ``HEAD_DIMS``)."""
    return CONFIGS.get(head_dim, ())


def reason(target: str, dtype: str, head_dim: int, head_dim_v: int, causal: str, aligned: bool, index64: bool,
           seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, features: bool = False,
           scale: float = 1.0) -> str | None:
    """None if ``flash_fwd_fp8_gluon`` with tiles (block_m, block_n) computes this call exactly, else why not (pure).

    ``causal``: "none", "top_left" or "bottom_right". ``features``: the call has a window, softcap, attention
    chunk or packed sequences (varlen, seqused), which this kernel does not implement. ``scale``: the softmax
    scale, which must be positive (the kernel scales each row's max once instead of every score; the descales,
    read on the device, are FlashAttention-3's positive factors).
    """
    if target not in TARGETS:
        return f"target {target} is not one of {TARGETS} (FP8 wgmma and TMA)"
    if dtype not in FP8_DTYPES:
        return f"dtype {dtype} is not one of {FP8_DTYPES}"
    if head_dim not in HEAD_DIMS or head_dim_v != head_dim:
        return f"head dims ({head_dim}, {head_dim_v}) are not one of {HEAD_DIMS} for both q and v"
    if not aligned or index64:
        return "TMA needs 16-byte aligned pointers and strides, and the kernel 32-bit offsets"
    if features:
        return "window, softcap, attention_chunk and packed sequences are not implemented"
    if (block_m, block_n) not in {t[:2] for t in configs(head_dim)}:
        return f"tiles ({block_m}, {block_n}) are not one of {configs(head_dim)} at head dim {head_dim}"
    if seqlen_q % block_m or seqlen_k % block_n or seqlen_q == 0 or seqlen_k == 0:
        return f"seqlens ({seqlen_q}, {seqlen_k}) must be positive multiples of the tiles ({block_m}, {block_n})"
    if not scale > 0.0:
        return f"softmax scale {scale} is not positive"
    if causal == "bottom_right" and seqlen_q > seqlen_k:
        return "bottom-right causal with seqlen_q > seqlen_k leaves rows without keys"
    return None


def variant(target: str, dtype: str, head_dim: int, causal: str, aligned: bool, index64: bool, seqlen_q: int,
            seqlen_k: int, features: bool = False, tiles: tuple[int, int, int] | None = None, scale: float = 1.0,
            head_dim_v: int | None = None, operand_order: bool = True) -> Variant | None:
    """The ``flash_fwd_fp8_gluon`` variant serving a call, or None where ``reason`` refuses it (pure).

    ``tiles``: (BLOCK_M, BLOCK_N, num_warps), one of ``configs(head_dim)`` (default its first); a tiling outside
    them is a ValueError. Its functional fields are ``flash_fwd_gluon``'s (ALIGN16, BLOCK_D, CAUSAL, EVEN_D,
    INDEX64) and V_OPERAND_ORDER where ``operand_order`` (V's copy in the P V wgmma's operand order, ``fp8.copy_v``:
    the Python calls'; the C API's callers give V with its keys in order); num_stages records the kernel's own ring
    depth (``stages``), which Gluon does not take from the option.
    """
    from lazytriton.variant import Variant, pairs

    allowed = configs(head_dim)
    if tiles is None and allowed:
        tiles = allowed[0]
    if tiles is None or tuple(tiles) not in allowed:
        raise ValueError(f"tiles must be one of {allowed} (BLOCK_M, BLOCK_N, num_warps) at head dim {head_dim}, "
                         f"got {tiles!r}")
    block_m, block_n, num_warps = tiles
    dv = head_dim if head_dim_v is None else head_dim_v
    if reason(target, dtype, head_dim, dv, causal, aligned, index64, seqlen_q, seqlen_k, block_m, block_n,
              features, scale):
        return None
    functional = {"ALIGN16": True, "BLOCK_D": head_dim, "CAUSAL": causal != "none", "EVEN_D": True,
                  "INDEX64": False, **({"V_OPERAND_ORDER": True} if operand_order else {})}
    return Variant(NAME, target, dtype, pairs(functional), pairs({"BLOCK_M": block_m, "BLOCK_N": block_n}),
                   pairs({"num_stages": stages(head_dim, block_n), "num_warps": num_warps}))


def built(variant: Variant) -> str | None:
    """Why a variant of this kernel (a miss log's line, say) is not one it builds, else None (pure).

    Its target must be one of ``TARGETS`` and its (BLOCK_M, BLOCK_N, num_warps) one of ``configs(BLOCK_D)``.
    """
    if variant.target not in TARGETS:
        return f"{NAME} is built for {TARGETS} only (FP8 wgmma and TMA), not {variant.target}"
    head_dim = int(variant.get("BLOCK_D"))
    tiles = tuple(int(variant.get(name)) for name in ("BLOCK_M", "BLOCK_N", "num_warps"))
    if tiles not in configs(head_dim):
        return f"tiles {tiles} are not one of {configs(head_dim)} (BLOCK_M, BLOCK_N, num_warps) at head dim {head_dim}"
    return None


def served_head_dims(operand_order: bool = True) -> frozenset[int]:
    """The head dims dispatch serves with this kernel: the Python calls' (V in operand order) or the C API's."""
    return DEFAULT_HEAD_DIMS if operand_order else DEFAULT_HEAD_DIMS & KEY_ORDER_HEAD_DIMS


def default_tiles(head_dim: int, causal: bool, operand_order: bool = True) -> tuple[int, int, int] | None:
    """``TABLE``'s tiles for (head dim, causal), or None where flash_fwd_fp8 serves.

    That is: ``BY_DEFAULT`` off, a head dim outside ``served_head_dims(operand_order)``, or no row.
    """
    return (TABLE.get((head_dim, bool(causal))) if BY_DEFAULT and head_dim in served_head_dims(operand_order)
            else None)


def fits(head_dim: int, head_dim_v: int, causal: bool, offset: int, scale: float, seqlen_q: int, seqlen_k: int,
         features: bool) -> bool:
    """Whether a call is one the kernel serves by default, as far as its shape and flags say (the memo key's bit).

    A ``TABLE`` row, v's head dim q's, seqlens positive multiples of the row's tiles, a positive softmax scale,
    a causal offset >= 0, none of the ``features``. Target, dtype, alignment and 64-bit offsets are decided by
    the plan (``default_variant``).
    """
    tiles = default_tiles(head_dim, causal)
    if tiles is None or features or head_dim_v != head_dim:
        return False
    block_m, block_n, _ = tiles
    return (0 < seqlen_q and seqlen_q % block_m == 0 and 0 < seqlen_k and seqlen_k % block_n == 0
            and scale > 0.0 and (not causal or offset >= 0))


def default_variant(target: str, dtype: str, head_dim: int, causal: bool, aligned: bool, index64: bool,
                    seqlen_q: int, seqlen_k: int, operand_order: bool = True) -> Variant | None:
    """The variant ``TABLE`` serves for a call that ``fits``, or None (flash_fwd_fp8 serves: target, alignment).

    ``operand_order``: ``variant``'s; True for the Python calls, False for the C API's (``KEY_ORDER_HEAD_DIMS``).
    """
    tiles = default_tiles(head_dim, causal, operand_order)
    if tiles is None:
        return None
    return variant(target, dtype, head_dim, "top_left" if causal else "none", aligned, index64, seqlen_q, seqlen_k,
                   tiles=tiles, operand_order=operand_order)


def prewarm_twin(target: str, dtype: str, head_dim: int, causal: bool, aligned: bool, index64: bool,
                 seqlen_q: int, seqlen_k: int) -> Variant | None:
    """The variant of this kernel a plain FP8 call of the shape runs, for prewarm; None where flash_fwd_fp8 serves.

    ``fp8.variant``'s choice for a dense call without a window, softcap or chunk, at the default softmax scale:
    ``fits``, then ``default_variant`` (the target, alignment and 64-bit offsets). Prewarm's causal calls are
    FlashAttention's (bottom-right), so a causal offset is seqlen_k - seqlen_q.
    """
    offset = seqlen_k - seqlen_q if causal else 0
    if not fits(head_dim, head_dim, causal, offset, 1.0 / math.sqrt(head_dim), seqlen_q, seqlen_k, False):
        return None
    return default_variant(target, dtype, head_dim, causal, aligned, index64, seqlen_q, seqlen_k)


def _why_not(target: str, dtype: str, head_dim: int, head_dim_v: int, causal: str, aligned: bool, index64: bool,
             seqlen_q: int, seqlen_k: int, features: bool) -> str | None:
    """Why a described call is not this kernel's by default, or None where it is (``explain``, ``served``)."""
    tiles = default_tiles(head_dim, causal != "none")
    if tiles is None:
        if not BY_DEFAULT:
            return "fp8_gluon.BY_DEFAULT is off"
        if head_dim in HEAD_DIMS and head_dim not in DEFAULT_HEAD_DIMS:
            served_dims = sorted(DEFAULT_HEAD_DIMS)
            return f"flash_fwd_fp8 is faster at head dim {head_dim} (fp8_gluon.DEFAULT_HEAD_DIMS: {served_dims})"
        return f"no table row for head dim {head_dim} (it serves {HEAD_DIMS})"
    return reason(target, dtype, head_dim, head_dim_v, causal, aligned, index64, seqlen_q, seqlen_k, tiles[0],
                  tiles[1], features)


def served(target: str, dtype: str, head_dim: int, head_dim_v: int, causal: str, aligned: bool, index64: bool,
           seqlen_q: int, seqlen_k: int, features: bool) -> Variant | None:
    """The variant of this kernel a described call (``cache explain``'s) runs, or None where flash_fwd_fp8 serves.

    ``causal``: "none", "top_left" or "bottom_right"; ``features``: a window, softcap, chunk or packed sequences.
    """
    if _why_not(target, dtype, head_dim, head_dim_v, causal, aligned, index64, seqlen_q, seqlen_k, features):
        return None
    return default_variant(target, dtype, head_dim, causal != "none", aligned, index64, seqlen_q, seqlen_k)


def explain(target: str, dtype: str, head_dim: int, head_dim_v: int, causal: str, aligned: bool, index64: bool,
            seqlen_q: int, seqlen_k: int, features: bool) -> str:
    """``cache explain``'s line on the FP8 Gluon forward for a described call: its variant, or why not."""
    why = _why_not(target, dtype, head_dim, head_dim_v, causal, aligned, index64, seqlen_q, seqlen_k, features)
    if why is None:
        chosen = default_variant(target, dtype, head_dim, causal != "none", aligned, index64, seqlen_q, seqlen_k)
        return f"the Gluon FP8 forward serves it: {chosen}"
    return f"flash_fwd_fp8 serves it, not the Gluon FP8 forward ({NAME}): {why}"
