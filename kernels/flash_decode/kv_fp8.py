"""Float8 KV caches: the formats, their ranges, and the targets that can build them (pure; no torch, no triton).

A float8 cache holds each key and value divided by its descale: ``k_cache``
holds k / k_descale and ``v_cache`` v / v_descale (FlashAttention-3's
convention; a descale of None is 1.0). ``kv_append`` writes new keys and
values that way: x / descale in float32 (correctly rounded), saturated to the
format's finite range (the sign kept, NaN kept), rounded to nearest, ties to
even. The split kernel reads the float8 bytes and dequantises in registers:
k_descale joins the softmax scale, v_descale multiplies the output.

``KV_FP8`` is the variant field of both (flash_decode's split kernel and
kv_append): ``e4m3`` (torch.float8_e4m3fn) or ``e5m2`` (torch.float8_e5m2),
absent for a cache of the queries' dtype (``lazytriton.variant``'s choices).
The combine kernel reads float32 partials already scaled: it has no field.
"""

from __future__ import annotations

from lazytriton.target import Target

NONE = "none"
FORMATS = ("e4m3", "e5m2")
# The largest finite value of each format: new keys and values saturate to it.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
# Triton has no float8e4nv below sm_89 (3.9: "type fp8e4nv not supported in this architecture. The supported
# fp8 dtypes are ('fp8e4b15', 'fp8e5')", compiling for cuda:80 and cuda:86 on this machine); e5m2 compiles on
# every CUDA and HIP target lazytriton knows (sm_80..sm_120, gfx90a..gfx1201).
E4M3_MIN_CAPABILITY = 89


def unsupported(target: Target, kv_fp8: str) -> str | None:
    """Why ``target`` cannot build a ``kv_fp8`` cache's kernels, or None when it can (pure)."""
    if kv_fp8 == "e4m3" and target.backend == "cuda" and (target.capability or 0) < E4M3_MIN_CAPABILITY:
        return (f"{target} has no float8_e4m3fn in Triton (float8e4nv needs sm_89 or newer; the float8_e5m2 cache "
                "works there)")
    return None


def require(target: Target, kv_fp8: str, name: str = "k_cache") -> None:
    """ValueError naming ``name`` when ``target`` cannot build the kernels of a ``kv_fp8`` cache."""
    why = unsupported(target, kv_fp8)
    if why is not None:
        raise ValueError(f"{name} is a float8 ({kv_fp8}) cache but {why}")


def flags(kv_fp8: str) -> dict[str, str]:
    """The variant's KV_FP8 field: written only for a float8 cache (absent: none)."""
    if kv_fp8 not in (NONE, *FORMATS):
        raise ValueError(f"kv_fp8 must be one of {(NONE, *FORMATS)}, got {kv_fp8!r}")
    return {} if kv_fp8 == NONE else {"KV_FP8": kv_fp8}
