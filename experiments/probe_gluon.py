"""Probe: flash_fwd_gluon (the Gluon, FlashAttention-3-style Hopper forward) on the H200.

Three stages, each shape in a child process of its own with a deadline, so a
fault (an illegal address poisons the CUDA context) or a hang (a pipeline of
mbarriers that never completes) costs that shape only; the run goes on and
says what happened:

1. ``compile``: every flash_fwd_gluon variant the later stages use, through
   lazytriton's own path (``runtime.kernel``: cache or JIT), with the entry's
   launch metadata or the full compile error.
2. ``check``: O and lse of fresh random inputs against a float32 reference,
   for several shapes (head dim 64/128/256, bf16/fp16, causal none/top-left/
   bottom-right, GQA, a (B, S, H, D) transposed layout, seqlen_q != seqlen_k).
   FlashAttention's rule: the error must be at most 2x that of a
   same-precision kernel (the current flash_fwd) against the same reference,
   plus 1e-4. A failure prints where the error sits (batch, head, row, column,
   query block).
3. ``time``: TFLOP/s (event-timed medians, ``lazytriton.cli.timing.median_ms``)
   of flash_fwd_gluon (the default tiles with and without the producer
   warp, and ping-pong; with ``--sweep``, ``sweep_tilings``: every config of
   ``gluon.configs(head_dim)``, the producer at the default tiles, and every
   ping-pong config that fits), the current
   flash_fwd (dispatch's variant, as a call gets it) and SDPA's cuDNN
   backend, at FlashAttention's benchmark shapes (batch x seqlen = 16k,
   hidden 2048), each output checked against cuDNN's before it is timed.

Logs go to ``$OUT`` (``probe_gluon.log``, ``probe_gluon.csv``) when set; the
summary table comes last. Usage:

    python experiments/probe_gluon.py [--quick] [--sweep] [--head-dims 64,128,256] [--deadline S]

Needs an sm_90 GPU. Compiles with the installed Triton (3.6 on the H200 host).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

GLUON = "flash_fwd_gluon"
# (dtype, batch, heads_q, heads_k, seqlen_q, seqlen_k, head_dim, causal, layout): layout "bhsd" is a
# contiguous (B, H, S, D) tensor, "bshd" a transposed view of a contiguous (B, S, H, D) one.
CHECKS = [
    ("bf16", 2, 4, 4, 1024, 1024, 128, "none", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 128, "top_left", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 64, "none", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 64, "top_left", "bhsd"),
    ("fp16", 1, 8, 8, 2048, 2048, 128, "top_left", "bhsd"),
    ("fp16", 1, 8, 8, 2048, 2048, 64, "none", "bhsd"),
    ("bf16", 1, 4, 4, 128, 128, 128, "top_left", "bhsd"),  # one block: only the peeled step and the last PV
    ("bf16", 1, 4, 4, 512, 1536, 128, "bottom_right", "bhsd"),  # seqlen_q < seqlen_k, causal offset 1024
    ("bf16", 1, 4, 4, 512, 1536, 64, "none", "bhsd"),
    ("bf16", 2, 8, 2, 1024, 1024, 128, "top_left", "bhsd"),  # GQA, 4 query heads a key/value head
    ("bf16", 2, 4, 4, 1024, 1024, 128, "top_left", "bshd"),  # (B, S, H, D) strides
    ("bf16", 2, 4, 4, 1024, 1024, 64, "none", "bshd"),
    # Head dim 256 (128 x 64 tiles, 2 stages, a 512-byte row split into four TMA boxes):
    ("bf16", 2, 4, 4, 1024, 1024, 256, "none", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 256, "top_left", "bhsd"),
    ("fp16", 1, 8, 8, 2048, 2048, 256, "top_left", "bhsd"),
    ("bf16", 1, 4, 4, 128, 128, 256, "top_left", "bhsd"),  # one query block, two key blocks
    ("bf16", 1, 4, 4, 512, 1536, 256, "bottom_right", "bhsd"),
    ("bf16", 2, 8, 2, 1024, 1024, 256, "top_left", "bhsd"),  # GQA
    ("bf16", 2, 4, 4, 1024, 1024, 256, "none", "bshd"),
    # Split head dims (two chunks: 96 = 64 + 32, 192 = 128 + 64, ...; 72 = 64 + 16 with the second chunk
    # zero-filled past the head dim) and a padded one (224 in 256's tile):
    ("bf16", 2, 4, 4, 1024, 1024, 96, "none", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 96, "top_left", "bshd"),
    ("fp16", 2, 8, 2, 1024, 1024, 96, "top_left", "bhsd"),
    ("bf16", 1, 4, 4, 512, 1536, 96, "bottom_right", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 80, "none", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 80, "top_left", "bshd"),
    ("bf16", 2, 4, 4, 1024, 1024, 72, "top_left", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 160, "none", "bhsd"),
    ("bf16", 2, 8, 2, 1024, 1024, 160, "top_left", "bshd"),
    ("bf16", 2, 4, 4, 1024, 1024, 192, "none", "bshd"),
    ("fp16", 2, 4, 4, 1024, 1024, 192, "top_left", "bhsd"),
    ("bf16", 1, 4, 4, 512, 1536, 192, "bottom_right", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 224, "none", "bhsd"),
    ("bf16", 2, 4, 4, 1024, 1024, 224, "top_left", "bshd"),
    ("fp16", 1, 4, 4, 512, 1536, 224, "bottom_right", "bhsd"),
]
SEQLENS = (1024, 4096, 16384)
# --quick: 4k, and 1k, where the per-CTA prologue (four device-side descriptors, the pipeline's fill) weighs
# most (head dim 128 at 1k: 0.72x cuDNN in the 2026-11-30 H200 run, 0.91x at 4k).
QUICK_SEQLENS = (1024, 4096)


def log(line: str, path: Path | None) -> None:
    """Print a line and append it to the log under $OUT, if any."""
    print(line, flush=True)
    if path is not None:
        with path.open("a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------
# Child side: one job, results as "RESULT {json}" lines on stdout


def _setup() -> tuple[Any, Any, Any]:
    import torch

    from lazytriton.kernels.flash_fwd import binding
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

    return torch, fwd_dispatch, binding


def _tensors(torch: Any, dtype: str, b: int, hq: int, hk: int, sq: int, sk: int, d: int, layout: str) -> tuple:
    """Fresh random q, k, v on the GPU (a new seed each call)."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))

    def one(h: int, s: int) -> Any:
        if layout == "bshd":
            return torch.randn(b, s, h, d, device="cuda", dtype=dt, generator=gen).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dt, generator=gen)

    return one(hq, sq), one(hk, sk), one(hk, sk)


# (BLOCK_M, BLOCK_N, num_warps), producer warp, ping-pong[, query tiles a program walks (absent: 1)]
Tiling = tuple[Any, ...]


def q_tiles_of(tiling: Tiling) -> int:
    return int(tiling[3]) if len(tiling) > 3 else 1


def sweep_tilings(head_dim: int | None = None) -> list[Tiling]:
    """What ``--sweep`` checks and times at ``head_dim`` (every head dim's, once each, without it): every
    config that fits without the producer warp, the default tiles with it (128 x 128 x 8; 128 x 64 x 8 at
    head dim 256; the H200 measured the producer slower at every 4-warp config: it costs those their
    second CTA on an SM), and each ping-pong config that fits (two consumer warpgroups taking turns, plus
    the producer). ``gluon.configs`` leaves out the tiles over shared memory (BLOCK_N 128 at 256)."""
    from lazytriton.kernels.flash_fwd import gluon

    every: list[Tiling] = []
    for d in gluon.HEAD_DIMS if head_dim is None else (head_dim,):
        every += ([(tiles, False, False) for tiles in gluon.configs(d)] + [(gluon.default_tiles(d), True, False)]
                  + [(tiles, True, True) for tiles in gluon.configs(d, pingpong=True)]
                  + [(tiles, True, False) for tiles in gluon.wide_configs(d)])
    return list(dict.fromkeys(every))


def _gluon_variant(fwd_dispatch: Any, binding: Any, q: Any, call: Any, tiling: Tiling) -> Any:
    from lazytriton import machine

    b, hq, hk, sq, sk, d = call.shape
    target = machine.target_of_device(q.device)
    found = fwd_dispatch.flash_fwd_gluon_variant(target, binding.DTYPES[q.dtype], d, call.causal, True, False, sq, sk,
                                                 tiles=tiling[0], scale=call.scale, producer=tiling[1],
                                                 pingpong=tiling[2], q_tiles=q_tiles_of(tiling))
    if found is None:
        from lazytriton.kernels.flash_fwd import gluon

        tm, tn, _ = tiling[0]
        raise ValueError("flash_fwd_gluon refuses this call: " + str(gluon.reason(
            str(target), binding.DTYPES[q.dtype], d, call.causal, True, False, sq, sk, tm, tn, scale=call.scale,
            q_tiles=q_tiles_of(tiling))))
    return found


def _flash_fwd(fwd_dispatch: Any, binding: Any, q: Any, k: Any, v: Any, call: Any) -> Any:
    """The Triton flash_fwd variant for the call, as dispatch served it before GLUON_TABLE (the baseline)."""
    out, lse = binding.empty_outputs(q, call.shape)
    _, aligned, index64 = binding.pack(q, k, v, out, lse, call)
    from lazytriton import machine

    return binding.variant(machine.target_of_device(q.device), q.dtype, call.shape, call.causal != "none",
                           aligned, index64)


def _run(binding: Any, q: Any, k: Any, v: Any, call: Any, variant: Any) -> tuple[Any, Any]:
    out, lse = binding.empty_outputs(q, call.shape)
    binding.launch_gpu(q, k, v, out, lse, call, variant=variant)
    return out, lse


def _reference(torch: Any, q: Any, k: Any, v: Any, call: Any) -> tuple[Any, Any]:
    """float32 attention and its logsumexp, one (batch, head) at a time to bound memory."""
    b, hq, hk, sq, sk, d = call.shape
    out = torch.empty(b, hq, sq, d, device="cuda", dtype=torch.float32)
    lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    rows = torch.arange(sq, device="cuda")[:, None]
    cols = torch.arange(sk, device="cuda")[None, :]
    for i in range(b):
        for h in range(hq):
            s = (q[i, h].float() @ k[i, h // (hq // hk)].float().T) * call.scale
            if call.causal != "none":
                s = s.masked_fill(cols > rows + call.offset, float("-inf"))
            lse[i, h] = torch.logsumexp(s, -1)
            out[i, h] = torch.softmax(s, -1) @ v[i, h // (hq // hk)].float()
    return out, lse


HANG_S = 30.0  # a launch still running after this long is an mbarrier wait that never completes


def finish(torch: Any, what: str, limit: float = HANG_S) -> None:
    """Wait for the GPU's work; if it is still running after ``limit`` s, say so and end the child at once.

    A hung kernel would hold the child until the parent's deadline (minutes,
    most of a 280 s run); ending it here costs ``limit`` s. The parent reads
    the crash and blames the tiling without a result (``suspects``), so later
    children skip it. os._exit: no cleanup may wait on the hung stream.
    """
    event = torch.cuda.Event()
    event.record()
    began = time.perf_counter()
    while not event.query():
        if time.perf_counter() - began > limit:
            print(f"HANG: {what} still running after {limit:.0f} s; ending this child", flush=True)
            os._exit(3)
        time.sleep(0.001)


def _where(torch: Any, err: Any, block_m: int) -> str:
    """Where the largest error sits, and the mean error by query block (first 8)."""
    idx = int(err.argmax())
    b, h, s, d = err.shape
    pos = (idx // (h * s * d), idx // (s * d) % h, idx // d % s, idx % d)
    by_block = err.amax(dim=(0, 1, 3)).reshape(-1, block_m).amax(dim=1)
    return (f"max at (b, h, row, col) {pos}, query block {pos[2] // block_m}; max by query block "
            f"{[round(float(x), 4) for x in by_block[:8]]}; NaNs {int(torch.isnan(err).sum())}")


def compile_list(args: argparse.Namespace) -> list[Any]:
    """Every gluon variant the run uses (sm_90), in a fixed order the compile shards split."""
    from lazytriton.kernels.flash_fwd import gluon

    found = [gluon.variant("sm_90", dtype, d, causal, True, False, 16384, 16384, tiles=tiling[0],
                           producer=tiling[1], pingpong=tiling[2], q_tiles=q_tiles_of(tiling))
             for dtype in ("bf16", "fp16") for d in head_dims(args) for causal in ("none", "top_left")
             for tiling in tiles_for(args, d)]
    return list(dict.fromkeys(v for v in found if v is not None))


def job_compile(args: argparse.Namespace, shard: int) -> None:
    """Load (cache or JIT-compile) shard ``shard`` of ``compile_list``; print each entry's metadata or error."""
    from lazytriton import runtime

    rt = runtime.get()
    for variant in compile_list(args)[shard::args.jobs]:
        began = time.perf_counter()
        try:
            entry = rt.kernel(variant, 0).entry
            meta = {"shared": entry.shared, "num_warps": entry.num_warps, "scratch": entry.global_scratch_size,
                    "triton": entry.provenance.compiler_version}
            print("RESULT " + json.dumps({"variant": str(variant), "ok": True,
                                          "s": round(time.perf_counter() - began, 2), **meta}), flush=True)
        except Exception as exc:
            print(f"compile/load of {variant} failed:\n{traceback.format_exc()}", flush=True)
            print("RESULT " + json.dumps({"variant": str(variant), "ok": False,
                                          "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)


def job_check(args: argparse.Namespace, index: int) -> None:
    """O and lse of one CHECKS shape against float32, beside the current flash_fwd's error."""
    torch, fwd_dispatch, binding = _setup()
    dtype, b, hq, hk, sq, sk, d, causal, layout = checks(args)[index]
    q, k, v = _tensors(torch, dtype, b, hq, hk, sq, sk, d, layout)
    call = binding.check(q, k, v, causal if causal != "none" else False)
    ref_out, ref_lse = _reference(torch, q, k, v, call)
    base_out, base_lse = _run(binding, q, k, v, call, _flash_fwd(fwd_dispatch, binding, q, k, v, call))
    base = (float((base_out.float() - ref_out).abs().max()), float((base_lse - ref_lse).abs().max()))
    for tiling in tiles_for(args, d):
        try:
            variant = _gluon_variant(fwd_dispatch, binding, q, call, tiling)
        except ValueError as exc:  # a program's rows (q_tiles x BLOCK_M) that do not divide this shape's
            print(f"{label(tiling)}: {exc}", flush=True)
            continue
        out, lse = _run(binding, q, k, v, call, variant)
        finish(torch, label(tiling))
        err = (out.float() - ref_out).abs()
        got = (float(err.max()), float((lse - ref_lse).abs().max()))
        ok = all(math.isfinite(g) and g <= 2 * bb + 1e-4 for g, bb in zip(got, base, strict=True))
        where = "" if ok else _where(torch, err, int(variant.get("BLOCK_M")))
        print("RESULT " + json.dumps({"shape": checks(args)[index], "tiles": label(tiling), "variant": str(variant),
                                      "ok": ok, "out_err": got[0], "lse_err": got[1], "base_out_err": base[0],
                                      "base_lse_err": base[1], "where": where}), flush=True)


def job_time(args: argparse.Namespace, index: int) -> None:
    """TFLOP/s of cuDNN, the current flash_fwd and each gluon tiling at one benchmark shape."""
    torch, fwd_dispatch, binding = _setup()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from lazytriton.cli.timing import median_ms

    dtype, d, causal, s = time_shapes(args)[index]
    b, h = 16384 // s, 2048 // d
    q, k, v = _tensors(torch, dtype, b, h, h, s, s, d, "bhsd")
    call = binding.check(q, k, v, causal)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    shape = {"dtype": dtype, "head_dim": d, "causal": causal, "seqlen": s, "batch": b, "heads": h}

    def cudnn() -> Any:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=causal)

    ref = cudnn().float()
    out, lse = binding.empty_outputs(q, call.shape)
    base = _flash_fwd(fwd_dispatch, binding, q, k, v, call)  # not dispatch's choice, which may be a GLUON_TABLE row
    providers: list[tuple[str, Any]] = [("cudnn", cudnn),
                                        ("flash_fwd", lambda: binding.launch_gpu(q, k, v, out, lse, call,
                                                                                 variant=base))]
    for tiling in tiles_for(args, d):
        try:
            variant = _gluon_variant(fwd_dispatch, binding, q, call, tiling)
        except ValueError as exc:
            print(f"{label(tiling)}: {exc}", flush=True)
            continue
        providers.append((label(tiling),
                          lambda variant=variant: binding.launch_gpu(q, k, v, out, lse, call, variant=variant)))
    for name, fn in providers:
        try:
            result = fn()
            finish(torch, name)
            got = result if name == "cudnn" else out
            rel = float((got.float() - ref).norm() / ref.norm())
            ms = median_ms(fn, True, warmup=5, reps=args.reps) if rel < 2e-2 else float("nan")
            print("RESULT " + json.dumps({**shape, "provider": name, "ms": ms, "rel_err": rel,
                                          "tflops": flops / ms / 1e9 if ms == ms else None}), flush=True)
        except Exception as exc:
            print(f"{name} at {shape} failed:\n{traceback.format_exc()}", flush=True)
            print("RESULT " + json.dumps({**shape, "provider": name, "error": f"{type(exc).__name__}: {exc}"[:300]}),
                  flush=True)


def tiles_for(args: argparse.Namespace, d: int) -> list[Tiling]:
    """The gluon tilings a run checks and times: the default tiles with and without the producer warp, and
    ping-pong; with ``--sweep``, ``sweep_tilings``."""
    from lazytriton.kernels.flash_fwd import gluon

    every = sweep_tilings(d) if args.sweep else [(gluon.default_tiles(d), False, False),
                                                 (gluon.default_tiles(d), True, False),
                                                 (gluon.configs(d, pingpong=True)[0], True, True)]
    if getattr(args, "wide", False) and not args.sweep:  # --wide: three consumer warpgroups (gluon.WIDE_CONFIGS)
        every += [(tiles, True, False) for tiles in gluon.wide_configs(d)]
    for n in (int(x) for x in getattr(args, "q_tiles", "").split(",") if x):  # --q-tiles: ping-pong tilings that fit
        every += [(tiles, True, True, n) for tiles in gluon.configs(d, pingpong=True, q_tiles=n)
                  if (tiles, True, True) in every]
    return [tiling for tiling in every if label(tiling) not in getattr(args, "skip", set())]


def label(tiling: Tiling) -> str:
    """A tiling's name in the logs and the table: gluon[BLOCK_M, BLOCK_N, num_warps] (+producer, +pingpong)."""
    if len(tiling) > 2 and tiling[2]:
        return f"gluon{list(tiling[0])}+pingpong" + (f"x{q_tiles_of(tiling)}" if q_tiles_of(tiling) > 1 else "")
    return f"gluon{list(tiling[0])}" + ("+producer" if tiling[1] else "")


def head_dims(args: argparse.Namespace) -> list[int]:
    """The head dims this run covers (``--head-dims``, in that order; gluon's tile widths by default)."""
    from lazytriton.kernels.flash_fwd import gluon

    chosen = getattr(args, "head_dims", "")  # the tests' namespaces leave it out
    if not chosen:
        return list(gluon.HEAD_DIMS)
    return list(dict.fromkeys(int(d) for d in chosen.split(",") if d))


def checks(args: argparse.Namespace) -> list[tuple[Any, ...]]:
    return [case for case in CHECKS if case[6] in head_dims(args)]


def time_shapes(args: argparse.Namespace) -> list[tuple[str, int, bool, int]]:
    seqlens = QUICK_SEQLENS if args.quick else SEQLENS
    shapes = [("bf16", d, causal, s) for d in head_dims(args) for causal in (False, True) for s in seqlens]
    if not args.quick and 128 in head_dims(args):
        shapes += [("fp16", 128, causal, 4096) for causal in (False, True)]
    return shapes


# ---------------------------------------------------------------------------
# Parent side: run each job in a child with a deadline, collect RESULT lines, print the table last


def run_child(args: argparse.Namespace, job: str, index: int, logfile: Path | None) -> list[dict[str, Any]]:
    """Run one job in a fresh process; its RESULT lines, or one error record if it crashed or hung."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", job, "--index", str(index), "--reps",
           str(args.reps), "--jobs", str(args.jobs), "--skip", ",".join(sorted(args.skip))]
    cmd += (["--sweep"] if args.sweep else []) + (["--quick"] if args.quick else [])
    cmd += ["--head-dims", args.head_dims] if getattr(args, "head_dims", "") else []
    cmd += ["--q-tiles", args.q_tiles] if getattr(args, "q_tiles", "") else []
    cmd += ["--wide"] if getattr(args, "wide", False) else []
    began = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.deadline)
        text, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text, rc = text + f"\nTIMEOUT after {args.deadline} s (a hang: an mbarrier wait that never completes?)", -9
    results = [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
    for line in text.splitlines():
        if not line.startswith("RESULT ") and logfile is not None:
            with logfile.open("a") as f:
                f.write(f"  [{job} {index}] {line}\n")
    if rc != 0:
        tail = "\n".join(text.strip().splitlines()[-25:])
        log(f"[{job} {index}] exited {rc} after {time.perf_counter() - began:.0f} s; last lines:\n{tail}", logfile)
        results.append({"job": job, "index": index, "crash": rc})
    return results


def suspects(args: argparse.Namespace, head_dim: int, results: list[dict[str, Any]]) -> set[str]:
    """The tilings of one check child that failed, and the one it was running when it crashed or hung.

    A child runs its tilings in ``tiles_for`` order and prints each result as
    it goes, so the first tiling without a result is the one that faulted
    (a fault poisons the CUDA context: the ones after it are not to blame).
    """
    bad = {r["tiles"] for r in results if "tiles" in r and not r["ok"]}
    if any("crash" in r for r in results):
        done = {r["tiles"] for r in results if "tiles" in r}
        pending = [label(t) for t in tiles_for(args, head_dim) if label(t) not in done]
        bad |= set(pending[:1])
    return bad


def time_suspect(args: argparse.Namespace, head_dim: int, results: list[dict[str, Any]]) -> str | None:
    """The gluon tiling a crashed time child was timing (its first without a result), or None."""
    if not any("crash" in r for r in results):
        return None
    done = {r["provider"] for r in results if "provider" in r}
    pending = [label(t) for t in tiles_for(args, head_dim) if label(t) not in done]
    return pending[0] if pending else None


def check_line(args: argparse.Namespace, r: dict[str, Any]) -> str:
    if "crash" in r:
        return f"check {checks(args)[r['index']]}: CRASHED or HUNG (exit {r['crash']})"
    verdict = "ok  " if r["ok"] else "FAIL"
    return (f"check {verdict} {tuple(r['shape'])} {r['tiles']}: out err {r['out_err']:.2e} "
            f"(flash_fwd {r['base_out_err']:.2e}), lse err {r['lse_err']:.2e} (flash_fwd {r['base_lse_err']:.2e})"
            + (f"\n      {r['where']}" if r["where"] else ""))


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per shape: TFLOP/s of cuDNN, flash_fwd, the best gluon tiling, and the ratios."""
    by_shape: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if "provider" in r:
            by_shape.setdefault((r["dtype"], r["head_dim"], r["causal"], r["seqlen"]), {})[r["provider"]] = r
    lines = [f"{'dtype':5} {'hd':>3} {'causal':6} {'seqlen':>6} | {'cuDNN':>6} {'flash_fwd':>9} {'gluon':>6} | "
             f"{'g/cuDNN':>7} {'g/ffwd':>6} | best gluon tiles"]
    ratios = []
    for (dtype, d, causal, s), got in sorted(by_shape.items()):
        tflops = {name: float(r.get("tflops") or float("nan")) for name, r in got.items()}
        gluons = {name: t for name, t in tflops.items() if name.startswith("gluon")}
        best = max(gluons, key=lambda n: -1 if math.isnan(gluons[n]) else gluons[n], default="gluon")
        nan = float("nan")
        g, c, f = tflops.get(best, nan), tflops.get("cudnn", nan), tflops.get("flash_fwd", nan)
        if g == g and c == c:
            ratios.append(g / c)
        lines.append(f"{dtype:5} {d:>3} {causal!s:6} {s:>6} | {c:6.0f} {f:9.0f} {g:6.0f} | {g / c:7.2f} "
                     f"{g / f:6.2f} | {best}")
    if ratios:
        lines.append(f"geomean gluon / cuDNN over {len(ratios)} shapes: "
                     f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    return lines


def parse_skip(text: str) -> set[str]:
    """``--skip``'s labels: split at the commas outside brackets (a label's tiles are "[128, 128, 8]")."""
    names, depth, start = set(), 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.add(text[start:i].strip())
            start = i + 1
    return names - {""}


def parse_label(name: str) -> Tiling:
    """The tiling a ``label`` names (the inverse of ``label``)."""
    tiles = tuple(int(x) for x in name[name.index("[") + 1:name.index("]")].split(","))
    name, _, q_tiles = name.partition("x") if "+pingpongx" in name else (name, "", "")
    pingpong = name.endswith("+pingpong")
    found = (tiles[0], tiles[1], tiles[2]), pingpong or name.endswith("+producer"), pingpong
    return (*found, int(q_tiles)) if q_tiles else found


def table_rows(rows: list[dict[str, Any]]) -> list[str]:
    """``flash_fwd.dispatch.GLUON_TABLE`` rows from the timings: per (dtype, head dim, causal), the gluon tiling with
    the best geomean over the timed seqlens, where that beats flash_fwd's (ready to paste; the rest keeps
    flash_fwd). Comments: TFLOP/s gluon / flash_fwd / cuDNN, geomean over the seqlens."""
    groups: dict[tuple[str, int, bool], dict[str, list[float]]] = {}
    for r in rows:
        if "provider" in r and r.get("tflops"):
            group = groups.setdefault((r["dtype"], r["head_dim"], r["causal"]), {})
            group.setdefault(r["provider"], []).append(float(r["tflops"]))

    def geomean(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    lines = []
    for (dtype, d, causal), got in sorted(groups.items()):
        n = len(got.get("flash_fwd", []))
        whole = {name: geomean(xs) for name, xs in got.items() if len(xs) == n and n}  # timed at every seqlen
        gluons = {name: t for name, t in whole.items() if name.startswith("gluon")}
        if not gluons or "flash_fwd" not in whole:
            continue
        best = max(gluons, key=gluons.__getitem__)
        if gluons[best] > whole["flash_fwd"]:
            lines.append(f"    ({dtype!r}, {d}, {causal}): {parse_label(best)},  # {gluons[best]:.0f} / "
                         f"{whole['flash_fwd']:.0f} / {whole.get('cudnn', float('nan')):.0f}".replace("'", '"'))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="time seqlens 1k and 4k only")
    parser.add_argument("--sweep", action="store_true", help="check and time every gluon tiling, not the default")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds a child may run (hangs end here)")
    parser.add_argument("--reps", type=int, default=30, help="timed runs per median")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compile processes")
    parser.add_argument("--only", choices=("compile", "check", "time"), action="append", help="stages to run")
    parser.add_argument("--head-dims", default="", help="comma-separated head dims to compile, check and time "
                        "(default: every one gluon serves)")
    parser.add_argument("--q-tiles", default="", help="comma-separated query tiles a program walks (2, 4, 8): each "
                        "ping-pong tiling also with that many (short sequences)")
    parser.add_argument("--wide", action="store_true", help="also the wide tiles: three consumer warpgroups of 64 "
                        "rows without turns (gluon.WIDE_CONFIGS)")
    parser.add_argument("--skip", default="", help="comma-separated gluon tilings not to run (as the table names them)")
    parser.add_argument("--job", choices=("compile", "check", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.skip = parse_skip(args.skip)
    if args.job == "compile":
        job_compile(args, args.index)
        return 0
    if args.job == "check":
        job_check(args, args.index)
        return 0
    if args.job == "time":
        job_time(args, args.index)
        return 0

    out_dir = os.environ.get("OUT")
    logfile = Path(out_dir) / "probe_gluon.log" if out_dir else None
    if logfile is not None:
        logfile.parent.mkdir(parents=True, exist_ok=True)
    import torch

    import lazytriton

    try:
        from importlib.metadata import version

        triton_version = version("triton")
    except Exception:
        triton_version = "none"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (every child will fail)"
    log(f"probe_gluon: {gpu}, torch {torch.__version__}, triton {triton_version}, "
        f"lazytriton {lazytriton.__version__}, cache {os.environ.get('LAZYTRITON_CACHE_DIR', '(default)')}", logfile)
    stages = args.only or ["compile", "check", "time"]
    # Tilings an earlier run's checks found wrong, faulting or hanging (kept under $OUT) are not timed again.
    skip_file = Path(out_dir) / "probe_gluon.skip" if out_dir else None
    if "check" not in stages and skip_file is not None and skip_file.exists():
        args.skip |= {name for name in skip_file.read_text().split("\n") if name}
        log(f"skipping, as an earlier run's checks said: {sorted(args.skip)}", logfile)
    summary: list[str] = []
    if "compile" in stages:  # compile shards in parallel (one variant takes 3-10 s), each in its own process
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:
            shards = list(pool.map(lambda i: run_child(args, "compile", i, logfile), range(args.jobs)))
        for r in (r for shard in shards for r in shard):
            line = (f"compile {'ok  ' if r.get('ok') else 'FAIL'} {r.get('variant', '(crashed)')}: "
                    + (f"{r.get('s')} s, shared {r.get('shared')}, warps {r.get('num_warps')}, scratch "
                       f"{r.get('scratch')}, triton {r.get('triton')}" if r.get("ok") else str(r.get("error", r))))
            log(line, logfile)
            summary += [line] if not r.get("ok") else []
    if "check" in stages:
        for i in range(len(checks(args))):
            got = run_child(args, "check", i, logfile)
            for r in got:
                line = check_line(args, r)
                log(line, logfile)
                summary += [line] if "FAIL" in line or "CRASH" in line else []
            bad = suspects(args, checks(args)[i][6], got)
            if bad - args.skip:
                log(f"  not timed from here on (wrong, crashed or hung): {sorted(bad - args.skip)}", logfile)
                args.skip |= bad
        if skip_file is not None:
            skip_file.write_text("\n".join(sorted(args.skip)) + "\n")
    rows: list[dict[str, Any]] = []
    if "time" in stages:
        for i in range(len(time_shapes(args))):
            got = run_child(args, "time", i, logfile)
            for r in got:
                log(f"time {json.dumps(r)}", logfile)
            rows += got
            hung = time_suspect(args, time_shapes(args)[i][1], got)
            if hung is not None:  # a child ends at a hang (finish): the tiling it was timing is not timed again
                log(f"  not timed from here on (crashed or hung while timed): {hung}", logfile)
                args.skip.add(hung)
        if out_dir:
            with (Path(out_dir) / "probe_gluon.csv").open("a", newline="") as f:
                writer = csv.writer(f)  # quoted: a tiling's label has commas ("gluon[128, 128, 4]")
                for r in rows:
                    if "provider" in r:
                        writer.writerow([r.get(k) for k in ("provider", "dtype", "head_dim", "causal", "seqlen",
                                                            "batch", "heads", "ms", "tflops", "rel_err")]
                                        + [triton_version])
    log("", logfile)
    log(f"== summary ({len(summary)} failures) ==", logfile)
    for line in summary:
        log(line, logfile)
    for line in table(rows):
        log(line, logfile)
    log("flash_fwd.dispatch.GLUON_TABLE rows (gluon beats flash_fwd; shapes not listed keep flash_fwd):", logfile)
    for line in table_rows(rows):
        log(line, logfile)
    return 1 if summary else 0


if __name__ == "__main__":
    sys.exit(main())
