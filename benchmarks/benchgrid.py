"""The grid bench_flash_fwd.py and bench_flash_bwd.py share: its cases, the flags that filter them, the prewarm.

FlashAttention's benchmark shapes: bf16/fp16 x head dim x causal or not x
seqlen, with batch x seqlen = 16k tokens and heads x head dim = 2048 (heads
rounded down where the head dim does not divide it).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lazytriton import geometry, machine
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS, HIDDEN = 16384, 2048
CAUSALS = {"both": [False, True], "full": [False], "causal": [True]}


class Case(NamedTuple):
    """One shape of the grid, in SDPA's (batch, heads, seqlen, head_dim) layout."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int

    @property
    def fwd_flops(self) -> float:
        return 4 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim / (2 if self.causal else 1)

    @property
    def label(self) -> str:
        size = f"{self.seqlen // 1024}k" if self.seqlen % 1024 == 0 else str(self.seqlen)
        return f"{self.dtype} hd{self.head_dim:<3} {'causal' if self.causal else 'full  '} {size:>3}"


def cases(dtypes: Sequence[str], head_dims: Sequence[int], causals: Sequence[bool], seqlens: Sequence[int],
          tokens: int = TOKENS, hidden: int = HIDDEN) -> list[Case]:
    """The grid: batch x seqlen = ``tokens``, heads x head dim = ``hidden``."""
    return [Case(dtype, d, causal, s, max(1, tokens // s), max(1, hidden // d))
            for dtype in dtypes for d in head_dims for causal in causals for s in seqlens]


def list_arg(flag: str, parse: Callable[[str], Any], allowed: Callable[[Any], bool], expected: str) -> Any:
    """An argparse type: a non-empty comma-separated list, each item parsed and allowed, else an error naming it."""
    def convert(text: str) -> list[Any]:
        try:
            values = [parse(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError:
            values = []
        if not values or not all(allowed(value) for value in values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected {expected}")
        return values

    return convert


def parse_seqlen(item: str) -> int:
    return int(item[:-1]) * 1024 if item.lower().endswith("k") else int(item)


def add_grid_arguments(parser: argparse.ArgumentParser, providers: Sequence[str]) -> None:
    """--quick, --dtypes, --head-dims, --seqlens, --causal, --providers (a subset of ``providers``), --prewarm-jobs."""
    parser.add_argument("--quick", action="store_true", help="seqlens 1k and 4k only (unless --seqlens is given)")
    parser.add_argument("--dtypes", type=list_arg("--dtypes", str, DTYPES.__contains__,
                                                  f"a comma-separated subset of {list(DTYPES)}"),
                        default=list(DTYPES), help="bf16,fp16 (default both)")
    parser.add_argument("--head-dims", type=list_arg("--head-dims", int, lambda d: 1 <= d <= geometry.MAX_HEAD_DIM,
                                                     f"comma-separated head dims in 1..{geometry.MAX_HEAD_DIM}"),
                        default=[64, 128, 256], help="default 64,128,256")
    parser.add_argument("--seqlens", type=list_arg("--seqlens", parse_seqlen, lambda s: s >= 1,
                                                   "comma-separated positive seqlens (1024 or 1k)"),
                        default=None, help="e.g. 1k,4k,16k (default; --quick: 1k,4k)")
    parser.add_argument("--causal", choices=tuple(CAUSALS), default="both")
    parser.add_argument("--providers", type=list_arg("--providers", str, providers.__contains__,
                                                     f"a comma-separated subset of {tuple(providers)}"),
                        default=list(providers), help=f"a subset of {','.join(providers)} (default all)")
    parser.add_argument("--prewarm-jobs", type=int, default=os.cpu_count() or 1,
                        help="compile lazytriton's variants of every case first, in this many processes, into an "
                             "image the run is served from (0: compile each just in time)")


def parse_grid(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``seqlens`` filled in (--quick's or the default) where not given."""
    args = parser.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = [1024, 4096] if args.quick else [1024, 4096, 16384]
    return args


def grid_of(args: argparse.Namespace) -> list[Case]:
    """The cases the parsed grid flags select."""
    return cases(args.dtypes, args.head_dims, CAUSALS[args.causal], args.seqlens)


def prewarm(case_list: Sequence[Case], device: torch.device, jobs: int, say: Callable[[str], None],
            backward: bool) -> None:
    """Compile lazytriton's variants of every case in ``jobs`` processes, into an image this run is served from.

    The forward's variants, and with ``backward`` the backward's too. Only to
    save time (the runtime compiles one at a time): a variant left out, or a
    failed build, is compiled just in time by the first call.
    """
    from lazytriton import config
    from lazytriton.kernels.flash_bwd import binding as bwd
    from lazytriton.kernels.flash_fwd import binding as fwd
    from lazytriton.prewarm.builder import build
    from lazytriton.prewarm.enumeration import Planned

    target = machine.target_of_device(device)
    chosen = {}
    for case in case_list:
        dtype = DTYPES[case.dtype]
        shape = fwd.Shape(case.batch, case.heads, case.heads, case.seqlen, case.seqlen, case.head_dim)
        # The Gluon kernels where dispatch serves them (their tables; equal seqlens, so causal offset 0)
        fwd_gluon = fwd_dispatch.flash_fwd_gluon_fits(case.dtype, case.head_dim, case.causal, 0,
                                                      case.head_dim ** -0.5, case.seqlen, case.seqlen)
        chosen_here = [fwd.variant(target, dtype, shape, case.causal, True, False, gluon=fwd_gluon)]
        if backward:
            bwd_gluon = bwd_dispatch.flash_bwd_gluon_fits(case.dtype, case.head_dim, case.causal, 0, case.seqlen,
                                                          case.seqlen)
            chosen_here += bwd.variants(target, dtype, shape, case.causal, True, False, gluon=bwd_gluon)
        for variant in chosen_here:
            chosen[variant.key()] = variant
    plan = [Planned(variant, key, "bench_grid") for key, variant in chosen.items()]
    folder = tempfile.mkdtemp(prefix="lt-bench-")
    atexit.register(shutil.rmtree, folder, True)
    image = Path(folder) / "bench_grid.ltimg"
    report = build(plan, image, jobs, stream=sys.stderr)
    if report.image is not None:
        config.configure(images=[image, *config.settings().images])
    say(f"prewarm: {len(plan)} variants, {report.compiled} compiled, {len(report.failures)} failed, "
        f"{report.seconds:.1f} s with {jobs} processes{'' if report.image else ' (no image: compiled just in time)'}")
