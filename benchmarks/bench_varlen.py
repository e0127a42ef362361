"""Benchmark lazytriton's varlen attention (packed sequences) beside a padded batch, measured in the same run.

One mixed-length batch of self-attention sequences (lengths drawn uniformly
from 128..4096 with a fixed seed: 16 sequences, ~34k tokens), bf16, head dim
64 and 128 with hidden = heads x head dim = 2048, causal or not; mode ``fwd``
times the forward, ``fwd+bwd`` forward and backward together. TFLOP/s count
the real tokens only: 4 * heads * head_dim * sum(len_i^2) for the forward
(halved if causal), 3.5x that for forward + backward (FlashAttention's
convention), whatever work a provider does on padding.

Providers (median of CUDA-event-timed runs, ``lazytriton.cli.timing.event_ms``):

- ``lt_varlen``: ``flash_attn_varlen_func``'s binding (``kernels/flash_fwd/
  varlen.py``: the call checked once outside the timed region, as a training
  step reuses its cu_seqlens; the public function adds one device-to-host read
  of cu_seqlens per call, timed separately as ``lt_varlen_api``);
- ``lt_dense``: lazytriton's dense kernels on the batch right-padded to the
  longest sequence. They take no mask, so for ``full`` the padded keys are
  attended (the work a padded batch costs, not the right answer: marked ``?``);
  with ``causal`` right padding needs no mask (a real query sees only earlier,
  real keys), and the answer is checked;
- ``sdpa_flash``, ``sdpa_cudnn``: torch SDPA pinned to one backend on the same
  padded batch; with ``causal`` no mask is needed (checked); ``full`` needs a
  key padding mask, which flash does not take (run unmasked: ``?``) and
  cuDNN is given (a boolean (B, 1, 1, S) mask; ``failed`` if it refuses it);
- ``sdpa_njt``: SDPA on nested jagged tensors (torch's own varlen; no padding),
  where torch supports it, else ``failed`` (torch 2.13 refuses ``is_causal``
  with nested tensors).

Every provider's first result is checked before it is timed, on head 0 of the
shortest and the longest sequence against a float64 reference, with
FlashAttention's rule (error at most 2x the same-dtype PyTorch math's, plus
the dtype's rounding at 0.3): out in ``fwd``, dq/dk/dv in ``fwd+bwd``.
Variants are compiled first in parallel into an image (``--prewarm-jobs``).
Rows go to benchmarks/results/varlen.csv (long format); the table (TFLOP/s and
lt_varlen's speedup over each peer, ``peer ms / lt_varlen ms``) comes last.

Usage: python benchmarks/bench_varlen.py [--csv PATH] [--quick] [--head-dims 64,128] [--causal both|causal|full]
       [--sequences 16] [--warmup N] [--reps N] [--prewarm-jobs N]
       python benchmarks/bench_varlen.py --cpu-smoke   (a tiny batch on CPU through the interpreter: CI)
"""

from __future__ import annotations

import argparse
import atexit
import logging
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from csvlog import append_rows, run_meta

import lazytriton
from lazytriton import geometry, machine
from lazytriton.cli.timing import median_ms
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.kernels.flash_fwd import varlen
from lazytriton.kernels.flash_fwd.reference import attention_reference

FIELDS = ["kernel", "provider", "mode", "dtype", "head_dim", "causal", "batch", "heads", "max_seqlen", "tokens",
          "p50_ms", "tflops", "rel_err", "check", "gpu", "torch", "triton", "lazytriton", "timestamp"]
PROVIDERS = ("lt_varlen", "lt_varlen_api", "lt_dense", "sdpa_flash", "sdpa_cudnn", "sdpa_njt")
MODES = {"fwd": 1.0, "fwd+bwd": 3.5}
HIDDEN, DTYPE = 2048, torch.bfloat16
FLOOR = 2 * 2.0**-8  # bf16's rounding at 0.3, twice (grad_rule.py's floor)


class Case(NamedTuple):
    head_dim: int
    causal: bool
    lengths: tuple[int, ...]
    heads: int

    @property
    def fwd_flops(self) -> float:
        return 4 * self.heads * self.head_dim * sum(n * n for n in self.lengths) / (2 if self.causal else 1)

    @property
    def label(self) -> str:
        tokens = sum(self.lengths)
        size = f"{tokens / 1024:.0f}k" if tokens >= 1024 else str(tokens)
        return f"bf16 hd{self.head_dim:<3} {'causal' if self.causal else 'full  '} {size:>3}"


class Result(NamedTuple):
    case: Case
    provider: str
    mode: str
    ms: float | None
    rel_err: float | None
    check: str  # ok, wrong (timed anyway), unchecked (not the same answer by design), failed (did not run)
    note: str = ""

    @property
    def tflops(self) -> float | None:
        return None if self.ms is None else self.case.fwd_flops * MODES[self.mode] / self.ms / 1e9


def lengths_of(sequences: int, low: int = 128, high: int = 4096, seed: int = 0) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(int(n) for n in torch.randint(low, high + 1, (sequences,), generator=gen))


def cases(head_dims: Sequence[int], causals: Sequence[bool], lengths: tuple[int, ...]) -> list[Case]:
    return [Case(d, causal, lengths, max(1, HIDDEN // d)) for d in head_dims for causal in causals]


# ---------------------------------------------------------------------------
# Inputs: one packed batch and its right-padded twin


class Batch(NamedTuple):
    q: torch.Tensor  # packed (total, heads, head_dim)
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    cu: torch.Tensor  # int32 (batch + 1)
    max_len: int
    pad_index: torch.Tensor  # the padded batch's (batch * max_len) row of each packed row
    key_mask: torch.Tensor  # (batch, 1, 1, max_len): True for real keys


def make_batch(case: Case, device: torch.device, seed: int) -> Batch:
    gen = torch.Generator(device=device).manual_seed(seed)
    total, max_len = sum(case.lengths), max(case.lengths)

    def randn() -> torch.Tensor:
        return torch.randn((total, case.heads, case.head_dim), generator=gen, device=device).to(DTYPE)

    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    rows = torch.cat([torch.arange(n) + i * max_len for i, n in enumerate(case.lengths)]).to(device)
    mask = torch.arange(max_len)[None, :] < torch.tensor(case.lengths)[:, None]
    return Batch(randn(), randn(), randn(), randn(), cu, max_len, rows, mask[:, None, None, :].to(device))


def pad(b: Batch, t: torch.Tensor) -> torch.Tensor:
    """A packed (total, heads, d) tensor right-padded to (batch, heads, max_len, d) with zeros (SDPA's layout)."""
    padded = t.new_zeros((b.cu.numel() - 1) * b.max_len, *t.shape[1:])
    padded[b.pad_index] = t
    return padded.view(b.cu.numel() - 1, b.max_len, *t.shape[1:]).transpose(1, 2)


def unpad(b: Batch, t: torch.Tensor) -> torch.Tensor:
    """The packed rows of a (batch, heads, max_len, d) tensor."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3])[b.pad_index]


# ---------------------------------------------------------------------------
# Providers: each factory does its setup and returns the timed call, whose result is packed (out, or grads)

Factory = Callable[[Batch, Case], Callable[[], Sequence[torch.Tensor]]]


def lt_varlen(api: bool) -> Callable[[Batch, Case, bool], Callable[[], Sequence[torch.Tensor]]]:
    def factory(b: Batch, case: Case, backward: bool) -> Callable[[], Sequence[torch.Tensor]]:
        call = varlen.check(b.q, b.k, b.v, b.cu, b.cu, b.max_len, b.max_len, case.causal)

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            if api:
                out, lse, _ = lazytriton.flash_attn_varlen_func(b.q, b.k, b.v, b.cu, b.cu, b.max_len, b.max_len,
                                                                causal=case.causal, return_attn_probs=True)
                return out, lse
            return varlen.forward(b.q, b.k, b.v, b.cu, b.cu, call)

        if not backward:
            return lambda: forward()[:1]

        def run() -> Sequence[torch.Tensor]:
            out, lse = forward()
            return varlen.backward(b.q, b.k, b.v, out, lse, b.do, b.cu, b.cu, call)

        return run
    return factory


def lt_dense(b: Batch, case: Case, backward: bool) -> Callable[[], Sequence[torch.Tensor]]:
    q, k, v, do = (pad(b, t) for t in (b.q, b.k, b.v, b.do))
    call = fwd.check(q, k, v, case.causal)

    def run() -> Sequence[torch.Tensor]:
        out, lse = fwd.forward(q, k, v, call)
        if not backward:
            return (unpad(b, out),)
        return tuple(unpad(b, g) for g in bwd.backward(q, k, v, out, lse, do, call))

    return run


def sdpa(name: str) -> Callable[[Batch, Case, bool], Callable[[], Sequence[torch.Tensor]]]:
    def factory(b: Batch, case: Case, backward: bool) -> Callable[[], Sequence[torch.Tensor]]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]
        leaves = [pad(b, t).detach().requires_grad_(backward) for t in (b.q, b.k, b.v)]
        do = pad(b, b.do)
        mask = b.key_mask if name == "sdpa_cudnn" and not case.causal else None

        def run() -> Sequence[torch.Tensor]:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], attn_mask=mask,
                                                     is_causal=case.causal)
            if not backward:
                return (unpad(b, out),)
            return tuple(unpad(b, g) for g in torch.autograd.grad(out, leaves, do))

        return run
    return factory


def sdpa_njt(b: Batch, case: Case, backward: bool) -> Callable[[], Sequence[torch.Tensor]]:
    """SDPA on nested jagged tensors: (batch, jagged seqlen, heads, d) transposed to SDPA's heads-first layout."""
    offsets = b.cu.long()
    leaves = [t.detach().requires_grad_(backward) for t in (b.q, b.k, b.v)]
    do = torch.nested.nested_tensor_from_jagged(b.do, offsets).transpose(1, 2)

    def run() -> Sequence[torch.Tensor]:
        nested = [torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in leaves]
        out = F.scaled_dot_product_attention(nested[0], nested[1], nested[2], is_causal=case.causal)
        if not backward:
            return (out.transpose(1, 2).values(),)
        return torch.autograd.grad(out, leaves, do)

    return run


FACTORIES: dict[str, Any] = {"lt_varlen": lt_varlen(False), "lt_varlen_api": lt_varlen(True), "lt_dense": lt_dense,
                             "sdpa_flash": sdpa("sdpa_flash"), "sdpa_cudnn": sdpa("sdpa_cudnn"),
                             "sdpa_njt": sdpa_njt}


def by_design_unchecked(provider: str, case: Case) -> bool:
    """A padded batch without a key mask attends the padding in a full (non-causal) call: not the same answer."""
    return provider in ("lt_dense", "sdpa_flash") and not case.causal


# ---------------------------------------------------------------------------
# Checking and timing


class Reference(NamedTuple):
    rows: list[tuple[int, int, int]]  # (sequence, first row, length) of the sequences checked
    exact: list[tuple[torch.Tensor, ...]]  # per sequence: out, or dq, dk, dv (float64)
    base: list[tuple[float, ...]]  # the same-dtype math's max errors


def reference(b: Batch, case: Case, backward: bool) -> Reference:
    """FlashAttention's rule's two references, on head 0 of the shortest and the longest sequence."""
    order = sorted(range(len(case.lengths)), key=lambda i: case.lengths[i])
    rows = [(i, int(b.cu[i]), case.lengths[i]) for i in dict.fromkeys((order[0], order[-1]))]
    exact, base = [], []
    for _, start, n in rows:
        parts = [t[start:start + n, :1].transpose(0, 1)[None] for t in (b.q, b.k, b.v, b.do)]

        def math(dtype: torch.dtype, parts: list[torch.Tensor] = parts) -> tuple[torch.Tensor, ...]:
            q, k, v = (t.detach().to(dtype).requires_grad_(backward) for t in parts[:3])
            out = attention_reference(q, k, v, causal=case.causal)[0]
            return torch.autograd.grad(out, (q, k, v), parts[3].to(dtype)) if backward else (out,)

        want = math(torch.float64)
        same = math(DTYPE)
        exact.append(want)
        base.append(tuple(float((s.double() - w).abs().max()) for s, w in zip(same, want, strict=True)))
    return Reference(rows, exact, base)


def check(got: Sequence[torch.Tensor], ref: Reference) -> tuple[bool, float, str]:
    """(passes FlashAttention's rule, worst relative error, what failed) for packed results (out, or dq, dk, dv)."""
    ok, worst, notes = True, 0.0, []
    for (seq, start, n), exact, base in zip(ref.rows, ref.exact, ref.base, strict=True):
        for name, g, x, e in zip(("dq", "dk", "dv") if len(got) == 3 else ("out",), got, exact, base, strict=True):
            part = g[start:start + n, :1].transpose(0, 1)[None].double()
            err = float((part - x).abs().max())
            worst = max(worst, float((part - x).norm() / x.norm().clamp_min(1e-30)))
            if not err <= 2 * e + FLOOR * max(1.0, float(x.abs().max())):
                ok = False
                notes.append(f"{name} of sequence {seq}: max error {err:.2e} > 2 x {e:.2e} + floor")
    return ok, worst, "; ".join(notes)




def measure(case: Case, provider: str, mode: str, b: Batch, ref: Reference, device: torch.device,
            args: argparse.Namespace) -> Result:
    try:
        fn = FACTORIES[provider](b, case, mode != "fwd")
        ok, err, note = check(fn(), ref)
        state = "unchecked" if by_design_unchecked(provider, case) else "ok" if ok else "wrong"
        if state == "unchecked":
            note = "padded batch without a key mask: attends the padding (work only)"
        ms = median_ms(fn, device.type == "cuda", args.warmup, args.reps)
        return Result(case, provider, mode, ms, err, state, note)
    except Exception as exc:  # a backend this torch/GPU lacks is reported, not fatal
        text = str(exc).strip().splitlines()
        return Result(case, provider, mode, None, None, "failed",
                      f"{type(exc).__name__}: {text[0][:160] if text else ''}")
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def prewarm(case_list: Sequence[Case], device: torch.device, jobs: int) -> str:
    """Compile every lazytriton variant of the run in ``jobs`` processes into an image the run is served from."""
    from lazytriton import config
    from lazytriton.prewarm.builder import build
    from lazytriton.prewarm.enumeration import Planned

    target = machine.target_of_device(device)
    chosen = {}
    for case in case_list:
        # The bindings' alignment rules: pointers and strides are aligned here (hidden 2048) (ALIGN16); the
        # dense backward's SEQ16 follows from the padded length (bwd.variants), a packed call never has it.
        m = max(case.lengths)
        dense = fwd.Shape(1, case.heads, case.heads, m, m, case.head_dim)
        for v in (fwd.variant(target, DTYPE, dense, case.causal, True, False),
                  *bwd.variants(target, DTYPE, dense, case.causal, True, False),
                  *(dispatch.kernel_variant(k, target, "bf16", case.head_dim, case.causal, True, m, m, varlen=True)
                    for k in ("flash_fwd", *bwd_dispatch.BWD_KERNELS))):
            chosen[v.key()] = v
    folder = tempfile.mkdtemp(prefix="lt-bench-varlen-")
    atexit.register(shutil.rmtree, folder, True)
    image = Path(folder) / "bench_varlen.ltimg"
    report = build([Planned(v, key, "bench_varlen") for key, v in chosen.items()], image, jobs, stream=sys.stderr)
    if report.image is not None:
        config.configure(images=[image, *config.settings().images])
    return f"prewarm: {len(chosen)} variants, {report.compiled} compiled, {report.seconds:.1f} s, {jobs} processes"


# ---------------------------------------------------------------------------
# Report

MARKS = {"ok": "", "wrong": "*", "unchecked": "?"}


def print_table(results: Sequence[Result]) -> None:
    """Per case and mode: each provider's TFLOP/s (real tokens), then lt_varlen's speedup over each (peer ms / ours)."""
    by = {(r.case, r.mode, r.provider): r for r in results}
    names = list(dict.fromkeys(r.provider for r in results))
    peers = [n for n in names if n != "lt_varlen"]
    for mode in MODES:
        print(f"\nTFLOP/s on real tokens ({mode})".ljust(26) + "".join(f"{n:>14}" for n in names)
              + "".join(f"{'x ' + p:>16}" for p in peers))
        for case in dict.fromkeys(r.case for r in results):
            cells, ratios = [], []
            for n in names:
                r = by.get((case, mode, n))
                cells.append("-" if r is None else "failed" if r.tflops is None else f"{r.tflops:.0f}{MARKS[r.check]}")
            ours = by.get((case, mode, "lt_varlen"))
            for p in peers:
                r = by.get((case, mode, p))
                if ours is None or r is None or not ours.ms or not r.ms:
                    ratios.append("-")
                else:
                    ratios.append(f"{r.ms / ours.ms:.2f}{MARKS[r.check]}")
            print(f"{case.label:<25}" + "".join(f"{c:>14}" for c in cells) + "".join(f"{x:>16}" for x in ratios))
    bad = {(r.provider, r.mode, r.check, r.note) for r in results if r.check != "ok"}
    if bad:
        print("\nnot ok (* failed the check, timed anyway; ? not the same answer by design, work only):")
        for provider, mode, state, note in sorted(bad):
            print(f"  {provider} {mode} {state}: {note}")


def csv_row(meta: dict[str, str], r: Result) -> dict[str, object]:
    case = r.case
    return {**meta, "provider": r.provider, "mode": r.mode, "dtype": "bf16", "head_dim": case.head_dim,
            "causal": case.causal, "batch": len(case.lengths), "heads": case.heads, "max_seqlen": max(case.lengths),
            "tokens": sum(case.lengths), "p50_ms": "" if r.ms is None else f"{r.ms:.4f}",
            "tflops": "" if r.tflops is None else f"{r.tflops:.1f}",
            "rel_err": "" if r.rel_err is None or math.isnan(r.rel_err) else f"{r.rel_err:.1e}", "check": r.check}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "varlen.csv")
    parser.add_argument("--quick", action="store_true", help="head dim 128 and causal only, 8 sequences")
    parser.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    parser.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--prewarm-jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny batch on CPU through the interpreter (CI)")
    args = parser.parse_args(argv)
    if args.sequences < 1 or args.reps < 1 or args.warmup < 0 or not all(
            1 <= d <= geometry.MAX_HEAD_DIM for d in args.head_dims):
        parser.error("--sequences and --reps must be >= 1, --warmup >= 0, head dims in 1..256")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run; exit status 1 if lt_varlen failed or failed its check, 2 without a GPU."""
    args = parse_args(argv)
    logging.getLogger("torch.nested").setLevel(logging.ERROR)  # why each backend refused, per call: in the table
    causals = {"both": [False, True], "causal": [True], "full": [False]}[args.causal]
    if args.cpu_smoke:
        device = torch.device("cpu")
        case_list = [Case(32, causal, (5, 17, 9), 2) for causal in causals]
        args.warmup, args.reps, args.prewarm_jobs = 0, 1, 0
    else:
        if not torch.cuda.is_available():
            print("bench_varlen needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        if args.quick:
            args.head_dims, causals, args.sequences = [128], [True], 8
        case_list = cases(args.head_dims, causals, lengths_of(args.sequences))
    if args.prewarm_jobs > 0:
        print(prewarm(case_list, device, args.prewarm_jobs), flush=True)
    meta = run_meta("flash_varlen", device)
    results = []
    for index, case in enumerate(case_list):
        b = make_batch(case, device, seed=1000 + index)
        for mode in MODES:
            ref = reference(b, case, mode != "fwd")
            for provider in PROVIDERS:
                r = measure(case, provider, mode, b, ref, device, args)
                shown = f"{r.ms:.3f} ms {r.tflops:.0f} TFLOP/s" if r.ms is not None and r.tflops else ""
                print(f"{case.label}  {mode:<7} {provider:<13} {r.check:<9} {shown} {r.note}".rstrip(), flush=True)
                results.append(r)
        append_rows(args.csv, FIELDS, [csv_row(meta, r) for r in results if r.case == case])
    print_table(results)
    ours = [r for r in results if r.provider == "lt_varlen"]
    return 0 if all(r.check == "ok" for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
