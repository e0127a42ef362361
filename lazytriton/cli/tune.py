"""lazytriton tune: measure candidate configs on this GPU and write tuning-table rows.

For each kernel family (--kernel flash_fwd, the default, and/or flash_bwd),
each (dtype, head dim, causal) group and each (seqlen_q, seqlen_k) pair,
every candidate config is compiled (in parallel, through the runtime and its
cache, so a rerun compiles nothing), checked against a float32 reference, and
timed (median of event-timed launches of the cached kernels, launched exactly
as a call launches them); the fastest becomes a row of the family's user
tuning table (<cache dir>/tuning/<family>.csv, read over the shipped one by
every call; --table names another file) with its TFLOP/s, the GPU's name and
the date. Rows for other groups are kept. Shapes follow FlashAttention's
benchmarks: hidden 2048 and batch x seqlen = 16k tokens.

The backward's two kernels (flash_bwd_dq, flash_bwd_dkdv) get a row each,
each chosen on its own time with the other kernel held fixed (see
lazytriton/cli/tune_bwd.py); --kernel flash_bwd_dq tunes one of them only.

The decoding kernels (--kernel flash_decode: flash_decode_split and
flash_decode_combine) are tuned over a grid of serving shapes instead of
seqlen pairs: one query per sequence, --heads (query/key-value heads),
--lengths (cache lengths), --batches and --layouts (contiguous, paged with
--page-size keys a page); each row serves every batch and layout of its
bucket (see lazytriton/cli/tune_decode.py). --causal and --pairs do not
apply to it. The grid of benchmarks/bench_decode.py, at head dims 64 and 128
(a few minutes on an H200):

    lazytriton tune --kernel flash_decode --dtype bf16 --head-dim 64,128

--causal takes the causal modes of prewarm and cache explain (none,
top_left, bottom_right; causal = top_left). A tuning row's causal is a flag:
top_left and bottom_right run one binary, so either tunes the causal rows,
timed bottom-right aligned (the pairs' seqlen_q <= seqlen_k).

Exit status: 0 done; 1 the work failed (no GPU to time on); 2 a usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lazytriton import geometry, machine, tuning
from lazytriton.cli import tune_compile
from lazytriton.cli.timing import event_ms
from lazytriton.cli.tune_compile import compile_all as compile_all  # re-exported: lazytriton.cli.tune.compile_all
from lazytriton.driver.gpu import DriverError
from lazytriton.fsutil import write_atomically
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

DEFAULT_PAIRS = ((16, 4096), (128, 128), (1024, 1024), (4096, 4096), (16384, 16384))

# Candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit dtypes: the
# sweep of 2026-11-30 on the H200 (bench_flash_fwd.py --sweep) kept these
# families within 10% of the best; BLOCK_M 16 rows serve decode-like calls.
_WIDE = ((128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4),
         (64, 128, 4, 3), (128, 32, 4, 3))
_NARROW = ((16, 64, 4, 3), (16, 128, 4, 3), (16, 32, 4, 3), (16, 64, 4, 4), (16, 128, 8, 3))


def candidates(dtype: str, head_dim: int, seqlen_q: int) -> list[Config]:
    """Configs worth timing for a group (pure)."""
    base: Sequence[tuple[int, int, int, int]] = _NARROW if seqlen_q <= 16 else _WIDE
    if head_dim >= 256 or dtype == "fp32":  # large tiles do not fit in shared memory: small ones, or 2 stages
        base = list(dict.fromkeys(
            c for w in base for c in ((w, (*w[:3], 2)) if w[0] * w[1] <= 64 * 64 else ((*w[:3], 2),))
            if c[0] * c[1] <= 128 * 64))
    configs = [Config(*c) for c in base if c[0] <= max(16, tuning.bucket(seqlen_q))]
    return configs or [Config(16, 32, 4, 2)]


def fitting(variants: Sequence[Variant]) -> list[Variant]:
    """The variants whose tiles fit their target's shared memory (prewarm's estimate), in order (pure)."""
    from lazytriton.prewarm.limits import refusal

    return [v for v in variants if refusal(v) is None]


def write_table(path: Path, table: tuning.Table) -> None:
    """Write the CSV atomically (temp file, then rename)."""
    write_atomically(path, [table.to_csv().encode()])


def _reference(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """Float32 reference output of the first batch element's first two heads."""
    from lazytriton.kernels.flash_fwd.reference import attention_reference

    mode = "bottom_right" if causal else False
    return attention_reference(q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), causal=mode)[0]


def _time_variant(variant: Variant, q: Any, k: Any, v: Any, causal: bool, ref: Any, reps: int) -> tuple[float, float]:
    """(median ms, relative error against ``ref``) of the cached kernel for ``variant``, launched as a call is."""
    from lazytriton.kernels.flash_fwd import binding

    # Causal calls with seqlen_q < seqlen_k (decode, chunked prefill) are bottom-right aligned.
    call = binding.check(q, k, v, "bottom_right" if causal else False, None)
    out, lse = binding.empty_outputs(q, call.shape)

    def launch() -> None:
        binding.launch_gpu(q, k, v, out, lse, call, variant)

    launch()
    err = float((out[:1, :2].float() - ref).norm() / ref.norm())
    return event_ms(launch, reps=reps), err


def tune_group(target: Target, dtype: str, head_dim: int, causal: bool, pairs: Sequence[tuple[int, int]],
               jobs: int, reps: int, gpu: str) -> list[tuning.Row]:
    """Rows for one group: the fastest correct candidate per seqlen pair."""
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    plans = {(sq, sk): fitting([fwd_dispatch.flash_fwd_variant(target, dtype, head_dim, causal, True, sq, config=c,
                                                               seqlen_k=sk) for c in candidates(dtype, head_dim, sq)])
             for sq, sk in pairs}
    failures = tune_compile.compile_all([v for vs in plans.values() for v in vs], jobs)
    rows = []
    today = dt.date.today().isoformat()
    for (sq, sk), variants in plans.items():
        # 16k tokens of the longer side: (16, 4096) is 4 batches of decode-like calls,
        # and no tensor reaches 2**31 elements (the variants are compiled with INDEX64=false).
        heads, batch = 2048 // head_dim, max(1, 16384 // max(sq, sk))
        q = torch.randn(batch, heads, sq, head_dim, device="cuda", dtype=torch_dtype)
        k, v = (torch.randn(batch, heads, sk, head_dim, device="cuda", dtype=torch_dtype) for _ in range(2))
        pairs_seen = sq * sk - sq * sq / 2 if causal else sq * sk  # bottom-right mask, seqlen_q <= seqlen_k
        flops = 4 * batch * heads * head_dim * pairs_seen
        ref = _reference(q, k, v, causal)
        best: tuple[float, Variant] | None = None
        for variant in variants:
            if str(variant) in failures:
                continue
            try:
                ms, err = _time_variant(variant, q, k, v, causal, ref, reps)
            except DriverError as exc:  # e.g. more shared memory than the estimate said: not a candidate
                print(f"  skipped {variant.tuned} {dict(variant.options)}: {exc}", file=sys.stderr)
                continue
            tflops = flops / ms / 1e9
            if err < 2e-2 and (best is None or tflops > best[0]):
                best = (tflops, variant)
        if best is None:
            print(f"  no candidate worked for {dtype} hd{head_dim} causal={causal} {sq}x{sk}", file=sys.stderr)
            continue
        tflops, variant = best
        row_head_dim = head_dim if dict(variant.functional).get("BLOCK_D2") else geometry.padded_head_dim(head_dim)
        rows.append(tuning.Row(str(target), "flash_fwd", dtype, row_head_dim, causal,
                               tuning.bucket(sq), tuning.bucket(sk), int(variant.get("BLOCK_M")),
                               int(variant.get("BLOCK_N")), int(variant.get("num_warps")),
                               int(variant.get("num_stages")), 0, round(tflops, 1), gpu, today))
        print(f"  {dtype} hd{head_dim} causal={causal} {sq}x{sk}: {variant.tuned} {dict(variant.options)} "
              f"{tflops:.0f} TFLOP/s")
    return rows


def _csv_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


CAUSAL_MODES = geometry.CAUSAL_MODES  # prewarm's and cache explain's spelling
# "causal" is prewarm's alias of top_left; "both" (none,top_left) is read too, unlisted, for scripts that pass it.
_CAUSAL_ALIASES = {"causal": "top_left", "both": "none,top_left"}


def causal_flags(text: str) -> tuple[bool, ...]:
    """The causal flags of the rows to tune for ``--causal`` (argparse type): comma-separated causal modes."""
    flags = []
    for item in _csv_list(text):
        alias = _CAUSAL_ALIASES.get(item.lower())
        if alias is not None:
            print(f"tune: --causal {item} read as {alias}", file=sys.stderr)
        for mode in (alias or item.lower()).split(","):
            if mode not in CAUSAL_MODES:
                raise argparse.ArgumentTypeError(f"--causal must be among {', '.join(CAUSAL_MODES)} "
                                                 f"(or causal, an alias of top_left), got {item!r}")
            flags.append(mode != "none")
    if not flags:
        raise argparse.ArgumentTypeError(f"--causal must be among {', '.join(CAUSAL_MODES)}, got {text!r}")
    return tuple(dict.fromkeys(flags))


def _dtypes(text: str) -> list[str]:
    values = _csv_list(text)
    bad = [v for v in values if v not in ("bf16", "fp16", "fp32")] or ([] if values else [text])
    if bad:
        raise argparse.ArgumentTypeError(f"--dtype must be among bf16, fp16, fp32, got {bad[0]!r}")
    return values


def _head_dims(text: str) -> list[int]:
    values = _csv_list(text)
    bad = [v for v in values if not v.isdigit() or not 1 <= int(v) <= geometry.MAX_HEAD_DIM] or (
        [] if values else [text])
    if bad:
        raise argparse.ArgumentTypeError(f"--head-dim must be integers in 1..{geometry.MAX_HEAD_DIM}, "
                                         f"got {bad[0]!r}")
    return [int(v) for v in values]


def _pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in _csv_list(text):
        q, _, k = item.partition("x")
        if not (q.isdigit() and k.isdigit() and int(q) > 0 and int(k) > 0):
            raise argparse.ArgumentTypeError(f"--pairs items must look like 4096x4096 (positive seqlen_q x "
                                             f"seqlen_k), got {item!r}")
        pairs.append((int(q), int(k)))
    if not pairs:
        raise argparse.ArgumentTypeError(f"--pairs: expected pairs like 4096x4096, got {text!r}")
    return pairs


def _kernels(text: str) -> tuple[str, ...]:
    from lazytriton.prewarm.enumeration import parse_kernels

    try:
        kernels = parse_kernels(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    untunable = [k for k in kernels if k in UNTUNED]
    if untunable:
        raise argparse.ArgumentTypeError(f"{', '.join(untunable)} has no tiles to tune (one config: a copy); "
                                         "tunable: flash_fwd, flash_bwd, flash_decode")
    return kernels


UNTUNED = ("kv_append",)  # kernels whose one config serves every call


def build_parser() -> argparse.ArgumentParser:
    """The ``lazytriton tune`` parser: every flag is checked here, before anything needs a GPU."""
    parser = argparse.ArgumentParser(prog="lazytriton tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", type=_kernels, default=("flash_fwd",),
                        help="kernel families or kernels to tune, comma-separated: flash_fwd (default), flash_bwd "
                             "(= flash_bwd_dq,flash_bwd_dkdv), flash_decode (= flash_decode_split,"
                             "flash_decode_combine: both are tuned together)")
    parser.add_argument("--dtype", type=_dtypes, default=["bf16", "fp16"], help="comma-separated: bf16, fp16, fp32")
    parser.add_argument("--head-dim", type=_head_dims, default=[64, 128], help="comma-separated head dims")
    parser.add_argument("--causal", type=causal_flags, action="extend",
                        help="none,top_left,bottom_right (default: none and causal; both causal modes tune one "
                             "row; causal = top_left)")
    parser.add_argument("--pairs", type=_pairs, default=list(DEFAULT_PAIRS),
                        help="comma-separated seqlen_q x seqlen_k pairs, default "
                             f"{','.join(f'{q}x{k}' for q, k in DEFAULT_PAIRS)}")
    parser.add_argument("--table", type=Path, default=None,
                        help="the CSV to update (default: the family's user table, <cache dir>/tuning/<family>.csv "
                             "(flash_fwd.csv, flash_bwd.csv), which calls read over the shipped one; the shipped "
                             "tables are kernels/<family>/tuning.csv)")
    _decode_args(parser)
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--reps", type=int, default=20)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("lazytriton tune: no GPU here (torch.cuda.is_available() is False); tune times kernels on the GPU "
              "it runs on", file=sys.stderr)
        return 1
    target = machine.target_of_device(torch.cuda.current_device())
    gpu = torch.cuda.get_device_name()
    causal = tuple(dict.fromkeys(args.causal)) if args.causal else (False, True)
    rows: list[tuning.Row] = []
    for family, kernels in families_of(args.kernel).items():
        path = args.table or tuning.user_table_path(family)
        path.parent.mkdir(parents=True, exist_ok=True)
        for dtype in args.dtype:
            for head_dim in args.head_dim:
                for c in ((False,) if family == "flash_decode" else causal):  # decoding: one query, never masked
                    group = tune_family_group(family, kernels, target, dtype, head_dim, c, args.pairs, args, gpu)
                    rows += group
                    save_rows(path, group)  # after each group: a killed run keeps what it measured
        print(f"{family}: {path}")
    print(f"wrote {len(rows)} rows ({math.fsum(r.tflops for r in rows) / max(1, len(rows)):.0f} "
          "TFLOP/s on average)")
    return 0


def _ints(text: str) -> list[int]:
    """Comma-separated positive ints, 4k = 4096 (argparse type)."""
    try:
        values = [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in _csv_list(text)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (4k = 4096), got {text!r}")
    return values


def _heads(text: str) -> list[tuple[int, int]]:
    """Comma-separated heads_q/heads_k pairs, heads_q a multiple of heads_k (argparse type)."""
    pairs = []
    for item in _csv_list(text):
        q, _, k = item.partition("/")
        if not (q.isdigit() and k.isdigit() and int(k) > 0 and int(q) % int(k) == 0):
            raise argparse.ArgumentTypeError(f"--heads items must look like 32/8 (query heads a multiple of "
                                             f"key/value heads), got {item!r}")
        pairs.append((int(q), int(k)))
    if not pairs:
        raise argparse.ArgumentTypeError(f"--heads: expected pairs like 32/8, got {text!r}")
    return pairs


def _layouts(text: str) -> list[str]:
    values = _csv_list(text)
    if not values or not set(values) <= {"contiguous", "paged"}:
        raise argparse.ArgumentTypeError(f"--layouts: expected a subset of contiguous,paged, got {text!r}")
    return values


def _page_size(text: str) -> int:
    if not text.isdigit() or int(text) < 16 or int(text) % 16:
        raise argparse.ArgumentTypeError(f"--page-size must be a positive multiple of 16, got {text!r}")
    return int(text)


def _decode_args(parser: argparse.ArgumentParser) -> None:
    """The decoding grid's flags (--kernel flash_decode); defaults are bench_decode.py's grid."""
    from lazytriton.cli import tune_decode as td

    group = parser.add_argument_group("flash_decode's grid")
    group.add_argument("--batches", type=_ints, default=list(td.DEFAULT_BATCHES), help="default 1,8,32,64")
    group.add_argument("--lengths", type=_ints, default=list(td.DEFAULT_LENGTHS),
                       help="cache lengths, default 1k,4k,16k,32k")
    group.add_argument("--layouts", type=_layouts, default=["contiguous", "paged"])
    group.add_argument("--heads", type=_heads, default=list(td.DEFAULT_HEADS),
                       help="query/key-value heads, default 32/8 (each group size is a table bucket)")
    group.add_argument("--page-size", type=_page_size, default=td.DEFAULT_PAGE, help="keys per page, default 256")
    group.add_argument("--splits-report", action="store_true",
                       help="also time forced split counts with the winners and print the heuristic's distance")


def families_of(kernels: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The chosen kernels grouped by family, in ``FAMILIES`` order (pure): each family has its own table."""
    from lazytriton.kernels import FAMILIES

    return {family: tuple(k for k in members if k in kernels) for family, members in FAMILIES.items()
            if any(k in kernels for k in members)}


def save_rows(path: Path, rows: Sequence[tuning.Row]) -> None:
    """Merge ``rows`` into the table at ``path`` (rows of other groups and kernels kept) and write it atomically."""
    old = tuning.Table.parse(path.read_text(), str(path.name)) if path.exists() else tuning.Table(())
    write_table(path, tuning.merge(old, rows))


def tune_family_group(family: str, kernels: Sequence[str], target: Target, dtype: str, head_dim: int, causal: bool,
                      pairs: Sequence[tuple[int, int]], args: argparse.Namespace, gpu: str) -> list[tuning.Row]:
    if family == "flash_fwd":
        return tune_group(target, dtype, head_dim, causal, pairs, args.jobs, args.reps, gpu)
    if family == "flash_decode":
        import torch

        from lazytriton.cli import tune_decode
        from lazytriton.kernels.flash_decode import binding

        cases = tune_decode.grid(dtype, head_dim, args.heads, args.batches, args.lengths, args.layouts,
                                 args.page_size)
        slots = binding.gpu_slots(torch.cuda.current_device())
        return tune_decode.tune_group(target, dtype, head_dim, cases, args.jobs, args.reps, gpu, slots,
                                      args.splits_report)
    from lazytriton.cli import tune_bwd

    return tune_bwd.tune_group(target, dtype, head_dim, causal, pairs, args.jobs, args.reps, gpu, kernels)


if __name__ == "__main__":
    sys.exit(main())
