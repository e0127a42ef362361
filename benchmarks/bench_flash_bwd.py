"""Benchmark lazytriton's attention backward beside its peers, measured in the same run.

Throughput (TFLOP/s, median of CUDA-event-timed runs after warmup; a case's
providers timed in turns, one call of each a round, so that their ratios
hold while the GPU's clock moves during the run) over
bf16/fp16 x head dim 64/128/256 x causal or not x seqlen 1k/4k/16k, with
batch x seqlen = 16k tokens and hidden = heads x head dim = 2048
(FlashAttention's benchmark shapes, the same grid as bench_flash_fwd.py).
Backward FLOPs are 2.5x the forward's 4*B*H*S*S*D (halved if causal),
FlashAttention's convention; forward + backward together are 3.5x.

Mode ``bwd`` times the backward alone:

- ``lazytriton``: ``flash_bwd.binding.backward`` (the two cache-served
  kernels, dQ then dK/dV); the forward (``flash_fwd.binding.forward``) runs
  once, outside the timed region, for ``out`` and ``lse``;
- ``triton_jit``: the same two kernel sources, with the variants dispatch
  picks (constexprs and options), launched through Triton's own JIT;
- ``sdpa_flash`` and ``sdpa_cudnn``: torch SDPA pinned to one backend; the
  forward runs once with requires_grad, then ``torch.autograd.grad(out,
  (q, k, v), do, retain_graph=True)`` is timed.

Mode ``fwd+bwd`` times forward and backward together (lazytriton, sdpa_flash,
sdpa_cudnn). Every provider's first result is checked before it is timed:
dq, dk and dv on batch 0, head 0 against a float64 reference, with
FlashAttention's rule (``grad_rule.py``: error at most 2x the error of the
same-dtype PyTorch math, plus the dtype's rounding at 0.3). A provider that fails to run is
reported as ``failed``; one that runs but fails the check is still timed and
marked ``*`` (left out of the geomeans). Inputs and dO are fresh random normal
tensors for each case.

Rows go to a long-format CSV (bench_flash_fwd.py's columns plus ``check``);
the table comes last; with ``$OUT`` set, the printed report is also written
to ``$OUT/bench_flash_bwd.log``.

Usage: python benchmarks/bench_flash_bwd.py [--csv PATH] [--quick] [--dtypes bf16,fp16]
       [--head-dims 64,128,256] [--seqlens 1k,4k,16k] [--causal both|causal|full]
       [--providers lazytriton,triton_jit,sdpa_flash,sdpa_cudnn] [--prewarm-jobs N] [--warmup N] [--reps N]
       python benchmarks/bench_flash_bwd.py --list        (the cases; no GPU needed)
       python benchmarks/bench_flash_bwd.py --cpu-smoke   (one tiny case on CPU: the interpreter, CI)
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from benchgrid import DTYPES, Case, add_grid_arguments, grid_of, parse_grid, prewarm
from csvlog import append_rows, run_meta
from grad_rule import Reference, check_grads, reference

from lazytriton import machine, runtime
from lazytriton.cli.timing import interleaved_ms, median_ms
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.target import target_from_cuda_capability

FIELDS = ["kernel", "provider", "mode", "dtype", "head_dim", "causal", "batch", "heads", "seqlen", "p50_ms",
          "tflops", "us_per_call", "rel_err", "check", "gpu", "torch", "triton", "lazytriton", "timestamp"]
BWD_PROVIDERS = ("lazytriton", "triton_jit", "sdpa_flash", "sdpa_cudnn")
FWD_BWD_PROVIDERS = ("lazytriton", "sdpa_flash", "sdpa_cudnn")
FLOPS_FACTOR = {"bwd": 2.5, "fwd+bwd": 3.5}


class Result(NamedTuple):
    """One provider on one case in one mode: ``check`` is ok, wrong (timed, check failed) or failed (did not run)."""

    case: Case
    provider: str
    mode: str
    ms: float | None
    rel_err: float | None
    check: str
    note: str = ""

    @property
    def tflops(self) -> float | None:
        return None if self.ms is None else self.case.fwd_flops * FLOPS_FACTOR[self.mode] / self.ms / 1e9


# ---------------------------------------------------------------------------
# Arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "flash_bwd.csv")
    add_grid_arguments(parser, BWD_PROVIDERS)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="one tiny case on CPU (Triton's interpreter): checks the script runs end to end")
    args = parse_grid(parser, argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    return args


# ---------------------------------------------------------------------------
# Timing and checking




# ---------------------------------------------------------------------------
# Providers: each factory does its setup (a forward, argument packing) and returns the timed call


Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Factory = Callable[[Tensors, bool], Callable[[], Sequence[torch.Tensor]]]


def lazytriton_bwd(t: Tensors, causal: bool) -> Callable[[], Sequence[torch.Tensor]]:
    q, k, v, do = t
    call = fwd.check(q, k, v, causal)
    out, lse = fwd.forward(q, k, v, call)
    return lambda: bwd.backward(q, k, v, out, lse, do, call)


def lazytriton_fwd_bwd(t: Tensors, causal: bool) -> Callable[[], Sequence[torch.Tensor]]:
    q, k, v, do = t
    call = fwd.check(q, k, v, causal)

    def run() -> Sequence[torch.Tensor]:
        out, lse = fwd.forward(q, k, v, call)
        return bwd.backward(q, k, v, out, lse, do, call)

    return run


def triton_jit_bwd(t: Tensors, causal: bool) -> Callable[[], Sequence[torch.Tensor]]:
    """Both kernels through Triton's JIT, with the variants dispatch picks (arguments from the binding).

    On the CPU (``--cpu-smoke``) the same arguments and constexprs (of the
    sm_90 variants) go through lazytriton's interpreter instead, so that CI
    checks them against the kernels' signatures.
    """
    q, k, v, do = t
    call = fwd.check(q, k, v, causal)
    out, lse = fwd.forward(q, k, v, call)
    grads = bwd.empty_grads(q, k, v)
    delta = torch.empty((call.shape.batch, call.shape.heads_q, call.shape.seqlen_q), dtype=torch.float32,
                        device=q.device)
    launches = jit_launches(q, k, v, out, lse, do, delta, grads, call, causal)

    def run() -> Sequence[torch.Tensor]:
        for launch in launches:
            launch()
        return grads

    return run


def jit_launches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 do: torch.Tensor, delta: torch.Tensor, grads: Any, call: Any,
                 causal: bool) -> list[Callable[[], None]]:
    """(dq launch, dK/dV launch): flash_bwd's two Triton kernels through Triton's JIT with dispatch's variants.

    The dQ kernel writes ``delta``, which the dK/dV kernel reads; on the CPU
    (no GPU target) the sm_90 variants' constexprs go through lazytriton's interpreter.
    """
    _, _, aligned, seq16, index64 = bwd.pack(q, k, v, out, do, lse, delta, *grads, call)
    target = machine.target_of_device(q.device) if q.device.type == "cuda" else target_from_cuda_capability(9, 0)
    chosen = bwd.variants(target, q.dtype, call.shape, causal, aligned, index64, seq16=seq16)
    grids = bwd.grids(call.shape, int(chosen[0].get("BLOCK_M")), int(chosen[1].get("BLOCK_N")))
    launches = []
    for spec, variant, grid in zip((FLASH_BWD_DQ, FLASH_BWD_DKDV), chosen, grids, strict=True):
        constexprs = {name: value for name, value in variant.constexprs.items() if name in spec.constexprs}
        args = bwd.triton_args(spec.name, q, k, v, out, lse, do, delta, grads, call)
        launches.append(_jit_launch(spec, grid, args, constexprs, dict(variant.options), q.device))
    return launches


def _jit_launch(spec: Any, grid: tuple[int, int, int], args: tuple[Any, ...], constexprs: dict[str, Any],
                options: dict[str, Any], device: torch.device) -> Callable[[], None]:
    if device.type != "cuda":
        from lazytriton import compiler

        return lambda: compiler.interpret(spec.name, grid, args, constexprs)
    from lazytriton.kernels.flash_bwd import triton_kernel

    kernel = getattr(triton_kernel, spec.function)[grid]
    return lambda: kernel(*args, **constexprs, **options)


def sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def _sdpa_setup(name: str, t: Tensors, causal: bool) -> tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, ...],
                                                                 torch.Tensor, torch.Tensor]:
    """(forward, leaf q/k/v, first out, dO laid out as that out is): some backends return a permuted out."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (x.detach().requires_grad_() for x in t[:3])
    backend = sdpa_backend(name)

    def forward() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = forward()
    return forward, (q, k, v), out, torch.empty_like(out).copy_(t[3])


def sdpa_bwd(name: str) -> Factory:
    def factory(t: Tensors, causal: bool) -> Callable[[], Sequence[torch.Tensor]]:
        _, leaves, out, do = _sdpa_setup(name, t, causal)
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)

    return factory


def sdpa_fwd_bwd(name: str) -> Factory:
    def factory(t: Tensors, causal: bool) -> Callable[[], Sequence[torch.Tensor]]:
        forward, leaves, _, do = _sdpa_setup(name, t, causal)
        return lambda: torch.autograd.grad(forward(), leaves, do)

    return factory


def providers(mode: str, selected: Sequence[str] = BWD_PROVIDERS) -> dict[str, Factory]:
    if mode == "bwd":
        every = {"lazytriton": lazytriton_bwd, "triton_jit": triton_jit_bwd,
                 **{name: sdpa_bwd(name) for name in BWD_PROVIDERS if name.startswith("sdpa")}}
    else:
        every = {"lazytriton": lazytriton_fwd_bwd, **{name: sdpa_fwd_bwd(name) for name in FWD_BWD_PROVIDERS
                                                      if name.startswith("sdpa")}}
    return {name: factory for name, factory in every.items() if name in selected}


# ---------------------------------------------------------------------------
# Running the grid


class Log:
    """Prints the report as it goes, and with ``$OUT`` set writes it, line by line, to ``$OUT/bench_flash_bwd.log``."""

    def __init__(self, out: str | None = None) -> None:
        self.lines: list[str] = []
        self.path = Path(out) / "bench_flash_bwd.log" if out else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def __call__(self, line: str = "", err: bool = False) -> None:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
        self.lines.append(line)
        if self.path is not None:  # kept as it goes: a run killed at its time limit leaves what it measured
            with self.path.open("a") as f:
                f.write(line + "\n")


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # a sticky CUDA error shows again in the next provider's result
            pass


def measure(case: Case, provider: str, mode: str, factory: Factory, tensors: Tensors, ref: Reference | None,
            device: torch.device, args: argparse.Namespace) -> Result:
    """Set up, check the first result, then time one provider; any exception makes a ``failed`` result."""
    fn = None
    try:
        fn = factory(tensors, case.causal)
        grads = fn()
        ok, err, note = check_grads(grads, ref) if ref is not None else (True, math.nan, "no reference")
        del grads
        ms = median_ms(fn, device.type == "cuda", args.warmup, args.reps)
        return Result(case, provider, mode, ms, err, "unchecked" if ref is None else "ok" if ok else "wrong", note)
    except Exception as exc:  # a backend missing on this GPU/torch, or a kernel that fails, is reported, not fatal
        return Result(case, provider, mode, None, None, "failed", _brief(exc))
    finally:
        del fn
        _release(device)


def measure_turns(case: Case, mode: str, factories: dict[str, Factory], tensors: Tensors, ref: Reference | None,
                  device: torch.device, args: argparse.Namespace) -> list[Result]:
    """Every provider set up and its first result checked, then all timed in turns (``interleaved_ms``).

    So a provider's ratio to another is measured over the same stretch of
    the run. A provider that raises while set up or checked gets a
    ``failed`` result; if the timing in turns raises, each is timed alone
    (``measure``), so one failing provider does not take the others' times.
    """
    ready: dict[str, tuple[Callable[[], Sequence[torch.Tensor]], float, str, str]] = {}
    failed: dict[str, Result] = {}
    for name, factory in factories.items():
        try:
            fn = factory(tensors, case.causal)
            grads = fn()
            ok, err, note = check_grads(grads, ref) if ref is not None else (True, math.nan, "no reference")
            del grads
            ready[name] = (fn, err, "unchecked" if ref is None else "ok" if ok else "wrong", note)
        except Exception as exc:  # reported, as measure does
            failed[name] = Result(case, name, mode, None, None, "failed", _brief(exc))
            _release(device)
    try:
        times = interleaved_ms([fn for fn, *_ in ready.values()], device.type == "cuda", args.warmup, args.reps)
    except Exception:  # one of them failed while timed: time each alone
        ready.clear()
        _release(device)
        return [failed.get(name) or measure(case, name, mode, factory, tensors, ref, device, args)
                for name, factory in factories.items()]
    timed = {name: Result(case, name, mode, ms, err, check, note)
             for (name, (_, err, check, note)), ms in zip(ready.items(), times, strict=True)}
    ready.clear()
    _release(device)
    return [timed.get(name) or failed[name] for name in factories]


def run_case(index: int, case: Case, device: torch.device, args: argparse.Namespace, log: Log) -> list[Result]:
    torch.manual_seed(1000 + index)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    tensors: Tensors = tuple(torch.randn(shape, device=device, dtype=DTYPES[case.dtype])  # type: ignore[assignment]
                             for _ in range(4))
    try:
        ref: Reference | None = reference(*tensors, case.causal)
    except Exception as exc:
        log(f"  {case.label}: reference failed, results unchecked: {_brief(exc)}", err=True)
        ref = None
    _release(device)
    results = []
    for mode in FLOPS_FACTOR:
        for r in measure_turns(case, mode, providers(mode, args.providers), tensors, ref, device, args):
            name = r.provider
            shown = f"{r.ms:.3f} ms {r.tflops:.0f} TFLOP/s rel_err {r.rel_err:.1e}" if r.ms is not None else ""
            log(f"{case.label}  {mode:<7} {name:<10} {r.check:<9} {shown} {r.note}".rstrip())
            results.append(r)
    return results


# ---------------------------------------------------------------------------
# Output


def csv_row(r: Result, meta: dict[str, str]) -> dict[str, object]:
    c = r.case
    return {**meta, "provider": r.provider, "mode": r.mode, "dtype": str(DTYPES.get(c.dtype, c.dtype)).split(".")[-1],
            "head_dim": c.head_dim, "causal": c.causal, "batch": c.batch, "heads": c.heads, "seqlen": c.seqlen,
            "p50_ms": "" if r.ms is None else round(r.ms, 4),
            "tflops": "" if r.tflops is None else round(r.tflops, 1), "us_per_call": "",
            "rel_err": "" if r.rel_err is None or math.isnan(r.rel_err) else f"{r.rel_err:.1e}", "check": r.check}


MARKS = {"ok": "", "wrong": "*", "unchecked": "?"}


def _cell(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.tflops is None:
        return "failed"
    return f"{r.tflops:.0f}{MARKS[r.check]}" if r.tflops >= 10 else f"{r.tflops:.2g}{MARKS[r.check]}"


def _ratio(x: float) -> str:
    return f"{x:>9.2f}" if not math.isnan(x) else f"{'-':>9}"


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else math.nan


def _ratio_of(lt: Result | None, other: Result | None) -> float:
    """lazytriton's TFLOP/s over a peer's, when both ran and passed the check."""
    if lt is None or other is None or not lt.check == other.check == "ok" or not lt.tflops or not other.tflops:
        return math.nan
    return lt.tflops / other.tflops


def print_table(results: Sequence[Result], log: Log) -> None:
    """Per case and mode: each provider's TFLOP/s, lazytriton's ratio to each peer; then geomean and min ratios."""
    by = {(r.case, r.mode, r.provider): r for r in results}
    case_list = list(dict.fromkeys(r.case for r in results))
    short = {"triton_jit": "jit", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn"}
    for mode, names in (("bwd", BWD_PROVIDERS), ("fwd+bwd", FWD_BWD_PROVIDERS)):
        peers = names[1:]
        log(f"\nTFLOP/s ({mode})".ljust(25) + "".join(f"{n:>11}" for n in names)
            + "".join(f"{'lt/' + short[p]:>9}" for p in peers))
        ratios: dict[str, list[float]] = {p: [] for p in peers}
        for case in case_list:
            row = [_ratio_of(by.get((case, mode, "lazytriton")), by.get((case, mode, p))) for p in peers]
            for p, ratio in zip(peers, row, strict=True):
                if not math.isnan(ratio):
                    ratios[p].append(ratio)
            log(f"{case.label:<24}" + "".join(f"{_cell(by.get((case, mode, n))):>11}" for n in names)
                + "".join(_ratio(x) for x in row))
        pad = " " * 11 * len(names)
        log("geomean".ljust(24) + pad + "".join(_ratio(_geomean(ratios[p])) for p in peers))
        log("min".ljust(24) + pad + "".join(_ratio(min(ratios[p], default=math.nan)) for p in peers))
        log("under 0.9 (issue 12)".ljust(24) + pad + "".join(f"{sum(x < 0.9 for x in ratios[p]):>9}" for p in peers))
    bad = [r for r in results if r.check != "ok"]
    if bad:
        log("\nnot ok (* failed the gradient check, timed anyway; ? unchecked; ratios use checked rows only):")
        groups: dict[tuple[str, str, str, str], list[Case]] = {}
        for r in bad:  # one line per provider, mode and reason (a backend missing fails every case alike)
            groups.setdefault((r.provider, r.mode, r.check, r.note), []).append(r.case)
        for (provider, mode, check, note), where in groups.items():
            cases_text = ", ".join(c.label for c in where) if len(where) <= 3 else f"{len(where)} cases"
            log(f"  {provider} {mode} {check} on {' '.join(cases_text.split())}: {note}")




SMOKE_CASE = Case("bf16", 32, True, 64, 1, 2)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid; exit status 1 if a lazytriton row failed or failed its check, 2 without a GPU."""
    args = parse_args(argv)
    log = Log(os.environ.get("OUT"))
    if args.cpu_smoke:
        device, case_list = torch.device("cpu"), [SMOKE_CASE]
        args.warmup, args.reps, args.prewarm_jobs = 1, 2, 0
    else:
        device, case_list = torch.device("cuda"), grid_of(args)
    if args.list:
        for case in case_list:
            print(f"{case.label}  batch {case.batch} heads {case.heads}")
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_flash_bwd needs a CUDA GPU (or --cpu-smoke, --list)", file=sys.stderr)
        return 2
    meta = run_meta("flash_bwd", device)
    log(f"bench_flash_bwd: {len(case_list)} cases on {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}")
    if args.prewarm_jobs > 0 and {"lazytriton", "triton_jit"} & set(args.providers):
        try:
            prewarm(case_list, device, args.prewarm_jobs, log, backward=True)
        except Exception as exc:
            log(f"prewarm failed, compiling just in time: {_brief(exc)}", err=True)
    results: list[Result] = []
    for index, case in enumerate(case_list):
        done = run_case(index, case, device, args, log)
        append_rows(args.csv, FIELDS, [csv_row(r, meta) for r in done])  # case by case, as the log
        results += done
    log(f"\n{len(results)} rows appended to {args.csv}; compiles by lazytriton in this run: {runtime.get().compiles}")
    print_table(results, log)
    return 1 if any(r.provider == "lazytriton" and r.check in ("failed", "wrong") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
