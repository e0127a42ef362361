"""Benchmark lazytriton's attn_fwd beside its peers, measured in the same run.

Throughput (TFLOP/s, median of event-timed runs; a case's providers timed in
turns, one call of each a round, so that their ratios hold while the GPU's
clock moves during the run) over bf16/fp16 x head dim
(``--head-dims``, default 64/128/256) x causal or not x seqlen 1k/4k/16k, with
batch x seqlen = 16k and hidden = heads x head dim = 2048 (FlashAttention's
benchmark shapes; heads rounded down for head dims that do not divide it), for:

- ``lazytriton``: ``lazytriton.flash.attn_fwd`` (cache-served cubin, cffi launch);
- ``triton_jit``: the same kernel source, same config, launched through
  Triton's own JIT (``kernel[grid](...)``);
- ``sdpa_flash`` and ``sdpa_cudnn``: torch SDPA pinned to one backend;
- ``lazytriton_sinks`` (with ``--sinks``): the same ``attn_fwd`` call with
  attention sinks (one float32 logit a query head, gpt-oss's), checked
  against SDPA's output rescaled by the sink's share of each row; the table
  then ends with its throughput over the same call's without sinks;
- ``lazytriton_chunk`` and ``lazytriton_window`` (with ``--attention-chunk C``):
  the same ``attn_fwd`` call with FlashAttention-3's ``attention_chunk=C``,
  and with the smallest sliding window that holds every query's chunk
  (``window_size=(C - 1, 0)`` causal, ``(C - 1, C - 1)`` full), both checked
  against SDPA with the boolean mask of their rule; the table then ends with
  the chunked call's time over the windowed one's. Their TFLOP/s count the
  dense call's FLOPs (a time ratio, not a throughput).

With ``--fp8`` the run is the FP8 forward's instead: at head dims
``--head-dims`` (64/128/256), causal or not, 16k tokens (batch 1, hidden
2048), ``lazytriton_fp8`` (``attn_fwd`` on float8_e4m3fn q, k, v with per
(batch, kv head) descales, bf16 out: the descale and V-transpose work
included; the bench has dispatch serve the Gluon FP8 forward,
``flash_fwd_fp8_gluon``, at every head dim where its rule holds, every row of
this grid on sm_90, where the library serves it only at the head dims where it
measured faster, ``fp8_gluon.DEFAULT_HEAD_DIMS``),
``lazytriton_fp8_e5m2`` (the same on
float8_e5m2 q, k, v), ``lazytriton_fp8_triton`` (the same e4m3 call through the
Triton FP8 kernel, ``flash_fwd_fp8``, by ``fp8.run_variant``: what dispatch
served before the Gluon one), ``lazytriton_fp8_gluon_keys`` (the same call
through the Gluon kernel's variant that reads V's keys in order, the C API's,
whose probabilities cross lanes before the P V product: ``lazytriton_fp8``'s
reads V's copy in the product's operand order), beside ``lazytriton`` (the bf16 forward, same run,
same shape) and
``sdpa_cudnn_fp8`` (torch's SDPA pinned to cuDNN on the FP8 tensors, where
torch takes them: a refusal is printed and its row is NaN). Outputs are checked
against SDPA's bf16 flash output on the dequantised inputs (relative error
under 0.08: e4m3 probabilities). The table ends with each row's FP8 / bf16
ratio.

Then (unless ``--no-host``) the host cost of one call on a tiny shape (µs per
call, wall clock over many calls, GPU work negligible). Every provider's
output is checked against SDPA before it is timed. Rows go to a long-format
CSV, case by case. Before the grid, lazytriton's variants of every case are
compiled in parallel into an image the run is served from
(``--prewarm-jobs``, as bench_flash_bwd.py). The grid and its filters are
``benchgrid.py``'s.

The table ends with the figures against cuDNN: the geomean by head dim
and over the grid, and the lowest row.

Usage: python benchmarks/bench_flash_fwd.py [--csv PATH] [--quick] [--dtypes bf16,fp16] [--head-dims 64,128,256]
       [--seqlens 1k,4k,16k] [--causal both|causal|full] [--providers lazytriton,triton_jit,sdpa_flash,sdpa_cudnn]
       [--prewarm-jobs N] [--no-host] [--sweep] [--sinks] [--attention-chunk C] [--fp8] [--mla]

With ``--mla`` the run is the MLA forward's instead (qv and v of 512: ``bench_flash_fwd_mla.py`` says what).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from benchgrid import DTYPES, add_grid_arguments, grid_of, parse_grid, prewarm
from csvlog import append_rows, run_meta

from lazytriton import machine, runtime
from lazytriton.cli.timing import event_ms, interleaved_ms
from lazytriton.flash import attn_fwd
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding
from lazytriton.tiles import Config

FIELDS = ["kernel", "provider", "mode", "dtype", "head_dim", "causal", "batch", "heads", "seqlen", "p50_ms",
          "tflops", "us_per_call", "rel_err", "gpu", "torch", "triton", "lazytriton", "timestamp"]


def time_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median of event-timed runs, in ms."""
    return event_ms(fn, warmup, reps)


def _turns(fns: dict[str, Callable[[], object]]) -> tuple[list[str], list[float]]:
    """(names, ms): the providers of a case timed in turns (``interleaved_ms``, one call of each a round).

    A ratio between two of them then holds while the GPU's clock moves during
    the run. If a provider fails while timed, each is timed alone, a failing
    one at NaN.
    """
    names = list(fns)
    try:
        return names, interleaved_ms([fns[n] for n in names], True, warmup=5, reps=30)
    except Exception:
        times = []
        for name in names:
            try:
                times.append(time_ms(fns[name]))
            except Exception as exc:
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                times.append(math.nan)
        return names, times


def host_us(fn: Callable[[], object], calls: int = 2000, rounds: int = 3) -> float:
    """Wall-clock µs per call over many calls, the best of ``rounds`` (tiny shapes: the host cost dominates)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def sdpa(backend: object) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def triton_jit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               config: Config | None = None) -> Callable[[], torch.Tensor]:
    """The same kernel source and config, launched through Triton's JIT (arguments from the binding)."""
    from lazytriton.kernels.flash_fwd.triton_kernel import flash_fwd_kernel

    call = binding.check(q, k, v, causal)
    out, lse = binding.empty_outputs(q, call.shape)
    args = binding.triton_args(q, k, v, out, lse, call)
    _, aligned, index64 = binding.pack(q, k, v, out, lse, call)
    variant = binding.variant(machine.target_of_device(q.device), q.dtype, call.shape, causal, aligned, index64)
    constexprs = {name: value for name, value in variant.constexprs.items() if name in FLASH_FWD.constexprs}
    cfg = config or Config(int(variant.get("BLOCK_M")), int(variant.get("BLOCK_N")),
                           int(variant.get("num_warps")), int(variant.get("num_stages")))
    constexprs.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    grid = binding.grid(call.shape, cfg.block_m)

    def run() -> torch.Tensor:
        flash_fwd_kernel[grid](*args, **constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out

    return run


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


FWD_PROVIDERS = ("lazytriton", "triton_jit", "sdpa_flash", "sdpa_cudnn")


SINKS_PROVIDER = "lazytriton_sinks"  # --sinks: attn_fwd with attention sinks
# --attention-chunk C: attn_fwd with attention_chunk=C, and with the window that holds every query's chunk.
CHUNK_PROVIDER, WINDOW_PROVIDER = "lazytriton_chunk", "lazytriton_window"


def chunk_window(chunk: int, causal: bool) -> tuple[int, int]:
    """The smallest sliding window holding every query's chunk of ``chunk`` keys: (C - 1, 0) causal, else both sides."""
    return (chunk - 1, 0 if causal else chunk - 1)


def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, chunk: int,
                     window: tuple[int, int]) -> torch.Tensor:
    """SDPA (its efficient backend) with the boolean mask of a chunked or windowed call (seqlen_q == seqlen_k)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lazytriton.kernels.flash_fwd.reference import visible

    keep = visible(q.shape[2], k.shape[2], "bottom_right" if causal else False, window, q.device, chunk)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def providers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              selected: Sequence[str] = FWD_PROVIDERS,
              sinks: torch.Tensor | None = None, chunk: int = 0) -> dict[str, Callable[[], object]]:
    """The selected providers' calls on one case (Triton's JIT call built only if selected); with ``sinks``, theirs.

    With ``chunk`` (> 0), the chunked call's and the windowed call's (``chunk_window``) too.
    """
    from torch.nn.attention import SDPBackend

    every: dict[str, Callable[[], Callable[[], object]]] = {
        "lazytriton": lambda: lambda: attn_fwd(q, k, v, causal=causal)[0],
        SINKS_PROVIDER: lambda: lambda: attn_fwd(q, k, v, causal=causal, sinks=sinks)[0],
        CHUNK_PROVIDER: lambda: lambda: attn_fwd(q, k, v, causal=causal, attention_chunk=chunk)[0],
        WINDOW_PROVIDER: lambda: lambda: attn_fwd(q, k, v, causal=causal,
                                                  window_size=chunk_window(chunk, causal))[0],
        "triton_jit": lambda: triton_jit(q, k, v, causal),
        "sdpa_flash": lambda: lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal),
        "sdpa_cudnn": lambda: lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, causal),
    }
    chosen = (*selected, *((SINKS_PROVIDER,) if sinks is not None else ()),
              *((CHUNK_PROVIDER, WINDOW_PROVIDER) if chunk > 0 else ()))
    return {name: make() for name, make in every.items() if name in chosen}


def sunk_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, ref: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """SDPA's output with the sinks: each row scaled by Z / (Z + exp(sink)), Z from lazytriton's plain lse."""
    lse = attn_fwd(q, k, v, causal=causal)[1]
    share = torch.exp(lse - torch.logaddexp(lse, sinks[None, :, None]))
    return (ref.float() * share[..., None]).to(ref.dtype)


def throughput(args: argparse.Namespace, meta: dict[str, str], rows: list[dict[str, object]]) -> None:
    """Every case of the grid: outputs checked against SDPA's flash backend, then the providers timed in turns.

    A case's rows are appended to the CSV and printed as soon as it is timed,
    so a run cut short keeps what it measured.
    """
    from torch.nn.attention import SDPBackend

    for index, case in enumerate(grid_of(args)):
        torch.manual_seed(index)
        dtype, shape = DTYPES[case.dtype], (case.batch, case.heads, case.seqlen, case.head_dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
        ref = sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, case.causal)
        sinks = torch.randn(case.heads, device="cuda") if args.sinks else None
        made = providers(q, k, v, case.causal, args.providers, sinks, args.attention_chunk)
        errs = {}
        for name, fn in made.items():
            try:
                if name == SINKS_PROVIDER:
                    want = sunk_reference(q, k, v, case.causal, ref, sinks)
                elif name == CHUNK_PROVIDER:
                    want = masked_reference(q, k, v, case.causal, args.attention_chunk, (-1, -1))
                elif name == WINDOW_PROVIDER:
                    want = masked_reference(q, k, v, case.causal, 0, chunk_window(args.attention_chunk, case.causal))
                else:
                    want = ref
                errs[name] = rel_err(fn(), want)  # type: ignore[arg-type]
            except Exception as exc:  # a backend missing on this GPU/torch is reported, not fatal
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                errs[name] = math.nan
        timed = dict(zip(*_turns({name: made[name] for name, err in errs.items() if err < 2e-2}), strict=True))
        done = []
        for name in made:
            ms = timed.get(name, math.nan)
            done.append({**meta, "provider": name, "mode": "fwd", "dtype": str(dtype).split(".")[-1],
                         "head_dim": case.head_dim, "causal": case.causal, "batch": case.batch, "heads": case.heads,
                         "seqlen": case.seqlen, "p50_ms": round(ms, 4), "tflops": round(case.fwd_flops / ms / 1e9, 1),
                         "us_per_call": "", "rel_err": f"{errs[name]:.1e}"})
        print(f"{case.label}  " + "  ".join(f"{r['provider']} {r['tflops']}" for r in done), flush=True)
        append_rows(args.csv, FIELDS, timed_rows(done))
        rows += done
        del q, k, v, ref, made
        torch.cuda.empty_cache()


def host_cost(meta: dict[str, str], rows: list[dict[str, object]]) -> None:
    from torch.nn.attention import SDPBackend

    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    providers = {
        "lazytriton": lambda: attn_fwd(q, k, v),
        "triton_jit": triton_jit(q, k, v, False),
        "sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, False),
        "sdpa_default": lambda: F.scaled_dot_product_attention(q, k, v),
        "torch_add": lambda: torch.add(q, q),
    }
    # The providers' rounds interleaved, each provider's best round kept: timed one after the other, a slow spell of
    # the host falls on some of them only (H200 host, 12-02: torch.add 6.29 µs in one run, 8.9-10.3 in two others)
    best = {name: math.inf for name in providers}
    for _ in range(5):
        for name, fn in providers.items():
            best[name] = min(best[name], host_us(fn, rounds=1))
    for name, us in best.items():
        rows.append({**meta, "provider": name, "mode": "host", "dtype": "bfloat16", "head_dim": 64, "causal": False,
                     "batch": 1, "heads": 2, "seqlen": 16, "p50_ms": "", "tflops": "", "us_per_call": round(us, 2),
                     "rel_err": ""})


def sweep(meta: dict[str, str]) -> None:
    """Time candidate configs of the kernel through Triton's JIT (to choose default_config)."""
    candidates = [Config(*c) for c in [
        (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 2),
        (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (64, 128, 4, 3)]]
    print("\nconfig sweep (bf16, TFLOP/s through Triton's JIT; BLOCK_M/BLOCK_N/warps/stages)")
    for d in (64, 128):
        for causal in (False, True):
            s = 4096
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            results = []
            for cfg in candidates:
                try:
                    ms = time_ms(triton_jit(q, k, v, causal, cfg), warmup=3, reps=15)
                    results.append((flops / ms / 1e9, cfg))
                except Exception as exc:
                    print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)
            results.sort(key=lambda r: -r[0])
            best = ", ".join(f"{c.block_m}/{c.block_n}/{c.num_warps}/{c.num_stages}: {t:.0f}" for t, c in results[:4])
            print(f"hd{d} causal={causal} s={s}: {best}")


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def print_table(rows: list[dict[str, object]]) -> None:
    fwd = [r for r in rows if r["mode"] == "fwd"]
    keys = sorted({(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) for r in fwd},
                  key=lambda x: (str(x[0]), int(x[1]), bool(x[2]), int(x[3])))
    by = {(r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["provider"]): r["tflops"] for r in fwd}
    short = {str(t).removeprefix("torch."): name for name, t in DTYPES.items()}  # the rows' dtype -> bf16, fp16
    print("\nTFLOP/s (fwd)             lazytriton triton_jit sdpa_flash sdpa_cudnn  lt/jit lt/flash lt/cudnn")
    for key in keys:
        vals = [float(by.get((*key, p), math.nan) or math.nan) for p in
                ("lazytriton", "triton_jit", "sdpa_flash", "sdpa_cudnn")]
        ratios = [vals[0] / x if x else math.nan for x in vals[1:]]
        label = f"{short.get(str(key[0]), key[0])} hd{key[1]} {'causal' if key[2] else 'full  '} {key[3] // 1024:>2}k"
        print(f"{label:<26}" + "".join(f"{x:>11.0f}" for x in vals) + "".join(f"{x:>8.2f}" for x in ratios))
    vs_cudnn: dict[int, list[float]] = {}
    for key in keys:
        lt, cudnn = (float(by.get((*key, p), math.nan) or math.nan) for p in ("lazytriton", "sdpa_cudnn"))
        if lt > 0 and cudnn > 0:
            vs_cudnn.setdefault(int(key[1]), []).append(lt / cudnn)
    every = [r for ratios in vs_cudnn.values() for r in ratios]
    if every:
        print("\nvs cuDNN (target: geomean >= 1.0, no row below 0.9): " + "; ".join(
            f"hd{d} {geomean(r):.3f} ({min(r):.2f}-{max(r):.2f})" for d, r in sorted(vs_cudnn.items()))
            + f"; all {geomean(every):.3f}, lowest {min(every):.2f}, {sum(r < 0.9 for r in every)} of {len(every)} "
            "under 0.9")
    sunk = {key: float(by.get((*key, SINKS_PROVIDER), math.nan) or math.nan) / float(
        by.get((*key, "lazytriton"), math.nan) or math.nan) for key in keys if (*key, SINKS_PROVIDER) in by}
    if sunk:
        print("\nwith sinks / without (TFLOP/s of the same attn_fwd call): " + "; ".join(
            f"{short.get(str(k[0]), k[0])} hd{k[1]} {'causal' if k[2] else 'full'} {k[3] // 1024}k {r:.3f}"
            for k, r in sunk.items())
            + f"; lowest {min(sunk.values()):.3f}, geomean {geomean(list(sunk.values())):.3f}")
    ms = {(r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["provider"]): float(r["p50_ms"]) for r in fwd}
    chunked = {key: ms[(*key, CHUNK_PROVIDER)] / ms[(*key, WINDOW_PROVIDER)] for key in keys
               if (*key, CHUNK_PROVIDER) in ms and (*key, WINDOW_PROVIDER) in ms}
    if chunked:
        print("\nchunked / windowed (p50 time of the same attn_fwd call, attention_chunk vs the window holding "
              "each chunk): " + "; ".join(
                  f"{short.get(str(k[0]), k[0])} hd{k[1]} {'causal' if k[2] else 'full'} {k[3] // 1024}k {r:.3f}"
                  for k, r in chunked.items())
              + f"; highest {max(chunked.values()):.3f}, geomean {geomean(list(chunked.values())):.3f}")
    host = [r for r in rows if r["mode"] == "host"]
    print("\nhost µs per call (1x2x16x64 bf16): " + ", ".join(f"{r['provider']} {r['us_per_call']}" for r in host))


FP8_PROVIDERS = ("lazytriton_fp8", "lazytriton_fp8_e5m2", "lazytriton_fp8_triton", "lazytriton_fp8_gluon_keys",
                 "lazytriton", "sdpa_cudnn_fp8")
FP8_TOKENS = 16384
FP8_MAX_ERR = 8e-2  # e4m3 probabilities and inputs against bf16 math on the dequantised values


def fp8_case(head_dim: int, causal: bool, meta: dict[str, str]) -> list[dict[str, object]]:
    """One FP8 row set: the FP8 forward, our bf16 forward and cuDNN's FP8 SDPA, checked and timed in turns."""
    from torch.nn.attention import SDPBackend

    heads = 2048 // head_dim
    shape = (1, heads, FP8_TOKENS, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    scales = tuple(torch.full((1, heads), 1.0, device="cuda") for _ in range(3))
    qd, kd, vd = (t.to(torch.bfloat16) for t in (q8, k8, v8))
    ref = sdpa(SDPBackend.FLASH_ATTENTION)(qd, kd, vd, causal)
    q5, k5, v5 = (t.to(torch.float8_e5m2) for t in (q, k, v))  # its reference: the same math on its own values
    ref5 = sdpa(SDPBackend.FLASH_ATTENTION)(*(t.to(torch.bfloat16) for t in (q5, k5, v5)), causal)
    from lazytriton.kernels import dispatch as kernel_dispatch
    from lazytriton.kernels.flash_fwd import fp8 as fp8_forward
    from lazytriton.kernels.flash_fwd import fp8_gluon

    call = binding.check(q8, k8, v8, causal, None, fp8=True)
    triton_fp8 = kernel_dispatch.kernel_variant("flash_fwd", machine.target_of_device(q.device), "e4m3", head_dim,
                                                causal, True, FP8_TOKENS, FP8_TOKENS)  # flash_fwd_fp8's
    gluon_keys = fp8_gluon.default_variant(str(machine.target_of_device(q.device)), "e4m3", head_dim, causal, True,
                                           False, FP8_TOKENS, FP8_TOKENS, operand_order=False)
    made: dict[str, Callable[[], object]] = {
        "lazytriton_fp8": lambda: attn_fwd(q8, k8, v8, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                           v_descale=scales[2])[0],
        "lazytriton_fp8_triton": lambda: fp8_forward.run_variant(q8, k8, v8, call, scales, triton_fp8)[0],
        # where the target has no Gluon FP8 kernel: run_variant's ValueError, a NaN row
        "lazytriton_fp8_gluon_keys": lambda: fp8_forward.run_variant(q8, k8, v8, call, scales, gluon_keys)[0],
        "lazytriton_fp8_e5m2": lambda: attn_fwd(q5, k5, v5, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                                v_descale=scales[2])[0],
        "lazytriton": lambda: attn_fwd(qd, kd, vd, causal=causal)[0],
        "sdpa_cudnn_fp8": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q8, k8, v8, causal),
    }
    errs = {}
    for name, fn in made.items():
        try:
            errs[name] = rel_err(fn(), ref5 if name == "lazytriton_fp8_e5m2" else ref)  # type: ignore[arg-type]
        except Exception as exc:  # torch's SDPA may refuse float8 on cuDNN: said, not fatal
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
            errs[name] = math.nan
    timed = dict(zip(*_turns({name: made[name] for name, err in errs.items() if err < FP8_MAX_ERR}), strict=True))
    flops = 4 * FP8_TOKENS * FP8_TOKENS * head_dim * heads / (2 if causal else 1)
    rows = []
    for name in made:
        ms = timed.get(name, math.nan)
        dtype = {"lazytriton": "bf16", "lazytriton_fp8_e5m2": "e5m2"}.get(name, "e4m3")  # _triton: e4m3
        rows.append({**meta, "provider": name, "mode": "fwd", "dtype": dtype,
                     "head_dim": head_dim, "causal": causal, "batch": 1, "heads": heads, "seqlen": FP8_TOKENS,
                     "p50_ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "us_per_call": "",
                     "rel_err": f"{errs[name]:.1e}"})
    return rows


def timed_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The rows of providers that ran (a refused or failed one has no time): what goes to the CSV."""
    return [r for r in rows if math.isfinite(float(r["tflops"]))]  # type: ignore[arg-type]


def fp8(args: argparse.Namespace, meta: dict[str, str]) -> list[dict[str, object]]:
    """The FP8 grid (``--fp8``): rows appended to the CSV case by case, then the FP8 / bf16 table."""
    from lazytriton.kernels.flash_fwd import fp8_gluon

    # lazytriton_fp8 measures the Gluon FP8 forward at every head dim (the library: DEFAULT_HEAD_DIMS only)
    fp8_gluon.BY_DEFAULT = True
    fp8_gluon.DEFAULT_HEAD_DIMS = frozenset(fp8_gluon.HEAD_DIMS)
    fp8_gluon.KEY_ORDER_HEAD_DIMS = frozenset(fp8_gluon.HEAD_DIMS)  # lazytriton_fp8_gluon_keys at every head dim
    rows: list[dict[str, object]] = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            torch.manual_seed(head_dim)
            done = fp8_case(head_dim, causal, meta)
            append_rows(args.csv, FIELDS, timed_rows(done))
            rows += done
            tf: dict[str, float] = {str(r["provider"]): float(r["tflops"]) for r in done}  # type: ignore[arg-type]
            print(f"hd{head_dim} {'causal' if causal else 'full  '} 16k: "
                  + "  ".join(f"{n} {t}" for n, t in tf.items())
                  + f"  fp8/bf16 {tf['lazytriton_fp8'] / tf['lazytriton']:.2f}"
                  + f"  fp8/fp8_triton {tf['lazytriton_fp8'] / tf['lazytriton_fp8_triton']:.2f}"
                  + f"  fp8/gluon_keys {tf['lazytriton_fp8'] / tf['lazytriton_fp8_gluon_keys']:.2f}"
                  + f"  e5m2/e4m3 {tf['lazytriton_fp8_e5m2'] / tf['lazytriton_fp8']:.2f}"
                  + f"  fp8/cudnn_fp8 {tf['lazytriton_fp8'] / tf['sdpa_cudnn_fp8']:.2f}", flush=True)
            torch.cuda.empty_cache()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "flash_fwd.csv")
    add_grid_arguments(parser, FWD_PROVIDERS)
    parser.add_argument("--no-host", action="store_true", help="skip the host cost of a call on a tiny shape")
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs through Triton's JIT")
    parser.add_argument("--sinks", action="store_true",
                        help="also time attn_fwd with attention sinks (provider lazytriton_sinks) beside lazytriton's "
                             "same call without them")
    parser.add_argument("--attention-chunk", type=int, default=0, metavar="C",
                        help="also time attn_fwd with attention_chunk=C (provider lazytriton_chunk) beside the same "
                             "call with the sliding window that holds each chunk (lazytriton_window)")
    parser.add_argument("--fp8", action="store_true",
                        help="time the FP8 forward instead (e4m3 and e5m2, 16k tokens, head dims --head-dims) beside "
                             "the bf16 forward and cuDNN's FP8 SDPA")
    parser.add_argument("--mla", action="store_true",
                        help="time the MLA forward instead (qv and v of 512, bench_flash_fwd_mla.py) beside "
                             "FlashAttention-3 where installed and SDPA on the joined head dim 576")
    args = parse_grid(parser, argv)
    if args.attention_chunk < 0:
        parser.error(f"--attention-chunk must be >= 0 (0: off), got {args.attention_chunk}")
    if not torch.cuda.is_available():
        print("bench_flash_fwd needs a CUDA GPU", file=sys.stderr)
        return 2
    meta = run_meta("flash_fwd", torch.device("cuda"))
    if args.fp8:
        fp8(args, meta)
        return 0
    if args.mla:
        from bench_flash_fwd_mla import mla

        mla(args, meta, FIELDS, _turns)
        return 0
    if args.prewarm_jobs > 0 and "lazytriton" in args.providers:
        try:
            prewarm(grid_of(args), torch.device("cuda"), args.prewarm_jobs, print, backward=False)
        except Exception as exc:
            print(f"prewarm failed, compiling just in time: {type(exc).__name__}: {exc}", file=sys.stderr)
    rows: list[dict[str, object]] = []
    throughput(args, meta, rows)
    if not args.no_host:
        host: list[dict[str, object]] = []
        host_cost(meta, host)
        append_rows(args.csv, FIELDS, host)
        rows += host
    if args.sweep:
        sweep(meta)
    print(f"compiles by lazytriton in this run: {runtime.get().compiles}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
