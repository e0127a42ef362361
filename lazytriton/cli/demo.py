"""``lazytriton demo``: one attention call and its backward through the cache, cold then warm.

On a GPU: a realistic shape, timed cold (entry from disk or compiled, loaded,
launched) and warm (memory), checked against SDPA. Without a GPU the cache
still does real work: the entry for ``sm_90`` is resolved cold and warm (it is
a real cubin, compiled here or read from disk), while the numbers come from
Triton's interpreter on a small shape. The interpreter compiles nothing, so
none of it is cached and none of it is reported as a cache hit.
"""

from __future__ import annotations

import math
import time

import torch

from lazytriton import machine, runtime
from lazytriton.cli.report import plural
from lazytriton.flash import attn_fwd
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    from lazytriton.kernels.flash_fwd.reference import attention_reference

    return attention_reference(q.double(), k.double(), v.double(), causal="top_left" if causal else False)[0]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _source_label(source: str) -> str:
    return {"jit": "jit (compiled now, stored in the local cache)", "memory": "memory (this process)",
            "local": "local disk cache"}.get(source, source)


def _summary(rt: runtime.Runtime, compiles_before: int) -> None:
    stats = rt.local.stats()
    print(f"compiles in this process: {rt.compiles}; in this cache since it was created: "
          f"{rt.counters().get('compiles', 0)} (was {compiles_before})")
    print(f"cache dir: {rt.settings.cache_dir} ({plural(stats.entries, 'entry')}, {stats.bytes / 2**20:.1f} MiB)")


def run_cpu() -> int:
    rt = runtime.get()
    compiles_before = rt.counters().get("compiles", 0)
    target = Target.parse("sm_90")
    b, h, s, d, causal = 1, 4, 128, 64, True
    print(f"no GPU used: the cache is shown on the {target} entry a GPU would launch; "
          "the numbers come from Triton's interpreter")
    variant = fwd_dispatch.flash_fwd_variant(target, "bf16", d, causal, True, s)
    print(f"variant: {variant}")
    cold = rt.resolve(variant)
    print(f"cold lookup: {cold.seconds * 1e3:9.2f} ms  served by {_source_label(cold.source)}")
    warm = rt.resolve(variant)
    print(f"warm lookup: {warm.seconds * 1e3:9.3f} ms  served by {_source_label(warm.source)}")
    print(f"entry: {cold.entry.kind} of {len(cold.entry.binary)} bytes, {cold.entry.num_warps} warps, "
          f"{cold.entry.shared} B shared memory, built by Triton {cold.entry.provenance.compiler_version}")
    gen = torch.Generator().manual_seed(int(time.time()))
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16) for _ in range(3))
    start = time.perf_counter()
    out, _ = attn_fwd(q, k, v, causal=causal)
    elapsed = time.perf_counter() - start
    print(f"attention {(b, h, s, d)} bf16 causal on CPU (interpreter): {elapsed:.2f} s, "
          f"relative error vs float64 reference {_rel_err(out, _reference(q, k, v, causal)):.1e}")
    _backward_cpu(rt, target, q, k, v, causal)
    _summary(rt, compiles_before)
    return 0


def _backward_cpu(rt: runtime.Runtime, target: Target, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> None:
    """The backward's two kernels resolved cold and warm for ``target``; gradients from the interpreter."""
    from lazytriton.kernels.flash_bwd.reference import attention_backward_reference

    b, h, s, d = q.shape
    for kernel in bwd_dispatch.BWD_KERNELS:
        variant = dispatch.kernel_variant(kernel, target, "bf16", d, causal, True, s, s)
        cold, warm = rt.resolve(variant), rt.resolve(variant)
        print(f"backward {kernel}: cold {cold.seconds * 1e3:.2f} ms ({_source_label(cold.source)}), "
              f"warm {warm.seconds * 1e3:.3f} ms ({_source_label(warm.source)})")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    do = torch.randn_like(q)
    start = time.perf_counter()
    grads = torch.autograd.grad(attn_fwd(*leaves, causal=causal)[0], leaves, do)
    elapsed = time.perf_counter() - start
    ref = attention_backward_reference(q.double(), k.double(), v.double(), do.double(),
                                       causal="top_left" if causal else False)
    errors = ", ".join(f"{name} {_rel_err(g, r):.1e}" for name, g, r in zip(("dq", "dk", "dv"), grads, ref,
                                                                               strict=True))
    print(f"backward {(b, h, s, d)} bf16 causal on CPU (interpreter): {elapsed:.2f} s, relative errors vs float64 "
          f"reference: {errors}")


def run_gpu() -> int:
    rt = runtime.get()
    compiles_before = rt.counters().get("compiles", 0)
    device = torch.device("cuda", torch.cuda.current_device())
    b, h, s, d, causal = 4, 16, 2048, 128, True
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # CUDA and cuBLAS init, off the clock
    torch.cuda.synchronize()
    print(f"GPU: {torch.cuda.get_device_name(device)} ({machine.target_of_device(device)})")
    for label in ("cold", "warm"):
        before = dict(rt.served)
        start = time.perf_counter()
        out, _ = attn_fwd(q, k, v, causal=causal)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        sources = [name for name, n in rt.served.items() if n > before.get(name, 0)] or ["memory"]
        print(f"{label} call: {elapsed * 1e3:9.2f} ms  served by {_source_label(sources[0])}")
    for kernel in rt.loaded_kernels():
        entry = kernel.entry
        print(f"entry: {entry.kind} of {len(entry.binary)} bytes, {entry.num_warps} warps, {entry.shared} B shared "
              f"memory, built by Triton {entry.provenance.compiler_version}")
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    events[0].record()
    for _ in range(10):
        attn_fwd(q, k, v, causal=causal)
    events[1].record()
    torch.cuda.synchronize()
    ms = events[0].elapsed_time(events[1]) / 10
    flops = 4 * b * h * s * s * d / 2
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    print(f"attention {(b, h, s, d)} bf16 causal: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
          f"relative error vs float32 SDPA {_rel_err(out, ref.double()):.1e}")
    _backward_gpu(rt, q, k, v, causal)
    _summary(rt, compiles_before)
    return 0 if math.isfinite(ms) else 1


def _backward_gpu(rt: runtime.Runtime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """A backward through autograd, cold then warm, timed and checked against float32 SDPA's gradients."""
    b, h, s, d = q.shape
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    do = torch.randn_like(q)
    out = attn_fwd(*leaves, causal=causal)[0]
    for label in ("cold", "warm"):
        before = dict(rt.served)
        start = time.perf_counter()
        grads = torch.autograd.grad(out, leaves, do, retain_graph=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        sources = [name for name, n in rt.served.items() if n > before.get(name, 0)] or ["memory"]
        print(f"{label} backward: {elapsed * 1e3:9.2f} ms  served by {_source_label(sources[0])}")
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    events[0].record()
    for _ in range(5):
        torch.autograd.grad(out, leaves, do, retain_graph=True)
    events[1].record()
    torch.cuda.synchronize()
    ms = events[0].elapsed_time(events[1]) / 5
    flops = 2.5 * 4 * b * h * s * s * d / 2
    rq, rk, rv = ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = torch.nn.functional.scaled_dot_product_attention(rq, rk, rv, is_causal=causal)
    ref = torch.autograd.grad(ref_out, ref_leaves, do.float())
    errors = ", ".join(f"{name} {_rel_err(g, r.double()):.1e}" for name, g, r in zip(("dq", "dk", "dv"), grads, ref,
                                                                                        strict=True))
    print(f"backward {(b, h, s, d)} bf16 causal: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, relative errors vs "
          f"float32 SDPA: {errors}")
