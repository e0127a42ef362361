"""Probe: the served fused backward (through the binding) beside the same kernel launched by Triton's JIT.

Times, for bench_flash_bwd.py's shapes (bf16), ``bwd.backward`` (prep, fused kernel, cast, as served) and
probe_gluon_bwd.ws_backward (the same three through Triton's JIT, both PREFETCH values, then the table's
with some ints left unspecialised), and lists the kernels the served backward launches with their times
(torch.profiler). It found (H200, 2026-12-01) the served entries 5-13% slower than the JIT's until the spec
marked lse's strides and the causal offset divisible by 16, as the JIT does, and a loop nest over the group's
heads costing 30% at head dim 256.

Usage: python experiments/probe_fused_served.py [--head-dims 256,128] [--seqlens 1024,16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_gluon_bwd  # noqa: E402

from lazytriton.cli.timing import event_ms  # noqa: E402
from lazytriton.kernels.flash_bwd import binding as bwd  # noqa: E402
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import binding as fwd  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="256,128,64")
    parser.add_argument("--seqlens", default="4096,16384")
    args = parser.parse_args(argv)
    import triton
    from triton.experimental import gluon

    from lazytriton.kernels.flash_bwd import fused_kernel

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    raw = fused_kernel.flash_bwd_fused_gluon_kernel.fn
    # Triton's JIT specialises ints (1 -> constant, multiples of 16 -> divisibility); the served entry marks the
    # pointers, data strides, seqlens, causal offset and lse strides. These two JIT functions leave group_size,
    # then also the others the served entry used to leave, unmarked.
    unspecialised = {"group": gluon.jit(do_not_specialize=["group_size"])(raw),
                     "ints": gluon.jit(do_not_specialize=["group_size", "heads_q", "causal_offset", "stride_lb",
                                                          "stride_lh"])(raw)}
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v, do = (torch.randn(b, h, s, d, device="cuda").to(torch.bfloat16) for _ in range(4))
                call = fwd.check(q, k, v, causal)
                bm = 128 if d == 64 and not causal else 64
                out, lse = fwd.forward(q, k, v, call)
                served = event_ms(lambda q=q, k=k, v=v, out=out, lse=lse, do=do, call=call:
                                  bwd.backward(q, k, v, out, lse, do, call), reps=10)
                jit = {p: event_ms(probe_gluon_bwd.ws_backward(q, k, v, out, lse.contiguous(), do, causal, (bm, p)),
                                   reps=10) for p in (False, True)}
                pf = bool(bwd_dispatch.BWD_FUSED_TABLE.get(("bf16", d, causal), (0, False))[1])
                for name, fn in unspecialised.items():
                    jit[name] = event_ms(probe_gluon_bwd.ws_backward(q, k, v, out, lse.contiguous(), do, causal,
                                                                     (bm, pf), fn), reps=10)
                rows.append((d, s, causal, served, jit))
                print(f"hd{d} {s} causal={causal}: served {served:.3f} ms, jit prefetch0 {jit[False]:.3f} "
                      f"prefetch1 {jit[True]:.3f}, unspecialised (prefetch {pf}) group {jit['group']:.3f} "
                      f"ints {jit['ints']:.3f}", flush=True)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    bwd.backward(q, k, v, out, lse, do, call)
                    torch.cuda.synchronize()
                kernels = [(e.key[:60], getattr(e, "device_time_total", 0) / 1e3) for e in prof.key_averages()]
                for name, ms in kernels:
                    print(f"    {ms:8.3f} ms  {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
