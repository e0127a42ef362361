"""``lazytriton tune --kernel flash_fwd``: time candidate configs of the forward and write its rows.

For each (seqlen_q, seqlen_k) pair of a (dtype, head dim, causal) group, every
candidate is compiled (``common.compile_all``), checked against a float32
reference and timed as a call launches it; the fastest correct one becomes
the pair's row. Shapes follow FlashAttention's benchmarks: hidden 2048 and
batch x seqlen = 16k tokens. ``--dtype e4m3`` sweeps the Triton FP8 forward's
tiles (``flash_fwd_fp8``, ``FP8_CANDIDATES``) into e4m3 rows, which its dispatch
reads; calls that the Gluon FP8 forward's rule takes run that kernel instead.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Sequence
from typing import Any

from lazytriton import geometry, tuning
from lazytriton.cli.timing import event_ms
from lazytriton.cli.tune import common
from lazytriton.driver.gpu import DriverError
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

# Candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit dtypes: the
# sweep of 2026-11-30 on the H200 (bench_flash_fwd.py --sweep) kept these
# families within 10% of the best; BLOCK_M 16 rows serve decode-like calls.
_WIDE = ((128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4),
         (64, 128, 4, 3), (128, 32, 4, 3))
_NARROW = ((16, 64, 4, 3), (16, 128, 4, 3), (16, 32, 4, 3), (16, 64, 4, 4), (16, 128, 8, 3))


# The FP8 forward's (flash_fwd_fp8, e4m3): FP8 dots take 32 keys and more; float8 is half the bytes, so key tiles
# of 128 and 256 and a third stage fit where bf16's do not (not measured yet: what this sweep is for).
_FP8 = ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (128, 256, 8, 2), (128, 128, 4, 3), (64, 128, 4, 3),
        (64, 64, 4, 3))
_FP8_256 = ((128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3))


def candidates(dtype: str, head_dim: int, seqlen_q: int) -> list[Config]:
    """Configs worth timing for a group (pure)."""
    if dtype == "e4m3":
        fp8 = _FP8_256 if head_dim > 128 else _FP8
        return [Config(*c) for c in fp8 if c[0] <= max(64, tuning.bucket(seqlen_q))]
    base: Sequence[tuple[int, int, int, int]] = _NARROW if seqlen_q <= 16 else _WIDE
    if head_dim >= 256 or dtype == "fp32":  # large tiles do not fit in shared memory: small ones, or 2 stages
        base = list(dict.fromkeys(
            c for w in base for c in ((w, (*w[:3], 2)) if w[0] * w[1] <= 64 * 64 else ((*w[:3], 2),))
            if c[0] * c[1] <= 128 * 64))
    configs = [Config(*c) for c in base if c[0] <= max(16, tuning.bucket(seqlen_q))]
    return configs or [Config(16, 32, 4, 2)]


def _reference(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """Float32 reference output of the first batch element's first two heads."""
    from lazytriton.kernels.flash_fwd.reference import attention_reference

    mode = "bottom_right" if causal else False
    return attention_reference(q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), causal=mode)[0]


def _time_variant(variant: Variant, q: Any, k: Any, v: Any, causal: bool, ref: Any, reps: int) -> tuple[float, float]:
    """(median ms, relative error against ``ref``) of the cached kernel for ``variant``, launched as a call is."""
    from lazytriton.kernels.flash_fwd import binding

    # Causal calls with seqlen_q < seqlen_k (decode, chunked prefill) are bottom-right aligned.
    call = binding.check(q, k, v, "bottom_right" if causal else False, None, fp8=variant.dtype == "e4m3")
    out, lse = binding.empty_outputs(q, call.shape)
    if variant.dtype == "e4m3":
        from lazytriton.kernels.flash_fwd import fp8

        def launch() -> None:
            nonlocal out
            out, _ = fp8.run_variant(q, k, v, call, (None, None, None), variant)
    else:
        def launch() -> None:
            binding.launch_gpu(q, k, v, out, lse, call, variant)

    launch()
    err = float((out[:1, :2].float() - ref).norm() / ref.norm())
    return event_ms(launch, reps=reps), err


def tune_group(target: Target, dtype: str, head_dim: int, causal: bool, pairs: Sequence[tuple[int, int]],
               jobs: int, reps: int, gpu: str) -> list[tuning.Row]:
    """Rows for one group: the fastest correct candidate per seqlen pair."""
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "e4m3": torch.bfloat16}[dtype]
    plans = {(sq, sk): common.fitting([fwd_dispatch.flash_fwd_variant(target, dtype, head_dim, causal, True, sq,
                                                                      config=c, seqlen_k=sk)
                                       for c in candidates(dtype, head_dim, sq)])
             for sq, sk in pairs}
    failures = common.compile_all([v for vs in plans.values() for v in vs], jobs)
    rows = []
    today = dt.date.today().isoformat()
    for (sq, sk), variants in plans.items():
        # 16k tokens of the longer side: (16, 4096) is 4 batches of decode-like calls,
        # and no tensor reaches 2**31 elements (the variants are compiled with INDEX64=false).
        heads, batch = 2048 // head_dim, max(1, 16384 // max(sq, sk))
        q = torch.randn(batch, heads, sq, head_dim, device="cuda", dtype=torch_dtype)
        k, v = (torch.randn(batch, heads, sk, head_dim, device="cuda", dtype=torch_dtype) for _ in range(2))
        if dtype == "e4m3":  # the reference reads the float8 values back (float32 of each)
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        pairs_seen = sq * sk - sq * sq / 2 if causal else sq * sk  # bottom-right mask, seqlen_q <= seqlen_k
        flops = 4 * batch * heads * head_dim * pairs_seen
        ref = _reference(q, k, v, causal)
        best: tuple[float, Variant] | None = None
        for variant in variants:
            if str(variant) in failures:
                continue
            try:
                ms, err = _time_variant(variant, q, k, v, causal, ref, reps)
            except DriverError as exc:  # e.g. more shared memory than the estimate said: not a candidate
                print(f"  skipped {variant.tuned} {dict(variant.options)}: {exc}", file=sys.stderr)
                continue
            tflops = flops / ms / 1e9
            if err < (8e-2 if dtype == "e4m3" else 2e-2) and (best is None or tflops > best[0]):  # e4m3's P
                best = (tflops, variant)
        if best is None:
            print(f"  no candidate worked for {dtype} hd{head_dim} causal={causal} {sq}x{sk}", file=sys.stderr)
            continue
        tflops, variant = best
        row_head_dim = head_dim if dict(variant.functional).get("BLOCK_D2") else geometry.padded_head_dim(head_dim)
        rows.append(tuning.Row(str(target), "flash_fwd", dtype, row_head_dim, causal,
                               tuning.bucket(sq), tuning.bucket(sk), int(variant.get("BLOCK_M")),
                               int(variant.get("BLOCK_N")), int(variant.get("num_warps")),
                               int(variant.get("num_stages")), 0, round(tflops, 1), gpu, today))
        print(f"  {dtype} hd{head_dim} causal={causal} {sq}x{sk}: {variant.tuned} {dict(variant.options)} "
              f"{tflops:.0f} TFLOP/s")
    return rows


def tune(kernels: Sequence[str], target: Target, dtype: str, head_dim: int, causal: bool,
         args: argparse.Namespace, gpu: str) -> list[tuning.Row]:
    """The forward's rows for one (dtype, head dim, causal) group of ``lazytriton tune``."""
    return tune_group(target, dtype, head_dim, causal, args.pairs, args.jobs, args.reps, gpu)
