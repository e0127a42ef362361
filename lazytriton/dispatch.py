"""Dispatch: from a call's description to the Variant that serves it.

``target_of_device`` is the one thin function that reads the machine; all the
rest is pure and tested with made-up inputs. Until the tuning table exists
(see the prewarm issue), tile sizes come from ``default_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lazytriton.target import Target, target_from_cuda_capability, target_from_gcn_arch
from lazytriton.variant import Variant, pairs

# Head dims are compiled at these sizes and the rest is masked: Triton's
# tl.arange needs a power of two, so 80 and 96 run as 128 (25-38% of the
# matrix work padded) until a split-tile kernel covers them.
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_HEAD_DIM = HEAD_DIMS[-1]
CAUSAL_MODES = ("none", "top_left", "bottom_right")


def padded_head_dim(head_dim: int) -> int:
    """The compiled head dim that holds ``head_dim`` (the smallest not below it)."""
    for size in HEAD_DIMS:
        if head_dim <= size:
            return size
    raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def causal_mode(causal: object) -> str:
    """Normalise the ``causal`` argument: False, True (= top_left), "top_left", "bottom_right"."""
    if causal is False or causal is None:
        return "none"
    if causal is True:
        return "top_left"
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return causal
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def seqlen_class(seqlen_q: int) -> int:
    """The largest BLOCK_M worth using for ``seqlen_q`` query rows (16, 64 or 128)."""
    if seqlen_q <= 16:
        return 16
    if seqlen_q <= 64:
        return 64
    return 128


@dataclass(frozen=True, slots=True)
class Config:
    """Tuned constexprs and compile options for one variant."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0

    def tuned(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}

    def options(self, target: Target) -> dict[str, int]:
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if target.backend == "hip":
            opts["waves_per_eu"] = self.waves_per_eu
        return opts


def default_config(target: Target, dtype: str, head_dim: int, seqlen_q: int) -> Config:
    """A sane config when the tuning table has no row (it never errors).

    Starting points from FACTS.md (H200, Triton 3.6): BLOCK_M 128 with
    BLOCK_N 64 at head dim 128 and 128 at 64, 4 warps, 2-3 stages were best
    for a TMA forward; this pointer kernel is swept in bench_flash_fwd.py.
    fp32 tiles are halved (twice the bytes, and IEEE dots use no tensor cores);
    head dim 256 tiles are halved to fit sm_80's 163 KiB of shared memory.
    """
    block_m = seqlen_class(seqlen_q)
    if target.backend == "hip":
        cfg = Config(128, 64, 4, 2, waves_per_eu=2)
    elif head_dim <= 64:
        cfg = Config(128, 64, 4, 3)
    else:
        cfg = Config(128, 64, 8, 3)
    if dtype == "fp32":
        cfg = Config(64, 32, 4, 2, cfg.waves_per_eu)
    if head_dim == 256:
        cfg = Config(64, 32 if dtype != "fp32" else 16, 4, 2 if dtype != "fp32" else 1, cfg.waves_per_eu)
    if block_m < cfg.block_m:
        cfg = Config(block_m, cfg.block_n, 4, cfg.num_stages, cfg.waves_per_eu)
    return cfg


def flash_fwd_variant(target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                      seqlen_q: int, config: Config | None = None) -> Variant:
    """The variant of ``flash_fwd`` that serves a call (pure)."""
    padded = padded_head_dim(head_dim)
    cfg = config or default_config(target, dtype, padded, seqlen_q)
    functional = {"ALIGN16": bool(aligned), "BLOCK_D": padded, "CAUSAL": bool(causal), "EVEN_D": head_dim == padded}
    return Variant("flash_fwd", str(target), dtype, pairs(functional), pairs(cfg.tuned()), pairs(cfg.options(target)))


def target_of_device(device: Any) -> Target:
    """The compile target of a torch CUDA/ROCm device (reads the machine)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return target_from_gcn_arch(props.gcnArchName)
    return target_from_cuda_capability(props.major, props.minor)
