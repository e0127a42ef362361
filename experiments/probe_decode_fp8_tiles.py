"""Probe: the float8 KV cache's split-kernel tiles beside the bf16 cache's (H200; not a benchmark).

``bench_decode.py --kv-dtype e4m3`` found the e4m3 cache as fast as the bf16
cache, not twice: both read 64 keys a tile (head dim 128), so the float8
tile holds half the bytes and half as many bytes are in flight. This probe
times, per case, the bf16 cache at its default tiles, the e4m3 cache at its
default tiles and at candidate (BLOCK_N, num_warps, num_stages) forced through
``binding.launch_gpu(forced=...)`` as a call launches them, each checked
against the default e4m3 output. One query per sequence, 32/8 heads, head dim
128, contiguous caches (``--paged``: pages of 256 keys).

``--nv-cvt`` runs the e4m3 kernels with V's float8 tile converted by PTX in
the load's layout (the description's NV_CVT from sm_89, off by default:
``kernels/flash_decode/__init__.py``'s ``NV_CVT_FROM``); run it in its own
cache dir, beside a run without it, to compare the two.

Usage: python experiments/probe_decode_fp8_tiles.py [--batches 1,8,32] [--lengths 4096,16384,32768] [--paged]
       [--nv-cvt] [--candidates 64x4x5,128x4x5] [--splits 0,16,64]
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

from lazytriton.cli.timing import event_ms
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.machine import target_of_device
from lazytriton.record import replace
from lazytriton.tiles import Config

CANDIDATES = ((64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 8, 3), (128, 8, 2), (256, 4, 2), (256, 8, 2), (256, 8, 3))
HQ, HK, D, PAGE = 32, 8, 128, 256


def split_variant(target: Any, call: Any, aligned: bool, index64: bool, config: Config) -> Any:
    """``binding.variants``' split variant with ``config`` forced."""
    return decode_dispatch.decode_variant(
        "flash_decode_split", target, "bf16", call.head_dim, call.causal, aligned, call.rows, call.capacity,
        config=config, index64=index64, page_size=call.page_size, head_dim_v=call.head_dim_v, paged=call.paged,
        kv_fp8=call.kv_fp8)


def inputs(batch: int, length: int, fp8: bool, paged: bool, gen: torch.Generator) -> checks.Inputs:
    q = torch.randn(batch, 1, HQ, D, generator=gen, device="cuda").to(torch.bfloat16)
    shape = (batch * length // PAGE, PAGE, HK, D) if paged else (batch, length, HK, D)
    k, v = (torch.randn(shape, generator=gen, device="cuda") for _ in range(2))
    table = (torch.randperm(batch * length // PAGE, generator=gen, device="cuda").reshape(batch, -1)
             .to(torch.int32) if paged else None)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    if not fp8:
        return checks.Inputs(q, k.to(torch.bfloat16), v.to(torch.bfloat16), None, None, lens, None, table)
    descale = torch.full((batch, HK), 0.5, device="cuda")
    return checks.Inputs(q, (k * 2).to(torch.float8_e4m3fn), (v * 2).to(torch.float8_e4m3fn), None, None, lens,
                         None, table, k_descale=descale, v_descale=descale)


def timed_ms(t: checks.Inputs, out: torch.Tensor, lse: torch.Tensor, call: Any, pair: tuple[Any, Any],
             reps: int) -> float:
    """Median event-timed ms of the call launched with the (split, combine) ``pair`` forced."""
    return event_ms(lambda: binding.launch_gpu(t, out, lse, call, forced=pair), reps=reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--lengths", default="4096,16384,32768")
    p.add_argument("--paged", action="store_true")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--nv-cvt", action="store_true", help="V's float8 tile converted by PTX (NV_CVT from sm_89)")
    p.add_argument("--candidates", default=",".join("x".join(map(str, c)) for c in CANDIDATES),
                   help="BLOCK_N x warps x stages, comma-separated (a paged call's block-table read takes a stage)")
    p.add_argument("--splits", default="0",
                   help="split counts to force on each e4m3 candidate (0: the heuristic's), comma-separated")
    args = p.parse_args()
    candidates = [tuple(int(x) for x in c.split("x")) for c in args.candidates.split(",")]
    split_counts = [int(x) for x in args.splits.split(",")]
    if args.nv_cvt:  # before the description is first looked up: its fingerprint (the keys) follows it
        import lazytriton.kernels.flash_decode as family
        from lazytriton.kernels import get, source_fingerprint

        flags = tuple((name, 89 if name == "NV_CVT" else since)
                      for name, since in family.FLASH_DECODE_SPLIT.capability_flags)  # the others as they are
        family.FLASH_DECODE_SPLIT = replace(family.FLASH_DECODE_SPLIT, capability_flags=flags)
        assert get("flash_decode_split") is family.FLASH_DECODE_SPLIT, "looked up before the patch"
        print("NV_CVT from sm_89; fingerprint", source_fingerprint("flash_decode_split"))
    target = target_of_device(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, length in itertools.product(map(int, args.batches.split(",")), map(int, args.lengths.split(","))):
        timed: dict[str, float] = {}
        for fp8 in (False, True):
            t = inputs(batch, length, fp8, args.paged, gen)
            call = checks.check(t)
            out, lse = binding.empty_outputs(t.q, call)
            aligned, index64 = binding.layout_flags(t, out)
            split, combine = binding.variants(target, t.q.dtype, call, aligned, index64)
            timed["bf16" if not fp8 else "e4m3"] = timed_ms(t, out, lse, call, (split, combine), args.reps)
            if not fp8:
                continue
            want = out.clone()
            block_m = int(split.get("BLOCK_M"))
            for (bn, warps, stages), splits in itertools.product(candidates, split_counts):
                forced = split_variant(target, call, aligned, index64, Config(block_m, bn, warps, stages))
                at = call._replace(num_splits=splits) if splits else call
                name = f"{bn}x{warps}x{stages}" + (f"/{splits}" if splits else "")
                try:
                    binding.launch_gpu(t, out, lse, at, forced=(forced, combine))
                    err = float((out.float() - want.float()).abs().max())
                    ms = timed_ms(t, out, lse, at, (forced, combine), args.reps)
                except Exception as exc:  # a candidate that does not build or launch: shown, not fatal
                    print(f"b{batch} {length}: {name} failed: {type(exc).__name__}: {exc}"[:300])
                    continue
                timed[name] = ms
                if err > 1e-2:
                    print(f"b{batch} {length}: {name} differs from the default by {err:.3g}")
        fp8_bytes = batch * length * HK * D * 2
        best = min((k for k in timed if k not in ("bf16", "e4m3")), key=timed.__getitem__)
        rows.append((batch, length, timed, best, fp8_bytes))
        print(f"b{batch:<3} {length:>6}: " + "  ".join(f"{k} {v:.4f}" for k, v in timed.items()), flush=True)
    print(f"\n{'case':<14}{'bf16 ms':>9}{'e4m3 ms':>9}{'best':>12}{'best ms':>9}{'GB/s':>7}{'x bf16':>8}")
    for batch, length, timed, best, fp8_bytes in rows:
        print(f"b{batch:<3} {length:>8}{timed['bf16']:9.4f}{timed['e4m3']:9.4f}{best:>12}{timed[best]:9.4f}"
              f"{fp8_bytes / timed[best] / 1e6:7.0f}{timed['bf16'] / timed[best]:8.2f}")


if __name__ == "__main__":
    main()
