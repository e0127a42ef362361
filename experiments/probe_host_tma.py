"""Probe: flash_fwd_host_tma (K and V through host tensor descriptors) against the pointer kernel and cuDNN.

FACTS.md measured about +20% over pointer loads for a forward with host
descriptors on the H200; the device-side descriptors of ``TMA=true``
measured 0.93x (NOTES.md). This runs the host-descriptor kernel the way a
call would: compiled through lazytriton's compile path
(``runtime.get().kernel``: cache, else JIT), launched by lazytriton's own
launcher, which encodes the two CUtensorMaps (``cuTensorMapEncodeTiled``)
from (base, sizes, strides) and passes them by value.

1. Numerics, per dtype x head dim x causal x config: B=2, H=4, seqlens 1000
   and 1024 (odd and even), against a float32 reference (SDPA math in fp32);
   FlashAttention's rule: error at most 2x SDPA's own (same dtype) + 1e-4.
2. Speed, bench_flash_fwd.py's shapes (batch x seqlen = 16k, hidden 2048),
   bf16/fp16 x head dim 64/128 x causal or not x seqlen 4k/16k: the best of a
   few configs (FACTS.md's best host-TMA configs), against the pointer kernel
   at dispatch's config and SDPA's cuDNN backend; event-timed medians
   (``lazytriton.cli.timing.median_ms``); output checked against cuDNN's.
3. Host cost of the encode: µs a launch of a tiny shape with the maps cached
   (same tensors each call) and re-encoded (two K/V pairs alternated), on the
   compiled helper and on the cffi ABI path.

A shape or config that fails (compile, launch, numerics) is reported and the
run goes on. The table comes last. With $OUT set, the log goes to
$OUT/probe_host_tma.log and rows to $OUT/probe_host_tma.csv.

Usage: python experiments/probe_host_tma.py [--quick]   (needs sm_90: TMA)
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lazytriton import driver, machine, runtime
from lazytriton.cli.timing import median_ms
from lazytriton.driver import fastlaunch
from lazytriton.kernels.flash_fwd import binding
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.variant import Variant

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (BLOCK_M, BLOCK_N, num_warps, num_stages). FACTS.md, host-descriptor forward on the H200 (Triton 3.6):
# best BLOCK_M 128, BLOCK_N 64 (head dim 128) or 128 (64), 4 warps, 2-3 stages.
CONFIGS = {64: ((128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 3)),
           128: ((128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2))}
LOG: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    LOG.append(text)


def variant(dtype: str, d: int, causal: bool, config: tuple[int, int, int, int]) -> Variant:
    bm, bn, warps, stages = config
    return Variant.parse(f"flash_fwd_host_tma:sm_90:{dtype}:ALIGN16=true,BLOCK_D={d},CAUSAL={str(causal).lower()},"
                         f"EVEN_D=true:BLOCK_M={bm},BLOCK_N={bn}:num_stages={stages},num_warps={warps}")


def host_tma_call(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  block_m: int) -> tuple[Any, torch.Tensor]:
    """A no-argument launch of ``kernel`` on q, k, v (SDPA layout, top-left causal), and its output."""
    b, h, s_q, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s_q, device=q.device, dtype=torch.float32)
    ints = (q.data_ptr(), k.data_ptr(), *k.shape, *k.stride(), v.data_ptr(), *v.shape, *v.stride(),
            out.data_ptr(), lse.data_ptr(), *q.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
            h // k.shape[1], s_q, k.shape[2], d, 0)
    floats = (1.0 / math.sqrt(d),)
    grid = ((s_q + block_m - 1) // block_m, h, b)
    stream = torch.cuda.current_stream().cuda_stream

    def run() -> torch.Tensor:
        kernel.launch(grid, stream, ints, floats)
        return out

    return run, out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def check_numerics(dtype: str, d: int, causal: bool, config: tuple[int, int, int, int]) -> str:
    """'ok' or why not, against a float32 reference on small odd and even seqlens."""
    kernel = runtime.get().kernel(variant(dtype, d, causal, config), torch.cuda.current_device())
    for s in (1000, 1024):
        q, k, v = (torch.randn(2, 4, s, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        same = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        run, _ = host_tma_call(kernel, q, k, v, causal, config[0])
        err, bound = rel_err(run(), ref), 2 * rel_err(same, ref) + 1e-4
        torch.cuda.synchronize()
        if not err <= bound:
            return f"seqlen {s}: error {err:.2e} > bound {bound:.2e}"
    return "ok"


def time_shape(dtype: str, d: int, causal: bool, s: int, quick: bool) -> dict[str, Any]:
    """TFLOP/s of the best host-TMA config, the pointer kernel and cuDNN on one shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        cudnn_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), on_gpu=True)
    call = binding.check(q, k, v, causal)
    out_p, lse_p = binding.empty_outputs(q, call.shape)
    target = machine.target_of_device(q.device)
    ptr = fwd_dispatch.flash_fwd_variant(target, dtype, d, causal, True, s, seqlen_k=s)  # type: ignore[arg-type]
    ptr_ms = median_ms(lambda: binding.launch_gpu(q, k, v, out_p, lse_p, call, ptr), on_gpu=True)
    row: dict[str, Any] = {"dtype": dtype, "d": d, "causal": causal, "seqlen": s, "cudnn": flops / cudnn_ms / 1e9,
                           "ptr": flops / ptr_ms / 1e9, "ptr_err": rel_err(out_p, ref), "tma": math.nan,
                           "tma_err": math.nan, "config": "-"}
    for config in CONFIGS[d][:2] if quick else CONFIGS[d]:
        name = "{}/{}/{}w/{}s".format(*config)
        try:
            kernel = runtime.get().kernel(variant(dtype, d, causal, config), q.device.index)
            run, out = host_tma_call(kernel, q, k, v, causal, config[0])
            run()
            err = rel_err(out, ref)
            if not err < 2e-2:
                say(f"  {dtype} d{d} causal={causal} s{s} {name}: output differs from cuDNN's ({err:.2e})")
                continue
            tflops = flops / median_ms(run, on_gpu=True) / 1e9
            say(f"  {dtype} d{d} causal={causal} s{s} {name}: {tflops:.1f} TFLOP/s (err {err:.1e})")
            if not tflops <= row["tma"]:  # NaN at first
                row.update(tma=tflops, tma_err=err, config=name)
        except Exception as exc:  # a config that does not compile, fit or launch is reported, not fatal
            say(f"  {dtype} d{d} causal={causal} s{s} {name}: {type(exc).__name__}: {str(exc)[:200]}")
    return row


def host_cost(dtype: str = "bf16") -> list[str]:
    """µs per launch of a tiny shape: maps cached vs re-encoded each call, on each launch path."""
    config = CONFIGS[64][0]
    entry = runtime.get().kernel(variant(dtype, 64, False, config), torch.cuda.current_device()).entry
    tensors = [torch.randn(1, 1, 128, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(5)]
    lines = []
    for path in ("compiled helper", "cffi ABI mode"):
        previous = fastlaunch.enable(path == "compiled helper")
        try:
            kernel = driver.load(entry, torch.cuda.current_device())
            if (kernel.fast is not None) != (path == "compiled helper"):
                lines.append(f"{path}: not available here")
                continue
            calls = [host_tma_call(kernel, tensors[0], tensors[i], tensors[i + 1], False, config[0])[0]
                     for i in (1, 3)]
            for label, order in (("maps cached", [0, 0]), ("re-encoded (2 maps a call)", [0, 1])):
                for _ in range(200):
                    calls[0]()
                torch.cuda.synchronize()
                n = 2000
                began = time.perf_counter()
                for i in range(n):
                    calls[order[i % 2]]()
                elapsed = time.perf_counter() - began
                torch.cuda.synchronize()
                lines.append(f"{path:16} {label:27} {elapsed / n * 1e6:7.2f} µs a launch (host)")
        finally:
            fastlaunch.enable(previous)
    return lines


def write_out(rows: list[dict[str, Any]]) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "probe_host_tma.log").write_text("\n".join(LOG) + "\n")
    if rows:
        with open(Path(out) / "probe_host_tma.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seqlen 4k only, two configs a head dim")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs an sm_90+ CUDA GPU (TMA)", file=sys.stderr)
        return 2
    import triton

    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"launch path {fastlaunch.path_name()}")
    say("numerics (float32 reference, FlashAttention's 2x rule):")
    for dtype in DTYPES:
        for d in (64, 128):
            for causal in (False, True):
                for config in CONFIGS[d][:1] if args.quick else CONFIGS[d]:
                    try:
                        verdict = check_numerics(dtype, d, causal, config)
                    except Exception as exc:
                        verdict = f"{type(exc).__name__}: {str(exc)[:200]}"
                        LOG.append(traceback.format_exc())
                    say(f"  {dtype} d{d} causal={causal} {'{}/{}/{}w/{}s'.format(*config)}: {verdict}")
    say("speed (best config per shape):")
    rows = []
    for dtype in DTYPES:
        for d in (64, 128):
            for causal in (False, True):
                for s in (4096,) if args.quick else (4096, 16384):
                    try:
                        rows.append(time_shape(dtype, d, causal, s, args.quick))
                    except Exception as exc:  # one failing shape never stops the run
                        say(f"  {dtype} d{d} causal={causal} s{s}: {type(exc).__name__}: {str(exc)[:200]}")
                        LOG.append(traceback.format_exc())
                    torch.cuda.empty_cache()
    say("host cost of a launch (tiny shape):")
    try:
        for line in host_cost():
            say("  " + line)
    except Exception as exc:
        say(f"  {type(exc).__name__}: {str(exc)[:200]}")
    say("")
    say(f"{'dtype':5} {'d':>4} {'causal':6} {'seqlen':>6} {'config':12} {'tma':>7} {'ptr':>7} {'cudnn':>7} "
        f"{'tma/ptr':>7} {'tma/cudnn':>9}   TFLOP/s")
    ratios: dict[str, list[float]] = {"ptr": [], "cudnn": []}
    for r in rows:
        tp, tc = r["tma"] / r["ptr"], r["tma"] / r["cudnn"]
        for name, value in (("ptr", tp), ("cudnn", tc)):
            if math.isfinite(value):
                ratios[name].append(value)
        say(f"{r['dtype']:5} {r['d']:>4} {r['causal']!s:6} {r['seqlen']:>6} {r['config']:12} {r['tma']:7.1f} "
            f"{r['ptr']:7.1f} {r['cudnn']:7.1f} {tp:6.2f}x {tc:8.2f}x")
    for name, values in ratios.items():
        if values:
            say(f"geomean tma/{name}: {math.exp(sum(map(math.log, values)) / len(values)):.3f}x over {len(values)}")
    write_out(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
