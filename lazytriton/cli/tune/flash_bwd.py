"""``lazytriton tune --kernel flash_bwd``: tune the backward's two kernels, each on its own time.

A backward call launches ``flash_bwd_dq`` (which also writes delta =
rowsum(dO * O)) and then ``flash_bwd_dkdv`` (which reads delta), so the
dK/dV kernel cannot run alone, and ``binding.launch_gpu`` launches the pair
exactly as a call does. Each kernel is therefore tuned with its partner held
fixed: every dq candidate is timed with dK/dV at dispatch's current choice
(its table row, else its default), then every dK/dV candidate with dq at the
winner just found. The partner's time is the same for every candidate of a
sweep, so the fastest pair is the fastest candidate of the kernel being
tuned: its choice depends on its own time alone, and each kernel's row is
chosen independently of the other's candidates. A row's ``tflops`` is the
whole backward's rate in that sweep (FlashAttention's convention: 2.5 times
the forward's FLOPs, over the pair's time), so the dK/dV row holds the rate
of the tuned pair.

Everything but the timing is pure (``candidates``, ``sweep_variants``,
``pick``, ``row_for``, ``tune_pair`` with an injected timer) and tested on CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lazytriton import geometry, tuning
from lazytriton.cli.timing import event_ms
from lazytriton.cli.tune import common
from lazytriton.driver.gpu import DriverError
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

KERNELS = bwd_dispatch.BWD_KERNELS
MAX_ERROR = 2e-2  # relative (Frobenius) error of each gradient against the float32 reference

# (held, streamed, num_warps, num_stages): "held" is the tile a program keeps (BLOCK_M query rows in dq,
# BLOCK_N key rows in dK/dV), "streamed" the one its loop walks. A starting grid around Triton's
# fused-attention tutorial (128 held x 32 streamed, 4 warps, 3 stages on Hopper) and FlashAttention-2's
# Triton backward (64-128 square tiles, 4-8 warps), for head dims up to 128 (tuned on the H200, 2026-11-30).
Grid = tuple[tuple[int, int, int, int], ...]
_WIDE: Grid = ((128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 16, 4, 3),
         (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 32, 4, 2))
# Held tiles of 16 for programs with at most 16 rows of their own (decode-like dq, short-key dK/dV).
_NARROW: Grid = ((16, 32, 4, 3), (16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 4, 2))

# Head dim 256 (padded: 129-256), per kernel. dK/dV keeps two float32 accumulators of held x 256, which is
# 256 registers a thread at 64 held rows and 4 warps before anything else: every _WIDE dK/dV candidate spilled
# there (1.7-5.9 KB of spill stores a thread, 2.9-8.5 causal; wgmma serialised for want of registers; 64/128/8/2
# and 64/64/4/3 need 256.5 and 257 KiB, over sm_90's 227, which the lower-bound estimate let through to fail at
# launch), and the tuned 64/64/4/2 reached 106-159 TFLOP/s. These come from experiments/probe_bwd_regs.py
# (Triton 3.6, ptxas 12.8, sm_90, bf16, 2026-12-01; spill stores in bytes non-causal/causal, shared memory in
# KiB, "mma" = mma.sync, else wgmma):
_LARGE_DKDV: Grid = (
    (64, 32, 8, 2),  # 255 regs, spill 28/168, 128
    (64, 32, 8, 3),  # spill 36/128, 160.5
    (64, 64, 8, 2),  # FlashAttention-3's hd256 tiles (64 x 64, two warpgroups): spill 320/556, 192.5
    (64, 16, 8, 2),  # 242 regs, no spill (16 causal), 96; wgmma N=16 is bound by shared-memory reads
    (64, 16, 8, 3),  # 249 regs, spill 0/16, 112
    (32, 32, 8, 2),  # mma, 194/213 regs, no spill, 66
    (32, 32, 8, 3),  # mma, 218/246 regs, no spill, 98.5
    (32, 64, 8, 2),  # mma, spill 8/44, 100.5
    (32, 16, 8, 3),  # mma, 172/210 regs, no spill, 65
    (64, 64, 4, 2),  # the tuned 2026-11-30 winner (spill 2544/3788, wgmma serialised): what the rest must beat
)
# dq holds one accumulator (held x 256): at 8 warps nothing spills. Left out: 4 warps at 128 held (4.1-4.5 KB of
# spill stores), (128, 64, 8, 2) and (64, 64, 4, 3) (256 KiB: over sm_90's 227; refused at launch).
_LARGE_DQ: Grid = (
    (128, 32, 8, 3),  # the tuned 2026-11-30 winner: 212/220 regs, no spill, 224
    (128, 32, 8, 2),  # 212/216 regs, 192
    (128, 16, 8, 3),  # 206/183 regs, 176
    (64, 64, 8, 2),  # 247/253 regs, 192
    (64, 32, 8, 3),  # 196/200 regs, 160
    (64, 32, 8, 2),  # 197/201 regs, 128
    (64, 16, 8, 3),  # 175/178 regs, 112
    (64, 16, 4, 3),  # 251/255 regs, no spill, 112: the only one with 2 CTAs an SM
)
LARGE_HEAD_DIM = 256  # padded head dims from here take the _LARGE lists
SPLIT_DKDV_HELD = 64  # the most key rows a dK/dV candidate holds at a split head dim padded to LARGE_HEAD_DIM
# ... and the shared memory its two held and two streamed tiles a stage may take (Triton 3.6 allocated at most
# that, probe_bwd_regs.py), within sm_90's 227 KiB (``refusal``'s estimate is a lower bound)
SPLIT_SHARED = 227 * 1024


def proposed_large_default(kernel: str, target: Target) -> Config:
    """The default this branch proposes for ``flash_bwd.dispatch.bwd_default_config`` at head dim 256, fp16/bf16, CUDA.

    Not wired in (dispatch's backward is another branch's); the tune measures
    it among the candidates. Configs are BLOCK_M/BLOCK_N/warps/stages (BLOCK_M
    the query tile in both kernels). Today's default (dq 64/32/4/1, dK/dV 32/64/4/1)
    spills on every CUDA target, and its dK/dV does not fit sm_86/89/120's 99 KiB
    (probe_bwd_regs.py, Triton 3.6, bf16): sm_90 dK/dV 1896 B of spill
    stores, wgmma serialised; sm_80 12164 B (ptxas fell back to 32
    registers); sm_86 112 KiB of shared memory. These do not spill, or
    little: sm_90/sm_80 dq 64/32/8/2 (197/207 regs, 128/100 KiB) and dK/dV
    32/64/8/2 (spill 28/8 B non-causal, 168/48 causal; 128/100 KiB); 99 KiB
    targets dq 64/16/8/2 (166 regs, 82 KiB) and dK/dV 32/32/8/2 (191 regs,
    66 KiB).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if target.backend != "cuda":
        raise ValueError(f"target must be a CUDA target (no AMD proposal: nothing measured), got {target}")
    from lazytriton.prewarm.limits import KNOWN_TARGETS

    limits = KNOWN_TARGETS.get(str(target))
    small = limits is not None and limits.shared < 128 * 1024  # sm_86, sm_89, sm_120: 99 KiB a block
    if kernel == "flash_bwd_dq":
        return Config(64, 16 if small else 32, 8, 2)
    return Config(32, 32 if small else 64, 8, 2)


# time(dq variant, dkdv variant) -> (median ms of the pair, worst relative error of dq, dk, dv)
Timer = Callable[[Variant, Variant], tuple[float, float]]


def own_seqlen(kernel: str, seqlen_q: int, seqlen_k: int) -> int:
    """The seqlen whose rows a program of ``kernel`` holds: seqlen_q for dq, seqlen_k for dK/dV."""
    return seqlen_q if kernel == "flash_bwd_dq" else seqlen_k


def candidates(kernel: str, target: Target, dtype: str, head_dim: int, seqlen_q: int,
               seqlen_k: int) -> list[Config]:
    """Configs worth timing for one kernel and shape (pure).

    Held tiles are no longer than the rows a program holds; a config whose
    tiles cannot fit the target's shared memory (``prewarm.limits.refusal``)
    is left out; dispatch's own choice without a table (the default) is
    always a candidate, so a tuned row is never slower than the default by
    the measurement that chose it. Padded head dim 256 has lists of its own
    (``_LARGE_DQ``, ``_LARGE_DKDV``: configs that do not spill, or little);
    a split head dim padded to it (160 = 128 + 32, 192 = 128 + 64) holds
    accumulators of its own width, not 256's, so it gets ``_WIDE``'s 4-warp
    tiles as well (dK/dV's held at most ``SPLIT_DKDV_HELD``: two 128 x 192
    float32 accumulators would spill at any warp count; none whose tiles
    need more than ``SPLIT_SHARED``).
    """
    from lazytriton.prewarm.limits import refusal

    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    rows = tuning.bucket(own_seqlen(kernel, seqlen_q, seqlen_k))
    padded = geometry.padded_head_dim(head_dim)
    if rows <= 16:
        base = _NARROW
    elif padded >= LARGE_HEAD_DIM:
        base = _LARGE_DQ if kernel == "flash_bwd_dq" else _LARGE_DKDV
        split = geometry.split_head_dim(head_dim)
        if split is not None:  # 160, 192: accumulators of their width, not 256's; tiles whose ring fits
            base = base + tuple(c for c in _WIDE if (kernel == "flash_bwd_dq" or c[0] <= SPLIT_DKDV_HELD)
                                and (2 * c[0] + 2 * c[1] * c[3]) * sum(split) * 2 <= SPLIT_SHARED)
    else:
        base = _WIDE
    configs = []
    for held, streamed, warps, stages in base:
        if held > max(16, rows):
            continue
        configs.append(Config(held, streamed, warps, stages) if kernel == "flash_bwd_dq"
                       else Config(streamed, held, warps, stages))
    default = bwd_dispatch.bwd_default_config(kernel, target, dtype, padded, seqlen_q, seqlen_k)
    if target.backend == "hip":
        configs = [Config(c.block_m, c.block_n, c.num_warps, min(c.num_stages, 2), 2) for c in configs]
    fitting = [c for c in dict.fromkeys(configs)
               if refusal(_variant(kernel, target, dtype, head_dim, False, seqlen_q, seqlen_k, c)) is None]
    return [default, *(c for c in fitting if c != default)]


def _variant(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int,
             config: Config | None, table: tuning.Table | None = None) -> Variant:
    return dispatch.kernel_variant(kernel, target, dtype, head_dim, causal, True, seqlen_q, seqlen_k, config=config,
                                   table=table)


def sweep_variants(target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int,
                   table: tuning.Table | None = None) -> dict[str, list[Variant]]:
    """For each backward kernel: dispatch's current choice (``table``, else the files), then its candidates (pure)."""
    sweeps = {}
    for kernel in KERNELS:
        chosen = _variant(kernel, target, dtype, head_dim, causal, seqlen_q, seqlen_k, None, table)
        sweep = [_variant(kernel, target, dtype, head_dim, causal, seqlen_q, seqlen_k, c)
                 for c in candidates(kernel, target, dtype, head_dim, seqlen_q, seqlen_k)]
        sweeps[kernel] = [chosen, *(v for v in sweep if v != chosen)]
    return sweeps


def pick(timed: Sequence[tuple[Variant, float, float]]) -> tuple[Variant, float] | None:
    """The fastest correct (variant, ms) among (variant, ms, error); None when none is correct (pure)."""
    correct = [(ms, str(v), v) for v, ms, err in timed if err < MAX_ERROR]
    if not correct:
        return None
    ms, _, variant = min(correct)
    return variant, ms


def backward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """FlashAttention's count: 2.5 times the forward's 4 * b * h * d * (visible pairs), bottom-right causal."""
    pairs = seqlen_q * seqlen_k - seqlen_q * seqlen_q / 2 if causal else seqlen_q * seqlen_k
    return 2.5 * 4 * batch * heads * head_dim * pairs


def row_for(variant: Variant, seqlen_q: int, seqlen_k: int, tflops: float, gpu: str, measured: str,
            head_dim: int) -> tuning.Row:
    """The tuning row that makes dispatch pick ``variant`` for calls in these seqlen buckets (pure).

    A split variant's row is keyed by the head dim it was tuned at (96), as the forward's: its tiles then serve
    that head dim only, never the padded tile's calls (hd128 and every head dim padded to it), which its
    shared-memory budget (the split width's) does not cover. A padded variant's row by its padded head dim.
    """
    split = bool(dict(variant.functional).get("BLOCK_D2"))
    return tuning.Row(variant.target, variant.kernel, variant.dtype,
                      head_dim if split else geometry.padded_head_dim(head_dim),
                      bool(variant.get("CAUSAL")), tuning.bucket(seqlen_q), tuning.bucket(seqlen_k),
                      int(variant.get("BLOCK_M")), int(variant.get("BLOCK_N")), int(variant.get("num_warps")),
                      int(variant.get("num_stages")), int(dict(variant.options).get("waves_per_eu", 0)),
                      round(tflops, 1), gpu, measured)


def tune_pair(sweeps: dict[str, list[Variant]], time_pair: Timer, flops: float, kernels: Sequence[str] = KERNELS,
              failed: frozenset[str] = frozenset()) -> dict[str, tuple[Variant, float]]:
    """The winner and the backward's TFLOP/s of each kernel in ``kernels``: dq first, then dK/dV on dq's winner.

    ``sweeps`` is ``sweep_variants``'s (its first variant of each kernel is
    the partner a sweep of the other starts from); ``failed`` holds the
    variants that did not compile (skipped). A kernel with no correct
    candidate is left out.
    """
    partner = {kernel: sweeps[kernel][0] for kernel in KERNELS}
    won: dict[str, tuple[Variant, float]] = {}
    for kernel in KERNELS:
        if kernel not in kernels:
            continue
        timed = []
        for variant in sweeps[kernel]:
            if str(variant) in failed:
                continue
            pair = {**partner, kernel: variant}
            ms, err = time_pair(pair["flash_bwd_dq"], pair["flash_bwd_dkdv"])
            timed.append((variant, ms, err))
        best = pick(timed)
        if best is None:
            continue
        partner[kernel] = best[0]
        won[kernel] = (best[0], flops / best[1] / 1e9)
    return won


def make_inputs(dtype: str, head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool) -> dict[str, Any]:
    """GPU tensors of one tuned shape (hidden 2048, 16k tokens), the forward's out and lse, the reference grads."""
    import torch

    from lazytriton.kernels.flash_bwd.reference import attention_backward_reference
    from lazytriton.kernels.flash_fwd import binding as fwd

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    heads, batch = 2048 // head_dim, max(1, 16384 // max(seqlen_q, seqlen_k))
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=torch_dtype)
    k, v = (torch.randn(batch, heads, seqlen_k, head_dim, device="cuda", dtype=torch_dtype) for _ in range(2))
    do = torch.randn_like(q)
    mode = "bottom_right" if causal else False  # causal calls with seqlen_q < seqlen_k are bottom-right aligned
    call = fwd.check(q, k, v, mode, None)
    out, lse = fwd.empty_outputs(q, call.shape)
    fwd.launch_gpu(q, k, v, out, lse, call)
    ref = attention_backward_reference(*(t[:1, :2].float() for t in (q, k, v, do)), causal=mode)
    return {"q": q, "k": k, "v": v, "do": do, "out": out, "lse": lse, "call": call, "ref": ref,
            "flops": backward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal)}


def gpu_timer(inputs: dict[str, Any], reps: int) -> Timer:
    """Time a (dq, dkdv) pair launched as a backward call launches it (``binding.launch_gpu``, forced)."""
    from lazytriton.kernels.flash_bwd import binding

    q, k, v, do, out, lse, call = (inputs[n] for n in ("q", "k", "v", "do", "out", "lse", "call"))
    grads = binding.empty_grads(q, k, v)

    def time_pair(dq_variant: Variant, dkdv_variant: Variant) -> tuple[float, float]:
        def launch() -> None:
            binding.launch_gpu(q, k, v, out, lse, do, grads, call, forced=(dq_variant, dkdv_variant))

        try:
            launch()
        except DriverError as exc:  # e.g. more shared memory than the estimate said: never picked
            print(f"  skipped the pair {dq_variant.tuned} / {dkdv_variant.tuned}: {exc}", file=sys.stderr)
            return math.inf, math.inf
        err = max(float((g[:1, :2].float() - r).norm() / r.norm().clamp_min(1e-30))
                  for g, r in zip(grads, inputs["ref"], strict=True))
        return event_ms(launch, reps=reps), err

    return time_pair


def tune_group(target: Target, dtype: str, head_dim: int, causal: bool, pairs: Sequence[tuple[int, int]],
               jobs: int, reps: int, gpu: str, kernels: Sequence[str] = KERNELS) -> list[tuning.Row]:
    """Rows for one (dtype, head dim, causal) group of the backward: per seqlen pair, each kernel's winner."""
    sweeps = {pair: sweep_variants(target, dtype, head_dim, causal, *pair) for pair in pairs}
    # Every candidate of the kernels tuned, and the fixed partner of a kernel not tuned.
    needed = [v for s in sweeps.values() for kernel, vs in s.items() for v in (vs if kernel in kernels else vs[:1])]
    failures = common.compile_all(needed, jobs)
    rows = []
    today = dt.date.today().isoformat()
    for (sq, sk), sweep in sweeps.items():
        inputs = make_inputs(dtype, head_dim, sq, sk, causal)
        won = tune_pair(sweep, gpu_timer(inputs, reps), inputs["flops"], kernels, frozenset(failures))
        for kernel in kernels:
            if kernel not in won:
                print(f"  no {kernel} candidate worked for {dtype} hd{head_dim} causal={causal} {sq}x{sk}",
                      file=sys.stderr)
                continue
            variant, tflops = won[kernel]
            rows.append(row_for(variant, sq, sk, tflops, gpu, today, head_dim))
            print(f"  {kernel} {dtype} hd{head_dim} causal={causal} {sq}x{sk}: {variant.tuned} "
                  f"{dict(variant.options)} backward {tflops:.0f} TFLOP/s")
    return rows


def tune(kernels: Sequence[str], target: Target, dtype: str, head_dim: int, causal: bool,
         args: argparse.Namespace, gpu: str) -> list[tuning.Row]:
    """The rows for one (dtype, head dim, causal) group of ``lazytriton tune``: ``kernels``' winners."""
    return tune_group(target, dtype, head_dim, causal, args.pairs, args.jobs, args.reps, gpu, kernels)
