"""Probe: Triton's automatic warp specialisation and persistent kernels on Hopper (issue 12's levers).

``benchmarks/ws_probe_kernel.py`` (a FlashAttention forward through
device-side tensor descriptors) is launched through Triton's JIT with
``warp_specialize`` on and off, as a grid of tiles and as a persistent kernel
(``ws_fwd_persistent``: one program per SM walking the tiles, longest rows
first), for bf16 x head dim 64/128 x causal or not x 1k/4k/16k tokens (batch
x seqlen = 16k, hidden 2048: bench_flash_fwd.py's shapes), over a few
tilings. Each is checked against SDPA in float32 (relative error), then timed
(median of CUDA-event-timed runs), beside ``lazytriton.flash.attn_fwd``
(dispatch: the Gluon kernel where GLUON_TABLE says, else flash_fwd) and
SDPA's cuDNN backend. A config that fails to compile is reported as such.
Prints one table (the best tiling of each kind); ``--csv`` appends
long-format rows.

Usage: python benchmarks/probe_warp_spec.py [--quick] [--csv PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_flash_fwd import FIELDS, rel_err, time_ms
from csvlog import append_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ws_probe_kernel  # noqa: E402

from lazytriton.flash import attn_fwd  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
TILINGS = ((128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3))  # 128x128 with 3 stages: out of shared memory with WS
TOKENS = 16384
HIDDEN = 2048


def _alloc(size: int, alignment: int, stream: object) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    return 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)


def launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, tiling: tuple[int, int, int, int],
             ws: bool, one_loop: bool, persistent: bool = False):
    """A closure launching the probe kernel (``persistent``: one program per SM walking the tiles)."""
    b, h, s, d = q.shape
    o = torch.empty_like(q)
    bm, bn, warps, stages = tiling
    kernel = ws_probe_kernel.ws_fwd_persistent if persistent else ws_probe_kernel.ws_fwd
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    grid = (min(sms, s // bm * b * h),) if persistent else (s // bm, b * h)

    def run() -> torch.Tensor:
        kernel[grid](q, k, v, o, d ** -0.5, b, h, s, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, WS=ws, CAUSAL=causal,
                     CAUSAL_ONE_LOOP=one_loop, num_warps=warps, num_stages=stages)
        return o
    return run


def measure_shape(d: int, causal: bool, s: int) -> tuple[tuple, dict[str, tuple[float, float]]]:
    """One shape: every provider checked, then timed; the table's row and {provider: (ms, TFLOP/s)}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    result: dict[str, float] = {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        result["cudnn"] = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    result["lazytriton"] = time_ms(lambda: attn_fwd(q, k, v, causal=causal))
    kinds = [(ws, one_loop, False) for ws in (False, True) for one_loop in ((False, True) if causal else (False,))
             if not (ws and causal and not one_loop)]  # the pass asserts on a second loop (ws_probe_kernel's docstring)
    kinds += [(ws, True, True) for ws in (False, True)]  # persistent: one loop (masked when causal)
    for ws, one_loop, persistent in kinds:
        for tiling in TILINGS:
            name = (f"{'ws' if ws else 'plain'}{'-persistent' if persistent else ''}"
                    f"{'-1loop' if one_loop and causal and not persistent else ''} {tiling}")
            run = launcher(q, k, v, causal, tiling, ws, one_loop, persistent)
            try:
                err = rel_err(run(), ref)
            except Exception as exc:  # noqa: BLE001 (a compile failure is a finding)
                text = str(exc).splitlines()[-1][:120] if str(exc) else ""
                print(f"d{d} causal={causal} {s}: {name} failed: {type(exc).__name__}: {text}", flush=True)
                continue
            if err > 2e-2:
                print(f"d{d} causal={causal} {s}: {name} wrong (rel err {err:.2e})", flush=True)
                continue
            result[name] = time_ms(run)
    fl = flops(b, h, s, d, causal)
    tf = {name: fl / (ms * 1e-3) / 1e12 for name, ms in result.items()}
    print(f"d{d} causal={causal} {s}: " + ", ".join(f"{n} {t:.0f}" for n, t in tf.items()), flush=True)
    best = {kind: max((n for n in tf if n.split(" ")[0].replace("-1loop", "") == kind), key=tf.__getitem__,
                      default=None) for kind in ("plain", "ws", "plain-persistent", "ws-persistent")}
    return (d, causal, s, tf["cudnn"], tf["lazytriton"], best, tf), {
        name: (ms, tf[name]) for name, ms in result.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="head dim 128, 1k and 4k only")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("probe_warp_spec needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    import triton

    triton.set_allocator(_alloc)  # device-side descriptors need global scratch
    torch.manual_seed(0)

    rows, csv_rows = [], []
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for d in ((128,) if args.quick else (64, 128)):
        for causal in (False, True):
            for s in ((1024, 4096) if args.quick else (1024, 4096, 16384)):
                row, measured = measure_shape(d, causal, s)
                rows.append(row)
                for name, (ms, tflops) in measured.items():
                    csv_rows.append({"kernel": "ws_probe", "provider": name, "mode": "fwd", "dtype": "bfloat16",
                                     "head_dim": d, "causal": causal, "batch": TOKENS // s, "heads": HIDDEN // d,
                                     "seqlen": s, "p50_ms": round(ms, 4), "tflops": round(tflops, 1),
                                     "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "triton": triton.__version__, "timestamp": stamp})
    print("\nTFLOP/s bf16 (best tiling of each)  cuDNN  lazytriton  plain     ws  plain-pers  ws-pers  ws/plain"
          "  pers/plain")
    for d, causal, s, cudnn, lt, best, tf in rows:
        v = {kind: tf[name] if name else float("nan") for kind, name in best.items()}
        print(f"d{d:<3} {'causal' if causal else 'full  '} {s:>5}                 {cudnn:6.0f} {lt:10.0f} "
              f"{v['plain']:6.0f} {v['ws']:6.0f} {v['plain-persistent']:11.0f} {v['ws-persistent']:8.0f} "
              f"{v['ws'] / v['plain']:9.2f} {v['plain-persistent'] / v['plain']:11.2f}")
    for d, causal, s, _, _, best, _ in rows:
        print(f"d{d} {'causal' if causal else 'full'} {s}: " + "; ".join(f"{k} {n}" for k, n in best.items() if n))
    if args.csv:
        append_rows(args.csv, FIELDS, csv_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
