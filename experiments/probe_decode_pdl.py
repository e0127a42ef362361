"""Does programmatic dependent launch (PDL) shorten a decoding call's split -> combine pair on Hopper?

A decoding call with several splits is two launches: the split kernel writes partial outputs, the combine kernel
merges them. Between the two the device drains the split grid, then launches and ramps up the combine grid. With
PDL (sm_90: ``griddepcontrol``), the split kernel lets its dependent launch early
(``gdc_launch_dependents``) and the combine kernel, launched with the programmatic-serialization attribute, waits
for the split grid's memory (``gdc_wait``) only where it reads the partials: its launch overlaps the split's tail.

This probe runs the project's own decode kernels through Triton's JIT (so no launcher of lazytriton changes): the
kernel file's text with the two calls inserted behind a ``PDL`` constexpr, the variants, splits and arguments of
the call as ``flash_attn_with_kvcache`` makes them (bench_decode.py's contiguous case: bf16, head dim 128, 32 query
/ 8 key-value heads, one query). For each (batch, length): the output against lazytriton's call (bit for bit), then
the µs a call, (a) back to back behind a spin kernel (the host's launch cost hidden: what the device takes for eager
calls) and (b) replayed from a CUDA graph, without and with PDL, beside lazytriton's own call and SDPA (cuDNN).

Usage: python3 experiments/probe_decode_pdl.py [--batches 1,8] [--lengths 1024,4096] [--calls 100]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

import lazytriton
from lazytriton import machine
from lazytriton.kernels import get
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.trust import trusted_indices
from lazytriton.variant import kernel_constexprs

KERNEL_FILE = pathlib.Path(binding.__file__).with_name("triton_kernel.py")


def pdl_module():
    """The decode kernels' module with PDL: the split kernel releases its dependent, the combine kernel waits."""
    text = KERNEL_FILE.read_text()
    marks = [("    NV_CVT: tl.constexpr = False,\n):\n",
              "    NV_CVT: tl.constexpr = False, PDL: tl.constexpr = False,\n):\n"),
             ("    batch = tl.program_id(2)\n    IEEE: tl.constexpr",
              "    batch = tl.program_id(2)\n    if PDL:\n        tl.extra.cuda.gdc_launch_dependents()\n"
              "    IEEE: tl.constexpr"),
             ("    SINKS: tl.constexpr = False,\n):\n    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)\n",
              "    SINKS: tl.constexpr = False, PDL: tl.constexpr = False,\n):\n    if PDL:\n"
              "        tl.extra.cuda.gdc_wait()\n    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)\n")]
    for old, new in marks:
        if text.count(old) != 1:
            sys.exit(f"the kernel file changed: {old!r} is not found once")
        text = text.replace(old, new)
    path = pathlib.Path(tempfile.mkdtemp()) / "decode_pdl_kernels.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("decode_pdl_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def behind_spin_us(fn, calls: int) -> float:
    """Median over 5 rounds of the µs a call, ``calls`` calls enqueued behind a spin (the device never waits)."""
    rounds = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # ~20 ms: longer than the host takes to enqueue the calls
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(rounds)


def graph_us(fn, calls: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return behind_spin_us(graph.replay, 1) / calls


def case(module, batch: int, length: int, calls: int) -> dict[str, float]:
    gen = torch.Generator(device="cuda").manual_seed(batch * 100_003 + length)
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                        for _ in range(2))
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")

    def ours():
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)

    want = ours()
    t = checks.Inputs(q, k_cache, v_cache, cache_seqlens=lens)
    call = checks.check(t)
    out, lse = binding.empty_outputs(q, call)
    aligned, index64 = binding.layout_flags(t, out)
    split_kernel, block_m, block_n, _, _ = binding.plan(q.device, q.dtype, call, aligned, index64)
    splits = binding.splits_for(call, block_m, block_n,
                                binding.gpu_slots(q.device.index, getattr(split_kernel, "shared", 0)),
                                binding.min_split_keys(call.head_dim))
    split_v, combine_v = binding.variants(machine.target_of_device(q.device), q.dtype, call, aligned, index64)
    part_out, part_lse = binding._partials(lse, call, splits)  # noqa: SLF001 (the probe's own copy of the call)
    ints = binding.split_ints(t, out, lse, part_out, part_lse, call, splits, pointers=lambda x: x)
    cints = binding.combine_ints(part_out, part_lse, out, lse, call, splits, pointers=lambda x: x)
    grid = binding.split_grid(call.rows, block_m, splits, call.heads_k, call.batch)
    cgrid = binding.combine_grid(call.lse_rows, int(combine_v.get("BLOCK_M")))
    split_fn, combine_fn = module.flash_decode_split_kernel, module.flash_decode_combine_kernel
    split_c = kernel_constexprs(split_v, get(split_v.kernel).constexprs)
    combine_c = kernel_constexprs(combine_v, get(combine_v.kernel).constexprs)
    floats = binding.floats(call)

    def jit(pdl: bool):
        def run():
            split_fn[grid](*ints, *floats, **split_c, **dict(split_v.options), PDL=pdl)
            if splits > 1:
                combine_fn[cgrid](*cints, **combine_c, **dict(combine_v.options), PDL=pdl, launch_pdl=pdl)
        return run

    row = {"splits": float(splits)}
    compiled = split_fn[grid](*ints, *floats, **split_c, **dict(split_v.options), PDL=True)
    row["split_gdc"] = float(compiled.asm["ptx"].count("griddepcontrol.launch_dependents"))
    if splits > 1:
        compiled = combine_fn[cgrid](*cints, **combine_c, **dict(combine_v.options), PDL=True, launch_pdl=True)
        row["combine_gdc"] = float(compiled.asm["ptx"].count("griddepcontrol.wait"))
    for pdl in (False, True):
        out.fill_(float("nan"))
        jit(pdl)()
        torch.cuda.synchronize()
        row[f"equal_pdl{int(pdl)}"] = float(torch.equal(out, want))
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k_cache, v_cache))
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)  # noqa: E731
    for name, fn in (("jit", jit(False)), ("jit+pdl", jit(True)), ("lazytriton", ours), ("sdpa", sdpa)):
        row[f"{name} eager"] = behind_spin_us(fn, calls)
        row[f"{name} graph"] = graph_us(fn, calls)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    module = pdl_module()
    names = ("jit", "jit+pdl", "lazytriton", "sdpa")
    print(f"{'batch':>5} {'keys':>6} {'splits':>6} {'equal':>5}  " + "  ".join(f"{n + ' ' + m:>16}" for m in
                                                                            ("eager", "graph") for n in names)
          + "  pdl gain eager / graph")
    for batch in (int(b) for b in args.batches.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            r = case(module, batch, length, args.calls)
            if "combine_gdc" in r and not (r["split_gdc"] and r["combine_gdc"]):
                print(f"griddepcontrol missing from the PTX: split {r['split_gdc']}, combine {r['combine_gdc']}")
            equal = "yes" if r["equal_pdl0"] and r["equal_pdl1"] else "NO"
            cells = "  ".join(f"{r[n + ' ' + m]:>16.2f}" for m in ("eager", "graph") for n in names)
            gain = (f"{r['jit eager'] / r['jit+pdl eager']:.3f}x / {r['jit graph'] / r['jit+pdl graph']:.3f}x")
            print(f"{batch:>5} {length:>6} {int(r['splits']):>6} {equal:>5}  {cells}  {gain}", flush=True)


if __name__ == "__main__":
    main()
