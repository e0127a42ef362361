"""The description of ``flash_fwd_fp8`` (``triton_kernel.py``'s ``flash_fwd_fp8_kernel``): the FP8 forward.

FlashAttention-3's FP8 forward: e4m3 q, k and v (the variant's dtype
``e4m3``, Triton's ``fp8e4nv``), or e5m2 ones (``e5m2``, ``fp8e5``; the
probabilities still rounded to e4m3 for their product with v), float32
descales per (batch, kv head) or per tensor (a null pointer: 1.0), the output
in bf16 (FlashAttention-3's output dtype for FP8 inputs).
The same body as ``flash_fwd`` (``triton_kernel._forward``), with V read from
its transpose (``_load_k_vt`` says why) and none of the score modifications,
sinks, TMA or split tiles; a kernel of its own, so that ``flash_fwd``'s
parameters (which the Gluon forward and the C API share) stay as they are.

Its pointers: flash_fwd's tensors, the varlen and seqused pointers (0 when
unused, as flash_fwd's), then ``Q_descale``, ``K_descale``, ``V_descale``;
its integers flash_fwd's strides and sizes up to ``attention_chunk``, then
each descale's (batch, kv head) strides (0 on a broadcast dim); its floats
``sm_scale`` and ``softcap``.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec
from lazytriton.kernels.flash_fwd import FLASH_FWD, SEQUSED_POINTERS, SIZES, VARLEN_POINTERS
from lazytriton.target import Target
from lazytriton.tiles import Config, seqlen_class

NAME = "flash_fwd_fp8"
DESCALE_POINTERS = (("Q_descale", "*fp32"), ("K_descale", "*fp32"), ("V_descale", "*fp32"))
DESCALE_STRIDES = tuple((f"stride_{t}d{d}", "i32") for t in "qkv" for d in "bh")
# flash_fwd's tensors' strides ({index}: 64-bit under INDEX64), then its sizes but the score modifications'.
_STRIDES = tuple(item for item in FLASH_FWD.params if item[1] == "{index}")
_SIZES = tuple(item for item in SIZES if not item[0].startswith(("stride_", "dropout")))

FLASH_FWD_FP8 = KernelSpec(
    name=NAME,
    module=FLASH_FWD.module,
    function="flash_fwd_fp8_kernel",
    params=(
        ("Q", "*{dtype}"),
        ("K", "*{dtype}"),
        ("V", "*{dtype}"),
        ("Out", "*bf16"),
        ("Lse", "*fp32"),
        *VARLEN_POINTERS,
        *SEQUSED_POINTERS,
        *DESCALE_POINTERS,
        *_STRIDES,
        *(item for item in _SIZES if not item[1].startswith("fp")),
        *DESCALE_STRIDES,
        *(item for item in _SIZES if item[1].startswith("fp")),
    ),
    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "CAUSAL", "WINDOW", "SOFTCAP", "VARLEN", "BLOCK_DV",
                "EVEN_DV", "SEQUSED_Q", "SEQUSED_K", "CHUNK"),
    aligned_params=FLASH_FWD.aligned_params,
    helpers=FLASH_FWD.helpers,
)

# The dtypes of q, k and v the FP8 forward takes (the variant's dtype; all three one); its output is bf16.
FP8_DTYPES = ("e4m3", "e5m2")


def fp8_refusal(target: Target) -> str | None:
    """Why the FP8 forward does not serve ``target`` (None: it does). Pure.

    FP8 tensor cores: CUDA sm_90 (Hopper's wgmma: e4m3 x e4m3 for both
    products of e4m3 inputs, e5m2 x e5m2 and e4m3 x e5m2 for e5m2 ones, read
    from this kernel's PTX) and later. sm_80 (Ampere) has none.
    Triton 3.9's AMD backend runs OCP FP8 (e4m3fn) natively from CDNA4
    (gfx950) and emulates it on gfx942, whose matrix cores take the FNUZ
    format (torch.float8_e4m3fnuz) instead; neither is measured here.
    """
    if target.backend == "cuda":
        if target.capability >= 90:
            return None
        return f"{target} has no FP8 tensor cores (the FP8 forward needs sm_90 or later: Hopper's FP8 wgmma)"
    return (f"{target}: the FP8 forward serves CUDA sm_90+ only (gfx942's matrix cores take FNUZ e4m3, which Triton "
            "emulates for e4m3fn; gfx950's OCP FP8 is not measured here)")


def fp8_default_config(target: Target, head_dim: int, seqlen_q: int) -> Config:
    """The FP8 forward's tiles where the tuning table has no row of its dtype: untuned (no H200 sweep of it yet).

    The bf16 kernel's sm_90 shapes at twice the key tile where shared memory
    allows it (float8 is half the bytes: 128 x 128 x 8 warps x 3 stages is
    64 KiB at head dim 128), 128 x 64 x 2 stages at head dim 256 (96 KiB),
    read from the compiled entries' shared sizes; a short seqlen_q takes its
    class's BLOCK_M as the bf16 kernel does.
    """
    block_m = min(128, seqlen_class(seqlen_q))
    if head_dim >= 256:
        cfg = Config(128, 64, 8, 2)
    else:
        cfg = Config(128, 128, 8, 3)
    if block_m < cfg.block_m:
        cfg = Config(max(block_m, 64), cfg.block_n, 4, cfg.num_stages)
    return cfg
