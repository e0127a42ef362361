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
lazytriton/cli/tune/flash_bwd.py); --kernel flash_bwd_dq tunes one of them only.

The decoding kernels (--kernel flash_decode: flash_decode_split and
flash_decode_combine) are tuned over a grid of serving shapes instead of
seqlen pairs: one query per sequence, --heads (query/key-value heads),
--lengths (cache lengths), --batches and --layouts (contiguous, paged with
--page-size keys a page); each row serves every batch and layout of its
bucket (see lazytriton/cli/tune/flash_decode.py). --causal and --pairs do not
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
import importlib
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from lazytriton import geometry, machine, tuning
from lazytriton.cli.tune import common
from lazytriton.target import Target

DEFAULT_PAIRS = ((16, 4096), (128, 128), (1024, 1024), (4096, 4096), (16384, 16384))


CAUSAL_MODES = geometry.CAUSAL_MODES  # prewarm's and cache explain's spelling
# "causal" is prewarm's alias of top_left; "both" (none,top_left) is read too, unlisted, for scripts that pass it.
_CAUSAL_ALIASES = {"causal": "top_left", "both": "none,top_left"}


def causal_flags(text: str) -> tuple[bool, ...]:
    """The causal flags of the rows to tune for ``--causal`` (argparse type): comma-separated causal modes."""
    flags = []
    for item in common.csv_list(text):
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
    values = common.csv_list(text)
    bad = [v for v in values if v not in ("bf16", "fp16", "fp32", "e4m3")] or ([] if values else [text])
    if bad:
        raise argparse.ArgumentTypeError(f"--dtype must be among bf16, fp16, fp32, e4m3 (the FP8 forward's, flash_fwd "
                                         f"only), got {bad[0]!r}")
    return values


def _head_dims(text: str) -> list[int]:
    values = common.csv_list(text)
    bad = [v for v in values if not v.isdigit() or not 1 <= int(v) <= geometry.MAX_HEAD_DIM] or (
        [] if values else [text])
    if bad:
        raise argparse.ArgumentTypeError(f"--head-dim must be integers in 1..{geometry.MAX_HEAD_DIM}, "
                                         f"got {bad[0]!r}")
    return [int(v) for v in values]


def _pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in common.csv_list(text):
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
TUNED = ("flash_fwd", "flash_bwd", "flash_decode")  # the families with a tuner here (cli/tune/<family>.py)


def build_parser() -> argparse.ArgumentParser:
    """The ``lazytriton tune`` parser: every flag is checked here, before anything needs a GPU."""
    parser = argparse.ArgumentParser(prog="lazytriton tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", type=_kernels, default=("flash_fwd",),
                        help="kernel families or kernels to tune, comma-separated: flash_fwd (default), flash_bwd "
                             "(= flash_bwd_dq,flash_bwd_dkdv), flash_decode (= flash_decode_split,"
                             "flash_decode_combine: both are tuned together)")
    parser.add_argument("--dtype", type=_dtypes, default=["bf16", "fp16"],
                        help="comma-separated: bf16, fp16, fp32, e4m3 (the FP8 forward's tiles: flash_fwd only)")
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
    for family in TUNED:  # each family's own flags, in an argument group of its own
        add_arguments = getattr(family_tuner(family), "add_arguments", None)
        if add_arguments is not None:
            add_arguments(parser)
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
                masks = causal if getattr(family_tuner(family), "CAUSAL_APPLIES", True) else (False,)
                for c in masks:
                    group = tune_family_group(family, kernels, target, dtype, head_dim, c, args, gpu)
                    rows += group
                    common.save_rows(path, group)  # after each group: a killed run keeps what it measured
        print(f"{family}: {path}")
    print(f"wrote {len(rows)} rows ({math.fsum(r.tflops for r in rows) / max(1, len(rows)):.0f} "
          "TFLOP/s on average)")
    return 0


def families_of(kernels: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The chosen kernels grouped by family, in ``FAMILIES`` order (pure): each family has its own table."""
    from lazytriton.kernels import FAMILIES

    return {family: tuple(k for k in members if k in kernels) for family, members in FAMILIES.items()
            if any(k in kernels for k in members)}


def family_tuner(family: str) -> ModuleType:
    """A family's tuner, ``lazytriton.cli.tune.<family>``: its ``tune``, and ``add_arguments`` where it has flags."""
    return importlib.import_module(f"{__name__}.{family}")


def tune_family_group(family: str, kernels: Sequence[str], target: Target, dtype: str, head_dim: int, causal: bool,
                      args: argparse.Namespace, gpu: str) -> list[tuning.Row]:
    """One (dtype, head dim, causal) group of ``family``'s ``kernels``: its tuner's rows."""
    return family_tuner(family).tune(kernels, target, dtype, head_dim, causal, args, gpu)  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
